"""NetHack and MiniHack (NLE 1.3, minihack 1.0.2) as text games, as BALROG plays them.

``nethack`` is ``NetHackChallenge-v0``: the whole game, a random role, episodes of up to
``max_steps`` (BALROG's 100 000) actions, aborted when the game's turn counter stands still for
150 actions (NLE's ``no_progress_timeout``, BALROG's setting). Reward is the in-game score's
change; ``info["progression"]`` is BALROG's metric: the highest of the empirical chances of
winning a game that reached each dungeon level and experience level seen so far (BALROG's
``achievements.json``, its ``Dlvl:N`` and ``Xp:N`` rows, in ``data/nethack_progression.json``).
Success is never reported: BALROG scores NetHack by progression only.

``minihack`` plays one of BALROG's eight MiniHack tasks (:data:`TASKS`, or any ``MiniHack-*``
id) with BALROG's settings: a random role, -0.01 for an action that lets no game time pass, 100
actions an episode. Success (and progression 1) is the task solved (NLE's end status
``TASK_SUCCESSFUL``; BALROG reads a final reward of at least 1, the same but on a step that
lets no time pass, where MiniHack pays 0.99).

The observation is BALROG's "hybrid" text (its default, ``balrog/environments/nle/base.py``):
the inventory, then the message, the language observation (:mod:`.nle_language`), the cursor,
and the terminal's map and status lines. The instruction is BALROG's prompt, listing its action
names; the env takes those names (case-insensitive), and, in NetHack, a single letter or digit
to answer the game's questions ("What do you want to eat? [dgh or ?*]"). As in BALROG, a
``--More--`` is paged through in the same step, the pages' messages and rewards summed.

Where this differs from BALROG, and why:

- An action text that names no action is an invalid-action step (the env contract: nothing
  changes, no step counted). BALROG plays a default action instead ("north" in MiniHack,
  "esc" in NetHack).
- Episodes are seeded: ``reset(seed)`` seeds NetHack's generators (NLE's ``seed(core=seed,
  disp=seed)``; NLE 1.3 refuses that on ``NetHackChallenge-v0``, so the env calls the base
  class's). BALROG draws a random seed for every episode.
- Boxoban plays the levels shipped in ``data/boxoban`` (DeepMind's boxoban-levels,
  Apache-2.0): all 3 332 of ``hard``, the first 1 000 of ``medium``'s 450 000 training levels;
  ``reset(seed)`` plays level ``seed`` modulo their number (BALROG downloads them all and picks
  one at random). NLE 1.3 broke minihack's Boxoban reset; the env mends it.
- ``show_map: false`` leaves the terminal's map and status lines out of the observation (24 x
  80 characters, a lot for a small model).
"""
from __future__ import annotations

import abc
import hashlib
import importlib.util
import json
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from nle import nethack as nh

from ragen_mega.envs.base import TextEnv, invalid_action_info
from ragen_mega.envs.checks import check_seed, ensure_steppable, is_int
from ragen_mega.envs.nle_language import NLELanguage

DATA = Path(__file__).parent / "data"
#: BALROG's MiniHack tasks by short name
TASKS = {
    "boxoban_hard": "MiniHack-Boxoban-Hard-v0",
    "boxoban_medium": "MiniHack-Boxoban-Medium-v0",
    "mazewalk_9x9": "MiniHack-MazeWalk-9x9-v0",
    "mazewalk_15x15": "MiniHack-MazeWalk-15x15-v0",
    "corridor_r3": "MiniHack-Corridor-R3-v0",
    "corridorbattle_dark": "MiniHack-CorridorBattle-Dark-v0",
    "quest_easy": "MiniHack-Quest-Easy-v0",
    "quest_medium": "MiniHack-Quest-Medium-v0",
}
OBSERVATION_KEYS = ("glyphs", "blstats", "tty_chars", "tty_cursor", "inv_letters", "inv_strs")
PROGRESSION: dict[str, float] = json.loads((DATA / "nethack_progression.json").read_text())

