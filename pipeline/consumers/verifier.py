"""Verifier: scores every completion with weak verifiers and aggregates them into a reward.

consumes:     RolloutGroup records from {ns}:rollouts (group "verifiers"), acked with the output
produces:     ScoredGroup records on {ns}:scored, each naming the label-model version used
waits for:    rollout groups; on first start, a label model fitted by some replica
unblocked by: generators
Weak verifiers never see the reference answer; it is used only for the hidden accuracy
logged beside the reward (and by the ``ground_truth`` reward mode for experiments).
A batch comes from rollouts shard k and goes to scored shard k.

The loop (``Stage.run``): wait for room downstream → take rollout groups → score every
completion with each weak verifier whose votes the reward reads (all of them for Weaver; the
rest only on ``verifier.monitor_share`` of the groups, their columns NaN elsewhere) → add
the votes to the label model's window and take its current version (``verifier.refit =
"versions"``: each group's policy version's fit) → aggregate votes into
rewards → emit the scored groups and ack the rollouts in one transaction (``Stage.emit``: the
emit Lua script, or a MULTI/EXEC when the records come to ``stage.MULTI_BYTES`` or more) →
append the posteriors file.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import zlib
from collections.abc import Callable, Collection, Sequence

import msgpack
import numpy as np

from pipeline.algo.labelmodel import LabelModel, fit_label_model
from pipeline.algo.scoremodel import ScoreModel, fit_score_model
from pipeline.algo.rewards import RewardMode, parse_reward_mode
from pipeline.bus.flow import NewestVersion
from pipeline.config import ConfigError, RunConfig, VerifierConfig
from pipeline.keys import TRAINER_GROUP, VERIFIERS_GROUP, Keys
from pipeline.model.tokenizer import model_vocab_size
from pipeline.records import RolloutGroup, ScoredGroup, check_group_size, check_token_ids, check_versions
from pipeline.stage import Batch, Output, Stage
from pipeline.tasks.prompting import prompt_format
from pipeline.tasks.registry import make_task
from pipeline.verifiers.base import VERIFIER_COMPLETIONS, VERIFIER_SECONDS, is_sound
from pipeline.verifiers.registry import Scorer, applicability_problems, check_spec

FIRST_MODEL_WAIT_S = 60.0
LOCK_TTL_MS = 30_000


class SharedLabelModel:
    """The label model all verifier replicas score with (docs/design.md §5, "Online").

    Each replica appends its groups' votes to the ``{ns}:votes`` window; whichever
    replica takes ``{ns}:labelmodel:lock`` refits on the window and stores the result
    with the next version in ``{ns}:labelmodel``; every replica then scores with that
    version, so the replicas never disagree about the reward of the same votes.

    ``by_version`` (``verifier.refit = "versions"``): votes go to their policy version's hash
    (:meth:`version_votes`) and each replica fits, once per policy version, on the earlier
    versions' votes in a fixed order (:meth:`models`): the same inputs on every replica and
    in every run with η = 0, so the same model.
    """

    def __init__(self, r, keys: Keys, cfg: VerifierConfig, worker_id: str, log, *, by_version: bool = False):
        self.r, self.keys, self.cfg, self.worker_id, self.log = r, keys, cfg, worker_id, log
        self.model: LabelModel | None = None
        self.version = -1
        self.by_version = by_version
        """``verifier.refit`` resolved to ``versions``: one fit per policy version (:meth:`models`)."""
        self.fits: dict[int, LabelModel | None] = {}
        """``by_version``: this replica's fit for each policy version (None: too few earlier rows)."""
        self._few: dict[int, np.ndarray] = {}
        """``by_version``: the earlier votes of a version whose groups are each fitted with their own."""
        self._trimmed = 0

    def version_votes(self, version: int) -> str:
        """``by_version``: the hash of the votes of the groups sampled at policy ``version``
        (field: prompt id, value: the group's [G, m] votes as little-endian float32)."""
        return self.keys.version_votes(version)

    def add_votes(self, votes: list[np.ndarray], truths: list[np.ndarray] | None = None,
                  groups: Sequence[RolloutGroup] | None = None) -> None:
        """Append the groups' votes to the window (``by_version``: to their policy version's
        hash, which needs ``groups``); while the labelled set (``verifier.labels``) holds fewer
        rows than asked, the groups' votes with their hidden truth go there too."""
        if self.cfg.labels and truths is not None:
            have = int(self.r.llen(self.keys.labels)) * max(1, votes[0].shape[0])
            if have < self.cfg.labels:
                self.r.rpush(self.keys.labels, *[np.ascontiguousarray(np.column_stack([v, t]), dtype="<f4").tobytes()
                                                 for v, t in zip(votes, truths)])
        pipe = self.r.pipeline(transaction=False)
        if self.by_version:
            if groups is None:
                raise ValueError("verifier.refit = versions: add_votes needs the groups (their versions)")
            for g, v in zip(groups, votes):
                blob = np.ascontiguousarray(v, dtype="<f4").tobytes()
                pipe.hset(self.version_votes(g.min_version), g.prompt_id, blob)
            pipe.execute()
            return
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
            lm = self._fit(votes, version + 1)
            self.r.hset(self.keys.labelmodel, mapping={
                "version": version + 1, "params": msgpack.packb(lm.to_dict()), "rows": len(votes), "new_groups": 0})
        finally:
            self.r.delete(self.keys.labelmodel_lock)

    def _fit(self, votes: np.ndarray, version: int, *, log: bool = True) -> LabelModel:
        """The configured label model fitted on ``votes`` [N, m] (with the labelled set under
        ``label_model = "scores"``), published as ``version``."""
        m = len(self.cfg.verifiers)
        t0 = time.perf_counter()
        sound = [n for n in self.cfg.verifiers if is_sound(n)] if self.cfg.sound_checks else []
        if self.cfg.label_model == "scores":
            labelled = [np.frombuffer(b, dtype="<f4").reshape(-1, m + 1)
                        for b in self.r.lrange(self.keys.labels, 0, -1)]
            given = None
            if labelled:
                lab = np.concatenate(labelled)[: max(self.cfg.labels, 1)]
                given = (np.arange(len(votes), len(votes) + len(lab)), lab[:, m].astype(np.float64))
                votes = np.concatenate([votes, lab[:, :m]])
            lm = fit_score_model(votes, list(self.cfg.verifiers), sound=sound, version=version, labels=given)
        else:
            lm = fit_label_model(votes, list(self.cfg.verifiers), version=version,
                                 dependence=self.cfg.dependence, sound=sound,
                                 class_balance=self.cfg.class_balance or None, pi_estimate=self.cfg.pi_estimate)
        if log:
            self.log.info("labelmodel_fitted", seconds=round(time.perf_counter() - t0, 4), **lm.report())
        return lm

    def earlier_votes(self, version: int, group_size: int) -> np.ndarray:
        """``by_version``: the votes the fit for policy ``version`` reads: those of the groups of
        the versions before it, in a fixed order (version, then prompt id), the newest
        ``window`` completions' worth of whole groups. Version hashes older than the window
        needs (less a margin for late groups) are deleted."""
        m = len(self.cfg.verifiers)
        max_groups = max(1, self.cfg.window // max(1, group_size))
        blocks: list[list[bytes]] = []
        have, w = 0, version - 1
        while w >= 0 and have < max_groups:
            h = self.r.hgetall(self.version_votes(w))
            blocks.append([h[k] for k in sorted(h)])
            have += len(h)
            w -= 1
        if w > 1:  # versions at or below w are outside every later fit's window
            stale = range(self._trimmed, w - 1)
            if stale:
                self.r.delete(*(self.version_votes(x) for x in stale))
                self._trimmed = w - 1
        groups = [b for block in reversed(blocks) for b in block][-max_groups:]
        if not groups:
            return np.zeros((0, m), dtype=np.float32)
        return np.concatenate([np.frombuffer(b, dtype="<f4").reshape(-1, m) for b in groups])

    def models(self, groups: Sequence[RolloutGroup], votes: list[np.ndarray]) -> list[LabelModel]:
        """``by_version``: the label model of each group: its policy version's fit on the earlier
        versions' votes (:meth:`earlier_votes`), fitted once per version by this replica; while
        those hold fewer than ``min_fit_rows`` completions, a fit on them plus the group's own."""
        out = []
        for g, vt in zip(groups, votes):
            v = g.min_version
            if v not in self.fits:
                earlier = self.earlier_votes(v, vt.shape[0])
                self.fits[v] = self._fit(earlier, v) if len(earlier) >= self.cfg.min_fit_rows else None
                if self.fits[v] is None:
                    self._few[v] = earlier
                for old in sorted(self.fits)[:-4]:  # a few versions kept for groups that come late
                    del self.fits[old]
                    self._few.pop(old, None)
            lm = self.fits[v]
            if lm is None:
                lm = self._fit(np.concatenate([self._few[v], vt]), v, log=False)
            out.append(lm)
        return out

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
                d = msgpack.unpackb(params)
                kind = ScoreModel if d.get("kind") == "scores" else LabelModel
                self.model, self.version = kind.from_dict(d), version
            if self.model is not None:
                return self.model
            if time.monotonic() > deadline:
                raise TimeoutError(f"no label model in {self.keys.labelmodel} after {FIRST_MODEL_WAIT_S} s")
            time.sleep(0.05)  # another replica holds the lock for the first fit


def refits_by_version(cfg: RunConfig) -> bool:
    """``verifier.refit`` resolved: ``versions`` (``auto`` with ``trainer.max_staleness`` 0) or not."""
    refit = cfg.verifier.refit
    return refit == "versions" or (refit == "auto" and cfg.trainer.max_staleness == 0)


def make_scorer(v: VerifierConfig, build: Sequence[str] | None = None) -> Scorer:
    """The weak verifiers ``verifier.verifiers`` names, under their deadlines; of the kinds, only
    those of ``build`` built now (None: all), the others when a group first asks for them."""
    return Scorer(v.verifiers, timeouts=v.timeout_map(), default_timeout_s=v.timeout_s, build=build)


def monitored(group_id: str, share: float) -> bool:
    """Whether a group is one of the ``verifier.monitor_share`` on which every verifier runs:
    picked by a hash of its id, so replicas and reruns agree."""
    return share >= 1.0 or (share > 0.0 and zlib.crc32(group_id.encode()) < share * 2**32)


def check_rollout(g: RolloutGroup, *, vocab_size: int, group_size: int | None = None,
                  newest: Callable[[int], int] | None = None) -> None:
    """Defects only a stage of this run can see: token ids its model cannot embed, a group of
    another size than ``generator.group_size``, a policy version not yet published (``newest``:
    the newest published, given the version a record claims)."""
    check_token_ids("prompt", g.prompt_ids, vocab_size)
    check_token_ids("completion", g.completion_ids, vocab_size)
    check_group_size(g, group_size)
    if newest is not None:
        check_versions(g, newest=newest(g.max_version))


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
    missing = [n for n in mode.verifiers if n not in v.verifiers]
    if missing:
        raise ConfigError(f"verifier.reward: {v.reward!r} names {missing}, not in verifier.verifiers {v.verifiers}")
    return mode


def panel_problems(cfg: RunConfig, *, prompts: int = 8) -> list[str]:
    """Before launch: the verifiers this run will run (those the reward reads; all of them with
    ``verifier.monitor_share``) scored on ``prompts`` real training prompts of its task, rendered
    as the generators render them (``registry.applicability_problems``): one that applies to
    none is named. Nothing when the reward, a spec or the task is wrong (other checks name those)."""
    v = cfg.verifier
    try:
        run = v.verifiers if v.monitor_share > 0 else parse_reward_mode(v.reward).reads(v.verifiers)
        for spec in run:
            check_spec(spec)
        items = list(itertools.islice(make_task(cfg.task).training(cfg.feeder.seed), prompts)) if run else []
        fmt = prompt_format(cfg.task, cfg.model.base_dir)
    except (ValueError, ImportError, OSError):
        return []
    if not items:
        return []
    return applicability_problems(run, [fmt.render(i.prompt) for i in items], where=f"task {cfg.task.kind}'s")


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


def score_batch(scorer: Scorer, groups: list[RolloutGroup], log,
                runs: Callable[[RolloutGroup], Collection[str] | None] = lambda g: None,
                ) -> tuple[list[np.ndarray], dict[str, int]]:
    """Votes of each group, and how many (group, verifier) pairs abstained by error or timeout.

    ``runs(group)``: the verifiers to run on it (None: all); the others' columns stay NaN.
    A verifier that fails or misses its deadline abstains for that group and is logged
    with its running counters; it never stops the stage.
    """
    votes, failed = [], {"error": 0, "timeout": 0}
    for g in groups:
        vt, outcome = scorer.score(g.prompt, g.completions, only=runs(g))
        votes.append(vt)
        for name, o in outcome.items():
            if o in failed:
                failed[o] += 1
                st = scorer.stats[name]
                log.warning("verifier_abstained", verifier=name, outcome=o, reason=st.last_error,
                            group_id=g.group_id, abstained_total=st.abstained, timeouts_total=st.timeouts)
    return votes, failed


class VerifierStage:
    """One verifier process: the weak verifiers, the reward mode, the shared label model and the stage plumbing."""

    def __init__(self, cfg: RunConfig, r, keys: Keys, worker_id: str, log, *, scorer: Scorer | None = None) -> None:
        v = cfg.verifier
        self.cfg, self.worker_id, self.log = cfg, worker_id, log
        self.mode = reward_mode(v)
        vocab_size = model_vocab_size(cfg.model.base_dir)
        self.task = make_task(cfg.task)
        self.shared = SharedLabelModel(r, keys, v, worker_id, log, by_version=refits_by_version(cfg)
                                       ) if self.mode.needs_label_model else None
        # Only the verifiers the reward reads run, and every one on the monitored share of groups.
        self.reads = self.mode.reads(v.verifiers)
        self.scorer = scorer if scorer is not None else make_scorer(v, None if v.monitor_share else self.reads)
        self.posteriors_path = cfg.run_dir / POSTERIORS_DIR / f"{worker_id}.jsonl"
        newest = NewestVersion(r, keys)
        self.stage = Stage(r, keys, cfg, name="verifier", worker_id=worker_id, log=log, source="rollouts",
                           group=VERIFIERS_GROUP, decode=RolloutGroup.decode, sink="scored", sink_group=TRAINER_GROUP,
                           check=lambda g: check_rollout(g, vocab_size=vocab_size, newest=newest,
                                                         group_size=cfg.generator.group_size), prefetch=True)
        self.scored = 0

    def runs(self, g: RolloutGroup) -> tuple[str, ...] | None:
        """The verifiers to run on ``g``: those the reward reads, or every one (None) on a
        monitored group (``verifier.monitor_share``)."""
        v = self.cfg.verifier
        if len(self.reads) == len(v.verifiers) or monitored(g.group_id, v.monitor_share):
            return None
        return self.reads

    def step(self, batch: Batch) -> Output:
        """Votes → label model → rewards for every group of the batch."""
        v = self.cfg.verifier
        t0 = time.perf_counter()
        groups = batch.records
        before = {n: (st.completions, st.seconds) for n, st in self.scorer.stats.items()}
        votes, failed = score_batch(self.scorer, groups, self.log, self.runs)
        costs = {}
        for n, st in self.scorer.stats.items():
            costs[VERIFIER_COMPLETIONS + n] = st.completions - before[n][0]
            costs[VERIFIER_SECONDS + n] = st.seconds - before[n][1]
        truths = [self.task.correctness(g.reference, g.completions) for g in groups]
        models: list[LabelModel | None] = [None] * len(groups)
        if self.shared is not None:
            self.shared.add_votes(votes, truths, groups)
            models = (self.shared.models(groups, votes) if self.shared.by_version
                      else [self.shared.current()] * len(groups))
        lm_version = max((lm.version for lm in models if lm is not None), default=-1)
        written, rows = [], []
        for (e, g), vt, truth, lm in zip(batch.good, votes, truths, models):
            rewards = self.mode(votes=vt, names=v.verifiers, completions=g.completions, label_model=lm, truth=truth,
                                prompt=g.prompt, answer=self.task.answer, reference=g.reference,
                                env_rewards=g.env_rewards)
            rows.append(posterior_row(g, vt, truth, lm, v.verifiers))
            rec = ScoredGroup(rollout=g, verifier_names=tuple(v.verifiers), votes=vt.astype(np.float32),
                              rewards=rewards.astype(np.float32), truth=truth.astype(np.float32),
                              reward_mode=v.reward, labelmodel_version=-1 if lm is None else lm.version,
                              verifier_id=self.worker_id, scored_at=time.time())
            written.append((e, rec.encode()))
        self.scored += len(groups)
        seconds = time.perf_counter() - t0

        def after() -> None:
            append_posteriors(self.posteriors_path, rows)
            self.stage.heartbeat("scored", groups=self.scored,
                                 abstained={n: st.abstained for n, st in self.scorer.stats.items()})
            self.log.info("batch_scored", groups=len(groups), dead=len(batch.bad),
                          labelmodel_version=lm_version, seconds=round(seconds, 4))

        return Output(written=written, after=after,
                      counters={"groups_scored_total": len(groups), "verifier_errors_total": failed["error"],
                                "verifier_timeouts_total": failed["timeout"], "verify_seconds_total": seconds,
                                **costs})


def set_torch_threads(n: int) -> None:
    """torch's intra-op threads for the model-based verifier kinds: set now when torch is loaded,
    else through ``OMP_NUM_THREADS``, which torch reads when a kind first imports it."""
    os.environ["OMP_NUM_THREADS"] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)


def run_verifier(cfg: RunConfig, r, keys: Keys, worker_id: str, log, *, max_batches: int | None = None,
                 scorer: Scorer | None = None) -> int:
    """Score rollout groups until stopped (or ``max_batches`` non-empty reads); returns groups scored.

    ``scorer`` replaces the one ``verifier.verifiers`` names (benchmarks wrap it in a fake device).
    """
    set_torch_threads(cfg.verifier.threads)
    ver = VerifierStage(cfg, r, keys, worker_id, log, scorer=scorer)
    log.info("verifier_started", reward=cfg.verifier.reward, verifiers=cfg.verifier.verifiers, reads=ver.reads,
             monitor_share=cfg.verifier.monitor_share)
    ver.stage.run(ver.step, count=cfg.verifier.batch, idle=lambda: ver.stage.heartbeat("idle", groups=ver.scored),
                  max_batches=max_batches)
    log.info("verifier_stopped", groups=ver.scored)
    return ver.scored
