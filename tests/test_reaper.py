"""The reaper of a local Ray (``ragen_mega/ray/reaper.py``) with plain processes standing in for
Ray's: once the driver's pipe closes, what it saw under its roots is killed, nothing else is.
The whole-run check (a SIGKILLed ``ragen-mega train``, Ray's real agents) is in
``tests/test_engine_faults.py``."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil

from ragen_mega.ray.reaper import GRACE_S, pin, record, start_reaper

#: a "raylet" that starts a child which outlives it (as Ray's agents outlive their raylet)
ROOT = ("import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n")


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_reaper_kills_what_it_saw_under_its_roots_once_the_driver_is_gone():
    root = subprocess.Popen([sys.executable, "-c", ROOT], stdout=subprocess.PIPE, text=True)
    outsider = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    child = int(root.stdout.readline())
    reaper = start_reaper([root.pid])
    try:
        time.sleep(3)  # a few of its snapshots
        root.kill()    # the "raylet" dies; its child lives on, reparented
        root.wait()
        time.sleep(1)
        assert _running(child) and reaper.poll() is None  # the driver still lives: no kill yet
        reaper.stdin.close()  # the driver's end: what its death does
        assert reaper.wait(timeout=GRACE_S + 20) == 0
        assert not _running(child), "the root's orphaned child outlived the reaper"
        assert _running(outsider.pid), "the reaper killed a process it never saw under its roots"
    finally:
        for pid in (child, outsider.pid):
            if _running(pid):
                psutil.Process(pid).kill()
        outsider.wait()
        if reaper.poll() is None:
            reaper.kill()


def test_a_root_whose_pid_was_reused_is_dropped_not_followed():
    """A root pid that names another process now (its start time differs from the pinned one:
    the root ended and the pid was reused, which a long run on a 32k pid space sees) must not
    bring that process or its children into what the reaper kills."""
    me = psutil.Process()
    roots = {me.pid: me.create_time() - 1.0}  # "pinned" when an earlier process had this pid
    seen: dict[int, float] = {}
    record(roots, seen)
    assert seen == {} and roots == {}
    roots = pin([me.pid])
    record(roots, seen)
    assert seen[me.pid] == me.create_time()
