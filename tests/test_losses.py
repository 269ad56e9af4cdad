import itertools
import math

import numpy as np
import pytest
import torch

from pipeline.algo.losses import ADVANTAGES, LOSSES, LossSettings, advantages, objective
from pipeline.config import TrainerConfig


def test_grpo_advantages_are_standardised_within_the_group():
    adv = ADVANTAGES["grpo"](torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-4)


def test_equal_rewards_give_zero_advantage():
    assert torch.allclose(ADVANTAGES["grpo"](torch.full((8,), 0.7)), torch.zeros(8), atol=1e-3)
    assert torch.allclose(ADVANTAGES["drgrpo"](torch.full((8,), 0.7)), torch.zeros(8), atol=1e-6)


def test_drgrpo_does_not_divide_by_std():
    adv = ADVANTAGES["drgrpo"](torch.tensor([0.2, 0.0]))
    assert torch.allclose(adv, torch.tensor([0.1, -0.1]))


def _batch():
    torch.manual_seed(0)
    logp = (-torch.rand(4, 5)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0, 0]] * 4, dtype=torch.float)
    return logp, mask


def test_on_policy_decoupled_ppo_gradient_raises_logp_of_positive_advantages():
    logp, mask = _batch()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, stats = LOSSES["decoupled_ppo"](logp, logp.detach(), logp.detach(), adv, mask, LossSettings())
    loss.backward()
    g = logp.grad
    assert (g[0, :3] < 0).all() and (g[1, :3] > 0).all(), "descent must raise logp where A > 0"
    assert (g[:, 3:] == 0).all(), "padding tokens get no gradient"
    assert abs(stats["ratio_mean"] - 1) < 1e-6 and stats["mismatch_kl"] < 1e-6


def test_importance_weight_is_truncated_at_the_cap():
    logp, mask = _batch()
    behav = logp.detach() - 5.0  # behaviour far less likely: raw weight e^5
    adv = torch.ones(4)
    loss, stats = LOSSES["decoupled_ppo"](logp, logp.detach(), behav, adv, mask, LossSettings(is_cap=2.0))
    assert abs(stats["is_weight_mean"] - 2.0) < 1e-5 and stats["is_truncated_frac"] == 1.0
    assert stats["mismatch_kl"] > 1.0
    loss_on, _ = LOSSES["decoupled_ppo"](logp, logp.detach(), logp.detach(), adv, mask, LossSettings())
    assert torch.isclose(loss, 2.0 * loss_on)


def test_the_clip_fraction_counts_only_tokens_where_the_clip_binds():
    """Above 1 + ε the clip binds only with A > 0, below 1 - ε only with A < 0 (elsewhere the
    unclipped term is the minimum and the gradient flows)."""
    logp, mask = _batch()
    prox = logp.detach() - 1.0  # ratio e^1 > 1 + eps everywhere
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, stats = LOSSES["decoupled_ppo"](logp, prox, prox, adv, mask, LossSettings(clip_eps=0.2))
    loss.backward()
    per_row = mask.sum(1)
    assert stats["clip_frac"] == pytest.approx(float((per_row[0] + per_row[2]) / per_row.sum()))
    assert torch.all(logp.grad[0] == 0) and torch.any(logp.grad[1] != 0)


def test_ratio_clipping_stops_the_gradient_outside_the_trust_region():
    logp, mask = _batch()
    prox = logp.detach() - 1.0  # ratio e^1 > 1 + eps
    adv = torch.ones(4)
    loss, stats = LOSSES["decoupled_ppo"](logp, prox, prox, adv, mask, LossSettings(clip_eps=0.2))
    loss.backward()
    assert stats["clip_frac"] == 1.0 and torch.all(logp.grad == 0)


def test_token_level_aggregation_divides_by_valid_tokens_in_the_batch():
    logp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float)
    adv = torch.tensor([1.0, 1.0])
    loss, _ = LOSSES["tis"](logp, logp.detach(), logp.detach(), adv, mask, LossSettings())
    loss.backward()
    assert torch.allclose(logp.grad[mask.bool()], torch.full((5,), -1 / 5))


# ----------------------------------------------------------------------------- the objective

SETTINGS = dict(clip_eps=0.2, clip_eps_high=0.28, is_cap=1.5, kl_coef=0.1)
GROUP_SIZES = (4, 3, 5, 2)


