"""The real SGLang 0.5.23 server on CPU against transformers as the reference.

One tiny-Qwen2 server (fp32) serves every check of this module (launches cost ~20 s and
~1.6 GB each); a second one runs SmolLM2-135M-Instruct for one real-model check. Tests that
change the served weights put the original checkpoint back (through the colocated sender)
before they end, so the order of tests does not matter.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from ragen_mega.backends.sglang.client import EngineClient, EngineError, dtype_name
from ragen_mega.backends.sglang.cpu_standins import STANDIN_ROOT
from ragen_mega.backends.sglang.server import launch_server
from ragen_mega.backends.sglang.payloads import (engine_payload, flatten_bucket,
                                                 pickle_for_receiver)
from ragen_mega.backends.sglang.weight_sender import BucketedWeightSender, iter_buckets

PROMPTS = [[1, 2, 3, 4, 5], [100, 2000, 30000, 77], list(range(500, 530))]
GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt, n_new):
    """Greedy continuation and the log-probs of the chosen tokens, by plain forward passes."""
    ids = list(prompt)
    logprobs = []
    for _ in range(n_new):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        lp = torch.log_softmax(logits, -1)
        nxt = int(torch.argmax(lp))
        ids.append(nxt)
        logprobs.append(float(lp[nxt]))
    return ids[len(prompt):], logprobs


def perturbed_state(model, seed, scale=0.05):
    """HF-named fp32 weights with noise; loaded into ``model`` too, as the reference."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp(min=1e-3))
            state[name] = p.detach().clone()
    return state


@pytest.fixture(scope="module")
def tiny_dir(tiny_model):
    return tiny_model("qwen2", tied=False)


@pytest.fixture(scope="module")
def taken_port():
    """A port held (bound) by this module: the first one the engine's launch draws, as when
    another process takes the port between ``free_port`` and the server's own bind."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


ENGINE_KEY = "-k3y-" + os.urandom(12).hex()   # a run's key may begin with "-"


@pytest.fixture(scope="module")
def engine(tiny_dir, taken_port):
    """The module's server, with a key (as a run starts its engines) that its client sends;
    its launch first draws ``taken_port`` (so it must start again)."""
    from ragen_mega.backends.sglang import server as server_module

    draws, real_free_port = [taken_port], server_module.free_port
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server_module, "free_port",
                   lambda host: draws.pop() if draws else real_free_port(host))
        # cpu_threads=1: robust to other jobs on a small shared CPU (see benchmarks/README.md)
        server = launch_server(tiny_dir, dtype="float32", startup_timeout=600, cpu_threads=1,
                               api_key=ENGINE_KEY)
    with server, EngineClient(server.url, timeout=120, retries=1, api_key=ENGINE_KEY) as client:
        yield server, client


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """transformers' greedy continuations of PROMPTS on the original tiny checkpoint."""
    model = hf_model(tiny_dir)
    return [hf_greedy(model, p, GREEDY["max_new_tokens"]) for p in PROMPTS]


def restore_original(client, tiny_dir) -> None:
    """The checkpoint's own weights back into the engine, labelled ``original``, through the
    colocated sender (the package's own path)."""
    state = {name: p.detach() for name, p in hf_model(tiny_dir).named_parameters()}
    BucketedWeightSender([client], mode="tensor", bucket_bytes=1 << 30).send(
        state.items(), version="original")


def update_in_session(client, named_tensors) -> None:
    """One colocated update inside the begin/end session SGLang requires (as the sender does)."""
    client.begin_weight_update()
    try:
        client.update_weights_from_tensor([pickle_for_receiver(engine_payload(named_tensors))])
    finally:
        client.end_weight_update()


def check_against(client, refs, atol=2e-4):
    outs = client.generate(PROMPTS, GREEDY)
    for out, (ids, lps) in zip(outs, refs):
        assert out.output_ids == ids
        assert out.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, lps)) < atol
    return outs


