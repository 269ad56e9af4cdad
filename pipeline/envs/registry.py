"""Environments by name: what ``env.kind`` may say, from ``pipeline.catalog.ENVS``.

``calculator`` (pipeline.envs.calculator), ``code`` (hidden tests in the code_exec sandbox,
pipeline.envs.code), ``textarena`` / ``textarena:<game id>`` (a single-player TextArena game,
pipeline.envs.textarena; the ``textarena`` extra), ``openenv:<url or app>`` (an OpenEnv server,
pipeline.envs.openenv; docs/environments.md), or your own as ``module:function`` /
``path/to/file.py:function`` / an ``rlpipe.envs`` entry point (pipeline.plugins): a
callable taking the run config and returning the factory ``make(task) -> Episode``
(pipeline.envs.base). An environment's module is imported only when a run picks it.

``mix:<kind>=<weight>,...`` (:func:`mixture`) is several of those in one run: each member's
factory is built as its own ``env.kind`` would be, and each prompt's group is routed to one
member (:func:`pipeline.envs.base.route_index`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.catalog import ENVS, env_name, member_config, parse_mix
from pipeline.envs.base import route_index
from pipeline.plugins import PluginError, require_callable

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from pipeline.envs.base import Episode, EnvFactory
    from pipeline.records import PromptTask


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


class EnvMixture:
    """The factory of ``env.kind = "mix:<kind>=<weight>,..."``: each member's own factory, and
    each task routed to one of them by a hash of ``feeder.seed`` and its prompt id
    (:func:`~pipeline.envs.base.route_index`): every completion of a group, every replay and
    every process route a prompt alike, and the shares follow the weights. :meth:`route` names
    the member (the EpisodeRunner counts per member); :meth:`close` closes every member
    factory that has a ``close`` (their servers)."""

    def __init__(self, cfg: RunConfig) -> None:
        members = parse_mix(cfg.env.kind)
        self.kinds = [k for k, _ in members]
        self.weights = [w for _, w in members]
        self.run_seed = cfg.feeder.seed
        self.factories: list = []
        try:
            for kind in self.kinds:
                self.factories.append(make_env(member_config(cfg, kind)))
        except BaseException:
            self.close()
            raise

    def index(self, task: PromptTask) -> int:
        return route_index(self.run_seed, task.prompt_id, self.weights)

    def route(self, task: PromptTask) -> str:
        """The member kind ``task``'s group plays."""
        return self.kinds[self.index(task)]

    def __call__(self, task: PromptTask) -> Episode:
        return self.factories[self.index(task)](task)

    def close(self) -> None:
        """Close every member factory (the first failure raised once all were tried)."""
        failed = None
        for factory in self.factories:
            close = getattr(factory, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as e:
                    failed = failed or e
        if failed is not None:
            raise failed


def mixture(cfg: RunConfig) -> EnvMixture:
    """The factory ``make_env`` returns for a ``mix:`` kind."""
    return EnvMixture(cfg)
