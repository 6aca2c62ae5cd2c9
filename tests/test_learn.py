"""The loop learns: ``ragen-mega train``'s own code path (real Ray, megatron-core, SGLang) on a
tiny random model over a three-token alphabet (tests/learn_envs.py), seeded rollouts, a few
steps each; and ``ragen-mega eval`` of the learned checkpoint.

The two-turn game needs A in turn 1 and B in turn 2 from a model that starts context-free, so a
gradient on the wrong turn (reward moved onto turn 1, advantages kept only on the last turn) or
on the wrong tokens (loss mask shifted by one: the paying letter is each response's first
token) pushes the wrong letter or none, and the paid rate does not rise; a flipped advantage
sign or engines never re-synced fail it too."""
from __future__ import annotations

import json
import tempfile

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ragen_mega.config import load_run_config
from ragen_mega.envs import registry
from ragen_mega.envs.references import REFERENCES
from ragen_mega.evaluate import evaluate
from ragen_mega.evaluate import main as eval_main
from ragen_mega.models.prepare import cache_dir
from ragen_mega.run_dir_lock import holding_run_dir
from ragen_mega.train import train

from learn_envs import (DoorThenPayGame, FirstLetterGame, first_letter_references,
                        make_letter_model)

DEMO = "examples/bandit_cpu_demo.yaml"


@pytest.fixture(scope="module")
def learn_setup(tiny_model):
    """The letter model; the test games registered for this module only (never in the
    package's registry); a private Ray (own temp dir, shut down afterwards)."""
    import ray

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry._CLASSES, "first_letter", FirstLetterGame)
        mp.setitem(registry._CLASSES, "door_then_pay", DoorThenPayGame)
        mp.setitem(REFERENCES, "first_letter", first_letter_references)
        mp.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="rm_ray_"))
        mp.setenv("RAY_AUTH_MODE", "disabled")
        yield make_letter_model(cache_dir() / "tiny" / "tiny-qwen2-letters-by-turn-v3", tiny_model("qwen2"))
        ray.shutdown()


def learn_overrides(tiny_run_overrides, model, run_dir, env: str, steps: int, *extra: str):
    """The tiny whole-loop run of tests/conftest.py on the letter model: 8 groups x 4 episodes a
    step, answers of at most 8 tokens read up to the first newline, every group kept, Adam with
    a large step (lr 0.05, eps 1e-2: see ``make_letter_model``; at lr 0.1 the newline rate
    swings away within a few steps and unfinished lines are invalid answers)."""
    return tiny_run_overrides(run_dir, steps) + [
        f"model.path={model}", f"env.name={env}", "agent.answer_line=true",
        "rollout.max_new_tokens=8", "trainer.check_weight_sync=false", "trainer.save_every=0",
        "env.env_groups=8", "env.group_size=4", "actor.tp=1", "actor.micro_batch_size=32",
        "critic.micro_batch_size=32", "actor.lr=0.05", "actor.adam_eps=1e-2", "critic.lr=1e-2",
        *extra]


def curve(history: list[dict], key: str = "rollout/success") -> list[float]:
    return [round(h[key], 3) for h in history]


def assert_learns(success: list[float], gain: float) -> None:
    """Mean success of the last two steps at least ``gain`` above step 1's (played with the start
    weights)."""
    start, end = success[0], sum(success[-2:]) / 2
    assert end >= start + gain, f"success by step {success}: {start:.3f} -> {end:.3f}"


@pytest.fixture(scope="module")
def one_turn_run(learn_setup, tiny_run_overrides, tmp_path_factory):
    """Critic-free (GRPO) training on the one-turn game (reference lines registered for it),
    evaluated (16 held-out seeds x 2
    episodes at temperature 1) before the first and after the last step, which is saved."""
    run_dir = tmp_path_factory.mktemp("one_turn")
    overrides = learn_overrides(
        tiny_run_overrides, learn_setup, run_dir, "first_letter", 8, "algo.adv_estimator=grpo",
        "critic.enable=false", "trainer.eval_every=8", "env.val_groups=16",
        "env.val_group_size=2", "rollout.val_temperature=1.0")
    history = train(load_run_config(DEMO, overrides))
    return overrides, history, run_dir


def test_learn_one_turn(one_turn_run):
    _, history, _ = one_turn_run
    success = curve(history)
    print("one turn: success by step", success)
    assert_learns(success, 0.25)


