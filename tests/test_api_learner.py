"""The Python API's Learner runs the trainer stage's own step and commit: the same scenarios
driven through the stage (``Trainer.run``, the loop ``pipeline train`` runs) and through the API
(``Queue.get`` → ``Learner.step`` → ``Learner.commit``) leave the same ledger, training log,
counters, acks and checkpoint, and either's checkpoint resumes the other."""

from __future__ import annotations

import json

import numpy as np
import pytest
from builders import make_scored

import pipeline.consumers.trainer as trainer_mod
from pipeline import api
from pipeline.bus.stats import read_stats
from pipeline.bus.streams import Entry, unacked_all
from pipeline.consumers.trainer import Outcome, Trainer
from pipeline.keys import TRAINER_GROUP
from pipeline.common import checkpoint
from pipeline.run.accounting import trainlog_counts

PATHS = ["stage", "api"]


def _overrides(tmp_path, base, redis_url, run_id: str, **extra) -> dict:
    return {"run_id": run_id, "runs_dir": str(tmp_path / "runs"), "redis.url": redis_url,
            "model.base_dir": str(base), "task.heldout_size": 4, "generator.group_size": 4,
            "trainer.groups_per_step": 2, "trainer.max_staleness": 0, "trainer.steps": 2,
            "trainer.checkpoint_every": 2, "trainer.eval_every": 100, **extra}


def _put(run, groups) -> None:
    assert run.queue("scored").put(groups) == len(groups)


def _learn(run, path: str, steps: int = 2) -> None:
    """``steps`` steps of two groups, then the commit: by the trainer stage's loop, or by the API."""
    if path == "stage":
        trainer = Trainer(run.cfg, run.r, run.keys, run.logger("trainer", "trainer"), run_dir=run.cfg.run_dir)
        try:
            assert trainer.run()["version"] == steps
        finally:
            trainer.close()
        return
    learner, scored = run.learner(), run.queue("scored")
    for _ in range(steps):
        got: list = []
        while len(got) < 2:
            got += scored.get(2 - len(got), consumer="trainer", block_ms=50)
        learner.step(got)
    assert learner.commit() is not None


