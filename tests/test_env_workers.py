"""Envs in Ray actors: the same episodes as envs in the driver, spread over the workers, closed
afterwards, an env raising in a worker dropping only its episode, and a worker that dies
mid-episode named in the error. One real Ray for all of it."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

import faulty_envs
from ragen_mega.agent import AgentConfig
from ragen_mega.ray.cluster import init_ray
from ragen_mega.ray.env_workers import EnvWorkerError, EnvWorkerGroup
from ragen_mega.ray.placement import bundle_cpus, create_placement_group, plan_placement
from ragen_mega.rollout.types import EpisodeSpec, Generation
from ragen_mega.rollout.seeding import EnvPart, mix_specs
from ragen_mega.rollout.episode import run_episode
from ragen_mega.rollout.types import EnvFailed
from ragen_mega.rollout.faults import DroppedEpisode, episode_or_drop

ANSWERS = [" go </think><answer> Up || Left </answer>", " hmm </think><answer> Down </answer>",
           " so </think><answer> Right || Down </answer>", "no tags at all"]


def test_remote_envs_play_the_local_episodes(private_ray, tokenizer, scripted, run_episodes_keyed):
    import ray

    with pytest.raises(ValueError, match="EnvWorkerGroup: no bundles given"):
        EnvWorkerGroup(None, [], num_cpus=0.1)
    init_ray(num_cpus=2)
    # the driver's sizing for 2 trainer ranks + 1 engine + 2 env workers fits a 2-CPU cluster
    cpus, env_cpus = bundle_cpus(2, 3, 2, use_gpu=False)
    plan = plan_placement(num_trainer_ranks=2, num_engines=1, num_env_workers=2,
                          cpus_per_bundle=cpus, cpus_per_env_worker=env_cpus)
    pg = create_placement_group(plan, timeout_s=60)
    workers = EnvWorkerGroup(pg, plan.env_worker_bundles, num_cpus=env_cpus)
    actors = workers.workers.actors
    agent = AgentConfig(think=True, max_actions_per_turn=2)
    # multi-action sokoban turns, frozen lake, and a bandit to which "Up" is an invalid arm
    parts = [EnvPart("box", "sokoban", {"dim_room": [6, 6], "num_boxes": 1}, 2),
             EnvPart("lake", "frozen_lake", {}, 1), EnvPart("arm", "bandit", {}, 1)]
    specs = mix_specs(parts, group_size=2, first_seed=3)
    local = asyncio.run(run_episodes_keyed(specs, tokenizer, agent, scripted(tokenizer, ANSWERS),
                                           max_turns=4))

    # every episode waits at its first generation until all have opened their env: then the
    # workers' contents show where each episode plays
    hosted, all_open = [], asyncio.Event()
    remote_gen = scripted(tokenizer, ANSWERS)
    first_turns = set()

    async def generate(ids, sampling):
        if sampling["episode_key"] not in first_turns:
            first_turns.add(sampling["episode_key"])
            if len(first_turns) == len(specs):
                hosted.extend(await asyncio.gather(*(a.hosted.remote() for a in actors)))
                all_open.set()
            await all_open.wait()
        return await remote_gen(ids, sampling)

    remote = asyncio.run(asyncio.wait_for(run_episodes_keyed(
        specs, tokenizer, agent, generate, max_turns=4, open_env=workers.open), 120))
    assert hosted == [[0, 2, 4, 6], [1, 3, 5, 7]]  # episode i on worker i % 2
    assert ray.get([a.hosted.remote() for a in actors]) == [[], []]  # every env closed
    for spec, lo, re in zip(specs, local, remote):
        assert re.samples == lo.samples, spec  # ids, rewards, done/last, info: all the same
        assert re.metrics == lo.metrics, spec
    assert any(e.metrics["num_actions"] > e.metrics["num_turns"] for e in remote)  # 2 actions/turn
    assert {e.metrics["valid_action_rate"] for e in remote[6:]} == {0.0}  # bandit: "Up" invalid

    # bad env kwargs: the env's own error, with the worker and episode named
    bad = EpisodeSpec("sokoban", {"dim": 3}, seed=0, episode_id=5, group_id=0)
    with pytest.raises(EnvWorkerError, match=r"env worker 1 raised during create of episode 5 "
                                             r"\(env 'sokoban', seed 0\): TypeError: "
                                             r"env 'sokoban' got unknown kwarg\(s\) \['dim'\]"):
        asyncio.run(workers.open(bad))

    # a user's env raising in a worker: the episode is dropped (EnvFailed, naming the worker's
    # error), the others play, and the failed env is closed like the rest
    ray.cloudpickle.register_pickle_by_value(faulty_envs)  # the workers cannot import tests/
    ray.get([a.__ray_call__.remote(lambda self, register: register(), faulty_envs.register)
             for a in actors])

    async def pull_dragon(ids, sampling):
        out = tokenizer.encode(" ok </think><answer> Dragon </answer>", add_special_tokens=False)
        return Generation(out, [-0.5] * len(out), "stop")

    faulty = [EpisodeSpec(faulty_envs.NAME, {"raise_at_step": [11]}, seed, seed, 0)
              for seed in (10, 11)]

    async def play_both():
        return await asyncio.gather(*(
            episode_or_drop(s, run_episode(s, tokenizer=tokenizer, agent=agent, sampling={},
                                        max_turns=1, open_env=workers.open, generate=pull_dragon))
            for s in faulty))

    ok, failed = asyncio.run(asyncio.wait_for(play_both(), 120))
    assert ok.samples[0].seed == 10 and isinstance(failed, DroppedEpisode)
    assert failed.reason.startswith(
        "env 'faulty_bandit' (seed 11, episode 11) raised during step: EnvWorkerError: env "
        "worker 1 raised during step of episode 11 ")
    assert failed.reason.endswith("RuntimeError: faulty_bandit: broken step at seed 11")
    assert ray.get([a.hosted.remote() for a in actors]) == [[], []]

    # worker 1 crashes (SIGKILL) while episode 1 waits for its turn-2 generation
    pid = ray.get(actors[1].__ray_call__.remote(lambda self: os.getpid()))
    crash_gen = scripted(tokenizer, ANSWERS)
    turns = {}

    async def crashing_generate(ids, sampling):
        key = sampling["episode_key"]
        turns[key] = turns.get(key, 0) + 1
        if key == 1 and turns[key] == 2:
            os.kill(pid, signal.SIGKILL)
        return await crash_gen(ids, sampling)

    with pytest.raises(EnvFailed, match=r"env worker 1 died during step of episode 1 "
                                             r"\(env 'sokoban', seed 3\)"):
        asyncio.run(asyncio.wait_for(run_episodes_keyed(
            specs[:2], tokenizer, agent, crashing_generate, max_turns=4, open_env=workers.open),
            120))
    workers.kill()
