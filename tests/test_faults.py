"""Faults that cost an episode or an update instead of the run, injected for real.

Pure Python: an env that raises at reset or step (dropped, counted, the rate limit names env,
seed and exception, a group that lost a member is advantaged on the rest), a prompt the engine
refuses as too long (the episode ends there, or is dropped without a turn). The whole loop
(real Ray, SGLang, Megatron actor TP=2, one run shared by every check): an env raising at reset
and a real over-long prompt against SGLang in step 1, a NaN loss forced into the real trainer in
step 2 (skipped: the checkpoint after it is bit-identical to the one before), a truncated shard
of the newest checkpoint (resume refuses it, names the file and takes the previous step), and
NaN updates in a row (the run ends, the last good checkpoint kept)."""
from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path

import pytest
import torch

import faulty_envs
import nan_objective
from conftest import documented_scalars
from ragen_mega.agent import AgentConfig
from ragen_mega.config import AlgoConfig, load_run_config
from ragen_mega.config_tree import ConfigError
from ragen_mega.train import train
from ragen_mega import checkpoints
from ragen_mega.algo.estimators import compute_advantages
from ragen_mega.rollout.batch import build_batch, filter_groups
from ragen_mega.rollout.types import EpisodeSpec, Generation, PromptTooLong
from ragen_mega.rollout.seeding import group_specs
from ragen_mega.rollout.episode import run_episode
from ragen_mega.rollout.faults import (DroppedEpisode, FaultCounters, count_rollout_faults,
                                       episode_or_drop)
from ragen_mega.train import skipped_updates_error

faulty_envs.register()
AGENT = AgentConfig(think=True, max_actions_per_turn=1)


def _play(specs, tokenizer, answer_of, max_turns=1):
    """Every spec through ``episode_or_drop(run_episode(...))``; ``answer_of(episode_id, turn)``
    is the text the policy writes (or raises)."""
    async def one(spec):
        turns = iter(range(1, max_turns + 1))

        async def generate(ids, sampling):
            ids = tokenizer.encode(answer_of(spec.episode_id, next(turns)),
                                   add_special_tokens=False)
            return Generation(ids, [-0.5] * len(ids), "stop")
        return await episode_or_drop(spec, run_episode(spec, tokenizer=tokenizer, agent=AGENT,
                                                    generate=generate, sampling={},
                                                    max_turns=max_turns))

    async def all_():
        return list(await asyncio.gather(*(one(s) for s in specs)))
    return asyncio.run(all_())


