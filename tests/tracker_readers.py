"""Readers of what the wandb and MLflow trackers wrote, through each library's own files and API.

wandb (offline) keeps a run in one transaction log, ``run-ID.wandb``: LevelDB's log format (a
7-byte file header ``:W&B``, key 0xBEE1, version 0; then 32 KiB blocks of records, each a 7-byte
header: CRC-32 of type byte + data, length, type FULL/FIRST/MIDDLE/LAST) holding wandb's own
protobuf ``Record`` messages. wandb 0.31 ships no Python reader of it, so the framing is read
here and every record is parsed and CRC-checked with wandb's own message classes.
"""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """Every ``wandb_internal_pb2.Record`` of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:_HEADER] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), path
    records, pos, pending = [], _HEADER, b""
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # a block's tail too short for a header: padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0:  # zero padding at the end of a block
            continue
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), (path, pos)
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_runs(run_dir: Path) -> list[dict]:
    """The wandb runs written under ``run_dir/wandb``, by start time: ``{"id", "name",
    "project", "start", "config": {key: value}, "history": {step: {name: value}}}`` (wandb's own
    ``_step``, ``_runtime``, ``_timestamp`` left out)."""
    runs = []
    for path in sorted((Path(run_dir) / "wandb").glob("*run-*/run-*.wandb")):
        run: dict = {"config": {}, "history": {}}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                r = record.run
                run.update(id=r.run_id, name=r.display_name, project=r.project,
                           start=r.start_time.ToNanoseconds())
                run["config"].update({u.key: json.loads(u.value_json) for u in r.config.update})
            elif kind == "history":
                items = {(i.key or ".".join(i.nested_key)): json.loads(i.value_json)
                         for i in record.history.item}
                run["history"][record.history.step.num] = {
                    k: v for k, v in items.items() if not k.startswith("_")}
        runs.append(run)
    return sorted(runs, key=lambda run: run["start"])


def mlflow_client(run_dir: Path):
    """An MLflow client on the run directory's default store (``RUN_DIR/mlflow.db``)."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}")


def mlflow_history(client, run_id: str, name: str) -> list[tuple[int, float]]:
    """(step, value) of metric ``name``, by step."""
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
