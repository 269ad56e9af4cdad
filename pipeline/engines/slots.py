"""Continuous batching for the torch generator: a fixed number of sequence slots, one KV cache.

:class:`SlotSampler` decodes every sequence in flight together, one token per
:meth:`~SlotSampler.step`. A prompt's ``n`` completions take ``n`` free slots (the prompt's
forward runs once and its keys and values are copied to the others); a completion leaves
its slot the moment it samples eos or reaches its token budget, and the last occupied slot
moves into the hole, so the slots in flight are always ``[0, active)`` and every tensor the
step touches is a view. A group is handed back (:class:`Finished`) as soon as its last
completion is done.

The forward is the model's own layers (embeddings, norms, projections, rotary embedding,
MLP) with attention over the slot cache: rows sit at different positions, so each row
attends to its own prefix under a length mask. The weights are the model's parameters, so
replacing them in place (``load_state_tensors``) takes effect at the next step: that is
the in-flight weight update. Each sampled token records the policy version whose forward
produced its logits. :meth:`SlotSampler.recompute` re-runs every prefix in flight under
the current weights (``generator.kv_on_swap = "recompute"``); :meth:`SlotSampler.refresh`
recomputes only the next-token logits (``keep``), so in both cases the first token sampled
after a swap comes from the new weights.

The sampler works for the decoder-only families ``transformers`` implements as
``Qwen3ForCausalLM`` and ``LlamaForCausalLM`` (the embedded default and the imported
chat models); its log-probabilities agree with the trainer's re-scoring
(``tests/test_continuous.py``).
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.model.qwen import draw, uniforms
from pipeline.records import Partial


def row_generator(seed: int, member: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator completion ``member`` of a prompt draws its tokens from, given the
    prompt's sampling seed (``pipeline.producers.generator.sampling_seed``): the same seed and
    member give the same draws on any worker, in any batch."""
    digest = hashlib.blake2b(f"{seed}:{member}".encode(), digest_size=8).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(digest, "little") >> 1)


