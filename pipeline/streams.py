"""Redis plumbing shared by every stage: connections, consumer groups, dead letters,
admission control, stop flags and queue depths.

Every stream entry has one field, ``d``, holding an encoded record (``pipeline.records``).
A run's streams may be sharded (``pipeline.keys``): ``ShardedReader`` reads all shards of
one stream, and the depth, counter and dead-letter readers sum or merge over the shards.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, SlotNotCoveredError
from redis.retry import Retry

from pipeline.keys import Keys, ShardKeys
from pipeline.records import RecordError

FIELD = b"d"
CONNECT_RETRIES = 10


class _TransientRetry(Retry):
    """Retries what a server restart causes, never refused credentials: those fail at once."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def transient(error: Exception) -> bool:
            if isinstance(error, redis.AuthenticationError) or "NOAUTH" in str(error) or "WRONGPASS" in str(error):
                return False
            return is_retryable(error) if is_retryable else True

        return super().call_with_retry(do, fail, transient, with_failure_count)


class _RidingCluster(RedisCluster):
    """A cluster client whose every command rides through a master's restart.

    redis-py's cluster client retries a failed command ``retry.get_retries()`` times but
    without sleeping in between (it refreshes the slot table and tries again at once), so
    a master that takes a second to come back fails the command. This one wraps each
    command in a second retry with exponential backoff, as ``connect`` does on one server;
    transactions (``pipeline(transaction=True)``) already back off with the ``retry`` given.
    """

    def __init__(self, *args, **kwargs):
        self._backoff_retry = _TransientRetry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), CONNECT_RETRIES * 2,
                                              supported_errors=CLUSTER_ERRORS)
        super().__init__(*args, **kwargs)

    def _internal_execute_command(self, *args, **kwargs):
        return self._backoff_retry.call_with_retry(
            lambda: super(_RidingCluster, self)._internal_execute_command(*args, **dict(kwargs)), lambda error: None)


CLUSTER_ERRORS = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, SlotNotCoveredError)


def _connect_cluster(url: str, *, name: str, socket_timeout: float, extra: dict) -> RedisCluster:
    client = _RidingCluster.from_url(
        url, client_name=name, socket_timeout=socket_timeout, socket_connect_timeout=5,
        require_full_coverage=False,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), CONNECT_RETRIES,
                    supported_errors=CLUSTER_ERRORS),
        **extra)
    return client


def connect(url: str, *, name: str = "pipeline", socket_timeout: float = 30.0, redis_cfg=None) -> redis.Redis:
    """A client that retries with exponential backoff (up to ~10 s) when the server restarts.

    With ``redis_cfg.cluster`` it is a Redis Cluster client bootstrapped from the node at
    ``url``; its commands back off the same way while a master restarts (``_RidingCluster``).

    ``socket_timeout`` must exceed the longest ``BLOCK`` a caller uses, or redis-py
    reports a blocking read as a timeout. Credentials come from the URL
    (``redis://user:password@host``) or, to keep them out of config files, from the
    environment variables named by ``redis_cfg.username_env`` / ``password_env``.
    ``rediss://`` URLs use TLS, verified against ``redis_cfg.tls_ca_file`` (else the
    system CAs), with ``tls_cert_file``/``tls_key_file`` as the client certificate.
    """
    if not url:
        raise ValueError("redis.url: empty; pass --redis.url or set REDIS_URL")
    extra: dict = {}
    if redis_cfg is not None:
        user = os.environ.get(redis_cfg.username_env, "") if redis_cfg.username_env else ""
        password = os.environ.get(redis_cfg.password_env, "") if redis_cfg.password_env else ""
        parsed = urlparse(url)
        if password and not parsed.password:
            extra["password"] = password
            if user and not parsed.username:
                extra["username"] = user
        if url.startswith("rediss://"):
            for key, attr in (("ssl_ca_certs", "tls_ca_file"), ("ssl_certfile", "tls_cert_file"),
                              ("ssl_keyfile", "tls_key_file")):
                if getattr(redis_cfg, attr):
                    extra[key] = getattr(redis_cfg, attr)
    if redis_cfg is not None and redis_cfg.cluster:
        try:
            client = _connect_cluster(url, name=name, socket_timeout=socket_timeout, extra=extra)
            client.ping()
        except redis.RedisError as e:
            raise redis.ConnectionError(f"cannot reach the Redis Cluster at {_redact(url)}: {e}") from e
        return client
    client = redis.Redis.from_url(
        url,
        client_name=name,
        socket_timeout=socket_timeout,
        socket_connect_timeout=5,
        health_check_interval=30,
        retry=_TransientRetry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), CONNECT_RETRIES),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        **extra,
    )
    try:
        client.ping()
    except redis.AuthenticationError as e:
        raise redis.ConnectionError(f"Redis at {_redact(url)} refused the credentials: {e}") from e
    except redis.ResponseError as e:
        if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
            raise redis.ConnectionError(f"Redis at {_redact(url)} needs credentials: {e}") from e
        raise
    except redis.ConnectionError as e:
        raise redis.ConnectionError(
            f"cannot reach Redis at {_redact(url)} after {CONNECT_RETRIES} retries with backoff: {e}") from e
    return client


