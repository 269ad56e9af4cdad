"""``pipeline top``: a live terminal view of a run, read from Redis (and its metrics file when local).

One row per stream and consumer group (depth, lag, pending, oldest pending age, rate in
and out), one row per worker (stage, state, heartbeat age, throughput), the policy
version, and sparklines of reward, sampled-answer accuracy and held-out accuracy. A run
with multi-turn episodes adds their lines (episodes/s, turns per episode, environment step
latency, tool-call rate and success) and the tool-call rate and environment reward per step.

The view is a pure function of snapshots (``render``), so a test renders it from a real
Redis and reads the numbers back; ``--once`` prints one frame.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pipeline.observe.metrics import snapshot

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 32, lo: float | None = None, hi: float | None = None) -> str:
    """The last ``width`` values as block characters, scaled to [lo, hi] (default: their min and max)."""
    vals = [v for v in values[-width:] if v == v]  # drop NaN
    if not vals:
        return ""
    lo = min(vals) if lo is None else lo
    hi = max(vals) if hi is None else hi
    span = hi - lo
    return "".join(BARS[0 if span <= 0 else min(len(BARS) - 1, max(0, int((v - lo) / span * (len(BARS) - 1) + 0.5)))]
                   for v in vals)


def rates(prev: dict | None, cur: dict) -> dict:
    """Entries per second into each stream (entries-added) and out of each group (entries read, minus pending growth)."""
    out: dict = {"in": {}, "out": {}, "workers": {}}
    if prev is None or cur["time"] <= prev["time"]:
        return out
    dt = cur["time"] - prev["time"]
    before = {s["stream"]: s for s in prev["streams"]}
    for s in cur["streams"]:
        p = before.get(s["stream"])
        if p is None:
            continue
        out["in"][s["stream"]] = max(0.0, (s["entries_added"] - p["entries_added"]) / dt)
        pg = {g["group"]: g for g in p["groups"]}
        for g in s["groups"]:
            if g["group"] in pg:
                q = pg[g["group"]]
                acked = (g["entries_read"] - g["pending"]) - (q["entries_read"] - q["pending"])
                out["out"][f"{s['stream']}/{g['group']}"] = max(0.0, acked / dt)
    if cur.get("episodes"):
        done = cur["stats"].get("episodes_finished_total", 0.0) - prev["stats"].get("episodes_finished_total", 0.0)
        out["episodes"] = max(0.0, done / dt)
    pw = {w["worker"]: w for w in prev["workers"]}
    for w in cur["workers"]:
        q = pw.get(w["worker"])
        for field in ("groups", "issued"):
            if q is not None and field in w and field in q:
                out["workers"][w["worker"]] = max(0.0, (float(w[field]) - float(q[field])) / dt)
    return out


class History:
    """Reward, sampled accuracy, held-out accuracy and staleness per step.

    Read from ``<run_dir>/metrics.jsonl`` when the run directory is on this machine;
    otherwise built from the trainer's progress in successive snapshots.
    """

    def __init__(self, metrics_file: Path | None = None):
        self.file = metrics_file
        self.reward: list[float] = []
        self.sample_accuracy: list[float] = []
        self.heldout: list[tuple[int, float]] = []
        self.staleness: list[int] = []
        self.tool_call_rate: list[float] = []
        """Multi-turn episodes: per step, the share of the step's episodes with a tool call ..."""
        self.env_reward: list[float] = []
        """... and their mean environment reward (both empty for a run without episodes)."""
        self._last_version = None

    def update(self, snap: dict) -> "History":
        if self.file is not None and self.file.exists():
            self._read_file()
            return self
        tr = snap["trainer"]
        version = tr.get("version")
        if isinstance(version, float) and version != self._last_version and version > 0:
            self._last_version = version
            self.reward.append(float(tr.get("reward_mean", float("nan"))))
            self.sample_accuracy.append(float(tr.get("sample_accuracy", float("nan"))))
            if isinstance(tr.get("env_reward_mean"), float):
                self.env_reward.append(tr["env_reward_mean"])
                self.tool_call_rate.append(float(tr.get("tool_call_rate", float("nan"))))
        ev, acc = tr.get("eval_version"), tr.get("eval_accuracy")
        if isinstance(ev, float) and isinstance(acc, float) and (not self.heldout or self.heldout[-1][0] != int(ev)):
            self.heldout.append((int(ev), acc))
        return self

    def _read_file(self) -> None:
        rows = []
        for line in self.file.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line being written
        steps = [x for x in rows if x.get("kind") == "step"]
        self.reward = [float(s.get("reward_mean", float("nan"))) for s in steps]
        self.sample_accuracy = [float(s.get("sample_accuracy", float("nan"))) for s in steps]
        self.heldout = [(int(e["version"]), float(e["heldout_accuracy"])) for e in rows if e.get("kind") == "eval"]
        episodic = [s for s in steps if "env_reward_mean" in s]
        self.env_reward = [float(s["env_reward_mean"]) for s in episodic]
        self.tool_call_rate = [float(s["tool_call_rate"]) if s.get("tool_call_rate") is not None else float("nan")
                               for s in episodic]
        hist: list[int] = []
        for s in steps:
            for i, n in enumerate(s.get("staleness_hist", [])):
                hist += [0] * (i + 1 - len(hist))
                hist[i] += int(n)
        self.staleness = hist


