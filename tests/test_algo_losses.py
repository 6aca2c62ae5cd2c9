"""PPO policy/value losses, KL estimators and loss aggregation against hand-worked values."""
from __future__ import annotations

import math

import pytest
import torch

from ragen_mega.algo.losses import (AGG_MODES, aggregate, episode_loss_tokens,
                                    episode_weighted_mask, highlight_first_tokens, kl_penalty,
                                    loss_normalizer, policy_loss, truncated_is_weights,
                                    value_loss)


def _one_token(ratio: float, adv: float):
    """logprobs/old_logprobs/advantages/mask for a single token with importance ratio ``ratio``."""
    t = lambda v: torch.tensor([[v]], dtype=torch.float32)  # noqa: E731
    return t(math.log(ratio)), t(0.0), t(adv), t(1.0)


# (ratio, advantage, expected per-token loss with clip 0.2/0.28 and dual-clip 3), worked by hand
PPO_CASES = [
    (1.10, +1.0, -1.10),  # inside the clip range: -A * r
    (1.50, +1.0, -1.28),  # A > 0 above 1 + 0.28: upper clip, -A * 1.28
    (0.50, +1.0, -0.50),  # A > 0 below 1 - 0.2: PPO does not clip the side that lowers the loss
    (0.50, -1.0, +0.80),  # A < 0 below 1 - 0.2: lower clip, -A * 0.8
    (1.20, -1.0, +1.20),  # A < 0 inside
    (2.00, -1.0, +2.00),  # A < 0 above the upper bound: max picks -A * r (=2 < 3, no dual clip)
    (5.00, -1.0, +3.00),  # A < 0, -A * r = 5 > -A * 3: dual-clip caps at 3
    (1.25, +2.0, -2.50),  # asymmetric: 1.25 is inside [0.8, 1.28] (it would clip at 1.2)
    (0.79, -2.0, +1.60),  # lower clip at 0.8: max(1.58, 1.6)
]


@pytest.mark.parametrize("ratio,adv,expected", PPO_CASES)
def test_policy_loss_single_token_hand_values(ratio, adv, expected):
    loss, _ = policy_loss(*_one_token(ratio, adv))
    assert loss.item() == pytest.approx(expected, abs=1e-5)


def test_policy_loss_clip_fractions_and_kl_metrics():
    ratios = torch.tensor([[c[0] for c in PPO_CASES]])
    advs = torch.tensor([[c[1] for c in PPO_CASES]])
    logp = ratios.log()
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp)
    loss, m = policy_loss(logp, old, advs, mask)
    n = len(PPO_CASES)
    assert loss.item() == pytest.approx(sum(c[2] for c in PPO_CASES) / n, abs=1e-5)
    assert m["clip_frac_upper"].item() == pytest.approx(1 / n)  # (1.50, +1)
    assert m["clip_frac_lower"].item() == pytest.approx(2 / n)  # (0.50, -1), (0.79, -2)
    assert m["clip_frac"].item() == pytest.approx(3 / n)
    assert m["dual_clip_frac"].item() == pytest.approx(1 / n)  # (5.00, -1)
    # approx_kl is the mean of old - new = -log r
    assert m["approx_kl"].item() == pytest.approx(-sum(math.log(c[0]) for c in PPO_CASES) / n,
                                                  abs=1e-6)
    assert not any(v.requires_grad for v in m.values())


def test_policy_loss_dual_clip_off_and_symmetric_clip():
    loss, m = policy_loss(*_one_token(5.0, -1.0), clip_ratio_c=None)
    assert loss.item() == pytest.approx(5.0, abs=1e-5)
    assert m["dual_clip_frac"].item() == 0.0
    loss, _ = policy_loss(*_one_token(1.25, 2.0), clip_ratio_high=0.2)
    assert loss.item() == pytest.approx(-2.4, abs=1e-5)


def test_policy_loss_gradient_is_zero_exactly_where_clipping_is_active():
    ratios = torch.tensor([[c[0] for c in PPO_CASES]])
    advs = torch.tensor([[c[1] for c in PPO_CASES]])
    logp = ratios.log().requires_grad_(True)
    loss, _ = policy_loss(logp, torch.zeros_like(logp), advs, torch.ones_like(advs),
                          agg="seq-mean-token-sum")  # one row: plain sum over tokens
    loss.backward()
    clipped = {1, 3, 6, 8}  # upper clip, lower clip, dual clip, lower clip (see PPO_CASES)
    for i, (r, a, _) in enumerate(PPO_CASES):
        g = logp.grad[0, i].item()
        if i in clipped:
            assert g == 0.0, f"case {i} is clipped but has gradient {g}"
        else:  # d(-A * exp(logp)) / dlogp = -A * r
            assert g == pytest.approx(-a * r, abs=1e-5), f"case {i}"


