"""The generation–verification gap experiment (DESIGN §5, §7), on the real pipeline.

From the same base model, seed and budget, train three times with `pipeline up`:

- ``single:<best>``: the best single weak verifier, picked by its measured selection
  accuracy on rollouts of the base model (sampled here, before any training);
- ``weaver``: the Weaver label model over the whole weak-verifier ensemble;
- ``ground_truth``: the hidden answers (the upper bound).

Reports held-out greedy accuracy (mean of the last three evaluations on the configured
held-out set, 1000 problems by default) and the share of the single → ground-truth gap
that Weaver closes: (weaver − single) / (ground_truth − single).

    python bench/gap.py                       # 200 steps per run (the default budget)
    python bench/gap.py --steps 120           # a smaller budget when time is short

Writes bench/results/gap.json, gap.md and gap.png (accuracy over steps, three runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_runs import RESULTS, ROOT, eval_series, md_table, read_run, run_up  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.distill import base_rollouts, selection_accuracy  # noqa: E402
from pipeline.labelmodel import fit_label_model  # noqa: E402
from pipeline.rewards import compute_rewards  # noqa: E402


def probe_verifiers(cfg, *, prompts: int, seed: int) -> dict:
    """Selection accuracy of each single verifier, majority vote and Weaver on base-model rollouts."""
    t0 = time.perf_counter()
    data = base_rollouts(cfg, prompts=prompts, seed=seed)
    names = list(cfg.verifier.verifiers)
    votes, truth = data["votes"], data["truth"]          # [n, G, m], [n, G]
    n, g, m = votes.shape
    lm = fit_label_model(votes.reshape(n * g, m), names)
    scores = {f"single:{name}": votes[:, :, j] for j, name in enumerate(names)}
    scores["majority"] = np.stack([compute_rewards("majority", votes=votes[i], names=names,
                                                   completions=data["completions"][i]) for i in range(n)])
    scores["weaver"] = lm.posterior(votes.reshape(n * g, m), names).reshape(n, g)
    acc = {k: round(selection_accuracy(s, truth), 4) for k, s in scores.items()}
    singles = {k: v for k, v in acc.items() if k.startswith("single:")}
    best = max(singles, key=singles.get)
    return {"prompts": n, "group_size": g, "seed": seed, "sample_accuracy": round(float(truth.mean()), 4),
            "any_correct": round(float((truth.max(axis=1) > 0).mean()), 4),
            "selection_accuracy": acc, "best_single": best, "seconds": round(time.perf_counter() - t0, 1)}


def gap_closed(single: float, weaver: float, truth: float) -> float | None:
    """(weaver − single) / (truth − single); None when there is no gap to close."""
    return None if truth - single <= 1e-9 else (weaver - single) / (truth - single)


def plot(runs: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, run in runs.items():
        x, y = eval_series(run)
        ax.plot(x, y, marker="o", ms=3, label=label)
    ax.set_xlabel("trainer step (policy version)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="trainer steps per run (same for all three)")
    ap.add_argument("--lr", type=float, default=None, help="trainer lr for all three (default: the config's)")
    ap.add_argument("--probe-prompts", type=int, default=512, help="base-model prompts for picking the best verifier")
    ap.add_argument("--runs-dir", default="runs", help="where the three runs go")
    ap.add_argument("--out", default=str(RESULTS), help="results directory")
    args = ap.parse_args()
    if args.steps < 10:
        raise SystemExit("--steps: must be >= 10 (the final figure is the mean of the last three evaluations)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, {})

    print(f"probing the weak verifiers on {args.probe_prompts} base-model prompts x {cfg.generator.group_size} samples",
          flush=True)
    probe = probe_verifiers(cfg, prompts=args.probe_prompts, seed=7)
    for k, v in sorted(probe["selection_accuracy"].items(), key=lambda kv: -kv[1]):
        print(f"  selection accuracy {k:<22} {v:.3f}", flush=True)
    best = probe["best_single"]
    print(f"best single verifier: {best}", flush=True)

    overrides: dict[str, object] = {"trainer.steps": args.steps}
    if args.lr is not None:
        overrides["trainer.lr"] = args.lr
    modes = {best: best, "weaver": "weaver", "ground_truth": "ground_truth"}
    runs, dirs = {}, {}
    for label, reward in modes.items():
        tag = "gap-" + label.replace(":", "-").replace("_", "-")
        run_dir = run_up(tag, {**overrides, "verifier.reward": reward}, runs_dir=ROOT / args.runs_dir)
        runs[label], dirs[label] = read_run(run_dir), run_dir

    final = {k: r["summary"]["final_accuracy_mean_last3"] for k, r in runs.items()}
    base = runs["weaver"]["summary"]["base_accuracy"]
    closed = gap_closed(final[best], final["weaver"], final["ground_truth"])
    result = {
        "budget": {"steps": args.steps, **{k: v for k, v in overrides.items() if k != "trainer.steps"},
                   "seed": cfg.trainer.seed, "feeder_seed": cfg.feeder.seed,
                   "heldout_size": runs["weaver"]["summary"]["heldout_size"]},
        "probe": probe,
        "base_accuracy": base,
        "final_accuracy_mean_last3": final,
        "gap_points": round(100 * (final["ground_truth"] - final[best]), 1),
        "weaver_gain_over_single_points": round(100 * (final["weaver"] - final[best]), 1),
        "gap_closed_by_weaver": None if closed is None else round(closed, 3),
        "runs": {k: str(d.relative_to(ROOT)) for k, d in dirs.items()},
        "evals": {k: dict(zip(*eval_series(r))) for k, r in runs.items()},
        "wall_seconds": {k: r["summary"].get("wall_seconds") for k, r in runs.items()},
    }
    (out / "gap.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [[k, f"{base:.3f}", f"{final[k]:.3f}", f"{100 * (final[k] - base):+.1f}",
             str(dirs[k].relative_to(ROOT))] for k in modes]
    sel = probe["selection_accuracy"]
    md = (f"# Generation–verification gap ({args.steps} trainer steps per run, same base model and seeds)\n\n"
          f"Best single verifier by selection accuracy on {probe['prompts']} base-model prompts x "
          f"{probe['group_size']} samples: **{best}** ({sel[best]:.3f}; weaver {sel['weaver']:.3f}, "
          f"majority {sel['majority']:.3f}).\n\n"
          + md_table(["reward", "base", "final (mean of last 3 evals)", "points", "run"], rows)
          + f"\nGap single → ground truth: {result['gap_points']:.1f} points; Weaver closes "
          + ("n/a (no gap)" if closed is None else f"**{100 * closed:.0f}%** of it")
          + f" ({result['weaver_gain_over_single_points']:+.1f} points over {best}).\n\n"
          + "Selection accuracy of each reward on base-model rollouts:\n\n"
          + md_table(["reward", "selection accuracy"], [[k, f"{v:.3f}"] for k, v in
                                                        sorted(sel.items(), key=lambda kv: -kv[1])]))
    (out / "gap.md").write_text(md)
    plot(runs, out / "gap.png", f"held-out accuracy, {args.steps} steps per run")
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
