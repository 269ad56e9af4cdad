"""Weak verifiers: the arithmetic task's (DESIGN §5, §7) and the math task's (end of the module).

A weak verifier looks at the prompt (``" 42+317="``) and the G completions of one
rollout group and scores each completion in [0, 1], or abstains with NaN when its
check does not apply. Verifiers NEVER see the reference answer: each one checks a
*necessary* property of the true result that it can compute cheaply from the
operands (units digit, residue mod 9, rough magnitude, ...), so each one passes
some wrong answers. That weakness is the point: the Weaver label model
(``pipeline.labelmodel``) learns how far to trust each of them without labels.

Registry: ``VERIFIERS[name](prompt, completions) -> float32 [G]``, filled with
``@register(name)``: the rule-based checks of this module. They are pure and take
microseconds, so they run inline, in the caller's thread.

Heavier *kinds* live in ``pipeline/verifier_kinds/`` and are named by a spec, with an
argument after a colon where the kind takes one (``KINDS``; imported on first use):

==========================  ===============================================================
``math_equiv``              symbolic equivalence (``math-verify``) with the group's majority answer
``reward_model:<dir>``      a local HF sequence-classification checkpoint's score
``lm_judge[:<dir>]``        P(yes) of a generator backend asked whether the completion is right
``code_exec``               share of the prompt's ``assert`` lines a sandboxed run of the code passes
==========================  ===============================================================

Each runs under a per-verifier deadline: in a worker thread the caller stops waiting
for (``code_exec`` additionally kills its sandboxed process group on its own clock).
``Scorer`` runs a fixed list of specs over groups; a verifier that raises, returns
something malformed, or misses its deadline abstains (NaN for that group) and is
counted per verifier (``Scorer.stats``), so one buggy or slow check can never take
the verifier stage down. ``score_group`` is the one-group form.

``correctness`` is the hidden truth, for evaluation and the ``ground_truth`` reward
mode only; it is not a verifier and is not in the registry.
"""

from __future__ import annotations

import importlib
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.task import evaluate, extract_answer, parse_prompt

Verifier = Callable[[str, Sequence[str]], np.ndarray]
"""``(prompt, completions) -> float32 [G]`` scores in [0, 1], NaN = abstain."""

VERIFIERS: dict[str, Verifier] = {}
"""All registered weak verifiers by name."""

DEFAULT_VERIFIERS: tuple[str, ...] = ("format", "units_digit", "mod9", "magnitude", "majority", "leading_digit")
"""The ensemble the pipeline uses unless configured otherwise (matches ``VerifierConfig``)."""

_CANONICAL = re.compile(r"0|[1-9][0-9]*")


THREADED: set[str] = set()
"""Registered functions that run in a worker thread under their deadline instead of inline."""

SOUND: set[str] = set()
"""Registered checks that a correct answer always passes: necessary conditions of being
right, by construction (a right sum has the right units digit, residue, length...). Known
from how the check is built, never from labels; the label model can fix their TPR at 1
(``verifier.sound_checks``) and estimate only how many wrong answers they let through."""

DEFAULT_TIMEOUT_S = 10.0
"""Seconds a verifier may spend on one group before it abstains (``verifier.timeout_s``)."""

MAX_STUCK_THREADS = 2
"""Worker threads of one verifier that may still run past their deadline; beyond that the
verifier abstains at once instead of starting another (a thread cannot be killed)."""


def register(name: str, *, threaded: bool = False, sound: bool = False) -> Callable[[Verifier], Verifier]:
    """Decorator: add a verifier to ``VERIFIERS`` under ``name`` (names are unique).

    ``threaded``: run it in a worker thread under its deadline (for a check that may be
    slow); otherwise it runs inline, and one that overruns its deadline still abstains.
    ``sound``: a correct answer always passes it (see ``SOUND``).
    """
    if ":" in name:
        raise ValueError(f"verifier name {name!r} must not contain ':' (it separates a kind from its argument)")

    def deco(fn: Verifier) -> Verifier:
        if name in VERIFIERS:
            raise ValueError(f"verifier {name!r} is already registered")
        VERIFIERS[name] = fn
        if threaded:
            THREADED.add(name)
        if sound:
            SOUND.add(name)
        return fn

    return deco