def test_truncated_is_weights_hand_values_and_their_place_in_the_loss():
    """min(exp(old - behaviour), cap) per token, then each token's clipped PPO loss times it."""
    old = torch.tensor([[0.0, 0.0, math.log(3.0), -1.0]])
    behaviour = torch.tensor([[0.0, math.log(2.0), 0.0, -1.5]])
    weights = truncated_is_weights(old, behaviour, cap=2.0)
    # exp(0) = 1; exp(-log 2) = 0.5; exp(log 3) = 3 -> capped at 2; exp(0.5)
    assert weights.tolist()[0] == pytest.approx([1.0, 0.5, 2.0, math.exp(0.5)], abs=1e-6)
    assert not weights.requires_grad
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(old, behaviour, cap=0.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        truncated_is_weights(old, behaviour[:, :3], cap=2.0)

    ratios = torch.tensor([[1.10, 1.50, 0.50, 5.00]])  # PPO_CASES' clipped losses, weighted
    advs = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    logp = ratios.log().requires_grad_(True)
    loss, m = policy_loss(logp, torch.zeros_like(logp), advs, torch.ones_like(advs),
                          is_weights=weights)
    per_token = [-1.10 * 1.0, -1.28 * 0.5, 0.80 * 2.0, 3.00 * math.exp(0.5)]
    assert loss.item() == pytest.approx(sum(per_token) / 4, abs=1e-5)
    loss.backward()  # the weights scale the gradient of the unclipped token only (1.10, +1)
    assert logp.grad.tolist()[0] == pytest.approx([-1.10 * 1.0 / 4, 0.0, 0.0, 0.0], abs=1e-6)
    # metrics describe the ratio, not the weights
    assert m["clip_frac"].item() == pytest.approx(2 / 4)
    with pytest.raises(ValueError, match="shape mismatch"):
        policy_loss(logp, logp.detach(), advs, torch.ones_like(advs), is_weights=weights[:, :2])


def test_policy_loss_ignores_masked_tokens_and_rejects_bad_input():
    logp = torch.tensor([[0.1, 50.0]])  # the masked token has an absurd ratio
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, -1.0]])
    loss, m = policy_loss(logp, old, adv, torch.tensor([[1.0, 0.0]]))
    assert loss.item() == pytest.approx(-math.exp(0.1), abs=1e-5)
    assert m["dual_clip_frac"].item() == 0.0
    with pytest.raises(ValueError, match="shape"):
        policy_loss(logp, old, adv, torch.ones(1, 3))
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logp, old, adv, torch.ones_like(adv), clip_ratio_c=1.0)


