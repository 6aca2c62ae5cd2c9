"""Is bf16 worth it on this CPU? SmolLM2's forward + backward in fp32 and under bf16 autocast
(transformers, one process), and a raw matmul of SmolLM2's shapes in each dtype.

CPUs with AVX512-BF16 or AMX (``grep -o 'avx512_bf16\\|amx_bf16' /proc/cpuinfo``) run bf16
matmuls through oneDNN's bf16 kernels; elsewhere bf16 is emulated and slower than fp32.

``--stack CONFIG``: the whole stack instead, ``ragen-mega train CONFIG`` for ``--steps`` steps
in fp32, then with the trainers (``actor.bf16``, ``critic.bf16``; fp32 main weights in Adam) and
the engines (``model.dtype``) in bf16, the trainer recomputing the old log-probs in both
(``algo.use_rollout_logprobs=false``) so that ``train/rollout_vs_trainer_logprob_diff`` (the
mean |engine - trainer| log-prob of the sampled tokens) is measured. The medians over steps 2..
of the step's phases (rollout, old log-probs, update, sync) and of that difference. The bf16
run bypasses the start-up check's bf16 rule (``ragen-mega train`` refuses bf16 on a CPU:
``preflight.check_bf16``, whose reasons these measurements are).

    python benchmarks/bench_cpu_bf16.py [--batch 8] [--seq 256]
    python benchmarks/bench_cpu_bf16.py --stack examples/bandit_cpu_demo.yaml [--steps 3]
        [--model smollm2] [key=value ...]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_small_model_step import STACK_PHASES, run_stack  # noqa: E402

#: the CLI with the start-up check's bf16 rule left out (``ragen-mega train`` refuses bf16 on
#: a CPU; the benchmark measures it anyway)
FORCED_BF16_CLI = ("-c", "import sys; import ragen_mega.preflight as p; "
                        "p.check_bf16 = lambda cfg: None; from ragen_mega.cli import main; "
                        "sys.exit(main())")
LOGPROB_DIFF = "train/rollout_vs_trainer_logprob_diff"


def stack(config: str, model: str, steps: int, extra: list[str]) -> None:
    """The stack's step in fp32 and in bf16 (module docstring), one after the other."""
    caps = torch.cpu.get_capabilities()
    native = bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    common = ["algo.use_rollout_logprobs=false", *extra]
    bf16 = ["actor.bf16=true", "critic.bf16=true", "model.dtype=bfloat16"]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench_cpu_bf16_") as tmp:
        for name, overrides in (("fp32", []), ("bf16", bf16)):
            launch = ("-m", "ragen_mega.cli") if name == "fp32" else FORCED_BF16_CLI
            rows[name] = run_stack(config, model, steps, Path(tmp) / name,
                                   [*common, *overrides], python_args=launch,
                                   extra_keys=(LOGPROB_DIFF,))
    print(f"| dtype | step s | {' | '.join(STACK_PHASES)} | {LOGPROB_DIFF} |")
    print("|---|---|" + "---|" * (len(STACK_PHASES) + 1))
    for name, row in rows.items():
        print(f"| {name} | {row['step_s']:.2f} | "
              + " | ".join(f"{row.get(k, float('nan')):.2f}" for k in STACK_PHASES)
              + f" | {row.get(LOGPROB_DIFF, float('nan')):.4f} |")
    print(f"bf16 / fp32 step time: {rows['bf16']['step_s'] / rows['fp32']['step_s']:.2f}x; "
          f"this CPU {'has' if native else 'lacks'} bf16 instructions (AVX512-BF16 or AMX)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--stack", metavar="CONFIG", help="time the whole stack on CONFIG")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default="smollm2")
    args, extra = parser.parse_known_args()
    if args.stack:
        stack(args.stack, args.model, args.steps, extra)
        return
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
