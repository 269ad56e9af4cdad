"""What a weak verifier is, and how one joins the registry.

A weak verifier looks at the prompt and the G completions of one rollout group and
scores each completion in [0, 1], or abstains with NaN when its check does not apply.
Verifiers NEVER see the reference answer. ``@register(name)`` adds a function to
``VERIFIERS``; heavier, parameterised *kinds* (``KINDS``) are modules of
``pipeline/verifiers/kinds/`` built from a spec ``<kind>[:<arg>]`` on first use.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


Verifier = Callable[[str, Sequence[str]], np.ndarray]
"""``(prompt, completions) -> float32 [G]`` scores in [0, 1], NaN = abstain."""

VERIFIERS: dict[str, Verifier] = {}
"""All registered weak verifiers by name."""

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
    check: str = ""
    """Name of a function ``check(arg: str | None) -> None`` of ``module`` that raises ValueError for a
    bad argument when the spec is checked (before anything starts); it must load no model and may
    read only a small file the spec names (an ``lm_judge`` style file). Empty: only ``arg`` is checked."""
    build: str = "build"
    """Name of the builder in ``module`` (several kinds may share a module)."""
    sound: bool = False
    """A correct answer always passes every verifier of this kind (see ``SOUND``)."""
    model: bool = False
    """It runs a model on any text (a judge, a reward model): it applies to every prompt, and the
    check before launch does not load it to see (``registry.applicability_problems``)."""


_EXTRACT_HELP = "a task.answer_extract spec (boxed, last_number, regex:<pattern>, full); default last_number"

KINDS: dict[str, Kind] = {
    "math_equiv": Kind(module="pipeline.verifiers.kinds.math_equiv", arg="none", help="no argument"),
    "reward_model": Kind(module="pipeline.verifiers.kinds.reward_model", arg="required", model=True,
                         help="a local HF sequence-classification checkpoint directory (safetensors)"),
    "lm_judge": Kind(module="pipeline.verifiers.kinds.lm_judge", arg="optional", check="check_arg", model=True,
                     help="a causal-LM checkpoint directory (default artifacts/base-model) or a judge server's "
                          "tcp://<host>:<port>, then optionally @<style> for a chat model"),
    "code_exec": Kind(module="pipeline.verifiers.kinds.code_exec", arg="none", help="no argument"),
    "self_consistency": Kind(module="pipeline.verifiers.kinds.answers", arg="optional", check="check_arg",
                             build="build_self_consistency", help=_EXTRACT_HELP),
    "states_answer": Kind(module="pipeline.verifiers.kinds.answers", arg="optional", check="check_arg",
                          build="build_states_answer", help=_EXTRACT_HELP, sound=True),
    "answer_only": Kind(module="pipeline.verifiers.kinds.answers", arg="optional", check="check_arg",
                        build="build_answer_only", help=_EXTRACT_HELP),
}
"""Verifier kinds beyond the rule-based functions, by the name before the colon."""


def is_sound(spec: str) -> bool:
    """Whether a verifier spec names a sound check: a registered one in ``SOUND`` or a kind marked sound."""
    if spec in SOUND:
        return True
    kind = KINDS.get(spec.partition(":")[0])
    return kind is not None and kind.sound


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


VERIFIER_SECONDS = "verifier_seconds_total:"
VERIFIER_COMPLETIONS = "verifier_completions_total:"
"""Prefixes of the run's per-verifier counters (``{ns}:stats``, one field per verifier spec,
e.g. ``verifier_seconds_total:mod9``): the seconds the verifier stage spent waiting for it
and the completions it scored, added with each scored batch."""


def verifier_costs(stats: dict[str, float], names: Sequence[str] = ()) -> dict[str, dict[str, float]]:
    """What each verifier cost a run, from its counters: ``{spec: {completions, seconds,
    seconds_per_completion}}``, in the order of ``names`` (a verifier of ``names`` that never
    ran: 0 completions, ``seconds_per_completion`` None), then any other counted."""
    done = {k[len(VERIFIER_COMPLETIONS):]: v for k, v in stats.items() if k.startswith(VERIFIER_COMPLETIONS)}
    secs = {k[len(VERIFIER_SECONDS):]: v for k, v in stats.items() if k.startswith(VERIFIER_SECONDS)}
    out = {}
    for name in [*names, *(n for n in done if n not in names)]:
        n, t = int(done.get(name, 0)), float(secs.get(name, 0.0))
        out[name] = {"completions": n, "seconds": round(t, 4),
                     "seconds_per_completion": round(t / n, 6) if n else None}
    return out
