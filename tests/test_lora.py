"""LoRA training on the torch engine (``trainer.lora_rank``, pipeline/engines/lora.py): only the
adapters train, generators get merged full weights under the plain HF names, checkpoints
hold adapters + optimizer and resume exactly, and lora_rank 0 is full fine-tuning unchanged."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from builders import make_scored
from safetensors.torch import load_file

from pipeline.config import ConfigError, load_config
from pipeline.inert import Situation, refuse_inert
from pipeline.engines.torch import TorchEngine, pad_batch, train_step, warmup_schedule
from pipeline.model.qwen import load_checkpoint, load_state_tensors, ragged_completion_logprobs
from pipeline.common import checkpoint

TARGET = "model.layers.0.self_attn.q_proj"


def _groups(n: int = 4, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [make_scored(prompt_id=f"p{seed}{i:07d}", rewards=rng.random(4).astype(np.float32)) for i in range(n)]


def _cfg(base, **trainer):
    return load_config(None, {"model.base_dir": str(base), **{f"trainer.{k}": str(v) for k, v in trainer.items()}})


def _lora(base, **trainer) -> TorchEngine:
    return TorchEngine(_cfg(base, **{"lora_rank": 4, "lora_alpha": 8, "lr": 1e-2, "warmup_steps": 0, **trainer}))


def _base(base) -> dict[str, torch.Tensor]:
    return load_file(str(base / "model.safetensors"))


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, vocab, (3, 9), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


# ----------------------------------------------------------------------------- lora off


def test_lora_rank_0_is_full_fine_tuning_bit_for_bit(tiny_base_model):
    """The engine with lora_rank 0 against the engine as it was, written out: the same model,
    the same reference model, AdamW over every parameter, the module's train_step."""
    cfg = _cfg(tiny_base_model, lora_rank=0, lr=1e-2, warmup_steps=1, kl_coef=0.1)
    engine = TorchEngine(cfg)
    assert engine.lora is None and engine.cfg.trainer.lora_rank == 0

    torch.manual_seed(cfg.trainer.seed)
    model, tok = load_checkpoint(tiny_base_model)
    ref = load_checkpoint(tiny_base_model)[0].eval()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
    sched = warmup_schedule(opt, cfg.trainer.warmup_steps)
    for step, seed in enumerate((1, 2), start=1):
        groups = _groups(seed=seed)
        got = engine.train_step(groups)
        engine.lr_step()
        want = train_step(model, opt, groups, cfg, pad_id=tok.pad_id, eos_id=tok.eos_id, ref_model=ref, step=step)
        sched.step()
        assert {k: v for k, v in got.items() if k != "trainable_params"} == want
        assert got["trainable_params"] == sum(p.numel() for p in model.parameters())
    weights = engine.weights()
    assert sorted(weights) == sorted(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(weights[name], value), name
    base = _base(tiny_base_model)
    assert all(not torch.equal(weights[k], base[k]) for k in (TARGET + ".weight", "model.norm.weight"))
    with pytest.raises(ValueError, match=r"trainer\.lora_rank"):
        engine.adapter_tensors()


# ----------------------------------------------------------------------------- lora on


def test_a_lora_step_trains_the_adapters_only(tiny_base_model):
    engine = _lora(tiny_base_model)
    before = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    adapters = engine.adapter_tensors()
    assert sorted(adapters) == sorted(f"{m}.lora_{ab}.weight" for m in engine.lora.layers for ab in "AB")
    assert {n.rsplit(".", 1)[-1] for n in engine.lora.layers} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    in_opt = {id(p) for g in engine.opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in engine.lora.adapter_params().values()}
    total = sum(p.numel() for p in engine.model.parameters())
    n_adapter = sum(t.numel() for t in adapters.values())
    assert all(float(v.abs().max()) == 0 for k, v in adapters.items() if ".lora_B." in k), "B starts at zero"

    stats = engine.train_step(_groups())
    assert stats["trainable_params"] == n_adapter < total / 2
    # With B = 0 the first gradient reaches B only; A moves from the second step on.
    first = engine.model.state_dict()
    assert all(torch.equal(v, before[k]) != (".lora_B." in k) for k, v in first.items()), \
        [k for k, v in first.items() if not torch.equal(v, before[k])]
    engine.train_step(_groups(seed=1))
    after = engine.model.state_dict()
    lora_keys = [k for k in after if ".lora_" in k]
    assert len(lora_keys) == len(adapters)
    for k, v in after.items():
        if ".lora_" in k:
            assert not torch.equal(v, before[k]), f"{k} did not move"
        else:
            assert torch.equal(v, before[k]), f"{k} (a base weight) moved"
    base = _base(tiny_base_model)
    assert torch.equal(after[TARGET + ".base_layer.weight"], base[TARGET + ".weight"])


def test_published_weights_are_the_base_plus_scaled_BA_under_the_plain_names(tiny_base_model):
    engine = _lora(tiny_base_model)
    base = _base(tiny_base_model)
    fresh = engine.weights()
    assert {k: tuple(v.shape) for k, v in fresh.items()} == {k: tuple(v.shape) for k, v in base.items()}
    assert all(torch.equal(fresh[k], base[k]) for k in base), "B = 0: the first published policy is the base"

    engine.train_step(_groups())
    weights = engine.weights()
    ad = engine.adapter_tensors()
    a, b = ad[TARGET + ".lora_A.weight"], ad[TARGET + ".lora_B.weight"]
    assert float(b.abs().max()) > 0
    scale = engine.cfg.trainer.lora_alpha / engine.cfg.trainer.lora_rank
    assert engine.lora.scale(TARGET) == scale == 2.0
    want = base[TARGET + ".weight"] + scale * (b @ a)
    torch.testing.assert_close(weights[TARGET + ".weight"], want, rtol=0, atol=1e-7)
    assert float((weights[TARGET + ".weight"] - base[TARGET + ".weight"]).abs().max()) > 1e-5
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.0.self_attn.q_norm.weight"):
        assert torch.equal(weights[name], base[name]), name
    # Publishing merged nothing into the model: its base weight is the checkpoint's, and
    # publishing again gives the same tensors.
    assert torch.equal(engine.model.state_dict()[TARGET + ".base_layer.weight"], base[TARGET + ".weight"])
    again = engine.weights()
    assert all(torch.equal(again[k], weights[k]) for k in weights)


def test_merged_weights_in_a_plain_model_give_the_lora_models_logits(tiny_base_model, tmp_path):
    engine = _lora(tiny_base_model, lr=5e-2)
    for seed in (1, 2, 3):
        engine.train_step(_groups(seed=seed))
    ids = _ids(engine.vocab_size)
    lora_logits = _logits(engine.model, ids)
    plain, _ = load_checkpoint(tiny_base_model)
    base_logits = _logits(plain, ids)
    assert float((lora_logits - base_logits).abs().max()) > 1e-3, "the adapters must have changed the model"
    load_state_tensors(plain, engine.weights())
    torch.testing.assert_close(_logits(plain, ids), lora_logits, rtol=0, atol=1e-5)

    engine.export_hf(tmp_path / "export")
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert sorted(exported) == sorted(_base(tiny_base_model))
    loaded, tok = load_checkpoint(tmp_path / "export")
    assert tok.pad_id == engine.tokenizer.pad_id
    torch.testing.assert_close(_logits(loaded, ids), lora_logits, rtol=0, atol=1e-5)


def test_the_kl_reference_is_the_base_with_the_adapters_off(tiny_base_model):
    engine = _lora(tiny_base_model, kl_coef=0.1, lr=5e-2)
    first = engine.train_step(_groups(seed=1))
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    second = engine.train_step(_groups(seed=2))
    assert second["kl_ref"] > 0
    ids = _ids(engine.vocab_size, seed=1)
    plain, _ = load_checkpoint(tiny_base_model)
    engine.model.train()
    ref = _logits(engine.ref_model, ids)
    assert engine.model.training, "the reference call restores the model's mode"
    engine.model.eval()
    torch.testing.assert_close(ref, _logits(plain, ids), rtol=0, atol=1e-6)
    assert float((_logits(engine.model, ids) - ref).abs().max()) > 1e-3


def test_a_lora_checkpoint_resumes_exactly_where_it_stopped(tmp_path, tiny_base_model):
    # Dropout draws from the torch RNG and the KL reference runs every step: both must resume.
    settings = {"warmup_steps": 2, "lora_dropout": 0.1, "kl_coef": 0.05}
    batches = [_groups(2, seed=s) for s in range(4)]

    def steps(engine, part):
        for groups in part:
            engine.train_step(groups)
            engine.lr_step()

    engine = _lora(tiny_base_model, **settings)
    steps(engine, batches[:2])
    path = checkpoint.save(tmp_path / "ck", write=engine.save_state,
                           state=checkpoint.TrainerState(version=2, evals={}, uncommitted=[]))
    names = sorted(p.name for p in path.iterdir())
    assert names == ["adapter.safetensors", "optimizer.safetensors", "state.json"], names
    assert sorted(load_file(str(path / "adapter.safetensors"))) == sorted(engine.adapter_tensors())
    steps(engine, batches[2:])
    straight = {k: v.clone() for k, v in engine.weights().items()}
    straight_ad = {k: v.clone() for k, v in engine.adapter_tensors().items()}

    resumed = _lora(tiny_base_model, **settings)
    state = checkpoint.load(checkpoint.latest(tmp_path / "ck"))
    resumed.load_state(path, state.engine)
    steps(resumed, batches[2:])
    for name, value in resumed.weights().items():
        assert torch.equal(value, straight[name]), name
    for name, value in resumed.adapter_tensors().items():
        assert torch.equal(value, straight_ad[name]), name

    # Without the checkpoint the same two steps land elsewhere: the comparison means something.
    cold = _lora(tiny_base_model, **settings)
    steps(cold, batches[2:])
    assert not torch.equal(cold.weights()[TARGET + ".weight"], straight[TARGET + ".weight"])


def test_a_checkpoint_resumes_only_under_the_lora_settings_that_wrote_it(tmp_path, tiny_base_model):
    lora = _lora(tiny_base_model)
    lora.train_step(_groups())
    lora_ck = checkpoint.save(tmp_path / "lora", write=lora.save_state,
                              state=checkpoint.TrainerState(version=1, evals={}, uncommitted=[]))
    full = TorchEngine(_cfg(tiny_base_model))
    full_ck = checkpoint.save(tmp_path / "full", write=full.save_state,
                              state=checkpoint.TrainerState(version=1, evals={}, uncommitted=[]))
    with pytest.raises(ValueError, match=r"trainer\.lora_rank: .*holds LoRA adapters"):
        TorchEngine(_cfg(tiny_base_model)).load_state(lora_ck, checkpoint.load(lora_ck).engine)
    with pytest.raises(ValueError, match=r"trainer\.lora_rank: .*LoRA settings"):
        _lora(tiny_base_model, lora_rank=2).load_state(lora_ck, checkpoint.load(lora_ck).engine)
    with pytest.raises(ValueError, match=r"trainer\.lora_rank: .*LoRA settings null"):
        _lora(tiny_base_model).load_state(full_ck, checkpoint.load(full_ck).engine)


def test_a_few_lora_steps_learn_the_batchs_preference(tiny_base_model):
    """Policy-gradient steps on a fixed batch raise the advantage-weighted log-likelihood:
    completions rewarded above their group's mean gain probability, the others lose it."""
    engine = _lora(tiny_base_model, lr=2e-2)
    groups = _groups(4, seed=7)
    cfg = engine.cfg
    pad = engine.tokenizer.pad_id
    prompts, comp_ids, _, mask = pad_batch(groups, pad)
    adv = torch.cat([torch.as_tensor(np.asarray(g.rewards)) - float(np.mean(g.rewards)) for g in groups])

    def score() -> float:
        with torch.no_grad():
            logp = ragged_completion_logprobs(engine.model, prompts, comp_ids, pad_id=pad,
                                              temperature=cfg.generator.temperature)
        return float((adv * (logp * mask).sum(dim=1)).sum())

    start = score()
    for _ in range(5):
        engine.train_step(groups)
        engine.lr_step()
    assert score() > start + 0.05, (start, score())


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, field", [
    ({"trainer.lora_rank": "-1"}, "trainer.lora_rank"),
    ({"trainer.lora_rank": "4", "trainer.backend": "torchtitan"}, "trainer.lora_rank"),
    ({"trainer.lora_rank": "4", "trainer.lora_alpha": "0"}, "trainer.lora_alpha"),
    ({"trainer.lora_rank": "4", "trainer.lora_alpha": "nan"}, "trainer.lora_alpha"),
    ({"trainer.lora_rank": "4", "trainer.lora_dropout": "1.0"}, "trainer.lora_dropout"),
    ({"trainer.lora_rank": "4", "trainer.lora_dropout": "-0.1"}, "trainer.lora_dropout"),
    ({"trainer.lora_rank": "4", "trainer.lora_targets": ""}, "trainer.lora_targets"),
    ({"trainer.lora_rank": "4", "trainer.lora_targets": "q_proj,q_proj"}, "trainer.lora_targets"),
    ({"trainer.lora_rank": "4", "trainer.lora_targets": "q proj"}, "trainer.lora_targets"),
    ({"weights.payload": "adapter"}, "weights.payload"),
])
def test_bad_lora_settings_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match="^" + re.escape(field) + ": must be"):
        load_config(None, overrides)


