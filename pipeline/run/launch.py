"""``pipeline up``: the whole pipeline on one machine, one OS process per stage.

The driver. A run this runs_dir records is dealt with first (``pipeline.run.down.reclaim_stale``).
Then it refuses, before starting anything, a field the user set that the run would ignore and
any input a worker would fail on (``pipeline.run.preflight.check_run``, as ``pipeline config
--check``), each a ``ConfigError`` naming the field. Then starts (or reuses) the
Redis-compatible server, builds the base model if missing (``pipeline.run.base_model``: at the
default location, or anywhere with ``model.build_missing``), starts the feeder, N generators,
M verifiers and the trainer through their own CLIs (``pipeline.run.plan``), prints live
progress, restarts a crashed worker (the policy of ``pipeline.run.supervisor``), and when the
trainer finishes stops everything, accounts for every prompt, and writes
``<run_dir>/summary.{json,md}`` (``pipeline.run.summary``). However the driver exits (an
exception, Ctrl-C, SIGTERM), it stops the workers and the server it started and removes
``cluster.json``, the record ``pipeline down`` (``pipeline.run.down``) finds the run by.
With ``--redis.cluster true`` and no URL the run gets a local three-master Redis Cluster
(``pipeline.bus.server.start_local_cluster``); ``--redis.shards S`` shards every stream.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from pipeline.bus.connection import connect
from pipeline.bus.server import provision
from pipeline.bus.stats import queue_depths, read_stats
from pipeline.bus.streams import ensure_all_groups
from pipeline.config import RunConfig
from pipeline.config_toml import to_toml
from pipeline.keys import Keys
from pipeline.observe.metrics import write_ports
from pipeline.observe.report import write_report
from pipeline.run.accounting import account
from pipeline.run.base_model import ensure_base_model
from pipeline.run.chaos import summary as chaos_summary
from pipeline.run.chaos import verdict
from pipeline.run.down import reclaim_stale, remove_weight_files
from pipeline.run.plan import log_file, run_config, stage_command, worker_table
from pipeline.run.preflight import check_run
from pipeline.run.resume import beat, record_resume, resume_count, total_wall
from pipeline.common.procs import proc_start_time
from pipeline.run.summary import write_summary
from pipeline.run.supervisor import Supervisor, WorkerFailed, report_failure
from pipeline.weights.shm import default_root


def _spawn(cfg: RunConfig, stage: str, worker: str | None) -> subprocess.Popen:
    cmd = stage_command(cfg, stage)
    if worker:
        cmd += ["--worker-id", worker]
    env = None
    if cfg.task.kind == "reasoning_gym" and "PYTHONHASHSEED" not in os.environ:
        # Some reasoning-gym datasets build questions from string hashing: one seed for every
        # worker, so the feeder and the trainer generate the same held-out set.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
    with open(log_file(cfg, stage, worker), "ab") as out:  # the child keeps its own copy
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)


def _progress_line(r, keys, start: float, steps: int) -> str:
    tr = {k.decode(): v.decode() for k, v in r.hgetall(keys.trainer).items()}
    q = queue_depths(r, keys)
    st = read_stats(r, keys)

    def f(name: str) -> str:
        return f"{float(tr[name]):.3f}" if name in tr else "  -  "

    return (f"[{time.time() - start:6.0f}s] step {int(tr.get('version', 0)):4d}/{steps}"
            f"  reward {f('reward_mean')}  sample-acc {f('sample_accuracy')}"
            f"  eval {f('eval_accuracy')} (base {f('base_accuracy')})"
            f"  queues prompts={q['prompts']['lag']}+{q['prompts']['pending']}"
            f" rollouts={q['rollouts']['lag']}+{q['rollouts']['pending']}"
            f" scored={q['scored']['lag']}+{q['scored']['pending']}"
            f"  stale={int(st.get('dropped_stale_total', 0))} dead={q['dead']['length']}")


@dataclass
class Cluster:
    """A running ``pipeline up``: its config, server, driver connection and workers (and, under
    ``pipeline chaos``, the fault injector it started beside them and otherwise ignores)."""

    cfg: RunConfig
    server: Any
    r: Any
    keys: Any
    chaos: bool = False
    injector: subprocess.Popen | None = None
    server_restarts: int = 0
    quick: Any = None
    """A client that never retries, for the driver loop's own reads (``progress_line``)."""
    workers: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    restarts: int = 0
    starts: dict[int, int | None] = field(default_factory=dict)
    """pid -> its start time (``proc_start_time``), read as each worker is spawned."""
    failure: WorkerFailed | None = None
    """The worker that kept exiting, when that ended the run."""
    resume_seconds: list[float] = field(default_factory=list)
    """Per death of the trainer, seconds from its death to its next committed step (``Supervisor.tick``)."""

    @property
    def cluster_file(self) -> Path:
        return Path(self.cfg.runs_dir) / "cluster.json"

    def record(self) -> None:
        """Write ``<runs_dir>/cluster.json``: what `pipeline down`, `top` and `status` find the run by."""
        cfg, server = self.cfg, self.server
        tmp = self.cluster_file.with_name(f".cluster.json.{os.getpid()}")
        server_pids = getattr(server, "pids", [server.process.pid] if server.process else [])
        workers = {n: p.pid for n, p in self.procs.items()}
        starts = {str(pid): proc_start_time(pid) for pid in [os.getpid(), *server_pids]}
        self.starts = {pid: self.starts.get(pid) for pid in workers.values()}  # only the current ones
        starts.update({str(pid): st for pid, st in self.starts.items()})
        tmp.write_text(json.dumps({
            "run_id": cfg.run_id, "url": server.url, "ns": self.keys.ns, "stop_key": self.keys.stop,
            "redis_cluster": cfg.redis.cluster, "shards": cfg.redis.shards,
            "server_pid": server.process.pid if server.process else None,
            "server_pids": server_pids, "server_urls": getattr(server, "urls", [server.url]),
            "driver_pid": os.getpid(), "workers": workers,
            "start_times": starts, "run_dir": str(cfg.run_dir),
            "shm_dir": str(default_root() / self.keys.ns) if cfg.weights.transport == "shm" else None}))
        os.replace(tmp, self.cluster_file)  # a reader never sees half of it

    def remove_weights(self) -> None:
        """Remove the run's shared-memory weight files, once its workers are gone: a trainer that
        died (or waited out a backoff) when the run stopped never closed its publisher."""
        if self.cfg.weights.transport == "shm":
            remove_weight_files({"ns": self.keys.ns})

    def forget(self) -> None:
        """Remove ``cluster.json`` if it records this driver (another run may have taken the file over)."""
        try:
            if json.loads(self.cluster_file.read_text()).get("driver_pid") == os.getpid():
                self.cluster_file.unlink()
        except (OSError, ValueError):
            pass

    def log_of(self, name: str) -> Path:
        """The file worker ``name``'s output goes to."""
        return log_file(self.cfg, *self.workers[name])

    def spawn(self, name: str) -> None:
        p = self.procs[name] = _spawn(self.cfg, *self.workers[name])
        self.starts[p.pid] = proc_start_time(p.pid)  # a child not yet waited for: its pid is still its own

    def version(self) -> int:
        return int(self.r.hget(self.keys.trainer, "version") or 0)

    def quick_client(self):
        """The driver's client that never retries (``quick``), made on first use."""
        if self.quick is None:
            self.quick = connect(self.server.url, name=f"{self.cfg.run_id}:driver-progress", redis_cfg=self.cfg.redis,
                                 retries=0, socket_timeout=2.0)
        return self.quick


