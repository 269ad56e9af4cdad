"""The objective's options beside the loss variant: aggregation (token-mean, per sequence,
Dr. GRPO's constant), masked importance sampling, and DAPO's over-long filter and soft
punishment in the torch trainer step; each against the rule written out, and micro-batches
against one pass for every aggregation."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import numpy as np
import typing

import pytest
import torch

from pipeline import config as C
from pipeline.algo.losses import (IS_MODES, LOSS_AGGREGATIONS, LOSSES, TOKEN_TERMS, LossSettings, advantages,
                                  objective, overlong_penalty, sequence_count, truncated)
from pipeline.config import ConfigError, RunConfig, TrainerConfig, load_config
from pipeline.engines.torch import microbatches, pad_batch, train_step
from pipeline.model.qwen import load_checkpoint, ragged_completion_logprobs
from pipeline.records import RolloutGroup, ScoredGroup

GROUP_SIZES = (4, 3, 5, 2)


def _batch(seed: int):
    """Float64 inputs: ragged mask (one completion without tokens), behaviour log-probs off
    the trainer's by up to ±1.5 (some weights above the cap), reference and entropy."""
    g = torch.Generator().manual_seed(seed)
    rewards = [torch.rand(k, generator=g, dtype=torch.float64) for k in GROUP_SIZES]
    n, t = sum(GROUP_SIZES), 7
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    lengths[5] = 0
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    logp = -3 * torch.rand(n, t, generator=g, dtype=torch.float64)
    behav = logp + 3 * torch.rand(n, t, generator=g, dtype=torch.float64) - 1.5
    ref = logp + 0.6 * torch.rand(n, t, generator=g, dtype=torch.float64) - 0.3
    entropy = 2 * torch.rand(n, t, generator=g, dtype=torch.float64)
    return advantages(rewards, "grpo"), logp, behav, ref, entropy, mask


def _reference_terms(logp, behav, adv, mask, *, loss, is_cap, is_mode):
    """Per-token loss terms written out one token at a time (on-policy: π_prox = π_θ, ratio 1);
    returns [(row, col, term)] for the valid tokens, and the cap's count."""
    out, capped = [], 0
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            if not mask[i, j]:
                continue
            raw = math.exp(float(logp[i, j].detach()) - float(behav[i, j]))
            over = raw > is_cap
            capped += over
            w = (0.0 if over else raw) if is_mode == "mask" else min(raw, is_cap)
            if loss == "tis":
                term = -w * float(adv[i]) * logp[i, j]
            else:  # decoupled_ppo, ratio exp(logp - logp.detach()) = 1 with gradient 1
                ratio = torch.exp(logp[i, j] - logp[i, j].detach())
                term = -w * ratio * float(adv[i])
            out.append((i, j, term))
    return out, capped


def _reference_loss(terms, mask, agg, *, norm_tokens, sequences=None, tokens=None):
    total = torch.zeros((), dtype=torch.float64)
    lens = mask.sum(1)
    n_tok = float(mask.sum()) if tokens is None else tokens
    for i, _, term in terms:
        if agg == "token-mean":
            total = total + term / n_tok
        elif agg == "seq-mean-token-mean":
            total = total + term / float(lens[i]) / (int((lens > 0).sum()) if sequences is None else sequences)
        else:
            total = total + term / ((mask.shape[0] if sequences is None else sequences) * norm_tokens)
    return total


@pytest.mark.parametrize("agg,loss,is_mode", list(itertools.product(LOSS_AGGREGATIONS, ("decoupled_ppo", "tis"),
                                                                     IS_MODES)))