def _random_batch(seed: int):
    """Float64 inputs of one batch: rewards per group (one group without signal), ragged mask,
    behaviour log-probs off the trainer's by up to ±1 (some weights above the cap)."""
    g = torch.Generator().manual_seed(seed)
    rewards = [torch.rand(k, generator=g, dtype=torch.float64).round() for k in GROUP_SIZES]
    rewards[0] = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)
    rewards[2] = torch.full((5,), 0.3, dtype=torch.float64)
    n, t = sum(GROUP_SIZES), 7
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    logp = -3 * torch.rand(n, t, generator=g, dtype=torch.float64)
    behav = logp + 2 * torch.rand(n, t, generator=g, dtype=torch.float64) - 1
    ref = logp + 0.6 * torch.rand(n, t, generator=g, dtype=torch.float64) - 0.3
    entropy = 2 * torch.rand(n, t, generator=g, dtype=torch.float64)
    return rewards, logp, behav, ref, entropy, mask


def _reference_advantages(rewards, kind):
    out = []
    for r in rewards:
        vals = [float(x) for x in r]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
        for v in vals:
            if kind == "drgrpo":
                out.append(v - mean)
            else:
                out.append(0.0 if std < 1e-6 else (v - mean) / (std + 1e-6))
    return out


def _reference(rows, adv, loss_kind, *, kl_coef, clip_eps, clip_eps_high, is_cap, with_ref, norm):
    """The objective written out token by token: ``rows`` are (logp, behav, ref, entropy, mask) per
    completion, ``logp`` a float64 tensor with grad (the proximal policy is its detached value)."""
    loss = torch.zeros((), dtype=torch.float64)
    sums = dict.fromkeys(("entropy", "clip_frac", "ratio_mean", "mismatch_kl", "is_weight_mean",
                          "is_truncated_frac", "kl_ref"), 0.0)
    count = 0
    high = clip_eps_high or clip_eps
    for (logp, behav, ref, ent, mask), a in zip(rows, adv):
        for j in range(len(mask)):
            if not mask[j]:
                continue
            count += 1
            lp, prox, b = logp[j], float(logp[j].detach()), float(behav[j])
            raw = math.exp(prox - b)
            if loss_kind == "decoupled_ppo":
                ratio = torch.exp(lp - prox)
                clipped = torch.clamp(ratio, 1 - clip_eps, 1 + high)
                weight = min(raw, is_cap)
                term = -weight * torch.minimum(ratio * a, clipped * a)
                r = float(ratio.detach())
                sums["clip_frac"] += float((r > 1 + high and a > 0) or (r < 1 - clip_eps and a < 0))
                sums["ratio_mean"] += r
            else:
                weight = min(math.exp(prox - b), is_cap)
                term = -weight * a * lp
                sums["ratio_mean"] += 1.0
            loss = loss + term / norm
            sums["mismatch_kl"] += raw - 1 - (prox - b)
            sums["is_weight_mean"] += weight
            sums["is_truncated_frac"] += float(raw > weight + 1e-6)
            sums["entropy"] += float(ent[j])
            if with_ref:
                d = ref[j] - lp
                k3 = torch.exp(d) - 1 - d
                loss = loss + kl_coef * k3 / norm
                sums["kl_ref"] += float(k3.detach())
    stats = {k: v / norm for k, v in sums.items()}
    if not with_ref:
        del stats["kl_ref"]
    return loss, {"loss": float(loss.detach()), "tokens": count, **stats}


def _run(rows_slice, batch, adv, s, *, with_ref, tokens=None):
    rewards, logp, behav, ref, entropy, mask = batch
    leaf = logp.clone().requires_grad_()
    sl = rows_slice
    loss, stats = objective(leaf[sl], behav[sl], mask[sl], adv[sl], s, ref_logp=ref[sl] if with_ref else None,
                            entropy=entropy[sl], tokens=tokens)
    loss.backward()
    return float(loss.detach()), stats, leaf.grad


@pytest.mark.parametrize("seed,loss_kind,adv_kind,with_ref", [
    (seed, *case) for seed, case in enumerate(itertools.product(("decoupled_ppo", "tis"), ("grpo", "drgrpo"),
                                                                (False, True)))])
