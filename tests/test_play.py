"""``ragen-mega play``: the terminal shows exactly the env's text and reacts to stdin lines."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ragen_mega.envs import make
from ragen_mega.envs.play import main, parse_kwarg

REPO = Path(__file__).resolve().parent.parent


def run_play(args: list[str], stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ragen_mega.envs.play", *args], input=stdin,
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_play_prints_the_model_text_and_steps_until_eof():
    actions = ["hello", "Up", "LEFT", "right"]
    out = run_play(["sokoban", "--seed", "4", "--kwarg", "dim_room=(7,7)",
                    "--kwarg", "num_boxes=2"], "\n".join(actions) + "\n")
    assert out.returncode == 0, out.stderr
    env = make("sokoban", dim_room=(7, 7), num_boxes=2)
    expected_start = env.instruction + "\n\n" + env.reset(4) + "\n"
    assert out.stdout.startswith(expected_start)
    rest = out.stdout[len(expected_start):].split("\n")
    for action in actions:  # each step: one "[step]" line, then the observation verbatim
        obs, reward, done, info = env.step(action)
        assert rest[0].startswith(f"[step] reward={reward:g} done={done} ")
        assert str(info["action_is_valid"]) in rest[0]
        assert rest[1:1 + len(obs.split("\n"))] == obs.split("\n")
        rest = rest[1 + len(obs.split("\n")):]
    assert rest == [""]


def test_play_stops_when_the_episode_ends():
    out = run_play(["bandit", "--seed", "2", "--kwarg", "high_risk_name=Trader",
                    "--kwarg", "low_risk_name=Librarian"], "trader\nLibrarian\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("[step]") == 1 and "You pulled Trader" in out.stdout
    assert out.stdout.rstrip().endswith("[episode done]")


def test_env_kwargs_are_taken_as_plain_options():
    out = run_play(["babaisai", "--task", "two_room-break_stop-goto_win", "--seed", "3",
                    "--add_ruleset=False"], "up\n")
    assert out.returncode == 0, out.stderr
    env = make("babaisai", task="two_room-break_stop-goto_win", add_ruleset=False)
    first = env.reset(3)
    after_up = env.step("up")[0]
    assert out.stdout.startswith(env.instruction + "\n\n" + first + "\n")
    assert out.stdout.endswith("\n" + after_up + "\n") and "Active rules" not in out.stdout


@pytest.mark.parametrize("argv,message", [
    (["no_such_env"], "unknown env 'no_such_env'"),
    (["bandit", "--kwarg", "oops"], "key=value"),
    (["bandit", "--kwarg", "high_risk_prob=2"], "high_risk_prob"),
    (["bandit", "--kwarg", "colour=red"], "colour"),
    (["bandit", "--kwarg", "low_risk_name=A", "--kwarg", "low_risk_name=B"], "twice"),
    (["sokoban", "--seed", "-3"], "seed must be a non-negative int"),
    (["babaisai", "--task"], "option --task needs a value"),
    (["babaisai", "stray"], "unexpected argument 'stray'"),
    (["babaisai", "--task", "nope"], "unknown task 'nope'"),
])
def test_play_reports_bad_arguments(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_kwarg_values_are_literals_or_strings():
    assert parse_kwarg("dim_room=(8, 8)") == ("dim_room", (8, 8))
    assert parse_kwarg("is_slippery=False") == ("is_slippery", False)
    assert parse_kwarg(" p = 0.7") == ("p", 0.7)
    assert parse_kwarg("low_risk_name=Trader") == ("low_risk_name", "Trader")
