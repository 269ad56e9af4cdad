"""GRPO advantages and off-policy-corrected policy losses (DESIGN §4).

Variants are small pure functions in registries chosen by config
(``trainer.advantage``, ``trainer.loss``), so a new one touches this file only.

Shapes: ``logp``, ``prox_logp``, ``behav_logp`` and ``mask`` are [N, T] (N completions,
T completion tokens, padded); ``adv`` is [N]. Aggregation is token-level: the sum over
valid tokens divided by the number of valid tokens in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

NO_SIGNAL_STD = 1e-6
"""A group whose rewards have a smaller standard deviation carries no GRPO signal."""

ADVANTAGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {}


def _register(table: dict, name: str):
    def deco(fn):
        table[name] = fn
        return fn
    return deco


@_register(ADVANTAGES, "grpo")
def grpo_advantage(rewards: torch.Tensor) -> torch.Tensor:
    """(r − mean) / (std + 1e-6) within one group; rewards [G] -> advantages [G].

    A group whose rewards differ only by float rounding gets exactly zero: dividing
    rounding noise by its own tiny std would turn it into advantages of order one.
    """
    std = rewards.std(unbiased=False)
    if std < NO_SIGNAL_STD:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (std + 1e-6)


@_register(ADVANTAGES, "drgrpo")
def drgrpo_advantage(rewards: torch.Tensor) -> torch.Tensor:
    """r − mean, without the std division that overweights near-uniform groups (Dr. GRPO)."""
    return rewards - rewards.mean()


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    clip_eps: float = 0.2
    clip_eps_high: float = 0.0
    """0: same as clip_eps."""
    is_cap: float = 2.0


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _diagnostics(prox_logp, behav_logp, mask, weight) -> dict[str, float]:
    log_r = (prox_logp - behav_logp).detach()
    # k3 estimator of KL(behaviour || trainer) on behaviour samples: always >= 0.
    k3 = torch.exp(log_r) - 1 - log_r
    return {
        "mismatch_kl": float(_masked_mean(k3, mask)),
        "is_weight_mean": float(_masked_mean(weight, mask)),
        "is_truncated_frac": float(_masked_mean((torch.exp(log_r) > weight + 1e-6).float(), mask)),
    }


@_register(LOSSES, "decoupled_ppo")
def decoupled_ppo_loss(logp, prox_logp, behav_logp, adv, mask, s: LossSettings):
    """AReaL's decoupled PPO: clip(π_θ/π_prox)·A, weighted by π_prox/π_behav (truncated at is_cap).

    π_prox is the trainer's policy before this update (detached); the behaviour
    policy is whatever (possibly older) version generated the tokens.
    """
    a = adv[:, None]
    ratio = torch.exp(logp - prox_logp.detach())
    high = s.clip_eps_high or s.clip_eps
    clipped = torch.clamp(ratio, 1 - s.clip_eps, 1 + high)
    weight = torch.exp(prox_logp - behav_logp).detach().clamp(max=s.is_cap)
    per_token = -weight * torch.minimum(ratio * a, clipped * a)
    loss = _masked_mean(per_token, mask)
    stats = {
        "clip_frac": float(_masked_mean(((ratio - clipped).abs() > 1e-6).float(), mask)),
        "ratio_mean": float(_masked_mean(ratio.detach(), mask)),
        **_diagnostics(prox_logp, behav_logp, mask, weight),
    }
    return loss, stats


@_register(LOSSES, "tis")
def truncated_is_loss(logp, prox_logp, behav_logp, adv, mask, s: LossSettings):
    """Policy gradient with a truncated importance weight min(π_θ/π_behav, is_cap), no clipping."""
    weight = torch.exp(logp.detach() - behav_logp).clamp(max=s.is_cap)
    loss = _masked_mean(-weight * adv[:, None] * logp, mask)
    stats = {"clip_frac": 0.0, "ratio_mean": 1.0, **_diagnostics(prox_logp, behav_logp, mask, weight)}
    return loss, stats


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ || π_ref) on samples from π_θ."""
    log_r = ref_logp - logp
    return torch.exp(log_r) - 1 - log_r
