"""``pipeline inject``: a fault injector that runs beside a run, outside its driver.

It knows the run only as anyone could: ``<runs_dir>/cluster.json`` (the pids of the
workers and of the server, each with its start time) and the server itself (the policy
version, to start once training has begun). One fault every ``chaos.min_gap_s`` to
``chaos.max_gap_s`` seconds (uniform; ``chaos.seed`` fixes the sequence), each of a kind
drawn from ``chaos.kinds``:

- ``kill``: SIGKILL of a worker's whole process group, mid-batch, no warning (a stage kind
  of ``chaos.targets`` first, then one of its workers, so the lone trainer is hit as often
  as the generator pool);
- ``pause``: SIGSTOP of a worker's group for ``chaos.pause_s`` seconds, then SIGCONT (a
  consumer that hangs: its peers reclaim its entries, and it wakes up holding stale ones);
- ``term``: SIGTERM of a worker: the graceful stop a scheduler sends (a generator with
  ``generator.swap`` step/drain hands its unfinished completions back as resumable work;
  every stage finishes or returns what it holds), after which the driver starts it again;
- ``redis``: SIGKILL of the Redis server (in a Redis Cluster, one master);
- ``env``: SIGKILL of one environment server process a generator's pool started
  (``env.kind = "openenv:<app>"``, pipeline.envs.servers): a generator that has a server up
  first, then one of its servers. The pools record their servers' pids with their start
  times in ``<run_dir>/env-servers/``; with none recorded up at that moment the fault is
  skipped. The generator's pool starts the server again; the episodes that had a session
  on it fail their steps (``env.on_error``) and their groups are still emitted.

The driver learns of a fault only as it learns of any fault, by a process exiting, and
treats it with the same restart policy (``pipeline.run.supervisor.Supervisor``); it starts a
server it started again on the same port and append-only file (an environment server is
its generator's to restart, not the driver's). ``pipeline chaos`` is
``pipeline up`` with this injector started beside it as its own process, and a total-queue
check at the end; ``pipeline inject`` runs it beside any ``pipeline up`` of the same
``runs_dir``. Every fault goes to ``<run_dir>/chaos.jsonl`` and to stdout. Each pid is
signalled only if its start time is the one recorded (``pipeline.common.procs``), so a
worker or an environment server restarted in between is never hit by a fault meant for
its predecessor.

Afterwards ``check`` reads everything back, in the manner of Jepsen's total-queue
analysis, and classifies every prompt id the feeder issued: trained, no signal, dropped
stale, dead-lettered, still in flight, **lost** (issued, never accounted for),
**duplicated** (consumed by two committed trainer steps, from the append-only training
log) and **unexpected** (consumed but never issued). The run passes when lost,
duplicated and unexpected are all zero and the trainer finished.

``chaos.load`` CPU burners (busy loops at the injector's priority) run beside the run from
the injector's start to its end, so the faults land on a loaded host.

With ``appendfsync everysec`` a SIGKILL of the server may drop its last second of
acknowledged writes, which no client can detect; a chaos run therefore uses
``appendfsync always`` so that server kills test the pipeline, not the fsync policy.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.bus.connection import connect
from pipeline.config import ChaosConfig, RunConfig, load_config
from pipeline.envs.servers import read_records
from pipeline.common.procs import recorded_identity, send_signal
from pipeline.keys import Keys

STAGE_OF = {"gen": "generator", "ver": "verifier", "trainer": "trainer", "feeder": "feeder", "eval": "evaluator"}

EVENTS_FILE = "chaos.jsonl"
"""The injector's record of its faults, in the run directory."""

WAIT_FOR_RUN_S = 120.0
"""How long ``pipeline inject`` waits for the run's ``cluster.json`` to appear."""


def stage_of(name: str) -> str:
    return STAGE_OF.get(name.split("-")[0], name)


@dataclass
class Fault:
    at_s: float
    kind: str
    target: str
    detail: str = ""
    version: int | None = None
    pid: int | None = None
    """The pid signalled (for ``kill`` and ``pause``, the leader of the process group signalled)."""

    def as_dict(self) -> dict:
        return {"at_s": round(self.at_s, 2), "kind": self.kind, "target": self.target, "detail": self.detail,
                "version": self.version, "pid": self.pid}