def test_torchtitan_refuses_lora_and_the_lora_knobs_are_inert_without_a_rank():
    with pytest.raises(ConfigError, match=r"trainer\.lora_rank: must be 0 with backend torchtitan"):
        load_config(None, {"trainer.backend": "torchtitan", "trainer.lora_rank": "8"})
    for name, value in (("lora_alpha", "32"), ("lora_dropout", "0.1"), ("lora_targets", "q_proj")):
        cfg = load_config(None, {f"trainer.{name}": value})
        with pytest.raises(ConfigError, match=rf"trainer\.{name} = .*cannot take effect: .*trainer\.lora_rank is 0"):
            refuse_inert(cfg, Situation())
        refuse_inert(load_config(None, {f"trainer.{name}": value, "trainer.lora_rank": "8"}), Situation())
    cfg = load_config(None, {"trainer.lora_rank": "8"})
    assert cfg.trainer.lora_targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_a_target_naming_no_module_is_refused_by_the_engine(tiny_base_model):
    with pytest.raises(ValueError, match=r"trainer\.lora_targets: 'qkv_proj' names no module"):
        _lora(tiny_base_model, lora_targets="q_proj,qkv_proj")
    engine = _lora(tiny_base_model, lora_targets="model.layers.0.mlp.down_proj")
    assert list(engine.lora.layers) == ["model.layers.0.mlp.down_proj"]


