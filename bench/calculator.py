"""The calculator experiment: RL teaches the tiny model to call a tool for a task it cannot do unaided.

The task is 4-digit multiplication (``1234*5678=``), which the ~1M-parameter character
model does not learn to answer directly in a short warm-up. The base is a cold start
(pipeline.model.tool_warmup): a fresh model teacher-forced on a mixture where a share
``--tool-rate`` of the problems is a two-turn calculator episode (the call, the tool's
answer with no loss, the copied answer) and the rest a direct answer, so it knows the call
format but rarely uses it. The task's held-out problems are kept out of the warm-up.

Then, once per seed, `pipeline up` trains it with the calculator environment
(``env.kind = "calculator"``) and the environment's reward (1 when the final answer is
right), the seed set in ``trainer.seed``, ``feeder.seed`` and ``generator.seed``. The
trainer evaluates the held-out problems as greedy episodes through the calculator
(pipeline.engines.episodes): ``heldout_accuracy`` is task success, ``heldout_tool_call_rate``
the share of episodes with a call. The base is also measured unaided (single-turn greedy
answers, no tool).

Reports per seed and as median and range: held-out success and tool-call rate of the base
and at the end (mean of the last three evaluations), both curves over training (held-out,
and the sampled training episodes' reward and tool-call rate per step).

    python bench/calculator.py                        # seeds 0,1,2
    python bench/calculator.py --seeds 0 --steps 20   # a quick look
    python bench/calculator.py --reuse                # re-read the runs named in calculator.json

Writes bench/results/calculator.json, calculator.md and calculator.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from pipeline_runs import RESULTS, ROOT, accounting_of, md_table, plot_episode_curves, read_run, run_up, step_series

DIGITS, OPS = 4, ("*",)
MAX_NEW_TOKENS = 32
"""Call (10) + eos + the tool's answer (up to 8) + the copied answer (8) + eos, with room."""
MAX_TURNS = 3


def task_config(heldout_size: int):
    from pipeline.config import TaskConfig

    return TaskConfig(kind="arithmetic", digits=DIGITS, ops=OPS, heldout_size=heldout_size,
                      max_new_tokens=MAX_NEW_TOKENS)


def build_base(out: Path, *, heldout_size: int, tool_rate: float, steps: int, batch_size: int) -> dict:
    """The cold-start base (reused when ``out`` holds one built from the same recipe)."""
    from pipeline.model.tool_warmup import warm_up_tool_use
    from pipeline.tasks import arithmetic as task

    cfg = task_config(heldout_size)
    want = {"digits": DIGITS, "ops": list(OPS), "tool_rate": tool_rate, "steps": steps, "batch_size": batch_size,
            "seed": 0, "heldout_excluded": heldout_size}
    rec = out / "tool_warmup.json"
    if rec.is_file():
        info = json.loads(rec.read_text())
        if {k: info.get(k) for k in want} == want:
            print(f"[base] reusing {out}", flush=True)
            return info
    held = task.heldout_problems(n=cfg.heldout_size, seed=cfg.heldout_seed, digits=DIGITS, ops=OPS)
    return warm_up_tool_use(out, heldout=held, digits=DIGITS, ops=OPS, tool_rate=tool_rate, steps=steps,
                            batch_size=batch_size, seed=0, log=lambda s: print(f"[base] {s}", flush=True))


def measure_base(base: Path, *, heldout_size: int) -> dict:
    """The base on the held-out problems: unaided (single-turn greedy), greedy episodes with the
    calculator, and sampled episodes (temperature 1, seed 0) with it."""
    import torch

    from pipeline.engines.torch import greedy_decode
    from pipeline.envs.calculator import calculator
    from pipeline.engines.episodes import play, summarise
    from pipeline.model.qwen import load_checkpoint
    from pipeline.tasks.arithmetic import ArithmeticTask

    t = ArithmeticTask(task_config(heldout_size))
    items = t.heldout()
    model, tok = load_checkpoint(base)
    model.eval()
    prompts = [np.asarray(tok.encode(i.prompt), dtype=np.int32) for i in items]
    refs = [i.reference for i in items]
    answers = greedy_decode(model, tok, prompts, max_new_tokens=t.eval_max_new_tokens)
    unaided = float(np.mean([t.correctness(i.reference, [a])[0] for i, a in zip(items, answers)]))
    greedy = summarise(play(model, tok, prompts, refs, calculator(None), max_turns=MAX_TURNS,
                            max_new_tokens=MAX_NEW_TOKENS))
    sampled = summarise(play(model, tok, prompts, refs, calculator(None), max_turns=MAX_TURNS,
                             max_new_tokens=MAX_NEW_TOKENS, temperature=1.0,
                             generator=torch.Generator().manual_seed(0)))
    return {"unaided": unaided, "greedy": greedy, "sampled": sampled}


