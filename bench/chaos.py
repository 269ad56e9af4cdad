"""Fault tolerance, measured: seeded chaos runs, the fault rate survived, and a soak.

Every run is ``pipeline chaos`` on the embedded default (Valkey, feeder, 2 generators,
2 verifiers, trainer, as ``make up-cluster`` starts them), with the fault injector
(``pipeline inject``) beside the driver as its own process: SIGKILLs of any worker,
SIGSTOPs of 8 s, SIGKILLs of the server, one every ``min_gap_s``-``max_gap_s`` seconds.
A run passes when it finishes with lost 0, duplicated 0 and unexpected 0 (the driver's
total-queue check over every prompt issued).

    python bench/chaos.py seeds --seeds 0-9 --steps 80        # ten seeded runs, a fault every 4-10 s
    python bench/chaos.py seeds --seeds 11-20 --load 2         # the same beside two CPU burners
    python bench/chaos.py seeds --seeds 11-20 --load 2 --resume  # after an interruption: the rest
    python bench/chaos.py rates --steps 60                     # rising fault rates until one fails
    python bench/chaos.py soak --minutes 60                    # one long run under steady faults

``--load N`` runs N CPU burners at normal priority beside each run (``chaos.load``): the host
loaded as production hosts are. Each run reports the trainer's resume time, from its death to
its next committed step (the driver's ``trainer_resume_seconds``), beside the faults survived.

Each writes its section of bench/results/chaos.json and rewrites bench/results/chaos.md;
``bench/run.py`` (``make bench``) carries the figures into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from pipeline_runs import PIPELINE, RESULTS, ROOT, md_table

OUT = RESULTS / "chaos.json"
RATE_GAPS = ((4.0, 10.0), (2.0, 5.0), (1.0, 2.5), (0.5, 1.2), (0.25, 0.6))
"""The gap ranges ``rates`` tries, in order: about 9, 17, 34, 71 and 141 faults a minute."""


def seed_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def chaos_run(label: str, *, steps: int, seed: int, gap: tuple[float, float], runs_dir: Path,
              extra: list[str] | None = None, timeout_s: float = 3600, on_start=None, load: int = 0) -> dict:
    """One ``pipeline chaos`` run; what its summary says, plus the exit code and wall time."""
    run_id = f"{label}-{time.strftime('%m%d-%H%M%S')}"
    cmd = [*PIPELINE, "chaos", "--run-id", run_id, "--runs_dir", str(runs_dir), "--trainer.steps", str(steps),
           "--chaos.seed", str(seed), "--chaos.min_gap_s", str(gap[0]), "--chaos.max_gap_s", str(gap[1]),
           "--redis.claim_idle_ms", "5000", "--cluster.timeout_s", str(int(timeout_s)), "--chaos.load", str(load),
           *(extra or [])]
    print(f"[{label}] {' '.join(cmd)}", flush=True)
    t0 = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          start_new_session=True) as p:
        if on_start is not None:
            on_start(p, runs_dir, run_id)
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith(("[", "chaos:", "pipeline:")) or "Traceback" in line or "CRASH" in line:
                print(f"[{label}] {line.rstrip()}", flush=True)
        rc = p.wait()
    run_dir = runs_dir / run_id
    row = {"label": label, "run": str(run_dir.relative_to(ROOT) if run_dir.is_relative_to(ROOT) else run_dir),
           "seed": seed, "gap_s": list(gap), "load": load, "exit_code": rc, "wall_seconds": round(time.time() - t0, 1)}
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {**row, "summary": False, "passed": False}
    v = s.get("chaos", {}).get("verdict", {})
    faults = s.get("chaos", {}).get("faults", 0)
    minutes = max(1e-9, (s.get("wall_seconds") or row["wall_seconds"]) / 60)
    resumes = sorted(s.get("trainer_resume_seconds") or [])
    return {**row, "summary": True, "trainer_resumes": len(resumes),
            "resume_s_median": resumes[len(resumes) // 2] if resumes else None,
            "resume_s_max": resumes[-1] if resumes else None, "resume_s": resumes,
            "status": s.get("status"), "steps": s.get("steps"),
            "faults": faults, "faults_per_min": round(faults / minutes, 1),
            "by_kind": s.get("chaos", {}).get("by_kind", {}), "restarts": s.get("restarts"),
            "server_restarts": s.get("server_restarts"), "issued": v.get("issued"), "trained": v.get("trained"),
            "lost": v.get("lost"), "duplicated": v.get("duplicated"), "unexpected": v.get("unexpected"),
            "in_flight": v.get("in_flight"), "finished": v.get("finished"),
            "gain_points": s.get("improvement_points"), "passed": rc == 0 and bool(v.get("ok"))}


def run_seeds(a, done: list[dict] | None = None, save=None) -> dict:
    """One chaos run per seed. ``done``: rows of an earlier, interrupted series (``--resume``), whose
    seeds are not run again; ``save`` gets the section after every run, so an interruption keeps
    every finished run."""
    rows = list(done or [])
    have = {r["seed"] for r in rows}

    def section() -> dict:
        return {"command": f"python bench/chaos.py seeds --seeds {a.seeds} --steps {a.steps} --min-gap {a.min_gap:g} "
                           f"--max-gap {a.max_gap:g} --load {a.load}", "steps": a.steps, "load": a.load,
                "gap_s": [a.min_gap, a.max_gap], "runs": rows, "passed": sum(r["passed"] for r in rows),
                "n": len(rows), "faults_total": sum(r.get("faults", 0) for r in rows), **resume_stats(rows)}

    for k in seed_list(a.seeds):
        if k in have:
            continue
        rows.append(chaos_run(f"chaos-seed{k}", steps=a.steps, seed=k, gap=(a.min_gap, a.max_gap),
                              runs_dir=a.runs_dir, load=a.load))
        if save is not None:
            save(section())
    return section()


def resume_stats(rows: list[dict]) -> dict:
    """The trainer's resume times over runs (death -> next committed step): how many, median, longest."""
    times = sorted(t for r in rows for t in r.get("resume_s") or [])
    return {"trainer_resumes": len(times), "resume_s_median": times[len(times) // 2] if times else None,
            "resume_s_max": times[-1] if times else None}


def run_rates(a) -> dict:
    rows = []
    for gap in RATE_GAPS:
        row = chaos_run(f"chaos-rate{gap[0]:g}-{gap[1]:g}", steps=a.steps, seed=a.seed, gap=gap, runs_dir=a.runs_dir,
                        load=a.load)
        rows.append(row)
        if not row["passed"]:
            break
    survived = [r for r in rows if r["passed"]]
    best = max(survived, key=lambda r: r["faults_per_min"]) if survived else None
    return {"command": f"python bench/chaos.py rates --steps {a.steps} --seed {a.seed} --load {a.load}",
            "steps": a.steps, "load": a.load, **resume_stats(rows), "runs": rows, "highest_survived_per_min": best["faults_per_min"] if best else None,
            "highest_survived_gap_s": best["gap_s"] if best else None,
            "first_failure": next((r for r in rows if not r["passed"]), None)}


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_soak(a) -> dict:
    """One long chaos run, stopped after ``--minutes`` by SIGTERM to its driver (as ``pipeline
    down`` does); samples every worker's and the server's memory and every stream's length."""
    samples: list[dict] = []
    state: dict = {}

    def on_start(p, runs_dir: Path, run_id: str) -> None:
        import threading

        def sample() -> None:
            import redis

            from pipeline.config import load_config
            from pipeline.keys import Keys

            deadline = time.time() + a.minutes * 60
            keys = r = None
            while p.poll() is None:
                time.sleep(a.sample_s)
                try:
                    info = json.loads((runs_dir / "cluster.json").read_text())
                except (OSError, ValueError):
                    continue
                if info.get("run_id") != run_id:
                    continue
                if keys is None:
                    cfg = load_config(str(Path(info["run_dir"]) / "config.toml"), {})
                    keys = Keys.of(run_id, cfg.redis)
                row = {"t_s": round(time.time() - state["t0"], 1)}
                for name, pid in (info.get("workers") or {}).items():
                    row[f"rss_{name}"] = _rss_mib(pid)
                row["rss_server"] = sum(x or 0 for x in map(_rss_mib, info.get("server_pids") or []))
                try:
                    r = r or redis.Redis.from_url(info["url"], socket_timeout=2)
                    for stream in ("prompts", "rollouts", "scored", "dead"):
                        row[f"len_{stream}"] = sum(r.xlen(k) for k in keys.stream_keys(stream))
                    row["server_used_mib"] = int(r.info("memory")["used_memory"]) / 2**20
                    row["version"] = int(r.hget(keys.trainer, "version") or 0)
                except Exception:  # noqa: BLE001 - the server is down (a fault): the next sample
                    r = None
                samples.append(row)
                if time.time() >= deadline and "stopped" not in state:
                    state["stopped"] = time.time()
                    print(f"[soak] {a.minutes} min up: SIGTERM to the driver (pid {p.pid})", flush=True)
                    os.kill(p.pid, signal.SIGTERM)

        state["t0"] = time.time()
        threading.Thread(target=sample, daemon=True).start()

    row = chaos_run("chaos-soak", steps=a.steps, seed=a.seed, gap=(a.min_gap, a.max_gap), runs_dir=a.runs_dir,
                    extra=["--trainer.eval_every", str(a.eval_every)], timeout_s=a.minutes * 60 + 3600,
                    on_start=on_start)
    bounded, ok_memory = judge_soak(samples)
    # The run was stopped, not finished: its verdict counts what is still in flight, and a pass is
    # lost 0, duplicated 0, unexpected 0 with worker memory and stream lengths as flat at the end
    # as at the start (see judge_soak).
    ok = row.get("lost") == 0 and row.get("duplicated") == 0 and row.get("unexpected") == 0 and ok_memory
    row["passed"] = ok
    return {"command": f"python bench/chaos.py soak --minutes {a.minutes}", "minutes": a.minutes,
            "run": row, "bounded": bounded, "samples": samples, "passed": ok}


SOAK_BOUND = 1.25
"""The last quarter's median over the first quarter's, at most, for worker memory and streams."""


def judge_soak(samples: list[dict]) -> tuple[dict, bool]:
    """Per quantity (worker memory summed, each stream's length, the server's used memory): the
    median and the peak of the first and the last quarter of the samples. Bounded: the last
    quarter's median at most ``SOAK_BOUND`` times the first's (a median, so one transient spike,
    a paused consumer's backlog say, does not decide; the peaks are reported beside it). The
    server's memory is reported, not judged: the ledger and the training log grow by one entry
    per prompt by design."""
    import statistics

    q = max(1, len(samples) // 4)

    def series(prefix: str) -> list[float]:
        return [sum(v for k, v in s.items() if k.startswith(prefix) and v is not None) for s in samples]

    out, ok = {}, True
    for what in ("rss_", "len_rollouts", "len_scored", "len_prompts", "server_used_mib"):
        v = series(what)
        first, last = v[:q], v[-q:]
        med0, med1 = statistics.median(first), statistics.median(last)
        ratio = round(med1 / med0, 3) if med0 else None
        out[what.rstrip("_")] = {"first_quarter_median": round(med0, 1), "last_quarter_median": round(med1, 1),
                                 "first_quarter_peak": round(max(first), 1), "last_quarter_peak": round(max(last), 1),
                                 "ratio": ratio}
        if what != "server_used_mib" and ratio is not None and ratio > SOAK_BOUND:
            ok = False
    return out, ok


def _resume_cell(r: dict) -> str:
    return f"{r['resume_s_median']:.1f} / {r['resume_s_max']:.1f}" if r.get("resume_s_median") is not None else "-"


def _resume_sentence(s: dict) -> str:
    if not s.get("trainer_resumes"):
        return ""
    return (f" The trainer resumed {s['trainer_resumes']} times (death -> next committed step): median "
            f"{s['resume_s_median']:.1f} s, longest {s['resume_s_max']:.1f} s.")


def render(res: dict) -> str:
    md = ["# Fault tolerance", "",
          "`bench/chaos.py`: `pipeline chaos` on the embedded default, faults injected by `pipeline inject` "
          "from outside the driver (SIGKILL of any worker, SIGSTOP for 8 s, SIGKILL of the server). A run passes "
          "when it finishes with lost 0, duplicated 0, unexpected 0.", ""]
    for key in sorted(k for k in res if k.startswith("seeds")):
        s = res[key]
        loaded = f", beside {s['load']} CPU burner(s)" if s.get("load") else ""
        md += [f"## Seeded runs{loaded}: {s['passed']} of {s['n']} passed",
               f"`{s['command']}`: a fault every {s['gap_s'][0]:g}-{s['gap_s'][1]:g} s, {s['steps']} steps, "
               f"{s['faults_total']} faults in all.{_resume_sentence(s)}", ""]
        md += [md_table(["seed", "passed", "faults", "by kind", "restarts", "server restarts", "issued", "lost",
                         "duplicated", "unexpected", "trainer resume (s) median / max", "wall (s)", "run"],
                        [[r["seed"], "yes" if r["passed"] else "NO", r.get("faults"),
                          ", ".join(f"{k} {v}" for k, v in sorted(r.get("by_kind", {}).items())), r.get("restarts"),
                          r.get("server_restarts"), r.get("issued"), r.get("lost"), r.get("duplicated"),
                          r.get("unexpected"), _resume_cell(r), r["wall_seconds"], f"`{r['run']}`"]
                         for r in s["runs"]]), ""]
    for key in sorted(k for k in res if k.startswith("rates")):
        s = res[key]
        best = s["highest_survived_per_min"]
        fail = s["first_failure"]
        loaded = f", beside {s['load']} CPU burner(s)" if s.get("load") else ""
        md += [f"## Fault rate survived{loaded}",
               f"`{s['command']}`: rising rates, one run each, until one fails. Highest rate survived: "
               f"**{best} faults/min** (gaps {s['highest_survived_gap_s']} s)." if best else "None survived.",
               (f"First failure at gaps {fail['gap_s']} s: status {fail.get('status')!r}, lost {fail.get('lost')}, "
                f"duplicated {fail.get('duplicated')}, exit code {fail.get('exit_code')}." if fail
                else "No rate tried failed.") + (f" {s['note']}" if s.get("note") else ""), ""]
        md += [md_table(["gaps (s)", "faults/min", "faults", "passed", "status", "lost", "duplicated",
                         "trainer resume (s) median / max", "wall (s)"],
                        [[f"{r['gap_s'][0]:g}-{r['gap_s'][1]:g}", r.get("faults_per_min"), r.get("faults"),
                          "yes" if r["passed"] else "NO", r.get("status"), r.get("lost"), r.get("duplicated"),
                          _resume_cell(r), r["wall_seconds"]] for r in s["runs"]]), ""]
    if s := res.get("soak"):
        r = s["run"]
        md += [f"## Soak: {s['minutes']} min, {'passed' if s['passed'] else 'FAILED'}",
               f"`{s['command']}`: {r.get('faults')} faults ({r.get('faults_per_min')}/min), "
               f"{r.get('steps')} steps, issued {r.get('issued')}, lost {r.get('lost')}, duplicated "
               f"{r.get('duplicated')}, unexpected {r.get('unexpected')}, in flight at the stop {r.get('in_flight')}. "
               f"Medians and peaks of the first and the last quarter of the samples (memory in MiB, summed over "
               f"workers); bounded when the last quarter's median is at most {SOAK_BOUND} times the first's "
               "(the server's memory is reported, not judged: the ledger and the training log grow by one entry "
               "per prompt by design):", ""]
        md += [md_table(["what", "first quarter median", "last quarter median", "ratio", "first quarter peak",
                         "last quarter peak"],
                        [[k, b["first_quarter_median"], b["last_quarter_median"], b["ratio"], b["first_quarter_peak"],
                          b["last_quarter_peak"]] for k, b in s["bounded"].items()]), ""]
        if s.get("note"):
            md += [s["note"], ""]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["seeds", "rates", "soak", "render"])
    p.add_argument("--seeds", default="0-9")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--min-gap", type=float, default=4.0)
    p.add_argument("--max-gap", type=float, default=10.0)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--sample-s", type=float, default=20.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "chaos-bench")
    p.add_argument("--load", type=int, default=0, help="CPU burners beside each run (chaos.load)")
    p.add_argument("--resume", action="store_true",
                   help="seeds: keep the runs the section already holds (same settings) and run only the others")
    a = p.parse_args(argv)
    if a.what == "soak" and a.steps == 80:
        a.steps = 1_000_000  # stopped by the clock, not by the step count
    res = json.loads(OUT.read_text()) if OUT.exists() else {}
    # Each setting its own section: seeds (idle, the default gaps), seeds-load2, seeds-gap1.5-4.5, ...
    key = a.what + (f"-load{a.load}" if a.load else "") + (
        f"-gap{a.min_gap:g}-{a.max_gap:g}" if a.what == "seeds" and (a.min_gap, a.max_gap) != (4.0, 10.0) else "")
    def save(part: dict) -> None:
        part["date"] = time.strftime("%Y-%m-%d")
        res[key] = part
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(res, indent=2) + "\n")

    if a.what == "seeds":
        earlier = res.get(key, {}) if a.resume else {}
        same = earlier.get("steps") == a.steps and earlier.get("load") == a.load
        save(run_seeds(a, done=[r for r in earlier.get("runs", []) if r.get("summary")] if same else None, save=save))
    elif a.what != "render":
        save({"rates": run_rates, "soak": run_soak}[a.what](a))
    OUT.with_suffix(".md").write_text(render(res))
    print(OUT.with_suffix(".md").read_text())
    if a.what == "seeds":
        return 0 if res[key]["passed"] == res[key]["n"] else 1
    return 0 if a.what == "render" or res[key].get("passed", res[key].get("highest_survived_per_min")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
