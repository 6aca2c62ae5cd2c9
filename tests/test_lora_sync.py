"""LoRA's adapter-only weight sync into real SGLang engines (``backends/sglang/lora_merge.py``).

A Megatron trainer with adapters on every linear and the LM head takes two steps (B, then A,
moves), then syncs: the adapters alone into an engine started with the merge plugin, the merged
weights whole into a plain engine, as a full-weight run would. Both engines must then give the
same greedy tokens and log-probs, those of the trainer; a second round (after another step)
shows the plugin merges onto the base it kept, not onto the last merge; and an engine started
afresh with the plugin at TP 2 and given only the adapters serves the same, each of its ranks
keeping half the base the TP 1 engine keeps. The same rounds on a
mixture of experts (adapters on every expert's gate/up/down) into an engine with the plugin
alone: its log-probs are the trainer's after each sync.

SGLang's own serving by name (``actor.lora.sync: native``, ``lora_serving.py``): each request
runs on the version it names, one in flight through two newer versions included, against PEFT;
and a whole run's engine follows the trainer, a restarted one too.
"""
from __future__ import annotations

import re

import pytest
import torch

from conftest import engines_started_together, push_first_completion

from ragen_mega.backends.megatron.launch import run_workers

PROMPTS = [[1, 2, 3, 4, 5], [100, 2000, 30000, 77], list(range(500, 520))]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def _observe(trainer, clients) -> dict:
    engines = [[(o.output_ids, o.output_logprobs) for o in c.generate(PROMPTS, GREEDY)]
               for c in clients]
    seqs = [p + ids for p, (ids, _) in zip(PROMPTS, engines[0])]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    lp = trainer.compute_logprobs({"input_ids": ids, "attention_mask": mask,
                                   "loss_mask": torch.zeros(ids.shape)})
    return {"engines": engines, "batch": (ids, mask),
            "trainer": [lp[i, len(p):len(p) + 8].tolist() for i, p in enumerate(PROMPTS)]}


def _worker(rank, world, hf_dir, adapter_url, merged_url=None, fresh_url=None):
    """Two rounds of two steps, then the adapters into ``adapter_url``'s engine and, where
    given, the merged weights into ``merged_url``'s; last, the adapters into ``fresh_url``'s."""
    from ragen_mega.backends.megatron.config import ActorConfig, LoraConfig
    from ragen_mega.backends.megatron.export import DirectExport
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.backends.sglang.client import EngineClient
    from ragen_mega.backends.sglang.weight_sender import BucketedWeightSender, send_export

    trainer = MegatronTrainer(ActorConfig(lr=2e-2, micro_batch_size=3,
                                          lora=LoraConfig(rank=4, alpha=8.0,
                                                          target_modules=list(TARGETS))), hf_dir)
    urls = [u for u in (adapter_url, merged_url) if u]
    clients = [EngineClient(u, timeout=120) for u in urls]
    senders = {u: BucketedWeightSender([EngineClient(u, timeout=120)], mode="distributed",
                                       backend="gloo", bucket_bytes=1 << 20,
                                       group_name=f"sync_{i}")
               for i, u in enumerate(urls)}
    for s in senders.values():
        s.connect()
    report = {"start": _observe(trainer, clients)}
    last = report["start"]
    for version, sign in ((1, 1.0), (2, -1.0)):
        push_first_completion(trainer, last["batch"], PROMPTS, sign)
        last = _observe(trainer, clients)
        # two steps: B moves in the first, A too in the second
        push_first_completion(trainer, last["batch"], PROMPTS, sign)
        report[f"stale_{version}"] = _observe(trainer, clients)
        adapters = trainer.weight_export(dst=0, prefetch_bytes=1 << 20)
        report[f"adapter_stats_{version}"] = send_export(adapters, senders[adapter_url], version)
        if merged_url:
            full = DirectExport(trainer.model, dst=0, prefetch_bytes=1 << 20)
            report[f"merged_stats_{version}"] = send_export(full, senders[merged_url], version)
        report[f"v{version}"] = last = _observe(trainer, clients)
    if fresh_url:   # a restarted engine: base from disk
        with BucketedWeightSender([EngineClient(fresh_url, timeout=120)], mode="distributed",
                                  backend="gloo", bucket_bytes=1 << 20,
                                  group_name="sync_fresh") as sender:
            sender.connect()
            send_export(trainer.weight_export(dst=0, prefetch_bytes=1 << 20), sender, 3)
            report["fresh"] = _observe(trainer, [EngineClient(fresh_url, timeout=120),
                                                 clients[1]])
    for s in senders.values():
        s.close()
    for report_item in report.values():
        if isinstance(report_item, dict):
            report_item.pop("batch", None)
    return report


