"""``ragen-mega env-server ENV [--host H] [--port N] [--kwarg K=V ...]``: an env served over HTTP.

Envs as services (NeMo Gym, ROLL's ROCK, SkyRL's OpenEnv) keep the env's dependencies out of the
trainer's environment and let a slow env (Crafter, a browser) scale on CPU nodes of its own. One
server holds many sessions, each an instance of the env built with the server's kwargs. JSON
over HTTP:

- ``GET /health`` -> ``{"env": NAME, "kwargs": {...}, "sessions": N}``;
- ``POST /sessions`` ``{"seed": S}`` -> ``{"session_id", "env", "observation", "instruction",
  "valid_actions", "state_key"}``: a new session, reset on the seed;
- ``POST /sessions/{ID}/step`` ``{"action": TEXT}`` -> ``{"observation", "reward", "done",
  "info", "state_key"}``;
- ``POST /sessions/{ID}/reset`` ``{"seed": S}`` -> ``{"observation", "state_key"}``;
- ``DELETE /sessions/{ID}`` -> ``{"closed": ID}``.

``state_key`` (the env's :meth:`~ragen_mega.envs.TextEnv.state_key`: GiGPO's anchor states)
extends the protocol; no other field depends on it.

Bad input never costs the server or another session: an unknown or closed session is 404, a body
that is not JSON or lacks a field 422 naming it (FastAPI), a seed the env refuses 422 with its
message, a step after the episode ended 409; a text that is no action is the env's own
invalid-action step (200). Any other env exception is a 500 with its message, which the client
counts as an env failure, as a local env's exception. ``rollout/remote_env.py`` is the rollout's
client (``env.remote``).

Off loopback the server needs a token (``RAGEN_MEGA_ENV_SERVER_TOKEN`` in its environment and in
the trainer's, whose client sends it); then every request without ``Authorization: Bearer
TOKEN`` is 401 (``http_token.py``).
"""
from __future__ import annotations

import json
import socket
import sys
import threading
import uuid
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from ragen_mega.envs.checks import EpisodeDone
from ragen_mega.envs.play import env_kwargs, env_parser
from ragen_mega.envs.registry import list_envs, make
from ragen_mega.http_token import ENV_SERVER_TOKEN, check_listen, require_token, token_from_env


def jsonable(value: Any) -> Any:
    """``value`` as JSON's types (numpy scalars and arrays, which env infos hold, converted);
    TypeError for anything else."""
    import numpy as np

    def convert(obj):
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
        raise TypeError(f"{type(obj).__name__} is not JSON: {obj!r}")

    return json.loads(json.dumps(value, default=convert))


class SeedBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: StrictInt


class ActionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    action: StrictStr


class Sessions:
    """The server's live envs by session id; a lock per session (its calls run one at a time,
    on the server's worker threads) and one for the table."""

    def __init__(self, env_name: str, kwargs: dict[str, Any]):
        self.env_name, self.kwargs = env_name, kwargs
        self.envs: dict[str, Any] = {}
        self.locks: dict[str, threading.Lock] = {}
        self.table = threading.Lock()

    def open(self):
        env = make(self.env_name, **self.kwargs)
        session_id = uuid.uuid4().hex
        with self.table:
            self.envs[session_id], self.locks[session_id] = env, threading.Lock()
        return session_id, env

    def get(self, session_id: str):
        with self.table:
            return self.envs.get(session_id), self.locks.get(session_id)

    def close(self, session_id: str) -> bool:
        with self.table:
            env = self.envs.pop(session_id, None)
            self.locks.pop(session_id, None)
        if env is not None:
            env.close()
        return env is not None


def make_app(env_name: str, kwargs: dict[str, Any], token: str | None = None):
    """The FastAPI app serving ``env_name`` with ``kwargs`` (built once here, so a bad kwarg
    fails at start-up); with ``token``, only to requests that carry it."""
    make(env_name, **kwargs).close()
    sessions = Sessions(env_name, kwargs)
    app = FastAPI(title=f"ragen-mega env-server: {env_name}")
    require_token(app, token)

    def session(session_id: str):
        env, lock = sessions.get(session_id)
        if env is None:
            raise HTTPException(404, f"no session {session_id!r} (never opened, or closed)")
        return env, lock

    def reset(env, seed: int) -> str:
        try:
            return env.reset(seed)
        except ValueError as e:  # the env refuses the seed
            raise HTTPException(422, f"seed: {e}") from e

    @app.get("/health")
    def health():
        return {"env": env_name, "kwargs": jsonable(kwargs), "sessions": len(sessions.envs)}

    @app.post("/sessions")
    def open_session(body: SeedBody):
        session_id, env = sessions.open()
        try:
            obs = reset(env, body.seed)
        except BaseException:
            sessions.close(session_id)
            raise
        return {"session_id": session_id, "env": env_name, "observation": obs,
                "instruction": env.instruction, "valid_actions": list(env.valid_actions),
                "state_key": env.state_key(obs)}

    @app.post("/sessions/{session_id}/reset")
    def reset_session(session_id: str, body: SeedBody):
        env, lock = session(session_id)
        with lock:
            obs = reset(env, body.seed)
            return {"observation": obs, "state_key": env.state_key(obs)}

    @app.post("/sessions/{session_id}/step")
    def step_session(session_id: str, body: ActionBody):
        env, lock = session(session_id)
        with lock:
            try:
                obs, reward, done, info = env.step(body.action)
            except EpisodeDone as e:
                raise HTTPException(409, str(e)) from e
            return {"observation": obs, "reward": float(reward), "done": bool(done),
                    "info": jsonable(info), "state_key": env.state_key(obs)}

    @app.delete("/sessions/{session_id}")
    def close_session(session_id: str):
        if not sessions.close(session_id):
            raise HTTPException(404, f"no session {session_id!r} (never opened, or closed)")
        return {"closed": session_id}

    return app


def serve(env_name: str, kwargs: dict[str, Any], host: str = "127.0.0.1", port: int = 0,
          token: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM. Binds first and prints ``serving ENV at URL`` on stdout, so
    with ``port=0`` the OS-picked port can be read back. Off loopback ``token`` is required
    (ValueError)."""
    import uvicorn

    check_listen(host, token, ENV_SERVER_TOKEN, "--host")
    app = make_app(env_name, kwargs, token)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections made from now on wait for the server instead of failing
    print(f"serving {env_name} at http://{host}:{sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    """``argv``: the words after ``env-server`` (``ENV [--host H] [--port N] [--kwarg k=v]``)."""
    parser = env_parser("ragen-mega env-server",
                        "Serve a registered env over HTTP (sessions, reset, step).")
    parser.add_argument("--host", default="127.0.0.1",
                        help=f"address to listen on (other than loopback: needs a token in "
                             f"{ENV_SERVER_TOKEN})")
    parser.add_argument("--port", type=int, default=0, help="port (0: any free one, printed)")
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        kwargs = env_kwargs(args.kwarg, extra)
        if args.env not in list_envs():
            raise ValueError(f"unknown env {args.env!r}; registered envs: "
                             f"{', '.join(list_envs())}")
        serve(args.env, kwargs, args.host, args.port, token_from_env(ENV_SERVER_TOKEN))
    except (ValueError, TypeError, ImportError, OSError) as err:
        print(f"ragen-mega env-server: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
