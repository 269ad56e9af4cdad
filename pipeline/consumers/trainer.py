"""Trainer: GRPO on bounded-staleness batches of scored groups; publishes each new version.

consumes:     ScoredGroup records from {ns}:scored (group "trainer"), acked once a checkpoint
              holds the step that consumed them (pipeline.run.checkpoint)
produces:     policy version v+1 after each step ({ns}:weights, {ns}:versions); the ledger
              entry and training-log entry of every consumed prompt ({ns}:ledger,
              {ns}:trainlog); metrics.jsonl; checkpoints; a final HF checkpoint
waits for:    groups_per_step (B) scored groups
unblocked by: verifiers
Staleness is checked at consumption: a group with v − min_version > η is dropped
(acked, counted, recorded), and the invariant is re-checked on what is trained.
A restarted trainer resumes from its latest checkpoint (model, optimizer, schedule, RNG,
version) and retrains only the groups no checkpoint holds; SIGTERM finishes the current
step, checkpoints it and exits.
With sharded streams the trainer reads every scored shard; a step's commit is one MULTI
per shard (that shard's ledger, training log, acks), each recording the shard's committed
version, so a commit re-applied after a crash skips the shards that already have it.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from pipeline.run import checkpoint
from pipeline.engines import TrainEngine, make_train_engine
from pipeline.run.checkpoint import StepRecord
from pipeline.config import RunConfig
from pipeline.keys import TRAINER_GROUP, Keys
from pipeline.observe.logs import MetricsFile
from pipeline.algo.losses import NO_SIGNAL_STD
from pipeline.records import ScoredGroup, check_token_ids
from pipeline.bus.flow import release_admissions, stop_requested
from pipeline.bus.stats import incr_stats
from pipeline.bus.streams import dead_letter, decode_entries, ensure_all_groups, parse_ref, sharded_reader
from pipeline.weights import make_publisher, publisher_options


def check_scored(g: ScoredGroup, *, vocab_size: int) -> None:
    """Defects only the trainer can see: token ids its model cannot embed."""
    check_token_ids("prompt", g.rollout.prompt_ids, vocab_size)
    check_token_ids("completion", g.rollout.completion_ids, vocab_size)


def collect_batch(reader, r, keys: Keys, *, size: int, block_ms: int, log, vocab_size: int,
                  held: set[str] = frozenset()):
    """Read until ``size`` new groups are in hand; None if a stop is requested first.

    Undecodable entries, and entries past their delivery limit, are dead-lettered; a
    prompt already in the ledger (trained or dropped before, e.g. redone by a generator
    after a crash) or ``held`` by a step not yet committed is acked and counted, never
    trained twice.
    """
    batch: list[tuple] = []
    seen: set[str] = set(held)
    while len(batch) < size:
        if stop_requested(r, keys):
            return None
        entries = reader.read(size - len(batch), block_ms)
        if not entries:
            continue
        shard = keys.shard(entries[0].shard)  # one read, one shard
        pipe = r.pipeline(transaction=True)
        decoded, bad = decode_entries(entries, ScoredGroup.decode, lambda g: check_scored(g, vocab_size=vocab_size),
                                      reader=reader)
        releases = 0
        for e, reason in bad:
            log.warning("dead_letter", id=e.id, reason=reason)
            releases += dead_letter(pipe, keys, stream=shard.scored, group=TRAINER_GROUP, entry=e, reason=reason,
                                    consumer="trainer", release_admission=True)
        known = [ledger_outcome(r, keys, g.rollout.prompt_id) for _, g in decoded]
        for (e, g), outcome in zip(decoded, known):
            if outcome is not None or g.rollout.prompt_id in seen:
                log.warning("duplicate_skipped", prompt_id=g.rollout.prompt_id, group_id=g.rollout.group_id,
                            earlier=outcome.decode() if outcome else "a step not yet committed")
                pipe.xack(shard.scored, TRAINER_GROUP, e.id)
                pipe.hincrby(shard.stats, "duplicates_skipped_total", 1)
            else:
                seen.add(g.rollout.prompt_id)
                batch.append((e, g))
        pipe.execute()
        release_admissions(r, keys, releases)
    return batch


def ledger_outcome(r, keys: Keys, prompt_id: str) -> bytes | None:
    """The prompt's ledger outcome, from the ledger of the shard it is routed to."""
    return r.hget(keys.shard(keys.shard_of(prompt_id)).ledger, prompt_id)


