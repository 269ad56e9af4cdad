r"""The math task (``task.kind = "math"``): problems and reference answers from a local file.

Rows come from a ``.jsonl`` or ``.parquet`` file (``task.dataset``; columns
``task.prompt_field`` and ``task.answer_field``). A seeded shuffle puts
``task.heldout_size`` rows aside for evaluation; training cycles over the rest,
reshuffled each epoch. A completion states its answer where ``task.answer_extract`` says
(by default in ``\boxed{...}``, the last one counting; ``pipeline.tasks.answers``) and is
right when ``math-verify`` finds it equal to the reference.

``math-verify``'s own timeouts rely on SIGALRM, which only works in the main thread;
they are turned off here and the verifier stage's per-verifier deadline bounds the call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import json
import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from pipeline.tasks.answers import boxed_answer, make_extractor
from pipeline.tasks.base import Item

__all__ = ["MathTask", "boxed_answer", "equivalent", "parse_answer", "read_rows"]

if TYPE_CHECKING:
    from pipeline.config import TaskConfig


def parse_answer(text: str) -> list:
    """math-verify's parse of ``text`` (empty when nothing could be parsed)."""
    from math_verify import parse

    # math-verify warns on every call that its SIGALRM timeout is off; that is deliberate here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return parse(text, parsing_timeout=None)


def equivalent(a: list, b: list) -> bool:
    """Whether two parsed answers are mathematically equal (math-verify's ``verify``)."""
    from math_verify import verify

    return bool(verify(a, b, timeout_seconds=None)) or bool(verify(b, a, timeout_seconds=None))


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a ``.jsonl`` (one JSON object per line) or ``.parquet`` file."""
    p = Path(path)
    if p.suffix == ".jsonl":
        rows = []
        with p.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{n}: not a JSON object ({e.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{p}:{n}: not a JSON object")
                rows.append(row)
        return rows
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError("reading .parquet prompts needs pyarrow (the 'math' extra)") from e
        return pq.read_table(p).to_pylist()
    raise ValueError(f"{p}: prompt files are .jsonl or .parquet")


def split(labelled: int | list[bool], cfg: TaskConfig) -> tuple[list[int], list[int]]:
    """(training row indices, held-out row indices) of a file's rows (``labelled``: how many
    rows, all with a reference answer, or per row whether it has one): a shuffle seeded by
    ``task.heldout_seed``, whose first ``task.heldout_size`` rows with an answer are held out
    (a row without one can only be trained on, with a reward that needs no label). The task
    and ``pipeline init-model``'s warm-up use the same split, so a warm-up never sees a
    held-out row."""
    has = [True] * labelled if isinstance(labelled, int) else list(labelled)
    order = list(range(len(has)))
    random.Random(cfg.heldout_seed).shuffle(order)
    held = [i for i in order if has[i]][: cfg.heldout_size]
    chosen = set(held)
    return [i for i in order if i not in chosen], held


class MathTask:
    def __init__(self, cfg: TaskConfig) -> None:
        rows = read_rows(cfg.dataset)
        items = []
        for n, row in enumerate(rows, 1):
            if cfg.prompt_field not in row or row[cfg.prompt_field] is None or not str(row[cfg.prompt_field]).strip():
                raise ValueError(f"{cfg.dataset}: row {n} has no {cfg.prompt_field!r} (task.prompt_field)")
            # A row without an answer is unlabelled: trained on with a label-free reward
            # (``ground_truth|weaver``: Weaver there), never held out.
            answer = row.get(cfg.answer_field)
            items.append(Item(cfg.template.replace("{problem}", str(row[cfg.prompt_field])),
                              "" if answer is None else str(answer).strip()))
        labelled = [bool(it.reference) for it in items]
        if not any(labelled):
            raise ValueError(f"{cfg.dataset}: no row has an answer in {cfg.answer_field!r} (task.answer_field); "
                             "the held-out set needs reference answers")
        if cfg.heldout_size >= len(items) or cfg.heldout_size > sum(labelled):
            raise ValueError(f"task.heldout_size: must be below the {len(items)} rows of {cfg.dataset} and at most "
                             f"its {sum(labelled)} rows with an answer; got {cfg.heldout_size}")
        train, held = split(labelled, cfg)
        self._heldout = [items[i] for i in held]
        self._train = [items[i] for i in train]
        self.eval_max_new_tokens = cfg.max_new_tokens
        self.extract = make_extractor(cfg.answer_extract)
        try:
            import math_verify  # noqa: F401
        except ImportError as e:
            raise ImportError(f"task.kind 'math' needs math-verify (the 'math' extra): {e}") from e
        self._parse, self._equal = parse_answer, equivalent

    def training(self, seed: int) -> Iterator[Item]:
        epoch = 0
        while True:
            order = list(range(len(self._train)))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
            for i in order:
                yield self._train[i]
            epoch += 1

    def heldout(self) -> list[Item]:
        return list(self._heldout)

    def answer(self, completion: str) -> str | None:
        a = self.extract(completion)
        return None if a is None else " ".join(a.split())

    def correctness(self, reference: str, completions: Sequence[str]) -> np.ndarray:
        out = np.zeros(len(completions), dtype=np.float32)
        if not reference:
            return out  # an unlabelled row: nothing to be right against
        ref = self._parse(f"${reference}$") or self._parse(reference)
        for i, c in enumerate(completions):
            a = self.extract(c)
            if a is None or not ref:
                continue
            if a == reference or self._equal(ref, self._parse(f"\\boxed{{{a}}}")):
                out[i] = 1.0
        return out
