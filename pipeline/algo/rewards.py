"""Reward modes: turn one group's verifier votes into per-completion rewards (docs/design.md §5, §7).

A mode is chosen by a spec string in the config (``verifier.reward``):

==================  ==========================================================================
``weaver``          soft Weaver posterior P(correct) from the label model (default)
``weaver-hard``     1[P(correct) > 0.5] from the same posterior
``single:<name>``   one verifier's binarised score, 1[s ≥ 0.5]; an abstention counts 0
``majority``        1 if the completion's answer is (one of) the group's most frequent answer(s)
``average``         the plain mean of the verifiers' scores (each in [0, 1]) over those that did not
                    abstain, 0 if all abstained: the naive ensemble, no label model, no calibration
``distilled:DIR``   P(correct) of a distilled cross-encoder saved in DIR by ``pipeline distill``
``ground_truth``    the task's own check against the reference answer (its ``correctness``)
``environment``     an episode's environment reward (``env.kind``; missing counts 0)
``module:function`` a labelled reward of your own (``path/to/file.py:function`` too, or a name in
                    the ``rlpipe.rewards`` entry-point group; ``pipeline.plugins``), TRL's shape:
                    ``function(prompts, completions, reference, **kw) -> list[float]``
==================  ==========================================================================

Modes combine: ``0.8*ground_truth + 0.2*single:format`` (a weighted sum) and
``ground_truth|weaver`` (the first where the group's row has a reference answer, the second
where it has none); ``CombinedReward``.

A labelled reward is called once per group with lists of length G: the prompt repeated,
the completions, the row's reference answer repeated (``reference``, also passed as
``answer``), and ``extracted``, each completion's answer as the task extracts it. It returns G
floats (None counts 0). ``ground_truth`` and labelled rewards are standard RLVR, for data with
reference answers; the weak modes (Weaver first) train where there are none, and never read
the reference.

Usage::

    mode = parse_reward_mode(cfg.verifier.reward)         # validates once, at start-up
    rewards = mode(votes=votes, names=names, completions=completions,
                   label_model=model, truth=truth)        # float32 [G]

or in one go ``compute_rewards("weaver", votes=..., names=..., label_model=...)``.
Every mode takes the same keyword arguments and reads only what it needs: only
``ground_truth`` ever reads ``truth`` (the others are not even handed it), so the
verifier stage may pass the hidden truth along for logging without any risk of it
leaking into a weak reward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import plugins
from pipeline.algo.labelmodel import LabelModel
from pipeline.tasks.arithmetic import extract_answer
from pipeline.verifiers.base import KINDS, VERIFIERS
from pipeline.verifiers.registry import check_spec


def _weaver(*, votes: np.ndarray, names: Sequence[str], label_model: LabelModel | None, **_: object) -> np.ndarray:
    if label_model is None:
        raise ValueError("reward mode 'weaver' needs a fitted label model (label_model=None)")
    return label_model.posterior(votes, names)


def _weaver_hard(*, votes: np.ndarray, names: Sequence[str], label_model: LabelModel | None, **_: object) -> np.ndarray:
    if label_model is None:
        raise ValueError("reward mode 'weaver-hard' needs a fitted label model (label_model=None)")
    return (label_model.posterior(votes, names) > 0.5).astype(np.float64)


def _majority(*, completions: Sequence[str] | None, answer=extract_answer, **_: object) -> np.ndarray:
    if completions is None:
        raise ValueError("reward mode 'majority' needs the completions")
    answers = [answer(c) for c in completions]
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return np.zeros(len(answers))
    top = max(counts.values())
    # Ties: every answer sharing the top count is "the" majority; unparseable never is.
    return np.array([1.0 if a is not None and counts[a] == top else 0.0 for a in answers])


def _average(*, votes: np.ndarray, **_: object) -> np.ndarray:
    v = np.asarray(votes, dtype=np.float64)
    voted = ~np.isnan(v)
    n = voted.sum(axis=1)
    # Scores are in [0, 1] by the verifier contract, so they are already normalised.
    return np.where(n > 0, np.where(voted, v, 0.0).sum(axis=1) / np.maximum(n, 1), 0.0)


def _ground_truth(*, truth: np.ndarray | None, **_: object) -> np.ndarray:
    if truth is None:
        raise ValueError("reward mode 'ground_truth' needs the hidden truth (truth=None)")
    return np.asarray(truth, dtype=np.float64)


RewardFn = Callable[..., np.ndarray]

REWARD_MODES: dict[str, RewardFn] = {
    "weaver": _weaver,
    "weaver-hard": _weaver_hard,
    "majority": _majority,
    "average": _average,
    "ground_truth": _ground_truth,
}
"""Parameterless modes by name; ``single:<verifier>`` is parameterised and handled by ``parse_reward_mode``."""

LABEL_MODEL_REWARDS = ("weaver", "weaver-hard")
"""Reward modes that aggregate the votes with the label model."""

VOTE_MODES = ("weaver", "weaver-hard", "average")
"""Modes that read every verifier's votes (through the label model, or averaged)."""