# ----------------------------------------------------------------------------- adapter payloads


def _adapter_generator(base):
    from pipeline.engines.torch import TorchGenerator

    cfg = load_config(None, {"model.base_dir": str(base), "weights.payload": "adapter", "trainer.lora_rank": "4",
                             "trainer.lora_alpha": "8"})
    return TorchGenerator(cfg, worker_id="gen-0")


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_an_adapter_payload_gives_the_generator_the_trainers_full_weights(tiny_base_model):
    """weights.payload adapter: the generator merges each version's A/B onto the base it
    loaded and ends with the weights a full payload would have carried, version after
    version (each merged onto the base, not onto the last version)."""
    engine, gen = _lora(tiny_base_model), _adapter_generator(tiny_base_model)
    for step in range(3):
        engine.train_step(_groups(seed=step))
        adapters, full = engine.adapter_tensors(), engine.weights()
        gen.load_weights({k: v.clone() for k, v in adapters.items()})
        held = gen.model.state_dict()
        assert all(torch.equal(held[k], full[k]) for k in full), f"step {step}: merged as the trainer merges"
        targets = [k.removesuffix(".lora_A.weight") for k in adapters if k.endswith(".lora_A.weight")]
        assert _nbytes(adapters) == sum(4 * 4 * sum(full[f"{m}.weight"].shape) for m in targets) < _nbytes(full), \
            "rank x (in + out) float32s per target: all the version carries"
    assert float((held[TARGET + ".weight"] - _base(tiny_base_model)[TARGET + ".weight"]).abs().max()) > 1e-5


