"""The arithmetic task's weak verifiers: cheap necessary properties of the true result.

Each one checks a *necessary* property of ``a op b`` that it can compute from the
operands (units digit, residue mod 9, rough magnitude, ...), so each one passes some
wrong answers. That weakness is the point: the Weaver label model
(``pipeline.algo.labelmodel``) learns how far to trust each of them without labels.
They are pure and take microseconds, so they run inline, in the caller's thread.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

from pipeline.tasks.arithmetic import evaluate, extract_answer, parse_prompt
from pipeline.verifiers.base import frequency_scores, register


_CANONICAL = re.compile(r"0|[1-9][0-9]*")


def _answers(completions: Sequence[str]) -> list[int | None]:
    """The integer each completion states (its leading digits), or None."""
    out: list[int | None] = []
    for c in completions:
        a = extract_answer(c)
        out.append(None if a is None else int(a))
    return out


def _per_answer(completions: Sequence[str], check: Callable[[int], bool]) -> np.ndarray:
    """Score 1/0 per completion by ``check(answer)``; NaN where no answer can be extracted.

    Abstaining (rather than failing) on unparseable completions keeps these checks
    about *their* property only: a missing answer is ``format``'s business, and
    letting every check fail it would make them all look correlated to the label model.
    """
    out = np.full(len(completions), np.nan, dtype=np.float32)
    for i, ans in enumerate(_answers(completions)):
        if ans is not None:
            out[i] = 1.0 if check(ans) else 0.0
    return out


def _residue_check(prompt: str, completions: Sequence[str], modulus: int) -> np.ndarray:
    """1 where answer ≡ (a mod m) op (b mod m) (mod m): a necessary condition computed from residues only."""
    a, op, b = parse_prompt(prompt)
    expected = evaluate(a % modulus, op, b % modulus) % modulus
    return _per_answer(completions, lambda ans: ans % modulus == expected)


def _top_interval(x: int, keep: int) -> tuple[int, int]:
    """The interval of all integers that share ``x``'s length and its ``keep`` leading digits.

    ``_top_interval(317, 1) == (300, 399)``; numbers with at most ``keep`` digits are exact.
    Verifiers reason from these intervals so they never compute the exact answer.
    """
    drop = max(len(str(x)) - keep, 0)
    scale = 10**drop
    lo = (x // scale) * scale
    return lo, lo + scale - 1


def _result_interval(a: int, op: str, b: int, keep: int) -> tuple[int, int]:
    """Bounds on ``a op b`` knowing only ``keep`` leading digits of each operand.

    Both operators are monotone on non-negative integers, so the bounds are the
    operator applied to the interval ends.
    """
    a_lo, a_hi = _top_interval(a, keep)
    b_lo, b_hi = _top_interval(b, keep)
    return evaluate(a_lo, op, b_lo), evaluate(a_hi, op, b_hi)


@register("format", sound=True)
def format_check(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """1 if the completion is exactly a canonical non-negative integer, else 0.

    Canonical: non-empty, only digits, no leading zero unless the number is "0";
    surrounding whitespace is tolerated (detokenisers may add it). Never abstains:
    an unparseable completion is a clear failure of this check. Weak: any well-formed
    wrong number passes.
    """
    del prompt  # the format does not depend on the problem
    return np.array([1.0 if _CANONICAL.fullmatch(c.strip()) else 0.0 for c in completions], dtype=np.float32)


@register("units_digit", sound=True)
def units_digit(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """1 if the answer's last digit equals that of (a op b), computed from the operands' units digits.

    Abstains when no answer can be extracted. Weak: passes every carry error
    (±10, ±100), every error in a higher digit, and 1 in 10 random answers.
    """
    return _residue_check(prompt, completions, 10)


@register("mod9", sound=True)
def mod9(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """Casting out nines: 1 if answer ≡ (a mod 9) op (b mod 9) (mod 9).

    Abstains when no answer can be extracted. Weak: passes any permutation of the
    right digits (digit swaps), errors that are multiples of 9, and 1 in 9 random answers.
    """
    return _residue_check(prompt, completions, 9)


@register("mod11", sound=True)
def mod11(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """Casting out elevens: 1 if answer ≡ (a mod 11) op (b mod 11) (mod 11).

    Abstains when no answer can be extracted. Weak: passes errors that are multiples
    of 11, swaps of digits two places apart, and 1 in 11 random answers.
    """
    return _residue_check(prompt, completions, 11)


@register("mod7", sound=True)
def mod7(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """1 if answer ≡ (a mod 7) op (b mod 7) (mod 7).

    Abstains when no answer can be extracted. Weak: passes errors that are multiples
    of 7 (±7, ±70, ±700, ...) and 1 in 7 random answers.
    """
    return _residue_check(prompt, completions, 7)


@register("magnitude", sound=True)
def magnitude(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """1 if the answer's digit count is possible given only the operands' leading digits.

    Each operand is known only to lie in the interval of numbers sharing its length
    and leading digit; the result then lies in [lo, hi] and the answer's digit count
    must be between len(lo) and len(hi). Abstains when no answer can be extracted.
    Weak: any answer with a plausible number of digits passes.
    """
    a, op, b = parse_prompt(prompt)
    lo, hi = _result_interval(a, op, b, keep=1)
    n_lo, n_hi = len(str(lo)), len(str(hi))
    return _per_answer(completions, lambda ans: n_lo <= len(str(ans)) <= n_hi)


@register("leading_digit", sound=True)
def leading_digit(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """1 if the answer's leading digit is consistent with an estimate from the operands' top two digits.

    The result lies in [lo, hi] (operands known to two leading digits). An answer of
    length L with leading digit d passes when [d·10^(L-1), (d+1)·10^(L-1)) meets
    [lo, hi]. Abstains when no answer can be extracted, and when no value in
    [lo, hi] has L digits at all: the length is ``magnitude``'s question, and
    answering it twice would make the two checks look more correlated than they are.
    Weak: everything after the leading digit is unchecked.
    """
    a, op, b = parse_prompt(prompt)
    lo, hi = _result_interval(a, op, b, keep=2)
    out = np.full(len(completions), np.nan, dtype=np.float32)
    for i, ans in enumerate(_answers(completions)):
        if ans is None:
            continue
        length = len(str(ans))
        span_lo, span_hi = (0 if length == 1 else 10 ** (length - 1)), 10**length - 1
        if span_hi < lo or span_lo > hi:
            continue  # wrong length: abstain
        d = int(str(ans)[0])
        d_lo = d * 10 ** (length - 1)
        d_hi = (d + 1) * 10 ** (length - 1) - 1
        out[i] = 1.0 if d_lo <= hi and d_hi >= lo else 0.0
    return out


@register("majority")
def majority(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """Weaver's majority-vote pseudo-verifier: min–max rescaled frequency of each answer in its group.

    Let c_i be how many completions of the group state completion i's answer. The
    score is (c_i − min c) / (max c − min c) over the completions with an answer, and
    1 for all of them when every answer is equally frequent (Weaver's rule, so
    all-agreeing groups score 1). A completion without an answer scores 0 (it agrees
    with nobody); a group where no completion has an answer abstains throughout.
    Weak: a group that agrees on a wrong answer passes it.
    """
    del prompt
    return frequency_scores(_answers(completions))
