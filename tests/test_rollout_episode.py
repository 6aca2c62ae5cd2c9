"""Multi-turn episodes: samples carry exactly the sampled ids, rewards add up, episodes overlap.

The "engine" here is a scripted policy (it answers with fixed action text), because these tests
are about the rollout's bookkeeping; the real SGLang engine drives the same code in the
end-to-end test.
"""
from __future__ import annotations

import asyncio

import pytest
from ragen_mega.agent import AgentConfig
from ragen_mega.envs import make
from ragen_mega.rollout.types import EpisodeSpec
from ragen_mega.rollout.seeding import EnvPart, group_specs, mix_specs, train_step_specs
from episodes import run_episodes
from ragen_mega.rollout.sample import collate


def test_bandit_group_episode_samples(tokenizer, scripted):
    agent = AgentConfig(think=False, max_actions_per_turn=1)
    specs = group_specs("bandit", {}, env_groups=2, group_size=3, first_seed=10)
    # the bandit's episode is one random draw: each group member gets its own seed
    assert [(s.seed, s.group_id, s.episode_id) for s in specs] == [
        (10, 0, 0), (11, 0, 1), (12, 0, 2), (13, 1, 3), (14, 1, 4), (15, 1, 5)]
    sokoban = group_specs("sokoban", {}, env_groups=2, group_size=2, first_seed=10)
    assert [(s.seed, s.group_id) for s in sokoban] == [(10, 0), (10, 0), (11, 1), (11, 1)]

    async def go():
        out = []
        for answer in (" Dragon </answer>", " pizza </answer>", "no closing tag"):
            gen = scripted(tokenizer, [answer])
            out.append(await run_episodes(
                specs, tokenizer=tokenizer, agent=agent,
                generate=lambda ids, sp: gen(ids, {**sp, "episode_key": 0}),
                sampling={}, max_turns=3))
        return out
    good, invalid, broken = asyncio.run(go())
    for ep, spec in zip(good, specs):
        env = make("bandit")
        env.reset(spec.seed)
        _, expected_reward, _, _ = env.step("Dragon")  # same seed, same pull: independent replay
        assert len(ep.samples) == 1 and ep.samples[0].done and ep.samples[0].last
        assert ep.samples[0].reward == pytest.approx(expected_reward)
        assert ep.metrics["valid_action_rate"] == 1.0 and ep.metrics["format_ok_rate"] == 1.0
        # the prompt is exactly what the agent protocol builds, ending in "<answer>" (answer-only)
        assert tokenizer.decode(ep.samples[0].prompt_ids).endswith("<answer>")
    # an unknown arm is an invalid action: RAGEN's penalty, the bandit goes on to the next turn
    assert all(len(ep.samples) == 3 and ep.metrics["valid_action_rate"] == 0.0 for ep in invalid)
    assert all(s.reward == pytest.approx(-0.1) and not s.done for s in invalid[0].samples)
    # a broken format costs RAGEN's -0.1 per turn and no action is taken
    assert all(s.reward == pytest.approx(-0.1) for s in broken[0].samples)
    assert broken[0].metrics["num_actions"] == 0 and broken[0].samples[-1].last


