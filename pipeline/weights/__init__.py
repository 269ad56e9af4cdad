"""Versioned weights: the trainer publishes, generators fetch, nobody runs half-written weights.

::

    trainer                                          generator x N
    publish(v, tensors)                              WeightWatch: PUB/SUB note of v (or the hash)
      │ lay out a safetensors payload                fetch(v)
      │ copy tensors into the transport's buffer       │ HGET <key> manifest:<v>
      │   (the snapshot; one copy)                     │ transfer into the second buffer
      │ CRC-32C each bucket                            │   (shm: map the file; tcp: recv_into per
      │ transport serves it ── shm file ──────►        │    bucket; ucx: one tag_recv)
      │                      ── tcp (ZeroMQ) ─►        │ check size + every bucket checksum
      │                      ── ucx (ucxx) ───►        │ tensors over the verified buffer
      │ HSET <key> version, manifest  (durable)        │   (copy=False: views, no copy)
      │ PUB <key> v                   (fast)           └ any defect -> WeightsError, keep old weights
      └ drop versions older than keep_versions

The Redis hash ``key`` (e.g. ``<ns>:weights``) holds:

- ``version``: the newest published version (decimal);
- ``manifest``: that version's manifest JSON (``Manifest.to_json``);
- ``manifest:<v>``: the manifest of every retained version, for ``fetch(v)``;
- ``announce``: the ZeroMQ PUB endpoint that announces new versions (``WeightWatch``).

Ordering is what keeps readers safe: the payload is complete at its address before
one atomic HSET announces it, and a version's announcement is deleted before its
payload is. A reader that loses a race (its version dropped mid-transfer) gets a
``WeightsError`` and retries with the newest version; it never gets bad tensors.

Transports are picked by name from the ``TRANSPORTS`` registry (``pipeline.catalog``) by
``make_publisher``/``make_fetcher``; adding one means subclassing ``WeightPublisher``
(``_allocate``, ``_store``, ``_retain``, ``_shutdown``) and ``WeightFetcher`` (``_transfer``) in
a module of its own and one ``TRANSPORTS.register`` line naming the pair. A transport's
module is imported only when a run picks it (choosing shm or tcp never imports ucxx).
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import redis

from pipeline.catalog import TRANSPORTS
from pipeline.weights.announce import Announcer, WeightWatch
from pipeline.weights.manifest import (
    DEFAULT_BUCKET_BYTES,
    Manifest,
    TensorSpec,
    WeightsError,
    checksum,
    describe,
    lay_out,
    load_tensors,
    verify,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "TRANSPORTS",
    "Manifest",
    "TensorSpec",
    "WeightFetcher",
    "WeightPublisher",
    "WeightWatch",
    "WeightsError",
    "fetcher_options",
    "host_buffer",
    "make_fetcher",
    "make_publisher",
    "publisher_options",
]


_VERSION_FIELD = "version"
_MANIFEST_FIELD = "manifest"
_VERSIONED_PREFIX = "manifest:"
ANNOUNCE_FIELD = "announce"


def _manifest_field(version: int) -> str:
    return f"{_VERSIONED_PREFIX}{version}"


class WeightPublisher(ABC):
    """Trainer side: makes each version's payload available, then announces it in Redis.

    Not thread-safe: call ``publish`` from one thread (the trainer loop).
    """

    transport: ClassVar[str]

    def __init__(
        self,
        redis_client: redis.Redis,
        key: str,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        keep_versions: int = 3,
        announce_host: str | None = "127.0.0.1",
        announce_port: int = 0,
        announce_advertise_host: str | None = None,
    ) -> None:
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be an int > 0, got {bucket_bytes!r}")
        if not isinstance(keep_versions, int) or keep_versions < 1:
            raise ValueError(f"keep_versions must be an int >= 1, got {keep_versions!r}")
        if not key:
            raise ValueError("key must be a non-empty Redis key name")
        self._redis = redis_client
        self._key = key
        self._bucket_bytes = bucket_bytes
        self._keep_versions = keep_versions
        self._retained: list[int] = []  # oldest first
        self._closed = False
        # None: no PUB socket; generators then learn of versions from the hash alone.
        self._announcer = (Announcer(key, host=announce_host, port=announce_port,
                                     advertise_host=announce_advertise_host) if announce_host else None)

    @property
    def retained_versions(self) -> tuple[int, ...]:
        """Versions this publisher still serves, oldest first."""
        return tuple(self._retained)

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> Manifest:
        """Copy ``tensors`` into a new payload, serve it, announce it; returns the manifest.

        The copy is the snapshot: once ``publish`` returns, the caller may change its
        tensors (an optimizer step) without touching the published version. Versions
        must increase.
        """
        if self._closed:
            raise RuntimeError("publish() on a closed WeightPublisher")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        if self._retained and version <= self._retained[-1]:
            raise ValueError(f"version {version} is not newer than the last published ({self._retained[-1]})")
        layout = lay_out(tensors)
        buffer = self._allocate(version, layout.total_bytes)
        layout.write(buffer)
        manifest = describe(buffer, version=version, transport=self.transport, address="pending",
                            bucket_bytes=self._bucket_bytes, created_at=time.time())
        del buffer  # the transport may close the mapping behind it
        # 1. The payload is complete and served at its address ...
        address = self._store(version)
        manifest = dataclasses.replace(manifest, address=address)
        text = manifest.to_json()
        # 2. ... before one atomic HSET makes it visible (both "version" and "manifest"
        # appear together, so a reader never pairs a version with another's manifest).
        fields: dict[str, str | int] = {_manifest_field(version): text, _VERSION_FIELD: version,
                                        _MANIFEST_FIELD: text}
        if self._announcer is not None:
            fields[ANNOUNCE_FIELD] = self._announcer.address
        self._redis.hset(self._key, mapping=fields)
        # 3. The PUB note is only a wake-up call; the hash above is the record.
        if self._announcer is not None:
            self._announcer.announce(version)
        self._retained.append(version)
        del self._retained[: -self._keep_versions]
        # 4. Retire old versions: announcement first, then data. The sweep over all
        # manifest:<v> fields also clears those a previous publisher process left behind.
        stale = [f for f in self._redis.hkeys(self._key) if _is_stale_field(f, self._retained)]
        if stale:
            self._redis.hdel(self._key, *stale)
        self._retain(frozenset(self._retained))
        return manifest

    def close(self) -> None:
        """Stop serving and release every retained payload. The Redis announcement stays
        (it is the durable record); fetchers of a closed publisher get ``WeightsError``."""
        if self._closed:
            return
        self._closed = True
        self._retained.clear()
        if self._announcer is not None:
            self._announcer.close()
        self._shutdown()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def _allocate(self, version: int, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes`` that will hold the payload of ``version``."""

    @abstractmethod
    def _store(self, version: int) -> str:
        """Serve the (now complete) buffer from ``_allocate`` as ``version``; return its address."""

    @abstractmethod
    def _retain(self, versions: frozenset[int]) -> None:
        """Stop serving every version not in ``versions`` and free its data."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Stop serving everything and release transport resources (idempotent)."""


