"""``env.kind = "code"``: write a function, see which hidden tests fail, try again; in process.

For the code task (``task.kind = "code"``, pipeline.tasks.code): the prompt asks for one
Python function; its hidden tests come with the prompt's reference (never in the prompt).
Each model turn is an attempt: its code (the first fenced block, else the whole turn) runs
against every hidden test in the sandbox (``pipeline.common.sandbox``: ``run_tests`` with
``SandboxLimits()``: a fresh interpreter, no network, 2 CPU seconds, 5 s wall clock, 512 MiB).

- **Reward**: every step gives the share of hidden tests the attempt passed (0 to 1); the
  last one given is the episode's, so an episode that runs out of turns
  (``env.max_turns``) or tokens is scored by its last attempt.
- **Done**: when an attempt passes every test (reward 1.0).
- **Observation** after a failed attempt: what went wrong, short (at most
  ``MAX_OBSERVATION`` characters): ``2 of 6 tests failed:`` and each failing test's
  ``assert`` with its exception (at most ``MAX_LISTED``, each cut to ``MAX_LINE``
  characters); or that the code does not compile, crashed while it was defined, ran out
  of time or was killed. The failing asserts are feedback the model sees from then on;
  the prompt, and the weak verifiers, never show a test.

Code that does not compile is answered without starting a sandbox. The reset observation
is empty: the prompt states the problem. The episode has no randomness: ``reset`` takes the
group's seed and ignores it.
"""

from __future__ import annotations

import re
import signal

from pipeline.common.sandbox import SandboxLimits, extract_code, run_tests
from pipeline.envs.base import EnvError, Step
from pipeline.tasks.code import compiles, decode_reference

MAX_OBSERVATION = 600
"""Characters of an observation at most."""
MAX_LISTED = 3
"""Failing tests an observation names at most."""
MAX_LINE = 160
"""Characters of one listed failure at most."""


def _cut(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _clean(text: str) -> str:
    """Printable ASCII and newlines only: every tokenizer the pipeline uses can encode it."""
    return re.sub(r"[^\x20-\x7e\n]", "?", text)


def feedback(tests: list[str], result, limits: SandboxLimits) -> str:
    """The observation for an ``ExecResult`` of ``tests`` that did not all pass (``limits``: the
    sandbox's)."""
    n = len(tests)
    if result.timed_out:  # the wall clock or the CPU allowance, whichever came first: one message for both
        return (f"\nYour code ran out of time (the limits are {limits.wall_s:g} s of wall clock and "
                f"{limits.cpu_s:g} s of CPU); 0 of {n} tests passed.\n")
    failures = []
    crashed = None
    for line in result.stderr.splitlines():
        if line.startswith("solution failed: "):
            crashed = line[len("solution failed: "):]
        elif line.startswith("test failed: "):
            rest = line[len("test failed: "):]
            for t in tests:
                if rest.startswith(t + ": "):
                    failures.append(f"{t} -> {rest[len(t) + 2:]}")
                    break
    if crashed is not None:
        text = f"\nYour code failed before any test ran: {_cut(crashed, MAX_LINE)}\n"
    elif failures:
        failed = n - result.passed
        lines = [_cut(f, MAX_LINE) for f in failures[:MAX_LISTED]]
        more = f"\n(and {failed - len(lines)} more)" if failed > len(lines) else ""
        text = f"\n{failed} of {n} tests failed:\n" + "\n".join(lines) + more + "\n"
    elif result.returncode is None:
        text = f"\nYour code could not be run ({_cut(result.note, MAX_LINE)}).\n"
    elif result.returncode == 0:  # the harness finished, but which tests failed was lost in the program's output
        text = f"\n{n - result.passed} of {n} tests failed (your code's own output hid which).\n"
    else:  # killed before the harness reported: the memory limit, or the process ended itself
        how = f"exit status {result.returncode}"
        if result.returncode < 0:
            try:
                how = signal.Signals(-result.returncode).name
            except ValueError:
                how = f"signal {-result.returncode}"
        tail = _cut(result.stderr.strip().splitlines()[-1], MAX_LINE) if result.stderr.strip() else ""
        text = f"\nYour code was stopped ({how}{': ' + tail if tail else ''}); 0 of {n} tests passed.\n"
    text = _clean(text)
    return text if len(text) <= MAX_OBSERVATION else text[: MAX_OBSERVATION - 4] + "...\n"


class CodeEpisode:
    """One attempt-and-feedback episode on a code problem (the module docstring)."""

    def __init__(self, reference: str, *, limits=None) -> None:
        try:
            self.function, self.tests = decode_reference(reference)
        except ValueError as e:
            raise EnvError(f"env.kind 'code': {e}") from None
        self.limits = limits or SandboxLimits()
        self.attempts = 0

    def reset(self, seed: int | None = None) -> str:
        return ""  # no randomness (the hidden tests are the prompt's): every seed is the same episode

    def step(self, action: str) -> Step:
        self.attempts += 1
        code = extract_code(action)
        n = len(self.tests)
        if not compiles(code):
            try:
                compile(code, "solution.py", "exec")
                why = "it does not compile"
            except SyntaxError as e:
                why = f"SyntaxError: {e.msg} (line {e.lineno})"
            except Exception as e:  # noqa: BLE001 - whatever compile raised
                why = f"{type(e).__name__}: {e}"
            return Step(observation=_clean(f"\nYour code does not compile: {_cut(why, MAX_LINE)}; 0 of {n} tests "
                                           f"passed.\n"), reward=0.0, done=False)
        result = run_tests(code, self.tests, limits=self.limits)
        passed = 0 if result.timed_out else result.passed
        if passed == n:
            return Step(observation="", reward=1.0, done=True)
        return Step(observation=feedback(self.tests, result, self.limits), reward=passed / n, done=False)

    def close(self) -> None:
        pass


def code(cfg):
    """The factory: one code episode per completion, knowing its prompt's hidden tests."""
    return lambda task: CodeEpisode(task.reference)
