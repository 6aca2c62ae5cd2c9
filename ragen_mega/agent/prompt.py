"""From an episode's history to the prompt's token ids, through the tokenizer's own chat template.

The chat has RAGEN's shape::

    system     You're a helpful assistant... (format rules for think / answer-only mode)
    user       <env instruction, valid actions, separator>
               Turn 1:
               State:
               <observation>
               You have N actions left. Always output: <think> ... </answer> with no extra text...
    assistant  <the model's turn-1 response>
    user       Reward: 0
               Turn 2: ...
    ...
    assistant  (generation prompt) <think>      or <answer> in answer-only mode

``AgentConfig.memory_turns=None`` shows every past turn (RAGEN's classic growing chat, for
~10-turn envs); a small number shows only the last k (Verlog's memory window: prompt cost stays
flat over hundreds of turns). Each prompt plus its sampled response is one training sample; turn
numbers stay absolute so the model knows how far along it is.

Token-in, token-out: a past response is spliced in as the very ids the engine sampled (after the
prefix tag), never as re-encoded text, which can tokenize differently. The chat template renders a
placeholder in its place and the text around the placeholders is tokenized piece by piece; the
pieces meet the response at the assistant header and end-of-turn marker, so for canonical ids the
result equals tokenizing the whole chat (tests check this). A sampled end-of-turn token (e.g.
``<|im_end|>``) is not doubled by the template's own. ``Prompt.response_spans`` locates the spliced
responses, so the last prompt of a classic episode plus its response is RAGEN's whole-episode
sequence with a loss mask on every assistant turn. A template that rewrites past assistant turns
(Qwen3 drops old ``<think>`` text) is not followed: the sampled ids stay as they were.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Sequence

from ragen_mega.agent.config import AgentConfig
from ragen_mega.agent.memory import History, Turn
from ragen_mega.agent.parse import ANSWER_CLOSE, ANSWER_OPEN, response_prefix

_PLACEHOLDER = "<<ragen_mega:response:{}>>"
_PLACEHOLDER_RE = re.compile(r"<<ragen_mega:response:(\d+)>>")


def system_prompt(config: AgentConfig) -> str:
    """RAGEN's short system message, plus the response format of the chosen mode."""
    if config.think:
        rule = ("In every turn, first think step by step inside <think> </think>, "
                "then give your action(s) inside <answer> </answer>.")
    else:
        rule = "In every turn, give only your action(s) inside <answer> </answer>, without explanation."
    return f"You're a helpful assistant. You are playing a text game, one turn at a time. {rule}"


def example_answer(config: AgentConfig, valid_actions: Sequence[str]) -> list[str] | None:
    """The action words of the example answer the prompt shows (``config.example_answer``): the
    env's first (up to two) action words; None when the prompt shows none."""
    if not (config.example_answer and valid_actions):
        return None
    return list(valid_actions)[:min(2, config.max_actions_per_turn)]


def format_hint(config: AgentConfig, valid_actions: Sequence[str] = ()) -> str:
    """The response format the rules line asks for. With ``config.example_answer`` the answer is
    :func:`example_answer` instead of ``[your answer]``: a 135M model copies the placeholder or
    the grid, but writes actions after seeing an example."""
    example = example_answer(config, valid_actions)
    answer = "[your answer]" if example is None else f" {config.action_sep} ".join(example)
    if config.think:
        return f"<think> [Your thoughts] </think> <answer> {answer} </answer>"
    return f"<answer> {answer} </answer>"


@dataclass
class Prompt:
    ids: list[int]                         # what the engine is given
    response_spans: list[tuple[int, int]]  # [start, end) of each spliced past response in ids
    first_turn: int                        # number of the oldest turn shown
    _tokenizer: Any = field(repr=False, compare=False)
    _chat: list[dict[str, str]] = field(repr=False, compare=False)  # past responses as placeholders
    _sampled: list[list[int]] = field(repr=False, compare=False)    # their ids, in order
    _prefix_ids: list[int] = field(repr=False, compare=False)

    # text and messages serve logs, tests and API models, never the engine: decoded when first
    # read, since decoding every prompt costs as much as tokenizing it.

    @cached_property
    def text(self) -> str:
        """``ids`` decoded with special tokens: what the model reads."""
        return self._tokenizer.decode(self.ids)

    @cached_property
    def messages(self) -> list[dict[str, str]]:
        """The chat with past responses decoded (prefix tag included)."""
        out = []
        for message in self._chat:
            placeholder = _PLACEHOLDER_RE.fullmatch(message["content"])
            if placeholder:
                response = self._sampled[int(placeholder.group(1))]
                message = {**message, "content": self._tokenizer.decode(
                    self._prefix_ids + response, skip_special_tokens=True)}
            out.append(message)
        return out


