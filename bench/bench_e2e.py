"""The embedded default end to end: `pipeline up` for a short run with η = 0 (synchronous)
and η = 1 (the default), everything else at its default (Redis, feeder, 2 generators,
2 verifiers, trainer as OS processes, the tiny base model, held-out evaluation every 10
steps), one run at a time under ``nice -n 10``.

Read back from each run's summary.json and metrics.jsonl:

- generated tokens/s: tokens generated over the whole run / the run's wall time (start-up
  and the final evaluation included), and in the training window (the generators'
  ``batch_generated`` log events between the first and the last step / that time);
- trainer idle fraction (waiting for a batch / waiting + stepping) and goodput (tokens
  trained / generated), as the summary computes them;
- wall time per step: (last step − first step) / (steps − 1), from metrics.jsonl.

    python bench/bench_e2e.py [--steps 40] [--etas 0,1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from common import progress, save_result

from pipeline_runs import read_run, run_up

RESULTS = ROOT / "bench" / "results"


say = progress("bench-e2e")


def generated_in(run_dir: Path, start: float, end: float) -> int:
    """Tokens the generators logged (``batch_generated`` events) between ``start`` and ``end`` (Unix s)."""
    n = 0
    for path in sorted((run_dir / "logs").glob("gen-*.jsonl")):
        for line in path.read_text().splitlines():
            ev = json.loads(line)
            if ev.get("event") == "batch_generated":
                at = datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()
                if start <= at <= end:
                    n += int(ev["tokens"])
    return n


def figures(run: dict, run_dir: Path) -> dict:
    """The end-to-end figures of one run (``pipeline_runs.read_run``'s dict and its directory)."""
    s, steps = run["summary"], sorted(run["steps"], key=lambda x: x["version"])
    if len(steps) < 2:
        raise ValueError(f"run {s.get('run_id')}: {len(steps)} steps in metrics.jsonl; need at least 2")
    window = steps[-1]["time"] - steps[0]["time"]
    gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]
    return {
        "run_id": s["run_id"], "status": s["status"], "max_staleness": s["max_staleness"], "steps": len(steps),
        "wall_s": s["wall_seconds"], "tokens_generated": s["tokens_generated"],
        "tokens_per_s": s["tokens_generated"] / s["wall_seconds"],
        "tokens_per_s_window": generated_in(run_dir, steps[0]["time"], steps[-1]["time"]) / window if window else 0.0,
        "trainer_idle_fraction": s["trainer_idle_fraction"], "goodput": s["goodput"],
        "step_s": window / (len(steps) - 1), "median_step_s": statistics.median(gaps),
        "stale_dropped": s["accounting"]["stale"], "lost": s["accounting"].get("lost"),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--etas", default="0,1")
    p.add_argument("--runs-dir", default=str(ROOT / "runs"))
    p.add_argument("--out", default=str(RESULTS / "e2e.json"))
    a = p.parse_args(argv)
    try:
        etas = [int(x) for x in a.etas.split(",") if x]
    except ValueError:
        p.error(f"--etas: expected comma-separated integers, got {a.etas!r}")
    if a.steps < 2 or not etas or min(etas) < 0:
        p.error("--steps must be >= 2 and --etas >= 0")
    rows = []
    for eta in etas:
        say(f"eta={eta}: pipeline up, {a.steps} steps (embedded default otherwise)")
        t0 = time.time()
        run_dir = run_up(f"bench-e2e-eta{eta}", {"trainer.steps": a.steps, "trainer.max_staleness": eta},
                         runs_dir=Path(a.runs_dir))
        row = {**figures(read_run(run_dir), run_dir), "run_dir": str(run_dir)}
        rows.append(row)
        say(f"eta={eta}: {row['step_s']:.2f} s per step; generated {row['tokens_per_s_window']:,.0f} tokens/s from "
            f"first to last step, {row['tokens_per_s']:,.0f}/s over the whole run; trainer idle "
            f"{row['trainer_idle_fraction']:.0%}, goodput {row['goodput']:.3f}; {time.time() - t0:.0f} s")
    res = save_result(a.out, {"runs": rows}, script="bench/bench_e2e.py", argv=argv)
    say(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
