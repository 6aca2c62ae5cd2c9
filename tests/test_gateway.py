"""The OpenAI-compatible gateway (``rollout/gateway.py``) and agents of the user's
(``rollout.agent``, ``rollout/user_agent.py``).

- Token-in/token-out against the real SmolLM2 tokenizer: a conversation that goes on from a
  reply keeps the reply's sampled ids, even ids that re-tokenizing its text would not give back
  (``" Le" + "ft"`` is two sampled tokens, ``" Left"`` one when encoded), and an edited earlier
  reply (a whitespace change) is rendered afresh and counted.
- The HTTP side with the ``openai`` client and raw requests: OpenAI's shapes, and every refused
  request a 4xx naming its field. The engine there is a scripted generate function (what it
  returns is what these tests are about); the real engine plays in the last test.
- A whole training step on the tiny model whose episodes are played by the example agent
  (``examples/agents/sokoban_agent.py``, the ``openai`` client): every trained sample is
  exactly an engine call's prompt, ids and log-probs, conversations grow by the sampled ids,
  the agent's per-call rewards land on their turns, and the trainer's log-probs of the samples
  equal the engine's.
"""
from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from conftest import server_killed_under_first_request, server_pids
from ragen_mega.config import load_run_config
from ragen_mega.config_tree import ConfigError
from ragen_mega.rollout.types import EngineRestarted, Generation
from ragen_mega.rollout.gateway import Gateway
from ragen_mega.rollout.token_history import TokenHistory
from ragen_mega.rollout.user_agent import load_agent

SPLIT_LEFT = [2250, 926]          # " Le" + "ft": decodes to " Left", which encodes as [19937]
IM_END = 2
DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}
EXAMPLE_AGENT = "examples/agents/sokoban_agent.py:run"


def template(tokenizer, messages, generation_prompt=True) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation_prompt)


# ------------------------------------------------------------------ token-in/token-out
def test_a_conversation_goes_on_from_the_sampled_ids(tokenizer):
    assert tokenizer.encode(" Left", add_special_tokens=False) != SPLIT_LEFT  # the trap is real
    history = TokenHistory(tokenizer)
    first = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Move?"}]
    ids, extends = history.chat_prompt(first)
    assert not extends and tokenizer.decode(ids) == template(tokenizer, first)
    for sampled in (SPLIT_LEFT + [IM_END], SPLIT_LEFT):   # stopped on <|im_end|>, or cut short
        history = TokenHistory(tokenizer)
        ids, _ = history.chat_prompt(first)
        content = tokenizer.decode(sampled, skip_special_tokens=True)
        history.record_chat(first, ids, sampled, content)
        second = first + [{"role": "assistant", "content": content},
                          {"role": "user", "content": "Again?"}]
        ids2, extends = history.chat_prompt(second)
        assert extends and ids2[:len(ids) + len(sampled)] == ids + sampled
        # the prompt is the template's text of the whole conversation, the reply as sampled
        assert tokenizer.decode(ids2) == template(tokenizer, second)
        assert ids2 != tokenizer.encode(template(tokenizer, second), add_special_tokens=False)


def test_an_edited_reply_is_rendered_afresh(tokenizer):
    history = TokenHistory(tokenizer)
    first = [{"role": "user", "content": "Move?"}]
    ids, _ = history.chat_prompt(first)
    history.record_chat(first, ids, SPLIT_LEFT + [IM_END], " Left")
    for edited in ("Left", " Left ", " left"):  # whitespace stripped or added, a case change
        second = first + [{"role": "assistant", "content": edited},
                          {"role": "user", "content": "Again?"}]
        ids2, extends = history.chat_prompt(second)
        assert not extends
        assert ids2 == tokenizer.encode(template(tokenizer, second), add_special_tokens=False)


