"""The policy model, tokenizer and shared kernels (pipeline.model.qwen) and the warm-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.tasks import arithmetic as task
from pipeline.model.qwen import (ModelShape, build_model, completion_logprobs, completion_mask, encode_prompts,
                                 greedy_accuracy, greedy_answers, load_checkpoint, load_state_tensors, sample,
                                 save_checkpoint, state_tensors)
from pipeline.model.tokenizer import CharTokenizer
from pipeline.model.pretrain import pretrain

TINY = ModelShape(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def tokenizer() -> CharTokenizer:
    return CharTokenizer()


@pytest.fixture
def model(tokenizer):
    return build_model(TINY, tokenizer.vocab_size, seed=0).eval()


def _prompts(tokenizer: CharTokenizer, n: int, seed: int = 0) -> torch.Tensor:
    problems = task.heldout_problems(n=n, seed=seed, digits=3, ops=("+", "*"))
    return encode_prompts(tokenizer, [p.prompt for p in problems])


def test_tokenizer_round_trips_prompts_and_answers(tokenizer):
    assert tokenizer.vocab_size == 2 + len("0123456789+*= ")
    assert (tokenizer.pad_id, tokenizer.eos_id) == (0, 1)
    text = " 42*317=13314"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)
    assert min(ids) >= 2
    assert tokenizer.decode(ids) == text


def test_tokenizer_decode_stops_at_eos_and_skips_pad(tokenizer):
    ids = tokenizer.encode("12") + [tokenizer.pad_id] + tokenizer.encode("3") + [tokenizer.eos_id]
    assert tokenizer.decode(ids + tokenizer.encode("99")) == "123"


def test_tokenizer_rejects_an_unknown_character_by_name(tokenizer):
    with pytest.raises(ValueError, match="'x'"):
        tokenizer.encode("12x3")


def test_saved_tokenizer_loads_back_and_matches_hugging_face(tokenizer, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer.save(tmp_path)
    assert CharTokenizer.load(tmp_path).tokens == tokenizer.tokens
    prompt = task.Problem(a=42, op="+", b=317, digits=3).prompt
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert hf(prompt, add_special_tokens=False)["input_ids"] == tokenizer.encode(prompt)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    assert auto(prompt, add_special_tokens=False)["input_ids"] == tokenizer.encode(prompt)
    assert (auto.eos_token_id, auto.pad_token_id) == (tokenizer.eos_id, tokenizer.pad_id)
    ids = tokenizer.encode(" 359") + [tokenizer.eos_id]
    assert auto.decode(ids, skip_special_tokens=True) == " 359"


def test_encode_prompts_rejects_prompts_of_different_lengths(tokenizer):
    assert encode_prompts(tokenizer, ["1+2=", "3+4="]).shape == (2, 4)
    with pytest.raises(ValueError, match="length"):
        encode_prompts(tokenizer, ["1+2=", "13+4="])


def test_build_model_is_deterministic_for_a_seed_and_untied(tokenizer):
    a = build_model(TINY, tokenizer.vocab_size, seed=3)
    b = build_model(TINY, tokenizer.vocab_size, seed=3)
    c = build_model(TINY, tokenizer.vocab_size, seed=4)
    sa, sb, sc = state_tensors(a), state_tensors(b), state_tensors(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert a.config.tie_word_embeddings is False
    assert a.lm_head.weight.data_ptr() != a.model.embed_tokens.weight.data_ptr()


def test_checkpoint_round_trip_gives_identical_logits(model, tokenizer, tmp_path):
    directory = save_checkpoint(model, tokenizer, tmp_path / "ckpt")
    assert (directory / "model.safetensors").is_file()
    assert not list(directory.glob("*.bin")) and not list(directory.glob("*.pt"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dir left behind"
    loaded, loaded_tokenizer = load_checkpoint(directory)
    assert loaded_tokenizer.tokens == tokenizer.tokens
    prompt_ids = _prompts(tokenizer, 4)
    with torch.no_grad():
        assert torch.equal(model(prompt_ids).logits, loaded(prompt_ids).logits)


def test_save_checkpoint_replaces_an_existing_checkpoint(model, tokenizer, tmp_path):
    save_checkpoint(model, tokenizer, tmp_path / "ckpt")
    other = build_model(TINY, tokenizer.vocab_size, seed=1)
    save_checkpoint(other, tokenizer, tmp_path / "ckpt")
    loaded, _ = load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(loaded.lm_head.weight, other.lm_head.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_sample_shapes_and_lengths_are_consistent_with_eos(model, tokenizer):
    prompt_ids = _prompts(tokenizer, 16).repeat_interleave(4, dim=0)
    gen = torch.Generator().manual_seed(0)
    # A high temperature on an untrained model makes eos come at varied positions.
    tokens, logprobs, lengths = sample(
        model, prompt_ids, max_new_tokens=8, temperature=3.0, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
        generator=gen,
    )
    n = prompt_ids.shape[0]
    assert tokens.shape == logprobs.shape == (n, 8)
    assert lengths.shape == (n,)
    assert tokens.dtype == lengths.dtype == torch.long and logprobs.dtype == torch.float32
    for row, lp, length in zip(tokens.tolist(), logprobs.tolist(), lengths.tolist()):
        eos_at = [i for i, t in enumerate(row) if t == tokenizer.eos_id]
        if eos_at:
            assert length == eos_at[0] + 1
            assert row[length:] == [tokenizer.pad_id] * (8 - length)
            assert lp[length:] == [0.0] * (8 - length)
        else:
            assert length == 8
        assert all(x < 0 for x in lp[:length])
    assert len(set(lengths.tolist())) > 2, "eos positions should vary at this temperature"


def test_sample_logprobs_equal_recomputed_completion_logprobs(model, tokenizer):
    prompt_ids = _prompts(tokenizer, 8).repeat_interleave(4, dim=0)
    gen = torch.Generator().manual_seed(1)
    tokens, logprobs, lengths = sample(
        model, prompt_ids, max_new_tokens=7, temperature=1.0, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
        generator=gen,
    )
    recomputed, entropy = completion_logprobs(model, prompt_ids, tokens, with_entropy=True)
    assert recomputed.requires_grad
    mask = completion_mask(lengths, tokens.shape[1])
    assert torch.allclose(recomputed[mask], logprobs[mask], atol=1e-4)
    assert entropy.shape == tokens.shape
    assert bool((entropy >= 0).all()) and bool((entropy <= torch.log(torch.tensor(float(tokenizer.vocab_size))) + 1e-5).all())


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_rescoring_at_the_sampling_temperature_matches_the_behaviour_logprobs(model, tokenizer, temperature):
    """The trainer scores at generator.temperature; at 1 the numbers would differ (the
    importance ratios of the loss would then be wrong from the first step)."""
    from pipeline.model.qwen import ragged_completion_logprobs

    prompt_ids = _prompts(tokenizer, 6).repeat_interleave(3, dim=0)
    tokens, logprobs, lengths = sample(model, prompt_ids, max_new_tokens=6, temperature=temperature,
                                       eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                                       generator=torch.Generator().manual_seed(3))
    mask = completion_mask(lengths, tokens.shape[1])
    with torch.no_grad():
        tempered = ragged_completion_logprobs(model, list(prompt_ids), tokens, pad_id=tokenizer.pad_id,
                                              temperature=temperature)
        plain = completion_logprobs(model, prompt_ids, tokens)
    assert torch.allclose(tempered[mask], logprobs[mask], atol=1e-4)
    assert not torch.allclose(plain[mask], logprobs[mask], atol=1e-2)


def test_sample_logprobs_follow_the_tempered_distribution(model, tokenizer):
    prompt_ids = _prompts(tokenizer, 8)
    tokens, logprobs, _ = sample(
        model, prompt_ids, max_new_tokens=1, temperature=0.5, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
        generator=torch.Generator().manual_seed(2),
    )
    with torch.no_grad():
        logits = model(prompt_ids).logits[:, -1, :]
    expected = torch.log_softmax(logits / 0.5, dim=-1).gather(1, tokens)
    assert torch.allclose(logprobs, expected, atol=1e-5)


def test_sample_is_reproducible_with_a_seeded_generator(model, tokenizer):
    prompt_ids = _prompts(tokenizer, 8)
    kwargs = dict(max_new_tokens=6, temperature=1.0, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    a = sample(model, prompt_ids, generator=torch.Generator().manual_seed(5), **kwargs)
    b = sample(model, prompt_ids, generator=torch.Generator().manual_seed(5), **kwargs)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_greedy_decoding_is_deterministic_and_picks_the_argmax(model, tokenizer):
    prompt_ids = _prompts(tokenizer, 8)
    kwargs = dict(max_new_tokens=5, temperature=0.0, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    a = sample(model, prompt_ids, generator=torch.Generator().manual_seed(1), **kwargs)
    b = sample(model, prompt_ids, generator=torch.Generator().manual_seed(2), **kwargs)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with torch.no_grad():
        first = model(prompt_ids).logits[:, -1, :]
    assert torch.equal(a[0][:, 0], first.argmax(-1))
    assert torch.allclose(a[1][:, 0], torch.log_softmax(first, -1).max(-1).values, atol=1e-5)


def test_sampling_repeated_prompts_matches_sampling_each_prompt(model, tokenizer):
    # sample() runs the prompt forward once per distinct prompt and fans out the cache.
    prompt_ids = _prompts(tokenizer, 6)
    kwargs = dict(max_new_tokens=5, temperature=0.0, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    single = sample(model, prompt_ids, **kwargs)
    repeated = sample(model, prompt_ids.repeat_interleave(3, dim=0), **kwargs)
    assert torch.equal(repeated[0], single[0].repeat_interleave(3, dim=0))
    assert torch.equal(repeated[2], single[2].repeat_interleave(3, dim=0))
    assert torch.allclose(repeated[1], single[1].repeat_interleave(3, dim=0), atol=1e-5)


def test_sample_rejects_a_completion_beyond_the_context(model, tokenizer):
    with pytest.raises(ValueError, match="context"):
        sample(model, _prompts(tokenizer, 2), max_new_tokens=100, temperature=1.0, eos_id=1, pad_id=0)


def test_greedy_accuracy_counts_extracted_answers(model, tokenizer):
    problems = task.heldout_problems(n=20, seed=0, digits=2, ops=("+",))
    answers = greedy_answers(model, tokenizer, problems, batch_size=7)
    assert len(answers) == 20
    expected = sum(task.extract_answer(a) == p.answer for a, p in zip(answers, problems)) / 20
    assert greedy_accuracy(model, tokenizer, problems, batch_size=7) == expected


def test_state_tensors_are_a_snapshot_safe_from_optimizer_steps(model, tokenizer):
    snapshot = state_tensors(model)
    assert "lm_head.weight" in snapshot and "model.embed_tokens.weight" in snapshot
    before = snapshot["lm_head.weight"].clone()
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert torch.equal(snapshot["lm_head.weight"], before)
    assert not snapshot["lm_head.weight"].requires_grad
    load_state_tensors(model, snapshot)
    assert torch.equal(model.lm_head.weight, before)


def test_load_state_tensors_rejects_a_missing_tensor(model):
    tensors = state_tensors(model)
    del tensors["lm_head.weight"]
    with pytest.raises(ValueError, match="missing.*lm_head.weight"):
        load_state_tensors(model, tensors)


def test_load_state_tensors_rejects_unexpected_names_and_shape_mismatches(model):
    tensors = state_tensors(model)
    tensors["extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unexpected.*extra.weight"):
        load_state_tensors(model, tensors)
    tensors = state_tensors(model)
    tensors["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_state_tensors(model, tensors)


def test_a_tiny_pretrain_run_writes_its_report_and_a_loadable_checkpoint(tmp_path):
    heldout = task.heldout_problems(n=50, seed=1234, digits=2, ops=("+",))
    logs: list[str] = []
    out = tmp_path / "base"
    result = pretrain(
        out, shape=TINY, digits=2, steps=5, batch_size=16, lr=1e-3, seed=0, heldout=heldout, warmup=2,
        progress=False, log=logs.append,
    )
    report = json.loads((out / "pretrain.json").read_text())
    assert report == json.loads(json.dumps(result))
    assert report["steps"] == 5 and report["seed"] == 0 and report["shape"]["hidden_size"] == 32
    assert 0.0 <= report["heldout_accuracy"] <= 1.0 and report["final_loss"] > 0 and report["params"] > 0
    assert logs
    model, tokenizer = load_checkpoint(out)
    assert greedy_accuracy(model, tokenizer, heldout) == report["heldout_accuracy"]


def test_pretrain_is_deterministic_for_a_seed(tmp_path: Path):
    heldout = task.heldout_problems(n=20, seed=1234, digits=2, ops=("+",))
    kwargs = dict(shape=TINY, digits=2, steps=3, batch_size=8, lr=1e-3, seed=7, heldout=heldout, progress=False,
                  log=lambda _: None)
    a = pretrain(tmp_path / "a", **kwargs)
    b = pretrain(tmp_path / "b", **kwargs)
    assert a["final_loss"] == b["final_loss"]
    ta, _ = load_checkpoint(tmp_path / "a")
    tb, _ = load_checkpoint(tmp_path / "b")
    sa, sb = state_tensors(ta), state_tensors(tb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