_COMPASS = {"N": "north", "E": "east", "S": "south", "W": "west", "NE": "northeast",
            "SE": "southeast", "SW": "southwest", "NW": "northwest"}
_MOVES = {**{word: f"move {word}" for word in _COMPASS.values()},
          **{f"far {word}": f"move far {word}" for word in _COMPASS.values()}}
#: BALROG's NetHack action names and their help, in its prompt's order
NETHACK_HELP = {
    **_MOVES,
    "up": "go up a staircase",
    "down": "go down a staircase (tip: you can only go down if you are standing on the stairs)",
    "wait": "rest one move while doing nothing",
    "more": "display more of the message (tip: ONLY ever use when current message ends with "
            "--More--)",
    "annotate": "leave a note about the level", "apply": "apply (use) a tool",
    "call": "name a monster or object, or add an annotation", "cast": "cast a spell",
    "close": "close an adjacent door", "open": "open an adjacent door",
    "dip": "dip an object into something", "drop": "drop an item",
    "droptype": "drop specific item types (specify in the next prompt)",
    "eat": "eat something (tip: replenish food when hungry)", "esc": "exit menu or message",
    "engrave": "engrave writing on the floor (tip: Elbereth)",
    "enhance": "advance or check weapons skills", "fire": "fire ammunition from quiver",
    "fight": "fight a monster (even if you only guess one is there)", "force": "force a lock",
    "inventory": "show your inventory", "invoke": "invoke ", "jump": "jump to a location",
    "kick": "kick an enemy or a locked door or chest", "look": "look at what is under you",
    "loot": "loot a box on the floor",
    "monster": "use a monster's special ability (when polymorphed)",
    "offer": "offer a sacrifice to the gods (tip: on an aligned altar)",
    "overview": "display an overview of the dungeon", "pay": "pay your shopping bill",
    "pickup": "pick up things at the current location", "pray": "pray to the gods for help",
    "puton": "put on an accessory", "quaff": "quaff (drink) something",
    "quiver": "select ammunition for quiver", "read": "read a scroll or spellbook",
    "remove": "remove an accessory", "rub": "rub a lamp or a stone",
    "search": "search for hidden doors and passages",
    "swap": "swap wielded and secondary weapons", "takeoff": "take off one piece of armor",
    "takeoffall": "take off all armor",
    "teleport": "teleport to another level (if you have the ability)",
    "throw": "throw something (e.g. a dagger or dart)",
    "travel": "travel to a specific location on the map (tip: in the next action, specify > or "
              "< for stairs, { for fountain, and _ for altar)",
    "twoweapon": "toggle two-weapon combat", "untrap": "untrap something",
    "wear": "wear a piece of armor", "wield": "wield a weapon", "wipe": "wipe off your face",
    "zap": "zap a wand", "minus": "-", "space": " ", "apos": "'",
    **{str(digit): str(digit) for digit in range(10)},
}
#: BALROG's MiniHack action names and their help (a task offers those its actions have)
MINIHACK_HELP = {
    **_MOVES,
    "up": "go up the stairs", "down": "go down the stairs",
    "wait": NETHACK_HELP["wait"], "more": "display more of the message",
    **{name: NETHACK_HELP[name] for name in ("apply", "close", "open")},
    "eat": "eat something",
    **{name: NETHACK_HELP[name] for name in ("force", "kick", "loot")},
    "pickup": "pick up things at the current location if there are any",
    **{name: NETHACK_HELP[name] for name in ("pray", "puton", "quaff", "search", "zap")},
}
_NETHACK_PROMPT = """\
You are an agent playing NetHack. The following are the possible actions you can take in the \
game, followed by a short description of each action:

{actions}.

Tips:
- When the message asks for a completion, such as: "What do you want to eat? [d or ?*]", you \
should respond with a single character corresponding to the item you want to eat/use.
    - For example, "What do you want to eat? [dgh or ?*]" -> Possible answers are "d", "g", or \
"h" to eat the associated food.
- When the message asks for a direction, such as: "In what direction?" you should respond with \
a direction.
- When the message has --More-- at the end, your next action should be "more" to see the rest \
of the message.
- Explore the environment to find the stairs down to the next level.
- Always carefully read the last message to understand the current state of the game and decide \
your next action accordingly.
- If you keep moving in the same direction, you will eventually hit a wall and stop moving. Your \
message might be: "It's solid stone", or "It's a wall". Change your action to move in another \
direction to continue exploring the environment.
- Read the language observation carefully and look at ascii map or image observation provided \
to decide the next action to take and where to move next.
- You can attack monsters by moving into them.

In a moment I will present a history of actions and observations from the game.
Your goal is to get as far as possible in the game.

PLAY!"""
_MINIHACK_PROMPT = """\
You are an agent playing MiniHack. The following are the possible actions you can take in the \
game, followed by a short description of each action:

{actions}.

In a moment I will present a history of actions and observations from the game.

Tip: there is no point in outputting the same action over and over if nothing changes.

{goal}

PLAY!"""
#: BALROG's goal sentence by the first word found in the lowercased task id
_GOALS = (
    ("corridor", "Your goal is to explore the level and reach the stairs down"),
    ("quest", "Your goal is to explore the level, fight monsters, and navigate rooms and mazes "
              "to ultimately reach the stairs down."),
    ("boxoban", "You are playing Boxoban, a box-pushing game inspired by Sokoban. Your goal is "
                "to push the boulders onto the fountains on the map. You can push the boulders "
                "by walking into them, as long as there are no obstacles behind them."),
    ("", "Your goal is to get as far as possible in the game."),
)
_ANSWERS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
    chr(c) for c in range(ord("A"), ord("Z") + 1)] + [str(d) for d in range(10)]


