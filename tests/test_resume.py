"""``pipeline up --resume`` (pipeline.run.resume): a run killed with everything it started (its
driver, every worker and its own server, as a batch job's time limit or a session's end does)
continues from its server's append-only file and its trainer's checkpoint, and finishes with
every prompt accounted for; what cannot be resumed is refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis
from harness import CLI, TINY, up

from pipeline.keys import Keys
from pipeline.run.accounting import account

STEPS = 30


def _wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}:\n{out[-3000:]}")
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _committed(run_dir: Path) -> int:
    """The last step row of the run's metrics (0 before the first)."""
    try:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except OSError:
        return 0
    return max((r["version"] for r in rows if r.get("kind") == "step"), default=0)


def _kill_everything(runs_dir: Path, driver: subprocess.Popen, *, server: bool) -> None:
    """SIGKILL the driver, every worker it recorded and (``server``) the server it started: nothing
    stops cleanly, no stop key is set, no summary is written."""
    info = json.loads((runs_dir / "cluster.json").read_text())
    pids = [info["driver_pid"], *info["workers"].values(), *(info["server_pids"] if server else [])]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    driver.wait(30)
    for pid in pids:  # gone, not merely signalled
        _wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), 30, f"pid {pid} to exit")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return True


def _resume(tmp_path: Path, run_id: str, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return subprocess.run([*CLI, "up", "--resume", "--run_id", run_id, "--runs_dir", str(tmp_path / "runs"), *extra],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, timeout=300)


@pytest.mark.parametrize("where", ["embedded", "external"])
def test_a_run_killed_with_everything_it_started_resumes_and_finishes_losing_nothing(tmp_path, tiny_base_model,
                                                                                      redis_url, where):
    run_id = f"resume-{where}"
    runs_dir, run_dir = tmp_path / "runs", tmp_path / "runs" / run_id
    extra = ["--redis.url", redis_url] if where == "external" else []
    p = up(tmp_path, tiny_base_model, "--run_id", run_id, "--trainer.steps", str(STEPS),
           "--trainer.checkpoint_every", "2", *extra)
    launched = time.time()
    _wait_for(lambda: _committed(run_dir) >= 3, 240, "step 3", p)
    driver_pid = json.loads((runs_dir / "cluster.json").read_text())["driver_pid"]
    _kill_everything(runs_dir, p, server=where == "embedded")
    killed = time.time()
    killed_at = _committed(run_dir)
    # The driver left no summary, but its heartbeat says how long it ran (it beats every 2 s).
    beat = json.loads((run_dir / "driver.json").read_text())
    assert beat["pid"] == driver_pid and launched <= beat["started"] < beat["alive_at"] <= killed
    assert killed - beat["alive_at"] < 60  # every 2 s on a quiet machine; a starved driver beats late
    if where == "external":  # what the trainer announced past its last checkpoint died with it
        announced = int(redis.Redis.from_url(redis_url).hget(Keys(run_id).trainer, "version"))
        kept = int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step-"))
        # The trainer checkpoints a step before it publishes it: a kill between the two leaves
        # the checkpoint one version ahead of the announcement, and no version is lost.
        assert announced >= kept - 1
    assert killed_at < STEPS and not (run_dir / "summary.json").exists()

    # Not a new run: the same id without --resume is refused, and says how to continue it.
    fresh = subprocess.run([*CLI, "up", "--config", str(TINY), "--run_id", run_id, "--runs_dir", str(runs_dir),
                            "--model.base_dir", str(tiny_base_model), *extra],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path, timeout=120,
                           env={k: v for k, v in os.environ.items() if k != "REDIS_URL"})
    said = fresh.stdout.decode(errors="replace")
    assert fresh.returncode != 0 and "already has data" in said and "--resume" in said, said[-2000:]

    done = _resume(tmp_path, run_id)
    out = done.stdout.decode(errors="replace")
    assert done.returncode == 0, out[-4000:]
    assert "resuming run" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == STEPS, out[-3000:]
    assert summary["driver_resumes"] == 1
    (line,) = [json.loads(x) for x in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert line["previous"] == "driver gone" and 2 <= line["committed_version"] <= killed_at
    assert line["previous_wall_s"] == pytest.approx(beat["alive_at"] - beat["started"], abs=0.1)
    assert summary["wall_seconds_total"] == pytest.approx(line["previous_wall_s"] + summary["wall_seconds"], abs=0.2)
    assert "over all its drivers" in (run_dir / "summary.md").read_text()
    acc = summary["accounting"]
    assert acc["ok"] and acc["lost"] == 0 and acc["unexpected"] == 0 and acc["trained_once"], acc
    # The trainer went on from its checkpoint (the versions never went back) to the last step.
    events = [json.loads(x) for x in (run_dir / "logs" / "trainer.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "trainer_resumed"]
    assert resumed and resumed[-1]["version"] >= 2
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS:06d}"
    if where == "external":  # the server kept running: its streams show the same
        assert summary["versions_lost_in_crashes"] == max(0, announced - kept)
        r = redis.Redis.from_url(redis_url)
        keys = Keys(run_id)
        announced = [int(f[b"version"]) for _, f in r.xrange(keys.versions)]
        assert announced == sorted(announced) and announced[-1] >= STEPS, "versions never went back"
        assert account(r, keys)["ok"]

    # A finished run is not resumed again.
    again = _resume(tmp_path, run_id)
    assert again.returncode == 2 and "finished" in again.stdout.decode(errors="replace")


@pytest.mark.one_server
def test_resume_refuses_what_it_cannot_continue_before_starting_anything(tmp_path, tiny_base_model):
    runs_dir = tmp_path / "runs"
    missing = _resume(tmp_path, "no-such-run")
    assert missing.returncode == 2 and "holds no config.toml" in missing.stdout.decode()
    nameless = subprocess.run([*CLI, "up", "--resume", "--runs_dir", str(runs_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, cwd=tmp_path, timeout=60)
    assert nameless.returncode == 2 and "run_id" in nameless.stdout.decode()

    # A run stopped by its timeout (its driver set the stop key as it stopped every stage): a field
    # of its config may not change; the watch's timeout may, and the run then goes on to its end.
    p = up(tmp_path, tiny_base_model, "--run_id", "short", "--trainer.steps", "8", "--cluster.timeout_s", "1")
    out = p.communicate(timeout=240)[0].decode(errors="replace")
    assert "timed out" in out, out[-2000:]
    first = json.loads((runs_dir / "short" / "summary.json").read_text())
    assert first["status"].startswith("timed out") and first["steps"] < 8
    changed = _resume(tmp_path, "short", "--trainer.lr", "0.5")
    said = changed.stdout.decode(errors="replace")
    assert changed.returncode == 2 and "trainer.lr" in said and "--resume continues it as it was" in said, said
    assert not (runs_dir / "short" / "resumes.jsonl").exists(), "nothing started"
    done = _resume(tmp_path, "short", "--cluster.timeout_s", "300")
    out = done.stdout.decode(errors="replace")
    assert done.returncode == 0, out[-4000:]
    summary = json.loads((runs_dir / "short" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 8 and summary["accounting"]["ok"]
    (line,) = [json.loads(x) for x in (runs_dir / "short" / "resumes.jsonl").read_text().splitlines()]
    assert line["previous"].startswith("timed out")
    assert line["previous_wall_s"] == pytest.approx(first["wall_seconds"], abs=0.1)
    assert summary["wall_seconds_total"] == pytest.approx(first["wall_seconds"] + summary["wall_seconds"], abs=0.2)


def test_a_resume_records_how_long_the_driver_before_it_ran_and_counts_each_driver_once(tmp_path):
    """pipeline.run.resume on the files a driver leaves: the summary's wall time wins over the
    heartbeat; a driver killed before its first beat is unknown (the total is then a lower bound),
    not the one before it counted again; unreadable files and lines are no crash."""
    from pipeline.run.resume import HEARTBEAT, beat, previous_status, previous_wall, record_resume, total_wall

    run = tmp_path / "run"
    run.mkdir()
    assert previous_wall(run) is None and previous_status(run) == "driver gone"
    assert beat(run, time.time() - 95.0)
    assert previous_wall(run) == pytest.approx(95.0, abs=1.0)
    (run / "summary.json").write_text(json.dumps({"status": "timed out: ...", "wall_seconds": 100.0}))
    assert previous_wall(run) == 100.0  # the summary's own figure, once the driver wrote one

    record_resume(run, committed_version=4)
    assert not (run / "summary.json").exists() and not (run / HEARTBEAT).exists()
    # This driver is killed before its first beat: the next resume knows nothing of it.
    record_resume(run, committed_version=4)
    beat(run, time.time() - 30.0)
    record_resume(run, committed_version=9)
    lines = [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()]
    assert [x["previous_wall_s"] for x in lines] == [100.0, None, pytest.approx(30.0, abs=1.0)]
    assert [x["previous"] for x in lines] == ["timed out: ...", "driver gone", "driver gone"]
    total, unknown = total_wall(run, 10.0)
    assert total == pytest.approx(140.0, abs=1.0) and unknown == 1

    with open(run / "resumes.jsonl", "a") as f:
        f.write('{"previous_wall_s": 5.0\n[1]\n{"previous_wall_s": 7.0}\n')
    total, unknown = total_wall(run, 10.0)
    assert total == pytest.approx(147.0, abs=1.0) and unknown == 3
    for bad in ("null", "[1, 2]", "{not json", '{"wall_seconds": "soon"}'):
        (run / "summary.json").write_text(bad)
        (run / HEARTBEAT).write_text(bad)
        assert previous_wall(run) is None and previous_status(run) == "driver gone"
    (run / HEARTBEAT).unlink()
    run.chmod(0o500)  # a directory the driver cannot write: the heartbeat says so, the run goes on
    try:
        assert beat(run, time.time()) is (os.geteuid() == 0)
    finally:
        run.chmod(0o700)


@pytest.mark.one_server
def test_a_bench_out_of_time_stops_its_run_cleanly_and_its_resume_finishes_it(tmp_path, tiny_base_model):
    """bench/pipeline_runs.run_up with a deadline (the benches' --hours): the driver is stopped as `pipeline
    down` stops it (SIGTERM; status interrupted, every stage down, nothing lost), DeadlineReached says so, the bench's
    unfinished_run finds the run and a resume finishes it; past the deadline no run starts, nor a fresh one the
    time left cannot hold."""
    from pipeline_runs import DeadlineReached, run_up, unfinished_run

    runs_dir = tmp_path / "runs"
    over = {"model.base_dir": tiny_base_model, "trainer.steps": 600, "trainer.checkpoint_every": 1}
    with pytest.raises(DeadlineReached, match="before this run started"):
        run_up("dl", over, runs_dir=runs_dir, config=TINY, deadline=time.time() - 1)
    # Nor a fresh run that the time left cannot hold (``needs_s``: what a finished run took).
    with pytest.raises(DeadlineReached, match="not started: 10 min left"):
        run_up("dl", over, runs_dir=runs_dir, config=TINY, deadline=time.time() + 600, needs_s=3600)
    assert not runs_dir.exists() or not any(runs_dir.iterdir())
    t0 = time.time()
    with pytest.raises(DeadlineReached, match="interrupted") as stopped:
        run_up("dl", over, runs_dir=runs_dir, config=TINY, deadline=time.time() + 20)
    run_dir = stopped.value.run_dir
    first = json.loads((run_dir / "summary.json").read_text())
    assert first["status"] == "interrupted" and first["steps"] < 600 and time.time() - t0 < 90
    assert not (runs_dir / "cluster.json").exists(), "the driver stopped what it started"
    assert unfinished_run("dl", over, runs_dir=runs_dir, config=TINY) == run_dir
    # A continuation starts even when a whole run would not fit: what it does is kept for the next resume.
    done = run_up("dl", over, runs_dir=runs_dir, config=TINY, resume=run_dir, deadline=time.time() + 600,
                  needs_s=3600)
    summary = json.loads((done / "summary.json").read_text())
    assert done == run_dir and summary["status"] == "finished" and summary["steps"] == 600
    assert summary["driver_resumes"] == 1 and summary["versions_lost_in_crashes"] == 0
    assert summary["accounting"]["ok"] and summary["accounting"]["lost"] == 0
