"""What a published weight version is: the manifest, its checksums, and their checks.

A version travels as one safetensors payload (``safetensors.torch.save`` bytes: an
8-byte little-endian header length, a JSON header, then the raw tensor data), cut
into fixed-size *buckets*. The manifest names the version, where the payload lives
(transport + address), its size, the bucket size, one checksum per bucket, and the
tensors it holds (name, safetensors dtype, shape, byte range in the payload).

The manifest is the only thing announced through Redis; the payload itself moves
over a transport (``shm``, ``tcp``). A fetcher trusts nothing it receives until the
sizes and every bucket checksum match the manifest.

Checksum: CRC-32C (Castagnoli; the ``crc32c`` package, SSE4.2 hardware instructions),
8 lowercase hex digits per bucket. Measured here on 256 MiB: crc32c ~12 GB/s, about
memcpy speed, where ``zlib.crc32`` ran at ~1.7 GB/s and sha256 ~1.5 GB/s, so checking
a version no longer costs more than moving it. The checksum guards against
*accidental* damage (torn or short writes, a wrong buffer slice, a stale file), for
which a CRC is the standard choice (iSCSI, ext4 and btrfs use this one): it catches
every burst error up to 32 bits and misses random damage with probability 2^-32 per
bucket. It is no defence against an attacker, but neither would a hash be here:
whoever can rewrite the payload can rewrite the manifest in the same Redis.

The payload is written by ``write_payload`` straight from the caller's tensors into
the transport's buffer (one copy: that copy *is* the snapshot), and read back by
``load_tensors`` as tensors over the verified buffer, after checking that the
buffer's own safetensors header says exactly what the manifest says.
"""

from __future__ import annotations

import json
import math
import re
import struct
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import crc32c

if TYPE_CHECKING:
    import torch

DEFAULT_BUCKET_BYTES = 16 << 20
"""Default bucket size (16 MiB): large enough that per-bucket overhead (one request,
one checksum call) is negligible, small enough to pipeline and to retry cheaply."""

SCHEMA = 2
"""Version of the manifest's JSON layout; bump it when a field changes meaning
(2: bucket checksums are CRC-32C, where 1 had zlib's CRC-32)."""

_CHECKSUM_RE = re.compile(r"[0-9a-f]{8}")
_MAX_HEADER_BYTES = 100 << 20  # the same bound safetensors itself enforces


class WeightsError(RuntimeError):
    """A weight transfer failed: missing version, bad data, publisher gone, timeout.

    The caller keeps its current weights and retries later; nothing was swapped in.
    """


def checksum(data: bytes | bytearray | memoryview) -> str:
    """CRC-32C of ``data`` as 8 lowercase hex digits (see the module docstring for why)."""
    return f"{crc32c.crc32c(data):08x}"


