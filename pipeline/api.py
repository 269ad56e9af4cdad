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
        learner.step(batch); learner.commit(); learner.publish()  # the trainer stage's step and commit

- ``Run(cfg=None, *, config=None, overrides=None, build_base_model=True)``: a context manager.
  On enter: the base model (``pipeline.run.base_model.ensure_base_model``, as ``pipeline up``), then
  the server, the run's config file and its streams exactly as ``pipeline up`` prepares them
  (``launch.provision_cluster``: ``bus.server.provision``, ``bus.connection.connect``,
  ``bus.streams.ensure_all_groups``), then the task (``tasks.registry.make_task``). On exit:
  the objects it made are closed and a server it started is stopped (one it only reached is
  left running). Attributes: ``cfg``, ``keys``, ``r``, ``task``, ``server``; ``stopped()``
  (the run's ``{ns}:stop`` flag) and ``stop()`` (sets it).
- ``run.queue(name)`` → ``Queue`` over stream ``prompts`` | ``rollouts`` | ``scored`` (its
  consumer group is the stage's: generators, verifiers, trainer), read through a
  ``stage.Stage`` of its own per consumer: ``put(records) -> int`` (each record to the shard of
  its prompt, ``Keys.shard_of``), ``get(n, *, consumer, block_ms=None) -> [(Entry, record)]``
  (``Stage.read``: own pending entries first, then reclaimed, then new ones; entries that do not
  decode, or were delivered ``redis.max_deliveries`` times, are dead-lettered by ``Stage.emit``,
  the stages' own transaction: the dead letter, its ack and its count in one call that a retry
  after a lost reply does not apply twice), ``ack(entries) -> int``, ``depth() -> int``
  (unacked by the group).
- ``run.policy(worker_id="api-gen")`` → ``Policy``: ``generate(prompts) -> [RolloutGroup]``
  (prompts: ``tasks.base.Item`` or ``records.PromptTask``; ``generator.group_size``
  completions each, ``engines.make_generation_backend`` + ``producers.generator.to_groups``),
  ``sync() -> int`` (the newest published weights, ``producers.generator.swap_weights``),
  ``version``.
- ``run.verifiers(worker_id="api-ver")`` → ``Verifiers``: ``score(groups) -> [ScoredGroup]``,
  the verifier stage's own step (``consumers.verifier.VerifierStage.step``: weak verifiers of
  ``verifier.verifiers``, the shared Weaver label model, the reward mode ``verifier.reward``).
- ``run.learner()`` → ``Learner``, the trainer stage's own parts (``consumers.trainer.Trainer``):
  ``step(groups) -> dict`` is ``Trainer.step`` (groups: ``Queue.get``'s (entry, group) pairs or
  bare ScoredGroups; groups more than ``trainer.max_staleness`` updates behind are dropped
  and the invariant re-checked, ``consumers.trainer.sort_step``; one optimizer step; the row is
  the trainer's ``metrics.jsonl`` row), ``commit() -> Path | None`` is ``Trainer.durable`` (a
  checkpoint, then per shard one script with each step's ledger and training-log entries, the
  acks of its entries and its counters), ``resume() -> Path | None`` is ``Trainer.resume``,
  ``publish()`` (``Trainer.publish``: the weight transport, ``{ns}:versions``,
  ``{ns}:trainer``), ``evaluate() -> float`` (``Trainer.evaluate``), ``version``, ``engine``,
  ``save(directory)`` (the policy as a checkpoint, ``export_hf``).
  A step written by hand, with the algorithm in the loop (the torch engine;
  examples/grpo_loop.py): ``batch(groups) -> TrainBatch`` (sorted by ``Trainer.sort``: stale
  groups dropped, groups without signal set aside, the rest padded: ``rewards`` per group,
  ``ids``, ``behav_logp``, ``mask`` [N, T]), ``logprobs(batch)`` ([N, T] with grad), then
  advantages and a loss from ``pipeline.algo.losses`` or your own, and ``update(batch, loss,
  stats) -> dict`` (backward, clip, AdamW, then ``Trainer.record`` as after the stage's step:
  the schedule, version + 1, the metrics row, the step kept for ``commit``).

What this API leaves to you, and ``pipeline up`` does: admission (the staleness bound enforced
before generation; here stale groups are only dropped at the step), when to commit (the trainer
commits every ``trainer.checkpoint_every`` steps; steps not committed are lost with the loop,
and their entries stay pending), skipping a prompt the ledger already holds (the trainer acks
such a duplicate unread; ``Learner.step`` trains what it is given), process supervision.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.bus.flow import stop_requested
from pipeline.bus.streams import FIELD, Entry, unacked_all
from pipeline.config import RunConfig, load_config
from pipeline.consumers.verifier import VerifierStage
from pipeline.engines import make_generation_backend
from pipeline.keys import STREAM_NAMES
from pipeline.observe.logs import setup_logging
from pipeline.producers.generator import swap_weights, to_groups
from pipeline.records import PromptTask, RolloutGroup, ScoredGroup
from pipeline.run.base_model import ensure_base_model
from pipeline.run.launch import provision_cluster
from pipeline.run.plan import run_config
from pipeline.stage import Batch, Output, Stage
from pipeline.tasks.prompting import build_prompt, prompt_format
from pipeline.tasks.registry import make_task
from pipeline.weights import fetcher_options, make_fetcher

API_VERSION = 1

__all__ = ["API_VERSION", "Run", "Queue", "Policy", "Verifiers", "Learner", "TrainBatch"]

_RECORDS = {"prompts": PromptTask, "rollouts": RolloutGroup, "scored": ScoredGroup}


def _prompt_id(rec) -> str:
    return rec.rollout.prompt_id if isinstance(rec, ScoredGroup) else rec.prompt_id


def _pairs(groups: Iterable) -> list[tuple]:
    """(entry, group) pairs of what a loop hands a Learner: ``Queue.get``'s pairs as they are, a
    bare group with entry None (nothing to ack at the commit)."""
    return [x if isinstance(x, tuple) else (None, x) for x in groups]


class Queue:
    """One of the run's streams (all its shards), typed by its record class, read as the stage's
    group through a ``stage.Stage`` per consumer (its reader and its emit transaction)."""

    def __init__(self, run: "Run", name: str) -> None:
        if name not in STREAM_NAMES:
            raise ValueError(f"queue: {name!r} is not one of {STREAM_NAMES}")
        self.run, self.name, self.record = run, name, _RECORDS[name]
        self.group = run.keys.shard(0).streams()[name][1]
        self._stages: dict[str, Stage] = {}

    def put(self, records: Iterable) -> int:
        """Append each record to its prompt's shard (as the stages route); returns how many."""
        keys, pipe, n = self.run.keys, self.run.r.pipeline(transaction=False), 0
        for rec in records:
            if not isinstance(rec, self.record):
                raise TypeError(f"queue {self.name!r} holds {self.record.__name__} records, not {type(rec).__name__}")
            pipe.xadd(getattr(keys.shard(keys.shard_of(_prompt_id(rec))), self.name), {FIELD: rec.encode()})
            n += 1
        if n:
            pipe.execute()
        return n

    def stage(self, consumer: str) -> Stage:
        """The stage plumbing ``consumer`` reads through (made on first use): nothing admitted,
        so a dead letter gives no admission slot back."""
        if consumer not in self._stages:
            run = self.run
            self._stages[consumer] = Stage(run.r, run.keys, run.cfg, name=f"api-{self.name}", worker_id=consumer,
                                           log=run.logger("queue", consumer), source=self.name, group=self.group,
                                           decode=self.record.decode, admitted=False)
        return self._stages[consumer]

    def get(self, n: int, *, consumer: str, block_ms: int | None = None) -> list[tuple[Any, Any]]:
        """Up to ``n`` (entry, record) pairs of one shard; [] when none came within ``block_ms``
        (default ``redis.block_ms``). Entries stay pending for ``consumer`` until acked (``ack``,
        or ``Learner.commit`` for the groups a step consumed).

        Defects (undecodable, delivered ``redis.max_deliveries`` times) go to the shard's dead
        letters by ``Stage.emit``, as a stage's do: the dead letter, its ack and the
        ``dead_letters_total`` count in one call, whose token makes a retry after a lost reply
        change nothing."""
        stage = self.stage(consumer)
        entries = stage.read(n, block_ms)
        if not entries:
            return []
        batch = stage.take(entries)
        if batch.bad:
            stage.emit(Batch(shard=batch.shard, good=[], bad=batch.bad), Output())
        return batch.good

    def ack(self, entries: Iterable) -> int:
        """Acknowledge entries (from ``get``) in their shards; returns how many were pending."""
        by_shard: dict[int, list] = {}
        for e in entries:
            by_shard.setdefault(e.shard, []).append(e.id)
        return sum(int(self.run.r.xack(getattr(self.run.keys.shard(k), self.name), self.group, *ids))
                   for k, ids in by_shard.items())

    def depth(self) -> int:
        """Entries the group has not acked yet (never delivered plus pending), over all shards."""
        return unacked_all(self.run.r, self.run.keys.stream_keys(self.name), self.group)


class Policy:
    """The generation engine (``generator.backend``) and its weight fetcher."""

    def __init__(self, run: "Run", worker_id: str) -> None:
        cfg = run.cfg
        self.run, self.worker_id, self.log = run, worker_id, run.logger("generator", worker_id)
        self.backend = make_generation_backend(cfg, worker_id=worker_id)
        self.fetcher = make_fetcher(cfg.weights.transport, run.r, run.keys.weights, **fetcher_options(cfg.weights))
        self.format = prompt_format(cfg.task, cfg.model.base_dir)
        self.version, self.batches = 0, 0
        self._ids = itertools.count()

    def sync(self) -> int:
        """Swap in the newest published weights if newer (a defect keeps the old); returns the version."""
        self.version = swap_weights(self.fetcher, self.backend, self.version, self.log)
        return self.version

    def prompt(self, item) -> PromptTask:
        """A ``tasks.base.Item`` as the feeder issues it (the one prompt builder)."""
        text, ids = build_prompt(self.format, self.backend.tokenizer, item.prompt)
        return PromptTask(prompt_id=f"p{self.worker_id}-{next(self._ids):08d}", prompt=text, prompt_ids=ids,
                          reference=item.reference, issued_at=time.time())

    def generate(self, prompts: Sequence) -> list[RolloutGroup]:
        """``generator.group_size`` completions of each prompt at ``generator.temperature``."""
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
        self.run = run
        self.verifier = VerifierStage(run.cfg, run.r, run.keys, worker_id, run.logger("verifier", worker_id))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.run.cfg.verifier.verifiers)

    def score(self, groups: Sequence[RolloutGroup]) -> list[ScoredGroup]:
        """One ScoredGroup per group, by ``VerifierStage.step`` itself (posteriors file included)."""
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
    entries: tuple = ()
    """Each group's stream entry (None for a bare group), in the order of ``groups``: what
    ``Learner.commit`` acks."""
    kinds: tuple = ()
    """Each group's outcome (``consumers.trainer.Outcome``), in the order of ``groups``."""

    @property
    def size(self) -> int:
        """N, the completions to train on (0: nothing had signal)."""
        return int(self.ids.shape[0])


