"""One registry of named components: what a config field that picks one by name may say.

A ``Registry`` maps each built-in name to its implementation, given either as the object
itself or as a ``module:attr`` string imported the first time it is asked for (so the names,
their checks and their rules are known without importing torch or the component's
dependencies). Beside its names, a registry with a plugin kind takes user code
(``module:attr``, ``path/to/file.py:attr`` or an entry-point name: ``pipeline.plugins``).

An entry may carry:

- ``check(section, p, check)``: the checks of its config fields, run when the config names
  it (``check`` is ``pipeline.config_base._check``: ``check(ok, field, allowed, value)``);
- ``inert(cfg) -> {field: why}``: the fields that cannot take effect when the run uses it;
- any other keyword (``meta``), read by the code that uses the registry.

A config field that names a component is annotated with its registry
(``kind: catalog.TASKS = "arithmetic"``): the value is a string, and ``choices`` of the
annotation are the registered names.

Registering: ``REG.register("name", "pkg.module:Class")``, or as a decorator
(``@REG.register("name")`` above the definition), from the registry's own module or from a
plugin module named in the config's ``plugins`` list (docs/extending.md).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pipeline import plugins


def _load(spec: str) -> Any:
    """A built-in's ``module:attr``; a missing optional dependency raises as its import does
    (``ModuleNotFoundError`` naming it), not as a user's plugin that cannot be found."""
    module, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class Entry:
    name: str
    target: Any
    """The implementation, or a ``module:attr`` string (a tuple of them) loaded on first use."""
    check: Callable[..., None] | None = None
    inert: Callable[[Any], dict[str, str]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Registry:
    """Built-in names of one kind of component (task kinds, losses, ...), with their checks."""

    def __init__(self, field_name: str, plugin_kind: str | None, what: str = "function", noun: str = "") -> None:
        self.field = field_name
        """The config field that picks a name (``task.kind``), for messages."""
        self.plugin_kind = plugin_kind
        """The kind in ``pipeline.plugins.ENTRY_POINT_GROUPS`` whose specs it also takes; None: built-ins only."""
        self.what = what
        """What a plugin spec names (``function``, ``Class``), for messages."""
        self.noun = noun or field_name.rpartition(".")[2]
        """What one entry is called in messages (``task``, ``loss``)."""
        self._entries: dict[str, Entry] = {}

    __name__ = "str"
    """A config field annotated with a registry holds a name (a string): ``_coerce`` calls the
    annotation to convert a value, and says ``must be str`` when it cannot."""

    def __call__(self, value: Any) -> str:
        """A TOML or command-line value as a name; which names are allowed is the section's check."""
        if not isinstance(value, str):
            raise TypeError(f"{self.field}: a name, not {value!r}")
        return value

    def register(self, name: str, target: Any = None, *, check: Callable[..., None] | None = None,
                 inert: Callable[[Any], dict[str, str]] | None = None, **meta: Any):
        """Register ``name``; without ``target``, a decorator registering what it decorates."""
        if target is None:
            def deco(obj):
                self.register(name, obj, check=check, inert=inert, **meta)
                return obj
            return deco
        known = self._entries.get(name)
        if known is not None and known.target is not target:
            raise ValueError(f"{self.field}: {name!r} is registered already (as {known.target!r})")
        self._entries[name] = Entry(name, target, check, inert, meta)
        return target

    def __repr__(self) -> str:
        return f"Registry({self.field}: {', '.join(self.names())})"

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __getitem__(self, name: str) -> Any:
        """A registered name's implementation (``KeyError`` for any other)."""
        if name not in self._entries:
            raise KeyError(name)
        return self.get(name)

    def entry(self, name: str) -> Entry | None:
        return self._entries.get(name)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def meta(self, name: str, key: str, default: Any = None) -> Any:
        e = self._entries.get(name)
        return default if e is None else e.meta.get(key, default)

    def get(self, name: str) -> Any:
        """The implementation of ``name``: a built-in, else a plugin spec's object (``ValueError``
        naming what is allowed, with the closest name, when it is neither)."""
        e = self._entries.get(name)
        if e is not None:
            if isinstance(e.target, str):
                e.target = _load(e.target)
            elif isinstance(e.target, tuple):
                e.target = tuple(_load(t) if isinstance(t, str) else t for t in e.target)
            return e.target
        found = plugins.find(self.plugin_kind, name) if self.plugin_kind else None
        if found is None:
            raise ValueError(self.unknown(name))
        return plugins.require_callable(found, name, self.plugin_kind)

    def unknown(self, name: str) -> str:
        """The message for a name that is neither registered nor a plugin."""
        close = difflib.get_close_matches(name, self.names(), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        own = (f", or your own as module:{self.what}, path/to/file.py:{self.what}, or a name in the "
               f"{plugins.ENTRY_POINT_GROUPS[self.plugin_kind]!r} entry-point group") if self.plugin_kind else ""
        return f"unknown {self.noun} {name!r}{hint}; known: {', '.join(sorted(self.names()))}{own}"

    def allows(self, value: str) -> bool:
        """Whether the config may name ``value``: a registered name, or the shape of a plugin spec
        (whether it loads is checked before launch)."""
        return value in self._entries or (self.plugin_kind is not None and plugins.shaped(value, self.plugin_kind))

    def allowed(self) -> str:
        """What ``allows`` accepts, for a ConfigError."""
        own = f", module:{self.what}, path/to/file.py:{self.what} or an entry-point name" if self.plugin_kind else ""
        return "|".join(self.names()) + own

    def check(self, name: str, section: Any, p: str, check: Callable[..., None]) -> None:
        """Run ``name``'s checks of its config fields, if it has any."""
        e = self._entries.get(name)
        if e is not None and e.check is not None:
            e.check(section, p, check)

    def inert(self, cfg: Any) -> dict[str, str]:
        """Every entry's fields without effect in a run of ``cfg``, with why."""
        out: dict[str, str] = {}
        for e in self._entries.values():
            if e.inert is not None:
                for name, why in e.inert(cfg).items():
                    out.setdefault(name, why)
        return out