def test_a_completion_prompt_goes_on_from_the_sampled_ids(tokenizer):
    history = TokenHistory(tokenizer)
    ids, extends = history.completion_prompt("Move:")
    assert not extends
    history.record_completion("Move:", ids, SPLIT_LEFT, " Left")
    ids2, extends = history.completion_prompt("Move: Left\nMove:")
    assert extends and ids2[:len(ids) + 2] == ids + SPLIT_LEFT
    assert tokenizer.decode(ids2) == "Move: Left\nMove:"
    # a completion that ended on <|im_end|> cannot be continued by a prompt string
    history.record_completion("Move:", ids, SPLIT_LEFT + [IM_END], " Left")
    assert not history.completion_prompt("Move: Left\nMove:")[1]


# ------------------------------------------------------------------ the HTTP side
def scripted_generate(replies, log):
    """Answers call k with ``replies[k]`` (ids), recording each prompt."""
    async def generate(prompt_ids, sampling):
        log.append((list(prompt_ids), dict(sampling)))
        ids = replies[min(len(log) - 1, len(replies) - 1)]
        return Generation(list(ids), [-0.25] * len(ids), "stop")
    return generate


async def _with_gateway(tokenizer, play, replies, max_turns=4):
    gateway, log = Gateway(tokenizer), []
    calls = gateway.open_episode(7, scripted_generate(replies, log), DEFAULTS, max_turns)
    async with gateway.serving():
        result = await play(gateway)
    return result, calls, log


