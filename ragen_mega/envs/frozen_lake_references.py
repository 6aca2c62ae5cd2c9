"""Reference success rates for FrozenLake, exact, by dynamic programming over the env's own
transition table (gymnasium's ``P``, from :attr:`FrozenLakeEnv.transitions`).

An episode is played as the rollout plays it (``ragen_mega/rollout/episode.py``): up to
``max_turns`` turns; in each, the first ``K = max_actions_per_turn`` actions of the model's answer
(``agent/parse.py``) are stepped in order, blind, until one ends the episode; the env stops after
``max_steps`` valid moves. So at most ``min(max_turns * K, max_steps)`` moves. Success = reaching
the goal (reward 1).

Lines, each a probability for one map:

- :func:`random_valid`: every move a uniformly random action word (K valid actions per answer);
  a random action goes each way with 1/4 whatever the slip, so slip does not change it;
- :func:`example_copy`: the same answer written every turn (e.g. the prompt's example
  ``Left || Down``, the first ``min(2, K)`` action words, from ``agent/prompt.py``);
- :func:`best_fixed`: the best such answer over all answers of 1..K actions (4 + ... + 4**K);
- :func:`optimal`: the best policy that sees the map and the player after every move
  (finite-horizon DP over moves); on slippery ice an upper bound, as a model writing K moves a
  turn sees the player only between turns;
- :func:`optimal_per_turn`: the best policy that sees the player at the start of each turn and
  commits to an answer of 1..K moves (DP over turns); equal to :func:`optimal` on non-slippery
  ice, where a plan needs no feedback.

``random_valid <= optimal_per_turn``, ``example_copy <= best_fixed <= optimal_per_turn <=
optimal``. :func:`references` gives all of them for one map, :func:`mean_references` their means
over the maps an env config plays for a list of seeds.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ragen_mega.envs.frozen_lake import ACTIONS, FrozenLakeEnv, action_index, gym_lake

N_ACTIONS = len(ACTIONS)
_WORDS = {index: word for word, index in ACTIONS.items()}
DEMO_EXAMPLE_ANSWER = ("Left", "Down")


@dataclass(frozen=True)
class Lake:
    """One map's dynamics: ``P[a]`` is the state-to-state matrix of action ``a`` (holes and the
    goal absorbing, as in gymnasium's table), ``goal`` a 0/1 vector, ``start`` the start state."""

    P: np.ndarray           # (n_actions, n_states, n_states)
    goal: np.ndarray        # (n_states,) float, 1.0 on the goal
    start: int
    max_steps: int
    rows: tuple[str, ...]

    @classmethod
    def from_table(cls, table: dict, rows: Sequence[str], max_steps: int = 100) -> "Lake":
        """From gymnasium's ``P[state][action] = [(prob, next, reward, terminated), ...]``."""
        n = len(table)
        P = np.zeros((N_ACTIONS, n, n))
        for s, by_action in table.items():
            for a, outcomes in by_action.items():
                for prob, nxt, _reward, _terminated in outcomes:
                    P[a, s, nxt] += prob
        letters = "".join(rows)
        goal = np.array([ch == "G" for ch in letters], dtype=float)
        return cls(P, goal, letters.index("S"), int(max_steps), tuple(rows))

    @classmethod
    def from_env(cls, env: FrozenLakeEnv) -> "Lake":
        """The map of ``env``'s current episode (call ``env.reset(seed)`` first), with the table
        ``env.step`` samples from."""
        return cls.from_table(env.transitions, env.map_rows, env.max_steps)

    @classmethod
    def from_rows(cls, rows: Sequence[str], *, is_slippery: bool = True,
                  success_rate: float = 0.8, max_steps: int = 100) -> "Lake":
        """A given map (rows of S, F, H, G), with the dynamics the env builds for it."""
        return cls.from_table(gym_lake(list(rows), is_slippery, success_rate).P, rows, max_steps)

    def horizon(self, max_turns: int, max_actions_per_turn: int) -> int:
        return min(max_turns * max_actions_per_turn, self.max_steps)


def _check(max_turns: int, max_actions_per_turn: int) -> None:
    for name, value in [("max_turns", max_turns), ("max_actions_per_turn", max_actions_per_turn)]:
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _answer_ids(answer: Sequence[str] | str, max_actions_per_turn: int) -> list[int]:
    """Action ids of an answer (a list of words, or text like ``"Left || Down"``), cut to K as
    the parser cuts it."""
    words = answer.split("||") if isinstance(answer, str) else list(answer)
    words = [w.strip() for w in words if w.strip()]
    if not words:
        raise ValueError("answer: needs at least one action word")
    ids = [action_index(w) for w in words]
    bad = [w for w, i in zip(words, ids) if i is None]
    if bad:
        raise ValueError(f"answer: {bad!r} are not action words ({', '.join(ACTIONS)})")
    return ids[:max_actions_per_turn]


def sequence_success(lake: Lake, moves: Sequence[int]) -> float:
    """Probability that playing ``moves`` (action ids) blind, in order, reaches the goal."""
    x = np.zeros(len(lake.goal))
    x[lake.start] = 1.0
    for a in moves[:lake.max_steps]:
        x = x @ lake.P[a]
    return float(x @ lake.goal)


