"""The ``torch`` backends: the embedded CPU default of both the generator and the trainer.

Both run where ``generator.device`` and ``trainer.device`` say (:func:`torch_device`): the
CPU, or the first GPU; the model's weights stay float32 on either.

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

from pipeline.engines import Sampled
from pipeline.engines.slots import SlotSampler, row_generator
from pipeline.engines.torch_state import read_torch_state, write_torch_state
from pipeline.config import RunConfig
from pipeline.algo.losses import LossSettings, advantages, objective, overlong_penalty, sequence_count, truncated
from pipeline.engines.episodes import play
from pipeline.engines.lora import AdapterMerger, LoraState
from pipeline.model.qwen import (load_checkpoint, load_state_tensors, ragged_completion_logprobs, sample,
                                 save_checkpoint)
from pipeline.records import ScoredGroup


def torch_device(kind: str, field: str) -> torch.device:
    """``cpu``, ``cuda`` (the first GPU) or ``auto`` (cuda when torch sees a GPU) as a device;
    ``field`` names the setting in the error when cuda is asked for and there is none."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{field}: 'cuda', but torch {torch.__version__} sees no GPU")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"{field}: one of auto, cpu, cuda; got {kind!r}")
    return torch.device(kind)


def by_length(prompts: list[np.ndarray]) -> dict[int, list[int]]:
    """Indices of ``prompts`` grouped by length, in first-seen order."""
    out: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        out.setdefault(int(p.size), []).append(i)
    return out