def action_name(action) -> str:
    """BALROG's name of an NLE action (the language wrapper's first name for it)."""
    kind = type(action).__name__   # CompassDirection, CompassCardinalDirectionLonger, ...
    if kind.startswith("Compass"):
        return ("far " if kind.endswith("Longer") else "") + _COMPASS[action.name]
    return "turnundead" if action == nh.Command.TURN else action.name.lower()


def _import_minihack() -> None:
    """Import minihack (it registers its ids), with what minihack 1.0.2 needs and lacks here:
    ``pkg_resources``, gone from setuptools 81 (minihack asks it only for its data folder),
    and the Boxoban levels, read from :data:`DATA` instead of a download."""
    if "minihack" in sys.modules:
        return
    if importlib.util.find_spec("pkg_resources") is None:
        shim = types.ModuleType("pkg_resources")
        shim.resource_filename = lambda package, name: str(
            Path(importlib.util.find_spec(package).origin).parent / name)
        sys.modules["pkg_resources"] = shim
    import minihack.envs.boxohack as boxohack

    boxohack.LEVELS_PATH = str(DATA / "boxoban")


class NLETextEnv(TextEnv):
    """An NLE game behind :class:`TextEnv`; :class:`NetHackEnv` and :class:`MiniHackEnv` say
    which game and how it is scored. See the module docstring."""

    def __init__(self, env_id: str, max_steps: int, show_map: bool, **nle_kwargs):
        if not is_int(max_steps) or max_steps < 1:
            raise ValueError(f"{self.name}: max_steps must be an int >= 1, got {max_steps!r}")
        if not isinstance(show_map, bool):
            raise ValueError(f"{self.name}: show_map must be true or false, got {show_map!r}")
        self.env_id, self.max_steps, self.show_map = env_id, int(max_steps), show_map
        self._env = gym.make(env_id, observation_keys=OBSERVATION_KEYS, character="@",
                             savedir=None, save_ttyrec_every=0, **nle_kwargs).unwrapped
        self._env._max_episode_steps = self.max_steps   # gymnasium's make keeps it for itself
        self._actions = self._action_table()
        self._more = self._env.actions.index(nh.MiscAction.MORE) if (
            nh.MiscAction.MORE in self._env.actions) else None
        self._language = NLELanguage()
        self._obs: dict[str, np.ndarray] = {}
        self._text = ""
        self._started = self._done = False
        #: BALROG's progression of the episode so far (every step's info carries it)
        self.progression = 0.0

    @abc.abstractmethod
    def _action_table(self) -> dict[str, int]:
        """The action texts the env takes, each to its index in NLE's action list."""

    @property
    def valid_actions(self) -> list[str]:
        return list(self._actions)

    def _action_index(self, action: object) -> int | None:
        """The action a text names (a name in any case; a letter as it is), or None."""
        if not isinstance(action, str) or len(action) > 40:
            return None
        text = action.strip()
        if text in self._actions:
            return self._actions[text]
        text = " ".join(text.lower().split())
        return self._actions.get(text) if len(text) > 1 else None

    def reset(self, seed: int) -> str:
        seed = check_seed(self.name, seed)
        self._seed(seed)
        self._obs = self._env.reset()[0]
        self._started, self._done, self.progression = True, False, 0.0
        self._text = self._render(self._language.message(self._obs["tty_chars"]))
        return self._text

    def _seed(self, seed: int) -> None:
        self._env.seed(seed, seed, False)

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        ensure_steppable(self.name, self._started, self._done)
        index = self._action_index(action)
        if index is None:
            return self._text, 0.0, False, invalid_action_info(
                "not an action of this game" + (f": {action[:40]!r}"
                                                if isinstance(action, str) else ""),
                progression=self.progression)
        before = self._obs["tty_chars"].copy()
        reward, message, end_status = self._play(index)
        self._text = self._render(message)
        info = {"action_is_valid": True,
                "action_is_effective": not np.array_equal(before, self._obs["tty_chars"]),
                "end_status": end_status, **self._score(end_status)}
        return self._text, reward, self._done, info

    def _play(self, index: int) -> tuple[float, str, int]:
        """One action, then ``more`` while the message ends in ``--More--`` (BALROG's
        AutoMore): the rewards summed, the pages' messages joined, NLE's end status."""
        total, message = 0.0, ""
        while True:
            with warnings.catch_warnings():   # NLE's note when an aborted game quits
                warnings.filterwarnings("ignore", message=".*smooth quitting")
                self._obs, reward, terminated, truncated, info = self._env.step(index)
            total += float(reward)
            self._done = bool(terminated or truncated)
            message += self._language.message(self._obs["tty_chars"])
            if "--More--" not in message or self._done or self._more is None:
                return total, message, int(info["end_status"])
            message, index = message.replace("--More--", "\n"), self._more

    @abc.abstractmethod
    def _score(self, end_status: int) -> dict[str, Any]:
        """``success``, ``progression`` (also kept in :attr:`progression`) and the game's own
        figures, after a step."""

    def _render(self, message: str) -> str:
        """BALROG's hybrid observation: inventory, then message, language observation,
        cursor and map."""
        obs, language = self._obs, self._language
        cursor = (f"{language.cursor(obs['glyphs'], obs['blstats'], obs['tty_cursor'])}\n"
                  f"(x={obs['tty_cursor'][1]}, y={obs['tty_cursor'][0]})")
        fields = [("message", message),
                  ("language observation", language.glyphs(obs["glyphs"], obs["blstats"])),
                  ("cursor", cursor)]
        if self.show_map:
            fields.append(("map", "".join(bytes(row).decode("latin-1") + "\n"
                                          for row in obs["tty_chars"][1:])))
        inventory = language.inventory(obs["inv_strs"], obs["inv_letters"])
        return (f"inventory:\n{inventory}\n\n"
                + "\n".join(f"{name}:\n{value}\n" for name, value in fields))

    def state_key(self, observation: str) -> str:
        """The map and the inventory: the message and the turn counter do not make the state."""
        if not self._obs:
            return observation
        digest = hashlib.sha256(self._obs["glyphs"].tobytes())
        digest.update(self._obs["inv_strs"].tobytes())
        return digest.hexdigest()[:16]

    def close(self) -> None:
        self._env.close()


