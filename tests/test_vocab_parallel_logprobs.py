"""The vocab-parallel log-prob/entropy function and its hand-written backward, against plain
float64 autograd through ``log_softmax`` (the independent reference), at TP 1 and TP 2 (rank 1
holds the padded vocab columns), at temperature 1 and 0.7, with and without the entropy, in one
block of rows and in blocks of two, on fp32 and bf16 logits; without grad it gives bit for bit
what it gives with grad, and it never writes to the logits."""
from __future__ import annotations

import pytest
import torch

from ragen_mega.backends.megatron.launch import run_workers

VOCAB, PADDED, B, S = 37, 40, 3, 5
CASES = [(t, e, block, dtype) for t in (1.0, 0.7) for e in (True, False) for block in (None, 2)
         for dtype in (torch.float32, torch.bfloat16)]


def _inputs():
    """Logits over the padded vocab (scaled so the softmax is far from uniform), targets, and the
    weights of the log-probs and the entropy in the loss."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, S, PADDED, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, VOCAB, (B, S), generator=g)
    w_lp, w_ent = (torch.randn(B, S, generator=g, dtype=torch.float64) for _ in range(2))
    return logits.float().double(), targets, w_lp, w_ent


def _rank_slice(rank, world):
    width = PADDED // world
    return slice(rank * width, (rank + 1) * width)


def _worker(rank, world):
    from ragen_mega.backends.megatron.forward import vocab_parallel_logprobs_entropy

    logits, targets, w_lp, w_ent = _inputs()
    out = {}
    for case in CASES:
        temperature, entropy, block, dtype = case
        local = logits[..., _rank_slice(rank, world)].to(dtype).requires_grad_(True)
        before = local.detach().clone()
        kwargs = dict(vocab_size=VOCAB, temperature=temperature, compute_entropy=entropy,
                      block_rows=block)
        lp, ent = vocab_parallel_logprobs_entropy(local, targets, **kwargs)
        loss = (lp.double() * w_lp).sum() + ((ent.double() * w_ent).sum() if entropy else 0)
        loss.backward()
        with torch.no_grad():
            lp_inf, ent_inf = vocab_parallel_logprobs_entropy(local, targets, **kwargs)
        out[case] = dict(
            lp=lp.detach(), ent=None if ent is None else ent.detach(), grad=local.grad,
            same_without_grad=torch.equal(lp_inf, lp) and (
                ent is None or torch.equal(ent_inf, ent)),
            logits_untouched=torch.equal(local.detach(), before))
    return out


def _reference(temperature, entropy, dtype):
    logits, targets, w_lp, w_ent = _inputs()
    x = logits.to(dtype).double().requires_grad_(True)
    logp = torch.log_softmax(x[..., :VOCAB] / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * w_lp).sum() + ((ent * w_ent).sum() if entropy else 0)).backward()
    return lp, ent, x.grad


@pytest.mark.parametrize("world", [1, 2])
def test_logprobs_entropy_and_gradients_match_float64_autograd(world):
    results = run_workers(_worker, world, tp=world)
    for case in CASES:
        temperature, entropy, _, dtype = case
        lp_ref, ent_ref, grad_ref = _reference(temperature, entropy, dtype)
        grad = torch.cat([r[case]["grad"] for r in results], dim=-1)
        assert grad.dtype == dtype, case
        grad = grad.double()
        # fp32 rounding of logits up to ~10 (the reference is float64 of the same inputs); a
        # bf16 gradient is the fp32 one rounded to 8 significant bits
        bound = 1e-5 + (2 ** -8 * grad_ref.abs() if dtype == torch.bfloat16 else 0)
        assert ((grad - grad_ref).abs() <= bound).all(), case
        assert grad[..., VOCAB:].abs().max() == 0, case  # padded columns take no gradient
        for rank, r in enumerate(results):
            assert (r[case]["lp"].double() - lp_ref).abs().max() < 1e-5, (case, rank)
            if entropy:
                assert (r[case]["ent"].double() - ent_ref).abs().max() < 1e-5, (case, rank)
            else:
                assert r[case]["ent"] is None
            assert r[case]["same_without_grad"], (case, rank)
            assert r[case]["logits_untouched"], (case, rank)