@dataclass(frozen=True, kw_only=True)
class Kind:
    """A parameterised verifier kind, built from a spec ``<name>[:<arg>]`` on first use."""

    module: str
    """Module holding ``build(arg: str | None) -> Verifier``; imported only when a spec names the kind."""
    arg: str
    """``required``, ``optional`` or ``none``: whether the spec carries ``:<arg>``."""
    help: str
    """What the argument is, for error messages."""


KINDS: dict[str, Kind] = {
    "math_equiv": Kind(module="pipeline.verifier_kinds.math_equiv", arg="none", help="no argument"),
    "reward_model": Kind(module="pipeline.verifier_kinds.reward_model", arg="required",
                         help="a local HF sequence-classification checkpoint directory (safetensors)"),
    "lm_judge": Kind(module="pipeline.verifier_kinds.lm_judge", arg="optional",
                     help="a causal-LM checkpoint directory of this project (default artifacts/base-model)"),
    "code_exec": Kind(module="pipeline.verifier_kinds.code_exec", arg="none", help="no argument"),
}
"""Verifier kinds beyond the rule-based functions, by the name before the colon."""


def check_spec(spec: str) -> None:
    """ValueError naming the allowed specs unless ``spec`` names a registered verifier or a valid kind spec."""
    if not isinstance(spec, str):
        raise ValueError(f"verifier spec must be a string, got {spec!r}")
    if spec in VERIFIERS:
        return
    name, sep, arg = spec.partition(":")
    kind = KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown verifier {spec!r}; allowed: {sorted(VERIFIERS)} and kinds "
                         f"{[k + (':<arg>' if v.arg == 'required' else '') for k, v in KINDS.items()]}")
    if kind.arg == "required" and not arg:
        raise ValueError(f"verifier {spec!r}: kind {name!r} needs ':<arg>', {kind.help}")
    if kind.arg == "none" and sep:
        raise ValueError(f"verifier {spec!r}: kind {name!r} takes no argument")


_BUILT: dict[str, Verifier] = {}
_BUILD_LOCK = threading.Lock()


def resolve(spec: str) -> Verifier:
    """The verifier function a spec names (kinds built once per process and cached)."""
    check_spec(spec)
    if spec in VERIFIERS:
        return VERIFIERS[spec]
    with _BUILD_LOCK:
        if spec not in _BUILT:
            name, _, arg = spec.partition(":")
            module = importlib.import_module(KINDS[name].module)
            _BUILT[spec] = module.build(arg or None)
        return _BUILT[spec]


def runs_threaded(spec: str) -> bool:
    """Kinds and ``threaded`` registrations run in a worker thread; rule-based functions inline."""
    return spec not in VERIFIERS or spec in THREADED


def _answers(completions: Sequence[str]) -> list[int | None]:
    """The integer each completion states (its leading digits), or None."""
    out: list[int | None] = []
    for c in completions:
        a = extract_answer(c)
        out.append(None if a is None else int(a))
    return out


def _per_answer(completions: Sequence[str], check: Callable[[int], bool]) -> np.ndarray:
    """Score 1/0 per completion by ``check(answer)``; NaN where no answer can be extracted.

    Abstaining (rather than failing) on unparseable completions keeps these checks
    about *their* property only: a missing answer is ``format``'s business, and
    letting every check fail it would make them all look correlated to the label model.
    """
    out = np.full(len(completions), np.nan, dtype=np.float32)
    for i, ans in enumerate(_answers(completions)):
        if ans is not None:
            out[i] = 1.0 if check(ans) else 0.0
    return out


def _residue_check(prompt: str, completions: Sequence[str], modulus: int) -> np.ndarray:
    """1 where answer ≡ (a mod m) op (b mod m) (mod m): a necessary condition computed from residues only."""
    a, op, b = parse_prompt(prompt)
    expected = evaluate(a % modulus, op, b % modulus) % modulus
    return _per_answer(completions, lambda ans: ans % modulus == expected)


