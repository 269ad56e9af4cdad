"""Shared by the training experiments (bench/gap.py, bench/hacking.py): run the real
pipeline (`pipeline up`) with config overrides, one run at a time, and read back what
it wrote under runs/<id>/ (summary.json, metrics.jsonl).

Each run is a full cluster (Redis, feeder, 2 generators, 2 verifiers, trainer) started
as OS processes by `pipeline up`; its live progress lines are passed through, prefixed
with the run's label, so a long experiment always shows where it is.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from pipeline.config import load_config
from pipeline.run.resume import previous_status

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PIPELINE = [sys.executable, "-m", "pipeline.cli"]


class RunFailed(RuntimeError):
    """A run that exited with an error or left no summary.json; ``run_dir`` is where it wrote."""

    def __init__(self, message: str, run_dir: Path) -> None:
        super().__init__(message)
        self.run_dir = run_dir


class DeadlineReached(RunFailed):
    """The bench's time ran out (``--hours``): the run was stopped as `pipeline down` stops it (status
    ``interrupted``, every stage stopped cleanly) and the bench's ``--resume`` continues it."""


class NotStarted(DeadlineReached):
    """A fresh run was not started: the time left before the bench's deadline is shorter than it is
    expected to take (``needs_s``). A shorter run may still fit; nothing was written."""


def deadline_of(hours: float | None) -> float | None:
    """``--hours`` of a bench as a wall-clock deadline (None: no limit)."""
    if hours is not None and hours <= 0:
        raise SystemExit(f"--hours must be > 0 (got {hours})")
    return None if hours is None else time.time() + 3600.0 * hours


