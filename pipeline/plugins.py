"""User code named in the config: ``package.module:attr`` specs and Python entry points.

Every registry (weak verifiers, reward modes, advantages, losses, task kinds, environments) takes, beside
its built-in names:

- ``module:attr`` (``my_checks:units_digit``, ``lab.rewards:exact_match``): ``attr`` of a
  module importable from the directory the command runs in or ``PYTHONPATH`` (``attr`` may
  be dotted: ``module:Class.method``);
- ``path/to/file.py:attr``: ``attr`` of a Python file, imported by path (relative to the
  directory the command runs in);
- a name an installed distribution registers under the registry's entry-point group
  (``ENTRY_POINT_GROUPS``), e.g. in its ``pyproject.toml``::

      [project.entry-points."rlpipe.verifiers"]
      units_digit = "my_checks:units_digit"

The driver (``pipeline up``) imports and checks every such spec before anything starts
(``pipeline.run.preflight.registry_problems``), so a typo fails there, naming the field; every
worker then resolves the same spec the same way, in its own process.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

ENTRY_POINT_GROUPS = {
    "verifier": "rlpipe.verifiers",
    "reward": "rlpipe.rewards",
    "advantage": "rlpipe.advantages",
    "loss": "rlpipe.losses",
    "task": "rlpipe.tasks",
    "env": "rlpipe.envs",
}
"""Entry-point group of each registry."""


class PluginError(ValueError):
    """A plugin spec that cannot be loaded: the message says what was tried and why it failed."""


def is_spec(text: str) -> bool:
    """Whether ``text`` has the shape of ``module:attr`` or ``file.py:attr``."""
    left, sep, attr = text.rpartition(":")
    if not sep or not left or not all(p.isidentifier() for p in attr.split(".")):
        return False
    return left.endswith(".py") or all(p.isidentifier() for p in left.split("."))


def shaped(value: str, kind: str) -> bool:
    """``module:attr``, ``file.py:attr`` or the name of an installed entry point of ``kind``'s group
    (any group when ``kind`` is empty): what ``find`` resolves. Whether it loads is checked
    before launch."""
    if ":" not in value:
        groups = [ENTRY_POINT_GROUPS[kind]] if kind else list(ENTRY_POINT_GROUPS.values())
        return any(value in {ep.name for ep in importlib.metadata.entry_points(group=g)} for g in groups)
    return is_spec(value)


def import_modules(names: tuple[str, ...] | list[str]) -> None:
    """Import each module of the config's ``plugins`` list (``module`` or ``path/to/file.py``),
    once per process: what they register at import (``pipeline.catalog``) joins the registries."""
    for name in names:
        _module(name)


def _module(left: str):
    if left.endswith(".py"):
        path = Path(left).resolve()
        if not path.is_file():
            raise PluginError(f"no such file {left!r} (looked for {path})")
        name = f"rlpipe_plugin_{path.stem}_{abs(hash(str(path))) % 10**8}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise PluginError(f"importing {left!r} failed: {type(e).__name__}: {e}") from e
        return module
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # as `python -m` does: the user's own modules beside them
    try:
        return importlib.import_module(left)
    except ModuleNotFoundError as e:
        raise PluginError(f"cannot import module {left!r} ({e}); it must be importable from the directory the "
                          f"command runs in ({Path.cwd()}) or from PYTHONPATH, or be given as path/to/file.py") from e
    except Exception as e:
        raise PluginError(f"importing module {left!r} failed: {type(e).__name__}: {e}") from e


@functools.cache
def load(spec: str):
    """The object a ``module:attr`` / ``file.py:attr`` spec names (imported once per process)."""
    if not is_spec(spec):
        raise PluginError(f"{spec!r} is not a plugin spec (module:attr or path/to/file.py:attr)")
    left, _, attr = spec.rpartition(":")
    obj = _module(left)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{left!r} has no attribute {attr!r}") from None
    return obj


def entry_point(kind: str, name: str):
    """The object an installed distribution registers as ``name`` in ``kind``'s group, else None."""
    for ep in entry_point_names(kind).get(name, ()):
        try:
            return ep.load()
        except Exception as e:
            raise PluginError(f"entry point {name!r} of group {ENTRY_POINT_GROUPS[kind]!r} ({ep.value}) failed to "
                              f"load: {type(e).__name__}: {e}") from e
    return None


def entry_point_names(kind: str) -> dict[str, list]:
    """Names registered in ``kind``'s entry-point group."""
    out: dict[str, list] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUPS[kind]):
        out.setdefault(ep.name, []).append(ep)
    return out


def find(kind: str, spec: str):
    """A plugin spec's object, or an entry point's; None when ``spec`` is neither."""
    if is_spec(spec):
        return load(spec)
    return entry_point(kind, spec)


def require_callable(obj, spec: str, what: str):
    if not callable(obj):
        raise PluginError(f"{spec!r} names {type(obj).__name__} {obj!r}, not a callable {what}")
    return obj
