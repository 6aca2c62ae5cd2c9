"""HF <-> Megatron mapping as pure tensor functions: round trips, hand-worked layouts, config checks.

The HF side comes from transformers itself (``from_config`` state dicts), so names and shapes
are not taken from the code under test.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from conftest import hf_to_megatron_shard
from ragen_mega.models import mapping
from ragen_mega.models.hf_config import ConfigMismatchError, ModelSpec, model_spec
from ragen_mega.models.mapping import check_checkpoint

# 8 heads / 4 KV heads allow TP=4; vocab 200 is padded (256 at TP 1-2, 512 at TP 4); 4 layers
# allow PP=2 with 2 virtual chunks. qwen3's head_dim 16 != hidden / heads = 8 (kv_channels).
ARCH_CASES = [("llama", True), ("qwen2", False), ("qwen3", True), ("qwen3", False)]


def hf_config(arch: str, tied: bool, **changes) -> dict:
    cfg = dict(model_type=arch, vocab_size=200, hidden_size=64, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=4, intermediate_size=96,
               max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=tied,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "qwen3":
        cfg["head_dim"] = 16
    cfg.update(changes)
    return cfg


def hf_state(cfg: dict) -> dict[str, torch.Tensor]:
    """Random HF state dict with transformers' own names and shapes (tied weights once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {}
    for name, p in model.named_parameters():  # named_parameters skips the tied lm_head
        state[name] = torch.randn_like(p)
    return state


@pytest.fixture(scope="module")
def states():
    return {case: hf_state(hf_config(*case)) for case in ARCH_CASES}


def shard_everything(state, spec, tp, pp, vpp):
    """Global Megatron name -> list of TP shards, from every (pp rank, vp stage, tp rank)."""
    shards: dict[str, list] = {}
    for pp_rank, vp_stage in itertools.product(range(pp), range(vpp or 1)):
        stage = vp_stage if vpp else None
        offset = mapping.chunk_layers(spec, pp_rank, pp, vpp, stage).start
        for tp_rank in range(tp):
            chunk = hf_to_megatron_shard(state, spec, tp_rank, tp, pp_rank, pp, vpp=vpp,
                                         vp_stage=stage)
            for local, tensor in chunk.items():
                name = mapping.to_global(local, offset)
                shards.setdefault(f"{name}@{pp_rank}" if name == "output_layer.weight"
                                  and spec.tie_word_embeddings else name, []).append(tensor)
    return shards


@pytest.mark.parametrize("arch,tied", ARCH_CASES)
def test_round_trip_bit_exact(states, arch, tied):
    state = states[(arch, tied)]
    spec = model_spec(hf_config(arch, tied))
    layouts = [(tp, pp, None) for tp in (1, 2, 4) for pp in (1, 2)] + [(2, 2, 2)]
    for tp, pp, vpp in layouts:
        shards = shard_everything(state, spec, tp, pp, vpp)
        tied_copy = shards.pop(f"output_layer.weight@{pp - 1}", None)
        assert (tied_copy is not None) == (tied and pp > 1), (tp, pp, vpp)
        if tied_copy is not None:  # the last stage's copy of the embedding, vocab-split
            assert torch.equal(torch.cat(tied_copy)[:200], state["model.embed_tokens.weight"])
        for name, parts in shards.items():
            assert len(parts) == tp, (name, tp, pp)
            if name.startswith("embedding") or name == "output_layer.weight":
                assert sum(p.shape[0] for p in parts) == spec.padded_vocab(tp)
        assert set(shards) == set(mapping.megatron_names(spec))
        back = dict(mapping.megatron_to_hf(shards.items(), spec))
        assert set(back) == set(state), (tp, pp, vpp, set(back) ^ set(state))
        for name, tensor in state.items():
            assert torch.equal(back[name], tensor), (name, tp, pp, vpp)


