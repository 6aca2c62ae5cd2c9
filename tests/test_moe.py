"""Mixtures of experts (issue 24): Qwen3-MoE and Qwen2-MoE read, mapped, trained, converted,
synced and served by the real megatron-core and SGLang against transformers, on tiny random
checkpoints that transformers writes (``models/prepare.make_tiny_model``: 4 experts, 2 per token;
qwen2_moe with a gated shared expert and q/k/v biases, qwen3_moe with q/k norms and renormalised
top-k probabilities).

- The config: both expert-count keys, the router's normalisation, dense layers refused by name;
  EP layouts the run or the model cannot take are config errors naming both numbers.
- The mapping: HF -> Megatron TP shards -> HF is bit-exact, and a checkpoint whose expert
  tensors contradict the config is refused naming the key.
- Megatron (local spec, ``SequentialMLP`` experts, alltoall dispatcher, on gloo with
  ``cpu_compat`` patches 8 and 9): log-probs, entropies and gradients against transformers at
  EP 1 and EP 2; the export against the checkpoint's files. The negative control builds the
  other router normalisation (``moe_router_pre_softmax``) and must miss the reference by far
  more than the tolerance. An Adam step at EP 2 and at EP 1 against transformers + AdamW; a
  torch_dist checkpoint saved at EP 2 resumes at EP 1.
- Conversion through the CLI at PP x EP, bit-exact; the weight sync from an EP 2 trainer into
  SGLang engines of TP 2 and TP 1 (broadcast and tensor paths); routing replay against
  transformers forced through the same experts; one whole run with a resume.

Not here (issue 24): experts under TP (megatron-core trains them only with sequence
parallelism: refused by name), SGLang's own expert parallelism on CPU.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import engines_started_together, hf_to_megatron_shard, make_batch, training_grads
from ragen_mega.backends.megatron.launch import run_workers
from ragen_mega.models import mapping
from ragen_mega.models.hf_config import ConfigMismatchError, model_spec
from test_megatron_logits import _export_diff, hf_grads, hf_reference

ARCHS = ("qwen3_moe", "qwen2_moe")


@pytest.fixture(scope="module")
def moe_dirs(tiny_model):
    return {arch: str(tiny_model(arch)) for arch in ARCHS}


def test_moe_configs_are_read_and_dense_layers_refused(moe_dirs):
    qwen3, qwen2 = (model_spec(moe_dirs[a]) for a in ARCHS)
    assert (qwen3.num_experts, qwen3.moe_top_k, qwen3.moe_ffn_hidden_size) == (4, 2, 32)
    assert qwen3.moe_norm_topk_prob and qwen3.qk_layernorm and not qwen3.qkv_bias
    assert qwen3.shared_expert_ffn_hidden_size == 0
    assert not qwen2.moe_norm_topk_prob and qwen2.qkv_bias and not qwen2.qk_layernorm
    assert qwen2.shared_expert_ffn_hidden_size == 64
    config = json.loads((Path(moe_dirs["qwen3_moe"]) / "config.json").read_text())
    renamed = {k: v for k, v in config.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert model_spec(renamed) == qwen3                  # saved configs' name for the count
    for key, value, message in (
            ("decoder_sparse_step", 2, "decoder_sparse_step=2 (dense layers"),
            ("mlp_only_layers", [1], r"mlp_only_layers=\[1\] (dense layers"),
            ("num_experts_per_tok", 5, "num_experts_per_tok=5 exceeds num_experts=4"),
            ("moe_intermediate_size", None, r"lacks \['moe_intermediate_size'\]")):
        with pytest.raises(ConfigMismatchError, match=message.replace("(", r"\(")):
            model_spec({**config, key: value})


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_mapping_round_trips_exactly_and_checks_expert_shapes(moe_dirs, arch):
    from safetensors.torch import load_file

    spec = model_spec(moe_dirs[arch])
    hf = load_file(f"{moe_dirs[arch]}/model.safetensors")
    assert sum(".experts." in name for name in hf) == 2 * 4 * 3   # per-expert names on disk
    mapping.check_checkpoint(spec, {k: v.shape for k, v in hf.items()})
    for tp in (1, 2):
        shards = [hf_to_megatron_shard(hf, spec, rank, tp) for rank in range(tp)]
        assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in shards[0]
        back = dict(mapping.megatron_to_hf(
            [(name, [s[name] for s in shards]) for name in mapping.megatron_names(spec)], spec))
        assert back.keys() == hf.keys()
        assert all(torch.equal(back[k], hf[k]) for k in hf)
    shapes = {k: tuple(v.shape) for k, v in hf.items()}
    shapes["model.layers.0.mlp.experts.2.up_proj.weight"] = (24, 64)
    with pytest.raises(ConfigMismatchError, match="moe_intermediate_size: config says 32, "
                                                  "checkpoint tensor model.layers.0.mlp.experts.2"):
        mapping.check_checkpoint(spec, shapes)
    shapes.pop("model.layers.0.mlp.experts.2.up_proj.weight")
    with pytest.raises(ConfigMismatchError, match="lacks tensor model.layers.0.mlp.experts.2.up"):
        mapping.check_checkpoint(spec, shapes)


def moe_worker(rank, world, dirs, ids, mask, ckpt_root):
    """Per arch: log-probs, entropy, export check, the other router normalisation's log-probs,
    a torch_dist checkpoint saved and loaded into a fresh model (and refused by the other
    normalisation's), then the gradients of a training schedule."""
    from ragen_mega.backends.megatron.checkpoint import load_checkpoint, save_checkpoint
    from ragen_mega.backends.megatron.export import export_hf_state
    from ragen_mega.backends.megatron.forward import forward_logprobs
    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint
    from ragen_mega.backends.megatron.parallel import init_parallel

    init_parallel(rank, world, None)
    out = {}
    for arch, hf_dir in dirs.items():
        spec = model_spec(hf_dir)
        chunks = build_model(spec)
        load_hf_checkpoint(chunks, hf_dir)
        lp, ent = forward_logprobs(chunks, ids, mask, micro_batch_size=2)
        out[arch] = lp, ent, _export_diff(dict(export_hf_state(chunks)), hf_dir)
        other = build_model(spec, config_overrides={
            "moe_router_pre_softmax": spec.moe_norm_topk_prob})
        load_hf_checkpoint(other, hf_dir)
        out[arch, "other_router"] = forward_logprobs(other, ids, mask)[0]
        saved = save_checkpoint(f"{ckpt_root}/{arch}", 1, chunks)
        fresh = build_model(spec)                       # random experts and router
        load_checkpoint(saved, fresh)
        # the same micro-batches as ``lp``: bit equality holds only for the same batch shapes
        out[arch, "resumed"] = torch.equal(
            forward_logprobs(fresh, ids, mask, micro_batch_size=2)[0], lp)
        try:
            load_checkpoint(saved, other)
            out[arch, "refused"] = "loaded"
        except ValueError as e:
            out[arch, "refused"] = str(e)
        out[arch, "grads"] = training_grads(chunks, ids, mask, rank)[0]
    return out


def per_expert(grads: dict, spec) -> dict:
    """transformers keeps a layer's experts fused in memory ([experts, 2 x ffn, hidden] gate
    then up, [experts, hidden, ffn] down): its weights or gradients under the checkpoint's
    per-expert names, as exported."""
    out = {}
    for name, grad in grads.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            for e in range(spec.num_experts):
                gate, up = grad[e].chunk(2, dim=0)
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(spec.num_experts):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = grad[e]
        else:
            out[name] = grad
    return out


def assert_grads_close(got: dict, want: dict, label) -> None:
    """Every gradient of ``want`` (transformers', per-expert names) within 1e-4 of its largest
    entry (the sums of a backward in another order)."""
    assert got.keys() == want.keys(), label
    for name, grad in want.items():
        scale = grad.abs().max().clamp_min(1e-6)
        assert (got[name] - grad).abs().max() / scale < 1e-4, (label, name)


def assert_step_is_the_reference(metrics: dict, weights: dict, ref: dict, spec, label) -> None:
    """A Megatron actor step against ``actor_step.reference``'s: loss, gradient norm, weights."""
    ref_weights = per_expert(ref["weights"], spec)
    assert metrics["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6), label
    assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), label
    assert weights.keys() == ref_weights.keys(), label
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, ref_weights[name], atol=1e-5, rtol=0,
                                   msg=lambda msg: f"{label} {name}: {msg}")


