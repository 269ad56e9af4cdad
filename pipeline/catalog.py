"""The built-in components picked by name in the config, one registry per kind.

=====================  ===================  ===========================================
registry               config field         its entries
=====================  ===================  ===========================================
``TASKS``              ``task.kind``        a class built as ``Class(task_config)`` (``pipeline.tasks``)
``ADVANTAGES``         ``trainer.advantage`` ``rewards [G] -> advantages [G]`` (``pipeline.algo.losses``)
``LOSSES``             ``trainer.loss``     ``(logp, prox_logp, behav_logp, adv, mask, settings) -> (loss, stats)``
``TRANSPORTS``         ``weights.transport`` ``(Publisher class, Fetcher class)`` (``pipeline.weights``)
``ENVS``               ``env.kind``         ``factory(run_config) -> make(task) -> Episode`` (``pipeline.envs``)
=====================  ===================  ===========================================

Each built-in is named here by its ``module:attr``, imported only when a run uses it, so the
config knows every name, check and rule without importing torch or the component's
dependencies. Adding one is one new module and one ``register`` line here; code of your own
registers the same way from a module named in the config's ``plugins`` list
(docs/extending.md). The checks here are those of the fields a component reads; the rules
say which fields cannot take effect with it (``pipeline.inert``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path
from typing import Any

from pipeline import plugins
from pipeline.registry import Registry

TASKS = Registry("task.kind", "task", what="Class", noun="task")
ADVANTAGES = Registry("trainer.advantage", "advantage")
LOSSES = Registry("trainer.loss", "loss")
TRANSPORTS = Registry("weights.transport", None, noun="weights transport")
ENVS = Registry("env.kind", "env", noun="environment")


# ----------------------------------------------------------------------------- tasks


def builtin_task(kind: str) -> bool:
    """A task kind of the package's, whose fields are known; one of the user's reads any field."""
    return bool(TASKS.meta(kind, "builtin"))


def _check_text_task(task: Any, p: str, check) -> None:
    """The fields every task that builds its prompts from text reads (math, reasoning_gym, code, yours)."""
    check("{problem}" in task.template, f"{p}.template", "a string containing {problem}", task.template)
    check(task.heldout_size >= 1, f"{p}.heldout_size", ">= 1", task.heldout_size)
    why = answer_extract_problem(task.answer_extract)
    check(why is None, f"{p}.answer_extract", why or "", task.answer_extract)


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


def _check_arithmetic(task: Any, p: str, check) -> None:
    check(1 <= task.digits <= 6, f"{p}.digits", "in [1, 6]", task.digits)
    check(bool(task.ops), f"{p}.ops", "a non-empty list of '+' and '*'", task.ops)
    # At most half of all distinct problems (pipeline.tasks.arithmetic.problem_count),
    # so training never runs out of fresh ones.
    limit = (10**task.digits) ** 2 * len(set(task.ops)) // 2
    check(1 <= task.heldout_size <= limit, f"{p}.heldout_size", f"in [1, {limit}] for {task.digits}-digit operands",
          task.heldout_size)


def _inert_arithmetic(cfg: Any) -> dict[str, str]:
    kind, out = cfg.task.kind, {}
    if kind != "arithmetic":
        out.update(dict.fromkeys([*PRETRAIN_FIELDS, "model.build_missing"],
                                 f"only task.kind 'arithmetic' builds its base model; with {kind!r} the checkpoint "
                                 "in model.base_dir is used as it is"))
    if kind == "arithmetic":
        out.update(dict.fromkeys(["task.template", "task.chat_template", "task.system_prompt", "task.answer_extract"],
                                 "the arithmetic task's prompts are fixed-width character strings and its answers "
                                 "their leading digits; only task.kind 'math' and 'reasoning_gym' build prompts from "
                                 "text and read answers from it"))
    elif builtin_task(kind):
        out.update(dict.fromkeys(["task.digits", "task.ops"],
                                 f"only task.kind 'arithmetic' generates problems; the task is {kind!r}"))
    return out


def _check_math(task: Any, p: str, check) -> None:
    _check_text_task(task, p, check)
    check(task.dataset.endswith((".jsonl", ".parquet")) and Path(task.dataset).is_file(), f"{p}.dataset",
          "an existing .jsonl or .parquet file", task.dataset)


def _inert_math(cfg: Any) -> dict[str, str]:
    kind = cfg.task.kind
    if kind == "math" or not builtin_task(kind):
        return {}
    return dict.fromkeys(["task.dataset", "task.prompt_field", "task.answer_field"],
                         f"only task.kind 'math' reads a dataset file; the task is {kind!r}")


def _check_reasoning_gym(task: Any, p: str, check) -> None:
    _check_text_task(task, p, check)
    task.dataset_specs(p)


def _inert_reasoning_gym(cfg: Any) -> dict[str, str]:
    kind = cfg.task.kind
    if kind == "reasoning_gym" or not builtin_task(kind):
        return {}
    return dict.fromkeys(["task.datasets", "task.dataset_params", "task.dataset_weights"],
                         f"only task.kind 'reasoning_gym' draws from reasoning-gym datasets; the task is {kind!r}")


def _check_code(task: Any, p: str, check) -> None:
    _check_text_task(task, p, check)
    limit = plugins.load("pipeline.tasks.code:heldout_limit")()  # half of each family's problems
    check(task.heldout_size <= limit, f"{p}.heldout_size", f"in [1, {limit}] for task.kind 'code'", task.heldout_size)


def _inert_code(cfg: Any) -> dict[str, str]:
    if cfg.task.kind != "code":
        return {}
    return {"task.answer_extract": "the code task reads a completion's code (its first fenced block, else all of "
                                   "it), not an answer"}


TASKS.register("arithmetic", "pipeline.tasks.arithmetic:ArithmeticTask", check=_check_arithmetic,
               inert=_inert_arithmetic, builtin=True, builds_base=True)
TASKS.register("math", "pipeline.tasks.math:MathTask", check=_check_math, inert=_inert_math, builtin=True)
TASKS.register("reasoning_gym", "pipeline.tasks.reasoning_gym:ReasoningGymTask", check=_check_reasoning_gym,
               inert=_inert_reasoning_gym, builtin=True, verifiers=("self_consistency", "states_answer", "answer_only"))
TASKS.register("code", "pipeline.tasks.code:CodeTask", check=_check_code, inert=_inert_code, builtin=True,
               test_references=True)
"""``verifiers``: the ensemble of a kind whose prompts the arithmetic checks cannot read, when
``verifier.verifiers`` is not set, each reading answers as ``task.answer_extract`` does
(``self_consistency:<extract>``, ...; pipeline/verifiers/kinds/answers.py). ``test_references``:
its references carry hidden tests (what ``env.kind = "code"`` runs)."""


def check_task(task: Any, p: str, check) -> None:
    """``task.kind``'s checks: a registered kind's own, else (code of the user's) those of every text task."""
    if task.kind in TASKS:
        TASKS.check(task.kind, task, p, check)
    else:
        _check_text_task(task, p, check)  # the task checks the rest of its fields itself, when it is built


# ----------------------------------------------------------------------------- advantages and losses

ADVANTAGES.register("grpo", "pipeline.algo.losses:grpo_advantage")
ADVANTAGES.register("drgrpo", "pipeline.algo.losses:drgrpo_advantage")
ADVANTAGES.register("reinforce_pp", "pipeline.algo.losses:reinforce_pp_advantage", batch=True)
"""``batch``: it sees the whole batch at once, ``[rewards [G_k] per group] -> advantages [N]``."""

LOSSES.register("decoupled_ppo", "pipeline.algo.losses:decoupled_ppo_loss", per_token=True, clips=True)
LOSSES.register("tis", "pipeline.algo.losses:truncated_is_loss", per_token=True, clips=False)
LOSSES.register("gspo", "pipeline.algo.losses:gspo_loss", per_token=True, clips=True)
"""``per_token``: its per-token terms are in ``losses.TOKEN_TERMS`` (every ``trainer.loss_agg``);
``clips``: it clips the ratio (reads ``trainer.clip_eps``)."""


# ----------------------------------------------------------------------------- weight transports


def _inert_ucx(cfg: Any) -> dict[str, str]:
    if cfg.weights.transport == "ucx":
        return {}
    return {"weights.ucx_tls": f"only weights.transport 'ucx' reads it; the transport is {cfg.weights.transport!r}"}


TRANSPORTS.register("shm", ("pipeline.weights.shm:ShmPublisher", "pipeline.weights.shm:ShmFetcher"), socket=False)
TRANSPORTS.register("tcp", ("pipeline.weights.tcp:TcpPublisher", "pipeline.weights.tcp:TcpFetcher"), socket=True,
                    needs=("zmq", "pyzmq", "`pip install pyzmq`"))
TRANSPORTS.register("ucx", ("pipeline.weights.ucx:UcxPublisher", "pipeline.weights.ucx:UcxFetcher"), socket=True,
                    inert=_inert_ucx, needs=("ucxx", "ucxx", "the 'ucx' extra: `pip install -e .[ucx]`"))
"""``socket``: it serves and fetches over a socket (reads ``weights.tcp_port``, ``fetch_timeout_s``);
``needs``: the optional package it imports, as (module, package, how to install it)."""


def missing_packages(cfg: Any) -> list[str]:
    """The optional package each component ``cfg`` picks needs and this environment lacks (found,
    not imported: no cost), each message naming the field, how to install it and the other choices."""
    problems = []
    for field, registry, value in (("weights.transport", TRANSPORTS, cfg.weights.transport),):
        needs = registry.meta(value, "needs")
        if needs and importlib.util.find_spec(needs[0]) is None:
            others = "|".join(n for n in registry if n != value)
            problems.append(f"{field}: {value!r} needs {needs[1]}, which is not installed in this environment "
                            f"({needs[2]}); or choose {others}")
    if cfg.trainer.archive and importlib.util.find_spec("pyarrow") is None:
        problems.append("trainer.archive: the rollout archive is written as Parquet and needs pyarrow, which is not "
                        "installed in this environment (pip install pyarrow==26.0.1, a dependency of the project); "
                        "or set trainer.archive false")
    return problems


# ----------------------------------------------------------------------------- environments


def env_name(kind: str) -> str:
    """The registry name an ``env.kind`` picks: ``textarena:<game>`` and ``openenv:<target>`` pick
    ``textarena`` and ``openenv``; anything else is a name or a plugin spec."""
    head = kind.partition(":")[0]
    return head if head in ENVS and ENVS.meta(head, "argument") else kind


def _check_openenv(cfg: Any, p: str, check) -> None:
    # the shapes pipeline.envs.openenv.split_kind accepts
    target = cfg.env.kind[len("openenv:"):].strip()
    urls = [u.strip() for u in target.split(",")]
    url = all(u.startswith(("http://", "https://")) and bool(u.split("://", 1)[1].strip("/")) for u in urls)
    check(url or plugins.is_spec(target), f"{p}.kind", "openenv:http://host:port (or several, comma-separated), "
          "openenv:module:app or openenv:path/to/file.py:app", cfg.env.kind)


MIX_PREFIX = "mix:"
MIX_FORM = "mix:<kind>=<weight>,<kind>=<weight>,... (two or more environments, positive weights)"


def parse_mix(kind: str) -> list[tuple[str, float]]:
    """The members of ``env.kind = "mix:calculator=3,textarena:GuessTheNumber-v0=1"``: (kind,
    weight) in order. Each member ends with ``=<weight>``; a part before a comma that has none
    belongs to the next (``openenv:http://a:1,http://b:2=1`` is one member with two URLs).
    ValueError saying what is wrong: fewer than two members, a weight that is not a positive
    number, a member named twice, a mixture inside a mixture."""
    body = kind[len(MIX_PREFIX):] if kind.startswith(MIX_PREFIX) else kind
    members: list[tuple[str, float]] = []
    pending: list[str] = []
    for part in body.split(","):
        pending.append(part)
        name, sep, weight = part.rpartition("=")
        if not sep:
            continue
        try:
            w = float(weight)
        except ValueError:
            continue  # an '=' inside the member (a URL's query): its weight comes later
        member = ",".join(pending[:-1] + [name]).strip()
        pending = []
        if not member:
            raise ValueError(f"a weight {weight!r} without an environment")
        if not (w > 0 and w != float("inf")):
            raise ValueError(f"{member!r}: weight {weight!r} is not a positive number")
        if member.startswith(MIX_PREFIX):
            raise ValueError(f"{member!r}: a mixture cannot hold a mixture")
        if any(m == member for m, _ in members):
            raise ValueError(f"{member!r} is named twice")
        members.append((member, w))
    if pending and ",".join(pending).strip():
        raise ValueError(f"{','.join(pending).strip()!r} does not end with =<weight> (a positive number)")
    if len(members) < 2:
        raise ValueError(f"{len(members)} environment(s); a mixture has two or more")
    return members


def member_config(cfg: Any, kind: str) -> Any:
    """``cfg`` with ``env.kind`` set to one member of a mixture (what its factory and checks read)."""
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, kind=kind))