def overrides(base: Path, *, seed: int, steps: int, heldout_size: int, eval_every: int) -> dict:
    return {"model.base_dir": base, "task.digits": DIGITS, "task.ops": ",".join(OPS), "task.heldout_size": heldout_size,
            "task.max_new_tokens": MAX_NEW_TOKENS, "env.kind": "calculator", "env.max_turns": MAX_TURNS,
            "generator.swap": "step", "verifier.reward": "environment", "trainer.steps": steps,
            "trainer.eval_every": eval_every, "trainer.seed": seed, "feeder.seed": seed, "generator.seed": seed}


def summarize_run(run_dir: Path, seed: int) -> dict:
    run = read_run(run_dir)
    ev = sorted(run["evals"], key=lambda e: e["version"])
    acc = [e["heldout_accuracy"] for e in ev]
    rate = [e["heldout_tool_call_rate"] for e in ev]
    train_versions, train_reward = step_series(run, "env_reward_mean")
    s = run["summary"]
    return {
        "seed": seed, "run": str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else str(run_dir),
        "base": acc[0], "final": float(np.mean(acc[-3:])),
        "base_tool_call_rate": rate[0], "final_tool_call_rate": float(np.mean(rate[-3:])),
        "versions": [e["version"] for e in ev], "heldout_accuracy": acc, "heldout_tool_call_rate": rate,
        "train_versions": train_versions, "train_env_reward": train_reward,
        "train_tool_call_rate": step_series(run, "tool_call_rate")[1],
        "steps": s.get("steps"), "wall_s": s.get("wall_seconds"),
        "accounting": accounting_of(s),
    }


def plot(res: dict, path: Path) -> None:
    def base_line(axes) -> None:
        axes[0].axhline(res["base"]["unaided"], color="grey", ls=":", label="base, unaided (no tool)")

    plot_episode_curves(res["runs"], path, [
        ("heldout_accuracy", "train_env_reward", "task success (4-digit multiplication)", "success", (0, 1)),
        ("heldout_tool_call_rate", "train_tool_call_rate", "tool-call rate (episodes with a calculator call)", "rate",
         (0, 1))], guide=base_line)


