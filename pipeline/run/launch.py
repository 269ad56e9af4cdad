"""``pipeline up``: the whole pipeline on one machine, one OS process per stage.

Starts (or reuses) the Redis-compatible server, builds the base model if missing,
starts the feeder, N generators, M verifiers and the trainer through their own CLIs,
prints live progress, restarts a crashed worker, and when the trainer finishes stops
everything, accounts for every prompt, and writes ``<run_dir>/summary.{json,md}``.
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
from pathlib import Path

from pipeline.config import RunConfig, to_toml

MAX_RESTARTS = 5


def ensure_base_model(cfg: RunConfig, *, force: bool = False) -> dict:
    """Pretrain the base model into ``model.base_dir`` unless a checkpoint is there."""
    from pipeline.tasks import arithmetic as task
    from pipeline.model.qwen import ModelShape
    from pipeline.model.pretrain import pretrain

    base = Path(cfg.model.base_dir)
    info = base / "pretrain.json"
    if info.exists() and not force:
        return json.loads(info.read_text())
    if cfg.task.kind != "arithmetic":
        # Only the embedded task has a warm-up; any other task starts from the checkpoint given.
        if not (base / "config.json").is_file():
            raise FileNotFoundError(f"model.base_dir: {base} is not an HF checkpoint directory (config.json, "
                                    "safetensors, tokenizer.json); `pipeline init-model` builds one")
        return {}
    m, t = cfg.model, cfg.task
    print(f"building the base model in {base} (supervised warm-up, at most {m.pretrain_steps} steps)", flush=True)
    return pretrain(
        base, shape=ModelShape(hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                               num_kv_heads=m.num_kv_heads, intermediate_size=m.intermediate_size),
        digits=t.digits, ops=tuple(t.ops), steps=m.pretrain_steps, batch_size=m.pretrain_batch_size,
        lr=m.pretrain_lr, seed=m.seed, stop_loss=m.pretrain_stop_loss or None,
        heldout=task.heldout_problems(n=t.heldout_size, seed=t.heldout_seed, digits=t.digits, ops=tuple(t.ops)))


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


def up(cfg: RunConfig, *, chaos: bool = False) -> int:
    """Run the whole pipeline; with ``chaos``, inject the faults of ``cfg.chaos`` and judge the result."""
    from pipeline.run.accounting import account
    from pipeline.keys import Keys
    from pipeline.bus.server import provision
    from pipeline.bus.connection import connect
    from pipeline.bus.streams import ensure_all_groups

    if not cfg.run_id:
        cfg.run_id = time.strftime("run-%Y%m%d-%H%M%S")
    run_dir = cfg.run_dir
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    start = time.time()
    base_info = ensure_base_model(cfg)
    if chaos:
        # A SIGKILLed server must lose nothing it acknowledged (see pipeline.run.chaos).
        cfg.redis.appendfsync = "always"
    server = provision(run_dir / "redis", url=cfg.redis.url, appendfsync=cfg.redis.appendfsync, redis_cfg=cfg.redis)
    monkey = None
    if chaos:
        from pipeline.run.chaos import Chaos

        if server.process is None and (cfg.chaos.redis_restarts or "redis" in cfg.chaos.schedule):
            server.stop()
            raise SystemExit("pipeline chaos: restarting Redis needs a server this run starts; "
                             "unset REDIS_URL/--redis.url or pass --chaos.redis_restarts 0")
        monkey = Chaos(cfg.chaos, time.time(), cfg.trainer.steps)
    cfg.redis.url = server.url
    (run_dir / "config.toml").write_text(to_toml(cfg))
    r, keys = connect(server.url, name=f"{cfg.run_id}:driver", redis_cfg=cfg.redis), Keys.of(cfg.run_id, cfg.redis)
    if any(r.exists(s.ledger) or r.exists(s.prompts) for s in keys.all_shards()):
        server.stop()
        raise SystemExit(f"pipeline: run {cfg.run_id!r} already has data in {server.url}; choose another --run-id")
    ensure_all_groups(r, keys)
    workers = {"trainer": ("train", None), "feeder": ("feed", None)}
    workers.update({f"gen-{i}": ("generate", f"gen-{i}") for i in range(cfg.cluster.generators)})
    workers.update({f"ver-{i}": ("verify", f"ver-{i}") for i in range(cfg.cluster.verifiers)})
    workers["exporter"] = ("exporter", None)  # stream metrics, and queue samples for the report
    if cfg.metrics.base_port:
        from pipeline.observe.metrics import write_ports

        write_ports(cfg, run_dir / "ports.json")
    procs: dict[str, subprocess.Popen] = {}
    cluster_file = Path(cfg.runs_dir) / "cluster.json"

    def record() -> None:
        cluster_file.write_text(json.dumps({
            "run_id": cfg.run_id, "url": server.url, "ns": keys.ns, "stop_key": keys.stop,
            "redis_cluster": cfg.redis.cluster,
            "server_pid": server.process.pid if server.process else None,
            "server_pids": getattr(server, "pids", [server.process.pid] if server.process else []),
            "driver_pid": os.getpid(), "workers": {n: p.pid for n, p in procs.items()}}))

    print(f"run {cfg.run_id}: redis {server.url}, logs in {run_dir}/logs, base accuracy "
          f"{base_info.get('heldout_accuracy', float('nan')):.3f}", flush=True)
    restarts = 0
    status = "finished"
    # Ctrl-C and `pipeline down` (SIGTERM) both stop the run cleanly; SIGINT is set
    # explicitly because a process started in the background inherits it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        for name, (stage, worker) in workers.items():
            procs[name] = _spawn(cfg, stage, worker)
        record()
        last_print = 0.0
        # The trainer exiting 0 ends the run (finished, or stopped); any other exit of any
        # worker, the trainer included (it resumes from its checkpoint), is a restart.
        while procs["trainer"].poll() != 0:
            for name, p in list(procs.items()):
                if p.poll() is None:
                    continue
                if monkey is not None and monkey.killed(name):
                    if not monkey.may_restart(name):
                        continue
                    del monkey.hold_until[name]
                    print(f"{name} restarting after the injected fault", flush=True)
                else:
                    if restarts >= MAX_RESTARTS:
                        raise RuntimeError(f"{name} keeps exiting (code {p.returncode}); see {run_dir}/logs/{name}.out")
                    print(f"{name} exited with code {p.returncode}; restarting it", flush=True)
                    restarts += 1
                procs[name] = _spawn(cfg, *workers[name])
                record()
            if monkey is not None:
                n = len(monkey.faults)
                monkey.tick(procs, server, version=int(r.hget(keys.trainer, "version") or 0))
                if len(monkey.faults) != n:
                    record()
            if time.time() - start > cfg.cluster.timeout_s:
                raise RuntimeError(f"the trainer did not finish within cluster.timeout_s={cfg.cluster.timeout_s}")
            if time.time() - last_print >= cfg.cluster.progress_every_s:
                print(_progress_line(r, keys, start, cfg.trainer.steps), flush=True)
                last_print = time.time()
            time.sleep(0.2)
        if procs["trainer"].returncode != 0:
            status = f"trainer exited with code {procs['trainer'].returncode}"
    except KeyboardInterrupt:
        status = "interrupted"
        print("\ninterrupted: stopping every stage", flush=True)
    finally:
        r.set(keys.stop, 1)
        _stop_all(procs)
    print(_progress_line(r, keys, start, cfg.trainer.steps), flush=True)
    accounting = account(r, keys)
    extra = {}
    if monkey is not None:
        from pipeline.run.chaos import verdict

        extra["chaos"] = {**monkey.summary(), "verdict": verdict(accounting, finished=status == "finished")}
    summary = write_summary(cfg, r, keys, accounting, base_info, status=status,
                            wall_seconds=time.time() - start, restarts=restarts, **extra)
    server.stop()
    cluster_file.unlink(missing_ok=True)
    print((run_dir / "summary.md").read_text(), flush=True)
    from pipeline.observe.report import write_report

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
