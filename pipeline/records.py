"""The records that travel between stages: one frozen type per transition.

    PromptTask   feeder    -> generators   ({ns}:prompts)
    RolloutGroup generator -> verifiers    ({ns}:rollouts)
    ScoredGroup  verifier  -> trainer      ({ns}:scored)

On the wire each record is a MessagePack map with ``schema`` (version) and ``type``.
Arrays travel as little-endian byte blobs (``<i4`` token ids, ``<f4`` floats), which is
far faster and smaller than lists of numbers. Decoding never executes code (no pickle),
checks the schema version, the type, every field's type and the sizes, and turns any
defect into ``RecordError`` with a reason the consumer writes to the dead-letter stream.

Decoding takes one of two paths. The fast one decodes the map into typed msgspec structs
(the field types checked in C, unknown fields refused) and checks sizes and values on the
blobs with as few array operations as it can; it accepts nothing the field-by-field path
would refuse and builds the same record. Whatever it does not accept (a defect, or a
record shaped other than the encoder writes it) goes through the field-by-field path,
which accepts it or names the defect in its ``RecordError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec
import numpy as np

SCHEMA_VERSION = 1
MAX_RECORD_BYTES = 16 * 1024 * 1024
"""Larger payloads are refused before decoding (a defence against oversize records)."""
MAX_GROUP_SIZE = 1024
MAX_TOKENS = 1 << 20


class RecordError(ValueError):
    """Bytes that are not a valid record; the message is the dead-letter reason."""


def check_token_ids(name: str, ids: np.ndarray, vocab_size: int) -> None:
    """Refuse token ids a model of ``vocab_size`` tokens cannot embed.

    Records do not know the vocabulary; each stage that feeds ids to a model calls this
    on what it decoded, so the defect is dead-lettered instead of crashing the model.
    """
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise RecordError(f"{name} token id outside the vocabulary [0, {vocab_size})")


MAX_ABS_REWARD = 1e4
"""Rewards beyond this magnitude are refused: no reward mode comes near it (verifier scores are in
[0, 1], environment rewards a game's score), and one such value would swamp a step's advantages."""


def check_versions(rollout: "RolloutGroup", *, newest: int) -> None:
    """Refuse a group claiming a policy version the run has not published (``newest``; version 0,
    the base model, always exists): a producer's bug or a forged record, which staleness
    arithmetic would otherwise turn into a negative lag."""
    if rollout.max_version > max(newest, 0):
        raise RecordError(f"policy version {rollout.max_version} is newer than the newest published, "
                          f"{max(newest, 0)}")


def check_group_size(rollout: "RolloutGroup", group_size: int | None) -> None:
    """Refuse a group of another size than the run's ``generator.group_size``."""
    if group_size is not None and rollout.group_size != group_size:
        raise RecordError(f"group of {rollout.group_size} completions, generator.group_size is {group_size}")


def check_scores(g: "ScoredGroup") -> None:
    """Refuse scores out of their ranges: votes in [0, 1] or NaN (abstained), the hidden truth in
    [0, 1] or NaN, rewards within ``MAX_ABS_REWARD`` (decoding already refused NaN and inf)."""
    votes = g.votes[~np.isnan(g.votes)]
    if votes.size and (float(votes.min()) < 0 or float(votes.max()) > 1):
        raise RecordError("votes outside [0, 1]")
    truth = g.truth[~np.isnan(g.truth)]
    if truth.size and (float(truth.min()) < 0 or float(truth.max()) > 1):
        raise RecordError("truth values outside [0, 1]")
    if g.rewards.size and float(np.abs(g.rewards).max()) > MAX_ABS_REWARD:
        raise RecordError(f"rewards beyond +-{MAX_ABS_REWARD:g}")


_I4, _F4 = np.dtype("<i4"), np.dtype("<f4")


def _i4(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=_I4).tobytes()


def _f4(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=_F4).tobytes()


def _blob(d: dict, name: str, dtype: str) -> np.ndarray:
    raw = d.get(name)
    if not isinstance(raw, bytes):
        raise RecordError(f"field {name!r}: expected bytes, got {type(raw).__name__}")
    if len(raw) % 4:
        raise RecordError(f"field {name!r}: {len(raw)} bytes is not a multiple of 4")
    # frombuffer is zero-copy and read-only, which suits frozen records.
    return np.frombuffer(raw, dtype=dtype)


def _get(d: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in d:
        raise RecordError(f"missing field {name!r}")
    v = d[name]
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise RecordError(f"field {name!r}: expected {getattr(kind, '__name__', kind)}, got {type(v).__name__}")
    return v


def _str_list(d: dict, name: str) -> tuple[str, ...]:
    v = _get(d, name, list)
    if not all(isinstance(x, str) for x in v):
        raise RecordError(f"field {name!r}: expected a list of strings")
    return tuple(v)


def _unpack(data: bytes, expected_type: str) -> dict:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordError(f"payload is {type(data).__name__}, not bytes")
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"record of {len(data)} bytes exceeds the {MAX_RECORD_BYTES}-byte limit")
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise RecordError(f"not MessagePack: {type(e).__name__}: {e}") from None
    if not isinstance(d, dict):
        raise RecordError(f"record is a {type(d).__name__}, not a map")
    schema = d.get("schema")
    if schema != SCHEMA_VERSION:
        raise RecordError(f"schema version {schema!r} is not supported (expected {SCHEMA_VERSION})")
    if d.get("type") != expected_type:
        raise RecordError(f"record type {d.get('type')!r}, expected {expected_type!r}")
    return d


def _runs(d: dict, name: str, n_tokens: int, lo: int, hi: int) -> np.ndarray | None:
    """An optional ``version_runs`` field: (start, version) int32 pairs over ``n_tokens`` tokens."""
    if d.get(name) is None:
        return None
    runs = _blob(d, name, "<i4")
    if runs.size % 2 or not 0 < runs.size <= 2 * max(n_tokens, 1):
        raise RecordError(f"field {name!r}: {runs.size} values are not (start, version) pairs for {n_tokens} tokens")
    starts, versions = runs[0::2], runs[1::2]
    if int(starts[0]) != 0 or (np.diff(starts) <= 0).any() or int(starts[-1]) >= max(n_tokens, 1):
        raise RecordError(f"field {name!r}: run starts must rise from 0 below {n_tokens}")
    if int(versions.min()) != lo or int(versions.max()) != hi:
        raise RecordError(f"field {name!r}: versions {int(versions.min())}..{int(versions.max())} "
                          f"do not span min/max version {lo}..{hi}")
    return runs


def _episode(d: dict, n_tokens: int, g: int) -> dict:
    """The optional episode fields of a RolloutGroup (all three or none), checked."""
    present = [k for k in ("loss_mask", "turns", "env_rewards") if d.get(k) is not None]
    if not present:
        return {}
    if len(present) != 3:
        raise RecordError(f"episode fields loss_mask, turns and env_rewards come together; got only {present}")
    raw = d["loss_mask"]
    if not isinstance(raw, bytes) or len(raw) != n_tokens:
        raise RecordError(f"field 'loss_mask': expected {n_tokens} bytes, one per completion token")
    mask = np.frombuffer(raw, dtype=np.uint8)
    if (mask > 1).any():
        raise RecordError("field 'loss_mask': values other than 0 and 1")
    turns, env = _blob(d, "turns", "<i4"), _blob(d, "env_rewards", "<f4")
    if turns.size != g or (turns < 0).any():
        raise RecordError(f"field 'turns': expected {g} non-negative counts")
    if env.size != g or np.isinf(env).any():
        raise RecordError(f"field 'env_rewards': expected {g} finite values or NaN")
    return {"loss_mask": mask, "turns": turns, "env_rewards": env, **_tool_calls(d, g)}


def _tool_calls(d: dict, g: int) -> dict:
    """The optional tool-call counts of an episode group (both or none), checked."""
    present = [k for k in ("tool_calls", "tool_calls_ok") if d.get(k) is not None]
    if not present:
        return {}
    if len(present) != 2:
        raise RecordError(f"fields tool_calls and tool_calls_ok come together; got only {present}")
    calls, ok = _blob(d, "tool_calls", "<i4"), _blob(d, "tool_calls_ok", "<i4")
    if calls.size != g or ok.size != g or (ok < 0).any() or (ok > calls).any():
        raise RecordError(f"fields tool_calls / tool_calls_ok: expected {g} counts each, 0 <= answered <= calls")
    return {"tool_calls": calls, "tool_calls_ok": ok}


def version_runs(per_token: np.ndarray) -> np.ndarray:
    """Per-token policy versions as (start, version) int32 pairs, one per run of equal versions."""
    per_token = np.asarray(per_token)
    if per_token.size == 0:
        raise ValueError("no tokens")
    starts = np.flatnonzero(np.r_[True, per_token[1:] != per_token[:-1]])
    return np.stack([starts, per_token[starts]], axis=1).astype(np.int32).reshape(-1)


def expand_runs(runs: np.ndarray, n_tokens: int) -> np.ndarray:
    """The per-token versions (int64 [n_tokens]) that :func:`version_runs` encoded."""
    starts, versions = runs[0::2].astype(np.int64), runs[1::2].astype(np.int64)
    return np.repeat(versions, np.diff(np.r_[starts, n_tokens]))


def _builtin(obj: Any) -> Any:
    """A subclass of a builtin scalar (a numpy float64) as that builtin, as ``msgpack.packb`` packs it."""
    for kind in (float, int, str, bytes):
        if isinstance(obj, kind):
            return kind(obj)
    raise TypeError(f"can not serialize {type(obj).__name__!r} object")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_builtin)
