"""The public API (pipeline/api.py) and the examples built on it (examples/)."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline import api
from pipeline.config import load_config
from pipeline.records import PromptTask

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.toml"


def _prompt(pid: str) -> PromptTask:
    return PromptTask(prompt_id=pid, prompt="1+2=", prompt_ids=np.array([1, 2, 3], dtype=np.int32), reference="3",
                      issued_at=time.time())


def test_api_version():
    assert api.API_VERSION == 1


def test_queues_round_trip_records_across_shards_and_ack(tmp_path, redis_url, redis_client):
    overrides = {"run_id": "api-queues", "runs_dir": str(tmp_path / "runs"), "redis.url": redis_url,
                 "redis.shards": 3}
    with api.Run(overrides=overrides, build_base_model=False) as run:
        assert run.server.process is None  # reached, not started: left running on exit
        q = run.queue("prompts")
        sent = [_prompt(f"p{i:08d}") for i in range(12)]
        assert q.put(sent) == 12
        per_shard = [redis_client.xlen(s.prompts) for s in run.keys.all_shards()]
        assert sum(per_shard) == 12 and sum(n > 0 for n in per_shard) >= 2, per_shard
        for rec in sent:  # each in the shard its prompt routes to, as the stages write
            shard = run.keys.shard(run.keys.shard_of(rec.prompt_id))
            ids = [PromptTask.decode(f[b"d"]).prompt_id for _, f in redis_client.xrange(shard.prompts)]
            assert rec.prompt_id in ids
        got = []
        while len(got) < 12:
            batch = q.get(5, consumer="c1", block_ms=50)
            assert batch, "entries went missing"
            assert len({e.shard for e, _ in batch}) == 1  # one read, one shard
            got += batch
        assert sorted(r.prompt_id for _, r in got) == sorted(r.prompt_id for r in sent)
        assert all(isinstance(r, PromptTask) and r.reference == "3" for _, r in got)
        assert q.depth() == 12  # delivered, not acked
        assert q.ack([e for e, _ in got[:7]]) == 7
        assert q.depth() == 5
        assert q.ack([e for e, _ in got[7:]]) == 5 and q.depth() == 0
        assert q.get(5, consumer="c1", block_ms=10) == []
        with pytest.raises(TypeError):
            run.queue("scored").put(sent[:1])
        with pytest.raises(ValueError):
            run.queue("nope")
    assert redis_client.ping()


def test_an_undecodable_entry_is_dead_lettered_and_acked(tmp_path, redis_url, redis_client):
    overrides = {"run_id": "api-dead", "runs_dir": str(tmp_path / "runs"), "redis.url": redis_url}
    with api.Run(overrides=overrides, build_base_model=False) as run:
        q = run.queue("rollouts")
        redis_client.xadd(run.keys.shard(0).rollouts, {"d": b"not msgpack"})
        assert q.get(4, consumer="v", block_ms=50) == []
        assert q.depth() == 0 and redis_client.xlen(run.keys.shard(0).dead) == 1


@pytest.mark.parametrize("field,spec", [
    ("verifier.verifiers", "format,units_digit,examples/my_verifier.py:last_digit_parity"),
    ("verifier.reward", "examples/my_reward.py:exact_or_length"),
    ("trainer.loss", "examples/my_loss.py:sequence_mean_ppo"),
])
def test_each_plugin_example_passes_the_drivers_checks(field, spec, monkeypatch):
    from pipeline.run.preflight import registry_problems

    monkeypatch.chdir(ROOT)  # specs are relative to where `pipeline up` runs
    assert registry_problems(load_config(None, {field: spec})) == []


def test_the_plugin_examples_compute_what_they_say(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import my_loss
    import my_reward
    import my_verifier
    import torch

    from pipeline.algo.losses import LossSettings

    v = my_verifier.last_digit_parity("911+ 41=", ["952", "951", "?"])
    assert v[0] == 1.0 and v[1] == 0.0 and np.isnan(v[2])
    assert my_reward.exact_or_length(["p"] * 3, ["a"] * 3, ["12"] * 3, ["12", "13", None]) == [1.0, 0.2, 0.0]
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = my_loss.sequence_mean_ppo(logp, logp.detach(), logp.detach(), torch.tensor([1.0, -1.0]),
                                            torch.ones(2, 3), LossSettings())
    loss.backward()
    assert "seq_mean_loss" in stats and logp.grad is not None


def test_every_example_names_the_command_that_runs_it():
    for path in (ROOT / "examples").glob("*.py"):
        doc = path.read_text().split('"""')[1]
        assert f"examples/{path.name}" in doc and ("pipeline up" in doc or "python examples/" in doc), path