def _num(v, fmt: str = "{:.3f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) else "-"


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def render(snap: dict, *, prev: dict | None = None, history: History | None = None) -> Group:
    """One frame of the view from a snapshot (``pipeline.observe.metrics.snapshot``), the previous one and the history."""
    rt = rates(prev, snap)
    tr, st = snap["trainer"], snap["stats"]
    version, steps = tr.get("version"), tr.get("steps")
    head = Text.assemble(
        ("run ", "bold"), (snap["ns"], "bold cyan"),
        "   policy version ", (_num(version, "{:.0f}"), "bold"), "/", _num(steps, "{:.0f}"),
        "   trainer ", str(tr.get("state", "-")),
        "   reward ", _num(tr.get("reward_mean")), "   sample acc ", _num(tr.get("sample_accuracy")),
        "   held-out ", _num(tr.get("eval_accuracy")), " (base ", _num(tr.get("base_accuracy")), ")",
        "\ngoodput ", _num(snap["goodput"]),
        "   dropped stale ", _num(st.get("dropped_stale_total", 0.0), "{:.0f}"),
        "   dead letters ", _num(st.get("dead_letters_total", 0.0), "{:.0f}"),
        "   tokens generated ", _num(st.get("tokens_generated_total", 0.0), "{:.0f}"),
        "   trained ", _num(st.get("tokens_trained_total", 0.0), "{:.0f}"))
    ep = snap.get("episodes")
    if ep:  # multi-turn episodes (env.kind): docs/observing.md, "Episodes"
        def ms(v):
            return _num(None if v is None else 1000 * v, "{:.1f}")

        head.append_text(Text.assemble(
            "\nepisodes ", _num(ep["episodes"], "{:.0f}"), " (finished ", _num(ep["episodes_finished"], "{:.0f}"),
            ", ", _num(rt.get("episodes"), "{:.2f}"), "/s)",
            "   turns per episode ", _num(ep["turns_per_episode"]),
            "   env steps ", _num(ep["env_steps"], "{:.0f}"),
            "   env step ", ms(ep["env_step_mean_s"] or 0.0), " ms",
            " (p50 ", ms(ep["env_step_p50_s"]), ", p95 ", ms(ep["env_step_p95_s"]), ")",
            "   env errors ", _num(ep["env_errors"], "{:.0f}"),
            "\ntool calls ", _num(ep["tool_calls"], "{:.0f}"), " (", _num(ep["tool_calls_per_episode"]), " per episode)",
            "   tool-call rate ", _num(ep["tool_call_rate"]),
            "   tool-call success ", _num(ep["tool_call_success"]),
            " (", _num(ep["tool_calls_ok"], "{:.0f}"), " answered)",
            "   malformed calls ", _num(ep.get("tool_parse_errors", 0.0), "{:.0f}")))
        for name, m in (ep.get("environments") or {}).items():  # a mixture's members
            head.append_text(Text.assemble(
                "\n  env ", (name, "cyan"), "   episodes ", _num(m["episodes"], "{:.0f}"),
                " (finished ", _num(m["finished"], "{:.0f}"), ")   errors ", _num(m["errors"], "{:.0f}"),
                "   reward ", _num(m["reward_mean"])))

    streams = Table(title="streams", box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("stream", "group", "length", "lag", "pending", "oldest pending", "consumers", "in/s", "out/s"):
        streams.add_column(col, justify="left" if col in ("stream", "group") else "right")
    for s in snap["streams"]:
        rate_in = _num(rt["in"].get(s["stream"]), "{:.1f}")
        if not s["groups"]:
            streams.add_row(s["stream"], "-", str(s["length"]), "-", "-", "-", "-", rate_in, "-")
        for g in s["groups"]:
            streams.add_row(s["stream"], g["group"], str(s["length"]), str(g["lag"]), str(g["pending"]),
                            _age(g["oldest_pending_age_s"]) if g["pending"] else "-", str(g["consumers"]), rate_in,
                            _num(rt["out"].get(f"{s['stream']}/{g['group']}"), "{:.1f}"))

    workers = Table(title="workers", box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("worker", "stage", "state", "pid", "heartbeat", "version", "groups", "groups/s"):
        workers.add_column(col, justify="left" if col in ("worker", "stage", "state") else "right")
    for w in snap["workers"]:
        stale = w["age_s"] > 30
        workers.add_row(w["worker"], str(w.get("stage", "-")), Text(str(w.get("state", "-")), style="red" if stale else ""),
                        str(w.get("pid", "-")), _age(w["age_s"]), _num(w.get("version"), "{:.0f}"),
                        _num(w.get("groups", w.get("issued")), "{:.0f}"), _num(rt["workers"].get(w["worker"]), "{:.1f}"))

    parts = [head, streams, workers]
    if history is not None:
        h = history
        lines = Table(title="history", box=box.SIMPLE_HEAD, title_justify="left", show_header=False)
        lines.add_column("series")
        lines.add_column("spark")
        lines.add_column("last", justify="right")
        lines.add_row("reward", sparkline(h.reward, lo=0.0, hi=1.0), _num(h.reward[-1] if h.reward else None))
        lines.add_row("sample accuracy", sparkline(h.sample_accuracy, lo=0.0, hi=1.0),
                      _num(h.sample_accuracy[-1] if h.sample_accuracy else None))
        lines.add_row("held-out accuracy", sparkline([a for _, a in h.heldout], lo=0.0, hi=1.0),
                      _num(h.heldout[-1][1] if h.heldout else None))
        if h.env_reward:
            lines.add_row("tool-call rate", sparkline(h.tool_call_rate, lo=0.0, hi=1.0),
                          _num(h.tool_call_rate[-1] if h.tool_call_rate else None))
            lines.add_row("env reward", sparkline(h.env_reward, lo=0.0, hi=1.0), _num(h.env_reward[-1]))
        if h.staleness:
            lines.add_row("staleness (versions)", sparkline([float(n) for n in h.staleness], lo=0.0),
                          " ".join(f"{i}:{n}" for i, n in enumerate(h.staleness)))
        parts.append(lines)
    return Group(*parts)


def frame_text(renderable, width: int = 140) -> str:
    """A renderable as plain text (what ``--once`` prints, without colour codes)."""
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(renderable)
    return console.file.getvalue()


def run_top(r, keys, *, run_dir: Path | None, once: bool, interval: float) -> int:
    """Print one frame (``once``) or refresh a live view every ``interval`` seconds until Ctrl-C."""
    history = History(run_dir / "metrics.jsonl" if run_dir is not None else None)
    prev = snapshot(r, keys)
    if once:
        # Two snapshots ``interval`` apart, so the frame shows rates.
        time.sleep(interval)
        snap = snapshot(r, keys)
        print(frame_text(render(snap, prev=prev, history=history.update(snap))), end="")
        return 0
    history.update(prev)
    with Live(render(prev, history=history), auto_refresh=False, screen=False) as live:
        try:
            while True:
                time.sleep(interval)
                snap = snapshot(r, keys)
                live.update(render(snap, prev=prev, history=history.update(snap)), refresh=True)
                prev = snap
        except KeyboardInterrupt:
            pass
    return 0
