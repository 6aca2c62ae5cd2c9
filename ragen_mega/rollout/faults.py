"""Faults a run survives, and the per-step counters that say how many it met.

A user's env that raises, a prompt that outgrows the engine's context, a NaN update: each costs
one episode or one update, not the run. Every fault is counted in the step's
:class:`FaultCounters` (logged every step as ``fault/<name>``, 0 when nothing happened, so a
dashboard shows a flat line rather than a gap) and described, one JSON line each, in
``RUN_DIR/faults.jsonl`` and on stderr (which env, seed and exception).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ragen_mega.rollout.types import DroppedEpisode, EngineRestarted, EnvFailed, EpisodeSpec
from ragen_mega.rollout.episode import Episode

if TYPE_CHECKING:  # streams.py counts its faults here and never imports this module
    from ragen_mega.rollout.streams import Window

T = TypeVar("T")

#: The counters of a step, each logged as ``fault/<name>``.
COUNTERS = (
    "episodes_dropped",   # episodes that gave no samples: their env raised, or turn 1 was too long
    "prompts_too_long",   # episodes ended early because a prompt outgrew the engine's context
    "updates_skipped",    # optimizer updates skipped for a NaN/inf loss or gradient
)


class FaultCounters:
    """One step's fault counts, plus the record of each fault (``faults.jsonl``)."""

    def __init__(self, step: int, log_path: str | Path | None = None):
        self.step, self.log_path = step, log_path
        self.counts = dict.fromkeys(COUNTERS, 0)

    def record(self, name: str, count: int = 1, **detail: Any) -> None:
        """Count ``count`` faults of kind ``name`` and describe them (if ``detail`` is given)."""
        if name not in self.counts:
            raise KeyError(f"unknown fault counter {name!r}; known: {', '.join(self.counts)}")
        self.counts[name] += count
        if detail:
            line = json.dumps({"step": self.step, "fault": name, **detail}, default=str)
            print(f"fault: {line}", file=sys.stderr)
            if self.log_path is not None:
                with open(self.log_path, "a") as f:
                    f.write(line + "\n")

    def metrics(self) -> dict[str, float]:
        return {f"fault/{name}": float(n) for name, n in self.counts.items()}

    def state_dict(self) -> dict[str, Any]:
        """The step and its counts as plain values (a checkpoint's pending rollout keeps them;
        the faults' descriptions are in ``faults.jsonl`` already)."""
        return {"step": int(self.step), "counts": {k: int(n) for k, n in self.counts.items()}}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], log_path: str | Path | None = None
                        ) -> FaultCounters:
        """The counters :meth:`state_dict` saved, describing further faults in ``log_path``.
        A counter the state lacks (added since) starts at 0; one no longer known is left out."""
        counters = cls(int(state["step"]), log_path)
        counters.counts.update({k: int(n) for k, n in state["counts"].items()
                                if k in counters.counts})
        return counters


async def episode_or_drop(spec: EpisodeSpec, play) -> Episode | DroppedEpisode:
    """Await ``play`` (a ``run_episode`` coroutine for ``spec``); an env failure, or an episode
    without a single turn, becomes a :class:`DroppedEpisode` instead of ending the step. Any
    other error (an engine's, a bug) still propagates."""
    try:
        episode = await play
    except EnvFailed as e:
        return DroppedEpisode(spec, "env_failed", str(e))
    if not episode.samples:
        return DroppedEpisode(spec, "prompt_too_long",
                              f"env {spec.env_name!r} (seed {spec.seed}, episode "
                              f"{spec.episode_id}): its first prompt is longer than the "
                              f"engine's context")
    return episode


