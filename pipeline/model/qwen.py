"""The tiny policy model (a stock Qwen3) and the torch kernels every stage shares.

The generator samples with :func:`sample`, the trainer re-scores the same tokens
with :func:`completion_logprobs`; the two must agree on the log-probability of a
sampled token (at temperature 1) or the importance ratios of the RL objective are
wrong from the first step. ``tests/test_model.py`` pins that invariant.

The model is a stock ``transformers`` Qwen3 so that checkpoints are plain HF
directories (safetensors + ``config.json`` + ``tokenizer.json``) that any HF-aware
inference engine can load.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

from pipeline.model.tokenizer import MAX_POSITIONS, CharTokenizer, load_tokenizer
from pipeline.tasks import arithmetic as task

ATTN_IMPLEMENTATION = "sdpa"
"""Measured on the 2-core CPU at the default shape, 1 thread, 256 sequences: sdpa and
eager are within noise of each other (sdpa ~5-10% faster in interleaved runs for
both sampling and a training forward+backward), so sdpa."""


def encode_prompts(tokenizer: CharTokenizer, prompts: Sequence[str]) -> torch.Tensor:
    """``LongTensor[N, P]`` of the prompts; they must all have the same length."""
    if not prompts:
        raise ValueError("no prompts")
    rows = [tokenizer.encode(p) for p in prompts]
    width = len(rows[0])
    for p, r in zip(prompts, rows):
        if len(r) != width:
            raise ValueError(f"prompts differ in length: {prompts[0]!r} has {width} tokens, {p!r} has {len(r)}")
    return torch.tensor(rows, dtype=torch.long)


# --------------------------------------------------------------------------- model


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Architecture of the policy; the defaults give ~0.8M parameters."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")


def model_config(shape: ModelShape, vocab_size: int, *, pad_id: int = 0, eos_id: int = 1) -> Qwen3Config:
    """The HF config of a policy of ``shape``."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        # Qwen3's default head_dim is 128 regardless of hidden_size; pin it.
        head_dim=shape.hidden_size // shape.num_heads,
        max_position_embeddings=MAX_POSITIONS,
        # Tied embeddings break vLLM's CPU reload of updated weights.
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        attn_implementation=ATTN_IMPLEMENTATION,
    )


def build_model(shape: ModelShape, vocab_size: int, *, seed: int) -> Qwen3ForCausalLM:
    """A freshly initialised float32 Qwen3 policy; the init depends only on ``seed``."""
    config = model_config(shape, vocab_size)
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model.float()


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@contextmanager
def _no_hf_progress_bars() -> Iterator[None]:
    """Silence the tqdm bars transformers 5 draws on every save/load; with several
    processes reloading weights they would flood stderr and garble rich's display."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
"""Files of a checkpoint directory that belong to its tokenizer and generation defaults."""


def save_checkpoint(model: torch.nn.Module, tokenizer, directory: str | os.PathLike[str], *,
                    tokenizer_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write an HF checkpoint (safetensors) plus tokenizer files to ``directory``.

    The tokenizer files come from ``tokenizer.save`` (the character tokenizer) or are
    copied from ``tokenizer_dir`` (any other checkpoint's tokenizer).
    The files are written to a sibling temp directory that is then renamed into
    place, so a reader never sees a half-written checkpoint. An existing checkpoint
    at ``directory`` is replaced (moved aside, then deleted after the rename).
    """
    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = final.parent / f".{final.name}.tmp-{tag}"
    try:
        # transformers 5 always writes safetensors (safe_serialization was removed).
        with _no_hf_progress_bars():
            model.save_pretrained(tmp)
        if isinstance(tokenizer, CharTokenizer):
            tokenizer.save(tmp)
        else:
            if tokenizer_dir is None:
                raise ValueError("save_checkpoint: tokenizer_dir is needed to copy a non-character tokenizer")
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
        if not (tmp / "model.safetensors").exists():
            raise RuntimeError(f"save_pretrained wrote no model.safetensors in {tmp}")
        replace_dir(tmp, final, tag)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def replace_dir(tmp: Path, final: Path, tag: str) -> None:
    """Put the finished directory ``tmp`` in place of ``final``: the old one is renamed aside
    first and removed after, so a reader sees the old or the new directory, never a mix."""
    old: Path | None = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{tag}"
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def safetensors_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The weight files of an HF checkpoint directory: ``model.safetensors``, or the shards
    its ``model.safetensors.index.json`` lists."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    raise FileNotFoundError(f"no model.safetensors (or index) in {d}")


