"""Verifier: scores every completion with weak verifiers and aggregates them into a reward.

consumes:     RolloutGroup records from {ns}:rollouts (group "verifiers"), acked with the output
produces:     ScoredGroup records on {ns}:scored, each naming the label-model version used
waits for:    rollout groups; on first start, a label model fitted by some replica
unblocked by: generators
Weak verifiers never see the reference answer; it is used only for the hidden accuracy
logged beside the reward (and by the ``ground_truth`` reward mode for experiments).
With sharded streams a batch comes from rollouts shard k and goes to scored shard k.
"""

from __future__ import annotations

import json
import time

import msgpack
import numpy as np

from pipeline.config import ConfigError, RunConfig, VerifierConfig
from pipeline.keys import TRAINER_GROUP, VERIFIERS_GROUP, Keys
from pipeline.algo.labelmodel import LabelModel, fit_label_model
from pipeline.records import RolloutGroup, ScoredGroup, check_token_ids
from pipeline.algo.rewards import RewardMode, parse_reward_mode
from pipeline.bus.flow import release_admissions, stop_requested, wait_for_room
from pipeline.bus.stats import heartbeat, incr_stats
from pipeline.bus.streams import FIELD, dead_letter, decode_entries, ensure_all_groups, sharded_reader, trim_acked
from pipeline.tasks.registry import make_task
from pipeline.model.tokenizer import model_vocab_size
from pipeline.verifiers.base import SOUND
from pipeline.verifiers.registry import Scorer, check_spec

FIRST_MODEL_WAIT_S = 60.0
TRIM_EVERY = 10
"""Batches between trims of the acked rollouts."""
LOCK_TTL_MS = 30_000


