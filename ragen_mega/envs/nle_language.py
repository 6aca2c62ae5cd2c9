"""NetHack's screen in words, as BALROG's agents read it: a Python rendering of the language
wrapper's text (``nle-language-wrapper``'s ``NLELanguageObsv``, C++, which BALROG runs from its
``balrog-nle`` fork of NLE).

That package does not build on Python 3.11 and pins NLE 0.9, so this module writes the same
text from NLE 1.3's own tables (``nle.nethack``'s monster and object data). Tests check every
field against outputs of the C++ original, recorded with BALROG's stack
(``tests/data/nle_language_reference.npz``).

- :meth:`NLELanguage.glyphs`: what is around the player, one line per name and distance:
  ``"horizontal wall very near north, south, and northwest"``, farthest first. Monsters,
  objects, stairs, fountains and doors are listed wherever they are on the map; walls, dark
  area, doorways and traps only along the eight compass rays, up to 9 cells, each ray ending at
  the first wall. Distance is Chebyshev: 1 "adjacent", 2 "very near", 3-5 "near", 6-19 "far",
  more "very far"; direction one of 16 compass words ("eastnortheast").
- :meth:`NLELanguage.message`: the top line, or a whole menu or multi-page text up to its
  ``--More--`` / ``(end)`` / ``(N of M)`` marker.
- :meth:`NLELanguage.cursor` and :meth:`NLELanguage.inventory`.

The C++ text's quirks are kept, since agents and papers read that text: "alter" for altar, a
plural that doubles a line when a name's plural is itself ("bars"), a death screen's message
starting with a NUL byte.
"""
from __future__ import annotations

import functools

import numpy as np
from nle import nethack as nh

WIDTH, HEIGHT = 79, 21   # the dungeon map, in cells

# NetHack's map symbols in ``glyph_to_cmap`` order, named as the wrapper names them
CMAP = (
    "dark area", "vertical wall", "horizontal wall", "northwest room corner",
    "northeast room corner", "southwest corner", "southeast corner", "cross wall",
    "t up wall", "t down wall", "t west wall", "t east wall", "doorway",
    "vertical open door", "horizontal open door", "vertical closed door",
    "horizontal closed door", "bars", "tree", "room floor", "dark room floor",
    "corridor floor", "lit corridor floor", "stairs up", "stairs down", "ladder up",
    "ladder down", "alter", "grave", "throne", "sink", "fountain", "pool", "ice",
    "lava", "vertical lowered drawbridge", "horizontal lowered drawbridge",
    "vertical raised drawbridge", "horizontal raised drawbridge", "air floor",
    "cloud floor", "water floor", "arrow trap", "dart trap", "falling rock trap",
    "squeaky board", "bear trap", "land mine", "rolling boulder trap",
    "sleeping gas trap", "rust trap", "fire trap", "pit", "spiked pit", "hole",
    "trap door", "teleportation trap", "level teleporter", "magic portal", "web",
    "statue trap", "magic trap", "anti magic trap", "polymorph trap",
    "vibrating square", "vertical beam", "horizontal beam", "left slant beam",
    "right slant beam", "dig beam", "flash beam", "boom left", "boom right",
    "shield 1", "shield 2", "shield 3", "shield 4", "poison cloud", "valid position",
    "swallow top left", "swallow top center", "swallow top right", "swallow middle left",
    "swallow middle right", "swallow bottom left", "swallow bottom center",
    "swallow bottom right", "explosion top left", "explosion top center",
    "explosion top right", "explosion middle left", "explosion middle center",
    "explosion middle right", "explosion bottom left", "explosion bottom center",
    "explosion bottom right", "MAXPCHARS",
)
FLOOR = {"room floor", "dark room floor", "corridor floor", "lit corridor floor"}
# map symbols listed wherever they are (the rest only along the rays)
LANDMARKS = {
    "horizontal closed door", "vertical closed door", "bars", "tree", "stairs up",
    "stairs down", "ladder up", "ladder down", "alter", "grave", "throne", "sink",
    "fountain", "pool", "ice", "lava", "vertical raised drawbridge",
    "horizontal raised drawbridge",
}
# what ends a ray
BLOCKING = {
    "dark area", "vertical wall", "horizontal wall", "northwest room corner",
    "northeast room corner", "southwest corner", "southeast corner", "cross wall",
    "t up wall", "t down wall", "t west wall", "t east wall", "horizontal closed door",
    "vertical closed door", "horizontal raised drawbridge", "vertical raised drawbridge",
}
WORRIES = ("worry", "concern", "anxiety", "disquiet", "alarm", "dread")
SWALLOW = CMAP[-18:-10]
EXPLODE = CMAP[-10:-1]
ZAP = ("horizontal zap beam", "vertical zap beam", "left slant zap beam", "right slant zap beam")
DISTANCES = ("very far", "far", "near", "very near", "adjacent")
DIRECTIONS = ("north", "northnortheast", "northeast", "eastnortheast", "east",
              "eastsoutheast", "southeast", "southsoutheast", "south", "southsouthwest",
              "southwest", "westsouthwest", "west", "westnorthwest", "northwest",
              "northnorthwest")
