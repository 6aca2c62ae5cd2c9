"""One training row per episode (``trainer.pack_trajectories: auto``) against the per-turn layout,
on Sokoban episodes played through the real prompt builder with a scripted policy.

The pure tests check the layout against the samples themselves (each packed row is the last
prompt + response, its loss tokens are every turn's sampled ids in order, with their engine
log-probs) and the fallbacks (memory window, answers re-rendered as text). The Megatron test
runs the tiny Qwen2 actor and critic in one process on both layouts of the same episodes:
log-probs, critic values, GAE advantages, losses, gradients and updated weights must agree.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from ragen_mega.agent import AgentConfig
from ragen_mega.backends.megatron.train import ppo_minibatches
from ragen_mega.algo.estimators import compute_advantages
from ragen_mega.config import AlgoConfig
from ragen_mega.rollout.batch import build_batch
from ragen_mega.rollout.types import EpisodeSpec, Generation
from ragen_mega.rollout.packing import grows_by_prefix, layouts_agree, pack_trajectories

# turn k's answer (cycled); the second ends with the sampled end-of-turn token, which the next
# prompt must not double
ANSWERS = [" the box is left of me </think><answer> Left || Up </answer>",
           " push it down </think><answer> Down </answer><|im_end|>",
           " try again, then right </think><answer> Right || Right || Up </answer>"]
PAD = 2


def _generate(tokenizer):
    """Scripted engine: turn k of an episode answers ANSWERS[k % 3], each token its own
    log-prob (episode, turn and position in it), so a misplaced one shows."""
    turns: dict[int, int] = {}

    async def generate(prompt_ids, sampling):
        key = sampling["episode_key"]
        k = turns[key] = turns.get(key, 0) + 1
        ids = tokenizer.encode(ANSWERS[(k - 1) % len(ANSWERS)], add_special_tokens=False)
        return Generation(ids, [-(key + 1) - k / 10 - j / 1000 for j in range(len(ids))], "stop")
    return generate


def play(tokenizer, run_episodes_keyed, agent, episode_ids, max_turns=4):
    specs = [EpisodeSpec("sokoban", {"dim_room": [6, 6], "num_boxes": 1}, seed=e, episode_id=e,
                         group_id=e // 2) for e in episode_ids]
    episodes = asyncio.run(run_episodes_keyed(specs, tokenizer, agent, _generate(tokenizer),
                                              max_turns=max_turns))
    return [s for ep in episodes for s in ep.samples]


@pytest.fixture(scope="module")
def unbounded(tokenizer, run_episodes_keyed):
    return play(tokenizer, run_episodes_keyed, AgentConfig(memory_turns=None), [0, 1])


@pytest.fixture(scope="module")
def windowed(tokenizer, run_episodes_keyed):
    return play(tokenizer, run_episodes_keyed, AgentConfig(memory_turns=1), [2, 3])


def _episodes(samples):
    out: dict[int, list] = {}
    for s in samples:
        out.setdefault(s.episode_id, []).append(s)
    return out


def test_unbounded_memory_packs_each_episode_into_its_last_turn(unbounded):
    assert {len(t) for t in _episodes(unbounded).values()} == {4}   # episodes went on
    per_turn = build_batch(unbounded, pad_id=PAD)
    layout = pack_trajectories(unbounded, per_turn, enabled=True)
    train = layout.batch
    assert layout.metrics == {"train/packed_episodes": 2.0, "train/pack_fallbacks": 0.0}
    assert train["input_ids"].shape[0] == 2
    for row, (episode, turns) in enumerate(_episodes(unbounded).items()):
        n = len(turns[-1].prompt_ids) + len(turns[-1].response_ids)
        assert train["input_ids"][row, :n].tolist() == turns[-1].prompt_ids + turns[-1].response_ids
        assert int(train["attention_mask"][row].sum()) == n
        mask = train["loss_mask"][row].bool()
        assert train["input_ids"][row][mask].tolist() == [i for t in turns for i in t.response_ids]
        assert train["rollout_logprobs"][row][mask].tolist() == pytest.approx(
            [lp for t in turns for lp in t.rollout_logprobs])
        assert train["rollout_logprobs"][row][~mask].abs().sum() == 0
        assert int(train["episode_id"][row]) == episode
    # the same loss tokens in both layouts, so token-mean losses share their normaliser
    assert train["loss_mask"].sum() == per_turn["loss_mask"].sum()
    # 4 turns of a ~200-token prompt each fed once instead of 4 times
    assert train["attention_mask"].sum() * 2 < per_turn["attention_mask"].sum()


def test_sampled_end_of_turn_is_not_doubled(unbounded, tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    second, third = unbounded[1], unbounded[2]
    assert second.response_ids[-1] == im_end
    seen = len(second.prompt_ids) + len(second.response_ids)
    assert third.prompt_ids[seen] != im_end       # the template's own end of turn was dropped
    assert grows_by_prefix(unbounded[:4])


def test_per_turn_tensors_land_on_the_same_tokens(unbounded):
    """Advantages of the per-turn layout reach the packed row on the same tokens (row by row,
    turn after turn); a packed row's values read back per turn are the row's columns up to each
    turn's length (the state after its last token included), 0 past it."""
    per_turn = build_batch(unbounded, pad_id=PAD)
    layout = pack_trajectories(unbounded, per_turn, enabled=True)
    g = torch.Generator().manual_seed(0)
    advantages = torch.randn(per_turn["loss_mask"].shape, generator=g) * per_turn["loss_mask"]
    packed = layout.to_train(advantages)
    for row, episode in enumerate(layout.batch["episode_id"].tolist()):
        turns = [i for i, s in enumerate(unbounded) if s.episode_id == episode]
        expected = torch.cat([advantages[i][per_turn["loss_mask"][i].bool()] for i in turns])
        assert torch.equal(packed[row][layout.batch["loss_mask"][row].bool()], expected)
        assert packed[row][~layout.batch["loss_mask"][row].bool()].abs().sum() == 0
    packed_values = torch.randn(layout.batch["input_ids"].shape, generator=g)
    values = layout.to_per_turn(packed_values)
    for i, n in enumerate(per_turn["attention_mask"].sum(1).tolist()):
        assert torch.equal(values[i, :n + 1], packed_values[layout.rows[i], :n + 1])
        assert values[i, n + 1:].abs().sum() == 0


