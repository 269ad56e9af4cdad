"""A small public Python API: the pipeline's parts behind a few objects, for loops you write yourself.

``API_VERSION = 1``. Everything here is a thin composition of the parts the stages use; nothing
samples, scores, trains or moves bytes on its own (docs/api.md has the full page)::

    from pipeline.api import Run

    with Run(overrides={"trainer.groups_per_step": 4}) as run:
        policy, verifiers, learner = run.policy("gen-0"), run.verifiers(), run.learner()
        scored = run.queue("scored")
        learner.publish()                                  # version 0, as the trainer does
        policy.sync()
        scored.put(verifiers.score(policy.generate(items)))
        batch = scored.get(4, consumer="me")
        learner.step([g for _, g in batch]); scored.ack([e for e, _ in batch]); learner.publish()

- ``Run(cfg=None, *, config=None, overrides=None, build_base_model=True)``: a context manager.
  On enter: the base model (``pipeline.run.launch.ensure_base_model``, as ``pipeline up``), then
  the server, the run's config file and its streams exactly as ``pipeline up`` prepares them
  (``launch.provision_cluster``: ``bus.server.provision``, ``bus.connection.connect``,
  ``bus.streams.ensure_all_groups``), then the task (``tasks.registry.make_task``). On exit:
  the objects it made are closed and a server it started is stopped (one it only reached is
  left running). Attributes: ``cfg``, ``keys``, ``r``, ``task``, ``server``; ``stopped()``
  (the run's ``{ns}:stop`` flag) and ``stop()`` (sets it).
- ``run.queue(name)`` → ``Queue`` over stream ``prompts`` | ``rollouts`` | ``scored`` (its
  consumer group is the stage's: generators, verifiers, trainer): ``put(records) -> int`` (each
  record to the shard of its prompt, ``Keys.shard_of``), ``get(n, *, consumer, block_ms=None)
  -> [(Entry, record)]`` (own pending entries first, then reclaimed, then new ones, through
  ``bus.streams.sharded_reader``; undecodable entries are dead-lettered and acked),
  ``ack(entries) -> int``, ``depth() -> int`` (unacked by the group).
- ``run.policy(worker_id="api-gen")`` → ``Policy``: ``generate(prompts) -> [RolloutGroup]``
  (prompts: ``tasks.base.Item`` or ``records.PromptTask``; ``generator.group_size``
  completions each, ``engines.make_generation_backend`` + ``producers.generator.to_groups``),
  ``sync() -> int`` (the newest published weights, ``producers.generator.swap_weights``),
  ``version``.
- ``run.verifiers(worker_id="api-ver")`` → ``Verifiers``: ``score(groups) -> [ScoredGroup]``,
  the verifier stage's own step (``consumers.verifier.Verifier``: weak verifiers of
  ``verifier.verifiers``, the shared Weaver label model, the reward mode ``verifier.reward``).
- ``run.learner()`` → ``Learner``: ``step(groups) -> dict`` (one optimizer step; groups with
  ``version − min_version > trainer.max_staleness`` are dropped by ``consumers.trainer.classify``;
  the row is the trainer's ``metrics.jsonl`` row), ``publish()`` (``Trainer.publish``: the weight
  transport, ``{ns}:versions``, ``{ns}:trainer``), ``evaluate() -> float`` (``Trainer.evaluate``),
  ``version``, ``engine``, ``save(directory)`` (the policy as a checkpoint, ``export_hf``).
  A step written by hand, with the algorithm in the loop (the torch engine;
  examples/grpo_loop.py): ``batch(groups) -> TrainBatch`` (stale groups dropped, groups without
  signal set aside, the rest padded: ``rewards`` per group, ``ids``, ``behav_logp``, ``mask``
  [N, T]), ``logprobs(batch)`` ([N, T] with grad), then advantages and a loss from
  ``pipeline.algo.losses`` or your own, and ``update(batch, loss, stats) -> dict`` (backward,
  clip, AdamW, version + 1, the metrics row).

What this API leaves to you, and ``pipeline up`` does: admission (the staleness bound enforced
before generation; here stale groups are only dropped at the step), the ledger and trainer
checkpoints (a crash loses the loop's progress), process supervision.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import RunConfig, load_config
from pipeline.records import PromptTask, RolloutGroup, ScoredGroup

API_VERSION = 1

__all__ = ["API_VERSION", "Run", "Queue", "Policy", "Verifiers", "Learner", "TrainBatch"]

_RECORDS = {"prompts": PromptTask, "rollouts": RolloutGroup, "scored": ScoredGroup}


def _prompt_id(rec) -> str:
    return rec.rollout.prompt_id if isinstance(rec, ScoredGroup) else rec.prompt_id


class Queue:
    """One of the run's streams (all its shards), typed by its record class, read as the stage's group."""

    def __init__(self, run: "Run", name: str) -> None:
        from pipeline.keys import STREAM_NAMES

        if name not in STREAM_NAMES:
            raise ValueError(f"queue: {name!r} is not one of {STREAM_NAMES}")
        self.run, self.name, self.record = run, name, _RECORDS[name]
        self.group = run.keys.shard(0).streams()[name][1]
        self._readers: dict[str, Any] = {}

    def put(self, records: Iterable) -> int:
        """Append each record to its prompt's shard (as the stages route); returns how many."""
        from pipeline.bus.streams import FIELD

        keys, pipe, n = self.run.keys, self.run.r.pipeline(transaction=False), 0
        for rec in records:
            if not isinstance(rec, self.record):
                raise TypeError(f"queue {self.name!r} holds {self.record.__name__} records, not {type(rec).__name__}")
            pipe.xadd(getattr(keys.shard(keys.shard_of(_prompt_id(rec))), self.name), {FIELD: rec.encode()})
            n += 1
        if n:
            pipe.execute()
        return n

    def _reader(self, consumer: str):
        from pipeline.bus.streams import sharded_reader

        if consumer not in self._readers:
            self._readers[consumer] = sharded_reader(self.run.r, self.run.keys, self.name, self.group, consumer,
                                                     self.run.cfg.redis)
        return self._readers[consumer]

    def get(self, n: int, *, consumer: str, block_ms: int | None = None) -> list[tuple[Any, Any]]:
        """Up to ``n`` (entry, record) pairs of one shard; [] when none came within ``block_ms``
        (default ``redis.block_ms``). Entries stay pending for ``consumer`` until acked."""
        from pipeline.bus.streams import decode_entries, dead_letter_fields

        reader = self._reader(consumer)
        entries = reader.read(n, self.run.cfg.redis.block_ms if block_ms is None else block_ms)
        if not entries:
            return []
        good, bad = decode_entries(entries, self.record.decode, reader=reader)
        for e, reason in bad:  # as a stage does: to the shard's dead letters, acked
            shard = self.run.keys.shard(e.shard)
            fields = dead_letter_fields(stream=getattr(shard, self.name), entry=e, reason=reason, consumer=consumer)
            self.run.r.xadd(shard.dead, dict(zip(fields[::2], fields[1::2])))
        self.ack([e for e, _ in bad])
        return good

    def ack(self, entries: Iterable) -> int:
        """Acknowledge entries (from ``get``) in their shards; returns how many were pending."""
        by_shard: dict[int, list] = {}
        for e in entries:
            by_shard.setdefault(e.shard, []).append(e.id)
        return sum(int(self.run.r.xack(getattr(self.run.keys.shard(k), self.name), self.group, *ids))
                   for k, ids in by_shard.items())

    def depth(self) -> int:
        """Entries the group has not acked yet (never delivered plus pending), over all shards."""
        from pipeline.bus.streams import unacked_all

        return unacked_all(self.run.r, self.run.keys.stream_keys(self.name), self.group)


