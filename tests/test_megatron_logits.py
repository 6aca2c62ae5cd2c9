"""Megatron (real megatron-core on gloo) log-probs / entropy / values vs transformers, per layout.

One 4-process launch visits TP1, TP2, PP2, TP2xPP2 (and PP2 x 2 virtual chunks for a 4-layer
model), re-laying out the same processes; the remaining ranks act as data-parallel replicas and
must get the same numbers. The references are transformers' own forward passes on each row
without padding; the HF export is compared with the safetensors files themselves.
"""
from __future__ import annotations


import json
import re
import shutil

import pytest
import torch

from conftest import LENGTHS, make_batch, training_grads
from ragen_mega.backends.megatron.launch import run_workers

LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2)]



def hf_reference(hf_dir, ids, mask, temperature=1.0):
    """Per-row (unpadded) log-probs of the next tokens, entropies, last hidden states."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    batch, seq = ids.shape
    logprobs, entropy = torch.zeros(batch, seq - 1), torch.zeros(batch, seq - 1)
    hidden = []
    with torch.no_grad():
        for b in range(batch):
            n = int(mask[b].sum())
            out = model(ids[b: b + 1, :n], output_hidden_states=True)
            logp = torch.log_softmax(out.logits[0].double() / temperature, -1)
            logprobs[b, : n - 1] = logp[:-1].gather(-1, ids[b, 1:n, None]).squeeze(-1).float()
            entropy[b, : n - 1] = -(logp.exp() * logp).sum(-1)[:-1].float()
            hidden.append(model.model(ids[b: b + 1, :n]).last_hidden_state[0])
    return logprobs, entropy, hidden


def hf_grads(hf_dir, ids, mask):
    """transformers' gradients of the same loss (Megatron's schedule averages micro-batches)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    losses = []
    for rows in ((0, 1), (2,)):              # the two micro-batches of split_microbatches(.., 2)
        loss = 0.0
        for b in rows:
            n = int(mask[b].sum())
            logp = torch.log_softmax(model(ids[b: b + 1, :n]).logits[0], -1)[:-1]
            entropy = -(logp.exp() * logp).sum(-1)
            loss = loss - (logp.gather(-1, ids[b, 1:n, None]).sum() + 0.1 * entropy.sum())
        losses.append(loss.detach())
        (loss / 2).backward()
    return {n: p.grad for n, p in model.named_parameters()}, torch.stack(losses)


def _export_diff(exported: dict, hf_dir) -> tuple[set, float]:
    """Names that differ between an export and the checkpoint files; max abs difference."""
    from safetensors.torch import load_file
    import glob

    files = {}
    for f in glob.glob(f"{hf_dir}/*.safetensors"):
        files.update(load_file(f))
    keys = set(files) ^ set(exported)
    diff = max((exported[k] - files[k]).abs().max().item() for k in set(files) & set(exported))
    return keys, diff


def logits_worker(rank, world, cases, layouts, ids, mask, critic_case, bad_dir):
    """For each layout and case: log-probs, entropy, export check; one critic check."""
    from ragen_mega.backends.megatron.forward import forward_logprobs, forward_values
    from ragen_mega.backends.megatron.chunk import unwrap
    from ragen_mega.backends.megatron.export import export_hf_state
    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint
    from ragen_mega.backends.megatron.parallel import init_parallel
    from ragen_mega.models.hf_config import model_spec

    out = {}
    for tp, pp, vpp in layouts:
        init_parallel(rank, world, None, tp=tp, pp=pp, vpp=vpp)
        temperature = 0.7 if (tp, pp) == (2, 2) else 1.0
        for label, hf_dir, divisor in cases:
            spec = model_spec(hf_dir, vocab_divisor=divisor)
            if spec.num_layers % (pp * (vpp or 1)):
                continue
            chunks = build_model(spec)
            load_hf_checkpoint(chunks, hf_dir)
            lp, ent = forward_logprobs(chunks, ids, mask, temperature=temperature,
                                       micro_batch_size=2)
            out[(label, tp, pp, vpp)] = (lp, ent, temperature,
                                         _export_diff(dict(export_hf_state(chunks)), hf_dir))
            if label == critic_case and (tp, pp) == (2, 2):
                critic = build_model(spec, role="critic")
                load_hf_checkpoint(critic, hf_dir)     # seeded from the actor checkpoint
                zero = forward_values(critic, ids, mask)
                w = torch.randn(1, spec.hidden_size, generator=torch.Generator().manual_seed(7))
                for chunk in critic:
                    head = getattr(unwrap(chunk), "output_layer", None)
                    if head is not None:
                        head.weight.data.copy_(w)
                values = forward_values(critic, ids, mask, micro_batch_size=2)
                exported = dict(export_hf_state(critic))
                out["critic"] = (zero, values, w, sorted(exported),
                                 torch.equal(exported["score.weight"], w))
                out["grads"] = training_grads(chunks, ids, mask, rank)
        if (tp, pp) == (2, 2):
            out["refused"] = _load_error(bad_dir)
    return out