_ORDER = {(d, r): i for i, (d, r) in enumerate((d, r) for d in DISTANCES for r in DIRECTIONS)}
# the rays, in the wrapper's order: east, southeast, south, southwest, west, northwest, ...
RAYS = ((1, 0), (1, 1), (0, 1), (-1, 1), (-1, 0), (-1, -1), (0, -1), (1, -1))
_BLANK = " \x1a"   # what the wrapper trims off a screen row


def _monster(glyph_offset: int) -> str:
    return nh.permonst(glyph_offset).mname


def _object(glyph: int) -> str:
    """An object's unidentified appearance, as the wrapper writes each class."""
    index = nh.glyph_to_obj(glyph)
    names = nh.objdescr.from_idx(index)
    name, desc = names.oc_name or "", names.oc_descr or ""
    kind = nh.objclass(index).oc_class
    kind = ord(kind) if isinstance(kind, str) else int(kind)
    if kind in (nh.ILLOBJ_CLASS, nh.WEAPON_CLASS, nh.COIN_CLASS, nh.ROCK_CLASS,
                nh.BALL_CLASS, nh.CHAIN_CLASS):
        return name
    if kind in (nh.ARMOR_CLASS, nh.TOOL_CLASS):
        return desc or name
    if kind == nh.AMULET_CLASS:
        return desc if "Amulet" in desc else desc + " amulet"
    if kind == nh.GEM_CLASS:
        return name if desc in name else f"{desc} {name}"
    suffix = {nh.RING_CLASS: " ring", nh.POTION_CLASS: " potion", nh.SPBOOK_CLASS: " spellbook",
              nh.WAND_CLASS: " wand", nh.FOOD_CLASS: ""}
    if kind in suffix:
        return (name if kind == nh.FOOD_CLASS else "") + desc + suffix[kind]
    if kind == nh.SCROLL_CLASS:
        return "scroll labeled " + desc
    if kind == nh.VENOM_CLASS:
        return "splash of " + name
    return ""


