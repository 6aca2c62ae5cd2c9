"""``trainer.async_mode: fully`` on the whole loop (real Ray, megatron-core, SGLang; tiny model):
the engines play the coming steps while the trainer trains, no trained token is older than
``trainer.max_staleness`` versions, every token keeps the version that sampled it, today's
faults cost what they cost in the other modes, and a resumed run plays every step's own
episodes (the rule of ``rollout/fully_async.py``), in episodes mode and in streamed windows.

The engine side of a sync that lands inside a request (its tokens' versions and log-probs
against transformers on both weights) is ``test_sglang_engine.py``'s
``test_a_sync_between_two_tokens_continues_the_request_with_the_new_weights``."""
from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

import pytest

import nan_objective
from conftest import first_request_killed, server_pids, undocumented_scalars
from learn_envs import make_letter_model
from ragen_mega import checkpoints, preemption, train as train_module
from ragen_mega.backends.megatron.checkpoint import read_checkpoint_state
from ragen_mega.config import load_run_config
from ragen_mega.envs import registry
from ragen_mega.envs.base import TextEnv
from ragen_mega.models.prepare import cache_dir
from ragen_mega.ray.engine_supervisor import EngineSupervisor
from ragen_mega.rollout.fully_async import FullyAsyncRollout
from ragen_mega.rollout.manager import RolloutManager
from ragen_mega.train import train

DEMO = "examples/bandit_cpu_demo.yaml"
#: the env seeds of step 3 (2 groups a step, seeds from 0): they wait for the sync of step 2
STRADDLING_SEEDS, WAITS_FOR = {4, 5}, 2
#: seeds whose next reset raises (once each)
RAISE_ONCE_AT_RESET: set[int] = set()
SYNCED: dict[int, threading.Event] = {}


class TwoTurnsGame(TextEnv):
    """Two turns whatever is answered, a line starting with A paid 1. An episode of :data:`STRADDLING_SEEDS` waits after its
    first turn (in its env-step thread, ``rollout.env_steps_in_thread``) until the engines serve
    version :data:`WAITS_FOR`: its second turn is sampled with newer weights than its first,
    however fast the machine is."""

    instruction = "Write anything."
    valid_actions = ["anything"]

    def reset(self, seed: int) -> str:
        if seed in RAISE_ONCE_AT_RESET:
            RAISE_ONCE_AT_RESET.discard(seed)
            raise RuntimeError(f"two_turns: a broken reset at seed {seed}")
        self._seed, self._turn = seed, 0
        return "Turn one:"

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self._turn += 1
        if self._turn == 1 and self._seed in STRADDLING_SEEDS:
            assert SYNCED.setdefault(WAITS_FOR, threading.Event()).wait(300)
        info = {"action_is_valid": True, "action_is_effective": True, "success": False}
        return "Turn two:", float(action.startswith("A")), self._turn == 2, info


def _synced(version: int) -> None:
    for v in range(version + 1):
        SYNCED.setdefault(v, threading.Event()).set()


@pytest.fixture
def fully_async_run(tiny_model, tiny_run_overrides, tmp_path, private_ray, monkeypatch):
    """The run's overrides (the letter model of ``learn_envs.py``, whose one-line answers the
    env is always stepped with), what each step trained on (``trained[step]`` lists (seed,
    episode, turn, token versions) of its samples), the run dir, and the pid of the engine
    server killed under step 2's first request (sent once step 1 is synced)."""
    letters = make_letter_model(cache_dir() / "tiny" / "tiny-qwen2-letters-by-turn-v3",
                                tiny_model("qwen2"))
    SYNCED.clear()
    monkeypatch.setitem(registry._CLASSES, "two_turns", TwoTurnsGame)
    real_init, real_synced = FullyAsyncRollout.__init__, FullyAsyncRollout.weights_synced

    def init(self, *args, version: int, **kwargs):
        _synced(version)
        real_init(self, *args, version=version, **kwargs)

    def weights_synced(self, version: int) -> None:
        real_synced(self, version)
        _synced(version)
    monkeypatch.setattr(FullyAsyncRollout, "__init__", init)
    monkeypatch.setattr(FullyAsyncRollout, "weights_synced", weights_synced)
    trained: dict[int, list] = {}
    real_train_step = train_module.train_step

    def train_step(cfg, run, step, played):
        trained[step] = sorted((s.seed, s.episode_id, s.turn, list(s.token_versions))
                               for s in played.samples)
        return real_train_step(cfg, run, step, played)
    monkeypatch.setattr(train_module, "train_step", train_step)
    killed: list[int] = []
    real_generate = RolloutManager._generate

    def generate(rollouts, kind: str, step: int, key: int):
        """Step 2's first request waits for the sync of step 1 (the trainer then waits for
        step 2), and the engine's server is SIGKILLed under it."""
        played = real_generate(rollouts, kind, step, key)
        if step != 2 or kind == "eval":
            return played
        kill = first_request_killed(played, server_pids(tmp_path)[-1], killed)

        async def after_sync_1(prompt_ids, sampling):
            if not killed:
                assert await asyncio.to_thread(SYNCED.setdefault(1, threading.Event()).wait,
                                               300)
            return await kill(prompt_ids, sampling)
        return after_sync_1
    monkeypatch.setattr(RolloutManager, "_generate", generate)
    overrides = tiny_run_overrides(tmp_path, 3) + [
        "trainer.async_mode=fully", "trainer.max_staleness=1", "actor.tis_cap=2.0",
        "actor.tp=1", "algo.whiten_advantages=false", "env.name=two_turns", "env.max_turns=2",
        "env.seed=0", "rollout.env_steps_in_thread=true", "rollout.env_workers=0",
        f"model.path={letters}", "agent.answer_line=true", "rollout.max_new_tokens=8"]
    return overrides, trained, tmp_path, killed


