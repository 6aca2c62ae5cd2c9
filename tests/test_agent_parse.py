"""Response parsing: RAGEN's format rules, edge cases, and agreement with RAGEN's own regex."""
import random
import re

import pytest

from ragen_mega.agent import AgentConfig, ParsedResponse, parse_response

THINK = AgentConfig(think=True)
ANSWER_ONLY = AgentConfig(think=False)


def ragen_reference(text: str, config: AgentConfig) -> tuple[list[str], str, bool]:
    """RAGEN's parser written out independently: ctx_manager._parse_response's regex, tag
    removal, split and cap, plus es_manager's penalty for an answer without actions. The model's
    text is read after the tag the prompt ends with, as RAGEN's prompt ends with it."""
    full = ("<think>" if config.think else "<answer>") + text
    pattern = r"<think>(.*?)</think>\s*<answer>(.*?)</answer>" if config.think else r"<answer>(.*?)</answer>"
    match = re.search(pattern, full, re.DOTALL)
    if not match:
        return [], "", False
    thought, answer = (match.group(1), match.group(2)) if config.think else ("", match.group(1))
    for tag in ["<think>", "</think>", "<answer>", "</answer>"]:
        answer = answer.replace(tag, "").strip()
        thought = thought.replace(tag, "").strip()
    actions = [a.strip() for a in answer.split(config.action_sep) if a.strip()]
    return actions[:config.max_actions_per_turn], thought, bool(actions)


def test_think_mode_well_formed():
    r = parse_response(" The box is above me.</think><answer>Up</answer>", THINK)
    assert r == ParsedResponse(actions=["Up"], thought="The box is above me.", format_ok=True,
                               penalty=0.0, n_dropped=0, error="")


def test_answer_only_mode_reads_after_the_prefix():
    r = parse_response("Up || Left</answer>", ANSWER_ONLY)
    assert (r.actions, r.thought, r.format_ok, r.penalty) == (["Up", "Left"], "", True, 0.0)
    # think tags in answer-only mode are stray tags, removed from the answer
    assert parse_response("<think>hmm</think>Up</answer>", ANSWER_ONLY).actions == ["hmmUp"]


def test_actions_split_stripped_and_capped():
    cfg = AgentConfig(think=False, max_actions_per_turn=2)
    r = parse_response(" \n Up ||  || Left\t|| Down||Right \n</answer>", cfg)
    assert r.actions == ["Up", "Left"] and r.n_dropped == 2
    assert r.format_ok and r.penalty == 0.0  # RAGEN keeps the first ones without a penalty
    assert parse_response("a,b , c</answer>", AgentConfig(think=False, action_sep=",")).actions == ["a", "b", "c"]


@pytest.mark.parametrize("text, error", [
    ("I go up.</think><answer>Up", "no '</answer>'"),            # cut off before </answer>
    ("I go up.<answer>Up</answer>", "no '</think>'"),             # </think> missing
    ("I go up.</think>Up</answer>", "no '</think>'"),             # <answer> missing
    ("I go up.</think> so <answer>Up</answer>", "no '</think>'"),  # text between the blocks
    ("I go up.</THINK><ANSWER>Up</ANSWER>", "no '</think>'"),      # tags are case-sensitive
    ("I go up.</think><answer></answer>", "empty answer"),
    ("I go up.</think><answer> || \n ||</answer>", "empty answer"),
    ("", "no '</think>'"),
])
def test_broken_format_gives_penalty_and_no_actions(text, error):
    r = parse_response(text, THINK)
    assert (r.actions, r.format_ok, r.penalty) == ([], False, -0.1)
    assert r.error.startswith(error)
    assert ragen_reference(text, THINK)[2] is False  # RAGEN penalises these too


def test_format_penalty_is_configurable_and_answer_only_needs_closing_tag():
    cfg = AgentConfig(think=False, format_penalty=-0.5)
    assert parse_response("Up", cfg).penalty == -0.5
    assert parse_response("Up</Answer>", cfg).format_ok is False  # case-sensitive here too
    assert parse_response("Up</answer>", cfg).penalty == 0.0


