"""``pipeline eval``: a checkpoint's held-out greedy accuracy, pass@k and mean@n.

The items are the task's held-out set, the same ones the trainer's evaluation reads
(``Task.heldout()``, never a training item), and each prompt is built by
``pipeline.tasks.prompting.build_prompt`` as the trainer builds it. Two passes:

greedy      one greedy completion per prompt (``greedy_decode``, in the trainer's batches),
            judged by ``Task.correctness``: the completions and verdicts behind the
            trainer's ``heldout_accuracy`` of the same checkpoint.
sampled     ``n`` completions per prompt at ``temperature`` with the torch sampler
            (``sample_prompts``), ``batch_size`` prompts per sampler call, from one
            ``torch.Generator`` seeded with ``seed``: the same seed and batch size give the
            same figures. With ``c`` of a prompt's ``n`` samples right, its pass@k is the
            unbiased estimator of Chen et al. (2021), ``1 - C(n-c, k) / C(n, k)``: the chance
            that k of its n samples, drawn without replacement, hold a right one. The
            reported pass@k is its mean over the prompts; mean@n is the mean accuracy of all
            samples (pass@1 and mean@n are the same number).

A checkpoint is an HF directory (``config.json``, safetensors, tokenizer files: a run's
``checkpoints/final``, ``artifacts/base-model``) or a trainer's resumable checkpoint
(``checkpoints/step-NNNNNN``: weights under their HF names beside ``state.json``), whose
architecture and tokenizer come from ``model.base_dir``.
"""

from __future__ import annotations

import inspect
import json
import math
import shlex
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

from pipeline.observe.logs import setup_logging
from pipeline.tasks.prompting import build_prompt, prompt_format
from pipeline.tasks.registry import make_task

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from pipeline.tasks.base import Item

DEFAULT_N = 8
DEFAULT_KS = (1, 4, 8)
DEFAULT_BATCH_SIZE = 64
"""Prompts per sampler call (each sampled ``n`` times)."""

Progress = Callable[[str, int, int], None]
"""``progress(phase, prompts_done, prompts_total)``, phase ``greedy`` or ``sampled``."""