def test_objective_matches_a_token_by_token_reference(seed, loss_kind, adv_kind, with_ref):
    batch = _random_batch(seed)
    rewards, logp, behav, ref, entropy, mask = batch
    s = LossSettings(advantage=adv_kind, loss=loss_kind, **SETTINGS)
    adv = advantages(rewards, s.advantage)
    assert adv.shape == (sum(GROUP_SIZES),)
    assert adv.tolist() == pytest.approx(_reference_advantages(rewards, adv_kind), rel=1e-12, abs=1e-12)
    if adv_kind == "grpo":
        assert torch.all(adv[7:12] == 0), "a group without signal has exactly zero advantage"

    loss, stats, grad = _run(slice(None), batch, adv, s, with_ref=with_ref)

    leaf = logp.clone().requires_grad_()
    rows = list(zip(leaf, behav, ref, entropy, mask))
    want_loss, want_stats = _reference(rows, adv.tolist(), loss_kind, with_ref=with_ref, norm=float(mask.sum()),
                                       **SETTINGS)
    want_loss.backward()
    assert loss == pytest.approx(float(want_loss.detach()), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-10, atol=1e-12)
    assert torch.all(grad[mask == 0] == 0)
    assert set(stats) == {"loss", "entropy", "tokens", "clip_frac", "ratio_mean", "mismatch_kl", "is_weight_mean",
                          "is_truncated_frac"} | ({"kl_ref"} if with_ref else set())
    assert stats["tokens"] == want_stats["tokens"] == int(mask.sum())
    for k, v in want_stats.items():
        assert stats[k] == pytest.approx(v, rel=1e-10, abs=1e-12), k
    # The inputs exercise the truncation: some weights capped, not all.
    assert 0 < stats["is_truncated_frac"] < 1


@pytest.mark.parametrize("loss_kind,with_ref", list(itertools.product(("decoupled_ppo", "tis"), (False, True))))
def test_parts_normalised_by_the_whole_batch_sum_to_the_whole_batch(loss_kind, with_ref):
    """What a data-parallel rank does: its completions, the global token count as normaliser."""
    batch = _random_batch(seed=7)
    rewards, logp, behav, ref, entropy, mask = batch
    s = LossSettings(advantage="grpo", loss=loss_kind, **SETTINGS)
    adv = advantages(rewards, s.advantage)
    total = float(mask.sum())
    full_loss, full_stats, full_grad = _run(slice(None), batch, adv, s, with_ref=with_ref)
    half = len(adv) // 2
    parts = [_run(sl, batch, adv, s, with_ref=with_ref, tokens=total) for sl in (slice(0, half), slice(half, None))]
    # The normaliser really differs from each part's own token count.
    assert all(0 < st["tokens"] < total for _, st, _ in parts)
    assert sum(loss for loss, _, _ in parts) == pytest.approx(full_loss, rel=1e-12)
    torch.testing.assert_close(parts[0][2] + parts[1][2], full_grad, rtol=1e-12, atol=1e-14)
    assert list(parts[0][1]) == list(full_stats)
    for k, v in full_stats.items():
        assert parts[0][1][k] + parts[1][1][k] == pytest.approx(v, rel=1e-12, abs=1e-14), k
    # And each part against the reference with the whole batch's normaliser.
    leaf = logp.clone().requires_grad_()
    rows = list(zip(leaf, behav, ref, entropy, mask))[:half]
    want_loss, want_stats = _reference(rows, adv.tolist()[:half], loss_kind, with_ref=with_ref, norm=total,
                                       **SETTINGS)
    want_loss.backward()
    assert parts[0][0] == pytest.approx(float(want_loss.detach()), rel=1e-10)
    torch.testing.assert_close(parts[0][2], leaf.grad, rtol=1e-10, atol=1e-12)
    for k, v in want_stats.items():
        assert parts[0][1][k] == pytest.approx(v, rel=1e-10, abs=1e-12), k


