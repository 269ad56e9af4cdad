"""``env.kind = "calculator"``: a calculator tool for the arithmetic task, in process.

The model's turn is either a **tool call**, an expression ending in ``=`` (``12+345=``),
which the calculator answers with its exact value as the observation (``357``), or its
**final answer** (anything else), which ends the episode with reward 1 when it equals the
reference answer, else 0. A malformed call (``12+=``) is answered with nothing (an empty
observation: the model simply takes another turn). Each call's step says so
(``Step.tool_call``), and whether it was answered (``Step.tool_ok``: False for a malformed
one), for the tool-call metrics (docs/observing.md). The tiny
character model's alphabet (digits, ``+``, ``*``, ``=``, space) spells both, so it can
learn to call the tool before it answers. The episode has no randomness: ``reset`` takes
the group's seed and ignores it.

The factory is a :class:`~pipeline.envs.tools.ToolEnv` declaring the same calculator as a
function, ``calculate(expression)`` (:data:`CALCULATE`): a chat model is shown its schema
(pipeline.envs.tools) and may call it as ``<tool_call>{"name": "calculate", "arguments":
{"expression": "12+345"}}</tool_call>``, answered with a ``tool`` turn; every turn without
such a call is the calculator episode's own, as above. The character model cannot spell
``<``, and a plain-text prompt shows no tools, so its episodes are unchanged.
"""

from __future__ import annotations

import re

from pipeline.envs.base import Step
from pipeline.envs.tools import Tool, ToolEnv

_EXPR = r"\s*(\d{1,12}(?:\s*[+*]\s*\d{1,12}){0,8})\s*"
_CALL = re.compile(f"^{_EXPR}=\\s*$")
_EXPRESSION = re.compile(f"^{_EXPR}=?\\s*$")


def evaluate(expr: str) -> int:
    """The value of digits joined by ``+`` and ``*`` (``*`` binds tighter), without eval."""
    return sum(_product(term) for term in expr.split("+"))


def _product(term: str) -> int:
    out = 1
    for factor in term.split("*"):
        out *= int(factor)
    return out


class CalculatorEpisode:
    def __init__(self, reference: str) -> None:
        self.reference = reference.strip()
        self.calls = 0

    def reset(self, seed: int | None = None) -> str:
        return ""  # no randomness: every seed is the same episode

    def step(self, action: str) -> Step:
        text = action.strip()
        if text.endswith("="):
            self.calls += 1
            m = _CALL.match(text)
            return Step(observation=str(evaluate(m.group(1).replace(" ", ""))) if m else "", tool_call=True,
                        tool_ok=m is not None)
        return Step(observation="", reward=float(text == self.reference), done=True)

    def close(self) -> None:
        pass


def calculate(expression: str) -> str:
    """The exact value of an expression of digits joined by ``+`` and ``*`` (``*`` binds tighter)."""
    m = _EXPRESSION.match(expression)
    if m is None:
        raise ValueError(f"{expression!r} is not digits joined by + and * (at most 9 numbers of 12 digits)")
    return str(evaluate(m.group(1).replace(" ", "")))


CALCULATE = Tool(
    name="calculate",
    description="The exact value of an arithmetic expression: whole numbers joined by + and * (* binds tighter).",
    parameters={"type": "object",
                "properties": {"expression": {"type": "string", "description": "for example 1234*5678+9"}},
                "required": ["expression"]},
    fn=calculate)
"""The calculator as a function the model is shown and may call."""


def calculator(cfg):
    """The factory: one calculator episode per completion, knowing its prompt's reference, with
    the calculator declared as a tool (:data:`CALCULATE`)."""
    return ToolEnv([CALCULATE], lambda task: CalculatorEpisode(task.reference), cfg=cfg)
