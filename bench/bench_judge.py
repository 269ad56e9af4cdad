"""LLM-judge throughput in process vs through the shared judge server, and a sanity AUC per style.

    python bench/bench_judge.py                                   # tiny random chat model only
    python bench/bench_judge.py --model artifacts/smollm2-135m-instruct --auc

For each model: judged completions per second of ``lm_judge`` in style ``direct`` on groups
of G completions (~24 tokens each, 2-term addition), median over ``--repeats`` repeats of
``--groups`` groups per client:

* ``in-process, 1 replica``: ``ChatJudge.score`` (what ``lm_judge:<dir>`` runs), one group per call;
* ``in-process, 2 replicas``: two processes, each with its own copy of the model, at once;
* ``server, 1 client`` / ``server, 2 clients``: ``pipeline judge-serve`` in its own process
  (max_batch 64, window 20 ms) and one or two concurrent clients (``lm_judge:ipc://...``);
  the server's forwards per request are reported too.

``--auc``: P(yes) per style on 20 clearly right and 20 clearly wrong answers to 2-term
addition problems (the wrong ones off by 11-59), and the AUC of P(yes) for right vs wrong.

Writes ``bench/results/judge.json`` and ``judge.md``, with the machine's core count and its
load average before and after (this benchmark shares the machine).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

from common import progress, save_result  # noqa: E402

say = progress("bench-judge")


def groups_of(n: int, g: int, *, seed: int) -> list[tuple[str, list[str]]]:
    """``n`` (prompt, G completions) of 2-term addition, completions of ~24 tokens, some right."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(100, 999)
        comps = []
        for _ in range(g):
            s = a + b + (0 if rng.random() < 0.5 else rng.choice([-10, -1, 1, 9, 100]))
            comps.append(f"Adding {a} and {b} gives {s}, so the answer is {s}.")
        out.append((f" {a}+{b}=", comps))
    return out


def _rate(completions: int, seconds: float) -> float:
    return completions / seconds if seconds > 0 else float("nan")


def in_process(directory: str, groups: list, repeats: int, style: str = "direct") -> dict:
    from pipeline.verifiers.kinds.lm_judge import ChatJudge

    j = ChatJudge(directory)
    j.score(style, *groups[0])  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for prompt, comps in groups:
            j.score(style, prompt, comps)
        rates.append(_rate(sum(len(c) for _, c in groups), time.perf_counter() - t0))
    return {"rates": rates, "median": statistics.median(rates)}


def _replica(directory: str, groups: list, repeats: int, barrier, out, threads: int, style: str) -> None:
    import torch

    from pipeline.verifiers.kinds.lm_judge import ChatJudge

    torch.set_num_threads(threads)

    j = ChatJudge(directory)
    j.score(style, *groups[0])
    for _ in range(repeats):
        barrier.wait()
        t0 = time.perf_counter()
        for prompt, comps in groups:
            j.score(style, prompt, comps)
        out.put(time.perf_counter() - t0)
        barrier.wait()


