"""The supervisor of `pipeline up` (pipeline.run.supervisor.Supervisor) and `pipeline down`, with real
processes: restarts past any fixed count, a crash-looping verifier reported while the run goes on,
the cleanup after a SIGKILLed driver (by `pipeline down` within 30 s, or by the next `pipeline
up`), no weight file left by a dead trainer, and no signal to a pid that is another process now."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis

from harness import up
from pipeline.run.launch import proc_start_time

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "pipeline.cli"]


def _alive(pid: int) -> bool:
    """Running (a zombie has exited all the same)."""
    return proc_start_time(pid) is not None


class Output:
    """The driver's merged stdout and stderr, read as it comes."""

    def __init__(self, p: subprocess.Popen) -> None:
        self.p, self.lines, self._lock = p, [], threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for raw in iter(self.p.stdout.readline, b""):
            with self._lock:
                self.lines.append(raw.decode(errors="replace"))

    @property
    def text(self) -> str:
        with self._lock:
            return "".join(self.lines)

    def wait_for(self, needle: str, timeout: float) -> float:
        t0 = time.time()
        while needle not in self.text:
            assert time.time() - t0 < timeout and self.p.poll() is None, \
                f"{needle!r} not seen within {timeout} s:\n{self.text[-4000:]}"
            time.sleep(0.2)
        return time.time() - t0

    def finish(self, timeout: float) -> str:
        self.p.wait(timeout)
        self._thread.join(10)
        return self.text


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive loopback ports free right now (the run's metrics ports are
    metrics.base_port plus an offset per worker, and pipeline up refuses a busy one)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = min(probe.getsockname()[1], 60000)
        held = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise AssertionError(f"no {n} consecutive free ports found")


def _cluster(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "runs" / "cluster.json").read_text())


def _wait_for_step(tmp_path: Path, run_id: str, p: subprocess.Popen, timeout: float = 240,
                   out: Output | None = None) -> None:
    metrics = tmp_path / "runs" / run_id / "metrics.jsonl"
    deadline = time.time() + timeout
    while not metrics.exists() or '"step"' not in metrics.read_text():
        assert time.time() < deadline and p.poll() is None, \
            "the cluster never trained a step" + (f":\n{out.text[-4000:]}" if out is not None else "")
        time.sleep(0.3)


def _version(r: redis.Redis, run_id: str) -> int:
    return int(r.hget(f"{run_id}:trainer", "version") or 0)


def _down(tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "down", "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True,
                          timeout=120)


def _heartbeat(r: redis.Redis, run_id: str, worker: str) -> dict:
    raw = r.hget(f"{run_id}:workers", worker)
    return json.loads(raw) if raw else {}


CRASH_LOOP_EXITS, KILLS = 3, 4  # more kills than a crash loop takes, each of them quick


@pytest.mark.one_server
def test_a_generator_sigkilled_more_times_than_a_crash_loop_takes_is_restarted_each_time_losing_nothing(
        tmp_path, tiny_base_model):
    """Four SIGKILLs of a generator a second into its work, one more than the crash-loop bound set here
    (3): a death by an outside signal is neither a crash nor a reason to back off longer."""
    run_id = f"kills-{uuid.uuid4().hex[:6]}"
    p = up(tmp_path, tiny_base_model, "--run-id", run_id, "--trainer.steps", "100000",
           "--cluster.restart_backoff_s", "0.5", "--cluster.restart_backoff_max_s", "2", "--redis.claim_idle_ms", "1500",
           "--cluster.crash_loop_exits", str(CRASH_LOOP_EXITS))
    out = Output(p)
    try:
        _wait_for_step(tmp_path, run_id, p)
        r = redis.Redis.from_url(_cluster(tmp_path)["url"])
        killed: list[int] = []
        for _ in range(KILLS):
            deadline = time.time() + 120
            while True:  # the restarted generator is up and working: its own heartbeat, a second on
                pid = _cluster(tmp_path)["workers"]["gen-0"]
                if pid not in killed and _alive(pid) and _heartbeat(r, run_id, "gen-0").get("pid") == pid:
                    break
                assert time.time() < deadline and p.poll() is None, out.text[-4000:]
                time.sleep(0.2)
            time.sleep(1.0)
            os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
        v = _version(r, run_id)
        deadline = time.time() + 120
        while _version(r, run_id) < v + 2:  # the run goes on
            assert time.time() < deadline and p.poll() is None, out.text[-4000:]
            time.sleep(0.3)
        down = _down(tmp_path)
        assert down.returncode == 0, down.stdout + down.stderr
        text = out.finish(180)
    finally:
        if p.poll() is None:
            p.kill()
    assert text.count("gen-0 killed by signal 9") == KILLS, text[-4000:]
    # A death by an outside signal says nothing of the worker's health: each restart at the short end.
    assert text.count("restarting it in 0.5 s") >= KILLS and "restarting it in 1.0 s" not in text, text[-4000:]
    assert "crash loop" not in text.lower(), "deaths by a signal are restarts, never a crash loop"
    summary = json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())
    assert summary["status"] == "interrupted", summary["status"]
    assert summary["restarts"] >= KILLS
    a = summary["accounting"]
    assert a["ok"] and a["lost"] == 0 and a["unexpected"] == 0, a


