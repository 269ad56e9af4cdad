"""Generator: samples G completions per prompt with the current policy.

consumes:     PromptTask records from {ns}:prompts (group "generators"), acked with the output
produces:     RolloutGroup records on {ns}:rollouts, with behaviour log-probs and policy version
waits for:    admission (DESIGN §3): groups admitted < (η + v + 1)·B; then for a prompt
unblocked by: the trainer publishing version v+1 ({ns}:versions); the feeder adding prompts
Weights swap only between generation batches, so no batch runs on half-written weights.
With sharded streams a batch comes from one shard k and its groups go to rollouts shard k,
so the xadd + xack + counters stay one single-slot MULTI.
"""

from __future__ import annotations

import time

import numpy as np

from pipeline.engines import GenerationBackend, Sampled, make_generation_backend
from pipeline.config import RunConfig
from pipeline.keys import GENERATORS_GROUP, VERIFIERS_GROUP, Keys
from pipeline.records import PromptTask, RecordError, RolloutGroup, check_token_ids
from pipeline.bus.flow import Admission, VersionWatch, release_admissions, stop_requested, wait_for_room
from pipeline.bus.stats import heartbeat, incr_stats
from pipeline.bus.streams import FIELD, dead_letter, decode_entries, ensure_all_groups, sharded_reader, trim_acked
from pipeline.tasks.arithmetic import prompt_length
from pipeline.model.tokenizer import model_context_length
from pipeline.weights import WeightsError, fetcher_options, make_fetcher


TRIM_EVERY = 10
"""Batches between trims of the acked prompts."""


def swap_weights(fetcher, backend: GenerationBackend, version: int, log) -> int:
    """Load the newest published version if it is newer; on any defect keep the old weights."""
    latest = fetcher.latest_version()
    if latest <= version:
        return version
    t0 = time.perf_counter()
    try:
        # Views of the fetcher's verified second buffer, copied into the engine right here.
        new_version, tensors = fetcher.fetch(latest, copy=False)
        backend.load_weights(tensors)
    except (WeightsError, ValueError) as e:
        log.warning("weights_fetch_failed", version=latest, error=str(e), keeping=version)
        return version
    log.info("weights_swapped", from_version=version, to_version=new_version, seconds=time.perf_counter() - t0)
    return new_version


def check_prompt(t: PromptTask, *, prompt_len: int | None, max_len: int, vocab_size: int) -> None:
    """Defects only the generator can see: a prompt of the wrong length or with unknown tokens."""
    if prompt_len is not None and t.prompt_ids.size != prompt_len:
        raise RecordError(f"prompt has {t.prompt_ids.size} tokens, this task's prompts have {prompt_len}")
    if not 1 <= t.prompt_ids.size <= max_len:
        raise RecordError(f"prompt has {t.prompt_ids.size} tokens; 1 to {max_len} leave room for the completion")
    check_token_ids("prompt", t.prompt_ids, vocab_size)


def to_groups(tasks: list[PromptTask], samples: list[Sampled], *, tok, worker_id: str, batch: int,
              version: int) -> list[RolloutGroup]:
    """One RolloutGroup per task from its ``Sampled`` completions."""
    out = []
    for t, s in zip(tasks, samples):
        rows = range(s.tokens.shape[0])
        out.append(RolloutGroup(
            prompt_id=t.prompt_id, group_id=f"{t.prompt_id}:{worker_id}:{batch}", generator_id=worker_id,
            prompt=t.prompt, prompt_ids=t.prompt_ids, reference=t.reference,
            completions=tuple(tok.decode(s.tokens[j, : s.lengths[j]].tolist()) for j in rows),
            completion_ids=np.concatenate([s.tokens[j, : s.lengths[j]] for j in rows]).astype(np.int32),
            completion_lens=s.lengths.astype(np.int32),
            behaviour_logprobs=np.concatenate([s.logprobs[j, : s.lengths[j]] for j in rows]).astype(np.float32),
            min_version=version, max_version=version, created_at=time.time()))
    return out


