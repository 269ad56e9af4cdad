"""Trainer: GRPO on bounded-staleness batches of scored groups; publishes each new version.

consumes:     ScoredGroup records from {ns}:scored (group "trainer"), acked once a checkpoint
              holds the step that consumed them (pipeline.common.checkpoint)
produces:     policy version v+1 after each step ({ns}:weights, {ns}:versions); the ledger
              entry and training-log entry of every consumed prompt ({ns}:ledger,
              {ns}:trainlog); metrics.jsonl (with each step's weights hash); the rollout archive
              (every group trained on, a Parquet segment a step: pipeline.common.archive);
              checkpoints; a final HF checkpoint
waits for:    groups_per_step (B) scored groups
unblocked by: verifiers
Staleness is checked at consumption: a group more than η updates behind (v − min_version,
less the versions in between whose step trained nothing) is dropped (acked, counted,
recorded), and the invariant is re-checked on what is trained.
A restarted trainer resumes from its latest checkpoint (model, optimizer, schedule, RNG,
version) and retrains only the groups no checkpoint holds; SIGTERM finishes the current
step, checkpoints it and exits.
The trainer reads every scored shard; a step's commit is one transaction per shard (that
shard's ledger, training log, acks), each checking and recording the shard's committed
version, so a commit re-applied after a crash, or sent again after a lost reply, skips the
shards that already have it. After each commit the scored entries every group acked are
trimmed.

The loop (``Trainer.run``): collect B new groups (dead-lettering defects, acking
duplicates) → classify each (stale: more than η updates behind, ``staleness``; nosignal: equal rewards;
trained) → one optimizer step on the groups with signal → version v+1 → checkpoint and
commit every ``checkpoint_every`` steps → publish the weights → evaluate now and then.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np

from pipeline.algo.losses import NO_SIGNAL_STD
from pipeline.bus.flow import release_once
from pipeline.bus.streams import counter_args, failure_summary, parse_ref, txn_script
from pipeline.config import RunConfig
from pipeline.engines import TrainEngine, make_train_engine
from pipeline.engines.episodes import summarise
from pipeline.engines.torch_state import weights_hash
from pipeline.envs.chat import ChatTurns
from pipeline.envs.registry import make_env
from pipeline.keys import TRAINER_GROUP, Keys
from pipeline.common.archive import ARCHIVE_DIR, ArchiveWriter
from pipeline.observe.logs import MetricsFile
from pipeline.observe.tracking import Trackers
from pipeline.records import ScoredGroup, check_group_size, check_scores, check_token_ids, check_versions
from pipeline.common import checkpoint
from pipeline.common.checkpoint import StepRecord
from pipeline.common.procs import EXIT_ENTRIES_FAILED, process_age_s
from pipeline.stage import STAGE_ERRORS, Output, Stage
from pipeline.tasks.prompting import build_prompt, prompt_format
from pipeline.tasks.registry import make_task
from pipeline.weights import make_publisher, publisher_options


class Outcome(StrEnum):
    """What became of a consumed group (its ledger entry is ``<outcome>:<version>``)."""

    TRAINED = "trained"
    NOSIGNAL = "nosignal"
    """All rewards equal: no GRPO gradient; counted toward the batch, not trained on."""
    STALE = "stale"
    """More than η updates behind (``staleness``): dropped by the staleness bound."""


def check_scored(g: ScoredGroup, *, vocab_size: int, group_size: int | None = None, version: int | None = None) -> None:
    """Defects only the trainer can see: token ids its model cannot embed, a group of another size
    than ``generator.group_size``, a policy version newer than its own ``version`` (every version
    it has published), scores out of range (``records.check_scores``)."""
    check_token_ids("prompt", g.rollout.prompt_ids, vocab_size)
    check_token_ids("completion", g.rollout.completion_ids, vocab_size)
    check_group_size(g.rollout, group_size)
    if version is not None:
        check_versions(g.rollout, newest=version)
    check_scores(g)


def collect_batch(stage: Stage, *, size: int, held: set[str] = frozenset()) -> list[tuple] | None:
    """Read until ``size`` new groups are in hand; None if a stop is requested first.

    Undecodable entries, and entries past their delivery limit, are dead-lettered; a
    prompt already in the ledger (trained or dropped before, e.g. redone by a generator
    after a crash) or ``held`` by a step not yet committed is acked and counted, never
    trained twice. The groups returned stay unacked until their step commits.
    """
    r, keys, log = stage.r, stage.keys, stage.log
    batch: list[tuple] = []
    seen: set[str] = set(held)
    while len(batch) < size:
        if stage.stopped():
            return None
        entries = stage.read(size - len(batch))
        if not entries:
            continue
        got = stage.take(entries)
        known = [ledger_outcome(r, keys, g.rollout.prompt_id) for g in got.records]
        duplicates = []
        for (e, g), outcome in zip(got.good, known):
            if outcome is not None or g.rollout.prompt_id in seen:
                log.warning("duplicate_skipped", prompt_id=g.rollout.prompt_id, group_id=g.rollout.group_id,
                            earlier=outcome.decode() if outcome else "a step not yet committed")
                duplicates.append((e, None))
            else:
                seen.add(g.rollout.prompt_id)
                batch.append((e, g))
        stage.emit(got, Output(written=duplicates, counters={"duplicates_skipped_total": len(duplicates)}))
    return batch


def ledger_outcome(r, keys: Keys, prompt_id: str) -> bytes | None:
    """The prompt's ledger outcome, from the ledger of the shard it is routed to."""
    return r.hget(keys.shard(keys.shard_of(prompt_id)).ledger, prompt_id)


