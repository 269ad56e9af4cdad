"""Versioned weights: the trainer publishes, generators fetch, nobody runs half-written weights.

::

    trainer                                         generator x N
    publish(v, tensors)                             fetch()
      │ safetensors.torch.save -> payload bytes       │ HGET <key> manifest
      │ cut into buckets, CRC-32 each                 │ transfer payload into a reused buffer
      │ transport stores payload   ── shm file ──►    │   (shm: readinto; tcp: recv_into per bucket)
      │                            ── tcp/zmq ──►     │ check size + every bucket checksum
      │ HSET <key> version, manifest  (announce)      │ safetensors.torch.load -> tensors
      └ drop versions older than keep_versions        └ any defect -> WeightsError, keep old weights

The Redis hash ``key`` (e.g. ``<ns>:weights``) holds:

- ``version``: the newest published version (decimal);
- ``manifest``: that version's manifest JSON (``Manifest.to_json``);
- ``manifest:<v>``: the manifest of every retained version, for ``fetch(v)``.

Ordering is what keeps readers safe: the payload is complete at its address before
one atomic HSET announces it, and a version's announcement is deleted before its
payload is. A reader that loses a race (its version dropped mid-transfer) gets a
``WeightsError`` and retries with the newest version; it never gets bad tensors.

Transports are picked by name in one factory (``make_publisher``/``make_fetcher``);
adding one means subclassing ``WeightPublisher`` (``_store``, ``_retain``,
``_shutdown``) and ``WeightFetcher`` (``_transfer``) and naming it in ``TRANSPORTS``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import redis
import safetensors.torch

from pipeline.weights.manifest import (
    DEFAULT_BUCKET_BYTES,
    Manifest,
    TensorSpec,
    WeightsError,
    describe,
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
    "WeightsError",
    "make_fetcher",
    "make_publisher",
]

TRANSPORTS = ("shm", "tcp")
"""Transport names ``make_publisher``/``make_fetcher`` accept."""

_VERSION_FIELD = "version"
_MANIFEST_FIELD = "manifest"
_VERSIONED_PREFIX = "manifest:"


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

    @property
    def retained_versions(self) -> tuple[int, ...]:
        """Versions this publisher still serves, oldest first."""
        return tuple(self._retained)

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> Manifest:
        """Serialise ``tensors`` (a CPU snapshot the caller will not mutate), serve, announce.

        Versions must increase. Returns the announced manifest.
        """
        if self._closed:
            raise RuntimeError("publish() on a closed WeightPublisher")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        if self._retained and version <= self._retained[-1]:
            raise ValueError(f"version {version} is not newer than the last published ({self._retained[-1]})")
        payload = safetensors.torch.save(tensors)
        # 1. The payload is complete and served at its address ...
        address = self._store(version, payload)
        manifest = describe(payload, version=version, transport=self.transport, address=address,
                            bucket_bytes=self._bucket_bytes, created_at=time.time())
        text = manifest.to_json()
        # 2. ... before one atomic HSET makes it visible (both "version" and "manifest"
        # appear together, so a reader never pairs a version with another's manifest).
        self._redis.hset(self._key, mapping={_manifest_field(version): text,
                                             _VERSION_FIELD: version, _MANIFEST_FIELD: text})
        self._retained.append(version)
        del self._retained[: -self._keep_versions]
        # 3. Retire old versions: announcement first, then data. The sweep over all
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
        self._shutdown()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def _store(self, version: int, payload: bytes) -> str:
        """Make ``payload`` fully available for ``version``; return its address."""

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
        # The "second buffer": payloads land here, are checked, and only then loaded.
        # Reused across fetches so each fetch does not pay fresh page faults.
        self._buffer = bytearray()

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

    def fetch(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """Transfer, verify and load ``version`` (newest if None) -> ``(version, tensors)``.

        Raises ``WeightsError`` on any defect; the tensors are fresh CPU tensors that
        share nothing with the fetcher's buffer, so the caller may keep them.
        """
        manifest = self.manifest(version)
        if manifest.transport != self.transport:
            raise WeightsError(
                f"weights v{manifest.version} are served over {manifest.transport!r}, "
                f"but this fetcher speaks {self.transport!r}"
            )
        if len(self._buffer) < manifest.total_bytes:
            self._buffer = bytearray(manifest.total_bytes)
        view = memoryview(self._buffer)[: manifest.total_bytes]
        self._transfer(manifest, view)
        verify(manifest, view)
        # safetensors.torch.load takes only `bytes` (one copy); it parses the header
        # itself and never executes code.
        data = bytes(view)
        try:
            tensors = safetensors.torch.load(data)
        except Exception as e:  # SafetensorError has no stable import path
            raise WeightsError(f"weights v{manifest.version}: safetensors could not load the payload: {e}") from e
        if set(tensors) != {t.name for t in manifest.tensors}:
            raise WeightsError(f"weights v{manifest.version}: payload tensors differ from the manifest's")
        return manifest.version, tensors

    def close(self) -> None:
        """Release transport resources and the receive buffer (idempotent)."""
        self._buffer = bytearray()

    def __enter__(self) -> WeightFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def _transfer(self, manifest: Manifest, into: memoryview) -> None:
        """Fill ``into`` (exactly ``manifest.total_bytes``) with the payload, or raise
        ``WeightsError``. Must give up within a bounded time."""

    def _hget(self, field: str) -> bytes | str | None:
        try:
            return self._redis.hget(self._key, field)
        except redis.RedisError as e:
            raise WeightsError(f"cannot read {self._key!r} from Redis: {e}") from e


def make_publisher(
    transport: str, redis_client: redis.Redis, key: str, *, ns: str, **opts: Any
) -> WeightPublisher:
    """Publisher for ``transport`` (one of ``TRANSPORTS``); ``opts`` go to its constructor.

    ``ns`` (the run id) scopes transport resources, e.g. the shm directory.
    """
    # Imports are local so that choosing shm never imports zmq, and vice versa.
    if transport == "shm":
        from pipeline.weights.shm import ShmPublisher

        return ShmPublisher(redis_client, key, ns=ns, **opts)
    if transport == "tcp":
        from pipeline.weights.tcp import TcpPublisher

        return TcpPublisher(redis_client, key, ns=ns, **opts)
    raise ValueError(f"unknown weights transport {transport!r}; allowed: {', '.join(TRANSPORTS)}")


def make_fetcher(transport: str, redis_client: redis.Redis, key: str, **opts: Any) -> WeightFetcher:
    """Fetcher for ``transport`` (one of ``TRANSPORTS``); ``opts`` go to its constructor."""
    if transport == "shm":
        from pipeline.weights.shm import ShmFetcher

        return ShmFetcher(redis_client, key, **opts)
    if transport == "tcp":
        from pipeline.weights.tcp import TcpFetcher

        return TcpFetcher(redis_client, key, **opts)
    raise ValueError(f"unknown weights transport {transport!r}; allowed: {', '.join(TRANSPORTS)}")


def _is_stale_field(field: bytes | str, retained: list[int]) -> bool:
    name = field.decode() if isinstance(field, bytes) else field
    if not name.startswith(_VERSIONED_PREFIX):
        return False
    suffix = name[len(_VERSIONED_PREFIX) :]
    return not (suffix.isdigit() and int(suffix) in retained)
