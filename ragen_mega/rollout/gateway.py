"""An OpenAI-compatible gateway to the engines, for agents the user wrote (``rollout.agent``).

As slime's OpenAI adapter, AReaL's proxy and Agent Lightning do, it trains an agent loop written
against the OpenAI client as it is. While a rollout plays, the run serves
``/episodes/{EPISODE}/v1/chat/completions`` and ``/episodes/{EPISODE}/v1/completions``; each
episode's agent gets its own base URL (``http://HOST:PORT/episodes/EPISODE/v1``), which groups
its calls. Every call is one turn and becomes one :class:`~ragen_mega.rollout.sample.Sample`
with the exact prompt ids the engine was given and the ids and log-probs it sampled: the gateway
tokenizes (``rollout/token_history.py``), never the trainer, and a conversation that continues
the previous call reuses the sampled tokens.

The request and response shapes are OpenAI's for the fields supported: ``model`` (any name: the
run's policy answers), ``messages`` (roles system/user/assistant, text content) or ``prompt``
(one string), ``temperature``, ``top_p``, ``max_tokens`` (or ``max_completion_tokens``),
``stop``, ``n`` (1), ``logprobs`` (chat: true/false; completions: 0/null), ``stream`` (false).
Any other field is refused (400 naming it), never ignored, so an agent relying on ``tools`` or
``seed`` learns it here, not from a silently different rollout. A missing sampling field takes
the rollout's value (``rollout.temperature``, or ``rollout.val_temperature`` in held-out
evaluation; ``rollout.top_p``; ``rollout.max_new_tokens``).

Errors use OpenAI's body (``{"error": {"message", "type", "param", "code"}}``): 400 for a bad
field, a call past the episode's turn limit, or a prompt longer than the engine's context
(code ``context_length_exceeded``); 404 for an episode not playing now; 503 when the engine
serving the call died (it is restarted and the whole episode replayed, as for built-in
episodes, so the agent need not retry).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ragen_mega.rollout.types import EngineRestarted, GenerateFn, Generation, PromptTooLong
from ragen_mega.http_token import GATEWAY_TOKEN, check_listen, require_token
from ragen_mega.rollout.token_history import TokenHistory

#: fields every call may carry besides its messages or prompt
SAMPLING_FIELDS = ("model", "temperature", "top_p", "max_tokens", "max_completion_tokens",
                   "stop", "n", "logprobs", "stream")
ROLES = ("system", "user", "assistant")


class BadRequest(ValueError):
    """A request the gateway refuses: ``param`` is the field, ``status`` the HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclasses.dataclass
class Call:
    """One answered call: the prompt ids sent and what the engine sampled."""
    prompt_ids: list[int]
    generation: Generation
    extends: bool               # the prompt went on from the previous call's ids


@dataclasses.dataclass
class EpisodeCalls:
    """One playing episode's side of the gateway: how to generate, with what defaults, its token
    history, and the calls answered so far."""
    generate: GenerateFn
    defaults: dict[str, Any]     # temperature, top_p, max_new_tokens
    max_turns: int
    history: TokenHistory
    calls: list[Call] = dataclasses.field(default_factory=list)
    #: why a call's engine was restarted (the episode is played again): the generate
    #: function's EngineRestarted
    engine_restarted: EngineRestarted | None = None
    prompt_too_long: bool = False

    @property
    def rerendered(self) -> int:
        """Calls after the first that did not go on from the previous call's tokens."""
        return sum(not c.extends for c in self.calls[1:])


