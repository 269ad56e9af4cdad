"""Stream throughput benchmark: rollout records per second through the pipeline's own
producer and consumer code against raw redis-py and redis-benchmark, in the same run, on a
server started the way ``pipeline up`` starts it (loopback, append-only file, everysec).

Producer (the generator's emit, ``pipeline.stage.Stage.emit`` itself): per batch of
``generator.prompts_per_batch`` records, one idempotent transaction (the emit script)
holding the ``XADD`` of each record to the rollouts stream, one variadic ``XACK`` of the
prompts they answer, and the counters; the prompts are read into the generator's pending
list and decoded beforehand, untimed. Baseline: the same bytes as plain pipelined ``XADD``
(no transaction, no acks), same batch. A third figure (``produce_one_ack``) is the same
writes as a plain MULTI/EXEC with one variadic ``XACK``: no script, no idempotency token.

Consumer (the verifier's read, the stage's own ``read``, ``take`` and ``emit``): own
pending, reclaim, then ``>``, the next read sent ahead (answered while the batch decodes,
its reply collected in the emit's wait); decoding with ``RolloutGroup.decode`` and the delivery limit;
the acks in one transaction (the emit script: one variadic ``XACK``, the idempotency
token; every ``TRIM_EVERY`` batches the trim of what was acked). Baseline: ``XREADGROUP
COUNT b`` + one ``XACK`` of the same entries. The same path with a decoder that returns
the bytes as they are separates the plumbing from the record validation
(``bench/bench_records.py``), and the same path with a bare ``XACK`` of the batch in place
of ``Stage.emit`` (``consume_one_ack``: no script, no token, no trim) shows what the emit
transaction costs.

Ceiling: ``redis-benchmark -x XADD`` with a payload of the same size (ASCII bytes: its
``-x`` argument is a C string), pipelined by the generator's batch, the better of 1 and 16
connections.

Each figure is the best of ``--rounds`` interleaved rounds (wall clock, one client
connection); records per CPU-second of client + server are reported beside it, as they
move less with other load on the machine.

Payloads: a typical LLM rollout group (G = 8, 200-token prompt, 8 × 500-token completions
with log-probs, ~50 KB) and an embedded-default group (3-digit addition, ~0.7 KB).

    python bench/bench_streams.py [--rounds 5] [--out bench/results/streams.json]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent

from common import progress, save_result

from bench_records import embedded_group, typical_group
from pipeline.config import RunConfig
from pipeline.keys import GENERATORS_GROUP, TRAINER_GROUP, VERIFIERS_GROUP, Keys
from pipeline.records import PromptTask, RolloutGroup
from pipeline.bus.server import start_local_server
from pipeline.bus.stats import incr_stats
from pipeline.bus.streams import FIELD, GroupReader, ensure_group
from pipeline.stage import Output, Stage

RESULTS = ROOT / "bench" / "results"
AIM = 0.80
"""The pipeline's producer and consumer paths should reach this share of raw redis-py."""


say = progress("bench-streams")


class Meter:
    """Wall time, and CPU time of this client and of the server, of the block it wraps.

    The CPU figures do not move with other load on the machine: records per CPU-second
    (client + server) compare the code paths' costs where wall-clock rates are noisy.
    """

    def __init__(self, r: redis.Redis, n: int):
        self.r, self.n = r, n

    def _server_cpu(self) -> float:
        info = self.r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def __enter__(self) -> "Meter":
        self.s0, self.c0 = self._server_cpu(), time.process_time()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.t0
        self.client = time.process_time() - self.c0
        self.server = self._server_cpu() - self.s0

    def result(self) -> dict:
        return {"rate": self.n / self.wall, "cpu_rate": self.n / max(self.client + self.server, 1e-9),
                "client_cpu_us": 1e6 * self.client / self.n, "server_cpu_us": 1e6 * self.server / self.n}


def _fresh(r: redis.Redis, keys: Keys) -> None:
    r.delete(keys.shard(0).prompts, keys.shard(0).rollouts, keys.shard(0).stats, "bench:raw")


def _batches(n: int, size: int):
    for i in range(0, n, size):
        yield min(size, n - i)


# --- producer ---------------------------------------------------------------------


