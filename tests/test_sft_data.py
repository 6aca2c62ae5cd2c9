"""SFT data (``ragen_mega/sft_data.py``) with the real SmolLM2 tokenizer: chats masked on the
assistant's tokens exactly, JSONL errors naming file:line, format-only examples whose prompt is
the very prompt the real rollout sends at turn 1, and the collated batch layout. No Ray, no
Megatron, no SGLang."""
from __future__ import annotations

import asyncio
import collections
import json
import re

import pytest
import torch
from transformers import AutoTokenizer

from ragen_mega.agent import parse_response
from ragen_mega.config import load_run_config
from ragen_mega.envs.registry import make
from ragen_mega.models.prepare import resolve_model
from ragen_mega.rollout.types import EpisodeSpec, Generation
from ragen_mega.rollout.seeding import train_parts
from ragen_mega.rollout.episode import run_episode
from ragen_mega.sft_data import (SFTExample, chat_example, collate_examples, format_examples,
                                 load_chats)

LAKE = "examples/frozen_lake_cpu_demo.yaml"
BANDIT = "examples/bandit_cpu_demo.yaml"
MIX_YAML = """\
model:
  path: smollm2
env:
  env_groups: 2
  group_size: 2
  max_turns: 5
  mix:
    - {tag: lake, name: frozen_lake, kwargs: {size: 4}, env_groups: 1, max_turns: 2}
    - {tag: arms, name: bandit, env_groups: 1}
    - {tag: box, name: sokoban, env_groups: 0}
agent:
  think: false
  max_actions_per_turn: 2
"""


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model("smollm2"))


def runs(tok, example: SFTExample) -> list[tuple[int, str]]:
    """The example as maximal runs of equal mask, each decoded with special tokens."""
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(example.ids, example.loss_mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return [(m, tok.decode(ids)) for m, ids in out]


def whole_chat(tok, messages):
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))


CHAT = [{"role": "system", "content": "You play a game."},
        {"role": "user", "content": "Where now?"},
        {"role": "assistant", "content": "Left || Down"},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "Up"}]


# ------------------------------------------------------------------------------ chat_example
def test_chat_example_masks_assistant_contents_and_their_end_of_turn(tok):
    example = chat_example(tok, CHAT)
    assert example.ids == whole_chat(tok, CHAT)  # the whole chat, unchanged
    masked = [t for t, m in zip(example.ids, example.loss_mask) if m]
    assert tok.decode(masked) == "Left || Down<|im_end|>Up<|im_end|>"
    # system, user, the assistant header and the newline after <|im_end|> are all 0
    assert runs(tok, example) == [
        (0, "<|im_start|>system\nYou play a game.<|im_end|>\n<|im_start|>user\nWhere now?"
            "<|im_end|>\n<|im_start|>assistant\n"),
        (1, "Left || Down<|im_end|>"),
        (0, "\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"),
        (1, "Up<|im_end|>"),
        (0, "\n")]


def test_chat_example_default_system_and_trailing_user(tok):
    # SmolLM2's template writes its own system message when the chat has none; a chat may end
    # on a user message (no loss there)
    chat = [{"role": "user", "content": "Pick an arm."},
            {"role": "assistant", "content": " <answer> Dragon </answer>"},
            {"role": "user", "content": "Reward: 1"}]
    example = chat_example(tok, chat)
    assert example.ids == whole_chat(tok, chat)
    assert runs(tok, example) == [
        (0, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nPick an arm.<|im_end|>\n<|im_start|>assistant\n"),
        (1, " <answer> Dragon </answer><|im_end|>"),
        (0, "\n<|im_start|>user\nReward: 1<|im_end|>\n")]


@pytest.mark.parametrize("messages, fragment", [
    ([], "'messages' must be a non-empty list"),
    ("hello", "'messages' must be a non-empty list"),
    ([{"role": "user", "content": "hi"}, "Left"], "message 1: must be an object"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}],
     "message 1: field 'role' must be one of system, user, assistant, got 'tool'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}],
     "message 1: field 'content' must be a string"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}],
     "message 1: field 'content' must be a string"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "name": "a"}],
     "message 1: field 'name' is not supported"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}],
     "message 1: field 'role': the chat has no assistant message"),
    ([{"role": "assistant", "content": "Left"}],
     "message 0: field 'role': an assistant message needs a message before it"),
])
def test_chat_example_rejects_bad_messages(tok, messages, fragment):
    with pytest.raises(ValueError, match="^data.jsonl:7: " + re.escape(fragment)):
        chat_example(tok, messages, where="data.jsonl:7")


def test_chat_example_refuses_a_template_that_rewrites_past_turns(tok):
    # like Qwen3's (old <think> text dropped): earlier assistant turns render differently once
    # a later turn follows, so the growing prefixes are not prefixes of each other
    rewriting = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    rewriting.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}[old]{% else %}{{ m['content'] }}"
        "{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match=r"^chats\.jsonl:3: message 4: .*not prefix-stable"):
        chat_example(rewriting, CHAT, where="chats.jsonl:3")
    one_turn = CHAT[:3]  # a single assistant turn is last in every prefix: fine
    assert chat_example(rewriting, one_turn).ids == whole_chat(rewriting, one_turn)


