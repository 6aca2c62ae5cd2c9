"""Env streams (``rollout.mode: turns``): fixed turns per step, episodes across steps, seed groups,
the cut's next prompt, and resume by replay.

The "engine" is a policy that picks a FrozenLake move from a hash of the prompt, so episodes end
at different turns (holes, the goal, the turn limit) and every prompt matters; the reference for
what a stream plays is ``run_episode`` playing the same episodes whole.
"""
from __future__ import annotations

import asyncio

import pytest

from ragen_mega.agent import AgentConfig
from ragen_mega.rollout.types import Generation
from ragen_mega.rollout.seeding import EnvPart
from ragen_mega.rollout.episode import run_episode
from ragen_mega.rollout.streams import EnvStreams

AGENT = AgentConfig(think=False, max_actions_per_turn=1, memory_turns=1)
PARTS = [EnvPart("lake", "frozen_lake", {"is_slippery": False}, 2)]
MOVES = ["Left", "Down", "Right", "Up"]


def policy(tokenizer):
    async def generate(prompt_ids, sampling):
        ids = tokenizer.encode(f" {MOVES[sum(prompt_ids) * 7 % 31 % 4]} </answer>",
                               add_special_tokens=False)
        return Generation(ids, [-0.25] * len(ids), "stop")
    return generate


def make_streams(tokenizer, turns_per_step=3):
    return EnvStreams(PARTS, group_size=2, seed=5, turns_per_step=turns_per_step,
                      tokenizer=tokenizer, agent=AGENT, max_turns=4)


def play(streams, tokenizer, version=0):
    gen = policy(tokenizer)
    return asyncio.run(streams.play_window(lambda s: gen, {}, weight_version=version))


