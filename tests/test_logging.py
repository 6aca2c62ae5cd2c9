"""TensorBoard scalars are readable by TensorBoard's own reader; echo-trap warnings fire."""
from __future__ import annotations

import io
import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ragen_mega.logging import EchoTrapThresholds, RunLogger


def test_scalars_roundtrip_through_tensorboard_reader(tmp_path):
    out = io.StringIO()
    logger = RunLogger(tmp_path, total_steps=2, stream=out)
    logger.log(1, {"rollout/success": 0.25, "actor/entropy": 1.5, "custom/x": 3})
    logger.log(2, {"rollout/success": 0.5, "actor/entropy": 1.25, "custom/x": 4})
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"rollout/success", "actor/entropy", "custom/x"} <= set(acc.Tags()["scalars"])
    got = [(e.step, e.value) for e in acc.Scalars("rollout/success")]
    assert got == [(1, 0.25), (2, 0.5)]
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1/2 | succ 0.25") and "ent 1.5" in lines[0]
    assert "WARNING" not in out.getvalue()


def test_echo_trap_warnings(tmp_path):
    out = io.StringIO()
    logger = RunLogger(tmp_path, total_steps=1, stream=out,
                       thresholds=EchoTrapThresholds(min_group_reward_std=0.05, min_entropy=0.1,
                                                     max_grad_norm=10.0))
    warnings = logger.log(1, {"filter/in_group_std": 0.0,
                              "actor/entropy": 0.01, "actor/grad_norm": 50.0})
    logger.close()
    assert len(warnings) == 3
    assert any("filter/in_group_std" in w and "echo trap" in w for w in warnings)
    assert out.getvalue().count("WARNING step 1") == 3
    # A NaN grad norm is always worth a warning; healthy values give none.
    assert logger.monitor.check({"actor/grad_norm": math.nan})
    assert not logger.monitor.check({"actor/entropy": 0.5, "actor/grad_norm": 1.0,
                                     "filter/in_group_std": 0.3})
    # the collapse probes' retrieval near chance: template collapse (RAGEN-2)
    key = "collapse_first_turn_sample/retrieval_above_chance"
    [warning] = logger.monitor.check({key: 0.02})
    assert warning.startswith(f"{key}=0.02 is below min_retrieval_above_chance=0.05") and \
        "template collapse" in warning
    assert not logger.monitor.check({key: 0.6})


def test_step_lines_carry_the_time_left_at_the_runs_pace():
    """The first step's own time, then the wall time per step since the first logged one
    (evaluations and saves included): 10 steps, step 1 took 3 s -> 27 s left; step 4 logged
    30 s after step 1 -> 10 s a step -> 60 s left; no estimate for the step-0 evaluation."""
    from ragen_mega.logging import StepPace, format_console_line

    pace = StepPace()
    assert pace.eta_s(0, 10, {}, now=0.0) is None
    assert pace.eta_s(1, 10, {"time/step_s": 3.0}, now=5.0) == 27.0
    assert pace.eta_s(4, 10, {"time/step_s": 1.0}, now=35.0) == 60.0
    assert pace.eta_s(10, 10, {"time/step_s": 1.0}, now=95.0) is None   # the last step
    assert format_console_line(4, 10, {"rollout/success": 0.5}, 3725.0) == \
        "step 4/10 | eta 1h02m | succ 0.5"
    assert format_console_line(4, 10, {}, 245.0) == "step 4/10 | eta 4m05s"
