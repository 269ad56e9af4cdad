"""LoRA training for the torch engine (``trainer.lora_rank > 0``), on PEFT.

PEFT injects its LoRA layers into the ``transformers`` model in place: each target module
(``trainer.lora_targets``) becomes a LoRA layer holding the frozen base layer and the
trainable ``lora_A`` [r, in] and ``lora_B`` [out, r] (B starts at zero, so the first policy
is the base). The engine keeps training that same model object, so the loss, the sampler and
the log-probabilities run on it unchanged. What leaves the engine keeps the plain HF names:

* :meth:`LoraState.merged_weights`: every weight under the names of the unwrapped model,
  each target's ``W + scale·B·A`` (scale = lora_alpha / lora_rank), computed into new
  tensors: the trained model is never merged or otherwise changed. Generators and every
  weight transport see an ordinary full model.
* :meth:`LoraState.adapter_tensors`: the A/B tensors alone, named
  ``<target module's HF name>.lora_A.weight`` / ``.lora_B.weight`` (PEFT's saved-adapter
  names without its ``base_model.model.`` prefix).
* Checkpoints (:meth:`LoraState.save` / :meth:`LoraState.load`): ``adapter.safetensors``
  (the adapter tensors above) and ``optimizer.safetensors`` (AdamW's state over the adapter
  parameters, and the torch RNG); the JSON extras record the LoRA settings and the base
  checkpoint's weight files, and a checkpoint resumes only under the same ones. The frozen
  base is read again from ``model.base_dir``.
* :meth:`LoraState.base_view`: the same modules with the adapters switched off and in eval
  mode, the KL reference (``trainer.kl_coef``) without a second copy of the base.
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pipeline.config import TrainerConfig
from pipeline.engines.torch_state import optimizer_tensors, restore_optimizer
from pipeline.model.qwen import safetensors_files

ADAPTER = "default"
"""The one adapter's name inside PEFT's layers."""

ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"


def require_peft():
    try:
        import peft
    except ImportError as e:  # pragma: no cover - the CPU requirement set installs it
        raise RuntimeError("trainer.lora_rank: LoRA training needs peft, which is not installed here (the 'lora' "
                           "extra: `pip install -e .[lora]`; requirements/cpu.txt installs it)") from e
    return peft


def settings(t: TrainerConfig) -> dict[str, Any]:
    """The LoRA settings a checkpoint records (JSON)."""
    return {"rank": t.lora_rank, "alpha": t.lora_alpha, "dropout": t.lora_dropout, "targets": list(t.lora_targets)}


def _matches(module_name: str, target: str) -> bool:
    # PEFT's rule for a list of target names: the full dotted name, or its last parts.
    return module_name == target or module_name.endswith("." + target)


def base_fingerprint(base_dir: str | Path) -> dict[str, int]:
    """The base checkpoint's weight files and their sizes: adapters resume only on the base they trained on."""
    return {f.name: f.stat().st_size for f in safetensors_files(base_dir)}