def test_streams_play_fixed_turns_and_continue_episodes(tokenizer):
    streams = make_streams(tokenizer)
    windows = [play(streams, tokenizer, version=v) for v in range(4)]
    for v, w in enumerate(windows):
        # exactly streams x turns_per_step samples, 3 per stream, every sample of version v
        assert [s.stream for s in w.samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
        assert {s.weight_version for s in w.samples} == {v}
    # per stream, the windows' samples are whole episodes one after another: turn numbers run
    # 1, 2, ... and restart only after an episode's last turn
    by_episode: dict[int, list] = {}
    for w in windows:
        for s in w.samples:
            by_episode.setdefault(s.episode_id, []).append(s)
    crossed = 0
    for eid, samples in by_episode.items():
        stream, j = eid % 4, eid // 4
        assert [s.turn for s in samples] == list(range(1, len(samples) + 1))
        assert all(s.stream == stream for s in samples)
        # episode j of group g: the seed episodes mode plays in step j + 1 (a function of g, j)
        assert samples[0].seed == 5 + 2 * j + stream // 2 and samples[0].group_id == stream // 2
        crossed += len({id(w) for w in windows for s in w.samples if s.episode_id == eid}) > 1
        finished = samples[-1].last
        # the reference: the same episode played whole gives the same turns, ends the same way
        whole = asyncio.run(run_episode(streams.spec(stream, j), tokenizer=tokenizer, agent=AGENT,
                                        generate=policy(tokenizer), sampling={}, max_turns=4))
        n = len(samples)
        assert [s.prompt_ids for s in whole.samples[:n]] == [s.prompt_ids for s in samples]
        assert [s.reward for s in whole.samples[:n]] == [s.reward for s in samples]
        assert finished == (n == len(whole.samples))
    assert crossed > 0
    # each stream's episodes are j = 0, 1, ..., every one but the newest finished: a finished
    # episode is followed at once by the stream's next one
    for stream in range(4):
        js = sorted(e // 4 for e in by_episode if e % 4 == stream)
        assert js == list(range(len(js))) and len(js) > 1
        assert all(by_episode[j * 4 + stream][-1].last for j in js[:-1])
    # every episode a window reports finished ended in it, with its whole-episode metrics
    ended = [e for w in windows for e in w.finished]
    assert ended and all(e.samples[-1].last for e in ended)
    assert all(e.metrics["num_turns"] == e.samples[-1].turn for e in ended)


def test_cut_next_prompt_is_the_next_turns_prompt(tokenizer):
    streams = make_streams(tokenizer)
    first = play(streams, tokenizer)
    second = play(streams, tokenizer)
    cuts = [s for s in first.samples if s.cut]
    assert cuts and all(not s.last for s in cuts)
    assert set(first.next_prompts) == {s.episode_id for s in cuts}
    for cut in cuts:   # valued at the cut = what the episode's next turn was prompted with
        [nxt] = [s for s in second.samples
                 if s.episode_id == cut.episode_id and s.turn == cut.turn + 1]
        assert first.next_prompts[cut.episode_id] == nxt.prompt_ids
    # a stream whose episode ended on the window's last turn has no cut
    assert all(s.cut == (not s.last) for w in (first, second)
               for s in [w.samples[i * 3 + 2] for i in range(4)])


def test_resumed_streams_replay_the_uninterrupted_ones(tokenizer):
    straight = make_streams(tokenizer)
    play(straight, tokenizer)
    saved = straight.state_dict()
    want = play(straight, tokenizer, version=1)
    assert any(saved["responses"])    # some stream is mid-episode at the save

    resumed = make_streams(tokenizer)
    resumed.load_state_dict(saved)
    got = play(resumed, tokenizer, version=1)
    fields = lambda w: [(s.episode_id, s.turn, s.prompt_ids, s.response_ids, s.reward, s.cut,
                         s.last) for s in w.samples]
    assert fields(got) == fields(want)
    assert got.next_prompts == want.next_prompts
    assert [e.metrics for e in got.finished] == [e.metrics for e in want.finished]


def test_a_window_cut_short_is_played_again_from_its_start(tokenizer):
    """A window abandoned mid-way (an engine died under stream 2's second request: the driver
    restarts it and calls ``restore``) is played again and gives exactly the window an
    uninterrupted run plays; the other streams were cancelled mid-turn, not left running."""
    straight = make_streams(tokenizer)
    play(straight, tokenizer)
    want = play(straight, tokenizer, version=1)

    class Died(RuntimeError):
        pass

    streams = make_streams(tokenizer)
    play(streams, tokenizer)
    start = streams.state_dict()
    gen, calls = policy(tokenizer), []

    def generate_for(stream):
        async def generate(prompt_ids, sampling):
            calls.append(stream)
            if stream == 2 and calls.count(2) == 2:
                raise Died("engine 0 died under a request and was restarted")
            await asyncio.sleep(0)
            return await gen(prompt_ids, sampling)
        return generate

    with pytest.raises(Died):
        asyncio.run(streams.play_window(generate_for, {}, weight_version=1))
    asyncio.run(streams.restore(start))
    got = play(streams, tokenizer, version=1)
    fields = lambda w: [(s.episode_id, s.turn, s.prompt_ids, s.response_ids, s.reward, s.cut,
                         s.last) for s in w.samples]
    assert fields(got) == fields(want) and got.next_prompts == want.next_prompts
    assert streams.state_dict() == straight.state_dict()


def test_window_metrics(tokenizer):
    from ragen_mega.rollout.metrics import summarize_window

    streams = make_streams(tokenizer)
    windows = [play(streams, tokenizer, version=v) for v in range(3)]
    w = next(w for w in windows if w.finished)
    m = summarize_window(w.samples, w.finished, "rollout", trained_version=5)
    version = w.samples[0].weight_version
    lengths = [e.samples[-1].turn for e in w.finished]   # each ended at its last turn
    assert m["rollout/samples"] == m["rollout/lake/samples"] == 12
    assert m["rollout/episodes_finished"] == len(w.finished)
    assert m["rollout/episode_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert m["rollout/weight_staleness"] == m["rollout/lake/weight_staleness"] == 5 - version
    assert m["rollout/response_length"] == pytest.approx(
        sum(len(s.response_ids) for s in w.samples) / 12)
    assert not any("pass@" in k or "before_filter" in k for k in m)
    # a window where nothing ended has no episode scalars, only the window's
    quiet = summarize_window(w.samples, [], "rollout", trained_version=5)
    assert "rollout/episode_length" not in quiet and "rollout/success" not in quiet
    assert quiet["rollout/episodes_finished"] == 0


def test_overlapped_window_that_meets_a_restarted_engine_is_played_again_as_it_was(
        tokenizer, tmp_path):
    """``RolloutManager.window`` overlapped (``async_mode: one_step_off``): step 2's window plays
    while step 1 trains, with version 0's weights, and is stamped so. An engine restarted under
    it ends it with ``EngineRestarted`` that is not ``resynced`` (weights cannot be given from the rollout's thread); the
    streams go back to where the window started, so the window played again after the sync is
    the one an uninterrupted run plays (a window left half-played would go on from its middle)."""
    from ragen_mega.config import load_run_config
    from ragen_mega.rollout.types import EngineRestarted
    from ragen_mega.rollout.manager import RolloutManager

    cfg = load_run_config(None, [
        "env.name=frozen_lake", "env.kwargs={is_slippery: false}", "env.env_groups=2",
        "env.group_size=2", "env.max_turns=4", "rollout.mode=turns", "rollout.turns_per_step=3",
        "algo.adv_estimator=gae", "critic.enable=true", "agent.think=false",
        "agent.max_actions_per_turn=1", "agent.memory_turns=1", f"trainer.run_dir={tmp_path}"])

    class Engines:  # the engine group's rollout side, serving the scripted policy
        def __init__(self):
            self.generate = policy(tokenizer)

        def run(self, work):
            return asyncio.run(work)

    def manager():
        m = RolloutManager(cfg, tokenizer, Engines())
        m.load_state_dict(None)
        m.rollout(1, 0)
        return m

    want = manager().rollout(2, 0)
    overlapped = manager()
    start, served, calls = overlapped.streams.state_dict(), overlapped.engines.generate, []

    async def restarted_under_third_request(prompt_ids, sampling, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise EngineRestarted("engine 0 was restarted under a request", resynced=False)
        await asyncio.sleep(0)
        return await served(prompt_ids, sampling)
    overlapped.engines.generate = restarted_under_third_request
    with pytest.raises(EngineRestarted):
        overlapped.rollout(2, 0)
    assert overlapped.streams.state_dict() == start
    overlapped.engines.generate = served
    got = overlapped.rollout(2, 0)
    fields = lambda p: [(s.episode_id, s.turn, s.prompt_ids, s.response_ids, s.reward, s.cut,
                         s.last, s.weight_version) for s in p.samples]
    assert fields(got) == fields(want)
    assert {s.weight_version for s in got.samples} == {0}
    assert got.window.next_prompts == want.window.next_prompts and got.metrics == want.metrics
