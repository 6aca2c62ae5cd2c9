"""``AgentConfig``: the knobs of the text protocol between an env and the model.

It is the config tree's ``agent:`` section, so the field names are user-facing keys: keep them
stable. Values are checked on construction; a bad one raises
:class:`~ragen_mega.config_tree.ConfigError` (a ``ValueError``) whose message starts with the
field's name (the tree prefixes ``agent.``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ragen_mega.config_tree import ConfigError, setting


@dataclass
class AgentConfig:
    think: bool = setting(True, help=(
        "true: the model writes `<think>...</think><answer>...</answer>` and the prompt ends with "
        "`<think>`; false (RAGEN's `NoThinking`): the prompt ends with `<answer>` and the model "
        "only completes the answer up to `</answer>`."))
    max_actions_per_turn: int = setting(5, help=(
        "actions kept from one answer (split on `action_sep`); extra ones are dropped and "
        "counted."))
    action_sep: str = setting("||", help=(
        "separator between several actions in one answer (RAGEN: `||`)."))
    format_penalty: float = setting(-0.1, help=(
        "added to the turn's reward when the response breaks the format (RAGEN: -0.1); must be <= "
        "0."))
    memory_turns: int | None = setting(None, help=(
        "how many past turns the prompt shows before the current one; null = all of them (RAGEN's "
        "classic growing chat); a small number = Verlog's memory window for long episodes."))
    include_thoughts_in_memory: bool = setting(True, help=(
        "past turns show the model's whole sampled response (true) or only its parsed actions as "
        "`<answer>a || b</answer>` (false: shorter prompts, no copying of old reasoning)."))
    max_prompt_tokens: int | None = setting(None, help=(
        "prompt length limit in tokens, null = no limit. Over it, a bounded window (memory_turns "
        "set) drops its oldest turns until the prompt fits; otherwise building the prompt raises."))
    answer_line: bool = setting(False, help=(
        "answer-only mode: the answer is the response's first line, ended by `</answer>`, a "
        "newline, or the model's own end of turn (not a cut at max_new_tokens). Small models "
        "rarely close the tag within a few tokens; this reads what they meant without guessing."))
    example_answer: bool = setting(False, help=(
        "the format rule shows an example answer made of the env's own first action words "
        "(`<answer> Left || Down </answer>`) instead of `[your answer]`, as RAGEN's FrozenLake "
        "prompt shows one. A small model that copies the placeholder or the grid starts writing "
        "actions with it; the example is also a prior on the moves, so it is off unless asked "
        "for."))
    instructions: bool = setting(True, help=(
        "the prompt carries RAGEN's words around the game: the system message, the env's "
        "instruction and action list, and the format rule after every observation. false: only "
        "the turns (`Turn k:`, the observation, the reward), for a model trained from scratch, "
        "which cannot read English: on a 4x4 FrozenLake those words are 280 of a prompt's 380 "
        "tokens, so they cost most of a step's compute and only dilute the board "
        "(docs/results.md)."))

    def __post_init__(self):
        for field in ("think", "include_thoughts_in_memory", "answer_line", "example_answer",
                      "instructions"):
            _check_bool(field, getattr(self, field))
        if self.example_answer and not self.instructions:
            raise ConfigError("example_answer: the example is part of the format rule, which "
                              "instructions=false leaves out")
        if self.answer_line and self.think:
            raise ConfigError("answer_line: is for answer-only mode; set think=false")
        _check_int("max_actions_per_turn", self.max_actions_per_turn, minimum=1)
        _check_int("memory_turns", self.memory_turns, minimum=0, optional=True)
        _check_int("max_prompt_tokens", self.max_prompt_tokens, minimum=1, optional=True)
        if not isinstance(self.action_sep, str) or not self.action_sep.strip():
            raise ConfigError(f"action_sep: must be a non-blank string, got {self.action_sep!r}")
        if "<" in self.action_sep or ">" in self.action_sep:
            raise ConfigError(f"action_sep: must not contain '<' or '>' (they belong to the "
                              f"<think>/<answer> tags), got {self.action_sep!r}")
        if isinstance(self.format_penalty, bool) or not isinstance(self.format_penalty, (int, float)):
            raise ConfigError(f"format_penalty: must be a number, got {self.format_penalty!r}")
        if not self.format_penalty <= 0:  # also rejects NaN
            raise ConfigError(f"format_penalty: is added to the reward, so it must be <= 0 "
                              f"(RAGEN uses -0.1), got {self.format_penalty!r}")
        self.format_penalty = float(self.format_penalty)


def _check_bool(field: str, value) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{field}: must be true or false, got {value!r}")


def _check_int(field: str, value, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if optional else "an int"
        raise ConfigError(f"{field}: must be {kind}, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{field}: must be >= {minimum}, got {value}")
