"""``pipeline replay`` and ``pipeline diff``: a run's training re-executed from its rollout
archive, and the first step where two runs (or a run and its replay) part.

Replay builds the run's trainer engine from its base checkpoint with the run's config
(``<run_dir>/config.toml``: seeds, thread count, loss settings), checks the base's hash
against the one the run recorded, then trains on each archived step's groups, in the
order and with the outcomes the trainer gave them, and compares the weights' hash after
each step with the recorded one. On the machine and thread count the run used, every
step matches bit for bit; otherwise the first step that differs is reported, with the
step's recorded and replayed statistics side by side and, where the run still keeps that
step's checkpoint, the tensors that differ. ``--set trainer.clip_eps=0.1`` replays the
same batches under changed settings (a counterfactual: nothing to compare against, the
statistics and the final weights are the result). docs/reproducibility.md.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.common import archive as arc
from pipeline.config import ConfigError, RunConfig, load_config
from pipeline.engines import make_train_engine
from pipeline.records import ScoredGroup
from pipeline.tasks.prompting import build_prompt, prompt_format
from pipeline.tasks.registry import make_task

COMPARED_STATS = ("loss", "grad_norm", "tokens", "clip_frac", "entropy", "kl")
"""A step's statistics shown side by side when its hash differs (those the step rows carry)."""


class ReplayError(ValueError):
    """The run cannot be replayed (no archive, a missing step, another base): the message says why."""


@dataclass
class ReplayResult:
    run_dir: str
    steps: int = 0
    """Steps replayed."""
    matched: int = 0
    """Of those, the steps whose weights hash matched the recorded one (exact replays)."""
    first_mismatch: dict | None = None
    counterfactual: dict = field(default_factory=dict)
    """The settings changed (``--set``); empty for an exact replay."""
    final_hash: str = ""
    final_checkpoint: str | None = None
    """Whether the run's final checkpoint (checkpoints/final) holds the replayed weights: match, differs, absent."""
    heldout_accuracy: float | None = None
    seconds: float = 0.0
    out: str = ""

    @property
    def identical(self) -> bool:
        return not self.counterfactual and self.first_mismatch is None and self.steps > 0

    def to_dict(self) -> dict:
        return {"run_dir": self.run_dir, "steps": self.steps, "matched": self.matched, "identical": self.identical,
                "first_mismatch": self.first_mismatch, "counterfactual": self.counterfactual,
                "final_hash": self.final_hash, "final_checkpoint": self.final_checkpoint,
                "heldout_accuracy": self.heldout_accuracy, "seconds": round(self.seconds, 3), "out": self.out}


def read_groups(path: Path) -> tuple[list[ScoredGroup], list[str]]:
    """A segment's groups, exactly as the trainer took them, in training order, with their outcomes."""
    records, outcomes = arc.read_records(path)
    return [ScoredGroup.decode(r) for r in records], outcomes


def run_config(run_dir: Path, settings: dict[str, str] | None = None) -> RunConfig:
    path = run_dir / "config.toml"
    if not path.exists():
        raise ReplayError(f"{run_dir}: no config.toml (not a run directory `pipeline up` wrote)")
    try:
        return load_config(path, settings or {})
    except ConfigError as e:
        raise ReplayError(f"--set: {e}") from None


def step_rows(run_dir: Path) -> dict[int, dict]:
    """The run's step rows by version (the last row of a version: a step redone after a crash rewrites it)."""
    rows: dict[int, dict] = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if row.get("kind") == "step":
                rows[int(row["version"])] = row
    return rows


