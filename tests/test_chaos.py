"""`pipeline chaos`, short: one SIGKILL of a generator, the trainer and the Redis server, and
one SIGSTOP of a verifier, mid-run, all from the injector process beside the driver, with a CPU
burner beside the run (``chaos.load``); then the total-queue check (lost = duplicated =
unexpected = 0) and the trainer's resume time. `make chaos` is the long one."""

from __future__ import annotations

import json

import pytest
from harness import up as _up

pytestmark = pytest.mark.slow


def test_kills_a_pause_and_a_redis_restart_from_outside_lose_and_repeat_nothing(tmp_path, tiny_base_model):
    p = _up(tmp_path, tiny_base_model, "--run-id", "chaos", "--trainer.steps", "24",
            "--chaos.schedule", "gen-0,trainer,redis,pause:ver-1", "--chaos.pause_s", "3",
            "--redis.claim_idle_ms", "1500", "--trainer.eval_every", "8", "--chaos.load", "1", command="chaos")
    out = p.communicate(timeout=600)[0].decode()
    assert p.returncode == 0, out[-4000:]
    summary = json.loads((tmp_path / "runs" / "chaos" / "summary.json").read_text())
    chaos = summary["chaos"]
    assert [(e["kind"], e["target"]) for e in chaos["events"]] == [
        ("kill", "gen-0"), ("kill", "trainer"), ("redis", "redis"), ("pause", "ver-1")], chaos
    assert summary["server_restarts"] == 1, "the driver started its killed server again, unasked"
    assert summary["restarts"] >= 2, "the killed workers came back through the restart policy"
    inject = (tmp_path / "runs" / "chaos" / "logs" / "inject.out").read_text()
    assert "inject: redis" in inject and "1 CPU burner(s) beside the run" in inject, inject
    (resumed,) = summary["trainer_resume_seconds"]  # the one SIGKILL of the trainer: death -> next committed step
    assert 0 < resumed < 300, resumed
    v = chaos["verdict"]
    assert v["ok"] and v["finished"], v
    assert v["lost"] == 0 and v["duplicated"] == 0 and v["unexpected"] == 0
    assert v["trained"] + v["nosignal"] + v["dropped_stale"] == 24 * 4, "every step's groups were committed once"
    assert "faults survived" in out and "PASS" in out
    events = [json.loads(x)["event"] for x in (tmp_path / "runs" / "chaos" / "logs" / "trainer.jsonl")
              .read_text().splitlines()]
    assert events.count("trainer_started") == 2 and "trainer_resumed" in events, (events, out[-3000:])
