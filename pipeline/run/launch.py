"""``pipeline up``: the whole pipeline on one machine, one OS process per stage.

Refuses, before starting anything, a field the user set that the run would ignore
(``pipeline.config.inert_fields``). Then starts (or reuses) the Redis-compatible server,
builds the base model if missing, starts the feeder, N generators, M verifiers and the
trainer through their own CLIs, prints live progress, restarts a crashed worker, and
when the trainer finishes stops everything, accounts for every prompt, and writes
``<run_dir>/summary.{json,md}``.
``pipeline down`` stops a cluster left running (it reads ``<runs_dir>/cluster.json``).
With ``--redis.cluster true`` and no URL the run gets a local three-master Redis Cluster
(``pipeline.bus.server.start_local_cluster``); ``--redis.shards S`` shards every stream.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig, Situation, refuse_inert, to_toml

MAX_RESTARTS = 5


def built_base_model(cfg: RunConfig) -> dict | None:
    """What the pretrained checkpoint in ``model.base_dir`` records (``pretrain.json``), or
    None when there is none and ``ensure_base_model`` would build one."""
    info = Path(cfg.model.base_dir) / "pretrain.json"
    return json.loads(info.read_text()) if info.exists() else None


def ensure_base_model(cfg: RunConfig, *, force: bool = False) -> dict:
    """Pretrain the base model into ``model.base_dir`` unless a checkpoint is there."""
    from pipeline.tasks import arithmetic as task
    from pipeline.model.qwen import ModelShape
    from pipeline.model.pretrain import install_shipped, pretrain, recipe

    base = Path(cfg.model.base_dir)
    if not force and (built := built_base_model(cfg)) is not None:
        return built
    if cfg.task.kind != "arithmetic":
        # Only the embedded task has a warm-up; any other task starts from the checkpoint given.
        if not (base / "config.json").is_file():
            raise FileNotFoundError(f"model.base_dir: {base} is not an HF checkpoint directory (config.json, "
                                    "safetensors, tokenizer.json); `pipeline init-model` builds one")
        return {}
    m, t = cfg.model, cfg.task
    shape = ModelShape(hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                       num_kv_heads=m.num_kv_heads, intermediate_size=m.intermediate_size)
    settings = dict(shape=shape, digits=t.digits, ops=tuple(t.ops), steps=m.pretrain_steps,
                    batch_size=m.pretrain_batch_size, lr=m.pretrain_lr, seed=m.seed,
                    stop_loss=m.pretrain_stop_loss or None)
    if not force and (shipped := install_shipped(base, recipe(**settings, heldout_size=t.heldout_size,
                                                              heldout_seed=t.heldout_seed))) is not None:
        # The same bytes on every machine (pipeline.model.pretrain says why it is shipped).
        print(f"installed the shipped base model in {base} (held-out greedy accuracy "
              f"{shipped['heldout_accuracy']:.1%}; `pipeline pretrain --force` trains it here instead)", flush=True)
        return shipped
    print(f"building the base model in {base} (supervised warm-up, at most {m.pretrain_steps} steps)", flush=True)
    return pretrain(base, **settings, heldout=task.heldout_problems(n=t.heldout_size, seed=t.heldout_seed,
                                                                     digits=t.digits, ops=tuple(t.ops)))


def stage_command(cfg: RunConfig, stage: str) -> list[str]:
    """The command line of one stage; a torchtitan trainer runs under torchrun with ``trainer.nproc`` ranks."""
    if stage == "train" and cfg.trainer.backend == "torchtitan":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={cfg.trainer.nproc}", "-m", "pipeline.cli"]
    else:
        launcher = [sys.executable, "-m", "pipeline.cli"]
    return [*launcher, stage, "--config", str(cfg.run_dir / "config.toml")]


def _spawn(cfg: RunConfig, stage: str, worker: str | None) -> subprocess.Popen:
    cmd = stage_command(cfg, stage)
    if worker:
        cmd += ["--worker-id", worker]
    name = worker or stage
    out = open(cfg.run_dir / "logs" / f"{name}.out", "ab")
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _progress_line(r, keys, start: float, steps: int) -> str:
    from pipeline.bus.stats import queue_depths, read_stats

    tr = {k.decode(): v.decode() for k, v in r.hgetall(keys.trainer).items()}
    q = queue_depths(r, keys)
    st = read_stats(r, keys)

    def f(name: str) -> str:
        return f"{float(tr[name]):.3f}" if name in tr else "  -  "

    return (f"[{time.time() - start:6.0f}s] step {int(tr.get('version', 0)):4d}/{steps}"
            f"  reward {f('reward_mean')}  sample-acc {f('sample_accuracy')}"
            f"  eval {f('eval_accuracy')} (base {f('base_accuracy')})"
            f"  queues prompts={q['prompts']['lag']}+{q['prompts']['pending']}"
            f" rollouts={q['rollouts']['lag']}+{q['rollouts']['pending']}"
            f" scored={q['scored']['lag']}+{q['scored']['pending']}"
            f"  stale={int(st.get('dropped_stale_total', 0))} dead={q['dead']['length']}")


def check_settings(cfg: RunConfig, *, chaos: bool = False) -> None:
    """ConfigError naming each field the user set that this run would ignore, and why
    (``pipeline.config.inert_fields``): checked before anything starts."""
    refuse_inert(cfg, Situation(command="chaos" if chaos else "up",
                                redis_url=cfg.redis.url or os.environ.get("REDIS_URL", ""),
                                base_model=built_base_model(cfg) if cfg.task.kind == "arithmetic" else None))


def run_config(cfg: RunConfig, *, chaos: bool = False) -> RunConfig:
    """The config the run uses: a run id made from the time when none is given, and under
    chaos a server that fsyncs every write (a SIGKILLed server must lose nothing it
    acknowledged, see pipeline.run.chaos)."""
    if not cfg.run_id:
        cfg = cfg.replace("run_id", time.strftime("run-%Y%m%d-%H%M%S"))
    if chaos:
        cfg = cfg.replace("redis.appendfsync", "always")
    return cfg


def worker_table(cfg: RunConfig) -> dict[str, tuple[str, str | None]]:
    """Worker name -> (stage command, ``--worker-id``) of every process ``pipeline up`` starts."""
    workers: dict[str, tuple[str, str | None]] = {"trainer": ("train", None), "feeder": ("feed", None)}
    workers.update({f"gen-{i}": ("generate", f"gen-{i}") for i in range(cfg.cluster.generators)})
    workers.update({f"ver-{i}": ("verify", f"ver-{i}") for i in range(cfg.cluster.verifiers)})
    workers["exporter"] = ("exporter", None)  # stream metrics, and queue samples for the report
    return workers


@dataclass
class Cluster:
    """A running ``pipeline up``: its config, server, driver connection, workers and fault injector."""

    cfg: RunConfig
    server: Any
    r: Any
    keys: Any
    monkey: Any = None
    workers: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    restarts: int = 0

    @property
    def cluster_file(self) -> Path:
        return Path(self.cfg.runs_dir) / "cluster.json"

    def record(self) -> None:
        """Write ``<runs_dir>/cluster.json``: what `pipeline down`, `top` and `status` find the run by."""
        cfg, server = self.cfg, self.server
        self.cluster_file.write_text(json.dumps({
            "run_id": cfg.run_id, "url": server.url, "ns": self.keys.ns, "stop_key": self.keys.stop,
            "redis_cluster": cfg.redis.cluster, "shards": cfg.redis.shards,
            "server_pid": server.process.pid if server.process else None,
            "server_pids": getattr(server, "pids", [server.process.pid] if server.process else []),
            "driver_pid": os.getpid(), "workers": {n: p.pid for n, p in self.procs.items()}}))

    def spawn(self, name: str) -> None:
        self.procs[name] = _spawn(self.cfg, *self.workers[name])

    def version(self) -> int:
        return int(self.r.hget(self.keys.trainer, "version") or 0)


def provision_cluster(cfg: RunConfig, *, chaos: bool = False) -> Cluster:
    """Start (or reach) the server, record the run's config, and prepare its streams; no worker yet."""
    from pipeline.bus.connection import connect
    from pipeline.bus.server import provision
    from pipeline.bus.streams import ensure_all_groups
    from pipeline.keys import Keys

    run_dir = cfg.run_dir
    server = provision(run_dir / "redis", url=cfg.redis.url, appendfsync=cfg.redis.appendfsync, redis_cfg=cfg.redis)
    monkey = None
    if chaos:
        from pipeline.run.chaos import Chaos

        if server.process is None and (cfg.chaos.redis_restarts or "redis" in cfg.chaos.schedule):
            server.stop()
            raise SystemExit("pipeline chaos: restarting Redis needs a server this run starts; "
                             "unset REDIS_URL/--redis.url or pass --chaos.redis_restarts 0")
        monkey = Chaos(cfg.chaos, time.time(), cfg.trainer.steps)
    cfg = cfg.replace("redis.url", server.url)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    r, keys = connect(server.url, name=f"{cfg.run_id}:driver", redis_cfg=cfg.redis), Keys.of(cfg.run_id, cfg.redis)
    if any(r.exists(s.ledger) or r.exists(s.prompts) for s in keys.all_shards()):
        server.stop()
        raise SystemExit(f"pipeline: run {cfg.run_id!r} already has data in {server.url}; choose another --run-id")
    ensure_all_groups(r, keys)
    if cfg.metrics.base_port:
        from pipeline.observe.metrics import write_ports

        write_ports(cfg, run_dir / "ports.json")
    return Cluster(cfg=cfg, server=server, r=r, keys=keys, monkey=monkey, workers=worker_table(cfg))


