"""OpenEnv environments (``env.kind = "openenv:..."``; the openenv lane: ``bash ops/ci/openenv_lane.sh``).

An environment written from OpenEnv's own template, outside this repository, named in the
config by its file and served by the generator's own server pool, runs episodes through the
generator stage on a real Redis-compatible server exactly as the in-process environments do
(tests/test_episodes.py); the calculator's OpenEnv server answers as the in-process
calculator does, served by the pipeline or running elsewhere (a URL); a server killed in the
middle of a run fails the steps in flight (counted), loses no group, and is restarted;
schemas the adapter cannot map and apps that do not start are refused, naming env.kind; and
`pipeline up` trains for 3 steps on the calculator's server with the environment's reward.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openenv.core", reason="the openenv lane installs openenv-core: bash ops/ci/openenv_lane.sh")


from pipeline.bus.connection import connect  # noqa: E402
from pipeline.bus.stats import read_stats  # noqa: E402
from pipeline.config import RunConfig  # noqa: E402
from pipeline.envs.base import EnvError, Step  # noqa: E402
from pipeline.envs.calculator import CalculatorEpisode  # noqa: E402
from pipeline.envs.openenv import action_field, observation_field  # noqa: E402
from pipeline.envs.registry import make_env  # noqa: E402
from pipeline.keys import Keys  # noqa: E402
from pipeline.model.qwen import ModelShape, build_model, save_checkpoint  # noqa: E402
from pipeline.model.tokenizer import CharTokenizer  # noqa: E402
from pipeline.producers.feeder import run_feeder  # noqa: E402
from pipeline.producers.generator import Generator, Streamer  # noqa: E402
from pipeline.records import PromptTask, RolloutGroup  # noqa: E402
from builders import RecordingLog  # noqa: E402

TINY = ModelShape(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
CALCULATOR = "openenv:pipeline.envs.calculator_server:app"
MAX_NEW = 40


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def no_server_left():
    """Every server pool a test started is stopped after it, its processes gone."""
    from harness import stop_live_pools

    yield
    stop_live_pools()


@pytest.fixture
def tok() -> CharTokenizer:
    return CharTokenizer()


# ---------------------------------------------------------------------- an environment from OpenEnv's template


def render_template(dest: Path, name: str, edits: dict[str, list[tuple[str, str]]]) -> Path:
    """OpenEnv's environment template (``openenv/cli/templates/openenv_env`` of the installed
    package) rendered into ``dest/name`` as ``openenv init`` renders it, then ``edits`` applied
    (file -> [(old, new)], each ``old`` present exactly once). Returns the environment's directory."""
    import openenv.cli.templates as templates

    src = Path(templates.__file__).parent / "openenv_env"
    cls = "".join(w.capitalize() for w in name.split("_"))
    names = {"__ENV_CLASS_NAME__": cls, "__ENV_TITLE_NAME__": " ".join(w.capitalize() for w in name.split("_")),
             "__ENV_CAMEL_NAME__": cls[0].lower() + cls[1:], "__ENV_NAME__": name}
    root = dest / name
    for f in sorted(src.rglob("*")):
        if not f.is_file() or "__pycache__" in f.parts:
            continue
        out = root / str(f.relative_to(src)).replace("__ENV_NAME__", name)
        out.parent.mkdir(parents=True, exist_ok=True)
        text = f.read_text()
        for old in sorted(names, key=len, reverse=True):
            text = text.replace(old, names[old])
        out.write_text(text)
    for rel, changes in edits.items():
        path = root / rel
        text = path.read_text()
        for old, new in changes:
            assert text.count(old) == 1, (rel, old)
            text = text.replace(old, new)
        path.write_text(text)
    assert not any("__ENV_" in p.read_text() for p in root.rglob("*.py"))
    return root


