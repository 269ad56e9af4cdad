"""Distilled verifier: a small cross-encoder trained on the Weaver posteriors (docs/design.md §5).

Weaver's last step replaces the whole weak-verifier ensemble plus label model with one
learned scorer: (prompt, completion) -> P(correct), trained on the ensemble's soft
posteriors, never on the hidden answers. Here the training data is what a run's verifier
stage recorded in ``runs/<id>/posteriors/<verifier>.jsonl`` (one line per scored group: prompt,
completions, votes, posterior, and the hidden truth, which is only used to *measure*).

    pipeline distill --run runs/<id>          # or just the run id
        -> runs/<id>/distilled/{model.safetensors, config.json, report.json}

The model reads ``prompt + completion + eos`` as characters with the project's tokenizer
through a Qwen3 causal LM (by default the run's base policy, which already does the task at
a modest accuracy) and scores it as its log-likelihood of the completion plus a scalar head
on the last hidden state (``CrossEncoder``). It is trained with binary cross-entropy
against the soft posterior. Measured on this task, the base-initialised scorer kept more
than the ensemble's selection accuracy, while a small model from scratch learned nothing
useful in the same budget (docs/experiments.md, bench/results/distill.md).
Measured on held-out groups (split by prompt): selection accuracy (pick the top-scored
completion of each group; ties averaged) against the ensemble's, the retention ratio,
and scoring throughput (rows/s) against running the ensemble + label model.

The trained scorer is a reward mode, ``distilled:<dir>`` (see ``pipeline.algo.rewards``).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from pipeline.common.archive import ARCHIVE_DIR, read_columns
from pipeline.algo.labelmodel import fit_label_model
from pipeline.config import load_config
from pipeline.model.qwen import ModelShape, build_model, encode_prompts, load_checkpoint, sample
from pipeline.model.tokenizer import CharTokenizer
from pipeline.tasks import arithmetic as task
from pipeline.tasks.arithmetic import correctness
from pipeline.verifiers.registry import score_group

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
REPORT_FILE = "report.json"
POSTERIORS_FILE = "posteriors.jsonl"
"""Where runs before per-worker files kept every verifier's lines (still read)."""
POSTERIORS_DIR = "posteriors"
"""``<run>/posteriors/<verifier worker>.jsonl``: each verifier replica appends to its own file,
so replicas on several hosts sharing a network file system never interleave."""


def posterior_files(run_dir: str | Path) -> list[Path]:
    """A run's posterior files: ``posteriors/*.jsonl`` (one per verifier), and ``posteriors.jsonl``."""
    run_dir = Path(run_dir)
    files = sorted((run_dir / POSTERIORS_DIR).glob("*.jsonl"))
    if (run_dir / POSTERIORS_FILE).is_file():
        files.append(run_dir / POSTERIORS_FILE)
    return files


def posterior_rows(run_dir: str | Path) -> list[dict]:
    """Every recorded line of a run's posterior files, parsed."""
    return [json.loads(line) for f in posterior_files(run_dir) for line in f.read_text(encoding="utf-8").splitlines()
            if line.strip()]


# --------------------------------------------------------------------------- measures


def selection_accuracy(scores: np.ndarray, truth: np.ndarray) -> float:
    """Mean over groups of the hidden correctness of the top-scored completion.

    ``scores`` and ``truth`` are [n, G]. Ties at the top are averaged (the expected
    accuracy of picking uniformly among them), so a binary verifier is not flattered by
    a lucky tie-break; a NaN score (abstain) ranks below every real score.
    """
    s = np.where(np.isnan(scores), -np.inf, np.asarray(scores, dtype=np.float64))
    t = np.asarray(truth, dtype=np.float64)
    if s.shape != t.shape or s.ndim != 2 or s.shape[0] == 0:
        raise ValueError(f"scores and truth must be the same [n, G] shape with n > 0; got {s.shape}, {t.shape}")
    top = s >= (s.max(axis=1, keepdims=True) - 1e-9)
    return float(((top * t).sum(axis=1) / top.sum(axis=1)).mean())