SINGLE_PREFIX = "single:"
SINGLE_THRESHOLD = 0.5
"""A single verifier's score counts as a pass at or above this (fixed, so the baseline needs no label model)."""

DISTILLED_PREFIX = "distilled:"
_DISTILLED: dict[str, object] = {}


def distilled_verifier(path: str):
    """The distilled verifier saved in ``path`` (``pipeline distill``), loaded once per process."""
    if path not in _DISTILLED:
        from pipeline.algo.distill import DistilledVerifier  # imports torch: only runs that use it pay

        _DISTILLED[path] = DistilledVerifier.load(path)
    return _DISTILLED[path]


@dataclass(frozen=True)
class RewardMode:
    """A validated reward mode; call it with keyword arguments to get float32 rewards [G].

    Call signature (all keyword-only, every mode accepts all of them)::

        mode(*, votes: np.ndarray [G, m] float (NaN = abstain), names: Sequence[str] (m),
             completions: Sequence[str] | None = None, label_model: LabelModel | None = None,
             truth: np.ndarray [G] | None = None) -> np.ndarray [G] float32 in [0, 1]

    Raises ValueError when the mode lacks what it needs (no label model for
    ``weaver``, verifier not among ``names`` for ``single:``, no truth for
    ``ground_truth``, ...) or when shapes disagree.
    """

    spec: str
    """The spec string as given, e.g. ``"single:mod9"``; record it on each scored group."""
    kind: str
    """``weaver``, ``weaver-hard``, ``single``, ``majority``, ``average``, ``ground_truth``,
    ``distilled`` or ``labelled``."""
    fn: Callable | None = None
    """The function of a ``labelled`` mode (``module:function``)."""
    verifier: str | None = None
    """The verifier of a ``single:`` mode."""
    path: str | None = None
    """The model directory of a ``distilled:`` mode."""

    @property
    def needs_label_model(self) -> bool:
        return self.kind in LABEL_MODEL_REWARDS

    @property
    def verifiers(self) -> tuple[str, ...]:
        """The verifiers a ``single:`` mode reads (they must be scored)."""
        return (self.verifier,) if self.verifier else ()

    @property
    def uses_truth(self) -> bool:
        """Only ``ground_truth``, ``environment`` and labelled rewards read the reference."""
        return self.kind in ("ground_truth", "labelled", "environment")

    def reads(self, names: Sequence[str]) -> tuple[str, ...]:
        """The verifiers of ``names`` whose votes this mode reads: all of them for the modes that
        aggregate every vote (:data:`VOTE_MODES`), one for ``single:``, none for the others (they
        read the completions, a model of their own or the reference). The verifier stage runs
        only these (and the others on ``verifier.monitor_share`` of the groups)."""
        if self.kind in VOTE_MODES:
            return tuple(names)
        return tuple(n for n in names if n == self.verifier)

    def __call__(
        self,
        *,
        votes: np.ndarray,
        names: Sequence[str],
        completions: Sequence[str] | None = None,
        label_model: LabelModel | None = None,
        truth: np.ndarray | None = None,
        prompt: str | None = None,
        answer=extract_answer,
        reference: str | None = None,
        env_rewards: np.ndarray | None = None,
    ) -> np.ndarray:
        v = np.asarray(votes, dtype=np.float64)
        names = list(names)
        if v.ndim != 2 or v.shape[1] != len(names):
            raise ValueError(f"votes must be [G, {len(names)}] for names {names}, got shape {v.shape}")
        g = v.shape[0]
        if completions is not None and len(completions) != g:
            raise ValueError(f"{len(completions)} completions for {g} vote rows")
        if self.kind == "single":
            if self.verifier not in names:
                raise ValueError(f"reward mode {self.spec!r}: verifier not among the scored ones {names}")
            col = v[:, names.index(self.verifier)]
            out = np.where(np.isnan(col), 0.0, (col >= SINGLE_THRESHOLD).astype(np.float64))
        elif self.kind == "distilled":
            if prompt is None or completions is None:
                raise ValueError(f"reward mode {self.spec!r} needs the group's prompt and completions")
            out = distilled_verifier(self.path).score_group(prompt, completions)
        elif self.kind == "ground_truth":
            out = _ground_truth(truth=truth)
        elif self.kind == "environment":
            if env_rewards is None:
                raise ValueError("reward mode 'environment' needs episodes with environment rewards (env.kind)")
            out = np.nan_to_num(np.asarray(env_rewards, dtype=np.float64), nan=0.0)
        elif self.kind == "labelled":
            out = _labelled(self, prompt=prompt, completions=completions, reference=reference, answer=answer, g=g)
        else:
            # The hidden truth is deliberately not passed on: weak modes cannot read it.
            out = REWARD_MODES[self.kind](votes=v, names=names, completions=completions, label_model=label_model,
                                          answer=answer)
        out = np.asarray(out, dtype=np.float32)
        if out.shape != (g,):
            raise ValueError(f"reward mode {self.spec!r} produced shape {out.shape}, expected ({g},)")
        return out


