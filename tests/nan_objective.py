"""A test-side objective whose loss is NaN on chosen updates: how the whole-run fault test reaches
the trainer's skip path for real. It wraps the role's real objective and is installed where the
run builds its objectives (``algo.objectives.OBJECTIVES``, read by ``ray/run.py``); its class
travels to the Ray trainer ranks by value (:func:`install`), as a tests module is not importable
there."""
from __future__ import annotations


class NanOnUpdates:
    """``inner`` with its loss times NaN on the ``updates``-th updates (1-based) of the trainer
    process that holds it: every parameter's gradient becomes NaN on those updates."""

    def __init__(self, inner, updates):
        self.inner, self.updates, self.count = inner, set(updates), 0
        self.keys, self.stat_names = inner.keys, inner.stat_names
        self.needs_reference = inner.needs_reference

    def prepare(self, batch: dict) -> dict:  # once per update, before its micro-batches
        self.count += 1
        return self.inner.prepare(batch)

    def summarize(self, metrics: dict) -> dict:
        return self.inner.summarize(metrics)

    def __call__(self, outputs, mb, norm):
        loss, stats = self.inner(outputs, mb, norm)
        return (loss * float("nan") if self.count in self.updates else loss), stats


def install(monkeypatch, role: str, updates) -> None:
    """The run's ``role`` trainer minimises its real objective, NaN on ``updates``."""
    import sys

    from ray import cloudpickle

    from ragen_mega.algo.objectives import OBJECTIVES, PolicyObjective, ValueObjective

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    real = {"actor": PolicyObjective, "critic": ValueObjective}[role]
    monkeypatch.setitem(OBJECTIVES, role, lambda settings, **kw: NanOnUpdates(real(settings, **kw),
                                                                          updates))