class SharedLabelModel:
    """The label model all verifier replicas score with (DESIGN §5 step 8).

    Each replica appends its groups' votes to the ``{ns}:votes`` window; whichever
    replica takes ``{ns}:labelmodel:lock`` refits on the window and stores the result
    with the next version in ``{ns}:labelmodel``; every replica then scores with that
    version, so the replicas never disagree about the reward of the same votes.
    """

    def __init__(self, r, keys: Keys, cfg: VerifierConfig, worker_id: str, log):
        self.r, self.keys, self.cfg, self.worker_id, self.log = r, keys, cfg, worker_id, log
        self.model: LabelModel | None = None
        self.version = -1

    def add_votes(self, votes: list[np.ndarray]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for v in votes:
            pipe.lpush(self.keys.votes, np.ascontiguousarray(v, dtype="<f4").tobytes())
        max_groups = max(1, self.cfg.window // max(1, votes[0].shape[0]))
        pipe.ltrim(self.keys.votes, 0, max_groups - 1)
        pipe.hincrby(self.keys.labelmodel, "new_groups", len(votes))
        pipe.execute()

    def _refit(self, version: int) -> None:
        if not self.r.set(self.keys.labelmodel_lock, self.worker_id, nx=True, px=LOCK_TTL_MS):
            return  # another replica is fitting
        try:
            m = len(self.cfg.verifiers)
            rows = [np.frombuffer(b, dtype="<f4").reshape(-1, m) for b in self.r.lrange(self.keys.votes, 0, -1)]
            votes = np.concatenate(rows)
            t0 = time.perf_counter()
            sound = [n for n in self.cfg.verifiers if n in SOUND] if self.cfg.sound_checks else []
            lm = fit_label_model(votes, list(self.cfg.verifiers), version=version + 1, dependence=self.cfg.dependence,
                                 sound=sound)
            self.r.hset(self.keys.labelmodel, mapping={
                "version": version + 1, "params": msgpack.packb(lm.to_dict()), "rows": len(votes), "new_groups": 0})
            self.log.info("labelmodel_fitted", seconds=round(time.perf_counter() - t0, 4), **lm.report())
        finally:
            self.r.delete(self.keys.labelmodel_lock)

    def current(self) -> LabelModel:
        deadline = time.monotonic() + FIRST_MODEL_WAIT_S
        while True:
            version, new, rows = self.r.hmget(self.keys.labelmodel, "version", "new_groups", "rows")
            version = int(version) if version is not None else -1
            if version < 0 or int(new or 0) >= self.cfg.refit_every or int(rows or 0) < self.cfg.min_fit_rows:
                self._refit(version)
                version = int(self.r.hget(self.keys.labelmodel, "version") or -1)
            if version != self.version and version >= 0:
                params = self.r.hget(self.keys.labelmodel, "params")
                self.model, self.version = LabelModel.from_dict(msgpack.unpackb(params)), version
            if self.model is not None:
                return self.model
            if time.monotonic() > deadline:
                raise TimeoutError(f"no label model in {self.keys.labelmodel} after {FIRST_MODEL_WAIT_S} s")
            time.sleep(0.05)  # another replica holds the lock for the first fit


def check_tokens(g: RolloutGroup, *, vocab_size: int) -> None:
    check_token_ids("completion", g.completion_ids, vocab_size)


def reward_mode(v: VerifierConfig) -> RewardMode:
    """The configured reward mode, refused at start (naming the field) rather than per message."""
    for n in v.verifiers:
        try:
            check_spec(n)
        except ValueError as e:
            raise ConfigError(f"verifier.verifiers: {e}") from None
    try:
        mode = parse_reward_mode(v.reward)
    except ValueError as e:
        raise ConfigError(f"verifier.reward: {e}") from None
    if mode.verifier is not None and mode.verifier not in v.verifiers:
        raise ConfigError(f"verifier.reward: {v.reward!r} names a verifier not in verifier.verifiers {v.verifiers}")
    return mode


POSTERIORS_DIR = "posteriors"
"""Per run and verifier replica, ``posteriors/<worker>.jsonl``: one JSON line per scored group
(prompt, completions, votes, Weaver posterior, hidden truth), the training data of ``pipeline
distill``; the scored stream itself is gone after the run. One file per replica, so replicas on
several hosts appending over a network file system never interleave."""


def posterior_row(g: RolloutGroup, votes: np.ndarray, truth: np.ndarray, lm: LabelModel | None,
                  names) -> dict:
    """One group's line of the posteriors file; ``posterior`` is null when no label model was in use."""
    post = None if lm is None else [round(float(x), 5) for x in lm.posterior(votes, list(names))]
    return {"group_id": g.group_id, "prompt_id": g.prompt_id, "prompt": g.prompt,
            "completions": list(g.completions), "names": list(names),
            "votes": [[None if np.isnan(x) else round(float(x), 5) for x in row] for row in votes],
            "posterior": post, "truth": [int(t) for t in truth],
            "labelmodel_version": -1 if lm is None else lm.version, "policy_version": g.min_version}


def append_posteriors(path, rows: list[dict]) -> None:
    """Append the batch's lines in one write (O_APPEND), so replicas never interleave within a line."""
    if rows:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))


def score_batch(scorer: Scorer, groups: list[RolloutGroup], log) -> tuple[list[np.ndarray], dict[str, int]]:
    """Votes of each group, and how many (group, verifier) pairs abstained by error or timeout.

    A verifier that fails or misses its deadline abstains for that group and is logged
    with its running counters; it never stops the stage.
    """
    votes, failed = [], {"error": 0, "timeout": 0}
    for g in groups:
        vt, outcome = scorer.score(g.prompt, g.completions)
        votes.append(vt)
        for name, o in outcome.items():
            if o != "ok":
                failed[o] += 1
                st = scorer.stats[name]
                log.warning("verifier_abstained", verifier=name, outcome=o, reason=st.last_error,
                            group_id=g.group_id, abstained_total=st.abstained, timeouts_total=st.timeouts)
    return votes, failed