def plan(run_dir: Path) -> list[arc.StepMeta]:
    """The archive's steps, checked to form one line from the base."""
    directory = run_dir / arc.ARCHIVE_DIR
    if not directory.is_dir():
        raise ReplayError(f"{run_dir}: no archive ({arc.ARCHIVE_DIR}/); the run had trainer.archive off, or it is "
                          "not a run directory")
    metas = arc.steps(directory)
    if not metas:
        raise ReplayError(f"{directory}: no step was archived")
    if metas[0].parent != 0:
        raise ReplayError(f"{directory}: the archive starts at step {metas[0].step}; replay needs every step from the "
                          f"base, and step {metas[0].parent or 1} and those before it are gone "
                          "(trainer.archive_keep_steps)")
    problems = arc.lineage_problems(directory, metas)
    if problems:
        raise ReplayError(f"{directory}: the steps do not form one line from the base: " + "; ".join(problems))
    return metas


def _tensor_diff(ckpt: Path, weights: dict) -> list[dict]:
    """The tensors of ``weights`` that differ from the checkpoint's model, the largest differences first."""
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / "model.safetensors"))
    out = []
    for name, t in weights.items():
        if name in saved and not saved[name].equal(t.detach().cpu()):
            d = (saved[name].double() - t.detach().cpu().double()).abs()
            out.append({"tensor": name, "max_abs_diff": float(d.max()), "elements_differing": int((d > 0).sum())})
    return sorted(out, key=lambda x: -x["max_abs_diff"])[:10]


def _final_checkpoint(run_dir: Path, digest: str) -> str:
    from safetensors.torch import load_file

    from pipeline.engines.torch_state import weights_hash

    path = run_dir / "checkpoints" / "final" / "model.safetensors"
    if not path.exists():
        return "absent"
    return "match" if weights_hash(load_file(str(path))) == digest else "differs"