def random_valid(lake: Lake, max_turns: int, max_actions_per_turn: int) -> float:
    """A uniformly random action at every move, for all the moves the budget allows."""
    _check(max_turns, max_actions_per_turn)
    mean = lake.P.mean(axis=0)
    x = np.zeros(len(lake.goal))
    x[lake.start] = 1.0
    for _ in range(lake.horizon(max_turns, max_actions_per_turn)):
        x = x @ mean
    return float(x @ lake.goal)


def example_copy(lake: Lake, answer: Sequence[str] | str, max_turns: int,
                 max_actions_per_turn: int) -> float:
    """The same ``answer`` every turn (its first K actions; at most ``max_steps`` moves)."""
    _check(max_turns, max_actions_per_turn)
    return sequence_success(lake, _answer_ids(answer, max_actions_per_turn) * max_turns)


def _answers(max_actions_per_turn: int) -> Iterable[tuple[int, ...]]:
    for length in range(1, max_actions_per_turn + 1):
        yield from itertools.product(range(N_ACTIONS), repeat=length)


def best_fixed_answer(lake: Lake, max_turns: int,
                      max_actions_per_turn: int) -> tuple[float, list[str]]:
    """The best answer of 1..K actions repeated every turn: (success probability, its words);
    the first best in order of length, then of gymnasium's action ids. Costs ``4**K`` answers."""
    _check(max_turns, max_actions_per_turn)
    best, best_ids = -1.0, ()
    for ids in _answers(max_actions_per_turn):
        value = sequence_success(lake, list(ids) * max_turns)
        if value > best + 1e-12:
            best, best_ids = value, ids
    return best, [_WORDS[i] for i in best_ids]


def best_fixed(lake: Lake, max_turns: int, max_actions_per_turn: int) -> float:
    return best_fixed_answer(lake, max_turns, max_actions_per_turn)[0]


def optimal(lake: Lake, max_turns: int, max_actions_per_turn: int) -> float:
    """``V_h(s) = max_a sum_s' P_a(s, s') V_{h-1}(s')``, ``V_0`` = 1 on the goal, over all the
    moves allowed."""
    _check(max_turns, max_actions_per_turn)
    value = lake.goal.copy()
    for _ in range(lake.horizon(max_turns, max_actions_per_turn)):
        value = (lake.P @ value).max(axis=0)
    return float(value[lake.start])


def optimal_per_turn(lake: Lake, max_turns: int, max_actions_per_turn: int) -> float:
    """``V_t = max_answer M_answer V_{t-1}`` (per state) over answers of 1..K actions, with the
    moves left (the env's ``max_steps``) counted down."""
    _check(max_turns, max_actions_per_turn)
    n = len(lake.goal)
    answers = {length: [] for length in range(1, max_actions_per_turn + 1)}
    for ids in _answers(max_actions_per_turn):
        matrix = np.eye(n)
        for a in ids:
            matrix = matrix @ lake.P[a]
        answers[len(ids)].append(matrix)
    stacked = {length: np.stack(ms) for length, ms in answers.items()}

    @functools.lru_cache(maxsize=None)
    def value(turns: int, moves: int) -> np.ndarray:
        if turns == 0 or moves == 0:
            return lake.goal
        best = np.zeros(n)
        for length in range(1, min(max_actions_per_turn, moves) + 1):
            best = np.maximum(best, (stacked[length] @ value(turns - 1, moves - length))
                              .max(axis=0))
        return best

    return float(value(max_turns, lake.max_steps)[lake.start])


def references(lake: Lake, max_turns: int, max_actions_per_turn: int,
               example_answer: Sequence[str] | str = DEMO_EXAMPLE_ANSWER) -> dict[str, float]:
    """All lines for one map."""
    return {
        "random_valid": random_valid(lake, max_turns, max_actions_per_turn),
        "example_copy": example_copy(lake, example_answer, max_turns, max_actions_per_turn),
        "best_fixed": best_fixed(lake, max_turns, max_actions_per_turn),
        "optimal_per_turn": optimal_per_turn(lake, max_turns, max_actions_per_turn),
        "optimal": optimal(lake, max_turns, max_actions_per_turn),
    }


def mean_references(seeds: Iterable[int], max_turns: int, max_actions_per_turn: int,
                    example_answer: Sequence[str] | str = DEMO_EXAMPLE_ANSWER,
                    **env_kwargs) -> dict[str, float]:
    """Means of :func:`references` over the maps ``FrozenLakeEnv(**env_kwargs)`` plays for
    ``seeds``."""
    env = FrozenLakeEnv(**env_kwargs)
    rows = []
    for seed in seeds:
        env.reset(seed)
        rows.append(references(Lake.from_env(env), max_turns, max_actions_per_turn,
                               example_answer))
    if not rows:
        raise ValueError("seeds: needs at least one seed")
    return {key: float(np.mean([r[key] for r in rows])) for key in rows[0]}
