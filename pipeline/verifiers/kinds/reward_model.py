"""``reward_model:<dir>``: score completions with a local HF sequence-classification checkpoint.

Any ``AutoModelForSequenceClassification`` directory works (BERT-style cross-encoders,
decoder reward heads such as ``Qwen3ForSequenceClassification``) as long as its weights
are safetensors (``model.safetensors`` or a sharded ``model.safetensors.index.json``)
and its tokenizer is saved beside them. Nothing is fetched from a hub.

Input: the prompt and the completion as a text pair. Output in [0, 1]: with one
label, sigmoid(logit); with two, the softmax probability of label 1 ("correct"). More
labels are refused.

The checkpoint loads on the first group (inside the verifier's deadline). If it cannot
load, every call raises the same clear error, so the verifier abstains and the failure
is counted and logged with the reason, and the verifier stage keeps running.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

BATCH = 64
"""Completions per forward pass."""


class RewardModelUnavailable(RuntimeError):
    """The checkpoint could not be loaded; the message says why."""


class RewardModel:
    """A loaded sequence-classification checkpoint that scores (prompt, completion) pairs in [0, 1]."""

    def __init__(self, directory: str | Path):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from pipeline.model.qwen import _no_hf_progress_bars

        d = Path(directory)
        if not d.is_dir():
            raise RewardModelUnavailable(f"reward model {str(d)!r}: no such directory")
        if not ((d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file()):
            raise RewardModelUnavailable(f"reward model {str(d)!r}: no model.safetensors (safetensors weights only)")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
            with _no_hf_progress_bars():
                self.model = AutoModelForSequenceClassification.from_pretrained(
                    d, local_files_only=True, use_safetensors=True, dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001 - any load failure becomes one clear message
            raise RewardModelUnavailable(f"reward model {str(d)!r}: cannot load: {type(exc).__name__}: {exc}") from exc
        self.model.eval()
        labels = self.model.config.num_labels
        if labels not in (1, 2):
            raise RewardModelUnavailable(f"reward model {str(d)!r}: {labels} labels; need 1 (a score) or 2 (wrong, correct)")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self._torch = torch
        # Tokenizers may emit inputs a model does not take (token_type_ids for a decoder).
        self._inputs = set(inspect.signature(self.model.forward).parameters)

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
        """float32 [N] scores in [0, 1] of each (prompt, completion) pair."""
        torch = self._torch
        out = []
        with torch.no_grad():
            for i in range(0, len(completions), BATCH):
                enc = self.tokenizer(list(prompts[i:i + BATCH]), list(completions[i:i + BATCH]), padding=True,
                                     truncation=True, return_tensors="pt")
                logits = self.model(**{k: v for k, v in enc.items() if k in self._inputs}).logits.float()
                p = torch.sigmoid(logits[:, 0]) if logits.shape[1] == 1 else torch.softmax(logits, dim=-1)[:, 1]
                out.append(p.numpy())
        return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)


def build(arg: str | None) -> object:
    if not arg:
        raise ValueError("reward_model needs a checkpoint directory: reward_model:<dir>")
    state: dict[str, object] = {}
    lock = threading.Lock()

    def load() -> RewardModel:
        with lock:
            if "model" not in state and "error" not in state:
                try:
                    state["model"] = RewardModel(arg)
                except RewardModelUnavailable as exc:
                    state["error"] = str(exc)
            if "error" in state:
                raise RewardModelUnavailable(state["error"])
            return state["model"]  # type: ignore[return-value]

    def reward_model(prompt: str, completions: Sequence[str]) -> np.ndarray:
        return load().score([prompt] * len(completions), completions)

    return reward_model
