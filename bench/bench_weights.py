"""Weight sync benchmark: each transport against its own ceiling, measured in the same run.

1. Bandwidth, per payload size (64 MiB, 256 MiB, 1 GiB by default), payload bytes / seconds:

   - ``shm``: publishing (tensors -> a version in /dev/shm: the one copy, CRC-32C, rename,
     announce) against the ceiling *memcpy into shared memory* (the same bytes copied
     into a fresh /dev/shm mapping); fetching (another process maps the file, verifies
     every bucket, views the tensors) is reported beside it.
   - ``tcp``: a fetch in another process (ZeroMQ, bucket requests, ``recv_into``, verify,
     views) against a *raw pyzmq PAIR transfer* of the same bytes between two processes
     (zero-copy sends of bucket-sized frames, ``recv_into`` a preallocated buffer).
   - ``ucx``: a fetch in another process (ucxx, one tag message per piece of at most
     ``MESSAGE_BYTES``, each piece's CRC-32C on a helper thread as it lands, views)
     against a *raw ucxx tag transfer* of the same bytes between two processes (one
     message, no check; worker addresses, error handling off). Skipped with a note
     where ucxx is not installed.

   Each figure is the best of ``--repeats`` rounds (ceiling, publish and fetch back to back,
   so all three see the same machine load), after two untimed warm-up rounds: a fetcher
   reuses its buffer, as a generator does from its second fetch on.
2. Latency from "trainer finished step v" (the snapshot is ready to publish) to "every
   generator runs v", with 4 generator-side processes (``bench/weights_worker.py fetch``:
   PUB/SUB wake-up, fetch, copy into their weights), per transport, median over versions.
3. How long a generator is blocked by a swap (fetch + copy into the model) relative to one
   generation batch, for the default tiny Qwen3 policy and batch.

Writes bench/results/weights.json and weights.md. ``make bench-weights``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

from common import progress

from pipeline.weights import DEFAULT_BUCKET_BYTES, make_fetcher, make_publisher
from weights_worker import synthetic_tensors

MiB = 1 << 20
KEY = "bench:weights"


say = progress("bench-weights")


def ucx_available() -> str | None:
    try:
        import ucxx  # noqa: F401
    except ImportError as e:
        return f"ucxx not installed ({e}); pip install -e '.[ucx]'"
    return None


# --- child processes ----------------------------------------------------------------


def child(argv: list[str]) -> None:
    """Entry point of the helper processes; prints one JSON line per measurement."""
    p = argparse.ArgumentParser()
    p.add_argument("role")
    p.add_argument("--redis-url", default="")
    p.add_argument("--transport", default="")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bytes", type=int, default=0)
    p.add_argument("--endpoint", default="")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.role == "fetch":
        import redis

        r = redis.Redis.from_url(a.redis_url)
        with make_fetcher(a.transport, r, KEY, **({"timeout_s": 120.0} if a.transport != "shm" else {})) as f:
            print(json.dumps({"ready": True}), flush=True)
            for line in sys.stdin:  # one fetch of the named version per line
                t0 = time.perf_counter()
                version, tensors = f.fetch(int(line), copy=False)
                dt = time.perf_counter() - t0
                del tensors
                print(json.dumps({"seconds": dt, "version": version}), flush=True)
    elif a.role == "zmq-recv":
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        print(json.dumps({"endpoint": f"tcp://127.0.0.1:{port}"}), flush=True)
        buf = bytearray(a.bytes)
        view = memoryview(buf)
        for _ in range(a.repeats):
            sock.recv()  # "go"
            t0 = time.perf_counter()
            sock.send(b"ready")
            got = 0
            while got < a.bytes:
                got += sock.recv_into(view[got : got + DEFAULT_BUCKET_BYTES])
            print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
        sock.close(linger=0)
        ctx.term()
    elif a.role == "ucx-recv":
        raw_ucx_receiver(a.bytes, a.repeats)


def raw_ucx_receiver(nbytes: int, repeats: int) -> None:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array

    ctx = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    worker = ucx_api.UCXWorker(ctx)
    worker.init_blocking_progress_mode()
    print(json.dumps({"address": worker.address.tobytes().hex()}), flush=True)
    buf = np.empty(nbytes, dtype=np.uint8)
    for i in range(repeats + 1):  # the first is the sender's wire-up, not timed
        req = worker.tag_recv(Array(buf), ucx_api.UCXXTag(i))
        line = sys.stdin.readline()  # the sender says when it starts
        t0 = time.perf_counter()
        _ucx_wait(worker, req)
        if i:
            print(json.dumps({"seconds": time.perf_counter() - t0, "started": float(line)}), flush=True)
        else:
            print(json.dumps({"wired": True}), flush=True)


def _ucx_wait(worker, req) -> None:
    while True:
        worker.progress()
        if req.completed:
            break
        if worker.arm():
            worker.progress_worker_event(epoll_timeout=100)
    req.check_error()


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--child", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)


def read_json(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"helper process exited ({proc.wait()}) without a result")
    return json.loads(line)


# --- 1. bandwidth -------------------------------------------------------------------


def memcpy_into_shm(src: np.ndarray) -> float:
    """Seconds to copy ``src`` into a fresh /dev/shm file mapping (the shm ceiling)."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = root / f"bench-memcpy-{uuid.uuid4().hex}"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, src.nbytes)
        m = mmap.mmap(fd, src.nbytes)
        np.copyto(np.frombuffer(m, dtype=np.uint8), src)
        seconds = time.perf_counter() - t0
        m.close()
    finally:
        os.close(fd)
        path.unlink()
    return seconds


