"""What makes a base model: its recipe, the directory it lives in, and the held-out rows it never saw.

A warm-up's bytes follow from its recipe (``recipe``): the shape, the warm-up settings, the
task, and the held-out sets it leaves out. Every base directory records its recipe
(``recipe.json``), and the default location is a family of directories, one per recipe:
``artifacts/base-model`` holds the shipped recipe's base (the default run's), any other
recipe's base lives in ``artifacts/base-model-<digest>`` (``recipe_dir``). A run whose recipe
differs never reuses, nor overwrites, another recipe's base.

Torch-free, so the config checks before a run (``pipeline config --check``, ``pipeline up``)
resolve and compare recipes without loading torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from pipeline.tasks.arithmetic import heldout_problems

DEFAULT_SCHEDULE = "constant"
"""A cosine decay makes the plateau escape (which needs a large lr) late or absent for
some seeds, so after warm-up the lr is kept constant."""
WARMUP_STEPS = 50
SHIPPED = Path(__file__).resolve().parent / "arith_base"
"""The default base model (HF checkpoint directory), built by ``pretrain`` from ``SHIPPED/recipe.json``."""
RECIPE_FILE = "recipe.json"

RECIPE_FIELDS: dict[str, str | None] = {
    "shape.hidden_size": "model.hidden_size", "shape.num_layers": "model.num_layers",
    "shape.num_heads": "model.num_heads", "shape.num_kv_heads": "model.num_kv_heads",
    "shape.intermediate_size": "model.intermediate_size", "digits": "task.digits", "ops": "task.ops",
    "steps": "model.pretrain_steps", "batch_size": "model.pretrain_batch_size", "lr": "model.pretrain_lr",
    "seed": "model.seed", "stop_loss": "model.pretrain_stop_loss", "heldout_size": "task.heldout_size",
    "heldout_seed": "task.heldout_seed", "schedule": None, "warmup": None, "eval_sets": "eval.sets",
}
"""Each recipe entry (dotted inside the record) and the config field that sets it (None: fixed in code)."""


def recipe(*, shape: Any, digits: int, ops: Sequence[str], steps: int, batch_size: int, lr: float,
           seed: int, stop_loss: float | None, heldout_size: int, heldout_seed: int,
           schedule: str = DEFAULT_SCHEDULE, warmup: int = WARMUP_STEPS,
           eval_sets: Sequence[Mapping[str, Any]] = ()) -> dict:
    """Everything that decides the bytes ``pretrain`` writes. ``shape``: a ``ModelShape`` or its
    fields. The held-out set (``heldout_size`` problems drawn with ``heldout_seed``) and each of
    ``eval_sets`` (more arithmetic held-out sets, ``{"digits", "ops", "heldout_size",
    "heldout_seed"}``; recorded only when there are any) are never trained on."""
    out = {"shape": asdict(shape) if is_dataclass(shape) else dict(shape), "digits": digits, "ops": list(ops),
           "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "stop_loss": stop_loss,
           "heldout_size": heldout_size, "heldout_seed": heldout_seed, "schedule": schedule, "warmup": warmup}
    if eval_sets:
        out["eval_sets"] = [dict(s) for s in eval_sets]
    return out


def read_recipe(directory: str | Path) -> dict | None:
    """The recipe a base directory records (``recipe.json``); None when it records none."""
    path = Path(directory) / RECIPE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def shipped_recipe() -> dict | None:
    return read_recipe(SHIPPED)


def digest(r: Mapping[str, Any]) -> str:
    """A short name for a recipe: the first 10 hex digits of the SHA-256 of its canonical JSON."""
    return hashlib.sha256(json.dumps(r, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:10]


def recipe_dir(default: str | Path, r: Mapping[str, Any]) -> Path:
    """Where the base of recipe ``r`` lives in the family at ``default``: ``default`` itself for
    the shipped recipe, ``<default>-<digest>`` for any other."""
    default = Path(default)
    return default if dict(r) == shipped_recipe() else default.with_name(f"{default.name}-{digest(r)}")


def _flat(r: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in r.items() if k != "shape"}
    out.update({f"shape.{k}": v for k, v in (r.get("shape") or {}).items()})
    out.setdefault("eval_sets", [])
    return out


def differences(recorded: Mapping[str, Any], want: Mapping[str, Any], *, label: str = "config") -> list[str]:
    """``field = recorded (<label>: wanted)`` for each recipe entry where the two differ, named
    by its config field (or the recipe's own name for one fixed in code)."""
    a, b = _flat(recorded), _flat(want)
    out = []
    for key in [*RECIPE_FIELDS, *sorted(set(a) | set(b) - set(RECIPE_FIELDS))]:
        if a.get(key) != b.get(key):
            name = RECIPE_FIELDS.get(key) or f"the warm-up's {key}"
            out.append(f"{name} = {_show(a.get(key))} ({label}: {_show(b.get(key))})")
    return out


def _show(v: Any) -> str:
    return "none" if v is None else json.dumps(v) if isinstance(v, (list, dict)) else str(v)


def heldout_sets(r: Mapping[str, Any]) -> list[dict] | None:
    """The held-out sets a recipe's warm-up left out, as ``{"digits", "ops", "heldout_size",
    "heldout_seed"}``; None when the record does not say (no ``heldout_seed``: a directory
    written before recipes were recorded)."""
    if r.get("heldout_seed") is None or r.get("heldout_size") is None:
        return None
    main = {k: r.get(k) for k in ("digits", "ops", "heldout_size", "heldout_seed")}
    return [main, *(dict(s) for s in r.get("eval_sets") or [])]


def _problems(s: Mapping[str, Any]) -> set:
    return set(heldout_problems(n=int(s["heldout_size"]), seed=int(s["heldout_seed"]), digits=int(s["digits"]),
                                ops=tuple(s["ops"])))


def leaked(r: Mapping[str, Any], evaluated: Sequence[Mapping[str, Any]]) -> int | None:
    """How many held-out problems of the ``evaluated`` sets (each as in ``heldout_sets``) the
    warm-up of recipe ``r`` may have trained on: those of its digits and operators that it
    did not leave out. None when ``r`` does not record what it left out."""
    left_out = heldout_sets(r)
    if left_out is None:
        return None
    excluded = set().union(*(_problems(s) for s in left_out))
    trained = [s for s in evaluated if s["digits"] == r.get("digits") and set(s["ops"]) & set(r.get("ops") or ())]
    return sum(1 for s in trained for p in _problems(s) if p.op in r["ops"] and p not in excluded)