def test_a_payload_that_does_not_fit_keeps_the_generators_weights(tiny_base_model):
    engine, gen = _lora(tiny_base_model), _adapter_generator(tiny_base_model)
    engine.train_step(_groups())
    adapters = engine.adapter_tensors()
    gen.load_weights(adapters)
    before = {k: v.clone() for k, v in gen.model.state_dict().items()}
    bad = [
        (engine.weights(), "non-adapter tensors"),
        ({k: v for k, v in adapters.items() if not k.startswith(TARGET + ".lora_B")}, "only one of lora_A / lora_B"),
        ({k: v for k, v in adapters.items() if not k.startswith(TARGET)}, "the same ones"),
        ({**adapters, TARGET + ".lora_A.weight": adapters[TARGET + ".lora_A.weight"][:, :-1]}, "does not make"),
        ({"model.layers.0.nothing.lora_A.weight": adapters[TARGET + ".lora_A.weight"],
          "model.layers.0.nothing.lora_B.weight": adapters[TARGET + ".lora_B.weight"]}, "the same ones"),
    ]
    for payload, why in bad:
        with pytest.raises(ValueError, match=r"weights\.payload adapter: .*" + re.escape(why)):
            gen.load_weights(payload)
        held = gen.model.state_dict()
        assert all(torch.equal(held[k], before[k]) for k in before), why
