"""``shm`` transport: one immutable file per version in shared memory (same host only).

The publisher writes each payload to ``/dev/shm/<ns>/<key>.v<version>.safetensors``
(``<tempdir>/<ns>/...`` where ``/dev/shm`` is missing): it maps a temporary file in
the same directory, copies the tensors straight into the mapping (the only copy on
the publishing side) and renames the file into place, so the final name only ever
refers to a complete payload. Files are never modified after the rename; dropping a
version unlinks its file, and a reader that already opened it keeps reading the
intact data (POSIX unlink semantics). The address in the manifest is the file path.

The fetcher maps the file read-only: the page cache pages the publisher wrote are
the fetcher's receive buffer, so a fetch copies nothing until the tensors are loaded
into a model. Every file is a valid safetensors file (``safetensors.torch.load_file``
reads it).

Both sides must see the same filesystem: use ``tcp`` across hosts or containers.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any

import redis

from pipeline.weights import WeightFetcher, WeightPublisher
from pipeline.weights.manifest import Manifest, WeightsError

_SUFFIX = ".safetensors"


def default_root() -> Path:
    """``/dev/shm`` when it exists and is writable (RAM-backed), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


class ShmPublisher(WeightPublisher):
    """Publishes each version as a file under ``<root>/<ns>/``.

    Options: ``root`` (directory holding the ``<ns>`` folder; default ``default_root()``),
    plus the base options ``bucket_bytes`` and ``keep_versions``. The retained files
    cost ``keep_versions`` x payload size of RAM on tmpfs.
    """

    transport = "shm"

    def __init__(
        self,
        redis_client: redis.Redis,
        key: str,
        *,
        ns: str,
        root: str | os.PathLike[str] | None = None,
        **base_opts: Any,
    ) -> None:
        super().__init__(redis_client, key, **base_opts)
        if not ns or ns in (".", "..") or "/" in ns or os.sep in ns or "\0" in ns:
            raise ValueError(f"ns must be a plain directory name, got {ns!r}")
        self._dir = Path(root if root is not None else default_root()) / ns
        self._dir.mkdir(parents=True, exist_ok=True)
        # The key scopes file names, so two publishers sharing a namespace never
        # delete each other's files; only filename-safe characters survive.
        self._stem = re.sub(r"[^A-Za-z0-9_.-]", "_", key)
        self._map: mmap.mmap | None = None  # the payload being written, until _store
        self._tmp: Path | None = None

    @property
    def directory(self) -> Path:
        """Folder holding this publisher's files."""
        return self._dir

    def _path(self, version: int) -> Path:
        return self._dir / f"{self._stem}.v{version}{_SUFFIX}"

    def _allocate(self, version: int, nbytes: int) -> memoryview:
        self._abandon()
        self._tmp = self._dir / f".{self._stem}.v{version}.{os.getpid()}.tmp"
        fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes)
        except BaseException:
            self._abandon()
            raise
        finally:
            os.close(fd)
        return memoryview(self._map)

    def _store(self, version: int) -> str:
        path = self._path(version)
        assert self._map is not None and self._tmp is not None, "_store without _allocate"
        # tmpfs needs no msync: the pages are the file. Closing the mapping before the
        # rename means nothing can write to the file once it has its final name.
        self._map.close()
        self._map = None
        os.replace(self._tmp, path)  # atomic: readers see no file or the whole file
        self._tmp = None
        return str(path)

    def _abandon(self) -> None:
        """Drop a half-written temporary (a publish that raised before ``_store``)."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes when it does
            self._map = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None

    def _retain(self, versions: frozenset[int]) -> None:
        # Scan the folder rather than only our own list, so files (and temporaries)
        # left by a previous publisher process killed mid-run are cleaned up too.
        for path in self._dir.iterdir():
            name = path.name
            if name.startswith(f".{self._stem}.v") and name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                continue
            if not (name.startswith(f"{self._stem}.v") and name.endswith(_SUFFIX)):
                continue
            number = name[len(self._stem) + 2 : -len(_SUFFIX)]
            if number.isdigit() and int(number) not in versions:
                path.unlink(missing_ok=True)

    def _shutdown(self) -> None:
        self._abandon()
        self._retain(frozenset())
        try:
            self._dir.rmdir()  # only if empty: other publishers may share the namespace
        except OSError:
            pass


class ShmFetcher(WeightFetcher):
    """Maps a version's file read-only; the mapping is the receive buffer. No options."""

    transport = "shm"

    def _transfer(self, manifest: Manifest) -> memoryview:
        where = f"weights v{manifest.version} at {manifest.address}"
        try:
            # O_NONBLOCK: opening a FIFO or device named by a bad manifest must not
            # hang; it has no effect on the regular files we expect.
            fd = os.open(manifest.address, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            raise WeightsError(f"{where}: file gone (version dropped or publisher closed)") from None
        except OSError as e:
            raise WeightsError(f"{where}: cannot open: {e}") from e
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise WeightsError(f"{where}: not a regular file")
            if info.st_size != manifest.total_bytes:
                raise WeightsError(
                    f"{where}: short read, file has {info.st_size} bytes, manifest says {manifest.total_bytes}"
                )
            try:
                # Published files are never truncated (only unlinked, which keeps the
                # pages of an open mapping), so the mapping stays fully readable.
                mapping = mmap.mmap(fd, manifest.total_bytes, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise WeightsError(f"{where}: cannot map: {e}") from e
        finally:
            os.close(fd)
        return memoryview(mapping)
