"""``pipeline down``, and the cleanup that starts every ``pipeline up``: a run found through
what its ``<runs_dir>/cluster.json`` records.

``pipeline down`` stops a cluster left running (``down``): the driver, then the workers while
the server still answers, then the server, then the run's ``/dev/shm`` weight files; every
stop of the driver's own ends the same way. ``cluster.json`` records each pid with its start
time (``/proc/<pid>/stat`` field 22), and nothing signals a pid whose start time differs: it
is another process now. A later ``pipeline up`` in the same runs_dir (``reclaim_stale``) finds
a ``cluster.json`` whose driver is dead (SIGKILLed) and stops that run's workers and server,
removes its shared-memory weight files, and starts; one whose driver is alive makes it refuse
to start."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import redis
from redis.cluster import RedisCluster

from pipeline.common.procs import recorded_identity, send_signal, signal_recorded, wait_gone
from pipeline.weights.shm import default_root


STOP_GRACE_S = 12.0
"""How long ``pipeline down`` (and a later ``pipeline up`` cleaning up) lets a recorded worker
finish its batch after SIGTERM before SIGKILL: the server is still up meanwhile, so no worker
waits on it."""


def _stop_recorded(info: dict, log=print, *, quiet_gone: bool = False) -> list[str]:
    """SIGTERM (then, after ``STOP_GRACE_S``, SIGKILL) the recorded workers' process groups, and
    once they are gone the recorded server (the workers finish their batch against it); each
    pid only after its start-time check. What was stopped."""
    stopped: list[str] = []
    for names, group in (([(f"{n}", pid) for n, pid in (info.get("workers") or {}).items()], True),
                         ([("the Redis server", pid) for pid in _server_pids(info)], False)):
        sent = [(what, pid) for what, pid in names if signal_recorded(info, what, pid, signal.SIGTERM, group=group,
                                                                        log=log, quiet_gone=quiet_gone)]
        for pid in wait_gone(info, [pid for _, pid in sent], STOP_GRACE_S):
            send_signal(pid, signal.SIGKILL, group=group)  # checked just above: still the recorded process
        wait_gone(info, [pid for _, pid in sent], 5.0)
        stopped += [f"{what} (pid {pid})" for what, pid in sent]
    return stopped


def _recorded_alive(info: dict) -> list[int]:
    """The recorded processes (driver, workers, servers) still running as recorded."""
    pids = [info.get("driver_pid"), *(info.get("workers") or {}).values(), *_server_pids(info)]
    return [pid for pid in pids if pid and recorded_identity(info, pid) == "same"]


def _server_pids(info: dict) -> list[int]:
    return list(info.get("server_pids") or ([info["server_pid"]] if info.get("server_pid") else []))


def remove_weight_files(info: dict) -> tuple[Path | None, int]:
    """Remove the shm transport's files the recorded run left (``/dev/shm/<ns>/``, see
    pipeline.weights.shm); the directory and how many files went."""
    ns = info.get("ns")
    directory = Path(info["shm_dir"]) if info.get("shm_dir") else (default_root() / ns if ns else None)
    if directory is None or not directory.is_dir():
        return directory, 0
    n = 0
    for path in directory.iterdir():
        if path.is_file() and (path.name.endswith(".safetensors") or path.name.endswith(".tmp")):
            path.unlink(missing_ok=True)
            n += 1
    try:
        directory.rmdir()  # only if empty
    except OSError:
        pass
    return directory, n


def reclaim_stale(runs_dir: Path, log=print) -> None:
    """Before a run starts: a ``<runs_dir>/cluster.json`` whose driver is dead (SIGKILLed) is
    cleaned up (its workers and server stopped after the start-time check, its shared-memory
    weight files removed, the file removed), and said so; one whose driver is alive refuses the start."""
    info_file = runs_dir / "cluster.json"
    try:
        info = json.loads(info_file.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        log(f"pipeline: removing an unreadable {info_file} ({e})", flush=True)
        info_file.unlink(missing_ok=True)
        return
    driver, run = info.get("driver_pid"), info.get("run_id", "?")
    if driver and recorded_identity(info, driver) in ("same", "unknown"):
        raise SystemExit(f"pipeline: {info_file} records run {run!r}, whose driver (pid {driver}) is still running; "
                         f"stop it first (`pipeline down --runs-dir {runs_dir}`) or choose another --runs_dir")
    log(f"pipeline: {info_file} records run {run!r}, whose driver (pid {driver}) is gone; cleaning up after it",
        flush=True)
    stopped = _stop_recorded(info, log=log)
    directory, n = remove_weight_files(info)
    info_file.unlink(missing_ok=True)
    log(f"pipeline: cleaned up run {run!r}: stopped {', '.join(stopped) if stopped else 'no process (none left)'}; "
        f"removed {n} weight file(s){f' in {directory}' if directory else ''}; removed {info_file}", flush=True)


DOWN_DRIVER_WAIT_S = 60.0
"""How long ``pipeline down`` waits for a live driver to stop its run (its workers' last batch,
the accounting, the summary) before it SIGKILLs the driver and stops the rest itself; while
every worker is gone already (the driver is accounting, writing its summary), up to
``DOWN_SUMMARY_WAIT_S``."""
DOWN_SUMMARY_WAIT_S = 600.0


def down(runs_dir: Path) -> int:
    """Stop the cluster recorded in ``<runs_dir>/cluster.json``, in order: SIGTERM the driver
    (which stops the rest) and wait for it (SIGKILL after ``DOWN_DRIVER_WAIT_S``, or
    ``DOWN_SUMMARY_WAIT_S`` while it writes its summary with every worker gone); then the stop
    key, and any worker left SIGTERMed, then SIGKILLed after ``STOP_GRACE_S``; then the server,
    last, so no worker waits on a server already gone; then the run's shared-memory weight files.
    ``cluster.json`` is removed only once no recorded process is left. Every pid is signalled
    only if its start time is the one recorded (``recorded_identity``); 1 if a process is left."""
    info_file = runs_dir / "cluster.json"
    if not info_file.exists():
        print(f"no cluster recorded in {info_file}; nothing to stop")
        return 0
    info = json.loads(info_file.read_text())
    driver = info.get("driver_pid")
    stopped_driver = False
    if driver and signal_recorded(info, "the cluster driver", driver, signal.SIGTERM):
        # The driver stops its workers and server itself; give it the time to.
        left = wait_gone(info, [driver], DOWN_DRIVER_WAIT_S)
        if left and not wait_gone(info, list((info.get("workers") or {}).values()), 0):
            print(f"the cluster driver (pid {driver}) has stopped its workers and is writing its summary; waiting")
            left = wait_gone(info, [driver], DOWN_SUMMARY_WAIT_S)
        if left:
            print(f"the cluster driver (pid {driver}) did not stop in time; killing it")
            send_signal(driver, signal.SIGKILL)
            wait_gone(info, [driver], 5.0)
        stopped_driver = True
        print(f"stopped the cluster driver (pid {driver}) and its workers")
    try:
        if info.get("redis_cluster"):
            RedisCluster.from_url(info["url"], socket_timeout=2).set(info["stop_key"], 1)
        else:
            redis.Redis.from_url(info["url"], socket_timeout=2).set(info.get("stop_key", f"{info['ns']}:stop"), 1)
    except (redis.RedisError, OSError, KeyError, IndexError, ValueError):
        pass  # server already gone: signals below still stop the workers
    for what in _stop_recorded(info, quiet_gone=stopped_driver):
        print(f"stopped {what}")
    directory, n = remove_weight_files(info)
    if n:
        print(f"removed {n} weight file(s) in {directory}")
    left = _recorded_alive(info)
    if left:
        print(f"pipeline: processes {left} of the run are still running; keeping {info_file} so that "
              f"`pipeline down` can find them again", file=sys.stderr)
        return 1
    info_file.unlink(missing_ok=True)
    return 0
