"""How good a verifier's scores are: best-of-G selection accuracy and calibration.

Used by ``bench/bench_verifier.py`` and the tests; all functions are pure numpy.

- ``selection_accuracy``: per group, pick the top-scored response; the share of groups
  whose pick is correct. Ties are resolved in expectation (the mean truth of the tied
  top responses), so a coarse score is neither helped nor hurt by an arbitrary
  tie-break; a NaN score ranks last.
- ``ece``: expected calibration error with equal-width bins over [0, 1]: Σ_b (n_b/N)·|mean p − mean y|.
- ``brier``: mean squared error of the probabilities against the 0/1 truth.
"""

from __future__ import annotations

import numpy as np


def _grouped(x: np.ndarray, group_size: int | None) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if group_size is not None:
        if x.ndim != 1 or group_size < 1 or x.size % group_size:
            raise ValueError(f"flat scores of length {x.size} do not split into groups of {group_size}")
        x = x.reshape(-1, group_size)
    if x.ndim != 2:
        raise ValueError(f"scores must be [groups, G] (or flat with group_size), got shape {x.shape}")
    return x


def selection_accuracy(scores: np.ndarray, truth: np.ndarray, group_size: int | None = None, *,
                       solvable_only: bool = False) -> float:
    """Share of groups whose top-scored response is correct (ties in expectation).

    ``scores`` and ``truth`` are [groups, G], or flat with ``group_size``. With
    ``solvable_only`` only groups with at least one correct response count (the
    denominator of "selection among the solvable"); otherwise every group does, so the
    ceiling is pass@G.
    """
    s, t = _grouped(scores, group_size), _grouped(truth, group_size)
    if s.shape != t.shape:
        raise ValueError(f"scores {s.shape} and truth {t.shape} differ in shape")
    s = np.where(np.isnan(s), -np.inf, s)
    top = s >= s.max(axis=1, keepdims=True) - 1e-12
    hit = (t * top).sum(axis=1) / top.sum(axis=1)
    if solvable_only:
        hit = hit[t.max(axis=1) > 0]
    return float(hit.mean()) if hit.size else float("nan")


def pass_at_g(truth: np.ndarray, group_size: int | None = None) -> float:
    """Share of groups with at least one correct response: the ceiling of any selection."""
    return float((_grouped(truth, group_size).max(axis=1) > 0).mean())


def ece(p: np.ndarray, y: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error of probabilities ``p`` against 0/1 truth ``y`` (equal-width bins)."""
    p, y = np.asarray(p, dtype=np.float64).ravel(), np.asarray(y, dtype=np.float64).ravel()
    if p.shape != y.shape or p.size == 0:
        raise ValueError(f"need equally long non-empty p and y, got {p.shape} and {y.shape}")
    if np.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError("probabilities must be finite and in [0, 1]")
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)
    count = np.bincount(idx, minlength=bins).astype(np.float64)
    gap = np.abs(np.bincount(idx, weights=p, minlength=bins) - np.bincount(idx, weights=y, minlength=bins))
    return float(gap.sum() / p.size) if count.sum() else float("nan")


def brier(p: np.ndarray, y: np.ndarray) -> float:
    """Mean squared error of probabilities ``p`` against 0/1 truth ``y``."""
    p, y = np.asarray(p, dtype=np.float64).ravel(), np.asarray(y, dtype=np.float64).ravel()
    if p.shape != y.shape or p.size == 0:
        raise ValueError(f"need equally long non-empty p and y, got {p.shape} and {y.shape}")
    return float(np.mean((p - y) ** 2))
