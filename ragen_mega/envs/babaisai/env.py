"""BabaIsAI (BALROG's and Verlog's Baba Is You puzzles) as a :class:`TextEnv`.

``make("babaisai", task="two_room-goto_win")``; ``task`` is any of the 40 ids of BALROG's list
(:data:`ragen_mega.envs.babaisai.levels.TASKS`; BALROG's ``env/`` prefix is accepted). Actions:
``idle``, ``up``, ``right``, ``down``, ``left``.

Rewards are the original engine's: ``1 - 0.9 * steps / max_steps`` on the winning step (counting
it), ``-1`` on stepping onto a LOSE object, else 0; ``binary_reward`` makes a win pay 1.0
(Verlog's training setting). The episode ends on a win, a loss, after ``max_steps`` valid actions
(100, as in BALROG), or -- our choice -- once no object is YOU and no transform rule can act, as
nothing can move again. The original engine idles on until the step limit, and BALROG's wrapper
starts a new level inside the same episode, which would break "one seed, one episode".

``idle`` and a move into a wall are valid steps that change nothing (``action_is_effective``
False).
"""
from __future__ import annotations

from typing import Any

from ragen_mega.envs.babaisai.grid import DIRECTIONS, Grid, parse_level
from ragen_mega.envs.babaisai.levels import TASKS, generate
from ragen_mega.envs.babaisai.text_view import render
from ragen_mega.envs.base import TextEnv, invalid_action_info
from ragen_mega.envs.checks import check_seed, ensure_steppable, is_int
from ragen_mega.envs.text_actions import match_action, unknown_action_reason

ACTIONS = ["idle", *DIRECTIONS]

INSTRUCTION = """\
You are playing BabaIsAI, a puzzle version of the game Baba Is You, on a grid with an outer \
wall. The rules of the game are word blocks lying on the grid: three words in a line, read left \
to right or top to bottom, make a rule such as "baba is you" (you move every baba), "key is win" \
(stepping onto a key wins), "wall is stop" (walls cannot be entered). Pushing a word block out of \
its line breaks that rule; lining words up makes a new one. Rules are updated after every move.
You push a word block by walking into it; a row of blocks is pushed together, unless the outer \
wall or something that is STOP is behind it. Word blocks cannot be walked over; objects can, \
unless they are STOP. Some puzzles need you to break a rule or make a new one before you can \
win, and a rule can even make you another object.
Each turn you see the active rules and every object and word block (written rule `word`) with \
its position counted in steps from you. The outer wall is not listed.
Actions: up, right, down, left move you one cell; idle waits. Win by stepping onto an object \
that is WIN, in as few moves as you can."""


class BabaIsAIEnv(TextEnv):
    """One BabaIsAI level per episode; see the module docstring for rules and rewards."""

    def __init__(self, task: str = "two_room-goto_win", max_steps: int = 100,
                 add_ruleset: bool = True, binary_reward: bool = False):
        """``add_ruleset``: show the "Active rules" section; ``binary_reward``: a win pays 1.0
        whatever its step."""
        name = task.removeprefix("env/") if isinstance(task, str) else None
        if name not in TASKS:
            raise ValueError(f"babaisai: unknown task {task!r}; use one of: {', '.join(TASKS)}")
        if not is_int(max_steps) or max_steps < 1:
            raise ValueError(f"babaisai: max_steps must be an int >= 1, got {max_steps!r}")
        for key, value in (("add_ruleset", add_ruleset), ("binary_reward", binary_reward)):
            if not isinstance(value, bool):
                raise ValueError(f"babaisai: {key} must be true or false, got {value!r}")
        self.task, self.max_steps = name, max_steps
        self.add_ruleset, self.binary_reward = add_ruleset, binary_reward
        self._grid: Grid | None = None
        self._steps = 0
        self._done = False

    @property
    def instruction(self) -> str:
        return INSTRUCTION

    @property
    def valid_actions(self) -> list[str]:
        return list(ACTIONS)

    @property
    def grid(self) -> Grid:
        """The level in play (for tests and tools)."""
        if self._grid is None:
            raise RuntimeError("env 'babaisai': call reset(seed) before reading the grid")
        return self._grid

    @property
    def steps(self) -> int:
        return self._steps

    def reset(self, seed: int) -> str:
        return self._start(generate(self.task, check_seed("babaisai", seed)))

    def load_level(self, level: str | Grid) -> str:
        """Start an episode on a hand-made level (the text of
        :func:`~ragen_mega.envs.babaisai.grid.parse_level`, or a grid)."""
        return self._start(parse_level(level) if isinstance(level, str) else level.copy())

    def render(self) -> str:
        return render(self.grid, self.add_ruleset)

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        ensure_steppable("babaisai", self._grid is not None, self._done)
        index = match_action(action, ACTIONS)
        if index is None:
            return self.render(), 0.0, False, invalid_action_info(
                unknown_action_reason(action, ACTIONS))
        self._steps += 1
        grid, before = self._grid, self._grid.state_key()
        won = lost = False
        if ACTIONS[index] != "idle":
            result = grid.step(ACTIONS[index])
            won, lost = result.won, result.lost
        reward = 0.0
        if won:
            reward = 1.0 if self.binary_reward else 1.0 - 0.9 * self._steps / self.max_steps
        elif lost:
            reward = -1.0
        stuck = not grid.you_things() and not grid.can_change_without_you()
        self._done = won or lost or stuck or self._steps >= self.max_steps
        info = {"action_is_valid": True, "action_is_effective": grid.state_key() != before,
                "success": won, "no_you_left": stuck}
        return self.render(), reward, self._done, info

    def _start(self, grid: Grid) -> str:
        self._grid, self._steps, self._done = grid, 0, False
        return self.render()