def echo_edits(name: str) -> dict[str, list[tuple[str, str]]]:
    """The template's echo environment, made to suit the character model: a ready message it
    can encode ("0"), the last 3 characters of the action echoed, done at the third step, and
    more than one session per server."""
    title = " ".join(w.capitalize() for w in name.split("_"))
    return {
        f"server/{name}_environment.py": [
            (f'echoed_message="{title} environment ready!"', 'echoed_message="0"'),
            ("message = action.message\n", "message = action.message[-3:]\n"),
            ("            done=False,\n            reward=reward,", "            done=self._state.step_count >= 3,\n"
                                                                  "            reward=reward,"),
        ],
        "server/app.py": [("max_concurrent_envs=1,", "max_concurrent_envs=64,")],
    }


def echo_expect(action: str, turn: int) -> Step:
    """What the edited echo environment answers to the ``turn``-th action (1-based)."""
    echoed = action[-3:]
    return Step(observation=echoed, reward=len(echoed) * 0.1, done=turn >= 3)


@pytest.fixture(scope="module")
def echo_env(tmp_path_factory) -> Path:
    return render_template(tmp_path_factory.mktemp("outside"), "echo_turns", echo_edits("echo_turns"))


# ---------------------------------------------------------------------- the generator stage, real Redis


def _gen_cfg(ns: str, base: str, tmp_path: Path, **extra) -> RunConfig:
    return RunConfig().with_overrides({
        "run_id": ns, "runs_dir": str(tmp_path / "runs"), "model.base_dir": base, "generator.swap": "step",
        "generator.group_size": 3, "generator.prompts_per_batch": 2, "generator.slots": 6,
        "task.max_new_tokens": MAX_NEW, "feeder.max_prompts": 2, "redis.claim_idle_ms": 0, "redis.block_ms": 50,
        **extra})


def _random_base(tmp_path, tok, seed=11) -> str:
    out = tmp_path / "random-base"
    save_checkpoint(build_model(TINY, tok.vocab_size, seed=seed).eval(), tok, out)
    return str(out)


def _rollouts(r, keys) -> list[RolloutGroup]:
    return [RolloutGroup.decode(f[b"d"]) for key in keys.stream_keys("rollouts") for _, f in r.xrange(key)]


def _run(cfg, r, tok, *, max_batches=1, log=None) -> tuple[Streamer, Keys]:
    keys = Keys(cfg.run_id, shards=cfg.redis.shards)
    run_feeder(cfg, r, keys, RecordingLog(), tokenizer=tok, max_rounds=1)
    streamer = Streamer(Generator(cfg, r, keys, "gen-a", log or RecordingLog()))
    streamer.run(max_batches=max_batches)
    return streamer, keys


def episode(tok, ids, mask) -> tuple[list[int], list[tuple[list[int], bool, list[int]]]]:
    """A completion's first observation and its turns: (sampled ids without the eos, ended by
    an eos, the observation ids after it), in order. Turns split at sampled eos tokens, so an
    empty observation still separates two turns."""
    i, first = 0, []
    while i < len(ids) and not mask[i]:
        first.append(ids[i])
        i += 1
    turns = []
    while i < len(ids):
        turn = []
        while i < len(ids) and mask[i] and ids[i] != tok.eos_id:
            turn.append(ids[i])
            i += 1
        eos = i < len(ids) and bool(mask[i])
        i += eos
        obs = []
        while i < len(ids) and not mask[i]:
            obs.append(ids[i])
            i += 1
        turns.append((turn, eos, obs))
    return first, turns


