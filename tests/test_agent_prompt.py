"""Prompt building with the real SmolLM2 tokenizer: ids equal the tokenizer's own rendering of a
chat written out by hand, the memory window, answer-only prefix, token-in/token-out splicing,
the prompt length limit, config validation."""
import re

import pytest
from transformers import AutoTokenizer

from ragen_mega.agent import AgentConfig, History, PromptBuilder, parse_response
from ragen_mega.envs import TextEnv, make

SYSTEM_THINK = ("You're a helpful assistant. You are playing a text game, one turn at a time. In every "
                "turn, first think step by step inside <think> </think>, then give your action(s) "
                "inside <answer> </answer>.")
SYSTEM_ANSWER = ("You're a helpful assistant. You are playing a text game, one turn at a time. In every "
                 "turn, give only your action(s) inside <answer> </answer>, without explanation.")
RULES_THINK = ("Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> with no "
               "extra text. Strictly follow this format.\n")
RULES_ANSWER = "Always output: <answer> [your answer] </answer> with no extra text. Strictly follow this format.\n"
HEAD = ("Walk right to the goal G.\nLegend: P you, G goal, _ floor.\nYour available actions are:\n"
        "Left, Right\nYou can take up to 5 action(s) per turn, separated by the action separator \" || \".\n")


class Corridor(TextEnv):
    """A four-cell corridor: just enough of an env for the prompt."""

    instruction = "Walk right to the goal G.\nLegend: P you, G goal, _ floor."
    valid_actions = ["Left", "Right"]

    def reset(self, seed):
        self.pos = 0
        return self._render()

    def step(self, action):
        self.pos = min(3, self.pos + 1) if action == "Right" else max(0, self.pos - 1)
        done = self.pos == 3
        return self._render(), float(done), done, {"action_is_valid": True, "action_is_effective": True,
                                                   "success": done}

    def _render(self):
        return "".join("P" if i == self.pos else ("G" if i == 3 else "_") for i in range(4))


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def chat_ids(tok, messages):
    """The tokenizer's own tokenization of a whole chat, ready for generation."""
    return tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)


def play(tok, config, responses, observations, rewards, actions_left):
    """A history where turn i saw observations[i] and the model answered responses[i] (token ids)."""
    h = History()
    for i, obs in enumerate(observations):
        h.observe(obs, actions_left[i])
        if i < len(responses):
            h.record(responses[i], parse_response(tok.decode(responses[i], skip_special_tokens=True), config),
                     rewards[i])
    return h


def test_classic_chat_equals_tokenizer_rendering_of_handwritten_chat(tok):
    cfg = AgentConfig(think=True)
    r1, r2 = " G is to my right.</think><answer>Right || Right</answer>", " One more.</think><answer>Right</answer>"
    # turn 1 ended on the end-of-turn token (as engines return it), turn 2 on a stop string
    sampled = [enc(tok, r1) + [tok.convert_tokens_to_ids("<|im_end|>")], enc(tok, r2)]
    h = play(tok, cfg, sampled, ["P__G", "__PG", "___P"], [0.0, 1.0], [10, 8, 7])
    prompt = PromptBuilder.for_env(tok, cfg, Corridor()).build(h)

    messages = [
        {"role": "system", "content": SYSTEM_THINK},
        {"role": "user", "content": HEAD + "\nTurn 1:\nState:\nP__G\nYou have 10 actions left. " + RULES_THINK},
        {"role": "assistant", "content": "<think>" + r1},
        {"role": "user", "content": "Reward: 0\n\nTurn 2:\nState:\n__PG\nYou have 8 actions left. " + RULES_THINK},
        {"role": "assistant", "content": "<think>" + r2},
        {"role": "user", "content": "Reward: 1\n\nTurn 3:\nState:\n___P\nYou have 7 actions left. " + RULES_THINK},
    ]
    assert prompt.ids == chat_ids(tok, messages) + enc(tok, "<think>")
    assert prompt.messages == messages
    assert prompt.text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + "<think>"
    assert prompt.first_turn == 1
    # the spans hold exactly the sampled ids: RAGEN's whole-episode loss mask over assistant turns
    assert [prompt.ids[s:e] for s, e in prompt.response_spans] == sampled


