"""GRPO as two short loops on the public API (pipeline/api.py, docs/api.md).

A rollout loop (a thread): sync the newest weights → take prompts from the task → sample G
completions each → score them (weak verifiers + Weaver) → put the scored groups in the queue.
A training loop: get B scored groups → advantages → loss → one optimizer step → ack →
publish → evaluate every ``trainer.eval_every`` steps. The advantage and the loss are the
two marked lines of ``training_loop``, written with the package's own functions
(pipeline/algo/losses.py): edit them and the run trains something else
(examples/reinforce_loop.py is one such edit). Everything else (server, streams, engines,
weight transport) is the pipeline's own, behind ``Run``.

Run it on the embedded default config (arithmetic task, the shipped base model in
artifacts/base-model, installed or built by ``pipeline pretrain`` when missing):

    .venv/bin/python examples/grpo_loop.py --steps 20

Any config field is a flag too, as for ``pipeline up``:

    .venv/bin/python examples/grpo_loop.py --steps 3 --config configs/tiny.toml --model.base_dir DIR

``--save DIR`` writes the final policy as a checkpoint (``pipeline eval --checkpoint DIR``).
The loop trains with the torch engine (``trainer.backend``); the config's objective fields
(``trainer.advantage``, ``trainer.loss``, PPO epochs, KL) are not read: the file is the algorithm.
``LossSettings`` still carries the clip and importance-weight settings the loss functions take.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402

from pipeline.algo.losses import LossSettings, decoupled_ppo_loss, grpo_advantage  # noqa: E402
from pipeline.api import Learner, Run  # noqa: E402


def rollout_loop(run: Run, done: threading.Event, counts: dict) -> None:
    """Sync weights, generate, score, put into the scored queue; stay at most B groups ahead."""
    policy, verifiers, scored = run.policy("gen-0"), run.verifiers("ver-0"), run.queue("scored")
    items = run.task.training(run.cfg.feeder.seed)
    per_batch, bound = run.cfg.generator.prompts_per_batch, run.cfg.trainer.groups_per_step
    while not done.is_set() and not run.stopped():
        if scored.depth() >= bound:  # backpressure keeps the groups fresh (staleness ≤ η)
            time.sleep(0.02)
            continue
        policy.sync()
        groups = policy.generate(list(itertools.islice(items, per_batch)))
        counts["put"] += scored.put(verifiers.score(groups))


def next_batch(scored, n: int, rollouts: threading.Thread) -> list:
    """``n`` (entry, scored group) pairs from the queue, waiting for the rollout loop."""
    got = []
    while len(got) < n:
        if not rollouts.is_alive():
            raise RuntimeError("the rollout loop died (its error is above)")
        got += scored.get(n - len(got), consumer="learner", block_ms=200)
    return got


def training_loop(run: Run, learner: Learner, steps: int, counts: dict, rollouts: threading.Thread) -> dict:
    """Get B scored groups, GRPO advantages and loss, one step, ack, publish; evaluate every ``trainer.eval_every`` steps."""
    scored, B = run.queue("scored"), run.cfg.trainer.groups_per_step
    settings = LossSettings.from_config(run.cfg.trainer)  # clip ε, importance-weight cap
    evals = begin(learner)
    while learner.version < steps:
        got = next_batch(scored, B, rollouts)
        batch = learner.batch([g for _, g in got])  # stale groups dropped, no-signal ones set aside, padded
        loss = stats = None
        if batch.size:
            adv = torch.cat([grpo_advantage(r) for r in batch.rewards])  # the advantage: (r - mean) / std per group
            logp = learner.logprobs(batch)  # [N, T] log π_θ of the sampled tokens, with grad
            loss, stats = decoupled_ppo_loss(logp, logp.detach(), batch.behav_logp, adv, batch.mask, settings)  # the loss
        row = learner.update(batch, loss, stats)  # backward, clip, AdamW; version + 1
        end_step(run, learner, scored, got, row, counts, evals, steps)
    return evals


def begin(learner: Learner) -> dict:
    """Publish version 0 (the generators start from it) and evaluate it: {version: held-out accuracy}."""
    learner.publish()
    evals = {0: learner.evaluate()}
    print(f"base held-out accuracy {evals[0]:.3f}", flush=True)
    return evals


def end_step(run: Run, learner: Learner, scored, got: list, row: dict, counts: dict, evals: dict, steps: int) -> None:
    """Ack the step's groups, count them, publish the new version, evaluate every ``trainer.eval_every`` steps."""
    counts["got"] += len(got)
    counts["acked"] += scored.ack([e for e, _ in got])
    counts["trained"] += row["groups_trained"]
    counts["nosignal"] += row["groups_nosignal"]
    counts["stale"] += row["groups_stale"]
    learner.publish()
    print(f"step {learner.version}: reward {row['reward_mean']:.3f} sample accuracy {row['sample_accuracy']:.3f} "
          f"trained {row['groups_trained']}/{len(got)} (stale {row['groups_stale']})", flush=True)
    if learner.version % run.cfg.trainer.eval_every == 0 or learner.version == steps:
        evals[learner.version] = learner.evaluate()
        print(f"step {learner.version}: held-out accuracy {evals[learner.version]:.3f}", flush=True)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Any config field can be set as --section.field VALUE.")
    p.add_argument("--steps", type=int, default=20, help="training steps (trainer.steps); default 20")
    p.add_argument("--config", help="TOML config file (default: the embedded defaults)")
    p.add_argument("--save", metavar="DIR", help="write the final policy as a checkpoint to DIR")
    args, rest = p.parse_known_args(argv)
    overrides, i = {}, 0
    while i < len(rest):
        name, eq, value = rest[i].removeprefix("--").partition("=")
        if not rest[i].startswith("--") or (not eq and i + 1 >= len(rest)):
            p.error(f"unexpected argument {rest[i]!r}; config overrides look like --trainer.lr 3e-4")
        if not eq:
            value, i = rest[i + 1], i + 1
        overrides[name], i = value, i + 1
    return args, {**overrides, "trainer.steps": args.steps}


def main(argv: list[str] | None = None, training=training_loop) -> dict:
    """Both loops on one run; ``training`` is the training loop (another example passes its own)."""
    args, overrides = parse(argv)
    counts = dict(put=0, got=0, acked=0, trained=0, nosignal=0, stale=0)
    with Run(config=args.config, overrides=overrides) as run:
        print(f"run {run.cfg.run_id}: redis {run.cfg.redis.url}, {args.steps} steps of "
              f"{run.cfg.trainer.groups_per_step} groups x {run.cfg.generator.group_size}", flush=True)
        done = threading.Event()
        rollouts = threading.Thread(target=rollout_loop, args=(run, done, counts), name="rollouts", daemon=True)
        rollouts.start()
        try:
            learner = run.learner()
            evals = training(run, learner, args.steps, counts, rollouts)
            if args.save:
                learner.save(args.save)
        finally:
            done.set()
            rollouts.join(timeout=120)
        counts["left_in_queue"] = run.queue("scored").depth()
        summary = {"run_id": run.cfg.run_id, "steps": args.steps, "evals": evals, "counts": counts,
                   "consistent": counts["got"] == counts["acked"] == counts["trained"] + counts["nosignal"]
                   + counts["stale"] and counts["put"] == counts["got"] + counts["left_in_queue"]}
        (run.cfg.run_dir / "api_summary.json").write_text(json.dumps(summary, indent=1))
    print(f"held-out accuracy: base {evals[0]:.3f} -> final {evals[max(evals)]:.3f}; groups {counts}", flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["consistent"] else 1)
