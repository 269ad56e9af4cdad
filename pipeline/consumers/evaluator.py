"""Eval worker: held-out greedy accuracy and pass@k of the published versions, beside training.

``cluster.evaluators = 1`` starts one (``pipeline evaluate --worker-id eval-0`` on its own).
It fetches versions as a generator does (the run's weight transport, the same integrity
checks; with ``weights.payload = "adapter"`` it merges the adapters onto its base), and
evaluates the first version it finds, then the newest one once it is at least
``eval.every_versions`` past the last it evaluated: versions in between are skipped, so it
never falls behind by more than one evaluation however slow it is. Each evaluation is
``pipeline.observe.evaluate.evaluate_model`` (what ``pipeline eval`` runs on a checkpoint) on
``eval.max_prompts`` prompts of the task's held-out set, never a training item: greedy
accuracy, pass@k for each of ``eval.ks`` from ``eval.n`` samples at ``eval.temperature``
(seeded by ``eval.seed``, the same for every version), mean@n, and the same per source of a
task of several datasets (``by_source``).

Each result is a line of ``<run_dir>/evals.jsonl`` and a ``version_evaluated`` log line, and
the newest is in the worker's heartbeat (``pipeline top``). The worker runs under SCHED_IDLE
(``eval.sched_idle``; else at ``eval.nice``) with ``eval.threads`` torch threads, so on a
shared host it takes the CPU the stages leave rather than theirs. It holds no stream entry
and writes nothing the other stages read: killing it at any moment loses nothing but the
evaluation in progress.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from pipeline.bus.flow import stop_requested
from pipeline.bus.stats import heartbeat
from pipeline.config import RunConfig
from pipeline.keys import Keys
from pipeline.observe.evaluate import evaluate_model
from pipeline.observe.tracking import Trackers
from pipeline.tasks.prompting import build_prompt, prompt_format
from pipeline.tasks.registry import make_task
from pipeline.weights import WeightsError, fetcher_options, make_fetcher

EVALS_FILE = "evals.jsonl"
"""The eval worker's results, one line per evaluated version, in the run directory."""

WAIT_MS = 500
"""Longest wait for the next version announcement (``{ns}:versions``) before the loop looks
at its stop conditions again."""


def set_priority(sched_idle: bool, nice: int) -> str:
    """Lower this process's CPU priority (``eval.sched_idle``, ``eval.nice``); returns which was set."""
    if sched_idle and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return "SCHED_IDLE"
        except OSError:
            pass
    if nice:
        os.nice(nice)
    return f"nice +{nice}"


def set_problems(cfg: RunConfig, sets: dict, tokenizer) -> list[str]:
    """Why each eval set (``EvalConfig.task_sets``) cannot be evaluated by the model of
    ``model.base_dir``: its held-out set does not build, or its first prompt does not encode
    with ``tokenizer`` (what the worker checks when it starts, and ``pipeline up`` before launch)."""
    problems = []
    for name, task_cfg in sets.items():
        try:
            item = make_task(task_cfg).heldout()[0]
            build_prompt(prompt_format(task_cfg, cfg.model.base_dir), tokenizer, item.prompt)
        except Exception as err:  # noqa: BLE001 - any failure: the set cannot be evaluated by this model
            field = "eval.sets" if name != "heldout" else "task"
            problems.append(f"{field}: the held-out set {name!r} cannot be prompted to model.base_dir "
                            f"{str(cfg.model.base_dir)!r}: {type(err).__name__}: {err}")
    return problems


