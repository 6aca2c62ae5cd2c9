"""Episodes per second of a small model's RL step: the whole stack against one plain process.

The stack: ``ragen-mega train CONFIG`` (SGLang engine, Megatron trainer, the weight sync every
step, Ray) for ``--steps`` steps with evaluation and checkpoints off. A step's time is
``time/rollout_s + time/step_s`` from its ``metrics.jsonl``; the other ``time/*`` scalars say
where it went.

The reference: the loop one would write in a single process on the same model, env, prompts and
batch shape: transformers ``generate`` per turn for all live episodes at once (left-padded, KV
cache within the turn), the env stepped in the loop, episode return minus its group's mean, the
same StarPO-S filter ratio (groups by reward std), then one AdamW step of the policy gradient
over the kept episodes (``actor.loss_agg_mode``: token-mean, or episode-mean-token-mean), each
packed as one row when the whole chat is shown (its last prompt and response, loss on every
response) or one row per turn under a memory window (``agent.memory_turns``), in micro-batches of
``actor.micro_batch_size``. No engine, no Ray, no sync: what the stack's machinery costs is the
gap.

Both use ``--model`` (default ``textgame-small``, random weights: responses run to
``max_new_tokens`` and episodes to ``env.max_turns`` almost always, so both sides do the same,
fixed work). The number is the median over steps 2.. (step 1 warms caches up) of the episodes a
step plays over its seconds; the ratio is the stack's over the reference's, both in one run.

    python benchmarks/bench_small_model_step.py [--config examples/frozen_lake_small_model_cpu.yaml]
        [--model textgame-small] [--steps 6] [--out runs/bench_small_model] [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

CONFIG = "examples/frozen_lake_small_model_cpu.yaml"
STACK_PHASES = ("time/rollout_s", "time/old_logprobs_s", "time/actor_update_s", "time/sync_s")


def run_stack(config: str, model: str, steps: int, run_dir: Path, extra: list[str],
              python_args: tuple[str, ...] = ("-m", "ragen_mega.cli"),
              extra_keys: tuple[str, ...] = ()) -> dict:
    """``ragen-mega train`` for ``steps`` steps (``python_args``: how Python starts the CLI);
    the medians of its step time, its phases and the metrics ``extra_keys``."""
    cmd = [sys.executable, *python_args, "train", config, f"model.path={model}",
           f"trainer.total_steps={steps}", f"trainer.run_dir={run_dir}", "trainer.eval_every=0",
           "trainer.save_every=0", *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = history[1:]
    out = {"step_s": statistics.median(h["time/rollout_s"] + h["time/step_s"] for h in later),
           "tokens": statistics.median(h["train/batch_tokens"] for h in later)}
    for key in (*STACK_PHASES, *extra_keys):
        if all(key in h for h in later):
            out[key] = statistics.median(h[key] for h in later)
    return out


class ReferenceLoop:
    """The single-process loop (module docstring) for a run config."""

    def __init__(self, cfg, model_dir: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(os.cpu_count() or 1)
        torch.manual_seed(cfg.trainer.seed)
        self.cfg = cfg
        self.tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.actor.lr,
                                     weight_decay=cfg.actor.weight_decay)

    def step(self, step: int) -> dict[str, float]:
        """Play one step's episodes and train on the kept ones; the phases' seconds."""
        from ragen_mega.agent.memory import History
        from ragen_mega.agent.parse import parse_response
        from ragen_mega.agent.prompt import PromptBuilder
        from ragen_mega.envs.registry import make

        cfg, env_cfg = self.cfg, self.cfg.env
        groups, size = env_cfg.env_groups, env_cfg.group_size
        t0 = time.perf_counter()
        envs = [make(env_cfg.name, **env_cfg.kwargs) for _ in range(groups * size)]
        builder = PromptBuilder.for_env(self.tok, cfg.agent, envs[0])
        histories = [History() for _ in envs]
        observations = [env.reset(step * groups + i // size) for i, env in enumerate(envs)]
        returns = [0.0] * len(envs)
        turns = [[] for _ in envs]   # (prompt, response ids) of each episode's turns
        live = list(range(len(envs)))
        generate_s = 0.0
        for _ in range(env_cfg.max_turns):
            if not live:
                break
            prompts = []
            for i in live:
                histories[i].observe(observations[i])
                prompts.append(builder.build(histories[i]))
            t = time.perf_counter()
            responses = self._generate([p.ids for p in prompts])
            generate_s += time.perf_counter() - t
            still = []
            for i, prompt, ids in zip(live, prompts, responses):
                finished = self.tok.eos_token_id in ids
                parsed = parse_response(self.tok.decode(ids, skip_special_tokens=True),
                                        cfg.agent, finished=finished)
                reward, done = parsed.penalty, False
                for action in parsed.actions:
                    observations[i], r, done, _ = envs[i].step(action)
                    reward += r
                    if done:
                        break
                histories[i].record(ids, parsed, reward)
                returns[i] += reward
                turns[i].append((prompt, ids))
                if not done:
                    still.append(i)
            live = still
        t1 = time.perf_counter()
        kept = self._kept(returns, groups, size)
        tokens = self._train(kept, returns, turns, groups, size)
        t2 = time.perf_counter()
        return {"step_s": t2 - t0, "generate_s": generate_s, "train_s": t2 - t1,
                "tokens": tokens}

    def _generate(self, prompts: list[list[int]]) -> list[list[int]]:
        pad = self.tok.pad_token_id
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True,
                temperature=self.cfg.rollout.temperature, top_p=self.cfg.rollout.top_p, top_k=0,
                max_new_tokens=self.cfg.rollout.max_new_tokens, pad_token_id=pad,
                eos_token_id=self.tok.eos_token_id)
        responses = []
        for row in out[:, width:].tolist():
            end = row.index(self.tok.eos_token_id) + 1 if self.tok.eos_token_id in row else len(row)
            responses.append(row[:end])
        return responses

    def _kept(self, returns: list[float], groups: int, size: int) -> list[int]:
        """Episode indices of the groups the StarPO-S filter keeps (highest return std)."""
        stds = [statistics.pstdev(returns[g * size:(g + 1) * size]) for g in range(groups)]
        keep = max(1, int(round(groups * self.cfg.filter.ratio)))
        best = sorted(range(groups), key=lambda g: -stds[g])[:keep]
        return [g * size + k for g in sorted(best) for k in range(size)]

    def _train(self, kept: list[int], returns: list[float], turns: list, groups: int,
               size: int) -> int:
        """One AdamW step of the policy gradient over ``kept``; its token count."""
        packed = self.cfg.agent.memory_turns is None
        per_episode = self.cfg.actor.loss_agg_mode == "episode-mean-token-mean"
        rows, masks, advantages = [], [], []
        for i in kept:
            g = i // size
            advantage = returns[i] - statistics.fmean(returns[g * size:(g + 1) * size])
            episode_rows = []
            for prompt, response in (turns[i][-1:] if packed else turns[i]):
                ids = list(prompt.ids) + list(response)
                mask = [0] * len(ids)
                for start, end in [*prompt.response_spans, (len(prompt.ids), len(ids))]:
                    mask[start:end] = [1] * (end - start)
                episode_rows.append((ids, mask))
            weight = 1 / max(1, sum(sum(m) for _, m in episode_rows)) if per_episode else 1
            for ids, mask in episode_rows:
                rows.append(ids)
                masks.append([weight * m for m in mask])
                advantages.append(advantage)
        total = sum(map(sum, masks))
        micro = self.cfg.actor.micro_batch_size
        self.opt.zero_grad()
        for k in range(0, len(rows), micro):
            chunk = range(k, min(k + micro, len(rows)))
            width = max(len(rows[j]) for j in chunk)
            ids = torch.tensor([rows[j] + [self.tok.pad_token_id] * (width - len(rows[j]))
                                for j in chunk])
            mask = torch.tensor([masks[j] + [0] * (width - len(masks[j])) for j in chunk],
                                dtype=torch.float32)
            attention = torch.tensor([[1] * len(rows[j]) + [0] * (width - len(rows[j]))
                                      for j in chunk])
            logits = self.model(input_ids=ids, attention_mask=attention).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            adv = torch.tensor([advantages[j] for j in chunk])[:, None]
            loss = -(adv * logp * mask[:, 1:]).sum() / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.actor.grad_clip)
        self.opt.step()
        return sum(len(r) for r in rows)


def run_reference(cfg, model_dir: str, steps: int) -> dict:
    loop = ReferenceLoop(cfg, model_dir)
    history = []
    for step in range(1, steps + 1):
        history.append(loop.step(step))
        print(f"reference step {step}: " + ", ".join(
            f"{k} {v:.2f}" for k, v in history[-1].items()), flush=True)
    return {k: statistics.median(h[k] for h in history[1:]) for k in history[0]}


def main() -> None:
    from ragen_mega.config import load_run_config
    from ragen_mega.models.prepare import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--model", default="textgame-small",
                        help="model.path for both sides (default: %(default)s, random weights)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="runs/bench_small_model")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for both sides")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the medians start at step 2)")
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"{out} exists: pick another --out (runs are never overwritten)")
    model_dir = resolve_model(args.model)
    cfg = load_run_config(args.config, [f"model.path={model_dir}", *args.overrides])
    episodes = cfg.env.env_groups * cfg.env.group_size
    print(f"# {platform.node()} {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
          f", torch {torch.__version__}; {args.config} {' '.join(args.overrides)}; {episodes} "
          f"episodes a step, {args.steps} steps each", flush=True)
    stack = run_stack(args.config, model_dir, args.steps, out / "stack", args.overrides)
    reference = run_reference(cfg, model_dir, args.steps)
    rate = {"stack": episodes / stack["step_s"], "reference": episodes / reference["step_s"]}
    print("\n| side | s/step | episodes/s | trained tokens | phases (s, medians) |\n|---|---|---|---|---|")
    print(f"| stack | {stack['step_s']:.2f} | {rate['stack']:.1f} | {stack['tokens']:.0f} | " +
          ", ".join(f"{k.removeprefix('time/').removesuffix('_s')} {stack[k]:.2f}"
                    for k in STACK_PHASES if k in stack) + " |")
    print(f"| reference | {reference['step_s']:.2f} | {rate['reference']:.1f} | "
          f"{reference['tokens']:.0f} | generate {reference['generate_s']:.2f}, "
          f"train {reference['train_s']:.2f} |")
    print(f"\nstack / reference episodes per second: {rate['stack'] / rate['reference']:.2f}x")


if __name__ == "__main__":
    main()
