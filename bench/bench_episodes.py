"""Multi-turn episodes: does environment latency stay off the generator's critical path?

The generator stage's own continuous loop (``generator.swap = "step"``, real Redis-compatible
server, the real slot sampler on a small random-weight model, real admission and emit)
runs three-turn episodes whose every environment step first sleeps ``--env-ms`` (a remote
tool or sandbox), against the same workload with an instant environment, for the same
wall time. Episodes waiting on their environment hold no slot (up to ``env.max_in_flight``
completions per generator), so decoding goes on while they wait. Figures: sampled tokens
per second (observation tokens not counted), episodes per second, turns per episode,
environment step latency.

    python bench/bench_episodes.py [--seconds 12] [--env-ms 50] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from common import progress, save_result

from pipeline.bus.connection import connect
from pipeline.bus.stats import read_stats
from pipeline.bus.streams import ensure_all_groups
from pipeline.config import load_config
from pipeline.keys import Keys
from pipeline.records import RolloutGroup

RESULTS = ROOT / "bench" / "results"
AIM = 0.80
"""Sampled tokens/s with the slow environment over the instant one."""

say = progress("bench-episodes")
DELAY_ENV = "RLPIPE_BENCH_ENV_DELAY_S"
"""The delay reaches the environment through the process environment: the generator loads
the factory by its file path, as a module of its own."""


class SlowEpisode:
    """Sleeps, then answers every turn with one digit; done at the third turn (reward 1)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.turns = delay_s, 0

    def reset(self) -> str:
        return ""

    def step(self, action: str):
        from pipeline.envs.base import Step

        time.sleep(self.delay_s)
        self.turns += 1
        return Step(observation=str(len(action) % 10), reward=1.0 if self.turns == 3 else None,
                    done=self.turns == 3)

    def close(self) -> None:
        pass


def slow_env(cfg):
    delay = float(os.environ.get(DELAY_ENV, "0"))
    return lambda task: SlowEpisode(delay)


def make_base(path: Path) -> Path:
    import torch

    from pipeline.model.qwen import ModelShape, build_model, save_checkpoint
    from pipeline.model.tokenizer import CharTokenizer

    torch.manual_seed(0)
    tok = CharTokenizer()
    model = build_model(ModelShape(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128),
                        tok.vocab_size, seed=0)
    save_checkpoint(model, tok, path)
    return path


