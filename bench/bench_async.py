"""Asynchronous against synchronous RL, measured on the pipeline's real plumbing.

A generator, a verifier and a trainer run as separate OS processes on a real Redis server
and pass real records (``PromptTask`` → ``RolloutGroup`` → ``ScoredGroup``) through the real
streams with the stages' own functions: ``Admission`` and ``VersionWatch`` (DESIGN §3),
``GroupReader`` and ``decode_entries``, backpressure (``wait_for_room``) and heartbeats,
MULTI pipelines of output + ack, and the trainer's
``collect_batch``, ``classify`` (the staleness rule), ``step_record`` and ``commit``. Only
the compute is replaced: each stage sleeps for the time its GPU work would take (by default
generate 3 s, verify 1 s, train 2 s per step of B groups, scaled ×0.1 so a run takes
seconds), each stage being its own resource.

With η = 0 (synchronous) a step costs the sum of the stages; with η ≥ 1 the stages overlap
and a step costs the slowest stage, or (gen + verify + train) / (η + 1) when that is larger
(the generator may run at most η versions ahead). The figure is the measured steady-state
step time against that ideal: the share of the ideal reached (ideal / measured).

    python bench/bench_async.py [--scale 0.1] [--steps 20] [--etas 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from common import progress, save_result

from pipeline.keys import GENERATORS_GROUP, TRAINER_GROUP, VERIFIERS_GROUP, Keys
from pipeline.records import PromptTask, RolloutGroup, ScoredGroup
from pipeline.config import RunConfig
from pipeline.bus.connection import connect
from pipeline.bus.flow import Admission, VersionWatch, stop_requested, wait_for_room
from pipeline.bus.stats import heartbeat, incr_stats
from pipeline.bus.streams import FIELD, GroupReader, decode_entries, ensure_all_groups

RESULTS = ROOT / "bench" / "results"
AIM = 0.90
"""Share of the ideal step time the pipeline should reach (overhead below 10%)."""
VOCAB = 17
BLOCK_MS = 500
STEPS_KEY = "bench:steps"
MAX_STREAM_LAG = RunConfig().redis.max_stream_lag


def _log(stage: str, worker: str):
    import structlog

    return structlog.get_logger().bind(stage=stage, worker=worker)


say = progress("bench-async")


def ideal_step(gen_s: float, verify_s: float, train_s: float, eta: int) -> float:
    """Seconds per step with perfect overlap: the slowest stage, or the whole loop spread over η + 1 steps."""
    return max(gen_s, verify_s, train_s, (gen_s + verify_s + train_s) / (eta + 1))


# --- the stages, compute replaced by sleeps -----------------------------------------------


def _rollout(task: PromptTask, *, version: int, group_size: int, worker: str) -> RolloutGroup:
    """A group for ``task`` with small fixed completions (its contents are irrelevant to the timing)."""
    lens = np.full(group_size, 4, dtype=np.int32)
    n = int(lens.sum())
    return RolloutGroup(
        prompt_id=task.prompt_id, group_id=f"{task.prompt_id}:{worker}:{version}", generator_id=worker,
        prompt=task.prompt, prompt_ids=task.prompt_ids, reference=task.reference,
        completions=tuple(["357", "356", "357", "12"][i % 4] for i in range(group_size)),
        completion_ids=(np.arange(n, dtype=np.int32) % 10) + 2, completion_lens=lens,
        behaviour_logprobs=np.full(n, -0.5, dtype=np.float32), min_version=version, max_version=version,
        created_at=time.time())


def generator(r, keys: Keys, *, eta: int, batch: int, group_size: int, gen_s: float) -> None:
    """The generator's loop (pipeline/producers/generator.py) with sampling replaced by a sleep."""
    admission = Admission(r, keys, max_staleness=eta, groups_per_step=batch)
    watch = VersionWatch(r, keys)
    reader = GroupReader(r, keys.prompts, GENERATORS_GROUP, "gen-0", claim_idle_ms=0)
    version, log = 0, _log("generator", "gen-0")
    heartbeat(r, keys, "gen-0", "generator", "ready")
    while not stop_requested(r, keys):
        version = max(version, int(r.hget(keys.trainer, "version") or 0))  # the swap between batches
        wait_for_room(r, keys, keys.rollouts, VERIFIERS_GROUP, bound=MAX_STREAM_LAG, worker_id="gen-0",
                      stage="generator", log=log)
        entries = reader.read_owned(batch)
        if not entries:
            granted = admission.admit(batch, version)
            if not granted:
                version = max(version, watch.wait(BLOCK_MS) or 0)
                continue
            entries = reader.read_new(granted, BLOCK_MS)
            admission.release(granted - len(entries))
        good, bad = decode_entries(entries, PromptTask.decode, reader=reader)
        if bad:
            raise RuntimeError(f"prompt refused: {bad[0][1]}")
        if not good:
            continue
        heartbeat(r, keys, "gen-0", "generator", "generating", version=version)
        time.sleep(gen_s * len(good) / batch)  # generation on its own GPU
        pipe = r.pipeline(transaction=True)
        for e, task in good:
            pipe.xadd(keys.rollouts, {FIELD: _rollout(task, version=version, group_size=group_size,
                                                      worker="gen-0").encode()})
            pipe.xack(keys.prompts, GENERATORS_GROUP, e.id)
        incr_stats(pipe, keys, groups_generated_total=len(good))
        pipe.execute()


