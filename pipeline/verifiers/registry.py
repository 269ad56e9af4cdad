"""The weak-verifier registry and the scorer the verifier stage runs them with.

A weak verifier looks at the prompt (``" 42+317="``) and the G completions of one
rollout group and scores each completion in [0, 1], or abstains with NaN when its
check does not apply. Verifiers NEVER see the reference answer: each one checks a
*necessary* property of the true result that it can compute cheaply from the
operands (units digit, residue mod 9, rough magnitude, ...), so each one passes
some wrong answers. That weakness is the point: the Weaver label model
(``pipeline.algo.labelmodel``) learns how far to trust each of them without labels.

Registry: ``VERIFIERS[name](prompt, completions) -> float32 [G]``, filled with
``@register(name)`` (``pipeline.verifiers.base``): the rule-based checks of
``pipeline.verifiers.arithmetic`` and ``pipeline.verifiers.math``, imported here so they
are registered. They are pure and take microseconds, so they run inline.

Heavier *kinds* live in ``pipeline/verifiers/kinds/`` and are named by a spec, with an
argument after a colon where the kind takes one (``KINDS``; imported on first use):

==========================  ===============================================================
``math_equiv``              symbolic equivalence (``math-verify``) with the group's majority answer
``reward_model:<dir>``      a local HF sequence-classification checkpoint's score
``lm_judge[:<dir>][@<s>]``  P(yes) of a judge model asked whether the completion is right (style ``s``;
                            ``lm_judge:tcp://<host>:<port>@<s>`` asks a judge server)
``code_exec``               share of the prompt's ``assert`` lines a sandboxed run of the code passes
``self_consistency[:<x>]``  the group's majority answer, answers read by ``task.answer_extract`` spec ``x``
``states_answer[:<x>]``     whether the completion states an answer at all (sound)
``answer_only[:<x>]``       whether the completion is its answer and nothing more
==========================  ===============================================================

Each runs under a per-verifier deadline: in a worker thread the caller stops waiting
for (``code_exec`` additionally kills its sandboxed process group on its own clock).
``Scorer`` runs a fixed list of specs over groups; a verifier that raises, returns
something malformed, or misses its deadline abstains (NaN for that group) and is
counted per verifier (``Scorer.stats``), so one buggy or slow check can never take
the verifier stage down. ``score_group`` is the one-group form.

The hidden truth (``correctness``) lives with each task (``pipeline.tasks``), for
evaluation and the ``ground_truth`` reward mode only; it is not a verifier.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline import plugins
from pipeline.config import DEFAULT_VERIFIERS  # noqa: F401  the ensemble unless configured otherwise
# The built-in verifiers register themselves on import.
from pipeline.verifiers import arithmetic as _arithmetic  # noqa: F401
from pipeline.verifiers import math as _math  # noqa: F401
from pipeline.verifiers.base import DEFAULT_TIMEOUT_S, KINDS, MAX_STUCK_THREADS, THREADED, VERIFIERS, Verifier



def check_spec(spec: str) -> None:
    """ValueError naming the allowed specs unless ``spec`` names a registered verifier or a valid kind spec."""
    if not isinstance(spec, str):
        raise ValueError(f"verifier spec must be a string, got {spec!r}")
    if spec in VERIFIERS:
        return
    name, sep, arg = spec.partition(":")
    kind = KINDS.get(name)
    if kind is None:
        found = plugins.find("verifier", spec)  # module:attr, file.py:attr, or an entry point
        if found is not None:
            plugins.require_callable(found, spec, "verifier (prompt, completions) -> scores [G]")
            return
        raise ValueError(f"unknown verifier {spec!r}; allowed: {sorted(VERIFIERS)}, kinds "
                         f"{[k + (':<arg>' if v.arg == 'required' else '') for k, v in KINDS.items()]}, "
                         "module:function or path/to/file.py:function (your own), or a name registered in the "
                         "'rlpipe.verifiers' entry-point group")
    if kind.arg == "required" and not arg:
        raise ValueError(f"verifier {spec!r}: kind {name!r} needs ':<arg>', {kind.help}")
    if kind.arg == "none" and sep:
        raise ValueError(f"verifier {spec!r}: kind {name!r} takes no argument")
    if kind.check:
        try:
            getattr(importlib.import_module(kind.module), kind.check)(arg or None)
        except ValueError as e:
            raise ValueError(f"verifier {spec!r}: {e}") from None


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
            if name not in KINDS:
                _BUILT[spec] = plugins.find("verifier", spec)
            else:
                module = importlib.import_module(KINDS[name].module)
                _BUILT[spec] = getattr(module, KINDS[name].build)(arg or None)
        return _BUILT[spec]


def runs_threaded(spec: str) -> bool:
    """Kinds and ``threaded`` registrations run in a worker thread; rule-based functions inline."""
    return spec not in VERIFIERS or spec in THREADED


class VerifierTimeout(Exception):
    """A verifier missed its deadline on a group."""


@dataclass
class VerifierStats:
    """Counters of one verifier in one ``Scorer`` (the verifier stage logs and exports them)."""

    groups: int = 0
    """Groups it was asked to score."""
    completions: int = 0
    """Completions of those groups (``seconds`` / ``completions``: its cost per completion)."""
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
    ``default_timeout_s``. Specs are validated at construction, so a typo fails at start-up,
    not per message; kinds are built then too, those of ``build`` only when it is given (the
    others on their first group: a judge no group asks for is never loaded).
    """

    names: Sequence[str]
    timeouts: Mapping[str, float] = field(default_factory=dict)
    default_timeout_s: float = DEFAULT_TIMEOUT_S
    build: Sequence[str] | None = None
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
        self._fns = {n: resolve(n) for n in self.names if self.build is None or n in self.build}
        self._stuck: dict[str, list[threading.Thread]] = {n: [] for n in self.names}
        self.stats = {n: VerifierStats() for n in self.names}

    def timeout_of(self, name: str) -> float:
        return float(self.timeouts.get(name, self.default_timeout_s))

    def score(self, prompt: str, completions: Sequence[str], *,
              only: Collection[str] | None = None) -> tuple[np.ndarray, dict[str, str]]:
        """Votes float32 [G, len(names)] (NaN = abstain) and each verifier's outcome:
        ``ok``, ``error`` or ``timeout`` (the last two abstain for the whole group), or
        ``skipped`` for a verifier not in ``only`` (not run: its column NaN; None runs all)."""
        g = len(completions)
        votes = np.full((g, len(self.names)), np.nan, dtype=np.float32)
        outcome: dict[str, str] = {}
        for j, name in enumerate(self.names):
            if only is not None and name not in only:
                outcome[name] = "skipped"
                continue
            st = self.stats[name]
            st.groups += 1
            st.completions += g
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
        if name not in self._fns:
            self._fns[name] = resolve(name)
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


