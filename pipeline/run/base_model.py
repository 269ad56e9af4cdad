"""The base model a run starts from (``model.base_dir``): what a checkpoint there records
(``built_base_model``), the recipe the config asks for and the directory it belongs in
(``base_recipe``, ``resolve_base_dir``), why a checkpoint there cannot start this run
(``base_problems``), and a missing one installed or built (``ensure_base_model``: the shipped
base, or the supervised warm-up of ``pipeline.model.pretrain``; ``pipeline pretrain``)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.config import DEFAULT_BASE_DIR, ConfigError, RunConfig, eval_set_task
from pipeline.model.recipe import (RECIPE_FILE, SHIPPED, differences, heldout_sets, leaked, read_recipe, recipe,
                                   recipe_dir, shipped_recipe)
from pipeline.tasks import arithmetic


def built_base_model(cfg: RunConfig) -> dict | None:
    """What the pretrained checkpoint in ``model.base_dir`` records (``pretrain.json``); for a
    checkpoint built another way (``config.json`` and no ``pretrain.json``: ``pipeline
    init-model``, the tool warm-up of pipeline.model.tool_warmup, an imported model) a record
    saying so; None when there is no checkpoint and ``ensure_base_model`` would build one."""
    base = Path(cfg.model.base_dir)
    info = base / "pretrain.json"
    if info.exists():
        return json.loads(info.read_text())
    if (base / "config.json").is_file():
        tool = base / "tool_warmup.json"
        return {"source": "checkpoint", **({"tool_warmup": json.loads(tool.read_text())} if tool.is_file() else {})}
    return None


def base_recipe(cfg: RunConfig) -> dict:
    """The recipe of the base model ``cfg`` asks for (task.kind ``arithmetic``): its shape and
    warm-up, and every held-out set of the run it must leave out (``evaluated_sets``)."""
    m, t = cfg.model, cfg.task
    shape = {k: getattr(m, k) for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")}
    others = evaluated_sets(cfg)[1:]  # the first is the task's own: heldout_size, heldout_seed
    overlapping = [s for s in others if s["digits"] == t.digits and set(s["ops"]) & set(t.ops)]
    return recipe(shape=shape, digits=t.digits, ops=t.ops, steps=m.pretrain_steps, batch_size=m.pretrain_batch_size,
                  lr=m.pretrain_lr, seed=m.seed, stop_loss=m.pretrain_stop_loss or None, heldout_size=t.heldout_size,
                  heldout_seed=t.heldout_seed, eval_sets=overlapping)


def evaluated_sets(cfg: RunConfig) -> list[dict]:
    """Every arithmetic held-out set the run evaluates on, the task's own first: the task's
    held-out split, and with an eval worker each arithmetic set of ``eval.sets``."""
    tasks = [cfg.task]
    for spec in cfg.eval.sets if cfg.cluster.evaluators else ():
        try:
            tasks.append(eval_set_task(cfg.task, spec))
        except ConfigError:
            continue  # the preflight names it (eval_problems)
    return [{"digits": t.digits, "ops": list(t.ops), "heldout_size": t.heldout_size, "heldout_seed": t.heldout_seed}
            for t in tasks if t.kind == "arithmetic"]


def resolve_base_dir(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``model.base_dir`` at the directory of its recipe when it names the default
    location: ``artifacts/base-model`` for the shipped recipe, ``artifacts/base-model-<digest>``
    for any other, so that a run with another recipe never reuses nor overwrites the default
    run's base. A directory named otherwise is the user's: kept as given."""
    if cfg.task.kind != "arithmetic" or Path(cfg.model.base_dir).resolve() != Path(DEFAULT_BASE_DIR).resolve():
        return cfg
    target = recipe_dir(cfg.model.base_dir, base_recipe(cfg))
    return cfg if target == Path(cfg.model.base_dir) else cfg.replace("model.base_dir", str(target))


def recorded_recipe(base: Path, built: dict) -> dict:
    """The recipe ``base`` records (``recipe.json``); for a directory written before recipes
    were recorded, what its ``pretrain.json`` says (no ``heldout_seed``)."""
    if (r := read_recipe(base)) is not None:
        return r
    return {"shape": built.get("shape"), "digits": built.get("digits"), "ops": built.get("ops"),
            "steps": built.get("max_steps"), "batch_size": built.get("batch_size"), "lr": built.get("lr"),
            "seed": built.get("seed"), "stop_loss": built.get("stop_loss"), "heldout_size": built.get("heldout_size"),
            "heldout_seed": None, "schedule": built.get("schedule"), "warmup": built.get("warmup")}


def base_model_differences(cfg: RunConfig, built: dict) -> list[str]:
    """``field = recorded (config: value)`` for each recipe entry where the checkpoint in
    ``model.base_dir`` (its ``recipe.json``) and the config disagree (an older default, another recipe)."""
    return differences(recorded_recipe(Path(cfg.model.base_dir), built), base_recipe(cfg))


