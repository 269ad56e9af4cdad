"""Selection accuracy, ECE and Brier on hand-checkable inputs."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.algo.selection import brier, ece, pass_at_g, selection_accuracy


def test_selection_picks_the_top_score_per_group():
    scores = np.array([[0.9, 0.1, 0.2], [0.1, 0.8, 0.3], [0.5, 0.4, 0.6]])
    truth = np.array([[1, 0, 0], [1, 0, 0], [0, 0, 0]])
    # group 0 right, group 1 wrong, group 2 has no correct answer at all
    assert selection_accuracy(scores, truth) == pytest.approx(1 / 3)
    assert selection_accuracy(scores, truth, solvable_only=True) == pytest.approx(1 / 2)
    assert selection_accuracy(scores.ravel(), truth.ravel(), group_size=3) == pytest.approx(1 / 3)
    assert pass_at_g(truth) == pytest.approx(2 / 3)


def test_ties_count_in_expectation_and_nan_ranks_last():
    scores = np.array([[1.0, 1.0, 1.0, 0.0], [np.nan, 0.2, 0.1, np.nan]])
    truth = np.array([[1, 0, 0, 1], [1, 0, 1, 0]])
    # group 0: one of the three tied tops is right -> 1/3; group 1: 0.2 wins, wrong
    assert selection_accuracy(scores, truth) == pytest.approx((1 / 3 + 0) / 2)
    # a constant score gives the base rate of each group (first-sample accuracy in expectation)
    assert selection_accuracy(np.zeros((2, 4)), truth) == pytest.approx(0.5)


def test_selection_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="groups of 3"):
        selection_accuracy(np.zeros(4), np.zeros(4), group_size=3)
    with pytest.raises(ValueError, match="differ in shape"):
        selection_accuracy(np.zeros((2, 3)), np.zeros((3, 2)))


def test_ece_by_hand():
    p = np.array([0.15, 0.15, 0.15, 0.15, 0.85, 0.85])
    y = np.array([0, 0, 1, 1, 1, 1])
    # bin 1: mean p .15 vs mean y .5, weight 4/6; bin 8: .85 vs 1, weight 2/6
    assert ece(p, y) == pytest.approx(4 / 6 * 0.35 + 2 / 6 * 0.15)
    assert ece(np.array([1.0, 0.0]), np.array([1, 0])) == 0.0  # p = 1 lands in the top bin
    rng = np.random.default_rng(0)
    q = rng.random(200_000)
    assert ece(q, (rng.random(q.size) < q).astype(float)) < 0.01  # calibrated by construction
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        ece(np.array([1.2]), np.array([1]))


def test_brier_by_hand():
    assert brier(np.array([1.0, 0.0, 0.5]), np.array([1, 1, 0])) == pytest.approx((0 + 1 + 0.25) / 3)
    assert brier(np.full(10, 0.3), np.zeros(10)) == pytest.approx(0.09)