class RunningChecksum:
    """``checksum`` of data that arrives in consecutive pieces: ``update`` with each
    piece in order, then ``hexdigest`` equals ``checksum`` of the pieces joined."""

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._value = crc32c.crc32c(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """One tensor of a payload, as its safetensors header describes it."""

    name: str
    """Tensor name (Hugging Face naming, e.g. ``model.layers.0.mlp.up_proj.weight``)."""
    dtype: str
    """safetensors dtype code, e.g. ``F32``, ``BF16``, ``I64``."""
    shape: tuple[int, ...]
    """Shape; ``()`` for a scalar."""
    start: int
    """Offset of the tensor's first byte in the payload (header included)."""
    end: int
    """Offset one past its last byte; ``end - start`` is its size in bytes."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tensor name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ValueError(f"tensor {self.name!r}: dtype must be a non-empty string")
        if not all(_is_int(d) and d >= 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: shape must be non-negative ints, got {self.shape!r}")
        if not (_is_int(self.start) and _is_int(self.end) and 0 <= self.start <= self.end):
            raise ValueError(f"tensor {self.name!r}: bad byte range [{self.start!r}, {self.end!r})")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "start": self.start, "end": self.end}

    @classmethod
    def from_dict(cls, d: Any) -> TensorSpec:
        if not isinstance(d, dict) or set(d) != {"name", "dtype", "shape", "start", "end"}:
            raise ValueError(f"tensor entry must have exactly name, dtype, shape, start, end; got {d!r}")
        if not isinstance(d["shape"], list):
            raise ValueError(f"tensor {d['name']!r}: shape must be a list, got {d['shape']!r}")
        return cls(name=d["name"], dtype=d["dtype"], shape=tuple(d["shape"]), start=d["start"], end=d["end"])


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything a fetcher needs to get, check and load one weight version.

    Sequences are tuples so that the record is really immutable; ``from_json`` and
    the constructor validate every field and raise ``ValueError`` on any defect.
    """

    version: int
    """Policy version = number of optimizer steps applied (>= 0)."""
    transport: str
    """Transport that serves the payload (``shm``, ``tcp``)."""
    address: str
    """Where that transport serves it: a file path (shm), ``tcp://host:port`` (tcp)."""
    total_bytes: int
    """Payload size in bytes (the whole safetensors blob)."""
    bucket_bytes: int
    """Bucket size in bytes; the last bucket may be shorter."""
    checksums: tuple[str, ...]
    """CRC-32C of each bucket, 8 hex digits, ``ceil(total_bytes / bucket_bytes)`` of them."""
    tensors: tuple[TensorSpec, ...]
    """The tensors in the payload, in byte order."""
    created_at: float
    """Unix time (seconds) at which the trainer published this version."""

    def __post_init__(self) -> None:
        if not _is_int(self.version) or self.version < 0:
            raise ValueError(f"manifest version must be an int >= 0, got {self.version!r}")
        for name in ("transport", "address"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"manifest {name} must be a non-empty string, got {getattr(self, name)!r}")
        if not _is_int(self.total_bytes) or self.total_bytes < 0:
            raise ValueError(f"manifest total_bytes must be an int >= 0, got {self.total_bytes!r}")
        if not _is_int(self.bucket_bytes) or self.bucket_bytes <= 0:
            raise ValueError(f"manifest bucket_bytes must be an int > 0, got {self.bucket_bytes!r}")
        if not isinstance(self.checksums, tuple) or not all(
            isinstance(c, str) and _CHECKSUM_RE.fullmatch(c) for c in self.checksums
        ):
            raise ValueError(f"manifest checksums must be a tuple of 8-hex-digit strings, got {self.checksums!r}")
        expected = math.ceil(self.total_bytes / self.bucket_bytes)
        if len(self.checksums) != expected:
            raise ValueError(
                f"manifest has {len(self.checksums)} checksums, expected {expected} "
                f"for {self.total_bytes} bytes in buckets of {self.bucket_bytes}"
            )
        if not isinstance(self.tensors, tuple) or not all(isinstance(t, TensorSpec) for t in self.tensors):
            raise ValueError("manifest tensors must be a tuple of TensorSpec")
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("manifest tensor names must be unique")
        for t in self.tensors:
            if t.end > self.total_bytes:
                raise ValueError(f"tensor {t.name!r} ends at byte {t.end}, past the payload ({self.total_bytes})")
        if not isinstance(self.created_at, (int, float)) or isinstance(self.created_at, bool) \
                or not math.isfinite(self.created_at):
            raise ValueError(f"manifest created_at must be a finite number, got {self.created_at!r}")

    @property
    def num_buckets(self) -> int:
        return len(self.checksums)

    def bucket_span(self, index: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of bucket ``index`` in the payload."""
        if not 0 <= index < self.num_buckets:
            raise IndexError(f"bucket {index} out of range (0..{self.num_buckets - 1})")
        start = index * self.bucket_bytes
        return start, min(start + self.bucket_bytes, self.total_bytes)

    def to_json(self) -> str:
        return json.dumps(
            {
                "schema": SCHEMA,
                "version": self.version,
                "transport": self.transport,
                "address": self.address,
                "total_bytes": self.total_bytes,
                "bucket_bytes": self.bucket_bytes,
                "checksums": list(self.checksums),
                "tensors": [t.to_dict() for t in self.tensors],
                "created_at": self.created_at,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and validate; ``ValueError`` on anything malformed (never executes code)."""
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"manifest is not valid JSON: {e}") from None
        fields = {"schema", "version", "transport", "address", "total_bytes", "bucket_bytes",
                  "checksums", "tensors", "created_at"}
        if not isinstance(d, dict):
            raise ValueError(f"manifest must be a JSON object, got {type(d).__name__}")
        if set(d) != fields:
            missing, extra = sorted(fields - set(d)), sorted(set(d) - fields)
            raise ValueError(f"manifest fields wrong: missing {missing}, unexpected {extra}")
        if d["schema"] != SCHEMA:
            raise ValueError(f"manifest schema {d['schema']!r} not supported (expected {SCHEMA})")
        for name in ("checksums", "tensors"):
            if not isinstance(d[name], list):
                raise ValueError(f"manifest {name} must be a list, got {type(d[name]).__name__}")
        return cls(
            version=d["version"],
            transport=d["transport"],
            address=d["address"],
            total_bytes=d["total_bytes"],
            bucket_bytes=d["bucket_bytes"],
            checksums=tuple(d["checksums"]),
            tensors=tuple(TensorSpec.from_dict(t) for t in d["tensors"]),
            created_at=d["created_at"],
        )


def describe(
    payload: bytes, *, version: int, transport: str, address: str, bucket_bytes: int, created_at: float
) -> Manifest:
    """Build the manifest of a safetensors ``payload``: bucket checksums and tensor specs."""
    view = memoryview(payload)
    checksums = tuple(
        checksum(view[start : start + bucket_bytes]) for start in range(0, len(payload), bucket_bytes)
    )
    return Manifest(
        version=version,
        transport=transport,
        address=address,
        total_bytes=len(payload),
        bucket_bytes=bucket_bytes,
        checksums=checksums,
        tensors=parse_header(payload),
        created_at=created_at,
    )


def parse_header(payload: bytes | bytearray | memoryview) -> tuple[TensorSpec, ...]:
    """Tensor specs from a safetensors payload's header, offsets made absolute.

    ``ValueError`` if the header is malformed; ``__metadata__`` is skipped.
    """
    if len(payload) < 8:
        raise ValueError(f"safetensors payload too short ({len(payload)} bytes) for its header length")
    (header_len,) = struct.unpack_from("<Q", payload, 0)
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > len(payload):
        raise ValueError(f"safetensors header length {header_len} does not fit the payload ({len(payload)} bytes)")
    try:
        header = json.loads(bytes(payload[8 : 8 + header_len]))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header must be a JSON object")
    base = 8 + header_len
    specs = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            specs.append(TensorSpec(name=name, dtype=entry["dtype"], shape=tuple(entry["shape"]),
                                    start=base + begin, end=base + end))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"safetensors header entry {name!r} is malformed: {entry!r}") from e
    # Header order is not data order; sort by offset so specs read like the payload.
    specs.sort(key=lambda t: (t.start, t.end))
    for t in specs:
        if t.end > len(payload):
            raise ValueError(f"tensor {t.name!r} ends at byte {t.end}, past the payload ({len(payload)})")
    return tuple(specs)