def test_answer_only_window_without_thoughts(tok):
    cfg = AgentConfig(think=False, memory_turns=2, include_thoughts_in_memory=False)
    sampled = [enc(tok, "go right</answr>"), enc(tok, " right ||Left </answer>"), enc(tok, "Right</answer>")]
    h = play(tok, cfg, sampled, ["P__G", "P__G", "P__G", "_P_G"], [-0.1, 0.0, 0.0], [10, 10, 8, 7])
    prompt = PromptBuilder(tok, cfg, Corridor.instruction, Corridor.valid_actions).build(h)

    messages = [
        {"role": "system", "content": SYSTEM_ANSWER},
        {"role": "user", "content": HEAD + "\nTurn 2:\nState:\nP__G\nYou have 10 actions left. " + RULES_ANSWER},
        {"role": "assistant", "content": "<answer>right || Left</answer>"},  # parsed actions, not the text
        {"role": "user", "content": "Reward: 0\n\nTurn 3:\nState:\nP__G\nYou have 8 actions left. " + RULES_ANSWER},
        {"role": "assistant", "content": "<answer>Right</answer>"},
        {"role": "user", "content": "Reward: 0\n\nTurn 4:\nState:\n_P_G\nYou have 7 actions left. " + RULES_ANSWER},
    ]
    assert prompt.ids == chat_ids(tok, messages) + enc(tok, "<answer>")
    assert prompt.first_turn == 2 and prompt.response_spans == []
    # the prompt ends with the assistant header and then the <answer> tokens for the model to continue
    tail = enc(tok, "<|im_end|>\n<|im_start|>assistant\n") + enc(tok, "<answer>")
    assert prompt.ids[-len(tail):] == tail
    # a broken past turn shows as an empty answer; its reward (with the penalty) is reported
    h1 = play(tok, cfg, sampled[:1], ["P__G", "P__G"], [-0.1], [10, 10])
    assert "<|im_start|>assistant\n<answer></answer><|im_end|>\n<|im_start|>user\nReward: -0.1\n" in \
        PromptBuilder(tok, cfg, "Walk.", ["Left"]).build(h1).text


def test_without_instructions_the_prompt_is_the_turns_alone(tok):
    """``instructions=False``: an empty system message (not the template's default one), no
    instruction, action list or format rule; the turns, their rewards and the actions left stay,
    and the whole chat still equals the tokenizer's own rendering of it."""
    cfg = AgentConfig(think=False, answer_line=True, instructions=False)
    sampled = [enc(tok, " Right </answer>")]
    h = play(tok, cfg, sampled, ["P__G", "_P_G"], [0.0], [10, 9])
    prompt = PromptBuilder.for_env(tok, cfg, Corridor()).build(h)
    messages = [
        {"role": "system", "content": ""},
        {"role": "user", "content": "\nTurn 1:\nState:\nP__G\nYou have 10 actions left. "},
        {"role": "assistant", "content": "<answer> Right </answer>"},
        {"role": "user", "content": "Reward: 0\n\nTurn 2:\nState:\n_P_G\nYou have 9 actions left. "},
    ]
    assert prompt.ids == chat_ids(tok, messages) + enc(tok, "<answer>")
    assert [prompt.ids[a:b] for a, b in prompt.response_spans] == sampled
    with_words = PromptBuilder.for_env(tok, AgentConfig(think=False, answer_line=True),
                                       Corridor()).build(h)
    assert len(prompt.ids) < len(with_words.ids) - 100  # the words are most of a short prompt
    assert "SmolLM" not in prompt.text and Corridor.instruction not in prompt.text


@pytest.mark.parametrize("memory_turns, shown", [(0, [6]), (1, [5, 6]), (2, [4, 5, 6]), (5, [1, 2, 3, 4, 5, 6]),
                                                 (9, [1, 2, 3, 4, 5, 6]), (None, [1, 2, 3, 4, 5, 6])])
def test_memory_window_keeps_exactly_the_last_k_turns(tok, memory_turns, shown):
    cfg = AgentConfig(think=False, memory_turns=memory_turns)
    sampled = [enc(tok, f"Right</answer> #{i}") for i in range(1, 6)]  # "#i" marks response i
    h = play(tok, cfg, sampled, [f"obs{i}" for i in range(1, 7)], [0.0] * 5, [None] * 6)
    prompt = PromptBuilder(tok, cfg, Corridor.instruction, Corridor.valid_actions).build(h)
    assert [int(n) for n in re.findall(r"Turn (\d+):", prompt.text)] == shown
    assert [int(n) for n in re.findall(r"State:\nobs(\d+)\n", prompt.text)] == shown
    assert [int(n) for n in re.findall(r"</answer> #(\d+)", prompt.text)] == shown[:-1]
    assert prompt.first_turn == shown[0] and prompt.text.count(Corridor.instruction) == 1
    assert "actions left" not in prompt.text  # actions_left=None leaves the sentence out