"""Writes the same bytes as ``msgpack.packb(..., use_bin_type=True)``, faster."""


def _pack(kind: str, body: dict) -> bytes:
    return _ENCODER.encode({"schema": SCHEMA_VERSION, "type": kind, **body})


@dataclass(frozen=True, kw_only=True, eq=False)
class PromptTask:
    """A prompt issued by the feeder."""

    prompt_id: str
    """Unique id of the prompt within the run; the key of end-to-end accounting."""
    prompt: str
    """Prompt text."""
    prompt_ids: np.ndarray
    """Token ids of the prompt, int32 [P]."""
    reference: str
    """Hidden reference answer: for evaluation and the ``ground_truth`` reward only, never shown to weak verifiers."""
    issued_at: float
    """Unix time the feeder issued it, seconds."""
    partial: Partial | None = None
    """Completions a stopped generator had begun (``generator.swap`` step/drain): the next
    generator continues them from their saved tokens instead of starting over."""

    def encode(self) -> bytes:
        body = {"prompt_id": self.prompt_id, "prompt": self.prompt, "prompt_ids": _i4(self.prompt_ids),
                "reference": self.reference, "issued_at": self.issued_at}
        if self.partial is not None:
            body["partial"] = self.partial._body()
        return _pack("PromptTask", body)

    @classmethod
    def decode(cls, data: bytes) -> "PromptTask":
        rec = _fast_prompt(cls, data)
        return rec if rec is not None else cls._decode_fields(data)

    @classmethod
    def _decode_fields(cls, data: bytes) -> "PromptTask":
        """The field-by-field path: every check in turn, the first defect named (module docstring)."""
        d = _unpack(data, "PromptTask")
        ids = _blob(d, "prompt_ids", "<i4")
        if not 0 < ids.size <= MAX_TOKENS:
            raise RecordError(f"prompt_ids has {ids.size} tokens")
        partial = d.get("partial")
        return cls(prompt_id=_get(d, "prompt_id", str), prompt=_get(d, "prompt", str), prompt_ids=ids,
                   reference=_get(d, "reference", str), issued_at=_get(d, "issued_at", float),
                   partial=None if partial is None else Partial._from_body(_get(d, "partial", dict)))


