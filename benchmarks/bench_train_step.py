"""Actor train-step throughput: ragen_mega's Megatron trainer vs plain transformers + torch.optim.

Both sides run the same StarPO step (forward, PPO clipped loss from ``ragen_mega.algo.losses``,
backward, grad clipping, AdamW) on the same HF checkpoint and the same random batch and report
loss-step tokens/s (all batch tokens, prompt included, per second of step time).

    python benchmarks/bench_train_step.py [--model smollm2|tiny|qwen2.5-0.5b|qwen2.5-1.5b]
                                          [--layers N] [--batch 4] [--seq 128]
                                          [--micro-batch 2] [--steps 3] [--tp 1] [--bf16]
                                          [--attention sdpa,unfused]

Megatron runs in ``tp`` worker processes (``launch.run_workers``), once per ``--attention`` (the
local layer spec's core attention, ``ActorConfig.local_attention``; one trainer after the
other in the same processes, each freed before the next, peak memory measured per trainer),
transformers in this process; on CPU each side gets all cores (``--tp`` splits them). One
warm-up step is not timed. The Qwen2.5
models are random weights in the published shapes (no hub here; the speed does not depend on
the values); ``--layers`` shortens them for a quick look. With a GPU both sides run on it:
``--bf16`` is Megatron's mixed precision (bf16 compute, fp32 main weights and grads in the
optimizer) against transformers' fp32 weights under ``torch.autocast(bfloat16)`` (HF Trainer's
bf16), and the model FLOP utilisation (MFU) is printed against ``--peak-tflops``.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from ragen_mega.algo.losses import policy_loss
from ragen_mega.backends.megatron.launch import run_workers
from ragen_mega.models.hf_config import LOCAL_ATTENTIONS


def make_batch(vocab: int, batch: int, seq: int, mixed: bool = False) -> dict:
    """Random rows of ``seq`` tokens, the second half of each row the "response"; ``mixed``:
    row lengths spread evenly from seq / 8 to seq (long-horizon turns next to short answers),
    right padded, rows shuffled."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.full((batch,), seq)
    if mixed:
        lengths = torch.linspace(seq // 8, seq, batch).long()[torch.randperm(batch, generator=g)]
    positions = torch.arange(seq)[None]
    attention_mask = (positions < lengths[:, None]).long()
    loss_mask = ((positions >= lengths[:, None] // 2) & (attention_mask > 0)).float()
    return {"input_ids": torch.randint(0, vocab, (batch, seq), generator=g) * attention_mask,
            "attention_mask": attention_mask, "loss_mask": loss_mask,
            "advantages": torch.randn(batch, seq, generator=g),
            "old_logprobs": torch.full((batch, seq), -10.0)}


# Published Qwen2.5 shapes (config.json of the hub models), random weights.
QWEN25_SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2),
}


def qwen25_random_dir(name: str, layers: int | None) -> str:
    """An HF directory with random bf16 weights in a Qwen2.5 shape (written once, cached)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from ragen_mega.models.prepare import atomic_dir, cache_dir

    shape = dict(QWEN25_SHAPES[name], **({"num_hidden_layers": layers} if layers else {}))

    def build(tmp):
        cfg = Qwen2Config(vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                          rms_norm_eps=1e-6, tie_word_embeddings=True, **shape)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp)

    return str(atomic_dir(cache_dir() / "bench" / f"{name}-random-{shape['num_hidden_layers']}l",
                          build))


def matmul_flops_per_token(hf_dir: str, seq: int) -> float:
    """Training FLOPs per token: 6 x the weights every token multiplies (the LM head included,
    embedding lookups not) plus causal-agnostic attention 12 x layers x hidden x seq."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q = c.num_attention_heads * head_dim
    kv = 2 * c.num_key_value_heads * head_dim
    per_layer = c.hidden_size * (q + kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    params = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size
    return 6 * params + 12 * c.num_hidden_layers * q * seq


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def _megatron_worker(rank, world_size, hf_dir, batch, micro_batch, steps, bf16, variants):
    """{label: (seconds per step, peak GiB, padding fraction)}: one trainer per variant (label,
    ActorConfig overrides), each freed before the next."""
    import gc

    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig

    out = {}
    for label, overrides in variants:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer = MegatronTrainer(ActorConfig(tp=world_size, micro_batch_size=micro_batch,
                                              lr=1e-5, bf16=bf16, **overrides), hf_dir)
        metrics = trainer.train(batch)  # warm-up
        _sync()
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train(batch)
        _sync()
        out[label] = (time.perf_counter() - start) / steps, _peak_gib(), metrics["padding_frac"]
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def transformers_step_time(hf_dir, batch, micro_batch, steps, bf16=False) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    mask = batch["loss_mask"][:, 1:]
    total = mask.sum()

    def step():
        opt.zero_grad()
        for lo in range(0, batch["input_ids"].shape[0], micro_batch):
            rows = slice(lo, lo + micro_batch)
            ids = batch["input_ids"][rows]
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                logits = model(input_ids=ids).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            loss, _ = policy_loss(logp, batch["old_logprobs"][rows, 1:],
                                  batch["advantages"][rows, 1:], mask[rows], normalizer=total)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step()  # warm-up
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync()
    return (time.perf_counter() - start) / steps, _peak_gib()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "tiny", *QWEN25_SHAPES), default="smollm2")
    parser.add_argument("--layers", type=int, default=None, help="shorten a Qwen2.5 shape")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPU only)")
    parser.add_argument("--attention", default="sdpa",
                        help="comma-separated Megatron local-spec core attentions to time "
                             "(sdpa, unfused), each its own trainer")
    parser.add_argument("--mixed-lengths", action="store_true",
                        help="row lengths from seq/8 to seq (right padded) instead of all seq")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=None,
                        help="also time the first attention with token-budget micro-batches")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the accelerator's dense bf16 peak for MFU (H100/H200 SXM: 989)")
    args = parser.parse_args()

    from transformers import AutoConfig

    from ragen_mega.models.prepare import cache_dir, make_tiny_model, prepare_smollm2

    if args.model == "smollm2":
        hf_dir = str(prepare_smollm2())
    elif args.model == "tiny":
        hf_dir = str(make_tiny_model(cache_dir() / "tiny" / "tiny-qwen2-untied", "qwen2"))
    else:
        hf_dir = qwen25_random_dir(args.model, args.layers)
    attentions = args.attention.split(",")
    for attention in attentions:
        if attention not in LOCAL_ATTENTIONS:
            parser.error(f"--attention: {attention!r} is not one of {LOCAL_ATTENTIONS}")
    batch = make_batch(AutoConfig.from_pretrained(hf_dir).vocab_size, args.batch, args.seq,
                       args.mixed_lengths)
    variants = [(f"{a} attention", {"local_attention": a}) for a in attentions]
    budget = args.max_tokens_per_micro_batch
    if budget:
        variants.append((f"{attentions[0]} attention, <= {budget} tokens per micro-batch",
                         {"local_attention": attentions[0], "max_tokens_per_micro_batch": budget}))
    cores = os.cpu_count() or 1
    mcore = run_workers(_megatron_worker, args.tp, hf_dir, batch, args.micro_batch, args.steps,
                        args.bf16, variants, tp=args.tp, timeout=3600,
                        threads_per_worker=max(1, cores // args.tp))[0]
    torch.set_num_threads(cores)
    hf = transformers_step_time(hf_dir, batch, args.micro_batch, args.steps, args.bf16)
    tokens = int(batch["attention_mask"].sum())  # real tokens, padding not counted
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"cpu={platform.processor() or platform.machine()} cores={cores}")
    print(f"model={args.model} layers={args.layers or 'all'} batch={args.batch}x{args.seq} "
          f"micro_batch={args.micro_batch} steps={args.steps} tp={args.tp} "
          f"lengths={'mixed' if args.mixed_lengths else 'all seq'} "
          f"dtype={'bf16' if args.bf16 else 'fp32'} device={device} torch={torch.__version__}")
    flops = matmul_flops_per_token(hf_dir, args.seq) * tokens
    rows = {f"megatron-core (tp={args.tp}, {label})": mcore[label] for label, _ in variants}
    rows["transformers + torch.optim"] = (*hf, float("nan"))
    print("| trainer | step time (s) | tokens/s | MFU | peak GPU mem (GiB) | padding |")
    print("|---|---|---|---|---|---|")
    for name, (t, gib, padding) in rows.items():
        mfu = flops / t / (args.peak_tflops * 1e12 * args.tp) if torch.cuda.is_available() else None
        print(f"| {name} | {t:.3f} | {tokens / t:.0f} | "
              f"{'-' if mfu is None else f'{mfu:.1%}'} | {gib:.1f} | "
              f"{'-' if padding != padding else f'{padding:.1%}'} |")
    for label, _ in variants:
        print(f"megatron ({label}) / transformers throughput ratio: "
              f"{hf[0] / mcore[label][0]:.2f}")
    first = variants[0][0]
    for label, _ in variants[1:]:
        print(f"megatron ({first}) / ({label}) throughput ratio: "
              f"{mcore[label][0] / mcore[first][0]:.2f}")


if __name__ == "__main__":
    main()
