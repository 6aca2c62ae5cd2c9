"""Filter -> batch -> advantages on hand-built episodes, against hand-worked numbers."""
from __future__ import annotations

import pytest
import torch

from ragen_mega.algo.estimators import compute_advantages
from ragen_mega.config import AlgoConfig
from ragen_mega.rollout.batch import build_batch, filter_groups
from ragen_mega.rollout.sample import Sample


def turn(ep, group, t, reward, last, prompt=(1, 2, 3), response=(7, 8), tag="x"):
    return Sample(list(prompt), list(response), [-1.0] * len(response), reward, ep, group, t,
                  done=last, last=last, env_tag=tag, seed=group)


def test_filter_keeps_the_most_varied_group():
    samples = [turn(0, 0, 1, 1.0, True), turn(1, 0, 1, 1.0, True),       # group 0: std 0
               turn(2, 1, 1, 0.0, True), turn(3, 1, 1, 2.0, True),       # group 1: std sqrt(2)
               turn(4, 2, 1, 0.0, False), turn(4, 2, 2, 0.5, True),      # group 2: totals 0.5, 0
               turn(5, 2, 1, 0.0, True)]
    kept, metrics, *_ = filter_groups(samples, ratio=0.34, mode="std")
    assert {s.episode_id for s in kept} == {2, 3}
    kept_rev, *_ = filter_groups(samples, ratio=0.34, mode="std_rev")
    assert {s.episode_id for s in kept_rev} == {0, 1}
    assert metrics["filter/kept_groups"] == 1.0
    assert metrics["filter/in_group_std"] == pytest.approx((0 + 2 ** 0.5 + 0.5 / 2 ** 0.5) / 3)


def test_filter_counts_kept_groups_per_env_tag():
    # groups 0, 1 play env "a", group 2 plays "b"; stds: 0, 1.5, 0.5 -> top 2 keep groups 1, 2
    samples = [turn(0, 0, 1, 1.0, True, tag="a"), turn(1, 0, 1, 1.0, True, tag="a"),
               turn(2, 1, 1, 0.0, True, tag="a"), turn(3, 1, 1, 3.0 / 2 ** 0.5, True, tag="a"),
               turn(4, 2, 1, 0.0, True, tag="b"), turn(5, 2, 1, 1.0 / 2 ** 0.5, True, tag="b")]
    kept, metrics, *_ = filter_groups(samples, ratio=0.67, mode="std")
    assert {s.group_id for s in kept} == {1, 2}
    assert metrics["filter/a/kept_groups"] == 1.0 and metrics["filter/b/kept_groups"] == 1.0
    _, one_env, *_ = filter_groups([s for s in samples if s.env_tag == "a"], ratio=1.0)
    assert not any(k.count("/") > 1 for k in one_env)  # one env: no per-tag duplicates


def test_filter_scores_members_by_entropy_and_length_and_weighs_advantages():
    """A member's entropy is the mean over its turns of a turn's mean token NLL (the engine's
    log-probs), its length the response tokens of all its turns."""
    def with_logprobs(sample, logprobs):
        sample.rollout_logprobs = list(logprobs)
        sample.response_ids = list(range(len(logprobs)))
        return sample

    samples = [  # group 0: episode 0 turns NLL 1 and 3 (mean 2), episode 1 NLL 0.5 -> 1.25
        with_logprobs(turn(0, 0, 1, 0.0, False), [-1.0, -1.0]),
        with_logprobs(turn(0, 0, 2, 1.0, True), [-3.0]),
        with_logprobs(turn(1, 0, 1, 0.0, True), [-0.5, -0.5, -0.5, -0.5]),
        # group 1: NLL 1.5 and 1.0 -> 1.25 too, but 6 + 7 tokens against group 0's 3 + 4
        with_logprobs(turn(2, 1, 1, 2.0, True), [-1.5] * 6),
        with_logprobs(turn(3, 1, 1, 0.0, True), [-1.0] * 7)]
    _, metrics, *_ = filter_groups(samples, ratio=0.5, metric="entropy", mode="largest")
    assert metrics["filter/score"] == pytest.approx(1.25)
    kept, *_ = filter_groups(samples, ratio=0.5, metric="length", mode="largest")
    assert {s.group_id for s in kept} == {1}
    kept, metrics, weights, scores = filter_groups(samples, ratio=0.5, metric="length",
                                                   mode="smallest")
    assert {s.group_id for s in kept} == {0} and metrics["filter/chosen_score"] == 3.5
    assert scores == {0: 3.5, 1: 6.5}  # every group's score, the filtered one's too
    # rewards: group 0 scores 1 and 0 (std 1/sqrt 2), group 1 2 and 0 (std sqrt 2); both kept,
    # each weighed by its std over the larger one, then by sqrt(kept share) = 1
    kept, _, weights, _ = filter_groups(samples, ratio=1.0, soft_reweight=True,
                                        loss_scaling="sqrt")
    assert [s.group_id for s in kept] == [0, 0, 0, 1, 1]
    assert weights.tolist() == pytest.approx([0.5] * 3 + [1.0] * 2, abs=1e-5)


