"""The Megatron trainer's actor, critic and SFT steps against an independent transformers +
torch.optim reference, and across TP x PP x DP layouts.

One 2-process launch visits every layout (DP2, TP2, PP2, PP2 with interleaving) and a critic;
the parent computes the reference with transformers, the algo loss functions and
torch.optim.AdamW on the full batch, without micro-batches.
"""
from __future__ import annotations

import math

import pytest
import torch

from ragen_mega.algo.losses import value_loss
from ragen_mega.backends.megatron.launch import run_workers

# layout name -> (tp, pp, vpp, extra config); world size 2, so tp=pp=1 means DP=2
LAYOUTS = {
    "dp2": (1, 1, None, {}),
    "tp2": (2, 1, None, {}),
    "pp2": (1, 2, None, {}),
    "pp2_vpp2": (1, 2, 2, {}),
    "dp2_seqmean": (1, 1, None, {"loss_agg_mode": "seq-mean-token-mean"}),
    "dp2_epmean": (1, 1, None, {"loss_agg_mode": "episode-mean-token-mean"}),
}
#: rows 0 and 3 are one episode's turns, on different DP ranks under DP 2 (rows 0-1 and 2-3)
EPISODE_ID = torch.tensor([0, 1, 2, 0])


def with_episodes(batch: dict) -> dict:
    """``batch`` with its rows' episodes, and their loss tokens as the driver counts them."""
    from ragen_mega.algo.losses import episode_loss_tokens

    return {**batch, "episode_id": EPISODE_ID,
            "episode_loss_tokens": episode_loss_tokens(batch["loss_mask"], EPISODE_ID)}


#: the SFT step: Adam with weight decay and an active clip, as the actor step's
SFT_SETTINGS = dict(micro_batch_size=1, lr=1e-3, weight_decay=0.1, adam_eps=1e-6, grad_clip=0.05)