class Gateway:
    """The gateway of one run (``tokenizer``: the policy's): episodes are opened and closed
    around their agent's play (:meth:`open_episode`, :meth:`close_episode`), and the HTTP server
    runs inside a rollout's event loop (:meth:`serving`)."""

    def __init__(self, tokenizer, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "policy", token: str | None = None):
        check_listen(host, token, GATEWAY_TOKEN, "rollout.gateway_host")
        self.tokenizer, self.host, self.port, self.model_name = tokenizer, host, port, model_name
        #: what an agent's OpenAI client sends as its api_key (``RAGEN_MEGA_GATEWAY_TOKEN``;
        #: None: the gateway is on loopback and asks for none)
        self.token = token
        self.episodes: dict[int, EpisodeCalls] = {}
        self.app = self._app()
        self._serving: asyncio.AbstractEventLoop | None = None   # the loop it serves on

    def url(self, episode_id: int) -> str:
        """The OpenAI base URL of ``episode_id``'s agent (valid while :meth:`serving`)."""
        return f"http://{self.host}:{self.port}/episodes/{episode_id}/v1"

    def open_episode(self, episode_id: int, generate: GenerateFn, defaults: dict[str, Any],
                     max_turns: int) -> EpisodeCalls:
        calls = EpisodeCalls(generate, dict(defaults), max_turns, TokenHistory(self.tokenizer))
        self.episodes[episode_id] = calls
        return calls

    def close_episode(self, episode_id: int) -> EpisodeCalls:
        return self.episodes.pop(episode_id)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """Serve on the running event loop (the engines' clients' and the agents') until the
        block ends. Port 0 binds a free port, kept for the rest of the run so URLs stay stable.
        One rollout plays at a time, so one server at a time; a block nested on the same loop
        (an evaluation beside ``async_mode: fully``'s rollout) uses the server already up."""
        import uvicorn

        if self._serving is asyncio.get_running_loop():
            yield
            return
        if self._serving is not None:
            raise RuntimeError("the gateway is already serving a rollout")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"the gateway cannot listen on {self.host}:{self.port} "
                               f"(rollout.gateway_host, rollout.gateway_port): {e}") from e
        self.port, self._serving = sock.getsockname()[1], asyncio.get_running_loop()
        # keep-alive far past the agents' clients' own (httpx: 5 s), so an agent never reuses
        # a connection the gateway closed meanwhile (uvicorn's default is also 5 s)
        server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off",
                                               access_log=False, timeout_keep_alive=600))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            while not server.started:
                if task.done():
                    task.result()  # the server's start-up error
                    raise RuntimeError(f"the gateway on {self.host}:{self.port} stopped at start")
                await asyncio.sleep(0.01)
            yield
        finally:
            server.should_exit = True
            await task
            sock.close()
            self._serving = None

    # ------------------------------------------------------------------ the HTTP side
    def _app(self) -> FastAPI:
        app = FastAPI(title="ragen-mega gateway")
        require_token(app, self.token)

        @app.post("/episodes/{episode_id}/v1/chat/completions")
        async def chat(episode_id: int, request: Request):
            return await self._answer(episode_id, request, chat=True)

        @app.post("/episodes/{episode_id}/v1/completions")
        async def completions(episode_id: int, request: Request):
            return await self._answer(episode_id, request, chat=False)

        return app

    async def _answer(self, episode_id: int, request: Request, chat: bool) -> JSONResponse:
        try:
            calls = self.episodes.get(episode_id)
            if calls is None:
                raise BadRequest(f"episode {episode_id} is not playing now (each episode's agent "
                                 f"gets its own base URL for the time of its episode)",
                                 status=404)
            body = await _json_object(request)
            answer = self._chat if chat else self._completion
            return JSONResponse(await answer(episode_id, calls, body))
        except BadRequest as e:
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.param,
                                           "code": e.code}}, status_code=e.status)

    async def _chat(self, episode_id: int, calls: EpisodeCalls, body: dict) -> dict:
        _check_fields(body, "messages", chat=True)
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest("messages: the policy's tokenizer has no chat template (a base "
                             "model); send a prompt string to /v1/completions instead",
                             "messages")
        messages = _messages(body.get("messages"))
        sampling = _sampling(body, calls.defaults)
        prompt_ids, gen, content = await self._sample(calls, sampling,
                                                      *calls.history.chat_prompt(messages))
        calls.history.record_chat(messages, prompt_ids, gen.output_ids, content)
        choice = {"index": 0, "message": {"role": "assistant", "content": content},
                  "finish_reason": _finish(gen), "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [
                {"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}
                for token, lp in zip(self._pieces(gen.output_ids), gen.logprobs)]}
        return self._response(episode_id, calls, "chat.completion", choice, prompt_ids, gen)

    async def _completion(self, episode_id: int, calls: EpisodeCalls, body: dict) -> dict:
        _check_fields(body, "prompt", chat=False)
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest(f"prompt: must be a non-empty string (one prompt per call), got "
                             f"{_short(prompt)}", "prompt")
        sampling = _sampling(body, calls.defaults)
        prompt_ids, gen, text = await self._sample(calls, sampling,
                                                   *calls.history.completion_prompt(prompt))
        calls.history.record_completion(prompt, prompt_ids, gen.output_ids, text)
        choice = {"index": 0, "text": text, "finish_reason": _finish(gen), "logprobs": None}
        return self._response(episode_id, calls, "text_completion", choice, prompt_ids, gen)

    async def _sample(self, calls: EpisodeCalls, sampling: dict, prompt_ids: list[int],
                      extends: bool) -> tuple[list[int], Generation, str]:
        """Generate for ``prompt_ids`` and record the call; the prompt, the engine's answer and
        its text as the agent gets it (special tokens and a final stop string left out, as
        OpenAI does)."""
        if calls.engine_restarted:
            raise BadRequest("the engine serving this episode was restarted; the episode will "
                             "be played again from its start", status=503)
        if len(calls.calls) >= calls.max_turns:
            raise BadRequest(f"the episode's turn limit is reached ({calls.max_turns} calls: "
                             f"env.max_turns)", code="turn_limit_reached")
        try:
            gen = await calls.generate(prompt_ids, sampling)
        except PromptTooLong as e:
            calls.prompt_too_long = True
            raise BadRequest(f"the prompt ({len(prompt_ids)} tokens) is longer than the engine's "
                             f"context: {e}", "messages", code="context_length_exceeded")
        except EngineRestarted as e:
            calls.engine_restarted = e
            raise BadRequest(f"the engine serving this episode died and was restarted ({e}); "
                             f"the episode will be played again from its start", status=503)
        calls.calls.append(Call(list(prompt_ids), gen, extends))
        text = self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
        return prompt_ids, gen, _without_stop(text, sampling)

    def _response(self, episode_id: int, calls: EpisodeCalls, kind: str, choice: dict,
                  prompt_ids: list[int], gen: Generation) -> dict:
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        return {"id": f"{prefix}-{episode_id}-{len(calls.calls)}", "object": kind,
                "created": int(time.time()), "model": self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": len(prompt_ids),
                          "completion_tokens": len(gen.output_ids),
                          "total_tokens": len(prompt_ids) + len(gen.output_ids)}}

    def _pieces(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]