def test_smollm2_real_model_matches_transformers(smollm2_dir):
    """First in the module, so its server does not share the CPU with the tiny one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    ids, lps = hf_greedy(hf_model(smollm2_dir), prompt, 12)
    with launch_server(smollm2_dir, dtype="float32", startup_timeout=600, cpu_threads=1) as server:
        with EngineClient(server.url, timeout=120) as client:
            out = client.generate(prompt, {"temperature": 0.0, "max_new_tokens": 12})
    assert out.output_ids == ids[:len(out.output_ids)]
    assert len(out.output_ids) == 12 or out.finish_reason == "stop"
    assert max(abs(a - b) for a, b in zip(out.output_logprobs, lps)) < 1e-3
    assert "Paris" in tok.decode(out.output_ids)


def test_server_handle_and_health(engine, taken_port):
    server, client = engine
    assert server.url == client.url and server.process.poll() is None
    # the first launch found its port taken and was replaced (not left waiting for start-up)
    first_log = (Path(tempfile.gettempdir()) / "ragen_mega_sglang" /
                 f"server-127.0.0.1-{taken_port}-{os.getpid()}.log")
    assert "address already in use" in first_log.read_text().lower()
    assert not server.url.endswith(f":{taken_port}")
    assert client.health()
    assert client.server_info()["device"] == "cpu"
    environ = dict(kv.split("=", 1) for kv in
                   open(f"/proc/{server.pid}/environ").read().split("\0") if "=" in kv)
    assert environ["SGLANG_USE_CPU_ENGINE"] == "1" and environ["OMP_NUM_THREADS"] == "1"
    assert environ["PYTHONPATH"].split(os.pathsep)[0] == str(STANDIN_ROOT)
    assert "--sleep-on-idle" in server.command and "--max-total-tokens" in server.command
    # the model registry imported qwen2.py (Qwen2ForCausalLM) alone: none of the ~260 others,
    # some of which fail to import on CPU and say so in the log when they are tried
    skipped = set(environ["SGLANG_DISABLED_MODEL_ARCHS"].split(","))
    assert "qwen2" not in skipped and {"llama", "qwen3", "qwen3_moe", "grok"} <= skipped
    assert "Ignore import error when loading" not in Path(server.log_file).read_text()


def test_model_modules_skipped_are_those_not_defining_the_architecture(tmp_path):
    """``unneeded_model_modules`` names every SGLang model module but the one defining the
    checkpoint's class; it skips nothing where it cannot tell (no ``architectures``, a class no
    module defines, no config)."""
    from ragen_mega.backends.sglang.model_modules import _models_dir, unneeded_model_modules

    every = {p.stem for p in _models_dir().glob("*.py")} - {"__init__"}
    for arch, module in (("Qwen3MoeForCausalLM", "qwen3_moe"), ("LlamaForCausalLM", "llama")):
        (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
        assert set(unneeded_model_modules(tmp_path).split(",")) == every - {module}
    for config in ({}, {"architectures": ["NoSuchModelForCausalLM"]}):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert unneeded_model_modules(tmp_path) is None
    assert unneeded_model_modules(tmp_path / "missing") is None


def test_greedy_and_logprobs_match_transformers(engine, reference):
    _, client = engine
    outs = check_against(client, reference)
    assert all(o.prompt_tokens == len(p) for o, p in zip(outs, PROMPTS))
    single = client.generate(PROMPTS[1], GREEDY)  # one prompt in -> one Completion out
    assert single.output_ids == reference[1][0]
    short = client.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 3})
    assert short.output_ids == reference[0][0][:3] and short.finish_reason == "length"


def test_concurrent_requests_from_threads(engine, reference):
    _, client = engine
    futures = [client.submit(client.aio.generate(p, GREEDY)) for p in PROMPTS * 3]
    got = [f.result().output_ids for f in futures]
    assert got == [r[0] for r in reference] * 3


def test_stop_token_ids_and_stop_strings(engine, reference, tiny_dir):
    from transformers import AutoTokenizer

    _, client = engine
    greedy = reference[2][0]
    stop_tok = greedy[4]
    first = greedy.index(stop_tok)
    stopping = {**GREEDY, "ignore_eos": False}  # SGLang's ignore_eos also ignores stop_token_ids
    out = client.generate(PROMPTS[2], {**stopping, "stop_token_ids": [stop_tok]})
    assert out.output_ids == greedy[:first + 1]
    assert out.finish_reason == "stop" and out.matched_stop == stop_tok

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    full_text = tok.decode(greedy)
    k = next(i for i in range(3, len(greedy)) if tok.decode(greedy[i]).strip()
             and tok.decode(greedy[i]).strip() not in tok.decode(greedy[:i]))
    stop = tok.decode(greedy[k]).strip()
    assert stop in full_text
    out = client.generate(PROMPTS[2], {**stopping, "stop": [stop]})
    assert out.finish_reason == "stop" and out.matched_stop == stop
    assert out.output_ids == greedy[:len(out.output_ids)]  # a prefix of the greedy run ...
    assert stop in tok.decode(out.output_ids)  # ... that ends where the stop string appears
    assert stop not in tok.decode(out.output_ids[:-1])


def test_distributed_weight_sync_bucket_sizes(engine, reference, tiny_dir):
    _, client = engine
    model = hf_model(tiny_dir)
    state = perturbed_state(model, seed=1)
    refs = [hf_greedy(model, p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    assert [r[0] for r in refs] != [r[0] for r in reference]  # the perturbation shows
    smallest = min(t.numel() * t.element_size() for t in state.values())
    rounds = [(512 << 20, None), (300_000, None), (smallest // 2, None),
              (300_000, "flattened_bucket")]
    runs = []
    with BucketedWeightSender([client], mode="distributed", backend="gloo") as sender:
        for i, (bucket_bytes, load_format) in enumerate(rounds):
            sender.bucket_bytes, sender.load_format = bucket_bytes, load_format
            stats = sender.send(state.items(), version=f"dist-{i}")
            assert stats.num_tensors == len(state)
            if i == 0:
                assert stats.num_buckets == 1
            if bucket_bytes < smallest:  # a bucket smaller than any tensor: each goes alone
                assert stats.num_buckets == len(state)
            assert client.model_info()["weight_version"] == f"dist-{i}"
            outs = check_against(client, refs)
            assert {o.weight_version for o in outs} == {f"dist-{i}"}
            runs.append([(o.output_ids, o.output_logprobs) for o in outs])
    assert all(run == runs[0] for run in runs)  # bucketing never changes what the engine holds

    restore_original(client, tiny_dir)
    check_against(client, reference)


def test_colocated_tensor_weight_sync(engine, reference, tiny_dir):
    _, client = engine
    model = hf_model(tiny_dir)
    state = perturbed_state(model, seed=2)
    refs = [hf_greedy(model, p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    for load_format in (None, "flattened_bucket"):
        sender = BucketedWeightSender([client], mode="tensor", bucket_bytes=300_000,
                                      load_format=load_format)
        stats = sender.send(state.items(), version=f"tensor-{load_format}")
        assert stats.num_buckets > 1
        assert client.model_info()["weight_version"] == f"tensor-{load_format}"
        check_against(client, refs)
        restore_original(client, tiny_dir)
        check_against(client, reference)
    assert client.model_info()["weight_version"] == "original"


def test_a_sync_between_two_tokens_continues_the_request_with_the_new_weights(engine, reference,
                                                                             tiny_dir):
    """The fully asynchronous mode's weight sync (``EngineGroup.generation_paused``): a request
    in flight is retracted at a token boundary, the weights change, and it continues. Its tokens
    report the version that sampled each, and each token's log-prob is that of the weights that
    sampled it given everything before it (transformers on the original, then the perturbed
    weights): the behaviour log-probs the IS weight divides by. Without the pause the update
    waits for the request (a mutation: the test then finds one version only)."""
    _, client = engine
    original = hf_model(tiny_dir)
    updated = hf_model(tiny_dir)
    state = perturbed_state(updated, seed=3)
    prompt = PROMPTS[2]
    sampling = {"temperature": 1.0, "max_new_tokens": 1500, "ignore_eos": True,
                "sampling_seed": 7}
    client.update_weight_version("7")
    held = client.submit(client.aio.generate(prompt, sampling))
    time.sleep(1.0)   # a few hundred tokens in
    client.pause_generation(mode="retract")
    assert not held.done()
    sender = BucketedWeightSender([client], mode="tensor", bucket_bytes=1 << 30)
    sender.send(state.items(), version="8")
    client.continue_generation()
    out = held.result(timeout=300)
    cut = out.token_versions.index("8")
    assert 0 < cut and set(out.token_versions[:cut]) == {"7"} \
        and set(out.token_versions[cut:]) == {"8"} and out.weight_version == "8"
    with torch.no_grad():
        ids = torch.tensor([prompt + out.output_ids[:-1]])
        want = [torch.log_softmax(m(ids).logits[0, len(prompt) - 1:].double(), -1)
                .gather(1, torch.tensor(out.output_ids)[:, None])[:, 0] for m in (original, updated)]
    got = torch.tensor(out.output_logprobs, dtype=torch.float64)
    assert (got[:cut] - want[0][:cut]).abs().max() < 2e-4
    assert (got[cut:] - want[1][cut:]).abs().max() < 2e-4
    assert (want[0][cut:] - want[1][cut:]).abs().max() > 1e-2   # the weights differ there
    restore_original(client, tiny_dir)
    check_against(client, reference)


def test_updates_outside_a_session_are_refused(engine, tiny_dir):
    """SGLang 0.5.23 requires begin/end_weight_update; the client reports its refusal."""
    _, client = engine
    model = hf_model(tiny_dir)
    name, tensor = next(iter(model.state_dict().items()))
    refusal = "update_weights_from_tensor.*must run between begin_weight_update"
    with pytest.raises(EngineError, match=refusal):
        client.update_weights_from_tensor([pickle_for_receiver(engine_payload([(name, tensor)]))])
    update_in_session(client, [(name, tensor)])  # inside a session the same call is accepted


def test_only_requests_with_the_key_are_served(engine, tiny_dir):
    """Without the run's key (or with another) the engine refuses generation and weight updates
    (HTTP 401), answers health probes, and does what it refused once the key comes; the key is
    in neither the server's command line (readable by every user of the node) nor its log
    (where SGLang writes its whole server_args)."""
    server, client = engine
    name, tensor = next(iter(hf_model(tiny_dir).state_dict().items()))
    for key in (None, "not-" + ENGINE_KEY):
        with EngineClient(server.url, timeout=120, retries=0, api_key=key) as outsider:
            assert outsider.health()
            for call in (lambda: outsider.generate(PROMPTS[0], GREEDY),
                         lambda: outsider.begin_weight_update(),
                         lambda: outsider.update_weights_from_tensor(
                             [pickle_for_receiver(engine_payload([(name, tensor)]))])):
                with pytest.raises(EngineError, match="refused: HTTP 401, the engine's key"):
                    call()
    assert client.generate(PROMPTS[0], GREEDY).output_ids
    update_in_session(client, [(name, tensor)])
    assert ENGINE_KEY not in open(f"/proc/{server.pid}/cmdline").read()
    assert ENGINE_KEY not in " ".join(server.command)
    log = server.log_file.read_text()
    assert "api_key" in log and ENGINE_KEY not in log   # logged, and blanked


def test_flush_pause_continue_and_memory(engine, reference):
    _, client = engine
    client.flush_cache()
    client.pause_generation(mode="retract")
    held = client.submit(client.aio.generate(PROMPTS[0], GREEDY))
    time.sleep(1.0)
    assert not held.done()  # a paused engine holds new requests ...
    client.continue_generation()
    assert held.result(timeout=60).output_ids == reference[0][0]  # ... and serves them after
    client.release_memory_occupation()
    client.resume_memory_occupation()
    check_against(client, reference)


def test_cpu_standins_raise_clear_errors():
    """The stand-ins import, report themselves, and refuse to be used."""
    code = (
        "import sgl_kernel, torchvision\n"
        "from torchvision.transforms import InterpolationMode\n"
        "from torchvision.io import ImageReadMode, decode_image\n"
        "assert InterpolationMode.BICUBIC.value == 'bicubic'\n"
        "assert 'standin' in torchvision.__version__\n"
        "try:\n    sgl_kernel.copy_all_layer_kv_cache_cpu()\n"
        "except RuntimeError as e:\n    print('CALL', e)\n"
        "try:\n    from sgl_kernel import flash_attn_varlen_func\n"
        "except ImportError as e:\n    print('IMPORT', e)\n")
    env = {**os.environ, "PYTHONPATH": str(STANDIN_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "CALL sgl_kernel.copy_all_layer_kv_cache_cpu was called, but it is a CPU" in out.stdout
    assert "IMPORT cannot import name 'flash_attn_varlen_func'" in out.stdout


def test_buckets_by_hand():
    sizes = [100, 200, 50, 1000, 10]  # bytes; a 256-byte bucket: 1000 must travel alone
    named = [(f"w{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    got = [[name for name, _ in b] for b in iter_buckets(named, 256)]
    assert got == [["w0"], ["w1", "w2"], ["w3"], ["w4"]]
    with pytest.raises(TypeError, match="weight 'x' is a list"):
        list(iter_buckets([("x", [1.0])], 256))


def test_flattened_bucket_roundtrips_through_sglangs_receiver():
    """Mixed dtypes with odd sizes: SGLang's own receive-side bucket rebuilds every tensor."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    gen = torch.Generator().manual_seed(0)
    bucket = [("a", torch.randn(3, generator=gen).to(torch.bfloat16)),
              ("b", torch.randn(5, 7, generator=gen)),
              ("c", torch.randint(0, 100, (9,), generator=gen).to(torch.int8)),
              ("d", torch.randn(2, 3, generator=gen).double())]
    names, dtypes, shapes, flat = flatten_bucket(bucket)
    received = FlattenedTensorBucket.empty(names, [dtype_name(d) for d in dtypes], shapes, "cpu")
    received.get_flattened_tensor().copy_(flat)
    rebuilt = dict(received.reconstruct_tensors())
    for name, tensor in bucket:
        assert rebuilt[name].dtype == tensor.dtype and torch.equal(rebuilt[name], tensor)