def run_generator(cfg: RunConfig, r, keys: Keys, worker_id: str, log, *, max_batches: int | None = None) -> int:
    """Generate until stopped (or ``max_batches`` batches); returns groups produced."""
    g = cfg.generator
    backend = make_generation_backend(cfg, worker_id=worker_id)
    ensure_all_groups(r, keys)
    fetcher = make_fetcher(cfg.weights.transport, r, keys.weights, **fetcher_options(cfg.weights))
    admission = Admission(r, keys, max_staleness=cfg.trainer.max_staleness, groups_per_step=cfg.trainer.groups_per_step)
    watch = VersionWatch(r, keys)
    reader = sharded_reader(r, keys, "prompts", GENERATORS_GROUP, worker_id, cfg.redis)
    plen = prompt_length(cfg.task.digits) if cfg.task.kind == "arithmetic" else None
    max_len = model_context_length(cfg.model.base_dir) - cfg.task.max_new_tokens
    log.info("generator_started", group_size=g.group_size, transport=cfg.weights.transport, backend=g.backend)
    try:
        produced = _generate_loop(cfg, r, keys, worker_id, log, backend=backend, fetcher=fetcher,
                                  admission=admission, watch=watch, reader=reader, plen=plen, max_len=max_len,
                                  max_batches=max_batches)
    finally:
        backend.close()
    return produced


def _generate_loop(cfg: RunConfig, r, keys: Keys, worker_id: str, log, *, backend: GenerationBackend, fetcher,
                   admission, watch, reader, plen: int | None, max_len: int, max_batches: int | None) -> int:
    g = cfg.generator
    tok = backend.tokenizer
    version, batches, produced = 0, 0, 0
    while not stop_requested(r, keys) and (max_batches is None or batches < max_batches):
        version = swap_weights(fetcher, backend, version, log)
        # Backpressure before taking work: the verifiers have not drained what we wrote.
        wait_for_room(r, keys, keys.stream_keys("rollouts"), VERIFIERS_GROUP, bound=cfg.redis.max_stream_lag,
                      worker_id=worker_id, stage="generator", log=log)
        # Already admitted: own entries left from before a restart, or a dead generator's.
        entries = reader.read_owned(g.prompts_per_batch)
        if not entries:
            granted = admission.admit(g.prompts_per_batch, version)
            if not granted:
                heartbeat(r, keys, worker_id, "generator", "waiting_admission", version=version, groups=produced)
                watch.wait(cfg.redis.block_ms)
                continue
            entries = reader.read_new(granted, cfg.redis.block_ms)
            admission.release(granted - len(entries))
        good, bad = decode_entries(entries, PromptTask.decode,
                                   lambda t: check_prompt(t, prompt_len=plen, max_len=max_len,
                                                          vocab_size=backend.vocab_size), reader=reader)
        if not entries:
            continue
        shard = keys.shard(entries[0].shard)  # one read, one shard
        pipe = r.pipeline(transaction=True)
        releases = 0
        for e, reason in bad:
            log.warning("dead_letter", id=e.id, reason=reason)
            releases += dead_letter(pipe, keys, stream=shard.prompts, group=GENERATORS_GROUP, entry=e, reason=reason,
                                    consumer=worker_id, release_admission=True)
        if good:
            batches += 1
            heartbeat(r, keys, worker_id, "generator", "generating", version=version, groups=produced)
            t0 = time.perf_counter()
            samples = backend.generate([t.prompt_ids for _, t in good], n=g.group_size,
                                       max_new_tokens=cfg.task.max_new_tokens, temperature=g.temperature)
            n_tokens = int(sum(int(s.lengths.sum()) for s in samples))
            for (e, _), rec in zip(good, to_groups([t for _, t in good], samples, tok=tok, worker_id=worker_id,
                                                    batch=batches, version=version)):
                pipe.xadd(shard.rollouts, {FIELD: rec.encode()})
                pipe.xack(shard.prompts, GENERATORS_GROUP, e.id)
            incr_stats(pipe, shard, groups_generated_total=len(good), tokens_generated_total=n_tokens,
                       generate_seconds_total=time.perf_counter() - t0)
            produced += len(good)
            log.info("batch_generated", groups=len(good), version=version, seconds=round(time.perf_counter() - t0, 4),
                     tokens=n_tokens,
                     prompt_ids=[t.prompt_id for _, t in good])
        pipe.execute()
        release_admissions(r, keys, releases)
        if cfg.redis.trim_acked and batches % TRIM_EVERY == 0:
            for key in keys.stream_keys("prompts"):
                trim_acked(r, key)
    log.info("generator_stopped", groups=produced, version=version)
    return produced
