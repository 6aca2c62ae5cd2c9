"""Placement plans, and real Ray placement across several raylets on one machine."""
from __future__ import annotations

import os
import tempfile

import pytest

from ragen_mega.backends.sglang.server import (build_command, build_env, cpu_threads_bind,
                                              launch_server)
from ragen_mega.ray.devices import bundle_gpu_ids
from ragen_mega.config import load_run_config
from ragen_mega.ray.placement import create_placement_group, plan_placement, plan_resources


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
    with pytest.raises(ValueError, match="num_trainer_ranks and num_engines must be >= 0"):
        plan_placement(num_trainer_ranks=-1, num_engines=1)
    with pytest.raises(ValueError, match="nothing to place"):
        plan_placement(num_trainer_ranks=0, num_engines=0)
    trainer_only = plan_placement(num_trainer_ranks=2, num_engines=0)
    assert trainer_only.trainer_bundles == [0, 1] and trainer_only.engine_bundles == []
    with pytest.raises(ValueError, match="colocate: 1 engines x engine_tp 1 need 1 devices"):
        plan_placement(num_trainer_ranks=0, num_engines=1, colocate=True)
    engines_only = plan_placement(num_trainer_ranks=0, num_engines=2, num_env_workers=1)
    assert engines_only.trainer_bundles == [] and engines_only.engine_bundles == [[0], [1]]
    assert engines_only.env_worker_bundles == [2]


def test_resource_plans_from_the_config_by_hand():
    """What each process reserves, worked out by hand for a 2-core machine and a GPU node."""
    # actor TP=2 + critic + one engine on 2 CPUs: 4 bundles of 2/4 CPU; the trainer ranks run
    # one phase at a time, so each may use 2 cores // 2 (the larger role's ranks) threads
    cfg = load_run_config(None, ["actor.tp=2"])
    res = plan_resources(cfg, cluster_cpus=2, host_cpus=2, use_gpu=False)
    assert (res.actor_world, res.critic_world) == (2, 1)
    assert res.placement.bundles == [{"CPU": 0.5}] * 4
    assert res.actor_bundles == [0, 1] and res.critic_bundles == [2]
    assert res.placement.engine_bundles == [[3]]
    assert (res.engine_cpus, res.trainer_cpus, res.trainer_gpus) == (0.5, 0.5, 0.0)
    assert res.trainer_threads == 1
    # 2 env workers count a quarter each: 2 / (3 + 2/4) = 0.5714..., rounded down to 1e-4
    cfg = load_run_config(None, ["rollout.env_workers=2"])
    res = plan_resources(cfg, cluster_cpus=2, host_cpus=2, use_gpu=False)
    assert res.placement.bundles == [{"CPU": 0.5714}] * 3 + [{"CPU": 0.1428}] * 2
    assert res.env_worker_cpus == 0.1428 and res.placement.env_worker_bundles == [3, 4]
    assert res.trainer_threads == 2
    # colocated, no critic, DP=2: the engine shares trainer bundle 0 and takes half its share
    cfg = load_run_config(None, ["trainer.colocate=true", "trainer.data_parallel=2",
                                 "critic.enable=false", "algo.adv_estimator=grpo"])
    res = plan_resources(cfg, cluster_cpus=2, host_cpus=2, use_gpu=False)
    assert res.critic_world == 0 and res.critic_bundles == []
    assert res.placement.bundles == [{"CPU": 1.0}] * 2 and res.placement.engine_bundles == [[0]]
    assert (res.engine_cpus, res.trainer_cpus) == (0.5, 0.5)
    # on GPU: a device and a core per bundle; colocated, half a device each; Ray's threads
    res = plan_resources(cfg, cluster_cpus=64, host_cpus=64, use_gpu=True)
    assert res.placement.bundles == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert (res.trainer_cpus, res.trainer_gpus, res.trainer_threads) == (0.5, 0.5, None)
    # engines only (ragen-mega eval): the colocate setting is moot without trainer ranks, and one
    # engine of TP 2 takes both cores as 2 bundles of 1 CPU
    cfg = load_run_config(None, ["trainer.colocate=true", "rollout.engine_tp=2"])
    res = plan_resources(cfg, cluster_cpus=2, host_cpus=2, use_gpu=False, with_trainers=False)
    assert (res.actor_world, res.critic_world) == (0, 0)
    assert res.placement.bundles == [{"CPU": 1.0}] * 2
    assert res.placement.engine_bundles == [[0, 1]] and res.engine_cpus == 1.0
    # trainer ranks only (ragen-mega sft): no engine, no env worker, colocate moot; an actor of
    # TP 2 takes both cores as 2 bundles of 1 CPU and may use 2 // 2 threads a rank
    cfg = load_run_config(None, ["trainer.colocate=true", "actor.tp=2", "critic.enable=false",
                                 "algo.adv_estimator=grpo", "rollout.env_workers=2"])
    res = plan_resources(cfg, cluster_cpus=2, host_cpus=2, use_gpu=False, with_engines=False)
    assert res.placement.bundles == [{"CPU": 1.0}] * 2 and res.actor_bundles == [0, 1]
    assert res.placement.engine_bundles == [] and res.placement.env_worker_bundles == []
    assert (res.trainer_cpus, res.trainer_threads) == (1.0, 1)


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

    def gpus(self):
        import ray

        return [str(i) for i in ray.get_gpu_ids()]


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


