"""Environment server processes a generator runs beside itself (``env.kind = "openenv:<app spec>"``).

A :class:`ServerPool` keeps ``env.servers`` processes of one ASGI app running, each a uvicorn
server on a free loopback port: it waits for each one's health endpoint (``GET /health``,
up to ``env.start_timeout_s``; the error names ``env.kind`` and ends with the server's log),
restarts one that exits, and stops them all at :meth:`ServerPool.close` (at the latest when
the process exits; on Linux a server also gets SIGTERM when the generator dies without
closing it). Every process is started and restarted by the pool's supervisor thread, so the
parent-death signal is tied to a thread that lives as long as the pool.

Given a ``record_dir`` (a generator's pool: ``<run_dir>/env-servers/``), the pool keeps a small
JSON file there, ``<pid>-<n>.json``, naming its own pid and every server's pid, each with its
start time (``pipeline.common.procs``), port and whether it is up, and the restart count. It is
rewritten atomically whenever a server starts, comes up or exits, and removed when the pool
closes; a pool's first write removes the records of pools whose process is gone. ``pipeline inject`` (chaos kind ``env``) reads it to find a server to kill; the start
times make sure a restarted server is never hit by a fault meant for its predecessor.

The app is named as a plugin spec: ``module:attr`` (importable from the directory the
generator runs in or ``PYTHONPATH``) or ``path/to/file.py:attr``. A file inside a package
(``my_env/server/app.py`` with ``__init__.py`` files up to ``my_env/``) is imported as that
package's module (``my_env.server.app``), so the relative imports of OpenEnv's template work.

The pool needs nothing of OpenEnv; the server process imports the app, and with it whatever
the app needs (openenv-core for an OpenEnv app). One server process::

    python -m pipeline.envs.servers --app my_env/server/app.py:app --port 8123
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from pipeline.common.procs import proc_start_time, recorded_identity

POLL_S = 0.2
"""How often the supervisor looks for exited servers."""
STOP_GRACE_S = 5.0
"""SIGTERM, then this long, then SIGKILL."""
LOG_TAIL = 2000
"""Characters of a server's log quoted in a start error."""
RECORD_DIR = "env-servers"
"""Where, under the run directory, a generator's pool records its servers (see the module docstring)."""

_POOLS: weakref.WeakSet = weakref.WeakSet()
_RECORD_SEQ = itertools.count()


def live_pools() -> list["ServerPool"]:
    """Every pool of this process not yet closed."""
    return [p for p in list(_POOLS) if not p.closed]


class ServerStartError(RuntimeError):
    """A server process that did not come up (exited, or no health answer in time)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Loopback requests never go through an HTTP proxy the environment variables name."""


def _fetch(url: str, request, timeout: float) -> bytes:
    """The body of a 2xx answer to ``request`` (``url`` or a Request for it); loopback
    addresses bypass any proxy."""
    host = urllib.request.urlparse(url).hostname or ""
    opener = _DIRECT if host in ("127.0.0.1", "localhost", "::1") else urllib.request.build_opener()
    with opener.open(request, timeout=timeout) as resp:
        return resp.read()


def http_get(url: str, timeout: float) -> bytes:
    """GET ``url``; the body of a 2xx answer."""
    return _fetch(url, url, timeout)


def http_post_json(url: str, body: dict, timeout: float) -> bytes:
    """POST ``body`` as JSON to ``url``; the body of a 2xx answer."""
    return _fetch(url, urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                              headers={"Content-Type": "application/json"}), timeout)


