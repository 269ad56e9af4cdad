"""A run's streams in a known, busy state, written to a real Redis for the observability tests."""

from __future__ import annotations

import json
import time

import redis

from pipeline.keys import GENERATORS_GROUP, VERIFIERS_GROUP, Keys
from pipeline.bus.stats import heartbeat, incr_stats
from pipeline.bus.streams import FIELD, ensure_all_groups
from tests.builders import make_prompt, make_rollout, make_scored


def fill_streams(r: redis.Redis, keys: Keys, *, prompts: int = 12, rollouts: int = 7, scored: int = 3) -> None:
    """Streams with undelivered, pending, redelivered and acked entries; dead letters; stats; heartbeats.

    prompts:  ``prompts`` entries; gen-0 reads 5 and acks 2, gen-1 reads 2 and reads one of
              them again (delivery count 2); the rest are undelivered (lag).
    rollouts: ``rollouts`` entries; ver-0 reads 4 and acks all of them.
    scored:   ``scored`` entries; nothing read.
    dead:     2 entries.
    """
    ensure_all_groups(r, keys)
    for i in range(prompts):
        r.xadd(keys.shard(0).prompts, {FIELD: make_prompt(prompt_id=f"p{i:08d}").encode()})
    for i in range(rollouts):
        r.xadd(keys.shard(0).rollouts, {FIELD: make_rollout(prompt_id=f"p{i:08d}").encode()})
    for i in range(scored):
        r.xadd(keys.shard(0).scored, {FIELD: make_scored(prompt_id=f"p{i:08d}").encode()})
    got = r.xreadgroup(GENERATORS_GROUP, "gen-0", {keys.shard(0).prompts: ">"}, count=5)[0][1]
    r.xack(keys.shard(0).prompts, GENERATORS_GROUP, got[0][0], got[1][0])
    r.xreadgroup(GENERATORS_GROUP, "gen-1", {keys.shard(0).prompts: ">"}, count=2)
    r.xreadgroup(GENERATORS_GROUP, "gen-1", {keys.shard(0).prompts: "0"}, count=1)  # a redelivery
    got = r.xreadgroup(VERIFIERS_GROUP, "ver-0", {keys.shard(0).rollouts: ">"}, count=4)[0][1]
    r.xack(keys.shard(0).rollouts, VERIFIERS_GROUP, *[e[0] for e in got])
    for reason in ("bad schema", "too long"):
        r.xadd(keys.shard(0).dead, {"reason": reason, "stream": keys.shard(0).prompts, "id": "0-1", "payload": b""})
    pipe = r.pipeline()
    incr_stats(pipe, keys.shard(0), dead_letters_total=2, dropped_stale_total=3, tokens_generated_total=1000,
               tokens_trained_total=640, groups_generated_total=9)
    pipe.hset(keys.trainer, mapping={"version": 4, "steps": 10, "reward_mean": 0.625, "sample_accuracy": 0.5,
                                     "eval_accuracy": 0.41, "base_accuracy": 0.3, "state": "training"})
    pipe.execute()
    heartbeat(r, keys, "gen-0", "generator", "generating", version=4)
    heartbeat(r, keys, "ver-0", "verifier", "idle")
    r.hset(keys.workers, "trainer", json.dumps({"stage": "trainer", "pid": 1, "state": "training",
                                                "at": time.time() - 5}))


def group_info(r: redis.Redis, key: str, group: str) -> dict:
    """The server's own numbers for one group, straight from XINFO GROUPS."""
    return next(g for g in r.xinfo_groups(key) if g["name"].decode() == group)