def has_signal(g: ScoredGroup) -> bool:
    """Whether a group's rewards differ enough to give a GRPO gradient (docs/design.md §3: count, skip the rest)."""
    return float(np.std(g.rewards)) >= NO_SIGNAL_STD


def staleness(min_version: int, *, version: int, idle: Collection[int] = ()) -> int:
    """How many policy updates a group generated from ``min_version`` is behind ``version``: the
    versions after its own up to ``version``, less those whose step trained nothing (``idle``:
    their weights are their parent's, so a group is no more off-policy for them). Without idle
    versions, ``version − min_version``. A version lost in a crash counts (its step is unknown)."""
    return version - min_version - sum(1 for v in idle if min_version < v <= version)


def classify(batch: list[tuple], *, version: int, max_staleness: int, idle: Collection[int] = ()) -> list[Outcome]:
    """Each consumed group's outcome: stale (``staleness`` > η), trained or nosignal."""
    return [Outcome.STALE if staleness(g.rollout.min_version, version=version, idle=idle) > max_staleness
            else (Outcome.TRAINED if has_signal(g) else Outcome.NOSIGNAL) for _, g in batch]


@dataclass(frozen=True)
class Sorted:
    """A step's groups by outcome (``sort_step``)."""

    kinds: list[Outcome]
    """Each consumed group's outcome, in batch order."""
    fresh: list[ScoredGroup]
    """The groups within the staleness bound (trained or without signal)."""
    signal: list[ScoredGroup]
    """The fresh groups whose rewards differ: the ones the step trains on."""


def sort_step(batch: list[tuple], *, version: int, max_staleness: int, idle: Collection[int] = ()) -> Sorted:
    """Classify a step's (entry, group) pairs and re-check the staleness invariant on what is
    to be trained: the one place the trainer stage and ``pipeline.api.Learner`` both sort a step."""
    kinds = classify(batch, version=version, max_staleness=max_staleness, idle=idle)
    fresh = [g for (_, g), k in zip(batch, kinds) if k != Outcome.STALE]
    signal = [g for (_, g), k in zip(batch, kinds) if k == Outcome.TRAINED]
    if any(staleness(g.rollout.min_version, version=version, idle=idle) > max_staleness for g in signal):
        raise RuntimeError(f"staleness invariant violated at version {version}")
    return Sorted(kinds=kinds, fresh=fresh, signal=signal)


def sample_accuracy(fresh) -> float:
    """The hidden accuracy of the sampled completions of a step's fresh groups (0 for none)."""
    truth = np.concatenate([g.truth for g in fresh]) if fresh else np.zeros(0)
    return float(truth.mean()) if truth.size else 0.0


