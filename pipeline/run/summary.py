"""The summary of a ``pipeline up`` run (``write_summary``): ``<run_dir>/summary.json`` and
``summary.md``, from the run's metrics file (``metrics.jsonl``), its evaluations beside
training (``evals.jsonl``), its Redis counters and the accounting of every prompt."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.bus.stats import read_stats
from pipeline.config import RunConfig
from pipeline.consumers.evaluator import read_evals
from pipeline.common.archive import ARCHIVE_DIR, size, steps
from pipeline.observe.metrics import episode_summary
from pipeline.verifiers.base import verifier_costs


def _by_dataset_lines(by_dataset: dict[int, dict[str, float]]) -> list[str]:
    """The summary line of each source's held-out accuracy, first -> last evaluation (none without sources)."""
    if not by_dataset:
        return []
    first, last = by_dataset[min(by_dataset)], by_dataset[max(by_dataset)]
    return ["- held-out accuracy per dataset, first -> last evaluation: "
            + ", ".join(f"{name} {first.get(name, float('nan')):.3f} -> {acc:.3f}" for name, acc in last.items())]


def _resume_lines(seconds: list[float]) -> list[str]:
    """The summary line of the trainer's resumes (death -> next committed step), when it died."""
    if not seconds:
        return []
    ordered = sorted(seconds)
    return [f"- trainer resumed {len(seconds)} time(s) after dying: death -> next committed step median "
            f"{ordered[len(ordered) // 2]:.1f} s, longest {ordered[-1]:.1f} s"]


def _beside_lines(rows: list[dict]) -> list[str]:
    """The eval worker's results (``cluster.evaluators``) as a table, one row per version."""
    if not rows:
        return []
    ks = list(rows[0]["pass_at_k"])
    out = ["", f"## Evaluated beside training (up to {max(x['prompts'] for x in rows)} held-out prompts per set, "
               f"n = {rows[0]['n']}, T = {rows[0]['temperature']:g}; `evals.jsonl`)", "",
           "| version | set | prompts | greedy | " + " | ".join(f"pass@{k}" for k in ks)
           + f" | mean@{rows[0]['n']} | seconds |",
           "|---" * (len(ks) + 6) + "|"]
    for x in rows:
        out.append(f"| {x['version']} | {x.get('set', 'heldout')} | {x['prompts']} | {x['greedy_accuracy']:.3f} | "
                   + " | ".join(f"{x['pass_at_k'].get(k, float('nan')):.3f}" for k in ks)
                   + f" | {x['mean_at_n']:.3f} | {x['seconds']:.1f} |")
    return out


def _verifier_lines(costs: dict[str, dict]) -> list[str]:
    """The summary's line of the weak verifiers: each one run, with its seconds per completion
    (``verifiers.base.verifier_costs``), and those never run."""
    ran = [f"`{n}` {c['seconds_per_completion']:.4g} s ({c['completions']:,} completions)"
           for n, c in costs.items() if c["completions"]]
    idle = [f"`{n}`" for n, c in costs.items() if not c["completions"]]
    out = [f"- verifiers run, seconds per completion: {', '.join(ran) if ran else 'none'}"]
    if idle:
        out.append(f"- verifiers not run (the reward reads none of their votes; verifier.monitor_share runs "
                   f"them on a share of the groups): {', '.join(idle)}")
    return out


