"""PPO mini-batches and epochs (``ppo_mini_batch_size`` in episodes, ``ppo_epochs``) against a
transformers + torch.optim.AdamW reference that makes the same sequence of updates.

One 2-process launch: the default (whole batch, one epoch) at DP=2 must be today's single step;
two mini-batches of one episode each (two turn samples apiece) at DP=2 and at TP=2 (DP=1, two
micro-batches per mini-batch), two epochs at TP=2, and token-budget micro-batches (DP ranks
with different micro-batch counts; rows reordered by length) must each equal the reference's
sequence of AdamW updates, every update's loss normalised over its own mini-batch; and with old
log-probs equal to the current policy's, a single update never clips while the second of two
does.
"""
from __future__ import annotations

import pytest
import torch

from ragen_mega.algo.losses import policy_loss
from ragen_mega.backends.megatron.launch import run_workers
from conftest import CLIP, EPS, LR, WD, _actor_batch, _hf_logprobs_entropy

BASE = dict(micro_batch_size=1, lr=LR, weight_decay=WD, adam_eps=EPS, grad_clip=CLIP)
# name -> (tp, extra config, old log-probs: "noisy" (clips from the start) or "exact")
RUNS = {"dp2_whole": (1, {}, "noisy"),
        "dp2_two": (1, {"ppo_mini_batch_size": 1}, "noisy"),
        "tp2_two": (2, {"ppo_mini_batch_size": 1}, "noisy"),
        "tp2_two_epochs2": (2, {"ppo_mini_batch_size": 1, "ppo_epochs": 2}, "noisy"),
        # token-budget micro-batches (row lengths 14, 9 | 12, 6): DP rank 0 gets [14] [9],
        # rank 1 [12, 6] in one; at TP=2 the sorted rows go [14] [12, 9] [6]
        "dp2_budget": (1, {"max_tokens_per_micro_batch": 24}, "noisy"),
        "tp2_two_budget": (2, {"ppo_mini_batch_size": 1, "max_tokens_per_micro_batch": 24},
                           "noisy"),
        "exact_whole": (2, {"lr": 0.05}, "exact"),
        "exact_two": (2, {"lr": 0.05, "ppo_mini_batch_size": 1}, "exact")}
EPISODES = torch.tensor([7, 7, 3, 3])     # rows 0-1: one episode's two turns, rows 2-3 another


def _ppo_worker(rank, world_size, hf_dir, batches):
    import gc

    from ragen_mega.backends.megatron.parallel import file_init_method, init_parallel
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig

    out = {}
    for name, (tp, extra, old) in RUNS.items():
        init_parallel(rank, world_size, file_init_method("/nonexistent"), tp=tp)
        trainer = MegatronTrainer(ActorConfig(**{**BASE, "tp": tp, **extra}), hf_dir,
                                  total_steps=10)
        metrics = trainer.train(batches[old])
        weights = dict(trainer.export_hf_state())
        out[name] = {"metrics": metrics, "steps": trainer.steps,
                     "weights": weights if rank == 0 else None}
        del trainer
        gc.collect()
    return out