class WeightFetcher(ABC):
    """Generator side: reads manifests from Redis, transfers, verifies, loads.

    Not thread-safe (it reuses one receive buffer): one fetcher per thread.
    """

    transport: ClassVar[str]

    def __init__(self, redis_client: redis.Redis, key: str) -> None:
        if not key:
            raise ValueError("key must be a non-empty Redis key name")
        self._redis = redis_client
        self._key = key
        # The "second buffer" (the model holds the first): payloads land here, are
        # checked, and only then loaded. Reused across fetches so that each fetch does
        # not pay fresh page faults.
        self._buffer = host_buffer(0)
        # Bucket checksums computed while the rest of the payload is still arriving
        # (``_check_arrived``); crc32c releases the GIL, so they overlap the transfer.
        self._checker: ThreadPoolExecutor | None = None
        self._checks: dict[int, Future[str]] = {}

    def latest_version(self) -> int:
        """Newest announced version, or -1 if none has been published."""
        raw = self._hget(_VERSION_FIELD)
        if raw is None:
            return -1
        try:
            return int(raw)
        except ValueError:
            raise WeightsError(f"{self._key!r} field 'version' is not an integer: {raw!r}") from None

    def manifest(self, version: int | None = None) -> Manifest:
        """Manifest of ``version`` (newest if None); ``WeightsError`` if not announced."""
        field = _MANIFEST_FIELD if version is None else _manifest_field(version)
        raw = self._hget(field)
        if raw is None:
            if version is None:
                raise WeightsError(f"no weights published yet under {self._key!r}")
            raise WeightsError(
                f"weights v{version} not available under {self._key!r} (never published or no "
                f"longer retained; newest is v{self.latest_version()})"
            )
        try:
            manifest = Manifest.from_json(raw)
        except ValueError as e:
            raise WeightsError(f"{self._key!r} field {field!r} holds a malformed manifest: {e}") from e
        if version is not None and manifest.version != version:
            raise WeightsError(f"{self._key!r} field {field!r} holds the manifest of v{manifest.version}")
        return manifest

    def fetch(self, version: int | None = None, *, copy: bool = True) -> tuple[int, dict[str, torch.Tensor]]:
        """Transfer, verify and load ``version`` (newest if None) -> ``(version, tensors)``.

        Raises ``WeightsError`` on any defect. ``copy=True``: fresh CPU tensors that
        share nothing with the fetcher, so the caller may keep them. ``copy=False``:
        views of the receive buffer (never write to them), no copy at all; valid until the
        next ``fetch`` or ``close``, which is all a caller that copies them into a model
        straight away (``load_state_dict``, vLLM's reload) needs.
        """
        manifest = self.manifest(version)
        if manifest.transport != self.transport:
            raise WeightsError(
                f"weights v{manifest.version} are served over {manifest.transport!r}, "
                f"but this fetcher speaks {self.transport!r}"
            )
        self._checks = {}
        payload = self._transfer(manifest)
        if self._checks:
            self._verify_checks(manifest, payload)
        else:
            verify(manifest, payload)
        return manifest.version, load_tensors(manifest, payload, copy=copy)

    def close(self) -> None:
        """Release transport resources and the receive buffer (idempotent)."""
        self._buffer = host_buffer(0)
        if self._checker is not None:
            self._checker.shutdown(wait=True, cancel_futures=True)
            self._checker = None

    def __enter__(self) -> WeightFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def _transfer(self, manifest: Manifest) -> memoryview:
        """The payload (exactly ``manifest.total_bytes``, unverified), or ``WeightsError``.
        Must give up within a bounded time."""

    def _check_arrived(self, manifest: Manifest, payload: memoryview, index: int) -> None:
        """Bucket ``index`` of ``payload`` is complete: checksum it on the helper thread
        while the transfer goes on. A transport that calls this for every bucket saves
        ``fetch`` a second pass over the payload."""
        if self._checker is None:
            self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-crc")
        start, end = manifest.bucket_span(index)
        self._checks[index] = self._checker.submit(checksum, payload[start:end])

    def _verify_checks(self, manifest: Manifest, payload: memoryview) -> None:
        if len(payload) != manifest.total_bytes:
            raise WeightsError(
                f"weights v{manifest.version}: got {len(payload)} bytes, manifest says {manifest.total_bytes}"
            )
        for index, expected in enumerate(manifest.checksums):
            check = self._checks.get(index)
            if check is None:
                raise WeightsError(f"weights v{manifest.version}: bucket {index} never arrived")
            got = check.result()
            if got != expected:
                start, end = manifest.bucket_span(index)
                raise WeightsError(
                    f"weights v{manifest.version}: bucket {index} (bytes {start}..{end}) checksum {got} "
                    f"!= manifest {expected}; payload corrupt or replaced"
                )

    def _receive_buffer(self, nbytes: int) -> memoryview:
        """The reused receive buffer, grown to ``nbytes`` if needed."""
        if self._buffer.nbytes < nbytes:
            self._buffer = host_buffer(0)  # drop the old one before allocating the new
            self._buffer = host_buffer(nbytes)
        return memoryview(self._buffer)[:nbytes]

    def _hget(self, field: str) -> bytes | str | None:
        try:
            return self._redis.hget(self._key, field)
        except redis.RedisError as e:
            raise WeightsError(f"cannot read {self._key!r} from Redis: {e}") from e


