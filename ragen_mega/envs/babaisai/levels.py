"""The 40 BabaIsAI levels of BALROG's task list, each drawn from its own seeded generator.

A task id reads ``[two_room-]<scenario>[-<distractors>]``. Scenarios: ``goto_win`` (walk to the
WIN object), ``make_win`` (its noun was pushed out of ``<obj> IS WIN``: put it back first),
``break_stop`` (``WALL IS STOP`` keeps you in the left room: break it), ``maybe_break_stop``
(the objects may lie in either room), ``make_you`` (make another object YOU), ``make_wall_win``
(the only way: break ``WALL IS STOP``, then make ``WALL IS WIN``). Distractors:

=========================  ==========================================================
(none)                     nothing else
``distr_obj``              a second object (not WIN)
``distr_rule``             a noun block of that second object
``distr_obj_rule``         both
``distr_obj-irrelevant_rule``  the second object and the noun of a third, absent one
``distr_win_rule``         second object, its noun, and an active ``<third> IS WIN``
=========================  ==========================================================

Layouts, regions and placement order follow the original generators (rooms of 8x8 and 13x9
cells with the border; the win object ``obj1``, the distractor ``obj2`` and the third name
``obj3`` drawn without replacement from ball/key/door, colours with replacement from
red/blue/green). Randomness comes only from ``numpy.random.default_rng(seed)``, so a seed gives
the same level in every process. The original reads numpy's global generator and ignores the
seed, so its levels are reproduced in distribution, not bit for bit. A random position is uniform
over the empty cells of its region, as the original's rejection sampling draws it. Where the
original leaves a placement open, the function says "our choice".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ragen_mega.envs.babaisai.grid import Grid, obj, word

Cells = Sequence[tuple[int, int]]
LEVEL_COLORS = ("red", "blue", "green")
LEVEL_OBJECTS = ("ball", "key", "door")
SUFFIXES = ("", "-distr_obj", "-distr_rule", "-distr_obj_rule", "-distr_obj-irrelevant_rule")


def box(x0: int, x1: int, y0: int, y1: int) -> list[tuple[int, int]]:
    """Cells with x in x0..x1 and y in y0..y1 (inclusive), row-major."""
    return [(x, y) for y in range(y0, y1 + 1) for x in range(x0, x1 + 1)]


@dataclass(frozen=True)
class Distractors:
    obj: bool = False         # place obj2 on the map
    rule: bool = False        # place a noun block (obj2's, or obj3's when irrelevant)
    irrelevant: bool = False  # the noun block is obj3's
    win_rule: bool = False    # an active "<obj3> is win"

    @classmethod
    def from_suffix(cls, suffix: str) -> "Distractors":
        return {
            "": cls(),
            "-distr_obj": cls(obj=True),
            "-distr_rule": cls(rule=True),
            "-distr_obj_rule": cls(obj=True, rule=True),
            "-distr_obj-irrelevant_rule": cls(obj=True, rule=True, irrelevant=True),
            "-distr_win_rule": cls(obj=True, rule=True, win_rule=True),
        }[suffix]


class Builder:
    """A grid under construction plus the level's random draws."""

    def __init__(self, rng: np.random.Generator, width: int, height: int):
        self.rng, self.grid = rng, Grid.empty(width, height)
        names = rng.permutation(len(LEVEL_OBJECTS))
        self.obj1, self.obj2, self.obj3 = (LEVEL_OBJECTS[i] for i in names)
        self.colors = {name: LEVEL_COLORS[rng.integers(len(LEVEL_COLORS))]
                       for name in (self.obj1, self.obj2, self.obj3)}

    def rule(self, x: int, y: int, words: Sequence[str]) -> None:
        """A horizontal sentence starting at (x, y), stacked on whatever is there."""
        for dx, text in enumerate(words):
            self.grid.put(x + dx, y, word(text))

    def random_cell(self, region: Cells) -> tuple[int, int]:
        """A uniformly drawn empty cell of ``region``."""
        free = [cell for cell in region if self.grid.top(*cell) is None]
        if not free:
            raise RuntimeError(f"babaisai level: no empty cell left in region {list(region)}")
        return free[int(self.rng.integers(len(free)))]

    def place(self, thing_name: str, region: Cells, as_word: bool = False) -> None:
        x, y = self.random_cell(region)
        self.grid.put(x, y, word(thing_name) if as_word else
                      obj(thing_name, self.colors.get(thing_name)))

    def place_objects(self, baba_region: Cells, objects: Cells, distr: "Distractors",
                      win_rule_at: tuple[int, int]) -> None:
        """The last steps of a level: baba, the win object, the distractor object if any, then
        the distractor ``<obj3> IS WIN`` if any (last, so it may cover what lies there)."""
        self.place("baba", baba_region)
        self.place(self.obj1, objects)
        if distr.obj:
            self.place(self.obj2, objects)
        if distr.win_rule:
            self.rule(*win_rule_at, (self.obj3, "is", "win"))

    def relocate(self, cell: tuple[int, int], region: Cells) -> None:
        """Move the top thing of ``cell`` to a random empty cell of ``region``."""
        x, y = self.random_cell(region)
        self.grid.put(x, y, self.grid.cells[cell[1] * self.grid.width + cell[0]].pop())


