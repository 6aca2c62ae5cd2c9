"""LoRA on the Megatron trainer against PEFT's own LoRA layers on transformers.

One 2-process launch: at TP 1 (DP 2), TP 2 and PP 2 the adapted model's log-probs and its
adapters' gradients equal those of ``peft`` with the same adapters on the same rows, and the
merged export equals PEFT's ``merge_and_unload``. Then the trainer (DP 2 with the distributed
optimizer): a step moves only the adapters (base weights bit-identical, Adam state for adapters
only), a checkpoint holds the adapters alone, resuming from it repeats the next step bit for
bit, it loads at TP 2 too, and its PEFT export loads in ``peft`` and gives the trainer's
log-probs; the KL term's reference is the base (the adapters switched off, no second model).
"""
from __future__ import annotations

import pytest
import torch

from conftest import load_adapters, make_batch
from ragen_mega.backends.megatron.launch import run_workers

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
LAYOUTS = ((1, 1), (2, 1), (1, 2))


def _loss(outputs, batch):
    """The loss of conftest.training_grads: log-probs and entropy of every token."""
    loss = -(outputs["logprobs"].sum() + 0.1 * outputs["entropy"].sum())
    return loss, {"loss": loss.detach().clone()}


def _worker(rank, world, hf_dir, adapters, ids, mask, batch, ckpt_root, peft_dir):
    import gc

    from megatron.core import parallel_state as mpu

    from ragen_mega.backends.megatron import lora, lora_export
    from ragen_mega.backends.megatron.config import ActorConfig, CriticConfig, LoraConfig
    from ragen_mega.backends.megatron.export import export_hf_state
    from ragen_mega.backends.megatron.forward import (forward_logprobs, make_forward_step,
                                                      run_schedule, split_microbatches)
    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint
    from ragen_mega.backends.megatron.parallel import init_parallel
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.models.hf_config import model_spec

    settings = lora.LoraSettings(RANK, ALPHA, 0.0, TARGETS)
    out = {}
    for tp, pp in LAYOUTS:
        init_parallel(rank, world, None, tp=tp, pp=pp)
        # a vocabulary padded to 50 000 rows: the LM head's last TP shard ends in padding
        chunks = build_model(model_spec(hf_dir, vocab_divisor=1000), use_te=False)
        load_hf_checkpoint(chunks, hf_dir)
        # frozen first, as apply_lora leaves it: Megatron runs a frozen weight's linear on
        # another path (linear_with_frozen_weight), which rounds one log-prob of this batch an
        # ulp apart at TP 2 on an Intel Xeon; the fresh adapters below must add exactly nothing
        for chunk in chunks:
            chunk.requires_grad_(False)
        base_lp, _ = forward_logprobs(chunks, ids, mask, micro_batch_size=2)
        lora.apply_lora(chunks, settings, seed=0)
        fresh_lp, _ = forward_logprobs(chunks, ids, mask, micro_batch_size=2)
        load_adapters(chunks, adapters)
        lp, _ = forward_logprobs(chunks, ids, mask, micro_batch_size=2)
        run_schedule(chunks, split_microbatches(ids, mask, 2),
                     make_forward_step(temperature=1.0, compute_entropy=True, loss_fn=_loss),
                     forward_only=False)
        with torch.no_grad():
            frozen_grads = [n for c in chunks for n, p in c.named_parameters()
                            if p.grad is not None and not lora.is_adapter(n)]
            for c in chunks:   # gather the gradients the way the adapters are gathered
                for p in c.parameters():
                    if p.grad is not None:
                        p.data = p.grad
            grads = lora_export.gather_adapters(chunks)
        out[(tp, pp)] = dict(base_lp=base_lp, fresh_lp=fresh_lp, lp=lp, grads=grads,
                             frozen_grads=frozen_grads)
        if (tp, pp) == (2, 1):
            load_adapters(chunks, adapters)   # the data above were the gradients
            out["merged"] = dict(export_hf_state(chunks))
        del chunks
        gc.collect()

    def trainer(tp, distributed):
        init_parallel(rank, world, None, tp=tp, pp=1)
        config = ActorConfig(tp=tp, lr=1e-2, micro_batch_size=2, grad_clip=1.0, kl_coef=0.01,
                             use_distributed_optimizer=distributed,
                             lora=LoraConfig(rank=RANK, alpha=ALPHA))
        return MegatronTrainer(config, hf_dir, total_steps=10, seed=3)

    def base_weights(t):
        return {n: p.detach().clone() for c in t.model for n, p in c.named_parameters()
                if not lora.is_adapter(n)}

    a = trainer(1, True)
    before = base_weights(a)
    start = lora_export.gather_adapters(a.model)
    old = a.compute_logprobs(batch) + batch["noise"]
    train = {**batch, "old_logprobs": old}
    a.train(train)
    after = base_weights(a)
    # the distributed optimizer's state on this DP rank: its shard of the trainable values
    state = [st for opt in _inner(a.optimizer) for st in opt.state.values()]
    out["step"] = dict(base_same=all(torch.equal(before[n], after[n]) for n in before),
                       n_base=len(before), start=start, step1=lora_export.gather_adapters(a.model),
                       adam_values=sum(st["exp_avg"].numel() for st in state),
                       adam_sq_values=sum(st["exp_avg_sq"].numel() for st in state),
                       adapter_values=sum(p.numel() for c in a.model
                                          for n, p in c.named_parameters() if lora.is_adapter(n)),
                       trainable=sorted(n for c in a.model for n, p in c.named_parameters()
                                        if p.requires_grad))
    path = a.save_checkpoint(ckpt_root, 1)
    a.train(train)
    out["step"]["step2"] = lora_export.gather_adapters(a.model)
    out["step"]["lp2"] = a.compute_logprobs(batch)
    out["step"]["ref_lp"] = a.compute_ref_logprobs(batch)   # the base, adapters off
    if rank == 0:
        lora_export.write_peft_adapter(peft_dir, out["step"]["step2"], a.lora, str(hf_dir))
    del a
    gc.collect()

    b = trainer(1, True)
    b.load_checkpoint(path)
    b.train(train)
    out["resumed"] = dict(step2=lora_export.gather_adapters(b.model), steps=b.steps)
    del b
    gc.collect()

    c = trainer(2, False)   # the distributed optimizer's state resumes at its TP x PP only
    c.load_checkpoint(path, optimizer=False)
    out["tp2_load"] = lora_export.gather_adapters(c.model)
    del c
    gc.collect()

    def critic():   # DP 2, adapters on every linear, the value head trained whole
        init_parallel(rank, world, None, tp=1, pp=1)
        return MegatronTrainer(CriticConfig(lr=1e-2, micro_batch_size=2, value_clip=None,
                                            lora=LoraConfig(rank=RANK, alpha=ALPHA)),
                               hf_dir, role="critic")

    d = critic()
    before = base_weights(d)
    values0 = d.compute_values(batch)
    losses = [d.train({**batch, "old_values": values0})["vf_loss"] for _ in range(4)]
    after = base_weights(d)
    head = [n for n in before if n.endswith("output_layer.weight")]
    out["critic"] = dict(
        losses=losses, head=head, head_moved=not torch.equal(before[head[0]], after[head[0]]),
        base_same=all(torch.equal(before[n], after[n]) for n in before if n not in head),
        trainable=sorted(n for c in d.model for n, p in c.named_parameters() if p.requires_grad))
    path = d.save_checkpoint(f"{ckpt_root}_critic", 4)
    values = d.compute_values(batch)
    del d
    gc.collect()
    e = critic()
    e.load_checkpoint(path)
    out["critic"]["resumed_values_equal"] = torch.equal(e.compute_values(batch), values)
    del e
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    return out


