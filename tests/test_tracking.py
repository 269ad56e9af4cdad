"""Experiment trackers: a real run with TensorBoard and W&B (offline) tracking, read back.

The scalars in the TensorBoard event files and in the offline W&B run must equal the
trainer's ``metrics.jsonl`` rows, step for step."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from harness import up as _up

from pipeline.config import ConfigError, load_config
from pipeline.observe.tracking import scalars

pytestmark = [pytest.mark.slow, pytest.mark.one_server]


def _metrics(run_dir: Path) -> dict[tuple[str, int], float]:
    """(tag, version) -> value, from metrics.jsonl through the same flattening the trackers use."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for tag, v in scalars(row["kind"], row).items():
            out[(tag, row["version"])] = v
    return out


def _tensorboard(directory: Path) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a ``.wandb`` file: a 7-byte header, then LevelDB-log records in 32 KiB blocks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        buf += chunk
        if kind in (1, 4):  # a full record, or the last piece of one
            out.append(buf)
            buf = b""
    return out


def _wandb(directory: Path) -> dict[tuple[str, int], float]:
    from wandb.proto import wandb_internal_pb2

    (path,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    out = {}
    for raw in _wandb_records(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") != "history":
            continue
        row = {(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item}
        for tag, v in row.items():
            if tag.startswith(("train/", "eval/")):
                out[(tag, int(row["policy_version"]))] = float(v)
    return out


def test_tensorboard_and_offline_wandb_hold_the_metrics_rows(tmp_path, tiny_base_model):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    p = _up(tmp_path, tiny_base_model, "--run-id", "tracked", "--trainer.steps", "6", "--trainer.eval_every", "3",
            "--tracking.backends", "tensorboard,wandb")
    out = p.communicate(timeout=600)[0].decode()
    assert p.returncode == 0, out[-3000:]
    run_dir = tmp_path / "runs" / "tracked"
    want = _metrics(run_dir)
    assert {v for _, v in want} >= set(range(1, 7)), "a row per step"
    assert any(tag == "eval/heldout_accuracy" for tag, _ in want)
    for name, got in (("tensorboard", _tensorboard(run_dir / "tensorboard")), ("wandb", _wandb(run_dir / "wandb"))):
        assert set(got) == set(want), (name, sorted(set(want) ^ set(got))[:10])
        bad = {k: (got[k], want[k]) for k in want if abs(got[k] - want[k]) > 1e-5 * max(1.0, abs(want[k]))}
        assert not bad, (name, list(bad.items())[:5])


def test_a_tracker_whose_package_is_missing_is_refused_before_launch(monkeypatch):
    import importlib.util

    from pipeline.run.preflight import backend_problems

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    problems = backend_problems(load_config(overrides={"tracking.backends": "wandb"}))
    assert any(p.startswith("tracking.backends: 'wandb' needs the 'wandb' package") for p in problems), problems
    with pytest.raises(ConfigError, match=r"tracking\.backends: must be"):
        load_config(overrides={"tracking.backends": "mlflow"})
