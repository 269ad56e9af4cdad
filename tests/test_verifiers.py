"""Weak verifiers: each passes the truth, catches some errors, and (being weak) passes others."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.verifiers import registry as V
from pipeline.tasks.arithmetic import Problem
from pipeline.tasks.arithmetic import correctness
from pipeline.verifiers.base import VERIFIERS, register
from pipeline.verifiers.registry import DEFAULT_VERIFIERS, score_group

ADD = " 42+317="  # 359
MUL = " 42*317="  # 13314


def scores(name: str, prompt: str, *completions: str) -> list[float]:
    out = VERIFIERS[name](prompt, list(completions))
    assert out.dtype == np.float32 and out.shape == (len(completions),)
    return [float(x) for x in out]


def is_nan(x: float) -> bool:
    return math.isnan(x)


def test_the_default_ensemble_is_registered_and_includes_the_design_checks():
    assert set(DEFAULT_VERIFIERS) <= set(VERIFIERS)
    assert {"format", "units_digit", "mod9", "magnitude", "majority"} <= set(DEFAULT_VERIFIERS)


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register("mod9")(lambda p, c: np.zeros(len(c), np.float32))


def test_format_passes_canonical_numbers_and_fails_everything_else_without_abstaining():
    assert scores("format", ADD, "359", "0", " 359\n") == [1.0, 1.0, 1.0]
    assert scores("format", ADD, "0359", "", "359+", "abc", "3 59", "-359", "00") == [0.0] * 7


def test_format_is_weak_any_well_formed_wrong_number_passes():
    assert scores("format", ADD, "358", "1") == [1.0, 1.0]


def test_units_digit_checks_the_last_digit_from_the_operands_units_digits():
    assert scores("units_digit", ADD, "359", "358", "360") == [1.0, 0.0, 0.0]
    assert scores("units_digit", MUL, "13314", "13315") == [1.0, 0.0]


def test_units_digit_is_weak_carry_errors_pass():
    assert scores("units_digit", ADD, "349", "459", "9") == [1.0, 1.0, 1.0]


def test_units_digit_abstains_when_there_is_no_answer():
    assert all(is_nan(x) for x in scores("units_digit", ADD, "", "abc"))


def test_mod9_casts_out_nines():
    assert scores("mod9", ADD, "359", "360", "349", "459") == [1.0, 0.0, 0.0, 0.0]
    assert scores("mod9", MUL, "13314", "13324") == [1.0, 0.0]


def test_mod9_is_weak_digit_swaps_and_multiples_of_nine_pass():
    assert scores("mod9", ADD, "395", "539", "368", "350") == [1.0, 1.0, 1.0, 1.0]


def test_mod9_abstains_when_there_is_no_answer():
    assert is_nan(scores("mod9", MUL, "x13314")[0])


def test_mod11_and_mod7_check_residues_of_the_operands():
    # 123 + 456 = 579: 579 % 11 = 7, 579 % 7 = 5.
    v11 = VERIFIERS["mod11"]("123+456=", ["579", "590", "568", "x"])
    assert v11[:3].tolist() == [1.0, 1.0, 1.0] and np.isnan(v11[3]), "±11 errors pass mod 11"
    v7 = VERIFIERS["mod7"]("123+456=", ["579", "586", "580"])
    assert v7.tolist() == [1.0, 1.0, 0.0], "a ±7 error passes mod 7, an off-by-one does not"
    assert VERIFIERS["mod11"]("123+456=", ["589"]).tolist() == [0.0], "a carry error (+10) fails mod 11"


def test_magnitude_checks_the_digit_count_from_leading_digit_intervals():
    assert scores("magnitude", ADD, "359", "3590", "35") == [1.0, 0.0, 0.0]
    assert scores("magnitude", MUL, "13314", "1331", "133140") == [1.0, 0.0, 0.0]


def test_magnitude_is_weak_any_answer_with_a_plausible_length_passes():
    assert scores("magnitude", ADD, "999", "100") == [1.0, 1.0]
    # 95+9: from leading digits the sum is in [99, 108], so both 2 and 3 digits are plausible.
    assert scores("magnitude", "95+ 9=", "104", "99", "10") == [1.0, 1.0, 1.0]


def test_leading_digit_checks_the_leading_digit_against_a_two_digit_estimate():
    assert scores("leading_digit", ADD, "359", "459", "259") == [1.0, 0.0, 0.0]
    assert scores("leading_digit", MUL, "13314", "23314") == [1.0, 0.0]


def test_leading_digit_is_weak_and_leaves_the_length_to_magnitude():
    assert scores("leading_digit", ADD, "301", "399") == [1.0, 1.0]
    # Wrong length: the length is magnitude's question, so leading_digit abstains.
    assert all(is_nan(x) for x in scores("leading_digit", ADD, "3590", "35", ""))


def test_majority_scores_min_max_rescaled_answer_frequency_within_the_group():
    got = scores("majority", ADD, "359", "359", "359", "358", "358", "7")
    assert got == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.5, 0.0])


def test_majority_gives_one_when_all_frequencies_are_equal_and_zero_without_an_answer():
    assert scores("majority", ADD, "359", "0359", "x") == [1.0, 1.0, 0.0]  # 0359 states 359
    assert scores("majority", ADD, "1", "2", "3") == [1.0, 1.0, 1.0]


def test_majority_is_weak_a_group_agreeing_on_a_wrong_answer_passes_it():
    assert scores("majority", ADD, "349", "349", "359") == [1.0, 1.0, 0.0]


def test_majority_abstains_when_no_completion_has_an_answer():
    assert all(is_nan(x) for x in scores("majority", ADD, "", "x"))


@settings(max_examples=200, deadline=None)
@given(a=st.integers(0, 99_999), b=st.integers(0, 99_999), op=st.sampled_from(["+", "*"]))
def test_every_answer_free_check_passes_the_true_answer(a, b, op):
    # The checks are necessary conditions of the true result: they may pass wrong
    # answers but must never fail (or abstain on) the right one.
    p = Problem(a=a, op=op, b=b, digits=5)
    for name in ("format", "units_digit", "mod9", "magnitude", "leading_digit"):
        assert scores(name, p.prompt, p.answer) == [1.0], name


def test_no_verifier_reads_the_reference_answer():
    # Signature-level guarantee: a verifier only gets (prompt, completions).
    import inspect

    for name, fn in VERIFIERS.items():
        assert list(inspect.signature(fn).parameters) == ["prompt", "completions"], name


def test_score_group_returns_one_column_per_named_verifier():
    votes, errors = score_group(ADD, ["359", "349", "x"], DEFAULT_VERIFIERS)
    assert votes.shape == (3, len(DEFAULT_VERIFIERS)) and votes.dtype == np.float32
    assert errors == {n: 0 for n in DEFAULT_VERIFIERS}
    col = {n: j for j, n in enumerate(DEFAULT_VERIFIERS)}
    assert votes[0, col["mod9"]] == 1.0 and votes[1, col["mod9"]] == 0.0 and np.isnan(votes[2, col["mod9"]])
    assert votes[2, col["format"]] == 0.0


def test_score_group_turns_a_raising_verifier_into_an_abstaining_column_and_counts_it(monkeypatch):
    def broken(prompt, completions):
        raise RuntimeError("boom")

    monkeypatch.setitem(VERIFIERS, "broken", broken)
    votes, errors = score_group(ADD, ["359", "349"], ["mod9", "broken"])
    assert np.isnan(votes[:, 1]).all()
    assert votes[:, 0].tolist() == [1.0, 0.0]
    assert errors == {"mod9": 0, "broken": 1}


def test_score_group_treats_malformed_verifier_output_as_an_error(monkeypatch):
    monkeypatch.setitem(VERIFIERS, "short", lambda p, c: np.ones(len(c) - 1, np.float32))
    monkeypatch.setitem(VERIFIERS, "big", lambda p, c: np.full(len(c), 2.0, np.float32))
    votes, errors = score_group(ADD, ["359", "349"], ["short", "big"])
    assert np.isnan(votes).all() and errors == {"short": 1, "big": 1}


def test_score_group_abstains_throughout_on_an_unparseable_prompt_but_format_still_works():
    votes, errors = score_group("garbage", ["359"], ["format", "mod9"])
    assert votes[0, 0] == 1.0 and np.isnan(votes[0, 1]) and errors == {"format": 0, "mod9": 1}


def test_score_group_rejects_an_unknown_name_and_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown verifier.*'nope'.*allowed.*mod9"):
        score_group(ADD, ["359"], ["mod9", "nope"])


def test_correctness_is_the_hidden_truth_on_the_stated_number():
    got = correctness("359", ["359", "0359", "359+", "349", "", "x"])
    assert got.dtype == np.float32
    assert got.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_correctness_is_not_a_registered_verifier():
    assert correctness not in VERIFIERS.values()


# ------------------------------------------------------ deadlines and abstention
def _slow(prompt, completions):
    time.sleep(3.0)
    return np.ones(len(completions), np.float32)


def test_a_threaded_verifier_past_its_deadline_abstains_promptly_and_is_counted(monkeypatch):
    monkeypatch.setitem(VERIFIERS, "slow", _slow)
    monkeypatch.setattr(V, "THREADED", V.THREADED | {"slow"})
    scorer = V.Scorer(["mod9", "slow"], timeouts={"slow": 0.2})
    t0 = time.perf_counter()
    votes, outcome = scorer.score(ADD, ["359", "349"])
    assert time.perf_counter() - t0 < 1.5, "the caller must stop waiting at the deadline"
    assert outcome == {"mod9": "ok", "slow": "timeout"}
    assert votes[:, 0].tolist() == [1.0, 0.0] and np.isnan(votes[:, 1]).all()
    st = scorer.stats["slow"]
    assert (st.groups, st.timeouts, st.abstained, st.errors) == (1, 1, 1, 0) and "0.2 s deadline" in st.last_error
    assert scorer.stats["mod9"].abstained == 0


def test_a_verifier_still_stuck_on_earlier_groups_abstains_without_starting_another_thread(monkeypatch):
    monkeypatch.setitem(VERIFIERS, "slow", _slow)
    monkeypatch.setattr(V, "THREADED", V.THREADED | {"slow"})
    scorer = V.Scorer(["slow"], timeouts={"slow": 0.05})
    before = threading.active_count()
    for _ in range(V.MAX_STUCK_THREADS + 3):
        _, outcome = scorer.score(ADD, ["359"])
        assert outcome == {"slow": "timeout"}
    assert threading.active_count() - before <= V.MAX_STUCK_THREADS
    assert scorer.stats["slow"].timeouts == V.MAX_STUCK_THREADS + 3
    assert "still running" in scorer.stats["slow"].last_error


def test_an_inline_verifier_that_overruns_its_deadline_still_abstains(monkeypatch):
    def sluggish(prompt, completions):
        time.sleep(0.1)
        return np.ones(len(completions), np.float32)

    monkeypatch.setitem(VERIFIERS, "sluggish", sluggish)
    votes, outcome = V.Scorer(["sluggish"], timeouts={"sluggish": 0.01}).score(ADD, ["359"])
    assert outcome == {"sluggish": "timeout"} and np.isnan(votes).all()


def test_an_error_is_counted_apart_from_a_timeout_with_its_reason(monkeypatch):
    def broken(prompt, completions):
        raise RuntimeError("boom")

    monkeypatch.setitem(VERIFIERS, "broken", broken)
    scorer = V.Scorer(["broken"])
    scorer.score(ADD, ["359"])
    scorer.score(ADD, ["359"])
    st = scorer.stats["broken"]
    assert (st.errors, st.timeouts, st.abstained) == (2, 0, 2) and st.last_error == "RuntimeError: boom"


def test_scorer_validates_specs_and_timeouts_up_front():
    with pytest.raises(ValueError, match="unknown verifier 'nope'"):
        V.Scorer(["mod9", "nope"])
    with pytest.raises(ValueError, match="not in the list"):
        V.Scorer(["mod9"], timeouts={"format": 1.0})
    with pytest.raises(ValueError, match="positive number of seconds"):
        V.Scorer(["mod9"], timeouts={"mod9": 0})
    with pytest.raises(ValueError, match="needs ':<arg>'"):
        V.check_spec("reward_model")
    with pytest.raises(ValueError, match="takes no argument"):
        V.check_spec("code_exec:x")
    with pytest.raises(ValueError, match="must not contain ':'"):
        register("a:b")
    V.check_spec("reward_model:/some/dir")
    V.check_spec("lm_judge")


def test_the_scorer_runs_only_the_verifiers_asked_for_and_counts_what_each_scored():
    names = ["format", "mod9", "states_answer:last_number"]
    scorer = V.Scorer(names, build=["format"])  # the kind is built when a group first asks for it
    votes, outcome = scorer.score(ADD, ["359", "358"], only=("format",))
    assert outcome == {"format": "ok", "mod9": "skipped", "states_answer:last_number": "skipped"}
    assert not np.isnan(votes[:, 0]).any() and np.isnan(votes[:, 1:]).all()
    assert [scorer.stats[n].completions for n in names] == [2, 0, 0]
    votes, outcome = scorer.score(ADD, ["359", "358", "x"])  # every one
    assert set(outcome.values()) == {"ok"} and votes[0, 1] == 1.0 and votes[0, 2] == 1.0
    assert [scorer.stats[n].completions for n in names] == [5, 3, 3]
    assert [scorer.stats[n].groups for n in names] == [2, 1, 1]
