"""The label model's two label-free estimates of the class balance π (``verifier.pi_estimate``:
``alternate`` and ``levels``), and the label model that keeps the scores
(``verifier.label_model = "scores"``, label-free), on synthetic verifier votes whose truth is
known, several seeds each: the estimated π against the true share, and the posterior's AUC.
Where a scenario says judges ask one model, their names say so (``lm_judge:m@<style>``), which
only the score model reads.

Each scenario is a way verifiers can err. Writes ``bench/results/pi.{json,md}``; a few seconds.

    python bench/pi_estimates.py [--seeds 5] [--rows 4000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

from common import progress, save_result
from pipeline_runs import ROOT, md_table
from real_experiment import auc

from pipeline.algo.labelmodel import PI_ESTIMATES, fit_label_model
from pipeline.algo.scoremodel import fit_score_model

PI = 0.2


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _check(y: np.ndarray, rng: np.random.Generator, tpr: float = 0.85, fpr: float = 0.3) -> np.ndarray:
    return np.where(y == 1.0, rng.random(y.size) < tpr, rng.random(y.size) < fpr).astype(np.float64)


def independent(y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Four continuous judges of unequal strength with independent errors, one binary check."""
    judges = [_sigmoid(a * (2.0 * y - 1.0) + rng.normal(size=y.size)) for a in (2.0, 1.5, 1.2, 0.8)]
    return np.column_stack([*judges, _check(y, rng)])


def shared_error(y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Three judges of one model: a common Gaussian error as large as the label's effect, one check."""
    z = rng.normal(size=y.size)
    judges = [_sigmoid(a * (2.0 * y - 1.0) + 1.5 * z + rng.normal(size=y.size)) for a in (2.0, 1.5, 1.0)]
    return np.column_stack([*judges, _check(y, rng)])


def fooled_together(y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Three judges that 40% of wrong answers fool all at once, two binary checks."""
    looks_right = np.where(y == 1.0, 1.0, (rng.random(y.size) < 0.4).astype(np.float64))
    judges = [_sigmoid(3.0 * looks_right - 1.5 + rng.normal(0.0, 0.8, y.size)) for _ in range(3)]
    return np.column_stack([*judges, _check(y, rng, 0.8), _check(y, rng, 0.8)])


def nuisance_pair(y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A strong and a medium judge, one check, and two near-chance judges that share a nuisance
    (say, answer length) far stronger than their signal."""
    u = rng.normal(size=y.size)
    good = [_sigmoid(a * (2.0 * y - 1.0) + rng.normal(size=y.size)) for a in (2.5, 1.2)]
    weak = [_sigmoid(0.3 * (2.0 * y - 1.0) + 2.0 * u + rng.normal(0.0, 0.5, y.size)) for _ in range(2)]
    return np.column_stack([*good, _check(y, rng), *weak])


SCENARIOS = {"independent": independent, "shared_error": shared_error, "fooled_together": fooled_together,
             "nuisance_pair": nuisance_pair}
ONE_MODEL = {"shared_error": 3}
"""Scenarios whose first k judges ask one model."""


def names_of(scenario: str, m: int) -> list[str]:
    k = ONE_MODEL.get(scenario, 0)
    return [f"lm_judge:m@s{j}" if j < k else f"v{j}" for j in range(m)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5, help="seeds per scenario")
    ap.add_argument("--rows", type=int, default=4000, help="completions per window")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results directory")
    args = ap.parse_args(argv)
    say = progress("pi-estimates")
    runs: dict[str, dict[str, list[dict]]] = {}
    for name, make in SCENARIOS.items():
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            y = (rng.random(args.rows) < PI).astype(np.float64)
            votes = make(y, rng)
            names = names_of(name, votes.shape[1])
            for how in (*PI_ESTIMATES, "scores"):
                if how == "scores":
                    lm = fit_score_model(votes, names)
                else:
                    lm = fit_label_model(votes, names, pi_estimate=how)
                a = auc(np.asarray(lm.posterior(votes, names)), y)
                runs.setdefault(name, {}).setdefault(how, []).append(
                    {"seed": seed, "true": round(float(y.mean()), 4), "pi": round(lm.pi, 4),
                     "auc": None if a is None else round(a, 4)})
        say(name + ": " + "; ".join(
            f"{how} π {statistics.median(r['pi'] for r in rs):.3f}" for how, rs in runs[name].items()))

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} ({min(xs):.3f} – {max(xs):.3f})"

    rows = []
    for name, by in runs.items():
        for how, rs in by.items():
            rows.append([f"`{name}`", f"`{how}`", cell([r["true"] for r in rs]), cell([r["pi"] for r in rs]),
                         cell([r["auc"] for r in rs if r["auc"] is not None])])
    out = Path(args.out)
    result = save_result(out / "pi.json", {"pi": PI, "rows": args.rows, "seeds": args.seeds, "runs": runs},
                         script="bench/pi_estimates.py", argv=argv)
    doc = "\n".join(f"- `{n}`: {' '.join((f.__doc__ or '').split())}" for n, f in SCENARIOS.items())
    md = (f"# The label models' label-free estimates of π on synthetic votes\n\n`{result['command']}`: "
          f"{args.rows} completions per window, a true share of {PI} right, {args.seeds} seeds; median "
          f"(range) over the seeds.\n\n{md_table(['scenario', 'pi_estimate (or label model)', 'true share', 'estimated π', 'AUC'], rows)}"
          f"\n\nScenarios:\n\n{doc}\n")
    (out / "pi.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