def check_episodes(groups, tok, expect, *, first_obs: str, max_turns: int) -> int:
    """Every completion of ``groups`` is what the environment ``expect(action, turn) -> Step``
    answers, token for token; returns how many observations came back into a sequence."""
    back = 0
    for g in groups:
        assert g.loss_mask is not None and g.turns is not None and g.env_rewards is not None
        for ids, m, lp, text, turns, reward, ref in zip(g.split(g.completion_ids), g.split(g.loss_mask),
                                                        g.split(g.behaviour_logprobs), g.completions, g.turns,
                                                        g.env_rewards, [g.reference] * len(g.turns)):
            ids, m = ids.tolist(), m.astype(bool)
            assert (lp[~m] == 0).all() and (lp[m] < 0).all()
            first, ts = episode(tok, ids, m)
            assert first == tok.encode(first_obs)
            assert len(ts) == turns <= max_turns
            assert text == tok.decode(ts[-1][0])  # what the verifiers read: the last model turn
            last = None
            for k, (turn, eos, obs) in enumerate(ts):
                stepped = eos and (k + 1 < len(ts) or len(ids) < MAX_NEW)  # the sampler's budget rule
                if not stepped:
                    assert k == len(ts) - 1 and obs == []
                    continue
                want = expect(tok.decode(turn), k + 1, ref)
                last = want
                if k + 1 < len(ts):  # the answer, as its exact encoded ids, before the next turn
                    assert not want.done and obs == tok.encode(want.observation)
                    back += bool(obs)
                else:
                    assert obs == []
            rewarded = last is not None and last.reward is not None
            assert np.isnan(reward) if not rewarded else reward == pytest.approx(last.reward, abs=1e-6)
    return back


def test_an_environment_from_openenvs_template_runs_episodes_through_the_generator(redis_url, tmp_path, tok,
                                                                                     echo_env):
    assert not echo_env.is_relative_to(Path(__file__).resolve().parent.parent)  # outside this repository
    spec = f"openenv:{echo_env}/server/app.py:app"
    cfg = _gen_cfg("oe-echo", _random_base(tmp_path, tok), tmp_path, **{"env.kind": spec, "env.max_turns": 3})
    r = connect(redis_url, name="t")
    streamer, keys = _run(cfg, r, tok)
    envs = streamer.env.factory
    assert (envs.action_field, envs.observation_field) == ("message", "echoed_message")  # read from /schema
    groups = _rollouts(r, keys)
    assert len(groups) == 2
    stats = read_stats(r, keys)
    assert stats["episodes_total"] == 6 and stats["turns_total"] == sum(int(g.turns.sum()) for g in groups)
    assert stats.get("env_errors_total", 0) == 0
    back = check_episodes(groups, tok, lambda a, k, ref: echo_expect(a, k), first_obs="0", max_turns=3)
    assert back, "no observation came back into a sequence"
    assert any(t > 1 for g in groups for t in g.turns), "no episode took a second turn"
    # The servers' logs are the run's; the pool is this generator's and stops with it.
    assert list((cfg.run_dir / "logs").glob("env-server-*.log"))
    envs.close()
    assert envs.pool.closed and all(s.proc.poll() is not None for s in envs.pool.servers)
    r.close()


# ---------------------------------------------------------------------- the calculator's OpenEnv server

_ACTIONS = [("357", ["12+345=", "2+3*4 =", "12+=", " 7 * 8 =", "356"]),
            ("357", [" 357 "]),
            ("14", ["1+1=", "", "=", "99999999999999+1=", "14"]),
            ("0", ["0*5=", "0"])]


def _task(reference: str, k: int = 0) -> PromptTask:
    return PromptTask(prompt_id=f"p{k}", prompt=" 1+1=", prompt_ids=np.array([3], np.int32), reference=reference,
                      issued_at=0.0)


def _same_as_in_process(factory) -> None:
    for k, (ref, actions) in enumerate(_ACTIONS):
        ours, theirs = factory(_task(ref, k)), CalculatorEpisode(ref)
        assert ours.reset() == theirs.reset() == ""
        for a in actions:
            want = theirs.step(a)
            assert ours.step(a) == want, (ref, a)
            if want.done:
                break
        ours.close()


def test_the_calculator_server_answers_as_the_in_process_calculator(tmp_path):
    cfg = RunConfig().with_overrides({"generator.swap": "step", "env.kind": CALCULATOR,
                                      "runs_dir": str(tmp_path / "runs"), "env.servers": 2})
    served = make_env(cfg)  # the pipeline serves the app itself: two servers, sessions spread over both
    assert len(served.pool.urls()) == 2
    _same_as_in_process(served)
    eps = [served(_task("2", k)) for k in range(6)]
    for ep in eps:
        ep.reset()
    assert {ep.url for ep in eps} == set(served.pool.urls())
    for ep in eps:
        ep.close()
    # The same app running elsewhere, named by its URL: the generator only connects.
    url = served.pool.urls()[0]
    remote = make_env(RunConfig().with_overrides({"generator.swap": "step", "env.kind": f"openenv:{url}"}))
    assert remote.pool is None and (remote.action_field, remote.observation_field) == ("text", "result")
    _same_as_in_process(remote)
    remote.close()
    served.close()


