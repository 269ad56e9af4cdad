"""Multi-turn environment metrics (docs/observing.md, "Episodes") through a real run.

A short ``pipeline up`` with the calculator environment on the test's Redis-compatible
server; afterwards the run's counters (as the exporter serves them and ``pipeline top``
prints them), the trainer's per-step rows and the report are recounted from what the run
left behind: each generator's ``group_generated`` log lines (one per emitted group, with its
completions' turns and tool calls) and the training log in Redis (which group each step
trained). The counting itself is unit-tested in tests/test_episodes.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from PIL import Image
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.bus.stats import read_stats
from pipeline.envs.base import Step
from pipeline.envs.openenv import tool_flags
from pipeline.keys import Keys
from pipeline.observe.metrics import StreamCollector, snapshot

RUN = "envm"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _samples(r, keys) -> dict[str, float]:
    """Every unlabelled sample (and the histogram's buckets by ``le``) the exporter serves now."""
    registry = CollectorRegistry()
    registry.register(StreamCollector(r, keys))
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
            elif set(s.labels) == {"le"}:
                out[f"{s.name}{{le={s.labels['le']}}}"] = s.value
    return out


@pytest.fixture(scope="module")
def calculator_run(tmp_path_factory, tiny_base_model, redis_server):
    """``pipeline up`` for 4 steps with the calculator and its reward, on the test server."""
    from harness import up

    tmp = tmp_path_factory.mktemp("envm")
    url = redis_server.url
    redis.Redis.from_url(url).flushdb()
    p = up(tmp, tiny_base_model, "--run-id", RUN, "--redis.url", url, "--trainer.steps", "4",
           "--trainer.eval_every", "4", "--generator.swap", "step", "--env.kind", "calculator",
           "--env.max_turns", "3", "--task.max_new_tokens", "24", "--verifier.reward", "environment", "--metrics.sample_every_s", "0.2",
           "--cluster.timeout_s", "400", weak_rewards=False)
    out = p.communicate(timeout=600)[0].decode()
    assert p.returncode == 0, out[-4000:]
    run = tmp / "runs" / RUN
    groups = {}
    for f in sorted((run / "logs").glob("gen-*.jsonl")):
        for e in _jsonl(f):
            if e.get("event") == "group_generated":
                assert e["group_id"] not in groups
                groups[e["group_id"]] = e
    assert groups and all("tool_calls" in g for g in groups.values())
    yield {"url": url, "run": run, "root": tmp, "groups": groups, "keys": Keys(RUN)}


def _recount(groups) -> dict[str, float]:
    calls = [c for g in groups for c in g["tool_calls"]]
    ok = [c for g in groups for c in g["tool_calls_ok"]]
    turns = [t for g in groups for t in g["turns"]]
    return {"episodes": len(calls), "tool_calls": sum(calls), "tool_calls_ok": sum(ok),
            "with_calls": sum(c > 0 for c in calls), "turns": sum(turns)}


def test_the_run_counters_and_the_exporter_equal_a_recount_of_the_groups_emitted(calculator_run):
    r = redis.Redis.from_url(calculator_run["url"])
    keys = calculator_run["keys"]
    n = _recount(calculator_run["groups"].values())
    stats = read_stats(r, keys)
    assert stats["episodes_finished_total"] == n["episodes"] and stats["turns_total"] == n["turns"]
    assert stats.get("tool_calls_total", 0) == n["tool_calls"]
    assert stats.get("tool_calls_ok_total", 0) == n["tool_calls_ok"]
    assert stats.get("episodes_with_tool_calls_total", 0) == n["with_calls"]
    assert stats["episodes_total"] >= n["episodes"]  # started: the ones handed back at the stop too

    m = _samples(r, keys)
    assert m["pipeline_episodes_finished_total"] == n["episodes"]
    assert m.get("pipeline_tool_calls_total", 0) == n["tool_calls"]
    assert m["pipeline_env_turns_per_episode"] == pytest.approx(n["turns"] / n["episodes"])
    assert m["pipeline_env_tool_call_rate_ratio"] == pytest.approx(n["with_calls"] / n["episodes"])
    assert m["pipeline_env_tool_calls_per_episode"] == pytest.approx(n["tool_calls"] / n["episodes"])
    if n["tool_calls"]:
        assert m["pipeline_env_tool_call_success_ratio"] == pytest.approx(n["tool_calls_ok"] / n["tool_calls"])
    else:
        assert "pipeline_env_tool_call_success_ratio" not in m
    # One latency observation per step attempt: the histogram's count is steps + errors.
    attempts = stats.get("env_steps_total", 0) + stats.get("env_errors_total", 0)
    assert attempts > 0 and m["pipeline_env_step_latency_seconds_count"] == attempts
    assert m["pipeline_env_step_latency_seconds_bucket{le=+Inf}"] == attempts
    assert m["pipeline_env_step_latency_seconds_sum"] == pytest.approx(stats["env_step_seconds_total"])
    assert not any(k.startswith("pipeline_env_step_seconds_bucket") for k in m)  # the buckets are one histogram
    ep = snapshot(r, keys)["episodes"]
    assert 0 < ep["env_step_p50_s"] <= ep["env_step_p95_s"] <= 10.0
    summary = json.loads((calculator_run["run"] / "summary.json").read_text())["episodes"]
    assert summary["tool_calls"] == n["tool_calls"] and summary["episodes_finished"] == n["episodes"]
    r.close()


def test_pipeline_top_prints_the_episode_numbers_and_per_step_history(calculator_run):
    n = _recount(calculator_run["groups"].values())
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "top", "--redis-url", calculator_run["url"],
                          "--run-id", RUN, "--runs_dir", str(calculator_run["root"] / "runs"), "--once",
                          "--interval", "0.1"], capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"(finished {n['episodes']}, " in out
    assert f"turns per episode {n['turns'] / n['episodes']:.3f}" in out
    assert f"tool calls {n['tool_calls']} ({n['tool_calls'] / n['episodes']:.3f} per episode)" in out
    assert f"tool-call rate {n['with_calls'] / n['episodes']:.3f}" in out
    success = f"{n['tool_calls_ok'] / n['tool_calls']:.3f}" if n["tool_calls"] else "-"
    assert f"tool-call success {success} ({n['tool_calls_ok']} answered)" in out
    assert " ms (p50 " in out and "env errors " in out
    steps = [s for s in _jsonl(calculator_run["run"] / "metrics.jsonl") if s["kind"] == "step"]
    (rate,) = [line.split() for line in out.splitlines() if line.split()[:2] == ["tool-call", "rate"]
               and len(line.split()) == 4]
    assert rate[3] == f"{steps[-1]['tool_call_rate']:.3f}"
    (env,) = [line.split() for line in out.splitlines() if line.split()[:2] == ["env", "reward"]]
    assert env[3] == f"{steps[-1]['env_reward_mean']:.3f}"


