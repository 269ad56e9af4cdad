"""Durable streams: consumer groups, readers that reclaim a dead consumer's entries,
decoding with dead letters, lag and unacked counts, and trimming what every group acked.

Every stream entry has one field, ``d``, holding an encoded record (``pipeline.records``).
A run's streams are sharded (``pipeline.keys``; one shard is the ordinary case):
``ShardedReader`` reads all shards of one stream, one shard per call.

Every transaction that writes a stage's outputs is a Lua script that carries an idempotency
token and checks it before writing (``TxnWriter``), so a call redis-py sends again after a
lost reply changes nothing. A read is not idempotent (it delivers entries to its consumer):
``GroupReader`` finds entries a lost reply delivered to it and returns them after all.
"""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.exceptions import RedisError

from pipeline.bus.connection import failed_calls
from pipeline.keys import Keys
from pipeline.records import RecordError


FIELD = b"d"
LOST_SCAN = 1000
"""Most lost deliveries one look finds (``GroupReader._find_lost``); a next look finds the rest."""


def payload_of(flat) -> bytes | None:
    """An entry's ``FIELD`` from its fields as a raw reply gives them, a flat [name, value, ...]
    list (a script's reply, a read sent on a connection of its own); None: a deleted entry, or
    no such field (a poison entry)."""
    if not flat:
        return None
    if len(flat) == 2:
        return flat[1] if flat[0] == FIELD else None
    return dict(zip(flat[::2], flat[1::2])).get(FIELD)


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


@dataclass(slots=True)
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

    A read of new entries whose reply is lost (the server died after recording the
    delivery, or the connection dropped) leaves entries pending for this consumer that it
    never saw, and redis-py sends the read again, which gets the next ones. Left alone they
    would wait for a restart of this consumer or a reclaim (never, for a group's only
    consumer, which does not reclaim). The group delivers in id order, so they are newer
    than any entry this reader returned before that read: after a read during which the
    client's calls failed (``failed_calls``), the reader lists its own pending entries newer
    than that, takes those the read did not return again (``XCLAIM``, which counts the
    delivery) and returns them first from the next read. Entries the caller still holds
    unacked are older: never among them.
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
        self._newest: tuple[int, int] | None = None
        """The newest entry id this reader returned (``note``), as (ms, seq)."""
        self._lost: list[Entry] = []
        """Lost deliveries found and not yet returned (``_find_lost``)."""
        self.recovered_total = 0
        """Lost deliveries found and returned again."""

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
        return self.note(self._with_deliveries(self._entries(entries)))

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
        entries = self._entries(resp[1])
        if self._claim_cursor in (b"0-0", "0-0") and not entries:
            self._next_claim = now + self.claim_every_s
        self.claimed_total += len(entries)
        return self.note(self._with_deliveries(entries))

    def read_owned(self, count: int) -> list[Entry]:
        """Work already admitted to the group: lost deliveries found, own pending entries, else
        entries reclaimed from the dead."""
        if self._lost:
            entries, self._lost = self._lost[:count], self._lost[count:]
            return entries
        return self.read_pending(count) or self.claim(count)

    def read_new(self, count: int, block_ms: int | None) -> list[Entry]:
        """Entries never delivered to the group, waiting up to ``block_ms`` for one (None: not at all).

        A call that failed and was sent again may have lost the reply of its first attempt:
        deliveries found lost come first from the next ``read_owned``.
        """
        failed, newest = failed_calls(self.r), self._newest
        resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        entries = self.note(self._entries(resp[0][1])) if resp else []
        if failed_calls(self.r) != failed:
            self._find_lost(newest, {e.id for e in entries})
        return entries

    def _find_lost(self, newest: tuple[int, int] | None, returned: set[bytes]) -> None:
        """Queue this consumer's pending entries newer than ``newest`` (the newest returned before
        the read) that the read did not return: deliveries whose reply was lost."""
        lo = "-" if newest is None else f"({newest[0]}-{newest[1]}"
        pending = self.r.xpending_range(self.stream, self.group, min=lo, max="+", count=LOST_SCAN,
                                        consumername=self.consumer)
        ids = [p["message_id"] for p in pending if p["message_id"] not in returned]
        if not ids:
            return
        found = self.note(self._with_deliveries(self._entries(
            self.r.xclaim(self.stream, self.group, self.consumer, 0, ids))))
        self.recovered_total += len(found)
        self._lost += found

    def note(self, entries: list[Entry]) -> list[Entry]:
        """Note the newest id among entries handed to the caller (``_find_lost`` looks past it);
        a caller that reads this reader's stream another way (a script) notes what it read.
        Every read returns entries in id order: the last is the newest."""
        if entries:
            ms, _, seq = entries[-1].id.partition(b"-")
            key = (int(ms), int(seq))
            if self._newest is None or key > self._newest:
                self._newest = key
        return entries

    def _entries(self, pairs) -> list[Entry]:
        """Entries of this reader's shard from a reply's (id, fields) pairs; a deleted entry has no fields."""
        shard = self.shard
        return [Entry(i, f.get(FIELD) if f else None, 1, shard) for i, f in pairs if i is not None]

    @property
    def newest(self) -> tuple[int, int] | None:
        """The newest entry id this reader returned, as (ms, seq): the mark ``recover_lost`` takes."""
        return self._newest

    def send_read_new(self, conn, count: int) -> None:
        """Send on ``conn`` (a connection of this reader's client's pool, held by the caller) the
        non-blocking read of up to ``count`` new entries, without waiting for its reply: the
        caller reads it later (``receive_new``) while it works on what it holds (read ahead).
        Take ``newest`` first: if the reply never comes, ``recover_lost`` needs it."""
        conn.send_command("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count, "STREAMS", self.stream,
                          ">")

    def receive_new(self, resp) -> list[Entry]:
        """The entries of the raw reply (a RESP3 map or a RESP2 array; none: nothing new) of a read
        ``send_read_new`` sent."""
        if not resp:
            return []
        pairs = next(iter(resp.values())) if isinstance(resp, dict) else resp[0][1]
        shard = self.shard
        return self.note([Entry(i, payload_of(f), 1, shard) for i, f in pairs if i is not None])

    def recover_lost(self, mark: tuple[int, int] | None) -> int:
        """After a read sent with ``send_read_new`` whose reply never came (its connection failed):
        take back what it may have delivered (``_find_lost``, past ``mark``: ``newest`` before
        it was sent), for the next ``read_owned``; returns how many entries were found."""
        before = self.recovered_total
        self._find_lost(mark, set())
        return self.recovered_total - before

    @property
    def owned_due(self) -> bool:
        """Whether the next ``read`` may find owned work: own pending entries not yet drained, or a
        reclaim sweep due. While it is not, the next read is a read of new entries."""
        return bool(self._lost) or self._pending_cursor is not None or (
            self.claim_idle_ms > 0 and time.monotonic() >= self._next_claim)

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

    @property
    def delivery_floor(self) -> int:
        """An entry delivered at most this many times is never over the limit (``decode_entries``)."""
        return self.max_deliveries

    def over_limit(self, e: Entry) -> str | None:
        """The dead-letter reason for an entry delivered too many times, else None."""
        if e.deliveries > self.max_deliveries:
            return (f"delivered {e.deliveries} times without being acked (limit {self.max_deliveries}): "
                    "every consumer that took it died or failed on it")
        return None