def _top_interval(x: int, keep: int) -> tuple[int, int]:
    """The interval of all integers that share ``x``'s length and its ``keep`` leading digits.

    ``_top_interval(317, 1) == (300, 399)``; numbers with at most ``keep`` digits are exact.
    Verifiers reason from these intervals so they never compute the exact answer.
    """
    drop = max(len(str(x)) - keep, 0)
    scale = 10**drop
    lo = (x // scale) * scale
    return lo, lo + scale - 1


def _result_interval(a: int, op: str, b: int, keep: int) -> tuple[int, int]:
    """Bounds on ``a op b`` knowing only ``keep`` leading digits of each operand.

    Both operators are monotone on non-negative integers, so the bounds are the
    operator applied to the interval ends.
    """
    a_lo, a_hi = _top_interval(a, keep)
    b_lo, b_hi = _top_interval(b, keep)
    return evaluate(a_lo, op, b_lo), evaluate(a_hi, op, b_hi)


@register("format", sound=True)
def format_check(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """1 if the completion is exactly a canonical non-negative integer, else 0.

    Canonical: non-empty, only digits, no leading zero unless the number is "0";
    surrounding whitespace is tolerated (detokenisers may add it). Never abstains:
    an unparseable completion is a clear failure of this check. Weak: any well-formed
    wrong number passes.
    """
    del prompt  # the format does not depend on the problem
    return np.array([1.0 if _CANONICAL.fullmatch(c.strip()) else 0.0 for c in completions], dtype=np.float32)


@register("units_digit", sound=True)
def units_digit(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """1 if the answer's last digit equals that of (a op b), computed from the operands' units digits.

    Abstains when no answer can be extracted. Weak: passes every carry error
    (±10, ±100), every error in a higher digit, and 1 in 10 random answers.
    """
    return _residue_check(prompt, completions, 10)


@register("mod9", sound=True)
def mod9(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """Casting out nines: 1 if answer ≡ (a mod 9) op (b mod 9) (mod 9).

    Abstains when no answer can be extracted. Weak: passes any permutation of the
    right digits (digit swaps), errors that are multiples of 9, and 1 in 9 random answers.
    """
    return _residue_check(prompt, completions, 9)


@register("mod11", sound=True)
def mod11(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """Casting out elevens: 1 if answer ≡ (a mod 11) op (b mod 11) (mod 11).

    Abstains when no answer can be extracted. Weak: passes errors that are multiples
    of 11, swaps of digits two places apart, and 1 in 11 random answers.
    """
    return _residue_check(prompt, completions, 11)


@register("mod7", sound=True)
def mod7(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """1 if answer ≡ (a mod 7) op (b mod 7) (mod 7).

    Abstains when no answer can be extracted. Weak: passes errors that are multiples
    of 7 (±7, ±70, ±700, ...) and 1 in 7 random answers.
    """
    return _residue_check(prompt, completions, 7)


@register("magnitude", sound=True)
def magnitude(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """1 if the answer's digit count is possible given only the operands' leading digits.

    Each operand is known only to lie in the interval of numbers sharing its length
    and leading digit; the result then lies in [lo, hi] and the answer's digit count
    must be between len(lo) and len(hi). Abstains when no answer can be extracted.
    Weak: any answer with a plausible number of digits passes.
    """
    a, op, b = parse_prompt(prompt)
    lo, hi = _result_interval(a, op, b, keep=1)
    n_lo, n_hi = len(str(lo)), len(str(hi))
    return _per_answer(completions, lambda ans: n_lo <= len(str(ans)) <= n_hi)


@register("leading_digit", sound=True)
def leading_digit(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """1 if the answer's leading digit is consistent with an estimate from the operands' top two digits.

    The result lies in [lo, hi] (operands known to two leading digits). An answer of
    length L with leading digit d passes when [d·10^(L-1), (d+1)·10^(L-1)) meets
    [lo, hi]. Abstains when no answer can be extracted, and when no value in
    [lo, hi] has L digits at all: the length is ``magnitude``'s question, and
    answering it twice would make the two checks look more correlated than they are.
    Weak: everything after the leading digit is unchecked.
    """
    a, op, b = parse_prompt(prompt)
    lo, hi = _result_interval(a, op, b, keep=2)
    out = np.full(len(completions), np.nan, dtype=np.float32)
    for i, ans in enumerate(_answers(completions)):
        if ans is None:
            continue
        length = len(str(ans))
        span_lo, span_hi = (0 if length == 1 else 10 ** (length - 1)), 10**length - 1
        if span_hi < lo or span_lo > hi:
            continue  # wrong length: abstain
        d = int(str(ans)[0])
        d_lo = d * 10 ** (length - 1)
        d_hi = (d + 1) * 10 ** (length - 1) - 1
        out[i] = 1.0 if d_lo <= hi and d_hi >= lo else 0.0
    return out


@register("majority")
def majority(prompt: str, completions: Sequence[str]) -> np.ndarray:
    """Weaver's majority-vote pseudo-verifier: min–max rescaled frequency of each answer in its group.

    Let c_i be how many completions of the group state completion i's answer. The
    score is (c_i − min c) / (max c − min c) over the completions with an answer, and
    1 for all of them when every answer is equally frequent (Weaver's rule, so
    all-agreeing groups score 1). A completion without an answer scores 0 (it agrees
    with nobody); a group where no completion has an answer abstains throughout.
    Weak: a group that agrees on a wrong answer passes it.
    """
    del prompt
    return frequency_scores(_answers(completions))


def frequency_scores(answers: Sequence[object | None]) -> np.ndarray:
    """Min-max rescaled frequency of each answer among the group's (Weaver's majority rule):
    1 for all when every answer is equally frequent, 0 for no answer, NaN throughout when
    no completion has one."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return np.full(len(answers), np.nan, dtype=np.float32)
    c_min, c_max = min(counts.values()), max(counts.values())
    out = np.zeros(len(answers), dtype=np.float32)
    for i, ans in enumerate(answers):
        if ans is not None:
            out[i] = 1.0 if c_max == c_min else (counts[ans] - c_min) / (c_max - c_min)
    return out


class VerifierTimeout(Exception):
    """A verifier missed its deadline on a group."""


@dataclass
class VerifierStats:
    """Counters of one verifier in one ``Scorer`` (the verifier stage logs and exports them)."""

    groups: int = 0
    """Groups it was asked to score."""
    abstained: int = 0
    """Groups where its whole column abstained because it failed (= errors + timeouts)."""
    errors: int = 0
    """Groups where it raised or returned something malformed."""
    timeouts: int = 0
    """Groups where it missed its deadline (or was still stuck on earlier ones)."""
    seconds: float = 0.0
    """Wall-clock seconds spent waiting for it."""
    last_error: str = ""
    """The most recent failure, for the log."""


@dataclass
class Scorer:
    """Runs a fixed list of verifier specs over rollout groups, each under its deadline.

    ``timeouts`` maps a spec to its own deadline in seconds; the others get
    ``default_timeout_s``. Specs are validated (and kinds built) at construction, so a
    typo fails at start-up, not per message.
    """

    names: Sequence[str]
    timeouts: Mapping[str, float] = field(default_factory=dict)
    default_timeout_s: float = DEFAULT_TIMEOUT_S
    stats: dict[str, VerifierStats] = field(init=False)

    def __post_init__(self) -> None:
        self.names = list(self.names)
        for n in self.names:
            check_spec(n)  # raises naming the allowed specs
        unknown = sorted(set(self.timeouts) - set(self.names))
        if unknown:
            raise ValueError(f"timeouts for verifiers not in the list {unknown}; the list is {self.names}")
        for n, t in {**self.timeouts, "default": self.default_timeout_s}.items():
            if not (isinstance(t, (int, float)) and t > 0):
                raise ValueError(f"timeout of {n!r} must be a positive number of seconds, got {t!r}")
        self._fns = {n: resolve(n) for n in self.names}
        self._stuck: dict[str, list[threading.Thread]] = {n: [] for n in self.names}
        self.stats = {n: VerifierStats() for n in self.names}

    def timeout_of(self, name: str) -> float:
        return float(self.timeouts.get(name, self.default_timeout_s))

    def score(self, prompt: str, completions: Sequence[str]) -> tuple[np.ndarray, dict[str, str]]:
        """Votes float32 [G, len(names)] (NaN = abstain) and each verifier's outcome:
        ``ok``, ``error`` or ``timeout`` (the last two abstain for the whole group)."""
        g = len(completions)
        votes = np.full((g, len(self.names)), np.nan, dtype=np.float32)
        outcome: dict[str, str] = {}
        for j, name in enumerate(self.names):
            st = self.stats[name]
            st.groups += 1
            t0 = time.perf_counter()
            try:
                col = self._call(name, prompt, completions)
                col = np.asarray(col, dtype=np.float32)
                if col.shape != (g,):
                    raise ValueError(f"verifier {name!r} returned shape {col.shape}, expected ({g},)")
                finite = col[~np.isnan(col)]
                if ((finite < 0) | (finite > 1)).any():
                    raise ValueError(f"verifier {name!r} returned scores outside [0, 1]")
            except VerifierTimeout as exc:
                st.timeouts += 1
                st.abstained += 1
                st.last_error = str(exc)
                outcome[name] = "timeout"
            except Exception as exc:  # noqa: BLE001 - any failure of one check is an abstention, counted
                st.errors += 1
                st.abstained += 1
                st.last_error = f"{type(exc).__name__}: {exc}"
                outcome[name] = "error"
            else:
                votes[:, j] = col
                outcome[name] = "ok"
            finally:
                st.seconds += time.perf_counter() - t0
        return votes, outcome

    def _call(self, name: str, prompt: str, completions: Sequence[str]) -> np.ndarray:
        fn, timeout = self._fns[name], self.timeout_of(name)
        if not runs_threaded(name):
            t0 = time.perf_counter()
            out = fn(prompt, completions)
            if time.perf_counter() - t0 > timeout:
                raise VerifierTimeout(f"{name} took {time.perf_counter() - t0:.3f} s > {timeout} s (inline)")
            return out
        stuck = self._stuck[name] = [t for t in self._stuck[name] if t.is_alive()]
        if len(stuck) >= MAX_STUCK_THREADS:
            raise VerifierTimeout(f"{name} is still running {len(stuck)} earlier groups past their deadline")
        box: dict[str, object] = {}
        done = threading.Event()

        def work() -> None:
            try:
                box["out"] = fn(prompt, completions)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["exc"] = exc
            finally:
                done.set()

        # A daemon thread: one that never returns cannot keep the process alive at exit.
        t = threading.Thread(target=work, name=f"verifier-{name}", daemon=True)
        t.start()
        if not done.wait(timeout):
            stuck.append(t)
            raise VerifierTimeout(f"{name} exceeded its {timeout} s deadline")
        if "exc" in box:
            raise box["exc"]  # type: ignore[misc]
        return box["out"]  # type: ignore[return-value]


def score_group(
    prompt: str, completions: Sequence[str], names: Sequence[str], *, timeouts: Mapping[str, float] | None = None,
) -> tuple[np.ndarray, dict[str, int]]:
    """Run the named verifiers over one group.

    Returns ``(votes, errors)``: ``votes`` is float32 [G, len(names)] with NaN where a
    verifier abstained; ``errors[name]`` is 1 if that verifier raised, returned
    something malformed (wrong shape, values outside [0, 1]) or missed its deadline,
    else 0. A failing verifier's column becomes all-NaN (abstain), never 0, so it
    cannot push the rewards of the group in either direction.

    Raises ValueError, before running anything, for a spec that names no verifier.
    For many groups, keep one ``Scorer`` (it keeps per-verifier counters).
    """
    votes, outcome = Scorer(names, timeouts=dict(timeouts or {})).score(prompt, completions)
    return votes, {n: int(o != "ok") for n, o in outcome.items()}


def correctness(reference: str, completions: Sequence[str]) -> np.ndarray:
    """HIDDEN TRUTH: float32 [G], 1.0 where the completion's extracted answer equals ``reference``.

    For evaluation, logging and the ``ground_truth`` reward mode ONLY. It reads the
    reference answer, so it must never feed a weak verifier or the label model.
    Like ``extract_answer`` it judges the stated number, not the format.
    """
    ref = extract_answer(reference)
    return np.array([1.0 if ref is not None and extract_answer(c) == ref else 0.0 for c in completions], dtype=np.float32)


# --------------------------------------------------------------------------- math task (task.kind = "math")

_NUMERIC = re.compile(r"-?\d+(\.\d+)?|-?\\[dt]?frac\{\d+\}\{\d+\}|-?\d+/\d+")


@register("boxed", sound=True)
def boxed(prompt: str, completions: Sequence[str]) -> np.ndarray:
    r"""1 where the completion states a final answer in ``\boxed{...}`` (the math task's format), else 0.

    Sound for that task: a right answer is, by the task's definition, a boxed one.
    """
    from pipeline.tasks import boxed_answer

    del prompt
    return np.array([0.0 if boxed_answer(c) is None else 1.0 for c in completions], dtype=np.float32)


@register("boxed_numeric")
def boxed_numeric(prompt: str, completions: Sequence[str]) -> np.ndarray:
    r"""1 where the boxed answer is a plain number or fraction (``-3``, ``0.25``, ``\frac{5}{6}``, ``5/6``),
    0 where it is anything else; abstains without a boxed answer.

    Weak and not sound in general (a right answer may be an expression); for datasets
    whose answers are numbers it rejects rambling, unfinished boxes.
    """
    from pipeline.tasks import boxed_answer

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
    from pipeline.tasks import boxed_answer

    del prompt
    answers = [boxed_answer(c) for c in completions]
    return frequency_scores([None if a is None else " ".join(a.split()) for a in answers])
