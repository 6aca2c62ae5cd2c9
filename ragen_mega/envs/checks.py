"""Small rules the built-in games share: guarding the episode's life, checking seeds and kwargs.
Kept out of :mod:`ragen_mega.envs.base` so the interface stays a pure contract.
"""
from __future__ import annotations

import math
import numbers
from typing import Any


class EpisodeDone(RuntimeError):
    """``step`` after the episode ended (the env server answers it with 409)."""


def ensure_steppable(env_name: str, started: bool, done: bool) -> None:
    """Refuse ``step`` before the first ``reset`` and after the episode ended."""
    if not started:
        raise RuntimeError(f"env {env_name!r}: call reset(seed) before step()")
    if done:
        raise EpisodeDone(f"env {env_name!r}: the episode is done; call reset(seed) to start "
                          f"a new one")


def check_seed(env_name: str, seed: Any) -> int:
    """Seeds are non-negative ints (numpy's generators refuse negative ones)."""
    if not is_int(seed) or seed < 0:
        raise ValueError(f"env {env_name!r}: seed must be a non-negative int, got {seed!r}")
    return int(seed)


def is_int(value: Any) -> bool:
    """True for Python and numpy ints, False for bools (a ``True`` kwarg is a mistake)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """True for finite Python/numpy ints and floats, False for bools, NaN and infinities."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))
