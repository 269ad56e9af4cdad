"""``lm_judge[:<dir>]``: ask a generator backend whether a completion is right; score P(yes).

The judge renders a yes/no question about (prompt, completion), asks the backend for
the log-probabilities of the *next token* only, and scores

    P(yes) = Σ_{t ∈ yes} p(t) / (Σ_{t ∈ yes} p(t) + Σ_{t ∈ no} p(t))

so the score is in [0, 1] whatever else the model would say; a completion whose
question the backend cannot encode, or where neither yes nor no tokens appear among
the returned log-probs, abstains (NaN).

Backends implement ``JudgeBackend``: ``question`` renders the text, ``yes`` / ``no``
name the answer tokens, and ``next_token_logprobs`` returns, per text, a map from token
string to log-probability — the shape of vLLM's ``SamplingParams(max_tokens=1,
logprobs=k)`` output, so a vLLM backend implements it with one ``generate`` call.
``TorchCharBackend`` runs the project's torch policy (``pipeline.model.qwen``: the same
checkpoint loader and the same forward pass as the first step of ``sample``).

The tiny character model is a weak judge: its alphabet is digits and ``+*= ``, so it
cannot read a question at all. Its question is the prompt followed by the completion,
"yes" is ending the answer right there (``<eos>``) and "no" is writing another digit:
P(yes) is how much the policy itself would stop at this answer. That mostly checks the
length and the policy's own confidence, which is also why it correlates with the
policy's mistakes. A real instruction-tuned judge behind a vLLM backend asks a real question.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

DEFAULT_DIR = "artifacts/base-model"
"""Checkpoint ``lm_judge`` without an argument uses (the base policy)."""


class JudgeBackend(Protocol):
    """What a judge needs from a generator backend."""

    yes: tuple[str, ...]
    """Next tokens that mean yes."""
    no: tuple[str, ...]
    """Next tokens that mean no."""

    def question(self, prompt: str, completion: str) -> str | None:
        """The text whose next token answers "is this completion right?"; None if it cannot be encoded."""

    def next_token_logprobs(self, texts: Sequence[str]) -> list[dict[str, float]]:
        """Per text, next-token log-probabilities by token string (at least the yes and no tokens)."""


class TorchCharBackend:
    """The project's torch policy (character tokenizer) as a judge backend; see the module docstring."""

    def __init__(self, directory: str | Path):
        import torch

        from pipeline.model.qwen import load_checkpoint

        self._torch = torch
        self.model, self.tokenizer = load_checkpoint(directory)
        vocab = self.tokenizer.tokens
        self.yes = (vocab[self.tokenizer.eos_id],)
        self.no = tuple(t for t in vocab if t.isdigit())

    def question(self, prompt: str, completion: str) -> str | None:
        text = prompt + completion.strip()
        try:
            self.tokenizer.encode(text)
        except ValueError:
            return None
        if len(text) >= self.model.config.max_position_embeddings:
            return None
        return text

    def next_token_logprobs(self, texts: Sequence[str]) -> list[dict[str, float]]:
        torch = self._torch
        from pipeline.model.qwen import encode_prompts

        out: list[dict[str, float]] = [{} for _ in texts]
        by_len: dict[int, list[int]] = {}
        for i, t in enumerate(texts):
            by_len.setdefault(len(t), []).append(i)  # no attention mask: one forward per length
        vocab = self.tokenizer.tokens
        with torch.no_grad():
            for idx in by_len.values():
                ids = encode_prompts(self.tokenizer, [texts[i] for i in idx])
                logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1, :].float()
                logp = torch.log_softmax(logits, dim=-1).numpy()
                for row, i in enumerate(idx):
                    out[i] = {tok: float(logp[row, k]) for k, tok in enumerate(vocab)}
        return out


def p_yes(logprobs: dict[str, float], yes: Sequence[str], no: Sequence[str]) -> float:
    """P(yes) renormalised over the yes and no tokens present; NaN if none is present."""
    py = sum(math.exp(logprobs[t]) for t in yes if t in logprobs)
    pn = sum(math.exp(logprobs[t]) for t in no if t in logprobs)
    return py / (py + pn) if py + pn > 0 else float("nan")


def judge(backend: JudgeBackend, prompt: str, completions: Sequence[str]) -> np.ndarray:
    """float32 [G] P(yes) per completion (NaN where the backend cannot ask)."""
    questions = [backend.question(prompt, c) for c in completions]
    asked = [i for i, q in enumerate(questions) if q is not None]
    out = np.full(len(completions), np.nan, dtype=np.float32)
    if asked:
        for i, lp in zip(asked, backend.next_token_logprobs([questions[i] for i in asked])):
            out[i] = p_yes(lp, backend.yes, backend.no)
    return out


def build(arg: str | None, *, backend: JudgeBackend | None = None) -> object:
    directory = arg or DEFAULT_DIR
    state: dict[str, object] = {} if backend is None else {"backend": backend}
    lock = threading.Lock()

    def load() -> JudgeBackend:
        with lock:  # loaded on first use, inside the verifier's deadline
            if "backend" not in state:
                if not (Path(directory) / "model.safetensors").is_file():
                    raise FileNotFoundError(f"lm_judge: no model.safetensors in {directory!r}")
                state["backend"] = TorchCharBackend(directory)
            return state["backend"]  # type: ignore[return-value]

    def lm_judge(prompt: str, completions: Sequence[str]) -> np.ndarray:
        return judge(load(), prompt, completions)

    return lm_judge
