"""A tokenizer made for the project's text games, for small models trained from scratch by RL
(``ragen-mega prepare-model textgame-small``): its tokens are the games' phrases.

Why not SmolLM2's tokenizer: a model of about a million weights with a 49 152-row vocabulary
spends nearly all its compute in the embedding and the LM head.

Why phrases, not words: the pre-tokenizer splits the text only at line ends and after each
coordinate item (``"),"``), so byte-level BPE over the games' prompts learns whole lines and
items as tokens: ``Player: (1, 0)``, ``Goal: (3, 2)``, ``_OO_`` (a board row), `` Up </answer>``
(a whole answer). Each fact of the board is then one token that a layer of attention can pick
out by what it is, not a digit whose meaning a two-layer model trained from scratch must first
learn from reward (docs/results.md, "A small model from scratch").

Byte-level: the 256 bytes are in the vocabulary, so any text encodes (no unknown token) and
``decode(encode(text)) == text``; an env the corpus never saw works, with longer prompts. The
chat template is ChatML (``<|im_start|>role ... <|im_end|>``, as SmolLM2 and Qwen write it). The
model that carries it must be of a type whose tokenizer transformers loads from
``tokenizer.json`` as written (Qwen3: yes; Qwen2: transformers 5 swaps in Qwen2's own word
pre-tokenizer), which ``tests/test_textgame_model.py`` checks.

The corpus is rendered by the agent's own :class:`~ragen_mega.agent.prompt.PromptBuilder` (with
SmolLM2's chat template, message texts only) over seeded random episodes of the games, so it
holds exactly the prompts' phrases. Deterministic: the same corpus gives the same vocabulary
and merges on every machine.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

#: ChatML, as SmolLM2-Instruct and Qwen write it (a system message is the caller's to give)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: (env name, kwargs) whose prompts make the corpus: the games a small model is trained on here
CORPUS_ENVS = (
    ("frozen_lake", {"observation_format": "grid"}),
    ("frozen_lake", {"observation_format": "coord", "is_slippery": False}),
    ("frozen_lake", {"observation_format": "grid_coord", "is_slippery": False}),
    ("frozen_lake", {"size": 3, "observation_format": "grid_coord", "is_slippery": False}),
    ("sokoban", {}),
    ("bandit", {}),
)


def corpus(reference_tokenizer, episodes: int = 48, max_turns: int = 4) -> Iterator[str]:
    """The message texts of ``episodes`` seeded random episodes of each of :data:`CORPUS_ENVS`,
    for each answer mode (think or answer-only, one or three actions a turn, with or without an
    example answer), plus the answers a model writes in those modes. ``reference_tokenizer``
    only renders the chat (any tokenizer with a chat template)."""
    from ragen_mega.agent.config import AgentConfig
    from ragen_mega.agent.memory import History
    from ragen_mega.agent.parse import parse_response
    from ragen_mega.agent.prompt import PromptBuilder
    from ragen_mega.envs.registry import make
    from ragen_mega.sft_data import format_target

    modes = [AgentConfig(think=False, answer_line=True, max_actions_per_turn=1),
             AgentConfig(think=False, answer_line=True, max_actions_per_turn=3,
                         example_answer=True),
             AgentConfig(think=True, max_actions_per_turn=3)]
    rng = random.Random(0)
    for name, kwargs in CORPUS_ENVS:
        env = make(name, **kwargs)
        for agent in modes:
            builder = PromptBuilder.for_env(reference_tokenizer, agent, env)
            for seed in range(episodes):
                history = History()
                obs, done = env.reset(seed), False
                for _ in range(max_turns):
                    history.observe(obs)
                    actions = [rng.choice(env.valid_actions)
                               for _ in range(rng.randint(1, agent.max_actions_per_turn))]
                    answer = format_target(agent, actions)
                    yield answer
                    reward = 0.0
                    for action in actions:
                        obs, r, done, _ = env.step(action)
                        reward += r
                        if done:
                            break
                    ids = reference_tokenizer.encode(answer, add_special_tokens=False)
                    history.record(ids, parse_response(answer, agent, finished=True), reward)
                    if done:
                        break
                history.observe(obs)
                for message in builder.build(history).messages:
                    yield message["role"]
                    yield message["content"]


def train_tokenizer(texts: Iterator[str], vocab_size: int = 4096):
    """A ``PreTrainedTokenizerFast``: byte-level BPE over ``texts`` split into phrases (module
    docstring), at most ``vocab_size`` entries counting the bytes and :data:`SPECIAL_TOKENS`
    (fewer when the corpus runs out of merges, as the games' corpus does), ChatML template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
        pre_tokenizers.Split(Regex(r"\),"), behavior="merged_with_previous"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|im_end|>", unk_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False)


def build_game_tokenizer(out_dir: str | Path, reference_tokenizer, vocab_size: int = 4096):
    """Train the text-game tokenizer and save it to ``out_dir``; returns it."""
    tok = train_tokenizer(corpus(reference_tokenizer), vocab_size)
    tok.save_pretrained(out_dir)
    return tok