class ShardedReader:
    """Reads every shard of one stream as one consumer: a ``GroupReader`` per shard.

    Each call returns entries of ONE shard (``Entry.shard``), so the caller's transaction that
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

    @property
    def recovered_total(self) -> int:
        return sum(x.recovered_total for x in self.readers)

    @property
    def lost_waiting(self) -> int:
        """Lost deliveries found and not yet returned (``GroupReader``: the next ``read_owned`` returns them)."""
        return sum(len(x._lost) for x in self.readers)

    @property
    def delivery_floor(self) -> int:
        """The lowest delivery limit of the shards' readers."""
        return min(x.max_deliveries for x in self.readers)

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

    @property
    def owned_due(self) -> bool:
        return any(x.owned_due for x in self.readers)

    def next_new(self) -> GroupReader:
        """The shard reader whose turn it is to be read for new entries; taking it moves the turn on."""
        k = self._next
        self._next = (k + 1) % len(self.readers)
        return self.readers[k]

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
    # Only an entry delivered more often than the lowest limit can be over its shard's limit.
    over, floor = (None, 0) if reader is None else (reader.over_limit, reader.delivery_floor)
    for e in entries:
        try:
            if over is not None and e.deliveries > floor and (reason := over(e)):
                raise RecordError(reason)
            if e.payload is None:
                raise RecordError("entry has no payload field")
            record = decode(e.payload)
            if check is not None:
                check(record)
            good.append((e, record))
        except RecordError as err:
            bad.append((e, str(err)))
        except (RedisError, OSError, MemoryError):
            raise  # the stage's own state, not the entry's: the caller fails as it would anywhere
        except Exception as err:  # noqa: BLE001 - a bug a record triggers is that record's defect
            bad.append((e, f"check failed: {failure_summary(err)}"))
    return good, bad


