"""`pipeline up` / `pipeline down`: the single-machine driver, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import up

pytestmark = pytest.mark.slow


_up = up


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0; it has exited all the same.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_up_starts_its_own_server_trains_and_writes_an_accounted_summary(tmp_path, tiny_base_model):
    p = _up(tmp_path, tiny_base_model, "--run-id", "tiny", "--trainer.steps", "3")
    out = p.communicate(timeout=300)[0].decode()
    assert p.returncode == 0, out
    run = tmp_path / "runs" / "tiny"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 3
    assert summary["accounting"]["ok"] and summary["accounting"]["lost"] == 0
    assert "step    3/3" in out and "Accounting" in out, out[-2000:]
    # Weaver reads every verifier: each ran, with its cost per completion.
    assert all(c["completions"] > 0 and c["seconds_per_completion"] > 0 for c in summary["verifiers"].values())
    assert "verifiers run, seconds per completion: `format`" in out
    assert {f.name for f in (run / "logs").glob("*.jsonl")} >= {"trainer.jsonl", "feeder.jsonl", "gen-0.jsonl",
                                                                "gen-1.jsonl", "ver-0.jsonl", "ver-1.jsonl"}
    # Each worker's stdout/stderr, under the name the driver's messages give it (pipeline.run.plan.log_file).
    assert {f.name for f in (run / "logs").glob("*.out")} == {"train.out", "feed.out", "exporter.out", "gen-0.out",
                                                               "gen-1.out", "ver-0.out", "ver-1.out"}
    assert not (tmp_path / "runs" / "cluster.json").exists()


def test_up_refuses_a_model_field_the_existing_checkpoint_ignores_before_starting_anything(tmp_path, tiny_base_model):
    p = _up(tmp_path, tiny_base_model, "--model.hidden_size", "64", "--model.seed", "0")
    out = p.communicate(timeout=120)[0].decode()
    assert p.returncode == 2, out
    assert "config error: model.hidden_size = 64: set, but cannot take effect" in out, out
    assert "already holds a pretrained checkpoint" in out and "point model.base_dir elsewhere" in out
    assert "model.seed" not in out, "the checkpoint was built with seed 0: that value did take effect"
    assert not (tmp_path / "runs").exists(), "nothing was started"


def test_down_stops_a_running_cluster_and_its_summary_still_accounts_for_everything(tmp_path, tiny_base_model):
    p = _up(tmp_path, tiny_base_model, "--run-id", "long", "--trainer.steps", "100000")
    info_file = tmp_path / "runs" / "cluster.json"
    deadline = time.time() + 240
    while not (tmp_path / "runs" / "long" / "metrics.jsonl").exists() or \
            "step" not in (tmp_path / "runs" / "long" / "metrics.jsonl").read_text():
        assert time.time() < deadline and p.poll() is None, "the cluster never trained a step"
        time.sleep(0.5)
    info = json.loads(info_file.read_text())
    down = subprocess.run([sys.executable, "-m", "pipeline.cli", "down", "--runs-dir", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    out = p.communicate(timeout=120)[0].decode()
    assert "interrupted" in out
    for pid in [*info["workers"].values(), info["server_pid"], info["driver_pid"]]:
        assert not _alive(pid), f"pid {pid} survived `pipeline down`"
    summary = json.loads((tmp_path / "runs" / "long" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["accounting"]["ok"], summary["accounting"]
    assert not info_file.exists()
    assert not any(Path("/dev/shm/long").glob("*")), "the trainer released its shared-memory weights"
