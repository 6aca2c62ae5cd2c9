"""From the model's response text to env actions, RAGEN's way.

The prompt ends with an opening tag the model continues from (``<think>`` in think mode,
``<answer>`` in answer-only mode, see :func:`response_prefix`), so the text to parse is that prefix
plus the sampled text. Its format is

    think mode:   <think> thoughts </think> <answer> a1 || a2 </answer>
    answer-only:  <answer> a1 || a2 </answer>

Behaviour matches RAGEN's parser (``re.search`` of
``<think>(.*?)</think>\\s*<answer>(.*?)</answer>`` with DOTALL; ``<answer>(.*?)</answer>`` in
answer-only mode) plus its env manager's penalty for an answer without actions:

- the first ``<think>``, the first ``</think>`` after it that is followed (after whitespace only)
  by ``<answer>``, and the first ``</answer>`` after that delimit thought and answer;
- a missing tag (including a response cut off before ``</answer>``), or text other than whitespace
  between ``</think>`` and ``<answer>``, breaks the format;
- tags are case-sensitive (``<ANSWER>`` is not a tag): the prompt spells them exactly;
- text after ``</answer>`` is ignored, as in RAGEN;
- stray tags inside thought or answer (nested or duplicated ``<think>``/``<answer>``...) are
  deleted, then both are stripped;
- the answer splits on ``action_sep``; pieces are stripped and empty ones dropped; the first
  ``max_actions_per_turn`` are kept and the rest counted in ``n_dropped`` (not penalised;
  RAGEN then trains a response rewritten to the kept actions, this project the tokens as
  sampled: docs/design.md, "Agent: what is trained of an answer");
- an answer with no action at all breaks the format.

A broken format gives no actions and ``penalty = config.format_penalty``. The work is linear in
the text length (RAGEN's regex can go quadratic on a long run of unclosed tags).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ragen_mega.agent.config import AgentConfig

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
_TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)
#: where the engines stop a turn: the answer is closed, and what would follow is ignored anyway
STOP_STRINGS = (ANSWER_CLOSE,)
_THINK_TO_ANSWER = re.compile(r"</think>\s*<answer>")


@dataclass
class ParsedResponse:
    """What one response means for the env and for the reward."""

    actions: list[str] = field(default_factory=list)  # to step the env with, in order
    thought: str = ""            # content of <think> (empty in answer-only mode)
    format_ok: bool = False
    penalty: float = 0.0         # 0.0, or config.format_penalty when the format is broken
    n_dropped: int = 0           # actions beyond max_actions_per_turn
    error: str = ""              # why the format is broken, for logs; empty when format_ok


def response_prefix(config: AgentConfig) -> str:
    """The tag the prompt ends with, so the model starts inside the format (as RAGEN does)."""
    return THINK_OPEN if config.think else ANSWER_OPEN


def parse_response(text: str, config: AgentConfig, *, finished: bool = False) -> ParsedResponse:
    """Parse the text the model sampled after the prompt (without :func:`response_prefix`).

    ``finished``: the model ended the response itself (end-of-turn token or a stop string), as
    opposed to being cut at ``max_new_tokens``; only ``config.answer_line`` reads it."""
    full = response_prefix(config) + text
    if config.think:
        bridge = _THINK_TO_ANSWER.search(full, len(THINK_OPEN))  # full starts with <think>
        if bridge is None:
            return _broken(config, "no '</think>' followed by '<answer>'")
        thought = full[len(THINK_OPEN):bridge.start()]
        answer_start = bridge.end()
    else:
        thought, answer_start = "", len(ANSWER_OPEN)
    answer_end = full.find(ANSWER_CLOSE, answer_start)
    if config.answer_line:
        answer_end = _line_end(full, answer_start, answer_end, finished)
    if answer_end < 0:
        return _broken(config, "no '</answer>'")
    answer = _clean(full[answer_start:answer_end])
    actions = [a.strip() for a in answer.split(config.action_sep) if a.strip()]
    if not actions:
        return _broken(config, "empty answer")
    kept = actions[:config.max_actions_per_turn]
    return ParsedResponse(actions=kept, thought=_clean(thought), format_ok=True,
                          n_dropped=len(actions) - len(kept))


def _line_end(full: str, start: int, close: int, finished: bool) -> int:
    """End of a one-line answer: ``</answer>``, the first newline after the answer's first
    visible character, or the end of a response the model finished itself; -1 if cut off."""
    body = len(full) - len(full[start:].lstrip())
    newline = full.find("\n", body)
    ends = [e for e in (close, newline) if e >= 0] + ([len(full)] if finished else [])
    return min(ends) if ends else -1


def _clean(content: str) -> str:
    for tag in _TAGS:
        content = content.replace(tag, "")
    return content.strip()


def _broken(config: AgentConfig, error: str) -> ParsedResponse:
    return ParsedResponse(format_ok=False, penalty=config.format_penalty, error=error)