def test_grpo_advantages_per_episode_score():
    # group 0: episodes score 1 and 3 (mean 2, std sqrt 2); group 1: one two-turn episode + 0
    samples = [turn(0, 0, 1, 1.0, True), turn(1, 0, 1, 3.0, True),
               turn(2, 1, 1, 0.5, False), turn(2, 1, 2, 0.5, True), turn(3, 1, 1, 0.0, True)]
    batch = compute_advantages(build_batch(samples, pad_id=0), AlgoConfig(adv_estimator="grpo"))
    s2 = 2 ** 0.5
    per_row = [-1 / s2, 1 / s2, 1 / (2 ** 0.5), 1 / (2 ** 0.5), -1 / s2]  # hand-worked
    adv = batch["advantages"]
    for i, expected in enumerate(per_row):
        toks = adv[i][batch["loss_mask"][i].bool()]
        assert toks.tolist() == pytest.approx([expected] * 2, rel=1e-5)
        assert adv[i][~batch["loss_mask"][i].bool()].abs().sum() == 0


def test_bi_level_gae_gamma_lambda_one_is_return_minus_value():
    # one episode of two turns: rewards 0.25 then 1.0; the turn return of turn 1 is 1.25
    samples = [turn(0, 0, 1, 0.25, False), turn(0, 0, 2, 1.0, True, prompt=(1, 2, 3, 4, 5))]
    batch = build_batch(samples, pad_id=0)
    values = torch.arange(batch["loss_mask"].numel(), dtype=torch.float32).view_as(
        batch["loss_mask"]) / 10
    batch = compute_advantages(batch, AlgoConfig(adv_estimator="gae", whiten_advantages=False), token_values=values)
    expected_returns = [1.25, 1.0]
    for i, ret in enumerate(expected_returns):
        m = batch["loss_mask"][i].bool()
        assert batch["advantages"][i][m].tolist() == pytest.approx((ret - values[i][m]).tolist())
        assert batch["returns"][i][m].tolist() == pytest.approx([ret] * int(m.sum()))


def test_whitened_gae_advantages_are_centred_over_response_tokens():
    """``whiten=True`` (algo.whiten_advantages, verl's GAE): the same return-minus-value
    advantages, standardised over the response tokens only (unbiased variance, worked out by
    hand here); returns stay raw, padding stays 0."""
    samples = [turn(0, 0, 1, 0.25, False), turn(0, 0, 2, 1.0, True, prompt=(1, 2, 3, 4, 5))]
    batch = build_batch(samples, pad_id=0)
    values = torch.arange(batch["loss_mask"].numel(), dtype=torch.float32).view_as(
        batch["loss_mask"]) / 10
    out = compute_advantages(dict(batch), AlgoConfig(adv_estimator="gae"), token_values=values)
    m = batch["loss_mask"].bool()
    raw = [ret - v for i, ret in enumerate([1.25, 1.0]) for v in values[i][m[i]].tolist()]
    mean = sum(raw) / len(raw)
    std = (sum((a - mean) ** 2 for a in raw) / (len(raw) - 1)) ** 0.5
    assert out["advantages"][m].tolist() == pytest.approx([(a - mean) / std for a in raw],
                                                          rel=1e-5)
    assert out["advantages"][~m].abs().sum() == 0
    assert out["returns"][0][m[0]].tolist() == pytest.approx([1.25] * int(m[0].sum()))


