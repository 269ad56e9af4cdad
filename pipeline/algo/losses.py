"""The GRPO objective (docs/design.md §4): advantages, off-policy-corrected policy losses, KL to a reference.

Variants are small pure functions in registries chosen by config
(``trainer.advantage``, ``trainer.loss``), so a new one touches this file only; a new
setting is one field of :class:`LossSettings` and the field of the same name in the
trainer config. The engines compute log-probabilities and call :func:`advantages` and
:func:`objective`; every piece of loss arithmetic is here.

Shapes: ``logp``, ``prox_logp``, ``behav_logp`` and ``mask`` are [N, T] (N completions,
T completion tokens, padded); ``adv`` is [N]. Aggregation (``trainer.loss_agg``) is
token-level by default: the sum over valid tokens divided by the number of valid tokens in
the batch (or a given normaliser, see :func:`objective`); :data:`LOSS_AGGREGATIONS` names
the others.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable

import numpy as np
import torch

from pipeline.catalog import ADVANTAGES, LOSSES
from pipeline.registry import Registry

NO_SIGNAL_STD = 1e-6
"""A group whose rewards have a smaller standard deviation carries no GRPO signal."""

# The names: ADVANTAGES (``rewards [G] -> advantages [G]``; with ``batch``, ``[rewards [G_k] per
# group] -> advantages [N]``) and LOSSES (``(logp, prox_logp, behav_logp, adv, mask, settings) ->
# (loss, stats)``, the loss and every statistic token means over ``mask``, what :func:`objective`
# rescales to its normaliser) are registries of pipeline.catalog, which names the functions below.
TOKEN_TERMS: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {}
"""The built-in losses per token: ``(same arguments) -> (per-token loss [N, T], stats)``, the
stats token means over ``mask``. :data:`LOSSES` holds their token means; the other
aggregations (:data:`LOSS_AGGREGATIONS`) weigh these terms themselves, so they need a loss
of this table (a loss of your own returns its aggregate only)."""

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "constant")
"""How the per-token terms of a batch are summed into its loss (``trainer.loss_agg``):

- ``token-mean``: the sum over valid tokens / the batch's valid tokens (every token weighs
  the same; a long completion weighs more than a short one);
- ``seq-mean-token-mean``: each completion's token mean, averaged over the completions that
  have a valid token (every completion weighs the same);
- ``constant`` (Dr. GRPO): the sum over valid tokens / (the batch's completions ×
  ``loss_norm_tokens``), a normaliser that depends on neither the lengths nor the mask.
