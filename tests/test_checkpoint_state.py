"""A checkpoint's extra state (``ragen_mega/checkpoints.py``) is plain data read with
``torch.load(weights_only=True)``: the pending async rollout, the RNG states and the env streams
round-trip exactly through a real ``torch.save``, and a state file of an older version that
pickled classes is refused naming the file, not taken for a corrupt one. No processes: the
trainers are stand-ins that keep each checkpoint's extra state as the bytes ``torch.save``
wrote (the whole loop through a saved pending rollout is tests/test_async_rollout.py)."""
from __future__ import annotations

import asyncio
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ragen_mega.agent import AgentConfig
from ragen_mega.backends.megatron import checkpoint as ckpt
from ragen_mega.config import load_run_config
from ragen_mega import checkpoints
from ragen_mega.rollout.types import Generation
from ragen_mega.rollout.seeding import EnvPart, group_specs
from ragen_mega.rollout.episode import run_episode
from ragen_mega.rollout.faults import FaultCounters
from ragen_mega.rollout.manager import PlayedStep
from ragen_mega.rollout.metrics import summarize
from ragen_mega.rollout.sample import Sample
from ragen_mega.rollout.streams import EnvStreams

REPO = Path(__file__).resolve().parents[1]
AGENT = AgentConfig(think=False, max_actions_per_turn=1, memory_turns=1)
MOVES = ["Left", "Down", "Right", "Up"]


def _policy(tokenizer):
    """A FrozenLake move from a hash of the prompt (episodes end at different turns)."""
    async def generate(prompt_ids, sampling):
        ids = tokenizer.encode(f" {MOVES[sum(prompt_ids) * 7 % 31 % 4]} </answer>",
                               add_special_tokens=False)
        return Generation(ids, [-0.1 * (i + 1) / 3 for i in range(len(ids))], "stop")
    return generate


def _played_step(tokenizer, run_dir: Path) -> PlayedStep:
    """Step 3's rollout as ``RolloutManager.rollout`` makes it: real FrozenLake episodes, their
    ``rollout/*`` metrics, counters with a fault recorded, samples stamped with a version."""
    specs = group_specs("frozen_lake", {"is_slippery": False}, env_groups=2, group_size=2,
                        first_seed=11, env_tag="lake")

    async def all_():
        return await asyncio.gather(*(run_episode(
            s, tokenizer=tokenizer, agent=AGENT, generate=_policy(tokenizer), sampling={},
            max_turns=4) for s in specs))
    episodes = asyncio.run(all_())
    samples = [s for e in episodes for s in e.samples]
    for s in samples:
        s.weight_version = 2
    # a hand-built one with the optional fields set and NumPy scalars where floats/ints go
    samples.append(Sample([5, 6, 7], [8, 9], [-0.1, -1e-30], np.float64(0.1), 99, 7, 2,
                          done=False, last=True, env_tag="x", seed=np.int64(12),
                          info={"finish_reason": "length", "format_ok": False,
                                "nested": {"a": [1, 2.5, None], "t": (1, "b")}},
                          weight_version=1, stream=3, cut=True))
    faults = FaultCounters(3, run_dir / "faults.jsonl")
    faults.record("episodes_dropped", env="lake", seed=11, reason="test")
    faults.record("prompts_too_long", 2)
    return PlayedStep(samples, summarize(episodes, "rollout"), 1.2345678901234567, faults)


class SerializingTrainer:
    """A stand-in trainer keeping each checkpoint's extra state as ``torch.save``'s bytes and
    loading them back with ``weights_only=True``, as ``read_checkpoint_state`` does."""

    def __init__(self):
        self.saved: dict[int, bytes] = {}

    def save_checkpoint(self, root, step, extra):
        (Path(root) / f"step_{step}").mkdir(parents=True)
        buf = io.BytesIO()
        torch.save({"extra": extra}, buf)
        self.saved[step] = buf.getvalue()

    def load_checkpoint(self, path):
        [data] = self.saved.values()
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)["extra"]


def test_pending_rollout_and_streams_round_trip_under_weights_only(tokenizer, tmp_path):
    cfg = load_run_config(REPO / "examples/bandit_cpu_demo.yaml", [
        f"trainer.run_dir={tmp_path}", "trainer.async_mode=one_step_off", "actor.tis_cap=2.0",
        "algo.use_rollout_logprobs=false", f"trainer.resume={tmp_path / 'checkpoints'}"])
    pending = _played_step(tokenizer, tmp_path)
    # a streamed run's state: every stream's episode index and its current episode's responses
    streams = EnvStreams([EnvPart("lake", "frozen_lake", {"is_slippery": False}, 2)],
                         group_size=2, seed=5, turns_per_step=3, tokenizer=tokenizer,
                         agent=AGENT, max_turns=4)
    asyncio.run(streams.play_window(lambda s: _policy(tokenizer), {}, weight_version=0))
    stream_state = streams.state_dict()
    assert any(stream_state["responses"])

    actor = SerializingTrainer()
    checkpoints.save(cfg, 2, actor, None, streams=stream_state, pending=pending)
    assert checkpoints.latest_complete_step(tmp_path) == 2
    step, got_streams, got = checkpoints.resume(cfg, actor, None)

    assert step == 2 and got_streams == stream_state
    assert isinstance(got, PlayedStep) and got.window is None
    assert len(got.samples) == len(pending.samples) > 4
    for want, have in zip(pending.samples, got.samples):
        assert have == want  # every field
        assert type(have.reward) is float and type(have.seed) is int
        assert all(type(t) is int for t in have.prompt_ids + have.response_ids)
    assert got.samples[-1].info["nested"]["t"] == (1, "b")
    assert got.metrics == pending.metrics and got.rollout_s == pending.rollout_s
    assert (got.faults.step, got.faults.counts) == (3, pending.faults.counts)
    assert got.faults.counts["prompts_too_long"] == 2
    # the resumed counters go on describing faults in the run's faults.jsonl
    assert got.faults.log_path == tmp_path / "faults.jsonl"
    got.faults.record("updates_skipped", role="actor", reason="resumed")
    lines = (tmp_path / "faults.jsonl").read_text().splitlines()
    assert [json.loads(l)["fault"] for l in lines] == ["episodes_dropped", "updates_skipped"]


