"""Benchmark of the verifier stage: how well each way of combining weak verifiers selects
and how well it is calibrated, on synthetic votes with known truth and on real rollouts of
the base model; and how fast the label model fits and scores.

    make bench-verifier                       # or: python bench/bench_verifier.py [--quick]

Methods (each gives one score per response; selection picks the top score per group):

- ``first_sample``: the first response of each group (no verification at all);
- ``majority``: the frequency of the response's answer within its group;
- ``best_single``: the single verifier with the best selection accuracy, picked *with the
  labels* (an optimistic baseline: nobody knows the best verifier in advance);
- ``average``: the plain mean of the verifiers' normalised scores (reward mode ``average``);
- ``dawid_skene``: EM on the binarised votes (one TPR/TNR per verifier), its posterior;
- ``weaver``: the label model of ``pipeline.algo.labelmodel`` (drop and merge policies);
- ``logistic``: logistic regression *trained on labels* of a separate split (upper bound
  of what any aggregation of these votes can do);
- ``oracle_rates``: Weaver's posterior over the same kept verifiers with TPR/TNR/π
  measured *with the truth*: the selection lost to label-free rate estimation is
  oracle_rates − weaver;
- on real rollouts also ``weaver_no_majority``: Weaver without the majority
  pseudo-verifier, whose votes are not conditionally independent of the others
  (it is computed from the whole group); and ``weaver_sound``: Weaver with the rule
  checks' TPR held at 1 (they are sound by construction; ``verifier.sound_checks``,
  the pipeline's default), where ``weaver`` estimates every rate.

Metrics: selection accuracy (ties in expectation), ECE (10 bins) and Brier score of the
probabilistic methods, and the mean absolute error of each label model's TPR/TNR against
the rates measured with the truth. Label-free methods are fitted on the evaluation rows
(they never see labels); the logistic regression is trained on the other half.

Speed: fit time on 100k rows × 10 verifiers against plain EM (the Dawid–Skene step alone),
and posterior throughput against a numpy majority vote over the same votes, in the same run.

Writes bench/results/verifier.json and bench/results/verifier.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

ROOT = Path(__file__).resolve().parent.parent

from pipeline.algo.labelmodel import MU_CLIP, _em, fit_label_model
from pipeline.algo.selection import brier, ece, pass_at_g, selection_accuracy
from pipeline.verifiers.base import SOUND

RESULTS = ROOT / "bench" / "results"
T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ================================================================ synthetic votes
@dataclass(frozen=True, kw_only=True)
class Scenario:
    """Votes with known truth. Verifiers are conditionally independent given correctness,
    except ``pair``: verifier ``pair[1]`` copies ``pair[0]`` with each vote flipped with
    probability ``flip`` (a correlated pair)."""

    name: str
    pi: float
    """Mean P(correct) of a response; each prompt draws its own from Beta with this mean."""
    tpr: tuple[float, ...] = (0.60, 0.70, 0.85, 0.75, 0.65, 0.80)
    tnr: tuple[float, ...] = (0.70, 0.60, 0.80, 0.85, 0.75, 0.65)
    groups: int = 4000
    group_size: int = 8
    pair: tuple[int, int] | None = None
    flip: float = 0.0
    abstain: float = 0.05
    """Share of votes missing at random (NaN)."""
    seed: int = 0


SCENARIOS = [
    Scenario(name="independent", pi=0.4),
    Scenario(name="correlated pair", pi=0.4, tpr=(0.60, 0.70, 0.85, 0.75, 0.65, 0.80, 0.85),
             tnr=(0.70, 0.60, 0.80, 0.85, 0.75, 0.65, 0.80), pair=(2, 6), flip=0.02, seed=1),
    Scenario(name="low pi", pi=0.1, seed=2),
    Scenario(name="high pi", pi=0.85, seed=3),
    Scenario(name="small groups", pi=0.4, group_size=4, groups=8000, seed=4),
]


def synthesize(sc: Scenario) -> dict:
    """Truth [n, G], answers [n, G] (0 = the correct one), votes [n, G, m] (NaN = abstain)."""
    rng = np.random.default_rng(sc.seed)
    n, g, m = sc.groups, sc.group_size, len(sc.tpr)
    conc = 4.0
    p = rng.beta(conc * sc.pi, conc * (1 - sc.pi), size=(n, 1))
    y = (rng.random((n, g)) < p).astype(np.float64)
    # Wrong answers repeat (a policy has favourite mistakes): three per prompt, skewed.
    wrong = 1 + rng.choice(3, size=(n, g), p=[0.6, 0.25, 0.15])
    answers = np.where(y == 1, 0, wrong)
    tpr, tnr = np.array(sc.tpr), np.array(sc.tnr)
    p_one = np.where(y[..., None] == 1, tpr, 1 - tnr)
    votes = (rng.random((n, g, m)) < p_one).astype(np.float64)
    if sc.pair is not None:
        a, b = sc.pair
        flips = rng.random((n, g)) < sc.flip
        votes[..., b] = np.where(flips, 1 - votes[..., a], votes[..., a])
    votes[rng.random(votes.shape) < sc.abstain] = np.nan
    return {"truth": y, "answers": answers, "votes": votes, "names": [f"v{j}" for j in range(m)]}


# ===================================================================== methods
def answer_frequency(answers: np.ndarray) -> np.ndarray:
    """[n, G]: how many responses of the group share each response's answer (None never counts)."""
    out = np.zeros(answers.shape, dtype=np.float64)
    for i, row in enumerate(answers):
        counts = Counter(a for a in row.tolist() if a is not None)
        out[i] = [counts[a] if a is not None else 0 for a in row.tolist()]
    return out


def posterior_from(b: np.ndarray, tpr: np.ndarray, tnr: np.ndarray, pi: float) -> np.ndarray:
    """§5 step 7 posterior of binarised votes [N, k] (NaN = abstain) under rates (clipped like Weaver's)."""
    tpr, tnr = np.clip(tpr, *MU_CLIP), np.clip(tnr, *MU_CLIP)
    pi = float(np.clip(pi, *MU_CLIP))
    w1 = np.log(tpr) - np.log(1 - tnr)
    w0 = np.log(1 - tpr) - np.log(tnr)
    logit = np.log(pi / (1 - pi)) + np.where(b == 1, w1, np.where(b == 0, w0, 0.0)).sum(axis=1)
    return 1 / (1 + np.exp(-logit))


def features(b: np.ndarray) -> np.ndarray:
    """One-hot votes [N, 2k] (vote 1, vote 0; an abstention is neither) plus an intercept."""
    return np.column_stack([(b == 1).astype(float), (b == 0).astype(float), np.ones(len(b))])


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-3) -> np.ndarray:
    def loss(w: np.ndarray) -> tuple[float, np.ndarray]:
        z = x @ w
        p = 1 / (1 + np.exp(-z))
        f = np.mean(np.logaddexp(0, z) - y * z) + 0.5 * l2 * (w[:-1] @ w[:-1])
        g = x.T @ (p - y) / len(y)
        g[:-1] += l2 * w[:-1]
        return float(f), g

    return minimize(loss, np.zeros(x.shape[1]), jac=True, method="L-BFGS-B").x


def rate_errors(b: np.ndarray, y: np.ndarray, tpr: np.ndarray, tnr: np.ndarray) -> dict[str, float]:
    """Mean |TPR − true TPR| and |TNR − true TNR| over the columns of binarised votes ``b``."""
    e_tpr, e_tnr = [], []
    for j in range(b.shape[1]):
        voted = ~np.isnan(b[:, j])
        pos, neg = voted & (y == 1), voted & (y == 0)
        if pos.sum() and neg.sum() and np.isfinite(tpr[j]):
            e_tpr.append(abs(tpr[j] - b[pos, j].mean()))
            e_tnr.append(abs(tnr[j] - (1 - b[neg, j].mean())))
    return {"tpr_mae": float(np.mean(e_tpr)), "tnr_mae": float(np.mean(e_tnr))}