def _inner(optimizer):
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


# ---------------------------------------------------------------------- the PEFT reference
def _peft_model(hf_dir, adapters=None, targets=TARGETS):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                            target_modules=list(targets),
                                            init_lora_weights=False))
    if adapters is not None:
        set_peft_model_state_dict(model, {"base_model.model." + k: v for k, v in adapters.items()})
    return model


def _row_logprobs(model, ids, mask, grad: bool = False):
    """Per-row (unpadded) next-token log-probs; with ``grad``, the backward of
    conftest.training_grads' loss over micro-batches of 2 rows (Megatron's schedule averages
    them)."""
    lp = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    rows = list(range(ids.shape[0]))
    for micro in (rows[i:i + 2] for i in range(0, len(rows), 2)):
        loss = 0.0
        for b in micro:
            n = int(mask[b].sum())
            logp = torch.log_softmax(model(input_ids=ids[b: b + 1, :n]).logits[0].double(), -1)[:-1]
            lp[b, : n - 1] = logp.gather(-1, ids[b, 1:n, None]).squeeze(-1).detach().float()
            entropy = -(logp.exp() * logp).sum(-1)
            loss = loss - (logp.gather(-1, ids[b, 1:n, None]).sum() + 0.1 * entropy.sum())
        if grad:
            (loss / ((len(rows) + 1) // 2)).backward()
    return lp


def read_peft_adapter(adapter_dir):
    """A PEFT LoRA adapter directory's tensors (keys as ``lora.adapter_tensors`` names them)
    and settings; what it cannot express here is refused, naming the field."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from ragen_mega.backends.megatron.lora import LoraSettings
    from ragen_mega.backends.megatron.lora_export import PEFT_PREFIX

    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    for field, allowed in (("peft_type", ("LORA",)), ("bias", ("none",)),
                           ("use_rslora", (False, None)), ("use_dora", (False, None)),
                           ("fan_in_fan_out", (False, None))):
        if config.get(field, allowed[0]) not in allowed:
            raise ValueError(f"{adapter_dir}/adapter_config.json: {field} is "
                             f"{config[field]!r}; only {allowed[0]!r} is supported")
    targets = config["target_modules"]
    targets = [targets] if isinstance(targets, str) else targets
    settings = LoraSettings(int(config["r"]), float(config["lora_alpha"]),
                            float(config.get("lora_dropout", 0.0)), tuple(sorted(targets)))
    raw = load_file(str(adapter_dir / "adapter_model.safetensors"))
    tensors = {k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k: v
               for k, v in raw.items()}
    return tensors, settings


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("qwen2", tied=False))


@pytest.fixture(scope="module")
def adapters(model_dir):
    """PEFT's own random adapters (A and B both non-zero), keys without PEFT's prefix."""
    from peft import get_peft_model_state_dict

    torch.manual_seed(0)
    state = get_peft_model_state_dict(_peft_model(model_dir), save_embedding_layers=False)
    return {k[len("base_model.model."):]: v.clone() for k, v in state.items()}


@pytest.fixture(scope="module")
def results(model_dir, adapters, tmp_path_factory):
    from transformers import AutoConfig

    from conftest import _actor_batch

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    ids, mask = make_batch(vocab)
    batch = _actor_batch(vocab)
    root = tmp_path_factory.mktemp("lora")
    out = run_workers(_worker, 2, model_dir, adapters, ids, mask, batch, str(root / "ckpt"),
                      str(root / "peft"), timeout=900)
    return dict(ranks=out, ids=ids, mask=mask, batch=batch, ckpt=root / "ckpt",
                peft=root / "peft")


def test_forward_and_gradients_equal_peft_at_tp1_tp2_pp2(results, model_dir, adapters):
    ids, mask = results["ids"], results["mask"]
    peft = _peft_model(model_dir, adapters)
    ref_lp = _row_logprobs(peft, ids, mask, grad=True)
    ref_grads = {n[len("base_model.model."):].replace(".default", ""): p.grad
                 for n, p in peft.named_parameters() if p.grad is not None and ".lora_" in n}
    assert set(ref_grads) == set(adapters)
    for rank, out in enumerate(results["ranks"]):
        for layout in LAYOUTS:
            got = out[layout]
            assert torch.allclose(got["fresh_lp"], got["base_lp"], atol=0, rtol=0), layout
            assert torch.allclose(got["lp"], ref_lp, atol=2e-5, rtol=0), (
                rank, layout, (got["lp"] - ref_lp).abs().max())
            assert not torch.allclose(got["lp"], got["base_lp"], atol=1e-3)
            assert got["frozen_grads"] == [], got["frozen_grads"][:3]
            assert set(got["grads"]) == set(ref_grads)
            for key, ref in ref_grads.items():
                scale = ref.abs().max().item()
                diff = (got["grads"][key] - ref).abs().max().item()
                assert diff <= 3e-5 * max(scale, 1e-3), (rank, layout, key, diff, scale)


def test_merged_export_equals_peft_merge_and_unload(results, model_dir, adapters):
    merged = _peft_model(model_dir, adapters).merge_and_unload().state_dict()
    got = results["ranks"][0]["merged"]
    assert set(got) == set(merged)
    for name, ref in merged.items():
        assert torch.allclose(got[name], ref, atol=1e-6, rtol=1e-6), name


def test_a_step_moves_only_the_adapters_and_adam_keeps_state_for_them_alone(results):
    ranks = [out["step"] for out in results["ranks"]]
    step = ranks[0]
    for r in ranks:
        assert r["base_same"] and r["n_base"] > 0
        assert r["trainable"] and all(".lora." in n for n in r["trainable"])
    # DP 2 with the distributed optimizer: each rank keeps Adam's moments for its half of
    # the adapters' values, and for nothing else
    assert sum(r["adam_values"] for r in ranks) == step["adapter_values"]
    assert sum(r["adam_sq_values"] for r in ranks) == step["adapter_values"]
    assert 0 < ranks[0]["adam_values"] < step["adapter_values"]
    start, b_keys = step["start"], [k for k in step["start"] if "lora_B" in k]
    assert len(b_keys) == len(start) // 2 and all(not start[k].any() for k in b_keys)  # B = 0
    # with B = 0 the first step moves every B and no A (A's gradient is B^T ...); the second
    # moves every A
    moved = {k for k in start if not torch.equal(start[k], step["step1"][k])}
    assert moved == set(b_keys)
    assert all(not torch.equal(step["step1"][k], step["step2"][k]) for k in start)


def test_checkpoint_holds_adapters_and_resumes_bit_identically(results):
    from torch.distributed.checkpoint import FileSystemReader

    path = results["ckpt"] / "step_1"
    keys = set(FileSystemReader(str(path / "dist")).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if not k.startswith("optimizer.")}
    assert model_keys and all(".lora_A.weight" in k or ".lora_B.weight" in k
                              for k in model_keys), sorted(model_keys)[:5]
    for rank, out in enumerate(results["ranks"]):
        step = out["step"]
        assert out["resumed"]["steps"] == 2
        for key, value in step["step2"].items():
            assert torch.equal(out["resumed"]["step2"][key], value), (rank, key)
        for key, value in step["step1"].items():   # loaded at TP 2: the same adapters
            assert torch.equal(out["tp2_load"][key], value), (rank, key)


def test_peft_export_gives_the_trainers_logprobs_and_the_reference_is_the_base(results,
                                                                              model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch = results["batch"]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(results["peft"]))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        ref = _row_logprobs(model, ids, mask)
    lp = results["ranks"][0]["step"]["lp2"][:, 1:]
    valid = mask[:, 1:].bool()
    assert torch.allclose(lp[valid], ref[valid], atol=2e-5, rtol=0), (lp - ref)[valid].abs().max()
    # the KL term's reference: the trainer's own base with the adapters off, transformers' base
    with torch.no_grad():
        base_lp = _row_logprobs(
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), ids, mask)
    ref_lp = results["ranks"][0]["step"]["ref_lp"][:, 1:]
    assert torch.allclose(ref_lp[valid], base_lp[valid], atol=2e-5, rtol=0)
    assert not torch.allclose(lp[valid], base_lp[valid], atol=1e-3)


def test_convert_writes_the_checkpoints_adapters_for_peft_and_merged_into_the_base(
        results, model_dir, tmp_path):
    """``ragen-mega convert megatron-to-peft`` gives the adapters the trainer saved, bit for
    bit; ``megatron-to-hf`` merges them into the base the run trained from (found through the
    checkpoint) as PEFT's ``merge_and_unload`` does."""
    from safetensors.torch import load_file

    from ragen_mega.backends.megatron import convert

    step_1 = str(results["ckpt"] / "step_1")
    assert convert.main(["megatron-to-peft", "--megatron-dir", step_1,
                         "--out-dir", str(tmp_path / "peft")]) == 0
    tensors, settings = read_peft_adapter(tmp_path / "peft")
    saved = results["ranks"][0]["step"]["step1"]
    assert set(tensors) == set(saved)
    assert all(torch.equal(tensors[k], saved[k]) for k in saved)
    assert (settings.rank, settings.alpha, settings.target_modules) == (
        RANK, ALPHA, tuple(sorted(TARGETS[:7])))   # the trainer's: LoraConfig's default
    assert convert.main(["megatron-to-hf", "--megatron-dir", step_1,
                         "--out-dir", str(tmp_path / "merged")]) == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    reference = _peft_model(model_dir, saved, TARGETS[:7]).merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    for name, ref in reference.items():
        assert torch.allclose(merged[name], ref, atol=1e-6, rtol=1e-6), name
    assert convert.main(["megatron-to-hf", "--megatron-dir", step_1, "--out-dir",
                         str(tmp_path / "merged")]) == 1   # not empty: refused, kept whole
    assert set(load_file(str(tmp_path / "merged" / "model.safetensors"))) == set(reference)


def test_a_critic_trains_adapters_and_its_value_head_and_resumes_them(results):
    """``critic.lora``: the value head (a fresh zero head) trains whole beside the adapters, the
    base stays frozen, the value loss falls, and the checkpoint (adapters and head) gives the
    same values when loaded."""
    for out in results["ranks"]:
        critic = out["critic"]
        assert len(critic["head"]) == 1 and critic["head_moved"] and critic["base_same"]
        assert all(".lora." in n or n.endswith("output_layer.weight")
                   for n in critic["trainable"])
        assert critic["losses"][-1] < 0.7 * critic["losses"][0], critic["losses"]
        assert critic["resumed_values_equal"]
