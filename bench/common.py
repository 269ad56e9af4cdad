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
