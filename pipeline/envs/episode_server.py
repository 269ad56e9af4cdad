"""An in-process environment (pipeline.envs.base's Episode) served as an OpenEnv Environment.

The shared part of the embedded environments' OpenEnv servers (calculator_server,
code_server, textarena_server): one episode per session, started by ``reset`` from the
keyword arguments the pipeline sends (``reference``, ``prompt_id``, ``seed``), stepped with
the text of the Action's ``action_field``, answered with an Observation whose
``observation_field`` is the episode's observation text, with its reward and done, and the
step's ``tool_call`` / ``tool_ok`` flags where the Observation declares them
(pipeline.envs.openenv reads them). A server module subclasses :class:`EpisodeEnvironment`
with its Action and Observation types and ``start``, and makes its ``app`` with
:func:`serve`. Importable only where openenv-core is installed (the ``openenv`` extra).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional
from uuid import uuid4

try:
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
except ImportError as e:  # pragma: no cover (the default lane has no openenv-core)
    raise ImportError(f"pipeline's OpenEnv servers need openenv-core, the `openenv` extra "
                      f"(pip install -e '.[openenv]'): {e}") from e

from pipeline.envs.base import Episode, Step

MAX_SESSIONS = 1024
"""Sessions one server holds at once: one per completion in flight on the generators it serves."""

TOOL_FLAGS = ("tool_call", "tool_ok")


class EpisodeEnvironment(Environment):
    """One in-process episode per session (the module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    action_type: ClassVar[type[Action]]
    observation_type: ClassVar[type[Observation]]
    action_field: ClassVar[str]
    """The Action field holding the model's turn."""
    observation_field: ClassVar[str]
    """The Observation field holding the episode's observation text."""
    started_by: ClassVar[str] = "reset(...) starts an episode"
    """How an episode starts, for the message of a step before any reset."""

    def __init__(self) -> None:
        super().__init__()
        self._episode: Episode | None = None
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def start(self, seed: Optional[int], **kwargs: Any) -> Episode:
        """The session's new episode, from the reset's arguments."""
        raise NotImplementedError

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> Observation:
        self._episode = self.start(seed, **kwargs)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return self._observe(Step(observation=self._episode.reset()))

    def step(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:  # type: ignore[override]
        if self._episode is None:
            raise RuntimeError(f"step before reset: {self.started_by}")
        self._state.step_count += 1
        return self._observe(self._episode.step(getattr(action, self.action_field)))

    def _observe(self, step: Step) -> Observation:
        flags = {k: getattr(step, k) for k in TOOL_FLAGS if k in self.observation_type.model_fields}
        return self.observation_type(**{self.observation_field: step.observation}, done=step.done,
                                     reward=step.reward, **flags)

    @property
    def state(self) -> State:
        return self._state


def serve(env: type[EpisodeEnvironment], name: str):
    """The OpenEnv app serving ``env`` (HTTP and WebSocket, ``MAX_SESSIONS`` sessions)."""
    return create_app(env, env.action_type, env.observation_type, env_name=name, max_concurrent_envs=MAX_SESSIONS)