# ragged mask with an empty row; values at masked positions must never leak in
LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0],
                     [4.0, 100.0, 100.0, 100.0],
                     [100.0, 8.0, 9.0, 100.0],
                     [100.0, 100.0, 100.0, 100.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0],
                     [1.0, 0.0, 0.0, 0.0],
                     [0.0, 1.0, 1.0, 0.0],
                     [0.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", (1 + 2 + 3 + 4 + 8 + 9) / 6),
    ("seq-mean-token-mean", (2.0 + 4.0 + 8.5) / 3),     # empty row is not a sequence
    ("seq-mean-token-sum", (6 + 4 + 17) / 3),
    ("seq-mean-token-sum-norm", (6 / 4 + 4 / 4 + 17 / 4) / 3),  # horizon = seq = 4
])
def test_aggregate_modes_on_ragged_mask(mode, expected):
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_aggregate_horizon_normalizer_and_errors():
    assert aggregate(LOSS, MASK, "seq-mean-token-sum-norm", horizon=10).item() == \
        pytest.approx((6 + 4 + 17) / 10 / 3)
    assert aggregate(LOSS, MASK, "token-mean", normalizer=12).item() == pytest.approx(27 / 12)
    empty = torch.zeros_like(MASK)
    for mode in AGG_MODES:  # an all-masked micro-batch gives 0, not NaN
        assert aggregate(LOSS, empty, mode).item() == 0.0
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):  # lists allowed modes
        aggregate(LOSS, MASK, "sum")
    with pytest.raises(ValueError, match="normalizer"):
        aggregate(LOSS, MASK, "token-mean", normalizer=-1)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_accumulation_with_global_normalizer_equals_full_batch(mode):
    g = torch.Generator().manual_seed(0)
    n, seq = 8, 12
    lengths = torch.tensor([1, 12, 3, 7, 0, 5, 9, 2])  # ragged, one empty row
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).float()
    logp_full = (torch.randn(n, seq, generator=g) * 0.3).requires_grad_(True)
    old = torch.randn(n, seq, generator=g) * 0.3
    adv = torch.randn(n, seq, generator=g)

    full, _ = policy_loss(logp_full, old, adv, mask, agg=mode)
    full.backward()

    splits = [(0, 3), (3, 5), (5, 8)]
    total = sum(loss_normalizer(mask[a:b], mode) for a, b in splits)  # what an all-reduce gives
    logp_mb = logp_full.detach().clone().requires_grad_(True)
    acc = 0.0
    naive = 0.0
    for a, b in splits:
        mb, _ = policy_loss(logp_mb[a:b], old[a:b], adv[a:b], mask[a:b], agg=mode,
                            normalizer=total)
        mb.backward()
        acc += mb.item()
        naive += policy_loss(logp_mb[a:b].detach(), old[a:b], adv[a:b], mask[a:b],
                             agg=mode)[0].item() / len(splits)
    assert acc == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(logp_mb.grad, logp_full.grad)
    # the naive mean of per-micro-batch means is a different number: the normalizer matters
    assert abs(naive - full.item()) > 1e-3


def test_episode_mean_weighs_each_episode_alike_in_any_layout():
    """Rows 0 and 2 are one episode's two turns, row 1 another episode, row 3 empty (an episode
    with no loss token). By hand: episode A's token mean (1+2+3+8+9)/5 = 4.6, B's 4.0; the mode
    gives their mean 4.3, where a token-mean gives (1+2+3+4+8+9)/6 = 4.5. The same episode packed
    into one row, or cut into micro-batches with the global normalizer, gives the same value."""
    episode = torch.tensor([7, 3, 7, 5])
    tokens = episode_loss_tokens(MASK, episode)
    assert tokens.tolist() == [5.0, 1.0, 5.0, 0.0]
    weighted = episode_weighted_mask(MASK, tokens)
    mode = "episode-mean-token-mean"
    assert aggregate(LOSS, weighted, mode).item() == pytest.approx((4.6 + 4.0) / 2)
    assert aggregate(LOSS, MASK, "token-mean").item() == pytest.approx(4.5)
    total = sum(loss_normalizer(weighted[a:b], mode) for a, b in [(0, 1), (1, 4)])
    assert total.item() == pytest.approx(2.0)  # the summed weights count the episodes
    split = sum(aggregate(LOSS[a:b], weighted[a:b], mode, normalizer=total)
                for a, b in [(0, 1), (1, 4)])
    assert split.item() == pytest.approx(4.3)
    packed_loss = torch.tensor([[1.0, 2.0, 3.0, 8.0, 9.0], [4.0, 0.0, 0.0, 0.0, 0.0]])
    packed_mask = torch.tensor([[1.0] * 5, [1.0, 0, 0, 0, 0]])
    packed = episode_weighted_mask(packed_mask, episode_loss_tokens(packed_mask,
                                                                    torch.tensor([7, 3])))
    assert aggregate(packed_loss, packed, mode).item() == pytest.approx(4.3)


KL_CASES = [  # logprob, ref_logprob, {kind: hand value}
    (-1.0, -1.2, {"k1": 0.2, "abs": 0.2, "k2": 0.02, "k3": math.exp(-0.2) + 0.2 - 1}),
    (-1.2, -1.0, {"k1": -0.2, "abs": 0.2, "k2": 0.02, "k3": math.exp(0.2) - 0.2 - 1}),
    (-0.5, -0.5, {"k1": 0.0, "abs": 0.0, "k2": 0.0, "k3": 0.0}),
]
ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


@pytest.mark.parametrize("logp,ref,expected", KL_CASES)
def test_kl_penalty_hand_values(logp, ref, expected):
    lp, rf = torch.tensor([[logp]]), torch.tensor([[ref]])
    for kind, value in expected.items():
        assert kl_penalty(lp, rf, kind).item() == pytest.approx(value, abs=1e-6), kind
        if kind in ALIASES:
            assert kl_penalty(lp, rf, ALIASES[kind]).item() == pytest.approx(value, abs=1e-6)


