"""HTTP client for one SGLang server: token-in/token-out generation and the weight-update API.

Prompts go in as ``input_ids``, completions come back as ``output_ids`` with
``meta_info.output_token_logprobs`` (docs/design.md, "Token-in, token-out").
:class:`AsyncEngineClient` is the aiohttp client; :class:`EngineClient` runs it on a private
event-loop thread, for plain code and several threads at once (e.g. a weight sender that keeps
an HTTP call open while it broadcasts).

Errors are :class:`EngineError` naming the engine URL and the endpoint. Only repeatable calls are
retried (generation, health, info, flush): a weight-update call that timed out may still run on
the server, and repeating it would desynchronise the broadcast.

Endpoints (SGLang 0.5.23, sglang/srt/entrypoints/http_server.py): /generate, /health_generate,
/model_info, /server_info, /flush_cache, /begin_weight_update, /end_weight_update,
/init_weights_update_group, /destroy_weights_update_group, /update_weights_from_distributed,
/update_weights_from_tensor, /update_weight_version, /pause_generation, /continue_generation,
/release_memory_occupation, /resume_memory_occupation, /load_lora_adapter, /unload_lora_adapter.
SGLang refuses a weight update outside a ``begin_weight_update``/``end_weight_update`` session
(``weight_sender.py`` opens one per engine around a whole update).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import functools
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Coroutine, Sequence

import aiohttp
import numpy as np

from ragen_mega.http_token import bearer_headers


# idle connections close on the client's side first (``server.build_env`` sets the server's
# SGLANG_TIMEOUT_KEEP_ALIVE longer), so no request goes out on a connection the server just
# closed: a weight-update call is never retried, and that race would fail it
CLIENT_KEEP_ALIVE_S = 15


class EngineError(RuntimeError):
    """A request to an SGLang engine failed; the message names the URL and endpoint."""


class EngineKeyRefused(EngineError):
    """The engine answered 401/403: the request carried no key, or not the engine's. A live
    engine that refuses is not dead: restarting it would hide the wrong key, not fix it."""


class ContextLengthExceeded(EngineError):
    """The engine refused a prompt (plus its ``max_new_tokens``) longer than its context: SGLang
    answers HTTP 400 naming "the model's context length" / "maximum context length"."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion, in token ids (never text).

    ``output_logprobs[i]`` is the engine's log-probability of ``output_ids[i]`` (``None`` when
    the request did not ask for logprobs). ``finish_reason`` is ``"stop"`` (EOS, a stop token or
    a stop string: ``matched_stop`` says which), ``"length"`` or ``"abort"``.
    ``routed_experts`` (a mixture of experts, when asked for and the server was started with
    ``--enable-return-routed-experts``): the experts each prompt and output token but the last
    was routed to, flat int32 in the order [token, layer, top-k].
    ``token_versions[i]``: the weight version that sampled ``output_ids[i]``; a request that
    was paused for a weight update and continued after it has tokens of two (SGLang's
    ``weight_versions`` spans; ``weight_version`` is the last).
    """

    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: str
    matched_stop: int | str | None
    weight_version: str
    prompt_tokens: int
    text: str
    meta_info: dict
    routed_experts: np.ndarray | None = None
    token_versions: list[str] | None = None


def _token_versions(meta: dict, tokens: int, version: str) -> list[str]:
    """Each output token's weight version from SGLang's ``weight_versions`` spans (``[{version,
    start, end}]`` over the output); a server that sends none sampled every token with
    ``version``. Spans that do not cover the output exactly are a malformed response."""
    spans = meta.get("weight_versions")
    if spans is None:
        return [version] * tokens
    versions = [str(span["version"]) for span in spans
                for _ in range(int(span["end"]) - int(span["start"]))]
    if len(versions) != tokens or any(a["end"] != b["start"] for a, b in zip(spans, spans[1:])):
        raise ValueError(f"weight_versions spans {spans} do not cover the {tokens} output tokens")
    return versions


def _is_token_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                for t in x)


def _check_input_ids(input_ids: Any) -> bool:
    """Validate prompts; return True for a single prompt (list[int]), False for a batch."""
    if _is_token_list(input_ids) and len(input_ids) > 0:
        return True
    if isinstance(input_ids, (list, tuple)) and input_ids and all(
            _is_token_list(p) and len(p) > 0 for p in input_ids):
        return False
    raise ValueError("generate: input_ids must be a non-empty list[int] or a non-empty "
                     f"list of non-empty list[int]; got {str(input_ids)[:200]}")


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (SGLang resolves it with getattr(torch, name))."""
    return str(dtype).removeprefix("torch.")