def test_megatron_moe_matches_transformers(moe_dirs, tmp_path):
    ids, mask = make_batch(49152)
    [results] = run_workers(moe_worker, 1, moe_dirs, ids, mask, str(tmp_path), timeout=900)
    valid = mask[:, 1:].bool()
    for arch, hf_dir in moe_dirs.items():
        spec = model_spec(hf_dir)
        ref_lp, ref_ent, _ = hf_reference(hf_dir, ids, mask)
        lp, ent, (names, export_diff) = results[arch]
        assert (lp - ref_lp)[valid].abs().max() < 1e-5, arch
        assert (ent - ref_ent)[valid].abs().max() < 1e-5, arch
        assert not names and export_diff == 0.0, (arch, names, export_diff)
        miss = (results[arch, "other_router"] - ref_lp)[valid].abs().max()
        print(arch, "the other router normalisation misses by", float(miss))
        assert miss > 1e-3, (arch, float(miss))
        assert results[arch, "resumed"], arch
        assert "field 'moe_router_pre_softmax' is" in results[arch, "refused"], arch
        want = per_expert(hf_grads(hf_dir, ids, mask)[0], spec)
        assert_grads_close(results[arch, "grads"], want, arch)


def test_layouts_and_adapters_the_run_cannot_take_are_config_errors(moe_dirs, tiny_model):
    """Loading checks EP against the data-parallel ranks it splits and the micro-batching, and
    LoRA's targets against the linears adapters wrap; the start-up check reads the model and
    names the expert count EP must divide, and refuses adapters on a tied head."""
    from ragen_mega.config import load_run_config
    from ragen_mega.config_tree import ConfigError
    from ragen_mega.preflight import preflight

    for overrides, needle in (
            (["actor.ep=2"], "actor.ep: expert parallelism splits the data-parallel ranks, "
                             "so it must divide trainer.data_parallel=1, got 2"),
            (["trainer.data_parallel=2", "critic.ep=2", "critic.max_tokens_per_micro_batch=64"],
             "critic.max_tokens_per_micro_batch: with ep > 1 every expert-parallel rank"),
            (["rollout.engine_ep=2"], "rollout.engine_ep: SGLang's expert parallelism splits "
                                      "an engine's TP ranks, so it must divide engine_tp=1"),
            (["actor.lora.rank=8", "actor.lora.target_modules=[q_proj,qkv_proj]"],
             r"actor.lora.target_modules: \['qkv_proj'\] are not among the linears")):
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
            load_run_config(None, overrides)
    for path, overrides, needle in (
            (moe_dirs["qwen3_moe"], ["trainer.data_parallel=3", "actor.ep=3"],
             "actor: expert parallel size 3 does not divide num_experts=4"),
            (tiny_model("qwen2"), ["trainer.data_parallel=3", "actor.ep=3"],
             "actor: expert parallel size 3 needs a mixture of experts; model_type=qwen2 has "
             "none"),
            (moe_dirs["qwen3_moe"], ["rollout.engine_tp=3", "rollout.engine_ep=3"],
             "rollout.engine_ep: expert parallel size 3 does not divide num_experts=4"),
            (tiny_model("qwen2"), ["actor.routing_replay=true"],
             "actor.routing_replay: replays the experts a mixture of experts routed each token "
             "to; model_type=qwen2 has none"),
            (tiny_model("qwen2", tied=True), ["actor.lora.rank=8",
                                              "actor.lora.target_modules=[q_proj,lm_head]"],
             "actor.lora.target_modules: lm_head of a model with tied embeddings")):
        cfg = load_run_config(None, [f"model.path={path}", *overrides])
        with pytest.raises(ConfigError, match=needle):
            preflight(cfg)