# -------------------------------------------------------------------------------- load_chats
def test_load_chats_round_trips(tok, tmp_path):
    chats = [CHAT, [{"role": "user", "content": "Pick."}, {"role": "assistant", "content": "Dragon"}]]
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": chats[0], "id": "a"}) + "\n\n   \n"
                    + json.dumps({"messages": chats[1]}) + "\n")
    assert load_chats(path, tok) == [chat_example(tok, c) for c in chats]
    assert load_chats(str(path), tok) == load_chats(path, tok)


GOOD_LINE = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "Up"}]})


@pytest.mark.parametrize("bad_line, fragment", [
    ('{"messages": [', ":2: not JSON"),
    ('["not", "an", "object"]', ":2: must be a JSON object"),
    ('{"chat": []}', ":2: needs a \"messages\" list, got none"),
    ('{"messages": "hi"}', ":2: needs a \"messages\" list"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"},
                              {"role": "bot", "content": "Up"}]}),
     ":2: message 1: field 'role' must be one of"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
     ":2: message 0: field 'role': the chat has no assistant message"),
])
def test_load_chats_names_file_and_line(tok, tmp_path, bad_line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD_LINE + "\n" + bad_line + "\n" + GOOD_LINE + "\n")
    with pytest.raises(ValueError, match="^" + re.escape(str(path) + fragment)):
        load_chats(path, tok)


