"""Keys a user can find: ``ragen-mega config`` prints a config as YAML that trains the same run,
``ragen-mega config --keys`` lists every key with its default, allowed values and help, and
docs/configuration.md's reference is that help, current, with YAML values and the registries'
names for string fields that take a registered name."""
from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

from ragen_mega.algo.config import builtin_estimators
from ragen_mega.algo.filter import GROUP_METRICS, STRATEGIES
from ragen_mega.config import RunConfig, load_run_config
from ragen_mega.config_command import REFERENCE_HEADING, main
from ragen_mega.config_tree import load_yaml
from ragen_mega.models.prepare import PRESETS

ROOT = pathlib.Path(__file__).parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
PAGE = ROOT / "docs" / "configuration.md"


def fields_of_tree(section_type, path=""):
    """(dotted key, field) of every field of the tree, the items of a list of sections
    (``env.mix[]``) included: walked here from the dataclasses themselves."""
    section = section_type()
    for f in dataclasses.fields(section):
        key = f"{path}{f.name}"
        yield key, f
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from fields_of_tree(type(value), f"{key}.")
        elif f.name == "mix":
            from ragen_mega.envs.config import EnvMixEntry

            yield from fields_of_tree(EnvMixEntry, f"{key}[].")


def test_every_field_of_the_run_config_has_help():
    missing = [key for key, f in fields_of_tree(RunConfig) if not f.metadata.get("help")]
    assert not missing, f"config fields without help= (setting/bounded): {missing}"


def fresh_reference() -> str:
    """The reference as a fresh process generates it (tools/config_reference.py does): this
    one's registries may hold what tests registered (tests/faulty_envs.py's env)."""
    code = "from ragen_mega.config_command import reference_markdown as r; print(r(), end='')"
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True).stdout


def test_the_reference_on_the_page_is_the_fields_help():
    """docs/configuration.md ends with the generated reference (tools/config_reference.py)."""
    page = PAGE.read_text()
    assert page.count(f"\n{REFERENCE_HEADING}\n") == 1
    assert page.split(f"\n{REFERENCE_HEADING}\n")[1] == \
        fresh_reference().split(f"{REFERENCE_HEADING}\n", 1)[1], \
        "docs/configuration.md is stale: run python tools/config_reference.py"


def reference_rows() -> dict[str, list[str]]:
    rows = {}
    for line in PAGE.read_text().split(f"\n{REFERENCE_HEADING}\n")[1].splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if cells and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells
    return rows


def test_the_reference_shows_yaml_values_and_every_registered_choice():
    rows = reference_rows()
    python_words = [k for k, cells in rows.items()
                    if re.search(r"`(None|True|False)`", cells[1] + cells[2])]
    assert not python_words, f"Python values, not YAML, on the page: {python_words}"
    assert rows["agent.memory_turns"][1] == "`null`" and rows["agent.think"][1] == "`true`"
    assert rows["trainer.async_mode"][1] == "`off`"
    for key, names in (("filter.strategy", STRATEGIES), ("filter.metric", GROUP_METRICS),
                       ("algo.adv_estimator", [n for n, _ in builtin_estimators()]),
                       ("trainer.resume", ["auto", "never", "force"]),
                       ("model.path", PRESETS)):
        assert set(re.findall(r"`([^`]+)`", rows[key][2])) >= set(names), key
    assert "MODULE:FUNCTION" in rows["algo.adv_estimator"][2]
    assert "checkpoint directory" in rows["trainer.resume"][2]


def test_the_finding_a_key_section_names_real_keys():
    """Every key of ours the index and the verl/RAGEN table name exists (a key ending in ``*``
    names a section's keys)."""
    page = PAGE.read_text()
    finding = page.split("\n## Finding a key\n")[1].split("\n## ")[0]
    sections = {f.name for f in dataclasses.fields(RunConfig)}
    keys = {key for key, _ in fields_of_tree(RunConfig)}
    named = set()
    for line in finding.splitlines():
        cells = line.split(" | ")
        text = cells[1] if line.startswith("|") and len(cells) > 2 else line
        named |= {m for m in re.findall(r"`([a-z_]+\.[a-z_.*\[\]]+)`", text)
                  if m.split(".")[0] in sections}
    assert len(named) > 40
    unknown = sorted(k for k in named if k not in keys and not (
        k.endswith(".*") and any(key.startswith(k[:-1]) for key in keys)))
    assert not unknown, f"docs/configuration.md names keys that do not exist: {unknown}"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_printed_config_trains_the_same_config(path, tmp_path, capsys):
    """``ragen-mega config EXAMPLE overrides`` prints YAML; loading that file (as ``ragen-mega
    train`` does) gives the config that the example and overrides give."""
    overrides = ["trainer.pack_trajectories=off", "trainer.total_steps=7"]
    model = yaml.safe_load(path.read_text())["model"]["path"]
    if model not in PRESETS and not (pathlib.Path(model) / "config.json").is_file():
        overrides.append("model.path=smollm2")   # a /path/to/... of the user's machine
    assert main([str(path), *overrides]) == 0
    printed = tmp_path / "resolved.yaml"
    printed.write_text(capsys.readouterr().out)
    assert load_run_config(printed) == load_run_config(path, overrides)


def test_keys_lists_defaults_as_yaml_with_help(capsys):
    assert main(["--keys", "agent."]) == 0
    text = capsys.readouterr().out
    listed = load_yaml(text)
    defaults = RunConfig().agent
    assert list(listed) == [f"agent.{f.name}" for f in dataclasses.fields(defaults)]
    for f in dataclasses.fields(defaults):
        entry = listed[f"agent.{f.name}"]
        assert entry["default"] == getattr(defaults, f.name) and entry["help"]
    assert "default: null" in text and "default: true" in text and "None" not in text
    assert listed["agent.think"]["allowed"] == "true | false"


def test_keys_of_an_unknown_prefix_name_the_sections(capsys):
    assert main(["--keys", "trainr"]) == 2
    err = capsys.readouterr().err
    assert "no config key starts with 'trainr'" in err and "trainer" in err
    assert main(["examples/bandit_cpu_demo.yaml", "--keys"]) == 2
    assert "give it no CONFIG" in capsys.readouterr().err


def test_the_command_is_ragen_mega_config(capsys):
    from ragen_mega.cli import main as ragen_mega

    assert ragen_mega(["config", "--keys", "sft.lr"]) == 0
    listed = load_yaml(capsys.readouterr().out)
    assert list(listed) == ["sft.lr"] and listed["sft.lr"]["default"] is RunConfig().sft.lr
