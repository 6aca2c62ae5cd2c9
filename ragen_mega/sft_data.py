"""Examples for ``ragen-mega sft``'s supervised warm start (why: :mod:`ragen_mega.sft`).

The loss is on the assistant's tokens only (:class:`SFTExample.loss_mask`): the model learns to
write answers, not to predict the env's prompts. Two sources:

- :func:`load_chats`: a JSONL file of chats ``{"messages": [{"role": ..., "content": ...}]}``,
  tokenized by the tokenizer's chat template (:func:`chat_example`); loss on each assistant
  message's content and the end-of-turn token closing it (so the model learns to stop), not on
  the template's text around it (``<|im_start|>assistant\\n``) nor on system/user messages.
- :func:`format_examples`: generated format-only targets. The prompt is the env's turn-1 prompt,
  token for token what the rollout sends (built by the rollout's own ``EpisodeState`` /
  ``PromptBuilder`` / ``History``); the target is a uniformly random valid answer:
  1..``agent.max_actions_per_turn`` actions, each uniform over the env's ``valid_actions``, in
  the agent's answer format, closed by the tokenizer's EOS (where the engine stops a response).
  This teaches the format and the action vocabulary, **not** the solution: the actions ignore the
  observation, so the warm start adds no prior over which move is good.

The prompt ends with :func:`~ragen_mega.agent.parse.response_prefix` (``<answer>``, or
``<think>`` in think mode), so a target starts right after it, as a sampled response does:
``" Left || Down </answer>"`` + EOS, or in think mode ``" </think> <answer> Left || Down
</answer>"`` + EOS (an empty thought: nothing is made up to look like reasoning; RL grows the
thoughts). Every target must parse back to exactly its actions, format ok (checked per example).
"""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Sequence

import torch

from ragen_mega.agent import History, PromptBuilder, parse_response
from ragen_mega.agent.parse import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE
from ragen_mega.envs.registry import make
from ragen_mega.rollout.types import EpisodeSpec
from ragen_mega.rollout.seeding import train_parts
from ragen_mega.rollout.episode import EpisodeState, LocalEnv

