"""Weight sync from a Megatron trainer (real megatron-core on gloo) into real SGLang engines.

The reference is the trainer itself: its own greedy decoding (Megatron forward passes, argmax
over the real vocabulary) and its log-probs of the engine's tokens (``compute_logprobs``, the
path the training loop uses). One launch walks, twice: train a step (the engines are now stale,
and the check must see it), sync in several small buckets, compare every engine. Covered:
* TP=1 trainer -> one engine; a tiny Llama with tied embeddings (SmolLM2's shape, the CPU demo's
  case, so the export's tied-head rule is exercised); the streamed sync (the sender follows the
  export's layout), then flattened buckets.
* TP=2 trainer -> a TP=2 engine and a TP=1 engine in one broadcast group (rank offsets 1 and 3);
  a tiny Qwen2; the streamed sync, then whole per-tensor buckets.

The sync's export sends every shard straight to the sending rank (``DirectExport``); a 4-process
launch checks it against the checkpoint files themselves, bit for bit, and its layout against
what it yields, under TP2, PP2, TP2xPP2 and PP2 with virtual chunks, with the receiving rank in
the first stage, in the last stage, and in another data-parallel replica.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from conftest import engines_started_together, push_first_completion

from ragen_mega.backends.megatron.launch import run_workers
from ragen_mega.backends.sglang.server import launch_server

PROMPTS = [[1, 2, 3, 4, 5], [100, 2000, 30000, 77], list(range(500, 520))]
NEW_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
BUCKET_BYTES = 1 << 20  # the tiny model is ~13 MB: several buckets, the embedding alone


@torch.no_grad()
def megatron_greedy(chunks, prompt: list[int], n_new: int) -> list[int]:
    """Greedy continuation by plain Megatron forward passes (PP=1; at TP>1 each step gathers the
    vocab-parallel logits of the last position: a collective over the TP group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from ragen_mega.backends.megatron.chunk import unwrap

    model = unwrap(chunks[0])
    vocab = model.ragen_spec.vocab_size
    tp = mpu.get_tensor_model_parallel_world_size()
    ids = list(prompt)
    for _ in range(n_new):
        tokens = torch.tensor([ids])
        last = model(tokens, torch.arange(len(ids)).unsqueeze(0), None)[0, -1].contiguous()
        if tp > 1:
            parts = [torch.empty_like(last) for _ in range(tp)]
            dist.all_gather(parts, last, group=mpu.get_tensor_model_parallel_group())
            last = torch.cat(parts)
        ids.append(int(torch.argmax(last[:vocab])))  # padded vocab rows never win
    return ids[len(prompt):]


def _observe(trainer, clients) -> dict:
    """Every engine's greedy tokens + log-probs (rank 0 asks them), the trainer's greedy tokens,
    and the trainer's log-probs of the first engine's tokens, for every prompt."""
    import torch.distributed as dist

    engines = [[(o.output_ids, o.output_logprobs, o.weight_version)
                for o in c.generate(PROMPTS, GREEDY)] for c in clients]
    shared = [engines]
    if dist.get_world_size() > 1:  # the other ranks compute on the same tokens
        dist.broadcast_object_list(shared, src=0)
    [engines] = shared
    seqs = [p + ids for p, (ids, _, _) in zip(PROMPTS, engines[0])]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    logprobs = trainer.compute_logprobs({"input_ids": ids, "attention_mask": mask,
                                         "loss_mask": torch.zeros(ids.shape)})
    return {"engines": [{"ids": [ids for ids, _, _ in outs],
                         "logprobs": [lps for _, lps, _ in outs],
                         "version": {v for _, _, v in outs}} for outs in engines],
            "trainer_ids": [megatron_greedy(trainer.model, p, NEW_TOKENS) for p in PROMPTS],
            "trainer_logprobs": [logprobs[i, len(p):len(p) + NEW_TOKENS].tolist()
                                 for i, p in enumerate(PROMPTS)],
            "batch": (ids, mask)}


class _KilledOnFirstDraw:
    """An export whose first drawn tensor (on the sending rank: the one that knows the layout)
    SIGKILLs the process group ``pgid``: an engine dies after its first bucket was announced."""

    def __init__(self, export, pgid: int):
        self.export, self.pgid, self.layout = export, pgid, export.layout

    def __iter__(self):
        for i, item in enumerate(self.export):
            if i == 0 and self.layout is not None:
                os.killpg(self.pgid, signal.SIGKILL)
            yield item


def _sync_worker(rank, world_size, hf_dir, urls, rounds, layout=None, kill_pgid=None):
    """A TP=``world_size`` trainer (or ``layout``: its ActorConfig parallel fields) that, per
    round ``(mode, load_format, streamed, sign)``, trains a step, observes the stale engines,
    syncs them as the training loop does (``DirectExport`` to rank 0, a sender of that
    ``mode``, ``send_export``; ``streamed``: the sender follows the export's layout) and
    observes them again. ``kill_pgid``: then one more step whose sync kills that engine's
    server (``_KilledOnFirstDraw``), then a sync that first replaces both engines by clients
    of the dead server; each rank reports what its ``send_export`` raised in each."""
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.backends.sglang.client import EngineClient
    from ragen_mega.backends.sglang.weight_sender import BucketedWeightSender, send_export
    from ragen_mega.config import ActorConfig

    trainer = MegatronTrainer(ActorConfig(lr=1e-2, micro_batch_size=3,
                                          **(layout or {"tp": world_size})), hf_dir)
    clients = [EngineClient(u, timeout=120, retries=1) for u in urls] if rank == 0 else []
    senders = {}   # mode -> the sender, made on its first round (rank 0 only)
    report = {"start": _observe(trainer, clients)}
    last = report["start"]
    for version, (mode, load_format, streamed, sign) in enumerate(rounds, start=1):
        report[f"train_{version}"] = push_first_completion(trainer, last["batch"], PROMPTS, sign)
        report[f"stale_{version}"] = _observe(trainer, clients)  # the engines have old weights
        export = trainer.weight_export(dst=0, prefetch_bytes=BUCKET_BYTES)
        if rank == 0 and mode not in senders:
            senders[mode] = BucketedWeightSender(clients, mode=mode, backend="gloo",
                                                 bucket_bytes=BUCKET_BYTES)
            if mode == "distributed":
                senders[mode].connect()
        sender = senders.get(mode)
        if sender is not None:
            sender.load_format = load_format
        report[f"stats_{version}"] = send_export(export, sender, version, streamed=streamed)
        report[f"v{version}"] = last = _observe(trainer, clients)
    if kill_pgid is not None:
        push_first_completion(trainer, last["batch"], PROMPTS, 1.0)
        export = _KilledOnFirstDraw(trainer.weight_export(dst=0, prefetch_bytes=BUCKET_BYTES),
                                    kill_pgid)
        try:
            send_export(export, senders.get("distributed"), len(rounds) + 1)
            report["killed_sync"] = None
        except Exception as e:  # noqa: BLE001 - the report says what it was
            report["killed_sync"] = f"{type(e).__name__}: {e}"
        # both engines "restarted" into the dead server: joining the new group fails
        broken = senders.pop("distributed", None)

        def rejoin():
            dead = urls[-1]
            broken.replace_engines({0: EngineClient(dead, timeout=120, retries=0),
                                    1: EngineClient(dead, timeout=120, retries=0)})

        export = trainer.weight_export(dst=0, prefetch_bytes=BUCKET_BYTES)
        try:
            send_export(export, broken, len(rounds) + 1, before=rejoin)
            report["rejoin"] = None
        except Exception as e:  # noqa: BLE001 - the report says what it was
            report["rejoin"] = f"{type(e).__name__}: {e}"
        for client in broken.engines if broken is not None else ():
            client.close()
    for sender in senders.values():
        sender.close()
    for client in clients:
        client.close()
    for value in report.values():
        if isinstance(value, dict):
            value.pop("batch", None)
    return report


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _check_engines_follow(report: dict, rounds) -> None:
    """Before any sync and after every sync, every engine serves exactly the trainer's weights;
    after a train step and before its sync they measurably do not (so the check can fail)."""
    for engine in report["start"]["engines"]:  # the checkpoint both loaded
        assert engine["ids"] == report["start"]["trainer_ids"]
        assert _max_diff(engine["logprobs"], report["start"]["trainer_logprobs"]) < 1e-4
    for version in range(1, len(rounds) + 1):
        assert report[f"train_{version}"]["update_successful"] == 1.0
        stale, synced = report[f"stale_{version}"], report[f"v{version}"]
        assert _max_diff(stale["engines"][0]["logprobs"], stale["trainer_logprobs"]) > 1e-2
        for engine in synced["engines"]:
            assert engine["version"] == {str(version)}
            assert engine["ids"] == synced["trainer_ids"]
            assert _max_diff(engine["logprobs"], synced["trainer_logprobs"]) < 1e-4
        stats = report[f"stats_{version}"]
        assert stats.num_buckets > 1 and stats.version == str(version)


LAYOUTS = [(2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2)]


def _export_to_worker(rank, world_size, cases):
    from ragen_mega.backends.megatron.export import DirectExport
    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint
    from ragen_mega.backends.megatron.parallel import init_parallel

    out = {}
    for tp, pp, vpp in LAYOUTS:
        init_parallel(rank, world_size, None, tp=tp, pp=pp, vpp=vpp)
        for hf_dir in cases:
            chunks = build_model(hf_dir)
            load_hf_checkpoint(chunks, hf_dir)
            for dst in (0, world_size - 1):
                # a small prefetch window: receives stay posted across many parameters
                export = DirectExport(chunks, dst=dst, prefetch_bytes=1 << 20)
                got = list(export)
                out[(hf_dir, tp, pp, vpp, dst)] = (
                    [n for n, _ in got], {n: t.clone() for n, t in got} if rank == dst else None,
                    export.layout)
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
                    names, tensors, layout = out[key]
                    if rank != dst:  # only the receiving rank yields, and knows a layout
                        assert names == [] and layout is None, (key, rank)
                        continue
                    assert sorted(names) == sorted(files) and len(names) == len(set(names)), key
                    # the layout announced before any shard moved is what came, in order
                    assert layout == [(n, tuple(tensors[n].shape), tensors[n].dtype)
                                      for n in names], key
                    for name, tensor in tensors.items():
                        assert tensor.dtype == files[name].dtype, (key, name)
                        assert torch.equal(tensor, files[name]), (key, name)


@pytest.mark.slow
def test_tp1_megatron_sync_engine_follows_trainer(tiny_model):
    hf_dir = tiny_model("llama", tied=True)
    rounds = [("distributed", None, True, 1.0), ("distributed", "flattened_bucket", False, -1.0)]
    with launch_server(hf_dir, dtype="float32", startup_timeout=600, cpu_threads=1) as server:
        [report] = run_workers(_sync_worker, 1, str(hf_dir), [server.url], rounds, timeout=600)
    _check_engines_follow(report, rounds)


@pytest.mark.slow
def test_tp2_megatron_sync_into_a_tp2_and_a_tp1_engine(tiny_model):
    """TP=2 trainer -> two engines in one broadcast group: a TP=2 engine (group ranks 1-2, each
    SGLang rank loads its own shard of the broadcast) and a TP=1 engine (rank 3).

    Then the TP=1 engine's server is SIGKILLed once the third sync has begun: the sending rank
    fails with the dead engine's error, and the other trainer rank, whose shards the sending
    rank still drains from the export, returns from its part (it would otherwise wait in the
    export until the launch's time-out). Then the sender is given two engines whose server is
    that dead one: joining the new group fails at once (it would otherwise wait out the
    rendezvous' time-out), and the other trainer rank returns from that sync as well."""
    hf_dir = tiny_model("qwen2", tied=False)
    rounds = [("distributed", None, True, 1.0), ("distributed", None, False, -1.0)]
    with engines_started_together(hf_dir, {"tp": 2}, {}, dtype="float32", cpu_threads=1
                                  ) as (tp2_engine, tp1_engine):
        report, other_rank = run_workers(_sync_worker, 2, str(hf_dir),
                                         [tp2_engine.url, tp1_engine.url], rounds,
                                         None, tp1_engine.pid, tp=2, timeout=600)
    _check_engines_follow(report, rounds)
    # the dead engine's error, or the survivor's (its receive fails when the dead rank's
    # connection resets): whichever came first
    assert report["killed_sync"].startswith("EngineError") and any(
        engine.url in report["killed_sync"] for engine in (tp1_engine, tp2_engine))
    assert other_rank["killed_sync"] is None  # its shards were taken: it returned
    # a restarted engine that dies before it joins the new group: an error, not a wait, and
    # the other rank returns from that sync too
    assert report["rejoin"].startswith("EngineError") and "did not join" in report["rejoin"]
    assert other_rank["rejoin"] is None
    # every engine rank received through the CPU plugin (warm_receive.py), which says so
    arena_lines = {name: [line for line in server.log_file.read_text().splitlines()
                          if "warm_receive: weight-sync receive arena" in line]
                   for name, server in (("tp2", tp2_engine), ("tp1", tp1_engine))}
    assert arena_lines["tp1"]
    assert {rank for rank in ("TP0", "TP1") for line in arena_lines["tp2"] if rank in line} \
        == {"TP0", "TP1"}
