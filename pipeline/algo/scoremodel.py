"""A label model that keeps the scores: class-conditional level tables per verifier (docs/design.md §5).

The Weaver label model (``pipeline.algo.labelmodel``) binarises every score at a threshold
that depends on π, which throws away the ranking a good judge has and ties π to the
thresholds. This one keeps each verifier's scores as ``LEVELS`` ordered levels and learns
P(level | Y) for each:

1. **Levels.** Each column's finite scores are cut at their own quantiles into at most
   ``LEVELS`` levels (a column of two values keeps two). An abstention (NaN) is missing:
   it leaves the row's likelihood unchanged.
2. **Families count once.** Verifiers that share a source of error form a family
   (``family``): judges that ask one model (``lm_judge:<dir>@<style>``, one ``<dir>`` or
   endpoint), and the answer-level checks (``self_consistency``, ``states_answer``,
   ``answer_only``: all read the group's extracted answers, so a popular wrong answer passes
   all three). A naive product would count a family of k k times; each enters the posterior
   with weight 1/k (a tempered product).
3. **The common factor** (label-free information, ``free = "factor"``, the default). On the
   rows no sound verifier fails, each column's scores become standardised quantiles, and their
   correlation matrix is fitted by one factor, c[i, j] ~ l[i] l[j], on the pairs of verifiers
   of *different* families only: under conditional independence given correctness the truth is
   the one thing verifiers of different families share, while a family's shared errors (a
   model's taste, an answer's popularity) show up only within it. The factor's sign makes
   the loadings' sum positive ("the verifiers are better than random on average"; a verifier
   with a negative loading is read upside down). Its score is the one-factor model's
   sum l / (1 − l²) × standardised quantile (an abstention adds nothing; a row a sound
   verifier fails scores −inf).
4. **EM** on the latent class model (one P(level | Y) table per verifier, Laplace-smoothed,
   π), started from each row's quantile on the factor's score (``free = "em"``: from each
   row's mean rank, the earlier start). A sound verifier (a right answer always passes it)
   has its lowest level held impossible for a right answer.
5. **Anchor and check.** y = 1 is the class the factor's score ranks higher: the fit's
   classes are swapped (π → 1 − π) when the factor separates them the other way round with
   AUC (each row weighted by its responsibilities) at least ``AGREE``. When it separates
   them by less than ``AGREE`` either way, EM found a split that is not what the verifiers
   of different families share (a family's own cluster, or one class taking every row): the
   fit is refused, its ranking replaced by the factor's score, on the fit's scale (a logistic
   fit of its responsibilities on the score; π stays the fit's, and the warning says it is
   not an estimate to trust). ``ScoreModel.used`` is then ``factor``. (``free = "em"``:
   the earlier anchor, by the weighted mean over verifiers of E[level | Y = 1] −
   E[level | Y = 0], and no check.)
6. **Labels** (optional: a few completions of training prompts with their truth): their
   rows' responsibilities are held at their truth through EM, so they pull π and every table
   towards what they show (π is estimated over all rows with those held: on 32 labels the
   labelled share alone is a coarser estimate, its standard error 0.07 at π = 0.2, and
   is reported beside). A guard then weighs the fit against simple rules: "the mean rank
   of the k verifiers with the highest AUC on the labels" for k in ``TOP_K`` (k = 1 is the
   best single verifier). With a handful of positives among the labels (8 in 128 at
   π = 0.06) the labels' own ranking of verifiers is noisy, so each is scored by its AUC out
   of bag over ``BOOTSTRAP`` resamples of the labels, the top k chosen afresh on each
   resample: a rule is scored as it would be used, not on the labels that picked it.
   ``guard = "simplest"`` (the default) scores the fit likewise on labels it did not hold
   (each labelled row's log-odds from a fit with the other ``FOLDS`` − 1 folds' labels held;
   held at their truth, the labels would make the fit look good on themselves), and keeps
   the best single verifier unless another
   candidate beats it on at least ``CLEAR`` of the resamples (paired, ties counted half),
   and then the one with the highest mean among those that do: a combination must show on
   the labels that it is better, not merely come out ahead on average when a few positives
   cannot tell (its selection also costs it: three judges' mean rank dilutes the best
   one's ranking). ``guard = "mean"``: the highest mean wins (ties to fewer verifiers), the
   earlier rule. A rule that wins keeps the raw scores' order
   (each score's quantile in its column, no levels, so a judge's fine ranking survives),
   calibrated on the labels by a logistic fit on the mean quantile's logit (Platt's smoothed
   targets, a ridge towards slope 1); π is then its mean posterior over all rows
   (``ScoreModel.used`` says which: ``fit``, ``factor``, ``single:<name>`` or ``rank-mean:<names>``).
7. **Sanity** (label-free): EM converged; π is not at an edge; most verifiers favour the
   component called right; the classes explain part of the agreement between verifiers
   of different families (their level correlation within a class is below the overall one,
   as conditional independence says); the check of step 5; and, label-free, that the
   factor's score follows the verifiers' mean quantile (rank correlation at least ``FOLLOW``:
   below it the factor may be a taste they share, or the wrong way round where its loadings
   nearly cancel). ``ScoreModel.warnings`` lists what failed; a warning changes nothing.

What the verifiers alone cannot give: the factor orders the rows, but π is identified only
through conditional independence, which judges of small models that share a taste for
plausible-looking answers break; label-free, π and the calibration are the fit's, and the
warnings say when it was refused. A few labels fix both (step 6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.verifiers.base import KINDS

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
FREE = ("factor", "em")
"""How the label-free fit is started and checked: ``factor`` (the default) starts EM from the
verifiers' common factor and refuses an EM fit that does not follow it; ``em`` is the earlier
fit (started from the mean rank, anchored by the verifiers' favour, never refused)."""
GUARDS = ("simplest", "mean")
"""How the labels' guard chooses: ``simplest`` (the default) keeps the best single verifier unless
a richer rule beats it on a clear majority of resamples; ``mean`` takes the highest mean out-of-bag AUC."""
FOLDS = 5
"""Folds of the labels over which ``simplest`` scores the fit on labels it did not hold."""
CLEAR = 0.9
"""Share of the labels' resamples on which a richer rule must beat the best single verifier (``simplest``)."""
AGREE = 0.75
"""Least AUC with which the common factor must separate EM's two classes for the EM fit to be kept."""
MAX_LOADING = 0.95
"""Largest |loading| of a verifier on the common factor (a loading of 1 would be a verifier that is the truth)."""
FOLLOW = 0.5
"""Least rank correlation between the common factor's score and the verifiers' mean rank under which,
label-free, the fit warns that the factor's direction is not what the verifiers say together."""


def family(name: str, *, answers: bool = True) -> str:
    """The source a verifier's errors come from, which verifiers of one family share: a judge's
    model (``lm_judge:<dir>@<style>`` -> ``lm_judge:<dir>``); with ``answers``, the module of a
    kind that runs no model (``self_consistency``, ``states_answer`` and ``answer_only`` all read
    the group's extracted answers: one family); any other verifier is its own."""
    if name.startswith("lm_judge:") and "@" in name:
        return name.rsplit("@", 1)[0]
    kind = KINDS.get(name.partition(":")[0])
    if answers and kind is not None and not kind.model:
        return kind.module
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


def _soft_auc(s: np.ndarray, r: np.ndarray) -> float:
    """AUC of ``s`` between two soft classes: each row counts r in class 1 and 1 - r in class 0."""
    values, inv = np.unique(s, return_inverse=True)
    pos = np.bincount(inv, weights=r, minlength=len(values))
    neg = np.bincount(inv, weights=1.0 - r, minlength=len(values))
    below = np.cumsum(neg) - neg
    total = pos.sum() * neg.sum()
    return float(np.sum(pos * (below + 0.5 * neg)) / total) if total > 0 else 0.5


@dataclass
class ScoreModel:
    names: tuple[str, ...]
    cuts: list[np.ndarray]
    tables: list[np.ndarray]
    """Per column: float [levels, 2], P(level | Y = y)."""
    weights: np.ndarray
    pi: float
    used: str = "fit"
    """``fit``; ``factor`` when the label-free check refused the fit (the common factor's score,
    calibrated); or, when the labels' guard chose an alternative, ``single:<name>`` (one verifier)
    or ``rank-mean:<name>,<name>,...`` (the mean rank of a few)."""
    single: tuple[list[int], list[np.ndarray], float, float] | None = None
    """The guard's alternative: (columns, each column's quantile grid, a, b): log-odds
    a + b logit(mean over the columns of each score's quantile)."""
    factor: dict | None = None
    """The verifiers' common factor (``_factor``: grids, centre, scale, loadings, weights, sound
    columns, and a, b: log-odds a + b score); the posterior when ``used`` is ``factor``."""
    agreement: float | None = None
    """How well the common factor's score separates the EM fit's two classes (AUC; ``factor`` only)."""
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
        if self.used == "factor":
            v = np.asarray(votes, dtype=np.float64)[:, [list(names).index(n) for n in self.names]]
            with np.errstate(invalid="ignore"):
                return _sigmoid(self.factor["a"] + self.factor["b"] * _factor_score(self.factor, v))
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
                "factor": self.factor, "agreement": self.agreement,
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
                   factor=d.get("factor"), agreement=d.get("agreement"), favour=list(d["favour"]),
                   warnings=list(d["warnings"]), iterations=int(d["iterations"]),
                   labels=int(d["labels"]), label_share=d["label_share"], label_auc=dict(d["label_auc"]),
                   version=int(d["version"]), fitted_rows=int(d["fitted_rows"]))

    def report(self) -> dict:
        return {"method": "scores", "version": self.version, "rows": self.fitted_rows, "pi": round(self.pi, 4),
                "used": self.used, "labels": self.labels,
                "weights": dict(zip(self.names, np.round(self.weights, 3).tolist())),
                "favour": dict(zip(self.names, np.round(self.favour, 3).tolist())),
                "levels": {n: len(c) + 1 for n, c in zip(self.names, self.cuts)}, "iterations": self.iterations,
                "sane": self.sane, "warnings": list(self.warnings),
                **({} if self.agreement is None else {"agreement": round(self.agreement, 3)}),
                **({"label_share": round(self.label_share, 4), "label_auc": self.label_auc} if self.labels else {})}


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _logit(u: np.ndarray) -> np.ndarray:
    u = np.clip(u, 1e-4, 1 - 1e-4)
    return np.log(u) - np.log1p(-u)


