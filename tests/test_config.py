import tomllib
from pathlib import Path

import pytest

from pipeline.config import ConfigError, RunConfig, documented_toml, load_config, to_toml

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
    assert cfg.verifier.verifiers == ["format", "mod9"]


@pytest.mark.parametrize("overrides, field", [
    ({"trainer.lr": "fast"}, "trainer.lr"),
    ({"trainer.lr": "2"}, "trainer.lr"),
    ({"trainer.loss": "ppo2"}, "trainer.loss"),
    ({"trainer.nope": "1"}, "trainer.nope"),
    ({"weights.transport": "carrier-pigeon"}, "weights.transport"),
    ({"task.ops": "-"}, "task.ops"),
    ({"run_id": "a b"}, "run_id"),
    ({"task.digits": "1"}, "task.heldout_size"),
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

    code = "import sys, pipeline.config; print('torch' in sys.modules, 'redis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_toml_output_is_valid_toml():
    assert tomllib.loads(to_toml(RunConfig()))["trainer"]["steps"] == RunConfig().trainer.steps
