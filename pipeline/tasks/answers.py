r"""How a completion states its answer (``task.answer_extract``), for the tasks that read free text.

The math and reasoning-gym tasks judge the answer a completion states, not the whole
completion; which part of it is the answer is one setting, used by the task's hidden
truth (``correctness``), its ``answer`` (the ``majority`` reward) and the held-out
evaluation alike:

================  ====================================================================
``boxed``         the content of the last ``\boxed{...}`` (balanced braces)
``last_number``   the last number: an integer or decimal, with an optional sign and
                  thousands separators (``-12``, ``3.5``, ``1,000`` read as ``1000``)
``regex:<pat>``   the last match of the regular expression ``<pat>`` (its first group when
                  it has one), e.g. ``regex:<answer>(.*?)</answer>``; searched with DOTALL
``full``          the whole completion
================  ====================================================================

Each gives the answer stripped of surrounding whitespace, or None when the completion
states none. The arithmetic task keeps its own reading (the leading digits).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from pipeline.catalog import answer_extract_problem

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")


def boxed_answer(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (balanced braces), stripped; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                content = text[i:j].strip()
                return content or None
    return None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (sign kept, thousands separators dropped); None when there is none."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    return found[-1].replace(",", "").lstrip("+")


def _full(text: str) -> str | None:
    return text.strip() or None


def _regex(pattern: re.Pattern[str], text: str) -> str | None:
    last = None
    for last in pattern.finditer(text):
        pass
    if last is None:
        return None
    value = last.group(1) if pattern.groups else last.group(0)
    value = (value or "").strip()
    return value or None


@functools.cache
def make_extractor(spec: str) -> Callable[[str], str | None]:
    """The function ``task.answer_extract = spec`` names: completion -> its answer (None: none stated)."""
    if (why := answer_extract_problem(spec)) is not None:
        raise ValueError(f"task.answer_extract: must be {why}; got {spec!r}")
    if spec == "boxed":
        return boxed_answer
    if spec == "last_number":
        return last_number
    if spec == "full":
        return _full
    return functools.partial(_regex, re.compile(spec.partition(":")[2], re.DOTALL))
