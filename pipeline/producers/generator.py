"""Generator: samples G completions per prompt with the current policy.

consumes:     PromptTask records from {ns}:prompts (group "generators"), acked with the output
produces:     RolloutGroup records on {ns}:rollouts, with behaviour log-probs and policy version
waits for:    admission (docs/design.md §3): groups admitted < (η + v + 1)·B; then for a prompt
unblocked by: the trainer publishing version v+1 ({ns}:versions); the feeder adding prompts
Weights swap only between generation batches, so no batch runs on half-written weights.
A batch comes from one shard k and its groups go to rollouts shard k, so the xadd + xack +
counters stay one single-slot MULTI (``pipeline.stage``).

The loop (``Stage.run``): swap in the newest weights → wait for room downstream → take
admitted prompts (own or reclaimed first, else as many new ones as admission grants) →
sample G completions per prompt → emit the groups and ack the prompts in one MULTI.
"""

from __future__ import annotations

import time

import numpy as np

from pipeline.bus.flow import Admission, VersionWatch
from pipeline.bus.streams import Entry
from pipeline.config import RunConfig
from pipeline.engines import GenerationBackend, Sampled, make_generation_backend
from pipeline.keys import GENERATORS_GROUP, VERIFIERS_GROUP, Keys
from pipeline.model.tokenizer import model_context_length
from pipeline.records import PromptTask, RecordError, RolloutGroup, check_token_ids
from pipeline.stage import Batch, Output, Stage
from pipeline.tasks.arithmetic import prompt_length
from pipeline.weights import WeightsError, fetcher_options, make_fetcher


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


NO_PROMPT_WAIT_S = 0.05
"""Pause after an admitted read found no new prompt (the feeder keeps a backlog, so rare)."""


class Generator:
    """One generator process: its engine, weight fetcher, admission and stage plumbing."""

    def __init__(self, cfg: RunConfig, r, keys: Keys, worker_id: str, log, *,
                 backend: GenerationBackend | None = None) -> None:
        self.cfg, self.r, self.keys, self.worker_id, self.log = cfg, r, keys, worker_id, log
        self.backend = backend if backend is not None else make_generation_backend(cfg, worker_id=worker_id)
        self.fetcher = make_fetcher(cfg.weights.transport, r, keys.weights, **fetcher_options(cfg.weights))
        self.admission = Admission(r, keys, max_staleness=cfg.trainer.max_staleness,
                                   groups_per_step=cfg.trainer.groups_per_step)
        self.watch = VersionWatch(r, keys)
        plen = prompt_length(cfg.task.digits) if cfg.task.kind == "arithmetic" else None
        max_len = model_context_length(cfg.model.base_dir) - cfg.task.max_new_tokens
        self.stage = Stage(r, keys, cfg, name="generator", worker_id=worker_id, log=log, source="prompts",
                           group=GENERATORS_GROUP, decode=PromptTask.decode, sink="rollouts",
                           sink_group=VERIFIERS_GROUP,
                           check=lambda t: check_prompt(t, prompt_len=plen, max_len=max_len,
                                                        vocab_size=self.backend.vocab_size))
        self.version, self.produced = 0, 0

    def swap_weights(self) -> None:
        self.version = swap_weights(self.fetcher, self.backend, self.version, self.log)

    def read_admitted(self, count: int) -> list[Entry]:
        """Prompts already admitted (own or a dead generator's), else as many new ones as admission grants."""
        entries = self.stage.reader.read_owned(count)
        if entries:
            return entries
        if self.cfg.redis.cluster:
            granted = self.admission.admit(count, self.version)
            room = granted > 0
            if room:  # not blocking: the window in which a kill leaks the grant is one round trip
                entries = self.stage.reader.read_new(granted, None)
                self.admission.release(granted - len(entries))
        else:  # one script: a kill at any point leaks no slot
            room, entries = self.admission.admit_read(self.stage.reader, count, self.version)
        if not room:
            self.stage.heartbeat("waiting_admission", version=self.version, groups=self.produced)
            self.watch.wait(self.cfg.redis.block_ms)
            return []
        if not entries:
            time.sleep(NO_PROMPT_WAIT_S)
        return entries

    def step(self, batch: Batch) -> Output:
        """G completions of every prompt, as one RolloutGroup each."""
        g = self.cfg.generator
        tasks = batch.records
        self.stage.heartbeat("generating", version=self.version, groups=self.produced)
        t0 = time.perf_counter()
        samples = self.backend.generate([t.prompt_ids for t in tasks], n=g.group_size,
                                        max_new_tokens=self.cfg.task.max_new_tokens, temperature=g.temperature)
        groups = to_groups(tasks, samples, tok=self.backend.tokenizer, worker_id=self.worker_id,
                           batch=self.stage.batches + 1, version=self.version)
        seconds = time.perf_counter() - t0
        n_tokens = int(sum(int(s.lengths.sum()) for s in samples))
        self.produced += len(groups)
        self.log.info("batch_generated", groups=len(groups), version=self.version, seconds=round(seconds, 4),
                      tokens=n_tokens, prompt_ids=[t.prompt_id for t in tasks])
        return Output(written=[(e, grp.encode()) for (e, _), grp in zip(batch.good, groups)],
                      counters={"groups_generated_total": len(groups), "tokens_generated_total": n_tokens,
                                "generate_seconds_total": seconds})

    def close(self) -> None:
        self.backend.close()


def run_generator(cfg: RunConfig, r, keys: Keys, worker_id: str, log, *, max_batches: int | None = None,
                  backend: GenerationBackend | None = None) -> int:
    """Generate until stopped (or ``max_batches`` reads); returns groups produced.

    ``backend`` replaces the engine ``generator.backend`` names (benchmarks pass a fake one).
    """
    gen = Generator(cfg, r, keys, worker_id, log, backend=backend)
    log.info("generator_started", group_size=cfg.generator.group_size, transport=cfg.weights.transport,
             backend=cfg.generator.backend)
    try:
        gen.stage.run(gen.step, count=cfg.generator.prompts_per_batch, read=gen.read_admitted,
                      before=gen.swap_weights, max_batches=max_batches)
    finally:
        gen.close()
    log.info("generator_stopped", groups=gen.produced, version=gen.version)
    return gen.produced
