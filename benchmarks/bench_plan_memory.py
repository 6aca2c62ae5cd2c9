"""``ragen-mega plan``'s memory estimate of a trainer rank against one measured on this CPU.

One SmolLM2 actor update in this process (Megatron TP 1, fp32, gloo): the bytes autograd saves
for the backward pass (a ``saved_tensors_hooks`` pack hook, each storage counted once, the
weights left out) and the process's peak RSS during the update (Linux ``VmHWM``, reset through
``/proc/self/clear_refs`` just before), next to what ``ragen_mega.plan.trainer_memory`` says for
the same micro-batch and sequence length. The import and model-build baseline (RSS before the
update) is printed too: for small models it dominates the process.

    python benchmarks/bench_plan_memory.py [--batch 8] [--seq 279] [--micro-batches 1]

Several micro-batches show glibc keeping the freed memory of the one before (the plan counts the
micro-batches in flight, one without pipelining); ``MALLOC_MMAP_THRESHOLD_=1048576`` in the
environment returns it to the system.
"""
from __future__ import annotations

import argparse
import gc
import json
import tempfile

import torch

GiB = 1 << 30


def status_bytes(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--seq", type=int, default=279, help="tokens per row")
    parser.add_argument("--micro-batches", type=int, default=1)
    args = parser.parse_args()
    from ragen_mega.backends.megatron.parallel import file_init_method, init_parallel
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig, load_run_config
    from ragen_mega.models.hf_config import model_spec
    from ragen_mega.models.prepare import prepare_smollm2
    from ragen_mega.plan import trainer_memory

    hf = str(prepare_smollm2())
    init_parallel(0, 1, file_init_method(tempfile.mkdtemp()), tp=1, pp=1)
    b, s, n = args.batch, args.seq, args.micro_batches
    trainer = MegatronTrainer(ActorConfig(micro_batch_size=b, lr=1e-6), hf, total_steps=10)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 49152, (n * b, s), generator=g),
             "attention_mask": torch.ones(n * b, s, dtype=torch.long),
             "loss_mask": torch.ones(n * b, s), "advantages": torch.randn(n * b, s, generator=g)}
    batch["old_logprobs"] = trainer.compute_logprobs(batch)
    weights = {p.untyped_storage().data_ptr() for c in trainer.model for p in c.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    gc.collect()
    before = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # the high-water mark from here on
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train(batch)
    peak = status_bytes("VmHWM")
    cfg = load_run_config(None, ["critic.enable=false", "algo.adv_estimator=grpo",
                                 f"actor.micro_batch_size={b}"])
    plan = trainer_memory(model_spec(hf), cfg, "actor", 0, s, gpu=False)
    print(json.dumps({"batch": b, "seq": s, "micro_batches": n,
                      "rss_before_update_gib": before / GiB, "peak_rss_gib": peak / GiB,
                      "autograd_saved_gib": sum(saved.values()) / GiB,
                      "plan_activations_and_logits_gib": (plan.activations + plan.logits) / GiB,
                      "plan_total_gib": plan.total / GiB}, indent=1))


if __name__ == "__main__":
    main()
