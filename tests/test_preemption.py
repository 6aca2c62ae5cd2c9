"""The loop's answer to a stop signal, without Ray: the step under way is finished and saved,
then the loop stops; a rerun resumes after it. Real signals are sent to this process; the
trainers are stand-ins that record checkpoints (the real loop under a simulated slurm job, with
Megatron checkpoints, is tests/test_slurm.py)."""
from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from ragen_mega.config import load_run_config
from ragen_mega.ray import checkpoints, preemption
from ragen_mega.ray.driver import run_loop

REPO = Path(__file__).resolve().parents[1]


class RecordingTrainer:
    """Keeps each checkpoint's extra state in memory and creates its ``step_N`` directory."""

    def __init__(self):
        self.saved: dict[str, dict] = {}

    def save_checkpoint(self, root, step, extra):
        path = Path(root) / f"step_{step}"
        path.mkdir(parents=True)
        self.saved[str(path)] = extra

    def load_checkpoint(self, path):
        return self.saved[str(path)]


class Loop:
    """A stand-in Run whose ``train_step`` sends this process ``signals[step]`` (if any)."""

    def __init__(self, signals: dict[int, list[int]]):
        self.signals, self.trained = signals, []
        self.actor, self.critic = RecordingTrainer(), RecordingTrainer()

    def train_step(self, step):
        for signum in self.signals.get(step, []):
            os.kill(os.getpid(), signum)
        self.trained.append(step)
        return {"x": float(step)}

    def sync_weights(self, version):
        return {}


def _cfg(run_dir, total_steps=5):
    return load_run_config(REPO / "examples/bandit_cpu_demo.yaml", [
        f"trainer.run_dir={run_dir}", f"trainer.total_steps={total_steps}",
        "trainer.save_every=0", "trainer.eval_every=0", "trainer.resume=auto",
        "critic.enable=true"])


def _loop(cfg, run):
    logger = SimpleNamespace(log=lambda step, metrics: None)
    with preemption.stop_on_signals() as stop:
        return run_loop(cfg, run, logger, stop)


def test_signal_finishes_the_step_saves_and_the_rerun_resumes(tmp_path, capsys, monkeypatch):
    cfg = _cfg(tmp_path)
    run = Loop({2: [signal.SIGUSR1, signal.SIGTERM]})  # a second signal during the same step
    # resume checks the newest step's files are whole; the stand-ins write no Megatron files, so
    # a step directory is whole here when its trainer recorded the save
    from ragen_mega.backends.megatron import checkpoint as megatron_checkpoint

    def recorded(ckpt_dir):
        if not any(str(ckpt_dir) in t.saved for t in (run.actor, run.critic)):
            raise FileNotFoundError(f"{ckpt_dir}: never saved")
    monkeypatch.setattr(megatron_checkpoint, "verify_checkpoint", recorded)
    with pytest.raises(preemption.Preempted) as stopped:
        _loop(cfg, run)
    assert (stopped.value.signal_name, stopped.value.step) == ("SIGUSR1", 2)
    assert run.trained == [1, 2]
    assert checkpoints.latest_complete_step(tmp_path) == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints/actor").iterdir()) == ["step_2"]
    assert sorted(p.name for p in (tmp_path / "checkpoints/critic").iterdir()) == ["step_2"]
    err = capsys.readouterr().err
    assert "SIGUSR1 received" in err and "SIGTERM again" in err
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # handlers restored afterwards

    # A save killed after the actor's rename, before the critic's and the pointer: step 3's
    # actor directory exists but step 3 never completed. The rerun discards it and redoes step 3.
    (tmp_path / "checkpoints/actor/step_3").mkdir()
    run.signals = {}
    run.trained = []
    with pytest.warns(UserWarning, match="discarding .*step_3"):
        history = _loop(cfg, run)
    assert run.trained == [3, 4, 5] and [h["step"] for h in history] == [3, 4, 5]
    assert checkpoints.latest_complete_step(tmp_path) == 5
    steps = [int(line.split('"step": ')[1].split(",")[0])
             for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_signal_before_the_first_step_stops_without_training(tmp_path):
    cfg = _cfg(tmp_path)
    run = Loop({})
    with preemption.stop_on_signals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(preemption.Preempted, match="no step was completed"):
            run_loop(cfg, run, SimpleNamespace(log=lambda *a: None), stop)
    assert run.trained == [] and checkpoints.latest_complete_step(tmp_path) is None


def test_signal_in_the_last_step_ends_the_run_normally(tmp_path):
    run = Loop({3: [signal.SIGUSR1]})
    history = _loop(_cfg(tmp_path, total_steps=3), run)
    assert [h["step"] for h in history] == [1, 2, 3]
    assert checkpoints.latest_complete_step(tmp_path) == 3
