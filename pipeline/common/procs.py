"""Processes a run recorded in ``cluster.json``, and signals that reach only those processes.

``cluster.json`` records each pid with its start time (``/proc/<pid>/stat`` field 22); a pid
whose start time differs belongs to another process now, and is never signalled. The
driver (``pipeline down``, a later ``pipeline up``) and the fault injector
(``pipeline inject``) use these.
"""

from __future__ import annotations

import os
import time

EXIT_ENTRIES_FAILED = 4
"""The exit code of a worker whose step failed on the entries in hand (the trainer: its step is the
whole batch's, so no entry can be set apart in the process). The driver restarts it at the short
end of its backoff and never counts it toward a crash loop: the entries' delivery count
(``redis.max_deliveries``) dead-letters them after a few restarts, and the run goes on."""

EXIT_CONFIG_FAILED = 5
"""The exit code of a worker that found the run cannot work as configured, in a way no restart
fixes (a generator whose environment's resets keep failing: ``env.max_failed_resets``). The
driver does not restart it: it stops the run, with the worker's last lines on stderr and the
error in the summary's status."""


def proc_start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (field 22 of ``/proc/<pid>/stat``, clock ticks since
    boot), or None when there is no such process or it has exited (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            after = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses
    except (OSError, IndexError):
        return None
    if not after or after[0] in ("Z", "X"):
        return None
    try:
        return int(after[19])  # fields 3.. follow the name: field 22 is index 19
    except (IndexError, ValueError):
        return None


def process_age_s(pid: int | None = None) -> float | None:
    """Seconds since process ``pid`` (this one by default) started, from ``/proc`` (to 10 ms);
    None when it cannot be read."""
    start = proc_start_time(os.getpid() if pid is None else pid)
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None if start is None else max(0.0, uptime - start / os.sysconf("SC_CLK_TCK"))


def recorded_identity(info: dict, pid: int) -> str:
    """Whether ``pid`` is still the process ``cluster.json`` (``info``) recorded: ``same``,
    ``gone`` (no such process, or it exited), ``other`` (its start time differs: the pid was
    reused) or ``unknown`` (alive, but no start time was recorded for it)."""
    now = proc_start_time(pid)
    if now is None:
        return "gone"
    starts = info.get("start_times")
    if not isinstance(starts, dict) or starts.get(str(pid)) is None:
        return "unknown"
    return "same" if starts[str(pid)] == now else "other"


SKIP_REASONS = {"gone": "already gone", "other": "its start time differs from the one recorded: the pid belongs to "
                "another process now", "unknown": "no start time is recorded for it, so it may be another process"}


def signal_recorded(info: dict, what: str, pid: int, sig: int, *, group: bool = False, log=print,
                     quiet_gone: bool = False) -> bool:
    """Signal ``pid`` only if it is still the process ``info`` recorded; say why when it is skipped
    (``quiet_gone``: not for a process that is merely gone)."""
    identity = recorded_identity(info, pid)
    if identity != "same":
        if not (quiet_gone and identity == "gone"):
            log(f"skipped {what} (pid {pid}): {SKIP_REASONS[identity]}; not signalled", flush=True)
        return False
    return send_signal(pid, sig, group=group)


def wait_gone(info: dict, pids: list[int], timeout_s: float) -> list[int]:
    """Wait until none of ``pids`` is the recorded process any more; those still alive then."""
    deadline = time.time() + timeout_s
    while True:
        left = [pid for pid in pids if recorded_identity(info, pid) == "same"]
        if not left or time.time() >= deadline:
            return left
        time.sleep(0.2)


def send_signal(pid: int, sig: int, *, group: bool = False) -> bool:
    try:
        (os.killpg if group else os.kill)(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def alive(pid: int) -> bool:
    return send_signal(pid, 0)
