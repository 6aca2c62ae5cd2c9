"""Record tests/data/nle_language_reference.npz: what BALROG's C++ language wrapper writes for a
varied set of NetHack and MiniHack observations.

The wrapper (``nle.nle_language_obsv.NLELanguageObsv``) ships compiled in the ``balrog-nle``
0.9.0 wheel, BALROG's fork of NLE. tests/test_nethack.py checks ragen_mega's Python port
(``ragen_mega.envs.nle_language``) against these outputs, so the reference comes from the C++
itself, not from the port.

balrog-nle and nle install the same import name, ``nle``, so this runs in a venv of its own,
never the project's (balrog-nle 0.9.0 has a Python 3.11 wheel; the minihack fork imports
``pkg_resources``, hence setuptools<81)::

    python3.11 -m venv nle09
    nle09/bin/pip install balrog-nle==0.9.0 gym==0.23.0 "numpy<2" "setuptools<81"
    nle09/bin/pip install --no-deps \
        git+https://github.com/balrog-ai/minihack@3ecb6da4eadcac7a4dbc5f8e801ccf636e34d7ec
    nle09/bin/python -m minihack.scripts.download_boxoban_levels
    nice nle09/bin/python tools/record_nle_language_reference.py [OUT.npz]

It takes about a minute on one core. Boxoban draws its level with ``random.choice`` from the
level files in ``os.listdir`` order (ext4 gave 000, 003, 002, 001), so on another file system
the Boxoban rows may come out different.

How it works
1. Random play: for every task and episode seed s, ``random.seed(s)`` (Boxoban draws its level
   from the global ``random``), ``env.unwrapped.seed(s, s, False)``, ``reset()``, then actions
   drawn with ``random.Random(s)``. NetHackChallenge runs with its default observation keys and
   all its actions (menus and --More-- are not skipped); odd seeds lean towards moves, to see
   more of the map. MiniHack runs with BALROG's observation keys, character "@" and
   autopickup off, and each task's own actions. Every observation, the first and the last
   included, is a candidate.
2. Each candidate gets feature tags from the C++ texts and the raw arrays: multi-line,
   --More--, (end) and (N of M) messages, death screens, the cursor off the player, pets,
   corpses, statues, plural lines, ... Two tags ask the port (``plural``: the glyph text has a
   plural line; ``msg_trim_quirk``: the C++ trim quirk changes the message). They only steer
   the selection: every stored text comes from the C++.
3. A deterministic greedy pick per task (a quota each) maximises the coverage of the tags (per
   task and overall) and of distinct object, monster and map feature names.
4. Hand-made inputs (arrays ``synth_*``, apart from the observations) cover what random play
   never reached: blstats with several status conditions at once or odd enum values (C++
   text_blstats) and tty screens for the C++ trim quirk (C++ text_message).
5. Texts are decoded latin-1 and stored as numpy unicode arrays, so
   ``np.load(..., allow_pickle=False)`` reads the file.
"""
import collections
import random
import re
import sys
import warnings
from pathlib import Path
from unittest import mock

warnings.filterwarnings("ignore")
import gym  # noqa: E402
import minihack  # noqa: E402,F401  (registers the MiniHack tasks)
import numpy as np  # noqa: E402
from nle import nethack as nh  # noqa: E402
from nle import nle_language_obsv  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ragen_mega.envs import nle_language  # noqa: E402  (the port: two selection tags only)

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests/data/nle_language_reference.npz"
MH_KEYS = ["glyphs", "blstats", "tty_chars", "inv_letters", "inv_strs", "tty_cursor",
           "tty_colors"]
KEEP = ["glyphs", "blstats", "tty_chars", "tty_cursor", "inv_letters", "inv_strs"]
# task, [(episode seeds, steps per episode at most), ...], rows in the fixture.
# NetHackChallenge: 12 long episodes plus 100 short ones (more starting rooms: statues,
# fountains, objects).
TASKS = [
    ("NetHackChallenge-v0", [(range(0, 12), 700), (range(160, 260), 40)], 64),
    ("MiniHack-Quest-Medium-v0", [(range(0, 10), 300)], 26),
    ("MiniHack-CorridorBattle-Dark-v0", [(range(0, 10), 300)], 22),
    ("MiniHack-MazeWalk-15x15-v0", [(range(0, 5), 250)], 14),
    ("MiniHack-Boxoban-Hard-v0", [(range(0, 5), 150)], 16),
    ("MiniHack-Corridor-R3-v0", [(range(0, 6), 300)], 18),
]
# the tags' weights in the selection (1.0 for the rest)
LOW = {"align_-1", "align_0", "align_1", "dirs_2", "dirs_3plus", "feature_cmap", "msg_single",
       "cursor_player", "inv_some", "inv_many"}
