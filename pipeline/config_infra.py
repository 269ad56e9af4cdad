"""Config sections of the infrastructure: the Redis server, what ``pipeline up`` starts,
fault injection, experiment trackers and metrics endpoints."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.config_base import Section, check as _check, choices


Appendfsync = Literal["always", "everysec", "no"]
StageKind = Literal["generator", "verifier", "trainer", "feeder"]
FaultKind = Literal["kill", "pause", "redis", "term", "env"]
TrackerName = Literal["tensorboard", "wandb"]
WandbMode = Literal["offline", "online", "disabled"]


@dataclass(frozen=True, kw_only=True)
class RedisConfig(Section):
    url: str = ""
    """Redis URL (``redis://``, ``rediss://``). Empty: ``$REDIS_URL``, else a local server started for the run."""
    appendfsync: Appendfsync = "everysec"
    """AOF fsync policy of a server we start: ``everysec`` (loses <= ~1 s on a crash) or ``always``."""
    block_ms: int = 1000
    """Longest a blocking stream read waits before the loop re-checks its stop conditions, ms."""
    claim_idle_ms: int = 30_000
    """An entry a consumer has held unacked this long is presumed abandoned (its consumer
    died or hangs) and another consumer of the group takes it over with XAUTOCLAIM. Must
    exceed the longest batch a stage works on. 0 disables reclaiming."""
    max_deliveries: int = 5
    """An entry delivered more times than this without an ack is moved to ``{ns}:dead``
    with its reason: it crashes whoever takes it, or its consumers keep dying."""
    max_stream_lag: int = 4096
    """Backpressure: a producer waits (state ``backpressure`` in its heartbeat, counted in
    ``{ns}:stats``) while the stream it writes holds more than this many entries its
    consumers have not acked, instead of growing Redis memory until writes are refused."""
    trim_acked: bool = True
    """Consumers trim their input stream of entries every consumer group has acked
    (XTRIM MINID below the oldest pending or undelivered entry), keeping memory flat."""
    username_env: str = "REDIS_USERNAME"
    """Environment variable holding the ACL user name (used with password_env when the URL has no credentials)."""
    password_env: str = "REDIS_PASSWORD"
    """Environment variable holding the password (AUTH/ACL) when the URL carries none; keeps it out of config files."""
    tls_ca_file: str = ""
    """``rediss://`` only: CA bundle that signed the server's certificate (empty: the system CAs)."""
    tls_cert_file: str = ""
    """``rediss://`` only: client certificate, for servers that require mutual TLS."""
    tls_key_file: str = ""
    """``rediss://`` only: the client certificate's private key."""
    shards: int = 1
    """Shards per stream (S): each of prompts, rollouts and scored is split into S streams,
    with their dead letters, ledger and counters beside them (``pipeline.keys``); prompts are
    routed by a hash of their id. 1 keeps every key's plain name on a single server."""
    cluster: bool = False
    """Connect to a Redis Cluster (``redis.cluster.RedisCluster``) through the node at ``url``;
    keys then carry hash tags so each shard's keys share one slot. ``pipeline up`` without a
    URL starts a local three-master cluster for the run."""
    worker_retries: int = -1
    """Retries of a stage worker's calls while the server is unreachable, its first
    connection included, with capped backoff, each outage logged (``redis_unreachable``,
    then ``redis_reachable`` with how long it lasted). -1: forever, so an outage of any
    length is ridden out and a worker started during one waits for the server; N >= 0:
    give up after N and exit with code 3. The driver and one-shot commands keep a short
    budget (about 10 s) whatever this says."""

    def _validate(self, p: str) -> None:
        _check(self.worker_retries >= -1, f"{p}.worker_retries", ">= -1 (-1: forever)", self.worker_retries)
        _check(10 <= self.block_ms <= 60_000, f"{p}.block_ms", "in [10, 60000]", self.block_ms)
        _check(self.claim_idle_ms == 0 or self.claim_idle_ms >= 100, f"{p}.claim_idle_ms",
               "0 (off) or >= 100", self.claim_idle_ms)
        _check(self.max_deliveries >= 1, f"{p}.max_deliveries", ">= 1", self.max_deliveries)
        _check(self.max_stream_lag >= 1, f"{p}.max_stream_lag", ">= 1", self.max_stream_lag)
        _check(not self.url or self.url.startswith(("redis://", "rediss://", "unix://")), f"{p}.url",
               "a redis://, rediss:// or unix:// URL", self.url)
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            value = getattr(self, name)
            _check(not value or Path(value).is_file(), f"{p}.{name}", "empty or an existing file", value)
        _check(1 <= self.shards <= 1024, f"{p}.shards", "in [1, 1024]", self.shards)
        _check(not (self.cluster and self.url.startswith("unix://")), f"{p}.url",
               "a redis:// or rediss:// URL of one cluster node when redis.cluster is on", self.url)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig(Section):
    generators: int = 2
    """Generator processes ``pipeline up`` starts."""
    verifiers: int = 2
    """Verifier processes ``pipeline up`` starts."""
    progress_every_s: float = 3.0
    """Seconds between live progress lines."""
    timeout_s: float = 1800.0
    """Give up (and stop everything) if the trainer has not finished by then."""
    restart_backoff_s: float = 1.0
    """Wait before restarting a worker that exited; doubles with each restart in a row without
    progress (per worker), up to restart_backoff_max_s. Progress (a step committed, a batch
    emitted), a death by an outside signal (SIGKILL, SIGTERM) and a step that failed on its
    entries start the next wait at restart_backoff_s again."""
    restart_backoff_max_s: float = 30.0
    """The longest wait before a restart."""
    restart_reset_s: float = 60.0
    """For a worker whose progress the driver cannot see (the feeder, the exporter, the server
    down): one that stayed up this long before exiting starts again at restart_backoff_s."""
    crash_loop_exits: int = 5
    """A worker that exits with a non-zero code within crash_loop_uptime_s of starting this
    many times in a row is crash-looping: reported (its last lines, its heartbeat state
    ``crash_loop``) and still restarted, except the trainer, whose crash loop ends the run.
    A death by a signal (SIGKILL, an OOM kill) is a restart, never part of a crash loop."""
    crash_loop_uptime_s: float = 30.0
    """An exit this soon after the start counts toward a crash loop (a worker's start imports
    torch and loads its model: seconds on an idle host, more while every worker starts at once)."""
    max_restarts_per_hour: int = 0
    """Restarts of all workers together allowed in any hour; one more ends the run. 0: unlimited."""
    evaluators: int = 0
    """Eval workers ``pipeline up`` starts beside training (0 or 1): each follows the published
    versions and writes greedy accuracy and pass@k per version ([eval], ``<run>/evals.jsonl``)."""

    def _validate(self, p: str) -> None:
        _check(self.generators >= 1, f"{p}.generators", ">= 1", self.generators)
        _check(self.evaluators in (0, 1), f"{p}.evaluators", "0 (off) or 1", self.evaluators)
        _check(self.restart_backoff_s >= 0, f"{p}.restart_backoff_s", ">= 0", self.restart_backoff_s)
        _check(self.restart_backoff_max_s >= self.restart_backoff_s, f"{p}.restart_backoff_max_s",
               ">= restart_backoff_s", self.restart_backoff_max_s)
        _check(self.restart_reset_s > 0, f"{p}.restart_reset_s", "> 0", self.restart_reset_s)
        _check(self.crash_loop_exits >= 1, f"{p}.crash_loop_exits", ">= 1", self.crash_loop_exits)
        _check(self.crash_loop_uptime_s > 0, f"{p}.crash_loop_uptime_s", "> 0", self.crash_loop_uptime_s)
        _check(self.max_restarts_per_hour >= 0, f"{p}.max_restarts_per_hour", ">= 0 (0: unlimited)",
               self.max_restarts_per_hour)
        _check(self.verifiers >= 1, f"{p}.verifiers", ">= 1", self.verifiers)
        _check(self.progress_every_s > 0, f"{p}.progress_every_s", "> 0", self.progress_every_s)
        _check(self.timeout_s > 0, f"{p}.timeout_s", "> 0", self.timeout_s)


@dataclass(frozen=True, kw_only=True)
class ChaosConfig(Section):
    """Fault injection by ``pipeline inject``, which ``pipeline chaos`` / ``make chaos`` start
    beside the run (``pipeline up`` leaves it off). See pipeline.run.chaos."""

    min_gap_s: float = 4.0
    """Seconds between two faults: uniform in [min_gap_s, max_gap_s], from the first training step."""
    max_gap_s: float = 10.0
    """See min_gap_s."""
    kinds: tuple[FaultKind, ...] = ("kill", "pause", "redis")
    """What a random fault does, drawn uniformly: ``kill`` (SIGKILL of a worker's process
    group), ``pause`` (SIGSTOP of it for pause_s, then SIGCONT), ``redis`` (SIGKILL of the
    server, which the driver starts again on its port and data), ``term`` (SIGTERM of a
    worker: its graceful stop, then a restart), ``env`` (SIGKILL of one environment server
    a generator started for ``env.kind = "openenv:<app>"``, which its generator starts
    again; a generator, then one of its servers that are up; ``targets`` does not apply)."""
    targets: tuple[StageKind, ...] = ("generator", "verifier", "trainer", "feeder")
    """Stage kinds a kill or a pause picks from (``generator``, ``verifier``, ``trainer``,
    ``feeder``): a kind uniformly, then one of its workers."""
    pause_s: float = 8.0
    """How long a paused worker stays stopped."""
    schedule: tuple[str, ...] = ()
    """Fixed fault sequence instead of random picks: worker names to kill (``gen-0``,
    ``ver-1``, ``trainer``, ``feeder``), ``pause:<worker>``, ``term:<worker>``, ``redis``, and
    ``env:<generator>`` (SIGKILL of one of that generator's environment servers, once one is
    up). Fault k of n comes once the policy reaches version k·steps/(n+2), so the faults land
    mid-run however fast the machine is."""
    seed: int = 0
    """Seed of the fault sequence."""
    max_faults: int = 0
    """Stop injecting after this many faults (0: until the trainer finishes)."""
    load: int = 0
    """CPU burners the injector runs beside the run, at normal priority, from its start to its
    end: the faults land on a loaded host, as on a production one (0: none)."""

    def _validate(self, p: str) -> None:
        _check(self.min_gap_s > 0, f"{p}.min_gap_s", "> 0", self.min_gap_s)
        _check(0 <= self.load <= 64, f"{p}.load", "in [0, 64]", self.load)
        _check(self.max_gap_s >= self.min_gap_s, f"{p}.max_gap_s", ">= min_gap_s", self.max_gap_s)
        _check(bool(self.kinds), f"{p}.kinds", f"a non-empty subset of {sorted(choices(FaultKind))}", self.kinds)
        _check(bool(self.targets), f"{p}.targets", f"a non-empty subset of {sorted(choices(StageKind))}", self.targets)
        _check(self.pause_s > 0, f"{p}.pause_s", "> 0", self.pause_s)

        def entry_ok(x: str) -> bool:
            kind, _, name = x.rpartition(":")
            if kind == "env":
                return name.startswith("gen-")
            return x == "redis" or (kind in ("", "kill", "pause", "term")
                                    and (name in ("trainer", "feeder") or name.startswith(("gen-", "ver-"))))
        _check(all(entry_ok(x) for x in self.schedule), f"{p}.schedule",
               "worker names (gen-N, ver-N, trainer, feeder), pause:<worker>, term:<worker>, env:gen-N or redis",
               self.schedule)
        _check(self.max_faults >= 0, f"{p}.max_faults", ">= 0", self.max_faults)


@dataclass(frozen=True, kw_only=True)
class TrackingConfig(Section):
    """Experiment trackers fed the trainer's metrics rows (``pipeline.observe.tracking``)."""

    backends: tuple[TrackerName, ...] = ()
    """Any of ``tensorboard`` (event files) and ``wandb`` (Weights & Biases); none by default
    (``metrics.jsonl`` is always written). Both need the ``tracking`` extra."""
    project: str = "rlpipe"
    """W&B project the run is logged under (its name is the run id)."""
    wandb_mode: WandbMode = "offline"
    """``offline``: no network, the run kept under the run directory for ``wandb sync``;
    ``online``: logged in as usual; ``disabled``: W&B's no-op mode."""
    dir: str = ""
    """Where ``tensorboard/`` and ``wandb/`` go (empty: the run directory)."""

    def _validate(self, p: str) -> None:
        _check(len(set(self.backends)) == len(self.backends), f"{p}.backends", "each backend at most once",
               self.backends)
        _check(bool(self.project), f"{p}.project", "a non-empty name", self.project)


@dataclass(frozen=True, kw_only=True)
class MetricsConfig(Section):
    base_port: int = 0
    """Prometheus: ``pipeline up``'s workers serve ``/metrics`` on this port + a fixed offset
    each (exporter, trainer, feeder, generators, verifiers; see runs/<id>/ports.json).
    0 serves nothing."""
    port: int = 0
    """This one process's metrics port, overriding base_port's slot (a worker started by hand). 0: none."""
    host: str = "127.0.0.1"
    """Address the metrics endpoints bind to (loopback by default)."""
    sample_every_s: float = 1.0
    """Seconds between the exporter's queue-depth samples (runs/<id>/queues.jsonl)."""

    def _validate(self, p: str) -> None:
        for name in ("base_port", "port"):
            v = getattr(self, name)
            _check(v == 0 or 1024 <= v <= 65000, f"{p}.{name}", "0 (off) or in [1024, 65000]", v)
        _check(self.sample_every_s > 0, f"{p}.sample_every_s", "> 0", self.sample_every_s)
