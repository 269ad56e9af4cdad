"""A DAPO-style configuration end to end: dynamic sampling with refill, clip-higher and
several updates per batch, through a real `pipeline up`; every prompt still accounted for."""

from __future__ import annotations

import json

import pytest
from harness import up as _up

pytestmark = [pytest.mark.slow, pytest.mark.one_server]


def test_dynamic_sampling_refills_and_the_accounting_balances(tmp_path, tiny_base_model):
    # The tiny base model is almost never right: with the ground-truth reward most groups have
    # no signal, so every step must refill.
    p = _up(tmp_path, tiny_base_model, "--run-id", "dapo", "--trainer.steps", "4", "--trainer.eval_every", "4",
            "--verifier.reward", "ground_truth", "--trainer.dynamic_sampling", "true", "--trainer.max_refills", "2",
            "--trainer.clip_eps_high", "0.28", "--trainer.ppo_epochs", "2", "--trainer.minibatches", "2",
            "--cluster.timeout_s", "300", weak_rewards=False)
    out = p.communicate(timeout=600)[0].decode()
    assert p.returncode == 0, out[-3000:]
    run = tmp_path / "runs" / "dapo"
    summary = json.loads((run / "summary.json").read_text())
    acc = summary["accounting"]
    assert acc["ok"] and acc["lost"] == 0 and acc["unexpected"] == 0, acc
    # The ground-truth reward reads no verifier's votes: none ran, and the summary says so.
    assert summary["verifiers"] and all(c["completions"] == 0 for c in summary["verifiers"].values())
    assert "verifiers not run" in (run / "summary.md").read_text()
    steps = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["kind"] == "step":
            steps[row["version"]] = row
    assert len(steps) == 4
    b = 4  # configs/tiny.toml trainer.groups_per_step
    for row in steps.values():
        consumed = row["groups_consumed"]
        assert consumed == row["groups_trained"] + row["groups_nosignal"] + row["groups_stale"]
        assert row["groups_trained"] >= b or row["refills"] == 2, row  # enough signal, or the refills ran out
        assert consumed <= b * 3, "each refill reads only what is missing"
    assert any(r["groups_consumed"] > b for r in steps.values()), "refills happened"
    assert sum(r["groups_consumed"] for r in steps.values()) == acc["trained"] + acc["nosignal"] + acc["stale"]
