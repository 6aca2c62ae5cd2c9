"""Train phase per step, one row per turn vs one row per episode (``trainer.pack_trajectories``).

RAGEN's Sokoban shape: 6x6 rooms, one box, 5 turns of up to 5 actions, think mode, unbounded
memory (every past turn in the prompt). The episodes are played through the real prompt builder
and env by a scripted policy that writes 20-120 words of thought and 1-5 random moves per turn
(so episodes run their 5 turns), then both layouts of the SAME episodes go through the driver's
train phase on the Megatron tiny Qwen2 or SmolLM2: actor log-probs, critic values, GAE
advantages, critic update, actor update (GAE, token-budget micro-batches). One actor and one
critic serve both layouts, steps alternating per-turn / packed so machine load hits both alike;
one untimed warm-up step each.

    python benchmarks/bench_packing.py [--model tiny|smollm2] [--episodes 8] [--steps 3]
                                       [--max-tokens-per-micro-batch 4096]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import time

import torch

from ragen_mega.backends.megatron.launch import run_workers

WORDS = ("the box is next to the wall so I should go around it first then push it toward "
         "the target while keeping the path clear of corners").split()
MOVES = ("Up", "Down", "Left", "Right")


def sokoban_episodes(tokenizer, episodes: int, seed: int = 0):
    """``episodes`` Sokoban episodes of RAGEN's shape, played with a scripted policy."""
    from ragen_mega.agent import AgentConfig
    from ragen_mega.rollout.types import EpisodeSpec, Generation
    from ragen_mega.rollout.episode import run_episode

    async def generate(prompt_ids, sampling):
        rng = random.Random(hash((seed, len(prompt_ids))))
        thought = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))
        moves = " || ".join(rng.choice(MOVES) for _ in range(rng.randint(1, 5)))
        ids = tokenizer.encode(f" {thought} </think><answer> {moves} </answer>",
                               add_special_tokens=False)
        return Generation(ids, [-1.0] * len(ids), "stop")

    specs = [EpisodeSpec("sokoban", {"dim_room": [6, 6], "num_boxes": 1}, seed=seed + e,
                         episode_id=e, group_id=e // 2) for e in range(episodes)]
    agent = AgentConfig(max_actions_per_turn=5, memory_turns=None)

    async def play():
        return await asyncio.gather(*(run_episode(s, tokenizer=tokenizer, agent=agent,
                                                  generate=generate, sampling={}, max_turns=5)
                                      for s in specs))
    played = asyncio.run(play())
    return [s for ep in played for s in ep.samples]


def _train_phase(actor, critic, batch, per_turn, layout):
    """The driver's train phase on ``batch`` (the per-turn batch itself, or the packed one)."""
    from ragen_mega.algo.estimators import compute_advantages
    from ragen_mega.config import AlgoConfig

    batch = {**batch, "old_logprobs": actor.compute_logprobs(batch),
             "old_values": critic.compute_values(batch)}
    values = batch["old_values"] if layout is None else layout.to_per_turn(batch["old_values"])
    adv = compute_advantages(dict(per_turn), AlgoConfig(adv_estimator="gae", whiten_advantages=False),
                             token_values=values)
    for key in ("advantages", "returns"):
        batch[key] = adv[key] if layout is None else layout.to_train(adv[key])
    critic_metrics = critic.train(batch)
    return actor.train(batch)["padding_frac"], critic_metrics["padding_frac"]


def _worker(rank, world_size, hf_dir, per_turn, layout, steps, budget):
    """{layout: (seconds per train phase, actor padding, critic padding)}."""
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig, CriticConfig

    settings = dict(micro_batch_size=1, max_tokens_per_micro_batch=budget, lr=1e-5)
    actor = MegatronTrainer(ActorConfig(**settings), hf_dir, role="actor")
    critic = MegatronTrainer(CriticConfig(**settings), hf_dir, role="critic")
    runs = {"per turn": (per_turn, None), "packed": (layout.batch, layout)}
    seconds = {name: 0.0 for name in runs}
    padding = {}
    for step in range(steps + 1):
        for name, (batch, lay) in runs.items():
            start = time.perf_counter()
            padding[name] = _train_phase(actor, critic, batch, per_turn, lay)
            if step:  # step 0 warms up
                seconds[name] += time.perf_counter() - start
    return {name: (seconds[name] / steps, *padding[name]) for name in runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=4096)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from ragen_mega.models.prepare import cache_dir, make_tiny_model, prepare_smollm2
    from ragen_mega.rollout.batch import build_batch
    from ragen_mega.rollout.packing import pack_trajectories

    hf_dir = str(prepare_smollm2() if args.model == "smollm2"
                 else make_tiny_model(cache_dir() / "tiny" / "tiny-qwen2-untied", "qwen2"))
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    samples = sokoban_episodes(tokenizer, args.episodes)
    per_turn = build_batch(samples, pad_id=tokenizer.pad_token_id)
    layout = pack_trajectories(samples, per_turn, enabled=True)
    timing = run_workers(_worker, 1, hf_dir, per_turn, layout, args.steps,
                         args.max_tokens_per_micro_batch, timeout=7200,
                         threads_per_worker=os.cpu_count() or 1)[0]
    tokens = {"per turn": int(per_turn["attention_mask"].sum()),
              "packed": int(layout.batch["attention_mask"].sum())}
    rows = {"per turn": per_turn["input_ids"].shape[0],
            "packed": layout.batch["input_ids"].shape[0]}
    print(f"model={args.model} episodes={args.episodes} turns={len(samples)} "
          f"loss tokens={int(per_turn['loss_mask'].sum())} packed={layout.metrics} "
          f"budget={args.max_tokens_per_micro_batch} steps={args.steps} "
          f"cpu={platform.processor() or platform.machine()} cores={os.cpu_count()} "
          f"torch={torch.__version__} load={os.getloadavg()[0]:.1f}")
    print("| layout | rows | training tokens | train phase (s/step) | padding fed (actor) |")
    print("|---|---|---|---|---|")
    for name in rows:
        seconds, actor_padding, _ = timing[name]
        print(f"| {name} | {rows[name]} | {tokens[name]} | {seconds:.2f} | {actor_padding:.1%} |")
    print(f"per turn / packed: {tokens['per turn'] / tokens['packed']:.2f}x training tokens, "
          f"{timing['per turn'][0] / timing['packed'][0]:.2f}x train phase time")


if __name__ == "__main__":
    main()
