"""A cold start for tool use: the supervised warm-up of a base that knows the calculator's
call format but rarely uses it.

RL can only raise the rate of a behaviour the policy already samples. A base warmed up on
direct answers alone never writes ``1234+5678=``; one warmed up on tool transcripts alone
always does, and leaves RL nothing to learn. ``warm_up_tool_use`` teacher-forces a mixture:
a share ``tool_rate`` of the problems as a two-turn calculator episode, the rest as a direct
answer, so the base's own tool-call rate starts near ``tool_rate`` and its success near the
direct answers'. Those must be poor for the tool to matter: measured here, 600 steps × 128
of this warm-up teach the tiny model 4-digit sums directly (0.69 held-out greedy), while
4-digit products stay at 0.000, so the defaults are the calculator experiment's recipe
(bench/calculator.py: 4-digit multiplication, 30% transcripts, 500 steps × 64). A tool transcript is what the calculator episode itself returns, laid out
as the generator lays out an episode::

    prompt "1234*5678="  |  call "1234*5678=" eos | observation "7006652" | answer "7006652" eos

and the observation's tokens carry no loss (the model never learns to predict the tool's
output, only to ask for it and to copy it), exactly as the trainer masks them in RL.
Held-out problems are never trained on: the caller passes the task's held-out set.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pipeline.envs.calculator import CalculatorEpisode
from pipeline.model.pretrain import DEFAULT_SHAPE, LOSS_WINDOW, WARMUP_STEPS, lr_factor
from pipeline.model.qwen import ModelShape, build_model, completion_logprobs, num_parameters, save_checkpoint
from pipeline.model.tokenizer import CharTokenizer
from pipeline.tasks import arithmetic as task


def transcript(tok: CharTokenizer, p: task.Problem, *, tool: bool) -> tuple[list[int], list[int]]:
    """(completion ids, loss mask) of ``p`` answered directly, or through one calculator call."""
    answer = tok.encode(p.answer) + [tok.eos_id]
    if not tool:
        return answer, [1] * len(answer)
    call = f"{p.a}{p.op}{p.b}="
    obs = CalculatorEpisode(p.answer).step(call).observation
    head, seen = tok.encode(call) + [tok.eos_id], tok.encode(obs)
    return head + seen + answer, [1] * len(head) + [0] * len(seen) + [1] * len(answer)


def warm_up_tool_use(out_dir: str | Path, *, heldout: Sequence[task.Problem], digits: int = 4,
                     ops: Sequence[str] = ("*",), tool_rate: float = 0.3, steps: int = 500, batch_size: int = 64,
                     lr: float = 2e-3, seed: int = 0, shape: ModelShape = DEFAULT_SHAPE, threads: int | None = 1,
                     log: Callable[[str], object] = print, every: int = 50) -> dict:
    """Train a fresh char model on the mixture and save it as a checkpoint in ``out_dir``;
    returns (and writes as ``out_dir/tool_warmup.json``) the recipe and the loss curve."""
    if not 0.0 <= tool_rate <= 1.0:
        raise ValueError(f"tool_rate must be in [0, 1], got {tool_rate}")
    if not heldout:
        raise ValueError("heldout must not be empty: those problems are kept out of the warm-up")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        tok = CharTokenizer()
        model = build_model(shape, tok.vocab_size, seed=seed)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98))
        problems = task.training_problems(seed=seed, digits=digits, ops=tuple(ops), exclude=set(heldout))
        choose = random.Random(seed + 1)
        losses, t0 = [], time.perf_counter()
        log(f"tool warm-up: {num_parameters(model):,} parameters, {steps} steps x {batch_size}, "
            f"tool transcripts {tool_rate:.0%}, seed {seed}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for step in range(steps):
                for g in opt.param_groups:
                    g["lr"] = lr * lr_factor(step, steps=steps, warmup=WARMUP_STEPS, schedule="constant")
                batch = [next(problems) for _ in range(batch_size)]
                rows = [transcript(tok, p, tool=choose.random() < tool_rate) for p in batch]
                width = max(len(ids) for ids, _ in rows)
                comp = torch.tensor([ids + [tok.pad_id] * (width - len(ids)) for ids, _ in rows])
                mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.float32)
                prompts = torch.tensor([tok.encode(p.prompt) for p in batch])
                loss = -(completion_logprobs(model, prompts, comp) * mask).sum() / mask.sum()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                if every and ((step + 1) % every == 0 or step + 1 == steps):
                    log(f"tool warm-up step {step + 1}/{steps}: loss {_mean_tail(losses):.4f}")
        model.eval()
        save_checkpoint(model, tok, out_dir)
    finally:
        torch.set_num_threads(previous)
    info = {"digits": digits, "ops": list(ops), "tool_rate": tool_rate, "steps": steps, "batch_size": batch_size,
            "lr": lr, "seed": seed, "heldout_excluded": len(heldout), "final_loss": _mean_tail(losses),
            "loss_every_50": losses[::50], "seconds": round(time.perf_counter() - t0, 1)}
    (Path(out_dir) / "tool_warmup.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


def _mean_tail(losses: list[float]) -> float:
    """The mean training loss of the last ``LOSS_WINDOW`` steps (or of all of them, if fewer)."""
    tail = losses[-LOSS_WINDOW:]
    return sum(tail) / len(tail)
