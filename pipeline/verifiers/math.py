"""The math task's weak verifiers: the ``\boxed{}`` format, a numeric answer, the boxed majority.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from pipeline.tasks.math import boxed_answer
from pipeline.verifiers.base import frequency_scores, register


_NUMERIC = re.compile(r"-?\d+(\.\d+)?|-?\\[dt]?frac\{\d+\}\{\d+\}|-?\d+/\d+")


@register("boxed", sound=True)
def boxed(prompt: str, completions: Sequence[str]) -> np.ndarray:
    r"""1 where the completion states a final answer in ``\boxed{...}`` (the math task's format), else 0.

    Sound for that task: a right answer is, by the task's definition, a boxed one.
    """
    del prompt
    return np.array([0.0 if boxed_answer(c) is None else 1.0 for c in completions], dtype=np.float32)


@register("boxed_numeric")
def boxed_numeric(prompt: str, completions: Sequence[str]) -> np.ndarray:
    r"""1 where the boxed answer is a plain number or fraction (``-3``, ``0.25``, ``\frac{5}{6}``, ``5/6``),
    0 where it is anything else; abstains without a boxed answer.

    Weak and not sound in general (a right answer may be an expression); for datasets
    whose answers are numbers it rejects rambling, unfinished boxes.
    """
    del prompt
    out = np.full(len(completions), np.nan, dtype=np.float32)
    for i, c in enumerate(completions):
        a = boxed_answer(c)
        if a is not None:
            out[i] = 1.0 if _NUMERIC.fullmatch(a.replace(" ", "")) else 0.0
    return out


@register("boxed_majority")
def boxed_majority(prompt: str, completions: Sequence[str]) -> np.ndarray:
    r"""``majority`` over the boxed answers (whitespace-normalised strings): min-max rescaled frequency.

    ``math_equiv`` is the equivalence-aware form (``\frac{1}{2}`` = ``0.5``); this one is
    exact-match and cheap.
    """
    del prompt
    answers = [boxed_answer(c) for c in completions]
    return frequency_scores([None if a is None else " ".join(a.split()) for a in answers])