def provision_cluster(cfg: RunConfig, *, chaos: bool = False, resume: bool = False) -> Cluster:
    """Start (or reach) the server, record the run's config, and prepare its streams; no worker yet.
    With ``resume`` the server must hold the run's data (``pipeline.run.resume``): the stop key the
    last driver set is removed and the resume recorded. A server it started is stopped again if
    anything after that fails."""
    run_dir = cfg.run_dir
    server = provision(run_dir / "redis", url=cfg.redis.url, appendfsync=cfg.redis.appendfsync, redis_cfg=cfg.redis)
    try:
        cfg = cfg.replace("redis.url", server.url)
        r, keys = connect(server.url, name=f"{cfg.run_id}:driver", redis_cfg=cfg.redis), Keys.of(cfg.run_id, cfg.redis)
        has_data = any(r.exists(s.ledger) or r.exists(s.prompts) for s in keys.all_shards())
        if has_data and not resume:
            raise SystemExit(f"pipeline: run {cfg.run_id!r} already has data in {server.url}; choose another --run-id, "
                             f"or continue it with `pipeline up --resume --run-id {cfg.run_id}`")
        if resume:
            if not has_data:
                raise SystemExit(f"pipeline: run {cfg.run_id!r} has no data in {server.url} (no prompt stream, no "
                                 f"ledger): nothing to resume from")
            r.delete(keys.stop)
            committed = int(r.hget(keys.trainer, "committed_version") or 0)
            n = record_resume(run_dir, committed_version=committed)
            print(f"pipeline: resuming run {cfg.run_id!r} (resume {n}) at committed version {committed}: the trainer "
                  f"continues from its last checkpoint, every stage from what the server holds", flush=True)
        # Written once the server is known to be this run's: a refused start leaves the run's own file alone.
        (run_dir / "config.toml").write_text(to_toml(cfg))
        ensure_all_groups(r, keys)
        if cfg.metrics.base_port:
            write_ports(cfg, run_dir / "ports.json")
    except BaseException:
        server.stop()
        raise
    return Cluster(cfg=cfg, server=server, r=r, keys=keys, chaos=chaos, workers=worker_table(cfg))