"""
IS_MODES = ("truncate", "mask")
"""What the cap on the behaviour importance weight does (``trainer.is_mode``): ``truncate``
lowers a weight above ``is_cap`` to ``is_cap`` (truncated IS); ``mask`` sets it to 0 (masked
IS: the token, for ``gspo`` the sequence, leaves the gradient)."""


def resolve(registry: Registry, kind: str, name: str):
    """A built-in of ``registry`` (``ADVANTAGES``, ``LOSSES``), or user code: ``module:function``,
    ``path/to/file.py:function`` or a name in the ``rlpipe.advantages`` / ``rlpipe.losses``
    entry-point group (``pipeline.plugins``); ``kind`` is kept for the callers that name it."""
    return registry.get(name)


def grpo_advantage(rewards: torch.Tensor) -> torch.Tensor:
    """(r − mean) / (std + 1e-6) within one group; rewards [G] -> advantages [G].

    A group whose rewards differ only by float rounding gets exactly zero: dividing
    rounding noise by its own tiny std would turn it into advantages of order one.
    """
    std = rewards.std(unbiased=False)
    if std < NO_SIGNAL_STD:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (std + 1e-6)


def drgrpo_advantage(rewards: torch.Tensor) -> torch.Tensor:
    """r − mean, without the std division that overweights near-uniform groups (Dr. GRPO)."""
    return rewards - rewards.mean()


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
    (``ADVANTAGES``), or the batch's at once (those registered with ``batch``).

    ``rewards_per_group``: one 1-D array or tensor per group (a :class:`ScoredGroup`'s
    ``rewards``), in completion order; ``kind``: a name in either table, or user code.
    """
    groups = [r.detach().clone() if isinstance(r, torch.Tensor) else torch.from_numpy(np.array(r))
              for r in rewards_per_group]
    if not groups:
        raise ValueError("advantages needs at least one group")
    if ADVANTAGES.meta(kind, "batch"):
        out = ADVANTAGES.get(kind)(groups)
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
    is_mode: str = "truncate"
    """A name in :data:`IS_MODES`: what a weight above ``is_cap`` becomes."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference policy (used when reference log-probs are given)."""
    loss_agg: str = "token-mean"
    """A name in :data:`LOSS_AGGREGATIONS`."""
    loss_norm_tokens: int = 0
    """``constant`` aggregation: tokens per completion in the normaliser (> 0 there; the trainer
    config's 0 means ``task.max_new_tokens``, see :meth:`from_config`)."""

    def __post_init__(self) -> None:
        resolve(ADVANTAGES, "advantage", self.advantage)
        resolve(LOSSES, "loss", self.loss)
        if self.is_mode not in IS_MODES:
            raise ValueError(f"is_mode: must be {'|'.join(IS_MODES)}; got {self.is_mode!r}")
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg: must be {'|'.join(LOSS_AGGREGATIONS)}; got {self.loss_agg!r}")
        if self.loss_agg != "token-mean" and self.loss not in TOKEN_TERMS:
            raise ValueError(f"loss_agg: {self.loss_agg!r} weighs the per-token terms of a built-in loss "
                             f"({', '.join(TOKEN_TERMS)}); loss {self.loss!r} returns its own aggregate: "
                             "use loss_agg 'token-mean'")
        if self.loss_norm_tokens < 0:
            raise ValueError(f"loss_norm_tokens: must be >= 0; got {self.loss_norm_tokens!r}")

    @classmethod
    def from_config(cls, cfg: Any, *, max_new_tokens: int | None = None) -> "LossSettings":
        """The settings of a trainer config (any object with an attribute per field).
        ``max_new_tokens`` (the task's) stands in for a ``loss_norm_tokens`` of 0."""
        values = {f.name: getattr(cfg, f.name) for f in fields(cls)}
        if values["loss_norm_tokens"] == 0 and max_new_tokens is not None:
            values["loss_norm_tokens"] = int(max_new_tokens)
        return cls(**values)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _is_weight(log_ratio: torch.Tensor, s: LossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """The behaviour importance weight exp(log_ratio), detached and capped as ``s.is_mode`` says,
    and where the cap acted (a bool tensor)."""
    raw = torch.exp(log_ratio).detach()
    capped = raw > s.is_cap
    if s.is_mode == "mask":
        return torch.where(capped, torch.zeros_like(raw), raw), capped
    return raw.clamp(max=s.is_cap), capped


def _diagnostics(prox_logp, behav_logp, mask, weight, s: LossSettings, capped: torch.Tensor) -> dict[str, float]:
    log_r = (prox_logp - behav_logp).detach()
    # k3 estimator of KL(behaviour || trainer) on behaviour samples: always >= 0.
    k3 = torch.exp(log_r) - 1 - log_r
    out = {
        "mismatch_kl": float(_masked_mean(k3, mask)),
        "is_weight_mean": float(_masked_mean(weight, mask)),
    }
    if s.is_mode == "mask":
        out["is_truncated_frac"] = 0.0
        out["is_masked_frac"] = float(_masked_mean(capped.float(), mask))
    else:
        out["is_truncated_frac"] = float(_masked_mean((torch.exp(log_r) > weight + 1e-6).float(), mask))
    return out


def _token_loss(name: str):
    """Record a per-token loss in :data:`TOKEN_TERMS` under ``name``; the function is then its token
    mean, what ``LOSSES`` (pipeline.catalog) names."""
    def deco(terms):
        @functools.wraps(terms)
        def token_mean(logp, prox_logp, behav_logp, adv, mask, s: LossSettings):
            per_token, stats = terms(logp, prox_logp, behav_logp, adv, mask, s)
            return _masked_mean(per_token, mask), stats
        TOKEN_TERMS[name] = terms
        return token_mean
    return deco


@_token_loss("decoupled_ppo")
def decoupled_ppo_loss(logp, prox_logp, behav_logp, adv, mask, s: LossSettings):
    """AReaL's decoupled PPO: clip(π_θ/π_prox)·A, weighted by π_prox/π_behav (capped at is_cap,
    as is_mode says).

    π_prox is the trainer's policy before this update (detached); the behaviour
    policy is whatever (possibly older) version generated the tokens.
    """
    a = adv[:, None]
    ratio = torch.exp(logp - prox_logp.detach())
    high = s.clip_eps_high or s.clip_eps
    clipped = torch.clamp(ratio, 1 - s.clip_eps, 1 + high)
    weight, capped = _is_weight(prox_logp - behav_logp, s)
    per_token = -weight * torch.minimum(ratio * a, clipped * a)
    stats = {
        # Where the clip binds (the gradient is cut): above 1 + high with A > 0, below 1 - ε with A < 0.
        "clip_frac": float(_masked_mean((((ratio > 1 + high) & (a > 0)) | ((ratio < 1 - s.clip_eps) & (a < 0)))
                                        .float(), mask)),
        "ratio_mean": float(_masked_mean(ratio.detach(), mask)),
        **_diagnostics(prox_logp, behav_logp, mask, weight, s, capped),
    }
    return per_token, stats


@_token_loss("gspo")
def gspo_loss(logp, prox_logp, behav_logp, adv, mask, s: LossSettings):
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios
    s_i = exp(mean_t (log π_θ − log π_prox)), clipped to [1 − ε, 1 + ε_high]; the term
    −min(s_i·A_i, clip(s_i)·A_i) is carried by each of the sequence's tokens (token-level
    aggregation by default). The off-policy weight is the sequence's too:
    exp(mean_t (log π_prox − log π_behav)), capped at is_cap (is_mode ``mask``: the whole
    sequence leaves the gradient). The paper's ε is small
    (3e-4 to 4e-4): set clip_eps accordingly."""
    a = adv[:, None]
    n_tok = mask.sum(dim=1).clamp(min=1.0)
    seq_log_ratio = ((logp - prox_logp.detach()) * mask).sum(dim=1) / n_tok
    ratio = torch.exp(seq_log_ratio)[:, None]
    high = s.clip_eps_high or s.clip_eps
    clipped = torch.clamp(ratio, 1 - s.clip_eps, 1 + high)
    seq_weight, seq_capped = _is_weight(((prox_logp - behav_logp) * mask).sum(dim=1) / n_tok, s)
    weight = seq_weight[:, None].expand_as(logp)
    per_token = -weight * torch.minimum(ratio * a, clipped * a).expand_as(logp)
    binds = ((ratio > 1 + high) & (a > 0)) | ((ratio < 1 - s.clip_eps) & (a < 0))
    stats = {
        "clip_frac": float(_masked_mean(binds.float().expand_as(logp), mask)),
        "ratio_mean": float(_masked_mean(ratio.detach().expand_as(logp), mask)),
        **_diagnostics(prox_logp, behav_logp, mask, weight, s, seq_capped[:, None].expand_as(logp)),
    }
    return per_token, stats


@_token_loss("tis")
def truncated_is_loss(logp, prox_logp, behav_logp, adv, mask, s: LossSettings):
    """Policy gradient with a truncated importance weight min(π_θ/π_behav, is_cap), no clipping
    (is_mode ``mask``: weight π_θ/π_behav, and 0 where it exceeds is_cap: masked IS)."""
    weight, capped = _is_weight(logp.detach() - behav_logp, s)
    per_token = -weight * adv[:, None] * logp
    stats = {"clip_frac": 0.0, "ratio_mean": 1.0, **_diagnostics(prox_logp, behav_logp, mask, weight, s, capped)}
    return per_token, stats


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ || π_ref) on samples from π_θ."""
    log_r = ref_logp - logp
    return torch.exp(log_r) - 1 - log_r


