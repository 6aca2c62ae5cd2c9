"""A Sokoban agent written against the OpenAI client, trained as it is by ragen-mega.

Nothing in it knows about ragen-mega's prompts or parser: it keeps its own chat, asks for one
move a turn, reads the first move word of the reply, and pays itself the env's rewards plus
RAGEN's -0.1 for a reply without a move. The run hands it an ``AgentTask``
(``ragen_mega/rollout/user_agent.py``): its episode's OpenAI base URL on the run's gateway, the
env, the seed, the turn limit and the sampling settings. Each chat completion it asks for is
one turn of the episode, trained token for token as the engine sampled it.

    rollout:
      agent: examples/agents/sokoban_agent.py:run
"""
import re

from openai import AsyncOpenAI

MOVE = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)
NO_MOVE_PENALTY = -0.1   # RAGEN's format penalty


async def run(task) -> list[float]:
    """Play one episode; one reward per chat completion asked for."""
    client = AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    env = task.env
    observation = await env.reset(task.seed)
    messages = [{"role": "system", "content": env.instruction}]
    rewards = []
    try:
        for _ in range(task.max_turns):
            messages.append({"role": "user", "content": f"{observation}\nYour move "
                                                        f"(Up, Down, Left or Right):"})
            reply = await client.chat.completions.create(
                model="policy", messages=messages, temperature=task.sampling["temperature"],
                top_p=task.sampling["top_p"], max_tokens=task.sampling["max_tokens"])
            text = reply.choices[0].message.content
            messages.append({"role": "assistant", "content": text})
            move = MOVE.search(text)
            if move is None:
                rewards.append(NO_MOVE_PENALTY)
                continue
            observation, reward, done, _ = await env.step(move.group(1).capitalize())
            rewards.append(reward)
            if done:
                break
    finally:
        await client.close()
    return rewards