def _redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    p = urlparse(url)
    if not p.password:
        return url
    return p._replace(netloc=p.netloc.replace(f":{p.password}@", ":***@")).geturl()


def ensure_group(r: redis.Redis, stream: str, group: str) -> None:
    """Create the consumer group (and the stream) if missing; idempotent."""
    try:
        r.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def ensure_all_groups(r: redis.Redis, keys: Keys) -> None:
    for shard in keys.all_shards():
        for key, group in shard.streams().values():
            ensure_group(r, key, group)


@dataclass
class Entry:
    id: bytes
    payload: bytes | None
    """The record bytes; None if the entry was deleted or has no ``d`` field (a poison entry)."""
    deliveries: int = 1
    """How many times the group has delivered this entry (1 for a first delivery)."""
    shard: int = 0
    """The shard of the stream it was read from (``pipeline.keys``)."""

    @property
    def ref(self) -> str:
        """The entry's id, prefixed ``k/`` outside shard 0: unique across a stream's shards."""
        return self.id.decode() if not self.shard else f"{self.shard}/{self.id.decode()}"


def parse_ref(ref: str) -> tuple[int, str]:
    """``Entry.ref`` back to (shard, id)."""
    shard, sep, eid = ref.partition("/")
    return (int(shard), eid) if sep else (0, ref)


