"""Weight sync from a TP=2 Megatron trainer into one SGLang engine, against a raw gloo broadcast.

  python benchmarks/bench_weight_sync.py [--hidden 512] [--layers 4] [--rounds 3] [--bucket-mb 512]
                                         [--thp]
  python benchmarks/bench_weight_sync.py --lora-rank 16 [--rounds 3]

``--lora-rank``: a LoRA run's sync, adapters alone (``lora_export.AdapterExport`` into an engine
with the merge plugin) against the merged weights whole, on SmolLM2; bytes and seconds per sync,
and the bytes of both for a Qwen2.5-7B shape (computed: it does not fit here).

Builds a random Qwen2-shaped checkpoint of a few hundred MB (fp32), starts one SGLang server on
it, and launches two Megatron ranks (TP=2, gloo) that load it. Per round every rank walks
``DirectExport(dst=0)`` (rank 1 sends its TP shards straight to rank 0, HF names through the
one mapping) and rank 0 streams it into the engine with ``BucketedWeightSender`` along the
export's layout (each tensor broadcast as soon as it is whole), exactly as the training loop's
sync does; alternating with it, the same sync without the layout (whole buckets, bucket k+1
drawn while bucket k travels). Reported next to them, best of ``--rounds``:
the export alone (no sending); the sender alone, pushing the same tensors already in rank 0's
memory (what a perfect export would cost: session, broadcast, the engine's receive and load);
and a raw gloo broadcast of the same bytes, in the same bucket sizes, from a process to one plain
peer (nothing loaded, no HTTP) - the floor. Ratio = raw / sync (1.0 = sync costs no more than
the bare transfer). Prints JSON lines and a Markdown row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sglang import raw_gloo_broadcast  # noqa: E402


def _tp2_worker(rank, world_size, hf_dir, url, rounds, bucket_bytes):
    from ragen_mega.backends.megatron.export import DirectExport
    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint
    from ragen_mega.backends.sglang.client import EngineClient
    from ragen_mega.backends.sglang.weight_sender import BucketedWeightSender

    chunks = build_model(hf_dir)
    load_hf_checkpoint(chunks, hf_dir)

    def export():  # what TrainerWorker.sync_weights walks
        return DirectExport(chunks, dst=0, prefetch_bytes=bucket_bytes)

    export_s = []
    for _ in range(rounds):
        start = time.perf_counter()
        sizes = [t.numel() * t.element_size() for _, t in export()]
        export_s.append(time.perf_counter() - start)
    if rank != 0:  # rank 0's copy for the plain sender, then its sync rounds: rank 1 only sends
        for _ in range(1 + 2 * rounds):
            for _ in export():
                pass
        return None
    sender = BucketedWeightSender([EngineClient(url)], mode="distributed",
                                  bucket_bytes=bucket_bytes, backend="gloo")
    sender.connect()
    ready = [(name, tensor.clone()) for name, tensor in export()]
    plain_s = [sender.send(ready, version=f"plain-{i}").seconds for i in range(rounds)]
    sync_s = {"bucketed": [], "streamed": []}
    for i in range(rounds):  # alternating, so both see the same machine
        for how in sync_s:
            start = time.perf_counter()
            walk = export()
            sender.send(walk, version=f"{how}-{i}",
                        layout=walk.layout if how == "streamed" else None)
            sync_s[how].append(time.perf_counter() - start)
    sender.close()
    return {"export_s": min(export_s), "plain_s": min(plain_s),
            "bucketed_s": min(sync_s["bucketed"]), "sync_s": min(sync_s["streamed"]),
            "tensor_bytes": sizes}


def _lora_worker(rank, world_size, hf_dir, url, rounds, rank_r):
    """One TP=1 rank with LoRA adapters (rank ``rank_r``, every linear, B made non-zero): the
    full merged-weight sync (``DirectExport``) against the adapter-only one (``AdapterExport``)
    into one engine started with the merge plugin, alternating, best of ``rounds``."""
    from ragen_mega.backends.megatron.export import DirectExport
    from ragen_mega.backends.megatron.lora import LoraSettings, adapter_tensors, apply_lora
    from ragen_mega.backends.megatron.lora_export import AdapterExport
    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint
    from ragen_mega.backends.sglang.client import EngineClient
    from ragen_mega.backends.sglang.weight_sender import BucketedWeightSender

    chunks = build_model(hf_dir, use_te=False)
    load_hf_checkpoint(chunks, hf_dir)
    apply_lora(chunks, LoraSettings(rank_r, 2.0 * rank_r, 0.0, LORA_TARGETS), seed=0)
    with torch.no_grad():
        for _, param, _ in adapter_tensors(chunks[0]):
            param.normal_(0, 1e-3)
    sender = BucketedWeightSender([EngineClient(url)], mode="distributed",
                                  bucket_bytes=512 << 20, backend="gloo")
    sender.connect()
    out = {"full": [], "adapters": []}
    for i in range(rounds):
        for how, make in (("full", lambda: DirectExport(chunks, dst=0, prefetch_bytes=512 << 20)),
                          ("adapters", lambda: AdapterExport(chunks, dst=0))):
            start = time.perf_counter()
            walk = make()
            stats = sender.send(walk, version=f"{how}-{i}", layout=walk.layout)
            out[how].append((time.perf_counter() - start, stats.num_bytes))
    sender.close()
    return {how: min(v) for how, v in out.items()}


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_bytes(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
               head_dim: int, vocab: int, rank: int, tied: bool, bytes_per_value: int = 2
               ) -> tuple[int, int]:
    """(full model bytes, adapter bytes) of a dense Qwen2/Llama shape: the full sync sends
    every weight (norms and biases too small to count are left out), the adapter sync A
    [r, in] and B [out, r] of each linear of each layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    linears = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, intermediate),
               (hidden, intermediate), (intermediate, hidden)]
    per_layer = sum(i * o for i, o in linears)
    full = layers * per_layer + vocab * hidden * (1 if tied else 2)
    adapters = layers * sum(rank * (i + o) for i, o in linears)
    return full * bytes_per_value, adapters * bytes_per_value