def has_signal(g: ScoredGroup) -> bool:
    """Whether a group's rewards differ enough to give a GRPO gradient (DESIGN §3: count, skip the rest)."""
    return float(np.std(g.rewards)) >= NO_SIGNAL_STD


def classify(batch: list[tuple], *, version: int, max_staleness: int) -> list[str]:
    """Each consumed group's outcome: ``stale`` (v − min_version > η), ``trained`` or ``nosignal``."""
    return ["stale" if version - g.rollout.min_version > max_staleness else ("trained" if has_signal(g) else "nosignal")
            for _, g in batch]


def step_metrics(batch, fresh, signal, *, version: int, stats: dict, wait_s: float, step_s: float) -> dict:
    """One metrics.jsonl row: the step's counts, reward and hidden accuracy, staleness, timing, loss stats."""
    rewards = np.concatenate([g.rewards for g in fresh]) if fresh else np.zeros(0)
    truth = np.concatenate([g.truth for g in fresh]) if fresh else np.zeros(0)
    return {
        "version": version, "groups_trained": len(signal), "groups_nosignal": len(fresh) - len(signal),
        "groups_stale": len(batch) - len(fresh), "reward_mean": float(rewards.mean()) if rewards.size else 0.0,
        "reward_std": float(rewards.std()) if rewards.size else 0.0,
        "sample_accuracy": float(truth.mean()) if truth.size else 0.0,
        # Staleness as consumed: against the version before this step (row["version"] is after it).
        "staleness_hist": np.bincount([version - 1 - g.rollout.min_version for _, g in batch]).tolist(),
        "wait_seconds": wait_s, "step_seconds": step_s,
        "labelmodel_versions": sorted({g.labelmodel_version for g in fresh}), **stats,
    }


def step_record(batch, kinds: list[str], *, version: int, row: dict) -> StepRecord:
    """What a step consumed, kept until a checkpoint holds the step and ``commit`` makes it final."""
    return StepRecord(
        version=version, entry_ids=[e.ref for e, _ in batch],
        outcomes={g.rollout.prompt_id: f"{kind}:{version}" for (_, g), kind in zip(batch, kinds)},
        group_ids={g.rollout.prompt_id: g.rollout.group_id for _, g in batch},
        counts={"groups_trained_total": row["groups_trained"], "groups_nosignal_total": row["groups_nosignal"],
                "dropped_stale_total": row["groups_stale"], "tokens_trained_total": row.get("tokens", 0)})


def shard_committed(r, keys: Keys, k: int) -> int:
    """The last step whose commit is final in shard ``k``."""
    if not keys.sharded:
        return int(r.hget(keys.trainer, "committed_version") or 0)
    return int(r.get(keys.shard(k).committed) or 0)


