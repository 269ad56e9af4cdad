"""``pipeline dashboard``: the live view of ``pipeline top`` as a local web page, with charts over time.

A stdlib HTTP server serves three static files shipped in the package (no CDN, no
network fetch) and one JSON endpoint the page polls:

    GET /                 index.html
    GET /static/<file>    app.js, style.css
    GET /api/snapshot     {"snapshot", "rates", "history", "samples"} (see ``Dashboard.payload``)

A run with multi-turn episodes also shows the episodes panel: ``snapshot.episodes``
(``pipeline.observe.metrics.episode_summary``), ``rates.episodes`` (finished episodes per
second) and the per-step ``history.tool_call_rate`` and ``history.env_reward``; the panel
stays hidden while ``snapshot.episodes`` is null.

A sampler thread reads a snapshot every ``interval`` seconds and keeps the last
``MAX_SAMPLES`` queue depths and trainer numbers, so the charts cover the time the
dashboard has been running; the per-step curves come from ``<run_dir>/metrics.jsonl``
when the run directory is on this machine, else from the trainer's progress.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pipeline.keys import Keys
from pipeline.observe.metrics import queue_rows, snapshot
from pipeline.observe.top import History, rates

STATIC = Path(__file__).parent / "static"
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/static/style.css": ("style.css", "text/css; charset=utf-8")}
MAX_SAMPLES = 3600
"""Samples kept for the charts over time (an hour at one per second)."""


class Dashboard:
    """The data behind the page: the latest snapshot, rates, sampled history."""

    def __init__(self, r, keys: Keys, *, run_dir: Path | None, interval: float):
        self.r, self.keys, self.interval = r, keys, interval
        self.lock = threading.Lock()
        self.history = History(run_dir / "metrics.jsonl" if run_dir is not None else None)
        self.samples: deque[dict] = deque(maxlen=MAX_SAMPLES)
        self.prev: dict | None = None
        self.last: dict | None = None
        self.stopped = threading.Event()

    def sample(self) -> dict:
        """Read a snapshot now, record it for the charts and return it."""
        with self.lock:
            snap = snapshot(self.r, self.keys)
            self.history.update(snap)
            if self.last is not None:
                self.prev = self.last
            self.last = snap
            tr = snap["trainer"]
            self.samples.append({"time": snap["time"], "queues": queue_rows(snap), "version": tr.get("version"),
                                 "reward_mean": tr.get("reward_mean"), "goodput": snap["goodput"],
                                 "dead_letters": snap["stats"].get("dead_letters_total", 0.0),
                                 "dropped_stale": snap["stats"].get("dropped_stale_total", 0.0)})
            return snap

    def payload(self) -> dict:
        """What ``/api/snapshot`` returns: a fresh snapshot, rates against the previous one, history, samples."""
        snap = self.sample()
        with self.lock:
            h = self.history
            return {"snapshot": snap, "rates": rates(self.prev, snap),
                    "history": {"reward": h.reward, "sample_accuracy": h.sample_accuracy,
                                "heldout": h.heldout, "staleness": h.staleness,
                                # null, not NaN, for a step without a number: JSON.parse refuses NaN
                                "tool_call_rate": [None if x != x else x for x in h.tool_call_rate],
                                "env_reward": [None if x != x else x for x in h.env_reward]},
                    "samples": list(self.samples)}

    def run_sampler(self) -> None:
        while not self.stopped.wait(self.interval):
            self.sample()


def _handler(dash: Dashboard):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            path = self.path.split("?", 1)[0]
            if path == "/api/snapshot":
                body, ctype = json.dumps(dash.payload(), default=float).encode(), "application/json"
            elif path in FILES:
                name, ctype = FILES[path]
                body = (STATIC / name).read_bytes()
            else:
                self.send_error(404, f"no such page: {path}")
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args) -> None:
            pass  # one line per poll would drown the terminal

    return Handler


def make_server(r, keys: Keys, *, run_dir: Path | None, host: str = "127.0.0.1", port: int = 0,
                interval: float = 1.0) -> tuple[ThreadingHTTPServer, Dashboard]:
    """The HTTP server (not yet serving) and its data; starts the sampler thread."""
    dash = Dashboard(r, keys, run_dir=run_dir, interval=interval)
    dash.sample()
    try:
        server = ThreadingHTTPServer((host, port), _handler(dash))
    except OSError as e:
        raise OSError(f"dashboard --port: cannot serve on {host}:{port}: {e}") from e
    server.daemon_threads = True
    threading.Thread(target=dash.run_sampler, name="dashboard-sampler", daemon=True).start()
    return server, dash


def serve_dashboard(r, keys: Keys, *, run_dir: Path | None, host: str, port: int, interval: float) -> int:
    server, dash = make_server(r, keys, run_dir=run_dir, host=host, port=port, interval=interval)
    print(f"dashboard of run {keys.ns}: http://{host}:{server.server_address[1]}/  (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        dash.stopped.set()
        server.server_close()
    return 0