class Policy:
    """The generation engine (``generator.backend``) and its weight fetcher."""

    def __init__(self, run: "Run", worker_id: str) -> None:
        from pipeline.engines import make_generation_backend
        from pipeline.tasks.prompting import prompt_format
        from pipeline.weights import fetcher_options, make_fetcher

        cfg = run.cfg
        self.run, self.worker_id, self.log = run, worker_id, run.logger("generator", worker_id)
        self.backend = make_generation_backend(cfg, worker_id=worker_id)
        self.fetcher = make_fetcher(cfg.weights.transport, run.r, run.keys.weights, **fetcher_options(cfg.weights))
        self.format = prompt_format(cfg.task, cfg.model.base_dir)
        self.version, self.batches = 0, 0
        self._ids = itertools.count()

    def sync(self) -> int:
        """Swap in the newest published weights if newer (a defect keeps the old); returns the version."""
        from pipeline.producers.generator import swap_weights

        self.version = swap_weights(self.fetcher, self.backend, self.version, self.log)
        return self.version

    def prompt(self, item) -> PromptTask:
        """A ``tasks.base.Item`` as the feeder issues it (the one prompt builder)."""
        from pipeline.tasks.prompting import build_prompt

        text, ids = build_prompt(self.format, self.backend.tokenizer, item.prompt)
        return PromptTask(prompt_id=f"p{self.worker_id}-{next(self._ids):08d}", prompt=text, prompt_ids=ids,
                          reference=item.reference, issued_at=time.time())

    def generate(self, prompts: Sequence) -> list[RolloutGroup]:
        """``generator.group_size`` completions of each prompt at ``generator.temperature``."""
        from pipeline.producers.generator import to_groups

        tasks = [p if isinstance(p, PromptTask) else self.prompt(p) for p in prompts]
        if not tasks:
            return []
        g = self.run.cfg.generator
        samples = self.backend.generate([t.prompt_ids for t in tasks], n=g.group_size,
                                        max_new_tokens=self.run.cfg.task.max_new_tokens, temperature=g.temperature)
        self.batches += 1
        return to_groups(tasks, samples, tok=self.backend.tokenizer, worker_id=self.worker_id, batch=self.batches,
                         version=self.version)

    def close(self) -> None:
        self.fetcher.close()
        self.backend.close()


