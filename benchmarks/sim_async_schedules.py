"""What fully asynchronous training would buy at cluster scale: a simulation of three schedules
on Verlog's Crafter shape, with GPU timings taken from measurements, run on a CPU in seconds.

The schedules (``trainer.async_mode``: off, ``one_step_off``, ``fully``):

- **sync** (colocated, as verl and Verlog run): every GPU plays the step's rollout, then every
  GPU trains, then the engines take the new weights (a colocated sync).
- **one-step-off** (disaggregated): ``engine_gpus`` play step k+1 while the other GPUs train
  step k; the step is ``max(rollout, train) + sync``.
- **fully async** (disaggregated, ``rollout/fully_async.py``): the engines keep a step's worth
  of jobs in flight (a finished episode or window is followed at once by the next step's),
  pausing only while a sync lands (the requests in flight continue after it: partial
  rollouts); step s's jobs start only while the engines serve version s - 1 -
  ``max_staleness`` or newer, and the trainer takes step s once all of its jobs are in.
  (The project implements this for whole episodes; windows are simulated as the same rule.)

The model (virtual time, no sleeping: 512 GPUs and hundreds of steps run in seconds):

- An engine decodes all its active sequences together; one token for each of ``b`` of them
  takes ``tau0 + tau1 * b`` seconds (memory-bound decode: a bigger batch is almost free until
  the per-sequence term dominates). Sequences share the engine equally (processor sharing), so
  a step's rollout on one engine, whose sequences must generate ``W_i`` tokens each, lasts
  ``sum over s of tau(#{i: W_i >= s})``: the step ends with its longest sequence, and the
  engine runs ever emptier towards that end.
- Training costs ``tokens / (gpus * train_tok_s)`` (actor and critic, forward and backward, and
  the old log-probs' and values' forward, folded into one per-GPU rate), a sync a fixed time.
- Each turn's prompt is prefilled whole (a sliding memory window leaves the prefix cache only
  the system prompt), compute-bound, one sequence after another. Env steps and request
  overheads are left out; every engine gets an equal share of the streams.

Workload: ``--mode turns`` is this project's streamed steps (``rollout.mode: turns``, the
Crafter 7B config: each of 16 streams per GPU plays 16 turns a step, an episode that ends is
followed by the stream's next); ``--mode episodes`` plays whole episodes (70 to 400 turns), as a
non-streamed run does. Each schedule's engine/trainer split is the best of a grid (a user would
tune it). Prints one table row per GPU count and schedule: seconds per step, trained turns per
second, the ratio to sync, and for fully async the mean and max staleness of the trained jobs'
first tokens.

    python benchmarks/sim_async_schedules.py [--mode turns|episodes] [--gpus 8 64 512]
"""
from __future__ import annotations

import argparse
import collections
import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Timings:
    """One GPU's costs (defaults: Qwen2.5-7B in bf16 on an H100-class GPU; see the README)."""
    tau0: float = 0.0065      # s per decode step of one sequence (~150 tok/s alone)
    tau1: float = 0.000085    # s added per sequence in the batch (~9k tok/s at 256)
    prefill_tok_s: float = 20000.0  # prompt tokens per s (compute-bound: one at a time)
    train_tok_s: float = 2300.0   # trained tokens per s per GPU, actor + critic, with the
    #                               old log-probs' and values' forward
    sync_s: float = 3.0       # a disaggregated sync (14.5 GiB over the network)
    colocated_sync_s: float = 1.0

    def tau(self, b: np.ndarray | int) -> np.ndarray | float:
        return self.tau0 + self.tau1 * b


@dataclass(frozen=True)
class Shape:
    """The workload, per GPU (weak scaling: the batch grows with the cluster)."""
    streams_per_gpu: int = 16
    turns_per_step: int = 16      # turns mode
    episodes_per_gpu: int = 16    # episodes mode
    min_turns: int = 70
    max_turns: int = 400
    response_mean: float = 150.0  # tokens a turn (Verlog: ~70 words of reasoning and an action)
    response_max: int = 512
    prompt_tokens: int = 1500     # trained context a turn (a 2-turn memory window)


def response_tokens(rng: np.random.Generator, shape: Shape, n) -> np.ndarray:
    """Tokens of ``n`` turns' responses: lognormal around the mean, cut at the maximum."""
    sigma = 0.6
    mu = np.log(shape.response_mean) - sigma ** 2 / 2
    return np.clip(rng.lognormal(mu, sigma, n).astype(int), 8, shape.response_max)


def episode_turns(rng: np.random.Generator, shape: Shape, n: int) -> np.ndarray:
    """Crafter episode lengths: most agents die young, some survive to the cap (a geometric
    tail above the minimum, cut at ``max_turns``: mean about 190 turns, Verlog's average)."""
    extra = rng.geometric(1 / 135, n)
    return np.minimum(shape.min_turns + extra, shape.max_turns)


