"""A text game of someone else's, trained for real: SmolLM2-135M-Instruct learns Number Hunt
over OpenEnv through the pipeline.

The game (``examples/number_hunt``) is an OpenEnv environment written from OpenEnv's own
template (``openenv init``), importing nothing from the ``pipeline`` package: a hidden
number from 1 to 10 drawn from the episode's seed, four guesses, "Higher." or "Lower." after
each, reward 1 for the right number. Without the feedback at most 40% of the games can be
won. This script copies it outside the repository (``--game-dir``) and names it in config
alone: ``env.kind = "openenv:<copy>/server/app.py:app"``; each generator starts and stops
its server.

Per seed, `pipeline up` trains the imported SmolLM2-135M-Instruct with the environment's
reward (GRPO, group of 8, the same seed in ``trainer.seed``, ``feeder.seed`` and
``generator.seed``). The trainer evaluates held-out games as greedy episodes through the
same server: their seeds come from the ids ``heldout-<i>`` (pipeline.envs.base.episode_seed
with run seed 0), which no training prompt has, so every seed is measured on the same 100
games and none is trained on. Reports per seed and as median and range: held-out success
and turns per episode at the base (version 0) and at the end (mean of the last three
evaluations), the curves, the accounting, and whether any game server outlived its run.

    python bench/game.py                    # seeds 0,1,2 (needs the openenv extra: its lane's venv)
    python bench/game.py --seeds 0 --steps 6
    python bench/game.py --resume           # keep the runs in game.json, run the missing seeds (a seed's
                                            # run killed with its driver continues: `pipeline up --resume`)
    python bench/game.py --resume --redo 0 --why "..."   # run seed 0 again; the old record stays, marked
    python bench/game.py --resume --hours 2  # stop cleanly after 2 h (a session's or a job's end); --resume goes on
                                            # (a fresh seed starts only if a kept seed's wall time fits)

Writes bench/results/game.json, game.md and game.png (each seed's result as it lands).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pipeline.run.resume import previous_status
from pipeline_runs import (RESULTS, ROOT, STOPPED_SHORT, DeadlineReached, RunFailed, accounting_of, deadline_of,
                           md_table, plot_episode_curves, read_run, run_up, step_series, unfinished_run)

GAME = ROOT / "examples" / "number_hunt"
PROMPT = "Let us play a guessing game. Answer every time with a single number and nothing else."
MAX_TURNS = 4
MAX_NEW_TOKENS = 128
"""The whole episode's budget: the rules (~40 tokens), four short replies and three answers with their turn
markers (~12 tokens each); a reply that rambles runs out of it unrewarded."""
PROMPT_ROWS = 400
EVAL_EVERY = 5
"""Steps between held-out evaluations (``--eval-every``)."""


def copy_game(dest: Path) -> Path:
    """The game copied to ``dest/number_hunt`` (outside this repository), with the prompt file
    beside it: rows of one instruction (the game ignores the prompt; it states its rules)."""
    dest = dest.resolve()
    if dest.is_relative_to(ROOT):
        raise SystemExit(f"--game-dir {dest} is inside the repository; the game must be run from outside it")
    game = dest / "number_hunt"
    if game.exists():
        shutil.rmtree(game)
    shutil.copytree(GAME, game, ignore=shutil.ignore_patterns("__pycache__"))
    rows = dest / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"problem": PROMPT, "answer": "1"}) + "\n" for _ in range(PROMPT_ROWS)))
    return game


def overrides(game: Path, *, seed: int, steps: int, heldout_size: int, eval_every: int, lr: float,
              max_new_tokens: int = MAX_NEW_TOKENS, max_turn_tokens: int = 0) -> dict:
    return {"model.base_dir": ROOT / "artifacts" / "smollm2-135m-instruct", "task.kind": "math",
            "task.dataset": game.parent / "prompts.jsonl", "task.heldout_size": heldout_size,
            "task.max_new_tokens": max_new_tokens, "env.kind": f"openenv:{game}/server/app.py:app",
            "env.max_turns": MAX_TURNS, "generator.swap": "step", "verifier.reward": "environment",
            "generator.prompts_per_batch": 8, "trainer.groups_per_step": 8, "trainer.lr": lr,
            "trainer.warmup_steps": 0, "trainer.threads": 1, "trainer.steps": steps, "trainer.eval_every": eval_every,
            # A checkpoint every step: a run killed part-way (a session's end) and continued with
            # --resume then loses no update (configuration A and B's seed 0 ran with 10).
            "trainer.checkpoint_every": 1, "cluster.generators": 1, "cluster.verifiers": 1,
            # The trainer's forward and backward in pieces (SmolLM2's 49k-word logits over 64
            # episodes of ~170 tokens took 19 GB in one pass and were killed on a 24 GB machine),
            # and room for the evaluations (100 games, ~2-3 min each on two busy cores): 6 minutes a step.
            "trainer.max_tokens_per_microbatch": 2048, "cluster.timeout_s": max(1800, 360 * steps),
            "trainer.seed": seed, "feeder.seed": seed, "generator.seed": seed,
            **({"env.max_turn_tokens": max_turn_tokens} if max_turn_tokens else {})}


def servers_left(game: Path) -> list[str]:
    """Processes still serving the game (none should outlive the run)."""
    out = subprocess.run(["pgrep", "-af", str(game)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def summarize_run(run_dir: Path, seed: int, left: list[str]) -> dict:
    run = read_run(run_dir)
    ev = sorted(run["evals"], key=lambda e: e["version"])
    acc = [e["heldout_accuracy"] for e in ev]
    turns = [e["heldout_turns_mean"] for e in ev]
    s = run["summary"]
    train_versions, train_reward = step_series(run, "env_reward_mean")
    return {
        "seed": seed, "run": str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else str(run_dir),
        "base": acc[0], "final": float(np.mean(acc[-3:])), "base_turns": turns[0],
        "final_turns": float(np.mean(turns[-3:])), "versions": [e["version"] for e in ev],
        "heldout_success": acc, "heldout_turns": turns, "heldout_env_errors": [e.get("heldout_env_errors") for e in ev],
        "train_versions": train_versions, "train_env_reward": train_reward,
        "train_turns": step_series(run, "turns_mean")[1],
        "steps": s.get("steps"), "wall_s": s.get("wall_seconds_total", s.get("wall_seconds")), "servers_left": left,
        "status": s.get("status"),
        "restarts": s.get("restarts"), "resumes": s.get("driver_resumes", 0),
        "versions_lost": s.get("versions_lost_in_crashes", 0),
        "accounting": accounting_of(s),
    }


def plot(res: dict, path: Path) -> None:
    def no_feedback(axes) -> None:
        axes[0].axhline(0.4, color="grey", ls=":", label="the most a player can win without the feedback")

    plot_episode_curves(res["runs"], path, [
        ("heldout_success", "train_env_reward", "Number Hunt: games won", "success", (0, 1)),
        ("heldout_turns", "train_turns", "turns per episode", "turns", (0, MAX_TURNS + 0.2))],
        smoothing=5, guide=no_feedback)


def plan_key(a) -> list:
    """What a kept run must have been run with to count for these arguments (``--resume``)."""
    key = [a.steps, a.lr]
    if (a.max_new_tokens, a.max_turn_tokens) != (MAX_NEW_TOKENS, 0):
        key += [a.max_new_tokens, a.max_turn_tokens]
    if a.eval_every != EVAL_EVERY:
        key += [{"eval_every": a.eval_every}]
    return key


def aggregate(runs: list[dict], a, earlier: list[dict] = ()) -> dict:
    gains = [100 * (r["final"] - r["base"]) for r in runs]
    seeds = ",".join(str(r["seed"]) for r in runs)
    extra = "" if (a.max_new_tokens, a.max_turn_tokens) == (MAX_NEW_TOKENS, 0) else \
        f" --max-new-tokens {a.max_new_tokens} --max-turn-tokens {a.max_turn_tokens}"
    if a.eval_every != EVAL_EVERY:
        extra += f" --eval-every {a.eval_every}"
    out = Path(a.out).resolve()
    if out != RESULTS / "game.json":
        extra += f" --out {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}"
    return {"n": len(runs), "runs": runs, "steps": a.steps, "heldout_size": a.heldout_size, "lr": a.lr,
            "max_new_tokens": a.max_new_tokens, "max_turn_tokens": a.max_turn_tokens,
            "eval_every": a.eval_every, "command": f"python bench/game.py --seeds {seeds} --steps {a.steps}{extra}",
            "resume_command": f"python bench/game.py --steps {a.steps}{extra} --resume",
            "figure": out.with_suffix(".png").name,
            "date": time.strftime("%Y-%m-%d"),
            "gain_points": {"median": statistics.median(gains), "min": min(gains), "max": max(gains)},
            "final": {"median": statistics.median(r["final"] for r in runs)},
            "base": {"median": statistics.median(r["base"] for r in runs)}, "earlier": list(earlier)}


def report(res: dict) -> str:
    rows = [[r["seed"] if r.get("status") == "finished" else f"{r['seed']} ({r.get('status')})", f"{r['base']:.3f}",
             f"{r['final']:.3f}", f"{100 * (r['final'] - r['base']):+.1f}",
             f"{r['base_turns']:.2f}", f"{r['final_turns']:.2f}", r["steps"],
             f"{r['wall_s']:.0f}" if r.get("wall_s") else "—",
             f"{r.get('restarts', '—')}" + (f" (resumed {r['resumes']}x)" if r.get("resumes") else ""),
             "lost {lost}, duplicated {duplicated}, unexpected {unexpected}".format(**r["accounting"]),
             len(r["servers_left"])] for r in res["runs"]]
    table = md_table(["seed", "held-out success, base", "final (last 3 evals)", "gain (points)", "turns, base",
                      "turns, final", "steps", "wall (s)", "worker restarts", "accounting", "servers left"], rows)
    g = res["gain_points"]
    return (
        "# A text game trained for real: SmolLM2-135M-Instruct on Number Hunt over OpenEnv\n\n"
        f"Reproduce: `{res['command']}` ({res['date']}; {res['n']} seed{'s' if res['n'] > 1 else ''} from the same "
        "imported checkpoint; "
        "run with the openenv extra installed, e.g. the openenv lane's venv).\n\n"
        "The game: `examples/number_hunt`, written from OpenEnv's template, copied outside the repository and "
        "named in config alone (`env.kind = \"openenv:<copy>/server/app.py:app\"`). A number from 1 to 10 from "
        f"the episode's seed, {MAX_TURNS} guesses, \"Higher.\"/\"Lower.\" after each, reward 1 for the right "
        "number; without the feedback at most 0.4 of the games can be won.\n\n"
        f"RL: `pipeline up`, the environment's reward, GRPO with groups of 8, 8 groups per step, lr {res['lr']}, "
        f"{res['steps']} steps; a completion's token budget (`task.max_new_tokens`, observations included) "
        f"{res.get('max_new_tokens', MAX_NEW_TOKENS)}, "
        + (f"a turn cut at {res['max_turn_tokens']} tokens (`env.max_turn_tokens`)" if res.get("max_turn_tokens")
           else "no per-turn limit") +
        f"; held-out: the same {res['heldout_size']} games for every seed (seeds from ids no "
        f"training prompt has), greedy, evaluated every {res['eval_every']} steps.\n\n"
        f"Held-out success gain: median **{g['median']:+.1f}** points (range {g['min']:+.1f} to {g['max']:+.1f}); "
        f"success {res['base']['median']:.3f} → median {res['final']['median']:.3f}.\n\n"
        + ("" if res["n"] >= 3 else f"Only {res['n']} of the three seeds so far: not yet a result "
           f"(`{res.get('resume_command', 'python bench/game.py --resume')}` runs the missing ones).\n\n")
        + table + f"\n![success and turns over training]({res.get('figure', 'game.png')})\n\n"
        "Left: held-out success (greedy, markers) and the sampled training episodes' reward (dashed, smoothed "
        "over 5 steps). Right: turns per episode, the same two ways. Servers left: game server processes alive "
        "after the run ended (`pgrep -f <game dir>`).\n"
        + earlier_section(res.get("earlier", []))
    )


def earlier_section(earlier: list[dict]) -> str:
    """The attempts a seed's counted run replaced (``--redo``), with the reason given: reported, not counted."""
    if not earlier:
        return ""
    rows = [[r["seed"], r.get("status", "—"), f"{r['base']:.3f}", f"{r['final']:.3f}",
             f"{100 * (r['final'] - r['base']):+.1f}", r["steps"], r.get("restarts", "—"), r.get("redo_why", "—")]
            for r in earlier]
    return ("\n## Earlier attempts (reported, not counted)\n\n"
            + md_table(["seed", "status", "base", "final", "gain (points)", "steps", "worker restarts",
                        "why run again"], rows) + "\n")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=20, help="trainer.steps of each RL run")
    p.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    p.add_argument("--heldout-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                   help="task.max_new_tokens: an episode's token budget, observations included")
    p.add_argument("--max-turn-tokens", type=int, default=0, help="env.max_turn_tokens (0: no per-turn limit)")
    p.add_argument("--game-dir", default=os.path.join(tempfile.gettempdir(), "rlpipe-number-hunt"),
                   help="where the game is copied (outside the repository)")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs in game.json and run only the missing seeds; a missing seed's run killed "
                        "with its driver (no summary) is continued from its checkpoint")
    p.add_argument("--redo", default="", metavar="SEEDS",
                   help="with --resume: run these seeds again; their kept records move to 'earlier' with --why")
    p.add_argument("--why", default="", help="why the --redo seeds run again (recorded and reported)")
    p.add_argument("--read", default="", metavar="SEED=RUN_DIR,...",
                   help="record these finished (or stopped) runs instead of running those seeds")
    p.add_argument("--out", default=str(RESULTS / "game.json"))
    p.add_argument("--hours", type=float, default=None,
                   help="stop after this long: the run in progress is stopped cleanly (as `pipeline down` stops "
                        "it) and --resume continues it; no new run starts after it, nor a new seed when less "
                        "time is left than a finished seed took")
    a = p.parse_args(argv)
    try:
        import openenv.core  # noqa: F401
    except ImportError:
        raise SystemExit("bench/game.py needs the openenv extra (pip install -e '.[openenv]', or the openenv "
                         "lane's venv: bash ops/ci/openenv_lane.sh install)") from None
    out = Path(a.out)
    deadline = deadline_of(a.hours)
    game = copy_game(Path(a.game_dir))
    runs, earlier = {}, []
    if a.resume and out.exists():
        old = json.loads(out.read_text())
        runs = {r["seed"]: r for r in old["runs"] if r.get("planned") == plan_key(a)}
        earlier = old.get("earlier", [])
    redo = {int(x) for x in a.redo.split(",") if x}
    if redo and not a.why:
        raise SystemExit("--redo needs --why: the reason a seed runs again is recorded next to its old result")
    for seed in sorted(redo & set(runs)):
        earlier.append({**runs.pop(seed), "redo_why": a.why})
    given = {int(k): Path(v) for k, v in (x.split("=", 1) for x in a.read.split(",") if x)}
    for seed in [int(x) for x in a.seeds.split(",") if x]:
        if seed in runs:
            print(f"[game-s{seed}] kept from {out.name}", flush=True)
            continue
        if seed in given:
            run_dir = given[seed]
        else:
            label = f"game-s{seed}"
            over = overrides(game, seed=seed, steps=a.steps, heldout_size=a.heldout_size, eval_every=a.eval_every,
                             lr=a.lr, max_new_tokens=a.max_new_tokens, max_turn_tokens=a.max_turn_tokens)
            # With --resume, a run of this seed killed with its driver (a session's end) goes on from its checkpoint.
            cont = unfinished_run(label, over, runs_dir=ROOT / a.runs_dir) if a.resume else None
            try:
                # A fresh seed is not started when the time left is shorter than a finished seed took.
                took = [r["wall_s"] for r in runs.values() if r.get("wall_s")]
                run_dir = run_up(label, over, runs_dir=ROOT / a.runs_dir, resume=cont, deadline=deadline,
                                 needs_s=min(took) if took else None)
            except DeadlineReached as e:
                print(f"[game-s{seed}] {e}: stopping here; rerun with --resume to go on", flush=True)
                break
            except RunFailed as e:  # a run that stopped early is kept, with its status, if it left a summary
                run_dir = e.run_dir
                # Not one stopped from outside (Ctrl-C, `pipeline down`): that one is continued by --resume.
                if previous_status(run_dir) in STOPPED_SHORT:
                    raise
                print(f"[game-s{seed}] {e}; recording it as it ended", flush=True)
            time.sleep(2)  # the generators stop their servers on the way out; give the last one a moment
        runs[seed] = summarize_run(run_dir, seed, servers_left(game))
        runs[seed]["planned"] = plan_key(a)
        res = aggregate([runs[s] for s in sorted(runs)], a, earlier)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2) + "\n")
        plot(res, out.with_suffix(".png"))
        out.with_suffix(".md").write_text(report(res))
        print(f"[game-s{seed}] base {runs[seed]['base']:.3f} -> final {runs[seed]['final']:.3f}", flush=True)
    if not runs:  # stopped at --hours before any seed finished
        return None
    res = aggregate([runs[s] for s in sorted(runs)], a, earlier)
    if out.with_suffix(".md").is_file():
        print(out.with_suffix(".md").read_text())
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
