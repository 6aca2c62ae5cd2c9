"""LoRA on a mixture of experts: adapters on attention, on every routed expert's gate/up/down,
on the shared expert and on the LM head, on one 2-process launch at two layouts: expert
parallelism 2 (each rank holds two of the 4 experts and their adapters) and TP 2 (every
expert's linears split over the ranks, under the sequence parallelism megatron-core trains
experts with at TP > 1).

* qwen2_moe (with a gated shared expert), at each layout: log-probs and each adapter's gradient
  of rows split over the data-parallel ranks against transformers with every adapted weight
  replaced by ``W + s * B A`` of leaf adapter tensors (the experts fused as transformers keeps
  them); the merged export (what ``convert`` writes and a merged-weight sync sends) against the
  checkpoint's weights plus ``s * B A``.
* qwen3_moe, the trainer: a step at EP 2 and at TP 2 equals the step at EP 1 (DP 2): loss,
  gradient norm (every rank's slice counted once) and adapters; an expert's adapters are
  reduced over the expert-data-parallel ranks only (summed over all data-parallel ranks they
  would take other experts' gradients in). The step after it at EP 2 equals that step resumed
  at EP 1 from the checkpoint EP 2 saved (each expert's adapters written by their owner), the
  base weights do not move, and the PEFT directory it exports gives its log-probs in PEFT,
  which reads the per-expert keys onto transformers' fused experts. (PEFT 0.21 on transformers
  5.19 does not read them onto qwen2_moe's experts: it drops them as unexpected keys, so that
  export is checked on qwen3_moe.)
"""
from __future__ import annotations

import pytest
import torch

from conftest import load_adapters, make_batch, training_grads
from ragen_mega.backends.megatron.launch import run_workers

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
#: the layouts sum a gradient in other orders (all-to-all, TP all-reduces, or locally and then
#: over DP): ~1e-10 apart on entries that are themselves near Adam's eps (1e-8), which its
#: first step, lr * g / (|g| + eps), turns into up to ~3e-3 of the lr (1e-2). A gradient
#: reduced wrongly (other experts' summed in, a TP part missing) moves entries by ~lr.
ATOL = 1e-4
#: expert parallelism 2 (DP 2; each rank two experts), and TP 2 (each expert's linears split
#: over the ranks under sequence parallelism, as megatron-core trains experts at TP > 1)
LAYOUTS = ({"ep": 2}, {"tp": 2})


def _checkpoint_tensors(hf_dir) -> dict[str, torch.Tensor]:
    import glob

    from safetensors.torch import load_file

    out = {}
    for f in glob.glob(f"{hf_dir}/*.safetensors"):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def hf_dir(tiny_model):
    return str(tiny_model("qwen2_moe"))


@pytest.fixture(scope="module")
def trained_dir(tiny_model):
    return str(tiny_model("qwen3_moe"))