def failure_summary(err: BaseException, frames: int = 3) -> str:
    """An exception in one line for a dead letter: its type and message, then the innermost
    ``frames`` frames of its traceback (``file:line function``), innermost first."""
    tb = traceback.extract_tb(err.__traceback__)[-frames:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(tb))
    return f"{type(err).__name__}: {err}" + (f" (at {where})" if where else "")


def dead_letter_fields(*, stream: str, entry: Entry, reason: str, consumer: str, prompt_id: str = "") -> list:
    """The fields of one entry's dead letter, as XADD's field/value list (``Stage.emit`` writes it
    into the entry's shard's ``dead`` stream, acking the entry in the same transaction)."""
    return ["reason", reason[:2000], "stream", stream, "id", entry.id, "consumer", consumer,
            "prompt_id", prompt_id, "payload", entry.payload or b"", "at", f"{time.time():.3f}"]


# ---------------------------------------------------------------- idempotent transactions

TXN_LUA = """
local function txn_seen(txn, writer, seq)
  local last = redis.call('HGET', txn, writer)
  if not last then return nil end
  local sp = string.find(last, ' ', 1, true)
  if tonumber(string.sub(last, 1, sp - 1)) >= tonumber(seq) then return string.sub(last, sp + 1) end
  return nil
end
local function txn_done(txn, writer, seq, result)
  redis.call('HSET', txn, writer, seq .. ' ' .. result)
end
local function add_counters(stats, i, n)
  for _ = 1, n do
    if ARGV[i + 1] == 'f' then
      redis.call('HINCRBYFLOAT', stats, ARGV[i], ARGV[i + 2])
    else
      redis.call('HINCRBY', stats, ARGV[i], ARGV[i + 2])
    end
    i = i + 3
  end
  return i
end
"""
"""Lua every idempotent transaction starts with. ``txn_seen(txn, writer, seq)``: the result the
writer's transaction ``seq`` (or a later one) recorded in the hash ``txn``, or nil if it was
never applied; ``txn_done`` records it, in the same script as the writes. ``add_counters``
applies ``n`` counters of ARGV from index ``i`` (``counter_args``) and returns the next index."""


def txn_script(r: redis.Redis, body: str):
    """``r.register_script`` of ``body`` after ``TXN_LUA``: one EVALSHA per call, loaded on first use."""
    return r.register_script(TXN_LUA + body)


class TxnWriter:
    """The idempotency token of one writer's transactions: an id made once, a number that only goes up.

    A transaction takes its number before its first attempt (``token``) and is applied by a
    script that starts with ``txn_seen``: a number at or below the one recorded for this
    writer in the slot's txn hash (``ShardKeys.txn``, ``Keys.admitted_txn``) was applied already, so
    the script changes nothing and returns the first application's result; otherwise it
    applies the writes and records the number with ``txn_done``, atomically. redis-py
    sending a call again after a lost reply (its retry) therefore changes nothing, however
    long the outage in between: the record has no TTL to outlive. A writer's calls run one
    at a time (the lock is held through the call), so its numbers are applied in order.
    """

    def __init__(self, label: str):
        self.id = f"{label}:{uuid.uuid4().hex[:12]}"
        self._seq = 0
        self._lock = threading.Lock()

    @contextmanager
    def token(self):
        """The next number, held (with the writer's lock) while the caller's script runs."""
        with self._lock:
            self._seq += 1
            yield self._seq


def counter_args(counts: dict[str, float]) -> list:
    """Counters as script arguments, (name, kind, value) each: ``i`` adds with HINCRBY, ``f``
    with HINCRBYFLOAT (a fractional value), zeros left out (as ``bus.stats.incr_stats`` does)."""
    out: list = []
    for name, n in counts.items():
        if n:
            if isinstance(n, float) and not n.is_integer():
                out += [name, "f", repr(n)]
            else:
                out += [name, "i", int(n)]
    return out


LAG_COUNT_CAP = 100_000
"""Most entries ``group_lag`` counts one by one when the server has no lag figure."""