def test_memory_window_falls_back_to_per_turn_rows(windowed, unbounded):
    """A window hides old turns, so prompts do not grow by prefix: every multi-turn episode is
    counted and keeps its per-turn rows. Mixed with packable episodes, each gets its layout and
    PPO mini-batches still hold the same episodes."""
    per_turn = build_batch(windowed, pad_id=PAD)
    layout = pack_trajectories(windowed, per_turn, enabled=True)
    assert layout.metrics == {"train/packed_episodes": 0.0, "train/pack_fallbacks": 2.0}
    for key in ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs", "episode_id"):
        assert torch.equal(layout.batch[key], per_turn[key]), key

    mixed = unbounded + windowed
    per_turn = build_batch(mixed, pad_id=PAD)
    layout = pack_trajectories(mixed, per_turn, enabled=True)
    assert layout.metrics == {"train/packed_episodes": 2.0, "train/pack_fallbacks": 2.0}
    assert layout.batch["episode_id"].tolist() == [0, 1] + [2] * 4 + [3] * 4
    assert [sorted(set(mb["episode_id"].tolist())) for mb in ppo_minibatches(layout.batch, 3)] \
        == [sorted(set(mb["episode_id"].tolist())) for mb in ppo_minibatches(per_turn, 3)]


def test_answers_rendered_as_text_fall_back(tokenizer, run_episodes_keyed):
    samples = play(tokenizer, run_episodes_keyed,
                   AgentConfig(include_thoughts_in_memory=False), [4], max_turns=2)
    layout = pack_trajectories(samples, build_batch(samples, pad_id=PAD), enabled=True)
    assert layout.metrics["train/pack_fallbacks"] == 1.0


def test_off_and_sequence_mean_losses_keep_per_turn_rows(unbounded):
    assert layouts_agree("auto", ["token-mean", "token-mean"])
    assert not layouts_agree("off", ["token-mean"])
    assert not layouts_agree("auto", ["token-mean", "seq-mean-token-mean"])
    assert layouts_agree("auto", ["episode-mean-token-mean", "token-mean"])  # weights follow
    per_turn = build_batch(unbounded, pad_id=PAD)
    layout = pack_trajectories(unbounded, per_turn, enabled=False)
    assert layout.metrics == {"train/packed_episodes": 0.0, "train/pack_fallbacks": 0.0}
    assert torch.equal(layout.batch["input_ids"], per_turn["input_ids"])


# ---------------------------------------------------------------- the real trainer, both layouts
# Adam's eps well above rounding-level gradients: with the default 1e-8 an element whose gradient
# is near zero gets an update of ~lr * sign(g), so a rounding-level gradient difference between
# the layouts moves that weight by up to ~lr (seen: 1.4e-6 on 1 of 8,192 weights at lr 1e-3).
# With eps, the update lr * m/(sqrt(v) + eps) moves by at most ~lr/eps per unit of gradient
# difference (and by a relative 1/4 of a relative gradient difference), which bounds the
# weights' tolerance below (WEIGHT_ATOL).
LR, ADAM_EPS, UPDATES = 1e-3, 1e-3, 2
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4
ACTOR = dict(lr=LR, adam_eps=ADAM_EPS, grad_clip=0.0, ppo_mini_batch_size=1, entropy_coeff=0.01)
CRITIC = dict(lr=LR, adam_eps=ADAM_EPS, grad_clip=0.0, ppo_mini_batch_size=1, value_clip=0.5)
#: two gradients within (GRAD_ATOL, GRAD_RTOL) give weights this close after UPDATES Adam steps
#: (the factor 2: the second step's moments mix both updates' gradients)
WEIGHT_ATOL = 2 * UPDATES * LR * (GRAD_ATOL / ADAM_EPS + GRAD_RTOL / 4)


