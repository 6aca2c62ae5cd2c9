"""Training replayed from a dump: slime's ``--save-debug-rollout-data`` and
``--load-debug-rollout-data``.

With ``trainer.save_rollouts`` the loop writes each step's rollout
(:meth:`PlayedStep.state_dict`: token ids, engine log-probs, rewards, metrics, fault counts) to
``RUN_DIR/trajectories/step_N.rollout.pt``. A run with ``trainer.replay_rollouts: DIR`` starts
no engine and takes step N's rollout from ``DIR``: the same batch through the same filter,
estimator and updates, to debug a loss on a bad rollout or compare settings on fixed batches.
Its checkpoints are its own trainer's.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ragen_mega.rollout.manager import PlayedStep
from ragen_mega.trajectories import DIRNAME, write_whole


def rollout_file(run_dir: str | Path, step: int) -> Path:
    """Where step ``step``'s saved rollout lives in ``run_dir``."""
    return Path(run_dir) / DIRNAME / f"step_{step}.rollout.pt"


def save_rollout(run_dir: str | Path, step: int, played: PlayedStep) -> None:
    """Step ``step``'s rollout, written whole or not at all."""
    state = played.state_dict()
    write_whole(rollout_file(run_dir, step), lambda f: torch.save(state, f))


class ReplayedRollouts:
    """The rollouts a replayed run trains on: each step's, read from ``source`` (a run
    directory written with ``trainer.save_rollouts``), in place of a :class:`RolloutManager`."""

    def __init__(self, source: str | Path, faults_log: Path):
        self.source, self.faults_log = Path(source), faults_log

    def load_state_dict(self, saved: None) -> None:
        """Nothing to restore: a dump holds episodes-mode steps only (config.py checks)."""

    def state_dict(self) -> None:
        return None

    def rollout(self, step: int, weight_version: int) -> PlayedStep:
        """Step ``step``'s saved rollout, its samples stamped as they were played;
        FileNotFoundError naming the file when ``source`` has none for this step."""
        path = rollout_file(self.source, step)
        if not path.is_file():
            raise FileNotFoundError(
                f"trainer.replay_rollouts: {path} does not exist (was the run written with "
                f"trainer.save_rollouts=true, and for {step} steps or more?)")
        return PlayedStep.from_state_dict(torch.load(path, weights_only=True), self.faults_log)
