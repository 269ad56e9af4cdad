"""REINFORCE++ with a truncated importance weight: examples/grpo_loop.py with its two algorithm lines changed.

The same two loops (the rollout loop, the bookkeeping and the flags are grpo_loop.py's);
only the objective differs, written with the package's own functions
(pipeline/algo/losses.py):

- the advantage: each completion's reward minus its group's mean, then the whole batch
  divided by the batch's standard deviation (REINFORCE++, ``reinforce_pp_advantage``),
  where GRPO divides each group by its own;
- the loss: the policy gradient −w·A·log π_θ with w = min(π_θ/π_behav, is_cap), the
  behaviour weight truncated (``truncated_is_loss``), no ratio clip.

    .venv/bin/python examples/reinforce_loop.py --steps 20

Any flag of examples/grpo_loop.py works here too (``--config``, ``--save DIR``, config fields).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # grpo_loop.py beside this file

from grpo_loop import begin, end_step, main, next_batch  # noqa: E402

from pipeline.algo.losses import LossSettings, reinforce_pp_advantage, truncated_is_loss  # noqa: E402
from pipeline.api import Learner, Run  # noqa: E402


def training_loop(run: Run, learner: Learner, steps: int, counts: dict, rollouts: threading.Thread) -> dict:
    """Get B scored groups, REINFORCE++ advantages, a truncated-IS policy gradient, one step, ack, publish."""
    scored, B = run.queue("scored"), run.cfg.trainer.groups_per_step
    settings = LossSettings.from_config(run.cfg.trainer)  # the importance-weight cap
    evals = begin(learner)
    while learner.version < steps:
        got = next_batch(scored, B, rollouts)
        batch = learner.batch([g for _, g in got])  # stale groups dropped, no-signal ones set aside, padded
        loss = stats = None
        if batch.size:
            adv = reinforce_pp_advantage(batch.rewards)  # the advantage: r - group mean, over the batch's std
            logp = learner.logprobs(batch)  # [N, T] log π_θ of the sampled tokens, with grad
            loss, stats = truncated_is_loss(logp, logp.detach(), batch.behav_logp, adv, batch.mask, settings)  # the loss
        row = learner.update(batch, loss, stats)  # backward, clip, AdamW; version + 1
        end_step(run, learner, scored, got, row, counts, evals, steps)
    return evals


if __name__ == "__main__":
    sys.exit(0 if main(training=training_loop)["consistent"] else 1)
