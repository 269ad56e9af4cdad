"""The code task and the code environment (``task.kind = "code"``, ``env.kind = "code"``), in process.

The environment runs a turn's code against the prompt's hidden tests in the code_exec
sandbox: a correct function ends the episode with reward 1; a wrong one is answered with
the failing tests and goes on; code that hangs, burns CPU or crashes ends as a failure within
the sandbox's limits. The task's held-out problems are never trained on, and no prompt shows
a test. Then `pipeline up` runs two steps of the real pipeline on it (the task, the
environment in every generator, the environment reward) with its accounting balanced.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.inert import Situation, refuse_inert
from pipeline.envs.base import EnvError, Step
from pipeline.envs.code import MAX_OBSERVATION, CodeEpisode
from pipeline.envs.registry import make_env
from pipeline.records import PromptTask
from pipeline.tasks import code as ct
from pipeline.tasks.registry import make_task
from pipeline.common.sandbox import SandboxLimits

pytestmark = pytest.mark.one_server

FAST = SandboxLimits(wall_s=3.0, cpu_s=1)
"""Tighter than the default limits, so the hanging cases end sooner."""


def _problem(family: str, k: int = 0) -> ct.Problem:
    return ct.problems_of(family)[k]


def _episode(p: ct.Problem, limits=FAST) -> CodeEpisode:
    ep = CodeEpisode(ct.encode_reference(p), limits=limits)
    assert ep.reset() == ""
    return ep


def code_task(**fields):
    return load_config(overrides={"task.kind": "code", **{f"task.{k}": v for k, v in fields.items()}}).task


# ---------------------------------------------------------------------- the environment


def test_a_correct_function_is_rewarded_1_and_ends_the_episode():
    p = _problem("clamp", 37)
    assert _episode(p).step(p.solution) == Step(observation="", reward=1.0, done=True)
    # In a fenced block after some prose, as chat models answer: the block is the code.
    fenced = f"Here it is:\n```python\n{p.solution}```\nDone."
    assert _episode(p).step(fenced) == Step(observation="", reward=1.0, done=True)
    # Every family's own solution passes its hidden tests in the sandbox (one problem each).
    for f in ct.FAMILIES:
        q = ct.problems_of(f.name)[len(ct.problems_of(f.name)) // 3]
        assert _episode(q).step(q.solution).reward == 1.0, q


def test_a_wrong_function_gets_the_failing_tests_back_and_another_turn():
    p = _problem("add_const", 6)  # x + 7
    ep = _episode(p)
    wrong = ep.step("def add_const(x):\n    return x + 6\n")
    assert not wrong.done and wrong.reward == 0.0
    assert wrong.observation.startswith("\n6 of 6 tests failed:\n")
    named = [line.split(" -> ")[0] for line in wrong.observation.splitlines() if " -> " in line]
    assert len(named) == 3 and set(named) <= set(p.tests) and "AssertionError" in wrong.observation
    assert "(and 3 more)" in wrong.observation and len(wrong.observation) <= MAX_OBSERVATION
    # Partly right: the reward is the share of tests passed; the second attempt ends it.
    half = ep.step("def add_const(x):\n    return x + 7 if x < 200 else x\n")
    failing = [t for t in p.tests if int(t.split("(")[1].split(")")[0]) >= 200]
    assert 0 < len(failing) < 6
    assert half.reward == pytest.approx((6 - len(failing)) / 6) and not half.done
    assert all(t in half.observation for t in failing[:3])
    assert ep.step(p.solution) == Step(observation="", reward=1.0, done=True) and ep.attempts == 3
    # A missing function, a syntax error (no sandbox started), an exception while defining it.
    assert "NameError" in _episode(p).step("def something_else(x):\n    return x\n").observation
    bad = _episode(p).step("def add_const(x:\n    return x")
    assert bad.observation.startswith("\nYour code does not compile: SyntaxError") and bad.reward == 0.0
    boom = _episode(p).step("raise ValueError('no')\n")
    assert "failed before any test ran: ValueError('no')" in boom.observation and not boom.done


@pytest.mark.parametrize("body, says", [
    ("import time\n    time.sleep(60)", "ran out of time"),  # hangs: the wall clock
    ("while True:\n        pass", "ran out of time"),  # burns CPU: the CPU limit, or the wall clock under load
    ("return [0] * 10 ** 10", "MemoryError"),  # the address-space limit
    ("import os\n    os._exit(3)", "exit status 3"),  # the process ends itself
])
def test_hanging_or_crashing_code_ends_as_a_failure_within_the_sandboxs_limits(body, says):
    p = _problem("times_const", 3)
    t0 = time.monotonic()
    step = _episode(p).step(f"def times_const(x):\n    {body}\n")
    took = time.monotonic() - t0
    assert step.reward == 0.0 and not step.done and step.observation
    assert says in step.observation
    assert took < FAST.wall_s + 5, f"{took:.1f} s"


def test_a_reference_without_tests_is_refused_naming_the_environment():
    with pytest.raises(EnvError, match="env.kind 'code'.*not a code task's reference"):
        CodeEpisode("357")
    cfg = load_config(overrides={"task.kind": "code", "env.kind": "code", "generator.swap": "step"})
    factory = make_env(cfg)
    task = make_task(cfg.task).heldout()[0]
    ep = factory(PromptTask(prompt_id="p1", prompt=task.prompt, prompt_ids=np.array([1], np.int32),
                            reference=task.reference, issued_at=0.0))
    assert isinstance(ep, CodeEpisode) and ep.tests == json.loads(task.reference)["tests"]


# ---------------------------------------------------------------------- the task


def test_the_heldout_split_never_overlaps_training_and_is_seeded():
    task = make_task(code_task(heldout_size=600))
    held = task.heldout()
    assert len({i.prompt for i in held}) == 600
    by_family = {}
    for i in held:
        by_family[i.source] = by_family.get(i.source, 0) + 1
    assert all(n <= len(ct.problems_of(f)) // 2 for f, n in by_family.items())  # every family is trained on too
    assert set(by_family) == {f.name for f in ct.FAMILIES}
    stream = task.training(0)
    train = [next(stream) for _ in range(4000)]
    assert not {i.prompt for i in train} & {i.prompt for i in held}
    assert not {i.reference for i in train} & {i.reference for i in held}
    # Deterministic: the same seeds give the same sets; other seeds others.
    again = make_task(code_task(heldout_size=600))
    assert [i.prompt for i in again.heldout()] == [i.prompt for i in held]
    assert [next(again.training(0)).prompt for _ in range(1)] == [train[0].prompt]
    assert [i.prompt for i in make_task(code_task(heldout_size=600, heldout_seed=7)).heldout()] != \
        [i.prompt for i in held]
    other = task.training(1)
    assert [next(other).prompt for _ in range(5)] != [i.prompt for i in train[:5]]
    # Too many held out is refused when the config loads, naming the field.
    with pytest.raises(ConfigError, match=rf"^task\.heldout_size: must be in \[1, {ct.heldout_limit()}\]"):
        code_task(heldout_size=ct.heldout_limit() + 1)


def test_no_prompt_shows_a_hidden_test_and_the_truth_runs_them():
    task = make_task(code_task(heldout_size=200))
    stream = task.training(3)
    items = task.heldout() + [next(stream) for _ in range(800)]
    for item in items:
        name, tests = ct.decode_reference(item.reference)
        assert len(tests) == ct.TESTS_PER_PROBLEM and all(t.startswith(f"assert {name}(") for t in tests)
        assert "assert" not in item.prompt and f"`{name}(" in item.prompt
        for t in tests:
            call = t[len("assert "):].split(" == ")[0]
            assert call not in item.prompt, (call, item.prompt)
    p = _problem("caesar", 2)
    ref = ct.encode_reference(p)
    right = task.correctness(ref, [p.solution, f"```python\n{p.solution}```", "def caesar(s):\n    return s\n",
                                   "def caesar(s", ""])
    assert right.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert task.answer(f"```python\n{p.solution}```") == " ".join(p.solution.split())


def test_code_fields_are_checked_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"^env\.kind: must be \"code\" only with task\.kind \"code\""):
        load_config(overrides={"env.kind": "code", "generator.swap": "step"})  # the arithmetic task
    load_config(overrides={"env.kind": "code", "task.kind": "code", "generator.swap": "step"})
    with pytest.raises(ConfigError, match=r"^task\.answer_extract = 'full'.*cannot take effect"):
        refuse_inert(load_config(overrides={"task.kind": "code", "task.answer_extract": "full"}), Situation())


def test_textarena_without_the_package_is_refused_before_launch_naming_env_kind():
    """The default install has no textarena (the `textarena` extra): the environment says so when
    its factory is built, which `pipeline up` does before it starts anything."""
    import importlib.util

    from pipeline.run.preflight import registry_problems

    if importlib.util.find_spec("textarena") is not None:
        pytest.skip("textarena is installed here (the openenv lane tests the games)")
    for kind in ("textarena", "textarena:TowerOfHanoi-v0"):
        cfg = load_config(overrides={"env.kind": kind, "generator.swap": "step"})
        with pytest.raises(EnvError, match=rf"^env\.kind '{kind}' needs textarena 0\.7\.4, the `textarena` extra"):
            make_env(cfg)
        problems = registry_problems(cfg)
        assert len(problems) == 1 and problems[0].startswith("env.kind") and \
            f"env.kind '{kind}' needs textarena 0.7.4" in problems[0], problems
    with pytest.raises(EnvError, match=r"^env\.kind 'textarena:': a TextArena game is named"):
        make_env(load_config(overrides={"env.kind": "textarena:", "generator.swap": "step"}))


# ---------------------------------------------------------------------- pipeline up


@pytest.fixture(scope="module")
def code_model(tmp_path_factory) -> Path:
    from builders import build_code_model

    return build_code_model(tmp_path_factory.mktemp("code") / "model")


@pytest.mark.slow
def test_pipeline_up_runs_the_code_task_in_the_code_environment(tmp_path, code_model, redis_url):
    from harness import up

    from pipeline.bus.connection import connect
    from pipeline.bus.stats import read_stats
    from pipeline.keys import Keys

    t0 = time.monotonic()
    p = up(tmp_path, code_model, "--run-id", "code-up", "--redis.url", redis_url, "--trainer.steps", "2",
           "--trainer.eval_every", "2",
           "--generator.swap", "step", "--task.kind", "code", "--env.kind", "code", "--env.max_turns", "2",
           "--task.heldout_size", "4", "--task.max_new_tokens", "32", "--verifier.reward", "environment",
           "--verifier.verifiers", "states_answer:full,code_exec", "--cluster.generators", "1",
           "--cluster.verifiers", "1", "--cluster.timeout_s", "300", weak_rewards=False)
    out = p.communicate(timeout=400)[0].decode()
    assert p.returncode == 0, out[-4000:]
    run = tmp_path / "runs" / "code-up"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 2
    acc = summary["accounting"]
    assert acc["ok"] and acc["adds_up"] and acc["lost"] == 0 and acc["unexpected"] == 0, acc
    assert acc["dead_lettered"] == 0, acc
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps if s["kind"] == "step"] == [1, 2]
    # The environment ran in the generator: its turns were stepped (code that rarely compiles,
    # answered with what went wrong), with no step failing.
    cfg = load_config(run / "config.toml")
    r = connect(redis_url, name="t")
    stats = read_stats(r, Keys.of(cfg.run_id, cfg.redis))
    r.close()
    assert stats["episodes_total"] >= 16 and stats.get("env_steps_total", 0) >= 1, stats
    assert stats.get("env_errors_total", 0) == 0, stats
    print(f"pipeline up, code task in the code environment: {time.monotonic() - t0:.1f} s")
