"""BabyAI's egocentric view in words, in the style of BALROG's BabyAI-Text.

The input is minigrid's partial observation (``gen_obs()["image"]``: one ``(type, color,
state)`` triple per cell of the square view, the agent in the bottom-middle cell facing row 0).
Reading it rather than the full grid makes the text say exactly what the agent sees: cells
behind walls and closed doors are "unseen" and never described.

Positions are relative to the agent: "2 steps left and 1 step forward". Like BabyAI-Text, only
the nearest wall straight ahead, left and right is mentioned (where the room ends, without
listing every wall cell); every other visible thing is listed.
"""
from __future__ import annotations

import numpy as np
from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT, STATE_TO_IDX

from ragen_mega.envs.wording import steps

_IDX_TO_STATE = {index: name for name, index in STATE_TO_IDX.items()}
_NOT_DESCRIBED = {"unseen", "empty", "floor", "agent"}


def relative_position(right: int, forward: int) -> str:
    """Offset from the agent in words: sideways part first, then the forward part."""
    parts = []
    if right:
        parts.append(steps(abs(right), "right" if right > 0 else "left"))
    if forward:
        parts.append(steps(forward, "forward"))
    return " and ".join(parts)


def object_phrase(type_idx: int, color_idx: int, state_idx: int) -> str:
    """One encoded cell as a noun phrase: "a wall", "a locked red door", "a blue key"."""
    kind = IDX_TO_OBJECT[int(type_idx)]
    if kind == "wall":
        return "a wall"
    color = IDX_TO_COLOR[int(color_idx)]
    if kind == "door":
        return f"a {_IDX_TO_STATE[int(state_idx)]} {color} door"
    return f"a {color} {kind}"


def visible_things(image: np.ndarray) -> list[str]:
    """Everything worth saying about the view, nearest first: "a red ball 1 step forward"."""
    size = image.shape[0]
    agent_i, agent_j = size // 2, size - 1
    found = []  # (distance, right, forward, phrase)
    nearest_wall: dict[tuple[int, int], tuple[int, int, int]] = {}  # ray -> (dist, right, fwd)
    for i in range(size):
        for j in range(size):
            if (i, j) == (agent_i, agent_j):  # the agent's own cell shows what it carries
                continue
            kind = IDX_TO_OBJECT[int(image[i, j, 0])]
            if kind in _NOT_DESCRIBED:
                continue
            right, forward = i - agent_i, agent_j - j
            distance = abs(right) + forward
            if kind == "wall":
                if right and forward:  # off the three rays: not mentioned
                    continue
                ray = (int(np.sign(right)), int(forward > 0))
                if ray not in nearest_wall or distance < nearest_wall[ray][0]:
                    nearest_wall[ray] = (distance, right, forward)
                continue
            found.append((distance, right, forward, object_phrase(*image[i, j])))
    found += [(d, r, f, "a wall") for d, r, f in nearest_wall.values()]
    found.sort()
    return [f"{phrase} {relative_position(right, forward)}" for _, right, forward, phrase in found]


def describe(image: np.ndarray, carrying, mission: str) -> str:
    """The whole observation text: mission, what is visible, what the agent carries."""
    things = visible_things(image)
    seen = "You see:\n" + "\n".join(f"- {t}" for t in things) if things else "You see nothing."
    carried = "nothing" if carrying is None else object_phrase(*carrying.encode())
    return f"Mission: {mission}\n{seen}\nYou carry {carried}."
