"""Prometheus metrics: what Redis says about the streams, and what each worker says about itself.

Two sources, two kinds of endpoint:

- **Stream-level** metrics are read from Redis at scrape time (``XINFO STREAM``,
  ``XINFO GROUPS``, ``XINFO CONSUMERS``, ``XPENDING``, the ``{ns}:stats`` counters, the
  trainer's progress hash and the workers' heartbeats) by ``StreamCollector``. One
  process serves them: ``pipeline exporter``, which ``pipeline up`` starts beside the
  stages and which also samples the queue depths into ``<run_dir>/queues.jsonl`` for
  ``pipeline report``.
- **Per-worker** metrics (busy ratio, tokens per second, the trainer's staleness
  histogram, the policy version a worker runs) live in the worker's own process and are
  served on its own port by ``start_worker_metrics``.

With sharded streams (``pipeline.keys``) a stream's shards are merged into one row:
lengths, lags, pending and read counts add up, the oldest pending age is the oldest of
any shard, and a consumer's rows across shards are summed; counters are summed.

Ports: ``metrics.base_port`` + a fixed offset per worker (``worker_ports``): the
exporter, then the trainer, the feeder, the generators and the verifiers. 0 disables
serving; the numbers are still kept, so the loops never branch on "is metrics on?".

Names follow Prometheus and redis_exporter conventions: ``_total`` counters,
``_seconds`` durations, ``_ratio`` fractions, labels only of low cardinality (stream,
group, consumer, stage, worker).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterator

import redis
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pipeline.bus.flow import stop_requested
from pipeline.keys import Keys
from pipeline.bus.stats import read_stats
from pipeline.envs.base import ENV_MEMBER_COUNTERS, ENV_STEP_BUCKET, ENV_STEP_BUCKETS, env_members
from pipeline.verifiers.base import VERIFIER_COMPLETIONS, VERIFIER_SECONDS, verifier_costs
from pipeline.bus.streams import group_lag

DELIVERY_BUCKETS = (1, 2, 3, 5, 10)
"""Upper bounds of the pending entries' delivery-count histogram (then +Inf)."""
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 8)
"""Upper bounds, in policy versions, of the trainer's staleness histogram (then +Inf)."""
PENDING_SAMPLE = 1000
"""Most pending entries per group whose delivery counts are read at one scrape (XPENDING COUNT)."""
WINDOW_S = 60.0
"""Window of the busy ratio and the tokens-per-second gauges, seconds."""

TRAINER_GAUGES = {
    "version": ("pipeline_policy_version", "Latest policy version the trainer published (optimizer steps applied)."),
    "steps": ("pipeline_trainer_steps_target", "Optimizer steps the trainer is configured to run."),
    "reward_mean": ("pipeline_reward_mean", "Mean reward of the completions in the last training step."),
    "sample_accuracy": ("pipeline_sample_accuracy_ratio",
                        "Hidden accuracy of the sampled answers in the last training step (never used as reward)."),
    "eval_accuracy": ("pipeline_heldout_accuracy_ratio", "Greedy accuracy on the held-out problems at the last evaluation."),
    "base_accuracy": ("pipeline_base_heldout_accuracy_ratio", "Greedy held-out accuracy of the base model."),
}


# ----------------------------------------------------------------------------- ports


def worker_ports(cfg) -> dict[str, int]:
    """Worker name -> port for ``pipeline up``'s workers; {} when ``metrics.base_port`` is 0."""
    base = cfg.metrics.base_port
    if not base:
        return {}
    names = ["exporter", "trainer", "feeder"]
    names += [f"gen-{i}" for i in range(cfg.cluster.generators)]
    names += [f"ver-{i}" for i in range(cfg.cluster.verifiers)]
    return {name: base + i for i, name in enumerate(names)}


def port_for(cfg, worker: str) -> int:
    """The port ``worker`` serves on: ``metrics.port`` if set, else its slot above the base port, else 0."""
    return cfg.metrics.port or worker_ports(cfg).get(worker, 0)


def write_ports(cfg, path: Path) -> dict[str, int]:
    """Write ``{worker: port}`` (and the host) to ``path``, e.g. ``runs/<id>/ports.json``."""
    ports = worker_ports(cfg)
    path.write_text(json.dumps({"host": cfg.metrics.host, "ports": ports}, indent=2))
    return ports