def run(url: str, tmp: Path, base: Path, *, env_s: float, a) -> dict:
    from pipeline.model.tokenizer import CharTokenizer
    from pipeline.observe.logs import setup_logging
    from pipeline.producers.feeder import run_feeder
    from pipeline.producers.generator import run_generator

    os.environ[DELAY_ENV] = str(env_s)
    ns = f"benchep-{int(env_s * 1000)}ms"
    cfg = load_config(overrides={
        "runs_dir": str(tmp / "runs"), "run_id": ns, "redis.url": url, "redis.block_ms": 100,
        "model.base_dir": str(base), "generator.swap": "step", "generator.group_size": a.group_size,
        "generator.prompts_per_batch": a.prompts, "generator.slots": a.slots, "generator.threads": 1,
        "task.max_new_tokens": a.max_new_tokens, "env.kind": f"{Path(__file__).resolve()}:slow_env",
        "env.max_turns": a.max_turns, "env.workers": a.workers, "verifier.reward": "environment",
        "trainer.max_staleness": 1_000_000, "trainer.groups_per_step": a.prompts,
        "redis.max_stream_lag": 1_000_000, "feeder.backlog": 100_000, "feeder.max_prompts": 20_000})
    r = connect(url, name="bench-episodes")
    keys = Keys.of(cfg.run_id, cfg.redis)
    ensure_all_groups(r, keys)
    log = setup_logging(cfg.run_dir / "logs", stage="generator", worker="gen-0")
    run_feeder(cfg, r, keys, log, tokenizer=CharTokenizer(), max_rounds=1)
    timer = threading.Timer(a.seconds, lambda: r.set(keys.stop, 1))
    t0 = time.time()
    timer.start()
    try:
        run_generator(cfg, r, keys, "gen-0", log)
    finally:
        elapsed = time.time() - t0
        timer.cancel()
    groups = [RolloutGroup.decode(f[b"d"]) for k in keys.stream_keys("rollouts") for _, f in r.xrange(k)]
    stats = read_stats(r, keys)
    sampled = sum(int(g.loss_mask.sum()) for g in groups)
    turns = np.concatenate([g.turns for g in groups]) if groups else np.zeros(0)
    for k in r.scan_iter(match=f"{ns}:*", count=1000):
        r.delete(k)
    r.close()
    steps = stats.get("env_steps_total", 0) + stats.get("env_errors_total", 0)
    return {"env_ms": env_s * 1000, "seconds": elapsed, "groups": len(groups), "sampled_tokens": sampled,
            "sampled_tokens_per_s": sampled / elapsed, "episodes_per_s": len(groups) * a.group_size / elapsed,
            "turns_per_episode": float(turns.mean()) if turns.size else 0.0,
            "env_step_s_mean": stats.get("env_step_seconds_total", 0) / max(steps, 1),
            "env_errors": stats.get("env_errors_total", 0)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=12.0, help="wall time per case")
    p.add_argument("--env-ms", type=float, default=50.0, help="latency of every environment step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--workers", type=int, default=64, help="env.workers: environment steps at once")
    p.add_argument("--repeats", type=int, default=2, help="runs of each case (medians reported)")
    p.add_argument("--out", default=str(RESULTS / "episodes.json"))
    a = p.parse_args(argv)
    if a.seconds <= 0 or a.env_ms < 0 or a.repeats < 1:
        p.error("--seconds must be > 0, --env-ms >= 0 and --repeats >= 1")
    from pipeline.bus.server import start_local_server

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-episodes-") as tmp:
        base = make_base(Path(tmp) / "base")
        server = start_local_server(Path(tmp) / "server")
        try:
            for env_ms in [0.0, a.env_ms] * a.repeats:  # alternated, so drift hits both alike
                say(f"environment step {env_ms:g} ms: {a.seconds:g} s of three-turn episodes, {a.slots} slots, "
                    f"{a.prompts} prompts x {a.group_size}, up to {a.max_turns} turns")
                row = run(server.url, Path(tmp), base, env_s=env_ms / 1000, a=a)
                runs.append(row)
                say(f"environment step {env_ms:g} ms: {row['sampled_tokens_per_s']:.0f} sampled tokens/s, "
                    f"{row['episodes_per_s']:.1f} episodes/s, {row['turns_per_episode']:.2f} turns per episode, "
                    f"env step {row['env_step_s_mean'] * 1000:.1f} ms")
        finally:
            server.stop()
    def median(env_ms: float, key: str) -> float:
        return float(np.median([x[key] for x in runs if x["env_ms"] == env_ms]))

    instant, slow = (median(0.0, "sampled_tokens_per_s"), median(a.env_ms, "sampled_tokens_per_s"))
    res = {"aim": AIM, "runs": runs, "instant_tokens_per_s": instant, "slow_tokens_per_s": slow,
           "ratio": slow / max(instant, 1e-9),
           "workload": {"env_ms": a.env_ms, "slots": a.slots, "group_size": a.group_size, "prompts": a.prompts,
                        "max_turns": a.max_turns, "max_new_tokens": a.max_new_tokens, "workers": a.workers}}
    say(f"{a.env_ms:g} ms environment / instant (medians of {a.repeats}): {res['ratio']:.2f} of the sampled "
        f"tokens/s (aim >= {AIM})")
    save_result(a.out, res, script="bench/bench_episodes.py", argv=argv)
    say(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