class Verifiers:
    """The verifier stage's scoring: weak verifiers → shared label model → reward mode."""

    def __init__(self, run: "Run", worker_id: str) -> None:
        from pipeline.consumers.verifier import Verifier

        self.run = run
        self.verifier = Verifier(run.cfg, run.r, run.keys, worker_id, run.logger("verifier", worker_id))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.run.cfg.verifier.verifiers)

    def score(self, groups: Sequence[RolloutGroup]) -> list[ScoredGroup]:
        """One ScoredGroup per group, by ``Verifier.step`` itself (posteriors file included)."""
        from pipeline.bus.streams import Entry
        from pipeline.stage import Batch

        if not groups:
            return []
        batch = Batch(shard=self.run.keys.shard(0), bad=[],
                      good=[(Entry(id=f"api-{i}".encode(), payload=None), g) for i, g in enumerate(groups)])
        out = self.verifier.step(batch)
        if out.after is not None:
            out.after()
        return [ScoredGroup.decode(payload) for _, payload in out.written]


@dataclass(frozen=True, kw_only=True)
class TrainBatch:
    """One step's groups for a loss written by hand (``Learner.batch``). N: the completions of
    the groups with signal, T: their longest completion; tensors are torch's."""

    groups: tuple
    """Every group handed to ``Learner.batch`` (ScoredGroup), in order."""
    fresh: list
    """The groups within ``trainer.max_staleness`` (trained or without signal)."""
    signal: list
    """The fresh groups whose rewards differ: the ones a step trains on, in completion order."""
    rewards: list
    """One float32 tensor [G] of rewards per group of ``signal``."""
    prompts: list
    """Each completion's prompt ids (a 1-D long tensor), N of them."""
    ids: Any
    """Completion token ids [N, T], padded."""
    behav_logp: Any
    """The behaviour policy's log-probabilities of those tokens [N, T] (the generator's)."""
    mask: Any
    """1 on the tokens the loss counts [N, T]: sampled tokens (not padding, not an environment's)."""
    started: float
    """``time.perf_counter()`` when the batch was made: the step's time counts from it."""

    @property
    def size(self) -> int:
        """N, the completions to train on (0: nothing had signal)."""
        return int(self.ids.shape[0])


