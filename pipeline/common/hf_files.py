"""What the JSON files of a local HF checkpoint directory say: its chat template and special
tokens (``tokenizer_config.json``, ``chat_template.jinja``), read without loading a tokenizer.
The tokenizers (``pipeline.model.tokenizer``) and the prompt builder (``pipeline.tasks.prompting``)
read them here."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def token_name(value: object) -> str | None:
    """``tokenizer_config.json`` writes special tokens as strings or as ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_chat_template(directory: str | os.PathLike[str]) -> str | None:
    """The checkpoint's chat template: ``chat_template`` of ``tokenizer_config.json`` (a string,
    or the ``default`` entry of a list of named templates), else ``chat_template.jinja``; None
    when it has none."""
    d = Path(directory)
    value = read_json(d / "tokenizer_config.json").get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if isinstance(value, str) and value.strip():
        return value
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        text = jinja.read_text(encoding="utf-8")
        return text if text.strip() else None
    return None


def special_token_names(directory: str | os.PathLike[str]) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ``pad_token``, ``unk_token`` of ``tokenizer_config.json`` (those it
    sets), as a chat template reads them."""
    tc = read_json(Path(directory) / "tokenizer_config.json")
    out = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if (token := token_name(tc.get(name))) is not None:
            out[name] = token
    return out