def verify(manifest: Manifest, payload: bytes | bytearray | memoryview) -> None:
    """Check size and every bucket checksum; ``WeightsError`` names the first bad bucket."""
    if len(payload) != manifest.total_bytes:
        raise WeightsError(
            f"weights v{manifest.version}: got {len(payload)} bytes, manifest says {manifest.total_bytes}"
        )
    view = memoryview(payload)
    for index, expected in enumerate(manifest.checksums):
        start, end = manifest.bucket_span(index)
        got = checksum(view[start:end])
        if got != expected:
            raise WeightsError(
                f"weights v{manifest.version}: bucket {index} (bytes {start}..{end}) checksum {got} "
                f"!= manifest {expected}; payload corrupt or replaced"
            )


def _is_int(x: object) -> bool:
    # bool is an int subclass; a JSON `true` must not pass for a size or a version.
    return isinstance(x, int) and not isinstance(x, bool)


# --- payload layout: writing tensors in, reading tensors out -------------------------

_DTYPE_CODES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
"""safetensors dtype code -> torch dtype attribute name (the codes safetensors writes)."""


def _torch_dtype(code: str) -> torch.dtype:
    import torch

    name = _DTYPE_CODES.get(code)
    if name is None or not hasattr(torch, name):
        raise ValueError(f"dtype {code!r} is not supported (known: {', '.join(_DTYPE_CODES)})")
    return getattr(torch, name)


