"""Stopping a run between steps when the scheduler asks (slurm preemption or time limit).

Slurm warns a job before it ends it: ``#SBATCH --signal=B:USR1@SECS`` (or SIGTERM on
preemption). Killing the driver then would lose everything since the last checkpoint and orphan
its engines and trainer ranks, so the signal only sets a flag: the loop finishes its step, saves
a checkpoint, stops everything it started and exits with :data:`PREEMPTED_EXIT_CODE`, which
``slurm/train.sbatch`` answers with a requeue that resumes (``trainer.resume=auto``).

A repeated signal changes nothing; a kill mid-save leaves the previous checkpoint the newest
complete one (checkpoint directories and ``latest_step`` appear only by atomic rename).
"""
from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator

# EX_TEMPFAIL of sysexits.h: "a temporary failure; retrying later may succeed".
PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    """Set by a stop signal, read by the loop between steps."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def request(self, signum: int, _frame=None) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            print(f"ragen-mega train: {name} again: still finishing the step and saving",
                  file=sys.stderr, flush=True)
            return
        self.signal_name = name
        print(f"ragen-mega train: {name} received: finishing the current step, then saving a "
              "checkpoint and exiting", file=sys.stderr, flush=True)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Route :data:`STOP_SIGNALS` to a :class:`StopRequest` inside the block; the previous handlers
    come back afterwards (a second ``train`` call in one process starts with a clear flag)."""
    stop = StopRequest()
    previous = {s: signal.signal(s, stop.request) for s in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class Preempted(Exception):
    """The loop stopped early on a signal; ``step`` is the newest checkpoint (0: none)."""

    def __init__(self, signal_name: str, step: int):
        newest = f"the newest checkpoint is step {step}" if step else "no step was completed"
        super().__init__(f"stopped by {signal_name}: {newest}; a rerun with "
                         "trainer.resume=auto continues from there")
        self.signal_name, self.step = signal_name, step
