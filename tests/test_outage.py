"""Stage workers ride out a server outage of any length, and nothing is lost or duplicated.

A real verifier process (``pipeline verify`` on the small run) and a trainer-side reader
(``collect_batch`` on the trainer's Stage, in a thread of the test) work against a server
with ``appendfsync always``; the server is SIGKILLed while they work, stays down for
``OUTAGE_S`` seconds (60 in the ``slow`` variant), and is started again on the same port
and data. Both must resume by themselves, say so in their logs (a warning when the outage
starts, an info line with its duration when it ends), and every rollout group must come out
scored exactly once: counted in the streams, the acks and the counters.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from urllib.parse import urlparse

import pytest
import redis
from builders import RecordingLog, make_rollout
from harness import spawn, tiny_config

from pipeline.bus.connection import connect
from pipeline.bus.server import _answers, _launch, find_server_binary, free_port, start_local_server
from pipeline.bus.stats import read_stats
from pipeline.bus.streams import ensure_all_groups, unacked
from pipeline.consumers.trainer import collect_batch
from pipeline.keys import TRAINER_GROUP, VERIFIERS_GROUP, Keys
from pipeline.records import ScoredGroup
from pipeline.stage import Stage

OUTAGE_S = float(os.environ.get("RLPIPE_TEST_OUTAGE_S", "20"))
BEFORE, AFTER = 160, 24
"""Rollout groups written before the outage (the verifier is still on them when the server
dies) and after it (work that only a resumed verifier can do)."""


def _wait(cond, timeout: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited {proc.returncode}:\n"
                                 f"{proc.stdout.read().decode(errors='replace')[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _add(r, keys: Keys, lo: int, hi: int) -> None:
    pipe = r.pipeline(transaction=False)
    for i in range(lo, hi):
        pipe.xadd(keys.shard(0).rollouts, {"d": make_rollout(prompt_id=f"p{i:08d}").encode()})
    pipe.execute()


def _ride_out(tmp_path, base_model, outage_s: float) -> None:
    server = start_local_server(tmp_path / "srv", appendfsync="always")
    port = urlparse(server.url).port
    cfg, path = tiny_config(tmp_path, base_model, server.url, "outage")
    keys = Keys(cfg.run_id)
    r = redis.Redis.from_url(server.url)
    ensure_all_groups(r, keys)
    _add(r, keys, 0, BEFORE)
    total = BEFORE + AFTER

    ver = spawn(path, "verify", "--worker-id", "ver-0")
    # The trainer's reader: its Stage turns the client into one that waits forever.
    tlog = RecordingLog(levels=True)
    tr = connect(server.url, name="outage:trainer")
    stage = Stage(tr, keys, cfg, name="trainer", worker_id="trainer", log=tlog, source="scored",
                  group=TRAINER_GROUP, decode=ScoredGroup.decode, claim=False)
    collected: list = []
    reader = threading.Thread(target=lambda: collected.append(collect_batch(stage, size=total)), daemon=True)
    reader.start()
    try:
        _wait(lambda: r.xlen(keys.shard(0).scored) >= 40, 180, "the verifier to score its first groups", ver)
        server.process.kill()  # SIGKILL mid-work: appendfsync always keeps what it acknowledged
        server.process.wait()
        server.stop()
        down = time.monotonic()
        while time.monotonic() - down < outage_s:
            assert ver.poll() is None, f"the verifier died during the outage (exit {ver.returncode}):\n" \
                                       f"{ver.stdout.read().decode(errors='replace')[-3000:]}"
            assert reader.is_alive() or collected, "the trainer's reader died during the outage"
            time.sleep(0.25)
        server = start_local_server(tmp_path / "srv", port=port, appendfsync="always")
        _add(r, keys, BEFORE, total)
        _wait(lambda: r.xlen(keys.shard(0).scored) >= total, 180, "the verifier to resume and finish", ver)
        reader.join(60)
        assert not reader.is_alive(), "the trainer's reader resumed and collected every group"
        r.set(keys.stop, 1)
        out = ver.communicate(timeout=60)[0].decode(errors="replace")
        assert ver.returncode == 0, out[-3000:]

        # Nothing lost, nothing twice: streams, acks and counters.
        scored = [ScoredGroup.decode(f[b"d"]) for _, f in r.xrange(keys.shard(0).scored)]
        want = {f"p{i:08d}" for i in range(total)}
        assert len(scored) == total and {g.rollout.prompt_id for g in scored} == want
        assert unacked(r, keys.shard(0).rollouts, VERIFIERS_GROUP) == 0
        assert r.xlen(keys.shard(0).dead) == 0
        assert read_stats(r, keys)["groups_scored_total"] == total
        (batch,) = collected
        assert batch is not None and sorted(g.rollout.prompt_id for _, g in batch) == sorted(want)

        # Both said so in their logs: when the outage started, and how long it lasted.
        events = [json.loads(x) for x in (cfg.run_dir / "logs" / "ver-0.jsonl").read_text().splitlines()]
        for name, evs in (("verifier", [(e["level"], e["event"], e) for e in events]), ("trainer", tlog.events)):
            lost = [e for level, ev, e in evs if ev == "redis_unreachable" and level == "warning"]
            back = [e for level, ev, e in evs if ev == "redis_reachable" and level == "info"]
            assert lost and back, f"the {name} logged the outage: {[ev for _, ev, _ in evs][-20:]}"
            assert max(e["seconds"] for e in back) >= outage_s - 1, (name, back)
    finally:
        try:
            r.set(keys.stop, 1)  # lets the reader thread return, if the server is up
        except redis.RedisError:
            pass
        if ver.poll() is None:
            ver.kill()
            ver.wait()
        reader.join(5)
        tr.close()
        server.stop()


def test_a_verifier_and_the_trainer_reader_ride_out_an_outage(tmp_path, tiny_base_model):
    _ride_out(tmp_path, tiny_base_model, OUTAGE_S)


@pytest.mark.slow
def test_they_ride_out_a_minute_long_outage(tmp_path, tiny_base_model):
    _ride_out(tmp_path, tiny_base_model, 60.0)


def test_a_finite_budget_still_gives_up_with_a_clear_message(tmp_path):
    """The driver and short commands keep a finite budget: a dead server is an error, not a hang."""
    t0 = time.monotonic()
    with pytest.raises(redis.ConnectionError, match="after 2 retries with backoff"):
        connect("redis://127.0.0.1:1/0", retries=2)
    assert time.monotonic() - t0 < 10


def test_an_unlimited_client_waits_for_a_server_that_comes_later(tmp_path):
    """``connect(retries=None)``: a worker started before its server waits for it, and logs it."""
    port = free_port()
    log = RecordingLog(levels=True)
    got: list = []

    def client() -> None:
        r = connect(f"redis://127.0.0.1:{port}/0", name="late", retries=None, log=log)
        got.append(r.set("k", "v"))

    t = threading.Thread(target=client, daemon=True)
    t.start()
    time.sleep(3)
    assert t.is_alive() and not got, "still waiting for the server"
    server = start_local_server(tmp_path / "srv", port=port)
    try:
        t.join(30)
        assert got == [True]
        assert [e for _, e, _ in log.events] == ["redis_unreachable", "redis_reachable"]
        assert log.events[1][2]["seconds"] >= 2.5
    finally:
        server.stop()


def test_a_server_interrupted_while_it_starts_is_not_left_behind(tmp_path):
    """A Ctrl-C (or SIGTERM) while the driver waits for the server it just started: the server runs
    in a session of its own, out of the terminal's reach, and no caller knows of it yet, so the wait
    stops it before passing the interrupt on."""
    port, awaited = free_port(), free_port()
    url = f"redis://127.0.0.1:{port}/0"
    args = [find_server_binary(), "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
            "--dir", str(tmp_path), "--logfile", str(tmp_path / "server.log")]
    up_when_interrupted: list[bool] = []

    def interrupt(signum, frame):
        up_when_interrupted.append(_answers(url))
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 2.0)
        with pytest.raises(KeyboardInterrupt):  # it answers on its own port, never on the one awaited
            _launch(args, f"redis://127.0.0.1:{awaited}/0")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert up_when_interrupted == [True], "the server was running when the interrupt came"
    assert not _answers(url), "the interrupted start stopped the server it started"


def test_the_backoff_stays_capped_however_long_the_outage():
    """redis-py's own backoff overflows after ~1000 failures; a client that waits forever must not."""
    from redis.backoff import ExponentialWithJitterBackoff

    from pipeline.bus.connection import BACKOFF_CAP_S, _backoff

    with pytest.raises(OverflowError):
        ExponentialWithJitterBackoff(base=0.05, cap=2.0).compute(5000)
    b = _backoff()
    waits = [b.compute(n) for n in (1, 2, 10, 1000, 5000, 10**6)]
    assert all(0 <= w <= BACKOFF_CAP_S for w in waits)


