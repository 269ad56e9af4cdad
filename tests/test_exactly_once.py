"""Every transaction is safe to retry: a reply lost after the server applied it changes nothing.

redis-py sends a whole call again after a connection error (the client's retry). If the
server applied it and the reply was lost, a plain MULTI/EXEC is applied twice. A small TCP
proxy between the client and the real server forwards everything but, when armed, swallows
the server's reply to the next EXEC/EVALSHA (after the server sent it: the call was
applied) and closes the client's connection, so redis-py retries the call. Every stage's
commit is driven through it with a reply dropped: the generator's and the verifier's emit,
a dead letter, the trainer's commit, the feeder's prompt writes, admission grants and
give-backs. Each must leave exactly one output per input, one count, and the admission
counter exact; the proxy must have seen the call twice (the retry really happened), and
with the token check taken out of the script the duplicate must appear (the test can fail).
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from urllib.parse import urlparse

import numpy as np
import pytest
from builders import RecordingLog, make_prompt, make_rollout, make_scored

import pipeline.bus.streams as streams
import pipeline.consumers.trainer as trainer_mod
import pipeline.producers.feeder as feeder_mod
import pipeline.stage as stage_mod
from pipeline.bus.connection import connect
from pipeline.bus.flow import Admission, release_admissions
from pipeline.bus.streams import TxnWriter, ensure_all_groups, unacked
from pipeline.config import RunConfig
from pipeline.keys import GENERATORS_GROUP, TRAINER_GROUP, VERIFIERS_GROUP, Keys
from pipeline.records import PromptTask, RolloutGroup
from pipeline.common.checkpoint import StepRecord
from pipeline.stage import Output, Stage

_COMMITS = (b"$4\r\nEXEC\r\n", b"$7\r\nEVALSHA\r\n")
_QUIET_S = 0.15
"""A swallowed reply is complete once the server has been quiet this long."""


def _log() -> RecordingLog:
    """A log that keeps (level, event, fields) of every line."""
    return RecordingLog(levels=True)


class DropReplyProxy:
    """A loopback TCP proxy to a Redis server that can drop the reply to the next EXEC/EVALSHA.

    ``drop_next()`` arms it: the next connection that sends an EXEC or EVALSHA gets that
    command forwarded, the server's whole reply read and thrown away, and then its
    connection closed, as if the network failed after the server applied the call. A
    ``-NOSCRIPT`` reply (the script was not applied) is passed on and the drop stays armed.
    ``sent`` counts the EXEC/EVALSHA commands clients sent; ``noscript`` the NOSCRIPT replies;
    ``applied_attempts`` their difference: how many times the server ran a transaction.
    """

    def __init__(self, target_url: str):
        t = urlparse(target_url)
        self.target = (t.hostname, t.port)
        self.db = t.path or "/0"
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.sent = self.noscript = self.dropped = 0
        self._armed = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.listener.getsockname()[1]}{self.db}"

    @property
    def applied_attempts(self) -> int:
        return self.sent - self.noscript

    def drop_next(self) -> None:
        with self._lock:
            self._armed += 1

    def close(self) -> None:
        self._closing.set()
        self._accept.join(5)
        for t in self._threads:
            t.join(5)
        self.listener.close()

    # ------------------------------------------------------------------ plumbing

    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self.listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            if len(self._threads) >= 64:  # bounded: a test opens a handful of connections
                client.close()
                continue
            t = threading.Thread(target=self._pump, args=(client,), daemon=True)
            self._threads.append(t)
            t.start()

    def _count(self, tail: bytes, data: bytes, markers: tuple[bytes, ...]) -> tuple[int, bytes]:
        buf = tail + data
        n = 0
        for m in markers:
            start = buf.find(m)
            while start >= 0:
                if start + len(m) > len(tail):  # not counted with the previous chunk
                    n += 1
                start = buf.find(m, start + 1)
        return n, buf[-16:]

    def _pump(self, client: socket.socket) -> None:
        server = socket.create_connection(self.target, timeout=5)
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ, "client")
        sel.register(server, selectors.EVENT_READ, "server")
        ctail = stail = b""
        swallowing, swallowed, last_reply = False, b"", 0.0
        deadline = 0.0
        try:
            while not self._closing.is_set():
                for key, _ in sel.select(timeout=0.02):
                    data = key.fileobj.recv(1 << 16)
                    if not data:
                        return
                    if key.data == "client":
                        n, ctail = self._count(ctail, data, _COMMITS)
                        with self._lock:
                            self.sent += n
                            if n and self._armed and not swallowing:
                                self._armed -= 1
                                swallowing, deadline = True, time.monotonic() + 5
                        server.sendall(data)
                    elif swallowing:
                        swallowed += data
                        last_reply = time.monotonic()
                    else:
                        n, stail = self._count(stail, data, (b"-NOSCRIPT",))
                        with self._lock:
                            self.noscript += n
                        client.sendall(data)
                now = time.monotonic()
                if swallowing and ((swallowed and now - last_reply > _QUIET_S) or now > deadline):
                    if swallowed.startswith(b"-NOSCRIPT"):  # not applied: pass it on, stay armed
                        with self._lock:
                            self.noscript += 1
                            self._armed += 1
                        client.sendall(swallowed)
                        swallowing, swallowed = False, b""
                        continue
                    with self._lock:
                        self.dropped += 1
                    return  # closes both sides: the client sees its connection lost
        except OSError:
            return
        finally:
            sel.close()
            for s in (client, server):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


@pytest.fixture
def proxy(redis_url):
    p = DropReplyProxy(redis_url)
    yield p
    p.close()


@pytest.fixture(params=[1, 2], ids=["1shard", "2shards"])
def shards(request) -> int:
    return request.param


@pytest.fixture
def no_token_check(monkeypatch):
    """Take the idempotency checks out of every script (what the tests must be able to catch)."""
    def disable() -> None:
        monkeypatch.setattr(streams, "TXN_LUA", streams.TXN_LUA.replace(
            "local last = redis.call('HGET', txn, writer)", "local last = nil"))
        monkeypatch.setattr(trainer_mod, "_COMMIT", trainer_mod._COMMIT.replace(
            "if done >= tonumber(ARGV[2]) then return 0 end", "done = 0"))
        monkeypatch.setattr(feeder_mod, "_WRITE", feeder_mod._WRITE.replace(
            ">= tonumber(ARGV[1]) then return 0 end", ">= tonumber(ARGV[1]) and false then return 0 end"))
        assert "local last = nil" in streams.TXN_LUA and "done = 0" in trainer_mod._COMMIT
        assert "and false" in feeder_mod._WRITE
        monkeypatch.setattr(Stage, "_replayed", staticmethod(lambda last, seq: None))
    return disable


def _cfg(ns: str, shards: int, **overrides) -> RunConfig:
    return RunConfig().with_overrides({"run_id": ns, "redis.shards": shards, "redis.claim_idle_ms": 0, **overrides})


def _stats(r, keys: Keys) -> dict[str, float]:
    from pipeline.bus.stats import read_stats

    return read_stats(r, keys)


def _all(r, keys: Keys, name: str) -> list:
    return [f for key in keys.stream_keys(name) for _, f in r.xrange(key)]


def _shard_with(keys: Keys, k: int, n: int) -> list[str]:
    """``n`` prompt ids that route to shard ``k``."""
    out, i = [], 0
    while len(out) < n:
        pid = f"p{i:08d}"
        if keys.shard_of(pid) == k:
            out.append(pid)
        i += 1
    return out


# ---------------------------------------------------------------------- the scenarios
# Each drives a real commit through the proxy with one reply dropped and returns what the
# server holds afterwards; the tests assert it is exact (or, with the check disabled, not).


def _emit(proxy, r0, *, shards: int, source: str, group: str, sink: str, sink_group: str, make, decode, name: str):
    keys = Keys(f"emit-{name}", shards=shards)
    r = connect(proxy.url, name="t")
    ensure_all_groups(r0, keys)
    k = shards - 1
    pids = _shard_with(keys, k, 3)
    src = getattr(keys.shard(k), source)
    for pid in pids:
        r0.xadd(src, {"d": make(pid).encode()})
    stage = Stage(r, keys, _cfg(keys.ns, shards), name=name, worker_id=f"{name}-0", log=_log(), source=source,
                  group=group, decode=decode, sink=sink, sink_group=sink_group)
    batch = stage.take(stage.reader.read_new(10, None))
    assert len(batch.good) == 3
    proxy.drop_next()
    stage.emit(batch, Output(written=[(e, rec.encode()) for e, rec in batch.good],
                             counters={"groups_out_total": len(batch.good), "seconds_total": 0.25}))
    out = _all(r0, keys, sink)
    return {"outputs": len(out), "distinct": len({bytes(f[b"d"]) for f in out}),
            "unacked": unacked(r0, src, group), "count": _stats(r0, keys).get("groups_out_total"),
            "seconds": _stats(r0, keys).get("seconds_total"), "calls": 1}


def scenario_generator_emit(proxy, r0, shards):
    return _emit(proxy, r0, shards=shards, source="prompts", group=GENERATORS_GROUP, sink="rollouts",
                 sink_group=VERIFIERS_GROUP, make=lambda pid: make_prompt(prompt_id=pid), decode=PromptTask.decode,
                 name="generator")


def scenario_verifier_emit(proxy, r0, shards):
    return _emit(proxy, r0, shards=shards, source="rollouts", group=VERIFIERS_GROUP, sink="scored",
                 sink_group=TRAINER_GROUP, make=lambda pid: make_rollout(prompt_id=pid), decode=RolloutGroup.decode,
                 name="verifier")


def scenario_dead_letter(proxy, r0, shards):
    """A batch of one good prompt and one undecodable entry: its dead letter gives its admission slot back."""
    keys = Keys("dead", shards=shards)
    r = connect(proxy.url, name="t")
    ensure_all_groups(r0, keys)
    r0.set(keys.admitted, 10)
    k = shards - 1
    (pid,) = _shard_with(keys, k, 1)
    src = keys.shard(k).prompts
    r0.xadd(src, {"d": make_prompt(prompt_id=pid).encode()})
    r0.xadd(src, {"d": b"\xc1 not msgpack"})
    stage = Stage(r, keys, _cfg(keys.ns, shards), name="generator", worker_id="gen-0", log=_log(), source="prompts",
                  group=GENERATORS_GROUP, decode=PromptTask.decode, sink="rollouts", sink_group=VERIFIERS_GROUP)
    batch = stage.take(stage.reader.read_new(10, None))
    assert len(batch.good) == 1 and len(batch.bad) == 1
    proxy.drop_next()
    stage.emit(batch, Output(written=[(e, rec.encode()) for e, rec in batch.good]))
    return {"dead": len(_all(r0, keys, "dead")), "dead_count": _stats(r0, keys).get("dead_letters_total"),
            "outputs": len(_all(r0, keys, "rollouts")), "unacked": unacked(r0, src, GENERATORS_GROUP),
            "admitted": int(r0.get(keys.admitted)), "calls": 2}


def scenario_api_dead_letter(proxy, r0, shards):
    """The same batch read through the Python API (``Queue.get``): its dead letter goes by the
    stage's own emit (the dead letter and its ack in one call), and gives no slot back (the
    API admits nothing)."""
    import tempfile

    from pipeline import api

    overrides = {"run_id": f"api-dead-{shards}", "runs_dir": tempfile.mkdtemp(prefix="api-dead-"),
                 "redis.url": proxy.url, "redis.shards": shards, "redis.claim_idle_ms": 0}
    with api.Run(overrides=overrides, build_base_model=False) as run:
        keys = run.keys
        r0.set(keys.admitted, 10)
        k = shards - 1
        (pid,) = _shard_with(keys, k, 1)
        src = keys.shard(k).prompts
        r0.xadd(src, {"d": make_prompt(prompt_id=pid).encode()})
        r0.xadd(src, {"d": b"\xc1 not msgpack"})
        q = run.queue("prompts")
        q.stage("api-0")  # made before the count: nothing it does on the way is a transaction
        before = proxy.applied_attempts
        proxy.drop_next()
        got = q.get(10, consumer="api-0", block_ms=50)
        # As after a restart: a new queue drains the consumer's pending entries first, the good
        # one only (the dead-lettered one was acked with its dead letter).
        again = run.queue("prompts").get(10, consumer="api-0", block_ms=50)
        return {"dead": len(_all(r0, keys, "dead")), "dead_count": _stats(r0, keys).get("dead_letters_total"),
                "good": [rec.prompt_id for _, rec in got], "again": [rec.prompt_id for _, rec in again],
                "unacked": unacked(r0, src, GENERATORS_GROUP), "admitted": int(r0.get(keys.admitted)),
                "calls": before + 1}


def scenario_trainer_commit(proxy, r0, shards):
    """Two steps of two groups each (one per shard when sharded), committed with a reply dropped."""
    keys = Keys("commit", shards=shards)
    r = connect(proxy.url, name="t")
    ensure_all_groups(r0, keys)
    pids = [f"p{i:08d}" for i in range(4)]
    refs = []
    for pid in pids:
        s = keys.shard(keys.shard_of(pid))
        eid = r0.xadd(s.scored, {"d": make_scored(prompt_id=pid).encode()})
        refs.append((keys.shard_of(pid), eid.decode()))
    for s in keys.all_shards():
        r0.xreadgroup(TRAINER_GROUP, "trainer", {s.scored: ">"})
    steps = [StepRecord(version=v, entry_ids=[f"{k}/{eid}" if k else eid for k, eid in refs[2 * (v - 1):2 * v]],
                        outcomes={pid: f"trained:{v}" for pid in pids[2 * (v - 1):2 * v]},
                        group_ids={pid: f"{pid}:g" for pid in pids[2 * (v - 1):2 * v]},
                        counts={"groups_trained_total": 2, "tokens_trained_total": 40})
             for v in (1, 2)]
    proxy.drop_next()
    trainer_mod.commit(r, keys, steps)
    log = _all(r0, keys, "trainlog")
    return {"trainlog": len(log), "distinct": len({f[b"prompt_id"] for f in log}),
            "trained": _stats(r0, keys).get("groups_trained_total"),
            "tokens": _stats(r0, keys).get("tokens_trained_total"),
            "ledger": sum(r0.hlen(s.ledger) for s in keys.all_shards()),
            "unacked": sum(unacked(r0, s.scored, TRAINER_GROUP) for s in keys.all_shards()),
            "committed": [int(r0.get(s.committed)) for s in keys.all_shards()], "calls": shards}


def scenario_large_emit(proxy, r0, shards):
    """Records too large for the script (``stage.MULTI_BYTES``): the MULTI path, with a dead
    letter giving its admission slot back; the lost EXEC reply is found applied by its token."""
    keys = Keys("large", shards=shards)
    r = connect(proxy.url, name="t")
    ensure_all_groups(r0, keys)
    r0.set(keys.admitted, 10)
    k = shards - 1
    src = keys.shard(k).prompts
    pids = _shard_with(keys, k, 3)
    for pid in pids:
        r0.xadd(src, {"d": make_prompt(prompt_id=pid).encode()})
    r0.xadd(src, {"d": b"\xc1 not msgpack"})
    stage = Stage(r, keys, _cfg(keys.ns, shards), name="generator", worker_id="gen-0", log=_log(), source="prompts",
                  group=GENERATORS_GROUP, decode=PromptTask.decode, sink="rollouts", sink_group=VERIFIERS_GROUP)
    batch = stage.take(stage.reader.read_new(10, None))
    assert len(batch.good) == 3 and len(batch.bad) == 1
    outputs = [make_rollout(prompt_id=e.id, completions=tuple(str(i) * 6000 for i in range(4))).encode()
               for e, _ in batch.good]
    assert sum(map(len, outputs)) >= stage_mod.MULTI_BYTES
    proxy.drop_next()
    stage.emit(batch, Output(written=list(zip([e for e, _ in batch.good], outputs)),
                             counters={"groups_out_total": 3, "seconds_total": 0.25}))
    out = _all(r0, keys, "rollouts")
    return {"outputs": len(out), "distinct": len({bytes(f[b"d"]) for f in out}), "dead": len(_all(r0, keys, "dead")),
            "unacked": unacked(r0, src, GENERATORS_GROUP), "count": _stats(r0, keys).get("groups_out_total"),
            "seconds": _stats(r0, keys).get("seconds_total"), "admitted": int(r0.get(keys.admitted)),
            # EXEC/EVALSHA sent besides the dropped one: the give-back, and the MULTI again only
            # when its check is taken out (with it, the retry's check finds the EXEC applied).
            "calls": 1 + (_stats(r0, keys).get("groups_out_total") == 6.0)}


def scenario_verifier_read_ahead(proxy, r0, shards):
    """The verifier's emit sent behind its read ahead on one connection, the emit's reply lost:
    the emit sent again the plain way is a replay, and every entry is processed once."""
    keys = Keys("prefetch", shards=shards)
    r = connect(proxy.url, name="t")
    ensure_all_groups(r0, keys)
    k = shards - 1
    src = keys.shard(k).rollouts
    for pid in _shard_with(keys, k, 6):
        r0.xadd(src, {"d": make_rollout(prompt_id=pid).encode()})
    stage = Stage(r, keys, _cfg(keys.ns, shards, **{"redis.block_ms": 50}), name="verifier", worker_id="ver-0",
                  log=_log(), source="rollouts", group=VERIFIERS_GROUP, decode=RolloutGroup.decode, sink="scored",
                  sink_group=TRAINER_GROUP, prefetch=True)
    seen, drop, ahead = [], True, 0
    for _ in range(2 * shards + 6):
        entries = stage.read(3)
        if not entries:
            continue
        batch = stage.take(entries)
        seen += [rec.prompt_id for _, rec in batch.good]
        ahead += stage._ahead is not None
        if drop:
            # The read's reply has come (the proxy swallows what follows the script), so the
            # drop hits the script's reply; a read whose reply is lost: tests/test_outage.py.
            assert stage._conn.can_read(timeout=5)
            proxy.drop_next()
            drop = False
        stage.emit(batch, Output(written=[(e, rec.encode()) for e, rec in batch.good],
                                 counters={"groups_out_total": len(batch.good), "seconds_total": 0.25}))
    out = _all(r0, keys, "scored")
    return {"outputs": len(out), "distinct": len({bytes(f[b"d"]) for f in out}), "seen": len(seen),
            "unacked": unacked(r0, src, VERIFIERS_GROUP), "count": _stats(r0, keys).get("groups_out_total"),
            "read_ahead": ahead == 2,
            # the plain resend of the dropped emit (a replay), and the second batch's emit
            "calls": 2}


class _Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 17 for c in text]


def scenario_feeder_write(proxy, r0, shards):
    keys = Keys("feed", shards=shards)
    r = connect(proxy.url, name="t")
    cfg = _cfg(keys.ns, shards, **{"feeder.max_prompts": 4, "feeder.backlog": 16})
    proxy.drop_next()
    feeder_mod.run_feeder(cfg, r, keys, _log(), tokenizer=_Tok(), max_rounds=1)
    ids = [PromptTask.decode(f[b"d"]).prompt_id for f in _all(r0, keys, "prompts")]
    routes = [keys.shard_of(feeder_mod.prompt_id(i)) for i in range(4)]
    runs = 1 + sum(a != b for a, b in zip(routes, routes[1:]))  # one write per run of prompts bound for one shard
    return {"prompts": len(ids), "distinct": len(set(ids)), "issued": _stats(r0, keys).get("prompts_issued"),
            "calls": runs}


def scenario_admission(proxy, r0, shards):
    """A grant with its reply dropped, then a give-back with its reply dropped."""
    keys = Keys("admit", shards=shards)
    r = connect(proxy.url, name="t")
    r0.set(keys.admitted, 3)
    adm = Admission(r, keys, max_staleness=1, groups_per_step=4)  # bound at version 0: 8
    proxy.drop_next()
    granted = adm.admit(4, 0)
    after_grant = int(r0.get(keys.admitted))
    proxy.drop_next()
    adm.release(2)
    after_release = int(r0.get(keys.admitted))
    proxy.drop_next()
    release_admissions(r, keys, 1, writer=TxnWriter("stage"))
    return {"granted": granted, "after_grant": after_grant, "after_release": after_release,
            "final": int(r0.get(keys.admitted)), "calls": 3}


def scenario_admit_read(proxy, r0, shards):
    """The one-server grant-and-read, its reply dropped: only the prompts read are counted, and
    the replay reads none again (the first attempt's prompts wait in the consumer's pending list)."""
    keys = Keys("admitread", shards=shards)
    r = connect(proxy.url, name="t")
    ensure_all_groups(r0, keys)
    k = shards - 1
    for pid in _shard_with(keys, k, 6):
        r0.xadd(keys.shard(k).prompts, {"d": make_prompt(prompt_id=pid).encode()})
    reader = streams.sharded_reader(r, keys, "prompts", GENERATORS_GROUP, "gen-0", _cfg(keys.ns, shards).redis)
    adm = Admission(r, keys, max_staleness=1, groups_per_step=4)  # bound at version 0: 8
    proxy.drop_next()
    room, first = adm.admit_read(reader, 2, 0)
    owned = reader.read_owned(10)
    return {"room": room, "first": len(first), "owned": len(owned), "admitted": int(r0.get(keys.admitted)),
            "pending": r0.xpending(keys.shard(k).prompts, GENERATORS_GROUP)["pending"], "calls": 1}


EXACT = {
    scenario_generator_emit: {"outputs": 3, "distinct": 3, "unacked": 0, "count": 3.0, "seconds": 0.25},
    scenario_verifier_emit: {"outputs": 3, "distinct": 3, "unacked": 0, "count": 3.0, "seconds": 0.25},
    scenario_dead_letter: {"dead": 1, "dead_count": 1.0, "outputs": 1, "unacked": 0, "admitted": 9},
    scenario_api_dead_letter: {"dead": 1, "dead_count": 1.0, "good": ["p00000000"], "again": ["p00000000"],
                               "unacked": 1, "admitted": 10},
    scenario_trainer_commit: {"trainlog": 4, "distinct": 4, "trained": 4.0, "tokens": 80.0, "ledger": 4,
                              "unacked": 0},
    scenario_feeder_write: {"prompts": 4, "distinct": 4, "issued": 4.0},
    scenario_admission: {"granted": 4, "after_grant": 7, "after_release": 5, "final": 4},
    scenario_admit_read: {"room": True, "first": 0, "owned": 2, "admitted": 2, "pending": 2},
    scenario_large_emit: {"outputs": 3, "distinct": 3, "dead": 1, "unacked": 0, "count": 3.0, "seconds": 0.25,
                          "admitted": 9},
    scenario_verifier_read_ahead: {"outputs": 6, "distinct": 6, "seen": 6, "unacked": 0, "count": 6.0,
                                   "read_ahead": True},
}
DROPS = {scenario_admission: 3}
SCENARIOS = list(EXACT)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__.removeprefix("scenario_"))
def test_a_lost_reply_changes_nothing(scenario, proxy, redis_client, shards):
    got = scenario(proxy, redis_client, shards)
    want = EXACT[scenario]
    assert {k: got[k] for k in want} == want
    if "committed" in got:
        assert got["committed"] == [2] * shards
    drops = DROPS.get(scenario, 1)
    assert proxy.dropped == drops, "the proxy swallowed an applied reply"
    assert proxy.applied_attempts == got["calls"] + drops, "redis-py really sent each dropped call again"


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__.removeprefix("scenario_"))
def test_without_the_token_check_the_retry_duplicates(scenario, proxy, redis_client, no_token_check):
    """The same drives with the check taken out: the retry applies the call twice (the tests can fail)."""
    no_token_check()
    got = scenario(proxy, redis_client, 1)
    want = EXACT[scenario]
    assert {k: got[k] for k in want} != want, f"no duplicate without the check: {got}"
    drops = DROPS.get(scenario, 1)
    assert proxy.dropped == drops and proxy.applied_attempts == got["calls"] + drops


def test_a_plain_multi_is_applied_twice_through_the_proxy(proxy, redis_client):
    """The hazard itself, with the transaction shape the pipeline no longer uses: MULTI/EXEC."""
    r = connect(proxy.url, name="t")
    pipe = r.pipeline(transaction=True)
    pipe.xadd("s", {"d": b"x"})
    pipe.hincrby("stats", "n", 1)
    proxy.drop_next()
    pipe.execute()
    assert proxy.dropped == 1 and proxy.applied_attempts == 2
    assert redis_client.xlen("s") == 2 and int(redis_client.hget("stats", "n")) == 2


def test_replays_return_the_first_result(redis_client):
    """A grant sent again returns the grant it made (the generator reads that many prompts)."""
    keys = Keys("first")
    adm = Admission(redis_client, keys, max_staleness=0, groups_per_step=4)
    script = adm._admit
    args = lambda seq: [3, adm.bound(0), adm.writer.id, seq]  # noqa: E731
    assert int(script(keys=[keys.admitted, keys.admitted_txn], args=args(1))) == 3
    assert int(script(keys=[keys.admitted, keys.admitted_txn], args=args(1))) == 3, "the replay: same answer"
    assert int(redis_client.get(keys.admitted)) == 3, "and no second grant"
    assert int(script(keys=[keys.admitted, keys.admitted_txn], args=args(2))) == 1, "the next call is new"
    assert int(redis_client.get(keys.admitted)) == 4


def test_admit_read_counts_only_what_it_read(redis_client):
    """Two prompts waiting, four wanted: two read and two counted (no grant to give back, so a
    generator killed at any point leaks nothing); a full admission reads nothing."""
    keys = Keys("only")
    ensure_all_groups(redis_client, keys)
    for pid in ("a", "b"):
        redis_client.xadd(keys.shard(0).prompts, {"d": make_prompt(prompt_id=pid).encode()})
    reader = streams.sharded_reader(redis_client, keys, "prompts", GENERATORS_GROUP, "gen-0", RunConfig().redis)
    adm = Admission(redis_client, keys, max_staleness=0, groups_per_step=3)  # bound at version 0: 3
    room, got = adm.admit_read(reader, 4, 0)
    assert room and sorted(PromptTask.decode(e.payload).prompt_id for e in got) == ["a", "b"]
    assert int(redis_client.get(keys.admitted)) == 2
    redis_client.xadd(keys.shard(0).prompts, {"d": make_prompt(prompt_id="c").encode()})
    redis_client.xadd(keys.shard(0).prompts, {"d": make_prompt(prompt_id="d").encode()})
    room, got = adm.admit_read(reader, 4, 0)
    assert room and [PromptTask.decode(e.payload).prompt_id for e in got] == ["c"], "room for one more only"
    assert adm.admit_read(reader, 4, 0) == (False, []), "admission full: nothing read"
    assert int(redis_client.get(keys.admitted)) == 3


def test_emit_costs_one_round_trip(redis_url):
    """One EVALSHA per batch, whatever its size, with the writes inside (no MULTI any more)."""
    r = connect(redis_url, name="t")
    keys = Keys("trips")
    ensure_all_groups(r, keys)
    for i in range(32):
        r.xadd(keys.shard(0).prompts, {"d": make_prompt(prompt_id=f"p{i:08d}").encode()})
    stage = Stage(r, keys, _cfg(keys.ns, 1), name="generator", worker_id="g", log=_log(), source="prompts",
                  group=GENERATORS_GROUP, decode=PromptTask.decode, sink="rollouts", sink_group=VERIFIERS_GROUP)
    batch = stage.take(stage.reader.read_new(32, None))
    stage.emit(batch, Output(written=[(e, b"x" * 100) for e, _ in batch.good]))  # loads the script
    calls = []
    original = r.execute_command
    r.execute_command = lambda *a, **kw: (calls.append(a[0]), original(*a, **kw))[1]
    for i in range(32):
        r.xadd(keys.shard(0).prompts, {"d": make_prompt(prompt_id=f"q{i:08d}").encode()})
    batch = stage.take(stage.reader.read_new(32, None))
    calls.clear()
    stage.emit(batch, Output(written=[(e, b"x" * 100) for e, _ in batch.good], counters={"n": 32}))
    assert calls == ["EVALSHA"]
    assert r.xlen(keys.shard(0).rollouts) == 64
    assert np.isclose(_stats(r, keys)["n"], 32)


def test_an_earlier_attempt_applied_late_aborts_the_multi(redis_client):
    """The MULTI path's race: an earlier attempt of the same emit is applied between the
    retry's WATCH and its EXEC (its EXEC still waiting in the server's buffer when the
    connection broke). The retry's EXEC is refused, its second look finds the token, and the
    records are written once."""
    keys = Keys("late")
    ensure_all_groups(redis_client, keys)
    for i in range(3):
        redis_client.xadd(keys.shard(0).prompts, {"d": make_prompt(prompt_id=f"p{i:08d}").encode()})
    log = _log()
    stage = Stage(redis_client, keys, _cfg(keys.ns, 1), name="generator", worker_id="gen-0", log=log,
                  source="prompts", group=GENERATORS_GROUP, decode=PromptTask.decode, sink="rollouts",
                  sink_group=VERIFIERS_GROUP)
    batch = stage.take(stage.reader.read_new(10, None))
    outputs = [make_rollout(prompt_id=e.id, completions=tuple(str(i) * 6000 for i in range(4))).encode()
               for e, _ in batch.good]
    looks = []
    real_multi = stage._emit_multi

    def look(last, seq):
        looks.append(last)
        if len(looks) == 1:  # the retry has WATCHed and read the token: now the earlier attempt lands
            args, kwargs = late_args[0]
            assert real_multi(*args, **kwargs) == (1, 0)
        return Stage._replayed(last, seq)

    late_args = []
    stage._emit_multi = lambda *a, **kw: (late_args.append((a, kw)), real_multi(*a, **kw))[1]
    stage._replayed = look
    stage.emit(batch, Output(written=list(zip([e for e, _ in batch.good], outputs)), counters={"n": 3}))
    assert redis_client.xlen(keys.shard(0).rollouts) == 3, "written once"
    assert _stats(redis_client, keys)["n"] == 3
    assert unacked(redis_client, keys.shard(0).prompts, GENERATORS_GROUP) == 0
    assert len(looks) == 3 and looks[0] is None and looks[2] is not None, \
        "the retry looked, its EXEC was refused, it looked again and found the token"
    assert any(e == "emit_replay_skipped" for _, e, _ in log.events)


def _verifier(r, keys: Keys, worker: str, **overrides) -> Stage:
    return Stage(r, keys, _cfg(keys.ns, keys.shards, **{"redis.block_ms": 50, **overrides}), name="verifier",
                 worker_id=worker, log=_log(), source="rollouts", group=VERIFIERS_GROUP, decode=RolloutGroup.decode,
                 sink="scored", sink_group=TRAINER_GROUP, prefetch=True)


def _drain(stage: Stage, rounds: int, pause_s: float = 0.0) -> list[str]:
    seen = []
    for _ in range(rounds):
        time.sleep(pause_s)
        entries = stage.read(4)
        if entries:
            batch = stage.take(entries)
            seen += [rec.prompt_id for _, rec in batch.good]
            stage.emit(batch, Output(written=[(e, rec.encode()) for e, rec in batch.good]))
    return seen


def test_a_stage_reads_ahead_only_after_short_steps(redis_client):
    """A batch read ahead waits through one step: after a step of ``READ_AHEAD_STEP_S`` or more
    (an LLM judge) the stage reads only when it is ready, so a peer could take that batch."""
    keys = Keys("aheadslow")
    ensure_all_groups(redis_client, keys)
    pids = [f"p{i:08d}" for i in range(16)]
    for pid in pids:
        redis_client.xadd(keys.shard(0).rollouts, {"d": make_rollout(prompt_id=pid).encode()})
    stage = _verifier(redis_client, keys, "ver-0")
    sent, seen = [], []
    next_new = stage.reader.next_new
    stage.reader.next_new = lambda: (sent.append(1), next_new())[1]

    def step(pause_s: float):
        def run(batch):
            time.sleep(pause_s)
            seen.extend(rec.prompt_id for _, rec in batch.good)
            return Output(written=[(e, rec.encode()) for e, rec in batch.good])
        return run

    stage.run(step(2 * stage_mod.READ_AHEAD_STEP_S), count=4, max_batches=2)
    assert len(sent) == 1, "only the first read, before any step was timed, read ahead"
    stage.run(step(0), count=4, max_batches=1)
    assert len(sent) == 1, "the read after a slow step did not"
    stage.run(step(0), count=4, max_batches=1)
    assert len(sent) == 2, "the read after a short step did"
    assert seen == pids, "every entry processed once, in order"
    assert unacked(redis_client, keys.shard(0).rollouts, VERIFIERS_GROUP) == 0


@pytest.mark.parametrize("n_shards", [1, 2])
def test_prefetch_still_reclaims_and_restarts_drain_what_it_read(redis_client, n_shards):
    """The verifier's read in its emit's round trip keeps the read's order of preference: a dead
    peer's entries are reclaimed while new work keeps coming, and what a stopped stage had
    read ahead is the first thing it reads when it starts again."""
    keys = Keys(f"ahead{n_shards}", shards=n_shards)
    ensure_all_groups(redis_client, keys)
    pids = [f"p{i:08d}" for i in range(40)]
    for pid in pids:
        redis_client.xadd(keys.shard(keys.shard_of(pid)).rollouts, {"d": make_rollout(prompt_id=pid).encode()})
    dead_held = []
    for s in keys.all_shards():  # a peer that died holding entries
        resp = redis_client.xreadgroup(VERIFIERS_GROUP, "ver-dead", {s.rollouts: ">"}, count=2)
        dead_held += [RolloutGroup.decode(f[b"d"]).prompt_id for _, f in resp[0][1]]
    stage = _verifier(redis_client, keys, "ver-0", **{"redis.claim_idle_ms": 300})
    turns = []
    next_new = stage.reader.next_new
    stage.reader.next_new = lambda: (turns.append(1), next_new())[1]
    seen = _drain(stage, 8, pause_s=0.2)  # busy for longer than a reclaim sweep's period (1 s)
    assert len(turns) >= 5, "the emits read ahead"
    assert stage.reader.claimed_total == len(dead_held), "and the dead peer's entries were reclaimed meanwhile"
    for _ in range(4):  # stop it right after an emit that read ahead
        if stage._prefetched:
            break
        seen += _drain(stage, 1)
    assert stage._prefetched
    assert set(dead_held) <= set(seen)
    ahead = [RolloutGroup.decode(e.payload).prompt_id for e in stage._prefetched]
    claimed = stage.reader.claimed_total
    del stage  # stopped holding what it read ahead
    again = _verifier(redis_client, keys, "ver-0", **{"redis.claim_idle_ms": 300})
    first = again.read(4)
    assert [RolloutGroup.decode(e.payload).prompt_id for e in first][:len(ahead)] == ahead[:4], \
        "its own pending entries come first after a restart"
    batch = again.take(first)
    again.emit(batch, Output(written=[(e, rec.encode()) for e, rec in batch.good]))
    seen += [rec.prompt_id for _, rec in batch.good] + _drain(again, 12)
    assert sorted(seen) == sorted(pids), "every entry processed exactly once"
    assert claimed + again.reader.claimed_total == len(dead_held)
    assert sum(unacked(redis_client, s.rollouts, VERIFIERS_GROUP) for s in keys.all_shards()) == 0
