"""The reasoning-gym task (``task.kind = "reasoning_gym"``): procedurally generated reasoning problems.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ (the ``reasoning`` extra)
generates problems offline from ~100 seeded datasets (``chain_sum``, ``basic_arithmetic``,
``gcd``, ``spell_backward``, ...), each entry a ``question``, an ``answer`` and ``metadata``,
and judges an answer with the dataset's own ``score_answer(answer, entry)`` in [0, 1].

* **Datasets**: ``task.datasets`` names several at once; ``task.dataset_params`` gives each
  its parameters, ``task.dataset_weights`` how often each is drawn for training.
* **Held out**: per dataset, ``task.heldout_size`` distinct questions generated from seeds
  derived from ``task.heldout_seed``. Training draws from seeds derived from ``feeder.seed``,
  and skips every entry whose question is held out, so training never sees one.
* **Truth**: the reference a prompt carries (hidden from the weak verifiers, as the math
  task's reference answer) is the whole entry, so any process scores an answer exactly as
  the dataset does without generating the entry again. A completion is right when the
  dataset's ``score_answer`` of its answer (``task.answer_extract``) is full (1.0).
* **Evaluation**: greedy on every held-out question; the accuracy is reported overall and
  per dataset (``Item.source``).

Entries are generated in chunks of ``CHUNK`` per derived seed (reasoning-gym seeds entry
``i`` of a dataset from ``seed + i``). A few datasets build their questions from Python's
string hashing, which differs between processes unless ``PYTHONHASHSEED`` is fixed; ``pipeline
up`` fixes it for every worker of this task, so the feeder and the trainer agree on the
held-out set.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import random
import zlib
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.tasks.answers import make_extractor
from pipeline.tasks.base import Item

if TYPE_CHECKING:
    from pipeline.config import TaskConfig

CHUNK = 1000
"""Entries generated per derived seed before the next seed is taken."""

FULL_SCORE = 1.0 - 1e-6
"""A ``score_answer`` at least this is a right answer (partial credit is not)."""

MAX_SKIPPED = 10_000
"""Held-out questions in a row a dataset's training stream may hit before it is refused as exhausted."""

NOT_SUPPORTED = {"composite": "name several datasets in task.datasets (with task.dataset_weights) instead"}
"""reasoning-gym datasets this task does not take, with what to do instead."""


def require() -> Any:
    """The ``reasoning_gym`` module, or ImportError saying how to install it."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"task.kind 'reasoning_gym' needs reasoning-gym (the 'reasoning' extra: "
                          f"`pip install -e .[reasoning]`, or `pip install reasoning-gym==0.1.25`): {e}") from e
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset this task can draw from."""
    require()
    from reasoning_gym.factory import DATASETS

    return sorted(n for n in DATASETS if n not in NOT_SUPPORTED)


def _derived_seed(kind: str, base: int, name: str, chunk: int) -> int:
    """A seed for chunk ``chunk`` of ``name``'s ``kind`` (heldout / train) stream, the same in every process."""
    return zlib.crc32(f"{kind}:{base}:{name}:{chunk}".encode())


def create(name: str, params: dict[str, Any], *, seed: int, size: int) -> Any:
    """A reasoning-gym dataset object."""
    rg = require()
    return rg.create_dataset(name, seed=seed, size=size, **params)


def entries(name: str, params: dict[str, Any], *, kind: str, base: int) -> Iterator[dict[str, Any]]:
    """The endless, deterministic stream of ``name``'s entries for ``kind`` seeded from ``base``."""
    for chunk in range(1 << 62):
        ds = create(name, params, seed=_derived_seed(kind, base, name, chunk), size=CHUNK)
        for i in range(CHUNK):
            yield ds[i]


# ----------------------------------------------------------------------------- the reference

# Entries hold dicts, lists, tuples, strings, numbers, booleans and None, and some metadata
# dicts have integer keys; score_answer can depend on a tuple staying a tuple. JSON keeps
# all of that when tuples and non-string-keyed dicts are tagged.
_TUPLE, _DICT = "__tuple__", "__dict__"


def _pack(x: Any) -> Any:
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x) and _TUPLE not in x and _DICT not in x:
            return {k: _pack(v) for k, v in x.items()}
        return {_DICT: [[_pack(k), _pack(v)] for k, v in x.items()]}
    if isinstance(x, tuple):
        return {_TUPLE: [_pack(v) for v in x]}
    if isinstance(x, list):
        return [_pack(v) for v in x]
    if x is None or type(x) in (str, bool, int, float):
        return x
    for kind in (str, bool, int, float):  # subclasses (numpy.str_, IntEnum, ...) as the plain type
        if isinstance(x, kind):
            return kind(x)
    if hasattr(x, "item"):  # numpy scalars
        return _pack(x.item())
    raise TypeError(f"a reasoning-gym entry holds a {type(x).__name__}, which the reference cannot carry")


