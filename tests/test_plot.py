"""``ragen-mega plot``: the figure's lines carry each run's metrics; bad run dirs are clear errors."""
from __future__ import annotations

import json
import re

import pytest

from conftest import documented_scalars
from ragen_mega import cli
from ragen_mega.plot import PANELS, plot_runs


def write_run(run_dir, rows):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_two_runs_overlaid(tmp_path):
    a = write_run(tmp_path / "vanilla", [
        {"step": 1, "rollout/success": 0.25, "actor/entropy": 2.0, "time/rollout_s": 3.0},
        {"step": 2, "rollout/success": 0.5, "actor/entropy": 1.5, "time/rollout_s": 2.0,
         "val/success": 0.4},
        {"step": 3, "rollout/success": 0.75, "actor/entropy": 1.0, "time/rollout_s": 2.5}])
    b = write_run(tmp_path / "starpo_s", [
        {"step": 1, "rollout/success": 0.1, "filter/in_group_std": 0.3,
         "filter/chosen_in_group_std": 0.45}])
    out = tmp_path / "plots" / "curves.png"
    fig = plot_runs([a, b], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
             for ax in fig.axes for line in ax.lines}
    assert lines["vanilla train"] == ([1, 2, 3], [0.25, 0.5, 0.75])   # success panel
    assert lines["vanilla val"] == ([2], [0.4])                      # only the step that evaluated
    assert lines["starpo_s train"] == ([1], [0.1])
    assert lines["starpo_s before filter"] == ([1], [0.3])
    assert lines["starpo_s after filter"] == ([1], [0.45])
    assert lines["vanilla"] == ([1, 2, 3], [2.0, 1.5, 1.0])           # entropy (no sub-label)
    assert lines["vanilla rollout"] == ([1, 2, 3], [3.0, 2.0, 2.5])
    # both runs' success curves share the success panel, in different colours
    success_ax = fig.axes[0]
    assert {l.get_label() for l in success_ax.lines} == {"vanilla train", "vanilla val",
                                                          "starpo_s train"}
    colours = {l.get_label(): l.get_color() for l in success_ax.lines}
    assert colours["vanilla train"] != colours["starpo_s train"]


def test_a_resumed_runs_replayed_steps_are_drawn_once_with_the_replay(tmp_path):
    """Resumed from step 1's checkpoint after step 3, the run appended steps 2 and 3 again."""
    run = write_run(tmp_path / "resumed", [
        {"step": 1, "rollout/success": 0.1}, {"step": 2, "rollout/success": 0.2},
        {"step": 3, "rollout/success": 0.3}, {"step": 2, "rollout/success": 0.25},
        {"step": 3, "rollout/success": 0.35}, {"step": 4, "rollout/success": 0.4}])
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
             for ax in plot_runs([run]).axes for line in ax.lines}
    assert lines["resumed train"] == ([1, 2, 3, 4], [0.1, 0.25, 0.35, 0.4])


def test_missing_and_empty_metrics_name_the_path(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope" / "metrics.jsonl")):
        plot_runs([tmp_path / "nope"])
    empty = write_run(tmp_path / "empty", [])
    with pytest.raises(ValueError, match="has no steps"):
        plot_runs([empty])
    assert cli.main(["plot", str(empty), "--out", str(tmp_path / "x.png")]) == 2
    assert str(empty / "metrics.jsonl") in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_panels_plot_scalars_the_loop_publishes():
    """Every curve reads a scalar under the name docs/metrics.md's table gives it (held-out
    ``val/`` names are the ``rollout/`` ones), so a renamed metric cannot leave a panel silently
    empty."""
    documented = documented_scalars()
    for panel, keys in PANELS.items():
        for key, _ in keys:
            assert re.sub(r"^val/", "rollout/", key) in documented, (panel, key)
