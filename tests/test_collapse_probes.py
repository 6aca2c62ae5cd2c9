"""RAGEN-2's collapse probes: the metrics on hand-worked score tables, the probe's cross batch,
and the real Megatron actor (SmolLM2) telling apart reasoning that copies its own prompt from
reasoning that is the same text for every prompt."""
from __future__ import annotations

import math

import pytest
import torch

from ragen_mega.algo.collapse import collapse_metrics
from ragen_mega.backends.megatron.launch import run_workers
from ragen_mega.rollout.collapse_probe import (FIRST_TURN, first_turn_probe, reasoning_text,
                                               valid_thinking_rate)
from ragen_mega.rollout.sample import Sample


def test_metrics_of_a_hand_worked_table():
    """Two samples, two prompts, one-token reasonings (sums = means): matched 0 and -1;
    marginal log((e^0 + e^-2) / 2) and log((e^-3 + e^-1) / 2); both pick their own prompt."""
    lsum = torch.tensor([[0.0, -2.0], [-3.0, -1.0]])
    got = collapse_metrics(lsum, torch.tensor([1, 1]), torch.tensor([0, 1]), ["a", "b"])
    marginal = [math.log((1 + math.exp(-2)) / 2), math.log((math.exp(-3) + math.exp(-1)) / 2)]
    gap = [0 - marginal[0], -1 - marginal[1]]
    std = abs(marginal[0] - marginal[1]) / 2  # population std of two values
    assert got["mi_estimate"] == pytest.approx(sum(gap) / 2)
    assert got["mi_seq_estimate"] == pytest.approx(sum(gap) / 2)
    assert got["mi_upper_bound"] == pytest.approx(math.log(2))
    assert got["mi_zscore"] == pytest.approx(sum(g / (std + 1e-3) for g in gap) / 2)
    assert got["conditional_entropy_est"] == pytest.approx(0.5)
    assert got["reasoning_entropy_est"] == pytest.approx(-sum(marginal) / 2)
    assert (got["retrieval_accuracy"], got["retrieval_chance_level"]) == (1.0, 0.5)
    # per-token means make the MI, sums the _seq one: row 0's four tokens sum to -4 after its
    # own prompt and -3 after the other (means -1 and -0.75): the other prompt is retrieved
    lsum, lengths = torch.tensor([[-4.0, -3.0], [-3.0, -1.0]]), torch.tensor([4, 1])
    got = collapse_metrics(lsum, lengths, torch.tensor([0, 1]), ["a", "b"])
    assert got["retrieval_accuracy"] == 0.5 and got["retrieval_above_chance"] == 0.0

    def mi(table):
        return sum(table[i][i] - math.log((math.exp(table[i][0]) + math.exp(table[i][1])) / 2)
                   for i in range(2)) / 2
    assert got["mi_seq_estimate"] == pytest.approx(mi([[-4.0, -3.0], [-3.0, -1.0]]))
    assert got["mi_estimate"] == pytest.approx(mi([[-1.0, -0.75], [-3.0, -1.0]]))


def test_duplicate_prompts_count_as_own():
    lsum = torch.tensor([[-1.0, -1.0, -5.0], [-2.0, -1.0, -5.0]])
    got = collapse_metrics(lsum, torch.tensor([1, 1]), torch.tensor([0, 0]), ["a", "a", "b"])
    assert got["retrieval_accuracy"] == 1.0          # column 1 is the same prompt as column 0
    assert got["retrieval_chance_level"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="N >= 2"):
        collapse_metrics(lsum[:, :1], torch.tensor([1, 1]), torch.tensor([0, 0]), ["a"])


WORDS = [["apple", "violin", "glacier", "pepper", "saddle"],
         ["rocket", "tulip", "anchor", "walnut", "prism"],
         ["falcon", "cactus", "lantern", "velvet", "harbor"],
         ["pencil", "meadow", "cobalt", "turnip", "whistle"],
         ["dragon", "oyster", "marble", "ginger", "beacon"],
         ["ladder", "comet", "saffron", "kettle", "orchid"]]


