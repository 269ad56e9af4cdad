"""The embedded code task (``task.kind = "code"``): write a small Python function, judged by hidden tests.

A problem asks for one function by name and signature and says in words what it must
return (``Write a Python function `clamp(x)` that returns ...``). The problems are
generated from the :data:`FAMILIES` below (two dozen kinds of function, each with its
parameters: a constant to add, a letter to count, a range to clamp to, ...; about 2,500
distinct problems in all). Each problem has six **hidden tests**, ``assert`` statements
on inputs drawn from a generator seeded by the problem itself, with the expected values
computed by the family's own solution; the same problem always has the same tests, in
every process.

* **Prompt**: the problem in words, through ``task.template`` (``{problem}``) and the
  checkpoint's chat template like the other text tasks. It never shows a test.
* **Reference**: ``{"function": name, "tests": [...]}`` as JSON (``encode_reference``).
  It travels with the prompt as every task's hidden reference: the ``code`` environment
  (``env.kind = "code"``, pipeline.envs.code) runs the tests, the truth below reads them,
  and the weak verifiers never see them.
* **Held out**: ``task.heldout_size`` distinct problems drawn with ``task.heldout_seed``
  (a family first, then one of its problems), never more than half of any family's
  problems, so every family is also trained on. Training draws the same way from
  ``feeder.seed`` and skips every held-out problem, so it never issues one.
* **Truth**: a completion is right when its code (the first fenced block, else the whole
  text; ``pipeline.common.sandbox.extract_code``) passes every hidden test in
  the sandbox (``run_tests``, its default limits). Code that does not even
  compile is wrong without starting a sandbox.
"""

from __future__ import annotations

import json
import math
import random
import string
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.common.sandbox import SandboxLimits, extract_code, run_tests
from pipeline.tasks.base import Item

if TYPE_CHECKING:
    from pipeline.config import TaskConfig

TESTS_PER_PROBLEM = 6
"""Hidden tests of every problem."""

INSTRUCTION = "Reply with the function's Python code only."
"""The last sentence of every problem."""


@dataclass(frozen=True)
class Family:
    """One kind of function: its name and signature, what it must do (``describe``, formatted with
    a parameter set), its solution (``solution``, the same), and the inputs its tests call it on."""

    name: str
    """The function's name (the same for every problem of the family)."""
    signature: str
    """Its parameters, as written in the ``def`` line."""
    describe: str
    """What it returns, a ``str.format`` template over the parameters."""
    solution: str
    """The body of a correct function, the same template (indented 4 spaces, lines joined by newlines)."""
    params: Callable[[], list[dict[str, Any]]]
    """Every parameter set of the family, in a fixed order."""
    inputs: Callable[[random.Random, dict[str, Any]], list[tuple]]
    """Argument tuples to test a problem on (at least ``TESTS_PER_PROBLEM`` distinct ones)."""


def _ints(rng: random.Random, lo: int, hi: int, extra: Sequence[int] = ()) -> list[tuple]:
    vals = list(dict.fromkeys(extra))
    while len(vals) < TESTS_PER_PROBLEM + 4:
        v = rng.randint(lo, hi)
        if v not in vals:
            vals.append(v)
    return [(v,) for v in vals]


def _words(rng: random.Random, n: int, *, alphabet: str = string.ascii_lowercase, lo: int = 0,
           hi: int = 9, extra: Sequence[str] = ()) -> list[tuple]:
    vals = list(dict.fromkeys(extra))
    while len(vals) < n:
        w = "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))
        if w not in vals:
            vals.append(w)
    return [(v,) for v in vals]


def _lists(rng: random.Random, n: int, *, lo: int = -20, hi: int = 20, min_len: int = 0, max_len: int = 8,
           extra: Sequence[list] = ()) -> list[tuple]:
    vals = [list(x) for x in extra]
    while len(vals) < n:
        xs = [rng.randint(lo, hi) for _ in range(rng.randint(min_len, max_len))]
        if xs not in vals:
            vals.append(xs)
    return [(v,) for v in vals]