# -- one room (8x8: interior x, y in 1..6) -------------------------------------------------------

#: where a one-room distractor noun may lie: cells along the border, where it starts no rule
ONE_ROOM_DISTRACTOR_CELLS = sorted(set(box(4, 6, 6, 6) + box(4, 6, 1, 1) + box(6, 6, 1, 6)),
                                   key=lambda cell: (cell[1], cell[0]))


def one_room(rng: np.random.Generator, make_win: bool, distr: Distractors) -> Grid:
    """``BABA IS YOU`` and ``<obj1> IS WIN`` lie against the border, so they cannot be broken;
    ``make_win`` moves the win noun inside. A distractor noun lies on a border cell, where it can
    never start a rule."""
    b = Builder(rng, 8, 8)
    b.rule(1, 6, ("baba", "is", "you"))
    b.rule(1, 1, (b.obj1, "is", "win"))
    if make_win:
        b.relocate((1, 1), box(2, 5, 2, 5))
    if distr.rule:
        b.place(b.obj3 if distr.irrelevant else b.obj2, ONE_ROOM_DISTRACTOR_CELLS, as_word=True)
    objects = box(1, 6, 2, 6)
    b.place_objects(objects, objects, distr, win_rule_at=(4, 4))
    return b.grid


# -- two rooms (13x9: interior x 1..11, y 1..7; inner wall at x = 6) -----------------------------

LEFT_PUSHABLE = box(2, 5, 3, 5)
RIGHT_PUSHABLE = box(7, 10, 3, 5)
LEFT_ANYWHERE = box(1, 4, 1, 7)
RIGHT_ANYWHERE = box(7, 10, 2, 7)
ANYWHERE = box(1, 11, 2, 7)
RIGHT_UNPUSHABLE = box(11, 11, 2, 6) + box(8, 11, 7, 7)


def _inner_wall(b: Builder) -> None:
    for y in range(1, 8):
        b.grid.put(6, y, obj("wall"))


def two_room(rng: np.random.Generator, break_stop: bool, make_win: bool, objects: Cells,
             distr: Distractors) -> Grid:
    """``BABA IS YOU`` and ``WALL IS STOP`` in the left room, ``<obj1> IS WIN`` in the right.
    ``break_stop`` moves IS or STOP (50/50) into the left pushable area; ``make_win`` moves the
    win noun into the right pushable area."""
    b = Builder(rng, 13, 9)
    _inner_wall(b)
    b.rule(1, 7, ("baba", "is", "you"))
    b.rule(1, 2, ("wall", "is", "stop"))
    b.rule(9, 1, (b.obj1, "is", "win"))
    if distr.irrelevant:
        b.place(b.obj3, RIGHT_PUSHABLE, as_word=True)
    elif distr.rule:
        b.place(b.obj2, RIGHT_UNPUSHABLE if distr.obj else RIGHT_PUSHABLE, as_word=True)
    if break_stop:
        b.relocate((2 + int(rng.integers(2)), 2), LEFT_PUSHABLE)
    if make_win:
        b.relocate((9, 1), RIGHT_PUSHABLE)
    b.place_objects(LEFT_PUSHABLE, objects, distr, win_rule_at=(9, 4))
    return b.grid


