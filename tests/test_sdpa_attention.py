"""The local spec's fused SDPA core attention against Megatron's unfused DotProductAttention.

One 2-process launch (gloo) builds a tiny grouped-query Qwen2 (4 heads, 2 KV heads) both ways at
TP=1 (the two ranks are data-parallel replicas) and TP=2 (one KV head per rank), on right-padded
rows of different lengths cut into trimmed micro-batches as the trainer feeds them: log-probs,
entropies and the gradients of a loss through both must agree to fp32 rounding. That the logits
also equal transformers' with SDPA on is ``test_megatron_logits`` (SDPA is the default).
"""
from __future__ import annotations

import pytest
import torch

from conftest import make_batch, training_grads
from ragen_mega.backends.megatron.launch import run_workers


def _attention_worker(rank, world, hf_dir, ids, mask):
    from ragen_mega.backends.megatron.forward import forward_logprobs
    from ragen_mega.backends.megatron.chunk import unwrap
    from ragen_mega.backends.megatron.model import build_model, load_hf_checkpoint
    from ragen_mega.backends.megatron.parallel import init_parallel

    out = {}
    for tp in (1, 2):
        init_parallel(rank, world, None, tp=tp)
        for attention in ("sdpa", "unfused"):
            chunks = build_model(hf_dir, local_attention=attention)
            load_hf_checkpoint(chunks, hf_dir)
            core = unwrap(chunks[0]).decoder.layers[0].self_attention.core_attention
            lp, ent = forward_logprobs(chunks, ids, mask, micro_batch_size=2)
            grads, _ = training_grads(chunks, ids, mask, rank)
            out[(tp, attention)] = (type(core).__name__, lp, ent, grads)
    return out


@pytest.mark.slow
def test_sdpa_matches_unfused_attention_tp1_tp2(tiny_model):
    hf_dir = str(tiny_model("qwen2"))
    ids, mask = make_batch(49152)                    # lengths 9, 5, 7, right padded
    results = run_workers(_attention_worker, 2, hf_dir, ids, mask, timeout=600)
    for rank, out in enumerate(results):
        for tp in (1, 2):
            name, lp, ent, grads = out[(tp, "sdpa")]
            ref_name, ref_lp, ref_ent, ref_grads = out[(tp, "unfused")]
            assert (name, ref_name) == ("SDPAttention", "DotProductAttention")
            assert lp.abs().sum() > 0 and torch.all(lp[1, 4:] == 0)   # padding stays 0
            torch.testing.assert_close(lp, ref_lp, atol=2e-6, rtol=0)
            torch.testing.assert_close(ent, ref_ent, atol=2e-6, rtol=0)
            if rank == 0:                                # the exporting rank holds the grads
                assert set(grads) == set(ref_grads)
                for key, g in grads.items():
                    scale = ref_grads[key].abs().max().item()
                    assert (g - ref_grads[key]).abs().max() <= 1e-5 * max(scale, 1e-3), key
                assert any(g.abs().max() > 0 for k, g in grads.items() if "k_proj" in k)


def test_local_attention_choice_is_validated(tiny_model):
    from ragen_mega.config import ActorConfig, ConfigError
    from ragen_mega.backends.megatron.transformer_config import layer_spec
    from ragen_mega.models.hf_config import model_spec

    with pytest.raises(ValueError, match="local_attention must be one of"):
        layer_spec(model_spec(tiny_model("qwen2")), use_te=False, local_attention="flash")
    with pytest.raises(ConfigError, match="local_attention"):
        ActorConfig(local_attention="flash").validate()