def _unpack(x: Any) -> Any:
    if isinstance(x, dict):
        if len(x) == 1 and _TUPLE in x:
            return tuple(_unpack(v) for v in x[_TUPLE])
        if len(x) == 1 and _DICT in x:
            return {_unpack(k): _unpack(v) for k, v in x[_DICT]}
        return {k: _unpack(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unpack(v) for v in x]
    return x


def encode_reference(name: str, entry: dict[str, Any]) -> str:
    """The hidden reference of an entry of dataset ``name``: the dataset and the whole entry."""
    return json.dumps({"dataset": name, "entry": _pack(entry)}, ensure_ascii=False, separators=(",", ":"))


def decode_reference(reference: str) -> tuple[str, dict[str, Any]]:
    """``(dataset name, entry)`` of a reference ``encode_reference`` wrote."""
    data = json.loads(reference)
    return data["dataset"], _unpack(data["entry"])


# ----------------------------------------------------------------------------- checks


def check_datasets(cfg: TaskConfig, *, samples: int = 2) -> list[str]:
    """What reasoning-gym refuses in ``task.datasets`` and ``task.dataset_params``, each problem
    naming its field (unknown names and parameters with the close ones): the datasets are
    built with their parameters and ``samples`` entries of each generated, carried through a
    reference and scored with their own answer. Empty: nothing."""
    try:
        require()
    except ImportError as e:
        return [f"task.kind: {e}"]
    from reasoning_gym.factory import DATASETS

    problems: list[str] = []
    known = dataset_names()
    for name, params, _ in cfg.dataset_specs():
        if name in NOT_SUPPORTED:
            problems.append(f"task.datasets: {name!r} is not supported here: {NOT_SUPPORTED[name]}")
            continue
        if name not in DATASETS:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
            hint = f"close names: {', '.join(close)}" if close else f"the {len(known)} datasets: {', '.join(known)}"
            problems.append(f"task.datasets: unknown reasoning-gym dataset {name!r}; {hint}")
            continue
        fields = {f.name: f for f in dataclasses.fields(DATASETS[name][1]) if f.name not in ("seed", "size")}
        unknown = [k for k in params if k not in fields]
        if unknown:
            allowed = ", ".join(f"{k} (default {_default(f)!r})" for k, f in fields.items())
            close = sorted({c for k in unknown for c in difflib.get_close_matches(k, list(fields), n=3, cutoff=0.6)})
            problems.append(f"task.dataset_params: {name} has no parameter {', '.join(map(repr, unknown))}"
                            + (f"; close names: {', '.join(close)}" if close else "")
                            + f"; its parameters: {allowed or 'none'}")
            continue
        try:
            ds = create(name, params, seed=_derived_seed("check", 0, name, 0), size=max(samples, 1))
            for i in range(samples):
                entry = ds[i]
                _, back = decode_reference(encode_reference(name, entry))
                if back != entry:
                    raise ValueError("its entries do not survive the reference's encoding")
                if entry.get("answer") is not None:
                    ds.score_answer(str(entry["answer"]), back)
        except Exception as e:  # noqa: BLE001 - a dataset's own check failing, whatever it raises
            why = str(e) or type(e).__name__
            problems.append(f"task.dataset_params: reasoning-gym refuses {name} with {json.dumps(params)}: "
                            f"{type(e).__name__}: {why}")
    return problems


def sample_prompts(cfg: TaskConfig, k: int = 2) -> dict[str, list[str]]:
    """``k`` user messages of each dataset (from the entries ``check_datasets`` samples), for
    checking before launch that prompts fit the model's context."""
    out = {}
    for name, params, _ in cfg.dataset_specs():
        ds = create(name, params, seed=_derived_seed("check", 0, name, 0), size=max(k, 1))
        out[name] = [cfg.template.replace("{problem}", str(ds[i]["question"])) for i in range(k)]
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


# ----------------------------------------------------------------------------- the task


class ReasoningGymTask:
    def __init__(self, cfg: TaskConfig) -> None:
        require()
        self.cfg = cfg
        self.specs = cfg.dataset_specs()
        self.names = [name for name, _, _ in self.specs]
        self.params = {name: params for name, params, _ in self.specs}
        self.weights = [w for _, _, w in self.specs]
        self.extract = make_extractor(cfg.answer_extract)
        self.eval_max_new_tokens = cfg.max_new_tokens
        self._scorers: dict[str, Any] = {}

    def _item(self, name: str, entry: dict[str, Any]) -> Item:
        return Item(self.cfg.template.replace("{problem}", str(entry["question"])), encode_reference(name, entry),
                    source=name)

    @cached_property
    def _heldout(self) -> list[tuple[str, dict[str, Any]]]:
        n = self.cfg.heldout_size
        out: list[tuple[str, dict[str, Any]]] = []
        for name in self.names:
            seen: set[str] = set()
            budget = max(4 * n, n + 1000)
            stream = entries(name, self.params[name], kind="heldout", base=self.cfg.heldout_seed)
            for tries, entry in enumerate(stream, 1):
                q = str(entry["question"])
                if q not in seen:
                    seen.add(q)
                    out.append((name, entry))
                    if len(seen) == n:
                        break
                if tries >= budget:
                    raise ValueError(f"task.heldout_size: {name} gave only {len(seen)} distinct questions in {tries} "
                                     f"draws with its parameters {json.dumps(self.params[name])}, fewer than the "
                                     f"{n} to hold out; lower task.heldout_size or widen task.dataset_params")
        return out

    @cached_property
    def heldout_questions(self) -> frozenset[str]:
        """Every held-out question (of any dataset): training never issues one."""
        return frozenset(str(e["question"]) for _, e in self._heldout)

    def training(self, seed: int) -> Iterator[Item]:
        held = self.heldout_questions
        streams = {name: entries(name, self.params[name], kind="train", base=seed) for name in self.names}
        pick = random.Random(seed)
        while True:
            name = pick.choices(self.names, weights=self.weights)[0] if len(self.names) > 1 else self.names[0]
            for skipped in range(MAX_SKIPPED + 1):
                entry = next(streams[name])
                if str(entry["question"]) not in held:
                    break
            else:
                raise ValueError(f"task.heldout_size: {MAX_SKIPPED} training draws in a row of {name} were all "
                                 "held-out questions: its parameters leave too few distinct questions for "
                                 f"{self.cfg.heldout_size} held out")
            yield self._item(name, entry)

    def heldout(self) -> list[Item]:
        return [self._item(name, entry) for name, entry in self._heldout]

    def answer(self, completion: str) -> str | None:
        a = self.extract(completion)
        return None if a is None else " ".join(a.split())

    def scorer(self, name: str) -> Any:
        """The dataset object whose ``score_answer`` judges answers to ``name``'s entries."""
        if name not in self._scorers:
            if name not in self.params:
                raise ValueError(f"reference of dataset {name!r}, which task.datasets {self.names} does not list")
            self._scorers[name] = create(name, self.params[name], seed=0, size=1)
        return self._scorers[name]

    def score(self, reference: str, completions: Sequence[str]) -> np.ndarray:
        """HIDDEN TRUTH: the dataset's ``score_answer`` of each completion's answer, float32 [G] in [0, 1]
        (0 where the completion states no answer, or the dataset's scoring raises)."""
        name, entry = decode_reference(reference)
        ds = self.scorer(name)
        out = np.zeros(len(completions), dtype=np.float32)
        for i, c in enumerate(completions):
            a = self.extract(c)
            if a is None:
                continue
            try:
                s = float(ds.score_answer(a, entry))
            except Exception:  # noqa: BLE001 - a dataset's scorer failing on a malformed answer scores 0
                s = 0.0
            out[i] = min(max(s, 0.0), 1.0) if np.isfinite(s) else 0.0
        return out

    def correctness(self, reference: str, completions: Sequence[str]) -> np.ndarray:
        """HIDDEN TRUTH: 1 where the dataset's ``score_answer`` gives the completion's answer full marks."""
        return (self.score(reference, completions) >= FULL_SCORE).astype(np.float32)


def sample_rows(cfg: TaskConfig, n: int, *, seed: int = 0) -> list[dict[str, str]]:
    """``n`` training problems as ``{"problem", "answer"}`` rows (never a held-out one): text for
    ``pipeline init-model --data`` to train a tokenizer on (and warm up on)."""
    task = ReasoningGymTask(cfg)
    rows = []
    for item in task.training(seed):
        _, entry = decode_reference(item.reference)
        answer = "" if entry["answer"] is None else str(entry["answer"])
        rows.append({"problem": str(entry["question"]), "answer": answer})
        if len(rows) == n:
            return rows
    return rows
