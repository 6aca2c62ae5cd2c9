"""FrozenLake as a text game, backed by gymnasium's own FrozenLake.

gymnasium does the dynamics (slippery moves, holes, goal, reward 1 on the goal); this class adds
a seeded random map per episode, seeded dynamics (gymnasium's ``reset(seed=seed)``), a text
observation in RAGEN's symbols (optionally with coordinates), action words, and invalid actions.

Maps (``start_goal``):

- ``"random"`` (default), RAGEN's generator (``ragen/env/frozen_lake/utils.py``,
  ``generate_random_map``): each tile is ice with probability ``p``, else a hole; start and goal
  are two independent uniform cells and overwrite the tile drawn there. A draw whose start equals
  its goal, or whose goal cannot be reached by 4-neighbour moves over non-hole tiles, is redrawn
  whole. Draws are made in RAGEN's order from gymnasium's seeded generator
  (``seeding.np_random(seed)``), so seed ``s`` gives RAGEN's map for ``s``. Start-goal distances
  on 4x4: docs/results.md, "On gymnasium's corner maps".
- ``"corners"``: gymnasium's ``generate_random_map(size, p, seed)``, start top-left, goal
  bottom-right (distance ``2 * (size - 1)``).

As in RAGEN, a slippery step goes the intended way with probability ``success_rate`` (0.8), else
to one of the two perpendicular directions, ``(1 - success_rate) / 2`` each (gymnasium's
``success_rate``; its default, 1/3, makes all three equally likely). ``is_slippery=False`` (or
``success_rate=1``) makes every move go where it is meant to.

``observation_format`` is RAGEN's option: ``"grid"`` (default) the symbol grid; ``"coord"`` the
board size and the zero-indexed (row, col) of start, goal, player and holes, in RAGEN's wording;
``"grid_coord"`` both (RAGEN's ``_3_frozen_lake`` config uses it, as ``CoordFrozenLake``, with
``success_rate: 1``).

The episode ends on the goal, in a hole, or after ``max_steps`` valid moves (gymnasium's
``FrozenLake-v1`` limit is 100); ``step`` after that raises.

Where this differs from RAGEN, and why:

- ``p`` defaults to 0.8 (RAGEN's env config: 0.9, its generator function: 0.85); in both, ``p``
  is the probability of *ice*, not of a hole.
- RAGEN retries a failing ``reset`` with seed ``hash(str(seed))``, which changes with Python's
  hash randomization; here nothing depends on ``hash``, and a valid map is always found (a start
  next to its goal is always valid, so the loop ends quickly for any ``p``).
- The coordinate text drops RAGEN's trailing spaces after ``Coordinates:`` and ``Grid Map:``; the
  instruction states the actual board's coordinate range (RAGEN's ``CoordFrozenLake`` says
  ``(5, 5)`` on a 4x4 board).
- The instruction and invalid-action handling are this project's (RAGEN gives its instruction in
  the config and maps action ids itself).
"""
from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake
from gymnasium.envs.toy_text.frozen_lake import generate_random_map
from gymnasium.utils import seeding

from ragen_mega.envs.base import TextEnv, invalid_action_info
from ragen_mega.envs.checks import check_seed, ensure_steppable, is_int, is_real
from ragen_mega.envs.text_actions import match_action, normalize_action, unknown_action_reason

#: action word -> gymnasium action id (gymnasium's order: LEFT=0, DOWN=1, RIGHT=2, UP=3)
ACTIONS = {"Left": 0, "Down": 1, "Right": 2, "Up": 3}
#: gymnasium map letter -> RAGEN symbol; the start tile is plain ice once the player leaves it
TILE_SYMBOLS = {b"S": "_", b"F": "_", b"H": "O", b"G": "G"}
PLAYER, PLAYER_IN_HOLE, PLAYER_ON_GOAL = "P", "X", "√"
_ACTION_KEYS = [normalize_action(word) for word in ACTIONS]
LEGEND = {"P": "player", "_": "frozen ice", "O": "hole", "G": "goal", "X": "player in hole",
          "√": "player on goal"}
START_GOAL = ("random", "corners")
OBSERVATION_FORMATS = ("grid", "coord", "grid_coord")
_NEIGHBOURS = ((1, 0), (0, 1), (-1, 0), (0, -1))


def action_index(word: object) -> int | None:
    """gymnasium's action id for an action word as the env reads it (case-insensitive), or None."""
    index = match_action(word, _ACTION_KEYS)
    return None if index is None else list(ACTIONS.values())[index]