def test_refused_credentials_fail_at_once_even_for_a_worker(tmp_path):
    server = start_local_server(tmp_path / "srv", extra_args=["--requirepass", "s3cret"])
    try:
        t0 = time.monotonic()
        with pytest.raises(redis.ConnectionError, match="needs credentials|refused the credentials"):
            connect(server.url, retries=None)
        with pytest.raises(redis.ConnectionError, match="refused the credentials"):
            connect(server.url.replace("redis://", "redis://:wrong@"), retries=None)
        assert time.monotonic() - t0 < 5
    finally:
        server.stop()


def test_a_worker_started_during_an_outage_waits_for_the_server(tmp_path, tiny_base_model):
    """A verifier process started while nothing listens on the port waits (``redis.worker_retries``
    -1, the default) and then scores; with a finite budget it gives up with exit code 3."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    cfg, path = tiny_config(tmp_path, tiny_base_model, url, "late")
    keys = Keys(cfg.run_id)
    quick = spawn(path, "verify", "--worker-id", "ver-1", "--redis.worker_retries", "2")
    ver = spawn(path, "verify", "--worker-id", "ver-0")
    server = None
    try:
        out = quick.communicate(timeout=60)[0].decode(errors="replace")
        assert quick.returncode == 3 and "cannot reach Redis" in out and "after 2 retries" in out, out[-2000:]
        time.sleep(3)
        assert ver.poll() is None, f"the worker gave up during the outage:\n{ver.stdout.read().decode()[-2000:]}"
        server = start_local_server(tmp_path / "srv", port=port)
        r = redis.Redis.from_url(url)
        ensure_all_groups(r, keys)
        _add(r, keys, 0, 8)
        _wait(lambda: r.xlen(keys.shard(0).scored) >= 8, 120, "the late worker to score", ver)
        r.set(keys.stop, 1)
        out = ver.communicate(timeout=60)[0].decode(errors="replace")
        assert ver.returncode == 0, out[-3000:]
        events = [json.loads(x)["event"] for x in (cfg.run_dir / "logs" / "ver-0.jsonl").read_text().splitlines()]
        assert "redis_unreachable" in events and "redis_reachable" in events, events[:10]
    finally:
        for p in (quick, ver):
            if p.poll() is None:
                p.kill()
                p.wait()
        if server is not None:
            server.stop()


# ---------------------------------------------------------------------------- lost replies
# A read of new entries delivers them to its consumer on the server; if the reply never
# reaches the client (the server SIGKILLed after its AOF recorded the delivery, a dropped
# connection, a timeout), redis-py sends the read again and gets the next entries. The
# entries of the lost reply are then pending for a consumer that never saw them. Here the
# reader's blocking read times out on the client (a socket timeout shorter than the block)
# and is sent again while another client delivers two entries to the reader's consumer in
# one transaction: the server's state after a lost reply, in the middle of a failed call.

def _during_a_failing_read(url: str, stream: str, group: str, consumer: str, payloads: list[bytes], then: bytes):
    """In a thread: deliver ``payloads`` to ``consumer`` (a lost reply), then add ``then`` for the reader."""
    other = redis.Redis.from_url(url)
    lost: list = []

    def run() -> None:
        time.sleep(0.3)
        pipe = other.pipeline(transaction=True)
        for p in payloads:
            pipe.xadd(stream, {"d": p})
        pipe.xreadgroup(group, consumer, {stream: ">"}, count=len(payloads))
        lost.extend(i for i, _ in pipe.execute()[-1][0][1])
        time.sleep(1.2)
        other.xadd(stream, {"d": then})
        other.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, lost


def test_a_read_whose_reply_was_lost_returns_those_entries_next(redis_url):
    from pipeline.bus.streams import GroupReader, ensure_group

    r = connect(redis_url, name="lost:reader", retries=None, socket_timeout=0.5)
    ensure_group(r, "s", "g")
    ids = [r.xadd("s", {"d": b"held"}) for _ in range(2)]
    reader = GroupReader(r, "s", "g", "c", claim_idle_ms=0)
    assert [e.id for e in reader.read(2, 50)] == ids  # the caller holds these unacked
    t, lost = _during_a_failing_read(redis_url, "s", "g", "c", [b"lost-1", b"lost-2"], then=b"new")
    first = reader.read_new(10, 3000)  # times out every 0.5 s and is sent again until "new" comes
    t.join(10)
    assert [e.payload for e in first] == [b"new"] and len(lost) == 2
    assert reader.owned_due, "the lost deliveries wait for the next read"
    again = reader.read(10, 50)
    assert [e.id for e in again] == lost and [e.payload for e in again] == [b"lost-1", b"lost-2"]
    assert all(e.deliveries == 2 for e in again), "taking a lost delivery again counts as a delivery"
    assert reader.recovered_total == 2
    assert reader.read(10, 50) == [], "entries the caller holds unacked are never returned again"
    assert len(r.xpending_range("s", "g", "-", "+", 100, consumername="c")) == 5
    r.close()


def test_a_read_ahead_whose_reply_is_lost_returns_its_entries_next(redis_url):
    """The verifier's read ahead delivered entries, then its connection failed before the reply
    was read: the emit goes the plain way, and the next read returns those entries."""
    from pipeline.config import RunConfig
    from pipeline.records import RolloutGroup
    from pipeline.stage import Output

    keys = Keys("aheadlost")
    r = connect(redis_url, name="lost:ahead")
    ensure_all_groups(r, keys)
    src = keys.shard(0).rollouts
    pids = [f"p{i:08d}" for i in range(8)]
    for pid in pids:
        r.xadd(src, {"d": make_rollout(prompt_id=pid).encode()})
    log = RecordingLog(levels=True)
    stage = Stage(r, keys, RunConfig().with_overrides({"run_id": keys.ns, "redis.block_ms": 50}), name="verifier",
                  worker_id="ver-0", log=log, source="rollouts", group=VERIFIERS_GROUP, decode=RolloutGroup.decode,
                  sink="scored", sink_group=TRAINER_GROUP, prefetch=True)
    first = stage.read(4)
    assert len(first) == 4 and stage._ahead is not None, "the read sent the next one ahead"
    _wait(lambda: r.xpending(src, VERIFIERS_GROUP)["pending"] == 8, 5, "the read ahead to deliver")
    stage._conn._sock.close()  # the connection fails with the read's reply unread
    batch = stage.take(first)
    stage.emit(batch, Output(written=[(e, rec.encode()) for e, rec in batch.good]))
    assert stage.reader.recovered_total == 4
    second = stage.read(4)
    assert [RolloutGroup.decode(e.payload).prompt_id for e in second] == pids[4:]
    assert all(e.deliveries == 2 for e in second), "taking a lost delivery again counts as a delivery"
    batch = stage.take(second)
    stage.emit(batch, Output(written=[(e, rec.encode()) for e, rec in batch.good]))
    assert stage.read(4) == []
    out = [RolloutGroup.decode(f[b"d"]).prompt_id for _, f in r.xrange(keys.shard(0).scored)]
    assert out == pids and unacked(r, src, VERIFIERS_GROUP) == 0, "every entry emitted once"
    events = [e for _, e, _ in log.events]
    assert "read_ahead_lost" in events and ("warning", "lost_deliveries_recovered",
                                            {"stream": "rollouts", "entries": 4}) in log.events
    stage.close()
    r.close()


def test_the_trainer_collects_a_lost_delivery_and_never_what_it_holds(tmp_path, tiny_base_model, redis_url):
    from builders import make_scored

    cfg, _ = tiny_config(tmp_path, tiny_base_model, redis_url, "lost")
    keys = Keys(cfg.run_id)
    r = connect(redis_url, name="lost:trainer", socket_timeout=0.5)  # under the 1 s block: reads time out
    ensure_all_groups(r, keys)
    scored = keys.shard(0).scored
    group = [make_scored(prompt_id=f"p{i:08d}").encode() for i in range(6)]
    for g in group[:3]:
        r.xadd(scored, {"d": g})
    log = RecordingLog(levels=True)
    stage = Stage(r, keys, cfg, name="trainer", worker_id="trainer", log=log, source="scored",
                  group=TRAINER_GROUP, decode=ScoredGroup.decode, claim=False)
    first = collect_batch(stage, size=3)  # one step's groups, held unacked until it commits
    assert [g.rollout.prompt_id for _, g in first] == ["p00000000", "p00000001", "p00000002"]
    t, lost = _during_a_failing_read(redis_url, scored, TRAINER_GROUP, "trainer", group[3:5], then=group[5])
    def give_up() -> None:
        # Without the lost deliveries the read would wait for ever: the reads stop timing
        # out (connections made from now on wait 30 s) and a stop ends it.
        pool = r.connection_pool
        pool.connection_kwargs["socket_timeout"] = 30
        for c in [*pool._available_connections, *pool._in_use_connections]:
            c.socket_timeout = 30
        redis.Redis.from_url(redis_url).set(keys.stop, 1)

    stopper = threading.Timer(20, give_up)
    stopper.start()
    second = collect_batch(stage, size=3, held={g.rollout.prompt_id for _, g in first})
    stopper.cancel()
    t.join(10)
    assert second is not None, "the trainer never got the lost deliveries"
    assert len(lost) == 2
    assert sorted(g.rollout.prompt_id for _, g in second) == ["p00000003", "p00000004", "p00000005"]
    assert [e for _, e, _ in log.events].count("lost_deliveries_recovered") == 1
    assert int(read_stats(r, keys).get("duplicates_skipped_total", 0)) == 0
    assert unacked(r, scored, TRAINER_GROUP) == 6, "nothing acked before its step commits"
    r.close()