@dataclass(frozen=True, kw_only=True, eq=False)
class Partial:
    """The G completions of one prompt as far as a generator got: every row's tokens,
    behaviour log-probs and policy versions so far, and which rows are finished."""

    lens: np.ndarray
    """Tokens so far per completion, int32 [G] (0: not begun)."""
    ids: np.ndarray
    """Their token ids concatenated, int32 [sum(lens)]."""
    logprobs: np.ndarray
    """Behaviour log-prob of each, float32 [sum(lens)]."""
    versions: np.ndarray
    """Policy version of each, as (start, version) runs (:func:`version_runs`); empty when no token."""
    done: np.ndarray
    """bool [G]: the completion is finished (eos, or ``max_new_tokens`` reached)."""

    @classmethod
    def of(cls, tokens: list[list[int]], logprobs: list[list[float]], versions: list[list[int]],
           done: list[bool]) -> "Partial":
        """From per-completion lists of token ids, log-probs and versions so far."""
        vers = [v for row in versions for v in row]
        return cls(lens=np.array([len(t) for t in tokens], dtype=np.int32),
                   ids=np.array([t for row in tokens for t in row], dtype=np.int32),
                   logprobs=np.array([x for row in logprobs for x in row], dtype=np.float32),
                   versions=version_runs(np.array(vers)) if vers else np.zeros(0, dtype=np.int32),
                   done=np.array(done, dtype=bool))

    def completions(self) -> list[tuple[list[int], list[float], list[int], bool]]:
        """Per completion: (token ids, log-probs, versions, done), the inverse of :meth:`of`."""
        per_token = expand_runs(self.versions, self.ids.size) if self.ids.size else np.zeros(0, dtype=np.int64)
        starts = np.r_[0, np.cumsum(self.lens)]
        return [(self.ids[a:b].astype(np.int64).tolist(), self.logprobs[a:b].astype(np.float64).tolist(),
                 per_token[a:b].astype(np.int64).tolist(), bool(self.done[j]))
                for j, (a, b) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist()))]

    def _body(self) -> dict:
        return {"lens": _i4(self.lens), "ids": _i4(self.ids), "logprobs": _f4(self.logprobs),
                "versions": _i4(self.versions), "done": np.asarray(self.done, dtype=np.uint8).tobytes()}

    @classmethod
    def _from_body(cls, d: dict) -> "Partial":
        lens, ids, logprobs = _blob(d, "lens", "<i4"), _blob(d, "ids", "<i4"), _blob(d, "logprobs", "<f4")
        done = d.get("done")
        if not isinstance(done, bytes) or len(done) != lens.size:
            raise RecordError(f"partial: 'done' must be {lens.size} bytes")
        if not 0 < lens.size <= MAX_GROUP_SIZE or (lens < 0).any() or int(lens.sum()) != ids.size:
            raise RecordError(f"partial: completion lengths (sum {int(lens.sum())}) do not match {ids.size} tokens")
        done_rows = np.frombuffer(done, dtype=np.uint8).astype(bool)
        if (done_rows & (lens == 0)).any():
            raise RecordError("partial: a finished completion without tokens")
        if logprobs.size != ids.size or not np.isfinite(logprobs).all() or (logprobs > 1e-4).any():
            raise RecordError("partial: behaviour log-probs missing, NaN, inf or positive")
        if ids.size:
            versions = _blob(d, "versions", "<i4")
            if versions.size < 2:
                raise RecordError("partial: no policy versions for its tokens")
            lo, hi = int(versions[1::2].min()), int(versions[1::2].max())
            if lo < 0:
                raise RecordError("partial: negative policy version")
            versions = _runs(d, "versions", ids.size, lo, hi)
        else:
            versions = np.zeros(0, dtype=np.int32)
        return cls(lens=lens, ids=ids, logprobs=logprobs, versions=versions, done=done_rows)


