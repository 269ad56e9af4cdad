"""The code environment and a TextArena game served over OpenEnv (the openenv lane:
``bash ops/ci/openenv_lane.sh``, which installs the ``openenv`` and ``textarena`` extras).

Each app is served by the pipeline's own server pool (``env.kind = "openenv:<module>:app"``)
and driven through the pipeline's OpenEnv client (reset, step, reward, done): the code
server answers every action exactly as the in-process ``code`` environment does (the same
sandbox, feedback, rewards and done), and the TextArena server plays the same seeded game
as the in-process ``textarena`` environment. Games textarena cannot play alone offline are
refused before launch, naming env.kind. Then `pipeline up` runs two steps of the code task
on the code server.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openenv.core", reason="the openenv lane installs openenv-core: bash ops/ci/openenv_lane.sh")
pytest.importorskip("textarena", reason="the openenv lane installs textarena: bash ops/ci/openenv_lane.sh")

from pipeline.config import RunConfig, load_config  # noqa: E402
from pipeline.envs.base import EnvError, Step  # noqa: E402
from pipeline.envs.code import CodeEpisode  # noqa: E402
from pipeline.envs.registry import make_env  # noqa: E402
from pipeline.envs.textarena import DEFAULT_GAME, TextArenaEpisode, seed_of  # noqa: E402
from pipeline.envs.tools import schemas_of  # noqa: E402
from pipeline.records import PromptTask  # noqa: E402
from pipeline.tasks import code as ct  # noqa: E402

CODE = "openenv:pipeline.envs.code_server:app"
GAME = "openenv:pipeline.envs.textarena_server:app"


@pytest.fixture(autouse=True)
def no_server_left():
    """Every server pool a test started is stopped after it, its processes gone."""
    from harness import stop_live_pools

    yield
    stop_live_pools()


def _task(reference: str = "", prompt_id: str = "p0") -> PromptTask:
    return PromptTask(prompt_id=prompt_id, prompt="play", prompt_ids=np.array([3], np.int32), reference=reference,
                      issued_at=0.0)


def _served(kind: str, tmp_path: Path, **extra):
    return make_env(RunConfig().with_overrides({"generator.swap": "step", "env.kind": kind, "task.kind": "code",
                                                "runs_dir": str(tmp_path / "runs"), **extra}))


# ---------------------------------------------------------------------- the code environment's server


def test_the_code_server_answers_as_the_in_process_code_environment(tmp_path):
    served = _served(CODE, tmp_path)
    assert (served.action_field, served.observation_field) == ("code", "feedback")  # read from /schema
    clamp, add = ct.problems_of("clamp")[100], ct.problems_of("add_const")[6]
    cases = [
        (clamp, [clamp.solution]),
        (add, ["def add_const(x):\n    return x + 6\n", "def add_const(x:\n", "raise ValueError('no')\n",
               "def add_const(x):\n    return x + 7 if x < 200 else x\n", f"```python\n{add.solution}```"]),
        (clamp, ["def clamp(x):\n    while True:\n        pass\n", "def clamp(x):\n    return 0\n"]),
    ]
    seen_failures = 0
    for k, (p, actions) in enumerate(cases):
        ref = ct.encode_reference(p)
        ours, theirs = served(_task(ref, f"p{k}")), CodeEpisode(ref)
        assert ours.reset() == theirs.reset() == ""
        for a in actions:
            want = theirs.step(a)
            got = ours.step(a)
            assert (got.observation, got.reward, got.done) == (want.observation, want.reward, want.done), a
            seen_failures += not got.done
        assert got.done == (actions[-1] in (p.solution, f"```python\n{p.solution}```"))
        if got.done:
            assert got.reward == 1.0
        ours.close()
    assert seen_failures == 6
    # A reference without tests: the server's reset fails, saying why (the runner counts a failed
    # reset), and so does the episode's first step.
    bad = served(_task("357"))
    with pytest.raises(EnvError, match="not a code task's reference"):
        bad.reset()
    with pytest.raises(EnvError, match="not a code task's reference"):
        bad.step("def f(): pass")
    served.close()


# ---------------------------------------------------------------------- a TextArena game's server


def _search(ep) -> list[tuple[str, Step]]:
    """Binary search for GuessTheNumber's secret (1..20), reading the game's hints."""
    lo, hi, out = 1, 20, []
    while True:
        guess = (lo + hi) // 2
        step = ep.step(f"I guess [{guess}]")
        out.append((f"[{guess}]", step))
        if step.done:
            return out
        if "higher" in step.observation:
            lo = guess + 1
        elif "lower" in step.observation:
            hi = guess - 1


def test_a_textarena_game_served_over_openenv_plays_as_in_process(tmp_path):
    served = _served(GAME, tmp_path)
    assert (served.action_field, served.observation_field) == ("action", "message")
    secrets = set()
    for pid in ("p1", "p2", "p3"):
        ours, theirs = served(_task(prompt_id=pid)), TextArenaEpisode(DEFAULT_GAME, seed_of(pid))
        first = ours.reset()
        assert first == theirs.reset() and first.startswith("\nYou are Player 0. You are playing Guess The Number.")
        secrets.add(theirs.env.state.game_state["game_number"])
        played = _search(ours)
        assert played[-1][1].done and played[-1][1].reward == 1.0 and len(played) <= 5
        for action, step in played:  # the same game in process: the same answers, turn for turn
            assert theirs.step(action) == step
        ours.close()
    assert len(secrets) > 1, "every prompt got the same game"
    # Two invalid moves in a row end the game, unrewarded by how close a guess came (none was made).
    ours = served(_task(prompt_id="p4"))
    ours.reset()
    warned = ours.step("seven")
    assert not warned.done and warned.reward is None and "invalid move" in warned.observation
    over = ours.step("eight")
    assert over.done and over.reward == 0.0
    ours.close()
    served.close()


def test_the_textarena_environment_in_process_and_games_it_cannot_play_are_refused_before_launch(tmp_path):
    from pipeline.run.preflight import registry_problems

    games = make_env(RunConfig().with_overrides({"generator.swap": "step", "env.kind": "textarena"}))
    ep = games(_task(prompt_id="p1"))
    assert ep.reset() == TextArenaEpisode(DEFAULT_GAME, seed_of("p1")).reset()
    assert _search(ep)[-1][1] == Step(observation="", reward=1.0, done=True)
    for kind, says in (("textarena:TicTacToe-v0", "not a single-player game"),
                       ("textarena:GuessTheNumbr-v0", "has no game 'GuessTheNumbr-v0'; close ids: GuessTheNumber-v0")):
        problems = registry_problems(RunConfig().with_overrides({"generator.swap": "step", "env.kind": kind}))
        assert len(problems) == 1 and problems[0].startswith("env.kind") and f"env.kind {kind!r}" in problems[0], \
            problems
        assert says in problems[0], problems


# ---------------------------------------------------------------------- pipeline up on the code server


@pytest.fixture(scope="module")
def code_model(tmp_path_factory) -> Path:
    from builders import build_code_model

    return build_code_model(tmp_path_factory.mktemp("code") / "model")


@pytest.mark.slow
def test_pipeline_up_runs_the_code_task_on_the_code_server(tmp_path, code_model, redis_url):
    from harness import env_servers_of, up

    from pipeline.bus.connection import connect
    from pipeline.bus.stats import read_stats
    from pipeline.keys import Keys

    t0 = time.monotonic()
    p = up(tmp_path, code_model, "--run-id", "code-oe", "--redis.url", redis_url, "--trainer.steps", "2",
           "--trainer.eval_every", "2", "--generator.swap", "step", "--task.kind", "code", "--env.kind", CODE,
           "--env.max_turns", "2", "--task.heldout_size", "4", "--task.max_new_tokens", "32",
           "--verifier.reward", "environment", "--verifier.verifiers", "states_answer:full,code_exec",
           "--cluster.generators", "1", "--cluster.verifiers", "1", "--cluster.timeout_s", "300", weak_rewards=False)
    out = p.communicate(timeout=400)[0].decode()
    assert p.returncode == 0, out[-4000:]
    run = tmp_path / "runs" / "code-oe"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 2
    acc = summary["accounting"]
    assert acc["ok"] and acc["adds_up"] and acc["lost"] == 0 and acc["unexpected"] == 0, acc
    cfg = load_config(run / "config.toml")
    r = connect(redis_url, name="t")
    stats = read_stats(r, Keys.of(cfg.run_id, cfg.redis))
    r.close()
    assert stats.get("env_steps_total", 0) >= 1 and stats.get("env_errors_total", 0) == 0, stats
    logs = sorted((run / "logs").glob("env-server-*.log"))
    assert logs, "the generator started no environment server"
    assert not env_servers_of({f.name.split("-")[2] for f in logs}), "environment servers outlived their generator"
    print(f"pipeline up, code task on the code server: {time.monotonic() - t0:.1f} s")


# ---------------------------------------------------------------------- Number Hunt, from OpenEnv's template


def test_number_hunt_written_from_openenvs_template_plays_from_outside_the_repository(tmp_path):
    """examples/number_hunt (bench/game.py's game), copied outside the repository and named in
    config alone: a seed is a game, a binary search on its answers wins every game within four
    guesses, a reply without a number costs a guess, and the fourth wrong guess ends it with 0."""
    root = Path(__file__).resolve().parent.parent
    game = shutil.copytree(root / "examples" / "number_hunt", tmp_path / "outside" / "number_hunt")
    served = _served(f"openenv:{game}/server/app.py:app", tmp_path)
    assert (served.action_field, served.observation_field) == ("guess", "message")

    def search(seed: int) -> list[tuple[int, Step]]:
        ep = served(_task(prompt_id=f"p{seed}"))
        assert "whole number from 1 to 10" in ep.reset(seed=seed)
        lo, hi, played = 1, 10, []
        while not played or not played[-1][1].done:
            guess = (lo + hi) // 2
            step = ep.step(f"My guess is {guess}.")
            played.append((guess, step))
            lo, hi = (guess + 1, hi) if step.observation == "Higher." else (lo, guess - 1)
        ep.close()
        return played

    secrets = set()
    for seed in range(12):
        played = search(seed)
        assert played == search(seed)  # the same seed, the same game
        assert len(played) <= 4 and played[-1][1].reward == 1.0 and played[-1][1].observation.startswith("Right!")
        assert all(s.reward == 0.0 and not s.done for _, s in played[:-1])
        secrets.add(played[-1][0])
    assert len(secrets) > 3, "the seeds drew too few numbers"
    ep = served(_task(prompt_id="p-lose"))
    ep.reset(seed=0)
    answers = [ep.step(a) for a in ("no idea", "11", "0", "-")]
    assert answers[0].observation == "Reply with one number from 1 to 10." and not answers[0].done
    assert answers[1].observation == "Lower." and answers[2].observation == "Higher."
    assert answers[3].done and answers[3].reward == 0.0 and "No guesses left" in answers[3].observation
    ep.close()
    served.close()


# ---------------------------------------------------------------------- MCP tools of an OpenEnv environment

VAULT_APP = '''
"""A guessing game with MCP tools (OpenEnv's MCPEnvironment): probe the hidden number with the
``compare`` tool, then answer it as text."""
from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State


class VaultAction(Action):
    answer: str = ""


class VaultObservation(Observation):
    message: str = ""


class Vault(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("vault")
        self.secret, self.probes = 0, 0

        @mcp.tool
        def compare(n: int) -> str:
            """Compare n with the hidden number: higher (it is above n), lower or equal."""
            self.probes += 1
            return "equal" if n == self.secret else "higher" if self.secret > n else "lower"

        @mcp.tool
        def jammed() -> str:
            """A tool that always fails."""
            raise ValueError("the dial is jammed")

        super().__init__(mcp)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.secret, self.probes = 1 + (seed or 0) % 10, 0
        return VaultObservation(message="Find the number from 1 to 10.", done=False, reward=0.0)

    def _step_impl(self, action, timeout_s=None, **kwargs):
        right = action.answer.strip() == str(self.secret)
        return VaultObservation(message=f"{'Right' if right else 'Wrong'} after {self.probes} probes.",
                                done=True, reward=1.0 if right else 0.0)

    @property
    def state(self):
        return State(step_count=self.probes)


app = create_app(Vault, VaultAction, VaultObservation, env_name="vault", max_concurrent_envs=16)
'''


def _call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_an_openenv_environments_mcp_tools_are_shown_checked_and_run_in_the_episodes_session(tmp_path):
    """An MCPEnvironment's tools (tools/list) become the factory's schemas; a call in the
    template's format runs as tools/call in the episode's own session (the tool sees the state
    the episode's reset made) and comes back as a tool turn; malformed calls are answered and
    counted without reaching the server; a tool that raises is answered with its error; a turn
    without a call is the environment's step; and a game without MCP has no tools."""
    app = tmp_path / "outside" / "vault_app.py"
    app.parent.mkdir()
    app.write_text(VAULT_APP)
    served = _served(f"openenv:{app}:app", tmp_path, **{"env.format_reward": 0.5})
    schemas = {s["function"]["name"]: s["function"] for s in schemas_of(served)}
    assert set(schemas) == {"compare", "jammed"}
    assert schemas["compare"]["parameters"]["properties"]["n"]["type"] == "integer"
    assert "hidden number" in schemas["compare"]["description"]

    def play(seed: int) -> tuple[list[Step], int]:
        ep = served(_task(prompt_id=f"v{seed}"))
        assert ep.reset(seed=seed) == "Find the number from 1 to 10."
        lo, hi, steps = 1, 10, []
        while lo < hi:  # a binary search on the tool's answers, each a tool turn
            mid = (lo + hi) // 2
            step = ep.step(f"Let me check. {_call('compare', n=mid)}")
            assert step.tool_call and step.tool_ok and step.role == "tool" and not step.done
            (msg,) = step.messages
            assert msg["role"] == "tool" and msg["name"] == "compare" and msg["tool_call_id"]
            assert step.observation == f"<tool_response>\n{msg['content']}\n</tool_response>"
            lo, hi = (mid + 1, hi) if msg["content"] == "higher" else (lo, mid)
            steps.append(step)
        last = ep.step(str(lo))
        ep.close()
        assert last.done and last.reward == 1.0 + 0.5  # right, and every call well-formed
        assert last.observation == f"Right after {len(steps)} probes."  # the probes counted in this session
        return steps, lo

    found = {play(seed)[1] for seed in range(6)}
    assert found == {1 + s % 10 for s in range(6)}

    ep = served(_task(prompt_id="v-bad"))
    ep.reset(seed=3)
    bad = ep.step(_call("compare", n="four") + _call("open_sesame") + "<tool_call>{not json</tool_call>")
    assert bad.tool_call and bad.tool_ok is False and bad.tool_errors == 3
    assert all(m["content"].startswith("error:") for m in bad.messages)
    jammed = ep.step(_call("jammed"))
    assert jammed.tool_ok is False and jammed.tool_errors == 0 and "jammed" in jammed.messages[0]["content"]
    last = ep.step("4")
    # No probe reached the server (the malformed calls never left), the answer is right, and the
    # format reward counts 1 well-formed call of 4: 0.5 * (4 - 2 * 3) / 4.
    assert last.observation == "Right after 0 probes." and last.reward == 1.0 + 0.5 * (4 - 6) / 4
    ep.close()
    served.close()

    root = Path(__file__).resolve().parent.parent
    game = shutil.copytree(root / "examples" / "number_hunt", tmp_path / "outside" / "number_hunt")
    plain = _served(f"openenv:{game}/server/app.py:app", tmp_path)
    assert schemas_of(plain) == [] and type(plain(_task())).__name__ == "OpenEnvEpisode"
    plain.close()