def step_metrics(batch, fresh, signal, *, version: int, stats: dict, wait_s: float, step_s: float,
                 idle: Collection[int] = ()) -> dict:
    """One metrics.jsonl row: the step's counts, reward and hidden accuracy, staleness, timing, loss stats."""
    rewards = np.concatenate([g.rewards for g in fresh]) if fresh else np.zeros(0)
    # Each token's own version (in-flight swaps give a group several): its lag behind the policy trained.
    lag = (version - 1 - np.concatenate([g.rollout.token_versions() for g in signal])) if signal else np.zeros(0)
    return {
        "token_lag_mean": float(lag.mean()) if lag.size else 0.0, "token_lag_max": int(lag.max()) if lag.size else 0,
        "groups_mixed_versions": sum(g.rollout.min_version != g.rollout.max_version for g in fresh),
        "version": version, "groups_trained": len(signal), "groups_nosignal": len(fresh) - len(signal),
        "groups_stale": len(batch) - len(fresh), "reward_mean": float(rewards.mean()) if rewards.size else 0.0,
        "reward_std": float(rewards.std()) if rewards.size else 0.0,
        "sample_accuracy": sample_accuracy(fresh),
        # Staleness as consumed (updates behind, ``staleness``): against the version before this
        # step (row["version"] is after it).
        "staleness_hist": np.bincount([staleness(g.rollout.min_version, version=version - 1, idle=idle)
                                       for _, g in batch]).tolist(),
        "wait_seconds": wait_s, "step_seconds": step_s,
        "labelmodel_versions": sorted({g.labelmodel_version for g in fresh}), **episode_metrics(fresh), **stats,
    }


def episode_metrics(fresh) -> dict:
    """Multi-turn episodes among a step's groups (none: {}): how many, turns per episode, the
    environment's reward (an episode it gave none counts 0, as reward mode ``environment``
    has it), and, when the records carry tool calls, the share of episodes with one
    (``tool_call_rate``), calls per episode and the share answered (``tool_call_success``,
    None when no call was made). docs/observing.md, "Episodes"."""
    eps = [g.rollout for g in fresh if g.rollout.turns is not None]
    if not eps:
        return {}
    turns = np.concatenate([r.turns for r in eps]).astype(np.float64)
    env = np.nan_to_num(np.concatenate([r.env_rewards for r in eps]).astype(np.float64), nan=0.0)
    out = {"episodes": int(turns.size), "turns_mean": float(turns.mean()), "env_reward_mean": float(env.mean())}
    counted = [r for r in eps if r.tool_calls is not None]
    if counted:
        calls = np.concatenate([r.tool_calls for r in counted]).astype(np.int64)
        ok = np.concatenate([r.tool_calls_ok for r in counted]).astype(np.int64)
        out.update(tool_call_rate=float((calls > 0).mean()), tool_calls_mean=float(calls.mean()),
                   episodes_with_tool_calls=int((calls > 0).sum()), tool_calls=int(calls.sum()),
                   tool_calls_ok=int(ok.sum()),
                   tool_call_success=float(ok.sum() / calls.sum()) if calls.sum() else None)
    return out


def step_record(batch, kinds: list[Outcome], *, version: int, row: dict) -> StepRecord:
    """What a step consumed, kept until a checkpoint holds the step and ``commit`` makes it final
    (an entry of None: a group handed to ``pipeline.api.Learner`` without a stream entry, nothing to ack)."""
    return StepRecord(
        version=version, entry_ids=[e.ref for e, _ in batch if e is not None],
        outcomes={g.rollout.prompt_id: f"{kind}:{version}" for (_, g), kind in zip(batch, kinds)},
        group_ids={g.rollout.prompt_id: g.rollout.group_id for _, g in batch},
        counts={"groups_trained_total": row["groups_trained"], "groups_nosignal_total": row["groups_nosignal"],
                "dropped_stale_total": row["groups_stale"], "tokens_trained_total": row.get("tokens", 0)})


def shard_committed(r, keys: Keys, k: int) -> int:
    """The last step whose commit is final in shard ``k``."""
    return int(r.get(keys.shard(k).committed) or 0)


