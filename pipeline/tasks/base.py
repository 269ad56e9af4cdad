"""What a task is: where prompts come from, which are held out, and what counts as right.

A task owns its truth: ``correctness`` reads the reference answer and is for
evaluation, the logged hidden accuracy and the ``ground_truth`` reward only; weak
verifiers never see the reference.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Item:
    prompt: str
    """The user message: the problem as the task words it (``pipeline.tasks.prompting`` renders it)."""
    reference: str
    """The hidden reference, read only by the task's ``correctness``."""
    source: str = ""
    """Which part of the task it comes from (a reasoning-gym dataset's name); evaluation reports
    the held-out accuracy per source when the items have one."""


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
