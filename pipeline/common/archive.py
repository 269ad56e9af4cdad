"""The rollout archive: every group the trainer trained on, in training order, as Parquet.

``<run_dir>/archive/`` holds one segment a step, ``step-<version>.parquet``, written by the
trainer before the checkpoint that holds the step (so a checkpointed step is always in the
archive), one row per completion (``SCHEMA``; docs/reproducibility.md shows it and reads it
with pandas and DuckDB). Each segment's Parquet metadata (key ``pipeline.archive``) carries
the step: the version it made, the version it started from (``parent``), whether an
optimizer update was made, and the weights' hash after it. Beside the segments:

    _base.json        the base's weights hash, written at a fresh start (step 0)
    _resumes.jsonl    one line per trainer resume: the checkpoint's version and the version
                      the resumed trainer continued as (versions lost in a crash are skipped)
    _abandoned/       segments of steps no checkpoint held when the trainer died: their
                      model died with it, the resumed trainer retrains their groups

Names starting with ``_`` are skipped by Parquet readers that take the directory
(``pyarrow.parquet.read_table``, ``pandas.read_parquet``), so the directory reads as the
run's training history. ``pipeline replay`` re-executes it; ``pipeline diff`` compares two.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

from pipeline.common.checkpoint import fsync_path

if TYPE_CHECKING:
    from pipeline.records import ScoredGroup

ARCHIVE_DIR = "archive"
BASE = "_base.json"
RESUMES = "_resumes.jsonl"
ABANDONED = "_abandoned"
META_KEY = b"pipeline.archive"
SCHEMA_VERSION = 1
COLUMNS: dict[str, str] = {
    "step": "the version this step made (the model after the update)",
    "parent": "the version the step started from",
    "position": "the group's place in the step's batch (the order it was trained in)",
    "prompt_id": "the prompt's id (the feeder's sequence)",
    "group_id": "the group's id",
    "outcome": "trained, nosignal (equal rewards) or stale (dropped by the staleness bound)",
    "completion": "the completion's index in its group",
    "generator_id": "the generator worker that sampled it",
    "verifier_id": "the verifier worker that scored it",
    "min_version": "the oldest policy version among the group's tokens",
    "max_version": "the newest policy version among the group's tokens",
    "prompt_text": "the prompt, as the task wrote it",
    "prompt_ids": "the prompt's token ids",
    "completion_ids": "the completion's token ids",
    "token_versions": "the policy version that sampled each token (several where a swap came mid-sequence)",
    "behaviour_logprobs": "the sampler's log-probability of each token",
    "completion_text": "the completion, decoded",
    "reward": "the reward the trainer used (reward_mode weaver: the label model's posterior)",
    "truth": "the hidden correctness (never used by the reward unless reward_mode is ground_truth)",
    "reward_mode": "how the reward was made",
    "labelmodel_version": "the label model's version that made the reward (-1: none)",
    "verifier_names": "the weak verifiers, in the order of votes",
    "votes": "each verifier's score in [0, 1] (NaN: it abstained)",
    "env_reward": "an episode's environment reward (null: not an episode)",
    "turns": "an episode's turns (null: not an episode)",
    "record": "the group's exact record (msgpack), on its completion 0 only: what replay trains on",
}
"""The archive's columns, one row per completion (docs/reproducibility.md)."""


def _schema():
    import pyarrow as pa

    types = {
        "step": pa.int32(), "parent": pa.int32(), "position": pa.int16(), "prompt_id": pa.string(),
        "group_id": pa.string(), "outcome": pa.string(), "completion": pa.int16(), "generator_id": pa.string(),
        "verifier_id": pa.string(), "min_version": pa.int32(), "max_version": pa.int32(),
        "prompt_text": pa.string(), "prompt_ids": pa.list_(pa.int32()), "completion_ids": pa.list_(pa.int32()),
        "token_versions": pa.list_(pa.int32()), "behaviour_logprobs": pa.list_(pa.float32()),
        "completion_text": pa.string(), "reward": pa.float32(), "truth": pa.float32(), "reward_mode": pa.string(),
        "labelmodel_version": pa.int32(), "verifier_names": pa.list_(pa.string()), "votes": pa.list_(pa.float32()),
        "env_reward": pa.float32(), "turns": pa.int32(), "record": pa.binary(),
    }
    assert list(types) == list(COLUMNS)
    return pa.schema([pa.field(k, v) for k, v in types.items()])


