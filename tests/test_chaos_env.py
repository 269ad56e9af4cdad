"""Chaos kind ``env``: the environment servers a generator's pool started, SIGKILLed from outside.

The generators serve the calculator's OpenEnv app themselves (``env.kind =
"openenv:pipeline.envs.calculator_server:app"``, one server process each); the injector,
from its own process, SIGKILLs those servers four times in the middle of training
(``chaos.schedule`` entries ``env:gen-N``), finding them through the pools' records in the
run directory. Each generator's pool starts its server again, the episodes that had a
session on it fail their steps, and the total-queue check still finds every prompt once:
lost = duplicated = unexpected = 0. The injector's view of a pool (a real one) never names
a dead server, a stopped generator's, or one from a record older than the server. Those
need openenv-core (the openenv lane: ``bash ops/ci/openenv_lane.sh``) and skip without it;
the config and schedule checks run everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from harness import env_servers_of, up

from pipeline.config import ConfigError, load_config
from pipeline.envs.servers import RECORD_DIR, read_records
from pipeline.run.chaos import Fault, Injector, Plan, by_kind
from pipeline.run.preflight import chaos_problems
from pipeline.common.procs import proc_start_time

CALCULATOR = "openenv:pipeline.envs.calculator_server:app"
SCHEDULE = ["env:gen-0", "env:gen-1", "env:gen-0", "env:gen-1"]
STEPS = 150


def needs_openenv() -> None:
    pytest.importorskip("openenv.core", reason="the openenv lane installs openenv-core: bash ops/ci/openenv_lane.sh")


# ---------------------------------------------------------------------- the kind in the config and the plan


def test_env_is_a_chaos_kind_and_a_schedule_entry_of_a_generator_only():
    assert "env" in load_config(overrides={"chaos.kinds": "kill,env"}).chaos.kinds
    assert load_config(overrides={"chaos.schedule": "env:gen-1,gen-0"}).chaos.schedule == ("env:gen-1", "gen-0")
    with pytest.raises(ConfigError, match=r"chaos\.kinds: must be .*env"):
        load_config(overrides={"chaos.kinds": "kill,envs"})
    for bad in ("env:ver-0", "env:trainer", "env"):
        with pytest.raises(ConfigError, match=r"chaos\.schedule: must be .*env:gen-N"):
            load_config(overrides={"chaos.schedule": bad})


def test_env_faults_are_refused_before_launch_without_servers_the_generators_start():
    def problems(**overrides):
        return [x for x in chaos_problems(load_config(overrides={"generator.swap": "step", **overrides}))
                if "env faults" in x]

    assert problems(**{"env.kind": CALCULATOR, "chaos.kinds": "env"}) == []
    assert problems(**{"env.kind": CALCULATOR, "chaos.schedule": "env:gen-1"}) == []
    for kind in ("", "calculator", "openenv:http://127.0.0.1:8000"):
        for field, value in (("chaos.kinds", "kill,env"), ("chaos.schedule", "gen-0,env:gen-0")):
            got = problems(**{"env.kind": kind, field: value})
            assert len(got) == 1 and got[0].startswith(f"{field}: ") and repr(kind) in got[0], (kind, got)
    assert problems(**{"env.kind": "", "chaos.kinds": "env", "chaos.schedule": "gen-0"}) == []  # the schedule rules


def test_a_random_env_fault_picks_a_generator_with_a_server_up_or_none():
    cfg = load_config(overrides={"chaos.kinds": "env", "chaos.seed": "3"}).chaos
    plan, again = Plan(cfg, 10), Plan(cfg, 10)
    workers = ["trainer", "feeder", "gen-0", "gen-1", "ver-0"]
    picks = [plan.pick(workers, 0.0, ["gen-0", "gen-1"]) for _ in range(20)]
    assert {p[0] for p in picks} == {"env"} and {p[1] for p in picks} == {"gen-0", "gen-1"}
    assert picks == [again.pick(workers, 0.0, ["gen-1", "gen-0"]) for _ in range(20)], "the seed fixes the picks"
    assert plan.pick(workers, 0.0, []) is None, "no server up: no fault"
    assert by_kind([Fault(1.0, "env", "gen-0"), Fault(2.0, "env", "gen-1"), Fault(3.0, "kill", "gen-0")]) == {
        "kill env server": 2, "kill generator": 1}


# ---------------------------------------------------------------------- the injector and a real pool


def test_the_injector_kills_only_a_live_server_of_the_recorded_generator(tmp_path):
    needs_openenv()
    from pipeline.envs.servers import ServerPool

    run_dir = tmp_path / "runs" / "r"
    # The record a SIGKILLed generator left behind: its process is gone, so the next pool removes it.
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run_dir / RECORD_DIR).mkdir(parents=True)
    (run_dir / RECORD_DIR / f"{dead.pid}-0.json").write_text(json.dumps(
        {"pid": dead.pid, "start_times": {str(dead.pid): 1}, "servers": [{"index": 0, "pid": dead.pid, "up": True}]}))
    pool = ServerPool(CALCULATOR[len("openenv:"):], n=2, name=CALCULATOR, log_dir=run_dir / "logs",
                      record_dir=run_dir / RECORD_DIR)
    try:
        (rec,) = read_records(run_dir)
        assert rec["pid"] == os.getpid() and [s["pid"] for s in rec["servers"]] == pool.pids()
        assert all(s["up"] for s in rec["servers"]) and rec["start_times"][str(pool.pids()[0])] == \
            proc_start_time(pool.pids()[0])
        inj = Injector(load_config(overrides={"runs_dir": str(tmp_path / "runs"), "chaos.kinds": "env"}))
        me = os.getpid()
        inj.info = {"run_dir": str(run_dir), "workers": {"gen-0": me, "trainer": 1},
                    "start_times": {str(me): proc_start_time(me)}}
        inj.plan = Plan(inj.cfg.chaos, 10)
        before = inj.env_servers()
        assert sorted(before) == ["gen-0"] and len(before["gen-0"]) == 2
        # Not a generator of the run (the driver's own check), or one that is paused: nothing to hit.
        inj.info["workers"] = {"trainer": me}
        assert inj.env_servers() == {}
        inj.info["workers"] = {"gen-0": me}
        inj.paused[me] = ("gen-0", time.time() + 60)
        assert inj.env_servers() == {} and inj.inject("env", "gen-0", 3) is None
        inj.paused.clear()

        fault = inj.inject("env", "gen-0", 3, before)
        assert fault is not None and fault.kind == "env" and fault.pid in pool.pids() and fault.version == 3
        assert "SIGKILL of environment server" in fault.detail and f"pid {fault.pid}" in fault.detail
        index = pool.pids().index(fault.pid)
        # Dead (even before its pool has noticed and rewritten the record): no target any more.
        deadline = time.monotonic() + 5
        while fault.pid in targets(inj) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fault.pid not in targets(inj) and targets(inj), "the other server is still a target"
        deadline = time.monotonic() + 60
        while pool.restarts < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.restarts == 1 and pool.servers[index].starts == 2
        (rec,) = read_records(run_dir)
        assert rec["restarts"] == 1 and rec["servers"][index]["pid"] == pool.pids()[index] != fault.pid
        assert targets(inj) == set(pool.pids()), "the restarted server is a target, under its own pid"
        # A record read before the restart names the old pid: it is never signalled again.
        stale = {"gen-0": [(r, s) for r, s in before["gen-0"] if s["pid"] == fault.pid]}
        assert inj.inject("env", "gen-0", 4, stale) is None
        assert all(s.proc.poll() is None for s in pool.servers)
    finally:
        pool.close()
    assert read_records(run_dir) == [], "a closed pool's record is removed"


def targets(inj: Injector) -> set[int]:
    return {srv["pid"] for servers in inj.env_servers().values() for _, srv in servers}


# ---------------------------------------------------------------------- pipeline chaos


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_environment_servers_killed_mid_run_lose_and_repeat_nothing(tmp_path, tiny_base_model):
    needs_openenv()
    p = up(tmp_path, tiny_base_model, "--run-id", "chaos-env", "--trainer.steps", str(STEPS),
           "--trainer.eval_every", str(STEPS), "--generator.swap", "step", "--env.kind", CALCULATOR,
           "--env.max_turns", "2", "--verifier.reward", "environment", "--chaos.schedule", ",".join(SCHEDULE),
           "--redis.claim_idle_ms", "1500", "--cluster.timeout_s", "400", command="chaos", weak_rewards=False)
    out = p.communicate(timeout=600)[0].decode()
    assert p.returncode == 0, out[-4000:]
    run = tmp_path / "runs" / "chaos-env"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished", summary["status"]

    # Every scheduled fault was a SIGKILL of a live environment server of the named generator.
    chaos = summary["chaos"]
    faults = chaos["events"]
    assert [(f["kind"], f["target"]) for f in faults] == [tuple(x.split(":")) for x in SCHEDULE], faults
    assert chaos["by_kind"] == {"kill env server": len(SCHEDULE)}
    assert all(0 < f["version"] < STEPS for f in faults), "the faults landed mid-training"
    assert "inject: env gen-0: SIGKILL of environment server 0" in (run / "logs" / "inject.out").read_text()
    # Only environment servers died: the driver restarted no worker, and no Redis server.
    assert summary["restarts"] == 0 and summary["server_restarts"] == 0, summary

    # Each generator's pool saw its killed server exit by SIGKILL and started it again; the
    # second kill of a generator hit the restarted server (a new pid), not its predecessor's.
    killed: dict[str, list[int]] = {}
    for f in faults:
        killed.setdefault(f["target"], []).append(f["pid"])
    for gen, pids in killed.items():
        events = _events(run / "logs" / f"{gen}.jsonl")
        exited = [e for e in events if e["event"] == "env_server_exited"]
        restarted = [e for e in events if e["event"] == "env_server_restarted"]
        assert [e["pid"] for e in exited if e["status"] == -9] == pids, (gen, exited)
        assert len(set(pids)) == len(pids)
        assert restarted and restarted[0]["pid"] == pids[1], (gen, restarted)
        assert len(restarted) >= len(pids) - 1
    # A generator's pool records its servers while it runs, and removes its record when it stops.
    assert not list((run / RECORD_DIR).glob("*.json"))

    # The total-queue check: every prompt once.
    v = chaos["verdict"]
    assert v["ok"] and v["finished"], v
    assert v["lost"] == 0 and v["duplicated"] == 0 and v["unexpected"] == 0, v
    assert v["trained"] + v["nosignal"] + v["dropped_stale"] == STEPS * 4, "every step's groups were committed once"
    assert "faults survived" in out and "PASS" in out

    # No environment server outlived its generator.
    parents = {f.name.split("-")[2] for f in (run / "logs").glob("env-server-*.log")}
    assert parents
    left = env_servers_of(parents)
    assert not left, f"environment servers outlived their generators: {left}"
