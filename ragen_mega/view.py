"""``ragen-mega view RUN_DIR``: the trajectory viewer, a local web page over a run's trajectory
files (``trajectories.py``) and its ``metrics.jsonl``.

It shows the run's steps (success, reward, kept groups), a step's groups (returns, std, the
filter's verdict and score), and an episode as the conversation it was: each turn's observation
as the env wrote it (grids in monospace), the response as sampled, the env steps it made, the
reward and the advantage. For the echo trap it marks responses repeated within a group (the same
turn of another episode) and those seen in the previous step, counts answers that copy the
prompt's example, and puts one seed's episode at two steps side by side.

The app reads only ``RUN_DIR/metrics.jsonl`` and files under ``RUN_DIR/trajectories`` named by
step number (typed integers: no path comes from a request). It serves on loopback unless told
otherwise, elsewhere only with a token (``http_token.py``: ``RAGEN_MEGA_VIEW_TOKEN``). A missing,
corrupt or too-new file is a 4xx with a message the page shows, never a 500.
"""
from __future__ import annotations

import functools
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from ragen_mega.http_token import VIEW_TOKEN, check_listen, require_token, token_from_env
from ragen_mega.trajectories import DIRNAME, read_records, step_file

PAGE = Path(__file__).with_name("view_page.html")
Kind = Literal["train", "eval"]


@functools.lru_cache(maxsize=64)
def _records_at(path: str, mtime_ns: int) -> tuple[dict[str, Any], ...]:
    """A file's records, cached until it changes (a live run rewrites its files)."""
    return tuple(read_records(path))


def load_step(run_dir: Path, kind: str, step: int) -> list[dict[str, Any]]:
    """Step ``step``'s records of ``kind``; LookupError when there is no such file, ValueError
    (naming the file) when it cannot be read."""
    path = step_file(run_dir, step, kind)
    if not path.is_file():
        raise LookupError(f"no {kind} trajectories for step {step} "
                          f"({path.relative_to(run_dir)} does not exist)")
    try:
        return list(_records_at(str(path), path.stat().st_mtime_ns))
    except (OSError, EOFError) as e:
        raise ValueError(f"{path.relative_to(run_dir)}: cannot be read ({e})") from None


def run_summary(run_dir: Path) -> dict[str, Any]:
    """The run's steps: metrics.jsonl's success, reward and kept groups (a resumed step's last
    line wins), and which steps have trajectory files."""
    steps: dict[int, dict[str, Any]] = {}
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue   # a line a killed run cut short
            step = row.get("step")
            if isinstance(step, int):
                steps[step] = {"step": step, "success": row.get("rollout/success"),
                               "reward": row.get("rollout/reward_mean"),
                               "kept_groups": row.get("filter/kept_groups"),
                               "val_success": row.get("val/success")}
    files = run_dir / DIRNAME
    for kind, prefix in (("train", "step_"), ("eval", "eval_step_")):
        for path in files.glob(f"{prefix}*.jsonl.gz") if files.is_dir() else ():
            number = path.name[len(prefix):-len(".jsonl.gz")]
            if number.isdigit():
                steps.setdefault(int(number), {"step": int(number)})[kind] = True
    return {"run": run_dir.name, "steps": [steps[k] for k in sorted(steps)]}


def _previous_responses(run_dir: Path, kind: str, step: int) -> set[str] | None:
    """Every response of the previous step's file of ``kind`` (None: there is none)."""
    try:
        records = load_step(run_dir, kind, step - 1)
    except (LookupError, ValueError):
        return None
    return {t["response"] for r in records for t in r["turns"]}


def marked(records, previous: set[str] | None) -> list[dict[str, Any]]:
    """``records`` with each turn's echo marks: ``repeats_in_group`` (other episodes of its
    group that wrote the same response at the same turn) and ``in_previous_step``."""
    counts = Counter((r["group"], t["turn"], t["response"]) for r in records for t in r["turns"])
    out = []
    for r in records:
        turns = [{**t, "repeats_in_group": counts[(r["group"], t["turn"], t["response"])] - 1,
                  "in_previous_step": None if previous is None else t["response"] in previous}
                 for t in r["turns"]]
        out.append({**r, "turns": turns})
    return out


def step_view(run_dir: Path, kind: str, step: int) -> dict[str, Any]:
    """A step's groups (returns, std, filter verdict and score, episodes) and its echo-trap
    shares: responses repeated within a group, copies of the prompt's example, responses seen
    in the previous step."""
    records = marked(load_step(run_dir, kind, step), _previous_responses(run_dir, kind, step))
    groups: dict[int, dict[str, Any]] = {}
    for r in records:
        g = groups.setdefault(r["group"], {"group": r["group"], "tag": r["tag"],
                                           "seed": r["seed"], "kept": r["kept"],
                                           "score": r["group_score"], "episodes": []})
        g["episodes"].append({"episode": r["episode"], "return": r["return"],
                              "success": r["success"], "turns": len(r["turns"]),
                              "window": r.get("window")})
    for g in groups.values():
        returns = [e["return"] for e in g["episodes"]]
        g["returns"] = returns
        g["std"] = statistics.stdev(returns) if len(returns) > 1 else 0.0
    turns = [t for r in records for t in r["turns"]]
    share = (lambda n: n / len(turns)) if turns else (lambda n: None)
    previous = [t["in_previous_step"] for t in turns if t["in_previous_step"] is not None]
    return {"kind": kind, "step": step, "schema": records[0]["schema"] if records else None,
            "groups": [groups[k] for k in sorted(groups)],
            "echo": {"turns": len(turns),
                     "repeated_in_group": share(sum(t["repeats_in_group"] > 0 for t in turns)),
                     "example_copy": share(sum(bool(t.get("example_copy")) for t in turns)),
                     "in_previous_step": (sum(previous) / len(previous)) if previous else None}}