def test_fused_layouts_match_hand_built_example():
    """4 query heads, 2 KV groups, head_dim 1, hidden 1: the rows are the head labels."""
    spec = ModelSpec(arch="qwen2", num_layers=1, hidden_size=1, num_heads=4, num_kv_heads=2,
                     head_dim=1, ffn_hidden_size=4, vocab_size=3, tie_word_embeddings=True,
                     rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=8,
                     qkv_bias=True, qk_layernorm=False, vocab_divisor=2)
    col = lambda *v: torch.tensor(v, dtype=torch.float32).reshape(-1, 1)  # noqa: E731
    q, k, v = col(10, 11, 12, 13), col(20, 21), col(30, 31)   # q heads 0-3, k/v groups 0-1
    gate, up = col(40, 41, 42, 43), col(50, 51, 52, 53)
    state = {
        "model.embed_tokens.weight": col(1, 2, 3), "model.norm.weight": col(0).flatten(),
        "model.layers.0.input_layernorm.weight": torch.ones(1),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(1),
        "model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v,
        "model.layers.0.self_attn.q_proj.bias": -q.flatten(),
        "model.layers.0.self_attn.k_proj.bias": -k.flatten(),
        "model.layers.0.self_attn.v_proj.bias": -v.flatten(),
        "model.layers.0.self_attn.o_proj.weight": torch.tensor([[60., 61., 62., 63.]]),
        "model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up,
        "model.layers.0.mlp.down_proj.weight": torch.tensor([[70., 71., 72., 73.]]),
    }
    full = hf_to_megatron_shard(state, spec, 0, 1)
    qkv = "decoder.layers.0.self_attention.linear_qkv."
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1
    assert full[qkv + "weight"].flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert full[qkv + "bias"].tolist() == [-10, -11, -20, -30, -12, -13, -21, -31]
    assert full["decoder.layers.0.mlp.linear_fc1.weight"].flatten().tolist() == \
        [40, 41, 42, 43, 50, 51, 52, 53]
    # padded to 16 rows, a multiple of divisor 2 x 8 (the same for TP 1, 2, 4, 8)
    assert full["embedding.word_embeddings.weight"].flatten().tolist() == [1, 2, 3] + [0] * 13
    r0, r1 = (hf_to_megatron_shard(state, spec, r, 2) for r in (0, 1))
    assert r0[qkv + "weight"].flatten().tolist() == [10, 11, 20, 30]
    assert r1[qkv + "weight"].flatten().tolist() == [12, 13, 21, 31]
    assert r0["decoder.layers.0.mlp.linear_fc1.weight"].flatten().tolist() == [40, 41, 50, 51]
    assert r1["decoder.layers.0.mlp.linear_fc1.weight"].flatten().tolist() == [42, 43, 52, 53]
    assert r0["decoder.layers.0.self_attention.linear_proj.weight"].tolist() == [[60, 61]]
    assert r1["decoder.layers.0.mlp.linear_fc2.weight"].tolist() == [[72, 73]]
    assert r0["embedding.word_embeddings.weight"].flatten().tolist() == [1, 2, 3] + [0] * 5
    assert r1["embedding.word_embeddings.weight"].flatten().tolist() == [0] * 8  # all padding
    assert r1["decoder.layers.0.input_layernorm.weight"].tolist() == [1]


