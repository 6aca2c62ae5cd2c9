"""``ragen-mega plan``: every example fits the hardware its header names; an impossible layout
exits 2 naming the rank (or engine, or host) and the shortfall; the weight counts equal
transformers' own models of the published configs; and the per-rank estimates agree with
Megatron-LM's theoretical-memory formula, implemented here from its published source."""
from __future__ import annotations

import math
import pathlib
import re
from types import SimpleNamespace

import pytest
import torch

from ragen_mega.models.hf_config import model_spec
from ragen_mega.models.known_configs import KNOWN_CONFIGS, known_config
from ragen_mega.plan import (GiB, load_plan_config, main, sequence_length, stage_weights,
                             total_weights, trainer_memory)

ROOT = pathlib.Path(__file__).parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_fits_the_hardware_its_header_names(path, capsys):
    """Each example's header names its hardware (``# Hardware: ...``) and the plan, read from
    that line, places every rank and finds that each fits."""
    assert re.search(r"^# Hardware: ", path.read_text(), re.M), f"{path.name} names no hardware"
    assert main([str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "the config's '# Hardware:' line" in out


def test_gpu_examples_train_in_bf16():
    """The GPU examples (those whose header names GPUs) train the actor and the critic in bf16
    and serve bf16 weights: fp32 would take twice the memory and the slow kernels."""
    for path in EXAMPLES:
        if re.search(r"^# Hardware: \d+ nodes? x", path.read_text(), re.M):
            cfg, _, _ = load_plan_config(str(path), [])
            roles = ("actor", "critic") if cfg.critic.enable else ("actor",)
            assert all(getattr(cfg, r).bf16 for r in roles), path.name
            assert cfg.model.dtype == "bfloat16", path.name


def _fails(argv, capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_a_layout_with_more_ranks_than_gpus_exits_2(capsys):
    """Actor TP 4 x PP 2 (8), critic TP 4 (4), 4 engines x TP 2 (8): 20 GPUs, counted by hand,
    on 2 x 8."""
    err = _fails(["examples/qwen2.5_7b_multinode.yaml", "rollout.engine_tp=2"], capsys)
    assert "needs 20 GPUs" in err and "the hardware has 16" in err


def test_an_engine_across_two_nodes_exits_2(capsys):
    """12 trainer GPUs, then engines of 2: on nodes of 5 GPUs, engine 1 gets GPUs 14 and 15,
    one on node 2 (10-14), one on node 3 (15-19)."""
    err = _fails(["examples/qwen2.5_7b_multinode.yaml", "rollout.engine_tp=2", "--nodes", "4",
                  "--gpus-per-node", "5"], capsys)
    assert "engine 1 (GPUs [14, 15]) straddles nodes [2, 3]" in err


def test_a_rank_that_does_not_fit_exits_2_naming_it_and_the_shortfall(capsys):
    """On 24 GiB GPUs the 7B actor's first stage is the first that does not fit: the message
    names the rank, its place, what it needs and of what, and the parts, which sum to it."""
    err = _fails(["examples/qwen2.5_7b_multinode.yaml", "--gpu-mem", "24GiB"], capsys)
    m = re.search(r"actor rank 0 \(tp 0, pp 0, dp 0\) \(node 0, GPU 0\): needs ([\d.]+) GiB "
                  r"of 24\.0 GiB: weights ([\d.]+), gradients ([\d.]+), optimizer ([\d.]+) .*"
                  r"activations ([\d.]+), logits ([\d.]+)", err)
    assert m, err
    need, *parts = map(float, m.groups())
    assert need > 24 and abs(sum(parts) - need) <= 0.25


def test_an_engine_without_room_for_one_sequence_exits_2(capsys):
    """Qwen2.5-7B's bf16 weights are 15.2 GB (14.2 GiB) on a TP-1 engine: a static share of
    0.17 x 80 GiB = 13.6 GiB leaves nothing for the KV cache."""
    err = _fails(["examples/qwen2.5_7b_multinode.yaml", "rollout.mem_fraction=0.17"], capsys)
    assert "engine 0 (TP 1) (node 1, GPU 4): its weights 14.2 GiB leave 0.0 GiB" in err


def test_a_cpu_run_larger_than_the_host_exits_2(capsys):
    err = _fails(["examples/long_horizon_crafter_cpu_demo.yaml", "--mem", "4GiB"], capsys)
    assert re.search(r"host: needs [\d.]+ GiB of 4\.0 GiB", err), err


def test_no_hardware_named_is_an_error_naming_the_flags(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("critic:\n  enable: false\nalgo:\n  adv_estimator: grpo\n")
    err = _fails([str(config), "--nodes", "1"], capsys)
    assert "--gpus-per-node, --gpu-mem" in err


@pytest.mark.parametrize("name", sorted(KNOWN_CONFIGS))
def test_weight_counts_equal_transformers_models(name):
    """``total_weights`` against transformers' own model of each published config (built on
    the meta device: no memory), and the pipeline stages' weights on TP 1 add up to it (plus
    the head's copy of a tied embedding when the last stage is not the first)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = known_config(f"/models/{name}")
    hf = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    spec = model_spec(config)
    assert total_weights(spec) == sum(p.numel() for p in model.parameters())
    pp = 4
    padding = (spec.padded_vocab(1) - spec.vocab_size) * spec.hidden_size
    stages = sum(sum(stage_weights(spec, "actor", 1, pp, 1, s)) for s in range(pp))
    head_copy = spec.vocab_size * spec.hidden_size if spec.tie_word_embeddings else 0
    assert stages == total_weights(spec) + 2 * padding + head_copy


# ------------------------------------------------------- Megatron-LM's theoretical memory
# An independent implementation of NVIDIA/Megatron-LM megatron/training/theoretical_memory_usage.py
# (commit 00caa53af30912914981c86f39db123961678bbd): compute_weight_and_optimizer_memory and
# compute_activation_memory_without_sp, the activation formula Megatron-LM applies when sequence
# parallelism with selective recompute is not on (this trainer runs dense models without either).
# Vocabulary padding as Megatron-LM's _vocab_size_with_padding: a multiple of 128 x TP.
def megatron_padded_vocab(vocab: int, tp: int) -> int:
    return math.ceil(vocab / (128 * tp)) * 128 * tp


def megatron_weight_and_optimizer(a) -> float:
    """Bytes of the most loaded shard's weights, gradients and optimizer state."""
    q_ratio = a.kv_channels * a.num_attention_heads / a.hidden_size
    self_attn = 2 * a.hidden_size * a.hidden_size * (
        (1 + a.num_query_groups / a.num_attention_heads) * q_ratio)
    if a.num_experts is None:
        layer = 2 * a.hidden_size * (a.ffn_hidden_size * 3 / 2 + 1) + self_attn
    else:
        layer = 2 * a.hidden_size * (a.moe_ffn_hidden_size * a.num_experts * 3 / 2 + 1) \
            + self_attn
    embedding = a.hidden_size * a.padded_vocab_size
    block = layer * a.num_layers + a.hidden_size
    shard = (block / a.pipeline_model_parallel_size + embedding) / a.tensor_model_parallel_size
    if a.untie_embeddings_and_output_weights and a.pipeline_model_parallel_size == 1:
        shard += embedding / a.tensor_model_parallel_size
    per = 18 if not a.use_distributed_optimizer else 6 + 12 / a.data_parallel_size
    return shard * per


def megatron_activation_layers(a) -> float:
    """The transformer layers' part of compute_activation_memory_without_sp on the first stage:
    sbh (10 + 24 / t) bytes per layer, all L layers (L / pp layers x pp micro-batches in
    flight), without the 5% overhead."""
    return a.seq_length * a.micro_batch_size * a.hidden_size * (
        10 + 24 / a.tensor_model_parallel_size) * a.num_layers


def megatron_args(spec, section, cfg, seq_len: int, **changes) -> SimpleNamespace:
    a = SimpleNamespace(
        hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size, num_layers=spec.num_layers,
        num_experts=spec.num_experts or None, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        padded_vocab_size=megatron_padded_vocab(spec.vocab_size, section.tp),
        untie_embeddings_and_output_weights=not spec.tie_word_embeddings,
        tensor_model_parallel_size=section.tp, pipeline_model_parallel_size=section.pp,
        data_parallel_size=cfg.trainer.data_parallel,
        use_distributed_optimizer=section.use_distributed_optimizer,
        seq_length=seq_len, micro_batch_size=section.micro_batch_size)
    a.__dict__.update(changes)
    return a


GPU_EXAMPLES = ["qwen2.5_7b_multinode.yaml", "ragen_sokoban_qwen2.5_0.5b.yaml"]


@pytest.mark.parametrize("example", GPU_EXAMPLES)
def test_weights_and_optimizer_agree_with_megatrons_formula(example):
    """The most loaded actor rank's weights + gradients + optimizer state against Megatron-LM's
    formula (bf16 weights, fp32 gradients, 12 bytes of Adam state a weight, sharded over DP by
    the distributed optimizer). The formula leaves out the q/k/v biases; so within 1%."""
    cfg, spec, _ = load_plan_config(f"examples/{example}", [])
    seq, _ = sequence_length(cfg)
    ours_static = max(m.weights + m.gradients + m.optimizer for m in (
        trainer_memory(spec, cfg, "actor", s, seq) for s in range(cfg.actor.pp)))
    theirs = megatron_weight_and_optimizer(megatron_args(spec, cfg.actor, cfg, seq))
    print(f"{example}: weights+optimizer plan {ours_static / GiB:.2f} GiB, Megatron-LM "
          f"{theirs / GiB:.2f} GiB ({ours_static / theirs:.4f})")
    assert ours_static == pytest.approx(theirs, rel=0.01)


def test_layer_activations_against_megatrons_formula():
    """Megatron-LM's activation formula is Korthikanti et al.'s for a GPT layer (multi-head
    attention, a 4h GeLU MLP, dropout masks), with fused kernels. The plan describes that shape
    (KV heads = heads, a SwiGLU MLP of 8h/3: as many weights as GeLU's 4h) and splits into the
    formula's parts. Replicated over TP (the norms' inputs and outputs): equal, once the
    formula's two 1-byte dropout masks are taken out (the trainer runs without dropout). Split
    over TP: the formula's 24h bytes (Q, K, V, the attention output; fc1's output and the
    activation's) plus what this trainer's unfused kernels keep besides, each counted by
    hand: the rotated Q and K beside the QKV output that V's view keeps alive (2h values), and
    Megatron's ``glu``'s SiLU output and ``x_linear + glu_linear_offset`` (2 x 8h/3 values)."""
    import dataclasses

    from ragen_mega.plan import layer_activation_values

    spec = model_spec(known_config("Qwen2.5-7B-Instruct"))
    h = spec.hidden_size
    gpt = dataclasses.replace(spec, num_kv_heads=spec.num_heads, ffn_hidden_size=8 * h / 3)
    one, two = (2 * layer_activation_values(gpt, tp, fused_norm=True) for tp in (1, 2))  # bytes
    split = 2 * (one - two)
    replicated = one - split
    a = SimpleNamespace(seq_length=1, micro_batch_size=1, hidden_size=h, num_layers=1)
    formula = {t: megatron_activation_layers(SimpleNamespace(**vars(a),
                                                             tensor_model_parallel_size=t))
               for t in (1, 2)}
    formula_split = 2 * (formula[1] - formula[2])
    masks = 2 * h
    assert replicated == pytest.approx(formula[1] - formula_split - masks, rel=1e-12)
    assert split == pytest.approx(formula_split + 2 * (2 * h + 2 * 8 * h / 3), rel=1e-12)


@pytest.mark.parametrize("example", GPU_EXAMPLES)
def test_first_stage_activations_beside_megatrons_formula(example):
    """For the record (the numbers docs/cluster.md quotes): the first stage's layer
    activations of the example's actor on its real shape (GQA, a SwiGLU of 5.3-5.4h) against
    Megatron-LM's formula for its TP, PP, micro-batch and sequence; the plan is the larger,
    never the smaller, as the parts above say it must be."""
    cfg, spec, _ = load_plan_config(f"examples/{example}", [])
    seq, _ = sequence_length(cfg)
    a = cfg.actor
    ours = trainer_memory(spec, cfg, "actor", 0, seq).activations
    ours -= 2 * spec.hidden_size * a.micro_batch_size * seq * a.pp   # the embedding's output
    formula = megatron_activation_layers(megatron_args(spec, a, cfg, seq))
    print(f"{example}: first-stage layer activations plan {ours / GiB:.2f} GiB, Megatron-LM "
          f"{formula / GiB:.2f} GiB ({ours / formula:.2f}x)")
    assert ours > formula


# ------------------------------------------------------- against what autograd keeps
def _saved_for_backward(rank, world_size, hf_dir, rows, seq):
    """Bytes of the tensors autograd saves in one actor train step (one micro-batch), the
    model's own parameters left out: what the plan's activations and logits estimate."""
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig

    trainer = MegatronTrainer(ActorConfig(micro_batch_size=rows, lr=1e-6), hf_dir,
                              total_steps=10)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 49152, (rows, seq), generator=g),
             "attention_mask": torch.ones(rows, seq, dtype=torch.long),
             "loss_mask": torch.ones(rows, seq), "advantages": torch.randn(rows, seq, generator=g)}
    batch["old_logprobs"] = trainer.compute_logprobs(batch)
    params = {p.untyped_storage().data_ptr() for c in trainer.model for p in c.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        trainer.train(batch)
    return sum(saved.values())


def test_cpu_activations_and_logits_are_what_autograd_saves(smollm2_dir):
    """The plan's activations and logits of a SmolLM2 actor rank (local layer spec, fp32)
    against the bytes autograd actually saves in a train step of Megatron on the CPU: the sum
    of every saved tensor's storage, counted once, parameters left out."""
    from ragen_mega.backends.megatron.launch import run_workers
    from ragen_mega.config import load_run_config

    rows, seq = 2, 192
    [saved] = run_workers(_saved_for_backward, 1, str(smollm2_dir), rows, seq, timeout=900)
    cfg = load_run_config(None, ["critic.enable=false", "algo.adv_estimator=grpo",
                                 f"actor.micro_batch_size={rows}"])
    m = trainer_memory(model_spec(smollm2_dir), cfg, "actor", 0, seq, gpu=False)
    print(f"saved for backward {saved / GiB:.3f} GiB, plan {(m.activations + m.logits) / GiB:.3f}")
    assert m.activations + m.logits == pytest.approx(saved, rel=0.03)


def test_lora_adapter_count_equals_peft():
    """``lora_weights`` on TP 1 (every adapter whole) against PEFT's own adapters on
    transformers' Qwen2.5-0.5B (meta device): the trainable weights of ``get_peft_model``."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from ragen_mega.backends.megatron.config import LoraConfig
    from ragen_mega.plan import lora_weights

    config = known_config("Qwen2.5-0.5B-Instruct")
    lora = LoraConfig(rank=8)
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)),
                               PeftLoraConfig(r=8, target_modules=list(lora.target_modules)))
    peft_count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_weights(model_spec(config), 1, 1, 1, lora) == peft_count