def verifier(r, keys: Keys, *, batch: int, verify_s: float) -> None:
    """The verifier's loop (pipeline/consumers/verifier.py) with scoring replaced by a sleep."""
    reader = GroupReader(r, keys.rollouts, VERIFIERS_GROUP, "ver-0", claim_idle_ms=0)
    log = _log("verifier", "ver-0")
    heartbeat(r, keys, "ver-0", "verifier", "ready")
    while not stop_requested(r, keys):
        wait_for_room(r, keys, keys.scored, TRAINER_GROUP, bound=MAX_STREAM_LAG, worker_id="ver-0",
                      stage="verifier", log=log)
        entries = reader.read(batch, BLOCK_MS)
        if not entries:
            continue
        good, bad = decode_entries(entries, RolloutGroup.decode, reader=reader)
        if bad:
            raise RuntimeError(f"rollout refused: {bad[0][1]}")
        time.sleep(verify_s * len(good) / batch)  # verifiers and label model on their own device
        pipe = r.pipeline(transaction=True)
        for e, g in good:
            rewards = np.linspace(0.0, 1.0, g.group_size, dtype=np.float32)
            pipe.xadd(keys.scored, {FIELD: ScoredGroup(
                rollout=g, verifier_names=("v0", "v1"), votes=np.ones((g.group_size, 2), dtype=np.float32),
                rewards=rewards, truth=(rewards > 0.5).astype(np.float32), reward_mode="weaver",
                labelmodel_version=0, verifier_id="ver-0", scored_at=time.time()).encode()})
            pipe.xack(keys.rollouts, VERIFIERS_GROUP, e.id)
        pipe.execute()
        heartbeat(r, keys, "ver-0", "verifier", "scored")


def trainer(r, keys: Keys, *, eta: int, batch: int, steps: int, train_s: float) -> None:
    """The trainer's loop (pipeline/consumers/trainer.py) with the optimizer step replaced by a sleep.

    Appends one JSON line per step to ``bench:steps``: when it finished, how long the
    trainer waited for its batch, and the staleness of what it consumed.
    """
    from pipeline.consumers.trainer import classify, collect_batch, commit, step_metrics, step_record

    log = _log("trainer", "trainer")
    reader = GroupReader(r, keys.scored, TRAINER_GROUP, "trainer", claim_idle_ms=0)
    version = 0
    heartbeat(r, keys, "trainer", "trainer", "ready")
    while version < steps:
        t_wait = time.perf_counter()
        got = collect_batch(reader, r, keys, size=batch, block_ms=BLOCK_MS, log=log, vocab_size=VOCAB)
        if got is None:
            break
        t_step = time.perf_counter()
        kinds = classify(got, version=version, max_staleness=eta)
        fresh = [g for (_, g), k in zip(got, kinds) if k != "stale"]
        signal = [g for (_, g), k in zip(got, kinds) if k == "trained"]
        if any(version - g.rollout.min_version > eta for g in signal):
            raise RuntimeError(f"staleness invariant violated at version {version}")
        time.sleep(train_s)  # the optimizer step on its own GPU
        version += 1
        row = step_metrics(got, fresh, signal, version=version, stats={}, wait_s=t_step - t_wait,
                           step_s=time.perf_counter() - t_step)
        commit(r, keys, [step_record(got, kinds, version=version, row=row)])
        pipe = r.pipeline(transaction=True)  # publish: generators see the version and their admission grows
        pipe.hset(keys.trainer, "version", version)
        pipe.xadd(keys.versions, {"version": version})
        pipe.rpush(f"{keys.ns}:{STEPS_KEY}", json.dumps({
            "version": version, "at": time.time(), "wait_s": row["wait_seconds"],
            "stale": row["groups_stale"], "staleness_hist": row["staleness_hist"]}))
        pipe.execute()


