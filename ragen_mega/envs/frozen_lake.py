"""FrozenLake as a text game, backed by gymnasium's own FrozenLake.

gymnasium does the dynamics (slippery moves, holes, goal, reward 1 on the goal); this class adds
what the model needs: a seeded random map per episode (``generate_random_map(size, p, seed)``),
seeded dynamics (gymnasium's ``reset(seed=seed)``), a text grid in RAGEN's symbols, action words,
and invalid-action handling.

As in RAGEN, a slippery step goes the intended way with probability ``success_rate`` (0.8) and
otherwise to one of the two perpendicular directions (gymnasium's ``success_rate`` argument).
Text that is not an action word is an invalid-action step: nothing changes, reward 0, no step
counted. The episode ends on the goal, in a hole, or after ``max_steps`` valid moves (gymnasium's
own ``FrozenLake-v1`` time limit is 100); ``step`` after that raises.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

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


class FrozenLakeEnv(TextEnv):
    """Walk from the top-left corner to the goal G without falling into a hole O."""

    def __init__(self, size: int = 4, p: float = 0.8, is_slippery: bool = True,
                 success_rate: float = 0.8, max_steps: int = 100):
        """``p``: probability that a tile is frozen ice (the rest are holes). gymnasium redraws
        a map until the goal is reachable, so a small ``p`` on a big lake takes long."""
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
        self.size, self.p, self.is_slippery = int(size), float(p), is_slippery
        self.success_rate, self.max_steps = float(success_rate), int(max_steps)
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
        return ("You are solving the FrozenLake puzzle. Avoid the holes and walk to the goal; "
                "reaching the goal gives reward 1, falling into a hole ends the game with 0."
                f"{slip} Moving into the edge of the lake leaves you where you are.\n"
                f"The grid has one row per line. Symbols: {legend}.\n"
                "Actions: Left, Down, Right, Up (one move each; case does not matter).")

    @property
    def valid_actions(self) -> list[str]:
        return list(ACTIONS)

    def reset(self, seed: int) -> str:
        seed = check_seed("frozen_lake", seed)
        desc = generate_random_map(size=self.size, p=self.p, seed=seed)
        if self._gym is None or desc != self._map:  # building gymnasium's table costs ~1 ms
            self._gym = GymFrozenLake(desc=desc, is_slippery=self.is_slippery,
                                      success_rate=self.success_rate)
            self._map = desc
        self._gym.reset(seed=seed)  # re-seeds gymnasium's generator: seeded dynamics
        self._steps, self._done = 0, False
        return self.render()

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        ensure_steppable("frozen_lake", self._gym is not None, self._done)
        index = match_action(action, _ACTION_KEYS)
        if index is None:
            return self.render(), 0.0, False, invalid_action_info(
                unknown_action_reason(action, self.valid_actions))
        self._steps += 1
        before = int(self._gym.s)
        state, reward, terminated, _, _ = self._gym.step(list(ACTIONS.values())[index])
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
    def position(self) -> tuple[int, int]:
        """The player's (row, col)."""
        return divmod(int(self._gym.s), self._gym.ncol)

    def render(self) -> str:
        """The lake as text, one row per line, in RAGEN's symbols."""
        if self._gym is None:
            raise RuntimeError("env 'frozen_lake': call reset(seed) before render()")
        grid = [[TILE_SYMBOLS[bytes(tile)] for tile in row] for row in self.desc]
        r, c = self.position
        tile = bytes(self.desc[r, c])
        grid[r][c] = {b"H": PLAYER_IN_HOLE, b"G": PLAYER_ON_GOAL}.get(tile, PLAYER)
        return "\n".join("".join(row) for row in grid)
