"""Placement plans, and real Ray placement across several raylets on one machine."""
from __future__ import annotations

import os
import tempfile

import pytest

from ragen_mega.ray.placement import create_placement_group, plan_placement


def test_disaggregated_and_colocated_plans():
    plan = plan_placement(num_trainer_ranks=4, num_engines=2, engine_tp=2, num_env_workers=1,
                          use_gpu=True)
    assert plan.trainer_bundles == [0, 1, 2, 3]
    assert plan.engine_bundles == [[4, 5], [6, 7]]
    assert plan.env_worker_bundles == [8]
    assert all(b == {"CPU": 1.0, "GPU": 1.0} for b in plan.bundles[:8])
    assert plan.bundles[8] == {"CPU": 0.1}
    colo = plan_placement(num_trainer_ranks=4, num_engines=2, engine_tp=2, colocate=True,
                          cpus_per_bundle=0.5)
    assert colo.engine_bundles == [[0, 1], [2, 3]] and len(colo.bundles) == 4
    assert colo.bundles[0] == {"CPU": 0.5}
    with pytest.raises(ValueError, match="colocate: 3 engines x engine_tp 2 need 6 devices"):
        plan_placement(num_trainer_ranks=4, num_engines=3, engine_tp=2, colocate=True)
    with pytest.raises(ValueError, match="num_trainer_ranks must be >= 1"):
        plan_placement(num_trainer_ranks=0, num_engines=1)


class _Where:
    """A stand-in trainer rank that reports where Ray put it."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def where(self, tag):
        import ray

        return (self.rank, self.world, ray.get_runtime_context().get_node_id(), tag,
                os.environ.get("RAGEN_TEST_VAR"))

    def fail(self):
        if self.rank == 1:
            raise ValueError("boom on purpose")
        return self.rank


def test_placement_on_a_multi_node_cluster(monkeypatch):
    """Two raylets ("nodes"): SPREAD puts the two trainer ranks on different nodes, PACK on one."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import remove_placement_group

    from ragen_mega.ray.actor_group import ActorGroup

    # A private, short temp root: Ray's socket paths are length-capped, and /tmp/ray is shared.
    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="rm_ray_"))
    here = os.path.dirname(os.path.abspath(__file__))  # Ray workers import _Where from here
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 100 << 20})
    cluster.add_node(num_cpus=1, object_store_memory=100 << 20)
    try:
        ray.init(address=cluster.address)
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2
        plan = plan_placement(num_trainer_ranks=2, num_engines=1, cpus_per_bundle=0.5)
        spread = create_placement_group(plan, strategy="SPREAD")
        group = ActorGroup(_Where, spread, plan.trainer_bundles, num_cpus=0.5,
                           env_vars={"RAGEN_TEST_VAR": "set"})
        got = group.call("where", "x", timeout_s=60)
        assert [g[:2] for g in got] == [(0, 2), (1, 2)]
        assert {g[3] for g in got} == {"x"} and {g[4] for g in got} == {"set"}
        assert len({g[2] for g in got}) == 2, "SPREAD must place the ranks on both nodes"
        with pytest.raises(RuntimeError, match="(?s)fail failed on rank 1: .*boom on purpose"):
            group.call("fail", timeout_s=60)
        group.kill()
        remove_placement_group(spread)

        packed = create_placement_group(plan_placement(num_trainer_ranks=2, num_engines=1,
                                                       engine_tp=1, cpus_per_bundle=0.3),
                                        strategy="STRICT_PACK")
        group = ActorGroup(_Where, packed, [0, 1], num_cpus=0.3)
        assert len({g[2] for g in group.call("where", "y", timeout_s=60)}) == 1
        group.kill()
        remove_placement_group(packed)

        too_big = plan_placement(num_trainer_ranks=3, num_engines=1, cpus_per_bundle=1.0)
        with pytest.raises(RuntimeError, match="placement group of 4 bundles .* not ready"):
            create_placement_group(too_big, timeout_s=3)
    finally:
        ray.shutdown()
        cluster.shutdown()