@pytest.mark.parametrize("path", PATHS)
def test_a_stale_group_is_refused_and_the_commit_is_the_stages(path, tmp_path, tiny_base_model, redis_url,
                                                               redis_client):
    with api.Run(overrides=_overrides(tmp_path, tiny_base_model, redis_url, f"learn-{path}"),
                 build_base_model=False) as run:
        # Step 1 (version 0 → 1): a group with signal and one without. Step 2 (1 → 2), η = 0: a
        # group of version 0 is stale, one of version 1 trains.
        _put(run, [make_scored(prompt_id="p00000000"), make_scored(prompt_id="p00000001", rewards=[1, 1, 1, 1]),
                   make_scored(prompt_id="p00000002"), make_scored(prompt_id="p00000003", version=1)])
        _learn(run, path)
        keys = run.keys
        ledger = {k.decode(): v.decode() for k, v in redis_client.hgetall(keys.shard(0).ledger).items()}
        assert ledger == {"p00000000": "trained:1", "p00000001": "nosignal:1", "p00000002": "stale:2",
                          "p00000003": "trained:2"}
        assert trainlog_counts(redis_client, keys) == {pid: 1 for pid in ledger}
        stats = read_stats(redis_client, keys)
        assert stats.get("groups_trained_total") == 2 and stats.get("dropped_stale_total") == 1
        assert unacked_all(redis_client, keys.stream_keys("scored"), TRAINER_GROUP) == 0
        assert int(redis_client.hget(keys.trainer, "committed_version")) == 2
        # The first batch's hidden accuracy, written before its update (the driver's check of a
        # base that answers nothing right reads it): p00000000's and p00000001's truths.
        first = np.concatenate([make_scored(prompt_id="p00000000").truth, np.ones(4)])
        assert float(redis_client.hget(keys.trainer, "first_batch_accuracy")) == pytest.approx(first.mean())
        rows = [json.loads(x) for x in (run.cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in rows if m["kind"] == "step"]
        assert [(m["version"], m["groups_trained"], m["groups_nosignal"], m["groups_stale"]) for m in steps] == \
            [(1, 1, 1, 0), (2, 1, 0, 1)]
        ckpt = checkpoint.latest(run.cfg.run_dir / "checkpoints")
        assert ckpt is not None and checkpoint.load(ckpt).version == 2
        # Either's checkpoint resumes both: the trainer stage, and a Learner.
        again = Trainer(run.cfg, run.r, keys, run.logger("trainer", "trainer"), run_dir=run.cfg.run_dir)
        try:
            assert again.resume() == ckpt and again.version == 2
        finally:
            again.close()
        learner = run.learner()
        assert learner.resume() == ckpt and learner.version == 2
        assert trainlog_counts(redis_client, keys) == {pid: 1 for pid in ledger}  # resuming re-applied nothing


@pytest.mark.parametrize("path", PATHS)
def test_a_step_that_trains_nothing_does_not_age_the_groups_and_a_resume_keeps_it(path, tmp_path, tiny_base_model,
                                                                                   redis_url, redis_client):
    """Staleness counts updates: a version whose step trained nothing has its parent's weights, so
    a group from before it is no further behind (a trainer that drops a stale batch would
    otherwise age every group in flight, and drop the next batch too)."""
    with api.Run(overrides=_overrides(tmp_path, tiny_base_model, redis_url, f"idle-{path}", **{"trainer.steps": 3,
                                                                                               "trainer.checkpoint_every": 3}),
                 build_base_model=False) as run:
        # Step 1 (0 → 1): no group has signal, no update: version 1 is idle. Step 2 (1 → 2), η = 0:
        # a group of version 0 is 0 updates behind and trains. Step 3 (2 → 3): a group of version 1
        # is 1 update behind (step 2's) and is stale; one of version 2 trains.
        _put(run, [make_scored(prompt_id="p00000000", rewards=[1, 1, 1, 1]),
                   make_scored(prompt_id="p00000001", rewards=[0, 0, 0, 0]),
                   make_scored(prompt_id="p00000002"), make_scored(prompt_id="p00000003", rewards=[1, 1, 1, 1]),
                   make_scored(prompt_id="p00000004", version=1), make_scored(prompt_id="p00000005", version=2)])
        _learn(run, path, steps=3)
        ledger = {k.decode(): v.decode() for k, v in redis_client.hgetall(run.keys.shard(0).ledger).items()}
        assert ledger == {"p00000000": "nosignal:1", "p00000001": "nosignal:1", "p00000002": "trained:2",
                          "p00000003": "nosignal:2", "p00000004": "stale:3", "p00000005": "trained:3"}
        ckpt = checkpoint.latest(run.cfg.run_dir / "checkpoints")
        assert checkpoint.load(ckpt).idle_versions == [1]
        again = Trainer(run.cfg, run.r, run.keys, run.logger("trainer", "trainer"), run_dir=run.cfg.run_dir)
        try:
            assert again.resume() == ckpt and again.idle_versions == {1}
            # The resumed trainer sorts as the first did: at version 3, a group of version 0 is 2 updates behind.
            old = make_scored(prompt_id="p00000009", version=0)
            assert again.sort([(None, old)]).kinds == [Outcome.STALE]
            assert trainer_mod.staleness(0, version=3, idle={1}) == 2
        finally:
            again.close()


@pytest.mark.parametrize("path", ["stage", "api-step", "api-batch"])
def test_the_staleness_invariant_is_checked_by_every_path(path, tmp_path, tiny_base_model, redis_url,
                                                          monkeypatch):
    """A classification that let a stale group through to training is caught by the check both share."""
    with api.Run(overrides=_overrides(tmp_path, tiny_base_model, redis_url, "invariant"),
                 build_base_model=False) as run:
        learner = run.learner()
        learner.trainer.version = 3  # the groups below, of version 0, are stale at η = 0
        monkeypatch.setattr(trainer_mod, "classify", lambda batch, **kw: [Outcome.TRAINED] * len(batch))
        pairs = [(Entry(id=f"1-{i}".encode(), payload=None), make_scored(prompt_id=f"p{i:08d}")) for i in range(2)]
        step = {"stage": lambda: learner.trainer.step(pairs, wait_s=0.0), "api-step": lambda: learner.step(pairs),
                "api-batch": lambda: learner.batch(pairs)}[path]
        with pytest.raises(RuntimeError, match="staleness invariant violated"):
            step()
        assert learner.version == 3 and not learner.trainer.uncommitted


def test_a_step_written_by_hand_is_committed_as_the_stages(tmp_path, tiny_base_model, redis_url, redis_client):
    """``Learner.batch`` → ``update`` ends as the stage's step does: the step kept for the commit,
    its entries acked by it, the schedule stepped only after an optimizer update."""
    with api.Run(overrides=_overrides(tmp_path, tiny_base_model, redis_url, "by-hand"),
                 build_base_model=False) as run:
        _put(run, [make_scored(prompt_id="p00000000"), make_scored(prompt_id="p00000001")])
        learner, scored = run.learner(), run.queue("scored")
        got: list = []
        while len(got) < 2:
            got += scored.get(2 - len(got), consumer="trainer", block_ms=50)
        batch = learner.batch(got)
        assert batch.size == 8 and [e for e, _ in got] == list(batch.entries)
        logp = learner.logprobs(batch)
        loss = -(logp * batch.mask).sum() / batch.mask.sum()
        row = learner.update(batch, loss, {"by_hand": 1.0})
        assert row["version"] == 1 and row["groups_trained"] == 2 and row["by_hand"] == 1.0
        assert learner.engine.sched.last_epoch == 1
        assert unacked_all(redis_client, run.keys.stream_keys("scored"), TRAINER_GROUP) == 2  # until the commit
        learner.commit()
        assert unacked_all(redis_client, run.keys.stream_keys("scored"), TRAINER_GROUP) == 0
        assert redis_client.hlen(run.keys.shard(0).ledger) == 2
        empty = learner.update(learner.batch([make_scored(prompt_id="p00000009", version=1, rewards=[1, 1, 1, 1])]))
        assert empty["groups_nosignal"] == 1 and learner.engine.sched.last_epoch == 1  # no update, no lr step