def _pending_prompts(r: redis.Redis, keys: Keys, n: int, batch: int) -> list[list]:
    """``n`` prompt entries delivered to ``gen-0`` (in its pending list), in read batches."""
    ensure_group(r, keys.shard(0).prompts, GENERATORS_GROUP)
    task = PromptTask(prompt_id="p", prompt=" 12+345=", prompt_ids=typical_group().prompt_ids[:12],
                      reference="357", issued_at=time.time()).encode()
    pipe = r.pipeline(transaction=False)
    for _ in range(n):
        pipe.xadd(keys.shard(0).prompts, {FIELD: task})
    pipe.execute()
    reader = GroupReader(r, keys.shard(0).prompts, GENERATORS_GROUP, "gen-0", claim_idle_ms=0)
    out = []
    for k in _batches(n, batch):
        out.append(reader.read_new(k, block_ms=1000))
    return out


def _stage(r: redis.Redis, keys: Keys, name: str):
    """The stage plumbing the generator (prompts -> rollouts) or verifier (rollouts -> scored) runs."""
    if name == "generator":
        return Stage(r, keys, RunConfig(), name="generator", worker_id="gen-0", log=_QUIET, source="prompts",
                     group=GENERATORS_GROUP, decode=PromptTask.decode, sink="rollouts", sink_group=VERIFIERS_GROUP)
    return Stage(r, keys, RunConfig(), name="verifier", worker_id="ver-0", log=_QUIET, source="rollouts",
                 group=VERIFIERS_GROUP, decode=RolloutGroup.decode, sink="scored", sink_group=TRAINER_GROUP,
                 prefetch=True)


class _Quiet:
    def __getattr__(self, _name):
        return lambda *a, **kw: None


_QUIET = _Quiet()


def produce_pipeline(r: redis.Redis, keys: Keys, payload: bytes, n: int, batch: int, *, one_ack: bool = False) -> dict:
    """Records/s through the generator's emit (``Stage.emit``: an XADD per record, one variadic XACK
    and the counters in one idempotent transaction); ``one_ack``: the same writes as a plain MULTI."""
    held = _pending_prompts(r, keys, n, batch)
    stage = _stage(r, keys, "generator")
    batches = [stage.take(entries) for entries in held]
    with Meter(r, n) as m:
        for b in batches:
            if not one_ack:
                stage.emit(b, Output(written=[(e, payload) for e, _ in b.good],
                                     counters={"groups_generated_total": len(b.good),
                                               "tokens_generated_total": 4000 * len(b.good),
                                               "generate_seconds_total": 0.25}))
                continue
            pipe = r.pipeline(transaction=True)
            for _ in b.good:
                pipe.xadd(keys.shard(0).rollouts, {FIELD: payload})
            pipe.xack(keys.shard(0).prompts, GENERATORS_GROUP, *[e.id for e, _ in b.good])
            incr_stats(pipe, keys.shard(0), groups_generated_total=len(b.good),
                       tokens_generated_total=4000 * len(b.good), generate_seconds_total=0.25)
            pipe.execute()
    assert r.xlen(keys.shard(0).rollouts) == n and r.xpending(keys.shard(0).prompts, GENERATORS_GROUP)["pending"] == 0
    return m.result()


def produce_raw(r: redis.Redis, payload: bytes, n: int, batch: int) -> dict:
    """Records/s of plain pipelined XADD of the same bytes."""
    with Meter(r, n) as m:
        for k in _batches(n, batch):
            pipe = r.pipeline(transaction=False)
            for _ in range(k):
                pipe.xadd("bench:raw", {FIELD: payload})
            pipe.execute()
    assert r.xlen("bench:raw") == n
    return m.result()


# --- consumer ---------------------------------------------------------------------


def _fill(r: redis.Redis, stream: str, group: str, payload: bytes, n: int) -> None:
    ensure_group(r, stream, group)
    for k in _batches(n, 500):
        pipe = r.pipeline(transaction=False)
        for _ in range(k):
            pipe.xadd(stream, {FIELD: payload})
        pipe.execute()