def _labelled(mode: "RewardMode", *, prompt, completions, reference, answer, g: int) -> np.ndarray:
    if completions is None or reference is None:
        raise ValueError(f"reward mode {mode.spec!r} needs the group's completions and reference answer")
    comps = list(completions)
    got = mode.fn(prompts=[prompt or ""] * g, completions=comps, reference=[reference] * g, answer=[reference] * g,
                  extracted=[answer(c) for c in comps])
    got = list(got) if got is not None else []
    if len(got) != g:
        raise ValueError(f"reward {mode.spec!r} returned {len(got)} values for {g} completions")
    return np.array([0.0 if x is None else float(x) for x in got], dtype=np.float64)


def allowed_reward_modes() -> list[str]:
    """Every valid spec, for error messages and ``--help`` (a kind stands for any of its specs)."""
    kinds = [f"{SINGLE_PREFIX}{k}" + (":<arg>" if v.arg == "required" else "") for k, v in KINDS.items()]
    return [*REWARD_MODES, "environment", *(f"{SINGLE_PREFIX}{n}" for n in sorted(VERIFIERS)), *kinds]


@dataclass(frozen=True)
class CombinedReward:
    """``w1*a + w2*b + ...`` (a weighted sum of modes, e.g. a labelled reward plus a format
    bonus) or ``a|b`` (``a`` where the group's row has a reference answer, ``b`` where it has
    none: labels where they exist, Weaver elsewhere). Called like a ``RewardMode``."""

    spec: str
    terms: tuple[tuple[float, "RewardMode | CombinedReward"], ...] = ()
    fallback: "tuple[RewardMode | CombinedReward, RewardMode | CombinedReward] | None" = None

    def _parts(self):
        return [m for _, m in self.terms] if self.fallback is None else list(self.fallback)

    @property
    def needs_label_model(self) -> bool:
        return any(m.needs_label_model for m in self._parts())

    @property
    def uses_truth(self) -> bool:
        return any(m.uses_truth for m in self._parts())

    @property
    def verifiers(self) -> tuple[str, ...]:
        return tuple(v for m in self._parts() for v in m.verifiers)

    def reads(self, names: Sequence[str]) -> tuple[str, ...]:
        """The verifiers of ``names`` any part reads (``RewardMode.reads``), in list order."""
        wanted = {n for m in self._parts() for n in m.reads(names)}
        return tuple(n for n in names if n in wanted)

    def __call__(self, *, votes, reference: str | None = None, **kw) -> np.ndarray:
        if self.fallback is not None:
            labelled, unlabelled = self.fallback
            if reference is not None and str(reference).strip():
                return labelled(votes=votes, reference=reference, **kw)
            return unlabelled(votes=votes, reference=reference, **kw)
        out = None
        for w, m in self.terms:
            r = w * m(votes=votes, reference=reference, **kw).astype(np.float64)
            out = r if out is None else out + r
        return out.astype(np.float32)


def _weighted(term: str) -> tuple[float, str]:
    head, star, rest = term.partition("*")
    if star:
        try:
            return float(head), rest.strip()
        except ValueError:
            pass
    return 1.0, term.strip()