def _grid(col: np.ndarray) -> np.ndarray:
    x = col[np.isfinite(col)]
    return np.quantile(x, np.linspace(0.0, 1.0, GRID)) if x.size else np.zeros(1)


def _quantile(col: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Each score's quantile in its column (the grid, tied values at their mean quantile, linear
    between); NaN for an abstention."""
    values, inv = np.unique(grid, return_inverse=True)
    at = np.bincount(inv, weights=np.linspace(0.0, 1.0, len(grid))) / np.bincount(inv)
    out = np.full(len(col), np.nan)
    ok = np.isfinite(col)
    out[ok] = np.interp(col[ok], values, at) if len(values) > 1 else 0.5
    return out


def _rank_mean(v: np.ndarray, grids: Sequence[np.ndarray]) -> np.ndarray:
    """Mean over the columns of ``v`` of each score's quantile in its column (``_quantile``); an
    abstention counts as quantile 0."""
    out = np.zeros(len(v))
    for j, g in enumerate(grids):
        out += np.nan_to_num(_quantile(v[:, j], g))
    return out / max(len(grids), 1)


def _midrank(x: np.ndarray) -> np.ndarray:
    """Ranks of ``x`` from 0, ties at their mean rank."""
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    below = np.cumsum(counts) - counts
    return (below + (counts - 1) / 2.0)[inv]


def _rank_corr(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two finite vectors; 0 if either is constant."""
    ra, rb = _midrank(a), _midrank(b)
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def _sound_fails(v: np.ndarray, sound: list[tuple[int, float]]) -> np.ndarray:
    """Rows a sound verifier scores at its lowest value (wrong, whatever the others say)."""
    out = np.zeros(len(v), dtype=bool)
    for j, low in sound:
        out |= v[:, j] <= low
    return out


