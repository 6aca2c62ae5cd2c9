"""Typed config trees from YAML files plus dotted command-line overrides.

A config is a tree of dataclasses. ``load_config(Root, "run.yaml", ["trainer.lr=1e-6"])`` merges
the YAML mapping and the overrides (``a.b.c=value``, value parsed as YAML, with YAML 1.2's
booleans: ``off`` is text, only ``true``/``false`` are booleans) into a fresh ``Root()``
and checks everything before any process or server starts:

- an unknown key names its full dotted path and lists the keys that section allows;
- a value of the wrong type names the key, the expected type and what it got;
- a ``Literal[...]`` field lists the allowed values;
- a field declared with :func:`bounded` (``lr: float = bounded(1e-6, gt=0)``) is checked
  against its bounds (``lr: must be > 0, got -1``); None passes, for an optional field unset;
- each field carries its user's help (``bounded(..., help=...)``, or :func:`setting` without
  bounds); :func:`describe_keys` lists every key with its default, allowed values and help
  (``ragen-mega config --keys``, docs/configuration.md);
- each section may define ``validate(self)`` for cross-field rules; it raises ``ConfigError``
  whose message starts with the key relative to the section (``lr: must be > 0``): the section's
  own path is put in front (``actor.lr: ...``), so one section class can serve several places;
- a key a section renamed (class attribute ``RENAMED_KEYS``, old -> new) is refused with the
  new key's full path, so an old config fails loudly instead of meaning something else;
- a section whose ``__post_init__`` refuses a value raises ``ConfigError`` naming the field the
  same way (``answer_line: ...`` becomes ``agent.answer_line: ...``); any other ``ValueError`` or
  ``TypeError`` from it is reported under the section's path.

Kept generic (no ragen_mega sections here) so the rules are tested once, on small trees.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import (Any, Callable, Literal, NamedTuple, Sequence, TypeVar, get_args,
                    get_origin, get_type_hints)

import yaml

T = TypeVar("T")


class _CoreSchemaLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's core-schema booleans: only ``true`` and ``false``
    (any case PyYAML accepts: ``True``, ``FALSE``) are booleans. YAML 1.1's ``on``/``off``/
    ``yes``/``no`` stay strings, so ``trainer.async_mode: off`` means the choice ``"off"``."""


_CoreSchemaLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_CoreSchemaLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"))


#: the words YAML 1.1 (PyYAML's default) reads as booleans and the core schema reads as text
YAML11_BOOLEAN_WORDS = ("y", "yes", "n", "no", "on", "off")


def load_yaml(text: str) -> Any:
    """``text`` parsed as YAML with the core schema's booleans (:class:`_CoreSchemaLoader`); the
    one YAML reader of config files and ``key=value`` overrides alike."""
    return yaml.load(text, Loader=_CoreSchemaLoader)


