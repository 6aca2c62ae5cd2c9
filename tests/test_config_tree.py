"""The config machinery: YAML + dotted overrides into typed dataclass trees, errors naming keys."""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import pytest

from ragen_mega.config_tree import (ConfigError, bounded, build_config, check_declared,
                                     load_config, parse_overrides)


@dataclasses.dataclass
class Optim:
    RENAMED_KEYS = {"learning_rate": "lr"}
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: Literal["constant", "cosine"] = "constant"


@dataclasses.dataclass
class Run:
    steps: int = 10
    name: str = "demo"
    seed: Optional[int] = None
    tags: list[str] = dataclasses.field(default_factory=list)
    env_kwargs: dict = dataclasses.field(default_factory=dict)
    optim: Optim = dataclasses.field(default_factory=Optim)

    def validate(self):
        if self.steps <= 0:
            raise ConfigError(f"steps: must be > 0, got {self.steps}")


def test_yaml_then_overrides_win(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 5\noptim:\n  lr: 0.5\n  schedule: cosine\nenv_kwargs: {dim: [6, 6]}\n")
    cfg = load_config(Run, path, ["optim.lr=1e-6", "tags=[a, b]", "seed=3", "name=x=y"])
    assert cfg.steps == 5 and cfg.optim.lr == 1e-6 and cfg.optim.schedule == "cosine"
    assert cfg.tags == ["a", "b"] and cfg.seed == 3 and cfg.name == "x=y"
    assert cfg.env_kwargs == {"dim": [6, 6]}
    assert cfg.optim.betas == (0.9, 0.999)  # untouched default survives a partial section


def test_int_widens_to_float_and_tuple_is_typed():
    cfg = build_config(Run, {"optim": {"lr": 1, "betas": [0.5, 1]}})
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.5, 1.0)


@pytest.mark.parametrize("overrides, needle", [
    (["optim.lrr=1"], "unknown config key 'optim.lrr'; allowed keys here: betas, lr, schedule"),
    (["stepz=1"], "unknown config key 'stepz'"),
    (["optim.learning_rate=1"], "config key 'optim.learning_rate' was renamed: write 'optim.lr'"),
    (["steps=ten"], "steps: expected int, got str 'ten'"),
    (["steps=1.5"], "steps: expected int"),
    (["optim.schedule=linear"], "optim.schedule: 'linear' is not allowed; allowed values: 'constant', 'cosine'"),
    (["optim.betas=[1, 2, 3]"], "optim.betas: expected 2 items, got 3"),
    (["steps=0"], "steps: must be > 0"),
    (["optim=3"], "optim: expected a mapping"),
    (["steps"], "not of the form a.b.c=value"),
    (["a..b=1"], "not of the form a.b.c=value"),
    (["tags=x"], "tags: expected a list, got 'x' (a list of one: [x])"),
    (["tags=[a"], "override 'tags=[a': value '[a' is not valid YAML: line 1, column 3: "
                  "expected ',' or ']'"),
])
def test_errors_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(Run, None, overrides)
    assert needle in str(err.value)


def test_bool_is_not_an_int():
    with pytest.raises(ConfigError, match="steps: expected int, got bool"):
        build_config(Run, {"steps": True})


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Run, tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(Run, tmp_path / "list.yaml")


