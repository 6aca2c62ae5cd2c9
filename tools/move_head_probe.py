"""Can this model learn to read this env's board from reward at all? A probe outside the stack.

The policy is a 4-way move head on a causal LM: the LM's logits of the env's move tokens at the
prompt's last position, sampled, so no answer format can break and nothing but the choice of
move is trained. REINFORCE with the group mean as the baseline, every episode weighted alike,
Adam, ``--groups`` x ``--group-size`` episodes a step, all trained; greedy success on 64
held-out maps every 20 steps. It separates "the model and prompt cannot learn this" from "the
RL setup or the stack keeps it from learning" (docs/results.md, "A small model from scratch").

The prompt is the run config's (``agent`` section: ``memory_turns``, ``instructions``), built by
the stack's own PromptBuilder, or with ``--observation-only`` the env's observation text alone.

    python tools/move_head_probe.py CONFIG --model DIR --out probe.jsonl [--steps 400]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_mega.agent.memory import History
    from ragen_mega.agent.parse import ParsedResponse
    from ragen_mega.agent.prompt import PromptBuilder
    from ragen_mega.config import load_run_config
    from ragen_mega.envs.registry import make

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--out", required=True, help="JSONL of the steps and held-out scores")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--observation-only", action="store_true",
                        help="the observation text and <answer>, no chat around it")
    args = parser.parse_args()
    cfg = load_run_config(args.config, [])
    torch.manual_seed(cfg.trainer.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    moves = list(make(cfg.env.name, **cfg.env.kwargs).valid_actions)
    move_ids = torch.tensor([tok.encode(" " + m, add_special_tokens=False)[0] for m in moves])

    def prompt(builder, history, observation):
        if args.observation_only:
            return tok.encode(observation + "\n<answer>", add_special_tokens=False)
        history.observe(observation)
        return builder.build(history).ids

    def move_logits(prompts):
        width, pad = max(map(len, prompts)), tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        hidden = model.model(input_ids=ids, attention_mask=attention,
                             position_ids=positions).last_hidden_state[:, -1]
        return hidden @ model.lm_head.weight[move_ids].T

    def play(seeds, greedy):
        envs = [make(cfg.env.name, **cfg.env.kwargs) for _ in seeds]
        builder = PromptBuilder.for_env(tok, cfg.agent, envs[0])
        histories = [History() for _ in envs]
        observations = [env.reset(seed) for env, seed in zip(envs, seeds)]
        returns, turns, live = [0.0] * len(envs), [[] for _ in envs], list(range(len(envs)))
        for _ in range(cfg.env.max_turns):
            if not live:
                break
            prompts = [prompt(builder, histories[i], observations[i]) for i in live]
            with torch.no_grad():
                logits = move_logits(prompts)
            picks = (logits.argmax(-1) if greedy
                     else torch.distributions.Categorical(logits=logits).sample()).tolist()
            still = []
            for i, p, k in zip(live, prompts, picks):
                observations[i], reward, done, _ = envs[i].step(moves[k])
                returns[i] += reward
                turns[i].append((p, k))
                if not args.observation_only:
                    answer = tok.encode(f" {moves[k]} </answer>", add_special_tokens=False)
                    histories[i].record(answer, ParsedResponse(actions=[moves[k]], format_ok=True),
                                        reward)
                if not done:
                    still.append(i)
            live = still
        return returns, turns

    held_out = list(range(10**6, 10**6 + 64))
    size, batch = args.group_size, args.groups * args.group_size
    with open(args.out, "w") as out:
        for step in range(args.steps + 1):
            if step % 20 == 0:
                returns, _ = play(held_out, greedy=True)
                record = {"step": step, "val_greedy": sum(r > 0 for r in returns) / 64}
                out.write(json.dumps(record) + "\n")
                print(record, flush=True)
            if step == args.steps:
                break
            returns, turns = play([(step + 1) * 1000 + i // size for i in range(batch)], False)
            rows, weights = [], []
            for i in range(batch):
                group = returns[i // size * size:(i // size + 1) * size]
                advantage = returns[i] - statistics.fmean(group)
                rows += turns[i]
                weights += [advantage / len(turns[i])] * len(turns[i])
            opt.zero_grad()
            logp = torch.log_softmax(move_logits([p for p, _ in rows]), -1)
            chosen = logp.gather(-1, torch.tensor([[k] for _, k in rows]))[:, 0]
            (-(torch.tensor(weights) * chosen).sum() / batch).backward()
            opt.step()
            out.write(json.dumps({"step": step + 1, "success": sum(r > 0 for r in returns) / batch})
                      + "\n")


if __name__ == "__main__":
    main()
