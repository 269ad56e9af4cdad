"""Held-out episodes: the policy plays each held-out prompt through the environment, greedily.

With ``env.kind`` set, what a run is judged on is the episode's outcome, not the first
turn's text (a calculator policy's first turn is a tool call, which single-turn accuracy
would count wrong). :func:`play` runs the episodes the way the generator does: the model
samples until its eos, the turn's text (up to the eos) is the action, the observation's
token ids are appended exactly as encoded, until the environment says done, ``max_turns``
model turns, or the completion's token budget (observation tokens included) has no room
for another turn. The trainer's held-out evaluation calls it with temperature 0 when the
run has an environment (``heldout_accuracy`` is then the episodes' mean environment
reward, a missing reward counting 0, beside the held-out tool-call rate and turns).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.envs.base import EnvFactory, Step
from pipeline.records import PromptTask


@dataclass
class Played:
    """One held-out episode's outcome."""

    reward: float
    """The last reward the environment gave (NaN: none)."""
    turns: int
    tool_calls: int
    tool_calls_ok: int
    error: str | None = None
    """Why the episode ended early (its environment raised), else None."""
    completion: list[int] | None = None
    """The token ids after the prompt: sampled turns (each ending in eos) and observations."""


def play(model, tokenizer, prompts: list[np.ndarray], references: list[str], factory: EnvFactory, *,
         max_turns: int, max_new_tokens: int, temperature: float = 0.0,
         generator: torch.Generator | None = None, texts: list[str] | None = None) -> list[Played]:
    """One episode per prompt (token ids, as the model reads them), all turns batched across
    the episodes still running. ``texts``: the prompts as the task wrote them, which the
    environment is given (as the feeder's record gives them); default: the ids decoded."""
    from pipeline.engines.torch import sample_prompts

    n = len(prompts)
    out = [Played(reward=math.nan, turns=0, tool_calls=0, tool_calls_ok=0) for _ in range(n)]
    episodes, seqs, used, live = [], [], [0] * n, []
    for i, (ids, ref) in enumerate(zip(prompts, references)):
        text = texts[i] if texts is not None else tokenizer.decode(list(ids))
        task = PromptTask(prompt_id=f"heldout-{i}", prompt=text, prompt_ids=np.asarray(ids, dtype=np.int32),
                          reference=ref, issued_at=time.time())
        try:
            ep = factory(task)
            episodes.append(ep)
            first = _encode(tokenizer, ep.reset())[: max_new_tokens - 1]
        except Exception as e:  # noqa: BLE001 - an environment that cannot start: the episode is unrewarded
            episodes.append(None)
            out[i].error = f"{type(e).__name__}: {e}"
            seqs.append(list(ids))
            continue
        seqs.append(list(ids) + first)
        used[i] = len(first)
        live.append(i)
    eos = tokenizer.eos_id
    while live:
        budget = max(max_new_tokens - used[i] for i in live)
        sampled = sample_prompts(model, [np.asarray(seqs[i], dtype=np.int32) for i in live], n=1,
                                 max_new_tokens=budget, temperature=temperature, eos_id=eos,
                                 pad_id=tokenizer.pad_id, generator=generator)
        still = []
        for i, s in zip(live, sampled):
            room = max_new_tokens - used[i]
            toks = s.tokens[0][: min(int(s.lengths[0]), room)].tolist()
            seqs[i] += toks
            used[i] += len(toks)
            out[i].turns += 1
            if not (toks and toks[-1] == eos and used[i] < max_new_tokens):
                continue  # the budget ended the completion mid-turn (or at its last token): no step
            action = tokenizer.decode(toks[:-1])
            try:
                step = episodes[i].step(action)
                if not isinstance(step, Step):
                    raise TypeError(f"step returned {type(step).__name__}, not a Step")
                obs = _encode(tokenizer, step.observation)
            except Exception as e:  # noqa: BLE001 - a failing step ends the episode, as env.on_error "end"
                out[i].error = f"{type(e).__name__}: {e}"
                continue
            if step.tool_call:
                out[i].tool_calls += 1
                out[i].tool_calls_ok += step.tool_ok is not False
            if step.reward is not None:
                out[i].reward = float(step.reward)
            if step.done or out[i].turns >= max_turns or used[i] + len(obs) >= max_new_tokens:
                continue
            seqs[i] += obs
            used[i] += len(obs)
            still.append(i)
        live = still
    for i, p in enumerate(out):
        p.completion = seqs[i][len(prompts[i]):]
    for ep in episodes:
        if ep is not None:
            try:
                ep.close()
            except Exception:  # noqa: BLE001 - a failed close loses nothing
                pass
    return out


def summarise(played: list[Played]) -> dict:
    """The held-out metrics of a set of episodes: success (mean reward, none counting 0), the
    share of episodes with a tool call, calls answered, turns, and environment errors."""
    rewards = np.array([0.0 if math.isnan(p.reward) else p.reward for p in played])
    calls = np.array([p.tool_calls for p in played])
    ok = int(sum(p.tool_calls_ok for p in played))
    return {"heldout_accuracy": float(rewards.mean()) if rewards.size else 0.0,
            "heldout_tool_call_rate": float((calls > 0).mean()) if calls.size else 0.0,
            "heldout_tool_call_success": ok / int(calls.sum()) if calls.sum() else None,
            "heldout_turns_mean": float(np.mean([p.turns for p in played])) if played else 0.0,
            "heldout_env_errors": sum(p.error is not None for p in played)}


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text)) if text else []