class Learner:
    """The trainer's engine, held-out set, publisher and metrics file (``consumers.trainer.Trainer``)."""

    def __init__(self, run: "Run") -> None:
        from pipeline.consumers.trainer import Trainer

        self.run = run
        self.trainer = Trainer(run.cfg, run.r, run.keys, run.logger("trainer", "trainer"), run_dir=run.cfg.run_dir)
        self.engine = self.trainer.engine

    @property
    def version(self) -> int:
        return self.trainer.version

    def step(self, groups: Sequence[ScoredGroup], *, wait_s: float = 0.0) -> dict:
        """One optimizer step on the groups with signal, after dropping stale ones; version + 1.

        Returns the trainer's metrics row (``groups_trained``, ``groups_nosignal``,
        ``groups_stale``, ``reward_mean``, ``sample_accuracy``, loss statistics...).
        """
        from pipeline.consumers.trainer import Outcome, classify, report_progress, step_metrics

        t, tr = self.run.cfg.trainer, self.trainer
        t0 = time.perf_counter()
        batch = [(None, g) for g in groups]
        kinds = classify(batch, version=tr.version, max_staleness=t.max_staleness)
        fresh = [g for g, k in zip(groups, kinds) if k != Outcome.STALE]
        signal = [g for g, k in zip(groups, kinds) if k == Outcome.TRAINED]
        stats = tr.engine.train_step(signal) if signal else {}
        tr.engine.lr_step()
        tr.version += 1
        row = step_metrics(batch, fresh, signal, version=tr.version, stats=stats, wait_s=wait_s,
                           step_s=time.perf_counter() - t0)
        row["groups_consumed"] = len(groups)
        tr.metrics.write("step", **row)
        report_progress(self.run.r, self.run.keys, version=tr.version, row=row)
        return row

    # -------------------------------------------------------------- a step written by hand

    def batch(self, groups: Sequence[ScoredGroup]) -> "TrainBatch":
        """The groups of one step, ready for an advantage and a loss written in the loop: stale
        groups dropped and groups without signal set aside (``consumers.trainer.classify``, as
        :meth:`step`), the rest padded as the torch engine pads them (``engines.torch.pad_batch``)."""
        import torch

        from pipeline.consumers.trainer import Outcome, classify
        from pipeline.engines.torch import pad_batch, sampled_mask

        t0 = time.perf_counter()
        self._torch_engine()
        kinds = classify([(None, g) for g in groups], version=self.version,
                         max_staleness=self.run.cfg.trainer.max_staleness)
        fresh = [g for g, k in zip(groups, kinds) if k != Outcome.STALE]
        signal = [g for g, k in zip(groups, kinds) if k == Outcome.TRAINED]
        if not signal:
            empty = torch.zeros((0, 0))
            return TrainBatch(groups=tuple(groups), fresh=fresh, signal=signal, rewards=[], prompts=[],
                              ids=empty.long(), behav_logp=empty, mask=empty, started=t0)
        prompts, ids, behav, pad_mask = pad_batch(signal, self.engine.tokenizer.pad_id)
        mask = pad_mask * sampled_mask(signal, tuple(pad_mask.shape))  # an episode's observation tokens out
        rewards = [torch.tensor(np.asarray(g.rewards, dtype=np.float32)) for g in signal]
        return TrainBatch(groups=tuple(groups), fresh=fresh, signal=signal, rewards=rewards, prompts=prompts,
                          ids=ids, behav_logp=behav, mask=mask, started=t0)

    def logprobs(self, batch: "TrainBatch"):
        """log π_θ of each completion token of ``batch`` under the current weights: [N, T], with
        grad, at ``generator.temperature`` (the policy the generators sample), by the function the
        torch engine's step uses (``model.qwen.ragged_completion_logprobs``)."""
        from pipeline.model.qwen import ragged_completion_logprobs

        engine = self._torch_engine()
        engine.model.train()
        return ragged_completion_logprobs(engine.model, batch.prompts, batch.ids, pad_id=engine.tokenizer.pad_id,
                                          temperature=self.run.cfg.generator.temperature)

    def update(self, batch: "TrainBatch", loss=None, stats: Mapping[str, float] | None = None, *,
               wait_s: float = 0.0) -> dict:
        """One optimizer step on ``loss`` (a scalar tensor from :meth:`logprobs`): backward, the
        gradient norm clipped to ``trainer.grad_clip``, AdamW; none when ``loss`` is None (no
        group had signal). Then as :meth:`step`: the learning-rate schedule, version + 1, the
        metrics row (``stats`` joins it) written and returned."""
        import torch

        from pipeline.consumers.trainer import report_progress, step_metrics

        engine, tr = self._torch_engine(), self.trainer
        row_stats: dict = {}
        if loss is not None:
            engine.opt.zero_grad(set_to_none=True)
            loss.backward()
            params = [p for g in engine.opt.param_groups for p in g["params"]]
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.run.cfg.trainer.grad_clip))
            engine.opt.step()
            row_stats = {"loss": float(loss.detach()), "grad_norm": norm, "tokens": int(batch.mask.sum()),
                         **(stats or {})}
        engine.model.eval()
        engine.lr_step()
        tr.version += 1
        pairs = [(None, g) for g in batch.groups]
        row = step_metrics(pairs, batch.fresh, batch.signal, version=tr.version, stats=row_stats, wait_s=wait_s,
                           step_s=time.perf_counter() - batch.started)
        row["groups_consumed"] = len(batch.groups)
        tr.metrics.write("step", **row)
        report_progress(self.run.r, self.run.keys, version=tr.version, row=row)
        return row

    def _torch_engine(self):
        from pipeline.engines.torch import TorchEngine

        if not isinstance(self.engine, TorchEngine):
            raise ValueError(f"trainer.backend: a step written by hand (Learner.batch, logprobs, update) needs the "
                             f"'torch' engine; this run's is {self.run.cfg.trainer.backend!r} (Learner.step "
                             "runs any engine)")
        return self.engine

    def save(self, directory: str | Path) -> Path:
        """The current policy as a plain checkpoint in ``directory`` (``pipeline eval --checkpoint``)."""
        self.engine.export_hf(Path(directory))
        return Path(directory)

    def publish(self) -> None:
        """Publish the current weights as ``version`` and announce it (``Trainer.publish``)."""
        self.trainer.publish()

    def evaluate(self) -> float:
        """Greedy accuracy of the current policy on the task's held-out set (``Trainer.evaluate``)."""
        return self.trainer.evaluate()

    def close(self) -> None:
        self.trainer.close()