def supervise(c: Cluster, start: float) -> str:
    """Start every worker and keep them running until the trainer finishes; then stop them
    all. Returns the run's status (``finished``, ``interrupted``, ``failed: ...`` when a
    worker keeps exiting, ``timed out: ...``, or why the trainer failed). Any other exception
    propagates, every worker stopped."""
    cfg = c.cfg
    status = "finished"
    try:
        sup = Supervisor(c)
        for name in c.workers:
            c.spawn(name)
            sup.started(name)
        c.record()
        if c.chaos:
            c.injector = start_injector(c)
        last_print, last_beat, base_checked = 0.0, 0.0, False
        # The trainer exiting 0 ends the run (finished, or stopped); any other exit of any
        # worker, the trainer included (it resumes from its checkpoint), is a restart.
        while c.procs["trainer"].poll() != 0:
            revive_server(c)
            sup.tick()
            if time.time() - start > cfg.cluster.timeout_s:
                status = f"timed out: the trainer did not finish within cluster.timeout_s={cfg.cluster.timeout_s}"
                print(f"pipeline: {status}; stopping every stage", file=sys.stderr, flush=True)
                break
            if time.time() - last_beat >= 2.0:
                if not beat(cfg.run_dir, start) and not last_beat:
                    print(f"pipeline: cannot write {cfg.run_dir / 'driver.json'} (the driver's heartbeat); the run "
                          f"goes on, but a resume will not know how long this driver ran", file=sys.stderr, flush=True)
                last_beat = time.time()
            if time.time() - last_print >= cfg.cluster.progress_every_s:
                print(progress_line(c, start), flush=True)
                last_print = time.time()
                if not base_checked and c.quick is not None:
                    base_checked = report_hopeless_base(c.quick, c.keys, cfg)
            time.sleep(0.2)
        if status == "finished" and c.procs["trainer"].returncode != 0:
            status = f"trainer exited with code {c.procs['trainer'].returncode}"
    except KeyboardInterrupt:
        status = "interrupted"
        print("\ninterrupted: stopping every stage", flush=True)
    except WorkerFailed as e:
        c.failure, status = e, f"failed: {e}"
        report_failure(e)
    finally:
        stop_injector(c)  # first: no fault from here on
        try:
            revive_server(c)
            c.r.set(c.keys.stop, 1)
        except Exception:  # noqa: BLE001 - the server is gone: the signals of _stop_all still stop them
            pass
        _stop_all(c.procs)
    return status


