"""Tokenizers of local HF checkpoint directories.

:func:`load_tokenizer` returns the project's :class:`~pipeline.model.CharTokenizer` for the
embedded character-level models and an :class:`HFTokenizer` for any other ``tokenizer.json``
(Qwen3's byte-level BPE, or one trained locally). Both give the stages what they need:
``encode`` (no special tokens added), ``decode`` (up to the first end-of-sequence, special
tokens skipped), ``pad_id``, ``eos_id`` and ``vocab_size``. Nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    pad_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_name(value: object) -> str | None:
    """``tokenizer_config.json`` writes special tokens as strings or as ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A ``tokenizers`` tokenizer with the end-of-sequence and pad ids of its checkpoint.

    The eos is the ``eos_token`` of ``tokenizer_config.json``, else ``eos_token_id`` of
    ``generation_config.json`` / ``config.json`` (the first one when a list); the pad is
    ``pad_token``, else the eos (as in most chat models' generation configs).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        d = Path(directory)
        self._tok = _Tokenizer.from_file(str(d / "tokenizer.json"))
        tc = _read_json(d / "tokenizer_config.json")
        eos = self._id_of(_token_name(tc.get("eos_token")))
        if eos is None:
            for name in ("generation_config.json", "config.json"):
                value = _read_json(d / name).get("eos_token_id")
                if isinstance(value, list) and value:
                    value = value[0]
                if isinstance(value, int):
                    eos = value
                    break
        if eos is None:
            raise ValueError(f"{d}: no end-of-sequence token (eos_token in tokenizer_config.json or "
                             "eos_token_id in config.json)")
        pad = self._id_of(_token_name(tc.get("pad_token")))
        self.eos_id = eos
        self.pad_id = eos if pad is None else pad
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            out.append(i)
        return self._tok.decode(out, skip_special_tokens=True)


def is_char_tokenizer(directory: str | os.PathLike[str]) -> bool:
    data = _read_json(Path(directory) / "tokenizer.json")
    return data.get("model", {}).get("type") == "WordLevel"


def load_tokenizer(directory: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer saved in a checkpoint directory."""
    d = Path(directory)
    if not (d / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {d}")
    if is_char_tokenizer(d):
        from pipeline.model import CharTokenizer

        return CharTokenizer.load(d)
    return HFTokenizer(d)


def model_context_length(directory: str | os.PathLike[str]) -> int:
    """The checkpoint's context length (``config.json`` ``max_position_embeddings``; unbounded when absent)."""
    return int(_read_json(Path(directory) / "config.json").get("max_position_embeddings", 1 << 30))


def model_vocab_size(directory: str | os.PathLike[str]) -> int:
    """Rows of the checkpoint's embedding (``config.json`` ``vocab_size``), which may exceed the tokenizer's."""
    cfg = _read_json(Path(directory) / "config.json")
    if "vocab_size" not in cfg:
        raise ValueError(f"{directory}/config.json has no vocab_size")
    return int(cfg["vocab_size"])
