"""What happens when an SGLang server dies, in one place: :class:`EngineSupervisor` finds dead
servers (process exited, or no HTTP answer), restarts them on the same devices within the step's
allowance (``rollout.max_engine_restarts_per_step``), counts ``fault/engine_restarts`` and
``fault/episodes_retried``, and brings a restarted server to the trainer's weights (the weight
channel's ``resync``, or the next sync while a rollout overlaps training). A restarted server
takes no request before that (:attr:`EngineSupervisor.unsynced`, marked before the engine group
can reach it). Every path goes through :meth:`EngineSupervisor.recover`; each recovery is
described in ``RUN_DIR/faults.jsonl`` and handed to the ``listeners``. Where each path runs
(under a request, in the train phase, in a sync): docs/design.md, "A dead engine, a dead driver".

The design follows slime's isolation of its engines' health monitor from the rollout; the code
is our own.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ragen_mega.ray.weight_channel import TrainerWeights

@dataclass
class Recovery:
    """One :meth:`EngineSupervisor.recover`: why it was called (``"check"``: a routine check),
    whether a weight sync broke, the engines checked, those found dead, and ``{engine: url}`` of
    every engine restarted (the dead ones, or all of them after a broken sync)."""

    reason: str
    broken_sync: bool
    checked: list[int]
    dead: list[int] = field(default_factory=list)
    restarted: dict[int, str] = field(default_factory=dict)


class EngineSupervisor:
    """Finds, restarts and resyncs dead engines (module docstring).

    ``workers``: the engines' Ray actors (``server_exited()``, ``restart() -> url``).
    ``urls``: the servers' URLs now. ``api_key``: the engines' key, for the health checks.
    ``connect(engine, url)``: the engine group talks to a restarted server from now on.
    ``weights`` (:class:`~ragen_mega.ray.weight_channel.TrainerWeights`): its
    ``resync({engine: url})`` loads the served weights into restarted engines (None: the
    engines serve the model as it is, so a new server already has it). ``fault_log``: where
    each recovery that restarted something is described (None: stderr only).
    """

    def __init__(self, workers: Sequence, urls: list[str], *, api_key: str, log_dir: str,
                 max_restarts_per_step: int, connect: Callable[[int, str], None],
                 weights: TrainerWeights | None = None, fault_log: str | Path | None = None):
        self.workers, self.urls, self.api_key = list(workers), urls, api_key
        self.log_dir, self.max_restarts_per_step = log_dir, max_restarts_per_step
        self.connect, self.weights, self.fault_log = connect, weights, fault_log
        #: called with each :class:`Recovery`, after its restarts and before the caller goes on
        self.listeners: list[Callable[[Recovery], None]] = []
        self.lives = [0] * len(self.workers)  # restarts of each engine so far
        self._faults = self._no_faults()
        self._lock = threading.RLock()  # one recovery at a time, from any thread
        self._deferring = False
        #: {engine: url} restarted and not yet given the trainer's weights; replaced whole,
        #: never changed in place, so the engine group's event loop reads it without the lock
        self._unsynced: dict[int, str] = {}

    @staticmethod
    def _no_faults() -> dict[str, float]:
        return {"fault/engine_restarts": 0.0, "fault/episodes_retried": 0.0}

    def take_fault_counts(self) -> dict[str, float]:
        """Engine restarts and replayed episodes since the last call (which also renews the
        restart allowance): the step's ``fault/*`` metrics."""
        faults, self._faults = self._faults, self._no_faults()
        return faults

    def count_retried(self, episodes: int) -> None:
        """``episodes`` are played again after an engine restart (``fault/episodes_retried``)."""
        self._faults["fault/episodes_retried"] += episodes

    def recover(self, reason: BaseException | None, suspects: Sequence[int] | None = None, *,
                broken_sync: bool = False) -> dict[int, str]:
        """Restart the dead engines among ``suspects`` (default: all); return ``{engine: url}``
        of every engine restarted. They serve the checkpoint they loaded until a weight sync (or
        :meth:`after_request_failed`'s resync) gives them the trainer's weights.

        ``reason``: the error that made the caller suspect them, re-raised if none is dead (a
        refused request or update is not an engine's fault); None: a routine check.
        ``broken_sync``: ``reason`` failed a weight sync, so if any engine is dead all restart:
        the others wait in a broadcast receive that never completes (and would not answer a
        request to leave it). The dead count against the step's allowance (past it:
        ``RuntimeError`` naming the engine's log and the config key); the others are counted in
        ``fault/engine_restarts`` but not limited."""
        with self._lock:
            checked = list(range(len(self.workers)) if suspects is None else suspects)
            recovery = Recovery(_describe(reason), broken_sync, checked,
                                dead=self._dead(checked))
            if not recovery.dead and reason is not None:
                raise reason
            for engine in recovery.dead:
                self._allow_restart(engine, reason)
            restart = list(range(len(self.workers))) if broken_sync and recovery.dead \
                else recovery.dead
            self._faults["fault/engine_restarts"] += len(restart) - len(recovery.dead)
            recovery.restarted = self._restart(restart)
            self._report(recovery)
            return recovery.restarted

    def after_request_failed(self, engine: int, life: int, error: BaseException) -> bool:
        """A rollout's request to ``engine`` (in its ``life``-th life) failed with ``error``:
        return once the engine is up again, or re-raise ``error`` if its server is alive (the
        request itself was refused). The first failed request restarts it; the others find it
        restarted. True: it serves the trainer's weights; False: resyncs are :meth:`deferred`,
        so it waits for the next weight sync (:attr:`unsynced`). Blocking: call it off the
        rollout's event loop."""
        with self._lock:  # a second request that failed on it waits here, then returns
            if self.lives[engine] == life:  # else another request has restarted it
                restarted = self.recover(error, [engine])
                if self.weights is not None and not self._deferring:
                    self.weights.resync(restarted)
                    self.synced(restarted)
            return engine not in self._unsynced

    @contextlib.contextmanager
    def deferred(self):
        """Within the block (an overlapped rollout on another thread, while the trainer
        trains), an engine restarted under a request is not given weights by a resync (that
        would call the trainer from the rollout's thread, mid-update): it stays in
        :attr:`unsynced` until the next sync."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    @property
    def unsynced(self) -> frozenset[int]:
        """The engines restarted that have not had the trainer's weights since (they serve the
        checkpoint they loaded): no request goes to them."""
        return frozenset(self._unsynced)

    def unsynced_urls(self) -> dict[int, str]:
        """``{engine: url}`` of :attr:`unsynced`: the next weight sync takes them in."""
        return dict(self._unsynced)

    def synced(self, engines) -> None:
        """A sync gave ``engines`` the trainer's weights: requests may go to them again."""
        self._unsynced = {e: url for e, url in self._unsynced.items() if e not in engines}

    def _dead(self, engines: list[int]) -> list[int]:
        """Those of ``engines`` whose server process exited or whose HTTP server does not
        answer (``/model_info``, which needs no scheduler step: a busy engine answers it)."""
        import ray

        from ragen_mega.backends.sglang.client import AsyncEngineClient

        exited = ray.get([self.workers[e].server_exited.remote() for e in engines])

        async def answering():
            clients = [AsyncEngineClient(self.urls[e], api_key=self.api_key) for e in engines]
            try:
                return await asyncio.gather(*(c.health(timeout=30.0, generate=False)
                                              for c in clients))
            finally:
                for c in clients:
                    await c.close()

        answers = asyncio.run(answering())  # a loop of its own: called off the rollout's
        return [e for e, gone, answers_http in zip(engines, exited, answers)
                if gone or not answers_http]

    def _allow_restart(self, engine: int, error: BaseException | None) -> None:
        """Count a restart of ``engine``, or raise once this step has had its allowance."""
        done = self._faults["fault/engine_restarts"]
        if done >= self.max_restarts_per_step:
            raise RuntimeError(
                f"engine {engine}'s SGLang server died (log {self.log_dir}/engine_{engine}.log) "
                f"and this step has already restarted {done:.0f} engine(s), the limit "
                f"(rollout.max_engine_restarts_per_step={self.max_restarts_per_step})") \
                from error
        self._faults["fault/engine_restarts"] += 1

    def _restart(self, engines: list[int]) -> dict[int, str]:
        """Restart ``engines``' servers together (same devices, same log file)."""
        import ray

        urls = ray.get([self.workers[e].restart.remote() for e in engines])
        for engine, url in zip(engines, urls):
            self.urls[engine] = url
            self.lives[engine] += 1
            if self.weights is not None:  # the weights come from the trainer: none until then
                self._unsynced = {**self._unsynced, engine: url}
            self.connect(engine, url)
        return dict(zip(engines, urls))

    def _report(self, recovery: Recovery) -> None:
        """Describe a recovery that restarted something (stderr and the fault log), then hand
        every recovery to the listeners."""
        if recovery.restarted:
            line = json.dumps({"fault": "engine_restarted", "reason": recovery.reason,
                               "dead": recovery.dead, "restarted": sorted(recovery.restarted),
                               "logs": [f"{self.log_dir}/engine_{e}.log"
                                        for e in recovery.dead]})
            print(f"fault: {line}", file=sys.stderr)
            if self.fault_log is not None:
                with open(self.fault_log, "a") as f:
                    f.write(line + "\n")
        for listener in self.listeners:
            listener(recovery)


def _describe(reason: BaseException | None) -> str:
    return "check" if reason is None else f"{type(reason).__name__}: {reason}"[:500]

