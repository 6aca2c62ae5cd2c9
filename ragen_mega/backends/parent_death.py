"""Helper processes that die with the process that started them.

A process started by one of ours (an SGLang server, a checkpoint writer) and left running when
its starter is killed (SIGKILL, Ray's memory monitor, Ray ending a dead driver's actors) is an
orphan: nobody stops it, and it keeps its memory and ports. Linux's ``PR_SET_PDEATHSIG`` has the
kernel SIGKILL a process when the *thread* that started it ends, so helpers are started from
threads that live as long as they should (a process's main thread, a Ray actor's task thread).
Elsewhere the call does nothing, and the usual shutdown paths are all there is.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Called in a new process: SIGKILL it when its starter ends; exit at once if the starter
    (``parent``: its pid, taken before the start) is already gone."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the starter died before the signal was armed
        os._exit(1)
