"""The generation–verification gap experiment (docs/design.md §5, §7), on the real pipeline.

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
    python bench/gap.py --reuse               # re-read the runs named in gap.json, rewrite the report
    python bench/gap.py --reuse --extra distilled=runs/<id>   # add a run as an extra row (not in the gap)

Beside the gap it reports the calibration of the Weaver posterior in the weaver run (hidden
accuracy of the sampled answers per posterior bin, from runs/<id>/posteriors/): where a
bin's accuracy is far from its posterior, the label model mis-weights its verifiers.

Writes bench/results/gap.json, gap.md and gap.png (accuracy over steps, three runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


from pipeline_runs import RESULTS, ROOT, eval_series, md_table, read_run, run_up

from pipeline.config import load_config
from pipeline.algo.distill import base_rollouts, selection_accuracy
from pipeline.algo.labelmodel import fit_label_model
from pipeline.algo.rewards import compute_rewards
from pipeline.verifiers.base import SOUND


def probe_verifiers(cfg, *, prompts: int, seed: int) -> dict:
    """Selection accuracy of each single verifier, majority vote and Weaver on base-model rollouts."""
    t0 = time.perf_counter()
    data = base_rollouts(cfg, prompts=prompts, seed=seed)
    names = list(cfg.verifier.verifiers)
    votes, truth = data["votes"], data["truth"]          # [n, G, m], [n, G]
    n, g, m = votes.shape
    # The label model exactly as the verifier stage fits it under this config.
    sound = [x for x in names if x in SOUND] if cfg.verifier.sound_checks else []
    lm = fit_label_model(votes.reshape(n * g, m), names, dependence=cfg.verifier.dependence, sound=sound)
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


def posterior_calibration(run_dir: Path, *, last_steps: int = 30) -> list[dict]:
    """Hidden accuracy of sampled answers per Weaver-posterior bin over the run's last ``last_steps`` versions."""
    from pipeline.algo.distill import posterior_rows

    rows = posterior_rows(run_dir)
    if not rows:
        return []
    post, truth = [], []
    top = max(r["policy_version"] for r in rows)
    for r in rows:
        if r["posterior"] is not None and r["policy_version"] > top - last_steps:
            post += r["posterior"]
            truth += r["truth"]
    p, t = np.asarray(post), np.asarray(truth, dtype=float)
    out = []
    for lo, hi in [(0.0, 0.2), (0.2, 0.5), (0.5, 0.8), (0.8, 1.0001)]:
        m = (p >= lo) & (p < hi)
        out.append({"posterior": f"[{lo:.1f}, {min(hi, 1.0):.1f}{']' if hi > 1 else ')'}", "rows": int(m.sum()),
                    "mean_posterior": round(float(p[m].mean()), 3) if m.any() else None,
                    "hidden_accuracy": round(float(t[m].mean()), 3) if m.any() else None})
    return out


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
    ap.add_argument("--seed", type=int, default=None,
                    help="trainer, feeder and generator seed for all three (default: the config's)")
    ap.add_argument("--probe-prompts", type=int, default=512, help="base-model prompts for picking the best verifier")
    ap.add_argument("--runs-dir", default="runs", help="where the three runs go")
    ap.add_argument("--out", default=str(RESULTS), help="results directory")
    ap.add_argument("--reuse", action="store_true", help="re-read the runs named in <out>/gap.json instead of training")
    ap.add_argument("--extra", action="append", default=[], metavar="LABEL=RUN_DIR",
                    help="an extra finished run to report and plot beside the three (not part of the gap)")
    args = ap.parse_args()
    if args.steps < 10:
        raise SystemExit("--steps: must be >= 10 (the final figure is the mean of the last three evaluations)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, {})
    extras = {}
    for item in args.extra:
        label, sep, path = item.partition("=")
        if not sep or not (ROOT / path / "summary.json").is_file():
            raise SystemExit(f"--extra {item!r}: expected LABEL=RUN_DIR with a finished run (summary.json)")
        extras[label] = ROOT / path
    if args.reuse:
        return report(json.loads((out / "gap.json").read_text()), extras, out)

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
    if args.seed is not None:
        overrides.update({"trainer.seed": args.seed, "feeder.seed": args.seed, "generator.seed": args.seed})
    modes = {best: best, "weaver": "weaver", "ground_truth": "ground_truth"}
    dirs = {}
    for label, reward in modes.items():
        tag = "gap-" + label.replace(":", "-").replace("_", "-")
        dirs[label] = run_up(tag, {**overrides, "verifier.reward": reward}, runs_dir=ROOT / args.runs_dir)
    budget = {"steps": args.steps, **{k: v for k, v in overrides.items() if k != "trainer.steps"},
              "seed": overrides.get("trainer.seed", cfg.trainer.seed),
              "feeder_seed": overrides.get("feeder.seed", cfg.feeder.seed)}
    return report({"budget": budget, "probe": probe, "runs": {k: str(d.relative_to(ROOT)) for k, d in dirs.items()}},
                  extras, out)


def report(prior: dict, extras: dict[str, Path], out: Path) -> int:
    """Read the three runs (and any extras) named in ``prior``, write gap.json, gap.md and gap.png."""
    probe, budget = prior["probe"], prior["budget"]
    best = probe["best_single"]
    modes = [best, "weaver", "ground_truth"]
    dirs = {k: ROOT / prior["runs"][k] for k in modes}
    runs = {k: read_run(d) for k, d in dirs.items()}
    steps = budget["steps"]

    final = {k: r["summary"]["final_accuracy_mean_last3"] for k, r in runs.items()}
    base = runs["weaver"]["summary"]["base_accuracy"]
    closed = gap_closed(final[best], final["weaver"], final["ground_truth"])
    extra_runs = {k: read_run(d) for k, d in extras.items()}
    calibration = posterior_calibration(dirs["weaver"])
    result = {
        "budget": {**budget, "heldout_size": runs["weaver"]["summary"]["heldout_size"]},
        "probe": probe,
        "base_accuracy": base,
        "final_accuracy_mean_last3": final,
        "gap_points": round(100 * (final["ground_truth"] - final[best]), 1),
        "weaver_gain_over_single_points": round(100 * (final["weaver"] - final[best]), 1),
        "gap_closed_by_weaver": None if closed is None else round(closed, 3),
        "runs": {k: str(d.relative_to(ROOT)) for k, d in dirs.items()},
        "evals": {k: dict(zip(*eval_series(r))) for k, r in runs.items()},
        "wall_seconds": {k: r["summary"].get("wall_seconds") for k, r in runs.items()},
        "weaver_posterior_calibration_last_30_steps": calibration,
        "extra": {k: {"run": str(extras[k].relative_to(ROOT)),
                      "reward": r["summary"].get("reward_mode"),
                      "final_accuracy_mean_last3": r["summary"]["final_accuracy_mean_last3"],
                      "evals": dict(zip(*eval_series(r)))} for k, r in extra_runs.items()},
    }
    (out / "gap.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [[k, f"{base:.3f}", f"{final[k]:.3f}", f"{100 * (final[k] - base):+.1f}",
             str(dirs[k].relative_to(ROOT))] for k in modes]
    rows += [[f"{k} (extra: `{r['summary'].get('reward_mode')}`)", f"{r['summary']['base_accuracy']:.3f}",
              f"{r['summary']['final_accuracy_mean_last3']:.3f}",
              f"{100 * (r['summary']['final_accuracy_mean_last3'] - r['summary']['base_accuracy']):+.1f}",
              str(extras[k].relative_to(ROOT))] for k, r in extra_runs.items()]
    sel = probe["selection_accuracy"]
    md = (f"# Generation–verification gap ({steps} trainer steps per run, same base model and seeds)\n\n"
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
    if calibration:
        md += ("\nCalibration of the Weaver posterior in the weaver run (last 30 steps; hidden accuracy of the "
               "sampled answers per posterior bin):\n\n"
               + md_table(["posterior", "rows", "mean posterior", "hidden accuracy"],
                          [[c["posterior"], c["rows"], c["mean_posterior"], c["hidden_accuracy"]] for c in calibration]))
    (out / "gap.md").write_text(md)
    plot({**runs, **{f"{k} (extra)": r for k, r in extra_runs.items()}}, out / "gap.png",
         f"held-out accuracy, {steps} steps per run")
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
