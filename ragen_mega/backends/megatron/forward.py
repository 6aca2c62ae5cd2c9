"""Forward passes of the Megatron chunks: per-token log-probs + entropy (actor), values (critic).

Log-probs are aligned with the next token: for right-padded ``input_ids`` [B, S],
``logprobs[b, t] = log p(input_ids[b, t+1] | tokens <= t)``, shape [B, S-1], 0 past each row's
length, on every rank (the last pipeline stage broadcasts them). Values are [B, S]: the
critic's value after reading token t.

Vocab-parallel (:class:`_VocabParallelLogprobs`): the LM head's logits stay split over TP ranks
(``parallel_output=True``), reduced only as [b, s] tensors, never gathered over the vocabulary;
padded vocab columns (ids >= vocab_size) are left out of the softmax, so log-probs equal
transformers' even when TP forces padding (docs/design.md, "The Megatron trainer").

Training: each micro-batch is a dict with at least ``input_ids`` [b, s] (right padded, trimmed)
and ``attention_mask``; any other [b, ...] tensors in it (sliced by ``split_microbatches``)
reach ``loss_fn(outputs, batch)`` unchanged, where ``outputs`` is ``{"logprobs": [b, s-1],
"entropy": [b, s-1] | None}`` (actor) or ``{"values": [b, s]}`` (critic), still attached to the
graph. ``loss_fn`` returns what Megatron's schedule accepts: ``(loss, metrics_dict)`` (the
schedule divides loss by num_microbatches IN PLACE) or ``(loss, num_tokens, metrics_dict)``
(divided by num_tokens unless ``config.calculate_per_token_loss``). ``run_schedule(...,
forward_only=False)`` returns the last stage's metrics dicts.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ragen_mega.backends.megatron.chunk import unwrap
from ragen_mega.backends.megatron.routing import set_engine_routing
from ragen_mega.backends.megatron.parallel import local_device


#: values (tokens x vocab) of one block of the log-prob work's fp32 temporaries: on the CPU
#: 16 MiB, under glibc's largest mmap threshold (32 MiB), so each block reuses the last one's
#: memory instead of faulting in fresh pages (benchmarks/README.md, bench_logprobs.py); on a GPU
#: the caching allocator reuses any size, and larger blocks launch fewer kernels
BLOCK_VALUES = {"cpu": 1 << 22, "cuda": 1 << 26}


def vocab_parallel_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                                    vocab_size: int, temperature: float = 1.0,
                                    compute_entropy: bool = True, tp_group=None,
                                    block_rows: int | None = None):
    """Log-prob of ``targets`` and entropy of softmax(logits / T) from this rank's vocab slice.

    ``logits`` [..., V_local] (any float dtype, never modified; the math is fp32) hold global
    vocab ids [rank * V_local, (rank + 1) * V_local); ``targets`` [...] global ids. Returns fp32
    tensors of ``targets``' shape (entropy or None), differentiable in ``logits``.
    ``block_rows``: tokens per block (default: the device type's :data:`BLOCK_VALUES` a block).
    """
    from megatron.core import parallel_state as mpu

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if block_rows is not None and block_rows < 1:
        raise ValueError(f"block_rows must be None or >= 1, got {block_rows}")
    group = tp_group or mpu.get_tensor_model_parallel_group()
    values = BLOCK_VALUES.get(logits.device.type, BLOCK_VALUES["cpu"])
    block = block_rows or max(1, values // logits.shape[-1])
    # inside the function grad mode is off and needs_input_grad ignores it: decide here
    keep = torch.is_grad_enabled() and logits.requires_grad
    logprobs, entropy = _VocabParallelLogprobs.apply(logits, targets, vocab_size, temperature,
                                                     compute_entropy, group, block, keep)
    return logprobs, (entropy if compute_entropy else None)


def _row_blocks(rows: int, block: int):
    return (slice(start, min(start + block, rows)) for start in range(0, rows, block))


class _VocabParallelLogprobs(torch.autograd.Function):
    """Log-probs and entropy of a vocab-parallel softmax, with a hand-written backward.

    Full-vocab tensors (tokens x vocab) are a step's largest (fp32 sizes: benchmarks/README.md,
    bench_logprobs.py), so this allocates at most one besides the logits: ``e = exp(d)``,
    ``d = u - m`` (``u`` the logits over T in fp32, ``m`` the global max), kept for the
    backward, which computes the gradient into it. All else works on blocks of ``block``
    tokens, so bf16 logits are never copied whole to fp32 and inference (nothing kept) needs no
    full-vocab tensor. Per token, with ``Z = sum_v e_v``: ``log p(target) = d_target - log Z``
    and ``H = log Z - sum_v e_v d_v / Z`` (the shifted sum, whose terms have one sign;
    unshifted, ``sum_v e_v u_v`` cancels against ``m`` and loses precision). The backward is
    analytic: for ``p = e / Z`` and the target's one-hot ``y``, ``d logp / du = y - p`` and
    ``d H / du = -p (u - m - log Z + H)``; it reuses ``e``, as Megatron's vocab-parallel cross
    entropy reuses its softmax, so the graph cannot be run backward twice. The backward needs
    no all-reduce: every TP rank holds the same log-probs, entropy and upstream gradients."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_size, temperature, compute_entropy, group, block,
                keep):
        tp = dist.get_world_size(group)
        shape, v_local = targets.shape, logits.shape[-1]
        start = (dist.get_rank(group) if tp > 1 else 0) * v_local
        valid = max(0, min(v_local, vocab_size - start))  # padded columns sit at the end
        ctx.set_materialize_grads(False)  # an output the loss leaves out gets no gradient pass
        flat, flat_targets = logits.reshape(-1, v_local), targets.reshape(-1)
        # the max commutes with the exact fp32 cast and with the division by T > 0
        top = flat[:, :valid].amax(dim=-1).float() / temperature
        if tp > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        local = (flat_targets >= start) & (flat_targets < start + valid)
        index = (flat_targets - start).clamp(0, v_local - 1).unsqueeze(-1)
        target_logit = (flat.gather(-1, index).squeeze(-1).float() / temperature - top) * local
        e_all = torch.empty(flat.shape, dtype=torch.float32, device=flat.device) if keep else None
        sum_exp = torch.empty_like(top)
        weighted = torch.empty_like(top) if compute_entropy else None
        for rows in _row_blocks(flat.shape[0], block):
            d = _shifted(flat[rows], top[rows], temperature)
            if keep:
                e = torch.exp(d, out=e_all[rows])
            else:  # d is only needed again for the entropy
                e = d.exp() if compute_entropy else d.exp_()
            e[:, valid:] = 0.0
            sum_exp[rows] = e.sum(dim=-1)
            if compute_entropy:  # sum_v e_v d_v: terms of one sign, torch's pairwise sum
                weighted[rows] = d.mul_(e).sum(dim=-1)
        sums = [sum_exp, target_logit] + ([weighted] if compute_entropy else [])
        if tp > 1:  # one all-reduce for all of them
            stacked = torch.stack(sums)
            dist.all_reduce(stacked, group=group)
            sums = list(stacked)
        sum_exp, target_logit = sums[0], sums[1]
        log_z = sum_exp.log()
        logprobs = target_logit - log_z
        entropy = (log_z - sums[2] / sum_exp if compute_entropy
                   else torch.zeros_like(logprobs))
        if keep:
            ctx.save_for_backward(logits, e_all, index, local, top, sum_exp, log_z, entropy)
        ctx.temperature, ctx.compute_entropy, ctx.block = temperature, compute_entropy, block
        return logprobs.view(shape), entropy.view(shape)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, grad, index, local, top, sum_exp, log_z, entropy = ctx.saved_tensors
        flat = logits.reshape(grad.shape)
        g_lp = None if grad_logprobs is None else grad_logprobs.reshape(-1).float()
        scale = (-1.0 / sum_exp).unsqueeze(-1)  # grad is e, made -p (...) in place
        if ctx.compute_entropy and grad_entropy is not None:
            g_h = grad_entropy.reshape(-1).float()
            shift = top + log_z - entropy  # u - shift = u - m - log Z + H
            for rows in _row_blocks(flat.shape[0], ctx.block):
                t = _shifted(flat[rows], shift[rows], ctx.temperature)
                t.mul_(g_h[rows].unsqueeze(-1))
                if g_lp is not None:
                    t.add_(g_lp[rows].unsqueeze(-1))
                grad[rows].mul_(t).mul_(scale[rows])
        elif g_lp is not None:
            grad.mul_(scale * g_lp.unsqueeze(-1))
        else:
            grad.zero_()
        if g_lp is not None:  # + g_lp at the target, where this rank holds it
            grad.scatter_add_(-1, index, (g_lp * local).unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.view(logits.shape).to(logits.dtype), *[None] * 7


def _shifted(logits_rows: torch.Tensor, shift: torch.Tensor, temperature: float) -> torch.Tensor:
    """A new fp32 tensor ``logits / T - shift`` of a block of rows (``shift`` [rows])."""
    if temperature != 1.0:  # x / 1 == x exactly: no pass at the usual temperature
        return (logits_rows.float() / temperature).sub_(shift.unsqueeze(-1))
    return logits_rows.float() - shift.unsqueeze(-1)


def _lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.long,
                          device=input_ids.device)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}")
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
    if not torch.equal(mask, positions < lengths.unsqueeze(1)):
        raise ValueError("attention_mask must be right padding (ones, then zeros, per row)")
    return lengths