def host_buffer(nbytes: int) -> np.ndarray:
    """An uninitialised byte buffer for payloads. numpy backs large arrays with
    transparent huge pages (``madvise``) where the kernel allows it, which cuts page
    faults and TLB misses for every pass over a payload; measured here, UCX's cma
    transfers between bytearrays ran at about half the speed of numpy buffers."""
    return np.empty(nbytes, dtype=np.uint8)


def _transport(transport: str) -> tuple[type[WeightPublisher], type[WeightFetcher]]:
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown weights transport {transport!r}; allowed: {', '.join(TRANSPORTS)}")
    return TRANSPORTS.get(transport)


def make_publisher(
    transport: str, redis_client: redis.Redis, key: str, *, ns: str, **opts: Any
) -> WeightPublisher:
    """Publisher for ``transport`` (a name in ``TRANSPORTS``); ``opts`` go to its constructor.

    ``ns`` (the run id) scopes transport resources, e.g. the shm directory.
    """
    return _transport(transport)[0](redis_client, key, ns=ns, **opts)


def make_fetcher(transport: str, redis_client: redis.Redis, key: str, **opts: Any) -> WeightFetcher:
    """Fetcher for ``transport`` (a name in ``TRANSPORTS``); ``opts`` go to its constructor."""
    return _transport(transport)[1](redis_client, key, **opts)


