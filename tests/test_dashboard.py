"""``pipeline dashboard``: the JSON endpoint and the page rendered by headless Chromium, against XINFO."""

from __future__ import annotations

import json
import os
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
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
"""CI (.ci/run sets ``CI=true``) installs Chromium: there the browser test fails where it is missing."""
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")
"""Headless, as root (``--no-sandbox``: Chromium's sandbox refuses to run as root), and quiet on
a closed network: no background connections, component updates or sync, each refused there."""


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


def test_the_episodes_panel_data_appears_with_episodes_and_the_page_has_its_elements(dashboard, tmp_path):
    r, keys, url = dashboard
    data = json.load(urllib.request.urlopen(f"{url}/api/snapshot", timeout=10))
    assert data["snapshot"]["episodes"] is None and "episodes" not in data["rates"]  # the panel stays hidden
    rows = [{"kind": "step", "version": v, "reward_mean": 0.5, "sample_accuracy": 0.5, "staleness_hist": [1],
             "episodes": 8, "env_reward_mean": v / 4, "tool_call_rate": v / 8 if v < 3 else None} for v in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    r.hset(keys.shard(0).stats, mapping={"episodes_total": 10, "episodes_finished_total": 8, "turns_total": 12,
                                         "env_steps_total": 4, "env_step_seconds_total": 0.02,
                                         "env_step_seconds_bucket:0.005": 4, "tool_calls_total": 4,
                                         "tool_calls_ok_total": 3, "episodes_with_tool_calls_total": 2})
    body = urllib.request.urlopen(f"{url}/api/snapshot", timeout=10).read().decode()

    def refuse(name):  # as the browser's JSON.parse: no NaN or Infinity
        raise ValueError(f"{name} in the JSON")

    data = json.loads(body, parse_constant=refuse)
    ep = data["snapshot"]["episodes"]
    assert (ep["episodes"], ep["episodes_finished"], ep["turns_per_episode"]) == (10, 8, 1.5)
    assert (ep["tool_call_rate"], ep["tool_calls_per_episode"], ep["tool_call_success"]) == (0.25, 0.5, 0.75)
    assert ep["env_step_mean_s"] == 0.005 and 0.0025 < ep["env_step_p50_s"] < ep["env_step_p95_s"] <= 0.005
    assert data["rates"]["episodes"] >= 0
    assert data["history"]["tool_call_rate"] == [0.125, 0.25, None]
    assert data["history"]["env_reward"] == [0.25, 0.5, 0.75]
    # The page has the panel, hidden until episodes exist, and a cell for every number app.js fills in.
    page = urllib.request.urlopen(f"{url}/", timeout=10).read().decode()
    assert '<section id="episodes" hidden>' in page and 'id="chart-episodes"' in page
    panel = page[page.index('<dl id="episodes-summary">'):page.index("</dl>", page.index('id="episodes-summary"'))]
    fields = set(re.findall(r'data-field="(\w+)"', panel))
    js = (STATIC / "app.js").read_text()
    filled = js[js.index("function renderEpisodes"):js.index("function renderStreams")]
    assert fields == set(re.findall(r"\b(\w+): (?:fmt|ms)\(", filled)) and len(fields) == 12


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


def test_the_page_rendered_by_headless_chromium_shows_the_servers_numbers(dashboard, tmp_path):
    if CHROMIUM is None:
        why = "headless Chromium is not installed (Debian: apt-get install chromium)"
        if IN_CI:
            pytest.fail(f"{why}, and CI installs it (.ci/run): the browser test must run there")
        pytest.skip(why)
    r, keys, url = dashboard
    p = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}",
                        "--virtual-time-budget=3000", "--dump-dom", url + "/"],
                       capture_output=True, text=True, timeout=60)
    dom = p.stdout
    assert p.returncode == 0 and "<html" in dom, f"{CHROMIUM} exited {p.returncode}: {p.stderr[-3000:]}"
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
    assert s["tool_call_rate"] == "-"  # a run without episodes: the episodes panel is never filled in
    # The charts were drawn from the polled samples: one backlog line per stream.
    assert re.findall(r'data-series="(\w+)"', dom)[:3] == ["prompts", "rollouts", "scored"]