# ----------------------------------------------------------------------------- the estimator


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` right among ``n`` samples: ``1 - C(n-c, k) / C(n, k)``.

    Exact integer binomials (Python's ``math.comb``), one rounding at the division.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c must be in [0, n={n}]; got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k must be in [1, n={n}]; got {k}")
    if n - c < k:  # every k-subset holds a right sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# ----------------------------------------------------------------------------- settings


def parse_ks(text: str) -> tuple[int, ...]:
    """``"1,4,8"`` -> ``(1, 4, 8)``; ValueError naming ``--k`` on anything else."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        ks = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--k: a comma-separated list of integers such as 1,4,8; got {text!r}") from None
    if not ks:
        raise ValueError(f"--k: a comma-separated list of integers such as 1,4,8; got {text!r}")
    return ks


def check_settings(*, n: int, ks: Sequence[int], temperature: float, max_prompts: int = 0,
                   batch_size: int = DEFAULT_BATCH_SIZE, max_new_tokens: int | None = None) -> tuple[int, ...]:
    """The sorted, distinct ``ks``; ValueError naming the flag of the first bad setting."""
    if n < 1:
        raise ValueError(f"--n: samples per prompt must be >= 1; got {n}")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"--k: each k must be in [1, --n={n}] (pass@k needs at least k samples per prompt); "
                         f"got {','.join(map(str, ks))}")
    if not ks:
        raise ValueError("--k: at least one k")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"--temperature: must be > 0 (the greedy accuracy is reported on its own); got {temperature}")
    if max_prompts < 0:
        raise ValueError(f"--max-prompts: must be >= 0 (0: the whole held-out set); got {max_prompts}")
    if batch_size < 1:
        raise ValueError(f"--batch-size: must be >= 1; got {batch_size}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: must be >= 1; got {max_new_tokens}")
    return tuple(sorted(set(ks)))


def checkpoint_kind(checkpoint: str | Path) -> str:
    """``hf`` (an HF directory) or ``trainer`` (a resumable step checkpoint); ValueError naming
    ``--checkpoint`` for anything else, saying what it found."""
    d = Path(checkpoint)
    if not d.is_dir():
        raise ValueError(f"--checkpoint: {str(d)!r} is not a directory")
    weights = (d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file()
    if weights and (d / "config.json").is_file():
        return "hf"
    if (d / "model.safetensors").is_file() and (d / "state.json").is_file():
        return "trainer"
    if (d / "checkpoints" / "final").is_dir():
        raise ValueError(f"--checkpoint: {str(d)!r} is a run directory; its trained policy is "
                         f"{str(d / 'checkpoints' / 'final')!r}")
    if (d / "state.json").is_file():
        raise ValueError(f"--checkpoint: {str(d)!r} is a trainer checkpoint without model.safetensors "
                         "(a sharded torchtitan one?); evaluate the run's checkpoints/final")
    raise ValueError(f"--checkpoint: {str(d)!r} holds no checkpoint (config.json and model.safetensors, "
                     "or a trainer's model.safetensors and state.json)")


# ----------------------------------------------------------------------------- helpers


def limit_items(items: list[Item], max_prompts: int) -> list[Item]:
    """The first ``max_prompts`` items (0: all). Items from several sources (reasoning-gym
    datasets, each a block of the held-out list) are taken in turn from each source, so a
    cap keeps every source; the items keep their held-out order."""
    if max_prompts <= 0 or max_prompts >= len(items):
        return list(items)
    by: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        by.setdefault(item.source, []).append(i)
    queues, keep = [list(reversed(v)) for v in by.values()], []
    while len(keep) < max_prompts:
        for q in queues:
            if q and len(keep) < max_prompts:
                keep.append(q.pop())
    return [items[i] for i in sorted(keep)]


def run_of(checkpoint: str | Path) -> Path | None:
    """The run directory a checkpoint lies in (``<run>/checkpoints/<name>`` beside
    ``<run>/config.toml``), or None."""
    d = Path(checkpoint).resolve()
    run = d.parent.parent
    return run if d.parent.name == "checkpoints" and (run / "config.toml").is_file() else None


def load_policy(checkpoint: str | Path, base_dir: str | Path):
    """``(model, tokenizer, tokenizer_dir)`` of a checkpoint (``checkpoint_kind``), in eval mode."""
    from pipeline.model.qwen import load_checkpoint, load_state_tensors

    d = Path(checkpoint)
    if checkpoint_kind(d) == "hf":
        model, tokenizer = load_checkpoint(d)
        return model, tokenizer, d
    from safetensors.torch import load_file

    model, tokenizer = load_checkpoint(base_dir)
    try:
        load_state_tensors(model, load_file(str(d / "model.safetensors")))
    except ValueError as e:
        raise ValueError(f"--checkpoint: the weights of {str(d)!r} do not fit model.base_dir "
                         f"{str(base_dir)!r} (pass the run's --config): {e}") from None
    model.eval()
    return model, tokenizer, Path(base_dir)


def task_differences(run_config: Path, cfg: RunConfig) -> list[str]:
    """The ``task.*`` fields a run's ``config.toml`` sets otherwise than ``cfg`` (empty when it
    cannot be read)."""
    try:
        trained = tomllib.loads(Path(run_config).read_text()).get("task", {})
    except (OSError, tomllib.TOMLDecodeError):
        return []
    ours = asdict(cfg.task)

    def norm(v: Any) -> Any:
        return tuple(v) if isinstance(v, (list, tuple)) else v

    return [f"task.{k}" for k, v in trained.items() if k in ours and norm(v) != norm(ours[k])]


def _greedy_batch() -> int:
    """The batch ``greedy_decode`` runs the trainer's held-out set in (its default)."""
    from pipeline.engines.torch import greedy_decode

    return int(inspect.signature(greedy_decode).parameters["batch_size"].default)


def _stderr(p: float, count: int) -> float:
    return math.sqrt(p * (1.0 - p) / count) if count else float("nan")


def _figures(greedy: Sequence[float], counts: Sequence[int], n: int, ks: Sequence[int]) -> dict[str, Any]:
    prompts = len(counts)
    g = sum(greedy) / prompts
    mean = sum(counts) / (prompts * n)
    return {"prompts": prompts, "greedy_accuracy": g, "greedy_stderr": _stderr(g, prompts), "mean_at_n": mean,
            "pass_at_k": {str(k): sum(pass_at_k(n, c, k) for c in counts) / prompts for k in ks}}


# ----------------------------------------------------------------------------- evaluation


def evaluate(cfg: RunConfig, checkpoint: str | Path, *, n: int = DEFAULT_N, ks: Sequence[int] = DEFAULT_KS,
             temperature: float = 1.0, max_prompts: int = 0, seed: int = 0, batch_size: int = DEFAULT_BATCH_SIZE,
             max_new_tokens: int | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Greedy accuracy, pass@k for each of ``ks`` and mean@n of ``checkpoint`` on the held-out
    set of ``cfg.task`` (its first ``max_prompts`` items; 0: all): ``evaluate_model`` on the
    checkpoint's weights, with the checkpoint and its load time added."""
    ks = check_settings(n=n, ks=ks, temperature=temperature, max_prompts=max_prompts, batch_size=batch_size,
                        max_new_tokens=max_new_tokens)
    checkpoint_kind(checkpoint)
    import torch

    # One thread unless configured: torch's default (every core) spins against whatever else
    # runs there; on a busy 2-core machine SmolLM2's evaluation took minutes instead of seconds.
    torch.set_num_threads(cfg.eval.threads)
    t0 = time.perf_counter()
    model, tokenizer, tokenizer_dir = load_policy(checkpoint, cfg.model.base_dir)
    t_load = time.perf_counter() - t0
    out = evaluate_model(cfg, model, tokenizer, tokenizer_dir, n=n, ks=ks, temperature=temperature,
                         max_prompts=max_prompts, seed=seed, batch_size=batch_size, max_new_tokens=max_new_tokens,
                         progress=progress)
    out["seconds"] = {"load": round(t_load, 3), **out["seconds"]}
    return {"checkpoint": str(checkpoint), **out}


def evaluate_model(cfg: RunConfig, model, tokenizer, tokenizer_dir: str | Path, *, n: int = DEFAULT_N,
                   ks: Sequence[int] = DEFAULT_KS, temperature: float = 1.0, max_prompts: int = 0, seed: int = 0,
                   batch_size: int = DEFAULT_BATCH_SIZE, max_new_tokens: int | None = None,
                   progress: Progress | None = None, task_cfg=None) -> dict[str, Any]:
    """The figures of a loaded policy (``model``, in eval mode) on the held-out set of ``cfg.task``
    (or of ``task_cfg``, a [task] section of another task: an ``eval.sets`` entry).

    ``max_new_tokens`` (default: the task's ``eval_max_new_tokens``, the trainer's greedy
    budget) bounds greedy and sampled completions alike. The result holds the figures,
    overall and per ``Item.source`` (``by_source``, when the items have sources), the
    settings, timings, and per prompt (``per_prompt``) the greedy completion, its verdict and
    the count of right samples.
    """
    task_cfg = cfg.task if task_cfg is None else task_cfg
    task = make_task(task_cfg)
    heldout = task.heldout()
    items = limit_items(heldout, max_prompts)
    budget = max_new_tokens or task.eval_max_new_tokens

    import torch

    from pipeline.engines.torch import by_length, greedy_decode, sample_prompts
    fmt = prompt_format(task_cfg, tokenizer_dir)
    ids = [build_prompt(fmt, tokenizer, item.prompt)[1] for item in items]
    total = len(items)
    report = progress or (lambda phase, done, count: None)

    # Both passes run the batches the trainer's greedy_decode and sample_prompts run (each chunk's
    # prompts of one length together, in the same order, so the same rng draws), one batch per
    # call, so progress comes after each batch.
    t0 = time.perf_counter()
    greedy: list[float] = [0.0] * total
    completions: list[str] = [""] * total
    step, done = _greedy_batch(), 0
    report("greedy", 0, total)
    for start in range(0, total, step):
        for idx in by_length(ids[start: start + step]).values():
            rows = [start + i for i in idx]
            answers = greedy_decode(model, tokenizer, [ids[i] for i in rows], max_new_tokens=budget)
            for i, a in zip(rows, answers):
                greedy[i], completions[i] = float(task.correctness(items[i].reference, [a])[0]), a
            done += len(rows)
            report("greedy", done, total)
    t_greedy = time.perf_counter() - t0

    t0 = time.perf_counter()
    rng = torch.Generator().manual_seed(seed)
    counts: list[int] = [0] * total
    done = 0
    report("sampled", 0, total)
    for start in range(0, total, batch_size):
        for idx in by_length(ids[start: start + batch_size]).values():
            rows = [start + i for i in idx]
            sampled = sample_prompts(model, [ids[i] for i in rows], n=n, max_new_tokens=budget,
                                     temperature=temperature, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                                     generator=rng)
            for i, s in zip(rows, sampled):
                texts = [tokenizer.decode(s.tokens[j, : s.lengths[j]].tolist()) for j in range(n)]
                counts[i] = int(np.count_nonzero(task.correctness(items[i].reference, texts) > 0.5))
            done += len(rows)
            report("sampled", done, total)
    t_sample = time.perf_counter() - t0

    out: dict[str, Any] = {
        "task": task_cfg.kind,
        "heldout_total": len(heldout),
        **_figures(greedy, counts, n, ks),
        "n": n, "ks": list(ks), "temperature": temperature, "seed": seed, "batch_size": batch_size,
        "max_new_tokens": budget,
        "seconds": {"greedy": round(t_greedy, 3), "sampled": round(t_sample, 3)},
    }
    sources = [item.source for item in items]
    if any(sources):
        out["by_source"] = {
            name: _figures([g for g, s in zip(greedy, sources) if s == name],
                           [c for c, s in zip(counts, sources) if s == name], n, ks)
            for name in dict.fromkeys(sources)}
    out["per_prompt"] = {"greedy_correct": [int(g) for g in greedy], "greedy_completions": completions,
                         "correct_samples": counts}
    return out


# ----------------------------------------------------------------------------- the command


def summary_line(result: dict[str, Any]) -> str:
    """One human line of the figures."""
    ks = "  ".join(f"pass@{k} {v:.3f}" for k, v in result["pass_at_k"].items())
    return (f"eval: {result['prompts']} held-out prompts: greedy {result['greedy_accuracy']:.3f} "
            f"(±{result['greedy_stderr']:.3f})  {ks}  mean@{result['n']} {result['mean_at_n']:.3f}  "
            f"(T={result['temperature']:g}, seed {result['seed']})")


class ProgressPrinter:
    """Progress on stderr: a rich bar per phase on a terminal, else a line per update.
    ``close()`` ends the bar (also when the evaluation raised)."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.bar = None
        self.tasks: dict[str, Any] = {}
        if self.stream.isatty():
            self.bar = Bar(TextColumn("[bold]eval {task.description}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("prompts"), TimeElapsedColumn(), console=Console(file=self.stream))

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.bar is None:
            print(f"eval {phase}: {done}/{total} prompts", file=self.stream, flush=True)
            return
        if phase not in self.tasks:
            if not self.tasks:
                self.bar.start()
            self.tasks[phase] = self.bar.add_task(phase, total=total)
        self.bar.update(self.tasks[phase], completed=done)

    def close(self) -> None:
        if self.bar is not None and self.tasks:
            self.bar.stop()


def eval_logger(checkpoint: str | Path, cfg: RunConfig):
    """``(logger, where)``: a structlog logger writing JSON lines to the checkpoint's run's
    ``logs/eval.jsonl`` (or ``<runs_dir>/<run_id>/logs`` with ``--run-id``), else to stderr."""
    run = run_of(checkpoint) or (cfg.run_dir if cfg.run_id else None)
    if run is not None:
        return setup_logging(Path(run) / "logs", stage="eval", worker="eval"), str(Path(run) / "logs" / "eval.jsonl")
    structlog.configure(processors=[structlog.processors.add_log_level,
                                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                                    structlog.processors.JSONRenderer(default=str)],
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr), cache_logger_on_first_use=False)
    return structlog.get_logger().bind(stage="eval", worker="eval"), "stderr"


def run_eval(cfg: RunConfig, *, checkpoint: str, n: int, ks: str | None, temperature: float | None, max_prompts: int,
             seed: int, batch_size: int, max_new_tokens: int | None, out: str | None,
             argv: Sequence[str]) -> dict[str, Any]:
    """What ``pipeline eval`` does: check every setting (before any model loads; ``ks`` None:
    those of ``DEFAULT_KS`` up to ``n``), evaluate with
    progress on stderr, log one ``checkpoint_evaluated`` line, write ``out`` (JSON: the
    figures, the command, the task config). Returns the result without its per-prompt lists."""
    temperature = cfg.generator.temperature if temperature is None else temperature
    chosen = parse_ks(ks) if ks is not None else tuple(k for k in DEFAULT_KS if k <= n) or (1,)
    k_list = check_settings(n=n, ks=chosen, temperature=temperature, max_prompts=max_prompts,
                            batch_size=batch_size, max_new_tokens=max_new_tokens)
    checkpoint_kind(checkpoint)
    if out and not Path(out).resolve().parent.is_dir():
        raise ValueError(f"--out: the directory of {out!r} does not exist")
    run = run_of(checkpoint)
    differ = task_differences(run / "config.toml", cfg) if run is not None else []
    if differ:
        print(f"eval: note: the run trained with other task fields ({', '.join(differ)}; {run / 'config.toml'}); "
              f"pass --config {run / 'config.toml'} to evaluate on that run's held-out set", file=sys.stderr)
    progress = ProgressPrinter()
    try:
        result = evaluate(cfg, checkpoint, n=n, ks=k_list, temperature=temperature, max_prompts=max_prompts,
                          seed=seed, batch_size=batch_size, max_new_tokens=max_new_tokens, progress=progress)
    finally:
        progress.close()
    result["command"] = shlex.join(["pipeline", *argv])
    result["task_config"] = asdict(cfg.task)
    per_prompt = result.pop("per_prompt")
    log, where = eval_logger(checkpoint, cfg)
    log.info("checkpoint_evaluated", checkpoint=result["checkpoint"], task=result["task"], prompts=result["prompts"],
             greedy_accuracy=result["greedy_accuracy"], mean_at_n=result["mean_at_n"],
             pass_at_k=result["pass_at_k"], n=n, temperature=temperature, seed=seed, out=out)
    if out:
        Path(out).write_text(json.dumps({**result, "per_prompt": per_prompt}, indent=2) + "\n")
    print(summary_line(result) + (f"; wrote {out}" if out else "") + ("" if where == "stderr" else f"; log {where}"),
          file=sys.stderr)
    return result
