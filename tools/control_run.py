"""``python tools/control_run.py {no-sync,flip-sign} CONFIG [key=value ...]``: ``ragen-mega
train`` with one link of the loop cut on purpose, for the control curves of a learning demo.

A curve that rises proves little alone: the control runs show that the rise comes from the loop.

- ``no-sync``: the engines keep serving the weights they started with (``model.path``); the
  trainer trains as usual but its weights never reach the rollout (``Run.sync_weights`` only
  records the version). The held-out curve must stay where it started.
- ``flip-sign``: every advantage is negated after the estimator: the actor is pushed away from
  what won. The curve must fall or stay at the start.

The cut is made in this process only (the driver, where the loop, the advantages and the sync
orchestration run), never in the library: nothing here changes ``ragen-mega train``.
"""
from __future__ import annotations

import sys

CONTROLS = ("no-sync", "flip-sign")


def cut(control: str) -> None:
    """Patch the loop of this process for ``control`` (one of :data:`CONTROLS`)."""
    import ragen_mega.train as train_module
    from ragen_mega.ray.run import Run

    if control == "no-sync":
        def keep_engine_weights(self, version: int) -> dict[str, float]:
            self.weight_version = version
            return {}
        Run.sync_weights = keep_engine_weights
    elif control == "flip-sign":
        estimate = train_module.compute_advantages

        def flipped(batch, *args, **kwargs):
            out = estimate(batch, *args, **kwargs)
            out["advantages"] = -out["advantages"]
            return out
        train_module.compute_advantages = flipped
    else:
        raise SystemExit(f"control must be one of {', '.join(CONTROLS)}, got {control!r}")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        raise SystemExit(__doc__.split("\n\n")[0])
    cut(argv[0])
    from ragen_mega.train import main as train_main

    return train_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
