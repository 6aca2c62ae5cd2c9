"""Test-only games and a tiny random model for the learning tests (tests/test_learn.py).

A random model over SmolLM2's 49152 tokens never writes a parseable answer, so every reward
would be the format penalty and nothing could be learned in a few steps. :func:`make_letter_model`
therefore builds a tiny random Qwen2 whose output is confined to a three-token alphabet
``A``, ``B`` and newline: a constant direction in every token embedding meets large output
weights of those three rows only, so they hold all but ~1e-6 of the probability, while the
rest of the network stays random. With ``agent.answer_line`` the answer is the text up to the
first newline, so within 8 tokens a random policy writes a valid one-line answer ~95% of the
time and starts it with ``A`` half of those: the games below pay on that first letter.

These envs are registered by the tests themselves, never in the package's registry.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ragen_mega.envs.base import TextEnv, invalid_action_info

#: token ids in SmolLM2's tokenizer
LETTER_A, LETTER_B, NEWLINE = 49, 50, 198


def make_letter_model(out_dir: str | Path, base_dir: str | Path) -> Path:
    """A copy of the tiny random model ``base_dir`` whose samples use only A, B and newline.

    Every token embedding gets 10.0 in dimension 0 (the others stay ~N(0, 0.02)), so after the
    final RMSNorm (its dimension-0 weight set to 1) each position's hidden state is ~8 along
    dimension 0 and ~0 elsewhere. The output matrix is zero except dimension 0 of three rows:
    3.0 (A, B) and 3.04 (newline), i.e. logits ~24 for the alphabet against 0 for the rest,
    newline a little more likely (0.39 vs 0.31 each) so answers end soon. The policy is thus a
    three-letter unigram whose letters' weights are what the loop has to learn; with
    ``adam_eps`` ~1e-2 the near-zero gradients of the random rest stay near-zero updates
    (Adam would otherwise blow them up to full-size steps that drown the constant direction)."""
    from safetensors.torch import load_file, save_file

    from ragen_mega.models.prepare import atomic_dir

    def build(tmp: Path) -> None:
        import shutil

        for f in Path(base_dir).iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, tmp / f.name)
        weights = load_file(str(Path(base_dir) / "model.safetensors"))
        embed = weights["model.embed_tokens.weight"]
        embed[:, 0] = 10.0
        weights["model.norm.weight"][0] = 1.0
        head = weights["lm_head.weight"]
        head.zero_()
        head[[LETTER_A, LETTER_B], 0] = 3.0
        head[NEWLINE, 0] = 3.04
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


class DoorThenPayGame(_LetterGame):
    """Two turns. Turn 1 picks a door by the answer's first letter (``A`` or ``B``) and pays
    nothing; turn 2 (any valid answer) opens it and pays 1 only behind door A. ``success`` is set
    at the turn-1 pick of door A, so the run's success rate is the probability of the right
    first-turn choice; the reward that teaches it arrives one turn later."""

    rules = "Pick a door with a line starting A or B, then open it with any line."

    def __init__(self):
        self._door: str | None = None

    def reset(self, seed: int) -> str:
        self._door = None
        return "Pick a door:"

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        letter = first_letter(action)
        if letter is None:
            return ("Pick a door:" if self._door is None else "Open it:", 0.0, False,
                    invalid_action_info("not A or B"))
        info = {"action_is_valid": True, "action_is_effective": True, "success": False}
        if self._door is None:
            self._door = letter
            info["success"] = letter == "A"
            return "Open it:", 0.0, False, info
        return "Done.", float(self._door == "A"), True, info