def _load_error(hf_dir) -> str:
    """The error of loading a checkpoint whose config.json contradicts its tensors."""
    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint

    chunks = build_model(hf_dir)
    try:
        load_hf_checkpoint(chunks, hf_dir)
    except ValueError as e:
        return str(e)
    return "loaded without error"



@pytest.fixture(scope="module")
def cases(tiny_model):
    # (label, hf dir, vocab divisor): qwen2 with divisor 1000 pads 49152 -> 50000 (TP1) /
    # 50000 (TP2) rows, so the padded-column masking of the vocab-parallel softmax is exercised.
    return [("llama-tied", str(tiny_model("llama", tied=True)), 128),
            ("qwen2-untied-padded", str(tiny_model("qwen2", tied=False)), 1000),
            ("qwen3-tied", str(tiny_model("qwen3", tied=True)), 128),
            ("qwen3-untied-4layers", str(tiny_model("qwen3", tied=False, num_layers=4)), 128)]


@pytest.mark.slow
def test_logprobs_entropy_values_match_transformers_all_layouts(cases, tmp_path):
    ids, mask = make_batch(49152)
    bad_dir = tmp_path / "wrong-intermediate-size"   # tensors say 128, config.json says 96
    shutil.copytree(cases[1][1], bad_dir)
    config = json.loads((bad_dir / "config.json").read_text())
    config["intermediate_size"] = 96
    (bad_dir / "config.json").write_text(json.dumps(config))
    results = run_workers(logits_worker, 4, cases, LAYOUTS, ids, mask, "qwen2-untied-padded",
                          str(bad_dir), timeout=900)
    refs = {}
    for label, hf_dir, _ in cases:
        for temperature in (1.0, 0.7):
            refs[(label, temperature)] = hf_reference(hf_dir, ids, mask, temperature)
    expected_runs = {(label, *layout) for label, *_ in cases for layout in LAYOUTS
                     if layout[2] is None or label.endswith("4layers")}
    for rank, out in enumerate(results):
        assert expected_runs <= set(out), expected_runs - set(out)
        for run in expected_runs:
            lp, ent, temperature, (key_diff, weight_diff) = out[run]
            ref_lp, ref_ent, _ = refs[(run[0], temperature)]
            assert torch.allclose(lp, ref_lp, atol=1e-5, rtol=0), (rank, run, (lp - ref_lp).abs().max())
            assert torch.allclose(ent, ref_ent, atol=1e-5, rtol=0), (rank, run, (ent - ref_ent).abs().max())
            assert lp.abs().sum() > 0 and torch.all(lp[1, 4:] == 0)   # padding stays 0
            assert key_diff == set() and weight_diff == 0.0, (rank, run, key_diff, weight_diff)
        zero, values, w, exported_names, head_exact = out["critic"]
        assert torch.all(zero == 0)          # an actor checkpoint gives a zero value head
        hidden = refs[("qwen2-untied-padded", 1.0)][2]
        for b, n in enumerate(LENGTHS):
            ref_values = (hidden[b] @ w.t()).squeeze(-1)
            assert torch.allclose(values[b, :n], ref_values, atol=2e-5, rtol=0), (rank, b)
            assert torch.all(values[b, n:] == 0)
        assert head_exact and "score.weight" in exported_names
        assert "lm_head.weight" not in exported_names
        assert re.search(r"intermediate_size: config says 96, checkpoint tensor "
                         r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \(128, 64\), "
                         r"implying 128", out["refused"]), out["refused"]
        grads, metrics = out["grads"]
        if rank == 0:
            ref_grads, ref_losses = hf_grads(cases[1][1], ids, mask)
            assert set(grads) == set(ref_grads)
            for name, g in grads.items():
                scale = ref_grads[name].abs().max().item()
                assert (g - ref_grads[name]).abs().max() <= 3e-5 * max(scale, 1e-3), name
        assert bool(metrics) == (rank >= 2)   # only the last pipeline stage (ranks 2, 3) reports
        if metrics:
            assert torch.allclose(torch.stack([m["loss"] for m in metrics]), ref_losses, atol=1e-4)


