"""Wait until a Ray cluster has its nodes and GPUs: the launch scripts' readiness check.

``python -m ragen_mega.ray.wait_cluster --address HEAD_IP:PORT --nodes N [--gpus-per-node G]
[--timeout-s S] [--step-pids PID ...]`` returns 0 once N nodes are alive with at least G GPUs
each; 1 with what the cluster had when the time ran out, or as soon as one of the processes
starting Ray (``--step-pids``, the srun steps) has exited. A fixed sleep would be too short (the
placement group fails on a half-formed cluster) or wasted (docs/cluster.md).
"""
from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path


def describe(nodes: list[dict]) -> str:
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        return "no node alive"
    return ", ".join(f"{n['NodeManagerAddress']} ({n['Resources'].get('CPU', 0):g} CPU, "
                     f"{n['Resources'].get('GPU', 0):g} GPU)" for n in alive)


def ready(nodes: list[dict], want_nodes: int, gpus_per_node: float) -> bool:
    alive = [n for n in nodes if n.get("Alive")]
    return (len(alive) >= want_nodes
            and all(n["Resources"].get("GPU", 0) >= gpus_per_node for n in alive))


def answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether the head's GCS port accepts connections: ``ray.init`` before it does would not
    return (it retries inside for a long time), so the wait could not be bounded."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def exited(pid: int) -> bool:
    """Whether process ``pid`` (a child of the launch script) is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_for_cluster(address: str, want_nodes: int, gpus_per_node: float, timeout_s: float,
                     step_pids: tuple[int, ...] = (), poll_s: float = 2.0) -> str:
    """Poll until ready; returns the description of the nodes, or raises TimeoutError
    (RuntimeError when a Ray step died: waiting longer cannot help)."""
    import ray

    deadline = time.monotonic() + timeout_s
    seen = f"the head at {address} did not answer"
    try:
        while True:
            if not ray.is_initialized() and answers(address):
                ray.init(address=address, log_to_driver=False, logging_level="ERROR")
            if ray.is_initialized():
                nodes = ray.nodes()
                seen = describe(nodes)
                if ready(nodes, want_nodes, gpus_per_node):
                    return seen
            dead = [pid for pid in step_pids if exited(pid)]
            if dead:
                raise RuntimeError(f"the Ray start step(s) {dead} exited (their output is "
                                   f"above); the cluster at {address} has: {seen}")
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"Ray cluster at {address} not ready after {timeout_s:.0f}s: wanted "
                    f"{want_nodes} node(s) with {gpus_per_node:g} GPU(s) each, have: {seen}")
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragen_mega.ray.wait_cluster",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True, help="HEAD_IP:PORT of the Ray head")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=float, default=0.0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--step-pids", type=int, nargs="*", default=[],
                        help="PIDs of the processes starting Ray: fail at once if one exits")
    args = parser.parse_args(argv)
    try:
        seen = wait_for_cluster(args.address, args.nodes, args.gpus_per_node, args.timeout_s,
                                tuple(args.step_pids))
    except (TimeoutError, RuntimeError) as err:
        print(f"ragen_mega: {err}", file=sys.stderr)
        return 1
    print(f"ragen_mega: Ray cluster ready: {seen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
