"""What the rollout archive costs the trainer, on the default run.

Runs the embedded default (``configs/default.toml``: 32 groups of 8 a step) for ``--steps``
steps with the archive on, then, on the groups that run archived, times per step in one
process and in turn: the trainer's optimizer step (``engine.train_step`` on the step's
groups, as the trainer makes it), the weights hash the trainer records after it, and the
segment's write (``pipeline.common.archive.write_segment``: rows, Parquet, zstd, fsync).
The write runs on a thread of its own beside the trainer; timed alone it is the most it can
take from a step. The ratio write / step is the archive's cost; the aim is at most 5%.
Bytes per group come from the segments. Results into ``bench/results/archive.{json,md}``.

    python bench/bench_archive.py --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
AIM = 0.05


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    from pipeline.consumers.trainer import sort_step
    from pipeline.engines import make_train_engine
    from pipeline.engines.torch_state import weights_hash
    from pipeline.common import archive as arc
    from pipeline.run.replay import read_groups, run_config

    work = Path(tempfile.mkdtemp(prefix="bench-archive-"))
    cmd = [sys.executable, "-m", "pipeline.cli", "up", "--run-id", "archive", "--runs_dir", str(work),
           "--trainer.steps", str(a.steps)]
    print(f"bench_archive: {' '.join(cmd[2:])} (the default run, {a.steps} steps)", file=sys.stderr, flush=True)
    t0 = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    run = work / "archive"
    print(f"bench_archive: the run took {time.time() - t0:.0f} s; timing its steps", file=sys.stderr, flush=True)
    cfg = run_config(run)
    engine = make_train_engine(cfg)
    scratch = work / "segments"
    scratch.mkdir()
    rows = []
    metas = arc.steps(run / "archive")
    idle = {m.step for m in metas if not m.updated}  # the trainer's staleness skips the steps that trained nothing
    for i, m in enumerate(metas):
        groups, outcomes = read_groups(m.path)
        s = sort_step([(None, g) for g in groups], version=m.parent, max_staleness=cfg.trainer.max_staleness,
                      idle=idle)
        t1 = time.perf_counter()
        if s.signal:
            engine.train_step(s.signal)
            engine.lr_step()
        t2 = time.perf_counter()
        digest = weights_hash(engine.weights())
        t3 = time.perf_counter()
        size = arc.write_segment(scratch, step=m.step, parent=m.parent, groups=groups, outcomes=outcomes,
                                 weights_hash=digest, updated=bool(s.signal))
        t4 = time.perf_counter()
        rows.append({"step": m.step, "groups": len(groups), "step_s": t2 - t1, "hash_s": t3 - t2, "write_s": t4 - t3,
                     "bytes": size, "replayed_exactly": digest == m.weights_hash})
        print(f"bench_archive: step {i + 1}/{len(metas)}: step {t2 - t1:.3f} s, write {t4 - t3:.4f} s",
              file=sys.stderr, flush=True)
    engine.close()
    med = {k: statistics.median(r[k] for r in rows) for k in ("step_s", "hash_s", "write_s")}
    groups = sum(r["groups"] for r in rows)
    res = {
        "command": f"python bench/bench_archive.py --steps {a.steps}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "config": "configs/default.toml", "groups_per_step": cfg.trainer.groups_per_step,
        "group_size": cfg.generator.group_size, "threads": torch.get_num_threads(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "median_step_s": med["step_s"], "median_hash_s": med["hash_s"], "median_write_s": med["write_s"],
        "write_over_step": med["write_s"] / med["step_s"], "hash_over_step": med["hash_s"] / med["step_s"],
        "aim_write_over_step": AIM, "meets_aim": med["write_s"] / med["step_s"] <= AIM,
        "bytes_per_group": sum(r["bytes"] for r in rows) / groups,
        "steps_replayed_exactly": sum(r["replayed_exactly"] for r in rows), "steps": rows,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "archive.json").write_text(json.dumps(res, indent=2) + "\n")
    (a.out / "archive.md").write_text("\n".join(section(res)) + "\n")
    print("\n".join(section(res)))
    return 0


def section(res: dict) -> list[str]:
    return [
        "## The rollout archive (bench/results/archive.json)\n",
        f"`{res['command']}` ({res['date']}): the default run ({res['groups_per_step']} groups of "
        f"{res['group_size']} a step), each archived step's optimizer step, weights hash and segment write timed "
        f"in one process, medians over {len(res['steps'])} steps. The write runs beside the trainer on a thread of "
        "its own; timed alone it is the most it can take from a step.\n",
        "| figure | median | vs the optimizer step | aim |",
        "|---|---|---|---|",
        f"| optimizer step | {res['median_step_s'] * 1000:.1f} ms | 1 | |",
        f"| segment write (rows, Parquet, zstd, fsync) | {res['median_write_s'] * 1000:.1f} ms | "
        f"{res['write_over_step']:.3f} | <= {res['aim_write_over_step']:.2f}: "
        f"{'met' if res['meets_aim'] else '**missed**'} |",
        f"| weights hash (blake2b, every tensor) | {res['median_hash_s'] * 1000:.2f} ms | "
        f"{res['hash_over_step']:.3f} | |",
        "",
        f"Size: {res['bytes_per_group']:,.0f} bytes per group ({res['group_size']} completions with their tokens, "
        f"log-probs, versions, votes and the exact record). The timing pass re-executed the run's steps from its "
        f"archive: {res['steps_replayed_exactly']} of {len(res['steps'])} matched the recorded weights hash.",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
