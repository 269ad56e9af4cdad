"""The rollout archive, exact replay and ``pipeline diff`` (docs/reproducibility.md), on real runs:
a chaos run (η = 1, its trainer SIGKILLed twice and the server once) replayed bit for bit from
its archive, final checkpoint included; the archive read by pandas and DuckDB as the docs show;
a counterfactual replay; a run beside it with another sampling seed, told apart by ``diff``."""

from __future__ import annotations

import json
import subprocess

import pytest
from harness import CLI, up as _up

from pipeline.common import archive as arc
from pipeline.run.replay import ReplayError, diff, read_groups, replay

pytestmark = [pytest.mark.slow, pytest.mark.one_server]
STEPS = 10


def _run(tmp_path, base, run_id: str, *extra: str, command: str = "up"):
    p = _up(tmp_path, base, "--run-id", run_id, "--trainer.steps", str(STEPS), *extra, command=command)
    out = p.communicate(timeout=600)[0].decode()
    assert p.returncode == 0, out[-4000:]
    return tmp_path / "runs" / run_id


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory, tiny_base_model):
    tmp = tmp_path_factory.mktemp("replay")
    run = _run(tmp, tiny_base_model, "kept", "--chaos.schedule", "trainer,redis,trainer",
               "--redis.claim_idle_ms", "1500", command="chaos")
    return tmp, run


