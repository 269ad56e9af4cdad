"""``shm`` transport: one immutable file per version in shared memory (same host only).

The publisher writes each payload to ``/dev/shm/<ns>/<key>.v<version>.safetensors``
(``<tempdir>/<ns>/...`` where ``/dev/shm`` is missing) by writing a temporary file in
the same directory and renaming it into place, so the final name only ever refers to
a complete payload. Files are never modified after the rename; dropping a version
unlinks its file, and a reader that already opened it keeps reading the intact data
(POSIX unlink semantics). The address in the manifest is the file path.

Both sides must see the same filesystem: use ``tcp`` across hosts or containers.
"""

from __future__ import annotations

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

    @property
    def directory(self) -> Path:
        """Folder holding this publisher's files."""
        return self._dir

    def _path(self, version: int) -> Path:
        return self._dir / f"{self._stem}.v{version}{_SUFFIX}"

    def _store(self, version: int, payload: bytes) -> str:
        path = self._path(version)
        tmp = self._dir / f".{self._stem}.v{version}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(payload)
            os.replace(tmp, path)  # atomic: readers see no file or the whole file
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return str(path)

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
        self._retain(frozenset())
        try:
            self._dir.rmdir()  # only if empty: other publishers may share the namespace
        except OSError:
            pass


class ShmFetcher(WeightFetcher):
    """Reads a version's file into the fetcher's reused buffer. No options."""

    transport = "shm"

    def _transfer(self, manifest: Manifest, into: memoryview) -> None:
        where = f"weights v{manifest.version} at {manifest.address}"
        try:
            # O_NONBLOCK: opening a FIFO or device named by a bad manifest must not
            # hang; it has no effect on the regular files we expect.
            fd = os.open(manifest.address, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            raise WeightsError(f"{where}: file gone (version dropped or publisher closed)") from None
        except OSError as e:
            raise WeightsError(f"{where}: cannot open: {e}") from e
        with open(fd, "rb", buffering=0) as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise WeightsError(f"{where}: not a regular file")
            if info.st_size != manifest.total_bytes:
                raise WeightsError(f"{where}: file has {info.st_size} bytes, manifest says {manifest.total_bytes}")
            got = 0
            try:
                while got < len(into):
                    n = f.readinto(into[got:])
                    if not n:
                        break
                    got += n
            except OSError as e:
                raise WeightsError(f"{where}: read failed after {got} bytes: {e}") from e
        if got != manifest.total_bytes:
            raise WeightsError(f"{where}: short read, {got} of {manifest.total_bytes} bytes")