@dataclass(frozen=True)
class StepMeta:
    """One segment's step, from its metadata."""

    step: int
    parent: int
    updated: bool
    """Whether the step made an optimizer update (a step whose groups all lacked signal made none)."""
    weights_hash: str
    groups: int
    path: Path


def segment_name(step: int) -> str:
    return f"step-{step:06d}.parquet"


def columns(step: int, parent: int, groups: list[ScoredGroup], outcomes: list[str]) -> dict[str, list]:
    """One step's rows (``COLUMNS``), one per completion, groups in training order."""
    out: dict[str, list] = {k: [] for k in COLUMNS}
    for pos, (g, outcome) in enumerate(zip(groups, outcomes)):
        ro = g.rollout
        ids, lps, vers = ro.split(ro.completion_ids), ro.split(ro.behaviour_logprobs), ro.split(ro.token_versions())
        record = g.encode()
        for c in range(ro.group_size):
            row = {
                "step": step, "parent": parent, "position": pos, "prompt_id": ro.prompt_id, "group_id": ro.group_id,
                "outcome": outcome, "completion": c, "generator_id": ro.generator_id, "verifier_id": g.verifier_id,
                "min_version": ro.min_version, "max_version": ro.max_version,
                "prompt_text": ro.prompt, "prompt_ids": ro.prompt_ids.astype(np.int32), "completion_ids": ids[c].astype(np.int32),
                "token_versions": vers[c].astype(np.int32), "behaviour_logprobs": lps[c].astype(np.float32),
                "completion_text": ro.completions[c] if c < len(ro.completions) else "",
                "reward": float(g.rewards[c]), "truth": float(g.truth[c]), "reward_mode": g.reward_mode,
                "labelmodel_version": g.labelmodel_version, "verifier_names": list(g.verifier_names),
                "votes": np.asarray(g.votes[c], dtype=np.float32) if g.votes.size else np.zeros(0, np.float32),
                "env_reward": None if ro.env_rewards is None else float(ro.env_rewards[c]),
                "turns": None if ro.turns is None else int(ro.turns[c]),
                "record": record if c == 0 else None,
            }
            for k, v in row.items():
                out[k].append(v)
    return out


def write_segment(directory: Path, *, step: int, parent: int, groups: list[ScoredGroup], outcomes: list[str],
                  weights_hash: str, updated: bool) -> int:
    """Write one step's segment atomically (a temporary name, fsync, rename); its size in bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = {"schema": SCHEMA_VERSION, "step": step, "parent": parent, "updated": updated,
            "weights_hash": weights_hash, "groups": len(groups)}
    schema = _schema().with_metadata({META_KEY: json.dumps(meta).encode()})
    table = pa.Table.from_pydict(columns(step, parent, groups, outcomes), schema=schema)
    path = directory / segment_name(step)
    tmp = directory / f".{path.name}.tmp"
    pq.write_table(table, tmp, compression="zstd")
    fsync_path(tmp)
    os.replace(tmp, path)
    return path.stat().st_size


class ArchiveWriter:
    """The trainer's side: segments written on a thread of their own, so the step goes on;
    ``flush`` (before each checkpoint) waits for them, so a checkpointed step is archived."""

    def __init__(self, directory: Path, *, keep_steps: int = 0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep_steps = keep_steps
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="archive")
        self._pending: list[Future] = []
        self.bytes = 0
        self.groups = 0

    def base(self, weights_hash: str, *, base_dir: str) -> None:
        """Record the base's hash (a fresh start): replay checks it before the first step."""
        (self.directory / BASE).write_text(json.dumps({"weights_hash": weights_hash,
                                                       "base_dir": str(Path(base_dir).resolve())}) + "\n")

    def write(self, *, step: int, parent: int, groups: list[ScoredGroup], outcomes: list[str], weights_hash: str,
              updated: bool) -> None:
        def job() -> None:
            size = write_segment(self.directory, step=step, parent=parent, groups=groups, outcomes=outcomes,
                                 weights_hash=weights_hash, updated=updated)
            self.bytes += size
            self.groups += len(groups)
            self._prune()

        self._pending.append(self._pool.submit(job))

    def flush(self) -> None:
        """Wait for every segment submitted; a write's error is raised here."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def _prune(self) -> None:
        if self.keep_steps:
            for path in segments(self.directory)[: -self.keep_steps]:
                path.unlink(missing_ok=True)

    def resumed(self, checkpoint_version: int, resumed_as: int) -> list[int]:
        """A trainer (re)starts from ``checkpoint_version`` (0: the base): segments of later steps
        move to ``_abandoned/`` (their model died; their groups are trained again) and, for a
        resume, a line goes to ``_resumes.jsonl``. Returns the steps moved."""
        self.flush()
        moved = []
        for path in segments(self.directory):
            step = int(path.stem.split("-")[1])
            if step > checkpoint_version:
                (self.directory / ABANDONED).mkdir(exist_ok=True)
                os.replace(path, self.directory / ABANDONED / f"{path.stem}-{int(time.time() * 1000)}.parquet")
                moved.append(step)
        if checkpoint_version > 0 or moved or resumed_as != checkpoint_version:
            with open(self.directory / RESUMES, "a") as f:
                f.write(json.dumps({"checkpoint": checkpoint_version, "resumed_as": resumed_as,
                                    "abandoned": moved, "at": time.time()}) + "\n")
        return moved

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)


def segments(directory: Path) -> list[Path]:
    """The archive's segments in step order."""
    return sorted(Path(directory).glob("step-*.parquet"))