def test_the_run_writes_every_step_and_evaluation_as_trajectories(one_turn_run):
    """``RUN_DIR/trajectories``: each training step's 32 episodes and the two evaluations'
    (steps 0 and 8), read back against the run's own metrics (the same episodes summarised by
    other code), the game's rules (a line starting with A pays 1) and GRPO's mean-only credit
    worked from the records' returns."""
    from learn_envs import first_letter
    from ragen_mega.trajectories import SCHEMA, read_records, step_file

    _, history, run_dir = one_turn_run
    names = sorted(p.name for p in (run_dir / "trajectories").iterdir())
    assert names == sorted([f"step_{k}.jsonl.gz" for k in range(1, 9)]
                           + ["eval_step_0.jsonl.gz", "eval_step_8.jsonl.gz"])
    for metrics in history:
        step = metrics["step"]
        records = read_records(step_file(run_dir, step))
        assert len(records) == 32 and {r["schema"] for r in records} == {SCHEMA}
        assert {(r["kind"], r["step"], r["weight_version"]) for r in records} == {
            ("train", step, step - 1)}
        returns = [r["return"] for r in records]
        assert sum(returns) / 32 == pytest.approx(metrics["rollout/reward_mean"], abs=1e-6)
        assert sum(r["success"] for r in records) / 32 == pytest.approx(
            metrics["rollout/success"])
        for r in records:
            [t] = r["turns"]
            assert t["observation"] == "Your line:" and t["prompt_tokens"] > 0
            assert r["return"] == t["reward"]
            for move in t["actions"]:  # what the env was told, parsed from what was sampled
                assert move["action"] in t["response"]
                assert move["reward"] == float(first_letter(move["action"]) == "A")
            group = [q["return"] for q in records if q["group"] == r["group"]]
            assert t["advantage"] == pytest.approx(r["return"] - sum(group) / len(group),
                                                   abs=1e-6)
            assert r["kept"] is True
        # verl's advantage scalars: over the trained answer tokens, so each turn's advantage
        # counts as many times as its answer has tokens
        weighted = [(t["advantage"], t["response_tokens"]) for r in records for t in r["turns"]]
        assert metrics["critic/advantages/mean"] == pytest.approx(
            sum(a * n for a, n in weighted) / sum(n for _, n in weighted), abs=1e-6)
        assert (metrics["critic/advantages/min"], metrics["critic/advantages/max"]) == (
            pytest.approx(min(a for a, _ in weighted), abs=1e-6),
            pytest.approx(max(a for a, _ in weighted), abs=1e-6))
    evaluations = {0: json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0]),
                   8: history[-1]}
    for step, metrics in evaluations.items():
        records = read_records(step_file(run_dir, step, "eval"))
        assert len(records) == 32 and {(r["kind"], r["weight_version"]) for r in records} == {
            ("eval", step)}
        assert sum(r["success"] for r in records) / 32 == pytest.approx(metrics["val/success"])
        assert {r["kept"] for r in records} == {None}


def test_the_viewer_shows_the_run_in_a_browser(one_turn_run):
    """``ragen-mega view`` of the run in a headless Chromium: click a step, then an episode of
    one of its groups; the page shows that episode's turn as its trajectory record has it
    (observation, response, reward, advantage), and the held-out evaluation of step 8 opens from
    its own link."""
    import shutil
    import socket
    import threading

    import uvicorn
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from ragen_mega.trajectories import read_records, step_file
    from ragen_mega.view import make_app

    _, _, run_dir = one_turn_run
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(run_dir), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--window-size=1400,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        wait = WebDriverWait(driver, 60)
        while not server.started:  # the server says when it listens
            thread.join(0.05)
        driver.get(f"http://127.0.0.1:{sock.getsockname()[1]}/")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR,
                                             '#steps tr[data-step="3"]'))[0].click()
        links = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR,
                                                     '#groups tr[data-group="1"] a[data-episode]'))
        episode = int(links[-1].get_attribute("data-episode"))
        links[-1].click()
        [want] = [r for r in read_records(step_file(run_dir, 3)) if r["episode"] == episode]
        [turn] = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#episode .turn"))
        shown = {key: turn.find_element(By.CSS_SELECTOR, f".{key}").text
                 for key in ("observation", "response", "reward", "advantage")}
        t = want["turns"][0]
        assert shown == {"observation": t["observation"], "response": t["response"].strip(),
                         "reward": f"{t['reward']:.3f}", "advantage": f"{t['advantage']:.3f}"}
        assert f"episode {episode}" in driver.find_element(By.CSS_SELECTOR, "#episode h2").text
        assert driver.find_element(By.ID, "message").text == ""

        driver.find_element(By.CSS_SELECTOR, '#steps a[data-kind="eval"][data-step="8"]').click()
        wait.until(lambda d: d.find_element(By.ID, "step-title").text.startswith("eval step 8"))
    finally:
        driver.quit()
        server.should_exit = True
        thread.join(30)