def replay(run_dir: str | Path, *, stop_at: int | None = None, out: str | Path | None = None,
           settings: dict[str, str] | None = None, evaluate: bool = False, progress=None) -> ReplayResult:
    """Re-run the trainer of ``run_dir`` on its archive (module docstring). ``stop_at``: stop after
    that step; ``out``: where the replay's rows, summary and (with ``stop_at`` or ``settings``)
    its final weights go (default ``<run_dir>/replay``); ``settings``: dotted config fields
    changed (a counterfactual); ``evaluate``: the held-out accuracy of the final weights."""
    from pipeline.consumers.trainer import classify, sort_step
    from pipeline.engines.torch_state import weights_hash

    run_dir = Path(run_dir)
    settings = dict(settings or {})
    cfg = run_config(run_dir, settings)
    metas = plan(run_dir)
    if stop_at is not None:
        if stop_at not in {m.step for m in metas}:
            raise ReplayError(f"--stop-at {stop_at}: not a step of the archive (steps {metas[0].step}..{metas[-1].step})")
        metas = [m for m in metas if m.step <= stop_at]
    out = Path(out) if out else run_dir / "replay"
    out.mkdir(parents=True, exist_ok=True)
    recorded_rows = step_rows(run_dir)
    res = ReplayResult(run_dir=str(run_dir), counterfactual=settings, out=str(out))
    t0 = time.perf_counter()
    recorded_base = arc.base_dir(run_dir / arc.ARCHIVE_DIR)
    if not (Path(cfg.model.base_dir) / "model.safetensors").exists():
        if recorded_base is None or not (Path(recorded_base) / "model.safetensors").exists():
            raise ReplayError(f"model.base_dir {cfg.model.base_dir}: no model.safetensors there (from "
                              f"{Path.cwd()}); run the replay where the run was started")
        cfg = cfg.replace("model.base_dir", recorded_base)
    engine = make_train_engine(cfg)
    try:
        base = arc.base_hash(run_dir / arc.ARCHIVE_DIR)
        if base is not None and weights_hash(engine.weights()) != base:
            raise ReplayError(f"model.base_dir {cfg.model.base_dir}: the base checkpoint differs from the one the run "
                              "started from (its weights hash is not the recorded one); replay from the directory "
                              "the run was started in, with its base unchanged")
        rows = []
        idle: set[int] = set()  # the steps that trained nothing, as the trainer kept them (staleness)
        with open(out / "replay.jsonl", "w") as f:
            for i, m in enumerate(metas):
                groups, outcomes = read_groups(m.path)
                batch = [(None, g) for g in groups]
                again = [str(k) for k in classify(batch, version=m.parent, max_staleness=cfg.trainer.max_staleness,
                                                  idle=idle)]
                if not settings and again != outcomes:
                    raise ReplayError(f"step {m.step}: the groups' outcomes at version {m.parent} are not the recorded "
                                      f"ones ({again} against {outcomes}); the run's config.toml is not the one it ran")
                sorted_ = sort_step(batch, version=m.parent, max_staleness=cfg.trainer.max_staleness, idle=idle)
                stats = engine.train_step(sorted_.signal) if sorted_.signal else {}
                if not sorted_.signal:
                    idle.add(m.step)
                if sorted_.signal:
                    engine.lr_step()
                digest = weights_hash(engine.weights())
                row = {"step": m.step, "weights_hash": digest, "recorded_hash": m.weights_hash,
                       "match": digest == m.weights_hash, "groups": len(groups),
                       **{k: stats[k] for k in COMPARED_STATS if k in stats}}
                f.write(json.dumps(row) + "\n")
                f.flush()
                rows.append(row)
                res.steps += 1
                res.matched += int(row["match"])
                if not settings and not row["match"] and res.first_mismatch is None:
                    rec = recorded_rows.get(m.step, {})
                    ckpt = run_dir / "checkpoints" / f"step-{m.step:06d}"
                    res.first_mismatch = {
                        "step": m.step, "recorded_hash": m.weights_hash, "replayed_hash": digest,
                        "stats": {k: {"recorded": rec.get(k), "replayed": stats.get(k)} for k in COMPARED_STATS
                                  if k in stats or k in rec},
                        "tensors": _tensor_diff(ckpt, engine.weights()) if (ckpt / "model.safetensors").exists()
                        else "the run keeps no checkpoint of this step (trainer.keep_checkpoints)"}
                if progress is not None:
                    progress(i + 1, len(metas), row, time.perf_counter() - t0)
                if res.first_mismatch is not None:
                    break  # every later step starts from other weights
        res.final_hash = rows[-1]["weights_hash"] if rows else ""
        last = metas[-1].step
        if not settings and res.first_mismatch is None and stop_at is None:
            res.final_checkpoint = _final_checkpoint(run_dir, res.final_hash)
        if settings or stop_at is not None:
            engine.export_hf(out / "checkpoint")
        if evaluate:
            task = make_task(cfg.task)
            heldout = task.heldout()
            fmt = prompt_format(cfg.task, cfg.model.base_dir)
            ids = [build_prompt(fmt, engine.tokenizer, item.prompt)[1] for item in heldout]
            answers = engine.greedy(ids, max_new_tokens=task.eval_max_new_tokens)
            res.heldout_accuracy = float(np.mean([task.correctness(it.reference, [a])[0]
                                                  for it, a in zip(heldout, answers)]))
        res.seconds = time.perf_counter() - t0
        (out / "replay.json").write_text(json.dumps({**res.to_dict(), "last_step": last}, indent=2) + "\n")
        return res
    finally:
        engine.close()


def print_progress(i: int, n: int, row: dict, elapsed: float) -> None:
    eta = elapsed / i * (n - i)
    mark = "ok" if row["match"] else "DIFFERS"
    print(f"replay step {row['step']} ({i}/{n}): {mark}  {row['weights_hash'][:12]}  ETA {eta:.0f} s",
          file=sys.stderr, flush=True)


# -- pipeline diff ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StepView:
    """What ``diff`` compares of one step: each group in training order (None for a replay,
    which keeps hashes only) and the weights after it."""

    step: int
    groups: tuple | None
    """Per group: (prompt id, outcome, (min, max) version, generator id, completion-token hash,
    votes hash, rewards, label-model version)."""
    weights_hash: str


_PROMPT, _OUTCOME, _VERSIONS, _GENERATOR, _SAMPLES, _VOTES, _REWARDS, _LABELMODEL = range(8)


