"""``ragen-mega play ENV [--seed N] [--kwarg key=value ...]``: play an env in the terminal.

Prints the env's instruction and each observation exactly as the model sees them, reads one
action per line from stdin until the episode ends or stdin closes, and after each action prints
a ``[step]`` line with reward, done and info. Only the tool's own lines start with ``[``. Also
runnable as ``python -m ragen_mega.envs.play``.

``--kwarg`` values are Python literals when they parse as one (``dim_room=(8,8)``,
``is_slippery=False``, ``p=0.7``), else strings (``low_risk_name=Trader``). Any other
``--NAME VALUE`` (or ``--NAME=VALUE``) means ``--kwarg NAME=VALUE``, as in
``ragen-mega play babaisai --task two_room-goto_win``.
"""
from __future__ import annotations

import argparse
import ast
import sys
from typing import Any

from ragen_mega.envs.registry import list_envs, make


def parse_kwarg(text: str) -> tuple[str, Any]:
    """``"key=value"`` -> ``(key, value)``; the value as a Python literal when it is one."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--kwarg expects key=value, got {text!r}")
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        value = raw.strip()
    return key.strip(), value


def option_kwargs(extra: list[str]) -> list[str]:
    """``["--task", "x", "--n=3"]`` -> ``["task=x", "n=3"]``: options argparse did not know."""
    out, rest = [], list(extra)
    while rest:
        option = rest.pop(0)
        if not option.startswith("--") or len(option) == 2:
            raise ValueError(f"unexpected argument {option!r}; env kwargs are given as "
                             f"--NAME VALUE or --kwarg NAME=VALUE")
        name, sep, value = option[2:].partition("=")
        if not sep:
            if not rest or rest[0].startswith("--"):
                raise ValueError(f"option {option} needs a value")
            value = rest.pop(0)
        out.append(f"{name.replace('-', '_')}={value}")
    return out


def env_kwargs(kwarg_options: list[str], extra: list[str]) -> dict[str, Any]:
    """The env kwargs of ``--kwarg K=V`` options and of ``extra`` (the ``--NAME VALUE`` options
    argparse did not know); ValueError for a key given twice."""
    kwargs: dict[str, Any] = {}
    for text in kwarg_options + option_kwargs(extra):
        key, value = parse_kwarg(text)
        if key in kwargs:
            raise ValueError(f"--kwarg {key} given twice")
        kwargs[key] = value
    return kwargs


def env_parser(prog: str, what: str) -> argparse.ArgumentParser:
    """A command's parser taking an env name and its kwargs (``--kwarg K=V``, or any other
    ``--NAME VALUE``: read them with ``parse_known_args`` and :func:`env_kwargs`)."""
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description=f"{what} Other --NAME VALUE options are env kwargs, like --kwarg NAME=VALUE.")
    parser.add_argument("env", help=f"env name, one of: {', '.join(list_envs())}")
    parser.add_argument("--kwarg", action="append", default=[], metavar="KEY=VALUE",
                        help="env constructor argument; repeat for several")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``argv``: the words after ``play`` (``ENV [--seed N] [--kwarg k=v ...]``); exit code."""
    parser = env_parser("ragen-mega play",
                        "Play a registered text env; one action per line on stdin.")
    parser.add_argument("--seed", type=int, default=0, help="episode seed (default 0)")
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exit_:  # argparse already printed usage and the problem
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        env = make(args.env, **env_kwargs(args.kwarg, extra))
        obs = env.reset(args.seed)
    except (ValueError, TypeError, ImportError) as err:
        print(f"ragen-mega play: error: {err}", file=sys.stderr)
        return 2
    try:
        print(env.instruction)
        print()
        print(obs, flush=True)
        for line in sys.stdin:
            obs, reward, done, info = env.step(line.rstrip("\r\n"))
            print(f"[step] reward={reward:g} done={done} info={info}")
            print(obs, flush=True)
            if done:
                print("[episode done]")
                break
    finally:
        env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