def test_gae_needs_values():
    batch = build_batch([turn(0, 0, 1, 1.0, True)], pad_id=0)
    with pytest.raises(ValueError, match="gae needs critic token_values"):
        compute_advantages(batch, AlgoConfig(adv_estimator="gae"))
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages(batch, AlgoConfig(adv_estimator="ppo"))


def test_summarize_means_and_pass_at_k():
    from ragen_mega.rollout.metrics import summarize
    from ragen_mega.rollout.episode import Episode

    def episode(group, success, reward):
        metrics = {"success": success, "reward": reward, "num_turns": 1.0}
        return Episode([turn(0, group, 1, reward, True, response=(1, 2, 3))], metrics)

    eps = [episode(0, 1.0, 1.0), episode(0, 0.0, 0.0), episode(1, 0.0, 0.0), episode(1, 0.0, 2.0)]
    out = summarize(eps, "rollout")
    assert out["rollout/success"] == 0.25 and out["rollout/reward_mean"] == 0.75
    assert out["rollout/pass@2"] == 0.5          # group 0 has a success, group 1 none
    assert out["rollout/response_length"] == 3.0
    assert out["rollout/reward_std"] == pytest.approx(torch.tensor([1.0, 0, 0, 2]).std().item())
    assert out["rollout/mixed_groups"] == 0.5    # group 0 won once and lost once, group 1 never won
    assert out["rollout/wins_after_turn_1"] == 0.0  # its one win came in its first (only) turn


def test_summarize_wins_after_the_first_turn():
    from ragen_mega.rollout.metrics import summarize
    from ragen_mega.rollout.episode import Episode

    def episode(group, success, turns):
        return Episode([turn(0, group, t, 0.0, t == turns, response=(1,))
                        for t in range(1, turns + 1)],
                       {"success": success, "reward": success, "num_turns": float(turns)})

    eps = [episode(0, 1.0, 1), episode(0, 1.0, 3), episode(1, 1.0, 2), episode(1, 0.0, 5)]
    out = summarize(eps, "val")
    assert out["val/wins_after_turn_1"] == pytest.approx(2 / 3)  # 2 of the 3 wins
    assert out["val/mixed_groups"] == 0.5                        # group 1 only
    out = summarize([episode(0, 0.0, 2), episode(0, 0.0, 1)], "val")
    assert "val/wins_after_turn_1" not in out and out["val/mixed_groups"] == 0.0
    assert "val/mixed_groups" not in summarize([episode(0, 1.0, 1), episode(1, 0.0, 1)], "val")


def test_a_step_whose_filter_keeps_nothing_moves_no_model():
    """top_p linear keeps no group when none varies (RAGEN's empty step): the loop's update
    returns before it reaches a model (``run`` is never touched here) and says so in the
    filter's scalars."""
    from ragen_mega.config import load_run_config
    from ragen_mega.rollout.faults import FaultCounters
    from ragen_mega.rollout.manager import PlayedStep
    from ragen_mega.train import update_models

    cfg = load_run_config(None, ["filter.strategy=top_p", "filter.top_p=0.9"])
    flat = [turn(0, 0, 1, 1.0, True), turn(1, 0, 1, 1.0, True),
            turn(2, 1, 1, 0.0, True), turn(3, 1, 1, 0.0, True)]
    metrics = {}
    played = PlayedStep(flat, {}, 0.0, FaultCounters(step=1))
    update = update_models(cfg, None, 1, played, metrics)
    assert update.train is None and update.per_turn is None and update.filtered.samples == []
    assert update.filtered.scores == {0: 0.0, 1: 0.0}  # the trajectory files still see both
    assert metrics["filter/kept_groups"] == 0.0 and metrics["filter/zero_groups"] == 2.0
