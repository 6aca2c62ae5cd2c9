"""Per-env-tag metrics of a mixed-env run: ``summarize`` against hand-computed values, and the
console line's per-tag success. Pure functions over hand-made episodes: no Ray, no engine."""
from __future__ import annotations

import math

import pytest

from ragen_mega.logging import format_console_line
from ragen_mega.rollout.metrics import summarize
from ragen_mega.rollout.episode import Episode
from ragen_mega.rollout.sample import Sample


def episode(tag, group, episode_id, reward, success, lengths):
    """An episode of ``len(lengths)`` turns with responses of those lengths."""
    samples = [Sample(prompt_ids=[1], response_ids=[7] * n, rollout_logprobs=[0.0] * n,
                      reward=0.0, episode_id=episode_id, group_id=group, turn=t + 1, done=False,
                      last=t == len(lengths) - 1, env_tag=tag, seed=0)
               for t, n in enumerate(lengths)]
    return Episode(samples, {"success": float(success), "reward": float(reward),
                             "num_turns": float(len(lengths))})


EPISODES = [  # tag "box": groups 0 and 1; tag "lake": group 2; groups of two episodes
    episode("box", 0, 0, 1.0, True, [3]), episode("box", 0, 1, 0.0, False, [3]),
    episode("box", 1, 2, 0.0, False, [3]), episode("box", 1, 3, 0.0, False, [3]),
    episode("lake", 2, 4, 2.0, True, [5, 7]), episode("lake", 2, 5, 1.0, True, [5, 7]),
]


def test_summarize_overall_and_per_tag_by_hand():
    m = summarize(EPISODES, "rollout")
    # overall: rewards 1,0,0,0,2,1 -> mean 2/3, unbiased var (1/9+3*4/9+16/9+1/9)/5 = 2/3
    assert m["rollout/success"] == pytest.approx(3 / 6)
    assert m["rollout/reward_mean"] == pytest.approx(4 / 6) and "rollout/reward" not in m
    assert m["rollout/reward_std"] == pytest.approx(math.sqrt(2 / 3))
    assert m["rollout/response_length"] == pytest.approx((4 * 3 + 2 * (5 + 7)) / 8)
    assert m["rollout/pass@2"] == pytest.approx(2 / 3)  # groups 0 and 2 have a success
    # box: rewards 1,0,0,0 -> mean 1/4, var (9/16 + 3/16)/3 = 1/4
    assert m["rollout/box/success"] == pytest.approx(1 / 4)
    assert m["rollout/box/reward_mean"] == pytest.approx(1 / 4)
    assert m["rollout/box/reward_std"] == pytest.approx(0.5)
    assert m["rollout/box/response_length"] == pytest.approx(3.0)
    assert m["rollout/box/pass@2"] == pytest.approx(1 / 2)
    # in-group std: group 0 (1, 0) -> sqrt(1/2), group 1 (0, 0) -> 0
    assert m["rollout/box/group_reward_std_before_filter"] == pytest.approx(math.sqrt(0.5) / 2)
    # lake: rewards 2,1
    assert m["rollout/lake/success"] == pytest.approx(1.0)
    assert m["rollout/lake/reward_mean"] == pytest.approx(1.5)
    assert m["rollout/lake/reward_std"] == pytest.approx(math.sqrt(0.5))
    assert m["rollout/lake/response_length"] == pytest.approx(6.0)
    assert m["rollout/lake/pass@2"] == pytest.approx(1.0)
    assert m["rollout/lake/group_reward_std_before_filter"] == pytest.approx(math.sqrt(0.5))
    # groups with both a win and a loss: group 0 of 0, 1, 2; wins after turn 1: the lake's two
    # (two turns each), not the box's (one)
    assert m["rollout/mixed_groups"] == pytest.approx(1 / 3)
    assert m["rollout/box/mixed_groups"] == 0.5 and m["rollout/lake/mixed_groups"] == 0.0
    assert m["rollout/wins_after_turn_1"] == pytest.approx(2 / 3)
    assert m["rollout/box/wins_after_turn_1"] == 0.0 and m["rollout/lake/wins_after_turn_1"] == 1.0
    # the run-wide in-group std is the StarPO-S filter's, not summarize's
    assert "rollout/group_reward_std_before_filter" not in m
    tags = {k.split("/")[1] for k in m if k.count("/") == 2}
    assert tags == {"box", "lake"}


def test_summarize_eval_groups_of_one():
    """Held-out eval plays groups of one episode: no pass@k and no in-group std, overall or per
    tag; per-tag means still split correctly."""
    val = [episode("box", 0, 0, 1.0, True, [2]), episode("box", 1, 1, 0.0, False, [4]),
           episode("lake", 2, 2, 0.0, False, [6])]
    m = summarize(val, "val")
    assert m["val/box/success"] == pytest.approx(0.5) and m["val/lake/success"] == 0.0
    assert m["val/success"] == pytest.approx(1 / 3)
    assert m["val/box/response_length"] == pytest.approx(3.0)
    assert m["val/lake/reward_std"] == 0.0  # one episode
    assert not [k for k in m if "pass@" in k or "group_reward_std" in k]


def test_console_line_shows_success_per_tag_only_for_a_mix():
    mixed = {**summarize(EPISODES, "rollout"), "val/success": 0.5, "val/box/success": 0.25,
             "val/lake/success": 0.75}
    line = format_console_line(3, 10, mixed)
    assert "| succ 0.5 (box 0.25, lake 1) |" in line
    assert "| val succ 0.5 (box 0.25, lake 0.75)" in line
    single = summarize(EPISODES[:4], "rollout")  # one tag: its values equal the totals
    assert "| succ 0.25 |" in format_console_line(3, 10, single)


def test_progression_is_averaged_where_an_env_reports_it():
    """BALROG's progression (the env's ``info["progression"]``): an episode of that env that
    reported none made no progress; an env that reports none gets no key of its own."""
    tw = [episode("tw", g, g, 0.0, False, [2]) for g in range(3)]
    tw[0].metrics["progression"], tw[1].metrics["progression"] = 0.5, 1.0
    m = summarize(tw + EPISODES[:2], "val")
    assert m["val/tw/progression"] == pytest.approx(0.5)          # (0.5 + 1 + 0) / 3
    assert m["val/progression"] == pytest.approx(1.5 / 5)
    assert "val/box/progression" not in m
