"""Redis Cluster support: sharded streams on a real local three-master cluster.

The key layout (one slot per shard, global keys in the ``{ns}`` slot, plain names
unsharded), a client riding through a master's SIGKILL and restart, the feeder's routing
and exact resume, an idempotent per-shard commit, and whole runs (`pipeline up`, and
`pipeline chaos` with a master killed mid-run) accounting for every prompt.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest
from redis.cluster import key_slot

from harness import up
from pipeline.common.checkpoint import StepRecord
from pipeline.config import RedisConfig, RunConfig
from pipeline.keys import TRAINER_GROUP, Keys
from pipeline.bus.server import _launch, start_local_cluster
from pipeline.bus.connection import connect
from pipeline.bus.stats import read_stats
from pipeline.bus.streams import ensure_all_groups


def _slot(key: str) -> int:
    return key_slot(key.encode())


def test_unsharded_keys_keep_their_plain_names():
    k = Keys("run")
    assert not k.tagged
    s = k.shard(0)
    assert (s.prompts, s.rollouts, s.scored, s.dead, s.ledger, s.trainlog, s.stats, s.committed) == (
        "run:prompts", "run:rollouts", "run:scored", "run:dead", "run:ledger", "run:trainlog", "run:stats",
        "run:committed")
    assert (k.weights, k.versions, k.admitted, k.trainer, k.workers, k.stop, k.labelmodel_lock) == (
        "run:weights", "run:versions", "run:admitted", "run:trainer", "run:workers", "run:stop", "run:labelmodel:lock")
    assert k.all_shards() == [k.shard(0)] and k.shard_of("p00000007") == 0
    assert Keys.of("run", RedisConfig()) == k


def test_sharded_keys_put_each_shard_in_one_slot_and_the_globals_in_the_ns_slot():
    k = Keys.of("run", RedisConfig(shards=3, cluster=True))
    slots = []
    for s in k.all_shards():
        names = [s.prompts, s.rollouts, s.scored, s.dead, s.ledger, s.trainlog, s.stats, s.committed]
        assert all(n.startswith(f"{{run/{s.index}}}:") for n in names), names
        assert len({_slot(n) for n in names}) == 1, f"shard {s.index}'s keys span slots: {names}"
        slots.append(_slot(s.prompts))
    assert len(set(slots)) > 1, "the shards spread over more than one slot"
    globals_ = [k.weights, k.versions, k.admitted, k.trainer, k.workers, k.stop, k.labelmodel, k.labelmodel_lock,
                k.votes]
    assert {_slot(n) for n in globals_} == {_slot("{run}")}
    routed = [k.shard_of(f"p{i:08d}") for i in range(300)]
    assert set(routed) == {0, 1, 2} and min(routed.count(j) for j in range(3)) > 60, "crc32 routing spreads prompts"
    assert routed == [k.shard_of(f"p{i:08d}") for i in range(300)], "routing is deterministic"
    with pytest.raises(IndexError, match="shard 3 of 3"):
        k.shard(3)
    assert not hasattr(k, "prompts"), "one layout: a stream's keys are always a shard's"
    # One shard on a cluster: hash tags all the same.
    one = Keys("run", cluster=True)
    assert one.shard(0).prompts == "{run/0}:prompts" and one.weights == "{run}:weights"


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    cluster = start_local_cluster(tmp_path_factory.mktemp("cluster"), masters=3, appendfsync="always")
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_client(redis_cluster):
    r = connect(redis_cluster.url, name="test", redis_cfg=RedisConfig(cluster=True))
    r.flushall(target_nodes="primaries")
    yield r
    r.close()


def _node_of(r, key: str) -> str:
    node = r.get_node_from_key(key)
    return f"redis://{node.host}:{node.port}/0"


def test_three_masters_serve_the_shards_and_a_client_rides_out_a_master_restart(redis_cluster, cluster_client):
    r = cluster_client
    keys = Keys("ride", shards=3, cluster=True)
    ensure_all_groups(r, keys)
    assert len({_node_of(r, s.prompts) for s in keys.all_shards()}) > 1, "shards live on different masters"
    for s in keys.all_shards():
        pipe = r.pipeline(transaction=True)  # a single-slot MULTI per shard
        pipe.xadd(s.prompts, {"d": b"x"})
        pipe.hincrby(s.stats, "n", 1)
        pipe.execute()
    victim_url = _node_of(r, keys.shard(0).prompts)
    node = next(n for n in redis_cluster.nodes if n.url == victim_url)
    node.process.kill()
    node.process.wait()

    def come_back() -> None:
        time.sleep(1.5)
        node.process = _launch(node.args, node.url)

    t = threading.Thread(target=come_back)
    t.start()
    t0 = time.monotonic()
    # Issued while the master is down: the client backs off until it is back.
    pipe = r.pipeline(transaction=True)
    pipe.xadd(keys.shard(0).prompts, {"d": b"y"})
    pipe.hincrby(keys.shard(0).stats, "n", 1)
    pipe.execute()
    assert r.xlen(keys.shard(0).prompts) == 2
    waited = time.monotonic() - t0
    t.join()
    assert waited >= 1.0, "the write really waited for the restarted master"
    assert read_stats(r, keys)["n"] == 4, "the AOF brought back what the killed master had acknowledged"


def test_feeder_routes_by_prompt_id_and_resumes_exactly(tmp_path, cluster_client, tiny_base_model):
    from pipeline.observe.logs import setup_logging
    from pipeline.producers.feeder import prompt_id, run_feeder
    from pipeline.model.tokenizer import load_tokenizer

    r = cluster_client
    cfg = RunConfig().with_overrides({"run_id": "feed", "redis.cluster": True, "redis.shards": 3,
                                      "model.base_dir": str(tiny_base_model), "feeder.backlog": 12})
    keys = Keys.of(cfg.run_id, cfg.redis)
    log = setup_logging(None, stage="feeder", worker="feeder")
    tok = load_tokenizer(cfg.model.base_dir)
    assert run_feeder(cfg, r, keys, log, tokenizer=tok, max_rounds=1) == 12
    cfg = cfg.replace("feeder.backlog", 20)  # the generators took nothing: 8 more fit
    assert run_feeder(cfg, r, keys, log, tokenizer=tok, max_rounds=1) == 8
    seen = []
    for s in keys.all_shards():
        ids = [json_id(f[b"d"]) for _, f in r.xrange(s.prompts)]
        assert ids, f"shard {s.index} got no prompt"
        assert all(keys.shard_of(p) == s.index for p in ids)
        assert ids == sorted(ids), "a shard's prompts are in id order"
        seen += ids
    assert sorted(seen) == [prompt_id(i) for i in range(20)], "no prompt skipped or issued twice across the resume"
    assert read_stats(r, keys)["prompts_issued"] == 20


def json_id(payload: bytes) -> str:
    from pipeline.records import PromptTask

    return PromptTask.decode(payload).prompt_id


def test_a_commit_replayed_after_a_crash_repeats_nothing_in_any_shard(cluster_client):
    from pipeline.consumers.trainer import commit, shard_committed

    r = cluster_client
    keys = Keys("commit", shards=3, cluster=True)
    ensure_all_groups(r, keys)
    by_shard = {k: [p for p in (f"p{i:08d}" for i in range(60)) if keys.shard_of(p) == k][:3] for k in range(3)}
    pids = [by_shard[k][v] for v in range(3) for k in range(3)]  # each step: one prompt of each shard
    refs = {}
    for pid in pids:
        s = keys.shard(keys.shard_of(pid))
        eid = r.xadd(s.scored, {"d": b"x"}).decode()
        r.xreadgroup(TRAINER_GROUP, "trainer", {s.scored: ">"}, count=1)
        refs[pid] = eid if s.index == 0 else f"{s.index}/{eid}"
    steps = [StepRecord(version=v + 1, entry_ids=[refs[p] for p in pids[3 * v: 3 * v + 3]],
                        outcomes={p: f"trained:{v + 1}" for p in pids[3 * v: 3 * v + 3]},
                        counts={"groups_trained_total": 3}) for v in range(3)]
    commit(r, keys, steps[:2])
    # A crash after shard 0's MULTI of the next commit: shard 0 has step 3, the others not.
    s0 = keys.shard(0)
    mine = {p: o for p, o in steps[2].outcomes.items() if keys.shard_of(p) == 0}
    assert mine, "the crash left one shard committed and the others not"
    pipe = r.pipeline(transaction=True)
    for pid, outcome in mine.items():
        pipe.hsetnx(s0.ledger, pid, outcome)
        pipe.xadd(s0.trainlog, {"prompt_id": pid, "group_id": "", "outcome": outcome, "version": 3})
    pipe.xack(s0.scored, TRAINER_GROUP, *[x for x in steps[2].entry_ids if "/" not in x])
    pipe.hincrby(s0.stats, "groups_trained_total", 3)
    pipe.set(s0.committed, 3)
    pipe.execute()
    assert int(r.hget(keys.trainer, "committed_version")) == 2
    commit(r, keys, steps[2:])  # the resumed trainer re-applies step 3
    commit(r, keys, steps[2:])  # and once more: nothing changes
    logged = [f[b"prompt_id"].decode() for s in keys.all_shards() for _, f in r.xrange(s.trainlog)]
    assert sorted(logged) == sorted(pids), "every prompt in the training log exactly once"
    assert read_stats(r, keys)["groups_trained_total"] == 9
    assert [shard_committed(r, keys, k) for k in range(3)] == [3, 3, 3]
    assert int(r.hget(keys.trainer, "committed_version")) == 3
    assert all(r.xpending(s.scored, TRAINER_GROUP)["pending"] == 0 for s in keys.all_shards())


def _run(tmp_path, base, *extra: str, command: str = "up") -> subprocess.Popen:
    """The small run on a local three-master Redis Cluster, every stream in 3 shards."""
    return up(tmp_path, base, "--task.heldout_size", "20", "--trainer.eval_every", "100",
              "--cluster.progress_every_s", "1", "--redis.cluster", "true", "--redis.shards", "3",
              "--cluster.generators", "1", "--cluster.verifiers", "1", *extra, command=command)


def _entries_added(r, key: str) -> int:
    return int(r.xinfo_stream(key)["entries-added"])


@pytest.mark.slow
def test_up_on_a_three_master_cluster_trains_and_accounts_for_every_prompt(tmp_path, redis_cluster, cluster_client,
                                                                           tiny_base_model):
    p = _run(tmp_path, tiny_base_model, "--run-id", "sharded", "--trainer.steps", "4",
             "--redis.url", redis_cluster.url)
    out = p.communicate(timeout=400)[0].decode()
    assert p.returncode == 0, out[-4000:]
    summary = json.loads((tmp_path / "runs" / "sharded" / "summary.json").read_text())
    a = summary["accounting"]
    assert summary["status"] == "finished" and summary["steps"] == 4, out[-3000:]
    assert a["ok"] and a["lost"] == 0 and a["duplicated"] == 0 and a["unexpected"] == 0, a
    assert a["trained"] + a["nosignal"] + a["stale"] == 16
    keys = Keys("sharded", shards=3, cluster=True)
    r = cluster_client
    for s in keys.all_shards():
        for name in ("prompts", "rollouts", "scored"):
            assert _entries_added(r, getattr(s, name)) > 0, f"shard {s.index}'s {name} never got an entry"
        assert r.xlen(s.trainlog) > 0 and r.hlen(s.ledger) == r.xlen(s.trainlog)
        assert int(r.get(s.committed)) == 4
    assert sum(r.hlen(s.ledger) for s in keys.all_shards()) == 16


@pytest.mark.slow
def test_a_master_killed_and_restarted_mid_run_loses_and_repeats_nothing(tmp_path, tiny_base_model):
    p = _run(tmp_path, tiny_base_model, "--run-id", "clchaos", "--trainer.steps", "6", "--chaos.schedule", "redis",
             "--redis.claim_idle_ms", "1500", command="chaos")
    out = p.communicate(timeout=500)[0].decode()
    assert p.returncode == 0, out[-4000:]
    summary = json.loads((tmp_path / "runs" / "clchaos" / "summary.json").read_text())
    chaos = summary["chaos"]
    assert [e["target"] for e in chaos["events"]] == ["redis"], chaos
    assert "of master redis://127.0.0.1:" in chaos["events"][0]["detail"], chaos
    # The first restart hits master 0 (slots 0..5460), which serves shard 2 of this run.
    assert _slot("{clchaos/2}") < 16384 // 3 and Keys("clchaos", shards=3).shard(2).prompts == "{clchaos/2}:prompts"
    v = chaos["verdict"]
    assert v["ok"] and v["finished"], v
    assert v["lost"] == 0 and v["duplicated"] == 0 and v["unexpected"] == 0
    assert v["trained"] + v["nosignal"] + v["dropped_stale"] == 6 * 4, "every step's groups were committed once"
    assert "PASS" in out