# --- the harness ------------------------------------------------------------------------


def run_harness(url: str, *, eta: int, steps: int = 20, warmup: int = 3, gen_s: float = 0.3, verify_s: float = 0.1,
                train_s: float = 0.2, batch: int = 32, group_size: int = 8, timeout_s: float | None = None) -> dict:
    """One run of the three stage processes for ``steps`` steps; returns the steady-state timing."""
    if steps <= warmup or warmup < 1:
        raise ValueError(f"steps ({steps}) must exceed warmup ({warmup}), and warmup must be >= 1")
    if min(gen_s, verify_s, train_s) < 0 or eta < 0 or batch < 1:
        raise ValueError("stage times must be >= 0, eta >= 0 and batch >= 1")
    keys = Keys(f"benchasync-{uuid.uuid4().hex[:8]}")
    r = connect(url, name="bench-async")
    ensure_all_groups(r, keys)
    common = [sys.executable, str(Path(__file__).resolve()), "--role", "", "--url", url, "--ns", keys.ns,
              "--eta", str(eta), "--batch", str(batch), "--group-size", str(group_size), "--steps", str(steps),
              "--gen-s", str(gen_s), "--verify-s", str(verify_s), "--train-s", str(train_s)]
    procs: dict[str, tuple[subprocess.Popen, object]] = {}
    limit = timeout_s or 60 + 5 * steps * (gen_s + verify_s + train_s)
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for role in ("trainer", "verifier", "generator"):
            cmd = list(common)
            cmd[3] = role
            err = tempfile.TemporaryFile()
            procs[role] = (subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env), err)

        def check_alive() -> None:
            for role, (p, err) in procs.items():
                if p.poll() not in (None, 0):
                    err.seek(0)
                    raise RuntimeError(f"{role} exited with {p.returncode}: {err.read().decode(errors='replace')[-2000:]}")

        deadline = time.monotonic() + limit
        while r.hlen(keys.workers) < 3:  # every stage has imported what it needs
            check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("the stage processes did not start")
            time.sleep(0.05)
        # The feeder: enough prompts that the generator never runs dry.
        pipe = r.pipeline(transaction=False)
        for i in range((steps + eta + 3) * batch):
            pipe.xadd(keys.prompts, {FIELD: PromptTask(
                prompt_id=f"p{i:08d}", prompt=" 12+345=", prompt_ids=np.arange(8, dtype=np.int32) % VOCAB,
                reference="357", issued_at=time.time()).encode()})
        pipe.execute()
        t_start = time.time()
        while procs["trainer"][0].poll() is None:
            check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"eta={eta}: {steps} steps did not finish in {limit:.0f} s")
            time.sleep(0.05)
        check_alive()
        rows = [json.loads(x) for x in r.lrange(f"{keys.ns}:{STEPS_KEY}", 0, -1)]
    finally:
        r.set(keys.stop, 1)
        for role, (p, err) in procs.items():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            err.close()
        for k in r.scan_iter(match=f"{keys.ns}:*", count=1000):
            r.delete(k)
        r.close()
    if len(rows) != steps:
        raise RuntimeError(f"eta={eta}: the trainer reported {len(rows)} of {steps} steps")
    times = [x["at"] for x in rows]
    steady = (times[-1] - times[warmup - 1]) / (steps - warmup)
    waits = [x["wait_s"] for x in rows[warmup:]]
    hist = np.zeros(eta + 2, dtype=int)
    for x in rows:
        h = x["staleness_hist"][: eta + 2]
        hist[: len(h)] += h
    ideal = ideal_step(gen_s, verify_s, train_s, eta)
    return {"eta": eta, "steps": steps, "warmup": warmup, "step_s": steady, "ideal_step_s": ideal,
            "share_of_ideal": ideal / steady, "first_step_s": times[0] - t_start,
            "trainer_idle_fraction": sum(waits) / (steady * (steps - warmup)),
            "stale_dropped": sum(x["stale"] for x in rows), "staleness_hist": hist.tolist()}