# ----------------------------------------------------------------------------- snapshot


def _id_ms(entry_id: bytes | str) -> int:
    s = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(s.split("-", 1)[0])


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _number(v: Any) -> float | str:
    s = _text(v)
    try:
        return float(s)
    except ValueError:
        return s


def _stream_row(r: redis.Redis, name: str, key: str, group: str | None, now_ms: int) -> dict:
    row: dict[str, Any] = {"stream": name, "key": key, "exists": False, "length": 0, "entries_added": 0,
                           "groups": []}
    try:
        info = r.xinfo_stream(key)
    except redis.ResponseError:
        return row  # not created yet
    row.update(exists=True, length=int(info["length"]), entries_added=int(info.get("entries-added") or info["length"]))
    for g in r.xinfo_groups(key):
        gname = _text(g["name"])
        if group is not None and gname != group:
            continue
        summary = r.xpending(key, gname)
        oldest = summary.get("min")
        counts = [int(p["times_delivered"]) for p in
                  r.xpending_range(key, gname, min="-", max="+", count=PENDING_SAMPLE)] if summary["pending"] else []
        row["groups"].append({
            "group": gname,
            "consumers": int(g["consumers"]),
            "pending": int(g["pending"]),
            "lag": group_lag(r, key, g),
            "entries_read": int(g.get("entries-read") or 0),
            "last_delivered_id": _text(g["last-delivered-id"]),
            "oldest_pending_id": _text(oldest) if oldest else None,
            # Age of the oldest unacked entry, from its id's millisecond time and the server's clock.
            "oldest_pending_age_s": max(0.0, (now_ms - _id_ms(oldest)) / 1000) if oldest else 0.0,
            "delivery_counts": counts,
            "consumer_rows": [{"consumer": _text(c["name"]), "pending": int(c["pending"]),
                               "idle_s": int(c["idle"]) / 1000} for c in r.xinfo_consumers(key, gname)],
        })
    return row


def _merge_rows(rows: list[dict]) -> dict:
    """One stream's rows over its shards, as one row (the first shard's key names it)."""
    if len(rows) == 1:
        return rows[0]
    out = {**rows[0], "exists": any(x["exists"] for x in rows), "length": sum(x["length"] for x in rows),
           "entries_added": sum(x["entries_added"] for x in rows), "groups": []}
    by_group: dict[str, dict] = {}
    for row in rows:
        for g in row["groups"]:
            m = by_group.get(g["group"])
            if m is None:
                by_group[g["group"]] = {**g, "delivery_counts": list(g["delivery_counts"]),
                                        "consumer_rows": [dict(c) for c in g["consumer_rows"]]}
                out["groups"].append(by_group[g["group"]])
                continue
            for f in ("pending", "lag", "entries_read"):
                m[f] += g[f]
            m["consumers"] = max(m["consumers"], g["consumers"])
            if g["oldest_pending_age_s"] > m["oldest_pending_age_s"]:
                m["oldest_pending_age_s"], m["oldest_pending_id"] = g["oldest_pending_age_s"], g["oldest_pending_id"]
            m["delivery_counts"] += g["delivery_counts"]
            known = {c["consumer"]: c for c in m["consumer_rows"]}
            for c in g["consumer_rows"]:
                if c["consumer"] in known:
                    known[c["consumer"]]["pending"] += c["pending"]
                    known[c["consumer"]]["idle_s"] = min(known[c["consumer"]]["idle_s"], c["idle_s"])
                else:
                    m["consumer_rows"].append(dict(c))
    return out


