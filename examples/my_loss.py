"""A loss variant of one's own: the built-in decoupled PPO objective, averaged per sequence
first (every completion weighs the same, whatever its length) instead of per token.

Signature (docs/extending.md, as pipeline/algo/losses.py's): ``fn(logp, prox_logp, behav_logp,
adv, mask, settings) -> (loss, stats)``; tensors are [N, T] (``adv`` [N]), ``mask`` 1 on
completion tokens.

    pipeline up --config configs/tiny.toml --trainer.steps 4 --trainer.loss examples/my_loss.py:sequence_mean_ppo
"""

from __future__ import annotations

import torch

from pipeline.algo.losses import LOSSES


def sequence_mean_ppo(logp, prox_logp, behav_logp, adv, mask, s):
    _, stats = LOSSES["decoupled_ppo"](logp, prox_logp, behav_logp, adv, mask, s)
    a = adv[:, None]
    ratio = torch.exp(logp - prox_logp.detach())
    high = s.clip_eps_high or s.clip_eps
    clipped = torch.clamp(ratio, 1 - s.clip_eps, 1 + high)
    weight = torch.exp(prox_logp - behav_logp).detach().clamp(max=s.is_cap)
    per_token = -weight * torch.minimum(ratio * a, clipped * a) * mask
    per_seq = per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_seq.mean(), {**stats, "seq_mean_loss": float(per_seq.mean().detach())}