def compare(train: dict, test: dict) -> dict:
    """Every method on ``test`` (logistic trained on ``train``): selection, calibration, rate errors."""
    y, votes, names = test["truth"], test["votes"], test["names"]
    n, g, m = votes.shape
    flat, yf = votes.reshape(n * g, m), y.reshape(-1)
    scores: dict[str, np.ndarray] = {}
    probs: dict[str, np.ndarray] = {}
    fits: dict[str, dict] = {}

    first = np.zeros((n, g))
    first[:, 0] = 1.0
    scores["first_sample"] = first
    scores["majority"] = answer_frequency(test["answers"])
    singles = {nm: selection_accuracy(np.nan_to_num(votes[..., j], nan=-1.0), y) for j, nm in enumerate(names)}
    best = max(singles, key=singles.get)
    scores["best_single"] = np.nan_to_num(votes[..., names.index(best)], nan=-1.0)
    avg = np.nanmean(np.where(np.isnan(flat).all(axis=1, keepdims=True), 0.0, flat), axis=1)
    scores["average"] = avg.reshape(n, g)
    probs["average"] = avg

    for policy in ("drop", "merge"):
        lm = fit_label_model(flat, names, dependence=policy)
        key = "weaver" if policy == "drop" else "weaver_merge"
        post = lm.posterior(flat)
        scores[key], probs[key] = post.reshape(n, g), post
        b = lm.binarize(flat)
        kept = np.array(lm.kept)
        fits[key] = {**rate_errors(b[:, kept], yf, np.array(lm.tpr)[kept], np.array(lm.tnr)[kept]),
                     "pi": lm.pi, "true_pi": float(yf.mean()), "dropped": lm.dropped,
                     "merged": {k: list(v) for k, v in lm.merged.items()}}
        if policy == "drop":
            b_all = b  # Weaver's binarisation, shared by Dawid–Skene and the logistic regression

    tpr, tnr, pi, _, _ = _em(b_all)
    post = posterior_from(b_all, tpr, tnr, pi)
    scores["dawid_skene"], probs["dawid_skene"] = post.reshape(n, g), post
    fits["dawid_skene"] = {**rate_errors(b_all, yf, tpr, tnr), "pi": pi, "true_pi": float(yf.mean())}

    lm = fit_label_model(flat, names)
    kept = np.array(lm.kept)
    bk = b_all[:, kept]
    true_tpr = np.array([np.nanmean(bk[(yf == 1) & ~np.isnan(bk[:, j]), j]) for j in range(bk.shape[1])])
    true_tnr = np.array([1 - np.nanmean(bk[(yf == 0) & ~np.isnan(bk[:, j]), j]) for j in range(bk.shape[1])])
    post = posterior_from(bk, true_tpr, true_tnr, float(yf.mean()))
    scores["oracle_rates"], probs["oracle_rates"] = post.reshape(n, g), post

    if "majority" in names:
        others = [nm for nm in names if nm != "majority"]
        cols = [names.index(nm) for nm in others]
        post = fit_label_model(flat[:, cols], others).posterior(flat[:, cols])
        scores["weaver_no_majority"], probs["weaver_no_majority"] = post.reshape(n, g), post

    sound = [nm for nm in names if nm in SOUND]
    if sound:
        # The pipeline's default: the rule checks' TPR held at 1 (verifier.sound_checks).
        lm = fit_label_model(flat, names, sound=sound)
        post = lm.posterior(flat)
        scores["weaver_sound"], probs["weaver_sound"] = post.reshape(n, g), post
        kept = np.array(lm.kept)
        fits["weaver_sound"] = {**rate_errors(lm.binarize(flat)[:, kept], yf, np.array(lm.tpr)[kept],
                                              np.array(lm.tnr)[kept]),
                                "pi": lm.pi, "true_pi": float(yf.mean()), "dropped": lm.dropped}

    lm_train = fit_label_model(train["votes"].reshape(-1, m), names)
    w = fit_logistic(features(lm_train.binarize(train["votes"].reshape(-1, m))), train["truth"].reshape(-1))
    post = 1 / (1 + np.exp(-(features(b_all) @ w)))
    scores["logistic"], probs["logistic"] = post.reshape(n, g), post

    return {
        "rows": int(n * g), "groups": int(n), "group_size": int(g), "verifiers": names, "pi": float(yf.mean()),
        "pass_at_g": pass_at_g(y), "best_single_name": best, "single": singles,
        "selection": {k: selection_accuracy(s, y) for k, s in scores.items()},
        "calibration": {k: {"ece": ece(p, yf), "brier": brier(p, yf)} for k, p in probs.items()},
        "rates": fits,
    }