def test_each_aggregation_and_cap_matches_the_rule_token_by_token(agg, loss, is_mode):
    adv, logp, behav, _, _, mask = _batch(seed=1)
    s = LossSettings(loss=loss, loss_agg=agg, is_cap=1.5, is_mode=is_mode, loss_norm_tokens=9)
    leaf = logp.clone().requires_grad_()
    got, stats = objective(leaf, behav, mask, adv, s)
    got.backward()
    ref_leaf = logp.clone().requires_grad_()
    terms, capped = _reference_terms(ref_leaf, behav, adv, mask, loss=loss, is_cap=1.5, is_mode=is_mode)
    want = _reference_loss(terms, mask, agg, norm_tokens=9)
    want.backward()
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-10, abs=1e-13)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-10, atol=1e-13)
    assert 0 < capped < mask.sum(), "the inputs exercise the cap on some tokens, not all"
    if is_mode == "mask":
        assert stats["is_masked_frac"] == pytest.approx(capped / float(mask.sum()), rel=1e-12)
        assert stats["is_truncated_frac"] == 0.0
        over = torch.exp(logp - behav) > 1.5
        assert torch.all(leaf.grad[over & mask.bool()] == 0), "masked tokens leave the gradient"
    else:
        assert "is_masked_frac" not in stats
        assert stats["is_truncated_frac"] == pytest.approx(capped / float(mask.sum()), rel=1e-12)
    # The statistics stay token means whatever the aggregation.
    base = objective(logp.clone().requires_grad_(), behav, mask, adv, dataclasses.replace(s, loss_agg="token-mean"))[1]
    for k in ("is_weight_mean", "mismatch_kl", "is_truncated_frac"):
        assert stats[k] == pytest.approx(base[k], rel=1e-12, abs=1e-15), k


def test_the_aggregations_really_differ_on_ragged_lengths():
    adv, logp, behav, _, _, mask = _batch(seed=2)
    losses = {agg: float(objective(logp.clone().requires_grad_(), behav, mask, adv,
                                   LossSettings(loss="tis", loss_agg=agg, loss_norm_tokens=7))[0])
              for agg in LOSS_AGGREGATIONS}
    assert len({round(v, 9) for v in losses.values()}) == 3, losses


@pytest.mark.parametrize("agg,loss", list(itertools.product(LOSS_AGGREGATIONS, ("decoupled_ppo", "tis", "gspo"))))
def test_parts_given_the_whole_normalisers_sum_to_the_whole_for_every_aggregation(agg, loss):
    adv, logp, behav, ref, entropy, mask = _batch(seed=3)
    prox = logp + 0.05 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    s = LossSettings(loss=loss, loss_agg=agg, kl_coef=0.1, is_cap=1.5, loss_norm_tokens=7)

    def run(sl, **kw):
        leaf = logp.clone().requires_grad_()
        out, st = objective(leaf[sl], behav[sl], mask[sl], adv[sl], s, ref_logp=ref[sl], entropy=entropy[sl],
                            prox_logp=prox[sl], **kw)
        out.backward()
        return float(out), st, leaf.grad

    full = run(slice(None))
    tokens, seqs = float(mask.sum()), float(sequence_count(mask, s))
    parts = [run(sl, tokens=tokens, sequences=seqs) for sl in (slice(0, 6), slice(6, 11), slice(11, None))]
    assert sum(p[0] for p in parts) == pytest.approx(full[0], rel=1e-12)
    torch.testing.assert_close(sum(p[2] for p in parts), full[2], rtol=1e-12, atol=1e-14)
    for k, v in full[1].items():
        assert sum(p[1][k] for p in parts) == pytest.approx(v, rel=1e-12, abs=1e-14), k
    # Each part's own normaliser would give another loss: the test has teeth.
    if agg != "token-mean":
        assert sum(run(sl)[0] for sl in (slice(0, 6), slice(6, 11), slice(11, None))) != pytest.approx(full[0])


def test_sequence_count_counts_what_each_aggregation_divides_by():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.float)
    assert sequence_count(mask, LossSettings(loss_agg="seq-mean-token-mean")) == 2
    assert sequence_count(mask, LossSettings(loss_agg="constant")) == 3  # a masked-out completion still counts


def test_gspo_masked_is_drops_whole_sequences():
    adv, logp, behav, _, _, mask = _batch(seed=5)
    mask[5, 0] = 1.0
    behav = logp.clone()
    behav[0] -= 2.0   # sequence 0: geometric-mean weight e^2 > cap
    behav[1] -= 0.1   # sequence 1: e^0.1, under the cap
    s = LossSettings(loss="gspo", is_cap=1.5, is_mode="mask")
    leaf = logp.clone().requires_grad_()
    loss, stats = objective(leaf, behav, mask, adv, s)
    loss.backward()
    assert torch.all(leaf.grad[0] == 0) and torch.any(leaf.grad[1] != 0)
    assert stats["is_masked_frac"] == pytest.approx(float(mask[0].sum() / mask.sum()))
    truncated_loss, tstats = objective(logp.clone().requires_grad_(), behav, mask, adv,
                                       dataclasses.replace(s, is_mode="truncate"))
    assert tstats["is_truncated_frac"] == pytest.approx(stats["is_masked_frac"])
    assert float(truncated_loss) != pytest.approx(float(loss))