def base_problems(cfg: RunConfig) -> list[str]:
    """Why the warm-up checkpoint in ``model.base_dir`` cannot start this run (empty: it can, or
    there is none to judge): at the default location, one built from another recipe; anywhere,
    one whose warm-up may have trained on a held-out problem the run evaluates on."""
    base = Path(cfg.model.base_dir)
    if cfg.task.kind != "arithmetic" or not (base / "pretrain.json").is_file():
        return []
    built = json.loads((base / "pretrain.json").read_text())
    have = recorded_recipe(base, built)
    want = base_recipe(cfg)
    if base.resolve() == recipe_dir(DEFAULT_BASE_DIR, want).resolve() and have != want:
        return [f"model.base_dir: {str(base)!r}, where this recipe's base belongs, holds one built from another "
                f"recipe ({'; '.join(differences(have, want))}): move it away (it is kept as it is) or "
                "replace it with this recipe's base (`pipeline pretrain --force`, with this config)"]
    n = leaked(have, evaluated_sets(cfg))
    if n is None:
        return [f"model.base_dir: {str(base)!r} records no held-out split of its warm-up (no {RECIPE_FILE}: written "
                "before recipes were recorded), so its warm-up may have trained on this run's held-out problems: "
                "rebuild it with `pipeline pretrain --force` and this config, or point model.base_dir elsewhere"]
    if n:
        return [f"model.base_dir: the warm-up of {str(base)!r} may have trained on {n} of the held-out problems this "
                f"run evaluates on (it left out {json.dumps(heldout_sets(have))}; the run evaluates on "
                f"{json.dumps(evaluated_sets(cfg))}): leave model.base_dir at its default (each recipe gets a base "
                "of its own), rebuild it with `pipeline pretrain --force` and this config, or evaluate on a set it "
                "left out (task.heldout_size, task.heldout_seed, eval.sets)"]
    return []


def builds_base_model(cfg: RunConfig) -> bool:
    """Whether a missing ``model.base_dir`` may be built by this run: the task has a warm-up
    (only ``arithmetic``) and the directory is the default location (or the config's recipe's
    directory there, ``resolve_base_dir``) or ``model.build_missing`` is set."""
    if cfg.task.kind != "arithmetic":
        return False
    base = Path(cfg.model.base_dir).resolve()
    return (cfg.model.build_missing or base == Path(DEFAULT_BASE_DIR).resolve()
            or base == recipe_dir(DEFAULT_BASE_DIR, base_recipe(cfg)).resolve())


def ensure_base_model(cfg: RunConfig, *, force: bool = False) -> dict:
    """Pretrain the base model into ``model.base_dir`` (at the default location, the directory
    of the config's recipe: ``resolve_base_dir``) unless a checkpoint is there; ConfigError when
    the checkpoint there cannot start this run (``base_problems``)."""
    cfg = resolve_base_dir(cfg)
    base = Path(cfg.model.base_dir)
    if not force and (built := built_base_model(cfg)) is not None:
        if problems := base_problems(cfg):
            raise ConfigError("; ".join(problems))
        if (base / "pretrain.json").is_file() and cfg.task.kind == "arithmetic" and (
                differ := base_model_differences(cfg, built)):
            print(f"note: {base} holds a base model built with {', '.join(differ)}; it is used as it is "
                  f"(remove it, or point model.base_dir elsewhere, for the one this config describes)", flush=True)
        return built
    if cfg.task.kind != "arithmetic":
        # Only the embedded task has a warm-up; any other task starts from the checkpoint given.
        if not (base / "config.json").is_file():
            raise FileNotFoundError(f"model.base_dir: {base} is not an HF checkpoint directory (config.json, "
                                    "safetensors, tokenizer.json); `pipeline init-model` builds one")
        return {}
    if base.resolve() == SHIPPED.resolve():
        raise ConfigError(f"model.base_dir: {str(base)!r} is the package's shipped base, which nothing writes; "
                          "point model.base_dir elsewhere")
    # torch and transformers: loaded only when a base model is installed or built, never by a
    # driver whose base is there already.
    from pipeline.model.pretrain import install_shipped, pretrain
    from pipeline.model.qwen import ModelShape

    m, t = cfg.model, cfg.task
    shape = ModelShape(hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                       num_kv_heads=m.num_kv_heads, intermediate_size=m.intermediate_size)
    want = base_recipe(cfg)
    if not force and (shipped := install_shipped(base, want)) is not None:
        # The same bytes on every machine (pipeline.model.pretrain says why it is shipped).
        print(f"installed the shipped base model in {base} (held-out greedy accuracy "
              f"{shipped['heldout_accuracy']:.1%}; `pipeline pretrain --force` trains it here instead)", flush=True)
        return shipped
    print(f"building the base model in {base} (supervised warm-up, at most {m.pretrain_steps} steps)", flush=True)
    if (shipped_r := shipped_recipe()) is not None and want != shipped_r:
        differ = "; ".join(differences(shipped_r, want, label="here"))
        print(f"  its recipe differs from the shipped base's in {differ}", flush=True)
    extra = [p for s in evaluated_sets(cfg)[1:] for p in arithmetic.heldout_problems(
        n=s["heldout_size"], seed=s["heldout_seed"], digits=s["digits"], ops=tuple(s["ops"]))]
    return pretrain(base, shape=shape, digits=t.digits, ops=tuple(t.ops), steps=m.pretrain_steps,
                    batch_size=m.pretrain_batch_size, lr=m.pretrain_lr, seed=m.seed,
                    stop_loss=m.pretrain_stop_loss or None, record=want, exclude=extra,
                    heldout=arithmetic.heldout_problems(n=t.heldout_size, seed=t.heldout_seed, digits=t.digits,
                                                        ops=tuple(t.ops)))
