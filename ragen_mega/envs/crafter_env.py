"""Crafter (crafter 1.8.3) as a text game: reproducible, and without drawing images.

Two changes to crafter, each the smallest override that does it (:class:`ReproducibleCrafter`):

1. Reproducibility. crafter keeps each 12x12 chunk's objects in a ``set``
   (``engine.World._chunks``), and objects hash by memory address. Every 10th step
   ``Env._balance_chunk`` lists that set and, when a chunk holds too many cows, zombies or
   skeletons, despawns ``creatures[random.randint(len(creatures))]``: which one goes depends on
   memory addresses, so the same seed and actions give different worlds in different processes,
   even in one process after other episodes. All else is deterministic: world generation and
   creatures draw from the world's seeded RandomState, other containers are lists and
   insertion-ordered dicts, and ``hash((seed, episode))`` of ints is not salted by
   PYTHONHASHSEED. Fix: ``_balance_chunk`` gets the chunk's objects sorted by position (one
   object per cell, so the order is total).
2. Speed. ``Env.step`` renders a 64x64 image every step (most of its time); the text needs none,
   so ``_obs`` returns None. Rendering is not pure: at night ``LocalView._noise`` draws darkness
   noise from the *world's* RandomState, so skipping it would change every later cow move and
   spawn. ``_obs`` therefore draws the same random numbers (same shape and order) and paints
   nothing, and the game stays step-for-step equal to crafter with rendering (tests check this
   over a night).

``reset(seed)`` plays the first episode of ``crafter.Env(seed=seed)``. Reward is crafter's (+1 per
achievement first unlocked this episode, +-0.1 per health point). The episode ends on death or
after ``max_steps`` steps (crafter's ``length``; 2000 by default, as in BALROG and Verlog).
``info["success"]`` is true on every valid step once ``success_achievement`` (default
``collect_diamond``, the hardest) is unlocked this episode, so an episode's last valid step tells
whether it succeeded (invalid-action steps say False, as in every env). ``info`` also holds
this episode's and this step's unlocks and crafter's own info (its counts as
``achievement_counts``).
"""
from __future__ import annotations

from typing import Any

import crafter
from crafter import constants

from ragen_mega.envs.base import TextEnv, invalid_action_info
from ragen_mega.envs.checks import check_seed, ensure_steppable, is_int
from ragen_mega.envs.crafter_text import VITALS, describe
from ragen_mega.envs.text_actions import match_action, unknown_action_reason

#: crafter's 17 actions in its own order, spelled as BALROG writes them ("move left", "do", ...)
ACTIONS = [name.replace("_", " ") for name in constants.actions]


class ReproducibleCrafter(crafter.Env):
    """``crafter.Env``, reproducible across processes and without image rendering (module
    docstring)."""

    def _balance_chunk(self, chunk, objs):
        super()._balance_chunk(chunk, sorted(objs, key=lambda obj: (obj.pos[0], obj.pos[1])))

    def _obs(self):
        if self._world.daylight < 0.5:  # crafter.engine.LocalView._light -> _noise
            unit = self._size // self._view
            self._world.random.uniform(32, 127, tuple(self._local_view._grid * unit))
        return None

    @property
    def world(self) -> crafter.engine.World:
        return self._world

    @property
    def player(self) -> crafter.objects.Player:
        return self._player

    @property
    def unlocked(self) -> set[str]:
        """Achievements unlocked this episode (empty before the first reset)."""
        return self._unlocked or set()

    @property
    def local_view_size(self) -> tuple[int, int]:
        """Cells of the world the agent's image shows around the player (9 x 7 by default)."""
        return tuple(int(c) for c in self._local_view._grid)

    def reset_to_seed(self, seed: int):
        """Reset to the world ``crafter.Env(seed=seed).reset()`` makes (crafter seeds episode k of
        ``Env(seed=s)`` with ``hash((s, k))``), whatever episodes this instance has played."""
        self._seed, self._episode = seed, 0
        return self.reset()


def _rules_text() -> str:
    """Crafter's recipes, written from crafter's own data tables so they cannot drift."""
    def amounts(d):
        return ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in d.items())
    lines = []
    for material, rule in constants.collect.items():
        need = f", needs {amounts(rule['require'])}" if rule["require"] else ""
        chance = f", {rule['probability']:.0%} chance" if "probability" in rule else ""
        lines.append(f"- do on {material}: get {amounts(rule['receive'])}{need}{chance}")
    for thing, rule in constants.place.items():
        lines.append(f"- place {thing}: uses {amounts(rule['uses'])}, onto "
                     f"{' / '.join(rule['where'])}")
    for tool, rule in constants.make.items():
        lines.append(f"- make {tool.replace('_', ' ')}: uses {amounts(rule['uses'])}, "
                     f"next to {' and '.join(rule['nearby'])}")
    return "\n".join(lines)