def parallel_outputs(rank, chunks, hf_dir, ids, mask, rows) -> dict:
    """What a parallel layout must reproduce, for a model loaded from ``hf_dir``: log-probs of
    the whole batch, both exports against the checkpoint files, and the gradients of this DP
    rank's ``rows`` reduced as DDP does."""
    from ragen_mega.backends.megatron.export import export_hf_state
    from ragen_mega.backends.megatron.forward import forward_logprobs

    direct = dict(export_hf_state(chunks, dst=0))
    return {"lp": forward_logprobs(chunks, ids, mask, micro_batch_size=2)[0],
            "export": _export_diff(dict(export_hf_state(chunks)), hf_dir),
            "direct": _export_diff(direct, hf_dir) if rank == 0 else direct,
            "grads": training_grads(chunks, ids[rows], mask[rows], rank,
                                    reduce_over_dp=True)[0]}


def tp_ep_worker(rank, world, dirs, ids, mask, value_head, batch, settings, own, other):
    """TP 2 x EP 2 on four processes (DP 2; sequence parallelism, which megatron-core needs for
    experts under TP): per arch, log-probs, both exports and the gradients of rows split over
    the DP ranks; a critic's values through a given value head; qwen3_moe's routing given
    transformers' own experts and replayed through others; an actor step; then an actor step
    at PP 2 x EP 2 with the distributed optimizer."""
    from megatron.core import parallel_state as mpu

    from ragen_mega.backends.megatron.forward import forward_logprobs, forward_values
    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint
    from ragen_mega.backends.megatron.chunk import unwrap
    from ragen_mega.backends.megatron.parallel import init_parallel
    from ragen_mega.backends.megatron.routing import take_mismatch_counts
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig

    mine = slice(0, 2) if mpu.get_data_parallel_rank() == 0 else slice(2, 3)
    out = {}
    for arch, hf_dir in dirs.items():
        chunks = build_model(hf_dir)
        load_hf_checkpoint(chunks, hf_dir)
        out[arch, "sp"] = unwrap(chunks[0]).config.sequence_parallel
        out.update({(arch, k): v for k, v in parallel_outputs(rank, chunks, hf_dir, ids, mask,
                                                             mine).items()})
        critic = build_model(hf_dir, role="critic")
        load_hf_checkpoint(critic, hf_dir)
        unwrap(critic[0]).output_layer.weight.data.copy_(value_head)
        out[arch, "values"] = forward_values(critic, ids, mask, micro_batch_size=2)
    chunks = build_model(dirs["qwen3_moe"])
    load_hf_checkpoint(chunks, dirs["qwen3_moe"])
    for name, routed, replay in (("own", own, False), ("other_replayed", other, True)):
        lp = forward_logprobs(chunks, ids, mask, routed_experts=routed, routing_replay=replay)[0]
        counts = take_mismatch_counts(chunks)
        torch.distributed.all_reduce(counts)
        out[name] = lp, counts.tolist()
    for name, layout in (("tp2_ep2", dict(tp=2, ep=2)),
                         ("pp2_ep2_distopt", dict(pp=2, ep=2, use_distributed_optimizer=True))):
        init_parallel(rank, world, None, tp=layout.get("tp", 1), pp=layout.get("pp", 1), ep=2)
        trainer = MegatronTrainer(ActorConfig(**layout, **settings), dirs["qwen2_moe"],
                                  total_steps=10)
        old = trainer.compute_logprobs(batch) + batch["noise"]
        out["step", name] = (trainer.train({**batch, "old_logprobs": old}),
                             {k: v.clone() for k, v in trainer.export_hf_state()})
        del trainer
    return out