def test_engine_gpus_are_its_own_bundles_gpus(private_ray, monkeypatch):
    """Ray with 4 fake GPUs assigns real GPU ids. Disaggregated: the engine's probed GPUs are the
    two the trainer ranks do not hold. Colocated: each engine bundle's GPU is the GPU of the
    trainer rank in that bundle (the probe fits next to its 0.5 GPU), in bundle order."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from ragen_mega.ray.actor_group import ActorGroup

    here = os.path.dirname(os.path.abspath(__file__))  # Ray workers import _Where from here
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here,
                                                                  os.environ.get("PYTHONPATH")])))
    ray.init(num_cpus=2, num_gpus=4, object_store_memory=100 << 20, include_dashboard=False)

    plan = plan_placement(num_trainer_ranks=2, num_engines=1, engine_tp=2, use_gpu=True,
                          cpus_per_bundle=0.25)
    pg = create_placement_group(plan)
    trainer = ActorGroup(_Where, pg, plan.trainer_bundles, num_cpus=0.25, num_gpus=1.0)
    trainer_ids = [i for ids in trainer.call("gpus", timeout_s=60) for i in ids]
    engine_ids = bundle_gpu_ids(pg, plan.engine_bundles[0])
    assert len(trainer_ids) == 2 and len(engine_ids) == 2
    assert sorted(trainer_ids + engine_ids) == ["0", "1", "2", "3"]
    # what the engine's server is started with: the node's environment, its own GPUs only, and
    # an idle-connection time-out longer than the clients' 15 s
    node_env = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert build_env(node_env, device="cuda", gpu_ids=engine_ids) == {
        "PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": ",".join(engine_ids),
        "SGLANG_TIMEOUT_KEEP_ALIVE": "60"}
    assert node_env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    with pytest.raises(RuntimeError, match=r"engine: the GPU probe of bundles \[0\] did not run "
                                           r"within 3s"):
        bundle_gpu_ids(pg, [0], timeout_s=3)  # trainer rank 0 holds all of bundle 0's GPU
    trainer.kill()
    remove_placement_group(pg)

    colo = plan_placement(num_trainer_ranks=2, num_engines=1, engine_tp=2, colocate=True,
                          use_gpu=True, cpus_per_bundle=0.5)
    pg = create_placement_group(colo)
    trainer = ActorGroup(_Where, pg, colo.trainer_bundles, num_cpus=0.25, num_gpus=0.5)
    rank_ids = trainer.call("gpus", timeout_s=60)
    assert all(len(ids) == 1 for ids in rank_ids) and rank_ids[0] != rank_ids[1]
    assert bundle_gpu_ids(pg, colo.engine_bundles[0]) == rank_ids[0] + rank_ids[1]
    assert bundle_gpu_ids(pg, [1, 0]) == rank_ids[1] + rank_ids[0]
    trainer.kill()
    remove_placement_group(pg)

    cpu_pg = create_placement_group(plan_placement(num_trainer_ranks=1, num_engines=1,
                                                   cpus_per_bundle=0.25))
    assert bundle_gpu_ids(cpu_pg, [1]) is None  # a CPU run: no GPUs, nothing to probe
    remove_placement_group(cpu_pg)


def test_engine_spanning_two_nodes_is_refused(monkeypatch):
    """Two raylets with one fake GPU each: a colocated engine of tp 2 lands on both; one SGLang
    TP group cannot, so probing its bundles names the problem."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="rm_ray_"))
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 1, "object_store_memory": 100 << 20})
    cluster.add_node(num_cpus=1, num_gpus=1, object_store_memory=100 << 20)
    try:
        ray.init(address=cluster.address)
        plan = plan_placement(num_trainer_ranks=2, num_engines=1, engine_tp=2, colocate=True,
                              use_gpu=True, cpus_per_bundle=0.5)
        pg = create_placement_group(plan)
        assert bundle_gpu_ids(pg, [0]) == ["0"] and bundle_gpu_ids(pg, [1]) == ["0"]
        with pytest.raises(RuntimeError, match=r"engine 0: its bundles span several nodes "
                                               r"\(bundle 0 on node .*, bundle 1 on node .*\); "
                                               r"an SGLang tensor-parallel group must run on one"):
            bundle_gpu_ids(pg, plan.engine_bundles[0], what="engine 0")
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_server_flags_and_env_for_gpu_and_cpu(tmp_path):
    """Colocated GPU engines get ``--enable-memory-saver`` (as SGLang 0.5.23's own parser reads
    it), CPU engines never; ``gpu_ids`` must match the TP size."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    common = dict(host="127.0.0.1", port=30000, tp=2, dtype=None, mem_fraction=None,
                  max_total_tokens=None)
    gpu = build_command("/m", device="cuda", memory_saver=True, seeded_sampling=True, **common)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(gpu[gpu.index("--model-path"):])
    assert args.enable_memory_saver and args.enable_deterministic_inference and args.tp_size == 2
    plain = build_command("/m", device="cuda", **common)
    assert not parser.parse_args(plain[plain.index("--model-path"):]).enable_memory_saver
    cpu = build_command("/m", device="cpu", memory_saver=True, seeded_sampling=True, **common)
    assert "--enable-memory-saver" not in cpu and "--enable-deterministic-inference" not in cpu
    assert "CUDA_VISIBLE_DEVICES" not in build_env({"PATH": "/usr/bin"}, device="cpu")

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"gpu_ids \['3'\] must name exactly tp=2 GPUs"):
        launch_server(tmp_path, tp=2, device="cuda", gpu_ids=["3"], wait=False)


def test_cpu_engine_ranks_get_their_own_cores():
    """A CPU engine with tp > 1 needs ``SGLANG_CPU_OMP_THREADS_BIND`` (else SGLang allows one
    rank per NUMA node): the cores are cut into tp consecutive groups, or shared round robin when
    there are fewer cores than ranks; a value the user set is kept."""
    assert cpu_threads_bind(2, [0, 1, 2, 3]) == "0-1|2-3"
    assert cpu_threads_bind(3, list(range(8))) == "0-2|3-5|6-7"
    assert cpu_threads_bind(2, [6, 4, 2, 0]) == "0,2|4,6"
    assert cpu_threads_bind(3, [0, 1]) == "0|1|0"
    env = build_env({}, device="cpu", tp=2)
    assert env["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in build_env({}, device="cpu", tp=1)
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in build_env({}, device="cuda", tp=2)
    mine = {"SGLANG_CPU_OMP_THREADS_BIND": "0-15|32-47"}
    assert build_env(mine, device="cpu", tp=2)["SGLANG_CPU_OMP_THREADS_BIND"] == "0-15|32-47"
