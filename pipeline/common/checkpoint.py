"""Trainer checkpoints: everything a killed trainer needs to resume where it was made durable.

A checkpoint is a directory ``<run_dir>/checkpoints/step-<version>/``:

    (the engine's tensors) the torch engine: ``model.safetensors`` (weights under their HF
                           names) and ``optimizer.safetensors`` (AdamW's per-parameter state
                           and the torch RNG, ``pipeline.engines.torch_state``); torchtitan: one
                           safetensors file per rank (``pipeline.engines.sharded_ckpt``)
    state.json             version, evaluations, the label-model versions trained on, the
                           engine's JSON extras (schedule state, optimizer settings), and the
                           *uncommitted steps*: for each step since the previous checkpoint,
                           the stream entry ids it consumed and each prompt's outcome

No pickle anywhere: tensors go through safetensors, the rest is JSON. The directory is
written under a temporary name, fsynced and renamed, then ``latest`` (a one-line file)
is replaced atomically, so a crash at any instant leaves the previous checkpoint intact.

The trainer acks a step's stream entries and writes their ledger outcomes only after a
checkpoint holds that step (``commit``). On resume it first re-applies the commit of the
checkpoint's uncommitted steps (idempotent: ledger HSETNX, XACK), then continues; entries
consumed by steps that never reached a checkpoint are still pending and are trained again
by the resumed model, which never saw them. So a kill -9 at any point neither loses a
group nor trains one twice into the surviving model.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LATEST = "latest"


@dataclass
class StepRecord:
    """What one trainer step consumed: entry ids to ack and each prompt's ledger outcome."""

    version: int
    entry_ids: list[str]
    outcomes: dict[str, str]
    """prompt id -> ``kind:version`` (trained, nosignal, stale)."""
    group_ids: dict[str, str] = field(default_factory=dict)
    """prompt id -> group id, for the training log."""
    counts: dict[str, float] = field(default_factory=dict)
    """Counters this step adds to ``{ns}:stats`` when it commits."""


@dataclass
class TrainerState:
    version: int
    evals: dict[int, float]
    uncommitted: list[StepRecord]
    labelmodel_versions: list[int] = field(default_factory=list)
    idle_versions: list[int] = field(default_factory=list)
    """Versions whose step trained nothing (no optimizer update): they do not count in a group's staleness."""
    saved_at: float = 0.0
    engine: dict[str, Any] = field(default_factory=dict)
    """What the training engine's ``save_state`` returned (JSON): its schedule and optimizer settings."""


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (its entries: a rename made durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: Path, *, state: TrainerState, write: Callable[[Path], dict[str, Any]], keep: int = 2) -> Path:
    """Write one checkpoint atomically and point ``latest`` at it; keeps the newest ``keep``.

    The tensors come from ``write(tmp_dir)`` (a training engine's ``save_state``), whose
    JSON extras land in ``state.engine``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    name = f"step-{state.version:06d}"
    final = directory / name
    tmp = directory / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state.engine = write(tmp)
    state.saved_at = time.time()
    meta = {**state.__dict__, "uncommitted": [s.__dict__ for s in state.uncommitted],
            "evals": {str(k): v for k, v in state.evals.items()}}
    (tmp / "state.json").write_text(json.dumps(meta))
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    pointer = directory / f".{LATEST}.tmp-{os.getpid()}"
    pointer.write_text(name + "\n")
    with open(pointer, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(pointer, directory / LATEST)
    fsync_path(directory)
    for old in sorted(p for p in directory.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(directory: Path) -> Path | None:
    """The checkpoint ``latest`` points at, or None when there is none."""
    pointer = directory / LATEST
    if not pointer.is_file():
        return None
    path = directory / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def load(path: Path) -> TrainerState:
    """A checkpoint's trainer state; the training engine restores its tensors from ``path``
    and ``state.engine``."""
    meta = json.loads((path / "state.json").read_text())
    if not meta.get("engine"):
        raise ValueError(f"{path}: no training-engine state (written by an older version of the trainer); "
                         "start a new run or set trainer.resume = false")
    return TrainerState(
        version=int(meta["version"]), evals={int(k): float(v) for k, v in meta["evals"].items()},
        uncommitted=[StepRecord(**s) for s in meta["uncommitted"]],
        labelmodel_versions=list(meta.get("labelmodel_versions", [])),
        idle_versions=[int(v) for v in meta.get("idle_versions", [])], saved_at=float(meta.get("saved_at", 0.0)),
            engine=dict(meta["engine"]))