def _dtype_code(dtype: torch.dtype) -> str:
    for code, name in _DTYPE_CODES.items():
        if str(dtype) == f"torch.{name}":
            return code
    raise ValueError(f"dtype {dtype} cannot be published (supported: {', '.join(_DTYPE_CODES)})")


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a version goes in its safetensors payload; ``write`` fills a buffer."""

    header: bytes
    """The 8-byte length prefix and the JSON header, padded so tensor data starts 8-aligned."""
    parts: tuple[tuple[torch.Tensor, int, int], ...]
    """(tensor, start, end) byte ranges in the payload, in payload order."""
    total_bytes: int

    def write(self, into: memoryview) -> None:
        """Copy the header and every tensor into ``into`` (exactly ``total_bytes``, writable).

        This is the only copy the publisher makes: it is the snapshot, so the caller's
        tensors may change as soon as it returns.
        """
        import torch

        if len(into) != self.total_bytes:
            raise ValueError(f"payload buffer has {len(into)} bytes, the layout needs {self.total_bytes}")
        into[: len(self.header)] = self.header
        dst = torch.frombuffer(into, dtype=torch.uint8)
        for tensor, start, end in self.parts:
            if end > start:
                dst[start:end].copy_(tensor.detach().reshape(-1).view(torch.uint8))


def lay_out(tensors: dict[str, torch.Tensor]) -> Layout:
    """Plan the safetensors payload of ``tensors`` (HF names -> tensors, any device).

    Tensors are ordered by element size, largest first, then by name, so every one
    starts aligned to its element size and views of the payload need no realignment.
    ``ValueError`` names the offending tensor if one cannot be published.
    """
    import torch

    if not tensors:
        raise ValueError("cannot publish an empty set of tensors")
    entries = []
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"tensor name must be a non-empty string other than '__metadata__', got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        try:
            entries.append((name, t, _dtype_code(t.dtype)))
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from None
    entries.sort(key=lambda e: (-e[1].element_size(), e[0]))
    header: dict[str, Any] = {}
    offset, placed = 0, []
    for name, t, code in entries:
        if not t.is_contiguous():
            t = t.contiguous()
        size = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        placed.append((t, offset, offset + size))
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # safetensors pads the header with spaces
    prefix = struct.pack("<Q", len(text)) + text
    base = len(prefix)
    return Layout(header=prefix, parts=tuple((t, base + s, base + e) for t, s, e in placed),
                  total_bytes=base + offset)


def load_tensors(manifest: Manifest, payload: memoryview, *, copy: bool) -> dict[str, torch.Tensor]:
    """Tensors of a verified ``payload`` (run ``verify`` first).

    The payload's own safetensors header must describe exactly the manifest's tensors
    (``WeightsError`` otherwise). ``copy=True``: fresh tensors (one copy each) that
    share nothing with ``payload``. ``copy=False``: views of ``payload`` (no copy),
    valid while the payload's buffer is; read-only when the buffer is.
    """
    import torch

    try:
        specs = parse_header(payload)
    except ValueError as e:
        raise WeightsError(f"weights v{manifest.version}: payload header unreadable: {e}") from None
    if specs != manifest.tensors:
        raise WeightsError(f"weights v{manifest.version}: payload header differs from the manifest's tensors")
    out = {}
    with warnings.catch_warnings():
        # A read-only buffer (an mmap of a published file) gives read-only views; torch
        # warns about that on every call, and copy=False callers only read them.
        warnings.simplefilter("ignore", UserWarning)
        for spec in specs:
            try:
                dtype = _torch_dtype(spec.dtype)
            except ValueError as e:
                raise WeightsError(f"weights v{manifest.version}: tensor {spec.name!r}: {e}") from None
            numel = math.prod(spec.shape)
            if numel * dtype.itemsize != spec.end - spec.start:
                raise WeightsError(f"weights v{manifest.version}: tensor {spec.name!r} size does not match its shape")
            if numel == 0:
                out[spec.name] = torch.empty(spec.shape, dtype=dtype)
                continue
            t = torch.frombuffer(payload, dtype=dtype, count=numel, offset=spec.start).reshape(spec.shape)
            out[spec.name] = t.clone() if copy else t
    return out
