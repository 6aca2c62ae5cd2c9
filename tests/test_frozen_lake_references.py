"""Reference success rates of FrozenLake (``ragen_mega.envs.frozen_lake_references``): values
worked out on paper for a 2x2 and a 3x3 map, an exact model written here from the documented
rules (fractions, own slip model, own search over answers and policies) on more small maps, the
order of the lines on random maps, and the real env played many times."""
from __future__ import annotations

import functools
import itertools
from fractions import Fraction

import numpy as np
import pytest

from ragen_mega.envs import make
from ragen_mega.envs.frozen_lake_references import (
    Lake, best_fixed, best_fixed_answer, example_copy, mean_references, optimal, optimal_per_turn,
    random_valid, references)

EXACT = 1e-12
#: a 2x2 lake: start top-left, ice top-right, hole bottom-left, goal bottom-right
SMALL = ["SF", "HG"]
#: a 3x3 lake: a hole in the middle, start and goal in opposite corners (shortest path 4 moves,
#: only R R D D and D D R R avoid the hole)
RING = ["SFF", "FHF", "FFG"]


def assert_lines(lake, max_turns, k, expected, answer=("Left", "Down")):
    got = references(lake, max_turns, k, answer)
    for key, value in expected.items():
        assert got[key] == pytest.approx(float(value), abs=EXACT), (key, got[key], value)


def test_small_lake_by_hand():
    """2x2 ``SF/HG``. Non-slippery, 2 turns of 2 actions (4 moves):
    - random_valid: from S, Left/Up stay, Right -> F, Down -> hole; from F, Right/Up stay,
      Left -> S, Down -> goal. With s, f the mass on S, F after n moves (goal gets f/4 each move):
      (s, f) = (1, 0), (1/2, 1/4), (5/16, 1/4), (7/32, 13/64); goal = 0 + 1/16 + 1/16 + 13/256
      = 45/256.
    - the example "Left || Down" repeated: Left stays, Down falls in: 0.
    - "Right || Down" wins in the first turn: best_fixed = optimal = 1.
    Slippery (intended 4/5, each side 1/10):
    - a uniformly random action goes each way with (4/5 + 1/10 + 1/10) / 4 = 1/4, so
      random_valid is the same 45/256.
    - 1 turn of 2 actions: the goal needs S -> F -> G; the most for S -> F is Right (4/5), for
      F -> G Down (4/5): 16/25 = best_fixed = optimal (a second move from S cannot win).
    - 2 turns, "Left || Down": L: S 9/10 (Down-slip falls in); D: S 9/100, F 9/100; L: from S stay
      9/10, from F Left 4/5 to S, Down-slip 1/10 to G: S 153/1000, F 9/1000, G 9/1000; D: G +=
      9/1000 * 4/5. Total 9/1000 + 72/10000 = 81/5000.
    - "Right || Down" twice: R: F 4/5, S 1/10; D: G 16/25, S 9/100, F 9/100; R: G 649/1000,
      F 153/1000, S 9/1000; D: G += 153/1000 * 4/5 -> 7714/10000 = 3857/5000 (the best answer).
    - optimal over 4 moves, V_h(state) with V_0 = 0 on S, F: V_1(F) = 4/5 (Down);
      V_2(S) = 4/5 * 4/5 = 16/25 (Right), V_2(F) = 4/5 + 1/10 * 4/5 = 22/25 (Down);
      V_3(S) = 4/5 * 22/25 + 1/10 * 16/25 = 96/125 (Right), V_3(F) = 4/5 + (16 + 22)/250
      = 119/125 (Down); V_4(S) = 4/5 * 119/125 + 1/10 * 96/125 = 524/625 (Right).
    - optimal_per_turn (sees the player only between turns): last turn from S "Right || Down"
      16/25, from F "Down || Down" 22/25; first turn "Right || Right" ends G 2/25, F 4/5, S 1/100:
      2/25 + 4/5 * 22/25 + 1/100 * 16/25 = 494/625 (below 524/625: committing to two blind moves
      costs)."""
    flat = Lake.from_rows(SMALL, is_slippery=False)
    assert_lines(flat, 2, 2, {"random_valid": Fraction(45, 256), "example_copy": 0,
                              "best_fixed": 1, "optimal_per_turn": 1, "optimal": 1})
    ice = Lake.from_rows(SMALL, is_slippery=True, success_rate=0.8)
    assert_lines(ice, 1, 2, {"random_valid": Fraction(1, 16), "example_copy": 0,
                             "best_fixed": Fraction(16, 25), "optimal_per_turn": Fraction(16, 25),
                             "optimal": Fraction(16, 25)})
    assert_lines(ice, 2, 2, {"random_valid": Fraction(45, 256), "example_copy": Fraction(81, 5000),
                             "best_fixed": Fraction(3857, 5000),
                             "optimal_per_turn": Fraction(494, 625),
                             "optimal": Fraction(524, 625)})
    value, words = best_fixed_answer(ice, 2, 2)
    assert value == pytest.approx(3857 / 5000, abs=EXACT) and words == ["Right", "Down"]
    assert example_copy(ice, "right || DOWN", 2, 2) == pytest.approx(3857 / 5000, abs=EXACT)


