"""``pipeline report <run dir>``: PNG plots and a markdown report of a run, from its files alone.

Reads what a run leaves in its directory:

    metrics.jsonl   trainer: one ``step`` row per optimizer step, one ``eval`` row per evaluation
    queues.jsonl    exporter: queue depths (length, lag, pending per stream) every sample
    logs/*.jsonl    every worker's structured log: ``batch_generated``, ``batch_scored`` and
                    ``step`` lines carry the seconds each batch took and end at their timestamp

and writes ``report/{reward_accuracy,queues,staleness,utilisation}.png``, ``report.json``
(every number the report states, and the series it plots) and ``report.md`` linking them.
A run with multi-turn episodes (its step rows carry ``env_reward_mean``, its queue samples
``episodes``) also gets ``report/episodes.png`` (tool-call rate and environment reward per
step) and an "Episodes" section (docs/observing.md, "Episodes"); a run with a rollout archive
(``archive/``) gets ``report/trained_on.png``, the mean reward of the right and the wrong
completions each step trained on (docs/reproducibility.md).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipeline.common.archive import ARCHIVE_DIR, read_columns, size as archive_size, steps as archive_steps

BUSY_EVENTS = {"batch_generated": "seconds", "batch_scored": "seconds", "step": "step_seconds"}
"""Log events that mark a finished unit of work, and the field holding how long it took."""
STAGE_ORDER = ("feeder", "generator", "verifier", "trainer")


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a torn last line of a killed process
    return rows


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def busy_spans(log_dir: Path) -> dict[str, dict]:
    """Per worker: its stage and its busy spans ``(start, end)`` in Unix seconds, from the log lines."""
    out: dict[str, dict] = {}
    for path in sorted(log_dir.glob("*.jsonl")) if log_dir.exists() else []:
        for row in _jsonl(path):
            field = BUSY_EVENTS.get(row.get("event", ""))
            if field is None or field not in row or "timestamp" not in row:
                continue
            end = _ts(row["timestamp"])
            w = out.setdefault(row.get("worker", path.stem), {"stage": row.get("stage", ""), "spans": []})
            w["spans"].append((end - float(row[field]), end))
    return out


def vote_rates(votes, truth, threshold: float = 0.5) -> dict:
    """TPR and TNR of 1[score >= threshold] against the hidden truth, abstentions (NaN) left out,
    and the share of completions scored at all."""
    v, t = np.asarray(votes, dtype=np.float64).ravel(), np.asarray(truth).ravel()
    m = ~np.isnan(v)
    p, n = m & (t == 1), m & (t == 0)
    return {"tpr": round(float((v[p] >= threshold).mean()), 3) if p.any() else None,
            "tnr": round(float((v[n] < threshold).mean()), 3) if n.any() else None,
            "voted": round(float(m.mean()), 3) if m.size else None}


def label_model_fit(run_dir: Path) -> dict | None:
    """The newest label-model fit the run's verifiers logged (``labelmodel_fitted``): per verifier
    kept or dropped (why), threshold and the TPR/TNR it estimated without labels; beside them
    the same rates measured against the hidden truth on the groups scored under that fit
    (``posteriors/``). None when no fit was logged (a run whose reward needs none)."""
    fit = None
    for rec in (r for log in sorted((run_dir / "logs").glob("ver-*.jsonl")) for r in _jsonl(log)):
        if rec.get("event") == "labelmodel_fitted" and (fit is None or rec.get("version", -1) >= fit.get("version", -1)):
            fit = rec
    if fit is None:
        return None
    rows = [r for f in sorted((run_dir / "posteriors").glob("*.jsonl")) for r in _jsonl(f)
            if r.get("labelmodel_version") == fit.get("version") and r.get("truth") is not None]
    thresholds = fit.get("thresholds") or {}
    names = list(thresholds) or list(fit.get("pos_rate") or {}) or list(fit.get("weights") or {})
    measured = {}
    if rows:
        cols = rows[0]["names"]
        votes = np.array([[[np.nan if v is None else v for v in c] for c in r["votes"]] for r in rows], dtype=np.float64)
        truth = np.array([r["truth"] for r in rows])
        for name in names:
            if name in cols and name in thresholds:
                measured[name] = vote_rates(votes[:, :, cols.index(name)], truth, thresholds[name])
    verifiers = {name: {"kept": name in (fit.get("kept") or fit.get("weights") or []), "dropped": (fit.get("dropped") or {}).get(name),
                        "threshold": thresholds.get(name), "tpr_fitted": (fit.get("tpr") or {}).get(name),
                        "tnr_fitted": (fit.get("tnr") or {}).get(name),
                        "tpr_measured": measured.get(name, {}).get("tpr"),
                        "tnr_measured": measured.get(name, {}).get("tnr")} for name in names}
    return {"version": fit.get("version"), "rows": fit.get("rows"), "pi": fit.get("pi"),
            "pi_method": fit.get("pi_method"), "groups_measured": len(rows), "verifiers": verifiers,
            **{k: fit[k] for k in ("method", "used", "warnings") if k in fit}}


def _wmean(rows: list[dict], field: str, weight: str) -> float | None:
    """``field`` averaged over ``rows`` weighted by ``weight``, skipping rows without it."""
    pairs = [(r[field], r[weight]) for r in rows if r.get(field) is not None and r.get(weight)]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def episode_report(steps: list[dict], queues: list[dict]) -> dict | None:
    """Multi-turn episodes: the trained batches' numbers per step and in all (from the step rows),
    and the run-wide ones as the exporter last sampled them (``queues.jsonl``); None for a run
    without episodes."""
    eps = [s for s in steps if "env_reward_mean" in s]
    sampled = [q for q in queues if q.get("episodes")]
    if not eps and not sampled:
        return None
    counted = [s for s in eps if s.get("tool_calls") is not None]
    n_counted = sum(s["episodes"] for s in counted)
    calls = sum(s["tool_calls"] for s in counted)
    ok = sum(s.get("tool_calls_ok", 0) for s in counted)
    rates = [s["tool_call_rate"] for s in counted]
    rewards = [s["env_reward_mean"] for s in eps]
    trained = {
        "steps": len(eps), "episodes": sum(s.get("episodes", 0) for s in eps),
        "turns_mean": _wmean(eps, "turns_mean", "episodes"),
        "env_reward_mean": _wmean(eps, "env_reward_mean", "episodes"),
        "env_reward_first10": _mean(rewards[:10]) if rewards else None,
        "env_reward_last10": _mean(rewards[-10:]) if rewards else None,
        "tool_calls": calls, "tool_calls_ok": ok,
        "episodes_with_tool_calls": sum(s.get("episodes_with_tool_calls", 0) for s in counted),
        "tool_call_rate": sum(s.get("episodes_with_tool_calls", 0) for s in counted) / n_counted if n_counted else None,
        "tool_call_rate_first10": _mean(rates[:10]) if rates else None,
        "tool_call_rate_last10": _mean(rates[-10:]) if rates else None,
        "tool_calls_per_episode": calls / n_counted if n_counted else None,
        "tool_call_success": ok / calls if calls else None,
    }
    per_step = {"versions": [s.get("version") for s in eps], "episodes": [s.get("episodes") for s in eps],
                "tool_call_rate": [s.get("tool_call_rate") for s in eps],
                "tool_call_success": [s.get("tool_call_success") for s in eps],
                "turns_mean": [s.get("turns_mean") for s in eps], "env_reward": rewards}
    run = None
    if sampled:
        run = dict(sampled[-1]["episodes"])
        span = sampled[-1]["time"] - queues[0]["time"]
        run["episodes_per_s"] = run.get("episodes_finished", 0.0) / span if span > 0 else None
        run["sampled_at"] = sampled[-1]["time"]
    return {"trained": trained, "per_step": per_step, "run": run}


def archive_report(run_dir: Path) -> dict | None:
    """From the rollout archive (None without one): per step, the mean reward of the right and
    of the wrong completions the trainer took, and the archive's size."""
    directory = run_dir / ARCHIVE_DIR
    metas = archive_steps(directory) if directory.is_dir() else []
    if not metas:
        return None
    t = read_columns(directory, ["step", "reward", "truth"])
    by: dict[int, dict[bool, list[float]]] = {}
    for step, reward, truth in zip(t["step"], t["reward"], t["truth"]):
        by.setdefault(step, {True: [], False: []})[truth >= 0.5].append(reward)
    versions = sorted(by)
    right = [x for v in versions for x in by[v][True]]
    wrong = [x for v in versions for x in by[v][False]]
    return {**archive_size(metas), "versions": versions, "reward_right": [_mean(by[v][True]) for v in versions],
            "reward_wrong": [_mean(by[v][False]) for v in versions],
            "reward_right_mean": _mean(right), "reward_wrong_mean": _mean(wrong),
            "completions_right": len(right), "completions_wrong": len(wrong)}