def test_experts_under_tensor_and_expert_parallelism_match_transformers(
        moe_dirs, actor_batch, actor_step):
    """TP 2 x EP 2 (experts split over EP and each expert's linears over TP, the sequence
    split over TP between layers): log-probs, the critic's values and the gradients equal
    transformers', both exports give back the checkpoint, and a StarPO actor step equals the
    transformers + AdamW step, as it does at PP 2 x EP 2 with the distributed optimizer
    (Adam's state sharded over each group's data-parallel ranks). Routing replay, where each
    TP rank routes its slice of the positions: transformers' own experts agree on every
    (token, layer), and replayed other experts give transformers' log-probs forced through
    them."""
    from transformers import AutoModelForCausalLM

    ids, mask = make_batch(49152)
    valid = mask[:, 1:].bool()
    value_head = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    _, own, _ = hf_routing(moe_dirs["qwen3_moe"], ids, mask)
    other = torch.where(own >= 0, (own + 1) % 4, own)
    forced_lp, _, _ = hf_routing(moe_dirs["qwen3_moe"], ids, mask, forced=other)
    results = run_workers(tp_ep_worker, 4, moe_dirs, ids, mask, value_head, actor_batch,
                          actor_step.settings, own, other, tp=2, ep=2, timeout=900)
    pairs = float(mask.sum() * 2) * 2    # (tokens x layers), counted by each of the 2 DP ranks
    for r in range(4):
        assert results[r]["own"][1] == [0.0, pairs]
        assert results[r]["other_replayed"][1] == [pairs, pairs]
        assert (results[r]["other_replayed"][0] - forced_lp)[valid].abs().max() < 1e-5
    for arch, hf_dir in moe_dirs.items():
        spec = model_spec(hf_dir)
        ref_lp, _, _ = hf_reference(hf_dir, ids, mask)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        with torch.no_grad():
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        ref_values = (hidden @ value_head.t()).squeeze(-1) * mask
        for r in range(4):
            assert results[r][arch, "sp"]
            assert (results[r][arch, "lp"] - ref_lp)[valid].abs().max() < 1e-5, (arch, r)
            assert (results[r][arch, "values"] - ref_values).abs().max() < 1e-4, (arch, r)
            assert results[r][arch, "export"] == (set(), 0.0), arch
        assert results[0][arch, "direct"] == (set(), 0.0)
        assert all(results[r][arch, "direct"] == {} for r in (1, 2, 3))
        want = per_expert(hf_grads(hf_dir, ids, mask)[0], spec)
        assert_grads_close(results[0][arch, "grads"], want, arch)
    hf_dir = moe_dirs["qwen2_moe"]
    ref = actor_step.reference(hf_dir, actor_batch, "token-mean")
    for name in ("tp2_ep2", "pp2_ep2_distopt"):
        assert_step_is_the_reference(*results[0]["step", name], ref, model_spec(hf_dir), name)


