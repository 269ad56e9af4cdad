"""Generator: samples G completions per prompt with the current policy.

consumes:     PromptTask records from {ns}:prompts (group "generators"), acked with the output
produces:     RolloutGroup records on {ns}:rollouts, with behaviour log-probs and policy version
waits for:    admission (DESIGN §3): groups admitted < (η + v + 1)·B; then for a prompt
unblocked by: the trainer publishing version v+1 ({ns}:versions); the feeder adding prompts
Weights swap only between generation batches, so no batch runs on half-written weights.
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import torch

from pipeline.config import RunConfig
from pipeline.keys import GENERATORS_GROUP, VERIFIERS_GROUP, Keys
from pipeline.model import load_checkpoint, load_state_tensors, sample
from pipeline.records import PromptTask, RecordError, RolloutGroup, check_token_ids
from pipeline.streams import (FIELD, Admission, VersionWatch, dead_letter, decode_entries, ensure_all_groups,
                              group_reader, heartbeat, incr_stats, stop_requested, trim_acked, wait_for_room)
from pipeline.task import prompt_length
from pipeline.weights import WeightsError, fetcher_options, make_fetcher


TRIM_EVERY = 10
"""Batches between trims of the acked prompts."""


def swap_weights(fetcher, model, version: int, log) -> int:
    """Load the newest published version if it is newer; on any defect keep the old weights."""
    latest = fetcher.latest_version()
    if latest <= version:
        return version
    t0 = time.perf_counter()
    try:
        # Views of the fetcher's verified second buffer, copied into the model right here.
        new_version, tensors = fetcher.fetch(latest, copy=False)
        load_state_tensors(model, tensors)
    except (WeightsError, ValueError) as e:
        log.warning("weights_fetch_failed", version=latest, error=str(e), keeping=version)
        return version
    log.info("weights_swapped", from_version=version, to_version=new_version, seconds=time.perf_counter() - t0)
    return new_version


def check_prompt(t: PromptTask, *, prompt_len: int, vocab_size: int) -> None:
    """Defects only the generator can see: a prompt of the wrong length or with unknown tokens."""
    if t.prompt_ids.size != prompt_len:
        raise RecordError(f"prompt has {t.prompt_ids.size} tokens, this task's prompts have {prompt_len}")
    check_token_ids("prompt", t.prompt_ids, vocab_size)


def to_groups(tasks: list[PromptTask], tokens, logprobs, lengths, *, tok, group_size: int, worker_id: str,
              batch: int, version: int) -> list[RolloutGroup]:
    """One RolloutGroup per task from a batch sampled with each prompt repeated ``group_size`` times."""
    out = []
    for i, t in enumerate(tasks):
        rows = range(i * group_size, (i + 1) * group_size)
        out.append(RolloutGroup(
            prompt_id=t.prompt_id, group_id=f"{t.prompt_id}:{worker_id}:{batch}", generator_id=worker_id,
            prompt=t.prompt, prompt_ids=t.prompt_ids, reference=t.reference,
            completions=tuple(tok.decode(tokens[j, : lengths[j]].tolist()) for j in rows),
            completion_ids=np.concatenate([tokens[j, : lengths[j]].numpy() for j in rows]).astype(np.int32),
            completion_lens=lengths[rows.start: rows.stop].numpy().astype(np.int32),
            behaviour_logprobs=np.concatenate([logprobs[j, : lengths[j]].numpy() for j in rows]).astype(np.float32),
            min_version=version, max_version=version, created_at=time.time()))
    return out


def run_generator(cfg: RunConfig, r, keys: Keys, worker_id: str, log, *, max_batches: int | None = None) -> int:
    """Generate until stopped (or ``max_batches`` batches); returns groups produced."""
    g = cfg.generator
    torch.set_num_threads(g.threads)
    model, tok = load_checkpoint(cfg.model.base_dir)
    model.eval()
    ensure_all_groups(r, keys)
    fetcher = make_fetcher(cfg.weights.transport, r, keys.weights, **fetcher_options(cfg.weights))
    admission = Admission(r, keys, max_staleness=cfg.trainer.max_staleness, groups_per_step=cfg.trainer.groups_per_step)
    watch = VersionWatch(r, keys)
    reader = group_reader(r, keys.prompts, GENERATORS_GROUP, worker_id, cfg.redis)
    rng = torch.Generator().manual_seed(g.seed * 1_000_003 + zlib.crc32(worker_id.encode()))
    plen = prompt_length(cfg.task.digits)
    version, batches, produced = 0, 0, 0
    log.info("generator_started", group_size=g.group_size, transport=cfg.weights.transport)
    while not stop_requested(r, keys) and (max_batches is None or batches < max_batches):
        version = swap_weights(fetcher, model, version, log)
        # Backpressure before taking work: the verifiers have not drained what we wrote.
        wait_for_room(r, keys, keys.rollouts, VERIFIERS_GROUP, bound=cfg.redis.max_stream_lag,
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
                                   lambda t: check_prompt(t, prompt_len=plen, vocab_size=tok.vocab_size), reader=reader)
        pipe = r.pipeline(transaction=True)
        for e, reason in bad:
            log.warning("dead_letter", id=e.id, reason=reason)
            dead_letter(pipe, keys, stream=keys.prompts, group=GENERATORS_GROUP, entry=e, reason=reason,
                        consumer=worker_id, release_admission=True)
        if good:
            batches += 1
            heartbeat(r, keys, worker_id, "generator", "generating", version=version, groups=produced)
            t0 = time.perf_counter()
            prompt_ids = torch.from_numpy(np.stack([t.prompt_ids for _, t in good]).astype(np.int64))
            tokens, logprobs, lengths = sample(
                model, prompt_ids.repeat_interleave(g.group_size, dim=0), max_new_tokens=cfg.task.max_new_tokens,
                temperature=g.temperature, eos_id=tok.eos_id, pad_id=tok.pad_id, generator=rng)
            for (e, _), rec in zip(good, to_groups([t for _, t in good], tokens, logprobs, lengths, tok=tok,
                                                    group_size=g.group_size, worker_id=worker_id,
                                                    batch=batches, version=version)):
                pipe.xadd(keys.rollouts, {FIELD: rec.encode()})
                pipe.xack(keys.prompts, GENERATORS_GROUP, e.id)
            incr_stats(pipe, keys, groups_generated_total=len(good), tokens_generated_total=int(lengths.sum()),
                       generate_seconds_total=time.perf_counter() - t0)
            produced += len(good)
            log.info("batch_generated", groups=len(good), version=version, seconds=round(time.perf_counter() - t0, 4),
                     tokens=int(lengths.sum()),
                     prompt_ids=[t.prompt_id for _, t in good])
        pipe.execute()
        if cfg.redis.trim_acked and batches % TRIM_EVERY == 0:
            trim_acked(r, keys.prompts)
    log.info("generator_stopped", groups=produced, version=version)
    return produced