@pytest.fixture(scope="module")
def adapters(hf_dir):
    """Random adapters (A and B non-zero) on every targeted linear under the checkpoint's own
    per-expert names; keys without PEFT's prefix."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, weight in sorted(_checkpoint_tensors(hf_dir).items()):
        module = name[: -len(".weight")]
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in TARGETS:
            continue
        rows, cols = weight.shape
        out[f"{module}.lora_A.weight"] = torch.randn(RANK, cols, generator=g) / cols ** 0.5
        out[f"{module}.lora_B.weight"] = torch.randn(rows, RANK, generator=g) * 0.1
    return out


def _worker(rank, world, hf_dir, adapters, ids, mask, trained_dir, batch, peft_dir, ckpt_root):
    import gc

    from ragen_mega.backends.megatron import lora, lora_export
    from ragen_mega.backends.megatron.config import LoraConfig
    from ragen_mega.backends.megatron.export import export_hf_state
    from ragen_mega.backends.megatron.forward import forward_logprobs
    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint
    from ragen_mega.backends.megatron.parallel import init_parallel
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig

    out = {}
    for layout in LAYOUTS:
        init_parallel(rank, world, None, **layout)
        chunks = build_model(hf_dir)
        load_hf_checkpoint(chunks, hf_dir)
        lora.apply_lora(chunks, lora.LoraSettings(RANK, ALPHA, 0.0, TARGETS), seed=0)
        load_adapters(chunks, adapters)
        name = _name(layout)
        out[name] = {
            "held": sorted(key for key, _, _ in lora.adapter_tensors(chunks[0])),
            "lp": forward_logprobs(chunks, ids, mask, micro_batch_size=2)[0],
            # what `convert` writes and a merged-weight sync sends: base + s * B A
            "merged": {k: v.clone() for k, v in export_hf_state(chunks)}}
        # at DP 2 this rank's micro-batch (together the two of the reference's), else both
        rows = slice(None) if layout.get("tp") == 2 else slice(0, 2) if rank == 0 else slice(2, 3)
        out[name]["grads"] = training_grads(chunks, ids[rows], mask[rows], rank,
                                           reduce_over_dp=True)[0]
        del chunks
        gc.collect()

    def step(trainer):
        old = trainer.compute_logprobs(batch) + batch["noise"]
        metrics = trainer.train({**batch, "old_logprobs": old})
        return metrics, lora_export.gather_adapters(trainer.model)

    def base(trainer):
        return {n: p.detach().clone() for c in trainer.model for n, p in c.named_parameters()
                if not lora.is_adapter(n)}

    config = dict(lr=1e-2, micro_batch_size=2, grad_clip=1.0,
                  lora=LoraConfig(rank=RANK, alpha=ALPHA, target_modules=list(TARGETS)))
    for layout in (*LAYOUTS, {"ep": 1}):
        init_parallel(rank, world, None, **layout)
        trainer = MegatronTrainer(ActorConfig(**layout, **config), trained_dir, total_steps=10,
                                  seed=3)
        before = base(trainer)
        ep = _name(layout)
        out["step", ep] = step(trainer)
        out["base_same", ep] = all(torch.equal(before[n], p) for n, p in base(trainer).items())
        if ep == "ep2":
            saved = trainer.save_checkpoint(ckpt_root, 1)
            out["second", "ep2"] = step(trainer)
            out["lp_after"] = trainer.compute_logprobs(batch)
            if rank == 0:
                lora_export.write_peft_adapter(peft_dir, out["second", "ep2"][1], trainer.lora,
                                               trained_dir)
        del trainer
        gc.collect()
    trainer = MegatronTrainer(ActorConfig(ep=1, **config), trained_dir, total_steps=10, seed=3)
    trainer.load_checkpoint(saved)
    out["second", "ep1"] = step(trainer)
    return out


def _name(layout: dict) -> str:
    return "".join(f"{k}{v}" for k, v in layout.items())


def _merged_reference(hf_dir, adapters, ids, mask):
    """transformers' log-probs and the adapters' gradients of ``training_grads``' loss (its two
    micro-batches averaged), each adapted weight computed as ``W + s * B A`` from leaf adapter
    tensors: a layer's fused experts ([experts, gate; up, hidden] and [experts, hidden, ffn])
    stacked from the per-expert adapters."""
    from torch.func import functional_call
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    leaves = {k: v.clone().requires_grad_(True) for k, v in adapters.items()}
    num_experts = model.config.num_experts

    def delta(module):
        return ALPHA / RANK * leaves[f"{module}.lora_B.weight"] @ leaves[f"{module}.lora_A.weight"]

    def weights():
        out = {}
        for name, p in model.named_parameters():
            stem = name.rsplit(".", 1)[0] + "."
            if name.endswith("mlp.experts.gate_up_proj"):
                out[name] = p + torch.stack([torch.cat([delta(f"{stem}{e}.gate_proj"),
                                                        delta(f"{stem}{e}.up_proj")])
                                             for e in range(num_experts)])
            elif name.endswith("mlp.experts.down_proj"):
                out[name] = p + torch.stack([delta(f"{stem}{e}.down_proj")
                                             for e in range(num_experts)])
            elif f"{name[: -len('.weight')]}.lora_A.weight" in leaves:
                out[name] = p + delta(name[: -len(".weight")])
        return out

    lp = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for rows in ((0, 1), (2,)):              # the two micro-batches of the two DP ranks
        loss = 0.0
        for b in rows:
            n = int(mask[b].sum())
            logits = functional_call(model, weights(), (ids[b: b + 1, :n],)).logits[0]
            logp = torch.log_softmax(logits, -1)[:-1]
            lp[b, : n - 1] = logp.gather(-1, ids[b, 1:n, None]).squeeze(-1).detach()
            entropy = -(logp.exp() * logp).sum(-1)
            loss = loss - (logp.gather(-1, ids[b, 1:n, None]).sum() + 0.1 * entropy.sum())
        (loss / 2).backward()
    return lp, {k: v.grad for k, v in leaves.items()}


def _peft_logprobs(hf_dir, peft_dir, batch):
    """PEFT's own LoRA on transformers, the adapter directory loaded onto the fused experts."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, peft_dir)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits[:, :-1]
    return torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def results(hf_dir, adapters, trained_dir, actor_batch, tmp_path_factory):
    ids, mask = make_batch(49152)
    root = tmp_path_factory.mktemp("lora_moe")
    out = run_workers(_worker, 2, hf_dir, adapters, ids, mask, trained_dir, actor_batch,
                      str(root / "peft"), str(root / "ckpt"), ep=2, timeout=900)
    return dict(ranks=out, ids=ids, mask=mask, peft=str(root / "peft"))


