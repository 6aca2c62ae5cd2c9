"""``trainer.loggers``: the same step scalars and the resolved config reach TensorBoard, wandb
(offline) and MLflow (the SQLite store in the run directory), read back through each library's
own reader; a resumed run continues the same wandb and MLflow runs; a missing package is a
config error naming the key. No network: wandb runs offline."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ragen_mega.config import load_run_config
from ragen_mega.config_tree import ConfigError
from ragen_mega.logging import RunLogger
from ragen_mega.trackers import IDS_FILE
from tracker_readers import mlflow_client, mlflow_history, wandb_runs

ALL = ["tensorboard", "wandb", "mlflow"]
#: a user's env file as env tag puts a path into a metric name; MLflow takes it without the
#: empty path part (its own validator refuses "//")
PATH_METRIC, PATH_METRIC_IN_MLFLOW = ("rollout//tmp/envs/coin.py:Coin/success",
                                      "rollout/tmp/envs/coin.py:Coin/success")
CONFIG = {"actor": {"lr": 1e-6, "tp": 2}, "env": {"name": "bandit", "kwargs": {"arms": [1, 2]}},
          "trainer": {"loggers": ALL, "ray_address": None},
          "agent": {"system_prompt": "x" * 7000}}   # beyond MLflow's 6000-character param value


@pytest.fixture()
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)


def run_steps(run_dir: Path, steps: dict[int, dict[str, float]], resume: bool = False) -> str:
    out = io.StringIO()
    logger = RunLogger(run_dir, total_steps=4, stream=out, loggers=ALL, config=CONFIG,
                       resume=resume)
    for step, scalars in steps.items():
        logger.log(step, scalars)
    logger.close()
    return out.getvalue()


def mlflow_runs(run_dir: Path) -> list:
    client = mlflow_client(run_dir)
    experiment = client.get_experiment_by_name("ragen_mega")
    return client.search_runs([experiment.experiment_id])


def test_every_tracker_gets_the_scalars_and_the_config(tmp_path, offline):
    run_dir = tmp_path / "my_run"
    steps = {1: {"rollout/success": 0.25, "actor/entropy": 1.5, PATH_METRIC: 1.0},
             2: {"rollout/success": 0.5, "actor/entropy": 1.25, PATH_METRIC: 0.0}}
    printed = run_steps(run_dir, steps)
    assert printed.splitlines()[0].startswith("step 1/4 | succ 0.25")

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rollout/success")] == [(1, 0.25), (2, 0.5)]

    [run] = wandb_runs(run_dir)
    assert (run["name"], run["project"]) == ("my_run", "ragen_mega")
    assert run["history"] == steps
    assert {k: run["config"][k] for k in CONFIG} == CONFIG

    [mlrun] = mlflow_runs(run_dir)
    client = mlflow_client(run_dir)
    assert mlrun.info.run_name == "my_run" and mlrun.info.status == "FINISHED"
    assert mlflow_history(client, mlrun.info.run_id, "rollout/success") == [(1, 0.25), (2, 0.5)]
    assert mlflow_history(client, mlrun.info.run_id, "actor/entropy") == [(1, 1.5), (2, 1.25)]
    assert mlflow_history(client, mlrun.info.run_id, PATH_METRIC_IN_MLFLOW) == [(1, 1.0),
                                                                               (2, 0.0)]
    params = mlrun.data.params
    assert params["actor.lr"] == "1e-06" and params["actor.tp"] == "2"
    assert params["env.name"] == "bandit" and params["env.kwargs.arms"] == "[1, 2]"
    assert params["trainer.loggers"] == '["tensorboard", "wandb", "mlflow"]'
    assert params["trainer.ray_address"] == "null"
    assert params["agent.system_prompt"] == "x" * 6000   # cut; whole in the artifact
    saved = json.loads(Path(client.download_artifacts(mlrun.info.run_id, "config.json",
                                                      str(tmp_path))).read_text())
    assert saved == CONFIG
    # the artifacts stay in the run directory (not in the working directory's ./mlruns)
    assert (run_dir / "mlflow_artifacts").is_dir() and not Path("mlruns").exists()


def test_a_resumed_run_continues_the_same_wandb_and_mlflow_runs(tmp_path, offline):
    """Steps 1-2, then a resumed start logging 3-4: one MLflow run holding steps 1-4, the
    resumed wandb log under the same run id (wandb sync joins them); a new run in the
    directory (resume=False) starts new ones."""
    run_steps(tmp_path, {1: {"x/loss": 4.0}, 2: {"x/loss": 3.0}})
    ids = json.loads((tmp_path / IDS_FILE).read_text())
    run_steps(tmp_path, {3: {"x/loss": 2.0}, 4: {"x/loss": 1.0}}, resume=True)
    assert json.loads((tmp_path / IDS_FILE).read_text()) == ids

    [mlrun] = mlflow_runs(tmp_path)
    assert mlrun.info.run_id == ids["mlflow"] and mlrun.info.status == "FINISHED"
    assert mlflow_history(mlflow_client(tmp_path), ids["mlflow"], "x/loss") == [
        (1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0)]
    first, resumed = wandb_runs(tmp_path)
    assert first["id"] == resumed["id"] == ids["wandb"]
    assert first["history"] == {1: {"x/loss": 4.0}, 2: {"x/loss": 3.0}}
    assert resumed["history"] == {3: {"x/loss": 2.0}, 4: {"x/loss": 1.0}}

    run_steps(tmp_path, {1: {"x/loss": 5.0}})   # a new run in the same directory
    new_ids = json.loads((tmp_path / IDS_FILE).read_text())
    assert new_ids["wandb"] != ids["wandb"] and new_ids["mlflow"] != ids["mlflow"]
    assert len(mlflow_runs(tmp_path)) == 2
    assert wandb_runs(tmp_path)[-1]["id"] == new_ids["wandb"]


def test_wandb_with_no_mode_and_no_key_logs_offline_and_says_so(tmp_path):
    """No WANDB_MODE, no WANDB_API_KEY, no netrc: offline, one line saying so, no login prompt
    (in a fresh process: wandb keeps its settings per process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / "no_netrc"))
    script = ("import sys; from ragen_mega.logging import RunLogger\n"
              f"logger = RunLogger({str(tmp_path / 'run')!r}, 1, loggers=['wandb'])\n"
              "logger.log(1, {'a/b': 2.0}); logger.close()\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wandb: no WANDB_MODE and no W&B credentials" in done.stdout
    [run] = wandb_runs(tmp_path / "run")
    assert run["history"] == {1: {"a/b": 2.0}}


def test_a_missing_tracker_package_is_a_config_error_naming_the_key(monkeypatch):
    """(A module set to None in sys.modules is one Python cannot import: not installed.)"""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    demo = "examples/bandit_cpu_demo.yaml"
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"trainer\.loggers: wandb needs the Python package\(s\) "
                                          r"wandb, not installed here: pip install wandb"):
        load_run_config(demo, ["trainer.loggers=[tensorboard,wandb]"])
    load_run_config(demo, ["trainer.loggers=[tensorboard,mlflow]"])   # not asked for: no check
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    with pytest.raises(ConfigError, match=r"trainer\.loggers: mlflow needs .* sqlalchemy, not "
                                          r"installed here: pip install mlflow"):
        load_run_config(demo, ["trainer.loggers=[mlflow]"])
    # an MLflow server needs only the client
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert load_run_config(demo, ["trainer.loggers=[mlflow]"]).trainer.loggers == ["mlflow"]
