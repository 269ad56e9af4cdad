"""Experiment trackers: the trainer's ``metrics.jsonl`` rows, also sent to TensorBoard and W&B.

``tracking.backends`` picks them (none by default). Every row the trainer writes to
``metrics.jsonl`` (a ``step`` row per optimizer step, an ``eval`` row per evaluation) goes
to each backend as scalars at the row's policy version: its numeric fields as
``train/<field>`` or ``eval/<field>``, a list field (``staleness_hist``) as one scalar per
entry (``train/staleness_hist/0``, ...). Non-numeric fields are left to ``metrics.jsonl``.

- ``tensorboard``: event files under ``tracking.dir`` (default ``<run_dir>/tensorboard``),
  through ``torch.utils.tensorboard`` (needs the ``tensorboard`` package: the
  ``tracking`` extra). ``tensorboard --logdir runs/<id>/tensorboard`` shows them.
- ``wandb``: a Weights & Biases run named after the run id, in ``tracking.wandb_mode``
  (``offline`` by default: no network, the run is kept under ``<run_dir>/wandb`` and
  ``wandb sync`` uploads it later; ``online`` logs in as usual). The run's config is the
  resolved config. A trainer restarted from its checkpoint resumes the same W&B run.

A backend that fails to start is refused before launch (``problems``) when its package is
missing; one that fails mid-run logs the error once and is dropped: a tracker never stops
training.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from pipeline.config import config_to_dict

BACKENDS = ("tensorboard", "wandb")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
INSTALL = 'pip install -e ".[tracking]" (or: pip install tensorboard==2.21.0 wandb==0.31.0)'


def problems(cfg) -> list[str]:
    """Before launch: each backend named must be importable."""
    out = []
    for name in cfg.tracking.backends:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            out.append(f"tracking.backends: {name!r} needs the {PACKAGES[name]!r} package, which is not installed; "
                       f"{INSTALL}")
    return out


def scalars(kind: str, row: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of one metrics row, as tracker tags (see the module docstring)."""
    prefix = "train" if kind == "step" else kind
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in ("kind", "time", "version"):
            continue
        if isinstance(value, bool):
            out[f"{prefix}/{key}"] = float(value)
        elif isinstance(value, (int, float)):
            out[f"{prefix}/{key}"] = float(value)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
            if key == "labelmodel_versions":
                continue  # ids, not a quantity
            for i, v in enumerate(value):
                out[f"{prefix}/{key}/{i}"] = float(v)
    return out


class TensorBoardSink:
    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        for tag, v in values.items():
            self.writer.add_scalar(tag, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, directory: Path, *, project: str, run_id: str, mode: str, config: dict) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=run_id, id=run_id.replace("/", "-"), resume="allow",
                              dir=str(directory), mode=mode, config=config,
                              settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        self.run.define_metric("policy_version")
        self.run.define_metric("*", step_metric="policy_version")

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, "policy_version": step})

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The backends ``tracking.backends`` names, fed one metrics row at a time."""

    def __init__(self, cfg, run_dir: Path | None, log=None) -> None:
        self.log = log
        self.sinks: dict[str, Any] = {}
        if run_dir is None:
            return
        base = Path(cfg.tracking.dir) if cfg.tracking.dir else Path(run_dir)
        for name in cfg.tracking.backends:
            try:
                if name == "tensorboard":
                    self.sinks[name] = TensorBoardSink(base / "tensorboard")
                else:
                    self.sinks[name] = WandbSink(base / "wandb", project=cfg.tracking.project, run_id=cfg.run_id,
                                                 mode=cfg.tracking.wandb_mode, config=config_to_dict(cfg))
            except Exception as e:  # noqa: BLE001 - a tracker never stops training
                self._failed(name, e)

    def _failed(self, name: str, e: Exception) -> None:
        self.sinks.pop(name, None)
        if self.log is not None:
            self.log.error("tracker_failed", backend=name, error=f"{type(e).__name__}: {e}")

    def write(self, kind: str, row: dict[str, Any]) -> None:
        if not self.sinks:
            return
        values = scalars(kind, row)
        step = int(row.get("version", 0))
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(kind, step, values)
            except Exception as e:  # noqa: BLE001
                self._failed(name, e)

    def close(self) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001
                self._failed(name, e)
        self.sinks.clear()
