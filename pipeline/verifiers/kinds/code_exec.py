"""``code_exec``: run a completion's code in a sandbox against the ``assert`` lines of its prompt.

Score = share of the test asserts that pass (in [0, 1]); a prompt without asserts
abstains. The tests are the public ones a code prompt states (MBPP/HumanEval style:
``assert f(2) == 4`` lines); no hidden reference is used.

The sandbox is ``pipeline.common.sandbox`` (``run_tests``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.common.sandbox import SandboxLimits, extract_code, run_tests


def tests_from_prompt(prompt: str) -> list[str]:
    """The prompt's test statements: every line that starts with ``assert`` (after indentation)."""
    return [line.strip() for line in prompt.splitlines() if line.strip().startswith("assert ")]


def build(arg: str | None, *, limits: SandboxLimits = SandboxLimits()) -> object:
    del arg  # takes none (checked by pipeline.verifiers.registry.check_spec)

    def code_exec(prompt: str, completions: Sequence[str]) -> np.ndarray:
        tests = tests_from_prompt(prompt)
        out = np.full(len(completions), np.nan, dtype=np.float32)
        if not tests:
            return out  # not a code task: abstain
        for i, c in enumerate(completions):
            out[i] = run_tests(extract_code(c), tests, limits=limits).score
        return out

    return code_exec