@dataclass
class Plan:
    """What to hit next: the fixed ``chaos.schedule`` in turn, or random picks after random gaps."""

    cfg: ChaosConfig
    expected_steps: int
    pos: int = 0
    next_at: float = float("inf")  # armed once training has begun
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.cfg.seed)

    def gap(self) -> float:
        return self.rng.uniform(self.cfg.min_gap_s, self.cfg.max_gap_s)

    def done(self, injected: int) -> bool:
        if self.cfg.max_faults and injected >= self.cfg.max_faults:
            return True
        return bool(self.cfg.schedule) and self.pos >= len(self.cfg.schedule)

    def due(self, now: float, version: int) -> bool:
        """A fixed schedule is spread over training progress: fault k of n once version >= k·steps/(n+2)
        (so the faults land mid-run whatever the machine's speed); random faults come after
        random gaps once the first step is done."""
        if self.cfg.schedule:
            return version >= (self.pos + 1) * self.expected_steps / (len(self.cfg.schedule) + 2)
        if version >= 1 and self.next_at == float("inf"):
            self.next_at = now + self.gap()
        return now >= self.next_at

    def pick(self, workers: list[str], now: float, env_targets: list[str] = ()) -> tuple[str, str] | None:
        """(kind, target): ``redis`` targets the server; ``env`` a generator with an environment
        server up (of ``env_targets``); the others a worker name."""
        if self.cfg.schedule:
            entry = self.cfg.schedule[self.pos]
            self.pos += 1
            kind, _, name = entry.rpartition(":")
            return ("redis", "redis") if entry == "redis" else (kind or "kill", name)
        self.next_at = now + self.gap()
        kind = self.rng.choice(list(self.cfg.kinds))
        if kind == "redis":
            return "redis", "redis"
        if kind == "env":
            return ("env", self.rng.choice(sorted(env_targets))) if env_targets else None
        by_kind: dict[str, list[str]] = {}
        for n in sorted(workers):
            if stage_of(n) in self.cfg.targets:
                by_kind.setdefault(stage_of(n), []).append(n)
        if not by_kind:
            return None
        return kind, self.rng.choice(by_kind[self.rng.choice(sorted(by_kind))])