class AsyncEngineClient:
    """Async client of one SGLang server at ``url``.

    ``timeout`` bounds each HTTP attempt (seconds); ``retries`` is how many times a repeatable
    call is retried after a connection error, a timeout or a 5xx answer (with ``backoff`` s,
    doubling). ``api_key``: the engine's key (``launch_server(api_key=...)``), sent with every
    request. A client belongs to the event loop it is first used on.
    """

    def __init__(self, url: str, *, timeout: float = 300.0, retries: int = 2,
                 backoff: float = 0.5, connect_timeout: float = 10.0,
                 api_key: str | None = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"EngineClient: url must start with http:// or https://, got {url!r}")
        if retries < 0:
            raise ValueError(f"EngineClient: retries must be >= 0, got {retries}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.connect_timeout = connect_timeout
        self._headers = bearer_headers(api_key)
        self._session: aiohttp.ClientSession | None = None

    async def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEP_ALIVE_S),
                headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "AsyncEngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def request(self, method: str, path: str, payload: dict | None = None, *,
                      timeout: float | None = None, retry: bool = True,
                      expect_json: bool = True) -> Any:
        """One call to ``path``; JSON (or text) result, or :class:`EngineError`."""
        where = f"{method} {self.url}{path}"
        timeout = self.timeout if timeout is None else timeout
        attempts = 1 + (self.retries if retry else 0)
        last: str = ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            session = await self._get_session()
            try:
                async with session.request(
                        method, f"{self.url}{path}", json=payload,
                        timeout=aiohttp.ClientTimeout(total=timeout,
                                                      sock_connect=self.connect_timeout)) as r:
                    body = await r.read()
                    status = r.status
            except asyncio.TimeoutError:
                last = f"no answer within {timeout:g} s"
                continue
            except aiohttp.ClientConnectionError as e:
                last = f"cannot connect ({type(e).__name__}: {e}); is the engine running?"
                continue
            text = body.decode("utf-8", errors="replace")
            if status >= 500:
                last = f"HTTP {status}: {text[:500]}"
                continue
            if status in (401, 403):
                sent = "did not match" if self._headers else "was not sent"
                raise EngineKeyRefused(f"{where} was refused: HTTP {status}, the engine's key "
                                  f"{sent}: {text[:300]}")
            if status >= 400:
                error = (ContextLengthExceeded if status == 400 and "context length" in text
                         else EngineError)
                raise error(f"{where} was refused: HTTP {status}: {text[:1000]}")
            if not expect_json:
                return text
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                raise EngineError(
                    f"{where}: malformed response (not JSON): {text[:300]!r}") from None
        raise EngineError(f"{where} failed after {attempts} attempt(s): {last}")

    async def _control(self, path: str, payload: dict | None = None, *,
                       timeout: float | None = None) -> dict:
        """A state-changing call (never retried); checks SGLang's ``success`` flag."""
        out = await self.request("POST", path, payload or {}, timeout=timeout, retry=False)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(f"POST {self.url}{path} failed: {out.get('message')}")
        return out

    # ----- health and info -----

    async def health(self, timeout: float = 30.0, generate: bool = True) -> bool:
        """True if the engine generates (``/health_generate`` answers 200); ``generate=False``:
        if its HTTP server answers at all (``/model_info``, which needs no scheduler step and so
        no weights: a colocated engine's released memory does not make it look dead). An
        engine that refuses this client's key raises :class:`EngineKeyRefused`."""
        try:
            await self.request("GET", "/health_generate" if generate else "/model_info",
                               timeout=timeout, retry=False, expect_json=False)
            return True
        except EngineKeyRefused:
            raise
        except EngineError:
            return False

    async def model_info(self) -> dict:
        return await self.request("GET", "/model_info")

    async def server_info(self) -> dict:
        return await self.request("GET", "/server_info")

    # ----- generation -----

    def _parse_completion(self, item: Any, return_logprob: bool,
                          return_routed_experts: bool = False) -> Completion:
        where = f"POST {self.url}/generate"
        try:
            output_ids = [int(t) for t in item["output_ids"]]
            meta = item["meta_info"]
            finish = meta["finish_reason"] or {}
            logprobs = None
            if return_logprob:
                entries = meta["output_token_logprobs"]
                if [int(e[1]) for e in entries] != output_ids:
                    raise EngineError(f"{where}: malformed response: output_token_logprobs "
                                      f"token ids do not match output_ids")
                logprobs = [float(e[0]) for e in entries]
            routed = None
            if return_routed_experts:
                routed = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
            version = str(meta.get("weight_version"))
            return Completion(output_ids=output_ids, output_logprobs=logprobs,
                              finish_reason=finish.get("type", "unknown"),
                              matched_stop=finish.get("matched"),
                              weight_version=version,
                              prompt_tokens=int(meta.get("prompt_tokens", 0)),
                              text=item.get("text", ""), meta_info=meta,
                              routed_experts=routed,
                              token_versions=_token_versions(meta, len(output_ids), version))
        except (KeyError, TypeError, ValueError, IndexError, binascii.Error) as e:
            raise EngineError(f"{where}: malformed response ({type(e).__name__}: {e}): "
                              f"{str(item)[:300]}") from None

    async def generate(self, input_ids: Sequence[int] | Sequence[Sequence[int]],
                       sampling_params: dict | Sequence[dict] | None = None, *,
                       return_logprob: bool = True, timeout: float | None = None,
                       return_routed_experts: bool = False, lora_path: str | None = None):
        """Sample one completion for one prompt or for each of a batch of prompts, given as
        token ids; a batch is one engine request.

        ``sampling_params`` is SGLang's dict (``temperature``, ``top_p``, ``top_k``,
        ``max_new_tokens``, ``stop`` (strings), ``stop_token_ids``, ``ignore_eos`` (which in
        SGLang also disables ``stop_token_ids``), ``sampling_seed``, ...); a batch may give a
        list of them, one per prompt (each its own ``sampling_seed``, say). ``n`` stays 1:
        several samples of a prompt are that prompt sent again, each with its own seed. The
        result mirrors the input: one prompt -> a :class:`Completion`; a batch -> a list of
        them. ``return_routed_experts``: each completion's ``routed_experts`` (see
        :class:`Completion`). ``lora_path``: the name of a LoRA adapter the engine serves
        (:meth:`load_lora_adapter`) to generate with; None: the base weights.
        """
        single = _check_input_ids(input_ids)
        prompts = [list(input_ids)] if single else [list(p) for p in input_ids]
        if isinstance(sampling_params, (list, tuple)):
            if single or len(sampling_params) != len(prompts):
                raise ValueError(f"generate: a list of sampling_params needs a batch of as many "
                                 f"prompts, got {len(sampling_params)} for {len(prompts)}")
            params: dict | list[dict] = [dict(p) for p in sampling_params]
        else:
            params = dict(sampling_params or {})
        if any(p.get("n", 1) != 1 for p in (params if isinstance(params, list) else [params])):
            raise ValueError("generate: sampling_params['n'] must be 1 (send a prompt once per "
                             "sample, each with its own sampling_seed)")
        body = {"input_ids": prompts[0] if single else prompts, "sampling_params": params,
                "return_logprob": return_logprob}
        if return_routed_experts:
            body["return_routed_experts"] = True
        if lora_path is not None:
            body["lora_path"] = lora_path
        out = await self.request("POST", "/generate", body, timeout=timeout)
        items = out if isinstance(out, list) else [out]
        if len(items) != len(prompts):
            raise EngineError(f"POST {self.url}/generate: malformed response: expected "
                              f"{len(prompts)} completion(s), got {len(items)}")
        results = [self._parse_completion(item, return_logprob, return_routed_experts)
                   for item in items]
        return results[0] if single else results

    # ----- cache and scheduling -----

    async def flush_cache(self) -> None:
        """Drop the radix (prefix) cache; SGLang refuses while requests are running."""
        await self.request("POST", "/flush_cache", expect_json=False)

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop scheduling: ``abort`` running requests, ``retract`` them to the queue (KV cache
        can then be flushed) or keep them ``in_place``."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_generation: mode must be abort|retract|in_place, got {mode!r}")
        await self.request("POST", "/pause_generation", {"mode": mode}, retry=False)

    async def continue_generation(self) -> None:
        await self.request("POST", "/continue_generation", {}, retry=False)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free weights and/or KV cache memory (``tags``: ``weights``, ``kv_cache``; GPU only,
        a no-op on CPU)."""
        await self.request("POST", "/release_memory_occupation", {"tags": tags}, retry=False,
                           expect_json=False)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self.request("POST", "/resume_memory_occupation", {"tags": tags}, retry=False,
                           expect_json=False)

    # ----- weight updates -----

    async def begin_weight_update(self) -> None:
        await self._control("/begin_weight_update")

    async def end_weight_update(self) -> None:
        await self._control("/end_weight_update")

    async def init_weights_update_group(self, master_addr: str, master_port: int,
                                        rank_offset: int, world_size: int,
                                        group_name: str = "weight_update_group",
                                        backend: str = "nccl",
                                        timeout: float | None = None) -> None:
        """Make the engine's TP ranks join a process group (ranks ``rank_offset`` ...
        ``rank_offset + tp - 1`` of ``world_size``) whose rank 0 is the weight sender. Blocks
        until every member has joined, so the sender must join concurrently."""
        await self._control("/init_weights_update_group", {
            "master_address": master_addr, "master_port": int(master_port),
            "rank_offset": int(rank_offset), "world_size": int(world_size),
            "group_name": group_name, "backend": backend}, timeout=timeout)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._control("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence,
                                              shapes: Sequence[Sequence[int]],
                                              group_name: str = "weight_update_group", *,
                                              flush_cache: bool = True,
                                              load_format: str | None = None,
                                              weight_version: str | None = None,
                                              timeout: float | None = None) -> None:
        """Receive tensors broadcast from rank 0 of ``group_name`` and load them.

        The engine allocates ``names``/``dtypes``/``shapes`` and waits for the broadcast, so
        this call returns only after the sender has broadcast: issue it concurrently with the
        broadcast. ``load_format="flattened_bucket"``: one uint8 tensor holding all of them.
        """
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise ValueError("update_weights_from_distributed: names, dtypes and shapes must be "
                             f"non-empty and equally long, got {len(names)}, {len(dtypes)}, "
                             f"{len(shapes)}")
        if load_format not in (None, "flattened_bucket"):
            raise ValueError("update_weights_from_distributed: load_format must be None or "
                             f"'flattened_bucket', got {load_format!r}")
        await self._control("/update_weights_from_distributed", {
            "names": list(names), "dtypes": [dtype_name(d) for d in dtypes],
            "shapes": [list(s) for s in shapes], "group_name": group_name,
            "flush_cache": flush_cache, "load_format": load_format,
            "weight_version": weight_version}, timeout=timeout)

    async def update_weights_from_tensor(self, serialized_named_tensors: Sequence[bytes | str], *,
                                         load_format: str | None = None,
                                         flush_cache: bool = True,
                                         weight_version: str | None = None,
                                         timeout: float | None = None) -> None:
        """Colocated update: one serialized payload per engine TP rank (see
        ``payloads.engine_payload`` and ``pickle_for_receiver``); tensors travel by shared
        memory, not HTTP."""
        payloads = [base64.b64encode(p).decode("ascii") if isinstance(p, (bytes, bytearray))
                    else p for p in serialized_named_tensors]
        await self._control("/update_weights_from_tensor", {
            "serialized_named_tensors": payloads, "load_format": load_format,
            "flush_cache": flush_cache, "weight_version": weight_version}, timeout=timeout)

    async def update_weight_version(self, new_version: str | int, *,
                                    abort_all_requests: bool = False) -> None:
        """Label the engine's weights; completions report it as ``Completion.weight_version``."""
        await self._control("/update_weight_version", {
            "new_version": str(new_version), "abort_all_requests": abort_all_requests})

    # ----- LoRA adapters (a server started with --enable-lora) -----

    async def load_lora_adapter(self, name: str, path: str | Path, *,
                                timeout: float | None = None) -> None:
        """Serve the PEFT adapter directory ``path`` (read by the server) as ``name``."""
        await self._lora_control("/load_lora_adapter", {"lora_name": name,
                                                        "lora_path": str(path)}, timeout)

    async def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Stop serving adapter ``name``; the server answers once the requests that use it
        have finished."""
        await self._lora_control("/unload_lora_adapter", {"lora_name": name}, timeout)

    async def _lora_control(self, path: str, payload: dict, timeout: float | None) -> None:
        out = await self.request("POST", path, payload, timeout=timeout, retry=False)
        if not isinstance(out, dict) or not out.get("success"):
            message = out.get("error_message") if isinstance(out, dict) else out
            raise EngineError(f"POST {self.url}{path} ({payload['lora_name']}) failed: {message}")


def _blocking(method):
    """The synchronous form of ``AsyncEngineClient.<method>``, with its signature and doc."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return self.submit(method(self.aio, *args, **kwargs)).result()
    return call


