"""The default recipe over seeds: `make up-cluster` as a newcomer runs it, once per seed.

Each run is the default config (`pipeline up`, 200 GRPO steps from the shipped base
model) with ``trainer.seed``, ``feeder.seed`` and ``generator.seed`` set to the run's
seed. Reports, per run and as median and range over the runs, the held-out greedy
accuracy of the base and of the final policy (mean of the last three evaluations) and
the gain in points, and how many runs land inside the stated range.

    python bench/seeds.py                      # seeds 0-4 (about 5 min each on 2 cores)
    python bench/seeds.py --seeds 0,1 --steps 60
    python bench/seeds.py --reuse              # re-read the runs named in seeds.json (under --runs-dir)

Writes bench/results/seeds.json and seeds.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pipeline_runs import RESULTS, ROOT, md_table, read_run, run_up

STATED_GAIN = (20.0, 30.0)
"""The held-out gain, in points, the README states for the default recipe."""


def summarize(runs: dict[int, Path], runs_dir: str, overrides: list[str] | None = None) -> dict:
    rows = []
    for seed, run_dir in sorted(runs.items()):
        s = read_run(run_dir)["summary"]
        a = s["accounting"]
        rows.append({"seed": seed, "run": f"{runs_dir}/{run_dir.name}",
                     "steps": s["steps"], "base": s["base_accuracy"], "final": s["final_accuracy_mean_last3"],
                     "gain_points": s["improvement_points"], "wall_seconds": s.get("wall_seconds"),
                     "lost": a.get("lost"), "unexpected": a.get("unexpected"),
                     "trainer_idle_fraction": s.get("trainer_idle_fraction"),
                     "weights_payload_bytes": s.get("weights_payload_bytes"),
                     "evals_beside_training": len(s.get("evals_beside_training", []))})
    gains = [r["gain_points"] for r in rows]
    lo, hi = STATED_GAIN
    idle = [r["trainer_idle_fraction"] for r in rows if r["trainer_idle_fraction"] is not None]
    return {"stated_gain_points": list(STATED_GAIN), "overrides": list(overrides or []), "runs": rows,
            "median_trainer_idle_fraction": statistics.median(idle) if idle else None,
            "median_gain_points": statistics.median(gains), "min_gain_points": min(gains),
            "max_gain_points": max(gains), "median_final": statistics.median(r["final"] for r in rows),
            "median_base": statistics.median(r["base"] for r in rows),
            "inside_stated_range": sum(lo <= g <= hi for g in gains), "n": len(rows)}


def report(res: dict) -> str:
    lo, hi = res["stated_gain_points"]
    def opt(v, fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    table = md_table(["seed", "base", "final (last 3 evals)", "gain (points)", "steps", "wall (s)", "trainer idle",
                      "weights per version (bytes)", "lost", "run"],
                     [[r["seed"], f"{r['base']:.3f}", f"{r['final']:.3f}", f"{r['gain_points']:+.1f}", r["steps"],
                       f"{r['wall_seconds']:.0f}" if r["wall_seconds"] else "", opt(r.get("trainer_idle_fraction"), ".1%"),
                       opt(r.get("weights_payload_bytes"), ","), r["lost"], f"`{r['run']}`"]
                      for r in res["runs"]])
    sets = res.get("overrides") or []
    what = ("the default `make up-cluster` run once per seed" if not sets else
            "the default `make up-cluster` run once per seed with " + ", ".join(f"`{x}`" for x in sets))
    command = ("python bench/seeds.py --seeds " + ",".join(str(r["seed"]) for r in res["runs"])
               + "".join(f" --set {x}" for x in sets))
    idle = res.get("median_trainer_idle_fraction")
    return (f"# The default recipe{' with overrides' if sets else ''} over {res['n']} seeds\n\n"
            f"`{command}`: {what}.\n\n"
            + (f"Median trainer idle fraction {idle:.1%}.\n" if idle is not None else "") +
            f"Held-out gain: median **{res['median_gain_points']:+.1f}** points, range "
            f"{res['min_gain_points']:+.1f} to {res['max_gain_points']:+.1f}; "
            f"{res['inside_stated_range']} of {res['n']} runs inside the stated range (+{lo:.0f} to +{hi:.0f}).\n"
            f"Median base {res['median_base']:.3f}, median final {res['median_final']:.3f}.\n\n" + table)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--steps", type=int, default=0, help="trainer.steps (0: the config's default)")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a config override for every run (repeatable), e.g. --set trainer.lr=3e-4")
    p.add_argument("--reuse", action="store_true", help="re-read the runs named in seeds.json")
    p.add_argument("--out", default=str(RESULTS / "seeds.json"))
    a = p.parse_args(argv)
    out = Path(a.out)
    if a.reuse:
        runs = {r["seed"]: ROOT / a.runs_dir / Path(r["run"]).name for r in json.loads(out.read_text())["runs"]}
    else:
        seeds = [int(x) for x in a.seeds.split(",") if x]
        runs = {}
        for i, seed in enumerate(seeds):
            t0 = time.time()
            print(f"seeds: run {i + 1} of {len(seeds)} (seed {seed})", flush=True)
            overrides: dict[str, object] = {"trainer.seed": seed, "feeder.seed": seed, "generator.seed": seed}
            if a.steps:
                overrides["trainer.steps"] = a.steps
            overrides.update(dict(kv.split("=", 1) for kv in a.set))
            runs[seed] = run_up(f"seed{seed}", overrides, runs_dir=ROOT / a.runs_dir)
            print(f"seeds: seed {seed} done in {time.time() - t0:.0f} s", flush=True)
    res = summarize(runs, a.runs_dir, a.set)
    out.write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(report(res))
    print(report(res))
    return res


if __name__ == "__main__":
    main()
