"""One agent episode's conversation as token ids: what the gateway (``rollout/gateway.py``) sends
the engine when an agent speaks in chat messages or prompt strings.

Re-tokenizing a conversation is the classic multi-turn RL bug: an earlier reply, decoded and
encoded again, need not give back the sampled ids (a merge across a word boundary, a stripped
space, a special token spelled out), so the trainer would score tokens the policy never produced.
Here the template is never applied to a reply the engine wrote: a call whose messages extend the
previous call's conversation (the same messages, the assistant message exactly as returned, then
new ones) is sent as the previous prompt ids + the sampled ids + the ids of the new text only:
what the template renders after the reply (its end of the assistant turn, ``<|im_end|>`` if the
engine stopped without it, then ``\\n``; then the new messages and the generation prompt).

A call that does not extend the history (an edited or reordered message, a template that
rewrites assistant content, e.g. Qwen3 dropping past reasoning) is rendered from scratch and
reported (``extends`` False) for the gateway to count. Its sample is still exact; it only no
longer shares a prefix with the episode's earlier samples.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class _Turn:
    """The last call: its messages plus the returned reply (chat) or its full text
    (completions), the ids that render it, and (chat) what the template adds after the
    sampled ids to close the reply."""
    key: Any                 # chat: list of {"role", "content"}; completions: the full text
    ids: list[int]           # prompt ids + sampled ids
    rendered: str = ""       # chat: the template's text of ``key`` (no generation prompt)
    bridge: str = ""         # chat: template text between the sampled ids and the next message


class TokenHistory:
    """The token ids of one episode's calls so far (``tokenizer``: the served model's).

    :meth:`chat_prompt` / :meth:`completion_prompt` give the ids for a call and whether they
    extend the previous call's; :meth:`record_chat` / :meth:`record_completion` remember the
    call once the engine has answered it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._last: _Turn | None = None

    # ------------------------------------------------------------------ chat messages
    def chat_prompt(self, messages: list[dict[str, str]]) -> tuple[list[int], bool]:
        """The prompt ids of a chat call and whether they extend the previous call (its prompt
        and sampled ids, unchanged, then the new messages' template text)."""
        full = self._render(messages, generation_prompt=True)
        last = self._last
        if (last is not None and isinstance(last.key, list)
                and len(messages) > len(last.key) and messages[:len(last.key)] == last.key
                and full.startswith(last.rendered)):
            return last.ids + self._encode(last.bridge + full[len(last.rendered):]), True
        return self._encode(full), False

    def record_chat(self, messages: list[dict[str, str]], prompt_ids: list[int],
                    output_ids: list[int], content: str) -> None:
        """Remember a chat call: ``content`` is the assistant message as returned to the agent.
        The next call extends it only if the template renders that reply as the sampled text
        followed by template text alone (otherwise the sampled ids could not stay as they are)."""
        conversation = [*messages, {"role": "assistant", "content": content}]
        asked = self._render(messages, generation_prompt=True)
        rendered = self._render(conversation, generation_prompt=False)
        sampled = self.tokenizer.decode(output_ids, skip_special_tokens=False)
        reply = rendered[len(asked):] if rendered.startswith(asked) else None
        if reply is None or not reply.startswith(sampled):
            self._last = None
            return
        self._last = _Turn(conversation, list(prompt_ids) + list(output_ids), rendered,
                           reply[len(sampled):])

    # ------------------------------------------------------------------ prompt strings
    def completion_prompt(self, prompt: str) -> tuple[list[int], bool]:
        """The ids of a completion call's ``prompt``: the previous call's prompt and sampled ids
        when ``prompt`` starts with that call's prompt + completion text, then the rest."""
        last = self._last
        if last is not None and isinstance(last.key, str) and prompt.startswith(last.key):
            return last.ids + self._encode(prompt[len(last.key):]), True
        return self._encode(prompt), False

    def record_completion(self, prompt: str, prompt_ids: list[int], output_ids: list[int],
                          text: str) -> None:
        """Remember a completion call; ``text`` is the completion as returned to the agent. A
        completion that ended on a special token (end of sequence) is not extended: the agent's
        text does not hold that token, so no later prompt string can continue after it."""
        sampled = self.tokenizer.decode(output_ids, skip_special_tokens=False)
        self._last = (_Turn(prompt + text, list(prompt_ids) + list(output_ids))
                      if sampled == text else None)

    # ------------------------------------------------------------------
    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []
