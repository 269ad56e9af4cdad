"""The torch engine's tensors in a trainer checkpoint (``pipeline.common.checkpoint``):
``model.safetensors`` (weights under their HF names) and ``optimizer.safetensors``
(AdamW's per-parameter state and the torch RNG). No pickle: safetensors, the param groups
go back as JSON."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pipeline.model.qwen import load_state_tensors


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for idx, st in sd["state"].items():
        for name, value in st.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"state.{idx}.{name}"] = t.detach().to("cpu", copy=True).contiguous()
    groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, groups


def restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if not key.startswith("state."):
            continue
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = t
    opt.load_state_dict({"state": state, "param_groups": groups})


def write_torch_state(directory: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """``model.safetensors`` and ``optimizer.safetensors`` (with the torch RNG) of one process;
    returns the optimizer's param groups (JSON)."""
    model_tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    save_file(model_tensors, str(directory / "model.safetensors"))
    opt_tensors, groups = optimizer_tensors(opt)
    opt_tensors["rng.torch"] = torch.get_rng_state()
    save_file(opt_tensors, str(directory / "optimizer.safetensors"))
    return groups


def read_torch_state(directory: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                     param_groups: list[dict[str, Any]]) -> None:
    """Inverse of :func:`write_torch_state`: model, optimizer and the torch RNG."""
    load_state_tensors(model, load_file(str(directory / "model.safetensors")))
    opt_tensors = load_file(str(directory / "optimizer.safetensors"))
    restore_optimizer(opt, opt_tensors, param_groups)
    torch.set_rng_state(opt_tensors["rng.torch"])


def weights_hash(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of a model's weights, bit for bit: blake2b (128 bits) over every tensor in name
    order, its name, dtype and shape included. Two steps, runs or replays with the same hash
    hold identical weights. The trainer records one per step (``weights_hash`` in the step
    rows and the archive) and ``pipeline replay`` checks against it."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(memoryview(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()
