"""RAGEN's echo trap, counted: the one definition of "a run collapsed at step k".

A run has **collapsed at step k** when both hold:

1. *The groups stopped telling their episodes apart:* at each of the :data:`RUN_LENGTH` training
   steps ``k - RUN_LENGTH + 1 .. k`` (consecutive steps, every one logged), the share of the
   step's groups whose episodes all scored alike (in-group reward std 0, ``filter/zero_groups``
   over ``env.env_groups``) is at least :data:`ZERO_STD_SHARE`. A group-relative estimator
   learns nothing from such a group, and the filter has nothing left to choose from.
2. *The held-out success fell from its peak:* the newest held-out evaluation at or before step k
   is at least :data:`SUCCESS_DROP` below the best one at or before step k (``val/success``, or
   the sweep report's metric).

The collapse step is the first k where both hold. Condition 1 alone also describes a run that
solved every map (all its groups win alike); condition 2 tells the trap from success. Both read
what every run logs (docs/metrics.md): ``filter/zero_groups`` counts the groups whose filter
score is 0, the zero-std count when the filter scores by ``reward_std`` or ``reward_variance``
(the StarPO-S and RAGEN-2 filters); under another ``filter.metric`` the collapse is undefined
(:func:`defined_for`).
"""
from __future__ import annotations

from typing import Mapping, Sequence

#: the share of a step's groups with zero reward std that counts as "all alike"
ZERO_STD_SHARE = 0.9
#: that many consecutive training steps
RUN_LENGTH = 10
#: held-out success this far below its peak so far
SUCCESS_DROP = 0.1
#: the filter scores under which ``filter/zero_groups`` counts zero-std groups
ZERO_STD_METRICS = ("reward_std", "reward_variance")


def defined_for(filter_metric: str) -> bool:
    """Whether ``filter/zero_groups`` counts zero-std groups under ``filter.metric``."""
    return filter_metric in ZERO_STD_METRICS


def zero_std_share(row: Mapping[str, float], env_groups: int) -> float | None:
    """The share of a training step's groups with zero in-group reward std (None: the step
    logged no filter, e.g. the step-0 evaluation)."""
    if "filter/zero_groups" not in row:
        return None
    return float(row["filter/zero_groups"]) / env_groups


def collapse_step(rows: Sequence[Mapping[str, float]], env_groups: int,
                  success_key: str = "val/success") -> int | None:
    """The first step at which the run has collapsed (module docstring), or None.

    ``rows`` are the run's metrics.jsonl records in step order (one per step, ``step`` in each;
    ``ragen_mega.plot.load_metrics``), ``env_groups`` the groups a training step plays."""
    in_row, last_step, peak, latest = 0, None, None, None
    for row in rows:
        step = int(row["step"])
        if success_key in row:
            latest = float(row[success_key])
            peak = latest if peak is None else max(peak, latest)
        share = zero_std_share(row, env_groups)
        if share is None:
            continue
        if share >= ZERO_STD_SHARE:  # a gap in the logged steps starts the count again
            in_row = in_row + 1 if last_step is not None and step == last_step + 1 else 1
        else:
            in_row = 0
        last_step = step
        if in_row >= RUN_LENGTH and peak is not None and peak - latest >= SUCCESS_DROP - 1e-12:
            return step
    return None