def base_rollouts(cfg, *, prompts: int, seed: int, model_dir: str | None = None) -> dict:
    """Sample G completions for ``prompts`` training problems with a checkpoint and score them.

    Returns ``prompts`` [n] (str), ``completions`` [n][G], ``votes`` float32 [n, G, m] over
    ``cfg.verifier.verifiers`` (NaN = abstain) and ``truth`` float32 [n, G] (hidden).
    Problems never repeat a held-out one.
    """
    t = cfg.task
    ops = tuple(t.ops)
    heldout = set(task.heldout_problems(n=t.heldout_size, seed=t.heldout_seed, digits=t.digits, ops=ops))
    stream = task.training_problems(seed=seed, digits=t.digits, ops=ops, exclude=heldout)
    probs = [next(stream) for _ in range(prompts)]
    model, tok = load_checkpoint(model_dir or cfg.model.base_dir)
    g = cfg.generator.group_size
    gen = torch.Generator().manual_seed(seed)
    completions: list[list[str]] = []
    with torch.no_grad():
        for start in range(0, len(probs), 64):
            chunk = probs[start:start + 64]
            ids = encode_prompts(tok, [p.prompt for p in chunk]).repeat_interleave(g, dim=0)
            tokens, _, lengths = sample(model, ids, max_new_tokens=t.max_new_tokens, temperature=cfg.generator.temperature,
                                        eos_id=tok.eos_id, pad_id=tok.pad_id, generator=gen)
            rows = [tok.decode(tokens[j, : lengths[j]].tolist()) for j in range(tokens.shape[0])]
            completions += [rows[i * g:(i + 1) * g] for i in range(len(chunk))]
    names = list(cfg.verifier.verifiers)
    votes = np.stack([score_group(p.prompt, c, names)[0] for p, c in zip(probs, completions)])
    truth = np.stack([correctness(p.answer, c) for p, c in zip(probs, completions)])
    return {"prompts": [p.prompt for p in probs], "completions": completions, "votes": votes, "truth": truth}


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Group:
    """One scored group of a run: its prompt, G completions, the ensemble's votes and posterior, hidden truth."""

    prompt_id: str
    prompt: str
    completions: tuple[str, ...]
    votes: np.ndarray          # float32 [G, m], NaN = abstain
    posterior: np.ndarray      # float32 [G], Weaver P(correct): the training target
    truth: np.ndarray          # float32 [G], hidden: for measuring only


def load_posteriors(path: str | Path) -> tuple[list[Group], list[str]]:
    """Read a posteriors file, or all of a run directory's (:func:`posterior_files`); returns
    (groups, verifier names).

    Groups recorded without a posterior (a run whose reward mode used no label model)
    get one from a label model fitted here on all the recorded votes, which is what the
    ensemble would have said. Raises ValueError naming the line of a malformed record.
    """
    path = Path(path)
    files = posterior_files(path) if path.is_dir() else [path] if path.is_file() else []
    if not files:
        raise FileNotFoundError(f"{path}: no posteriors; runs record them from the verifier stage on "
                                f"({POSTERIORS_DIR}/<worker>.jsonl)")
    groups, names, missing = [], None, []
    lines = [(f, n, line) for f in files for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)]
    for path, lineno, line in lines:
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            comps = tuple(str(c) for c in d["completions"])
            votes = np.array([[np.nan if x is None else x for x in row] for row in d["votes"]], dtype=np.float32)
            truth = np.asarray(d["truth"], dtype=np.float32)
            post = None if d.get("posterior") is None else np.asarray(d["posterior"], dtype=np.float32)
            if names is None:
                names = list(d["names"])
            elif list(d["names"]) != names:
                raise ValueError(f"verifier names {d['names']} differ from the first line's {names}")
            g = len(comps)
            if votes.shape != (g, len(names)) or truth.shape != (g,) or (post is not None and post.shape != (g,)):
                raise ValueError(f"shapes disagree: {g} completions, votes {votes.shape}, truth {truth.shape}")
            grp = Group(str(d["prompt_id"]), str(d["prompt"]), comps, votes,
                        post if post is not None else np.full(g, np.nan, np.float32), truth)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{lineno}: bad record: {e}") from None
        if post is None:
            missing.append(len(groups))
        groups.append(grp)
    if not groups:
        raise ValueError(f"{path}: no scored groups")
    if missing:
        votes = np.concatenate([g.votes for g in groups])
        lm = fit_label_model(votes, names)
        for i in missing:
            groups[i] = Group(**{**groups[i].__dict__, "posterior": lm.posterior(groups[i].votes, names).astype(np.float32)})
    return groups, names