def publisher_options(weights_cfg: Any) -> dict[str, Any]:
    """``make_publisher`` options from a ``WeightsConfig``, the transport's own (the caller
    passes ``keep_versions``)."""
    advertise = weights_cfg.advertise_host or None
    opts: dict[str, Any] = {"announce_host": weights_cfg.tcp_host, "announce_port": weights_cfg.announce_port,
                            "announce_advertise_host": advertise}
    if TRANSPORTS.meta(weights_cfg.transport, "socket"):
        opts.update(host=weights_cfg.tcp_host, port=weights_cfg.tcp_port, advertise_host=advertise)
    if weights_cfg.transport == "ucx" and weights_cfg.ucx_tls:
        opts["tls"] = weights_cfg.ucx_tls
    return opts


def fetcher_options(weights_cfg: Any) -> dict[str, Any]:
    """``make_fetcher`` options from a ``WeightsConfig``."""
    opts: dict[str, Any] = {}
    if TRANSPORTS.meta(weights_cfg.transport, "socket"):
        opts["timeout_s"] = weights_cfg.fetch_timeout_s
    if weights_cfg.transport == "ucx" and weights_cfg.ucx_tls:
        opts["tls"] = weights_cfg.ucx_tls
    return opts


def _is_stale_field(field: bytes | str, retained: list[int]) -> bool:
    name = field.decode() if isinstance(field, bytes) else field
    if not name.startswith(_VERSIONED_PREFIX):
        return False
    suffix = name[len(_VERSIONED_PREFIX) :]
    return not (suffix.isdigit() and int(suffix) in retained)
