"""Console lines a user sees while a run starts: one per start-up stage, with the seconds since
the command began (``[  12.3s] engines 1/2 ready``), so the minutes before step 1 (Ray, engine
servers, trainer ranks, the first weight sync, the step-0 evaluation) are never silent. They go
to stderr, as tqdm's bars do: stdout stays the command's result (eval's table, the step lines).

Module-level on purpose, like :mod:`logging`: the stages happen in several modules (the loop,
the engine group), and a line needs no object handed down to them.
"""
from __future__ import annotations

import sys
import time

_started = time.perf_counter()


def restart_clock() -> None:
    """Count the seconds of the lines from now (the start of a command)."""
    global _started
    _started = time.perf_counter()


def say(text: str) -> None:
    """Print ``text`` as one start-up line, stamped with the seconds since the command began."""
    print(f"[{time.perf_counter() - _started:7.1f}s] {text}", file=sys.stderr, flush=True)


def count_ready(refs: list, noun: str, timeout_s: float | None = None) -> None:
    """Say ``{noun} k/N ready`` as each of the Ray object refs ``refs`` completes (a failed one
    counts as done: the caller's ``ray.get`` reports it); returns when all are done or
    ``timeout_s`` has passed (the caller's gather then names the ranks still pending)."""
    import ray

    pending, done = list(refs), 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            return
        done += len(ready)
        say(f"{noun} {done}/{len(refs)} ready")


def eta_text(seconds: float) -> str:
    """``1h02m``, ``4m05s``, ``12s``: a remaining time as a step line shows it."""
    seconds = int(round(max(seconds, 0.0)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
