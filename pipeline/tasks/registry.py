"""Tasks by name: ``task.kind`` picks one.

``arithmetic``  the embedded task (``pipeline.tasks.arithmetic``): generated fixed-width
                integer problems, an endless training stream that never repeats a held-out one.
``math``        problems and reference answers from a local ``.jsonl`` or ``.parquet`` file
                (``pipeline.tasks.math``), right when ``math-verify`` finds the boxed
                answer equal to the reference.

A task kind is one class with the ``Task`` contract (``pipeline.tasks.base``) and one
line in ``TASKS``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collections.abc import Callable

from pipeline.tasks.arithmetic import ArithmeticTask
from pipeline.tasks.base import Item, Task
from pipeline.tasks.math import MathTask

if TYPE_CHECKING:
    from pipeline.config import TaskConfig

TASKS: dict[str, Callable[[TaskConfig], Task]] = {"arithmetic": ArithmeticTask, "math": MathTask}
"""Task kinds by ``task.kind``."""

__all__ = ["TASKS", "Item", "Task", "make_task"]


def make_task(cfg: TaskConfig) -> Task:
    """The task ``cfg.kind`` names."""
    try:
        kind = TASKS[cfg.kind]
    except KeyError:
        raise ValueError(f"task.kind: unknown task {cfg.kind!r}; allowed: {sorted(TASKS)}") from None
    return kind(cfg)
