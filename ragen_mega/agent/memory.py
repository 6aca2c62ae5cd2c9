"""One episode's turns as the prompt builder needs them, and the window of recent ones.

:meth:`History.observe` opens a turn with the env's observation; :meth:`History.record` completes
it with the response token ids as the engine sampled them (never re-tokenized), their parse and
the reward. :meth:`History.window` is the memory: the whole record is kept and cut only when
prompting, so the rollout can log full episodes while every prompt stays bounded.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from ragen_mega.agent.parse import ParsedResponse


@dataclass
class Turn:
    number: int                        # 1-based, counted over the whole episode
    observation: str
    actions_left: int | None = None    # shown as "You have N actions left." (None: not shown)
    response_ids: list[int] | None = None  # sampled ids, None until the model has answered
    parsed: ParsedResponse | None = None
    reward: float | None = None        # what the prompt reports back ("Reward: x")

    @property
    def answered(self) -> bool:
        return self.response_ids is not None


class History:
    """The turns of one episode, oldest first; the last one may still await its response."""

    def __init__(self):
        self.turns: list[Turn] = []

    def observe(self, observation: str, actions_left: int | None = None) -> Turn:
        """Start the next turn with the env's observation text."""
        if self.turns and not self.turns[-1].answered:
            raise RuntimeError(f"History.observe: turn {self.turns[-1].number} has no response yet; "
                               f"call record() before the next observation")
        if not isinstance(observation, str):
            raise TypeError(f"History.observe: observation must be str, got {type(observation).__name__}")
        if actions_left is not None and (isinstance(actions_left, bool) or not isinstance(actions_left, int)):
            raise TypeError(f"History.observe: actions_left must be an int or None, got {actions_left!r}")
        turn = Turn(number=len(self.turns) + 1, observation=observation, actions_left=actions_left)
        self.turns.append(turn)
        return turn

    def record(self, response_ids, parsed: ParsedResponse, reward: float) -> Turn:
        """Complete the current turn with the sampled ids, their parse and the turn's reward."""
        turn = self._current("record")
        ids = list(response_ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TypeError("History.record: response_ids must be token ids (ints)")
        if not isinstance(parsed, ParsedResponse):
            raise TypeError(f"History.record: parsed must be a ParsedResponse, got {type(parsed).__name__}")
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):  # numpy scalars too
            raise TypeError(f"History.record: reward must be a number, got {reward!r}")
        turn.response_ids, turn.parsed, turn.reward = ids, parsed, float(reward)
        return turn

    def window(self, memory_turns: int | None) -> list[Turn]:
        """The current turn and at most ``memory_turns`` answered turns before it (None: all)."""
        self._current("window")
        if memory_turns is not None and memory_turns < 0:
            raise ValueError(f"History.window: memory_turns must be >= 0 or None, got {memory_turns}")
        past = len(self.turns) - 1
        if memory_turns is not None:
            past = min(past, memory_turns)
        return self.turns[len(self.turns) - 1 - past:]

    def _current(self, caller: str) -> Turn:
        if not self.turns or self.turns[-1].answered:
            raise RuntimeError(f"History.{caller}: no turn awaits a response; call observe() first")
        return self.turns[-1]
