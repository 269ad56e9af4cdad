"""Run counters, worker heartbeats and queue depths, summed over a stream's shards.
"""

from __future__ import annotations

import json
import os
import time

import redis

from pipeline.bus.streams import LAG_COUNT_CAP, group_lag
from pipeline.keys import Keys, ShardKeys


def heartbeat(r: redis.Redis, keys: Keys, worker_id: str, stage: str, state: str, **extra) -> None:
    r.hset(keys.workers, worker_id, json.dumps(
        {"stage": stage, "pid": os.getpid(), "state": state, "at": time.time(), **extra}))


def incr_stats(pipe: redis.Redis | redis.client.Pipeline, shard: ShardKeys, **counts: float) -> None:
    """Add to the counters of ``shard`` (so the increments join that shard's MULTI)."""
    for name, n in counts.items():
        if n:
            if isinstance(n, float) and not n.is_integer():
                pipe.hincrbyfloat(shard.stats, name, n)
            else:
                pipe.hincrby(shard.stats, name, int(n))


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