@pytest.mark.one_server
def test_a_verifier_that_fails_on_start_is_reported_as_a_crash_loop_while_the_run_goes_on(tmp_path,
                                                                                           tiny_base_model):
    run_id = f"loop-{uuid.uuid4().hex[:6]}"
    base = _free_ports(16)
    p = up(tmp_path, tiny_base_model, "--run-id", run_id, "--trainer.steps", "100000",
           "--metrics.base_port", str(base), "--cluster.crash_loop_exits", "3",
           "--cluster.crash_loop_uptime_s", "30", "--cluster.restart_backoff_s", "0.5",
           "--cluster.restart_backoff_max_s", "2")
    out = Output(p)
    blocker = socket.socket()
    try:
        _wait_for_step(tmp_path, run_id, p, out=out)
        port = json.loads((tmp_path / "runs" / run_id / "ports.json").read_text())["ports"]["ver-1"]
        info = _cluster(tmp_path)
        r = redis.Redis.from_url(info["url"])
        # ver-1 dies, and its metrics port is taken while it is down: every start fails at once.
        os.killpg(info["workers"]["ver-1"], signal.SIGKILL)
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.time() + 5
        while True:
            try:
                blocker.bind(("127.0.0.1", port))
                break
            except OSError:
                assert time.time() < deadline, f"port {port} never came free"
                time.sleep(0.02)
        blocker.listen()
        took = out.wait_for("CRASH LOOP: ver-1", timeout=90)
        text = out.text
        assert "ver-1 is in a crash loop" in text, text[-4000:]
        assert "cannot serve" in text and str(port) in text, "its error line is reported"
        assert _heartbeat(r, run_id, "ver-1").get("state") == "crash_loop"
        # The run goes on: the driver and trainer alive, training progressing.
        v = _version(r, run_id)
        deadline = time.time() + 120
        while _version(r, run_id) < v + 2:
            assert time.time() < deadline and p.poll() is None, text[-4000:]
            time.sleep(0.3)
        assert p.poll() is None
        print(f"crash loop reported {took:.1f} s after the port was taken")
        # The port free again, the verifier comes back by itself.
        blocker.close()
        deadline = time.time() + 120
        while True:
            pid = _cluster(tmp_path)["workers"]["ver-1"]
            if _alive(pid) and _heartbeat(r, run_id, "ver-1").get("pid") == pid:
                break
            assert time.time() < deadline and p.poll() is None, out.text[-4000:]
            time.sleep(0.3)
        down = _down(tmp_path)
        assert down.returncode == 0, down.stdout + down.stderr
        out.finish(180)
    finally:
        blocker.close()
        if p.poll() is None:
            p.kill()
    summary = json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["accounting"]["ok"], summary["accounting"]


def test_up_after_a_sigkilled_driver_cleans_up_its_workers_server_and_weight_files(tmp_path, tiny_base_model):
    old = f"stale-{uuid.uuid4().hex[:6]}"
    info = _sigkilled_driver(tmp_path, tiny_base_model, old)
    shm = Path("/dev/shm") / old
    pids = [*info["workers"].values(), *info["server_pids"]]

    q = up(tmp_path, tiny_base_model, "--run-id", f"next-{uuid.uuid4().hex[:6]}", "--trainer.steps", "3")
    text = q.communicate(timeout=300)[0].decode()
    assert q.returncode == 0, text[-4000:]
    assert f"records run {old!r}, whose driver (pid {info['driver_pid']}) is gone" in text, text[:3000]
    assert f"cleaned up run {old!r}" in text and "weight file(s)" in text, text[:3000]
    for pid in pids:
        assert not _alive(pid), f"pid {pid} of the old run survived"
    assert not shm.exists() or not any(shm.iterdir()), "the old run's shared-memory weights are gone"
    assert not (tmp_path / "runs" / "cluster.json").exists()


def _weights_of(run_id: str) -> list[Path]:
    shm = Path("/dev/shm") / run_id
    return list(shm.iterdir()) if shm.is_dir() else []