@dataclass(frozen=True, kw_only=True, eq=False)
class RolloutGroup:
    """G sampled completions of one prompt, with the behaviour policy's log-probs."""

    prompt_id: str
    group_id: str
    """Unique per generation attempt (a prompt redone after a crash gets a new group id)."""
    generator_id: str
    prompt: str
    prompt_ids: np.ndarray
    """int32 [P]."""
    reference: str
    """Carried through for evaluation and ``ground_truth`` only (see PromptTask)."""
    completions: tuple[str, ...]
    """Decoded completion texts, G of them (end-of-sequence token removed)."""
    completion_ids: np.ndarray
    """All completions' token ids concatenated, int32 [sum(completion_lens)], each ending in eos unless truncated."""
    completion_lens: np.ndarray
    """Tokens per completion, int32 [G]."""
    behaviour_logprobs: np.ndarray
    """Log-prob of each completion token under the sampling policy, float32, aligned with completion_ids."""
    min_version: int
    """Oldest policy version that produced any token of this group."""
    max_version: int
    """Newest policy version that produced any token (equal to min_version when weights didn't change mid-group)."""
    created_at: float
    """Unix time the group was finished, seconds."""
    version_runs: np.ndarray | None = None
    """Policy version of every token, as (start, version) int32 pairs over the flat
    ``completion_ids`` (:func:`version_runs`); None: every token is ``min_version`` (weights
    swapped only between generation batches)."""
    loss_mask: np.ndarray | None = None
    """Episodes (``env.kind``): uint8 aligned with ``completion_ids``, 1 on the tokens the policy
    sampled, 0 on the observation tokens the environment appended (their behaviour log-prob
    is 0 and the loss never reads them). None: every token was sampled."""
    turns: np.ndarray | None = None
    """Episodes: model turns per completion, int32 [G]."""
    env_rewards: np.ndarray | None = None
    """Episodes: the environment's reward of each completion, float32 [G] (NaN: it gave none);
    a labelled signal (reward mode ``environment``), never shown to weak verifiers."""
    tool_calls: np.ndarray | None = None
    """Episodes: tool calls per completion (steps the environment marked ``Step.tool_call``),
    int32 [G]; None: not recorded (a record written before the field existed)."""
    tool_calls_ok: np.ndarray | None = None
    """Episodes: of those, the ones the environment answered (``Step.tool_ok`` not False), int32 [G]."""

    @property
    def group_size(self) -> int:
        return int(self.completion_lens.size)

    def token_versions(self) -> np.ndarray:
        """The policy version that sampled each token, int64 aligned with ``completion_ids``."""
        if self.version_runs is None:
            return np.full(self.completion_ids.size, self.min_version, dtype=np.int64)
        return expand_runs(self.version_runs, self.completion_ids.size)

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """Split a flat per-token array (ids or log-probs) into per-completion arrays."""
        return np.split(flat, np.cumsum(self.completion_lens)[:-1])

    def _body(self) -> dict:
        return {
            "prompt_id": self.prompt_id, "group_id": self.group_id, "generator_id": self.generator_id,
            "prompt": self.prompt, "prompt_ids": _i4(self.prompt_ids), "reference": self.reference,
            "completions": list(self.completions), "completion_ids": _i4(self.completion_ids),
            "completion_lens": _i4(self.completion_lens), "behaviour_logprobs": _f4(self.behaviour_logprobs),
            "min_version": self.min_version, "max_version": self.max_version, "created_at": self.created_at,
            **({} if self.version_runs is None else {"version_runs": _i4(self.version_runs)}),
            **({} if self.loss_mask is None else {
                "loss_mask": np.ascontiguousarray(self.loss_mask, dtype=np.uint8).tobytes(),
                "turns": _i4(self.turns), "env_rewards": _f4(self.env_rewards)}),
            **({} if self.loss_mask is None or self.tool_calls is None else {
                "tool_calls": _i4(self.tool_calls), "tool_calls_ok": _i4(self.tool_calls_ok)}),
        }

    def encode(self) -> bytes:
        return _pack("RolloutGroup", self._body())

    @classmethod
    def _from_body(cls, d: dict) -> "RolloutGroup":
        lens = _blob(d, "completion_lens", "<i4")
        ids = _blob(d, "completion_ids", "<i4")
        logprobs = _blob(d, "behaviour_logprobs", "<f4")
        completions = _str_list(d, "completions")
        prompt_ids = _blob(d, "prompt_ids", "<i4")
        if not 0 < lens.size <= MAX_GROUP_SIZE:
            raise RecordError(f"group size {lens.size} outside [1, {MAX_GROUP_SIZE}]")
        if (lens < 1).any() or int(lens.sum()) != ids.size or ids.size > MAX_TOKENS:
            raise RecordError(f"completion_lens (sum {int(lens.sum())}) do not match {ids.size} completion tokens")
        if logprobs.size != ids.size:
            raise RecordError(f"{logprobs.size} behaviour log-probs for {ids.size} tokens")
        if len(completions) != lens.size:
            raise RecordError(f"{len(completions)} completion texts for group size {lens.size}")
        if not 0 < prompt_ids.size <= MAX_TOKENS:
            raise RecordError(f"prompt_ids has {prompt_ids.size} tokens")
        if not np.isfinite(logprobs).all() or (logprobs > 1e-4).any():
            raise RecordError("behaviour_logprobs contain NaN, inf or positive values")
        min_v, max_v = _get(d, "min_version", int), _get(d, "max_version", int)
        if not 0 <= min_v <= max_v:
            raise RecordError(f"policy versions min={min_v} max={max_v} are inconsistent")
        return cls(prompt_id=_get(d, "prompt_id", str), group_id=_get(d, "group_id", str),
                   generator_id=_get(d, "generator_id", str), prompt=_get(d, "prompt", str),
                   prompt_ids=prompt_ids, reference=_get(d, "reference", str), completions=completions,
                   completion_ids=ids, completion_lens=lens, behaviour_logprobs=logprobs,
                   min_version=min_v, max_version=max_v, created_at=_get(d, "created_at", float),
                   version_runs=_runs(d, "version_runs", ids.size, min_v, max_v), **_episode(d, ids.size, lens.size))

    @classmethod
    def decode(cls, data: bytes) -> "RolloutGroup":
        rec = _fast_rollout_record(cls, data)
        return rec if rec is not None else cls._decode_fields(data)

    @classmethod
    def _decode_fields(cls, data: bytes) -> "RolloutGroup":
        """The field-by-field path: every check in turn, the first defect named (module docstring)."""
        return cls._from_body(_unpack(data, "RolloutGroup"))


