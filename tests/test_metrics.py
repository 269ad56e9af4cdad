"""The Prometheus endpoints against the server's own XINFO / XPENDING numbers, on a real Redis."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pipeline.config import ConfigError, load_config
from pipeline.keys import GENERATORS_GROUP, VERIFIERS_GROUP, Keys
from pipeline.observe.logs import setup_logging
from pipeline.observe.metrics import (StreamCollector, WorkerMetrics, port_for, run_exporter, serve, start_worker_metrics,
                              worker_metrics, worker_ports, write_ports)
from pipeline.bus.server import free_port
from tests.busy_streams import fill_streams, group_info


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page, keyed by (name, sorted labels)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def with_le(labels: tuple, le: str) -> tuple:
    return tuple(sorted(labels + (("le", le),)))


@pytest.fixture
def exporter(redis_client):
    keys = Keys("obs")
    fill_streams(redis_client, keys)
    registry = CollectorRegistry()
    registry.register(StreamCollector(redis_client, keys))
    port = free_port()
    server, _ = serve(registry, port, "127.0.0.1", what="test exporter")
    yield redis_client, keys, port
    server.shutdown()


def test_stream_metrics_equal_the_servers_xinfo_and_xpending(exporter):
    r, keys, port = exporter
    m = scrape(port)
    for name, (key, group) in keys.shard(0).streams().items():
        g = group_info(r, key, group)
        lbl = (("group", group), ("stream", name))
        assert m[("pipeline_stream_length", (("stream", name),))] == r.xlen(key)
        assert m[("pipeline_stream_group_lag", lbl)] == g["lag"]
        assert m[("pipeline_stream_group_pending", lbl)] == g["pending"] == r.xpending(key, group)["pending"]
        assert m[("pipeline_stream_group_consumers", lbl)] == g["consumers"]
        assert m[("pipeline_stream_group_entries_read_total", lbl)] == (g["entries-read"] or 0)
    assert m[("pipeline_stream_length", (("stream", "dead"),))] == r.xlen(keys.shard(0).dead) == 2
    # The fill left 12 prompts: 5 + 2 read, 2 acked -> lag 5, pending 5.
    assert m[("pipeline_stream_group_lag", (("group", GENERATORS_GROUP), ("stream", "prompts")))] == 5
    assert m[("pipeline_stream_group_pending", (("group", VERIFIERS_GROUP), ("stream", "rollouts")))] == 0


def test_consumer_rows_and_delivery_histogram_match_xpending(exporter):
    r, keys, port = exporter
    m = scrape(port)
    pend = r.xpending_range(keys.shard(0).prompts, GENERATORS_GROUP, min="-", max="+", count=100)
    per_consumer = {c["name"].decode(): c["pending"] for c in r.xpending(keys.shard(0).prompts, GENERATORS_GROUP)["consumers"]}
    for consumer, n in per_consumer.items():
        lbl = (("consumer", consumer), ("group", GENERATORS_GROUP), ("stream", "prompts"))
        assert m[("pipeline_stream_consumer_pending", lbl)] == n
        assert 0 <= m[("pipeline_stream_consumer_idle_seconds", lbl)] < 30
    lbl = (("group", GENERATORS_GROUP), ("stream", "prompts"))
    counts = [p["times_delivered"] for p in pend]
    assert sorted(counts) == [1, 1, 1, 1, 2]
    assert m[("pipeline_stream_pending_delivery_count_count", lbl)] == len(counts)
    assert m[("pipeline_stream_pending_delivery_count_sum", lbl)] == sum(counts)
    assert m[("pipeline_stream_pending_delivery_count_bucket", with_le(lbl, "1.0"))] == 4
    assert m[("pipeline_stream_pending_delivery_count_bucket", with_le(lbl, "2.0"))] == 5
    # The oldest pending entry's age is the server clock minus the millisecond part of its id.
    sec, usec = r.time()
    oldest_ms = int(r.xpending(keys.shard(0).prompts, GENERATORS_GROUP)["min"].decode().split("-")[0])
    age = m[("pipeline_stream_oldest_pending_age_seconds", lbl)]
    assert 0 <= age <= (sec * 1000 + usec // 1000 - oldest_ms) / 1000 + 1e-3


def test_counters_trainer_gauges_goodput_and_heartbeats_come_from_redis(exporter):
    r, keys, port = exporter
    m = scrape(port)
    assert m[("pipeline_dead_letters_total", ())] == 2
    assert m[("pipeline_dropped_stale_total", ())] == 3
    assert m[("pipeline_tokens_generated_total", ())] == 1000
    assert m[("pipeline_goodput_ratio", ())] == pytest.approx(0.64)
    assert m[("pipeline_policy_version", ())] == 4
    assert m[("pipeline_reward_mean", ())] == 0.625
    assert m[("pipeline_heldout_accuracy_ratio", ())] == 0.41
    assert m[("pipeline_worker_state", (("stage", "generator"), ("state", "generating"), ("worker", "gen-0")))] == 1
    assert 4 <= m[("pipeline_worker_heartbeat_age_seconds", (("stage", "trainer"), ("worker", "trainer")))] < 60
    # A new entry shows at the next scrape: the collector reads Redis at scrape time.
    r.xadd(keys.shard(0).scored, {"d": b"x"})
    assert scrape(port)[("pipeline_stream_length", (("stream", "scored"),))] == 4


def test_worker_metrics_report_busy_ratio_tokens_and_staleness():
    wm = WorkerMetrics("trainer", "trainer")
    port = free_port()
    wm.serve(port)
    wm.batch(seconds=0.25, groups=8, tokens=400)
    wm.batch(seconds=0.25, groups=8, tokens=600)
    wm.staleness([0, 0, 1, 2, 5], dropped=1)
    wm.policy_version(7)
    m = scrape(port)
    lbl = (("stage", "trainer"), ("worker", "trainer"))
    assert m[("pipeline_stage_busy_seconds_total", lbl)] == 0.5
    assert m[("pipeline_stage_groups_total", lbl)] == 16
    assert m[("pipeline_stage_tokens_total", lbl)] == 1000
    # 0.5 s busy since the metrics were made, well under a second ago: the ratio is capped at 1.
    assert 0 < m[("pipeline_stage_busy_ratio", lbl)] <= 1
    assert m[("pipeline_tokens_per_second", lbl)] >= 1000 / 60
    assert m[("pipeline_worker_policy_version", lbl)] == 7
    assert m[("pipeline_staleness_versions_bucket", with_le(lbl, "0.0"))] == 2
    assert m[("pipeline_staleness_versions_bucket", with_le(lbl, "1.0"))] == 3
    assert m[("pipeline_staleness_versions_bucket", with_le(lbl, "4.0"))] == 4
    assert m[("pipeline_staleness_versions_count", lbl)] == 5
    assert m[("pipeline_worker_dropped_stale_groups_total", lbl)] == 1
    wm.server.shutdown()


def test_ports_follow_the_base_port_and_go_to_ports_json(tmp_path):
    cfg = load_config(None, {"metrics.base_port": "9400", "cluster.generators": "2", "cluster.verifiers": "3"})
    ports = write_ports(cfg, tmp_path / "ports.json")
    assert ports == {"exporter": 9400, "trainer": 9401, "feeder": 9402, "gen-0": 9403, "gen-1": 9404,
                     "ver-0": 9405, "ver-1": 9406, "ver-2": 9407}
    assert json.loads((tmp_path / "ports.json").read_text())["ports"] == ports
    assert port_for(cfg, "ver-2") == 9407 and port_for(cfg, "someone-else") == 0
    assert worker_ports(load_config(None, {})) == {}
    assert port_for(load_config(None, {"metrics.port": "9555"}), "gen-0") == 9555
    with pytest.raises(ConfigError, match="metrics.base_port"):
        load_config(None, {"metrics.base_port": "22"})


def test_a_busy_port_is_a_clear_error():
    port = free_port()
    first, _ = serve(CollectorRegistry(), port, "127.0.0.1", what="first")
    try:
        with pytest.raises(OSError, match="metrics.base_port/metrics.port: cannot serve second"):
            serve(CollectorRegistry(), port, "127.0.0.1", what="second")
    finally:
        first.shutdown()


def test_exporter_samples_queue_depths_until_stopped(redis_client, redis_url, tmp_path):
    keys = Keys("obs")
    fill_streams(redis_client, keys)
    cfg = load_config(None, {"run_id": "obs", "redis.url": redis_url, "metrics.port": str(free_port()),
                             "metrics.sample_every_s": "0.05"})
    log = setup_logging(None, stage="exporter", worker="exporter")
    assert run_exporter(cfg, redis_client, keys, log, run_dir=tmp_path, max_samples=3) == 3
    lines = [json.loads(x) for x in (tmp_path / "queues.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    assert lines[-1]["queues"]["prompts"] == {"length": 12, "lag": 5, "pending": 5}
    assert lines[-1]["queues"]["dead"]["length"] == 2
    assert lines[-1]["version"] == 4 and lines[-1]["workers"]["gen-0"] == "generating"
    redis_client.set(keys.stop, 1)
    assert run_exporter(cfg, redis_client, keys, log, run_dir=None) == 0


ROOT = Path(__file__).resolve().parents[1]


def exported_sample_names(r, keys) -> set[str]:
    """Every sample name the exporter and a worker serve (``_total``, ``_bucket`` ... included)."""
    fill_streams(r, keys)
    registry = CollectorRegistry()
    registry.register(StreamCollector(r, keys))
    wm = WorkerMetrics("trainer", "trainer")
    names = set()
    for reg in (registry, wm.registry):
        for fam in reg.collect():
            names |= {s.name for s in fam.samples}
    return names


def test_every_grafana_panel_queries_metrics_the_code_exports(redis_client):
    names = exported_sample_names(redis_client, Keys("obs"))
    dash = json.loads((ROOT / "ops" / "grafana" / "pipeline.json").read_text())
    assert dash["panels"] and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("backlog", "pending", "dead letters", "delivery", "idle", "policy version", "staleness",
                  "busy", "tokens per second", "reward", "held-out", "goodput"):
        assert topic in titles, f"no panel about {topic}"
    for panel in dash["panels"]:
        assert {"gridPos", "type", "title", "targets"} <= panel.keys()
        for target in panel["targets"]:
            used = set(re.findall(r"\bpipeline_[a-z_]+", target["expr"]))
            assert used, f"panel {panel['title']!r}: expr names no pipeline metric"
            missing = used - names
            assert not missing, f"panel {panel['title']!r} queries metrics nobody exports: {missing}"


def test_prometheus_config_scrapes_every_port_of_the_default_cluster():
    conf = yaml.safe_load((ROOT / "ops" / "prometheus.yml").read_text())
    targets = {t for job in conf["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    cfg = load_config(None, {"metrics.base_port": "9400"})  # what `make up-cluster` passes
    assert targets == {f"127.0.0.1:{p}" for p in worker_ports(cfg).values()}


def test_a_workers_log_lines_feed_its_metrics(tmp_path):
    cfg = load_config(None, {"metrics.port": str(free_port())})
    log = setup_logging(tmp_path, stage="trainer", worker="trainer")
    log = start_worker_metrics(cfg, "trainer", "trainer", log)
    try:
        log.info("step", version=3, step_seconds=0.5, staleness_hist=[2, 1], groups_stale=1, reward_mean=0.4, tokens=90)
        log.info("evaluated", version=3, heldout_accuracy=0.55)
        log.info("trainer_started", steps=10)
        m = scrape(cfg.metrics.port)
    finally:
        worker_metrics().server.shutdown()
    lbl = (("stage", "trainer"), ("worker", "trainer"))
    assert m[("pipeline_stage_busy_seconds_total", lbl)] == 0.5
    assert m[("pipeline_stage_tokens_total", lbl)] == 90
    assert m[("pipeline_staleness_versions_count", lbl)] == 3
    assert m[("pipeline_staleness_versions_sum", lbl)] == 1
    assert m[("pipeline_worker_dropped_stale_groups_total", lbl)] == 1
    assert m[("pipeline_worker_policy_version", lbl)] == 3
    assert m[("pipeline_worker_reward_mean", lbl)] == 0.4
    assert m[("pipeline_worker_heldout_accuracy_ratio", lbl)] == 0.55
    # The lines still reach the worker's log file, with the stage and worker bound.
    lines = [json.loads(x) for x in (tmp_path / "trainer.jsonl").read_text().splitlines()]
    assert [x["event"] for x in lines] == ["step", "evaluated", "trainer_started"]
    assert all(x["worker"] == "trainer" and x["stage"] == "trainer" for x in lines)


def test_episode_counters_become_a_latency_histogram_and_per_episode_gauges(exporter):
    r, keys, port = exporter
    assert not any(name.startswith("pipeline_env_") for name, _ in scrape(port))  # no episodes: none of them
    r.hset(keys.shard(0).stats, mapping={"episodes_total": 12, "episodes_finished_total": 10, "turns_total": 25,
                                         "env_steps_total": 14, "env_errors_total": 1, "env_step_seconds_total": 0.3,
                                         "tool_calls_total": 8, "tool_calls_ok_total": 6,
                                         "episodes_with_tool_calls_total": 5,
                                         "env_step_seconds_bucket:0.001": 9, "env_step_seconds_bucket:0.05": 4,
                                         "env_step_seconds_bucket:+Inf": 2})
    m = scrape(port)
    assert m[("pipeline_env_turns_per_episode", ())] == 2.5
    assert m[("pipeline_env_tool_call_rate_ratio", ())] == 0.5
    assert m[("pipeline_env_tool_calls_per_episode", ())] == 0.8
    assert m[("pipeline_env_tool_call_success_ratio", ())] == 0.75
    assert m[("pipeline_tool_calls_total", ())] == 8 and m[("pipeline_episodes_finished_total", ())] == 10
    # Cumulative over every bound (empty buckets included), the count is every step attempt.
    bucket = "pipeline_env_step_latency_seconds_bucket"
    assert m[(bucket, (("le", "0.001"),))] == 9 and m[(bucket, (("le", "0.025"),))] == 9
    assert m[(bucket, (("le", "0.05"),))] == 13 and m[(bucket, (("le", "10.0"),))] == 13
    assert m[(bucket, (("le", "+Inf"),))] == 15 == m[("pipeline_env_step_latency_seconds_count", ())]
    assert m[("pipeline_env_step_latency_seconds_sum", ())] == pytest.approx(0.3)
    assert not any(name.startswith("pipeline_env_step_seconds_bucket") for name, _ in m)


def test_the_exporters_queue_samples_carry_the_episode_numbers(redis_client, redis_url, tmp_path):
    keys = Keys("obs")
    fill_streams(redis_client, keys)
    cfg = load_config(None, {"run_id": "obs", "redis.url": redis_url, "metrics.port": "0",
                             "metrics.sample_every_s": "0.01"})
    log = setup_logging(None, stage="exporter", worker="exporter")
    run_exporter(cfg, redis_client, keys, log, run_dir=tmp_path, max_samples=1)
    redis_client.hset(keys.shard(0).stats, mapping={"episodes_total": 4, "episodes_finished_total": 4,
                                                    "turns_total": 6, "tool_calls_total": 2,
                                                    "tool_calls_ok_total": 1, "episodes_with_tool_calls_total": 2})
    run_exporter(cfg, redis_client, keys, log, run_dir=tmp_path, max_samples=1)
    first, second = [json.loads(x) for x in (tmp_path / "queues.jsonl").read_text().splitlines()]
    assert "episodes" not in first
    ep = second["episodes"]
    assert (ep["episodes_finished"], ep["turns_per_episode"], ep["tool_call_rate"], ep["tool_call_success"]) == \
        (4, 1.5, 0.5, 0.5)
    assert ep["env_step_p50_s"] is None and ep["env_step_mean_s"] is None  # no step timed yet