# One shard's commit (docs/design.md §3, "Commit"): a script in the shard's slot that checks
# the shard's committed step first, so a commit sent again (redis-py's retry after a lost
# reply, or a resumed trainer re-applying its checkpoint's commit) repeats nothing.
# KEYS: ledger, trainlog, scored, stats, committed.
# ARGV: group, the last step, n steps, then per step: version, n prompts, (prompt id,
#       outcome, group id) each, n entry ids, ids..., n counters, (name, kind, value) each.
# Returns the number of steps applied (0: the shard had them all).
_COMMIT = """
local done = tonumber(redis.call('GET', KEYS[5]) or '0')
if done >= tonumber(ARGV[2]) then return 0 end
local i, applied = 4, 0
for _ = 1, tonumber(ARGV[3]) do
  local version = ARGV[i]
  local apply = tonumber(version) > done
  local np = tonumber(ARGV[i + 1])
  i = i + 2
  for _ = 1, np do
    if apply then
      redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1])
      redis.call('XADD', KEYS[2], '*', 'prompt_id', ARGV[i], 'group_id', ARGV[i + 2], 'outcome', ARGV[i + 1],
                 'version', version)
    end
    i = i + 3
  end
  local ni = tonumber(ARGV[i])
  i = i + 1
  if apply then
    for j = i, i + ni - 1, 500 do
      redis.call('XACK', KEYS[3], ARGV[1], unpack(ARGV, j, math.min(j + 499, i + ni - 1)))
    end
  end
  i = i + ni
  local nc = tonumber(ARGV[i])
  if apply then
    add_counters(KEYS[4], i + 1, nc)
    applied = applied + 1
  end
  i = i + 1 + 3 * nc
end
redis.call('SET', KEYS[5], ARGV[2])
return applied
"""


