"""How far float32 logits move with the kernels' choices: the floor under the import check's tolerance.

``pipeline import-model`` compares the written checkpoint with the GGUF-read model on one
batch (pipeline/model/importer.py). Both hold the same values, so any difference is the
order of float32 sums; this script measures that order's effect directly: one model's
logits on the check batch at several torch thread counts (and on a GPU, TF32 off, when
there is one), each against the one-thread logits, absolute and as a share of the largest
|logit|. ``--checkpoint DIR`` runs an imported model; ``--config config.json`` a model of
that architecture with seeded random weights (for machines the checkpoint cannot reach).
``--burners N`` runs N busy processes beside it (load).

    python bench/import_spread.py --checkpoint artifacts/smollm2-135m-instruct --threads 1,2 --burners 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import time

import torch


def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _model(args):
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.checkpoint:
        from pipeline.model.qwen import load_checkpoint

        model, tok = load_checkpoint(args.checkpoint)
        return model, tok.encode("What is 2+3?")
    config = AutoConfig.from_pretrained(args.config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # weights of a trained model's scale, so the logits are of a trained model's size
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    return model.eval(), list(range(10, 30))


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint")
    ap.add_argument("--config")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--burners", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    model, prompt = _model(args)
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, int(model.config.vocab_size), (len(prompt),), generator=g)
    batch = torch.stack([torch.tensor(prompt), noise])
    stop = mp.Event()
    burners = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    try:
        torch.set_num_threads(1)
        ref = model(input_ids=batch, use_cache=False).logits.float()
        scale = float(ref.abs().max())
        rows = []
        for n in [int(x) for x in args.threads.split(",")]:
            torch.set_num_threads(n)
            diffs = [float((model(input_ids=batch, use_cache=False).logits.float() - ref).abs().max())
                     for _ in range(args.repeats)]
            rows.append({"where": f"cpu, {n} threads", "max_abs": max(diffs), "relative": max(diffs) / scale})
        if torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            gpu = model.to("cuda")
            out = gpu(input_ids=batch.cuda(), use_cache=False).logits.float().cpu()
            d = float((out - ref).abs().max())
            rows.append({"where": f"cuda ({torch.cuda.get_device_name()}), float32, TF32 off", "max_abs": d,
                         "relative": d / scale})
    finally:
        stop.set()
        for b in burners:
            b.join()
    machine = f"{platform.processor() or platform.machine()}, {mp.cpu_count()} cpus"
    result = {"machine": machine, "torch": torch.__version__,
              "model": args.checkpoint or args.config, "burners": args.burners, "max_abs_logit": scale,
              "batch": list(batch.shape), "rows": rows, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
