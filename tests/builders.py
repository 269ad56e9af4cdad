"""Keyword-only builders of valid records for tests, and a log that keeps what a stage logs."""

from __future__ import annotations

import time

import numpy as np

from pipeline.records import PromptTask, RolloutGroup, ScoredGroup


def make_prompt(*, prompt_id: str = "p00000001", prompt: str = " 12+345=", reference: str = "357") -> PromptTask:
    return PromptTask(prompt_id=prompt_id, prompt=prompt, prompt_ids=np.arange(8, dtype=np.int32) % 17,
                      reference=reference, issued_at=time.time())


def make_rollout(*, prompt_id: str = "p00000001", version: int = 0, group_size: int = 4,
                 completions: tuple[str, ...] | None = None) -> RolloutGroup:
    completions = completions or tuple(["357", "356", "357", "12"][i % 4] for i in range(group_size))
    lens = np.array([len(c) + 1 for c in completions], dtype=np.int32)
    n = int(lens.sum())
    return RolloutGroup(
        prompt_id=prompt_id, group_id=f"{prompt_id}:gen-0:1", generator_id="gen-0", prompt=" 12+345=",
        prompt_ids=np.arange(8, dtype=np.int32) % 17, reference="357", completions=completions,
        completion_ids=(np.arange(n, dtype=np.int32) % 10) + 2, completion_lens=lens,
        behaviour_logprobs=-np.linspace(0.1, 2.0, n).astype(np.float32),
        min_version=version, max_version=version, created_at=time.time())


def make_scored(*, prompt_id: str = "p00000001", version: int = 0, rewards=None) -> ScoredGroup:
    ro = make_rollout(prompt_id=prompt_id, version=version)
    g = ro.group_size
    rewards = np.asarray(rewards if rewards is not None else [1, 0, 1, 0][:g], dtype=np.float32)
    return ScoredGroup(rollout=ro, verifier_names=("format", "mod9"), votes=np.ones((g, 2), dtype=np.float32),
                       rewards=rewards, truth=rewards.copy(), reward_mode="weaver", labelmodel_version=3,
                       verifier_id="ver-0", scored_at=time.time())


def build_code_model(out):
    """A tiny checkpoint at ``out`` for the code task: its byte-level BPE tokenizer trained on the
    task's prompts and solutions, warmed up for a few steps so its turns end (an eos) and the
    environment steps."""
    from pipeline.config import load_config
    from pipeline.model.init_model import init_model, warm_up
    from pipeline.tasks import code as ct

    rows = ct.sample_rows(load_config(overrides={"task.kind": "code", "task.heldout_size": 4}).task, 200, seed=5)
    texts = [r["problem"] for r in rows] + [r["answer"] for r in rows] + ["6 of 6 tests failed: -> AssertionError()"]
    init_model(out, preset="tiny", texts=texts, tokenizer_vocab=512, seed=0)
    warm_up(out, [{"problem": r["problem"], "answer": "x"} for r in rows], template="{problem}", steps=25,
            batch_size=8, seed=0)
    return out


class RecordingLog:
    """A stage's log (``log.info(event, **fields)``, any level) that keeps every line in
    ``events``: ``(event, fields)``, or ``(level, event, fields)`` with ``levels=True``."""

    def __init__(self, *, levels: bool = False) -> None:
        self.levels = levels
        self.events: list[tuple] = []

    def __getattr__(self, level: str):
        if level.startswith("__"):
            raise AttributeError(level)
        if self.levels:
            return lambda event, **kw: self.events.append((level, event, kw))
        return lambda event, **kw: self.events.append((event, kw))
