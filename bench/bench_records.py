"""Record codec benchmark: encode + decode of a typical rollout group against a plain
MessagePack round trip of the same byte blobs, measured in the same run.

The typical group is what an LLM generator emits (G = 8 completions of 500 tokens each for
a 200-token prompt, per-token behaviour log-probs, ~4 characters of text per token); the
embedded default's groups (3-digit addition) are measured beside it. The baseline packs and
unpacks a map with the same keys and the same bytes, with the arrays already serialised, so
the ratio is what the records' typing, copies and validation cost.

    python bench/bench_records.py [--seconds 1.5] [--out bench/results/records.json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from common import progress, save_result

from pipeline.records import RolloutGroup, ScoredGroup

RESULTS = ROOT / "bench" / "results"
VOCAB = 151_936
"""Token ids are drawn from a Qwen-sized vocabulary so no id fits in a short encoding by chance."""


say = progress("bench-records")


def typical_group(*, group_size: int = 8, prompt_tokens: int = 200, completion_tokens: int = 500,
                  chars_per_token: int = 4, seed: int = 0, prompt_id: str = "p000000001") -> RolloutGroup:
    """A rollout group shaped like an LLM generator's: G completions of fixed length with log-probs."""
    rng = np.random.default_rng(seed)
    text = "abcdefghijklmnopqrstuvwxyz 0123456789+=."
    words = lambda n: "".join(text[i] for i in rng.integers(0, len(text), n))  # noqa: E731
    lens = np.full(group_size, completion_tokens, dtype=np.int32)
    n = int(lens.sum())
    return RolloutGroup(
        prompt_id=prompt_id, group_id=f"{prompt_id}:gen-0:1", generator_id="gen-0",
        prompt=words(prompt_tokens * chars_per_token),
        prompt_ids=rng.integers(0, VOCAB, prompt_tokens, dtype=np.int32), reference="42",
        completions=tuple(words(completion_tokens * chars_per_token) for _ in range(group_size)),
        completion_ids=rng.integers(0, VOCAB, n, dtype=np.int32), completion_lens=lens,
        behaviour_logprobs=-rng.exponential(0.5, n).astype(np.float32),
        min_version=3, max_version=3, created_at=time.time())


def embedded_group(*, prompt_id: str = "p000000001") -> RolloutGroup:
    """A group as the embedded default emits it: 3-digit addition, G = 8, 12-token prompt, ~5-token answers."""
    return typical_group(group_size=8, prompt_tokens=12, completion_tokens=5, chars_per_token=1, prompt_id=prompt_id)


def scored_of(g: RolloutGroup, *, verifiers: int = 6) -> ScoredGroup:
    """The verifier's output for ``g``: votes of ``verifiers`` weak verifiers and rewards."""
    rng = np.random.default_rng(1)
    n = g.group_size
    rewards = rng.random(n).astype(np.float32)
    return ScoredGroup(rollout=g, verifier_names=tuple(f"v{i}" for i in range(verifiers)),
                       votes=rng.random((n, verifiers)).astype(np.float32), rewards=rewards,
                       truth=(rewards > 0.5).astype(np.float32), reward_mode="weaver", labelmodel_version=2,
                       verifier_id="ver-0", scored_at=time.time())


def plain_map(g: RolloutGroup) -> dict:
    """The group's fields as a plain map of the same bytes (arrays already serialised)."""
    return {"schema": 1, "type": "RolloutGroup", **g._body()}


def rate(fn, seconds: float) -> float:
    """Calls of ``fn`` per second over about ``seconds`` (after one warm-up call)."""
    fn()
    n, t0 = 0, time.perf_counter()
    batch = 1
    while True:
        for _ in range(batch):
            fn()
        n += batch
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n / dt
        batch = min(batch * 2, 1024)


def best_rate(fn, seconds: float, repeats: int) -> float:
    return max(rate(fn, seconds / repeats) for _ in range(repeats))


def measure(*, seconds: float = 1.5, repeats: int = 3) -> dict:
    """Round trips per second of each record kind against the plain MessagePack baseline, interleaved."""
    rows = []
    cases = [("RolloutGroup, typical (G=8, 200+8x500 tokens)", typical_group(), RolloutGroup),
             ("ScoredGroup, typical (G=8, 200+8x500 tokens, 6 verifiers)", scored_of(typical_group()), ScoredGroup),
             ("RolloutGroup, embedded default (G=8, 3-digit addition)", embedded_group(), RolloutGroup)]
    for name, rec, cls in cases:
        wire = rec.encode()
        assert cls.decode(wire).encode() == wire, "round trip changed the bytes"
        plain = msgpack.unpackb(wire, raw=False)  # the same keys and bytes, already plain Python objects
        say(f"{name}: {len(wire):,} bytes on the wire; timing encode+decode vs plain msgpack ({seconds:.1f} s each)")

        def pipeline_rt(rec=rec, cls=cls):
            cls.decode(rec.encode())

        def plain_rt(plain=plain):
            msgpack.unpackb(msgpack.packb(plain, use_bin_type=True), raw=False)

        measured, baseline = [], []
        for _ in range(repeats):  # interleaved, so both see the same load
            measured.append(rate(pipeline_rt, seconds / repeats))
            baseline.append(rate(plain_rt, seconds / repeats))
        enc = best_rate(rec.encode, seconds / 2, repeats)
        dec = best_rate(lambda: cls.decode(wire), seconds / 2, repeats)
        row = {"record": name, "bytes": len(wire), "roundtrips_per_s": max(measured),
               "plain_msgpack_roundtrips_per_s": max(baseline), "ratio": max(measured) / max(baseline),
               "encode_per_s": enc, "decode_per_s": dec}
        rows.append(row)
        say(f"  {row['roundtrips_per_s']:,.0f} round trips/s vs plain msgpack {row['plain_msgpack_roundtrips_per_s']:,.0f}/s"
            f" ({row['ratio']:.0%}); encode {enc:,.0f}/s, decode {dec:,.0f}/s")
    return {"rows": rows, "seconds_per_figure": seconds, "repeats": repeats}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=1.5, help="timing per figure (split over --repeats)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "records.json"))
    a = p.parse_args(argv)
    if a.seconds <= 0 or a.repeats < 1:
        p.error("--seconds must be > 0 and --repeats >= 1")
    res = save_result(a.out, measure(seconds=a.seconds, repeats=a.repeats), script="bench/bench_records.py",
                      argv=argv)
    say(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
