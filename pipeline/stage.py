"""A stream stage's plumbing (claim, decode and check, emit + ack, trim) and the loop two stages run on it.

A stage reads one stream (every shard of it) as a consumer of its group and, per read:

1. **claim**: its own unacked entries first (left from before a restart), then entries a
   dead consumer held for ``redis.claim_idle_ms``, then new ones (``bus.streams``);
2. **decode and check**: each entry becomes a record, or a defect with its reason
   (undecodable, refused by the stage's own check, delivered too often);
3. **process**: the stage's own step turns the records into outputs;
4. **emit + ack**: ONE transaction in the read shard's slot (the ``_EMIT`` Lua script; a
   MULTI/EXEC instead when the records written come to ``MULTI_BYTES`` or more) writes the
   outputs downstream, acks their inputs, dead-letters the defects and adds the counters,
   so an output is never written without its input acked, nor an input acked without its
   output; it checks its idempotency token first (``bus.streams.TxnWriter``), so a call
   redis-py sends again after a lost reply changes nothing. Admission slots of
   dead-lettered groups are given back right after, idempotently too;
5. **trim**: every ``TRIM_EVERY`` batches, what every group of the input stream acked.

Before each read the stage waits while its output stream holds more than
``redis.max_stream_lag`` unacked entries (backpressure). A stage's client waits out a
server outage of any length (``bus.connection.ride_outages``), logging when it starts and
when it ends.

Who runs what. The verifier and the batch generator (``generator.swap = "batch"``) are a step
function plugged into :meth:`Stage.run`, this loop. Two stream stages drive the same plumbing
(``read``, ``take``, ``emit``, ``trim``) from loops of their own, because a turn of theirs is
not one read: the trainer (``consumers.trainer.Trainer.run``) gathers ``groups_per_step``
groups over several reads and keeps them unacked until a checkpoint holds the step (its
commit acks them, not the emit); the streaming generator (``producers.generator.Streamer.run``,
``generator.swap = "step" | "drain"``) turns once per decode step over its slots, reads only
when slots are free and emits each group as it finishes. The feeder and the eval worker read
no stream and have no Stage: the feeder writes the task's problems (``producers.feeder``), the
eval worker follows ``{ns}:versions`` (``consumers.evaluator``). ``pipeline.api.Queue`` reads
through a Stage too (its dead letters go by ``emit``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.bus.connection import ride_outages
from pipeline.bus.flow import release_admissions, stop_requested, wait_for_room
from pipeline.bus.stats import heartbeat
from pipeline.bus.streams import Entry, TxnWriter, counter_args, dead_letter_fields, decode_entries, \
    ensure_all_groups, failure_summary, sharded_reader, trim_acked, txn_script
from pipeline.keys import Keys, ShardKeys

TRIM_EVERY = 10
"""Batches between trims of the acked input entries."""

READ_AHEAD_STEP_S = 0.05
"""A stage that reads ahead (``prefetch``) does so while its last step took less than this:
the batch read ahead waits in its pending list through one step, so a slow stage (an LLM
judge) never holds a batch its peers could be working on."""

_LINK_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)

STAGE_ERRORS = (RedisError, OSError, MemoryError)
"""Failures of the stage's own state (its server, its files, its memory), not of the entries in
hand: they end the step and the process as they would anywhere. Any other exception a step
raises is put down to its entries (``Stage.isolate``)."""

MULTI_BYTES = 64 << 10
"""Records written in one emit from this many bytes on go in a MULTI (``Stage._emit_multi``)
rather than the script: a script copies every argument into Lua (about a millisecond per MB),
a MULTI passes the records to the server's commands as they are, for two more round trips."""

