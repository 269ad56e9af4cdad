"""Fields without effect: which fields the user set that cannot take effect in a run.

A field that its run never reads (a vLLM option with the torch backend, a TLS file with a
plain ``redis://`` server, ...) is refused before launch, naming why, instead of being
silently ignored. The rules of a component picked by name (a task kind, a weight transport)
are its registry entry's (``pipeline.catalog``); those of the other sections are here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pipeline import catalog
from pipeline.algo.rewards import uses_label_model
from pipeline.catalog import PRETRAIN_FIELDS
from pipeline.config import ChaosConfig, ConfigError, GeneratorConfig, RunConfig


@dataclass(frozen=True, kw_only=True)
class Situation:
    """What, beside the config itself, decides whether a field can take effect in a run."""

    command: Literal["up", "chaos"] = "up"
    """The command starting the run."""
    redis_url: str = ""
    """The server the run will use (``redis.url``, else ``$REDIS_URL``); empty: one the run starts."""
    base_model: Mapping[str, Any] | None = None
    """What ``model.base_dir``'s pretrained checkpoint records (its ``pretrain.json``) when
    one is there, so the base model will not be built again; None when it will be."""


LABEL_MODEL_FIELDS = ("verifier.window", "verifier.refit_every", "verifier.min_fit_rows", "verifier.dependence",
                      "verifier.sound_checks", "verifier.class_balance", "verifier.pi_estimate",
                      "verifier.label_model", "verifier.labels", "verifier.refit")
VLLM_FIELDS = tuple(f"generator.{f.name}" for f in dataclasses.fields(GeneratorConfig) if f.name.startswith("vllm_"))


def _recorded(record: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = record
    for part in path:
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def inert_fields(cfg: RunConfig, s: Situation) -> dict[str, str]:
    """Every field whose value cannot take effect in a run of ``cfg`` in situation ``s``, with why."""
    out: dict[str, str] = {}

    def inert(names, why: str) -> None:
        for n in names:
            out.setdefault(n, why)

    if catalog.TASKS.meta(cfg.task.kind, "builds_base") and s.base_model is not None:
        # A value the checkpoint was built with did take effect: re-running a config is fine.
        inert([n for n, at in PRETRAIN_FIELDS.items() if (_recorded(s.base_model, at) or 0) != (cfg.get(n) or 0)],
              f"model.base_dir {cfg.model.base_dir!r} already holds a pretrained checkpoint, which is "
              "used as it is: remove it, or point model.base_dir elsewhere to build a new one")
    if s.command != "chaos":
        inert([f"chaos.{f.name}" for f in dataclasses.fields(ChaosConfig)],
              "only `pipeline chaos` injects faults; `pipeline up` leaves [chaos] off")
    if s.redis_url:
        inert(["redis.appendfsync"], f"it sets the fsync policy of a server the run starts, and this run uses the "
                                     f"running server {s.redis_url}")
    elif s.command == "chaos" and cfg.redis.appendfsync != "always":
        inert(["redis.appendfsync"], "`pipeline chaos` starts its server with appendfsync = always, so that a "
                                     "killed server loses nothing it acknowledged")
    if not s.redis_url.startswith("rediss://"):
        inert(["redis.tls_ca_file", "redis.tls_cert_file", "redis.tls_key_file"],
              f"only a rediss:// URL uses TLS, and this run's server is {s.redis_url or 'a local one it starts'}")
    if cfg.generator.backend != "torch":
        inert(["generator.device"], f"only generator.backend 'torch' reads it; the backend is {cfg.generator.backend!r}")
    if cfg.generator.backend != "vllm":
        inert(VLLM_FIELDS, f"only generator.backend 'vllm' reads it; the backend is {cfg.generator.backend!r}")
    if not cfg.trainer.dynamic_sampling:
        inert(["trainer.max_refills"], "only trainer.dynamic_sampling reads it, and it is off")
    if cfg.trainer.backend != "torch":
        inert(["trainer.ppo_epochs", "trainer.minibatches", "trainer.max_tokens_per_microbatch"],
              f"only trainer.backend 'torch' implements them; the backend is {cfg.trainer.backend!r}")
    if cfg.trainer.lora_rank == 0:
        inert(["trainer.lora_alpha", "trainer.lora_dropout", "trainer.lora_targets"],
              "only LoRA training reads it, and trainer.lora_rank is 0 (full fine-tuning)")
    clipping = [n for n in catalog.LOSSES if catalog.LOSSES.meta(n, "clips")]
    if cfg.trainer.loss in catalog.LOSSES and not catalog.LOSSES.meta(cfg.trainer.loss, "clips"):
        inert(["trainer.clip_eps", "trainer.clip_eps_high"],
              f"only trainer.loss {' and '.join(map(repr, clipping))} clip the ratio; the loss is {cfg.trainer.loss!r}")
    elif cfg.trainer.backend == "torch" and cfg.trainer.ppo_epochs * cfg.trainer.minibatches == 1:
        inert(["trainer.clip_eps", "trainer.clip_eps_high"],
              "with one update per batch (trainer.ppo_epochs = trainer.minibatches = 1) the ratio is 1 and never "
              "clipped; set trainer.ppo_epochs or trainer.minibatches above 1")
    if not catalog.TRANSPORTS.meta(cfg.weights.transport, "socket"):
        sockets = [n for n in catalog.TRANSPORTS if catalog.TRANSPORTS.meta(n, "socket")]
        inert(["weights.tcp_port", "weights.fetch_timeout_s"],
              f"only weights.transport {' and '.join(map(repr, sockets))} serve and fetch over a socket; the "
              f"transport is {cfg.weights.transport!r}")
    for registry in (catalog.TASKS, catalog.TRANSPORTS):
        for name, why in registry.inert(cfg).items():
            inert([name], why)
    if "wandb" not in cfg.tracking.backends:
        inert(["tracking.project", "tracking.wandb_mode"], "only the wandb tracker reads it; tracking.backends is "
                                                           f"{list(cfg.tracking.backends)}")
    if not cfg.tracking.backends:
        inert(["tracking.dir"], "no tracker is chosen (tracking.backends is empty)")
    if not (cfg.metrics.base_port or cfg.metrics.port):
        inert(["metrics.host"], "no metrics endpoint is served (metrics.base_port and metrics.port are 0)")
    if not uses_label_model(cfg.verifier.reward):
        inert(LABEL_MODEL_FIELDS, f"they tune the label model, which reward {cfg.verifier.reward!r} does not use "
                                  "(only 'weaver' and 'weaver-hard' do)")
    return out


def refuse_inert(cfg: RunConfig, s: Situation) -> None:
    """ConfigError naming every field the user set (``cfg.explicit``) to other than its default
    that cannot take effect, why, and how to get round it: leave the field out, or set it back
    to its default on the command line (which wins over a config file)."""
    by_reason: dict[str, list[str]] = {}
    default = RunConfig()
    for name, why in inert_fields(cfg, s).items():
        if name in cfg.explicit and cfg.get(name) != default.get(name):
            by_reason.setdefault(why, []).append(name)
    if by_reason:
        raise ConfigError("; ".join(
            f"{', '.join(f'{n} = {cfg.get(n)!r}' for n in names)}: set, but cannot take effect: {why}. To run "
            f"without {'them' if len(names) > 1 else 'it'}, leave {'them' if len(names) > 1 else 'it'} out of the "
            f"config, or pass {' '.join(f'--{n} {_flag_value(default.get(n))}' for n in names)} (the default)"
            for why, names in by_reason.items()))


def _flag_value(v: Any) -> str:
    """``v`` as a command-line value (lists joined by commas, as ``_coerce`` reads them)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v)) or "''"
    return "''" if v == "" else str(v)