def snapshot(r: redis.Redis, keys: Keys) -> dict:
    """Everything the exporter, ``pipeline top`` and the dashboard show, read from Redis now.

    Plain JSON-able data: streams (with their consumer groups and consumers), the dead
    letters, the ``{ns}:stats`` counters, the trainer's progress and worker heartbeats.
    Times come from the server's clock so ages do not depend on the reader's.
    """
    t = r.time()
    if isinstance(t, dict):  # a cluster client asks every node; any clock will do
        t = next(iter(t.values()))
    sec, usec = t
    now_ms = sec * 1000 + usec // 1000
    shards = keys.all_shards()
    streams = [_merge_rows([_stream_row(r, name, getattr(s, name), group, now_ms) for s in shards])
               for name, (_, group) in shards[0].streams().items()]
    streams.append(_merge_rows([_stream_row(r, "dead", s.dead, None, now_ms) for s in shards]))
    stats = read_stats(r, keys)
    trainer = {_text(k): _number(v) for k, v in r.hgetall(keys.trainer).items()}
    workers = []
    for wid, raw in sorted(r.hgetall(keys.workers).items()):
        try:
            beat = json.loads(raw)
        except ValueError:
            continue  # a malformed heartbeat is not worth failing a scrape over
        beat["worker"] = _text(wid)
        beat["age_s"] = max(0.0, now_ms / 1000 - float(beat.get("at", 0)))
        workers.append(beat)
    generated = stats.get("tokens_generated_total", 0.0)
    return {
        "ns": keys.ns, "time": now_ms / 1000, "streams": streams, "stats": stats, "trainer": trainer,
        "workers": workers,
        "goodput": stats.get("tokens_trained_total", 0.0) / generated if generated else 0.0,
        "episodes": episode_summary(stats),
    }