class GroupReader:
    """Reads one stream as a named consumer of a group, reclaiming what dead consumers held.

    ``read`` returns, in order of preference:

    1. this consumer's own pending entries (delivered before a crash, never acked),
       following a cursor so an entry held unacked is not returned twice;
    2. entries another consumer has held unacked for at least ``claim_idle_ms``
       (it died or hangs), taken over with ``XAUTOCLAIM``, whose cursor is followed
       across calls so a long pending list is swept in pages;
    3. entries never delivered to the group (``>``), blocking up to ``block_ms``.

    Redelivered entries carry their delivery count. One redelivered more than
    ``max_deliveries`` times crashed every consumer that took it (or the consumers keep
    dying): ``decode_entries`` turns it into a defect, and the caller dead-letters it.
    """

    def __init__(self, r: redis.Redis, stream: str, group: str, consumer: str, *,
                 claim_idle_ms: int = 30_000, max_deliveries: int = 5, claim_every_s: float = 1.0, shard: int = 0):
        self.r, self.stream, self.group, self.consumer = r, stream, group, consumer
        self.shard = shard
        self.claim_idle_ms, self.max_deliveries, self.claim_every_s = claim_idle_ms, max_deliveries, claim_every_s
        self._pending_cursor: bytes | str | None = "0"
        self._claim_cursor: bytes | str = "0-0"
        self._next_claim = 0.0
        self.claimed_total = 0

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
        return self._with_deliveries([Entry(i, f.get(FIELD) if f else None, shard=self.shard) for i, f in entries])

    def claim(self, count: int) -> list[Entry]:
        """Take over up to ``count`` entries idle in other consumers for ``claim_idle_ms`` or more.

        Sweeps the pending list with XAUTOCLAIM's cursor, at most once per
        ``claim_every_s`` while nothing is found, so an idle group costs one call a second.
        """
        now = time.monotonic()
        if self.claim_idle_ms <= 0 or now < self._next_claim:
            return []
        resp = self.r.xautoclaim(self.stream, self.group, self.consumer, self.claim_idle_ms,
                                 start_id=self._claim_cursor, count=count)
        self._claim_cursor = resp[0]
        entries = [Entry(i, f.get(FIELD) if f else None, shard=self.shard) for i, f in resp[1] if i is not None]
        if self._claim_cursor in (b"0-0", "0-0") and not entries:
            self._next_claim = now + self.claim_every_s
        self.claimed_total += len(entries)
        return self._with_deliveries(entries)

    def read_owned(self, count: int) -> list[Entry]:
        """Work already admitted to the group: own pending entries, else entries reclaimed from the dead."""
        return self.read_pending(count) or self.claim(count)

    def read_new(self, count: int, block_ms: int | None) -> list[Entry]:
        """Entries never delivered to the group, waiting up to ``block_ms`` for one (None: not at all)."""
        resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        entries = resp[0][1] if resp else []
        return [Entry(i, f.get(FIELD) if f else None, shard=self.shard) for i, f in entries]

    def read(self, count: int, block_ms: int) -> list[Entry]:
        """Own pending entries first, then reclaimed ones, then new ones."""
        return self.read_owned(count) or self.read_new(count, block_ms)

    def _with_deliveries(self, entries: list[Entry]) -> list[Entry]:
        if not entries:
            return entries
        counts = {p["message_id"]: int(p["times_delivered"]) for p in self.r.xpending_range(
            self.stream, self.group, min=entries[0].id, max=entries[-1].id, count=len(entries) * 4,
            consumername=self.consumer)}
        for e in entries:
            e.deliveries = counts.get(e.id, e.deliveries)
        return entries

    def over_limit(self, e: Entry) -> str | None:
        """The dead-letter reason for an entry delivered too many times, else None."""
        if e.deliveries > self.max_deliveries:
            return (f"delivered {e.deliveries} times without being acked (limit {self.max_deliveries}): "
                    "every consumer that took it died or failed on it")
        return None


