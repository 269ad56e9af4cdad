"""The base model a run starts from: the same bytes for the same recipe.

The default recipe's base is shipped in the package (``pipeline.model.pretrain.SHIPPED``),
so every machine starts the default run from identical weights; any other recipe is
trained, deterministically for its seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from pipeline.catalog import ADVANTAGES, ENVS, LOSSES, TASKS, TRANSPORTS
from pipeline.cli import parse
from pipeline.config import DEFAULT_BASE_DIR, ConfigError, load_config
from pipeline.model.pretrain import RECIPE_FILE, SHIPPED, install_shipped, pretrain, recipe
from pipeline.model.qwen import ModelShape, greedy_accuracy, load_checkpoint
from pipeline.model.recipe import differences, leaked
from pipeline.run.base_model import base_problems, base_recipe, ensure_base_model, evaluated_sets, resolve_base_dir
from pipeline.run.preflight import model_problems, preflight
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


def test_an_older_base_in_a_directory_of_the_users_is_used_and_said_to_differ(tmp_path, capsys):
    cfg = load_config(overrides={"model.base_dir": str(tmp_path / "base")})
    ensure_base_model(cfg)
    want = json.loads((tmp_path / "base" / RECIPE_FILE).read_text())
    (tmp_path / "base" / RECIPE_FILE).write_text(json.dumps({**want, "stop_loss": 0.45}))  # an older default
    capsys.readouterr()
    ensure_base_model(cfg)
    out = capsys.readouterr().out
    assert "model.pretrain_stop_loss = 0.45 (config: 0.4)" in out and "used as it is" in out
    (tmp_path / "base" / RECIPE_FILE).write_text(json.dumps(want))
    ensure_base_model(cfg)
    assert "used as it is" not in capsys.readouterr().out, "no note when the recipe matches"


# ----------------------------------------------------------------------------- a directory per recipe

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """A fresh working directory (no artifacts/) that sees the repository's configs/."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _stand_in(directory: Path, cfg, tiny_base_model) -> None:
    """What a run's base step leaves in ``directory`` for ``cfg``'s recipe (a checkpoint, its
    pretrain.json and its recipe), without the minutes of a full-size warm-up."""
    shutil.copytree(tiny_base_model, directory)
    (directory / RECIPE_FILE).write_text(json.dumps(base_recipe(cfg)))


@pytest.mark.parametrize("field,value", [
    ("task.heldout_size", "50"), ("task.heldout_seed", "7"), ("task.digits", "2"), ("task.ops", "+,*"),
    ("model.hidden_size", "64"), ("model.num_layers", "2"), ("model.num_heads", "2"), ("model.num_kv_heads", "1"),
    ("model.intermediate_size", "256"), ("model.pretrain_steps", "900"), ("model.pretrain_stop_loss", "0.5"),
    ("model.pretrain_batch_size", "64"), ("model.pretrain_lr", "1e-3"), ("model.seed", "3"),
])
def test_each_recipe_field_names_a_base_directory_of_its_own(field, value, in_tmp):
    default = resolve_base_dir(load_config())
    assert default.model.base_dir == DEFAULT_BASE_DIR, "the shipped recipe keeps the default location"
    other = resolve_base_dir(load_config(overrides={field: value}))
    assert other.model.base_dir.startswith(DEFAULT_BASE_DIR + "-") and other.model.base_dir != DEFAULT_BASE_DIR
    assert resolve_base_dir(load_config(overrides={field: value})).model.base_dir == other.model.base_dir
    assert any(d.startswith(field) for d in differences(base_recipe(default), base_recipe(other)))
    mine = resolve_base_dir(load_config(overrides={field: value, "model.base_dir": "mine"}))
    assert mine.model.base_dir == "mine", "a directory the user names is kept as given"


def test_the_default_location_holding_another_recipes_base_is_refused_naming_the_difference(
        in_tmp, tiny_base_model):
    tiny = load_config(overrides={"task.heldout_size": "50"})
    _stand_in(in_tmp / DEFAULT_BASE_DIR, tiny, tiny_base_model)  # what an older version left there
    before = _sha(in_tmp / DEFAULT_BASE_DIR / "model.safetensors")
    cfg = load_config()
    problems = base_problems(cfg)
    assert len(problems) == 1 and "task.heldout_size = 50 (config: 1000)" in problems[0]
    assert "`pipeline pretrain --force`" in problems[0] and "move it away" in problems[0]
    with pytest.raises(ConfigError, match=r"task\.heldout_size = 50 \(config: 1000\)"):
        ensure_base_model(cfg)
    with pytest.raises(ConfigError, match=r"task\.heldout_size = 50"):
        preflight(cfg)
    assert _sha(in_tmp / DEFAULT_BASE_DIR / "model.safetensors") == before, "kept as it is"


def test_a_warm_up_that_may_have_trained_on_the_runs_held_out_problems_is_refused(tmp_path, tiny_base_model):
    # A warm-up that left out the first 50 held-out problems (heldout_seed 1234, as the small
    # run's recipe says): a run evaluating on 50 is clean, one evaluating on 1000 is not, nor is
    # one on another seed.
    small = tmp_path / "small"
    _stand_in(small, load_config(overrides={"task.heldout_size": "50"}), tiny_base_model)
    ok = load_config(overrides={"model.base_dir": str(small), "task.heldout_size": "50"})
    assert base_problems(ok) == []
    wide = load_config(overrides={"model.base_dir": str(small)})
    (why,) = base_problems(wide)
    assert "may have trained on 950 of the held-out problems" in why and "task.heldout_size" in why
    with pytest.raises(ConfigError, match="may have trained on 950"):
        ensure_base_model(wide)
    other_seed = load_config(overrides={"model.base_dir": str(small), "task.heldout_size": "50",
                                        "task.heldout_seed": "7"})
    assert "may have trained on 50 of" in base_problems(other_seed)[0]
    # A base written before recipes were recorded cannot show what it left out.
    old = tmp_path / "old"
    shutil.copytree(tiny_base_model, old)
    (old / RECIPE_FILE).unlink()
    (why,) = base_problems(load_config(overrides={"model.base_dir": str(old), "task.heldout_size": "50"}))
    assert "records no held-out split" in why and "`pipeline pretrain --force`" in why


