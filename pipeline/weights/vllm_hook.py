"""Swap fetched weights into a vLLM engine (the ``vllm`` generator backend; docs/design.md §6).

vLLM is not a dependency of the embedded default, so nothing here imports it at module
level: the caller passes its own ``vllm.LLM``. Measured on vLLM-CPU (docs/design.md §6): a
reload takes 10–25 ms for the tiny model.

Tied embeddings (``tie_word_embeddings``, e.g. SmolLM2): vLLM's model shares one parameter
between ``model.embed_tokens`` and ``lm_head`` and its loader fills it once, under the
embedding's name. On CPU the output head does not compute from that parameter, though, but
from a packed copy made when the weights were first processed (``cpu_linear``: oneDNN or
sgl-kernel); ``reload_weights`` re-processes only the layers it loaded, so after a reload the
input embeddings were the new ones and the head still the old ones (measured on vLLM-CPU
0.32: greedy outputs changed, log-probs off by up to 5.7 from the updated torch model's).
:func:`update_vllm` therefore re-processes every layer whose weight is shared with another
one after each reload (:func:`refresh_tied_layers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def refresh_tied_layers(worker: Any) -> int:
    """On one vLLM worker (run through ``collective_rpc``): re-run the weight processing of every
    unquantized layer whose ``weight`` parameter is shared with another layer (a tied output
    head), so whatever it derived from the weight (vLLM-CPU's packed GEMM weight) follows the
    values a reload wrote into the shared parameter. Returns how many layers it re-processed."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    owners: dict[int, list[Any]] = {}
    for module in worker.model_runner.get_model().modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None and isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
            owners.setdefault(id(weight), []).append(module)
    done = 0
    for modules in owners.values():
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)
                done += 1
    return done


def update_vllm(llm: Any, tensors: dict[str, torch.Tensor], *, reset_prefix_cache: bool = True) -> None:
    """Load ``tensors`` (HF names, as ``WeightFetcher.fetch`` returns them) into ``llm`` in place.

    Runs between generation batches, or between two engine steps with requests in flight
    (``generator.swap`` step/drain). ``reload_weights`` on each
    worker feeds the tensors through the model's own ``load_weights`` (so vLLM's
    fused and sharded layouts are its business), then layers sharing a tied weight are
    re-processed (:func:`refresh_tied_layers`, see the module docstring), then the prefix
    cache is reset: cached KV blocks were computed by the old weights and must not be reused.
    ``reset_prefix_cache=False`` skips that for an engine built without prefix caching
    (the streaming engine, whose running requests would make the reset fail and warn).

    Fetch with ``copy=True`` when the engine's workers live in other processes (the
    tensors are serialised to them, and views of the fetcher's buffer would only be
    valid until its next fetch); ``copy=False`` is enough for an in-process engine.
    """
    if not tensors:
        raise ValueError("update_vllm needs at least one tensor")
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(tensors.items())})
    llm.collective_rpc(refresh_tied_layers)
    if reset_prefix_cache:
        llm.reset_prefix_cache()
