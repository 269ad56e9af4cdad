"""Which HF checkpoints the torchtitan trainer can build, checked without torch or torchtitan.

``ARCHES`` maps an HF ``model_type`` to the torchtitan model that trains it;
``checkpoint_problems(config.json)`` says why a checkpoint cannot be built exactly (each item
names the field). ``pipeline up`` runs it before launch when ``trainer.backend`` is
``torchtitan``; the trainer (``pipeline.engines.titan``) runs it again when it loads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TitanArch:
    """How checkpoints of one HF ``model_type`` become a torchtitan model: the torchtitan model
    package, its decoder and block classes, its HF state-dict adapter, and what that model can
    represent (RoPE layout and scalings, QK-norm, extra fields that must hold a value)."""

    package: str
    """``torchtitan.models.<package>``."""
    model: str
    block: str
    adapter: str
    """The class in ``torchtitan.models.<package>.state_dict_adapter``."""
    rope: str
    """The RoPE layout the adapter's ``from_hf`` assumes (it checks): ``CosSinRoPE`` rotates halves,
    as HF does, so q/k load as they are; ``ComplexRoPE`` rotates adjacent pairs, and the adapter
    permutes the rows of q/k (``from_hf``) and back (``to_hf``), a pure reindexing."""
    rope_types: tuple[str, ...]
    """HF ``rope_type`` values the RoPE module computes exactly as transformers does."""
    qk_norm: bool
    """RMSNorm on q and k per head, before RoPE (Qwen3)."""
    required: tuple[tuple[str, object], ...] = ()
    """(config.json field, the value torchtitan's model implies), beside the common ones."""


COMMON_REQUIRED: tuple[tuple[str, object], ...] = (
    ("hidden_act", "silu"),        # torchtitan's FeedForward is SwiGLU
    ("attention_bias", False),     # its q/k/v/o projections have no bias
    ("mlp_bias", False),           # nor do w1/w2/w3
    ("attention_dropout", 0.0),    # its attention has no dropout (transformers applies it in train mode)
    ("partial_rotary_factor", 1.0),  # RoPE over the whole head
)
"""Fields every architecture needs at these values (an absent field takes transformers' default,
which is this value)."""

ARCHES: dict[str, TitanArch] = {
    "qwen3": TitanArch(package="qwen3", model="Qwen3Model", block="Qwen3TransformerBlock",
                       adapter="Qwen3StateDictAdapter", rope="CosSinRoPE", rope_types=("default",), qk_norm=True,
                       required=(("use_sliding_window", False),)),
    "llama": TitanArch(package="llama3", model="Llama3Model", block="Llama3TransformerBlock",
                       adapter="Llama3StateDictAdapter", rope="ComplexRoPE", rope_types=("default", "llama3"),
                       qk_norm=False),
}
"""HF ``model_type`` -> the torchtitan model that trains it (``LlamaForCausalLM``: Llama 2/3,
SmolLM2, ...; ``Qwen3ForCausalLM``: dense Qwen3)."""

LLAMA3_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor")
"""What a ``rope_type: llama3`` scaling must state (transformers reads them without defaults)."""


def rope_parameters(cfg: dict) -> dict:
    """The RoPE settings of an HF config, in either layout: ``rope_parameters`` (transformers 5)
    over the older top-level ``rope_scaling`` / ``rope_theta``; ``rope_type`` normalised (old
    files say ``type``)."""
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    if "rope_theta" not in rope and cfg.get("rope_theta") is not None:
        rope["rope_theta"] = cfg["rope_theta"]
    return rope


def checkpoint_problems(cfg: dict) -> list[str]:
    """Why torchtitan's model for ``cfg["model_type"]`` cannot compute what transformers computes
    for this ``config.json`` (each item names the field and what it needs); empty when it can."""
    model_type = cfg.get("model_type")
    arch = ARCHES.get(model_type)
    if arch is None:
        return [f"model_type {model_type!r} (the torchtitan backend builds {', '.join(map(repr, ARCHES))})"]
    problems = []
    for field, need in COMMON_REQUIRED + arch.required:
        if field in cfg and cfg[field] is not None and cfg[field] != need:
            problems.append(f"{field} {cfg[field]!r} (need {need!r})")
    heads = int(cfg.get("num_attention_heads") or 0)
    kv = int(cfg.get("num_key_value_heads") or heads)
    if heads <= 0 or kv <= 0 or heads % kv:
        problems.append(f"num_attention_heads {heads} / num_key_value_heads {kv} (need kv heads dividing heads)")
    rope = rope_parameters(cfg)
    if any(isinstance(v, dict) for v in rope.values()):
        problems.append("rope_parameters per layer type (need one RoPE for every layer)")
        return problems
    kind = rope["rope_type"]
    if kind not in arch.rope_types:
        problems.append(f"rope_type {kind!r} (need {' or '.join(map(repr, arch.rope_types))} for {model_type})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor {rope['partial_rotary_factor']!r} (need 1.0)")
    if kind == "llama3":
        missing = [f for f in LLAMA3_ROPE_FIELDS if not isinstance(rope.get(f), (int, float))]
        if missing:
            problems.append(f"rope_type 'llama3' without {', '.join(missing)}")
        elif rope["high_freq_factor"] == rope["low_freq_factor"]:
            problems.append("rope_type 'llama3' with high_freq_factor == low_freq_factor")
    return problems