# --------------------------------------------------------------------- expert parallelism
def ep_worker(rank, world, dirs, ids, mask, batch, settings, ckpt_root):
    """World 2 launched at expert parallel 2 (DP 2; each rank holds 2 of the 4 experts).
    Per arch: log-probs, both exports, gradients of rows split over the ranks; then an actor
    step at EP 2 and at EP 1 (DP 2), and a second step at EP 2 against the same step resumed
    at EP 1 from the torch_dist checkpoint EP 2 saved."""
    import gc

    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint
    from ragen_mega.backends.megatron.parallel import init_parallel, parallel_info
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig

    out = {"ep": parallel_info().ep}
    # this DP rank's micro-batch for the grads: together the two of hf_grads' reference
    mine = slice(0, 2) if rank == 0 else slice(2, 3)
    for arch, hf_dir in dirs.items():
        chunks = build_model(hf_dir)
        load_hf_checkpoint(chunks, hf_dir)
        out[arch, "experts"] = sorted(n for n, _ in chunks[0].named_parameters()
                                      if "local_experts" in n and n.startswith("decoder.layers.0"))
        out.update({(arch, k): v for k, v in parallel_outputs(rank, chunks, hf_dir, ids, mask,
                                                             mine).items()})

    def step(trainer):
        old = trainer.compute_logprobs(batch) + batch["noise"]
        metrics = trainer.train({**batch, "old_logprobs": old})
        # copies: replicated weights come out as views of the live ones the next step moves
        return metrics, {k: v.clone() for k, v in trainer.export_hf_state()}

    hf_dir = dirs["qwen2_moe"]
    for ep in (2, 1):
        init_parallel(rank, world, None, ep=ep)
        trainer = MegatronTrainer(ActorConfig(ep=ep, **settings), hf_dir, total_steps=10)
        out["step", ep] = step(trainer)
        if ep == 2:
            saved = trainer.save_checkpoint(ckpt_root, 1)
            out["second", 2] = step(trainer)
        del trainer
        gc.collect()
    trainer = MegatronTrainer(ActorConfig(ep=1, **settings), hf_dir, total_steps=10)
    trainer.load_checkpoint(saved)
    out["second", 1] = step(trainer)
    return out


def test_expert_parallel_matches_transformers_and_resumes_at_another_layout(
        moe_dirs, actor_batch, actor_step, tmp_path):
    """EP 2 on two processes: every rank's log-probs and the gradients of rows split over
    the data-parallel ranks equal transformers'; both exports give back the checkpoint; a
    StarPO actor step (Adam, clipping active, KL to the reference) at EP 2 and at EP 1 equals
    the transformers + AdamW step, and the step after it at EP 2 equals that step resumed at
    EP 1 from the checkpoint EP 2 saved."""
    ids, mask = make_batch(49152)
    results = run_workers(ep_worker, 2, moe_dirs, ids, mask, actor_batch, actor_step.settings,
                          str(tmp_path), ep=2, timeout=900)
    valid = mask[:, 1:].bool()
    assert results[0]["ep"] == 2
    for arch, hf_dir in moe_dirs.items():
        spec = model_spec(hf_dir)
        # each rank holds its own two experts, under Megatron's local indices 0 and 1
        assert results[0][arch, "experts"] == results[1][arch, "experts"]
        assert {n.split(".")[6] for n in results[0][arch, "experts"]} == {"0", "1"}
        ref_lp, _, _ = hf_reference(hf_dir, ids, mask)
        for r in range(2):
            assert (results[r][arch, "lp"] - ref_lp)[valid].abs().max() < 1e-5, (arch, r)
            assert results[r][arch, "export"] == (set(), 0.0), arch
        assert results[0][arch, "direct"] == (set(), 0.0) and results[1][arch, "direct"] == {}
        want = per_expert(hf_grads(hf_dir, ids, mask)[0], spec)
        assert_grads_close(results[0][arch, "grads"], want, arch)

    hf_dir = moe_dirs["qwen2_moe"]
    ref = actor_step.reference(hf_dir, actor_batch, "token-mean")
    assert ref["grad_norm"] > actor_step.clip                    # clipping was active
    for ep in (2, 1):
        assert_step_is_the_reference(*results[0]["step", ep], ref, model_spec(hf_dir), f"ep {ep}")
    (m2, w2), (m1, w1) = results[0]["second", 2], results[0]["second", 1]
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-6)
    assert w1.keys() == w2.keys()
    for name, tensor in w2.items():
        torch.testing.assert_close(w1[name], tensor, atol=1e-6, rtol=0)
    first = results[0]["step", 2][1]
    assert all(not torch.equal(w2[name], first[name]) for name in w2)   # the step moved all


def test_conversion_round_trips_exactly_across_pipeline_and_expert_layouts(moe_dirs, tmp_path,
                                                                           capsys):
    """qwen2_moe (shared expert, biases) through the CLI: imported at TP 2 x EP 2 (four
    processes, each writing its TP shard of its own experts), exported at PP 2: the same
    bytes as the original, and transformers loads the result. Layouts the model cannot
    take are refused before any process starts, naming both numbers."""
    from transformers import AutoModelForCausalLM

    from ragen_mega.backends.megatron.convert import main
    from safetensors.torch import load_file

    hf_dir = Path(moe_dirs["qwen2_moe"])
    assert main(["hf-to-megatron", "--hf-dir", str(hf_dir), "--out-dir", str(tmp_path / "m"),
                 "--tp", "2", "--ep", "2"]) == 0
    assert main(["megatron-to-hf", "--megatron-dir", str(tmp_path / "m"), "--out-dir",
                 str(tmp_path / "hf"), "--pp", "2"]) == 0
    original, back = (load_file(f"{d}/model.safetensors") for d in (hf_dir, tmp_path / "hf"))
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert main(["hf-to-megatron", "--hf-dir", str(hf_dir), "--out-dir", str(tmp_path / "x"),
                 "--ep", "3"]) == 1
    assert "expert parallel size 3 does not divide num_experts=4" in capsys.readouterr().err


