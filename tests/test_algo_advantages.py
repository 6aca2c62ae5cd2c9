"""Advantage estimators against hand-worked values and naive per-episode python loops."""
from __future__ import annotations

import math

import pytest
import torch

from ragen_mega.algo.advantages import (advantage_metrics, bi_level_token_gae,
                                        broadcast_to_tokens, gae, grpo, kl_penalized_rewards,
                                        masked_whiten, normalize_scores, turn_level_gae)


def _naive_gae(rewards: list[float], values: list[float], gamma: float, lam: float,
               last_value: float = 0.0) -> list[float]:
    """Textbook GAE over one trajectory of steps, in plain python floats."""
    adv, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_v = values[t + 1] if t + 1 < len(rewards) else last_value
        running = rewards[t] + gamma * next_v - values[t] + gamma * lam * running
        adv[t] = running
    return adv


def _random_multi_turn(seed: int, rows: int = 5, seq: int = 30):
    """Rows of [prompt | response | observation | response ... | padding] with rewards on the
    last token of each response segment."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, seq)
    rewards = torch.zeros(rows, seq)
    for r in range(rows):
        t = int(torch.randint(0, 4, (1,), generator=g))
        while t < seq - 2:
            length = int(torch.randint(1, 5, (1,), generator=g))
            end = min(t + length, seq)
            mask[r, t:end] = 1
            rewards[r, end - 1] = float(torch.randn(1, generator=g))
            t = end + int(torch.randint(1, 5, (1,), generator=g))  # observation tokens
    values = torch.randn(rows, seq, generator=g)
    return rewards, values, mask


def test_gae_gamma_lambda_one_is_reward_to_go_minus_value():
    rewards, values, mask = _random_multi_turn(0)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    to_go = rewards.flip(-1).cumsum(-1).flip(-1)  # rewards only sit on loss tokens
    torch.testing.assert_close(adv, (to_go - values) * mask)
    torch.testing.assert_close(ret, to_go * mask)


@pytest.mark.parametrize("gamma,lam", [(0.9, 0.8), (0.99, 0.95), (1.0, 0.5)])
def test_gae_matches_naive_loop_over_loss_tokens(gamma, lam):
    rewards, values, mask = _random_multi_turn(1)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    for r in range(mask.shape[0]):
        idx = torch.nonzero(mask[r]).flatten().tolist()
        expected = _naive_gae(rewards[r, idx].tolist(), values[r, idx].tolist(), gamma, lam)
        torch.testing.assert_close(adv[r, idx], torch.tensor(expected), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret[r, idx], torch.tensor(expected) + values[r, idx],
                                   atol=1e-5, rtol=1e-5)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_gae_skips_observation_tokens_hand_values():
    # [response a | obs | obs | response b], reward 1 on b; obs values are garbage
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, -9.0, 0.2]])
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # b: delta = 1 - 0.2 = 0.8 -> A = 0.8
    # a: delta = 0.9 * 0.2 - 0.5 = -0.32 -> A = -0.32 + 0.9 * 0.8 * 0.8 = 0.256
    torch.testing.assert_close(adv, torch.tensor([[0.256, 0.0, 0.0, 0.8]]))
    torch.testing.assert_close(ret, torch.tensor([[0.756, 0.0, 0.0, 1.0]]))


def test_gae_rejects_rewards_on_masked_positions_and_bad_shapes():
    with pytest.raises(ValueError, match="masked"):
        gae(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]))
    with pytest.raises(ValueError, match="shapes"):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4))


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 50.0], [3.0, 4.0, 50.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    std = math.sqrt(((1 - 2.5) ** 2 + (2 - 2.5) ** 2 + (3 - 2.5) ** 2 + (4 - 2.5) ** 2) / 3)
    expected = torch.tensor([[(1 - 2.5) / std, (2 - 2.5) / std, 0.0],
                             [(3 - 2.5) / std, (4 - 2.5) / std, 0.0]])
    torch.testing.assert_close(masked_whiten(x, mask), expected)
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False),
                               (expected + 2.5) * mask)


def test_grpo_hand_values():
    scores = torch.tensor([1.0, 0.0, 5.0, 0.0, 2.0, 1.0, 2.0])
    groups = torch.tensor([10, 10, 3, 10, 7, 10, 7])  # unsorted, non-contiguous ids
    # group 10: [1, 0, 0, 1], mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    a = 0.5 / math.sqrt(1 / 3)
    expected = torch.tensor([a, -a, 0.0, -a, 0.0, a, 0.0])  # group 3 is alone, group 7 flat
    torch.testing.assert_close(grpo(scores, groups), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grpo(scores, groups, norm_by_std=False),
                               torch.tensor([0.5, -0.5, 0.0, -0.5, 0.0, 0.5, 0.0]))


def test_advantage_metrics_weigh_the_trained_tokens():
    """One group: a win in one turn of 2 answer tokens, a loss in three such turns. GRPO gives
    them +0.5 and -0.5, which sum to 0 over the episodes; over the tokens the loss has three
    times the weight: (2 * 0.5 - 6 * 0.5) / 8 = -0.25."""
    episodes = grpo(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), norm_by_std=False)
    advantages = broadcast_to_tokens(episodes[torch.tensor([0, 1, 1, 1])],  # a row per turn
                                     torch.tensor([[0.0, 1.0, 1.0, 0.0]] * 4))
    advantages[:, 0] = 9.0  # a prompt token's value is never read
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]] * 4)
    metrics = advantage_metrics(advantages, mask)
    assert metrics == pytest.approx({"critic/advantages/mean": -0.25,
                                     "critic/advantages/max": 0.5,
                                     "critic/advantages/min": -0.5})
    assert advantage_metrics(advantages, torch.zeros_like(mask)) == {}  # nothing trained
    with pytest.raises(ValueError, match="shapes"):
        advantage_metrics(advantages, mask[:, :3])


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1.0, 1.0, 0.0],
                                                                       [0.0, 1.0, 1.0]]))
    torch.testing.assert_close(out, torch.tensor([[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]))
    with pytest.raises(ValueError, match="per_sample"):
        broadcast_to_tokens(torch.zeros(3), torch.ones(2, 3))


def test_normalize_scores_methods():
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0, 7.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    # group 0: mean 2, unbiased std sqrt(2); group 1 flat; group 2 alone
    s2 = math.sqrt(2.0)
    torch.testing.assert_close(normalize_scores(scores, groups, "identity"), scores)
    torch.testing.assert_close(normalize_scores(scores, groups, "mean"),
                               torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(normalize_scores(scores, groups, "mean_std"),
                               torch.tensor([-1 / (s2 + 1e-6), 1 / (s2 + 1e-6), 0.0, 0.0, 0.0]))


def test_normalize_scores_asym_clip_and_errors():
    # one success among 20 episodes: mean 0.05, unbiased std sqrt(0.95 / 19) = sqrt(0.05)
    success = torch.zeros(20)
    success[0] = 1.0
    out = normalize_scores(success, torch.zeros(20, dtype=torch.long), "asym_clip")
    assert out[0].item() == 3.0  # 0.95 / 0.2236 = 4.25, clipped to 3
    assert out[1].item() == pytest.approx(-0.05 / (math.sqrt(0.05) + 1e-6), abs=1e-5)
    failure = 1.0 - success  # the rare failure: -4.25, clipped to -1
    out = normalize_scores(failure, torch.zeros(20, dtype=torch.long), "asym_clip")
    assert out[0].item() == -1.0
    with pytest.raises(ValueError, match="mean_std"):
        normalize_scores(success, torch.zeros(20), "zscore")


def test_turn_level_gae_hand_values_with_truncated_bootstrap():
    # episode 7: turns 0, 1, done at 1.  episode 3: turns 5, 6 (a window), truncated, V(next)=2
    # samples deliberately shuffled
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.0])
    values = torch.tensor([0.4, 0.2, 0.3, 0.1])
    episodes = torch.tensor([3, 7, 3, 7])
    turns = torch.tensor([6, 1, 5, 0])
    dones = torch.tensor([False, True, False, False])
    boot = torch.tensor([2.0, 99.0, 99.0, 99.0])  # only read at episode 3's last turn
    adv, ret = turn_level_gae(rewards, values, episodes, turns, dones, gamma_turn=0.9,
                              lam_turn=0.8, bootstrap_values=boot)
    # ep 3, turn 6: delta = 0 + 0.9 * 2 - 0.4 = 1.4;  A = 1.4
    # ep 3, turn 5: delta = 0 + 0.9 * 0.4 - 0.3 = 0.06;  A = 0.06 + 0.72 * 1.4 = 1.068
    # ep 7, turn 1: delta = 1 - 0.2 = 0.8;  A = 0.8
    # ep 7, turn 0: delta = 0.9 * 0.2 - 0.1 = 0.08;  A = 0.08 + 0.72 * 0.8 = 0.656
    torch.testing.assert_close(adv, torch.tensor([1.4, 0.8, 1.068, 0.656]))
    torch.testing.assert_close(ret, torch.tensor([1.8, 1.0, 1.368, 0.756]))


def test_turn_level_gae_matches_naive_loop_on_random_episodes():
    g = torch.Generator().manual_seed(3)
    ep_ids, turn_ids, rewards, values, dones, boot = [], [], [], [], [], []
    episodes = {}
    for e in range(6):
        n = int(torch.randint(1, 9, (1,), generator=g))
        start = int(torch.randint(0, 50, (1,), generator=g))
        done = e % 2 == 0
        r = torch.randn(n, generator=g).tolist()
        v = torch.randn(n, generator=g).tolist()
        b = float(torch.randn(1, generator=g))
        episodes[e] = (r, v, 0.0 if done else b)
        for k in range(n):
            ep_ids.append(e), turn_ids.append(start + k), rewards.append(r[k])
            values.append(v[k]), dones.append(done and k == n - 1)
            boot.append(b if k == n - 1 else float("nan"))  # NaN elsewhere: must not be read
    perm = torch.randperm(len(ep_ids), generator=g)
    t = lambda xs, **kw: torch.tensor(xs, **kw)[perm]  # noqa: E731
    adv, ret = turn_level_gae(t(rewards), t(values), t(ep_ids), t(turn_ids), t(dones),
                              gamma_turn=0.97, lam_turn=0.9, bootstrap_values=t(boot))
    for i, j in enumerate(perm.tolist()):
        r, v, last = episodes[ep_ids[j]]
        k = turn_ids[j] - min(tid for tid, e in zip(turn_ids, ep_ids) if e == ep_ids[j])
        expected = _naive_gae(r, v, 0.97, 0.9, last)[k]
        assert adv[i].item() == pytest.approx(expected, abs=1e-5)
        assert ret[i].item() == pytest.approx(expected + v[k], abs=1e-5)


def test_turn_level_gae_input_errors():
    r = torch.zeros(3)
    with pytest.raises(ValueError, match="consecutive"):
        turn_level_gae(r, r, torch.tensor([1, 1, 1]), torch.tensor([0, 1, 3]),
                       torch.tensor([False, False, True]))
    with pytest.raises(ValueError, match="consecutive"):
        turn_level_gae(r, r, torch.tensor([1, 1, 1]), torch.tensor([0, 1, 1]),
                       torch.tensor([False, False, True]))
    with pytest.raises(ValueError, match="before their last turn"):
        turn_level_gae(r, r, torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2]),
                       torch.tensor([False, True, True]))
    with pytest.raises(ValueError, match="bootstrap_values"):
        turn_level_gae(r, r, torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]),
                       torch.tensor([False, True, False]))


def test_bi_level_token_gae_hand_values():
    # one turn, two loss tokens after a prompt token; turn return G = 1.5
    values = torch.tensor([[7.0, 0.5, 0.25]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    adv, ret = bi_level_token_gae(torch.tensor([1.5]), values, mask, gamma_token=0.9,
                                  lam_token=0.5)
    # last token: A = 1.5 - 0.25 = 1.25;  first: 0.9 * 0.25 - 0.5 + 0.45 * 1.25 = 0.2875
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.2875, 1.25]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.7875, 1.5]]))
    # gamma = lam = 1: every token gets G - its value
    adv, _ = bi_level_token_gae(torch.tensor([1.5]), values, mask)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 1.0, 1.25]]))


def _verlog_dual_discount(turns, gamma_step, lam_step, gamma_tok, lam_tok, last_value):
    """Verlog's dual-discount GAE written out over the episode's concatenated response tokens:
    turns = [(token_values, reward)], the reward on each turn's last token; gamma*lam is the step
    pair across a turn boundary and the token pair inside a turn."""
    flat = [(v, (r if i == len(vs) - 1 else 0.0), i == len(vs) - 1)
            for vs, r in turns for i, v in enumerate(vs)]
    adv, running = [0.0] * len(flat), 0.0
    for t in reversed(range(len(flat))):
        v, r, turn_end = flat[t]
        g, lam = (gamma_step, lam_step) if turn_end else (gamma_tok, lam_tok)
        next_v = flat[t + 1][0] if t + 1 < len(flat) else last_value
        running = r + g * next_v - v + g * lam * running
        adv[t] = running
    return adv


@pytest.mark.parametrize("done", [True, False])
def test_turn_then_bi_level_equals_verlog_dual_discount_gae(done):
    g = torch.Generator().manual_seed(5)
    lengths = [3, 1, 4, 2]
    width = 6
    turns = [(torch.randn(n, generator=g).tolist(), float(torch.randn(1, generator=g)))
             for n in lengths]
    last_value = 0.0 if done else 0.7
    expected = _verlog_dual_discount(turns, 0.99, 0.95, 1.0, 1.0, last_value)

    mask = torch.zeros(len(lengths), width)
    token_values = torch.full((len(lengths), width), float("nan"))  # prompt/pad never read
    for k, (vs, _) in enumerate(turns):
        mask[k, 1:1 + len(vs)] = 1  # one prompt token, then the response
        token_values[k, 1:1 + len(vs)] = torch.tensor(vs)
    turn_values = torch.tensor([vs[0] for vs, _ in turns])  # value at each turn's prompt end
    dones = torch.tensor([False] * (len(lengths) - 1) + [done])
    n = len(lengths)
    t_adv, t_ret = turn_level_gae(torch.tensor([r for _, r in turns]), turn_values,
                                  torch.zeros(n, dtype=torch.long), torch.arange(n), dones,
                                  gamma_turn=0.99, lam_turn=0.95,
                                  bootstrap_values=torch.full((n,), last_value))
    adv, _ = bi_level_token_gae(t_ret, token_values, mask)
    got = adv[mask.bool()].tolist()  # row-major = the episode's token order
    assert got == pytest.approx(expected, abs=1e-5)
    # the first token of each turn carries exactly the turn-level advantage
    torch.testing.assert_close(adv[:, 1], t_adv)


def test_kl_in_the_reward_is_each_turns_summed_token_kl():
    """Turn 0's response tokens (columns 2-3) have KL 0.5 and 0.25, its prompt's 9 (masked
    out): 0.75; turn 1 one token of 2. With coef 0.1: 1 - 0.075 and 0 - 0.2."""
    token_kl = torch.tensor([[9.0, 9.0, 0.5, 0.25], [9.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0]])
    rewards, turn_kl = kl_penalized_rewards(torch.tensor([1.0, 0.0]), token_kl, mask, 0.1)
    assert turn_kl.tolist() == [0.75, 2.0]
    assert rewards.tolist() == pytest.approx([0.925, -0.2])
    with pytest.raises(ValueError, match="rewards"):
        kl_penalized_rewards(torch.zeros(3), token_kl, mask, 0.1)