def commit(r, keys: Keys, steps: list[StepRecord]) -> None:
    """Make checkpointed steps final: ledger (HSETNX), training log, acks, counters.

    One transaction per shard, holding that shard's prompts (by ``Keys.shard_of``) and
    entries (by ``Entry.ref``); shard 0's also carries the steps' counters. Each records
    the shard's last committed step, and steps a shard already committed are skipped, so
    re-applying a commit interrupted between shards neither repeats a training-log entry
    nor a counter. ``{ns}:trainer`` ``committed_version`` is set once every shard has it:
    a resumed trainer re-applies only the steps of its checkpoint beyond it.
    """
    if not steps:
        return
    last = steps[-1].version
    for shard in keys.all_shards():
        todo = [s for s in steps if s.version > shard_committed(r, keys, shard.index)]
        if not todo:
            continue
        pipe = r.pipeline(transaction=True)
        for s in todo:
            for pid, outcome in s.outcomes.items():
                if keys.shard_of(pid) != shard.index:
                    continue
                pipe.hsetnx(shard.ledger, pid, outcome)
                pipe.xadd(shard.trainlog, {"prompt_id": pid, "group_id": s.group_ids.get(pid, ""),
                                           "outcome": outcome, "version": s.version})
            ids = [eid for k, eid in map(parse_ref, s.entry_ids) if k == shard.index]
            if ids:
                pipe.xack(shard.scored, TRAINER_GROUP, *ids)
            if shard.index == 0:
                incr_stats(pipe, shard, **s.counts)
        if keys.sharded:
            pipe.set(shard.committed, last)
        else:
            pipe.hset(keys.trainer, "committed_version", last)
        pipe.execute()
    if keys.sharded:
        r.hset(keys.trainer, "committed_version", last)


def report_progress(r, keys: Keys, *, version: int, row: dict) -> None:
    r.hset(keys.trainer, mapping={"version": version, "reward_mean": row["reward_mean"],
                                  "sample_accuracy": row["sample_accuracy"], "updated_at": time.time()})