def analyse(run_dir: Path) -> dict:
    """Every number and series the report shows, from the run directory's files."""
    rows = _jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in rows if r.get("kind") == "step"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    queues = _jsonl(run_dir / "queues.jsonl")
    workers = busy_spans(run_dir / "logs")

    staleness: list[int] = []
    for s in steps:
        for i, n in enumerate(s.get("staleness_hist", [])):
            staleness += [0] * (i + 1 - len(staleness))
            staleness[i] += int(n)
    consumed = sum(staleness)

    t0 = min([q["time"] for q in queues] + [sp[0] for w in workers.values() for sp in w["spans"]]
             + [r["time"] for r in rows if "time" in r], default=0.0)
    t1 = max([q["time"] for q in queues] + [sp[1] for w in workers.values() for sp in w["spans"]]
             + [r["time"] for r in rows if "time" in r], default=0.0)
    window = max(t1 - t0, 1e-9)

    streams = sorted({name for q in queues for name in q["queues"]},
                     key=lambda n: ("prompts", "rollouts", "scored", "dead").index(n)
                     if n in ("prompts", "rollouts", "scored", "dead") else 99)
    queue_stats = {}
    for name in streams:
        backlog = [q["queues"][name]["lag"] + q["queues"][name]["pending"] for q in queues if name in q["queues"]]
        length = [q["queues"][name]["length"] for q in queues if name in q["queues"]]
        queue_stats[name] = {"backlog_mean": _mean(backlog), "backlog_max": max(backlog, default=0),
                             "length_max": max(length, default=0)}

    util = {}
    for name, w in sorted(workers.items()):
        busy = sum(e - s for s, e in w["spans"])
        util[name] = {"stage": w["stage"], "batches": len(w["spans"]), "busy_seconds": busy,
                      "busy_fraction": busy / window}
    stages = {}
    for stage in STAGE_ORDER:
        ws = [u for u in util.values() if u["stage"] == stage]
        if ws:
            stages[stage] = {"workers": len(ws), "busy_fraction": sum(u["busy_fraction"] for u in ws) / len(ws)}

    later = [e["heldout_accuracy"] for e in evals if e.get("version", 0) > 0]
    return {
        "run_dir": str(run_dir),
        "steps": len(steps),
        "duration_seconds": t1 - t0 if t1 > t0 else 0.0,
        "reward": [s.get("reward_mean", float("nan")) for s in steps],
        "sample_accuracy": [s.get("sample_accuracy", float("nan")) for s in steps],
        "step_versions": [s.get("version", i + 1) for i, s in enumerate(steps)],
        "reward_first10": _mean([s["reward_mean"] for s in steps[:10] if "reward_mean" in s]),
        "reward_last10": _mean([s["reward_mean"] for s in steps[-10:] if "reward_mean" in s]),
        "sample_accuracy_first10": _mean([s["sample_accuracy"] for s in steps[:10] if "sample_accuracy" in s]),
        "sample_accuracy_last10": _mean([s["sample_accuracy"] for s in steps[-10:] if "sample_accuracy" in s]),
        "evals": [[e.get("version", 0), e["heldout_accuracy"]] for e in evals],
        "base_accuracy": evals[0]["heldout_accuracy"] if evals else float("nan"),
        "final_accuracy_mean_last3": _mean(later[-3:]),
        "staleness_hist": staleness,
        "staleness_mean": sum(i * n for i, n in enumerate(staleness)) / consumed if consumed else float("nan"),
        "groups_consumed": consumed,
        "groups_stale": sum(s.get("groups_stale", 0) for s in steps),
        "queue_samples": len(queues),
        "queues": queue_stats,
        "workers": util,
        "stages": stages,
        "evals_beside_training": _jsonl(run_dir / "evals.jsonl"),
        "label_model": label_model_fit(run_dir),
        "episodes": episode_report(steps, queues),
        "archive": archive_report(run_dir),
        "_t0": t0, "_t1": t1,
    }


