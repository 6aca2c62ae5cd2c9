"""``trainer.async_mode: fully``: the engines play the coming steps' episodes while the trainer
trains, and never stop for it (AReaL's asynchronous RL, on this project's steps).

A thread of its own plays step ``s``'s episodes (the seeds of ``RolloutManager.train_specs``, as
in any mode), as many at once as a step has, and starts the next step's as soon as one ends, so
the engines stay as full as mid-step in a synchronous run. With ``rollout.mode: turns`` each env
stream plays its windows one step after another at its own pace (Verlog's long episodes: no
stream waits for another's slow turns); step ``s``'s window is every stream's ``s``-th. The
trainer takes step ``s`` once all of it is in (:meth:`FullyAsyncRollout.take`) and trains on it
with the weights of step ``s - 1``. A weight sync lands between two tokens of the requests in
flight (``EngineGroup.generation_paused``): a cut turn continues with the new weights and each
token keeps the version that sampled it (``Sample.token_versions``). The loss takes the engine's
per-token log-probs as the behaviour policy through the truncated IS weight (``actor.tis_cap``)
and the actor's recomputed ones as PPO's proximal policy (AReaL's decoupled objective).

**Admission** (the staleness bound): an episode (or a stream's window) of step ``s`` starts only
once the engines serve version ``s - 1 - trainer.max_staleness`` or newer; it trains at version
``s - 1``, so no trained token is more than ``max_staleness`` versions stale. The check is made
where the work starts (SkyRL's admission control), so nothing is played only to be dropped: an
engine that far ahead waits instead (``time/engine_idle_s``). AReaL bounds the same quantity
(the version lag of a trajectory's first token) by capping how many trajectories have started.

**A dead engine** is restarted from this thread (``EngineSupervisor.deferred``: no trainer call
here); the episode (or window) that met it plays again, and no request goes to the new server
until a sync gives it the trainer's weights (``EngineGroup._serving_engine``): the trainer's next
sync, or the one :meth:`FullyAsyncRollout.take` makes at once when the trainer is waiting.

**Resume**: what was played ahead of the newest checkpoint is not saved; a resumed run replays
step ``s + 1`` from its first episode (seeds are a function of the step), so every step trains
on exactly its own episodes. The streams are saved where step ``s``'s window left them
(``PlayedStep.streams_state``), so a resumed stream plays window ``s + 1`` from there.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ragen_mega.rollout.faults import count_rollout_faults, count_window_faults, replay_on_restart
from ragen_mega.rollout.metrics import summarize, summarize_window
from ragen_mega.rollout.streams import EnvStreams, Window

if TYPE_CHECKING:
    from ragen_mega.rollout.manager import PlayedStep, RolloutManager
    from ragen_mega.rollout.types import DroppedEpisode, Episode
    from ragen_mega.rollout.sample import Sample

#: how often a waiting admission looks at the version again (seconds)
POLL_S = 0.05


class FullyAsyncRollout:
    """The ``fully`` :class:`~ragen_mega.rollout.source.RolloutSource`: plays steps
    ``first_step`` .. ``last_step`` over ``manager``'s engines on its own thread; the engines
    serve ``version`` now. ``resync()`` gives engines restarted under the rollout the trainer's
    weights; :meth:`take` calls it (on the trainer's thread) while it waits."""

    def __init__(self, manager: RolloutManager, *, first_step: int, last_step: int,
                 max_staleness: int, version: int, resync: Callable[[], object]):
        self.manager, self.max_staleness, self._resync = manager, max_staleness, resync
        self.first_step, self.last_step = first_step, last_step
        self._lock = threading.Condition()
        self._version = version
        #: step -> what has been handed in: index -> an episode (or its drop), or a stream's
        #: (window part, where the stream stood after it)
        self._played: dict[int, dict[int, Episode | DroppedEpisode | tuple[Window, tuple]]] = {}
        self._sizes: dict[int, int] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self._playing: tuple[asyncio.AbstractEventLoop, asyncio.Task] | None = None
        #: since the last take: seconds a free slot waited for admission (the bound held it)
        self._engine_idle_s = 0.0
        self._streams_state: dict | None = None   # the taken step's (state_dict)
        self._thread = threading.Thread(target=self._run, name="fully-async-rollout",
                                        daemon=True)
        self._thread.start()

    def weights_synced(self, version: int) -> None:
        """The engines serve ``version`` now: the steps it admits may start."""
        with self._lock:
            self._version = version

    def take(self, step: int) -> PlayedStep:
        """Step ``step``'s rollout, once all of it has been played (waiting for it counts as
        ``time/trainer_idle_s``): its episodes, or its window of every stream's turns."""
        from ragen_mega.rollout.manager import PlayedStep

        start = time.perf_counter()
        while True:
            with self._lock:
                if self._lock.wait_for(lambda: self._error is not None or (
                        step in self._sizes and len(self._played[step]) == self._sizes[step]),
                        timeout=POLL_S):
                    break
            if self.manager.engines.supervisor.unsynced:   # its episodes wait for weights
                self._resync()
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"the fully asynchronous rollout failed while step {step} "
                                   f"waited for it: {self._error}") from self._error
            played = self._played.pop(step)
            ahead = sum(len(p) for p in self._played.values())
            engine_idle, self._engine_idle_s = self._engine_idle_s, 0.0
        idle = time.perf_counter() - start
        faults = self.manager.fault_counters(step)
        parts = [played[i] for i in sorted(played)]
        rate = self.manager.cfg.rollout.max_env_failure_rate
        window, self._streams_state = None, None
        if self.manager.streams is None:
            episodes = count_rollout_faults(parts, faults, rate)
            samples = [s for e in episodes for s in e.samples]
            _stamp_oldest_versions(samples)
            metrics = {**summarize(episodes, "rollout"), "rollout/episodes_ahead": float(ahead)}
        else:
            window = Window.merged([part for part, _ in parts])
            count_window_faults(window, faults, rate)
            samples = window.samples
            _stamp_oldest_versions(samples)
            # where the streams stood when this window ended (they have played on since)
            self._streams_state = EnvStreams.joined_state([saved for _, saved in parts])
            metrics = {**summarize_window(samples, window.finished, "rollout",
                                          trained_version=step - 1),
                       "rollout/turns_ahead": float(ahead * self.manager.streams.turns_per_step)}
        lags = [step - 1 - v for s in samples for v in s.token_versions]
        metrics.update({"rollout/staleness_mean": sum(lags) / len(lags),
                        "rollout/staleness_max": float(max(lags)),
                        "time/trainer_idle_s": idle, "time/engine_idle_s": engine_idle})
        return PlayedStep(samples, metrics, idle, faults, window)

    def before_sync(self, metrics: dict[str, float]) -> None:
        """Nothing to wait for: the sync pauses the requests in flight between two tokens."""

    def after_sync(self, version: int) -> None:
        self.weights_synced(version)

    def state_dict(self) -> dict:
        """What the last taken step's checkpoint keeps: where the env streams stood when its
        window ended (``rollout.mode=turns``); no pending rollout (steps played ahead are
        replayed on resume)."""
        return {"streams": self._streams_state, "pending": None}

    def stop(self) -> None:
        """Start no further episode, stop those in flight, and wait for the thread."""
        with self._lock:
            self._stopping = True
            playing = self._playing
        if playing is not None:
            loop, task = playing
            with contextlib.suppress(RuntimeError):   # its loop has ended: nothing to stop
                loop.call_soon_threadsafe(task.cancel)
        self._thread.join()

    def _run(self) -> None:
        engines = self.manager.engines
        try:   # a restarted engine gets its weights at the next sync, on the trainer's thread
            with engines.supervisor.deferred():
                engines.serve_forever(self._play_steps())
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's take
            self._fail(e)

    async def _play_steps(self) -> None:
        with self._lock:
            self._playing = asyncio.get_running_loop(), asyncio.current_task()
            if self._stopping:
                return
        gateway = self.manager.gateway   # rollout.agent: its episodes call the engines there
        async with gateway.serving() if gateway else contextlib.nullcontext():
            if self.manager.streams is None:
                await self._play_episodes()
            else:
                await asyncio.gather(*(self._play_stream(stream)
                                       for stream in self.manager.streams.streams))

    async def _play_episodes(self) -> None:
        """Episodes mode: one step's worth of episodes in flight; when one ends, the next (the
        same step's, or the coming step's first) starts."""
        slots = None
        in_flight: set[asyncio.Task] = set()
        try:
            for step in range(self.first_step, self.last_step + 1):
                specs = self.manager.train_specs(step)
                slots = slots or asyncio.Semaphore(len(specs))
                self._expect(step, len(specs))
                for index, spec in enumerate(specs):
                    await slots.acquire()
                    if not await self._admitted(step):
                        slots.release()
                        return
                    task = asyncio.create_task(self._play(step, index, spec))
                    in_flight.add(task)
                    task.add_done_callback(lambda t: (in_flight.discard(t), slots.release()))
            while in_flight and not self._stopped():
                await asyncio.sleep(POLL_S)
        finally:
            for task in list(in_flight):
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _play_stream(self, stream) -> None:
        """``rollout.mode: turns``: one env stream plays its window of each step in turn (the
        same turns, seeded alike, as in any mode) once the step is admitted, and hands it in with
        where the stream stood after it (for the step's checkpoint). A window an engine restart
        cut short is replayed from its start by this stream alone."""
        streams, manager = self.manager.streams, self.manager
        try:
            for step in range(self.first_step, self.last_step + 1):
                self._expect(step, len(streams.streams))
                if not await self._admitted(step):
                    return
                start = stream.saved()
                # a replay samples afresh what the cut try sampled (seeded alike)
                part = await replay_on_restart(
                    lambda: manager.play_stream_window(stream, step),
                    retried=lambda: manager.engines.supervisor.count_retried(1),
                    undo=lambda: streams.restore_stream(stream, start), wait_for_sync=True)
                self._hand_in(step, stream.index, (part, stream.saved()))
        except Exception as e:  # noqa: BLE001 - an env's or engine's error: take() raises it
            self._fail(e)

    async def _admitted(self, step: int) -> bool:
        """Wait until step ``step``'s episodes may start (False: the rollout is stopping)."""
        oldest = step - 1 - self.max_staleness
        started = time.perf_counter()
        while not self._stopped():
            with self._lock:
                if self._version >= oldest:
                    self._engine_idle_s += time.perf_counter() - started
                    return True
            await asyncio.sleep(POLL_S)
        return False

    async def _play(self, step: int, index: int, spec) -> None:
        try:
            outcome = await self.manager.play_episode(spec, step, wait_for_sync=True)
        except Exception as e:  # noqa: BLE001 - an engine's error or a bug: take() raises it
            self._fail(e)
            return
        self._hand_in(step, index, outcome)

    def _expect(self, step: int, size: int) -> None:
        """Step ``step`` is complete with ``size`` pieces (episodes, or streams' windows)."""
        with self._lock:
            if step not in self._sizes:
                self._sizes[step], self._played[step] = size, {}

    def _hand_in(self, step: int, index: int, piece) -> None:
        with self._lock:
            self._played[step][index] = piece
            self._lock.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._error = self._error or error
            self._lock.notify_all()

    def _stopped(self) -> bool:
        with self._lock:
            return self._stopping or self._error is not None


def _stamp_oldest_versions(samples: list[Sample]) -> None:
    """Each sample's weight version is its oldest token's: the weights it trains against are
    that many versions newer at most."""
    for sample in samples:
        sample.weight_version = min(sample.token_versions)
