"""``ragen-mega plan CONFIG [key=value ...]``: a run's layout and memory, checked without a GPU.

It resolves the config as ``train`` does, places the actor's and critic's ranks and the SGLang
engines with the run's own placement (``ray/placement.py``: trainer bundles first, engines after
them unless colocated; Ray's PACK fills a node before the next, so bundle ``i`` sits on node
``i // gpus_per_node``), and estimates what each GPU holds:

- a trainer rank (Megatron DDP + Megatron's Adam, ``backends/megatron/train.py``): weights in the
  trainer's dtype (``actor.bf16``); gradients in fp32 (``grad_reduce_in_fp32``); Adam's two
  moments and, in bf16, the fp32 master copy (12 bytes a weight in bf16, 8 in fp32), sharded over
  the data-parallel ranks with ``use_distributed_optimizer`` (experts' over DP / EP); the
  activations a backward needs (no recompute, no dropout, unfused RoPE and SwiGLU: see
  :func:`layer_activation_values`) for the micro-batches a 1F1B pipeline stage holds; on the
  last stage of an actor the logits (:data:`LOGIT_BYTES`); a reference copy for ``kl_coef > 0``;
- an engine: its weights' shard in ``model.dtype``, and SGLang's KV cache in what
  ``rollout.mem_fraction`` (``--mem-fraction-static``) leaves of the GPU's free memory.

The model's shape comes from ``model.path``'s config.json, or, for the Hub models the examples
name, their published one (``models/known_configs.py``). The hardware comes from the flags, else
the config's ``# Hardware:`` line (``2 nodes x 8 GPUs of 80 GiB``, or ``CPU, 16 GiB of RAM``:
every process then shares the host's memory, :func:`host_need`). Exit 2 names the rank and its
shortfall when something does not fit or cannot be placed. The estimate counts tensors, not the
CUDA context, NCCL's buffers or allocator fragmentation (docs/cluster.md, "plan").
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from ragen_mega.config import RunConfig, load_run_config
from ragen_mega.config_tree import ConfigError, load_yaml, parse_overrides
from ragen_mega.models.hf_config import ModelSpec, model_spec
from ragen_mega.models.known_configs import known_config

GiB = 1 << 30
#: a run whose prompts have no token limit (agent.max_prompt_tokens) is sized with this many
#: prompt tokens a turn shown (system text and observation); --seq-len sets the length instead
PROMPT_TOKENS_PER_TURN = 256
#: bytes a logit costs on the actor's last stage during its backward: the logits in the
#: trainer's dtype, their fp32 exponentials kept for the backward (forward.py's
#: ``_VocabParallelLogprobs``) and the gradient cast back to the logits' dtype: 2 + 4 + 2 in bf16,
#: 4 + 4 in fp32 (the cast is the same tensor)
LOGIT_BYTES = 8
#: SGLang's KV cache on a CPU engine: --max-total-tokens (backends/sglang/server.py)
CPU_KV_TOKENS = 32768

_HARDWARE = re.compile(r"^#\s*Hardware:\s*(?:(?P<nodes>\d+) nodes? x (?P<gpus>\d+) GPUs? of "
                       r"(?P<gpu_mem>[\d.]+ *\w+)|CPU, (?P<ram>[\d.]+ *\w+) of RAM)", re.M)
_UNITS = {"gib": GiB, "g": GiB, "gb": 10**9, "mib": 1 << 20, "mb": 10**6, "tib": 1 << 40}


@dataclasses.dataclass(frozen=True)
class Hardware:
    device: str          # "gpu" or "cpu"
    nodes: int
    gpus_per_node: int   # 0 on CPU
    mem: int             # bytes of each GPU; on CPU, of the host
    source: str          # where it was read

    def describe(self) -> str:
        if self.device == "cpu":
            return f"CPU, {_gib(self.mem)} GiB of RAM ({self.source})"
        return (f"{self.nodes} node{'s' * (self.nodes > 1)} x {self.gpus_per_node} GPUs of "
                f"{_gib(self.mem)} GiB ({self.source})")


def parse_size(text: str) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"512MiB"`` -> bytes (G = GiB)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]+)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is no memory size; write e.g. 80GiB, 80GB or 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


# ----------------------------------------------------------------------- the model's sizes
def layer_weights(spec: ModelSpec, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) weights of one decoder layer on one TP / EP rank."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    dense = ((h * (q + 2 * kv) + q * h + spec.qkv_bias * (q + 2 * kv)) // tp + 2 * h
             + spec.qk_layernorm * 2 * d)
    if not spec.is_moe:
        return dense + 3 * h * spec.ffn_hidden_size // tp, 0
    shared = spec.shared_expert_ffn_hidden_size
    dense += h * spec.num_experts + 3 * h * shared // tp + (h if shared else 0)
    return dense, spec.num_experts // ep * 3 * h * spec.moe_ffn_hidden_size // tp


def stage_weights(spec: ModelSpec, role: str, tp: int, pp: int, ep: int,
                  stage: int) -> tuple[int, int]:
    """(dense, expert) weights of pipeline stage ``stage`` on one TP / EP rank: its layers, the
    embedding on the first stage, the final norm and the head (the actor's vocabulary, also when
    tied and the last stage is not the first; the critic's value head) on the last."""
    dense, expert = (n * spec.num_layers // pp for n in layer_weights(spec, tp, ep))
    vocab = spec.padded_vocab(tp) // tp * spec.hidden_size
    if stage == 0:
        dense += vocab
    if stage == pp - 1:
        dense += spec.hidden_size
        if role == "critic":
            dense += spec.hidden_size
        elif not spec.tie_word_embeddings or pp > 1:
            dense += vocab
    return dense, expert


def total_weights(spec: ModelSpec) -> int:
    """The whole model's weights (an engine's, before its TP split; vocabulary unpadded)."""
    dense, expert = layer_weights(spec, 1, 1)
    embed = spec.vocab_size * spec.hidden_size
    return ((dense + expert) * spec.num_layers + spec.hidden_size
            + embed * (1 if spec.tie_word_embeddings else 2))


def layer_activation_values(spec: ModelSpec, tp: int, fused_norm: bool) -> float:
    """Values one token keeps for the backward in one decoder layer on one TP rank, as the
    trainer's layer runs (no recompute, no dropout, fused attention: no seq x seq scores),
    counted from the tensors autograd saves (measured on the CPU, docs/cluster.md "plan"):

    - each of the two norms: its input, the normalised values and the scaled output (the next
      linear's input): 3h; TransformerEngine's fused norm-and-linear (``fused_norm``, the GPU
      layer spec) keeps the input and the output: 2h. Replicated over TP, split under sequence
      parallelism (which megatron-core runs for a mixture of experts under TP);
    - attention: the fused QKV output (q + 2kv, alive through V's view), the rotated Q and K
      (RoPE unfused: q + kv) and the attention output (q): (3q + 3kv) / tp, plus Qwen3's q/k
      norms (their input and output: 2 (q + kv) / tp);
    - the SwiGLU MLP (Megatron's ``glu``): fc1's output (2 ffn), SiLU's output, the linear
      half plus ``glu_linear_offset`` (a new tensor) and their product (fc2's input): 5 ffn / tp;
      a mixture of experts keeps the router's scores and, for each of its k experts, the
      permuted input and the output before the weighted sum (2h) with the expert's 5 ffn."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    sp = tp if spec.is_moe and tp > 1 else 1
    values = ((4 if fused_norm else 6) * h / sp + (3 * q + 3 * kv) / tp
              + spec.qk_layernorm * 2 * (q + kv) / tp)
    if not spec.is_moe:
        return values + 5 * spec.ffn_hidden_size / tp
    k = spec.moe_top_k
    return (values + spec.num_experts / sp + k * (2 * h + 5 * spec.moe_ffn_hidden_size / tp) / sp
            + 5 * spec.shared_expert_ffn_hidden_size / tp)


# ----------------------------------------------------------------------- memory
@dataclasses.dataclass(frozen=True)
class TrainerMemory:
    """Bytes one trainer rank holds at its peak (the backward of its first micro-batch)."""
    weights: int
    gradients: int
    optimizer: int              # as configured
    optimizer_replicated: int   # without the distributed optimizer
    optimizer_distributed: int  # with it
    activations: int
    logits: int
    reference: int              # the KL reference's weights (actor.kl_coef > 0)

    @property
    def static(self) -> int:
        """What stays between steps: weights, gradients, optimizer, reference."""
        return self.weights + self.gradients + self.optimizer + self.reference

    @property
    def total(self) -> int:
        return self.static + self.activations + self.logits

    def describe(self) -> str:
        parts = [f"weights {_gib(self.weights)}", f"gradients {_gib(self.gradients)}",
                 f"optimizer {_gib(self.optimizer)} (distributed: "
                 f"{_gib(self.optimizer_distributed)}, replicated: "
                 f"{_gib(self.optimizer_replicated)})",
                 f"activations {_gib(self.activations)}", f"logits {_gib(self.logits)}"]
        if self.reference:
            parts.append(f"reference {_gib(self.reference)}")
        return ", ".join(parts)


def trainer_memory(spec: ModelSpec, cfg: RunConfig, role: str, stage: int, seq_len: int,
                   gpu: bool = True) -> TrainerMemory:
    """One ``role`` rank of pipeline stage ``stage`` (every TP / DP rank of a stage alike);
    ``gpu``: the TransformerEngine layer spec (not with LoRA), else the local one."""
    s = getattr(cfg, role)
    dp = cfg.trainer.data_parallel
    wbytes = 2 if s.bf16 else 4
    dense, expert = stage_weights(spec, role, s.tp, s.pp, s.ep, stage)
    trained_dense, trained_expert = dense, expert
    lora = s.lora
    if lora.rank:   # only the adapters (and a critic's value head) train
        trained_dense, trained_expert = lora_weights(spec, s.tp, s.pp, s.ep, lora), 0
        trained_dense += spec.hidden_size if role == "critic" and stage == s.pp - 1 else 0
    per = 12 if s.bf16 else 8   # Adam's two moments (+ the fp32 master weights in bf16)
    replicated = (trained_dense + trained_expert) * per
    distributed = int(trained_dense * per / dp + trained_expert * per / (dp // s.ep))
    tokens = s.max_tokens_per_micro_batch or s.micro_batch_size * seq_len
    in_flight = s.pp - stage
    if s.vpp:   # Megatron-LM's interleaved-schedule factor (theoretical_memory_usage.py)
        in_flight *= 1 + (s.pp - 1) / (s.pp * s.vpp)
    values = layer_activation_values(spec, s.tp, gpu and not lora.rank) * spec.num_layers / s.pp
    values += spec.hidden_size if stage == 0 else 0   # the embedding's output
    last = role == "actor" and stage == s.pp - 1
    reference = ((dense + expert) * wbytes if role == "actor" and s.kl_coef and not lora.rank
                 else 0)
    return TrainerMemory(
        weights=(dense + expert) * wbytes + (trained_dense * wbytes if lora.rank else 0),
        gradients=(trained_dense + trained_expert) * 4,
        optimizer=distributed if s.use_distributed_optimizer else replicated,
        optimizer_replicated=replicated, optimizer_distributed=distributed,
        activations=int(values * tokens * in_flight * wbytes),
        logits=tokens * spec.padded_vocab(s.tp) // s.tp * LOGIT_BYTES if last else 0,
        reference=reference)


def lora_weights(spec: ModelSpec, tp: int, pp: int, ep: int, lora) -> int:
    """Adapter weights of one rank: ``rank x (in + out)`` per wrapped linear (an upper bound:
    one of the two is split over TP)."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    ffn, copies = ((spec.moe_ffn_hidden_size, spec.num_experts // ep) if spec.is_moe
                   else (spec.ffn_hidden_size, 1))
    dims = {"q_proj": (h + q, 1), "k_proj": (h + kv, 1), "v_proj": (h + kv, 1),
            "o_proj": (q + h, 1), "gate_proj": (h + ffn, copies), "up_proj": (h + ffn, copies),
            "down_proj": (ffn + h, copies)}
    per_layer = sum(lora.rank * n * c for n, c in (dims[t] for t in lora.target_modules
                                                  if t in dims))
    head = lora.rank * (h + spec.padded_vocab(tp) // tp) if "lm_head" in lora.target_modules else 0
    return per_layer * spec.num_layers // pp + head


@dataclasses.dataclass(frozen=True)
class EngineMemory:
    """One GPU (or, on CPU, one engine) of an SGLang engine."""
    weights: int
    kv_per_token: int
    budget: int       # weights + KV cache: SGLang's static share of what was free at its start
    fraction: float
    fraction_source: str

    @property
    def kv_cache(self) -> int:
        return self.budget - self.weights

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_cache) // self.kv_per_token


def sglang_default_fraction(gpu_mem: int, tp: int) -> float:
    """SGLang's --mem-fraction-static when none is given (sglang 0.5's
    ``arg_groups/memory_hook.py``): (memory - reserve) / memory, the reserve being 512 MiB,
    1.5 MiB per token of a >= 2048-token prefill chunk and tp / 8 GiB, at least 10 GiB on a GPU
    over 60 GiB."""
    reserve = 512 * (1 << 20) + 2048 * 1.5 * (1 << 20) + tp / 8 * GiB
    if gpu_mem > 60 * GiB:
        reserve = max(reserve, 10 * GiB)
    return round((gpu_mem - reserve) / gpu_mem, 3)


def engine_memory(spec: ModelSpec, cfg: RunConfig, hw: Hardware, occupied: int) -> EngineMemory:
    """One engine GPU's share, ``occupied`` bytes of it held by a colocated trainer rank."""
    tp = cfg.rollout.engine_tp
    ebytes = 2 if cfg.model.dtype == "bfloat16" else 4
    kv_heads = max(1, spec.num_kv_heads // tp)   # fewer KV heads than ranks: replicated
    kv = 2 * spec.num_layers * kv_heads * spec.head_dim * ebytes
    weights = total_weights(spec) * ebytes // tp
    if hw.device == "cpu":
        return EngineMemory(weights, kv, weights + CPU_KV_TOKENS * kv, 1.0,
                            f"CPU: --max-total-tokens {CPU_KV_TOKENS}")
    fraction, source = cfg.rollout.mem_fraction, "rollout.mem_fraction"
    if fraction is None:
        fraction, source = sglang_default_fraction(hw.mem, tp), "SGLang's default, estimated"
    return EngineMemory(weights, kv, int(fraction * (hw.mem - occupied)), fraction, source)


# ----------------------------------------------------------------------- the plan
def sequence_length(cfg: RunConfig) -> tuple[int, str]:
    """Tokens of the longest training row, and how it was found."""
    new = cfg.rollout.max_new_tokens
    if cfg.agent.max_prompt_tokens:
        return (cfg.agent.max_prompt_tokens + new,
                "agent.max_prompt_tokens + rollout.max_new_tokens")
    memory = cfg.agent.memory_turns
    turns = cfg.env.max_turns if memory is None else min(memory + 1, cfg.env.max_turns)
    return (turns * (PROMPT_TOKENS_PER_TURN + new),
            f"assumed: {turns} turn(s) of {PROMPT_TOKENS_PER_TURN} prompt + {new} new tokens, "
            f"agent.max_prompt_tokens unset; --seq-len sets it")


@dataclasses.dataclass
class Slot:
    """One device (or, on CPU, one process) and what it holds."""
    what: str
    where: str
    trainer: TrainerMemory | None = None
    engine: EngineMemory | None = None


class PlanError(Exception):
    """The layout cannot be placed, or a rank does not fit."""


def plan(cfg: RunConfig, spec: ModelSpec, hw: Hardware, seq_len: int) -> list[Slot]:
    """Every trainer rank and engine with its place and memory; PlanError on the first that
    cannot be placed or does not fit."""
    from ragen_mega.ray.placement import plan_resources

    gpu = hw.device == "gpu"
    try:
        res = plan_resources(cfg, cluster_cpus=os.cpu_count() or 1, host_cpus=os.cpu_count() or 1,
                             use_gpu=gpu)
    except ValueError as e:
        raise PlanError(f"layout: {e}") from e
    placement = res.placement
    where = {}
    if gpu:
        devices = sum(1 for b in placement.bundles if b.get("GPU"))
        have = hw.nodes * hw.gpus_per_node
        if devices > have:
            raise PlanError(f"layout: needs {devices} GPUs ({res.actor_world} actor ranks, "
                            f"{res.critic_world} critic ranks, {cfg.rollout.num_engines} "
                            f"engines x TP {cfg.rollout.engine_tp}"
                            f"{', colocated' if cfg.trainer.colocate else ''}); the hardware "
                            f"has {have}")
        where = {b: divmod(b, hw.gpus_per_node) for b in range(devices)}
    slots: list[Slot] = []
    static = {}
    for role, world, bundles in (("actor", res.actor_world, res.actor_bundles),
                                 ("critic", res.critic_world, res.critic_bundles)):
        s = getattr(cfg, role)
        for rank, bundle in zip(range(world), bundles):
            tp_rank, dp_rank, stage = rank % s.tp, rank // s.tp % cfg.trainer.data_parallel, \
                rank // (s.tp * cfg.trainer.data_parallel)
            mem = trainer_memory(spec, cfg, role, stage, seq_len, gpu)
            static[bundle] = mem.static
            node_gpu = f"node {where[bundle][0]}, GPU {where[bundle][1]}" if gpu else "host"
            slots.append(Slot(f"{role} rank {rank} (tp {tp_rank}, pp {stage}, dp {dp_rank})",
                              node_gpu, trainer=mem))
    for e, bundles in enumerate(placement.engine_bundles):
        nodes = sorted({where[b][0] for b in bundles}) if gpu else []
        if len(nodes) > 1:
            raise PlanError(f"engine {e} (GPUs {bundles}) straddles nodes {nodes}: an SGLang "
                            f"TP group runs on one node (rollout.engine_tp <= GPUs per node, "
                            f"and the trainer's GPUs before it must leave a node's rest whole)")
        occupied = max((static.get(b, 0) for b in bundles), default=0)
        mem = engine_memory(spec, cfg, hw, occupied)
        gpus = [where[b][1] for b in bundles] if gpu else []
        place = (f"node {nodes[0]}, GPU {gpus[0]}" + (f"-{gpus[-1]}" if len(gpus) > 1 else "")
                 if gpu else "host")
        slots.append(Slot(f"engine {e} (TP {cfg.rollout.engine_tp})", place, engine=mem))
    _check_fit(slots, hw, seq_len)
    return slots


def host_need(slots: list[Slot]) -> int:
    """A CPU run's peak on its one host: every process's static memory (trainer ranks' weights,
    gradients and optimizer; engines' weights and KV cache) and, on top, the activations and
    logits of the role that trains (actor and critic train one after the other)."""
    peaks = [sum(s.trainer.total - s.trainer.static for s in slots
                 if s.trainer and s.what.startswith(role)) for role in ("actor", "critic")]
    return (sum(s.trainer.static for s in slots if s.trainer)
            + sum(s.engine.budget for s in slots if s.engine) + max(peaks))


def _check_fit(slots: list[Slot], hw: Hardware, seq_len: int) -> None:
    """PlanError on the first engine without KV room for one sequence, then the first trainer
    rank over its GPU's memory (on CPU: the host's peak over its RAM)."""
    for slot in slots:
        if slot.engine is not None and slot.engine.kv_tokens < seq_len:
            m = slot.engine
            raise PlanError(f"{slot.what} ({slot.where}): its weights {_gib(m.weights)} GiB "
                            f"leave {_gib(max(0, m.kv_cache))} GiB of its {_gib(m.budget)} GiB "
                            f"({m.fraction_source} {m.fraction}) for the KV cache, less than one "
                            f"{seq_len}-token sequence ({_gib(seq_len * m.kv_per_token)} GiB)")
    if hw.device == "cpu":
        need = host_need(slots)
        if need > hw.mem:
            static = sum(s.trainer.static for s in slots if s.trainer)
            engines = sum(s.engine.budget for s in slots if s.engine)
            raise PlanError(f"host: needs {_gib(need)} GiB of {_gib(hw.mem)} GiB: trainer ranks' "
                            f"weights, gradients and optimizer {_gib(static)}, engines "
                            f"{_gib(engines)}, the larger role's activations and logits "
                            f"{_gib(need - static - engines)}")
        return
    for slot in slots:
        if slot.trainer is not None and slot.trainer.total > hw.mem:
            raise PlanError(f"{slot.what} ({slot.where}): needs {_gib(slot.trainer.total)} GiB "
                            f"of {_gib(hw.mem)} GiB: {slot.trainer.describe()}")


# ----------------------------------------------------------------------- the command
def _raw_model_path(config: str | None, overrides: list[str]) -> str | None:
    """``model.path`` as written (the last override, else the file's)."""
    given = parse_overrides(overrides).get("model", {})
    if isinstance(given, dict) and "path" in given:
        return str(given["path"])
    tree = load_yaml(Path(config).read_text()) if config else None
    model = tree.get("model") if isinstance(tree, dict) else None
    return str(model["path"]) if isinstance(model, dict) and "path" in model else None


def load_plan_config(config: str | None, overrides: list[str]) -> tuple[RunConfig, ModelSpec, str]:
    """The run config, the model's spec and where the spec came from. A ``model.path`` that is
    not a local directory but is in ``known_configs`` is planned from its published config."""
    from ragen_mega.models.prepare import PRESETS, is_hub_id, resolve_model

    try:
        cfg = load_run_config(config, overrides)
    except ConfigError as e:
        raw = _raw_model_path(config, overrides)
        known = known_config(raw) if raw and str(e).startswith("model.path:") else None
        if known is None:
            raise
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(known))
            cfg = load_run_config(config, [*overrides, f"model.path={tmp}"])
        cfg.model.path = raw
        return cfg, model_spec(known), (f"{raw}: not here; the published config.json of "
                                        f"{Path(raw).name} (ragen_mega/models/known_configs.py)")
    path = cfg.model.path
    if path not in PRESETS and not (Path(path) / "config.json").is_file() and is_hub_id(path):
        return cfg, *_hub_config(path)   # a plan reads the config, never the weights
    path = resolve_model(path)
    return cfg, model_spec(path), f"{path}/config.json"


def _hub_config(repo_id: str) -> tuple[ModelSpec, str]:
    """A hub model's spec: its cached snapshot's config.json, else the published one of
    ``known_configs``, else its config.json alone from the hub."""
    from huggingface_hub import hf_hub_download

    from ragen_mega.models.prepare import hub_snapshot

    local = hub_snapshot(repo_id, download=False)
    if local is not None:
        return model_spec(local), f"{local}/config.json"
    known = known_config(repo_id)
    if known is not None:
        return model_spec(known), (f"the published config.json of {repo_id} "
                                   f"(ragen_mega/models/known_configs.py)")
    try:
        path = hf_hub_download(repo_id, "config.json")
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, no network: all said the same
        raise ConfigError(f"model.path: {repo_id!r}: its config.json is neither cached nor "
                          f"downloadable ({type(e).__name__}: {e})") from e
    return model_spec(path), f"{path} (from the hub)"


def hardware(args, config: str | None) -> Hardware:
    """The flags' hardware, the rest from the config's ``# Hardware:`` line."""
    m = _HARDWARE.search(Path(config).read_text()) if config else None
    device = args.device or ("cpu" if m and m.group("ram") else "gpu")
    if device == "cpu":
        size = args.mem or (m.group("ram") if m and m.group("ram") else None)
        if size is None:
            raise ValueError("--device cpu needs --mem (the host's RAM) or a '# Hardware: CPU, "
                             "N GiB of RAM' line in the config")
        return Hardware("cpu", 1, 0, parse_size(size),
                        "--mem" if args.mem else "the config's '# Hardware:' line")
    header = m if m and m.group("nodes") else None
    missing = [flag for flag, value in (("--nodes", args.nodes),
                                        ("--gpus-per-node", args.gpus_per_node),
                                        ("--gpu-mem", args.gpu_mem)) if value is None]
    if missing and header is None:
        raise ValueError(f"name the hardware: {', '.join(missing)}, or a '# Hardware: N nodes x "
                         f"G GPUs of M GiB' line in the config")
    nodes = args.nodes or int(header.group("nodes"))
    gpus = args.gpus_per_node or int(header.group("gpus"))
    mem = parse_size(args.gpu_mem or header.group("gpu_mem"))
    source = "flags" if not missing else ("the config's '# Hardware:' line" if len(missing) == 3
                                          else "flags and the config's '# Hardware:' line")
    return Hardware("gpu", nodes, gpus, mem, source)


def report(cfg: RunConfig, spec: ModelSpec, source: str, hw: Hardware, seq_len: int,
           seq_source: str, slots: list[Slot]) -> str:
    """What ``plan`` prints: the model, hardware and layout, then one row per GPU (on CPU, per
    process) with its memory in GiB."""
    lines = [f"model: {spec.arch}, {spec.num_layers} layers, hidden {spec.hidden_size}, "
             f"{spec.num_heads} heads / {spec.num_kv_heads} KV, "
             + (f"{spec.num_experts} experts of {spec.moe_ffn_hidden_size} (top {spec.moe_top_k})"
                if spec.is_moe else f"MLP {spec.ffn_hidden_size}")
             + f", vocab {spec.vocab_size}: {total_weights(spec) / 1e9:.2f}B weights ({source})",
             f"hardware: {hw.describe()}",
             f"sequence: {seq_len} tokens a row ({seq_source})"]
    dp = cfg.trainer.data_parallel
    for role in ("actor", "critic") if cfg.critic.enable else ("actor",):
        s = getattr(cfg, role)
        lines.append(f"{role}: TP {s.tp} x PP {s.pp}{f' (VPP {s.vpp})' if s.vpp else ''} x DP "
                     f"{dp}{f' (EP {s.ep})' if s.ep > 1 else ''}, {'bf16' if s.bf16 else 'fp32'}"
                     f", micro-batch {s.micro_batch_size} rows, "
                     f"{'distributed' if s.use_distributed_optimizer else 'replicated'} optimizer")
    lines.append(f"engines: {cfg.rollout.num_engines} x TP {cfg.rollout.engine_tp}, "
                 f"{cfg.model.dtype}, {'colocated' if cfg.trainer.colocate else 'disaggregated'}")
    lines.append("")
    lines.append(f"{'what':<36} {'where':<18} GiB: {'weights':>7} {'grads':>6} "
                 f"{'optim':>6} {'(dist.':>6} {'repl.)':>6} {'activ.':>6} {'logits':>6} "
                 f"{'KV':>6} {'total':>6}")
    for slot in slots:
        t, e = slot.trainer, slot.engine
        cells = ([t.weights + t.reference, t.gradients, t.optimizer, t.optimizer_distributed,
                  t.optimizer_replicated, t.activations, t.logits, None, t.total] if t else
                 [e.weights, None, None, None, None, None, None, e.kv_cache, e.budget])
        lines.append(f"{slot.what:<36} {slot.where:<18}      "
                     + " ".join(f"{'' if c is None else _gib(c):>{w}}" for c, w in
                                zip(cells, (7, 6, 6, 6, 6, 6, 6, 6, 6))))
        if e:
            lines[-1] += f"   ({e.kv_tokens} KV tokens; {e.fraction_source}" + (
                f" {e.fraction})" if hw.device == "gpu" else ")")
    if hw.device == "cpu":
        lines.append(f"host: {_gib(host_need(slots))} GiB of {_gib(hw.mem)} GiB at the peak (every "
                     f"process's weights, gradients, optimizer and engine memory, and the larger "
                     f"role's activations and logits)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``ragen-mega plan CONFIG [key=value ...] [--nodes N --gpus-per-node G --gpu-mem 80GiB]``"""
    parser = argparse.ArgumentParser(
        prog="ragen-mega plan", description="The run's layout (TP x PP x DP (x EP) of actor and "
        "critic, engines, which rank on which node and GPU) and a per-GPU memory estimate, "
        "without a GPU. Exit 2 names the rank and its shortfall when something does not fit.")
    parser.add_argument("config", help="YAML config file (see examples/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.tp=2")
    parser.add_argument("--nodes", type=int, help="nodes (default: the config's '# Hardware:')")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per node")
    parser.add_argument("--gpu-mem", help="memory of each GPU, e.g. 80GiB")
    parser.add_argument("--device", choices=("gpu", "cpu"),
                        help="cpu: every process in one host's RAM (--mem)")
    parser.add_argument("--mem", help="the host's RAM with --device cpu, e.g. 16GiB")
    parser.add_argument("--seq-len", type=int, help="tokens of the longest training row")
    args = parser.parse_args(argv)
    try:
        cfg, spec, source = load_plan_config(args.config, args.overrides)
        hw = hardware(args, args.config)
    except (ConfigError, ValueError, OSError) as e:
        print(f"ragen-mega plan: {e}", file=sys.stderr)
        return 2
    seq_len, seq_source = ((args.seq_len, "--seq-len") if args.seq_len
                           else sequence_length(cfg))
    try:
        slots = plan(cfg, spec, hw, seq_len)
    except PlanError as e:
        print(f"ragen-mega plan: does not fit: {e}", file=sys.stderr)
        return 2
    print(report(cfg, spec, source, hw, seq_len, seq_source, slots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