def test_token_mean_is_the_registered_loss_times_the_share_bit_for_bit():
    """The default aggregation is the token mean every loss of LOSSES returns, unchanged."""
    adv, logp, behav, _, _, mask = _batch(seed=6)
    for name in TOKEN_TERMS:
        s = LossSettings(loss=name)
        got, _ = objective(logp, behav, mask, adv, s)
        want, _ = LOSSES[name](logp, logp, behav, adv, mask, s)
        assert torch.equal(got, want * (float(mask.sum()) / float(mask.sum())))


# ----------------------------------------------------------------------------- over-long completions


def test_overlong_penalty_is_the_linear_ramp_over_the_buffer_clipped():
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10])
    got = overlong_penalty(lengths, max_new_tokens=10, buffer=4, penalty=0.5)
    assert got.tolist() == pytest.approx([0, 0, 0, 0.125, 0.25, 0.375, 0.5])
    assert torch.all(overlong_penalty(lengths, max_new_tokens=10, buffer=0, penalty=1.0) == 0)
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalty(lengths, max_new_tokens=10, buffer=11, penalty=1.0)


def test_truncated_means_the_full_length_without_eos():
    lengths = torch.tensor([6, 6, 3])
    last = torch.tensor([5, 1, 4])
    assert truncated(lengths, last, max_new_tokens=6, eos_id=1).tolist() == [True, False, False]


EOS, MAX_NEW = 1, 6


def _group(i: int, completions: list[list[int]], rewards: list[float]) -> ScoredGroup:
    lens = np.array([len(c) for c in completions], dtype=np.int32)
    ids = np.concatenate([np.asarray(c, dtype=np.int32) for c in completions])
    ro = RolloutGroup(prompt_id=f"p{i:08d}", group_id=f"p{i:08d}:gen-0:1", generator_id="gen-0", prompt=" 1+2=",
                      prompt_ids=(np.arange(8, dtype=np.int32) + i) % 10 + 2, reference="3",
                      completions=tuple("x" * len(c) for c in completions), completion_ids=ids, completion_lens=lens,
                      behaviour_logprobs=-np.linspace(0.1, 2.0, ids.size).astype(np.float32), min_version=0,
                      max_version=0, created_at=time.time())
    r = np.asarray(rewards, dtype=np.float32)
    return ScoredGroup(rollout=ro, verifier_names=("format",), votes=np.ones((len(r), 1), dtype=np.float32),
                       rewards=r, truth=r.copy(), reward_mode="weaver", labelmodel_version=-1, verifier_id="ver-0",
                       scored_at=time.time())


def _overlong_groups() -> list[ScoredGroup]:
    """Lengths 2..6, some cut off at MAX_NEW (no eos), one of full length ending in eos."""
    return [
        _group(0, [[3, 4, 5, 6, 7, 8], [3, 4, EOS], [5, 6, 7, 8, 9, EOS], [4, 5, 6, 7, 8, 9]], [1.0, 0.0, 1.0, 0.5]),
        _group(1, [[7, 8, 9, 2, 3, EOS], [9, EOS], [2, 3, 4, 5, 6, 7], [6, 7, 8, 9, EOS]], [0.0, 1.0, 0.25, 1.0]),
        _group(2, [[2, 3, 4, EOS], [8, 9, 2, 3, 4, 5], [3, EOS], [4, 5, 6, 7, EOS]], [0.5, 1.0, 0.0, 0.75]),
    ]


def _cfg(**trainer) -> RunConfig:
    return RunConfig().with_overrides({"task.max_new_tokens": MAX_NEW, **{f"trainer.{k}": v for k, v in trainer.items()}})


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sgd_step(base, groups, cfg, **kw):
    """One train_step under SGD with lr 1 and no clipping: the parameters move by exactly the
    gradient, so equal parameters after it mean equal gradients."""
    model, tok = load_checkpoint(base)
    stats = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), groups, cfg, pad_id=tok.pad_id, **kw)
    return _params(model), stats