# Emit + ack (docs/design.md §2, step 4): one script in the read shard's slot.
# KEYS: source stream, sink stream, dead letters, stats, txn.
# ARGV: writer id, seq (the TxnWriter token), group; n dead letters, then per dead letter:
#       entry id, n fields, fields... (each gives its admission slot back: every stage's
#       inputs descend from an admitted prompt);
#       n entries to ack, then their ids; n outputs, then the outputs (written in order, in
#       the field ``d``, bus.streams.FIELD);
#       n entries to hand back, then per entry: id, the record that replaces it (written to
#       the source stream: unfinished work a stopping stage returns; its admission slot is
#       given back, as the next reader is admitted anew);
#       n counters, then (name, kind, value) each (bus.streams.counter_args).
# Each part's entries are acked with one variadic XACK (per ACK_CHUNK ids: unpack's limit).
# Returns {applied (0: a replay, nothing changed), admission slots to give back}.
_EMIT = """
local seen = txn_seen(KEYS[5], ARGV[1], ARGV[2])
if seen then return {0, tonumber(seen)} end
local group, i = ARGV[3], 5
local ACK_CHUNK = 1000
local function ack(ids, first, last)
  for s = first, last, ACK_CHUNK do
    redis.call('XACK', KEYS[1], group, unpack(ids, s, math.min(s + ACK_CHUNK - 1, last)))
  end
end
local ndead = tonumber(ARGV[4])
local dead_ids = {}
for k = 1, ndead do
  local nf = tonumber(ARGV[i + 1])
  redis.call('XADD', KEYS[3], '*', unpack(ARGV, i + 2, i + 1 + nf))
  dead_ids[k] = ARGV[i]
  i = i + 2 + nf
end
ack(dead_ids, 1, ndead)
if ndead > 0 then redis.call('HINCRBY', KEYS[4], 'dead_letters_total', ndead) end
local nw = tonumber(ARGV[i])
local first_id = i + 1
i = first_id + nw
local nout = tonumber(ARGV[i])
for k = i + 1, i + nout do
  redis.call('XADD', KEYS[2], '*', 'd', ARGV[k])
end
ack(ARGV, first_id, first_id + nw - 1)
i = i + 1 + nout
local nback = tonumber(ARGV[i])
i = i + 1
local back_ids = {}
for k = 1, nback do
  redis.call('XADD', KEYS[1], '*', 'd', ARGV[i + 1])
  back_ids[k] = ARGV[i]
  i = i + 2
end
ack(back_ids, 1, nback)
add_counters(KEYS[4], i + 1, tonumber(ARGV[i]))
local releases = ndead + nback
txn_done(KEYS[5], ARGV[1], ARGV[2], releases)
return {1, releases}
"""


@dataclass
class Batch:
    """One read: entries of one shard, split into decoded records and defects."""

    shard: ShardKeys
    good: list[tuple[Entry, Any]]
    bad: list[tuple[Entry, str]]

    @property
    def records(self) -> list[Any]:
        return [rec for _, rec in self.good]


@dataclass
class Output:
    """What a step returns for one batch.

    ``written`` pairs each input entry to ack with the encoded record to write downstream
    for it (None: ack only). A good entry of the batch that is not listed stays unacked
    (the trainer holds its inputs until a checkpoint has the step). ``after`` runs once
    the transaction has been applied.
    """

    written: Sequence[tuple[Entry, bytes | None]] = ()
    counters: dict[str, float] = field(default_factory=dict)
    handed_back: Sequence[tuple[Entry, bytes]] = ()
    """Input entries replaced by a record written back to the input stream (a stopping
    generator's unfinished completions), in the same transaction as their acks."""
    after: Callable[[], None] | None = None


