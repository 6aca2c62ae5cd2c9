"""The text protocol between envs and the model: prompts as token ids, parsing, memory window.

Per turn, the rollout does::

    builder = PromptBuilder.for_env(tokenizer, AgentConfig(...), env)
    history = History()
    history.observe(env.reset(seed), actions_left=max_actions)
    prompt = builder.build(history)                 # prompt.ids -> engine
    parsed = parse_response(response_text, config)  # actions for env.step, format penalty
    history.record(response_ids, parsed, reward)    # then observe() the next observation

and trains on ``prompt.ids + response_ids`` with the loss on the response only.
"""
from ragen_mega.agent.config import AgentConfig
from ragen_mega.agent.memory import History, Turn
from ragen_mega.agent.parse import ParsedResponse, parse_response, response_prefix
from ragen_mega.agent.prompt import Prompt, PromptBuilder, format_hint, system_prompt

__all__ = ["AgentConfig", "History", "Turn", "ParsedResponse", "parse_response", "response_prefix",
           "Prompt", "PromptBuilder", "format_hint", "system_prompt"]