@dataclass
class _Row:
    """One completion: its prompt's group, its tokens so far and where it sits."""

    key: object
    member: int
    prompt: np.ndarray
    budget: int
    """Most tokens this completion may have (``max_new_tokens``)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    """1 on sampled tokens, 0 on observation tokens an environment appended."""
    done: bool = False
    episodic: bool = False
    """Its eos ends a turn (the environment answers), not the completion."""
    turns: int = 0
    turn_start: int = 0
    """Index in ``tokens`` where the current model turn began."""
    waiting: bool = False
    """Its turn ended; out of the slots until :meth:`SlotSampler.observe`."""
    cut: bool = False
    """Its current turn ended at the per-turn token limit, not at an eos (``observe`` closes it
    with an eos before the observation)."""
    turns_cut: int = 0
    """Its turns that ended at the per-turn token limit."""
    slot: int = -1
    length: int = 0
    u: list[float] | None = None
    """A group added with a ``seed``: the uniforms of its own generator (:func:`row_generator`),
    one per token it may sample, the k-th sampled token drawn at the k-th; else None (the
    sampler's generator)."""
    drawn: int = 0
    """Tokens it has sampled (observation tokens not counted)."""
    """Positions in the slot's cache (prompt plus the tokens fed so far)."""
    logit_version: int = 0
    """Policy version of the forward that produced this row's next-token logits."""


@dataclass
class Finished:
    """A group whose ``n`` completions are all done."""

    key: object
    tokens: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    masks: list[list[int]] | None = None
    """Episodes: 1 on sampled tokens, 0 on observation tokens (None: every token sampled)."""
    turns: list[int] | None = None
    """Episodes: model turns per completion."""
    last_turns: list[list[int]] | None = None
    """Episodes: the tokens of each completion's last model turn (its final answer)."""
    turns_cut: list[int] | None = None
    """Episodes: each completion's turns that ended at the per-turn token limit (``env.max_turn_tokens``)."""


class SlotSampler:
    """``slots`` sequences decoded together over a slot KV cache (see the module docstring)."""

    def __init__(self, model, *, slots: int, temperature: float, eos_id: int, pad_id: int,
                 generator: torch.Generator | None = None) -> None:
        cfg = model.config
        self.model, self.slots = model, slots
        self.temperature, self.eos_id, self.pad_id, self.rng = temperature, eos_id, pad_id, generator
        self.n_layers = cfg.num_hidden_layers
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.context = cfg.max_position_embeddings
        self._rope = sys.modules[type(model).__module__].apply_rotary_pos_emb
        weight = model.model.embed_tokens.weight
        self.device, self._dtype = weight.device, weight.dtype
        """Where the cache and every tensor of a step live: the model's device, and its dtype for the cache."""
        self._capacity = 0
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._logits = torch.zeros((slots, cfg.vocab_size), device=self.device)
        self._order: list[_Row] = []
        """Rows in flight, by slot: ``_order[s].slot == s``."""
        self._groups: dict[object, list[_Row]] = {}
        self._waiting = 0
        self._ready: list[_Row] = []
        self._turns: list[tuple[object, int, list[int]]] = []
        self._max_turns: dict[object, int] = {}
        self._turn_tokens: dict[object, int] = {}

    # ------------------------------------------------------------------ occupancy

    @property
    def active(self) -> int:
        """Slots in flight."""
        return len(self._order)

    @property
    def free(self) -> int:
        """Slots neither in flight nor promised to a completion whose observation came back."""
        return self.slots - len(self._order) - len(self._ready)

    @property
    def rows(self) -> int:
        """Completions not finished: in flight, waiting on their environment, or ready to go on."""
        return len(self._order) + self._waiting + len(self._ready)

    def _place(self) -> None:
        """Completions whose observation came back take the free slots, oldest first."""
        while self._ready and len(self._order) < self.slots:
            r = self._ready.pop(0)
            r.slot = len(self._order)
            self._order.append(r)
            self._refill(r)

    @property
    def groups(self) -> list[object]:
        """Keys of the groups not yet finished."""
        return list(self._groups)

    def _grow(self, positions: int) -> None:
        """Room for ``positions`` positions in every slot (doubling, up to the model's context)."""
        if positions <= self._capacity:
            return
        if positions > self.context:
            raise ValueError(f"{positions} positions exceed the model's context of {self.context}")
        cap = min(self.context, max(positions, 2 * self._capacity, 64))
        shape = (self.slots, self.n_kv, cap, self.head_dim)
        k, v = [], []
        for layer in range(self.n_layers):
            nk = torch.zeros(shape, dtype=self._dtype, device=self.device)
            nv = torch.zeros(shape, dtype=self._dtype, device=self.device)
            if self._capacity:
                nk[:, :, : self._capacity] = self._k[layer]
                nv[:, :, : self._capacity] = self._v[layer]
            k.append(nk)
            v.append(nv)
        self._k, self._v, self._capacity = k, v, cap

    # ------------------------------------------------------------------ the forward

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, write, attend) -> torch.Tensor:
        """The decoder over hidden states ``h [B, L, H]`` at ``positions [B, L]``; ``write(layer,
        k, v)`` stores the new keys/values, ``attend(layer, q)`` returns attention outputs."""
        inner = self.model.model
        cos, sin = inner.rotary_emb(h, positions)
        b, n = h.shape[:2]
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(b, n, self.n_heads, self.head_dim)
            k = attn.k_proj(x).view(b, n, self.n_kv, self.head_dim)
            v = attn.v_proj(x).view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            write(i, k, v)
            o = attend(i, q, k, v, attn.scaling)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(inner.norm(h[:, -1:])).float()[:, 0]

    @torch.no_grad()
    def _prefill(self, ids: np.ndarray, slots: list[int]) -> torch.Tensor:
        """Run ``ids`` (one sequence) forward, store its keys/values in every slot of ``slots``;
        returns the next-token logits."""
        n = int(ids.size)
        self._grow(n + 1)
        x = torch.from_numpy(ids.astype(np.int64)).unsqueeze(0).to(self.device)
        h = self.model.model.embed_tokens(x)
        index = torch.tensor(slots, device=self.device)

        def write(i, k, v):
            self._k[i][index, :, :n] = k[0]
            self._v[i][index, :, :n] = v[0]

        def attend(i, q, k, v, scale):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

        return self._layers(h, torch.arange(n, device=self.device).unsqueeze(0), write, attend)[0]

    @torch.no_grad()
    def _decode(self, tokens: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one token to every slot in flight (``tokens [active]``, at ``pos``: default each
        row's next position); returns their next logits."""
        a = len(self._order)
        if pos is None:
            pos = torch.tensor([r.length for r in self._order])
        width = int(pos.max()) + 1
        self._grow(width)
        tokens, pos = tokens.to(self.device), pos.to(self.device)
        h = self.model.model.embed_tokens(tokens.unsqueeze(1))
        rows = torch.arange(a, device=self.device)
        mask = (torch.arange(width, device=self.device).unsqueeze(0) <= pos.unsqueeze(1))[:, None, None, :]

        def write(i, k, v):
            self._k[i][rows, :, pos] = k[:, :, 0]
            self._v[i][rows, :, pos] = v[:, :, 0]

        def attend(i, q, k, v, scale):
            return F.scaled_dot_product_attention(q, self._k[i][:a, :, :width], self._v[i][:a, :, :width],
                                                  attn_mask=mask, scale=scale, enable_gqa=True)

        return self._layers(h, pos.unsqueeze(1), write, attend)

    # ------------------------------------------------------------------ groups in and out

    def add(self, key, prompt: np.ndarray, *, n: int, max_new_tokens: int, version: int,
            partial: Partial | None = None, observations: list[list[int]] | None = None,
            seed: int | None = None) -> Finished | None:
        """Put ``n`` completions of ``prompt`` in flight (``partial``: continue them from their
        saved tokens); returns the group at once if every completion of it was already done.

        ``seed``: the prompt's sampling seed; each completion then draws from its own generator
        (:func:`row_generator`), so its tokens do not depend on the other sequences in flight.
        None: every completion draws from the sampler's generator.

        ``observations`` makes the completions episodes: each one's first observation (token
        ids, possibly none) is appended after the prompt, and an eos ends a model turn
        (:meth:`turn_ended`, then :meth:`observe`) instead of the completion."""
        if key in self._groups:
            raise ValueError(f"group {key!r} is already in flight")
        rows = [_Row(key=key, member=j, prompt=prompt, budget=max_new_tokens) for j in range(n)]
        if seed is not None:
            drawn = uniforms([row_generator(seed, j, self.device) for j in range(n)], max_new_tokens, self.device)
            for r, u in zip(rows, drawn.tolist()):
                r.u = u
        if observations is not None:
            if partial is not None or len(observations) != n:
                raise ValueError(f"an episode group needs {n} first observations and no partial")
            for r, obs in zip(rows, observations):
                r.episodic = True
                self._append_observation(r, obs[: max_new_tokens - 1], version)
        if partial is not None:
            if partial.lens.size != n:
                raise ValueError(f"partial has {partial.lens.size} completions, the group {n}")
            for row, (tokens, logprobs, versions, done) in zip(rows, partial.completions()):
                row.tokens, row.logprobs, row.versions, row.mask = tokens, logprobs, versions, [1] * len(tokens)
                row.drawn = len(tokens)
                row.done = done or len(tokens) >= max_new_tokens
        live = [r for r in rows if not r.done]
        if len(live) > self.free:
            raise ValueError(f"{len(live)} completions for {self.free} free slots")
        self._groups[key] = rows
        if not live:
            return self._finish(key)
        fresh = [r for r in live if not r.tokens]
        for r in live:
            r.slot = len(self._order)
            self._order.append(r)
            r.logit_version = version
        if fresh:  # one prompt forward, fanned out
            logits = self._prefill(prompt, [r.slot for r in fresh])
            for r in fresh:
                r.length = int(prompt.size)
                self._logits[r.slot] = logits
        for r in live:
            if r.tokens:
                self._refill(r)
        return None

    def _refill(self, r: _Row) -> None:
        seq = np.concatenate([r.prompt.astype(np.int64), np.asarray(r.tokens, dtype=np.int64)])
        self._logits[r.slot] = self._prefill(seq, [r.slot])
        r.length = int(seq.size)

    @torch.no_grad()
    def refresh(self, version: int) -> None:
        """After a swap: the next-token logits of every row in flight under the current weights,
        by feeding each row's last token again at its own position (one decode step; the keys
        and values of the earlier positions stay those of the weights that computed them)."""
        if not self._order:
            return
        last = torch.tensor([int(r.tokens[-1]) if r.tokens else int(r.prompt[-1]) for r in self._order])
        pos = torch.tensor([r.length - 1 for r in self._order])
        self._logits[: len(self._order)] = self._decode(last, pos)
        for r in self._order:
            r.logit_version = version

    def recompute(self, version: int) -> None:
        """Re-run every prefix in flight under the current weights (their next logits included)."""
        for r in self._order:
            if r.tokens:
                self._refill(r)
            else:
                self._logits[r.slot] = self._prefill(r.prompt, [r.slot])
            r.logit_version = version

    def _finish(self, key) -> Finished:
        rows = self._groups.pop(key)
        self._max_turns.pop(key, None)
        self._turn_tokens.pop(key, None)
        episodic = any(r.episodic for r in rows)
        return Finished(key=key, tokens=[r.tokens for r in rows], logprobs=[r.logprobs for r in rows],
                        versions=[r.versions for r in rows],
                        masks=[r.mask for r in rows] if episodic else None,
                        turns=[r.turns for r in rows] if episodic else None,
                        last_turns=[r.tokens[r.turn_start:] for r in rows] if episodic else None,
                        turns_cut=[r.turns_cut for r in rows] if episodic else None)

    def _append_observation(self, r: _Row, obs: list[int], version: int) -> None:
        version = r.versions[-1] if r.versions else version
        r.tokens += obs
        r.logprobs += [0.0] * len(obs)
        r.versions += [version] * len(obs)
        r.mask += [0] * len(obs)
        r.turn_start = len(r.tokens)

    def turn_ended(self) -> list[tuple[object, int, list[int]]]:
        """The (group key, completion index, action token ids) of every model turn that ended
        since the last call; each waits for :meth:`observe`."""
        out, self._turns = self._turns, []
        return out

    def observe(self, key, member: int, observation: list[int], *, done: bool, version: int) -> Finished | None:
        """The environment's answer to a completion's turn: ``done`` (or no room left for a
        turn after ``observation``, or ``env.max_turns`` reached) ends it; otherwise the
        observation's ids are appended and the completion takes a slot again (the first free
        one: a waiting completion holds none, so more episodes than slots can be in flight
        and their environments' latency overlaps decoding). A turn cut at the per-turn token
        limit is closed first with an eos the model did not sample (masked like the
        observation), so the transcript reads as turns. Returns its group if that was the
        group's last completion."""
        r = self._groups[key][member]
        if not r.waiting:
            raise ValueError(f"completion {member} of group {key!r} is not waiting for an observation")
        r.waiting = False
        self._waiting -= 1
        if r.cut:
            observation, r.cut = [self.eos_id, *observation], False
        if done or r.turns >= self._max_turns.get(key, 1 << 30) or len(r.tokens) + len(observation) >= r.budget:
            r.done = True
        else:
            self._append_observation(r, observation, version)
            r.logit_version = version
            self._ready.append(r)
            self._place()
        if all(x.done for x in self._groups[key]):
            return self._finish(key)
        return None

    def _vacate(self, r: _Row) -> None:
        """Free ``r``'s slot: the last slot in flight moves into it."""
        last = self._order.pop()
        if last is not r:
            s, t = r.slot, last.slot
            for i in range(self.n_layers):
                self._k[i][s, :, : last.length] = self._k[i][t, :, : last.length]
                self._v[i][s, :, : last.length] = self._v[i][t, :, : last.length]
            self._logits[s] = self._logits[t]
            last.slot = s
            self._order[s] = last
        r.slot = -1

    @torch.no_grad()
    def step(self, version: int) -> list[Finished]:
        """Sample one token in every slot in flight, then feed the continuing ones forward
        under the current weights (``version``); returns the groups that finished."""
        self._place()
        a = len(self._order)
        if a == 0:
            return []
        logits = self._logits[:a]
        if self.temperature == 0:
            logp = F.log_softmax(logits, dim=-1)
            nxt = logp.argmax(dim=-1)
        else:
            logp = F.log_softmax(logits / self.temperature, dim=-1)
            if all(r.u is not None for r in self._order):
                u = torch.tensor([r.u[min(r.drawn, len(r.u) - 1)] for r in self._order], device=self.device)
                nxt = draw(logp.exp(), u=u)
            else:
                nxt = draw(logp.exp(), self.rng)
        lp = logp.gather(1, nxt.unsqueeze(1)).squeeze(1).tolist()
        ids = nxt.tolist()
        ended: list[_Row] = []
        for r, tok, l in zip(list(self._order), ids, lp):
            r.drawn += 1
            r.tokens.append(tok)
            r.logprobs.append(l)
            r.versions.append(r.logit_version)
            r.mask.append(1)
            limit = self._turn_tokens.get(r.key, 0) if r.episodic else 0
            cut = limit > 0 and tok != self.eos_id and len(r.tokens) - r.turn_start >= limit
            if r.episodic and (tok == self.eos_id or cut) and len(r.tokens) < r.budget:
                r.turns += 1
                r.waiting = True
                r.cut = cut
                r.turns_cut += cut
                self._waiting += 1
                self._turns.append((r.key, r.member, r.tokens[r.turn_start:] if cut else r.tokens[r.turn_start:-1]))
                ended.append(r)
            elif tok == self.eos_id or len(r.tokens) >= r.budget:
                r.done = True
                if r.episodic:
                    r.turns += 1
                ended.append(r)
        fed = {id(r): tok for r, tok in zip(self._order, ids) if not (r.done or r.waiting)}
        # Vacate from the highest slot down, so a row moved into a hole never ends this step.
        for r in sorted(ended, key=lambda r: -r.slot):
            self._vacate(r)
        if self._order:
            tokens = torch.tensor([fed[id(r)] for r in self._order])
            self._logits[: len(self._order)] = self._decode(tokens)
            for r in self._order:
                r.length += 1
                r.logit_version = version
        out = []
        for key in dict.fromkeys(r.key for r in ended if r.done):
            if all(x.done for x in self._groups[key]):
                out.append(self._finish(key))
        return out

    def unfinished(self) -> list[tuple[object, Partial]]:
        """Every group in flight as a :class:`Partial` (tokens, log-probs, versions so far)."""
        return [(key, Partial.of([r.tokens for r in rows], [r.logprobs for r in rows], [r.versions for r in rows],
                                 [r.done for r in rows])) for key, rows in self._groups.items()]

    def set_max_turns(self, key, turns: int, turn_tokens: int = 0) -> None:
        """An episode group's limit of model turns per completion, and of tokens per model turn
        (``turn_tokens``; 0: none but the completion's budget). A turn that reaches
        ``turn_tokens`` without an eos ends there: its tokens so far are the action."""
        self._max_turns[key] = turns
        self._turn_tokens[key] = turn_tokens

    def clear(self) -> None:
        """Drop every group in flight."""
        self._order.clear()
        self._groups.clear()
        self._turns.clear()
        self._max_turns.clear()
        self._turn_tokens.clear()
        self._ready.clear()
        self._waiting = 0
