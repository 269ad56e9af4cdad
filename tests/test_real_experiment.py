"""bench/real_experiment.py's measures and report, on results written here (the runs themselves
take an hour each: `make real-experiment`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import real_experiment as RX


def test_auc_counts_ties_half_and_leaves_abstentions_out():
    assert RX.auc(np.array([0.9, 0.8, 0.1, np.nan]), np.array([1, 1, 0, 1])) == 1.0
    assert RX.auc(np.array([0.5, 0.5]), np.array([1, 0])) == 0.5
    assert RX.auc(np.array([0.2, 0.9, np.nan]), np.array([1, 0, 0])) == 0.0
    assert RX.auc(np.array([0.2, 0.3]), np.array([1, 1])) is None


def test_the_gap_closed_is_weavers_share_of_the_single_to_truth_distance():
    assert RX.gap_closed(0.5, 0.6, 0.7) == pytest.approx(0.5)
    assert RX.gap_closed(0.5, 0.45, 0.7) == pytest.approx(-0.25)
    assert RX.gap_closed(0.7, 0.8, 0.7) is None, "no gap to close when the single judge matches the truth"


def _run(final, last, base=0.38):
    return {"run": "runs/x", "base": base, "final": final, "last": last, "evals": {"0": base, "30": last},
            "wall_seconds": 1200.0, "accounting_ok": True, "lost": 0, "unexpected": 0, "fitted": None}


def test_the_report_gives_medians_ranges_and_the_share_closed_per_seed(tmp_path):
    result = {"command": "python bench/real_experiment.py", "finished": "now", "probe": None, "heldout_size": 100,
              "runs": {"ground_truth": {"0": _run(0.60, 0.62), "1": _run(0.56, 0.58)},
                       "single": {"0": _run(0.50, 0.50), "1": _run(0.48, 0.49)},
                       "weaver": {"0": _run(0.55, 0.57), "1": _run(0.54, 0.50)}}}
    RX.report(result, tmp_path)
    md = (tmp_path / "real.md").read_text()
    assert "| ground_truth | 2 | 0.380 | 0.580 (0.560 – 0.600) | +20.0 (+18.0 – +22.0) |" in md
    # medians: truth 0.58, single 0.49, weaver 0.545 -> (0.545 - 0.49) / (0.58 - 0.49) = 61%
    assert "Weaver closes **61%** of it" in md and "seed 0: 50%; seed 1: 75%" in md
    assert json.loads((tmp_path / "real.json").read_text())["runs"]["weaver"]["1"]["final"] == 0.54
    assert (tmp_path / "real.png").stat().st_size > 1000


def test_a_post_hoc_variant_is_reported_apart_from_the_arms(tmp_path):
    result = {"command": "python bench/real_experiment.py", "finished": "now", "probe": None, "heldout_size": 100,
              "runs": {"ground_truth": {"0": _run(0.60, 0.62)}, "single": {"0": _run(0.50, 0.50)},
                       "weaver": {"0": _run(0.55, 0.57)}},
              "variants": {"weaver-no-sound": {"label": "weaver-no-sound", "why": "Because.",
                                               "overrides": {"verifier.sound_checks": "false"},
                                               "runs": {"0": _run(0.58, 0.59)}}}}
    RX.report(result, tmp_path)
    md = (tmp_path / "real.md").read_text()
    assert "| weaver-no-sound (post hoc) | 1 | 0.380 | 0.580 (0.580 – 0.580) | +20.0 (+20.0 – +20.0) |" in md
    assert "`weaver-no-sound` is not one of the three arms: the weaver reward with `verifier.sound_checks = false`" in md
    assert "Weaver closes **50%** of it" in md, "the gap is the three arms' alone"


def test_the_offline_refit_tells_an_estimated_pi_from_a_known_one(tmp_path):
    """A weaver run's votes where three judges err together: held at the known share, the refit
    rewards wrong answers far less than the label-free estimate does, and the report shows both."""
    from pipeline.config import load_config
    from pipeline.config_toml import to_toml

    run = tmp_path / "runs" / "real-weaver-s0"
    (run / "posteriors").mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(load_config(overrides={"verifier.reward": "weaver"})))
    rng = np.random.default_rng(5)
    names = ["j0", "j1", "j2", "c0", "c1"]
    with open(run / "posteriors" / "ver-0.jsonl", "w") as f:
        for g in range(500):
            y = (rng.random(8) < 0.2).astype(int)
            looks_right = np.where(y == 1, 1.0, (rng.random(8) < 0.4).astype(float))
            judges = [1 / (1 + np.exp(-(3 * looks_right - 1.5 + rng.normal(0, 0.8, 8)))) for _ in range(3)]
            checks = [np.where(y == 1, rng.random(8) < 0.8, rng.random(8) < 0.3).astype(float) for _ in range(2)]
            votes = np.column_stack(judges + checks)
            f.write(json.dumps({"names": names, "votes": votes.round(4).tolist(), "truth": y.tolist()}) + "\n")
    d = RX.pi_diagnosis(run, 0.2)
    assert list(d["fits"])[:2] == ["estimated without labels, alternate", "estimated without labels, levels"]
    alternate, levels, known, oracle = d["fits"].values()
    assert d["completions"] == 4000 and abs(d["true_share"] - 0.2) < 0.03
    assert known["pi"] == 0.2 and abs(oracle["pi"] - d["true_share"]) < 1e-3
    for est in (alternate, levels):  # judges fooled together mislead both label-free estimates here
        assert est["pi"] > 0.3 and known["reward_wrong"] < 0.2 < est["reward_wrong"]
    r = {**_run(0.55, 0.57), "refit": d}
    RX.report({"command": "x", "finished": "now", "probe": None, "runs": {"weaver": {"0": r}}}, tmp_path)
    md = (tmp_path / "real.md").read_text()
    assert "## The label model refitted offline, π estimated or known" in md
    assert f"| weaver, seed 0 | 4000 ({d['true_share']:.3f}) | held at the probe's 0.200 | 0.200 |" in md