class RawZmq:
    """A raw pyzmq PAIR transfer of ``payload`` to another process (the tcp ceiling)."""

    def __init__(self, payload: np.ndarray, repeats: int) -> None:
        import zmq

        self.payload = memoryview(payload)
        self.receiver = spawn("zmq-recv", "--bytes", str(payload.nbytes), "--repeats", str(repeats + 1))
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.connect(read_json(self.receiver)["endpoint"])
        self.once()  # warm-up: connection, first-touch of the receive buffer

    def once(self) -> float:
        self.sock.send(b"go")
        self.sock.recv()  # ready: the receiver's clock is running
        for start in range(0, len(self.payload), DEFAULT_BUCKET_BYTES):
            self.sock.send(self.payload[start : start + DEFAULT_BUCKET_BYTES], copy=False)
        return read_json(self.receiver)["seconds"]

    def close(self) -> None:
        self.receiver.wait(timeout=60)
        self.sock.close(linger=0)
        self.ctx.term()


class RawUcx:
    """A raw ucxx tagged transfer of ``payload`` to another process (the ucx ceiling)."""

    def __init__(self, payload: np.ndarray, repeats: int) -> None:
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        import ucxx._lib.libucxx as ucx_api

        self.api = ucx_api
        self.payload = payload
        self.receiver = spawn("ucx-recv", "--bytes", str(payload.nbytes), "--repeats", str(repeats))
        address = bytes.fromhex(read_json(self.receiver)["address"])
        self.ctx = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self.worker = ucx_api.UCXWorker(self.ctx)
        self.worker.init_blocking_progress_mode()
        self.ep = self.worker.create_endpoint_from_worker_address(
            ucx_api.UCXAddress.create_from_buffer(address), False)
        self.tag = 0
        self.once()  # wire-up, not timed by the receiver

    def once(self) -> float:
        from ucxx._lib.arr import Array

        self.receiver.stdin.write(f"{time.time()}\n")
        self.receiver.stdin.flush()
        _ucx_wait(self.worker, self.ep.tag_send(Array(self.payload), self.api.UCXXTag(self.tag)))
        self.tag += 1
        return read_json(self.receiver).get("seconds", 0.0)

    def close(self) -> None:
        self.receiver.stdin.close()
        self.receiver.wait(timeout=60)


