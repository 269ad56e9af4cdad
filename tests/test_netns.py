"""Several hosts on one machine: the pipeline across Linux network namespaces.

Each "host" is a network namespace with its own veth interface on its own /24 subnet,
joined by a router namespace that forwards between them, so nothing reaches another
host over loopback:

    redis   10.231.1.2  redis-server bound to that address only
    trainer 10.231.2.2  pipeline train, tcp weights publisher bound to 10.231.2.2
    workers 10.231.3.2  pipeline feed, generate (gen-0), verify (ver-0)

All of them read the same config file (the filesystem is shared, as on a cluster with a
shared file system); only the trainer is told its own address (``--weights.tcp_host``),
as the Slurm template and the Kubernetes manifests do. The test checks that records
crossed from the workers' host to the trainer's through the Redis host (the accounting
is complete) and that the generator swapped in versions > 0 fetched over tcp from the
trainer's address. It needs root and ``ip netns``; elsewhere it skips, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import tiny_config
from pipeline.keys import Keys
from pipeline.bus.server import find_server_binary

pytestmark = pytest.mark.slow

STEPS = 3
B = 4
REDIS_PORT = 6390
HOSTS = {"redis": 1, "trainer": 2, "workers": 3}  # host name -> subnet 10.231.<k>.0/24


def _ip(*args: str) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")


def _why_no_netns() -> str | None:
    """None when network namespaces can be made here, else the reason to skip."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"rlp-probe-{os.getpid()}"
    p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if p.returncode != 0:
        return f"`ip netns add` is not permitted here: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture
def hosts():
    """Three host namespaces and a router namespace; {host: (netns name, address)}.

    The finalizer deletes every namespace it made (veth pairs go with them)."""
    reason = _why_no_netns()
    if reason:
        pytest.skip(reason)
    tag = f"rlp{os.getpid() % 100000}"
    router = f"{tag}-router"
    made: list[str] = []
    out: dict[str, tuple[str, str]] = {}
    try:
        _ip("netns", "add", router)
        made.append(router)
        # The router forwards between the hosts' subnets (a per-namespace setting; the host's is untouched).
        subprocess.run(["ip", "netns", "exec", router, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"], check=True)
        for host, k in HOSTS.items():
            ns, inner, outer = f"{tag}-{host}", f"{tag}h{k}", f"{tag}r{k}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer, "netns", router)
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", router, "addr", "add", f"10.231.{k}.1/24", "dev", outer)
            _ip("-n", router, "link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"10.231.{k}.2/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", f"10.231.{k}.1")
            out[host] = (ns, f"10.231.{k}.2")
        yield out
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _in(ns: str, *cmd: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, **kw)


def _python_in(ns: str, code: str) -> str:
    p = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _start_redis(ns: str, addr: str, data_dir: Path) -> subprocess.Popen:
    server = _in(ns, find_server_binary(), "--bind", addr, "--port", str(REDIS_PORT), "--protected-mode", "no",
                 "--save", "", "--appendonly", "yes", "--dir", str(data_dir), "--logfile", "")
    deadline = time.time() + 20
    seen = []
    while time.time() < deadline:
        line = server.stdout.readline().decode(errors="replace")
        seen.append(line)
        if "Ready to accept connections" in line:
            return server
        if not line and server.poll() is not None:
            break
    server.kill()
    raise RuntimeError("redis-server did not start in its namespace:\n" + "".join(seen))


def _events(run_dir: Path, worker: str) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "logs" / f"{worker}.jsonl").read_text().splitlines()]


def test_the_pipeline_runs_across_network_namespaces_with_tcp_weights(tmp_path, tiny_base_model, hosts):
    (redis_ns, redis_addr), (trainer_ns, trainer_addr), (workers_ns, _) = (
        hosts["redis"], hosts["trainer"], hosts["workers"])
    url = f"redis://{redis_addr}:{REDIS_PORT}/0"
    cfg, path = tiny_config(tmp_path, tiny_base_model, url, "netns", **{
        "trainer.steps": STEPS, "trainer.groups_per_step": B, "trainer.eval_every": STEPS, "trainer.max_staleness": 1,
        "weights.transport": "tcp", "weights.fetch_timeout_s": 3})
    # The shared file keeps weights.tcp_host at its loopback default: only the trainer is told its
    # address, so a generator that fetched from anything but the manifest's address would fail.
    assert cfg.weights.tcp_host == "127.0.0.1"
    (tmp_path / "redis").mkdir()

    stage = [sys.executable, "-m", "pipeline.cli"]
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["redis"] = _start_redis(redis_ns, redis_addr, tmp_path / "redis")
        procs["trainer"] = _in(trainer_ns, *stage, "train", "--config", str(path), "--weights.tcp_host", trainer_addr)
        procs["feeder"] = _in(workers_ns, *stage, "feed", "--config", str(path))
        procs["gen-0"] = _in(workers_ns, *stage, "generate", "--config", str(path), "--worker-id", "gen-0")
        procs["ver-0"] = _in(workers_ns, *stage, "verify", "--config", str(path), "--worker-id", "ver-0")
        try:
            procs["trainer"].wait(150)
        finally:
            _python_in(workers_ns, f"import redis; redis.Redis.from_url({url!r}).set({Keys(cfg.run_id).stop!r}, 1)")
            for name in ("feeder", "gen-0", "ver-0"):
                try:
                    procs[name].wait(30)
                except subprocess.TimeoutExpired:
                    procs[name].kill()
        outputs = {name: procs[name].stdout.read().decode(errors="replace")
                   for name in ("trainer", "feeder", "gen-0", "ver-0")}
        for name, text in outputs.items():
            assert procs[name].returncode == 0, f"{name} exited {procs[name].returncode}:\n{text[-3000:]}"

        # Records crossed hosts: prompts from the workers' host, scored groups trained on the
        # trainer's host, all through the server on the Redis host; every prompt accounted for.
        acc = json.loads(subprocess.run(["ip", "netns", "exec", workers_ns, *stage, "account", "--config", str(path)],
                                        capture_output=True, text=True, check=True, timeout=60).stdout)
        assert acc["ok"] and acc["lost"] == 0 and acc["unexpected"] == 0, acc
        assert acc["trained"] + acc["nosignal"] + acc["stale"] == STEPS * B

        # The durable announcement names the publisher on the trainer's own address.
        weights = json.loads(_python_in(redis_ns, (
            "import json, redis; r = redis.Redis.from_url(%r, decode_responses=True); "
            "print(json.dumps(r.hgetall(%r)))") % (url, Keys(cfg.run_id).weights)))
        manifest = json.loads(weights["manifest"])
        assert int(weights["version"]) == STEPS
        assert manifest["transport"] == "tcp"
        assert manifest["address"].startswith(f"tcp://{trainer_addr}:"), manifest["address"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)

    # Weights crossed hosts: the generator (workers' host) swapped in versions > 0, which only
    # the trainer's publisher on trainer_addr could serve.
    swapped = [e["to_version"] for e in _events(cfg.run_dir, "gen-0") if e["event"] == "weights_swapped"]
    assert swapped and max(swapped) >= 1 and swapped == sorted(swapped), swapped
    versions = [e["version"] for e in _events(cfg.run_dir, "gen-0") if e["event"] == "batch_generated"]
    assert max(versions) >= 1, "the generator sampled with a version it fetched from the trainer's host"
    assert (cfg.run_dir / "checkpoints" / "final" / "model.safetensors").exists()