def test_fully_async_steps_stay_within_the_bound_survive_faults_and_resume_every_episode(
        fully_async_run, monkeypatch):
    """Steps at ``max_staleness=1``: step 1 plays at once; step 2 starts at once too (its
    episodes may be one version old when trained); step 3's may start only once the engines
    serve version 1, and its episodes straddle the sync of step 2 (their env waits for it
    after the first turn): first turns sampled with version 1, second turns with version 2,
    and the step trains at version 2. Today's fault paths, in this mode:

    - an env that raises at reset (one episode of step 1) drops that episode, counted;
    - the engine dies under a request of step 2 while the trainer waits for that step: it is
      restarted, given the trainer's weights by the trainer's thread (until then no request
      goes to it, or it would serve the weights it loaded, older than the bound), and the
      episodes it cut are played again;
    - step 2's update is NaN: skipped, the run goes on;
    - SIGTERM in step 3: the step is finished and saved, the rollout (which has played into
      step 4) is stopped, and the run ends preempted. Resumed there, it plays exactly step 4's
      episodes (seeds 6 and 7, every episode and turn), all with step 3's weights."""
    overrides, trained, run_dir, killed = fully_async_run
    overrides += ["algo.adv_estimator=grpo", "critic.enable=false", "trainer.save_every=2",
                  "trainer.total_steps=4", "rollout.max_env_failure_rate=0.5"]
    monkeypatch.setattr(sys.modules[__name__], "RAISE_ONCE_AT_RESET", {1})
    nan_objective.install(monkeypatch, "actor", updates=[2])
    train_step = train_module.train_step

    def preempted_in_step_3(cfg, run, step, played):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(cfg, run, step, played)
    monkeypatch.setattr(train_module, "train_step", preempted_in_step_3)
    with pytest.raises(preemption.Preempted, match="SIGTERM"):
        train(load_run_config(DEMO, overrides))
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3]
    assert checkpoints.latest_complete_step(run_dir) == 3
    assert [h["fault/episodes_dropped"] for h in history] == [1.0, 0.0, 0.0]
    assert [h["fault/updates_skipped"] for h in history] == [0.0, 1.0, 0.0]
    assert killed and server_pids(run_dir)[-2] == killed[0]
    assert sum(h["fault/engine_restarts"] for h in history) == 1
    assert sum(h["fault/episodes_retried"] for h in history) >= 1
    for step, samples in trained.items():
        versions = [v for *_, vs in samples for v in vs]
        assert versions and all(0 <= step - 1 - v <= 1 for v in versions), (step, samples)
        assert {seed for seed, *_ in samples} == {2 * (step - 1), 2 * step - 1}
        # 2 groups x 2 episodes x 2 turns: none lost but step 1's dropped episode
        assert len(samples) == 2 * 2 * 2 - 2 * (step == 1)
    first_turns = {v for _, _, turn, vs in trained[3] if turn == 1 for v in vs}
    second_turns = {v for _, _, turn, vs in trained[3] if turn == 2 for v in vs}
    assert first_turns == {1} and second_turns == {2}, trained[3]
    assert history[2]["rollout/staleness_max"] == 1.0
    assert history[2]["rollout/staleness_mean"] == pytest.approx(0.5)
    for h in history:
        assert h["sync/max_logprob_diff"] < 1e-3, h["sync/max_logprob_diff"]
        assert h["time/engine_idle_s"] >= 0 and h["time/trainer_idle_s"] >= 0
    assert not undocumented_scalars(history[2], tags=("two_turns",))

    trained.clear()
    resumed = train(load_run_config(DEMO, overrides))
    assert [h["step"] for h in resumed] == [4]
    assert sorted((seed, turn) for seed, _, turn, _ in trained[4]) == \
        [(seed, turn) for seed in (6, 7) for turn in (1, 1, 2, 2)]
    assert len({ep for _, ep, *_ in trained[4]}) == 4
    # the engines served step 3's weights from the resumed start on: nothing older
    assert {v for *_, vs in trained[4] for v in vs} == {3}


