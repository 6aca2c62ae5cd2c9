"""Where the training loop's rollouts come from: one :class:`RolloutSource` per
``trainer.async_mode``, built by :func:`open_rollout_source`, so the loop has no mode branch.

* :class:`SynchronousRollouts` (``off``, and a replayed run): step k's rollout is played when the
  loop asks for it, with the weights of step k-1.
* :class:`OneStepOffRollouts` (``one_step_off``): step k+1's rollout plays on another thread while
  step k trains and is waited for before the sync (an engine must not change weights under a
  request); step k's checkpoint saves it, so a resumed run trains on exactly it.
* :class:`~ragen_mega.rollout.fully_async.FullyAsyncRollout` (``fully``): the engines play ahead
  on their own thread, within ``trainer.max_staleness``.

``rollout.mode`` (episodes or streams' windows) is handled in
:class:`~ragen_mega.rollout.manager.RolloutManager`.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ragen_mega.rollout.metrics import weight_staleness
from ragen_mega.rollout.types import EngineRestarted

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ragen_mega.config import RunConfig
    from ragen_mega.rollout.manager import PlayedStep


class RolloutSource(Protocol):
    def take(self, step: int) -> PlayedStep:
        """Step ``step``'s rollout (waiting for it if it is still being played)."""

    def before_sync(self, metrics: dict[str, float]) -> None:
        """The weights are about to change: the engines must have finished what plays on the
        old ones (its wait goes into ``metrics``)."""

    def after_sync(self, version: int) -> None:
        """The engines serve ``version`` now."""

    def state_dict(self) -> dict:
        """What the checkpoint of the step just trained keeps: ``streams`` (the env streams'
        state, or None) and ``pending`` (a rollout played ahead, or None)."""

    def stop(self) -> None:
        """Stop playing (the run ends, or failed)."""


class SynchronousRollouts:
    """Each step's rollout played when it is taken, with the weights the engines serve
    (``version()``). ``rollouts``: a :class:`RolloutManager`, or a replayed run's
    :class:`~ragen_mega.rollout.replay.ReplayedRollouts`."""

    def __init__(self, rollouts, version: Callable[[], int]):
        self.rollouts, self.version = rollouts, version

    def take(self, step: int) -> PlayedStep:
        return self.rollouts.rollout(step, self.version())

    def before_sync(self, metrics: dict[str, float]) -> None:
        pass

    def after_sync(self, version: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"streams": self.rollouts.state_dict(), "pending": None}

    def stop(self) -> None:
        pass


class OneStepOffRollouts(SynchronousRollouts):
    """``async_mode: one_step_off``: taking step k starts step k+1's rollout on a daemon thread
    (up to ``last_step``), and :meth:`before_sync` waits for it. ``pending``: a step's rollout
    played already (the resumed checkpoint's), taken first."""

    def __init__(self, rollouts, version: Callable[[], int], *, last_step: int,
                 pending: PlayedStep | None = None):
        super().__init__(rollouts, version)
        self.last_step, self.pending = last_step, pending
        self._next: Future | None = None

    def take(self, step: int) -> PlayedStep:
        played, self.pending = self.pending or super().take(step), None
        if step < self.last_step:
            self._next = self.rollouts.rollout_in_background(step + 1, self.version())
        return dataclasses.replace(played, metrics={
            **played.metrics, "rollout/weight_staleness": weight_staleness(played.samples,
                                                                           step - 1)})

    def before_sync(self, metrics: dict[str, float]) -> None:
        """Wait for the overlapped rollout. One that met a restarted engine waiting for weights
        (``EngineRestarted``, not ``resynced``) is dropped; the next :meth:`take` replays it
        after this sync, which also gives that engine the trainer's weights."""
        if self._next is None:
            return
        start = time.perf_counter()
        try:
            self.pending = self._next.result()
        except EngineRestarted:
            self.pending = None
        self._next = None
        metrics["time/rollout_wait_s"] = time.perf_counter() - start

    def state_dict(self) -> dict:
        return {"streams": self.rollouts.state_dict(), "pending": self.pending}


def open_rollout_source(cfg: RunConfig, run, *, start: int, pending: PlayedStep | None
                        ) -> RolloutSource:
    """The source of ``cfg.trainer.async_mode`` for a run whose steps after ``start`` are left
    to train; ``pending``: the rollout of step ``start + 1`` a checkpoint kept
    (``one_step_off``)."""
    t = cfg.trainer
    version = lambda: run.weight_version   # noqa: E731 - read at each take
    if t.async_mode == "one_step_off":
        return OneStepOffRollouts(run.rollouts, version, last_step=t.total_steps,
                                  pending=pending)
    if t.async_mode == "fully" and start < t.total_steps:
        from ragen_mega.rollout.fully_async import FullyAsyncRollout

        return FullyAsyncRollout(run.rollouts, first_step=start + 1, last_step=t.total_steps,
                                 max_staleness=t.max_staleness, version=start,
                                 resync=lambda: run.sync_weights(run.weight_version))
    return SynchronousRollouts(run.rollouts, version)
