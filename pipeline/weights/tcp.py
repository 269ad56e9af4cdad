"""``tcp`` transport: the publisher serves buckets over ZeroMQ; fetchers pull them.

Protocol (MessagePack, never pickle), one request per bucket::

    fetcher DEALER                              publisher ROUTER (its own thread)
      [packb([version, index])]        ──►
                                       ◄──      [packb([version, index, status]), bucket bytes]

``status`` is ``"ok"`` (the data frame holds bucket ``index``), ``"gone"`` (the
version is not retained: dropped, or the publisher restarted) or ``"bad request"``;
on an error the data frame is empty. The fetcher keeps up to ``max_in_flight``
requests outstanding so that the round trips overlap, and receives each bucket
straight into its slice of the receive buffer (``recv_into``). Every reply must come
within ``timeout_s``, so a dead or wedged publisher costs one timeout, not a hang.

Threading: the ROUTER socket lives and dies in the server thread (zmq sockets are not
thread-safe); ``publish`` hands payloads to it through a lock-protected dict. A payload
is never written after ``publish`` stores it, so replies send memoryview slices of it
without copying (``copy=False``), and a payload dropped while a reply is still in
flight stays alive until zmq is done with it.
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack
import numpy as np
import redis
import zmq

from pipeline.weights import WeightFetcher, WeightPublisher, host_buffer
from pipeline.weights.manifest import Manifest, WeightsError

_MAX_REQUEST_BYTES = 1024  # a request is a few bytes; refuse anything bigger unread
_MAX_HEADER_BYTES = 1024


class TcpPublisher(WeightPublisher):
    """Serves retained versions from a ZeroMQ ROUTER socket in a background thread.

    Options: ``host`` (bind address, default ``127.0.0.1``), ``port`` (0 = a free port),
    ``advertise_host`` (host written into the manifest for fetchers; default ``host``,
    set it when binding ``0.0.0.0``), plus the base options ``bucket_bytes`` and
    ``keep_versions``. The retained payloads cost ``keep_versions`` x payload size of RAM.
    """

    transport = "tcp"
    _max_request_bytes = _MAX_REQUEST_BYTES

    def __init__(
        self,
        redis_client: redis.Redis,
        key: str,
        *,
        ns: str,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        **base_opts: Any,
    ) -> None:
        super().__init__(redis_client, key, **base_opts)
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        self._lock = threading.Lock()
        self._payloads: dict[int, np.ndarray] = {}  # version -> payload; guarded by _lock
        self._writing: np.ndarray | None = None  # between _allocate and _store
        self._ctx = zmq.Context()
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self._port = port
        self._thread = threading.Thread(
            target=self._serve, args=(host,), name=f"weights-tcp-{ns}", daemon=True
        )
        self._thread.start()
        self._bound.wait()  # binding is local and immediate; it either works or raises
        if self._bind_error is not None:
            self._ctx.term()
            if self._announcer is not None:
                self._announcer.close()
            raise self._bind_error
        self._address = f"tcp://{_bracket(advertise_host or host)}:{self._port}"

    @property
    def address(self) -> str:
        """Endpoint fetchers connect to (also in every manifest)."""
        return self._address

    def _allocate(self, version: int, nbytes: int) -> memoryview:
        self._writing = host_buffer(nbytes)
        return memoryview(self._writing)

    def _store(self, version: int) -> str:
        payload, self._writing = self._writing, None
        assert payload is not None, "_store without _allocate"
        with self._lock:
            self._payloads[version] = payload
        return self._address

    def _retain(self, versions: frozenset[int]) -> None:
        with self._lock:
            for version in [v for v in self._payloads if v not in versions]:
                del self._payloads[version]

    def _shutdown(self) -> None:
        # term() makes the server thread's blocking recv raise ContextTerminated; the
        # thread closes its socket, and only then does term() return.
        self._ctx.term()
        self._thread.join()
        with self._lock:
            self._payloads.clear()

    def _serve(self, host: str) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        try:
            sock.linger = 0
            sock.maxmsgsize = self._max_request_bytes
            if ":" in host:
                sock.ipv6 = True
            endpoint = f"tcp://{_bracket(host)}"
            if self._port == 0:
                self._port = sock.bind_to_random_port(endpoint)
            else:
                sock.bind(f"{endpoint}:{self._port}")
        except BaseException as e:
            self._bind_error = e
            sock.close(linger=0)
            return
        finally:
            self._bound.set()
        try:
            self._loop(sock)
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)

    def _loop(self, sock: zmq.Socket) -> None:
        """Answer requests until the context is terminated."""
        while True:
            frames = sock.recv_multipart()
            if len(frames) != 2:
                continue  # not our protocol (DEALER requests are [identity, body])
            identity, request = frames
            sock.send_multipart([identity, *self._answer(request)], copy=False)

    def _answer(self, request: bytes) -> list[bytes | memoryview]:
        try:
            version, index = msgpack.unpackb(request)
            if not (type(version) is int and type(index) is int):
                raise ValueError
        except Exception:  # msgpack raises several types on garbage; all mean the same
            return [msgpack.packb([-1, -1, "bad request"]), b""]
        with self._lock:
            payload = self._payloads.get(version)
        if payload is None:
            return [msgpack.packb([version, index, "gone"]), b""]
        start = index * self._bucket_bytes
        if index < 0 or start >= len(payload):
            return [msgpack.packb([version, index, "bad request"]), b""]
        # A memoryview slice of a payload nobody writes any more: zmq sends it without
        # a copy and holds a reference until the kernel has it.
        return [msgpack.packb([version, index, "ok"]), memoryview(payload)[start : start + self._bucket_bytes]]


class TcpFetcher(WeightFetcher):
    """Pulls buckets from a ``TcpPublisher`` into the fetcher's reused buffer.

    Options: ``timeout_s`` (most seconds to wait for any one reply; default 10.0) and
    ``max_in_flight`` (bucket requests outstanding at once; default 4).
    """

    transport = "tcp"

    def __init__(
        self, redis_client: redis.Redis, key: str, *, timeout_s: float = 10.0, max_in_flight: int = 4
    ) -> None:
        super().__init__(redis_client, key)
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        self._timeout_ms = max(1, round(timeout_s * 1000))
        self._max_in_flight = max_in_flight
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._sock_key: tuple[str, int] | None = None

    def close(self) -> None:
        super().close()
        self._drop_socket()
        self._ctx.destroy(linger=0)

    def _transfer(self, manifest: Manifest) -> memoryview:
        where = f"weights v{manifest.version} from {manifest.address}"
        into = self._receive_buffer(manifest.total_bytes)
        if not manifest.address.startswith("tcp://"):
            raise WeightsError(f"{where}: not a tcp:// address")
        sock = self._socket(manifest)
        try:
            self._pull(sock, manifest, into, where)
            return into
        except BaseException as e:
            # A failed fetch may leave replies in flight: drop the socket, so that none of
            # them can ever be mistaken for a reply to the next fetch.
            self._drop_socket()
            if isinstance(e, zmq.Again):
                raise WeightsError(
                    f"{where}: no reply within {self._timeout_ms / 1000:g}s (publisher gone or overloaded)"
                ) from None
            if isinstance(e, zmq.ZMQError):
                raise WeightsError(f"{where}: {e}") from e
            raise

    def _socket(self, manifest: Manifest) -> zmq.Socket:
        """The DEALER socket for ``manifest``'s publisher, kept across successful fetches
        (no reconnect, no TCP slow start per version); a new one when the address moves."""
        limit = max(manifest.bucket_bytes, _MAX_HEADER_BYTES)
        if self._sock is not None and self._sock_key == (manifest.address, limit):
            return self._sock
        self._drop_socket()
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.rcvtimeo = self._timeout_ms
        sock.sndtimeo = self._timeout_ms
        # A peer sending frames larger than a bucket is not our publisher: zmq drops
        # the connection unread, and we time out instead of allocating for it.
        sock.maxmsgsize = limit
        sock.connect(manifest.address)
        self._sock, self._sock_key = sock, (manifest.address, limit)
        return sock

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock, self._sock_key = None, None

    def _pull(self, sock: zmq.Socket, manifest: Manifest, into: memoryview, where: str) -> None:
        n = manifest.num_buckets
        received = [False] * n
        sent = done = 0
        while done < n:
            while sent < n and sent - done < self._max_in_flight:
                sock.send(msgpack.packb([manifest.version, sent]))
                sent += 1
            header = sock.recv()
            try:
                version, index, status = msgpack.unpackb(header)
            except Exception:
                raise WeightsError(f"{where}: malformed reply header {header[:64]!r}") from None
            if status != "ok":
                hint = " (version dropped or publisher restarted)" if status == "gone" else ""
                raise WeightsError(f"{where}: publisher answered {status!r} for bucket {index}{hint}")
            if version != manifest.version or type(index) is not int or not 0 <= index < sent or received[index]:
                raise WeightsError(f"{where}: unexpected reply for v{version} bucket {index}")
            if not sock.rcvmore:
                raise WeightsError(f"{where}: reply for bucket {index} has no data frame")
            start, end = manifest.bucket_span(index)
            size = sock.recv_into(into[start:end])
            if size != end - start:
                raise WeightsError(f"{where}: bucket {index} has {size} bytes, expected {end - start}")
            if sock.rcvmore:
                raise WeightsError(f"{where}: reply for bucket {index} has extra frames")
            received[index] = True
            done += 1
            self._check_arrived(manifest, into, index)


def _bracket(host: str) -> str:
    """IPv6 literals go in brackets inside a zmq endpoint."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
