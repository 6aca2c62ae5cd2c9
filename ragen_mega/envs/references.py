"""Reference success lines of an env, by env name: what a success rate must be read against.

Computed exactly where possible, on the seeds played and under the run's budget (``max_turns``
turns of up to ``max_actions_per_turn`` actions each):

- ``random_valid``: a uniformly random valid action at every move;
- ``example_copy``: the prompt's example answer written every turn (only when the prompt shows
  one: ``agent.example_answer``);
- ``best_fixed``: the best single answer written every turn, chosen per map (not map-blind: one
  answer for every map can do much worse);
- ``optimal``: the best policy that sees the map.

Each entry of :data:`REFERENCES` maps ``(env_kwargs, seeds, max_turns, max_actions_per_turn,
example_answer)`` to each line's mean over ``seeds`` (a seed listed twice counts twice);
``example_answer`` is the prompt's action words, or None. An env without an entry has no lines;
a line that does not apply to an env is left out.

- ``frozen_lake``: dynamic programming (:mod:`.frozen_lake_references`); its ``optimal`` is
  ``optimal_per_turn`` there (sees the player at the start of each turn, as the model does).
- ``sokoban``: search over the level's positions (:mod:`.sokoban_references`).
- ``textworld``: random admissible commands, estimated; the walkthrough
  (:mod:`.textworld_references`).
- ``minihack``: random valid actions, estimated (:mod:`.nethack_references`).
- ``bandit``: closed form. Success is choosing the arm of higher expected reward and the seed
  only orders the arms on screen, so every line is the same on every seed: ``random_valid`` the
  share of better arms (1/2, or 1 when equal), ``best_fixed`` and ``optimal`` 1,
  ``example_copy`` whether the example's first arm (the one it pulls) is a better one.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

REFERENCE_KEYS = ("random_valid", "example_copy", "best_fixed", "optimal")

ReferenceFn = Callable[[dict, Sequence[int], int, int, "Sequence[str] | None"], dict[str, float]]


def _frozen_lake(env_kwargs, seeds, max_turns, max_actions_per_turn, example_answer):
    from ragen_mega.envs import frozen_lake_references as fl

    env = fl.FrozenLakeEnv(**env_kwargs)
    per_seed = {}
    for seed in sorted(set(seeds)):
        env.reset(seed)
        lake = fl.Lake.from_env(env)
        lines = {"random_valid": fl.random_valid(lake, max_turns, max_actions_per_turn),
                 "best_fixed": fl.best_fixed(lake, max_turns, max_actions_per_turn),
                 "optimal": fl.optimal_per_turn(lake, max_turns, max_actions_per_turn)}
        if example_answer is not None:
            lines["example_copy"] = fl.example_copy(lake, example_answer, max_turns,
                                                    max_actions_per_turn)
        per_seed[seed] = lines
    return {key: float(np.mean([per_seed[s][key] for s in seeds])) for key in per_seed[seeds[0]]}


def _bandit(env_kwargs, seeds, max_turns, max_actions_per_turn, example_answer):
    from ragen_mega.envs.bandit import BanditEnv

    env = BanditEnv(**env_kwargs)
    best = max(env.expected_reward.values())
    better = [env.expected_reward[arm] >= best for arm in env.valid_actions]
    lines = {"random_valid": sum(better) / len(better), "best_fixed": 1.0, "optimal": 1.0}
    if example_answer is not None:
        lines["example_copy"] = float(env.expected_reward[example_answer[0]] >= best)
    return lines


def _sokoban(env_kwargs, seeds, max_turns, max_actions_per_turn, example_answer):
    from ragen_mega.envs.sokoban_references import references

    per_seed = {seed: references(env_kwargs, seed, max_turns, max_actions_per_turn,
                                 example_answer) for seed in sorted(set(seeds))}
    return {key: float(np.mean([per_seed[s][key] for s in seeds])) for key in per_seed[seeds[0]]}


def _textworld(env_kwargs, seeds, max_turns, max_actions_per_turn, example_answer):
    from ragen_mega.envs.textworld_references import references

    return references(env_kwargs, seeds, max_turns, max_actions_per_turn)


def _minihack(env_kwargs, seeds, max_turns, max_actions_per_turn, example_answer):
    from ragen_mega.envs.nethack_references import references

    return references(env_kwargs, seeds, max_turns, max_actions_per_turn)


REFERENCES: dict[str, ReferenceFn] = {"frozen_lake": _frozen_lake, "bandit": _bandit,
                                      "sokoban": _sokoban, "textworld": _textworld,
                                      "minihack": _minihack}


def reference_lines(env_name: str, env_kwargs: dict, seeds: Sequence[int], *, max_turns: int,
                    max_actions_per_turn: int, example_answer: Sequence[str] | None = None
                    ) -> dict[str, float] | None:
    """The lines of ``env_name`` on ``seeds``, keys in :data:`REFERENCE_KEYS` order, or None
    when the env has none."""
    if env_name not in REFERENCES:
        return None
    seeds = list(seeds)
    if not seeds:
        raise ValueError("reference_lines: needs at least one seed")
    lines = REFERENCES[env_name](dict(env_kwargs), seeds, max_turns, max_actions_per_turn,
                                 None if example_answer is None else list(example_answer))
    return {key: lines[key] for key in REFERENCE_KEYS if key in lines}
