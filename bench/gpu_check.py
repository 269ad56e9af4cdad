"""One-GPU check of the scale backends on a randomly initialised ~0.6B Qwen3 (no hub access).

Run by ``ops/gpu_check.sh`` after it installs requirements/gpu.txt. Phases, each timed and
written to the JSON file as soon as it ends (so a run cut short still reports what it did):

1. ``build``    synthetic math prompts and ``init-model --preset qwen3-0.6b`` (BPE tokenizer
                trained here, 151 936-row embedding, untied, random weights, bfloat16 on disk)
2. ``vllm``     vLLM offline engine (``generator.backend = vllm``): tokens/s sampling
                ``--prompts`` prompts x ``--n`` completions of up to ``--max-tokens`` tokens
3. ``weights``  the weight path a new version takes: publish (snapshot into shm buckets with
                CRC-32C), fetch + verify, ``load_weights`` into the running vLLM engine
4. ``e2e``      ``pipeline up`` with the vllm generator, the torchtitan trainer (FSDP2, NCCL,
                1 rank) and the Weaver verifier on the math task for ``--steps`` steps:
                wall time, median trainer step time, swaps seen by the generator

    python bench/gpu_check.py --out gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def say(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Report:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = {"started_at": time.time(), "phases": {}}
        self.write()

    def phase(self, name: str, result: dict) -> None:
        self.data["phases"][name] = result
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)


def environment() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1))
    for mod in ("vllm", "torchtitan", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            info[mod] = f"unavailable: {e}"
    return info


def build(work: Path, args) -> dict:
    from pipeline.model.init_model import corpus, init_model, synthetic_math_rows, write_rows

    t0 = time.perf_counter()
    rows = synthetic_math_rows(3000, seed=0)
    data = write_rows(rows, work / "math.jsonl")
    summary = init_model(work / "model", preset=args.preset, texts=corpus(rows), tokenizer_vocab=4096, seed=0,
                         dtype="bfloat16")
    return {"seconds": time.perf_counter() - t0, "dataset": str(data), **summary}


def shared_settings(work: Path) -> dict[str, str]:
    """Config overrides both the vLLM phase and the end-to-end run use: the model, the math
    task and the vLLM engine (the e2e run gives vLLM a smaller share of the GPU)."""
    return {"model.base_dir": str(work / "model"), "task.kind": "math", "task.dataset": str(work / "math.jsonl"),
            "task.template": "{problem} Put the answer in \\boxed{}.", "task.heldout_size": "64",
            "task.max_new_tokens": "128", "generator.backend": "vllm", "generator.vllm_dtype": "bfloat16",
            "generator.vllm_gpu_memory_utilization": "0.35", "generator.vllm_max_model_len": "512"}


def run_config(work: Path):
    from pipeline.config import load_config

    return load_config(None, shared_settings(work))


def vllm_phase(work: Path, args) -> tuple[dict, object]:
    import numpy as np

    from pipeline.engines.vllm import VllmGenerator

    cfg = run_config(work)
    t0 = time.perf_counter()
    gen = VllmGenerator(cfg, worker_id="gpu-check")
    load_s = time.perf_counter() - t0
    tok = gen.tokenizer
    from pipeline.tasks.registry import make_task

    items = make_task(cfg.task).heldout()
    prompts = [np.asarray(tok.encode(items[i % len(items)].prompt), dtype=np.int32) for i in range(args.prompts)]
    gen.generate(prompts[:4], n=2, max_new_tokens=8, temperature=1.0)  # warm-up
    t0 = time.perf_counter()
    out = gen.generate(prompts, n=args.n, max_new_tokens=args.max_tokens, temperature=1.0)
    sec = time.perf_counter() - t0
    tokens = int(sum(int(s.lengths.sum()) for s in out))
    return {"engine_load_seconds": load_s, "prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens,
            "tokens": tokens, "seconds": sec, "tokens_per_second": tokens / sec}, gen


def weights_phase(work: Path, gen) -> dict:
    import torch
    from safetensors.torch import load_file

    from pipeline.keys import Keys
    from pipeline.bus.server import start_local_server
    from pipeline.bus.connection import connect
    from pipeline.weights import make_fetcher, make_publisher

    server = start_local_server(work / "redis")
    try:
        r = connect(server.url, name="gpu-check")
        keys = Keys("gpucheck")
        tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(work / "model" / "model.safetensors")).items()}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        pub = make_publisher("shm", r, keys.weights, ns=keys.ns, keep_versions=2)
        fetcher = make_fetcher("shm", r, keys.weights)
        rows = []
        try:
            for version in (1, 2, 3):
                t0 = time.perf_counter()
                pub.publish(version, tensors)
                t1 = time.perf_counter()
                _, got = fetcher.fetch(version, copy=False)
                t2 = time.perf_counter()
                gen.load_weights(got)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                t3 = time.perf_counter()
                rows.append({"publish_s": t1 - t0, "fetch_verify_s": t2 - t1, "load_weights_s": t3 - t2,
                             "total_s": t3 - t0})
        finally:
            fetcher.close()
            pub.close()
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        return {"transport": "shm", "bytes": nbytes, "versions": rows, "median": med,
                "gb_per_s_end_to_end": nbytes / med["total_s"] / 1e9}
    finally:
        server.stop()


def e2e_phase(work: Path, args) -> dict:
    runs = work / "runs"
    settings = {**shared_settings(work), "verifier.verifiers": "boxed,boxed_numeric,boxed_majority,math_equiv",
                "generator.vllm_gpu_memory_utilization": "0.3", "generator.group_size": "8",
                "generator.prompts_per_batch": "32", "trainer.backend": "torchtitan", "trainer.device": "auto",
                "trainer.nproc": "1", "trainer.steps": str(args.steps), "trainer.groups_per_step": "16",
                "trainer.eval_every": "1000", "trainer.checkpoint_every": "1000", "cluster.generators": "1",
                "cluster.verifiers": "1", "feeder.backlog": "64", "verifier.min_fit_rows": "32",
                "cluster.timeout_s": str(args.e2e_timeout)}
    cmd = [sys.executable, "-m", "pipeline.cli", "up", "--run-id", "gpu-e2e", "--runs_dir", str(runs),
           *(item for name, value in settings.items() for item in (f"--{name}", value))]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.e2e_timeout + 60, cwd=ROOT)
    wall = time.perf_counter() - t0
    out: dict = {"returncode": p.returncode, "wall_seconds": wall, "output_tail": p.stdout[-2000:] + p.stderr[-2000:]}
    run = runs / "gpu-e2e"
    if (run / "summary.json").is_file():
        s = json.loads((run / "summary.json").read_text())
        out.update(status=s.get("status"), steps=s.get("steps"), accounting_ok=s.get("accounting", {}).get("ok"))
    if (run / "metrics.jsonl").is_file():
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
        secs = [row["step_seconds"] for row in steps if "step_seconds" in row]
        if secs:
            out.update(trainer_step_seconds_median=statistics.median(secs), trainer_step_seconds=secs)
    swaps = []
    for f in (run / "logs").glob("gen-*.jsonl") if (run / "logs").is_dir() else []:
        for line in f.read_text().splitlines():
            if '"weights_swapped"' in line:
                swaps.append(json.loads(line).get("seconds"))
    if swaps:
        out.update(generator_swaps=len(swaps), generator_swap_seconds_median=statistics.median(swaps))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--work", default="/tmp/rlpipe-gpu-check")
    ap.add_argument("--preset", default="qwen3-0.6b", help="model shape (tiny: a CPU smoke test of the script)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--e2e-timeout", type=int, default=240)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    report = Report(Path(args.out).resolve())
    report.data["environment"] = environment()
    report.write()
    gen = None
    for name in ("build", "vllm", "weights", "e2e"):
        say(f"phase {name} ...")
        t0 = time.perf_counter()
        try:
            if name == "build":
                result = build(work, args)
            elif name == "vllm":
                result, gen = vllm_phase(work, args)
            elif name == "weights":
                if gen is None:
                    raise RuntimeError("no vLLM engine (the vllm phase failed)")
                result = weights_phase(work, gen)
                gen.close()
                gen = None
                import gc

                gc.collect()
            else:
                result = e2e_phase(work, args)
        except Exception as e:  # noqa: BLE001 - recorded; the next phases still run
            result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        result["phase_seconds"] = time.perf_counter() - t0
        report.phase(name, result)
        say(f"phase {name} done in {result['phase_seconds']:.1f} s: "
            + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()
                        if k not in ("traceback", "output_tail", "versions", "trainer_step_seconds"))[:600])
    report.data["finished_at"] = time.time()
    report.write()
    say(f"wrote {report.path}")
    return 0 if all("error" not in p for p in report.data["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
