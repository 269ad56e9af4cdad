"""The ``torchtitan`` trainer engine: torchtitan's Qwen3 or Llama 3 under FSDP2, one process per rank.

``pipeline train`` runs under ``torchrun --nproc-per-node <trainer.nproc>``. Every rank
builds a :class:`TitanEngine` (the constructor is collective: process group, model,
``fully_shard``). Rank 0 is the *driver*: the normal trainer loop (all Redis I/O, commit,
publish, evaluation) calls the engine's methods. Ranks > 0 are *followers*: they never
touch Redis and run :func:`follow`, which executes, in lock-step, whatever collective work
the driver announces.

The command protocol (rank 0 -> all, ``torch.distributed.broadcast``, no pickle):

    header   int64 tensor [opcode, payload length]
    payload  uint8 tensor of MessagePack bytes (omitted when the length is 0)

    TRAIN    payload: the ScoredGroup records' own MessagePack encodings. Every rank
             computes the advantages of all groups, takes its contiguous slice of the
             completions, and normalises its token sums by the whole batch's token count
             (``pipeline.algo.losses.objective``); FSDP2 sums the gradients (division
             disabled), so the update equals one process stepping on the whole batch.
             The statistics, normalised the same way, are summed by an all-reduce.
    LR_STEP  the warm-up schedule advances on every rank.
    WEIGHTS  full_tensor() of every sharded parameter, renamed to HF names by
             the architecture's torchtitan state-dict adapter; only rank 0 keeps the result.
             ``greedy`` and ``export_hf`` need nothing else from the followers: rank 0
             copies the gathered weights into a plain local ``transformers`` model and
             decodes or saves there.
    SAVE     payload: the directory. Model, optimizer and the torch RNG into
             ``<dir>/shards``: each rank's rows as safetensors (``pipeline.engines.sharded_ckpt``;
             no pickle, no object collectives).
    LOAD     payload: the directory, the schedule state and learning rates; the inverse of
             SAVE, resharding, so a checkpoint loads under a different rank count.
    STOP     the followers leave :func:`follow`.

The model is built from the ``config.json`` of ``model.base_dir``: its ``model_type`` picks
the torchtitan model and adapter (``ARCHES``: ``qwen3``, ``llama``), and a checkpoint that
model cannot compute exactly is refused, naming the field (:func:`checkpoint_problems`). SDPA
attention, which runs on CPU (docs/design.md §9); the weights come from its safetensors
through the adapter's ``from_hf``. On CPU the process group is gloo, which has no averaging
reduce-scatter, so FSDP2 is told to reduce by sum (``set_force_sum_reduction_for_comms``); on
CUDA it is NCCL.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import signal
from functools import partial
from pathlib import Path

import msgpack
import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.distributed.utils import clip_grad_norm_
from torchtitan.models.common import Embedding, Linear, rope as titan_rope
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.nn_modules import RMSNorm

from pipeline.config import RunConfig
from pipeline.engines.titan_arch import (  # noqa: F401  re-exported
    ARCHES, COMMON_REQUIRED, LLAMA3_ROPE_FIELDS, TitanArch, checkpoint_problems, rope_parameters)
from pipeline.algo.losses import LossSettings, advantages, objective
from pipeline.engines.episodes import play
from pipeline.engines.sharded_ckpt import load_sharded, save_sharded
from pipeline.engines.torch import greedy_decode, warmup_schedule
from pipeline.model.qwen import load_checkpoint, load_state_tensors, safetensors_files, save_checkpoint, token_logprobs
from pipeline.model.tokenizer import load_tokenizer
from pipeline.records import ScoredGroup

OP_TRAIN, OP_LR_STEP, OP_WEIGHTS, OP_SAVE, OP_LOAD, OP_STOP = 1, 2, 3, 4, 5, 6
OP_NAMES = {OP_TRAIN: "TRAIN", OP_LR_STEP: "LR_STEP", OP_WEIGHTS: "WEIGHTS", OP_SAVE: "SAVE", OP_LOAD: "LOAD",
            OP_STOP: "STOP"}

COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)
"""How long a follower waits for the driver's next command. The driver may wait on Redis
for scored groups for as long as the generators take; a dead driver is noticed by
``torchrun``, which then stops the followers."""

SHARDS_DIR = "shards"
"""Subdirectory of a checkpoint holding the torch.distributed.checkpoint files."""


# --------------------------------------------------------------------------- model


def _hf_config(directory: Path) -> dict:
    cfg = json.loads((directory / "config.json").read_text())
    problems = checkpoint_problems(cfg)
    if problems:
        raise ValueError(f"model.base_dir {directory}: torchtitan backend cannot build this model: "
                         + "; ".join(problems))
    return cfg


def _rope_config(cfg: dict, arch: TitanArch, head_dim: int):
    """The RoPE config of ``arch``'s layout with the checkpoint's theta and scaling (the
    frequencies transformers' ``default`` / ``llama3`` initialisers compute)."""
    rope = rope_parameters(cfg)
    kw = {}
    if rope["rope_type"] == "llama3":
        # transformers prefers a top-level original_max_position_embeddings, then the
        # rope's own, then max_position_embeddings (standardize_rope_params).
        original = cfg.get("original_max_position_embeddings",
                           rope.get("original_max_position_embeddings", cfg["max_position_embeddings"]))
        kw = dict(scaling="llama", scaling_factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                  high_freq_factor=float(rope["high_freq_factor"]), original_max_position_embeddings=int(original))
    # transformers' default_theta when a config states none.
    theta = float(rope.get("rope_theta", 10000.0))
    return getattr(titan_rope, arch.rope).Config(dim=head_dim, max_seq_len=int(cfg["max_position_embeddings"]),
                                                  theta=theta, **kw)


def titan_model_config(cfg: dict):
    """torchtitan's model config for an HF ``config.json`` that :func:`checkpoint_problems` accepts:
    the ``ARCHES`` entry of its ``model_type``, dense, SDPA attention, separate q/k/v projections."""
    arch = ARCHES[cfg["model_type"]]
    package = importlib.import_module(f"torchtitan.models.{arch.package}")
    model_cls, block_cls = getattr(package, arch.model), getattr(package, arch.block)
    dim = int(cfg["hidden_size"])
    n_heads = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    head_dim = int(cfg.get("head_dim") or dim // n_heads)
    vocab = int(cfg["vocab_size"])
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    # Every weight is overwritten from the HF checkpoint; the initialisers only satisfy init_states.
    linear_init = {"weight": partial(torch.nn.init.normal_, std=0.02)}
    norm_init = {"weight": torch.nn.init.ones_}

    def norm(n: int):
        return RMSNorm.Config(normalized_shape=n, eps=eps, param_init=norm_init)

    rope = _rope_config(cfg, arch, head_dim)
    # head_dim is always stated, so the softmax scale is head_dim ** -0.5, as transformers passes it.
    layers = [
        block_cls.Config(
            attention_norm=norm(dim), ffn_norm=norm(dim),
            attention=make_gqa_config(dim=dim, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
                                      wqkv_param_init=linear_init, wo_param_init=linear_init,
                                      inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=False,
                                      rope=rope, qk_norm=norm(head_dim) if arch.qk_norm else None),
            feed_forward=make_ffn_config(dim=dim, hidden_dim=int(cfg["intermediate_size"]),
                                         w1_param_init=linear_init, w2w3_param_init=linear_init))
        for _ in range(int(cfg["num_hidden_layers"]))]
    return model_cls.Config(
        vocab_size=vocab, dim=dim, norm=norm(dim), enable_weight_tying=bool(cfg.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=linear_init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=linear_init), layers=layers)


def read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory (``model.safetensors`` or its sharded index)."""
    files = safetensors_files(directory)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def build_titan_model(base_dir: Path):
    """(model, model config, state-dict adapter): the torchtitan model of the checkpoint's
    ``model_type`` (``ARCHES``) with its weights, float32."""
    cfg = _hf_config(base_dir)
    arch = ARCHES[cfg["model_type"]]
    mcfg = titan_model_config(cfg)
    model = mcfg.build()
    model.init_states()
    adapter_cls = getattr(importlib.import_module(f"torchtitan.models.{arch.package}.state_dict_adapter"), arch.adapter)
    adapter = adapter_cls(mcfg, None)
    hf = read_hf_tensors(base_dir)
    if mcfg.enable_weight_tying:
        # transformers ties the head to the embedding whatever the file holds; so does from_hf
        # when the head is absent.
        hf.pop("lm_head.weight", None)
    model.load_state_dict(adapter.from_hf(hf), strict=True)
    return model.float(), mcfg, adapter


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Parameter names that share an earlier name's tensor (a tied head: ``lm_head.weight`` ->
    ``tok_embeddings.weight``); the same on every rank."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            out[name] = first[id(param)]
        else:
            first[id(param)] = name
    return out


def titan_completion_logprobs(model, prompts: list[torch.Tensor], completion_ids: torch.Tensor, *, pad_id: int,
                              with_entropy: bool = False, temperature: float = 1.0):
    """Log-probabilities of ``completion_ids[N, T]`` after ``prompts`` (1-D, any lengths) under a titan model.

    Each row is its prompt and completion (less its last token) right-padded; causal
    attention keeps real tokens from seeing the padding after them, and positions start
    at 0 in every row, so no mask is needed. Same contract as
    :func:`pipeline.model.qwen.ragged_completion_logprobs`.
    """
    n, t = completion_ids.shape
    if t == 0:
        raise ValueError("completion_ids has no tokens")
    lens = torch.tensor([int(p.numel()) for p in prompts])
    width = int(lens.max()) + t - 1
    device = completion_ids.device
    inputs = torch.full((n, width), pad_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        inputs[i, : p.numel()] = p
        inputs[i, p.numel(): p.numel() + t - 1] = completion_ids[i, : t - 1]
    logits = model(inputs)
    index = (lens.unsqueeze(1) - 1 + torch.arange(t).unsqueeze(0)).to(device)
    logits = logits[torch.arange(n, device=device).unsqueeze(1), index].float()
    # At the generators' sampling temperature, like the torch engine.
    return token_logprobs(logits, completion_ids, temperature=temperature, with_entropy=with_entropy)


# --------------------------------------------------------------------------- process group


def resolve_device(cfg: RunConfig) -> torch.device:
    """``trainer.device``: ``auto`` is cuda when a GPU is visible, else cpu."""
    kind = cfg.trainer.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device is 'cuda' but torch sees no GPU")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _init_process_group(device: torch.device) -> bool:
    """Join torchrun's process group (or make a one-rank group outside torchrun); True if this call created it."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=COLLECTIVE_TIMEOUT)
    return True


# --------------------------------------------------------------------------- engine


class TitanEngine:
    """``trainer.backend = "torchtitan"``: this rank's part of the FSDP2-sharded policy.

    On rank 0 it is the :class:`~pipeline.engines.TrainEngine` the trainer loop drives;
    every method that needs the other ranks announces itself first. On other ranks it is
    driven by :func:`follow`.
    """

    def __init__(self, cfg: RunConfig) -> None:
        t = cfg.trainer
        self.cfg = cfg
        self.base_dir = Path(cfg.model.base_dir)
        self.device = resolve_device(cfg)
        self._owns_group = _init_process_group(self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(t.seed)
        torch.set_num_threads(t.threads)
        self.tokenizer = load_tokenizer(self.base_dir)
        mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("fsdp",))

        def shard(model):
            model.to(self.device)
            # Per block, then the root; gradient division off: the loss is scaled to the global token mean.
            apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                                  pp_enabled=False)
            if self.device.type == "cpu":
                for m in model.modules():
                    if isinstance(m, FSDPModule):
                        m.set_force_sum_reduction_for_comms(True)
            return model

        model, self.model_config, self.adapter = build_titan_model(self.base_dir)
        self.vocab_size = int(self.model_config.vocab_size)
        self.model = shard(model)
        self.aliases = tied_aliases(self.model)
        self.model.eval()
        self.ref_model = shard(build_titan_model(self.base_dir)[0]).eval() if t.kl_coef > 0 else None
        if self.ref_model is not None:
            self.ref_model.requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.sched = warmup_schedule(self.opt, t.warmup_steps)
        self._gathered: dict[str, torch.Tensor] | None = None
        self._local = None
        self._local_fresh = False
        self._closed = False
        self._busy = False

    # ---------------------------------------------------------------- wire

    def _announce(self, op: int, payload: bytes = b"") -> None:
        # Marked busy until the operation completes: a driver that fails in between must
        # not send STOP into a collective the followers are still waiting in (close()).
        self._busy = op != OP_STOP
        if self.world == 1:
            return
        header = torch.tensor([op, len(payload)], dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device), src=0)

    def _receive(self) -> tuple[int, bytes]:
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        op, size = (int(v) for v in header.tolist())
        if op not in OP_NAMES:
            raise RuntimeError(f"rank {self.rank}: unknown command {op} from rank 0")
        payload = b""
        if size:
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            dist.broadcast(buf, src=0)
            payload = buf.cpu().numpy().tobytes()
        return op, payload

    def serve(self) -> None:
        """Follower loop: run the driver's commands until STOP."""
        if self.rank == 0:
            raise RuntimeError("serve() is for ranks > 0; rank 0 drives the engine")
        while True:
            op, payload = self._receive()
            if op == OP_STOP:
                return
            if op == OP_TRAIN:
                self._train([ScoredGroup.decode(b) for b in msgpack.unpackb(payload)])
            elif op == OP_LR_STEP:
                self.sched.step()
            elif op == OP_WEIGHTS:
                self._gather()
            elif op == OP_SAVE:
                self._save(Path(msgpack.unpackb(payload)["dir"]))
            elif op == OP_LOAD:
                msg = msgpack.unpackb(payload, strict_map_key=False)
                self._load(Path(msg["dir"]), msg["sched"], msg.get("lrs"))

    # ---------------------------------------------------------------- collective work (every rank)

    def _train(self, groups: list[ScoredGroup]) -> dict:
        t = self.cfg.trainer
        settings = LossSettings.from_config(t)
        pad_id = self.tokenizer.pad_id
        rows = []  # (prompt ids, completion ids, behaviour log-probs) of every completion, in order
        for g in groups:
            ro = g.rollout
            p = torch.from_numpy(ro.prompt_ids.astype(np.int64))
            for ids, lp in zip(ro.split(ro.completion_ids), ro.split(ro.behaviour_logprobs)):
                rows.append((p, ids, lp))
        if not rows:
            raise ValueError("train_step needs at least one completion")
        adv_all = advantages([g.rewards for g in groups], settings.advantage)
        global_tokens = sum(len(r[1]) for r in rows)
        n = len(rows)
        lo, hi = self.rank * n // self.world, (self.rank + 1) * n // self.world
        mine, adv = rows[lo:hi], adv_all[lo:hi]
        # A rank without completions still runs forward and backward (FSDP's collectives
        # must match), on a copy of the first row whose mask is all zero.
        empty = not mine
        if empty:
            mine, adv = rows[:1], adv_all[:1]
        width = max(len(r[1]) for r in mine)
        ids = torch.full((len(mine), width), pad_id, dtype=torch.long)
        behav = torch.zeros((len(mine), width))
        mask = torch.zeros((len(mine), width))
        for i, (_, c, b) in enumerate(mine):
            ids[i, : len(c)] = torch.from_numpy(c.astype(np.int64))
            behav[i, : len(b)] = torch.from_numpy(b.copy())
            mask[i, : len(c)] = 1
        if empty:
            mask.zero_()
        prompts = [r[0].to(self.device) for r in mine]
        ids, behav, mask, adv = (x.to(self.device) for x in (ids, behav, mask, adv.float()))

        self.model.train()
        temp = self.cfg.generator.temperature
        logp, entropy = titan_completion_logprobs(self.model, prompts, ids, pad_id=pad_id, with_entropy=True,
                                                  temperature=temp)
        ref_logp = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp = titan_completion_logprobs(self.ref_model, prompts, ids, pad_id=pad_id, temperature=temp)
        # Normalised by the whole batch's tokens: the summed gradients of all ranks are
        # those of the token mean over the whole batch, and so are the summed statistics.
        loss, stats = objective(logp, behav, mask, adv, settings, ref_logp=ref_logp, entropy=entropy,
                                tokens=global_tokens)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = clip_grad_norm_(list(self.model.parameters()), t.grad_clip)
        self.opt.step()
        self.model.eval()
        self._gathered = None
        self._local_fresh = False

        # Every rank holds the same keys in the same order.
        sums = torch.tensor([float(v) for v in stats.values()], dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(sums)
        stats = dict(zip(stats, sums.cpu().tolist()))
        stats["tokens"] = int(round(stats["tokens"]))
        return {"loss": stats["loss"], "grad_norm": float(grad_norm), **stats}

    def _gather(self) -> dict[str, torch.Tensor] | None:
        full = {}
        for name, value in self.model.state_dict().items():
            if name in self.aliases:
                continue  # the tied head: to_hf drops it; it is re-added below without a second gather
            value = value.full_tensor() if isinstance(value, DTensor) else value
            if self.rank == 0:
                full[name] = value.detach().to("cpu", copy=True).contiguous()
        if self.rank != 0:
            return None
        hf = self.adapter.to_hf(full)
        if self.model_config.enable_weight_tying:
            # to_hf drops the tied head (as HF files do); a transformers model's state_dict
            # (what generators load, and the torch backend publishes) names it too.
            hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
        return hf

    def _tensor_state(self) -> dict[str, torch.Tensor]:
        """Model and AdamW state as one flat dict of (DTensor) tensors: ``model.<fqn>``,
        ``optim.state.<fqn>.<exp_avg|exp_avg_sq|step>`` and ``rng``. The optimizer's
        hyper-parameters are not tensors; they come from the config, the learning rate from
        the schedule state in ``state.json``."""
        msd, osd = get_state_dict(self.model, self.opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        # A tied head is the embedding's tensor under a second name: stored once (safetensors
        # refuses two names for one tensor), re-aliased on load. The optimizer state names it once.
        state = {f"model.{k}": v for k, v in msd.items() if k not in self.aliases}
        state.update({f"optim.{k}": v for k, v in osd.items() if isinstance(v, torch.Tensor)})
        state["rng"] = torch.get_rng_state()
        return state

    def _save(self, directory: Path) -> None:
        # Every rank writes its own rows as safetensors (pipeline.engines.sharded_ckpt).
        save_sharded(directory / SHARDS_DIR, self._tensor_state(), rank=self.rank, world=self.world)
        torch.distributed.barrier()

    def _load(self, directory: Path, sched: dict, lrs: list[float] | None = None) -> None:
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        # The hyper-parameter entries (param_groups.<fqn>.lr, betas, ...) as they are now.
        hyper = {k: v for k, v in get_state_dict(self.model, self.opt, options=flat)[1].items()
                 if not isinstance(v, torch.Tensor)}
        state = self._tensor_state()
        # Reads the rows this rank needs, whatever the writers' rank count.
        load_sharded(directory / SHARDS_DIR, state, rank=self.rank, world=self.world)
        msd = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
        msd.update({alias: msd[source] for alias, source in self.aliases.items()})
        osd = {k[len("optim."):]: v for k, v in state.items() if k.startswith("optim.")}
        osd.update(hyper)
        set_state_dict(self.model, self.opt, model_state_dict=msd, optim_state_dict=osd, options=flat)
        torch.set_rng_state(state["rng"])
        self.sched.load_state_dict(sched)
        if lrs is not None:
            for group, lr in zip(self.opt.param_groups, lrs):
                group["lr"] = lr
        self._gathered = None
        self._local_fresh = False

    # ---------------------------------------------------------------- TrainEngine (rank 0)

    def _driver(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"{what}() is driven by rank 0; rank {self.rank} runs follow()")
        if self._closed:
            raise RuntimeError(f"{what}() on a closed engine")

    def train_step(self, groups: list[ScoredGroup]) -> dict:
        self._driver("train_step")
        self._announce(OP_TRAIN, msgpack.packb([g.encode() for g in groups]))
        stats = self._train(groups)
        self._busy = False
        return stats

    def lr_step(self) -> None:
        self._driver("lr_step")
        self._announce(OP_LR_STEP)
        self.sched.step()
        self._busy = False

    def weights(self) -> dict[str, torch.Tensor]:
        """HF-named full tensors; gathered once per version (the followers join only then)."""
        self._driver("weights")
        if self._gathered is None:
            self._announce(OP_WEIGHTS)
            self._gathered = self._gather()
            self._busy = False
        return self._gathered

    def _local_model(self):
        """A plain ``transformers`` copy of the current weights on rank 0, for decoding and export."""
        weights = self.weights()
        if self._local is None:
            self._local = load_checkpoint(self.base_dir)[0].eval()
        if not self._local_fresh:
            load_state_tensors(self._local, weights)
            self._local_fresh = True
        return self._local

    def greedy(self, prompts: list[np.ndarray], *, max_new_tokens: int) -> list[str]:
        self._driver("greedy")
        return greedy_decode(self._local_model(), self.tokenizer, prompts, max_new_tokens=max_new_tokens)

    def play(self, prompts: list[np.ndarray], references: list[str], factory, *, max_turns: int,
             max_new_tokens: int, texts: list[str] | None = None, chat=None, max_turn_tokens: int = 0) -> list:
        self._driver("greedy")
        return play(self._local_model(), self.tokenizer, prompts, references, factory, max_turns=max_turns,
                    max_new_tokens=max_new_tokens, texts=texts, chat=chat, max_turn_tokens=max_turn_tokens)

    def save_state(self, directory: Path) -> dict:
        self._driver("save_state")
        directory = Path(directory).resolve()
        self._announce(OP_SAVE, msgpack.packb({"dir": str(directory)}))
        self._save(directory)
        self._busy = False
        return {"format": "sharded-safetensors", "dir": SHARDS_DIR, "world_size": self.world, "sched": self.sched.state_dict(),
                "lrs": [g["lr"] for g in self.opt.param_groups]}

    def load_state(self, directory: Path, extras: dict) -> None:
        self._driver("load_state")
        if extras.get("format") != "sharded-safetensors":
            raise ValueError(f"{directory}: not a torchtitan (sharded safetensors) checkpoint (format "
                             f"{extras.get('format')!r}); a checkpoint resumes only under the trainer.backend that wrote it")
        directory = Path(directory).resolve()
        self._announce(OP_LOAD, msgpack.packb({"dir": str(directory), "sched": extras["sched"], "lrs": extras["lrs"]}))
        self._load(directory, extras["sched"], extras["lrs"])
        self._busy = False

    def export_hf(self, directory: Path) -> None:
        self._driver("export_hf")
        save_checkpoint(self._local_model(), self.tokenizer, directory, tokenizer_dir=self.base_dir)

    def close(self) -> None:
        """Rank 0: release the followers (STOP); every rank: leave the process group if this engine made it.

        After a driver failure inside an operation no STOP is sent (the followers are
        inside that operation's collectives); the driver's exit makes torchrun stop them.
        """
        if self._closed:
            return
        self._closed = True
        if self.rank == 0 and not self._busy:
            self._announce(OP_STOP)
            # Every rank holds the STOP before any leaves the group: a rank tearing gloo down
            # while a peer still relays the broadcast aborts that peer.
            dist.barrier()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()


def follow(cfg: RunConfig) -> None:
    """A follower rank's whole life: build this rank's part of the engine, serve rank 0 until STOP.

    Followers ignore SIGINT and SIGTERM (torchrun and terminals deliver them to every
    rank): rank 0 finishes its step, checkpoints, and then sends STOP.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine = TitanEngine(cfg)
    try:
        engine.serve()
        dist.barrier()  # rank 0's close() meets it after the STOP
    finally:
        engine._closed = True
        if engine._owns_group and dist.is_initialized():
            dist.destroy_process_group()