def test_the_generator_runs_calculator_episodes_on_its_openenv_server(redis_url, tmp_path, tok):
    cfg = _gen_cfg("oe-calc", _random_base(tmp_path, tok), tmp_path, **{"env.kind": CALCULATOR, "env.max_turns": 3})
    r = connect(redis_url, name="t")
    _, keys = _run(cfg, r, tok)
    groups = _rollouts(r, keys)
    assert len(groups) == 2
    stats = read_stats(r, keys)
    assert stats["episodes_total"] == 6 and stats.get("env_errors_total", 0) == 0

    def expect(action, turn, reference):  # the in-process calculator, replayed on the same actions
        ep = CalculatorEpisode(reference)
        return ep.step(action)

    check_episodes(groups, tok, expect, first_obs="", max_turns=3)
    r.close()


# ---------------------------------------------------------------------- a server killed mid-run


def fragile_edits(name: str) -> dict[str, list[tuple[str, str]]]:
    """The echo edits, and the first step any server of the run answers kills that server
    (SIGKILL, as the OOM killer would); the marker file keeps a restarted one alive."""
    edits = echo_edits(name)
    edits[f"server/{name}_environment.py"].append((
        "        self._state.step_count += 1\n",
        "        self._state.step_count += 1\n"
        "        import os, signal\n"
        "        marker = os.environ['RLPIPE_TEST_KILL_MARKER']\n"
        "        if not os.path.exists(marker):\n"
        "            open(marker, 'w').close()\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"))
    return edits


def test_a_server_killed_mid_run_fails_its_steps_loses_nothing_and_is_restarted(redis_url, tmp_path, tok,
                                                                                 monkeypatch):
    env_dir = render_template(tmp_path / "outside", "fragile_echo", fragile_edits("fragile_echo"))
    marker = tmp_path / "killed"
    monkeypatch.setenv("RLPIPE_TEST_KILL_MARKER", str(marker))
    cfg = _gen_cfg("oe-kill", _random_base(tmp_path, tok, seed=13), tmp_path,
                   **{"env.kind": f"openenv:{env_dir}/server/app.py:app", "env.max_turns": 3, "env.on_error": "end",
                      "feeder.max_prompts": 4, "env.start_timeout_s": 60,
                      # One prompt per read, two groups in flight: the first two meet the kill, the
                      # last two start on the restarted server.
                      "generator.prompts_per_batch": 1, "env.max_in_flight": 6})
    r = connect(redis_url, name="t")
    log = RecordingLog()
    streamer, keys = _run(cfg, r, tok, max_batches=4, log=log)
    pool = streamer.env.factory.pool
    assert marker.exists(), "the server was never killed"
    groups = _rollouts(r, keys)
    assert len(groups) == 4, "a killed server lost a group"
    stats = read_stats(r, keys)
    assert stats["episodes_total"] == 12
    assert stats["env_errors_total"] >= 1
    failed = [kw for e, kw in log.events if e == "env_step_failed"]
    assert failed and all("was lost" in kw["error"] for kw in failed), failed
    # The pool restarted the server; episodes after the restart ran on it and were rewarded.
    deadline = time.monotonic() + 60
    while pool.restarts < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pool.restarts == 1 and pool.servers[0].starts == 2
    assert not pool.urls()  # and the generator's close tore its servers down
    server_log = pool.servers[0].log_path.read_text()
    assert server_log.count("== start") == 2  # started, then restarted: both in the server's one log
    rewards = np.concatenate([g.env_rewards for g in groups])
    assert np.isnan(rewards).any() and (~np.isnan(rewards)).any()
    r.close()


