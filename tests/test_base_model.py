"""The base model a run starts from: the same bytes for the same recipe.

The default recipe's base is shipped in the package (``pipeline.model.pretrain.SHIPPED``),
so every machine starts the default run from identical weights; any other recipe is
trained, deterministically for its seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from pipeline.config import load_config
from pipeline.model.pretrain import RECIPE_FILE, SHIPPED, install_shipped, pretrain, recipe
from pipeline.model.qwen import ModelShape, load_checkpoint
from pipeline.run.launch import ensure_base_model
from pipeline.tasks import arithmetic as task


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_default_config_installs_the_shipped_base_byte_for_byte(tmp_path, capsys):
    cfg = load_config(overrides={"model.base_dir": str(tmp_path / "base")})
    info = ensure_base_model(cfg)
    assert info["source"] == "shipped" and "installed the shipped base" in capsys.readouterr().out
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert _sha(tmp_path / "base" / name) == _sha(SHIPPED / name)
    model, tok = load_checkpoint(tmp_path / "base")
    assert tok.vocab_size == model.config.vocab_size
    assert info["heldout_size"] == cfg.task.heldout_size and info["seed"] == cfg.model.seed
    # Present now: a second call keeps what is there.
    assert ensure_base_model(cfg)["source"] == "shipped"


def test_the_shipped_recipe_is_the_default_configs(tmp_path):
    shipped = json.loads((SHIPPED / RECIPE_FILE).read_text())
    m, t = load_config().model, load_config().task
    assert shipped["shape"] == {"hidden_size": m.hidden_size, "num_layers": m.num_layers, "num_heads": m.num_heads,
                                "num_kv_heads": m.num_kv_heads, "intermediate_size": m.intermediate_size}
    assert (shipped["seed"], shipped["steps"], shipped["stop_loss"], shipped["heldout_seed"]) == (
        m.seed, m.pretrain_steps, m.pretrain_stop_loss, t.heldout_seed)
    other = {**shipped, "seed": shipped["seed"] + 1}
    assert install_shipped(tmp_path / "other", other) is None, "another recipe is never given the shipped bytes"
    assert not (tmp_path / "other").exists()


def test_pretraining_writes_the_same_bytes_for_the_same_seed(tmp_path):
    shape = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    heldout = task.heldout_problems(n=20, seed=1234, digits=2, ops=("+",))
    runs = []
    for name, seed, threads in (("a", 3, 1), ("b", 3, 2), ("c", 4, 1)):
        pretrain(tmp_path / name, shape=shape, digits=2, ops=("+",), steps=15, batch_size=16, lr=2e-3, seed=seed,
                 heldout=heldout, threads=threads, progress=False, log=lambda _: None)
        runs.append(_sha(tmp_path / name / "model.safetensors"))
    assert runs[0] == runs[1], "one seed, one set of bytes (1 or 2 threads)"
    assert runs[0] != runs[2], "another seed trains another model"
    assert dataclasses.asdict(shape) == recipe(shape=shape, digits=2, ops=("+",), steps=15, batch_size=16, lr=2e-3,
                                               seed=3, stop_loss=None, heldout_size=20, heldout_seed=1234)["shape"]


def test_an_older_base_in_the_directory_is_used_and_said_to_differ(tmp_path, capsys):
    cfg = load_config(overrides={"model.base_dir": str(tmp_path / "base")})
    ensure_base_model(cfg)
    info = json.loads((tmp_path / "base" / "pretrain.json").read_text())
    (tmp_path / "base" / "pretrain.json").write_text(json.dumps({**info, "stop_loss": 0.45}))  # an older default
    capsys.readouterr()
    assert ensure_base_model(cfg)["stop_loss"] == 0.45
    out = capsys.readouterr().out
    assert "model.pretrain_stop_loss = 0.45 (config: 0.4)" in out and "used as it is" in out
    (tmp_path / "base" / "pretrain.json").write_text(json.dumps(info))
    ensure_base_model(cfg)
    assert "used as it is" not in capsys.readouterr().out, "no note when the recipe matches"
