"""PPO updates in the torch engine: epochs and minibatches that move the ratio off 1, and
gradient accumulation over micro-batches that gives the same update as one pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import make_scored

from pipeline.algo.losses import LossSettings, advantages, objective
from pipeline.config import ConfigError, RunConfig, load_config
from pipeline.inert import Situation, refuse_inert
from pipeline.engines.torch import microbatches, pad_batch, train_step
from pipeline.model.qwen import load_checkpoint, ragged_completion_logprobs


def _groups(n: int = 4) -> list:
    rng = np.random.default_rng(0)
    return [make_scored(prompt_id=f"p{i:08d}", rewards=rng.random(4).astype(np.float32)) for i in range(n)]


def _cfg(**trainer) -> RunConfig:
    return RunConfig().with_overrides({f"trainer.{k}": v for k, v in trainer.items()})


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _old_step(model, opt, groups, cfg, *, pad_id: int) -> dict:
    """The one-update step as it was before epochs and minibatches existed, written out."""
    settings = LossSettings.from_config(cfg.trainer)
    prompts, comp_ids, behav, mask = pad_batch(groups, pad_id)
    adv = advantages([g.rewards for g in groups], settings.advantage)
    model.train()
    logp, entropy = ragged_completion_logprobs(model, prompts, comp_ids, pad_id=pad_id, with_entropy=True,
                                               temperature=cfg.generator.temperature)
    loss, stats = objective(logp, behav, mask, adv, settings, entropy=entropy)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
    opt.step()
    model.eval()
    return stats


def test_one_epoch_one_minibatch_is_the_plain_update_bit_for_bit(tiny_base_model):
    groups, cfg = _groups(), _cfg()
    a, tok = load_checkpoint(tiny_base_model)
    b, _ = load_checkpoint(tiny_base_model)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-3)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3)
    stats = train_step(a, opt_a, groups, cfg, pad_id=tok.pad_id)
    old = _old_step(b, opt_b, groups, cfg, pad_id=tok.pad_id)
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert stats["ratio_mean"] == old["ratio_mean"] == 1.0 and stats["clip_frac"] == 0.0


def test_epochs_and_minibatches_move_the_ratio_and_the_clip_binds(tiny_base_model):
    groups, cfg = _groups(8), _cfg(ppo_epochs=2, minibatches=4, lr=0.05, clip_eps=0.05)
    model, tok = load_checkpoint(tiny_base_model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    stats = train_step(model, opt, groups, cfg, pad_id=tok.pad_id)
    assert stats["updates"] == 8
    assert stats["clip_frac"] > 0, stats
    assert abs(stats["ratio_mean"] - 1.0) > 1e-4, stats


def test_micro_batches_accumulate_to_the_single_pass_gradient(tiny_base_model):
    """Plain SGD with lr 1 and no clipping: the parameters move by exactly the gradient, so
    equal updates mean equal gradients."""
    groups = _groups(4)
    cfg_one, cfg_micro = _cfg(grad_clip=1e9), _cfg(grad_clip=1e9, max_tokens_per_microbatch=7)
    a, tok = load_checkpoint(tiny_base_model)
    b, _ = load_checkpoint(tiny_base_model)
    _, _, _, mask = pad_batch(groups, tok.pad_id)
    assert len(microbatches(torch.arange(mask.shape[0]), mask, 7)) > 3, "really split"
    sa = train_step(a, torch.optim.SGD(a.parameters(), lr=1.0), groups, cfg_one, pad_id=tok.pad_id)
    sb = train_step(b, torch.optim.SGD(b.parameters(), lr=1.0), groups, cfg_micro, pad_id=tok.pad_id)
    pa, pb = _params(a), _params(b)
    worst = max(float((pa[k] - pb[k]).abs().max()) for k in pa)
    assert worst < 1e-6, worst
    assert sa["loss"] == pytest.approx(sb["loss"], rel=1e-5, abs=1e-7)
    assert sa["tokens"] == sb["tokens"]


def test_microbatches_respect_the_token_budget():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    pieces = microbatches(torch.arange(4), mask, 4)
    assert [p.tolist() for p in pieces] == [[0], [1], [2], [3]] or all(
        float(mask[p].sum()) <= 4 or len(p) == 1 for p in pieces)
    assert sorted(i for p in pieces for i in p.tolist()) == [0, 1, 2, 3]
    assert [p.tolist() for p in microbatches(torch.arange(4), mask, 0)] == [[0, 1, 2, 3]]


def test_clip_eps_with_one_update_per_batch_is_refused_as_inert():
    cfg = load_config(overrides={"trainer.clip_eps": "0.1"})
    with pytest.raises(ConfigError, match=r"trainer\.clip_eps = .*ratio is 1"):
        refuse_inert(cfg, Situation())
    refuse_inert(load_config(overrides={"trainer.clip_eps": "0.1", "trainer.ppo_epochs": "2"}), Situation())


def test_a_step_that_trains_nothing_leaves_the_lr_schedule_alone_and_warns_nothing(tiny_base_model, redis_client,
                                                                                  tmp_path, recwarn):
    from pipeline.bus.streams import Entry
    from pipeline.consumers.trainer import Trainer
    from pipeline.keys import Keys
    from pipeline.observe.logs import setup_logging

    cfg = load_config(overrides={"model.base_dir": str(tiny_base_model), "run_id": "no-signal",
                                 "trainer.groups_per_step": "2"})
    log = setup_logging(tmp_path / "logs", stage="trainer", worker="trainer")
    trainer = Trainer(cfg, redis_client, Keys.of(cfg.run_id, cfg.redis), log, run_dir=None)
    try:
        same = [(Entry(id=f"1-{i}".encode(), payload=None), make_scored(prompt_id=f"p{i:08d}", rewards=[1, 1, 1, 1]))
                for i in range(2)]
        trainer.step(same, wait_s=0.0)  # every group's rewards equal: no signal, no update
        assert trainer.engine.sched.last_epoch == 0 and trainer.version == 1
        assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in recwarn]
        trainer.step([(Entry(id=f"2-{i}".encode(), payload=None), make_scored(prompt_id=f"q{i:08d}", version=1))
                      for i in range(2)], wait_s=0.0)
        assert trainer.engine.sched.last_epoch == 1 and trainer.version == 2
    finally:
        trainer.close()
