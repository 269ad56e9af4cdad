"""Stand-alone publisher and generator-side processes for tests and ``bench/bench_weights.py``.

``python bench/weights_worker.py publish ...`` publishes synthetic versions of a
given size and then takes ``publish <version>`` lines on stdin until stdin closes.
``python bench/weights_worker.py fetch ...`` behaves like a generator's weight
loop: it waits for announcements (``WeightWatch``), fetches into its second buffer,
copies into its own "model" tensors, and retries after a failure with its old
weights in place. Both print one JSON object per line on stdout (``event`` names
what happened; times are Unix seconds), so a parent process can follow them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import redis
import torch

from pipeline.weights import WeightsError, WeightWatch, make_fetcher, make_publisher
from pipeline.weights.manifest import checksum

CHUNK_BYTES = 16 << 20
"""Synthetic payloads are cut into tensors of this size (like a model's large matrices)."""


def synthetic_tensors(total_bytes: int, *, seed: int) -> dict[str, torch.Tensor]:
    """About ``total_bytes`` of float32 tensors under HF-style names; every value depends on ``seed``.

    Filled from an integer ramp rather than a random generator: the bench makes GiBs
    of these, and only the bytes matter (no NaN checks run on them).
    """
    if total_bytes < 4:
        raise ValueError(f"total_bytes must be >= 4, got {total_bytes}")
    out, left, i = {}, total_bytes, 0
    while left >= 4:
        n = min(CHUNK_BYTES, left) // 4
        ramp = torch.arange(n, dtype=torch.int32).mul_(2 * seed + 1).add_(i)
        out[f"model.layers.{i}.mlp.up_proj.weight"] = ramp.view(torch.float32)
        left -= n * 4
        i += 1
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """Checksum over the tensors' names and bytes, in name order (compares two sets of weights)."""
    parts = []
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        parts.append(f"{name}:{checksum(data)}")
    return checksum("|".join(parts).encode())


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def _options(args: argparse.Namespace, *, publisher: bool) -> dict[str, object]:
    opts: dict[str, object] = {}
    if args.tls:
        opts["tls"] = args.tls
    if publisher:
        opts["keep_versions"] = args.keep_versions
        if args.bucket_bytes:
            opts["bucket_bytes"] = args.bucket_bytes
    elif args.transport != "shm":
        opts["timeout_s"] = args.timeout_s
        if args.transport == "tcp" and args.max_in_flight:
            opts["max_in_flight"] = args.max_in_flight
    return opts


def run_publisher(args: argparse.Namespace) -> None:
    r = redis.Redis.from_url(args.redis_url)
    publisher = make_publisher(args.transport, r, args.key, ns=args.ns, **_options(args, publisher=True))

    def publish(version: int) -> None:
        tensors = synthetic_tensors(args.bytes, seed=version)
        step_done = time.time()  # "the trainer finished step v": the snapshot is ready
        manifest = publisher.publish(version, tensors)
        _emit(event="published", version=version, step_done_at=step_done, announced_at=time.time(),
              total_bytes=manifest.total_bytes, digest=digest(tensors))

    try:
        for version in args.versions:
            publish(version)
        _emit(event="ready")
        for line in sys.stdin:  # "publish <v>" until the parent closes stdin
            command, _, value = line.strip().partition(" ")
            if command == "publish":
                publish(int(value))
    finally:
        publisher.close()


def run_fetcher(args: argparse.Namespace) -> None:
    r = redis.Redis.from_url(args.redis_url)
    fetcher = make_fetcher(args.transport, r, args.key, **_options(args, publisher=False))
    watch = WeightWatch(r, args.key, recheck_s=args.recheck_s)
    model: dict[str, torch.Tensor] | None = None  # the "first buffer": weights in use
    version = -1
    _emit(event="started")
    try:
        while args.until_version is None or version < args.until_version:
            newest = watch.wait(version, timeout_s=args.recheck_s)
            if newest <= version:
                continue
            t0 = time.perf_counter()
            try:
                got, tensors = fetcher.fetch(newest, copy=False)
                if model is None or set(model) != set(tensors):
                    model = {name: t.clone() for name, t in tensors.items()}
                else:
                    for name, t in tensors.items():
                        model[name].copy_(t)
            except WeightsError as e:
                _emit(event="fetch_failed", version=newest, keeping=version, error=str(e),
                      digest=digest(model) if model is not None else None)
                # Retry at the next announcement or recheck, whichever comes first.
                watch.wait(newest, timeout_s=args.recheck_s)
                continue
            version = got
            _emit(event="applied", version=version, at=time.time(), swap_seconds=time.perf_counter() - t0,
                  digest=digest(model) if args.digest else None)
    finally:
        watch.close()
        fetcher.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench/weights_worker.py", description=__doc__.split("\n")[0])
    parser.add_argument("role", choices=("publish", "fetch"))
    parser.add_argument("--transport", required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--ns", default="weights-worker")
    parser.add_argument("--bytes", type=int, default=1 << 20, help="publish: payload size per version")
    parser.add_argument("--versions", type=lambda s: [int(v) for v in s.split(",") if v], default=[])
    parser.add_argument("--keep-versions", type=int, default=2)
    parser.add_argument("--bucket-bytes", type=int, default=0)
    parser.add_argument("--tls", default="")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--max-in-flight", type=int, default=0)
    parser.add_argument("--recheck-s", type=float, default=1.0)
    parser.add_argument("--until-version", type=int, default=None)
    parser.add_argument("--digest", action="store_true", help="fetch: report a digest of the applied weights")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    (run_publisher if args.role == "publish" else run_fetcher)(args)


if __name__ == "__main__":
    main()
