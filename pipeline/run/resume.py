"""``pipeline up --resume``: continue a run whose driver stopped before its trainer finished.

A run stops short when its driver is interrupted (Ctrl-C, ``pipeline down``), times out, or is
killed with everything it started (a batch job's time limit, a machine's session ending, a
reboot). Everything the run needs to go on is on disk: the server's append-only file under
``<run_dir>/redis`` (every stream, the ledger, the counters), the trainer's last checkpoint
and the rollout archive. ``--resume`` starts the same run again from them:

- the config is the run's own ``<run_dir>/config.toml``; a field given on the command line may
  only repeat it, except ``RESUME_MAY_CHANGE`` (how the driver watches it, where its metrics are served);
- a run whose server the driver started (``<run_dir>/redis`` holds its data) gets its server
  started again on that data, on a free port; a run on an external server reuses its URL;
- the stop key the last driver set is removed; the trainer resumes from its last checkpoint (as
  after a trainer crash: versions published after it are lost and counted, docs/faults.md), the
  feeder from its recorded position, generators and verifiers claim what the dead ones held
  pending;
- each resume is a line of ``<run_dir>/resumes.jsonl`` (when, the previous status, the
  committed version it resumed at, how long the previous driver ran: its summary's wall time,
  or, killed before it wrote one, the span of its heartbeat ``<run_dir>/driver.json``), and the
  last driver's summary is removed (the run is under way again); the new summary counts the
  resumes (``driver_resumes``) and the wall time over every driver (``wall_seconds_total``).

A run that finished, a directory that is not a run, or a server that holds no data of the run
is refused before anything starts, naming why.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pipeline.config import RunConfig, load_config
from pipeline.config_base import ConfigError

RESUME_MAY_CHANGE = ("cluster.timeout_s", "cluster.progress_every_s", "metrics.base_port")
"""Fields ``--resume`` lets the command line change (how the driver watches the run and where its metrics are
served; `make up-cluster` sets the port); every other field is the run's own."""
_WHERE = ("run_id", "runs_dir", "redis.url")
"""Fields that say which run to resume and where its server is, not how it runs."""


def _embedded_data(run_dir: Path) -> bool:
    """Whether the run's driver started its own server (or local cluster), whose data is under
    ``<run_dir>/redis``."""
    data = run_dir / "redis"
    return any((d / "server.pid").exists() or (d / "appendonlydir").exists()
               for d in (data, *data.glob("node-*")))


def resumed_config(cfg: RunConfig) -> RunConfig:
    """The config of the run ``cfg.run_id`` in ``cfg.runs_dir`` to continue, with what the command
    line may change applied; a ``ConfigError`` naming the field, or why the run cannot go on."""
    if not cfg.run_id:
        raise ConfigError("run_id: `pipeline up --resume` continues a run: name it with --run-id NAME")
    run_dir = cfg.run_dir
    saved = run_dir / "config.toml"
    if not saved.is_file():
        raise ConfigError(f"run_id: {run_dir} holds no config.toml: not a run `pipeline up` started "
                          f"(--run-id and --runs-dir name the run to resume)")
    status = previous_status(run_dir)
    if status == "finished":
        raise ConfigError(f"run_id: run {cfg.run_id!r} finished (its summary.json says so): nothing to resume")
    keep = {f: cfg.get(f) for f in RESUME_MAY_CHANGE if f in cfg.explicit}
    run = load_config(saved, keep)
    for f in sorted(cfg.explicit - set(RESUME_MAY_CHANGE) - set(_WHERE)):
        if cfg.get(f) != run.get(f):
            raise ConfigError(f"{f}: run {cfg.run_id!r} runs with {run.get(f)!r}; --resume continues it as it "
                              f"was (only {', '.join(RESUME_MAY_CHANGE)} may change), so drop --{f} or start a "
                              f"new run")
    if "redis.url" in cfg.explicit:
        url = cfg.redis.url
    elif _embedded_data(run_dir):
        if run.redis.cluster:
            raise ConfigError("redis.cluster: a run on the local three-master cluster `pipeline up` starts cannot be "
                              "resumed (its nodes' ports are in their cluster state); run on a server of your own "
                              "(--redis-url) to resume")
        url = ""  # the driver starts the run's own server again, on its data
    else:
        url = run.redis.url
    return run.with_overrides({"run_id": cfg.run_id, "runs_dir": cfg.runs_dir, "redis.url": url})