async def replay_on_restart(play: Callable[[], Awaitable[T]], *, retried: Callable[[], None],
                            undo: Callable[[], Awaitable[None]] | None = None,
                            wait_for_sync: bool = False) -> T:
    """``await play()`` (an episode, a window, one stream's window), replayed from its start
    each time a restarted engine cuts it short (:class:`EngineRestarted`): ``undo`` first
    reverts what the cut try changed (the streams' state), ``retried`` counts the replay. If the
    restarted engine waits for the next weight sync (``resynced`` False), the error is re-raised
    for the caller to replay after that sync, unless ``wait_for_sync`` (a fully asynchronous
    rollout: the replay waits for an engine with weights while the trainer goes on and syncs)."""
    while True:
        try:
            return await play()
        except EngineRestarted as e:
            if not (e.resynced or wait_for_sync):
                raise
            retried()
            if undo is not None:
                await undo()


def count_rollout_faults(played: list[Episode | DroppedEpisode], counters: FaultCounters,
                         max_failure_rate: float) -> list[Episode]:
    """Count and describe the step's dropped and truncated episodes; return the played ones.

    Raises RuntimeError (naming the first failure's env, seed and exception) when more than
    ``max_failure_rate`` of the step's episodes had an env that raised, or none is left."""
    dropped = [p for p in played if isinstance(p, DroppedEpisode)]
    episodes = [p for p in played if not isinstance(p, DroppedEpisode)]
    _record_dropped(dropped, counters)
    for e in episodes:
        if e.metrics["prompt_too_long"]:
            s = e.samples[-1]
            _record_too_long(counters, s.env_tag, s.seed, s.episode_id, s.turn)
    _check_failure_rate(dropped, len(played), counters.step, max_failure_rate,
                        len(episodes), "gave samples")
    return episodes


def count_window_faults(window: Window, counters: FaultCounters, max_failure_rate: float
                        ) -> None:
    """:func:`count_rollout_faults` for a streamed step's window (``rollout/streams.py``): its
    dropped episodes and the episodes its too-long prompts ended. The failure rate is over the
    episodes the window played in: those dropped, finished, or cut to go on next step."""
    _record_dropped(window.dropped, counters)
    for spec, turns in window.too_long:
        if turns:  # one without a turn is a dropped episode, recorded above
            _record_too_long(counters, spec.env_tag or spec.env_name, spec.seed,
                             spec.episode_id, turns)
    played = len(window.dropped) + len(window.finished) + len(window.next_prompts)
    _check_failure_rate(window.dropped, played, counters.step, max_failure_rate,
                        len(window.samples), "turn samples were played")


def _record_dropped(dropped: list[DroppedEpisode], counters: FaultCounters) -> None:
    for d in dropped:
        counters.record("episodes_dropped", env=d.spec.env_name, seed=d.spec.seed,
                        episode=d.spec.episode_id, group=d.spec.group_id, reason=d.reason)
        if d.kind == "prompt_too_long":
            counters.record("prompts_too_long")


def _record_too_long(counters: FaultCounters, env: str, seed: int, episode: int, turns: int
                     ) -> None:
    counters.record("prompts_too_long", env=env, seed=seed, episode=episode,
                    reason=f"the prompt of turn {turns + 1} is longer than the engine's context: "
                           f"the episode ends after turn {turns}")


def _check_failure_rate(dropped: list[DroppedEpisode], played: int, step: int,
                        max_failure_rate: float, kept: int, kept_what: str) -> None:
    """RuntimeError when more than ``max_failure_rate`` of ``played`` episodes had an env that
    raised, or nothing is left to train on (``kept`` is 0)."""
    failed = [d for d in dropped if d.kind == "env_failed"]
    rate = len(failed) / played if played else 0.0
    if (failed and rate > max_failure_rate) or not kept:
        first = (failed or dropped)[0].reason if dropped else "no episodes were played"
        raise RuntimeError(
            f"rollout: {len(failed)} of {played} episodes of step {step} had an env that raised "
            f"({rate:.0%}; rollout.max_env_failure_rate={max_failure_rate}), "
            f"{kept} {kept_what}; the first failure: {first}")