def test_sampled_ids_are_spliced_not_retokenized(tok):
    cfg = AgentConfig(think=True)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    # a legal but non-canonical sampling: " " and "right" as two tokens where the tokenizer uses one
    sampled = enc(tok, " G is to my") + enc(tok, " ") + enc(tok, "right.</think><answer>Right</answer>") + [eos]
    text = tok.decode(sampled, skip_special_tokens=True)
    assert enc(tok, text) != sampled[:-1]  # re-tokenizing the text would change the ids
    h = play(tok, cfg, [sampled], ["P__G", "_P_G"], [0.0], [10, 9])
    prompt = PromptBuilder.for_env(tok, cfg, Corridor()).build(h)

    system = {"role": "system", "content": SYSTEM_THINK}
    user1 = {"role": "user", "content": HEAD + "\nTurn 1:\nState:\nP__G\nYou have 10 actions left. " + RULES_THINK}
    user2 = {"role": "user", "content": "Reward: 0\n\nTurn 2:\nState:\n_P_G\nYou have 9 actions left. " + RULES_THINK}
    whole = [system, user1, {"role": "assistant", "content": "<think>" + text}, user2]
    # expected: template up to the assistant header + prefix, the sampled ids, template after them
    rendered = tok.apply_chat_template(whole, tokenize=False, add_generation_prompt=True)
    after = rendered[rendered.index(text + "<|im_end|>") + len(text + "<|im_end|>"):]
    expected = chat_ids(tok, [system, user1]) + enc(tok, "<think>") + sampled + enc(tok, after) + enc(tok, "<think>")
    assert prompt.ids == expected
    assert prompt.ids != chat_ids(tok, whole) + enc(tok, "<think>")  # what re-tokenizing would give
    (s, e), = prompt.response_spans
    assert prompt.ids[s:e] == sampled
    assert prompt.messages[2]["content"] == "<think>" + text


@pytest.mark.parametrize("memory_turns", [None, 2])
def test_one_builder_over_a_whole_episode_equals_the_tokenizer_every_turn(tok, memory_turns):
    """The rollout keeps one builder per episode, which reuses the tokenized pieces of the last
    prompt; every turn's ids must still equal the tokenizer's whole-chat rendering (canonical
    responses) and a fresh builder's."""
    cfg = AgentConfig(think=True, memory_turns=memory_turns)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    builder = PromptBuilder.for_env(tok, cfg, Corridor())
    h = History()
    for turn in range(1, 7):
        h.observe(f"obs{turn}", 12 - turn)
        prompt = builder.build(h)
        assert prompt.ids == chat_ids(tok, prompt.messages) + enc(tok, "<think>")
        assert prompt.ids == PromptBuilder.for_env(tok, cfg, Corridor()).build(h).ids
        assert [int(n) for n in re.findall(r"Turn (\d+):", prompt.text)][0] == prompt.first_turn
        response = enc(tok, f" step {turn}.</think><answer>Right</answer>") + ([eos] if turn % 2 else [])
        h.record(response, parse_response(tok.decode(response, skip_special_tokens=True), cfg), 0.5 * turn)


def test_prompt_limit_drops_oldest_turns_of_a_bounded_window(tok):
    sampled = [enc(tok, "Right</answer>")] * 4
    h = play(tok, AgentConfig(think=False), sampled, ["P__G", "_P_G", "__PG", "P__G", "_P_G"], [0.0] * 4, [9] * 5)

    def build(**kw):
        return PromptBuilder(tok, AgentConfig(think=False, **kw), Corridor.instruction, Corridor.valid_actions).build(h)

    one_past = build(memory_turns=1)
    fitted = build(memory_turns=3, max_prompt_tokens=len(one_past.ids))
    assert fitted.first_turn == 4 and fitted.ids == one_past.ids
    assert build(memory_turns=3, max_prompt_tokens=len(one_past.ids) - 1).first_turn == 5
    # the classic whole-episode chat never loses turns silently, even when dropping would fit
    with pytest.raises(ValueError, match=rf"max_prompt_tokens={len(one_past.ids)} .*memory_turns=None"):
        build(memory_turns=None, max_prompt_tokens=len(one_past.ids))
    with pytest.raises(ValueError, match=r"has \d+ tokens, over AgentConfig.max_prompt_tokens=10 "
                                         r"\(even with no past turn shown\)"):
        build(memory_turns=2, max_prompt_tokens=10)