def run_up(label: str, overrides: dict[str, object], *, runs_dir: Path, nice: int = 10,
           config: Path | None = None, resume: Path | None = None, deadline: float | None = None,
           needs_s: float | None = None) -> Path:
    """Run `pipeline up` with ``overrides`` (dotted config fields) under a fresh run id, from the TOML
    file ``config`` when given; with ``resume`` (a run directory, see ``unfinished_run``), continue
    that run instead (`pipeline up --resume`, its own config). Returns the run dir.

    ``deadline`` (``time.time()`` seconds): the driver is sent SIGTERM then (a clean stop, as `pipeline
    down`; SIGINT would be ignored by a driver a background shell started), and DeadlineReached raised
    when the run stopped short; a run that finished all the same is returned; none starts past it.
    ``needs_s`` (seconds, e.g. what a finished run of the same bench took): a fresh run is not started
    when less time than that is left before ``deadline`` (NotStarted), as it could not finish; a
    continuation (``resume``) still starts, since what it does is kept for the next ``--resume``.

    Raises RunFailed (a RuntimeError) if the run fails or leaves no summary.json.
    """
    left = None if deadline is None else deadline - time.time()
    if left is not None and left <= 0:
        raise DeadlineReached("the bench's time ran out before this run started", runs_dir / "(not started)")
    if left is not None and needs_s and resume is None and left < needs_s:
        raise NotStarted(f"not started: {left / 60:.0f} min left before the bench's deadline, and a run "
                         f"takes about {needs_s / 60:.0f} min", runs_dir / "(not started)")
    if resume is not None:
        run_id = resume.name
        cmd = [*PIPELINE, "up", "--resume", "--run-id", run_id, "--runs_dir", str(runs_dir)]
    else:
        run_id = f"{label}-{time.strftime('%m%d-%H%M%S')}"
        cmd = [*PIPELINE, "up", "--run-id", run_id, "--runs_dir", str(runs_dir)]
        if config is not None:
            cmd += ["--config", str(config)]
        for k, v in overrides.items():
            cmd += [f"--{k}", str(v)]
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]
    print(f"[{label}] {' '.join(cmd)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    last: deque[str] = deque(maxlen=5)
    stopped = threading.Event()
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as p:
        assert p.stdout is not None

        def stop() -> None:  # ``nice`` execs the driver: p is the driver itself
            if p.poll() is not None:
                return
            stopped.set()
            print(f"[{label}] the bench's time is up: stopping the run (--resume continues it)", flush=True)
            p.send_signal(signal.SIGTERM)

        timer = threading.Timer(max(0.0, deadline - time.time()), stop) if deadline is not None else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            for line in p.stdout:
                # Progress lines only; the summary is read back from the run directory.
                if line.startswith("[") or "error" in line.lower() or "Traceback" in line or "resuming" in line:
                    print(f"[{label}] {line.rstrip()}", flush=True)
                last.append(line.rstrip())
            rc = p.wait()
        finally:
            if timer is not None:
                timer.cancel()
    run_dir = runs_dir / run_id
    if stopped.is_set():
        status = previous_status(run_dir)
        if status == "finished":  # the stop came as it was ending: its result stands
            return run_dir
        if status in STOPPED_SHORT:
            raise DeadlineReached(f"run {run_id} stopped at the bench's deadline ({status}); the bench's --resume "
                                  f"continues it", run_dir)
    if rc != 0 or not (run_dir / "summary.json").exists():
        # A run refused before it started has no logs yet: its last words say why.
        said = "; ".join(x for x in last if x) if not (run_dir / "logs").exists() or resume else ""
        raise RunFailed(f"run {run_id} failed (exit {rc}); " + (said or f"see {run_dir}/logs"), run_dir)
    return run_dir


STOPPED_SHORT = ("driver gone", "interrupted")
"""How a run ended (``pipeline.run.resume.previous_status``) that the benches continue with --resume:
killed with its driver (no summary), or stopped from outside; not one that ended by its own settings."""


def unfinished_run(label: str, overrides: dict[str, object], *, runs_dir: Path,
                   config: Path | None = None) -> Path | None:
    """The newest run of ``label`` (a run id ``run_up`` made for it) whose driver stopped before the run
    ended (no summary: killed with everything it started; or interrupted) and whose config has every
    one of ``overrides`` (and ``config``'s fields): the run ``run_up(..., resume=...)`` continues."""
    pattern = re.compile(re.escape(label) + r"-\d{4}-\d{6}$")
    want = load_config(config, {k: str(v) for k, v in overrides.items()})
    for run_dir in sorted((d for d in runs_dir.glob(f"{label}-*") if pattern.match(d.name)), reverse=True):
        if previous_status(run_dir) not in STOPPED_SHORT or not (run_dir / "config.toml").is_file():
            continue
        if not (run_dir / "metrics.jsonl").is_file():
            continue  # stopped before its trainer wrote anything (its server may hold no data): start afresh
        try:
            have = load_config(run_dir / "config.toml")
        except ValueError:
            continue
        if all(_same(have.get(k), want.get(k)) for k in want.explicit if k not in ("run_id", "runs_dir", "redis.url")):
            return run_dir
    return None


def _same(a: object, b: object) -> bool:
    """Equal values, or two spellings of one existing path (a link, a relative path)."""
    if a == b:
        return True
    return isinstance(a, str) and isinstance(b, str) and Path(a).exists() and Path(a).resolve() == Path(b).resolve()


def read_run(run_dir: Path) -> dict:
    """summary.json plus the per-step and per-evaluation series of metrics.jsonl."""
    summary = json.loads((run_dir / "summary.json").read_text())
    steps, evals = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "step":
            steps.append(rec)
        elif rec.get("kind") == "eval":
            evals.append(rec)
    return {"summary": summary, "steps": steps, "evals": evals}


def eval_series(run: dict) -> tuple[list[int], list[float]]:
    """(policy versions, held-out accuracy) of every evaluation, in order."""
    ev = sorted(run["evals"], key=lambda e: e["version"])
    return [e["version"] for e in ev], [e["heldout_accuracy"] for e in ev]


def step_series(run: dict, field: str) -> tuple[list[int], list[float]]:
    """(policy versions, ``field``) of every trainer step that logged it."""
    st = [s for s in run["steps"] if s.get(field) is not None]
    return [s["version"] for s in st], [float(s[field]) for s in st]


def smooth(y: list[float], k: int = 10) -> list[float]:
    """Trailing moving average over ``k`` points (noisy per-step series read better smoothed)."""
    out, acc = [], 0.0
    for i, v in enumerate(y):
        acc += v
        if i >= k:
            acc -= y[i - k]
        out.append(acc / min(i + 1, k))
    return out


def md_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


ACCOUNTING = ("issued", "trained", "nosignal", "stale", "lost", "duplicated", "unexpected", "ok")


def accounting_of(summary: dict) -> dict:
    """The run's accounting as the experiments report it (summary.json's ``accounting``)."""
    return {k: summary["accounting"][k] for k in ACCOUNTING}


def plot_episode_curves(runs: list[dict], path: Path, panels: list[tuple[str, str, str, str, tuple]],
                        *, smoothing: int = 10, guide=None) -> None:
    """Two panels of per-seed curves from an episode experiment: each panel is (held-out key,
    training key, title, y label, y limits), the held-out evaluations as markers and the
    training episodes' series smoothed and dashed. ``guide(axes)`` draws extra lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(11, 4))
    for ax, (held, train, title, ylabel, ylim) in zip(axes, panels):
        for r in runs:
            ax.plot(r["versions"], r[held], marker="o", ms=3, label=f"held-out, seed {r['seed']}")
            ax.plot(r["train_versions"], smooth(r[train], smoothing), alpha=0.5, ls="--",
                    label=f"training episodes (smoothed), seed {r['seed']}")
        ax.set(title=title, xlabel="policy version", ylabel=ylabel, ylim=ylim)
    if guide is not None:
        guide(axes)
    for ax in axes:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
