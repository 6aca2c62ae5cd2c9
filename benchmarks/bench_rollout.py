"""Multi-turn rollout throughput against the engine's raw throughput on the same token load.

  python benchmarks/bench_rollout.py [--env sokoban] [--groups 8] [--group-size 4] [--turns 5]
  python benchmarks/bench_rollout.py --horizon [--turns 200] [--memory-turns 2] [--context 4096]
  python benchmarks/bench_rollout.py --streamed [--steps 3] [--turn-limits 4,8,16] [--model tiny]

One SGLang server (CPU way, ``--cpu-threads`` for its torch) on a small random Qwen2 checkpoint,
with seeded sampling as the driver uses it (``rollout.seeded``): every request carries the seed
of its (episode, turn), so every phase samples the very same responses. Phases:

- **rollout**: the driver's path (``RolloutManager.episodes``: every episode its own ``run_episode``
  coroutine with its own seeded generate function, all gathered; chat-template prompts as token
  ids, parsing, env steps). Its prompts (every turn's ``prompt_ids``) are the token load of the
  other phases.
- **raw_cached**: right after the rollout, all its prompts at once, with the KV the rollout
  computed still in the radix cache: decode only (how the first version of this benchmark
  measured "raw", which made 0.82).
- **chained**: each episode's turn k+1 sent the moment its turn k returns, no Python work
  between: the turn dependency alone, without our overhead.
- **waves**: turn by turn with a barrier (all turn-k prompts at once, then turn k+1).
- **raw**: all prompts at once, one flat batch of concurrent requests, cache empty: the
  engine's raw throughput. Ratio = rollout tokens/s over raw tokens/s (goal >= 0.9).

An untimed rollout first warms up both sides and records the prompts. The radix (prefix) cache
is flushed before every phase but raw_cached. Every request asks the
same ``--new-tokens`` (``ignore_eos``), so the tokens are equal and the ratios are ratios of wall
times. Per phase: the time-weighted mean number of requests in flight, the prompt tokens the
engine had to prefill (``prompt_tokens - cached_tokens``), the client process's CPU seconds and
the 1-minute load average at its start; for the rollout also the gap between a turn's answer and
the episode's next request (prompt building, parsing, env step, event-loop latency). ``rollout /
chained`` is our overhead, ``chained / raw`` the turn dependency. ``--rounds`` repeats all
phases in a rotated order (the machine's load drifts; the ratios are taken within a round).

``--horizon`` measures something else on the same machinery: the per-turn cost of ONE long
episode as it ages (one ``run_episode`` over the real engine, ``--model smollm2`` by default,
Crafter, answer-only, one action a turn, ``--new-tokens`` per turn with ``ignore_eos`` so every
turn decodes the same), twice: with a bounded memory window (``--memory-turns``, what the
long-horizon configs and streamed training use) and with the whole chat (unbounded memory,
RAGEN's growing prompt), each with the same seed and sampling seeds. Per-turn cost is the
engine round trip of each turn (send to answer) averaged over 10 turns around turn 10 and
around the last turn; the whole chat stops at the turn whose prompt no longer fits the context
(``--context``, default: the model's ``max_position_embeddings``, minus the new tokens).

``--streamed`` compares the two rollout modes on one load whose episode lengths vary: Sokoban
episodes in three tags with turn limits ``--turn-limits`` (4, 8, 16 by default: the random
model never solves a puzzle, so each plays to its limit, and the longest is 4x the shortest),
``--groups`` groups of ``--group-size`` per tag. Episodes mode is ``RolloutManager.episodes``'s shape (all of
a step's episodes at once, the step over when its longest is); streamed mode is
``EnvStreams.play_window`` with ``turns_per_step`` = the episodes-mode turns per step / streams, rounded
down, so both modes play about as many turns a step. ``--steps`` steps each, after an untimed
one, alternating modes; per mode turns/s, the engine's time-weighted mean requests in flight and
seconds per step. Rollout only (no training between steps). ``--model`` picks the engine's
model (tiny by default; ``smollm2`` is ~10x dearer per token and gains more from batching).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path


def in_flight_mean(spans: list[tuple[float, float]]) -> float:
    """Time-weighted mean number of requests open over the phase (first send to last answer)."""
    start, end = min(s for s, _ in spans), max(e for _, e in spans)
    return sum(e - s for s, e in spans) / (end - start)


def wave_spread(spans: dict[int, list[tuple[float, float]]]) -> float:
    """Mean over turns k of how far apart the episodes' turn-k requests were sent (seconds): how
    tightly the engine gets each wave of a turn-dependent load."""
    spreads = []
    for wave in itertools.zip_longest(*spans.values()):
        sent = [span[0] for span in wave if span is not None]
        spreads.append(max(sent) - min(sent))
    return statistics.mean(spreads)


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


class Timed:
    """Generation of turn ``turn`` (1-based) of episode ``episode`` with the seed the driver's
    seeded rollout gives it (``request_seed``), so every phase samples the same responses; logs
    (send, answer) times per episode and the prompt tokens the engine had to prefill (its
    ``prompt_tokens - cached_tokens``)."""

    def __init__(self, client, sampling, request_seed):
        self.client, self.sampling, self.request_seed = client, sampling, request_seed
        self.reset()

    def reset(self) -> None:
        self.spans: dict[int, list[tuple[float, float]]] = {}
        self.prompt_lengths: dict[int, list[int]] = {}
        self.prefilled = 0

    async def __call__(self, episode: int, turn: int, prompt_ids: list[int]):
        params = {**self.sampling, "sampling_seed": self.request_seed("bench", episode, turn)}
        sent = time.perf_counter()
        out = await self.client.generate(prompt_ids, params)
        self.spans.setdefault(episode, []).append((sent, time.perf_counter()))
        self.prompt_lengths.setdefault(episode, []).append(len(prompt_ids))
        self.prefilled += out.prompt_tokens - int(out.meta_info.get("cached_tokens", 0))
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", default="sokoban")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="the server's OMP_NUM_THREADS; 0: torch's default (one per core)")
    parser.add_argument("--horizon", action="store_true",
                        help="per-turn cost of one long episode, memory window vs whole chat")
    parser.add_argument("--model", choices=["smollm2", "tiny"], default=None,
                        help="--horizon (default smollm2), --streamed (default tiny)")
    parser.add_argument("--memory-turns", type=int, default=2)
    parser.add_argument("--context", type=int, default=0,
                        help="--horizon: context limit in tokens; 0: the model's own")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--streamed", action="store_true",
                        help="streamed (turns) vs episodes mode on episodes of varied lengths")
    parser.add_argument("--steps", type=int, default=3, help="--streamed: timed steps per mode")
    parser.add_argument("--turn-limits", default="4,8,16",
                        help="--streamed: turn limit of each tag's episodes")
    args = parser.parse_args()
    if args.horizon:
        args.model = args.model or "smollm2"
        horizon(args)
        return
    if args.streamed:
        args.model = args.model or "tiny"
        streamed(args)
        return

    from transformers import AutoTokenizer

    from ragen_mega.agent import AgentConfig
    from ragen_mega.backends.sglang.client import AsyncEngineClient
    from ragen_mega.backends.sglang.server import launch_server
    from ragen_mega.rollout.seeding import request_seed
    from ragen_mega.rollout.types import Generation
    from ragen_mega.rollout.seeding import group_specs
    from ragen_mega.rollout.episode import run_episode

    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        hf_dir = bench_model(args.model or "tiny", tmp)
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        specs = group_specs(args.env, {}, env_groups=args.groups, group_size=args.group_size,
                            first_seed=0)
        sampling = {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
        agent = AgentConfig(think=True)
        with launch_server(hf_dir, dtype="float32", cpu_threads=args.cpu_threads or None,
                           seeded_sampling=True) as server:

            async def run():
                client = AsyncEngineClient(server.url)
                timed = Timed(client, sampling, request_seed)

                async def phase(name, play, flush=True):
                    if flush:
                        await client.flush_cache()
                    timed.reset()
                    load, cpu, start = loadavg(), time.process_time(), time.perf_counter()
                    await play()
                    rounds[-1][name] = {"s": time.perf_counter() - start,
                                        "cpu_s": time.process_time() - cpu, "load": load,
                                        "spans": timed.spans, "prefilled": timed.prefilled}

                def episode_generate(episode):  # Run.episode_generate + EngineGroup.generate
                    turns = itertools.count(1)

                    async def generate(ids, params):
                        out = await timed(episode, next(turns), ids)
                        return Generation(out.output_ids, out.output_logprobs, out.finish_reason)
                    return generate

                async def rollout():  # RolloutManager.episodes' shape: one generate function per episode
                    episodes.append(list(await asyncio.gather(*(run_episode(
                        spec, tokenizer=tokenizer, agent=agent,
                        generate=episode_generate(spec.episode_id), sampling=sampling,
                        max_turns=args.turns) for spec in specs))))
                    prompts.update({e.samples[0].episode_id: [s.prompt_ids for s in e.samples]
                                    for e in episodes[-1]})

                async def chain(i):
                    for k, p in enumerate(prompts[i], 1):
                        await timed(i, k, p)

                async def chained():
                    await asyncio.gather(*(chain(i) for i in prompts))

                async def waves():
                    for k in range(1, max(len(p) for p in prompts.values()) + 1):
                        await asyncio.gather(*(timed(i, k, p[k - 1]) for i, p in prompts.items()
                                               if k <= len(p)))

                async def raw():
                    await asyncio.gather(*(timed(i, k, p) for i, ps in prompts.items()
                                           for k, p in enumerate(ps, 1)))

                # One untimed rollout records the prompts and warms up both sides (the engine's
                # first long prompts, the chat template's compilation), so no phase pays that.
                # Rounds rotate the order, so a load that drifts during the run does not always
                # favour the same phase. raw_cached follows the rollout without a flush: its KV
                # is still cached.
                order = [[("rollout", rollout, True), ("raw_cached", raw, False)],
                         [("chained", chained, True)], [("waves", waves, True)],
                         [("raw", raw, True)]]
                episodes, prompts, rounds = [], {}, []
                await rollout()
                for r in range(args.rounds):
                    rounds.append({})
                    for unit in order[r % len(order):] + order[:r % len(order)]:
                        for name, play, flush in unit:
                            await phase(name, play, flush)
                await client.close()
                return episodes, rounds

            episodes, rounds = asyncio.run(run())
    report(args, episodes, rounds)


def bench_model(name: str, tmp: str) -> Path:
    """The HF directory of ``--model``: the real SmolLM2-135M-Instruct or a small random Qwen2
    written into ``tmp``."""
    from ragen_mega.models.prepare import make_tiny_model, resolve_model

    if name == "smollm2":
        return Path(resolve_model("smollm2"))
    return make_tiny_model(Path(tmp) / "model", "qwen2", hidden_size=128, num_layers=4,
                           num_heads=4, num_kv_heads=2, intermediate_size=384)


def horizon(args) -> None:
    """``--horizon``: one episode of ``--turns`` turns with a memory window, then the same
    episode with the whole chat until its prompt outgrows the context; one JSON line each."""
    from transformers import AutoConfig, AutoTokenizer

    from ragen_mega.agent import AgentConfig
    from ragen_mega.backends.sglang.client import AsyncEngineClient
    from ragen_mega.backends.sglang.server import launch_server
    from ragen_mega.rollout.types import EpisodeSpec, Generation
    from ragen_mega.rollout.episode import run_episode
    from ragen_mega.rollout.seeding import request_seed

    with tempfile.TemporaryDirectory(prefix="bench_horizon_") as tmp:
        hf_dir = bench_model(args.model, tmp)
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        model_context = AutoConfig.from_pretrained(hf_dir).max_position_embeddings
        context = args.context or model_context
        if context > model_context:
            raise SystemExit(f"--context {context} is over the model's own context "
                             f"(max_position_embeddings={model_context}): the engine refuses "
                             f"longer prompts")
        sampling = {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
        spec = EpisodeSpec("crafter", {"max_steps": 10_000}, args.seed, 0, 0)
        with launch_server(hf_dir, dtype="float32", cpu_threads=args.cpu_threads or None,
                           seeded_sampling=True) as server:

            async def play(memory_turns):
                agent = AgentConfig(think=False, answer_line=True, max_actions_per_turn=1,
                                    memory_turns=memory_turns, include_thoughts_in_memory=False,
                                    max_prompt_tokens=context - args.new_tokens)
                async with AsyncEngineClient(server.url) as client:
                    await client.flush_cache()
                    timed = Timed(client, sampling, request_seed)
                    turns = itertools.count(1)

                    async def generate(ids, params):
                        out = await timed(0, next(turns), ids)
                        return Generation(out.output_ids, out.output_logprobs, out.finish_reason)

                    stop, load = "max_turns", loadavg()
                    try:
                        episode = await run_episode(spec, tokenizer=tokenizer, agent=agent,
                                                    generate=generate, sampling=sampling,
                                                    max_turns=args.turns,
                                                    env_steps_in_thread=True)
                        if episode.samples[-1].done:
                            stop = "episode ended"
                    except ValueError as e:  # the whole chat's prompt outgrew the context
                        stop = f"context: {str(e)[:120]}"
                spans, lengths = timed.spans[0], timed.prompt_lengths[0]
                seconds = [b - a for a, b in spans]
                early = slice(5, 15)  # turns 6-15: turn 10 without the first turns' warm-up
                late = slice(max(len(seconds) - 10, 15), len(seconds))
                row = {"memory_turns": memory_turns, "turns_played": len(seconds),
                       "stopped_by": stop, "load": load, "context": context,
                       "prompt_tokens_turn_10": lengths[9] if len(lengths) >= 10 else None,
                       "prompt_tokens_last": lengths[-1],
                       "s_per_turn_6_15": round(statistics.mean(seconds[early]), 3),
                       "s_last_turn": round(seconds[-1], 3)}
                if seconds[late]:
                    row[f"s_per_turn_{late.start + 1}_{late.stop}"] = round(
                        statistics.mean(seconds[late]), 3)
                    row["ratio_late_vs_turn_10"] = round(
                        statistics.mean(seconds[late]) / statistics.mean(seconds[early]), 3)
                print(json.dumps(row), flush=True)

            async def run():
                await play(args.memory_turns)
                await play(None)

            asyncio.run(run())


def streamed(args) -> None:
    """``--streamed``: the same varied-length load in episodes mode and in streamed mode; one
    JSON line per mode."""
    from transformers import AutoTokenizer

    from ragen_mega.agent import AgentConfig
    from ragen_mega.backends.sglang.client import AsyncEngineClient
    from ragen_mega.backends.sglang.server import launch_server
    from ragen_mega.rollout.types import Generation
    from ragen_mega.rollout.seeding import EnvPart, train_step_specs
    from ragen_mega.rollout.episode import run_episode
    from ragen_mega.rollout.seeding import request_seed
    from ragen_mega.rollout.streams import EnvStreams

    limits = [int(t) for t in args.turn_limits.split(",")]
    parts = [EnvPart(f"limit_{t}", "sokoban", {}, args.groups, t) for t in limits]
    n_streams = len(limits) * args.groups * args.group_size
    turns_per_step = sum(limits) * args.groups * args.group_size // n_streams
    with tempfile.TemporaryDirectory(prefix="bench_streamed_") as tmp:
        hf_dir = bench_model(args.model, tmp)
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        sampling = {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
        agent = AgentConfig(think=False, answer_line=True, max_actions_per_turn=1,
                            memory_turns=args.memory_turns)
        streams = EnvStreams(parts, group_size=args.group_size, seed=args.seed,
                             turns_per_step=turns_per_step, tokenizer=tokenizer, agent=agent,
                             max_turns=max(limits))
        with launch_server(hf_dir, dtype="float32", cpu_threads=args.cpu_threads or None,
                           seeded_sampling=True) as server:

            async def run():
                client = AsyncEngineClient(server.url)
                timed = Timed(client, sampling, request_seed)

                def generate_for(key):
                    turns = itertools.count(1)

                    async def generate(ids, params):
                        out = await timed(key, next(turns), ids)
                        return Generation(out.output_ids, out.output_logprobs, out.finish_reason)
                    return generate

                async def episodes_step(step):
                    # the driver's steps count from 1; the untimed warm-up is step 0 here
                    specs = train_step_specs(parts, group_size=args.group_size, seed=args.seed,
                                             step=step + 1)
                    played = await asyncio.gather(*(run_episode(
                        spec, tokenizer=tokenizer, agent=agent,
                        generate=generate_for((step, spec.episode_id)), sampling=sampling,
                        max_turns=max(limits)) for spec in specs))
                    return sum(len(e.samples) for e in played)

                async def streamed_step(step):
                    window = await streams.play_window(lambda s: generate_for((step, s)), sampling,
                                                weight_version=step)
                    return len(window.samples)

                modes = {"episodes": episodes_step, "streamed": streamed_step}
                totals = {m: {"turns": 0, "s": 0.0, "in_flight": [], "load": []} for m in modes}
                for mode in modes:  # untimed: warms the engine and both code paths
                    await modes[mode](0)
                for step in range(1, args.steps + 1):
                    for mode in (list(modes) if step % 2 else list(modes)[::-1]):
                        await client.flush_cache()
                        timed.reset()
                        load, start = loadavg(), time.perf_counter()
                        turns = await modes[mode](step)
                        totals[mode]["s"] += time.perf_counter() - start
                        totals[mode]["turns"] += turns
                        totals[mode]["load"].append(load)
                        totals[mode]["in_flight"].append(in_flight_mean(
                            [span for spans in timed.spans.values() for span in spans]))
                await client.close()
                return totals

            totals = asyncio.run(run())
    for mode, t in totals.items():
        print(json.dumps({"mode": mode, "streams_or_episodes": n_streams,
                          "turn_limits": limits, "turns_per_step": turns_per_step
                          if mode == "streamed" else "to the end", "steps": args.steps,
                          "turns": t["turns"], "s": round(t["s"], 2),
                          "turns_per_s": round(t["turns"] / t["s"], 2),
                          "s_per_step": round(t["s"] / args.steps, 2),
                          "mean_in_flight": round(statistics.mean(t["in_flight"]), 2),
                          "load": t["load"]}), flush=True)
    ratio = (totals["streamed"]["turns"] / totals["streamed"]["s"]) / (
        totals["episodes"]["turns"] / totals["episodes"]["s"])
    print(json.dumps({"streamed_vs_episodes_turns_per_s": round(ratio, 3)}), flush=True)


def report(args, episodes, rounds) -> None:
    """One JSON line per round, then the summary: per-round ratios, their median and range."""
    first = episodes[0]
    same = all([s.response_ids for e in eps for s in e.samples] ==
               [s.response_ids for e in first for s in e.samples] for eps in episodes)
    turns = sum(len(e.samples) for e in first)
    tokens = sum(len(s.response_ids) for e in first for s in e.samples)
    ratios = {"ratio": ("raw", "rollout"), "ratio_vs_raw_cached": ("raw_cached", "rollout"),
              "rollout_vs_chained": ("chained", "rollout"), "chained_vs_raw": ("raw", "chained"),
              "waves_vs_raw": ("raw", "waves")}
    for r, phases in enumerate(rounds):
        gaps = [b[0] - a[1] for spans in phases["rollout"]["spans"].values()
                for a, b in zip(spans, spans[1:])]
        row = {"round": r, "rollout_gap_ms_mean": round(1000 * statistics.mean(gaps), 2),
               "rollout_gap_ms_max": round(1000 * max(gaps), 2)}
        for name, p in phases.items():
            row[name] = {"s": round(p["s"], 2), "tok_per_s": round(tokens / p["s"], 1),
                         "in_flight": round(in_flight_mean(
                             [s for spans in p["spans"].values() for s in spans]), 1),
                         "client_cpu_s": round(p["cpu_s"], 2), "prefill_tok": p["prefilled"],
                         "wave_spread_ms": round(1000 * wave_spread(p["spans"]), 1),
                         "load": p["load"]}
        row.update({k: round(phases[a]["s"] / phases[b]["s"], 3) for k, (a, b) in ratios.items()})
        print(json.dumps(row))
    summary = {"env": args.env, "episodes": len(first), "turns": turns,
               "new_tokens_per_turn": args.new_tokens, "cpu_threads": args.cpu_threads,
               "prompt_tokens_mean": round(statistics.mean(len(s.prompt_ids) for e in first
                                                           for s in e.samples)),
               "rollouts_identical": same, "rounds": len(rounds)}
    for name in rounds[0]:
        summary[f"{name}_tok_per_s_median"] = round(statistics.median(
            tokens / ph[name]["s"] for ph in rounds), 1)
    for k, (a, b) in ratios.items():
        values = sorted(ph[a]["s"] / ph[b]["s"] for ph in rounds)
        summary[k] = f"{statistics.median(values):.3f} ({values[0]:.3f}-{values[-1]:.3f})"
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