def _glyph_names(glyph: int) -> tuple[str, str]:
    """``(listed anywhere, seen along a ray)``: one of them names the glyph, or neither."""
    if glyph >= nh.GLYPH_STATUE_OFF:
        return _monster(glyph - nh.GLYPH_STATUE_OFF) + " statue", ""
    if glyph >= nh.GLYPH_WARNING_OFF:
        return "unknown creature causing you " + WORRIES[nh.glyph_to_warning(glyph)], ""
    if glyph >= nh.GLYPH_SWALLOW_OFF:
        return SWALLOW[(glyph - nh.GLYPH_SWALLOW_OFF) % 8], ""
    if glyph >= nh.GLYPH_ZAP_OFF:
        return ZAP[(glyph - nh.GLYPH_ZAP_OFF) % 4], ""
    if glyph >= nh.GLYPH_EXPLODE_OFF:
        return EXPLODE[(glyph - nh.GLYPH_EXPLODE_OFF) % nh.MAXEXPCHARS], ""
    if glyph >= nh.GLYPH_CMAP_OFF:
        name = CMAP[nh.glyph_to_cmap(glyph)]
        if name in FLOOR:
            return "", ""
        return (name, "") if name in LANDMARKS else ("", name)
    if glyph >= nh.GLYPH_OBJ_OFF:
        return _object(glyph), ""
    for offset, prefix, suffix in ((nh.GLYPH_RIDDEN_OFF, "ridden ", ""),
                                   (nh.GLYPH_BODY_OFF, "", " corpse"),
                                   (nh.GLYPH_DETECT_OFF, "detected ", "")):
        if glyph >= offset:
            return prefix + _monster(glyph - offset) + suffix, ""
    if glyph >= nh.GLYPH_INVIS_OFF:
        return "invisible creature", ""
    if glyph >= nh.GLYPH_PET_OFF:
        return "tame " + _monster(glyph - nh.GLYPH_PET_OFF), ""
    return _monster(glyph), ""


@functools.cache
def _name_tables() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Every glyph's two names (:func:`_glyph_names`), built once a process (half a second)."""
    anywhere, on_ray = zip(*(_glyph_names(g) for g in range(nh.MAX_GLYPH)))
    return anywhere, on_ray


def pluralize(noun: str) -> str:
    """The wrapper's English plural (for a name seen twice in one direction)."""
    if noun.endswith(("boots", "shoes", "scales", "lenses", "bars")):
        return noun
    special = {"can of grease": "cans of grease", "Master of Thieves": "Masters of Thieves",
               "ice": "area of ice", "lava": "area of lava", "": "s"}
    if noun in special:
        return special[noun]
    for head in ("boom", "shield", "swallow", "scroll", "worthless piece", "unknown creature"):
        if noun.startswith(head + " "):
            return head + "s" + noun[len(head):]
    if noun[-1] == "y" and (len(noun) < 2 or noun[-2] not in "aeiou"):
        return noun[:-1] + "ies"
    if noun[-1] in "zxs" or noun.endswith("sh"):
        return noun + "es"
    if noun[-1] == "f":
        return noun[:-2 if noun.endswith("ff") else -1] + "ves"
    return noun + "s"


def where(x: int, y: int) -> tuple[str, str]:
    """``(distance, direction)`` of a cell ``x`` east and ``y`` north of the player."""
    diag = min(abs(x), abs(y))
    diagonal = ""
    if diag:
        diagonal = ("south" if y < 0 else "north") + ("west" if x < 0 else "east")
    x_rest, y_rest = x - diag * np.sign(x), y - diag * np.sign(y)
    off = max(abs(x), abs(y))
    distance = ("adjacent" if off == 1 else "very near" if off == 2 else "near" if off < 6
                else "far" if off < 20 else "very far")
    return distance, (("south" if y_rest < 0 else "north" if y_rest > 0 else "")
                      + ("west" if x_rest < 0 else "east" if x_rest > 0 else "") + diagonal)


def _join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else (
        " and ".join(words) if len(words) == 2 else ", ".join(words[:-1]) + ", and " + words[-1])


def _trim(row: str) -> str:
    """The wrapper's trim: a row whose only non-blank character is its last one trims to ""."""
    start = next((i for i, ch in enumerate(row) if ch not in _BLANK), None)
    return "" if start is None or start == len(row) - 1 else row.strip(_BLANK)