def run_trainer(cfg: RunConfig, r, keys: Keys, log, *, run_dir: Path | None = None,
                engine: TrainEngine | None = None) -> dict:
    """Train until the policy reaches version ``trainer.steps`` (or a stop); returns a summary.

    ``engine`` does the tensor work (``trainer.backend``; on torchtitan this process is the
    driver rank and the engine runs each operation on every rank); it is closed on return.
    """
    from pipeline.tasks.registry import make_task

    t = cfg.trainer
    if engine is None:
        engine = make_train_engine(cfg)
    tok = engine.tokenizer
    the_task = make_task(cfg.task)
    heldout = the_task.heldout()
    heldout_ids = [np.asarray(tok.encode(item.prompt), dtype=np.int32) for item in heldout]
    transport_opts = publisher_options(cfg.weights)
    metrics = MetricsFile(run_dir / "metrics.jsonl" if run_dir else None)
    ckpt_dir = run_dir / "checkpoints" if run_dir else None
    ensure_all_groups(r, keys)
    # The only consumer of its group: nothing to reclaim from others, and its own
    # uncommitted entries must not come back to it while it still holds them.
    reader = sharded_reader(r, keys, "scored", TRAINER_GROUP, "trainer", cfg.redis, claim=False)
    uncommitted: list[StepRecord] = []
    held: set[str] = set()
    labelmodel_versions: set[int] = set()

    version, evals = 0, {}
    resumed_from = checkpoint.latest(ckpt_dir) if ckpt_dir is not None and t.resume else None
    if resumed_from is not None:
        state = checkpoint.load(resumed_from)
        engine.load_state(resumed_from, state.engine)
        committed = int(r.hget(keys.trainer, "committed_version") or 0)
        reapply = [s for s in state.uncommitted if s.version > committed]
        commit(r, keys, reapply)
        version, evals = state.version, state.evals
        labelmodel_versions.update(state.labelmodel_versions)
        announced = int(r.hget(keys.trainer, "version") or 0)
        if announced > version:
            # Steps after the checkpoint published versions whose model died with the
            # process. Versions only go up: the checkpoint's model becomes the next one.
            log.warning("versions_lost_in_crash", checkpoint=version, announced=announced, resume_as=announced + 1)
            version = announced + 1
        log.info("trainer_resumed", checkpoint=str(resumed_from), version=version, reapplied_steps=len(reapply),
                 committed_before=committed)

    def durable() -> None:
        """Checkpoint, then make the checkpointed steps final (the order that loses nothing)."""
        if ckpt_dir is not None:
            checkpoint.save(ckpt_dir, write=engine.save_state, keep=t.keep_checkpoints, state=checkpoint.TrainerState(
                version=version, evals=evals,
                uncommitted=list(uncommitted), labelmodel_versions=sorted(labelmodel_versions)))
        commit(r, keys, uncommitted)
        uncommitted.clear()
        held.clear()

    def evaluate(version: int) -> float:
        t0 = time.perf_counter()
        answers = engine.greedy(heldout_ids, max_new_tokens=the_task.eval_max_new_tokens)
        acc = float(np.mean([the_task.correctness(item.reference, [a])[0] for item, a in zip(heldout, answers)]))
        metrics.write("eval", version=version, heldout_accuracy=acc, n=len(heldout))
        log.info("evaluated", version=version, heldout_accuracy=acc, seconds=round(time.perf_counter() - t0, 3))
        r.hset(keys.trainer, mapping={"eval_accuracy": acc, "eval_version": version})
        return acc

    publisher = make_publisher(cfg.weights.transport, r, keys.weights, ns=keys.ns,
                               keep_versions=cfg.weights.keep_versions, **transport_opts)

    def publish(version: int) -> None:
        # publish() copies into the transport's buffer, and that copy is the snapshot:
        # the live parameters can go in as they are.
        publisher.publish(version, engine.weights())
        r.xadd(keys.versions, {"version": version}, maxlen=10_000, approximate=True)
        r.hset(keys.trainer, "version", version)

    # The publisher owns transport resources (shm files, a tcp server thread): release
    # them however the loop ends, an interrupt included.
    try:
        publish(version)
        if version not in evals:
            evals[version] = evaluate(version)
        if resumed_from is None:
            r.hset(keys.trainer, "base_accuracy", evals[0])
        r.hset(keys.trainer, mapping={"steps": t.steps, "state": "training"})
        log.info("trainer_started", steps=t.steps, groups_per_step=t.groups_per_step, max_staleness=t.max_staleness,
                 version=version, checkpoint_every=t.checkpoint_every)
        while version < t.steps:
            t_wait = time.perf_counter()
            batch = collect_batch(reader, r, keys, size=t.groups_per_step, block_ms=cfg.redis.block_ms, log=log,
                                  vocab_size=engine.vocab_size, held=held)
            if batch is None:
                log.info("stop_requested", version=version)
                break
            t_step = time.perf_counter()
            kinds = classify(batch, version=version, max_staleness=t.max_staleness)
            fresh = [g for (_, g), k in zip(batch, kinds) if k != "stale"]
            signal = [g for (_, g), k in zip(batch, kinds) if k == "trained"]
            if any(version - g.rollout.min_version > t.max_staleness for g in signal):
                raise RuntimeError(f"staleness invariant violated at version {version}")
            stats = engine.train_step(signal) if signal else {}
            engine.lr_step()
            version += 1
            row = step_metrics(batch, fresh, signal, version=version, stats=stats, wait_s=t_step - t_wait,
                               step_s=time.perf_counter() - t_step)
            uncommitted.append(step_record(batch, kinds, version=version, row=row))
            held.update(g.rollout.prompt_id for _, g in batch)
            labelmodel_versions.update(g.labelmodel_version for g in fresh)
            # The row first: a step redone after a crash rewrites its row (readers keep the last).
            metrics.write("step", **row)
            if version % t.checkpoint_every == 0 or version >= t.steps:
                durable()
            publish(version)
            report_progress(r, keys, version=version, row=row)
            log.info("step", **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()})
            if version % t.eval_every == 0 or version == t.steps:
                evals[version] = evaluate(version)
        if uncommitted:
            durable()
        if run_dir is not None:
            engine.export_hf(run_dir / "checkpoints" / "final")
        r.hset(keys.trainer, "state", "finished" if version >= t.steps else "stopped")
    finally:
        publisher.close()
        engine.close()
    log.info("trainer_finished", version=version, evals=evals)
    return {"version": version, "evals": evals}
