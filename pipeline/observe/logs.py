"""Structured logs: one JSON object per line in ``<run_dir>/logs/<worker>.jsonl``.

Every line carries the event name, the stage and the worker id; callers bind message
ids. A short human form of warnings and errors also goes to stderr.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import structlog


class _TeeLogger:
    """Writes the rendered JSON to the log file, and a compact line to stderr for warnings and errors."""

    def __init__(self, file, echo_all: bool):
        self._file, self._echo_all = file, echo_all

    def msg(self, line: str) -> None:
        self._file.write(line + "\n")
        self._file.flush()
        event = json.loads(line)
        if self._echo_all or event.get("level") in ("warning", "error", "critical"):
            extras = " ".join(f"{k}={v}" for k, v in event.items() if k not in ("event", "timestamp", "level", "stage", "worker"))
            print(f"[{event.get('worker')}] {event.get('level')} {event.get('event')} {extras}", file=sys.stderr, flush=True)

    debug = info = warning = error = critical = exception = msg


def setup_logging(log_dir: Path | None, *, stage: str, worker: str, echo_all: bool = False) -> Any:
    """Configure structlog for this process and return a logger bound to stage and worker."""
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        file = open(log_dir / f"{worker}.jsonl", "a", buffering=1)
    else:
        file = open("/dev/null", "w")
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(default=str),
        ],
        logger_factory=lambda *_: _TeeLogger(file, echo_all),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger().bind(stage=stage, worker=worker)


class MetricsFile:
    """Appends one JSON object per line (per training step, per evaluation) to a metrics file,
    and hands each row to the experiment trackers (``pipeline.observe.tracking.Trackers``)."""

    def __init__(self, path: Path | None, trackers=None):
        self._file = open(path, "a", buffering=1) if path is not None else None
        self.trackers = trackers

    def write(self, kind: str, **values: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, "time": time.time(), **values}, default=float) + "\n")
        if self.trackers is not None:
            self.trackers.write(kind, values)

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
