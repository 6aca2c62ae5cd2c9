"""Where every process of a run lives: one Ray placement group, bundles assigned by role.

A run has trainer ranks (TP x PP x DP), SGLang engines (each spanning ``engine_tp`` devices) and
env workers. Two layouts, as slime has them:

- **disaggregated**: trainer ranks and engines get separate bundles (separate GPUs); weights go
  from trainer to engines by broadcast.
- **colocated**: engine ``e`` shares the bundles of trainer ranks ``e*engine_tp ..``; engines
  release their memory while the trainer trains.

On a CPU machine bundles hold fractional CPUs (``cpus_per_bundle``), so a whole run fits on 2
cores; on GPU each bundle holds one GPU. Trainer bundles come first, so rank ``r`` sits in bundle
``r`` and ``PACK`` keeps consecutive ranks (a TP group) on one node when it fits.
"""
from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    """Bundles of one placement group and which role uses which bundle index."""
    bundles: list[dict[str, float]]
    trainer_bundles: list[int]
    engine_bundles: list[list[int]]
    env_worker_bundles: list[int]


def plan_placement(*, num_trainer_ranks: int, num_engines: int, engine_tp: int = 1,
                   num_env_workers: int = 0, colocate: bool = False, use_gpu: bool = False,
                   cpus_per_bundle: float = 1.0, cpus_per_env_worker: float = 0.1) -> PlacementPlan:
    """Lay out bundles for a run; impossible layouts raise ``ValueError`` naming the knob."""
    if num_trainer_ranks < 1:
        raise ValueError(f"num_trainer_ranks must be >= 1, got {num_trainer_ranks}")
    if num_engines < 1 or engine_tp < 1:
        raise ValueError(f"num_engines and engine_tp must be >= 1, got {num_engines}, {engine_tp}")
    if cpus_per_bundle <= 0:
        raise ValueError(f"cpus_per_bundle must be > 0, got {cpus_per_bundle}")
    device = {"GPU": 1.0} if use_gpu else {}
    unit = {"CPU": cpus_per_bundle, **device}
    bundles = [dict(unit) for _ in range(num_trainer_ranks)]
    trainer = list(range(num_trainer_ranks))
    if colocate:
        if num_engines * engine_tp > num_trainer_ranks:
            raise ValueError(
                f"colocate: {num_engines} engines x engine_tp {engine_tp} need "
                f"{num_engines * engine_tp} devices but the trainer has {num_trainer_ranks}")
        engines = [trainer[e * engine_tp:(e + 1) * engine_tp] for e in range(num_engines)]
    else:
        engines = []
        for _ in range(num_engines):
            engines.append(list(range(len(bundles), len(bundles) + engine_tp)))
            bundles.extend(dict(unit) for _ in range(engine_tp))
    env_workers = list(range(len(bundles), len(bundles) + num_env_workers))
    bundles.extend({"CPU": cpus_per_env_worker} for _ in range(num_env_workers))
    return PlacementPlan(bundles, trainer, engines, env_workers)


def create_placement_group(plan: PlacementPlan, strategy: Literal["PACK", "SPREAD", "STRICT_PACK",
                                                                  "STRICT_SPREAD"] = "PACK",
                           timeout_s: float = 60.0):
    """Reserve ``plan.bundles`` in the Ray cluster; a cluster too small is a clear error."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(plan.bundles, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        need = {k: sum(b.get(k, 0.0) for b in plan.bundles) for k in ("CPU", "GPU")}
        raise RuntimeError(
            f"placement group of {len(plan.bundles)} bundles ({need}) not ready after "
            f"{timeout_s:.0f}s; the cluster has {ray.cluster_resources()}")
    return pg