def step_meta(path: Path) -> StepMeta:
    import pyarrow.parquet as pq

    meta = json.loads(pq.read_schema(path).metadata[META_KEY])
    return StepMeta(step=meta["step"], parent=meta["parent"], updated=meta["updated"],
                    weights_hash=meta["weights_hash"], groups=meta["groups"], path=path)


def steps(directory: Path) -> list[StepMeta]:
    return [step_meta(p) for p in segments(directory)]


def size(metas: list[StepMeta]) -> dict:
    """An archive's steps, bytes and bytes per group, from its segments (``steps``)."""
    total = sum(m.path.stat().st_size for m in metas)
    return {"steps": len(metas), "bytes": total, "bytes_per_group": total / max(1, sum(m.groups for m in metas))}


def base_hash(directory: Path) -> str | None:
    path = Path(directory) / BASE
    return json.loads(path.read_text())["weights_hash"] if path.exists() else None


def base_dir(directory: Path) -> str | None:
    """The base checkpoint's directory, as an absolute path, from ``_base.json``."""
    path = Path(directory) / BASE
    return json.loads(path.read_text()).get("base_dir") if path.exists() else None


def resumes(directory: Path) -> list[dict]:
    path = Path(directory) / RESUMES
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def read_columns(directory: Path, columns: list[str]) -> dict[str, list]:
    """The named columns of every segment, in step order, as lists."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = segments(directory)
    if not paths:
        return {c: [] for c in columns}
    return pa.concat_tables([pq.read_table(p, columns=columns) for p in paths]).to_pydict()


def read_records(path: Path) -> tuple[list[bytes], list[str]]:
    """A segment's groups as the exact records the trainer took (``ScoredGroup.decode`` reads
    them), in training order, with their outcomes."""
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["position", "completion", "outcome", "record"]).to_pydict()
    rows = sorted((p, o, r) for p, c, o, r in zip(t["position"], t["completion"], t["outcome"], t["record"]) if c == 0)
    return [r for _, _, r in rows], [o for _, o, _ in rows]


def lineage_problems(directory: Path, metas: list[StepMeta]) -> list[str]:
    """Why the segments do not form one line of steps from the base (empty: they do): a
    step's parent must be the step before it, or the version a resume continued as from
    that step's checkpoint."""
    aliases = {r["resumed_as"]: r["checkpoint"] for r in resumes(directory)}
    problems, prev = [], 0
    for m in metas:
        parent = aliases.get(m.parent, m.parent) if m.parent != prev else m.parent
        if parent != prev:
            problems.append(f"step {m.step} starts from version {m.parent}, but the step before it made {prev}"
                            + (" (a step is missing)" if m.parent > prev else ""))
        prev = m.step
    return problems