def _kept(log: str) -> list[tuple[int, int, float]]:
    """Each server rank's ``lora_merge`` line: adapted modules, parameters, MiB kept."""
    return [(int(m), int(p), float(mib)) for m, p, mib in re.findall(
        r"base weights of (\d+) adapted modules kept: (\d+) parameters, ([\d.]+) MiB", log)]


def _diff(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.slow
def test_adapter_only_sync_serves_the_merged_weights(tiny_model):
    hf_dir = tiny_model("qwen2", tied=False)
    with engines_started_together(hf_dir, {"lora_targets": TARGETS}, {},
                                  {"lora_targets": TARGETS, "tp": 2}, dtype="float32",
                                  cpu_threads=1) as (adapter_engine, merged_engine, fresh_engine):
        [report] = run_workers(_worker, 1, str(hf_dir), adapter_engine.url, merged_engine.url,
                               fresh_engine.url, timeout=900)
        [whole] = _kept(adapter_engine.log_file.read_text())
        shards = _kept(fresh_engine.log_file.read_text())
    # 2 layers x 7 modules + the head, in 2 x (qkv, o, gate_up, down) + the head's parameters;
    # at TP 2 each rank keeps its own half (2 KV heads, 49 152 = 2 x 24 576 head rows)
    assert whole[:2] == (15, 9)
    assert len(shards) == 2 and all(s[:2] == (15, 9) for s in shards), shards
    assert all(abs(s[2] - whole[2] / 2) < 1e-3 for s in shards), (whole, shards)
    for version in (1, 2):
        stale, synced = report[f"stale_{version}"], report[f"v{version}"]
        (stale_ids, stale_lp), _ = [list(zip(*e)) for e in stale["engines"]]
        assert _diff(stale_lp, stale["trainer"]) > 1e-2   # trained away from what they serve
        (a_ids, a_lp), (m_ids, m_lp) = [list(zip(*e)) for e in synced["engines"]]
        assert a_ids == m_ids
        assert _diff(a_lp, m_lp) < 1e-5, _diff(a_lp, m_lp)
        assert _diff(a_lp, synced["trainer"]) < 1e-4
        sent, full = report[f"adapter_stats_{version}"], report[f"merged_stats_{version}"]
        assert sent.num_bytes * 20 < full.num_bytes, (sent.num_bytes, full.num_bytes)
    (f_ids, f_lp), (m_ids, m_lp) = [list(zip(*e)) for e in report["fresh"]["engines"]]
    assert f_ids == m_ids and _diff(f_lp, m_lp) < 1e-5


@pytest.mark.slow
def test_adapter_only_sync_into_a_mixture_of_experts_serves_the_trainers_weights(tiny_model):
    hf_dir = tiny_model("qwen3_moe")
    with engines_started_together(hf_dir, {"lora_targets": TARGETS}, dtype="float32",
                                  cpu_threads=1) as (engine,):
        [report] = run_workers(_worker, 1, str(hf_dir), engine.url, timeout=900)
        log = engine.log_file.read_text()
    # 2 layers x (q, k, v, o and 4 experts x gate, up, down) + the LM head
    [(modules, params, _)] = _kept(log)   # experts go into their layer's w13 and w2
    assert (modules, params) == (33, 9)
    for version in (1, 2):
        stale, synced = report[f"stale_{version}"], report[f"v{version}"]
        (_, stale_lp), (_, lp) = [list(zip(*r["engines"][0])) for r in (stale, synced)]
        assert _diff(stale_lp, stale["trainer"]) > 1e-2   # trained away from what it serves
        assert _diff(lp, synced["trainer"]) < 1e-4, _diff(lp, synced["trainer"])
        assert report[f"adapter_stats_{version}"].num_bytes > 0


@pytest.mark.slow
def test_engines_serving_the_adapters_by_name_follow_the_trainer_and_its_restart(
        tiny_run_overrides, tmp_path, private_ray, monkeypatch):
    """``actor.lora.sync: native``, the whole loop (GRPO, actor at TP 2, one engine serving
    the adapters with SGLang's own LoRA kernels, ``torch_native`` on CPU): after each step's
    sync the engine's log-probs under the newest adapter version are the trainer's; its server
    is SIGKILLed after step 2's update, and the restarted one, which starts from the base
    weights, is given that version by the sync; each engine keeps the newest two versions on
    disk and unloads the one before."""
    import json
    import os
    import signal

    from conftest import server_pids
    from ragen_mega.config import load_run_config
    from ragen_mega.train import train
    import ragen_mega.train as train_module

    real_update = train_module.update_models

    def killed_after_update(cfg, run, step, played, metrics):
        out = real_update(cfg, run, step, played, metrics)
        if step == 2:
            os.kill(server_pids(tmp_path)[-1], signal.SIGKILL)
        return out

    monkeypatch.setattr(train_module, "update_models", killed_after_update)
    overrides = tiny_run_overrides(tmp_path, total_steps=3) + [
        "trainer.save_every=0", "rollout.max_engine_restarts_per_step=1", "actor.lr=2e-2",
        "critic.enable=false", "algo.adv_estimator=grpo",
        "actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.sync=native"]
    history = train(load_run_config("examples/bandit_cpu_demo.yaml", overrides))
    assert [h["step"] for h in history] == [1, 2, 3]
    assert [h["fault/engine_restarts"] for h in history] == [0, 1, 0]
    for h in history:
        assert h["sync/max_logprob_diff"] < 1e-3, h
    log = (tmp_path / "logs" / "engine_0.log").read_text()
    assert len(server_pids(tmp_path)) == 2
    assert sorted(p.name for p in (tmp_path / "lora_adapters").iterdir()) == [
        "ragen_mega_v2", "ragen_mega_v3"]
    config = json.loads((tmp_path / "lora_adapters" / "ragen_mega_v3" /
                         "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert "ragen_mega_v1" in log and "ragen_mega_v3" in log


@pytest.mark.slow
def test_each_request_runs_on_the_adapter_version_it_names(tiny_model, tmp_path):
    """Versions published into an engine that serves adapters by name
    (``lora_serving.ServedAdapters``): a long greedy request names v1 and is decoding while v2
    and v3 are published, v3's publish unloading v1 (SGLang answers that once the request has
    finished); then a request names v2. Each one's tokens and log-probs are PEFT's on
    transformers with that version's adapters, and v1 is no longer served."""
    import time

    from peft import get_peft_model_state_dict

    from ragen_mega.backends.megatron.lora import LoraSettings
    from ragen_mega.backends.sglang.client import EngineClient, EngineError
    from ragen_mega.backends.sglang.lora_serving import ServedAdapters, adapter_name
    from test_lora import _peft_model

    hf_dir = str(tiny_model("qwen2", tied=False))
    targets = TARGETS[:7]
    models = {}
    for version in (1, 2, 3):
        torch.manual_seed(version)
        models[version] = _peft_model(hf_dir, targets=targets)
    settings = LoraSettings(4, 8.0, 0.0, targets)

    def tensors(version):
        state = get_peft_model_state_dict(models[version])
        return {k[len("base_model.model."):]: v for k, v in state.items()}

    def peft_logprobs(version, prompt, completion):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logp = torch.log_softmax(models[version](input_ids=ids).logits[0, :-1].double(), -1)
        return logp.gather(-1, ids[0, 1:, None])[len(prompt) - 1:, 0].tolist()

    def peft_greedy(version, prompt, n):
        with torch.no_grad():
            out = models[version].generate(torch.tensor([prompt]), max_new_tokens=n,
                                           do_sample=False)
        return out[0, len(prompt):].tolist()

    long = {"temperature": 0.0, "max_new_tokens": 1500, "ignore_eos": True}
    with engines_started_together(hf_dir, {"lora_serving": (4, targets)}, dtype="float32",
                                  cpu_threads=1) as (engine,):
        client = EngineClient(engine.url, timeout=600)
        served = ServedAdapters([EngineClient(engine.url)], tmp_path, hf_dir)
        served.publish(tensors(1), settings, 1)
        in_flight = client.submit(client.aio.generate(PROMPTS[2], long,
                                                      lora_path=adapter_name(1)))
        time.sleep(1.0)   # decoding by now (on a fast machine it may be done: still correct)
        served.publish(tensors(2), settings, 2)
        served.publish(tensors(3), settings, 3)   # unloads v1
        assert in_flight.done()
        first = in_flight.result()
        second = client.generate(PROMPTS, GREEDY, lora_path=adapter_name(2))
        with pytest.raises(EngineError, match="ragen_mega_v1"):
            client.generate(PROMPTS[0], GREEDY, lora_path=adapter_name(1))
        client.close()
        served.close()
    assert served.loaded == [[adapter_name(2), adapter_name(3)]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [adapter_name(2), adapter_name(3)]
    assert len(first.output_ids) == 1500
    assert _diff([first.output_logprobs],
                 [peft_logprobs(1, PROMPTS[2], first.output_ids)]) < 1e-4
    for prompt, out in zip(PROMPTS, second):
        assert out.output_ids == peft_greedy(2, prompt, 8)
        assert _diff([out.output_logprobs], [peft_logprobs(2, prompt, out.output_ids)]) < 1e-4