def test_the_warm_up_leaves_out_the_held_out_problems_of_every_arithmetic_eval_set(in_tmp):
    # Training on + and *, evaluating on *: the eval set's problems are the warm-up's kind.
    small = {"model.hidden_size": "32", "model.num_layers": "1", "model.num_heads": "2", "model.num_kv_heads": "1",
             "model.intermediate_size": "64", "model.pretrain_steps": "3", "model.pretrain_stop_loss": "0",
             "model.pretrain_batch_size": "8", "task.digits": "2", "task.ops": "+,*", "task.heldout_size": "20"}
    cfg = load_config(overrides={**small, "cluster.evaluators": "1", "eval.sets": "ops=*;heldout_size=30"})
    r = base_recipe(cfg)
    assert r["eval_sets"] == [{"digits": 2, "ops": ["*"], "heldout_size": 30, "heldout_seed": 1234}]
    assert leaked(r, evaluated_sets(cfg)) == 0
    without = {k: v for k, v in r.items() if k != "eval_sets"}
    assert leaked(without, evaluated_sets(cfg)) > 0, "the eval set's problems are trainable otherwise"
    info = ensure_base_model(cfg)
    base = Path(resolve_base_dir(cfg).model.base_dir)
    assert base.parent == Path("artifacts") and json.loads((base / RECIPE_FILE).read_text()) == r
    assert info["heldout_size"] == 20 and base_problems(resolve_base_dir(cfg)) == []
    # The same config without the eval worker evaluates on the task's set alone: another recipe.
    assert resolve_base_dir(load_config(overrides=small)).model.base_dir != str(base)


def _doc_commands() -> list[list[str]]:
    """Every ``pipeline up`` command of docs/extending.md and of the examples it names."""
    text = (ROOT / "docs" / "extending.md").read_text()
    for name in sorted(set(re.findall(r"examples/\w+\.py", text))):
        text += "\n" + (ROOT / name).read_text()
    text = text.replace("\\\\\n", " ").replace("\\\n", " ")  # docstrings' and shells' continuations
    return [shlex.split(line.strip().strip("`"))[1:] for line in text.splitlines()
            if line.strip().strip("`").startswith("pipeline up ")]


def _doc_files(directory: Path) -> list[str]:
    """The files docs/extending.md shows whole (a ``python`` block whose first line is ``# name.py``),
    written into ``directory`` as a reader following it would; their names."""
    text = (ROOT / "docs" / "extending.md").read_text()
    names = []
    for body in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        first = body.splitlines()[0]
        if re.fullmatch(r"# \w+\.py", first):
            (directory / first[2:]).write_text(body)
            names.append(first[2:])
    return names


@pytest.fixture
def registries():
    """The component registries as they were: a plugin the docs register is taken out after."""
    saved = {reg: dict(reg._entries) for reg in (TASKS, ADVANTAGES, LOSSES, TRANSPORTS, ENVS)}
    yield
    for reg, entries in saved.items():
        reg._entries.clear()
        reg._entries.update(entries)


def test_the_extending_commands_then_a_default_run_leave_the_shipped_base_untouched(in_tmp, tiny_base_model,
                                                                                    registries):
    assert "my_lab.py" in _doc_files(in_tmp)  # the plugin module its commands name
    commands = _doc_commands()
    assert len(commands) >= 4 and any("configs/tiny.toml" in c for c in commands)
    made = {}
    for argv in commands:  # each command's base step, as `pipeline up` takes it
        _, cfg = parse(argv)
        cfg = resolve_base_dir(cfg)
        base = Path(cfg.model.base_dir)
        if base_recipe(cfg) == json.loads((SHIPPED / RECIPE_FILE).read_text()):
            assert base == Path(DEFAULT_BASE_DIR)
        else:
            assert base != Path(DEFAULT_BASE_DIR), f"{argv} would build into the default run's base"
            if not base.exists():
                _stand_in(base, cfg, tiny_base_model)
            made[base] = _sha(base / "model.safetensors")
        assert base_problems(cfg) == []
    assert made, "the tiny config's recipe differs from the shipped one"
    cfg = resolve_base_dir(parse(["up", "--metrics.base_port", "9400"])[1])  # then `make up-cluster`'s base step
    assert model_problems(cfg) == []
    info = ensure_base_model(cfg)
    assert cfg.model.base_dir == DEFAULT_BASE_DIR and info["source"] == "shipped"
    for f in SHIPPED.iterdir():
        if f.name != "pretrain.json":  # the copy records its source
            assert _sha(in_tmp / DEFAULT_BASE_DIR / f.name) == _sha(f), f.name
    model, tok = load_checkpoint(in_tmp / DEFAULT_BASE_DIR)
    heldout = task.heldout_problems(n=cfg.task.heldout_size, seed=cfg.task.heldout_seed, digits=cfg.task.digits,
                                    ops=tuple(cfg.task.ops))
    assert info["heldout_accuracy"] == greedy_accuracy(model.eval(), tok, heldout) == 0.424
    assert {b: _sha(b / "model.safetensors") for b in made} == made, "nor did the default run touch theirs"