@pytest.mark.parametrize("text, line, column, problem", [
    # an unclosed bracket is found where the file ends (one past its last character), and the
    # message also says where the bracket opened
    ("env: [unclosed", 1, len("env: [unclosed") + 1, "expected ',' or ']', but got '<stream end>' "
     "(while parsing a flow sequence started at line 1, column 6)"),
    ("steps: 5\nname: a: b\n", 2, len("name: a:"), "mapping values are not allowed here"),
    ("steps: 5\nname: \x07\n", 2, len("name: \x07"), "character #x0007: special characters"),
])
def test_yaml_syntax_error_names_file_line_and_column(tmp_path, text, line, column, problem):
    """PyYAML counts lines and columns from 0; the message counts them as editors do."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(Run, path)
    assert str(err.value).startswith(f"config file '{path}' is not valid YAML: "
                                     f"line {line}, column {column}: {problem}")


def test_config_file_that_is_no_text_names_the_byte(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"steps: \xff\n")
    with pytest.raises(ConfigError, match=rf"^config file '{path}' is not text: byte 7 "):
        load_config(Run, path)


def test_parse_overrides_nests():
    assert parse_overrides(["a.b.c=1", "a.d=x", "e="]) == {"a": {"b": {"c": 1}, "d": "x"}, "e": ""}
    with pytest.raises(ConfigError, match="already given a value"):
        parse_overrides(["a=1", "a.b=2"])


@dataclasses.dataclass
class Checked:
    k: int = 1

    def __post_init__(self):
        if self.k < 0:
            raise ValueError(f"Checked.k must be >= 0, got {self.k}")


@dataclasses.dataclass
class Outer:
    inner: Run = dataclasses.field(default_factory=Run)
    checked: Checked = dataclasses.field(default_factory=Checked)


def test_nested_section_errors_carry_the_section_path():
    with pytest.raises(ConfigError, match=r"^inner\.steps: must be > 0"):
        build_config(Outer, {"inner": {"steps": -1}})
    with pytest.raises(ConfigError, match=r"^checked: Checked\.k must be >= 0, got -2"):
        build_config(Outer, {"checked": {"k": -2}})


@dataclasses.dataclass
class Bounded:
    """Declared bounds, each edge kind once, and an optional field."""
    workers: int = bounded(0, ge=0, note="0: none")
    rate: float = bounded(0.5, gt=0, le=1)
    beta: float = bounded(0.9, ge=0, lt=1)
    cap: Optional[float] = bounded(None, gt=1, note="None: off")
    mode: Literal["a", "b"] = "a"
    scale: float = bounded(1.0, lt=10)


@dataclasses.dataclass
class BoundedRun:
    b: Bounded = dataclasses.field(default_factory=Bounded)


@pytest.mark.parametrize("override, message", [
    ("b.workers=-1", "b.workers: must be >= 0 (0: none), got -1"),
    ("b.rate=0", "b.rate: must be in (0, 1], got 0.0"),
    ("b.rate=1.5", "b.rate: must be in (0, 1], got 1.5"),
    ("b.rate=.nan", "b.rate: must be in (0, 1], got nan"),   # NaN fails every bound
    ("b.beta=1", "b.beta: must be in [0, 1), got 1.0"),
    ("b.cap=1", "b.cap: must be > 1 (None: off), got 1.0"),
    ("b.scale=10", "b.scale: must be < 10, got 10.0")])
def test_declared_bounds_name_the_key_and_the_range(override, message):
    with pytest.raises(ConfigError) as e:
        build_config(BoundedRun, parse_overrides([override]))
    assert str(e.value) == message


def test_declared_bounds_admit_their_edges_and_an_unset_optional():
    cfg = build_config(BoundedRun, parse_overrides(["b.workers=0", "b.rate=1", "b.beta=0",
                                                    "b.cap=1.01", "b.scale=-5"]))
    assert (cfg.b.workers, cfg.b.rate, cfg.b.beta, cfg.b.cap) == (0, 1, 0, 1.01)
    assert build_config(BoundedRun).b.cap is None


def test_check_declared_checks_a_section_built_directly():
    """A backend handed a section outside any tree checks what the tree would have."""
    check_declared(Bounded())
    with pytest.raises(ConfigError, match=r"^mode: 'c' is not allowed; allowed values: 'a', 'b'"):
        check_declared(Bounded(mode="c"))
    with pytest.raises(ConfigError, match=r"^rate: must be in \(0, 1\], got 2"):
        check_declared(Bounded(rate=2))
