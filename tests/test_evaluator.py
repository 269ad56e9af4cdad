"""The eval worker beside training (``cluster.evaluators``, pipeline/consumers/evaluator.py):
it follows the published versions through the real weight transport, evaluates the first
and then every ``eval.every_versions``-th newest, and its figures are what ``pipeline eval``
computes on the same weights."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager

import numpy as np
import pytest
import redis
import torch
from builders import RecordingLog, make_scored
from harness import run_stages, spawn, tiny_config

from pipeline.config import ConfigError, load_config
from pipeline.consumers.evaluator import Evaluator, read_evals
from pipeline.keys import Keys
from pipeline.model.qwen import load_checkpoint, load_state_tensors
from pipeline.run.accounting import account
from pipeline.observe.evaluate import evaluate_model
from pipeline.run.plan import worker_table
from pipeline.weights import make_publisher

pytestmark = pytest.mark.one_server

EVAL = {"eval.max_prompts": 12, "eval.n": 4, "eval.ks": "1,2,4", "eval.every_versions": 3, "eval.nice": 0,
        "eval.sched_idle": False}


@contextmanager
def _evaluator(tmp_path, base_dir, url, run_id, **overrides):
    """(cfg, publisher, eval worker) of a run: a real shm publisher and an Evaluator on one server."""
    cfg, _ = tiny_config(tmp_path, base_dir, url, run_id, **{**EVAL, **overrides})
    r = redis.Redis.from_url(url)
    keys = Keys(cfg.run_id)
    pub = make_publisher("shm", r, keys.weights, ns=keys.ns)
    ev = Evaluator(cfg, r, keys, "eval-0", RecordingLog(levels=True))
    try:
        yield cfg, pub, ev
    finally:
        ev.close()
        pub.close()


def _noisy(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def test_it_evaluates_the_first_version_then_every_nth_newest_as_pipeline_eval_would(tmp_path, tiny_base_model,
                                                                                     redis_url):
    cfg, _ = tiny_config(tmp_path, tiny_base_model, redis_url, "evalw", **EVAL)
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cfg.run_id)
    base, _tok = load_checkpoint(tiny_base_model)
    pub = make_publisher("shm", r, keys.weights, ns=keys.ns)
    ev = Evaluator(cfg, r, keys, "eval-0", RecordingLog(levels=True))
    try:
        assert not ev.turn(), "nothing published yet"
        versions = {v: _noisy(base.state_dict(), v) for v in range(6)}
        pub.publish(0, versions[0])
        assert ev.turn() and ev.last == 0
        for v in (1, 2):
            pub.publish(v, versions[v])
            assert not ev.turn(), f"version {v} is fewer than every_versions past 0"
        pub.publish(3, versions[3])
        pub.publish(4, versions[4])
        assert ev.turn() and ev.last == 4, "the newest, once due; 3 is skipped"
        assert not ev.turn()
        rows = read_evals(cfg.run_dir)
        assert [x["version"] for x in rows] == [0, 4]
        assert all(torch.equal(ev.model.state_dict()[k], versions[4][k]) for k in versions[4])

        # The same figures pipeline eval's core computes on a model holding version 4.
        model, tokenizer = load_checkpoint(tiny_base_model)
        load_state_tensors(model, versions[4])
        model.eval()
        want = evaluate_model(cfg, model, tokenizer, tiny_base_model, n=4, ks=(1, 2, 4), max_prompts=12, seed=0)
        got = rows[-1]
        assert got["prompts"] == want["prompts"] == 12
        assert got["greedy_accuracy"] == want["greedy_accuracy"] and got["pass_at_k"] == want["pass_at_k"]
        assert got["mean_at_n"] == want["mean_at_n"] and list(got["pass_at_k"]) == ["1", "2", "4"]
        assert got["pass_at_k"]["1"] == pytest.approx(got["mean_at_n"])
        assert got["pass_at_k"]["1"] <= got["pass_at_k"]["2"] <= got["pass_at_k"]["4"]
        beat = json.loads(r.hget(keys.workers, "eval-0"))
        assert beat["stage"] == "evaluator" and beat["version"] == 4 and beat["evaluated"] == 2
    finally:
        ev.close()
        pub.close()


def test_with_adapter_payloads_it_evaluates_the_merged_policy(tmp_path, tiny_base_model, redis_url):
    from pipeline.engines.torch import TorchEngine

    lora = {"trainer.lora_rank": 4, "trainer.lora_alpha": 8, "trainer.lr": 1e-2, "trainer.warmup_steps": 0,
            "weights.payload": "adapter"}
    cfg, _ = tiny_config(tmp_path, tiny_base_model, redis_url, "evala", **EVAL, **lora)
    r = redis.Redis.from_url(redis_url)
    keys = Keys(cfg.run_id)
    engine = TorchEngine(cfg)
    rng = np.random.default_rng(0)
    engine.train_step([make_scored(prompt_id=f"p{i:08d}", rewards=rng.random(4).astype(np.float32))
                       for i in range(4)])
    pub = make_publisher("shm", r, keys.weights, ns=keys.ns)
    ev = Evaluator(cfg, r, keys, "eval-0", RecordingLog(levels=True))
    try:
        pub.publish(1, engine.adapter_tensors())
        assert ev.turn()
        full = engine.weights()
        assert all(torch.equal(ev.model.state_dict()[k], full[k]) for k in full)
    finally:
        ev.close()
        pub.close()


def test_each_eval_set_gets_its_row_per_version(tmp_path, tiny_base_model, redis_url):
    """``eval.sets``: another task's held-out split beside the run's own, each its own row,
    each what pipeline eval's core computes on that set."""
    base, tokenizer = load_checkpoint(tiny_base_model)
    with _evaluator(tmp_path, tiny_base_model, redis_url, "evals", **{"eval.sets": "digits=2"}) as (cfg, pub, ev):
        pub.publish(0, base.state_dict())
        assert ev.turn()
        rows = read_evals(cfg.run_dir)
        assert [(x["version"], x["set"]) for x in rows] == [(0, "heldout"), (0, "digits=2")]
        two = cfg.eval.task_sets(cfg.task)["digits=2"]
        assert two.digits == 2 and cfg.task.digits == 3
        base.eval()
        want = evaluate_model(cfg, base, tokenizer, tiny_base_model, n=4, ks=(1, 2, 4), max_prompts=12, seed=0,
                              task_cfg=two)
        assert rows[1]["greedy_accuracy"] == want["greedy_accuracy"] and rows[1]["pass_at_k"] == want["pass_at_k"]


