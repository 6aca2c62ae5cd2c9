"""Reference lines of a TextWorld game (:class:`~ragen_mega.envs.textworld_env.TextWorldEnv`).

- ``random_valid``: a uniformly random admissible command at every step (BALROG publishes no
  random baseline), estimated from ``episodes`` seeded games per map;
- ``optimal``: the game's walkthrough (textworld's recorded winning commands) played within the
  budget: 1 when it fits. The walkthrough is the shortest path on coin collector's tree maps
  and may not be on the others, so there this is a lower bound of the best policy's success.
"""
from __future__ import annotations

import numpy as np

from ragen_mega.envs.textworld_env import TextWorldEnv


def random_admissible(env: TextWorldEnv, seed: int, budget: int, episodes: int
                      ) -> tuple[float, float]:
    """(success rate, mean progression) of ``episodes`` random-admissible-command games of
    ``seed``'s map, each at most ``budget`` commands; the draws are seeded by ``seed``."""
    rng = np.random.default_rng(seed)
    wins, progress = 0, 0.0
    for _ in range(episodes):
        env.reset(seed)
        info = {"success": False, "progression": 0.0}
        for _ in range(budget):
            commands = sorted(env.admissible_commands())
            _, _, done, info = env.step(commands[rng.integers(len(commands))])
            if done:
                break
        wins += bool(info["success"])
        progress += info["progression"]
    return wins / episodes, progress / episodes


def walkthrough_wins(env: TextWorldEnv, seed: int, budget: int) -> bool:
    """Whether the game's walkthrough, played from the start, wins within ``budget`` commands.
    Its commands the game would not take are skipped, uncounted (the cooking game's walkthrough
    opens doors that are open already)."""
    env.reset(seed)
    info: dict = {"success": False}
    taken = 0
    for command in env.walkthrough(seed):
        _, _, done, info = env.step(command)
        taken += info["action_is_valid"]
        if done or taken >= budget:
            break
    return bool(info["success"])


def references(env_kwargs: dict, seeds, max_turns: int, max_actions_per_turn: int,
               episodes: int = 8) -> dict[str, float]:
    """Each line's mean over ``seeds``, under the run's budget: ``max_turns`` turns of up to
    ``max_actions_per_turn`` commands, and the env's ``max_steps``."""
    env = TextWorldEnv(**env_kwargs)
    try:
        budget = min(max_turns * max_actions_per_turn, env.max_steps)
        per_seed = {seed: (random_admissible(env, seed, budget, episodes)[0],
                           float(walkthrough_wins(env, seed, budget)))
                    for seed in sorted(set(seeds))}
    finally:
        env.close()
    return {"random_valid": float(np.mean([per_seed[s][0] for s in seeds])),
            "optimal": float(np.mean([per_seed[s][1] for s in seeds]))}


def table(tasks=("coin_collector", "treasure_hunter", "the_cooking_game"), seeds=range(25),
          budget: int = 80, episodes: int = 8, split: str = "test") -> str:
    """The markdown table of docs/environments.md: per task, over ``seeds`` of ``split``, the
    random agent's success and progression, the walkthrough's length and success in
    ``budget`` commands."""
    rows = ["| task | games | random agent: success | random agent: progression "
            "| walkthrough: commands | walkthrough: won in budget |", "|---|---|---|---|---|---|"]
    for task in tasks:
        env = TextWorldEnv(task=task, split=split, games=len(seeds))
        try:
            random = [random_admissible(env, s, budget, episodes) for s in seeds]
            lengths = [len(env.walkthrough(s)) for s in seeds]
            wins = [walkthrough_wins(env, s, budget) for s in seeds]
        finally:
            env.close()
        rows.append(f"| `{task}` | {len(seeds)} | {np.mean([r[0] for r in random]):.3f} "
                    f"| {np.mean([r[1] for r in random]):.3f} | {np.mean(lengths):.1f} "
                    f"({min(lengths)}-{max(lengths)}) | {np.mean(wins):.2f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