def lora_main(args) -> None:
    """``--lora-rank R``: SmolLM2 measured (fp32 on this CPU), Qwen2.5-7B computed (bf16)."""
    from ragen_mega.backends.megatron.launch import run_workers
    from ragen_mega.backends.sglang.server import launch_server
    from ragen_mega.models.prepare import prepare_smollm2

    hf_dir = prepare_smollm2()
    with launch_server(hf_dir, dtype="float32", cpu_threads=1,
                       lora_targets=LORA_TARGETS) as server:
        [r0] = run_workers(_lora_worker, 1, str(hf_dir), server.url, args.rounds,
                           args.lora_rank, timeout=1200, threads_per_worker=1)
    (full_s, full_b), (lora_s, lora_b) = r0["full"], r0["adapters"]
    print(json.dumps({"model": "SmolLM2-135M fp32", "rank": args.lora_rank,
                      "full_bytes": full_b, "full_s": round(full_s, 3),
                      "adapter_bytes": lora_b, "adapter_s": round(lora_s, 3),
                      "loadavg": Path("/proc/loadavg").read_text().split()[:3]}))
    print(f"| SmolLM2-135M, fp32, measured | {args.lora_rank} | {full_b / 2**20:.1f} MiB | "
          f"{full_s:.3f} s | {lora_b / 2**20:.2f} MiB | {lora_s:.3f} s | {full_b / lora_b:.0f}x |")
    full, adapters = lora_bytes(3584, 18944, 28, 28, 4, 128, 152064, args.lora_rank, tied=False)
    print(f"| Qwen2.5-7B shape, bf16, computed | {args.lora_rank} | {full / 2**20:.0f} MiB | - | "
          f"{adapters / 2**20:.1f} MiB | - | {full / adapters:.0f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--thp", action="store_true",
                        help="THP_MEM_ALLOC_ENABLE=1 for every process (torch backs large CPU "
                             "tensors with transparent huge pages: ~5x fewer page-fault costs)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="instead: full merged-weight sync against adapter-only sync with "
                             "LoRA adapters of this rank (SmolLM2 measured, Qwen2.5-7B computed)")
    args = parser.parse_args()
    if args.lora_rank:
        return lora_main(args)
    if args.thp:  # read by torch's CPU allocator; inherited by the workers and the server
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"

    from ragen_mega.backends.megatron.launch import run_workers
    from ragen_mega.backends.sglang.server import launch_server
    from ragen_mega.backends.sglang.weight_sender import iter_buckets
    from ragen_mega.models.prepare import make_tiny_model

    hf_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="bench_sync_")) / "model", "qwen2",
                             hidden_size=args.hidden, num_layers=args.layers, num_heads=8,
                             num_kv_heads=4, intermediate_size=3 * args.hidden)
    bucket_bytes = args.bucket_mb << 20
    with launch_server(hf_dir, dtype="float32", cpu_threads=1) as server:
        [r0, _] = run_workers(_tp2_worker, 2, str(hf_dir), server.url, args.rounds, bucket_bytes,
                              tp=2, timeout=1200, threads_per_worker=1)
    sizes = r0["tensor_bytes"]
    metas = ((str(i), torch.empty(n, dtype=torch.uint8, device="meta")) for i, n in enumerate(sizes))
    buckets = [sum(t.numel() for _, t in b) for b in iter_buckets(metas, bucket_bytes)]
    raw = raw_gloo_broadcast(buckets, args.rounds)
    total = sum(sizes)
    row = {"model_mb": round(total / 2**20), "tensors": len(sizes), "buckets": len(buckets),
           "raw_broadcast_s": round(raw, 3), "plain_sender_s": round(r0["plain_s"], 3),
           "tp2_export_s": round(r0["export_s"], 3),
           "tp2_sync_bucketed_s": round(r0["bucketed_s"], 3), "tp2_sync_s": round(r0["sync_s"], 3),
           "ratio_raw_over_sync": round(raw / r0["sync_s"], 2),
           "ratio_plain_over_sync": round(r0["plain_s"] / r0["sync_s"], 2),
           "thp": args.thp, "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    print(json.dumps(row))
    print(f"| {row['model_mb']} MiB fp32, {row['tensors']} tensors, {row['buckets']} bucket(s) | "
          f"{row['raw_broadcast_s']} s | {row['plain_sender_s']} s | {row['tp2_export_s']} s | "
          f"{row['tp2_sync_bucketed_s']} s | {row['tp2_sync_s']} s | {row['ratio_raw_over_sync']} | "
          f"{row['ratio_plain_over_sync']} |")


if __name__ == "__main__":
    main()
