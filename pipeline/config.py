"""Run configuration: one small frozen dataclass per component under one root.

Loaded from TOML (``--config run.toml``) and overridden by dotted CLI flags
(``--trainer.lr 3e-4``). Every field is validated with a ``ValueError`` that names
the field and what it allows. A loaded config cannot be changed: code that needs a
different one derives it (``cfg.replace("redis.url", url)``, ``cfg.with_overrides({...})``),
validated again. A field with a fixed set of values is typed with a ``Literal``, which
is the one list of what it allows; a field naming a component (``task.kind``,
``trainer.advantage``, ``trainer.loss``, ``weights.transport``, ``env.kind``) is annotated with
that component's registry (``pipeline.catalog``), which owns its names and their checks.
This module imports neither torch nor redis, so every CLI can parse and check its config
before paying for heavy imports.

The sections live beside it: ``pipeline.config_infra`` (Redis, cluster, chaos, tracking,
metrics), ``pipeline.config_task`` (model, task, feeder), ``pipeline.config_train``
(generator, verifier, trainer, weights, env); this module holds the root, the eval section
and the loading. Which set fields cannot take effect is ``pipeline.inert``'s; the TOML
writer is ``pipeline.config_toml``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipeline import catalog, plugins
from pipeline.config_base import ConfigError, Section, check as _check, choices, hints as _hints
from pipeline.config_infra import ChaosConfig, ClusterConfig, MetricsConfig, RedisConfig, TrackingConfig
from pipeline.config_task import DEFAULT_BASE_DIR, FeederConfig, ModelConfig, TaskConfig
from pipeline.config_train import (DEFAULT_VERIFIERS, EnvConfig, GeneratorConfig, TrainerConfig, VerifierConfig,
                                   WeightsConfig)

__all__ = ["DEFAULT_BASE_DIR", "DEFAULT_VERIFIERS", "ChaosConfig", "ClusterConfig", "ConfigError", "EnvConfig",
           "EvalConfig", "FeederConfig", "GeneratorConfig", "MetricsConfig", "ModelConfig", "RedisConfig",
           "RunConfig", "TaskConfig", "TrackingConfig", "TrainerConfig", "VerifierConfig", "WeightsConfig",
           "choices", "config_to_dict", "eval_set_task", "field_names", "load_config", "task_verifiers"]


def task_verifiers(task: TaskConfig) -> tuple[str, ...]:
    """The weak verifiers a run of ``task`` gets when ``verifier.verifiers`` is not set: the
    defaults, or those its task kind names (``verifiers`` in ``pipeline.catalog.TASKS``), each
    reading answers as ``task.answer_extract`` does."""
    kinds = catalog.TASKS.meta(task.kind, "verifiers")
    return DEFAULT_VERIFIERS if kinds is None else tuple(f"{k}:{task.answer_extract}" for k in kinds)


def eval_set_task(task: "TaskConfig", spec: str) -> "TaskConfig":
    """The task of one ``eval.sets`` entry: ``task`` changed by its ``field=value;...`` pairs
    (a list value's items joined by ``+``); ConfigError naming ``eval.sets`` otherwise."""
    fields = {f.name: f for f in dataclasses.fields(TaskConfig)}
    changes: dict[str, Any] = {}
    for part in (x.strip() for x in spec.split(";")):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in fields:
            raise ConfigError(f"eval.sets: {spec!r}: each part must be field=value with a [task] field "
                              f"({', '.join(sorted(fields))}); got {part!r}")
        changes[name] = value.strip().replace("+", ",")
    try:
        merged = _build(TaskConfig, {**config_to_dict(task), **changes}, "task.")
    except ConfigError as e:
        raise ConfigError(f"eval.sets: {spec!r}: {e}") from None
    # Another split of the run's own items could hold items the trainer trains on.
    items = [f for f in fields if f not in _EVAL_FORMAT_FIELDS]
    if all(getattr(merged, f) == getattr(task, f) for f in items):
        raise ConfigError(f"eval.sets: {spec!r} draws its items as the run's own task does (it changes only "
                          f"{', '.join(sorted(changes))}): its held-out split could hold training items; change "
                          "what the items are (kind, dataset, datasets, digits, ops, ...)")
    return merged


_EVAL_FORMAT_FIELDS = ("heldout_size", "heldout_seed", "max_new_tokens", "template", "system_prompt", "chat_template",
                       "answer_extract", "prompt_field", "answer_field")
"""[task] fields that change how items are asked or how many are held out, not which items exist."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig(Section):
    every_versions: int = 10
    """The eval worker (``cluster.evaluators = 1``) evaluates the first version it finds, then
    the newest one once it is at least this many versions past the last it evaluated
    (versions in between are skipped, never queued)."""
    n: int = 8
    """Samples per held-out prompt for pass@k and mean@n."""
    ks: tuple[int, ...] = (1, 4, 8)
    """The k of each pass@k reported (each in [1, n])."""
    temperature: float = 1.0
    """Sampling temperature of the pass@k samples (greedy accuracy is always greedy)."""
    max_prompts: int = 200
    """Held-out prompts per evaluation (an even spread over the held-out set; 0: all of them)."""
    seed: int = 0
    """Seed of the samples: each version is sampled from the same seed."""
    threads: int = 1
    """Torch threads of the eval worker and of ``pipeline eval``."""
    sched_idle: bool = True
    """Linux: the eval worker runs under SCHED_IDLE, on CPU time no other process wants, so
    the stages never wait for it (it evaluates less often on a saturated host). False (or
    where SCHED_IDLE is missing): it runs at ``nice``."""
    nice: int = 10
    """Scheduling niceness the eval worker adds to its own (0-19) when not under SCHED_IDLE."""
    sets: tuple[str, ...] = ()
    """More held-out sets, besides the run's own task's: each the held-out split of the task as
    changed by ``field=value`` pairs of [task] joined by ``;`` (a list value's items joined by
    ``+``), e.g. ``"digits=4"`` or ``"kind=reasoning_gym;datasets=chain_sum+leg_counting"``."""

    def task_sets(self, task: "TaskConfig") -> dict[str, "TaskConfig"]:
        """Every set evaluated, by name: ``heldout`` (the run's task) and each of ``sets``."""
        out = {"heldout": task}
        for spec in self.sets:
            out[spec] = eval_set_task(task, spec)
        return out

    def _validate(self, p: str) -> None:
        _check(self.every_versions >= 1, f"{p}.every_versions", ">= 1", self.every_versions)
        _check(len(set(self.sets)) == len(self.sets) and "heldout" not in self.sets, f"{p}.sets",
               "distinct and other than 'heldout'", list(self.sets))
        _check(self.n >= 1, f"{p}.n", ">= 1", self.n)
        _check(bool(self.ks) and all(1 <= k <= self.n for k in self.ks) and len(set(self.ks)) == len(self.ks),
               f"{p}.ks", f"distinct integers in [1, n={self.n}]", list(self.ks))
        _check(math.isfinite(self.temperature) and self.temperature > 0, f"{p}.temperature", "> 0", self.temperature)
        _check(self.max_prompts >= 0, f"{p}.max_prompts", ">= 0 (0: the whole held-out set)", self.max_prompts)
        _check(self.threads >= 1, f"{p}.threads", ">= 1", self.threads)
        _check(0 <= self.nice <= 19, f"{p}.nice", "in [0, 19]", self.nice)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    run_id: str = ""
    """Run id; also the Redis key namespace. Empty: ``pipeline up`` makes one from the time."""
    runs_dir: str = "runs"
    """Logs, metrics, checkpoints and the summary go to ``<runs_dir>/<run_id>/``."""
    plugins: tuple[str, ...] = ()
    """Modules of your own imported before the config is checked, in every process of the run
    (``module`` importable from the directory the command runs in or ``PYTHONPATH``, or
    ``path/to/file.py``): what they register in ``pipeline.catalog`` (a task kind, a loss, an
    advantage, a weight transport, an environment) is then a name the config accepts
    (docs/extending.md)."""
    redis: RedisConfig = field(default_factory=RedisConfig)
    """The Redis-compatible server."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The base model and its supervised warm-up."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The task (arithmetic, or math problems from a file) and its held-out evaluation set."""
    feeder: FeederConfig = field(default_factory=FeederConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """What ``pipeline up`` starts on this machine."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Prometheus endpoints and queue sampling."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Experiment trackers (TensorBoard, Weights & Biases)."""
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    """Fault injection, used only by ``pipeline chaos``."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes in an environment (off by default)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The eval worker beside training (``cluster.evaluators``)."""

    def validate(self) -> "RunConfig":
        try:
            plugins.import_modules(self.plugins)
        except plugins.PluginError as e:
            raise ConfigError(f"plugins: {e}") from None
        _check(all(c.isalnum() or c in "-_." for c in self.run_id), "run_id", "letters, digits, '-', '_' or '.'", self.run_id)
        self.eval.task_sets(self.task)  # each set's task is a valid task (errors name eval.sets)
        _check(self.weights.payload == "full" or self.trainer.lora_rank > 0, "weights.payload",
               '"full" unless the trainer trains LoRA adapters (trainer.lora_rank > 0)', self.weights.payload)
        _check(not self.env.kind or self.generator.swap != "batch", "env.kind",
               'used with generator.swap "step" or "drain" (episodes run in the slot sampler)', self.env.kind)
        _check(self.env.max_in_flight == 0 or self.env.max_in_flight >= self.generator.group_size,
               "env.max_in_flight", f"0 or at least generator.group_size ({self.generator.group_size})",
               self.env.max_in_flight)
        _check(not self.env.kind or self.generator.backend == "torch", "env.kind",
               'used with generator.backend "torch" (its slot sampler runs the turns)', self.env.kind)
        _check(not self.env.kind or self.trainer.backend == "torch", "env.kind",
               'used with trainer.backend "torch" (its loss masks the observation tokens)', self.env.kind)
        _check(self.verifier.reward.strip() != "environment" or bool(self.env.kind), "verifier.reward",
               '"environment" only with an environment (env.kind)', self.verifier.reward)
        if self.env.kind:
            _check(catalog.ENVS.allows(catalog.env_name(self.env.kind)), "env.kind", catalog.ENVS.allowed(),
                   self.env.kind)
            catalog.ENVS.check(catalog.env_name(self.env.kind), self, "env", _check)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                value.validate(f.name)
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.run_id

    @property
    def explicit(self) -> frozenset[str]:
        """Dotted names of the fields the user set when this config was loaded: every
        override, and every TOML value that differs from the default. A config derived by
        ``with_overrides`` keeps its origin's set: what code derives, the user did not set."""
        return self.__dict__.get("_explicit", frozenset())

    def with_overrides(self, overrides: Mapping[str, Any]) -> "RunConfig":
        """A new config: this one with dotted overrides (``{"redis.url": url}``), coerced
        like command-line values and validated again."""
        cfg = _build(RunConfig, _merge(config_to_dict(self), _nest(overrides)), "").validate()
        object.__setattr__(cfg, "_explicit", self.explicit)
        return cfg

    def replace(self, dotted: str, value: Any) -> "RunConfig":
        """A new config with one field changed (``cfg.replace("redis.appendfsync", "always")``)."""
        return self.with_overrides({dotted: value})

    def get(self, dotted: str) -> Any:
        """The value of a dotted field name (``cfg.get("trainer.lr")``)."""
        value: Any = self
        for part in dotted.split("."):
            value = getattr(value, part)
        return value


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Convert a TOML or command-line value to the field's declared type."""
    origin = typing.get_origin(hint)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: must be a list; got {value!r}")
        item = typing.get_args(hint)[0]
        return tuple(_coerce(v, item, name) for v in value)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if not (isinstance(value, str) and value in allowed):
            raise ConfigError(f"{name}: must be {'|'.join(allowed)}; got {value!r}")
        return value
    try:
        if hint is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if hint is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return hint(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: must be {hint.__name__}; got {value!r}") from None


def _build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    """An instance of the config class ``cls`` from a (nested) table of raw values; fields
    not named keep their default. Unknown names and unconvertible values raise, naming the field."""
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"{name}: unknown field{_did_you_mean(key, names, prefix)}; allowed: "
                              f"{', '.join(sorted(names))}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{name}: must be a table of fields; got {value!r}")
            kwargs[key] = _build(hint, value, f"{name}.")
        else:
            kwargs[key] = _coerce(value, hint, name)
    return cls(**kwargs)


def field_names(cls: type | None = None, prefix: str = "") -> list[str]:
    """The dotted name of every field of ``cls`` (default: the whole ``RunConfig``)."""
    out = []
    for f in dataclasses.fields(cls or RunConfig):
        hint = _hints(cls or RunConfig)[f.name]
        out += field_names(hint, f"{prefix}{f.name}.") if dataclasses.is_dataclass(hint) else [f"{prefix}{f.name}"]
    return out


def _did_you_mean(key: str, names: list[str], prefix: str) -> str:
    """`` (did you mean X?)`` for an unknown field ``prefix + key``: the closest field of its own
    table, else a field of that name (or a close one) in another table; empty when none is close."""
    if close := difflib.get_close_matches(key, names, n=1, cutoff=0.6):
        return f" (did you mean {prefix}{close[0]}?)"
    everywhere = field_names()
    leaves = {n.rpartition(".")[2]: n for n in everywhere}
    if close := difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.75):
        return f" (did you mean {leaves[close[0]]}?)"
    if close := difflib.get_close_matches(f"{prefix}{key}", everywhere, n=1, cutoff=0.75):
        return f" (did you mean {close[0]}?)"
    return ""


def _nest(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``{"trainer.lr": v}`` -> ``{"trainer": {"lr": v}}``."""
    nested: dict[str, Any] = {}
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = nested
        for part in parents:
            if not isinstance(node.setdefault(part, {}), dict):
                raise ConfigError(f"{dotted}: {part} is a field, not a table of fields")
            node = node[part]
        node[leaf] = value
    return nested


def _merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` laid over it, table by table."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _leaves(table: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted names of the values (not the sub-tables) of a nested table."""
    for key, value in table.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Defaults, then the TOML file, then dotted overrides (``{"trainer.lr": "3e-4"}``), validated.

    The result is frozen; ``explicit`` names the fields set here (see ``RunConfig.explicit``).
    """
    data: dict[str, Any] = {}
    explicit: set[str] = set()
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        from_file, default = _build(RunConfig, data, ""), RunConfig()
        explicit.update(n for n in _leaves(data) if from_file.get(n) != default.get(n))
    nested = _nest(overrides or {})
    explicit.update(_leaves(nested))
    cfg = _build(RunConfig, _merge(data, nested), "").validate()
    if "verifier.verifiers" not in explicit and catalog.TASKS.meta(cfg.task.kind, "verifiers"):
        cfg = cfg.replace("verifier.verifiers", ",".join(task_verifiers(cfg.task)))
    object.__setattr__(cfg, "_explicit", frozenset(explicit))
    return cfg


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
