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

``math-verify``'s own timeouts rely on SIGALRM, which only works in the main thread;
they are turned off here and the verifier stage's per-verifier deadline bounds the call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

try:
    from math_verify import parse, verify
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError("verifier kind 'math_equiv' needs the 'math' extra: pip install -e '.[math]'") from exc

# math-verify warns on every call that its SIGALRM timeout is off; that is deliberate here.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def parse_answer(text: str) -> list:
    """math-verify's parse of ``text`` (empty when nothing could be parsed)."""
    return parse(text, parsing_timeout=None)


def equivalent(a: list, b: list) -> bool:
    """Whether two parsed answers are mathematically equal (math-verify's ``verify``)."""
    return bool(verify(a, b, timeout_seconds=None)) or bool(verify(b, a, timeout_seconds=None))


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
    del arg  # takes none (checked by pipeline.verifiers.check_spec)

    def math_equiv(prompt: str, completions: Sequence[str]) -> np.ndarray:
        del prompt  # the group's own majority is the reference
        return majority_equivalence(completions)

    return math_equiv
