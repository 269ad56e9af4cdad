"""``ucx`` transport: payloads move over UCX (``ucxx``); requests and liveness over ZeroMQ.

Needs the optional extra (``pip install -e '.[ucx]'``: ``ucxx-cu12``, which imports
and runs without a GPU). The control channel is the ``tcp`` transport's ROUTER
socket; only the payload takes the UCX path, as tagged messages: each bucket cut
into pieces of at most ``message_bytes`` (the fetcher's choice, ``MESSAGE_BYTES`` by
default), message ``i`` of a fetch tagged ``tag + i``::

    fetcher                                          publisher (server thread)
      tag_recv(piece i slice, tag + i)  for every i  (posted first)
      DEALER [packb([v, "ucx", worker address, tag, message_bytes])]  ──►
                                                      endpoint from the worker address
                                                        (cached; error handling off)
                                                      tag_send(piece i of v, tag + i)
                                 ◄──  [packb([v, -1, status]), b""]
      step the worker (progress_once) until every piece has landed and the reply
      says ok; each piece goes to the bucket's running CRC-32C as soon as it lands,
      on a helper thread (overlapping the rest of the transfer) or, for a bucket
      that starts while the helper is behind, on this thread (the piece still hot)

Overlap is the point of the pieces and the stepping: ``progress`` would run the
whole payload in one call, so no check could start before the last byte; and a
piece that is checked right after its copy is still (partly) in the cache. Measured
here, a piece's CRC-32C straight after it landed ran at ~26 GB/s for 1 MiB, ~20 GB/s
for 4 MiB and ~12 GB/s for 16 MiB, against ~14-17 GB/s for the copy itself; below
4 MiB the per-message work on both sides cost more than the cache saved. The helper
only overlaps when a core is free for it; on a busy machine it falls behind, and then
summing the next bucket in line costs less than a late, cold pass (the helper lagging
is how the fetcher tells). Every bucket's checksum is still compared with the
manifest before any tensor is made from the buffer (``WeightFetcher.fetch``), so a
corrupt piece anywhere is refused.

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
number per fetch shifted left by 24 bits, plus the message index, so a send meant
for an abandoned fetch never matches a new one. A request without ``message_bytes``
gets one message per bucket.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
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
from pipeline.weights.manifest import Manifest, RunningChecksum, WeightsError  # noqa: E402
from pipeline.weights.tcp import TcpPublisher  # noqa: E402

_MAX_ENDPOINTS = 64  # cached endpoints, one per fetcher worker; the oldest is closed first
_MAX_HEADER_BYTES = 1024
_BEHIND_PIECES = 2  # a helper this many pieces behind has no core of its own: sum inline
_MESSAGE_TAGS = 1 << 24  # tags per fetch: message i of the fetch with base tag t is t + i
MESSAGE_BYTES = 4 << 20
"""Default UCX message size a fetcher asks for (``message_bytes``): a bucket travels as
pieces of at most this, each checked as soon as it lands, while the copy left it in
the cache (see the module docstring for the measurements behind 4 MiB)."""


def _message_count(total_bytes: int, bucket_bytes: int, message_bytes: int) -> int:
    full, rest = divmod(total_bytes, bucket_bytes)
    return full * -(-bucket_bytes // message_bytes) + -(-rest // message_bytes)


def _messages(total_bytes: int, bucket_bytes: int, message_bytes: int) -> list[tuple[int, int, int, bool]]:
    """The UCX messages of a payload in payload order: ``(bucket, start, end, last)``, each
    bucket cut into pieces of ``message_bytes`` (its last one shorter); ``last`` marks
    the final piece of its bucket. Both sides derive the same list from the same sizes."""
    out = []
    for bucket, first in enumerate(range(0, total_bytes, bucket_bytes)):
        stop = min(first + bucket_bytes, total_bytes)
        for start in range(first, stop, message_bytes):
            end = min(start + message_bytes, stop)
            out.append((bucket, start, end, end == stop))
    return out


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
    plus the base options ``bucket_bytes`` (one checksum per bucket; a bucket goes as
    one or more UCX messages, of the size each fetcher asks for) and ``keep_versions``.
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
            fields = msgpack.unpackb(request)
            # [version, "ucx", worker address, base tag, message bytes]; without the last
            # field, one message per bucket.
            version, kind, address, tag = fields[:4]
            message_bytes = fields[4] if len(fields) == 5 else self._bucket_bytes
            if not (len(fields) in (4, 5) and type(version) is int and kind == "ucx" and type(address) is bytes
                    and type(tag) is int and 0 <= tag and tag % _MESSAGE_TAGS == 0 and tag < 2**64
                    and type(message_bytes) is int and message_bytes > 0):
                raise ValueError
        except Exception:  # msgpack raises several types on garbage; all mean the same
            return [msgpack.packb([-1, -1, "bad request"]), b""]
        with self._lock:
            payload = self._payloads.get(version)
        if payload is None:
            return [msgpack.packb([version, -1, "gone"]), b""]
        if _message_count(len(payload), self._bucket_bytes, message_bytes) > _MESSAGE_TAGS:
            return [msgpack.packb([version, -1, "too many messages"]), b""]
        try:
            endpoint = self._endpoint(address)
            data = np.frombuffer(payload, dtype=np.uint8)
            for index, (_, start, end, _) in enumerate(_messages(len(payload), self._bucket_bytes, message_bytes)):
                self._sends.append((endpoint.tag_send(Array(data[start:end]), ucx_api.UCXXTag(tag + index)), payload))
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
    """Receives a version over UCX straight into the fetcher's reused buffer, checking
    each piece's CRC-32C as it lands, mostly on a helper thread while the next pieces
    are still arriving.

    Options: ``timeout_s`` (most seconds for the request's reply and, separately,
    for the payload to arrive; default 10.0), ``tls`` (``UCX_TLS``; default UCX's) and
    ``message_bytes`` (the largest UCX message it asks for; default ``MESSAGE_BYTES``).
    """

    transport = "ucx"

    def __init__(self, redis_client: redis.Redis, key: str, *, timeout_s: float = 10.0,
                 tls: str | None = None, message_bytes: int = MESSAGE_BYTES) -> None:
        super().__init__(redis_client, key)
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if type(message_bytes) is not int or message_bytes <= 0:
            raise ValueError(f"message_bytes must be an int > 0, got {message_bytes!r}")
        self._timeout_s = float(timeout_s)
        self._message_bytes = message_bytes
        self._ucx_context, self._ucx_worker = _worker(tls)
        self._address = bytes(self._ucx_worker.address.tobytes())
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._sock_address: str | None = None
        self._awaiting_reply = False  # a request was sent whose reply has not been read
        # One thread, so the pieces of a bucket are summed in order; crc32c releases the
        # GIL, so it runs beside the transfer.
        self._piece_checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-ucx-crc")
        self._piece_checks: list[Future[str | None]] = []

    def close(self) -> None:
        super().close()
        self._piece_checker.shutdown(wait=True, cancel_futures=True)
        self._drop_socket()
        self._ctx.destroy(linger=0)

    def _transfer(self, manifest: Manifest) -> memoryview:
        where = f"weights v{manifest.version} from {manifest.address}"
        if not manifest.address.startswith("tcp://"):
            raise WeightsError(f"{where}: not a tcp:// control address")
        if _message_count(manifest.total_bytes, manifest.bucket_bytes, self._message_bytes) > _MESSAGE_TAGS:
            raise WeightsError(f"{where}: more UCX messages than one fetch can tag")
        into = self._receive_buffer(manifest.total_bytes)
        messages = _messages(manifest.total_bytes, manifest.bucket_bytes, self._message_bytes)
        tag = secrets.randbits(40) * _MESSAGE_TAGS
        data = np.frombuffer(into, dtype=np.uint8)
        # Post every receive before asking, so the payload lands in place, never in
        # UCX's unexpected-message queue.
        receives = [self._ucx_worker.tag_recv(Array(data[start:end]), ucx_api.UCXXTag(tag + index))
                    for index, (_, start, end, _) in enumerate(messages)]
        self._piece_checks = []
        try:
            sock = self._request(manifest, tag, where)
            self._wait(into, messages, receives, sock, where)
        except BaseException:
            self._abandon(receives)
            raise
        return into

    def _request(self, manifest: Manifest, tag: int, where: str) -> zmq.Socket:
        """Send the request; ``_wait`` reads its reply while the payload moves."""
        try:
            sock = self._socket(manifest.address)
            sock.send(msgpack.packb([manifest.version, "ucx", self._address, tag, self._message_bytes]))
        except zmq.Again:
            self._drop_socket()
            raise WeightsError(f"{where}: no reply within {self._timeout_s:g}s (publisher gone or overloaded)") from None
        except zmq.ZMQError as e:
            self._drop_socket()
            raise WeightsError(f"{where}: {e}") from e
        self._awaiting_reply = True
        return sock

    def _reply(self, sock: zmq.Socket, where: str) -> None:
        """Read the reply that is waiting on ``sock``; ``WeightsError`` unless it says ok."""
        try:
            frames = sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._drop_socket()
            raise WeightsError(f"{where}: {e}") from e
        self._awaiting_reply = False
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
        self._awaiting_reply = False

    def _wait(self, into: memoryview, messages: list[tuple[int, int, int, bool]], receives: list[Any],
              sock: zmq.Socket, where: str) -> None:
        """Move the payload and read the reply; each piece goes to its checksum as it lands.

        ``progress_once`` is one step of the transfer (a fragment of one message), where
        ``progress`` runs until nothing posted can move, i.e. the whole payload in one
        call. Stepping is what lets piece ``i``'s CRC run on the helper thread while
        piece ``i + 1`` is still being copied, so that checking adds only the last
        piece's CRC to the transfer. A bucket whose first piece lands while the helper
        is ``_BEHIND_PIECES`` behind is summed on this thread instead, piece by piece as
        each lands. The loop sleeps only when UCX has nothing queued, on the worker's
        event fd and the control socket together.
        """
        worker = self._ucx_worker
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(worker.epoll_file_descriptor, zmq.POLLIN)
        # The reply must come within timeout_s of the request, the payload within
        # timeout_s of the reply (read, at the latest, once the pieces stop moving).
        deadline, replied = time.monotonic() + self._timeout_s, False
        landed, total = 0, len(receives)  # pieces [0, landed) are complete and being checked
        running, inline, first = RunningChecksum(), False, True
        while landed < total or not replied:
            moved = worker.progress_once()
            while landed < total and receives[landed].completed:
                bucket, start, end, last = messages[landed]
                try:
                    receives[landed].check_error()
                except Exception as e:  # ucxx raises UCX status errors (e.g. message truncated)
                    raise WeightsError(f"{where}: UCX receive of bucket {bucket} (bytes {start}..{end}) "
                                       f"failed: {e}") from e
                if first:  # a bucket is summed by one thread: the helper, unless it is behind
                    inline = self._helper_backlog() >= _BEHIND_PIECES
                if inline:  # no core to spare for the helper: sum here, while the piece is hot
                    running.update(into[start:end])
                    if last:
                        check: Future[str | None] = Future()
                        check.set_result(running.hexdigest())
                        self._checks[bucket] = check
                else:
                    check = self._piece_checker.submit(_sum_piece, running, into[start:end], last)
                    self._piece_checks.append(check)
                    if last:
                        self._checks[bucket] = check  # what fetch() compares with the manifest
                if last:
                    running = RunningChecksum()
                first = last
                landed += 1
            now = time.monotonic()
            if moved and landed < total and now < deadline:
                continue  # the payload is moving: keep it moving, read the reply later
            if not replied:
                if sock.poll(0, zmq.POLLIN):
                    self._reply(sock, where)
                    deadline, replied = now + self._timeout_s, True
                    continue
                if now >= deadline:
                    self._drop_socket()
                    raise WeightsError(f"{where}: no reply within {self._timeout_s:g}s (publisher gone or "
                                       f"overloaded)")
            elif now >= deadline:
                raise WeightsError(f"{where}: payload not received within {self._timeout_s:g}s (publisher died "
                                   f"mid-transfer or is overloaded)")
            if not moved and worker.arm():  # nothing queued: sleep until data moves or the reply comes
                poller.poll(max(1, round(min(deadline - now, 0.5) * 1000)))

    def _helper_backlog(self) -> int:
        """Pieces handed to the helper thread and not summed yet (it takes them in order)."""
        behind = 0
        for check in reversed(self._piece_checks):
            if check.done():
                break
            behind += 1
        return behind

    def _abandon(self, receives: list[Any]) -> None:
        """Cancel receives that will not complete, and stop using their buffer."""
        if not all(r.completed for r in receives):
            self._ucx_worker.cancel_inflight_requests()
            self._ucx_worker.progress()
        if self._awaiting_reply:  # that reply would be read as the next request's
            self._drop_socket()
        for check in self._piece_checks:
            check.cancel()  # checksums not started yet are of no use now
        self._piece_checks = []
        self._buffer = host_buffer(0)  # a late send may still target the old one: never reuse it


def _sum_piece(running: RunningChecksum, piece: memoryview, last: bool) -> str | None:
    """Add ``piece`` to its bucket's checksum; the last piece's result is the bucket's."""
    running.update(piece)
    return running.hexdigest() if last else None