@dataclass(frozen=True, kw_only=True, eq=False)
class ScoredGroup:
    """A rollout group with its verifier votes and rewards."""

    rollout: RolloutGroup
    verifier_names: tuple[str, ...]
    """Names of the m weak verifiers, in the column order of ``votes``."""
    votes: np.ndarray
    """Raw verifier scores in [0, 1], float32 [G, m]; NaN where a verifier abstained."""
    rewards: np.ndarray
    """Reward per completion, float32 [G], from ``reward_mode``."""
    truth: np.ndarray
    """Hidden correctness per completion, float32 [G]: logged beside the reward, never used by it (unless ground_truth)."""
    reward_mode: str
    labelmodel_version: int
    """Version of the label model in ``{ns}:labelmodel`` that produced the rewards (-1: none used)."""
    verifier_id: str
    scored_at: float

    def encode(self) -> bytes:
        return _pack("ScoredGroup", {
            "rollout": self.rollout._body(), "verifier_names": list(self.verifier_names),
            "votes": _f4(self.votes), "rewards": _f4(self.rewards), "truth": _f4(self.truth),
            "reward_mode": self.reward_mode, "labelmodel_version": self.labelmodel_version,
            "verifier_id": self.verifier_id, "scored_at": self.scored_at,
        })

    @classmethod
    def decode(cls, data: bytes) -> "ScoredGroup":
        rec = _fast_scored(cls, data)
        return rec if rec is not None else cls._decode_fields(data)

    @classmethod
    def _decode_fields(cls, data: bytes) -> "ScoredGroup":
        """The field-by-field path: every check in turn, the first defect named (module docstring)."""
        d = _unpack(data, "ScoredGroup")
        body = _get(d, "rollout", dict)
        rollout = RolloutGroup._from_body(body)
        g = rollout.group_size
        names = _str_list(d, "verifier_names")
        votes = _blob(d, "votes", "<f4")
        if votes.size != g * len(names):
            raise RecordError(f"{votes.size} votes for {g} completions x {len(names)} verifiers")
        rewards, truth = _blob(d, "rewards", "<f4"), _blob(d, "truth", "<f4")
        if rewards.size != g or truth.size != g:
            raise RecordError(f"{rewards.size} rewards / {truth.size} truth values for group size {g}")
        if not np.isfinite(rewards).all():
            raise RecordError("rewards contain NaN or inf")
        return cls(rollout=rollout, verifier_names=names, votes=votes.reshape(g, len(names)),
                   rewards=rewards, truth=truth, reward_mode=_get(d, "reward_mode", str),
                   labelmodel_version=_get(d, "labelmodel_version", int),
                   verifier_id=_get(d, "verifier_id", str), scored_at=_get(d, "scored_at", float))