class LoraState:
    """The LoRA side of one :class:`pipeline.engines.torch.TorchEngine`: wraps ``model`` in place."""

    def __init__(self, model: torch.nn.Module, t: TrainerConfig, *, base_dir: str | Path) -> None:
        peft = require_peft()
        from peft.tuners.lora import LoraLayer

        self.settings = settings(t)
        self.base_dir = Path(base_dir)
        self.plain_names = list(model.state_dict())
        modules = dict(model.named_modules())
        for target in t.lora_targets:
            if not any(_matches(name, target) for name in modules if name):
                raise ValueError(f"trainer.lora_targets: {target!r} names no module of the model in "
                                 f"{self.base_dir} (its modules end in e.g. "
                                 f"{sorted({n.rsplit('.', 1)[-1] for n in modules if n})[:12]})")
        config = peft.LoraConfig(r=t.lora_rank, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout,
                                 target_modules=list(t.lora_targets), bias="none")
        with warnings.catch_warnings():
            # PEFT asks transformers 5 through a deprecated alias whether checkpointing is on.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            self.peft_model = peft.get_peft_model(model, config, adapter_name=ADAPTER)
        self.model = model
        self.layers: dict[str, Any] = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
        for name, layer in self.layers.items():
            if not isinstance(layer.get_base_layer(), torch.nn.Linear):
                raise ValueError(f"trainer.lora_targets: {name} is a {type(layer.get_base_layer()).__name__}; "
                                 "adapters go on linear layers only")
        self._names: dict[str, str | None] = {}
        self._check_names()
        trainable = {id(q) for q in model.parameters() if q.requires_grad}
        if trainable != {id(q) for q in self.adapter_params().values()}:
            raise RuntimeError("LoRA wrapping left parameters other than the adapters trainable")

    # ------------------------------------------------------------------ names

    def _plain_name(self, key: str) -> str | None:
        """The unwrapped model's name of a state-dict key of the wrapped one (None: an adapter tensor)."""
        if key in self._names:
            return self._names[key]
        self._names[key] = name = self._rename(key)
        return name

    def _rename(self, key: str) -> str | None:
        for prefix in self.layers:
            if key.startswith(prefix + "."):
                rest = key[len(prefix) + 1:]
                if rest.startswith("base_layer."):
                    return f"{prefix}.{rest[len('base_layer.'):]}"
                return None
        return key

    def _check_names(self) -> None:
        wrapped = self.model.state_dict()
        mapped = [n for n in (self._plain_name(k) for k in wrapped) if n is not None]
        if sorted(mapped) != sorted(self.plain_names):
            raise RuntimeError(f"LoRA wrapping changed the weight names: {sorted(set(mapped) ^ set(self.plain_names))}")
        # A target whose weight is shared with another name (tied embeddings) would publish
        # the merged weight under one name and the base under the other.
        bases = {self.layers[p].get_base_layer().weight.data_ptr(): p for p in self.layers}
        for key, tensor in wrapped.items():
            name = self._plain_name(key)
            if name is not None and not key.endswith(".base_layer.weight") and tensor.data_ptr() in bases:
                raise ValueError(f"trainer.lora_targets: {bases[tensor.data_ptr()]} shares its weight with {name} "
                                 "(tied weights); leave it out of the targets")

    def adapter_params(self) -> dict[str, torch.nn.Parameter]:
        """The trainable adapter parameters under their public names, in model order."""
        out = {}
        for name, layer in self.layers.items():
            out[f"{name}.lora_A.weight"] = layer.lora_A[ADAPTER].weight
            out[f"{name}.lora_B.weight"] = layer.lora_B[ADAPTER].weight
        return out

    # ------------------------------------------------------------------ what leaves the engine

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The LoRA A/B tensors only (live, detached views)."""
        return {name: p.detach() for name, p in self.adapter_params().items()}

    def scale(self, module: str) -> float:
        """lora_alpha / lora_rank of one target module (what its B·A is multiplied by)."""
        return float(self.layers[module].scaling[ADAPTER])

    @torch.no_grad()
    def merged_weights(self) -> dict[str, torch.Tensor]:
        """Every weight under the plain HF names; each target's is a new tensor W + scale·B·A
        (the model's own tensors are not written). Other weights are live detached views."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in self.model.state_dict().items():
            name = self._plain_name(key)
            if name is not None:
                out[name] = tensor.detach()
        for prefix, layer in self.layers.items():
            name = f"{prefix}.weight"
            out[name] = out[name] + layer.get_delta_weight(ADAPTER).to(out[name].dtype)
        return {name: out[name] for name in self.plain_names}

    @contextmanager
    def adapters_off(self):
        """The model as the base: adapters bypassed and eval mode (dropout off), restored after."""
        was_training = self.model.training
        self.model.eval()
        try:
            with self.peft_model.disable_adapter():
                yield self.model
        finally:
            self.model.train(was_training)

    def base_view(self) -> _BaseView:
        return _BaseView(self)

    # ------------------------------------------------------------------ checkpoints

    def save(self, directory: Path, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """``adapter.safetensors`` and ``optimizer.safetensors`` (with the torch RNG) into
        ``directory``; returns the JSON extras (optimizer param groups, LoRA settings, base files)."""
        save_file({k: v.to("cpu", copy=True).contiguous() for k, v in self.adapter_tensors().items()},
                  str(directory / ADAPTER_FILE))
        opt_tensors, groups = optimizer_tensors(opt)
        opt_tensors["rng.torch"] = torch.get_rng_state()
        save_file(opt_tensors, str(directory / OPTIMIZER_FILE))
        return {"param_groups": groups, "lora": self.settings, "lora_base": base_fingerprint(self.base_dir)}

    def load(self, directory: Path, opt: torch.optim.Optimizer, extras: dict[str, Any]) -> None:
        """Inverse of :meth:`save`: adapters, optimizer and the torch RNG."""
        if extras.get("lora") != self.settings:
            raise ValueError(f"trainer.lora_rank: the checkpoint {directory} was written with LoRA settings "
                             f"{json.dumps(extras.get('lora'))} and this config has {json.dumps(self.settings)}; "
                             "a checkpoint resumes only under the settings that wrote it")
        if extras.get("lora_base") != base_fingerprint(self.base_dir):
            raise ValueError(f"model.base_dir: the checkpoint {directory} holds adapters trained on a base whose "
                             f"weight files were {extras.get('lora_base')}; {self.base_dir} has "
                             f"{base_fingerprint(self.base_dir)}")
        tensors = load_file(str(directory / ADAPTER_FILE))
        params = self.adapter_params()
        if sorted(tensors) != sorted(params) or any(tuple(tensors[k].shape) != tuple(p.shape)
                                                     for k, p in params.items()):
            raise ValueError(f"{directory / ADAPTER_FILE}: its adapter tensors do not fit the model")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(tensors[name])
        opt_tensors = load_file(str(directory / OPTIMIZER_FILE))
        restore_optimizer(opt, opt_tensors, extras["param_groups"])
        torch.set_rng_state(opt_tensors["rng.torch"])


class _BaseView:
    """Callable like the model, computing the base's outputs (the KL reference)."""

    def __init__(self, state: LoraState) -> None:
        self.state = state

    def __call__(self, *args, **kwargs):
        with self.state.adapters_off() as model:
            return model(*args, **kwargs)


# ---------------------------------------------------------------------- generator side

ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class AdapterMerger:
    """A generator's half of ``weights.payload = "adapter"``: versions carry the A/B tensors
    alone (``LoraState.adapter_tensors``), and each target's weight becomes W₀ + scale·B·A,
    W₀ being the target's weight as it was before the first adapter came (the base the
    generator loaded from ``model.base_dir``, as the trainer's frozen base). Computed as PEFT
    computes its delta, so the generator holds the weights the trainer would have sent in
    full. A payload that does not fit (a missing half, a module the model lacks, other shapes,
    another set of modules than the first version's) raises ValueError before anything
    changes: the generator keeps the weights it has.

    ``weights()`` gives the model's weights by HF name; it is read once, at the first adapter,
    for the targets' W₀ (:meth:`of_model` reads a torch model's parameters).
    """

    def __init__(self, weights, scale: float) -> None:
        self._weights, self.scale = weights, float(scale)
        self.base: dict[str, torch.Tensor] | None = None
        self.modules: tuple[str, ...] | None = None

    @classmethod
    def of_model(cls, model: torch.nn.Module, scale: float) -> "AdapterMerger":
        merger = cls(lambda: dict(model.named_parameters()), scale)
        merger.model = model
        return merger

    def merged(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new weight of each target (``<module>.weight``), computed onto its base."""
        stray = sorted(k for k in tensors if not k.endswith(ADAPTER_SUFFIXES))
        if stray:
            raise ValueError(f"weights.payload adapter: the version holds non-adapter tensors {stray[:3]} (was it "
                             "published with weights.payload full?)")
        modules = tuple(sorted({k.rsplit(".lora_", 1)[0] for k in tensors}))
        if not modules:
            raise ValueError("weights.payload adapter: the version holds no adapter tensors")
        if self.modules is not None and modules != self.modules:
            raise ValueError(f"weights.payload adapter: the version adapts {len(modules)} modules, the first one "
                             f"{len(self.modules)}; every version must adapt the same ones")
        current = self._weights() if self.base is None else self.base
        for m in modules:
            a, b, w = tensors.get(f"{m}.lora_A.weight"), tensors.get(f"{m}.lora_B.weight"), current.get(f"{m}.weight")
            if a is None or b is None:
                raise ValueError(f"weights.payload adapter: {m} has only one of lora_A / lora_B")
            if w is None:
                raise ValueError(f"weights.payload adapter: the model has no weight {m}.weight to adapt")
            if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w.shape):
                raise ValueError(f"weights.payload adapter: {m}: B {tuple(b.shape)} · A {tuple(a.shape)} does not "
                                 f"make its weight's shape {tuple(w.shape)}")
        if self.base is None:
            self.base = {f"{m}.weight": current[f"{m}.weight"].detach().clone() for m in modules}
        self.modules = modules
        out = {}
        with torch.no_grad():
            for m in modules:
                base = self.base[f"{m}.weight"]
                delta = (tensors[f"{m}.lora_B.weight"] @ tensors[f"{m}.lora_A.weight"]) * self.scale
                out[f"{m}.weight"] = base + delta.to(base.device, base.dtype)
        return out

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """:meth:`merged`, copied into the model of :meth:`of_model` in place."""
        merged = self.merged(tensors)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, w in merged.items():
                params[name].copy_(w)
