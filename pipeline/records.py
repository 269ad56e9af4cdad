"""The records that travel between stages: one frozen type per transition.

    PromptTask   feeder    -> generators   ({ns}:prompts)
    RolloutGroup generator -> verifiers    ({ns}:rollouts)
    ScoredGroup  verifier  -> trainer      ({ns}:scored)

On the wire each record is a MessagePack map with ``schema`` (version) and ``type``.
Arrays travel as little-endian byte blobs (``<i4`` token ids, ``<f4`` floats), which is
far faster and smaller than lists of numbers. Decoding never executes code (no pickle),
checks the schema version, the type, every field's type and the sizes, and turns any
defect into ``RecordError`` with a reason the consumer writes to the dead-letter stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
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


def _i4(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<i4").tobytes()


def _f4(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


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


def _pack(kind: str, body: dict) -> bytes:
    return msgpack.packb({"schema": SCHEMA_VERSION, "type": kind, **body}, use_bin_type=True)


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
                   version_runs=_runs(d, "version_runs", ids.size, min_v, max_v))

    @classmethod
    def decode(cls, data: bytes) -> "RolloutGroup":
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


