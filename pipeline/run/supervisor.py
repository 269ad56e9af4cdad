"""The restart policy of ``pipeline up`` (``Supervisor``), as Kubernetes' CrashLoopBackOff and
systemd do it: a worker that exits is started again, forever, after a per-worker exponential
backoff (``cluster.restart_backoff_s`` doubling to ``cluster.restart_backoff_max_s``), back to
the start once the worker made progress, as Redis shows it (the trainer committed a step, a
generator or verifier emitted a batch; for the others, once it stayed up
``cluster.restart_reset_s``). A death by an outside signal (SIGKILL, an OOM kill, SIGTERM,
``pipeline chaos``) and a step that failed on its entries (``EXIT_ENTRIES_FAILED``) restart
at the short end and are never part of a crash loop. ``cluster.crash_loop_exits`` quick
non-zero exits in a row (each within ``cluster.crash_loop_uptime_s`` of its start) are a
crash loop: reported on stderr with the worker's last lines, in the progress output and in
its heartbeat, and restarted all the same; only a trainer crash loop ends the run. The
trainer's resumes are timed, from its death to its next committed step.
``cluster.max_restarts_per_hour`` (0: unlimited) bounds all restarts together; past it the
run ends (``WorkerFailed``). A run that ends so prints the worker's last output lines
(``report_failure``), stops everything, and says why in its summary. So does a worker that
exits with ``EXIT_CONFIG_FAILED`` (the run cannot work as configured: no restart would help),
at its first such exit."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.bus.stats import heartbeat
from pipeline.run.plan import stage_of_worker
from pipeline.common.procs import EXIT_CONFIG_FAILED, EXIT_ENTRIES_FAILED


RESTART_BUDGET_WINDOW_S = 3600.0
"""The window ``cluster.max_restarts_per_hour`` counts restarts over."""


OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
"""Deaths another process causes (a fault injector, the OOM killer, an operator); a worker's own
crash (SIGSEGV, SIGABRT, ...) backs off as an exit code does."""


class WorkerFailed(RuntimeError):
    """The restart policy gives up on a worker (a trainer crash loop, the hourly restart
    budget spent): the run stops."""

    def __init__(self, name: str, code: int | None, log: Path, *, why: str = "keeps exiting",
                 fatal: bool = False) -> None:
        how = "exited" if fatal else "keeps exiting"
        super().__init__(f"{name} {how} (code {code}): {why}; see {log}")
        self.name, self.code, self.log, self.why, self.how = name, code, log, why, how


@dataclass
class WorkerRecord:
    """What the supervisor knows of one worker: its current start, its exits, its backoff."""

    started_at: float = 0.0
    backoff_level: int = 0
    """Restarts in a row without progress (``Supervisor.progressed``) in between."""
    progress_at_start: int | None = None
    """The trainer's committed step when this start began (None: not read)."""
    died_at: float | None = None
    """When the trainer last died, until its next committed step (``Supervisor.resume_seconds``)."""
    quick_failures: int = 0
    """Non-zero exits in a row, each within ``cluster.crash_loop_uptime_s`` of its start."""
    restart_at: float | None = None
    """When the exited worker is started again (None: it is running)."""
    crash_looping: bool = False


