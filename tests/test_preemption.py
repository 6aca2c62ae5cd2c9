"""The loop's answer to a stop signal, without Ray: the step under way is finished and saved,
then the loop stops; a rerun resumes after it. Real signals are sent to this process; the
trainers are stand-ins that record checkpoints (the real loop under a simulated slurm job, with
Megatron checkpoints, is tests/test_slurm.py)."""
from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

from ragen_mega.config import load_run_config
from ragen_mega import checkpoints, preemption
import ragen_mega.train as training
from ragen_mega.train import run_loop

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
        self.rollouts = SimpleNamespace(  # episodes mode: no streams state of the step's own
            rollout=lambda step, version: SimpleNamespace(step=step, streams_state=None),
            load_state_dict=lambda saved: None, state_dict=lambda: None)
        self.weight_version = 0

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
    def train_step(cfg, run, step, played):  # the stand-in's step in place of the real one
        return run.train_step(played.step)
    with preemption.stop_on_signals() as stop, \
            mock.patch.object(training, "train_step", train_step):
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


def write_checkpoint(ckpt_dir: Path, step: int) -> None:
    """A small checkpoint directory the real ``verify_checkpoint`` accepts, as a finished save
    leaves it (state file, torch_dist metadata and shard), without Megatron."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from ragen_mega.backends.megatron import checkpoint as megatron_checkpoint

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(ckpt_dir / "dist"))
    for name in ("common.pt", "metadata.json"):
        (ckpt_dir / "dist" / name).write_text("{}")
    torch.save({"format_version": 1, "step": step, "extra": {"step": step}},
               ckpt_dir / megatron_checkpoint.STATE_FILE)


class LoadingTrainer:
    """Records the checkpoint directories ``resume`` loads; the extra state is the step's."""

    def __init__(self):
        self.loaded: list[str] = []

    def load_checkpoint(self, path):
        self.loaded.append(path)
        return {"step": int(Path(path).name[5:]), "rng": checkpoints.rng_states(),
                "data_cursor": {}}


@pytest.mark.parametrize("text, shown", [("garbage", "'garbage'"), ("", "''"), ("-2", "'-2'"),
                                         ("x" * 100, f"{'x' * 80!r}... (100 characters)")])
def test_pointer_naming_no_step_is_reported_with_what_it_holds(tmp_path, text, shown):
    pointer = checkpoints.checkpoint_root(tmp_path) / checkpoints.LATEST
    pointer.parent.mkdir()
    pointer.write_text(text)
    with pytest.raises(checkpoints.UnreadablePointer) as err:
        checkpoints.latest_complete_step(tmp_path)
    assert str(err.value) == f"{pointer} holds {shown}, not a step number"
    pointer.write_text("7\n")  # a hand-written pointer with a newline still reads
    assert checkpoints.latest_complete_step(tmp_path) == 7


def test_garbage_pointer_resumes_from_the_newest_step_that_verifies(tmp_path):
    """Without a readable pointer, a step is complete when its actor and critic directories
    verify: step 4's save was killed after the actor's (no critic's), step 3's actor shard is
    cut short, so the run resumes after step 2; nothing is deleted, the refused steps are moved
    aside and the pointer names step 2 again."""
    cfg = _cfg(tmp_path)
    root = checkpoints.checkpoint_root(tmp_path)
    for step, roles in ((1, ("actor", "critic")), (2, ("actor", "critic")),
                        (3, ("actor", "critic")), (4, ("actor",))):
        for role in roles:
            write_checkpoint(checkpoints.step_dir(tmp_path, role, step), step)
    shard = next((checkpoints.step_dir(tmp_path, "actor", 3) / "dist").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    (root / checkpoints.LATEST).write_text("garbage")
    actor, critic = LoadingTrainer(), LoadingTrainer()

    with pytest.warns(UserWarning) as record:
        step, streams, pending = checkpoints.resume(cfg, actor, critic)
    warned = [str(w.message) for w in record]
    assert (step, streams, pending) == (2, None, None)
    assert actor.loaded == [str(checkpoints.step_dir(tmp_path, "actor", 2))]
    assert critic.loaded == [str(checkpoints.step_dir(tmp_path, "critic", 2))]
    assert any(m.startswith(f"trainer.resume: {root / 'latest_step'} holds 'garbage', not a step "
                            f"number; resuming from the newest step") for m in warned), warned
    assert any(m.startswith("trainer.resume: refusing step 4: ") and
               str(checkpoints.step_dir(tmp_path, "critic", 4)) in m for m in warned), warned
    assert any(m.startswith("trainer.resume: refusing step 3: ") and f"shard {shard}" in m
               for m in warned), warned
    assert (root / checkpoints.LATEST).read_text() == "2"
    assert sorted(p.name for p in (root / "actor").iterdir()) == [
        "corrupt-step_3", "corrupt-step_4", "step_1", "step_2"]
    assert sorted(p.name for p in (root / "critic").iterdir()) == [
        "corrupt-step_3", "step_1", "step_2"]


def test_garbage_pointer_and_no_intact_step_stops_the_resume(tmp_path):
    """A pointer exists, so the run saved once: with no step that verifies it does not start
    afresh silently; a lone critic directory is refused too, not left for the rerun's save to
    collide with."""
    cfg = _cfg(tmp_path)
    root = checkpoints.checkpoint_root(tmp_path)
    write_checkpoint(checkpoints.step_dir(tmp_path, "critic", 1), 1)
    (root / checkpoints.LATEST).write_text("garbage")
    with pytest.warns(UserWarning) as record, pytest.raises(
            RuntimeError, match=rf"no intact checkpoint under {root} \({root / 'latest_step'} "
                                r"holds 'garbage', not a step number; every step was refused"):
        checkpoints.resume(cfg, LoadingTrainer(), LoadingTrainer())
    warned = [str(w.message) for w in record]
    assert len(warned) == 2 and "holds 'garbage'" in warned[0], warned
    assert warned[1].startswith("trainer.resume: refusing step 1: ") and str(
        checkpoints.step_dir(tmp_path, "actor", 1)) in warned[1], warned
    assert (root / "critic" / "corrupt-step_1").is_dir()