class Run:
    """One run: its server, connection, streams and task; a context manager (see the module docstring)."""

    def __init__(self, cfg: RunConfig | None = None, *, config: str | Path | None = None,
                 overrides: Mapping[str, Any] | None = None, build_base_model: bool = True) -> None:
        if cfg is not None and (config is not None or overrides):
            for name, value in (overrides or {}).items():
                cfg = cfg.replace(name, value)
        elif cfg is None:
            cfg = load_config(config, dict(overrides or {}))
        self.cfg, self.build_base_model = cfg, build_base_model
        self.server = self.r = self.keys = self.task = None
        self.base_info: dict = {}
        self._owned: list = []
        self._loggers: dict = {}

    # ------------------------------------------------------------------ lifetime

    def __enter__(self) -> "Run":
        from pipeline.run.base_model import ensure_base_model
        from pipeline.run.launch import provision_cluster
        from pipeline.run.plan import run_config
        from pipeline.tasks.registry import make_task

        cfg = run_config(self.cfg)
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        if self.build_base_model:
            self.base_info = ensure_base_model(cfg)
        c = provision_cluster(cfg)
        self.cfg, self.server, self.r, self.keys = c.cfg, c.server, c.r, c.keys
        try:
            self.task = make_task(self.cfg.task)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close what this run made (engines, publishers, fetchers), then stop a server it started."""
        while self._owned:
            try:
                self._owned.pop().close()
            except Exception:  # noqa: BLE001 - the rest must still close
                pass
        if self.r is not None:
            self.r.close()
            self.r = None
        if self.server is not None:
            self.server.stop()
            self.server = None

    def stopped(self) -> bool:
        """Whether a stop is requested for this run (``pipeline down``, ``stop()``)."""
        from pipeline.bus.flow import stop_requested

        return stop_requested(self.r, self.keys)

    def stop(self) -> None:
        """Ask every loop of the run to stop (sets ``{ns}:stop``)."""
        self.r.set(self.keys.stop, 1)

    def logger(self, stage: str, worker: str):
        """A structlog logger bound to ``stage`` and ``worker``, writing ``<run_dir>/logs/api.jsonl`` (``observe.logs``)."""
        if not self._loggers:
            from pipeline.observe.logs import setup_logging

            self._loggers["api"] = setup_logging(self.cfg.run_dir / "logs", stage="api", worker="api")
        if worker not in self._loggers:
            self._loggers[worker] = self._loggers["api"].bind(stage=stage, worker=worker)
        return self._loggers[worker]

    # ------------------------------------------------------------------ the objects of a loop

    def _own(self, obj):
        self._owned.append(obj)
        return obj

    def queue(self, name: str) -> Queue:
        return Queue(self, name)

    def policy(self, worker_id: str = "api-gen") -> Policy:
        return self._own(Policy(self, worker_id))

    def verifiers(self, worker_id: str = "api-ver") -> Verifiers:
        return Verifiers(self, worker_id)

    def learner(self) -> Learner:
        return self._own(Learner(self))
