"""The torchtitan trainer engine (pipeline.engines.titan) under real ``torchrun`` launches on gloo.

Parity: two FSDP2 ranks take the same GRPO steps as the single-process torch engine.
Checkpoints: sharded safetensors written by two ranks resumes on one rank with the same next step.
Whole pipeline: ``pipeline up`` with a two-rank torchtitan trainer finishes its steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import TINY

pytest.importorskip("torchtitan")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tests.titan_ranks import make_groups, make_prompts  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
# Learning rate high enough that one Adam step moves every weight by ~1e-3: far above the
# tolerance, so a wrong gradient (even a wrong sign) fails the comparison.
SETTINGS = {"trainer.lr": "0.001", "trainer.warmup_steps": "1", "trainer.kl_coef": "0.05"}


def torchrun(nproc: int, base: Path, out: Path, *actions: str, settings: dict | None = None) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "tests.titan_ranks", "--base", str(base), "--out", str(out),
           *[f"--set={k}={v}" for k, v in (settings or SETTINGS).items()], *actions]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p.stdout


def torch_engine(base: Path):
    from pipeline.engines.torch import TorchEngine
    from pipeline.config import load_config

    return TorchEngine(load_config(None, {"model.base_dir": str(base), **SETTINGS}))


def assert_weights_close(got: dict, want: dict, *, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_two_ranks_take_the_same_steps_as_the_torch_engine(tmp_path, tiny_base_model):
    out = torchrun(2, tiny_base_model, tmp_path, "train:1", "lr", "train:2",
                   f"weights:{tmp_path / 'titan.safetensors'}")
    assert "rank 0: train:2 done" in out
    titan = load_file(str(tmp_path / "titan.safetensors"))
    titan_stats = [json.loads(line) for line in (tmp_path / "stats.jsonl").read_text().splitlines()]

    base = load_file(str(tiny_base_model / "model.safetensors"))
    # weights() hands out exactly the base checkpoint's HF names and shapes.
    assert {k: tuple(v.shape) for k, v in titan.items()} == {k: tuple(v.shape) for k, v in base.items()}

    engine = torch_engine(tiny_base_model)
    torch_stats = []
    for step, seed in enumerate((1, 2)):
        torch_stats.append(engine.train_step(make_groups(seed, vocab=engine.vocab_size)))
        if step == 0:
            engine.lr_step()
    ref = {k: v.detach().clone() for k, v in engine.weights().items()}

    moved = min(float((ref[k] - base[k]).abs().max()) for k in base)
    assert moved > 1e-4, "the reference steps must move every tensor for the comparison to mean anything"
    assert_weights_close(titan, ref)
    for got, want in zip(titan_stats, torch_stats):
        assert got["tokens"] == want["tokens"]
        for key in ("loss", "grad_norm", "entropy", "clip_frac", "ratio_mean", "mismatch_kl", "is_weight_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    # The reference-policy KL is 0 on the first step and positive once the policy moved.
    assert titan_stats[0]["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    assert titan_stats[1]["kl_ref"] == pytest.approx(torch_stats[1]["kl_ref"], rel=1e-3) and titan_stats[1]["kl_ref"] > 0


def test_more_ranks_than_completions_still_steps_correctly(tmp_path, tiny_base_model):
    """3 ranks, 1 group of 2 completions: the third rank has nothing and must still join every collective."""
    settings = {**SETTINGS, "trainer.kl_coef": "0"}
    torchrun(3, tiny_base_model, tmp_path / "three", "train:7:1:2", f"weights:{tmp_path / 'three.safetensors'}",
             settings=settings)
    torchrun(1, tiny_base_model, tmp_path / "one", "train:7:1:2", f"weights:{tmp_path / 'one.safetensors'}",
             settings=settings)
    assert_weights_close(load_file(str(tmp_path / "three.safetensors")), load_file(str(tmp_path / "one.safetensors")))


def assert_safetensors_shards(directory, *, ranks: int) -> None:
    """A distributed checkpoint is one safetensors file per rank, nothing pickled: every file
    opens with safetensors, and together they hold the model, the AdamW state and the RNG."""
    from safetensors import safe_open

    files = sorted(directory.iterdir())
    assert len(files) == ranks and all(f.suffix == ".safetensors" for f in files), [f.name for f in files]
    names = set()
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            names |= set(fh.keys())
    assert "rng" in names and any(n.startswith("model.") for n in names)
    assert any(n.endswith(".exp_avg_sq") for n in names) and any(n.endswith(".step") for n in names)


def test_sharded_checkpoint_from_two_ranks_resumes_on_one_rank(tmp_path, tiny_base_model):
    ckpt = tmp_path / "ckpt"
    torchrun(2, tiny_base_model, tmp_path / "a", "train:1", "lr", f"save:{ckpt}", "train:2",
             f"weights:{tmp_path / 'continued.safetensors'}")
    assert_safetensors_shards(ckpt / "shards", ranks=2)
    extras = json.loads((ckpt / "extras.json").read_text())
    assert extras["format"] == "sharded-safetensors" and extras["world_size"] == 2 and extras["sched"]["last_epoch"] == 1

    export = tmp_path / "export"
    torchrun(1, tiny_base_model, tmp_path / "b", f"load:{ckpt}", "train:2",
             f"weights:{tmp_path / 'resumed.safetensors'}", f"greedy:{tmp_path / 'greedy.json'}", f"export:{export}")
    continued = load_file(str(tmp_path / "continued.safetensors"))
    resumed = load_file(str(tmp_path / "resumed.safetensors"))
    # Model, Adam moments and schedule all came back: the step after the checkpoint is the same step.
    assert_weights_close(resumed, continued)
    # A fresh optimizer at the checkpoint's weights would step differently (no Adam moments).
    fresh = tmp_path / "fresh"
    torchrun(1, tiny_base_model, tmp_path / "c", f"load:{ckpt}", f"export:{fresh}")
    engine = torch_engine(fresh)
    engine.train_step(make_groups(2, vocab=engine.vocab_size))
    differs = max(float((engine.weights()[k] - continued[k]).abs().max()) for k in continued)
    assert differs > 1e-4

    # export_hf writes a loadable HF checkpoint of the current weights; greedy decodes with them.
    from pipeline.engines.torch import sample_prompts
    from pipeline.model.qwen import load_checkpoint

    model, tok = load_checkpoint(export)
    assert_weights_close({k: v for k, v in model.state_dict().items()}, resumed, rtol=0, atol=0)
    want = [tok.decode(s.tokens[0].tolist()) for s in sample_prompts(
        model, make_prompts(), n=1, max_new_tokens=4, temperature=0.0, eos_id=tok.eos_id, pad_id=tok.pad_id)]
    assert json.loads((tmp_path / "greedy.json").read_text()) == want


def up_args(tmp_path, base, run_id: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "up", "--runs_dir", str(tmp_path / "runs"), "--run-id", run_id,
            "--model.base_dir", str(base), "--config", str(TINY), "--trainer.backend", "torchtitan", "--trainer.nproc", "2",
            "--trainer.device", "cpu", "--trainer.steps", str(steps)]


UP_ENV = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the embedded server


def test_pipeline_up_with_a_two_rank_torchtitan_trainer(tmp_path, tiny_base_model):
    p = subprocess.run(up_args(tmp_path, tiny_base_model, "titan", 3), cwd=tmp_path, env=UP_ENV, capture_output=True,
                       text=True, timeout=600)
    run = tmp_path / "runs" / "titan"
    trainer_out = (run / "logs" / "train.out").read_text() if (run / "logs" / "train.out").exists() else ""
    assert p.returncode == 0, p.stdout[-3000:] + trainer_out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 3, summary
    assert summary["accounting"]["ok"] and summary["accounting"]["lost"] == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps if s.get("kind", "step") == "step" and "groups_trained" in s] == [1, 2, 3]
    ckpt = run / "checkpoints"
    latest = ckpt / (ckpt / "latest").read_text().strip()
    assert_safetensors_shards(latest / "shards", ranks=2)
    state = json.loads((latest / "state.json").read_text())
    assert state["version"] == 3 and state["engine"]["format"] == "sharded-safetensors"
    final = load_file(str(ckpt / "final" / "model.safetensors"))
    base = load_file(str(tiny_base_model / "model.safetensors"))
    assert sorted(final) == sorted(base) and any(not torch.equal(final[k], base[k]) for k in base)
    assert np.isfinite([s["loss"] for s in steps if "loss" in s]).all()


def test_pipeline_down_stops_every_rank_after_a_checkpoint(tmp_path, tiny_base_model):
    """SIGTERM reaches torchrun and every rank: followers wait for rank 0, which checkpoints its step and sends STOP."""
    p = subprocess.Popen(up_args(tmp_path, tiny_base_model, "long", 100000), cwd=tmp_path, env=UP_ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run = tmp_path / "runs" / "long"
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").exists() or '"kind": "step"' not in (run / "metrics.jsonl").read_text():
        assert time.time() < deadline and p.poll() is None, "the cluster never trained a step"
        time.sleep(0.5)
    ranks = subprocess.run(["pgrep", "-f", f"pipeline.cli train --config {run}"], capture_output=True, text=True)
    pids = [int(x) for x in ranks.stdout.split()]
    assert len(pids) >= 3, ranks.stdout  # torchrun's agent and two ranks
    down = subprocess.run([sys.executable, "-m", "pipeline.cli", "down", "--runs-dir", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=180)
    assert down.returncode == 0, down.stderr
    out = p.communicate(timeout=180)[0].decode()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["accounting"]["ok"], out[-3000:]
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3], \
            f"trainer process {pid} survived `pipeline down`"
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    state = json.loads((latest / "state.json").read_text())
    assert state["version"] == summary["steps"] and state["engine"]["world_size"] == 2
    assert "Traceback" not in (run / "logs" / "train.out").read_text()


def test_tied_embeddings_in_one_process_without_torchrun(tmp_path, tiny_base_model):
    """Outside torchrun the engine is a one-rank group; a tied checkpoint publishes the head as the torch engine does."""
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.engines.titan import TitanEngine
    from pipeline.config import load_config

    tied = tmp_path / "tied"
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
        eos_token_id=1, bos_token_id=None)).float().save_pretrained(tied)
    for f in tiny_base_model.glob("tokenizer*.json"):
        shutil.copy(f, tied / f.name)
    assert "lm_head.weight" not in load_file(str(tied / "model.safetensors"))

    titan = TitanEngine(load_config(None, {"model.base_dir": str(tied), "trainer.backend": "torchtitan",
                                           "trainer.device": "cpu", **SETTINGS}))
    try:
        ref = torch_engine(tied)
        for engine in (titan, ref):
            engine.train_step(make_groups(3, vocab=16))
        got, want = titan.weights(), ref.weights()
        assert_weights_close(got, want)
        assert got["lm_head.weight"] is got["model.embed_tokens.weight"]
        assert titan.greedy(make_prompts(), max_new_tokens=4) == ref.greedy(make_prompts(), max_new_tokens=4)
    finally:
        titan.close()
