"""Write bench/results/distill.{md,json} from the report.json that `pipeline distill` left in each run.

    python bench/distill_report.py runs/<id>/distilled [more distilled dirs...]

Every figure comes from those files (measured by `pipeline distill` in its own run);
nothing is typed in by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results"


def row(rep: dict) -> str:
    sel, rps, cfg = rep["selection_accuracy"], rep["rows_per_second"], rep["config"]
    best = max((k for k in sel if k.startswith("single:")), key=sel.get)
    return (f"| `{rep['run']}` | {cfg['init']} | {rep['params']:,} | {rep['train_rows']} rows, {rep['steps']} steps, "
            f"{rep['train_seconds']:.0f} s | {sel['distilled']:.3f} | {sel['ensemble']:.3f} | "
            f"**{100 * rep['retention']:.1f}%** | {rep['top_pick_agreement']:.2f} | {best} {sel[best]:.3f} | "
            f"{rps['distilled_batched']:,.0f} / {rps['distilled_per_group']:,.0f} | {rps['ensemble_per_group']:,.0f} |")


def main(dirs: list[str]) -> int:
    if not dirs:
        raise SystemExit(__doc__)
    reports = []
    for d in dirs:
        path = ROOT / d / "report.json" if not Path(d).is_absolute() else Path(d) / "report.json"
        if not path.is_file():
            raise SystemExit(f"{d}: no report.json (run `pipeline distill --run <run>` first)")
        reports.append(json.loads(path.read_text()))
    md = [
        "# Distilled verifier (a cross-encoder trained on a run's Weaver posteriors)", "",
        "Each row: `pipeline distill --run <run>`; held-out groups are split by prompt, their hidden truth used "
        "only to measure. Selection accuracy = hidden correctness of each held-out group's top-scored completion "
        "(ties averaged); the ensemble is the Weaver posterior the run recorded. Throughput in the same process, "
        "1 torch thread, on the shared 2-core CPU: rows/s of the distilled model (batched / one group per call) "
        "against the weak verifiers + label-model posterior per group, as the verifier stage runs them.", "",
        "| run | init | params | training | distilled | ensemble | retention | top-pick agreement | best single "
        "| distilled rows/s | ensemble rows/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *[row(r) for r in reports], "",
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "distill.md").write_text("\n".join(md))
    (OUT / "distill.json").write_text(json.dumps(reports, indent=2))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
