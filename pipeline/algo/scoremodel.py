"""A label model that keeps the scores: class-conditional level tables per verifier (docs/design.md §5).

The Weaver label model (``pipeline.algo.labelmodel``) binarises every score at a threshold
that depends on π, which throws away the ranking a good judge has and ties π to the
thresholds. This one keeps each verifier's scores as ``LEVELS`` ordered levels and learns
P(level | Y) for each:

1. **Levels.** Each column's finite scores are cut at their own quantiles into at most
   ``LEVELS`` levels (a column of two values keeps two). An abstention (NaN) is missing:
   it leaves the row's likelihood unchanged.
2. **Same-model judges count once.** Judges that ask one model (``lm_judge:<dir>@<style>``,
   one ``<dir>`` or endpoint) share their errors, and a naive product would count them k
   times; each of a family of k enters the posterior with weight 1/k (a tempered product).
3. **EM** on the latent class model (one P(level | Y) table per verifier, Laplace-smoothed,
   π), started from each row's mean rank: the "verifiers are better than random on
   average" start. A sound verifier (a right answer always passes it) has its lowest
   level held impossible for a right answer.
4. **Anchor.** y = 1 is the component the verifiers favour: when the weighted mean over
   verifiers of E[level | Y = 1] − E[level | Y = 0] is negative after EM, the two
   components are swapped (π → 1 − π). EM's labels are otherwise arbitrary, and a
   minority of right answers is exactly where a start can land on the wrong side.
5. **Labels** (optional: a few completions of training prompts with their truth): their
   rows' responsibilities are held at their truth through EM, so they pull π and every table
   towards what they show (π is estimated over all rows with those held: on 32 labels the
   labelled share alone is a coarser estimate, its standard error 0.07 at π = 0.2, and
   is reported beside). A guard then weighs the fit against simple rules: "the mean rank
   of the k verifiers with the highest AUC on the labels" for k in ``TOP_K`` (k = 1 is the
   best single verifier). With a handful of positives among the labels (8 in 128 at
   π = 0.06) the labels' own ranking of verifiers is noisy, so each is scored by its AUC out
   of bag over ``BOOTSTRAP`` resamples of the labels, the top k chosen afresh on each
   resample: a rule is scored as it would be used, not on the labels that picked it. The
   highest mean wins (ties to fewer verifiers). A rule that wins keeps the raw scores' order
   (each score's quantile in its column, no levels, so a judge's fine ranking survives),
   calibrated on the labels by a logistic fit on the mean quantile's logit (Platt's smoothed
   targets, a ridge towards slope 1); π is then its mean posterior over all rows
   (``ScoreModel.used`` says which: ``fit``, ``single:<name>`` or ``rank-mean:<names>``).
6. **Sanity** (label-free): EM converged; π is not at an edge; most verifiers favour the
   component called right; and the classes explain part of the agreement between verifiers
   of different families (their level correlation within a class is below the overall one,
   as conditional independence says). ``ScoreModel.warnings`` lists what failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

LABEL_MODELS = ("weaver", "scores")
"""What ``verifier.label_model`` chooses: ``pipeline.algo.labelmodel``'s model, or this one."""
LEVELS = 5
"""Most levels a column's scores are cut into."""
SMOOTHING = 1.0
"""Laplace pseudo-count per level and class."""
MAX_ITER = 300
TOL = 1e-5
"""EM stops when no responsibility moves more than this."""
TOP_K = (1, 2, 3)
"""The guard's alternatives to the fit: the mean rank of the k verifiers with the highest AUC on the labels."""
BOOTSTRAP = 200
"""Resamples of the labels over which the guard compares the fit and the alternatives (out of bag)."""
GRID = 101
"""Quantiles of a column kept to rank its scores (the alternatives' ranks on new rows)."""


def family(name: str) -> str:
    """The model a judge asks (``lm_judge:<dir>@<style>`` -> ``lm_judge:<dir>``); other verifiers are their own."""
    if name.startswith("lm_judge:") and "@" in name:
        return name.rsplit("@", 1)[0]
    return name


