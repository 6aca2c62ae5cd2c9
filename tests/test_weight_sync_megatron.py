"""Weight sync from a TP=1 Megatron trainer (real megatron-core on gloo) into a real SGLang engine.

The reference is the trainer itself: its own greedy decoding (Megatron forward passes, argmax
over the real vocabulary) and its log-probs of the engine's tokens (``compute_logprobs``, the
path the training loop uses). One launch walks: train a step (the engine is now stale, and the
check must see it), sync in several small per-tensor buckets, compare; train again, sync with
flattened buckets, compare. The model is a tiny Llama with tied embeddings (SmolLM2's shape, the
CPU demo's TP=1 case), so the export's tied-head rule is exercised. TP=2 is covered end to end
in test_train_e2e.py.

The sync's export sends every shard straight to the sending rank (``export_hf_state(dst=...)``);
a 4-process launch checks it against the checkpoint files themselves, bit for bit, under TP2,
PP2, TP2xPP2 and PP2 with virtual chunks, with the receiving rank in the first stage, in the
last stage, and in another data-parallel replica.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ragen_mega.backends.megatron.launch import run_workers
from ragen_mega.backends.sglang.server import launch_server

PROMPTS = [[1, 2, 3, 4, 5], [100, 2000, 30000, 77], list(range(500, 520))]
NEW_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
BUCKET_BYTES = 1 << 20  # the tiny model is ~13 MB: several buckets, the embedding alone


@torch.no_grad()
def megatron_greedy(chunks, prompt: list[int], n_new: int) -> list[int]:
    """Greedy continuation by plain Megatron forward passes (TP=1, PP=1: full-vocab logits)."""
    from ragen_mega.backends.megatron.model import unwrap

    model = unwrap(chunks[0])
    vocab = model.ragen_spec.vocab_size
    ids = list(prompt)
    for _ in range(n_new):
        tokens = torch.tensor([ids])
        logits = model(tokens, torch.arange(len(ids)).unsqueeze(0), None)
        ids.append(int(torch.argmax(logits[0, -1, :vocab])))  # padded vocab rows never win
    return ids[len(prompt):]


def _observe(trainer, client) -> dict:
    """Engine greedy tokens + log-probs, the trainer's greedy tokens, and the trainer's log-probs
    of the engine's tokens, for every prompt."""
    outs = client.generate(PROMPTS, GREEDY)
    seqs = [p + o.output_ids for p, o in zip(PROMPTS, outs)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    logprobs = trainer.compute_logprobs({"input_ids": ids, "attention_mask": mask,
                                         "loss_mask": torch.zeros(ids.shape)})
    return {"engine_ids": [o.output_ids for o in outs],
            "engine_logprobs": [o.output_logprobs for o in outs],
            "engine_version": {o.weight_version for o in outs},
            "trainer_ids": [megatron_greedy(trainer.model, p, NEW_TOKENS) for p in PROMPTS],
            "trainer_logprobs": [logprobs[i, len(p):len(p) + NEW_TOKENS].tolist()
                                 for i, p in enumerate(PROMPTS)],
            "batch": (ids, mask)}


def _train_step(trainer, observed: dict, sign: float) -> dict:
    """One actor step on the engine's completions: push the first completion up and the others
    down (lr 1e-2 moves every weight visibly)."""
    ids, mask = observed["batch"]
    loss_mask = mask.clone().float()
    for i, p in enumerate(PROMPTS):
        loss_mask[i, :len(p)] = 0
    old = trainer.compute_logprobs({"input_ids": ids, "attention_mask": mask,
                                    "loss_mask": loss_mask})
    adv = torch.full(ids.shape, -sign)
    adv[0] = sign
    return trainer.train_actor({"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask,
                                "old_logprobs": old, "advantages": adv * loss_mask})


def _tp1_sync_worker(rank, world_size, hf_dir, url):
    from ragen_mega.backends.megatron.model import export_hf_state
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.backends.sglang.client import EngineClient
    from ragen_mega.backends.sglang.weight_sender import BucketedWeightSender
    from ragen_mega.config import TrainerConfig

    trainer = MegatronTrainer(TrainerConfig(lr=1e-2, micro_batch_size=3), hf_dir)
    report = {}
    with EngineClient(url, timeout=120, retries=1) as client, \
            BucketedWeightSender([client], mode="distributed", backend="gloo",
                                 bucket_bytes=BUCKET_BYTES) as sender:
        report["start"] = last = _observe(trainer, client)
        for version, load_format, sign in ((1, None, 1.0), (2, "flattened_bucket", -1.0)):
            report[f"train_{version}"] = _train_step(trainer, last, sign)
            report[f"stale_{version}"] = _observe(trainer, client)  # the engine has old weights
            sender.load_format = load_format
            # the training loop's export: shards straight to the sending rank (here itself)
            named = export_hf_state(trainer.model, dst=0, prefetch_bytes=BUCKET_BYTES)
            report[f"stats_{version}"] = sender.send(named, version=version)
            report[f"v{version}"] = last = _observe(trainer, client)
    for value in report.values():
        if isinstance(value, dict):
            value.pop("batch", None)
    return report


LAYOUTS = [(2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2)]


def _export_to_worker(rank, world_size, cases):
    from ragen_mega.backends.megatron.model import build_model, export_hf_state, load_hf_checkpoint
    from ragen_mega.backends.megatron.parallel import init_parallel

    out = {}
    for tp, pp, vpp in LAYOUTS:
        init_parallel(rank, world_size, None, tp=tp, pp=pp, vpp=vpp)
        for hf_dir in cases:
            chunks = build_model(hf_dir)
            load_hf_checkpoint(chunks, hf_dir)
            for dst in (0, world_size - 1):
                # a small prefetch window: receives stay posted across many parameters
                got = list(export_hf_state(chunks, dst=dst, prefetch_bytes=1 << 20))
                out[(hf_dir, tp, pp, vpp, dst)] = (
                    [n for n, _ in got], {n: t.clone() for n, t in got} if rank == dst else None)
    return out


@pytest.mark.slow
def test_export_to_one_rank_is_the_checkpoint_bit_for_bit(tiny_model):
    from safetensors.torch import load_file

    # qwen2: q/k/v biases, tied head (a separate output copy under PP, never exported);
    # qwen3: q/k norms, untied lm_head. Both: padded vocabulary rows at TP2.
    cases = [str(tiny_model("qwen2", tied=True, num_layers=4)),
             str(tiny_model("qwen3", tied=False, num_layers=4))]
    results = run_workers(_export_to_worker, 4, cases, timeout=600)
    for hf_dir in cases:
        files = {}
        for f in sorted(Path(hf_dir).glob("*.safetensors")):
            files.update(load_file(f))
        for tp, pp, vpp in LAYOUTS:
            for dst in (0, 3):
                key = (hf_dir, tp, pp, vpp, dst)
                for rank, out in enumerate(results):
                    names, tensors = out[key]
                    if rank != dst:
                        assert names == [], (key, rank)  # only the receiving rank yields
                        continue
                    assert sorted(names) == sorted(files) and len(names) == len(set(names)), key
                    for name, tensor in tensors.items():
                        assert tensor.dtype == files[name].dtype, (key, name)
                        assert torch.equal(tensor, files[name]), (key, name)


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.slow
def test_tp1_megatron_sync_engine_follows_trainer(tiny_model):
    hf_dir = tiny_model("llama", tied=True)
    with launch_server(hf_dir, dtype="float32", startup_timeout=600, cpu_threads=1) as server:
        [report] = run_workers(_tp1_sync_worker, 1, str(hf_dir), server.url, timeout=600)

    # before any sync the engine serves the checkpoint the trainer loaded: they agree already
    start = report["start"]
    assert start["engine_ids"] == start["trainer_ids"]
    assert _max_diff(start["engine_logprobs"], start["trainer_logprobs"]) < 1e-4
    for version in (1, 2):
        assert report[f"train_{version}"]["update_successful"] == 1.0
        stale, synced = report[f"stale_{version}"], report[f"v{version}"]
        # the step moved the trainer away from what the engine serves: the check can fail ...
        assert _max_diff(stale["engine_logprobs"], stale["trainer_logprobs"]) > 1e-2
        # ... and after the sync the engine serves exactly the trainer's weights
        assert synced["engine_version"] == {str(version)}
        assert synced["engine_ids"] == synced["trainer_ids"]
        assert _max_diff(synced["engine_logprobs"], synced["trainer_logprobs"]) < 1e-4
        stats = report[f"stats_{version}"]
        assert stats.num_buckets > 1 and stats.version == str(version)
