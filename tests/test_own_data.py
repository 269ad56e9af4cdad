"""Your own data: a GSM8K-style file with ``question``/``answer`` fields goes through
``pipeline init-model`` and the math task, and the held-out rows are never trained on."""

from __future__ import annotations

import json

import pytest

from pipeline import cli
from pipeline.config import load_config
from pipeline.tasks.math import split

pytest.importorskip("math_verify")


def _rows(n: int) -> list[dict]:
    return [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1), "id": i} for i in range(n)]


@pytest.fixture
def gsm(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(60)))
    return path


def test_init_model_honours_the_fields_and_never_warms_up_on_held_out_rows(tmp_path, gsm, monkeypatch):
    import pipeline.model.init_model as im

    seen: dict = {}
    real = im.warm_up

    def spy(directory, rows, **kw):
        seen["rows"], seen["kw"] = list(rows), kw
        return real(directory, rows, **kw)

    monkeypatch.setattr(cli, "warm_up", spy)  # the name the command calls
    flags = ["--task.kind", "math", "--task.dataset", str(gsm), "--task.prompt_field", "question",
             "--task.answer_field", "answer", "--task.heldout_size", "10"]
    out = tmp_path / "model"
    assert cli.main(["init-model", "--out", str(out), "--warmup-steps", "2", *flags]) == 0
    summary = json.loads((out / "init.json").read_text())
    assert (summary["training_rows"], summary["heldout_rows_excluded"]) == (50, 10)
    cfg = load_config(overrides={k[2:]: v for k, v in zip(flags[::2], flags[1::2])})
    from pipeline.tasks.math import MathTask

    heldout = {item.prompt for item in MathTask(cfg.task).heldout()}
    assert len(heldout) == 10
    warmed = {r["question"] for r in seen["rows"]}
    assert len(warmed) == 50 and not (warmed & heldout), "a held-out row reached the warm-up"
    assert seen["kw"]["prompt_field"] == "question" and seen["kw"]["answer_field"] == "answer"


def test_the_split_is_the_tasks_and_a_missing_field_is_named(tmp_path, gsm, capsys):
    cfg = load_config(overrides={"task.kind": "math", "task.dataset": str(gsm), "task.prompt_field": "question",
                                 "task.answer_field": "answer", "task.heldout_size": "10"})
    train, held = split(60, cfg.task)
    assert sorted(train + held) == list(range(60)) and len(held) == 10
    code = cli.main(["init-model", "--out", str(tmp_path / "m"), "--task.kind", "math", "--task.dataset", str(gsm),
                     "--task.heldout_size", "10"])
    err = capsys.readouterr().err
    assert code == 2 and "task.prompt_field: " in err and "has no field 'problem'" in err, err
    assert "'question'" in err, "the file's own fields are listed"


def test_rows_without_an_answer_are_trained_on_never_held_out(tmp_path):
    from pipeline.tasks.math import MathTask

    rows = _rows(40)
    for r in rows[::2]:
        r["answer"] = ""  # half the file unlabelled
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(overrides={"task.kind": "math", "task.dataset": str(path), "task.prompt_field": "question",
                                 "task.answer_field": "answer", "task.heldout_size": "8"})
    task = MathTask(cfg.task)
    held = task.heldout()
    assert len(held) == 8 and all(item.reference for item in held), "only labelled rows are held out"
    stream = task.training(0)
    train = [next(stream) for _ in range(32)]
    assert sum(not item.reference for item in train) == 20, "every unlabelled row is a training row"
    assert not ({i.prompt for i in held} & {i.prompt for i in train})
    assert list(task.correctness("", ["\\boxed{1}"])) == [0.0]
    with pytest.raises(ValueError, match="task.heldout_size"):
        MathTask(cfg.task.__class__(**{**cfg.task.__dict__, "heldout_size": 25}))