class NLELanguage:
    """The text fields of one NLE observation (arrays as NLE returns them)."""

    @property
    def _names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return _name_tables()

    def glyphs(self, glyphs: np.ndarray, blstats: np.ndarray) -> str:
        anywhere, on_ray = self._names
        px, py = int(blstats[0]), int(blstats[1])
        seen = []
        for (gy, gx), glyph in np.ndenumerate(glyphs):
            name = anywhere[glyph]
            if name and (gx, gy) != (px, py):
                seen.append((name, *where(gx - px, py - gy)))
        for dx, dy in RAYS:
            for off in range(1, 10):
                gx, gy = px + dx * off, py + dy * off
                if not (0 <= gx < WIDTH and 0 <= gy < HEIGHT):
                    break
                glyph = glyphs[gy, gx]
                if not anywhere[glyph] and on_ray[glyph]:
                    seen.append((on_ray[glyph], *where(gx - px, py - gy)))
                    if on_ray[glyph] in BLOCKING:
                        break
        seen.sort(key=lambda item: _ORDER[item[1:]])
        groups: dict[tuple[str, str], list[str]] = {}
        for name, distance, direction in seen:
            groups.setdefault((name, distance), []).append(direction)
        # a direction seen once under the name, seen more often under its plural; a plural
        # equal to its noun ("bars") takes the noun's entry, and its line comes twice
        order, entries = [], {}
        for (name, distance), directions in groups.items():
            once = [d for d in dict.fromkeys(directions) if directions.count(d) == 1]
            more = [d for d in dict.fromkeys(directions) if directions.count(d) > 1]
            for label, words in ((name, once), (pluralize(name), more)):
                if words:
                    order.append((label, distance))
                    entries[label, distance] = words
        return "\n".join(f"{label} {distance} {_join(entries[label, distance])}"
                         for label, distance in order)

    def message(self, tty_chars: np.ndarray) -> str:
        rows = [bytes(row).decode("latin-1") for row in tty_chars]
        first = rows[0]
        if not _trim(first) and not _trim(rows[1]):
            return ""
        # The C++ reads each row from the top line's indent; a blank top line (a death screen)
        # makes that index wrap around, so every row starts one byte early.
        indent = len(first) - len(first.lstrip(" ")) if first.strip(" ") else -1
        screen, width = "\x00" + "".join(rows), len(first)
        death = "Points" in rows[1] or "list!" in rows[1]
        out, blanks = "", 0
        for i in range(len(rows)):
            start = 1 + i * width + indent
            row = _trim(screen[start:start + width - indent])
            blanks = blanks + 1 if not row else 0
            at = row.find(" of ")
            marker = ("--More--" in row or "(end)" in row
                      or (at >= 2 and at + 5 < len(row) and row[at - 2] == "("
                          and row[at + 5] == ")"))
            out += row
            if marker:
                return out
            if row:
                out += "\n"
            if death and blanks > 1:
                return out
        return _trim(first)

    def cursor(self, glyphs: np.ndarray, blstats: np.ndarray, tty_cursor: np.ndarray) -> str:
        px, py = int(blstats[0]), int(blstats[1])
        cx, cy = int(tty_cursor[1]), int(tty_cursor[0]) - 1
        index = cx + cy * WIDTH
        if not (-WIDTH <= cx - px < WIDTH and -HEIGHT <= py - cy < HEIGHT
                and 0 < index < glyphs.size):
            return ""
        name = self._names[0][glyphs.reshape(-1)[index]]
        if (cx, cy) == (px, py):
            return "Yourself a " + name
        distance, direction = where(cx - px, py - cy)
        return f"{distance} {direction} {name}"

    @staticmethod
    def inventory(inv_strs: np.ndarray, inv_letters: np.ndarray) -> str:
        lines = []
        for letter, text in zip(inv_letters, inv_strs):
            if letter == 0:
                break
            name = bytes(text).split(b"\0", 1)[0].decode("latin-1")
            lines.append(f"{chr(letter)}: {name}")
        return "\n".join(lines)