def test_eval_of_learned_checkpoint(one_turn_run, learn_setup, tmp_path, capsys):
    """``ragen-mega eval`` of the run directory (its final Megatron checkpoint, exported to HF)
    reproduces the run's own final evaluation exactly (same held-out seeds and sampling seeds,
    same weights), and that of the start model the run's step-0 evaluation; trained > start.
    The game's reference lines are in the JSON (overall and per tag), in the printed table and
    in the run directory's references.json (what ``ragen-mega plot`` draws)."""
    overrides, history, run_dir = one_turn_run
    out = tmp_path / "eval.json"
    with holding_run_dir(run_dir):  # a live run's directory can be evaluated: eval only reads
        assert eval_main([DEMO, *overrides, "--checkpoint", str(run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    header, *_ = printed.out.splitlines()   # stdout: the table only
    assert "held-out episodes: 100%" in printed.err and "32/32" in printed.err  # the bar
    assert header.split()[1:6] == ["episodes", "success", "random_valid", "best_fixed", "optimal"]
    trained = json.loads(out.read_text())
    lines = {"random_valid": 0.5, "best_fixed": 1.0, "optimal": 1.0}
    assert trained["references"] == trained["per_tag"]["first_letter"]["references"] == lines
    assert json.loads((run_dir / "references.json").read_text()) == {
        "references": lines, "per_tag": {"first_letter": lines}}
    final = history[-1]
    assert trained["episodes"] == 32 and trained["per_tag"]["first_letter"]["episodes"] == 32
    for key in ("success", "valid_action_rate", "pass@2", "mean_turns", "response_length"):
        assert trained[key] == trained["per_tag"]["first_letter"][key]
    assert trained["success"] == final["val/success"]
    assert trained["valid_action_rate"] == final["val/valid_action_rate"]
    assert trained["pass@2"] == final["val/pass@2"]

    base = evaluate(load_run_config(DEMO, overrides), str(learn_setup))
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    [step0] = [e for e in acc.Scalars("val/success") if e.step == 0]
    assert base["success"] == pytest.approx(step0.value)
    # metrics.jsonl (what `ragen-mega plot` draws) starts with the same step-0 evaluation
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["val/success"] == pytest.approx(step0.value)
    print("eval: start model", base["success"], "trained", trained["success"])
    assert trained["success"] >= base["success"] + 0.3


def test_eval_missing_checkpoint_names_the_path(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "actor" / "step_3").mkdir(parents=True)  # no pointer: incomplete
    assert eval_main([DEMO, "--checkpoint", str(run_dir)]) == 2
    assert str(run_dir / "checkpoints" / "latest_step") in capsys.readouterr().err
    step_dir = run_dir / "checkpoints" / "actor" / "step_3"  # a save that never finished
    assert eval_main([DEMO, "--checkpoint", str(step_dir)]) == 2
    assert f"{step_dir} is not a complete checkpoint" in capsys.readouterr().err
    assert eval_main([DEMO, "--checkpoint", str(tmp_path / "nope")]) == 2
    assert str(tmp_path / "nope") in capsys.readouterr().err
    assert eval_main([DEMO, "env.val_group_size=0", "--checkpoint", "smollm2"]) == 2
    assert "config error: env.val_group_size" in capsys.readouterr().err


def test_eval_garbage_pointer_names_the_file_and_what_it_holds(tmp_path, capsys, monkeypatch):
    """A run dir whose ``latest_step`` names no step: a clear error (exit 2), raised before
    any engine or Ray starts."""
    import ray

    from ragen_mega.ray import run as run_module

    def no_run(*args, **kwargs):
        raise AssertionError("build_run was called")
    monkeypatch.setattr(run_module, "build_run", no_run)
    ray_before = ray.is_initialized()  # an earlier test of this module may hold a Ray
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "actor" / "step_3").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest_step").write_text("garbage")
    assert eval_main([DEMO, "--checkpoint", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert (f"ragen-mega eval: {run_dir / 'checkpoints' / 'latest_step'} holds 'garbage', not a "
            f"step number") in err
    assert "Traceback" not in err and ray.is_initialized() == ray_before  # none started


def credit_overrides(tiny_run_overrides, model, run_dir, estimator: str) -> list[str]:
    """The two-turn run: each turn's prompt shows only its own observation (the marker word the
    letter model reads). ``grpo-lora``: critic-free, the actor trains LoRA adapters of rank 8
    on every linear and the LM head (the letter model tells A from B in its head alone: see
    ``make_letter_model``); each sync sends the adapters alone, and the engines' log-probs are
    checked against the trainer's after it."""
    extra = (["algo.adv_estimator=gae", "critic.enable=true"] if estimator == "gae" else
             ["algo.adv_estimator=grpo", "critic.enable=false"])
    if estimator == "grpo-lora":
        extra += ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.lora.target_modules="
                  "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]",
                  "trainer.check_weight_sync=true"]
    return learn_overrides(tiny_run_overrides, model, run_dir, "door_then_pay", 6,
                           "env.max_turns=2", "agent.memory_turns=0",
                           "algo.use_rollout_logprobs=true", *extra)


@pytest.mark.parametrize("estimator", ["gae", "grpo-lora"])
def test_learn_credit_across_turns(estimator, learn_setup, tiny_run_overrides, tmp_path):
    """Two turns that need different letters (door A, then B to be paid; only the last turn
    pays): the paid rate rises, with a critic (turn-level GAE, the bi-level estimator) and
    critic-free (GRPO on the episode's reward) training LoRA adapters only."""
    overrides = credit_overrides(tiny_run_overrides, learn_setup, tmp_path, estimator)
    history = train(load_run_config(DEMO, overrides))
    # memory_turns=0: the prompts do not grow by prefix, so no episode is packed and every
    # two-turn episode is counted as a fallback (trainer.pack_trajectories)
    assert all(h["train/packed_episodes"] == 0 and h["train/pack_fallbacks"] > 0 for h in history)
    success = curve(history)
    print(f"credit ({estimator}): paid (door A, then B) by step", success)
    assert_learns(success, 0.25)
    if estimator == "grpo-lora":   # the engines merged the adapters into what they serve
        assert all(h["sync/max_logprob_diff"] < 1e-3 for h in history), history


SMALL_MODEL_DEMO = "examples/frozen_lake_small_model_cpu.yaml"


def test_sft_warm_start_lowers_heldout_loss_and_serves(learn_setup, textgame_small_dir,
                                                       tmp_path, capsys):
    """``ragen-mega sft`` on the small-model FrozenLake demo's format targets from the
    ``textgame-small`` preset (random weights, the games' tokenizer; the Megatron actor at TP 2,
    no engine), the loss on the targets only: the held-out loss falls to under half its start
    (a uniform guess over the vocabulary, ln 2 422 = 7.8; the floor, a uniform move, is 0.69);
    the Hugging Face directory it writes is a valid ``model.path``, and SGLang serves it (the
    held-out episodes ``eval`` plays, greedy) with transformers' greedy tokens for the same
    prompts. Bad input fails before anything starts."""
    from ragen_mega.evaluate import play_held_out
    from ragen_mega.sft import main as sft_main

    from test_sglang_engine import hf_greedy, hf_model

    base = textgame_small_dir
    out = tmp_path / "warm"
    overrides = [f"model.path={base}", f"trainer.run_dir={tmp_path / 'run'}", f"sft.out={out}",
                 "sft.steps=6", "sft.batch_size=8", "sft.examples=48", "sft.heldout=8",
                 "sft.eval_every=3", "sft.lr=1e-2", "sft.prompt_loss=false", "actor.tp=2",
                 "actor.micro_batch_size=4"]
    assert sft_main([SMALL_MODEL_DEMO, *overrides, "sft.batch_size=6"]) == 2
    assert "sft.batch_size: must be a multiple of actor.micro_batch_size" in capsys.readouterr().err
    assert sft_main([SMALL_MODEL_DEMO, *overrides, f"sft.data={tmp_path / 'nope.jsonl'}"]) == 2
    assert str(tmp_path / "nope.jsonl") in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written

    assert sft_main([SMALL_MODEL_DEMO, *overrides]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    held = {r["step"]: r["sft/heldout_loss"] for r in rows if "sft/heldout_loss" in r}
    print("sft: held-out loss by step", held)
    assert sorted(held) == [0, 3, 6] and [r["step"] for r in rows] == list(range(7))
    assert held[6] < 0.5 * held[0]
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert {"sft/loss", "sft/heldout_loss", "sft/grad_norm", "sft/lr"} <= set(acc.Tags()["scalars"])
    assert sft_main([SMALL_MODEL_DEMO, *overrides]) == 2  # sft.out is taken now: lose nothing
    assert f"sft.out: {out} exists and is not empty" in capsys.readouterr().err

    cfg = load_run_config(SMALL_MODEL_DEMO, [
        f"model.path={out}", f"trainer.run_dir={tmp_path / 'eval'}", "env.val_groups=2",
        "env.max_turns=1", "rollout.val_temperature=0.0", "rollout.max_new_tokens=8"])
    episodes = play_held_out(cfg, str(out))
    warm, start = hf_model(out), hf_model(base)
    for sample in (e.samples[0] for e in episodes):
        expected, _ = hf_greedy(warm, sample.prompt_ids, len(sample.response_ids))
        assert sample.response_ids == expected
    assert hf_greedy(start, sample.prompt_ids, 8)[0] != hf_greedy(warm, sample.prompt_ids, 8)[0]