# ---------------------------------------------------------------------- request checks
async def _json_object(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as e:
        raise BadRequest(f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_short(body)}")
    return body


def _check_fields(body: dict, main: str, chat: bool) -> None:
    for key in body:
        if key != main and key not in SAMPLING_FIELDS:
            raise BadRequest(f"{key}: not supported by the ragen-mega gateway (supported: "
                             f"{', '.join((main,) + SAMPLING_FIELDS)})", key)
    if main not in body:
        raise BadRequest(f"{main}: required", main)
    if body.get("n", 1) != 1:
        raise BadRequest(f"n: only 1 completion per call (each call is one turn of the "
                         f"episode), got {_short(body['n'])}", "n")
    if body.get("stream", False) is not False:
        raise BadRequest(f"stream: streaming is not supported, got {_short(body['stream'])}",
                         "stream")
    logprobs = body.get("logprobs")
    if chat and not (logprobs is None or isinstance(logprobs, bool)):
        raise BadRequest(f"logprobs: true or false, got {_short(logprobs)}", "logprobs")
    if not chat and logprobs not in (None, 0):
        raise BadRequest(f"logprobs: only 0 or null on /v1/completions (per-token log-probs come "
                         f"with chat completions' logprobs: true), got {_short(logprobs)}",
                         "logprobs")
    if "model" in body and not isinstance(body["model"], str):
        raise BadRequest(f"model: must be a string, got {_short(body['model'])}", "model")


def _messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI messages as ``{"role", "content"}`` with text content (a list of text parts is
    joined); anything else is refused, naming the message and field."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"messages: must be a non-empty list, got {_short(messages)}",
                         "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where}: must be an object, got {_short(m)}", where)
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise BadRequest(f"{where}.{extra[0]}: not supported (messages carry role and "
                             f"text content only)", f"{where}.{extra[0]}")
        if m.get("role") not in ROLES:
            raise BadRequest(f"{where}.role: must be one of {', '.join(ROLES)}, got "
                             f"{_short(m.get('role'))}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise BadRequest(f"{where}.content: only text parts ({{'type': 'text', "
                                 f"'text': ...}}) are supported", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"{where}.content: must be a string, got {_short(content)}",
                             f"{where}.content")
        out.append({"role": m["role"], "content": content})
    return out


def _sampling(body: dict, defaults: dict[str, Any]) -> dict[str, Any]:
    """The engine's sampling parameters: the request's fields, the rollout's where absent."""
    sampling = dict(defaults)
    for key, low, high in (("temperature", 0.0, None), ("top_p", 0.0, 1.0)):
        if body.get(key) is not None:
            value = body[key]
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or value < low or (high is not None and value > high)
                    or (key == "top_p" and value == 0)):
                bounds = "(0, 1]" if key == "top_p" else ">= 0"
                raise BadRequest(f"{key}: must be a number in {bounds}, got {_short(value)}",
                                 key)
            sampling[key] = float(value)
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None:
            value = body[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadRequest(f"{key}: must be an integer >= 1, got {_short(value)}", key)
            sampling["max_new_tokens"] = value
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if (not isinstance(stop, list) or not 1 <= len(stop) <= 4
                or not all(isinstance(s, str) and s for s in stop)):
            raise BadRequest(f"stop: a non-empty string or a list of 1 to 4 of them, got "
                             f"{_short(body['stop'])}", "stop")
        sampling["stop"] = stop
    return sampling


def _without_stop(text: str, sampling: dict) -> str:
    """``text`` without the request's stop string it ends on (OpenAI leaves it out; the sampled
    ids keep it, so the conversation's next call is rendered afresh, and counted)."""
    for stop in sampling.get("stop", ()):
        if text.endswith(stop):
            return text[:-len(stop)]
    return text


def _finish(gen: Generation) -> str:
    return "length" if gen.finish_reason == "length" else "stop"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
