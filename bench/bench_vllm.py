"""Generation throughput of the ``vllm`` backend against the ``torch`` backend, same model,
same prompts, same process, measured one after the other.

Each backend is built through ``make_generation_backend`` exactly as a generator builds it
(``generator.threads`` torch threads, float32), warmed up, then timed in ``--repeats``
interleaved rounds (torch, vllm, torch, vllm, ... so both see the same load on a shared
machine; medians reported) on two batch shapes: the generator's default batch
(``prompts_per_batch`` 16 prompts x ``group_size`` 8, 3-digit addition, ``max_new_tokens``
6) and a wide one (``--wide`` prompts x 8). Tokens counted are generated tokens (eos included), as the
generator's ``tokens_generated_total`` counts them. A weight swap of the same tensors is
timed too. Needs vLLM (the vllm lane's venv: ``bash ops/ci/vllm_lane.sh``).

    python bench/bench_vllm.py [--base-dir artifacts/base-model] [--repeats 5] [--wide 128]
                               [--out bench/results/vllm.json]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from common import progress, save_result

say = progress("bench-vllm")


def _prompts(tok, n: int, seed: int) -> list[np.ndarray]:
    from pipeline.tasks import arithmetic as task

    rng = random.Random(seed)
    return [np.asarray(tok.encode(task.random_problem(rng, digits=3, ops=("+",)).prompt), dtype=np.int32)
            for _ in range(n)]


def timed_batch(backend, prompts, *, n: int, max_new: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    samples = backend.generate(prompts, n=n, max_new_tokens=max_new, temperature=1.0)
    return int(sum(int(s.lengths.sum()) for s in samples)), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-dir", default=str(ROOT / "artifacts" / "base-model"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--wide", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm.json"))
    args = ap.parse_args(argv)

    import torch
    from safetensors.torch import load_file

    from pipeline.engines import make_generation_backend
    from pipeline.config import load_config

    if not (Path(args.base_dir) / "model.safetensors").exists():
        raise SystemExit(f"no checkpoint in {args.base_dir}: run `make pretrain` first")
    result: dict = {"base_dir": args.base_dir, "repeats": args.repeats, "torch_version": torch.__version__}
    backends, cfg = {}, None
    for kind in ("torch", "vllm"):
        cfg = load_config(overrides={"model.base_dir": args.base_dir, "generator.backend": kind,
                                     "generator.vllm_dtype": "float32", "generator.vllm_kv_cache_gib": 0.5})
        say(f"building the {kind} backend")
        t0 = time.perf_counter()
        backends[kind] = make_generation_backend(cfg, worker_id="bench")
        result[kind] = {"start_s": round(time.perf_counter() - t0, 1)}
        say(f"{kind} backend ready in {result[kind]['start_s']} s")
    g = cfg.generator
    shapes = {"default": g.prompts_per_batch, "wide": args.wide}
    prompts = {shape: _prompts(backends["torch"].tokenizer, k, seed=1) for shape, k in shapes.items()}
    for b in backends.values():  # warm-up
        for p in prompts.values():
            b.generate(p, n=g.group_size, max_new_tokens=cfg.task.max_new_tokens, temperature=1.0)
    # Interleaved rounds on a shared machine: both backends see the same load; medians reported.
    rates: dict = {(k, s): [] for k in backends for s in shapes}
    for r in range(args.repeats):
        for shape in shapes:
            for kind, b in backends.items():
                tokens, sec = timed_batch(b, prompts[shape], n=g.group_size, max_new=cfg.task.max_new_tokens)
                rates[kind, shape].append((tokens / sec, sec))
        say(f"round {r + 1}/{args.repeats}: " + ", ".join(
            f"{k} {s} {rates[k, s][-1][0]:.0f} tok/s" for k in backends for s in shapes))
    for (kind, shape), xs in rates.items():
        result[kind][shape] = {"prompts": shapes[shape], "group_size": g.group_size,
                               "tokens_per_s_median": round(float(np.median([x for x, _ in xs])), 1),
                               "batch_ms_median": round(1000 * float(np.median([t for _, t in xs])), 2),
                               "tokens_per_s_rounds": [round(x, 1) for x, _ in xs]}
    tensors = load_file(str(Path(args.base_dir) / "model.safetensors"))
    for kind, b in backends.items():
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            b.load_weights(tensors)
        result[kind]["load_weights_ms"] = round(1000 * (time.perf_counter() - t0) / args.repeats, 2)
        say(f"{kind} load_weights: {result[kind]['load_weights_ms']} ms")
        b.close()
    import vllm

    result["vllm_version"] = vllm.__version__
    for shape in ("default", "wide"):
        ratio = result["vllm"][shape]["tokens_per_s_median"] / result["torch"][shape]["tokens_per_s_median"]
        result[f"vllm_over_torch_{shape}"] = round(ratio, 2)
        say(f"{shape}: vllm / torch tokens/s = {ratio:.2f}")
    save_result(args.out, result, script="bench/bench_vllm.py", argv=argv)
    say(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