def report_hopeless_base(r, keys, cfg: RunConfig) -> bool:
    """Once the trainer has its base evaluation and its first batch (it writes that batch's hidden
    accuracy before its first update): when the base model answered no held-out problem right and
    no sampled completion of that batch is right either, print so, with what to change (no group
    can carry a signal the truth agrees with). Returns whether the check could be made (then it
    is not made again)."""
    try:
        tr = {k.decode(): v.decode() for k, v in r.hgetall(keys.trainer).items()}
    except redis.RedisError:
        return False
    if "base_accuracy" not in tr or "first_batch_accuracy" not in tr:
        return False
    if float(tr["base_accuracy"]) == 0 and float(tr["first_batch_accuracy"]) == 0:
        t, g = cfg.task, cfg.generator
        print(f"pipeline: the base model answers nothing right: held-out greedy accuracy 0 on "
              f"{t.heldout_size} problems and 0 of the first step's {cfg.trainer.groups_per_step} x {g.group_size} "
              "sampled completions, so no group has a signal the truth agrees with and training cannot start "
              "from here. Change: an easier task (task.dataset_params, task.datasets), a prompt the model "
              "follows (task.system_prompt, task.template, task.chat_template), room to answer "
              "(task.max_new_tokens), how answers are read (task.answer_extract), more tries per prompt "
              "(generator.group_size, generator.temperature), or a stronger base (model.base_dir)",
              file=sys.stderr, flush=True)
    return True


def progress_line(c: Cluster, start: float) -> str:
    """The live progress line, read through a client that does not retry: the driver's loop is
    what starts a dead server again, so it must never wait on that server."""
    try:
        return _progress_line(c.quick_client(), c.keys, start, c.cfg.trainer.steps)
    except redis.RedisError as e:
        c.quick = None
        return f"[{time.time() - start:6.0f}s] the Redis server does not answer ({e}); the workers wait for it"


def start_injector(c: Cluster) -> subprocess.Popen:
    """``pipeline inject`` for this run, as its own process (``logs/inject.out``): it finds the
    workers and the server through ``cluster.json``, as it would beside any run."""
    cmd = [sys.executable, "-m", "pipeline.cli", "inject", "--config", str(c.cfg.run_dir / "config.toml")]
    with open(c.cfg.run_dir / "logs" / "inject.out", "ab") as out:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop_injector(c: Cluster) -> None:
    """SIGTERM for the injector first (it resumes any worker it paused), then the workers' stop."""
    p = c.injector
    if p is None or p.poll() is not None:
        return
    p.terminate()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        _kill_group(p)


def revive_server(c: Cluster) -> None:
    """Start the server this run started again if it died (SIGKILL, an OOM kill): the same
    port, the same append-only file; clients reconnect by themselves."""
    if not getattr(c.server, "dead", lambda: False)():
        return
    t0 = time.perf_counter()
    try:
        what = c.server.revive()
    except Exception as e:  # noqa: BLE001 - the next tick tries again; the workers ride out the outage
        print(f"pipeline: the Redis server is down and did not start again ({e}); retrying", file=sys.stderr,
              flush=True)
        time.sleep(1.0)
        return
    c.server_restarts += 1
    print(f"pipeline: the Redis server{what} had exited; started it again on its port and data in "
          f"{time.perf_counter() - t0:.2f} s (server restart {c.server_restarts} of this run)", flush=True)
    c.record()


