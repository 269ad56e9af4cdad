"""Tasks: where prompts come from, which are held out, and what counts as a right answer.

``task.kind`` picks one:

``arithmetic``  the embedded task of :mod:`pipeline.task`: generated fixed-width integer
                problems, an endless training stream that never repeats a held-out one.
``math``        problems and reference answers from a local ``.jsonl`` or ``.parquet``
                file (``task.dataset``; columns ``task.prompt_field`` and
                ``task.answer_field``). A seeded shuffle puts ``task.heldout_size`` rows
                aside for evaluation; training cycles over the rest, reshuffled each
                epoch. A completion states its answer in ``\\boxed{...}`` (the last one
                counts) and is right when ``math-verify`` finds it equal to the reference.

The reference answer is for evaluation, the logged hidden accuracy and the
``ground_truth`` reward only; weak verifiers never see it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from pipeline import task as arith
from pipeline.config import TaskConfig


@dataclass(frozen=True)
class Item:
    prompt: str
    reference: str


class Task(Protocol):
    eval_max_new_tokens: int
    """Tokens a greedy held-out answer may take."""

    def training(self, seed: int) -> Iterator[Item]:
        """The endless, deterministic stream of training prompts (never a held-out one)."""
        ...

    def heldout(self) -> list[Item]:
        ...

    def answer(self, completion: str) -> str | None:
        """The answer a completion states, normalised for comparison (None: it states none)."""
        ...

    def correctness(self, reference: str, completions: Sequence[str]) -> np.ndarray:
        """HIDDEN TRUTH: float32 [G], 1 where the completion's answer is right."""
        ...


class ArithmeticTask:
    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg
        self.ops = tuple(cfg.ops)
        self.eval_max_new_tokens = arith.answer_max_length(cfg.digits, self.ops) + 1
        self._heldout = arith.heldout_problems(n=cfg.heldout_size, seed=cfg.heldout_seed, digits=cfg.digits,
                                               ops=self.ops)

    def training(self, seed: int) -> Iterator[Item]:
        for p in arith.training_problems(seed=seed, digits=self.cfg.digits, ops=self.ops, exclude=set(self._heldout)):
            yield Item(p.prompt, p.answer)

    def heldout(self) -> list[Item]:
        return [Item(p.prompt, p.answer) for p in self._heldout]

    def answer(self, completion: str) -> str | None:
        return arith.extract_answer(completion)

    def correctness(self, reference: str, completions: Sequence[str]) -> np.ndarray:
        from pipeline.verifiers import correctness

        return correctness(reference, completions)


# --------------------------------------------------------------------------- math


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


class MathTask:
    def __init__(self, cfg: TaskConfig) -> None:
        rows = read_rows(cfg.dataset)
        items = []
        for n, row in enumerate(rows, 1):
            for name in (cfg.prompt_field, cfg.answer_field):
                if name not in row or row[name] is None or str(row[name]).strip() == "":
                    raise ValueError(f"{cfg.dataset}: row {n} has no {name!r} (task.prompt_field / task.answer_field)")
            items.append(Item(cfg.template.replace("{problem}", str(row[cfg.prompt_field])),
                              str(row[cfg.answer_field]).strip()))
        if cfg.heldout_size >= len(items):
            raise ValueError(f"task.heldout_size: must be below the {len(items)} rows of {cfg.dataset}; "
                             f"got {cfg.heldout_size}")
        order = list(range(len(items)))
        random.Random(cfg.heldout_seed).shuffle(order)
        self._heldout = [items[i] for i in order[: cfg.heldout_size]]
        self._train = [items[i] for i in order[cfg.heldout_size:]]
        self.eval_max_new_tokens = cfg.max_new_tokens
        try:
            from pipeline.verifier_kinds.math_equiv import equivalent, parse_answer
        except ImportError as e:
            raise ImportError(f"task.kind 'math' needs math-verify: {e}") from e
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
        a = boxed_answer(completion)
        return None if a is None else " ".join(a.split())

    def correctness(self, reference: str, completions: Sequence[str]) -> np.ndarray:
        ref = self._parse(f"${reference}$") or self._parse(reference)
        out = np.zeros(len(completions), dtype=np.float32)
        for i, c in enumerate(completions):
            a = boxed_answer(c)
            if a is None or not ref:
                continue
            if a == reference or self._equal(ref, self._parse(f"\\boxed{{{a}}}")):
                out[i] = 1.0
        return out


def make_task(cfg: TaskConfig) -> Task:
    return MathTask(cfg) if cfg.kind == "math" else ArithmeticTask(cfg)