HIGH = {"msg_multiline", "msg_more", "msg_end", "msg_n_of_m", "death_screen", "top_ten",
        "msg_nul_prefix", "msg_trim_quirk", "final", "reset", "cursor_off_player",
        "cursor_no_glyph", "pet", "corpse", "statue", "plural", "object", "monster", "ordinary",
        "non_ascii"}
WEIGHT = collections.defaultdict(lambda: 1.0, {**{t: 0.3 for t in LOW}, **{t: 2.0 for t in HIGH}})
# per task, rows picked first for these tags (as many as the task's candidates have)
MINS = [("reset", 2), ("final", 2), ("death_screen", 3), ("msg_n_of_m", 6), ("msg_more", 8),
        ("msg_end", 8), ("msg_trim_quirk", 3), ("statue", 4), ("corpse", 3), ("trap", 2),
        ("cursor_off_player", 4), ("cursor_empty", 3), ("plural", 4), ("non_ascii", 2),
        ("ordinary", 3)]
MOVES = {"N", "E", "S", "W", "NE", "SE", "SW", "NW"}
FIELDS = ["text_glyphs", "text_blstats", "text_inventory", "text_cursor", "text_message"]
NOFM = re.compile(r"\(\d of \d\)")
LINE = re.compile(r"^(.*?) (very far|far|near|very near|adjacent) [a-z ,]+$")
GLYPH_KINDS = [
    ("pet", nh.GLYPH_PET_OFF, nh.GLYPH_INVIS_OFF),
    ("invisible", nh.GLYPH_INVIS_OFF, nh.GLYPH_DETECT_OFF),
    ("detected", nh.GLYPH_DETECT_OFF, nh.GLYPH_BODY_OFF),
    ("corpse", nh.GLYPH_BODY_OFF, nh.GLYPH_RIDDEN_OFF),
    ("ridden", nh.GLYPH_RIDDEN_OFF, nh.GLYPH_OBJ_OFF),
    ("object", nh.GLYPH_OBJ_OFF, nh.GLYPH_CMAP_OFF),
    ("explode", nh.GLYPH_EXPLODE_OFF, nh.GLYPH_ZAP_OFF),
    ("zap", nh.GLYPH_ZAP_OFF, nh.GLYPH_SWALLOW_OFF),
    ("swallow", nh.GLYPH_SWALLOW_OFF, nh.GLYPH_WARNING_OFF),
    ("warning", nh.GLYPH_WARNING_OFF, nh.GLYPH_STATUE_OFF),
    ("statue", nh.GLYPH_STATUE_OFF, nh.MAX_GLYPH),
]

cpp = nle_language_obsv.NLELanguageObsv()
port = nle_language.NLELanguage()


def cpp_texts(o):
    out = (cpp.text_glyphs(o["glyphs"], o["blstats"]), cpp.text_blstats(o["blstats"]),
           cpp.text_inventory(o["inv_strs"], o["inv_letters"]),
           cpp.text_cursor(o["glyphs"], o["blstats"], o["tty_cursor"]),
           cpp.text_message(o["tty_chars"]))
    return tuple(x.decode("latin-1") for x in out)


def has_plural(glyphs, blstats):
    """Whether the port's glyph text has a plural line (one name seen twice in one direction):
    with every plural written as a NUL, whether its text has a NUL."""
    with mock.patch.object(nle_language, "pluralize", lambda noun: "\x00"):
        return "\x00" in port.glyphs(glyphs, blstats)


def plain_trim_message(tty_chars):
    """The port's message with an ordinary strip(): it differs from the C++ text only where the
    C++ trim quirk (a row whose only non-blank character is its last one trims to "") matters."""
    with mock.patch.object(nle_language, "_trim", lambda row: row.strip(" \x1a")):
        return port.message(tty_chars)


