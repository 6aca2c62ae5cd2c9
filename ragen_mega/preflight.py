"""The start-up check: what a run's config cannot say by itself and this machine must.

:func:`~ragen_mega.config.load_run_config` validates the config tree alone (types, ranges,
combinations of keys) and probes nothing. Before a command starts a process or a server,
:func:`preflight` checks the config against the machine and the code installed on it, and
raises :class:`~ragen_mega.config_tree.ConfigError` naming the key:

- every env of the run (training, held-out, each ``env.mix`` entry) builds with its kwargs,
  once, in this process: a wrong kwarg is named here, not in an env worker minutes later; with
  ``env.remote``, each env server answers and serves the config's env and kwargs instead;
- ``rollout.agent`` imports and is an async function, and its gateway off loopback has a token;
- ``actor.bf16`` / ``critic.bf16`` have a GPU to run on (on a CPU bf16 learns slower, and
  runs slower without bf16 instructions: measured), ``*.moe_grouped_gemm`` TransformerEngine
  on a GPU;
- the model (``model.path``'s config.json) splits over the actor's and the critic's parallel
  layout (TP divides the heads and MLP widths, PP the layers, EP the experts) and over the
  engines' expert parallelism; routing replay has experts to replay; LoRA adapters
  (``actor.lora``, ``critic.lora``) fit the model (``lm_head`` only on an actor's untied
  head);
- ``actor.load`` is a complete torch_dist checkpoint of the model ``model.path`` describes.

``ragen-mega train``, ``eval`` and ``sft`` run it right after loading the config.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ragen_mega.backends.megatron.transformer_config import (GROUPED_GEMM_NEEDS_TE,
                                                              te_available)
from ragen_mega.config import RunConfig
from ragen_mega.config_tree import ConfigError
from ragen_mega.http_token import GATEWAY_TOKEN, check_listen, token_from_env


def preflight(cfg: RunConfig) -> RunConfig:
    """``cfg``, once every env builds, bf16 has a GPU and the checkpoints it starts from are
    there; else ConfigError naming the key."""
    from ragen_mega.envs import make
    from ragen_mega.rollout.remote_env import check_servers

    if cfg.env.remote:  # the servers build the env: they must serve the config's
        try:
            check_servers(cfg.env.remote, cfg.env.name, cfg.env.kwargs,
                          min(cfg.env.remote_timeout_s, 30.0))
        except ValueError as e:
            raise ConfigError(f"env.remote{e}") from e
    else:
        for key, name, kwargs in env_builds(cfg):
            try:
                make(name, **kwargs).close()
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{key}: {e}") from e
    if cfg.rollout.agent is not None:
        from ragen_mega.rollout.user_agent import load_agent

        try:
            load_agent(cfg.rollout.agent)
        except ValueError as e:
            raise ConfigError(f"rollout.agent: {e}") from e
        try:
            check_listen(cfg.rollout.gateway_host, token_from_env(GATEWAY_TOKEN), GATEWAY_TOKEN,
                         "rollout.gateway_host")
        except ValueError as e:
            raise ConfigError(str(e)) from e
    check_bf16(cfg)
    for role in ("actor", "critic"):
        if getattr(cfg, role).moe_grouped_gemm and not te_available():
            raise ConfigError(f"{role}.moe_grouped_gemm: {GROUPED_GEMM_NEEDS_TE} (set "
                              f"{role}.moe_grouped_gemm=false: one linear per expert)")
    check_model_layout(cfg)
    check_start_checkpoint(cfg)
    resume = cfg.trainer.resume
    if resume not in ("auto", "never", "force") and not (Path(resume) / "actor").is_dir():
        raise ConfigError(f"trainer.resume: auto, never, force, or a directory holding actor/ "
                          f"(and critic/) checkpoints; {resume!r} is none of these")
    return cfg


def check_bf16(cfg: RunConfig) -> None:
    """``actor.bf16`` / ``critic.bf16`` only with a GPU: on a CPU, bf16 was measured to learn
    slower per step, and to run slower where the CPU lacks bf16 instructions
    (benchmarks/README.md, "bf16 on a CPU")."""
    if torch.cuda.is_available():
        return
    for role in ("actor", "critic"):
        if getattr(cfg, role).bf16:
            raise ConfigError(
                f"{role}.bf16: bf16 training needs a GPU; on a CPU it learns slower per step "
                f"(the forward's bf16 weights move only by whole bf16 steps: the bandit demo "
                f"took 15 steps in bf16 to where fp32 is at step 5) and, without AVX512-BF16 or "
                f"AMX, runs 2.5x slower a step (benchmarks/README.md, \"bf16 on a CPU\"); set "
                f"{role}.bf16=false")


def check_model_layout(cfg: RunConfig) -> None:
    """The model's config.json against each trained role's TP / PP / EP layout. A preset
    (``smollm2``, ``textgame-small``) is written on first use, which a check must not start: the
    trainer checks its layout when it builds the model. A Hugging Face Hub id not in the cache
    is downloaded here, before anything starts (``models/prepare.py``: ``hub_snapshot``)."""
    from ragen_mega.models.hf_config import model_spec
    from ragen_mega.models.prepare import PRESETS, resolve_model

    if cfg.model.path in PRESETS:
        return
    try:
        spec = model_spec(resolve_model(cfg.model.path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: {e}") from e
    for role in ("actor", "critic") if cfg.critic.enable else ("actor",):
        section = getattr(cfg, role)
        try:
            spec.check_parallel(section.tp, section.pp, section.vpp, section.ep)
        except ValueError as e:
            raise ConfigError(f"{role}: {e}") from e
    try:
        spec.check_parallel(ep=cfg.rollout.engine_ep)
    except ValueError as e:
        raise ConfigError(f"rollout.engine_ep: {e}") from e
    if cfg.actor.routing_replay and not spec.is_moe:
        raise ConfigError(f"actor.routing_replay: replays the experts a mixture of experts "
                          f"routed each token to; model_type={spec.arch} has none")
    from ragen_mega.backends.megatron.lora import check_supported

    for role in ("actor", "critic") if cfg.critic.enable else ("actor",):
        lora = getattr(cfg, role).lora.settings()
        if lora is not None:
            try:
                check_supported(spec, lora, role)
            except ValueError as e:
                raise ConfigError(f"{role}.{e}") from e


def check_start_checkpoint(cfg: RunConfig) -> None:
    """``actor.load``: a complete checkpoint (``step_N``, or a root holding one) with all its
    files, of the architecture in ``model.path``'s config.json (compared with the checkpoint's
    ``hf/`` copy; a preset is not written yet, so the trainer compares when it loads)."""
    from ragen_mega.backends.megatron import checkpoint as ckpt
    from ragen_mega.models.hf_config import model_spec
    from ragen_mega.models.prepare import PRESETS, resolve_model

    if cfg.actor.load is None:
        return
    path = Path(cfg.actor.load)
    if (path / "config.json").is_file():
        raise ConfigError(f"actor.load: {path} is a Hugging Face model directory; give it as "
                          f"model.path (actor.load takes a Megatron torch_dist checkpoint: "
                          f"ragen-mega convert hf-to-megatron's output, or a run's "
                          f"checkpoints/actor/step_N)")
    try:
        found = ckpt.find_checkpoint(path)
        ckpt.verify_checkpoint(found)
    except (OSError, ValueError, RuntimeError) as e:  # missing, corrupt, or an older version's
        raise ConfigError(f"actor.load: {e}") from e
    if cfg.model.path in PRESETS or not (found / "hf" / "config.json").is_file():
        return
    saved, wanted = model_spec(found / "hf"), model_spec(resolve_model(cfg.model.path))
    differ = [f"{f.name}={getattr(saved, f.name)!r} (model.path: {getattr(wanted, f.name)!r})"
              for f in dataclasses.fields(wanted)
              if getattr(saved, f.name) != getattr(wanted, f.name)]
    if differ:
        raise ConfigError(f"actor.load: {found} holds another model than model.path "
                          f"{cfg.model.path}: {', '.join(differ)}")


def env_builds(cfg: RunConfig) -> list[tuple[str, str, dict]]:
    """``(kwargs key, env name, kwargs)`` of every env the run plays."""
    from ragen_mega.rollout.seeding import val_parts

    env = cfg.env
    if env.mix:
        return [(f"env.mix[{i}].kwargs", m.env_name, m.kwargs) for i, m in enumerate(env.mix)]
    builds = [("env.kwargs", env.name, env.kwargs)]
    if env.val_name is not None or env.val_kwargs:
        [val] = val_parts(env)
        builds.append(("env.val_kwargs", val.name, val.kwargs))
    return builds