INSTRUCTION = f"""\
You are playing Crafter, a 2D survival and crafting game on a 64x64 map. Each turn you see the
nearest thing of each kind around you (positions in steps up/down/left/right from you), what is
right in front of you, your status and your inventory.
Survive and unlock achievements: each new one gives +1 reward (collect wood, place table, make
wood pickaxe, eat cow, defeat zombie, ... up to collect diamond); losing or regaining health gives
-0.1 / +0.1 per point. Food, drink and energy drop over time; at 0 you lose health. Eat cows
(hit them with do) or ripe plants, drink water (do on water), sleep when energy is low. Zombies
come out on grass, more at night; skeletons live in dark tunnels; lava kills.
Moving turns you to face that way; you move only onto grass, sand or path. "do" acts on the thing
you face: collect a material, hit a creature, drink, eat.
{_rules_text()}
Actions (write exactly one): {", ".join(ACTIONS)}"""


class CrafterEnv(TextEnv):
    """Crafter behind :class:`TextEnv`; see the module docstring."""

    def __init__(self, max_steps: int = 2000, success_achievement: str = "collect_diamond"):
        if not is_int(max_steps) or max_steps <= 0:
            raise ValueError(f"crafter: max_steps must be a positive integer, got {max_steps!r}")
        if success_achievement not in constants.achievements:
            raise ValueError(f"crafter: unknown success_achievement {success_achievement!r}; "
                             f"choose one of {constants.achievements}")
        self.max_steps = int(max_steps)
        self.success_achievement = success_achievement
        self._game = ReproducibleCrafter(length=self.max_steps, seed=0)
        self._obs_text = ""
        self._started = self._done = False

    @property
    def crafter_env(self) -> ReproducibleCrafter:
        """The underlying crafter env, for inspection in tests and tools."""
        return self._game

    @property
    def instruction(self) -> str:
        return INSTRUCTION

    @property
    def valid_actions(self) -> list[str]:
        return list(ACTIONS)

    def reset(self, seed: int) -> str:
        self._game.reset_to_seed(check_seed("crafter", seed))
        self._started, self._done = True, False
        self._obs_text = self._describe()
        return self._obs_text

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        ensure_steppable("crafter", self._started, self._done)
        index = match_action(action, ACTIONS)
        if index is None:
            return self._obs_text, 0.0, False, invalid_action_info(
                unknown_action_reason(action, ACTIONS), achievements=sorted(self._game.unlocked))
        unlocked_before = set(self._game.unlocked)
        faced = self._faced_cell()
        before = self._footprint(*faced)
        _, reward, done, crafter_info = self._game.step(index)
        effective = self._footprint(*faced) != before
        self._done = bool(done)
        self._obs_text = self._describe()
        unlocked = self._game.unlocked
        info = {"action_is_valid": True, "action_is_effective": effective,
                "success": self.success_achievement in unlocked,
                "achievements": sorted(unlocked),
                "new_achievements": sorted(unlocked - unlocked_before),
                "achievement_counts": crafter_info["achievements"],
                "inventory": crafter_info["inventory"],
                "semantic": crafter_info["semantic"],
                "player_pos": tuple(int(c) for c in crafter_info["player_pos"]),
                "discount": crafter_info["discount"]}
        return self._obs_text, float(reward), self._done, info

    def _describe(self) -> str:
        return describe(self._game.world, self._game.player, self._game.local_view_size)

    def _faced_cell(self) -> tuple[tuple[int, int], Any]:
        """The cell in front of the player and the creature (or plant) on it, if any."""
        player = self._game.player
        target = (int(player.pos[0]) + player.facing[0], int(player.pos[1]) + player.facing[1])
        return target, self._game.world[target][1]

    def _footprint(self, target: tuple[int, int], creature) -> tuple:
        """What the player's own action can change, for ``action_is_effective``: its cell, facing,
        sleep, items, achievements, and the cell it faced before acting (material, creature
        health). Vitals drift every step whatever the action, so they are left out (eating and
        drinking show up as achievements)."""
        player = self._game.player
        items = tuple((k, v) for k, v in player.inventory.items() if k not in VITALS)
        creature_state = None if creature is None else (creature.health, creature.removed)
        return (tuple(int(c) for c in player.pos), tuple(player.facing), player.sleeping, items,
                tuple(player.achievements.values()), self._game.world[target][0], creature_state)
