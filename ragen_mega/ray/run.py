"""A run's placed pieces (SGLang engines, the Megatron actor and critic, env workers) in one
placement group, wired together: :func:`build_run` starts (or joins) Ray and places them;
:class:`Run` holds them, syncs the actor's weights into the engines (taking colocated engines'
memory back) and stops them. No loop (``train.py``), no rollout logic (``rollout/manager.py``):
docs/design.md, "The loop, the rollout manager, the run". A restarted engine gets the served
weights from the engine supervisor, through :class:`~ragen_mega.ray.weight_channel.TrainerWeights`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ragen_mega.algo.objectives import OBJECTIVES
from ragen_mega.config import RunConfig
from ragen_mega.models.prepare import resolve_model
from ragen_mega.ray.placement import ResourcePlan
from ragen_mega.ray.weight_channel import TrainerWeights
from ragen_mega.rollout.manager import RolloutManager
from ragen_mega.rollout.remote_env import RemoteEnvs

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup
    from transformers import PreTrainedTokenizerBase

    from ragen_mega.ray.engine_group import EngineGroup
    from ragen_mega.ray.env_workers import EnvWorkerGroup
    from ragen_mega.ray.trainer_group import TrainerGroup
    from ragen_mega.rollout.source import RolloutSource


@dataclasses.dataclass
class Run:
    """The placed pieces of a run; whatever is not None yet is stopped by :meth:`shutdown`."""
    cfg: RunConfig
    model_dir: str
    tokenizer: PreTrainedTokenizerBase
    resources: ResourcePlan
    placement_group: PlacementGroup
    engines: EngineGroup | None = None
    actor: TrainerGroup | None = None
    critic: TrainerGroup | None = None
    env_workers: EnvWorkerGroup | None = None   # None: the envs live in the driver
    rollouts: RolloutManager | None = None   # plays the run's rollouts on its engines
    #: the loop takes each step's rollout from it, as ``trainer.async_mode`` plays them
    source: RolloutSource | None = None
    #: the actor's weights as the engines get them (and a restarted engine is brought to)
    weights: TrainerWeights = dataclasses.field(default_factory=TrainerWeights)

    @property
    def weight_version(self) -> int:
        """The trainer step whose weights the engines serve."""
        return self.weights.version

    def shutdown(self) -> None:
        """Stop what this run started: trainer actors first (the actor closes its weight-update
        group with the live engines), then engines, env workers, the placement group. Every
        piece is stopped even if stopping another one fails."""
        from ray.util.placement_group import remove_placement_group

        with contextlib.ExitStack() as stack:  # callbacks run last-in first-out
            stack.callback(remove_placement_group, self.placement_group)
            if self.env_workers is not None:
                stack.callback(self.env_workers.kill)
            if self.engines is not None:
                stack.callback(self.engines.shutdown)
            if self.critic is not None:
                stack.callback(self.critic.kill)
            if self.actor is not None:
                stack.callback(self.actor.kill)

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the actor's weights into every engine as ``version``. An engine that died since
        the rollout (the train phase) is restarted first; it and any restarted during an
        overlapped rollout join the weight-update group, so this one sync gives them the weights.
        An engine that dies during the sync fails it on every trainer rank; then every engine is
        restarted and the sync made again (``EngineSupervisor.recover(error,
        broken_sync=True)``), as often as the step's restart allowance lets it. Colocated
        engines, released here (after start-up and each rollout), take their weight memory back
        first and their KV cache once the weights are in (slime's order). A replayed run
        (``trainer.replay_rollouts``) has no engine: nothing is sent."""
        if self.engines is None:
            self.weights.version = version
            return {}
        supervisor = self.engines.supervisor
        restarted = {**supervisor.unsynced_urls(), **supervisor.recover(None)}
        self.engines.resume_memory(["weights"])
        # async_mode=fully: the rollout plays on; its requests wait between two tokens
        with (self.engines.generation_paused() if self.cfg.trainer.async_mode == "fully"
              else contextlib.nullcontext()):
            while True:  # ends with a sync, or an error: no engine dead, or too many restarts
                try:
                    metrics = self.weights.push(version, restarted)
                    break
                except Exception as error:  # noqa: BLE001 - re-raised unless an engine died
                    restarted = supervisor.recover(error, broken_sync=True)
                    self.engines.resume_memory(["weights"])
        supervisor.synced(restarted)
        if _sync_mode(self.cfg) == "lora":
            from ragen_mega.backends.sglang.lora_serving import adapter_name

            self.engines.adapter = (adapter_name(version), version)   # new requests use it
        self.engines.resume_memory(["kv_cache"])
        return metrics