def reachable(desc: list[str] | np.ndarray, start: tuple[int, int],
              goal: tuple[int, int]) -> bool:
    """Whether ``goal`` can be reached from ``start`` by 4-neighbour moves over non-hole tiles."""
    rows, cols = len(desc), len(desc[0])
    seen, queue = {start}, deque([start])
    while queue:
        r, c = queue.popleft()
        if (r, c) == goal:
            return True
        for dr, dc in _NEIGHBOURS:
            nxt = (r + dr, c + dc)
            if (0 <= nxt[0] < rows and 0 <= nxt[1] < cols and nxt not in seen
                    and desc[nxt[0]][nxt[1]] != "H"):
                seen.add(nxt)
                queue.append(nxt)
    return False


def random_start_goal_map(size: int, p: float, seed: int) -> list[str]:
    """A ``size`` x ``size`` map (rows of S, F, H, G) with start and goal at random cells and a
    path between them, drawn as RAGEN's generator draws it (see the module docstring)."""
    rng, _ = seeding.np_random(seed)
    while True:
        board = rng.choice(["F", "H"], (size, size), p=[p, 1 - p])
        start = tuple(int(v) for v in rng.integers(size, size=2))
        goal = tuple(int(v) for v in rng.integers(size, size=2))
        if start == goal:
            continue
        board[start], board[goal] = "S", "G"
        if reachable(board, start, goal):
            return ["".join(row) for row in board]


def gym_lake(rows: list[str], is_slippery: bool, success_rate: float) -> GymFrozenLake:
    """The gymnasium FrozenLake that plays the map ``rows``: the env's dynamics."""
    return GymFrozenLake(desc=list(rows), is_slippery=is_slippery, success_rate=success_rate)


def make_map(size: int, p: float, seed: int, start_goal: str = "random") -> list[str]:
    """The map ``FrozenLakeEnv(size=size, p=p, start_goal=start_goal).reset(seed)`` plays."""
    if start_goal == "corners":
        return generate_random_map(size=size, p=p, seed=seed)
    return random_start_goal_map(size, p, seed)