# ---------------------------------------------------------------- the fast decoding path
#
# Each function returns the record, or None: then the field-by-field path decides (it
# accepts the record or names its defect). Every test here is one the field-by-field path
# makes, or a stricter one, so the fast path never accepts what the other refuses. The
# structs list each record's fields as its encoder writes them and refuse any other field:
# a field added to a record and not here sends the records carrying it down the
# field-by-field path (correct, only slower); the ``_make`` calls must list every field.


def _rollout_structs(blob: type, name: str) -> tuple[type, type]:
    """(body, wire) structs of a RolloutGroup as ``RolloutGroup._body`` writes it, with the token
    and log-prob blobs decoded as ``blob``: ``bytes`` (copies, cheapest for small records) or
    ``memoryview`` (views into the read bytes that the record's arrays share: nothing copied).
    Episodes (``loss_mask``, ``turns``, ``env_rewards``, ``tool_calls``, ``tool_calls_ok``) take
    the field-by-field path."""
    body = msgspec.defstruct(f"_RolloutBody{name}", [
        ("prompt_id", str), ("group_id", str), ("generator_id", str), ("prompt", str), ("prompt_ids", blob),
        ("reference", str), ("completions", tuple[str, ...]), ("completion_ids", blob), ("completion_lens", blob),
        ("behaviour_logprobs", blob), ("min_version", int), ("max_version", int), ("created_at", float),
        ("version_runs", bytes | None, None), ("loss_mask", None, None), ("turns", None, None),
        ("env_rewards", None, None), ("tool_calls", None, None), ("tool_calls_ok", None, None)],
        forbid_unknown_fields=True)
    wire = msgspec.defstruct(f"_RolloutWire{name}", [("schema", int), ("type", str)], bases=(body,), kw_only=True)
    return body, wire


_RolloutBody, _RolloutWire = _rollout_structs(bytes, "")
_RolloutBodyView, _RolloutWireView = _rollout_structs(memoryview, "View")

VIEW_BYTES = 8 << 10
"""Records from this size on decode their blobs as views (no copy); smaller ones as bytes."""


class _PromptWire(msgspec.Struct, forbid_unknown_fields=True):
    schema: int
    type: str
    prompt_id: str
    prompt: str
    prompt_ids: bytes
    reference: str
    issued_at: float
    partial: None = None
    """A task carrying a partial takes the field-by-field path."""


def _scored_struct(body: type, name: str) -> type:
    return msgspec.defstruct(f"_ScoredWire{name}", [
        ("schema", int), ("type", str), ("rollout", body), ("verifier_names", tuple[str, ...]), ("votes", bytes),
        ("rewards", bytes), ("truth", bytes), ("reward_mode", str), ("labelmodel_version", int),
        ("verifier_id", str), ("scored_at", float)], forbid_unknown_fields=True)


_PROMPT_WIRE = msgspec.msgpack.Decoder(_PromptWire)
_ROLLOUT_WIRE = (msgspec.msgpack.Decoder(_RolloutWire), msgspec.msgpack.Decoder(_RolloutWireView))
_SCORED_WIRE = (msgspec.msgpack.Decoder(_scored_struct(_RolloutBody, "")),
                msgspec.msgpack.Decoder(_scored_struct(_RolloutBodyView, "View")))
"""Each: (the decoder of records below ``VIEW_BYTES``, the one of records from it on)."""

_new, _setattr = object.__new__, object.__setattr__
_imax = np.maximum.reduce


def _make(cls: type, fields: dict) -> Any:
    """A frozen record from the dict of all its fields (what the dataclass ``__init__`` builds,
    without its one ``setattr`` per field)."""
    rec = _new(cls)
    _setattr(rec, "__dict__", fields)
    return rec


def _wire(decoder: msgspec.msgpack.Decoder, data: Any, kind: str) -> Any:
    """``data`` decoded into the typed struct of a ``kind`` record, or None."""
    if type(data) is not bytes or len(data) > MAX_RECORD_BYTES:
        return None
    try:
        w = decoder.decode(data)
    except Exception:  # msgspec's DecodeError and ValidationError, and anything else
        return None
    return w if w.schema == SCHEMA_VERSION and w.type == kind else None


# The float tests read the blobs' bytes first: the last byte of a little-endian float32 holds
# its sign and the top seven bits of its exponent, which settle most values at once.
_FINITE_TOP = bytes(b for b in range(256) if b & 0x7F != 0x7F)
"""Top bytes of float32s that are finite whatever their other bytes (exponent not all ones)."""
_NONPOSITIVE_TOP = bytes([0x00, *range(0x80, 0xFF)])
"""Top bytes of float32s that are finite and at most 1e-4 whatever their other bytes: 0x00
(below 2**-125) and 0x80-0xFE (negative, exponent not all ones)."""
_NEGATIVE_FINITE_I4 = -(1 << 23) - 1
"""-FLT_MAX read as an int32: the negative finite float32s are exactly the int32s at or below it."""
_BYTE_TEST_MAX = 1024
"""Blobs up to this many bytes are tested byte-wise; longer ones with one numpy reduction."""


def _finite(raw: bytes, a: np.ndarray) -> bool:
    """No NaN or infinity in the float32 blob ``raw`` (``a`` its array)."""
    return not raw[3::4].translate(None, _FINITE_TOP) or bool(np.isfinite(a).all())


def _logprobs_ok(raw: bytes | memoryview, a: np.ndarray) -> bool:
    """Every value of the float32 blob ``raw`` (``a`` its array) finite and at most 1e-4."""
    if len(raw) <= _BYTE_TEST_MAX:
        top = raw[3::4]
        if not (top if type(top) is bytes else top.tobytes()).translate(None, _NONPOSITIVE_TOP):
            return True
    elif int(_imax(np.frombuffer(raw, _I4))) <= _NEGATIVE_FINITE_I4:
        return True  # all negative and finite
    return bool(np.isfinite(a).all()) and not bool((a > 1e-4).any())


