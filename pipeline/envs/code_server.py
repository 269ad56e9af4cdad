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

from typing import Optional

from pydantic import Field

from pipeline.envs.code import CodeEpisode
from pipeline.envs.episode_server import Action, EpisodeEnvironment, Observation, serve


class CodeAction(Action):
    """The model's turn: the function's code (a fenced block, or the whole text)."""

    code: str = Field(..., description="The model's attempt at the function, as text")


class CodeObservation(Observation):
    """What went wrong with the last attempt ("" when every hidden test passed, and at reset)."""

    feedback: str = Field(default="", description="The failing tests and how they failed, or why the code did not run")


class CodeEnvironment(EpisodeEnvironment):
    """One code episode per session; ``reset(reference=...)`` starts it with the prompt's hidden tests."""

    action_type, observation_type = CodeAction, CodeObservation
    action_field, observation_field = "code", "feedback"
    started_by = "reset(reference=...) starts a code episode"

    def start(self, seed: Optional[int], reference: str = "", **kwargs) -> CodeEpisode:
        return CodeEpisode(reference)  # EnvError naming env.kind 'code' for a reference without tests


app = serve(CodeEnvironment, "code")
