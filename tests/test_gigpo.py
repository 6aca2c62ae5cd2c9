"""GiGPO (``algo/gigpo.py``, ``algo.adv_estimator: gigpo``) against hand-worked numbers from the
paper's definitions (arXiv 2505.10978, Eq. 3 and 5-8), the anchor states the rollout records,
and the config's refusals."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch

from ragen_mega.agent import AgentConfig
from ragen_mega.algo.estimators import compute_advantages
from ragen_mega.algo.gigpo import anchor_groups, gigpo, step_group_metrics, step_returns
from ragen_mega.config import AlgoConfig, load_run_config
from ragen_mega.config_tree import ConfigError
from ragen_mega.envs import make
from ragen_mega.envs.sokoban import SokobanEnv
from ragen_mega.rollout.batch import build_batch
from ragen_mega.rollout.types import EpisodeSpec
from episodes import run_episodes
from ragen_mega.rollout.sample import Sample

# Group 0 plays one seed three times, gamma 0.5; states are named s0..s3 (the anchor keys):
#   episode 0: s0 r=0 -> s1 r=0 -> s2 r=1      score 1
#   episode 1: s0 r=0 -> s1 r=0 -> s3 r=0      score 0
#   episode 2: s0 r=0 -> s2 r=1                score 1
# Group 1 plays another seed whose first observation is *also* "s0" (text that repeats across
# maps must not pool their turns):
#   episode 3: s0 r=1                          score 1
#   episode 4: s0 r=0                          score 0
TURNS = [  # (episode, group, turn, state, reward)
    (0, 0, 1, "s0", 0.0), (0, 0, 2, "s1", 0.0), (0, 0, 3, "s2", 1.0),
    (1, 0, 1, "s0", 0.0), (1, 0, 2, "s1", 0.0), (1, 0, 3, "s3", 0.0),
    (2, 0, 1, "s0", 0.0), (2, 0, 2, "s2", 1.0),
    (3, 1, 1, "s0", 1.0),
    (4, 1, 1, "s0", 0.0),
]
GAMMA, OMEGA = 0.5, 2.0
# Eq. 5, R_t = r_t + gamma R_{t+1}: episode 0: 0.25, 0.5, 1; episode 1: 0, 0, 0; episode 2: 0.5, 1
RETURNS = [0.25, 0.5, 1.0, 0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 0.0]
# Eq. 3 with mean subtraction (mean_norm): group 0's mean score 2/3, group 1's 1/2
EPISODE_TERM = [1 / 3] * 3 + [-2 / 3] * 3 + [1 / 3] * 2 + [0.5, -0.5]
# Eq. 7, step groups (group 0) s0: returns 0.25, 0, 0.5 (mean 0.25); s1: 0.5, 0 (mean 0.25);
# s2: 1, 1 (mean 1); s3 alone (0). Group 1's s0: 1, 0 (mean 0.5).
STEP_TERM = [0.0, 0.25, 0.0, -0.25, -0.25, 0.0, 0.25, 0.0, 0.5, -0.5]


def columns(order=None):
    rows = [TURNS[i] for i in (order or range(len(TURNS)))]
    episode, group, turn, state, reward = zip(*rows)
    return (torch.tensor(reward), torch.tensor(episode), torch.tensor(group), torch.tensor(turn),
            list(state))


def test_step_returns_discount_within_each_episode():
    reward, episode, _, turn, _ = columns()
    assert step_returns(reward, episode, turn, GAMMA).tolist() == pytest.approx(RETURNS)
    assert step_returns(reward, episode, turn, 1.0).tolist() == pytest.approx(
        [1, 1, 1, 0, 0, 0, 1, 1, 1, 0])


def test_anchor_groups_pool_equal_states_of_one_group_only():
    _, _, group, _, state = columns()
    ids = anchor_groups(state, group.tolist()).tolist()
    # s0, s1, s2, s3 of group 0 and s0 of group 1: five step groups, numbered as first seen
    assert ids == [0, 1, 2, 0, 1, 3, 0, 2, 4, 4]


def test_similarity_groups_near_identical_states():
    # "abcdefghij" vs "abcdefghiX": difflib ratio 2 * 9 / 20 = 0.9 exactly
    keys = ["abcdefghij", "abcdefghiX", "zzzzzzzzzz", "abcdefghij"]
    assert anchor_groups(keys, [0, 0, 0, 1], similarity=0.9).tolist() == [0, 0, 1, 2]
    assert anchor_groups(keys, [0, 0, 0, 1], similarity=0.95).tolist() == [0, 1, 2, 3]
    assert anchor_groups(keys, [0, 0, 0, 1]).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="similarity must be in"):
        anchor_groups(keys, [0, 0, 0, 1], similarity=1.0)


@pytest.mark.parametrize("order", [None, [9, 2, 5, 0, 7, 3, 8, 1, 6, 4]])
def test_gigpo_hand_worked(order):
    """A = A_episode + omega * A_step (Eq. 8), mean-normalised, in any sample order."""
    reward, episode, group, turn, state = columns(order)
    idx = order or list(range(len(TURNS)))
    adv, episode_term, step_term = gigpo(
        reward, episode, group, turn, anchor_groups(state, group.tolist()), step_weight=OMEGA,
        gamma=GAMMA, norm_by_std=False)
    assert episode_term.tolist() == pytest.approx([EPISODE_TERM[i] for i in idx])
    assert step_term.tolist() == pytest.approx([STEP_TERM[i] for i in idx])
    assert adv.tolist() == pytest.approx([EPISODE_TERM[i] + OMEGA * STEP_TERM[i] for i in idx])


def test_gigpo_std_normalised():
    """mean_std_norm: group 0's scores (1, 0, 1) have std sqrt(1/3); step group s0's returns
    (0.25, 0, 0.5) std 0.25, s1's (0.5, 0) std sqrt(1/8); s2's equal returns have std 0 and so
    term 0 (0 / (0 + eps))."""
    reward, episode, group, turn, state = columns()
    _, episode_term, step_term = gigpo(reward, episode, group, turn,
                                       anchor_groups(state, group.tolist()), gamma=GAMMA)
    s = math.sqrt(1 / 3)
    assert episode_term[:8].tolist() == pytest.approx(
        [1 / 3 / s] * 3 + [-2 / 3 / s] * 3 + [1 / 3 / s] * 2, rel=1e-5)
    s1 = math.sqrt(1 / 8)
    assert step_term.tolist() == pytest.approx(
        [0.0, 0.25 / s1, 0.0, -1.0, -0.25 / s1, 0.0, 1.0, 0.0, 0.5 / 0.5 ** 0.5,
         -0.5 / 0.5 ** 0.5], rel=1e-5)


def sample(episode, group, turn, state, reward, stream=None, last=False):
    return Sample(prompt_ids=[5, 6], response_ids=[7, 8, 9], rollout_logprobs=[-1.0] * 3,
                  reward=reward, episode_id=episode, group_id=group, turn=turn, done=last,
                  last=last, env_tag="t", seed=group, stream=stream, state_key=state)


def test_estimator_through_build_batch_spreads_over_response_tokens():
    samples = [sample(e, g, t, s, r, last=(e, t) in {(0, 3), (1, 3), (2, 2), (3, 1), (4, 1)})
               for e, g, t, s, r in TURNS]
    settings = AlgoConfig(adv_estimator="gigpo", gamma=GAMMA, gigpo_step_weight=OMEGA,
                          grpo_norm_by_std=False)
    batch = compute_advantages(build_batch(samples, pad_id=0), settings)
    want = [a + OMEGA * b for a, b in zip(EPISODE_TERM, STEP_TERM)]
    mask = batch["loss_mask"].bool()
    for i, w in enumerate(want):
        assert batch["advantages"][i][mask[i]].tolist() == pytest.approx([w] * 3)
        assert batch["advantages"][i][~mask[i]].abs().sum() == 0
    assert "returns" not in batch                       # critic-free
    metrics = step_group_metrics(batch["state_group"], batch["step_advantages"])
    assert metrics["gigpo/step_group_size"] == pytest.approx(10 / 5)
    assert metrics["gigpo/shared_state_rate"] == pytest.approx(9 / 10)   # s3 is alone
    assert metrics["gigpo/step_adv_abs"] == pytest.approx(sum(map(abs, STEP_TERM)) / 10)


def test_streamed_members_are_streams():
    """``rollout.mode: turns``: the episode term scores each env stream by its window's rewards
    (stream 0: its episode 0 won (r 1), then episode 2 started; stream 1: episode 1, no reward),
    the step term's returns stop at the window's end. gamma 1, omega 1, mean-normalised:
      episode term: stream 0 +0.5, stream 1 -0.5
      step groups: "a" (turn 1 of episodes 0, 1, 2): returns 1, 0, 0 -> 2/3, -1/3, -1/3;
                   "b" (turn 2 of episodes 0, 1): returns 1, 0 -> 0.5, -0.5; "c" alone -> 0."""
    samples = [sample(0, 0, 1, "a", 0.0, stream=0), sample(0, 0, 2, "b", 1.0, stream=0, last=True),
               sample(2, 0, 1, "a", 0.0, stream=0),
               sample(1, 0, 1, "a", 0.0, stream=1), sample(1, 0, 2, "b", 0.0, stream=1),
               sample(1, 0, 3, "c", 0.0, stream=1)]
    batch = compute_advantages(build_batch(samples, pad_id=0),
                               AlgoConfig(adv_estimator="gigpo", grpo_norm_by_std=False))
    want = [0.5 + 2 / 3, 0.5 + 0.5, 0.5 - 1 / 3, -0.5 - 1 / 3, -0.5 - 0.5, -0.5]
    assert batch["advantages"][:, -1].tolist() == pytest.approx(want)


def test_rollout_records_each_turns_state_key(tokenizer, scripted, monkeypatch):
    """Every turn's Sample carries the env's key of the observation that turn was given (by
    default the observation text, replayed independently here); an env's own ``state_key``
    replaces it."""
    agent = AgentConfig(think=False, max_actions_per_turn=1)
    spec = EpisodeSpec("sokoban", {"dim_room": [6, 6], "num_boxes": 1}, seed=3, episode_id=0,
                       group_id=0)
    answers = [" Up </answer>", " Left </answer>", " Down </answer>"]

    def play():
        gen = scripted(tokenizer, answers)
        [ep] = asyncio.run(run_episodes(
            [spec], tokenizer=tokenizer, agent=agent, sampling={}, max_turns=3,
            generate=lambda ids, sp: gen(ids, {**sp, "episode_key": 0})))
        return [s.state_key for s in ep.samples]

    env = make("sokoban", dim_room=[6, 6], num_boxes=1)
    shown = [env.reset(3)] + [env.step(a)[0] for a in ("Up", "Left")]
    assert play() == shown and len(set(shown)) > 1
    monkeypatch.setattr(SokobanEnv, "state_key", lambda self, obs: f"len {len(obs)}",
                        raising=False)
    assert play() == [f"len {len(o)}" for o in shown]


@pytest.mark.parametrize("override, message", [
    (["critic.enable=true"], "critic-free"),
    (["critic.enable=false", "algo.gigpo_similarity=1.5"], r"gigpo_similarity: must be in \(0, 1\)"),
    (["critic.enable=false", "algo.gigpo_step_weight=-1"], "gigpo_step_weight: must be"),
    (["critic.enable=false", "env.group_size=1"], "group_size >= 2"),
])
def test_config_refuses_misused_gigpo(override, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, ["algo.adv_estimator=gigpo", *override])


def test_config_refuses_similarity_without_gigpo():
    with pytest.raises(ConfigError, match="read by adv_estimator=gigpo only"):
        load_run_config(None, ["algo.gigpo_similarity=0.9"])


def test_config_accepts_gigpo_in_streamed_steps():
    cfg = load_run_config(None, ["algo.adv_estimator=gigpo", "critic.enable=false",
                                 "rollout.mode=turns", "rollout.turns_per_step=4",
                                 "algo.gigpo_similarity=0.9"])
    assert cfg.algo.adv_estimator == "gigpo" and cfg.algo.gigpo_similarity == 0.9