def shared_rollout_s(work: np.ndarray, turns: np.ndarray, shape: Shape, t: Timings) -> float:
    """Seconds for one engine to generate ``work[i]`` tokens for each of its sequences, all
    started together and sharing it equally (the longest one decides), and to prefill each
    turn's prompt."""
    counts = np.bincount(work)
    active = counts[::-1].cumsum()[::-1][1:]   # active[s-1]: sequences with >= s tokens
    return float(t.tau(active).sum()) + turns.sum() * shape.prompt_tokens / t.prefill_tok_s


def job_work(rng, shape: Shape, mode: str, jobs: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens to generate, turns) of each job: a stream's window of turns, or an episode."""
    turns = (np.full(jobs, shape.turns_per_step) if mode == "turns"
             else episode_turns(rng, shape, jobs))
    per_turn = response_tokens(rng, shape, int(turns.sum()))
    work = np.add.reduceat(per_turn, np.concatenate(([0], turns.cumsum()[:-1])))
    return work, turns


def step_rollout(rng, shape: Shape, t: Timings, mode: str, engines: int, per_engine: int):
    """One step's rollout on ``engines`` engines of ``per_engine`` jobs each: (seconds, turns,
    trained tokens)."""
    seconds, turns_all, tokens = 0.0, 0, 0
    for _ in range(engines):
        work, turns = job_work(rng, shape, mode, per_engine)
        seconds = max(seconds, shared_rollout_s(work, turns, shape, t))
        turns_all += int(turns.sum())
        tokens += int(work.sum() + turns.sum() * shape.prompt_tokens)
    return seconds, turns_all, tokens


