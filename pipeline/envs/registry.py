"""Environments by name: what ``env.kind`` may say.

``calculator`` (pipeline.envs.calculator), ``code`` (hidden tests in the code_exec sandbox,
pipeline.envs.code), ``textarena`` / ``textarena:<game id>`` (a single-player TextArena game,
pipeline.envs.textarena; the ``textarena`` extra), ``openenv:<url or app>`` (an OpenEnv server,
pipeline.envs.openenv; docs/environments.md), or your own as ``module:function`` /
``path/to/file.py:function`` / an ``rlpipe.envs`` entry point (pipeline.plugins): a
callable taking the run config and returning the factory ``make(task) -> Episode``
(pipeline.envs.base).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from pipeline.envs.base import EnvFactory


def make_env(cfg: RunConfig) -> EnvFactory | None:
    """The factory ``env.kind`` names, or None for single-turn generation (``env.kind = ""``)."""
    kind = cfg.env.kind
    if not kind:
        return None
    if kind == "calculator":
        from pipeline.envs.calculator import calculator

        return calculator(cfg)
    if kind == "code":
        from pipeline.envs.code import code

        return code(cfg)
    if kind == "textarena" or kind.startswith("textarena:"):  # textarena is imported there, only then
        from pipeline.envs.textarena import textarena

        return textarena(cfg)
    if kind.startswith("openenv:"):  # OpenEnv servers (pipeline.envs.openenv; openenv-core is imported there)
        from pipeline.envs.openenv import openenv

        return openenv(cfg)
    from pipeline.plugins import PluginError, find, require_callable

    obj = find("env", kind)
    if obj is None:
        raise PluginError(f"env.kind: unknown environment {kind!r}; allowed: calculator, code, textarena, "
                          f"textarena:<game id>, openenv:<url or app>, "
                          f"module:function, path/to/file.py:function, or an rlpipe.envs entry point")
    return require_callable(obj, kind, "environment")(cfg)
