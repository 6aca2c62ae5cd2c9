"""Test-only games and a tiny random model for the learning tests (tests/test_learn.py).

A random model over SmolLM2's 49152 tokens never writes a parseable answer, so every reward
would be the format penalty and nothing could be learned in a few steps. :func:`make_letter_model`
therefore builds a tiny random Qwen2 whose output is confined to a three-token alphabet
``A``, ``B`` and newline: a constant direction in every token embedding meets large output
weights of those three rows only, so they hold all but ~1e-6 of the probability, while the
rest of the network stays random. The first token after the prompt is never a newline and
later ones mostly are, so with ``agent.answer_line`` (the answer is the text up to the first
newline) a random policy writes a valid one-letter line almost always, starting with ``A`` or
``B`` at even odds: the games below pay on that first letter, which is the response's first
token (so a loss mask shifted by one token no longer trains it). Marker words in the prompt
steer one attention head, so the model can learn a different letter for each turn.

These envs are registered by the tests themselves, never in the package's registry.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ragen_mega.envs.base import TextEnv, invalid_action_info

#: token ids in SmolLM2's tokenizer
LETTER_A, LETTER_B, NEWLINE = 49, 50, 198
#: the words that tell the letter model which turn it is in (see :class:`DoorThenPayGame`)
PICK, PAY = 31413, 2290     # "Pick", " pay"
#: ">", the last token of every prompt (it ends with ``<answer>``): where the first letter is written
ANSWER_GT = 46


def make_letter_model(out_dir: str | Path, base_dir: str | Path) -> Path:
    """A copy of the tiny random model ``base_dir`` whose samples use only A, B and newline, and
    that can tell the door-picking turn from the paying turn.

    Every token embedding gets 10.0 in dimension 0 (the others stay ~N(0, 0.02)), so after the
    final RMSNorm (its dimension-0 weight set to 1) each position's hidden state is ~7 along
    dimension 0. The output matrix is zero except three rows: 3.0 (A, B) and 3.43 (newline) in
    dimension 0, i.e. logits ~21-24 for the alphabet against 0 for the rest, newline 0.91 after
    a letter so answers end soon. The prompt's last token ``>`` (of ``<answer>``) also has 5.0
    in dimension 4, where the newline row has -4.5: the first token is A or B (~1e-5 newline). With ``adam_eps`` ~1e-2 the near-zero
    gradients of the random rest stay near-zero updates (Adam would otherwise blow them up to
    full-size steps that drown the constant direction).

    The turn signal: the marker words ``Pick`` and `` pay`` get 10.0 in dimension 1 ("a marker")
    and -10.0 / +10.0 in dimension 2 (which one). In layer 0, query head 0 reads dimension 0 and
    its key reads dimension 1 in the slowest-rotating RoPE pair, so every position attends
    (score ~15 against ~0) to the marker words before it; its value carries dimension 2, written
    by ``o_proj`` into residual dimension 3: ~-3.6 after the final norm in a prompt with
    ``Pick``, ~+3.6 with `` pay``, ~0 with neither. The output rows start at 0 in dimension 3,
    so the model starts context-free (same letter odds in every turn) and can learn a different
    letter per turn only by learning the right sign there from the right turn's tokens."""
    from safetensors.torch import load_file, save_file

    from ragen_mega.models.prepare import atomic_dir

    def build(tmp: Path) -> None:
        import json
        import shutil

        for f in Path(base_dir).iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, tmp / f.name)
        config = json.loads((Path(base_dir) / "config.json").read_text())
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        slow = head_dim // 2 - 1             # the RoPE pair (slow, slow + head_dim/2) turns least
        weights = load_file(str(Path(base_dir) / "model.safetensors"))
        embed = weights["model.embed_tokens.weight"]
        embed[:, 0] = 10.0
        embed[[PICK, PAY], 1] = 10.0
        embed[PICK, 2], embed[PAY, 2] = -10.0, 10.0
        embed[ANSWER_GT, 4] = 5.0
        attn = "model.layers.0.self_attn."
        weights["model.layers.0.input_layernorm.weight"][:3] = 1.0
        for name in ("q", "k"):  # a clean slow pair in head 0 (kv head 0)
            for row in (slow, slow + head_dim // 2):
                weights[f"{attn}{name}_proj.weight"][row] = 0.0
                weights[f"{attn}{name}_proj.bias"][row] = 0.0
        weights[f"{attn}q_proj.weight"][slow, 0] = 1.3
        weights[f"{attn}k_proj.weight"][slow, 1] = 1.3
        weights[f"{attn}v_proj.weight"][0] = 0.0
        weights[f"{attn}v_proj.weight"][0, 2] = 1.05
        weights[f"{attn}v_proj.bias"][0] = 0.0
        weights[f"{attn}o_proj.weight"][3] = 0.0
        weights[f"{attn}o_proj.weight"][3, 0] = 1.05
        weights["model.norm.weight"][[0, 3, 4]] = 1.0
        head = weights["lm_head.weight"]
        head.zero_()
        head[[LETTER_A, LETTER_B], 0] = 3.0
        head[NEWLINE, 0] = 3.43
        head[NEWLINE, 4] = -4.5
        save_file({k: v.contiguous() for k, v in weights.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return atomic_dir(Path(out_dir), build)


def first_letter(action: str) -> str | None:
    """``A`` or ``B`` when the answer starts with it, else None."""
    head = action.strip()[:1].upper()
    return head if head in ("A", "B") else None


class _LetterGame(TextEnv):
    """A game whose actions are lines of letters, read by their first letter."""

    rules = ""

    @property
    def instruction(self) -> str:
        return self.rules

    @property
    def valid_actions(self) -> list[str]:
        return ["A", "B"]


class FirstLetterGame(_LetterGame):
    """One turn: an answer starting with ``A`` pays 1 (success), one starting with ``B`` 0."""

    rules = "Write one line of letters. A line that starts with A wins."

    def reset(self, seed: int) -> str:
        return "Your line:"

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        letter = first_letter(action)
        if letter is None:
            return "Your line:", 0.0, True, invalid_action_info("not A or B")
        won = letter == "A"
        return "Done.", float(won), True, {"action_is_valid": True, "action_is_effective": True,
                                           "success": won}


def first_letter_references(env_kwargs, seeds, max_turns, max_actions_per_turn, example_answer):
    """FirstLetterGame's reference lines (``envs/references.py``'s signature), by hand: a random
    valid answer (A or B) wins half the time; always A, and so the best policy, always wins."""
    return {"random_valid": 0.5, "best_fixed": 1.0, "optimal": 1.0}


class DoorThenPayGame(_LetterGame):
    """Two turns, told apart by their prompts' marker words. Turn 1 ("Pick a door:") picks a door
    by the answer's first letter and pays nothing; turn 2 ("Now pay:") pays 1 only if the door
    was A *and* its answer starts with B. ``success`` is that payout, so the success rate is
    P(A in turn 1) x P(B in turn 2), ~0.22 at the start. Learning both needs the credit on the
    right turn and the right tokens: a gradient from one turn's tokens pushes the other turn's
    letter the wrong way (the letter model starts context-free). Runs with
    ``agent.memory_turns=0``, so a turn's prompt shows only its own marker word."""

    rules = "Write one line of letters per turn. Turn 1 chooses a door, turn 2 settles."

    def __init__(self):
        self._door: str | None = None

    def reset(self, seed: int) -> str:
        self._door = None
        return "Pick a door:"

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        letter = first_letter(action)
        if letter is None:
            return ("Pick a door:" if self._door is None else "Now pay:", 0.0, False,
                    invalid_action_info("not A or B"))
        info = {"action_is_valid": True, "action_is_effective": True, "success": False}
        if self._door is None:
            self._door = letter
            return "Now pay:", 0.0, False, info
        info["success"] = paid = self._door == "A" and letter == "B"
        return "Done.", float(paid), True, info