def test_ring_lake_by_hand():
    """3x3 ``SFF/FHF/FFG``, 2 turns of 2 actions (4 moves), so only the two 4-move paths win.
    Non-slippery:
    - random_valid: 2 of the 4**4 action sequences (RRDD, DDRR): 1/128; the same slippery,
      since a random action goes each way with 1/4.
    - example "Left || Down": L D L D ends at (2, 0): 0. No answer repeated wins: a period-2
      sequence is never RRDD or DDRR, one action a turn is only 2 moves: best_fixed = 0.
    - optimal = optimal_per_turn = 1: "Right || Right", then "Down || Down".
    Slippery (4/5, 1/10):
    - "Left || Down": a Left can only slip Down (1/10) and the Down moves would both have to
      slip Right, giving D R D R through the hole: 0.
    - best_fixed: a repeated answer (a, b, a, b) wins along RRDD only if a goes R then D and
      b goes R then D, at most 4/5 * 1/10 each: 16/2500, the same for DDRR: 8/625. "Down ||
      Down" reaches it: RRDD as two Downs slipping Right (1/10 each) then two Downs (4/5 each),
      DDRR as two Downs, then two more Downs, against the bottom edge, slipping Right.
    - optimal over 4 moves: V_1 = 4/5 next to the goal (Down from (1, 2)); V_2((0, 2)) =
      4/5 * 4/5 = 16/25; V_3((0, 1)) = 4/5 * 16/25 = 64/125 (Right; its Up-slip stays, which
      cannot win in 2 moves, its Down-slip falls in); V_4(S) = 4/5 * 64/125 + 1/10 * 64/125
      (Right, its Down-slip lands on the mirror cell (1, 0)) = 288/625.
    - optimal_per_turn: last turn from (0, 2) "Down || Down" 16/25 (and from (2, 0) the
      mirror); first turn "Right || Right" ends on (0, 2) with 16/25 and on (2, 0) with 1/100:
      (16/25 + 1/100) * 16/25 = 52/125."""
    flat = Lake.from_rows(RING, is_slippery=False)
    assert_lines(flat, 2, 2, {"random_valid": Fraction(1, 128), "example_copy": 0,
                              "best_fixed": 0, "optimal_per_turn": 1, "optimal": 1})
    ice = Lake.from_rows(RING, is_slippery=True, success_rate=0.8)
    assert_lines(ice, 2, 2, {"random_valid": Fraction(1, 128), "example_copy": 0,
                             "best_fixed": Fraction(8, 625), "optimal_per_turn": Fraction(52, 125),
                             "optimal": Fraction(288, 625)})
    assert best_fixed_answer(ice, 2, 2)[1] == ["Down", "Down"]  # first of the tied answers
    # 3 actions a turn: "Down || Down || Right" twice walks D D R, bumps the bottom edge twice
    # (stays), R: best_fixed = 1 non-slippery; the env's 100-move limit does not bind ...
    assert best_fixed_answer(flat, 2, 3) == (1.0, ["Down", "Down", "Right"])
    # ... but with max_steps=5 the 6th move never comes: no repeated answer wins, while a policy
    # can still write "Down || Down || Right", then "Right" (4 moves)
    capped = Lake.from_rows(RING, is_slippery=False, max_steps=5)
    assert best_fixed(capped, 2, 3) == 0 and optimal_per_turn(capped, 2, 3) == 1
    assert optimal(capped, 2, 3) == 1