def restart_exited(c: Cluster) -> None:
    """Start again every worker that exited: after an injected fault once it may come back,
    otherwise counted against ``MAX_RESTARTS``."""
    for name, p in list(c.procs.items()):
        if p.poll() is None:
            continue
        if c.monkey is not None and c.monkey.killed(name):
            if not c.monkey.may_restart(name):
                continue
            del c.monkey.hold_until[name]
            print(f"{name} restarting after the injected fault", flush=True)
        else:
            if c.restarts >= MAX_RESTARTS:
                raise RuntimeError(f"{name} keeps exiting (code {p.returncode}); see {c.cfg.run_dir}/logs/{name}.out")
            print(f"{name} exited with code {p.returncode}; restarting it", flush=True)
            c.restarts += 1
        c.spawn(name)
        c.record()


def supervise(c: Cluster, start: float) -> str:
    """Start every worker and keep them running until the trainer finishes; then stop them
    all. Returns the run's status (``finished``, ``interrupted``, or why the trainer failed)."""
    cfg = c.cfg
    status = "finished"
    # Ctrl-C and `pipeline down` (SIGTERM) both stop the run cleanly; SIGINT is set
    # explicitly because a process started in the background inherits it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        for name in c.workers:
            c.spawn(name)
        c.record()
        last_print = 0.0
        # The trainer exiting 0 ends the run (finished, or stopped); any other exit of any
        # worker, the trainer included (it resumes from its checkpoint), is a restart.
        while c.procs["trainer"].poll() != 0:
            restart_exited(c)
            if c.monkey is not None:
                n = len(c.monkey.faults)
                c.monkey.tick(c.procs, c.server, version=c.version())
                if len(c.monkey.faults) != n:
                    c.record()
            if time.time() - start > cfg.cluster.timeout_s:
                raise RuntimeError(f"the trainer did not finish within cluster.timeout_s={cfg.cluster.timeout_s}")
            if time.time() - last_print >= cfg.cluster.progress_every_s:
                print(_progress_line(c.r, c.keys, start, cfg.trainer.steps), flush=True)
                last_print = time.time()
            time.sleep(0.2)
        if c.procs["trainer"].returncode != 0:
            status = f"trainer exited with code {c.procs['trainer'].returncode}"
    except KeyboardInterrupt:
        status = "interrupted"
        print("\ninterrupted: stopping every stage", flush=True)
    finally:
        c.r.set(c.keys.stop, 1)
        _stop_all(c.procs)
    return status