def step_histogram(stats: dict[str, float]) -> list[tuple[float, float]]:
    """The environment step latency histogram in ``stats``: (upper bound in seconds, cumulative
    count) per bucket, ``inf`` last; [] when no step was timed."""
    counts: dict[float, float] = {}
    for k, v in stats.items():
        if k.startswith(ENV_STEP_BUCKET):
            counts[float(k[len(ENV_STEP_BUCKET):])] = v
    if not counts:
        return []
    out, total = [], 0.0
    for bound in sorted({*ENV_STEP_BUCKETS, *counts, float("inf")}):  # every bucket, empty ones too
        total += counts.get(bound, 0.0)
        out.append((bound, total))
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a cumulative histogram, interpolated linearly inside its bucket (as
    Prometheus' ``histogram_quantile``: a quantile in the +Inf bucket is the highest finite bound);
    None when it is empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lo, below = 0.0, 0.0
    for bound, cum in buckets:
        if cum >= rank and cum > below:
            if bound == float("inf"):
                return lo
            return lo + (bound - lo) * (rank - below) / (cum - below)
        lo, below = (bound if bound != float("inf") else lo), cum
    return lo


def episode_summary(stats: dict[str, float]) -> dict | None:
    """The multi-turn episode numbers of a run's counters (docs/observing.md, "Episodes"), or None
    for a run without episodes: what ``pipeline top``, the dashboard and the exporter's gauges show.

    Per-episode numbers are over finished episodes (``episodes_finished_total``: their groups
    were emitted); the step latency is over every step attempt (answered, raised or timed out)."""
    started = stats.get("episodes_total", 0.0)
    if not started:
        return None
    done = stats.get("episodes_finished_total", 0.0)
    per = done or started  # counters written before episodes_finished_total existed: the started ones
    steps, errors = stats.get("env_steps_total", 0.0), stats.get("env_errors_total", 0.0)
    calls, ok = stats.get("tool_calls_total", 0.0), stats.get("tool_calls_ok_total", 0.0)
    hist = step_histogram(stats)
    members = env_members(stats)  # a mixture's members (env.kind = "mix:..."), each on its own
    return {
        **({"environments": members} if members else {}),
        "episodes": started, "episodes_finished": done,
        "turns_per_episode": stats.get("turns_total", 0.0) / per,
        "turns_cut": stats.get("env_turns_cut_total", 0.0),
        "env_steps": steps, "env_errors": errors,
        "env_step_mean_s": stats.get("env_step_seconds_total", 0.0) / (steps + errors) if steps + errors else None,
        "env_step_p50_s": histogram_quantile(0.5, hist), "env_step_p95_s": histogram_quantile(0.95, hist),
        "tool_calls": calls, "tool_calls_ok": ok,
        "tool_parse_errors": stats.get("env_tool_parse_errors_total", 0.0),
        "episodes_with_tool_calls": stats.get("episodes_with_tool_calls_total", 0.0),
        "tool_call_rate": stats.get("episodes_with_tool_calls_total", 0.0) / done if done else None,
        "tool_calls_per_episode": calls / done if done else None,
        "tool_call_success": ok / calls if calls else None,
    }


def queue_rows(snap: dict) -> dict[str, dict[str, int]]:
    """Per stream: length, lag and pending of its (first) group: the shape ``queues.jsonl`` records."""
    out = {}
    for s in snap["streams"]:
        g = s["groups"][0] if s["groups"] else {"lag": 0, "pending": 0}
        out[s["stream"]] = {"length": s["length"], "lag": g["lag"], "pending": g["pending"]}
    return out


# ----------------------------------------------------------------------------- stream collector


def _delivery_histogram(counts: list[int]) -> tuple[list[tuple[str, float]], float]:
    buckets = [(floatToGoString(b), float(sum(1 for c in counts if c <= b))) for b in DELIVERY_BUCKETS]
    buckets.append(("+Inf", float(len(counts))))
    return buckets, float(sum(counts))


class StreamCollector:
    """A Prometheus collector that reads the streams' state from Redis at every scrape."""

    def __init__(self, r: redis.Redis, keys: Keys):
        self.r, self.keys = r, keys

    def describe(self) -> list:
        return []  # metrics are dynamic; registering must not trigger a Redis read

    def collect(self) -> Iterator:
        snap = snapshot(self.r, self.keys)
        yield from families(snap)


def families(snap: dict) -> Iterator:
    """The metric families of one snapshot (pure, so a test can check them without HTTP)."""
    length = GaugeMetricFamily("pipeline_stream_length", "Entries in the stream (XLEN).", labels=["stream"])
    added = CounterMetricFamily("pipeline_stream_entries_added", "Entries ever added to the stream (XINFO STREAM entries-added).",
                                labels=["stream"])
    lag = GaugeMetricFamily("pipeline_stream_group_lag", "Entries not yet delivered to the group (XINFO GROUPS lag).",
                            labels=["stream", "group"])
    pending = GaugeMetricFamily("pipeline_stream_group_pending", "Entries delivered to the group but not acked (PEL size).",
                                labels=["stream", "group"])
    read = CounterMetricFamily("pipeline_stream_group_entries_read", "Entries the group has read (XINFO GROUPS entries-read).",
                               labels=["stream", "group"])
    consumers = GaugeMetricFamily("pipeline_stream_group_consumers", "Consumers known to the group.", labels=["stream", "group"])
    age = GaugeMetricFamily("pipeline_stream_oldest_pending_age_seconds",
                            "Age of the group's oldest unacked entry, from its id and the server clock.",
                            labels=["stream", "group"])
    deliveries = HistogramMetricFamily(
        "pipeline_stream_pending_delivery_count",
        f"Delivery counts of the group's pending entries (XPENDING, first {PENDING_SAMPLE}).", labels=["stream", "group"])
    c_pending = GaugeMetricFamily("pipeline_stream_consumer_pending", "Entries pending for one consumer.",
                                  labels=["stream", "group", "consumer"])
    c_idle = GaugeMetricFamily("pipeline_stream_consumer_idle_seconds", "Seconds since the consumer last read or claimed.",
                               labels=["stream", "group", "consumer"])
    for s in snap["streams"]:
        length.add_metric([s["stream"]], s["length"])
        added.add_metric([s["stream"]], s["entries_added"])
        for g in s["groups"]:
            lbl = [s["stream"], g["group"]]
            lag.add_metric(lbl, g["lag"])
            pending.add_metric(lbl, g["pending"])
            read.add_metric(lbl, g["entries_read"])
            consumers.add_metric(lbl, g["consumers"])
            age.add_metric(lbl, g["oldest_pending_age_s"])
            buckets, total = _delivery_histogram(g["delivery_counts"])
            deliveries.add_metric(lbl, buckets, total)
            for c in g["consumer_rows"]:
                c_pending.add_metric(lbl + [c["consumer"]], c["pending"])
                c_idle.add_metric(lbl + [c["consumer"]], c["idle_s"])
    yield from (length, added, lag, pending, read, consumers, age, deliveries, c_pending, c_idle)

    dead = next(s for s in snap["streams"] if s["stream"] == "dead")
    dl = GaugeMetricFamily("pipeline_dead_letter_stream_length", "Entries in the dead-letter stream.")
    dl.add_metric([], dead["length"])
    yield dl
    # Every {ns}:stats counter (dead_letters_total, dropped_stale_total, tokens_generated_total, ...),
    # but the step latency buckets (one histogram) and the per-verifier counters (labelled).
    stats = {k: v for k, v in snap["stats"].items()
             if not k.startswith((ENV_STEP_BUCKET, VERIFIER_SECONDS, VERIFIER_COMPLETIONS, *ENV_MEMBER_COUNTERS))}
    costs = verifier_costs(snap["stats"])
    for metric, field, doc in (("pipeline_verifier_seconds", "seconds", "Seconds the verifier stage spent on it."),
                               ("pipeline_verifier_completions", "completions", "Completions it scored.")):
        c = CounterMetricFamily(metric, f"Per weak verifier: {doc}", labels=["verifier"])
        for name, row in costs.items():
            c.add_metric([name], row[field])
        yield c
    stats.setdefault("dead_letters_total", 0.0)
    stats.setdefault("dropped_stale_total", 0.0)
    for name, value in sorted(stats.items()):
        base = name.removesuffix("_total")
        c = CounterMetricFamily(f"pipeline_{base}", f"Pipeline counter {base} ({{ns}}:stats).")
        c.add_metric([], value)
        yield c
    goodput = GaugeMetricFamily("pipeline_goodput_ratio", "Tokens trained / tokens generated so far.")
    goodput.add_metric([], snap["goodput"])
    yield goodput
    yield from episode_families(snap)
    for field, (metric, doc) in TRAINER_GAUGES.items():
        value = snap["trainer"].get(field)
        if isinstance(value, float):
            g = GaugeMetricFamily(metric, doc)
            g.add_metric([], value)
            yield g
    age = GaugeMetricFamily("pipeline_worker_heartbeat_age_seconds", "Seconds since the worker's last heartbeat.",
                            labels=["worker", "stage"])
    state = GaugeMetricFamily("pipeline_worker_state", "1 for the worker's current state (from its heartbeat).",
                              labels=["worker", "stage", "state"])
    for w in snap["workers"]:
        age.add_metric([w["worker"], str(w.get("stage", ""))], w["age_s"])
        state.add_metric([w["worker"], str(w.get("stage", "")), str(w.get("state", ""))], 1)
    yield age
    yield state


EPISODE_GAUGES = {
    "turns_per_episode": ("pipeline_env_turns_per_episode", "Model turns per finished episode."),
    "tool_call_rate": ("pipeline_env_tool_call_rate_ratio", "Share of finished episodes with at least one tool call."),
    "tool_calls_per_episode": ("pipeline_env_tool_calls_per_episode", "Tool calls per finished episode."),
    "tool_call_success": ("pipeline_env_tool_call_success_ratio",
                          "Share of tool calls the environment answered (not malformed, not failed)."),
}


ENV_MEMBER_FAMILIES = {
    "episodes": ("pipeline_env_member_episodes", "Per environment of a mixture: episodes started."),
    "errors": ("pipeline_env_member_errors", "Per environment of a mixture: failed resets and steps."),
    "finished": ("pipeline_env_member_finished", "Per environment of a mixture: episodes finished (emitted)."),
    "reward": ("pipeline_env_member_reward", "Per environment of a mixture: the sum of its finished episodes' "
                                             "environment rewards (none given counts 0)."),
}


def episode_families(snap: dict) -> Iterator:
    """Multi-turn episodes (only for a run with some): the step latency histogram and the
    per-episode gauges of ``episode_summary``. The counters themselves come with every other
    ``{ns}:stats`` counter (``pipeline_episodes_finished_total``, ``pipeline_tool_calls_total``, ...)."""
    summary = snap.get("episodes")
    if not summary:
        return
    hist = step_histogram(snap["stats"])
    if hist:
        h = HistogramMetricFamily("pipeline_env_step_latency_seconds",
                                  "Environment step attempts by latency (answered, raised or timed out).")
        h.add_metric([], [(floatToGoString(b), c) for b, c in hist], snap["stats"].get("env_step_seconds_total", 0.0))
        yield h
    for field, (metric, doc) in EPISODE_GAUGES.items():
        if summary.get(field) is not None:
            g = GaugeMetricFamily(metric, doc)
            g.add_metric([], summary[field])
            yield g
    members = summary.get("environments")
    if members:  # a mixture: its members' counters, labelled by the member's env.kind
        for field, (metric, doc) in ENV_MEMBER_FAMILIES.items():
            c = CounterMetricFamily(metric, doc, labels=["env"])
            for name, row in members.items():
                c.add_metric([name], row[field])
            yield c


# ----------------------------------------------------------------------------- per-worker metrics


class _Window:
    """Busy seconds and tokens of the batches that ended within the last ``WINDOW_S`` seconds."""

    def __init__(self, started: float):
        self.started = started
        self.spans: deque[tuple[float, float, int]] = deque()  # (end time, busy seconds, tokens)
        self.lock = threading.Lock()

    def add(self, busy_s: float, tokens: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.spans.append((now, busy_s, tokens))
            while self.spans and self.spans[0][0] < now - WINDOW_S:
                self.spans.popleft()

    def _recent(self) -> tuple[float, float, int]:
        now = time.monotonic()
        span = max(1e-9, min(WINDOW_S, now - self.started))
        with self.lock:
            recent = [s for s in self.spans if s[0] >= now - WINDOW_S]
        return span, sum(s[1] for s in recent), sum(s[2] for s in recent)

    def busy_ratio(self) -> float:
        span, busy, _ = self._recent()
        return min(1.0, busy / span)

    def tokens_per_second(self) -> float:
        span, _, tokens = self._recent()
        return tokens / span


class WorkerMetrics:
    """One worker process's own metrics, in its own registry; served only if ``serve`` is called."""

    def __init__(self, stage: str, worker: str):
        self.stage, self.worker = stage, worker
        self.registry = CollectorRegistry()
        self._window = _Window(time.monotonic())
        lbl = {"stage": stage, "worker": worker}
        names = ["stage", "worker"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry).labels(**lbl)

        self._busy = Counter("pipeline_stage_busy_seconds", "Seconds spent processing batches.", names,
                             registry=self.registry).labels(**lbl)
        self._batches = Counter("pipeline_stage_batches", "Batches processed.", names, registry=self.registry).labels(**lbl)
        self._items = Counter("pipeline_stage_groups", "Groups processed (generated, scored or consumed).", names,
                              registry=self.registry).labels(**lbl)
        self._tokens = Counter("pipeline_stage_tokens", "Tokens processed (generated or trained).", names,
                               registry=self.registry).labels(**lbl)
        gauge("pipeline_stage_busy_ratio", f"Share of the last {WINDOW_S:.0f} s spent processing.").set_function(
            self._window.busy_ratio)
        gauge("pipeline_tokens_per_second", f"Tokens processed per second over the last {WINDOW_S:.0f} s.").set_function(
            self._window.tokens_per_second)
        self._version = gauge("pipeline_worker_policy_version", "Policy version this worker runs (generators) or trained.")
        self._staleness = Histogram("pipeline_staleness_versions",
                                    "Trainer: policy versions between a consumed group's oldest version and the trainer's.",
                                    names, buckets=STALENESS_BUCKETS, registry=self.registry).labels(**lbl)
        self._stale = Counter("pipeline_worker_dropped_stale_groups", "Trainer: groups dropped as too stale.", names,
                              registry=self.registry).labels(**lbl)
        self._reward = gauge("pipeline_worker_reward_mean", "Trainer: mean reward of the last step.")
        self._accuracy = gauge("pipeline_worker_heldout_accuracy_ratio", "Trainer: held-out accuracy at the last evaluation.")
        self.server = None

    def batch(self, *, seconds: float, groups: int, tokens: int = 0) -> None:
        """Record one processed batch: busy seconds, groups and tokens."""
        self._busy.inc(seconds)
        self._batches.inc()
        self._items.inc(groups)
        self._tokens.inc(tokens)
        self._window.add(seconds, tokens)

    def policy_version(self, version: int) -> None:
        self._version.set(version)

    def staleness(self, values: list[int], *, dropped: int = 0) -> None:
        """Trainer: the staleness of each consumed group, and how many were dropped as too stale."""
        for v in values:
            self._staleness.observe(v)
        self._stale.inc(dropped)

    def reward(self, mean: float) -> None:
        self._reward.set(mean)

    def heldout_accuracy(self, accuracy: float) -> None:
        self._accuracy.set(accuracy)

    def observe_event(self, event: dict) -> None:
        """Feed the metrics from a worker's own log lines (the events that mark finished work)."""
        name = event.get("event")
        if name in ("batch_generated", "batch_scored"):
            self.batch(seconds=float(event.get("seconds", 0.0)), groups=int(event.get("groups", 0)),
                       tokens=int(event.get("tokens", 0)))
            if "version" in event:
                self.policy_version(int(event["version"]))
        elif name == "step" and "step_seconds" in event:
            hist = event.get("staleness_hist", [])
            self.batch(seconds=float(event["step_seconds"]), groups=int(sum(hist)), tokens=int(event.get("tokens", 0)))
            self.staleness([v for v, n in enumerate(hist) for _ in range(int(n))],
                           dropped=int(event.get("groups_stale", 0)))
            self.policy_version(int(event["version"]))
            self.reward(float(event.get("reward_mean", 0.0)))
        elif name == "evaluated" and "heldout_accuracy" in event:
            self.heldout_accuracy(float(event["heldout_accuracy"]))

    def _processor(self, logger, method_name: str, event: dict) -> dict:
        self.observe_event(event)
        return event

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread."""
        self.server, _ = serve(self.registry, port, host, what=f"{self.worker} metrics")


def serve(registry: CollectorRegistry, port: int, host: str, *, what: str):
    try:
        return start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise OSError(f"metrics.base_port/metrics.port: cannot serve {what} on {host}:{port}: {e}") from e


_current = WorkerMetrics(stage="", worker="")


def worker_metrics() -> WorkerMetrics:
    """This process's worker metrics (a do-nothing-visible instance until ``start_worker_metrics``)."""
    return _current


def start_worker_metrics(cfg, stage: str, worker: str, log):
    """Make this process's worker metrics, serve them if its port (``port_for``) is not 0, and
    return ``log`` rebound so every line it writes also feeds them (``WorkerMetrics.observe_event``).

    The stages already log each finished batch with its duration and size, so the metrics
    hook into logging, like a middleware, rather than into every stage's loop.
    """
    global _current
    _current = WorkerMetrics(stage, worker)
    port = port_for(cfg, worker)
    if port:
        _current.serve(port, cfg.metrics.host)
    structlog.configure(processors=[_current._processor, *structlog.get_config()["processors"]])
    return structlog.get_logger().bind(**structlog.get_context(log))


# ----------------------------------------------------------------------------- the exporter process


def run_exporter(cfg, r: redis.Redis, keys: Keys, log, *, run_dir: Path | None = None,
                 max_samples: int | None = None) -> int:
    """Serve the stream collector and sample the queues into ``<run_dir>/queues.jsonl``.

    consumes:     nothing (reads XINFO/XPENDING, stats, heartbeats at each scrape and sample)
    produces:     ``/metrics`` on ``port_for(cfg, "exporter")``; one queues.jsonl line per sample
                  (with ``episodes``, ``episode_summary``, in a run with multi-turn episodes)
    waits for:    ``metrics.sample_every_s`` between samples
    unblocked by: the stop key (checked every sample), or ``max_samples``
    """
    registry = CollectorRegistry()
    registry.register(StreamCollector(r, keys))
    port = port_for(cfg, "exporter")
    server = serve(registry, port, cfg.metrics.host, what="the stream exporter")[0] if port else None
    out = open(run_dir / "queues.jsonl", "a", buffering=1) if run_dir is not None else None
    log.info("exporter_started", port=port, samples_to=str(run_dir / "queues.jsonl") if out else None)
    samples = 0
    try:
        while not stop_requested(r, keys) and (max_samples is None or samples < max_samples):
            snap = snapshot(r, keys)
            if out is not None:
                row = {"time": snap["time"], "version": snap["trainer"].get("version", 0), "queues": queue_rows(snap),
                       "workers": {w["worker"]: w.get("state", "") for w in snap["workers"]}}
                if snap["episodes"]:  # the run-wide episode numbers, for the report
                    row["episodes"] = snap["episodes"]
                out.write(json.dumps(row) + "\n")
            samples += 1
            if max_samples is None or samples < max_samples:
                time.sleep(cfg.metrics.sample_every_s)
    finally:
        if out is not None:
            out.close()
        if server is not None:
            server.shutdown()
            server.server_close()
    log.info("exporter_stopped", samples=samples)
    return samples
