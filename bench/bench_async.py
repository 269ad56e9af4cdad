"""Asynchronous against synchronous RL, measured on the stages' own loops.

A feeder, a generator, a verifier and a trainer run as separate OS processes on a real
Redis server, each running the stage function users run (``run_feeder``,
``run_generator``, ``run_verifier``, ``run_trainer``: the one ``pipeline.stage`` loop,
admission and version wake-ups, backpressure, dead letters, MULTI of output + ack, the
real weak verifiers and Weaver label model, the trainer's staleness rule, checkpoints,
commits and weight publishing over shm). Only the engines are fakes: the generator's
backend, the verifier's scorer and the trainer's engine each sleep for the time its
device work would take (by default generate 3 s, verify 1 s, train 2 s per step of B
groups, scaled ×0.1 so a run takes seconds), each stage being its own resource.

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
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from common import progress, save_result

from pipeline.bus.connection import connect
from pipeline.bus.streams import ensure_all_groups
from pipeline.config import load_config
from pipeline.engines import Sampled
from pipeline.keys import Keys
from pipeline.model.tokenizer import MAX_POSITIONS, CharTokenizer
from pipeline.observe.logs import setup_logging

RESULTS = ROOT / "bench" / "results"
AIM = 0.90
"""Share of the ideal step time the pipeline should reach (overhead below 10%)."""
BLOCK_MS = 500
ANSWERS = ("357", "356", "357", "12", "1", "357", "99", "356")
"""Completions the fake generator writes (varied, so the weak verifiers and rewards differ)."""


say = progress("bench-async")


def ideal_step(gen_s: float, verify_s: float, train_s: float, eta: int) -> float:
    """Seconds per step with perfect overlap: the slowest stage, or the whole loop spread over η + 1 steps."""
    return max(gen_s, verify_s, train_s, (gen_s + verify_s + train_s) / (eta + 1))


# --- fake engines: a calibrated sleep in place of each device ------------------------------


def write_model_dir(path: Path) -> Path:
    """The checkpoint files the stages read besides the weights: tokenizer and config.json."""
    tok = CharTokenizer()
    tok.save(path)
    (path / "config.json").write_text(json.dumps({"vocab_size": tok.vocab_size,
                                                  "max_position_embeddings": MAX_POSITIONS}))
    return path


class SleepGenerator:
    """A ``GenerationBackend`` that sleeps ``seconds_per_prompt`` per prompt and writes fixed answers."""

    def __init__(self, seconds_per_prompt: float) -> None:
        self.tokenizer = CharTokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        self.seconds_per_prompt = seconds_per_prompt

    def generate(self, prompts, *, n: int, max_new_tokens: int, temperature: float) -> list[Sampled]:
        time.sleep(self.seconds_per_prompt * len(prompts))  # generation on its own GPU
        rows = []
        for j in range(n):
            ids = self.tokenizer.encode(ANSWERS[j % len(ANSWERS)]) + [self.tokenizer.eos_id]
            rows.append((ids, [-0.5] * len(ids)))
        return [Sampled.from_rows(rows, pad_id=self.tokenizer.pad_id) for _ in prompts]

    def load_weights(self, tensors) -> None:
        pass

    def close(self) -> None:
        pass


class SleepScorer:
    """The real weak verifiers, plus a sleep of ``seconds_per_group`` for the device-bound ones."""

    def __init__(self, scorer, seconds_per_group: float) -> None:
        self.scorer, self.seconds_per_group = scorer, seconds_per_group
        self.stats = scorer.stats

    def score(self, prompt, completions, *, only=None):
        time.sleep(self.seconds_per_group)  # verifiers on their own device
        return self.scorer.score(prompt, completions, only=only)


class SleepEngine:
    """A ``TrainEngine`` whose optimizer step is a sleep of ``seconds`` and whose weights are one small tensor."""

    def __init__(self, seconds: float) -> None:
        import torch

        self.tokenizer = CharTokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        self.seconds = seconds
        self._weights = {"w": torch.zeros(256)}

    def train_step(self, groups) -> dict:
        time.sleep(self.seconds)  # the optimizer step on its own GPU
        return {"tokens": int(sum(int(g.rollout.completion_lens.sum()) for g in groups))}

    def lr_step(self) -> None:
        pass

    def weights(self):
        return self._weights

    def greedy(self, prompts, *, max_new_tokens: int) -> list[str]:
        return ["0"] * len(prompts)

    def save_state(self, directory: Path) -> dict:
        return {}

    def load_state(self, directory: Path, extras: dict) -> None:
        pass

    def export_hf(self, directory: Path) -> None:
        pass

    def close(self) -> None:
        pass


def bench_config(*, runs_dir: Path, run_id: str, url: str, eta: int, batch: int, group_size: int, steps: int,
                 model_dir: Path, overrides: dict | None = None):
    """The run's config: the defaults of a real run, with the bench's sizes (then ``overrides``)."""
    return load_config(overrides={
        "runs_dir": str(runs_dir), "run_id": run_id, "redis.url": url, "redis.block_ms": BLOCK_MS,
        "model.base_dir": str(model_dir), "trainer.max_staleness": eta, "trainer.groups_per_step": batch,
        "trainer.steps": steps, "trainer.eval_every": steps, "trainer.checkpoint_every": steps,
        "generator.group_size": group_size, "generator.prompts_per_batch": batch, "verifier.batch": batch,
        "task.heldout_size": 8, "weights.transport": "shm", "feeder.backlog": 4 * batch, **(overrides or {})})


def run_role(role: str, cfg, *, gen_s: float, verify_s: float, train_s: float) -> None:
    """One stage process: the stage's own function with a fake engine."""
    from pipeline.consumers.trainer import run_trainer
    from pipeline.consumers.verifier import make_scorer, run_verifier
    from pipeline.producers.feeder import run_feeder
    from pipeline.producers.generator import run_generator

    r = connect(cfg.redis.url, name=f"bench-async-{role}", redis_cfg=cfg.redis)
    keys = Keys.of(cfg.run_id, cfg.redis)
    log = setup_logging(cfg.run_dir / "logs", stage=role, worker=role)
    batch = cfg.trainer.groups_per_step
    if role == "feeder":
        run_feeder(cfg, r, keys, log, tokenizer=CharTokenizer())
    elif role == "generator":
        run_generator(cfg, r, keys, "gen-0", log, backend=SleepGenerator(gen_s / batch))
    elif role == "verifier":
        run_verifier(cfg, r, keys, "ver-0", log, scorer=SleepScorer(make_scorer(cfg.verifier), verify_s / batch))
    elif role == "trainer":
        run_trainer(cfg, r, keys, log, run_dir=cfg.run_dir, engine=SleepEngine(train_s))
    else:
        raise ValueError(f"--role: unknown role {role!r}")


