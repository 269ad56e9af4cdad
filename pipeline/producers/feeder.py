"""Feeder: streams training prompts into ``{ns}:prompts`` with a bounded backlog.

consumes:     the task's endless training stream (pipeline.tasks.registry; never a held-out problem),
              each prompt rendered and encoded by pipeline.tasks.prompting.build_prompt
produces:     PromptTask records on {ns}:prompts, ids p00000000, p00000001, ...; with S shards,
              prompt p goes to shard crc32(p) mod S (``Keys.shard_of``)
waits for:    the generators' group lag (all shards) to fall below ``feeder.backlog``
unblocked by: generators reading prompts

Resume is exact: prompts are written in id order, each run of consecutive prompts bound
for one shard in one transaction (``_WRITE``) that also sets that shard's ``prompts_issued``
to the id after its last prompt, so the maximum over shards (``read_stats``) is where the
stream resumes. That position is also the transaction's idempotency token: it checks it
first and writes nothing if the shard already has it, so a write redis-py sends again after
a lost reply adds no prompt twice.
"""

from __future__ import annotations

import itertools
import time

from pipeline.config import RunConfig
from pipeline.keys import Keys
from pipeline.records import PromptTask
from pipeline.bus.connection import ride_outages
from pipeline.bus.flow import stop_requested
from pipeline.bus.stats import heartbeat, queue_depths, read_stats
from pipeline.bus.streams import ensure_all_groups
from pipeline.tasks.prompting import build_prompt, prompt_format
from pipeline.tasks.registry import make_task

IDLE_WAIT_S = 0.2
"""No blocking read exists for "the backlog shrank", so the feeder re-checks at this period."""


# One run of consecutive prompts bound for one shard. KEYS: prompts, stats (one shard's slot).
# ARGV: the position after the run's last prompt, then the PromptTask records (each in the
# field ``d``, bus.streams.FIELD).
# Returns the prompts written (0: the shard already had them).
_WRITE = """
if tonumber(redis.call('HGET', KEYS[2], 'prompts_issued') or '0') >= tonumber(ARGV[1]) then return 0 end
for i = 2, #ARGV do redis.call('XADD', KEYS[1], '*', 'd', ARGV[i]) end
redis.call('HSET', KEYS[2], 'prompts_issued', ARGV[1])
return #ARGV - 1
"""


def prompt_id(seq: int) -> str:
    return f"p{seq:08d}"


def write_prompts(script, keys: Keys, shard: int, end: int, records: list[bytes]) -> int:
    """Write one run of prompts to ``shard`` with its position ``end`` (the id after the last), once."""
    s = keys.shard(shard)
    return int(script(keys=[s.prompts, s.stats], args=[end, *records]))


def run_feeder(cfg: RunConfig, r, keys: Keys, log, *, tokenizer, max_rounds: int | None = None) -> int:
    """Issue prompts until stopped (or ``feeder.max_prompts``); returns prompts issued by this call."""
    if cfg.redis.worker_retries < 0:
        ride_outages(r, log)
    ensure_all_groups(r, keys)
    write = r.register_script(_WRITE)
    problems = make_task(cfg.task).training(cfg.feeder.seed)
    fmt = prompt_format(cfg.task, cfg.model.base_dir)
    # A restarted feeder resumes the same deterministic problem stream where it stopped.
    seq = int(read_stats(r, keys).get("prompts_issued", 0))
    problems = itertools.islice(problems, seq, None)
    issued = 0
    rounds = 0
    log.info("feeder_started", resume_from=seq, backlog=cfg.feeder.backlog)
    while not stop_requested(r, keys) and (max_rounds is None or rounds < max_rounds):
        rounds += 1
        if cfg.feeder.max_prompts and seq >= cfg.feeder.max_prompts:
            log.info("feeder_exhausted", issued=seq)
            break
        room = cfg.feeder.backlog - queue_depths(r, keys, lag_cap=cfg.feeder.backlog + 1)["prompts"]["lag"]
        if cfg.feeder.max_prompts:
            room = min(room, cfg.feeder.max_prompts - seq)
        if room <= 0:
            heartbeat(r, keys, "feeder", "feeder", "backlog_full")
            time.sleep(IDLE_WAIT_S)
            continue
        run: list[bytes] = []
        shard = -1

        def flush() -> None:
            if run:
                write_prompts(write, keys, shard, seq, run)
                run.clear()

        for p in itertools.islice(problems, room):
            text, ids = build_prompt(fmt, tokenizer, p.prompt)
            rec = PromptTask(prompt_id=prompt_id(seq), prompt=text, prompt_ids=ids, reference=p.reference,
                             issued_at=time.time())
            k = keys.shard_of(rec.prompt_id)
            if k != shard:
                flush()
                shard = k
            run.append(rec.encode())
            seq += 1
            issued += 1
        flush()
        heartbeat(r, keys, "feeder", "feeder", "issued", issued=seq)
    log.info("feeder_stopped", issued=issued, total=seq)
    return issued


