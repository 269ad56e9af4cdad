"""The one harness for multi-process tests: the small run of ``configs/tiny.toml``, real processes.

- ``tiny_config``: the small run's config (tiny.toml + overrides) and its TOML file in the run dir,
  for stages started one by one (``spawn``, ``run_stages``);
- ``up``: ``pipeline up`` (or ``chaos``) on the small run, as a user starts it (the embedded
  default server unless the test passes ``--redis.url``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import redis

from pipeline.config import load_config
from pipeline.config_toml import to_toml
from pipeline.keys import Keys

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.toml"
CLI = [sys.executable, "-m", "pipeline.cli"]


def tiny_config(tmp_path: Path, base_dir: Path, url: str, run_id: str, **overrides):
    """The small run's config (``configs/tiny.toml`` + ``overrides``) and the TOML file every stage reads."""
    cfg = load_config(TINY, overrides={"run_id": run_id, "runs_dir": str(tmp_path / "runs"), "redis.url": url,
                                       "model.base_dir": str(base_dir), **overrides})
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    path = cfg.run_dir / "config.toml"
    path.write_text(to_toml(cfg))
    return cfg, path


def spawn(path: Path, stage: str, *extra: str) -> subprocess.Popen:
    """One stage process (``pipeline <stage> --config path``), output captured."""
    return subprocess.Popen([*CLI, stage, "--config", str(path), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def run_stages(cfg, path: Path, url: str, *, generators: int = 2, verifiers: int = 2,
               timeout: float = 240) -> dict[str, subprocess.Popen]:
    """Trainer, feeder, generators and verifiers as their own processes until the trainer finishes;
    then a stop for the rest. Every process must exit 0."""
    procs = {"trainer": spawn(path, "train"), "feeder": spawn(path, "feed")}
    for i in range(generators):
        procs[f"gen-{i}"] = spawn(path, "generate", "--worker-id", f"gen-{i}")
    for i in range(verifiers):
        procs[f"ver-{i}"] = spawn(path, "verify", "--worker-id", f"ver-{i}")
    r = redis.Redis.from_url(url)
    try:
        procs["trainer"].wait(timeout)
    finally:
        r.set(Keys.of(cfg.run_id, cfg.redis).stop, 1)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    outputs = {name: p.stdout.read().decode(errors="replace") for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, f"{name} exited {p.returncode}:\n{outputs[name][-3000:]}"
    return procs


def up(tmp_path: Path, base: Path, *extra: str, command: str = "up", weak_rewards: bool = True) -> subprocess.Popen:
    """``pipeline up`` (or ``chaos``) on the small run in ``tmp_path``, on the embedded default server.
    ``weak_rewards=False``: the small run without its label-model setting, for a reward that
    fits no label model (``ground_truth``, a labelled reward)."""
    config = TINY
    if not weak_rewards:
        config = tmp_path / "tiny-labelled.toml"
        config.write_text(TINY.read_text().replace("min_fit_rows = 16", ""))
    args = [*CLI, command, "--config", str(config), "--runs_dir", str(tmp_path / "runs"),
            "--model.base_dir", str(base), *extra]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the embedded default
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)


def env_servers_of(parents: set[str], *, settle_s: float = 1.0) -> list[str]:
    """Pids of environment server processes (``pipeline.envs.servers``) still running whose
    ``--parent`` is one of ``parents`` (generator pids), after ``settle_s`` for exits to land."""
    time.sleep(settle_s)
    left = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pipeline.envs.servers" in cmd and any(cmd[i + 1].decode() in parents for i, a in enumerate(cmd[:-1])
                                                   if a == b"--parent"):
            left.append(proc.name)
    return left


def stop_live_pools() -> None:
    """Close every environment server pool this process started (``pipeline.envs.servers``) and
    check that their processes are gone."""
    from pipeline.envs.servers import live_pools

    pools = live_pools()
    procs = [s.proc for p in pools for s in p.servers if s.proc is not None]
    for p in pools:
        p.close()
    assert all(proc.poll() is not None for proc in procs)