# --- an exact model written from the rules, in fractions ------------------------------------------

WORDS = ["Left", "Down", "Right", "Up"]   # gymnasium's order: each word's sides are its neighbours
STEP = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}


def _outcomes(rows, cell, word, success):
    """[(probability, next cell)] of one move: intended with ``success``, each perpendicular with
    (1 - success) / 2; a move off the board stays."""
    i = WORDS.index(word)
    side = (1 - success) / 2
    out = []
    for w, prob in [(WORDS[(i - 1) % 4], side), (word, success), (WORDS[(i + 1) % 4], side)]:
        r, c = cell[0] + STEP[w][0], cell[1] + STEP[w][1]
        if not (0 <= r < len(rows) and 0 <= c < len(rows[0])):
            r, c = cell
        out.append((prob, (r, c)))
    return out


def _play(rows, cell, words, success, moves_left):
    """Blind moves from ``cell``: (P(goal), {non-terminal end cell: prob}, moves used)."""
    dist, goal, used = {cell: Fraction(1)}, Fraction(0), 0
    for word in words[:moves_left]:
        used += 1
        nxt: dict = {}
        for at, mass in dist.items():
            for prob, to in _outcomes(rows, at, word, success):
                letter = rows[to[0]][to[1]]
                if letter == "G":
                    goal += mass * prob
                elif letter != "H":
                    nxt[to] = nxt.get(to, 0) + mass * prob
        dist = nxt
    return goal, dist, used