def report(res: dict) -> str:
    rows = [[r["seed"], f"{r['base']:.3f}", f"{r['final']:.3f}", f"{100 * (r['final'] - r['base']):+.1f}",
             f"{r['base_tool_call_rate']:.3f}", f"{r['final_tool_call_rate']:.3f}", r["steps"],
             f"{r['wall_s']:.0f}" if r.get("wall_s") else "—",
             "lost {lost}, duplicated {duplicated}, unexpected {unexpected}".format(**r["accounting"])]
            for r in res["runs"]]
    table = md_table(["seed", "held-out success, base", "final (last 3 evals)", "gain (points)",
                      "tool-call rate, base", "final", "steps", "wall (s)", "accounting"], rows)
    g, b = res["gain_points"], res["base"]
    w = res["warmup"]
    return (
        "# The calculator experiment: RL teaches a tool call\n\n"
        f"Reproduce: `{res['command']}` ({res['date']}; {res['n']} seeds from the same base).\n\n"
        f"Task: 4-digit multiplication, {res['heldout_size']} held-out problems, never trained on (nor in the "
        f"warm-up). Base: a fresh ~1M-parameter character model warmed up for {w['steps']} steps × "
        f"{w['batch_size']} on a mixture with {w['tool_rate']:.0%} calculator transcripts "
        "(pipeline/model/tool_warmup.py). RL: `pipeline up` with `env.kind = \"calculator\"`, the environment's "
        f"reward, {res['steps']} steps; the held-out episodes are greedy, through the calculator.\n\n"
        f"Base, unaided (single-turn greedy, no tool): **{b['unaided']:.3f}**. Base with the calculator: greedy "
        f"success {b['greedy']['heldout_accuracy']:.3f} (tool-call rate {b['greedy']['heldout_tool_call_rate']:.3f}); "
        f"sampled at temperature 1, success {b['sampled']['heldout_accuracy']:.3f} (tool-call rate "
        f"{b['sampled']['heldout_tool_call_rate']:.3f}).\n\n"
        f"Held-out success gain: median **{g['median']:+.1f}** points (range {g['min']:+.1f} to {g['max']:+.1f}); "
        f"tool-call rate {res['tool_call_rate']['base_median']:.3f} → median {res['tool_call_rate']['final_median']:.3f} "
        f"(range {res['tool_call_rate']['final_min']:.3f} to {res['tool_call_rate']['final_max']:.3f}).\n\n"
        + table + "\n![success and tool-call rate over training](calculator.png)\n\n"
        "Left: held-out success (greedy episodes, markers) and the sampled training episodes' reward (dashed, "
        "smoothed over 10 steps). Right: the share of episodes with a calculator call, the same two ways.\n"
    )


def aggregate(runs: list[dict], base: dict, info: dict, a) -> dict:
    gains = [100 * (r["final"] - r["base"]) for r in runs]
    rates = [r["final_tool_call_rate"] for r in runs]
    cmd = f"python bench/calculator.py --seeds {','.join(str(r['seed']) for r in runs)} --steps {a.steps}"
    return {"n": len(runs), "runs": runs, "base": base, "warmup": info, "steps": a.steps,
            "heldout_size": a.heldout_size, "command": cmd, "date": time.strftime("%Y-%m-%d"),
            "gain_points": {"median": statistics.median(gains), "min": min(gains), "max": max(gains)},
            "tool_call_rate": {"base_median": statistics.median(r["base_tool_call_rate"] for r in runs),
                               "final_median": statistics.median(rates), "final_min": min(rates),
                               "final_max": max(rates)}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=40, help="trainer.steps of each RL run")
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--heldout-size", type=int, default=300)
    p.add_argument("--tool-rate", type=float, default=0.3, help="share of calculator transcripts in the warm-up")
    p.add_argument("--warmup-steps", type=int, default=500)
    p.add_argument("--warmup-batch", type=int, default=64)
    p.add_argument("--base-dir", default="artifacts/calculator-base")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--reuse", action="store_true", help="re-read the runs named in calculator.json")
    p.add_argument("--out", default=str(RESULTS / "calculator.json"))
    a = p.parse_args(argv)
    out = Path(a.out)
    base_dir = ROOT / a.base_dir
    info = build_base(base_dir, heldout_size=a.heldout_size, tool_rate=a.tool_rate, steps=a.warmup_steps,
                      batch_size=a.warmup_batch)
    base = measure_base(base_dir, heldout_size=a.heldout_size)
    print(f"[base] unaided {base['unaided']:.3f}; with the calculator: greedy {base['greedy']}, "
          f"sampled {base['sampled']}", flush=True)
    if a.reuse:
        named = {r["seed"]: ROOT / r["run"] for r in json.loads(out.read_text())["runs"]}
    else:
        named = {}
        for seed in [int(x) for x in a.seeds.split(",") if x]:
            named[seed] = run_up(f"calc-s{seed}", overrides(base_dir, seed=seed, steps=a.steps,
                                                            heldout_size=a.heldout_size, eval_every=a.eval_every),
                                 runs_dir=ROOT / a.runs_dir)
    runs = [summarize_run(d, s) for s, d in sorted(named.items())]
    res = aggregate(runs, base, info, a)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out.with_suffix(".png"))
    out.with_suffix(".md").write_text(report(res))
    print(out.with_suffix(".md").read_text())
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
