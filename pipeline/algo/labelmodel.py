"""Weaver label model: combine weak verifiers into P(correct) without labels (docs/design.md §5).

Input: a pooled window of verifier votes, float [N, m], NaN where a verifier
abstained (rows are completions from many groups; the majority pseudo-verifier of
§5 step 1 is just one of the columns, computed by ``pipeline.verifiers.registry``).

Fit (``fit_label_model``), §5 steps 2–6:

2. **Normalise** each column to [0, 1] by its pooled min and max; a column whose
   scores already lie in [0, 1] is left as is (so a threshold means the same thing
   in every window). Non-finite scores are abstentions, never 0.
3. **Binarise** v = 1[s ≥ t]: a given threshold wins; a column whose scores are all
   0 or 1 uses 0.5; any other column uses the label-free (1 − π) quantile of its
   own scores, so it passes about as many rows as the class balance says are correct.
4. **Filter** columns whose positive rate r is degenerate: keep 0.1 < r < 0.9, or
   r < 0.5 when π < 0.2, or r > 0.5 when π > 0.8 (a check that passes most rows
   while most answers are wrong carries little signal and a lot of noise). Columns
   with fewer than ``MIN_VOTES`` votes go too. If that leaves fewer than two, the
   non-constant columns whose rate is closest to π are kept instead, because a
   label model over zero verifiers would say nothing at all.
   **Dependent pairs**: two kept columns whose binarised votes have
   |Pearson correlation| > ``DEPENDENCE_CORR`` on the rows where both vote are one
   check counted twice, which makes the posterior overconfident. Of each pair the
   one with fewer votes (on a tie, the later column) leaves the posterior, with the
   reason recorded in ``LabelModel.dropped``. What happens to it is the
   ``dependence`` policy: ``drop`` forgets it; ``merge`` averages it into the
   column that stays (normalised scores and thresholds averaged over the members
   that voted on a row, a negatively correlated member entering as 1 − s), so the
   pair votes once but a row where only the dropped member voted still gets a vote.
   Merges are recorded in ``LabelModel.merged`` and applied again by ``binarize``.
5. **Class balance π** by EM on the same conditionally independent label model
   (Dawid–Skene with one TPR and one TNR per verifier), started from the soft
   majority vote of the binarised verifiers — this start is the "verifiers are
   better than random on average" assumption that breaks the label-swap symmetry;
   if EM still ends below random on average, its solution is swapped. Reference
   answers are never used. Because the quantile thresholds depend on π and π on
   the binarised votes, steps 3–5 alternate until π moves less than 1e-3
   (at most ``MAX_ROUNDS`` rounds). A known class balance (``class_balance``, e.g.
   the base policy's accuracy measured on a small labelled sample of the training
   split) replaces the estimate: π is held there, the quantile thresholds are set
   from it once, and EM estimates the rates alone. The label-free estimate is the
   fragile part of the fit: the (1 − π) quantile thresholds give every verifier a
   positive rate of about π, so the marginals say nothing about π and only the
   verifiers' agreements do; verifiers that err together (LLM judges of one model)
   pull it up, thresholds fall with it, and wrong answers are rewarded.
   That is ``pi_estimate="alternate"``, the default. ``pi_estimate="levels"`` estimates
   π before any threshold instead: each quantile column's scores are cut into
   ``LEVELS`` levels at their own mid-ranks (a column with a given threshold, or of
   0/1 scores, keeps its two), dependent level columns go as in step 4, and EM fits a
   latent class model with one P(level | Y) table per verifier, started from each
   row's mean rank (the same "better than random on average" start; a sound
   verifier's failing level is held impossible for a right answer). π is then held
   like a known class balance: one round of steps 3–6. With no continuous column the
   two are the same model and the fit reports ``alternate``. Neither dominates: on
   SmolLM2's judges ``levels`` lands as near the truth or nearer; on synthetic judges sharing
   one Gaussian error, or a weak pair sharing a nuisance, ``alternate`` does
   (docs/real-models.md). The fit records which ran in ``LabelModel.pi_method``.
6. **μ by moment matching** (MeTaL): with one-hot votes L [N, 2k] and
   P = diag(1 − π, π), minimise ‖M∘(O − μPμᵀ)‖²_F + ‖μP𝟙 − diag O‖² over
   μ[2j+a, y] = P(v_j = a | Y = y) with scipy's bounded L-BFGS-B to convergence,
   from the EM solution. μ is parameterised by TPR_j = μ[2j+1, 1] and
   TNR_j = μ[2j, 0] in [0, 1], so each verifier's two rows sum to 1 per class by
   construction. Abstentions: every entry of O is an average over only the rows
   where *both* verifiers voted (not LᵀL/N, which would count an abstention as
   "voted neither" and shrink that verifier's moments), and pairs with fewer than
   ``MIN_VOTES`` shared rows are masked out of the objective.

Every fit carries its own report (``LabelModel.report()``): kept, dropped and merged
verifiers with reasons, TPR/TNR, π, the moment-matching objective and the iteration
counts; the verifier stage logs it on each refit.

Posterior (``LabelModel.posterior``), step 7: logit P(y=1 | v) = log(π/(1−π)) +
Σ_j [log μ̂[2j+v_j, 1] − log μ̂[2j+v_j, 0]] over the kept verifiers that voted,
μ̂ clipped to [0.01, 0.99]; an abstaining verifier adds nothing. A fit that kept no
verifier (a first window with fewer than ``MIN_VOTES`` votes per verifier) gives each
row its mean binarised vote instead, the unweighted ensemble, and π where none voted.

The fitted model is plain data (``to_dict``/``from_dict`` use only lists, floats,
ints, bools and strings) so it can live, versioned, in the ``{ns}:labelmodel`` hash.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SCHEMA = 2
"""Version of the ``to_dict`` layout; ``from_dict`` rejects any other."""

DEPENDENCE_POLICIES = ("drop", "merge")
"""What a fit does with the weaker verifier of a dependent pair (module docstring, step 4)."""

PI_ESTIMATES = ("alternate", "levels")
"""How a fit estimates the class balance π without labels (module docstring, step 5)."""

LEVELS = 3
"""Levels each continuous verifier's scores are cut into (at its pooled quantiles) for the
``levels`` estimate of π."""

MU_CLIP = (0.01, 0.99)
"""μ̂ (and π) are clipped to this range in the posterior (§5 step 7), so no single vote is decisive."""

DEPENDENCE_CORR = 0.95
"""|corr| of two verifiers' binarised votes above which they count as one check."""

