"""Redis plumbing shared by every stage: connections, consumer groups, dead letters,
admission control, stop flags and queue depths.

Every stream entry has one field, ``d``, holding an encoded record (``pipeline.records``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from pipeline.keys import Keys
from pipeline.records import RecordError

FIELD = b"d"
CONNECT_RETRIES = 10


def connect(url: str, *, name: str = "pipeline", socket_timeout: float = 30.0) -> redis.Redis:
    """A client that retries with exponential backoff (up to ~10 s) when the server restarts.

    ``socket_timeout`` must exceed the longest ``BLOCK`` a caller uses, or redis-py
    reports a blocking read as a timeout.
    """
    if not url:
        raise ValueError("redis.url: empty; pass --redis.url or set REDIS_URL")
    client = redis.Redis.from_url(
        url,
        client_name=name,
        socket_timeout=socket_timeout,
        socket_connect_timeout=5,
        health_check_interval=30,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), CONNECT_RETRIES),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )
    try:
        client.ping()
    except redis.ConnectionError as e:
        raise redis.ConnectionError(f"cannot reach Redis at {url} after {CONNECT_RETRIES} retries: {e}") from e
    return client


def ensure_group(r: redis.Redis, stream: str, group: str) -> None:
    """Create the consumer group (and the stream) if missing; idempotent."""
    try:
        r.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def ensure_all_groups(r: redis.Redis, keys: Keys) -> None:
    for key, group in keys.streams().values():
        ensure_group(r, key, group)


@dataclass
class Entry:
    id: bytes
    payload: bytes | None
    """The record bytes; None if the entry was deleted or has no ``d`` field (a poison entry)."""


class GroupReader:
    """Reads one stream as a named consumer of a group.

    A restarted consumer first re-reads its own pending entries (delivered before the
    crash, never acked), following a cursor so entries it holds unacked are not
    returned twice, then reads new entries with ``>``.
    """

    def __init__(self, r: redis.Redis, stream: str, group: str, consumer: str):
        self.r, self.stream, self.group, self.consumer = r, stream, group, consumer
        self._pending_cursor: bytes | str | None = "0"

    @property
    def draining_pending(self) -> bool:
        return self._pending_cursor is not None

    def read_pending(self, count: int) -> list[Entry]:
        """This consumer's own delivered-but-unacked entries, oldest first; [] once drained."""
        if self._pending_cursor is None:
            return []
        resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: self._pending_cursor}, count=count)
        entries = resp[0][1] if resp else []
        if not entries:
            self._pending_cursor = None
            return []
        self._pending_cursor = entries[-1][0]
        return [Entry(i, f.get(FIELD) if f else None) for i, f in entries]

    def read_new(self, count: int, block_ms: int) -> list[Entry]:
        """Entries never delivered to the group, waiting up to ``block_ms`` for one."""
        resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        entries = resp[0][1] if resp else []
        return [Entry(i, f.get(FIELD) if f else None) for i, f in entries]

    def read(self, count: int, block_ms: int) -> list[Entry]:
        """Own pending entries first, then new ones."""
        return self.read_pending(count) or self.read_new(count, block_ms)


def decode_entries(entries: list[Entry], decode, check=None) -> tuple[list[tuple[Entry, object]], list[tuple[Entry, str]]]:
    """Split entries into ``(entry, record)`` pairs and ``(entry, reason)`` defects.

    ``decode`` is a record type's ``decode``; ``check(record)`` may raise RecordError
    for defects only the stage can see (a prompt length, a vocabulary size).
    """
    good, bad = [], []
    for e in entries:
        try:
            if e.payload is None:
                raise RecordError("entry has no payload field")
            record = decode(e.payload)
            if check is not None:
                check(record)
            good.append((e, record))
        except RecordError as err:
            bad.append((e, str(err)))
    return good, bad


def dead_letter(
    pipe: redis.client.Pipeline,
    keys: Keys,
    *,
    stream: str,
    group: str,
    entry: Entry,
    reason: str,
    consumer: str,
    prompt_id: str = "",
    release_admission: bool = False,
) -> None:
    """Queue, on a MULTI pipeline, the move of one entry to ``{ns}:dead`` and its ack.

    ``release_admission`` returns the group's admission slot (DESIGN §3) when the
    entry was admitted for generation but will never reach the trainer.
    """
    pipe.xadd(keys.dead, {
        "reason": reason[:2000], "stream": stream, "id": entry.id, "consumer": consumer,
        "prompt_id": prompt_id, "payload": entry.payload or b"", "at": f"{time.time():.3f}",
    })
    pipe.xack(stream, group, entry.id)
    pipe.hincrby(keys.stats, "dead_letters_total", 1)
    if release_admission:
        pipe.decr(keys.admitted)


# Admission (DESIGN §3, AReaL's rule): groups admitted so far must stay below
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


def stop_requested(r: redis.Redis, keys: Keys) -> bool:
    return bool(r.exists(keys.stop))


def heartbeat(r: redis.Redis, keys: Keys, worker_id: str, stage: str, state: str, **extra) -> None:
    r.hset(keys.workers, worker_id, json.dumps(
        {"stage": stage, "pid": os.getpid(), "state": state, "at": time.time(), **extra}))


def incr_stats(pipe: redis.Redis | redis.client.Pipeline, keys: Keys, **counts: float) -> None:
    for name, n in counts.items():
        if n:
            if isinstance(n, float) and not n.is_integer():
                pipe.hincrbyfloat(keys.stats, name, n)
            else:
                pipe.hincrby(keys.stats, name, int(n))


def read_stats(r: redis.Redis, keys: Keys) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in r.hgetall(keys.stats).items()}


def queue_depths(r: redis.Redis, keys: Keys) -> dict[str, dict[str, int]]:
    """Per stream: length, entries not yet delivered to its group (lag), delivered but unacked (pending)."""
    out: dict[str, dict[str, int]] = {}
    for name, (key, group) in keys.streams().items():
        row = {"length": int(r.xlen(key)), "lag": 0, "pending": 0}
        try:
            for g in r.xinfo_groups(key):
                if g["name"].decode() == group:
                    row["pending"] = int(g["pending"])
                    lag = g.get("lag")
                    row["lag"] = int(lag) if lag is not None else 0
        except redis.ResponseError:
            pass  # stream not created yet
        out[name] = row
    out["dead"] = {"length": int(r.xlen(keys.dead)), "lag": 0, "pending": 0}
    return out
