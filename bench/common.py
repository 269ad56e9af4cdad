"""What the benchmark scripts share: timestamped progress lines, and writing a result with
the command line that reproduces it."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def progress(name: str) -> Callable[[str], None]:
    """A ``say(msg)`` that prints ``[<name> HH:MM:SS] msg`` at once."""

    def say(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    return say


def save_result(path: str | Path, result: dict, *, script: str, argv: Sequence[str] | None) -> dict:
    """Record in ``result`` the command that produced it (``python <script> <args>``), write it as JSON."""
    result["command"] = " ".join([f"python {script}", *(argv if argv is not None else sys.argv[1:])])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def slot_generate(model, prompts: list, *, n: int, max_new: int, eos_id: int, pad_id: int, rng):
    """Tokens the slot sampler samples from ``prompts`` (token id arrays), ``n`` per prompt, one
    slot per sequence; returns (tokens, finished groups)."""
    from pipeline.engines.slots import SlotSampler  # torch: deferred, the other helpers here need none

    s = SlotSampler(model, slots=len(prompts) * n, temperature=1.0, eos_id=eos_id, pad_id=pad_id, generator=rng)
    done = []
    for i, p in enumerate(prompts):
        f = s.add(i, p, n=n, max_new_tokens=max_new, version=0)
        if f is not None:
            done.append(f)
    while s.active:
        done += s.step(0)
    if len(done) != len(prompts):
        raise RuntimeError(f"the slot sampler returned {len(done)} of {len(prompts)} groups")
    return sum(len(t) for f in done for t in f.tokens), done
