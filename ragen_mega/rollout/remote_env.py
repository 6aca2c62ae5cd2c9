"""Envs served over HTTP (``ragen-mega env-server``, ``envs/server.py``), played as local ones.

``env.remote: [URL, ...]`` opens each episode's env as a session on a server (episode ``i`` on
server ``i mod len(urls)``) through :class:`HttpEnv`, an
:class:`~ragen_mega.rollout.types.EnvHandle` like ``LocalEnv``: prompts, rewards, seeds and
samples are those of the same env played locally. The server builds the env with its own kwargs;
:func:`check_servers` (at start-up) checks each serves the config's env and kwargs.

A server that is down, answers garbage or misses ``env.remote_timeout_s`` is an ordinary env
failure: the episode is dropped and counted (``fault/episodes_dropped``) and the run goes on
within ``rollout.max_env_failure_rate``. Every episode opens its own HTTP session, so a server
that comes back is used again by the next episode that lands on it.

Servers started with a token (``RAGEN_MEGA_ENV_SERVER_TOKEN``) get it from the same variable in
the trainer's environment, sent as ``Authorization: Bearer``.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import aiohttp

from ragen_mega.http_token import ENV_SERVER_TOKEN, bearer_headers, token_from_env


class RemoteEnvError(RuntimeError):
    """An env server answered something other than what the protocol says."""


class HttpEnv:
    """One env session on a server, as an ``EnvHandle``. Open with :meth:`open` (which resets
    the session on the seed); :meth:`close` deletes the session."""

    def __init__(self, url: str, http: aiohttp.ClientSession, opened: dict[str, Any]):
        self.url, self.http = url, http
        self.session_id = _field(opened, "session_id", str, url)
        self.instruction = _field(opened, "instruction", str, url)
        self.valid_actions = _field(opened, "valid_actions", list, url)
        self._obs = _field(opened, "observation", str, url)
        self._key = _field(opened, "state_key", str, url)
        self._fresh_seed: int | None = None  # the seed the session was opened on, until used

    @classmethod
    async def open(cls, url: str, env_name: str, seed: int, timeout_s: float) -> HttpEnv:
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     headers=bearer_headers(token_from_env(ENV_SERVER_TOKEN)))
        try:
            opened = await _call(http, "POST", f"{url}/sessions", {"seed": seed})
            served = _field(opened, "env", str, url)
            if served != env_name:
                raise RemoteEnvError(f"env server {url} serves {served!r}, the episode plays "
                                     f"{env_name!r}")
            env = cls(url, http, opened)
        except BaseException:
            await http.close()
            raise
        env._fresh_seed = seed
        return env

    async def reset(self, seed: int) -> str:
        fresh, self._fresh_seed = self._fresh_seed, None
        if fresh == seed:  # opening reset the session on this seed already
            return self._obs
        out = await _call(self.http, "POST", f"{self._session}/reset", {"seed": seed})
        return self._observed(out)

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self._fresh_seed = None
        out = await _call(self.http, "POST", f"{self._session}/step", {"action": action})
        obs = self._observed(out)
        reward = _field(out, "reward", (int, float), self.url)
        return obs, float(reward), _field(out, "done", bool, self.url), \
            _field(out, "info", dict, self.url)

    async def state_key(self, observation: str) -> str:
        """The server's key of the latest observation (the env's ``state_key``); an older
        observation's is its text, ``TextEnv``'s default."""
        return self._key if observation == self._obs else observation

    async def close(self) -> None:
        try:
            await _call(self.http, "DELETE", self._session)
        finally:
            await self.http.close()

    @property
    def _session(self) -> str:
        return f"{self.url}/sessions/{self.session_id}"

    def _observed(self, out: dict[str, Any]) -> str:
        self._obs = _field(out, "observation", str, self.url)
        self._key = _field(out, "state_key", str, self.url)
        return self._obs


class RemoteEnvs:
    """The rollout's ``open_env`` over env servers: ``await RemoteEnvs(urls, t).open(spec)``."""

    def __init__(self, urls: Sequence[str], timeout_s: float):
        if not urls:
            raise ValueError("RemoteEnvs: needs at least one server URL")
        self.urls, self.timeout_s = [u.rstrip("/") for u in urls], timeout_s

    async def open(self, spec) -> HttpEnv:
        url = self.urls[spec.episode_id % len(self.urls)]
        return await HttpEnv.open(url, spec.env_name, spec.seed, self.timeout_s)


async def _call(http: aiohttp.ClientSession, method: str, url: str,
                payload: dict[str, Any] | None = None) -> dict[str, Any]:
    """One request; a non-2xx answer or a body that is not a JSON object raises
    :class:`RemoteEnvError` naming the URL and what came back (connection errors and time-outs
    raise as aiohttp and asyncio raise them)."""
    async with http.request(method, url, json=payload) as response:
        text = await response.text()
        if response.status >= 300:
            raise RemoteEnvError(f"{method} {url}: HTTP {response.status}: {text[:300]}")
    try:
        out = json.loads(text)
    except ValueError:
        out = None
    if not isinstance(out, dict):
        raise RemoteEnvError(f"{method} {url}: not a JSON object: {text[:300]!r}")
    return out


def _field(out: dict[str, Any], name: str, kind: type | tuple[type, ...], url: str):
    """``out[name]`` if it is of ``kind`` (a bool is no number); else RemoteEnvError."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    value = out.get(name)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise RemoteEnvError(f"env server {url}: field {name!r} missing or not "
                             f"{' or '.join(k.__name__ for k in kinds)}: {value!r}")
    return value


def check_servers(urls: Sequence[str], env_name: str, kwargs: dict[str, Any],
                  timeout_s: float) -> None:
    """Each server answers ``/health`` and serves ``env_name`` with ``kwargs``; else ValueError
    naming the server (``preflight`` reports it under ``env.remote``)."""
    import requests

    for i, url in enumerate(urls):
        token = token_from_env(ENV_SERVER_TOKEN)
        try:
            answer = requests.get(f"{url.rstrip('/')}/health", timeout=timeout_s,
                                  headers=bearer_headers(token))
            health = answer.json()
        except (requests.RequestException, ValueError) as e:
            raise ValueError(f"[{i}]: {url} does not answer /health: {e}") from e
        if answer.status_code == 401:
            raise ValueError(f"[{i}]: {url} wants a token, and {ENV_SERVER_TOKEN} "
                             f"{'holds another' if token else 'is not set'}")
        if health.get("env") != env_name or health.get("kwargs") != kwargs:
            raise ValueError(f"[{i}]: {url} serves {health.get('env')!r} with kwargs "
                             f"{health.get('kwargs')!r}; the config plays {env_name!r} with "
                             f"{kwargs!r}")
