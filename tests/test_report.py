"""``pipeline report``: the numbers and figures of a run directory written here, checked against its files."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from PIL import Image

from pipeline.observe.report import write_report

pytestmark = pytest.mark.one_server

T0 = 1_800_000_000.0


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def write_run(run: Path, *, steps: int = 24) -> dict:
    """A run directory as ``pipeline up`` leaves it: metrics.jsonl, queues.jsonl and worker logs."""
    (run / "logs").mkdir(parents=True)
    metrics = [{"kind": "eval", "time": T0, "version": 0, "heldout_accuracy": 0.30, "n": 100}]
    trainer_log, gen_log, ver_log = [], [], []
    for v in range(1, steps + 1):
        t = T0 + 2 * v
        hist = [v % 3, 4 - v % 3] if v > 1 else [4]
        metrics.append({"kind": "step", "time": t, "version": v, "reward_mean": 0.2 + 0.02 * v,
                        "sample_accuracy": 0.1 + 0.01 * v, "staleness_hist": hist, "groups_stale": v % 5 == 0,
                        "wait_seconds": 0.5, "step_seconds": 1.5})
        trainer_log.append({"stage": "trainer", "worker": "trainer", "event": "step", "version": v,
                            "step_seconds": 1.5, "timestamp": iso(t)})
        gen_log.append({"stage": "generator", "worker": "gen-0", "event": "batch_generated", "seconds": 0.5,
                        "groups": 4, "timestamp": iso(t - 1)})
        ver_log.append({"stage": "verifier", "worker": "ver-0", "event": "batch_scored", "seconds": 0.25,
                        "timestamp": iso(t - 0.5)})
        if v % 8 == 0:
            metrics.append({"kind": "eval", "time": t, "version": v, "heldout_accuracy": 0.30 + 0.01 * v, "n": 100})
    gen_log.append({"stage": "generator", "worker": "gen-0", "event": "generator_stopped", "timestamp": iso(T0 + 60)})
    queues = [{"time": T0 + i, "version": i // 2,
               "queues": {"prompts": {"length": 50, "lag": 40 - i, "pending": 8},
                          "rollouts": {"length": i, "lag": i % 4, "pending": 2},
                          "scored": {"length": 3, "lag": 1, "pending": 0},
                          "dead": {"length": i // 10, "lag": 0, "pending": 0}}} for i in range(0, 40)]
    for name, rows in (("metrics.jsonl", metrics), ("queues.jsonl", queues), ("logs/trainer.jsonl", trainer_log),
                       ("logs/gen-0.jsonl", gen_log), ("logs/ver-0.jsonl", ver_log)):
        (run / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "logs" / "gen-0.out").write_text("not json\n")
    return {"metrics": metrics, "queues": queues}


def test_report_numbers_equal_what_the_run_logged(tmp_path):
    run = tmp_path / "run-a"
    src = write_run(run)
    rep = write_report(run)
    steps = [m for m in src["metrics"] if m["kind"] == "step"]
    evals = [m for m in src["metrics"] if m["kind"] == "eval"]
    assert rep["steps"] == 24
    assert rep["reward"] == [s["reward_mean"] for s in steps]
    assert rep["reward_first10"] == pytest.approx(sum(s["reward_mean"] for s in steps[:10]) / 10)
    assert rep["reward_last10"] == pytest.approx(sum(s["reward_mean"] for s in steps[-10:]) / 10)
    assert rep["base_accuracy"] == 0.30
    assert rep["final_accuracy_mean_last3"] == pytest.approx(sum(e["heldout_accuracy"] for e in evals[1:][-3:]) / 3)
    hist = [sum(s["staleness_hist"][0] for s in steps), sum(s["staleness_hist"][1] for s in steps if len(s["staleness_hist"]) > 1)]
    assert rep["staleness_hist"] == hist and rep["groups_consumed"] == 24 * 4
    assert rep["groups_stale"] == 4
    backlog = [q["queues"]["prompts"]["lag"] + q["queues"]["prompts"]["pending"] for q in src["queues"]]
    assert rep["queues"]["prompts"]["backlog_mean"] == pytest.approx(sum(backlog) / len(backlog))
    assert rep["queues"]["prompts"]["backlog_max"] == max(backlog) == 48
    assert rep["queues"]["dead"]["length_max"] == 3
    # The run's window: from the first sample or busy span (T0) to the last (the final step, T0 + 48);
    # a log line that marks no work (generator_stopped at T0 + 60) does not extend it.
    assert rep["duration_seconds"] == pytest.approx(48.0)
    assert rep["workers"]["trainer"]["busy_seconds"] == pytest.approx(24 * 1.5)
    assert rep["workers"]["gen-0"]["batches"] == 24
    assert rep["workers"]["ver-0"]["busy_fraction"] == pytest.approx(24 * 0.25 / 48.0)
    assert rep["stages"]["trainer"]["busy_fraction"] == pytest.approx(36 / 48)
    on_disk = json.loads((run / "report.json").read_text())
    assert on_disk["staleness_hist"] == hist and on_disk["steps"] == 24


def test_report_writes_real_pngs_and_markdown_that_links_them(tmp_path):
    run = tmp_path / "run-b"
    write_run(run, steps=12)
    rep = write_report(run)
    md = (run / "report.md").read_text()
    assert set(rep["figures"]) == {"reward_accuracy", "queues", "staleness", "utilisation"}
    for rel in rep["figures"].values():
        assert f"]({rel})" in md
        with Image.open(run / rel) as img:
            assert img.format == "PNG" and img.size == (800, 450)
            low, high = img.convert("L").getextrema()
            assert high - low > 100  # something dark was drawn on the white canvas
    assert f"| trainer | trainer | 12 | {12 * 1.5:.1f} |" in md
    assert "| prompts |" in md and "held-out greedy accuracy: base 0.300" in md
    assert rep["episodes"] is None and "## Episodes" not in md  # a single-turn run: no episodes section


def test_report_command_prints_the_markdown_and_rejects_a_non_run_directory(tmp_path):
    run = tmp_path / "run-c"
    write_run(run, steps=4)
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "report", str(run)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# Report of run-c") and "report figures" in done.stderr
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither metrics.jsonl nor logs"):
        write_report(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_report(tmp_path / "missing")


def test_the_eval_workers_results_get_a_figure_and_a_table(tmp_path):
    run = tmp_path / "run-e"
    write_run(run, steps=12)
    rows = [{"version": v, "set": name, "prompts": 20, "greedy_accuracy": 0.3 + 0.01 * v,
             "pass_at_k": {"1": 0.2 + 0.01 * v, "4": 0.5 + 0.01 * v}, "mean_at_n": 0.2 + 0.01 * v, "n": 4,
             "temperature": 1.0, "seconds": 1.0} for v in (0, 5, 10) for name in ("heldout", "digits=4")]
    (run / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
    rep = write_report(run)
    md = (run / "report.md").read_text()
    assert "beside" in rep["figures"] and f"]({rep['figures']['beside']})" in md
    with Image.open(run / rep["figures"]["beside"]) as img:
        assert img.format == "PNG"
    assert "| 10 | digits=4 | 20 | 0.400 | 0.300 | 0.600 | 0.300 |" in md
    assert len(rep["evals_beside_training"]) == 6, "the torn last line is left out"


@pytest.mark.slow
def test_a_weaver_runs_report_shows_each_verifiers_fitted_and_measured_rates(tmp_path, tiny_base_model):
    """A real `pipeline up` with the weaver reward (π estimated by `levels`): the report carries the
    label model's newest fit, how π was set, and per verifier the fitted rates beside the rates
    measured against the hidden truth under that fit."""
    from harness import up

    # The built-in checks vote 0/1 on the tiny model's answers (both estimates are then one
    # model); a verifier of your own with scores between 0 and 1 gives `levels` a column to level.
    (tmp_path / "graded.py").write_text(
        "import numpy as np\n\n"
        "def length(prompt, completions):\n"
        "    return np.array([min(len(c), 40) / 40 for c in completions], dtype=np.float32)\n")
    verifiers = "format,units_digit,mod9,magnitude,majority," + str(tmp_path / "graded.py") + ":length"
    p = up(tmp_path, tiny_base_model, "--run-id", "lm-report", "--trainer.steps", "4",
           "--verifier.pi_estimate", "levels", "--verifier.verifiers", verifiers)
    text = p.communicate(timeout=300)[0].decode()
    assert p.returncode == 0, text[-3000:]
    run = tmp_path / "runs" / "lm-report"
    rep = json.loads((run / "report.json").read_text())
    lm = rep["label_model"]
    fits = [json.loads(line) for line in (run / "logs" / "ver-0.jsonl").read_text().splitlines()
            if '"labelmodel_fitted"' in line]
    fits += [json.loads(line) for f in (run / "logs").glob("ver-[1-9].jsonl") for line in f.read_text().splitlines()
             if '"labelmodel_fitted"' in line]
    newest = max(fits, key=lambda r: r["version"])
    assert lm["version"] == newest["version"] and lm["pi"] == newest["pi"] and lm["groups_measured"] > 0
    assert lm["pi_method"] == newest["pi_method"] == "levels"
    assert set(lm["verifiers"]) == set(newest["thresholds"])
    for name in newest["kept"]:
        v = lm["verifiers"][name]
        assert v["kept"] and v["tpr_fitted"] == newest["tpr"][name] and v["tnr_fitted"] == newest["tnr"][name]
        assert v["tpr_measured"] is None or 0 <= v["tpr_measured"] <= 1
    assert any(v["tnr_measured"] is not None for v in lm["verifiers"].values())
    md = (run / "report.md").read_text()
    assert "## Weak verifiers: what the label model fitted" in md and "estimated by `levels`" in md
    assert all(f"| `{name}` |" in md for name in newest["thresholds"])


def test_a_run_with_episodes_gets_their_section_table_and_figure(tmp_path):
    run = tmp_path / "run-ep"
    write_run(run, steps=12)
    rows = _jsonl_rows(run / "metrics.jsonl")
    for r in rows:
        if r["kind"] == "step":
            v = r["version"]
            calls = v if v % 3 else 0
            r.update(episodes=16, turns_mean=1.5, env_reward_mean=v / 24, tool_call_rate=min(v, 16) / 16,
                     tool_calls_mean=calls / 16, episodes_with_tool_calls=min(v, 16), tool_calls=calls,
                     tool_calls_ok=calls // 2, tool_call_success=(calls // 2) / calls if calls else None)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    queues = _jsonl_rows(run / "queues.jsonl")
    queues[-1]["episodes"] = {"episodes": 200, "episodes_finished": 195, "turns_per_episode": 1.4,
                              "env_steps": 270, "env_errors": 3, "env_step_mean_s": 0.002, "env_step_p50_s": 0.001,
                              "env_step_p95_s": 0.004, "tool_calls": 80, "tool_calls_ok": 60,
                              "episodes_with_tool_calls": 70, "tool_call_rate": 70 / 195,
                              "tool_calls_per_episode": 80 / 195, "tool_call_success": 0.75}
    (run / "queues.jsonl").write_text("".join(json.dumps(r) + "\n" for r in queues))
    rep = write_report(run)
    steps = [r for r in rows if r["kind"] == "step"]
    ep = rep["episodes"]
    assert ep["per_step"]["versions"] == list(range(1, 13))
    assert ep["per_step"]["tool_call_rate"] == [s["tool_call_rate"] for s in steps]
    assert ep["per_step"]["env_reward"] == [s["env_reward_mean"] for s in steps]
    t = ep["trained"]
    assert t["episodes"] == 192 and t["episodes_with_tool_calls"] == sum(range(1, 13))
    assert t["tool_call_rate"] == pytest.approx(sum(range(1, 13)) / 192)
    calls = sum(v for v in range(1, 13) if v % 3)
    assert t["tool_calls"] == calls and t["tool_calls_ok"] == sum(v // 2 for v in range(1, 13) if v % 3)
    assert t["tool_call_success"] == pytest.approx(t["tool_calls_ok"] / calls)
    assert t["tool_call_rate_first10"] == pytest.approx(sum(range(1, 11)) / 160)
    assert t["env_reward_last10"] == pytest.approx(sum(v / 24 for v in range(3, 13)) / 10)
    # Run-wide: the exporter's last sample, its finished episodes over the samples' span (39 s).
    assert ep["run"]["episodes_finished"] == 195 and ep["run"]["episodes_per_s"] == pytest.approx(195 / 39)
    md = (run / "report.md").read_text()
    assert "## Episodes" in md and f"]({rep['figures']['episodes']})" in md
    assert f"| tool-call rate | {t['tool_call_rate']:.3f} | {t['tool_call_rate_first10']:.3f} |" in md
    assert f"| tool-call success | {t['tool_call_success']:.3f} ({t['tool_calls_ok']} of {calls}) |" in md
    assert "| 200 (195) | 5.00 | 1.400 | 2.0 / 1.0 / 4.0 | 3 | 80 | 0.359 | 0.750 |" in md
    with Image.open(run / rep["figures"]["episodes"]) as img:
        assert img.format == "PNG" and img.size == (800, 450)


def _jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