def token_budget_groups(lengths: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """Row indices of micro-batches that each hold at most ``max_tokens`` padded tokens.

    Rows sorted longest first fill a micro-batch while (rows x its longest row) fits, so rows
    of similar length share one; a row longer than the budget gets a micro-batch of its own.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    groups, current = [], []
    for row in torch.argsort(lengths, descending=True, stable=True).tolist():
        if current and (len(current) + 1) * int(lengths[current[0]]) > max_tokens:
            groups.append(current)
            current = []
        current.append(row)
    groups.append(current)
    return [torch.tensor(g, device=lengths.device) for g in groups]


def split_microbatches(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       micro_batch_size: int | None = None, *, max_tokens: int | None = None,
                       **extra) -> list[dict]:
    """Micro-batch dicts, each trimmed to its longest row (right padding keeps rows causal):
    ``micro_batch_size`` consecutive rows, or with ``max_tokens`` :func:`token_budget_groups`.
    ``extra`` [B, ...] tensors are sliced by rows (and trimmed along dim 1 when it is S or S-1).
    """
    lengths = _lengths(input_ids, attention_mask)
    batch, seq = input_ids.shape
    if max_tokens is not None:
        groups = token_budget_groups(lengths, max_tokens)
    else:
        mbs = micro_batch_size or batch
        if mbs < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        groups = [torch.arange(lo, min(lo + mbs, batch), device=input_ids.device)
                  for lo in range(0, batch, mbs)]
    out = []
    for rows in groups:
        length = max(int(lengths[rows].max()), 1)
        mb = {"input_ids": input_ids[rows, :length],
              "attention_mask": (torch.arange(length, device=input_ids.device).unsqueeze(0)
                                 < lengths[rows].unsqueeze(1)).long(),
              "rows": rows}
        for key, value in extra.items():
            value = value[rows]
            if value.dim() > 1 and value.shape[1] in (seq, seq - 1):
                value = value[:, : length - (seq - value.shape[1])]
            mb[key] = value
        out.append(mb)
    return out


def _postprocess(model, output_tensor: torch.Tensor, batch: dict, temperature: float,
                 compute_entropy: bool) -> dict:
    """Model output on the last stage -> per-token quantities (masked to each row's length)."""
    inner = unwrap(model)
    mask = batch["attention_mask"].to(output_tensor.device)
    if inner.ragen_role == "critic":
        return {"values": output_tensor.squeeze(-1).float() * mask}
    input_ids = batch["input_ids"].to(output_tensor.device)
    # every position against the next token (the last one against a placeholder, cut after):
    # the logits are used whole, where a view without the last position would need a copy
    targets = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        output_tensor, targets, vocab_size=inner.ragen_spec.vocab_size,
        temperature=temperature, compute_entropy=compute_entropy)
    next_mask = mask[:, 1:]
    return {"logprobs": logprobs[:, :-1] * next_mask,
            "entropy": entropy[:, :-1] * next_mask if entropy is not None else None}


def make_forward_step(*, temperature: float = 1.0, compute_entropy: bool = True,
                      loss_fn: Callable | None = None, routing_replay: bool = False):
    """Megatron forward-step function: ``(data_iterator, model) -> (output, loss_func)``.

    Every stage draws the next micro-batch (so all stay in step); the last turns the output into
    log-probs/entropy or values for ``loss_fn(outputs, batch)``; without ``loss_fn`` the loss is
    0 and the schedule collects the detached outputs. An MoE micro-batch may carry the engine's
    ``routed_experts`` [b, s, layers, top-k] (``routing.py``; replayed with ``routing_replay``).
    """
    def forward_step(data_iterator, model):
        device = local_device()
        batch = {k: (v.to(device) if torch.is_tensor(v) else v)
                 for k, v in next(data_iterator).items()}
        inner = unwrap(model)
        width, multiple = batch["input_ids"].shape[1], _sequence_multiple(inner)
        input_ids = _pad_width(batch["input_ids"], multiple, 0)
        if inner.ragen_spec.is_moe:
            routed = batch.get("routed_experts")
            set_engine_routing(model, None if routed is None else
                               _pad_width(routed, multiple, -1), routing_replay)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
        output = model(input_ids, position_ids, None)
        if inner.post_process:   # the padding for sequence parallelism off again
            output = output[:, :width]

        def loss_func(output_tensor):
            outputs = _postprocess(model, output_tensor, batch, temperature, compute_entropy)
            if loss_fn is not None:
                return loss_fn(outputs, batch)
            detached = {k: (v.detach() if v is not None else None) for k, v in outputs.items()}
            return output_tensor.new_zeros(()), detached

        return output, loss_func

    return forward_step


def _sequence_multiple(model) -> int:
    """What a chunk's input length must be a multiple of: TP under sequence parallelism (each
    TP rank holds its slice of the sequence between layers), else 1."""
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_world_size() if model.config.sequence_parallel else 1


def _pad_width(t: torch.Tensor, multiple: int, value) -> torch.Tensor:
    """``t`` [b, s, ...] padded along dim 1 with ``value`` to a multiple of ``multiple``: right
    padding, which a causal model's earlier positions never see."""
    extra = -t.shape[1] % multiple
    if not extra:
        return t
    return torch.cat([t, t.new_full((t.shape[0], extra, *t.shape[2:]), value)], dim=1)


def run_schedule(chunks, microbatches: list[dict], forward_step, *, forward_only: bool) -> list:
    """Run Megatron's schedule (no pipelining, 1F1B, or interleaved) over ``microbatches``.

    Returns the last stage's ``loss_func`` extras, one per micro-batch ([] on other stages)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not microbatches:
        raise ValueError("run_schedule: no micro-batches")
    multiple = _sequence_multiple(unwrap(chunks[0]))
    seq = max(-(-mb["input_ids"].shape[1] // multiple) * multiple for mb in microbatches)
    mbs = max(mb["input_ids"].shape[0] for mb in microbatches)
    iterators = ([iter(microbatches) for _ in chunks] if len(chunks) > 1
                 else iter(microbatches))
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators,
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(microbatches),
        seq_length=seq, micro_batch_size=mbs, forward_only=forward_only)


def _on_every_rank(results: list[dict], microbatches: list[dict], key: str, shape) -> torch.Tensor:
    """The micro-batches' ``key`` in one fp32 tensor of ``shape`` (zeros past each micro-batch's
    width), assembled on the last pipeline stage and broadcast from it to the others."""
    from megatron.core import parallel_state as mpu

    out = torch.zeros(shape, dtype=torch.float32, device=local_device())
    pp = mpu.get_pipeline_model_parallel_world_size()
    if mpu.get_pipeline_model_parallel_rank() == pp - 1:
        for mb, res in zip(microbatches, results):
            value = res[key]
            out[mb["rows"], : value.shape[1]] = value
    if pp > 1:
        group = mpu.get_pipeline_model_parallel_group()
        dist.broadcast(out, src=dist.get_global_rank(group, pp - 1), group=group)
    return out


def _check_role(chunks, role: str, fn: str) -> None:
    actual = unwrap(chunks[0]).ragen_role
    if actual != role:
        raise ValueError(f"{fn} needs a {role} model, got a {actual} (build_model(role=...))")


def forward_logprobs(chunks, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     *, temperature: float = 1.0, compute_entropy: bool = True,
                     micro_batch_size: int | None = None,
                     routed_experts: torch.Tensor | None = None, routing_replay: bool = False):
    """Per-token log-probs of the next tokens (+ entropy), see the module docstring;
    ``routed_experts``: see :func:`make_forward_step`."""
    _check_role(chunks, "actor", "forward_logprobs")
    extra = {} if routed_experts is None else {"routed_experts": routed_experts}
    microbatches = split_microbatches(input_ids, attention_mask, micro_batch_size, **extra)
    step = make_forward_step(temperature=temperature, compute_entropy=compute_entropy,
                             routing_replay=routing_replay)
    with torch.no_grad():
        results = run_schedule(chunks, microbatches, step, forward_only=True)
    shape = (input_ids.shape[0], input_ids.shape[1] - 1)
    logprobs = _on_every_rank(results, microbatches, "logprobs", shape)
    entropy = (_on_every_rank(results, microbatches, "entropy", shape) if compute_entropy
               else None)
    return logprobs, entropy


def forward_values(chunks, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   *, micro_batch_size: int | None = None) -> torch.Tensor:
    """Critic values per position [B, S] (0 past each row's length), on every rank."""
    _check_role(chunks, "critic", "forward_values")
    microbatches = split_microbatches(input_ids, attention_mask, micro_batch_size)
    with torch.no_grad():
        results = run_schedule(chunks, microbatches, make_forward_step(), forward_only=True)
    return _on_every_rank(results, microbatches, "values", tuple(input_ids.shape))