def consume_pipeline(r: redis.Redis, keys: Keys, payload: bytes, n: int, batch: int, *, decode=RolloutGroup.decode,
                     one_ack: bool = False) -> dict:
    """Records/s through the verifier's read: ``Stage.read`` (own pending, reclaim, new), ``Stage.take``
    (decode, check), and the acks (``Stage.emit`` with nothing written downstream); ``one_ack``: a bare
    XACK of the batch in place of ``Stage.emit``."""
    _fill(r, keys.shard(0).rollouts, VERIFIERS_GROUP, payload, n)
    stage = _stage(r, keys, "verifier")
    stage.decode = decode
    got = 0
    with Meter(r, n) as m:
        while got < n:
            b = stage.take(stage.read(batch))
            if b.bad:
                raise RuntimeError(f"benchmark payload refused: {b.bad[0][1]}")
            if one_ack:
                r.xack(keys.shard(0).rollouts, VERIFIERS_GROUP, *[e.id for e, _ in b.good])
            else:
                stage.emit(b, Output(written=[(e, None) for e, _ in b.good]))
            got += len(b.good)
    assert r.xpending(keys.shard(0).rollouts, VERIFIERS_GROUP)["pending"] == 0
    return m.result()


def consume_raw(r: redis.Redis, payload: bytes, n: int, batch: int) -> dict:
    """Records/s of XREADGROUP COUNT batch + one XACK of the same entries."""
    _fill(r, "bench:raw", "raw", payload, n)
    got = 0
    with Meter(r, n) as m:
        while got < n:
            resp = r.xreadgroup("raw", "c", {"bench:raw": ">"}, count=batch, block=1000)
            ids = [i for i, _ in resp[0][1]]
            r.xack("bench:raw", "raw", *ids)
            got += len(ids)
    return m.result()


# --- ceiling ----------------------------------------------------------------------


