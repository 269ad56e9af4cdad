"""Weight sync between real OS processes: announcements, late joiners, kill -9 on either side."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipeline.observe.logs import setup_logging
from pipeline.model.qwen import load_state_tensors
from pipeline.producers.generator import swap_weights
from pipeline.weights import TRANSPORTS, WeightsError, make_fetcher, make_publisher
from pipeline.weights.shm import default_root
from weights_worker import digest, synthetic_tensors

WORKER = Path(__file__).resolve().parent.parent / "bench" / "weights_worker.py"

try:
    import ucxx  # noqa: F401

    UCX_SKIP = None
except ImportError as e:
    UCX_SKIP = f"the ucx transport needs the optional extra (pip install -e '.[ucx]'): {e}"

KEY = "run1:weights"
REPO = Path(__file__).resolve().parents[1]


class Worker:
    """A ``bench/weights_worker.py`` process whose JSON lines arrive on a queue."""

    def __init__(self, role: str, transport: str, redis_url: str, *args: str) -> None:
        cmd = [sys.executable, str(WORKER), role, "--transport", transport,
               "--redis-url", redis_url, "--key", KEY, *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def expect(self, event: str, timeout: float = 30.0, **match: object) -> dict:
        """The next line with this event (and these fields); other events are skipped."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {event} {match} within {timeout}s (exit code {self.proc.poll()})")
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line["event"] == event and all(line.get(k) == v for k, v in match.items()):
                return line

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    if request.param == "ucx" and UCX_SKIP:
        pytest.skip(UCX_SKIP)
    return request.param


@pytest.fixture
def workers(redis_url: str) -> Iterator:
    started: list[Worker] = []
    namespaces: list[str] = []

    def start(role: str, transport: str, *args: str) -> Worker:
        if role == "publish" and "--ns" not in args:
            args = (*args, "--ns", f"test-{uuid.uuid4().hex[:12]}")
        if role == "publish":
            namespaces.append(args[args.index("--ns") + 1])
        w = Worker(role, transport, redis_url, *args)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()
    for ns in namespaces:  # files of publishers killed with -9
        shutil.rmtree(default_root() / ns, ignore_errors=True)


@pytest.fixture
def ns() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def test_a_late_joiner_gets_the_newest_version_then_pub_sub_wakes_it_for_each_later_one(transport, workers):
    publisher = workers("publish", transport, "--bytes", "300000", "--versions", "1")
    v1 = publisher.expect("published", version=1)
    publisher.expect("ready")
    # recheck_s=60: only a PUB note can wake the fetcher in time for the later versions.
    fetcher = workers("fetch", transport, "--recheck-s", "60", "--digest", "--until-version", "5")
    assert fetcher.expect("applied", version=1)["digest"] == v1["digest"]  # from the durable hash

    publisher.send("publish 2")
    v2 = publisher.expect("published", version=2)
    applied = fetcher.expect("applied", version=2, timeout=20)
    assert applied["digest"] == v2["digest"]
    assert applied["at"] - v2["announced_at"] < 20  # woken by the note, not the 60 s recheck

    publisher.send("publish 5")  # versions 3 and 4 are skipped
    v5 = publisher.expect("published", version=5)
    assert fetcher.expect("applied", timeout=20)["version"] == 5
    fetcher.proc.wait(timeout=20)
    assert fetcher.proc.returncode == 0
    assert v5["digest"] != v2["digest"]


@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t != "shm"])  # shm readers share nothing
def test_a_fetcher_killed_mid_fetch_is_replaced_and_the_publisher_keeps_serving(
    transport, workers, redis_client, ns
):
    if transport == "ucx" and UCX_SKIP:
        pytest.skip(UCX_SKIP)
    publisher = make_publisher(transport, redis_client, KEY, ns=ns, keep_versions=2)
    try:
        publisher.publish(1, synthetic_tensors(24 << 20, seed=1))
        doomed = workers("fetch", transport, "--until-version", "1")
        doomed.expect("started")
        time.sleep(0.3)  # let it get into the transfer
        doomed.kill9()

        tensors = synthetic_tensors(1 << 20, seed=2)
        publisher.publish(2, tensors)
        replacement = workers("fetch", transport, "--digest", "--until-version", "2")
        assert replacement.expect("applied", version=2)["digest"] == digest(tensors)
        with make_fetcher(transport, redis_client, KEY) as fetcher:  # still serving in-process too
            assert digest(fetcher.fetch(2)[1]) == digest(tensors)
    finally:
        publisher.close()