def two_room_make_you(rng: np.random.Generator, make_win: bool) -> Grid:
    """``BABA IS YOU`` is breakable, ``WALL IS STOP`` lies against the border (unbreakable).
    obj2's noun lies in the left 3x3 pushable area, baba too (our choice); both objects in the
    right room, so the way out is to make obj2 YOU. ``make_win`` also moves the win noun into the
    right 3x3 area."""
    b = Builder(rng, 13, 9)
    _inner_wall(b)
    b.rule(1, 6, ("baba", "is", "you"))
    b.rule(1, 1, ("wall", "is", "stop"))
    b.rule(9, 1, (b.obj1, "is", "win"))
    left, right = box(2, 4, 3, 5), box(8, 10, 3, 5)
    b.place(b.obj2, left, as_word=True)
    if make_win:
        b.relocate((9, 1), right)
    b.place("baba", left)
    b.place(b.obj1, RIGHT_ANYWHERE)
    b.place(b.obj2, RIGHT_ANYWHERE)
    return b.grid


def two_room_make_wall_win(rng: np.random.Generator) -> Grid:
    """The win noun lies on a right cell where it can never rejoin its rule; an obj3 noun lies in
    the right pushable area. Baba starts in the left pushable area, both objects in the right
    room (our choice), so the way to win is to break ``WALL IS STOP``, make ``WALL IS WIN`` and
    walk onto a wall."""
    b = Builder(rng, 13, 9)
    _inner_wall(b)
    b.rule(1, 7, ("baba", "is", "you"))
    b.rule(2, 2, ("wall", "is", "stop"))
    b.rule(9, 1, (b.obj1, "is", "win"))
    b.relocate((9, 1), RIGHT_UNPUSHABLE)
    b.place(b.obj3, RIGHT_PUSHABLE, as_word=True)
    b.place("baba", LEFT_PUSHABLE)
    b.place(b.obj1, RIGHT_ANYWHERE)
    b.place(b.obj2, RIGHT_ANYWHERE)
    return b.grid


def _task_table() -> dict[str, Callable[[np.random.Generator], Grid]]:
    table: dict[str, Callable[[np.random.Generator], Grid]] = {}
    for scenario, make_win in (("goto_win", False), ("make_win", True)):
        for suffix in SUFFIXES:
            distr = Distractors.from_suffix(suffix)
            table[scenario + suffix] = (
                lambda rng, m=make_win, d=distr: one_room(rng, m, d))
    two_rooms = {  # scenario -> (break stop, make win, object region, suffixes)
        "goto_win": (True, False, LEFT_ANYWHERE, SUFFIXES + ("-distr_win_rule",)),
        "break_stop-goto_win": (False, False, RIGHT_ANYWHERE, SUFFIXES),
        "maybe_break_stop-goto_win": (False, False, ANYWHERE, SUFFIXES),
        "make_win": (True, True, LEFT_ANYWHERE, SUFFIXES + ("-distr_win_rule",)),
        "break_stop-make_win": (False, True, RIGHT_ANYWHERE, SUFFIXES),
    }
    for scenario, (stop, win, region, suffixes) in two_rooms.items():
        for suffix in suffixes:
            distr = Distractors.from_suffix(suffix)
            table[f"two_room-{scenario}{suffix}"] = (
                lambda rng, s=stop, w=win, r=region, d=distr: two_room(rng, s, w, r, d))
    table["two_room-make_you"] = lambda rng: two_room_make_you(rng, make_win=False)
    table["two_room-make_you-make_win"] = lambda rng: two_room_make_you(rng, make_win=True)
    table["two_room-make_wall_win"] = two_room_make_wall_win
    return table


#: task id (BALROG's, without its "env/" prefix) -> generator taking a numpy Generator
TASKS = _task_table()


def generate(task: str, seed: int) -> Grid:
    """The level of ``task`` for ``seed``, with its rules read."""
    grid = TASKS[task](np.random.default_rng(seed))
    grid.read_rules()
    return grid