class Injector:
    """Reads ``cluster.json``, injects the plan's faults, resumes what it paused, logs every fault."""

    def __init__(self, cfg: RunConfig, *, log=print) -> None:
        self.cfg, self.log = cfg, log
        self.runs_dir = Path(cfg.runs_dir)
        self.info: dict = {}
        self.run_cfg: RunConfig | None = None
        self.plan: Plan | None = None
        self.faults: list[Fault] = []
        self.paused: dict[int, tuple[str, float]] = {}
        """pid -> (worker, when to resume it)."""
        self.started = time.time()
        self._r = None
        self._keys = None
        self._version = 0

    # ------------------------------------------------------------------ the run, as recorded

    def read_info(self) -> dict | None:
        try:
            info = json.loads((self.runs_dir / "cluster.json").read_text())
        except (OSError, ValueError):
            return None
        if self.cfg.run_id and info.get("run_id") != self.cfg.run_id:
            return None
        return info

    def attach(self, timeout_s: float = WAIT_FOR_RUN_S) -> bool:
        """Wait for the run's ``cluster.json``; load the run's own config from its run directory."""
        deadline = time.time() + timeout_s
        while (info := self.read_info()) is None:
            if time.time() > deadline:
                self.log(f"inject: no run{f' {self.cfg.run_id!r}' if self.cfg.run_id else ''} recorded in "
                         f"{self.runs_dir / 'cluster.json'} after {timeout_s:.0f} s; nothing to do", flush=True)
                return False
            time.sleep(0.5)
        self.info = info
        run_dir = Path(info["run_dir"])
        self.run_cfg = load_config(str(run_dir / "config.toml"), {})
        self.plan = Plan(self.cfg.chaos, self.run_cfg.trainer.steps)
        self.events = run_dir / EVENTS_FILE
        self.log(f"inject: attached to run {info['run_id']!r} (driver pid {info.get('driver_pid')}); faults every "
                 f"{self.cfg.chaos.min_gap_s:g}-{self.cfg.chaos.max_gap_s:g} s of {', '.join(self.cfg.chaos.kinds)}"
                 f"{f', schedule {list(self.cfg.chaos.schedule)}' if self.cfg.chaos.schedule else ''}", flush=True)
        return True

    def run_alive(self) -> bool:
        driver = self.info.get("driver_pid")
        return bool(driver) and recorded_identity(self.info, driver) in ("same", "unknown")

    def version(self) -> int:
        """The trainer's policy version, from the server; the last one read while it is down."""
        try:
            if self._r is None:
                self._r = connect(self.info["url"], name=f"{self.info['run_id']}:inject", retries=0,
                                  redis_cfg=self.run_cfg.redis, socket_timeout=1.0)
                self._keys = Keys.of(self.info["run_id"], self.run_cfg.redis)
            self._version = int(self._r.hget(self._keys.trainer, "version") or 0)
        except Exception:  # noqa: BLE001 - the server is down (perhaps by our own hand): try again later
            self._r = None
        return self._version

    def env_servers(self) -> dict[str, list[tuple[dict, dict]]]:
        """Generator name -> (its pool's record, server) of every environment server recorded up
        now, by a generator that is the recorded one (not paused) and under a pid that is still
        that server's."""
        names = {pid: name for name, pid in (self.info.get("workers") or {}).items() if stage_of(name) == "generator"}
        out: dict[str, list[tuple[dict, dict]]] = {}
        for rec in read_records(Path(self.info["run_dir"])):
            parent = rec.get("pid")
            name = names.get(parent)
            if name is None or parent in self.paused or recorded_identity(self.info, parent) != "same" \
                    or recorded_identity(rec, parent) != "same":
                continue  # the driver's own check, a generator gone or restarted since, or one stopped
            for srv in rec["servers"]:
                pid = srv.get("pid")
                if srv.get("up") and isinstance(pid, int) and recorded_identity(rec, pid) == "same":
                    out.setdefault(name, []).append((rec, srv))
        return out

    # ------------------------------------------------------------------ the faults

    def inject(self, kind: str, target: str, version: int,
               env: dict[str, list[tuple[dict, dict]]] | None = None) -> Fault | None:
        info = self.info
        if kind == "env":
            servers = (self.env_servers() if env is None else env).get(target)
            if not servers:
                return None  # no server of that generator up now: the next fault
            rec, srv = self.plan.rng.choice(servers)
            pid = srv["pid"]
            if recorded_identity(rec, pid) != "same" or not send_signal(pid, signal.SIGKILL):
                return None
            return Fault(time.time() - self.started, kind, target,
                         f"SIGKILL of environment server {srv.get('index')} (pid {pid}, port {srv.get('port')}) of "
                         f"{target} (pid {rec['pid']})", version, pid)
        if kind == "redis":
            pids = list(info.get("server_pids") or ([info["server_pid"]] if info.get("server_pid") else []))
            if not pids:
                return None
            # In a Redis Cluster, one master at a time, in turn (master 0 first).
            i = sum(f.kind == "redis" for f in self.faults) % len(pids)
            pid = pids[i]
            if recorded_identity(info, pid) != "same" or not send_signal(pid, signal.SIGKILL):
                return None  # down already, or not yet recorded again: the next fault
            urls = info.get("server_urls") or []
            node = f" of master {urls[i]}" if len(pids) > 1 and i < len(urls) else ""
            return Fault(time.time() - self.started, kind, "redis", f"SIGKILL{node} (server pid {pid})", version, pid)
        pid = (info.get("workers") or {}).get(target)
        if pid is None or recorded_identity(info, pid) != "same" or pid in self.paused:
            return None  # not started, between two lives, or paused already: the next fault
        if kind == "kill":
            if not send_signal(pid, signal.SIGKILL, group=True):
                return None
            return Fault(time.time() - self.started, kind, target, f"SIGKILL of pid {pid}'s group", version, pid)
        if kind == "term":
            if not send_signal(pid, signal.SIGTERM):
                return None
            return Fault(time.time() - self.started, kind, target, f"SIGTERM of pid {pid}", version, pid)
        if not send_signal(pid, signal.SIGSTOP, group=True):
            return None
        self.paused[pid] = (target, time.time() + self.cfg.chaos.pause_s)
        return Fault(time.time() - self.started, kind, target,
                     f"SIGSTOP of pid {pid}'s group for {self.cfg.chaos.pause_s:g} s", version, pid)

    def resume_due(self, *, everything: bool = False) -> None:
        now = time.time()
        for pid, (name, until) in list(self.paused.items()):
            if everything or now >= until:
                if recorded_identity(self.info, pid) == "same":
                    send_signal(pid, signal.SIGCONT, group=True)
                del self.paused[pid]

    def record(self, fault: Fault) -> None:
        self.faults.append(fault)
        with open(self.events, "a") as f:
            f.write(json.dumps(fault.as_dict()) + "\n")
        self.log(f"inject: {fault.kind} {fault.target}: {fault.detail} (version {fault.version})", flush=True)

    def run(self) -> int:
        """Inject until the run ends (its driver gone, its ``cluster.json`` removed) or the plan is
        done; ``chaos.load`` CPU burners run meanwhile."""
        if not self.attach():
            return 1
        burners = start_burners(self.cfg.chaos.load)
        if burners:
            self.log(f"inject: {len(burners)} CPU burner(s) beside the run (pids {[b.pid for b in burners]})",
                     flush=True)
        try:
            while True:
                info = self.read_info()
                if info is None or info.get("driver_pid") != self.info.get("driver_pid") or not self.run_alive():
                    break
                self.info = info  # restarted workers and server: their new pids and start times
                self.resume_due()
                version = self.version()
                if version >= self.run_cfg.trainer.steps:
                    break
                if not self.plan.done(len(self.faults)) and self.plan.due(time.time(), version):
                    env = self.env_servers()
                    picked = self.plan.pick(list((info.get("workers") or {})), time.time(), sorted(env))
                    fault = self.inject(*picked, version, env) if picked else None
                    if fault is not None:
                        self.record(fault)
                    elif self.cfg.chaos.schedule:
                        self.plan.pos -= 1  # that worker is between two lives: try the same entry again
                time.sleep(0.1)
        except KeyboardInterrupt:
            pass
        finally:
            self.resume_due(everything=True)  # nothing stays stopped after the injector
            stop_burners(burners)
        self.log(f"inject: done, {len(self.faults)} faults {by_kind(self.faults)}", flush=True)
        return 0


