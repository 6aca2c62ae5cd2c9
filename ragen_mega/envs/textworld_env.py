"""TextWorld (textworld 1.7.0) as a text game, after BALROG's wrapper.

BALROG's three tasks (``coin_collector``, ``treasure_hunter``, ``the_cooking_game``), each a pool
of ``games`` seeded games (:mod:`ragen_mega.envs.textworld_games`; BALROG plays 25 a task):
``reset(seed)`` plays game ``seed % games`` of ``split``. The instruction is BALROG's prompt for
the task (``balrog/environments/textworld/__init__.py``, its PDF-copy slips mended and the step
count this env's ``max_steps``); the observation is the game's own text, as BALROG shows it
(runs of blank lines made one).
Actions are free text: a command the game would take now (textworld's admissible commands),
or ``goal``, ``look``, ``inventory``. Reward is score progress, normalised so an episode's
return is the score over the maximum; ``info["progression"]`` is BALROG's metric,
``max(score / max_score, won)``; success is the game won. The episode ends when the game is won
or lost, or after ``max_steps`` commands (BALROG's 80).

Where this differs from BALROG, and why:

- BALROG cuts the objective out of every observation, so the agent never reads it (in
  ``treasure_hunter`` it then cannot know which object to take; a wrong one loses). Here the
  first observation starts with it, as intelligent-go-explore (where BALROG's games come from)
  shows it, and ``goal`` prints it.
- BALROG sends any text to the game's parser, and every reply ("That's not a verb I
  recognise.") uses one of the 80 steps. Here a command the game would not take now is an
  invalid-action step (the env contract: nothing changes, no step counted); the rollout's turn
  limit (``env.max_turns``, 80 as BALROG) still counts it.
- ``show_commands: true`` adds the admissible commands to each observation (BALROG never
  shows them; off by default).

``action_is_effective``: the command changed the game's state (its facts). :meth:`state_key` is
the game state itself (GiGPO's anchor states), not the text: ``goal`` prints the same words in
every room.
"""
from __future__ import annotations

import hashlib
import re
import warnings
from typing import Any

from ragen_mega.envs.base import TextEnv, invalid_action_info
from ragen_mega.envs.checks import check_seed, ensure_steppable, is_int
from ragen_mega.envs.text_actions import normalize_action
from ragen_mega.envs.textworld_games import LOCK, check_task, game_path, walkthrough

#: commands the game always takes; they change nothing
INFO_COMMANDS = ("goal", "look", "inventory")
#: the command words of each task, as BALROG's prompt lists them
COMMANDS = {
    "coin_collector": ["go north", "go south", "go east", "go west", "take coin", "goal"],
    "treasure_hunter": ["look", "goal", "inventory", "go <dir>", "open ...", "drop ...",
                        "take ...", "put ... on ...", "take ... from ...", "insert ... into ...",
                        "unlock ... with ..."],
    "the_cooking_game": ["look", "goal", "inventory", "go <dir>", "examine ...", "eat ...",
                         "open ...", "drop ...", "take ...", "put ... on ...",
                         "take ... from ...", "insert ... into ...", "lock ... with ...",
                         "unlock ... with ...", "cook ... with ...", "slice ... with ...",
                         "chop ... with ...", "dice ... with ...", "prepare meal"],
}

