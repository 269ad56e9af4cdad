"""Fuzzing the streams of a real run: generated records (undecodable, of the wrong shape, and
valid but absurd) written into the prompts, rollouts and scored streams while `pipeline up`
trains, beside replays of real entries (valid: duplicates the trainer must skip).

The property: no stage exits over any of them (no worker restart), every bad record is
dead-lettered with a reason naming its defect, and the accounting holds: lost 0, duplicated 0,
unexpected 0. Among the fixed poison, the ScoredGroup claiming policy version 1e6 that once
made the trainer raise on every delivery. Hypothesis draws the records (derandomized, so a CI
run is repeatable); one run holds every example, so the test takes about a minute.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis
from builders import make_prompt, make_rollout, make_scored
from harness import up
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.keys import Keys
from pipeline.records import Partial, PromptTask

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "pipeline.cli"]
VOCAB_PAST = 10_000
"""A token id past any vocabulary of the small run."""
FUTURE = 1_000_000
"""A policy version no run of this test reaches."""


def _future(g, version: int):
    """The record ``g`` (a rollout, or a scored group's) claiming ``version`` for every token."""
    if hasattr(g, "rollout"):
        return dataclasses.replace(g, rollout=_future(g.rollout, version))
    return dataclasses.replace(g, min_version=version, max_version=version)


def _regrouped(g, size: int):
    """A scored group (or rollout) of ``size`` completions: the run's groups have 4."""
    ro = make_rollout(prompt_id=g.prompt_id if not hasattr(g, "rollout") else g.rollout.prompt_id, group_size=size)
    if not hasattr(g, "rollout"):
        return ro
    r = np.array([1, 0, 1][:size] * 2, dtype=np.float32)[:size]
    return dataclasses.replace(g, rollout=ro, votes=np.ones((size, 2), dtype=np.float32), rewards=r, truth=r.copy())


def _out_of_vocab(g):
    if hasattr(g, "rollout"):
        return dataclasses.replace(g, rollout=_out_of_vocab(g.rollout))
    return dataclasses.replace(g, completion_ids=np.full_like(g.completion_ids, VOCAB_PAST))


def _partial(pid: str, *, size: int, version: int) -> PromptTask:
    return dataclasses.replace(make_prompt(prompt_id=pid), partial=Partial.of(
        [[3, 4]] * size, [[-0.5, -0.25]] * size, [[version, version]] * size, [False] * size))


# Per stream, the absurd records: each decodes, and a check this run makes refuses it.
ABSURD = {
    "prompts": {
        "out of vocabulary": lambda pid, n: dataclasses.replace(
            make_prompt(prompt_id=pid), prompt_ids=np.full(8, VOCAB_PAST, dtype=np.int32)),
        "wrong prompt length": lambda pid, n: dataclasses.replace(
            make_prompt(prompt_id=pid), prompt_ids=np.arange(1 + n % 5, dtype=np.int32)),
        "partial from the future": lambda pid, n: _partial(pid, size=4, version=FUTURE + n),
        "partial of another group size": lambda pid, n: _partial(pid, size=2 + n % 2, version=0),
    },
    "rollouts": {
        "future version": lambda pid, n: _future(make_rollout(prompt_id=pid), FUTURE + n),
        "another group size": lambda pid, n: _regrouped(make_rollout(prompt_id=pid), 2 + n % 2),
        "out of vocabulary": lambda pid, n: _out_of_vocab(make_rollout(prompt_id=pid)),
    },
    "scored": {
        "future version": lambda pid, n: _future(make_scored(prompt_id=pid), FUTURE + n),
        "another group size": lambda pid, n: _regrouped(make_scored(prompt_id=pid), 2 + n % 2),
        "out of vocabulary": lambda pid, n: _out_of_vocab(make_scored(prompt_id=pid)),
        "votes out of range": lambda pid, n: dataclasses.replace(
            make_scored(prompt_id=pid), votes=np.full((4, 2), 2.0 + n, dtype=np.float32)),
        "absurd rewards": lambda pid, n: dataclasses.replace(
            make_scored(prompt_id=pid), rewards=np.array([1e20, 0, 1, 0], dtype=np.float32)),
    },
}

WRONG_TYPE = {"prompts": make_scored, "rollouts": make_prompt, "scored": make_rollout}


RETYPED = {"prompts": ["prompt_id", "prompt_ids", "issued_at", "schema"],
           "rollouts": ["prompt_id", "min_version", "completion_ids", "schema"],
           "scored": ["rollout.prompt_id", "rollout.min_version", "rewards", "votes", "schema"]}
"""Per stream, fields of a real record that a retyped copy gives a list instead."""


def _garbage(stream: str) -> st.SearchStrategy:
    """Bytes no stage can decode: random bytes, MessagePack of random maps, a real record with a
    field of the wrong type, a record of another stream's type, or an entry without its payload."""
    scalars = st.one_of(st.integers(-2**40, 2**40), st.text(max_size=8), st.binary(max_size=8), st.none(),
                        st.floats(allow_nan=True))
    return st.one_of(
        st.binary(max_size=64).map(lambda b: ("bytes", b)),
        st.dictionaries(st.text(max_size=6), scalars, max_size=6).map(
            lambda d: ("map", msgpack.packb(d, use_bin_type=True))),
        st.sampled_from(RETYPED[stream]).map(lambda f: ("retyped", f)),
        st.just(("wrong type", b"")),
        st.just(("no payload", b"")),
    )


def _bad_entry(stream: str, kind: str, detail, pid: str, real: bytes) -> dict:
    """The fields of one bad entry of ``stream``."""
    if kind in ("bytes", "map"):
        return {"d": detail}
    if kind == "no payload":
        return {"x": b"where is d"}
    if kind == "wrong type":
        return {"d": WRONG_TYPE[stream](prompt_id=pid).encode()}
    body = msgpack.unpackb(real, raw=False)
    *inner, name = detail.split(".")
    target = body[inner[0]] if inner else body
    target[name] = [1, 2]
    return {"d": msgpack.packb(body, use_bin_type=True)}


def _cluster(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "runs" / "cluster.json").read_text())