def _reference(model_dir, batch, row_groups, epochs=1):
    """AdamW updates with transformers, one per mini-batch of rows, loss token-mean over it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if p.dim() == 1 or n.endswith(".bias")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, eps=EPS)
    losses = []
    for _ in range(epochs):
        for rows in row_groups:
            mb = {k: v[rows] for k, v in batch.items()}
            lp, _ = _hf_logprobs_entropy(model, mb)
            mask = mb["loss_mask"][:, 1:] * mb["attention_mask"][:, 1:]
            loss, _ = policy_loss(lp, mb["old_logprobs"][:, 1:], mb["advantages"][:, 1:], mask,
                                  0.2, 0.28, 3.0)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            losses.append(loss.item())
    return {n: p.detach().clone() for n, p in model.state_dict().items()}, losses


@pytest.fixture(scope="module")
def setup(tiny_model):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = tiny_model("qwen2", tied=True, num_layers=4)
    batch = _actor_batch(AutoConfig.from_pretrained(model_dir).vocab_size)
    with torch.no_grad():
        lp, _ = _hf_logprobs_entropy(AutoModelForCausalLM.from_pretrained(model_dir), batch)
    lp = torch.cat([torch.zeros(4, 1), lp], dim=1)      # column t: log p(token t | < t)
    batches = {old: {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                     "loss_mask": batch["loss_mask"], "advantages": batch["advantages"],
                     "episode_id": EPISODES,
                     "old_logprobs": lp + (batch["noise"] if old == "noisy" else 0)}
               for old in ("noisy", "exact")}
    return model_dir, batches, run_workers(_ppo_worker, 2, model_dir, batches, timeout=900)


@pytest.mark.parametrize("name, row_groups, epochs", [
    ("dp2_whole", [[0, 1, 2, 3]], 1),
    ("dp2_two", [[0, 1], [2, 3]], 1),
    ("tp2_two", [[0, 1], [2, 3]], 1),
    ("tp2_two_epochs2", [[0, 1], [2, 3]], 2),
    ("dp2_budget", [[0, 1, 2, 3]], 1),
    ("tp2_two_budget", [[0, 1], [2, 3]], 1)])
def test_updates_match_adamw_reference(setup, name, row_groups, epochs):
    model_dir, batches, results = setup
    ref_weights, ref_losses = _reference(model_dir, batches["noisy"], row_groups, epochs)
    for r in range(2):
        m = results[r][name]["metrics"]
        assert m["ppo_updates"] == len(row_groups) * epochs
        assert m["update_successful"] == 1.0 and m["lr"] == pytest.approx(LR)
        assert m["loss"] == pytest.approx(sum(ref_losses) / len(ref_losses), rel=1e-5, abs=1e-6)
        assert results[r][name]["steps"] == 1          # one training step, however many updates
    for hf_name, tensor in results[0][name]["weights"].items():
        torch.testing.assert_close(tensor, ref_weights[hf_name], atol=1e-5, rtol=0,
                                   msg=lambda msg: f"{name} {hf_name}: {msg}")


def test_token_budget_padding_fraction(setup):
    _, _, results = setup
    for r in range(2):
        assert results[r]["dp2_whole"]["metrics"]["padding_frac"] == 0.0   # one row each
        # 41 real tokens; fed 14 + 9 + 2 x 12 (rank 1's rows 12 and 6 share a micro-batch)
        assert results[r]["dp2_budget"]["metrics"]["padding_frac"] == pytest.approx(6 / 47)


def test_second_minibatch_is_off_policy_and_clips(setup):
    _, _, results = setup
    for r in range(2):
        one, two = results[r]["exact_whole"]["metrics"], results[r]["exact_two"]["metrics"]
        assert one["pg_clipfrac"] == 0.0 and one["ppo_updates"] == 1.0   # ratio 1: no clip
        # the mean over the two updates; the first one is the same on-policy update as above
        assert two["pg_clipfrac"] > 0 and two["ppo_updates"] == 2.0


def test_minibatches_keep_episodes_together():
    from ragen_mega.backends.megatron.train import ppo_minibatches

    batch = {"episode_id": torch.tensor([5, 5, 2, 9, 9, 9, 4]), "x": torch.arange(7)}
    cut = ppo_minibatches(batch, 2)
    assert [mb["x"].tolist() for mb in cut] == [[0, 1, 2], [3, 4, 5, 6]]
    assert ppo_minibatches(batch, None) == [batch]
    assert [mb["x"].tolist() for mb in ppo_minibatches(batch, 3)] == [[0, 1, 2, 3, 4, 5], [6]]
    with pytest.raises(KeyError, match="episode_id"):
        ppo_minibatches({"x": torch.arange(3)}, 2)


def test_token_budget_groups_pack_sorted_rows():
    from ragen_mega.backends.megatron.forward import split_microbatches, token_budget_groups

    lengths = torch.tensor([14, 9, 12, 6, 30])
    groups = token_budget_groups(lengths, 24)
    assert [g.tolist() for g in groups] == [[4], [0], [2, 1], [3]]   # 30 > 24: alone
    ids = torch.arange(5 * 30).reshape(5, 30)
    mask = (torch.arange(30)[None] < lengths[:, None]).long()
    mbs = split_microbatches(ids, mask, max_tokens=24, advantages=torch.ones(5, 29))
    assert [tuple(mb["input_ids"].shape) for mb in mbs] == [(1, 30), (1, 14), (2, 12), (1, 6)]
    assert [tuple(mb["advantages"].shape) for mb in mbs] == [(1, 29), (1, 13), (2, 11), (1, 5)]
    assert torch.equal(mbs[2]["input_ids"], ids[[2, 1], :12])
