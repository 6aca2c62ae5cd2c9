"""Which physical GPUs a group of placement-group bundles holds, found by asking Ray in each one.

An engine spans ``engine_tp`` bundles but its Ray actor takes resources from one, so it asks for
no GPU and Ray sets no ``CUDA_VISIBLE_DEVICES`` for it: its server would start on GPUs 0..tp-1,
on top of trainer rank 0 or another engine (docs/design.md, "Placement: disaggregated and
colocated"). So one tiny task per bundle asks Ray which GPU that bundle holds. It asks for
:data:`PROBE_GPUS` and no CPU, so it also fits a colocated bundle whose trainer rank holds half
the GPU, and gets that same GPU (a bundle's GPU is one device).
"""
from __future__ import annotations

from typing import Sequence

PROBE_GPUS = 0.01  # fits next to a colocated trainer rank's 0.5 and an engine actor's 0


def _where_am_i() -> tuple[str, str, list[str]]:
    import ray

    return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
            [str(i) for i in ray.get_gpu_ids()])


def bundle_gpu_ids(pg, bundle_indices: Sequence[int], *, what: str = "engine",
                   timeout_s: float = 120.0) -> list[str] | None:
    """The GPU ids (as ``CUDA_VISIBLE_DEVICES`` spells them) of ``pg``'s bundles
    ``bundle_indices``, in bundle order, or ``None`` when these bundles hold no GPU (a CPU run:
    nothing is probed).

    Raises ``RuntimeError`` when the bundles lie on more than one node (one SGLang TP group runs
    on one node), naming ``what`` and each bundle's node, or when a probe does not finish in
    ``timeout_s`` (a bundle whose GPU is fully taken by another actor).
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not all(pg.bundle_specs[b].get("GPU", 0) > 0 for b in bundle_indices):
        return None
    probe = ray.remote(_where_am_i)
    refs = [probe.options(num_cpus=0, num_gpus=PROBE_GPUS,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              placement_group=pg, placement_group_bundle_index=b)).remote()
            for b in bundle_indices]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(ready) < len(refs):
        for ref in refs:
            ray.cancel(ref)
        raise RuntimeError(f"{what}: the GPU probe of bundles {list(bundle_indices)} did not run "
                           f"within {timeout_s:.0f}s (is a bundle's GPU fully held by an actor?)")
    found = ray.get(refs)
    if len({node for node, _, _ in found}) > 1:
        where = ", ".join(f"bundle {b} on node {ip} ({node[:8]})"
                          for b, (node, ip, _) in zip(bundle_indices, found))
        raise RuntimeError(f"{what}: its bundles span several nodes ({where}); an SGLang "
                           f"tensor-parallel group must run on one node: rollout.engine_tp must "
                           f"be at most the GPUs per node and the engines' bundles (which follow "
                           f"the trainer's) must not straddle a node boundary")
    return [gpu for _, _, ids in found for gpu in ids]