MIN_VOTES = 10
"""Fewest votes a verifier (or a pair, for its co-moments and correlation) needs to be used."""

MAX_ROUNDS = 5
"""Most threshold ↔ π alternations (only columns thresholded at the π quantile need them)."""

_EM_CLIP = (1e-3, 1.0 - 1e-3)  # keeps EM's logs finite when a rate hits 0 or 1
_EM_MAX_ITERS = 1000
_EM_TOL = 1e-7


@dataclass(frozen=True, kw_only=True)
class LabelModel:
    """A fitted Weaver label model. Per-verifier tuples follow ``names`` (the vote columns).

    Dropped verifiers keep their normalisation and threshold (they are reported) but
    have NaN TPR/TNR and never touch the posterior.
    """

    names: tuple[str, ...]
    """Verifier names, in the column order of the votes the model was fitted on."""
    lo: tuple[float, ...]
    """Normalisation offset per verifier: s_norm = (s − lo) / (hi − lo)."""
    hi: tuple[float, ...]
    """Normalisation top per verifier ((0, 1) for scores already in [0, 1])."""
    thresholds: tuple[float, ...]
    """Binarisation threshold per verifier, on the normalised scale: vote = 1[s_norm ≥ t]."""
    kept: tuple[bool, ...]
    """Whether the verifier is used by the posterior."""
    pi: float
    """Estimated class balance P(correct), label-free (EM)."""
    tpr: tuple[float, ...]
    """P(vote = 1 | correct) per verifier = μ[2j+1, 1]; NaN if not kept."""
    tnr: tuple[float, ...]
    """P(vote = 0 | wrong) per verifier = μ[2j, 0]; NaN if not kept."""
    pos_rate: tuple[float, ...]
    """Share of the verifier's (non-abstaining) votes that were 1 on the fitted window; NaN if it never voted."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Verifiers left out of the posterior, with the reason."""
    version: int = 0
    """Version under which the model is published (``{ns}:labelmodel``)."""
    fitted_rows: int = 0
    """Rows (completions) in the window it was fitted on."""
    loss: float = float("nan")
    """Final moment-matching objective (0 for a perfect conditionally independent fit)."""
    converged: bool = True
    """Whether EM and L-BFGS-B both reported convergence."""
    dependence: str = "drop"
    """Policy the fit applied to dependent pairs: ``drop`` or ``merge``."""
    merged: dict[str, tuple[str, bool]] = field(default_factory=dict)
    """Under ``merge``: verifier → (the kept verifier it was averaged into, whether it enters inverted)."""
    rounds: int = 0
    """Threshold ↔ π alternations the fit ran (steps 3–5)."""
    pi_method: str = "alternate"
    """How π was set: ``levels`` (latent class model over score levels), ``alternate``
    (thresholds ↔ EM), or ``given`` (``class_balance``)."""
    em_iterations: int = 0
    """EM iterations of the last round (step 5)."""
    lbfgs_iterations: int = 0
    """L-BFGS-B iterations of the moment matching (step 6)."""

    # ------------------------------------------------------------------ views
    @property
    def kept_names(self) -> tuple[str, ...]:
        return tuple(n for n, k in zip(self.names, self.kept, strict=True) if k)

    @property
    def mu(self) -> np.ndarray:
        """μ [2k, 2] over the kept verifiers: rows (v_j = 0, v_j = 1) per verifier, columns (Y = 0, Y = 1)."""
        idx = [j for j, k in enumerate(self.kept) if k]
        tpr = np.array([self.tpr[j] for j in idx])
        tnr = np.array([self.tnr[j] for j in idx])
        return _mu_from(tpr, tnr)

    def verifier_stats(self) -> dict[str, dict[str, float | bool]]:
        """Per-verifier report for logs and dashboards (TPR, TNR, pass rate, threshold, kept)."""
        return {
            n: {"tpr": self.tpr[j], "tnr": self.tnr[j], "pos_rate": self.pos_rate[j],
                "threshold": self.thresholds[j], "kept": self.kept[j]}
            for j, n in enumerate(self.names)
        }

    def report(self) -> dict[str, Any]:
        """The fit in one plain map for logs: what was kept, dropped (why) and merged,
        TPR/TNR of the kept verifiers, π, the objective, and the iterations it took."""
        kept = self.kept_names
        warnings = []
        if not kept:
            warnings.append("no verifier kept: the posterior is each completion's mean binarised vote "
                            "(the unweighted ensemble) until a fit keeps one")
        elif len(kept) <= 3:
            # k binary verifiers give 2k + 1 unknowns and, with k = 3, exactly as many
            # independent moments: any dependence among them is absorbed into the rates.
            warnings.append(f"only {len(kept)} verifiers kept: the model is not over-determined, so dependence "
                            "among them cannot show as misfit and biases TPR/TNR instead")
        if not self.converged:
            warnings.append("EM or L-BFGS-B stopped before converging (a flat likelihood: weakly identified rates)")
        return {
            "warnings": warnings,
            "version": self.version, "rows": self.fitted_rows, "pi": round(self.pi, 4), "pi_method": self.pi_method,
            "dependence": self.dependence, "kept": list(kept), "dropped": dict(self.dropped),
            "merged": {k: {"into": r, "inverted": inv} for k, (r, inv) in self.merged.items()},
            "tpr": {n: round(self.tpr[self.names.index(n)], 4) for n in kept},
            "tnr": {n: round(self.tnr[self.names.index(n)], 4) for n in kept},
            "pos_rate": {n: round(float(r), 4) for n, r in zip(self.names, self.pos_rate, strict=True)},
            "thresholds": {n: round(float(t), 4) for n, t in zip(self.names, self.thresholds, strict=True)},
            "objective": self.loss, "converged": self.converged,
            "iterations": {"rounds": self.rounds, "em": self.em_iterations, "lbfgs": self.lbfgs_iterations},
        }

    # --------------------------------------------------------------- inference
    def binarize(self, votes: np.ndarray, names: Sequence[str] | None = None) -> np.ndarray:
        """Votes [N, m] → binarised float [N, len(self.names)]: 1, 0, or NaN (abstain).

        ``names`` gives the columns of ``votes`` when they differ from ``self.names``;
        a verifier of the model that is missing from them abstains. A column that
        others were merged into holds the merged vote.
        """
        raw = self._align(votes, names)
        lo, hi = np.array(self.lo), np.array(self.hi)
        norm = (raw - lo) / (hi - lo)
        norm[~np.isfinite(raw)] = np.nan
        thr = np.array(self.thresholds)
        index = {n: j for j, n in enumerate(self.names)}
        groups = {index[k]: (index[r], inv) for k, (r, inv) in self.merged.items()}
        return _binarise_merged(norm, thr, groups)

    def posterior(self, votes: np.ndarray, names: Sequence[str] | None = None) -> np.ndarray:
        """P(correct) per row, float64 [N] (§5 step 7). Never reads any label."""
        b = self.binarize(votes, names)
        if not any(self.kept):
            # A fit that kept nothing (too few votes yet) has no rates to weigh: the unweighted
            # ensemble, each row's mean binarised vote (π where none voted), rather than π for
            # every row, which would leave the first groups of a run without any signal.
            voted = (~np.isnan(b)).sum(axis=1)
            mean = np.nansum(b, axis=1) / np.maximum(voted, 1)
            return np.where(voted > 0, mean, float(np.clip(self.pi, *MU_CLIP)))
        logit = np.full(b.shape[0], _logit(float(np.clip(self.pi, *MU_CLIP))))
        for j, keep in enumerate(self.kept):
            if not keep:
                continue
            tpr, tnr = np.clip(self.tpr[j], *MU_CLIP), np.clip(self.tnr[j], *MU_CLIP)
            w1 = math.log(tpr) - math.log(1.0 - tnr)   # log μ[2j+1,1] − log μ[2j+1,0]
            w0 = math.log(1.0 - tpr) - math.log(tnr)   # log μ[2j,1]   − log μ[2j,0]
            col = b[:, j]
            logit += np.where(col == 1.0, w1, np.where(col == 0.0, w0, 0.0))  # NaN (abstain) adds 0
        return 1.0 / (1.0 + np.exp(-logit))

    def _align(self, votes: np.ndarray, names: Sequence[str] | None) -> np.ndarray:
        v = np.asarray(votes, dtype=np.float64)
        if v.ndim != 2:
            raise ValueError(f"votes must be 2-D [N, m], got shape {v.shape}")
        if names is None:
            if v.shape[1] != len(self.names):
                raise ValueError(f"votes have {v.shape[1]} columns; the model has {len(self.names)} verifiers {list(self.names)}")
            return v
        names = list(names)
        if len(names) != v.shape[1]:
            raise ValueError(f"{len(names)} names for {v.shape[1]} vote columns")
        col = {n: i for i, n in enumerate(names)}
        out = np.full((v.shape[0], len(self.names)), np.nan)
        for j, n in enumerate(self.names):
            if n in col:
                out[:, j] = v[:, col[n]]
        return out

    # ----------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain msgpack-able data: lists, floats, ints, bools, strings (NaN TPR/TNR mark dropped verifiers)."""
        return {
            "schema": SCHEMA,
            "names": list(self.names),
            "lo": [float(x) for x in self.lo],
            "hi": [float(x) for x in self.hi],
            "thresholds": [float(x) for x in self.thresholds],
            "kept": [bool(x) for x in self.kept],
            "pi": float(self.pi),
            "tpr": [float(x) for x in self.tpr],
            "tnr": [float(x) for x in self.tnr],
            "pos_rate": [float(x) for x in self.pos_rate],
            "dropped": {str(k): str(v) for k, v in self.dropped.items()},
            "version": int(self.version),
            "fitted_rows": int(self.fitted_rows),
            "loss": float(self.loss),
            "converged": bool(self.converged),
            "dependence": str(self.dependence),
            "merged": {str(k): [str(r), bool(inv)] for k, (r, inv) in self.merged.items()},
            "iterations": [int(self.rounds), int(self.em_iterations), int(self.lbfgs_iterations)],
            "pi_method": str(self.pi_method),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LabelModel:
        """Inverse of ``to_dict``. The data may come from Redis: every defect is a ValueError."""
        if not isinstance(d, Mapping):
            raise ValueError(f"label model must be a map, got {type(d).__name__}")
        if d.get("schema") != SCHEMA:
            raise ValueError(f"label model schema {d.get('schema')!r}, expected {SCHEMA}")
        try:
            names = tuple(d["names"])
            if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
                raise ValueError("names must be distinct strings")
            m = len(names)

            def floats(key: str) -> tuple[float, ...]:
                xs = d[key]
                if not isinstance(xs, (list, tuple)) or len(xs) != m:
                    raise ValueError(f"{key!r} must be a list of {m} numbers")
                if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs):
                    raise ValueError(f"{key!r} must hold numbers")
                return tuple(float(x) for x in xs)

            kept = d["kept"]
            if not isinstance(kept, (list, tuple)) or len(kept) != m or not all(isinstance(k, bool) for k in kept):
                raise ValueError(f"'kept' must be a list of {m} bools")
            dropped = d["dropped"]
            if not isinstance(dropped, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in dropped.items()):
                raise ValueError("'dropped' must map names to reasons")
            merged = d["merged"]
            if not isinstance(merged, Mapping) or not all(
                    k in names and isinstance(v, (list, tuple)) and len(v) == 2 and v[0] in names
                    and isinstance(v[1], bool) for k, v in merged.items()):
                raise ValueError("'merged' must map verifier names to [kept verifier name, inverted]")
            if d["dependence"] not in DEPENDENCE_POLICIES:
                raise ValueError(f"'dependence' must be one of {DEPENDENCE_POLICIES}, got {d['dependence']!r}")
            iters = d["iterations"]
            if not isinstance(iters, (list, tuple)) or len(iters) != 3 or not all(isinstance(i, int) for i in iters):
                raise ValueError("'iterations' must be [rounds, em, lbfgs] integers")
            pi = d["pi"]
            if not isinstance(pi, (int, float)) or not 0.0 <= float(pi) <= 1.0:
                raise ValueError(f"'pi' must be a number in [0, 1], got {pi!r}")
            pi_method = d.get("pi_method", "alternate")  # absent: a model written before levels existed
            if pi_method not in (*PI_ESTIMATES, "given"):
                raise ValueError(f"'pi_method' must be one of {(*PI_ESTIMATES, 'given')}, got {pi_method!r}")
            model = cls(
                names=names, lo=floats("lo"), hi=floats("hi"), thresholds=floats("thresholds"),
                kept=tuple(kept), pi=float(pi), tpr=floats("tpr"), tnr=floats("tnr"),
                pos_rate=floats("pos_rate"), dropped=dict(dropped), version=int(d["version"]),
                fitted_rows=int(d["fitted_rows"]), loss=float(d["loss"]), converged=bool(d["converged"]),
                dependence=str(d["dependence"]), merged={k: (v[0], v[1]) for k, v in merged.items()},
                rounds=iters[0], em_iterations=iters[1], lbfgs_iterations=iters[2], pi_method=pi_method,
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed label model: {exc!r}") from exc
        for j in range(m):
            if not model.hi[j] > model.lo[j]:
                raise ValueError(f"normalisation of {names[j]!r} has hi <= lo")
            if model.kept[j] and not (0.0 <= model.tpr[j] <= 1.0 and 0.0 <= model.tnr[j] <= 1.0):
                raise ValueError(f"kept verifier {names[j]!r} needs TPR/TNR in [0, 1]")
        return model


# ====================================================================== fitting
def fit_label_model(
    votes: np.ndarray,
    names: Sequence[str],
    *,
    version: int = 0,
    thresholds: Mapping[str, float] | Sequence[float] | None = None,
    dependence: str = "drop",
    sound: Sequence[str] = (),
    class_balance: float | None = None,
    pi_estimate: str = "alternate",
) -> LabelModel:
    """Fit the Weaver label model on pooled votes [N, m] (NaN = abstain) without labels.

    ``thresholds`` (normalised scale, per name or per column) override the
    binarisation rule for those verifiers; ``dependence`` (``drop`` or ``merge``) is
    what happens to the weaker verifier of a dependent pair; ``sound`` names verifiers
    a correct answer always passes (known from how they are built), whose TPR is then
    held at 1 in EM and in moment matching instead of estimated; ``class_balance``, a
    known π in (0, 1), is used instead of estimating π (step 5); ``pi_estimate``
    (``alternate`` or ``levels``) is how π is estimated when it is not known. See the
    module docstring for each step.
    """
    if class_balance is not None and not 0.0 < class_balance < 1.0:
        raise ValueError(f"class_balance must lie in (0, 1), got {class_balance!r}")
    if pi_estimate not in PI_ESTIMATES:
        raise ValueError(f"pi_estimate must be one of {PI_ESTIMATES}, got {pi_estimate!r}")
    if dependence not in DEPENDENCE_POLICIES:
        raise ValueError(f"dependence must be one of {DEPENDENCE_POLICIES}, got {dependence!r}")
    unknown = set(sound) - set(names)
    if unknown:
        raise ValueError(f"sound verifiers {sorted(unknown)} are not among {list(names)}")
    with _single_threaded_blas():
        return _fit(votes, names, version=version, thresholds=thresholds, dependence=dependence, sound=tuple(sound),
                    class_balance=class_balance, pi_estimate=pi_estimate)


def _fit(
    votes: np.ndarray,
    names: Sequence[str],
    *,
    version: int,
    thresholds: Mapping[str, float] | Sequence[float] | None,
    dependence: str,
    sound: tuple[str, ...] = (),
    class_balance: float | None = None,
    pi_estimate: str = "alternate",
) -> LabelModel:
    raw = np.array(votes, dtype=np.float64)  # copy: non-finite → NaN below
    names = tuple(names)
    if raw.ndim != 2 or raw.shape[1] != len(names):
        raise ValueError(f"votes must be [N, {len(names)}] for names {list(names)}, got shape {raw.shape}")
    if len(set(names)) != len(names):
        raise ValueError(f"verifier names must be distinct: {list(names)}")
    raw[~np.isfinite(raw)] = np.nan
    n, m = raw.shape

    lo, hi = _normalisation(raw)
    norm = (raw - lo) / (hi - lo)
    binary = np.array([np.isin(norm[~np.isnan(norm[:, j]), j], (0.0, 1.0)).all() for j in range(m)])
    given = _given_thresholds(thresholds, names)
    quantile_cols = [j for j in range(m) if given[j] is None and not binary[j]]

    # Steps 3–5, alternated until π settles: the quantile thresholds need π, the degenerate
    # filter's rule depends on π, and π comes from the binarised, filtered votes. Round 0
    # starts from π = 0.5 with quantile columns at the midpoint of their normalised range.
    # A known class balance sets π and the quantile thresholds once: one round. So does the
    # levels estimate, which needs no threshold, when some column is thresholded at a quantile.
    pi_method = "given" if class_balance is not None else pi_estimate
    if class_balance is None and pi_estimate == "levels":
        if quantile_cols:
            class_balance = _levels_pi(norm, given, names, sound)
        else:
            pi_method = "alternate"  # every threshold fixed: EM on the votes is the same model
    pi = 0.5 if class_balance is None else float(class_balance)
    thr = np.array([g if g is not None else 0.5 for g in given], dtype=np.float64)
    if class_balance is not None:
        _quantile_thresholds(thr, norm, quantile_cols, pi)
    rounds = 0
    for rounds in range(1, MAX_ROUNDS + 1):
        b = _binarise(norm, thr)
        rate = _pos_rates(b)
        kept, dropped, pairs = _select(b, rate, pi, names, sound)
        groups: dict[int, tuple[int, bool]] = {}
        if dependence == "merge" and pairs:
            groups = _merge_groups(pairs)
            b = _binarise_merged(norm, thr, groups)
            for k, (root, inv) in groups.items():
                dropped[names[k]] = dropped[names[k]].replace("dependent on", "merged into", 1) + (
                    " (inverted)" if inv else "")
        fixed = np.array([names[j] in sound for j in range(m)])[kept]
        em_tpr, em_tnr, new_pi, em_ok, em_iters = _em(b[:, kept], fixed, pi=class_balance)
        settled = class_balance is not None or abs(new_pi - pi) < 1e-3
        pi = new_pi
        if settled:
            break
        _quantile_thresholds(thr, norm, quantile_cols, pi)

    tpr_k, tnr_k, loss, mm_ok, mm_iters = _moment_match(b[:, kept], pi, em_tpr, em_tnr, fixed)
    tpr = np.full(m, np.nan)
    tnr = np.full(m, np.nan)
    tpr[kept], tnr[kept] = tpr_k, tnr_k
    return LabelModel(
        names=names, lo=tuple(float(x) for x in lo), hi=tuple(float(x) for x in hi),
        thresholds=tuple(float(x) for x in thr), kept=tuple(bool(k) for k in kept), pi=float(pi),
        tpr=tuple(float(x) for x in tpr), tnr=tuple(float(x) for x in tnr),
        pos_rate=tuple(float(x) for x in rate), dropped=dropped, version=int(version),
        fitted_rows=int(n), loss=float(loss), converged=bool(em_ok and mm_ok), dependence=dependence,
        merged={names[k]: (names[r], bool(inv)) for k, (r, inv) in groups.items()},
        rounds=rounds, em_iterations=em_iters, lbfgs_iterations=mm_iters, pi_method=pi_method,
    )


def _mid_ranks(hist: np.ndarray) -> np.ndarray:
    """Mid-rank share in [0, 1] of each value of a column, from its counts ``hist`` (ties share one)."""
    hist = hist.astype(np.float64)
    return (np.cumsum(hist) - hist / 2.0) / max(hist.sum(), 1.0)


def _levels(norm: np.ndarray, given: Sequence[float | None]) -> tuple[np.ndarray, list[int], np.ndarray]:
    """Step 5's π-free coding of the votes: level codes [N, m] (−1 abstain), levels per column,
    and the columns used (enough votes, more than one level, not a dependent copy).

    A column with a given threshold, or whose scores are all 0 or 1, has two levels (its vote);
    any other is cut at the ``LEVELS``-quantiles of its own pooled scores (ties merge levels)."""
    n, m = norm.shape
    codes = np.full((n, m), -1, dtype=np.int64)
    counts = [0] * m
    for j in range(m):
        voted = ~np.isnan(norm[:, j])
        col = norm[voted, j]
        if given[j] is not None:
            level = (col >= given[j]).astype(np.int64)
        else:
            values, inverse = np.unique(col, return_inverse=True)
            if values.size <= 2:
                level = inverse
            else:
                # Level of a score = its mid-rank share cut into LEVELS equal parts, so tied scores
                # share a level and a column piled on one value still splits off the rest.
                mid = _mid_ranks(np.bincount(inverse))
                level = np.minimum((mid * LEVELS).astype(np.int64), LEVELS - 1)[inverse]
            level = np.unique(level, return_inverse=True)[1]  # levels numbered 0.. without gaps
        codes[voted, j] = level
        counts[j] = int(level.max()) + 1 if col.size else 0
    use = np.array([counts[j] > 1 and (codes[:, j] >= 0).sum() >= MIN_VOTES for j in range(m)])
    # Dependent pairs (as step 4 finds them, here on the level codes): one of each stays.
    _dependent_pairs(np.maximum(codes, 0).astype(np.float64), codes >= 0, use)
    return codes, [max(k, 1) for k in counts], use


def _levels_pi(norm: np.ndarray, given: Sequence[float | None], names: tuple[str, ...], sound: tuple[str, ...],
               ) -> float:
    """Step 5, ``levels``: π from EM on a latent class model over the score levels of
    :func:`_levels` (one P(level | class) table per verifier, verifiers independent given
    the class), started from each row's mean rank-normalised score: the "better than random
    on average" assumption. A sound verifier's level 0 is held impossible for a right answer."""
    codes, counts, use = _levels(norm, given)
    cols = np.flatnonzero(use)
    if cols.size < 2:
        return 0.5
    codes = codes[:, cols]
    counts = [counts[j] for j in cols]
    held = [names[j] in sound and counts[i] == 2 for i, j in enumerate(cols)]
    k = codes.shape[1]
    # Rows collapse to their distinct level patterns, weighted by their counts.
    pat, w = np.unique(codes, axis=0, return_counts=True)
    w = w.astype(np.float64)
    onehot = [(pat[:, i, None] == np.arange(counts[i])[None, :]).astype(np.float64) for i in range(k)]
    # Start: mean over voting columns of the rank-normalised score (mid-ranks over the pooled rows).
    rank = np.zeros(pat.shape)
    for i in range(k):
        col = codes[:, i]
        voted = col >= 0
        mid = _mid_ranks(np.bincount(col[voted], minlength=counts[i]))
        rank[:, i] = np.where(pat[:, i] >= 0, mid[np.maximum(pat[:, i], 0)], np.nan)
    n_voted = (pat >= 0).sum(axis=1)
    q = np.where(n_voted > 0, np.nansum(rank, axis=1) / np.maximum(n_voted, 1), 0.5)
    pi = 0.5
    for _ in range(_EM_MAX_ITERS):
        wq, wq0 = w * q, w * (1.0 - q)
        new_pi = float(np.clip(wq.sum() / w.sum(), *_EM_CLIP))
        llr = np.full(pat.shape[0], _logit(new_pi))
        for i in range(k):
            p1 = wq @ onehot[i] + 0.5
            p0 = wq0 @ onehot[i] + 0.5
            p1, p0 = p1 / p1.sum(), p0 / p0.sum()
            if held[i]:
                p1 = np.array([_EM_CLIP[0], 1.0 - _EM_CLIP[0]])
            llr += onehot[i] @ (np.log(p1) - np.log(p0))
        new_q = 1.0 / (1.0 + np.exp(-llr))
        done = abs(new_pi - pi) < _EM_TOL and float(np.abs(new_q - q).max()) < 1e-6
        q, pi = new_q, new_pi
        if done:
            break
    # The class the verifiers score higher is "right" (no held column: the solution may have swapped).
    mean_rank = np.nanmean(rank, axis=1)
    ok = np.isfinite(mean_rank)
    hi_mean = np.average(mean_rank[ok], weights=(w * q)[ok]) if (w * q)[ok].sum() > 0 else 1.0
    lo_mean = np.average(mean_rank[ok], weights=(w * (1 - q))[ok]) if (w * (1 - q))[ok].sum() > 0 else 0.0
    if hi_mean < lo_mean and not any(held):
        pi = 1.0 - pi
    return float(np.clip(pi, *_EM_CLIP))


def _quantile_thresholds(thr: np.ndarray, norm: np.ndarray, cols: Sequence[int], pi: float) -> None:
    """Step 3's label-free rule, in place: each of ``cols`` thresholded at the (1 − π) quantile of
    its own normalised scores (0.5 for a column with no votes)."""
    for j in cols:
        col = norm[~np.isnan(norm[:, j]), j]
        thr[j] = float(np.quantile(col, 1.0 - pi)) if col.size else 0.5


def _normalisation(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-column (lo, hi): (0, 1) for scores already in [0, 1], else the pooled min and max."""
    m = raw.shape[1]
    lo, hi = np.zeros(m), np.ones(m)
    for j in range(m):
        col = raw[~np.isnan(raw[:, j]), j]
        if col.size == 0 or (col.min() >= 0.0 and col.max() <= 1.0):
            continue
        lo[j] = col.min()
        # A constant out-of-range column maps to 0; it is degenerate and gets filtered.
        hi[j] = col.max() if col.max() > col.min() else col.min() + 1.0
    return lo, hi


def _given_thresholds(thresholds: Mapping[str, float] | Sequence[float] | None, names: tuple[str, ...]) -> list[float | None]:
    if thresholds is None:
        return [None] * len(names)
    if isinstance(thresholds, Mapping):
        unknown = set(thresholds) - set(names)
        if unknown:
            raise ValueError(f"thresholds for unknown verifiers {sorted(unknown)}; allowed: {list(names)}")
        return [None if thresholds.get(n) is None else float(thresholds[n]) for n in names]
    ts = list(thresholds)
    if len(ts) != len(names):
        raise ValueError(f"{len(ts)} thresholds for {len(names)} verifiers")
    return [None if t is None else float(t) for t in ts]


def _binarise(norm: np.ndarray, thr: np.ndarray) -> np.ndarray:
    b = (norm >= thr).astype(np.float64)
    b[np.isnan(norm)] = np.nan
    return b


def _merge_groups(pairs: Sequence[tuple[int, int, float]]) -> dict[int, tuple[int, bool]]:
    """Dependent pairs (dropped, stays, corr) → {member: (root it is merged into, inverted vs the root)}.

    Pairs chain (a → b, then b → c): members follow the chain to the column that is
    still kept, and their sign relative to it is the product of the signs on the way.
    """
    parent = {lo: (hi, c < 0) for lo, hi, c in pairs}
    out: dict[int, tuple[int, bool]] = {}
    for k in parent:
        root, inv = k, False
        while root in parent:
            root, flip = parent[root]
            inv ^= flip
        out[k] = (root, inv)
    return out


def _binarise_merged(norm: np.ndarray, thr: np.ndarray, groups: Mapping[int, tuple[int, bool]]) -> np.ndarray:
    """Binarise, then replace each merge root's column by its group's vote on each row:
    1[mean s ≥ mean t] over the members that voted (an inverted member as 1 − s, 1 − t)."""
    b = _binarise(norm, thr)
    roots: dict[int, list[tuple[int, bool]]] = {}
    for k, (root, inv) in groups.items():
        roots.setdefault(root, [(root, False)]).append((k, inv))
    for root, members in roots.items():
        s = np.column_stack([1.0 - norm[:, k] if inv else norm[:, k] for k, inv in members])
        t = np.array([1.0 - thr[k] if inv else thr[k] for k, inv in members])
        voted = ~np.isnan(s)
        cnt = voted.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            s_mean = np.where(voted, s, 0.0).sum(axis=1) / cnt
            t_mean = (voted * t).sum(axis=1) / cnt
        col = (s_mean >= t_mean - 1e-12).astype(np.float64)
        col[cnt == 0] = np.nan
        b[:, root] = col
    return b


def _pos_rates(b: np.ndarray) -> np.ndarray:
    obs = ~np.isnan(b)
    cnt = obs.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, np.nansum(b, axis=0) / np.maximum(cnt, 1), np.nan)


def _rate_ok(r: float, pi: float) -> bool:
    """§5 step 4: is a positive rate r informative at class balance π?"""
    if not np.isfinite(r):
        return False
    if pi < 0.2:
        return 0.0 < r < 0.5
    if pi > 0.8:
        return 0.5 < r < 1.0
    return 0.1 < r < 0.9


def _select(
    b: np.ndarray, rate: np.ndarray, pi: float, names: tuple[str, ...], sound: tuple[str, ...] = (),
) -> tuple[np.ndarray, dict[str, str], list[tuple[int, int, float]]]:
    """Steps 4 and dependence: boolean kept mask over columns, reasons for the rest, and
    the dependent pairs found, as (column taken out, column that stays, correlation).

    A sound verifier passing almost every row is kept all the same (unless it is
    constant): its TPR is known, so only the few wrong answers it rejects carry weight,
    and each of those rejections is decisive rather than noise."""
    m = b.shape[1]
    obs = ~np.isnan(b)
    n_votes = obs.sum(axis=0)
    dropped: dict[str, str] = {}
    kept = np.zeros(m, dtype=bool)
    for j in range(m):
        if n_votes[j] < MIN_VOTES:
            dropped[names[j]] = f"too few votes ({n_votes[j]} < {MIN_VOTES})"
        elif not _rate_ok(float(rate[j]), pi) and not (names[j] in sound and 0.0 < rate[j] < 1.0):
            dropped[names[j]] = f"degenerate positive rate {rate[j]:.3f} at pi={pi:.3f}"
        else:
            kept[j] = True
    if kept.sum() < 2:
        # Better two imperfect verifiers than none: restore the non-constant ones whose
        # pass rate is closest to the class balance.
        spare = [j for j in range(m) if not kept[j] and n_votes[j] >= MIN_VOTES and 0.0 < rate[j] < 1.0]
        spare.sort(key=lambda j: abs(rate[j] - pi))
        for j in spare[: 2 - int(kept.sum())]:
            kept[j] = True
            del dropped[names[j]]
    pairs = _dependent_pairs(np.where(obs, b, 0.0), obs, kept)
    for loser, winner, corr, shared in pairs:
        dropped[names[loser]] = (
            f"dependent on {names[winner]!r}: |corr| = {abs(corr):.3f} > {DEPENDENCE_CORR} over {shared} rows"
        )
    pairs = [(loser, winner, corr) for loser, winner, corr, _ in pairs]
    return kept, dropped, pairs


def _dependent_pairs(v: np.ndarray, obs: np.ndarray, keep: np.ndarray) -> list[tuple[int, int, float, int]]:
    """Step 4's dependent pairs among the ``keep`` columns of values ``v`` [N, m] (0 where
    ``obs`` is False): two columns whose |Pearson correlation| over the rows where both
    voted exceeds ``DEPENDENCE_CORR`` (with at least ``MIN_VOTES`` such rows). Of each pair
    the column with more votes (on a tie, the earlier) stays; the other is taken out of
    ``keep`` in place. Returns (column taken out, column that stays, correlation, shared rows)."""
    m = v.shape[1]
    a = obs.astype(np.float64)
    n_votes = obs.sum(axis=0)
    # Pairwise statistics over the rows where both voted, all pairs at once.
    both = a.T @ a                  # rows where i and j both voted
    sx = v.T @ a                    # sx[i, j] = sum of i's values on those rows
    sxx = (v * v).T @ a
    sxy = v.T @ v
    with np.errstate(invalid="ignore", divide="ignore"):
        cov = both * sxy - sx * sx.T
        var_x = both * sxx - sx * sx    # i's variance term on the shared rows
        corr = cov / np.sqrt(var_x * var_x.T)
    pairs: list[tuple[int, int, float, int]] = []
    for i in range(m):
        for j in range(i + 1, m):
            if not (keep[i] and keep[j]) or both[i, j] < MIN_VOTES or not np.isfinite(corr[i, j]):
                continue
            if abs(float(corr[i, j])) > DEPENDENCE_CORR:
                loser, winner = (i, j) if n_votes[i] < n_votes[j] else (j, i)
                keep[loser] = False
                pairs.append((loser, winner, float(corr[i, j]), int(both[i, j])))
    return pairs


def _em(b: np.ndarray, fixed: np.ndarray | None = None, pi: float | None = None,
        ) -> tuple[np.ndarray, np.ndarray, float, bool, int]:
    """Dawid–Skene EM on binarised votes [N, k] (NaN = abstain): (TPR, TNR, π, converged, iterations).

    ``fixed`` marks sound verifiers, whose TPR is held at 1 (clipped like every rate);
    ``pi``, when given, is the known class balance, held instead of estimated.

    Started from the soft majority vote (the "better than random on average" assumption);
    a solution that still ends worse than random on average is label-swapped. Rows are
    collapsed to their distinct vote patterns (at most 3^k, usually a few hundred) with
    counts, which makes each iteration independent of N.
    """
    n, k = b.shape
    known_pi = pi
    if k == 0 or n == 0:
        return np.zeros(0), np.zeros(0), 0.5 if known_pi is None else known_pi, True, 0
    state = np.where(np.isnan(b), 0, b + 1).astype(np.int64)      # 0 abstain, 1 vote 0, 2 vote 1
    codes = state @ (3 ** np.arange(k, dtype=np.int64))
    _, first, count = np.unique(codes, return_index=True, return_counts=True)
    pat = state[first]
    a = (pat > 0).astype(np.float64)
    v = (pat == 2).astype(np.float64)
    w = count.astype(np.float64)
    votes_per_row = a.sum(axis=1)
    q = np.where(votes_per_row > 0, v.sum(axis=1) / np.maximum(votes_per_row, 1.0), 0.5)
    tpr = tnr = np.zeros(k)
    pi = 0.5
    converged = False
    iters = 0
    for iters in range(1, _EM_MAX_ITERS + 1):
        # M step (weighted by pattern counts)
        wq, wq0 = w * q, w * (1.0 - q)
        new_pi = float(np.clip(wq.sum() / w.sum(), *_EM_CLIP)) if known_pi is None else known_pi
        new_tpr = np.clip((wq @ v) / np.maximum(wq @ a, 1e-12), *_EM_CLIP)
        if fixed is not None:
            new_tpr[fixed] = _EM_CLIP[1]
        new_tnr = np.clip((wq0 @ (a - v)) / np.maximum(wq0 @ a, 1e-12), *_EM_CLIP)
        delta = max(abs(new_pi - pi), float(np.abs(new_tpr - tpr).max()), float(np.abs(new_tnr - tnr).max()))
        pi, tpr, tnr = new_pi, new_tpr, new_tnr
        if delta < _EM_TOL:
            converged = True
            break
        # E step: per-pattern log-likelihood ratio of Y = 1 vs Y = 0
        llr = v @ (np.log(tpr) - np.log(1.0 - tnr)) + (a - v) @ (np.log(1.0 - tpr) - np.log(tnr))
        q = 1.0 / (1.0 + np.exp(-(_logit(pi) + llr)))
    if np.mean(tpr + tnr) < 1.0 and (fixed is None or not fixed.any()) and known_pi is None:  # label swap: Y' = 1 − Y
        tpr, tnr, pi = 1.0 - tnr, 1.0 - tpr, 1.0 - pi
    return tpr, tnr, pi, converged, iters


def _mu_from(tpr: np.ndarray, tnr: np.ndarray) -> np.ndarray:
    """μ [2k, 2]: μ[2j, 0] = TNR, μ[2j+1, 0] = 1 − TNR, μ[2j, 1] = 1 − TPR, μ[2j+1, 1] = TPR."""
    k = tpr.shape[0]
    mu = np.empty((2 * k, 2))
    mu[0::2, 0], mu[1::2, 0] = tnr, 1.0 - tnr
    mu[0::2, 1], mu[1::2, 1] = 1.0 - tpr, tpr
    return mu


def _moment_match(
    b: np.ndarray, pi: float, tpr0: np.ndarray, tnr0: np.ndarray, fixed: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, float, bool, int]:
    """§5 step 6: bounded L-BFGS-B fit of μ to the pairwise vote moments, from the EM solution.

    A sound verifier's TPR (``fixed``) is bounded to [1 − 1e-3, 1] (the knowledge that a
    correct answer always passes it also breaks the label-swap symmetry).
    Returns (TPR, TNR, objective, converged, iterations)."""
    n, k = b.shape
    if k == 0:
        return np.zeros(0), np.zeros(0), 0.0, True, 0
    obs = ~np.isnan(b)
    one_hot = np.zeros((n, 2 * k))
    one_hot[:, 0::2] = obs & (b == 0.0)
    one_hot[:, 1::2] = obs & (b == 1.0)
    pair_n = np.kron(obs.T.astype(np.float64) @ obs.astype(np.float64), np.ones((2, 2)))
    o = (one_hot.T @ one_hot) / np.maximum(pair_n, 1.0)  # each entry over the rows where both voted
    block = np.kron(np.eye(k), np.ones((2, 2))).astype(bool)
    mask = (~block & (pair_n >= MIN_VOTES)).astype(np.float64)
    diag_o = np.diag(o).copy()
    p = np.array([1.0 - pi, pi])
    pm = np.diag(p)

    def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
        mu = _mu_from(x[:k], x[k:])
        r = mask * (mu @ pm @ mu.T - o)
        e = mu @ p - diag_o
        f = float((r * r).sum() + (e * e).sum())
        g_mu = 4.0 * r @ mu @ pm + 2.0 * np.outer(e, p)  # r is symmetric
        g_tpr = g_mu[1::2, 1] - g_mu[0::2, 1]
        g_tnr = g_mu[0::2, 0] - g_mu[1::2, 0]
        return f, np.concatenate([g_tpr, g_tnr])

    x0 = np.concatenate([tpr0, tnr0])
    bounds = [(_EM_CLIP[1], 1.0) if fixed is not None and fixed[j] else (0.0, 1.0) for j in range(k)] + [(0.0, 1.0)] * k
    from scipy.optimize import minimize  # here, not at import: scipy.optimize costs ~1 s, which every CLI start paid

    res = minimize(objective, x0, jac=True, method="L-BFGS-B", bounds=bounds,
                   options={"maxiter": 10_000, "maxfun": 20_000, "ftol": 1e-15, "gtol": 1e-11})
    tpr, tnr = res.x[:k], res.x[k:]
    if np.mean(tpr + tnr) < 1.0 and (fixed is None or not fixed.any()):
        # With π held fixed the swapped solution is not a symmetric optimum, so this means
        # the moments could not pin μ down (e.g. two verifiers): keep the EM estimate.
        return tpr0, tnr0, float(res.fun), False, int(res.nit)
    return tpr, tnr, float(res.fun), bool(res.success), int(res.nit)


@contextlib.contextmanager
def _single_threaded_blas() -> Iterator[None]:
    """Run the block with every loaded OpenBLAS limited to one thread, then restore.

    Why: L-BFGS-B calls BLAS/LAPACK on tiny (2k × 2k) matrices every iteration, and
    on a machine whose cores are busy (the whole pipeline shares them) OpenBLAS's
    thread hand-off made the 4096 × 7 fit ~15× slower (0.20 s vs 0.013 s measured).
    This is threadpoolctl's trick without the dependency: find the OpenBLAS copies
    mapped into the process (numpy and scipy each ship one) and call their
    ``*_set_num_threads``. Anything unexpected makes it a no-op, never an error.
    """
    restore: list[tuple[Any, int]] = []
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line}
        for path in sorted(paths):
            lib = ctypes.CDLL(path)
            for get_name, set_name in _OPENBLAS_THREAD_SYMBOLS:
                if hasattr(lib, get_name) and hasattr(lib, set_name):
                    getter, setter = getattr(lib, get_name), getattr(lib, set_name)
                    getter.restype = ctypes.c_int
                    setter.argtypes = [ctypes.c_int]
                    restore.append((setter, int(getter())))
                    setter(1)
                    break
    except Exception:  # noqa: BLE001 - a speed-up only; never let it break a fit
        pass
    try:
        yield
    finally:
        for setter, threads in restore:
            with contextlib.suppress(Exception):
                setter(threads)


_OPENBLAS_THREAD_SYMBOLS = (
    ("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
    ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
    ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
    ("openblas_get_num_threads", "openblas_set_num_threads"),
)


def _logit(p: float) -> float:
    return math.log(p) - math.log1p(-p)