class Stage:
    """The plumbing of one stage process: its reader, its output stream, its emit transaction and its trims."""

    def __init__(self, r, keys: Keys, cfg, *, name: str, worker_id: str, log, source: str, group: str,
                 decode: Callable[[bytes], Any], check: Callable[[Any], None] | None = None,
                 sink: str | None = None, sink_group: str | None = None, claim: bool = True,
                 prefetch: bool = False, admitted: bool = True) -> None:
        self.r, self.keys, self.cfg, self.log = r, keys, cfg, log
        self.admitted = admitted
        """Whether the inputs descend from admitted prompts (every stage's do), so that a
        dead-lettered or handed-back one gives its admission slot back; a ``pipeline.api.Queue``
        admits nothing and gives nothing back."""
        self.name, self.worker_id = name, worker_id
        self.source, self.group = source, group
        self.sink, self.sink_group = sink, sink_group
        self.decode, self.check = decode, check
        if cfg.redis.worker_retries < 0:
            ride_outages(r, log)
        self.txn = TxnWriter(f"{name}:{worker_id}")
        self._emit = txn_script(r, _EMIT)
        ensure_all_groups(r, keys)
        self.reader = sharded_reader(r, keys, source, group, worker_id, cfg.redis, claim=claim)
        self.batches = 0
        self._cluster = isinstance(r, RedisCluster)
        self.prefetch = prefetch and not self._cluster
        self._prefetched: list[Entry] = []
        self._conn = None
        """The connection reads ahead go on (``prefetch``), taken from the client's pool on first use."""
        self._ahead: tuple[Any, tuple[int, int] | None] | None = None
        """The read ahead in flight on ``_conn``: (its shard's reader, its mark)."""
        self.step_seconds = 0.0
        """How long the last step took (``run``): reads go ahead only after short ones."""

    # ------------------------------------------------------------------ the steps of the loop

    def stopped(self) -> bool:
        return stop_requested(self.r, self.keys)

    def wait_for_room(self) -> float:
        """Backpressure: block while the output stream holds more than ``redis.max_stream_lag`` unacked."""
        if self.sink is None:
            return 0.0
        return wait_for_room(self.r, self.keys, self.keys.stream_keys(self.sink), self.sink_group,
                             bound=self.cfg.redis.max_stream_lag, worker_id=self.worker_id, stage=self.name,
                             log=self.log)

    def read(self, count: int, block_ms: int | None = None) -> list[Entry]:
        """Own pending entries, then reclaimed ones, then new ones (blocking ``block_ms``, by
        default ``redis.block_ms``).

        With ``prefetch``, a read that returns entries sends the next read of new entries right
        away, on a connection of its own, and the stage works on what it returned while the
        server answers (``_read_ahead``); the emit's script goes behind it on that connection
        and one wait returns both. The entries it read come back first, without a call.
        """
        if self._ahead is not None:  # no emit collected it
            self._prefetched += self._receive_ahead()
        if self._prefetched:
            entries, self._prefetched = self._prefetched[:count], self._prefetched[count:]
        else:
            recovered = self.reader.recovered_total
            entries = self.reader.read(count, self.cfg.redis.block_ms if block_ms is None else block_ms)
            self._log_recovered(self.reader.recovered_total - recovered)
        if entries:
            self._read_ahead(count)
        return entries

    def _log_recovered(self, n: int) -> None:
        if n:
            self.log.warning("lost_deliveries_recovered", stream=self.source, entries=n)

    def _read_ahead(self, count: int) -> None:
        """Send the read the next ``read`` would make (new entries of the shard whose turn it is),
        when that is what it would make: no own pending entries to drain, no reclaim sweep due,
        nothing read ahead left, and the last step short (``READ_AHEAD_STEP_S``).

        A read delivers but never acks, and it goes after the entries the caller holds were
        returned: what it delivers is this consumer's, and if the stage stops before taking it,
        it stays in its pending list, which it drains first when it starts again (or a peer
        reclaims after ``redis.claim_idle_ms``), as after a crash.
        """
        if not (self.prefetch and not self._prefetched and self.step_seconds < READ_AHEAD_STEP_S
                and not self.reader.owned_due):
            return
        if self._conn is None:
            try:
                self._conn = self.r.connection_pool.get_connection()
            except _LINK_ERRORS:  # the server went away: the next read waits for it the plain way
                return
        reader = self.reader.next_new()
        mark = reader.newest
        try:
            reader.send_read_new(self._conn, count)
        except _LINK_ERRORS:  # not sent, or sent and its reply is lost with the connection
            self._ahead_lost(reader, mark)
            return
        self._ahead = (reader, mark)

    def _receive_ahead(self) -> list[Entry]:
        """The entries of the read ahead in flight (its reply read now); [] if its connection failed,
        and what it delivered comes back from the next read (``GroupReader.recover_lost``)."""
        (reader, mark), self._ahead = self._ahead, None
        try:
            return reader.receive_new(self._conn.read_response())
        except ResponseError:  # refused (the group gone): the next plain read raises it
            self._conn.disconnect()
            return []
        except _LINK_ERRORS:
            self._ahead_lost(reader, mark)
            return []

    def _ahead_lost(self, reader, mark) -> None:
        self._conn.disconnect()
        self.log.info("read_ahead_lost", stream=reader.stream)
        self._log_recovered(reader.recover_lost(mark))

    def close(self) -> None:
        """Give the read-ahead connection back to the client's pool (a read ahead in flight is
        dropped with it: its entries stay in this consumer's pending list)."""
        if self._conn is not None:
            if self._ahead is not None:
                self._ahead = None
                self._conn.disconnect()
            self.r.connection_pool.release(self._conn)
            self._conn = None

    def take(self, entries: list[Entry]) -> Batch:
        """Decode and check one read (entries of one shard)."""
        good, bad = decode_entries(entries, self.decode, self.check, reader=self.reader)
        return Batch(shard=self.keys.shard(entries[0].shard), good=good, bad=bad)

    def emit(self, batch: Batch, out: Output) -> None:
        """Write, ack, dead-letter and count in one transaction of the batch's shard; then trim now and then.

        One call: the ``_EMIT`` script (an EVALSHA), or, when the records written come to
        ``MULTI_BYTES`` or more on one server, the same writes in a MULTI/EXEC
        (``_emit_multi``). Its token (``self.txn``) is taken before the first attempt, so
        redis-py sending it again after a lost reply changes nothing and returns the first
        result. The dead-letter path of every stage and of ``pipeline.api.Queue.get``.
        """
        shard = batch.shard
        src = getattr(shard, self.source)
        dst = getattr(shard, self.sink) if self.sink is not None else shard.dead
        dead: list = []
        for e, reason in batch.bad:
            self.log.warning("dead_letter", id=e.id, reason=reason)
            fields = dead_letter_fields(stream=src, entry=e, reason=reason, consumer=self.worker_id)
            dead += [e.id, len(fields), *fields]
        acks = [e.id for e, _ in out.written]
        outputs = [payload for _, payload in out.written if payload is not None]
        back: list = []
        for e, payload in out.handed_back:
            back += [e.id, payload]
        counters = counter_args(out.counters)
        if batch.bad or out.written or out.handed_back or counters:
            size = sum(map(len, outputs)) + sum(len(p) for _, p in out.handed_back)
            with self.txn.token() as seq:
                if size >= MULTI_BYTES and not self._cluster:
                    applied, releases = self._emit_multi(shard, src, dst, seq, dead, acks, outputs, back, counters,
                                                         releases=len(batch.bad) + len(out.handed_back))
                else:
                    applied, releases = self._emit_script(
                        keys=[src, dst, shard.dead, shard.stats, shard.txn],
                        args=[self.txn.id, seq, self.group, len(batch.bad), *dead,
                              len(acks), *acks, len(outputs), *outputs, len(out.handed_back), *back,
                              len(counters) // 3, *counters])
            if not applied:
                self.log.info("emit_replay_skipped", shard=shard.index, seq=seq)
            if self.admitted:
                release_admissions(self.r, self.keys, int(releases), writer=self.txn)
        if out.after is not None:
            out.after()
        self.batches += 1
        if self.batches % TRIM_EVERY == 0:
            self.trim()

    def _emit_script(self, *, keys: list, args: list) -> tuple[int, int]:
        """The emit script; behind a read ahead in flight (``read``), on its connection: one wait
        returns the read's entries and the script's result.

        Any failure on that connection sends the script again the plain way (the client's
        retries, the script loaded if the server lost it); its token makes that a replay if
        the first attempt was applied. A read ahead whose reply was lost is recovered
        (``GroupReader.recover_lost``).
        """
        if self._ahead is None:
            return self._emit(keys=keys, args=args)
        reader, mark = self._ahead
        try:
            self._conn.send_command("EVALSHA", self._emit.sha, len(keys), *keys, *args, check_health=False)
        except _LINK_ERRORS:
            self._ahead = None
            self._ahead_lost(reader, mark)
            return self._emit(keys=keys, args=args)
        self._prefetched = self._receive_ahead()
        if not self._conn.is_connected:  # the read's reply failed: the script's is gone with it
            return self._emit(keys=keys, args=args)
        try:
            return self._conn.read_response()
        except NoScriptError:  # a restarted server: the plain call loads it and sends it again
            return self._emit(keys=keys, args=args)
        except _LINK_ERRORS:  # applied or not: the token decides
            self._conn.disconnect()
            return self._emit(keys=keys, args=args)

    def _emit_multi(self, shard: ShardKeys, src: str, dst: str, seq: int, dead: list, acks: list, outputs: list,
                    back: list, counters: list, *, releases: int) -> tuple[int, int]:
        """The emit script's writes as a MULTI, for records too large to pass through Lua cheaply.

        The token is this writer's own key in the shard's slot (``<shard>:txn:<writer>``, "<seq>
        <result>"), WATCHed and read before the MULTI that writes it: a seq already recorded
        was applied (a replay: nothing is written, the first result returned); an attempt
        whose key changed between its WATCH and its EXEC (an earlier attempt of the same call,
        applied late after a lost connection) is not applied and looks again. redis-py turns
        a connection lost while watching into a WatchError, so every path ends in a check.
        """
        marker = f"{shard.txn}:{self.txn.id}"
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(marker)
                    if (first := self._replayed(pipe.get(marker), seq)) is not None:
                        pipe.unwatch()
                        return 0, first
                    pipe.multi()
                    i, dead_ids = 0, []
                    while i < len(dead):
                        nf = dead[i + 1]
                        pipe.execute_command("XADD", shard.dead, "*", *dead[i + 2:i + 2 + nf])
                        dead_ids.append(dead[i])
                        i += 2 + nf
                    if dead_ids:
                        pipe.xack(src, self.group, *dead_ids)
                        pipe.hincrby(shard.stats, "dead_letters_total", len(dead_ids))
                    for payload in outputs:
                        pipe.execute_command("XADD", dst, "*", "d", payload)
                    if acks:
                        pipe.xack(src, self.group, *acks)
                    for k in range(0, len(back), 2):
                        pipe.execute_command("XADD", src, "*", "d", back[k + 1])
                    if back:
                        pipe.xack(src, self.group, *back[0::2])
                    for k in range(0, len(counters), 3):
                        name, kind, value = counters[k:k + 3]
                        (pipe.hincrbyfloat if kind == "f" else pipe.hincrby)(shard.stats, name, value)
                    pipe.set(marker, f"{seq} {releases}")
                    pipe.execute()
                    return 1, releases
                except WatchError:
                    continue

    @staticmethod
    def _replayed(last: bytes | str | None, seq: int) -> int | None:
        """The first result if the token ``last`` ("<seq> <result>") shows ``seq`` applied, else None."""
        if last is None:
            return None
        done, _, result = (last.decode() if isinstance(last, bytes) else last).partition(" ")
        return int(result) if int(done) >= seq else None

    def trim(self) -> None:
        """Remove the input entries every group has acked (``redis.trim_acked``)."""
        if self.cfg.redis.trim_acked:
            for key in self.keys.stream_keys(self.source):
                trim_acked(self.r, key)

    def heartbeat(self, state: str, **extra) -> None:
        heartbeat(self.r, self.keys, self.worker_id, self.name, state, **extra)

    def isolate(self, step: Callable[[Batch], Output], batch: Batch, err: Exception) -> None:
        """After ``step`` failed on ``batch`` with an error not of the stage's own state
        (``STAGE_ERRORS``): its defects are dead-lettered, then each good entry is stepped and
        emitted alone, and one that fails alone is tried again until it has failed
        ``redis.max_deliveries`` times (the batch's failure counted), then dead-lettered with
        the failure's summary (an entry of a larger batch gets ``redis.max_deliveries`` tries
        alone). The stage goes on either way: what an entry brings never ends the process."""
        limit = self.cfg.redis.max_deliveries
        self.log.warning("step_failed", entries=len(batch.good), error=failure_summary(err),
                         then="each entry alone" if len(batch.good) > 1 else "again")
        if batch.bad:
            self.emit(Batch(shard=batch.shard, good=[], bad=batch.bad), Output())
        for entry, record in batch.good:
            one = Batch(shard=batch.shard, good=[(entry, record)], bad=[])
            # A batch of one failed on this entry already; in a larger one, the failure was anyone's.
            failures, out = int(len(batch.good) == 1), None
            while out is None and failures < limit:
                try:
                    out = step(one)
                except STAGE_ERRORS:
                    raise
                except Exception as e:  # noqa: BLE001 - this entry's failure
                    failures, err = failures + 1, e
            if out is not None:
                self.emit(one, out)
                continue
            reason = f"{self.name} failed on this entry {failures} times: {failure_summary(err)}"
            self.log.warning("entry_failed", id=entry.id, tries=failures, error=failure_summary(err))
            self.emit(Batch(shard=batch.shard, good=[], bad=[(entry, reason)]),
                      Output(counters={"entries_failed_total": 1}))

    # ------------------------------------------------------------------ the loop

    def run(self, step: Callable[[Batch], Output], *, count: int, read: Callable[[int], list[Entry]] | None = None,
            before: Callable[[], None] | None = None, idle: Callable[[], None] | None = None,
            max_batches: int | None = None) -> int:
        """Claim → process → emit + ack until stopped (or ``max_batches`` reads with entries); returns reads done.

        The loop of the verifier and the batch generator (the module docstring says which
        stages loop on their own and why). ``read(count)`` replaces the plain read (the
        generator's admission); ``before`` runs at the top of every turn (the generator's
        weight swap); ``idle`` when a read found nothing. ``step`` sees only batches with at
        least one good record; a step that raises something not of the stage's own state
        (``STAGE_ERRORS``) has its batch taken apart (``isolate``).
        """
        done = 0
        try:
            while not self.stopped() and (max_batches is None or done < max_batches):
                if before is not None:
                    before()
                self.wait_for_room()
                entries = (read or self.read)(count)
                if not entries:
                    if idle is not None:
                        idle()
                    continue
                batch = self.take(entries)
                t0 = time.perf_counter()
                try:
                    out = step(batch) if batch.good else Output()
                except STAGE_ERRORS:
                    raise
                except Exception as err:  # noqa: BLE001 - something an entry brought: find it, go on
                    self.step_seconds = time.perf_counter() - t0
                    self.isolate(step, batch, err)
                    done += 1
                    continue
                self.step_seconds = time.perf_counter() - t0
                self.emit(batch, out)
                done += 1
        finally:
            self.close()
        return done

