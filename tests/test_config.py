import dataclasses
import importlib.util
import json
import tomllib
from pathlib import Path

import pytest

from pipeline import catalog
from pipeline import config as C
from pipeline.config_base import choice_fields as _choice_fields, hints as _hints
from pipeline.config import ConfigError, RunConfig, load_config
from pipeline.config_toml import documented_toml, to_toml
from pipeline.inert import Situation, refuse_inert

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_valid_and_round_trip_through_toml(tmp_path):
    cfg = load_config()
    path = tmp_path / "run.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


def test_shipped_default_config_matches_the_code_defaults():
    assert load_config(ROOT / "configs" / "default.toml") == RunConfig().validate()
    # Every field and its documentation: regenerate with `pipeline config > configs/default.toml`.
    assert (ROOT / "configs" / "default.toml").read_text() == documented_toml()


def test_dotted_overrides_are_coerced_to_the_field_type():
    cfg = load_config(overrides={"trainer.lr": "3e-4", "trainer.max_staleness": "0",
                                 "verifier.verifiers": "format,mod9"})
    assert cfg.trainer.lr == 3e-4 and cfg.trainer.max_staleness == 0
    assert cfg.verifier.verifiers == ("format", "mod9")


@pytest.mark.parametrize("overrides, field", [
    ({"trainer.lr": "fast"}, "trainer.lr"),
    ({"trainer.lr": "2"}, "trainer.lr"),
    ({"trainer.loss": "ppo2"}, "trainer.loss"),
    ({"trainer.nope": "1"}, "trainer.nope"),
    ({"weights.transport": "carrier-pigeon"}, "weights.transport"),
    ({"task.ops": "-"}, "task.ops"),
    ({"run_id": "a b"}, "run_id"),
    ({"task.digits": "1"}, "task.heldout_size"),
    ({"verifier.class_balance": "1.0"}, "verifier.class_balance"),
])
def test_bad_values_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(overrides=overrides)


def test_malformed_toml_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\nlr = 1")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(bad)