def filler(batch: list[np.ndarray], k: int, vocab_size: int) -> list[np.ndarray]:
    """``k`` prompts of the batch's length, distinct from each other and from ``batch`` (the
    sampler runs each distinct prompt's forward once, so copies would not fill the batch)."""
    seen = {p.tobytes() for p in (np.asarray(q, dtype=np.int64) for q in batch)}
    out, base, shift = [], np.asarray(batch[-1], dtype=np.int64), 1
    while len(out) < k and shift <= vocab_size * vocab_size:  # a tiny vocabulary may run out
        cand = base.copy()
        cand[0] = (cand[0] + shift) % vocab_size
        cand[-1] = (cand[-1] + shift // vocab_size) % vocab_size
        shift += 1
        if cand.tobytes() not in seen:
            seen.add(cand.tobytes())
            out.append(cand)
    return out


def sample_prompts(model, prompts: list[np.ndarray], *, n: int, max_new_tokens: int, temperature: float,
                   eos_id: int, pad_id: int, generator: torch.Generator | None = None,
                   seeds: list[int] | None = None, pad_prompts: int = 0) -> list[Sampled]:
    """``n`` samples of each prompt with the torch sampler, one batch per prompt length (on the
    model's device; ``generator`` must be a generator of that device).

    ``seeds``: one sampling seed per prompt; completion j of prompt i then draws from
    ``row_generator(seeds[i], j)`` instead of ``generator``. ``pad_prompts``: when every prompt
    has one length, a batch of fewer is filled up to that many with prompts of its own
    (:func:`filler`: sampled, then dropped). Together they make a prompt's samples the same whichever worker
    samples it and whatever prompts share its batch: on the CPU a row's logits do not depend
    on the other rows of a batch of the same shape, but can differ in the last bit between
    batch sizes (docs/determinism.md)."""
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    out: list[Sampled | None] = [None] * len(prompts)
    device = model.get_input_embeddings().weight.device
    groups = by_length(prompts)
    for idx in groups.values():
        batch = [prompts[i] for i in idx]
        if len(groups) == 1 and pad_prompts > len(idx):
            batch += filler(batch, pad_prompts - len(idx), int(model.config.vocab_size))
        ids = torch.from_numpy(np.stack(batch).astype(np.int64)).repeat_interleave(n, dim=0)
        rngs = generator
        if seeds is not None:
            rngs = [row_generator(seeds[i], j, device) for i in idx for j in range(n)]
            rngs += [row_generator(-1, j, device) for j in range(n * (len(batch) - len(idx)))]  # the filler's
        tokens, logprobs, lengths = sample(model, ids.to(device), max_new_tokens=max_new_tokens,
                                           temperature=temperature, eos_id=eos_id, pad_id=pad_id, generator=rngs)
        tokens, logprobs, lengths = tokens.cpu().numpy(), logprobs.cpu().numpy(), lengths.cpu().numpy()
        for k, i in enumerate(idx):
            mine = slice(k * n, (k + 1) * n)
            out[i] = Sampled(tokens=tokens[mine].astype(np.int32), logprobs=logprobs[mine].astype(np.float32),
                             lengths=lengths[mine].astype(np.int32))
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
    """``generator.backend = "torch"``.

    ``seeded``: :meth:`generate` takes a sampling seed per prompt and the slot sampler's
    ``add`` a seed per group (the generator stage passes them: each prompt's samples depend on
    its seed alone, not on the worker or the batch); without them, draws come from the worker's
    own generator (``generator.seed`` mixed with the worker id)."""

    seeded = True

    def __init__(self, cfg: RunConfig, *, worker_id: str) -> None:
        g = cfg.generator
        torch.set_num_threads(g.threads)
        self.device = torch_device(g.device, "generator.device")
        self.model, self.tokenizer = load_checkpoint(cfg.model.base_dir)
        self.model.to(self.device).eval()
        self.adapters = None
        if cfg.weights.payload == "adapter":  # versions carry LoRA adapters: merged here, onto the base
            self.adapters = AdapterMerger.of_model(self.model, cfg.trainer.lora_alpha / cfg.trainer.lora_rank)
        self.vocab_size = int(self.model.config.vocab_size)
        self.rng = torch.Generator(self.device).manual_seed(g.seed * 1_000_003 + zlib.crc32(worker_id.encode()))
        self.temperature = g.temperature
        self.batch_prompts = g.prompts_per_batch

    def generate(self, prompts: list[np.ndarray], *, n: int, max_new_tokens: int, temperature: float,
                 seeds: list[int] | None = None) -> list[Sampled]:
        return sample_prompts(self.model, prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                              eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id, generator=self.rng,
                              seeds=seeds, pad_prompts=self.batch_prompts if seeds is not None else 0)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.adapters is not None:
            self.adapters.load(tensors)
        else:
            load_state_tensors(self.model, tensors)

    def continuous(self, *, slots: int) -> SlotSampler:
        """A slot sampler on this engine's model (``generator.swap`` step/drain); weights loaded
        into the model take effect at its next decode step."""
        return SlotSampler(self.model, slots=slots, temperature=self.temperature, eos_id=self.tokenizer.eos_id,
                           pad_id=self.tokenizer.pad_id, generator=self.rng)

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


def sampled_mask(groups: list[ScoredGroup], shape: tuple[int, int]) -> torch.Tensor:
    """[N, T] in the order of :func:`pad_batch`: 1 on the tokens the policy sampled, 0 on the
    observation tokens an environment appended to an episode (and on padding)."""
    out = torch.zeros(shape)
    i = 0
    for g in groups:
        ro = g.rollout
        flat = np.ones(ro.completion_ids.size, dtype=np.float32) if ro.loss_mask is None else ro.loss_mask
        for piece in ro.split(flat):
            out[i, : piece.size] = torch.from_numpy(np.asarray(piece, dtype=np.float32))
            i += 1
    return out


def microbatches(rows: torch.Tensor, mask: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """``rows`` (completion indices) cut into consecutive pieces of at most ``max_tokens`` valid
    tokens each (a completion longer than that is a piece alone); 0: one piece."""
    if max_tokens <= 0:
        return [rows]
    pieces, cur, used = [], [], 0
    for i in rows.tolist():
        n = int(mask[i].sum())
        if cur and used + n > max_tokens:
            pieces.append(torch.tensor(cur))
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        pieces.append(torch.tensor(cur))
    return pieces


def train_step(model, opt, groups: list[ScoredGroup], cfg: RunConfig, *, pad_id: int, eos_id: int | None = None,
               ref_model=None, step: int = 0) -> dict:
    """One trainer step (docs/design.md §4) on ``groups``: ``trainer.ppo_epochs`` passes over the
    batch, each in ``trainer.minibatches`` optimizer updates (clip, AdamW), each update's
    gradient accumulated over micro-batches of at most ``trainer.max_tokens_per_microbatch``
    tokens (the same update as one pass over the minibatch: every piece is normalised by the
    minibatch's token count, or its completion count under ``trainer.loss_agg``). With more
    than one update the proximal log-probabilities are computed once, before the first
    (AReaL's decoupled objective clips against them); with one epoch and one minibatch the
    proximal policy is the current one and the ratio is 1. The statistics are token means
    over every update of the step.

    Over-long completions (DAPO), before the advantages: ``trainer.overlong_buffer`` lowers
    the rewards of long completions (:func:`pipeline.algo.losses.overlong_penalty`), and
    ``trainer.overlong_filter`` masks the truncated ones out of the loss. A completion is
    truncated when it has ``task.max_new_tokens`` tokens and its last is not ``eos_id``
    (the tokenizer's; without it the step cannot tell, and refuses the filter). Statistics
    beside the loss's: ``overlong_frac`` (the batch's truncated completions, with
    ``eos_id``) and ``overlong_penalty_mean`` (with a buffer)."""
    t = cfg.trainer
    max_new = cfg.task.max_new_tokens
    settings = LossSettings.from_config(t, max_new_tokens=max_new)
    prompts, comp_ids, behav, mask = pad_batch(groups, pad_id)
    n = comp_ids.shape[0]
    lengths = mask.sum(dim=1).long()
    extra: dict[str, float] = {}
    cut = None
    if eos_id is not None:
        last = comp_ids.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
        cut = truncated(lengths, last, max_new_tokens=max_new, eos_id=eos_id)
        extra["overlong_frac"] = float(cut.float().mean())
    elif t.overlong_filter:
        raise ValueError("trainer.overlong_filter: the step needs the tokenizer's eos_id to tell truncated "
                         "completions (train_step(..., eos_id=))")
    rewards = [g.rewards for g in groups]
    if t.overlong_buffer > max_new:
        raise ValueError(f"trainer.overlong_buffer: must be at most task.max_new_tokens ({max_new}); "
                         f"got {t.overlong_buffer!r}")
    if t.overlong_buffer > 0:
        pen = overlong_penalty(lengths, max_new_tokens=max_new, buffer=t.overlong_buffer, penalty=t.overlong_penalty)
        rewards = [torch.as_tensor(np.asarray(r)) for r in rewards]
        rewards = [r - p.to(r.dtype) for r, p in zip(rewards, torch.split(pen, [len(r) for r in rewards]))]
        extra["overlong_penalty_mean"] = float(pen.mean())
    adv = advantages(rewards, settings.advantage)
    # The loss's mask: sampled tokens only (an episode's observation tokens out), and the
    # truncated completions out under the filter. Micro-batches are cut by ``mask`` (what a
    # piece costs to run), normalisers count ``loss_mask``.
    loss_mask = mask * sampled_mask(groups, tuple(mask.shape))
    device = model.get_input_embeddings().weight.device
    if device.type != "cpu":  # the batch goes where the model is; the statistics come back as floats
        prompts = [p.to(device) for p in prompts]
        comp_ids, behav, mask, loss_mask, adv = (x.to(device) for x in (comp_ids, behav, mask, loss_mask, adv))
    if t.overlong_filter:
        loss_mask = loss_mask * (~cut).to(loss_mask.device, mask.dtype)[:, None]
    # The policy being optimised is the one the generators sample: softmax(logits / temperature).
    temp = cfg.generator.temperature

    def logprobs(net, rows: torch.Tensor, **kw):
        return ragged_completion_logprobs(net, [prompts[i] for i in rows.tolist()], comp_ids[rows], pad_id=pad_id,
                                          temperature=temp, **kw)

    updates = t.ppo_epochs * min(t.minibatches, n)
    everyone = torch.arange(n)
    prox = None
    if updates > 1:
        with torch.no_grad():
            prox = torch.cat([logprobs(model, rows) for rows in microbatches(everyone, mask, t.max_tokens_per_microbatch)]
                             ) if t.max_tokens_per_microbatch else logprobs(model, everyone)
    model.train()
    totals: dict[str, float] = {}
    weight_sum, norms = 0.0, []
    order = torch.Generator().manual_seed(t.seed * 1_000_003 + step)
    for _epoch in range(t.ppo_epochs):
        rows_all = torch.randperm(n, generator=order) if min(t.minibatches, n) > 1 else everyone
        for mb in torch.tensor_split(rows_all, min(t.minibatches, n)):
            opt.zero_grad(set_to_none=True)
            mb_tokens = float(loss_mask[mb].sum())
            mb_seqs = float(sequence_count(loss_mask[mb], settings))
            pieces = microbatches(mb, mask, t.max_tokens_per_microbatch)
            stats_mb: dict[str, float] = {}
            for rows in pieces:
                logp, entropy = logprobs(model, rows, with_entropy=True)
                ref_logp = None
                if ref_model is not None:
                    with torch.no_grad():
                        ref_logp = logprobs(ref_model, rows)
                whole = len(pieces) == 1 and prox is None
                loss, st = objective(logp, behav[rows], loss_mask[rows], adv[rows], settings, ref_logp=ref_logp,
                                     entropy=entropy, tokens=None if whole else max(mb_tokens, 1.0),
                                     sequences=None if whole else max(mb_seqs, 1.0),
                                     prox_logp=None if prox is None else prox[rows])
                loss.backward()
                for k, v in st.items():
                    stats_mb[k] = stats_mb.get(k, 0.0) + v
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)))
            opt.step()
            # Token means of this update, weighted by its tokens into the step's means.
            for k, v in stats_mb.items():
                totals[k] = totals.get(k, 0.0) + (v if k == "tokens" else v * mb_tokens)
            weight_sum += mb_tokens
    model.eval()
    if len(norms) == 1:
        stats = {**stats_mb, "tokens": int(stats_mb["tokens"])}
    else:
        stats = {k: v / max(weight_sum, 1.0) for k, v in totals.items() if k != "tokens"}
        stats["tokens"] = int(totals["tokens"] / t.ppo_epochs)  # the batch's tokens, once
        stats["updates"] = len(norms)
    return {"loss": stats["loss"], "grad_norm": norms[-1] if len(norms) == 1 else max(norms), **stats, **extra}


