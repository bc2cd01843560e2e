"""Metrics loggers: each iteration's metrics (and its sampled responses) to TensorBoard, Weights & Biases
(offline) or MLflow (a local file store), each through the library's own API.

    names = parse_logger_names("tensorboard,wandb")      # torch-free: one-line error before anything starts
    loggers = open_loggers(names, run_name="grpo-tiny", params={...}, tensorboard_dir="tb")
    with Trainer(plan, cfg, loggers=loggers) as t: ...  # Trainer.step calls logger.log(metrics)
    close_loggers(loggers)

Scalars go under their metric names (nested dicts flattened: `op_seconds/generate`), at the
iteration as the step. Where they write: TensorBoard to `tensorboard_dir` (default: its own
`runs/…`); W&B offline to `$WANDB_DIR` or `./wandb` (`wandb sync` uploads it later); MLflow to
`$MLFLOW_TRACKING_URI` or the file store `./mlruns` (`mlflow ui --backend-store-uri ./mlruns`).
This module imports none of the three libraries until a logger is opened.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from abc import ABC, abstractmethod
from pathlib import Path

from hybridflow.simulator.errors import HflowError

# logger name -> (module that must be importable, what to install)
LOGGERS = {"tensorboard": ("tensorboard", "pip install tensorboard"),
           "wandb": ("wandb", "pip install 'hybridflow[loggers]'"),
           "mlflow": ("mlflow", "pip install 'hybridflow[loggers]'")}
PROJECT = "hybridflow"


def parse_logger_names(text: str | None) -> list[str]:
    """`tensorboard,wandb,mlflow` → the names; an unknown or uninstalled one is a one-line error."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    for n in names:
        if n not in LOGGERS:
            raise HflowError(f"unknown logger '{n}'; choose from {', '.join(LOGGERS)} (comma-separated)")
        module, install = LOGGERS[n]
        if importlib.util.find_spec(module) is None:
            raise HflowError(f"logger '{n}' needs {module}, which is not installed: {install}")
    return list(dict.fromkeys(names))


def scalars(metrics: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics dict, nested dicts flattened with '/'; the iteration and text left out."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update(scalars(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration":
            out[f"{prefix}{k}"] = float(v)
    return out


class MetricsLogger(ABC):
    def log(self, metrics: dict) -> None:
        step = int(metrics["iteration"])
        self.log_scalars(scalars(metrics), step)
        if metrics.get("samples"):
            self.log_samples(metrics["samples"], step)

    @abstractmethod
    def log_scalars(self, values: dict[str, float], step: int) -> None: ...

    @abstractmethod
    def log_samples(self, samples: list[dict], step: int) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


def _cell(value) -> str | float:
    """A sample's field as a table cell: numbers and text as they are, chat messages as JSON."""
    return value if isinstance(value, (str, int, float)) else json.dumps(value)


def _samples_markdown(samples: list[dict]) -> str:
    cols = list(samples[0])
    rows = ["| " + " | ".join(str(_cell(s.get(c))).replace("|", "\\|").replace("\n", " ") for c in cols) + " |"
            for s in samples]
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols), *rows])


class TensorBoardLogger(MetricsLogger):
    def __init__(self, log_dir: str | None, params: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)
        self.writer.add_text("config", "```\n" + json.dumps(params, indent=2, default=str) + "\n```", 0)

    def log_scalars(self, values, step):
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_samples(self, samples, step):
        self.writer.add_text("samples", _samples_markdown(samples), step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandbLogger(MetricsLogger):
    def __init__(self, run_name: str, params: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=PROJECT, name=run_name, config=params, mode="offline",
                              settings=wandb.Settings(silent=True))

    def log_scalars(self, values, step):
        self.run.log(values, step=step)

    def log_samples(self, samples, step):
        cols = list(samples[0])
        table = self.wandb.Table(columns=cols, data=[[_cell(s.get(c)) for c in cols] for s in samples])
        self.run.log({"samples": table}, step=step)

    def close(self):
        self.run.finish()


class MlflowLogger(MetricsLogger):
    def __init__(self, run_name: str, params: dict):
        uri = os.environ.get("MLFLOW_TRACKING_URI") or "mlruns"
        if "://" not in uri and not uri.startswith("file:"):  # a plain folder
            uri = Path(uri).resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps the file store in maintenance mode and refuses it unless this is set; it is
            # still the local store that needs no server and no database.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(PROJECT)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(PROJECT)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:500]) for k, v in params.items()])

    def log_scalars(self, values, step):
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.Metric(k, v, now, step) for k, v in values.items()])

    def log_samples(self, samples, step):
        self.client.log_text(self.run_id, json.dumps(samples, indent=1), f"samples/iteration_{step:06d}.json")

    def close(self):
        self.client.set_terminated(self.run_id)


def open_loggers(names: list[str], run_name: str, params: dict,
                 tensorboard_dir: str | None = None) -> list[MetricsLogger]:
    """The loggers `names` asks for (see parse_logger_names), opened; close them with close_loggers."""
    opened: list[MetricsLogger] = []
    try:
        for n in names:
            if n == "tensorboard":
                opened.append(TensorBoardLogger(tensorboard_dir, params))
            elif n == "wandb":
                opened.append(WandbLogger(run_name, params))
            else:
                opened.append(MlflowLogger(run_name, params))
    except Exception:
        close_loggers(opened)
        raise
    return opened


def close_loggers(loggers: list[MetricsLogger]) -> None:
    for logger in loggers:
        logger.close()