class FrozenLakeEnv(TextEnv):
    """Walk from the start to the goal G without falling into a hole O."""

    def __init__(self, size: int = 4, p: float = 0.8, is_slippery: bool = True,
                 success_rate: float = 0.8, max_steps: int = 100, start_goal: str = "random",
                 observation_format: str = "grid"):
        """``p``: probability that a tile is ice, not a hole; with ``start_goal="corners"``
        gymnasium redraws a map until the goal is reachable, so a small ``p`` on a big lake takes
        long. ``start_goal`` and ``observation_format``: see the module docstring."""
        if not is_int(size) or size < 2:
            raise ValueError(f"frozen_lake: size must be an int >= 2, got {size!r}")
        if not is_real(p) or not 0 < p <= 1:
            raise ValueError(f"frozen_lake: p (probability of frozen ice) must be in (0, 1], "
                             f"got {p!r}")
        if not isinstance(is_slippery, bool):
            raise ValueError(f"frozen_lake: is_slippery must be a bool, got {is_slippery!r}")
        if not is_real(success_rate) or not 0 <= success_rate <= 1:
            raise ValueError(f"frozen_lake: success_rate must be in [0, 1], got {success_rate!r}")
        if not is_int(max_steps) or max_steps < 1:
            raise ValueError(f"frozen_lake: max_steps must be an int >= 1, got {max_steps!r}")
        if not isinstance(start_goal, str) or start_goal not in START_GOAL:
            raise ValueError(f"frozen_lake: start_goal must be one of {', '.join(START_GOAL)}, "
                             f"got {start_goal!r}")
        if not isinstance(observation_format, str) or observation_format not in OBSERVATION_FORMATS:
            raise ValueError(f"frozen_lake: observation_format must be one of "
                             f"{', '.join(OBSERVATION_FORMATS)}, got {observation_format!r}")
        self.size, self.p, self.is_slippery = int(size), float(p), is_slippery
        self.success_rate, self.max_steps = float(success_rate), int(max_steps)
        self.start_goal, self.observation_format = start_goal, observation_format
        self._gym: GymFrozenLake | None = None
        self._map: list[str] = []
        self._steps = 0
        self._done = False

    @property
    def instruction(self) -> str:
        legend = ", ".join(f"{sym} {name}" for sym, name in LEGEND.items())
        slip = (f" The ice is slippery: a move goes the intended way with probability "
                f"{self.success_rate:g}, otherwise to one of the two sides."
                if self.is_slippery else "")
        shown = {"grid": "The grid has one row per line.",
                 "coord": "The observation lists the board size and the coordinates of the "
                          "start, the goal, the player and the holes.",
                 "grid_coord": "The observation lists the board size and the coordinates of "
                               "the start, the goal, the player and the holes, then the grid, "
                               "one row per line."}[self.observation_format]
        coords = ("" if self.observation_format == "grid" else
                  f" Coordinates are zero-indexed (row, col): (0, 0) is the top-left corner, "
                  f"({self.size - 1}, {self.size - 1}) the bottom-right; Down adds 1 to the row, "
                  f"Right adds 1 to the col.")
        symbols = "" if self.observation_format == "coord" else f" Symbols: {legend}."
        return ("You are solving the FrozenLake puzzle. Avoid the holes and walk to the goal; "
                "reaching the goal gives reward 1, falling into a hole ends the game with 0."
                f"{slip} Moving into the edge of the lake leaves you where you are.\n"
                f"{shown}{coords}{symbols}\n"
                "Actions: Left, Down, Right, Up (one move each; case does not matter).")

    @property
    def valid_actions(self) -> list[str]:
        return list(ACTIONS)

    def reset(self, seed: int) -> str:
        seed = check_seed("frozen_lake", seed)
        desc = make_map(self.size, self.p, seed, self.start_goal)
        if self._gym is None or desc != self._map:  # rebuild gymnasium's table only on a new map
            self._gym = gym_lake(desc, self.is_slippery, self.success_rate)
            self._map = desc
        self._gym.reset(seed=seed)  # re-seeds gymnasium's generator: seeded dynamics
        self._steps, self._done = 0, False
        return self.render()

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        ensure_steppable("frozen_lake", self._gym is not None, self._done)
        gym_action = action_index(action)
        if gym_action is None:
            return self.render(), 0.0, False, invalid_action_info(
                unknown_action_reason(action, self.valid_actions))
        self._steps += 1
        before = int(self._gym.s)
        state, reward, terminated, _, _ = self._gym.step(gym_action)
        success = self.desc[self.position] == b"G"
        self._done = bool(terminated) or self._steps >= self.max_steps
        info = {"action_is_valid": True, "action_is_effective": int(state) != before,
                "success": bool(success)}
        return self.render(), float(reward), self._done, info

    @property
    def desc(self) -> np.ndarray:
        """gymnasium's map of the current episode: bytes letters S, F, H, G."""
        return self._gym.desc

    @property
    def map_rows(self) -> list[str]:
        """The current episode's map as rows of the letters S, F, H, G."""
        return list(self._map)

    @property
    def transitions(self) -> dict[int, dict[int, list[tuple[float, int, float, bool]]]]:
        """gymnasium's transition table of the current map, which ``step`` samples from:
        ``P[state][action] = [(prob, next_state, reward, terminated), ...]``, states
        ``row * size + col``, actions as in :data:`ACTIONS`; holes and the goal are absorbing."""
        if self._gym is None:
            raise RuntimeError("env 'frozen_lake': call reset(seed) before reading transitions")
        return self._gym.P

    @property
    def start_state(self) -> int:
        """The start tile's state number (``row * size + col``)."""
        return int(np.flatnonzero(self.desc.ravel() == b"S")[0])

    @property
    def position(self) -> tuple[int, int]:
        """The player's (row, col)."""
        return divmod(int(self._gym.s), self._gym.ncol)

    def render(self) -> str:
        """The observation text: grid, coordinates, or both (``observation_format``)."""
        if self._gym is None:
            raise RuntimeError("env 'frozen_lake': call reset(seed) before render()")
        if self.observation_format == "grid":
            return self._grid()
        if self.observation_format == "coord":
            return self._coordinates()
        return f"Coordinates:\n{self._coordinates()}\nGrid Map:\n{self._grid()}"

    def _grid(self) -> str:
        """The lake, one row per line, in RAGEN's symbols."""
        grid = [[TILE_SYMBOLS[bytes(tile)] for tile in row] for row in self.desc]
        r, c = self.position
        tile = bytes(self.desc[r, c])
        grid[r][c] = {b"H": PLAYER_IN_HOLE, b"G": PLAYER_ON_GOAL}.get(tile, PLAYER)
        return "\n".join("".join(row) for row in grid)

    def _coordinates(self) -> str:
        """RAGEN's coordinate text: board size, then Start, Goal, the player, Holes (if any)."""
        rows, cols = self.desc.shape

        def cells(letter: bytes) -> list[tuple[int, int]]:
            return [(r, c) for r in range(rows) for c in range(cols) if self.desc[r, c] == letter]

        r, c = self.position
        player = {b"G": "Player on goal", b"H": "Player in hole"}.get(bytes(self.desc[r, c]),
                                                                     "Player")
        lines = [f"Board size: {rows} rows x {cols} cols (zero-indexed)."]
        for label, coords in [("Start", cells(b"S")), ("Goal", cells(b"G")), (player, [(r, c)]),
                              ("Holes", cells(b"H"))]:
            if coords:
                lines.append(f"{label}: " + ", ".join(f"({i}, {j})" for i, j in coords))
        return "\n".join(lines)
