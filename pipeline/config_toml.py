"""The config as TOML: what a run directory records (``to_toml``) and the documented default
(``documented_toml``, which ``configs/default.toml`` is)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from types import ModuleType
from typing import Any

from pipeline import config, config_infra, config_task, config_train
from pipeline.config import RunConfig, config_to_dict

SECTION_MODULES = (config, config_infra, config_task, config_train)
"""The modules whose classes' field docstrings ``documented_toml`` writes above each field."""


def to_toml(cfg: RunConfig) -> str:
    """The config as TOML, so a run directory records exactly what ran."""
    top: list[str] = []
    tables: list[str] = []
    for key, value in config_to_dict(cfg).items():
        if isinstance(value, dict):
            tables.append(f"\n[{key}]")
            tables.extend(f"{k} = {_toml_value(v)}" for k, v in value.items())
        else:
            top.append(f"{key} = {_toml_value(value)}")
    return "\n".join(top + tables) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def field_docs() -> dict[tuple[str, str], str]:
    """The docstring under each config field, keyed by (class name, field name)."""
    docs: dict[tuple[str, str], str] = {}
    for module in SECTION_MODULES:
        docs.update(_docs_of(module))
    return docs


def _docs_of(module: ModuleType) -> dict[tuple[str, str], str]:
    docs: dict[tuple[str, str], str] = {}
    for node in ast.parse(inspect.getsource(module)).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for st, nxt in zip(node.body, node.body[1:]):
            if (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                docs[(node.name, st.target.id)] = " ".join(str(nxt.value.value).split())
    return docs


def documented_toml(cfg: RunConfig | None = None) -> str:
    """``cfg`` (default: the code defaults) as TOML with every field's docstring above it.

    ``configs/default.toml`` is this text (``pipeline config > configs/default.toml``).
    """
    cfg = cfg or RunConfig()
    docs = field_docs()
    out = ["# The embedded default: what `make up-cluster` runs. Every field, with its default.",
           "# Override any of them on the command line: pipeline up --trainer.lr 3e-4", ""]

    def emit(owner: str, name: str, value: Any) -> None:
        if doc := docs.get((owner, name)):
            out.extend("# " + line for line in textwrap.wrap(doc, 88))
        out.append(f"{name} = {_toml_value(value)}")

    fields = dataclasses.fields(cfg)
    for f in fields:
        if not dataclasses.is_dataclass(getattr(cfg, f.name)):
            emit("RunConfig", f.name, getattr(cfg, f.name))
    for f in fields:
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section):
            out += ["", f"[{f.name}]"]
            for g in dataclasses.fields(section):
                emit(type(section).__name__, g.name, getattr(section, g.name))
    return "\n".join(out) + "\n"
