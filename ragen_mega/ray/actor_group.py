"""A group of Ray actors of one class, one per placement-group bundle, called together.

Trainer ranks are SPMD: every rank must enter the same collective call, so the driver calls a
method on all of them at once (``call``) and gets their results in rank order. Errors from any
rank come back with the rank named.
"""
from __future__ import annotations

from typing import Any, Sequence


class ActorGroup:
    """``num`` actors of ``actor_cls``; actor ``i`` in ``bundle_indices[i]`` of ``pg``."""

    def __init__(self, actor_cls: type, pg, bundle_indices: Sequence[int], *,
                 num_cpus: float, num_gpus: float = 0.0, env_vars: dict[str, str] | None = None,
                 init_args: Sequence[Any] = ()):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote_cls = ray.remote(actor_cls)
        self.actors = []
        for rank, bundle in enumerate(bundle_indices):
            options = dict(
                num_cpus=num_cpus, num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle),
                runtime_env={"env_vars": dict(env_vars or {})})
            self.actors.append(remote_cls.options(**options).remote(rank, len(bundle_indices),
                                                                    *init_args))

    def __len__(self) -> int:
        return len(self.actors)

    def call_async(self, method: str, *args, **kwargs) -> list:
        """Start ``method`` on every actor; return the object refs in rank order."""
        return [getattr(actor, method).remote(*args, **kwargs) for actor in self.actors]

    def call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Run ``method`` on every actor at once and return the results in rank order."""
        return gather(self.call_async(method, *args, **kwargs), what=method, timeout_s=timeout_s)

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def gather(refs: list, *, what: str, timeout_s: float | None = None) -> list:
    """``ray.get`` of per-rank refs; a failure or time-out names the rank and the call."""
    import ray

    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        ranks = [i for i, r in enumerate(refs) if r in pending]
        raise TimeoutError(f"{what}: ranks {ranks} did not answer within {timeout_s}s")
    results = []
    for rank, ref in enumerate(refs):
        try:
            results.append(ray.get(ref))
        except Exception as e:  # re-raised with the rank, the original stays chained
            raise RuntimeError(f"{what} failed on rank {rank}: {e}") from e
    return results