def _figures(run_dir: Path, a: dict, out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    queues = _jsonl(run_dir / "queues.jsonl")
    spans = busy_spans(run_dir / "logs")
    made: dict[str, str] = {}

    def reward_accuracy(ax):
        ax.plot(a["step_versions"], a["reward"], label="reward (mean)")
        ax.plot(a["step_versions"], a["sample_accuracy"], label="sampled-answer accuracy (hidden)")
        if a["evals"]:
            ax.plot([v for v, _ in a["evals"]], [x for _, x in a["evals"]], "o-", label="held-out greedy accuracy")
        ax.set(xlabel="policy version (optimizer step)", ylabel="fraction", ylim=(0, 1), title="reward and accuracy")
        ax.legend(loc="lower right")

    def queue_depths(ax):
        for name in a["queues"]:
            pts = [(q["time"] - a["_t0"], q["queues"][name]["lag"] + q["queues"][name]["pending"])
                   for q in queues if name in q["queues"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name)
        ax.set(xlabel="seconds since start", ylabel="entries not yet acked (lag + pending)", title="queue backlog")
        if a["queues"]:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no queues.jsonl samples", ha="center", transform=ax.transAxes)

    def staleness(ax):
        hist = a["staleness_hist"]
        ax.bar(range(len(hist)), hist)
        for i, n in enumerate(hist):
            ax.annotate(str(n), (i, n), ha="center", va="bottom")
        ax.set(xlabel="staleness (trainer version - group's oldest version)", ylabel="groups consumed",
               title="staleness of consumed groups", xticks=range(len(hist)))

    def utilisation(ax):
        names = sorted(spans, key=lambda n: (STAGE_ORDER.index(spans[n]["stage"])
                                             if spans[n]["stage"] in STAGE_ORDER else 9, n))
        for i, name in enumerate(names):
            ax.broken_barh([(s - a["_t0"], e - s) for s, e in spans[name]["spans"]], (i - 0.4, 0.8))
        ax.set(yticks=range(len(names)), yticklabels=[f"{n} ({a['workers'][n]['busy_fraction']:.0%})" for n in names],
               xlabel="seconds since start", title="per-stage utilisation (busy spans, share of the run)")

    def beside(ax):
        rows = a["evals_beside_training"]
        for name in dict.fromkeys(x.get("set", "heldout") for x in rows):
            mine = [x for x in rows if x.get("set", "heldout") == name]
            versions = [x["version"] for x in mine]
            ax.plot(versions, [x["greedy_accuracy"] for x in mine], "o-", label=f"{name}: greedy")
            for k in mine[0]["pass_at_k"]:
                ax.plot(versions, [x["pass_at_k"][k] for x in mine], ".--", label=f"{name}: pass@{k}")
        ax.set(xlabel="policy version", ylabel="fraction", ylim=(0, 1), title="evaluated beside training")
        ax.legend(loc="lower right", fontsize="small")

    def episodes(ax):
        ps = a["episodes"]["per_step"]
        nan = float("nan")
        ax.plot(ps["versions"], [nan if x is None else x for x in ps["tool_call_rate"]], "o-",
                label="tool-call rate (episodes with a call)")
        ax.plot(ps["versions"], ps["env_reward"], "s-", label="environment reward (mean)")
        ax.plot(ps["versions"], [nan if x is None else x for x in ps["tool_call_success"]], ".--",
                label="tool-call success (calls answered)")
        ax.set(xlabel="policy version (optimizer step)", ylabel="fraction", ylim=(0, 1),
               title="multi-turn episodes of the trained batches")
        ax.legend(loc="lower right", fontsize="small")

    def trained_on(ax):
        ar = a["archive"]
        ax.plot(ar["versions"], ar["reward_right"], "o-", markersize=3, label="right completions (hidden truth)")
        ax.plot(ar["versions"], ar["reward_wrong"], "s-", markersize=3, label="wrong completions")
        ax.set(xlabel="policy version (optimizer step)", ylabel="mean reward", ylim=(0, 1),
               title="the reward of what the trainer trained on (rollout archive)")
        ax.legend(loc="best", fontsize="small")

    plots = {"reward_accuracy": reward_accuracy, "queues": queue_depths, "staleness": staleness,
             "utilisation": utilisation}
    if a["archive"]:
        plots["trained_on"] = trained_on
    if a["episodes"] and a["episodes"]["per_step"]["versions"]:
        plots["episodes"] = episodes
    if a["evals_beside_training"]:
        plots["beside"] = beside
    for name, draw in tqdm(plots.items(), desc="report figures", unit="fig"):
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        draw(ax)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        made[name] = str(path.relative_to(run_dir))
    return made


def _markdown(run_dir: Path, a: dict, figs: dict[str, str]) -> str:
    def f(x: float) -> str:
        return "-" if x != x else f"{x:.3f}"

    md = [f"# Report of {run_dir.name}", "",
          f"{a['steps']} training steps over {a['duration_seconds']:.0f} s.", "",
          "## Reward and accuracy", "", f"![reward and accuracy]({figs['reward_accuracy']})", "",
          f"- reward: first 10 steps {f(a['reward_first10'])}, last 10 {f(a['reward_last10'])}",
          f"- hidden accuracy of sampled answers: {f(a['sample_accuracy_first10'])} -> {f(a['sample_accuracy_last10'])}",
          f"- held-out greedy accuracy: base {f(a['base_accuracy'])}, final {f(a['final_accuracy_mean_last3'])} "
          "(mean of the last three evaluations)", "",
          "## Queues", "", f"![queue backlog]({figs['queues']})", "",
          f"{a['queue_samples']} samples of the exporter.", "",
          "| stream | mean backlog | max backlog | max length |", "|---|---|---|---|"]
    md += [f"| {n} | {q['backlog_mean']:.1f} | {q['backlog_max']} | {q['length_max']} |" for n, q in a["queues"].items()]
    md += ["", "## Staleness", "", f"![staleness]({figs['staleness']})", "",
           f"{a['groups_consumed']} groups consumed, mean staleness {f(a['staleness_mean'])} versions, "
           f"{a['groups_stale']} dropped as too stale.", "",
           "| staleness | " + " | ".join(str(i) for i in range(len(a["staleness_hist"]))) + " |",
           "|---|" + "---|" * len(a["staleness_hist"]),
           "| groups | " + " | ".join(str(n) for n in a["staleness_hist"]) + " |", "",
           "## Utilisation", "", f"![utilisation]({figs['utilisation']})", "",
           "| worker | stage | batches | busy seconds | busy share of the run |", "|---|---|---|---|---|"]
    md += [f"| {n} | {u['stage']} | {u['batches']} | {u['busy_seconds']:.1f} | {u['busy_fraction']:.1%} |"
           for n, u in a["workers"].items()]
    md += ["", "Per stage (mean over its workers): "
           + ", ".join(f"{s} {v['busy_fraction']:.1%}" for s, v in a["stages"].items()), ""]
    md += _episodes_markdown(a["episodes"], figs)
    ar = a["archive"]
    if ar:
        md += ["## What the trainer trained on", "", f"![trained on]({figs['trained_on']})", "",
               f"From the rollout archive (`archive/`: {ar['steps']} steps, {ar['bytes']:,} bytes, "
               f"{ar['bytes_per_group']:,.0f} bytes per group; docs/reproducibility.md): the mean reward of the "
               f"{ar['completions_right']} right completions {f(ar['reward_right_mean'])}, of the "
               f"{ar['completions_wrong']} wrong ones {f(ar['reward_wrong_mean'])}.", ""]
    rows = a["evals_beside_training"]
    if rows:
        ks = list(rows[0]["pass_at_k"])
        md += ["## Evaluated beside training", "", f"![evaluated beside training]({figs['beside']})", "",
               "| version | set | prompts | greedy | " + " | ".join(f"pass@{k}" for k in ks) + " | mean@n |",
               "|---" * (len(ks) + 5) + "|"]
        md += [f"| {x['version']} | {x.get('set', 'heldout')} | {x['prompts']} | {f(x['greedy_accuracy'])} | "
               + " | ".join(f(x["pass_at_k"].get(k, float("nan"))) for k in ks) + f" | {f(x['mean_at_n'])} |"
               for x in rows]
        md += [""]
    lm = a.get("label_model")
    if lm:
        how = {"given": ", held at `verifier.class_balance`", None: ""}.get(
            lm.get("pi_method"), f", estimated by `{lm.get('pi_method')}` (`verifier.pi_estimate`)")
        if lm.get("method") == "scores":
            how = (", by the label model that keeps the scores (`verifier.label_model = \"scores\"`), label-free"
                   + (f"; it used {lm['used']}" if lm.get("used", "fit") != "fit" else "")
                   + (f"; sanity warnings: {'; '.join(lm['warnings'])}" if lm.get("warnings") else ""))
        md += ["## Weak verifiers: what the label model fitted", "",
               f"The newest fit (label model version {lm['version']}, {lm['rows']} completions, estimated share "
               f"of right answers π = {lm['pi']}{how}): each verifier's TPR and TNR as Weaver estimated them without "
               f"labels, beside the same rates measured against the hidden truth on the {lm['groups_measured']} "
               "groups scored under that fit (votes 1[score ≥ threshold]).", "",
               "| verifier | in the posterior | threshold | TPR fitted | TPR measured | TNR fitted | TNR measured |",
               "|---|---|---|---|---|---|---|"]

        def g(x):
            return "-" if x is None else f"{x:.3f}"

        md += [f"| `{n}` | {'yes' if v['kept'] else 'no: ' + str(v['dropped'] or 'filtered')} | {g(v['threshold'])} | "
               f"{g(v['tpr_fitted'])} | {g(v['tpr_measured'])} | {g(v['tnr_fitted'])} | {g(v['tnr_measured'])} |"
               for n, v in lm["verifiers"].items()]
        md += [""]
    return "\n".join(md)


def _episodes_markdown(ep: dict | None, figs: dict[str, str]) -> list[str]:
    if not ep:
        return []

    def f(x, fmt="{:.3f}") -> str:
        return "-" if x is None or x != x else fmt.format(x)

    def ms(x) -> str:
        return "-" if x is None else f"{1000 * x:.1f}"

    t = ep["trained"]
    md = ["## Episodes", ""]
    if "episodes" in figs:
        md += [f"![tool-call rate and environment reward]({figs['episodes']})", ""]
    md += [f"The trained batches of {t['steps']} steps held {t['episodes']} episodes "
           "(tool-call rate: the share of episodes with at least one tool call; tool-call success: the "
           "share of tool calls the environment answered).", "",
           "| trained batches | all steps | first 10 steps | last 10 steps |", "|---|---|---|---|",
           f"| tool-call rate | {f(t['tool_call_rate'])} | {f(t['tool_call_rate_first10'])} | "
           f"{f(t['tool_call_rate_last10'])} |",
           f"| environment reward | {f(t['env_reward_mean'])} | {f(t['env_reward_first10'])} | "
           f"{f(t['env_reward_last10'])} |",
           f"| tool calls per episode | {f(t['tool_calls_per_episode'])} | | |",
           f"| tool-call success | {f(t['tool_call_success'])} ({t['tool_calls_ok']} of {t['tool_calls']}) | | |",
           f"| turns per episode | {f(t['turns_mean'])} | | |", ""]
    run = ep["run"]
    if run:
        md += ["Run-wide, every episode the generators finished (the exporter's last sample):", "",
               "| episodes (finished) | episodes/s | turns per episode | env step mean / p50 / p95 (ms) | "
               "env errors | tool calls | tool-call rate | tool-call success |", "|---|---|---|---|---|---|---|---|",
               f"| {f(run.get('episodes'), '{:.0f}')} ({f(run.get('episodes_finished'), '{:.0f}')}) | "
               f"{f(run.get('episodes_per_s'), '{:.2f}')} | {f(run.get('turns_per_episode'))} | "
               f"{ms(run.get('env_step_mean_s'))} / {ms(run.get('env_step_p50_s'))} / {ms(run.get('env_step_p95_s'))} | "
               f"{f(run.get('env_errors'), '{:.0f}')} | {f(run.get('tool_calls'), '{:.0f}')} | "
               f"{f(run.get('tool_call_rate'))} | {f(run.get('tool_call_success'))} |", ""]
    return md


def write_report(run_dir: Path) -> dict:
    """Write the figures, ``report.json`` and ``report.md`` into ``run_dir``; return the numbers and the markdown."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    if not (run_dir / "metrics.jsonl").exists() and not (run_dir / "logs").is_dir():
        raise FileNotFoundError(f"{run_dir} holds neither metrics.jsonl nor logs/: not a run directory")
    a = analyse(run_dir)
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    figs = _figures(run_dir, a, out)
    md = _markdown(run_dir, a, figs)
    (run_dir / "report.md").write_text(md)
    numbers = {k: v for k, v in a.items() if not k.startswith("_")}
    (run_dir / "report.json").write_text(json.dumps({**numbers, "figures": figs}, indent=2, default=float))
    return {**numbers, "figures": figs, "markdown": md}