@pytest.mark.parametrize("think, max_actions, answer", [
    (False, 3, "<answer> Left || Right </answer>"),
    (False, 1, "<answer> Left </answer>"),
    (True, 5, "<think> [Your thoughts] </think> <answer> Left || Right </answer>"),
])
def test_example_answer_shows_the_envs_own_actions_only_when_asked(tok, think, max_actions, answer):
    h = play(tok, AgentConfig(), [], ["P__G"], [], [None])
    text = {}
    for example in (False, True):
        cfg = AgentConfig(think=think, max_actions_per_turn=max_actions, example_answer=example)
        text[example] = PromptBuilder(tok, cfg, Corridor.instruction, Corridor.valid_actions).build(h).text
    rules = (RULES_THINK if think else RULES_ANSWER).replace("\n", "")
    assert rules in text[False] and "Left || Right </answer>" not in text[False]
    assert text[True] == text[False].replace(
        rules, f"Always output: {answer} (with your own actions) with no extra text. Strictly follow this format.")


@pytest.mark.parametrize("kwargs, field", [
    ({"think": "yes"}, "think"),
    ({"max_actions_per_turn": 0}, "max_actions_per_turn"),
    ({"max_actions_per_turn": 2.0}, "max_actions_per_turn"),
    ({"action_sep": " "}, "action_sep"),
    ({"action_sep": "<|>"}, "action_sep"),
    ({"format_penalty": 0.1}, "format_penalty"),
    ({"format_penalty": float("nan")}, "format_penalty"),
    ({"format_penalty": "-0.1"}, "format_penalty"),
    ({"memory_turns": -1}, "memory_turns"),
    ({"include_thoughts_in_memory": 1}, "include_thoughts_in_memory"),
    ({"max_prompt_tokens": 0}, "max_prompt_tokens"),
    ({"example_answer": "yes"}, "example_answer"),
    ({"instructions": "no"}, "instructions"),
    ({"instructions": False, "example_answer": True}, "example_answer"),
])
def test_config_errors_name_the_field(kwargs, field):
    """A bad value is a ConfigError (a ValueError) naming the field first, as every section's."""
    from ragen_mega.config_tree import ConfigError

    with pytest.raises(ConfigError, match=rf"^{field}: "):
        AgentConfig(**kwargs)


def test_misuse_gives_clear_errors(tok, smollm2_dir):
    cfg = AgentConfig()
    builder = PromptBuilder(tok, cfg, "Walk.", ["Left"])
    h = History()
    with pytest.raises(RuntimeError, match="call observe"):
        builder.build(h)
    h.observe("P_G")
    with pytest.raises(RuntimeError, match="turn 1 has no response yet"):
        h.observe("_PG")
    with pytest.raises(TypeError, match="response_ids must be token ids"):
        h.record("Right</answer>", parse_response("Right</answer>", cfg), 0.0)
    with pytest.raises(TypeError, match="reward must be a number"):
        h.record([1, 2], parse_response("Right</answer>", cfg), None)
    other = AutoTokenizer.from_pretrained(smollm2_dir)
    other.chat_template = "{% for m in messages if m['role'] != 'assistant' %}{{ m['content'] }}{% endfor %}"
    h.record(enc(tok, "x</think><answer>Left</answer>"), parse_response("x</think><answer>Left</answer>", cfg), 0.0)
    h.observe("_PG")
    with pytest.raises(ValueError, match="did not render each past assistant message exactly once"):
        PromptBuilder(other, cfg, "Walk.", ["Left"]).build(h)
    other.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        PromptBuilder(other, cfg, "Walk.", ["Left"])


@pytest.mark.parametrize("env_name", ["bandit", "sokoban"])
def test_registered_envs_round_trip(tok, env_name):
    """Two turns of a real env: its text reaches the prompt, the parsed action reaches the env."""
    env, cfg = make(env_name), AgentConfig(think=False, memory_turns=1)
    builder = PromptBuilder.for_env(tok, cfg, env)
    h = History()
    h.observe(env.reset(seed=3), actions_left=5)
    for turn in range(2):
        prompt = builder.build(h)
        assert env.instruction.strip() in prompt.text and all(a in prompt.text for a in env.valid_actions)
        response = enc(tok, f"{env.valid_actions[0]}</answer>")
        parsed = parse_response(tok.decode(response), cfg)
        obs, reward, done, info = env.step(parsed.actions[0])
        assert info["action_is_valid"]
        h.record(response, parsed, reward)
        if done:
            break
        h.observe(obs, actions_left=4 - turn)
        assert f"State:\n{obs}\n" in builder.build(h).text