# ---------------------------------------------------------------------- refused, naming env.kind


def _schema(title, **fields):
    props = {"metadata": {"type": "object"}}
    props.update({k: {"type": v} if isinstance(v, str) else v for k, v in fields.items()})
    return {"title": title, "properties": props, "required": [k for k in fields if k.startswith("need_")]}


def test_the_action_and_observation_fields_come_from_the_schema_or_are_refused():
    kind = "openenv:x:app"
    assert action_field(_schema("A", message="string"), kind) == "message"
    assert action_field(_schema("A", message={"anyOf": [{"type": "string"}, {"type": "null"}]}, n="integer"),
                        kind) == "message"
    for bad, why in ((_schema("A", a="string", b="string"), "exactly one string field"),
                     (_schema("A", n="integer"), "exactly one string field"),
                     (_schema("A", message="string", need_n="integer"), "also requires need_n")):
        with pytest.raises(EnvError, match=why) as e:
            action_field(bad, kind)
        assert kind in str(e.value)
    obs = _schema("O", done="boolean", reward="number", text="string", length="integer")
    assert observation_field(obs, "", kind) == "text"
    two = _schema("O", prompt="string", feedback="string")
    with pytest.raises(EnvError, match="env.observation_field"):
        observation_field(two, "", kind)
    assert observation_field(two, "feedback", kind) == "feedback"
    with pytest.raises(EnvError, match="no such field"):
        observation_field(two, "answer", kind)


def test_an_app_that_does_not_start_is_refused_naming_env_kind_before_launch(tmp_path):
    from pipeline.run.preflight import registry_problems

    broken = tmp_path / "broken_app.py"
    broken.write_text("raise RuntimeError('this environment cannot start')\n")
    kind = f"openenv:{broken}:app"
    cfg = RunConfig().with_overrides({"generator.swap": "step", "env.kind": kind, "runs_dir": str(tmp_path / "runs"),
                                      "env.start_timeout_s": 60})
    with pytest.raises(EnvError) as e:
        make_env(cfg)
    assert kind in str(e.value) and "exited with status" in str(e.value) and "cannot start" in str(e.value)
    problems = registry_problems(cfg)  # the driver builds the factory as every generator does
    assert len(problems) == 1 and problems[0].startswith("env.kind") and "cannot start" in problems[0]
    nothing = RunConfig().with_overrides({"generator.swap": "step", "env.kind": "openenv:http://127.0.0.1:9"})
    with pytest.raises(EnvError, match=r"openenv:http://127\.0\.0\.1:9.*schema"):
        make_env(nothing)


# ---------------------------------------------------------------------- pipeline up


@pytest.mark.slow
def test_pipeline_up_trains_on_the_calculators_openenv_server(tmp_path, tiny_base_model):
    from harness import env_servers_of, up

    p = up(tmp_path, tiny_base_model, "--run-id", "oe-up", "--trainer.steps", "3", "--trainer.eval_every", "3",
           "--generator.swap", "step", "--env.kind", CALCULATOR, "--verifier.reward", "environment",
           "--cluster.timeout_s", "400", weak_rewards=False)
    out = p.communicate(timeout=600)[0].decode()
    assert p.returncode == 0, out[-4000:]
    run = tmp_path / "runs" / "oe-up"
    summary = json.loads((run / "summary.json").read_text())
    acc = summary["accounting"]
    assert acc["ok"] and acc["lost"] == 0 and acc["unexpected"] == 0, acc
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps if s["kind"] == "step"] == [1, 2, 3]
    # Every generator served the app itself, and stopped its servers when it stopped.
    logs = sorted((run / "logs").glob("env-server-*.log"))
    assert logs, "no generator started an environment server"
    started = [json.loads(line) for f in (run / "logs").glob("gen-*.jsonl") for line in f.read_text().splitlines()]
    assert any(e["event"] == "env_server_started" for e in started)
    parents = {f.name.split("-")[2] for f in logs}
    left = env_servers_of(parents)
    assert not left, f"environment servers outlived their generators: {left}"