def redis_benchmark(url: str, size: int, n: int, *, clients: int = 16, pipeline: int = 16) -> dict:
    """``redis-benchmark -x XADD`` with a ``size``-byte ASCII payload; {"rps", "command"} or {"note"}."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {"note": "redis-benchmark not installed (Debian: apt-get install redis-tools)"}
    port = url.rsplit(":", 1)[1].split("/")[0]
    cmd = [exe, "-h", "127.0.0.1", "-p", port, "-n", str(n), "-c", str(clients), "-P", str(pipeline), "--csv",
           "-x", "XADD", "bench:rb", "*", "d"]
    with tempfile.TemporaryFile() as f:
        f.write(b"x" * size)
        f.seek(0)
        out = subprocess.run(cmd, stdin=f, capture_output=True, text=True, timeout=300)
    rows = [line.split('","') for line in out.stdout.splitlines() if line.startswith('"XADD')]
    if out.returncode != 0 or not rows:
        return {"note": f"redis-benchmark failed (exit {out.returncode}): {out.stderr.strip()[-300:]}"}
    shown = " ".join(["redis-benchmark"] + cmd[3:5] + cmd[5:]) + f" < {size}-byte payload"
    return {"rps": float(rows[-1][1]), "command": shown, "clients": clients, "pipeline": pipeline}


def redis_benchmark_best(url: str, size: int, n: int, *, pipeline: int) -> dict:
    """The best of one connection and 16 connections (large payloads do better on fewer)."""
    runs = [redis_benchmark(url, size, n, clients=c, pipeline=pipeline) for c in (1, 16)]
    ok = [x for x in runs if "rps" in x]
    return max(ok, key=lambda x: x["rps"]) if ok else runs[0]


# --- driver -----------------------------------------------------------------------


def measure(url: str, *, rounds: int = 5, max_bytes: int = 24 << 20, payloads: list[str] | None = None) -> dict:
    cfg = RunConfig()
    gen_batch, ver_batch = cfg.generator.prompts_per_batch, cfg.verifier.batch
    r = redis.Redis.from_url(url)
    server_version = r.info("server")["redis_version"]
    keys = Keys("benchstreams")
    cases = {"typical": typical_group(), "embedded": embedded_group()}
    rows = []
    for label in payloads or list(cases):
        payload = cases[label].encode()
        n = max(500, min(10_000, max_bytes // len(payload)))
        say(f"{label} payload: {len(payload):,} bytes, {n} records per measurement, best of {rounds} interleaved rounds")
        names = ("produce_raw", "produce_pipeline", "produce_one_ack", "consume_raw", "consume_pipeline",
                 "consume_one_ack", "consume_plumbing")
        runs: dict[str, list[dict]] = {k: [] for k in names}
        paths = [
            ("produce_raw", lambda: produce_raw(r, payload, n, gen_batch)),
            ("produce_pipeline", lambda: produce_pipeline(r, keys, payload, n, gen_batch)),
            ("produce_one_ack", lambda: produce_pipeline(r, keys, payload, n, gen_batch, one_ack=True)),
            ("consume_raw", lambda: consume_raw(r, payload, n, ver_batch)),
            ("consume_pipeline", lambda: consume_pipeline(r, keys, payload, n, ver_batch)),
            ("consume_one_ack", lambda: consume_pipeline(r, keys, payload, n, ver_batch, one_ack=True)),
            ("consume_plumbing", lambda: consume_pipeline(r, keys, payload, n, ver_batch, decode=lambda b: b)),
        ]
        for i in range(rounds):
            # Each round starts one path later, so no path always runs first (after the big deletes).
            for name, fn in paths[i % len(paths):] + paths[: i % len(paths)]:
                _fresh(r, keys)
                runs[name].append(fn())
            say(f"  round {i + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]['rate']:,.0f}/s" for k, v in runs.items()))
        _fresh(r, keys)
        say(f"  redis-benchmark -x XADD, {len(payload):,}-byte payload")
        rb = redis_benchmark_best(url, len(payload), max(n, min(100_000, (64 << 20) // len(payload))),
                                  pipeline=gen_batch)
        r.delete("bench:rb")
        # Best of the rounds: the round least disturbed by other load on the machine.
        best = {k: max(x["rate"] for x in v) for k, v in runs.items()}
        cpu = {k: max(x["cpu_rate"] for x in v) for k, v in runs.items()}
        row = {"payload": label, "bytes": len(payload), "records": n, "generator_batch": gen_batch,
               "verifier_batch": ver_batch, **best, "cpu_rate": cpu, "rounds": runs, "redis_benchmark": rb}
        for fig, base in (("produce", "produce_raw"), ("produce_one_ack", "produce_raw"), ("consume", "consume_raw"),
                          ("consume_one_ack", "consume_raw"), ("consume_plumbing", "consume_raw")):
            key = fig if fig.endswith(("ack", "plumbing")) else f"{fig}_pipeline"
            row[f"{fig}_ratio"] = best[key] / best[base]
            row[f"{fig}_cpu_ratio"] = cpu[key] / cpu[base]
        rows.append(row)
        ceiling = f"{rb['rps']:,.0f}/s" if "rps" in rb else rb["note"]
        say(f"  producer {best['produce_pipeline']:,.0f}/s vs raw {best['produce_raw']:,.0f}/s "
            f"({row['produce_ratio']:.0%}, per CPU-second {row['produce_cpu_ratio']:.0%}; as a plain MULTI "
            f"{row['produce_one_ack_ratio']:.0%}); consumer {best['consume_pipeline']:,.0f}/s vs raw "
            f"{best['consume_raw']:,.0f}/s ({row['consume_ratio']:.0%}, per CPU-second {row['consume_cpu_ratio']:.0%}; "
            f"a bare XACK for the emit script {row['consume_one_ack_ratio']:.0%}; without record decoding "
            f"{row['consume_plumbing_ratio']:.0%}); redis-benchmark {ceiling}")
    return {"server_version": server_version, "aim": AIM, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-mib", type=int, default=24, help="bytes written per measurement (sets the record count)")
    p.add_argument("--payloads", default="typical,embedded", help="comma-separated: typical, embedded")
    p.add_argument("--out", default=str(RESULTS / "streams.json"))
    a = p.parse_args(argv)
    payloads = [x for x in a.payloads.split(",") if x]
    if a.rounds < 1 or a.max_mib < 1 or not set(payloads) <= {"typical", "embedded"} or not payloads:
        p.error("--rounds and --max-mib must be >= 1; --payloads takes typical and/or embedded")
    with tempfile.TemporaryDirectory(prefix="bench-streams-") as tmp:
        server = start_local_server(Path(tmp))
        say(f"server {server.url} (AOF everysec, as pipeline up starts it)")
        try:
            res = measure(server.url, rounds=a.rounds, max_bytes=a.max_mib << 20, payloads=payloads)
        finally:
            server.stop()
    save_result(a.out, res, script="bench/bench_streams.py", argv=argv)
    say(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
