"""One run per run directory (``ragen_mega/run_dir_lock.py``), with real processes: a second
``ragen-mega train`` in a directory a live process holds exits 2 naming that process, before it
writes anything there; a holder that was SIGKILLed leaves nothing that stops the next run.
(``ragen-mega eval`` of a held directory is checked in test_learn.py: it only reads.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ragen_mega.run_dir_lock import LOCK_FILE, RunDirInUse, holding_run_dir

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "bandit_cpu_demo.yaml"
HOLD = ("import sys, time\nfrom ragen_mega.run_dir_lock import holding_run_dir\n"
        "with holding_run_dir(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)\n")


def _holder(run_dir: Path) -> subprocess.Popen:
    """A process that holds ``run_dir``'s lock the way a run does, until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()


def test_a_second_run_in_a_live_runs_directory_exits_2_naming_it(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    live = _holder(run_dir)
    try:
        second = subprocess.run(
            [sys.executable, "-m", "ragen_mega.cli", "train", str(DEMO),
             f"model.path={tiny_model('qwen2')}", f"trainer.run_dir={run_dir}"],
            capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"is in use by a live run (pid {live.pid}," in second.stderr, second.stderr[-3000:]
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing written
        try:                                   # the same refusal for any job in the process
            with holding_run_dir(run_dir, "sft"):
                raise AssertionError("took a lock that a live process holds")
        except RunDirInUse as e:
            assert "give this sft another trainer.run_dir" in str(e)
    finally:
        _kill(live)
    # the holder was SIGKILLed: its PID is still in the file, but the lock went with it
    assert (run_dir / LOCK_FILE).read_text().split() == [str(live.pid)]
    with holding_run_dir(run_dir):
        assert (run_dir / LOCK_FILE).read_text().split() == [str(os.getpid())]
    after = _holder(run_dir)            # and released again when the block ends
    _kill(after)