def _rank_one(c: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Loadings l with c[i, j] ~ l[i] l[j] on the entries ``mask`` keeps (least squares,
    alternating from the leading eigenvector; |l| <= ``MAX_LOADING``)."""
    cm = np.where(mask, c, 0.0)
    w, vec = np.linalg.eigh(cm)
    lam = np.clip(vec[:, -1] * np.sqrt(max(w[-1], 1e-6)), -MAX_LOADING, MAX_LOADING)
    for _ in range(1000):
        new = np.clip(cm @ lam / np.maximum(mask @ lam ** 2, 1e-9), -MAX_LOADING, MAX_LOADING)
        if np.max(np.abs(new - lam)) < 1e-10:
            break
        lam = new
    return new


def _factor(v: np.ndarray, fam: list[str], sound: list[tuple[int, float]]) -> dict:
    """The verifiers' common factor (docstring, step 3): each column's quantiles standardised on
    the rows no sound verifier fails, their correlation matrix fitted by one factor on the pairs
    of verifiers of different families (a family's shared errors are not the truth), the sign
    making the loadings' sum positive, and each verifier weighted l / (1 - l^2) (a one-factor
    model's score with independent residuals). Returns the plain-data form ``ScoreModel.factor`` keeps."""
    m = v.shape[1]
    act = ~_sound_fails(v, sound)
    grids = [_grid(v[act, j]) for j in range(m)]
    q = np.column_stack([_quantile(v[act, j], grids[j]) for j in range(m)])
    centre = np.array([np.nanmean(q[:, j]) if np.isfinite(q[:, j]).any() else 0.5 for j in range(m)])
    scale = np.array([np.nanstd(q[:, j]) if np.isfinite(q[:, j]).sum() > 1 else 0.0 for j in range(m)])
    scale = np.where(scale > 1e-9, scale, np.inf)
    z = (q - centre) / scale
    c = np.eye(m)
    for a in range(m):
        for b in range(a + 1, m):
            ok = np.isfinite(z[:, a]) & np.isfinite(z[:, b])
            if ok.sum() > 2 and np.std(z[ok, a]) > 0 and np.std(z[ok, b]) > 0:
                c[a, b] = c[b, a] = np.corrcoef(z[ok, a], z[ok, b])[0, 1]
    mask = np.array([[fam[a] != fam[b] for b in range(m)] for a in range(m)], dtype=float)
    if not mask.any():  # one family: every pair
        mask = 1.0 - np.eye(m)
    lam = _rank_one(c, mask)
    if lam.sum() < 0:
        lam = -lam
    return {"grids": [g.tolist() for g in grids], "centre": centre.tolist(),
            "scale": [float(x) if np.isfinite(x) else None for x in scale], "loadings": lam.tolist(),
            "weights": (lam / (1.0 - lam ** 2)).tolist(), "sound": [[int(j), float(low)] for j, low in sound],
            "a": 0.0, "b": 1.0}


def _factor_score(f: dict, v: np.ndarray) -> np.ndarray:
    """The factor's score of each row of ``v`` (the columns the factor was fitted on); an
    abstention adds nothing, a row a sound verifier fails scores -inf."""
    out = np.zeros(len(v))
    for j, g in enumerate(f["grids"]):
        if f["scale"][j] is None:
            continue
        z = (_quantile(v[:, j], np.asarray(g)) - f["centre"][j]) / f["scale"][j]
        out += f["weights"][j] * np.nan_to_num(z)
    out[_sound_fails(v, [(int(j), low) for j, low in f["sound"]])] = -np.inf
    return out


def _soft_logistic(x: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """Logistic fit of soft targets ``t`` on ``x`` (Newton steps, halved until the loss falls): (a, b)."""
    def loss(a: float, b: float) -> float:
        z = a + b * x
        return float(np.sum(np.logaddexp(0, z) - t * z) + 1e-6 * b * b)

    m = float(np.clip(t.mean(), 1e-4, 1 - 1e-4))
    a, b = float(np.log(m / (1 - m))), 0.0
    for _ in range(100):
        p = _sigmoid(a + b * x)
        g = np.array([np.sum(p - t), np.sum((p - t) * x) + 2e-6 * b])
        w = p * (1 - p)
        h = np.array([[w.sum() + 1e-9, (w * x).sum()], [(w * x).sum(), (w * x * x).sum() + 2e-6]])
        step = np.linalg.solve(h, g)
        f, scale = loss(a, b), 1.0
        while scale > 1e-6 and loss(a - scale * step[0], b - scale * step[1]) > f:
            scale /= 2
        a, b = a - scale * step[0], b - scale * step[1]
        if np.abs(scale * step).max() < 1e-8:
            break
    return float(a), float(b)


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


def _guard(fit_z: np.ndarray, raw: np.ndarray, y: np.ndarray, rule: str = "simplest",
           seed: int = 0) -> tuple[dict, dict, int]:
    """Out-of-bag AUC over ``BOOTSTRAP`` resamples of the labelled rows, of the fit's log-odds
    ``fit_z`` and of each rule "the mean rank of the k verifiers with the highest AUC on the
    resample" (``TOP_K``; ``raw`` the labelled rows' scores, already as quantiles). The top k
    are chosen on each resample afresh, so a rule is scored as it would be used, not on the
    labels that chose it. ``rule``: ``mean`` takes the highest mean (ties to fewer verifiers);
    ``simplest`` keeps the best single verifier (k = 1) unless another candidate beats it on
    at least ``CLEAR`` of the resamples (ties count half), and then takes the highest mean among
    those that do. Returns ({candidate: mean out-of-bag AUC}, {candidate: share of resamples
    on which it beats k = 1}, the candidate chosen: k, or 0 for the fit)."""
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
    one = np.asarray(got[1])
    beats = {k: float(np.mean((np.asarray(a) > one) + 0.5 * (np.asarray(a) == one))) if a else 0.0
             for k, a in got.items()}
    if rule == "mean":
        return mean, beats, max(mean, key=lambda k: (mean[k], -k))
    clear = [k for k in mean if k != 1 and beats[k] >= CLEAR]
    return mean, beats, max(clear, key=lambda k: (mean[k], -k)) if clear else 1


def _em(lv: np.ndarray, sizes: list[int], weights: np.ndarray, sound: np.ndarray, r: np.ndarray,
        idx: np.ndarray | None, y_lab: np.ndarray | None) -> tuple[np.ndarray, float, list[np.ndarray], int, bool]:
    """EM from the responsibilities ``r``, the rows ``idx`` held at ``y_lab``: (r, π, tables,
    iterations, converged)."""
    pi = float(np.clip(r.mean(), 0.01, 0.99))
    tables = _tables(lv, r, sizes, sound)
    it = 0
    for it in range(1, MAX_ITER + 1):
        before = r
        r = 1.0 / (1.0 + np.exp(-_log_odds(lv, tables, weights, pi)))
        if idx is not None:
            r[idx] = y_lab
        pi = float(np.clip(r.mean(), 1e-3, 1 - 1e-3))
        tables = _tables(lv, r, sizes, sound)
        if np.max(np.abs(r - before)) < TOL:
            return r, pi, tables, it, True
    return r, pi, tables, it, False


def _crossfit(lv: np.ndarray, sizes: list[int], weights: np.ndarray, sound: np.ndarray, start: np.ndarray,
              idx: np.ndarray, y_lab: np.ndarray) -> np.ndarray:
    """The fit's log-odds of each labelled row from a fit that did not hold its label: the labels
    split into ``FOLDS`` folds, EM run once per fold with the other folds' labels held."""
    z = np.zeros(len(idx))
    order = np.random.default_rng(0).permutation(len(idx))
    for f in range(min(FOLDS, len(idx))):
        out, held = order[f::FOLDS], np.setdiff1d(order, order[f::FOLDS])
        r0 = start.copy()
        r0[idx[held]] = y_lab[held]
        _, pi, tables, _, _ = _em(lv, sizes, weights, sound, r0, idx[held], y_lab[held])
        z[out] = _log_odds(lv[idx[out]], tables, weights, pi)
    return z


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
                    labels: tuple[np.ndarray, np.ndarray] | None = None, version: int = 0,
                    free: str = "factor", guard: str = "simplest") -> ScoreModel:
    """Fit on pooled votes float [N, m] (NaN = abstain). ``labels``: (row indices, truth 0/1) of a
    few labelled rows, never held-out ones; without them the fit is label-free. ``free``: one of
    ``FREE``; ``guard``: one of ``GUARDS``."""
    if free not in FREE or guard not in GUARDS:
        raise ValueError(f"free must be one of {FREE} and guard one of {GUARDS}")
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
    fam = [family(n, answers=free == "factor") for n in names_k]
    weights = np.array([1.0 / fam.count(f) for f in fam])
    sound_mask = np.array([n in set(sound) for n in names_k])
    mid = np.where(lv >= 0, lv / np.maximum(np.array(sizes) - 1, 1), np.nan)
    warnings: list[str] = []

    idx = y_lab = None
    label_share = None
    if labels is not None and len(labels[0]):
        idx, y_lab = np.asarray(labels[0], dtype=np.int64), np.asarray(labels[1], dtype=np.float64)
        label_share = float((y_lab.sum() + 1.0) / (len(y_lab) + 2.0))
    fac = score = act = None
    if free == "factor":
        # The start: each row's quantile on the verifiers' common factor (0 where a sound verifier fails).
        fac = _factor(v, fam, [(j, float(np.nanmin(v[:, j]))) for j in np.flatnonzero(sound_mask)])
        score = _factor_score(fac, v)
        act = np.isfinite(score)
        r = np.zeros(len(v))
        r[act] = (np.argsort(np.argsort(score[act], kind="stable"), kind="stable") + 0.5) / max(act.sum(), 1)
    else:
        # The start: each row's mean normalised level, weighted, as a soft vote.
        w = np.where(np.isfinite(mid), weights, 0.0)
        r = np.nansum(np.nan_to_num(mid) * w, axis=1) / np.maximum(w.sum(axis=1), 1e-12)
        r = np.where(w.sum(axis=1) > 0, r, 0.5)
    start = r.copy()
    if idx is not None:
        r[idx] = y_lab
    r, pi, tables, it, converged = _em(lv, sizes, weights, sound_mask, r, idx, y_lab)
    if not converged:
        warnings.append(f"EM did not converge in {MAX_ITER} iterations")

    favour = [float(np.dot(np.arange(k) / max(k - 1, 1), t[:, 1] - t[:, 0])) for k, t in zip(sizes, tables)]
    agreement = None
    if fac is not None:
        # Anchor by the common factor: y = 1 is the class its score ranks higher, when the classes
        # are its split (else the check below refuses them, and which is y = 1 is left as EM found it).
        agreement = _soft_auc(score[act], r[act]) if act.any() else 0.5
        if idx is None and 1.0 - agreement >= AGREE:
            tables, pi, favour, r = [t[:, ::-1].copy() for t in tables], 1.0 - pi, [-f for f in favour], 1.0 - r
            agreement = 1.0 - agreement
    elif np.dot(weights, favour) < 0:
        tables = [t[:, ::-1].copy() for t in tables]
        pi = 1.0 - pi
        favour = [-f for f in favour]
    if not 0.02 < pi < 0.98:
        warnings.append(f"pi {pi:.3f} is at the edge: one class took (almost) every row")
    if fac is not None and idx is None and act.sum() > 2:
        # The factor is signed by its loadings' sum; where they nearly cancel, or the factor is a
        # shared taste that some verifiers follow and others oppose, its score need not follow what
        # the verifiers say together (each score's quantile, averaged), and without labels nothing
        # says which way round it is. Only said: the fit and its ranking are unchanged.
        # (the factor's grids are its columns' quantiles on these same rows, those no sound verifier fails)
        follow = _rank_corr(score[act], _rank_mean(v[act], [np.asarray(g) for g in fac["grids"]]))
        if follow < FOLLOW:
            warnings.append(f"the common factor's score follows the verifiers' mean rank at rank correlation "
                            f"{follow:.2f} < {FOLLOW} (its loadings sum to {sum(fac['loadings']):.2f}): it may "
                            "be a taste the verifiers share rather than correctness, or the wrong way round; "
                            "a few labels settle it")
    explained = _agreement_explained(mid, fam, r)
    if explained is not None and explained < 0.0:
        warnings.append(f"the classes do not explain the verifiers' agreement (across families the correlation "
                        f"within a class is {-explained:.3f} above the overall one)")
    against = [n for n, f in zip(names_k, favour) if f < 0]
    if 2 * len(against) > len(names_k):
        warnings.append(f"most verifiers favour the component called wrong: {against}")
    model = ScoreModel(names_k, cuts, tables, weights, pi, favour=favour, warnings=warnings, iterations=it,
                       version=version, fitted_rows=len(v), factor=fac, agreement=agreement)
    if fac is not None and idx is None and agreement < AGREE:
        # The check: EM's classes are not the split the verifiers share; keep the factor's ranking,
        # on the fit's scale (a logistic fit of its responsibilities on the score), π the fit's.
        model.warnings.append(f"the fit's classes are not the verifiers' common factor (its score separates "
                              f"them at AUC {agreement:.3f} < {AGREE}): the factor's score is used, pi is the fit's")
        model.used = "factor"
        x = score[act]
        mu, sd = float(x.mean()), max(float(x.std()), 1e-12)
        a, b = _soft_logistic((x - mu) / sd, r[act])
        b = max(b, 1e-3)
        fac["a"], fac["b"] = a - b * mu / sd, b / sd
    if idx is not None:
        model.labels = len(idx)
        model.label_share = label_share
        fit_z = model.log_odds(lv[idx])
        grids = [_grid(v[:, j]) for j in range(v.shape[1])]
        ranks = np.stack([_rank_mean(v[:, [j]], [grids[j]]) for j in range(v.shape[1])], axis=1)
        singles = {names_k[j]: _auc(ranks[idx, j], y_lab) for j in range(len(names_k))}
        # ``simplest`` scores the fit on labels it did not hold (``FOLDS``-fold cross-fitting).
        oob_z = fit_z if guard == "mean" else _crossfit(lv, sizes, weights, sound_mask, start, idx, y_lab)
        oob, beats, k = _guard(oob_z, ranks[idx], y_lab, guard)
        best = max(singles, key=singles.get)
        tag = {c: "fit" if c == 0 else f"top{c}" for c in oob}
        model.label_auc = {"fit": round(_auc(fit_z, y_lab), 3), "best_single": best,
                           "best_single_auc": round(singles[best], 3),
                           "out_of_bag": {tag[c]: round(a, 3) for c, a in oob.items()},
                           "beats_top1": {tag[c]: round(b, 3) for c, b in beats.items() if c != 1}}
        if k:
            cols = sorted(range(len(names_k)), key=lambda j: -singles[names_k[j]])[:k]
            x = _logit(ranks[:, cols].mean(axis=1))
            a, b = _platt(x[idx], y_lab)
            model.single = (cols, [grids[j] for j in cols], a, b)
            model.pi = float(_sigmoid(a + b * x).mean())
            model.used = (f"single:{names_k[cols[0]]}" if k == 1 else
                          "rank-mean:" + ",".join(names_k[j] for j in cols))
    return model

