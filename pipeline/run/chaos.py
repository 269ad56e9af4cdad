"""``pipeline chaos``: a whole run while faults are injected, then a total-queue check.

The driver of ``pipeline up`` runs as usual; a ``Chaos`` object is consulted on each of
its ticks and SIGKILLs worker processes (whole process groups, mid-batch, no warning) and
the Redis server (then starts it again on the same port and append-only file; in a
Redis Cluster, one master at a time, which comes back with its ``nodes.conf`` and slots). A killed
worker stays down for a random hold time, so a live peer sometimes reclaims its pending
entries (XAUTOCLAIM) before it comes back and drains its own. A killed trainer resumes
from its checkpoint.

Afterwards ``check`` reads everything back, in the manner of Jepsen's total-queue
analysis, and classifies every prompt id the feeder issued: trained, no signal, dropped
stale, dead-lettered, still in flight, **lost** (issued, never accounted for),
**duplicated** (consumed by two committed trainer steps, from the append-only training
log) and **unexpected** (consumed but never issued). The run passes when lost,
duplicated and unexpected are all zero and the trainer finished.

With ``appendfsync everysec`` a SIGKILL of the server may drop its last second of
acknowledged writes, which no client can detect; a chaos run therefore uses
``appendfsync always`` so that server kills test the pipeline, not the fsync policy.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field

from pipeline.config import ChaosConfig

STAGE_OF = {"gen": "generator", "ver": "verifier", "trainer": "trainer", "feeder": "feeder"}


def stage_of(name: str) -> str:
    return STAGE_OF.get(name.split("-")[0], name)


@dataclass
class Fault:
    at_s: float
    target: str
    detail: str = ""


@dataclass
class Chaos:
    """Decides when to kill what; the cluster driver asks it on every tick."""

    cfg: ChaosConfig
    run_start: float
    expected_steps: int
    faults: list[Fault] = field(default_factory=list)
    hold_until: dict[str, float] = field(default_factory=dict)
    _next_at: float = 0.0
    _schedule_pos: int = 0
    _redis_left: int = 0
    _rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.cfg.seed)
        self._redis_left = self.cfg.redis_restarts
        self._next_at = float("inf")  # armed once training has begun

    def _gap(self) -> float:
        return self._rng.expovariate(1.0 / self.cfg.kill_every_s)

    @property
    def done(self) -> bool:
        if self.cfg.max_faults and len(self.faults) >= self.cfg.max_faults:
            return True
        return bool(self.cfg.schedule) and self._schedule_pos >= len(self.cfg.schedule)

    def _due(self, now: float, version: int) -> bool:
        """A fixed schedule is spread over training progress: fault k of n once version >= k·steps/(n+2)
        (so the faults land mid-run whatever the machine's speed); random faults come after
        exponential gaps once the first step is done."""
        if self.cfg.schedule:
            k = self._schedule_pos + 1
            return version >= k * self.expected_steps / (len(self.cfg.schedule) + 2)
        if version >= 1 and self._next_at == float("inf"):
            self._next_at = now + self._gap()
        return now >= self._next_at

    def _pick(self, procs: dict[str, subprocess.Popen], version: int) -> str | None:
        if self.cfg.schedule:
            target = self.cfg.schedule[self._schedule_pos]
            self._schedule_pos += 1
            return target
        self._next_at = time.time() + self._gap()
        # Spread the server restarts over the run: due once training passed the next fraction.
        if self._redis_left and version >= self.expected_steps * (
                self.cfg.redis_restarts - self._redis_left + 1) / (self.cfg.redis_restarts + 1):
            self._redis_left -= 1
            return "redis"
        # A stage kind first, then one of its live workers: the lone trainer is hit as
        # often as the generator pool.
        alive: dict[str, list[str]] = {}
        for n, p in sorted(procs.items()):
            if stage_of(n) in self.cfg.targets and p.poll() is None:
                alive.setdefault(stage_of(n), []).append(n)
        if not alive:
            return None
        return self._rng.choice(alive[self._rng.choice(sorted(alive))])

    def tick(self, procs: dict[str, subprocess.Popen], server, *, version: int, log=print) -> None:
        """Inject the next fault if it is due."""
        now = time.time()
        if self.done or not self._due(now, version):
            return
        target = self._pick(procs, version)
        if target is None:
            return
        at = now - self.run_start
        if target == "redis":
            t0 = time.perf_counter()
            node = server.restart(kill=True)  # in a Redis Cluster: one master, in turn
            detail = f"SIGKILL{f' of master {node}' if node else ''}, back in {time.perf_counter() - t0:.2f} s"
        else:
            p = procs.get(target)
            if p is None or p.poll() is not None:
                return
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            p.wait()
            hold = self._rng.uniform(0, self.cfg.max_hold_s)
            self.hold_until[target] = now + hold
            detail = f"SIGKILL at version {version}, down for {hold:.1f} s"
        self.faults.append(Fault(at, target, detail))
        log(f"chaos: {target} {detail}")

    def may_restart(self, name: str) -> bool:
        """Whether a dead worker may come back now (a killed one waits out its hold). The
        driver restarts it as any other exited worker otherwise (``pipeline.run.launch.Supervisor``:
        the same backoff, counted against the same budget)."""
        return time.time() >= self.hold_until.get(name, 0.0)

    def summary(self) -> dict:
        kinds: dict[str, int] = {}
        for f in self.faults:
            k = "redis" if f.target == "redis" else stage_of(f.target)
            kinds[k] = kinds.get(k, 0) + 1
        return {"faults": len(self.faults), "by_kind": kinds,
                "events": [{"at_s": round(f.at_s, 2), "target": f.target, "detail": f.detail} for f in self.faults]}


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