class ShardedReader:
    """Reads every shard of one stream as one consumer: a ``GroupReader`` per shard.

    Each call returns entries of ONE shard (``Entry.shard``), so the caller's MULTI that
    writes downstream and acks upstream stays in that shard's slot. Shards are visited in
    turn, starting after the one that last gave work, so none starves. ``read_new`` first
    polls every shard without blocking, then blocks on one shard for a slice of
    ``block_ms`` (all of it with one shard, which behaves exactly like a ``GroupReader``).
    """

    def __init__(self, readers: list[GroupReader]):
        self.readers = readers
        self._next = 0

    @property
    def max_deliveries(self) -> int:
        return self.readers[0].max_deliveries

    @property
    def claimed_total(self) -> int:
        return sum(x.claimed_total for x in self.readers)

    def _turn(self) -> list[int]:
        n = len(self.readers)
        return [(self._next + i) % n for i in range(n)]

    def read_owned(self, count: int) -> list[Entry]:
        for k in self._turn():
            got = self.readers[k].read_owned(count)
            if got:
                self._next = (k + 1) % len(self.readers)
                return got
        return []

    def read_new(self, count: int, block_ms: int | None) -> list[Entry]:
        if len(self.readers) == 1:
            return self.readers[0].read_new(count, block_ms)
        for k in self._turn():
            got = self.readers[k].read_new(count, None)
            if got:
                self._next = (k + 1) % len(self.readers)
                return got
        if not block_ms:
            return []
        k = self._next
        self._next = (k + 1) % len(self.readers)
        return self.readers[k].read_new(count, max(10, block_ms // len(self.readers)))

    def read(self, count: int, block_ms: int) -> list[Entry]:
        """Own pending entries first, then reclaimed ones, then new ones (of one shard)."""
        return self.read_owned(count) or self.read_new(count, block_ms)

    def over_limit(self, e: Entry) -> str | None:
        return self.readers[e.shard].over_limit(e)


def group_reader(r: redis.Redis, stream: str, group: str, consumer: str, redis_cfg, *, claim: bool = True,
                 shard: int = 0) -> GroupReader:
    """A reader with the run's reclaim and delivery-limit settings (``RedisConfig``)."""
    return GroupReader(r, stream, group, consumer, max_deliveries=redis_cfg.max_deliveries,
                       claim_idle_ms=redis_cfg.claim_idle_ms if claim else 0, shard=shard)


def sharded_reader(r: redis.Redis, keys: Keys, stream: str, group: str, consumer: str, redis_cfg, *,
                   claim: bool = True) -> ShardedReader:
    """A reader of every shard of stream ``stream`` (prompts, rollouts or scored)."""
    return ShardedReader([group_reader(r, getattr(s, stream), group, consumer, redis_cfg, claim=claim, shard=s.index)
                          for s in keys.all_shards()])


def decode_entries(entries: list[Entry], decode, check=None, *, reader: GroupReader | ShardedReader | None = None,
                   ) -> tuple[list[tuple[Entry, object]], list[tuple[Entry, str]]]:
    """Split entries into ``(entry, record)`` pairs and ``(entry, reason)`` defects.

    ``decode`` is a record type's ``decode``; ``check(record)`` may raise RecordError
    for defects only the stage can see (a prompt length, a vocabulary size). With a
    ``reader``, an entry past its delivery limit is a defect before it is even decoded.
    """
    good, bad = [], []
    for e in entries:
        try:
            if reader is not None and (reason := reader.over_limit(e)):
                raise RecordError(reason)
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
) -> int:
    """Queue, on a MULTI pipeline, the move of one entry to its shard's dead letters and its ack.

    ``release_admission`` returns the group's admission slot (DESIGN §3) when the
    entry was admitted for generation but will never reach the trainer. Unsharded the
    release is part of the MULTI and 0 is returned; sharded, ``{ns}:admitted`` is in
    another slot, so the slots to give back are returned for ``release_admissions``
    to send once the MULTI is done (``pipeline.keys`` says what a crash between costs).
    """
    shard = keys.shard(entry.shard)
    pipe.xadd(shard.dead, {
        "reason": reason[:2000], "stream": stream, "id": entry.id, "consumer": consumer,
        "prompt_id": prompt_id, "payload": entry.payload or b"", "at": f"{time.time():.3f}",
    })
    pipe.xack(stream, group, entry.id)
    pipe.hincrby(shard.stats, "dead_letters_total", 1)
    if not release_admission:
        return 0
    if keys.sharded:
        return 1
    pipe.decr(keys.admitted)
    return 0


def release_admissions(r: redis.Redis, keys: Keys, n: int) -> None:
    """Give back ``n`` admission slots of dead-lettered groups (sharded runs; see ``dead_letter``)."""
    if n > 0:
        r.decrby(keys.admitted, n)


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


_local_stop = threading.Event()


def request_local_stop() -> None:
    """Ask this process's stage loop to finish its current batch and exit (the first SIGTERM)."""
    _local_stop.set()


def stop_requested(r: redis.Redis, keys: Keys) -> bool:
    """Whether this process was asked to stop (SIGTERM), or the whole run was (``{ns}:stop``)."""
    return _local_stop.is_set() or bool(r.exists(keys.stop))


LAG_COUNT_CAP = 100_000
"""Most entries ``group_lag`` counts one by one when the server has no lag figure."""


def group_lag(r: redis.Redis, stream: str, group_info: dict, *, cap: int = LAG_COUNT_CAP) -> int:
    """Entries of ``stream`` not yet delivered to the group described by ``group_info`` (XINFO GROUPS).

    The server's own ``lag`` is used when it has one. After it replays its append-only
    file (a restart) the server no longer knows how many entries a group has read and
    reports no lag; the entries past the group's last-delivered id are then counted,
    up to ``cap`` (a caller that only compares with a bound passes bound + 1).
    """
    lag = group_info.get("lag")
    if lag is not None:
        return int(lag)
    last = group_info["last-delivered-id"]
    last = last.decode() if isinstance(last, bytes) else last
    n, start = 0, "(" + last
    while n < cap:
        want = min(1000, cap - n)
        page = r.xrange(stream, min=start, max="+", count=want)
        n += len(page)
        if len(page) < want:
            break
        start = "(" + page[-1][0].decode()
    return n


def unacked(r: redis.Redis, stream: str, group: str, *, cap: int = LAG_COUNT_CAP) -> int:
    """Entries of ``stream`` its group has not acked yet: never delivered (lag) plus pending."""
    try:
        for g in r.xinfo_groups(stream):
            if g["name"].decode() == group:
                return int(g["pending"]) + group_lag(r, stream, g, cap=cap)
    except redis.ResponseError:
        pass  # the stream does not exist yet
    return 0


def unacked_all(r: redis.Redis, streams: str | list[str], group: str, *, cap: int = LAG_COUNT_CAP) -> int:
    """``unacked`` summed over a stream's shards (a list of keys), stopping once past ``cap``."""
    total = 0
    for key in [streams] if isinstance(streams, str) else streams:
        total += unacked(r, key, group, cap=max(1, cap - total))
        if total >= cap:
            break
    return total


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


def _next_id(entry_id: bytes | str) -> str:
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def trim_acked(r: redis.Redis, stream: str) -> int:
    """Remove the entries every consumer group of ``stream`` has acked; returns how many went.

    The floor is, over all groups, the oldest pending entry and the first entry not yet
    delivered; ``XTRIM MINID`` removes only entries strictly below it, so nothing a
    group still needs (pending or never delivered) is ever trimmed. A stream without
    groups is left alone.
    """
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:
        return 0
    if not groups:
        return 0
    floor: tuple[int, int] | None = None
    for g in groups:
        summary = r.xpending(stream, g["name"])
        if summary["pending"]:
            cand = summary["min"]
        else:
            cand = _next_id(g["last-delivered-id"])
        key = tuple(int(x) for x in (cand.decode() if isinstance(cand, bytes) else cand).split("-"))
        floor = key if floor is None or key < floor else floor
    return int(r.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=False))