def app_target(spec: str) -> tuple[Path | None, str, str]:
    """(directory to put on ``sys.path`` or None, module name, attribute) of an app spec."""
    left, sep, attr = spec.rpartition(":")
    if not sep or not left or not attr:
        raise ValueError(f"{spec!r} is not an app spec (module:attr or path/to/file.py:attr)")
    if not left.endswith(".py"):
        return None, left, attr
    path = Path(left).resolve()
    if not path.is_file():
        raise ValueError(f"no such file {left!r} (looked for {path})")
    parts = [] if path.stem == "__init__" else [path.stem]
    d = path.parent
    # Up through the enclosing packages: the file is imported as their module, relative imports work.
    while (d / "__init__.py").is_file() and d.name.isidentifier() and d.parent != d:
        parts.insert(0, d.name)
        d = d.parent
    if not parts:
        raise ValueError(f"{spec!r}: cannot name a module for {path}")
    return d, ".".join(parts), attr


def load_app(spec: str):
    """The object an app spec names, imported as the server process imports it."""
    directory, module, attr = app_target(spec)
    where = str(directory) if directory is not None else str(Path.cwd())
    if where not in sys.path:
        sys.path.insert(0, where)
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class Server:
    index: int
    port: int = 0
    proc: subprocess.Popen | None = None
    up: bool = False
    starts: int = 0
    log_path: Path | None = None
    failures: int = 0
    """Consecutive failed starts (restart back-off)."""
    next_try: float = 0.0
    history: deque = field(default_factory=lambda: deque(maxlen=8))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid


class Record:
    """The pool's servers as a JSON file others can read (``path``; None: no file): written
    atomically (a temporary file renamed over it), never again once :meth:`remove` ran."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._gone = False
        self._pruned = False

    def write(self, pool: "ServerPool") -> None:
        if self.path is None:
            return
        me = os.getpid()
        starts = {str(me): proc_start_time(me)}
        servers = []
        for s in pool.servers:
            pid = s.pid
            alive = s.proc is not None and s.proc.poll() is None
            if pid is not None and alive:
                starts[str(pid)] = proc_start_time(pid)
            servers.append({"index": s.index, "pid": pid if alive else None, "port": s.port, "up": s.up and alive,
                            "starts": s.starts})
        doc = {"pid": me, "env": pool.name, "spec": pool.spec, "restarts": pool.restarts, "servers": servers,
               "start_times": starts, "updated_at": round(time.time(), 3)}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with self._lock:
            if self._gone:
                return
            if not self._pruned:
                self._pruned = True
                prune_records(self.path.parent)
            for attempt in range(3):  # another pool of the run may remove the directory in between
                try:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    tmp.write_text(json.dumps(doc))
                    os.replace(tmp, self.path)
                    return
                except FileNotFoundError:
                    if attempt == 2:
                        raise

    def remove(self) -> None:
        if self.path is None:
            return
        with self._lock:
            self._gone = True
            for f in (self.path, self.path.with_name(f".{self.path.name}.tmp")):
                try:
                    f.unlink()
                except OSError:
                    pass
            try:
                self.path.parent.rmdir()  # only when no other pool's record is left there
            except OSError:
                pass


def prune_records(directory: Path) -> None:
    """Remove the records in ``directory`` of pools whose process is gone (a SIGKILLed
    generator cannot remove its own)."""
    for f in Path(directory).glob("*.json"):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        pid = doc.get("pid") if isinstance(doc, dict) else None
        if isinstance(pid, int) and recorded_identity(doc, pid) in ("gone", "other"):
            try:
                f.unlink()
            except OSError:
                pass


def read_records(run_dir: Path) -> list[dict]:
    """Every server pool's record under ``run_dir`` (files a writer is replacing, or cut short, are left out)."""
    out = []
    for f in sorted((Path(run_dir) / RECORD_DIR).glob("*.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("servers"), list):
            out.append(doc)
    return out


class ServerPool:
    """``n`` server processes of the app ``spec`` on loopback ports; see the module docstring.

    The constructor returns once every server answers its health check, or raises
    :class:`ServerStartError` (having stopped whatever it started). ``name`` is what errors
    and log events call the pool (``env.kind``). ``record_dir``: keep the servers' record
    there (see the module docstring)."""

    def __init__(self, spec: str, *, n: int = 1, start_timeout_s: float = 120.0, name: str = "",
                 log_dir: Path | None = None, log=None, health_path: str = "/health",
                 env: dict[str, str] | None = None, record_dir: Path | None = None) -> None:
        app_target(spec)  # a malformed spec or a missing file fails here, before anything starts
        self.spec, self.name = spec, name or spec
        self.start_timeout_s, self.health_path = start_timeout_s, health_path
        self.log = log
        self.log_dir = log_dir
        self.env = env
        self.servers = [Server(i) for i in range(n)]
        self.restarts = 0
        """Servers started again after they exited."""
        self.closed = False
        self.record = Record(None if record_dir is None
                             else Path(record_dir) / f"{os.getpid()}-{next(_RECORD_SEQ)}.json")
        self._stop = threading.Event()
        self._procs = threading.Lock()
        """Held while a process is started or the pool stops them: none starts after the stop."""
        self._ready = threading.Event()
        self._changed = threading.Condition()
        self._error: str | None = None
        self._thread = threading.Thread(target=self._supervise, name="env-servers", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self.close()
            raise ServerStartError(self._error)
        _POOLS.add(self)
        weakref.finalize(self, _stop_all, self.servers, self._stop, self._procs, self.record)

    # ------------------------------------------------------------------ what clients read

    def urls(self) -> list[str]:
        """Base URLs of the servers up now."""
        return [s.url for s in self.servers if s.up]

    def wait_up(self, timeout: float) -> list[str]:
        """Base URLs of the servers up, waiting up to ``timeout`` s for one (empty: none came up)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self.closed and not self.urls():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, POLL_S))
        return self.urls()

    def pids(self) -> list[int | None]:
        return [s.pid for s in self.servers]

    # ------------------------------------------------------------------ the supervisor thread

    def _event(self, level: str, event: str, **kw) -> None:
        log = self.log
        if log is None:
            log = structlog.get_logger()
        getattr(log, level)(event, env=self.name, **kw)

    def _spawn(self, s: Server) -> None:
        s.port = free_port()
        s.starts += 1
        s.up = False
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            s.log_path = self.log_dir / f"env-server-{os.getpid()}-{s.index}.log"
        else:
            fd, name = tempfile.mkstemp(prefix=f"rlpipe-env-server-{os.getpid()}-{s.index}-", suffix=".log")
            os.close(fd)
            s.log_path = Path(name)
        env = {**os.environ, **(self.env or {}), "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "pipeline.envs.servers", "--app", self.spec, "--port", str(s.port),
               "--parent", str(os.getpid())]
        with self._procs, open(s.log_path, "ab") as out:
            if self._stop.is_set():
                raise ServerStartError(f"env.kind {self.name!r}: the pool is closed")
            out.write(f"== start {s.starts}: {' '.join(cmd)}\n".encode())
            out.flush()
            s.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self._record()

    def _tail(self, s: Server) -> str:
        try:
            text = s.log_path.read_text(errors="replace") if s.log_path else ""
        except OSError:
            return ""
        return text[-LOG_TAIL:]

    def _wait_healthy(self, s: Server, deadline: float) -> None:
        url = s.url + self.health_path
        while True:
            if self._stop.is_set():
                raise ServerStartError(f"env.kind {self.name!r}: the pool was closed while server {s.index} started")
            code = s.proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"env.kind {self.name!r}: server {s.index} ({self.spec}) exited with status {code} before it "
                    f"answered {self.health_path}; its log ({s.log_path}) ends:\n{self._tail(s)}")
            try:
                http_get(url, timeout=1.0)
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"env.kind {self.name!r}: server {s.index} ({self.spec}, pid {s.proc.pid}) did not answer {url} "
                    f"within env.start_timeout_s = {self.start_timeout_s:g} s; its log ({s.log_path}) ends:\n"
                    f"{self._tail(s)}")
            time.sleep(0.1)

    def _record(self) -> None:
        try:
            self.record.write(self)
        except OSError as e:  # the record is for others to read; the servers run without it
            self._event("warning", "env_server_record_failed", path=str(self.record.path),
                        error=f"{type(e).__name__}: {e}")

    def _up(self, s: Server) -> None:
        with self._changed:
            s.up, s.failures = True, 0
            self._changed.notify_all()
        self._record()

    def _supervise(self) -> None:
        try:
            for s in self.servers:  # all at once: their imports overlap
                self._spawn(s)
            deadline = time.monotonic() + self.start_timeout_s
            for s in self.servers:
                self._wait_healthy(s, deadline)
                self._up(s)
                self._event("info", "env_server_started", server=s.index, pid=s.pid, url=s.url)
        except Exception as e:
            self._error = str(e)
            self._ready.set()
            return
        self._ready.set()
        while not self._stop.wait(POLL_S):
            for s in self.servers:
                if self._stop.is_set():
                    return
                try:
                    self._look_after(s)
                except Exception as e:  # never let the supervisor die: it owns the processes
                    self._event("error", "env_server_supervisor_error", server=s.index,
                                error=f"{type(e).__name__}: {e}")

    def _look_after(self, s: Server) -> None:
        code = s.proc.poll() if s.proc is not None else -1
        if code is None:
            return
        if s.up:
            with self._changed:
                s.up = False
            self._record()
            self._event("warning", "env_server_exited", server=s.index, pid=s.pid, status=code, url=s.url)
        if time.monotonic() < s.next_try:
            return
        self._spawn(s)
        try:
            self._wait_healthy(s, time.monotonic() + self.start_timeout_s)
        except ServerStartError as e:
            s.failures += 1
            s.next_try = time.monotonic() + min(2.0 ** s.failures, 30.0)
            if s.proc.poll() is None:
                _terminate(s.proc)
            self._record()
            self._event("error", "env_server_restart_failed", server=s.index, attempt=s.failures,
                        error=str(e)[-600:])
            return
        self.restarts += 1
        self._up(s)  # recorded with the new restart count
        self._event("info", "env_server_restarted", server=s.index, pid=s.pid, url=s.url, restarts=self.restarts)

    # ------------------------------------------------------------------ the end

    def close(self) -> None:
        """Stop every server (SIGTERM, then SIGKILL after a grace period) and the supervisor."""
        if self.closed:
            return
        self.closed = True
        _stop_all(self.servers, self._stop, self._procs, self.record)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=STOP_GRACE_S + 5)
        with self._changed:
            self._changed.notify_all()

    def __enter__(self) -> "ServerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(STOP_GRACE_S)


def _stop_all(servers: list[Server], stop: threading.Event, lock: threading.Lock, record: Record | None = None) -> None:
    if record is not None:
        record.remove()  # first: no one picks a server that is about to stop
    with lock:
        stop.set()
        procs = [s.proc for s in servers if s.proc is not None and s.proc.poll() is None]
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(STOP_GRACE_S)
    for s in servers:
        s.up = False


# ---------------------------------------------------------------------- the server process


def _die_with_parent(parent: int) -> None:
    """Linux: SIGTERM this process when the thread that started it ends (the pool's supervisor)."""
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:
        return
    if os.getppid() != parent:  # the parent went before the signal was armed
        sys.exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.envs.servers",
                                 description="Serve an ASGI app (an OpenEnv environment) with uvicorn.")
    ap.add_argument("--app", required=True, help="module:attr or path/to/file.py:attr")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--parent", type=int, default=0, help="pid of the process that started this one (Linux: "
                                                          "exit with it)")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    _die_with_parent(args.parent)
    try:
        app = load_app(args.app)
    except Exception as e:
        traceback.print_exc()
        print(f"cannot load the app {args.app!r}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 2
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