def write_summary(cfg: RunConfig, r, keys, accounting: dict, base_info: dict, **extra) -> dict:
    """Write ``summary.json`` and ``summary.md`` from the run's metrics file and Redis counters."""
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (cfg.run_dir / "metrics.jsonl").exists() else []
    # A trainer resumed from a checkpoint redoes the steps after it: the last row per version counts.
    steps = sorted({x["version"]: x for x in rows if x["kind"] == "step"}.values(), key=lambda x: x["version"])
    # A step's row is written before its commit; a row past the last committed step (the trainer
    # died in between, or the run stopped) is of a step that never happened.
    committed = int(r.hget(keys.trainer, "committed_version") or 0)
    lost = len(json.loads(r.hget(keys.trainer, "lost_versions") or "[]"))
    steps = [x for x in steps if x["version"] <= committed]
    evals = sorted({x["version"]: x for x in rows if x["kind"] == "eval"}.values(), key=lambda x: x["version"])
    stats = read_stats(r, keys)
    base = evals[0]["heldout_accuracy"] if evals else float("nan")
    last3 = [e["heldout_accuracy"] for e in evals[1:]][-3:]
    final = sum(last3) / len(last3) if last3 else float("nan")

    def window_mean(key: str, part: slice) -> float:
        vals = [s[key] for s in steps[part] if key in s]
        return sum(vals) / len(vals) if vals else float("nan")

    wait = sum(s.get("wait_seconds", 0) for s in steps)
    busy = sum(s.get("step_seconds", 0) for s in steps)
    gen_tokens = stats.get("tokens_generated_total", 0)
    summary = {
        "run_id": cfg.run_id, **extra,
        "reward_mode": cfg.verifier.reward, "max_staleness": cfg.trainer.max_staleness,
        "steps": committed, "versions_lost_in_crashes": lost, "base_accuracy": base,
        "final_accuracy_mean_last3": final,
        "improvement_points": 100 * (final - base),
        "heldout_size": cfg.task.heldout_size, "evals": {e["version"]: e["heldout_accuracy"] for e in evals},
        "pretrain": base_info,
        "reward_first10": window_mean("reward_mean", slice(0, 10)), "reward_last10": window_mean("reward_mean", slice(-10, None)),
        "sample_accuracy_first10": window_mean("sample_accuracy", slice(0, 10)),
        "sample_accuracy_last10": window_mean("sample_accuracy", slice(-10, None)),
        "tokens_generated": gen_tokens, "tokens_trained": stats.get("tokens_trained_total", 0),
        "goodput": stats.get("tokens_trained_total", 0) / gen_tokens if gen_tokens else 0.0,
        "trainer_idle_fraction": wait / (wait + busy) if wait + busy else 0.0,
        "weights_payload": (r.hget(keys.trainer, "payload") or b"full").decode(),
        "weights_payload_bytes": int(r.hget(keys.trainer, "payload_bytes") or 0),
        "accounting": accounting,
        **archive_size(cfg.run_dir / ARCHIVE_DIR),
    }

    beside = read_evals(cfg.run_dir)
    if beside:
        summary["evals_beside_training"] = beside
    by_dataset = {e["version"]: e["heldout_by_dataset"] for e in evals if e.get("heldout_by_dataset")}
    if by_dataset:  # a task of several sources (reasoning_gym): each one's held-out accuracy
        summary["evals_by_dataset"] = by_dataset

    episodes = episode_summary(stats)
    if episodes:  # multi-turn episodes: the run-wide numbers (docs/observing.md, "Episodes")
        summary["episodes"] = episodes

    summary["verifiers"] = verifier_costs(stats, cfg.verifier.verifiers)  # which ran, and their cost
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    a = accounting
    md = [
        f"# Run {cfg.run_id}", "",
        f"- status: {summary['status']}; {summary['steps']} steps in {summary['wall_seconds']:.0f} s; reward `{cfg.verifier.reward}`, η = {cfg.trainer.max_staleness}",
        f"- held-out greedy accuracy ({evals[-1].get('n', cfg.task.heldout_size) if evals else cfg.task.heldout_size} "
        f"problems): base {base:.3f} -> final {final:.3f} "
        f"(mean of the last three evaluations), {summary['improvement_points']:+.1f} points",
        *_by_dataset_lines(by_dataset),
        f"- reward: first 10 steps {summary['reward_first10']:.3f}, last 10 {summary['reward_last10']:.3f}; "
        f"hidden accuracy of sampled answers: {summary['sample_accuracy_first10']:.3f} -> {summary['sample_accuracy_last10']:.3f}",
        f"- goodput (tokens trained / generated): {summary['goodput']:.3f}; trainer idle {summary['trainer_idle_fraction']:.1%}; worker restarts {summary['restarts']}",
        *_resume_lines(summary.get("trainer_resume_seconds") or []),
        *([f"- {lost} version(s) lost in trainer crashes: published after the trainer's last checkpoint, their "
           f"model died with it and the checkpoint's went on as the next version, so the final model has "
           f"{committed - lost} updates behind it, not {committed} (`trainer.checkpoint_every 1` loses none)"]
          if lost else []),
        *([f"- resumed {summary['driver_resumes']} time(s) with `pipeline up --resume` (resumes.jsonl): "
           f"{summary.get('wall_seconds_total', summary['wall_seconds']):.0f} s over all its drivers"
           + (f" (at least: {summary['drivers_wall_unknown']} of them left no record of how long they ran)"
              if summary.get("drivers_wall_unknown") else "")
           + "; the time on the status line is the last driver's"] if summary.get("driver_resumes") else []),
        f"- weights per version: {summary['weights_payload_bytes']:,} bytes (weights.payload {summary['weights_payload']})",
        *([f"- rollout archive: {summary['archive_steps']} steps, {summary['archive_bytes']:,} bytes, "
           f"{summary['archive_bytes_per_group']:,.0f} bytes per group (archive/, docs/reproducibility.md)"]
          if summary.get("archive_steps") else []),
        *_beside_lines(beside),
        *_verifier_lines(summary["verifiers"]),
        "", "## Accounting", "",
        "| issued | trained | no signal | stale | dead-lettered | in flight at stop | lost | unexpected | duplicates skipped |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {a['issued']} | {a['trained']} | {a['nosignal']} | {a['stale']} | {a['dead_lettered']} | "
        f"{sum(a['in_flight'].values())} {a['in_flight']} | {a['lost']} | {a['unexpected']} | {a['duplicates_skipped']} |",
        "", f"Counts add up: {a['adds_up']}; every trained group trained once: {a['trained_once']}; accounting ok: {a['ok']}", "",
    ]
    (cfg.run_dir / "summary.md").write_text("\n".join(md))
    return summary


def archive_size(directory: Path) -> dict:
    """The rollout archive's steps, bytes and bytes per group ({} without one)."""
    metas = steps(directory) if directory.is_dir() else []
    return {f"archive_{k}": v for k, v in size(metas).items()} if metas else {}