def test_expert_parallel_trainer_syncs_into_sglang_engines(moe_dirs):
    """An EP 2 trainer, whose experts live half on each rank, syncs the way the training loop
    does (every rank's shards go straight to rank 0, which streams them on) into two SGLang
    engines serving qwen3_moe: TP 2 (each expert split over two ranks) and TP 2 with EP 2
    (each rank holds two whole experts: the ``ep_native_moe`` plugin), in one broadcast
    group: streamed tensor by tensor, then in flattened buckets (a TP 1 engine and the
    colocated tensor path are the whole-loop test's). Before any sync, after each, every
    engine's greedy tokens are the trainer's own and its log-probs within 1e-4; after a train
    step and before its sync they are not."""
    from test_weight_sync_megatron import _check_engines_follow, _sync_worker

    hf_dir = moe_dirs["qwen3_moe"]
    rounds = [("distributed", None, True, 1.0), ("distributed", "flattened_bucket", False, -1.0)]
    with engines_started_together(hf_dir, {}, {"extra_args": ["--ep-size", "2"]}, tp=2,
                                  dtype="float32", cpu_threads=1) as (tp2, ep2):
        report, _ = run_workers(_sync_worker, 2, hf_dir, [tp2.url, ep2.url], rounds,
                                {"ep": 2}, ep=2, timeout=900)
    _check_engines_follow(report, rounds)
    assert len(report["v2"]["engines"]) == 2


def test_whole_loop_trains_a_mixture_of_experts_at_ep2_and_resumes(moe_dirs, tiny_run_overrides,
                                                                    tmp_path, private_ray):
    """``train`` (the real driver: Ray, a Megatron actor on two ranks at EP 2, one SGLang
    engine that returns each token's experts, the bandit) on the tiny qwen3_moe: one step
    with the engine on its own (weights broadcast), then a second run that resumes from the
    first one's checkpoint and trains step 2 with routing replay on, colocated: the engine
    shares the trainer's bundles, frees its memory for the train phase (a no-op on CPU, the
    protocol still runs) and takes the new weights through the tensor path (shared memory
    here, CUDA IPC on GPUs); its envs live in two Ray env workers, and its filter is RAGEN-2's
    ``min_p`` over the groups' mean reward (the step trains on the best groups' turns only).
    After each sync the engine's log-probs of the sampled tokens equal the trainer's; the
    engine's routing is the trainer's own (both fp32 here: ``actor/routing_mismatch`` 0); the
    resumed actor's Adam continued from step 1's state (its step-2 checkpoint counts two
    optimizer steps: a fresh optimizer would count one)."""
    from ragen_mega.config import load_run_config
    from ragen_mega.train import train

    moe = [f"model.path={moe_dirs['qwen3_moe']}", "actor.tp=1", "trainer.data_parallel=2",
           "actor.ep=2", "critic.enable=false", "algo.adv_estimator=grpo"]
    first = train(load_run_config("examples/bandit_cpu_demo.yaml",
                                  tiny_run_overrides(tmp_path, 1) + moe))
    resumed = train(load_run_config("examples/bandit_cpu_demo.yaml",
                                    tiny_run_overrides(tmp_path, 2) + moe
                                    + ["actor.routing_replay=true", "trainer.colocate=true",
                                       "rollout.env_workers=2", "filter.strategy=min_p",
                                       "filter.min_p=1.0", "filter.metric=reward",
                                       "filter.mode=largest", "filter.loss_scaling=linear",
                                       "trainer.resume=force"]))  # a changed config, on purpose
    assert [h["step"] for h in first + resumed] == [1, 2]
    for h in first + resumed:
        assert h["actor/update_successful"] == 1.0
        assert h["sync/max_logprob_diff"] < 1e-3, h["sync/max_logprob_diff"]
        assert h["train/rollout_vs_trainer_logprob_diff"] < 1e-3
        print("routing mismatch", h["actor/routing_mismatch"])
        assert h["actor/routing_mismatch"] == 0.0
    actor = tmp_path / "checkpoints" / "actor"
    assert [torch.load(actor / f"step_{s}" / "ragen_state.pt", weights_only=False)
            ["optimizer_steps"] for s in (1, 2)] == [1, 2]
    h = resumed[0]
    assert h["filter/kept_groups"] >= 1 and h["filter/chosen_score"] >= h["filter/score"]
    assert h["train/batch_samples"] == 2 * h["filter/kept_groups"]  # 2 one-turn episodes each
    log = (tmp_path / "logs" / "engine_0.log").read_text()
    first_run, second_run = log.split("SGLang server pid")[1:]   # one server per run
    assert "/update_weights_from_distributed" in first_run
    for endpoint in ("/release_memory_occupation", "/resume_memory_occupation",
                     "/update_weights_from_tensor"):
        assert endpoint in second_run, f"the colocated engine's log shows no {endpoint} call"
    assert "/update_weights_from_distributed" not in second_run