def test_startup_failures_carry_the_log_tail_and_leave_nothing_behind(tmp_path, tiny_dir):
    from ragen_mega.backends.sglang.server import EngineStartupError, group_alive

    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no_such_arch"}')
    with pytest.raises(EngineStartupError, match="exited with code") as err:
        launch_server(bad, log_file=tmp_path / "bad.log", startup_timeout=300)
    assert "no_such_arch" in str(err.value)  # SGLang's own complaint, from the log tail
    assert str(tmp_path / "bad.log") in str(err.value)

    with pytest.raises(EngineStartupError, match="was not healthy after 1 s") as err:
        launch_server(tiny_dir, startup_timeout=1)  # still importing SGLang after 1 s
    pid = int(str(err.value).split("(pid ")[1].split(")")[0])
    assert not group_alive(pid)  # the whole process group was stopped
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        launch_server(tmp_path)


def test_standins_never_shadow_an_installed_package(monkeypatch):
    import importlib.util

    from ragen_mega.backends.sglang import cpu_standins

    real_find_spec = importlib.util.find_spec
    installed = {"torchvision"}  # pretend only sgl_kernel is missing
    monkeypatch.setattr(cpu_standins.importlib.util, "find_spec",
                        lambda name: object() if name in installed else real_find_spec(name))
    path = cpu_standins.server_pythonpath()
    assert sorted(os.listdir(path)) == ["_cpu_standin.py", "sgl_kernel"]
    installed.add("sgl_kernel")
    assert cpu_standins.server_pythonpath() is None