def simulate_stepped(gpus: int, engine_gpus: int | None, shape: Shape, t: Timings, mode: str,
                     steps: int, seed: int) -> dict:
    """sync (``engine_gpus`` None: every GPU does both) or one-step-off (step k trains while
    step k+1 plays: ``max(rollout of k+1, train of k) + sync``; a long rollout's step is also a
    long training, so pairing a step's training with its own rollout would hide the wait)."""
    rng = np.random.default_rng(seed)
    jobs = gpus * (shape.streams_per_gpu if mode == "turns" else shape.episodes_per_gpu)
    engines = engine_gpus or gpus
    train_gpus = gpus if engine_gpus is None else gpus - engine_gpus
    played = [step_rollout(rng, shape, t, mode, engines, jobs // engines)
              for _ in range(steps + 1)]
    total_s = total_turns = 0.0
    for (rollout_s, turns, tokens), (next_rollout_s, _, _) in zip(played, played[1:]):
        train_s = tokens / (train_gpus * t.train_tok_s)
        total_s += (rollout_s + train_s + t.colocated_sync_s if engine_gpus is None
                    else max(next_rollout_s, train_s) + t.sync_s)
        total_turns += turns
    return {"step_s": total_s / steps, "turns_s": total_turns / total_s}


def simulate_fully_async(gpus: int, engine_gpus: int, shape: Shape, t: Timings, mode: str,
                         steps: int, max_staleness: int, seed: int, take: str = "own") -> dict:
    """A fully asynchronous schedule, an event simulation in virtual time: at most one step's
    worth of jobs run at once (the slots), and the j-th job to start (of step
    ``j // batch + 1``) starts only while the engines serve version ``j // batch -
    max_staleness`` or newer.
    ``take="own"`` is ``rollout/fully_async.py``: the trainer takes step s once all of step s's
    jobs are in. ``take="first"`` is AReaL's: it takes the first ``batch`` jobs to finish,
    whatever step they were started for, after dropping those whose first token is more than
    ``max_staleness`` versions old. The jobs in flight share the engines equally, as in the
    stepped schedules, so one clock of tokens-per-job stands for every engine; a sync stops
    that clock for its length."""
    rng = np.random.default_rng(seed)
    per_gpu = shape.streams_per_gpu if mode == "turns" else shape.episodes_per_gpu
    batch = gpus * per_gpu                      # jobs per trained step, as in the other modes
    train_gpus = gpus - engine_gpus

    def sec_per_token() -> float:
        """Seconds for every job in flight to advance one token: a decode step of the engine's
        share of them, and their prompts' prefill (one per response's worth of tokens)."""
        per_engine = max(len(events), 1) / engine_gpus
        prefill = per_engine * shape.prompt_tokens / shape.response_mean / t.prefill_tok_s
        return float(t.tau(per_engine)) + prefill

    progress, now, version, started, free_slots = 0.0, 0.0, 0, 0, batch
    events: list = []                           # (done at progress, job, start version, ...)
    done = collections.defaultdict(list)       # step -> (start version, turns, tokens)
    buffer: list = []                           # take="first": finished, in order
    train_end, sync_times, lags, trained, dropped, played = None, [], [], [], 0, []

    def start_jobs() -> None:
        nonlocal started, free_slots
        while free_slots and started // batch - max_staleness <= version:  # the admission
            work, turns = job_work(rng, shape, mode, 1)
            heapq.heappush(events, (progress + int(work[0]), started, version, int(turns[0]),
                                    int(work[0] + turns[0] * shape.prompt_tokens)))
            started, free_slots = started + 1, free_slots - 1

    def next_batch() -> list | None:
        nonlocal buffer, dropped
        if take == "own":
            own = done[len(trained) + 1]
            return own if len(own) == batch else None
        dropped += sum(x[1] for x in buffer if version - x[0] > max_staleness)
        buffer = [x for x in buffer if version - x[0] <= max_staleness]
        if len(buffer) < batch:
            return None
        taken, buffer = buffer[:batch], buffer[batch:]
        return taken

    start_jobs()
    while len(sync_times) < steps:
        rate = sec_per_token()
        next_job = now + (events[0][0] - progress) * rate if events else float("inf")
        if train_end is not None and train_end <= next_job:
            progress += (train_end - now) / rate
            now = train_end + t.sync_s            # the engines pause while the sync lands
            version, train_end = version + 1, None
            sync_times.append(now)
        else:
            done_at, job, start_version, turns, tokens = heapq.heappop(events)
            progress, now, free_slots = done_at, next_job, free_slots + 1
            done[job // batch + 1].append((start_version, turns, tokens))
            buffer.append((start_version, turns, tokens))
            played.append(turns)
        if train_end is None and (jobs := next_batch()) is not None:
            lags += [version - x[0] for x in jobs]
            trained.append(jobs)
            train_end = now + sum(x[2] for x in jobs) / (train_gpus * t.train_tok_s)
        start_jobs()
    warm = steps // 4                              # leave the start-up out of the rates
    span = sync_times[-1] - sync_times[warm - 1]
    turns = sum(x[1] for jobs in trained[warm:steps] for x in jobs)
    trained_turns = [x[1] for jobs in trained for x in jobs]
    return {"step_s": span / (steps - warm), "turns_s": turns / span,
            "staleness_mean": float(np.mean(lags)), "staleness_max": int(max(lags)),
            "dropped": dropped / sum(played),
            "length_bias": float(np.mean(trained_turns) / np.mean(played))}


def best_split(gpus: int, run) -> tuple[int, dict]:
    """The engine share (of 1/8 .. 7/8 of the GPUs) with the most trained turns a second."""
    options = sorted({max(1, min(gpus - 1, round(gpus * f / 8))) for f in range(1, 8)})
    results = [(engine_gpus, run(engine_gpus)) for engine_gpus in options]
    return max(results, key=lambda r: r[1]["turns_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("turns", "episodes"), default="turns")
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--response-mean", type=float, default=Shape.response_mean,
                        help="tokens a turn's response has on average")
    parser.add_argument("--response-max", type=int, default=Shape.response_max)
    args = parser.parse_args()
    shape = Shape(response_mean=args.response_mean, response_max=args.response_max)
    t = Timings()
    print(f"# mode {args.mode}, {shape}, {t}, max_staleness {args.max_staleness}")
    print("| GPUs | schedule | engine GPUs | s / step | trained turns / s | vs sync | "
          "staleness mean (max) | turns dropped | trained / played episode length |")
    print("|---|---|---|---|---|---|---|---|---|")
    for gpus in args.gpus:
        sync = simulate_stepped(gpus, None, shape, t, args.mode, args.steps, args.seed)
        rows = [("sync (colocated)", gpus, sync)]
        rows.append(("one-step-off", *best_split(gpus, lambda e: simulate_stepped(
            gpus, e, shape, t, args.mode, args.steps, args.seed))))
        for take, name in (("own", "fully async"), ("first", "fully async, first finished")):
            rows.append((name, *best_split(gpus, lambda e: simulate_fully_async(
                gpus, e, shape, t, args.mode, args.steps, args.max_staleness, args.seed,
                take))))
        for name, engine_gpus, r in rows:
            extra = (f"{r['staleness_mean']:.2f} ({r['staleness_max']}) | {r['dropped']:.1%} | "
                     f"{r['length_bias']:.2f}" if "staleness_max" in r else "- | - | -")
            print(f"| {gpus} | {name} | {engine_gpus} | {r['step_s']:.0f} | {r['turns_s']:.1f} | "
                  f"{r['turns_s'] / sync['turns_s']:.2f} | {extra} |", flush=True)


if __name__ == "__main__":
    main()
