"""Name -> env class registry.

Built-in envs are registered lazily (imported on first ``make``), so ``import ragen_mega.envs``
does not import crafter or minigrid. A user's env is one decorator away::

    from ragen_mega.envs import TextEnv, register_env

    @register_env("my_game")
    class MyGame(TextEnv): ...

or ``register_env("my_game")(MyGame)``, or, without importing it,
``register_env_path("my_game", "my_pkg.games:MyGame")``. A run's YAML can also name the class,
``env.name: my_pkg.games:MyGame`` or ``env.name: games.py:MyGame``: every process that builds the
env (driver, Ray env workers, env server) imports it on first use and registers it by that name.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Callable

from ragen_mega.envs.base import TextEnv
from ragen_mega.user_code import is_code_path, load_object

_BUILTIN: dict[str, str] = {
    "bandit": "ragen_mega.envs.bandit:BanditEnv",
    "sokoban": "ragen_mega.envs.sokoban:SokobanEnv",
    "frozen_lake": "ragen_mega.envs.frozen_lake:FrozenLakeEnv",
    "babyai": "ragen_mega.envs.babyai:BabyAIEnv",
    "crafter": "ragen_mega.envs.crafter_env:CrafterEnv",
    "babaisai": "ragen_mega.envs.babaisai.env:BabaIsAIEnv",
    "textworld": "ragen_mega.envs.textworld_env:TextWorldEnv",
    "minihack": "ragen_mega.envs.nethack_env:MiniHackEnv",
    "nethack": "ragen_mega.envs.nethack_env:NetHackEnv",
}
_CLASSES: dict[str, type[TextEnv]] = {}
_PATHS: dict[str, str] = dict(_BUILTIN)


def register_env(name: str) -> Callable[[type[TextEnv]], type[TextEnv]]:
    """Class decorator registering a :class:`TextEnv` subclass under ``name``."""
    def deco(cls: type[TextEnv]) -> type[TextEnv]:
        if not (inspect.isclass(cls) and issubclass(cls, TextEnv)):
            raise TypeError(f"register_env({name!r}): {cls!r} is not a TextEnv subclass")
        cls.name = name
        _CLASSES[name] = cls
        return cls
    return deco


def register_env_path(name: str, path: str) -> None:
    """Register ``"package.module:ClassName"`` under ``name`` without importing it yet."""
    if ":" not in path:
        raise ValueError(f"register_env_path({name!r}): expected 'module:Class', got {path!r}")
    _PATHS[name] = path


def list_envs() -> list[str]:
    """All registered env names, sorted."""
    return sorted(set(_PATHS) | set(_CLASSES))


def env_class(name: str) -> type[TextEnv]:
    """The class registered under ``name``, or the one a ``MODULE:CLASS`` / ``FILE.py:CLASS``
    name points to (imported and registered under ``name``); else ValueError."""
    if name not in _CLASSES:
        if name in _PATHS:
            module, _, attr = _PATHS[name].partition(":")
            cls = getattr(importlib.import_module(module), attr)
        elif is_code_path(name):
            cls = load_object(name)
            if not (inspect.isclass(cls) and issubclass(cls, TextEnv)):
                raise ValueError(f"{name!r} is not a TextEnv subclass (an env is "
                                 f"'class MyEnv(ragen_mega.envs.TextEnv)')")
        else:
            raise ValueError(f"unknown env {name!r}; registered envs: {', '.join(list_envs())}, "
                             f"or a class of yours as MODULE:CLASS or FILE.py:CLASS")
        if name not in _CLASSES:  # a module using @register_env has registered itself already
            register_env(name)(cls)
    return _CLASSES[name]


def make(name: str, **kwargs) -> TextEnv:
    """Build env ``name`` with its kwargs; a kwarg it does not take is a clear ``TypeError``."""
    cls = env_class(name)
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in kwargs if k not in params] if not takes_any else []
    if unknown:
        allowed = [k for k in params if k != "self"]
        raise TypeError(f"env {name!r} got unknown kwarg(s) {unknown}; allowed: {allowed}")
    return cls(**kwargs)