def test_the_qwen3_30b_a3b_example_fits_the_model_and_the_nodes(tmp_path):
    """The multi-node MoE example against Qwen3-30B-A3B's real shape: its PP and EP split the
    layers and experts, the start-up check passes, and its 32 actor ranks are 4 nodes x 8."""
    from ragen_mega.config import load_run_config
    from ragen_mega.models.known_configs import known_config
    from ragen_mega.preflight import check_model_layout
    from ragen_mega.ray.placement import plan_resources

    # the Hub's config.json of Qwen3-30B-A3B (no weights needed to check a layout)
    (tmp_path / "config.json").write_text(json.dumps(known_config("Qwen3-30B-A3B")))
    example = "examples/ragen_sokoban_qwen3_30b_a3b_multinode.yaml"
    cfg = load_run_config(example, [f"model.path={tmp_path}"])
    check_model_layout(cfg)
    spec = model_spec(tmp_path)
    assert (spec.num_experts, spec.moe_top_k, spec.moe_norm_topk_prob) == (128, 8, True)
    assert mapping.local_experts(spec, 7, cfg.actor.ep) == range(112, 128)
    plan = plan_resources(cfg, cluster_cpus=4 * 64, host_cpus=64, use_gpu=True)
    assert plan.actor_world == 32 and plan.critic_world == 0


# --------------------------------------------------------------------- routing replay
def hf_routing(hf_dir, ids, mask, forced=None):
    """transformers' log-probs, each token's top-k experts [B, S, layers, k] (-1 past each
    row's length) and the gradients of minus the log-probs' sum (per-expert names);
    ``forced``: route through these experts instead (the router's own softmax probabilities at
    them, renormalised as ``norm_topk_prob`` says), an independent replay."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    b, s = ids.shape
    chosen = []
    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate

        def route(hidden, gate=gate, i=i):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            index = torch.topk(probs, gate.top_k, dim=-1).indices
            if forced is not None:     # tokens without given experts (padding) keep their own
                given = forced[:, :, i].reshape(b * s, -1).long()
                index = torch.where(given >= 0, given, index)
            chosen.append(index.detach().reshape(b, s, -1))
            value = probs.gather(1, index)
            if gate.norm_topk_prob:
                value = value / value.sum(dim=-1, keepdim=True)
            return logits, value.to(logits.dtype), index

        gate.forward = route
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    lp = lp * mask[:, 1:]
    (-lp.sum()).backward()
    routed = torch.stack(chosen, dim=2)
    routed[~mask.bool()] = -1
    grads = per_expert({n: p.grad for n, p in model.named_parameters()}, model_spec(hf_dir))
    return lp.detach(), routed.to(torch.int16), grads


def replay_worker(rank, world, hf_dir, ids, mask, own, other):
    """Megatron's log-probs and routing-mismatch counts: routing on its own, given
    transformers' experts (counted, not replayed), given other experts (counted, then
    replayed); then the gradients of minus the log-probs' sum, replayed through the others."""
    from ragen_mega.backends.megatron.export import export_hf_state
    from ragen_mega.backends.megatron.forward import (forward_logprobs, make_forward_step,
                                                      run_schedule, split_microbatches)
    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint
    from ragen_mega.backends.megatron.routing import take_mismatch_counts

    chunks = build_model(hf_dir)
    load_hf_checkpoint(chunks, hf_dir)
    out = {}
    for name, routed, replay in (("alone", None, False), ("own", own, False),
                                 ("other", other, False), ("other_replayed", other, True)):
        out[name] = (forward_logprobs(chunks, ids, mask, routed_experts=routed,
                                      routing_replay=replay)[0],
                     take_mismatch_counts(chunks).tolist())
    step = make_forward_step(compute_entropy=False, routing_replay=True,
                             loss_fn=lambda outputs, mb: (-outputs["logprobs"].sum(), {}))
    run_schedule(chunks, split_microbatches(ids, mask, len(ids), routed_experts=other), step,
                 forward_only=False)
    for param in chunks[0].parameters():
        param.data = param.grad
    out["grads"] = dict(export_hf_state(chunks))
    return out


