"""Answer-level checks for free-text tasks, reading answers the way ``task.answer_extract`` does.

``self_consistency[:<extract>]``  the group's majority answer (self-consistency): min–max rescaled
                                 frequency of each completion's stated answer among the group's, as
                                 the ``majority`` check does for the arithmetic task; a completion
                                 stating none scores 0, a group where none states one abstains.
``states_answer[:<extract>]``     1 where the completion states an answer at all, else 0.
``answer_only[:<extract>]``       1 where the completion is its answer and nothing else (a trailing
                                 full stop allowed), 0 where it says more; abstains where it states
                                 none. The format a prompt like "Give only the final number." asks for.

``<extract>`` is an ``task.answer_extract`` spec (``boxed``, ``last_number``, ``regex:<pattern>``,
``full``; default ``last_number``); answers compare after whitespace is collapsed. None of them
sees the reference: each is weak (a group can agree on a wrong answer; a bare wrong number has the
right format), which is what the label model is for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pipeline.catalog import answer_extract_problem
from pipeline.tasks.answers import make_extractor
from pipeline.verifiers.base import frequency_scores

DEFAULT_EXTRACT = "last_number"

CHECKS = ("self_consistency", "states_answer", "answer_only")


def check_arg(arg: str | None) -> None:
    """The spec check: a valid ``task.answer_extract`` spec (touches no file)."""
    if arg and (why := answer_extract_problem(arg)) is not None:
        raise ValueError(f"the answer extraction must be {why}; got {arg!r}")


def _answers(extract: Callable[[str], str | None], completions: Sequence[str]) -> list[str | None]:
    out = []
    for c in completions:
        a = extract(c)
        out.append(None if a is None else " ".join(a.split()))
    return out


def self_consistency(extract: Callable[[str], str | None], prompt: str, completions: Sequence[str]) -> np.ndarray:
    del prompt
    return frequency_scores(_answers(extract, completions))


def states_answer(extract: Callable[[str], str | None], prompt: str, completions: Sequence[str]) -> np.ndarray:
    del prompt
    return np.array([0.0 if a is None else 1.0 for a in _answers(extract, completions)], dtype=np.float32)


def answer_only(extract: Callable[[str], str | None], prompt: str, completions: Sequence[str]) -> np.ndarray:
    del prompt
    out = np.full(len(completions), np.nan, dtype=np.float32)
    for i, (c, a) in enumerate(zip(completions, _answers(extract, completions))):
        if a is not None:
            body = " ".join(c.split()).removesuffix(".").strip()
            out[i] = 1.0 if body == a else 0.0
    return out


def builder(check: Callable) -> Callable[[str | None], Callable]:
    def build(arg: str | None) -> Callable[[str, Sequence[str]], np.ndarray]:
        check_arg(arg)
        extract = make_extractor(arg or DEFAULT_EXTRACT)

        def verifier(prompt: str, completions: Sequence[str]) -> np.ndarray:
            return check(extract, prompt, completions)

        verifier.__name__ = check.__name__
        return verifier

    return build


build_self_consistency = builder(self_consistency)
build_states_answer = builder(states_answer)
build_answer_only = builder(answer_only)
