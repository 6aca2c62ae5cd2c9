"""EngineClient error paths that a healthy SGLang server cannot be pushed into.

A small fake HTTP server on 127.0.0.1 plays the broken engine (hanging, failing with 5xx,
answering garbage); a real process that is killed plays the dead one.
"""
from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ragen_mega.backends.sglang.client import ContextLengthExceeded, EngineClient, EngineError
from ragen_mega.backends.sglang.server import free_port

GOOD_ITEM = {"text": "ab", "output_ids": [5, 6],
             "meta_info": {"finish_reason": {"type": "length", "length": 2},
                           "prompt_tokens": 3, "weight_version": "7",
                           "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]]}}


class FakeEngine:
    """``routes[path]`` is a list of (status, body) answers, used in turn (the last repeats);
    a status of ``None`` means: never answer (until the test ends)."""

    def __init__(self):
        self.routes: dict[str, list] = {}
        self.calls: dict[str, int] = {}
        self.release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                n = fake.calls.get(self.path, 0)
                fake.calls[self.path] = n + 1
                answers = fake.routes.get(self.path, [(404, "no such route")])
                status, body = answers[min(n, len(answers) - 1)]
                if status is None:
                    fake.release.wait(60)
                    return
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    engine = FakeEngine()
    yield engine
    engine.close()


def test_well_formed_answer_is_parsed(fake):
    """The fake speaks SGLang's format: the happy path works, so the failures below are real."""
    fake.routes["/generate"] = [(200, GOOD_ITEM)]
    with EngineClient(fake.url) as client:
        out = client.generate([1, 2, 3], {"max_new_tokens": 2})
    assert out.output_ids == [5, 6] and out.output_logprobs == [-0.5, -1.5]
    assert out.finish_reason == "length" and out.weight_version == "7"


def test_engine_that_does_not_answer_times_out_naming_url(fake):
    fake.routes["/generate"] = [(None, "")]
    with EngineClient(fake.url, timeout=0.5, retries=1, backoff=0.1) as client:
        start = time.monotonic()
        with pytest.raises(EngineError) as err:
            client.generate([1, 2, 3], {"max_new_tokens": 2})
        elapsed = time.monotonic() - start
    assert f"{fake.url}/generate" in str(err.value)
    assert "no answer within 0.5 s" in str(err.value) and "2 attempt(s)" in str(err.value)
    assert fake.calls["/generate"] == 2
    assert elapsed < 30  # bounded: the fake would hold the request for 60 s


def test_server_errors_are_retried_then_reported(fake):
    fake.routes["/generate"] = [(500, "scheduler exploded")]
    with EngineClient(fake.url, retries=2, backoff=0.01) as client:
        with pytest.raises(EngineError, match="HTTP 500: scheduler exploded") as err:
            client.generate([1, 2, 3])
    assert fake.url in str(err.value) and "3 attempt(s)" in str(err.value)
    assert fake.calls["/generate"] == 3


def test_transient_server_error_recovers_by_retry(fake):
    fake.routes["/generate"] = [(503, "busy"), (200, GOOD_ITEM)]
    with EngineClient(fake.url, retries=1, backoff=0.01) as client:
        assert client.generate([1, 2, 3]).output_ids == [5, 6]
    assert fake.calls["/generate"] == 2


def test_refusals_are_not_retried(fake):
    fake.routes["/generate"] = [(400, '{"error": "max_new_tokens must be >= 0"}')]
    fake.routes["/update_weights_from_distributed"] = [(500, "boom")]
    with EngineClient(fake.url, retries=3, backoff=0.01) as client:
        with pytest.raises(EngineError, match="refused: HTTP 400.*max_new_tokens") as err:
            client.generate([1, 2, 3], {"max_new_tokens": -1})
        # only the engine's context-length refusal ends an episode quietly (a real one:
        # tests/test_faults.py); any other refusal is a bug to report
        assert not isinstance(err.value, ContextLengthExceeded)
        with pytest.raises(EngineError, match="1 attempt"):  # weight updates: never repeated
            client.update_weights_from_distributed(["w"], ["float32"], [[2]], "g")
    assert fake.calls == {"/generate": 1, "/update_weights_from_distributed": 1}


def test_control_call_reporting_failure_raises(fake):
    fake.routes["/begin_weight_update"] = [(200, {"success": False, "message": "busy updating"})]
    with EngineClient(fake.url) as client:
        with pytest.raises(EngineError, match="begin_weight_update failed: busy updating"):
            client.begin_weight_update()


@pytest.mark.parametrize("body, problem", [
    ("<html>oops</html>", "not JSON"),
    ({"text": "x"}, "KeyError"),
    ({**GOOD_ITEM, "meta_info": {**GOOD_ITEM["meta_info"],
                                 "output_token_logprobs": [[-0.5, 9, None], [-1.5, 6, None]]}},
     "do not match output_ids"),
    ([GOOD_ITEM, GOOD_ITEM], r"expected 1 completion\(s\), got 2"),
])
def test_malformed_responses_are_reported(fake, body, problem):
    fake.routes["/generate"] = [(200, body)]
    with EngineClient(fake.url, retries=0) as client:
        with pytest.raises(EngineError, match=problem) as err:
            client.generate([1, 2, 3])
    assert f"{fake.url}/generate" in str(err.value) and "malformed" in str(err.value)


def test_dead_server_is_reported(tmp_path):
    """A real server process that is killed: the client says it cannot connect."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                             "127.0.0.1", "--directory", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:  # wait until it listens, so the kill below is what breaks it
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "http.server did not start"
                time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    url = f"http://127.0.0.1:{port}"
    with EngineClient(url, retries=1, backoff=0.01) as client:
        with pytest.raises(EngineError, match="cannot connect.*is the engine running") as err:
            client.generate([1, 2, 3])
        assert not client.health()
    assert f"{url}/generate" in str(err.value)


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="url must start with http"):
        EngineClient("127.0.0.1:30000")
    with EngineClient("http://127.0.0.1:9") as client:
        with pytest.raises(ValueError, match="input_ids must be a non-empty list"):
            client.generate("hello")
        with pytest.raises(ValueError, match=r"sampling_params\['n'\] must be 1"):
            client.generate([1], {"n": 4})
        with pytest.raises(ValueError, match="a list of sampling_params needs a batch of as many"):
            client.generate([[1], [2]], [{}])
        with pytest.raises(ValueError, match="mode must be abort"):
            client.pause_generation("stop")


def test_sender_that_cannot_host_the_group_says_why_at_once(fake):
    """The sender hosts the group's store; when that fails (here: its port is taken) the error
    is the sender's own, raised at once, not the engines' time-out hiding it."""
    from torch.distributed import DistNetworkError

    from ragen_mega.backends.sglang.weight_sender import BucketedWeightSender

    fake.routes["/init_weights_update_group"] = [(None, None)]  # engines wait for the group
    with socket.socket() as taken, EngineClient(fake.url) as client:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        sender = BucketedWeightSender([client], backend="gloo", engine_tp_sizes=[1],
                                      master_port=taken.getsockname()[1], timeout=5)
        with pytest.raises(DistNetworkError, match="address already in use"):
            sender.connect()
    assert sender.group is None


@contextlib.contextmanager
def _sender_to_a_silent_peer(fake, update_answer):
    """A sender whose one engine is ``fake`` (answering every control call with success and the
    update with ``update_answer``) plus a process that joins the group as the engine's rank 1
    and then never receives. Yields the sender, connected; kills the peer, then closes."""
    from ragen_mega.backends.sglang.weight_sender import BucketedWeightSender

    ok = {"success": True, "message": ""}
    for path in ("/begin_weight_update", "/end_weight_update", "/update_weight_version",
                 "/init_weights_update_group", "/destroy_weights_update_group"):
        fake.routes[path] = [(200, ok)]
    fake.routes["/update_weights_from_distributed"] = [update_answer]
    port = free_port()
    peer = subprocess.Popen([sys.executable, "-c", (
        "import time; from ragen_mega.backends.sglang.update_group import join_update_group, "
        "update_group_store; "
        f"join_update_group(update_group_store('127.0.0.1', {port}, 2, rank=1), 1, 2, 'g', "
        "'gloo'); time.sleep(300)")])
    try:
        with EngineClient(fake.url) as client:
            sender = BucketedWeightSender([client], backend="gloo", master_port=port,
                                          group_name="g", engine_tp_sizes=[1], timeout=60)
            sender.connect()
            yield sender
            peer.kill()  # a broadcast nobody receives ends when its receiver goes away ...
            peer.wait()
            sender.close()  # ... and then the broken group can be torn down
            assert fake.calls["/destroy_weights_update_group"] == 1 and sender.group is None
    finally:
        peer.kill()
        peer.wait()


def test_sender_stops_when_an_engine_refuses_the_broadcast(fake):
    """An engine that joined the group but refuses the update never receives the broadcast: the
    sender must raise (naming the engine) instead of waiting for it forever."""
    import torch

    refusal = (400, {"success": False, "message": "Group g not in []"})
    with _sender_to_a_silent_peer(fake, refusal) as sender:
        with pytest.raises(EngineError, match="Group g not in") as err:
            sender.send([("w", torch.ones(1 << 22))], version=1)
        assert fake.url in str(err.value)
        assert fake.calls["/end_weight_update"] == 1  # the session was still closed
        assert "/update_weight_version" not in fake.calls  # a failed sync is not labelled


def test_a_failed_update_is_raised_without_waiting_for_the_other_engines():
    """A weight update's answers are awaited together: one engine's failure (a dead server's) is
    raised at once, while an engine before it in order still has not answered (the survivor of
    a broadcast whose other receiver died can wait in its receive until its time-out)."""
    from concurrent.futures import Future

    from ragen_mega.backends.sglang.weight_sender import _answered

    waiting, failed, outcome = Future(), Future(), Future()
    failed.set_exception(EngineError("POST http://engine-1/update_weights_from_distributed "
                                     "failed: cannot connect"))

    def await_both():
        try:
            _answered([waiting, failed])
            outcome.set_result(None)
        except EngineError as e:
            outcome.set_result(e)

    threading.Thread(target=await_both, daemon=True).start()
    assert "engine-1" in str(outcome.result(timeout=60))  # not left waiting on engine 0
    waiting.cancel()


@pytest.mark.parametrize("stream, problem", [
    ([("v", (4,))], r"depart from their layout: expected 'w' \(4,\) torch.float32, got 'v'"),
    ([("w", (5,))], r"expected 'w' \(4,\) torch.float32, got 'w' \(5,\)"),
    ([("w", (4,))], r"'u' was announced but never came"),
    ([("w", (4,)), ("u", (2,)), ("x", (1,))], r"go on past their layout.*'x' was not announced"),
])
def test_streamed_sync_stops_where_the_tensors_leave_their_layout(fake, stream, problem):
    """With a layout the engines are told a bucket's tensors before they exist; a stream that
    then differs (name, shape, too few, too many) raises at once, naming the tensor, and the
    sync is not labelled with the new version; the engines' sessions are closed."""
    import torch

    layout = [("w", (4,), torch.float32), ("u", (2,), torch.float32)]
    with _sender_to_a_silent_peer(fake, (200, {"success": True, "message": ""})) as sender:
        with pytest.raises(ValueError, match=problem):
            sender.send(((name, torch.ones(shape)) for name, shape in stream), version=1,
                        layout=layout)
        assert fake.calls["/end_weight_update"] == 1  # the session was closed, as unstreamed
        assert "/update_weight_version" not in fake.calls
