"""``model.path`` as a Hugging Face Hub id (``org/name``): its snapshot in the HF cache, found
without a network call; HF_HUB_OFFLINE honoured, and a clear error naming the key when the
model is neither cached nor downloadable. No network: the cache is laid out by hand from a local
model directory, as ``huggingface_hub`` writes it, and the hub's address is a closed local port.
Each case runs in a fresh interpreter, since ``huggingface_hub`` reads its environment
(HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT) once, at import."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

#: resolves ``model.path`` as a run does: the config check, the start-up check, the directory
PROBE = """
import json, sys
from ragen_mega.config import load_run_config
from ragen_mega.config_tree import ConfigError
from ragen_mega.models.prepare import resolve_model
from ragen_mega.preflight import check_model_layout
try:
    cfg = load_run_config(None, ["model.path=" + sys.argv[1]])
except ConfigError as e:
    print(json.dumps({"config_error": str(e)})); sys.exit()
try:
    check_model_layout(cfg)
except ConfigError as e:
    print(json.dumps({"preflight_error": str(e)})); sys.exit()
print(json.dumps({"path": cfg.model.path, "dir": resolve_model(cfg.model.path)}))
"""


def _resolve(repo_id: str, hf_home, offline: bool = False) -> dict:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_ENDPOINT": "http://127.0.0.1:9"}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run([sys.executable, "-c", PROBE, repo_id], env=env, cwd=hf_home.parent,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def cached(tiny_model, tmp_path):
    """(HF_HOME, snapshot dir): ``org/tiny`` cached at revision ``abc123`` as the hub's client
    lays it out (``hub/models--org--tiny/snapshots/<rev>`` and ``refs/main`` naming it)."""
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    shutil.copytree(tiny_model("qwen2"), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    return tmp_path / "hf", snapshot


@pytest.mark.parametrize("offline", [False, True])
def test_a_cached_hub_id_resolves_to_its_snapshot_without_the_hub(cached, offline):
    """Online (the hub a closed port: any call to it would fail) or offline alike, the id
    loads, passes the start-up check and resolves to the snapshot laid out."""
    hf_home, snapshot = cached
    got = _resolve("org/tiny", hf_home, offline=offline)
    assert got == {"path": "org/tiny", "dir": str(snapshot)}


def test_an_uncached_hub_id_offline_is_refused_naming_the_key(cached):
    """Offline and not in the cache: the config is refused at load, naming model.path, the
    cache and HF_HUB_OFFLINE, at once (no network call to wait for). A snapshot without its
    weights is no cached model either."""
    hf_home, snapshot = cached
    start = time.monotonic()
    got = _resolve("org/absent", hf_home, offline=True)
    assert time.monotonic() - start < 60
    message = got["config_error"]
    assert message.startswith("model.path: 'org/absent' is neither a local directory nor a model "
                              f"in the Hugging Face cache ({hf_home / 'hub'})"), message
    assert "HF_HUB_OFFLINE is set" in message
    for weights in snapshot.glob("*.safetensors"):
        weights.unlink()
    message = _resolve("org/tiny", hf_home, offline=True)["config_error"]
    assert f"its snapshot {snapshot} lacks config.json or *.safetensors" in message, message


def test_an_uncached_hub_id_online_is_downloaded_at_start_up(cached):
    """Online, the config loads (a download is the start-up's, not the config's) and the
    start-up check tries the hub: its failure is reported naming the key."""
    hf_home, _ = cached
    message = _resolve("org/absent", hf_home)["preflight_error"]
    assert message.startswith("model.path: 'org/absent' is neither a local directory nor a model "
                              "in the Hugging Face cache"), message
    assert "downloading it failed" in message


def test_a_local_path_is_never_taken_for_a_hub_id(tmp_path, monkeypatch):
    """A relative directory named like an id is the directory; a missing one with more than one
    slash is a missing directory, named as such."""
    from ragen_mega.config import load_run_config
    from ragen_mega.config_tree import ConfigError
    from ragen_mega.models.prepare import is_hub_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert not is_hub_id("org/local") and is_hub_id("org/remote")
    with pytest.raises(ConfigError, match="model.path: 'a/b/c' is not a Hugging Face model "
                                          "directory"):
        load_run_config(None, ["model.path=a/b/c"])
