"""``pipeline top``: frames rendered from a real Redis, numbers read back and compared with XINFO."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from pipeline.keys import GENERATORS_GROUP, Keys
from pipeline.observe.metrics import snapshot
from pipeline.observe.top import History, frame_text, rates, render, sparkline
from tests.busy_streams import fill_streams, group_info


def table_rows(text: str, first: str) -> list[list[str]]:
    """Whitespace-split rows of a rendered table whose first cell is ``first``."""
    return [line.split() for line in text.splitlines() if line.split()[:1] == [first]]


def test_once_prints_a_frame_whose_stream_rows_equal_xinfo(redis_client, redis_url, tmp_path):
    keys = Keys("obs")
    fill_streams(redis_client, keys)
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "top", "--redis-url", redis_url, "--run-id", "obs",
                          "--runs_dir", str(tmp_path), "--once", "--interval", "0.1"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    for name, (key, group) in keys.shard(0).streams().items():
        (row,) = table_rows(out, name)
        g = group_info(redis_client, key, group)
        assert row[1] == group
        assert [int(x) for x in row[2:5]] == [redis_client.xlen(key), g["lag"], g["pending"]]
        assert int(row[6]) == g["consumers"]
    (dead,) = table_rows(out, "dead")
    assert int(dead[2]) == redis_client.xlen(keys.shard(0).dead) == 2
    (gen0,) = table_rows(out, "gen-0")
    assert gen0[1:3] == ["generator", "generating"]
    assert "policy version 4/10" in out and "reward 0.625" in out and "held-out 0.410 (base 0.300)" in out
    assert "dead letters 2" in out and "dropped stale 3" in out


def test_rates_count_entries_added_and_acked_between_snapshots(redis_client):
    keys = Keys("obs")
    fill_streams(redis_client, keys)
    before = snapshot(redis_client, keys)
    for _ in range(6):
        redis_client.xadd(keys.shard(0).prompts, {"d": b"x"})
    got = redis_client.xreadgroup(GENERATORS_GROUP, "gen-2", {keys.shard(0).prompts: ">"}, count=4)[0][1]
    redis_client.xack(keys.shard(0).prompts, GENERATORS_GROUP, *[e[0] for e in got])
    time.sleep(0.05)
    after = snapshot(redis_client, keys)
    dt = after["time"] - before["time"]
    rt = rates(before, after)
    assert abs(rt["in"]["prompts"] * dt - 6) < 1e-6
    assert abs(rt["out"]["prompts/generators"] * dt - 4) < 1e-6
    assert rt["in"]["rollouts"] == 0
    text = frame_text(render(after, prev=before))
    (row,) = table_rows(text, "prompts")
    assert float(row[7]) == round(6 / dt, 1) and float(row[8]) == round(4 / dt, 1)


def test_history_reads_the_metrics_file_and_draws_sparklines(redis_client, tmp_path):
    keys = Keys("obs")
    fill_streams(redis_client, keys)
    rows = [{"kind": "eval", "version": 0, "heldout_accuracy": 0.3}]
    rows += [{"kind": "step", "version": v, "reward_mean": v / 10, "sample_accuracy": v / 20,
              "staleness_hist": [1, 2] if v % 2 else [3]} for v in range(1, 11)]
    rows += [{"kind": "eval", "version": 10, "heldout_accuracy": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    snap = snapshot(redis_client, keys)
    h = History(tmp_path / "metrics.jsonl").update(snap)
    assert h.reward == [v / 10 for v in range(1, 11)]
    assert h.heldout == [(0, 0.3), (10, 0.5)]
    assert h.staleness == [5 * 1 + 5 * 3, 5 * 2]
    text = frame_text(render(snap, history=h))
    (reward,) = table_rows(text, "reward")
    assert reward[1] == sparkline(h.reward, lo=0.0, hi=1.0) and reward[2] == "1.000"
    assert "0:20 1:10" in text


def test_history_without_a_file_follows_the_trainer_hash(redis_client):
    keys = Keys("obs")
    fill_streams(redis_client, keys)
    h = History(None)
    h.update(snapshot(redis_client, keys))
    redis_client.hset(keys.trainer, mapping={"version": 5, "reward_mean": 0.75, "eval_version": 5, "eval_accuracy": 0.45})
    h.update(snapshot(redis_client, keys))
    h.update(snapshot(redis_client, keys))  # unchanged version: no new point
    assert h.reward == [0.625, 0.75]
    assert h.heldout == [(5, 0.45)]


def test_sparkline_scales_values_to_eight_levels():
    assert sparkline([0.0, 0.5, 1.0], lo=0.0, hi=1.0) == "▁▅█"
    assert sparkline([2.0, 2.0]) == "▁▁"
    assert sparkline([]) == ""
    assert len(sparkline(list(range(100)), width=10)) == 10


def test_without_run_id_or_url_top_follows_the_cluster_pipeline_up_recorded(redis_client, redis_url, tmp_path):
    keys = Keys("obs")
    fill_streams(redis_client, keys)
    (tmp_path / "cluster.json").write_text(json.dumps({"run_id": "obs", "url": redis_url, "ns": "obs", "workers": {}}))
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "top", "--runs_dir", str(tmp_path), "--once",
                          "--interval", "0.1"], capture_output=True, text=True, timeout=60, check=True, env=env).stdout
    assert "run obs" in out and table_rows(out, "prompts")[0][2] == "12"
    (tmp_path / "cluster.json").unlink()
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "top", "--runs_dir", str(tmp_path), "--once"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and "run_id: required" in done.stderr


def test_status_and_account_follow_the_cluster_pipeline_up_recorded_and_explicit_flags_win(redis_client, redis_url,
                                                                                           tmp_path):
    keys = Keys("obs")
    fill_streams(redis_client, keys)
    (tmp_path / "cluster.json").write_text(json.dumps({"run_id": "obs", "url": redis_url, "ns": "obs", "workers": {}}))
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}

    def run(*args: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "pipeline.cli", *args, "--runs_dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=60, check=True, env=env).stdout
        return json.loads(out)

    followed = run("status")
    assert followed["trainer"]["version"] == "4" and "gen-0" in followed["workers"]
    assert followed["queues"] == run("status", "--run-id", "obs", "--redis-url", redis_url)["queues"]
    assert run("account") == run("account", "--run-id", "obs", "--redis-url", redis_url)
    other = run("status", "--run-id", "other")  # an explicit run id wins over the recorded one
    assert other["trainer"] == {} and other["workers"] == {}
    (tmp_path / "cluster.json").unlink()
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--runs_dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and "run_id: required" in done.stderr


def test_episode_counters_show_as_a_line_of_their_own(redis_client):
    keys = Keys("obsep")
    fill_streams(redis_client, keys)
    stats = keys.shard(0).stats
    text = frame_text(render(snapshot(redis_client, keys)))
    assert "episodes " not in text  # single-turn runs show no episode line
    redis_client.hset(stats, mapping={"episodes_total": 40, "turns_total": 100, "env_steps_total": 58,
                                      "env_errors_total": 2, "env_step_seconds_total": 3.0})
    text = frame_text(render(snapshot(redis_client, keys)))
    assert "episodes 40" in text and "turns per episode 2.500" in text
    assert "env step 50.0 ms" in text and "env errors 2" in text
    assert "tool-call rate -" in text and "tool-call success -" in text  # counters of an older generator


def test_the_episode_lines_show_rates_latency_percentiles_and_tool_calls(redis_client):
    keys = Keys("obsep2")
    fill_streams(redis_client, keys)
    stats = keys.shard(0).stats
    # 40 finished episodes, 25 of them with a tool call: 32 calls, 24 answered. 60 step attempts:
    # 30 at most 1 ms, 24 in (1, 2.5] ms, 6 in (50, 100] ms.
    redis_client.hset(stats, mapping={"episodes_total": 44, "episodes_finished_total": 40, "turns_total": 100,
                                      "env_steps_total": 58, "env_errors_total": 2, "env_step_seconds_total": 0.9,
                                      "tool_calls_total": 32, "tool_calls_ok_total": 24,
                                      "episodes_with_tool_calls_total": 25,
                                      "env_step_seconds_bucket:0.001": 30, "env_step_seconds_bucket:0.0025": 24,
                                      "env_step_seconds_bucket:0.1": 6})
    before = snapshot(redis_client, keys)
    redis_client.hincrby(stats, "episodes_finished_total", 8)
    time.sleep(0.05)
    after = snapshot(redis_client, keys)
    dt = after["time"] - before["time"]
    text = frame_text(render(after, prev=before), width=200)
    assert f"episodes 44 (finished 48, {8 / dt:.2f}/s)" in text
    assert "turns per episode 2.083" in text  # per finished episode: 100 / 48
    # Mean 0.9 s / 60 = 15 ms; p50 at rank 30: the top of the first bucket, 1 ms; p95 at rank 57:
    # half-way through the (50, 100] ms bucket's 6 steps, linearly, 50 + 50 * 3/6 = 75 ms.
    assert "env step 15.0 ms (p50 1.0, p95 75.0)" in text
    assert "tool calls 32 (0.667 per episode)" in text
    assert "tool-call rate 0.521" in text and "tool-call success 0.750 (24 answered)" in text


def test_history_carries_the_per_step_tool_call_rate_and_environment_reward(redis_client, tmp_path):
    keys = Keys("obsep3")
    fill_streams(redis_client, keys)
    rows = [{"kind": "step", "version": v, "reward_mean": 0.1, "sample_accuracy": 0.1, "staleness_hist": [1],
             "episodes": 8, "env_reward_mean": v / 8, "tool_call_rate": v / 4 if v != 2 else None}
            for v in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    snap = snapshot(redis_client, keys)
    h = History(tmp_path / "metrics.jsonl").update(snap)
    assert h.env_reward == [0.125, 0.25, 0.375] and h.tool_call_rate[0] == 0.25 and h.tool_call_rate[2] == 0.75
    text = frame_text(render(snap, history=h))
    (rate,) = [row for row in table_rows(text, "tool-call") if row[1] == "rate"]
    (env,) = [row for row in table_rows(text, "env") if row[1] == "reward"]
    assert rate[3] == "0.750" and env[3] == "0.375" and env[2] == sparkline(h.env_reward, lo=0.0, hi=1.0)
    # Without the file, from the trainer's progress hash.
    h = History(None)
    redis_client.hset(keys.trainer, mapping={"version": 5, "env_reward_mean": 0.5, "tool_call_rate": 0.25})
    h.update(snapshot(redis_client, keys))
    assert h.env_reward == [0.5] and h.tool_call_rate == [0.25]
    single = History(None).update(snapshot(redis_client, Keys("obs-none")))
    assert single.env_reward == [] and "tool-call" not in frame_text(render(snapshot(redis_client, keys), history=single))
