"""Sharded checkpoints of FSDP2 state without pickle: one safetensors file per rank.

Each rank writes only what it holds: the local rows of every ``Shard(0)`` DTensor (FSDP2's
layout) and, on rank 0, the replicated tensors, into
``rank-<r>-of-<W>.safetensors``. The file's header records, per tensor, the global shape
and the rows it covers, as JSON. Loading reads the headers of every file and copies the
rows each rank now needs, straight out of the files (``safe_open`` slices), so a checkpoint
written by W ranks resumes under any other rank count. No collective is involved beyond a
barrier, and nothing is pickled: ``torch.distributed.checkpoint``'s planner exchanges
pickled plans between ranks, which the project's wire rule excludes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Replicate, Shard

META_KEY = "rlpipe.shards"


def _row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows of a ``Shard(0)`` DTensor that ``rank`` of ``world`` holds (``torch.chunk`` sizes)."""
    sizes = [c.numel() for c in torch.arange(rows).chunk(world)] if rows else []
    start = sum(sizes[:rank])
    return start, start + (sizes[rank] if rank < len(sizes) else 0)


def _layout(t: torch.Tensor) -> str:
    if not isinstance(t, DTensor):
        return "full"
    if len(t.placements) != 1:
        raise ValueError(f"sharded checkpoints take 1-D meshes; got placements {t.placements}")
    p = t.placements[0]
    if isinstance(p, Replicate):
        return "replicated"
    if isinstance(p, Shard) and p.dim == 0:
        return "rows"
    raise ValueError(f"sharded checkpoints take Shard(0) or Replicate; got {p}")


def save_sharded(directory: Path, tensors: dict[str, torch.Tensor], *, rank: int, world: int) -> Path:
    """Write this rank's file; every rank calls it with the same names."""
    directory.mkdir(parents=True, exist_ok=True)
    local: dict[str, torch.Tensor] = {}
    meta: dict[str, list] = {}
    for name, t in tensors.items():
        layout = _layout(t)
        if layout == "rows":
            start, stop = _row_range(t.shape[0], world, rank)
            value = t.to_local()
            if value.shape[0] != stop - start:
                raise ValueError(f"{name}: local shard has {value.shape[0]} rows, expected {stop - start}")
        elif rank == 0:
            value = t.to_local() if layout == "replicated" else t
            start, stop = 0, (t.shape[0] if t.dim() else 0)
        else:
            continue
        local[name] = value.detach().to("cpu").contiguous()
        meta[name] = [list(t.shape), start, stop]
    path = directory / f"rank-{rank:05d}-of-{world:05d}.safetensors"
    tmp = path.with_suffix(".tmp")
    save_file(local, str(tmp), metadata={META_KEY: json.dumps(meta)})
    tmp.rename(path)
    return path


def load_sharded(directory: Path, targets: dict[str, torch.Tensor], *, rank: int, world: int) -> None:
    """Copy the saved values into ``targets`` (this rank's DTensors or plain tensors), in place."""
    files = sorted(directory.glob("rank-*-of-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no rank-*.safetensors in {directory}")
    pieces: dict[str, list[tuple[Path, int, int, list[int]]]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {}).get(META_KEY, "{}"))
        for name, (shape, start, stop) in meta.items():
            pieces.setdefault(name, []).append((f, start, stop, shape))
    missing = sorted(set(targets) - set(pieces))
    if missing:
        raise ValueError(f"{directory}: checkpoint lacks {missing[:5]}{'...' if len(missing) > 5 else ''}")
    with torch.no_grad():
        for name, t in targets.items():
            layout = _layout(t)
            dest = t.to_local() if layout != "full" else t
            saved_shape = pieces[name][0][3]
            if list(t.shape) != saved_shape:
                raise ValueError(f"{name}: checkpoint shape {saved_shape}, this model's {list(t.shape)}")
            if layout == "rows":
                want = _row_range(t.shape[0], world, rank)
            else:
                want = (0, t.shape[0] if t.dim() else 0)
            if t.dim() == 0:
                f = pieces[name][0][0]
                with safe_open(str(f), framework="pt") as fh:
                    dest.copy_(fh.get_tensor(name))
                continue
            for f, start, stop, _ in pieces[name]:
                lo, hi = max(want[0], start), min(want[1], stop)
                if lo >= hi:
                    continue
                with safe_open(str(f), framework="pt") as fh:
                    part = fh.get_slice(name)[lo - start: hi - start]
                dest[lo - want[0]: hi - want[0]].copy_(part)