def _cuts(col: np.ndarray) -> np.ndarray:
    x = col[np.isfinite(col)]
    if x.size == 0:
        return np.array([])
    values = np.unique(x)
    if values.size <= LEVELS:
        return (values[:-1] + values[1:]) / 2
    qs = np.quantile(x, np.arange(1, LEVELS) / LEVELS)
    return np.unique(qs)


def _level(col: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    out = np.searchsorted(cuts, col, side="right").astype(np.int64)
    out[~np.isfinite(col)] = -1
    return out


def _auc(s: np.ndarray, y: np.ndarray) -> float:
    s = np.where(np.isfinite(s), s, -np.inf)
    pos, neg = s[y == 1], s[y == 0]
    if not len(pos) or not len(neg):
        return 0.5
    return float(((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (len(pos) * len(neg)))


@dataclass
class ScoreModel:
    names: tuple[str, ...]
    cuts: list[np.ndarray]
    tables: list[np.ndarray]
    """Per column: float [levels, 2], P(level | Y = y)."""
    weights: np.ndarray
    pi: float
    used: str = "fit"
    """``fit``; or, when the labels' guard chose an alternative, ``single:<name>`` (one verifier)
    or ``rank-mean:<name>,<name>,...`` (the mean rank of a few)."""
    single: tuple[list[int], list[np.ndarray], float, float] | None = None
    """The guard's alternative: (columns, each column's quantile grid, a, b): log-odds
    a + b logit(mean over the columns of each score's quantile)."""
    favour: list[float] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    iterations: int = 0
    labels: int = 0
    label_share: float | None = None
    label_auc: dict = field(default_factory=dict)
    version: int = 0
    fitted_rows: int = 0

    def levels(self, votes: np.ndarray, names: Sequence[str]) -> np.ndarray:
        cols = [list(names).index(n) for n in self.names]
        v = np.asarray(votes, dtype=np.float64)[:, cols]
        return np.stack([_level(v[:, j], self.cuts[j]) for j in range(len(self.names))], axis=1)

    def log_odds(self, lv: np.ndarray) -> np.ndarray:
        return _log_odds(lv, self.tables, self.weights, self.pi)

    def posterior(self, votes: np.ndarray, names: Sequence[str]) -> np.ndarray:
        """float64 [N] P(correct) of each row of ``votes`` (columns named by ``names``)."""
        if self.single is not None:
            cols, grids, a, b = self.single
            v = np.asarray(votes, dtype=np.float64)[:, [list(names).index(self.names[j]) for j in cols]]
            return _sigmoid(a + b * _logit(_rank_mean(v, grids)))
        return _sigmoid(self.log_odds(self.levels(votes, names)))

    @property
    def sane(self) -> bool:
        return not self.warnings

    def to_dict(self) -> dict:
        """Plain lists, floats and strings (msgpack), for the ``{ns}:labelmodel`` hash."""
        return {"kind": "scores", "names": list(self.names), "cuts": [c.tolist() for c in self.cuts],
                "tables": [t.tolist() for t in self.tables], "weights": self.weights.tolist(), "pi": self.pi,
                "used": self.used, "single": None if self.single is None else
                [list(self.single[0]), [g.tolist() for g in self.single[1]], self.single[2], self.single[3]],
                "favour": list(self.favour), "warnings": list(self.warnings), "iterations": self.iterations,
                "labels": self.labels, "label_share": self.label_share, "label_auc": dict(self.label_auc),
                "version": self.version, "fitted_rows": self.fitted_rows}

    @classmethod
    def from_dict(cls, d: dict) -> ScoreModel:
        return cls(tuple(d["names"]), [np.asarray(c, dtype=np.float64) for c in d["cuts"]],
                   [np.asarray(t, dtype=np.float64) for t in d["tables"]], np.asarray(d["weights"], dtype=np.float64),
                   float(d["pi"]), used=d["used"],
                   single=None if d["single"] is None else
                   ([int(j) for j in d["single"][0]], [np.asarray(g, dtype=np.float64) for g in d["single"][1]],
                    float(d["single"][2]), float(d["single"][3])),
                   favour=list(d["favour"]), warnings=list(d["warnings"]), iterations=int(d["iterations"]),
                   labels=int(d["labels"]), label_share=d["label_share"], label_auc=dict(d["label_auc"]),
                   version=int(d["version"]), fitted_rows=int(d["fitted_rows"]))

    def report(self) -> dict:
        return {"method": "scores", "version": self.version, "rows": self.fitted_rows, "pi": round(self.pi, 4),
                "used": self.used, "labels": self.labels,
                "weights": dict(zip(self.names, np.round(self.weights, 3).tolist())),
                "favour": dict(zip(self.names, np.round(self.favour, 3).tolist())),
                "levels": {n: len(c) + 1 for n, c in zip(self.names, self.cuts)}, "iterations": self.iterations,
                "sane": self.sane, "warnings": list(self.warnings),
                **({"label_share": round(self.label_share, 4), "label_auc": self.label_auc} if self.labels else {})}


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _logit(u: np.ndarray) -> np.ndarray:
    u = np.clip(u, 1e-4, 1 - 1e-4)
    return np.log(u) - np.log1p(-u)


def _grid(col: np.ndarray) -> np.ndarray:
    x = col[np.isfinite(col)]
    return np.quantile(x, np.linspace(0.0, 1.0, GRID)) if x.size else np.zeros(1)


def _rank_mean(v: np.ndarray, grids: Sequence[np.ndarray]) -> np.ndarray:
    """Mean over the columns of ``v`` of each score's quantile in its column (the grid, tied
    values at their mean quantile, linear between); an abstention counts as quantile 0."""
    out = np.zeros(len(v))
    for j, g in enumerate(grids):
        values, inv = np.unique(g, return_inverse=True)
        at = np.bincount(inv, weights=np.linspace(0.0, 1.0, len(g))) / np.bincount(inv)
        col = v[:, j]
        ok = np.isfinite(col)
        out[ok] += np.interp(col[ok], values, at) if len(values) > 1 else 0.5
    return out / max(len(grids), 1)


def _platt(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Logistic fit P(y = 1) = sigmoid(a + b x), with Platt's smoothed targets and a ridge pulling
    b towards 1 (``x`` is a quantile's logit, so b = 1 keeps its odds); Newton steps halved until
    the penalised loss falls, so labels that one score separates do not send it to infinity; b > 0."""
    pos = y.sum()
    t = np.where(y == 1, (pos + 1) / (pos + 2), 1 / (len(y) - pos + 2))

    def loss(a: float, b: float) -> float:
        z = a + b * x
        return float(np.sum(np.logaddexp(0, z) - t * z) + 0.5 * (b - 1) ** 2)

    a, b = float(np.log(t.mean() / (1 - t.mean()))), 1.0
    for _ in range(100):
        p = _sigmoid(a + b * x)
        g = np.array([np.sum(p - t), np.sum((p - t) * x) + (b - 1)])
        w = p * (1 - p)
        h = np.array([[w.sum() + 1e-9, (w * x).sum()], [(w * x).sum(), (w * x * x).sum() + 1.0]])
        step = np.linalg.solve(h, g)
        f, scale = loss(a, b), 1.0
        while scale > 1e-6 and loss(a - scale * step[0], b - scale * step[1]) > f:
            scale /= 2
        a, b = a - scale * step[0], b - scale * step[1]
        if np.abs(scale * step).max() < 1e-8:
            break
    return float(a), float(max(b, 1e-3))


def _guard(fit_z: np.ndarray, raw: np.ndarray, y: np.ndarray, seed: int = 0) -> tuple[dict, int]:
    """Out-of-bag AUC, averaged over ``BOOTSTRAP`` resamples of the labelled rows, of the fit's
    log-odds ``fit_z`` and of each rule "the mean rank of the k verifiers with the highest AUC
    on the resample" (``TOP_K``; ``raw`` the labelled rows' scores, already as quantiles).
    The top k are chosen on each resample afresh, so a rule is scored as it would be used, not
    on the labels that chose it. Returns ({candidate: mean out-of-bag AUC}, the k chosen; 0 the fit)."""
    rng = np.random.default_rng(seed)
    n = len(y)
    got: dict[int, list[float]] = {k: [] for k in (0, *TOP_K)}
    for _ in range(BOOTSTRAP):
        bag = rng.integers(0, n, n)
        oob = np.setdiff1d(np.arange(n), bag)
        if len(np.unique(y[bag])) < 2 or len(np.unique(y[oob])) < 2:
            continue
        order = np.argsort([-_auc(raw[bag, j], y[bag]) for j in range(raw.shape[1])], kind="stable")
        got[0].append(_auc(fit_z[oob], y[oob]))
        for k in TOP_K:
            got[k].append(_auc(raw[np.ix_(oob, order[:k])].mean(axis=1), y[oob]))
    mean = {k: float(np.mean(a)) if a else 0.0 for k, a in got.items()}
    return mean, max(mean, key=lambda k: (mean[k], -k))


def _log_odds(lv: np.ndarray, tables: list[np.ndarray], weights: np.ndarray, pi: float) -> np.ndarray:
    z = np.full(len(lv), np.log(pi) - np.log1p(-pi))
    for j, t in enumerate(tables):
        ok = lv[:, j] >= 0
        z[ok] += weights[j] * (np.log(t[lv[ok, j], 1]) - np.log(t[lv[ok, j], 0]))
    return z


def _agreement_explained(mid: np.ndarray, fam: list[str], r: np.ndarray) -> float | None:
    """Mean |correlation| of levels between verifiers of different families, overall minus within
    the classes (each row weighted by its responsibility): positive when the classes explain
    part of the verifiers' agreement, as conditional independence across families says they
    should; None with fewer than two families."""
    pairs = [(a, b) for a in range(len(fam)) for b in range(a + 1, len(fam)) if fam[a] != fam[b]]
    if not pairs:
        return None

    def corr(x, y, w):
        ok = np.isfinite(x) & np.isfinite(y) & (w > 0)
        if ok.sum() < 3:
            return np.nan
        x, y, w = x[ok], y[ok], w[ok]
        mx, my = np.average(x, weights=w), np.average(y, weights=w)
        cov = np.average((x - mx) * (y - my), weights=w)
        sd = np.sqrt(np.average((x - mx) ** 2, weights=w) * np.average((y - my) ** 2, weights=w))
        return abs(cov / sd) if sd > 0 else np.nan

    ones = np.ones(len(r))
    overall = np.nanmean([corr(mid[:, a], mid[:, b], ones) for a, b in pairs])
    within = np.nanmean([r.mean() * corr(mid[:, a], mid[:, b], r) + (1 - r.mean()) * corr(mid[:, a], mid[:, b], 1 - r)
                         for a, b in pairs])
    return None if not np.isfinite(overall) or not np.isfinite(within) else float(overall - within)


def _tables(lv: np.ndarray, r: np.ndarray, sizes: list[int], sound: np.ndarray) -> list[np.ndarray]:
    out = []
    for j, k in enumerate(sizes):
        ok = lv[:, j] >= 0
        t = np.full((k, 2), SMOOTHING)
        np.add.at(t[:, 1], lv[ok, j], r[ok])
        np.add.at(t[:, 0], lv[ok, j], 1.0 - r[ok])
        if sound[j] and k > 1:
            t[0, 1] = 1e-6
        out.append(t / t.sum(axis=0, keepdims=True))
    return out


def fit_score_model(votes: np.ndarray, names: Sequence[str], *, sound: Sequence[str] = (),
                    labels: tuple[np.ndarray, np.ndarray] | None = None, version: int = 0) -> ScoreModel:
    """Fit on pooled votes float [N, m] (NaN = abstain). ``labels``: (row indices, truth 0/1) of a
    few labelled rows, never held-out ones; without them the fit is label-free."""
    v = np.asarray(votes, dtype=np.float64)
    names = tuple(names)
    keep = [j for j in range(v.shape[1]) if np.unique(v[np.isfinite(v[:, j]), j]).size >= 2]
    if not keep:
        raise ValueError("no verifier has two distinct scores: nothing to fit")
    names_k = tuple(names[j] for j in keep)
    v = v[:, keep]
    cuts = [_cuts(v[:, j]) for j in range(v.shape[1])]
    lv = np.stack([_level(v[:, j], cuts[j]) for j in range(v.shape[1])], axis=1)
    sizes = [len(c) + 1 for c in cuts]
    fam = [family(n) for n in names_k]
    weights = np.array([1.0 / fam.count(f) for f in fam])
    sound_mask = np.array([n in set(sound) for n in names_k])
    mid = np.where(lv >= 0, lv / np.maximum(np.array(sizes) - 1, 1), np.nan)
    warnings: list[str] = []

    idx = y_lab = None
    fixed_pi = label_share = None
    if labels is not None and len(labels[0]):
        idx, y_lab = np.asarray(labels[0], dtype=np.int64), np.asarray(labels[1], dtype=np.float64)
        label_share = float((y_lab.sum() + 1.0) / (len(y_lab) + 2.0))
    # The start: each row's mean normalised level, weighted, as a soft vote.
    w = np.where(np.isfinite(mid), weights, 0.0)
    r = np.nansum(np.nan_to_num(mid) * w, axis=1) / np.maximum(w.sum(axis=1), 1e-12)
    r = np.where(w.sum(axis=1) > 0, r, 0.5)
    if idx is not None:
        r[idx] = y_lab
    pi = fixed_pi if fixed_pi is not None else float(np.clip(r.mean(), 0.01, 0.99))
    tables = _tables(lv, r, sizes, sound_mask)
    it = 0
    for it in range(1, MAX_ITER + 1):
        before = r
        r = 1.0 / (1.0 + np.exp(-_log_odds(lv, tables, weights, pi)))
        if idx is not None:
            r[idx] = y_lab
        if fixed_pi is None:
            pi = float(np.clip(r.mean(), 1e-3, 1 - 1e-3))
        tables = _tables(lv, r, sizes, sound_mask)
        if np.max(np.abs(r - before)) < TOL:
            break
    else:
        warnings.append(f"EM did not converge in {MAX_ITER} iterations")

    favour = [float(np.dot(np.arange(k) / max(k - 1, 1), t[:, 1] - t[:, 0])) for k, t in zip(sizes, tables)]
    if fixed_pi is None and np.dot(weights, favour) < 0:
        tables = [t[:, ::-1].copy() for t in tables]
        pi = 1.0 - pi
        favour = [-f for f in favour]
    if not 0.02 < pi < 0.98:
        warnings.append(f"pi {pi:.3f} is at the edge: one class took (almost) every row")
    explained = _agreement_explained(mid, fam, r)
    if explained is not None and explained < 0.0:
        warnings.append(f"the classes do not explain the verifiers' agreement (across families the correlation "
                        f"within a class is {-explained:.3f} above the overall one)")
    against = [n for n, f in zip(names_k, favour) if f < 0]
    if 2 * len(against) > len(names_k):
        warnings.append(f"most verifiers favour the component called wrong: {against}")
    model = ScoreModel(names_k, cuts, tables, weights, pi, favour=favour, warnings=warnings, iterations=it,
                       version=version, fitted_rows=len(v))
    if idx is not None:
        model.labels = len(idx)
        model.label_share = label_share
        fit_z = model.log_odds(lv[idx])
        grids = [_grid(v[:, j]) for j in range(v.shape[1])]
        ranks = np.stack([_rank_mean(v[:, [j]], [grids[j]]) for j in range(v.shape[1])], axis=1)
        singles = {names_k[j]: _auc(ranks[idx, j], y_lab) for j in range(len(names_k))}
        oob, k = _guard(fit_z, ranks[idx], y_lab)
        best = max(singles, key=singles.get)
        model.label_auc = {"fit": round(_auc(fit_z, y_lab), 3), "best_single": best,
                           "best_single_auc": round(singles[best], 3),
                           "out_of_bag": {("fit" if c == 0 else f"top{c}"): round(a, 3) for c, a in oob.items()}}
        if k:
            cols = sorted(range(len(names_k)), key=lambda j: -singles[names_k[j]])[:k]
            x = _logit(ranks[:, cols].mean(axis=1))
            a, b = _platt(x[idx], y_lab)
            model.single = (cols, [grids[j] for j in cols], a, b)
            model.pi = float(_sigmoid(a + b * x).mean())
            model.used = (f"single:{names_k[cols[0]]}" if k == 1 else
                          "rank-mean:" + ",".join(names_k[j] for j in cols))
    return model