def test_with_the_tensorboard_tracker_its_figures_are_scalars_at_their_version(tmp_path, tiny_base_model, redis_url):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    base, _tok = load_checkpoint(tiny_base_model)
    with _evaluator(tmp_path, tiny_base_model, redis_url, "evaltb", **{"tracking.backends": "tensorboard"}) \
            as (cfg, pub, ev):
        pub.publish(7, base.state_dict())
        assert ev.turn()
    row = read_evals(cfg.run_dir)[0]
    acc = EventAccumulator(str(cfg.run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    got = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert got[("evaluator/heldout/greedy_accuracy", 7)] == pytest.approx(row["greedy_accuracy"])
    assert got[("evaluator/heldout/pass@4", 7)] == pytest.approx(row["pass_at_k"]["4"])


def test_a_set_this_model_cannot_be_prompted_with_is_refused_naming_eval_sets(tmp_path, tiny_base_model, redis_url):
    data = tmp_path / "words.jsonl"
    data.write_text("".join(json.dumps({"problem": f"what is {w}?", "answer": "1"}) + "\n"
                            for w in ("one", "two", "three", "four")))
    cfg, _ = tiny_config(tmp_path, tiny_base_model, redis_url, "evalbad", **EVAL,
                         **{"eval.sets": f"kind=math;dataset={data};heldout_size=2"})
    with pytest.raises(ValueError, match=r"^eval\.sets: the held-out set 'kind=math;dataset="):
        Evaluator(cfg, redis.Redis.from_url(redis_url), Keys(cfg.run_id), "eval-0", RecordingLog(levels=True))
    # pipeline up says so before it starts anything.
    from pipeline.run.preflight import preflight

    with pytest.raises(ConfigError, match=r"eval\.sets: the held-out set 'kind=math;dataset="):
        preflight(cfg.replace("cluster.evaluators", 1))


@pytest.mark.parametrize("overrides, field", [
    ({"cluster.evaluators": "2"}, "cluster.evaluators"),
    ({"eval.ks": "1,9"}, "eval.ks"),
    ({"eval.ks": "2,2"}, "eval.ks"),
    ({"eval.every_versions": "0"}, "eval.every_versions"),
    ({"eval.nice": "20"}, "eval.nice"),
    ({"eval.temperature": "0"}, "eval.temperature"),
    ({"eval.sets": "nofield=1"}, "eval.sets"),
    ({"eval.sets": "digits=x"}, "eval.sets"),
    ({"eval.sets": "heldout_seed=7"}, "eval.sets"),
    ({"eval.sets": "heldout"}, "eval.sets"),
])
def test_bad_eval_settings_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match="^" + field.replace(".", r"\.") + ": "):
        load_config(None, overrides)


def test_pipeline_up_starts_one_when_asked():
    assert "eval-0" not in worker_table(load_config(None, {}))
    assert worker_table(load_config(None, {"cluster.evaluators": "1"}))["eval-0"] == ("evaluate", "eval-0")


@pytest.mark.slow
def test_beside_the_stages_as_processes_it_reports_versions_and_training_accounts(tmp_path, tiny_base_model,
                                                                                 redis_url):
    cfg, path = tiny_config(tmp_path, tiny_base_model, redis_url, "evalp",
                            **{"trainer.steps": 6, **EVAL, "eval.every_versions": 2})
    evaluator = spawn(path, "evaluate", "--worker-id", "eval-0")
    r = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 90  # started (torch imported, model loaded) before training begins
        while r.hget(Keys(cfg.run_id).workers, "eval-0") is None and evaluator.poll() is None:
            assert time.monotonic() < deadline, "the eval worker did not start"
            time.sleep(0.2)
        run_stages(cfg, path, redis_url)
        out, _ = evaluator.communicate(timeout=120)
    finally:
        evaluator.kill()
    assert evaluator.returncode == 0, out.decode()[-2000:]
    rows = read_evals(cfg.run_dir)
    versions = [x["version"] for x in rows]
    assert versions and versions == sorted(versions) and len(set(versions)) == len(versions)
    assert all(b - a >= 2 for a, b in zip(versions, versions[1:])) and versions[-1] <= 6
    assert all(0 <= x["greedy_accuracy"] <= 1 and x["prompts"] == 12 for x in rows)
    acc = account(r, Keys(cfg.run_id))
    assert acc["ok"] and acc["lost"] == 0 and acc["unexpected"] == 0