def in_process_replicas(directory: str, groups: list, repeats: int, threads: int, replicas: int = 2,
                        style: str = "direct") -> dict:
    """``replicas`` processes, each with its own model; aggregate rate per repeat."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(replicas + 1), ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(directory, groups, repeats, barrier, out, threads, style))
             for _ in range(replicas)]
    for p in procs:
        p.start()
    rates = []
    n = sum(len(c) for _, c in groups)
    for _ in range(repeats):
        barrier.wait()
        t0 = time.perf_counter()
        barrier.wait()
        wall = time.perf_counter() - t0
        for _ in range(replicas):
            out.get()
        rates.append(_rate(replicas * n, wall))
    for p in procs:
        p.join(60)
    return {"rates": rates, "median": statistics.median(rates)}


def start_server(directory: str, endpoint: str, *, max_batch: int, window_ms: float,
                 threads: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.verifiers.judge_server", directory, "--endpoint",
                             endpoint, "--max-batch", str(max_batch), "--window-ms", str(window_ms),
                             "--threads", str(threads)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    if not line.startswith("judge server ready"):
        proc.kill()
        raise RuntimeError(f"judge server did not start: {line}{proc.stdout.read()}")
    return proc


def through_server(endpoint: str, groups: list, repeats: int, clients: int, style: str = "direct") -> dict:
    from pipeline.verifiers.judge_server import JudgeClient

    cs = [JudgeClient(endpoint, timeout_s=600) for _ in range(clients)]
    cs[0].score(style, *groups[0])  # warm-up
    rates, per_request = [], []
    n = sum(len(c) for _, c in groups)
    for _ in range(repeats):
        before = cs[0].info()
        barrier = threading.Barrier(clients)

        def work(c) -> None:
            barrier.wait()
            for prompt, comps in groups:
                c.score(style, prompt, comps)

        threads = [threading.Thread(target=work, args=(c,)) for c in cs]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rates.append(_rate(clients * n, time.perf_counter() - t0))
        after = cs[0].info()
        per_request.append((after["forwards"] - before["forwards"]) / max(1, after["requests"] - before["requests"]))
    for c in cs:
        c.close()
    return {"rates": rates, "median": statistics.median(rates), "forwards_per_request": statistics.median(per_request)}


def auc(pos: list[float], neg: list[float]) -> float:
    """P(score of a right answer > score of a wrong one), ties counted half (Mann-Whitney)."""
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def sanity_auc(directory: str, *, n: int = 20, seed: int = 1, extra_styles: tuple[str, ...] = ()) -> dict:
    from pipeline.verifiers.kinds.lm_judge import STYLES, ChatJudge

    rng = random.Random(seed)
    problems = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)]
    wrong_of = {(a, b): a + b + rng.choice([-1, 1]) * rng.randint(11, 59) for a, b in problems}
    j = ChatJudge(directory)
    out = {}
    for form, make_prompt in (("task prompt ' a+b='", lambda a, b: f" {a}+{b}="),
                              ("question 'What is a + b?'", lambda a, b: f"What is {a} + {b}?")):
        rows = {}
        for style in [*STYLES, *(x for x in extra_styles if x not in STYLES)]:
            right, wrong = [], []
            for a, b in problems:
                p = j.score(style, make_prompt(a, b), [f"The answer is {a + b}.", f"The answer is {wrong_of[a, b]}."])
                right.append(float(p[0]))
                wrong.append(float(p[1]))
            rows[style] = {"auc": auc(right, wrong), "mean_p_right": float(np.mean(right)),
                           "mean_p_wrong": float(np.mean(wrong))}
            say(f"  AUC {form} {style}: {rows[style]['auc']:.3f}")
        out[form] = rows
    return out


def bench_model(name: str, directory: str, *, g: int, groups: int, repeats: int, replicas: bool,
                threads: int, server_threads: int | None = None, styles: tuple[str, ...] = ("direct",)) -> dict:
    from transformers import AutoTokenizer

    gs = groups_of(groups, g, seed=0)
    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    comp_tokens = statistics.mean(len(tok.encode(c, add_special_tokens=False)) for _, cs in gs for c in cs)
    res: dict = {"model": name, "directory": directory, "group_size": g, "groups_per_client": groups,
                 "repeats": repeats, "completion_tokens_mean": round(comp_tokens, 1), "styles": {}}
    for style in styles:
        rows = res["styles"][style] = {}
        say(f"{name} @{style}: in process")
        rows["in_process_1"] = in_process(directory, gs, repeats, style)
        if replicas:
            say(f"{name} @{style}: 2 in-process replicas")
            rows["in_process_2"] = in_process_replicas(directory, gs, repeats, threads, style=style)
        with tempfile.TemporaryDirectory() as tmp:
            endpoint = f"ipc://{tmp}/judge.sock"
            proc = start_server(directory, endpoint, max_batch=64, window_ms=20, threads=threads)
            try:
                for clients in (1, 2):
                    say(f"{name} @{style}: server, {clients} client(s)")
                    rows[f"server_{clients}"] = through_server(endpoint, gs, repeats, clients, style)
            finally:
                proc.terminate()
                proc.wait(30)
            if server_threads and server_threads != threads:
                proc = start_server(directory, endpoint, max_batch=64, window_ms=20, threads=server_threads)
                try:
                    say(f"{name} @{style}: server with {server_threads} threads, 2 clients")
                    rows["server_2_threads"] = {**through_server(endpoint, gs, repeats, 2, style),
                                                "threads": server_threads}
                finally:
                    proc.terminate()
                    proc.wait(30)
    return res


LABELS = {"in_process_1": "in process, 1 replica", "in_process_2": "in process, 2 replicas (2 model copies)",
          "server_1": "server, 1 client", "server_2": "server, 2 concurrent clients",
          "server_2_threads": "server with --server-threads, 2 concurrent clients"}


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# LLM judge throughput", "",
             f"`{result['command']}` on {m['cpus']} CPUs, torch {m['torch']} ({m['torch_threads']} thread(s) per "
             "judging process), "
             f"{m['started']}; 1-minute load average {m['load_before']:.1f} before and {m['load_after']:.1f} after "
             "(the machine is shared with other jobs: compare rows of one run, not absolute numbers).", "",
             "Judged completions per second of each style (yes/no: P(yes) of one question per completion; "
             "likelihood: P(the judge states the completion's answer), the group's context run once), median "
             "of the repeats; the server is `pipeline judge-serve` (max_batch 64, window 20 ms) in its own "
             "process.", "",
             "| model | style | completion tokens | G | setup | completions/s | repeats | server forwards / request |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["models"]:
        for style, rows in r.get("styles", {"direct": r}).items():
            for key, label in LABELS.items():
                if key in rows:
                    x = rows[key]
                    fpr = f"{x['forwards_per_request']:.2f}" if "forwards_per_request" in x else ""
                    lines.append(f"| {r['model']} | `{style}` | {r['completion_tokens_mean']} | {r['group_size']} | "
                                 f"{label} | {x['median']:.1f} | {', '.join(f'{v:.1f}' for v in x['rates'])} | "
                                 f"{fpr} |")
    if result.get("auc"):
        lines += ["", f"## Sanity: the score on 20 right vs 20 wrong 2-term additions ({result['auc']['model']})", "",
                  "Completions `The answer is <sum>.` vs `The answer is <sum ± 11..59>.`; AUC of the score "
                  "(P(yes), or P(answer) for a likelihood style; 0.5 = chance), and its mean on the right and the "
                  "wrong answers.", "",
                  "| prompt | style | AUC | mean score right | mean score wrong |", "|---|---|---|---|---|"]
        for form, rows in result["auc"]["forms"].items():
            for style, x in rows.items():
                lines.append(f"| {form} | `{style}` | {x['auc']:.3f} | {x['mean_p_right']:.3f} | "
                             f"{x['mean_p_wrong']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=[],
                   help="HF chat checkpoint directory to measure beside the tiny model (repeatable)")
    p.add_argument("--auc", action="store_true", help="also the right-vs-wrong AUC per style of each --model")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups", type=int, default=20, help="groups per client per repeat, tiny model")
    p.add_argument("--model-groups", type=int, default=3, help="groups per client per repeat, --model")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model-repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of every judging process (default 1, as the project's stages on a shared CPU)")
    p.add_argument("--server-threads", type=int, default=None,
                   help="also measure 2 clients against a server with this many torch threads")
    p.add_argument("--no-replicas", action="store_true", help="skip the 2 in-process replicas")
    p.add_argument("--style", action="append", default=[],
                   help="a judge style or style file to measure (repeatable; default: direct)")
    p.add_argument("--out", default=str(RESULTS / "judge.json"))
    args = p.parse_args(argv)
    styles = tuple(args.style) or ("direct",)

    import torch

    from pipeline.verifiers.judge_fixtures import write_tiny_chat_model

    torch.set_num_threads(args.threads)

    result = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                          "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                          "load_before": os.getloadavg()[0]}, "models": []}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(write_tiny_chat_model(Path(tmp) / "tiny-chat"))
        result["models"].append(bench_model("tiny random Llama (judge_fixtures)", tiny, g=args.group_size,
                                            groups=args.groups, repeats=args.repeats,
                                            replicas=not args.no_replicas, threads=args.threads,
                                            server_threads=args.server_threads, styles=styles))
    for d in args.model:
        result["models"].append(bench_model(Path(d).name, d, g=args.group_size, groups=args.model_groups,
                                            repeats=args.model_repeats, replicas=not args.no_replicas,
                                            threads=args.threads, server_threads=args.server_threads,
                                            styles=styles))
        if args.auc:
            say(f"{d}: sanity AUC")
            result["auc"] = {"model": Path(d).name, "forms": sanity_auc(d, extra_styles=styles)}
    result["machine"]["load_after"] = os.getloadavg()[0]
    save_result(args.out, result, script="bench/bench_judge.py", argv=argv)
    Path(args.out).with_suffix(".md").write_text(markdown(result))
    say(f"wrote {args.out} and {Path(args.out).with_suffix('.md')}")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