def load_archive(run_dir: str | Path) -> tuple[list[Group], list[str]]:
    """A run's trained groups from its rollout archive (``archive/``, pipeline.common.archive):
    the prompts and completions the trainer took, their votes, truth and, where the reward was
    Weaver's, the posterior; groups rewarded otherwise get one from a label model fitted here,
    as ``load_posteriors`` does."""
    directory = Path(run_dir) / ARCHIVE_DIR
    t = read_columns(directory, ["prompt_id", "prompt_text", "completion_text", "verifier_names", "votes", "reward",
                                 "truth", "reward_mode"])
    if not t["prompt_id"]:
        raise FileNotFoundError(f"{run_dir}: no rollout archive ({ARCHIVE_DIR}/ with step segments)")
    rows: dict[str, list[int]] = {}
    for i, pid in enumerate(t["prompt_id"]):
        rows.setdefault(pid, []).append(i)
    names = list(t["verifier_names"][0])
    groups, missing = [], []
    for pid, idx in rows.items():
        votes = np.array([[np.nan if x is None else x for x in t["votes"][i]] for i in idx], dtype=np.float32)
        weaver = t["reward_mode"][idx[0]] == "weaver"
        post = np.array([t["reward"][i] for i in idx], np.float32) if weaver else np.full(len(idx), np.nan, np.float32)
        if not weaver:
            missing.append(len(groups))
        groups.append(Group(pid, t["prompt_text"][idx[0]], tuple(t["completion_text"][i] for i in idx), votes, post,
                            np.array([t["truth"][i] for i in idx], np.float32)))
    if missing:
        lm = fit_label_model(np.concatenate([g.votes for g in groups]), names)
        for i in missing:
            groups[i] = Group(**{**groups[i].__dict__, "posterior": lm.posterior(groups[i].votes, names).astype(np.float32)})
    return groups, names