def measure(url: str, *, etas: list[int], steps: int, warmup: int, scale: float, gen_s: float, verify_s: float,
            train_s: float, batch: int) -> dict:
    g, v, t = gen_s * scale, verify_s * scale, train_s * scale
    say(f"stages (×{scale}): generate {g:.3f} s, verify {v:.3f} s, train {t:.3f} s per step of {batch} groups; "
        f"{steps} steps, the first {warmup} not timed")
    runs = []
    for eta in etas:
        say(f"eta={eta}: starting generator, verifier and trainer processes "
            f"(ideal {ideal_step(g, v, t, eta):.3f} s per step)")
        row = run_harness(url, eta=eta, steps=steps, warmup=warmup, gen_s=g, verify_s=v, train_s=t, batch=batch)
        runs.append(row)
        say(f"eta={eta}: {row['step_s']:.3f} s per step vs ideal {row['ideal_step_s']:.3f} s "
            f"({row['share_of_ideal']:.1%} of ideal); trainer idle {row['trainer_idle_fraction']:.0%}; "
            f"staleness consumed {row['staleness_hist']}, stale dropped {row['stale_dropped']}")
    sync = next((x for x in runs if x["eta"] == 0), None)
    for x in runs:
        if sync is not None and x is not sync:
            x["speedup_vs_sync"] = sync["step_s"] / x["step_s"]
            x["ideal_speedup_vs_sync"] = sync["ideal_step_s"] / x["ideal_step_s"]
    return {"aim": AIM, "scale": scale, "stage_seconds_unscaled": {"generate": gen_s, "verify": verify_s,
                                                                   "train": train_s},
            "groups_per_step": batch, "runs": runs}


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", default="", help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    p.add_argument("--ns", default="", help=argparse.SUPPRESS)
    p.add_argument("--eta", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--group-size", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--etas", default="0,1,2", help="staleness bounds to run (0 = synchronous)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing")
    p.add_argument("--scale", type=float, default=0.1, help="factor applied to the stage times")
    p.add_argument("--gen-s", type=float, default=3.0, help="generation seconds per step (before --scale)")
    p.add_argument("--verify-s", type=float, default=1.0, help="verification seconds per step (before --scale)")
    p.add_argument("--train-s", type=float, default=2.0, help="training seconds per step (before --scale)")
    p.add_argument("--batch", type=int, default=32, help="groups per step (B)")
    p.add_argument("--out", default=str(RESULTS / "async.json"))
    a = p.parse_args(argv)
    if a.role:
        r = connect(a.url, name=f"bench-async-{a.role}")
        keys = Keys(a.ns)
        if a.role == "generator":
            generator(r, keys, eta=a.eta, batch=a.batch, group_size=a.group_size, gen_s=a.gen_s)
        elif a.role == "verifier":
            verifier(r, keys, batch=a.batch, verify_s=a.verify_s)
        elif a.role == "trainer":
            trainer(r, keys, eta=a.eta, batch=a.batch, steps=a.steps, train_s=a.train_s)
        else:
            p.error(f"--role: unknown role {a.role!r}")
        return None
    try:
        etas = sorted({int(x) for x in a.etas.split(",") if x})
    except ValueError:
        p.error(f"--etas: expected comma-separated integers, got {a.etas!r}")
    if not etas or min(etas) < 0 or a.scale <= 0 or a.steps <= a.warmup or a.warmup < 1:
        p.error("--etas must be >= 0, --scale > 0, --warmup >= 1 and --steps > --warmup")
    from pipeline.bus.server import start_local_server

    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        server = start_local_server(Path(tmp))
        try:
            res = measure(server.url, etas=etas, steps=a.steps, warmup=a.warmup, scale=a.scale, gen_s=a.gen_s,
                          verify_s=a.verify_s, train_s=a.train_s, batch=a.batch)
        finally:
            server.stop()
    save_result(a.out, res, script="bench/bench_async.py", argv=argv)
    say(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
