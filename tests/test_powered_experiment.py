"""bench/powered_experiment.py's rule, statistics and report, on results written here (the
experiment itself takes tens of hours: `make powered-experiment`)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import powered_experiment as PX


def _task(completions: int, auc: float | None, best: str = "lm_judge:x@qa") -> dict:
    return {"completions": completions, "true_share": 0.07, "best_single": best,
            "methods": {"best single verifier": {"auc": auc}}}


def test_the_rule_reads_the_auc_only_on_a_full_record_and_keeps_the_benchs_order():
    panel = {"pilot": [{"key": k, "dataset": k, "params": {"n": i}} for i, k in enumerate("abcde")],
             "tasks": {"a": _task(2000, 0.93), "b": _task(1900, 0.70), "c": _task(2000, 0.90),
                       "d": _task(2048, 0.85, best="self_consistency:last_number"), "e": _task(2000, 0.60)}}
    chosen, rows = PX.tasks_by_rule(panel)
    assert [t["key"] for t in chosen] == ["c", "d"], "the first two with a full record and AUC <= 0.90, in order"
    assert chosen[1]["best_single"] == "self_consistency:last_number" and chosen[0]["params"] == {"n": 2}
    why = {r[0]: r[4] for r in rows}
    assert "1900 completions" in why["b"] and "> 0.9" in why["a"] and "(chosen)" not in why["e"]


def test_paired_differences_resample_problems_and_seeds():
    rng = np.random.default_rng(1)
    a = {s: (rng.random(500) < 0.6).astype(int).tolist() for s in range(3)}
    b = {s: (rng.random(500) < 0.4).astype(int).tolist() for s in range(3)}
    d = PX.paired(a, b, resamples=2000)
    assert d["seeds"] == 3
    assert d["mean"] == pytest.approx(np.mean([np.mean(a[s]) - np.mean(b[s]) for s in range(3)]), abs=1e-4)
    assert d["low"] < d["mean"] < d["high"] and d["low"] > 0.1, "a 20-point difference on 1500 pairs is clear"
    same = PX.paired(a, a, resamples=500)
    assert same["mean"] == same["low"] == same["high"] == 0.0


def test_the_gap_share_is_weavers_distance_over_the_single_to_truth_gap():
    n = 500
    truth = {0: [1] * 300 + [0] * 200}  # 0.6
    single = {0: [1] * 200 + [0] * 300}  # 0.4
    weaver = {0: [1] * 250 + [0] * 250}  # 0.5
    g = PX.gap_share(truth, single, weaver, resamples=500)
    assert g["share"] == pytest.approx(0.5)
    assert g["low"] <= 0.5 <= g["high"]
    assert PX.gap_share({0: [0] * n}, {0: [0] * n}, {0: [1] * n}, resamples=10)["share"] is None


def test_the_report_says_each_line_met_or_missed_with_its_interval(tmp_path):
    rng = np.random.default_rng(0)
    base = (rng.random(500) < 0.05).astype(int).tolist()

    def run(p: float, seed: int) -> dict:
        r = np.random.default_rng(seed)
        final = (r.random(500) < p).astype(int).tolist()
        return {"run": "runs/x", "wall_seconds": 3600.0, "evals": {"0": 0.05, "120": p}, "final_correct": final,
                "final": float(np.mean(final)), "accounting_ok": True, "lost": 0, "unexpected": 0, "duplicated": 0,
                "label_model": None, "train_reward_mean": 0.0 if p == 0.12 else p}

    arms = {"truth": 0.30, "single": 0.12, "weaver": 0.14, "weaver-128": 0.25}
    task = {"key": "gcd-x", "dataset": "gcd", "params": {}, "best_single": "lm_judge:g@qa", "base_correct": base,
            "runs": {arm: {str(s): run(p, 10 * s + i) for s in range(3)} for i, (arm, p) in enumerate(arms.items())}}
    task["statistics"] = PX.task_statistics(task)
    lines = {x["line"]: x for x in task["statistics"]["lines"]}
    assert lines["truth gains >= 10 points, interval excluding 0"]["met"]
    assert not lines["weaver closes >= 50% of the single -> truth gap"]["met"], "0.14 of a 0.12 -> 0.30 gap"
    assert lines["weaver-128 closes >= 50% of the single -> truth gap"]["met"]
    assert lines["weaver gain >= single gain - 2 points"]["met"]
    result = {"command": "python bench/powered_experiment.py", "finished": None, "steps": 120, "heldout": 500,
              "seeds": [0, 1, 2], "rule": [["gcd-x", 2000, "`lm_judge:g@qa`", 0.88, "best single AUC 0.88 <= 0.9 (chosen)"]],
              "tasks": {"gcd-x": task,  # the second task not reached yet (the runs go seed-major)
                        "lcm-y": {"key": "lcm-y", "dataset": "lcm", "params": {}, "best_single": "lm_judge:s@qa",
                                  "runs": {}}}}
    PX.report(result, tmp_path, "powered")
    md = (tmp_path / "powered.md").read_text()
    assert "## lcm-y\n\nNot started" in md
    assert "| weaver closes >= 50% of the single -> truth gap | **missed** |" in md
    assert "| truth | 3 |" in md and "balanced" in md
    single_row = next(x for x in md.splitlines() if x.startswith("| single | 3 |"))
    assert "| 0.000 |" in single_row, "the single arm's training reward is shown beside its gain"
    assert "The single arm's reward was 0 at every step of its 3 runs: no group carried a signal" in md
    assert "The truth arm's reward was 0" not in md
    assert PX.train_reward_mean({"steps": [{"reward_mean": 0.0}, {"reward_mean": 0.5}, {"kind": "step"}]}) == 0.25
    assert PX.train_reward_mean({"steps": []}) is None
    assert json.loads((tmp_path / "powered.json").read_text())["tasks"]["gcd-x"]["statistics"]["arms"]["truth"]["seeds"] == 3
    assert (tmp_path / "powered.png").stat().st_size > 1000


def test_a_task_config_holds_the_task_the_panel_and_the_plans_budget(tmp_path):
    from pipeline.config import load_config

    task = {"key": "basic_arithmetic-x", "dataset": "basic_arithmetic",
            "params": {"min_terms": 2, "max_terms": 2, "operators": ["+", "-"]}}
    path = PX.task_config(task, tmp_path / "t.toml", heldout=500, panel=["self_consistency:last_number",
                                                                         "answer_only:last_number"])
    cfg = load_config(path)
    assert cfg.task.datasets == ["basic_arithmetic"] or list(cfg.task.datasets) == ["basic_arithmetic"]
    assert json.loads(cfg.task.dataset_params) == {"basic_arithmetic": task["params"]}
    assert cfg.task.heldout_size == 500 and cfg.trainer.steps == PX.STEPS and cfg.trainer.eval_every == PX.EVAL_EVERY
    assert list(cfg.verifier.verifiers) == ["self_consistency:last_number", "answer_only:last_number"]


def test_an_interrupted_run_of_the_same_arm_and_settings_is_the_one_continued(tmp_path):
    from pipeline_runs import unfinished_run

    from pipeline.config import load_config
    from pipeline.config_toml import to_toml

    over = {"trainer.seed": 1, "trainer.steps": 120, "verifier.reward": "ground_truth"}

    def run(name: str, summary: dict | None, **changes) -> None:
        d = tmp_path / name
        d.mkdir()
        cfg = load_config(None, {"run_id": name, **{k: str(v) for k, v in {**over, **changes}.items()}})
        (d / "config.toml").write_text(to_toml(cfg))
        (d / "metrics.jsonl").write_text('{"kind": "eval", "version": 0}\n')
        if summary is not None:
            (d / "summary.json").write_text(json.dumps(summary))

    label = "pw-task-truth-s1"
    assert unfinished_run(label, over, runs_dir=tmp_path) is None
    run(f"{label}-1205-100000", {"status": "finished"})
    run(f"{label}-1205-110000", {"status": "timed out: ..."})  # ended by its own settings: not continued
    run(f"{label}-1205-120000", None, **{"trainer.steps": 60})  # another plan's run
    run(f"{label}0-1205-130000", None)  # another label (seed 10)
    assert unfinished_run(label, over, runs_dir=tmp_path) is None
    run(f"{label}-1205-090000", None)  # killed with its driver: no summary
    run(f"{label}-1205-095000", {"status": "interrupted"})
    assert unfinished_run(label, over, runs_dir=tmp_path).name == f"{label}-1205-095000", "the newest"
    run(f"{label}-1205-099000", None)
    (tmp_path / f"{label}-1205-099000" / "metrics.jsonl").unlink()  # stopped before its trainer wrote anything
    assert unfinished_run(label, over, runs_dir=tmp_path).name == f"{label}-1205-095000"


def test_every_arm_names_its_reward_and_label_model_and_the_config_accepts_it():
    # The label-free arm names the label model the plan fixed (the default when the first arm
    # ran), so a later change of the pipeline's default cannot reach the runs still to come.
    from pipeline.config import load_config

    for arm in PX.ARMS:
        over = PX.arm_overrides(arm, "lm_judge:x@qa")
        cfg = load_config(None, {k: str(v) for k, v in over.items()})
        assert cfg.verifier.reward == over["verifier.reward"]
        if arm.startswith("weaver"):
            assert "verifier.label_model" in over and cfg.verifier.monitor_share == 1.0
    assert PX.arm_overrides("weaver", "x")["verifier.label_model"] == "weaver"
    assert PX.arm_overrides("weaver-128", "x")["verifier.labels"] == PX.LABELS


def test_a_fresh_run_is_expected_to_take_what_its_arm_took_on_its_task_else_the_longest_run(tmp_path):
    # --hours skips a run that cannot finish in the time left (a run cut short is lost where the run
    # directory does not outlive the session) and goes on to a later one that may fit.
    from pipeline_runs import DeadlineReached, NotStarted, run_up

    assert PX.expected_seconds({}, "a", "truth") is None
    result = {"tasks": {"a": {"runs": {"truth": {"0": {"wall_seconds": 5300.0}, "1": {"wall_seconds": 5000.0}},
                                       "single": {"0": {"wall_seconds": 2600.0}}}},
                        "b": {"runs": {"truth": {"0": {"wall_seconds": 5600.0}}}}}}
    assert PX.expected_seconds(result, "a", "truth") == 5000.0
    assert PX.expected_seconds(result, "a", "single") == 2600.0
    # The single arm took 43 min on a where its judge passed nothing; on b it may train: the longest.
    assert PX.expected_seconds(result, "b", "single") == 5600.0
    assert PX.expected_seconds(result, "a", "weaver") == 5600.0  # no weaver run yet: at least the longest
    with pytest.raises(NotStarted, match="not started: 60 min left"):
        run_up("x", {}, runs_dir=tmp_path, deadline=time.time() + 3600, needs_s=5600.0)
    assert not any(tmp_path.iterdir())
    # Past the deadline nothing starts, short or long: the driver stops instead of trying the next run.
    with pytest.raises(DeadlineReached, match="before this run started") as past:
        run_up("x", {}, runs_dir=tmp_path, deadline=time.time() - 1, needs_s=60.0)
    assert not isinstance(past.value, NotStarted)
