"""Actor train-step throughput: ragen_mega's Megatron trainer vs plain transformers + torch.optim.

Both sides run the same StarPO step (forward, PPO clipped loss from ``ragen_mega.algo.losses``,
backward, grad clipping, AdamW) on the same HF checkpoint and the same random batch, in fp32, and
report loss-step tokens/s (all batch tokens, prompt included, per second of step time).

    python benchmarks/bench_train_step.py [--model smollm2|tiny] [--batch 4] [--seq 128]
                                          [--micro-batch 2] [--steps 3] [--tp 1]

Megatron runs in ``tp`` worker processes (``launch.run_workers``), transformers in this process;
each side gets all CPU cores (``--tp`` splits them). One warm-up step is not timed.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from ragen_mega.algo.losses import policy_loss
from ragen_mega.backends.megatron.launch import run_workers


def make_batch(vocab: int, batch: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(0)
    loss_mask = torch.zeros(batch, seq)
    loss_mask[:, seq // 2:] = 1  # second half = "response"
    return {"input_ids": torch.randint(0, vocab, (batch, seq), generator=g),
            "loss_mask": loss_mask, "advantages": torch.randn(batch, seq, generator=g),
            "old_logprobs": torch.full((batch, seq), -10.0)}


def _megatron_worker(rank, world_size, hf_dir, batch, micro_batch, steps):
    from ragen_mega.backends.megatron.train import MegatronTrainer, TrainerConfig

    trainer = MegatronTrainer(TrainerConfig(tp=world_size, micro_batch_size=micro_batch,
                                            lr=1e-5), hf_dir)
    trainer.train_actor(batch)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_actor(batch)
    return (time.perf_counter() - start) / steps


def transformers_step_time(hf_dir, batch, micro_batch, steps) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    mask = batch["loss_mask"][:, 1:]
    total = mask.sum()

    def step():
        opt.zero_grad()
        for lo in range(0, batch["input_ids"].shape[0], micro_batch):
            rows = slice(lo, lo + micro_batch)
            ids = batch["input_ids"][rows]
            logits = model(input_ids=ids).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            loss, _ = policy_loss(logp, batch["old_logprobs"][rows, 1:],
                                  batch["advantages"][rows, 1:], mask[rows], normalizer=total)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()

    from transformers import AutoConfig

    from ragen_mega.models.prepare import cache_dir, make_tiny_model, prepare_smollm2

    hf_dir = str(prepare_smollm2() if args.model == "smollm2"
                 else make_tiny_model(cache_dir() / "tiny" / "tiny-qwen2-untied", "qwen2"))
    batch = make_batch(AutoConfig.from_pretrained(hf_dir).vocab_size, args.batch, args.seq)
    cores = os.cpu_count() or 1
    mcore = run_workers(_megatron_worker, args.tp, hf_dir, batch, args.micro_batch, args.steps,
                        tp=args.tp, timeout=3600, threads_per_worker=max(1, cores // args.tp))[0]
    torch.set_num_threads(cores)
    hf = transformers_step_time(hf_dir, batch, args.micro_batch, args.steps)
    tokens = args.batch * args.seq
    print(f"model={args.model} batch={args.batch}x{args.seq} micro_batch={args.micro_batch} "
          f"steps={args.steps} tp={args.tp} cpu={platform.processor() or platform.machine()} "
          f"cores={cores} torch={torch.__version__}")
    print("| trainer | step time (s) | tokens/s |")
    print("|---|---|---|")
    print(f"| megatron-core (tp={args.tp}) | {mcore:.2f} | {tokens / mcore:.0f} |")
    print(f"| transformers + torch.optim | {hf:.2f} | {tokens / hf:.0f} |")
    print(f"megatron / transformers throughput ratio: {hf / mcore:.2f}")


if __name__ == "__main__":
    main()