def test_sokoban_multi_turn_reuses_sampled_ids(tokenizer, scripted):
    """Later prompts contain earlier responses' ids verbatim; collate masks exactly them."""
    agent = AgentConfig(think=True, max_actions_per_turn=2)
    spec = EpisodeSpec("sokoban", {"dim_room": [6, 6], "num_boxes": 1}, seed=3, episode_id=0,
                       group_id=0)
    answers = [" go </think><answer> Up || Left </answer>", " hmm </think><answer> Down </answer>"]
    gen = scripted(tokenizer, answers)
    [ep] = asyncio.run(run_episodes(
        [spec], tokenizer=tokenizer, agent=agent, sampling={}, max_turns=3,
        generate=lambda ids, sp: gen(ids, {**sp, "episode_key": 0}), env_steps_in_thread=True))
    env = make("sokoban", dim_room=[6, 6], num_boxes=1)
    env.reset(3)
    rewards = [sum(env.step(a)[1] for a in ("Up", "Left")), env.step("Down")[1], env.step("Down")[1]]
    assert [s.reward for s in ep.samples] == pytest.approx(rewards)
    first, second = ep.samples[0], ep.samples[1]
    resp = first.response_ids
    pos = [i for i in range(len(second.prompt_ids)) if second.prompt_ids[i:i + len(resp)] == resp]
    assert pos, "turn 2's prompt must contain turn 1's sampled ids verbatim"
    batch = collate(ep.samples, pad_id=tokenizer.pad_token_id)
    for i, s in enumerate(ep.samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        assert batch["input_ids"][i, p:p + r].tolist() == s.response_ids
        assert batch["loss_mask"][i].sum().item() == r
        masked = batch["input_ids"][i][batch["loss_mask"][i].bool()].tolist()
        assert masked == s.response_ids
        assert batch["rollout_logprobs"][i][batch["loss_mask"][i].bool()].tolist() == [-0.5] * r


def test_episodes_do_not_wait_for_the_slowest(tokenizer, scripted, run_episodes_keyed):
    """A slow generation for episode 0 does not hold back episode 1's later turns."""
    agent = AgentConfig(think=False, max_actions_per_turn=1)
    specs = [EpisodeSpec("bandit", {}, seed=s, episode_id=s, group_id=0) for s in (0, 1)]
    log: list[int] = []
    gen = scripted(tokenizer, [" pizza </answer>"], delays={0: 0.3}, log=log)
    asyncio.run(run_episodes_keyed(specs, tokenizer, agent, gen))
    assert log[:3] == [1, 1, 1], f"episode 1 should finish its 3 turns first, order was {log}"


def test_mix_seed_and_group_layout():
    """A step over several envs: each env its own seed range (bandit: a seed per episode,
    sokoban/frozen_lake: one per group), ranges end to end, group and episode ids numbered on."""
    parts = [EnvPart("arm", "bandit", {}, 2), EnvPart("box", "sokoban", {"dim_room": [6, 6]}, 2),
             EnvPart("lake", "frozen_lake", {}, 1)]
    specs = mix_specs(parts, group_size=2, first_seed=100)
    assert [(s.env_tag, s.env_name, s.seed, s.group_id, s.episode_id) for s in specs] == [
        ("arm", "bandit", 100, 0, 0), ("arm", "bandit", 101, 0, 1),
        ("arm", "bandit", 102, 1, 2), ("arm", "bandit", 103, 1, 3),
        ("box", "sokoban", 104, 2, 4), ("box", "sokoban", 104, 2, 5),
        ("box", "sokoban", 105, 3, 6), ("box", "sokoban", 105, 3, 7),
        ("lake", "frozen_lake", 106, 4, 8), ("lake", "frozen_lake", 106, 4, 9)]
    assert specs[4].env_kwargs == {"dim_room": [6, 6]} and specs[0].env_kwargs == {}
    # one part is exactly the single-env layout
    assert mix_specs(parts[:1], group_size=3, first_seed=10) == group_specs(
        "bandit", {}, env_groups=2, group_size=3, first_seed=10, env_tag="arm")
    # step k spans 7 seeds (4 + 2 + 1) right after step k-1's: a function of the step alone,
    # never the same (env, seed) twice across steps, never one seed for two envs
    steps = {k: train_step_specs(parts, group_size=2, seed=5, step=k) for k in (1, 2, 3)}
    assert [min(s.seed for s in steps[k]) for k in (1, 2, 3)] == [5, 12, 19]
    assert [max(s.seed for s in steps[k]) for k in (1, 2, 3)] == [11, 18, 25]
    owner = {}
    for k, step_specs in steps.items():
        for s in step_specs:
            assert owner.setdefault(s.seed, (k, s.env_tag)) == (k, s.env_tag)
    assert train_step_specs(parts, group_size=2, seed=5, step=2) == steps[2]


def test_mixed_episodes_play_their_own_env(tokenizer, scripted):
    """Bandit and sokoban episodes in one batch: each plays its own env (reward replayed on
    that env independently), its samples carry its tag, and it stops at its own turn limit
    (sokoban's 4; the bandit has none of its own, so the run's 2)."""
    agent = AgentConfig(think=False, max_actions_per_turn=1)
    parts = [EnvPart("arm", "bandit", {}, 1),
             EnvPart("box", "sokoban", {"dim_room": [6, 6]}, 1, max_turns=4)]
    specs = mix_specs(parts, group_size=2, first_seed=0)
    gen = scripted(tokenizer, [" Up </answer>"])  # a sokoban move, not an arm of the bandit
    episodes = asyncio.run(run_episodes(
        specs, tokenizer=tokenizer, agent=agent, sampling={}, max_turns=2,
        generate=lambda ids, sp: gen(ids, {**sp, "episode_key": 0})))
    for spec, ep in zip(specs, episodes):
        assert {s.env_tag for s in ep.samples} == {spec.env_tag}
        assert {s.group_id for s in ep.samples} == {spec.group_id}
        env = make(spec.env_name, **spec.env_kwargs)
        env.reset(spec.seed)
        expected = []
        for _ in ep.samples:
            _, r, _, info = env.step("Up")
            expected.append(r + (0.0 if info["action_is_valid"] else agent.format_penalty))
        assert [s.reward for s in ep.samples] == pytest.approx(expected), spec
    assert [len(ep.samples) for ep in episodes] == [2, 2, 4, 4]  # bandit: invalid, goes on
    assert not any(s.done for ep in episodes for s in ep.samples)  # the limits ended them
    bandit_prompt = tokenizer.decode(episodes[0].samples[0].prompt_ids)
    sokoban_prompt = tokenizer.decode(episodes[2].samples[0].prompt_ids)
    assert "Phoenix" in bandit_prompt and "Phoenix" not in sokoban_prompt


def _frozen_lake_turn_rates(tokenizer, scripted, answers, key, **agent_kwargs):
    """``(episode.metrics[key], turns)`` of one FrozenLake episode (seed 0, no slip, up to 4
    turns) whose turns answer ``answers`` in order, the last one from there on."""
    spec = EpisodeSpec("frozen_lake", {"is_slippery": False}, seed=0, episode_id=0, group_id=0)
    agent = AgentConfig(think=False, **{"max_actions_per_turn": 2, **agent_kwargs})
    gen = scripted(tokenizer, answers)

    async def go():
        return await run_episodes([spec], tokenizer=tokenizer, agent=agent,
                                  generate=lambda ids, sp: gen(ids, {**sp, "episode_key": 0}),
                                  sampling={}, max_turns=4)
    [episode] = asyncio.run(go())
    return episode.metrics[key], episode.metrics["num_turns"]


def test_example_copy_rate_counts_turns_that_answer_the_prompts_example(tokenizer, scripted):
    """FrozenLake's example answer is ``Left || Down`` (its first two action words): a turn
    answering exactly that, case and spaces aside, copies it; another answer, or a prompt that
    shows no example, does not."""
    def rate(answers, example_answer=True):
        return _frozen_lake_turn_rates(tokenizer, scripted, answers, "example_copy_rate",
                                       example_answer=example_answer)

    copied, turns = rate([" Up </answer>", " left ||down </answer>"])  # the second on, every turn
    assert turns > 1 and copied == pytest.approx((turns - 1) / turns)
    assert rate([" Left || Down </answer>"])[0] == 1.0
    assert rate([" Down || Left </answer>"])[0] == 0.0
    assert rate([" Left || Down </answer>"], example_answer=False)[0] == 0.0


def test_over_budget_rate_counts_turns_whose_answer_names_unplayed_actions(tokenizer, scripted):
    """An answer's actions past ``agent.max_actions_per_turn`` are dropped unplayed (RAGEN's
    parser); a turn that named any counts once, however many: exactly the budget does not."""
    def rate(answers, max_actions=2):
        return _frozen_lake_turn_rates(tokenizer, scripted, answers, "over_budget_rate",
                                       max_actions_per_turn=max_actions)

    over, turns = rate([" Up || Up || Up || Up </answer>", " Up </answer>"])
    assert turns > 1 and over == pytest.approx(1 / turns)
    assert rate([" Up || Up </answer>"])[0] == 0.0
    assert rate([" Up || Up || Up </answer>"], max_actions=3)[0] == 0.0
    assert rate([" Up || Up || Up </answer>"])[0] == 1.0
