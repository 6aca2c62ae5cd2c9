"""Faults that must cost a retry, not the run, and must leave nothing behind; injected for real on
the tiny-model loop (real Ray, Megatron, SGLang):

* the SGLang server of the run's engine is SIGKILLed (by the pid the engine's log records) in the
  train phase of step 1: the step's weight sync restarts it and gives it the weights;
* ... and in the middle of a step-2 rollout: the engine comes back with the step-1 weights and
  the episodes that used it are replayed, giving exactly the samples the same rollout gave
  without the fault; past ``rollout.max_engine_restarts_per_step`` a dead engine is a clear
  error;
* ... and in step 2's weight sync, and its restarted server before it joins the new
  weight-update group: each time the sync fails, the engine is restarted and the sync made
  again into the new server.
* the ``ragen-mega train`` driver is SIGKILLed mid-run: every process it started (Ray, the
  trainer ranks, the engine worker, the SGLang server and its children) is gone soon after.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import server_killed_under_first_request, server_pids
from ragen_mega.config import load_run_config
from ragen_mega.rollout.manager import RolloutManager
from ragen_mega.train import train
from ragen_mega import checkpoints
import ragen_mega.train as train_module

REPO = Path(__file__).resolve().parents[1]
def _running(process) -> bool:
    """``process`` (a ``psutil.Process``) still runs: neither gone nor a zombie."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _outliving(processes, wait_s: float) -> list[str]:
    """``pid: name`` of those of ``processes`` still running after ``wait_s`` s; they are then
    killed (this test's own processes: never left to the next test)."""
    deadline = time.monotonic() + wait_s
    while (left := [p for p in processes if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    names = []
    for p in left:
        try:
            names.append(f"{p.pid}: {p.name()}")
            p.kill()
        except Exception:  # noqa: BLE001 - it ended meanwhile
            continue
    return names


def _alive(pid: int) -> bool:
    import psutil

    try:
        return _running(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def _kill(pid: int) -> None:
    """SIGKILL ``pid`` and wait (up to 30 s) until it is gone."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)


def _samples(episodes) -> list[tuple]:
    return [(s.episode_id, s.turn, s.prompt_ids, s.response_ids, s.reward, s.last)
            for e in episodes for s in e.samples]


def _logprobs(episodes) -> list[float]:
    return [lp for e in episodes for s in e.samples for lp in s.rollout_logprobs]


def test_dead_engine_is_restarted_resynced_and_its_episodes_replayed(
        tiny_run_overrides, tmp_path, private_ray, monkeypatch):
    """Step 1's server is SIGKILLed in the train phase, after the actor's update: the step's
    weight sync finds it dead, restarts it (counted at step 1) and gives the new server the
    trainer's weights (the post-sync check), instead of failing the sync's first request.

    Step 2's rollout is played three times in the run: once untouched (the reference), once
    with the server killed while the first request is in flight (restart 1: the replay must
    give the reference's samples, so the new server has the step-1 weights, not the checkpoint
    it loads), once with the server killed before it starts while the step's one allowed
    restart is spent (a clear error), then, with more restarts allowed, again (restart 2, same
    samples). The step then trains on the replayed episodes and syncs; that server is SIGKILLed
    after the sync's check for dead engines, so the sync itself fails on it: the failure must
    reach every trainer rank, and the run restart the engine (restart 3) and sync into the new
    server through a new weight-update group. That server dies before it joins the group: the
    sync fails again, the engine restarts again (4) and the sync reaches it (the post-sync
    check)."""
    import numpy as np

    real_rollout = RolloutManager.episodes
    seen = {}

    def faulted_rollout(rollouts, step, *, evaluate=False, faults=None):
        if step != 2 or evaluate:
            return real_rollout(rollouts, step, evaluate=evaluate, faults=faults)
        reference, _ = real_rollout(rollouts, step)
        seen["reference"] = reference
        first_pid = seen["killed"] = server_pids(tmp_path)[-1]
        with server_killed_under_first_request(rollouts.engines, first_pid):
            seen["replayed"], seconds = real_rollout(rollouts, step)
        assert not _alive(first_pid)

        os.kill(server_pids(tmp_path)[-1], signal.SIGKILL)
        supervisor = rollouts.engines.supervisor
        supervisor.max_restarts_per_step = 1  # and this step has had one
        with pytest.raises(RuntimeError, match=r"engine 0's SGLang server died \(log .*engine_0"
                                               r"\.log\) .*\(rollout\.max_engine_restarts_per_"
                                               r"step=1\)"):
            real_rollout(rollouts, step)
        supervisor.max_restarts_per_step = 4
        seen["after_error"], seconds = real_rollout(rollouts, step, faults=faults)
        supervisor.listeners.append(killed_in_the_sync)
        return seen["after_error"], seconds

    real_update = train_module.update_models

    def killed_after_update(cfg, run, step, played, metrics):
        out = real_update(cfg, run, step, played, metrics)
        if step == 1:
            seen["killed_in_train"] = pid = server_pids(tmp_path)[-1]
            _kill(pid)
        return out

    def killed_in_the_sync(recovery):
        """Step 2's sync: the server dies after the check for dead engines, so the sync's own
        requests meet it dead; then the first server restarted for the broken sync dies before
        it joins the new weight-update group: the sync fails again and is made again into yet
        another."""
        if recovery.reason == "check" and "killed_in_sync" not in seen:
            seen["killed_in_sync"] = pid = server_pids(tmp_path)[-1]
            _kill(pid)
        elif recovery.broken_sync and "killed_before_join" not in seen:
            seen["killed_before_join"] = pid = server_pids(tmp_path)[-1]
            _kill(pid)

    monkeypatch.setattr(RolloutManager, "episodes", faulted_rollout)
    monkeypatch.setattr(train_module, "update_models", killed_after_update)
    overrides = tiny_run_overrides(tmp_path, total_steps=2) + [
        "trainer.save_every=0", "rollout.max_engine_restarts_per_step=4"]
    history = train(load_run_config("examples/bandit_cpu_demo.yaml", overrides))

    assert [h["step"] for h in history] == [1, 2]
    assert history[0]["fault/engine_restarts"] == 1 and history[0]["fault/episodes_retried"] == 0
    assert history[0]["sync/max_logprob_diff"] < 1e-3  # the new server has step 1's weights
    # two in the rollout, two in the sync: its failed sync restarted the engine, whose server
    # died before it joined; the sync failed again, restarted it again and went through
    assert history[1]["fault/engine_restarts"] == 4
    # the first kill: at least the request in flight, at most all 4 episodes; the second: all 4
    assert 4 + 1 <= history[1]["fault/episodes_retried"] <= 4 + 4
    reference = seen["reference"]
    assert len(reference) == 4 and len(_samples(reference)) == 4
    for replayed in (seen["replayed"], seen["after_error"]):
        assert _samples(replayed) == _samples(reference)  # none lost, none twice, same tokens
        np.testing.assert_allclose(_logprobs(replayed), _logprobs(reference), atol=1e-5)
    assert history[1]["train/batch_samples"] == 4
    # the step's sync, made a third time, reaches the sixth server: it serves the new weights
    assert history[1]["sync/max_logprob_diff"] < 1e-3
    pids = server_pids(tmp_path)
    assert len(pids) == 6 and len(set(pids)) == 6
    assert (pids[0], pids[1], pids[3], pids[4]) == (
        seen["killed_in_train"], seen["killed"], seen["killed_in_sync"], seen["killed_before_join"])
    # each restart is described in the run's fault log, naming the dead engine and its log
    described = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    restarts = [d for d in described if d["fault"] == "engine_restarted"]
    assert len(restarts) == 5 and all(d["dead"] == [0] == d["restarted"] for d in restarts)
    assert restarts[-1]["logs"][0].endswith("logs/engine_0.log")


STARTER = """
import functools, multiprocessing, os, subprocess, time
from ragen_mega.backends.megatron.checkpoint import writers_die_with_this_process
from ragen_mega.backends.parent_death import die_with_parent
if __name__ == "__main__":
    writers_die_with_this_process()
    writer = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
    writer.start()
    server = subprocess.Popen(["sleep", "600"], start_new_session=True,  # as launch_server does
                              preexec_fn=functools.partial(die_with_parent, os.getpid()))
    print(writer.pid, server.pid, flush=True)
    time.sleep(600)
"""


def test_helpers_die_with_the_process_that_started_them(tmp_path):
    """What a trainer rank or engine worker starts (a forked torch_dist writer, a server in its
    own session) is gone soon after the starter is SIGKILLed, though the server is not in the
    starter's process group."""
    import psutil

    (tmp_path / "starter.py").write_text(STARTER)
    starter = subprocess.Popen([sys.executable, str(tmp_path / "starter.py")], cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)},
                               stdout=subprocess.PIPE, text=True)
    try:
        helpers = [psutil.Process(int(p)) for p in starter.stdout.readline().split()]
        assert len(helpers) == 2 and all(_running(h) for h in helpers)
    finally:
        starter.kill()
        starter.wait()
    left = _outliving(helpers, wait_s=10)
    assert not left, left


def _descendants(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


def test_killed_driver_leaves_no_process_behind(tiny_run_overrides, tmp_path):
    """``ragen-mega train`` starts its own Ray; SIGKILL it once step 1 is saved (step 2 under
    way). Every process it had started (Ray's, its agents included, the trainer ranks, the
    engine worker, the SGLang server and its scheduler) ends within a minute. Ray's dashboard and runtime-env agents would hang for minutes on their own; the run's
    reaper (``ragen_mega/ray/reaper.py``) ends them."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    overrides = tiny_run_overrides(tmp_path, total_steps=20)  # a checkpoint every step
    started = []
    with open(tmp_path / "driver.out", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ragen_mega.cli", "train",
                                 "examples/bandit_cpu_demo.yaml", *overrides], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while checkpoints.latest_complete_step(tmp_path) is None:
            assert proc.poll() is None, (tmp_path / "driver.out").read_text()[-4000:]
            assert time.monotonic() < deadline, "no step saved after 600 s"
            time.sleep(0.5)
        started = _descendants(proc.pid)
        [server] = server_pids(tmp_path)
        assert server in {p.pid for p in started}
        titles = " ".join(" ".join(p.cmdline()) for p in started if _running(p))
        for part in ("raylet", "gcs_server", "ray::TrainerWorker", "ray::EngineWorker",
                     "sglang.launch_server",
                     "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ragen_mega.ray.reaper"):
            assert part in titles, f"no {part} among the driver's processes: {titles[:2000]}"
    finally:
        proc.kill()
        proc.wait()
        left = _outliving(started, wait_s=60)
    assert not left, left