def test_a_part_without_tokens_contributes_nothing_but_keeps_the_graph():
    batch = _random_batch(seed=3)
    rewards, logp, behav, ref, entropy, mask = batch
    s = LossSettings(**SETTINGS)
    adv = advantages(rewards, s.advantage)
    leaf = logp[:1].clone().requires_grad_()
    loss, stats = objective(leaf, behav[:1], torch.zeros_like(mask[:1]), adv[:1], s, ref_logp=ref[:1],
                            entropy=entropy[:1], tokens=float(mask.sum()))
    loss.backward()
    assert float(loss.detach()) == 0 and torch.all(leaf.grad == 0)
    assert stats["tokens"] == 0 and all(v == 0 for v in stats.values())


def test_advantages_accept_the_records_float32_arrays():
    rewards = [np.array([1, 0, 1, 0], dtype=np.float32), np.array([0.5, 0.5], dtype=np.float32)]
    adv = advantages(rewards, "grpo")
    assert adv.dtype == torch.float32
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0, 0.0]), atol=1e-4)


def test_settings_come_from_the_trainer_config_fields_of_the_same_name():
    t = TrainerConfig(clip_eps=0.1, clip_eps_high=0.3, is_cap=3.0, kl_coef=0.02, advantage="drgrpo", loss="tis")
    s = LossSettings.from_config(t)
    assert s == LossSettings(clip_eps=0.1, clip_eps_high=0.3, is_cap=3.0, kl_coef=0.02, advantage="drgrpo",
                             loss="tis")
    # The defaults agree, so a setting means the same wherever it is read.
    assert LossSettings.from_config(TrainerConfig()) == LossSettings()


def test_unknown_variant_names_are_refused():
    with pytest.raises(ValueError, match="unknown loss"):
        LossSettings(loss="nope")
    with pytest.raises(ValueError, match="unknown advantage"):
        advantages([np.zeros(2, dtype=np.float32)], "nope")


def test_reinforce_pp_centres_per_group_and_normalises_by_the_batch():
    """Against the paper's rule written in numpy: r − group mean, divided by the batch std of that."""
    rng = np.random.default_rng(3)
    groups = [rng.random(4), rng.random(4), np.full(4, 0.5)]
    centred = np.concatenate([g - g.mean() for g in groups])
    want = centred / (centred.std() + 1e-6)
    got = advantages([g.astype(np.float32) for g in groups], "reinforce_pp")
    assert np.allclose(got.numpy(), want, atol=1e-5)
    assert torch.all(got[8:] == 0), "a group without spread stays at 0 (its centred rewards are 0)"
    assert torch.all(advantages([np.ones(4, np.float32)], "reinforce_pp") == 0)


def test_gspo_matches_its_sequence_level_formula():
    """GSPO written out per sequence in float64: the geometric-mean ratio, its clip, the
    sequence weight, each sequence's term carried by its tokens, the token mean."""
    torch.manual_seed(5)
    n, t = 5, 6
    logp = (-torch.rand(n, t, dtype=torch.float64)).requires_grad_()
    prox = logp.detach() + 0.05 * torch.randn(n, t, dtype=torch.float64)
    behav = prox + 0.1 * torch.randn(n, t, dtype=torch.float64)
    mask = torch.ones(n, t, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0], dtype=torch.float64)
    s = LossSettings(loss="gspo", clip_eps=0.02, clip_eps_high=0.03, is_cap=1.5)
    loss, stats = LOSSES["gspo"](logp, prox, behav, adv, mask, s)
    total, count, binds = torch.zeros((), dtype=torch.float64), 0, 0
    for i in range(n):
        m = mask[i].bool()
        ratio = torch.exp((logp[i][m] - prox[i][m]).mean())
        clipped = torch.clamp(ratio, 1 - 0.02, 1 + 0.03)
        weight = min(float(torch.exp((prox[i][m] - behav[i][m]).mean())), 1.5)
        term = -weight * torch.minimum(ratio * adv[i], clipped * adv[i])
        total = total + term * int(m.sum())
        count += int(m.sum())
        r = float(ratio)
        binds += int(m.sum()) * ((r > 1.03 and adv[i] > 0) or (r < 0.98 and adv[i] < 0))
    want = total / count
    assert float(loss) == pytest.approx(float(want), rel=1e-12)
    g1 = torch.autograd.grad(loss, logp, retain_graph=True)[0]
    g2 = torch.autograd.grad(want, logp)[0]
    assert torch.allclose(g1, g2, atol=1e-12)
    assert stats["clip_frac"] == pytest.approx(binds / count)
