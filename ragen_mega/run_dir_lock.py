"""One run per run directory: a job that writes ``trainer.run_dir`` holds its lock while it runs.

Two runs writing one directory would interleave checkpoints, ``metrics.jsonl`` and the
``latest_step`` pointer, and a resume would then read a mix of both. The lock is an ``flock``
on ``RUN_DIR/run.lock``, so the OS releases it when the holder's process ends however it ends
(a SIGKILLed or OOM-killed run leaves no stale lock to clean up); the file keeps the holder's
PID so the refusal can name it. Readers (``ragen-mega eval``, ``plot``) never take it.

A file system without ``flock`` (some Lustre mounts) cannot give this protection: the run goes
on with a warning rather than not at all.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = "run.lock"


class RunDirInUse(RuntimeError):
    """Another live process holds the run directory's lock; the message names its PID."""


@contextlib.contextmanager
def holding_run_dir(run_dir: str | Path, job: str = "train") -> Iterator[None]:
    """Hold ``run_dir``'s lock for the block (creating the directory), or raise
    :class:`RunDirInUse` at once, before anything in the directory is touched."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirInUse(
            f"trainer.run_dir {run_dir} is in use by a live run (pid {holder}, lock {path}): "
            f"two runs would overwrite each other's checkpoints and metrics. Wait for it, stop "
            f"it, or give this {job} another trainer.run_dir") from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            os.close(fd)
            raise
        warnings.warn(f"{path}: this file system cannot lock files ({e.strerror}); nothing "
                      f"stops a second run from writing {run_dir} at the same time")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race a new holder)
