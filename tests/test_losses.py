import torch

from pipeline.algo.losses import ADVANTAGES, LOSSES, LossSettings


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
