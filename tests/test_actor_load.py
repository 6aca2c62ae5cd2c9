"""``actor.load``: a fresh run's actor starts from a torch_dist checkpoint saved at another
layout (slime's --load), and the start-up check refuses what it cannot start from, naming the
key. SmolLM2 with perturbed weights is converted at TP3 (``ragen-mega convert``; its 9 heads and
3 KV heads split over 1 or 3 ranks only) and loaded by a TP1 trainer whose ``model.path`` is the
unperturbed SmolLM2: its log-probs, its KL reference and
its first update are those of a trainer built from the perturbed HF directory itself. (The
config reaching the trainer ranks and the engines serving the loaded weights from the first
rollout on: tests/test_train_e2e.py.) Two 1-process launches and one 3-process conversion."""
from __future__ import annotations

import pytest
import torch

from ragen_mega.backends.megatron import checkpoint as ckpt
from ragen_mega.backends.megatron.convert import main as convert_main
from ragen_mega.backends.megatron.launch import run_workers
from ragen_mega.config import load_run_config
from ragen_mega.config_tree import ConfigError
from ragen_mega.preflight import preflight

from conftest import perturbed_copy, policy_batch

#: the update's settings; a KL term, so the reference model is built (from the start weights)
SETTINGS = dict(micro_batch_size=2, lr=1e-3, kl_coef=0.1, kl_kind="k1", lr_warmup_steps=2)


@pytest.fixture(scope="module")
def converted(smollm2_dir, tmp_path_factory):
    """(perturbed HF dir, its TP3 conversion's root)."""
    root = tmp_path_factory.mktemp("actor_load")
    perturbed = perturbed_copy(smollm2_dir, root / "perturbed", scale=0.05)
    assert convert_main(["hf-to-megatron", "--hf-dir", str(perturbed), "--out-dir",
                         str(root / "mcore"), "--tp", "3"]) == 0
    return perturbed, root / "mcore"


def _start_worker(rank, world_size, model_dir, load, batch):
    from ragen_mega.backends.megatron.parallel import init_parallel
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig

    init_parallel(rank, world_size, "", tp=1, pp=1)
    t = MegatronTrainer(ActorConfig(load=load, **SETTINGS), model_dir, total_steps=10)
    out = {"logprobs": t.compute_logprobs(batch), "ref": t.compute_ref_logprobs(batch)}
    out["update"] = t.train(batch)
    out["after"] = t.compute_logprobs(batch)
    out["steps"] = t.steps
    return out


@pytest.fixture(scope="module")
def started(smollm2_dir, converted):
    """(from actor.load with model.path = SmolLM2, from the perturbed HF directory)."""
    from transformers import AutoConfig

    perturbed, mcore = converted
    batch = policy_batch(AutoConfig.from_pretrained(smollm2_dir).vocab_size)
    [loaded] = run_workers(_start_worker, 1, str(smollm2_dir), str(mcore), batch, timeout=900)
    [direct] = run_workers(_start_worker, 1, str(perturbed), None, batch, timeout=900)
    return loaded, direct, batch


def test_a_tp3_conversion_starts_a_tp1_actor_as_its_hf_directory_would(started, smollm2_dir):
    """Same weights, same fp32 arithmetic: the log-probs (policy and KL reference) agree to
    fp32 rounding, and the first update (LR at warm-up step 1 of 2, the first step counted)
    moves both alike: the optimizer and the LR schedule start afresh."""
    from transformers import AutoModelForCausalLM

    loaded, direct, batch = started
    for key in ("logprobs", "ref", "after"):
        torch.testing.assert_close(loaded[key], direct[key], atol=1e-6, rtol=0, msg=key)
    assert loaded["update"] == pytest.approx(direct["update"], rel=1e-6, abs=1e-7)
    assert loaded["update"]["lr"] == pytest.approx(SETTINGS["lr"] / 2)
    assert loaded["steps"] == direct["steps"] == 1
    # the checkpoint's weights are not model.path's: ignoring actor.load would show here
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    with torch.no_grad():
        logp = torch.log_softmax(model(batch["input_ids"]).logits[:, :-1], -1)
    unperturbed = logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    assert (loaded["logprobs"][:, 1:] - unperturbed).abs().max() > 0.05


def test_start_checks_name_actor_load(converted, smollm2_dir, tiny_model, tmp_path):
    """Refused at start-up, naming the key: an HF directory, a directory holding no
    checkpoint (the file it looked for), one whose shard is missing, and a checkpoint of
    another model than ``model.path``'s (the field that differs)."""
    perturbed, mcore = converted

    def check(load, model=smollm2_dir):
        preflight(load_run_config(None, [f"model.path={model}", f"actor.load={load}"]))

    check(mcore)  # the root: its newest step
    check(mcore / "step_0")
    with pytest.raises(ConfigError, match="actor.load: .* is a Hugging Face model directory; "
                                          "give it as model.path"):
        check(perturbed)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=f"actor.load: no complete ragen_mega checkpoint at "
                                          f"or under .*empty .*{ckpt.STATE_FILE}"):
        check(tmp_path / "empty")
    with pytest.raises(ConfigError, match="actor.load: no complete ragen_mega checkpoint"):
        check(tmp_path / "nowhere")
    tiny = tiny_model("qwen2")
    with pytest.raises(ConfigError, match=r"actor.load: .* holds another model than model.path"
                                          r" .*num_layers=30 \(model.path: 2\)"):
        check(mcore, model=tiny)
    with pytest.raises(ConfigError, match="actor.load: full weights .* lora.rank"):
        load_run_config(None, [f"actor.load={mcore}", "actor.lora.rank=4"])


def test_a_missing_shard_is_named(converted, tmp_path):
    import shutil

    _, mcore = converted
    copy = tmp_path / "step_0"
    shutil.copytree(mcore / "step_0", copy)
    shard = sorted((copy / "dist").glob("*.distcp"))[0]
    shard.unlink()
    with pytest.raises(ConfigError, match=f"actor.load: checkpoint .* shard .*{shard.name} is "
                                          f"missing"):
        preflight(load_run_config(None, [f"actor.load={copy}"]))