def test_config_module_imports_neither_torch_nor_redis():
    import subprocess
    import sys

    code = ("import sys, pipeline.config; print('torch' in sys.modules, 'redis' in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('pipeline.') and m != 'pipeline.config'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    torch, redis, modules = out.split(maxsplit=2)
    assert (torch, redis) == ("False", "False")
    # Only its own sections and the neutral registries: no task, loss, transport or environment module.
    assert set(eval(modules)) <= {"pipeline.catalog", "pipeline.config_base", "pipeline.config_infra",
                                  "pipeline.config_task", "pipeline.config_train", "pipeline.plugins",
                                  "pipeline.registry"}, modules


def test_toml_output_is_valid_toml():
    assert tomllib.loads(to_toml(RunConfig()))["trainer"]["steps"] == RunConfig().trainer.steps


# ----------------------------------------------------------------------------- frozen


def test_a_loaded_config_and_each_of_its_sections_cannot_be_changed():
    cfg = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run_id = "x"
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(section, dataclasses.fields(section)[0].name, None)
    # The lists are tuples: nothing inside a config changes either.
    assert isinstance(cfg.verifier.verifiers, tuple) and isinstance(cfg.task.ops, tuple)
    assert hash(cfg) == hash(load_config())


def test_a_derived_config_is_a_new_validated_one_and_the_original_is_untouched():
    cfg = load_config(overrides={"trainer.lr": "3e-4"})
    new = cfg.replace("redis.appendfsync", "always").with_overrides({"run_id": "r1", "trainer.steps": "7",
                                                                     "verifier.verifiers": ["format"]})
    assert (new.redis.appendfsync, new.run_id, new.trainer.steps, new.verifier.verifiers) == ("always", "r1", 7, ("format",))
    assert new.trainer.lr == 3e-4 and new.get("trainer.lr") == 3e-4
    assert (cfg.redis.appendfsync, cfg.run_id, cfg.trainer.steps) == ("everysec", "", 200)
    assert new.explicit == cfg.explicit == {"trainer.lr"}, "what code derives is not what the user set"
    with pytest.raises(ConfigError, match=r"redis\.appendfsync: must be always\|everysec\|no"):
        cfg.replace("redis.appendfsync", "sometimes")
    with pytest.raises(ConfigError, match=r"task\.heldout_size"):
        cfg.replace("task.digits", 1)  # validated again, across fields
    with pytest.raises(ConfigError, match=r"trainer\.nope: unknown field"):
        cfg.with_overrides({"trainer.nope": 1})


def test_explicit_names_every_override_and_each_toml_value_that_differs_from_the_default(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[trainer]\nlr = 3e-4\nsteps = 200\n[model]\nhidden_size = 64\n')
    cfg = load_config(path, {"generator.temperature": "1.0", "run_id": "a"})
    assert cfg.explicit == {"trainer.lr", "model.hidden_size", "generator.temperature", "run_id"}
    assert load_config(ROOT / "configs" / "default.toml").explicit == frozenset()


# ----------------------------------------------------------------------------- choices and their registries


def test_each_choice_field_allows_exactly_what_its_registry_implements(tmp_path):
    from pipeline.algo import labelmodel, losses, scoremodel
    from pipeline.engines import GENERATION_BACKENDS, TRAIN_ENGINES
    from pipeline.verifiers.registry import DEFAULT_VERIFIERS

    hints = {cls: _hints(cls) for cls in (C.TrainerConfig, C.VerifierConfig, C.GeneratorConfig)}
    pairs = {
        "verifier.dependence": (hints[C.VerifierConfig]["dependence"], tuple(labelmodel.DEPENDENCE_POLICIES)),
        "verifier.pi_estimate": (hints[C.VerifierConfig]["pi_estimate"], tuple(labelmodel.PI_ESTIMATES)),
        "verifier.label_model": (hints[C.VerifierConfig]["label_model"], tuple(scoremodel.LABEL_MODELS)),
        "generator.backend": (hints[C.GeneratorConfig]["backend"], tuple(GENERATION_BACKENDS)),
        "trainer.backend": (hints[C.TrainerConfig]["backend"], tuple(TRAIN_ENGINES)),
    }
    for name, (hint, registry) in pairs.items():
        assert registry, f"{name}: no names found in its registry"
        assert sorted(C.choices(hint)) == sorted(registry), name
    assert C.DEFAULT_VERIFIERS == C.VerifierConfig().verifiers == tuple(DEFAULT_VERIFIERS)
    # The component fields ask their registry: every built-in name is accepted and resolves to its code.
    assert losses.LOSSES is catalog.LOSSES and losses.ADVANTAGES is catalog.ADVANTAGES
    for field, registry in (("trainer.advantage", catalog.ADVANTAGES), ("trainer.loss", catalog.LOSSES),
                            ("task.kind", catalog.TASKS), ("weights.transport", catalog.TRANSPORTS)):
        for name in registry:
            (tmp_path / "p.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
            needs = {"math": {"task.dataset": str(tmp_path / "p.jsonl")},
                     "reasoning_gym": {"task.datasets": "chain_sum"}}.get(name, {})
            assert load_config(overrides={field: name, **needs}).get(field) == name
            if name == "ucx" and importlib.util.find_spec("ucxx") is None:
                continue  # its module needs the optional ucx extra
            assert callable(registry.get(name)) or all(map(callable, registry.get(name))), (field, name)
    assert sorted(catalog.LOSSES) == sorted(losses.TOKEN_TERMS), "every built-in loss aggregates every way"


def test_every_fixed_choice_field_is_a_literal_and_its_validation_allows_its_values_only(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    needs = {"math": {"task.dataset": str(tmp_path / "p.jsonl")}, "reasoning_gym": {"task.datasets": "chain_sum"},
             "adapter": {"trainer.lora_rank": 4}}
    cfg = RunConfig()
    found = set()
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(section):
            continue
        for name, (allowed, many) in _choice_fields(type(section)).items():
            found.add(f"{f.name}.{name}")
            for value in allowed:
                got = load_config(overrides={f"{f.name}.{name}": value, **needs.get(value, {})}).get(f"{f.name}.{name}")
                assert got == ((value,) if many else value)
            with pytest.raises(ConfigError, match=rf"{f.name}\.{name}: must be .*{allowed[0]}"):
                load_config(overrides={f"{f.name}.{name}": "no-such-choice"})
    assert found == {"redis.appendfsync", "task.ops", "task.chat_template", "generator.backend",
                     "generator.vllm_dtype", "generator.swap", "generator.kv_on_swap", "generator.device",
                     "verifier.dependence", "verifier.pi_estimate", "verifier.label_model", "verifier.refit",
                     "trainer.backend",
                     "trainer.device",
                     "trainer.is_mode",
                     "trainer.loss_agg", "weights.payload", "chaos.targets", "chaos.kinds", "tracking.backends",
                     "tracking.wandb_mode", "env.on_error", "env.returns"}
    # A section built directly, not loaded, is refused the same way.
    with pytest.raises(ConfigError, match=r"trainer\.loss: must be decoupled_ppo\|tis\|gspo, module:function"):
        dataclasses.replace(cfg, trainer=C.TrainerConfig(loss="ppo2")).validate()
    with pytest.raises(ConfigError, match=r"weights\.transport: must be shm\|tcp\|ucx; got 'udp'"):
        load_config(overrides={"weights.transport": "udp"})


# ----------------------------------------------------------------------------- fields that cannot take effect


def _built(base: Path, **record) -> Path:
    base.mkdir(parents=True, exist_ok=True)
    shape = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512}
    (base / "pretrain.json").write_text(json.dumps({"shape": shape, "max_steps": 1000, "stop_loss": 0.45,
                                                    "batch_size": 128, "lr": 2e-3, "seed": 2, **record}))
    return base


@pytest.mark.parametrize("field, value", [
    ("model.hidden_size", "64"), ("model.num_layers", "2"), ("model.pretrain_steps", "10"),
    ("model.pretrain_lr", "1e-3"), ("model.seed", "5"), ("model.pretrain_stop_loss", "0"),
])
def test_a_model_field_set_while_the_base_dir_holds_a_checkpoint_is_refused_by_name(tmp_path, field, value):
    from pipeline.run.preflight import check_settings

    base = _built(tmp_path / "base")
    cfg = load_config(overrides={"model.base_dir": str(base), field: value})
    with pytest.raises(ConfigError, match=rf"^{field.replace('.', chr(92) + '.')} = .*already holds a pretrained "
                                          r"checkpoint.*remove it, or point model\.base_dir elsewhere"):
        check_settings(cfg)
    # No checkpoint yet: the value builds the new one.
    check_settings(load_config(overrides={"model.base_dir": str(tmp_path / "empty"), field: value}))
    # The value the checkpoint was built with took effect: re-running the same config is fine.
    check_settings(load_config(overrides={"model.base_dir": str(base), "model.hidden_size": "128", "model.seed": "2"}))


def test_a_toml_value_differing_from_the_default_counts_as_set(tmp_path):
    from pipeline.run.preflight import check_settings

    base = _built(tmp_path / "base")
    path = tmp_path / "run.toml"
    path.write_text(to_toml(load_config(overrides={"model.base_dir": str(base)})))  # every field, at its default
    check_settings(load_config(path))
    path.write_text(path.read_text().replace("num_heads = 4", "num_heads = 8"))
    with pytest.raises(ConfigError, match=r"model\.num_heads = 8"):
        check_settings(load_config(path))


@pytest.mark.parametrize("overrides, situation, field", [
    ({"task.kind": "math", "model.num_layers": "2"}, {}, "model.num_layers"),
    ({"task.kind": "math", "model.build_missing": "true"}, {}, "model.build_missing"),
    ({"chaos.min_gap_s": "3"}, {}, "chaos.min_gap_s"),
    ({"redis.appendfsync": "always"}, {"redis_url": "redis://elsewhere:6379/0"}, "redis.appendfsync"),
    ({"redis.appendfsync": "no"}, {"command": "chaos"}, "redis.appendfsync"),
    ({"redis.tls_ca_file": str(ROOT / "pyproject.toml")}, {"redis_url": "redis://x:6379/0"}, "redis.tls_ca_file"),
    ({"generator.vllm_dtype": "float16"}, {}, "generator.vllm_dtype"),
    ({"generator.backend": "vllm", "generator.device": "cuda"}, {}, "generator.device"),
    ({"trainer.loss": "tis", "trainer.clip_eps": "0.1"}, {}, "trainer.clip_eps"),
    ({"task.template": "Q: {problem}"}, {}, "task.template"),
    ({"weights.tcp_port": "5555"}, {}, "weights.tcp_port"),
    ({"weights.transport": "tcp", "weights.ucx_tls": "tcp"}, {}, "weights.ucx_tls"),
    ({"metrics.host": "0.0.0.0"}, {}, "metrics.host"),
    ({"verifier.reward": "single:mod9", "verifier.window": "512"}, {}, "verifier.window"),
    ({"verifier.reward": "majority", "verifier.dependence": "merge"}, {}, "verifier.dependence"),
])
def test_a_field_another_setting_makes_inert_is_refused_by_name(overrides, situation, field, tmp_path):
    if overrides.get("task.kind") == "math":
        (tmp_path / "p.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
        overrides = {**overrides, "task.dataset": str(tmp_path / "p.jsonl")}
    cfg = load_config(overrides=overrides)
    with pytest.raises(ConfigError, match=rf"^{field.replace('.', chr(92) + '.')} = .*cannot take effect"):
        refuse_inert(cfg, Situation(**situation))
    # The same value under the setting that reads it is fine; so is an unset field.
    refuse_inert(load_config(), Situation(**situation))


@pytest.mark.parametrize("overrides, situation", [
    ({"chaos.min_gap_s": "3", "redis.appendfsync": "always"}, {"command": "chaos"}),
    ({"model.build_missing": "true"}, {}),
    ({"model.build_missing": "true"}, {"base_model": {"seed": 2}}),  # "if missing": harmless once built
    ({"redis.tls_ca_file": str(ROOT / "pyproject.toml")}, {"redis_url": "rediss://x:6380/0"}),
    ({"generator.backend": "vllm", "generator.vllm_dtype": "float16"}, {}),
    ({"trainer.backend": "torchtitan", "trainer.device": "cuda"}, {}),
    ({"trainer.device": "cuda", "generator.device": "cuda"}, {}),  # the torch engines read both
    ({"weights.transport": "tcp", "weights.tcp_port": "5555"}, {}),
    ({"weights.transport": "ucx", "weights.ucx_tls": "tcp"}, {}),
    ({"metrics.base_port": "9400", "metrics.host": "0.0.0.0"}, {}),
    ({"verifier.reward": "weaver-hard", "verifier.window": "512"}, {}),
])
def test_the_same_fields_are_accepted_where_they_take_effect(overrides, situation):
    refuse_inert(load_config(overrides=overrides), Situation(**situation))
