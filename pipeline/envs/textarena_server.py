"""A single-player TextArena game (pipeline.envs.textarena) as an OpenEnv server.

``env.kind = "openenv:pipeline.envs.textarena_server:app"`` plays the game of
``env.kind = "textarena"`` on OpenEnv servers the generators start: the same game, seeded
from the prompt's id (``reset`` receives ``prompt_id``), the same observations, rewards and
done for the same actions. The game is ``GuessTheNumber-v0`` unless the environment
variable ``RLPIPE_TEXTARENA_GAME`` names another (a single-player game that runs offline;
each server process reads it when it imports this module, and a generator's servers inherit
the generator's environment).

Its shape is that of OpenEnv's environment template, as the calculator's server: an Action
(``action``, the turn's text), an Observation (``message``, the game's new messages), an
``Environment`` and the ``app``. Importable only where openenv-core and textarena are
installed (the ``openenv`` and ``textarena`` extras). By hand::

    RLPIPE_TEXTARENA_GAME=TowerOfHanoi-v0 uvicorn pipeline.envs.textarena_server:app --port 8000
    pipeline up --generator.swap step --env.kind openenv:http://127.0.0.1:8000 ...
"""

from __future__ import annotations

import os
from typing import Any, Optional
from uuid import uuid4

try:
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field
except ImportError as e:  # pragma: no cover (the default lane has no openenv-core)
    raise ImportError(f"pipeline.envs.textarena_server needs openenv-core, the `openenv` extra "
                      f"(pip install -e '.[openenv]'): {e}") from e

from pipeline.envs.textarena import DEFAULT_GAME, TextArenaEpisode, TextArenaGames, seed_of

GAME = os.environ.get("RLPIPE_TEXTARENA_GAME", "").strip() or DEFAULT_GAME
"""The game this server plays."""
KIND = f"textarena:{GAME}"
MAX_SESSIONS = 1024
"""Sessions one server holds at once: one per completion in flight on the generators it serves."""

TextArenaGames(KIND)  # textarena installed, the game known and playable alone: else the server does not start


class TextArenaAction(Action):
    """The model's turn: the game action (GuessTheNumber reads ``[n]``)."""

    action: str = Field(..., description="The model's move, as text")


class TextArenaObservation(Observation):
    """The game's messages since the last turn ("" once the game is over)."""

    message: str = Field(default="", description="What the game says, one [GAME] line per message")


class TextArenaEnvironment(Environment):
    """One game per session; ``reset(prompt_id=...)`` starts it with the prompt's seed."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._episode: TextArenaEpisode | None = None
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, prompt_id: str = "",
              **kwargs: Any) -> TextArenaObservation:
        self._episode = TextArenaEpisode(GAME, seed if seed is not None else seed_of(prompt_id), kind=KIND)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return TextArenaObservation(message=self._episode.reset(), done=False, reward=None)

    def step(self, action: TextArenaAction, timeout_s: Optional[float] = None,
             **kwargs: Any) -> TextArenaObservation:  # type: ignore[override]
        if self._episode is None:
            raise RuntimeError("step before reset: reset(prompt_id=...) starts a game")
        self._state.step_count += 1
        step = self._episode.step(action.action)
        return TextArenaObservation(message=step.observation, done=step.done, reward=step.reward)

    @property
    def state(self) -> State:
        return self._state


app = create_app(TextArenaEnvironment, TextArenaAction, TextArenaObservation, env_name="textarena",
                 max_concurrent_envs=MAX_SESSIONS)