def split_groups(groups: Sequence[Group], *, heldout_fraction: float, seed: int) -> tuple[list[Group], list[Group]]:
    """Train / held-out split by prompt, so no held-out prompt is ever seen in training."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    prompts = sorted({g.prompt for g in groups})
    random.Random(seed).shuffle(prompts)
    held = set(prompts[: max(1, round(heldout_fraction * len(prompts)))])
    return [g for g in groups if g.prompt not in held], [g for g in groups if g.prompt in held]


def training_rows(groups: Sequence[Group]) -> tuple[list[str], list[str], np.ndarray]:
    """(prompts, completions, targets): one row per distinct (prompt, completion), target = mean posterior."""
    acc: dict[tuple[str, str], list[float]] = {}
    for g in groups:
        for c, p in zip(g.completions, g.posterior):
            acc.setdefault((g.prompt, c), []).append(float(p))
    keys = list(acc)
    return [k[0] for k in keys], [k[1] for k in keys], np.array([np.mean(acc[k]) for k in keys], dtype=np.float32)


# --------------------------------------------------------------------------- model


@dataclass(kw_only=True)
class DistillConfig:
    """How the cross-encoder is built and trained."""

    init: str = "base"
    """``base``: start from the run's base policy (which already does the task at a modest
    accuracy); ``scratch``: a freshly initialised tiny Qwen3 of the shape below."""
    hidden_size: int = 64
    """Width of a ``scratch`` model."""
    num_layers: int = 2
    """Blocks of a ``scratch`` model."""
    num_heads: int = 4
    """Attention heads of a ``scratch`` model."""
    epochs: float = 3.0
    """Passes over the distinct training rows."""
    batch_size: int = 256
    """Rows per optimizer step."""
    lr: float = 5e-4
    """AdamW peak learning rate (linear warm-up, then linear decay to 0)."""
    warmup_steps: int = 20
    """Learning-rate warm-up steps."""
    heldout_fraction: float = 0.2
    """Share of the run's prompts held out for measuring (never trained on)."""
    max_completion_chars: int = 16
    """Longer completions are cut to this many characters before scoring."""
    seed: int = 0
    """Seed of the split, the init of a scratch model, and the batch order."""
    threads: int = 1
    """torch intra-op threads."""

    def validate(self) -> None:
        for name, ok, allowed in [
            ("init", self.init in ("base", "scratch"), "base|scratch"),
            ("epochs", self.epochs > 0, "> 0"), ("batch_size", self.batch_size >= 1, ">= 1"),
            ("lr", self.lr > 0, "> 0"), ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("heldout_fraction", 0 < self.heldout_fraction < 1, "in (0, 1)"),
            ("max_completion_chars", self.max_completion_chars >= 1, ">= 1"), ("threads", self.threads >= 1, ">= 1"),
        ]:
            if not ok:
                raise ValueError(f"distill.{name}: must be {allowed}; got {getattr(self, name)!r}")


class CrossEncoder(nn.Module):
    """A Qwen3 causal LM read as a scorer of (prompt, completion).

    logit P(correct) = scale · Σ log p_LM(completion tokens + eos | prompt) + head(h at the eos)

    The first term is the LM's own confidence in the completion: started from the base
    policy, which already does the task at a modest accuracy, it ranks completions from
    the first step, and fine-tuning moves it towards what the ensemble believes. The head
    on the last hidden state adds what a likelihood cannot say (format, residue checks).
    """

    def __init__(self, lm: nn.Module, *, scale: float = 1.0):
        super().__init__()
        self.lm = lm
        self.head = nn.Linear(lm.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        # 1 for a pretrained LM (its likelihood ranks answers from the start); 0 for a fresh
        # one, whose likelihood is noise (a sum of ~-log V per token) until it has learned.
        self.scale = nn.Parameter(torch.tensor(float(scale)))

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """Logits [N] for right-padded ``ids`` [N, T]: ``lengths`` [N] real tokens, completion from ``starts`` [N]."""
        # Right padding + causal attention: a real position never attends to a pad, so no mask is needed.
        h = self.lm.model(input_ids=ids).last_hidden_state
        logp = F.log_softmax(self.lm.lm_head(h[:, :-1]).float(), dim=-1)
        tok_lp = logp.gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)        # [N, T-1]: log p(ids[t+1])
        pos = torch.arange(ids.shape[1] - 1, device=ids.device).unsqueeze(0)
        mask = (pos >= (starts - 1).unsqueeze(1)) & (pos < (lengths - 1).unsqueeze(1))
        last = h[torch.arange(ids.shape[0]), lengths - 1]
        return self.scale * (tok_lp * mask).sum(1) + self.head(last).squeeze(-1)


