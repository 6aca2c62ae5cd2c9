"""How a trainer rank's weights reach the engines: one :class:`WeightChannel` per rank.

Every rank of the actor calls :meth:`WeightChannel.push` at each sync (the export is
collective); only global rank 0's channel talks to the engines. :func:`open_weight_channel` picks
the kind from the sync mode, and the trainer worker does not know which one it feeds:

* :class:`ExportChannel` (``"distributed"``: a broadcast group; ``"tensor"``: colocated shared
  memory): the export's HF-named tensors (full weights, or adapters the engines merge) streamed
  bucket by bucket (``backends/sglang/weight_sender.py``);
* :class:`AdapterChannel` (``"lora"``: ``actor.lora.sync: native``): the adapters gathered and
  written as a PEFT directory the engines load by name (``backends/sglang/lora_serving.py``).

Engines restarted since the last sync (``new_engines``) are taken in before the channel sends.
On the driver, :class:`TrainerWeights` is the channels' other end, handed to the engine
supervisor to bring a restarted engine to the weights the others serve.
"""
from __future__ import annotations

from typing import Protocol


class WeightChannel(Protocol):
    def push(self, trainer, version: int, new_engines: dict | None = None
             ) -> dict[str, float]:
        """This rank's part in sending ``trainer``'s weights as ``version``; on rank 0, after
        taking ``new_engines`` (index -> ``EngineClient`` of a restarted server) in place of
        the gone ones. The ``sync/*`` metrics on rank 0, ``{}`` elsewhere."""

    def close(self) -> None:
        """Tear the channel down (its process group and HTTP sessions)."""


class TrainerWeights:
    """The driver's end of the actor ranks' channels: a push asks every rank to send its
    weights, and :attr:`version` is what the engines serve since the last one."""

    def __init__(self):
        self.actor = None   # the actor's TrainerGroup, once its ranks are built
        self.version = 0

    def push(self, version: int, new_engines: dict[int, str]) -> dict[str, float]:
        """Send the actor's weights as ``version``, taking in ``new_engines`` (index -> url of
        a restarted server) first; the ``sync/*`` metrics."""
        metrics = self.actor.sync_weights(version, new_engines=new_engines)
        self.version = version
        return metrics

    def resync(self, engines: dict[int, str]) -> None:
        """Bring the restarted ``engines`` to :attr:`version` (the weights the others serve)."""
        self.push(self.version, engines)


class ExportChannel:
    """The bucketed send of ``trainer.weight_export``: rank 0 holds the ``sender``
    (:class:`BucketedWeightSender`), the other ranks none (they send their shards to it)."""

    def __init__(self, sender, bucket_bytes: int):
        self.sender, self.bucket_bytes = sender, bucket_bytes

    def push(self, trainer, version: int, new_engines: dict | None = None) -> dict[str, float]:
        from ragen_mega.backends.sglang.weight_sender import send_export

        def take_them_in() -> None:
            self.sender.replace_engines(new_engines)

        export = trainer.weight_export(dst=0, prefetch_bytes=self.bucket_bytes)
        stats = send_export(export, self.sender, version,
                            before=take_them_in if new_engines and self.sender else None)
        if stats is None:  # not the sending rank
            return {}
        return {"sync/seconds": stats.seconds, "sync/bytes": float(stats.num_bytes),
                "sync/buckets": float(stats.num_buckets)}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            for client in self.sender.engines:
                client.close()
            self.sender = None


class AdapterChannel:
    """The adapters gathered to every rank (collective) and served by name: rank 0 holds the
    ``served`` (:class:`ServedAdapters`), the other ranks none."""

    def __init__(self, served):
        self.served = served

    def push(self, trainer, version: int, new_engines: dict | None = None) -> dict[str, float]:
        from ragen_mega.backends.megatron.lora_export import gather_adapters

        tensors = gather_adapters(trainer.model)
        if self.served is None:
            return {}
        if new_engines:
            self.served.replace_engines(new_engines)
        stats = self.served.publish(tensors, trainer.lora, version)
        return {"sync/seconds": stats.seconds, "sync/bytes": float(stats.num_bytes)}

    def close(self) -> None:
        if self.served is not None:
            self.served.close()
            self.served = None


def open_weight_channel(mode: str, clients: list | None, *, bucket_bytes: int,
                        engine_tp_sizes: list[int], master_addr: str, adapter_dir: str | None,
                        base_model: str) -> WeightChannel:
    """The channel of sync ``mode`` ("distributed", "tensor" or "lora"). ``clients``: an
    ``EngineClient`` per engine on the sending rank (None on the others, whose channel only
    takes part in the collective export). ``adapter_dir``: where "lora" writes each version
    (where the engines can read it); ``base_model``: the HF directory its adapters name."""
    if mode == "lora":
        from ragen_mega.backends.sglang.lora_serving import ServedAdapters

        return AdapterChannel(ServedAdapters(clients, adapter_dir, base_model) if clients
                              else None)
    if not clients:
        return ExportChannel(None, bucket_bytes)
    from ragen_mega.backends.sglang.weight_sender import BucketedWeightSender

    sender = BucketedWeightSender(clients, mode=mode, bucket_bytes=bucket_bytes,
                                  master_addr=master_addr, engine_tp_sizes=engine_tp_sizes)
    if mode == "distributed":
        sender.connect()
    return ExportChannel(sender, bucket_bytes)