# --- the harness ------------------------------------------------------------------------


def run_harness(url: str, *, eta: int, steps: int = 20, warmup: int = 3, gen_s: float = 0.3, verify_s: float = 0.1,
                train_s: float = 0.2, batch: int = 32, group_size: int = 8, timeout_s: float | None = None,
                overrides: dict | None = None, watch_lengths: bool = False) -> dict:
    """One run of the four stage processes for ``steps`` steps; returns the steady-state timing.

    ``overrides`` are config overrides for every stage; with ``watch_lengths`` the length of
    every stream of the run is sampled while it runs and the maxima are returned
    (``max_lengths``: stream name -> entries, summed over shards; ``length_samples``).
    """
    if steps <= warmup or warmup < 1:
        raise ValueError(f"steps ({steps}) must exceed warmup ({warmup}), and warmup must be >= 1")
    if min(gen_s, verify_s, train_s) < 0 or eta < 0 or batch < 1:
        raise ValueError("stage times must be >= 0, eta >= 0 and batch >= 1")
    tmp = Path(tempfile.mkdtemp(prefix="bench-async-"))
    run_id = f"benchasync-{uuid.uuid4().hex[:8]}"
    model_dir = write_model_dir(tmp / "model")
    cfg = bench_config(runs_dir=tmp / "runs", run_id=run_id, url=url, eta=eta, batch=batch, group_size=group_size,
                       steps=steps, model_dir=model_dir, overrides=overrides)
    keys = Keys.of(cfg.run_id, cfg.redis)
    r = connect(url, name="bench-async")
    ensure_all_groups(r, keys)
    common = [sys.executable, str(Path(__file__).resolve()), "--role", "", "--url", url, "--ns", run_id,
              "--runs-dir", str(tmp / "runs"), "--model-dir", str(model_dir), "--eta", str(eta),
              "--batch", str(batch), "--group-size", str(group_size), "--steps", str(steps),
              "--gen-s", str(gen_s), "--verify-s", str(verify_s), "--train-s", str(train_s),
              "--overrides", json.dumps(overrides or {})]
    procs: dict[str, tuple[subprocess.Popen, object]] = {}
    watched = {name: keys.stream_keys(name) for name in ("prompts", "rollouts", "scored", "dead", "trainlog")}
    watched["versions"] = [keys.versions]
    max_lengths = {name: 0 for name in watched}
    samples = 0
    limit = timeout_s or 60 + 5 * steps * (gen_s + verify_s + train_s)
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for role in ("trainer", "verifier", "generator", "feeder"):
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
        while procs["trainer"][0].poll() is None:
            check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"eta={eta}: {steps} steps did not finish in {limit:.0f} s")
            if watch_lengths:
                pipe = r.pipeline(transaction=False)
                for ks in watched.values():
                    for k in ks:
                        pipe.xlen(k)
                got = iter(pipe.execute())
                for name, ks in watched.items():
                    max_lengths[name] = max(max_lengths[name], sum(next(got) for _ in ks))
                samples += 1
            time.sleep(0.05)
        check_alive()
        rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    finally:
        r.set(keys.stop, 1)
        for role, (p, err) in procs.items():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            err.close()
        for k in r.scan_iter(match=f"{run_id}:*", count=1000):
            r.delete(k)
        r.close()
        shutil.rmtree(tmp, ignore_errors=True)
    start = next(x["time"] for x in rows if x["kind"] == "eval" and x["version"] == 0)
    rows = [x for x in rows if x["kind"] == "step"]
    if len(rows) != steps:
        raise RuntimeError(f"eta={eta}: the trainer reported {len(rows)} of {steps} steps")
    times = [x["time"] for x in rows]
    steady = (times[-1] - times[warmup - 1]) / (steps - warmup)
    waits = [x["wait_seconds"] for x in rows[warmup:]]
    hist = np.zeros(eta + 2, dtype=int)
    for x in rows:
        h = x["staleness_hist"][: eta + 2]
        hist[: len(h)] += h
    ideal = ideal_step(gen_s, verify_s, train_s, eta)
    return {"eta": eta, "steps": steps, "warmup": warmup, "step_s": steady, "ideal_step_s": ideal,
            "share_of_ideal": ideal / steady, "first_step_s": times[0] - start,
            "trainer_idle_fraction": sum(waits) / (steady * (steps - warmup)),
            "stale_dropped": sum(x["groups_stale"] for x in rows), "staleness_hist": hist.tolist(),
            **({"max_lengths": max_lengths, "length_samples": samples} if watch_lengths else {})}


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
    p.add_argument("--runs-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
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
        cfg = bench_config(runs_dir=Path(a.runs_dir), run_id=a.ns, url=a.url, eta=a.eta, batch=a.batch,
                           group_size=a.group_size, steps=a.steps, model_dir=Path(a.model_dir),
                           overrides=json.loads(a.overrides))
        run_role(a.role, cfg, gen_s=a.gen_s, verify_s=a.verify_s, train_s=a.train_s)
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
