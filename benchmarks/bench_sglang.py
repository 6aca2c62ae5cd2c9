"""SGLang engine benchmarks: generation throughput and weight-sync time.

  python benchmarks/bench_sglang.py [--dtype bfloat16] [--requests 16] [--prompt-len 150]
                                    [--new-tokens 32] [--models tiny,smollm2] [--sync-rounds 3]

For each model: one real SGLang server (CPU way on a machine without CUDA), then
  * generation: ``--requests`` concurrent requests of ``--prompt-len`` random prompt tokens,
    ``--new-tokens`` new tokens each (ignore_eos), after one warm-up round; new tokens/s;
  * weight sync (SmolLM2 only; the tiny model is too small to time): the checkpoint's weights
    pushed by ``BucketedWeightSender`` (gloo broadcast, per-tensor and flattened buckets; and the
    colocated shared-memory path), against a raw gloo broadcast of the same buckets' bytes from
    this process to one plain peer process — the floor any broadcast-based sync can reach here.
Prints one JSON line per measurement and a Markdown table at the end.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import time

import torch


def bench_generate(client, requests: int, prompt_len: int, new_tokens: int) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(requests)]
    params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}

    def one_round():
        futures = [client.submit(client.aio.generate(p, params)) for p in prompts]
        return [f.result() for f in futures]

    one_round()  # warm-up
    client.flush_cache()
    start = time.perf_counter()
    outs = one_round()
    seconds = time.perf_counter() - start
    produced = sum(len(o.output_ids) for o in outs)
    return {"requests": requests, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "seconds": round(seconds, 2), "new_tok_per_s": round(produced / seconds, 1)}


def _raw_peer(port: int, sizes: list[int], rounds: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for _ in range(rounds):
        dist.barrier()
        for b in buffers:
            dist.broadcast(b, src=0)
    dist.destroy_process_group()


def raw_gloo_broadcast(sizes: list[int], rounds: int) -> float:
    """Best-of-``rounds`` seconds to broadcast buffers of ``sizes`` bytes to a peer process
    over gloo (the peer only receives: no loading, no HTTP)."""
    import torch.distributed as dist

    from ragen_mega.backends.sglang.server import free_port

    port = free_port()
    peer = mp.get_context("spawn").Process(target=_raw_peer, args=(port, sizes, rounds))
    peer.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    best = float("inf")
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for b in buffers:
            dist.broadcast(b, src=0)
        best = min(best, time.perf_counter() - start)
    dist.destroy_process_group()
    peer.join()
    return best


def bench_sync(client, model_dir, dtype: torch.dtype, rounds: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from ragen_mega.backends.sglang.weight_sender import BucketedWeightSender, iter_buckets

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    state = {n: p.detach() for n, p in model.named_parameters()}
    rows = []
    for bucket_mb in (64, 512):
        bucket_bytes = bucket_mb << 20
        sizes = [sum(t.numel() * t.element_size() for _, t in b)
                 for b in iter_buckets(state.items(), bucket_bytes)]
        raw = raw_gloo_broadcast(sizes, rounds)
        rows.append({"what": "raw gloo broadcast", "bucket_mb": bucket_mb,
                     "bytes": sum(sizes), "seconds": round(raw, 3)})
        for mode, load_format in (("distributed", None), ("distributed", "flattened_bucket"),
                                  ("tensor", None)):
            sender = BucketedWeightSender([client], mode=mode, bucket_bytes=bucket_bytes,
                                          load_format=load_format, backend="gloo")
            if mode == "distributed":
                sender.connect()
            best = min(sender.send(state.items(), version=f"bench-{i}").seconds
                       for i in range(rounds))
            sender.close()
            rows.append({"what": f"sender {mode}" + (" flattened" if load_format else ""),
                         "bucket_mb": bucket_mb, "bytes": sum(sizes), "seconds": round(best, 3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--sync-rounds", type=int, default=3)
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="OMP_NUM_THREADS of a CPU server (default: torch's own choice)")
    args = ap.parse_args()

    from ragen_mega.backends.sglang.client import EngineClient
    from ragen_mega.backends.sglang.server import launch_server
    from ragen_mega.models.prepare import cache_dir, make_tiny_model, prepare_smollm2

    smollm2 = prepare_smollm2()
    dirs = {"tiny": make_tiny_model(cache_dir() / "tiny" / "tiny-qwen2-untied", "qwen2",
                                    tokenizer_dir=smollm2),
            "smollm2": smollm2}
    table = []
    for name in args.models.split(","):
        start = time.perf_counter()
        with launch_server(dirs[name], dtype=args.dtype, startup_timeout=900,
                           cpu_threads=args.cpu_threads) as server:
            startup = time.perf_counter() - start
            with EngineClient(server.url, timeout=600) as client:
                gen = bench_generate(client, args.requests, args.prompt_len, args.new_tokens)
                row = {"model": name, "dtype": args.dtype, "startup_s": round(startup, 1), **gen}
                print(json.dumps(row), flush=True)
                table.append(f"| {name} generate | {args.dtype} | {args.requests} req x "
                             f"{args.prompt_len}+{args.new_tokens} tok | "
                             f"{gen['new_tok_per_s']} new tok/s (start-up {startup:.0f} s) |")
                if name == "smollm2":
                    for r in bench_sync(client, dirs[name], getattr(torch, args.dtype),
                                        args.sync_rounds):
                        print(json.dumps({"model": name, "dtype": args.dtype, **r}), flush=True)
                        table.append(f"| {name} {r['what']} | {args.dtype} | "
                                     f"{r['bytes'] / 2**20:.0f} MiB, {r['bucket_mb']} MiB buckets"
                                     f" | {r['seconds']} s |")
    print("\n| what | dtype | load | result |\n|---|---|---|---|")
    print("\n".join(table))


if __name__ == "__main__":
    main()
