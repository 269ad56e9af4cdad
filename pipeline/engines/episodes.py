"""Held-out episodes: the policy plays each held-out prompt through the environment, greedily.

With ``env.kind`` set, what a run is judged on is the episode's outcome, not the first
turn's text (a calculator policy's first turn is a tool call, which single-turn accuracy
would count wrong). :func:`play` runs the episodes on the generator's own slot sampler
(pipeline.engines.slots), so by the generator's rules: the model samples until its eos, the
turn's text (up to the eos) is the action, the observation's token ids are appended (its raw
encoding, or with ``chat`` a turn of the chat template, pipeline.envs.chat), until the
environment says done, ``max_turns`` model turns, or the completion's token budget
(observation tokens included) has no room for another turn; a turn reaching
``max_turn_tokens`` without an eos ends there. The trainer's held-out
evaluation calls it with temperature 0 when the
run has an environment (``heldout_accuracy`` is then the episodes' mean environment
reward, a missing reward counting 0, beside the held-out tool-call rate and turns).

Held-out episode ``i`` has the prompt id ``heldout-i`` and is reset with the seed
``episode_seed(seed, "heldout-i")`` (pipeline.envs.base: the generator's derivation), so the
held-out set is the same games at every evaluation; ``seed`` defaults to 0, which the
trainer's engines use, so runs that share a held-out set also share its games.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.engines.slots import SlotSampler
from pipeline.envs.base import EnvFactory, Step, encode_text, episode_seed, reset_episode
from pipeline.envs.chat import ChatTurns
from pipeline.records import PromptTask


@dataclass
class Played:
    """One held-out episode's outcome."""

    reward: float
    """The last reward the environment gave (NaN: none)."""
    turns: int
    tool_calls: int
    tool_calls_ok: int
    completion: list[int]
    """The token ids after the prompt: sampled turns (each ending in eos) and observations."""
    prompt: list[int] | None = None
    """The prompt the completion continues (with ``chat`` and a reset text: the prompt without
    its generation prompt, which the first observation then holds); None until it starts."""
    error: str | None = None
    """Why the episode ended early (its environment raised), else None."""


SLOTS = 64
"""Held-out episodes decoded together at most (the slot sampler's KV cache holds this many)."""


def play(model, tokenizer, prompts: list[np.ndarray], references: list[str], factory: EnvFactory, *,
         max_turns: int, max_new_tokens: int, temperature: float = 0.0,
         generator: torch.Generator | None = None, texts: list[str] | None = None,
         chat: ChatTurns | None = None, seed: int = 0, max_turn_tokens: int = 0) -> list[Played]:
    """One episode per prompt (token ids, as the model reads them), decoded together by the
    generator's own slot sampler (pipeline.engines.slots: its turn, turn-limit and token-budget
    rules), each ended turn stepped in the environment at once. ``texts``: the prompts as the
    task wrote them, which the environment is given (as the feeder's record gives them);
    default: the ids decoded. ``chat``: the observations as turns of the checkpoint's chat
    template (None: their raw encoding, the reset text right after the prompt). ``seed``: the
    run seed the held-out prompt ids are hashed with into each episode's reset seed (see the
    module docstring). ``max_turn_tokens``: tokens per model turn at most (``env.max_turn_tokens``;
    0: none)."""
    n = len(prompts)
    chat = chat if chat is None else chat.for_factory(factory)
    out = [Played(reward=math.nan, turns=0, tool_calls=0, tool_calls_ok=0, completion=[]) for _ in range(n)]
    sampler = SlotSampler(model, slots=max(1, min(n, SLOTS)), temperature=temperature, eos_id=tokenizer.eos_id,
                          pad_id=tokenizer.pad_id, generator=generator)
    episodes: dict[int, object] = {}
    todo = list(range(n - 1, -1, -1))

    def finished(f) -> None:
        out[f.key].turns, out[f.key].completion = f.turns[0], list(f.tokens[0])

    while todo or sampler.rows:
        while todo and sampler.free > 0:
            i = todo.pop()
            text = texts[i] if texts is not None else tokenizer.decode(list(prompts[i]))
            ids = np.asarray(prompts[i], dtype=np.int32)
            try:
                pid = f"heldout-{i}"
                episodes[i] = factory(PromptTask(prompt_id=pid, prompt=text, prompt_ids=ids,
                                                 reference=references[i], issued_at=time.time()))
                reset = reset_episode(episodes[i], episode_seed(seed, pid))
                if chat is None:
                    first = encode_text(tokenizer, reset)
                else:
                    ids, (first,) = chat.first(ids, [reset], text=text)
            except Exception as e:  # noqa: BLE001 - an environment that cannot start: the episode is unrewarded
                out[i].error = f"{type(e).__name__}: {e}"
                continue
            out[i].prompt = [int(x) for x in ids]
            sampler.set_max_turns(i, max_turns, max_turn_tokens)
            f = sampler.add(i, ids, n=1, max_new_tokens=max_new_tokens, version=0, observations=[first])
            if f is not None:
                finished(f)
        for f in sampler.step(0):
            finished(f)
        for i, _, action in sampler.turn_ended():
            obs, done = [], True
            try:
                step = episodes[i].step(tokenizer.decode(action))
                if not isinstance(step, Step):
                    raise TypeError(f"step returned {type(step).__name__}, not a Step")
                obs = encode_text(tokenizer, step.observation) if chat is None else chat.step_ids(step)
                done = step.done
            except Exception as e:  # noqa: BLE001 - a failing step ends the episode, as env.on_error "end"
                out[i].error = f"{type(e).__name__}: {e}"
            else:
                if step.tool_call:
                    out[i].tool_calls += 1
                    out[i].tool_calls_ok += step.tool_ok is not False
                if step.reward is not None:
                    out[i].reward = float(step.reward)
            f = sampler.observe(i, 0, obs, done=done, version=0)
            if f is not None:
                finished(f)
    for ep in episodes.values():
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
