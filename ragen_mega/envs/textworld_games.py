"""BALROG's three TextWorld task families as seeded games, generated offline and cached.

BALROG (``balrog/environments/textworld/``) plays 25 pre-generated games per task, downloaded as
an archive; they were made by intelligent-go-explore's scripts with textworld's own generator:

=====================  ===============================================  ======================
task                   textworld challenge and settings                 BALROG's games
=====================  ===============================================  ======================
``coin_collector``     ``tw-coin_collector --level 220``                60 rooms, coin 20 away
``treasure_hunter``    ``tw-treasure_hunter --level 30``                20 rooms, locked doors
``the_cooking_game``   ``tw-cooking --recipe 5 --take 5 --go 12``       12 rooms, 5 ingredients
                       ``--open --cook --cut --split test``
=====================  ===============================================  ======================

Here the games are generated with the same challenges and settings (textworld 1.7.0, which
writes Z-machine ``.z8`` files; BALROG's archive holds Glulx files that 1.7.0 no longer plays),
``grammar.only_last_action`` as intelligent-go-explore sets it for the coin and treasure games.
Game ``index`` of a ``split`` has the generator seed ``SPLIT_SEEDS[split] + index``, so the
splits never share a game; the cooking game's own ``split`` setting (disjoint recipes) follows
it. Differences: intelligent-go-explore kept only treasure games whose walkthrough is exactly
20 commands (a search of many minutes a game); here every generated game is kept.

A game is written once under ``$RAGEN_MEGA_CACHE/textworld`` (``~/.cache/ragen_mega`` by
default), atomically, so processes that ask for it at once all get one complete copy.
"""
from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path
from typing import Any

from ragen_mega.envs.checks import is_int
from ragen_mega.models.prepare import atomic_dir, cache_dir

#: task -> (textworld challenge, BALROG's settings); a ``level`` kwarg replaces ``level``
TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "coin_collector": ("tw-coin_collector", {"level": 220}),
    "treasure_hunter": ("tw-treasure_hunter", {"level": 30}),
    "the_cooking_game": ("tw-cooking", {"recipe": 5, "take": 5, "go": 12, "open": True,
                                        "cook": True, "cut": True, "drop": False,
                                        "recipe_seed": 0}),
}
#: each task's levels (textworld's bounds; coin levels past 100 rooms do not fit a .z8)
LEVELS = {"coin_collector": range(1, 301), "treasure_hunter": range(1, 31)}
SPLIT_SEEDS = {"train": 0, "valid": 1 << 20, "test": 2 << 20}
MAX_GAMES = 1 << 20
_RETRIES = 10   # a treasure quest may fail to sample; the next seed is tried
_GAME = "game.z8"
#: textworld keeps parser state shared between threads (its knowledge base is parsed at every
#: generation and game start): one thread at a time generates, starts or steps a game
LOCK = threading.RLock()


def check_task(task: object, level: object, split: object, games: object) -> None:
    """Refuse settings no game can be made from, naming the kwarg."""
    if task not in TASKS:
        raise ValueError(f"textworld: unknown task {task!r}; choose one of {sorted(TASKS)}")
    if level is not None:
        if task not in LEVELS:
            raise ValueError(f"textworld: task {task!r} has no level (it takes BALROG's "
                             f"settings); level is for {sorted(LEVELS)}")
        if not is_int(level) or level not in LEVELS[task]:
            bounds = LEVELS[task]
            raise ValueError(f"textworld: level must be an int in [{bounds[0]}, {bounds[-1]}] "
                             f"for {task}, got {level!r}")
    if split not in SPLIT_SEEDS:
        raise ValueError(f"textworld: split must be one of {sorted(SPLIT_SEEDS)}, got {split!r}")
    if not is_int(games) or not 0 < games <= MAX_GAMES:
        raise ValueError(f"textworld: games must be an int in [1, {MAX_GAMES}], got {games!r}")


def settings(task: str, level: int | None, split: str) -> dict[str, Any]:
    """The challenge's settings for ``task`` (BALROG's, ``level`` replacing its level)."""
    chosen = dict(TASKS[task][1])
    if level is not None:
        chosen["level"] = int(level)
    if task == "the_cooking_game":
        chosen["split"] = split
    return chosen


def game_path(task: str, level: int | None, split: str, index: int,
              root: str | Path | None = None) -> Path:
    """The ``.z8`` file of game ``index`` of ``split``, generated on first use."""
    chosen = settings(task, level, split)
    tag = "-".join(f"{k}{int(v) if isinstance(v, bool) else v}" for k, v in sorted(chosen.items())
                   if k != "split")
    out = Path(root) if root is not None else cache_dir() / "textworld"
    out = out / task / tag / f"{split}-{index:07d}"
    if not (out / _GAME).exists():
        with LOCK:
            atomic_dir(out, lambda tmp: _generate(task, chosen, SPLIT_SEEDS[split] + index, tmp),
                       marker=_GAME)
    return out / _GAME


def _generate(task: str, chosen: dict[str, Any], seed: int, out: Path) -> None:
    """Generate and compile one game into ``out`` (``game.z8``, ``game.json``) from ``seed``,
    or from the next seeds when textworld cannot sample the quest."""
    import textworld.challenges
    from textworld import GameOptions
    from textworld.generator import QuestGenerationError, compile_game

    make = textworld.challenges.CHALLENGES[TASKS[task][0]][1]
    for attempt in range(_RETRIES):
        options = GameOptions()
        options.seeds = seed + attempt * 3 * MAX_GAMES   # beyond every split's range
        options.path = str(out / _GAME)
        options.file_ext = ".z8"
        options.force_recompile = True
        options.grammar.only_last_action = task != "the_cooking_game"
        try:
            with warnings.catch_warnings():  # jericho's, on the walkthrough check's game
                warnings.filterwarnings("ignore", message=".*is not fully supported")
                game = make(settings=dict(chosen), options=options)
        except QuestGenerationError:
            continue
        compile_game(game, options)
        (out / "walkthrough.json").write_text(json.dumps(list(game.walkthrough or [])))
        return
    raise RuntimeError(f"textworld: no {task} game with settings {chosen} from seed {seed} "
                       f"after {_RETRIES} tries")


def walkthrough(path: str | Path) -> list[str]:
    """The winning commands textworld recorded for the game at ``path``."""
    return json.loads((Path(path).parent / "walkthrough.json").read_text())