def _wait_for_weights(run_id: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not any(p.name.endswith(".safetensors") for p in _weights_of(run_id)):
        assert time.time() < deadline, "the trainer published no weights in /dev/shm"
        time.sleep(0.2)


def _sigkilled_driver(tmp_path: Path, base: Path, run_id: str) -> dict:
    """Starts a long run, waits for its first step and its first weights in /dev/shm, SIGKILLs its
    driver, and returns what runs/cluster.json recorded (its workers and server are still alive)."""
    p = up(tmp_path, base, "--run-id", run_id, "--trainer.steps", "100000")
    try:
        _wait_for_step(tmp_path, run_id, p)
        _wait_for_weights(run_id)
        info = _cluster(tmp_path)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    assert all(_alive(pid) for pid in [*info["workers"].values(), *info["server_pids"]]), \
        "a SIGKILLed driver leaves its workers and server running"
    return info


def _down_leaves_nothing(tmp_path: Path, run_id: str, info: dict) -> float:
    """`pipeline down`, timed; then no recorded process, no weight file, no cluster.json."""
    t0 = time.time()
    down = _down(tmp_path)
    took = time.time() - t0
    assert down.returncode == 0, down.stdout + down.stderr
    for name, pid in [*info["workers"].items(), *(("server", pid) for pid in info["server_pids"]),
                      ("driver", info["driver_pid"])]:
        assert not _alive(pid), f"{name} (pid {pid}) outlived `pipeline down`:\n{down.stdout}"
    assert _weights_of(run_id) == [], "the run's shared-memory weights are gone"
    assert not (tmp_path / "runs" / "cluster.json").exists()
    return took


def test_down_after_a_sigkilled_driver_stops_workers_then_server_and_leaves_nothing_within_30_s(tmp_path,
                                                                                                 tiny_base_model):
    run_id = f"orphans-{uuid.uuid4().hex[:6]}"
    info = _sigkilled_driver(tmp_path, tiny_base_model, run_id)
    took = _down_leaves_nothing(tmp_path, run_id, info)
    assert took < 30, f"`pipeline down` took {took:.1f} s"


@pytest.mark.one_server
def test_a_run_stopped_while_its_trainer_is_dead_leaves_no_weight_file(tmp_path, tiny_base_model):
    """The trainer SIGKILLed (its publisher never closed) and waiting out a long backoff when the
    run is stopped: the driver removes what it left in /dev/shm."""
    run_id = f"deadtrainer-{uuid.uuid4().hex[:6]}"
    p = up(tmp_path, tiny_base_model, "--run-id", run_id, "--trainer.steps", "100000",
           "--cluster.restart_backoff_s", "120", "--cluster.restart_backoff_max_s", "120")
    out = Output(p)
    try:
        _wait_for_step(tmp_path, run_id, p)
        _wait_for_weights(run_id)
        info = _cluster(tmp_path)
        os.killpg(info["workers"]["trainer"], signal.SIGKILL)
        out.wait_for("trainer killed by signal 9", timeout=30)
        assert _weights_of(run_id), "a SIGKILLed trainer leaves its weight files"
        took = _down_leaves_nothing(tmp_path, run_id, info)
        out.finish(60)
    finally:
        if p.poll() is None:
            p.kill()
    assert took < 30, f"`pipeline down` took {took:.1f} s"


@pytest.mark.one_server
def test_up_refuses_to_start_while_the_recorded_driver_is_alive(tmp_path, tiny_base_model):
    runs = tmp_path / "runs"
    runs.mkdir()
    me = os.getpid()
    (runs / "cluster.json").write_text(json.dumps({
        "run_id": "other", "url": "redis://127.0.0.1:1", "ns": "other", "stop_key": "other:stop",
        "driver_pid": me, "workers": {}, "server_pids": [], "start_times": {str(me): proc_start_time(me)}}))
    q = up(tmp_path, tiny_base_model, "--trainer.steps", "3")
    text = q.communicate(timeout=120)[0].decode()
    assert q.returncode != 0 and "is still running" in text, text
    assert (runs / "cluster.json").exists()


@pytest.mark.one_server
def test_down_never_signals_a_pid_whose_start_time_differs(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    me = os.getpid()
    got: list[int] = []
    old = {s: signal.signal(s, lambda n, f: got.append(n)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        (runs / "cluster.json").write_text(json.dumps({
            "run_id": "ghost", "url": "redis://127.0.0.1:1", "ns": "ghost", "stop_key": "ghost:stop",
            "driver_pid": me, "workers": {"gen-0": me}, "server_pid": me, "server_pids": [me],
            "start_times": {str(me): proc_start_time(me) + 1}}))
        down = _down(tmp_path)
        time.sleep(0.5)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    assert down.returncode == 0, down.stderr
    assert got == [], f"this process was signalled: {got}"
    assert down.stdout.count(f"(pid {me}): its start time differs") == 3, down.stdout
    assert "stopped" not in down.stdout, down.stdout


@pytest.mark.one_server
def test_over_the_hourly_restart_budget_the_run_ends_with_everything_stopped(tmp_path, tiny_base_model):
    run_id = f"budget-{uuid.uuid4().hex[:6]}"
    p = up(tmp_path, tiny_base_model, "--run-id", run_id, "--trainer.steps", "100000",
           "--cluster.max_restarts_per_hour", "2", "--cluster.restart_backoff_max_s", "1")
    out = Output(p)
    try:
        _wait_for_step(tmp_path, run_id, p)
        killed: list[int] = []
        while p.poll() is None and len(killed) < 3:
            info = _cluster(tmp_path)
            pid = info["workers"]["gen-0"]
            if pid not in killed and _alive(pid):
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.3)
        text = out.finish(180)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, text[-4000:]
    assert "over cluster.max_restarts_per_hour = 2" in text, text[-4000:]
    for pid in [*info["workers"].values(), *info["server_pids"]]:
        assert not _alive(pid), f"pid {pid} outlived the run"
    assert not (tmp_path / "runs" / "cluster.json").exists()
    summary = json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())
    assert summary["status"].startswith("failed: gen-0 keeps exiting"), summary["status"]
