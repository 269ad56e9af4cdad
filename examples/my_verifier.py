"""A weak verifier of one's own: does the answer's parity match the parity the operands imply?

For ``a+b`` / ``a-b`` the last digit's parity of the result is fixed by the operands' last
digits; for ``a*b`` it is odd only when both are. A cheap, partial, independent signal: it
votes 1.0 when the completion's parity matches, 0.0 when not, and abstains (NaN) where it
cannot read the prompt or the answer. Weaver learns how far to trust it from agreement alone.

Signature (docs/extending.md): ``fn(prompt: str, completions: list[str]) -> array [G]`` in [0, 1].

    pipeline up --config configs/tiny.toml --trainer.steps 4 \\
        --verifier.verifiers format,units_digit,mod9,examples/my_verifier.py:last_digit_parity
"""

from __future__ import annotations

import re

import numpy as np

_PROBLEM = re.compile(r"(-?\d+)\s*([+\-*])\s*(-?\d+)\s*=")
_ANSWER = re.compile(r"-?\d+")


def expected_parity(prompt: str) -> int | None:
    m = None
    for m in _PROBLEM.finditer(prompt):
        pass  # the last problem of the prompt (a few-shot prompt holds solved ones first)
    if m is None:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return (a * b if op == "*" else a + b if op == "+" else a - b) % 2


def last_digit_parity(prompt: str, completions: list[str]) -> np.ndarray:
    want = expected_parity(prompt)
    out = np.full(len(completions), np.nan, dtype=np.float32)
    if want is None:
        return out
    for i, c in enumerate(completions):
        m = _ANSWER.search(c)
        if m is not None:
            out[i] = 1.0 if int(m.group()) % 2 == want else 0.0
    return out
