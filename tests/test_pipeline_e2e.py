"""The whole pipeline as separate OS processes against a real server, for a few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from pipeline.run.accounting import account
from harness import run_stages, spawn, tiny_config
from pipeline.keys import Keys

pytestmark = pytest.mark.slow

STEPS = 4
B = 4


def _config(tmp_path: Path, base_dir: Path, url: str, run_id: str, **overrides):
    return tiny_config(tmp_path, base_dir, url, run_id, **{"trainer.steps": STEPS, **overrides})


def _events(cfg, worker: str) -> list[dict]:
    return [json.loads(x) for x in (cfg.run_dir / "logs" / f"{worker}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("eta, transport", [(1, "shm"), (0, "tcp")])
def test_all_stages_as_processes_train_account_and_respect_staleness(tmp_path, tiny_base_model, redis_url, eta,
                                                                     transport):
    cfg, path = _config(tmp_path, tiny_base_model, redis_url, f"e2e-eta{eta}",
                        **{"trainer.max_staleness": eta, "weights.transport": transport})
    run_stages(cfg, path, redis_url)
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cfg.run_id)

    # Accounting: every issued prompt is trained, dropped, dead-lettered or still in flight; none twice.
    acc = account(r, keys)
    assert acc["ok"], acc
    assert acc["lost"] == 0 and acc["unexpected"] == 0 and acc["trained_once"]
    assert acc["trained"] + acc["nosignal"] + acc["stale"] == STEPS * B

    # Staleness bound held for everything trained, and η = 0 means every group was on-policy.
    steps = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        trained_staleness = s["staleness_hist"][: eta + 1]
        assert sum(trained_staleness) == s["groups_trained"] + s["groups_nosignal"]
        if eta == 0:
            assert s["staleness_hist"] == [B]

    # Generators swapped in the trainer's versions between batches, in increasing order.
    swapped = [e["to_version"] for g in ("gen-0", "gen-1") for e in _events(cfg, g) if e["event"] == "weights_swapped"]
    assert swapped and max(swapped) >= STEPS - eta - 1
    for g in ("gen-0", "gen-1"):
        seq = [e["to_version"] for e in _events(cfg, g) if e["event"] == "weights_swapped"]
        assert seq == sorted(seq)
        versions = [e["version"] for e in _events(cfg, g) if e["event"] == "batch_generated"]
        assert versions == sorted(versions) and all(v <= STEPS for v in versions)

    # Admission (docs/design.md §3): never more than (η + v + 1)·B groups admitted.
    assert int(r.get(keys.admitted)) <= (eta + STEPS + 1) * B
    # The final checkpoint loads through safetensors.
    assert (cfg.run_dir / "checkpoints" / "final" / "model.safetensors").exists()

    # The inspection commands read the same numbers back.
    cli = [sys.executable, "-m", "pipeline.cli"]
    shown = json.loads(subprocess.run([*cli, "account", "--config", str(path)], capture_output=True, text=True,
                                      check=True).stdout)
    assert shown["ok"] and shown["trained"] == acc["trained"]
    status = json.loads(subprocess.run([*cli, "status", "--config", str(path)], capture_output=True, text=True,
                                       check=True).stdout)
    assert int(status["trainer"]["version"]) == STEPS and status["queues"]["scored"]["length"] == r.xlen(keys.shard(0).scored)


def test_a_malformed_rollout_is_dead_lettered_and_the_verifier_keeps_going(tmp_path, tiny_base_model, redis_url):
    from builders import make_rollout

    cfg, path = _config(tmp_path, tiny_base_model, redis_url, "dlq")
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cfg.run_id)
    from pipeline.bus.streams import ensure_all_groups

    ensure_all_groups(r, keys)
    r.xadd(keys.shard(0).rollouts, {"d": b"\x93not a record"})
    r.xadd(keys.shard(0).rollouts, {"d": make_rollout(prompt_id="p1", completions=("357", "358", "357", "1")).encode()})
    r.xadd(keys.shard(0).rollouts, {"other": b"no payload field"})
    p = spawn(path, "verify", "--worker-id", "ver-0", "--max-batches", "1", "--verifier.reward", "majority")
    out = p.communicate(timeout=120)[0].decode()
    assert p.returncode == 0, out
    dead = r.xrange(keys.shard(0).dead)
    assert len(dead) == 2
    reasons = sorted(f[b"reason"].decode() for _, f in dead)
    assert any("not MessagePack" in x or "not a map" in x for x in reasons), reasons
    assert any("no payload" in x for x in reasons), reasons
    assert r.xlen(keys.shard(0).scored) == 1
    info = {g["name"].decode(): g for g in r.xinfo_groups(keys.shard(0).rollouts)}
    assert info["verifiers"]["pending"] == 0, "everything was acked: scored or dead-lettered"


def test_a_stage_without_a_server_says_so_and_waits_or_fails_with_a_clear_message(tmp_path, tiny_base_model):
    """A stage waits for its server by default (redis.worker_retries -1), saying so on its
    output; with a finite budget it gives up, exit code 3, with the URL it could not reach."""
    cfg, path = _config(tmp_path, tiny_base_model, "redis://127.0.0.1:1/0", "noserver")
    waiting = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "feed", "--config", str(path)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})  # its output survives the kill
    try:
        time.sleep(4)
        assert waiting.poll() is None, "the default is to wait for the server"
    finally:
        waiting.kill()
    out = waiting.communicate(timeout=30)[0]
    assert "redis_unreachable" in out and "Connection refused" in out and "until it answers" in out, out
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "feed", "--config", str(path),
                        "--redis.worker_retries", "10"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 3
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in p.stderr
    assert time.time() - t0 > 1, "it retried with backoff before giving up"