def heartbeat(r: redis.Redis, keys: Keys, worker_id: str, stage: str, state: str, **extra) -> None:
    r.hset(keys.workers, worker_id, json.dumps(
        {"stage": stage, "pid": os.getpid(), "state": state, "at": time.time(), **extra}))


def incr_stats(pipe: redis.Redis | redis.client.Pipeline, keys: Keys | ShardKeys, **counts: float) -> None:
    """Add to the counters of ``keys`` (a shard's, so the increments join that shard's MULTI)."""
    for name, n in counts.items():
        if n:
            if isinstance(n, float) and not n.is_integer():
                pipe.hincrbyfloat(keys.stats, name, n)
            else:
                pipe.hincrby(keys.stats, name, int(n))


MAX_STATS = frozenset({"prompts_issued"})
"""Counters that are positions, not sums: merged over shards by their maximum."""


def merge_stats(rows: list[dict[str, float]]) -> dict[str, float]:
    """Shards' counters as one: sums, except ``MAX_STATS`` (maximum)."""
    out: dict[str, float] = {}
    for row in rows:
        for k, v in row.items():
            out[k] = max(out.get(k, v), v) if k in MAX_STATS else out.get(k, 0.0) + v
    return out


def read_stats(r: redis.Redis, keys: Keys) -> dict[str, float]:
    """The run's counters, summed over shards."""
    return merge_stats([{k.decode(): float(v) for k, v in r.hgetall(s.stats).items()} for s in keys.all_shards()])


def queue_depths(r: redis.Redis, keys: Keys, *, lag_cap: int = LAG_COUNT_CAP) -> dict[str, dict[str, int]]:
    """Per stream: length, entries not yet delivered to its group (lag), delivered but unacked (pending),
    each summed over the stream's shards."""
    out: dict[str, dict[str, int]] = {}
    for shard in keys.all_shards():
        for name, (key, group) in shard.streams().items():
            row = out.setdefault(name, {"length": 0, "lag": 0, "pending": 0})
            row["length"] += int(r.xlen(key))
            try:
                for g in r.xinfo_groups(key):
                    if g["name"].decode() == group:
                        row["pending"] += int(g["pending"])
                        row["lag"] += group_lag(r, key, g, cap=lag_cap)
            except redis.ResponseError:
                pass  # stream not created yet
    out["dead"] = {"length": sum(int(r.xlen(s.dead)) for s in keys.all_shards()), "lag": 0, "pending": 0}
    return out