def _check_mix(cfg: Any, p: str, check) -> None:
    try:
        members = parse_mix(cfg.env.kind)
    except ValueError as e:
        check(False, f"{p}.kind", f"{MIX_FORM}: {e}", cfg.env.kind)
        return
    for member, _ in members:  # each member checked as a single env.kind is
        check(ENVS.allows(env_name(member)), f"{p}.kind", f"mixture members among {ENVS.allowed()}", member)
        ENVS.check(env_name(member), member_config(cfg, member), p, check)


def _check_code_env(cfg: Any, p: str, check) -> None:
    kind = cfg.task.kind
    check(not builtin_task(kind) or bool(TASKS.meta(kind, "test_references")), f"{p}.kind",
          '"code" only with task.kind "code" (its references carry the hidden tests) or a task of your own '
          f"that writes such references; task.kind is {kind!r}", cfg.env.kind)


ENVS.register("calculator", "pipeline.envs.calculator:calculator")
ENVS.register("code", "pipeline.envs.code:code", check=_check_code_env)
ENVS.register("textarena", "pipeline.envs.textarena:textarena", argument="<game id>", bare=True)
ENVS.register("openenv", "pipeline.envs.openenv:openenv", argument="<url or app>", check=_check_openenv)
ENVS.register("mix", "pipeline.envs.registry:mixture", argument="<kind>=<weight>,...", check=_check_mix)
"""``argument``: the kind is followed by ``:<argument>`` (``openenv:<url or app>``); ``bare``: or
not (``textarena`` alone is a game of its choosing)."""


# ----------------------------------------------------------------------------- before launch


def component_problems(cfg: Any) -> list[str]:
    """Every component the config names by a plugin spec (a task kind, an advantage, a loss) must
    import and be callable, each message naming its field. A registered name is not imported
    here (no torch to load before launch): it was checked when the config was loaded."""
    problems = []
    for field, registry, value in (("task.kind", TASKS, cfg.task.kind),
                                   ("trainer.advantage", ADVANTAGES, cfg.trainer.advantage),
                                   ("trainer.loss", LOSSES, cfg.trainer.loss)):
        if value in registry:
            continue
        try:
            registry.get(value)
        except ValueError as e:
            problems.append(f"{field}: {e}")
    return problems