def run_verifier(cfg: RunConfig, r, keys: Keys, worker_id: str, log, *, max_batches: int | None = None) -> int:
    """Score rollout groups until stopped (or ``max_batches`` non-empty reads); returns groups scored."""
    v = cfg.verifier
    mode = reward_mode(v)
    ensure_all_groups(r, keys)
    vocab_size = model_vocab_size(cfg.model.base_dir)
    the_task = make_task(cfg.task)
    shared = SharedLabelModel(r, keys, v, worker_id, log) if mode.needs_label_model else None
    reader = sharded_reader(r, keys, "rollouts", VERIFIERS_GROUP, worker_id, cfg.redis)
    posteriors_path = cfg.run_dir / POSTERIORS_DIR / f"{worker_id}.jsonl"
    scorer = Scorer(v.verifiers, timeouts=v.timeout_map(), default_timeout_s=v.timeout_s)
    batches, scored = 0, 0
    log.info("verifier_started", reward=v.reward, verifiers=v.verifiers)
    while not stop_requested(r, keys) and (max_batches is None or batches < max_batches):
        # Backpressure before taking work: the trainer has not drained what we wrote.
        wait_for_room(r, keys, keys.stream_keys("scored"), TRAINER_GROUP, bound=cfg.redis.max_stream_lag,
                      worker_id=worker_id, stage="verifier", log=log)
        entries = reader.read(v.batch, cfg.redis.block_ms)
        if not entries:
            heartbeat(r, keys, worker_id, "verifier", "idle")
            continue
        batches += 1
        shard = keys.shard(entries[0].shard)  # one read, one shard
        t0 = time.perf_counter()
        good, bad = decode_entries(entries, RolloutGroup.decode, lambda g: check_tokens(g, vocab_size=vocab_size),
                                   reader=reader)
        votes, failed = score_batch(scorer, [g for _, g in good], log)
        lm = None
        if shared is not None and good:
            shared.add_votes(votes)
            lm = shared.current()
        pipe = r.pipeline(transaction=True)
        rows = []
        for (e, g), vt in zip(good, votes):
            truth = the_task.correctness(g.reference, g.completions)
            rewards = mode(votes=vt, names=v.verifiers, completions=g.completions, label_model=lm, truth=truth,
                           prompt=g.prompt, answer=the_task.answer)
            rows.append(posterior_row(g, vt, truth, lm, v.verifiers))
            rec = ScoredGroup(rollout=g, verifier_names=tuple(v.verifiers), votes=vt.astype(np.float32),
                              rewards=rewards.astype(np.float32), truth=truth.astype(np.float32),
                              reward_mode=v.reward, labelmodel_version=shared.version if shared else -1,
                              verifier_id=worker_id, scored_at=time.time())
            pipe.xadd(shard.scored, {FIELD: rec.encode()})
            pipe.xack(shard.rollouts, VERIFIERS_GROUP, e.id)
        releases = 0
        for e, reason in bad:
            log.warning("dead_letter", id=e.id, reason=reason)
            releases += dead_letter(pipe, keys, stream=shard.rollouts, group=VERIFIERS_GROUP, entry=e, reason=reason,
                                    consumer=worker_id, release_admission=True)
        incr_stats(pipe, shard, groups_scored_total=len(good), verifier_errors_total=failed["error"],
                   verifier_timeouts_total=failed["timeout"], verify_seconds_total=time.perf_counter() - t0)
        pipe.execute()
        release_admissions(r, keys, releases)
        append_posteriors(posteriors_path, rows)
        scored += len(good)
        if cfg.redis.trim_acked and batches % TRIM_EVERY == 0:
            for key in keys.stream_keys("rollouts"):
                trim_acked(r, key)
        heartbeat(r, keys, worker_id, "verifier", "scored", groups=scored,
                  abstained={n: st.abstained for n, st in scorer.stats.items()})
        log.info("batch_scored", groups=len(good), dead=len(bad), labelmodel_version=shared.version if shared else -1,
                 seconds=round(time.perf_counter() - t0, 4))
    log.info("verifier_stopped", groups=scored)
    return scored