def _wait(cond, timeout: float, what: str, p: subprocess.Popen) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert p.poll() is None, f"the run ended while waiting for {what}"
        assert time.time() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.3)


def test_fuzzed_records_in_every_stream_are_dead_lettered_and_the_run_goes_on(tmp_path, tiny_base_model):
    run_id = f"fuzz-{uuid.uuid4().hex[:6]}"
    p = up(tmp_path, tiny_base_model, "--run-id", run_id, "--trainer.steps", "100000", "--trainer.eval_every", "1000")
    try:
        runs = tmp_path / "runs"
        _wait(lambda: (runs / "cluster.json").exists(), 120, "cluster.json", p)
        info = _cluster(tmp_path)
        r = redis.Redis.from_url(info["url"])
        keys = Keys(run_id)
        shard = keys.shard(0)
        _wait(lambda: int(r.hget(keys.trainer, "committed_version") or 0) >= 1, 180, "a first committed step", p)
        real: dict[str, bytes] = {}

        def caught() -> bool:  # one real entry of each stream, for replays and retyped copies
            for name in ("prompts", "rollouts", "scored"):
                if name not in real and (last := r.xrevrange(getattr(shard, name), count=1)):
                    real[name] = last[0][1][b"d"]
            return len(real) == 3

        _wait(caught, 60, "an entry in each stream", p)
        bad: dict[tuple[str, bytes], str] = {}
        """(stream key, entry id) -> what it is, for every record that must be dead-lettered."""
        serial = iter(range(1_000_000))

        def write(stream: str, fields: dict, what: str) -> None:
            key = getattr(shard, stream)
            bad[(key, r.xadd(key, fields))] = f"{stream}: {what}"

        # The fixed poison first: the future-version ScoredGroup (min = max = 1e6).
        write("scored", {"d": _future(make_scored(prompt_id="fz-future"), 1_000_000).encode()},
              "scored group of version 1e6")
        write("rollouts", {"d": _future(make_rollout(prompt_id="fz-future-r"), 1_000_000).encode()},
              "rollout group of version 1e6")

        @settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(stream=st.sampled_from(["prompts", "rollouts", "scored"]), data=st.data())
        def inject(stream: str, data) -> None:
            n = next(serial)
            pid = f"fz-{n:05d}"
            kind = data.draw(st.sampled_from(["absurd", "garbage", "replay"]))
            if kind == "absurd":
                what = data.draw(st.sampled_from(sorted(ABSURD[stream])))
                write(stream, {"d": ABSURD[stream][what](pid, n).encode()}, what)
            elif kind == "garbage":
                what, detail = data.draw(_garbage(stream))
                write(stream, _bad_entry(stream, what, detail, pid, real[stream]), what)
            else:  # a valid record: a replay of a real entry, which the trainer trains at most once
                r.xadd(getattr(shard, stream), {"d": real[stream]})

        inject()
        v0 = int(r.hget(keys.trainer, "committed_version") or 0)

        def dead_letters() -> dict[tuple[str, bytes], bytes]:
            return {(f[b"stream"].decode(), f[b"id"]): f[b"reason"] for _, f in r.xrange(shard.dead)}

        _wait(lambda: set(bad) <= set(dead_letters()), 120, "every bad record dead-lettered", p)
        _wait(lambda: int(r.hget(keys.trainer, "committed_version") or 0) >= v0 + 3, 120, "three more steps", p)
        letters = dead_letters()
        down = subprocess.run([*CLI, "down", "--runs-dir", str(runs)], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        text = p.communicate(timeout=120)[0].decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
    for entry, what in bad.items():
        reason = letters[entry].decode()
        assert reason.strip(), f"{what}: dead-lettered without a reason"
    future = letters[next(e for e, w in bad.items() if w == "scored: scored group of version 1e6")].decode()
    assert "policy version 1000000 is newer than the newest published" in future, future
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["restarts"] == 0, f"a stage exited over a record:\n{text[-4000:]}"
    a = summary["accounting"]
    assert (a["lost"], a["duplicated"], a["unexpected"]) == (0, 0, 0) and a["ok"], a
    print(f"{len(bad)} bad records dead-lettered, each with its reason; "
          f"{a['duplicates_skipped']} duplicates skipped; {summary['steps']} steps")
