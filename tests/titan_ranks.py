"""The torchtitan engine on every rank of a real ``torchrun`` launch, driven by a list of actions.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.titan_ranks \\
        --base DIR [--set trainer.lr=1e-3 ...] ACTION ...

Rank 0 builds a :class:`TitanEngine` and performs the actions in order; the other ranks
run :func:`pipeline.engines.titan.follow`. Actions:

    train:SEED[:G:N]     train_step on :func:`make_groups` (SEED, G groups of N completions; default 3 of 4);
                         appends the stats to --out/stats.jsonl
    lr                   lr_step
    save:DIR             save_state(DIR); the extras go to DIR/extras.json
    load:DIR             load_state(DIR, DIR/extras.json)
    weights:FILE         weights() written as safetensors
    greedy:FILE          greedy answers of :func:`make_prompts`, as JSON
    export:DIR           export_hf(DIR)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from pipeline.records import RolloutGroup, ScoredGroup


def make_groups(seed: int, *, groups: int = 3, group_size: int = 4, vocab: int = 16) -> list[ScoredGroup]:
    """Scored groups with prompts and completions of different lengths, every group with signal."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        plen = int(rng.integers(4, 9))
        lens = rng.integers(1, 7, size=group_size).astype(np.int32)
        n = int(lens.sum())
        rewards = rng.integers(0, 2, size=group_size).astype(np.float32)
        rewards[0], rewards[1] = 1.0, 0.0
        ro = RolloutGroup(
            prompt_id=f"p{seed}-{g}", group_id=f"p{seed}-{g}:gen-0:1", generator_id="gen-0", prompt="x" * plen,
            prompt_ids=rng.integers(2, vocab, size=plen).astype(np.int32), reference="0",
            completions=tuple("x" * (int(k) - 1) for k in lens), completion_ids=rng.integers(1, vocab, size=n).astype(np.int32),
            completion_lens=lens, behaviour_logprobs=-rng.uniform(0.5, 3.0, size=n).astype(np.float32),
            min_version=0, max_version=0, created_at=0.0)
        out.append(ScoredGroup(rollout=ro, verifier_names=("v",), votes=rewards[:, None].copy(), rewards=rewards,
                               truth=rewards.copy(), reward_mode="weaver", labelmodel_version=-1, verifier_id="ver-0",
                               scored_at=0.0))
    return out


def states_a_number(prompts, completions, reference, extracted, **kw) -> list[float]:
    """A labelled reward (``verifier.reward = "<this file>:states_a_number"``) for the SmolLM2
    ``pipeline up`` test: 1 when the completion states a number at all (``task.answer_extract =
    "last_number"``). A base chat model at temperature 1 does so in some samples of a group and
    not in others, so groups carry signal and the run's steps train; its right answers are too
    rare for that within a test's few steps."""
    return [0.0 if e is None else 1.0 for e in extracted]


def make_prompts(vocab: int = 16) -> list[np.ndarray]:
    """Held-out-like prompts of two lengths."""
    rng = np.random.default_rng(99)
    return [rng.integers(2, vocab, size=int(k)).astype(np.int32) for k in (5, 7, 5, 6, 7)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--out", default=".")
    ap.add_argument("--set", action="append", default=[], help="config override section.field=value")
    ap.add_argument("actions", nargs="*")
    a = ap.parse_args()

    from pipeline.engines.titan import TitanEngine, follow
    from pipeline.config import load_config

    overrides = dict(kv.split("=", 1) for kv in a.set)
    cfg = load_config(None, {"model.base_dir": a.base, "trainer.backend": "torchtitan",
                             "trainer.nproc": os.environ.get("WORLD_SIZE", "1"), "trainer.device": "cpu", **overrides})
    if int(os.environ.get("RANK", "0")) > 0:
        follow(cfg)
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = TitanEngine(cfg)
    try:
        for action in a.actions:
            kind, _, arg = action.partition(":")
            t0 = time.perf_counter()
            if kind == "train":
                seed, groups, size = (arg.split(":") + ["3", "4"])[:3]
                stats = engine.train_step(make_groups(int(seed), groups=int(groups), group_size=int(size),
                                                      vocab=engine.vocab_size))
                stats["seconds"] = time.perf_counter() - t0
                with open(out / "stats.jsonl", "a") as f:
                    f.write(json.dumps(stats) + "\n")
            elif kind == "lr":
                engine.lr_step()
            elif kind == "save":
                Path(arg).mkdir(parents=True, exist_ok=True)
                extras = engine.save_state(Path(arg))
                (Path(arg) / "extras.json").write_text(json.dumps(extras))
            elif kind == "load":
                engine.load_state(Path(arg), json.loads((Path(arg) / "extras.json").read_text()))
            elif kind == "weights":
                from safetensors.torch import save_file
                # Copies: a tied head is the embedding's tensor, which safetensors will not write twice.
                save_file({k: v.detach().clone().contiguous() for k, v in engine.weights().items()}, arg)
            elif kind == "greedy":
                Path(arg).write_text(json.dumps(engine.greedy(make_prompts(engine.vocab_size), max_new_tokens=4)))
            elif kind == "export":
                engine.export_hf(Path(arg))
            else:
                raise SystemExit(f"unknown action {action!r}")
            print(f"rank 0: {action} done in {time.perf_counter() - t0:.2f}s", flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