def _train_worker(rank, world_size, hf_dir, batch, actor_settings):
    import gc

    from ragen_mega.backends.megatron.parallel import file_init_method, init_parallel
    from ragen_mega.algo.objectives import SFTObjective
    from ragen_mega.backends.megatron.train import MegatronTrainer, dp_shard
    from ragen_mega.config import ActorConfig, CriticConfig

    out = {}
    for name, (tp, pp, vpp, extra) in LAYOUTS.items():
        batch = with_episodes(batch) if "epmean" in name else batch
        init_parallel(rank, world_size, file_init_method("/nonexistent"), tp=tp, pp=pp, vpp=vpp)
        trainer = MegatronTrainer(ActorConfig(tp=tp, pp=pp, vpp=vpp, **actor_settings, **extra),
                                  hf_dir, total_steps=10)
        logprobs = trainer.compute_logprobs(dp_shard(batch))  # this DP rank's rows
        # old policy = current policy + noise, so clipped and dual-clipped tokens both occur;
        # the training step takes the global batch and cuts this rank's rows itself
        old = trainer.compute_logprobs(batch) + batch["noise"]
        metrics = trainer.train({**batch, "old_logprobs": old})
        weights = dict(trainer.export_hf_state())
        out[name] = {"metrics": metrics, "logprobs": logprobs,
                     "weights": weights if rank == 0 else None}
        del trainer
        gc.collect()

    # three rows in micro-batches of 2 (a per-turn batch has as many rows as the step played
    # turns): over two DP ranks (padded with a row that carries no loss), and under TP 2 (a
    # last micro-batch of one row)
    rows3 = {k: v[:3] for k, v in batch.items()}
    for name, tp in (("dp2_3rows", 1), ("tp2_3rows", 2)):
        init_parallel(rank, world_size, file_init_method("/nonexistent"), tp=tp, pp=1)
        trainer = MegatronTrainer(ActorConfig(tp=tp, **{**actor_settings, "micro_batch_size": 2}),
                                  hf_dir, total_steps=10)
        old = trainer.compute_logprobs(rows3) + rows3["noise"]
        metrics = trainer.train({**rows3, "old_logprobs": old})
        weights = dict(trainer.export_hf_state())  # a collective: every rank takes part
        out[name] = {"metrics": metrics, "weights": weights if rank == 0 else None}
        del trainer
        gc.collect()

    # bf16 mixed precision (bf16 weights and compute, fp32 main weights in Adam) at TP 2: the
    # GPU examples' `actor.bf16` path, run here on the CPU (the app refuses bf16 on a CPU, for
    # speed and learning reasons: preflight.check_bf16; the trainer itself runs it anywhere)
    init_parallel(rank, world_size, file_init_method("/nonexistent"), tp=2, pp=1)
    trainer = MegatronTrainer(ActorConfig(tp=2, bf16=True, **actor_settings), hf_dir,
                              total_steps=10)
    logprobs = trainer.compute_logprobs(batch)
    metrics = trainer.train({**batch, "old_logprobs": logprobs + batch["noise"]})
    out["bf16_tp2"] = {"metrics": metrics, "logprobs": logprobs,
                       "weights": dict(trainer.export_hf_state())}
    del trainer
    gc.collect()

    critic = MegatronTrainer(CriticConfig(tp=2, micro_batch_size=2, lr=1e-2, grad_clip=1.0,
                                          value_clip=None), hf_dir, role="critic")
    values0 = critic.compute_values(batch)
    losses = [critic.train({**batch, "old_values": values0})["vf_loss"]
              for _ in range(6)]
    out["critic"] = {"values0": values0, "losses": losses}
    del critic
    gc.collect()
    highlighted = MegatronTrainer(CriticConfig(tp=2, micro_batch_size=2, value_clip=None,
                                               highlight_first=3.0), hf_dir, role="critic")
    out["critic"]["highlighted_loss"] = highlighted.train(
        {**batch, "old_values": values0})["vf_loss"]
    del highlighted
    gc.collect()
    # ragen-mega sft's step: the same trainer given the SFT objective (TP2, micro-batches of 1)
    sft = MegatronTrainer(ActorConfig(tp=2, **SFT_SETTINGS), hf_dir, total_steps=10,
                          objective=SFTObjective())
    out["sft"] = {"metrics": sft.train(batch), "weights": dict(sft.export_hf_state())}
    return out


@pytest.fixture(scope="module")
def model_dir(actor_model_dir):
    return actor_model_dir


@pytest.fixture(scope="module")
def batch(actor_batch):
    return actor_batch


@pytest.fixture(scope="module")
def results(model_dir, batch, actor_step):
    return run_workers(_train_worker, 2, model_dir, batch, actor_step.settings, timeout=900)


@pytest.fixture(scope="module")
def references(model_dir, batch, actor_step):
    return {mode: actor_step.reference(model_dir, with_episodes(batch), mode)
            for mode in ("token-mean", "seq-mean-token-mean", "episode-mean-token-mean")}


def _mode(name):
    return LAYOUTS[name][3].get("loss_agg_mode", "token-mean")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_actor_step_matches_transformers_and_adamw(results, references, actor_step, name):
    ref = references[_mode(name)]
    # log-probs before the step: every DP rank's rows against transformers
    dp2 = LAYOUTS[name][:2] == (1, 1)  # each DP rank holds half of the rows
    lp = (torch.cat([results[r][name]["logprobs"] for r in range(2)]) if dp2
          else results[0][name]["logprobs"])
    valid = torch.cat([torch.zeros(4, 1), ref["mask"]], dim=1) > 0
    expected = torch.cat([torch.zeros(4, 1), ref["ref_lp"]], dim=1)
    torch.testing.assert_close(lp[valid], expected[valid], atol=2e-5, rtol=0)

    for r in range(2):  # every rank reports the same global metrics
        m = results[r][name]["metrics"]
        assert m["update_successful"] == 1.0
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
        assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert m["lr"] == pytest.approx(actor_step.lr)
    assert ref["grad_norm"] > actor_step.clip  # clipping was active
    m = results[0][name]["metrics"]
    # either ratio clip (verl's pg_clipfrac) and the dual clip (verl's pg_clipfrac_lower) occur
    assert 0 < m["pg_clipfrac"] < 1 and m["pg_clipfrac_lower"] > 0
    assert m["pg_clipfrac"] == pytest.approx(m["pg_clipfrac_ratio_high"] + m["pg_clipfrac_ratio_low"])

    weights = results[0][name]["weights"]
    assert set(weights) == set(ref["weights"]) - {"lm_head.weight"}  # tied: no lm_head exported
    for hf_name, tensor in weights.items():
        torch.testing.assert_close(tensor, ref["weights"][hf_name], atol=1e-5, rtol=0,
                                   msg=lambda msg: f"{name} {hf_name}: {msg}")


