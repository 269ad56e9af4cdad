"""The powered real-model experiment, run as its plan says (bench/results/powered-plan.md).

SmolLM2-135M-Instruct trained with GRPO on the reasoning-gym tasks the plan's rule picks from
the panel bench (bench/results/panel.json: best single verifier's AUC on the evaluation split
at most 0.90, read once the bench holds at least 2,000 scored completions of the task), four
arms from the same base and seeds:

- ``truth``: ``verifier.reward = ground_truth``;
- ``single``: ``single:<the bench's best single verifier of the task>``;
- ``weaver``: ``weaver``, label-free, the default label model;
- ``weaver-128``: ``weaver`` with ``verifier.label_model = scores`` and ``verifier.labels = 128``.

Each run is a real ``pipeline up`` (bench/pipeline_runs.run_up); afterwards its final
checkpoint is evaluated greedily on the 500 held-out problems with ``pipeline eval``, per
problem, and the base once per task the same way. The report gives each arm's gain (median
and range over seeds), paired differences between arms with 95% bootstrap intervals over
problems and seeds, and each weaver arm's share of the single -> truth gap.

    python bench/powered_experiment.py --dry-run     # the tasks the rule picks, the runs, the cost
    python bench/powered_experiment.py               # every run not yet in powered.json (resumable)
    python bench/powered_experiment.py --report-only # rewrite the report from powered.json
    python bench/powered_experiment.py --smoke       # the machinery on a tiny budget (not the experiment)
    python bench/powered_experiment.py --hours 2.5   # stop cleanly after 2.5 h; the same command goes on
                                                     # (a run not expected to finish in the time left is skipped
                                                     #  for a later, shorter one)

Runs go seed-major (seed 0 of every arm of every task first), one at a time, niced; after each
one bench/results/powered.json is rewritten, so an interrupted experiment keeps what finished
and a rerun continues it; a run killed mid-way (with its driver: a session's end) is continued
from its last checkpoint (`pipeline up --resume`), not started over. A progress line with an ETA
comes between runs; each run's own progress lines pass through.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_runs import (PIPELINE, RESULTS, ROOT, DeadlineReached, NotStarted, deadline_of, eval_series,  # noqa: E402
                           md_table, read_run, run_up, unfinished_run)

# The plan's constants (bench/results/powered-plan.md); changing one is an amendment of the plan.
AUC_MAX = 0.90
MIN_COMPLETIONS = 2000
TASKS = 2
SEEDS = (0, 1, 2)
STEPS = 120
EVAL_EVERY = 20
CHECKPOINT_EVERY = 1
HELDOUT = 500
LABELS = 128
RESAMPLES = 10_000
ARMS = ("truth", "single", "weaver", "weaver-128")
PLAN = RESULTS / "powered-plan.md"
SMOL = "artifacts/smollm2-135m-instruct"


def arm_overrides(arm: str, best_single: str) -> dict[str, object]:
    """The config fields an arm sets (beside the seeds and the budget)."""
    return {"truth": {"verifier.reward": "ground_truth", "verifier.monitor_share": 0.0},
            "single": {"verifier.reward": f"single:{best_single}", "verifier.monitor_share": 0.0},
            # The default label model when the first arm ran (2026-12-07), named so that a later
            # change of the default cannot reach the runs still to come.
            "weaver": {"verifier.reward": "weaver", "verifier.monitor_share": 1.0, "verifier.label_model": "weaver"},
            "weaver-128": {"verifier.reward": "weaver", "verifier.monitor_share": 1.0,
                           "verifier.label_model": "scores", "verifier.labels": LABELS}}[arm]


# --------------------------------------------------------------------------- the tasks


def tasks_by_rule(panel: dict, *, min_completions: int = MIN_COMPLETIONS) -> tuple[list[dict], list[list]]:
    """The plan's rule over the bench's tasks, in the bench's order: (the first ``TASKS`` that
    qualify, a row per bench task saying why it does or does not)."""
    pilot = {p["key"]: p for p in panel.get("pilot", [])}
    chosen, rows = [], []
    for key, t in panel["tasks"].items():
        best = t["best_single"]
        a = t["methods"]["best single verifier"]["auc"]
        if t["completions"] < min_completions:
            why = f"record holds {t['completions']} completions, the rule reads it at {min_completions}"
            ok = False
        elif a is None or a > AUC_MAX:
            why, ok = f"best single AUC {a} > {AUC_MAX}", False
        else:
            why, ok = f"best single AUC {a} <= {AUC_MAX}", True
        if ok and len(chosen) < TASKS:
            p = pilot.get(key, {})
            chosen.append({"key": key, "dataset": p.get("dataset", key.split("-")[0]), "params": p.get("params", {}),
                           "best_single": best, "best_single_auc": a, "base_sampled_accuracy": t["true_share"]})
            why += " (chosen)"
        rows.append([key, t["completions"], f"`{best}`", a, why])
    return chosen, rows


def task_config(task: dict, path: Path, *, heldout: int, panel: list[str]) -> Path:
    """The run config of a task: configs/real.toml's training settings on the task, as the bench samples it."""
    verifiers = ",\n  ".join(json.dumps(v) for v in panel)
    path.write_text(f"""# Written by bench/powered_experiment.py for {task['key']} (bench/results/powered-plan.md).
[model]
base_dir = "{SMOL}"

[task]
kind = "reasoning_gym"
datasets = [{json.dumps(task['dataset'])}]
dataset_params = {json.dumps(json.dumps({task['dataset']: task['params']}))}
system_prompt = "Give only the final number."
answer_extract = "last_number"
max_new_tokens = 32
heldout_size = {heldout}

[generator]
prompts_per_batch = 8

[verifier]
reward = "weaver"
verifiers = [
  {verifiers},
]
batch = 8
timeout_s = 120.0

[trainer]
steps = {STEPS}
groups_per_step = 8
lr = 3e-6
warmup_steps = 0
threads = 1
eval_every = {EVAL_EVERY}
checkpoint_every = {CHECKPOINT_EVERY}

[cluster]
generators = 1
verifiers = 1
timeout_s = 21600.0
""")
    return path