PROBE_COMPLETIONS = ("7", "42", "315", "1640", "27813", "The answer is 7.", "\\boxed{3}")
"""What ``applicability_problems`` scores each sampled prompt with: answers in the shapes the
answer extractions read (bare numbers of several lengths, a sentence, a boxed answer). A
verifier that applies to a prompt scores some of them (right or wrong); one that cannot read
the prompt fails or abstains on all."""


def applicability_problems(specs: Sequence[str], prompts: Sequence[str], *, where: str = "the task's") -> list[str]:
    """The verifiers of ``specs`` that apply to none of ``prompts`` (real prompts of the run's
    task): each scores every prompt with :data:`PROBE_COMPLETIONS`, and one that abstains on
    all of them, or fails on all of them, is named with its last error. Kinds that run a model
    on any text (``Kind.model``: judges, reward models) apply everywhere and are not loaded."""
    problems = []
    for spec in specs:
        kind = KINDS.get(spec.partition(":")[0])
        if spec not in VERIFIERS and kind is not None and kind.model:
            continue
        scorer = Scorer([spec])
        voted = 0
        for prompt in prompts:
            votes, _ = scorer.score(prompt, list(PROBE_COMPLETIONS))
            voted += int(np.isfinite(votes).any())
        if not voted:
            st = scorer.stats[spec]
            why = f"it failed on every one ({st.last_error})" if st.errors else "it abstained on every one"
            problems.append(f"verifier.verifiers: {spec!r} does not apply to this task: scored on {len(prompts)} of "
                            f"{where} prompts (e.g. {prompts[0][:60]!r}), {why}; its votes would be NaN on every "
                            "group. Remove it, or pick verifiers that read these prompts")
    return problems