_N = TESTS_PER_PROBLEM + 4
_PREFIXES = ("pre", "re", "un", "in", "dis", "over", "sub", "co", "de", "ex", "anti", "auto", "bi", "mid", "mis",
             "non", "out", "tri", "up", "under")

FAMILIES: tuple[Family, ...] = (
    Family("add_const", "x", "returns the integer x plus {k}", "return x + {k}",
           lambda: [{"k": k} for k in range(1, 201)],
           lambda rng, p: _ints(rng, -1000, 1000, (0, -p["k"]))),
    Family("times_const", "x", "returns the integer x multiplied by {k}", "return x * {k}",
           lambda: [{"k": k} for k in range(2, 101)],
           lambda rng, p: _ints(rng, -500, 500, (0, 1, -1))),
    Family("is_multiple", "n", "returns True when the integer n is divisible by {k}, and False otherwise",
           "return n % {k} == 0",
           lambda: [{"k": k} for k in range(2, 101)],
           lambda rng, p: _ints(rng, -300, 300, (0, p["k"], p["k"] + 1, 3 * p["k"]))),
    Family("clamp", "x", "returns x limited to the range from {lo} to {hi}: {lo} when x is smaller than {lo}, "
           "{hi} when x is larger than {hi}, and x itself otherwise", "return min(max(x, {lo}), {hi})",
           lambda: [{"lo": lo, "hi": lo + d} for lo in range(-20, 21) for d in range(1, 31)],
           lambda rng, p: _ints(rng, p["lo"] - 30, p["hi"] + 30, (p["lo"], p["hi"], p["lo"] - 1, p["hi"] + 1))),
    Family("repeat_text", "s", "returns the string s repeated {k} times", "return s * {k}",
           lambda: [{"k": k} for k in range(2, 10)],
           lambda rng, p: _words(rng, _N, hi=5, extra=("",))),
    Family("count_letter", "s", "returns how many times the letter '{c}' occurs in the string s",
           "return s.count('{c}')",
           lambda: [{"c": c} for c in string.ascii_lowercase],
           lambda rng, p: _words(rng, _N, alphabet=p["c"] * 4 + "abcxyz", hi=12, extra=("", p["c"]))),
    Family("drop_letter", "s", "returns the string s with every '{c}' removed", "return s.replace('{c}', '')",
           lambda: [{"c": c} for c in string.ascii_lowercase],
           lambda rng, p: _words(rng, _N, alphabet=p["c"] * 4 + "abcxyz", hi=12, extra=("", p["c"] * 3))),
    Family("sum_multiples", "n", "returns the sum of the integers from 0 to n - 1 that are multiples of {k} "
           "(0 when n is 0 or less)", "return sum(i for i in range(n) if i % {k} == 0)",
           lambda: [{"k": k} for k in range(2, 31)],
           lambda rng, p: _ints(rng, 1, 200, (0, 1, p["k"], p["k"] + 1))),
    Family("power_of", "x", "returns the integer x raised to the power {k}", "return x ** {k}",
           lambda: [{"k": k} for k in range(2, 7)],
           lambda rng, p: _ints(rng, -12, 12, (0, 1, -1))),
    Family("digit_sum_base", "n", "returns the sum of the digits of the non-negative integer n written in "
           "base {b}", "total = 0\n    while n > 0:\n        total += n % {b}\n        n //= {b}\n    return total",
           lambda: [{"b": b} for b in range(2, 17)],
           lambda rng, p: _ints(rng, 1, 5000, (0, p["b"], p["b"] - 1))),
    Family("rotate_left", "xs", "returns a new list: the list xs rotated left by {k} positions (the first "
           "item moves to the end, {k} times; an empty list stays empty)",
           "if not xs:\n        return []\n    k = {k} % len(xs)\n    return xs[k:] + xs[:k]",
           lambda: [{"k": k} for k in range(1, 10)],
           lambda rng, p: _lists(rng, _N, extra=([], [5]))),
    Family("every_nth", "xs", "returns a list of every {k}-th item of the list xs, starting with the first "
           "(the items at positions 0, {k}, {k2}, ...)", "return xs[::{k}]",
           lambda: [{"k": k, "k2": 2 * k} for k in range(2, 10)],
           lambda rng, p: _lists(rng, _N, max_len=20, extra=([],))),
    Family("count_above", "xs", "returns how many numbers in the list xs are greater than {t}",
           "return sum(1 for x in xs if x > {t})",
           lambda: [{"t": t} for t in range(-50, 51)],
           lambda rng, p: _lists(rng, _N, lo=p["t"] - 10, hi=p["t"] + 10, extra=([], [p["t"]]))),
    Family("keep_divisible", "xs", "returns a list of the numbers in the list xs that are divisible by {k}, "
           "in their order", "return [x for x in xs if x % {k} == 0]",
           lambda: [{"k": k} for k in range(2, 21)],
           lambda rng, p: _lists(rng, _N, lo=-60, hi=60, max_len=10, extra=([],))),
    Family("pad_left", "s", "returns the string s with '{c}' characters added on its left until it is "
           "{w} characters long (s itself when it is already that long or longer)", "return s.rjust({w}, '{c}')",
           lambda: [{"w": w, "c": c} for w in range(3, 17) for c in "*#.-_0"],
           lambda rng, p: _words(rng, _N, hi=p["w"] + 3, extra=("",))),
    Family("caesar", "s", "returns s with every lowercase letter a-z shifted {k} places forward in the "
           "alphabet, wrapping around from z to a; other characters stay as they are",
           "return ''.join(chr((ord(ch) - 97 + {k}) % 26 + 97) if 'a' <= ch <= 'z' else ch for ch in s)",
           lambda: [{"k": k} for k in range(1, 26)],
           lambda rng, p: _words(rng, _N, alphabet="abcxyz z-A!", hi=10, extra=("", "z"))),
    Family("kth_largest", "xs", "returns the {k}-th largest number in the list xs, which has at least {k} "
           "items (1 means the largest; equal numbers count separately)", "return sorted(xs, reverse=True)[{k} - 1]",
           lambda: [{"k": k} for k in range(1, 5)],
           lambda rng, p: _lists(rng, _N, min_len=p["k"], max_len=9)),
    Family("gcd_with", "n", "returns the greatest common divisor of the positive integer n and {k}",
           "import math\n    return math.gcd(n, {k})",
           lambda: [{"k": k} for k in range(2, 201)],
           lambda rng, p: _ints(rng, 1, 1000, (1, p["k"], 2 * p["k"]))),
    Family("reverse_words", "s", "returns the parts of the string s separated by '{sep}', in reverse order and "
           "joined by '{sep}' again", "return '{sep}'.join(reversed(s.split('{sep}')))",
           lambda: [{"sep": sep} for sep in " ,;-|/"],
           lambda rng, p: _words(rng, _N, alphabet="abcde" + p["sep"], lo=1, hi=12, extra=("ab",))),
    Family("mod_sum", "a, b", "returns the sum of the integers a and b modulo {k} (a number from 0 to {km})",
           "return (a + b) % {k}",
           lambda: [{"k": k, "km": k - 1} for k in range(2, 101)],
           lambda rng, p: list(dict.fromkeys((rng.randint(-200, 200), rng.randint(-200, 200)) for _ in range(_N)))),
    Family("starts_with", "s", "returns True when the string s starts with '{p}', and False otherwise",
           "return s.startswith('{p}')",
           lambda: [{"p": p} for p in _PREFIXES],
           lambda rng, p: _words(rng, _N, alphabet="aeinoprstu", hi=6,
                                 extra=(p["p"], p["p"] + "x", p["p"][:-1], "x" + p["p"], ""))),
    Family("scaled_triangle", "n", "returns {k} times the sum 1 + 2 + ... + n of the integers from 1 to n "
           "(0 when n is 0)", "return {k} * n * (n + 1) // 2",
           lambda: [{"k": k} for k in range(1, 51)],
           lambda rng, p: _ints(rng, 1, 500, (0, 1))),
    Family("fib_from", "n", "returns term n of the sequence whose terms 0 and 1 are {a} and {b}, each later "
           "term being the sum of the two before it (n is 0 or more)",
           "a, b = {a}, {b}\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
           lambda: [{"a": a, "b": b} for a in range(10) for b in range(10)],
           lambda rng, p: _ints(rng, 2, 40, (0, 1))),
    Family("longest_run", "s", "returns the length of the longest run of consecutive '{c}' characters in the "
           "string s (0 when s has none)",
           "best = run = 0\n    for ch in s:\n        run = run + 1 if ch == '{c}' else 0\n"
           "        best = max(best, run)\n    return best",
           lambda: [{"c": c} for c in "ab01xy"],
           lambda rng, p: _words(rng, _N, alphabet=p["c"] * 3 + "ab01xy", hi=14, extra=("", p["c"]))),
)
"""Every kind of problem the task generates."""

