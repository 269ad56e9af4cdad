"""``pipeline dashboard``: the JSON endpoint and the page rendered by headless Chromium, against XINFO."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from html.parser import HTMLParser

import pytest

from pipeline.observe.dashboard import STATIC, make_server
from pipeline.keys import Keys
from tests.busy_streams import fill_streams, group_info

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Cells(HTMLParser):
    """Text of every ``<td data-field>`` by its row's data-stream/data-worker, and of the summary fields."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self.summary: dict[str, str] = {}
        self._row: str | None = None
        self._field: tuple[dict, str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and ("data-stream" in a or "data-worker" in a):
            self._row = a.get("data-stream") or a.get("data-worker")
            self.rows[self._row] = {}
        elif "data-field" in a:
            target = self.rows[self._row] if tag == "td" and self._row else self.summary
            self._field = (target, a["data-field"])

    def handle_data(self, data):
        if self._field is not None:
            target, name = self._field
            target[name] = target.get(name, "") + data

    def handle_endtag(self, tag):
        if tag in ("td", "dd", "span"):
            self._field = None
        if tag == "tr":
            self._row = None


@pytest.fixture
def dashboard(redis_client, tmp_path):
    keys = Keys("obs")
    fill_streams(redis_client, keys)
    server, dash = make_server(redis_client, keys, run_dir=tmp_path, interval=0.2)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield redis_client, keys, f"http://127.0.0.1:{server.server_address[1]}"
    dash.stopped.set()
    server.shutdown()
    server.server_close()


def test_json_endpoint_matches_xinfo_and_keeps_samples(dashboard):
    r, keys, url = dashboard
    data = json.load(urllib.request.urlopen(f"{url}/api/snapshot", timeout=10))
    rows = {s["stream"]: s for s in data["snapshot"]["streams"]}
    for name, (key, group) in keys.shard(0).streams().items():
        g = group_info(r, key, group)
        (got,) = rows[name]["groups"]
        assert (rows[name]["length"], got["lag"], got["pending"], got["consumers"]) == \
            (r.xlen(key), g["lag"], g["pending"], g["consumers"])
    assert data["samples"] and data["samples"][-1]["queues"]["prompts"] == {"length": 12, "lag": 5, "pending": 5}
    r.xadd(keys.shard(0).prompts, {"d": b"x"})
    again = json.load(urllib.request.urlopen(f"{url}/api/snapshot", timeout=10))
    assert again["samples"][-1]["queues"]["prompts"]["length"] == 13
    assert again["rates"]["in"]["prompts"] > 0


def test_unknown_paths_are_404_and_the_page_fetches_nothing_from_the_network(dashboard):
    _, _, url = dashboard
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{url}/etc/passwd", timeout=10)
    assert e.value.code == 404
    for f in STATIC.iterdir():
        text = f.read_text()
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), f"{f.name} loads from the network"
        assert "import(" not in text and "@import" not in text
    assert urllib.request.urlopen(f"{url}/static/app.js", timeout=10).headers["Content-Type"].startswith("text/javascript")


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
def test_the_page_rendered_by_headless_chromium_shows_the_servers_numbers(dashboard):
    r, keys, url = dashboard
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--virtual-time-budget=3000", "--dump-dom", url + "/"],
                         capture_output=True, text=True, timeout=60).stdout
    cells = Cells()
    cells.feed(dom)
    for name, (key, group) in keys.shard(0).streams().items():
        g = group_info(r, key, group)
        row = cells.rows[name]
        assert row["group"] == group
        assert [int(row[f]) for f in ("length", "lag", "pending", "consumers")] == \
            [r.xlen(key), g["lag"], g["pending"], g["consumers"]]
    assert int(cells.rows["dead"]["length"]) == r.xlen(keys.shard(0).dead) == 2
    assert cells.rows["gen-0"]["state"] == "generating"
    s = cells.summary
    assert (s["version"], s["steps"], s["reward_mean"], s["eval_accuracy"], s["dead_letters_total"]) == \
        ("4", "10", "0.625", "0.410", "2")
    # The charts were drawn from the polled samples: one backlog line per stream.
    assert re.findall(r'data-series="(\w+)"', dom)[:3] == ["prompts", "rollouts", "scored"]
