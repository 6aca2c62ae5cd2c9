"""Resume equivalence: a run killed after step k and resumed with
``trainer.resume=auto`` reproduces the uninterrupted run's step k+1 metrics. The straight run
is also the suite's check of a whole synchronous run (:func:`check_whole_run`).

What makes it possible: a step's env seeds are a function of the step (the data cursor), and with
``rollout.seeded`` every request carries a sampling seed derived from (run seed, step, episode,
turn) that the SGLang engine samples with as a pure function of seed and logits (the CPU server
gets this through ``seeded_sampling_plugin``). Weights, optimizer and LR schedule come back from
the checkpoint; the trainer draws no random numbers (no dropout).
"""
from __future__ import annotations

import asyncio
import json
import math
import shutil
import struct

import requests
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ragen_mega.backends.sglang.client import AsyncEngineClient, ContextLengthExceeded
from ragen_mega.backends.sglang.request_batcher import RequestBatcher
from ragen_mega.backends.sglang.seeded_sampling import murmur_hash32_torch
from ragen_mega.backends.sglang.server import launch_server
from conftest import (resumed_step_diffs, start_env_server, stop_env_server,
                      undocumented_scalars)
from ragen_mega.config import load_run_config
from ragen_mega.train import train
from ragen_mega.trajectories import read_records, step_file
from ragen_mega import checkpoints
from ragen_mega.trackers import IDS_FILE
from tracker_readers import mlflow_client, mlflow_history, wandb_runs

DEMO = "examples/bandit_cpu_demo.yaml"


def murmur3_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32 written from the reference algorithm (any length, with tail)."""
    c1, c2, m = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF

    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & m

    h, n = seed, len(data) // 4
    for (k,) in struct.iter_unpack("<I", data[:4 * n]):
        h = (rotl(h ^ (rotl((k * c1) & m, 15) * c2) & m, 13) * 5 + 0xE6546B64) & m
    if data[4 * n:]:
        h ^= (rotl((int.from_bytes(data[4 * n:], "little") * c1) & m, 15) * c2) & m
    h ^= len(data)
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & m
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_cpu_sampling_hash_is_murmur3():
    """The pure-torch stand-in for sgl_kernel's CPU hash is MurmurHash3 of (seed, position,
    column), like SGLang's GPU kernel, so seeded samples are the same function everywhere."""
    # the reference reproduces published MurmurHash3_x86_32 values
    assert murmur3_32(b"", 1) == 0x514E28B7
    assert murmur3_32(b"foo") == (-156908512) % 2**32
    assert murmur3_32(b"hello") == 613153351
    seeds = torch.tensor([0, 1, 2**40 + 7, -5, 2**63 - 1])
    positions = torch.tensor([0, 3, 100, 7, 2**31 - 1])
    cols = torch.tensor([0, 1, 49151, 12345])
    expected = [[murmur3_32((int(s) % 2**64).to_bytes(8, "little") + struct.pack("<II", p, c))
                 for c in cols.tolist()] for s, p in zip(seeds.tolist(), positions.tolist())]
    assert murmur_hash32_torch(seeds, positions, cols).tolist() == expected