def _run_example(script: Path, tmp_path: Path, base_model: Path, redis_url: str, *, steps: int, run_id: str,
                 extra: tuple[str, ...] = ()) -> tuple[dict, str]:
    """Run an example loop file as a process on configs/tiny.toml; its api_summary.json and output."""
    args = [sys.executable, str(script), "--steps", str(steps), "--config", str(TINY), "--model.base_dir",
            str(base_model), "--runs_dir", str(tmp_path / "runs"), "--run_id", run_id, "--redis.url", redis_url,
            "--trainer.eval_every", "2", "--task.heldout_size", "20", *extra]
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    return json.loads((tmp_path / "runs" / run_id / "api_summary.json").read_text()), out


@pytest.mark.slow
@pytest.mark.parametrize("example", ["grpo_loop.py", "reinforce_loop.py"])
def test_each_loop_example_runs_end_to_end(example, tmp_path, tiny_base_model, redis_url):
    steps = 3
    t0 = time.monotonic()
    summary, out = _run_example(ROOT / "examples" / example, tmp_path, tiny_base_model, redis_url, steps=steps,
                                run_id="loop", extra=("--save", str(tmp_path / "final")))
    c = summary["counts"]
    assert summary["consistent"], summary
    assert c["got"] == c["acked"] == steps * 4  # B = 4 groups per step in tiny.toml, every one acked
    assert c["put"] == c["got"] + c["left_in_queue"]
    assert set(summary["evals"]) == {"0", "2", "3"}
    assert "base held-out accuracy" in out and "-> final" in out
    metrics = [json.loads(x) for x in (tmp_path / "runs" / "loop" / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [m for m in metrics if m["kind"] == "step"]
    assert [m["version"] for m in steps_rows] == [1, 2, 3]
    trained = [m for m in steps_rows if m["groups_trained"]]
    assert trained and all(m["grad_norm"] > 0 and m["tokens"] > 0 for m in trained), steps_rows
    assert (tmp_path / "final" / "model.safetensors").is_file()  # --save: a checkpoint pipeline eval reads
    print(f"{example}: {time.monotonic() - t0:.1f} s")


LOSS_LINE = "# the loss"


@pytest.mark.slow
def test_editing_the_loss_line_of_the_grpo_loop_changes_what_trains(tmp_path, tiny_base_model, redis_url):
    from safetensors.torch import load_file

    source = (ROOT / "examples" / "grpo_loop.py").read_text()
    lines = [x for x in source.splitlines() if x.rstrip().endswith(LOSS_LINE)]
    assert len(lines) == 1 and "decoupled_ppo_loss(" in lines[0] and ", adv," in lines[0], lines
    # The edit: the same loss with the advantages' sign turned, which rewards what GRPO punishes.
    edited = tmp_path / "copy" / "grpo_loop.py"
    edited.parent.mkdir()
    edited.write_text(source.replace(lines[0], lines[0].replace(", adv,", ", -adv,")))
    sys_path_line = "sys.path.insert(0, str(Path(__file__).resolve().parent.parent))"
    assert sys_path_line in source  # the copy must import this checkout's pipeline package
    edited.write_text(edited.read_text().replace(sys_path_line, f"sys.path.insert(0, {str(ROOT)!r})"))

    def trained(script: Path, name: str) -> dict:
        # In this process (runpy), so the three runs pay for the imports once.
        main = runpy.run_path(str(script), run_name="example")["main"]
        summary = main(["--steps", "1", "--config", str(TINY), "--model.base_dir", str(tiny_base_model),
                        "--runs_dir", str(tmp_path / "runs"), "--run_id", name, "--redis.url", redis_url,
                        "--task.heldout_size", "20", "--save", str(tmp_path / name)])
        assert summary["consistent"] and summary["counts"]["trained"] > 0, summary  # the step had signal
        return load_file(tmp_path / name / "model.safetensors")

    base = load_file(tiny_base_model / "model.safetensors")
    first, again = trained(ROOT / "examples" / "grpo_loop.py", "a"), trained(ROOT / "examples" / "grpo_loop.py", "b")
    other = trained(edited, "edited")
    assert first.keys() == again.keys() == other.keys() == base.keys()
    # The file as shipped trains the same weights twice (same seeds, same first batch) ...
    assert all((first[k] == again[k]).all() for k in first)
    assert any(not (first[k] == base[k]).all() for k in first)  # ... and it trained
    # ... and the edited loss line trains different ones.
    assert any(not (first[k] == other[k]).all() for k in first)
