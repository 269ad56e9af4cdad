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

from typing import Any, Optional
from uuid import uuid4

try:
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field
except ImportError as e:  # pragma: no cover (the default lane has no openenv-core)
    raise ImportError(f"pipeline.envs.calculator_server needs openenv-core, the `openenv` extra "
                      f"(pip install -e '.[openenv]'): {e}") from e

from pipeline.envs.calculator import CalculatorEpisode

MAX_SESSIONS = 1024
"""Sessions one server holds at once: one per completion in flight on the generators it serves."""


class CalculatorAction(Action):
    """The model's turn: a tool call (an expression ending in ``=``) or its final answer."""

    text: str = Field(..., description="The model's turn, as text")


class CalculatorObservation(Observation):
    """The calculator's answer to a call ("" for a final answer or a malformed call)."""

    result: str = Field(default="", description="The exact value of the call's expression")
    tool_call: bool = Field(default=False, description="The action was a tool call (it ended in '=')")
    tool_ok: Optional[bool] = Field(default=None, description="The call was well-formed and answered")


class CalculatorEnvironment(Environment):
    """One calculator episode per session; ``reset(reference=...)`` starts it."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._episode = CalculatorEpisode("")
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, reference: str = "",
              **kwargs: Any) -> CalculatorObservation:
        self._episode = CalculatorEpisode(reference)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return CalculatorObservation(result=self._episode.reset(), done=False, reward=None)

    def step(self, action: CalculatorAction, timeout_s: Optional[float] = None,
             **kwargs: Any) -> CalculatorObservation:  # type: ignore[override]
        self._state.step_count += 1
        step = self._episode.step(action.text)
        return CalculatorObservation(result=step.observation, done=step.done, reward=step.reward,
                                     tool_call=step.tool_call, tool_ok=step.tool_ok)

    @property
    def state(self) -> State:
        return self._state


app = create_app(CalculatorEnvironment, CalculatorAction, CalculatorObservation, env_name="calculator",
                 max_concurrent_envs=MAX_SESSIONS)