def _commit_args(shard, steps: list[StepRecord], keys: Keys) -> list:
    """The per-step arguments of one shard's commit: its prompts, its entries, and (shard 0) the counters."""
    args: list = []
    for s in steps:
        prompts = [(pid, outcome) for pid, outcome in s.outcomes.items() if keys.shard_of(pid) == shard.index]
        args += [s.version, len(prompts)]
        for pid, outcome in prompts:
            args += [pid, outcome, s.group_ids.get(pid, "")]
        ids = [eid for k, eid in map(parse_ref, s.entry_ids) if k == shard.index]
        counters = counter_args(s.counts) if shard.index == 0 else []
        args += [len(ids), *ids, len(counters) // 3, *counters]
    return args


def commit(r, keys: Keys, steps: list[StepRecord]) -> None:
    """Make checkpointed steps final: ledger (HSETNX), training log, acks, counters.

    One transaction per shard (a script, ``_COMMIT``), holding that shard's prompts (by
    ``Keys.shard_of``) and entries (by ``Entry.ref``); shard 0's also carries the steps'
    counters. Each records the shard's last committed step and, inside the same
    transaction, first checks it: steps the shard already committed are skipped, so a
    commit sent again (redis-py's retry after a lost reply) or re-applied after a crash
    between shards neither repeats a training-log entry nor a counter.
    ``{ns}:trainer`` ``committed_version`` is set once every shard has it: a resumed
    trainer re-applies only the steps of its checkpoint beyond it.
    """
    if not steps:
        return
    last = steps[-1].version
    script = txn_script(r, _COMMIT)
    for shard in keys.all_shards():
        script(keys=[shard.ledger, shard.trainlog, shard.scored, shard.stats, shard.committed],
               args=[TRAINER_GROUP, last, len(steps), *_commit_args(shard, steps, keys)])
    r.hset(keys.trainer, "committed_version", last)


def report_progress(r, keys: Keys, *, version: int, row: dict) -> None:
    episodes = {k: row[k] for k in ("env_reward_mean", "tool_call_rate") if row.get(k) is not None}
    r.hset(keys.trainer, mapping={"version": version, "reward_mean": row["reward_mean"],
                                  "sample_accuracy": row["sample_accuracy"], "updated_at": time.time(), **episodes})


def accuracy_by_source(items, right) -> dict[str, float]:
    """Held-out accuracy per ``Item.source`` (a reasoning-gym dataset), in the order the sources
    first appear; empty when the items have no source."""
    by: dict[str, list[float]] = {}
    for item, ok in zip(items, right):
        if item.source:
            by.setdefault(item.source, []).append(ok)
    return {name: float(np.mean(v)) for name, v in by.items()}


def record_lost_versions(r, keys: Keys, versions) -> None:
    """Add ``versions`` (published, their model died with a trainer before a checkpoint held it) to the
    run's record of them (``lost_versions`` of ``{ns}:trainer``, a JSON list; the summary counts it). A
    set, so a trainer that dies again before publishing anything counts no version twice."""
    known = set(json.loads(r.hget(keys.trainer, "lost_versions") or "[]"))
    r.hset(keys.trainer, "lost_versions", json.dumps(sorted(known | set(versions))))


class Trainer:
    """The trainer process: its engine, held-out set, publisher, checkpoints and uncommitted steps."""

    def __init__(self, cfg: RunConfig, r, keys: Keys, log, *, run_dir: Path | None = None,
                 engine: TrainEngine | None = None) -> None:
        self.cfg, self.r, self.keys, self.log = cfg, r, keys, log
        age = process_age_s()
        self.started_age_s = None if age is None else round(age, 3)
        """Seconds from the process's start to this trainer's (interpreter, imports, connection)."""
        t0 = time.perf_counter()
        self._payload_bytes = -1
        self.engine = engine if engine is not None else make_train_engine(cfg)
        self.task = make_task(cfg.task)
        self.heldout = self.task.heldout()
        fmt = prompt_format(cfg.task, cfg.model.base_dir)
        self.heldout_ids = [build_prompt(fmt, self.engine.tokenizer, item.prompt)[1] for item in self.heldout]
        self.metrics = MetricsFile(run_dir / "metrics.jsonl" if run_dir else None,
                                   trackers=Trackers(cfg, run_dir, log) if cfg.tracking.backends else None)
        self.run_dir = run_dir
        self.ckpt_dir = run_dir / "checkpoints" if run_dir else None
        self.archive = ArchiveWriter(run_dir / ARCHIVE_DIR, keep_steps=cfg.trainer.archive_keep_steps) \
            if run_dir is not None and cfg.trainer.archive else None
        """The rollout archive (``trainer.archive``): every group trained on, per step, with the weights' hash."""
        # The only consumer of its group: nothing to reclaim from others, and its own
        # uncommitted entries must not come back to it while it still holds them.
        self.stage = Stage(r, keys, cfg, name="trainer", worker_id="trainer", log=log, source="scored",
                           group=TRAINER_GROUP, decode=ScoredGroup.decode, claim=False,
                           check=lambda g: check_scored(g, vocab_size=self.engine.vocab_size, version=self.version,
                                                        group_size=cfg.generator.group_size))
        self.publisher = make_publisher(cfg.weights.transport, r, keys.weights, ns=keys.ns,
                                        keep_versions=cfg.weights.keep_versions, **publisher_options(cfg.weights))
        self.version = 0
        self.evals: dict[int, float] = {}
        self.uncommitted: list[StepRecord] = []
        self.refills = 0
        """Extra reads of the last step under dynamic sampling."""
        self.held: set[str] = set()
        self.labelmodel_versions: set[int] = set()
        self.idle_versions: set[int] = set()
        """Versions whose step trained nothing (``staleness`` does not count them)."""
        self._env = None
        """The environment factory of the held-out episodes (``env.kind``), built at the first evaluation."""
        self.init_s = round(time.perf_counter() - t0, 3)
        """Seconds building the engine (the base model), the held-out set, the reader and the publisher."""

    def resume(self) -> Path | None:
        """Restore the latest checkpoint and re-apply its commit; the checkpoint, or None for a fresh start."""
        path = checkpoint.latest(self.ckpt_dir) if self.ckpt_dir is not None and self.cfg.trainer.resume else None
        r, keys = self.r, self.keys
        if path is None:
            announced = int(r.hget(keys.trainer, "version") or 0)
            if announced > 0:
                # An attempt that died before its first checkpoint published versions: versions
                # only go up (generators hold them, verifiers check groups against the newest),
                # so the base becomes the next one, as after a crash past a checkpoint.
                self.log.warning("versions_lost_in_crash", checkpoint=0, announced=announced,
                                 resume_as=announced + 1)
                record_lost_versions(r, keys, range(1, announced + 1))
                self.version = announced + 1
            if self.archive is not None:  # segments of a first attempt that died before a checkpoint go
                self.archive.resumed(0, self.version)
                self.archive.base(weights_hash(self.engine.weights()), base_dir=self.cfg.model.base_dir)
            return None
        state = checkpoint.load(path)
        self.engine.load_state(path, state.engine)
        committed = int(r.hget(keys.trainer, "committed_version") or 0)
        reapply = [s for s in state.uncommitted if s.version > committed]
        commit(r, keys, reapply)
        self.version, self.evals = state.version, state.evals
        self.labelmodel_versions.update(state.labelmodel_versions)
        self.idle_versions = set(state.idle_versions)
        announced = int(r.hget(keys.trainer, "version") or 0)
        if announced > self.version:
            # Steps after the checkpoint published versions whose model died with the
            # process. Versions only go up: the checkpoint's model becomes the next one.
            self.log.warning("versions_lost_in_crash", checkpoint=self.version, announced=announced,
                             resume_as=announced + 1)
            record_lost_versions(r, keys, range(self.version + 1, announced + 1))
            self.version = announced + 1
        if self.archive is not None:
            abandoned = self.archive.resumed(state.version, self.version)
            if abandoned:
                self.log.info("archive_steps_abandoned", steps=abandoned, checkpoint=state.version)
        self.log.info("trainer_resumed", checkpoint=str(path), version=self.version, reapplied_steps=len(reapply),
                      committed_before=committed)
        return path

    def durable(self) -> Path | None:
        """Checkpoint, then make the checkpointed steps final (the order that loses nothing), then
        trim; the checkpoint (None without a run directory). The trainer's commit, and
        ``pipeline.api.Learner.commit``'s."""
        path = None
        if self.archive is not None:  # the archive holds every step a checkpoint holds
            self.archive.flush()
        if self.ckpt_dir is not None:
            path = checkpoint.save(self.ckpt_dir, write=self.engine.save_state, keep=self.cfg.trainer.keep_checkpoints,
                            state=checkpoint.TrainerState(
                                version=self.version, evals=self.evals, uncommitted=list(self.uncommitted),
                                labelmodel_versions=sorted(self.labelmodel_versions),
                                idle_versions=sorted(self.idle_versions)))
        commit(self.r, self.keys, self.uncommitted)
        self.uncommitted.clear()
        self.held.clear()
        self.stage.trim()
        return path

    def evaluate(self) -> float:
        """Greedy accuracy of the current policy on the held-out set; with an environment
        (``env.kind``), the held-out episodes' success (pipeline.engines.episodes)."""
        t0 = time.perf_counter()
        if self.cfg.env.kind:
            extra = self._evaluate_episodes()
            acc = extra.pop("heldout_accuracy")
        else:
            answers = self.engine.greedy(self.heldout_ids, max_new_tokens=self.task.eval_max_new_tokens)
            right = [self.task.correctness(item.reference, [a])[0] for item, a in zip(self.heldout, answers)]
            acc = float(np.mean(right))
            by_source = accuracy_by_source(self.heldout, right)
            extra = {"heldout_by_dataset": by_source} if by_source else {}
        self.metrics.write("eval", version=self.version, heldout_accuracy=acc, n=len(self.heldout), **extra)
        self.log.info("evaluated", version=self.version, heldout_accuracy=acc,
                      seconds=round(time.perf_counter() - t0, 3), **extra)
        self.r.hset(self.keys.trainer, mapping={"eval_accuracy": acc, "eval_version": self.version})
        self.evals[self.version] = acc
        return acc

    def _evaluate_episodes(self) -> dict:
        """The held-out prompts played greedily through the run's environment (built here at
        the first evaluation, closed with the trainer): success, tool-call rate, turns."""
        if self._env is None:
            self._env = make_env(self.cfg)
        played = self.engine.play(self.heldout_ids, [item.reference for item in self.heldout], self._env,
                                  max_turns=self.cfg.env.max_turns, max_new_tokens=self.cfg.task.max_new_tokens,
                                  texts=[item.prompt for item in self.heldout],
                                  max_turn_tokens=self.cfg.env.max_turn_tokens,
                                  chat=ChatTurns.of(prompt_format(self.cfg.task, self.cfg.model.base_dir),
                                                    self.engine.tokenizer))
        for p in played:
            if p.error is not None:
                self.log.warning("heldout_episode_failed", error=p.error)
                break
        return summarise(played)

    def publish(self) -> None:
        # publish() copies into the transport's buffer, and that copy is the snapshot:
        # the live parameters can go in as they are.
        m = self.publisher.publish(self.version, self.engine.adapter_tensors()
                                   if self.cfg.weights.payload == "adapter" else self.engine.weights())
        if m.total_bytes != self._payload_bytes:  # what one version weighs on the wire (the summary reports it)
            self._payload_bytes = m.total_bytes
            self.r.hset(self.keys.trainer, mapping={"payload_bytes": m.total_bytes,
                                                    "payload": self.cfg.weights.payload})
        self.r.xadd(self.keys.versions, {"version": self.version}, maxlen=10_000, approximate=True)
        self.r.hset(self.keys.trainer, "version", self.version)

    def sort(self, batch: list[tuple]) -> Sorted:
        """The step's groups by outcome at the current version, the staleness invariant checked (``sort_step``)."""
        return sort_step(batch, version=self.version, max_staleness=self.cfg.trainer.max_staleness,
                         idle=self.idle_versions)

    def step(self, batch: list[tuple], *, wait_s: float) -> dict:
        """Classify the batch, train on the groups with signal, and record the step (not yet committed)."""
        t_step = time.perf_counter()
        # One order whatever the arrival order: the prompts' sequence (the feeder's ids).
        batch = sorted(batch, key=lambda eg: eg[1].rollout.prompt_id)
        s = self.sort(batch)
        if self.version == 0:  # the base's own samples, known before the first update (the driver reads it)
            self.r.hset(self.keys.trainer, "first_batch_accuracy", sample_accuracy(s.fresh))
        stats = self.engine.train_step(s.signal) if s.signal else {}
        return self.record(batch, s, stats=stats, updated=bool(s.signal), wait_s=wait_s, started=t_step)

    def record(self, batch: list[tuple], s: Sorted, *, stats: dict, updated: bool, wait_s: float,
               started: float) -> dict:
        """After a step's optimizer update (``updated``: one was made): the learning-rate schedule,
        version + 1, the metrics row written, and the step kept for the next commit (``durable``).
        ``step`` and a step written by hand (``pipeline.api.Learner.update``) end here."""
        if updated:  # the lr warm-up counts optimizer updates; a step that trained nothing made none
            self.engine.lr_step()
        parent = self.version
        self.version += 1
        if not updated:
            self.idle_versions.add(self.version)
        digest = weights_hash(self.engine.weights())
        if self.archive is not None:
            self.archive.write(step=self.version, parent=parent, groups=[g for _, g in batch],
                               outcomes=[str(k) for k in s.kinds], weights_hash=digest, updated=updated)
        row = step_metrics(batch, s.fresh, s.signal, version=self.version, stats=stats, wait_s=wait_s,
                           idle=self.idle_versions,
                           step_s=time.perf_counter() - started)
        row["groups_consumed"] = len(batch)
        row["weights_hash"] = digest
        if self.cfg.trainer.dynamic_sampling:
            row["refills"] = self.refills
        self.uncommitted.append(step_record(batch, s.kinds, version=self.version, row=row))
        self.held.update(g.rollout.prompt_id for _, g in batch)
        self.labelmodel_versions.update(g.labelmodel_version for g in s.fresh)
        # The row first: a step redone after a crash rewrites its row (readers keep the last).
        self.metrics.write("step", **row)
        return row

    def refill(self, batch: list[tuple]) -> list[tuple] | None:
        """Dynamic sampling (DAPO): while fewer than ``groups_per_step`` groups of the batch have
        signal, read as many more, at most ``trainer.max_refills`` times. Every group read is
        consumed (no-signal and stale ones are counted and committed as always). Before each
        read, as many admission slots as it will read go back (the groups in hand that will not
        count), so generators can make the replacements and every step still counts
        ``groups_per_step`` groups against the staleness bound. The give-back's token is the
        step's version and the refill's number: a step redone after a crash gives back nothing twice."""
        t = self.cfg.trainer
        self.refills = 0
        for n in range(t.max_refills):
            kinds = classify(batch, version=self.version, max_staleness=t.max_staleness, idle=self.idle_versions)
            missing = t.groups_per_step - sum(kind == Outcome.TRAINED for kind in kinds)
            if missing <= 0:
                break
            self.refills = n + 1
            release_once(self.r, self.keys, missing, writer_id="trainer:refills",
                         seq=(self.version + 1) * 10_000 + n)
            more = collect_batch(self.stage, size=missing,
                                 held=self.held | {g.rollout.prompt_id for _, g in batch})
            if more is None:
                return None
            batch = batch + more
        return batch

    def run(self) -> dict:
        """Train until the policy reaches version ``trainer.steps`` (or a stop); returns a summary."""
        t, r, keys = self.cfg.trainer, self.r, self.keys
        t0 = time.perf_counter()
        resumed_from = self.resume()
        t1 = time.perf_counter()
        self.publish()
        t2 = time.perf_counter()
        # A start with neither a checkpoint nor versions published before it (resume's lost-versions case).
        fresh = resumed_from is None and self.version == 0
        if fresh and self.version not in self.evals:
            # The base model's accuracy; a resumed trainer evaluates on its schedule, not before training.
            self.evaluate()
        if fresh:
            r.hset(keys.trainer, "base_accuracy", self.evals[0])
        r.hset(keys.trainer, mapping={"steps": t.steps, "state": "training"})
        # Where a (re)start's time goes, up to training: what the driver's resume time is made of.
        startup = {"before_init_s": self.started_age_s, "init_s": self.init_s, "resume_s": round(t1 - t0, 3),
                   "publish_s": round(t2 - t1, 3), "eval_s": round(time.perf_counter() - t2, 3)}
        self.log.info("trainer_started", steps=t.steps, groups_per_step=t.groups_per_step,
                      max_staleness=t.max_staleness, version=self.version, checkpoint_every=t.checkpoint_every,
                      resumed=not fresh, startup=startup)
        while self.version < t.steps:
            t_wait = time.perf_counter()
            batch = collect_batch(self.stage, size=t.groups_per_step, held=self.held)
            if batch is not None and t.dynamic_sampling:
                batch = self.refill(batch)
            if batch is None:
                self.log.info("stop_requested", version=self.version)
                break
            try:
                row = self.step(batch, wait_s=time.perf_counter() - t_wait)
            except STAGE_ERRORS:
                raise
            except Exception as err:  # something the groups brought, past every check: exit, resume
                self.log.error("step_failed", version=self.version, groups=len(batch), error=failure_summary(err),
                               then="exit; the restarted trainer resumes from its checkpoint and the groups' "
                                    "delivery count dead-letters them (redis.max_deliveries)")
                raise StepFailed(f"step {self.version + 1} failed on the groups in hand: {failure_summary(err)}") \
                    from err
            if self.version % t.checkpoint_every == 0 or self.version >= t.steps:
                self.durable()
            self.publish()
            report_progress(r, keys, version=self.version, row=row)
            self.log.info("step", **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()})
            if self.version % t.eval_every == 0 or self.version == t.steps:
                self.evaluate()
        if self.uncommitted:
            self.durable()
        if self.run_dir is not None:
            self.engine.export_hf(self.run_dir / "checkpoints" / "final")
        r.hset(keys.trainer, "state", "finished" if self.version >= t.steps else "stopped")
        return {"version": self.version, "evals": self.evals}

    def close(self) -> None:
        if self.archive is not None:
            self.archive.close()
        self.metrics.close()
        self.publisher.close()
        self.engine.close()
        close_env = getattr(self._env, "close", None)
        if callable(close_env):  # an OpenEnv app's servers, started for the held-out episodes
            close_env()


class StepFailed(RuntimeError):
    """A step failed on the groups in hand with an error no check foresaw; the process exits
    with ``EXIT_ENTRIES_FAILED`` (``run_trainer``)."""


def run_trainer(cfg: RunConfig, r, keys: Keys, log, *, run_dir: Path | None = None,
                engine: TrainEngine | None = None) -> dict:
    """Train until the policy reaches version ``trainer.steps`` (or a stop); returns a summary.

    ``engine`` does the tensor work (``trainer.backend``; on torchtitan this process is the
    driver rank and the engine runs each operation on every rank); it is closed on return,
    with the publisher's transport resources (shm files, a tcp server thread), however the
    loop ends, an interrupt included. A step that fails on its groups exits the process with
    ``EXIT_ENTRIES_FAILED`` (``pipeline.common.procs``), which the driver restarts at once.
    """
    trainer = Trainer(cfg, r, keys, log, run_dir=run_dir, engine=engine)
    try:
        summary = trainer.run()
    except StepFailed:
        raise SystemExit(EXIT_ENTRIES_FAILED) from None
    finally:
        trainer.close()
    log.info("trainer_finished", version=summary["version"], evals=summary["evals"])
    return summary
