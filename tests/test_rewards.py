"""Reward modes on a small group: validation, each mode's values, and no truth leaks."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.algo.labelmodel import fit_label_model
from pipeline.algo.rewards import REWARD_MODES, RewardMode, allowed_reward_modes, compute_rewards, parse_reward_mode
from pipeline.tasks.arithmetic import correctness
from pipeline.verifiers.registry import DEFAULT_VERIFIERS, score_group

PROMPT = " 42+317="  # 359
COMPLETIONS = ["359", "359", "349", "359+", "0359", "395", "", "358"]
TRUTH = correctness("359", COMPLETIONS)


@pytest.fixture(scope="module")
def scored():
    votes, errors = score_group(PROMPT, COMPLETIONS, DEFAULT_VERIFIERS)
    assert not any(errors.values())
    return votes


@pytest.fixture(scope="module")
def label_model():
    # A label model fitted on synthetic votes for the same verifier names.
    rng = np.random.default_rng(0)
    y = rng.random(4_000) < 0.4
    tpr = np.array([0.95, 0.9, 0.9, 0.95, 0.8, 0.9])
    tnr = np.array([0.15, 0.5, 0.8, 0.3, 0.6, 0.3])
    votes = (rng.random((4_000, 6)) < np.where(y[:, None], tpr, 1 - tnr)).astype(np.float64)
    return fit_label_model(votes, DEFAULT_VERIFIERS, version=5)


def test_every_listed_mode_parses():
    for spec in allowed_reward_modes():
        mode = parse_reward_mode(spec)
        assert isinstance(mode, RewardMode) and mode.spec == spec
    assert {"weaver", "weaver-hard", "majority", "ground_truth"} <= set(REWARD_MODES)
    assert parse_reward_mode("single:mod9").verifier == "mod9"


@pytest.mark.parametrize("spec", ["", "weaver_hard", "single:", "single:nope", "truth", "Weaver"])
def test_an_unknown_mode_is_rejected_naming_the_allowed_ones(spec):
    with pytest.raises(ValueError, match="allowed"):
        parse_reward_mode(spec)


def test_single_rejects_an_unknown_verifier_by_listing_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown verifier 'nope'.*mod9"):
        parse_reward_mode("single:nope")


def test_weaver_is_the_soft_posterior_and_needs_no_truth(scored, label_model):
    got = compute_rewards("weaver", votes=scored, names=DEFAULT_VERIFIERS, label_model=label_model, truth=None)
    assert got.dtype == np.float32 and got.shape == (len(COMPLETIONS),)
    np.testing.assert_allclose(got, label_model.posterior(scored, DEFAULT_VERIFIERS), rtol=1e-6)
    assert ((0.0 <= got) & (got <= 1.0)).all()
    # The right answer outranks the carry error, the swap and the off-by-one.
    assert got[0] > max(got[2], got[5], got[7])


def test_weaver_never_reads_the_hidden_truth(scored, label_model):
    kw = dict(votes=scored, names=DEFAULT_VERIFIERS, completions=COMPLETIONS, label_model=label_model)
    for mode in ("weaver", "weaver-hard", "majority", "single:mod9"):
        with_truth = compute_rewards(mode, **kw, truth=TRUTH)
        flipped = compute_rewards(mode, **kw, truth=1.0 - TRUTH)
        without = compute_rewards(mode, **kw, truth=None)
        assert np.array_equal(with_truth, flipped) and np.array_equal(with_truth, without), mode
    assert not parse_reward_mode("weaver").uses_truth and parse_reward_mode("ground_truth").uses_truth


def test_weaver_hard_thresholds_the_posterior_at_one_half(scored, label_model):
    soft = compute_rewards("weaver", votes=scored, names=DEFAULT_VERIFIERS, label_model=label_model)
    hard = compute_rewards("weaver-hard", votes=scored, names=DEFAULT_VERIFIERS, label_model=label_model)
    assert hard.tolist() == (soft > 0.5).astype(np.float32).tolist()


def test_weaver_without_a_label_model_is_an_error(scored):
    assert parse_reward_mode("weaver").needs_label_model
    with pytest.raises(ValueError, match="label model"):
        compute_rewards("weaver", votes=scored, names=DEFAULT_VERIFIERS)


def test_single_is_the_binarised_verifier_with_abstentions_as_zero(scored):
    got = compute_rewards("single:mod9", votes=scored, names=DEFAULT_VERIFIERS)
    # 359, 359, 349, 359+, 0359, 395 (swap passes mod 9), "" (abstains -> 0), 358
    assert got.tolist() == [1, 1, 0, 1, 1, 1, 0, 0]
    assert compute_rewards("single:format", votes=scored, names=DEFAULT_VERIFIERS).tolist() == [1, 1, 1, 0, 0, 1, 0, 1]


def test_single_needs_its_verifier_among_the_scored_columns(scored):
    with pytest.raises(ValueError, match="not among"):
        compute_rewards("single:mod9", votes=scored[:, :1], names=DEFAULT_VERIFIERS[:1])


def test_majority_rewards_the_most_frequent_answer_and_all_tied_ones():
    votes = np.zeros((len(COMPLETIONS), 0))
    got = compute_rewards("majority", votes=votes, names=[], completions=COMPLETIONS)
    # 359 is stated by "359", "359", "359+" and "0359"
    assert got.tolist() == [1, 1, 0, 1, 1, 0, 0, 0]
    tied = compute_rewards("majority", votes=np.zeros((4, 0)), names=[], completions=["1", "2", "1", "2"])
    assert tied.tolist() == [1, 1, 1, 1]
    assert compute_rewards("majority", votes=np.zeros((2, 0)), names=[], completions=["", "x"]).tolist() == [0, 0]
    with pytest.raises(ValueError, match="completions"):
        compute_rewards("majority", votes=votes, names=[])


def test_ground_truth_is_the_hidden_truth_and_requires_it(scored):
    got = compute_rewards("ground_truth", votes=scored, names=DEFAULT_VERIFIERS, truth=TRUTH)
    assert got.dtype == np.float32 and got.tolist() == TRUTH.tolist()
    with pytest.raises(ValueError, match="truth"):
        compute_rewards("ground_truth", votes=scored, names=DEFAULT_VERIFIERS)


def test_shapes_are_checked(scored, label_model):
    with pytest.raises(ValueError, match="votes must be"):
        compute_rewards("weaver", votes=scored, names=DEFAULT_VERIFIERS[:-1], label_model=label_model)
    with pytest.raises(ValueError, match="completions"):
        compute_rewards("majority", votes=scored, names=DEFAULT_VERIFIERS, completions=COMPLETIONS[:-1])


def test_a_parsed_mode_is_reusable_and_callable_directly(scored, label_model):
    mode = parse_reward_mode("weaver")
    a = mode(votes=scored, names=DEFAULT_VERIFIERS, label_model=label_model)
    b = compute_rewards(mode, votes=scored, names=DEFAULT_VERIFIERS, label_model=label_model)
    assert np.array_equal(a, b)


def test_average_is_the_plain_mean_of_the_scores_that_did_not_abstain():
    votes = np.array([[1.0, 0.0, np.nan], [np.nan, np.nan, np.nan], [0.5, 1.0, 1.0]])
    got = compute_rewards("average", votes=votes, names=["a", "b", "c"])
    np.testing.assert_allclose(got, [0.5, 0.0, 2.5 / 3], rtol=1e-6)
    assert "average" in REWARD_MODES and not parse_reward_mode("average").needs_label_model


def test_single_accepts_a_verifier_kind_spec():
    mode = parse_reward_mode("single:reward_model:/models/rm")
    assert mode.kind == "single" and mode.verifier == "reward_model:/models/rm"
    with pytest.raises(ValueError, match="needs ':<arg>'"):
        parse_reward_mode("single:reward_model")


def test_a_weighted_sum_of_modes_is_the_sum_of_their_rewards():
    from pipeline.algo.rewards import parse_reward_mode

    mode = parse_reward_mode("0.8*ground_truth + 0.2*single:format")
    assert mode.uses_truth and not mode.needs_label_model and mode.verifiers == ("format",)
    votes = np.array([[1.0], [0.0], [1.0], [np.nan]])
    truth = np.array([1.0, 1.0, 0.0, 0.0])
    got = mode(votes=votes, names=["format"], truth=truth, completions=["a", "b", "c", "d"], reference="7")
    assert np.allclose(got, [1.0, 0.8, 0.2, 0.0])


def test_labels_where_the_row_has_one_and_the_weak_mode_where_not():
    from pipeline.algo.rewards import parse_reward_mode

    mode = parse_reward_mode("ground_truth|average")
    assert mode.uses_truth and not mode.needs_label_model
    votes = np.array([[1.0, 0.0], [0.5, 0.5]])
    truth = np.array([0.0, 1.0])
    labelled = mode(votes=votes, names=["a", "b"], truth=truth, completions=["x", "y"], reference="3")
    unlabelled = mode(votes=votes, names=["a", "b"], truth=np.zeros(2), completions=["x", "y"], reference="")
    assert list(labelled) == [0.0, 1.0], "the row's label rules"
    assert np.allclose(unlabelled, [0.5, 0.5]), "no label: the weak verifiers' mean"
    assert parse_reward_mode("ground_truth|weaver").needs_label_model


@pytest.mark.parametrize("spec", ["ground_truth|nope", "0.5*weaver + single:no_such", "2*"])
def test_a_bad_term_of_a_combination_is_refused(spec):
    from pipeline.algo.rewards import parse_reward_mode

    with pytest.raises(ValueError):
        parse_reward_mode(spec)


@pytest.mark.parametrize("spec,reads", [
    ("weaver", DEFAULT_VERIFIERS), ("weaver-hard", DEFAULT_VERIFIERS), ("average", DEFAULT_VERIFIERS),
    ("single:mod9", ("mod9",)), ("ground_truth", ()), ("majority", ()),
    ("0.8*ground_truth + 0.2*single:format", ("format",)), ("ground_truth|weaver", DEFAULT_VERIFIERS),
    ("single:magnitude + single:format", ("format", "magnitude")),
])
def test_a_reward_mode_reads_only_the_votes_it_aggregates(spec, reads):
    assert parse_reward_mode(spec).reads(DEFAULT_VERIFIERS) == tuple(reads)


def test_a_reward_over_the_votes_it_reads_is_the_same_with_the_others_unscored(scored):
    # What lets the verifier stage leave them unscored (NaN, an abstention).
    for spec in ("single:mod9", "ground_truth", "majority", "0.8*ground_truth + 0.2*single:format"):
        mode = parse_reward_mode(spec)
        partial = scored.copy()
        for j, name in enumerate(DEFAULT_VERIFIERS):
            if name not in mode.reads(DEFAULT_VERIFIERS):
                partial[:, j] = np.nan
        kw = dict(names=DEFAULT_VERIFIERS, completions=COMPLETIONS, truth=TRUTH, reference="359", prompt=PROMPT)
        assert np.array_equal(mode(votes=scored, **kw), mode(votes=partial, **kw)), spec
