"""The Baba Is You engine behind BabaIsAI: cell stacks, rules read from word blocks, moves.

Rules are word blocks on the grid. Three in a row, left to right or top to bottom, make a
sentence: ``BABA IS YOU`` (every baba moves with the action), ``KEY IS WIN`` (stepping onto a key
wins), ``WALL IS STOP`` (walls cannot be entered), ``BALL IS KEY`` (every ball turns into a key).
A colour before the noun (``RED BALL IS WIN``) restricts the rule to that colour. There is no
AND, NOT or HAS.

Semantics (those of the engine BALROG and Verlog evaluate on; ``x`` grows rightwards, ``y``
downwards):

- Each cell is a stack; only its top thing takes part in rules, moves, win tests and the text.
  Border walls are outside the rules: they always block and are never pushed.
- Word blocks are always pushable and never walked over. An object can be walked over unless it
  is STOP; the mover is stacked on top and hides what was there.
- A non-idle action moves every YOU object (row-major, each once, only while it is still the top
  of its cell). A move into a pushable thing first pushes it the same way, recursively (Sokoban
  chains); then the mover enters unless the top thing there is STOP or a word block (a border, a
  blocked push). A PUSH object that could not be pushed and is not STOP is walked over, as in
  the original engine.
- WIN and LOSE are tested on the top thing of the destination *before* the mover lands there,
  with the rules of the start of the step (a blocked mover's destination is its own cell).
- After the moves the rules are read again from scratch, then ``A IS B`` turns every top A into
  a new B (the A stays underneath). ``idle`` changes nothing, not even the rules.
- YOU, WIN, STOP, PUSH, LOSE act as above; PULL, MOVE, OPEN and SHUT are read and listed but have
  no effect: no level uses them, here or in the original engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

NOUNS = ("baba", "ball", "key", "door", "wall")
PROPERTIES = ("you", "win", "stop", "push", "pull", "move", "lose", "open", "shut")
COLORS = ("red", "blue", "green", "white", "grey")
DEFAULT_COLOR = {"baba": "white", "ball": "green", "key": "blue", "door": "red", "wall": "grey"}

#: action name -> (dx, dy); "idle" is (0, 0) and is handled apart
DIRECTIONS = {"up": (0, -1), "right": (1, 0), "down": (0, 1), "left": (-1, 0)}


class Thing:
    """One thing on the grid. Immutable and compared by identity (two red balls are two
    things), so grid copies share them. ``kind``: "border" (the outer wall), "object" (``name``
    one of NOUNS), or a word block: "noun", "is", "property", "color" (``name`` is the word)."""

    __slots__ = ("kind", "name", "color", "key")

    def __init__(self, kind: str, name: str, color: str = ""):
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "color", color)
        object.__setattr__(self, "key", f"{kind}:{name}:{color}")

    def __setattr__(self, attr, value):
        raise AttributeError("Thing is immutable")

    @property
    def is_word(self) -> bool:
        return self.kind in ("noun", "is", "property", "color")

    def __repr__(self) -> str:
        return f"Thing({self.kind}, {self.name}{', ' + self.color if self.color else ''})"


def obj(name: str, color: str | None = None) -> Thing:
    """An object (baba, ball, key, door, wall) in ``color`` or its default colour."""
    if name not in NOUNS:
        raise ValueError(f"babaisai: unknown object {name!r}; objects are {NOUNS}")
    return Thing("object", name, color or DEFAULT_COLOR[name])


def word(text: str) -> Thing:
    """A word block: a noun, ``is``, a property or a colour."""
    if text == "is":
        return Thing("is", text)
    for kind, vocabulary in (("noun", NOUNS), ("property", PROPERTIES), ("color", COLORS)):
        if text in vocabulary:
            return Thing(kind, text)
    raise ValueError(f"babaisai: unknown word {text!r}; words are is, {NOUNS}, {PROPERTIES}, "
                     f"{COLORS}")


BORDER = Thing("border", "border")


@dataclass(frozen=True)
class Rule:
    """``[color] noun is target``; ``target`` is a property or, for a transform, a noun."""
    noun: str
    target: str
    color: str = ""

    @property
    def is_transform(self) -> bool:
        return self.target in NOUNS

    def text(self) -> str:
        return " ".join(w for w in (self.color, self.noun, "is", self.target) if w)


@dataclass
class Ruleset:
    """The rules in reading order (row-major by the IS block, horizontal before vertical)."""
    rules: list[Rule] = field(default_factory=list)

    def __post_init__(self):
        self._props: dict[tuple[str, str], set[str]] = {}
        for rule in self.rules:
            if not rule.is_transform:
                self._props.setdefault((rule.noun, rule.color), set()).add(rule.target)

    def has(self, thing: Thing | None, prop: str) -> bool:
        """Whether ``thing`` has property ``prop`` under these rules (only objects can)."""
        if thing is None or thing.kind != "object":
            return False
        return (prop in self._props.get((thing.name, ""), ())
                or prop in self._props.get((thing.name, thing.color), ()))

    def transforms(self) -> list[Rule]:
        return [rule for rule in self.rules if rule.is_transform]


@dataclass
class MoveResult:
    won: bool = False
    lost: bool = False


class Grid:
    """A level in play: ``width x height`` cell stacks (index ``y * width + x``) and its rules.
    Build one with :meth:`empty` (border included) and :meth:`put`."""

    def __init__(self, width: int, height: int, cells: list[list[Thing]]):
        self.width, self.height, self.cells = width, height, cells
        self.rules = Ruleset()

    @classmethod
    def empty(cls, width: int, height: int) -> "Grid":
        """An empty level surrounded by border walls."""
        cells = [[] for _ in range(width * height)]
        grid = cls(width, height, cells)
        for x in range(width):
            for y in range(height):
                if x in (0, width - 1) or y in (0, height - 1):
                    cells[y * width + x].append(BORDER)
        return grid

    def copy(self) -> "Grid":
        twin = Grid(self.width, self.height, [list(stack) for stack in self.cells])
        twin.rules = self.rules
        return twin

    def inside(self, x: int, y: int) -> bool:
        return 0 <= x < self.width and 0 <= y < self.height

    def top(self, x: int, y: int) -> Thing | None:
        stack = self.cells[y * self.width + x]
        return stack[-1] if stack else None

    def put(self, x: int, y: int, thing: Thing) -> None:
        """Stack ``thing`` on top of cell (x, y)."""
        self.cells[y * self.width + x].append(thing)

    def tops(self) -> Iterator[tuple[int, int, Thing]]:
        """``(x, y, top thing)`` of every non-empty cell, row-major."""
        for index, stack in enumerate(self.cells):
            if stack:
                yield index % self.width, index // self.width, stack[-1]

    def state_key(self) -> tuple:
        """Hashable contents (what the player can change; rules follow from it)."""
        return tuple(tuple(t.key for t in stack) for stack in self.cells)

    # -- rules ------------------------------------------------------------------------------

    def read_rules(self) -> None:
        """Read the rules from the word blocks now on top of their cells (from scratch)."""
        rules = []
        for x, y, thing in self.tops():
            if thing.kind != "is":
                continue
            for dx, dy in ((1, 0), (0, 1)):
                rule = self._sentence(x, y, dx, dy)
                if rule is not None:
                    rules.append(rule)
        self.rules = Ruleset(rules)

    def _word_at(self, x: int, y: int) -> Thing | None:
        if not self.inside(x, y):
            return None
        thing = self.top(x, y)
        return thing if thing is not None and thing.is_word else None

    def _sentence(self, x: int, y: int, dx: int, dy: int) -> Rule | None:
        """The rule through the IS at (x, y) along (dx, dy), if the words make one."""
        before, after = self._word_at(x - dx, y - dy), self._word_at(x + dx, y + dy)
        if before is None or after is None or before.kind != "noun":
            return None
        if after.kind not in ("property", "noun"):
            return None
        color = self._word_at(x - 2 * dx, y - 2 * dy)
        shade = color.name if color is not None and color.kind == "color" else ""
        return Rule(before.name, after.name, shade)

    def _transform(self, thing: Thing) -> Rule | None:
        """The first ``A IS B`` rule that turns ``thing`` (a top thing) into another B."""
        return next((rule for rule in self.rules.transforms()
                     if thing.kind == "object" and thing.name == rule.noun
                     and rule.color in ("", thing.color) and rule.target != thing.name), None)

    def apply_transforms(self) -> None:
        """``A IS B``: a new B (default colour) on top of every cell whose top is an A."""
        for x, y, thing in list(self.tops()):
            rule = self._transform(thing)
            if rule is not None:
                self.put(x, y, obj(rule.target))

    # -- moves ------------------------------------------------------------------------------

    def you_things(self) -> list[tuple[int, int, Thing]]:
        """Top things that are YOU, row-major."""
        return [(x, y, t) for x, y, t in self.tops() if self.rules.has(t, "you")]

    def pushable(self, thing: Thing | None) -> bool:
        return thing is not None and (thing.is_word or self.rules.has(thing, "push"))

    def blocks(self, thing: Thing | None) -> bool:
        return thing is not None and (thing.kind == "border" or thing.is_word
                                      or self.rules.has(thing, "stop"))

    def _move(self, x: int, y: int, dx: int, dy: int, result: MoveResult | None) -> bool:
        """Move the top thing of (x, y) one cell, pushing first; True if it moved. ``result``
        (YOU movers only) collects the WIN/LOSE test at the destination."""
        nx, ny = x + dx, y + dy
        if not self.inside(nx, ny):
            return False
        if self.pushable(self.top(nx, ny)):
            self._move(nx, ny, dx, dy, None)
        moved = not self.blocks(self.top(nx, ny))
        if result is not None:
            there = self.top(nx, ny) if moved else self.top(x, y)
            result.won |= self.rules.has(there, "win")
            result.lost |= self.rules.has(there, "lose")
        if moved:
            self.put(nx, ny, self.cells[y * self.width + x].pop())
        return moved

    def step(self, direction: str) -> MoveResult:
        """One non-idle action (a key of DIRECTIONS): move, then re-read rules and transform."""
        dx, dy = DIRECTIONS[direction]
        result = MoveResult()
        for _, _, thing in self.you_things():
            at = self._position_of_top(thing)
            if at is not None:
                self._move(at[0], at[1], dx, dy, result)
        self.read_rules()
        self.apply_transforms()
        return result

    def _position_of_top(self, thing: Thing) -> tuple[int, int] | None:
        """Where ``thing`` is the top of its cell, if anywhere (earlier movers may cover it)."""
        for index, stack in enumerate(self.cells):
            if stack and stack[-1] is thing:
                return index % self.width, index // self.width
        return None

    def can_change_without_you(self) -> bool:
        """Whether a step can still change anything with no YOU object: only a transform acting
        on a top object can (it may create a YOU)."""
        return any(self._transform(thing) is not None for _, _, thing in self.tops())


def parse_level(text: str) -> Grid:
    """A hand-made level: rows of whitespace-separated cells, the border added around.

    ``.`` is an empty cell, a lower-case noun an object (default colour, ``colour:noun`` for
    another, e.g. ``red:ball``), an upper-case word a word block (``BABA``, ``IS``, ``WIN``,
    ``RED``). Several things on one cell are joined by ``+``, bottom first (``ball+BABA``).
    """
    rows = [line.split() for line in text.strip("\n").splitlines() if line.strip()]
    if not rows or any(len(row) != len(rows[0]) for row in rows):
        raise ValueError(f"babaisai level: rows must have the same number of cells, got {text!r}")
    grid = Grid.empty(len(rows[0]) + 2, len(rows) + 2)
    for y, row in enumerate(rows, start=1):
        for x, cell in enumerate(row, start=1):
            if cell == ".":
                continue
            for part in cell.split("+"):
                if part.isupper():
                    grid.put(x, y, word(part.lower()))
                else:
                    color, _, name = part.rpartition(":")
                    grid.put(x, y, obj(name, color or None))
    grid.read_rules()
    return grid
