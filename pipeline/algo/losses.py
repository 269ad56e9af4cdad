"""The GRPO objective (docs/design.md §4): advantages, off-policy-corrected policy losses, KL to a reference.

Variants are small pure functions in registries chosen by config
(``trainer.advantage``, ``trainer.loss``), so a new one touches this file only; a new
setting is one field of :class:`LossSettings` and the field of the same name in the
trainer config. The engines compute log-probabilities and call :func:`advantages` and
:func:`objective`; every piece of loss arithmetic is here.

Shapes: ``logp``, ``prox_logp``, ``behav_logp`` and ``mask`` are [N, T] (N completions,
T completion tokens, padded); ``adv`` is [N]. Aggregation is token-level: the sum over
valid tokens divided by the number of valid tokens in the batch (or a given normaliser,
see :func:`objective`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable

import numpy as np
import torch

NO_SIGNAL_STD = 1e-6
"""A group whose rewards have a smaller standard deviation carries no GRPO signal."""

ADVANTAGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {}
"""``(logp, prox_logp, behav_logp, adv, mask, settings) -> (loss, stats)``: the loss and every
statistic are token means over ``mask`` (what :func:`objective` rescales to its normaliser)."""


def resolve(table: dict, kind: str, name: str):
    """A built-in of ``table``, or user code: ``module:function``, ``path/to/file.py:function`` or a
    name in the ``rlpipe.advantages`` / ``rlpipe.losses`` entry-point group (``pipeline.plugins``)."""
    if name in table:
        return table[name]
    from pipeline import plugins

    fn = plugins.find(kind, name)
    if fn is None:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(table))}, or your own as "
                         f"module:function, path/to/file.py:function, or a name in the "
                         f"{plugins.ENTRY_POINT_GROUPS[kind]!r} entry-point group")
    return plugins.require_callable(fn, name, kind)


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


BATCH_ADVANTAGES: dict[str, Callable[[list[torch.Tensor]], torch.Tensor]] = {}
"""Advantages that see the whole batch: ``[rewards [G_k] per group] -> advantages [N]``."""


@_register(BATCH_ADVANTAGES, "reinforce_pp")
def reinforce_pp_advantage(rewards_per_group: list[torch.Tensor]) -> torch.Tensor:
    """REINFORCE++ with a group baseline (Hu et al. 2025): r − mean of its group, then the
    whole batch normalised by the batch's std of those differences (global, not per group)."""
    centred = torch.cat([r - r.mean() for r in rewards_per_group])
    std = centred.std(unbiased=False)
    if std < NO_SIGNAL_STD:
        return torch.zeros_like(centred)
    return centred / (std + 1e-6)


def advantages(rewards_per_group: Iterable[Any], kind: str) -> torch.Tensor:
    """Per-completion advantages [N] of consecutive groups: each group's from its own rewards
    (:data:`ADVANTAGES`), or the batch's at once (:data:`BATCH_ADVANTAGES`).

    ``rewards_per_group``: one 1-D array or tensor per group (a :class:`ScoredGroup`'s
    ``rewards``), in completion order; ``kind``: a name in either table, or user code.
    """
    groups = [r.detach().clone() if isinstance(r, torch.Tensor) else torch.from_numpy(np.array(r))
              for r in rewards_per_group]
    if not groups:
        raise ValueError("advantages needs at least one group")
    if kind in BATCH_ADVANTAGES:
        out = BATCH_ADVANTAGES[kind](groups)
    else:
        fn = resolve(ADVANTAGES, "advantage", kind)
        out = torch.cat([fn(r) for r in groups])
    if out.shape != (sum(len(r) for r in groups),):
        raise ValueError(f"advantage {kind!r} returned shape {tuple(out.shape)} for "
                         f"{sum(len(r) for r in groups)} completions")
    return out


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """Everything the objective is configured by. :meth:`from_config` reads each field from
    the trainer config's field of the same name."""

    advantage: str = "grpo"
    """A name in :data:`ADVANTAGES`, or a plugin spec (``resolve``): ``rewards [G] -> advantages [G]``."""
    loss: str = "decoupled_ppo"
    """A name in :data:`LOSSES`, or a plugin spec with the same signature as they have."""
    clip_eps: float = 0.2
    clip_eps_high: float = 0.0
    """0: same as clip_eps."""
    is_cap: float = 2.0
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference policy (used when reference log-probs are given)."""

    def __post_init__(self) -> None:
        if self.advantage not in BATCH_ADVANTAGES:
            resolve(ADVANTAGES, "advantage", self.advantage)
        resolve(LOSSES, "loss", self.loss)

    @classmethod
    def from_config(cls, cfg: Any) -> "LossSettings":
        """The settings of a trainer config (any object with an attribute per field)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


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
        # Where the clip binds (the gradient is cut): above 1 + high with A > 0, below 1 - ε with A < 0.
        "clip_frac": float(_masked_mean((((ratio > 1 + high) & (a > 0)) | ((ratio < 1 - s.clip_eps) & (a < 0)))
                                        .float(), mask)),
        "ratio_mean": float(_masked_mean(ratio.detach(), mask)),
        **_diagnostics(prox_logp, behav_logp, mask, weight),
    }
    return loss, stats