def test_whitespace_between_blocks_and_trailing_text_are_accepted():
    r = parse_response("\n plan \n</think>\n\n  <answer>\n Up \n</answer> trailing words <|im_end|>", THINK)
    assert (r.actions, r.thought, r.format_ok) == (["Up"], "plan", True)


def test_duplicated_and_nested_tags():
    # the model repeats the opening tag the prompt already gave: removed from the thought
    assert parse_response("<think>plan</think><answer>Up</answer>", THINK).thought == "plan"
    # a second answer block is ignored: the first </answer> closes the answer
    assert parse_response("t</think><answer>Up</answer><answer>Down</answer>", THINK).actions == ["Up"]
    # the first </think> not followed by <answer> does not end the thought
    r = parse_response("a <think>b</think> c</think><answer>Up</answer>", THINK)
    assert (r.thought, r.actions) == ("a b c", ["Up"])
    # a nested <answer> inside the answer is dropped as a stray tag
    assert parse_response("<answer>Up || <answer>Left</answer>", ANSWER_ONLY).actions == ["Up", "Left"]


def test_unicode():
    r = parse_response("思考 🤔 — naïve</think><answer>向上 || ← ||  Ünïcode </answer>", THINK)
    assert (r.thought, r.actions) == ("思考 🤔 — naïve", ["向上", "←", "Ünïcode"])


def test_100kb_texts():
    long_thought = "x" * 100_000
    r = parse_response(long_thought + "</think><answer>Up</answer>", THINK)
    assert r.actions == ["Up"] and len(r.thought) == 100_000
    # runs of unclosed tags: RAGEN's regex is quadratic here; this parser answers at once
    assert parse_response("<think>" * 15_000, THINK).error == "no '</think>' followed by '<answer>'"
    assert parse_response("</think>" * 12_000 + "<answer>" * 1000, THINK).error == "no '</answer>'"
    assert parse_response("<answer>" * 12_000, ANSWER_ONLY).error == "no '</answer>'"
    many = parse_response(" || ".join(["Up"] * 25_000) + "</answer>", ANSWER_ONLY)
    assert many.actions == ["Up"] * 5 and many.n_dropped == 24_995


def test_agrees_with_ragen_regex_on_random_texts():
    fragments = ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "Up", "Left", "||", "x",
                 "<ANSWER>", "</answer", "思"]
    rng = random.Random(0)
    n_ok = 0
    for config in (THINK, ANSWER_ONLY, AgentConfig(think=True, max_actions_per_turn=1)):
        for _ in range(3000):
            text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 14)))
            r = parse_response(text, config)
            actions, thought, ok = ragen_reference(text, config)
            assert (r.actions, r.format_ok) == (actions, ok), text
            if ok:
                n_ok += 1
                assert r.thought == thought, text
            assert r.penalty == (0.0 if ok else config.format_penalty)
    assert n_ok > 300  # the sample exercised well-formed responses, not only broken ones


def test_answer_line_mode_reads_the_first_line():
    cfg = AgentConfig(think=False, answer_line=True, max_actions_per_turn=1)
    assert parse_response(" Dragon </answer> more", cfg).actions == ["Dragon"]
    assert parse_response(" \nPhoenix.\nTurn 2: Dragon", cfg).actions == ["Phoenix."]
    assert parse_response(" Phoenix", cfg, finished=True).actions == ["Phoenix"]
    # cut at max_new_tokens in the middle of the line: not an answer
    cut = parse_response(" Phoenix is the one I", cfg, finished=False)
    assert not cut.format_ok and cut.penalty == cfg.format_penalty
    assert not parse_response("   \n  ", cfg, finished=True).format_ok
    # without answer_line the same texts need the closing tag, as RAGEN's parser does
    strict = AgentConfig(think=False, max_actions_per_turn=1)
    assert not parse_response(" \nPhoenix.\nTurn 2", strict).format_ok
    with pytest.raises(ValueError, match="answer_line: is for answer-only mode"):
        AgentConfig(think=True, answer_line=True)