def _worst(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("agg,overlong_filter", list(itertools.product(LOSS_AGGREGATIONS, (False, True))))
def test_micro_batches_accumulate_to_one_pass_for_every_aggregation(tiny_base_model, agg, overlong_filter):
    groups = _overlong_groups()
    common = dict(grad_clip=1e9, loss_agg=agg, overlong_filter=overlong_filter, kl_coef=0.0)
    _, tok = load_checkpoint(tiny_base_model)
    _, _, _, mask = pad_batch(groups, tok.pad_id)
    assert len(microbatches(torch.arange(mask.shape[0]), mask, 7)) > 4, "really split"
    one, s1 = _sgd_step(tiny_base_model, groups, _cfg(**common), eos_id=EOS)
    many, s2 = _sgd_step(tiny_base_model, groups, _cfg(**common, max_tokens_per_microbatch=7), eos_id=EOS)
    assert _worst(one, many) < 1e-6
    assert s1["loss"] == pytest.approx(s2["loss"], rel=1e-5, abs=1e-7)
    assert s1["tokens"] == s2["tokens"]
    if agg != "token-mean":  # the aggregation changes the update
        tm, _ = _sgd_step(tiny_base_model, groups, _cfg(grad_clip=1e9, overlong_filter=overlong_filter), eos_id=EOS)
        assert _worst(one, tm) > 1e-5


def _manual_step(base, groups, cfg, *, rewards, keep):
    """The plain one-update step written out, with the given rewards and completions kept."""
    model, tok = load_checkpoint(base)
    settings = LossSettings.from_config(cfg.trainer, max_new_tokens=cfg.task.max_new_tokens)
    prompts, comp_ids, behav, mask = pad_batch(groups, tok.pad_id)
    adv = advantages(rewards, settings.advantage)
    model.train()
    logp = ragged_completion_logprobs(model, prompts, comp_ids, pad_id=tok.pad_id,
                                      temperature=cfg.generator.temperature)
    loss, stats = objective(logp, behav, mask * keep[:, None], adv, settings)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return _params(model), stats


def test_overlong_filter_masks_exactly_the_truncated_completions(tiny_base_model):
    groups = _overlong_groups()
    cfg = _cfg(grad_clip=1e9, overlong_filter=True)
    got, stats = _sgd_step(tiny_base_model, groups, cfg, eos_id=EOS)
    cut = torch.tensor([1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0], dtype=torch.float)  # full length, no eos
    want, want_stats = _manual_step(tiny_base_model, groups, cfg, rewards=[g.rewards for g in groups], keep=1 - cut)
    assert _worst(got, want) < 1e-6
    assert stats["overlong_frac"] == pytest.approx(4 / 12)
    assert stats["tokens"] == want_stats["tokens"] == sum(len(c) for g in groups
                                                          for c in g.rollout.split(g.rollout.completion_ids)) - 4 * 6
    # Off, the truncated completions train: another update, the same fraction reported.
    off, off_stats = _sgd_step(tiny_base_model, groups, _cfg(grad_clip=1e9), eos_id=EOS)
    assert _worst(got, off) > 1e-5 and off_stats["overlong_frac"] == stats["overlong_frac"]
    with pytest.raises(ValueError, match=r"trainer\.overlong_filter"):
        _sgd_step(tiny_base_model, groups, cfg)  # without the eos id it cannot tell


def test_overlong_buffer_lowers_the_rewards_before_the_advantages(tiny_base_model):
    groups = _overlong_groups()
    cfg = _cfg(grad_clip=1e9, overlong_buffer=3, overlong_penalty=0.5)
    got, stats = _sgd_step(tiny_base_model, groups, cfg, eos_id=EOS)
    # Lengths 4, 5, 6 lose 0.5 · (len − 3) / 3: 1/6, 1/3, 1/2; 3 and under nothing.
    lose = {2: 0.0, 3: 0.0, 4: 1 / 6, 5: 1 / 3, 6: 0.5}
    rewards = [np.asarray(g.rewards) - np.array([lose[int(n)] for n in g.rollout.completion_lens], dtype=np.float32)
               for g in groups]
    want, _ = _manual_step(tiny_base_model, groups, cfg, rewards=rewards, keep=torch.ones(12))
    assert _worst(got, want) < 1e-6
    lens = [int(n) for g in groups for n in g.rollout.completion_lens]
    assert stats["overlong_penalty_mean"] == pytest.approx(sum(lose[n] for n in lens) / 12)
    plain, _ = _sgd_step(tiny_base_model, groups, _cfg(grad_clip=1e9), eos_id=EOS)
    assert _worst(got, plain) > 1e-5
    with pytest.raises(ValueError, match=r"trainer\.overlong_buffer: must be at most task\.max_new_tokens"):
        _sgd_step(tiny_base_model, groups, _cfg(overlong_buffer=MAX_NEW + 1), eos_id=EOS)


def test_the_torch_engine_reports_the_overlong_fraction(tiny_base_model):
    from pipeline.engines.torch import TorchEngine

    engine = TorchEngine(load_config(None, {"model.base_dir": str(tiny_base_model), "task.max_new_tokens": "6",
                                            "trainer.overlong_filter": "true"}))
    stats = engine.train_step(_overlong_groups())
    assert stats["overlong_frac"] == pytest.approx(4 / 12)


def test_constant_aggregation_defaults_to_the_tasks_max_new_tokens():
    t = TrainerConfig(loss_agg="constant")
    assert LossSettings.from_config(t, max_new_tokens=64).loss_norm_tokens == 64
    assert LossSettings.from_config(TrainerConfig(loss_agg="constant", loss_norm_tokens=32),
                                    max_new_tokens=64).loss_norm_tokens == 32
    adv, logp, behav, _, _, mask = _batch(seed=8)
    with pytest.raises(ValueError, match="loss_norm_tokens"):
        objective(logp, behav, mask, adv, LossSettings.from_config(t))


# ----------------------------------------------------------------------------- config


def test_the_choice_fields_name_what_the_objective_implements():
    hints = typing.get_type_hints(C.TrainerConfig)
    assert C.choices(hints["loss_agg"]) == LOSS_AGGREGATIONS
    assert C.choices(hints["is_mode"]) == IS_MODES
    assert sorted(TOKEN_TERMS) == sorted(LOSSES), "every built-in loss aggregates every way"


@pytest.mark.parametrize("overrides, field", [
    ({"trainer.loss_norm_tokens": "-1"}, "trainer.loss_norm_tokens"),
    ({"trainer.loss_norm_tokens": "64"}, "trainer.loss_norm_tokens"),  # read only by loss_agg constant
    ({"trainer.overlong_buffer": "-1"}, "trainer.overlong_buffer"),
    ({"trainer.overlong_penalty": "-0.5"}, "trainer.overlong_penalty"),
    ({"trainer.overlong_penalty": "nan"}, "trainer.overlong_penalty"),
    ({"trainer.loss_agg": "seq-mean"}, "trainer.loss_agg"),
    ({"trainer.is_mode": "clip"}, "trainer.is_mode"),
    ({"trainer.loss_agg": "constant", "trainer.loss": "examples/my_loss.py:sequence_mean_ppo"}, "trainer.loss_agg"),
    ({"trainer.backend": "torchtitan", "trainer.loss_agg": "seq-mean-token-mean"}, "trainer.loss_agg"),
    ({"trainer.backend": "torchtitan", "trainer.overlong_filter": "true"}, "trainer.overlong_filter"),
    ({"trainer.backend": "torchtitan", "trainer.overlong_buffer": "4"}, "trainer.overlong_buffer"),
])
def test_bad_option_values_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=rf"^{field.replace('.', chr(92) + '.')}: must be"):
        load_config(overrides=overrides)


def test_the_options_are_accepted_where_they_take_effect():
    cfg = load_config(overrides={"trainer.loss_agg": "constant", "trainer.loss_norm_tokens": "64",
                                 "trainer.advantage": "drgrpo", "trainer.overlong_filter": "true",
                                 "trainer.overlong_buffer": "4", "trainer.overlong_penalty": "0.5",
                                 "trainer.is_mode": "mask", "trainer.loss": "gspo"})
    assert LossSettings.from_config(cfg.trainer).loss_agg == "constant"
    # The cap's mode acts inside the loss, so the torchtitan engine honours it.
    assert load_config(overrides={"trainer.backend": "torchtitan", "trainer.is_mode": "mask"}).trainer.is_mode == "mask"
