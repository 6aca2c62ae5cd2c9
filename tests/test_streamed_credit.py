"""Credit in streamed steps (``rollout.mode: turns``): the cut bootstrap of the advantages and the
StarPO-S group score of env streams, against hand-worked numbers."""
from __future__ import annotations

import pytest
import torch

from ragen_mega.algo.estimators import compute_advantages
from ragen_mega.config import AlgoConfig
from ragen_mega.rollout.batch import build_batch, filter_groups
from ragen_mega.rollout.sample import Sample


def sample(episode, turn, reward, *, last=False, done=False, cut=False, group=0, stream=None):
    return Sample(prompt_ids=[5, 6], response_ids=[7, 8], rollout_logprobs=[-1.0, -1.0],
                  reward=reward, episode_id=episode, group_id=group, turn=turn, done=done,
                  last=last, env_tag="t", seed=0, stream=stream, cut=cut)


def test_cut_bootstrap_hand_worked():
    """gamma = lambda = 0.5. Token values are constant within a turn (V of the turn), so every
    loss token's advantage is the turn-level advantage and its return the turn-level return.

    Episode 7, a fragment (turns 1-2 were trained in an earlier step), cut after turn 4:
      r3 = 1, r4 = 0, V3 = 0.5, V4 = 1.0, V(after the cut) = 2.0
      delta4 = 0 + 0.5*2.0 - 1.0 = 0.0                A4 = 0.0     R4 = 1.0
      delta3 = 1 + 0.5*1.0 - 0.5 = 1.0                A3 = 1.0 + 0.25*0.0 = 1.0    R3 = 1.5
      (without the bootstrap: delta4 = -1.0, A4 = -1.0, A3 = 1.0 + 0.25*(-1.0) = 0.75)
    Episode 9 ends in the window (done at turn 2); the 100 at its row must not be read:
      r1 = 0, r2 = 1, V1 = 0.25, V2 = 0.5
      delta2 = 1 - 0.5 = 0.5                          A2 = 0.5     R2 = 1.0
      delta1 = 0 + 0.5*0.5 - 0.25 = 0.0               A1 = 0.0 + 0.25*0.5 = 0.125  R1 = 0.375
    Episode 11 hits max_turns at turn 6 (last, not done): terminal as in episodes mode.
      r6 = 1, V6 = 0.5: A6 = 0.5, R6 = 1.0
    """
    samples = [sample(7, 3, 1.0), sample(9, 1, 0.0), sample(7, 4, 0.0, cut=True),
               sample(9, 2, 1.0, last=True, done=True), sample(11, 6, 1.0, last=True)]
    turn_v = torch.tensor([0.5, 0.25, 1.0, 0.5, 0.5])
    boot = torch.tensor([0.0, 0.0, 2.0, 100.0, 100.0])
    want_adv = torch.tensor([1.0, 0.125, 0.0, 0.5, 0.5])
    want_ret = torch.tensor([1.5, 0.375, 1.0, 1.0, 1.0])

    def run(bootstrap):
        batch = build_batch(samples, pad_id=0)
        values = turn_v[:, None].expand_as(batch["loss_mask"]).clone()
        out = compute_advantages(batch, AlgoConfig(adv_estimator="gae", whiten_advantages=False, gamma=0.5,
                                                       lam=0.5),
                                 token_values=values, bootstrap_values=bootstrap)
        mask = out["loss_mask"].bool()
        assert mask.sum(1).tolist() == [2] * 5
        return (out["advantages"][mask].view(5, 2), out["returns"][mask].view(5, 2))

    adv, ret = run(boot)
    assert torch.allclose(adv, want_adv[:, None].expand(5, 2))
    assert torch.allclose(ret, want_ret[:, None].expand(5, 2))
    # a zero bootstrap is a terminal cut: episode 7 falls back to the hand-worked 0.75 / -1.0
    adv0, _ = run(torch.zeros(5))
    assert adv0[:, 0].tolist() == pytest.approx([0.75, 0.125, -1.0, 0.5, 0.5])
    # an episode that goes on with no bootstrap given is refused, not silently made terminal
    with pytest.raises(ValueError, match="truncated"):
        run(None)


def test_stream_filter_keeps_the_high_spread_group():
    """Two groups of two streams, two turns each in the window; ratio 0.5 keeps one group.

    Group 0: stream 0 plays episode 0 (rewards 1, 1: window sum 2); stream 1 finishes episode 1
    (reward 1) and starts episode 5 (reward 1): window sum 2. Stream spread: std(2, 2) = 0.
    Group 1: stream 2 (0.5, 0.5) = 1.0 and stream 3 (0.5, 1.0) = 1.5: std = 0.3536.
    By stream the filter keeps group 1. Scored per episode it would keep group 0 instead
    (episode totals 2, 1, 1: std 0.577 > 0.354): a stream that finished a short episode and
    began the next is not a worse group member than one still in its first.
    """
    samples = [sample(0, 1, 1.0, stream=0), sample(0, 2, 1.0, stream=0, cut=True),
               sample(1, 3, 1.0, stream=1, last=True, done=True),
               sample(5, 1, 1.0, stream=1, cut=True),
               sample(2, 4, 0.5, group=1, stream=2), sample(2, 5, 0.5, group=1, stream=2, cut=True),
               sample(3, 1, 0.5, group=1, stream=3), sample(3, 2, 1.0, group=1, stream=3, cut=True)]
    kept, metrics, *_ = filter_groups(samples, ratio=0.5, mode="std", by_stream=True)
    assert [s.stream for s in kept] == [2, 2, 3, 3]
    assert metrics["filter/chosen_in_group_std"] == pytest.approx(0.5 ** 0.5 / 2)
    assert metrics["filter/in_group_std"] == pytest.approx(0.5 ** 0.5 / 4)
    by_episode = filter_groups(samples, ratio=0.5, mode="std").samples
    assert {s.group_id for s in by_episode} == {0}
