"""Bytes of a step's trajectory file, and the viewer's time to open that step, for two shapes:
RAGEN's FrozenLake demo step (16 groups x 8 episodes, up to 6 one-move turns) and a streamed
BabyAI window in Verlog's shape (32 streams x 64 turns, a memory window of 2 turns, reasoning
responses). The envs are real (``ragen_mega.envs``) and played with random valid actions; the
responses are fixed texts of the shape each config writes (a move; a 60-word reasoning plus
the action), so the bytes are those of a real run's records up to what the model writes. The
records go through ``trajectories.episode_records`` and ``write_records`` as in a run, the
replay dump through ``rollout/replay.py``'s ``save_rollout`` (``trainer.save_rollouts``); the
viewer's API (``ragen-mega view``) opens the step through FastAPI's test client, the echo-trap
marks included.

    python benchmarks/bench_trajectory_files.py
"""
from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch


def played(env_name, kwargs, streams, group_size, turns, response, tokenizer, agent, streamed):
    """Samples of ``streams`` envs played ``turns`` turns each with random valid actions, as a
    step's played samples: one episode each, or (``streamed``) a window in which a stream's
    next episode starts when one ends and the last one is cut."""
    from ragen_mega.agent import History, PromptBuilder
    from ragen_mega.agent.parse import ParsedResponse
    from ragen_mega.envs import make
    from ragen_mega.rollout.sample import Sample

    rng = random.Random(0)
    samples, episode = [], 0
    for stream in range(streams):
        env = make(env_name, **kwargs)
        builder = PromptBuilder.for_env(tokenizer, agent, env)
        seed = 1000 + stream // group_size
        obs, history, turn = env.reset(seed), History(), 0
        for _ in range(turns):
            turn += 1
            history.observe(obs, actions_left=None)
            prompt = builder.build(history).ids
            action = rng.choice(list(env.valid_actions))
            text = response.format(action=action)
            ids = tokenizer.encode(text, add_special_tokens=False)
            before = obs
            obs, reward, done, info = env.step(action)
            samples.append(Sample(prompt, ids, [-0.5] * len(ids), float(reward), episode,
                                  stream // group_size, turn, bool(done), bool(done), env_name,
                                  seed, info={"format_ok": True, "finish_reason": "stop",
                                              "example_copy": False,
                                              "steps": [{"action": action, "reward": reward,
                                                         "done": done, "info": dict(info)}]},
                                  stream=stream if streamed else None,
                                  observation=before))
            history.record(ids, ParsedResponse(actions=[action], format_ok=True), reward)
            if done and not streamed:
                break
            if done:
                episode, turn = episode + 1, 0
                obs, history = env.reset(seed), History()
        episode += 1
        if streamed and not samples[-1].done:
            samples[-1].cut = True
    return samples


def measure(name, samples, tokenizer):
    from fastapi.testclient import TestClient

    from ragen_mega import trajectories
    from ragen_mega.rollout.faults import FaultCounters
    from ragen_mega.rollout.manager import PlayedStep
    from ragen_mega.rollout.replay import rollout_file, save_rollout
    from ragen_mega.view import make_app

    advantages = torch.zeros(len(samples), max(len(s.prompt_ids) + len(s.response_ids)
                                               for s in samples))
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        records = trajectories.episode_records(
            samples, tokenizer, kind="train", step=1, scores={g: 0.5 for g in
                                                              {s.group_id for s in samples}},
            kept=samples, advantages=advantages)
        trajectories.write_records(trajectories.step_file(run_dir, 1), records)
        write_s = time.perf_counter() - start
        size = trajectories.step_file(run_dir, 1).stat().st_size
        save_rollout(run_dir, 1, PlayedStep(samples, {}, 0.0, FaultCounters(step=1)))
        dump = rollout_file(run_dir, 1).stat().st_size
        client = TestClient(make_app(Path(run_dir)))
        start = time.perf_counter()
        assert client.get("/api/train/steps/1").status_code == 200
        open_s = time.perf_counter() - start
        start = time.perf_counter()
        episode = records[0]["episode"]
        assert client.get(f"/api/train/steps/1/episodes/{episode}").status_code == 200
        episode_s = time.perf_counter() - start
    print(f"| {name} | {len(records)} | {len(samples)} | {size / 1024:.1f} | "
          f"{dump / 1024:.0f} | {write_s:.2f} | {open_s:.2f} | {episode_s:.2f} |")


def main():
    from transformers import AutoTokenizer

    from ragen_mega.config import load_run_config
    from ragen_mega.models.prepare import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    reasoning = ("<think>" + " ".join(["the key is to the left of the door so I should turn "
                                       "and walk there first"] * 4) + "</think>"
                 "<answer>{action}</answer>")
    print("| step | records | turns | step_N.jsonl.gz KiB | step_N.rollout.pt KiB (save_rollouts) "
          "| records: build + write s | viewer: open step s | viewer: open episode s |\n"
          "|---|---|---|---|---|---|---|---|")
    lake = load_run_config("examples/frozen_lake_small_model_cpu.yaml", [])
    games = AutoTokenizer.from_pretrained(resolve_model("textgame-small"))
    measure("FrozenLake demo: 16 x 8 episodes, <= 6 turns",
            played("frozen_lake", lake.env.kwargs, 128, 8, 6, " {action} </answer>", games,
                   lake.agent, streamed=False), games)
    babyai = load_run_config("examples/long_horizon_babyai_qwen2.5_3b.yaml",
                             ["model.path=smollm2"])
    measure("BabyAI window: 32 streams x 64 turns, memory 2",
            played("babyai", babyai.env.kwargs, 32, 8, 64, reasoning, tokenizer, babyai.agent,
                   streamed=True), tokenizer)


if __name__ == "__main__":
    main()