def test_each_steps_row_recounts_from_the_groups_it_trained(calculator_run):
    r = redis.Redis.from_url(calculator_run["url"])
    keys = calculator_run["keys"]
    groups = calculator_run["groups"]
    trained: dict[int, list[dict]] = {}
    for key in keys.stream_keys("trainlog"):
        for _, f in r.xrange(key):
            if not f[b"outcome"].startswith(b"stale"):  # fresh groups: the step's episodes
                trained.setdefault(int(f[b"version"]), []).append(groups[f[b"group_id"].decode()])
    steps = [s for s in _jsonl(calculator_run["run"] / "metrics.jsonl") if s["kind"] == "step"]
    assert [s["version"] for s in steps] == [1, 2, 3, 4]
    for s in steps:
        n = _recount(trained[s["version"]])
        assert s["episodes"] == n["episodes"] and s["tool_calls"] == n["tool_calls"]
        assert s["tool_call_rate"] == pytest.approx(n["with_calls"] / n["episodes"])
        assert s["tool_calls_ok"] == n["tool_calls_ok"] and s["episodes_with_tool_calls"] == n["with_calls"]
        assert s["turns_mean"] == pytest.approx(n["turns"] / n["episodes"])
        assert s["tool_call_success"] == (pytest.approx(n["tool_calls_ok"] / n["tool_calls"]) if n["tool_calls"]
                                          else None)
        # The environment is the reward: the step's reward is its environment reward.
        assert s["env_reward_mean"] == pytest.approx(s["reward_mean"], abs=1e-6)
    r.close()