_COMMON = """\
You are an agent playing TextWorld, a text-based adventure game where you {setting}.
Here are the available commands:
{commands}
"""
INSTRUCTIONS = {
    "coin_collector": _COMMON + """\
The only action you can do is go <dir> to explore the maze and 'take coin' when you see the coin
in the room. You have {max_steps} steps to complete the task. Restarting is forbidden.""",
    "treasure_hunter": _COMMON + """\
- The target object might be located in a closed or locked container.
- The adjective is useful for determining whether the key is matched with the lock (e.g.
  non-euclidean keycard is matched with non-euclidean safe). Make sure it is matched to unlock!
- The key required to unlock the door may be in another room or locked inside a container.
- Take the key whenever you can.
- After unlocking a locked door or container, it will remain closed. You will then need to
  open it.
You have {max_steps} steps to complete the task. Restarting is forbidden.""",
    "the_cooking_game": _COMMON + """\
- You can examine the cookbook to see the recipe when it is visible.
- The BBQ is for grilling things, the stove is for frying things, the oven is for roasting
  things. Cooking ingredients in the wrong way will lead to a failure of the game.
- Once you have got processed ingredients and the appropriate cooking tool ready, cook all of
  them according to the recipe.
- There are two conditions to correctly cook something (grill/fry/roast): a) the ingredient you
  want to cook is in your inventory and b) there is a suitable cooking tool in the room, and
  then use 'cook ... with ...' command.
- When you need to chop/slice/dice ingredients, you need to take the knife and the ingredient
  in your inventory and then 'slice/chop/dice ... with knife'.
- Make sure to first process the food (chop/slice/dice) before you try to cook them.
- When you have all the ingredients (that got processed or cooked according to the menu), you
  can 'prepare meal' in the kitchen and then 'eat meal' to win the game.
- The ingredients should EXACTLY match the color in the recipe, but if the recipe doesn't
  specify color, any color would be fine. When you 'take ... with ...', use the EXACT name you
  see.
- You don't need to examine the container/supporter (e.g. toolbox) when it says something like
  "there isn't a thing on it"/"has nothing on it".
You have {max_steps} steps to complete the task. Restarting is forbidden.""",
}
_SETTINGS = {
    "coin_collector": "are in a randomly generated maze and must find the coin. You need to "
                      "explore different rooms to find the target object",
    "treasure_hunter": "are in a randomly generated maze and must find a specific object. You "
                       "need to explore different rooms to find the target object",
    "the_cooking_game": "navigate through different rooms, interact with objects, and solve "
                        "puzzles. Your goal is to first find the recipe, find and prepare food "
                        "according to the recipe, and finally prepare and eat the meal",
}
_HELP = {
    "look": "describe the current room", "goal": "print the goal of this game",
    "inventory": "print the player's inventory",
    "go <dir>": "move the player north, east, south or west. You can only go in the direction "
                "indicated with an exit or a door",
    "examine ...": "examine something more closely", "eat ...": "eat edible food",
    "open ...": "open a door or a container. You need to open a closed door before you can go "
                "through it",
    "drop ...": "drop an object on the floor", "take ...": "take an object that is visible",
    "put ... on ...": "place an object on a supporter",
    "take ... from ...": "take an object from a container or a supporter",
    "insert ... into ...": "place an object into a container",
    "lock ... with ...": "lock a door or a container with a key",
    "unlock ... with ...": "unlock a door or a container with a key (a matched key in your "
                           "inventory)",
    "cook ... with ...": "cook cookable food with something providing heat",
    "slice ... with ...": "slice cuttable food with something sharp",
    "chop ... with ...": "chop cuttable food with something sharp",
    "dice ... with ...": "dice cuttable food with something sharp",
    "prepare meal": "combine ingredients from inventory into a meal (only in the kitchen)",
    "take coin": "win the game by 'take coin' if you see the coin in the room",
}
# the Z-machine's prompt and status line ("> ... -= Room =-score/moves") after each reply
_STATUS = re.compile(r"\n>[^\n]*$")
_BLANK_LINES = re.compile(r"\n{3,}")


def _clean(feedback: str) -> str:
    """The game's reply without the status line, runs of blank lines made one."""
    return _BLANK_LINES.sub("\n\n", _STATUS.sub("", feedback)).strip()