def test_env_that_raises_is_dropped_and_its_group_keeps_the_rest(tokenizer, tmp_path):
    # 2 groups x 2; seed 1 (episode 1, group 0) raises at its pull. The arms pay for sure
    # (high_risk_prob=1): Dragon 1.0, Phoenix 0.1.
    specs = group_specs(faulty_envs.NAME, {"raise_at_step": [1], "high_risk_prob": 1.0},
                        env_groups=2, group_size=2, first_seed=0)
    arm = {0: "Phoenix", 1: "Dragon", 2: "Phoenix", 3: "Dragon"}
    played = _play(specs, tokenizer, lambda e, t: f" ok </think><answer> {arm[e]} </answer>")
    assert isinstance(played[1], DroppedEpisode) and played[1].kind == "env_failed"
    assert "RuntimeError: faulty_bandit: broken step at seed 1" in played[1].reason

    counters = FaultCounters(step=7, log_path=tmp_path / "faults.jsonl")
    episodes = count_rollout_faults(played, counters, max_failure_rate=0.25)
    assert [e.samples[0].episode_id for e in episodes] == [0, 2, 3]
    assert counters.metrics() == {"fault/episodes_dropped": 1.0, "fault/prompts_too_long": 0.0,
                                  "fault/updates_skipped": 0.0}
    [line] = [json.loads(l) for l in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert (line["step"], line["fault"], line["env"], line["seed"], line["episode"]) == (
        7, "episodes_dropped", faulty_envs.NAME, 1, 1)

    # the group that lost a member is filtered and advantaged on the one it has: alone, it has
    # no baseline (advantage 0); group 1 is Phoenix 0.1 vs Dragon 1.0: mean 0.55, unbiased std
    # 0.45 * sqrt(2), so -+1/sqrt(2)
    samples, metrics, *_ = filter_groups([s for e in episodes for s in e.samples], ratio=1.0)
    assert metrics["filter/kept_groups"] == 2.0
    batch = compute_advantages(build_batch(samples, pad_id=0), AlgoConfig(adv_estimator="grpo"))
    per_sample = (batch["advantages"] * batch["loss_mask"]).sum(1) / batch["loss_mask"].sum(1)
    assert torch.allclose(per_sample, torch.tensor([0.0, -2 ** -0.5, 2 ** -0.5]), atol=1e-5)

    # one failure of four is over a 20% limit: the run ends naming env, seed and exception
    with pytest.raises(RuntimeError, match=r"1 of 4 episodes of step 7 had an env that raised "
                                           r"\(25%; rollout.max_env_failure_rate=0.2\).*env "
                                           r"'faulty_bandit' \(seed 1, episode 1\) raised during "
                                           r"step: RuntimeError: faulty_bandit: broken step"):
        count_rollout_faults(played, FaultCounters(7), max_failure_rate=0.2)
    # an env that cannot even reset is dropped the same way
    [broken] = _play([EpisodeSpec(faulty_envs.NAME, {"raise_at_reset": [5]}, 5, 0, 0)],
                     tokenizer, lambda e, t: "unused")
    assert broken.kind == "env_failed" and "raised during reset" in broken.reason
    with pytest.raises(RuntimeError, match="0 gave samples"):  # nothing left to train on
        count_rollout_faults([broken], FaultCounters(1), max_failure_rate=1.0)


def test_prompt_too_long_ends_the_episode_there(tokenizer, tmp_path):
    """Episode 0's turn-2 prompt is refused: it ends after turn 1, truncated (not done) and
    flagged; episode 1's first prompt is refused: no turn, dropped; episode 2 plays 3 turns."""
    specs = [EpisodeSpec("sokoban", {"dim_room": [6, 6], "num_boxes": 1}, seed, seed, seed)
             for seed in range(3)]

    def answer(episode, turn):
        if (episode, turn) in ((0, 2), (1, 1)):
            raise PromptTooLong("refused: longer than the model's context length")
        return " go </think><answer> Up </answer>"

    played = _play(specs, tokenizer, answer, max_turns=3)
    first, dropped, full = played
    assert [s.turn for s in first.samples] == [1] and first.samples[-1].last
    assert not first.samples[-1].done and first.metrics["prompt_too_long"] == 1.0
    assert isinstance(dropped, DroppedEpisode) and dropped.kind == "prompt_too_long"
    assert len(full.samples) == 3 and full.metrics["prompt_too_long"] == 0.0
    counters = FaultCounters(3, tmp_path / "faults.jsonl")
    # a prompt that is too long is not an env failure: a zero failure rate is still met
    assert count_rollout_faults(played, counters, max_failure_rate=0.0) == [first, full]
    assert counters.counts == {"episodes_dropped": 1, "prompts_too_long": 2,
                               "updates_skipped": 0}
    reasons = [json.loads(l)["reason"]
               for l in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert "first prompt is longer than the engine's context" in reasons[0]
    assert "the prompt of turn 2" in reasons[1]


def test_streamed_faults_cost_an_episode_not_the_window(tokenizer, tmp_path):
    """``rollout.mode: turns``: 2 groups x 2 streams of the faulty bandit, 3 turns per stream;
    stream s's episode j plays seed 4j + s (the bandit's seeds are not shared in a group).
    Seed 2 (stream 2's first episode) raises at its step: dropped, and stream 2 goes on with
    seeds 6, 10, 14. Seed 1 does not end at the pull (two turns); stream 1's 2nd request, its
    turn-2 prompt, is refused as too long: the episode ends after turn 1 (last, truncated), and
    its 3rd, the first prompt of seed 5, too: no turn, dropped. Every stream still gives 3."""
    from ragen_mega.rollout.seeding import EnvPart
    from ragen_mega.rollout.faults import count_window_faults
    from ragen_mega.rollout.streams import EnvStreams

    part = EnvPart("b", faulty_envs.NAME, {"raise_at_step": [2], "long_seeds": [1]}, 2)
    streams = EnvStreams([part], group_size=2, seed=0, turns_per_step=3, tokenizer=tokenizer,
                         agent=AGENT, max_turns=2)
    calls: dict[int, int] = {}

    def generate_for(stream):
        async def generate(prompt_ids, sampling):
            calls[stream] = calls.get(stream, 0) + 1
            if stream == 1 and calls[stream] in (2, 3):
                raise PromptTooLong("refused: longer than the model's context length")
            ids = tokenizer.encode(" ok </think><answer> Dragon </answer>",
                                   add_special_tokens=False)
            return Generation(ids, [-0.5] * len(ids), "stop")
        return generate

    window = asyncio.run(streams.play_window(generate_for, {}, weight_version=0))
    by_stream = [[(s.seed, s.turn, s.last) for s in window.samples[3 * i:3 * i + 3]]
                 for i in range(4)]
    assert by_stream == [[(0, 1, True), (4, 1, True), (8, 1, True)],
                         [(1, 1, True), (9, 1, True), (13, 1, True)],
                         [(6, 1, True), (10, 1, True), (14, 1, True)],
                         [(3, 1, True), (7, 1, True), (11, 1, True)]]
    assert [(d.spec.seed, d.kind) for d in window.dropped] == [
        (5, "prompt_too_long"), (2, "env_failed")]
    truncated = next(e for e in window.finished if e.samples[0].seed == 1)
    assert truncated.metrics["prompt_too_long"] == 1.0 and not truncated.samples[-1].done
    assert streams.state_dict()["episodes"] == [3, 4, 4, 3]

    counters = FaultCounters(4, tmp_path / "faults.jsonl")
    count_window_faults(window, counters, max_failure_rate=0.1)  # 1 failure of 14 played
    assert counters.counts == {"episodes_dropped": 2, "prompts_too_long": 2,
                               "updates_skipped": 0}
    with pytest.raises(RuntimeError, match=r"1 of 14 episodes of step 4 had an env that raised "
                                           r".*12 turn samples were played; the first failure: "
                                           r"env 'faulty_bandit' \(seed 2, episode 2\)"):
        count_window_faults(window, FaultCounters(4), max_failure_rate=0.05)

    # a stream whose every episode fails ends the window, naming the first failure
    broken = EnvStreams([EnvPart("b", faulty_envs.NAME, {"raise_at_reset": list(range(99))}, 1)],
                        group_size=2, seed=0, turns_per_step=2, tokenizer=tokenizer,
                        agent=AGENT, max_turns=2)
    with pytest.raises(RuntimeError, match=r"env stream 0: 3 episodes in one window gave no "
                                           r"sample; the first: .*seed 0.*broken reset"):
        asyncio.run(broken.play_window(generate_for, {}, weight_version=0))


def test_fault_config_keys_are_checked():
    with pytest.raises(ConfigError, match="max_env_failure_rate: must be in"):
        load_run_config("examples/bandit_cpu_demo.yaml", ["rollout.max_env_failure_rate=1.5"])
    with pytest.raises(ConfigError, match="max_skipped_updates_in_row: must be >= 1"):
        load_run_config("examples/bandit_cpu_demo.yaml", ["trainer.max_skipped_updates_in_row=0"])
    assert skipped_updates_error({"actor/updates_skipped_in_row": 1.0}, limit=2) is None
    with pytest.raises(RuntimeError, match=r"critic: 2 updates in a row .*=2\)"):
        raise skipped_updates_error({"actor/updates_skipped_in_row": 0.0,
                                     "critic/updates_skipped_in_row": 2.0}, limit=2)


def _dist_tensors(step_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's torch_dist files (model and optimizer), read back with
    torch's own DCP reader, independent of the trainer's loading code (converted under
    ``scratch``, outside the run's checkpoint directory, which the test lists)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    scratch.mkdir(exist_ok=True)
    out = scratch / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir / "dist", out)
    flat = {}

    def walk(prefix, x):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}/{k}", v)
        elif torch.is_tensor(x):
            flat[prefix] = x
    walk("", torch.load(out, weights_only=False))
    return flat


def test_faults_in_a_whole_run(tiny_run_overrides, tmp_path, private_ray, monkeypatch):
    nan_objective.install(monkeypatch, "actor", updates=[2])  # step 2's update
    overrides = [o for o in tiny_run_overrides(tmp_path, total_steps=3)
                 if not o.startswith(("critic.", "algo.adv_estimator", "env.name"))] + [
        "critic.enable=false", "algo.adv_estimator=gigpo", f"env.name={faulty_envs.NAME}",
        # step 1 plays seeds 0-3: seed 1 raises at reset (group 0 keeps one member); seed 2's
        # second prompt holds two padded observations, longer than the model's 2048 tokens
        "env.kwargs={raise_at_reset: [1], long_seeds: [2], long_words: 900}",
        "env.max_turns=2", "rollout.max_env_failure_rate=0.5",
        "trainer.max_skipped_updates_in_row=2",
        "algo.kl_in_reward=0.01",  # the actor keeps a reference model; KL enters the rewards
        "actor.micro_batch_size=1"]  # a step's turn count varies (drops, multi-turn)
    history = train(load_run_config("examples/bandit_cpu_demo.yaml", overrides))
    assert [h["step"] for h in history] == [1, 2, 3]
    one, two, three = history
    assert (one["fault/episodes_dropped"], one["fault/prompts_too_long"]) == (1.0, 1.0)
    for h in (two, three):
        assert h["fault/episodes_dropped"] == h["fault/prompts_too_long"] == 0.0
    # samples add up: every kept (filter.ratio=1) turn of the played episodes is trained on
    played = [4 - h["fault/episodes_dropped"] for h in history]
    for h, n in zip(history, played):
        assert h["train/batch_samples"] == pytest.approx(h["rollout/num_turns"] * n)
    # seed 2 was cut after turn 1 by the real engine's refusal: 1 of the 3 played episodes
    assert one["rollout/prompt_too_long"] == pytest.approx(1 / 3)
    # KL in the reward: none while the actor is its reference (step 1), then the update of
    # step 1 shows (step 2's NaN update is skipped, so step 3 still has step 1's weights)
    kl = [h["algo/kl_in_reward"] for h in history]
    assert kl[0] == 0.0 and kl[1] > 0 and kl[2] > 0, kl
    # the NaN update of step 2 is skipped on both TP ranks alike, the others are not
    assert [h["fault/updates_skipped"] for h in history] == [0.0, 1.0, 0.0]
    assert [h["actor/update_successful"] for h in history] == [1.0, 0.0, 1.0]
    assert [h["actor/updates_skipped_in_row"] for h in history] == [0.0, 1.0, 0.0]
    faults = [json.loads(l) for l in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [(f["step"], f["fault"]) for f in faults] == [
        (1, "episodes_dropped"), (1, "prompts_too_long"), (2, "updates_skipped")]
    assert (faults[0]["seed"], faults[1]["seed"]) == (1, 2)
    assert "RuntimeError: faulty_bandit: broken reset at seed 1" in faults[0]["reason"]
    documented = documented_scalars()
    for key in history[0]:
        generic = re.sub(rf"^rollout/{faulty_envs.NAME}/", "rollout/<tag>/", key)
        assert key == "step" or generic in documented or \
            re.sub(r"/<tag>/", "/", generic) in documented, key

    # weights AND optimizer state after the skipped step 2 are bit-identical to step 1's; the
    # normal step 3 changes both (so the comparison can tell)
    ckpt = tmp_path / "checkpoints" / "actor"
    t1, t2, t3 = (_dist_tensors(ckpt / f"step_{s}", tmp_path / "dcp") for s in (1, 2, 3))
    assert t1.keys() == t2.keys() and any("optimizer" in k for k in t1)
    assert all(torch.equal(t1[k], t2[k]) for k in t1), [k for k in t1
                                                         if not torch.equal(t1[k], t2[k])]
    assert sum(not torch.equal(t2[k], t3[k]) for k in t2) > len(t2) // 2
    steps = [torch.load(ckpt / f"step_{s}" / "ragen_state.pt",
                        weights_only=False)["optimizer_steps"] for s in (1, 2, 3)]
    assert steps == [1, 1, 2]

    # a truncated shard of the newest checkpoint: resume refuses it, naming the file, and
    # continues from step 2; then NaN at steps 4 and 5 is 2 skipped in a row: the run ends
    # before saving step 5, and step 4 (weights untouched) is the newest checkpoint
    shard = sorted((ckpt / "step_3" / "dist").glob("*.distcp"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    overrides5 = [o for o in overrides if not o.startswith("trainer.total_steps")] + [
        "trainer.total_steps=5"]
    # the resumed run's trainer makes the updates of steps 3, 4, 5: NaN at steps 4 and 5
    nan_objective.install(monkeypatch, "actor", updates=[2, 3])
    with pytest.warns(UserWarning, match=rf"refusing step 3: .*shard {re.escape(str(shard))} "
                                         r"is truncated"), \
            pytest.raises(RuntimeError, match=r"actor: 2 updates in a row had a NaN"):
        train(load_run_config("examples/bandit_cpu_demo.yaml", overrides5))
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3, 3, 4, 5]
    assert [l["fault/updates_skipped"] for l in lines[3:]] == [0.0, 1.0, 1.0]
    assert all(math.isfinite(l["rollout/reward_mean"]) for l in lines)
    assert (ckpt / "corrupt-step_3").is_dir()
    assert checkpoints.latest_complete_step(tmp_path) == 4
    assert sorted(p.name for p in ckpt.iterdir()) == ["corrupt-step_3", "step_1", "step_2",
                                                      "step_3", "step_4"]


@pytest.mark.parametrize("wait_for_sync", [False, True])
def test_a_cut_try_is_undone_and_replayed_unless_its_engine_waits_for_the_sync(wait_for_sync):
    """``replay_on_restart``: a try a resynced restart cut is undone, counted and played
    again until one ends; a restart whose engine waits for the next sync ends the play
    (re-raised, nothing undone here: the caller plays it after the sync) unless the caller
    waits for that sync (fully async), where it is replayed like the others."""
    from ragen_mega.rollout.faults import replay_on_restart
    from ragen_mega.rollout.types import EngineRestarted

    tries, log = iter([EngineRestarted("cut"), EngineRestarted("cut, waits", resynced=False),
                       "played"]), []

    async def play():
        log.append("try")
        outcome = next(tries)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def undo():
        log.append("undo")

    def retried():
        log.append("retried")

    run = replay_on_restart(play, retried=retried, undo=undo, wait_for_sync=wait_for_sync)
    if wait_for_sync:
        assert asyncio.run(run) == "played"
        assert log == ["try", "retried", "undo"] * 2 + ["try"]
    else:
        with pytest.raises(EngineRestarted, match="waits") as e:
            asyncio.run(run)
        assert not e.value.resynced and log == ["try", "retried", "undo", "try"]
