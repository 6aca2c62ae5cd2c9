"""BALROG's TextWorld, MiniHack and NetHack through the whole loop: one run, the three envs in
one mix, streamed (``rollout.mode: turns``) on a tiny model (real Ray, SGLang engine, Megatron
actor), two steps. Each prompt is the current observation alone (NetHack's instruction is
1,100 tokens; with a turn of memory its prompts outgrow the tiny model's 2,048).

The tiny random model writes no answer in the format, so no game moves (as in
tests/test_train_streamed.py's Crafter): what is checked is that each family's observations
reach the engine and its turns the trainer, NetHack's games streamed across the steps,
TextWorld's and MiniHack's ended by a 3-turn limit inside each step. The envs' steps and
BALROG's progression are checked in tests/test_nethack.py and tests/test_textworld.py.
"""
from __future__ import annotations

import math

from ragen_mega.config import load_run_config
from ragen_mega.train import train

DEMO = "examples/bandit_cpu_demo.yaml"


def test_textworld_minihack_and_nethack_train_streamed(tiny_run_overrides, tmp_path,
                                                       private_ray):
    games = tmp_path / "textworld_games"
    mix = ("env.mix=["
           f"{{tag: textworld, kwargs: {{task: coin_collector, level: 4, games: 2, "
           f"cache_dir: '{games}'}}, env_groups: 1, max_turns: 3}},"
           " {tag: minihack, kwargs: {task: corridor_r3, show_map: false}, env_groups: 1,"
           " max_turns: 3},"
           " {tag: nethack, kwargs: {show_map: false}, env_groups: 1, max_turns: 5000}]")
    overrides = tiny_run_overrides(tmp_path / "run", 2, single_rank=True) + [
        mix, "env.env_groups=3", "env.max_turns=5000", "rollout.mode=turns",
        "rollout.turns_per_step=3", "agent.memory_turns=0", "algo.adv_estimator=gigpo"]
    history = train(load_run_config(DEMO, overrides))
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert h["rollout/samples"] == h["train/batch_samples"] == 3 * 2 * 3  # streams x turns
        for tag in ("textworld", "minihack", "nethack"):
            assert h[f"rollout/{tag}/samples"] == 6
        # two 3-turn episodes end in each step's 3 turns; NetHack's games go on
        assert h["rollout/textworld/episodes_finished"] == 2
        assert h["rollout/minihack/episodes_finished"] == 2
        assert h["rollout/nethack/episodes_finished"] == 0
        assert "rollout/nethack/episode_length" not in h
        assert all(math.isfinite(v) for v in h.values())