def test_fully_async_streams_stay_within_the_bound_and_resume_where_their_window_ended(
        fully_async_run, monkeypatch):
    """``rollout.mode: turns``: 4 streams (2 groups x 2) of two-turn episodes, 3 turns a window,
    so window k holds turns 3k-2 .. 3k of each stream and cuts an episode every other window
    (a critic bootstraps the cut). Each stream plays its windows at its own pace under the
    bound. Window 3 opens with episode 3 of each stream (seeds 6 and 7), whose env waits after
    turn 1 for the sync of step 2: turn 1 sampled with version 1, the rest of the window with
    version 2. The engine dies under a request of window 2 while the trainer waits for it:
    the windows it cut are played again, each by its own stream. The checkpoint of step 1
    holds the streams where window 1 left them (each in episode 1, one turn played), and that
    of step 2 where window 2
    left them, though it is written only once the streams have played window 3; a run resumed
    from step 1 trains windows 2 and 3 on exactly the straight run's turns."""
    overrides, trained, run_dir, killed = fully_async_run
    monkeypatch.setattr(sys.modules[__name__], "STRADDLING_SEEDS", {6, 7})
    served: collections.Counter = collections.Counter()   # requests answered, by step
    generate, weights_synced = RolloutManager._generate, FullyAsyncRollout.weights_synced

    def counted_generate(rollouts, kind, step, key):
        played = generate(rollouts, kind, step, key)

        async def counted(prompt_ids, sampling):
            out = await played(prompt_ids, sampling)
            served[step] += 1
            return out
        return counted

    def synced_then_window_3_played(self, version: int) -> None:
        """Once step 2 is synced, the trainer goes on (to step 2's checkpoint) only when the
        streams have played all of window 3: they are past where window 2 left them."""
        weights_synced(self, version)
        for _ in range(6000):
            if version != 2 or served[3] >= 12:
                break
            time.sleep(0.05)
    monkeypatch.setattr(RolloutManager, "_generate", counted_generate)
    monkeypatch.setattr(FullyAsyncRollout, "weights_synced", synced_then_window_3_played)
    supervise = EngineSupervisor.__init__

    def slow_recoveries(supervisor, *args, **kwargs):
        """Once an engine has been restarted, each recovery (the restart, and each sync's
        check for dead engines) takes 2 s more: requests sent meanwhile must still not reach
        the restarted server before a sync has given it the trainer's weights."""
        supervise(supervisor, *args, **kwargs)
        supervisor.listeners.append(lambda _: any(supervisor.lives) and time.sleep(2))
    monkeypatch.setattr(EngineSupervisor, "__init__", slow_recoveries)
    overrides += ["rollout.mode=turns", "rollout.turns_per_step=3", "algo.adv_estimator=gae",
                  "critic.enable=true", "algo.gamma=0.99", "algo.lam=0.95",
                  "trainer.save_every=1"]
    history = train(load_run_config(DEMO, overrides))
    assert [h["step"] for h in history] == [1, 2, 3]
    assert killed and server_pids(run_dir)[-2] == killed[0]
    assert sum(h["fault/engine_restarts"] for h in history) == 1
    # the windows of the streams whose requests the dead server had (each played again)
    assert 1 <= sum(h["fault/episodes_retried"] for h in history) <= 4
    # (episode of stream s in its j-th episode: j * 4 + s), turn: window k's 12 samples
    windows = {1: [(0, 1), (0, 2), (1, 1)], 2: [(1, 2), (2, 1), (2, 2)],
               3: [(3, 1), (3, 2), (4, 1)]}
    for step, samples in trained.items():
        versions = [v for *_, vs in samples for v in vs]
        assert versions and all(0 <= step - 1 - v <= 1 for v in versions), (step, samples)
        assert sorted((ep, turn) for _, ep, turn, _ in samples) == sorted(
            (j * 4 + s, turn) for j, turn in windows[step] for s in range(4)), (step, samples)
    first = {(ep, 1) for ep in range(12, 16)}   # the first turns of each stream's episode 3
    assert {v for _, ep, turn, vs in trained[3] if (ep, turn) in first for v in vs} == {1}
    assert {v for _, ep, turn, vs in trained[3] if (ep, turn) not in first for v in vs} == {2}
    assert [h["rollout/episodes_finished"] for h in history] == [4, 8, 4]
    assert history[2]["rollout/staleness_max"] == 1.0
    for h in history:
        assert h["sync/max_logprob_diff"] < 1e-3, h["sync/max_logprob_diff"]
    assert not undocumented_scalars(history[2], tags=("two_turns",))
    saved = [read_checkpoint_state(checkpoints.step_dir(run_dir, "actor", step))["extra"][
        "streams"] for step in (1, 2)]
    # after window 1: each stream one turn into its episode 1; after window 2: at episode 3
    assert saved[0]["episodes"] == [1] * 4 and [len(r) for r in saved[0]["responses"]] == [1] * 4
    assert saved[1] == {"episodes": [3] * 4, "responses": [[]] * 4}

    ckpt = run_dir / "checkpoints"
    for step in (2, 3):
        for role in ("actor", "critic"):
            shutil.rmtree(ckpt / role / f"step_{step}")
    (ckpt / "latest_step").write_text("1")
    straight = dict(trained)
    trained.clear()
    resumed = train(load_run_config(DEMO, overrides))
    assert [h["step"] for h in resumed] == [2, 3]
    for step in (2, 3):
        assert [s[:3] for s in trained[step]] == [s[:3] for s in straight[step]], step