class NetHackEnv(NLETextEnv):
    """``NetHackChallenge-v0`` with BALROG's settings and progression; see the module
    docstring."""

    def __init__(self, max_steps: int = 100_000, show_map: bool = True):
        super().__init__("NetHackChallenge-v0", max_steps, show_map, no_progress_timeout=150)
        self._deepest, self._best_xp = 1, 1

    @property
    def instruction(self) -> str:
        return _NETHACK_PROMPT.format(actions=",\n".join(
            f"{name}: {text}" for name, text in NETHACK_HELP.items()))

    def _action_table(self) -> dict[str, int]:
        """BALROG's: the names of NLE's ``USEFUL_ACTIONS``, then a letter or digit for each
        key that is an action (answers to the game's questions; BALROG lists all 62)."""
        actions = list(self._env.actions)
        table = {action_name(a): actions.index(a) for a in nh.USEFUL_ACTIONS if a in actions}
        keys = {int(a): i for i, a in enumerate(actions)}
        table.update({char: keys[ord(char)] for char in _ANSWERS if ord(char) in keys})
        return table

    def _seed(self, seed: int) -> None:
        # NLE 1.3's NetHackChallenge replaces its game's seeding methods to refuse seeds; drop
        # the replacements and seed as every NLE env does
        for method in ("set_initial_seeds", "set_current_seeds", "get_current_seeds"):
            vars(self._env.nethack).pop(method, None)
        nle_base = type(self._env).__mro__[1]
        nle_base.seed(self._env, seed, seed, False)
        self._deepest, self._best_xp = 1, 1

    def _score(self, end_status: int) -> dict[str, Any]:
        depth, xp = (int(self._obs["blstats"][i]) for i in (nh.NLE_BL_DEPTH, nh.NLE_BL_XP))
        for key in (f"Xp:{xp}", f"Dlvl:{depth}"):   # (all 0 once the game is over)
            self.progression = max(self.progression, PROGRESSION.get(key, 0.0))
        self._deepest, self._best_xp = max(self._deepest, depth), max(self._best_xp, xp)
        return {"success": False, "progression": self.progression,
                "max_depth": self._deepest, "max_experience_level": self._best_xp}


