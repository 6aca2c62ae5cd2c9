"""Can this model learn to read this env's board from reward at all? A probe outside the stack.

The policy is a 4-way move head on a causal LM: the LM's logits of the env's move tokens at the
prompt's last position, sampled, so no answer format can break and nothing but the choice of
move is trained. REINFORCE with the group mean as the baseline (or ``--estimator gigpo``: the
stack's GiGPO with the config's ``algo.gamma`` and ``algo.grpo_norm_by_std``), every episode
weighted alike, Adam, ``--groups`` x ``--group-size`` episodes a step, all trained; greedy
success on 64 held-out maps every 20 steps. It separates "the model and prompt cannot learn
this" from "the RL setup or the stack keeps it from learning" (docs/results.md, "A small model
from scratch").

``--softmax vocab`` makes the same logits the LM head's policy: the softmax over the whole
vocabulary, an answer that is no move scored as a broken format (``agent.format_penalty``, the
turn spent). ``--sample-moves`` then samples among the moves only (the loss keeps the whole
softmax), ``--untie`` gives the output layer its own copy of the embeddings, and
``--freeze-other-rows`` (with ``--untie``) keeps the output rows of every token but the moves
where they started: the A/B that separates a 4-way policy from the LM head's, one difference at a
time. In ``vocab`` mode each step's record has ``move_mass``, the sampled turns' mean probability
of the four moves, and ``--answer-loss all`` takes the loss on every token of the answer the turn
wrote (`` Up </answer>``, as the engine's stop string leaves it), each episode's tokens averaged:
the stack's ``episode-mean-token-mean`` over its response tokens, where the default trains the
move's token alone.

The prompt is the run config's (``agent`` section: ``memory_turns``, ``instructions``), built by
the stack's own PromptBuilder, or with ``--observation-only`` the env's observation text alone.

``--warm-start-steps N`` first runs a format warm start in this process, on the examples
``ragen-mega sft`` trains on (``sft_data.format_examples``: turn-1 prompts, random valid answers),
with Adam at ``--warm-start-lr``, 64 examples a step, a linear warm-up over the first 20 steps and
the gradient's norm clipped at 1 (as the actor's defaults do): a sweep over warm starts without a
Megatron run for each. ``--warm-start-prompt-loss`` also takes the loss on the prompt's tokens
(the model learns to predict the boards, so its states must carry them). Step 0's record has
``map_spread``: how much the final hidden state at the answer position differs between the 64
held-out boards, as a share of its norm (the format warm start drives it down: it "erases the
board"). ``--device cuda`` runs it on a GPU.

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
    from ragen_mega.algo.gigpo import anchor_groups, gigpo
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
    parser.add_argument("--adam-eps", type=float, default=1e-8)
    parser.add_argument("--seed", type=int, default=None, help="default: trainer.seed")
    parser.add_argument("--estimator", choices=("reinforce", "gigpo"), default="reinforce")
    parser.add_argument("--softmax", choices=("moves", "vocab"), default="moves")
    parser.add_argument("--sample-moves", action="store_true",
                        help="--softmax vocab: sample among the moves, train the whole softmax")
    parser.add_argument("--untie", action="store_true", help="the output layer's own weights")
    parser.add_argument("--freeze-other-rows", action="store_true",
                        help="--untie: no update to the output rows of the non-move tokens")
    parser.add_argument("--observation-only", action="store_true",
                        help="the observation text and <answer>, no chat around it")
    parser.add_argument("--warm-start-steps", type=int, default=0)
    parser.add_argument("--warm-start-lr", type=float, default=3e-4)
    parser.add_argument("--warm-start-prompt-loss", action="store_true",
                        help="the warm start's loss on the prompt's tokens too")
    parser.add_argument("--answer-loss", choices=("move", "all"), default="move",
                        help="--softmax vocab: the loss on the move's token, or on every token "
                             "of the answer as the stack's (each episode's tokens averaged)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.freeze_other_rows and not args.untie:
        parser.error("--freeze-other-rows needs --untie (tied, the rows are the input embeddings)")
    if args.answer_loss == "all" and args.softmax != "vocab":
        parser.error("--answer-loss all needs --softmax vocab (the answer's tokens are the LM's)")
    cfg = load_run_config(args.config, [])
    torch.manual_seed(cfg.trainer.seed if args.seed is None else args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device)
    if args.warm_start_steps:
        warm_start(model, tok, cfg, args)
    if args.untie:
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=args.adam_eps)
    moves = list(make(cfg.env.name, **cfg.env.kwargs).valid_actions)
    move_ids = torch.tensor([tok.encode(" " + m, add_special_tokens=False)[0] for m in moves],
                            device=args.device)
    vocab = args.softmax == "vocab"
    other_rows = torch.ones(model.lm_head.weight.shape[0], dtype=torch.bool, device=args.device)
    other_rows[move_ids] = False

    def prompt(builder, history, observation, turn):
        """Turn ``turn``'s (0-based) prompt ids, as the rollout's EpisodeState builds them (the
        actions left included)."""
        if args.observation_only:
            return tok.encode(observation + "\n<answer>", add_special_tokens=False)
        history.observe(observation, actions_left=(cfg.env.max_turns - turn)
                        * cfg.agent.max_actions_per_turn)
        return builder.build(history).ids

    def final_hidden(prompts):
        """The final hidden state at each prompt's last position (prompts left-padded)."""
        width, pad = max(map(len, prompts)), tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=args.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                                 device=args.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        return model.model(input_ids=ids, attention_mask=attention,
                           position_ids=positions).last_hidden_state[:, -1]

    def move_logits(prompts):
        hidden = final_hidden(prompts)
        return hidden @ (model.lm_head.weight if vocab else model.lm_head.weight[move_ids]).T

    def answer_logprobs(pairs):
        """Each (prompt, answer)'s summed log-probability of the answer's tokens (right-padded
        rows, one forward)."""
        width = max(len(p) + len(a) for p, a in pairs)
        ids = torch.full((len(pairs), width), tok.pad_token_id, device=args.device)
        targets = torch.zeros((len(pairs), width), dtype=torch.bool, device=args.device)
        for row, (p, a) in enumerate(pairs):
            ids[row, :len(p) + len(a)] = torch.tensor(p + a, device=args.device)
            targets[row, len(p):len(p) + len(a)] = True
        attention = (torch.arange(width, device=args.device)[None, :]
                     < torch.tensor([len(p) + len(a) for p, a in pairs],
                                    device=args.device)[:, None]).long()
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits[:, :-1], -1)
        token_logp = logp.gather(-1, ids[:, 1:, None])[..., 0]
        return (token_logp * targets[:, 1:]).sum(-1)

    def map_spread(seeds):
        """Between-board spread of the turn-1 final hidden state, as a share of its norm."""
        env = make(cfg.env.name, **cfg.env.kwargs)
        builder = PromptBuilder.for_env(tok, cfg.agent, env)
        with torch.no_grad():
            hidden = final_hidden([prompt(builder, History(), env.reset(s), 0) for s in seeds])
        return ((hidden - hidden.mean(0)).norm(dim=-1).mean() / hidden.norm(dim=-1).mean()).item()

    def pick(logits, greedy):
        """The sampled (or greedy) column of ``logits``, and the move it is (None: no move)."""
        if vocab and args.sample_moves:
            logits = logits.clone()
            logits[:, other_rows] = -torch.inf
        picks = (logits.argmax(-1) if greedy
                 else torch.distributions.Categorical(logits=logits).sample()).tolist()
        index = move_ids.tolist() if vocab else list(range(len(moves)))
        return [(k, index.index(k) if k in index else None) for k in picks]

    def play(seeds, greedy):
        envs = [make(cfg.env.name, **cfg.env.kwargs) for _ in seeds]
        builder = PromptBuilder.for_env(tok, cfg.agent, envs[0])
        histories = [History() for _ in envs]
        observations = [env.reset(seed) for env, seed in zip(envs, seeds)]
        wins, turns, live = [False] * len(envs), [[] for _ in envs], list(range(len(envs)))
        move_mass = []
        for turn in range(cfg.env.max_turns):
            if not live:
                break
            prompts = [prompt(builder, histories[i], observations[i], turn) for i in live]
            with torch.no_grad():
                logits = move_logits(prompts)
                picks = pick(logits, greedy)
            move_mass += logits.softmax(-1)[:, move_ids].sum(-1).tolist() if vocab else []
            still = []
            for i, p, (k, move) in zip(live, prompts, picks):
                state = envs[i].state_key(observations[i])
                if move is None:  # an answer that is no move: the turn is spent
                    reward, done = cfg.agent.format_penalty, False
                    parsed = ParsedResponse(format_ok=False, penalty=reward)
                else:
                    observations[i], reward, done, info = envs[i].step(moves[move])
                    wins[i] = wins[i] or bool(info.get("success"))
                    parsed = ParsedResponse(actions=[moves[move]], format_ok=True)
                answer = [k] if move is None else tok.encode(f" {moves[move]} </answer>",
                                                             add_special_tokens=False)
                turns[i].append((p, k, reward, state, answer))
                if not args.observation_only:
                    histories[i].record(answer, parsed, reward)
                if not done:
                    still.append(i)
            live = still
        return wins, turns, move_mass

    def advantages(turns):
        """Each turn's advantage, in the order of the batch's turns."""
        rows = [(i, t) for i, episode in enumerate(turns) for t in range(len(episode))]
        rewards = torch.tensor([turns[i][t][2] for i, t in rows])
        groups = torch.tensor([i // size for i, _ in rows])
        if args.estimator == "gigpo":
            steps = anchor_groups([turns[i][t][3] for i, t in rows], groups.tolist())
            return gigpo(rewards, torch.tensor([i for i, _ in rows]), groups,
                         torch.tensor([t + 1 for _, t in rows]), steps, gamma=cfg.algo.gamma,
                         norm_by_std=cfg.algo.grpo_norm_by_std)[0]
        returns = [sum(turn[2] for turn in episode) for episode in turns]
        return torch.tensor([returns[i] - statistics.fmean(returns[i // size * size:
                                                                   (i // size + 1) * size])
                             for i, _ in rows])

    held_out = list(range(10**6, 10**6 + 64))
    size, batch = args.group_size, args.groups * args.group_size
    with open(args.out, "w") as out:
        for step in range(args.steps + 1):
            if step % 20 == 0:
                wins, _, _ = play(held_out, greedy=True)
                record = {"step": step, "val_greedy": sum(wins) / 64}
                if step == 0:
                    record["map_spread"] = round(map_spread(held_out), 5)
                out.write(json.dumps(record) + "\n")
                out.flush()
                print(record, flush=True)
            if step == args.steps:
                break
            seeds = [(step + 1) * 1000 + i // size for i in range(batch)]
            wins, turns, move_mass = play(seeds, greedy=False)
            rows = [turn for episode in turns for turn in episode]
            opt.zero_grad()
            if args.answer_loss == "all":
                weights = advantages(turns) * torch.tensor(
                    [1 / sum(len(t[4]) for t in episode) for episode in turns for _ in episode])
                chosen = answer_logprobs([(p, answer) for p, _, _, _, answer in rows])
            else:
                weights = advantages(turns) * torch.tensor(
                    [1 / len(episode) for episode in turns for _ in episode])
                logp = torch.log_softmax(move_logits([p for p, *_ in rows]), -1)
                chosen = logp.gather(-1, torch.tensor([[k] for _, k, *_ in rows],
                                                      device=args.device))[:, 0]
            (-(weights.to(args.device) * chosen).sum() / batch).backward()
            if args.freeze_other_rows:
                model.lm_head.weight.grad[other_rows] = 0.0
            opt.step()
            record = {"step": step + 1, "success": sum(wins) / batch}
            if vocab:
                record["move_mass"] = statistics.fmean(move_mass)
            out.write(json.dumps(record) + "\n")


def warm_start(model, tok, cfg, args, batch: int = 64, warmup: int = 20) -> None:
    """The format warm start in this process (module docstring): ``args.warm_start_steps``
    steps of ``batch`` fresh examples each, Adam, linear warm-up, grad norm clipped at 1."""
    from ragen_mega.sft_data import collate_examples, format_examples

    examples = format_examples(cfg, tok, args.warm_start_steps * batch, cfg.trainer.seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.warm_start_lr)
    for step in range(args.warm_start_steps):
        for group in opt.param_groups:
            group["lr"] = args.warm_start_lr * min(1.0, (step + 1) / warmup)
        data = {k: v.to(args.device) for k, v in collate_examples(
            examples[step * batch:(step + 1) * batch], tok.pad_token_id).items()}
        logits = model(input_ids=data["input_ids"],
                       attention_mask=data["attention_mask"]).logits[:, :-1]
        mask = (data["attention_mask"].float() if args.warm_start_prompt_loss
                else data["loss_mask"])[:, 1:]
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2),
                                                   data["input_ids"][:, 1:], reduction="none")
        loss = (losses * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.warm_start_steps - 1:
            print({"warm_start_step": step + 1, "loss": round(loss.item(), 4)}, flush=True)


if __name__ == "__main__":
    main()