def features(o, out, t, done):
    tg, _, _, tc, tm = out
    b = o["blstats"]
    row1 = bytes(o["tty_chars"][1]).decode("latin-1")
    lines = tg.split("\n") if tg else []
    tags = {"align_%d" % int(b[26])}
    checks = {
        "reset": t == 0,
        "final": done,
        "msg_empty": tm == "",
        "msg_single": tm != "" and "\n" not in tm,
        "msg_multiline": "\n" in tm,
        "msg_more": "--More--" in tm,
        "msg_end": "(end)" in tm,
        "msg_n_of_m": bool(NOFM.search(tm)),
        "msg_trim_quirk": plain_trim_message(o["tty_chars"]) != tm,
        "msg_nul_prefix": tm.startswith("\x00"),
        "death_screen": "Points" in row1 or "list!" in row1,
        "top_ten": "top ten" in tm,
        "inv_empty": o["inv_letters"][0] == 0,
        "inv_many": o["inv_letters"][0] != 0 and (o["inv_letters"] != 0).sum() >= 8,
        "inv_some": o["inv_letters"][0] != 0 and (o["inv_letters"] != 0).sum() < 8,
        "cursor_empty": tc == "",
        "cursor_player": tc.startswith("Yourself"),
        "cursor_off_player": tc != "" and not tc.startswith("Yourself"),
        "cursor_no_glyph": tc != "" and not tc.startswith("Yourself") and tc.endswith(" "),
        "plural": has_plural(o["glyphs"], b),
        "glyphs_empty": tg == "",
        "dirs_3plus": any(", and " in ln for ln in lines),
        "dirs_2": any(" and " in ln and ", and " not in ln for ln in lines),
        "very_far": any(" very far " in ln for ln in lines),
        "feature_cmap": any(n in tg for n in (
            "closed door", "stairs", "fountain", "altar", "alter", "sink", "throne", "grave",
            "tree", "pool", "lava", "bars", "ladder")),
        "trap": any(w in tg for w in ("trap", "web", "pit", "hole")),
        "condition": int(b[25]) != 0,
        "hunger_other": int(b[21]) != 1,
        "encumbered": int(b[22]) != 0,
        "gold": int(b[13]) != 0,
        "hp_below_max": int(b[10]) < int(b[11]),
        "xp_gt1": int(b[18]) > 1,
        "non_ascii": any(ord(ch) > 126 for f in out for ch in f if ch != "\x00"),
    }
    tags |= {tag for tag, hit in checks.items() if hit}
    g = o["glyphs"].astype(np.int64)
    g[int(b[1]), int(b[0])] = -1  # the player's own cell
    if ((g >= 0) & (g < nh.GLYPH_PET_OFF)).any():
        tags.add("monster")
    tags |= {name for name, lo, hi in GLYPH_KINDS if ((g >= lo) & (g < hi)).any()}
    if not tags & {"msg_multiline", "cursor_off_player", "cursor_empty", "death_screen", "final",
                   "reset"}:
        tags.add("ordinary")
    names = {m.group(1) for m in map(LINE.match, lines) if m}
    return tags, names


def collect(task, segments):
    """Every observation of the task's random episodes, with its C++ texts and tags."""
    kw = {} if task.startswith("NetHack") else {
        "observation_keys": MH_KEYS, "character": "@", "autopickup": False}
    env = gym.make(task, **kw)
    u = env.unwrapped
    actions = list(u.actions)
    moves = [i for i, a in enumerate(actions) if getattr(a, "name", "") in MOVES]
    cands = []
    for s, max_steps in [(s, n) for seeds, n in segments for s in seeds]:
        random.seed(s)
        u.seed(s, s, False)
        o, done = env.reset(), False
        rng = random.Random(s)
        lean = task.startswith("NetHack") and s % 2 == 1
        for t in range(max_steps + 1):
            # copies: NLE reuses its buffers
            cands.append((s, t, {k: np.array(o[k], copy=True) for k in KEEP}, done))
            if done or t == max_steps:
                break
            a = rng.choice(moves) if lean and rng.random() < 0.6 else rng.randrange(len(actions))
            o, _, done, _ = env.step(a)
    env.close()
    rows = []
    for s, t, o, done in cands:
        out = cpp_texts(o)
        tags, names = features(o, out, t, done)
        rows.append(dict(task=task, seed=s, step=t, obs=o, out=out, tags=tags, names=names))
    return rows


def select(rows, quota, cov_global, names_global):
    """``quota`` row indices, greedily, each adding the most tag and name coverage."""
    cov_task = collections.Counter()
    near = collections.defaultdict(list)
    msgs, heads, glyph_texts = set(), set(), set()
    chosen, left = [], list(range(len(rows)))
    tie = random.Random(12345)
    keys = {i: tie.random() for i in left}

    def score(i):
        r = rows[i]
        sc = sum(WEIGHT[f] * (1.0 / (1 + cov_task[f]) + 1.0 / (1 + cov_global[f]))
                 for f in r["tags"])
        sc += 0.3 * len(r["names"] - names_global)
        # against near-duplicates: neighbouring steps, one episode, repeated texts
        sc -= 0.5 * sum(1 for st in near.get(r["seed"], ()) if abs(st - r["step"]) < 3)
        sc -= 0.4 * len(near.get(r["seed"], ()))
        head = r["out"][4].split("\n", 1)[0]
        sc -= (3.0 * (r["out"][4] in msgs) + 1.0 * (head in heads)
               + 2.0 * (r["out"][0] in glyph_texts))
        return (sc, keys[i])

    def take(best):
        chosen.append(best)
        left.remove(best)
        r = rows[best]
        near[r["seed"]].append(r["step"])
        msgs.add(r["out"][4])
        heads.add(r["out"][4].split("\n", 1)[0])
        glyph_texts.add(r["out"][0])
        cov_task.update(r["tags"])
        cov_global.update(r["tags"])
        names_global.update(r["names"])

    for tag, k in MINS:
        while cov_task[tag] < k and len(chosen) < quota:
            pool = [i for i in left if tag in rows[i]["tags"]]
            if not pool:
                break
            take(max(pool, key=score))
    while len(chosen) < quota:
        take(max(left, key=score))
    return sorted(chosen, key=lambda i: (rows[i]["seed"], rows[i]["step"]))