def smollm2_worker(rank, world, hf_dir, ids, mask):
    from ragen_mega.backends.megatron.forward import forward_logprobs
    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint
    from ragen_mega.backends.megatron.parallel import init_parallel

    out = {}
    for tp, pp in ((1, 1), (3, 1), (1, 3)):   # 9 heads / 3 KV heads: TP 3, not 2
        init_parallel(rank, world, None, tp=tp, pp=pp)
        chunks = build_model(hf_dir)
        load_hf_checkpoint(chunks, hf_dir)
        out[(tp, pp)] = forward_logprobs(chunks, ids, mask, micro_batch_size=2)
        del chunks
    return out


@pytest.mark.slow
def test_smollm2_real_model_matches_transformers_tp1_tp3_pp3(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["The capital of France is Paris, and the capital of Italy is",
             "def fibonacci(n):\n    return", "Hello! How are you today?"]
    rows = [tok(t)["input_ids"] for t in texts]
    seq = max(map(len, rows))
    ids = torch.full((len(rows), seq), tok.pad_token_id)
    mask = torch.zeros(len(rows), seq, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)], mask[b, : len(row)] = torch.tensor(row), 1
    results = run_workers(smollm2_worker, 3, str(smollm2_dir), ids, mask, timeout=900)
    ref_lp, ref_ent, _ = hf_reference(smollm2_dir, ids, mask)
    assert ref_lp[0, :-1].mean() > -3.0       # a real model: the sentence is likely
    for rank, out in enumerate(results):
        assert len(out) == 3
        for layout, (lp, ent) in out.items():
            assert (lp - ref_lp).abs().max() < 1e-4, (rank, layout, (lp - ref_lp).abs().max())
            assert (ent - ref_ent).abs().max() < 1e-4, (rank, layout, (ent - ref_ent).abs().max())


def test_forward_helpers_reject_bad_input():
    from ragen_mega.backends.megatron.forward import split_microbatches

    ids, mask = make_batch(100)
    left_padded = mask.flip(1)
    with pytest.raises(ValueError, match="right padding"):
        split_microbatches(ids, left_padded)
    with pytest.raises(ValueError, match="attention_mask shape"):
        split_microbatches(ids, mask[:, :-1])
    mbs = split_microbatches(ids, mask, 2, advantages=torch.ones(3, ids.shape[1] - 1))
    assert [mb["input_ids"].shape for mb in mbs] == [(2, 9), (1, 7)]
    assert [mb["advantages"].shape for mb in mbs] == [(2, 8), (1, 6)]


def test_run_workers_reports_rank_and_traceback():
    from ragen_mega.backends.megatron.launch import WorkerError

    with pytest.raises(WorkerError, match=r"rank 1 failed:(.|\n)*ZeroDivisionError"):
        run_workers(_fail_on_rank_1, 2, timeout=120)
    with pytest.raises(TimeoutError, match=r"ranks \[0\] still running after 8 s"):
        run_workers(_hang_on_rank_0, 1, timeout=8)


def _fail_on_rank_1(rank, world):
    if rank == 1:
        return 1 / 0
    return rank


def _hang_on_rank_0(rank, world):
    import time

    if rank == 0:
        time.sleep(600)
    return rank