def _views(path: Path) -> tuple[str, list[StepView]]:
    """A run's steps (from its archive) or a replay's (from its replay.jsonl: hashes only)."""
    if (path / "replay.jsonl").exists() and not (path / arc.ARCHIVE_DIR).is_dir():
        rows = [json.loads(x) for x in (path / "replay.jsonl").read_text().splitlines() if x.strip()]
        return "replay", [StepView(r["step"], None, r["weights_hash"]) for r in rows]
    directory = path / arc.ARCHIVE_DIR
    if not directory.is_dir():
        raise ReplayError(f"{path}: neither a run with an archive ({arc.ARCHIVE_DIR}/) nor a replay (replay.jsonl)")
    import pyarrow.parquet as pq

    views = []
    for m in arc.steps(directory):
        t = pq.read_table(m.path, columns=["position", "completion", "prompt_id", "outcome", "min_version",
                                           "max_version", "generator_id", "completion_ids", "votes", "reward",
                                           "labelmodel_version"]).to_pydict()
        groups: dict[int, list] = {}
        for i in sorted(range(len(t["position"])), key=lambda i: (t["position"][i], t["completion"][i])):
            g = groups.setdefault(t["position"][i], [t["prompt_id"][i], t["outcome"][i],
                                                     (t["min_version"][i], t["max_version"][i]),
                                                     t["generator_id"][i], [], [], [], t["labelmodel_version"][i]])
            g[_SAMPLES].append(tuple(t["completion_ids"][i]))
            g[_VOTES].append(tuple(np.nan_to_num(np.asarray(t["votes"][i], dtype=np.float64), nan=-1.0).tolist()))
            g[_REWARDS].append(t["reward"][i])
        views.append(StepView(m.step, tuple(tuple(hash(tuple(x)) if j in (_SAMPLES, _VOTES) else
                                                  (tuple(x) if isinstance(x, list) else x) for j, x in enumerate(g))
                                            for g in groups.values()), m.weights_hash))
    return "run", views


def _events(path: Path) -> list[tuple[float, str]]:
    """A run's faults and resumes: (the version at which it happened, what)."""
    out: list[tuple[float, str]] = []
    for r in arc.resumes(path / arc.ARCHIVE_DIR):
        out.append((r["checkpoint"] + 0.5, f"the trainer was restarted and resumed from the checkpoint of step "
                                           f"{r['checkpoint']} (steps abandoned: {r['abandoned'] or 'none'})"))
    chaos = path / "chaos.jsonl"
    if chaos.exists():
        for line in chaos.read_text().splitlines():
            ev = json.loads(line) if line.strip() else {}
            if ev.get("version") is not None:
                out.append((float(ev["version"]), f"fault: {ev.get('kind')} of {ev.get('target')} "
                                                  f"({ev.get('detail')}) at version {ev['version']}"))
    return sorted(out)


def diff(path_a: str | Path, path_b: str | Path) -> dict:
    """The first step at which two runs (or a run and its replay) differ, what differs, and the
    nearest cause the records show. Compared in this order, each only where the ones before
    agree: the batch (prompt ids, outcomes), the policy versions that sampled each group, the
    samples (completion tokens), the votes, the rewards, the weights. ``first_difference`` is
    None when every common step agrees."""
    a, b = Path(path_a), Path(path_b)
    kind_a, va = _views(a)
    kind_b, vb = _views(b)
    by_b = {v.step: v for v in vb}
    common = [v for v in va if v.step in by_b]
    result: dict = {"a": str(a), "b": str(b), "steps_compared": len(common), "first_difference": None}
    for x in common:
        y = by_b[x.step]
        first: dict = {"step": x.step}
        if x.groups is not None and y.groups is not None:
            first.update(_group_difference(x.groups, y.groups))
        if "differs" not in first and x.weights_hash != y.weights_hash:
            first["differs"] = "weights"
        if "differs" not in first:
            continue
        first["cause"] = _cause(first, a, b, kind_a, kind_b)
        result["first_difference"] = first
        break
    return result