def finish(c: Cluster, base_info: dict, status: str, start: float) -> int:
    """Account for every prompt, write the summary and report, stop the server; the exit code."""
    cfg, run_dir = c.cfg, c.cfg.run_dir
    revive_server(c)  # killed by a last fault, the server still holds every acknowledged write
    print(_progress_line(c.r, c.keys, start, cfg.trainer.steps), flush=True)
    accounting = account(c.r, c.keys)
    extra = {}
    if c.chaos:
        extra["chaos"] = {**chaos_summary(run_dir), "verdict": verdict(accounting, finished=status == "finished")}
    wall = time.time() - start
    total, unknown = total_wall(run_dir, wall)
    summary = write_summary(cfg, c.r, c.keys, accounting, base_info, status=status,
                            wall_seconds=wall, wall_seconds_total=round(total, 1), drivers_wall_unknown=unknown,
                            restarts=c.restarts,
                            trainer_resume_seconds=c.resume_seconds,
                            server_restarts=c.server_restarts, driver_resumes=resume_count(run_dir), **extra)
    c.server.stop()
    c.remove_weights()
    c.forget()
    print((run_dir / "summary.md").read_text(), flush=True)
    write_report(run_dir)
    print(f"report: {run_dir / 'report.md'}", flush=True)
    if c.chaos:
        v, ch = extra["chaos"]["verdict"], extra["chaos"]
        print(f"chaos: {ch['faults']} faults survived {ch['by_kind']}; per prompt: "
              f"issued {v['issued']}, trained {v['trained']}, no signal {v['nosignal']}, "
              f"dropped stale {v['dropped_stale']}, dead-lettered {v['dead_lettered']}, in flight {v['in_flight']}, "
              f"lost {v['lost']}, duplicated {v['duplicated']}, unexpected {v['unexpected']} -> "
              f"{'PASS' if v['ok'] and status == 'finished' else 'FAIL'}", flush=True)
        return 0 if v["ok"] and status == "finished" else 1
    return 0 if status == "finished" and summary["accounting"]["ok"] else 1


def shut_down(c: Cluster) -> None:
    """After any abnormal exit of the driver: stop every worker, then the server this run
    started, and remove ``cluster.json``; further Ctrl-C and SIGTERM wait until that is done."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            c.r.set(c.keys.stop, 1)
        except Exception:  # noqa: BLE001 - the server is gone already
            pass
        stop_injector(c)
        _stop_all(c.procs, grace_s=5.0)
        c.server.stop()
        c.remove_weights()
        c.forget()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def up(cfg: RunConfig, *, chaos: bool = False, resume: bool = False) -> int:
    """Run the whole pipeline; with ``chaos``, inject the faults of ``cfg.chaos`` and judge the result;
    with ``resume``, continue the run ``cfg`` names (its config from ``pipeline.run.resume.resumed_config``).

    A run this runs_dir records is dealt with first (``reclaim_stale``); then every input the
    config shows is checked (``check_run``, as ``pipeline config --check``), so a bad one fails here,
    before anything starts. From then on Ctrl-C and SIGTERM (`pipeline
    down`) stop the run cleanly, and however the driver exits, it stops what it started.
    """
    # A run left behind by a SIGKILLed driver first: its workers would hold this run's ports.
    reclaim_stale(Path(cfg.runs_dir))
    cfg = run_config(check_run(cfg, chaos=chaos), chaos=chaos)
    # SIGINT is set explicitly because a process started in the background inherits it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    (cfg.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    start = time.time()
    base_info = ensure_base_model(cfg)
    c = provision_cluster(cfg, chaos=chaos, resume=resume)
    try:
        beat(c.cfg.run_dir, start)  # from here a kill leaves how long this driver ran (the loop beats on)
        known = base_info.get("heldout_accuracy")
        base = f"base accuracy {known:.3f}" if known is not None else \
            "base accuracy: measured on the held-out set before the first step"
        print(f"run {c.cfg.run_id}: redis {c.server.url}, logs in {c.cfg.run_dir}/logs, {base}", flush=True)
        status = supervise(c, start)
        code = finish(c, base_info, status, start)
    except BaseException:
        shut_down(c)
        raise
    if c.failure is not None:
        e = c.failure
        print(f"pipeline: run {c.cfg.run_id} failed: {e.name} {e.how} (code {e.code}); its last lines are "
              f"above, its whole output is {e.log} ({e.why})", file=sys.stderr, flush=True)
        return code or 1
    return code


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop_all(procs: dict[str, subprocess.Popen], grace_s: float = 15.0) -> None:
    """Ask every worker to stop (the stop key is set), then SIGTERM, then SIGKILL. Interrupted
    (a second Ctrl-C), it kills them all at once before passing the interrupt on."""
    try:
        deadline = time.time() + grace_s
        for p in procs.values():
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                _kill_group(p)
    except KeyboardInterrupt:
        for p in procs.values():
            if p.poll() is None:
                _kill_group(p)
        raise


def _kill_group(p: subprocess.Popen) -> None:
    # The whole group (every worker starts its own session): a torchrun agent's ranks
    # die with it instead of outliving a SIGKILL of the agent alone.
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()