@_register(LOSSES, "gspo")
def gspo_loss(logp, prox_logp, behav_logp, adv, mask, s: LossSettings):
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios
    s_i = exp(mean_t (log π_θ − log π_prox)), clipped to [1 − ε, 1 + ε_high]; the term
    −min(s_i·A_i, clip(s_i)·A_i) is carried by each of the sequence's tokens (token-level
    aggregation, as every loss here). The off-policy weight is the sequence's too:
    exp(mean_t (log π_prox − log π_behav)), truncated at is_cap. The paper's ε is small
    (3e-4 to 4e-4): set clip_eps accordingly."""
    a = adv[:, None]
    n_tok = mask.sum(dim=1).clamp(min=1.0)
    seq_log_ratio = ((logp - prox_logp.detach()) * mask).sum(dim=1) / n_tok
    ratio = torch.exp(seq_log_ratio)[:, None]
    high = s.clip_eps_high or s.clip_eps
    clipped = torch.clamp(ratio, 1 - s.clip_eps, 1 + high)
    seq_weight = torch.exp(((prox_logp - behav_logp) * mask).sum(dim=1) / n_tok).detach().clamp(max=s.is_cap)
    weight = seq_weight[:, None].expand_as(logp)
    per_token = -weight * torch.minimum(ratio * a, clipped * a).expand_as(logp)
    loss = _masked_mean(per_token, mask)
    binds = ((ratio > 1 + high) & (a > 0)) | ((ratio < 1 - s.clip_eps) & (a < 0))
    stats = {
        "clip_frac": float(_masked_mean(binds.float().expand_as(logp), mask)),
        "ratio_mean": float(_masked_mean(ratio.detach().expand_as(logp), mask)),
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


def objective(logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
              settings: LossSettings, *, ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
              tokens: float | None = None, prox_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss to backpropagate for one optimizer step on a batch, and its statistics.

    ``logp`` [N, T]: the trainer's log-probabilities of the completion tokens (with grad).
    ``prox_logp`` [N, T]: the proximal policy's, computed once per batch before its first
    update (several PPO epochs or minibatches); None: one update per batch, so the proximal
    policy is ``logp`` itself, detached (the ratio is 1 and only the importance weight acts).
    ``behav_logp`` [N, T]: the behaviour policy's; ``mask`` [N, T]: 1 on valid tokens;
    ``adv`` [N] (from :func:`advantages`). ``ref_logp`` [N, T]: the reference policy's, for
    the k3 KL term weighted by ``settings.kl_coef``; ``entropy`` [N, T]: reported only.

    ``tokens`` is the normaliser of every token sum (default: this batch's valid tokens, a
    token mean). Parts of one batch given the whole batch's token count return losses,
    gradients and statistics that sum to the whole batch's: a data-parallel rank passes the
    global count and all-reduces (sums) the statistics.

    Statistics: ``loss``, ``entropy`` (with ``entropy``), ``tokens`` (this part's valid
    tokens), the loss variant's (``clip_frac``, ``ratio_mean``, ``mismatch_kl``,
    ``is_weight_mean``, ``is_truncated_frac``) and ``kl_ref`` (with ``ref_logp``); all but
    ``tokens`` are token sums over the normaliser.
    """
    local = float(mask.sum())
    if tokens is None:
        norm = max(local, 1.0)
    elif tokens > 0:
        norm = float(tokens)
    else:
        raise ValueError(f"tokens: the normaliser must be > 0; got {tokens!r}")
    # The variants return token means over this part; ``share`` turns a mean into a sum over ``norm``.
    share = local / norm
    prox = logp.detach() if prox_logp is None else prox_logp.detach()
    mean_loss, variant_stats = resolve(LOSSES, "loss", settings.loss)(logp, prox, behav_logp, adv, mask, settings)
    loss = mean_loss * share
    kl = None
    if ref_logp is not None:
        kl = (kl_k3(logp, ref_logp) * mask).sum() / norm
        loss = loss + settings.kl_coef * kl
    stats: dict[str, float] = {"loss": float(loss.detach())}
    if entropy is not None:
        stats["entropy"] = float((entropy.detach() * mask).sum() / norm)
    stats["tokens"] = int(local)
    stats.update({k: v * share for k, v in variant_stats.items()})
    if kl is not None:
        stats["kl_ref"] = float(kl.detach())
    return loss, stats
