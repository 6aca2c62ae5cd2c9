"""Reference lines (``envs/references.py``) on hand-worked cases, as eval and train assemble
them for a held-out set (``evaluate.held_out_references``), and as ``ragen-mega plot`` draws
them."""
from __future__ import annotations

import json

import pytest

from ragen_mega.config import load_run_config
from ragen_mega.envs.frozen_lake import FrozenLakeEnv
from ragen_mega.envs.references import reference_lines
from ragen_mega.evaluate import REFERENCES_FILE, format_table, held_out_references
from ragen_mega.plot import plot_runs

#: a 2x2 lake without holes, every move going where it is meant: start and goal are either
#: neighbours or diagonal
OPEN_2X2 = {"size": 2, "p": 1.0, "is_slippery": False}
STEP = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}


def hand_worked_2x2(rows: list[str], example: list[str]) -> dict[str, float]:
    """One turn of up to two moves on ``OPEN_2X2``, worked by hand. From the start, one of the
    four moves goes towards a neighbouring goal, two hit the walls and stay, one goes to the
    other neighbour (diagonal to the goal): two random moves win 1/4 + 2/4 * 1/4 = 3/8. A
    diagonal goal needs one of the two moves to a neighbour, then the one move on: 2/4 * 1/4.
    One or two fixed moves always reach it."""
    cells = {ch: (r, c) for r, row in enumerate(rows) for c, ch in enumerate(row)}
    (sr, sc), (gr, gc) = cells["S"], cells["G"]
    adjacent = abs(sr - gr) + abs(sc - gc) == 1
    position, won = (sr, sc), False
    for word in example:  # the example answer, walked against the walls, stopping on the goal
        dr, dc = STEP[word]
        position = (min(1, max(0, position[0] + dr)), min(1, max(0, position[1] + dc)))
        if position == (gr, gc):
            won = True
            break
    return {"random_valid": 3 / 8 if adjacent else 1 / 8, "example_copy": float(won),
            "best_fixed": 1.0, "optimal": 1.0}


def test_frozen_lake_lines_on_open_2x2_maps_match_the_hand_worked_ones():
    env, seen = FrozenLakeEnv(**OPEN_2X2), set()
    for seed in range(12):
        env.reset(seed)
        expected = hand_worked_2x2(env.map_rows, ["Left", "Down"])
        got = reference_lines("frozen_lake", OPEN_2X2, [seed], max_turns=1,
                              max_actions_per_turn=2, example_answer=["Left", "Down"])
        assert list(got) == ["random_valid", "example_copy", "best_fixed", "optimal"]
        assert got == pytest.approx(expected, abs=1e-12), (seed, env.map_rows)
        seen.add((expected["random_valid"], expected["example_copy"]))
    assert len(seen) >= 3          # neighbours and diagonals, example winning and losing
    # a seed listed twice counts twice; without an example the copy line is left out
    env.reset(0)
    a = hand_worked_2x2(env.map_rows, ["Left"])["random_valid"]
    env.reset(1)
    b = hand_worked_2x2(env.map_rows, ["Left"])["random_valid"]
    got = reference_lines("frozen_lake", OPEN_2X2, [0, 0, 1], max_turns=1, max_actions_per_turn=2)
    assert got == pytest.approx({"random_valid": (2 * a + b) / 3, "best_fixed": 1.0,
                                 "optimal": 1.0}, abs=1e-12)


@pytest.mark.parametrize("kwargs, random_valid, example_copy", [
    ({}, 0.5, 0.0),                              # Dragon 0.25 x 1.0 beats Phoenix's 0.1
    ({"low_risk_reward": 0.3}, 0.5, 1.0),        # now Phoenix, the example's first arm, is better
    ({"low_risk_reward": 0.25}, 1.0, 1.0),       # equal expectations: both arms are better
])
def test_bandit_lines_in_closed_form(kwargs, random_valid, example_copy):
    got = reference_lines("bandit", kwargs, [3, 4], max_turns=1, max_actions_per_turn=5,
                          example_answer=["Phoenix", "Dragon"])
    assert got == {"random_valid": random_valid, "example_copy": example_copy,
                   "best_fixed": 1.0, "optimal": 1.0}


def test_an_env_without_lines_has_none():
    assert reference_lines("babyai", {}, [0], max_turns=5, max_actions_per_turn=2) is None