BURNER = """
import os
parent = os.getppid()
while os.getppid() == parent:  # orphaned (the injector SIGKILLed): stop burning
    for _ in range(1_000_000):
        pass
"""
"""A CPU burner: one core busy at normal priority for as long as its injector lives."""


def start_burners(n: int) -> list[subprocess.Popen]:
    """``n`` CPU burners (``chaos.load``), in the injector's process group, so a SIGKILL of the
    group takes them too; each also ends by itself once its injector is gone."""
    return [subprocess.Popen([sys.executable, "-c", BURNER], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for _ in range(n)]


def stop_burners(burners: list[subprocess.Popen]) -> None:
    for b in burners:
        b.kill()
    for b in burners:
        b.wait()


def by_kind(faults: list[Fault] | list[dict]) -> dict[str, int]:
    """Faults per kind: ``redis``, ``kill env server``, and ``kill``/``pause``/``term`` of each
    stage kind (``kill generator``)."""
    out: dict[str, int] = {}
    for f in faults:
        d = f if isinstance(f, dict) else f.as_dict()
        k = "redis" if d["kind"] == "redis" else "kill env server" if d["kind"] == "env" \
            else f"{d['kind']} {stage_of(d['target'])}"
        out[k] = out.get(k, 0) + 1
    return out


def read_faults(run_dir: Path) -> list[dict]:
    """The faults an injector recorded for this run (``chaos.jsonl``)."""
    try:
        lines = (Path(run_dir) / EVENTS_FILE).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill
    return out


def summary(run_dir: Path) -> dict:
    faults = read_faults(run_dir)
    return {"faults": len(faults), "by_kind": by_kind(faults), "events": faults}


def verdict(accounting: dict, *, finished: bool) -> dict:
    """The total-queue verdict: every prompt accounted for, none twice, none from nowhere."""
    ok = (finished and accounting["lost"] == 0 and accounting["duplicated"] == 0
          and accounting["unexpected"] == 0 and accounting["adds_up"])
    return {"ok": ok, "finished": finished, "issued": accounting["issued"], "trained": accounting["trained"],
            "nosignal": accounting["nosignal"], "dropped_stale": accounting["stale"],
            "dead_lettered": accounting["dead_lettered"], "in_flight": sum(accounting["in_flight"].values()),
            "lost": accounting["lost"], "duplicated": accounting["duplicated"],
            "unexpected": accounting["unexpected"], "lost_ids": accounting["lost_ids"],
            "duplicated_ids": accounting["duplicated_ids"]}


def main(cfg: RunConfig) -> int:
    return Injector(cfg).run()


if __name__ == "__main__":  # pragma: no cover - `pipeline inject` is the entry point
    sys.exit(main(load_config(None, {})))
