"""Flow control between stages: admission (the staleness bound), version wake-ups,
the stop flag, and backpressure on a stream's unacked entries.
"""

from __future__ import annotations

import threading
import time

import redis

from pipeline.bus.stats import heartbeat
from pipeline.bus.streams import Entry, ShardedReader, TxnWriter, payload_of, txn_script, unacked_all
from pipeline.keys import Keys


# Admission (docs/design.md §3, AReaL's rule): groups admitted so far must stay below
# (η + v + 1)·B. Granting and counting happen in one script so concurrent generators
# never overshoot. Every change of {ns}:admitted carries its writer's idempotency token
# (bus.streams.TxnWriter) checked in the same script, in the {ns} slot, so a call redis-py
# sends again after a lost reply neither grants twice nor gives back twice.
# KEYS: admitted, admitted:txn.  ARGV: want, bound (Admission.bound), writer id, seq.  Returns the grant.
_ADMIT = """
local seen = txn_seen(KEYS[2], ARGV[3], ARGV[4])
if seen then return tonumber(seen) end
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local grant = math.min(tonumber(ARGV[1]), tonumber(ARGV[2]) - cur)
if grant <= 0 then return 0 end
redis.call('INCRBY', KEYS[1], grant)
txn_done(KEYS[2], ARGV[3], ARGV[4], grant)
return grant
"""
# KEYS: admitted, admitted:txn.  ARGV: n, writer id, seq.  Returns 1 if applied, 0 for a replay.
_RELEASE = """
if txn_seen(KEYS[2], ARGV[2], ARGV[3]) then return 0 end
redis.call('DECRBY', KEYS[1], ARGV[1])
txn_done(KEYS[2], ARGV[2], ARGV[3], ARGV[1])
return 1
"""


# One server (not a Redis Cluster): the grant and the read of the prompts it grants, in one
# script, so a generator killed at any point leaks no slot; only what was read is counted.
# KEYS: admitted, admitted:txn, then the prompt stream of every shard in the order to visit.
# ARGV: want, bound, writer id, seq, group, consumer.
# Reads from the first shard that has new prompts only (a stage's transaction stays in one
# shard). Returns {room, shard index, id, fields, id, fields, ...}: room 0 means admission
# is full; a replay returns {-1} (what it read is in the consumer's pending list).
_ADMIT_READ = """
if txn_seen(KEYS[2], ARGV[3], ARGV[4]) then return {-1} end
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local room = math.min(tonumber(ARGV[1]), tonumber(ARGV[2]) - cur)
if room <= 0 then return {0} end
local out, got = {room}, 0
for i = 3, #KEYS do
  local resp = redis.call('XREADGROUP', 'GROUP', ARGV[5], ARGV[6], 'COUNT', room, 'STREAMS', KEYS[i], '>')
  if resp and #resp[1][2] > 0 then
    out[2] = i - 3
    for _, e in ipairs(resp[1][2]) do
      out[#out + 1] = e[1]
      out[#out + 1] = e[2]
      got = got + 1
    end
    break
  end
end
if got > 0 then redis.call('INCRBY', KEYS[1], got) end
txn_done(KEYS[2], ARGV[3], ARGV[4], got)
return out
"""


def release_admissions(r: redis.Redis, keys: Keys, n: int, *, writer: TxnWriter, script=None) -> bool:
    """Give back ``n`` admission slots (of dead-lettered groups, or granted but unused), exactly once.

    ``{ns}:admitted`` lives outside a shard's slot, so this is its own script, sent right
    after the shard's transaction (``pipeline.keys`` says what a crash between the two
    costs). Returns whether it was applied (False: nothing to give back, or a replay).
    """
    if n <= 0:
        return False
    script = script or txn_script(r, _RELEASE)
    with writer.token() as seq:
        return bool(script(keys=[keys.admitted, keys.admitted_txn], args=[n, writer.id, seq]))


def release_once(r: redis.Redis, keys: Keys, n: int, *, writer_id: str, seq: int) -> bool:
    """Give back ``n`` slots under a token the caller keeps across restarts (``writer_id``, and
    ``seq`` rising, e.g. a trainer step's version): applied once however often it is sent."""
    if n <= 0:
        return False
    return bool(txn_script(r, _RELEASE)(keys=[keys.admitted, keys.admitted_txn], args=[n, writer_id, seq]))


class Admission:
    def __init__(self, r: redis.Redis, keys: Keys, *, max_staleness: int, groups_per_step: int,
                 writer: TxnWriter | None = None):
        self.r, self.keys = r, keys
        self.max_staleness, self.groups_per_step = max_staleness, groups_per_step
        self.writer = writer or TxnWriter("admission")
        self._admit = txn_script(r, _ADMIT)
        self._release = txn_script(r, _RELEASE)
        self._admit_read = txn_script(r, _ADMIT_READ)

    def bound(self, version: int) -> int:
        """How many groups may have been admitted in all while the generators run ``version``:
        (trainer.max_staleness + version + 1) x trainer.groups_per_step, the staleness bound
        (docs/design.md) as a count the admission script compares ``{ns}:admitted`` with."""
        return (self.max_staleness + version + 1) * self.groups_per_step

    def admit(self, want: int, version: int) -> int:
        """Admit up to ``want`` new groups for a generator running ``version``; returns how many."""
        with self.writer.token() as seq:
            return int(self._admit(keys=[self.keys.admitted, self.keys.admitted_txn],
                                   args=[want, self.bound(version), self.writer.id, seq]))

    def release(self, n: int) -> None:
        """Give back slots admitted but not used (no prompt was available)."""
        release_admissions(self.r, self.keys, n, writer=self.writer, script=self._release)

    def admit_read(self, reader: ShardedReader, want: int, version: int) -> tuple[bool, list[Entry]]:
        """Up to ``want`` new prompts, admitted and read in one script: (whether admission had
        room, the entries read, all of one shard's or several). Only what is read is counted,
        so a generator killed at any point leaks no slot. On one server only: in a Redis
        Cluster ``{ns}:admitted`` and the prompt streams live in different slots, so it is
        ``admit``, then a read, then ``release`` of what was not read (a generator killed
        between the grant and the give-back leaks those slots until the run ends: admission
        stricter, never looser)."""
        order = reader._turn()
        with self.writer.token() as seq:
            resp = self._admit_read(
                keys=[self.keys.admitted, self.keys.admitted_txn, *(reader.readers[k].stream for k in order)],
                args=[want, self.bound(version), self.writer.id, seq, reader.readers[0].group,
                      reader.readers[0].consumer])
        room = int(resp[0])
        if room == -1:  # a replay: the first attempt's entries are this consumer's pending ones
            for k in order:
                reader.readers[k]._pending_cursor = "0"
            return True, []
        if len(resp) < 2:
            return room > 0, []
        shard = order[int(resp[1])]
        entries = []
        for i in range(2, len(resp), 2):
            entries.append(Entry(resp[i], payload_of(resp[i + 1]), shard=shard))
        reader._next = (shard + 1) % len(reader.readers)
        return True, reader.readers[shard].note(entries)


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


class NewestVersion:
    """The newest policy version the trainer has published (``{ns}:weights`` ``version``), read
    again only when a record claims a newer one than last read: a check per record
    (``records.check_versions``) that costs a round trip only for a record that may be forged."""

    def __init__(self, r: redis.Redis, keys: Keys):
        self.r, self.key, self.known = r, keys.weights, -1

    def __call__(self, claimed: int) -> int:
        if claimed > self.known:
            self.known = max(self.known, int(self.r.hget(self.key, "version") or -1))
        return self.known


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