def finish(c: Cluster, base_info: dict, status: str, start: float) -> int:
    """Account for every prompt, write the summary and report, stop the server; the exit code."""
    from pipeline.observe.report import write_report
    from pipeline.run.accounting import account

    cfg, run_dir, monkey = c.cfg, c.cfg.run_dir, c.monkey
    print(_progress_line(c.r, c.keys, start, cfg.trainer.steps), flush=True)
    accounting = account(c.r, c.keys)
    extra = {}
    if monkey is not None:
        from pipeline.run.chaos import verdict

        extra["chaos"] = {**monkey.summary(), "verdict": verdict(accounting, finished=status == "finished")}
    summary = write_summary(cfg, c.r, c.keys, accounting, base_info, status=status,
                            wall_seconds=time.time() - start, restarts=c.restarts, **extra)
    c.server.stop()
    c.cluster_file.unlink(missing_ok=True)
    print((run_dir / "summary.md").read_text(), flush=True)
    write_report(run_dir)
    print(f"report: {run_dir / 'report.md'}", flush=True)
    if monkey is not None:
        v = extra["chaos"]["verdict"]
        print(f"chaos: {len(monkey.faults)} faults survived {monkey.summary()['by_kind']}; per prompt: "
              f"issued {v['issued']}, trained {v['trained']}, no signal {v['nosignal']}, "
              f"dropped stale {v['dropped_stale']}, dead-lettered {v['dead_lettered']}, in flight {v['in_flight']}, "
              f"lost {v['lost']}, duplicated {v['duplicated']}, unexpected {v['unexpected']} -> "
              f"{'PASS' if v['ok'] else 'FAIL'}", flush=True)
        return 0 if v["ok"] else 1
    return 0 if status == "finished" and summary["accounting"]["ok"] else 1


