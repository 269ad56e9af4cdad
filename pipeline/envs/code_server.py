"""The code environment (pipeline.envs.code) as an OpenEnv server.

``env.kind = "openenv:pipeline.envs.code_server:app"`` behaves like ``code``: every
generator serves this app itself and drives it through OpenEnv's client. Its shape is that
of OpenEnv's environment template, as the calculator's server (pipeline.envs.calculator_server):
an Action, an Observation, an ``Environment`` and the app ``create_app`` makes of them. The
prompt's reference (the function's name and its hidden tests) comes with ``reset``; the
episode logic is the in-process one's, unchanged: the same sandbox, observations, rewards
and done for the same actions.

Each session's steps run sandboxed programs (up to 5 s each); OpenEnv runs a session's
step on the server's worker threads, so sessions overlap, and a server holds up to
``MAX_SESSIONS`` of them. Importable only where openenv-core is installed (the ``openenv``
extra). By hand::

    uvicorn pipeline.envs.code_server:app --port 8000
    pipeline up --generator.swap step --task.kind code --env.kind openenv:http://127.0.0.1:8000
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
    raise ImportError(f"pipeline.envs.code_server needs openenv-core, the `openenv` extra "
                      f"(pip install -e '.[openenv]'): {e}") from e

from pipeline.envs.code import CodeEpisode

MAX_SESSIONS = 1024
"""Sessions one server holds at once: one per completion in flight on the generators it serves."""


class CodeAction(Action):
    """The model's turn: the function's code (a fenced block, or the whole text)."""

    code: str = Field(..., description="The model's attempt at the function, as text")


class CodeObservation(Observation):
    """What went wrong with the last attempt ("" when every hidden test passed, and at reset)."""

    feedback: str = Field(default="", description="The failing tests and how they failed, or why the code did not run")


class CodeEnvironment(Environment):
    """One code episode per session; ``reset(reference=...)`` starts it with the prompt's hidden tests."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._episode: CodeEpisode | None = None
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, reference: str = "",
              **kwargs: Any) -> CodeObservation:
        self._episode = CodeEpisode(reference)  # EnvError naming env.kind 'code' for a reference without tests
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return CodeObservation(feedback=self._episode.reset(), done=False, reward=None)

    def step(self, action: CodeAction, timeout_s: Optional[float] = None,
             **kwargs: Any) -> CodeObservation:  # type: ignore[override]
        if self._episode is None:
            raise RuntimeError("step before reset: reset(reference=...) starts a code episode")
        self._state.step_count += 1
        step = self._episode.step(action.code)
        return CodeObservation(feedback=step.observation, done=step.done, reward=step.reward)

    @property
    def state(self) -> State:
        return self._state


app = create_app(CodeEnvironment, CodeAction, CodeObservation, env_name="code", max_concurrent_envs=MAX_SESSIONS)
