"""End-to-end accounting: what became of every prompt the feeder issued.

Each issued prompt ends in exactly one of: trained, nosignal (consumed by the trainer
but all rewards equal, so no gradient), stale (dropped by the staleness bound),
dead-lettered, or still in flight when the run stopped (waiting in, or delivered but
unacked from, one of the streams). Anything else is lost; a ledger entry for a prompt
never issued is unexpected. The ledger is written with HSETNX, so a prompt can have
one outcome only; duplicates that reached the trainer are counted when skipped.

Independent evidence of double training comes from ``{ns}:trainlog``, which the trainer
appends to unconditionally for every group a committed step consumed: a prompt that
appears there twice was trained (or dropped) twice, whatever the ledger says. The
issued set is the feeder's deterministic id sequence (``prompts_issued`` ids, p00000000
onwards), so it survives the trimming of acked prompts.

With sharded streams every per-shard key (ledger, training log, dead letters, the three
streams, counters) is read in each shard and merged.
"""

from __future__ import annotations

from collections import Counter

import msgpack

from pipeline.keys import Keys
from pipeline.records import PromptTask, RecordError
from pipeline.bus.stats import read_stats
from pipeline.producers.feeder import prompt_id

PAGE = 1000


def _xrange_all(r, key: str, start: str = "-"):
    while True:
        page = r.xrange(key, min=start, max="+", count=PAGE)
        yield from page
        if len(page) < PAGE:
            return
        start = "(" + page[-1][0].decode()


def _prompt_id(payload: bytes | None) -> str | None:
    """The prompt id in any record's bytes, without trusting the rest of it."""
    if not payload:
        return None
    try:
        d = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:
        return None
    if not isinstance(d, dict):
        return None
    rollout = d.get("rollout")
    pid = rollout.get("prompt_id") if isinstance(rollout, dict) else d.get("prompt_id")
    return pid if isinstance(pid, str) else None


def _unacked_prompt_ids(r, key: str, group: str) -> set[str]:
    """Prompt ids of entries the group has not acked: never delivered, or delivered and pending."""
    ids: set[str] = set()
    last = b"0-0"
    for g in r.xinfo_groups(key):
        if g["name"].decode() == group:
            last = g["last-delivered-id"]
    for _, fields in _xrange_all(r, key, "(" + last.decode()):
        ids.add(_prompt_id(fields.get(b"d")))
    pending = r.xpending_range(key, group, min="-", max="+", count=1_000_000)
    for p in pending:
        entry = r.xrange(key, min=p["message_id"], max=p["message_id"])
        if entry:
            ids.add(_prompt_id(entry[0][1].get(b"d")))
    ids.discard(None)
    return ids


def issued_ids(r, keys: Keys) -> set[str]:
    """Every prompt id the feeder issued: its id sequence, plus any still-decodable prompt entry."""
    n = int(read_stats(r, keys).get("prompts_issued", 0))
    issued = {prompt_id(i) for i in range(n)}
    for key in keys.stream_keys("prompts"):
        for _, fields in _xrange_all(r, key):
            try:
                issued.add(PromptTask.decode(fields.get(b"d")).prompt_id)
            except RecordError:
                pass  # a malformed entry was never a prompt the feeder issued
    return issued


def trainlog_counts(r, keys: Keys) -> Counter:
    """How many committed steps consumed each prompt id, from the append-only training log."""
    return Counter(f[b"prompt_id"].decode() for key in keys.stream_keys("trainlog") for _, f in _xrange_all(r, key))


def account(r, keys: Keys) -> dict:
    issued = issued_ids(r, keys)
    ledger = {k.decode(): v.decode() for key in keys.stream_keys("ledger") for k, v in r.hgetall(key).items()}
    outcomes = Counter(v.split(":", 1)[0] for pid, v in ledger.items() if pid in issued)
    dead_ids = {_prompt_id(f.get(b"payload")) or f.get(b"prompt_id", b"").decode()
                for key in keys.stream_keys("dead") for _, f in _xrange_all(r, key)}
    dead = (dead_ids & issued) - set(ledger)
    # Each remaining prompt is placed at the furthest stage that still holds it unacked.
    remaining = issued - set(ledger) - dead
    in_flight: dict[str, int] = {}
    for name in ("scored", "rollouts", "prompts"):
        held = set()
        for shard in keys.all_shards():
            key, group = shard.streams()[name]
            held |= _unacked_prompt_ids(r, key, group)
        held &= remaining
        in_flight[name] = len(held)
        remaining -= held
    stats = read_stats(r, keys)
    consumed = trainlog_counts(r, keys)
    duplicated = sorted(pid for pid, n in consumed.items() if n > 1)
    result = {
        "issued": len(issued),
        "trained": outcomes.get("trained", 0),
        "nosignal": outcomes.get("nosignal", 0),
        "stale": outcomes.get("stale", 0),
        "dead_lettered": len(dead),
        "in_flight": in_flight,
        "lost": len(remaining),
        "lost_ids": sorted(remaining)[:20],
        "duplicated": len(duplicated),
        "duplicated_ids": duplicated[:20],
        "unexpected": len((set(ledger) | set(consumed)) - issued),
        "dead_letters_total": sum(int(r.xlen(key)) for key in keys.stream_keys("dead")),
        "duplicates_skipped": int(stats.get("duplicates_skipped_total", 0)),
        # The trainer counts the groups it trained per committed step; a group trained
        # twice would make this exceed the ledger's count of trained prompts.
        "groups_trained_by_steps": int(stats.get("groups_trained_total", 0)),
    }
    total = (result["trained"] + result["nosignal"] + result["stale"] + result["dead_lettered"]
             + sum(in_flight.values()) + result["lost"])
    result["adds_up"] = total == result["issued"]
    result["trained_once"] = (result["groups_trained_by_steps"] == result["trained"] and not duplicated
                              and sum(consumed.values()) == len(ledger))
    result["ok"] = (result["adds_up"] and result["trained_once"] and result["lost"] == 0
                    and result["unexpected"] == 0)
    return result