def _fetch_or_error(fetcher, version: int) -> object:
    try:
        return fetcher.fetch(version)
    except WeightsError as e:
        return e


def test_a_tcp_publisher_killed_mid_transfer_costs_one_timeout_and_the_old_weights_stay(workers, redis_client):
    # 16 MiB in 4 KiB buckets, one request in flight: thousands of round trips to kill into.
    publisher = workers("publish", "tcp", "--bytes", str(16 << 20), "--versions", "1,2", "--bucket-bytes", "4096")
    publisher.expect("ready", timeout=60)
    fetcher = make_fetcher("tcp", redis_client, KEY, timeout_s=2.0, max_in_flight=1)
    try:
        _, model = fetcher.fetch(1)
        kept = digest(model)
        result: list[object] = []
        thread = threading.Thread(target=lambda: result.append(_fetch_or_error(fetcher, 2)))
        thread.start()
        time.sleep(0.2)
        publisher.kill9()
        killed = time.monotonic()
        thread.join(timeout=30)
        assert isinstance(result[0], WeightsError), "the transfer finished before the kill; make it longer"
        assert "no reply within 2s" in str(result[0])
        assert time.monotonic() - killed < 2.0 + 3.0
        assert digest(model) == kept
    finally:
        fetcher.close()


@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t != "shm"])
def test_a_dead_publisher_costs_one_timeout_and_its_restarted_successor_is_found(transport, workers, redis_client):
    if transport == "ucx" and UCX_SKIP:
        pytest.skip(UCX_SKIP)
    publisher = workers("publish", transport, "--bytes", "100000", "--versions", "1")
    publisher.expect("ready")
    fetcher = make_fetcher(transport, redis_client, KEY, timeout_s=1.0)
    try:
        fetcher.fetch(1)
        publisher.kill9()
        started = time.monotonic()
        with pytest.raises(WeightsError, match="within 1s"):
            fetcher.fetch()
        assert time.monotonic() - started < 1.0 + 3.0
        restarted = workers("publish", transport, "--bytes", "100000", "--versions", "9")
        v9 = restarted.expect("published", version=9)
        version, tensors = fetcher.fetch()
        assert version == 9 and digest(tensors) == v9["digest"]
    finally:
        fetcher.close()


def test_an_shm_publisher_killed_mid_write_never_exposes_a_partial_version(workers, redis_client, ns):
    publisher = workers("publish", "shm", "--bytes", str(48 << 20), "--versions", "1", "--ns", ns)
    v1 = publisher.expect("published", version=1, timeout=60)
    publisher.expect("ready")
    publisher.send("publish 2")
    time.sleep(0.3)  # usually mid-write of version 2; either way the check below must hold
    publisher.kill9()

    with make_fetcher("shm", redis_client, KEY) as fetcher:
        version, tensors = fetcher.fetch()
        assert digest(tensors) == (v1["digest"] if version == 1 else digest(synthetic_tensors(48 << 20, seed=2)))
    successor = make_publisher("shm", redis_client, KEY, ns=ns)
    try:
        successor.publish(3, synthetic_tensors(1000, seed=3))
        assert [p.name for p in successor.directory.iterdir()] == ["run1_weights.v3.safetensors"]
    finally:
        successor.close()