def test_load_chats_missing_or_empty_file(tok, tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_chats(missing, tok)
    for text in ("", "\n  \n"):
        empty = tmp_path / "empty.jsonl"
        empty.write_text(text)
        with pytest.raises(ValueError, match="^" + re.escape(f"{empty}: no chats")):
            load_chats(empty, tok)


# --------------------------------------------------------------------------- format_examples
def split(example: SFTExample) -> tuple[list[int], list[int]]:
    start = example.loss_mask.index(1)
    assert example.loss_mask == [0] * start + [1] * (len(example.ids) - start)
    return example.ids[:start], example.ids[start:]


def rollout_first_prompts(cfg, tok, seed: int, count: int) -> list[list[int]]:
    """What the real rollout sends at turn 1 of example k's episode (part k % n, seed + k)."""
    parts = train_parts(cfg.env)
    prompts = []

    async def play(spec):
        sent = []

        async def generate(prompt_ids, sampling):
            sent.append(list(prompt_ids))
            answer = tok.encode(" </think> <answer> x </answer>" if cfg.agent.think
                                else " x </answer>", add_special_tokens=False)
            return Generation(answer, [0.0] * len(answer), "stop")
        await run_episode(spec, tokenizer=tok, agent=cfg.agent, generate=generate, sampling={},
                          max_turns=cfg.env.max_turns)
        return sent[0]

    for k in range(count):
        p = parts[k % len(parts)]
        spec = EpisodeSpec(p.name, dict(p.kwargs), seed + k, episode_id=k, group_id=k,
                           env_tag=p.tag, max_turns=p.max_turns)
        prompts.append(asyncio.run(play(spec)))
    return prompts


@pytest.fixture
def mix_cfg(tmp_path):
    path = tmp_path / "mix.yaml"
    path.write_text(MIX_YAML)
    return load_run_config(str(path))


@pytest.mark.parametrize("which", ["lake", "lake_think", "bandit", "mix"])
def test_format_prompt_is_the_rollouts_turn_one_prompt(tok, which, request):
    cfg = {"lake": lambda: load_run_config(LAKE),
           "lake_think": lambda: load_run_config(LAKE, ["agent.think=true",
                                                        "agent.answer_line=false"]),
           "bandit": lambda: load_run_config(BANDIT),
           "mix": lambda: request.getfixturevalue("mix_cfg")}[which]()
    examples = format_examples(cfg, tok, 6, seed=40)
    prompts = rollout_first_prompts(cfg, tok, 40, 6)
    assert [split(e)[0] for e in examples] == prompts
    prefix = "<think>" if cfg.agent.think else "<answer>"
    assert all(tok.decode(p).endswith("<|im_start|>assistant\n" + prefix) for p in prompts)
    if which == "mix":  # round robin: lake, arms, lake, ... ; the lake's own turn limit shown
        texts = [tok.decode(p) for p in prompts]
        assert ["FrozenLake" in t for t in texts] == [True, False] * 3
        assert ["bandit" in t for t in texts] == [False, True] * 3
        assert all("You have 4 actions left." in t for t in texts[0::2])   # 2 turns x 2
        assert all("You have 10 actions left." in t for t in texts[1::2])  # 5 turns x 2


def test_format_target_text_lake(tok):
    cfg = load_run_config(LAKE)
    move = "(Left|Down|Right|Up)"
    for example in format_examples(cfg, tok, 20, seed=0):
        _, target = split(example)
        assert target[-1] == tok.eos_token_id
        assert re.fullmatch(rf" {move}( \|\| {move}){{0,2}} </answer><\|im_end\|>",
                            tok.decode(target))
    think = load_run_config(LAKE, ["agent.think=true", "agent.answer_line=false"])
    for example in format_examples(think, tok, 20, seed=0):
        assert re.fullmatch(rf" </think> <answer> {move}( \|\| {move}){{0,2}} </answer><\|im_end\|>",
                            tok.decode(split(example)[1]))


@pytest.mark.parametrize("path, overrides", [
    (LAKE, []), (LAKE, ["agent.think=true", "agent.answer_line=false"]),
    (LAKE, ["agent.answer_line=false", "agent.action_sep=;"]), (BANDIT, [])])
def test_format_targets_parse_back_uniformly(tok, path, overrides):
    cfg = load_run_config(path, overrides)
    k_max = cfg.agent.max_actions_per_turn
    valid = make(cfg.env.name, **cfg.env.kwargs).valid_actions
    examples = format_examples(cfg, tok, 200, seed=7)
    actions, lengths = collections.Counter(), collections.Counter()
    for example in examples:
        _, target = split(example)
        parsed = parse_response(tok.decode(target, skip_special_tokens=True), cfg.agent,
                                finished=True)
        assert parsed.format_ok and parsed.n_dropped == 0, parsed.error
        assert 1 <= len(parsed.actions) <= k_max and set(parsed.actions) <= set(valid)
        actions.update(parsed.actions)
        lengths[len(parsed.actions)] += 1
    # uniform over the actions and over 1..K: every one shows up, none far below its share
    total = sum(actions.values())
    assert set(actions) == set(valid)
    assert min(actions.values()) > 0.6 * total / len(valid), actions
    assert set(lengths) == set(range(1, k_max + 1))
    assert min(lengths.values()) > 0.6 * 200 / k_max, lengths


def test_format_examples_are_deterministic(tok):
    cfg = load_run_config(LAKE)
    a = format_examples(cfg, tok, 30, seed=3)
    assert a == format_examples(cfg, tok, 30, seed=3)
    b = format_examples(cfg, tok, 30, seed=4)
    assert a != b
    assert [split(x)[1] for x in a] != [split(x)[1] for x in b]  # the answers differ too
    # example k plays seed + k: seed 4's first example's prompt is seed 3's second one's
    assert split(b[0])[0] == split(a[1])[0]


def test_prompt_loss_trains_on_every_token_and_keeps_the_heldout_loss_on_targets(tok):
    """``sft.prompt_loss``: the training examples' loss covers every token but the first (the
    prompt too); the held-out examples keep the target-only mask, so the held-out loss still
    measures the format. Off, both are exactly ``format_examples``' own."""
    from ragen_mega.sft import load_examples

    overrides = ["sft.examples=6", "sft.heldout=2", "sft.seed=5"]
    plain = format_examples(load_run_config(LAKE, overrides), tok, 8, seed=5)
    train, heldout = load_examples(load_run_config(LAKE, overrides), tok)
    assert train + heldout == plain
    train, heldout = load_examples(load_run_config(LAKE, [*overrides, "sft.prompt_loss=true"]),
                                   tok)
    assert heldout == plain[6:]
    assert [e.ids for e in train] == [e.ids for e in plain[:6]]
    for e, p in zip(train, plain):
        assert e.loss_mask == [0] + [1] * (len(e.ids) - 1)
        assert sum(e.loss_mask) > 3 * sum(p.loss_mask)  # the prompt's tokens outnumber the answer's


def test_format_examples_bad_count(tok):
    cfg = load_run_config(BANDIT)
    for count in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="count"):
            format_examples(cfg, tok, count, seed=0)


# -------------------------------------------------------------------------- collate_examples
def test_collate_examples_exact_layout():
    a = SFTExample(ids=[5, 6, 7, 8, 9], loss_mask=[0, 0, 1, 1, 0])
    b = SFTExample(ids=[11, 12, 13], loss_mask=[0, 1, 1])
    batch = collate_examples([a, b], pad_id=0)
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert batch["input_ids"].dtype == torch.long and batch["attention_mask"].dtype == torch.long
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [11, 12, 13, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0., 0., 1., 1., 0.], [0., 1., 1., 0., 0.]]
    assert collate_examples([b], pad_id=2)["input_ids"].tolist() == [[11, 12, 13]]
    assert collate_examples([b, a], pad_id=2)["input_ids"].tolist() == [[11, 12, 13, 2, 2],
                                                                         [5, 6, 7, 8, 9]]
    with pytest.raises(ValueError, match="no examples"):
        collate_examples([], pad_id=0)


@pytest.mark.parametrize("ids, mask, fragment", [
    ([1, 2], [0], "2 ids but 1"), ([], [], "no tokens"), ([1, 2], [0, 2], "0 or 1"),
    ([1, 2], [1, 1], "token 0"), ([1, 2], [0, 0], "no loss token")])
def test_sft_example_checks_its_mask(ids, mask, fragment):
    with pytest.raises(ValueError, match=fragment):
        SFTExample(ids=ids, loss_mask=mask)