def previous_status(run_dir: Path) -> str:
    """How the run's last driver ended: its summary's status, or ``driver gone`` when it wrote none."""
    return str(_json_object(run_dir / "summary.json").get("status", "driver gone"))


HEARTBEAT = "driver.json"
"""The driver's heartbeat in the run directory: when it started and when it was last alive (``beat``)."""


def beat(run_dir: Path, started: float) -> bool:
    """Write the driver's heartbeat: a driver killed with everything it started leaves no summary,
    and this says how long it ran. Returns False when it could not be written (a full disk): the
    run goes on, only the wall time of a later resume will not know this driver's."""
    tmp = run_dir / f".{HEARTBEAT}.tmp"
    try:
        tmp.write_text(json.dumps({"pid": os.getpid(), "started": round(started, 3),
                                   "alive_at": round(time.time(), 3)}))
        os.replace(tmp, run_dir / HEARTBEAT)
    except OSError:
        return False
    return True


def _json_object(path: Path) -> dict:
    """The JSON object in ``path``; {} when it is missing, unreadable or not an object."""
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def previous_wall(run_dir: Path) -> float | None:
    """How long the run's last driver ran: its summary's ``wall_seconds``, or, killed before it
    wrote one, its heartbeat's span; None when neither says."""
    for read in (lambda: _json_object(run_dir / "summary.json")["wall_seconds"],
                 lambda: _span(_json_object(run_dir / HEARTBEAT))):
        try:
            return max(0.0, float(read()))
        except (KeyError, TypeError, ValueError):
            continue
    return None


def _span(hb: dict) -> float:
    return float(hb["alive_at"]) - float(hb["started"])


def total_wall(run_dir: Path, this_driver: float) -> tuple[float, int]:
    """Wall time over every driver of the run, the earlier drivers' from ``resumes.jsonl``, and how
    many earlier drivers it does not know (killed before their first heartbeat, or a line that
    cannot be read): then the total is a lower bound."""
    earlier, unknown = 0.0, 0
    try:
        lines = [x for x in (run_dir / "resumes.jsonl").read_text().splitlines() if x.strip()]
    except OSError:
        lines = []
    for text in lines:
        try:
            line = json.loads(text)
            earlier += float(line["previous_wall_s"])
        except (ValueError, TypeError, KeyError):
            unknown += 1
    return earlier + this_driver, unknown


def record_resume(run_dir: Path, *, committed_version: int) -> int:
    """Append this resume to ``<run_dir>/resumes.jsonl``; returns how many resumes it now holds."""
    wall = previous_wall(run_dir)
    line = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "previous": previous_status(run_dir),
            "committed_version": committed_version,
            "previous_wall_s": None if wall is None else round(wall, 1)}
    with open(run_dir / "resumes.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    # The run is under way again: the last driver's summary and heartbeat (kept in the line above) no
    # longer say how it ended, and a driver killed before its own first beat must not count them twice.
    for name in ("summary.json", "summary.md", HEARTBEAT):
        (run_dir / name).unlink(missing_ok=True)
    return resume_count(run_dir)


def resume_count(run_dir: Path) -> int:
    """How many times the run was resumed (lines of ``resumes.jsonl``)."""
    try:
        return sum(1 for line in (run_dir / "resumes.jsonl").read_text().splitlines() if line.strip())
    except OSError:
        return 0