def exact_lines(rows, max_turns, k, answer, success, max_steps=100):
    start = next((r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch == "S")
    horizon = min(max_turns * k, max_steps)
    answers = [list(a) for n in range(1, k + 1) for a in itertools.product(WORDS, repeat=n)]

    def repeated(words):
        return _play(rows, start, words * max_turns, success, max_steps)[0]

    @functools.lru_cache(maxsize=None)
    def per_move(cell, h):
        if h == 0:
            return Fraction(0)
        best = Fraction(0)
        for word in WORDS:
            value = Fraction(0)
            for prob, to in _outcomes(rows, cell, word, success):
                letter = rows[to[0]][to[1]]
                after = 1 if letter == "G" else 0 if letter == "H" else per_move(to, h - 1)
                value += prob * after
            best = max(best, value)
        return best

    @functools.lru_cache(maxsize=None)
    def per_turn(cell, turns, moves):
        if turns == 0 or moves == 0:
            return Fraction(0)
        best = Fraction(0)
        for words in answers:
            if len(words) > moves:
                continue
            goal, dist, used = _play(rows, cell, words, success, moves)
            best = max(best, goal + sum(m * per_turn(c, turns - 1, moves - used)
                                        for c, m in dist.items()))
        return best

    uniform = Fraction(0)   # a random word each move: sum over all 4**horizon sequences / 4**h
    dist = {start: Fraction(1)}
    for _ in range(horizon):
        nxt: dict = {}
        for at, mass in dist.items():
            for word in WORDS:
                for prob, to in _outcomes(rows, at, word, success):
                    letter = rows[to[0]][to[1]]
                    if letter == "G":
                        uniform += mass * prob / 4
                    elif letter != "H":
                        nxt[to] = nxt.get(to, 0) + mass * prob / 4
        dist = nxt
    return {"random_valid": uniform, "example_copy": repeated(list(answer)[:k]),
            "best_fixed": max(repeated(a) for a in answers),
            "optimal_per_turn": per_turn(start, max_turns, max_steps),
            "optimal": per_move(start, horizon)}


@pytest.mark.parametrize("rows,max_turns,k,max_steps", [
    (SMALL, 3, 2, 100), (RING, 2, 3, 100), (RING, 2, 3, 5), (RING, 3, 1, 100),
    (["SFH", "FFF", "HFG"], 2, 2, 100), (["FFF", "SHG", "FFF"], 3, 2, 100)])
@pytest.mark.parametrize("success", [Fraction(1), Fraction(4, 5), Fraction(1, 3)])
def test_lines_equal_an_exact_model(rows, max_turns, k, max_steps, success):
    lake = Lake.from_rows(rows, is_slippery=success != 1, success_rate=float(success),
                          max_steps=max_steps)
    expected = exact_lines(rows, max_turns, k, ("Right", "Down"), success, max_steps)
    assert_lines(lake, max_turns, k, expected, answer=("Right", "Down"))


# --- on random maps -----------------------------------------------------------------------------

@pytest.mark.parametrize("start_goal", ["random", "corners"])
@pytest.mark.parametrize("is_slippery", [True, False])
def test_lines_are_ordered_on_random_maps(start_goal, is_slippery):
    env = make("frozen_lake", size=4, is_slippery=is_slippery, start_goal=start_goal)
    for seed in range(20):
        env.reset(seed)
        lake = Lake.from_env(env)
        for max_turns, k in [(5, 3), (3, 1), (2, 2)]:
            r = references(lake, max_turns, k)
            for key, value in r.items():
                assert 0 <= value <= 1 + EXACT, (key, value)
            assert r["example_copy"] <= r["best_fixed"] + EXACT
            assert r["best_fixed"] <= r["optimal_per_turn"] + EXACT
            assert r["random_valid"] <= r["optimal_per_turn"] + EXACT
            assert r["optimal_per_turn"] <= r["optimal"] + EXACT
            if not is_slippery:
                assert r["optimal"] == r["optimal_per_turn"]
        if not is_slippery:  # a path exists: 7 moves reach the goal of a 4x4 map in most cases
            assert optimal(lake, 100, 1) == 1.0


def test_real_env_plays_as_the_references_say():
    """Play the env itself, one episode per seed (each its own map and its own slips), as the
    rollout plays a turn: the answer's actions in order until the episode ends. The success
    rate of a random valid policy and of the repeated answer "Right || Down" agree with the
    means of random_valid and example_copy over the same seeds within 4 standard errors
    (the actions come from a seeded generator, so the outcome is fixed)."""
    max_turns, k, seeds = 5, 3, range(1200)
    env = make("frozen_lake", size=4)
    rng = np.random.default_rng(7)
    for policy, line in [("random", random_valid), ("copy", None)]:
        wins, expected = [], []
        for seed in seeds:
            env.reset(seed)
            lake = Lake.from_env(env)
            if line is None:
                expected.append(example_copy(lake, ["Right", "Down"], max_turns, k))
            else:
                expected.append(line(lake, max_turns, k))
            done, success = False, False
            for _ in range(max_turns):
                answer = (list(rng.choice(env.valid_actions, size=k)) if policy == "random"
                          else ["Right", "Down"])
                for action in answer:
                    _, _, done, info = env.step(str(action))
                    success |= info["success"]
                    if done:
                        break
                if done:
                    break
            wins.append(success)
        p = np.array(expected)
        se = np.sqrt(np.sum(p * (1 - p))) / len(p)
        assert abs(np.mean(wins) - p.mean()) < 4 * se, (policy, np.mean(wins), p.mean(), se)


def test_mean_references_and_bad_arguments():
    means = mean_references(range(5), 5, 3, size=4, start_goal="corners")
    env = make("frozen_lake", size=4, start_goal="corners")
    rows = []
    for seed in range(5):
        env.reset(seed)
        rows.append(references(Lake.from_env(env), 5, 3))
    assert means == pytest.approx({key: np.mean([r[key] for r in rows]) for key in rows[0]})
    lake = Lake.from_rows(SMALL)
    with pytest.raises(ValueError, match="answer"):
        example_copy(lake, ["Left", "Jump"], 2, 2)
    with pytest.raises(ValueError, match="answer"):
        example_copy(lake, " || ", 2, 2)
    with pytest.raises(ValueError, match="max_turns"):
        optimal(lake, 0, 2)
    with pytest.raises(ValueError, match="max_actions_per_turn"):
        random_valid(lake, 2, True)
    with pytest.raises(ValueError, match="seeds"):
        mean_references([], 5, 3)
    # an answer longer than K is cut to K, as the parser cuts it
    assert example_copy(lake, ["Right", "Down", "Left"], 1, 2) == pytest.approx(16 / 25)
