"""The ``textgame-small`` preset (``ragen-mega prepare-model textgame-small``): a small Qwen3 for
RL from scratch with a tokenizer made for the games' prompts (their phrases are its tokens). Its
SFT warm start, Megatron (TP 2) and SGLang serving are tested in ``test_learn.py``
(``test_sft_warm_start_lowers_heldout_loss_and_serves``)."""
from __future__ import annotations

import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from ragen_mega.agent.config import AgentConfig
from ragen_mega.agent.memory import History
from ragen_mega.agent.prompt import PromptBuilder
from ragen_mega.envs.registry import make
from ragen_mega.models.game_tokenizer import corpus, train_tokenizer


def first_prompt(tokenizer, env, seed: int) -> str:
    builder = PromptBuilder.for_env(tokenizer, AgentConfig(think=False, answer_line=True,
                                                           max_actions_per_turn=1), env)
    history = History()
    history.observe(env.reset(seed))
    return builder.build(history).text


def test_the_games_tokenizer_writes_prompts_short_and_exact_in_chatml(textgame_small_dir,
                                                                      smollm2_dir):
    tok = AutoTokenizer.from_pretrained(textgame_small_dir)
    smol = AutoTokenizer.from_pretrained(smollm2_dir)
    config = json.loads((textgame_small_dir / "config.json").read_text())
    assert len(tok) == config["vocab_size"] <= 4096
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"],
            config["tie_word_embeddings"]) == ("qwen3", 128, 2, True)
    # ChatML exactly as SmolLM2-Instruct's own template renders it
    chat = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Map:\n_P√"},
            {"role": "assistant", "content": "<answer> Up </answer>"},
            {"role": "user", "content": "Reward: 0"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        smol.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|im_end|>")
    # maps the corpus never saw (seeds from 1000): exact round trip, fewer tokens than SmolLM2
    lake = make("frozen_lake", is_slippery=False, observation_format="grid_coord")
    for seed in range(1000, 1016):
        text = first_prompt(tok, lake, seed)
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert len(ids) < len(smol.encode(first_prompt(smol, lake, seed),
                                          add_special_tokens=False)) / 3
    # each fact of the board is one token: the player's cell, the goal's, a whole answer
    board = lake.reset(1000)
    player = next(line for line in board.splitlines() if line.startswith("Player: "))
    for text in (player, "Goal: (3, 2)", " Up </answer>", " Right </answer>"):
        assert len(tok.encode(text, add_special_tokens=False)) == 1, text
    odd = "Ünïcode ≠ ASCII: 🙂 \t tabs"  # bytes outside the corpus still encode, losslessly
    assert tok.decode(tok.encode(odd, add_special_tokens=False)) == odd
    model = AutoModelForCausalLM.from_pretrained(textgame_small_dir)
    assert 700_000 < sum(p.numel() for p in model.parameters()) < 900_000


def test_the_games_tokenizer_is_the_same_on_every_build(textgame_small_dir, smollm2_dir):
    """Trained again from its corpus, the vocabulary and merges are the prepared ones'; and
    loaded from the model's directory (transformers' ``AutoTokenizer``, as the rollout, SFT
    and SGLang load it), it splits text as it was trained to (a Qwen2 model's directory would
    get Qwen2's word pre-tokenizer instead)."""
    prepared = AutoTokenizer.from_pretrained(textgame_small_dir)
    again = train_tokenizer(corpus(AutoTokenizer.from_pretrained(smollm2_dir)))
    assert again.get_vocab() == prepared.get_vocab()
    merges = json.loads(again.backend_tokenizer.to_str())["model"]["merges"]
    assert merges == json.loads((textgame_small_dir / "tokenizer.json").read_text())[
        "model"]["merges"]
    lake = make("frozen_lake", is_slippery=False, observation_format="grid_coord")
    for seed in range(1000, 1008):
        text = first_prompt(prepared, lake, seed)
        assert prepared.tokenize(text) == again.tokenize(text)