def split(data: dict) -> tuple[dict, dict]:
    half = data["truth"].shape[0] // 2
    pick = lambda sl: {k: (v[sl] if isinstance(v, np.ndarray) else v) for k, v in data.items()}  # noqa: E731
    return pick(slice(0, half)), pick(slice(half, None))


# ================================================================ real rollouts
def real_rollouts(*, base_dir: str, prompts: int, group_size: int, seed: int) -> dict:
    """Sample ``group_size`` completions per prompt from the base model; score with the default verifiers."""
    import torch

    from pipeline.tasks import arithmetic as task
    from pipeline.model.qwen import encode_prompts, load_checkpoint, sample
    from pipeline.tasks.arithmetic import correctness
    from pipeline.verifiers.registry import DEFAULT_VERIFIERS, Scorer

    torch.set_num_threads(1)
    model, tok = load_checkpoint(base_dir)
    meta = json.loads((Path(base_dir) / "pretrain.json").read_text())
    digits, ops = int(meta["digits"]), tuple(meta["ops"])
    rng = random.Random(seed)
    problems = [task.random_problem(rng, digits=digits, ops=ops) for _ in range(prompts)]
    gen = torch.Generator().manual_seed(seed)
    scorer = Scorer(list(DEFAULT_VERIFIERS))
    votes, truth, answers = [], [], []
    batch = 64
    max_new = task.answer_max_length(digits, ops) + 1
    for start in range(0, prompts, batch):
        chunk = problems[start:start + batch]
        ids = encode_prompts(tok, [p.prompt for p in chunk]).repeat_interleave(group_size, dim=0)
        tokens, _, _ = sample(model, ids, max_new_tokens=max_new, temperature=1.0, eos_id=tok.eos_id,
                              pad_id=tok.pad_id, generator=gen)
        texts = [tok.decode(row) for row in tokens.tolist()]
        for i, p in enumerate(chunk):
            comps = texts[i * group_size:(i + 1) * group_size]
            v, _ = scorer.score(p.prompt, comps)
            votes.append(v.astype(np.float64))
            truth.append(correctness(p.answer, comps).astype(np.float64))
            answers.append([task.extract_answer(c) for c in comps])
        if (start // batch) % 4 == 0:
            say(f"  real rollouts: {min(start + batch, prompts)}/{prompts} prompts sampled and scored")
    ans = np.empty((prompts, group_size), dtype=object)
    ans[:] = answers
    return {"truth": np.stack(truth), "answers": ans, "votes": np.stack(votes), "names": list(DEFAULT_VERIFIERS),
            "abstained": {n: st.abstained for n, st in scorer.stats.items()}}


# ======================================================================= speed
def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def speed(rows: int, m: int, repeat: int) -> dict:
    rng = np.random.default_rng(7)
    y = rng.random(rows) < 0.4
    tpr, tnr = rng.uniform(0.6, 0.85, m), rng.uniform(0.6, 0.85, m)
    votes = (rng.random((rows, m)) < np.where(y[:, None], tpr, 1 - tnr)).astype(np.float64)
    votes[rng.random(votes.shape) < 0.05] = np.nan
    names = [f"v{j}" for j in range(m)]
    fit_s = timed(lambda: fit_label_model(votes, names), repeat)
    em_s = timed(lambda: _em(votes), repeat)
    lm = fit_label_model(votes, names)
    post_s = timed(lambda: lm.posterior(votes), repeat)
    mv_s = timed(lambda: (np.nanmean(votes, axis=1) > 0.5), repeat)
    return {"rows": rows, "verifiers": m, "fit_seconds": fit_s, "plain_em_seconds": em_s,
            "fit_vs_plain_em": fit_s / em_s, "posterior_rows_per_s": rows / post_s,
            "majority_vote_rows_per_s": rows / mv_s, "posterior_vs_majority_vote": mv_s / post_s}


# ===================================================================== report
METHODS = ["first_sample", "majority", "best_single", "average", "dawid_skene", "weaver", "weaver_merge",
           "weaver_no_majority", "weaver_sound", "oracle_rates", "logistic"]
PROB = ["average", "dawid_skene", "weaver", "weaver_merge", "weaver_no_majority", "weaver_sound", "oracle_rates",
        "logistic"]


def markdown(res: dict) -> str:
    out = ["# Verifier benchmark", "", f"`{res['command']}` — {res['seconds']:.0f} s on this machine.", ""]
    out += ["## Selection accuracy (top-scored response per group is correct)", "",
            "| data | π | pass@G | " + " | ".join(METHODS) + " |",
            "|---|---|---|" + "---|" * len(METHODS)]
    for name, r in res["data"].items():
        cells = [f"{r['selection'][k]:.3f}" if k in r["selection"] else "—" for k in METHODS]
        out.append(f"| {name} | {r['pi']:.2f} | {r['pass_at_g']:.3f} | " + " | ".join(cells) + " |")
    out += ["", "best_single is picked with the labels (optimistic); logistic is trained on labels "
            "of a separate split (upper bound).", "",
            "## Calibration (ECE, 10 bins / Brier)", "", "| data | " + " | ".join(PROB) + " |",
            "|---|" + "---|" * len(PROB)]
    for name, r in res["data"].items():
        cells = [f"{r['calibration'][k]['ece']:.3f} / {r['calibration'][k]['brier']:.3f}" if k in r["calibration"]
                 else "—" for k in PROB]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += ["", "`average` is not a probability; it is listed to show what an uncalibrated score looks like.", "",
            "## Label-model rates against the truth (mean |error| of TPR / TNR; π estimated vs true)", "",
            "| data | dawid_skene | weaver | weaver_merge | dropped (weaver) |", "|---|---|---|---|---|"]
    for name, r in res["data"].items():
        f = r["rates"]
        cell = lambda k: f"{f[k]['tpr_mae']:.3f} / {f[k]['tnr_mae']:.3f}; π {f[k]['pi']:.2f} vs {f[k]['true_pi']:.2f}"  # noqa: E731
        out.append(f"| {name} | {cell('dawid_skene')} | {cell('weaver')} | {cell('weaver_merge')} | "
                   f"{', '.join(f['weaver']['dropped']) or '—'} |")
    s = res["speed"]
    out += ["", "## Speed", "",
            f"- fit, {s['rows']:,} rows × {s['verifiers']} verifiers: {s['fit_seconds']:.3f} s "
            f"({s['fit_vs_plain_em']:.2f}× plain EM's {s['plain_em_seconds']:.3f} s, same run)",
            f"- posterior: {s['posterior_rows_per_s']:,.0f} rows/s ({s['posterior_vs_majority_vote']:.2f}× a numpy "
            f"majority vote's {s['majority_vote_rows_per_s']:,.0f} rows/s, same run)", "",
            "## The bar", ""]
    for line in res["bar"]["lines"]:
        out.append(f"- {line}")
    return "\n".join(out) + "\n"


def check_bar(res: dict) -> dict:
    r = res["data"]["synthetic: independent"]
    sel, cal = r["selection"], r["calibration"]["weaver"]
    checks = {
        "beats majority vote": sel["weaver"] > sel["majority"],
        "beats the best single verifier": sel["weaver"] > sel["best_single"],
        "ECE <= 0.05": cal["ece"] <= 0.05,
    }
    lines = [f"independent synthetic verifiers: Weaver {sel['weaver']:.3f} vs majority {sel['majority']:.3f} and "
             f"best single {sel['best_single']:.3f}; ECE {cal['ece']:.3f}: "
             + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in checks.items())]
    return {"passed": all(checks.values()), "checks": checks, "lines": lines}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller data and speed test (a smoke run)")
    ap.add_argument("--prompts", type=int, default=1000, help="prompts of real rollouts (G completions each)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--base-dir", default=str(ROOT / "artifacts" / "base-model"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    res: dict = {"command": "python bench/bench_verifier.py" + (" --quick" if args.quick else ""), "data": {}}
    for sc in SCENARIOS:
        if args.quick:
            sc = Scenario(**{**asdict(sc), "groups": sc.groups // 4})
        say(f"synthetic '{sc.name}': {sc.groups} groups × {sc.group_size}, π={sc.pi}, {len(sc.tpr)} verifiers")
        data = synthesize(sc)
        train, test = split(data)
        r = compare(train, test)
        r["scenario"] = {k: v for k, v in asdict(sc).items()}
        res["data"][f"synthetic: {sc.name}"] = r
        say("  selection: " + ", ".join(f"{k} {v:.3f}" for k, v in r["selection"].items())
            + f"; weaver ECE {r['calibration']['weaver']['ece']:.3f}")
    if Path(args.base_dir, "model.safetensors").is_file():
        prompts = args.prompts // 4 if args.quick else args.prompts
        say(f"real rollouts: {prompts} prompts × {args.group_size} from {args.base_dir}")
        data = real_rollouts(base_dir=args.base_dir, prompts=prompts, group_size=args.group_size, seed=args.seed)
        first, second = split(data)
        # Both folds: each half is once the (unlabeled) evaluation window and once the
        # logistic regression's training set, which shows how much the label-free fit
        # moves between two windows of the same policy.
        for fold, (train, test) in enumerate([(first, second), (second, first)], start=1):
            r = compare(train, test)
            r["abstained"] = data["abstained"]
            res["data"][f"real rollouts, fold {fold}"] = r
            say(f"  fold {fold} selection: " + ", ".join(f"{k} {v:.3f}" for k, v in r["selection"].items())
                + f"; weaver ECE {r['calibration']['weaver']['ece']:.3f}")
    else:
        say(f"no base model in {args.base_dir}: skipping real rollouts (run `pipeline pretrain`)")
    rows = 20_000 if args.quick else 100_000
    say(f"speed: fit and posterior on {rows:,} rows × 10 verifiers")
    res["speed"] = speed(rows, 10, repeat=2 if args.quick else 3)
    say(f"  fit {res['speed']['fit_seconds']:.3f} s ({res['speed']['fit_vs_plain_em']:.2f}× plain EM); posterior "
        f"{res['speed']['posterior_rows_per_s']:,.0f} rows/s ({res['speed']['posterior_vs_majority_vote']:.2f}× majority vote)")
    res["bar"] = check_bar(res)
    res["seconds"] = time.perf_counter() - T0
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "verifier.json").write_text(json.dumps(res, indent=2, default=float) + "\n")
    (RESULTS / "verifier.md").write_text(markdown(res))
    say(f"wrote {RESULTS / 'verifier.json'} and verifier.md")
    for line in res["bar"]["lines"]:
        print(line)
    return 0 if res["bar"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