def first_turns(tokenizer, reasoning_for) -> list[Sample]:
    """One first turn per group (prompt j lists WORDS[j]); its response is the reasoning
    ``reasoning_for(j)`` then an answer, as a think-mode turn is written."""
    samples = []
    for j, words in enumerate(WORDS):
        chat = [{"role": "user", "content": f"Remember these words: {' '.join(words)}. "
                                            f"Think, then answer ok."}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                               tokenize=False) + "<think>"
        response = f" {reasoning_for(j)} </think><answer> ok </answer>"
        ids = tokenizer.encode(response, add_special_tokens=False)
        samples.append(Sample(tokenizer.encode(prompt, add_special_tokens=False), ids,
                              [0.0] * len(ids), 0.0, j, j, 1, True, True, "words", j))
    return samples


def test_probe_rows_and_valid_thinking(tokenizer):
    copy = first_turns(tokenizer, lambda j: "The words are " + " ".join(WORDS[j]))
    assert reasoning_text(copy[2], tokenizer) == "The words are falcon cactus lantern velvet harbor"
    no_think = Sample(copy[0].prompt_ids, tokenizer.encode(" ok", add_special_tokens=False),
                      [0.0], 0.0, 9, 0, 1, True, True, "words", 0)
    assert valid_thinking_rate(copy + [no_think], tokenizer) == pytest.approx(6 / 7)
    probe = first_turn_probe(copy + [no_think], tokenizer, max_samples=4, seed=0,
                             rows_multiple_of=5)
    assert probe.n == 4 and len(probe.column_keys) == 6
    assert probe.batch["input_ids"].shape[0] == 25  # 4 x 6 rows, padded to a multiple of 5
    # row i * 6 + j: reasoning i after prompt j
    for i, own in enumerate(probe.own.tolist()):
        for j in range(6):
            row = probe.batch["input_ids"][i * 6 + j]
            assert row[:len(probe.column_keys[j])].tolist() == list(probe.column_keys[j])
        z = probe.batch["loss_mask"][i * 6].sum()
        assert int(z) == int(probe.lengths[i])
        assert reasoning_text(copy[own], tokenizer).endswith(WORDS[own][-1])
    one_group = [s for s in copy if s.group_id == 0]
    assert first_turn_probe(one_group, tokenizer, max_samples=4, seed=0) is None


def _score_worker(rank, world, hf_dir, batches):
    from ragen_mega.backends.megatron.parallel import file_init_method, init_parallel
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig

    init_parallel(rank, world, file_init_method("/nonexistent"), tp=1, pp=1)
    trainer = MegatronTrainer(ActorConfig(micro_batch_size=12), hf_dir, total_steps=10)
    return [trainer.compute_logprobs(b) for b in batches]


def test_the_actor_tells_copied_prompts_from_one_template(tokenizer, smollm2_dir):
    """SmolLM2 as the Megatron actor scores each reasoning after each of 6 prompts. Reasoning
    that repeats its own prompt's words finds its prompt every time (MI near log 6); the same
    sentence for every prompt finds one prompt for all: chance, and no information."""
    copy = first_turns(tokenizer, lambda j: "The words are " + " ".join(WORDS[j]))
    same = first_turns(tokenizer, lambda j: "I should answer ok as asked")
    probes = [first_turn_probe(s, tokenizer, max_samples=6, seed=0) for s in (copy, same)]
    scored = run_workers(_score_worker, 1, smollm2_dir, [p.batch for p in probes],
                         timeout=600)[0]
    copied, templated = (p.metrics(lp) for p, lp in zip(probes, scored))
    assert copied[FIRST_TURN + "retrieval_accuracy"] == 1.0
    assert copied[FIRST_TURN + "mi_seq_estimate"] > 0.5 * math.log(6)
    assert templated[FIRST_TURN + "retrieval_accuracy"] == pytest.approx(1 / 6)
    assert templated[FIRST_TURN + "retrieval_above_chance"] == pytest.approx(0.0)
    assert templated[FIRST_TURN + "mi_seq_estimate"] < 0.1 * copied[FIRST_TURN + "mi_seq_estimate"]
