"""Batch-synchronous against continuous + in-flight generation on a long-tailed workload.

The generator stage's own loop (``run_generator``: admission, reads, emit + ack in one
transaction, weight fetches over shm from a real publisher) runs on a real Redis-compatible
server with a fake engine: a calibrated sleep per decode step (``--step-ms`` plus
``--row-us`` per sequence in flight, as a memory-bound accelerator step) and completion
lengths drawn from a long-tailed distribution (log-normal, median ``--median`` tokens,
``--sigma``, cut at ``--max-new-tokens``). A publisher thread announces a new policy version
every ``--publish-s`` seconds, as a trainer would.

``generator.swap = "batch"`` samples ``prompts_per_batch`` prompts to completion (the batch
lasts as long as its longest completion; a new version waits for the batch to end);
``"step"`` keeps ``slots`` sequences in flight, refills a slot the moment its sequence ends
and swaps weights between two decode steps. Figures, per mode, over the same wall time:
completion tokens emitted per second, slot utilisation (sequences in flight / slots, per
decode step), seconds and decode steps from a version's fetch to the first token sampled
under it (forwards in between: the swap's, for a slot sampler), seconds from its
publication to the first token under it or a newer version (every version published, also
those a batch-synchronous generator skips), and the version lag of emitted tokens (the newest
published version when the group was emitted minus each token's version).

    python bench/bench_generation.py [--seconds 15] [--median 48] [--sigma 1.0]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from common import progress, save_result

from pipeline.bus.connection import connect
from pipeline.bus.streams import ensure_all_groups
from pipeline.config import load_config
from pipeline.engines import Sampled
from pipeline.engines.slots import Finished
from pipeline.keys import Keys
from pipeline.model.tokenizer import MAX_POSITIONS, CharTokenizer
from pipeline.records import Partial, RolloutGroup

RESULTS = ROOT / "bench" / "results"
AIM = 1.3
"""Tokens/s of continuous + in-flight generation over batch-synchronous, in the same run."""

say = progress("bench-generation")


class Workload:
    """The fake device: per-step cost and the long-tailed completion lengths (seeded)."""

    def __init__(self, *, step_s: float, row_s: float, median: float, sigma: float, max_new: int, seed: int):
        self.step_s, self.row_s, self.max_new = step_s, row_s, max_new
        self.median, self.sigma = median, sigma
        self.rng = np.random.default_rng(seed)
        self.tok = CharTokenizer()
        self.version = 0
        self.loaded_at: dict[int, float] = {}
        self.first_token: dict[int, tuple[float, int]] = {}
        """version -> (time, decode steps since its load) of the first token sampled under it."""
        self.steps_since_load = 0
        self.slot_steps, self.steps, self.slots_seen = 0, 0, 0

    def length(self) -> int:
        return int(np.clip(round(self.rng.lognormal(np.log(self.median), self.sigma)), 2, self.max_new))

    def forward(self, rows: int, slots: int = 0) -> None:
        """One forward of ``rows`` sequences (``slots``: a decode step's, counted in the utilisation)."""
        time.sleep(self.step_s + self.row_s * rows)
        self.steps_since_load += 1
        if slots:
            self.steps += 1
            self.slot_steps += rows
            self.slots_seen += slots

    def sampled(self, version: int) -> None:
        if version not in self.first_token and version in self.loaded_at:
            self.first_token[version] = (time.time(), self.steps_since_load)

    def load(self, tensors) -> None:
        self.version = int(tensors["version"][0])
        self.loaded_at[self.version] = time.time()
        self.steps_since_load = 0

    def token_ids(self, n: int) -> list[int]:
        ids = [2 + (i % (self.tok.vocab_size - 2)) for i in range(n - 1)]
        return ids + [self.tok.eos_id]


class FakeSlots:
    """The slot sampler's interface (``pipeline.engines.slots.SlotSampler``) on the fake device."""

    def __init__(self, w: Workload, slots: int):
        self.w, self.slots = w, slots
        self.rows: list[dict] = []
        self.groups: dict[object, list[dict]] = {}

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def free(self) -> int:
        return self.slots - len(self.rows)

    def add(self, key, prompt, *, n, max_new_tokens, version, partial: Partial | None = None):
        rows = []
        for j in range(n):
            target = self.w.length()
            row = {"key": key, "target": self.w.token_ids(target), "tokens": [], "versions": [], "lv": version}
            if partial is not None:
                row["tokens"], _, row["versions"], _ = partial.completions()[j]
            rows.append(row)
        self.groups[key] = rows
        self.rows += rows
        self.w.forward(1)  # the prompt's forward
        return None

    def step(self, version: int) -> list[Finished]:
        # Sample from the logits at hand, then the forward of the sequences that continue.
        ended = []
        for row in self.rows:
            row["tokens"].append(row["target"][len(row["tokens"])])
            row["versions"].append(row["lv"])
            self.w.sampled(row["lv"])
            row["lv"] = version
            if len(row["tokens"]) == len(row["target"]):
                ended.append(row)
        gone = {id(r) for r in ended}
        slots_used = len(self.rows)
        self.rows = [r for r in self.rows if id(r) not in gone]
        if self.rows:
            self.w.forward(len(self.rows), self.slots)
        else:
            self.w.steps += 1
            self.w.slot_steps += slots_used
            self.w.slots_seen += self.slots
        out = []
        for key in dict.fromkeys(r["key"] for r in ended):
            rows = self.groups[key]
            if all(len(r["tokens"]) == len(r["target"]) for r in rows):
                del self.groups[key]
                out.append(Finished(key=key, tokens=[r["tokens"] for r in rows],
                                    logprobs=[[-1.0] * len(r["tokens"]) for r in rows],
                                    versions=[r["versions"] for r in rows]))
        return out

    def refresh(self, version: int) -> None:
        if self.rows:  # the last position of every sequence, under the new weights
            self.w.forward(len(self.rows))
        for r in self.rows:
            r["lv"] = version

    recompute = refresh

    def unfinished(self):
        return [(key, Partial.of([r["tokens"] for r in rows], [[-1.0] * len(r["tokens"]) for r in rows],
                                 [r["versions"] for r in rows], [len(r["tokens"]) == len(r["target"]) for r in rows]))
                for key, rows in self.groups.items()]

    def clear(self) -> None:
        self.rows, self.groups = [], {}


class FakeBackend:
    """A ``GenerationBackend`` on the fake device: batch mode via ``generate``, slots via ``continuous``."""

    def __init__(self, w: Workload):
        self.w = w
        self.tokenizer = w.tok
        self.vocab_size = w.tok.vocab_size

    def generate(self, prompts, *, n: int, max_new_tokens: int, temperature: float) -> list[Sampled]:
        lengths = [[self.w.length() for _ in range(n)] for _ in prompts]
        rows = len(prompts) * n
        self.w.forward(len(prompts))  # the prompts' forward
        self.w.sampled(self.w.version)
        flat = [x for g in lengths for x in g]
        for t in range(max(flat) - 1):  # every row sampled at t; those that continue go forward
            self.w.forward(sum(x > t + 1 for x in flat), rows)
        return [Sampled.from_rows([(self.w.token_ids(x), [-1.0] * x) for x in g], pad_id=self.tokenizer.pad_id)
                for g in lengths]

    def continuous(self, *, slots: int) -> FakeSlots:
        return FakeSlots(self.w, slots)

    def load_weights(self, tensors) -> None:
        self.w.load(tensors)

    def close(self) -> None:
        pass


def write_model_dir(path: Path, context: int) -> Path:
    """The files the stage reads besides the weights: the tokenizer and a config.json."""
    tok = CharTokenizer()
    tok.save(path)
    (path / "config.json").write_text(json.dumps({"vocab_size": tok.vocab_size, "max_position_embeddings": context}))
    return path


def run_mode(url: str, tmp: Path, *, swap: str, a, seed: int) -> dict:
    from pipeline.observe.logs import setup_logging
    from pipeline.producers.feeder import run_feeder
    from pipeline.producers.generator import run_generator
    from pipeline.weights import make_publisher

    ns = f"benchgen-{swap}-{seed}"
    cfg = load_config(overrides={
        "runs_dir": str(tmp / "runs"), "run_id": ns, "redis.url": url, "redis.block_ms": 100,
        "model.base_dir": str(write_model_dir(tmp / f"model-{swap}", MAX_POSITIONS + a.max_new_tokens)), "weights.transport": "shm",
        "generator.swap": swap, "generator.group_size": a.group_size, "generator.prompts_per_batch": a.prompts,
        "generator.slots": a.prompts * a.group_size, "task.max_new_tokens": a.max_new_tokens,
        "trainer.max_staleness": 1_000_000, "trainer.groups_per_step": a.prompts,
        "redis.max_stream_lag": 1_000_000, "feeder.backlog": 100_000, "feeder.max_prompts": a.max_prompts})
    r = connect(url, name="bench-generation")
    keys = Keys.of(cfg.run_id, cfg.redis)
    ensure_all_groups(r, keys)
    log = setup_logging(cfg.run_dir / "logs", stage="generator", worker="gen-0")
    run_feeder(cfg, r, keys, log, tokenizer=CharTokenizer(), max_rounds=1)
    w = Workload(step_s=a.step_ms / 1e3, row_s=a.row_us / 1e6, median=a.median, sigma=a.sigma,
                 max_new=a.max_new_tokens, seed=seed)
    pub = make_publisher("shm", r, keys.weights, ns=keys.ns)
    published: dict[int, float] = {}
    stop = threading.Event()

    def trainer() -> None:  # announces a version every --publish-s
        v = 0
        while not stop.wait(a.publish_s if v else 0):
            v += 1
            pub.publish(v, {"version": torch.tensor([v], dtype=torch.int64)})
            published[v] = time.time()

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    while not published:
        time.sleep(0.01)
    timer = threading.Timer(a.seconds, lambda: r.set(keys.stop, 1))
    t0 = time.time()
    timer.start()
    try:
        run_generator(cfg, r, keys, "gen-0", log, backend=FakeBackend(w))
    finally:
        elapsed = time.time() - t0
        stop.set()
        thread.join()
        timer.cancel()
        pub.close()
    groups = [RolloutGroup.decode(f[b"d"]) for k in keys.stream_keys("rollouts") for _, f in r.xrange(k)]
    tokens = sum(int(g.completion_ids.size) for g in groups)
    lags = []
    pub_times = sorted(published.items())
    for g in groups:
        newest = max((v for v, t in pub_times if t <= g.created_at), default=0)
        lags.append(newest - g.token_versions())
    lag = np.concatenate(lags) if lags else np.zeros(0)
    fetch_to_token = [w.first_token[v][0] - w.loaded_at[v] for v in w.first_token if v in w.loaded_at]
    steps_to_token = [w.first_token[v][1] for v in w.first_token]
    # Every published version, skipped or not: until the first token under it or a newer one.
    firsts = sorted(w.first_token.items())
    publish_to_token = [min(t for u, (t, _) in firsts if u >= v) - at for v, at in published.items()
                        if any(u >= v for u, _ in firsts)]
    for k in r.scan_iter(match=f"{ns}:*", count=1000):
        r.delete(k)
    r.close()
    return {"swap": swap, "seconds": elapsed, "groups": len(groups), "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "slot_utilisation": w.slot_steps / max(w.slots_seen, 1), "decode_steps": w.steps,
            "versions_published": len(published), "versions_sampled": len(w.first_token),
            "fetch_to_first_token_s": float(np.median(fetch_to_token)) if fetch_to_token else None,
            "fetch_to_first_token_steps_median": float(np.median(steps_to_token)) if steps_to_token else None,
            "published": {v: round(t - t0, 3) for v, t in published.items()},
            "first_token": {v: round(t - t0, 3) for v, (t, _) in w.first_token.items()},
            "publish_to_first_token_s": float(np.median(publish_to_token)) if publish_to_token else None,
            "token_version_lag_mean": float(lag.mean()) if lag.size else None,
            "groups_mixed_versions": sum(g.min_version != g.max_version for g in groups)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=15.0, help="wall time per mode")
    p.add_argument("--step-ms", type=float, default=4.0, help="fake decode step: fixed cost, ms")
    p.add_argument("--row-us", type=float, default=20.0, help="fake decode step: cost per sequence in flight, µs")
    p.add_argument("--median", type=float, default=48.0, help="median completion length, tokens")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the completion lengths")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch; slots = prompts x group size")
    p.add_argument("--publish-s", type=float, default=1.1, help="seconds between published versions")
    p.add_argument("--max-prompts", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "generation.json"))
    a = p.parse_args(argv)
    if a.seconds <= 0 or a.median < 2 or a.sigma < 0 or a.max_new_tokens < 2 or a.publish_s <= 0:
        p.error("--seconds and --publish-s must be > 0, --median and --max-new-tokens >= 2, --sigma >= 0")
    from pipeline.bus.server import start_local_server

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-generation-") as tmp:
        server = start_local_server(Path(tmp) / "server")
        try:
            for swap in ("batch", "step"):
                say(f"{swap}: {a.seconds:.0f} s of generation, {a.prompts} prompts x {a.group_size}, lengths "
                    f"log-normal median {a.median:.0f} sigma {a.sigma} (cut at {a.max_new_tokens})")
                row = run_mode(server.url, Path(tmp), swap=swap, a=a, seed=a.seed)
                runs.append(row)
                say(f"{swap}: {row['tokens_per_s']:.0f} tokens/s, slots used {row['slot_utilisation']:.0%}, "
                    f"fetch -> first token {row['fetch_to_first_token_s']:.3f} s "
                    f"(median {row['fetch_to_first_token_steps_median']:.0f} forwards), publish -> first token "
                    f"{row['publish_to_first_token_s']:.3f} s, token version lag {row['token_version_lag_mean']:.2f}")
        finally:
            server.stop()
    batch, step = runs
    res = {"aim": AIM, "runs": runs, "speedup": step["tokens_per_s"] / batch["tokens_per_s"],
           "workload": {"step_ms": a.step_ms, "row_us": a.row_us, "median": a.median, "sigma": a.sigma,
                        "max_new_tokens": a.max_new_tokens, "group_size": a.group_size, "prompts": a.prompts,
                        "publish_s": a.publish_s}}
    say(f"continuous + in-flight / batch-synchronous: {res['speedup']:.2f}x tokens/s (aim >= {AIM}x)")
    save_result(a.out, res, script="bench/bench_generation.py", argv=argv)
    say(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