def test_seeded_engine_sample_ignores_batch_composition(tiny_model):
    """A seeded request gives the same tokens alone, inside a concurrent batch (other order,
    unseeded neighbours) and inside one batched /generate (``rollout.batch_requests``: the
    requests of one event-loop pass as one HTTP request, each with its own seed); another seed
    gives other tokens; unseeded requests stay random. In a batch with a prompt longer than the
    engine's context, only that prompt fails."""
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 200, 300, 400], [42] * 6]

    def params(seed=None, n=24):
        p = {"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True}
        return p if seed is None else {**p, "sampling_seed": seed}

    async def check(url):
        async with AsyncEngineClient(url) as c:
            alone = [(await c.generate(p, params(10 + i))).output_ids
                     for i, p in enumerate(prompts)]
            batch = await asyncio.gather(
                *(c.generate(p, params(10 + i)) for i, p in reversed(list(enumerate(prompts)))),
                *(c.generate(prompts[0], params(n=40)) for _ in range(4)))
            together = [o.output_ids for o in batch[:len(prompts)]][::-1]
            unseeded = {tuple(o.output_ids) for o in batch[len(prompts):]}
            reseeded = (await c.generate(prompts[0], params(11))).output_ids

            sent = []

            async def send(key, batch, samplings):
                sent.append((key, len(batch)))
                return await c.generate(batch, samplings)

            batcher = RequestBatcher(send)
            batched = await asyncio.gather(*(batcher.generate("e", p, params(10 + i))
                                             for i, p in enumerate(prompts)))
            assert sent == [("e", len(prompts))]
            assert [o.output_ids for o in batched] == alone
            too_long = [7] * (context + 1)
            outcome = await asyncio.gather(batcher.generate("e", too_long, params(1)),
                                           batcher.generate("e", prompts[2], params(12)),
                                           return_exceptions=True)
            assert isinstance(outcome[0], ContextLengthExceeded), outcome[0]
            assert outcome[1].output_ids == alone[2]
            assert sent[1:] == [("e", 2), ("e", 1), ("e", 1)]  # refused whole, then one by one
        assert together == alone
        assert reseeded != alone[0]
        assert len(unseeded) == 4

    model = tiny_model("qwen2")
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    with launch_server(model, dtype="float32", startup_timeout=600, cpu_threads=1,
                       seeded_sampling=True) as server:
        asyncio.run(check(server.url))


def checkpoint_weights(step_dir) -> dict[str, torch.Tensor]:
    """The model tensors of a trainer checkpoint (torch_dist: global names and shapes), read in
    this process without Megatron or a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = str(step_dir / "dist")
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
               if isinstance(m, TensorStorageMetadata) and not k.startswith("optimizer")}
    dcp.load(tensors, checkpoint_id=path, no_dist=True)
    return tensors


def test_resumed_step_replays_uninterrupted_run(tiny_run_overrides, tmp_path, private_ray,
                                                monkeypatch):
    """Run 3 steps straight (checkpoint every step); turn the run directory into what a run
    killed right after step 2's checkpoint leaves; a fresh ``train`` resumes and its step 3
    must equal the straight run's step 3.

    Both runs warm the critic up for 2 steps (``critic.warmup_steps=2``): steps 1-2 train the
    critic only, so the resumed run restores an actor whose optimizer never stepped and makes
    its first update in step 3, as the straight run does. The checkpoints show the warm-up: the
    actor's weights after steps 1 and 2 are bit-identical while the critic's moved, and the
    actor's move in step 3.

    The resumed run plays its episodes on an env server (``env.remote``, ``ragen-mega
    env-server bandit``) where the straight run built them in the driver: its step equal to the
    straight one is also a whole training step on remote envs equal to one on local envs (the
    bandit's observation shows its arms in a seed-dependent order, so a wrong seed would change
    the prompts).

    Tolerance: exact equality for everything but wall-clock times and the engine's own
    log-probs. The CPU engine's logits are not batch-invariant (SmolLM2, 16 requests alone vs
    batched: log-probs differ by up to 1.8e-5), so ``train/rollout_vs_trainer_logprob_diff``
    gets 1e-4; the sampled tokens are still the same (seeded Gumbel-max flips only on a near
    tie), and everything the trainer computes from them is deterministic here
    (``algo.use_rollout_logprobs=false``: the trainer recomputes the old log-probs).

    The straight run saves its rollouts (``trainer.save_rollouts``); a third run replays them
    (``trainer.replay_rollouts``, no engine started) and must make the same three updates to the
    same weights, exactly: same batches, same start, same trainer.

    The tiny random model never answers, so its rollout metrics are constants (reward = format
    penalty, 6 tokens); what checks that the resumed step sampled the same tokens are the
    actor's entropy, loss and grad norm over them (with ``rollout.seeded=false`` they differed,
    entropy by 1e-6, pg_loss and grad norms by 0.5-2%).

    Both runs also log to wandb (offline) and MLflow (``trainer.loggers``): the resumed start
    continues the straight run's wandb run and MLflow run, read back through their own files
    and API (tests/tracker_readers.py).
    """
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    overrides = tiny_run_overrides(tmp_path, 3) + ["critic.warmup_steps=2",
                                                   "trainer.save_rollouts=true",
                                                   "trainer.loggers=[tensorboard,wandb,mlflow]"]
    straight = train(load_run_config(DEMO, overrides))
    assert [h["step"] for h in straight] == [1, 2, 3]
    check_whole_run(straight, tmp_path)

    ckpt = tmp_path / "checkpoints"
    assert [h["train/actor_frozen"] for h in straight] == [1.0, 1.0, 0.0]
    assert [any(k.startswith("actor/") for k in h) for h in straight] == [False, False, True]
    assert all(h["critic/update_successful"] == 1.0 for h in straight)
    actor, critic = ({s: checkpoint_weights(ckpt / role / f"step_{s}") for s in (1, 2, 3)}
                     for role in ("actor", "critic"))
    for name, tensor in actor[1].items():
        assert torch.equal(tensor, actor[2][name]), name
    assert any(not torch.equal(t, actor[3][n]) for n, t in actor[2].items())
    assert any(not torch.equal(t, critic[2][n]) for n, t in critic[1].items())
    assert [torch.load(ckpt / "actor" / f"step_{s}" / "ragen_state.pt",
                       weights_only=False)["optimizer_steps"] for s in (1, 2, 3)] == [0, 0, 1]

    straight_step3 = read_records(step_file(tmp_path, 3))
    for role in ("actor", "critic"):
        shutil.rmtree(ckpt / role / "step_3")
    (ckpt / "latest_step").write_text("2")
    server, url = start_env_server("bandit")  # the resumed run plays on an env server
    try:
        resumed = train(load_run_config(DEMO, overrides + [f"env.remote=[{url}]"]))
        assert requests.get(f"{url}/health", timeout=10).json()["sessions"] == 0  # all closed
    finally:
        stop_env_server(server)
    assert [h["step"] for h in resumed] == [3]

    want, got = straight[2], resumed[0]
    assert set(got) == set(want)
    for key in ("rollout/reward_mean", "rollout/response_length", "actor/pg_loss",
                "actor/grad_norm", "actor/entropy", "critic/vf_loss", "critic/grad_norm"):
        assert key in want, key  # among the compared metrics
    diffs = resumed_step_diffs(want, got)
    assert not diffs, json.dumps(diffs, indent=1)
    # the equality is not that of a constant: step 3 is not step 2 over again
    assert got["critic/vf_loss"] != straight[1]["critic/vf_loss"]
    assert got["sync/max_logprob_diff"] < 1e-3
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 3]  # the resumed step 3 is appended; nothing else is rewritten
    check_trackers_continued(tmp_path, straight, got)
    # its trajectory file is written again, not beside the first: the same episodes, texts and
    # credit, turn by turn
    assert sorted(p.name for p in (tmp_path / "trajectories").iterdir()) == [
        "step_1.jsonl.gz", "step_1.rollout.pt", "step_2.jsonl.gz", "step_2.rollout.pt",
        "step_3.jsonl.gz", "step_3.rollout.pt"]
    assert read_records(step_file(tmp_path, 3)) == straight_step3

    # the same three steps replayed from the saved rollouts, with no engine: the same updates
    # (the same batch composition and start weights, so exactly), the same weights after them
    replay_dir = tmp_path / "replay"
    replayed = train(load_run_config(DEMO, overrides + [
        f"trainer.run_dir={replay_dir}", f"trainer.replay_rollouts={tmp_path}",
        "trainer.check_weight_sync=false", "trainer.save_rollouts=false"]))
    for want, got in zip(straight, replayed):
        assert {k for k in want if k.startswith(("actor/", "critic/"))} <= set(got)
        diffs = {k: (want[k], got[k]) for k in got if k in want and not k.startswith("time/")
                 and want[k] != got[k]}
        assert not diffs, json.dumps(diffs, indent=1)
    assert not any(k.startswith("sync/") for h in replayed for k in h)  # no engine to sync
    for role in ("actor", "critic"):
        final = checkpoint_weights(replay_dir / "checkpoints" / role / "step_3")
        for name, tensor in checkpoint_weights(ckpt / role / "step_3").items():
            assert torch.equal(final[name], tensor), (role, name)


def check_trackers_continued(run_dir, straight: list[dict], resumed_step: dict) -> None:
    """One MLflow run and one wandb run id hold the straight steps 1-3 and the resumed step 3
    (wandb offline: a second log file under the same id, joined by ``wandb sync``)."""
    ids = json.loads((run_dir / IDS_FILE).read_text())
    client = mlflow_client(run_dir)
    [run] = client.search_runs([client.get_experiment_by_name("ragen_mega").experiment_id])
    assert run.info.run_id == ids["mlflow"] and run.info.run_name == run_dir.name
    assert mlflow_history(client, ids["mlflow"], "critic/vf_loss") == [
        (h["step"], h["critic/vf_loss"]) for h in [*straight, resumed_step]]
    assert run.data.params["trainer.loggers"] == '["tensorboard", "wandb", "mlflow"]'
    first, resumed = wandb_runs(run_dir)
    assert first["id"] == resumed["id"] == ids["wandb"]
    assert {s: h["critic/vf_loss"] for s, h in first["history"].items()} == {
        h["step"]: h["critic/vf_loss"] for h in straight}
    assert resumed["history"] == {3: {k: v for k, v in resumed_step.items() if k != "step"}}
    assert first["config"]["actor"]["lr"] == 1e-3


def check_whole_run(history: list[dict], run_dir) -> None:
    """What every synchronous run of the loop must show: engines serving the trainer's weights
    after each sync, trainer and engine log-probs equal (fp32 both sides), verl's scalar names
    in TensorBoard and every scalar in docs/metrics.md's table, one checkpoint per step under one
    pointer."""
    for h in history:
        # the actor does not move in the critic's warm-up: no time/actor_update_s then
        phases = ("time/old_logprobs_s", "time/values_s", "time/critic_update_s") + (
            () if h["train/actor_frozen"] else ("time/actor_update_s",))
        assert h["sync/max_logprob_diff"] < 1e-3, h["sync/max_logprob_diff"]
        assert h["weight_version"] == h["step"]
        assert h["train/rollout_vs_trainer_logprob_diff"] < 1e-3
        # the step's time breakdown: each phase measured, together within the train phase
        assert all(h[k] > 0 for k in phases) and sum(h[k] for k in phases) <= h["time/train_s"]
        assert h["time/save_s"] > 0  # every step saves here
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("rollout/success", "rollout/reward_mean", "actor/pg_loss", "actor/grad_norm",
                "actor/entropy", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl",
                "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "filter/kept_groups",
                "filter/in_group_std", "time/rollout_s", "sync/seconds"):
        assert tag in tags, f"missing scalar {tag}"
    for tag in tags:
        assert all(math.isfinite(e.value) for e in acc.Scalars(tag)), tag
    assert not undocumented_scalars(tags, tags=("bandit",))
    assert checkpoints.latest_complete_step(run_dir) == len(history)
    for role in ("actor", "critic"):
        assert sorted(p.name for p in (run_dir / "checkpoints" / role).iterdir()) == [
            f"step_{h['step']}" for h in history]