def _lora_targets(cfg: RunConfig) -> tuple[str, ...]:
    """The modules whose adapters the engines merge (``actor.lora``); none for a full-weight
    run, or one whose syncs send merged weights (said in the log: a sync then moves the whole
    model)."""
    lora = cfg.actor.lora
    if not lora.rank or lora.sync == "native":
        return ()
    if lora.sync == "merged":
        print("ragen-mega: actor.lora.sync=merged: every weight sync sends the merged weights "
              "whole, not the adapters alone", file=sys.stderr, flush=True)
        return ()
    return tuple(lora.target_modules)


def _lora_serving(cfg: RunConfig) -> tuple[int, tuple[str, ...]] | None:
    """(rank, target modules) of the adapters the engines serve by name
    (``actor.lora.sync: native``); None otherwise."""
    lora = cfg.actor.lora
    if not lora.rank or lora.sync != "native":
        return None
    return lora.rank, tuple(lora.target_modules)


def _sync_mode(cfg: RunConfig) -> str:
    """How a weight sync reaches the engines (``ray/weight_channel.py``): "lora" (they serve
    the adapters by name), "tensor" (colocated: shared memory) or "distributed" (a broadcast
    group)."""
    if _lora_serving(cfg) is not None:
        return "lora"
    return "tensor" if cfg.trainer.colocate else "distributed"