def test_bf16_step_on_cpu_tracks_the_fp32_reference(results, references, actor_step,
                                                    model_dir):
    """bf16 keeps ~3 significant digits: log-probs within bf16 rounding of the fp32 reference
    (and not equal to it: the step really ran in bf16), the same loss and gradient norm to a
    few percent, and the exported bf16 weights where the reference's AdamW step put them.
    Adam's first step moves a weight by about lr whatever its gradient's size, so a near-zero
    gradient whose sign bf16 flips lands 2 lr away; each layer's linear weights move the
    reference's way (cosine of the moves > 0.95), and so does the embedding, tied to the LM head
    (> 0.5: most of its rows get only the head's near-zero gradients). A norm weight's 1e-3 move
    is below bf16's spacing at 1.0: only the fp32 main weights hold it."""
    from safetensors.torch import load_file

    ref, got = references["token-mean"], results[0]["bf16_tp2"]
    valid = torch.cat([torch.zeros(4, 1), ref["mask"]], dim=1) > 0
    expected = torch.cat([torch.zeros(4, 1), ref["ref_lp"]], dim=1)
    diff = (got["logprobs"][valid] - expected[valid]).abs()
    print(f"bf16 vs fp32 log-probs: max {diff.max():.4f}, mean {diff.mean():.5f}")
    assert 1e-4 < diff.max() < 0.15 and diff.mean() < 0.02
    m = got["metrics"]
    assert m["update_successful"] == 1.0
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=0.05)
    assert m["loss"] == pytest.approx(ref["loss"], rel=0.05, abs=1e-3)
    start_weights = load_file(f"{model_dir}/model.safetensors")
    for hf_name, tensor in got["weights"].items():
        assert tensor.dtype == torch.bfloat16, hf_name
        want = ref["weights"][hf_name]
        torch.testing.assert_close(tensor.float(), want, rtol=2 ** -8, atol=2 * actor_step.lr,
                                   msg=lambda msg: f"{hf_name}: {msg}")
        if tensor.dim() == 2:
            start = start_weights[hf_name]
            cos = torch.nn.functional.cosine_similarity((tensor.float() - start).flatten(),
                                                        (want - start).flatten(), dim=0)
            least = 0.5 if "embed" in hf_name else 0.95
            assert cos > least, f"{hf_name}: the bf16 step's cosine to the reference's: {cos:.3f}"


@pytest.mark.parametrize("name", ["dp2_3rows", "tp2_3rows"])
def test_rows_that_do_not_split_over_dp_and_micro_batches_train_as_the_full_batch(
        results, model_dir, batch, actor_step, name):
    """Three rows in micro-batches of 2: over DP 2 the trainer pads the second rank with a row
    that has no loss token; under TP 2 the last micro-batch holds one row. Either step equals
    the transformers step on the three rows."""
    ref = actor_step.reference(model_dir, {k: v[:3] for k, v in batch.items()}, "token-mean")
    for r in range(2):
        m = results[r][name]["metrics"]
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
        assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    for hf_name, tensor in results[0][name]["weights"].items():
        torch.testing.assert_close(tensor, ref["weights"][hf_name], atol=1e-5, rtol=0,
                                   msg=lambda msg: f"{hf_name}: {msg}")