MIX = ("env.mix=[{tag: lake, name: frozen_lake, kwargs: {size: 2, p: 1.0, is_slippery: false},"
       " env_groups: 1, val_groups: 3}, {tag: bandit, env_groups: 1, val_groups: 2}]")


def test_held_out_references_of_a_mix_weigh_each_tag_by_its_episodes():
    """Lake groups play held-out seeds val_seed..val_seed+2 (two episodes each), the bandit's
    episodes the next four seeds; overall = the episode-weighted mean, per tag their own."""
    cfg = load_run_config(None, [MIX, "env.env_groups=2", "env.val_group_size=2",
                                 "env.max_turns=1", "agent.max_actions_per_turn=2"])
    overall, per_tag = held_out_references(cfg)
    env, lake = FrozenLakeEnv(**OPEN_2X2), []
    for seed in range(cfg.env.val_seed, cfg.env.val_seed + 3):
        env.reset(seed)
        lake.append(hand_worked_2x2(env.map_rows, [])["random_valid"])
    assert per_tag["lake"] == pytest.approx({"random_valid": sum(lake) / 3, "best_fixed": 1.0,
                                             "optimal": 1.0}, abs=1e-12)
    assert per_tag["bandit"] == {"random_valid": 0.5, "best_fixed": 1.0, "optimal": 1.0}
    assert overall == pytest.approx({"random_valid": (sum(lake) * 2 + 0.5 * 4) / 10,
                                     "best_fixed": 1.0, "optimal": 1.0}, abs=1e-12)
    # the prompt's example (the env's first two action words) adds the copy line
    cfg = load_run_config(None, [MIX, "env.env_groups=2", "env.max_turns=1",
                                 "agent.max_actions_per_turn=2", "agent.example_answer=true"])
    _, per_tag = held_out_references(cfg)
    assert per_tag["bandit"]["example_copy"] == 0.0        # Phoenix || Dragon pulls Phoenix
    # one env without lines: no overall lines, the others' per tag
    cfg = load_run_config(None, [MIX.replace("]", ", {tag: babyai, env_groups: 1}]"),
                                 "env.env_groups=3", "env.max_turns=1"])
    overall, per_tag = held_out_references(cfg)
    assert overall == {} and sorted(per_tag) == ["bandit", "lake"]


def test_eval_table_prints_the_lines_next_to_success():
    report = {"success": 0.25, "valid_action_rate": 1.0, "mean_turns": 1.0, "episodes": 4,
              "response_length": 3.0, "references": {"random_valid": 0.5, "optimal": 1.0},
              "per_tag": {"bandit": {"success": 0.25, "valid_action_rate": 1.0, "episodes": 4,
                                     "mean_turns": 1.0, "response_length": 3.0,
                                     "references": {"random_valid": 0.5, "optimal": 1.0}}}}
    header, bandit, total = format_table(report).splitlines()
    assert header.split()[1:5] == ["episodes", "success", "random_valid", "optimal"]
    assert bandit.split()[1:5] == total.split()[1:5] == ["4", "0.250", "0.500", "1.000"]


def write_run(run_dir, references=None):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/success": 0.1}) + "\n")
    if references is not None:
        (run_dir / REFERENCES_FILE).write_text(json.dumps({"references": references}))
    return run_dir


def test_plot_draws_the_lines_on_the_success_panel(tmp_path):
    lines = {"random_valid": 0.26, "example_copy": 0.135, "best_fixed": 0.78, "optimal": 0.94}
    a, b = write_run(tmp_path / "base", lines), write_run(tmp_path / "sft", lines)
    success = plot_runs([a, b]).axes[0]
    drawn = {l.get_label(): list(l.get_ydata()) for l in success.lines}
    for key, value in lines.items():  # shared by both runs: drawn once, labelled by the key
        assert drawn[key] == [value, value]
    assert {l.get_color() for l in success.lines if l.get_label() in lines} == {"grey"}
    c = write_run(tmp_path / "other", {"random_valid": 0.5})
    drawn = {l.get_label(): list(l.get_ydata()) for l in plot_runs([a, c]).axes[0].lines}
    assert drawn["base optimal"] == [0.94, 0.94] and drawn["other random_valid"] == [0.5, 0.5]
    assert "optimal" not in drawn
    (tmp_path / "other" / REFERENCES_FILE).write_text("[1, 2")
    with pytest.raises(ValueError, match=REFERENCES_FILE):
        plot_runs([c])
