"""The embedded task: verifiable integer arithmetic.

A problem is ``a <op> b`` with operands of at most ``digits`` digits, written in a
fixed-width prompt (operands right-aligned with spaces) so that every prompt of a
task has the same length and batches need no padding or attention masks::

    " 42+317="   ->  completion "359" followed by the end-of-sequence token

The reference answer travels with the prompt for evaluation and for the
``ground_truth`` reward mode only; weak verifiers never see it (they see the prompt
and the completions). ``correctness`` is the task's hidden truth; ``ArithmeticTask``
(``task.kind = "arithmetic"``) is the task the stages see: an endless training stream
that never repeats a held-out problem.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.tasks.base import Item

if TYPE_CHECKING:
    from pipeline.config import TaskConfig

OPS = ("+", "*")


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One arithmetic problem."""

    a: int
    """Left operand, 0 <= a < 10**digits."""
    op: str
    """Operator, one of ``OPS``."""
    b: int
    """Right operand, 0 <= b < 10**digits."""
    digits: int
    """Operand width the prompt is formatted to."""

    @property
    def prompt(self) -> str:
        return f"{self.a:>{self.digits}}{self.op}{self.b:>{self.digits}}="

    @property
    def answer(self) -> str:
        return str(evaluate(self.a, self.op, self.b))


def evaluate(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}; allowed: {OPS}")


def prompt_length(digits: int) -> int:
    """Characters in every prompt of a task with ``digits``-digit operands."""
    return 2 * digits + 2


def answer_max_length(digits: int, ops: tuple[str, ...]) -> int:
    """Most characters a correct answer can have."""
    top = 10**digits - 1
    return max(len(str(evaluate(top, op, top))) for op in ops)


def parse_prompt(prompt: str) -> tuple[int, str, int]:
    """Inverse of ``Problem.prompt``: ``" 42+317="`` -> ``(42, "+", 317)``.

    Raises ValueError on anything that is not a well-formed prompt.
    """
    body = prompt.rstrip()
    if not body.endswith("="):
        raise ValueError(f"prompt does not end with '=': {prompt!r}")
    body = body[:-1]
    for op in OPS:
        left, sep, right = body.partition(op)
        if sep:
            return int(left.strip()), op, int(right.strip())
    raise ValueError(f"prompt has no operator: {prompt!r}")


def extract_answer(completion: str) -> str | None:
    """The answer a completion states: its leading digits, or None if it has none.

    A completion is expected to be just the digits of the answer; anything after
    the digits is ignored here and penalised by the ``format`` verifier.
    """
    text = completion.strip()
    end = 0
    while end < len(text) and text[end].isdigit():
        end += 1
    if end == 0:
        return None
    return str(int(text[:end]))


def problem_count(*, digits: int, ops: tuple[str, ...]) -> int:
    """Distinct problems with ``digits``-digit operands."""
    return (10**digits) ** 2 * len(set(ops))


def random_problem(rng: random.Random, *, digits: int, ops: tuple[str, ...]) -> Problem:
    hi = 10**digits - 1
    return Problem(a=rng.randint(0, hi), op=rng.choice(ops), b=rng.randint(0, hi), digits=digits)


def heldout_problems(*, n: int, seed: int, digits: int, ops: tuple[str, ...]) -> list[Problem]:
    """A fixed evaluation set: ``n`` distinct problems drawn with ``seed``."""
    if n > problem_count(digits=digits, ops=ops) // 2:
        raise ValueError(f"{n} held-out problems would leave too few of the {problem_count(digits=digits, ops=ops)} "
                         f"distinct {digits}-digit problems for training")
    rng = random.Random(seed)
    seen: set[Problem] = set()
    out: list[Problem] = []
    while len(out) < n:
        p = random_problem(rng, digits=digits, ops=ops)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def training_problems(*, seed: int, digits: int, ops: tuple[str, ...], exclude: set[Problem]):
    """An endless stream of training problems that never repeats a held-out one."""
    rng = random.Random(seed)
    while True:
        p = random_problem(rng, digits=digits, ops=ops)
        if p not in exclude:
            yield p


def correctness(reference: str, completions: Sequence[str]) -> np.ndarray:
    """HIDDEN TRUTH: float32 [G], 1.0 where the completion's extracted answer equals ``reference``.

    For evaluation, logging and the ``ground_truth`` reward mode ONLY. It reads the
    reference answer, so it must never feed a weak verifier or the label model.
    Like ``extract_answer`` it judges the stated number, not the format.
    """
    ref = extract_answer(reference)
    return np.array([1.0 if ref is not None and extract_answer(c) == ref else 0.0 for c in completions], dtype=np.float32)


class ArithmeticTask:
    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg
        self.ops = tuple(cfg.ops)
        self.eval_max_new_tokens = answer_max_length(cfg.digits, self.ops) + 1
        self._heldout = heldout_problems(n=cfg.heldout_size, seed=cfg.heldout_seed, digits=cfg.digits,
                                         ops=self.ops)

    def training(self, seed: int) -> Iterator[Item]:
        for p in training_problems(seed=seed, digits=self.cfg.digits, ops=self.ops, exclude=set(self._heldout)):
            yield Item(p.prompt, p.answer)

    def heldout(self) -> list[Item]:
        return [Item(p.prompt, p.answer) for p in self._heldout]

    def answer(self, completion: str) -> str | None:
        return extract_answer(completion)

    def correctness(self, reference: str, completions: Sequence[str]) -> np.ndarray:
        return correctness(reference, completions)
