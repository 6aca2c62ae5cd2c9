"""The Megatron actor or critic as a group of Ray actors, one per rank, plus weight sync.

Each :class:`TrainerWorker` is one rank of the TP x PP x DP world: it joins torch.distributed
(gloo on CPU, NCCL on GPU) through the rendezvous store rank 0 hosts, builds a
:class:`~ragen_mega.backends.megatron.train.MegatronTrainer`, and runs whatever the driver asks
on every rank at once (SPMD collectives). The driver hands over the GLOBAL batch; each rank cuts
its data-parallel share. At a sync every rank walks a ``DirectExport(dst=0)`` and global rank 0
streams it into the engines through its :class:`~ragen_mega.ray.weight_channel.WeightChannel`
(docs/design.md, "Weight sync, streamed").
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from ragen_mega.config import ActorConfig, CriticConfig
from ragen_mega.ray.actor_group import ActorGroup, gather


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class TrainerWorker:
    """One rank of a Megatron trainer (actor or critic), living in a Ray actor."""

    def __init__(self, rank: int, world_size: int, threads: int | None = None):
        from ragen_mega.backends.megatron.cpu_compat import quiet_cpu_warnings

        quiet_cpu_warnings()
        if threads:
            torch.set_num_threads(threads)
        self.rank, self.world_size = rank, world_size
        self.store = None  # rank 0: the rendezvous store it hosts (host_rendezvous)
        self.trainer = None  # built by start
        self.channel = None  # the weight channel (connect_engines), on every rank
        self.engine_key = None  # rank 0: the engines' key, for restarted engines too

    def host_rendezvous(self) -> tuple[str, int]:
        """Rank 0: open the process group's store on a port the OS picks; its address."""
        from ragen_mega.backends.megatron.parallel import tcp_store

        ip = _node_ip()
        self.store = tcp_store(ip, 0, self.world_size, master=True)
        return ip, self.store.port

    def start(self, address: tuple[str, int], role: str, hf_dir: str,
              config: ActorConfig | CriticConfig, derived: dict) -> None:
        """Join the process group through rank 0's store at ``address`` and build the
        trainer."""
        from ragen_mega.backends.megatron.parallel import init_parallel, tcp_store
        from ragen_mega.backends.megatron.train import MegatronTrainer

        store = self.store or tcp_store(*address, self.world_size, master=False)
        init_parallel(self.rank, self.world_size, None, tp=config.tp, pp=config.pp,
                      vpp=config.vpp, ep=config.ep, seed=derived["seed"], store=store)
        self.trainer = MegatronTrainer(config, hf_dir, role=role, **derived)

    def compute_logprobs(self, batch: dict) -> torch.Tensor | None:
        """Log-probs [B, S] of the global batch (returned by rank 0 only)."""
        return self._on_rows(self.trainer.compute_logprobs, batch)

    def compute_ref_logprobs(self, batch: dict) -> torch.Tensor | None:
        """The reference policy's log-probs [B, S] of the global batch (rank 0 only)."""
        return self._on_rows(self.trainer.compute_ref_logprobs, batch)

    def compute_values(self, batch: dict) -> torch.Tensor | None:
        return self._on_rows(self.trainer.compute_values, batch)

    def train(self, batch: dict) -> dict[str, float]:
        return self.trainer.train(batch)  # cuts its PPO mini-batches, then each one's DP shard

    def save_checkpoint(self, root: str, step: int, extra: dict | None = None) -> str:
        return str(self.trainer.save_checkpoint(root, step, extra=extra))

    def load_checkpoint(self, path: str) -> dict:
        return self.trainer.load_checkpoint(path)

    def connect_engines(self, urls: list[str], engine_tp_sizes: list[int], mode: str,
                        bucket_bytes: int, api_key: str | None,
                        adapter_dir: str | None = None) -> None:
        """Open this rank's weight channel of sync ``mode`` (``ray/weight_channel.py``): rank 0's
        talks to every engine, with the engines' key; the others only take part in each sync's
        collective export (``bucket_bytes`` also bounds what each rank keeps in flight).
        ``adapter_dir``: where mode "lora" writes each version of the adapters."""
        from ragen_mega.backends.sglang.client import EngineClient
        from ragen_mega.ray.weight_channel import open_weight_channel

        self.engine_key = api_key
        clients = [EngineClient(u, api_key=api_key) for u in urls] if self.rank == 0 else None
        self.channel = open_weight_channel(
            mode, clients, bucket_bytes=bucket_bytes, engine_tp_sizes=engine_tp_sizes,
            master_addr=_node_ip(), adapter_dir=adapter_dir, base_model=self.trainer.hf_dir)

    def sync_weights(self, version: int, new_engines: dict[int, str] | None = None
                     ) -> dict[str, float]:
        """Push the current weights into the engines as ``version`` (collective over every
        rank; the ``sync/*`` metrics from rank 0).

        The other ranks send their shards to rank 0, up to a bucket ahead, and rank 0 puts each
        tensor on the wire as soon as it is whole. ``new_engines`` (index -> url): restarted
        engines, which rank 0's channel first takes in place of the old ones. A failure there
        or in the send is raised on rank 0 once the export has run to its end on every rank
        (``send_export``)."""
        if self.channel is None:
            raise RuntimeError("sync_weights: call connect_engines first")
        from ragen_mega.backends.sglang.client import EngineClient

        clients = ({i: EngineClient(u, api_key=self.engine_key)
                    for i, u in sorted(new_engines.items())}
                   if new_engines and self.rank == 0 else None)
        return self.channel.push(self.trainer, version, clients)

    def close(self) -> None:
        """Tear down the weight channel (its process group and HTTP sessions)."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def _on_rows(self, compute, batch: dict) -> torch.Tensor | None:
        """``compute`` on this DP rank's rows of the global ``batch`` (padded first to a
        multiple of the DP ranks: a weight-sync probe is one row); every DP rank's output, in
        global order and without the padding, on rank 0 (None elsewhere)."""
        from megatron.core import parallel_state as mpu

        from ragen_mega.backends.megatron.train import dp_shard, pad_rows

        dp = mpu.get_data_parallel_world_size()
        local = compute(dp_shard(pad_rows(batch, dp)))
        if dp > 1:
            parts = [torch.empty_like(local) for _ in range(dp)]
            torch.distributed.all_gather(parts, local.contiguous(),
                                         group=mpu.get_data_parallel_group())
            local = torch.cat(parts)
        return local[:len(batch["input_ids"])] if self.rank == 0 else None


class TrainerGroup:
    """All ranks of one trainer role; every method runs on all ranks and returns rank 0's."""

    def __init__(self, role: str, hf_dir: str, config: ActorConfig | CriticConfig, pg,
                 bundles: list[int], *, num_cpus: float, num_gpus: float = 0.0,
                 threads: int | None = None, total_steps: int, temperature: float = 1.0,
                 seed: int, objective=None):
        """``total_steps``, ``temperature``, ``seed``: what the run derives for the trainer;
        ``objective``: the loss it minimises (``algo/objectives.py``; None: the role's), sent
        to every rank (see :class:`~ragen_mega.backends.megatron.train.MegatronTrainer`)."""
        derived = dict(total_steps=total_steps, temperature=temperature, seed=seed,
                       objective=objective)
        self.group = ActorGroup(TrainerWorker, pg, bundles, num_cpus=num_cpus, num_gpus=num_gpus,
                                init_args=(threads,))
        self.role = role
        # The ranks start in the background (Ray hands rank 0's address on once known); the
        # first call waits for them and raises a rank's failure to start.
        address = self.group.actors[0].host_rendezvous.remote()
        self._starting = self.group.call_async("start", address, role, hf_dir, config, derived)

    def _call(self, method: str, *args: Any) -> list:
        if self._starting:
            gather(self._starting, what=f"starting the {self.role} trainer")
            self._starting = None
        return self.group.call(method, *args)

    def _first(self, method: str, *args: Any) -> Any:
        return self._call(method, *args)[0]

    def _on_batch(self, method: str, batch: dict) -> Any:
        """``method(batch)`` on every rank, the batch put into Ray's object store once (each
        rank reads the same copy instead of being sent its own serialisation)."""
        import ray

        return self._first(method, ray.put(batch))

    def compute_logprobs(self, batch: dict) -> torch.Tensor:
        return self._on_batch("compute_logprobs", batch)

    def compute_ref_logprobs(self, batch: dict) -> torch.Tensor:
        return self._on_batch("compute_ref_logprobs", batch)

    def compute_values(self, batch: dict) -> torch.Tensor:
        return self._on_batch("compute_values", batch)

    def train(self, batch: dict) -> dict[str, float]:
        return {f"{self.role}/{k}": v for k, v in self._on_batch("train", batch).items()}

    def save_checkpoint(self, root: str, step: int, extra: dict | None = None) -> str:
        return self._first("save_checkpoint", root, step, extra)

    def load_checkpoint(self, path: str) -> dict:
        return self._first("load_checkpoint", path)

    def connect_engines(self, urls: list[str], engine_tp_sizes: list[int], *, mode: str,
                        bucket_bytes: int, api_key: str | None,
                        adapter_dir: str | None = None) -> None:
        self._call("connect_engines", urls, engine_tp_sizes, mode, bucket_bytes, api_key,
                   adapter_dir)

    def sync_weights(self, version: int, new_engines: dict[int, str] | None = None
                     ) -> dict[str, float]:
        return self._first("sync_weights", version, new_engines)

    def kill(self) -> None:
        """Close the weight-update channel, then end every rank. A rank that failed to start
        (or died) has no channel to close: that is reported, and the ranks are ended anyway."""
        try:
            self.group.call("close")
        except RuntimeError as e:
            warnings.warn(f"{self.role}: could not close the weight-update channel: {e}")
        finally:
            self.group.kill()