_BY_NAME = {f.name: f for f in FAMILIES}
assert len(_BY_NAME) == len(FAMILIES), "family names must differ"


@dataclass(frozen=True)
class Problem:
    """One problem: a family and one of its parameter sets (as sorted pairs, so it hashes)."""

    family: str
    params: tuple[tuple[str, Any], ...]

    @property
    def spec(self) -> Family:
        return _BY_NAME[self.family]

    @property
    def values(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def prompt(self) -> str:
        f = self.spec
        return f"Write a Python function `{f.name}({f.signature})` that {f.describe.format(**self.values)}. " \
               + INSTRUCTION

    @property
    def solution(self) -> str:
        """A correct function (the family's own), as source."""
        f = self.spec
        return f"def {f.name}({f.signature}):\n    {f.solution.format(**self.values)}\n"

    @property
    def tests(self) -> list[str]:
        return hidden_tests(self)


def _problem(family: Family, values: dict[str, Any]) -> Problem:
    return Problem(family.name, tuple(sorted(values.items())))


@cache
def problems_of(name: str) -> tuple[Problem, ...]:
    """Every problem of the family ``name``, in a fixed order."""
    f = _BY_NAME[name]
    return tuple(_problem(f, v) for v in f.params())


def problem_count() -> int:
    """Distinct problems the task can generate."""
    return sum(len(problems_of(f.name)) for f in FAMILIES)


def heldout_limit() -> int:
    """The most problems ``task.heldout_size`` may hold out: half of each family's problems."""
    return sum(len(problems_of(f.name)) // 2 for f in FAMILIES)


@cache
def hidden_tests(problem: Problem) -> list[str]:
    """The problem's ``TESTS_PER_PROBLEM`` asserts: inputs from a generator seeded by the problem,
    expected values from the family's own solution (run here: it is this module's code)."""
    f = problem.spec
    rng = random.Random(zlib.crc32(f"code-tests:{problem.family}:{problem.params!r}".encode()))
    ns: dict[str, Any] = {"math": math}
    exec(compile(problem.solution, f"<solution of {problem.family}>", "exec"), ns)  # noqa: S102 - our own code
    fn = ns[f.name]
    args = list({repr(a): a for a in f.inputs(rng, problem.values)}.values())  # distinct, in order
    # A fixed draw of the first few inputs (the edge cases) plus random ones, in a shuffled order.
    chosen = args[:3] + rng.sample(args[3:], TESTS_PER_PROBLEM - 3)
    tests = []
    for a in chosen:
        call = f"{f.name}({', '.join(repr(x) for x in a)})"
        expected = fn(*[list(x) if isinstance(x, list) else x for x in a])
        tests.append(f"assert {call} == {expected!r}")
    rng.shuffle(tests)
    return tests


def encode_reference(problem: Problem) -> str:
    """The hidden reference of a problem: the function's name and its tests."""
    return json.dumps({"function": problem.spec.name, "tests": hidden_tests(problem)}, separators=(",", ":"))


def decode_reference(reference: str) -> tuple[str, list[str]]:
    """``(function name, tests)`` of a reference ``encode_reference`` wrote; ValueError for anything else."""
    try:
        data = json.loads(reference)
    except (TypeError, ValueError):
        data = None
    if not (isinstance(data, dict) and isinstance(data.get("function"), str) and isinstance(data.get("tests"), list)
            and data["tests"] and all(isinstance(t, str) for t in data["tests"])):
        raise ValueError(f"not a code task's reference (a JSON object with 'function' and a non-empty list of "
                         f"'tests'; task.kind 'code' writes them): {str(reference)[:80]!r}")
    return data["function"], list(data["tests"])


def _draw(rng: random.Random, families: Sequence[Family]) -> Problem:
    return rng.choice(problems_of(rng.choice(families).name))


def heldout_problems(*, n: int, seed: int) -> list[Problem]:
    """``n`` distinct problems drawn with ``seed``: a family, then one of its problems, at most
    half of any family's problems."""
    if not 1 <= n <= heldout_limit():
        raise ValueError(f"task.heldout_size: in [1, {heldout_limit()}] for task.kind 'code' (half of each "
                         f"family's problems); got {n}")
    rng = random.Random(zlib.crc32(f"code-heldout:{seed}".encode()))
    taken: dict[str, int] = {f.name: 0 for f in FAMILIES}
    seen: set[Problem] = set()
    out: list[Problem] = []
    while len(out) < n:
        room = [f for f in FAMILIES if taken[f.name] < len(problems_of(f.name)) // 2]
        p = _draw(rng, room)
        if p not in seen:
            seen.add(p)
            taken[p.family] += 1
            out.append(p)
    return out


def training_problems(*, seed: int, exclude: set[Problem]) -> Iterator[Problem]:
    """The endless stream of training problems: never one of ``exclude`` (the held-out set)."""
    rng = random.Random(zlib.crc32(f"code-train:{seed}".encode()))
    while True:
        p = _draw(rng, FAMILIES)
        if p not in exclude:
            yield p


def compiles(code: str) -> bool:
    """Whether ``code`` compiles as a module (nothing of it runs)."""
    try:
        compile(code, "solution.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False
    return True


def passes(code: str, tests: Sequence[str], *, limits=None) -> bool:
    """HIDDEN TRUTH: whether ``code`` passes every test in the sandbox (``pipeline.common.sandbox``)."""
    if not compiles(code):
        return False
    r = run_tests(code, tests, limits=limits or SandboxLimits())
    return not r.timed_out and r.total > 0 and r.passed == r.total


class CodeTask:
    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg
        self.eval_max_new_tokens = cfg.max_new_tokens
        self._heldout = heldout_problems(n=cfg.heldout_size, seed=cfg.heldout_seed)

    def _item(self, p: Problem) -> Item:
        return Item(self.cfg.template.replace("{problem}", p.prompt), encode_reference(p), source=p.family)

    def training(self, seed: int) -> Iterator[Item]:
        for p in training_problems(seed=seed, exclude=set(self._heldout)):
            yield self._item(p)

    def heldout(self) -> list[Item]:
        return [self._item(p) for p in self._heldout]

    def answer(self, completion: str) -> str | None:
        """The code a completion states (its first fenced block, else all of it), whitespace-normalised."""
        code = extract_code(completion).strip()
        return " ".join(code.split()) or None

    def correctness(self, reference: str, completions: Sequence[str]) -> np.ndarray:
        """HIDDEN TRUTH: 1 where the completion's code passes every hidden test (one sandbox run each;
        identical code is run once)."""
        _, tests = decode_reference(reference)
        seen: dict[str, bool] = {}
        out = np.zeros(len(completions), dtype=np.float32)
        for i, c in enumerate(completions):
            code = extract_code(c)
            if code not in seen:
                seen[code] = passes(code, tests)
            out[i] = float(seen[code])
        return out


def sample_rows(cfg: TaskConfig, n: int, *, seed: int = 0) -> list[dict[str, str]]:
    """``n`` training problems as ``{"problem", "answer"}`` rows, the answer a correct function
    (never a held-out problem): text to train a tokenizer on and warm a model up with."""
    held = set(heldout_problems(n=cfg.heldout_size, seed=cfg.heldout_seed))
    rows = []
    for p in training_problems(seed=seed, exclude=held):
        rows.append({"problem": p.prompt, "answer": p.solution})
        if len(rows) == n:
            break
    return rows