@contextlib.contextmanager
def build_run(cfg: RunConfig, *, with_trainers: bool = True,
              with_engines: bool = True) -> Iterator[Run]:
    """Start Ray (or join it), place engines, trainers and env workers, connect the weight sync;
    on leaving the block (also when building fails halfway) stop whatever was started.
    ``with_trainers=False``: engines and env workers only, serving ``model.path`` as it is;
    ``with_engines=False``: the trainers only (a replayed run: ``run.rollouts`` is then the
    caller's to set)."""
    from transformers import AutoTokenizer

    from ragen_mega.ray.cluster import init_ray
    from ragen_mega.ray.placement import create_placement_group, plan_resources

    model_dir = resolve_model(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    init_ray(cfg.trainer.ray_address)
    import ray

    resources = plan_resources(cfg, cluster_cpus=ray.cluster_resources().get("CPU", 1),
                               host_cpus=os.cpu_count() or 1, use_gpu=torch.cuda.is_available(),
                               with_trainers=with_trainers, with_engines=with_engines)
    run = Run(cfg, model_dir, tokenizer, resources, create_placement_group(resources.placement))
    try:
        if with_engines:
            _place(run, with_trainers)
        else:
            _start_trainers(run)
        yield run
    except BaseException:
        try:  # the error that stopped the run is the one to report, not a teardown's
            run.shutdown()
        except Exception as e:  # noqa: BLE001 - reported, then the original is re-raised
            warnings.warn(f"stopping the run after an error also failed: {e!r}")
        raise
    run.shutdown()


def _routing_shape(model_dir: str) -> tuple[int, int, int] | None:
    """(layers, top-k, experts) of a mixture of experts, whose engines return each token's
    experts (routing replay and ``actor/routing_mismatch``); None for a dense model."""
    from ragen_mega.models.hf_config import model_spec

    spec = model_spec(model_dir)
    return (spec.num_layers, spec.moe_top_k, spec.num_experts) if spec.is_moe else None


def _place(run: Run, with_trainers: bool) -> None:
    """Start the run's processes, each kept in ``run`` as soon as it exists. Trainer ranks on
    devices of their own build their models while the engines start (Ray creates actors in the
    background; the first call waits), so the run's two longest start-ups overlap. Colocated
    trainer ranks wait for the engines to release the devices."""
    from ragen_mega.ray.engine_group import EngineGroup
    from ragen_mega.ray.env_workers import EnvWorkerGroup

    cfg, res, pg, t = run.cfg, run.resources, run.placement_group, run.cfg.trainer
    log_dir = Path(t.run_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if with_trainers and not t.colocate:
        _start_trainers(run)
    engines = run.engines = EngineGroup(run.model_dir, pg, res.placement.engine_bundles,
                              tp=cfg.rollout.engine_tp, dtype=cfg.model.dtype,
                              log_dir=str(log_dir.resolve()), num_cpus=res.engine_cpus,
                              seeded_sampling=cfg.rollout.seeded, memory_saver=t.colocate,
                              mem_fraction=cfg.rollout.mem_fraction,
                              max_restarts_per_step=cfg.rollout.max_engine_restarts_per_step,
                              ep=cfg.rollout.engine_ep,
                              routed_experts=_routing_shape(run.model_dir),
                              weights=run.weights if with_trainers else None,
                              fault_log=Path(t.run_dir) / "faults.jsonl",
                              lora_targets=_lora_targets(cfg) if with_trainers else (),
                              lora_serving=_lora_serving(cfg) if with_trainers else None,
                              batch_requests=cfg.rollout.batch_requests)
    open_env = None  # envs built in the driver
    if res.placement.env_worker_bundles:
        run.env_workers = EnvWorkerGroup(pg, res.placement.env_worker_bundles,
                                         num_cpus=res.env_worker_cpus)
        open_env = run.env_workers.open
    elif cfg.env.remote:
        open_env = RemoteEnvs(cfg.env.remote, cfg.env.remote_timeout_s).open
    run.rollouts = RolloutManager(cfg, run.tokenizer, engines, open_env)
    if not with_trainers:
        return
    if t.colocate:  # the trainer ranks about to be built need the shared devices
        run.engines.release_memory()
        _start_trainers(run)
    run.actor.connect_engines(run.engines.urls, run.engines.tp_sizes, mode=_sync_mode(cfg),
                              bucket_bytes=t.sync_bucket_mb << 20, api_key=run.engines.api_key,
                              adapter_dir=str((Path(t.run_dir) / "lora_adapters").resolve()))


def _start_trainers(run: Run) -> None:
    """Create the actor's (and the critic's) trainer ranks: they build their models in the
    background, and the first call to them waits for that."""
    from ragen_mega.ray.trainer_group import TrainerGroup

    cfg, res, pg, t = run.cfg, run.resources, run.placement_group, run.cfg.trainer
    place = dict(num_cpus=res.trainer_cpus, num_gpus=res.trainer_gpus,
                 threads=res.trainer_threads, seed=t.seed)
    run.actor = TrainerGroup("actor", run.model_dir, cfg.actor, pg, res.actor_bundles, **place,
                             objective=OBJECTIVES["actor"](
                                 cfg.actor, reference=cfg.algo.kl_in_reward > 0),
                             total_steps=max(t.total_steps - cfg.critic.warmup_steps,
                                             cfg.actor.lr_warmup_steps + 1),
                             temperature=max(cfg.rollout.temperature, 1e-6))
    run.weights.actor = run.actor
    if cfg.critic.enable:
        run.critic = TrainerGroup("critic", run.model_dir, cfg.critic, pg, res.critic_bundles,
                                  **place, objective=OBJECTIVES["critic"](cfg.critic),
                                  total_steps=max(t.total_steps, cfg.critic.lr_warmup_steps + 1))
