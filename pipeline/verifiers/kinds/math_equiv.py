"""``math_equiv``: symbolic equivalence of each completion's answer with the group's majority answer.

No reference answer is used: the completions of a group are parsed with
``math-verify`` (LaTeX, fractions, decimals, boxed answers, plain expressions), grouped
into classes of mutually equivalent answers, and every completion in the largest
class (or one of the tied largest) scores 1, every other parsed completion 0. A
completion with nothing parseable abstains (NaN; the format is another check's
business), and so does a whole group with no parseable answer.

This is the majority pseudo-verifier made equivalence-aware: ``\\frac{1}{2}``, ``0.5``
and ``1/2`` vote for the same answer. Weak in the same way: a group that agrees on a
wrong answer passes it. Needs the optional extra ``math`` (``pip install -e '.[math]'``).

Parsing and equivalence are the math task's (``pipeline.tasks.math``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

try:
    import math_verify  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError("verifier kind 'math_equiv' needs the 'math' extra: pip install -e '.[math]'") from exc

from pipeline.tasks.math import equivalent, parse_answer


def majority_equivalence(completions: Sequence[str]) -> np.ndarray:
    """float32 [G]: 1 in the (tied) largest equivalence class, 0 in the others, NaN if unparseable."""
    parsed = [parse_answer(c) for c in completions]
    reps: list[list] = []           # one parsed answer per class
    cls = [-1] * len(completions)   # class of each completion, -1 = unparseable
    for i, p in enumerate(parsed):
        if not p:
            continue
        for k, rep in enumerate(reps):
            if equivalent(rep, p):
                cls[i] = k
                break
        else:
            reps.append(p)
            cls[i] = len(reps) - 1
    out = np.full(len(completions), np.nan, dtype=np.float32)
    if not reps:
        return out
    sizes = np.bincount([c for c in cls if c >= 0], minlength=len(reps))
    top = sizes.max()
    for i, c in enumerate(cls):
        if c >= 0:
            out[i] = 1.0 if sizes[c] == top else 0.0
    return out


def build(arg: str | None) -> object:
    del arg  # takes none (checked by pipeline.verifiers.registry.check_spec)

    def math_equiv(prompt: str, completions: Sequence[str]) -> np.ndarray:
        del prompt  # the group's own majority is the reference
        return majority_equivalence(completions)

    return math_equiv