def _group_difference(ga: tuple, gb: tuple) -> dict:
    """What first differs between two steps' groups (empty: nothing)."""
    ids_a, ids_b = [g[_PROMPT] for g in ga], [g[_PROMPT] for g in gb]
    if ids_a != ids_b or [g[_OUTCOME] for g in ga] != [g[_OUTCOME] for g in gb]:
        return {"differs": "batch", "only_in_a": sorted(set(ids_a) - set(ids_b))[:10],
                "only_in_b": sorted(set(ids_b) - set(ids_a))[:10],
                "outcomes_a": sorted({g[_OUTCOME] for g in ga}), "outcomes_b": sorted({g[_OUTCOME] for g in gb})}
    for field_, name in ((_VERSIONS, "policy_versions"), (_SAMPLES, "samples"), (_VOTES, "votes"),
                         (_REWARDS, "rewards")):
        differ = [i for i, (x, y) in enumerate(zip(ga, gb)) if x[field_] != y[field_]]
        if differ:
            i = differ[0]
            out = {"differs": name, "groups_differing": len(differ), "prompt_id": ga[i][_PROMPT]}
            if name == "policy_versions":
                out["versions"] = {"a": list(ga[i][_VERSIONS]), "b": list(gb[i][_VERSIONS])}
            if name == "samples":
                out["generators"] = {"a": ga[i][_GENERATOR], "b": gb[i][_GENERATOR]}
            if name == "rewards":
                out["labelmodel_versions"] = {"a": ga[i][_LABELMODEL], "b": gb[i][_LABELMODEL]}
            return out
    return {}


def _cause(first: dict, a: Path, b: Path, kind_a: str, kind_b: str) -> str:
    """The nearest explanation the records hold for a first difference."""
    step, what = first["step"], first["differs"]
    events = []
    for name, path, kind in (("a", a, kind_a), ("b", b, kind_b)):
        if kind == "run":
            events += [(v, f"{name}: {text}") for v, text in _events(path) if v <= step]
    nearest = max(events)[1] if events else None
    after = f"; the nearest fault or resume before it: {nearest}" if nearest else ""
    if what == "weights":
        if "replay" in (kind_a, kind_b):
            return ("the same step trained to other weights: the replay ran on another machine, thread count or "
                    "torch build than the run (docs/reproducibility.md)")
        return "the same groups and rewards trained to other weights: the trainer's arithmetic differs " \
               "(thread count, kernels, torch build)" + after
    if what == "batch":
        if nearest:
            return nearest
        if "stale" in first["outcomes_a"] + first["outcomes_b"]:
            return "groups dropped stale in one run and not the other (generation timing against the staleness bound)"
        return "other groups reached the trainer first (timing; no fault or resume is recorded before it)"
    if what == "policy_versions":
        return (f"group {first['prompt_id']} was sampled by policy versions {first['versions']['a']} in a and "
                f"{first['versions']['b']} in b: generation timing against weight updates (η > 0)" + after)
    if what == "samples":
        g = first["generators"]
        if g["a"] != g["b"]:
            return (f"group {first['prompt_id']} was sampled by {g['a']} in a and {g['b']} in b, and each generator "
                    "draws from its own random stream: which worker takes a prompt is timing" + after)
        return f"group {first['prompt_id']} was sampled differently by the same generator and version" + after
    if what == "votes":
        return f"the verifiers scored group {first['prompt_id']} differently (a judge's sampling or timeout)" + after
    lm = first["labelmodel_versions"]
    if lm["a"] != lm["b"]:
        return (f"a label-model refit: group {first['prompt_id']}'s rewards came from label model {lm['a']} in a "
                f"and {lm['b']} in b" + after)
    return (f"the label model {lm['a']} was fitted on other votes in the two runs (its window holds what arrived "
            "first)" + after)
