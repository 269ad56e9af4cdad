"""The ground every config section stands on: ``ConfigError``, the field check, the ``Literal``
choice fields and the section base class (``pipeline.config`` assembles the sections)."""

from __future__ import annotations

import functools
import typing
from typing import Any, Literal

from pipeline.registry import Registry


class ConfigError(ValueError):
    """A config value is missing, unknown or out of bounds; the message names the field."""


def check(ok: bool, name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{name}: must be {allowed}; got {value!r}")


def choices(hint: Any) -> tuple[str, ...]:
    """The values a ``Literal`` choice type allows, in order (a ``Registry``: its names)."""
    if isinstance(hint, Registry):
        return hint.names()
    if typing.get_origin(hint) is not Literal:
        raise TypeError(f"not a Literal: {hint!r}")
    return typing.get_args(hint)


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def choice_fields(cls: type) -> dict[str, tuple[tuple[str, ...], bool]]:
    """Fields typed ``Literal[...]`` or ``tuple[Literal[...], ...]``: name -> (allowed values, is a list)."""
    out = {}
    for name, hint in hints(cls).items():
        many = typing.get_origin(hint) is tuple
        item = typing.get_args(hint)[0] if many else hint
        if typing.get_origin(item) is Literal:
            out[name] = (typing.get_args(item), many)
    return out


class Section:
    """A config section: its choice fields are checked against their Literals, then ``_validate``."""

    def validate(self, p: str) -> None:
        for name, (allowed, many) in choice_fields(type(self)).items():
            value = getattr(self, name)
            ok = all(v in allowed for v in value) if many else value in allowed
            check(ok, f"{p}.{name}", ("a list of " if many else "") + "|".join(allowed), value)
        self._validate(p)

    def _validate(self, p: str) -> None:
        pass
