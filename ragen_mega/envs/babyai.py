"""BabyAI (minigrid 3.2.0's levels) as a text game, as BALROG and Verlog play it.

Levels are chosen by short name (BALROG's five task kinds) or by any registered ``BabyAI-*`` id:

===================  =========================================================================
``goto``             BabyAI-GoToLocal-v0: "go to the red ball" in one 8x8 room, 8 distractors
``pickup``           BabyAI-PickupLoc-v0: "pick up the blue key (on your left)", one room
``open``             BabyAI-Open-v0: "open the green door" in a 3x3 maze of rooms
``putnext``          BabyAI-PutNextLocal-v0: "put the red box next to the grey ball", one room
``pickup_seq_goto``  :class:`PickupThenGoToLocal` (below): "pick up A, then go to B"
===================  =========================================================================

BALROG draws its tasks from babyai-text's ``MixedTrainLocal`` level, which minigrid does not
ship. The first four are minigrid's levels for the same skills (except that BALROG's "open" is
two rooms and a locked door, Open-v0 a 3x3 maze of closed doors; ``BabyAI-UnlockLocal-v0`` is
the locked-door variant). The fifth is built from minigrid's instruction and verifier classes,
so minigrid judges success in every level.

Reward is minigrid's (``1 - 0.9 * steps / max_steps`` on success, else 0); ``success`` is
"the mission was completed". ``max_steps=None`` keeps each level's own limit.
"""
from __future__ import annotations

import contextlib
import io
from typing import Any

import gymnasium as gym
import minigrid  # noqa: F401  (importing it registers the BabyAI-* ids with gymnasium)
from minigrid.envs.babyai.core.levelgen import LevelGen
from minigrid.envs.babyai.core.roomgrid_level import RejectSampling
from minigrid.envs.babyai.core.verifier import (
    OBJ_TYPES_NOT_DOOR,
    AfterInstr,
    BeforeInstr,
    GoToInstr,
    PickupInstr,
)

from ragen_mega.envs.babyai_text import describe
from ragen_mega.envs.base import TextEnv, invalid_action_info
from ragen_mega.envs.checks import check_seed, ensure_steppable, is_int
from ragen_mega.envs.text_actions import match_action, unknown_action_reason

#: BALROG's action names, in minigrid's action order (left, right, forward, pickup, drop, toggle)
ACTIONS = ["turn left", "turn right", "go forward", "pick up", "drop", "toggle"]


class PickupThenGoToLocal(LevelGen):
    """BALROG's ``pick_up_seq_go_to`` (babyai-text's, not in minigrid) on minigrid's ``LevelGen``:
    one 8x8 room, 10 objects, "pick up A then go to B" / "go to B after you pick up A". A and B
    never describe the same object (else "pick up the ball then go to the ball" is odd)."""

    def __init__(self, **kwargs):
        super().__init__(num_rows=1, num_cols=1, num_dists=10, locked_room_prob=0,
                         locations=False, unblocking=False, implicit_unlock=False, **kwargs)

    def gen_mission(self):
        self.place_agent()
        self.add_distractors(num_distractors=self.num_dists, all_unique=False)
        self.check_objs_reachable()
        pickup = PickupInstr(self.rand_obj(types=OBJ_TYPES_NOT_DOOR))
        goto = GoToInstr(self.rand_obj(types=OBJ_TYPES_NOT_DOOR))
        if {id(o) for o in pickup.desc.obj_set} & {id(o) for o in goto.desc.obj_set}:
            raise RejectSampling("the object to pick up may also be the one to go to")
        self.instrs = BeforeInstr(pickup, goto) if self._rand_bool() else AfterInstr(goto, pickup)


LEVELS: dict[str, str | type] = {
    "goto": "BabyAI-GoToLocal-v0",
    "pickup": "BabyAI-PickupLoc-v0",
    "open": "BabyAI-Open-v0",
    "putnext": "BabyAI-PutNextLocal-v0",
    "pickup_seq_goto": PickupThenGoToLocal,
}

INSTRUCTION = """\
You are an agent in BabyAI, a grid world of rooms with walls, doors, keys, balls and boxes.
Each turn you get your mission and what you see: a 7x7 area in front of you (you stand in the
middle of its near edge), positions given as steps left/right and steps forward from you. Walls
and closed doors block your sight. Only the nearest wall straight ahead, left and right is listed.
Actions (write exactly one):
- turn left / turn right: turn 90 degrees in place
- go forward: move one cell forward (blocked by walls, closed doors and objects)
- pick up: pick up the object directly in front of you (you can carry one object at a time)
- drop: put the object you carry on the empty cell in front of you
- toggle: open or close the door in front of you (a locked door opens only while you carry a key
  of its color), or open the box in front of you
"go to X" is done when you face X from the cell right next to it; "put X next to Y" when you drop
X on a cell beside Y. Finish the mission in as few steps as you can."""


class BabyAIEnv(TextEnv):
    """A minigrid BabyAI level behind :class:`TextEnv`; see the module docstring."""

    def __init__(self, level: str = "goto", max_steps: int | None = None):
        if not (isinstance(level, str) and (level in LEVELS or (level.startswith("BabyAI-")
                                                                and level in gym.registry))):
            raise ValueError(f"babyai: unknown level {level!r}; use one of {sorted(LEVELS)} "
                             "or a registered BabyAI-* env id such as 'BabyAI-GoToObj-v0'")
        if max_steps is not None and not (is_int(max_steps) and max_steps > 0):
            raise ValueError(f"babyai: max_steps must be a positive integer or None, got "
                             f"{max_steps!r}")
        self.level = level
        kwargs = {} if max_steps is None else {"max_steps": int(max_steps)}
        entry = LEVELS.get(level, level)
        if isinstance(entry, str):
            self._env = gym.make(entry, **kwargs).unwrapped
        else:
            self._env = entry(**kwargs)
        self._obs_text = ""
        self._started = self._done = False

    @property
    def minigrid_env(self):
        """The underlying (unwrapped) minigrid env, for inspection in tests and tools."""
        return self._env

    @property
    def instruction(self) -> str:
        return INSTRUCTION

    @property
    def valid_actions(self) -> list[str]:
        return list(ACTIONS)

    def reset(self, seed: int) -> str:
        # Rejection sampling in level generation prints to stdout ("Sampling rejected: ...").
        with contextlib.redirect_stdout(io.StringIO()):
            obs, _ = self._env.reset(seed=check_seed("babyai", seed))
        self._started, self._done = True, False
        self._obs_text = describe(obs["image"], self._env.carrying, obs["mission"])
        return self._obs_text

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        ensure_steppable("babyai", self._started, self._done)
        index = match_action(action, ACTIONS)
        if index is None:
            return self._obs_text, 0.0, False, invalid_action_info(
                unknown_action_reason(action, ACTIONS))
        before = self._state_key()
        obs, reward, terminated, truncated, _ = self._env.step(index)
        self._done = bool(terminated or truncated)
        self._obs_text = describe(obs["image"], self._env.carrying, obs["mission"])
        info = {"action_is_valid": True, "action_is_effective": self._state_key() != before,
                "success": bool(terminated and reward > 0)}
        return self._obs_text, float(reward), self._done, info

    def _state_key(self) -> tuple:
        """What an action can change: agent pose, carried object, grid contents (doors, objects)."""
        env = self._env
        carried = None if env.carrying is None else tuple(env.carrying.encode())
        return (tuple(env.agent_pos), env.agent_dir, carried, env.grid.encode().tobytes())

    def close(self) -> None:
        self._env.close()
