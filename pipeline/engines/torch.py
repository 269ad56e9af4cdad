"""The ``torch`` backends: the embedded CPU default of both the generator and the trainer.

:class:`TorchGenerator` samples with :func:`pipeline.model.qwen.sample` (KV cache, prompt
forward once per distinct prompt); prompts of different lengths are sampled in one
batch per length, since the sampler uses no attention mask. :class:`TorchEngine` is
one process training a ``transformers`` model with AdamW; its log-probabilities come
from :func:`pipeline.model.qwen.ragged_completion_logprobs`, which agrees with the sampler
token for token (``tests/test_model.py``).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import torch

from pipeline.run import checkpoint
from pipeline.engines import Sampled
from pipeline.config import RunConfig
from pipeline.algo.losses import LossSettings, advantages, objective
from pipeline.model.qwen import (load_checkpoint, load_state_tensors, ragged_completion_logprobs, sample,
                                 save_checkpoint)
from pipeline.records import ScoredGroup


def by_length(prompts: list[np.ndarray]) -> dict[int, list[int]]:
    """Indices of ``prompts`` grouped by length, in first-seen order."""
    out: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        out.setdefault(int(p.size), []).append(i)
    return out


def sample_prompts(model, prompts: list[np.ndarray], *, n: int, max_new_tokens: int, temperature: float,
                   eos_id: int, pad_id: int, generator: torch.Generator | None = None) -> list[Sampled]:
    """``n`` samples of each prompt with the torch sampler, one batch per prompt length."""
    out: list[Sampled | None] = [None] * len(prompts)
    for idx in by_length(prompts).values():
        ids = torch.from_numpy(np.stack([prompts[i] for i in idx]).astype(np.int64)).repeat_interleave(n, dim=0)
        tokens, logprobs, lengths = sample(model, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                           eos_id=eos_id, pad_id=pad_id, generator=generator)
        tokens, logprobs, lengths = tokens.numpy(), logprobs.numpy(), lengths.numpy()
        for k, i in enumerate(idx):
            rows = slice(k * n, (k + 1) * n)
            out[i] = Sampled(tokens=tokens[rows].astype(np.int32), logprobs=logprobs[rows].astype(np.float32),
                             lengths=lengths[rows].astype(np.int32))
    return out  # type: ignore[return-value]


def greedy_decode(model, tokenizer, prompts: list[np.ndarray], *, max_new_tokens: int,
                  batch_size: int = 1000) -> list[str]:
    """Decoded greedy completions of ``prompts`` (any lengths), in order, ``batch_size`` at a time."""
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        for s in sample_prompts(model, prompts[start: start + batch_size], n=1, max_new_tokens=max_new_tokens,
                                temperature=0.0, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id):
            out.append(tokenizer.decode(s.tokens[0].tolist()))
    return out


class TorchGenerator:
    """``generator.backend = "torch"``."""

    def __init__(self, cfg: RunConfig, *, worker_id: str) -> None:
        g = cfg.generator
        torch.set_num_threads(g.threads)
        self.model, self.tokenizer = load_checkpoint(cfg.model.base_dir)
        self.model.eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.rng = torch.Generator().manual_seed(g.seed * 1_000_003 + zlib.crc32(worker_id.encode()))

    def generate(self, prompts: list[np.ndarray], *, n: int, max_new_tokens: int, temperature: float) -> list[Sampled]:
        return sample_prompts(self.model, prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                              eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id, generator=self.rng)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        load_state_tensors(self.model, tensors)

    def close(self) -> None:
        pass


def pad_batch(groups: list[ScoredGroup], pad_id: int):
    """All completions of ``groups``: prompt ids (a list of 1-D tensors, one per completion),
    completion ids [N,T], behaviour log-probs [N,T] and the completion mask [N,T]."""
    prompts, comps, behav = [], [], []
    for g in groups:
        ro = g.rollout
        p = torch.from_numpy(ro.prompt_ids.astype(np.int64))
        for ids, lp in zip(ro.split(ro.completion_ids), ro.split(ro.behaviour_logprobs)):
            prompts.append(p)
            comps.append(ids)
            behav.append(lp)
    n, t = len(comps), max(len(c) for c in comps)
    ids = torch.full((n, t), pad_id, dtype=torch.long)
    lp = torch.zeros((n, t))
    mask = torch.zeros((n, t))
    for i, (c, b) in enumerate(zip(comps, behav)):
        ids[i, : len(c)] = torch.from_numpy(c.astype(np.int64))
        lp[i, : len(b)] = torch.from_numpy(b.copy())
        mask[i, : len(c)] = 1
    return prompts, ids, lp, mask


def train_step(model, opt, groups: list[ScoredGroup], cfg: RunConfig, *, pad_id: int, ref_model=None) -> dict:
    """One GRPO step (docs/design.md §4) on ``groups``: :func:`pipeline.algo.losses.objective` on the
    model's log-probabilities (and the reference's, when kept), clip, AdamW."""
    settings = LossSettings.from_config(cfg.trainer)
    prompts, comp_ids, behav, mask = pad_batch(groups, pad_id)
    adv = advantages([g.rewards for g in groups], settings.advantage)
    model.train()
    # The policy being optimised is the one the generators sample: softmax(logits / temperature).
    temp = cfg.generator.temperature
    logp, entropy = ragged_completion_logprobs(model, prompts, comp_ids, pad_id=pad_id, with_entropy=True,
                                               temperature=temp)
    ref_logp = None
    if ref_model is not None:
        with torch.no_grad():
            ref_logp = ragged_completion_logprobs(ref_model, prompts, comp_ids, pad_id=pad_id, temperature=temp)
    loss, stats = objective(logp, behav, mask, adv, settings, ref_logp=ref_logp, entropy=entropy)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
    opt.step()
    model.eval()
    return {"loss": stats["loss"], "grad_norm": float(grad_norm), **stats}


def warmup_schedule(opt: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear learning-rate warm-up over ``warmup_steps``, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / (warmup_steps + 1)))


class TorchEngine:
    """``trainer.backend = "torch"``: one process, AdamW, checkpoints as safetensors."""

    def __init__(self, cfg: RunConfig) -> None:
        t = cfg.trainer
        self.cfg = cfg
        torch.manual_seed(t.seed)
        torch.set_num_threads(t.threads)
        self.model, self.tokenizer = load_checkpoint(cfg.model.base_dir)
        self.model.eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.ref_model = load_checkpoint(cfg.model.base_dir)[0].eval() if t.kl_coef > 0 else None
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.sched = warmup_schedule(self.opt, t.warmup_steps)

    def train_step(self, groups: list[ScoredGroup]) -> dict:
        return train_step(self.model, self.opt, groups, self.cfg, pad_id=self.tokenizer.pad_id,
                          ref_model=self.ref_model)

    def lr_step(self) -> None:
        self.sched.step()

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: t.detach() for name, t in self.model.state_dict().items()}

    def greedy(self, prompts: list[np.ndarray], *, max_new_tokens: int) -> list[str]:
        return greedy_decode(self.model, self.tokenizer, prompts, max_new_tokens=max_new_tokens)

    def save_state(self, directory: Path) -> dict:
        groups = checkpoint.write_torch_state(directory, self.model, self.opt)
        return {"sched": self.sched.state_dict(), "param_groups": groups}

    def load_state(self, directory: Path, extras: dict) -> None:
        checkpoint.read_torch_state(directory, self.model, self.opt, extras["param_groups"])
        self.sched.load_state_dict(extras["sched"])

    def export_hf(self, directory: Path) -> None:
        save_checkpoint(self.model, self.tokenizer, directory, tokenizer_dir=self.cfg.model.base_dir)

    def close(self) -> None:
        pass