class MiniHackEnv(NLETextEnv):
    """One of BALROG's MiniHack tasks; see the module docstring."""

    def __init__(self, task: str = "mazewalk_9x9", max_steps: int = 100, show_map: bool = True):
        _import_minihack()
        env_id = TASKS.get(task, task)
        if not (isinstance(env_id, str) and env_id.startswith("MiniHack-")
                and env_id in gym.registry):
            raise ValueError(f"minihack: unknown task {task!r}; BALROG's tasks: "
                             f"{', '.join(TASKS)}, or a MiniHack-* id")
        self.task = task
        super().__init__(env_id, max_steps, show_map, penalty_step=-0.01, penalty_time=0.0,
                         penalty_mode="constant", autopickup=False)
        self._levels = sorted(getattr(self._env, "_levels", ()))   # Boxoban's, in a fixed order

    def _action_table(self) -> dict[str, int]:
        """BALROG's: the task's actions that BALROG's MiniHack prompt names."""
        return {action_name(a): i for i, a in enumerate(self._env.actions)
                if action_name(a) in MINIHACK_HELP}

    @property
    def instruction(self) -> str:
        actions = ",\n".join(f"{name}: {MINIHACK_HELP[name]}" for name in self.valid_actions)
        goal = next(text for word, text in _GOALS if word in self.env_id.lower())
        return _MINIHACK_PROMPT.format(actions=actions, goal=goal)

    def _seed(self, seed: int) -> None:
        super()._seed(seed)
        if self._levels:
            # Boxoban draws its level with the global ``random``: give it one to draw; and NLE
            # 1.3's reset reads a field minihack's Boxoban sets only after it
            self._env._levels = [self._levels[seed % len(self._levels)]]
            self._env._goal_pos_set = set()

    def _score(self, end_status: int) -> dict[str, Any]:
        solved = end_status == self._env.StepStatus.TASK_SUCCESSFUL
        self.progression = float(solved)
        return {"success": solved, "progression": self.progression}