def _fast_prompt(cls: type, data: Any) -> PromptTask | None:
    w = _wire(_PROMPT_WIRE, data, "PromptTask")
    if w is None or len(w.prompt_ids) & 3 or not 0 < len(w.prompt_ids) >> 2 <= MAX_TOKENS:
        return None
    return _make(cls, {"prompt_id": w.prompt_id, "prompt": w.prompt, "prompt_ids": np.frombuffer(w.prompt_ids, _I4),
                       "reference": w.reference, "issued_at": w.issued_at, "partial": None})


def _fast_rollout(cls: type, w: _RolloutBody) -> RolloutGroup | None:
    lens_b, ids_b, lp_b, prompt_b = w.completion_lens, w.completion_ids, w.behaviour_logprobs, w.prompt_ids
    if (len(lens_b) | len(ids_b) | len(lp_b) | len(prompt_b)) & 3:
        return None
    g, n = len(lens_b) >> 2, len(ids_b) >> 2
    min_v, max_v = w.min_version, w.max_version
    if not (0 < g <= MAX_GROUP_SIZE and n <= MAX_TOKENS and len(lp_b) == len(ids_b) and len(w.completions) == g
            and 0 < len(prompt_b) >> 2 <= MAX_TOKENS and 0 <= min_v <= max_v):
        return None
    lens = np.frombuffer(lens_b, _I4)
    per = lens.tolist()
    if min(per) < 1 or sum(per) != n:
        return None
    logprobs = np.frombuffer(lp_b, _F4)
    if not _logprobs_ok(lp_b, logprobs):
        return None
    runs = None
    if w.version_runs is not None:
        try:
            runs = _runs({"version_runs": w.version_runs}, "version_runs", n, min_v, max_v)
        except RecordError:
            return None
    return _make(cls, {
        "prompt_id": w.prompt_id, "group_id": w.group_id, "generator_id": w.generator_id, "prompt": w.prompt,
        "prompt_ids": np.frombuffer(prompt_b, _I4), "reference": w.reference, "completions": w.completions,
        "completion_ids": np.frombuffer(ids_b, _I4), "completion_lens": lens, "behaviour_logprobs": logprobs,
        "min_version": min_v, "max_version": max_v, "created_at": w.created_at, "version_runs": runs,
        "loss_mask": None, "turns": None, "env_rewards": None, "tool_calls": None, "tool_calls_ok": None})


def _fast_rollout_record(cls: type, data: Any) -> RolloutGroup | None:
    w = _wire(_ROLLOUT_WIRE[type(data) is bytes and len(data) >= VIEW_BYTES], data, "RolloutGroup")
    return None if w is None else _fast_rollout(cls, w)


def _fast_scored(cls: type, data: Any) -> ScoredGroup | None:
    w = _wire(_SCORED_WIRE[type(data) is bytes and len(data) >= VIEW_BYTES], data, "ScoredGroup")
    if w is None or (rollout := _fast_rollout(RolloutGroup, w.rollout)) is None:
        return None
    g, m = rollout.group_size, len(w.verifier_names)
    votes_b, rewards_b, truth_b = w.votes, w.rewards, w.truth
    if (len(votes_b) | len(rewards_b) | len(truth_b)) & 3 or len(votes_b) >> 2 != g * m \
            or len(rewards_b) >> 2 != g or len(truth_b) >> 2 != g:
        return None
    rewards = np.frombuffer(rewards_b, _F4)
    if not _finite(rewards_b, rewards):
        return None
    return _make(cls, {"rollout": rollout, "verifier_names": w.verifier_names,
                       "votes": np.frombuffer(votes_b, _F4).reshape(g, m), "rewards": rewards,
                       "truth": np.frombuffer(truth_b, _F4), "reward_mode": w.reward_mode,
                       "labelmodel_version": w.labelmodel_version, "verifier_id": w.verifier_id,
                       "scored_at": w.scored_at})


RECORD_TYPES = {"PromptTask": PromptTask, "RolloutGroup": RolloutGroup, "ScoredGroup": ScoredGroup}


def describe(data: bytes) -> str:
    """A short human description of raw bytes for dead-letter inspection (never raises)."""
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if isinstance(d, dict):
            return f"{d.get('type')} schema={d.get('schema')} prompt_id={d.get('prompt_id')}"
        return f"msgpack {type(d).__name__}"
    except Exception:
        return f"{len(data)} undecodable bytes"


