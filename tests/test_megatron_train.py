"""The Megatron trainer's actor and critic steps against an independent transformers + torch.optim
reference, and across TP x PP x DP layouts.

One 2-process launch visits every layout (DP2, TP2, PP2, PP2 with interleaving) and a critic;
the parent computes the reference with transformers, the algo loss functions and
torch.optim.AdamW on the full batch, without micro-batches.
"""
from __future__ import annotations

import math

import pytest
import torch

from ragen_mega.algo.losses import aggregate, kl_penalty, policy_loss, value_loss
from ragen_mega.backends.megatron.launch import run_workers

LR, WD, EPS, CLIP = 1e-3, 0.1, 1e-6, 0.05
ACTOR = dict(micro_batch_size=1, lr=LR, weight_decay=WD, adam_eps=EPS, grad_clip=CLIP,
             entropy_coeff=0.01, kl_coef=0.1, kl_kind="k1", total_steps=10)
# layout name -> (tp, pp, vpp, extra config); world size 2, so tp=pp=1 means DP=2
LAYOUTS = {
    "dp2": (1, 1, None, {}),
    "tp2": (2, 1, None, {}),
    "pp2": (1, 2, None, {}),
    "pp2_vpp2": (1, 2, 2, {}),
    "dp2_seqmean": (1, 1, None, {"loss_agg_mode": "seq-mean-token-mean"}),
}


def _batch(vocab: int, seed: int = 0) -> dict:
    """Ragged right-padded rows: prompt, a masked-out observation in the middle, padding."""
    g = torch.Generator().manual_seed(seed)
    B, S = 4, 14
    lengths = [14, 9, 12, 6]
    input_ids = torch.randint(0, vocab, (B, S), generator=g)
    attention_mask = torch.zeros(B, S, dtype=torch.long)
    loss_mask = torch.zeros(B, S)
    for b, n in enumerate(lengths):
        attention_mask[b, :n] = 1
        input_ids[b, n:] = 0
        loss_mask[b, 3:n] = 1
    loss_mask[0, 7:9] = 0  # an environment observation inside the response
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "advantages": torch.randn(B, S, generator=g),
            "noise": torch.randn(B, S, generator=g),
            "returns": 1.5 + 0.5 * torch.randn(B, S, generator=g)}


def _train_worker(rank, world_size, hf_dir, batch):
    import gc

    from ragen_mega.backends.megatron.parallel import file_init_method, init_parallel
    from ragen_mega.backends.megatron.train import MegatronTrainer, TrainerConfig, dp_shard

    out = {}
    for name, (tp, pp, vpp, extra) in LAYOUTS.items():
        init_parallel(rank, world_size, file_init_method("/nonexistent"), tp=tp, pp=pp, vpp=vpp)
        trainer = MegatronTrainer(TrainerConfig(tp=tp, pp=pp, vpp=vpp, **ACTOR, **extra), hf_dir)
        local = dp_shard(batch)
        logprobs = trainer.compute_logprobs(local)
        # old policy = current policy + noise, so clipped and dual-clipped tokens both occur
        local = {**local, "old_logprobs": logprobs + local["noise"]}
        metrics = trainer.train_actor(local)
        weights = dict(trainer.export_hf_state())
        out[name] = {"metrics": metrics, "logprobs": logprobs,
                     "weights": weights if rank == 0 else None}
        del trainer
        gc.collect()

    init_parallel(rank, world_size, file_init_method("/nonexistent"), tp=2, pp=1)
    critic = MegatronTrainer(TrainerConfig(tp=2, micro_batch_size=2, lr=1e-2, grad_clip=1.0,
                                           value_clip=None), hf_dir, role="critic")
    values0 = critic.compute_values(batch)
    losses = [critic.train_critic({**batch, "old_values": values0})["value_loss"]
              for _ in range(6)]
    out["critic"] = {"values0": values0, "losses": losses}
    return out


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen2", tied=True, num_layers=4)


@pytest.fixture(scope="module")
def batch(model_dir):
    from transformers import AutoConfig

    return _batch(AutoConfig.from_pretrained(model_dir).vocab_size)


@pytest.fixture(scope="module")
def results(model_dir, batch):
    return run_workers(_train_worker, 2, model_dir, batch, timeout=900)


def _hf_logprobs_entropy(model, batch):
    logits = model(input_ids=batch["input_ids"],
                   attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def _reference_step(model_dir, batch, mode):
    """Full-batch StarPO loss with transformers + algo functions, then torch AdamW."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref_lp, _ = _hf_logprobs_entropy(ref_model, batch)
    mask = batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]
    old = ref_lp + batch["noise"][:, 1:]
    lp, entropy = _hf_logprobs_entropy(model, batch)
    pg, _ = policy_loss(lp, old, batch["advantages"][:, 1:], mask, 0.2, 0.28, 3.0, agg=mode)
    loss = (pg - ACTOR["entropy_coeff"] * aggregate(entropy, mask, mode)
            + ACTOR["kl_coef"] * aggregate(kl_penalty(lp, ref_lp, "k1"), mask, mode))
    loss.backward()
    params = [p for p in model.parameters()]
    grad_norm = torch.norm(torch.stack([p.grad.norm() for p in params])).item()
    torch.nn.utils.clip_grad_norm_(params, CLIP)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if p.dim() == 1 or n.endswith(".bias")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, eps=EPS)
    opt.step()
    return {"loss": loss.item(), "grad_norm": grad_norm, "ref_lp": ref_lp,
            "weights": {n: p.detach().clone() for n, p in model.state_dict().items()},
            "mask": mask}


@pytest.fixture(scope="module")
def references(model_dir, batch):
    return {mode: _reference_step(model_dir, batch, mode)
            for mode in ("token-mean", "seq-mean-token-mean")}


def _mode(name):
    return LAYOUTS[name][3].get("loss_agg_mode", "token-mean")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_actor_step_matches_transformers_and_adamw(results, references, name):
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
        assert m["lr"] == pytest.approx(LR)
    assert ref["grad_norm"] > CLIP  # clipping was active
    m = results[0][name]["metrics"]
    assert 0 < m["pg_clipfrac"] < 1 and m["dual_clip_frac"] > 0

    weights = results[0][name]["weights"]
    assert set(weights) == set(ref["weights"]) - {"lm_head.weight"}  # tied: no lm_head exported
    for hf_name, tensor in weights.items():
        torch.testing.assert_close(tensor, ref["weights"][hf_name], atol=1e-5, rtol=0,
                                   msg=lambda msg: f"{name} {hf_name}: {msg}")


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