def reward_terms(spec: str) -> list[str]:
    """The modes a reward spec combines, each without its weight or argument (``0.2*single:format +
    weaver|ground_truth`` -> ``["single", "weaver", "ground_truth"]``): the spec's grammar, without
    checking it (``parse_reward_mode`` does)."""
    terms = [_weighted(t)[1] for part in spec.split("|") for t in part.split("+")]
    return [t.partition(":")[0] for t in terms]


def uses_label_model(spec: str) -> bool:
    """Whether a reward spec fits the label model (one of its terms is ``weaver`` or ``weaver-hard``)."""
    return any(t in LABEL_MODEL_REWARDS for t in reward_terms(spec))


def reward_problems(verifier_cfg) -> list[str]:
    """What is wrong with ``verifier.reward`` in a ``VerifierConfig``, each message naming the field:
    a spec that does not parse (its plugins imported), or a verifier it reads that is not in
    ``verifier.verifiers``. The check before launch."""
    try:
        mode = parse_reward_mode(verifier_cfg.reward)
    except ValueError as e:
        return [f"verifier.reward: {e}"]
    return [f"verifier.reward: {verifier_cfg.reward!r} must name a verifier of verifier.verifiers "
            f"{list(verifier_cfg.verifiers)}; add {name!r} to the list or pick another"
            for name in mode.verifiers if name not in verifier_cfg.verifiers]


def parse_reward_mode(spec: str) -> "RewardMode | CombinedReward":
    """Validate a reward spec and return its mode; ValueError lists the allowed specs.

    Besides one mode: ``labelled|weak`` (the first where the row has a reference answer, the
    second where not) and weighted sums ``0.8*ground_truth + 0.2*single:format``."""
    if not isinstance(spec, str):
        raise ValueError(f"reward mode must be a string, got {spec!r}; allowed: {allowed_reward_modes()}")
    s = spec.strip()
    if "|" in s:
        first, _, second = s.partition("|")
        return CombinedReward(spec=s, fallback=(parse_reward_mode(first), parse_reward_mode(second)))
    if "+" in s:
        terms = tuple((w, parse_reward_mode(t)) for w, t in map(_weighted, s.split("+")))
        return CombinedReward(spec=s, terms=terms)
    w, one = _weighted(s)
    if w != 1.0 or one != s:
        return CombinedReward(spec=s, terms=((w, parse_reward_mode(one)),))
    if s in REWARD_MODES:
        return RewardMode(spec=s, kind=s)
    if s == "environment":
        return RewardMode(spec=s, kind="environment")
    if s.startswith(SINGLE_PREFIX):
        name = s[len(SINGLE_PREFIX):]
        try:
            check_spec(name)
        except ValueError as e:
            raise ValueError(f"reward mode {spec!r}: {e}") from None
        return RewardMode(spec=s, kind="single", verifier=name)
    if s.startswith(DISTILLED_PREFIX):
        path = s[len(DISTILLED_PREFIX):]
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"reward mode {spec!r}: {path!r} is not a distilled verifier directory (no config.json); "
                             "build one with `pipeline distill --run <run>`")
        return RewardMode(spec=s, kind="distilled", path=path)
    fn = plugins.find("reward", s)
    if fn is not None:
        plugins.require_callable(fn, s, "reward (prompts, completions, reference, **kw) -> list[float]")
        return RewardMode(spec=s, kind="labelled", fn=fn)
    raise ValueError(f"unknown reward mode {spec!r}; allowed: {allowed_reward_modes()}, distilled:<dir>, or a "
                     "reward of your own: module:function, path/to/file.py:function, or a name registered in the "
                     "'rlpipe.rewards' entry-point group")


def compute_rewards(
    mode: str | RewardMode,
    *,
    votes: np.ndarray,
    names: Sequence[str],
    completions: Sequence[str] | None = None,
    label_model: LabelModel | None = None,
    truth: np.ndarray | None = None,
    prompt: str | None = None,
) -> np.ndarray:
    """Rewards float32 [G] for one group under ``mode`` (a spec string or a parsed ``RewardMode``).

    ``votes`` [G, m] are the raw verifier scores (NaN = abstain) in the column order of
    ``names``; ``completions`` are needed by ``majority``; ``label_model`` by ``weaver`` and
    ``weaver-hard``; ``truth`` (hidden correctness, [G]) only by ``ground_truth``.
    """
    parsed = parse_reward_mode(mode) if isinstance(mode, str) else mode
    return parsed(votes=votes, names=names, completions=completions, label_model=label_model, truth=truth,
                  prompt=prompt)