def test_an_openai_client_conversation_through_the_gateway(tokenizer):
    """The ``openai`` client's chat completions: OpenAI's response shapes, the sampling fields
    passed on (the rollout's where absent), the sampled ids reused, and an edited reply counted
    as a fresh render."""
    from openai import AsyncOpenAI

    async def play(gateway):
        client = AsyncOpenAI(base_url=gateway.url(7), api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Move?"}]
        first = await client.chat.completions.create(model="any", messages=messages,
                                                     logprobs=True, max_tokens=5, stop="\n")
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Again?"}]
        second = await client.chat.completions.create(model="any", messages=messages,
                                                      temperature=0.5)
        messages[1]["content"] = messages[1]["content"].strip()   # the agent edits a reply
        messages += [{"role": "assistant", "content": second.choices[0].message.content},
                     {"role": "user", "content": "And?"}]
        await client.chat.completions.create(model="any", messages=messages)
        await client.close()
        return first, second

    (first, second), calls, log = asyncio.run(_with_gateway(
        tokenizer, play, [SPLIT_LEFT + [IM_END], tokenizer.encode(" Up", add_special_tokens=False)
                          + [IM_END]]))
    assert first.object == "chat.completion" and first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content == " Left"
    assert first.choices[0].finish_reason == "stop"
    assert [t.logprob for t in first.choices[0].logprobs.content] == [-0.25] * 3
    assert "".join(t.token for t in first.choices[0].logprobs.content) == " Left<|im_end|>"
    assert first.usage.completion_tokens == 3 and first.usage.prompt_tokens == len(log[0][0])
    assert second.choices[0].logprobs is None
    assert log[0][1] == {**DEFAULTS, "max_new_tokens": 5, "stop": ["\n"]}
    assert log[1][1] == {**DEFAULTS, "temperature": 0.5}
    # call 2 went on from call 1's prompt and sampled ids; call 3 (edited reply) did not
    assert log[1][0][:len(log[0][0]) + 3] == log[0][0] + SPLIT_LEFT + [IM_END]
    assert [c.extends for c in calls.calls] == [False, True, False] and calls.rerendered == 1
    assert [c.prompt_ids for c in calls.calls] == [p for p, _ in log]


def test_a_gateway_with_a_token_answers_only_calls_that_carry_it(tokenizer, monkeypatch):
    """Off loopback the gateway will not start without a token (the start-up check names the
    key and the variable); with one, the openai client's call without it (or with another) is
    refused with 401 before it reaches the engine, and the same call with it is answered."""
    import openai

    from ragen_mega.http_token import GATEWAY_TOKEN
    from ragen_mega.preflight import preflight

    with pytest.raises(ValueError, match=f"rollout.gateway_host: 0.0.0.0 .*set {GATEWAY_TOKEN}"):
        Gateway(tokenizer, host="0.0.0.0")
    cfg = load_run_config("examples/sokoban_agent_cpu.yaml", ["rollout.gateway_host=0.0.0.0"])
    monkeypatch.delenv(GATEWAY_TOKEN, raising=False)
    with pytest.raises(ConfigError, match=f"rollout.gateway_host: .*set {GATEWAY_TOKEN}"):
        preflight(cfg)
    token, log = "gw-" + os.urandom(8).hex(), []

    async def play():
        gateway = Gateway(tokenizer, token=token)
        gateway.open_episode(7, scripted_generate([SPLIT_LEFT + [IM_END]], log), DEFAULTS, 4)
        messages = [{"role": "user", "content": "Move?"}]
        async with gateway.serving():
            for key in ("none", "not-" + token):
                client = openai.AsyncOpenAI(base_url=gateway.url(7), api_key=key, max_retries=0)
                with pytest.raises(openai.AuthenticationError):
                    await client.chat.completions.create(model="any", messages=messages)
                await client.close()
            client = openai.AsyncOpenAI(base_url=gateway.url(7), api_key=token, max_retries=0)
            answer = await client.chat.completions.create(model="any", messages=messages)
            await client.close()
        return answer

    assert asyncio.run(play()).choices[0].message.content == " Left"
    assert len(log) == 1   # the refused calls never reached the engine


@pytest.mark.parametrize("body, status, param", [
    ({"messages": [{"role": "user", "content": "hi"}], "tools": []}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": True}, 400, "stream"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [1]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, 400, "logprobs"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, 400,
     "messages[0].tool_calls"),
    ({"messages": []}, 400, "messages"),
    ({"model": "policy"}, 400, "messages"),
])
def test_a_malformed_chat_request_is_a_4xx_naming_the_field(tokenizer, body, status, param):
    async def play(gateway):
        async with httpx.AsyncClient() as client:
            return await client.post(f"{gateway.url(7)}/chat/completions", json=body)

    response, calls, log = asyncio.run(_with_gateway(tokenizer, play, [SPLIT_LEFT]))
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and param.split(".")[-1].split("[")[0] in error["message"]
    assert error["type"] == "invalid_request_error"
    assert not log and not calls.calls  # nothing reached the engine or the episode


def test_other_refusals_name_their_cause(tokenizer):
    """An episode not playing is 404, a body that is not JSON 400, a call past the turn limit
    400 naming env.max_turns, a completions prompt that is not a string 400; the episode's
    answered calls stay as they were."""
    async def play(gateway):
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient() as client:
            base = gateway.url(7)
            return [await client.post(gateway.url(8) + "/chat/completions", json=chat),
                    await client.post(base + "/chat/completions", content=b"{not json"),
                    await client.post(base + "/completions", json={"prompt": ["a", "b"]}),
                    await client.post(base + "/chat/completions", json=chat),
                    await client.post(base + "/chat/completions", json=chat)]

    responses, calls, log = asyncio.run(_with_gateway(tokenizer, play, [SPLIT_LEFT],
                                                      max_turns=1))
    assert [r.status_code for r in responses] == [404, 400, 400, 200, 400]
    assert "episode 8 is not playing" in responses[0].json()["error"]["message"]
    assert "not JSON" in responses[1].json()["error"]["message"]
    assert responses[2].json()["error"]["param"] == "prompt"
    assert "env.max_turns" in responses[4].json()["error"]["message"]
    assert len(calls.calls) == 1 and len(log) == 1


def test_an_agent_plays_beside_training_on_one_gateway(tokenizer):
    """``async_mode: fully``: the gateway serves on the rollout's loop for the whole run and an
    evaluation's block inside it uses the same server (another loop is refused); an agent's
    samples keep each call's token versions (a sync landed inside the first call); an engine
    restarted under a call while resyncs wait for the trainer ends the episode with
    ``EngineRestarted`` (played again after the sync), not as a dropped episode."""
    from ragen_mega.rollout.types import EpisodeSpec
    from ragen_mega.rollout.user_agent import play_agent_episode

    agent, spec = load_agent(EXAMPLE_AGENT), EpisodeSpec("sokoban", {}, 3, 7, 0)
    up = tokenizer.encode(" Up", add_special_tokens=False) + [IM_END]

    async def generate(prompt_ids, sampling):   # a sync to version 5 after the first token
        versions = [5] * len(up) if calls else [4] + [5] * (len(up) - 1)
        calls.append(prompt_ids)
        return Generation(list(up), [-0.25] * len(up), "stop", versions=versions)

    async def restarted(prompt_ids, sampling):
        raise EngineRestarted("engine 0 was restarted during an overlapped rollout",
                              resynced=False)

    def play(gateway, generate_fn):
        return play_agent_episode(spec, agent=agent, gateway=gateway, generate=generate_fn,
                                  sampling=DEFAULTS, max_turns=2)

    async def beside_training():
        gateway = Gateway(tokenizer)
        async with gateway.serving():
            port = gateway.port
            async with gateway.serving():   # an evaluation's, on the same loop
                assert gateway.port == port
                episode = await play(gateway, generate)
            with pytest.raises(EngineRestarted):
                await play(gateway, restarted)
            elsewhere = asyncio.to_thread(asyncio.run, _serve_once(gateway))
            with pytest.raises(RuntimeError, match="already serving"):
                await elsewhere
        return episode

    calls: list = []
    episode = asyncio.run(beside_training())
    assert len(calls) == 2 and [s.token_versions for s in episode.samples] == [
        [4] + [5] * (len(up) - 1), [5] * len(up)]


async def _serve_once(gateway):
    async with gateway.serving():
        pass


def test_chat_needs_a_chat_template(tokenizer):
    """A base model's tokenizer has no chat template: chat calls are refused naming it, prompt
    strings still work."""
    import copy

    base = copy.deepcopy(tokenizer)
    base.chat_template = None

    async def play(gateway):
        async with httpx.AsyncClient() as client:
            return [await client.post(f"{gateway.url(7)}/chat/completions",
                                      json={"messages": [{"role": "user", "content": "hi"}]}),
                    await client.post(f"{gateway.url(7)}/completions", json={"prompt": "Move:"})]

    (chat, completion), calls, _ = asyncio.run(_with_gateway(base, play, [SPLIT_LEFT]))
    assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == " Left"
    assert completion.json()["object"] == "text_completion" and len(calls.calls) == 1


# ------------------------------------------------------------------ config and loading
def test_rollout_agent_is_checked_before_anything_starts(tmp_path, capsys):
    from ragen_mega.train import main as train_main

    with pytest.raises(ConfigError, match="rollout.agent: MODULE:FUNCTION"):
        load_run_config("examples/bandit_cpu_demo.yaml", ["rollout.agent=no_colon"])
    with pytest.raises(ConfigError, match="rollout.agent: an agent plays whole episodes"):
        load_run_config("examples/bandit_cpu_demo.yaml", [
            f"rollout.agent={EXAMPLE_AGENT}", "rollout.mode=turns", "rollout.turns_per_step=2",
            "algo.adv_estimator=gae", "critic.enable=true"])
    sync = tmp_path / "sync_agent.py"
    sync.write_text("def run(task):\n    return 0.0\n")
    for path, problem in ((f"{sync}:run", "no async function 'run'"),
                          (f"{tmp_path}/missing.py:run", "no file"),
                          ("no_such_module_here:run", "importing no_such_module_here raised")):
        assert train_main(["examples/bandit_cpu_demo.yaml", f"rollout.agent={path}"]) == 2
        err = capsys.readouterr().err
        assert "config error: rollout.agent:" in err and problem in err, err
    assert load_agent(EXAMPLE_AGENT).__name__ == "run"


# ------------------------------------------------------------------ a real training step
def test_an_openai_client_agent_trains_through_the_gateway(tiny_run_overrides, tokenizer,
                                                           tmp_path, private_ray, monkeypatch):
    """The example agent plays Sokoban (3 turns) on the tiny model through the gateway in a
    real training step (Megatron actor TP 2, a critic, one SGLang engine). The engine's server is
    killed under the step's first call: the gateway answers 503, the engine is restarted with
    the trainer's weights and every episode whose call it cut is played again, none dropped.
    Every trained sample is an engine call exactly (prompt ids, sampled ids, their log-probs); a
    conversation's next call begins with the previous call's prompt and sampled ids unless its
    reply did not render back (counted, and checked call by call); the agent's per-call rewards
    are the turns'; the trainer's log-probs of the samples equal the engine's."""
    import ragen_mega.rollout.manager as manager
    import ragen_mega.train as train_module
    from ragen_mega.ray.engine_group import EngineGroup
    from ragen_mega.train import train

    specials = set(tokenizer.all_special_ids)
    engine_calls, returned, trained = [], {}, []
    real_generate, real_filter = EngineGroup.generate, train_module.filter_groups

    async def recording_generate(self, prompt_ids, sampling, engine=None):
        gen = await real_generate(self, prompt_ids, sampling, engine)
        engine_calls.append((tuple(prompt_ids), tuple(gen.output_ids), tuple(gen.logprobs)))
        return gen

    def recording_agent(path):
        agent = load_agent(path)

        async def run(task):
            returned[task.episode_id] = rewards = await agent(task)
            return rewards
        return run

    def recording_filter(samples, **kwargs):
        trained.extend(samples)
        return real_filter(samples, **kwargs)

    real_episodes = manager.RolloutManager.episodes

    def killed_under_a_call(rollouts, step, evaluate=False, faults=None):
        with server_killed_under_first_request(rollouts.engines, server_pids(tmp_path)[-1]):
            return real_episodes(rollouts, step, evaluate=evaluate, faults=faults)

    monkeypatch.setattr(EngineGroup, "generate", recording_generate)
    monkeypatch.setattr(manager.RolloutManager, "episodes", killed_under_a_call)
    monkeypatch.setattr(manager, "load_agent", recording_agent)
    monkeypatch.setattr(train_module, "filter_groups", recording_filter)
    overrides = tiny_run_overrides(tmp_path, total_steps=1) + [
        "env.name=sokoban", "env.kwargs={}", "env.max_turns=3", "trainer.save_every=0",
        f"rollout.agent={EXAMPLE_AGENT}", "rollout.max_new_tokens=8"]
    [h] = train(load_run_config("examples/bandit_cpu_demo.yaml", overrides))

    assert len(trained) >= 4 and set(returned) == {s.episode_id for s in trained}
    calls = set(engine_calls)
    for s in trained:
        assert (tuple(s.prompt_ids), tuple(s.response_ids), tuple(s.rollout_logprobs)) in calls
    rerendered = extended = 0
    for episode, rewards in returned.items():
        turns = sorted((s for s in trained if s.episode_id == episode), key=lambda s: s.turn)
        assert [s.reward for s in turns] == pytest.approx(rewards)
        assert [s.turn for s in turns] == list(range(1, len(turns) + 1)) and turns[-1].last
        for prev, cur in zip(turns, turns[1:]):
            seen = prev.prompt_ids + prev.response_ids
            grows = cur.prompt_ids[:len(seen)] == seen
            # a reply renders back unless it sampled a special token other than a final
            # <|im_end|> (the text the agent gets back has none)
            special = [t for t in prev.response_ids[:-1] if t in specials]
            special += [prev.response_ids[-1]] if prev.response_ids[-1] in specials - {IM_END} \
                else []
            assert grows == (not special), (prev, cur)
            assert grows == cur.info["extends"]
            extended += grows
            rerendered += not grows
    assert extended >= 1
    assert h["fault/engine_restarts"] == 1 and h["fault/episodes_retried"] >= 1
    assert h["fault/episodes_dropped"] == 0
    assert h["rollout/rerendered_calls"] == pytest.approx(rerendered / len(returned))
    assert h["train/rollout_vs_trainer_logprob_diff"] < 1e-3
    assert h["sync/max_logprob_diff"] < 1e-3 and h["actor/update_successful"] == 1.0