def load_checkpoint(directory: str | os.PathLike[str]):
    """Load a local HF causal-LM checkpoint directory and its tokenizer (safetensors only, never pickle).

    Any architecture ``transformers`` knows loads (Qwen3 first among them), in float32;
    sharded checkpoints (``model.safetensors.index.json``) too.
    """
    d = Path(directory)
    if not ((d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file()):
        raise FileNotFoundError(f"no model.safetensors in {d}")
    with _no_hf_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(
            d,
            use_safetensors=True,
            local_files_only=True,
            dtype=torch.float32,
            attn_implementation=ATTN_IMPLEMENTATION,
        )
    tie_if_configured(model)
    model.eval()
    return model, load_tokenizer(d)


def tie_if_configured(model: torch.nn.Module) -> torch.nn.Module:
    """Make the output head the input embedding when the config ties them. ``transformers``
    normally does so itself, but within a process that has built other models it has been seen
    to leave a tied head untied (unmaterialised, or freshly initialised) instead."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and head is not None and embed is not None \
            and head.weight is not embed.weight:
        head.weight = embed.weight
    return model


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A snapshot of the weights under their HF names: detached contiguous CPU clones,
    so later optimizer steps (in-place updates) cannot change it."""
    return {
        name: t.detach().to("cpu", copy=True).contiguous() for name, t in model.state_dict().items()
    }


def fit_errors(expected: dict[str, tuple[int, ...]], tensors: dict) -> str:
    """What keeps ``tensors`` from fitting the ``expected`` names and shapes ("" when they fit):
    missing and unexpected names, and shape mismatches."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    mismatched = sorted(
        f"{name}: expected {tuple(expected[name])}, got {tuple(tensors[name].shape)}"
        for name in set(expected) & set(tensors)
        if tuple(tensors[name].shape) != tuple(expected[name])
    )
    parts = [f"{what} {names}" for what, names in
             (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)) if names]
    return "; ".join(parts)


def load_state_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``model`` in place; names and shapes must match exactly."""
    misfit = fit_errors({name: tuple(t.shape) for name, t in model.state_dict().items()}, tensors)
    if misfit:
        raise ValueError("state tensors do not fit the model: " + misfit)
    with torch.no_grad():
        model.load_state_dict(tensors, strict=True)


# --------------------------------------------------------------------------- kernels


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The KV-cache argument and output attribute of this transformers version's forward."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def uniforms(generators: Sequence[torch.Generator], count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(generators), count]: each row's next ``count`` uniforms in [0, 1) from its own generator."""
    return torch.stack([torch.rand(count, generator=g, device=device) for g in generators])


def draw(probs: torch.Tensor, generator: torch.Generator | None = None, u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``probs[N, V]``: ``torch.multinomial`` with ``generator``, or, given
    ``u[N]`` (uniforms in [0, 1)), by inverting each row's cumulative distribution at its own
    uniform: the same distribution, and a row's token depends on its probabilities and its
    uniform alone."""
    if u is None:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    cdf = probs.cumsum(dim=-1)
    at = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, at, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


@torch.no_grad()
def sample(
    model: Qwen3ForCausalLM,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    eos_id: int,
    pad_id: int,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample completions of equal-length prompts with the KV cache.

    ``generator``: one for the whole batch, or a sequence of one per row: then row i's t-th
    token is drawn at the t-th uniform of its generator (:func:`draw`), so that each row's
    samples depend on its own generator alone, not on the other rows.

    Returns ``(tokens[N, T], logprobs[N, T], lengths[N])`` with ``T = max_new_tokens``
    (always, even when every row stopped early, so batches have a fixed shape).
    ``logprobs`` is the behaviour log-probability of each sampled token under
    ``softmax(logits / temperature)``; for ``temperature == 0`` (greedy) it is the
    argmax token's log-probability at temperature 1. ``lengths`` counts generated
    tokens including the eos (``max_new_tokens`` when no eos came). After a row's
    eos, tokens are ``pad_id`` and logprobs 0. Nothing is masked out of the
    distribution, so an (untrained) model can sample ``pad_id`` mid-completion; the
    trainer's re-scoring sees the same distribution, so the log-probs still agree.
    """
    if prompt_ids.dim() != 2 or prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be [N, P] with P > 0, got {tuple(prompt_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    n, p = prompt_ids.shape
    limit = model.config.max_position_embeddings
    if p + max_new_tokens > limit:
        raise ValueError(f"prompt ({p}) + max_new_tokens ({max_new_tokens}) exceeds the context of {limit}")

    device = prompt_ids.device
    tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)

    # GRPO-style batches repeat each prompt G times: run the prompt forward (the most
    # expensive step) once per distinct prompt, then fan the KV cache out to the rows.
    unique, inverse = torch.unique(prompt_ids, dim=0, return_inverse=True)
    dedup = unique.shape[0] < n
    # transformers 5.2x renamed the kwarg/attribute past_key_values -> cache; the GPU set's
    # 5.20 still has the old name.
    kwarg = _cache_kwarg(model)
    out = model(input_ids=unique if dedup else prompt_ids, use_cache=True, logits_to_keep=1)
    cache = getattr(out, kwarg)
    logits = out.logits[:, -1, :].float()
    if dedup:
        cache.reorder_cache(inverse)
        logits = logits[inverse]
    own = None  # one generator per row: every row's uniforms, drawn now
    if temperature != 0 and generator is not None and not isinstance(generator, torch.Generator):
        if len(generator) != n:
            raise ValueError(f"{len(generator)} generators for {n} rows")
        own = uniforms(generator, max_new_tokens, device)
    for t in range(max_new_tokens):
        if temperature == 0:
            logp = F.log_softmax(logits, dim=-1)
            nxt = logp.argmax(dim=-1)
        else:
            logp = F.log_softmax(logits / temperature, dim=-1)
            nxt = draw(logp.exp(), generator) if own is None else draw(logp.exp(), u=own[:, t])
        lp = logp.gather(1, nxt.unsqueeze(1)).squeeze(1)
        nxt = torch.where(finished, pad_id, nxt)
        tokens[:, t] = nxt
        logprobs[:, t] = torch.where(finished, 0.0, lp)
        ended = (nxt == eos_id) & ~finished
        lengths[ended] = t + 1
        finished |= ended
        if t + 1 == max_new_tokens or bool(finished.all()):
            break
        # Finished rows keep being fed pad: without masks they only affect themselves.
        out = model(input_ids=nxt.unsqueeze(1), use_cache=True, **{kwarg: cache})
        cache = getattr(out, kwarg)
        logits = out.logits[:, -1, :].float()
    return tokens, logprobs, lengths


def completion_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``BoolTensor[N, width]``: True on the generated tokens (eos included) of each row."""
    return torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def completion_logprobs(
    model: Qwen3ForCausalLM,
    prompt_ids: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``completion_ids[N, T]`` after ``prompt_ids[N, P]`` under
    ``softmax(logits / temperature)``: the distribution the sampler drew from, so that the
    trainer's ratios compare like with like (temperature 0, greedy, scores at 1).

    One forward over the concatenation, with autograd. Positions after a row's eos
    get the log-probability of whatever token is there (pad); mask them with
    :func:`completion_mask`. With ``with_entropy`` also returns the entropy of the
    next-token distribution at each completion position (no gradient through it).
    """
    if prompt_ids.dim() != 2 or completion_ids.dim() != 2 or prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError(
            f"need prompt_ids [N, P] and completion_ids [N, T]; got {tuple(prompt_ids.shape)}, "
            f"{tuple(completion_ids.shape)}"
        )
    t = completion_ids.shape[1]
    if t == 0:
        # logits_to_keep=0 would mean "all positions" to transformers.
        raise ValueError("completion_ids has no tokens")
    # The last completion token predicts nothing we score, so it is not fed in.
    inputs = torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1)
    # logits_to_keep=T: only the positions that predict completion tokens reach lm_head.
    logits = model(input_ids=inputs, use_cache=False, logits_to_keep=t).logits.float()
    return token_logprobs(logits, completion_ids, temperature=temperature, with_entropy=with_entropy)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0,
                   with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``tokens[N, T]`` under ``softmax(logits[N, T, V] / temperature)``
    (temperature 0, greedy, scores at 1), and optionally each position's entropy (no gradient)."""
    if temperature not in (0, 1):
        logits = logits / temperature
    logp = F.log_softmax(logits, dim=-1)
    chosen = logp.gather(2, tokens.unsqueeze(2)).squeeze(2)
    if not with_entropy:
        return chosen
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(dim=-1)
    return chosen, entropy


def ragged_completion_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[torch.Tensor],
    completion_ids: torch.Tensor,
    *,
    pad_id: int,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`completion_logprobs` for prompts of different lengths (1-D id tensors).

    Equal lengths take the batched path unchanged. Otherwise each row is its prompt and
    completion concatenated and right-padded: causal attention never lets a real token
    see the padding after it, and positions start at 0 in every row, so no attention
    mask is needed and each row's scores equal those of the row alone.
    """
    lens = [int(p.numel()) for p in prompts]
    if len(set(lens)) == 1:
        return completion_logprobs(model, torch.stack(list(prompts)), completion_ids, with_entropy=with_entropy,
                                   temperature=temperature)
    n, t = completion_ids.shape
    if t == 0:
        raise ValueError("completion_ids has no tokens")
    width = max(lens) + t - 1
    device = completion_ids.device
    inputs = torch.full((n, width), pad_id, dtype=torch.long, device=device)
    for i, (p, length) in enumerate(zip(prompts, lens)):
        inputs[i, :length] = p
        inputs[i, length: length + t - 1] = completion_ids[i, : t - 1]
    # Only positions from the shortest prompt's last token on predict completion tokens.
    keep = width - (min(lens) - 1)
    logits = model(input_ids=inputs, use_cache=False, logits_to_keep=keep).logits.float()
    offset = width - keep
    index = torch.tensor(lens, device=device).unsqueeze(1) - 1 - offset + torch.arange(t, device=device).unsqueeze(0)
    logits = logits[torch.arange(n, device=device).unsqueeze(1), index]
    return token_logprobs(logits, completion_ids, temperature=temperature, with_entropy=with_entropy)


def greedy_answers(
    model: Qwen3ForCausalLM,
    tokenizer: CharTokenizer,
    problems: Sequence[task.Problem],
    *,
    batch_size: int = 1000,
) -> list[str]:
    """Decoded greedy completions of ``problems``, in order.

    Each batch decodes one token more than the longest correct answer in it (room
    for the eos), so an over-long answer shows up as an extra digit (and is wrong).
    """
    out: list[str] = [""] * len(problems)
    # Problems of different widths cannot share a batch (no attention mask).
    by_width: dict[int, list[int]] = {}
    for i, prob in enumerate(problems):
        by_width.setdefault(len(prob.prompt), []).append(i)
    was_training = model.training
    model.eval()
    try:
        for indices in by_width.values():
            for start in range(0, len(indices), batch_size):
                chunk = indices[start : start + batch_size]
                probs = [problems[i] for i in chunk]
                prompt_ids = encode_prompts(tokenizer, [p.prompt for p in probs])
                longest = max(task.answer_max_length(p.digits, (p.op,)) for p in probs)
                tokens, _, _ = sample(
                    model,
                    prompt_ids,
                    max_new_tokens=longest + 1,
                    temperature=0.0,
                    eos_id=tokenizer.eos_id,
                    pad_id=tokenizer.pad_id,
                )
                for i, row in zip(chunk, tokens.tolist()):
                    out[i] = tokenizer.decode(row)
    finally:
        model.train(was_training)
    return out


def greedy_accuracy(
    model: Qwen3ForCausalLM,
    tokenizer: CharTokenizer,
    problems: Sequence[task.Problem],
    *,
    batch_size: int = 1000,
) -> float:
    """Fraction of ``problems`` whose greedy completion states the right answer."""
    if not problems:
        raise ValueError("no problems")
    answers = greedy_answers(model, tokenizer, problems, batch_size=batch_size)
    correct = sum(task.extract_answer(a) == p.answer for a, p in zip(answers, problems))
    return correct / len(problems)
