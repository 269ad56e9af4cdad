"""Tokenizers of local HF checkpoint directories.

:func:`load_tokenizer` returns the project's :class:`CharTokenizer` for the
embedded character-level models and an :class:`HFTokenizer` for any other ``tokenizer.json``
(Qwen3's byte-level BPE, or one trained locally). Both give the stages what they need:
``encode`` (no special tokens added), ``decode`` (up to the first end-of-sequence, special
tokens skipped), ``pad_id``, ``eos_id`` and ``vocab_size``. Nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizerFile

from pipeline.common.hf_files import read_json, token_name


class Tokenizer(Protocol):
    pad_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
CHARACTERS = "0123456789+*= "
"""Every character a prompt or a completion of the arithmetic task can contain."""

MAX_POSITIONS = 64
"""Context length of the model: prompt + completion never come close (3-digit ``*``
is 8 + 7 tokens), and a small table keeps RoPE caches and checkpoints tiny."""


class CharTokenizer:
    """Character-level tokenizer: ``<pad>`` (0), ``<eos>`` (1), then one id per character.

    Encoding/decoding is pure python dictionary lookups (faster than a round trip
    through ``tokenizers`` for 10-character strings); :meth:`save` additionally writes
    an equivalent HF ``tokenizer.json`` so HF tooling and inference engines can load
    the checkpoint directory.
    """

    def __init__(self, tokens: Sequence[str] | None = None) -> None:
        if tokens is None:
            tokens = [PAD_TOKEN, EOS_TOKEN, *CHARACTERS]
        tokens = list(tokens)
        if tokens[:2] != [PAD_TOKEN, EOS_TOKEN]:
            raise ValueError(f"vocabulary must start with {PAD_TOKEN!r}, {EOS_TOKEN!r}; got {tokens[:2]}")
        if len(set(tokens)) != len(tokens):
            raise ValueError("vocabulary has duplicate tokens")
        for tok in tokens[2:]:
            if len(tok) != 1:
                raise ValueError(f"non-special token {tok!r} is not a single character")
        self._tokens: list[str] = tokens
        self._ids: dict[str, int] = {tok: i for i, tok in enumerate(tokens) if i >= 2}

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def eos_id(self) -> int:
        return 1

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[str]:
        """The vocabulary in id order (a copy)."""
        return list(self._tokens)

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of ``text`` (no eos appended)."""
        ids = self._ids
        try:
            return [ids[ch] for ch in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the vocabulary {CHARACTERS!r}") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` up to (excluding) the first eos; pads are skipped."""
        out: list[str] = []
        tokens = self._tokens
        for i in ids:
            i = int(i)
            if i == 1:
                break
            if i == 0:
                continue
            if not 0 <= i < len(tokens):
                raise ValueError(f"token id {i} is outside the vocabulary (size {len(tokens)})")
            out.append(tokens[i])
        return "".join(out)

    def to_hf_json(self) -> str:
        """The HF ``tokenizer.json`` equivalent of this tokenizer."""
        vocab = {tok: i for i, tok in enumerate(self._tokens)}
        hf = HFTokenizerFile(models.WordLevel(vocab=vocab, unk_token=None))
        # One pre-token per character (spaces included: they are real tokens here, the
        # prompts are right-aligned with them), so the WordLevel lookup sees characters.
        hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        # Fuse concatenates decoded tokens; the default would join them with spaces.
        hf.decoder = decoders.Fuse()
        hf.add_special_tokens([AddedToken(PAD_TOKEN, special=True), AddedToken(EOS_TOKEN, special=True)])
        return hf.to_str(pretty=True)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "tokenizer.json").write_text(self.to_hf_json(), encoding="utf-8")
        special = {"pad_token": PAD_TOKEN, "eos_token": EOS_TOKEN}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "model_max_length": MAX_POSITIONS,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (d / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> CharTokenizer:
        """Read the vocabulary back from ``directory/tokenizer.json``."""
        data = json.loads((Path(directory) / "tokenizer.json").read_text(encoding="utf-8"))
        model = data.get("model", {})
        if model.get("type") != "WordLevel":
            raise ValueError(f"{directory}/tokenizer.json is not a WordLevel tokenizer")
        vocab: dict[str, int] = model["vocab"]
        tokens = sorted(vocab, key=vocab.__getitem__)
        if [vocab[t] for t in tokens] != list(range(len(tokens))):
            raise ValueError(f"{directory}/tokenizer.json has non-contiguous token ids")
        return cls(tokens)


class HFTokenizer:
    """A ``tokenizers`` tokenizer with the end-of-sequence and pad ids of its checkpoint.

    The eos is the ``eos_token`` of ``tokenizer_config.json``, else ``eos_token_id`` of
    ``generation_config.json`` / ``config.json`` (the first one when a list); the pad is
    ``pad_token``, else the eos (as in most chat models' generation configs).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        d = Path(directory)
        self._tok = HFTokenizerFile.from_file(str(d / "tokenizer.json"))
        tc = read_json(d / "tokenizer_config.json")
        eos = self._id_of(token_name(tc.get("eos_token")))
        if eos is None:
            for name in ("generation_config.json", "config.json"):
                value = read_json(d / name).get("eos_token_id")
                if isinstance(value, list) and value:
                    value = value[0]
                if isinstance(value, int):
                    eos = value
                    break
        if eos is None:
            raise ValueError(f"{d}: no end-of-sequence token (eos_token in tokenizer_config.json or "
                             "eos_token_id in config.json)")
        pad = self._id_of(token_name(tc.get("pad_token")))
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
    data = read_json(Path(directory) / "tokenizer.json")
    return data.get("model", {}).get("type") == "WordLevel"


def load_tokenizer(directory: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer saved in a checkpoint directory."""
    d = Path(directory)
    if not (d / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {d}")
    if is_char_tokenizer(d):
        return CharTokenizer.load(d)
    return HFTokenizer(d)


def model_context_length(directory: str | os.PathLike[str]) -> int:
    """The checkpoint's context length (``config.json`` ``max_position_embeddings``; unbounded when absent)."""
    return int(read_json(Path(directory) / "config.json").get("max_position_embeddings", 1 << 30))


def model_vocab_size(directory: str | os.PathLike[str]) -> int:
    """Rows of the checkpoint's embedding (``config.json`` ``vocab_size``), which may exceed the tokenizer's."""
    cfg = read_json(Path(directory) / "config.json")
    if "vocab_size" not in cfg:
        raise ValueError(f"{directory}/config.json has no vocab_size")
    return int(cfg["vocab_size"])