class EngineClient:
    """Synchronous :class:`AsyncEngineClient` (same methods, same arguments) on its own
    event-loop thread; :meth:`submit` starts a call of :attr:`aio` and returns a
    ``concurrent.futures.Future`` for overlapping work (e.g. a broadcast)."""

    def __init__(self, url: str, *, timeout: float = 300.0, retries: int = 2,
                 backoff: float = 0.5, connect_timeout: float = 10.0,
                 api_key: str | None = None):
        self.aio = AsyncEngineClient(url, timeout=timeout, retries=retries, backoff=backoff,
                                     connect_timeout=connect_timeout, api_key=api_key)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"EngineClient {url}")
        self._thread.start()

    @property
    def url(self) -> str:
        return self.aio.url

    def submit(self, call: Coroutine) -> concurrent.futures.Future:
        """Run ``call``, a coroutine of :attr:`aio` (``client.aio.flush_cache()``), on this
        client's loop; return its Future."""
        return asyncio.run_coroutine_threadsafe(call, self._loop)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self.submit(self.aio.close()).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    health = _blocking(AsyncEngineClient.health)
    model_info = _blocking(AsyncEngineClient.model_info)
    server_info = _blocking(AsyncEngineClient.server_info)
    generate = _blocking(AsyncEngineClient.generate)
    flush_cache = _blocking(AsyncEngineClient.flush_cache)
    pause_generation = _blocking(AsyncEngineClient.pause_generation)
    continue_generation = _blocking(AsyncEngineClient.continue_generation)
    release_memory_occupation = _blocking(AsyncEngineClient.release_memory_occupation)
    resume_memory_occupation = _blocking(AsyncEngineClient.resume_memory_occupation)
    begin_weight_update = _blocking(AsyncEngineClient.begin_weight_update)
    end_weight_update = _blocking(AsyncEngineClient.end_weight_update)
    init_weights_update_group = _blocking(AsyncEngineClient.init_weights_update_group)
    destroy_weights_update_group = _blocking(AsyncEngineClient.destroy_weights_update_group)
    update_weights_from_distributed = _blocking(AsyncEngineClient.update_weights_from_distributed)
    update_weights_from_tensor = _blocking(AsyncEngineClient.update_weights_from_tensor)
    update_weight_version = _blocking(AsyncEngineClient.update_weight_version)
    load_lora_adapter = _blocking(AsyncEngineClient.load_lora_adapter)
    unload_lora_adapter = _blocking(AsyncEngineClient.unload_lora_adapter)