def sequence_count(mask: torch.Tensor, settings: LossSettings) -> int:
    """The completions of ``mask`` [N, T] that the ``sequences`` normaliser of :func:`objective`
    counts: those with a valid token (``seq-mean-token-mean``), or all N (``constant``: a
    completion masked out of the loss still counts, so the normaliser stays constant);
    ``token-mean`` counts none."""
    if settings.loss_agg == "seq-mean-token-mean":
        return int((mask.sum(dim=1) > 0).sum())
    if settings.loss_agg == "constant":
        return int(mask.shape[0])
    return 0


def _aggregation_weights(mask: torch.Tensor, settings: LossSettings, sequences: float | None) -> torch.Tensor:
    """Per-token weights [N, T] of the ``seq-mean-token-mean`` and ``constant`` aggregations:
    the loss is ``(per_token * weights).sum()``."""
    if sequences is None:
        n = max(float(sequence_count(mask, settings)), 1.0)
    elif sequences > 0:
        n = float(sequences)
    else:
        raise ValueError(f"sequences: the normaliser must be > 0; got {sequences!r}")
    if settings.loss_agg == "seq-mean-token-mean":
        return mask / (mask.sum(dim=1, keepdim=True).clamp(min=1.0) * n)
    if settings.loss_norm_tokens <= 0:
        raise ValueError("loss_norm_tokens: the constant aggregation needs a token count > 0 (the trainer "
                         "config's 0 stands for task.max_new_tokens: LossSettings.from_config(..., max_new_tokens=))")
    return mask / (n * settings.loss_norm_tokens)


