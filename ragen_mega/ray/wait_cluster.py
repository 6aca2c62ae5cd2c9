"""Wait until a Ray cluster has its nodes and GPUs: the launch scripts' readiness check.

``python -m ragen_mega.ray.wait_cluster --address HEAD_IP:PORT --nodes N [--gpus-per-node G]
[--timeout-s S]`` returns 0 once N nodes are alive with at least G GPUs each, or 1 with what
the cluster had when the time ran out. A fixed sleep is either too short (the driver meets a
half-formed cluster and its placement group waits, then fails, on resources that are still
coming) or wasted time; a node that never joins should be a clear error naming it.
"""
from __future__ import annotations

import argparse
import sys
import time


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


def wait_for_cluster(address: str, want_nodes: int, gpus_per_node: float, timeout_s: float,
                     poll_s: float = 2.0) -> str:
    """Poll until ready; returns the description of the nodes, or raises TimeoutError."""
    import ray

    deadline = time.monotonic() + timeout_s
    seen = f"the head at {address} did not answer"
    try:
        while True:
            if not ray.is_initialized():
                try:
                    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
                except ConnectionError as err:
                    seen = f"the head at {address} did not answer ({err})"
            if ray.is_initialized():
                nodes = ray.nodes()
                seen = describe(nodes)
                if ready(nodes, want_nodes, gpus_per_node):
                    return seen
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
    args = parser.parse_args(argv)
    try:
        seen = wait_for_cluster(args.address, args.nodes, args.gpus_per_node, args.timeout_s)
    except TimeoutError as err:
        print(f"ragen_mega: {err}", file=sys.stderr)
        return 1
    print(f"ragen_mega: Ray cluster ready: {seen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