def test_kl_low_var_is_clamped_and_unknown_kind_rejected():
    # d = ref - logp = 30: exp(20) - 20 - 1 after the inner clamp, then capped at 10
    assert kl_penalty(torch.tensor([[-30.0]]), torch.tensor([[0.0]]), "k3").item() == 10.0
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_value_loss_hand_values_and_clip_gradient():
    values = torch.tensor([[1.0, 2.0, 0.0, 2.0]], requires_grad=True)
    old = torch.tensor([[0.8, 1.0, 0.0, 1.0]])
    returns = torch.tensor([[0.0, 3.0, 1.0, 1.2]])
    mask = torch.ones_like(old)
    # per token max(unclipped, clipped) squared errors, clip range 0.5:
    #  0: v_clip = 0.8 + 0.2 = 1.0 -> 1.0, 1.0        -> 1.0
    #  1: v_clip = 1.0 + 0.5 = 1.5 -> 1.0, 2.25       -> 2.25 (clipped term wins)
    #  2: v_clip = 0.0            -> 1.0, 1.0         -> 1.0
    #  3: v_clip = 1.5            -> 0.64, 0.09       -> 0.64
    loss, m = value_loss(values, old, returns, mask, clip_range_value=0.5)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 2.25 + 1.0 + 0.64) / 4)
    assert m["vf_clip_frac"].item() == pytest.approx(1 / 4)
    loss.backward()
    # token 1: the clipped term is constant in values -> no gradient; others: 0.5*2*(v-R)/4
    expected = [0.25 * (1.0 - 0.0), 0.0, 0.25 * (0.0 - 1.0), 0.25 * (2.0 - 1.2)]
    torch.testing.assert_close(values.grad, torch.tensor([expected]))

    plain, m = value_loss(values.detach(), old, returns, mask, clip_range_value=None)
    assert plain.item() == pytest.approx(0.5 * (1.0 + 1.0 + 1.0 + 0.64) / 4)
    assert m["vf_clip_frac"].item() == 0.0


def test_highlight_first_weights_each_response_start_hand_values():
    """Row 0: one response (tokens 2-4); row 1: a whole-chat row with two responses (tokens 1-2
    and 4). Weight 3 on each response's first token, 1 on the rest of the loss tokens."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 1]], dtype=torch.float32)
    assert highlight_first_tokens(mask, 3.0).tolist() == [[0, 0, 3, 1, 1], [0, 3, 1, 0, 3]]
    assert highlight_first_tokens(mask, 1.0) is mask
    with pytest.raises(ValueError, match="must be >= 1"):
        highlight_first_tokens(mask, 0.5)

    returns = torch.tensor([[0.0, 0.0, 1.0, 2.0, 0.0], [0.0, 3.0, 1.0, 5.0, 2.0]])
    values = torch.zeros_like(returns)  # squared errors on loss tokens: 1 4 0 | 9 1 . 4
    # token-mean, weighted: 0.5 * (3*1 + 4 + 0 + 3*9 + 1 + 3*4) / (3+1+1 + 3+1+3) = 0.5 * 47 / 12
    weighted = highlight_first_tokens(mask, 3.0)
    loss, _ = value_loss(values, values, returns, weighted, None)
    assert loss.item() == pytest.approx(0.5 * 47 / 12)
    # today's loss with weight 1: 0.5 * (1 + 4 + 0 + 9 + 1 + 4) / 6
    plain, _ = value_loss(values, values, returns, highlight_first_tokens(mask, 1.0), None)
    assert plain.item() == pytest.approx(0.5 * 19 / 6)
    # seq-mean-token-mean: rows 0.5*(3+4+0)/5 = 0.7 and 0.5*(27+1+12)/7 = 20/7, mean of the two
    seq, _ = value_loss(values, values, returns, weighted, None, agg="seq-mean-token-mean")
    assert seq.item() == pytest.approx((0.7 + 20 / 7) / 2)
    # split into one-row micro-batches, the global weighted normaliser gives the same loss
    total = sum(loss_normalizer(weighted[i:i + 1], "token-mean") for i in range(2))
    assert total.item() == 12
    parts = [value_loss(values[i:i + 1], values[i:i + 1], returns[i:i + 1], weighted[i:i + 1],
                        None, normalizer=total)[0] for i in range(2)]
    assert sum(parts).item() == pytest.approx(0.5 * 47 / 12)
