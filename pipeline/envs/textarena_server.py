"""A single-player TextArena game (pipeline.envs.textarena) as an OpenEnv server.

``env.kind = "openenv:pipeline.envs.textarena_server:app"`` plays the game of
``env.kind = "textarena"`` on OpenEnv servers the generators start: the same game, seeded
with the group's seed (``reset`` receives ``seed``; without one, from ``prompt_id``), the same observations, rewards and
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
from typing import Optional

from pydantic import Field

from pipeline.envs.episode_server import Action, EpisodeEnvironment, Observation, serve
from pipeline.envs.textarena import DEFAULT_GAME, TextArenaEpisode, TextArenaGames, seed_of

GAME = os.environ.get("RLPIPE_TEXTARENA_GAME", "").strip() or DEFAULT_GAME
"""The game this server plays."""
KIND = f"textarena:{GAME}"

TextArenaGames(KIND)  # textarena installed, the game known and playable alone: else the server does not start


class TextArenaAction(Action):
    """The model's turn: the game action (GuessTheNumber reads ``[n]``)."""

    action: str = Field(..., description="The model's move, as text")


class TextArenaObservation(Observation):
    """The game's messages since the last turn ("" once the game is over)."""

    message: str = Field(default="", description="What the game says, one [GAME] line per message")


class TextArenaEnvironment(EpisodeEnvironment):
    """One game per session; ``reset(prompt_id=...)`` starts it with the prompt's seed."""

    action_type, observation_type = TextArenaAction, TextArenaObservation
    action_field, observation_field = "action", "message"
    started_by = "reset(prompt_id=...) starts a game"

    def start(self, seed: Optional[int], prompt_id: str = "", **kwargs) -> TextArenaEpisode:
        return TextArenaEpisode(GAME, seed if seed is not None else seed_of(prompt_id), kind=KIND)


app = serve(TextArenaEnvironment, "textarena")