class Evaluator:
    """One eval worker: a policy model on the base, a weight fetcher, the results file."""

    def __init__(self, cfg: RunConfig, r, keys: Keys, worker_id: str, log) -> None:
        # Deferred: torch and the model (the worker's heavy libraries), loaded when one starts.
        import torch

        from pipeline.model.qwen import load_checkpoint

        e = cfg.eval
        self.cfg, self.r, self.keys, self.worker_id, self.log = cfg, r, keys, worker_id, log
        self.sched = set_priority(e.sched_idle, e.nice)
        torch.set_num_threads(e.threads)
        self.model, self.tokenizer = load_checkpoint(cfg.model.base_dir)
        self.model.eval()
        self.adapters = None
        if cfg.weights.payload == "adapter":
            from pipeline.engines.lora import AdapterMerger  # deferred: torch

            self.adapters = AdapterMerger.of_model(self.model, cfg.trainer.lora_alpha / cfg.trainer.lora_rank)
        self.sets = e.task_sets(cfg.task)
        self._check_sets()
        self.fetcher = make_fetcher(cfg.weights.transport, r, keys.weights, **fetcher_options(cfg.weights))
        self.trackers = None
        backends = [b for b in cfg.tracking.backends if b == "tensorboard"]  # W&B: the trainer's run alone
        if backends:
            self.trackers = Trackers(cfg.replace("tracking.backends", ",".join(backends)), cfg.run_dir, log)
        self.path = cfg.run_dir / EVALS_FILE
        self.last: int | None = None
        self.done = 0
        newest = r.xrevrange(keys.versions, count=1)
        self._seen = newest[0][0] if newest else "0-0"
        """The id of the newest version announcement looked at."""

    def _check_sets(self) -> None:
        """Every set's first prompt builds with this model's tokenizer (before any version comes)."""
        problems = set_problems(self.cfg, self.sets, self.tokenizer)
        if problems:
            raise ValueError(problems[0])

    def wait(self) -> None:
        """Until the trainer announces a version after the last one looked at (at most ``WAIT_MS``)."""
        got = self.r.xread({self.keys.versions: self._seen}, block=WAIT_MS)
        if got:
            self._seen = got[0][1][-1][0]

    def due(self, latest: int) -> bool:
        """Whether ``latest`` (the newest published version, -1: none yet) is to be evaluated."""
        if latest < 0:
            return False
        return self.last is None or latest - self.last >= self.cfg.eval.every_versions

    def load(self, version: int) -> int:
        """Fetch ``version`` into the model; returns the version loaded (WeightsError/ValueError
        when it cannot be had or does not fit: the caller tries a newer one later)."""
        from pipeline.model.qwen import load_state_tensors  # deferred: torch

        got, tensors = self.fetcher.fetch(version, copy=False)
        if self.adapters is not None:
            self.adapters.load(tensors)
        else:
            load_state_tensors(self.model, tensors)
        return got

    def evaluate(self, version: int) -> list[dict[str, Any]]:
        """One row per eval set (``heldout`` first), each appended to the results file."""
        e = self.cfg.eval
        rows = []
        for name, task in self.sets.items():
            t0 = time.perf_counter()
            out = evaluate_model(self.cfg, self.model, self.tokenizer, self.cfg.model.base_dir, n=e.n, ks=e.ks,
                                 temperature=e.temperature, max_prompts=e.max_prompts, seed=e.seed, task_cfg=task)
            out.pop("per_prompt")
            row = {"version": version, "set": name, "at": round(time.time(), 3),
                   "seconds": round(time.perf_counter() - t0, 3),
                   **{k: out[k] for k in ("task", "prompts", "greedy_accuracy", "greedy_stderr", "pass_at_k",
                                          "mean_at_n", "n", "temperature", "seed")}}
            if "by_source" in out:
                row["by_source"] = {src: {k: f[k] for k in ("prompts", "greedy_accuracy", "pass_at_k", "mean_at_n")}
                                    for src, f in out["by_source"].items()}
            rows.append(row)
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            if self.trackers is not None:
                self.trackers.write(f"evaluator/{name}", tracked(row))
        return rows

    def turn(self) -> bool:
        """Evaluate the newest version if it is due; returns whether it evaluated one."""
        latest = -1
        try:
            latest = self.fetcher.latest_version()
            if not self.due(latest):
                return False
            version = self.load(latest)
        except (WeightsError, ValueError) as err:
            self.log.warning("eval_fetch_failed", version=latest, error=str(err))
            return False
        self.heartbeat("evaluating", version=version)
        rows = self.evaluate(version)
        self.last, self.done = version, self.done + 1
        for row in rows:
            self.log.info("version_evaluated", **{k: v for k, v in row.items() if k != "by_source"})
        self.heartbeat("idle", version=version, greedy_accuracy=rows[0]["greedy_accuracy"],
                       pass_at_k=rows[0]["pass_at_k"])
        return True

    def heartbeat(self, state: str, **extra) -> None:
        heartbeat(self.r, self.keys, self.worker_id, "evaluator", state, evaluated=self.done, **extra)

    def close(self) -> None:
        self.fetcher.close()
        if self.trackers is not None:
            self.trackers.close()


def tracked(row: dict[str, Any]) -> dict[str, Any]:
    """A result row as tracker scalars at its version: greedy accuracy, mean@n, each pass@k
    (``pass@k``) and each source's greedy accuracy (``<source>/greedy_accuracy``)."""
    out: dict[str, Any] = {"version": row["version"], "greedy_accuracy": row["greedy_accuracy"],
                           "mean_at_n": row["mean_at_n"], "seconds": row["seconds"],
                           **{f"pass@{k}": v for k, v in row["pass_at_k"].items()}}
    for src, f in row.get("by_source", {}).items():
        out[f"{src}/greedy_accuracy"] = f["greedy_accuracy"]
    return out


def run_evaluator(cfg: RunConfig, r, keys: Keys, worker_id: str, log, *, max_evals: int | None = None) -> int:
    """Evaluate versions until stopped (or ``max_evals`` evaluations); returns how many."""
    ev = Evaluator(cfg, r, keys, worker_id, log)
    log.info("evaluator_started", every_versions=cfg.eval.every_versions, prompts=cfg.eval.max_prompts,
             n=cfg.eval.n, ks=list(cfg.eval.ks), sets=list(ev.sets), priority=ev.sched, results=str(ev.path))
    try:
        while not stop_requested(r, keys) and (max_evals is None or ev.done < max_evals):
            if not ev.turn():
                ev.heartbeat("idle")
                ev.wait()
    finally:
        ev.close()
    log.info("evaluator_stopped", evaluated=ev.done)
    return ev.done


def read_evals(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``evals.jsonl`` (a torn last line, from a kill mid-write, left out)."""
    rows = []
    try:
        lines = (Path(run_dir) / EVALS_FILE).read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows
