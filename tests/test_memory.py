"""A long run keeps every work stream bounded: what every group acked is trimmed.

The four stages run as their own processes with the stage functions users run (the
async benchmark's harness: fake engines, real loops, real server) for 500 steps, while
the length of every stream is sampled. Each bound is what the config allows: the
unacked entries (backlog, backpressure bound, what the trainer holds until a checkpoint)
plus the acked entries a stage trims every ``TRIM_EVERY`` batches.
"""

from __future__ import annotations

import pytest

import bench_async
from pipeline.stage import TRIM_EVERY

pytestmark = pytest.mark.slow

STEPS, B, G = 500, 4, 4
LAG, BACKLOG, CKPT = 32, 16, 5


def test_every_work_stream_stays_bounded_over_500_steps(redis_url):
    res = bench_async.run_harness(redis_url, eta=1, steps=STEPS, warmup=2, gen_s=0.0, verify_s=0.0, train_s=0.0,
                                  batch=B, group_size=G, watch_lengths=True, timeout_s=600,
                                  overrides={"redis.max_stream_lag": LAG, "feeder.backlog": BACKLOG,
                                             "trainer.checkpoint_every": CKPT})
    top, consumed = res["max_lengths"], STEPS * B
    assert res["length_samples"] > 100, "the lengths were sampled throughout the run"
    # Each generator batch is B prompts (prompts_per_batch = B), each verifier batch B groups.
    bounds = {
        "prompts": BACKLOG + B + TRIM_EVERY * B,            # backlog + one batch in hand + acked, not yet trimmed
        "rollouts": LAG + B + TRIM_EVERY * B,               # backpressure bound + a batch + untrimmed
        "scored": LAG + B + CKPT * B + TRIM_EVERY * B,      # + what the trainer holds until its checkpoint
    }
    for name, bound in bounds.items():
        assert top[name] <= bound, f"{name} reached {top[name]} entries (bound {bound}): {top}"
        assert top[name] < consumed / 10, f"{name} grew with the run: {top[name]} of {consumed} groups"
    assert top["dead"] == 0
    assert top["versions"] <= STEPS + 1
    # The training log is the run's audit record: one entry per consumed group, by design.
    assert top["trainlog"] <= consumed
    assert res["stale_dropped"] == 0 and sum(res["staleness_hist"]) == consumed