def test_layouts_agree_with_each_other(results):
    base = results[0]["dp2"]["weights"]
    for name in ("tp2", "pp2", "pp2_vpp2"):
        for hf_name, tensor in results[0][name]["weights"].items():
            torch.testing.assert_close(tensor, base[hf_name], atol=1e-5, rtol=0)


def test_critic_learns_fixed_targets(results, batch):
    critic = results[0]["critic"]
    mask = (batch["loss_mask"] * batch["attention_mask"])[:, 1:]
    # the value head starts at zero, so the first loss is 0.5 * mean(returns^2) over loss tokens
    assert torch.count_nonzero(critic["values0"]) == 0
    first, _ = value_loss(torch.zeros_like(mask), torch.zeros_like(mask), batch["returns"][:, 1:],
                          mask, None)
    assert critic["losses"][0] == pytest.approx(first.item(), rel=1e-5)
    assert critic["losses"][-1] < 0.7 * critic["losses"][0]
    assert all(math.isfinite(x) for x in critic["losses"])
    assert critic["losses"] == results[1]["critic"]["losses"]


def test_critic_highlight_first_loss_is_the_hand_weighted_mean(results, batch):
    """``highlight_first=3``: each response's first token counts 3 times in the critic's
    token-mean, across the micro-batches and both TP ranks. By hand from the batch's layout: every
    row's response starts at token 3, row 0's second response (after the observation at tokens
    7-8) at token 9; the value head starts at zero, so the loss is 0.5 * sum(w R^2) / sum(w)."""
    weights = batch["loss_mask"].clone()
    weights[:, 3] *= 3
    weights[0, 9] *= 3
    expected = 0.5 * (weights * batch["returns"].square()).sum() / weights.sum()
    got = results[0]["critic"]["highlighted_loss"]
    assert got == pytest.approx(expected.item(), rel=1e-5)
    assert got != pytest.approx(results[0]["critic"]["losses"][0], rel=1e-3)  # not today's loss
    assert got == results[1]["critic"]["highlighted_loss"]


def test_sft_step_matches_transformers_and_adamw(results, model_dir, batch):
    """``ragen-mega sft``'s step: the token-mean NLL of the loss-mask tokens only (prompt
    tokens and row 0's observation carry none), its gradient norm and the clipped AdamW update,
    against transformers and torch.optim.AdamW on the full batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = model(input_ids=batch["input_ids"],
                   attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = (batch["loss_mask"] * batch["attention_mask"])[:, 1:]
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()
    params = list(model.parameters())
    grad_norm = torch.norm(torch.stack([p.grad.norm() for p in params])).item()
    torch.nn.utils.clip_grad_norm_(params, SFT_SETTINGS["grad_clip"])
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    rest = [p for n, p in model.named_parameters() if p.dim() == 1 or n.endswith(".bias")]
    torch.optim.AdamW([{"params": decay, "weight_decay": SFT_SETTINGS["weight_decay"]},
                       {"params": rest, "weight_decay": 0.0}], lr=SFT_SETTINGS["lr"],
                      eps=SFT_SETTINGS["adam_eps"]).step()
    for r in range(2):
        m = results[r]["sft"]["metrics"]
        assert m["update_successful"] == 1.0
        assert m["loss"] == pytest.approx(loss.item(), rel=1e-5)
        assert m["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    assert grad_norm > SFT_SETTINGS["grad_clip"]  # clipping was active
    reference = model.state_dict()
    for hf_name, tensor in results[0]["sft"]["weights"].items():
        torch.testing.assert_close(tensor, reference[hf_name], atol=1e-5, rtol=0,
                                   msg=lambda msg: f"sft {hf_name}: {msg}")
