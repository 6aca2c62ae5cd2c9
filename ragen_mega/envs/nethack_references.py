"""Reference lines of BALROG's MiniHack tasks and NetHack: a uniformly random action at every
step (BALROG publishes no random baseline), estimated from seeded episodes.

- MiniHack: ``random_valid`` is the random agent's success rate;
- NetHack: the table gives the random agent's progression (BALROG's metric), depth and
  experience level at the episode's end.
"""
from __future__ import annotations

import numpy as np

from ragen_mega.envs.nethack_env import TASKS, MiniHackEnv, NetHackEnv, NLETextEnv


def random_agent(env: NLETextEnv, seed: int, budget: int) -> tuple[dict, int]:
    """The last ``info`` of one episode of ``seed`` played with random valid actions, at most
    ``budget`` of them, and how many it took; the draws are seeded by ``seed``."""
    rng = np.random.default_rng(seed)
    actions = env.valid_actions
    env.reset(seed)
    info: dict = {"success": False, "progression": 0.0}
    for taken in range(1, budget + 1):
        _, _, done, info = env.step(actions[rng.integers(len(actions))])
        if done:
            break
    return info, taken


def references(env_kwargs: dict, seeds, max_turns: int, max_actions_per_turn: int
               ) -> dict[str, float]:
    """``random_valid`` over ``seeds`` under the run's budget: ``max_turns`` turns of up to
    ``max_actions_per_turn`` actions, and the env's ``max_steps``."""
    env = MiniHackEnv(**env_kwargs)
    try:
        budget = min(max_turns * max_actions_per_turn, env.max_steps)
        wins = {seed: random_agent(env, seed, budget)[0]["success"]
                for seed in sorted(set(seeds))}
    finally:
        env.close()
    return {"random_valid": float(np.mean([wins[s] for s in seeds]))}


def table(seeds=range(25), nethack_seeds=range(10)) -> str:
    """The markdown tables of docs/environments.md: the random agent on each MiniHack task
    (BALROG's 100 actions an episode) and on NetHack (until the game ends)."""
    rows = ["| task | episodes | random agent: success | actions an episode |",
            "|---|---|---|---|"]
    for task in TASKS:
        env = MiniHackEnv(task=task)
        try:
            ends = [random_agent(env, seed, env.max_steps) for seed in seeds]
        finally:
            env.close()
        rows.append(f"| `{task}` | {len(seeds)} | {np.mean([e['success'] for e, _ in ends]):.2f} "
                    f"| {np.mean([n for _, n in ends]):.0f} |")
    env = NetHackEnv()
    try:
        ends = [random_agent(env, seed, env.max_steps) for seed in nethack_seeds]
    finally:
        env.close()
    mean = {key: np.mean([e[key] for e, _ in ends])
            for key in ("progression", "max_depth", "max_experience_level")}
    rows += ["", "| game | episodes | random agent: progression | deepest level "
             "| highest experience level | actions an episode |", "|---|---|---|---|---|---|",
             f"| `nethack` | {len(nethack_seeds)} | {mean['progression']:.4f} "
             f"| {mean['max_depth']:.2f} | {mean['max_experience_level']:.2f} "
             f"| {np.mean([n for _, n in ends]):.0f} |"]
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