def test_sample_info_is_not_pickled():
    s = Sample([1], [2], [-0.5], 0.0, 0, 0, 1, done=True, last=True, env_tag="x", seed=0,
               info={"finish_reason": "stop", "obj": object()})
    with pytest.raises(TypeError, match=r"Sample.info\['obj'\] is a builtins.object"):
        s.to_dict()


def test_pending_streamed_window_keeps_what_training_reads(tokenizer):
    """An overlapped streamed step (``rollout.mode=turns``) is saved pending with its window's
    cut prompts, which the critic values for the bootstrap; the samples keep stream and cut."""
    streams = EnvStreams([EnvPart("lake", "frozen_lake", {"is_slippery": False}, 2)],
                         group_size=2, seed=5, turns_per_step=3, tokenizer=tokenizer,
                         agent=AGENT, max_turns=6)
    window = asyncio.run(streams.play_window(lambda s: _policy(tokenizer), {}, weight_version=4))
    assert window.next_prompts and window.finished        # some episodes cut, some ended
    played = PlayedStep(window.samples, {"rollout/samples": 12.0}, 0.5, FaultCounters(5), window)
    buf = io.BytesIO()
    torch.save(played.state_dict(), buf)
    got = PlayedStep.from_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert got.samples == window.samples and got.window.samples is got.samples
    assert got.window.next_prompts == window.next_prompts
    assert [(s.stream, s.cut, s.weight_version) for s in got.samples] == [
        (s.stream, s.cut, 4) for s in window.samples]


def test_rng_states_round_trip_under_weights_only():
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    random.gauss(0, 1)     # Python's gauss keeps its second value
    np.random.randn()      # NumPy's legacy gaussian caches one too (has_gauss = 1)
    buf = io.BytesIO()
    torch.save({"rng": checkpoints.rng_states()}, buf)

    def draws():
        return (random.random(), random.gauss(0, 1), np.random.randn(), np.random.rand(3).tolist(),
                np.random.randint(0, 2**31, 4).tolist(), torch.rand(3).tolist(),
                torch.randint(0, 2**31, (4,)).tolist())
    want = draws()
    draws()  # move every generator on
    buf.seek(0)
    checkpoints.set_rng_states(torch.load(buf, weights_only=True)["rng"])
    assert draws() == want


class Legacy:
    """Stands for a class an older version pickled into the extra state."""


def _state_file(step_dir: Path, extra: dict) -> None:
    step_dir.mkdir(parents=True)
    torch.save({"format_version": 1, "step": 2, "optimizer_steps": 2, "has_optimizer": True,
                "scheduler": None, "signature": {}, "extra": extra}, step_dir / ckpt.STATE_FILE)


def test_state_file_with_pickled_classes_is_refused_clearly(tmp_path):
    # what an older version wrote: the pending rollout as a pickled class, NumPy's RNG tuple
    old = checkpoints.step_dir(tmp_path, "actor", 2)
    _state_file(old, {"step": 2, "rng": {"numpy": np.random.get_state()},
                      "pending_rollout": Legacy()})
    (checkpoints.checkpoint_root(tmp_path) / checkpoints.LATEST).write_text("2")
    path = old / ckpt.STATE_FILE
    message = (rf"{path} holds pickled Python objects \(.*test_checkpoint_state\.Legacy.*\).* "
               r"older ragen_mega that pickled classes")
    with pytest.raises(ckpt.LegacyCheckpoint, match=message):
        ckpt.read_checkpoint_state(old)
    with pytest.raises(ckpt.LegacyCheckpoint, match=message):
        ckpt.verify_checkpoint(old)
    # not a corrupt step: resume stops on it, nothing falls back or is moved aside
    with pytest.raises(ckpt.LegacyCheckpoint, match=message):
        checkpoints.newest_intact_step(tmp_path, with_critic=False)
    assert old.is_dir() and not old.with_name("corrupt-step_2").exists()
    assert checkpoints.latest_complete_step(tmp_path) == 2

    # a state file cut short is still a corrupt one
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(ckpt.CorruptCheckpoint, match=rf"{path} is unreadable"):
        ckpt.verify_checkpoint(old)

    # a plain one loads (its torch_dist files are not there: missing, not unreadable)
    new = checkpoints.step_dir(tmp_path, "actor", 3)
    _state_file(new, {"step": 3, "rng": checkpoints.rng_states(), "pending_rollout": None})
    assert ckpt.read_checkpoint_state(new)["extra"]["step"] == 3
    with pytest.raises(ckpt.CorruptCheckpoint, match=r"\.metadata is missing"):
        ckpt.verify_checkpoint(new)
