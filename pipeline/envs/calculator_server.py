"""The calculator environment (pipeline.envs.calculator) as an OpenEnv server.

``env.kind = "openenv:pipeline.envs.calculator_server:app"`` behaves like ``calculator``:
every generator serves this app itself and drives it through OpenEnv's client. Its shape is
that of OpenEnv's environment template: an Action, an Observation, an ``Environment`` and
the app ``create_app`` makes of them. The prompt's reference answer comes with ``reset``
(the pipeline passes ``reference``); the episode logic is the in-process one's, unchanged.
The Observation's ``tool_call`` and ``tool_ok`` fields carry the step's tool-call flags
(pipeline.envs.openenv reads them).

Importable only where openenv-core is installed (the ``openenv`` extra). By hand::

    uvicorn pipeline.envs.calculator_server:app --port 8000
    pipeline up --generator.swap step --env.kind openenv:http://127.0.0.1:8000
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from pipeline.envs.calculator import CalculatorEpisode
from pipeline.envs.episode_server import Action, EpisodeEnvironment, Observation, serve


class CalculatorAction(Action):
    """The model's turn: a tool call (an expression ending in ``=``) or its final answer."""

    text: str = Field(..., description="The model's turn, as text")


class CalculatorObservation(Observation):
    """The calculator's answer to a call ("" for a final answer or a malformed call)."""

    result: str = Field(default="", description="The exact value of the call's expression")
    tool_call: bool = Field(default=False, description="The action was a tool call (it ended in '=')")
    tool_ok: Optional[bool] = Field(default=None, description="The call was well-formed and answered")


class CalculatorEnvironment(EpisodeEnvironment):
    """One calculator episode per session; ``reset(reference=...)`` starts it."""

    action_type, observation_type = CalculatorAction, CalculatorObservation
    action_field, observation_field = "text", "result"

    def __init__(self) -> None:
        super().__init__()
        self._episode = CalculatorEpisode("")  # a step before any reset is a turn with no reference

    def start(self, seed: Optional[int], reference: str = "", **kwargs) -> CalculatorEpisode:
        return CalculatorEpisode(reference)


app = serve(CalculatorEnvironment, "calculator")