def test_routing_replay_routes_through_the_given_experts(moe_dirs):
    """With transformers' own top-k as the engine's routing, Megatron's routing agrees on every
    (token, layer) and the log-probs are transformers'. Given other experts (each one shifted
    by one), every pair is counted as differing; not replayed, the log-probs stay the model's
    own; replayed, they and the gradients (the router's too) are those of transformers forced
    through the same experts, and far from the model's own."""
    hf_dir = moe_dirs["qwen3_moe"]
    ids, mask = make_batch(49152)
    valid = mask[:, 1:].bool()
    ref_lp, own, _ = hf_routing(hf_dir, ids, mask)
    other = torch.where(own >= 0, (own + 1) % 4, own)
    forced_lp, forced, forced_grads = hf_routing(hf_dir, ids, mask, forced=other)
    assert torch.equal(forced, other)     # (-1 past each row: those are masked alike)
    [out] = run_workers(replay_worker, 1, hf_dir, ids, mask, own, other, timeout=600)
    pairs = float(mask.sum() * 2)                        # tokens x layers
    assert out["alone"][1] == [0.0, 0.0]                 # nothing to compare with
    assert out["own"][1] == [0.0, pairs]
    assert out["other"][1] == [pairs, pairs] == out["other_replayed"][1]
    for name in ("alone", "own", "other"):
        assert (out[name][0] - ref_lp)[valid].abs().max() < 1e-5, name
    assert (out["other_replayed"][0] - forced_lp)[valid].abs().max() < 1e-5
    assert (forced_lp - ref_lp)[valid].abs().max() > 1e-2
    assert_grads_close(out["grads"], forced_grads, "replayed")
    assert forced_grads["model.layers.1.mlp.gate.weight"].abs().max() > 0   # router trained


# --------------------------------------------------------------------- load balancing
AUX = 0.5   # large enough to move the router's gradient far beyond the tolerance


def hf_grads_with_load_balancing(hf_dir, ids, coeff):
    """transformers' gradients of training_grads' loss plus megatron-core's load-balancing loss
    worked by hand from the router logits: per MoE layer and micro-batch of T tokens,
    coeff * E / (k * T^2) * sum_e (sum_t softmax(logits)_te) * (tokens routed to e), summed
    over layers; each micro-batch's total divided by the schedule's 2 micro-batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    spec = model_spec(hf_dir)
    e, k = spec.num_experts, spec.moe_top_k
    for rows in ((0, 1), (2,)):                    # split_microbatches(.., 2) of three rows
        out = model(input_ids=ids[list(rows)], output_router_logits=True)
        logp = torch.log_softmax(out.logits[:, :-1].float(), -1)
        entropy = -(logp.exp() * logp).sum(-1)
        target = ids[list(rows), 1:, None]
        loss = -(logp.gather(-1, target).sum() + 0.1 * entropy.sum())
        for logits in out.router_logits:
            probs = torch.softmax(logits.float(), dim=-1)
            tokens = torch.zeros(e).index_add_(0, probs.topk(k, dim=-1).indices.reshape(-1),
                                               torch.ones(probs.shape[0] * k))
            t = probs.shape[0]
            loss = loss + coeff * e / (k * t * t) * (probs.sum(0) * tokens).sum()
        (loss / 2).backward()
    return per_expert({n: p.grad for n, p in model.named_parameters()}, spec)


def load_balancing_worker(rank, world, hf_dir, ids, mask, settings):
    """Gradients with the load-balancing loss the trainer configures, and the trainer's own
    Megatron config for it."""
    from megatron.core.utils import get_model_config

    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig

    trainer = MegatronTrainer(ActorConfig(moe_aux_loss_coeff=AUX, **settings), hf_dir)
    config = get_model_config(trainer.model[0])
    chunks = build_model(hf_dir, config_overrides=trainer._moe_settings())
    load_hf_checkpoint(chunks, hf_dir)
    return ((config.moe_router_load_balancing_type, config.moe_aux_loss_coeff),
            training_grads(chunks, ids, mask, rank)[0])


def test_load_balancing_loss_is_megatron_cores_switch_loss(moe_dirs, actor_step):
    """``actor.moe_aux_loss_coeff``: the trainer's model gets megatron-core's aux loss, whose
    gradients (on rows without padding) are those of the hand-worked Switch loss added to the
    model's loss, and move the router's far from its gradient without it."""
    hf_dir = moe_dirs["qwen3_moe"]
    ids, mask = make_batch(49152, lengths=[9, 9, 9])
    [(setting, got)] = run_workers(load_balancing_worker, 1, hf_dir, ids, mask,
                                   actor_step.settings, timeout=600)
    assert setting == ("aux_loss", AUX)
    want = hf_grads_with_load_balancing(hf_dir, ids, AUX)
    without = per_expert(hf_grads(hf_dir, ids, mask)[0], model_spec(hf_dir))
    assert_grads_close(got, want, "load balancing")
    router = "model.layers.1.mlp.gate.weight"
    assert (want[router] - without[router]).abs().max() > 1e-2 * want[router].abs().max()
