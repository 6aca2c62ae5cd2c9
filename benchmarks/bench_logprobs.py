"""The LM head's loss math: ragen_mega's vocab-parallel log-probs + entropy against plain autograd.

Every actor step ends in log-probs of the sampled tokens and the policy's entropy over the whole
vocabulary: [tokens x vocab] work that dominates small models and costs large-vocabulary models
(Qwen's 151 936 rows) their memory. Two implementations on the same fp32 logits:

- ``ragen_mega``: ``forward.vocab_parallel_logprobs_entropy`` (one autograd function with the
  analytic backward; one full-vocab tensor besides the logits for training, none for
  inference; the rest in blocks of rows);
- ``autograd``: ``log_softmax``, ``gather`` and ``-sum(p * log p)`` through autograd, as
  a plain PyTorch trainer writes them.

Two modes: ``train`` (log-probs and entropy, forward and backward of a weighted sum of both) and
``inference`` (log-probs only, no grad: the actor's and the reference's log-prob passes). Each
(implementation, mode) runs in a fresh process, so its peak memory is its own: the peak resident
memory above what the process held before the head's logits were made (so the logits count as
one full tensor; on a GPU: the peak CUDA allocation above it). The time is the mean of
``--repeats`` after one untimed warm-up.

    python benchmarks/bench_logprobs.py [--tokens 4096] [--vocab 49152] [--repeats 3]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import tempfile
import time

import torch

IMPLEMENTATIONS = ("ragen_mega", "autograd")
MODES = ("train", "inference")


def _autograd(logits, targets, entropy: bool):
    log_p = torch.log_softmax(logits.float(), dim=-1)
    logprobs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logprobs, (-(log_p.exp() * log_p).sum(dim=-1) if entropy else None)


def _ragen_mega(logits, targets, entropy: bool):
    import torch.distributed as dist

    from ragen_mega.backends.megatron.forward import vocab_parallel_logprobs_entropy

    return vocab_parallel_logprobs_entropy(logits, targets, vocab_size=logits.shape[-1],
                                           compute_entropy=entropy, tp_group=dist.group.WORLD)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak(device) -> int:
    """Start a peak-memory window; the bytes held now. On the CPU: Linux's resident high-water
    mark, reset through /proc/self/clear_refs."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def _peak(device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _status_bytes("VmHWM")


def _measure(impl: str, mode: str, tokens: int, vocab: int, repeats: int, store: str, out):
    """Child process: time one implementation in one mode; report (s, peak bytes, checksums)."""
    import torch.distributed as dist

    import ragen_mega.backends.megatron.forward  # noqa: F401 - imported before any measurement

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(tokens, vocab, generator=g) * 3).to(device)
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    w_lp, w_ent = (torch.randn(tokens, generator=g).to(device) for _ in range(2))
    train = mode == "train"

    def once():
        held = _reset_peak(device)
        logits = base.clone().requires_grad_(train)  # what the model's head hands over
        start = time.perf_counter()
        with torch.set_grad_enabled(train):
            if impl == "autograd":
                lp, ent = _autograd(logits, targets, entropy=train)
            else:
                lp, ent = _ragen_mega(logits, targets, entropy=train)
            if train:
                ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        took, peak = time.perf_counter() - start, _peak(device) - held
        sums = [float(lp.detach().sum(dtype=torch.float64))]
        if train:  # reductions only: a converted copy would be a full tensor of its own
            sums += [float(ent.detach().sum(dtype=torch.float64)), float(logits.grad.norm())]
        return took, peak, sums

    once()  # warm-up
    runs = [once() for _ in range(repeats)]
    out.put((sum(r[0] for r in runs) / repeats, max(r[1] for r in runs), runs[-1][2]))
    dist.destroy_process_group()


def measure(impl: str, mode: str, tokens: int, vocab: int, repeats: int):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        proc = ctx.Process(target=_measure,
                           args=(impl, mode, tokens, vocab, repeats, f"{tmp}/store", out))
        proc.start()
        while proc.is_alive() and out.empty():
            proc.join(timeout=1.0)
        if out.empty():
            raise RuntimeError(f"{impl}/{mode}: the measuring process exited with "
                               f"{proc.exitcode} (its traceback is above)")
        result = out.get()
        proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's; Qwen2.5's: 151936")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    print(f"tokens={args.tokens} vocab={args.vocab} fp32 device={device or 'cpu'} "
          f"torch={torch.__version__} threads={torch.get_num_threads()} "
          f"load={os.getloadavg()[0]:.1f}")
    full = args.tokens * args.vocab * 4 / 2**30
    print(f"one [tokens x vocab] fp32 tensor: {full:.2f} GiB\n")
    print("| mode | implementation | s | peak memory from the logits on (GiB) | x full tensors |")
    print("|---|---|---|---|---|")
    results = {}
    for mode in MODES:
        for impl in IMPLEMENTATIONS:
            took, peak, sums = measure(impl, mode, args.tokens, args.vocab, args.repeats)
            results[mode, impl] = (took, peak, sums)
            gib = peak / 2**30
            print(f"| {mode} | {impl} | {took:.3f} | {gib:.2f} | {gib / full:.1f} |")
    print()
    for mode in MODES:
        (t_r, p_r, s_r), (t_a, p_a, s_a) = results[mode, "ragen_mega"], results[mode, "autograd"]
        agree = max(abs(a - b) / max(abs(b), 1.0) for a, b in zip(s_r, s_a))
        print(f"{mode}: autograd / ragen_mega time ratio {t_a / t_r:.2f}, memory ratio "
              f"{p_a / max(p_r, 1):.2f} (checksums agree to {agree:.1e} relative)")


if __name__ == "__main__":
    main()