def test_a_flipped_byte_is_rejected_and_the_generator_keeps_its_weights(transport, redis_client, ns, tmp_path):
    log = setup_logging(tmp_path, stage="generator", worker="g0")
    model = torch.nn.Linear(64, 32)
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}

    class ModuleEngine:  # the torch generator's swap, on a bare module
        def load_weights(self, tensors):
            load_state_tensors(model, tensors)

    engine = ModuleEngine()
    publisher = make_publisher(transport, redis_client, KEY, ns=ns, bucket_bytes=1024)
    fetcher = make_fetcher(transport, redis_client, KEY)
    try:
        publisher.publish(1, state)
        assert swap_weights(fetcher, engine, 0, log) == 1
        before = {name: t.clone() for name, t in model.state_dict().items()}
        manifest = publisher.publish(2, {name: t + 1 for name, t in state.items()})
        _flip_a_data_byte(publisher, manifest)

        assert swap_weights(fetcher, engine, 1, log) == 1  # rejected: still on version 1
        failures = [json.loads(line) for line in (tmp_path / "g0.jsonl").read_text().splitlines()]
        assert [f["event"] for f in failures if f["event"] == "weights_fetch_failed"] == ["weights_fetch_failed"]
        assert "checksum" in failures[-1]["error"] and failures[-1]["keeping"] == 1
        for name, t in model.state_dict().items():
            assert torch.equal(t, before[name]), name
        publisher.publish(3, {name: t + 3 for name, t in state.items()})
        assert swap_weights(fetcher, engine, 1, log) == 3  # the retry at the next batch succeeds
        assert torch.equal(model.state_dict()["bias"], state["bias"] + 3)
    finally:
        fetcher.close()
        publisher.close()


def test_a_fetch_that_finds_the_trainer_ended_is_skipped_not_failed(transport, redis_client, ns, tmp_path):
    """The trainer writes its final state, then closes its publisher (every payload released):
    a generator's fetch that finds the payload gone after that is the run's end, logged as
    ``weights_fetch_skipped``; while the trainer is still training it is a ``weights_fetch_failed``."""
    log = setup_logging(tmp_path, stage="generator", worker="g0")
    model = torch.nn.Linear(16, 8)
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}

    class ModuleEngine:
        def load_weights(self, tensors):
            load_state_tensors(model, tensors)

    trainer_key = f"{ns}:trainer"

    def ended() -> bool:
        return redis_client.hget(trainer_key, "state") == b"finished"

    publisher = make_publisher(transport, redis_client, KEY, ns=ns)
    fetcher = make_fetcher(transport, redis_client, KEY, **({} if transport == "shm" else {"timeout_s": 1.0}))
    try:
        redis_client.hset(trainer_key, "state", "training")
        publisher.publish(1, state)
        assert swap_weights(fetcher, ModuleEngine(), 0, log, publisher_closed=ended) == 1
        publisher.publish(2, {name: t + 1 for name, t in state.items()})
        publisher.close()
        assert swap_weights(fetcher, ModuleEngine(), 1, log, publisher_closed=ended) == 1
        redis_client.hset(trainer_key, "state", "finished")
        assert swap_weights(fetcher, ModuleEngine(), 1, log, publisher_closed=ended) == 1
        events = [json.loads(line) for line in (tmp_path / "g0.jsonl").read_text().splitlines()]
        ends = [(e["event"], e["version"]) for e in events if e["event"].startswith("weights_fetch_")]
        assert ends == [("weights_fetch_failed", 2), ("weights_fetch_skipped", 2)], ends
        assert torch.equal(model.state_dict()["bias"], state["bias"])  # still version 1
    finally:
        redis_client.delete(trainer_key)
        fetcher.close()
        publisher.close()


def _flip_a_data_byte(publisher, manifest) -> None:
    position = manifest.tensors[0].start + 5
    if manifest.transport == "shm":
        with open(manifest.address, "r+b") as f:
            f.seek(position)
            (byte,) = f.read(1)
            f.seek(position)
            f.write(bytes([byte ^ 0x01]))
        return
    with publisher._lock:  # fault injection into the server's store
        publisher._payloads[manifest.version][position] ^= 0x01