def episode_view(run_dir: Path, kind: str, step: int, episode: int) -> dict[str, Any]:
    """One episode's record (every window of it, in streamed steps) with its turns' echo marks."""
    records = marked(load_step(run_dir, kind, step), _previous_responses(run_dir, kind, step))
    found = [r for r in records if r["episode"] == episode]
    if not found:
        raise LookupError(f"{kind} step {step} has no episode {episode}")
    return {**found[0], "turns": [t for r in found for t in r["turns"]]}


def seed_view(run_dir: Path, kind: str, seed: int, steps: list[int],
              tag: str | None = None) -> dict[str, Any]:
    """The first episode (lowest id) played on ``seed`` (and ``tag``) at each of ``steps``:
    one seed's episode across steps, side by side."""
    out = {}
    for step in steps:
        matches = [r for r in load_step(run_dir, kind, step)
                   if r["seed"] == seed and (tag is None or r["tag"] == tag)]
        if not matches:
            raise LookupError(f"{kind} step {step} has no episode on seed {seed}"
                              + (f" of {tag!r}" if tag else ""))
        out[str(step)] = min(matches, key=lambda r: r["episode"])
    return {"seed": seed, "tag": tag, "episodes": out}


def make_app(run_dir: str | Path, token: str | None = None):
    """The viewer's FastAPI app over ``run_dir``; with ``token``, only for requests that carry
    it (``http_token.require_token``, browser-style)."""
    from fastapi import FastAPI, HTTPException, Query
    from fastapi import Path as PathParam
    from fastapi.responses import HTMLResponse

    root = Path(run_dir).resolve()
    app = FastAPI(title=f"ragen-mega view {root.name}", docs_url=None, redoc_url=None)
    require_token(app, token, browser=True)

    def answer(fn, *args):
        try:
            return fn(root, *args)
        except LookupError as e:
            raise HTTPException(404, str(e)) from None
        except ValueError as e:
            raise HTTPException(422, str(e)) from None

    @app.get("/", response_class=HTMLResponse)
    def page():
        return PAGE.read_text()

    @app.get("/api/run")
    def run():
        return run_summary(root)

    @app.get("/api/{kind}/steps/{step}")
    def step(kind: Kind, step: int = PathParam(ge=0)):
        return answer(step_view, kind, step)

    @app.get("/api/{kind}/steps/{step}/episodes/{episode}")
    def episode(kind: Kind, step: int = PathParam(ge=0), episode: int = PathParam(ge=0)):
        return answer(episode_view, kind, step, episode)

    @app.get("/api/{kind}/seeds/{seed}")
    def seed(kind: Kind, seed: int, steps: list[int] = Query(..., min_length=1, max_length=8),
             tag: str | None = None):
        if any(s < 0 for s in steps):
            raise HTTPException(422, "steps must be >= 0")
        return answer(seed_view, kind, seed, steps, tag)

    return app


def main(argv: list[str] | None = None) -> int:
    """``ragen-mega view RUN_DIR [--host 127.0.0.1] [--port 8321]``"""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(prog="ragen-mega view", description=main.__doc__)
    parser.add_argument("run_dir", help="a run directory (trainer.run_dir)")
    parser.add_argument("--host", default="127.0.0.1",
                        help=f"address to listen on (default: loopback only; any other needs "
                             f"a token in ${VIEW_TOKEN})")
    parser.add_argument("--port", type=int, default=8321)
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / DIRNAME).is_dir() and not (run_dir / "metrics.jsonl").is_file():
        print(f"ragen-mega view: {run_dir} holds no trajectories/ and no metrics.jsonl "
              f"(is it a trainer.run_dir?)", file=sys.stderr)
        return 2
    token = token_from_env(VIEW_TOKEN)
    try:
        check_listen(args.host, token, VIEW_TOKEN, "--host")
    except ValueError as e:
        print(f"ragen-mega view: {e}", file=sys.stderr)
        return 2
    query = "?token=TOKEN" if token else ""   # the token itself stays out of the terminal
    print(f"ragen-mega view: http://{args.host}:{args.port}/{query} ({run_dir})", flush=True)
    uvicorn.run(make_app(run_dir, token), host=args.host, port=args.port, log_level="warning")
    return 0
