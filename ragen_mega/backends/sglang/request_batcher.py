"""One batched ``/generate`` for the requests that one pass of the event loop makes: RAGEN's
turn-by-turn batches, for small models whose per-request HTTP work (each request parsed by
SGLang's HTTP server and handed to the scheduler one by one) costs nearly as much as the model
(docs/design.md, "One training step"; benchmarks/README.md, ``rollout.batch_requests``).

:class:`RequestBatcher` leaves the episodes' code as it is: a request waits until the running
pass of the event loop ends (``loop.call_soon``), by when every episode woken by a batch's
answers has asked again; the waiting requests to one engine and adapter go as one batch, each
with its own sampling parameters (and ``sampling_seed``, so what it samples is unchanged). The
price: an episode's turn waits for its batch's slowest response (lock-step by turn, as in RAGEN).
Hence ``rollout.batch_requests``: on for small models on CPU, off where long, uneven responses
make the wait cost more than the requests.

A batch refused as too long for the engine's context is sent again one request at a time, so
only the too-long prompt fails; any other error fails every request of the batch.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from ragen_mega.backends.sglang.client import Completion, ContextLengthExceeded

#: ``send(key, prompts, sampling_params)``: one batched request of ``prompts`` (each with its own
#: sampling parameters) to the engine and adapter of ``key``; a completion per prompt, in order
SendBatch = Callable[[Hashable, list[list[int]], list[dict]], Awaitable[list[Completion]]]


class RequestBatcher:
    """Gathers the requests of one event-loop pass by ``key`` (engine, adapter) and sends each
    group as one batch through ``send`` (module docstring). Works on any number of event loops
    (each loop's requests are batched apart)."""

    def __init__(self, send: SendBatch):
        self.send = send
        self._waiting: dict[tuple[asyncio.AbstractEventLoop, Hashable],
                            list[tuple[list[int], dict, asyncio.Future]]] = {}
        self._sending: set[asyncio.Task] = set()

    async def generate(self, key: Hashable, prompt_ids: list[int], sampling: dict[str, Any]
                       ) -> Completion:
        loop = asyncio.get_running_loop()
        slot = (loop, key)
        future = loop.create_future()
        waiting = self._waiting.get(slot)
        if waiting is None:
            waiting = self._waiting[slot] = []
            loop.call_soon(self._flush, slot)
        waiting.append((prompt_ids, sampling, future))
        return await future

    def _flush(self, slot) -> None:
        task = asyncio.ensure_future(self._send(slot[1], self._waiting.pop(slot)))
        self._sending.add(task)  # a reference until it is done: the loop keeps only weak ones
        task.add_done_callback(self._sending.discard)

    async def _send(self, key, requests: list[tuple[list[int], dict, asyncio.Future]]) -> None:
        try:
            outs = await self.send(key, [r[0] for r in requests], [r[1] for r in requests])
        except ContextLengthExceeded as e:
            if len(requests) == 1:
                _settle(requests[0][2], error=e)
                return
            # one prompt too long refuses the whole batch: each alone, so only it fails
            await asyncio.gather(*(self._send(key, [r]) for r in requests))
            return
        except BaseException as e:  # noqa: BLE001 - each request raises what the batch met
            for *_, future in requests:
                _settle(future, error=e)
            if not isinstance(e, Exception):
                raise
            return
        for (*_, future), out in zip(requests, outs):
            _settle(future, result=out)


def _settle(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    """Complete ``future`` unless its waiter has gone (an episode cancelled meanwhile)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
