"""``ucx`` transport: payloads move over UCX (``ucxx``); requests and liveness over ZeroMQ.

Needs the optional extra (``pip install -e '.[ucx]'``: ``ucxx-cu12``, which imports
and runs without a GPU). The control channel is the ``tcp`` transport's ROUTER
socket; only the payload takes the UCX path, one tagged message per bucket::

    fetcher                                          publisher (server thread)
      tag_recv(bucket i slice, tag + i)  for every i  (posted first)
      DEALER [packb([v, "ucx", worker address, tag])]  ──►
                                                      endpoint from the worker address
                                                        (cached; error handling off)
                                                      tag_send(bucket i of v, tag + i)
                                 ◄──  [packb([v, -1, status]), b""]
      progress until every recv completes or timeout_s passes; each bucket's
      CRC-32C runs on a helper thread as soon as it lands (overlapping the rest)

Worker addresses, not listeners: the fetcher sends its UCX worker address in the
request, and the publisher makes an endpoint from it with *error handling off*.
That is what lets UCX pick its shared-memory transports on one host (cma, posix,
sysv); an endpoint with error handling on is limited to transports that can report
peer failure and falls back to tcp (measured here: ~8 GB/s with it off, ~0.5 GB/s
with it on, 64 MiB). The price is that UCX itself will not notice a dead peer, so
liveness comes from the control plane: every reply must come within ``timeout_s``,
and a receive that has not completed by then is cancelled and reported as a
``WeightsError``; the fetcher then drops its receive buffer, so a late send can
never land in data that is in use.

``tls`` sets ``UCX_TLS`` for this transport's UCX context (None: UCX's default,
``all``), e.g. ``"tcp"`` to force sockets or ``"cma,self"``. Tags are a random 40-bit
number per fetch shifted left by 24 bits, plus the bucket index, so a send meant for
an abandoned fetch never matches a new one.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import OrderedDict
from typing import Any

import msgpack
import numpy as np
import redis
import zmq

# UCX warns on stderr about UCX_* variables it does not use (ucxx sets some itself);
# that noise is not ours to act on.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx._lib.libucxx as ucx_api  # noqa: E402  (after the environment it reads)
from ucxx._lib.arr import Array  # noqa: E402

from pipeline.weights import WeightFetcher, host_buffer  # noqa: E402
from pipeline.weights.manifest import Manifest, WeightsError  # noqa: E402
from pipeline.weights.tcp import TcpPublisher  # noqa: E402

_MAX_ENDPOINTS = 64  # cached endpoints, one per fetcher worker; the oldest is closed first
_MAX_HEADER_BYTES = 1024
_BUCKET_TAGS = 1 << 24  # tags per fetch: bucket i of the fetch with base tag t is t + i


def _worker(tls: str | None) -> tuple[Any, Any]:
    if tls is not None and (not isinstance(tls, str) or not tls.strip()):
        raise ValueError(f"tls must be a non-empty UCX_TLS value (e.g. 'all', 'tcp', 'cma,self'), got {tls!r}")
    config = {"TLS": tls} if tls else None
    try:
        context = ucx_api.UCXContext(config_dict=config, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    except Exception as e:  # ucxx raises its own exception types for bad UCX options
        raise ValueError(f"cannot create a UCX context with TLS={tls!r}: {e}") from e
    worker = ucx_api.UCXWorker(context)
    worker.init_blocking_progress_mode()
    return context, worker


class UcxPublisher(TcpPublisher):
    """Serves retained versions over UCX, taking requests on a ZeroMQ ROUTER socket.

    Options: ``tls`` (``UCX_TLS`` for this publisher; default UCX's own), and the
    ``tcp`` publisher's ``host``, ``port``, ``advertise_host`` (the control channel),
    plus the base options ``bucket_bytes`` (one UCX message and one checksum per
    bucket) and ``keep_versions``.
    """

    transport = "ucx"
    _max_request_bytes = 4096  # a UCX worker address is a few hundred bytes

    def __init__(self, redis_client: redis.Redis, key: str, *, ns: str, tls: str | None = None,
                 **opts: Any) -> None:
        # The UCX worker belongs to the server thread from here on (it alone progresses it).
        self._ucx_context, self._ucx_worker = _worker(tls)
        self._endpoints: OrderedDict[bytes, Any] = OrderedDict()
        self._sends: list[tuple[Any, object]] = []  # (request, payload kept alive until done)
        super().__init__(redis_client, key, ns=ns, **opts)

    def _loop(self, sock: zmq.Socket) -> None:
        worker = self._ucx_worker
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(worker.epoll_file_descriptor, zmq.POLLIN)
        while True:
            worker.progress()
            self._sends = [(r, p) for r, p in self._sends if not r.completed]
            # arm() is False while UCX still has work queued: go round without sleeping.
            ready = dict(poller.poll(None if worker.arm() else 0))
            if sock not in ready:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) == 2:
                    identity, request = frames
                    sock.send_multipart([identity, *self._answer(request)])

    def _answer(self, request: bytes) -> list[bytes | memoryview]:
        try:
            version, kind, address, tag = msgpack.unpackb(request)
            if not (type(version) is int and kind == "ucx" and type(address) is bytes and type(tag) is int
                    and 0 <= tag and tag % _BUCKET_TAGS == 0 and tag < 2**64):
                raise ValueError
        except Exception:  # msgpack raises several types on garbage; all mean the same
            return [msgpack.packb([-1, -1, "bad request"]), b""]
        with self._lock:
            payload = self._payloads.get(version)
        if payload is None:
            return [msgpack.packb([version, -1, "gone"]), b""]
        if -(-len(payload) // self._bucket_bytes) > _BUCKET_TAGS:
            return [msgpack.packb([version, -1, "too many buckets"]), b""]
        try:
            endpoint = self._endpoint(address)
            data = np.frombuffer(payload, dtype=np.uint8)
            for index, start in enumerate(range(0, len(payload), self._bucket_bytes)):
                bucket = Array(data[start : start + self._bucket_bytes])
                self._sends.append((endpoint.tag_send(bucket, ucx_api.UCXXTag(tag + index)), payload))
        except Exception as e:  # a malformed address or a UCX failure: the fetcher hears why
            self._endpoints.pop(address, None)
            return [msgpack.packb([version, -1, f"ucx error: {e}"]), b""]
        return [msgpack.packb([version, -1, "ok"]), b""]

    def _endpoint(self, address: bytes) -> Any:
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            endpoint = self._ucx_worker.create_endpoint_from_worker_address(
                ucx_api.UCXAddress.create_from_buffer(address), False  # error handling off: shm transports
            )
            self._endpoints[address] = endpoint
            while len(self._endpoints) > _MAX_ENDPOINTS:
                self._endpoints.popitem(last=False)
        self._endpoints.move_to_end(address)
        return endpoint

    def _shutdown(self) -> None:
        super()._shutdown()  # the server thread has stopped: nobody progresses the worker now
        self._sends.clear()
        self._endpoints.clear()


class UcxFetcher(WeightFetcher):
    """Receives a version over UCX straight into the fetcher's reused buffer.

    Options: ``timeout_s`` (most seconds for the request's reply and, separately,
    for the payload to arrive; default 10.0) and ``tls`` (``UCX_TLS``; default UCX's).
    """

    transport = "ucx"

    def __init__(self, redis_client: redis.Redis, key: str, *, timeout_s: float = 10.0,
                 tls: str | None = None) -> None:
        super().__init__(redis_client, key)
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self._timeout_s = float(timeout_s)
        self._ucx_context, self._ucx_worker = _worker(tls)
        self._address = bytes(self._ucx_worker.address.tobytes())
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._sock_address: str | None = None

    def close(self) -> None:
        super().close()
        self._drop_socket()
        self._ctx.destroy(linger=0)

    def _transfer(self, manifest: Manifest) -> memoryview:
        where = f"weights v{manifest.version} from {manifest.address}"
        if not manifest.address.startswith("tcp://"):
            raise WeightsError(f"{where}: not a tcp:// control address")
        into = self._receive_buffer(manifest.total_bytes)
        if manifest.num_buckets > _BUCKET_TAGS:
            raise WeightsError(f"{where}: {manifest.num_buckets} buckets, more than one fetch can tag")
        tag = secrets.randbits(40) * _BUCKET_TAGS
        data = np.frombuffer(into, dtype=np.uint8)
        # Post every receive before asking, so the payload lands in place, never in
        # UCX's unexpected-message queue.
        receives = []
        for index in range(manifest.num_buckets):
            start, end = manifest.bucket_span(index)
            receives.append(self._ucx_worker.tag_recv(Array(data[start:end]), ucx_api.UCXXTag(tag + index)))
        try:
            self._request(manifest, tag, where)
            self._wait(manifest, into, receives, where)
        except BaseException:
            self._abandon(receives)
            raise
        return into

    def _request(self, manifest: Manifest, tag: int, where: str) -> None:
        try:
            sock = self._socket(manifest.address)
            sock.send(msgpack.packb([manifest.version, "ucx", self._address, tag]))
            frames = sock.recv_multipart()
        except zmq.Again:
            self._drop_socket()
            raise WeightsError(f"{where}: no reply within {self._timeout_s:g}s (publisher gone or overloaded)") from None
        except zmq.ZMQError as e:
            self._drop_socket()
            raise WeightsError(f"{where}: {e}") from e
        try:
            _, _, status = msgpack.unpackb(frames[0])
        except Exception:
            raise WeightsError(f"{where}: malformed reply {frames[0][:64]!r}") from None
        if status != "ok":
            hint = " (version dropped or publisher restarted)" if status == "gone" else ""
            raise WeightsError(f"{where}: publisher answered {status!r}{hint}")

    def _socket(self, address: str) -> zmq.Socket:
        """The control socket to ``address``, kept while requests get their replies."""
        if self._sock is not None and self._sock_address == address:
            return self._sock
        self._drop_socket()
        sock = self._ctx.socket(zmq.DEALER)
        timeout_ms = max(1, round(self._timeout_s * 1000))
        sock.linger = 0
        sock.rcvtimeo = sock.sndtimeo = timeout_ms
        sock.maxmsgsize = _MAX_HEADER_BYTES
        sock.connect(address)
        self._sock, self._sock_address = sock, address
        return sock

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock, self._sock_address = None, None

    def _wait(self, manifest: Manifest, into: memoryview, receives: list[Any], where: str) -> None:
        worker = self._ucx_worker
        deadline = time.monotonic() + self._timeout_s
        pending = dict(enumerate(receives))
        while pending:
            worker.progress()
            for index in [i for i, r in pending.items() if r.completed]:
                try:
                    pending.pop(index).check_error()
                except Exception as e:  # ucxx raises UCX status errors (e.g. message truncated)
                    raise WeightsError(f"{where}: UCX receive of bucket {index} failed: {e}") from e
                self._check_arrived(manifest, into, index)
            if not pending:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WeightsError(f"{where}: payload not received within {self._timeout_s:g}s (publisher died "
                                   f"mid-transfer or is overloaded)")
            if worker.arm():  # nothing queued: sleep on the worker's event fd until data moves
                worker.progress_worker_event(epoll_timeout=max(1, round(min(remaining, 0.5) * 1000)))

    def _abandon(self, receives: list[Any]) -> None:
        """Cancel receives that will not complete, and stop using their buffer."""
        if not all(r.completed for r in receives):
            self._ucx_worker.cancel_inflight_requests()
            self._ucx_worker.progress()
        self._buffer = host_buffer(0)  # a late send may still target the old one: never reuse it
