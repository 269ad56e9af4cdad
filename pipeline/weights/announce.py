"""New-version announcements: a ZeroMQ PUB note for speed, the Redis hash for the record.

::

    publisher                                   WeightWatch (one per generator)
      HSET <key> version=v, announce=<endpoint>   HGET <key> version    (at start: late joiner)
      PUB  [<key>, msgpack(v)]          ──────►   SUB wakes at once; HGET again
                                                  nothing for recheck_s: HGET anyway

A PUB/SUB note is fire-and-forget: a subscriber that connects after it was sent, or
whose publisher restarted on a new port, never sees it. So a note only wakes the
watcher, and the version it reports is always read back from the durable hash. A
generator that starts late, or restarts, reads the newest version from the hash
before it waits for anything, and a lost note costs at most ``recheck_s``.
"""

from __future__ import annotations

import time

import msgpack
import redis
import zmq

from pipeline.weights.manifest import WeightsError

_VERSION_FIELD = "version"
_ANNOUNCE_FIELD = "announce"

JOIN_WINDOW_S = 2.0
"""After (re)connecting its SUB socket, a watcher re-reads the hash every JOIN_RECHECK_S for
this long: notes sent before the subscription reaches the publisher are dropped by PUB."""
JOIN_RECHECK_S = 0.05


class Announcer:
    """The publisher's PUB socket on ``host``: ``port`` (0: a free one); one note per version.

    ``address`` is what subscribers connect to: ``advertise_host`` (default ``host``) and the
    port, so a publisher bound to ``0.0.0.0`` in a pod or on a node advertises a reachable name.
    """

    def __init__(self, key: str, *, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"announce port must be an int in 0..65535, got {port!r}")
        self._topic = key.encode()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.linger = 0
        self._sock.sndhwm = 100  # notes are tiny; a stuck subscriber only loses old ones
        if ":" in host:
            self._sock.ipv6 = True
        endpoint = f"tcp://[{host}]" if ":" in host else f"tcp://{host}"
        try:
            if port:
                self._sock.bind(f"{endpoint}:{port}")
            else:
                port = self._sock.bind_to_random_port(endpoint)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            self._ctx.term()
            raise ValueError(f"announce_host {host!r} port {port}: cannot bind a PUB socket: {e}") from e
        shown = advertise_host or host
        self.address = f"tcp://[{shown}]:{port}" if ":" in shown else f"tcp://{shown}:{port}"

    def announce(self, version: int) -> None:
        # NOBLOCK: PUB never blocks anyway (it drops for slow peers); be explicit.
        self._sock.send_multipart([self._topic, msgpack.packb(version)], flags=zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


class WeightWatch:
    """Generator side: the newest announced version, and a blocking wait for a newer one.

    ``recheck_s`` bounds how long a lost PUB note (or a publisher not started yet)
    can delay noticing a version: the watcher reads the hash at least that often
    while it waits. Not thread-safe: one watcher per thread.
    """

    def __init__(self, redis_client: redis.Redis, key: str, *, recheck_s: float = 1.0) -> None:
        if not key:
            raise ValueError("key must be a non-empty Redis key name")
        if not isinstance(recheck_s, (int, float)) or not recheck_s > 0:
            raise ValueError(f"recheck_s must be > 0, got {recheck_s!r}")
        self._redis = redis_client
        self._key = key
        self._topic = key.encode()
        self._recheck_s = float(recheck_s)
        self._ctx = zmq.Context()
        self._sub: zmq.Socket | None = None
        self._endpoint: str | None = None
        self._connected_at = float("-inf")

    def latest(self) -> int:
        """Newest version in the durable hash (-1 if none); reconnects the SUB socket
        when the publisher moved (restart) and drops notes already covered.

        Notes are drained *before* the hash is read: the publisher writes the hash, then
        sends the note, so every note drained here is covered by the read that follows,
        and a note sent after the read stays queued and wakes the next poll. (Draining
        after the read lost a note that landed between the two, leaving the watcher asleep
        for ``recheck_s``.)
        """
        self._drain()
        try:
            version, endpoint = self._redis.hmget(self._key, [_VERSION_FIELD, _ANNOUNCE_FIELD])
        except redis.RedisError as e:
            raise WeightsError(f"cannot read {self._key!r} from Redis: {e}") from e
        if endpoint is not None:
            self._connect(endpoint.decode() if isinstance(endpoint, bytes) else endpoint)
        if version is None:
            return -1
        try:
            return int(version)
        except ValueError:
            raise WeightsError(f"{self._key!r} field 'version' is not an integer: {version!r}") from None

    def wait(self, after: int, timeout_s: float) -> int:
        """Block until a version newer than ``after`` is announced, or ``timeout_s`` passes.

        Returns the newest version (``<= after`` only on a timeout). Returns at once if
        the hash already holds a newer one, which is how late joiners catch up.
        """
        deadline = time.monotonic() + timeout_s
        newest = self.latest()
        while newest <= after:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            step_s = min(remaining, self._recheck_s)
            if time.monotonic() - self._connected_at < JOIN_WINDOW_S:
                # A fresh SUB socket misses notes until its subscription reaches the
                # publisher (ZeroMQ's slow joiner); re-read the hash often meanwhile.
                step_s = min(step_s, JOIN_RECHECK_S)
            step_ms = max(1, round(step_s * 1000))
            if self._sub is not None:
                self._sub.poll(step_ms)  # a note, or the recheck period, ends the wait
            else:
                time.sleep(step_ms / 1000)  # no publisher has announced an endpoint yet
            newest = self.latest()
        return newest

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        self._ctx.term()

    def __enter__(self) -> WeightWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self, endpoint: str) -> None:
        if endpoint == self._endpoint:
            return
        if self._sub is not None:
            self._sub.close(linger=0)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.linger = 0
        self._sub.maxmsgsize = 1024
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._sub.connect(endpoint)
        self._endpoint = endpoint
        self._connected_at = time.monotonic()

    def _drain(self) -> None:
        if self._sub is None:
            return
        while True:
            try:
                self._sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