def test_pipeline_placement_matches_megatron_interleaving():
    spec = model_spec(hf_config("llama", False, num_hidden_layers=8))
    assert list(mapping.chunk_layers(spec, 1, 2)) == [4, 5, 6, 7]
    # interleaved: chunk c of rank r holds layers (c * pp + r) * per_chunk ...
    assert [list(mapping.chunk_layers(spec, r, 2, 2, c)) for r in (0, 1) for c in (0, 1)] == \
        [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert mapping.owner("decoder.layers.5.mlp.linear_fc2.weight", spec, 2, 2) == (0, 1)
    assert mapping.owner("output_layer.weight", spec, 2, 2) == (1, 1)
    assert mapping.chunk_has_embedding(0, 2, 2, 0) and not mapping.chunk_has_embedding(0, 2, 2, 1)
    assert mapping.chunk_has_head(1, 2, 2, 1) and not mapping.chunk_has_head(1, 2, 2, 0)


def test_transformer_engine_names_are_read_as_the_local_specs():
    """The TE layer spec's fused pre-norms and its grouped-GEMM experts (``TEGroupedMLP``: one
    ``weight{j}`` per local expert in the layer's grouped linear) under the local spec's names,
    which then take the chunk's layer and expert offsets like any other."""
    name = mapping.local_spec_name
    assert name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.0.input_layernorm.weight"
    assert name("decoder.layers.2.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.2.pre_mlp_layernorm.weight"
    assert name("decoder.layers.1.mlp.experts.linear_fc1.weight0") == \
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    grouped = name("decoder.layers.1.mlp.experts.linear_fc2.weight11")
    assert grouped == "decoder.layers.1.mlp.experts.local_experts.11.linear_fc2.weight"
    assert mapping.to_global(grouped, 2, 16) == \
        "decoder.layers.3.mlp.experts.local_experts.27.linear_fc2.weight"
    for unchanged in ("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
                      "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
                      "decoder.layers.1.mlp.router.weight", "output_layer.weight"):
        assert name(unchanged) == unchanged


def test_mismatched_checkpoint_is_refused_naming_the_field(states):
    state = states[("qwen2", False)]
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    check_checkpoint(model_spec(hf_config("qwen2", False)), shapes)  # the matching config passes

    wrong_kv = model_spec(hf_config("qwen2", False, num_key_value_heads=2))
    with pytest.raises(ConfigMismatchError, match=r"num_key_value_heads: config says 2, checkpoint "
                       r"tensor model\.layers\.0\.self_attn\.k_proj\.(weight|bias) has shape .* "
                       r"implying 4"):
        check_checkpoint(wrong_kv, shapes)
    with pytest.raises(ConfigMismatchError, match="intermediate_size: config says 128"):
        check_checkpoint(model_spec(hf_config("qwen2", False, intermediate_size=128)), shapes)
    with pytest.raises(ConfigMismatchError, match="vocab_size: config says 300"):
        check_checkpoint(model_spec(hf_config("qwen2", False, vocab_size=300)), shapes)
    with pytest.raises(ConfigMismatchError, match="num_hidden_layers: config says 3"):
        check_checkpoint(model_spec(hf_config("qwen2", False, num_hidden_layers=3)), shapes)
    with pytest.raises(ConfigMismatchError, match=r"lacks tensor lm_head\.weight.*tie_word_embeddings"):
        untied = {k: v for k, v in shapes.items() if k != "lm_head.weight"}
        check_checkpoint(model_spec(hf_config("qwen2", False)), untied)
    with pytest.raises(ConfigMismatchError, match=r"q_norm"):  # a qwen2 checkpoint, qwen3 config
        check_checkpoint(model_spec(hf_config("qwen3", False, head_dim=8)), shapes)


def test_unsupported_configs_are_refused_naming_the_key():
    with pytest.raises(ConfigMismatchError, match="rope_type='llama3'"):
        model_spec(hf_config("llama", True, rope_parameters={"rope_type": "llama3",
                                                             "rope_theta": 5e5, "factor": 8.0}))
    with pytest.raises(ConfigMismatchError, match="model_type='gpt2'"):
        model_spec(hf_config("gpt2", True))
    with pytest.raises(ConfigMismatchError, match="use_sliding_window"):
        model_spec(hf_config("qwen2", True, use_sliding_window=True))
    old_style = hf_config("qwen2", True, rope_theta=1e6)
    del old_style["rope_parameters"]
    assert model_spec(old_style).rope_theta == 1e6
    spec = model_spec(hf_config("qwen3", True))
    assert (spec.head_dim, spec.qk_layernorm, spec.qkv_bias) == (16, True, False)
    assert model_spec(hf_config("qwen2", True)).qkv_bias
    with pytest.raises(ValueError, match="num_key_value_heads=4"):
        spec.check_parallel(tp=8)
    with pytest.raises(ValueError, match="num_hidden_layers=4"):
        spec.check_parallel(pp=3)


def test_padded_vocab_rule():
    spec = dataclasses.replace(model_spec(hf_config("qwen2", True)), vocab_size=151936)
    # one padded size for TP 1, 2, 4, 8 (152576 = 149 x 1024), so checkpoints move across them
    assert {spec.padded_vocab(tp) for tp in (1, 2, 4, 8)} == {152576}
    assert spec.padded_vocab(3) == 153600 and 153600 % (128 * 3) == 0