# A group that has been delivered every entry has no lag, whatever the server's counter says.
# KEYS: the stream.  ARGV: the group.  If the group's last-delivered id is the stream's last
# id and its entries-read differs from entries-added, sets entries-read right (XGROUP SETID
# to the same id: nothing is redelivered), all in one script so no read can slip in between.
# Returns 1 if it repaired the counter.
_REPAIR_LAG = """
local function field(flat, name)
  for i = 1, #flat, 2 do if flat[i] == name then return flat[i + 1] end end
  return nil
end
local stream = redis.call('XINFO', 'STREAM', KEYS[1])
local last, added = field(stream, 'last-generated-id'), field(stream, 'entries-added')
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  if field(g, 'name') == ARGV[1] then
    if field(g, 'last-delivered-id') == last and field(g, 'entries-read') ~= added then
      redis.call('XGROUP', 'SETID', KEYS[1], ARGV[1], last, 'ENTRIESREAD', added)
      return 1
    end
    return 0
  end
end
return 0
"""


def group_lag(r: redis.Redis, stream: str, group_info: dict, *, cap: int = LAG_COUNT_CAP) -> int:
    """Entries of ``stream`` not yet delivered to the group described by ``group_info`` (XINFO GROUPS).

    The server's own ``lag`` is used when it has one and the stream holds an entry past the
    group's last-delivered id. After the server replays its append-only file (a restart) its
    count of what a group has read can be lost (no lag reported) or wrong: Redis 7.0 was seen
    reporting a lag of 3072 for a group that had been delivered every entry, which kept the
    feeder's backlog "full" forever. A group at the stream's end therefore has lag 0, and its
    counter is set right (``_REPAIR_LAG``); without a server figure the entries past the
    last-delivered id are counted, up to ``cap`` (a caller that only compares with a bound
    passes bound + 1).
    """
    lag = group_info.get("lag")
    last = group_info["last-delivered-id"]
    last = last.decode() if isinstance(last, bytes) else last
    if lag is not None:
        if int(lag) == 0:
            return 0
        newest = r.xrevrange(stream, count=1)
        newest_id = newest[0][0].decode() if newest and isinstance(newest[0][0], bytes) else (newest[0][0] if newest else None)
        if newest_id is not None and newest_id != last:
            return int(lag)
        name = group_info["name"].decode() if isinstance(group_info["name"], bytes) else group_info["name"]
        r.register_script(_REPAIR_LAG)(keys=[stream], args=[name])
        return 0
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


# What ``trim_acked`` removes, in one round trip. KEYS: the stream. Returns how many went.
# Ids are compared and stepped as decimal strings (their sequence part may exceed a Lua
# number's 53 exact bits): without leading zeros, a shorter string is a smaller number.
_TRIM_ACKED = """
local function field(flat, name)
  for i = 1, #flat, 2 do if flat[i] == name then return flat[i + 1] end end
  return nil
end
local function split(id)
  local dash = string.find(id, '-', 1, true)
  if not dash then return id, '' end
  return string.sub(id, 1, dash - 1), string.sub(id, dash + 1)
end
local function plus_one(s)
  local i = #s
  while i > 0 and string.sub(s, i, i) == '9' do i = i - 1 end
  if i == 0 then return '1' .. string.rep('0', #s) end
  return string.sub(s, 1, i - 1) .. string.char(string.byte(s, i) + 1) .. string.rep('0', #s - i)
end
local function below(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local groups = redis.pcall('XINFO', 'GROUPS', KEYS[1])
if type(groups) ~= 'table' or groups.err or #groups == 0 then return 0 end
local floor_ms, floor_seq
for _, g in ipairs(groups) do
  local ms, seq
  local summary = redis.call('XPENDING', KEYS[1], field(g, 'name'))
  if summary[1] > 0 then
    ms, seq = split(summary[2])
  else
    ms, seq = split(field(g, 'last-delivered-id'))
    if seq == '' then seq = '0' end
    seq = plus_one(seq)
  end
  if not floor_ms or below(ms, floor_ms) or ms == floor_ms and below(seq, floor_seq) then
    floor_ms, floor_seq = ms, seq
  end
end
return redis.call('XTRIM', KEYS[1], 'MINID', floor_ms .. '-' .. floor_seq)
"""


def trim_acked(r: redis.Redis, stream: str) -> int:
    """Remove the entries every consumer group of ``stream`` has acked; returns how many went.

    The floor is, over all groups, the oldest pending entry and the first entry not yet
    delivered; ``XTRIM MINID`` removes only entries strictly below it, so nothing a
    group still needs (pending or never delivered) is ever trimmed. A stream without
    groups (or no stream) is left alone. One script: one round trip, and no read of the
    groups can slip in between.
    """
    return int(r.register_script(_TRIM_ACKED)(keys=[stream]))
