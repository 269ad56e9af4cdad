"""Weaver label model: recovery on synthetic votes with known truth, and on the real arithmetic task."""

from __future__ import annotations

import random
import time

import msgpack
import numpy as np
import pytest

from pipeline.algo.labelmodel import DEPENDENCE_CORR, LabelModel, _select, fit_label_model
from pipeline.tasks.arithmetic import random_problem
from pipeline.tasks.arithmetic import correctness
from pipeline.verifiers.registry import DEFAULT_VERIFIERS, score_group

# Conditionally independent verifiers with accuracies in 0.6–0.85 and unequal TPR/TNR.
TPR = np.array([0.60, 0.70, 0.85, 0.75, 0.65, 0.80, 0.70])
TNR = np.array([0.70, 0.60, 0.80, 0.85, 0.75, 0.65, 0.80])
NAMES = [f"v{j}" for j in range(len(TPR))]


def synthetic(n: int, pi: float, *, seed: int, tpr=TPR, tnr=TNR) -> tuple[np.ndarray, np.ndarray]:
    """(truth [n], binary votes [n, m]) with P(vote=1 | y) = TPR if y else 1 − TNR, independently."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < pi).astype(np.float64)
    p_one = np.where(y[:, None] == 1.0, tpr, 1.0 - tnr)
    return y, (rng.random((n, len(tpr))) < p_one).astype(np.float64)


def accuracy(score: np.ndarray, y: np.ndarray, threshold: float = 0.5) -> float:
    return float(((score > threshold) == (y == 1.0)).mean())


def selection_accuracy(score: np.ndarray, y: np.ndarray, group_size: int) -> float:
    """Share of groups (with at least one correct answer) whose top-scored answer is correct.

    Rows are consecutive groups of ``group_size``. Ties are resolved in expectation (the
    mean truth over the tied top answers), so a coarse score is neither helped nor hurt
    by an arbitrary tie-break.
    """
    s, t = score.reshape(-1, group_size), y.reshape(-1, group_size)
    top = s >= s.max(axis=1, keepdims=True) - 1e-12
    hit = (t * top).sum(axis=1) / top.sum(axis=1)
    return float(hit[t.max(axis=1) > 0].mean())


def ece(p: np.ndarray, y: np.ndarray, bins: int = 10) -> float:
    idx = np.minimum((p * bins).astype(int), bins - 1)
    return float(sum(abs(p[idx == k].mean() - y[idx == k].mean()) * (idx == k).mean() for k in range(bins) if (idx == k).any()))


# --------------------------------------------------------------- synthetic truth
@pytest.fixture(scope="module", params=[0.3, 0.7], ids=["pi=0.3", "pi=0.7"])
def synth_fit(request):
    pi = request.param
    y, votes = synthetic(40_000, pi, seed=int(pi * 10))
    return pi, y, votes, fit_label_model(votes, NAMES)


def test_the_posterior_beats_majority_vote_and_the_best_single_verifier(synth_fit):
    _, y, votes, model = synth_fit
    post = model.posterior(votes)
    weaver = accuracy(post, y)
    majority = accuracy(votes.mean(axis=1), y)
    best_single = max(accuracy(votes[:, j], y) for j in range(votes.shape[1]))
    assert weaver > majority + 0.005 and weaver > best_single + 0.05, (weaver, majority, best_single)

    # Read as 5000 prompts with 8 answers each: pick the top-scored answer per prompt.
    weaver_sel = selection_accuracy(post, y, 8)
    majority_sel = selection_accuracy(votes.mean(axis=1), y, 8)
    single_sel = max(selection_accuracy(votes[:, j], y, 8) for j in range(votes.shape[1]))
    assert weaver_sel > majority_sel and weaver_sel > single_sel, (weaver_sel, majority_sel, single_sel)


def test_tpr_tnr_and_class_balance_are_recovered_without_labels(synth_fit):
    pi, _, _, model = synth_fit
    assert model.kept == (True,) * len(NAMES) and model.dropped == {}
    assert model.pi == pytest.approx(pi, abs=0.03)
    np.testing.assert_allclose(model.tpr, TPR, atol=0.05)
    np.testing.assert_allclose(model.tnr, TNR, atol=0.05)
    assert model.converged and model.fitted_rows == 40_000


def test_mu_matches_the_reported_tpr_and_tnr(synth_fit):
    _, _, _, model = synth_fit
    mu = model.mu
    assert mu.shape == (2 * len(NAMES), 2)
    np.testing.assert_allclose(mu[1::2, 1], model.tpr)  # μ[2k+1, 1] = TPR
    np.testing.assert_allclose(mu[0::2, 0], model.tnr)  # μ[2k, 0] = TNR
    np.testing.assert_allclose(mu[0::2] + mu[1::2], 1.0)  # each verifier's rows sum to 1 per class


def test_the_posterior_is_calibrated(synth_fit):
    _, y, votes, model = synth_fit
    assert ece(model.posterior(votes), y) <= 0.05


def test_the_label_swap_is_broken_towards_better_than_random_verifiers():
    # With π = 0.7 the mirrored solution (π = 0.3, worse-than-random verifiers) fits the
    # votes equally well; the fit must pick the better-than-random one.
    _, votes = synthetic(20_000, 0.7, seed=11)
    model = fit_label_model(votes, NAMES)
    assert model.pi > 0.5 and all(t + n > 1.0 for t, n in zip(model.tpr, model.tnr))


def test_abstentions_do_not_bias_the_estimates():
    y, votes = synthetic(40_000, 0.3, seed=5)
    rng = np.random.default_rng(6)
    missing = votes.copy()
    for j, rate in [(0, 0.4), (2, 0.3), (5, 0.5)]:
        missing[rng.random(len(y)) < rate, j] = np.nan
    model = fit_label_model(missing, NAMES)
    assert model.pi == pytest.approx(0.3, abs=0.03)
    np.testing.assert_allclose(model.tpr, TPR, atol=0.05)
    np.testing.assert_allclose(model.tnr, TNR, atol=0.05)
    assert ece(model.posterior(missing), y) <= 0.05
    # Reading an abstention as a 0 vote would bias those verifiers' rates by the abstention rate:
    zeroed = fit_label_model(np.nan_to_num(missing, nan=0.0), NAMES)
    assert abs(zeroed.tpr[5] - TPR[5]) > 0.2


def test_an_abstaining_verifier_contributes_nothing_to_the_posterior():
    _, votes = synthetic(5_000, 0.3, seed=7)
    model = fit_label_model(votes, NAMES)
    rows = votes[:4].copy()
    rows[:, 3] = np.nan
    # Expected: §5 step 7 by hand, over every verifier except the abstaining one.
    lp = np.log(model.pi / (1 - model.pi))
    for j in range(len(NAMES)):
        if j == 3:
            continue
        tpr, tnr = np.clip(model.tpr[j], 0.01, 0.99), np.clip(model.tnr[j], 0.01, 0.99)
        lp = lp + np.where(rows[:, j] == 1, np.log(tpr / (1 - tnr)), np.log((1 - tpr) / tnr))
    np.testing.assert_allclose(model.posterior(rows), 1 / (1 + np.exp(-lp)))
    # Everything abstaining leaves the prior.
    assert model.posterior(np.full((1, len(NAMES)), np.nan))[0] == pytest.approx(model.pi)


def test_a_duplicated_verifier_is_detected_and_dropped_with_its_reason():
    y, votes = synthetic(20_000, 0.3, seed=8)
    dup = np.column_stack([votes, votes[:, 2]])
    model = fit_label_model(dup, [*NAMES, "v2_copy"])
    assert model.kept == (True,) * len(NAMES) + (False,)
    assert "dependent on 'v2'" in model.dropped["v2_copy"] and str(DEPENDENCE_CORR) in model.dropped["v2_copy"]
    np.testing.assert_allclose(model.tpr[: len(NAMES)], TPR, atol=0.05)
    assert ece(model.posterior(dup), y) <= 0.05


def test_an_inverted_copy_is_also_one_check_counted_twice():
    _, votes = synthetic(10_000, 0.3, seed=9)
    model = fit_label_model(np.column_stack([votes, 1.0 - votes[:, 0]]), [*NAMES, "not_v0"])
    assert "not_v0" in model.dropped and sum(model.kept) == len(NAMES)


def test_degenerate_verifiers_are_filtered_by_positive_rate():
    _, votes = synthetic(10_000, 0.3, seed=10)
    rng = np.random.default_rng(0)
    lenient = (rng.random(len(votes)) < 0.97).astype(np.float64)  # passes nearly everything
    model = fit_label_model(np.column_stack([votes, lenient, np.zeros(len(votes))]), [*NAMES, "lenient", "never"])
    assert "degenerate positive rate" in model.dropped["lenient"]
    assert "never" in model.dropped
    assert model.kept[: len(NAMES)] == (True,) * len(NAMES)
    assert np.isnan(model.tpr[-1]) and np.isnan(model.tnr[-2])


def test_filtering_keeps_the_best_behaved_two_rather_than_none():
    rng = np.random.default_rng(1)
    n = 5_000
    votes = np.column_stack([(rng.random(n) < r).astype(np.float64) for r in (0.95, 0.93, 0.97, 1.0)])
    # At π = 0.5 every rate is degenerate; the two closest to π come back, a constant never does.
    kept, dropped, _ = _select(votes, votes.mean(axis=0), 0.5, ("a", "b", "c", "d"))
    assert kept.tolist() == [True, True, False, False] and set(dropped) == {"c", "d"}
    model = fit_label_model(votes, ["a", "b", "c", "d"])
    assert sum(model.kept) >= 2 and model.kept[3] is False
    assert np.isfinite(model.posterior(votes)).all()


def test_continuous_scores_are_normalised_and_thresholded_at_the_class_balance_quantile():
    y, votes = synthetic(20_000, 0.3, seed=12)
    rng = np.random.default_rng(3)
    # A score on an arbitrary scale (0..10): higher for correct answers, noisy.
    score = 10.0 / (1.0 + np.exp(-(2.0 * y - 1.0) * 1.5 - rng.normal(0, 1.0, len(y))))
    model = fit_label_model(np.column_stack([votes, score]), [*NAMES, "score"])
    assert model.kept[-1] and model.lo[-1] == pytest.approx(score.min()) and model.hi[-1] == pytest.approx(score.max())
    # Quantile threshold: the verifier passes about a (π)-share of rows.
    assert model.pos_rate[-1] == pytest.approx(model.pi, abs=0.02)
    assert model.thresholds[:-1] == (0.5,) * len(NAMES)  # binary scores use 0.5
    assert accuracy(model.posterior(np.column_stack([votes, score])), y) > accuracy(model.posterior(np.column_stack([votes, np.full(len(y), np.nan)])), y)


def test_given_thresholds_override_the_label_free_choice():
    _, votes = synthetic(2_000, 0.3, seed=13)
    model = fit_label_model(votes, NAMES, thresholds={"v0": 0.9}, version=7)
    assert model.thresholds[0] == 0.9 and model.version == 7
    with pytest.raises(ValueError, match="unknown verifiers"):
        fit_label_model(votes, NAMES, thresholds={"zz": 0.5})


def test_round_trip_through_msgpack_gives_identical_posteriors():
    _, votes = synthetic(4_000, 0.3, seed=14)
    votes = np.column_stack([votes, votes[:, 0]])
    votes[::7, 1] = np.nan
    model = fit_label_model(votes, [*NAMES, "copy"], version=3)
    wire = msgpack.packb(model.to_dict())
    back = LabelModel.from_dict(msgpack.unpackb(wire))
    assert back.version == 3 and back.dropped == model.dropped and back.kept == model.kept
    assert np.array_equal(back.posterior(votes), model.posterior(votes))


def test_from_dict_rejects_malformed_data():
    _, votes = synthetic(1_000, 0.3, seed=15)
    good = fit_label_model(votes, NAMES).to_dict()
    for bad in ({**good, "schema": 99}, {**good, "tpr": good["tpr"][:-1]}, {**good, "pi": "x"},
                {k: v for k, v in good.items() if k != "kept"}, [1, 2]):
        with pytest.raises(ValueError):
            LabelModel.from_dict(bad)


def test_the_posterior_aligns_columns_by_name():
    _, votes = synthetic(3_000, 0.3, seed=16)
    model = fit_label_model(votes, NAMES)
    perm = [3, 0, 6, 1, 5, 2, 4]
    np.testing.assert_array_equal(model.posterior(votes[:, perm], [NAMES[j] for j in perm]), model.posterior(votes))
    with pytest.raises(ValueError):
        model.posterior(votes[:, :3])


def test_fitting_4096_rows_of_7_verifiers_is_fast():
    _, votes = synthetic(4_096, 0.3, seed=17)
    votes[::5, 4] = np.nan
    best = min(_timed(lambda: fit_label_model(votes, NAMES)) for _ in range(3))
    assert best < 0.25, best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ------------------------------------------------------------- the real task
def corrupt(answer: int, rng: random.Random) -> str:
    """A realistic wrong (or malformed) completion for ``answer``."""
    s = str(answer)
    kind = rng.choice(["carry10", "carry100", "swap", "off_by_one", "random", "dropped_digit", "format"])
    if kind == "carry10":
        wrong = answer + rng.choice([-10, 10])
    elif kind == "carry100":
        wrong = answer + rng.choice([-100, 100])
    elif kind == "off_by_one":
        wrong = answer + rng.choice([-1, 1])
    elif kind == "swap" and len(s) >= 2:
        i = rng.randrange(len(s) - 1)
        wrong = int(s[:i] + s[i + 1] + s[i] + s[i + 2:])
    elif kind == "random":
        wrong = rng.randint(0, 10 ** len(s))
    elif kind == "dropped_digit" and len(s) >= 2:
        wrong = int(s[:-1])
    elif kind == "format":
        return rng.choice(["", "=", s + "+" + s, "x" + s])
    else:
        wrong = answer + 2
    wrong = abs(wrong)
    return str(wrong if wrong != answer else answer + 11)


def arithmetic_window(n_prompts: int, *, group: int, seed: int):
    """Score G completions for each of n prompts: ~40% correct, the rest drawn from a
    per-prompt pool of three corruptions (a policy repeats its mistakes)."""
    rng = random.Random(seed)
    votes, truth = [], []
    for _ in range(n_prompts):
        p = random_problem(rng, digits=3, ops=("+", "*"))
        pool = [corrupt(int(p.answer), rng) for _ in range(3)]
        p_correct = rng.uniform(0.1, 0.7)  # prompts differ in difficulty; mean 0.4
        comps = [p.answer if rng.random() < p_correct else rng.choice(pool) for _ in range(group)]
        v, errors = score_group(p.prompt, comps, DEFAULT_VERIFIERS)
        assert not any(errors.values())
        votes.append(v)
        truth.append(correctness(p.answer, comps))
    return np.concatenate(votes).astype(np.float64), np.concatenate(truth).astype(np.float64)


def test_on_the_arithmetic_task_weaver_ranks_better_than_the_plain_average_of_verifiers():
    votes, truth = arithmetic_window(500, group=8, seed=0)
    assert 0.3 < truth.mean() < 0.5
    model = fit_label_model(votes, DEFAULT_VERIFIERS)
    post = model.posterior(votes)
    weaver = selection_accuracy(post, truth, 8)
    average = selection_accuracy(np.nanmean(votes, axis=1), truth, 8)
    single = {n: selection_accuracy(np.nan_to_num(votes[:, j], nan=0.0), truth, 8) for j, n in enumerate(DEFAULT_VERIFIERS)}
    assert weaver > average + 0.02, (weaver, average, single)
    assert weaver > max(single.values()), (weaver, single)
    assert accuracy(post, truth) > accuracy(np.nanmean(votes, axis=1), truth)
    # Label-free π lands near the hidden accuracy.
    assert model.pi == pytest.approx(truth.mean(), abs=0.1)


# ------------------------------------------------------- hand-checkable cases
def test_a_perfect_verifier_is_recovered_as_perfect_and_decides_the_posterior():
    y, votes = synthetic(20_000, 0.4, seed=21)
    votes = np.column_stack([votes, y])
    model = fit_label_model(votes, [*NAMES, "oracle"])
    assert model.kept[-1] and model.tpr[-1] > 0.98 and model.tnr[-1] > 0.98
    assert accuracy(model.posterior(votes), y) > 0.99


def test_an_always_wrong_verifier_is_learnt_as_inverted_and_still_helps():
    # TPR = TNR = 0: it says the opposite of the truth every time, which is as informative as the truth.
    y, votes = synthetic(20_000, 0.4, seed=22)
    with_liar = np.column_stack([votes, 1.0 - y])
    model = fit_label_model(with_liar, [*NAMES, "liar"])
    assert model.kept[-1] and model.tpr[-1] < 0.02 and model.tnr[-1] < 0.02
    assert model.pi == pytest.approx(0.4, abs=0.02)  # the label swap is still broken the right way
    assert accuracy(model.posterior(with_liar), y) > 0.99
    assert accuracy(model.posterior(with_liar), y) > accuracy(fit_label_model(votes, NAMES).posterior(votes), y)


def test_an_always_yes_verifier_is_filtered_as_degenerate_and_named_in_the_report():
    _, votes = synthetic(5_000, 0.4, seed=23)
    model = fit_label_model(np.column_stack([votes, np.ones(len(votes))]), [*NAMES, "yes"])
    assert not model.kept[-1] and "degenerate positive rate 1.000" in model.dropped["yes"]
    report = model.report()
    assert "yes" not in report["kept"] and report["dropped"]["yes"] == model.dropped["yes"]
    assert report["pos_rate"]["yes"] == 1.0


def test_merge_averages_a_duplicated_pair_into_one_column_and_stays_calibrated():
    y, votes = synthetic(20_000, 0.3, seed=24)
    dup = np.column_stack([votes, votes[:, 2]])
    model = fit_label_model(dup, [*NAMES, "v2_copy"], dependence="merge")
    assert model.dependence == "merge" and model.merged == {"v2_copy": ("v2", False)}
    assert model.kept == (True,) * len(NAMES) + (False,)
    assert model.dropped["v2_copy"].startswith("merged into 'v2'")
    np.testing.assert_allclose(model.tpr[: len(NAMES)], TPR, atol=0.05)
    assert ece(model.posterior(dup), y) <= 0.05
    # A row where only the copy voted still gets v2's vote through the merge; under drop it does not.
    row = dup[:1].copy()
    row[0, 2] = np.nan
    dropped = fit_label_model(dup, [*NAMES, "v2_copy"], dependence="drop")
    assert model.binarize(row)[0, 2] == row[0, -1] and np.isnan(dropped.binarize(row)[0, 2])
    assert model.posterior(row)[0] != pytest.approx(dropped.posterior(row)[0])


def test_merge_flips_an_inverted_copy_before_averaging():
    _, votes = synthetic(10_000, 0.3, seed=25)
    inv = np.column_stack([votes, 1.0 - votes[:, 0]])
    model = fit_label_model(inv, [*NAMES, "not_v0"], dependence="merge")
    assert model.merged == {"not_v0": ("v0", True)} and "(inverted)" in model.dropped["not_v0"]
    # Averaged with its flip the pair agrees with v0 on every row, so v0's estimates are unchanged.
    np.testing.assert_array_equal(model.binarize(inv)[:, 0], votes[:, 0])
    np.testing.assert_allclose(model.tpr[0], TPR[0], atol=0.05)


def test_an_unknown_dependence_policy_is_refused():
    _, votes = synthetic(1_000, 0.3, seed=26)
    with pytest.raises(ValueError, match="dependence must be one of"):
        fit_label_model(votes, NAMES, dependence="keep")


def test_the_fit_report_carries_rates_balance_objective_and_iterations():
    _, votes = synthetic(5_000, 0.3, seed=27)
    model = fit_label_model(np.column_stack([votes, votes[:, 1]]), [*NAMES, "copy"], dependence="merge")
    report = model.report()
    assert report["kept"] == NAMES and set(report["dropped"]) == {"copy"}
    assert report["merged"] == {"copy": {"into": "v1", "inverted": False}}
    assert set(report["tpr"]) == set(NAMES) and 0.5 < report["tpr"]["v2"] <= 1.0
    assert report["pi"] == pytest.approx(model.pi, abs=1e-4) and report["objective"] >= 0.0
    it = report["iterations"]
    assert it["rounds"] >= 1 and it["em"] >= 1 and it["lbfgs"] >= 0
    msgpack.packb(report)  # plain data, loggable and storable
    back = LabelModel.from_dict(msgpack.unpackb(msgpack.packb(model.to_dict())))
    assert back.merged == model.merged and back.report() == report


def test_the_report_warns_when_too_few_verifiers_are_kept_to_reveal_dependence():
    _, votes = synthetic(5_000, 0.3, seed=28)
    assert fit_label_model(votes, NAMES).report()["warnings"] == []
    few = fit_label_model(votes[:, :3], NAMES[:3]).report()["warnings"]
    assert any("only 3 verifiers kept" in w for w in few)


def test_a_fit_that_keeps_no_verifier_scores_with_the_mean_vote_not_a_constant():
    # A run's first window: two groups of four, fewer than MIN_VOTES votes per verifier.
    votes = np.array([[1, 1, 1, 1], [1, 0, 1, 1], [0, np.nan, 0, 1], [1, 1, 0, 0],
                      [0, 0, 0, 0], [1, 1, 1, 1], [np.nan] * 4, [1, np.nan, 1, 0]], dtype=np.float64)
    lm = fit_label_model(votes, NAMES[:4])
    assert tuple(lm.kept_names) == () and len(lm.dropped) == 4
    post = lm.posterior(votes)
    np.testing.assert_allclose(post, [1.0, 0.75, 1 / 3, 0.5, 0.0, 1.0, lm.pi, 2 / 3])
    assert any("no verifier kept" in w for w in lm.report()["warnings"])
    # The serialised model the verifier replicas share scores the same way.
    again = LabelModel.from_dict(msgpack.unpackb(msgpack.packb(lm.to_dict())))
    np.testing.assert_allclose(again.posterior(votes), post)


def _correlated_wrong_answers(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two sound checks (a right answer always passes) and a majority-like vote whose errors
    share a cause with check ``a``: plausible wrong answers fool both, as carry errors fool the
    units digit and the group's majority on the arithmetic task."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.3).astype(np.float64)
    plausible = rng.random(n) < 0.5
    a = np.where(y == 1, 1.0, rng.random(n) < np.where(plausible, 0.85, 0.1))
    b = np.where(y == 1, 1.0, rng.random(n) < 0.15)
    maj = np.where(y == 1, rng.random(n) < 0.8, rng.random(n) < np.where(plausible, 0.75, 0.1))
    return y, np.stack([a, b, maj], axis=1).astype(np.float64)


def test_sound_checks_hold_their_tpr_at_one_and_fix_the_posterior_of_answers_that_fail_them():
    from pipeline.algo.selection import ece

    y, votes = _correlated_wrong_answers(20_000, seed=3)
    names = ["a", "b", "maj"]
    free = fit_label_model(votes, names)
    held = fit_label_model(votes, names, sound=["a", "b"])
    assert held.verifier_stats()["a"]["tpr"] >= 0.999 and held.verifier_stats()["b"]["tpr"] >= 0.999
    p_free, p_held = free.posterior(votes, names), held.posterior(votes, names)
    fails_b = votes[:, 1] == 0
    assert y[fails_b].sum() == 0, "a sound check never fails a right answer"
    assert p_held[fails_b].max() < 0.05, "failing a sound check is decisive"
    # The failure it fixes: left free, the shared errors of a and maj make b look like it
    # rejects many right answers, and the posterior is badly calibrated.
    assert free.verifier_stats()["b"]["tpr"] < 0.8
    assert ece(p_held, y) < 0.1 < 0.2 < ece(p_free, y)
    with pytest.raises(ValueError, match="not among"):
        fit_label_model(votes, names, sound=["c"])


def test_the_rule_checks_are_registered_sound_and_the_majority_vote_is_not():
    from pipeline.verifiers.base import SOUND

    assert {"format", "units_digit", "mod9", "magnitude", "leading_digit"} <= SOUND
    assert "majority" not in SOUND


def _judges_that_err_together(n: int, pi: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(truth, votes): three continuous judges sharing one error (40% of wrong answers look right
    to all three), beside two independent binary checks."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < pi).astype(np.float64)
    looks_right = np.where(y == 1.0, 1.0, (rng.random(n) < 0.4).astype(np.float64))
    judges = [1.0 / (1.0 + np.exp(-(3.0 * looks_right - 1.5 + rng.normal(0.0, 0.8, n)))) for _ in range(3)]
    checks = [np.where(y == 1.0, rng.random(n) < 0.8, rng.random(n) < 0.3).astype(np.float64) for _ in range(2)]
    return y, np.column_stack(judges + checks)


def test_a_known_class_balance_is_held_and_sets_the_quantile_thresholds():
    y, votes = _judges_that_err_together(4000, 0.2, seed=5)
    names = ["j0", "j1", "j2", "c0", "c1"]
    known = fit_label_model(votes, names, class_balance=0.2)
    assert known.pi == 0.2 and known.rounds == 1
    assert known.pos_rate[:3] == pytest.approx((0.2, 0.2, 0.2), abs=0.01)  # the judges pass a π-share
    assert known.thresholds[3:] == (0.5, 0.5)                              # binary checks keep 0.5
    post = known.posterior(votes)
    assert accuracy(post, y) > 0.8 and post[y == 0].mean() < 0.2 < post[y == 1].mean()
    # Judges that err together pull the label-free estimate of π up, their quantile thresholds
    # down with it, and wrong answers are rewarded: the known balance is the better fit here.
    free = fit_label_model(votes, names)
    assert free.pi > 0.3 and accuracy(free.posterior(votes), y) < accuracy(post, y) - 0.1
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="class_balance"):
            fit_label_model(votes, names, class_balance=bad)


def _independent_judges(n: int, pi: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(truth, votes): four continuous judges with independent errors and unequal strength,
    beside one binary check."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < pi).astype(np.float64)
    judges = [1.0 / (1.0 + np.exp(-(a * (2.0 * y - 1.0) + rng.normal(0.0, 1.0, n)))) for a in (2.0, 1.5, 1.2, 0.8)]
    check = np.where(y == 1.0, rng.random(n) < 0.85, rng.random(n) < 0.3).astype(np.float64)
    return y, np.column_stack([*judges, check])


@pytest.mark.parametrize("pi", [0.2, 0.4])
def test_the_levels_estimate_recovers_pi_without_thresholds_and_is_recorded(pi):
    y, votes = _independent_judges(4000, pi, seed=21)
    names = ["j0", "j1", "j2", "j3", "c"]
    lm = fit_label_model(votes, names, pi_estimate="levels")
    assert lm.pi_method == "levels" and lm.report()["pi_method"] == "levels"
    assert lm.rounds == 1                                  # π is set once, like a known balance
    assert lm.pi == pytest.approx(y.mean(), abs=0.05)
    assert accuracy(lm.posterior(votes), y) > 0.85
    back = LabelModel.from_dict(msgpack.unpackb(msgpack.packb(lm.to_dict())))
    assert back.pi_method == "levels" and np.array_equal(back.posterior(votes), lm.posterior(votes))
    assert fit_label_model(votes, names).pi_method == "alternate"                       # the default
    assert fit_label_model(votes, names, class_balance=pi, pi_estimate="levels").pi_method == "given"


def test_on_binary_votes_both_estimates_of_pi_are_the_same_fit():
    _, votes = synthetic(4000, 0.3, seed=22)
    a = fit_label_model(votes, NAMES, pi_estimate="alternate")
    b = fit_label_model(votes, NAMES, pi_estimate="levels")
    assert (a.pi, a.tpr, a.tnr, a.kept) == (b.pi, b.tpr, b.tnr, b.kept)
    assert b.pi_method == "alternate"  # every threshold is fixed: EM on the votes is the levels model


def test_an_unknown_pi_estimate_is_refused_and_an_old_model_reads_as_alternate():
    _, votes = synthetic(1000, 0.3, seed=23)
    with pytest.raises(ValueError, match="pi_estimate must be one of"):
        fit_label_model(votes, NAMES, pi_estimate="guess")
    d = fit_label_model(votes, NAMES).to_dict()
    old = {k: v for k, v in d.items() if k != "pi_method"}  # written before the field existed
    assert LabelModel.from_dict(old).pi_method == "alternate"
    with pytest.raises(ValueError, match="pi_method"):
        LabelModel.from_dict({**d, "pi_method": "guess"})