def encode_rows(tok: CharTokenizer, prompts: Sequence[str], completions: Sequence[str], *,
                max_completion_chars: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [N, T] of ``prompt + completion + eos``, their lengths [N] and completion starts [N].

    Raises ValueError naming the row for a character outside the vocabulary.
    """
    rows, starts = [], []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        try:
            pi = tok.encode(p)
            rows.append(pi + tok.encode(c[:max_completion_chars]) + [tok.eos_id])
        except ValueError as e:
            raise ValueError(f"row {i} ({p!r}, {c!r}): {e}") from None
        if not pi:
            raise ValueError(f"row {i}: empty prompt")
        starts.append(len(pi))
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    ids = torch.full((len(rows), int(lengths.max())), tok.pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return ids, lengths, torch.tensor(starts, dtype=torch.long)


def _language_model(cfg: DistillConfig, base_dir: str | Path | None, vocab_size: int) -> nn.Module:
    if cfg.init == "base":
        if base_dir is None:
            raise ValueError("distill.init 'base' needs the base model directory")
        lm, _ = load_checkpoint(base_dir)
        return lm
    shape = ModelShape(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                       num_kv_heads=max(1, cfg.num_heads // 2), intermediate_size=4 * cfg.hidden_size)
    return build_model(shape, vocab_size, seed=cfg.seed)


class DistilledVerifier:
    """A trained cross-encoder: ``score(prompts, completions) -> P(correct)`` float32 [N]."""

    def __init__(self, model: CrossEncoder, tok: CharTokenizer, *, max_completion_chars: int):
        self.model, self.tok, self.max_completion_chars = model.eval(), tok, max_completion_chars

    @torch.no_grad()
    def score(self, prompts: Sequence[str], completions: Sequence[str], *, batch_size: int = 1024) -> np.ndarray:
        out = []
        for s in range(0, len(prompts), batch_size):
            ids, lengths, starts = encode_rows(self.tok, prompts[s:s + batch_size], completions[s:s + batch_size],
                                               max_completion_chars=self.max_completion_chars)
            out.append(torch.sigmoid(self.model(ids, lengths, starts)).numpy())
        return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)

    def score_group(self, prompt: str, completions: Sequence[str]) -> np.ndarray:
        return self.score([prompt] * len(completions), completions)

    def save(self, directory: str | Path, *, extra: dict | None = None) -> Path:
        """``model.safetensors`` (LM + head) and ``config.json`` (LM config, settings) + tokenizer files."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().clone() for k, v in self.model.state_dict().items()}
        save_file(tensors, str(d / WEIGHTS_FILE), metadata={"format": "pt", "kind": "distilled-verifier"})
        self.tok.save(d)
        config = {"kind": "distilled-verifier", "lm": self.model.lm.config.to_dict(),
                  "max_completion_chars": self.max_completion_chars, **(extra or {})}
        (d / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return d

    @classmethod
    def load(cls, directory: str | Path) -> DistilledVerifier:
        """Load what ``save`` wrote (safetensors only, never pickle)."""
        from transformers import Qwen3Config, Qwen3ForCausalLM

        d = Path(directory)
        if not (d / WEIGHTS_FILE).is_file() or not (d / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"{d}: not a distilled verifier (needs {WEIGHTS_FILE} and {CONFIG_FILE})")
        config = json.loads((d / CONFIG_FILE).read_text())
        if config.get("kind") != "distilled-verifier":
            raise ValueError(f"{d / CONFIG_FILE}: kind is {config.get('kind')!r}, expected 'distilled-verifier'")
        lm_cfg = Qwen3Config(**{k: v for k, v in config["lm"].items() if k not in ("model_type", "transformers_version")})
        model = CrossEncoder(Qwen3ForCausalLM(lm_cfg).float())
        model.load_state_dict(load_file(str(d / WEIGHTS_FILE)), strict=True)
        return cls(model, CharTokenizer.load(d), max_completion_chars=int(config["max_completion_chars"]))


def train(prompts: Sequence[str], completions: Sequence[str], targets: np.ndarray, cfg: DistillConfig, *,
          tok: CharTokenizer, base_dir: str | Path | None = None, log_every: int = 50,
          progress=print) -> tuple[DistilledVerifier, list[float]]:
    """Fit a cross-encoder to soft ``targets`` in [0, 1] with binary cross-entropy; returns (verifier, losses)."""
    cfg.validate()
    if len(prompts) == 0:
        raise ValueError("no training rows")
    t = np.asarray(targets, dtype=np.float32)
    if t.shape != (len(prompts),) or np.isnan(t).any() or (t < 0).any() or (t > 1).any():
        raise ValueError(f"targets must be [{len(prompts)}] values in [0, 1]")
    torch.set_num_threads(cfg.threads)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = CrossEncoder(_language_model(cfg, base_dir, tok.vocab_size),
                             scale=1.0 if cfg.init == "base" else 0.0).float().train()
    ids, lengths, starts = encode_rows(tok, prompts, completions, max_completion_chars=cfg.max_completion_chars)
    y = torch.from_numpy(t)
    n = len(prompts)
    steps = max(1, math.ceil(cfg.epochs * n / cfg.batch_size))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / max(1, cfg.warmup_steps), max(0.0, (steps - s) / max(1, steps - cfg.warmup_steps))))
    rng = torch.Generator().manual_seed(cfg.seed)
    order, pos, losses, t0 = torch.randperm(n, generator=rng), 0, [], time.perf_counter()
    for step in range(steps):
        if pos + cfg.batch_size > n and pos > 0:
            order, pos = torch.randperm(n, generator=rng), 0
        idx = order[pos:pos + cfg.batch_size]
        pos += len(idx)
        width = int(lengths[idx].max())
        loss = F.binary_cross_entropy_with_logits(model(ids[idx, :width], lengths[idx], starts[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress and ((step + 1) % log_every == 0 or step + 1 == steps):
            progress(f"distill step {step + 1}/{steps}  loss {np.mean(losses[-log_every:]):.4f}  "
                     f"{time.perf_counter() - t0:.0f}s")
    return DistilledVerifier(model, tok, max_completion_chars=cfg.max_completion_chars), losses


# --------------------------------------------------------------------------- measure and run


def _timed_rate(fn, rows: int, *, min_seconds: float = 1.0) -> float:
    """Rows per second of ``fn()`` (which handles ``rows`` rows), repeated for at least ``min_seconds``."""
    fn()  # warm-up
    reps, t0 = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        dt = time.perf_counter() - t0
        if dt >= min_seconds:
            return rows * reps / dt


def measure(verifier: DistilledVerifier, heldout: Sequence[Group], train_groups: Sequence[Group],
            names: list[str]) -> dict:
    """Selection accuracy on held-out groups (distilled vs ensemble) and scoring throughput (rows/s)."""
    sizes = {len(g.completions) for g in heldout}
    if len(sizes) != 1:
        raise ValueError(f"held-out groups differ in size {sorted(sizes)}")
    truth = np.stack([g.truth for g in heldout])
    ensemble = np.stack([g.posterior for g in heldout])
    prompts = [g.prompt for g in heldout for _ in g.completions]
    comps = [c for g in heldout for c in g.completions]
    distilled = verifier.score(prompts, comps).reshape(truth.shape)
    sel = {"distilled": selection_accuracy(distilled, truth), "ensemble": selection_accuracy(ensemble, truth)}
    for j, name in enumerate(names):
        sel[f"single:{name}"] = selection_accuracy(np.stack([g.votes[:, j] for g in heldout]), truth)
    # Informative groups: at least one right and one wrong completion (elsewhere every pick is equal).
    mixed = (truth.max(axis=1) > 0) & (truth.min(axis=1) < 1)
    sel_mixed = {k: selection_accuracy(s[mixed], truth[mixed]) for k, s in
                 {"distilled": distilled, "ensemble": ensemble}.items()} if mixed.any() else {}

    # Throughput, same process, same rows: the ensemble as the verifier stage runs it (every weak
    # verifier per group, then the label model's posterior) against the distilled scorer.
    t0 = time.perf_counter()
    lm = fit_label_model(np.concatenate([g.votes for g in train_groups]), names)
    fit_s = time.perf_counter() - t0

    def run_ensemble():
        for g in heldout:
            lm.posterior(score_group(g.prompt, g.completions, names)[0], names)

    def run_distilled_groups():
        for g in heldout:
            verifier.score_group(g.prompt, g.completions)

    rows = len(comps)
    rate = {"ensemble_per_group": _timed_rate(run_ensemble, rows),
            "distilled_batched": _timed_rate(lambda: verifier.score(prompts, comps), rows),
            "distilled_per_group": _timed_rate(run_distilled_groups, rows)}
    return {
        "heldout_groups": len(heldout), "heldout_rows": rows, "mixed_groups": int(mixed.sum()),
        "selection_accuracy": {k: round(v, 4) for k, v in sel.items()},
        "selection_accuracy_mixed_groups": {k: round(v, 4) for k, v in sel_mixed.items()},
        "retention": round(sel["distilled"] / sel["ensemble"], 4) if sel["ensemble"] > 0 else None,
        "top_pick_agreement": round(float(np.mean(distilled.argmax(1) == ensemble.argmax(1))), 4),
        "mae_vs_posterior": round(float(np.abs(distilled - ensemble).mean()), 4),
        "hard_agreement": round(float(np.mean((distilled > 0.5) == (ensemble > 0.5))), 4),
        "rows_per_second": {k: round(v, 1) for k, v in rate.items()},
        "speedup_batched_vs_ensemble": round(rate["distilled_batched"] / rate["ensemble_per_group"], 3),
        "speedup_per_group_vs_ensemble": round(rate["distilled_per_group"] / rate["ensemble_per_group"], 3),
        "labelmodel_fit_seconds": round(fit_s, 3),
    }


def resolve_run(run: str, runs_dir: str | Path = "runs") -> Path:
    """A run directory from a path or a run id; FileNotFoundError when neither exists."""
    p = Path(run)
    if posterior_files(p) or (p / "config.toml").is_file():
        return p
    q = Path(runs_dir) / run
    if q.is_dir():
        return q
    raise FileNotFoundError(f"--run {run!r}: neither a run directory nor a run id under {runs_dir}/")


def distill_run(run_dir: str | Path, cfg: DistillConfig, *, out: str | Path | None = None, progress=print,
                source: str = "posteriors") -> dict:
    """Train a distilled verifier on a run's posteriors (``source`` ``posteriors``: every scored
    group the verifier stage recorded; ``archive``: the groups the trainer trained on, from the
    rollout archive), measure it, save it; returns the report."""
    cfg.validate()
    run_dir = Path(run_dir)
    run_cfg = load_config(str(run_dir / "config.toml"), {}) if (run_dir / "config.toml").is_file() else None
    base_dir = run_cfg.model.base_dir if run_cfg is not None else None
    groups, names = load_archive(run_dir) if source == "archive" else load_posteriors(run_dir)
    train_groups, heldout = split_groups(groups, heldout_fraction=cfg.heldout_fraction, seed=cfg.seed)
    if not train_groups or not heldout:
        raise ValueError(f"{run_dir}: too few prompts ({len(groups)} groups) to hold some out")
    prompts, comps, targets = training_rows(train_groups)
    tok = CharTokenizer.load(base_dir) if base_dir is not None else CharTokenizer()
    progress = progress or (lambda _msg: None)
    progress(f"distilling {run_dir}: {len(groups)} groups, {len(train_groups)} for training "
             f"({len(prompts)} distinct rows), {len(heldout)} held out; init {cfg.init}")
    t0 = time.perf_counter()
    verifier, losses = train(prompts, comps, targets, cfg, tok=tok, base_dir=base_dir, progress=progress)
    train_s = time.perf_counter() - t0
    report = {"run": str(run_dir), "source": source, "groups": len(groups), "train_groups": len(train_groups),
              "train_rows": len(prompts), "train_seconds": round(train_s, 1), "steps": len(losses),
              "final_loss": round(float(np.mean(losses[-20:])), 4), "config": asdict(cfg),
              "params": sum(p.numel() for p in verifier.model.parameters()), "verifiers": names}
    report.update(measure(verifier, heldout, train_groups, names))
    out = Path(out) if out is not None else run_dir / "distilled"
    verifier.save(out, extra={"trained_on": str(run_dir), "distill": asdict(cfg)})
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    report["out"] = str(out)
    return report
