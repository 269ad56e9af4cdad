"""What ``pipeline up`` starts, read from its config alone: the config the run uses
(``run_config``), its workers (``worker_table``: name -> stage command and ``--worker-id``),
and each worker's stage (``stage_of_worker``), command line (``stage_command``) and output
file (``log_file``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from pipeline.config import RunConfig
from pipeline.run.base_model import resolve_base_dir


def run_config(cfg: RunConfig, *, chaos: bool = False) -> RunConfig:
    """The config the run uses: the base directory of its recipe (``resolve_base_dir``), a run
    id made from the time when none is given, and under chaos a server that fsyncs every
    write (a SIGKILLed server must lose nothing it acknowledged, see pipeline.run.chaos)."""
    cfg = resolve_base_dir(cfg)
    if not cfg.run_id:
        cfg = cfg.replace("run_id", time.strftime("run-%Y%m%d-%H%M%S"))
    if chaos:
        cfg = cfg.replace("redis.appendfsync", "always")
    return cfg


def worker_table(cfg: RunConfig) -> dict[str, tuple[str, str | None]]:
    """Worker name -> (stage command, ``--worker-id``) of every process ``pipeline up`` starts."""
    workers: dict[str, tuple[str, str | None]] = {"trainer": ("train", None), "feeder": ("feed", None)}
    workers.update({f"gen-{i}": ("generate", f"gen-{i}") for i in range(cfg.cluster.generators)})
    workers.update({f"ver-{i}": ("verify", f"ver-{i}") for i in range(cfg.cluster.verifiers)})
    workers.update({f"eval-{i}": ("evaluate", f"eval-{i}") for i in range(cfg.cluster.evaluators)})
    workers["exporter"] = ("exporter", None)  # stream metrics, and queue samples for the report
    return workers


def stage_of_worker(name: str) -> str:
    """The stage command of a worker of ``worker_table``: ``gen-0`` -> ``generate``."""
    return {"gen": "generate", "ver": "verify", "eval": "evaluate", "trainer": "train", "feeder": "feed"}.get(
        name.split("-")[0], name)


def stage_command(cfg: RunConfig, stage: str) -> list[str]:
    """The command line of one stage; a torchtitan trainer runs under torchrun with ``trainer.nproc`` ranks."""
    if stage == "train" and cfg.trainer.backend == "torchtitan":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={cfg.trainer.nproc}", "-m", "pipeline.cli"]
    else:
        launcher = [sys.executable, "-m", "pipeline.cli"]
    return [*launcher, stage, "--config", str(cfg.run_dir / "config.toml")]


def log_file(cfg: RunConfig, stage: str, worker: str | None) -> Path:
    """Where a worker's stdout and stderr go: ``logs/<worker id>.out``, or ``logs/<stage>.out``
    for the single-instance stages (``train.out``, ``feed.out``, ``exporter.out``)."""
    return cfg.run_dir / "logs" / f"{worker or stage}.out"