class ConfigError(ValueError):
    """A config value is unknown, mistyped or contradicts another; the message names the key."""


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` checked (and where lossless, converted) against the annotation ``tp``."""
    origin, args = get_origin(tp) or (tp if tp in (list, tuple, dict) else None), get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        others = [a for a in args if a is not type(None)]
        if len(others) == 1:  # Optional[X]: X's own message (a Literal's allowed values)
            return _coerce(value, others[0], key)
        for arg in others:
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not allowed; allowed values: "
                              f"{', '.join(repr(a) for a in args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for section {tp.__name__}, got {value!r}")
        return _merge(tp(), value, key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            hint = f" (a list of one: [{value}])" if isinstance(value, (str, int, float)) else ""
            raise ConfigError(f"{key}: expected a list, got {value!r}{hint}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-6" as a string
            return float(value)
        except ValueError:
            pass
    if tp is bool and isinstance(value, str) and value.lower() in YAML11_BOOLEAN_WORDS:
        raise ConfigError(f"{key}: expected true or false, got {value!r} (YAML 1.2: only "
                          f"true and false are booleans)")
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported annotation {tp!r}")


def _merge(section: Any, values: dict, prefix: str) -> Any:
    """Return a copy of dataclass ``section`` with ``values`` (a nested dict) applied."""
    hints = get_type_hints(type(section))
    fields = {f.name for f in dataclasses.fields(section)}
    updates = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        renamed = getattr(type(section), "RENAMED_KEYS", {}).get(name)
        if renamed is not None and name not in fields:
            new_key = f"{prefix}.{renamed}" if prefix else renamed
            raise ConfigError(f"config key {key!r} was renamed: write {new_key!r}")
        if name not in fields:
            raise ConfigError(f"unknown config key {key!r}; allowed keys here: "
                              f"{', '.join(sorted(fields))}")
        current = getattr(section, name)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            updates[name] = _merge(current, value, key)
        else:
            updates[name] = _coerce(value, hints[name], key)
    try:
        return dataclasses.replace(section, **updates)
    except ConfigError as e:  # the section's own __post_init__ checks, naming the field
        raise ConfigError(f"{prefix}.{e}" if prefix else str(e)) from e
    except (TypeError, ValueError) as e:  # a check written otherwise still names the section
        raise ConfigError(f"{prefix or type(section).__name__}: {e}") from e


def parse_overrides(overrides: list[str]) -> dict:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}`` (values parsed as YAML scalars)."""
    tree: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} is not of the form a.b.c=value")
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} was already given a value")
        node[leaf] = _override_value(item, raw)
    return tree


def _override_value(item: str, raw: str) -> Any:
    """The value of override ``item`` (its text after ``=``), parsed as YAML; a value YAML
    cannot parse (``tags=[a``) is a config error naming the override, not PyYAML's traceback."""
    if raw == "":
        return ""
    try:
        return load_yaml(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value {raw!r} is not valid YAML: "
                          f"{_yaml_problem(e, raw)}") from e


@dataclasses.dataclass(frozen=True)
class Bounds:
    """A number field's bounds (any of ``ge``, ``gt``, ``le``, ``lt``) and what an edge value
    means (``note``: ``0: off``), for the message."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    note: str = ""

    def holds(self, value) -> bool:
        """Written as ``not (value < ge)``'s complement so that NaN fails every bound."""
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def describe(self) -> str:
        low = (f"[{self.ge}" if self.ge is not None else
               f"({self.gt}" if self.gt is not None else None)
        high = (f"{self.le}]" if self.le is not None else
                f"{self.lt})" if self.lt is not None else None)
        if low and high:
            text = f"in {low}, {high}"
        elif low:
            text = f"{'>=' if low[0] == '[' else '>'} {low[1:]}"
        else:
            text = f"{'<=' if high[-1] == ']' else '<'} {high[:-1]}"
        return f"{text} ({self.note})" if self.note else text


def bounded(default, *, ge=None, gt=None, le=None, lt=None, note: str = "", help: str = ""):
    """A dataclass field with ``default``, declared bounds (:class:`Bounds`), which
    :func:`check_bounds` enforces before the section's own ``validate``, and the user's ``help``
    (as :func:`setting`)."""
    return dataclasses.field(default=default,
                             metadata={"bounds": Bounds(ge, gt, le, lt, note), "help": help})


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            help: str, choices: Sequence[str] | Callable[[], Sequence[str]] = (),
            also: str = ""):
    """A dataclass field with ``default`` (or ``default_factory``) and the ``help`` a user reads
    for the key (``ragen-mega config --keys``, docs/configuration.md). ``choices``: a registry's
    names for a string field, or a function returning them (called when the keys are listed, so
    later registrations appear); ``also``: what else it takes (``a checkpoint directory``).
    Choices are shown, not enforced: the section's ``validate`` checks the registry."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"help": help, "choices": choices, "also": also})


def check_bounds(section: Any) -> None:
    """ConfigError naming the first field of ``section`` outside its declared bounds."""
    for f in dataclasses.fields(section):
        bounds, value = f.metadata.get("bounds"), getattr(section, f.name)
        if bounds is not None and value is not None and not bounds.holds(value):
            raise ConfigError(f"{f.name}: must be {bounds.describe()}, got {value!r}")


def check_declared(section: Any) -> None:
    """For a section built outside any tree: check its declared bounds and ``Literal`` fields
    as the tree does; ConfigError naming the field."""
    hints = get_type_hints(type(section))
    for f in dataclasses.fields(section):
        tp = hints[f.name]
        if Literal in (get_origin(tp), *map(get_origin, get_args(tp))):
            _coerce(getattr(section, f.name), tp, f.name)
    check_bounds(section)


def _line_column(text: str, position: int) -> str:
    """``line L, column C`` (1-based, as editors count) of character ``position`` of ``text``."""
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    return f"line {line}, column {column}"


def _mark(mark) -> str:
    """A PyYAML mark (0-based ``line``/``column``) as ``line L, column C``, 1-based."""
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _yaml_problem(e: yaml.YAMLError, text: str) -> str:
    """What PyYAML found wrong in ``text`` and where (``line 1, column 15: expected ...``),
    plus the construct it was reading and where that started (an unclosed bracket is reported
    at the end of the file; its opening is what to fix). PyYAML's snippets are left out."""
    if isinstance(e, yaml.MarkedYAMLError):
        where = f"{_mark(e.problem_mark)}: " if e.problem_mark is not None else ""
        message = f"{where}{e.problem or e.context or type(e).__name__}"
        if e.context and e.problem:
            at = f" started at {_mark(e.context_mark)}" if e.context_mark is not None else ""
            message += f" ({e.context}{at})"
        return message + (f"; {e.note}" if e.note else "")
    if isinstance(e, yaml.reader.ReaderError):
        char = f"#x{e.character:04x}" if isinstance(e.character, int) else repr(e.character)
        return f"{_line_column(text, e.position)}: character {char}: {e.reason}"
    return str(e)


def _validate_tree(section: Any, prefix: str = "") -> None:
    for f in dataclasses.fields(section):
        child = getattr(section, f.name)
        if dataclasses.is_dataclass(child):
            _validate_tree(child, f"{prefix}{f.name}.")
    try:
        check_bounds(section)
        if hasattr(section, "validate"):
            section.validate()
    except ConfigError as e:
        raise ConfigError(f"{prefix}{e}") from e


def build_config(root_type: type[T], values: dict | None = None) -> T:
    """``root_type()`` with nested ``values`` applied, then every section's ``validate()``."""
    cfg = _merge(root_type(), values or {}, "")
    _validate_tree(cfg)
    return cfg


def _deep_update(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_yaml(path: Path) -> Any:
    """The YAML document in ``path``; a file that is no text or no YAML is a ConfigError naming
    the file, line and column, not a traceback."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not text: byte {e.start} is not "
                          f"{e.encoding} ({e.reason})") from e
    try:
        return load_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: "
                          f"{_yaml_problem(e, text)}") from e


def load_config(root_type: type[T], path: str | Path | None = None,
                overrides: list[str] | None = None) -> T:
    """Read YAML ``path`` (optional), apply dotted ``overrides``, validate, return the tree."""
    values: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        loaded = _read_yaml(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
        values = loaded or {}
    return build_config(root_type, _deep_update(values, parse_overrides(overrides or [])))


class _CoreSchemaDumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting by the loader's core schema: ``off`` is written bare (the
    loader reads a string), ``'true'`` quoted (else it would read a boolean)."""


_CoreSchemaDumper.yaml_implicit_resolvers = _CoreSchemaLoader.yaml_implicit_resolvers


def dump_yaml(data: Any, **options) -> str:
    """``data`` as YAML that :func:`load_yaml` reads back to equal ``data``, keys in order."""
    return yaml.dump(data, Dumper=_CoreSchemaDumper, sort_keys=False, **options)


def yaml_value(value: Any) -> str:
    """``value`` written as in a YAML config, on one line: ``null``, ``true``, ``[tensorboard]``,
    ``{}``, ``off``."""
    text = dump_yaml(value, default_flow_style=True, width=float("inf")).strip()
    return text.removesuffix("\n...").strip()


class KeyDoc(NamedTuple):
    """One key of a config tree as its user reads it."""
    key: str          # dotted path; the fields of a list's items as ``env.mix[].tag``
    default: Any      # the default value (a section's: None)
    values: tuple     # the values it takes, written as YAML (a Literal's, a registry's names)
    words: str        # what else it takes, in words (its bounds, ``a checkpoint directory``)
    nullable: bool    # it may be null
    listed: bool      # a list of such values
    help: str         # the field's help (metadata ``help``); "" where the field has none
    section: bool     # a section of keys, not a value

    def allowed(self, code: Callable[[str], str] = str) -> str:
        """``values`` (each through ``code``: markdown puts them in backticks), then ``words``,
        then null: ``>= 1 | null``, ``a list of: tensorboard | wandb | mlflow``."""
        text = " | ".join([*map(code, self.values), *([self.words] if self.words else [])])
        if self.listed:
            text = f"a list of: {text}" if self.values else f"a list of {text}"
        return f"{text} | {code('null')}" if self.nullable and "null" not in text else text


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", dict: "a mapping"}
_TYPES_WORDS = {int: "integers", float: "numbers", str: "strings", dict: "mappings"}


def _key_doc(key: str, field: dataclasses.Field, tp: Any, default: Any) -> KeyDoc:
    """The :class:`KeyDoc` of a value field: its annotation, bounds and choices in words."""
    meta, args = field.metadata, get_args(tp)
    nullable = get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args
    if nullable:
        others = [a for a in args if a is not type(None)]
        tp = others[0] if len(others) == 1 else tp
    listed = (get_origin(tp) or tp) is list
    if listed:
        tp = get_args(tp)[0] if get_args(tp) else Any
    values = [yaml_value(a) for a in get_args(tp)] if get_origin(tp) is Literal else \
        ["true", "false"] if tp is bool else []
    choices = meta.get("choices", ())
    values += [str(c) for c in (choices() if callable(choices) else choices)]
    words = meta["bounds"].describe() if meta.get("bounds") else meta.get("also", "")
    if not values and not words:
        words = (_TYPES_WORDS if listed else _TYPE_WORDS).get(tp, "")
    return KeyDoc(key, default, tuple(values), words, nullable, listed, meta.get("help", ""),
                  False)


def describe_keys(root_type: type) -> list[KeyDoc]:
    """Every key of the config tree ``root_type``, depth first in declaration order: a section
    (``actor.lora``) right before its keys; a list of sections (``env.mix``) before the fields of
    its items (``env.mix[].tag``, defaults those of a fresh item)."""
    docs: list[KeyDoc] = []

    def walk(section: Any, prefix: str) -> None:
        hints = get_type_hints(type(section))
        for f in dataclasses.fields(section):
            key, value, tp = f"{prefix}{f.name}", getattr(section, f.name), hints[f.name]
            item = get_args(tp)[0] if get_origin(tp) is list and get_args(tp) else None
            if dataclasses.is_dataclass(value):
                docs.append(KeyDoc(key, None, (), "", False, False, f.metadata.get("help", ""),
                                   True))
                walk(value, f"{key}.")
            elif dataclasses.is_dataclass(item):
                docs.append(KeyDoc(key, value, (), "mappings, each with the keys below", False,
                                   True, f.metadata.get("help", ""), False))
                walk(item(), f"{key}[].")
            else:
                docs.append(_key_doc(key, f, tp, value))

    walk(root_type(), "")
    return docs
