"""Where a run's step scalars go (``trainer.loggers``): TensorBoard, Weights & Biases, MLflow.

Each tracker has ``log(step, scalars)`` and ``close()``; :func:`open_trackers` opens the chosen
ones for :class:`~ragen_mega.logging.RunLogger`. wandb and mlflow are imported only when chosen
(:func:`missing_packages` names what a choice needs) and get the resolved config: wandb as the
run's config, mlflow as one param per dotted key (``actor.lr``) plus the artifact ``config.json``.
A resumed run continues the same wandb and MLflow runs (ids in ``RUN_DIR/trackers.json``); a new
run in the directory starts new ones.

wandb honours ``WANDB_MODE`` (``offline`` writes under ``RUN_DIR/wandb/`` with no account;
``wandb sync`` uploads it later). With neither ``WANDB_MODE`` nor W&B credentials
(``WANDB_API_KEY``, ``wandb login``) it logs offline and says so: a run never stops at a login
prompt. Project: ``WANDB_PROJECT`` (default ``ragen_mega``); files: ``WANDB_DIR`` (default the
run directory); run name: the run directory's name.

MLflow honours ``MLFLOW_TRACKING_URI`` (default ``sqlite:///RUN_DIR/mlflow.db``, artifacts in
``RUN_DIR/mlflow_artifacts``: MLflow 3 refuses new ``./mlruns`` file stores, and SQLite is the
local store it recommends) and ``MLFLOW_EXPERIMENT_NAME`` (default ``ragen_mega``). MLflow's
metric and param names allow fewer characters than the run's (a user's env file path can be
part of a metric name): :func:`mlflow_name` maps the rest.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path
from typing import IO, Any, Mapping, Protocol

#: RUN_DIR/IDS_FILE: {"wandb": run id, "mlflow": run id}, what a resumed run continues
IDS_FILE = "trackers.json"
#: the wandb project and MLflow experiment when the environment names none
DEFAULT_PROJECT = "ragen_mega"


class Tracker(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def mlflow_tracking_uri(run_dir: str | Path) -> str:
    """``MLFLOW_TRACKING_URI``, else the SQLite store in the run directory."""
    return (os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}")


def missing_packages(loggers: list[str], run_dir: str | Path) -> list[str]:
    """One line per chosen tracker whose Python packages are not installed: what is missing
    and the pip command that installs it."""
    lines = []
    for name in dict.fromkeys(loggers):
        if name == "wandb":
            modules, pip = ["wandb"], "pip install wandb"
        elif name == "mlflow":
            # a database store (the default SQLite one) needs SQLAlchemy and alembic besides
            # the client; an HTTP server or a file store does not
            uri = mlflow_tracking_uri(run_dir)
            database = "://" in uri and uri.partition(":")[0] not in (
                "http", "https", "file", "databricks")
            modules = ["mlflow"] + (["sqlalchemy", "alembic"] if database else [])
            pip = "pip install mlflow (or mlflow-skinny sqlalchemy alembic)"
        else:
            continue
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            lines.append(f"{name} needs the Python package(s) {', '.join(missing)}, not "
                         f"installed here: {pip}, or leave {name} out of trainer.loggers")
    return lines


def _stored_id(run_dir: Path, name: str) -> str | None:
    path = run_dir / IDS_FILE
    return json.loads(path.read_text()).get(name) if path.is_file() else None


def _store_id(run_dir: Path, name: str, run_id: str) -> None:
    path = run_dir / IDS_FILE
    ids = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**ids, name: run_id}, indent=2) + "\n")


class TensorBoardTracker:
    """Scalars as TensorBoard events in ``RUN_DIR/tensorboard``."""

    def __init__(self, run_dir: Path, config: dict, resume: bool, stream: IO[str]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, float(value), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run (module docstring: mode, project, files, resume)."""

    def __init__(self, run_dir: Path, config: dict, resume: bool, stream: IO[str]):
        import wandb

        files = os.environ.get("WANDB_DIR") or str(run_dir)
        mode = None  # wandb's own choice: WANDB_MODE, its settings files
        if not os.environ.get("WANDB_MODE") and not wandb.login(prompt=False, verify=False):
            mode = "offline"
            print(f"wandb: no WANDB_MODE and no W&B credentials (WANDB_API_KEY, `wandb login`): "
                  f"logging offline to {files}/wandb (upload later: wandb sync)", file=stream,
                  flush=True)
        run_id = _stored_id(run_dir, "wandb") if resume else None
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                              name=run_dir.name, id=run_id, resume="allow" if run_id else None,
                              dir=files, config=config, mode=mode)
        _store_id(run_dir, "wandb", self.run.id)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({name: float(value) for name, value in scalars.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_name(name: str) -> str:
    """``name`` as MLflow takes a metric or param key: characters other than letters, digits,
    ``_ - . : /`` and space become ``_``, and path parts that are empty, ``.`` or ``..`` are
    dropped (MLflow refuses names that a path normalisation would change)."""
    parts = re.sub(r"[^\w.\- :/]", "_", name).split("/")
    return "/".join(p for p in parts if p not in ("", ".", ".."))


def _flat_params(config: dict) -> dict[str, str]:
    """One MLflow param per dotted config key; values as JSON (strings as they are). MLflow
    cuts a value past its length limit (6000 characters) with a warning; the whole config is
    the run's ``config.json`` artifact."""
    from ragen_mega.run_intent import flatten

    return {mlflow_name(key): value if isinstance(value, str) else json.dumps(value)
            for key, value in flatten(config).items()}


class MlflowTracker:
    """An MLflow run (module docstring: tracking URI, experiment, resume)."""

    def __init__(self, run_dir: Path, config: dict, resume: bool, stream: IO[str]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(mlflow_tracking_uri(run_dir))
        self.run_id = _stored_id(run_dir, "mlflow") if resume else None
        if self.run_id is not None:  # params are write-once in MLflow: the first start's stay
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else \
                self.client.create_experiment(name, artifact_location=None if os.environ.get(
                    "MLFLOW_TRACKING_URI") else (run_dir / "mlflow_artifacts").as_uri())
            self.run_id = self.client.create_run(experiment_id,
                                                 run_name=run_dir.name).info.run_id
            self.client.log_batch(self.run_id, params=[
                Param(k, v) for k, v in _flat_params(config).items()])
            _store_id(run_dir, "mlflow", self.run_id)
        self.client.log_dict(self.run_id, config, "config.json")  # this start's config

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(mlflow_name(name), float(value), now, step) for name, value in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS: dict[str, type] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                             "mlflow": MlflowTracker}


def open_trackers(loggers: list[str], run_dir: str | Path, config: dict[str, Any],
                  resume: bool, stream: IO[str]) -> list[Tracker]:
    """The chosen trackers, opened on ``run_dir``; ``resume`` continues the runs whose ids the
    directory holds."""
    return [TRACKERS[name](Path(run_dir).resolve(), config, resume, stream)
            for name in dict.fromkeys(loggers)]