def test_the_report_has_an_episodes_section_plotting_tool_call_rate_and_reward(calculator_run):
    run = calculator_run["run"]
    rep = json.loads((run / "report.json").read_text())
    steps = [s for s in _jsonl(run / "metrics.jsonl") if s["kind"] == "step"]
    ep = rep["episodes"]
    assert ep["per_step"]["versions"] == [1, 2, 3, 4]
    assert ep["per_step"]["tool_call_rate"] == [s["tool_call_rate"] for s in steps]
    assert ep["per_step"]["env_reward"] == [s["env_reward_mean"] for s in steps]
    t = ep["trained"]
    assert t["episodes"] == sum(s["episodes"] for s in steps)
    assert t["tool_calls"] == sum(s["tool_calls"] for s in steps)
    assert t["tool_call_rate"] == pytest.approx(sum(s["episodes_with_tool_calls"] for s in steps) / t["episodes"])
    # Run-wide, the exporter's last sample: never more than the groups the generators emitted.
    n = _recount(calculator_run["groups"].values())
    assert 0 < ep["run"]["episodes_finished"] <= n["episodes"]
    assert ep["run"]["tool_calls"] <= n["tool_calls"]
    md = (run / "report.md").read_text()
    assert "## Episodes" in md and f"]({rep['figures']['episodes']})" in md
    assert f"| tool-call rate | {t['tool_call_rate']:.3f} |" in md
    with Image.open(run / rep["figures"]["episodes"]) as img:
        assert img.format == "PNG"
        low, high = img.convert("L").getextrema()
        assert high - low > 100


def test_the_held_out_evaluation_plays_episodes_through_the_environment(calculator_run, tiny_base_model):
    """With env.kind set, the trainer's held-out accuracy is greedy episodes' success through the
    calculator, with the tool-call rate beside it; version 0 is the base, played again here."""
    import numpy as np

    from pipeline.config import TaskConfig
    from pipeline.envs.calculator import calculator
    from pipeline.engines.episodes import play, summarise
    from pipeline.model.qwen import load_checkpoint
    from pipeline.tasks.arithmetic import ArithmeticTask

    evals = [e for e in _jsonl(calculator_run["run"] / "metrics.jsonl") if e["kind"] == "eval"]
    assert [e["version"] for e in evals] == [0, 4]
    for e in evals:
        assert {"heldout_tool_call_rate", "heldout_turns_mean", "heldout_env_errors"} <= set(e)
        assert 0.0 <= e["heldout_tool_call_rate"] <= 1.0 and e["heldout_turns_mean"] >= 1.0
    summary = json.loads((calculator_run["run"] / "summary.json").read_text())
    items = ArithmeticTask(TaskConfig(heldout_size=evals[0]["n"])).heldout()
    model, tok = load_checkpoint(tiny_base_model)
    again = summarise(play(model.eval(), tok, [np.asarray(tok.encode(i.prompt), dtype=np.int32) for i in items],
                           [i.reference for i in items], calculator(None), max_turns=3, max_new_tokens=24))
    assert again["heldout_accuracy"] == pytest.approx(evals[0]["heldout_accuracy"], abs=0.02)
    assert again["heldout_tool_call_rate"] == pytest.approx(evals[0]["heldout_tool_call_rate"], abs=0.02)
    assert summary["evals"]["0"] == pytest.approx(evals[0]["heldout_accuracy"])


def test_an_openenv_observation_carries_the_tool_call_flags_in_fields_of_its_own():
    """The client's side of the calculator server's ``tool_call`` / ``tool_ok`` fields (the
    served round trip is tested in the openenv lane, tests/test_openenv.py)."""
    assert tool_flags({"result": "357", "tool_call": True, "tool_ok": True}) == (True, True)
    assert tool_flags({"result": "", "tool_call": True, "tool_ok": False}) == (True, False)
    assert tool_flags({"result": "", "tool_call": False, "tool_ok": None}) == (False, None)
    # An environment without the fields (OpenEnv's template), or with other types in them: no tool call.
    assert tool_flags({"echoed_message": "abc", "message_length": 3}) == (False, None)
    assert tool_flags({"tool_call": "12+3=", "tool_ok": "yes"}) == (False, None)
    assert tool_flags(None) == (False, None)
    assert Step(observation="x") == Step(observation="x", tool_call=False, tool_ok=None)  # old environments