def up(cfg: RunConfig, *, chaos: bool = False) -> int:
    """Run the whole pipeline; with ``chaos``, inject the faults of ``cfg.chaos`` and judge the result."""
    check_settings(cfg, chaos=chaos)
    cfg = run_config(cfg, chaos=chaos)
    (cfg.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    start = time.time()
    base_info = ensure_base_model(cfg)
    c = provision_cluster(cfg, chaos=chaos)
    print(f"run {c.cfg.run_id}: redis {c.server.url}, logs in {c.cfg.run_dir}/logs, base accuracy "
          f"{base_info.get('heldout_accuracy', float('nan')):.3f}", flush=True)
    status = supervise(c, start)
    return finish(c, base_info, status, start)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop_all(procs: dict[str, subprocess.Popen], grace_s: float = 15.0) -> None:
    """Ask every worker to stop (the stop key is set), then SIGTERM, then SIGKILL."""
    deadline = time.time() + grace_s
    for p in procs.values():
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            # The whole group (every worker starts its own session): a torchrun agent's
            # ranks die with it instead of outliving a SIGKILL of the agent alone.
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def write_summary(cfg: RunConfig, r, keys, accounting: dict, base_info: dict, **extra) -> dict:
    """Write ``summary.json`` and ``summary.md`` from the run's metrics file and Redis counters."""
    from pipeline.bus.stats import read_stats

    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (cfg.run_dir / "metrics.jsonl").exists() else []
    # A trainer resumed from a checkpoint redoes the steps after it: the last row per version counts.
    steps = sorted({x["version"]: x for x in rows if x["kind"] == "step"}.values(), key=lambda x: x["version"])
    evals = sorted({x["version"]: x for x in rows if x["kind"] == "eval"}.values(), key=lambda x: x["version"])
    stats = read_stats(r, keys)
    base = evals[0]["heldout_accuracy"] if evals else float("nan")
    last3 = [e["heldout_accuracy"] for e in evals[1:]][-3:]
    final = sum(last3) / len(last3) if last3 else float("nan")

    def window_mean(key: str, part: slice) -> float:
        vals = [s[key] for s in steps[part] if key in s]
        return sum(vals) / len(vals) if vals else float("nan")

    wait = sum(s.get("wait_seconds", 0) for s in steps)
    busy = sum(s.get("step_seconds", 0) for s in steps)
    gen_tokens = stats.get("tokens_generated_total", 0)
    summary = {
        "run_id": cfg.run_id, **extra,
        "reward_mode": cfg.verifier.reward, "max_staleness": cfg.trainer.max_staleness,
        "steps": len(steps), "base_accuracy": base, "final_accuracy_mean_last3": final,
        "improvement_points": 100 * (final - base),
        "heldout_size": cfg.task.heldout_size, "evals": {e["version"]: e["heldout_accuracy"] for e in evals},
        "pretrain": base_info,
        "reward_first10": window_mean("reward_mean", slice(0, 10)), "reward_last10": window_mean("reward_mean", slice(-10, None)),
        "sample_accuracy_first10": window_mean("sample_accuracy", slice(0, 10)),
        "sample_accuracy_last10": window_mean("sample_accuracy", slice(-10, None)),
        "tokens_generated": gen_tokens, "tokens_trained": stats.get("tokens_trained_total", 0),
        "goodput": stats.get("tokens_trained_total", 0) / gen_tokens if gen_tokens else 0.0,
        "trainer_idle_fraction": wait / (wait + busy) if wait + busy else 0.0,
        "accounting": accounting,
    }
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    a = accounting
    md = [
        f"# Run {cfg.run_id}", "",
        f"- status: {summary['status']}; {summary['steps']} steps in {summary['wall_seconds']:.0f} s; reward `{cfg.verifier.reward}`, η = {cfg.trainer.max_staleness}",
        f"- held-out greedy accuracy ({cfg.task.heldout_size} problems): base {base:.3f} -> final {final:.3f} "
        f"(mean of the last three evaluations), {summary['improvement_points']:+.1f} points",
        f"- reward: first 10 steps {summary['reward_first10']:.3f}, last 10 {summary['reward_last10']:.3f}; "
        f"hidden accuracy of sampled answers: {summary['sample_accuracy_first10']:.3f} -> {summary['sample_accuracy_last10']:.3f}",
        f"- goodput (tokens trained / generated): {summary['goodput']:.3f}; trainer idle {summary['trainer_idle_fraction']:.1%}; worker restarts {summary['restarts']}",
        "", "## Accounting", "",
        "| issued | trained | no signal | stale | dead-lettered | in flight at stop | lost | unexpected | duplicates skipped |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {a['issued']} | {a['trained']} | {a['nosignal']} | {a['stale']} | {a['dead_lettered']} | "
        f"{sum(a['in_flight'].values())} {a['in_flight']} | {a['lost']} | {a['unexpected']} | {a['duplicates_skipped']} |",
        "", f"Counts add up: {a['adds_up']}; every trained group trained once: {a['trained_once']}; accounting ok: {a['ok']}", "",
    ]
    (cfg.run_dir / "summary.md").write_text("\n".join(md))
    return summary


def down(runs_dir: Path) -> int:
    """Stop the cluster recorded in ``<runs_dir>/cluster.json``: stop key, SIGTERM the workers, stop the server."""
    import redis

    info_file = runs_dir / "cluster.json"
    if not info_file.exists():
        print(f"no cluster recorded in {info_file}; nothing to stop")
        return 0
    info = json.loads(info_file.read_text())
    driver = info.get("driver_pid")
    if driver and _signal(driver, signal.SIGTERM):
        # The driver stops its workers and server itself; give it the time to.
        for _ in range(100):
            if not _alive(driver):
                print(f"stopped the cluster driver (pid {driver}) and its workers")
                break
            time.sleep(0.2)
    try:
        if info.get("redis_cluster"):
            from redis.cluster import RedisCluster

            RedisCluster.from_url(info["url"], socket_timeout=2).set(info["stop_key"], 1)
        else:
            redis.Redis.from_url(info["url"], socket_timeout=2).set(info.get("stop_key", f"{info['ns']}:stop"), 1)
    except redis.RedisError:
        pass  # server already gone: signals below still stop the workers
    for name, pid in info["workers"].items():
        if _signal(pid, signal.SIGTERM, group=True):
            print(f"stopped {name} (pid {pid})")
    for pid in info.get("server_pids") or ([info["server_pid"]] if info.get("server_pid") else []):
        if _signal(pid, signal.SIGTERM):
            print(f"stopped the Redis server (pid {pid})")
    info_file.unlink(missing_ok=True)
    return 0


def _signal(pid: int, sig: int, *, group: bool = False) -> bool:
    try:
        (os.killpg if group else os.kill)(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _alive(pid: int) -> bool:
    return _signal(pid, 0)