# --------------------------------------------------------------------------- the runs


def evaluate(config: Path, checkpoint: str, out: Path) -> list[int]:
    """Greedy correctness per held-out problem of ``checkpoint`` (``pipeline eval``, one sample for pass@1)."""
    if not out.is_file():
        cmd = ["nice", "-n", "10", *PIPELINE, "eval", "--config", str(config), "--checkpoint", checkpoint,
               "--n", "1", "--k", "1", "--out", str(out)]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return [int(x) for x in json.loads(out.read_text())["per_prompt"]["greedy_correct"]]


def run_one(task: dict, arm: str, seed: int, *, config: Path, runs_dir: Path, steps: int,
            extra: dict[str, object], deadline: float | None = None, needs_s: float | None = None) -> dict:
    overrides = {**arm_overrides(arm, task["best_single"]), "trainer.seed": seed, "feeder.seed": seed,
                 "generator.seed": seed, "trainer.steps": steps, **extra}
    t0 = time.time()
    # The code this driver runs (read now: the repository may move on while the run goes).
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    label = f"pw-{task['dataset']}-{arm}-s{seed}"
    # A run killed with its driver (a session's end) goes on from its checkpoint instead of starting over.
    cont = unfinished_run(label, overrides, runs_dir=runs_dir, config=config)
    run_dir = run_up(label, overrides, runs_dir=runs_dir, config=config, resume=cont, deadline=deadline,
                     needs_s=needs_s)
    wall = time.time() - t0
    for ckpt in (run_dir / "checkpoints").glob("step-*"):
        shutil.rmtree(ckpt, ignore_errors=True)  # model and optimizer of the last steps; final/ stays
    final = evaluate(run_dir / "config.toml", str(run_dir / "checkpoints" / "final"), run_dir / "final_eval.json")
    run = read_run(run_dir)
    s = run["summary"]
    x, y = eval_series(run)
    acc = s.get("accounting", {})
    from pipeline.observe.report import label_model_fit

    return {"run": str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else str(run_dir),
            "commit": commit or None,
            # Over every driver of a resumed run (this process saw only the last one's part).
            "wall_seconds": round(s.get("wall_seconds_total") or wall, 1), "resumes": s.get("driver_resumes", 0),
            "versions_lost": s.get("versions_lost_in_crashes", 0),
            "evals": dict(zip(map(str, x), y)),
            "final_correct": final, "final": float(np.mean(final)),
            # What the arm trained on: its mean reward per step (a single arm whose judge never
            # reaches its threshold trains on nothing; the report shows it beside the gains).
            "train_reward_mean": train_reward_mean(run),
            "accounting_ok": bool(acc.get("ok", s.get("accounting_ok"))), "lost": acc.get("lost"),
            "unexpected": acc.get("unexpected"), "duplicated": acc.get("duplicated"),
            "label_model": label_model_fit(run_dir) if arm.startswith("weaver") else None}


