"""Environments by name: what ``env.kind`` may say, from ``pipeline.catalog.ENVS``.

``calculator`` (pipeline.envs.calculator), ``code`` (hidden tests in the code_exec sandbox,
pipeline.envs.code), ``textarena`` / ``textarena:<game id>`` (a single-player TextArena game,
pipeline.envs.textarena; the ``textarena`` extra), ``openenv:<url or app>`` (an OpenEnv server,
pipeline.envs.openenv; docs/environments.md), or your own as ``module:function`` /
``path/to/file.py:function`` / an ``rlpipe.envs`` entry point (pipeline.plugins): a
callable taking the run config and returning the factory ``make(task) -> Episode``
(pipeline.envs.base). An environment's module is imported only when a run picks it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.catalog import ENVS, env_name
from pipeline.plugins import PluginError, require_callable

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from pipeline.envs.base import EnvFactory


def make_env(cfg: RunConfig) -> EnvFactory | None:
    """The factory ``env.kind`` names, or None for single-turn generation (``env.kind = ""``)."""
    kind = cfg.env.kind
    if not kind:
        return None
    try:
        factory = ENVS.get(env_name(kind))
    except PluginError:
        raise
    except ValueError:
        known = []
        for n in ENVS:
            arg = ENVS.meta(n, "argument")
            known += ([n] if not arg or ENVS.meta(n, "bare") else []) + ([f"{n}:{arg}"] if arg else [])
        raise PluginError(f"env.kind: unknown environment {kind!r}; allowed: {', '.join(known)}, module:function, "
                          "path/to/file.py:function, or an rlpipe.envs entry point") from None
    return require_callable(factory, kind, "environment")(cfg)
