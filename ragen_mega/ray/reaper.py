"""A private local Ray ends with the driver that started it, even when the driver is SIGKILLed.

Ray's raylet and GCS die with the driver (the kernel's parent-death signal) and the raylet's
workers follow the raylet, but its dashboard and runtime-env agents hang on (docs/design.md, "A
dead engine, a dead driver"). The reaper, a process of ours in its own session, records every
process under the driver's Ray while the driver lives (the pids Ray's node reports and their
descendants, each with its start time); when the driver ends, however it ends, the kernel closes
the reaper's stdin, and the reaper gives the recorded processes :data:`GRACE_S` to exit, then
SIGKILLs the rest. A reused pid (a different start time) is left alone.

    python -m ragen_mega.ray.reaper ROOT_PID [ROOT_PID ...]   # stdin: a pipe from the driver
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

#: how often the process tree is recorded while the driver lives (seconds)
SNAPSHOT_EVERY_S = 1.0
#: how long the recorded processes get to exit by themselves once the driver is gone (seconds)
GRACE_S = 5.0


def start_reaper(root_pids: list[int]) -> subprocess.Popen:
    """Start the reaper for the Ray processes ``root_pids`` (and all their descendants). The
    returned process's stdin is the driver's end of the pipe: keep the object alive for the
    driver's lifetime (closing it, or the driver's exit, sets the reaper off)."""
    return subprocess.Popen([sys.executable, "-m", "ragen_mega.ray.reaper",
                             *map(str, root_pids)], stdin=subprocess.PIPE,
                            start_new_session=True)  # a Ctrl-C to the driver's group skips it


def pin(roots: list[int]) -> dict[int, float]:
    """Each root's start time (pid -> start), taken while the driver, which just started them,
    still lives; a root already gone is left out."""
    import psutil

    pinned = {}
    for root in roots:
        try:
            pinned[root] = psutil.Process(root).create_time()
        except psutil.Error:
            continue
    return pinned


def record(roots: dict[int, float], seen: dict[int, float]) -> None:
    """Add the pinned ``roots`` (pid -> start time) still running and their descendants to
    ``seen`` (pid -> start). A root whose pid now names another process (a different start time:
    the pid was reused after the root ended) is dropped, so nothing under it is ever recorded."""
    import psutil

    for root, started in list(roots.items()):
        try:
            top = psutil.Process(root)
            if top.create_time() != started:
                raise psutil.NoSuchProcess(root)
            for process in [top, *top.children(recursive=True)]:
                seen.setdefault(process.pid, process.create_time())
        except psutil.NoSuchProcess:
            del roots[root]
        except psutil.Error:  # e.g. a child that ended mid-walk: try again next time
            continue


def kill_left(seen: dict[int, float]) -> list[int]:
    """SIGKILL the recorded processes still running (same pid and start time); their pids."""
    import psutil

    killed = []
    for pid, started in seen.items():
        try:
            process = psutil.Process(pid)
            if process.create_time() != started or process.status() == psutil.STATUS_ZOMBIE:
                continue
            process.kill()
            killed.append(pid)
        except psutil.Error:
            continue
    return killed


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    roots = pin([int(pid) for pid in argv])
    driver_gone = threading.Event()

    def wait_for_eof():
        sys.stdin.buffer.read()  # returns when every writer (the driver) is gone
        driver_gone.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    seen: dict[int, float] = {}
    while not driver_gone.wait(SNAPSHOT_EVERY_S):
        record(roots, seen)
    time.sleep(GRACE_S)
    killed = kill_left(seen)
    if killed:  # to the driver's stderr (inherited), for whoever reads its log
        print(f"ragen_mega reaper: SIGKILLed {len(killed)} process(es) of the local Ray still "
              f"running {GRACE_S:g} s after its driver ended: pids {killed}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