@pytest.mark.parametrize("layout", ["ep2", "tp2"])
def test_expert_adapters_match_transformers_with_merged_weights(results, hf_dir, adapters,
                                                                layout):
    ids, mask = results["ids"], results["mask"]
    ranks = [out[layout] for out in results["ranks"]]
    base = _checkpoint_tensors(hf_dir)
    for r, out in enumerate(ranks):
        assert out["merged"].keys() == base.keys(), r
        for name, weight in base.items():
            module = name[: -len(".weight")]
            want = weight + (ALPHA / RANK * adapters[f"{module}.lora_B.weight"]
                             @ adapters[f"{module}.lora_A.weight"]
                             if f"{module}.lora_A.weight" in adapters else 0)
            torch.testing.assert_close(out["merged"][name], want, atol=1e-6, rtol=0, msg=name)
    ref_lp, ref_grads = _merged_reference(hf_dir, adapters, ids, mask)
    valid = mask[:, 1:].bool()
    experts = [{k.split(".mlp.experts.")[1].split(".")[0] for k in out["held"]
                if ".mlp.experts." in k} for out in ranks]
    # at EP 2 each rank holds its own experts' adapters; at TP 2 a part of every one's
    assert experts == ([{"0", "1"}, {"2", "3"}] if layout == "ep2" else [{"0", "1", "2", "3"}] * 2)
    assert any(".shared_expert." in k for k in ranks[0]["held"])
    for r, out in enumerate(ranks):
        assert (out["lp"] - ref_lp)[valid].abs().max() < 1e-5, r
    grads = ranks[0]["grads"]
    assert grads.keys() == ref_grads.keys()
    for key, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1e-6)
        assert (grads[key] - ref).abs().max() / scale < 1e-4, key


def test_a_step_at_ep2_and_at_tp2_is_the_step_at_ep1_and_resumes_there(results):
    rank0 = results["ranks"][0]
    m1, a1 = rank0["step", "ep1"]
    for layout in ("ep2", "tp2"):
        m, a = rank0["step", layout]
        assert m["loss"] == pytest.approx(m1["loss"], rel=1e-6), layout
        assert m["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-6), layout
        assert a.keys() == a1.keys()
        for key, tensor in a1.items():
            torch.testing.assert_close(a[key], tensor, atol=ATOL, rtol=0, msg=f"{layout} {key}")
    assert all(out["base_same", ep] for out in results["ranks"] for ep in ("ep2", "tp2", "ep1"))
    (s2, b2), (s1, b1) = rank0["second", "ep2"], rank0["second", "ep1"]
    assert s1["loss"] == pytest.approx(s2["loss"], rel=1e-6)
    for key, tensor in b2.items():
        torch.testing.assert_close(b1[key], tensor, atol=ATOL, rtol=0, msg=key)
        assert not torch.equal(tensor, a1[key]), key    # the second step moved every adapter


def test_the_peft_export_of_expert_adapters_gives_the_trainers_logprobs(results, trained_dir,
                                                                         actor_batch):
    got = results["ranks"][0]["lp_after"]
    want = _peft_logprobs(trained_dir, results["peft"], actor_batch)
    valid = actor_batch["attention_mask"][:, 1:].bool()
    assert (got[:, 1:] - want)[valid].abs().max() < 1e-5   # log-probs of tokens 1..