class PromptBuilder:
    """Builds one env's prompts; holds the tokenizer and the text that never changes."""

    def __init__(self, tokenizer, config: AgentConfig, instruction: str, valid_actions: Sequence[str]):
        if not isinstance(config, AgentConfig):
            raise TypeError(f"PromptBuilder: config must be an AgentConfig, got {type(config).__name__}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"PromptBuilder: tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} "
                             f"has no chat template")
        self.tokenizer, self.config = tokenizer, config
        #: the action words of the example answer the prompt shows (None: it shows none)
        self.example = example_answer(config, valid_actions)
        self.prefix_ids = self._encode(response_prefix(config))
        self._special_ids = set(tokenizer.all_special_ids)
        # without instructions: an empty system message (a template would put its own default
        # in the place of a missing one), no head, no rule after the observations
        self._system = system_prompt(config) if config.instructions else ""
        self._head = (f"{instruction.strip()}\nYour available actions are:\n{', '.join(valid_actions)}\n"
                      f"You can take up to {config.max_actions_per_turn} action(s) per turn, "
                      f"separated by the action separator \" {config.action_sep} \".\n"
                      if config.instructions else "")
        own = " (with your own actions)" if config.example_answer else ""
        self._rules = (f"Always output: {format_hint(config, valid_actions)}{own} with no extra text. "
                       f"Strictly follow this format.\n" if config.instructions else "")
        # The last prompt's template pieces, tokenized: text between two sampled responses never
        # changes, so the next turn tokenizes only its new piece(s) and a turn's cost does not
        # grow with the chat (benchmarks/README.md). Only the last prompt's are kept.
        self._encoded: dict[str, list[int]] = {}

    def copies_example(self, actions: Sequence[str]) -> bool:
        """Whether an answer's actions are the prompt's example answer (case and spaces aside):
        a 135M model copies it, the echo trap's favourite answer."""
        return self.example is not None and [a.strip().lower() for a in actions] == [
            w.lower() for w in self.example]

    @classmethod
    def for_env(cls, tokenizer, config: AgentConfig, env) -> "PromptBuilder":
        """A builder with the env's instruction and valid actions."""
        return cls(tokenizer, config, env.instruction, env.valid_actions)

    def build(self, history: History) -> Prompt:
        """The prompt for the turn awaiting a response.

        With ``max_prompt_tokens`` set, a bounded window (``memory_turns`` not None) sheds its
        oldest turns until the prompt fits; a prompt that cannot fit raises ``ValueError``."""
        window = history.window(self.config.memory_turns)
        limit = self.config.max_prompt_tokens
        while True:
            prompt = self._render(window)
            if limit is None or len(prompt.ids) <= limit:
                return prompt
            if self.config.memory_turns is None or len(window) == 1:
                why = ("memory_turns=None keeps every past turn; set AgentConfig.memory_turns to let "
                       "old turns drop" if self.config.memory_turns is None
                       else "even with no past turn shown")
                raise ValueError(f"prompt for turn {window[-1].number} has {len(prompt.ids)} tokens, over "
                                 f"AgentConfig.max_prompt_tokens={limit} ({why})")
            window = window[1:]

    def _render(self, window: list[Turn]) -> Prompt:
        messages, sampled = self._messages(window)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        pieces = _PLACEHOLDER_RE.split(text)  # text, index, text, index, ..., text
        if [int(i) for i in pieces[1::2]] != list(range(len(sampled))):
            raise ValueError(f"chat template of {self.tokenizer.name_or_path!r} did not render each past "
                             f"assistant message exactly once; cannot splice the sampled token ids")
        ids, spans = [], []
        encoded = {}
        for k, piece in enumerate(pieces[0::2]):
            piece_ids = self._encoded[piece] if piece in self._encoded else self._encode(piece)
            encoded[piece] = piece_ids
            if k > 0 and piece_ids and ids[-1] == piece_ids[0] and ids[-1] in self._special_ids:
                piece_ids = piece_ids[1:]  # the sampled end-of-turn token is the template's own
            ids += piece_ids
            if k < len(sampled):
                ids += self.prefix_ids
                spans.append((len(ids), len(ids) + len(sampled[k])))
                ids += sampled[k]
        ids += self.prefix_ids
        self._encoded = encoded
        return Prompt(ids=ids, response_spans=spans, first_turn=window[0].number,
                      _tokenizer=self.tokenizer, _chat=messages, _sampled=sampled,
                      _prefix_ids=self.prefix_ids)

    def _messages(self, window: list[Turn]) -> tuple[list[dict[str, str]], list[list[int]]]:
        """The chat for ``window``; past responses to splice are placeholders, returned apart."""
        messages = [{"role": "system", "content": self._system}]
        sampled: list[list[int]] = []
        user = self._head
        for turn in window:
            user += self._turn_text(turn)
            if not turn.answered:
                break
            messages.append({"role": "user", "content": user})
            if self.config.include_thoughts_in_memory:
                content = _PLACEHOLDER.format(len(sampled))
                sampled.append(turn.response_ids)
            else:
                content = ANSWER_OPEN + f" {self.config.action_sep} ".join(turn.parsed.actions) + ANSWER_CLOSE
            messages.append({"role": "assistant", "content": content})
            user = f"Reward: {turn.reward:g}\n"
        messages.append({"role": "user", "content": user})
        return messages, sampled

    def _turn_text(self, turn: Turn) -> str:
        left = "" if turn.actions_left is None else f"You have {turn.actions_left} actions left. "
        return f"\nTurn {turn.number}:\nState:\n{turn.observation}\n{left}{self._rules}"

    def _encode(self, text: str) -> list[int]:
        # as apply_chat_template(tokenize=True) does: the template itself writes any special tokens
        return self.tokenizer.encode(text, add_special_tokens=False)