class TextWorldEnv(TextEnv):
    """A TextWorld game behind :class:`TextEnv`; see the module docstring."""

    def __init__(self, task: str = "coin_collector", level: int | None = None,
                 games: int = 25, split: str = "train", max_steps: int = 80,
                 show_commands: bool = False, cache_dir: str | None = None):
        check_task(task, level, split, games)
        if not is_int(max_steps) or max_steps <= 0:
            raise ValueError(f"textworld: max_steps must be a positive int, got {max_steps!r}")
        if not isinstance(show_commands, bool):
            raise ValueError(f"textworld: show_commands must be true or false, got "
                             f"{show_commands!r}")
        self.task, self.level, self.games, self.split = task, level, int(games), split
        self.max_steps, self.show_commands = int(max_steps), show_commands
        self.cache_dir = cache_dir
        self._game = self._path = None
        self._state: Any = None
        self._obs = ""
        self._steps, self._done = 0, False

    @property
    def instruction(self) -> str:
        commands = "\n".join(f"- {c}: {_HELP.get(c, '')}".rstrip(": ")
                             for c in COMMANDS[self.task])
        return INSTRUCTIONS[self.task].format(setting=_SETTINGS[self.task], commands=commands,
                                              max_steps=self.max_steps)

    @property
    def valid_actions(self) -> list[str]:
        return list(COMMANDS[self.task])

    def game_file(self, seed: int) -> str:
        """The ``.z8`` file ``reset(seed)`` plays (generated on first use)."""
        return str(game_path(self.task, self.level, self.split,
                             check_seed(self.name, seed) % self.games, self.cache_dir))

    def walkthrough(self, seed: int) -> list[str]:
        """The game's winning commands as textworld recorded them (not always the shortest)."""
        return walkthrough(self.game_file(seed))

    def reset(self, seed: int) -> str:
        with LOCK:
            return self._reset(seed)

    def _reset(self, seed: int) -> str:
        import textworld

        path = self.game_file(seed)
        if path != self._path:
            self.close()
            infos = textworld.EnvInfos(objective=True, score=True, max_score=True, won=True,
                                       lost=True, admissible_commands=True, facts=True)
            with warnings.catch_warnings():  # jericho's own score tracking: textworld keeps its
                warnings.filterwarnings("ignore", message=".*is not fully supported")
                self._game = textworld.start(path, request_infos=infos)
            self._path = path
        self._state = self._game.reset()
        feedback, objective = self._state.feedback, self._state["objective"]
        # the banner goes, as in BALROG; the objective stays (BALROG cuts it: module docstring)
        start = feedback.find(objective)
        self._obs = self._view(_clean(feedback[start:] if start >= 0 else feedback))
        self._steps, self._done = 0, False
        return self._obs

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        ensure_steppable(self.name, self._game is not None, self._done)
        command = (normalize_action(action) if isinstance(action, str) and len(action) < 200
                   else None)   # no command is 200 characters long: skip the work
        admissible = self._commands()
        if command not in admissible:
            return self._obs, 0.0, False, invalid_action_info(
                "not a command the game takes now"
                + ("" if command is None else f": {command[:40]!r}"),
                progression=_progression(self._state))
        before = self._state
        with LOCK:
            self._state, _, _ = self._game.step(command)
        self._steps += 1
        state = self._state
        won, lost = bool(state["won"]), bool(state["lost"])
        self._done = won or lost or self._steps >= self.max_steps
        self._obs = self._view(_clean(state.feedback))
        max_score = max(state["max_score"], 1)
        reward = (state["score"] - before["score"]) / max_score
        info = {"action_is_valid": True,
                "action_is_effective": _facts(state) != _facts(before),
                "success": won, "lost": lost, "score": state["score"],
                "max_score": state["max_score"],
                "progression": _progression(state)}
        return self._obs, float(reward), self._done, info

    def state_key(self, observation: str) -> str:
        if self._state is None:
            return observation
        return hashlib.sha256("\n".join(_facts(self._state)).encode()).hexdigest()[:16]

    def close(self) -> None:
        if self._game is not None:
            with LOCK:
                self._game.close()
        self._game = self._path = None

    def admissible_commands(self) -> set[str]:
        """The commands the game would take now (textworld's list, in canonical spelling)."""
        return {normalize_action(c) for c in self._state["admissible_commands"]}

    def _commands(self) -> set[str]:
        return self.admissible_commands() | set(INFO_COMMANDS)

    def _view(self, text: str) -> str:
        if not self.show_commands or self._state is None:
            return text
        return f"{text}\nAdmissible commands: {', '.join(sorted(self._commands()))}"


def _progression(state) -> float:
    """BALROG's TextWorld metric: the score over its maximum, 1 once won."""
    return max(state["score"] / max(state["max_score"], 1), float(state["won"]))


def _facts(state) -> list[str]:
    return sorted(str(fact) for fact in state["facts"])
