"""Is bf16 worth it on this CPU? SmolLM2's forward + backward in fp32 and under bf16 autocast
(transformers, one process), and a raw matmul of SmolLM2's shapes in each dtype.

CPUs with AVX512-BF16 or AMX (``grep -o 'avx512_bf16\\|amx_bf16' /proc/cpuinfo``) run bf16
matmuls through oneDNN's bf16 kernels; elsewhere bf16 is emulated and slower than fp32. This is
the first measurement behind a bf16 option for the CPU trainer and engine (fp32 master weights
stay as Megatron keeps them); the trainer-vs-engine log-prob gap in bf16 is not measured here.

    python benchmarks/bench_cpu_bf16.py [--batch 8] [--seq 256]
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from ragen_mega.models.prepare import prepare_smollm2

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(prepare_smollm2()), dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))

    def step(bf16: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids).logits.float().log_softmax(-1).mean()
        loss.backward()
        model.zero_grad()
        return time.perf_counter() - start

    for bf16 in (False, True, False, True):   # alternating, the best of two each
        print(f"{'bf16 autocast' if bf16 else 'fp32'}: {min(step(bf16) for _ in range(2)):.2f} s "
              f"forward + backward, {args.batch} x {args.seq} tokens", flush=True)
    a, b = torch.randn(2048, 576), torch.randn(576, 1536)
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        x @ y
        start = time.perf_counter()
        for _ in range(20):
            x @ y
        seconds = (time.perf_counter() - start) / 20
        print(f"{dtype}: {2 * 2048 * 576 * 1536 / seconds / 1e9:.0f} GFLOP/s, "
              f"2048 x 576 @ 576 x 1536")


if __name__ == "__main__":
    main()