def objective(logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
              settings: LossSettings, *, ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
              tokens: float | None = None, sequences: float | None = None,
              prox_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
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
    global count and all-reduces (sums) the statistics. Under ``settings.loss_agg``
    ``seq-mean-token-mean`` and ``constant`` the loss (policy term and KL term alike) is
    normalised by ``sequences`` instead, the whole batch's :func:`sequence_count` (default:
    this part's), with the same property; the statistics stay token means over ``tokens``.

    Statistics: ``loss``, ``entropy`` (with ``entropy``), ``tokens`` (this part's valid
    tokens), the loss variant's (``clip_frac``, ``ratio_mean``, ``mismatch_kl``,
    ``is_weight_mean``, ``is_truncated_frac``, and ``is_masked_frac`` with is_mode ``mask``)
    and ``kl_ref`` (with ``ref_logp``); all but ``tokens`` are token sums over the normaliser.
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
    token_mean = settings.loss_agg == "token-mean"
    if token_mean:
        mean_loss, variant_stats = resolve(LOSSES, "loss", settings.loss)(logp, prox, behav_logp, adv, mask, settings)
        loss = mean_loss * share
    else:
        weights = _aggregation_weights(mask, settings, sequences)
        per_token, variant_stats = TOKEN_TERMS[settings.loss](logp, prox, behav_logp, adv, mask, settings)
        loss = (per_token * weights).sum()
    kl = None
    if ref_logp is not None:
        k3 = kl_k3(logp, ref_logp)
        kl = (k3 * mask).sum() / norm
        loss = loss + settings.kl_coef * (kl if token_mean else (k3 * weights).sum())
    stats: dict[str, float] = {"loss": float(loss.detach())}
    if entropy is not None:
        stats["entropy"] = float((entropy.detach() * mask).sum() / norm)
    stats["tokens"] = int(local)
    stats.update({k: v * share for k, v in variant_stats.items()})
    if kl is not None:
        stats["kl_ref"] = float(kl.detach())
    return loss, stats


# ----------------------------------------------------------------------------- over-long completions (DAPO)


def truncated(lengths: torch.Tensor, last_ids: torch.Tensor, *, max_new_tokens: int, eos_id: int) -> torch.Tensor:
    """Which completions were cut off: ``lengths`` [N] equal to ``max_new_tokens`` and the last
    token (``last_ids`` [N]) not the end-of-sequence id. Bool [N]."""
    return (lengths == max_new_tokens) & (last_ids != eos_id)


def overlong_penalty(lengths: torch.Tensor, *, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft over-long punishment, what each completion's reward loses: 0 up to
    ``max_new_tokens − buffer`` tokens, then rising linearly to ``penalty`` at
    ``max_new_tokens``: penalty · (len − (max_new_tokens − buffer)) / buffer, clipped to
    [0, penalty]. ``lengths`` [N] -> [N] float64; ``buffer`` 0: all zero."""
    lengths = lengths.to(torch.float64)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    if buffer > max_new_tokens:
        raise ValueError(f"overlong_buffer: must be at most max_new_tokens ({max_new_tokens}); got {buffer!r}")
    over = (lengths - (max_new_tokens - buffer)) / buffer
    return (penalty * over).clamp(min=0.0, max=penalty)
