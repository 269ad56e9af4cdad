"""Flow control between stages: admission (the staleness bound), version wake-ups,
the stop flag, and backpressure on a stream's unacked entries.
"""

from __future__ import annotations

import threading
import time

import redis

from pipeline.bus.stats import heartbeat
from pipeline.bus.streams import unacked_all
from pipeline.keys import Keys


def release_admissions(r: redis.Redis, keys: Keys, n: int) -> None:
    """Give back ``n`` admission slots of dead-lettered groups (sharded runs; see ``dead_letter``)."""
    if n > 0:
        r.decrby(keys.admitted, n)


# Admission (docs/design.md §3, AReaL's rule): groups admitted so far must stay below
# (η + v + 1)·B. Granting and counting happen in one script so concurrent
# generators never overshoot.
_ADMIT = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local grant = math.min(tonumber(ARGV[1]), tonumber(ARGV[2]) - cur)
if grant <= 0 then return 0 end
redis.call('INCRBY', KEYS[1], grant)
return grant
"""


class Admission:
    def __init__(self, r: redis.Redis, keys: Keys, *, max_staleness: int, groups_per_step: int):
        self.r, self.keys = r, keys
        self.eta, self.batch = max_staleness, groups_per_step
        self._script = r.register_script(_ADMIT)

    def limit(self, version: int) -> int:
        return (self.eta + version + 1) * self.batch

    def admit(self, want: int, version: int) -> int:
        """Admit up to ``want`` new groups for a generator running ``version``; returns how many."""
        return int(self._script(keys=[self.keys.admitted], args=[want, self.limit(version)]))

    def release(self, n: int) -> None:
        """Give back slots admitted but not used (no prompt was available)."""
        if n > 0:
            self.r.decrby(self.keys.admitted, n)


class VersionWatch:
    """Blocks until the trainer announces a new policy version on ``{ns}:versions``."""

    def __init__(self, r: redis.Redis, keys: Keys):
        self.r, self.key = r, keys.versions
        last = r.xrevrange(self.key, count=1)
        self._cursor = last[0][0] if last else b"0-0"

    def wait(self, block_ms: int) -> int | None:
        """The newest announced version after the cursor, or None after ``block_ms``."""
        resp = self.r.xread({self.key: self._cursor}, block=block_ms)
        if not resp:
            return None
        entries = resp[0][1]
        self._cursor = entries[-1][0]
        return int(entries[-1][1][b"version"])


_local_stop = threading.Event()


def request_local_stop() -> None:
    """Ask this process's stage loop to finish its current batch and exit (the first SIGTERM)."""
    _local_stop.set()


def stop_requested(r: redis.Redis, keys: Keys) -> bool:
    """Whether this process was asked to stop (SIGTERM), or the whole run was (``{ns}:stop``)."""
    return _local_stop.is_set() or bool(r.exists(keys.stop))


def wait_for_room(r: redis.Redis, keys: Keys, stream: str | list[str], group: str, *, bound: int, worker_id: str,
                  stage: str, log, poll_s: float = 0.2) -> float:
    """Backpressure: block while ``stream`` (a key, or all shards' keys) holds more than ``bound`` unacked entries.

    Says so in the heartbeat (state ``backpressure``), the log and the counters
    (``backpressure_waits_total``, ``backpressure_seconds_total``). Returns seconds waited.
    """
    t0 = time.perf_counter()
    depth = unacked_all(r, stream, group, cap=bound + 1)
    if depth <= bound:
        return 0.0
    name = stream if isinstance(stream, str) else stream[0]
    stats = keys.shard(0).stats
    log.warning("backpressure", stream=name, unacked=depth, bound=bound)
    r.hincrby(stats, "backpressure_waits_total", 1)
    while depth > bound and not stop_requested(r, keys):
        heartbeat(r, keys, worker_id, stage, "backpressure", stream=name, unacked=depth)
        time.sleep(poll_s)
        depth = unacked_all(r, stream, group, cap=bound + 1)
    waited = time.perf_counter() - t0
    r.hincrbyfloat(stats, "backpressure_seconds_total", waited)
    log.info("backpressure_released", stream=stream, unacked=depth, seconds=round(waited, 3))
    return waited