def expected_seconds(result: dict, task: str, arm: str) -> float | None:
    """What a fresh run of ``arm`` on ``task`` is expected to take, for ``--hours``: the shortest
    finished run of that arm on that task (another seed), else the longest finished run of any arm on
    any task (an arm's time differs across tasks: a judge that never passes trains on nothing, and
    runs in half the time, on one task and not on another); None before any run finished."""
    took = [(k, a, r["wall_seconds"]) for k, tr in result.get("tasks", {}).items()
            for a, runs in tr.get("runs", {}).items() for r in runs.values() if r.get("wall_seconds")]
    same = [w for k, a, w in took if (k, a) == (task, arm)]
    every = [w for _, _, w in took]
    return min(same) if same else (max(every) if every else None)


def train_reward_mean(run: dict) -> float | None:
    """Mean over a run's steps of the step's mean reward (None: no step recorded one)."""
    vals = [r["reward_mean"] for r in run["steps"] if isinstance(r.get("reward_mean"), (int, float))]
    return round(float(np.mean(vals)), 4) if vals else None


# --------------------------------------------------------------------------- the statistics


def paired(a: dict[int, list[int]], b: dict[int, list[int]], *, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Mean over seeds of (accuracy of a - accuracy of b) on the same problems, with a 95% percentile
    bootstrap interval: each resample draws the problems and the seeds with replacement."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return {"mean": None, "low": None, "high": None, "seeds": 0}
    d = np.array([np.asarray(a[s], dtype=np.float64) - np.asarray(b[s], dtype=np.float64) for s in seeds])
    rng = np.random.default_rng(seed)
    n = d.shape[1]
    means = np.empty(resamples)
    for i in range(resamples):
        rows = rng.integers(0, len(seeds), len(seeds))
        cols = rng.integers(0, n, n)
        means[i] = d[np.ix_(rows, cols)].mean()
    return {"mean": round(float(d.mean()), 4), "low": round(float(np.percentile(means, 2.5)), 4),
            "high": round(float(np.percentile(means, 97.5)), 4), "seeds": len(seeds)}


def gap_share(truth: dict, single: dict, weaver: dict, *, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """(weaver - single) / (truth - single) and its 95% bootstrap interval over problems and seeds
    (resamples where the gap is 0 are left out)."""
    seeds = sorted(set(truth) & set(single) & set(weaver))
    if not seeds:
        return {"share": None, "low": None, "high": None}
    t, s, w = (np.array([np.asarray(x[k], dtype=np.float64) for k in seeds]) for x in (truth, single, weaver))
    gap = (t - s).mean()
    share = None if abs(gap) < 1e-12 else float((w - s).mean() / gap)
    rng = np.random.default_rng(seed)
    n, vals = t.shape[1], []
    for _ in range(resamples):
        rows, cols = rng.integers(0, len(seeds), len(seeds)), rng.integers(0, n, n)
        g = (t - s)[np.ix_(rows, cols)].mean()
        if abs(g) > 1e-12:
            vals.append((w - s)[np.ix_(rows, cols)].mean() / g)
    return {"share": None if share is None else round(share, 3),
            "low": round(float(np.percentile(vals, 2.5)), 3) if vals else None,
            "high": round(float(np.percentile(vals, 97.5)), 3) if vals else None}


def task_statistics(result: dict) -> dict:
    """Per arm the gains; the paired differences; the gap shares; the plan's lines met or missed."""
    base = result["base_correct"]
    runs = result["runs"]
    finals = {arm: {int(s): r["final_correct"] for s, r in runs.get(arm, {}).items()} for arm in ARMS}
    out: dict = {"arms": {}, "paired": {}, "gap_share": {}, "lines": []}
    base_acc = float(np.mean(base))
    for arm in ARMS:
        f = finals[arm]
        if not f:
            continue
        gains = [float(np.mean(v)) - base_acc for v in f.values()]
        out["arms"][arm] = {"seeds": len(f), "gain_median": round(float(np.median(gains)), 4),
                            "gain_min": round(min(gains), 4), "gain_max": round(max(gains), 4),
                            "gain_vs_base": paired(f, {s: base for s in f})}
    for a, b in (("truth", "single"), ("weaver", "single"), ("weaver-128", "single"), ("weaver", "truth"),
                 ("weaver-128", "truth"), ("weaver-128", "weaver")):
        if finals[a] and finals[b]:
            out["paired"][f"{a} - {b}"] = paired(finals[a], finals[b])
    ts = out["paired"].get("truth - single")
    gap_excludes_zero = bool(ts and ts["low"] is not None and (ts["low"] > 0 or ts["high"] < 0))
    for w in ("weaver", "weaver-128"):
        if finals[w] and finals["truth"] and finals["single"] and gap_excludes_zero:
            out["gap_share"][w] = gap_share(finals["truth"], finals["single"], finals[w])
    truth = out["arms"].get("truth")
    if truth:
        iv = truth["gain_vs_base"]
        out["lines"].append({"line": "truth gains >= 10 points, interval excluding 0",
                             "met": iv["mean"] >= 0.10 and iv["low"] > 0,
                             "by": round(iv["mean"] - 0.10, 4), "interval": [iv["low"], iv["high"]]})
    for w in ("weaver", "weaver-128"):
        if w in out["gap_share"]:
            g = out["gap_share"][w]
            out["lines"].append({"line": f"{w} closes >= 50% of the single -> truth gap",
                                 "met": g["share"] is not None and g["share"] >= 0.5,
                                 "by": None if g["share"] is None else round(g["share"] - 0.5, 3),
                                 "interval": [g["low"], g["high"]]})
        d = out["paired"].get(f"{w} - single")
        if d:
            out["lines"].append({"line": f"{w} gain >= single gain - 2 points", "met": d["mean"] >= -0.02,
                                 "by": round(d["mean"] + 0.02, 4), "interval": [d["low"], d["high"]]})
    return out


# --------------------------------------------------------------------------- the report


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = result["tasks"]
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(6 * max(1, len(tasks)), 4), squeeze=False)
    colors = {"truth": "tab:green", "single": "tab:orange", "weaver": "tab:blue", "weaver-128": "tab:purple"}
    for ax, (key, t) in zip(axes[0], tasks.items()):
        for arm in ARMS:
            for k, r in enumerate(t["runs"].get(arm, {}).values()):
                ax.plot([int(v) for v in r["evals"]], list(r["evals"].values()), color=colors[arm], alpha=0.8,
                        marker="o", ms=3, label=arm if k == 0 else None)
        ax.set_title(key, fontsize=8)
        ax.set_xlabel("trainer step")
        ax.set_ylabel(f"held-out greedy accuracy ({result['heldout']} problems)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a task not started has no curve yet
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict, out: Path, name: str) -> None:
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# The powered real-model experiment{' (smoke: not the experiment)' if result.get('smoke') else ''}", "",
             f"`{result['command']}`, {result.get('finished') or 'not finished'}; planned in "
             "`bench/results/powered-plan.md` before any arm ran, reported against it. "
             f"{result['heldout']} held-out problems per task, greedy; {result['steps']} steps per run; "
             f"seeds {', '.join(map(str, result['seeds']))}.", "",
             "## The tasks the plan's rule picks", "",
             md_table(["bench task", "completions recorded", "best single verifier", "its AUC (evaluation split)",
                       "the rule"], result["rule"])]
    for key, t in result["tasks"].items():
        st = t.get("statistics") or {}
        if "base_correct" not in t:  # the runs go seed-major: a task is reached after another's first runs
            lines += [f"## {key}", "", f"Not started (single arm: `{t['best_single']}`): no base evaluation or "
                      "run yet.", ""]
            continue
        lines += [f"## {key}", "", f"Base greedy accuracy {np.mean(t['base_correct']):.3f}; single arm: "
                  f"`{t['best_single']}`.", ""]
        rows, unsignalled = [], []
        for arm in ARMS:
            a = st.get("arms", {}).get(arm)
            runs = t["runs"].get(arm, {})
            if not a:
                rows.append([arm, "0", "not run", "", "", "", "", ""])
                continue
            rewards = [r["train_reward_mean"] for r in runs.values() if r.get("train_reward_mean") is not None]
            if len(rewards) == len(runs) and not any(rewards):  # it trained on nothing: it is the base
                unsignalled.append((arm, len(runs)))
            iv = a["gain_vs_base"]
            walls = [r["wall_seconds"] for r in runs.values()]
            ok = all(r["accounting_ok"] for r in runs.values())
            resumed = (f"{sum(r.get('resumes', 0) for r in runs.values())} / "
                       f"{sum(r.get('versions_lost') or 0 for r in runs.values())}")
            rows.append([arm, a["seeds"], f"{pct(a['gain_median'])} ({pct(a['gain_min'])} to {pct(a['gain_max'])})",
                         f"{pct(iv['mean'])} [{pct(iv['low'])}, {pct(iv['high'])}]",
                         f"{np.median(rewards):.3f}" if rewards else "",
                         f"{np.median(walls) / 60:.0f} min", resumed, "balanced" if ok else "**not balanced**"])
        lines += [md_table(["arm", "seeds", "gain, median (range), points", "gain, mean [95% interval]",
                            "training reward, median of runs' means", "wall per run", "resumes / versions lost",
                            "accounting"], rows)]
        for arm, n in unsignalled:  # said where its comparisons are read
            lines += [f"The {arm} arm's reward was 0 at every step of its {n} run{'s' if n > 1 else ''}: no group "
                      "carried a signal, nothing was trained, and its final accuracy is the base's; every "
                      "comparison with it below is a comparison with the base.", ""]
        if st.get("paired"):
            lines += ["Paired differences of final accuracy (points; mean over seeds, 95% bootstrap interval "
                      "over problems and seeds):", "",
                      md_table(["difference", "mean", "interval"],
                               [[k, pct(v["mean"]), f"[{pct(v['low'])}, {pct(v['high'])}]"]
                                for k, v in st["paired"].items()])]
        if st.get("gap_share"):
            lines += [md_table(["weaver arm", "share of the single -> truth gap closed", "interval"],
                               [[k, v["share"], f"[{v['low']}, {v['high']}]"] for k, v in st["gap_share"].items()])]
        if st.get("lines"):
            def by(x: dict) -> list[str]:
                if "gap" in x["line"]:  # a share of the gap, not points
                    return [str(x["by"]), f"[{x['interval'][0]}, {x['interval'][1]}]"]
                return [pct(x["by"]), f"[{pct(x['interval'][0])}, {pct(x['interval'][1])}]"]

            lines += [md_table(["the plan's line", "met", "by (points, or share of the gap)", "interval"],
                               [[x["line"], "yes" if x["met"] else "**missed**", *by(x)] for x in st["lines"]])]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    if any(t["runs"] for t in result["tasks"].values()):
        plot(result, out / f"{name}.png")


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--panel", type=Path, default=RESULTS / "panel.json", help="the panel bench's result")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where powered.{json,md,png} go")
    ap.add_argument("--runs-dir", type=Path, default=ROOT / "runs")
    ap.add_argument("--dry-run", action="store_true", help="print the tasks, the runs and the cost; run nothing")
    ap.add_argument("--hours", type=float, default=None,
                    help="stop after this long: the run in progress is stopped cleanly (as `pipeline down` stops "
                         "it) and the next invocation continues it from its checkpoint; no new run or base "
                         "evaluation starts after it, and a fresh run expected to take longer than the time left "
                         "is skipped for a later one that fits (expected: the shortest finished run of its arm on "
                         "its task, else the longest of any); a run's final evaluation, minutes, is not cut: "
                         "leave a margin")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from <out>/powered.json")
    ap.add_argument("--smoke", action="store_true",
                    help="the machinery on a tiny budget (2 steps, 20 held-out problems, seed 0, small batches, "
                         "the first bench task whatever its record), to a temporary directory: not the experiment")
    args = ap.parse_args()
    from bench_panel import PANEL

    name = "powered"
    panel = json.loads(args.panel.read_text())
    steps, heldout, seeds, extra = STEPS, HELDOUT, SEEDS, {}
    if args.smoke:
        steps, heldout, seeds = 2, 20, (0,)
        extra = {"trainer.groups_per_step": 2, "generator.prompts_per_batch": 2, "trainer.eval_every": 1,
                 "trainer.checkpoint_every": 1}
        args.out = Path(tempfile.mkdtemp(prefix="powered-smoke-"))
        args.runs_dir = args.out / "runs"
    chosen, rule_rows = tasks_by_rule(panel, min_completions=0 if args.smoke else MIN_COMPLETIONS)
    if args.smoke:
        chosen = chosen[:1] or tasks_by_rule(panel, min_completions=0)[0][:1]
    path = args.out / f"{name}.json"
    result = json.loads(path.read_text()) if path.is_file() and not args.smoke else {}
    argv = sys.argv[1:]
    # How one invocation ran (its time, or only the report), not how the experiment runs.
    if "--hours" in argv:
        i = argv.index("--hours")
        argv = argv[:i] + argv[i + 2:]
    argv = [x for x in argv if not x.startswith("--hours=") and x != "--report-only"]
    result.update({"command": " ".join(["python", "bench/powered_experiment.py", *argv]),
                   "plan": str(PLAN.relative_to(ROOT)), "steps": steps, "heldout": heldout, "seeds": list(seeds),
                   "rule": rule_rows, "smoke": args.smoke})
    result.setdefault("tasks", {})
    for t in chosen:
        if t["key"] in result["tasks"] and result["tasks"][t["key"]]["best_single"] != t["best_single"]:
            raise SystemExit(f"{t['key']}: the bench now picks {t['best_single']} as the best single verifier, "
                             f"the recorded runs used {result['tasks'][t['key']]['best_single']}: the plan forbids a "
                             "swap after results; keep the bench's record as it was when the first arm ran")
        result["tasks"].setdefault(t["key"], {**t, "runs": {}})
    todo = [(t, arm, s) for s in seeds for t in chosen for arm in ARMS
            if str(s) not in result["tasks"][t["key"]]["runs"].get(arm, {})]
    if not chosen:
        print("no task meets the plan's rule yet:", flush=True)
        for r in rule_rows:
            print(f"  {r[0]}: {r[4]}", flush=True)
        return 0 if (args.dry_run or args.report_only) else 1
    print(f"tasks by the plan's rule: {', '.join(t['key'] for t in chosen)}; {len(todo)} runs to do", flush=True)
    if args.dry_run:
        for t, arm, s in todo:
            print(f"  {t['key']} {arm} seed {s}", flush=True)
        return 0
    if not args.report_only:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.runs_dir / "powered").mkdir(parents=True, exist_ok=True)
        done, t_start, deadline = 0, time.time(), deadline_of(args.hours)
        for t, arm, s in todo:
            if deadline is not None and time.time() >= deadline:
                print("[powered] the time given (--hours) is up: stopping here; rerun the same command to go on",
                      flush=True)
                break
            tr = result["tasks"][t["key"]]
            config = task_config(t, args.runs_dir / "powered" / f"{t['key']}.toml", heldout=heldout, panel=PANEL)
            if "base_correct" not in tr:
                print(f"[powered] {t['key']}: the base on {heldout} held-out problems", flush=True)
                tr["base_correct"] = evaluate(config, SMOL, args.runs_dir / "powered" / f"{t['key']}-base.json")
            rate = (time.time() - t_start) / done if done else None
            eta = f", ETA {rate * (len(todo) - done) / 3600:.1f} h" if rate else ""
            print(f"[powered] run {done + 1}/{len(todo)}: {t['key']} {arm} seed {s}{eta}", flush=True)
            try:
                rec = run_one(t, arm, s, config=config, runs_dir=args.runs_dir, steps=steps, extra=extra,
                              deadline=deadline, needs_s=expected_seconds(result, t["key"], arm))
            except NotStarted as e:  # a shorter run further down the list may still fit
                print(f"[powered] {t['key']} {arm} seed {s}: {e}; trying the next run", flush=True)
                continue
            except DeadlineReached as e:
                print(f"[powered] {e}: stopping here; rerun the same command to go on", flush=True)
                break
            tr["runs"].setdefault(arm, {})[str(s)] = rec
            tr["statistics"] = task_statistics(tr)
            done += 1
            result["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()) if done == len(todo) else None
            report(result, args.out, name)
    for tr in result["tasks"].values():
        if "base_correct" in tr:
            tr["statistics"] = task_statistics(tr)
    report(result, args.out, name)
    print(f"wrote {args.out / name}.md", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
