"""HF <-> Megatron conversion (CLI), torch_dist checkpoints across layouts, optimizer resume, and
atomic saves. Three launches: import at TP2 (2 procs), export at PP2 (2 procs) + everything
else in one 2-process launch, and a 1-process save killed mid-way."""
from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from ragen_mega.backends.megatron import checkpoint as ckpt
from ragen_mega.backends.megatron.convert import main
from ragen_mega.backends.megatron.launch import WorkerError, run_workers

from conftest import policy_batch

TRAIN = dict(micro_batch_size=2, lr=1e-3, lr_warmup_steps=3, lr_decay_style="cosine",
             weight_decay=0.1, grad_clip=1.0)


def _load_dir(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def hf_dir(tiny_model):
    return tiny_model("qwen2", tied=False)  # q/k/v biases and a separate lm_head


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    """HF -> Megatron at TP2 -> HF (exported by a PP2 launch), both through the CLI."""
    root = tmp_path_factory.mktemp("convert")
    assert main(["hf-to-megatron", "--hf-dir", str(hf_dir), "--out-dir", str(root / "mcore"),
                 "--tp", "2"]) == 0
    assert main(["megatron-to-hf", "--megatron-dir", str(root / "mcore"), "--out-dir",
                 str(root / "hf_out"), "--pp", "2"]) == 0
    return root


def test_round_trip_is_bit_exact_and_loadable(hf_dir, converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original, back = _load_dir(hf_dir), _load_dir(converted / "hf_out")
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    model = AutoModelForCausalLM.from_pretrained(converted / "hf_out")
    tok = AutoTokenizer.from_pretrained(converted / "hf_out")
    assert model.config.vocab_size == len(tok) == original["model.embed_tokens.weight"].shape[0]


def test_bad_layout_and_bad_checkpoint_dir_are_refused(hf_dir, tmp_path, capsys):
    assert main(["hf-to-megatron", "--hf-dir", str(hf_dir), "--out-dir", str(tmp_path / "x"),
                 "--tp", "3"]) == 1
    assert "num_attention_heads" in capsys.readouterr().err
    assert main(["megatron-to-hf", "--megatron-dir", str(tmp_path), "--out-dir",
                 str(tmp_path / "y")]) == 1
    assert "no complete ragen_mega checkpoint" in capsys.readouterr().err


def test_config_json_that_is_no_json_is_named_with_line_and_column(tmp_path, capsys,
                                                                   monkeypatch):
    """Both directions read the HF config before any worker starts; a broken one is reported
    with its path and position, not json's bare ``Expecting ',' delimiter``."""
    from ragen_mega.backends.megatron import convert

    def no_workers(*args, **kwargs):
        raise AssertionError("run_workers was called")
    monkeypatch.setattr(convert, "run_workers", no_workers)
    hf = (tmp_path / "hf").resolve()
    hf.mkdir()
    (hf / "config.json").write_text('{"hidden_size": 8\n"num_hidden_layers": 2}\n')
    want = f"ragen-mega convert: error: {hf / 'config.json'} is not valid JSON: line 2, column 1: "
    assert main(["hf-to-megatron", "--hf-dir", str(hf), "--out-dir", str(tmp_path / "x")]) == 1
    assert want + "Expecting ',' delimiter" in capsys.readouterr().err
    step = tmp_path / "mcore" / "step_0"
    step.mkdir(parents=True)
    (step / ckpt.STATE_FILE).write_bytes(b"")  # the config is read before the checkpoint
    assert main(["megatron-to-hf", "--megatron-dir", str(step), "--hf-dir", str(hf),
                 "--out-dir", str(tmp_path / "y")]) == 1
    assert want + "Expecting ',' delimiter" in capsys.readouterr().err
    (hf / "config.json").write_text("[1, 2]")
    assert main(["hf-to-megatron", "--hf-dir", str(hf), "--out-dir", str(tmp_path / "x")]) == 1
    assert f"{hf / 'config.json'} must hold a JSON object, got list" in capsys.readouterr().err


def _ckpt_worker(rank, world_size, hf_dir, other_hf_dir, converted_root, root, batch):
    from ragen_mega.backends.megatron.parallel import init_parallel
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig

    out = {}
    # 1. the TP2-converted checkpoint, loaded at PP2 into a trainer built from random weights
    init_parallel(rank, world_size, "", tp=1, pp=2)
    t = MegatronTrainer(ActorConfig(pp=2, **TRAIN), other_hf_dir, total_steps=10)  # wrong weights first...
    with pytest.raises(ValueError) as err:  # ...and a wrong architecture: refused, field named
        t.load_checkpoint(converted_root, optimizer=False)
    out["mismatch"] = str(err.value)
    del t
    t = MegatronTrainer(ActorConfig(pp=2, **TRAIN), hf_dir, total_steps=10)
    for p in t.model[0].parameters():  # scramble, so the load must restore every weight
        p.data.normal_()
    t.load_checkpoint(converted_root, optimizer=False)
    out["pp2_logprobs"] = t.compute_logprobs(batch)
    out["pp2_weights"] = dict(t.export_hf_state())
    del t

    # 2. save with optimizer after step 1 (distributed optimizer, DP2), resume, compare step 2
    init_parallel(rank, world_size, "", tp=1, pp=1)
    cfg = ActorConfig(use_distributed_optimizer=True, **TRAIN)
    t = MegatronTrainer(cfg, hf_dir, total_steps=10)
    t.train(batch)
    out["saved"] = str(t.save_checkpoint(root, 1, extra={"cursor": 7, "rank0": rank == 0}))
    out["uninterrupted"] = [t.train(batch) for _ in range(2)]
    out["uninterrupted_weights"] = dict(t.export_hf_state())
    del t
    t = MegatronTrainer(cfg, hf_dir, total_steps=10)
    out["extra"] = t.load_checkpoint(root)
    out["resumed_steps"] = t.steps
    out["resumed"] = [t.train(batch) for _ in range(2)]
    out["resumed_weights"] = dict(t.export_hf_state())

    # 3. an exception inside the commit leaves only a temp dir behind
    original = ckpt.commit_dir

    def crash(*args):
        raise RuntimeError("simulated crash before commit")

    ckpt.commit_dir = crash
    try:
        t.save_checkpoint(root, 3)
    except RuntimeError as err:  # on every rank: rank 0 tells the others
        out["crashed"] = str(err)
    finally:
        ckpt.commit_dir = original
    return out


@pytest.fixture(scope="module")
def resumed(hf_dir, tiny_model, converted, tmp_path_factory):
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("ckpt")
    other = tiny_model("qwen2", tied=True, num_layers=4)
    batch = policy_batch(AutoConfig.from_pretrained(hf_dir).vocab_size)
    results = run_workers(_ckpt_worker, 2, str(hf_dir), str(other), str(converted / "mcore"),
                          str(root), batch, timeout=900)
    return results, root, batch


def test_tp2_checkpoint_loads_at_pp2(hf_dir, resumed):
    from transformers import AutoModelForCausalLM

    results, _, batch = resumed
    original = _load_dir(hf_dir)
    for name, tensor in results[0]["pp2_weights"].items():
        assert torch.equal(tensor, original[name]), name
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():
        logp = torch.log_softmax(model(batch["input_ids"]).logits[:, :-1], -1)
    expected = logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(results[0]["pp2_logprobs"][:, 1:], expected, atol=2e-5, rtol=0)


def test_mismatched_architecture_is_refused_naming_the_field(resumed):
    message = resumed[0][0]["mismatch"]
    assert "'num_layers'" in message and "4" in message and "2" in message


def test_resume_gives_the_same_next_steps(resumed):
    results, root, _ = resumed
    r = results[0]
    assert r["extra"] == results[1]["extra"] == {"cursor": 7, "rank0": True}  # rank 0's dict
    assert r["resumed_steps"] == 1
    for a, b in zip(r["uninterrupted"], r["resumed"]):
        assert a == b  # loss, grad norm, lr (warm-up position), clip fractions: all identical
    assert [m["lr"] for m in r["resumed"]] == pytest.approx([2e-3 / 3, 1e-3])
    for name, tensor in r["uninterrupted_weights"].items():
        assert torch.equal(tensor, r["resumed_weights"][name]), name


def test_crashed_save_never_looks_complete(resumed):
    results, root, _ = resumed
    assert results[0]["crashed"] == "simulated crash before commit"
    assert "rank 0 failed" in results[1]["crashed"]
    assert (root / ".tmp-step_3").exists() and not (root / "step_3").exists()
    assert ckpt.latest_checkpoint(root) == root / "step_1"


def _killed_save_worker(rank, world_size, hf_dir, root):
    from ragen_mega.backends.megatron.model import build_model

    chunks = build_model(hf_dir)
    ckpt.save_checkpoint(root, 5, chunks, hf_dir=hf_dir)
    ckpt.commit_dir = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    ckpt.save_checkpoint(root, 6, chunks, hf_dir=hf_dir)


def test_killed_save_is_ignored(hf_dir, tmp_path):
    with pytest.raises(WorkerError, match="killed or crashed"):
        run_workers(_killed_save_worker, 1, str(hf_dir), str(tmp_path), timeout=300)
    assert (tmp_path / ".tmp-step_6" / ckpt.STATE_FILE).exists()  # all data written, no commit
    assert not (tmp_path / "step_6").exists()
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_5"
    with pytest.raises(FileNotFoundError, match="unfinished or killed save"):
        ckpt.read_checkpoint_state(tmp_path / ".tmp-step_6")