class ChildFetcher:
    """A fetcher in another process, one timed ``fetch(version)`` per call."""

    def __init__(self, redis_url: str, transport: str) -> None:
        self.proc = spawn("fetch", "--redis-url", redis_url, "--transport", transport)
        read_json(self.proc)

    def once(self, version: int) -> float:
        self.proc.stdin.write(f"{version}\n")
        self.proc.stdin.flush()
        return read_json(self.proc)["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        if self.proc.wait(timeout=60):
            raise RuntimeError("fetch helper failed")


def bandwidth(redis_url: str, sizes: list[int], repeats: int, transports: list[str]) -> list[dict]:
    """Each repeat runs the ceiling and the transport back to back, so that both see the
    same machine load; the best of the repeats is reported for each."""
    import redis

    r = redis.Redis.from_url(redis_url)
    rows = []
    for size in sizes:
        tensors = synthetic_tensors(size, seed=1)
        flat = np.concatenate([t.view(torch.uint8).numpy() for t in tensors.values()])
        gb = flat.nbytes / 1e9
        for transport in transports:
            r.delete(KEY)
            say(f"{size // MiB} MiB {transport}: {repeats} rounds of ceiling, publish, fetch in another process")
            ceiling = {"shm": None, "tcp": RawZmq, "ucx": RawUcx}[transport]
            raw = ceiling(flat, repeats) if ceiling else None
            fetcher = ChildFetcher(redis_url, transport)
            best = {"ceiling": float("inf"), "publish": float("inf"), "fetch": float("inf")}
            try:
                with make_publisher(transport, r, KEY, ns=f"bench-{uuid.uuid4().hex[:8]}", keep_versions=1) as pub:
                    for v in (-2, -1):  # warm-up, untimed: buffers, connections, UCX's caches
                        pub.publish(v + 2, tensors)
                        fetcher.once(v + 2)
                    for v in range(2, repeats + 2):
                        best["ceiling"] = min(best["ceiling"], raw.once() if raw else memcpy_into_shm(flat))
                        t0 = time.perf_counter()
                        pub.publish(v, tensors)
                        best["publish"] = min(best["publish"], time.perf_counter() - t0)
                        best["fetch"] = min(best["fetch"], fetcher.once(v))
            finally:
                fetcher.close()
                if raw:
                    raw.close()
            measured = "publish" if transport == "shm" else "fetch"
            row = {"size_mib": size // MiB, "transport": transport, "publish_gbps": gb / best["publish"],
                   "fetch_gbps": gb / best["fetch"], "ceiling_gbps": gb / best["ceiling"], "measured": measured,
                   "ceiling": {"shm": "memcpy into /dev/shm", "tcp": "raw pyzmq PAIR",
                               "ucx": "raw ucxx tag send/recv"}[transport],
                   "ratio": best["ceiling"] / best[measured]}
            say(f"{size // MiB} MiB {transport}: publish {row['publish_gbps']:.2f} GB/s, fetch "
                f"{row['fetch_gbps']:.2f} GB/s; ceiling ({row['ceiling']}) {row['ceiling_gbps']:.2f} GB/s; "
                f"{measured} / ceiling = {row['ratio']:.0%}")
            rows.append(row)
        del tensors, flat
    return rows


# --- 2. step -> every generator runs it -----------------------------------------------


def latency(redis_url: str, transports: list[str], nbytes: int, versions: int, generators: int) -> list[dict]:
    rows = []
    for transport in transports:
        import redis

        redis.Redis.from_url(redis_url).delete(KEY)
        base = [sys.executable, str(ROOT / "bench" / "weights_worker.py")]
        common = ["--transport", transport, "--redis-url", redis_url, "--key", KEY]
        say(f"latency {transport}: 1 publisher + {generators} generator processes, {versions} versions "
            f"of {nbytes // MiB} MiB")
        publisher = subprocess.Popen([*base, "publish", *common, "--bytes", str(nbytes), "--versions", "1",
                                      "--ns", f"bench-{uuid.uuid4().hex[:8]}"], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        fetchers = [subprocess.Popen([*base, "fetch", *common, "--until-version", str(versions), "--recheck-s", "5"],
                                     cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in range(generators)]
        try:
            published = {}
            while (line := json.loads(publisher.stdout.readline()))["event"] != "ready":
                published[line["version"]] = line
            for f in fetchers:  # each catches up on version 1 first (late joiners)
                while json.loads(f.stdout.readline()).get("version") != 1:
                    pass
            for v in range(2, versions + 1):
                publisher.stdin.write(f"publish {v}\n")
                publisher.stdin.flush()
                line = json.loads(publisher.stdout.readline())
                published[v] = line
                applied = []
                for f in fetchers:
                    while (got := json.loads(f.stdout.readline()))["event"] != "applied" or got["version"] != v:
                        pass
                    applied.append(got["at"])
                seconds = max(applied) - line["step_done_at"]
                say(f"latency {transport}: v{v} on all {generators} generators {seconds * 1000:.0f} ms after the "
                    f"step (publish {1000 * (line['announced_at'] - line['step_done_at']):.0f} ms)")
                published[v]["all_applied_s"] = seconds
            lat = [published[v]["all_applied_s"] for v in range(2, versions + 1)]
            pub = [published[v]["announced_at"] - published[v]["step_done_at"] for v in range(2, versions + 1)]
            rows.append({"transport": transport, "size_mib": nbytes // MiB, "generators": generators,
                         "median_s": statistics.median(lat), "max_s": max(lat),
                         "median_publish_s": statistics.median(pub)})
        finally:
            publisher.stdin.close()
            publisher.wait(timeout=60)
            for f in fetchers:
                f.wait(timeout=60)
    return rows


# --- 3. swap vs generation batch ------------------------------------------------------


def swap_vs_batch(redis_url: str, transports: list[str], repeats: int) -> list[dict]:
    import redis

    from pipeline.config import RunConfig
    from pipeline.model.qwen import ModelShape, build_model, load_state_tensors, sample, state_tensors
    from pipeline.tasks.arithmetic import prompt_length

    cfg = RunConfig()
    m = cfg.model
    shape = ModelShape(hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                       num_kv_heads=m.num_kv_heads, intermediate_size=m.intermediate_size)
    vocab = 17
    model = build_model(shape, vocab, seed=0).eval()
    g = cfg.generator
    prompts = torch.randint(2, vocab, (g.prompts_per_batch * g.group_size, prompt_length(cfg.task.digits)),
                            generator=torch.Generator().manual_seed(0))
    batch_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sample(model, prompts, max_new_tokens=cfg.task.max_new_tokens, temperature=1.0, eos_id=1, pad_id=0,
               generator=torch.Generator().manual_seed(1))
        batch_s.append(time.perf_counter() - t0)
    batch = statistics.median(batch_s)
    r = redis.Redis.from_url(redis_url)
    rows = []
    for transport in transports:
        r.delete(KEY)
        with make_publisher(transport, r, KEY, ns=f"bench-{uuid.uuid4().hex[:8]}") as pub, \
                make_fetcher(transport, r, KEY) as fetcher:
            swaps = []
            for v in range(1, repeats + 1):
                pub.publish(v, state_tensors(model))
                t0 = time.perf_counter()
                _, tensors = fetcher.fetch(v, copy=False)
                load_state_tensors(model, tensors)
                swaps.append(time.perf_counter() - t0)
                del tensors
        swap = statistics.median(swaps)
        payload_mib = sum(t.numel() * t.element_size() for t in state_tensors(model).values()) / MiB
        rows.append({"transport": transport, "payload_mib": round(payload_mib, 2), "swap_s": swap,
                     "batch_s": batch, "swap_over_batch": swap / batch})
        say(f"swap {transport}: {swap * 1000:.2f} ms blocked per swap vs {batch * 1000:.0f} ms per generation "
            f"batch ({swap / batch:.1%})")
    return rows


# --- report -------------------------------------------------------------------------


def md_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


def report(result: dict) -> str:
    out = ["# Weight sync benchmark\n", f"`{result['command']}` on {result['machine']}, {result['date']}; "
           f"1-minute load average {result['load_before']:.1f} before and {result['load_after']:.1f} after "
           "(the machine is shared: ratios are measured round by round against a ceiling taken under "
           "the same load).\n"]
    if result.get("ucx_note"):
        out.append(f"ucx: {result['ucx_note']}\n")
    out.append("## Bandwidth against each transport's own ceiling (best of "
               f"{result['repeats']}, GB/s = 1e9 bytes/s)\n")
    out.append(md_table(
        ["payload", "transport", "publish GB/s", "fetch GB/s", "ceiling", "ceiling GB/s", "ratio"],
        [[f"{r['size_mib']} MiB", r["transport"], f"{r['publish_gbps']:.2f}", f"{r['fetch_gbps']:.2f}",
          r["ceiling"], f"{r['ceiling_gbps']:.2f}", f"{r['measured']} {r['ratio']:.0%}"]
         for r in result["bandwidth"]]))
    out.append("\nshm's ratio compares publishing with the memcpy into shared memory (its fetch maps the\n"
               "file, so it has no copy to compare); tcp's and ucx's compare a fetch with a raw transfer of\n"
               "the same bytes between two processes.\n")
    if result["latency"]:
        out.append("\n## Trainer step done -> every generator runs the version\n")
        out.append(md_table(["transport", "payload", "generators", "median", "max", "of which publish (median)"],
                            [[r["transport"], f"{r['size_mib']} MiB", r["generators"], f"{r['median_s'] * 1000:.0f} ms",
                              f"{r['max_s'] * 1000:.0f} ms", f"{r['median_publish_s'] * 1000:.0f} ms"]
                             for r in result["latency"]]))
    if result["swap"]:
        out.append("\n## Generator blocked by a swap vs one generation batch (default tiny policy and batch)\n")
        out.append(md_table(["transport", "payload", "swap (fetch + load)", "generation batch", "swap / batch"],
                            [[r["transport"], f"{r['payload_mib']} MiB", f"{r['swap_s'] * 1000:.2f} ms",
                              f"{r['batch_s'] * 1000:.0f} ms", f"{r['swap_over_batch']:.1%}"]
                             for r in result["swap"]]))
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mib", default="64,256,1024", help="payload sizes for the bandwidth part")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--latency-mib", type=int, default=64)
    p.add_argument("--latency-versions", type=int, default=6)
    p.add_argument("--generators", type=int, default=4)
    p.add_argument("--transports", default="shm,tcp,ucx")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: bandwidth, latency, swap")
    p.add_argument("--out", default=str(RESULTS / "weights"))
    a = p.parse_args()
    torch.set_num_threads(1)
    transports = [t for t in a.transports.split(",") if t]
    ucx_note = ucx_available() if "ucx" in transports else None
    if ucx_note:
        say(f"skipping ucx: {ucx_note}")
        transports.remove("ucx")
    skip = set(a.skip.split(","))
    from pipeline.bus.server import provision

    with tempfile.TemporaryDirectory() as tmp:
        server = provision(Path(tmp), url=os.environ.get("REDIS_URL", ""))
        try:
            started = time.time()
            result = {
                "command": " ".join(["python bench/bench_weights.py", *sys.argv[1:]]),
                "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}",
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "repeats": a.repeats, "ucx_note": ucx_note, "load_before": os.getloadavg()[0],
                "bandwidth": [] if "bandwidth" in skip else bandwidth(
                    server.url, [int(s) * MiB for s in a.sizes_mib.split(",")], a.repeats, transports),
                "latency": [] if "latency" in skip else latency(
                    server.url, transports, a.latency_mib * MiB, a.latency_versions, a.generators),
                "swap": [] if "swap" in skip else swap_vs_batch(server.url, transports, max(a.repeats, 5)),
            }
            result["seconds"] = time.time() - started
            result["load_after"] = os.getloadavg()[0]
        finally:
            server.stop()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(report(result))
    say(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