def synthetic(base_blstats):
    """Several status conditions at once (the C++ prints them in its unordered_map's order), odd
    enum values, and tty screens for the C++ trim quirk."""
    rng = random.Random(7)
    masks = [1 << i for i in range(13)]  # BL_MASK_STONE .. BL_MASK_RIDE
    conds = masks + [0, sum(masks), 0x1001, 0x3, 0x820, 0x1800] + [
        sum(rng.sample(masks, rng.randint(2, 9))) for _ in range(8)]
    changes = [(25, c) for c in conds] + [
        (21, 0), (21, 4), (21, 9), (22, 3), (22, 9), (26, -1), (26, -128), (26, 5)]
    bl = np.stack([np.array(base_blstats, dtype=np.int64) for _ in changes])
    for b, (idx, val) in zip(bl, changes):
        b[idx] = val

    def screen(rows):
        t = np.full((24, 80), ord(" "), dtype=np.uint8)
        for i, text in rows.items():
            t[i, :len(text)] = np.frombuffer(text.encode("latin-1"), dtype=np.uint8)
        return t
    screens = np.stack([
        screen({0: " " * 79 + "x", 1: "Hello there"}),
        screen({0: "x", 1: " " * 79 + "y"}),
        screen({0: "Things that are here:", 1: " " * 79 + "}", 2: "a lone letter at the end:",
                3: " " * 60 + "q" + " " * 18 + "r", 4: "--More--"}),
        screen({0: "      Pick an object", 1: "      a - a", 2: " " * 79 + "b",
                3: "      (1 of 2)"}),
        screen({0: "\x1a\x1a Message with SUB bytes \x1a", 1: "x" + " " * 10 + "y",
                2: "(end)"}),
        # (no screen with a blank row 0: there the C++ reads one byte before the buffer)
    ])
    return {
        "synth_blstats": bl,
        "synth_text_blstats": [cpp.text_blstats(b).decode("latin-1") for b in bl],
        "synth_tty_chars": screens,
        "synth_text_message": [cpp.text_message(t.copy()).decode("latin-1") for t in screens],
    }


def main():
    cov_global, names_global = collections.Counter(), set()
    picked = []
    for task, segments, quota in TASKS:
        rows = collect(task, segments)
        sel = select(rows, quota, cov_global, names_global)
        print(f"{task}: {len(rows)} candidates, picked {len(sel)}", flush=True)
        picked += [rows[i] for i in sel]
    dtypes = {"glyphs": np.int16, "blstats": np.int64, "tty_chars": np.uint8,
              "tty_cursor": np.uint8, "inv_letters": np.uint8, "inv_strs": np.uint8}
    arr = {k: np.stack([r["obs"][k] for r in picked]).astype(t) for k, t in dtypes.items()}
    texts = {f: [r["out"][k] for r in picked] for k, f in enumerate(FIELDS)}
    synth = synthetic(arr["blstats"][0])
    texts.update({k: synth.pop(k) for k in ("synth_text_blstats", "synth_text_message")})
    arr.update(synth)
    for k, strings in texts.items():
        arr[k] = np.array(strings, dtype=str)
        # numpy unicode arrays drop trailing NULs: every text must survive the round trip
        assert [str(a) for a in arr[k]] == strings, k
    arr["task"] = np.array([r["task"] for r in picked], dtype=str)
    arr["episode_seed"] = np.array([r["seed"] for r in picked], dtype=np.int32)
    arr["step"] = np.array([r["step"] for r in picked], dtype=np.int32)
    arr["source"] = np.array("balrog-nle 0.9.0 nle.nle_language_obsv.NLELanguageObsv (C++), "
                             "outputs decoded latin-1; made by "
                             "tools/record_nle_language_reference.py")
    assert arr["blstats"].shape[1] == nh.NLE_BLSTATS_SIZE == 27
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arr)
    print(f"{len(picked)} rows, {OUT.stat().st_size} bytes -> {OUT}")


if __name__ == "__main__":
    main()
