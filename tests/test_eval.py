"""``pipeline eval``: the pass@k estimator, checkpoint evaluation against the trainer's own
held-out evaluation, and the command end to end."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import load_config
from pipeline.config_toml import documented_toml
from pipeline.observe.evaluate import (check_settings, checkpoint_kind, evaluate, limit_items, parse_ks, pass_at_k,
                                   run_of)
from pipeline.tasks.base import Item

pytestmark = pytest.mark.one_server

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the estimator


def test_pass_at_k_is_the_fraction_of_k_subsets_holding_a_right_sample():
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                exact = Fraction(sum(any(s) for s in subsets), len(subsets))
                assert math.isclose(pass_at_k(n, c, k), float(exact), rel_tol=1e-12, abs_tol=1e-15), (n, c, k)


def test_pass_at_k_edge_cases():
    for n in (1, 5, 16, 200):
        for k in (1, n // 2 or 1, n):
            assert pass_at_k(n, 0, k) == 0.0
            assert pass_at_k(n, n, k) == 1.0
        for c in range(1, n + 1):
            assert pass_at_k(n, c, n) == 1.0  # all n samples drawn: right once any is
        for c in range(n + 1):
            assert math.isclose(pass_at_k(n, c, 1), c / n)  # pass@1 is the sample accuracy
    assert pass_at_k(10, 7, 4) == 1.0  # fewer wrong samples (3) than k: every subset has a right one
    for bad in ((4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_the_estimator_is_unbiased_for_the_pass_at_k_of_fresh_draws():
    n, p = 10, 0.3
    pmf = [math.comb(n, c) * p**c * (1 - p) ** (n - c) for c in range(n + 1)]
    rng = np.random.default_rng(0)
    trials = 20_000
    counts = rng.binomial(n, p, size=trials)
    for k in (1, 2, 4, 8):
        truth = 1 - (1 - p) ** k
        # Exactly, over the binomial distribution of c ...
        assert math.isclose(sum(w * pass_at_k(n, c, k) for c, w in enumerate(pmf)), truth, rel_tol=1e-9)
        # ... and over random draws: the estimator's mean vs the empirical pass@k of k fresh samples.
        estimate = float(np.mean([pass_at_k(n, int(c), k) for c in counts]))
        empirical = float(np.mean((rng.random((trials, k)) < p).any(axis=1)))
        assert abs(estimate - truth) < 0.01 and abs(empirical - truth) < 0.015 and abs(estimate - empirical) < 0.02
        if k >= 4:  # the plug-in 1 - (1 - c/n)^k is biased, by more than these tolerances
            plug_in = float(np.mean([1 - (1 - c / n) ** k for c in counts]))
            assert truth - plug_in > 0.03


# ----------------------------------------------------------------------------- settings


def test_settings_are_checked_naming_the_flag():
    assert parse_ks("8, 1,4") == (8, 1, 4)
    assert check_settings(n=8, ks=(8, 1, 4, 4), temperature=1.0) == (1, 4, 8)
    for text in ("", "a", "1,,x"):
        with pytest.raises(ValueError, match="--k"):
            parse_ks(text)
    for ks in ((0,), (1, 5), (-1,)):
        with pytest.raises(ValueError, match="--k"):
            check_settings(n=4, ks=ks, temperature=1.0)
    with pytest.raises(ValueError, match="--n"):
        check_settings(n=0, ks=(1,), temperature=1.0)
    for t in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="--temperature"):
            check_settings(n=4, ks=(1,), temperature=t)
    with pytest.raises(ValueError, match="--max-prompts"):
        check_settings(n=4, ks=(1,), temperature=1.0, max_prompts=-1)
    with pytest.raises(ValueError, match="--batch-size"):
        check_settings(n=4, ks=(1,), temperature=1.0, batch_size=0)


def test_checkpoint_kinds(tmp_path, tiny_base_model):
    assert checkpoint_kind(tiny_base_model) == "hf"
    with pytest.raises(ValueError, match="--checkpoint: .* is not a directory"):
        checkpoint_kind(tmp_path / "missing")
    (tmp_path / "run" / "checkpoints" / "final").mkdir(parents=True)
    with pytest.raises(ValueError, match="is a run directory; its trained policy is .*checkpoints/final"):
        checkpoint_kind(tmp_path / "run")
    with pytest.raises(ValueError, match="--checkpoint: .* holds no checkpoint"):
        checkpoint_kind(tmp_path / "run" / "checkpoints" / "final")


def test_a_prompt_cap_keeps_every_source_and_the_order():
    items = [Item(f"a{i}", "") for i in range(3)]
    assert limit_items(items, 2) == items[:2] and limit_items(items, 0) == items and limit_items(items, 9) == items
    mixed = [Item(f"{s}{i}", "", source=s) for s in "xyz" for i in range(4)]
    kept = limit_items(mixed, 5)
    assert [i.prompt for i in kept] == ["x0", "x1", "y0", "y1", "z0"]


# ----------------------------------------------------------------------------- evaluation


def _trainer_heldout_evaluation(cfg, redis_client, tmp_path) -> tuple[float, list[str]]:
    """The trainer's own held-out evaluation of ``model.base_dir``: ``Trainer.evaluate``'s
    accuracy, and the greedy completions it judges (``engine.greedy`` of its held-out prompts)."""
    from pipeline.consumers.trainer import Trainer
    from pipeline.keys import Keys
    from pipeline.observe.logs import setup_logging

    log = setup_logging(tmp_path / "logs", stage="trainer", worker="trainer")
    trainer = Trainer(cfg, redis_client, Keys.of(cfg.run_id, cfg.redis), log, run_dir=None)
    try:
        answers = trainer.engine.greedy(trainer.heldout_ids, max_new_tokens=trainer.task.eval_max_new_tokens)
        return trainer.evaluate(), answers
    finally:
        trainer.close()  # the publisher's transport resources (its shm directory, its announcer)


@pytest.mark.parametrize("which", ["tiny", "shipped"])
def test_evaluate_gives_the_trainers_heldout_accuracy_and_consistent_pass_at_k(which, tiny_base_model, redis_client,
                                                                               tmp_path):
    from pipeline.model.pretrain import SHIPPED

    # The tiny fixture answers nothing right yet; the shipped base (42% held out) makes the
    # comparison of verdicts a real one.
    ckpt = tiny_base_model if which == "tiny" else SHIPPED
    cfg = load_config(overrides={"model.base_dir": str(ckpt), "task.heldout_size": "64",
                                 "run_id": f"evaltest-{os.getpid()}"})
    trainer_acc, trainer_answers = _trainer_heldout_evaluation(cfg, redis_client, tmp_path)
    if which == "shipped":
        assert 0.2 < trainer_acc < 0.8
    seen: list[tuple[str, int, int]] = []
    out = evaluate(cfg, ckpt, n=8, ks=(1, 2, 4, 8), temperature=1.0, seed=3, batch_size=16,
                   progress=lambda *a: seen.append(a))
    assert out["prompts"] == out["heldout_total"] == 64
    greedy = out["per_prompt"]["greedy_correct"]
    assert out["per_prompt"]["greedy_completions"] == trainer_answers
    assert sum(greedy) == round(trainer_acc * 64) and math.isclose(out["greedy_accuracy"], trainer_acc, abs_tol=1e-6)
    counts = out["per_prompt"]["correct_samples"]
    assert len(counts) == 64 and all(0 <= c <= 8 for c in counts)
    assert math.isclose(out["mean_at_n"], sum(counts) / (64 * 8))
    assert math.isclose(out["pass_at_k"]["1"], out["mean_at_n"], abs_tol=1e-12)
    curve = [out["pass_at_k"][str(k)] for k in (1, 2, 4, 8)]
    assert curve == sorted(curve) and 0.0 <= curve[0] and curve[-1] <= 1.0
    assert math.isclose(out["pass_at_k"]["8"], sum(c > 0 for c in counts) / 64)
    assert ("sampled", 64, 64) in seen and ("greedy", 64, 64) in seen
    assert [d for p, d, _ in seen if p == "sampled"] == [0, 16, 32, 48, 64]
    # The same seed and batch size give the same figures; a cap takes the first prompts.
    again = evaluate(cfg, ckpt, n=8, ks=(1, 2, 4, 8), temperature=1.0, seed=3, batch_size=16,
                     max_prompts=16)
    assert again["prompts"] == 16 and again["per_prompt"]["greedy_correct"] == greedy[:16]
    assert again["per_prompt"]["correct_samples"] == counts[:16]


def test_a_trainer_checkpoint_evaluates_like_its_hf_export(tiny_base_model, tmp_path):
    import torch
    from safetensors.torch import save_file

    from pipeline.model.qwen import load_checkpoint, save_checkpoint

    model, tok = load_checkpoint(tiny_base_model)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    step = tmp_path / "checkpoints" / "step-000001"
    step.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(step / "model.safetensors"))
    (step / "state.json").write_text("{}")
    save_checkpoint(model, tok, tmp_path / "checkpoints" / "final")
    cfg = load_config(overrides={"model.base_dir": str(tiny_base_model), "task.heldout_size": "32"})
    kw = dict(n=2, ks=(1, 2), temperature=1.0, seed=0)
    a, b = evaluate(cfg, step, **kw), evaluate(cfg, tmp_path / "checkpoints" / "final", **kw)
    base = evaluate(cfg, tiny_base_model, **kw)
    assert checkpoint_kind(step) == "trainer"
    assert a["per_prompt"] == b["per_prompt"]
    assert a["per_prompt"]["greedy_completions"] != base["per_prompt"]["greedy_completions"]


# ----------------------------------------------------------------------------- the command


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "eval", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_command_writes_the_figures_the_command_and_a_log_line(tiny_base_model, tmp_path):
    import shutil

    cfg = load_config(overrides={"model.base_dir": str(tiny_base_model)})
    run = tmp_path / "runs" / "r1"
    shutil.copytree(tiny_base_model, run / "checkpoints" / "final")
    (run / "config.toml").write_text(documented_toml(cfg))
    ckpt = run / "checkpoints" / "final"
    assert run_of(ckpt) == run.resolve()
    out = tmp_path / "f.json"
    p = _cli("--checkpoint", str(ckpt), "--n", "4", "--k", "1,4", "--task.heldout_size", "16", "--out", str(out),
             "--model.base_dir", str(tiny_base_model), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    assert result["prompts"] == 16 and result["n"] == 4 and set(result["pass_at_k"]) == {"1", "4"}
    assert result["pass_at_k"]["1"] <= result["pass_at_k"]["4"]
    assert math.isclose(result["pass_at_k"]["1"], result["mean_at_n"], abs_tol=1e-12)
    assert 0.0 <= result["greedy_accuracy"] <= 1.0 and len(result["per_prompt"]["correct_samples"]) == 16
    assert "--k 1,4" in result["command"] and result["command"].startswith("pipeline eval --checkpoint")
    assert result["task_config"]["heldout_size"] == 16
    stdout = json.loads(p.stdout)
    assert stdout["pass_at_k"] == result["pass_at_k"] and "per_prompt" not in stdout
    assert "eval sampled: 16/16 prompts" in p.stderr and "pass@4" in p.stderr
    # Another task config than the run's: said, not refused.
    assert "task.heldout_size" in p.stderr and "--config" in p.stderr
    line = json.loads((run / "logs" / "eval.jsonl").read_text().splitlines()[-1])
    assert line["event"] == "checkpoint_evaluated" and line["stage"] == "eval"
    assert line["pass_at_k"] == result["pass_at_k"] and line["greedy_accuracy"] == result["greedy_accuracy"]


def test_a_bad_k_fails_before_any_model_loads(tmp_path, tiny_base_model):
    # The checkpoint does not exist: an error naming --k proves --k was checked first.
    for args in (["--n", "4", "--k", "1,5"], ["--k", "0"], ["--k", "one"]):
        p = _cli("--checkpoint", str(tmp_path / "missing"), *args, cwd=tmp_path)
        assert p.returncode == 2, p.stderr
        assert "config error: --k:" in p.stderr and "--checkpoint" not in p.stderr, p.stderr
        assert p.stdout == ""
    p = _cli("--checkpoint", str(tmp_path / "missing"), "--n", "4", "--k", "1,4", cwd=tmp_path)
    assert p.returncode == 2 and "--checkpoint:" in p.stderr and "is not a directory" in p.stderr