class Learner:
    """The trainer stage's own parts (``consumers.trainer.Trainer``): its engine, held-out set,
    publisher, metrics file, step, commit and resume."""

    def __init__(self, run: "Run") -> None:
        # Deferred: the trainer loads torch, which a loop without a Learner never needs.
        from pipeline.consumers.trainer import Trainer

        self.run = run
        self.trainer = Trainer(run.cfg, run.r, run.keys, run.logger("trainer", "trainer"), run_dir=run.cfg.run_dir)
        self.engine = self.trainer.engine

    @property
    def version(self) -> int:
        return self.trainer.version

    def step(self, groups: Sequence, *, wait_s: float = 0.0) -> dict:
        """The trainer stage's step (``Trainer.step``): stale groups dropped and the staleness
        invariant re-checked, one optimizer step on the groups with signal, version + 1, the
        step kept for :meth:`commit`.

        ``groups``: ``Queue.get``'s (entry, group) pairs (their entries are acked at the
        commit) or bare ScoredGroups. Returns the trainer's metrics row (``groups_trained``,
        ``groups_nosignal``, ``groups_stale``, ``reward_mean``, ``sample_accuracy``, loss
        statistics...), also written to ``metrics.jsonl``.
        """
        from pipeline.consumers.trainer import report_progress  # deferred with the trainer (torch)

        row = self.trainer.step(_pairs(groups), wait_s=wait_s)
        report_progress(self.run.r, self.run.keys, version=self.version, row=row)
        return row

    def commit(self) -> Path | None:
        """Make the steps since the last commit final, as the trainer stage does every
        ``trainer.checkpoint_every`` steps (``Trainer.durable``): a checkpoint in
        ``<run_dir>/checkpoints`` (model, optimizer, schedule, version, the uncommitted steps),
        then per shard one script holding each step's ledger entries, training-log entries,
        acks of the stream entries its groups came in and counters (a commit sent again
        repeats nothing), then the acked entries trimmed. Returns the checkpoint."""
        return self.trainer.durable()

    def resume(self) -> Path | None:
        """Restore the latest checkpoint of the run (a Learner's or the trainer stage's) and
        re-apply its commit (``Trainer.resume``); the checkpoint, or None when there is none
        (or ``trainer.resume`` is off)."""
        return self.trainer.resume()

    # -------------------------------------------------------------- a step written by hand

    def batch(self, groups: Sequence) -> "TrainBatch":
        """The groups of one step, ready for an advantage and a loss written in the loop: sorted
        as :meth:`step` sorts them (``Trainer.sort``: stale groups dropped, the invariant
        re-checked, groups without signal set aside), the rest padded as the torch engine pads
        them (``engines.torch.pad_batch``). ``groups`` as for :meth:`step`."""
        import torch  # deferred: a heavy optional library, as the engine below

        from pipeline.engines.torch import pad_batch, sampled_mask

        t0 = time.perf_counter()
        self._torch_engine()
        pairs = _pairs(groups)
        s = self.trainer.sort(pairs)
        common = dict(groups=tuple(g for _, g in pairs), entries=tuple(e for e, _ in pairs), kinds=tuple(s.kinds),
                      fresh=s.fresh, signal=s.signal, started=t0)
        if not s.signal:
            empty = torch.zeros((0, 0))
            return TrainBatch(rewards=[], prompts=[], ids=empty.long(), behav_logp=empty, mask=empty, **common)
        prompts, ids, behav, pad_mask = pad_batch(s.signal, self.engine.tokenizer.pad_id)
        mask = pad_mask * sampled_mask(s.signal, tuple(pad_mask.shape))  # an episode's observation tokens out
        rewards = [torch.tensor(np.asarray(g.rewards, dtype=np.float32)) for g in s.signal]
        return TrainBatch(rewards=rewards, prompts=prompts, ids=ids, behav_logp=behav, mask=mask, **common)

    def logprobs(self, batch: "TrainBatch"):
        """log π_θ of each completion token of ``batch`` under the current weights: [N, T], with
        grad, at ``generator.temperature`` (the policy the generators sample), by the function the
        torch engine's step uses (``model.qwen.ragged_completion_logprobs``)."""
        from pipeline.model.qwen import ragged_completion_logprobs  # deferred: torch

        engine = self._torch_engine()
        engine.model.train()
        return ragged_completion_logprobs(engine.model, batch.prompts, batch.ids, pad_id=engine.tokenizer.pad_id,
                                          temperature=self.run.cfg.generator.temperature)

    def update(self, batch: "TrainBatch", loss=None, stats: Mapping[str, float] | None = None, *,
               wait_s: float = 0.0) -> dict:
        """One optimizer step on ``loss`` (a scalar tensor from :meth:`logprobs`): backward, the
        gradient norm clipped to ``trainer.grad_clip``, AdamW; none when ``loss`` is None (no
        group had signal). Then what follows the stage's step (``Trainer.record``): the
        learning-rate schedule (after an update only), version + 1, the metrics row (``stats``
        joins it) written and returned, the step kept for :meth:`commit`."""
        import torch  # deferred: a heavy optional library

        from pipeline.consumers.trainer import Sorted, report_progress

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
        pairs = list(zip(batch.entries or (None,) * len(batch.groups), batch.groups))
        kinds = list(batch.kinds) or tr.sort(pairs).kinds
        row = tr.record(pairs, Sorted(kinds=kinds, fresh=list(batch.fresh), signal=list(batch.signal)),
                        stats=row_stats, updated=loss is not None, wait_s=wait_s, started=batch.started)
        report_progress(self.run.r, self.run.keys, version=tr.version, row=row)
        return row

    def _torch_engine(self):
        from pipeline.engines.torch import TorchEngine  # deferred: torch

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
        return stop_requested(self.r, self.keys)

    def stop(self) -> None:
        """Ask every loop of the run to stop (sets ``{ns}:stop``)."""
        self.r.set(self.keys.stop, 1)

    def logger(self, stage: str, worker: str):
        """A structlog logger bound to ``stage`` and ``worker``, writing ``<run_dir>/logs/api.jsonl`` (``observe.logs``)."""
        if not self._loggers:
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