_ROLES = ("system", "user", "assistant")


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One training sequence: ``ids`` (prompt + target token ids) and ``loss_mask`` (same
    length; 1 exactly on the tokens the loss is taken on, the assistant's, 0 elsewhere).

    Token 0 is never a loss token (nothing before it predicts it), and at least one token is."""
    ids: list[int]
    loss_mask: list[int]

    def __post_init__(self):
        if len(self.ids) != len(self.loss_mask):
            raise ValueError(f"SFTExample: {len(self.ids)} ids but {len(self.loss_mask)} "
                             f"loss-mask entries")
        if not self.ids:
            raise ValueError("SFTExample: no tokens")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("SFTExample: loss_mask entries must be 0 or 1")
        if self.loss_mask[0]:
            raise ValueError("SFTExample: token 0 cannot be a loss token (nothing predicts it)")
        if not any(self.loss_mask):
            raise ValueError("SFTExample: no loss token")


def _tokenize(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              add_generation_prompt=generation_prompt))


def _check_messages(messages, where: str) -> None:
    at = f"{where}: " if where else ""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{at}'messages' must be a non-empty list of messages, got {messages!r:.80}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{at}message {i}: must be an object with 'role' and 'content', "
                             f"got {message!r:.80}")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise ValueError(f"{at}message {i}: field {extra[0]!r} is not supported (a message "
                             f"has only 'role' and 'content')")
        if message.get("role") not in _ROLES:
            raise ValueError(f"{at}message {i}: field 'role' must be one of "
                             f"{', '.join(_ROLES)}, got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{at}message {i}: field 'content' must be a string, got "
                             f"{message.get('content')!r:.80}")
        if message["role"] == "assistant" and i == 0:
            raise ValueError(f"{at}message {i}: field 'role': an assistant message needs a "
                             f"message before it (the chat template opens the assistant turn "
                             f"after one)")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{at}message {len(messages) - 1}: field 'role': the chat has no "
                         f"assistant message (nothing to learn)")


def chat_example(tokenizer, messages: list[dict], where: str = "") -> SFTExample:
    """A chat as one :class:`SFTExample`: ``ids`` are ``apply_chat_template(messages)`` (the whole
    chat, unchanged); the loss is on each assistant message's tokens up to and including the
    end-of-turn token the template closes it with.

    Each assistant message's tokens are found by tokenizing growing prefixes of the chat:
    ``messages[:i]`` with the generation prompt (ends where the assistant's content begins),
    then ``messages[:i+1]``; the tokens in between are the content, the end-of-turn token and
    whatever the template writes after it (``\\n`` in ChatML). The mask stops at the last special
    token of that span (the end-of-turn token; if the span has none, the whole span is masked).
    Every tokenization must be a prefix of the next, else ``ValueError`` naming ``where`` and the
    message: such a template (one that rewrites earlier turns) cannot be masked this way.
    Malformed messages raise ``ValueError`` naming ``where``, the message index and the field."""
    _check_messages(messages, where)
    at = f"{where}: " if where else ""
    special = set(tokenizer.all_special_ids)
    chat = [{"role": m["role"], "content": m["content"]} for m in messages]
    mask: list[int] = []
    ids: list[int] = []

    def extend(new: list[int], i: int, what: str) -> None:
        if new[:len(ids)] != ids:
            raise ValueError(f"{at}message {i}: the chat template of "
                             f"{getattr(tokenizer, 'name_or_path', tokenizer)!r} is not prefix-"
                             f"stable ({what} does not start with the tokens of the chat before "
                             f"it); cannot mask the assistant's tokens")
        mask.extend([0] * (len(new) - len(ids)))
        ids[:] = new

    for i, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        extend(_tokenize(tokenizer, chat[:i], True), i, "the chat with its generation prompt")
        start = len(ids)
        extend(_tokenize(tokenizer, chat[:i + 1], False), i, "the chat with this message")
        span = ids[start:]
        closing = [k for k, t in enumerate(span) if t in special]
        end = start + (closing[-1] + 1 if closing else len(span))
        mask[start:end] = [1] * (end - start)
    extend(_tokenize(tokenizer, chat, False), len(chat) - 1, "the whole chat")
    return SFTExample(ids=list(ids), loss_mask=mask)


def load_chats(path, tokenizer) -> list[SFTExample]:
    """The chats of a JSONL file (one ``{"messages": [...]}`` object a line; blank lines skipped,
    other keys ignored) as :func:`chat_example` examples. A missing file raises
    ``FileNotFoundError``; a bad line or no chat ``ValueError``, naming ``file:line``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SFT data file {str(path)!r} does not exist (or is not a file)")
    examples = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: must be a JSON object {{\"messages\": [...]}}, got "
                                 f"a {type(record).__name__}")
            if not isinstance(record.get("messages"), list):
                raise ValueError(f"{where}: needs a \"messages\" list, got "
                                 f"{'none' if 'messages' not in record else repr(record['messages'])[:80]}")
            examples.append(chat_example(tokenizer, record["messages"], where=where))
    if not examples:
        raise ValueError(f"{path}: no chats (the file is empty or has only blank lines)")
    return examples


def format_target(agent, actions: Sequence[str]) -> str:
    """The text a model writes after the prompt's :func:`response_prefix` to take ``actions``:
    ``" a || b </answer>"`` (answer-only) or ``" </think> <answer> a || b </answer>"`` (think
    mode, an empty thought). Spacing as the prompt's own format hint shows it."""
    answer = f" {agent.action_sep} ".join(actions)
    tail = f" {answer} {ANSWER_CLOSE}"
    return f" {THINK_CLOSE} {ANSWER_OPEN}{tail}" if agent.think else tail


def format_examples(cfg, tokenizer, count: int, seed: int) -> list[SFTExample]:
    """``count`` format-only examples (module docstring) for the run ``cfg`` (a ``RunConfig``):
    example k is the turn-1 prompt of env part ``k % len(parts)`` (``train_parts(cfg.env)``) reset
    with seed ``seed + k``, then a random valid answer and EOS, the loss on those only.
    Deterministic in its arguments."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"format_examples: count must be an int >= 1, got {count!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"format_examples: seed must be an int, got {seed!r}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"format_examples: tokenizer {getattr(tokenizer, 'name_or_path', '')!r} "
                         f"has no EOS token to end a target with")
    agent = cfg.agent
    parts = train_parts(cfg.env)
    if not parts:
        raise ValueError("format_examples: the run trains on no env (every env.mix entry has "
                         "env_groups: 0)")
    rng = random.Random(seed)
    examples = []
    for k in range(count):
        part = parts[k % len(parts)]
        prompt, valid = _first_prompt(part, seed + k, tokenizer, cfg)
        if not valid:
            raise ValueError(f"format_examples: env {part.name!r} lists no valid actions")
        actions = [rng.choice(valid) for _ in range(rng.randint(1, agent.max_actions_per_turn))]
        target = tokenizer.encode(format_target(agent, actions), add_special_tokens=False) + [eos]
        parsed = parse_response(tokenizer.decode(target, skip_special_tokens=True), agent,
                                finished=True)
        if not parsed.format_ok or parsed.actions != actions:
            raise ValueError(f"format_examples: env {part.name!r}'s actions {actions} do not parse "
                             f"back from their answer (got {parsed.actions}, {parsed.error or 'ok'}"
                             f"); an action word may contain agent.action_sep "
                             f"{agent.action_sep!r} or a tag")
        examples.append(SFTExample(ids=prompt + target,
                                   loss_mask=[0] * len(prompt) + [1] * len(target)))
    return examples


def _first_prompt(part, seed: int, tokenizer, cfg) -> tuple[list[int], list[str]]:
    """Turn 1's prompt ids of an episode of ``part`` reset with ``seed``, built as
    ``rollout.episode.open_episode`` and ``take_turn`` build it, and the env's valid actions."""
    env = make(part.name, **part.kwargs)
    try:
        handle = LocalEnv(env)
        builder = PromptBuilder.for_env(tokenizer, cfg.agent, handle)
        obs = env.reset(seed)
        spec = EpisodeSpec(part.name, dict(part.kwargs), seed, episode_id=0, group_id=0,
                           env_tag=part.tag, max_turns=part.max_turns)
        state = EpisodeState(spec, handle, builder, History(), obs,
                             spec.max_turns or cfg.env.max_turns)
        return state.next_prompt_ids(cfg.agent), list(handle.valid_actions)
    finally:
        env.close()


def collate_examples(examples: Sequence[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded [B, S] batch, the layout of ``rollout.sample.collate`` (column t belongs to
    token t): ``input_ids`` (long, ``pad_id`` after each example), ``attention_mask`` (long, 1
    on the example's tokens), ``loss_mask`` (float32, the example's mask, 0 on padding)."""
    if not examples:
        raise ValueError("collate_examples: no examples")
    seq = max(len(e.ids) for e in examples)
    b = len(examples)
    input_ids = torch.full((b, seq), pad_id, dtype=torch.long)
    attention = torch.zeros(b, seq, dtype=torch.long)
    loss_mask = torch.zeros(b, seq, dtype=torch.float32)
    for i, e in enumerate(examples):
        n = len(e.ids)
        input_ids[i, :n] = torch.tensor(e.ids, dtype=torch.long)
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(e.loss_mask, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}