def test_a_chaos_run_replays_bit_for_bit_from_its_archive(chaos_run):
    tmp, run = chaos_run
    resumes = arc.resumes(run / "archive")
    assert len(resumes) == 2, "both SIGKILLs of the trainer are in the archive's record of resumes"
    metas = arc.steps(run / "archive")
    assert [m.step for m in metas] == list(range(1, STEPS + 1)), "one segment a step, none missing or twice"
    recorded = {json.loads(x)["version"]: json.loads(x)["weights_hash"]
                for x in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "step"' in x}
    assert {m.step: m.weights_hash for m in metas} == recorded, "the segments carry the step rows' hashes"
    assert len(set(recorded.values())) == STEPS, "every step changed the weights"

    res = replay(run)
    assert res.identical and res.steps == res.matched == STEPS, res.to_dict()
    assert res.final_checkpoint == "match", "checkpoints/final holds exactly the replayed weights"
    assert res.final_hash == recorded[STEPS]
    rows = [json.loads(x) for x in (run / "replay" / "replay.jsonl").read_text().splitlines()]
    assert [r["weights_hash"] for r in rows] == [recorded[v] for v in range(1, STEPS + 1)]
    assert diff(run, run / "replay")["first_difference"] is None


def test_the_cli_replays_to_a_step_and_under_a_changed_setting(chaos_run):
    tmp, run = chaos_run
    recorded = {m.step: m.weights_hash for m in arc.steps(run / "archive")}
    p = subprocess.run([*CLI, "replay", str(run), "--stop-at", "4", "--out", str(tmp / "at4")], cwd=tmp,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "replay step 4 (4/4): ok" in p.stderr, "progress lines, one a step"
    out = json.loads(p.stdout)
    assert out["steps"] == 4 and out["final_hash"] == recorded[4]
    from safetensors.torch import load_file

    from pipeline.engines.torch_state import weights_hash

    assert weights_hash(load_file(str(tmp / "at4" / "checkpoint" / "model.safetensors"))) == recorded[4]

    p = subprocess.run([*CLI, "replay", str(run), "--set", "trainer.lr=0.003", "--out", str(tmp / "lr")], cwd=tmp,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["counterfactual"] == {"trainer.lr": "0.003"} and out["steps"] == STEPS and out["matched"] == 0
    assert diff(run, tmp / "lr")["first_difference"]["step"] == 1
    assert (tmp / "lr" / "checkpoint" / "model.safetensors").exists()

    bad = subprocess.run([*CLI, "replay", str(run), "--set", "trainer.lr=7"], cwd=tmp, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "trainer.lr" in bad.stderr, bad.stderr


def test_the_archive_reads_with_pandas_and_duckdb(chaos_run):
    _, run = chaos_run
    pd = pytest.importorskip("pandas")
    duckdb = pytest.importorskip("duckdb")
    df = pd.read_parquet(run / "archive")  # the _-prefixed files and folders are skipped
    assert list(df.columns) == list(arc.COLUMNS)
    groups = df[df.completion == 0]
    assert len(groups) == STEPS * 4 and groups.groupby("step").size().eq(4).all()
    assert df.prompt_id.is_unique is False and groups.prompt_id.is_unique, "every prompt trained once"
    assert (df.reward.between(0, 1)).all() and set(df.outcome) <= {"trained", "nosignal", "stale"}
    assert all(len(c) == len(v) == len(lp) for c, v, lp in zip(df.completion_ids, df.token_versions,
                                                               df.behaviour_logprobs))
    per_step = duckdb.sql(f"select step, count(*) n, avg(truth) acc from read_parquet('{run}/archive/step-*.parquet') "
                          "group by step order by step").fetchall()
    assert [s for s, _, _ in per_step] == list(range(1, STEPS + 1)) and all(n == 16 for _, n, _ in per_step)


def test_diff_names_the_first_step_two_runs_part_and_why(chaos_run, tiny_base_model):
    tmp, run = chaos_run
    other = _run(tmp, tiny_base_model, "other-seed", "--generator.seed", "7")
    d = diff(run, other)["first_difference"]
    assert d["step"] == 1, d
    # The first step of each run as the trainer took it: its groups' prompts and outcomes, in order.
    (ga, oa), (gb, ob) = (read_groups(arc.segments(r / "archive")[0]) for r in (run, other))
    ids_a, ids_b = [g.rollout.prompt_id for g in ga], [g.rollout.prompt_id for g in gb]
    if ids_a != ids_b or oa != ob:  # on a busy machine other groups can reach the trainer first: timing, not the seed
        assert d["differs"] == "batch", d
        assert set(d["only_in_a"]) == set(ids_a) - set(ids_b) and set(d["only_in_b"]) == set(ids_b) - set(ids_a), d
    else:  # the same groups, sampled from another random stream
        assert d["differs"] == "samples", d
        assert "random stream" in d["cause"] or "sampled differently" in d["cause"], d


def test_replay_refuses_an_archive_that_lost_its_first_steps(chaos_run, tmp_path):
    _, run = chaos_run
    copy = tmp_path / "pruned"
    subprocess.run(["cp", "-r", str(run), str(copy)], check=True)
    for path in arc.segments(copy / "archive")[:3]:
        path.unlink()
    with pytest.raises(ReplayError, match="starts at step 4.*step 3"):
        replay(copy)
    (copy / "archive" / "step-000006.parquet").unlink()
    with pytest.raises(ReplayError, match="starts at step 4"):
        replay(copy)
    assert any("step 7 starts from version 6" in p for p in arc.lineage_problems(copy / "archive",
                                                                                   arc.steps(copy / "archive")))


def test_a_resume_moves_the_steps_no_checkpoint_held_aside(chaos_run, tmp_path):
    _, run = chaos_run
    directory = tmp_path / "archive"
    w = arc.ArchiveWriter(directory)
    for m in arc.steps(run / "archive")[:5]:
        groups, outcomes = read_groups(m.path)
        w.write(step=m.step, parent=m.parent, groups=groups, outcomes=outcomes, weights_hash=m.weights_hash,
                updated=m.updated)
    w.flush()
    assert w.groups == 20 and w.bytes > 0
    assert w.resumed(3, 9) == [4, 5], "the steps after the checkpoint died with the trainer's model"
    assert [m.step for m in arc.steps(directory)] == [1, 2, 3]
    assert len(list((directory / arc.ABANDONED).iterdir())) == 2
    assert arc.resumes(directory)[-1]["resumed_as"] == 9
    # The resumed trainer's next step starts from version 9, which is the checkpoint of step 3.
    groups, outcomes = read_groups(arc.segments(run / "archive")[3])
    w.write(step=10, parent=9, groups=groups, outcomes=outcomes, weights_hash="x", updated=True)
    w.close()
    assert arc.lineage_problems(directory, arc.steps(directory)) == []


def test_distill_trains_on_the_archive(chaos_run, tmp_path):
    _, run = chaos_run
    from pipeline.algo.distill import DistillConfig, distill_run, load_archive

    groups, names = load_archive(run)
    assert len(groups) == STEPS * 4 and names and all(len(g.completions) == 4 for g in groups)
    assert all(g.prompt and (g.posterior >= 0).all() and (g.posterior <= 1).all() for g in groups)
    report = distill_run(run, DistillConfig(init="scratch", epochs=1.0), out=tmp_path / "distilled", progress=None, source="archive")
    assert report["source"] == "archive" and report["groups"] == STEPS * 4
    assert (tmp_path / "distilled" / "model.safetensors").exists()
