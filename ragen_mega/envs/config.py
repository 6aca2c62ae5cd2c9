"""The ``env`` section of the run config: the env(s) a run plays, RAGEN's grouping, held-out
evaluation, env servers (the tree is in ``ragen_mega/config.py``, section rules in
``ragen_mega/config_tree.py``)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from ragen_mega.config_tree import ConfigError, bounded, check_bounds, setting
from ragen_mega.envs.registry import env_class, list_envs
from ragen_mega.user_code import is_code_path

_TAG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def _check_env_name(name: str, name_key: str) -> None:
    """``name`` is a registered env or a user's ``MODULE:CLASS`` / ``FILE.py:CLASS`` (imported
    here, so a bad one fails at load); else a ConfigError naming the key. ``preflight.py``
    checks that the env builds with its kwargs."""
    if not is_code_path(name):  # a registered env is not imported here (crafter, minigrid)
        if name not in list_envs():
            raise ConfigError(f"{name_key}: unknown env {name!r}; registered envs: "
                              f"{', '.join(list_envs())}, or a class of yours as MODULE:CLASS "
                              f"or FILE.py:CLASS")
        return
    try:
        env_class(name)
    except ValueError as e:
        raise ConfigError(f"{name_key}: {e}") from e


_USER_ENV = "a class of yours as MODULE:CLASS or FILE.py:CLASS"


@dataclasses.dataclass
class EnvMixEntry:
    """One env of a mixed run (an ``env.mix`` item; RAGEN's ``env_configs`` tag + ``n_groups``)."""
    tag: str = setting("", help=(
        "the env's name in metric names (rollout/<tag>/success, val/<tag>/pass@k, ...): letters, "
        "digits, _ - ."))
    name: Optional[str] = setting(None, choices=list_envs, also=_USER_ENV, help=(
        "the env; null: the env registered under the tag"))
    kwargs: dict = setting(default_factory=dict, help="the env's constructor arguments")
    env_groups: int = bounded(1, ge=0, help="training groups per step (0: evaluated only)")
    val_groups: Optional[int] = bounded(None, ge=0, help=(
        "held-out groups; null: env.val_groups (0: not evaluated)"))
    max_turns: Optional[int] = bounded(None, ge=1, note="leave it out to use env.max_turns", help=(
        "turns an episode of this env may play"))

    @property
    def env_name(self) -> str:
        return self.name if self.name is not None else self.tag


@dataclasses.dataclass
class EnvConfig:
    """The env(s) a run plays, RAGEN's grouping, and the held-out evaluation.

    One env: ``name``, ``kwargs``, ``env_groups`` groups of ``group_size`` episodes per step;
    evaluation on ``val_groups`` held-out groups of ``val_name`` (default: the same env). Metrics
    are logged overall (``rollout/success``) and with the env's name as tag
    (``rollout/sokoban/success``).

    Several envs (RAGEN's es_manager ``tags`` / ``n_groups``): list them in ``mix``; each group
    plays one env, and every metric is also logged per tag::

        env:
          env_groups: 8            # the step's total: must equal the sum over mix (as in RAGEN)
          group_size: 16           # shared, as are seed, val_groups, val_seed
          max_turns: 10            # the default of entries without their own
          mix:
            - {tag: sokoban, kwargs: {dim_room: [6, 6]}, env_groups: 4}
            - {tag: lake, name: frozen_lake, kwargs: {is_slippery: true}, env_groups: 2}
            - {tag: babyai, kwargs: {level: goto}, env_groups: 2, max_turns: 64}
            - {tag: sokoban_8x8, name: sokoban, kwargs: {dim_room: [8, 8]}, env_groups: 0}

    ``name`` defaults to the tag; ``env_groups: 0`` makes an eval-only env (generalisation to an
    env never trained on), ``val_groups: 0`` a train-only one; ``max_turns`` lets a long-horizon
    env (BabyAI, Crafter) play longer than a puzzle beside it (RAGEN's per-env
    ``max_actions_per_traj``); ``val_groups`` counts per env, so an added env never thins
    another's evaluation. With ``mix``, a top-level ``name``/``kwargs``/``val_name``/``val_kwargs``
    is refused. Each env of a step gets its own consecutive seed range, end to end, so a step's
    seeds depend only on the step (resume) and no two envs share one
    (``rollout.seeding.mix_specs``).
    """
    name: str = setting("bandit", choices=list_envs, also=_USER_ENV, help=(
        "the env a run plays (`ragen-mega play NAME` shows it)"))
    kwargs: dict = setting(default_factory=dict, help="the env's constructor arguments")
    env_groups: int = bounded(8, ge=1, help="distinct seeds per step (RAGEN: env_groups)")
    group_size: int = bounded(16, ge=1, help="episodes per seed (RAGEN: group_size)")
    max_turns: int = bounded(5, ge=1, help=(
        "turns an episode may play; the last one ends it (truncated)"))
    seed: int = setting(0, help="first training seed; step k uses seeds after step k-1's")
    val_name: Optional[str] = setting(None, choices=list_envs, also=_USER_ENV, help=(
        "the env of the held-out evaluation; null: env.name"))
    val_kwargs: dict = setting(default_factory=dict, help=(
        "the held-out env's constructor arguments"))
    val_groups: int = bounded(16, ge=1, help="held-out seeds")
    val_group_size: int = bounded(1, ge=1, help=(
        "episodes per held-out seed: > 1 logs pass@k (a seed counts if any of its k episodes won)"))
    val_seed: int = setting(1_000_000, help="the first held-out seed (far from the training seeds)")
    mix: list[EnvMixEntry] = setting(default_factory=list, help=(
        "several envs in one run (RAGEN's es_manager tags / n_groups), one entry per env; each "
        "group plays one env and every metric is also logged per tag. With a mix, env.name, "
        "env.kwargs, env.val_name and env.val_kwargs stay unset, and env.env_groups must equal "
        "the entries' env_groups summed"))
    remote: list[str] = setting(default_factory=list, help=(
        "env servers (`ragen-mega env-server`) the episodes are played on instead of local envs, "
        "episode i on server i mod len (`rollout/remote_env.py`); each must serve `name` with "
        "`kwargs` (checked at start-up). []: local envs (or `rollout.env_workers`)"))
    remote_timeout_s: float = bounded(60.0, gt=0, help=(
        "seconds an env server may take to answer; longer counts as the env failing"))

    def validate(self):
        if self.remote:
            self._validate_remote()
        if not self.mix:
            _check_env_name(self.name, "name")
            if self.val_name is not None:
                _check_env_name(self.val_name, "val_name")
            return
        self._validate_mix()

    def _validate_remote(self):
        for i, url in enumerate(self.remote):
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(f"remote[{i}]: must be an http(s):// URL of an env server, "
                                  f"got {url!r}")
        if self.mix or self.val_name is not None or self.val_kwargs:
            raise ConfigError("remote: env servers serve one env, the run's name and kwargs; "
                              "not with env.mix, env.val_name or env.val_kwargs")

    def _validate_mix(self):
        defaults = EnvConfig()
        for key in ("name", "kwargs", "val_name", "val_kwargs"):
            if getattr(self, key) != getattr(defaults, key):
                raise ConfigError(f"{key}: {getattr(self, key)!r} is not used when env.mix is set; "
                                  f"each env.mix entry names its env (eval-only env: an entry "
                                  f"with env_groups: 0)")
        tags: set[str] = set()
        for i, m in enumerate(self.mix):
            key = f"mix[{i}]"
            if not m.tag or not set(m.tag) <= _TAG_CHARS:
                raise ConfigError(f"{key}.tag: {m.tag!r} must be a non-empty name of letters, "
                                  f"digits, '_', '-', '.' (it becomes part of metric names)")
            if m.tag in tags:
                raise ConfigError(f"{key}.tag: duplicate tag {m.tag!r}; each env of the mix "
                                  f"needs its own tag")
            tags.add(m.tag)
            _check_env_name(m.env_name, f"{key}.name" if m.name is not None else
                            f"{key}.tag (no name given, so the tag names the env)")
            try:  # list items are no sections of the tree: their bounds are checked here
                check_bounds(m)
            except ConfigError as e:
                raise ConfigError(f"{key}.{e}") from e
            if m.env_groups == 0 and m.val_groups == 0:
                raise ConfigError(f"{key}: env_groups and val_groups are both 0: the env "
                                  f"{m.tag!r} would never be played")
        total = sum(m.env_groups for m in self.mix)
        if total != self.env_groups:
            raise ConfigError(f"env_groups: {self.env_groups} but the env.mix entries' env_groups "
                              f"sum to {total}; they must match (RAGEN: sum(n_groups) == "
                              f"env_groups)")
        if not any(self.val_groups if m.val_groups is None else m.val_groups for m in self.mix):
            raise ConfigError("mix: every entry has val_groups: 0, so evaluation plays nothing")