def warmup_schedule(opt: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear learning-rate warm-up over ``warmup_steps``, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / (warmup_steps + 1)))


class TorchEngine:
    """``trainer.backend = "torch"``: one process, AdamW, checkpoints as safetensors.

    With ``trainer.lora_rank > 0`` the model carries PEFT LoRA adapters
    (:mod:`pipeline.engines.lora`): only they train and are in the optimizer, the KL
    reference is the same model with its adapters off, :meth:`weights` hands out the merged
    full weights under the plain HF names, checkpoints hold the adapters and their optimizer
    state, and :meth:`export_hf` writes a merged plain checkpoint."""

    def __init__(self, cfg: RunConfig) -> None:
        t = cfg.trainer
        self.cfg = cfg
        torch.manual_seed(t.seed)
        torch.set_num_threads(t.threads)
        self.device = torch_device(t.device, "trainer.device")
        self.model, self.tokenizer = load_checkpoint(cfg.model.base_dir)
        self.model.to(self.device).eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.lora = None
        if t.lora_rank > 0:
            self.lora = LoraState(self.model, t, base_dir=cfg.model.base_dir)
            self.ref_model = self.lora.base_view() if t.kl_coef > 0 else None
            params = [p for p in self.model.parameters() if p.requires_grad]
        else:
            self.ref_model = load_checkpoint(cfg.model.base_dir)[0].to(self.device).eval() if t.kl_coef > 0 else None
            params = list(self.model.parameters())
        self.trainable_params = sum(p.numel() for p in params)
        self.opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
        self.sched = warmup_schedule(self.opt, t.warmup_steps)
        self.steps = 0

    def train_step(self, groups: list[ScoredGroup]) -> dict:
        self.steps += 1
        stats = train_step(self.model, self.opt, groups, self.cfg, pad_id=self.tokenizer.pad_id,
                           eos_id=self.tokenizer.eos_id, ref_model=self.ref_model, step=self.steps)
        return {**stats, "trainable_params": self.trainable_params}

    def lr_step(self) -> None:
        self.sched.step()

    def weights(self) -> dict[str, torch.Tensor]:
        if self.lora is not None:
            return self.lora.merged_weights()
        return {name: t.detach() for name, t in self.model.state_dict().items()}

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The LoRA A/B tensors alone (``<module>.lora_A.weight`` [r, in], ``<module>.lora_B.weight``
        [out, r]; a module's weight is W + (lora_alpha / lora_rank)·B·A)."""
        if self.lora is None:
            raise ValueError("trainer.lora_rank: adapter_tensors needs LoRA training (trainer.lora_rank > 0); "
                             "it is 0")
        return self.lora.adapter_tensors()

    def greedy(self, prompts: list[np.ndarray], *, max_new_tokens: int) -> list[str]:
        return greedy_decode(self.model, self.tokenizer, prompts, max_new_tokens=max_new_tokens)

    def play(self, prompts: list[np.ndarray], references: list[str], factory, *, max_turns: int,
             max_new_tokens: int, texts: list[str] | None = None, chat=None, max_turn_tokens: int = 0) -> list:
        """Greedy held-out episodes through ``factory``'s environment (pipeline.engines.episodes)."""
        return play(self.model, self.tokenizer, prompts, references, factory, max_turns=max_turns,
                    max_new_tokens=max_new_tokens, texts=texts, chat=chat, max_turn_tokens=max_turn_tokens)

    def save_state(self, directory: Path) -> dict:
        # ``steps`` seeds each step's minibatch order: a resumed trainer continues its count.
        if self.lora is not None:
            return {"sched": self.sched.state_dict(), "steps": self.steps, **self.lora.save(directory, self.opt)}
        groups = write_torch_state(directory, self.model, self.opt)
        return {"sched": self.sched.state_dict(), "steps": self.steps, "param_groups": groups}

    def load_state(self, directory: Path, extras: dict) -> None:
        if self.lora is not None:
            self.lora.load(directory, self.opt, extras)
        elif "lora" in extras:
            raise ValueError(f"trainer.lora_rank: the checkpoint {directory} holds LoRA adapters "
                             f"({extras['lora']}) and this config trains every weight (lora_rank 0); "
                             "a checkpoint resumes only under the settings that wrote it")
        else:
            read_torch_state(directory, self.model, self.opt, extras["param_groups"])
        self.sched.load_state_dict(extras["sched"])
        self.steps = int(extras.get("steps", self.steps))

    def export_hf(self, directory: Path) -> None:
        if self.lora is not None:
            # A plain model of the base's architecture holding the merged weights.
            plain = load_checkpoint(self.cfg.model.base_dir)[0]
            load_state_tensors(plain, self.lora.merged_weights())
            save_checkpoint(plain, self.tokenizer, directory, tokenizer_dir=self.cfg.model.base_dir)
            return
        save_checkpoint(self.model, self.tokenizer, directory, tokenizer_dir=self.cfg.model.base_dir)

    def close(self) -> None:
        pass
