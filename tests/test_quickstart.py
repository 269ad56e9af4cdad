"""The real-model quick start (configs/real-quick.toml, `make real-quick`, docs/real-models.md):
its config passes the checks before launch, its reward runs no verifier, and a base model that
answers nothing right is reported with what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.keys import Keys

ROOT = Path(__file__).resolve().parent.parent
QUICK = ROOT / "configs" / "real-quick.toml"


def test_the_quick_start_reward_reads_no_verifier_and_its_panel_reads_its_prompts(monkeypatch):
    pytest.importorskip("reasoning_gym")
    from pipeline.algo.rewards import parse_reward_mode
    from pipeline.config import task_verifiers
    from pipeline.consumers.verifier import panel_problems

    cfg = load_config(QUICK)
    assert parse_reward_mode(cfg.verifier.reward).reads(cfg.verifier.verifiers) == ()
    assert cfg.verifier.verifiers == task_verifiers(cfg.task)  # the task's own default panel, listed
    monkeypatch.chdir(ROOT)
    if (ROOT / cfg.model.base_dir / "config.json").is_file():  # imported: the panel applies to its prompts
        assert panel_problems(cfg.replace("verifier.monitor_share", 0.25)) == []


def _trainer_state(redis_client, keys: Keys, **fields) -> None:
    redis_client.delete(keys.trainer)
    redis_client.hset(keys.trainer, mapping=fields)


def test_a_base_that_answers_nothing_right_is_reported_with_what_to_change(redis_client, capsys):
    from pipeline.run.launch import report_hopeless_base

    cfg, keys = load_config(QUICK), Keys("quick")
    _trainer_state(redis_client, keys, version=0)
    assert report_hopeless_base(redis_client, keys, cfg) is False  # no evaluation, no batch yet: ask again
    _trainer_state(redis_client, keys, version=0, base_accuracy=0.0)
    assert report_hopeless_base(redis_client, keys, cfg) is False  # the first batch not taken yet: ask again
    # The trainer writes its first batch's hidden accuracy before it trains on it (version still 0).
    _trainer_state(redis_client, keys, version=0, base_accuracy=0.0, first_batch_accuracy=0.0)
    assert report_hopeless_base(redis_client, keys, cfg) is True
    err = capsys.readouterr().err
    assert "answers nothing right" in err and "task.dataset_params" in err and "model.base_dir" in err
    for fields in ({"base_accuracy": 0.0, "first_batch_accuracy": 0.05},
                   {"base_accuracy": 0.01, "first_batch_accuracy": 0.0}):
        _trainer_state(redis_client, keys, version=0, **fields)
        assert report_hopeless_base(redis_client, keys, cfg) is True
        assert capsys.readouterr().err == ""  # some success: nothing to report
