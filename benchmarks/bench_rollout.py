"""Multi-turn rollout throughput against the engine's raw throughput on the same token load.

  python benchmarks/bench_rollout.py [--env sokoban] [--groups 8] [--group-size 4] [--turns 5]

One SGLang server (CPU way) on a small random Qwen2 checkpoint. First the real rollout
(:func:`ragen_mega.rollout.episode.run_episodes`: every episode its own coroutine, prompts built
through the chat template, env steps, parsing) plays ``groups x group_size`` episodes of up to
``--turns`` turns. Then the same prompts (the recorded prompt ids of every turn) are sent to the
engine as one flat batch of concurrent requests with the same number of new tokens each
(``ignore_eos``): the engine's raw throughput on the identical token load. Ratio = rollout
tokens/s over raw tokens/s; what it loses is the turn-to-turn dependency plus the Python work
between turns (goal: >= 0.9).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", default="sokoban")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from ragen_mega.agent import AgentConfig
    from ragen_mega.backends.sglang.client import AsyncEngineClient
    from ragen_mega.backends.sglang.server import launch_server
    from ragen_mega.models.prepare import make_tiny_model
    from ragen_mega.rollout.episode import Generation, group_specs, run_episodes

    hf_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="bench_rollout_")) / "model", "qwen2",
                             hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                             intermediate_size=384)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    specs = group_specs(args.env, {}, env_groups=args.groups, group_size=args.group_size,
                        first_seed=0)
    sampling = {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    with launch_server(hf_dir, dtype="float32") as server:

        async def run():
            client = AsyncEngineClient(server.url)

            async def generate(ids, params):
                out = await client.generate(ids, params)
                return Generation(out.output_ids, out.output_logprobs, out.finish_reason)

            await generate([1, 2, 3], sampling)  # warm-up
            start = time.perf_counter()
            episodes = await run_episodes(specs, tokenizer=tokenizer,
                                          agent=AgentConfig(think=True), generate=generate,
                                          sampling=sampling, max_turns=args.turns)
            rollout_s = time.perf_counter() - start
            prompts = [s.prompt_ids for e in episodes for s in e.samples]
            start = time.perf_counter()
            raw = await asyncio.gather(*(client.generate(p, sampling) for p in prompts))
            raw_s = time.perf_counter() - start
            await client.close()
            return episodes, rollout_s, raw, raw_s

        episodes, rollout_s, raw, raw_s = asyncio.run(run())
    turns = sum(len(e.samples) for e in episodes)
    rollout_tokens = sum(len(s.response_ids) for e in episodes for s in e.samples)
    raw_tokens = sum(len(c.output_ids) for c in raw)
    row = {"env": args.env, "episodes": len(episodes), "turns": turns,
           "new_tokens_per_turn": args.new_tokens,
           "rollout_s": round(rollout_s, 2), "rollout_tok_per_s": round(rollout_tokens / rollout_s, 1),
           "env_turns_per_s": round(turns / rollout_s, 2),
           "raw_s": round(raw_s, 2), "raw_tok_per_s": round(raw_tokens / raw_s, 1),
           "ratio": round((rollout_tokens / rollout_s) / (raw_tokens / raw_s), 2)}
    print(json.dumps(row))
    print(f"| {args.env}, {len(episodes)} episodes x <= {args.turns} turns ({turns} turns), "
          f"{args.new_tokens} new tok/turn | {row['rollout_tok_per_s']} | {row['raw_tok_per_s']} | "
          f"{row['ratio']} |")


if __name__ == "__main__":
    main()
