"""The rollout manager: plays a step's episodes (or the env streams' window) over the engines,
seeded, in the foreground or overlapped with training, and the held-out evaluation.
"""
from __future__ import annotations

import dataclasses

from ragen_mega.rollout.faults import FaultCounters
from ragen_mega.rollout.sample import Sample
from ragen_mega.rollout.streams import Window


@dataclasses.dataclass
class PlayedStep:
    """One step's rollout, ready to train on: its samples, ``rollout/*`` metrics, seconds, the
    step's fault counters, and (``rollout.mode=turns``) the window it came from."""
    samples: list[Sample]
    metrics: dict[str, float]
    rollout_s: float
    faults: FaultCounters
    window: Window | None = None
