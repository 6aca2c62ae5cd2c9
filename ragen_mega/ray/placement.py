"""Where every process of a run lives: one Ray placement group, bundles assigned by role.

Trainer ranks (TP x PP x DP), SGLang engines (``engine_tp`` bundles each) and env workers, in
slime's two layouts, disaggregated or colocated (docs/design.md, "Placement: disaggregated and
colocated"). A bundle holds one GPU, or fractional CPUs (``cpus_per_bundle``) on a CPU machine.
Trainer bundles come first, so rank ``r`` sits in bundle ``r`` and ``PACK`` keeps consecutive
ranks (a TP group) on one node when it fits.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ragen_mega.config import RunConfig


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
    """Lay out bundles for a run; impossible layouts raise ``ValueError`` naming the knob.
    ``num_trainer_ranks=0``: engines (and env workers) only, as ``ragen-mega eval`` places them;
    ``num_engines=0``: trainer ranks only, as ``ragen-mega sft`` places them."""
    if num_trainer_ranks < 0 or num_engines < 0:
        raise ValueError(f"num_trainer_ranks and num_engines must be >= 0, got "
                         f"{num_trainer_ranks}, {num_engines}")
    if num_trainer_ranks + num_engines == 0:
        raise ValueError("nothing to place: num_trainer_ranks and num_engines are both 0")
    if engine_tp < 1:
        raise ValueError(f"engine_tp must be >= 1, got {engine_tp}")
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


def bundle_cpus(cluster_cpus: float, n_bundles: int, n_env_workers: int,
                use_gpu: bool) -> tuple[float, float]:
    """CPUs reserved by each trainer-rank/engine bundle and by each env-worker bundle. On GPU: a
    core each, so many env workers spread over the cluster's CPUs. On CPU the whole run shares the
    machine: an env worker reserves a quarter of what a trainer rank or engine does (it is busy
    only between generations), rounded down to Ray's resource unit (1e-4) so the sum fits."""
    if use_gpu:
        return 1.0, 1.0
    cpus = min(1.0, math.floor(cluster_cpus / (n_bundles + n_env_workers / 4) * 1e4) / 1e4)
    return cpus, math.floor(cpus / 4 * 1e4) / 1e4


@dataclasses.dataclass(frozen=True)
class ResourcePlan:
    """What each process of a run reserves, and where it sits (``placement``)."""
    placement: PlacementPlan
    actor_world: int             # actor ranks: TP x PP x DP
    critic_world: int            # critic ranks (0: no critic)
    engine_cpus: float           # CPUs of each engine worker's Ray actor
    trainer_cpus: float          # ... of each trainer rank's
    trainer_gpus: float          # GPUs of each trainer rank (a half when it shares with an engine)
    env_worker_cpus: float
    trainer_threads: int | None  # torch threads per trainer rank; None: Ray's choice (GPU)

    @property
    def actor_bundles(self) -> list[int]:
        return self.placement.trainer_bundles[:self.actor_world]

    @property
    def critic_bundles(self) -> list[int]:
        return self.placement.trainer_bundles[self.actor_world:]


def plan_resources(cfg: RunConfig, *, cluster_cpus: float, host_cpus: int, use_gpu: bool,
                   with_trainers: bool = True, with_engines: bool = True) -> ResourcePlan:
    """The run's bundles and per-process reservations from its config and the cluster's size.

    Colocated, an engine and a trainer rank share a bundle, so each takes half its CPUs (and, on
    GPU, half the device). Ray gives an actor with a fractional CPU one OpenMP thread; on CPU the
    phases (rollout, critic, actor) run one after another, so each trainer rank may use the
    ``host_cpus`` it shares with the ranks of the other role. ``with_trainers=False``: engines
    and env workers only (``ragen-mega eval``); ``with_engines=False``: the trainer ranks only
    (``ragen-mega sft``)."""
    dp = cfg.trainer.data_parallel
    colocate = cfg.trainer.colocate and with_trainers and with_engines
    actor_world = cfg.actor.tp * cfg.actor.pp * dp if with_trainers else 0
    critic_world = cfg.critic.tp * cfg.critic.pp * dp if cfg.critic.enable and with_trainers else 0
    num_engines = cfg.rollout.num_engines if with_engines else 0
    engine_devices = num_engines * cfg.rollout.engine_tp
    n_bundles = actor_world + critic_world + (0 if colocate else engine_devices)
    n_env = cfg.rollout.env_workers if with_engines else 0
    cpus, env_cpus = bundle_cpus(cluster_cpus, n_bundles, n_env, use_gpu)
    placement = plan_placement(num_trainer_ranks=actor_world + critic_world,
                               num_engines=num_engines,
                               engine_tp=cfg.rollout.engine_tp, colocate=colocate,
                               use_gpu=use_gpu, cpus_per_bundle=cpus, num_env_workers=n_env,
                               cpus_per_env_worker=env_cpus)
    shared = cpus / 2 if colocate else cpus
    return ResourcePlan(
        placement, actor_world, critic_world, engine_cpus=shared, trainer_cpus=shared,
        trainer_gpus=(0.5 if colocate else 1.0) if use_gpu else 0.0, env_worker_cpus=env_cpus,
        trainer_threads=None if use_gpu else max(1, host_cpus // max(actor_world, critic_world, 1)))


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
