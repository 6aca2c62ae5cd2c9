"""What a start does with its run directory (``ragen_mega/run_intent.py``), and pruning old
checkpoints (``trainer.keep_checkpoints``).

Unit tests build run directories with checkpoints the real ``verify_checkpoint`` accepts; the
last test runs ``ragen-mega train`` for real (Ray, an SGLang engine, Megatron trainer ranks) four
times in one run directory, as a user who reruns a README command would."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ragen_mega import checkpoints, run_intent
from ragen_mega.config import load_run_config
from test_preemption import write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "bandit_cpu_demo.yaml"


def _cfg(run_dir, *overrides):
    return load_run_config(DEMO, [f"trainer.run_dir={run_dir}", "trainer.total_steps=5",
                                  "critic.enable=true", *overrides])


def _saved_run(run_dir, steps, *overrides):
    """A run directory as a start of ``_cfg(run_dir, *overrides)`` leaves it after ``steps``
    complete saves: its config.json and actor and critic checkpoints with the pointer."""
    cfg = _cfg(run_dir, *overrides)
    run_intent.record_start(cfg, run_intent.start_plan(cfg))
    for step in steps:
        for role in ("actor", "critic"):
            write_checkpoint(checkpoints.step_dir(run_dir, role, step), step)
    (checkpoints.checkpoint_root(run_dir) / checkpoints.LATEST).write_text(str(steps[-1]))
    return cfg


def test_a_new_run_says_so(tmp_path):
    plan = run_intent.start_plan(_cfg(tmp_path / "run"))
    assert (plan.resume_step, plan.complete) == (None, False)
    assert plan.message == f"new run in {tmp_path / 'run'}"


def test_a_run_with_checkpoints_resumes_and_lists_the_keys_that_may_change(tmp_path):
    _saved_run(tmp_path, [1, 2])
    plan = run_intent.start_plan(_cfg(tmp_path, "trainer.eval_every=2", "trainer.loggers=[]",
                                      "rollout.num_engines=2"))
    assert (plan.resume_step, plan.complete, plan.forced) == (2, False, False)
    assert plan.message == (f"resuming {tmp_path} from step 2 of 5; changed since its last "
                            f"start: rollout.num_engines 1 -> 2, trainer.eval_every 5 -> 2, "
                            f'trainer.loggers ["tensorboard"] -> []')


def test_a_finished_run_is_complete_and_says_how_to_go_on(tmp_path):
    _saved_run(tmp_path, [5])
    plan = run_intent.start_plan(_cfg(tmp_path))
    assert plan.complete
    assert plan.message == (f"{tmp_path} is complete at step 5 (trainer.total_steps=5): nothing "
                            f"to do. To train on, raise trainer.total_steps; for a new run, set "
                            f"another trainer.run_dir")


@pytest.mark.parametrize("override, shown", [
    ("actor.lr=3e-4", "actor.lr: 2e-05 -> 0.0003"),
    ("model.path=textgame-small", 'model.path: "smollm2" -> "textgame-small"'),
    ("algo.gamma=0.9", "algo.gamma: 1.0 -> 0.9"),
    ("env.seed=7", "env.seed: 0 -> 7"),
    ("filter.ratio=0.5", "filter.ratio: 0.25 -> 0.5"),
    ("rollout.top_p=0.9", "rollout.top_p: 1.0 -> 0.9"),
])
def test_a_resume_whose_config_changes_what_it_means_is_refused_naming_each_key(
        tmp_path, override, shown):
    _saved_run(tmp_path, [2])
    with pytest.raises(run_intent.ConfigChanged) as refused:
        run_intent.start_plan(_cfg(tmp_path, override, "trainer.total_steps=9"))
    message = str(refused.value)
    assert message.startswith(f"{tmp_path} holds a run at step 2 whose config differs in keys "
                              f"that change what it trains:\n  {shown}\n"), message
    assert "trainer.total_steps" not in message  # a key that may change is not a reason
    assert "trainer.resume=force" in message
    assert not (tmp_path / run_intent.CHANGES_FILE).exists()


def test_force_resumes_and_records_the_change_in_the_run(tmp_path):
    _saved_run(tmp_path, [2])
    cfg = _cfg(tmp_path, "actor.lr=3e-4", "trainer.resume=force")
    plan = run_intent.start_plan(cfg)
    assert (plan.resume_step, plan.forced) == (2, True)
    assert "FORCED (trainer.resume=force), changed since its last start: actor.lr 2e-05 -> " \
           "0.0003" in plan.message
    run_intent.record_start(cfg, plan)
    (entry,) = [json.loads(line) for line in
                (tmp_path / run_intent.CHANGES_FILE).read_text().splitlines()]
    assert (entry["step"], entry["forced"]) == (2, True)
    assert entry["changes"] == {"actor.lr": [2e-5, 3e-4], "trainer.resume": ["auto", "force"]}
    # the forced config is the run's now: the next plain start with it is no change of meaning
    again = run_intent.start_plan(_cfg(tmp_path, "actor.lr=3e-4"))
    assert again.resume_step == 2 and not again.forced


def test_never_over_a_run_with_checkpoints_says_they_are_written_over(tmp_path):
    _saved_run(tmp_path, [1])
    plan = run_intent.start_plan(_cfg(tmp_path, "trainer.resume=never", "actor.lr=1e-3"))
    assert plan.resume_step is None
    assert plan.message.endswith("(trainer.resume=never: its checkpoints are written over)")


def test_prune_keeps_the_newest_complete_steps_and_never_a_save_under_way(tmp_path):
    for step in (1, 2, 3, 4):
        for role in ("actor", "critic"):
            write_checkpoint(checkpoints.step_dir(tmp_path, role, step), step)
    (checkpoints.checkpoint_root(tmp_path) / checkpoints.LATEST).write_text("3")  # 4: under way
    assert checkpoints.prune(tmp_path, keep=2) == [1]
    for role in ("actor", "critic"):
        assert sorted(p.name for p in (checkpoints.checkpoint_root(tmp_path) / role).iterdir()
                      ) == ["step_2", "step_3", "step_4"]
    assert checkpoints.prune(tmp_path, keep=1) == [2]
    with pytest.warns(UserWarning, match="step_4: its step never completed"):
        assert checkpoints.find_resume_step(_cfg(tmp_path)) == 3


def _train(run_dir, tiny_run_overrides, *extra):
    overrides = tiny_run_overrides(run_dir, total_steps=2, single_rank=True) + [
        "trainer.keep_checkpoints=1", *extra]
    return subprocess.run([sys.executable, "-m", "ragen_mega.cli", "train", str(DEMO),
                           *overrides], capture_output=True, text=True, timeout=900, cwd=ROOT)


def _kept_steps(run_dir):
    """The actor's saved steps (the single-rank run has no critic; ``prune``'s own test covers
    both roles)."""
    return sorted(p.name for p in (checkpoints.checkpoint_root(run_dir) / "actor").iterdir())


def test_rerunning_a_command_says_what_it_does(tmp_path, tiny_run_overrides):
    """A user's reruns of one command in one run directory, with real processes: the first
    trains (start-up stages printed, older checkpoints pruned), the same command again finds the
    run complete and starts nothing, a changed learning rate is refused naming the key, and a
    larger step budget resumes after the pruning, the change listed."""
    run_dir = tmp_path / "run"
    first = _train(run_dir, tiny_run_overrides)
    assert first.returncode == 0, first.stderr[-3000:]
    for line in (f"new run in {run_dir}", "Ray ready", "engines 1/1 ready",
                 "trainer ranks ready; the weights of model.path ("):
        assert line in first.stderr, first.stderr[-3000:]   # start-up lines: stderr
    assert "step 2/2" in first.stdout
    assert _kept_steps(run_dir) == ["step_2"]

    again = _train(run_dir, tiny_run_overrides)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{run_dir} is complete at step 2 (trainer.total_steps=2): nothing to do" in \
        again.stderr
    assert "Ray ready" not in again.stderr   # nothing was started

    changed = _train(run_dir, tiny_run_overrides, "actor.lr=3e-4")
    assert changed.returncode == 2
    assert "whose config differs in keys that change what it trains:\n  actor.lr: 0.001 -> " \
           "0.0003\n" in changed.stderr, changed.stderr[-3000:]
    assert "Ray ready" not in changed.stderr

    longer = _train(run_dir, tiny_run_overrides, "trainer.total_steps=3")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert (f"resuming {run_dir} from step 2 of 3; changed since its last start: "
            f"trainer.total_steps 2 -> 3") in longer.stderr, longer.stderr[-3000:]
    assert "the weights of step 2's checkpoint synced into the engines" in longer.stderr
    assert "step 3/3" in longer.stdout
    assert _kept_steps(run_dir) == ["step_3"]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text()
             .splitlines()]
    assert steps == [1, 2, 3]


def test_resume_from_a_directory_that_holds_no_checkpoint_fails_before_the_start(tmp_path,
                                                                                   tiny_model):
    """``trainer.resume=DIR`` is checked when the run starts (``preflight``), naming the key;
    a directory holding ``actor/`` passes."""
    from ragen_mega.config_tree import ConfigError
    from ragen_mega.preflight import preflight

    model = f"model.path={tiny_model('qwen2')}"
    with pytest.raises(ConfigError, match=r"trainer.resume: auto, never, force, or a directory "
                                          r"holding actor/ .*'.*nowhere' is none of these"):
        preflight(load_run_config(DEMO, [model, f"trainer.resume={tmp_path / 'nowhere'}"]))
    (tmp_path / "ckpt" / "actor").mkdir(parents=True)
    preflight(load_run_config(DEMO, [model, f"trainer.resume={tmp_path / 'ckpt'}"]))