class Supervisor:
    """The restart policy of ``pipeline up`` (see the module docstring): per-worker
    exponential backoff, crash-loop reports, the trainer's crash loop and the hourly
    budget ending the run (``WorkerFailed``). ``c`` is the running cluster it restarts the
    workers of (``pipeline.run.launch.Cluster``: its procs, its spawn, its record)."""

    def __init__(self, c, *, log=print) -> None:
        self.c, self.log = c, log
        self.records: dict[str, WorkerRecord] = {}
        self.restart_times: list[float] = []

    def started(self, name: str) -> None:
        rec = self.records.setdefault(name, WorkerRecord())
        rec.started_at, rec.restart_at = time.time(), None
        if name == "trainer":
            rec.progress_at_start = self.committed()

    def committed(self) -> int | None:
        """The trainer's last committed step (``{ns}:trainer`` ``committed_version``); None while the
        server does not answer (read without retries: the driver's loop must never wait on it)."""
        try:
            return int(self.c.quick_client().hget(self.c.keys.trainer, "committed_version") or 0)
        except Exception:  # noqa: BLE001 - the server is down: the caller falls back on uptime
            self.c.quick = None
            return None

    def progressed(self, name: str, rec: WorkerRecord) -> bool | None:
        """Whether this start of the worker made progress: the trainer committed a step, a generator
        or verifier emitted a batch (its heartbeat, from this process, counts groups); None when
        unknown (another stage, or the server down): then the uptime rule decides."""
        if name == "trainer":
            now = self.committed()
            return None if now is None or rec.progress_at_start is None else now > rec.progress_at_start
        if stage_of_worker(name) not in ("generate", "verify"):
            return None
        try:
            raw = self.c.quick_client().hget(self.c.keys.workers, name)
        except Exception:  # noqa: BLE001 - the server is down
            self.c.quick = None
            return None
        try:
            beat = json.loads(raw) if raw else {}
        except ValueError:
            return None
        return beat.get("pid") == self.c.procs[name].pid and int(beat.get("groups") or 0) > 0

    def delay(self, rec: WorkerRecord) -> float:
        k = self.c.cfg.cluster
        return min(k.restart_backoff_max_s, k.restart_backoff_s * 2 ** min(rec.backoff_level, 30))

    def tick(self) -> None:
        """Note every worker that exited since the last tick; start again each one whose wait is over;
        time the trainer's resume after a death."""
        c, now = self.c, time.time()
        tr = self.records.get("trainer")
        if tr is not None and tr.died_at is not None and tr.restart_at is None:
            committed = self.committed()
            if tr.progress_at_start is None:  # the server was down when it started
                tr.progress_at_start = committed
            elif committed is not None and committed > tr.progress_at_start:
                c.resume_seconds.append(round(now - tr.died_at, 2))
                self.log(f"trainer resumed: step {committed} committed {now - tr.died_at:.1f} s after it died "
                         f"({now - tr.started_at:.1f} s after its restart)", flush=True)
                tr.died_at = None
        for name, p in list(c.procs.items()):
            rec = self.records.setdefault(name, WorkerRecord(started_at=now))
            if p.poll() is None or (name == "trainer" and p.returncode == 0):
                continue  # running, or the trainer finished: that ends the run
            if rec.restart_at is None:
                self.exited(name, p.returncode, now)
            if rec.restart_at is not None and now >= rec.restart_at:
                c.spawn(name)
                self.started(name)
                c.record()

    def exited(self, name: str, code: int, now: float) -> None:
        c, k, rec = self.c, self.c.cfg.cluster, self.records[name]
        if code == EXIT_CONFIG_FAILED:  # the worker says no restart can help: the run stops
            last = log_tail(c.log_of(name), 1)
            raise WorkerFailed(name, code, c.log_of(name), fatal=True,
                               why=f"the run cannot work as configured: {last[0].strip() if last else 'no output'}")
        uptime = now - rec.started_at
        progressed = self.progressed(name, rec)
        if progressed or (progressed is None and uptime >= k.restart_reset_s):
            rec.backoff_level = 0
        # A signal from outside (SIGKILL, an OOM kill, SIGTERM) or a step that failed on its entries
        # says nothing of the worker's own health: it starts again at the short end.
        outside = -code in OUTSIDE_SIGNALS or code == EXIT_ENTRIES_FAILED
        if outside:
            rec.backoff_level = 0
        if code > 0 and code != EXIT_ENTRIES_FAILED and uptime < k.crash_loop_uptime_s:
            rec.quick_failures += 1
        else:  # a clean exit, a long run, a signal, entries at fault: not a crash loop
            rec.quick_failures, rec.crash_looping = 0, False
        if name == "trainer" and rec.died_at is None:
            rec.died_at = now
        self.restart_times = [t for t in self.restart_times if t > now - RESTART_BUDGET_WINDOW_S]
        self.restart_times.append(now)
        c.restarts += 1
        if k.max_restarts_per_hour and len(self.restart_times) > k.max_restarts_per_hour:
            raise WorkerFailed(name, code, c.log_of(name),
                               why=f"{len(self.restart_times)} restarts within an hour, over "
                                   f"cluster.max_restarts_per_hour = {k.max_restarts_per_hour}")
        looping = rec.quick_failures >= k.crash_loop_exits
        if looping and name == "trainer":
            raise WorkerFailed(name, code, c.log_of(name),
                               why=f"crash loop: {rec.quick_failures} exits in a row within "
                                   f"{k.crash_loop_uptime_s:g} s of starting")
        wait = self.delay(rec)
        rec.backoff_level += 1
        rec.restart_at = now + wait
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        last = log_tail(c.log_of(name), 1)
        self.log(f"{name} {how} after {uptime:.1f} s{f' ({last[0].strip()})' if last and code > 0 else ''}; "
                 f"restarting it in {wait:.1f} s (restart {c.restarts} of this run)", flush=True)
        if looping:
            self.report_crash_loop(name, code, rec, wait)

    def report_crash_loop(self, name: str, code: int, rec: WorkerRecord, wait: float) -> None:
        """Loud, once per crash loop (again when it starts anew): its last lines on stderr,
        a line in the progress output, and ``crash_loop`` as its heartbeat state."""
        c = self.c
        tail = log_tail(c.log_of(name), 10)
        error = tail[-1].strip() if tail else ""
        if not rec.crash_looping:
            rec.crash_looping = True
            print(f"\npipeline: {name} is in a crash loop: {rec.quick_failures} exits in a row (code {code}) "
                  f"within {c.cfg.cluster.crash_loop_uptime_s:g} s of starting; still restarting it, every "
                  f"{c.cfg.cluster.restart_backoff_max_s:g} s at most. "
                  + (f"The last lines of {c.log_of(name)}:" if tail else f"Its output, {c.log_of(name)}, is empty."),
                  file=sys.stderr)
            for line in tail:
                print(f"  | {line}", file=sys.stderr)
            sys.stderr.flush()
        self.log(f"CRASH LOOP: {name} failed {rec.quick_failures} times in a row on start (code {code}): "
                 f"{error or 'no output'}; next start in {wait:.1f} s", flush=True)
        try:
            heartbeat(c.r, c.keys, name, c.workers[name][0], "crash_loop", pid=None, exit_code=code,
                      quick_failures=rec.quick_failures, error=error[-500:])
        except Exception:  # noqa: BLE001 - the report on stderr stands without the heartbeat
            pass


def log_tail(path: Path, lines: int = 20) -> list[str]:
    """The last ``lines`` non-blank lines of a worker's output file (a traceback ends there)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


def report_failure(e: WorkerFailed) -> None:
    """Print, on stderr, why the run stops: the worker, its exit code, and the end of its own output."""
    tail = log_tail(e.log)
    print(f"\npipeline: {e.name} {e.how} (code {e.code}): {e.why}; stopping the run. "
          + (f"The last lines of {e.log}:" if tail else f"Its output, {e.log}, is empty."), file=sys.stderr)
    for line in tail:
        print(f"  | {line}", file=sys.stderr)
    sys.stderr.flush()