def _both_layouts_worker(rank, world_size, hf_dir, batches, layout):
    """Log-probs and values on each layout, then GAE advantages through the per-turn estimator,
    then one actor and one critic training step per layout from the same initial weights (two
    PPO mini-batches of one episode each): metrics, last update's gradients, weights."""
    import gc

    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig, CriticConfig

    per_turn, train = batches["per_turn"], batches["train"]
    out = {"turn": {}, "packed": {}}
    for role, config in (("critic", CriticConfig(**CRITIC)), ("actor", ActorConfig(**ACTOR))):
        for name, batch in (("turn", per_turn), ("packed", train)):
            trainer = MegatronTrainer(config, hf_dir, role=role, total_steps=10)
            res = out[name]
            if role == "critic":
                res["values"] = trainer.compute_values(batch)
                values = (res["values"] if name == "turn" else layout.to_per_turn(res["values"]))
                adv = compute_advantages(dict(per_turn), AlgoConfig(adv_estimator="gae", whiten_advantages=False, gamma=0.9,
                                                    lam=0.8), token_values=values)
                res["advantages"], res["returns"] = adv["advantages"], adv["returns"]
                if name == "packed":
                    res["advantages"] = layout.to_train(adv["advantages"])
                    res["returns"] = layout.to_train(adv["returns"])
                step = {**batch, "old_values": res["values"], "returns": res["returns"]}
            else:
                res["logprobs"] = trainer.compute_logprobs(batch)
                # old policy = current one, shifted per token, so the clip acts on some tokens
                noise = batches["noise"] if name == "turn" else layout.to_train(batches["noise"])
                step = {**batch, "old_logprobs": res["logprobs"] + noise,
                        "advantages": res["advantages"]}
            res[f"{role}_metrics"] = trainer.train(step)
            res[f"{role}_grads"] = {n: p.main_grad.clone()
                                    for n, p in trainer.model[0].named_parameters()}
            res[f"{role}_weights"] = dict(trainer.export_hf_state())
            del trainer
            gc.collect()
    return out


@pytest.fixture(scope="module")
def both_layouts(actor_model_dir, tokenizer, run_episodes_keyed):
    from ragen_mega.backends.megatron.launch import run_workers

    samples = play(tokenizer, run_episodes_keyed, AgentConfig(memory_turns=None), [0, 1],
                   max_turns=5)
    per_turn = build_batch(samples, pad_id=PAD)
    layout = pack_trajectories(samples, per_turn, enabled=True)
    noise = 0.3 * torch.randn(per_turn["loss_mask"].shape,
                              generator=torch.Generator().manual_seed(1)) * per_turn["loss_mask"]
    batches = {"per_turn": per_turn, "train": layout.batch, "noise": noise}
    [out] = run_workers(_both_layouts_worker, 1, actor_model_dir, batches, layout, timeout=600)
    return per_turn, layout, out


def test_packed_log_probs_values_and_advantages_equal_per_turn(both_layouts):
    per_turn, layout, out = both_layouts
    mask = per_turn["loss_mask"].bool()
    lp_turn, lp_packed = out["turn"]["logprobs"], layout.to_per_turn(out["packed"]["logprobs"])
    torch.testing.assert_close(lp_packed[mask], lp_turn[mask], atol=2e-5, rtol=0)
    assert lp_turn[mask].std() > 0.1                      # log-probs of a real model, not zeros
    v_turn, v_packed = out["turn"]["values"], layout.to_per_turn(out["packed"]["values"])
    torch.testing.assert_close(v_packed, v_turn, atol=2e-5, rtol=0)   # every column read
    for key in ("advantages", "returns"):
        torch.testing.assert_close(layout.to_train(out["turn"][key]), out["packed"][key],
                                   atol=2e-5, rtol=0)
        assert out["turn"][key][mask].std() > 0


@pytest.mark.parametrize("role, keys", [
    ("actor", ("loss", "pg_loss", "entropy", "pg_clipfrac", "ppo_kl", "grad_norm")),
    ("critic", ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm"))])
def test_packed_training_step_equals_per_turn(both_layouts, role, keys):
    _, _, out = both_layouts
    turn, packed = out["turn"][f"{role}_metrics"], out["packed"][f"{role}_metrics"]
    assert turn["ppo_updates"] == packed["ppo_updates"] == UPDATES
    for key in keys:
        assert packed[key] == pytest.approx(turn[key], rel=1e-4, abs=1e-6), key
    if role == "actor":
        assert turn["pg_clipfrac"] > 0
    for name, grad in out["turn"][f"{role}_grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(out["packed"][f"{role}_grads"][name], grad,
                                   atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                   msg=lambda m: f"{role} {name}: {m}")
    for name, w in out["turn"][f"{role}_weights"].items():
        torch.testing.assert_close(out["packed"][f"{role}_weights"][name], w, atol=WEIGHT_ATOL,
                                   rtol=0, msg=lambda m: f"{role} {name}: {m}")
