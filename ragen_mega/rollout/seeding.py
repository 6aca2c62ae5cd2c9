"""Seeds that make a step's rollout a function of the step and the weights: which env seeds a
step's episodes play (RAGEN's grouping, over one env or a mix: :func:`train_step_specs`), and
the sampling seed each request carries.

Env seeds: group ``g`` of a step plays one seed in all its episodes (or one seed an episode, for
an env whose ``seed_shared_in_group`` is False), each env of a mix on its own consecutive range,
the ranges end to end, and step k's range right after step k-1's.

Sampling seeds: with ``rollout.seeded`` an episode's k-th request carries
``sampling_seed = request_seed(trainer.seed, phase, step, episode_id, k)``, so its tokens do not
depend on what else the engines run and a resumed run replays the uninterrupted one. In
``rollout.mode: turns`` the key is (trainer.seed, "stream", step, stream, k).
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
from typing import Any, Sequence

from ragen_mega.envs import env_class
from ragen_mega.rollout.types import EpisodeSpec, GenerateFn


def request_seed(*key) -> int:
    """A 63-bit sampling seed that is a pure function of ``key`` (stable across processes and
    Python versions, unlike ``hash``), spread so that neighbouring keys give unrelated seeds."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seeded_generate(generate: GenerateFn, *key) -> GenerateFn:
    """``generate`` for one episode, its k-th request seeded with ``request_seed(*key, k)``."""
    turns = itertools.count(1)

    async def seeded(prompt_ids, sampling):
        seed = request_seed(*key, next(turns))
        return await generate(prompt_ids, {**sampling, "sampling_seed": seed})
    return seeded


def group_specs(env_name: str, env_kwargs: dict[str, Any], *, env_groups: int, group_size: int,
                first_seed: int, env_tag: str = "", first_group: int = 0,
                max_turns: int | None = None) -> list[EpisodeSpec]:
    """RAGEN's grouping: ``env_groups`` groups of ``group_size`` episodes. Group ``g`` plays seed
    ``first_seed + g`` in every episode, unless the env's ``seed_shared_in_group`` is False; then
    episode ``i`` plays seed ``first_seed + i`` (:func:`seeds_per_step` counts the range). Group
    ids start at ``first_group`` (episode ids follow), so several envs' groups in one step stay
    distinct. ``max_turns``: the env's own turn limit (None: the run's)."""
    shared = env_class(env_name).seed_shared_in_group
    return [EpisodeSpec(env_name, dict(env_kwargs),
                        first_seed + (g if shared else g * group_size + k),
                        (first_group + g) * group_size + k, first_group + g, env_tag, max_turns)
            for g in range(env_groups) for k in range(group_size)]


def seeds_per_step(env_name: str, env_groups: int, group_size: int) -> int:
    """How many consecutive seeds one call of :func:`group_specs` uses."""
    return env_groups if env_class(env_name).seed_shared_in_group else env_groups * group_size


@dataclasses.dataclass(frozen=True)
class EnvPart:
    """One env of a step's mix (RAGEN's ``env_configs`` tag with its ``n_groups``): episodes of
    env ``name`` built with ``kwargs``, ``groups`` groups of them, metrics logged under ``tag``,
    at most ``max_turns`` turns each (None: the run's ``env.max_turns``)."""
    tag: str
    name: str
    kwargs: dict[str, Any]
    groups: int
    max_turns: int | None = None


def train_parts(env) -> list[EnvPart]:
    """The envs of one training step, in order, from the run's ``env`` section: its ``mix``
    entries that train (``env_groups`` > 0), or the one env ``name`` with ``kwargs``."""
    if not env.mix:
        return [EnvPart(env.name, env.name, env.kwargs, env.env_groups)]
    return [EnvPart(m.tag, m.env_name, m.kwargs, m.env_groups, m.max_turns) for m in env.mix
            if m.env_groups > 0]


def val_parts(env) -> list[EnvPart]:
    """The envs of the held-out evaluation (groups of ``env.val_group_size`` episodes), in
    order: each ``mix`` entry with held-out groups, or ``val_name`` (default: the training env)
    with ``val_kwargs`` (default: the training kwargs, for the training env only)."""
    if not env.mix:
        name = env.val_name or env.name
        kwargs = env.val_kwargs or (env.kwargs if name == env.name else {})
        return [EnvPart(name, name, kwargs, env.val_groups)]
    groups = [env.val_groups if m.val_groups is None else m.val_groups for m in env.mix]
    return [EnvPart(m.tag, m.env_name, m.kwargs, g, m.max_turns)
            for m, g in zip(env.mix, groups) if g]


def mix_seeds_per_step(parts: Sequence[EnvPart], group_size: int) -> int:
    """How many consecutive seeds one :func:`mix_specs` call uses: the parts' ranges end to end."""
    return sum(seeds_per_step(p.name, p.groups, group_size) for p in parts)


def mix_specs(parts: Sequence[EnvPart], *, group_size: int, first_seed: int) -> list[EpisodeSpec]:
    """The episodes of one step over several envs: :func:`group_specs` for each part in order,
    each on its own seed range after the previous part's (no two envs share a seed; the step
    spans :func:`mix_seeds_per_step` seeds), group ids numbered on across parts. One part is
    exactly :func:`group_specs`."""
    specs: list[EpisodeSpec] = []
    first_group = 0
    for p in parts:
        specs += group_specs(p.name, p.kwargs, env_groups=p.groups, group_size=group_size,
                             first_seed=first_seed, env_tag=p.tag, first_group=first_group,
                             max_turns=p.max_turns)
        first_seed += seeds_per_step(p.name, p.groups, group_size)
        first_group += p.groups
    return specs


def train_step_specs(parts: Sequence[EnvPart], *, group_size: int, seed: int, step: int
                     ) -> list[EpisodeSpec]:
    """Training step ``step``'s (1-based) episodes: its seeds follow step ``step - 1``'s, so they
    are a function of the step alone (a resumed run replays exactly the uninterrupted one)."""
    first = seed + (step - 1) * mix_seeds_per_step(parts, group_size)
    return mix_specs(parts, group_size=group_size, first_seed=first)
