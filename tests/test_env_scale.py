"""Several environments in one run, several servers behind one kind, and returns over turns.

- ``env.kind = "mix:<kind>=<weight>,..."``: each prompt's group is routed to one member by a
  hash of the run seed and its prompt id (the same for every completion of a group and in every
  replay, the shares following the weights), validated member by member before launch, counted
  per member; a real ``pipeline up`` with two in-process environments balances its accounting
  and counts both;
- ``openenv:http://a:1,http://b:2``: sessions spread over two real OpenEnv servers, one
  stopped: its session's error names its URL and new sessions go to the other (the openenv
  lane: ``bash ops/ci/openenv_lane.sh``);
- ``env.returns``: ``sum`` and ``discounted`` over a scripted environment's per-turn rewards,
  ``last`` the last reward given, as before.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import ConfigError, RunConfig
from pipeline.envs.base import EnvError, EpisodeRunner, Step, env_members, episode_return, route_index
from pipeline.envs.registry import EnvMixture, make_env
from pipeline.model.tokenizer import CharTokenizer
from pipeline.records import PromptTask
try:
    from builders import RecordingLog
except ImportError:  # this file imported by path as an env.kind plugin (pipeline up), outside pytest
    RecordingLog = None

HERE = Path(__file__).resolve()
SCRIPT = (1.0, None, 0.5, 2.0)
"""The scripted environment's reward per model turn (None: that turn gives none); done after the last."""


pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.one_server]


def _task(pid: str) -> PromptTask:
    return PromptTask(prompt_id=pid, prompt="1+2=", prompt_ids=np.array([1, 2, 3], dtype=np.int32), reference="3",
                      issued_at=0.0)


def _cfg(**overrides) -> RunConfig:
    return RunConfig().with_overrides({"generator.swap": "step", **overrides})


class ScriptedEpisode:
    """Gives the rewards of :data:`SCRIPT`, one per model turn; observations the tiny tokenizer encodes."""

    def __init__(self):
        self.turn = 0

    def reset(self, seed=None):
        return ""

    def step(self, action: str) -> Step:
        reward = SCRIPT[self.turn]
        self.turn += 1
        return Step(observation="1", reward=reward, done=self.turn >= len(SCRIPT))

    def close(self):
        pass


def scripted(cfg):
    """An in-process environment (``path/to/test_env_scale.py:scripted``)."""
    return lambda task: ScriptedEpisode()


# ---------------------------------------------------------------------- several environments in one run


def test_routing_is_a_deterministic_hash_of_seed_and_prompt_whose_shares_follow_the_weights():
    ids = [f"p{k}" for k in range(20000)]
    picks = [route_index(7, pid, [3.0, 1.0]) for pid in ids]
    assert picks == [route_index(7, pid, [3.0, 1.0]) for pid in ids], "routing is not a function of its inputs"
    share = picks.count(0) / len(picks)
    assert abs(share - 0.75) < 0.015, share
    thirds = [route_index(7, pid, [1.0, 1.0, 1.0]) for pid in ids]
    assert all(abs(thirds.count(i) / len(ids) - 1 / 3) < 0.015 for i in range(3))
    # another run seed routes the same prompts differently, in the same shares
    other = [route_index(8, pid, [3.0, 1.0]) for pid in ids]
    assert other != picks and abs(other.count(0) / len(ids) - 0.75) < 0.015


def test_a_mixture_is_validated_member_by_member_naming_the_field():
    cfg = _cfg(**{"env.kind": f"mix:calculator=3,{HERE}:scripted=1"})
    assert cfg.env.kind.startswith("mix:")
    for bad, says in (("mix:calculator=3", "two or more"),
                      ("mix:calculator=1,calculator=2", "named twice"),
                      ("mix:calculator=0,code=1", "not a positive number"),
                      ("mix:calculator=1,nope=1", "mixture members"),
                      ("mix:calculator=1,code=1", 'only with task.kind "code"'),
                      ("mix:calculator=1,openenv:ftp://x=1", "openenv:http://host:port"),
                      ("mix:calculator=1,textarena", "does not end with =<weight>")):
        with pytest.raises(ConfigError, match="^env.kind: ") as e:
            _cfg(**{"env.kind": bad})
        assert says in str(e.value), (bad, str(e.value))


def test_every_completion_of_a_group_plays_its_prompts_environment_and_each_is_counted():
    tok = CharTokenizer()
    cfg = _cfg(**{"env.kind": f"mix:calculator=1,{HERE}:scripted=1", "feeder.seed": 3})
    mix = make_env(cfg)
    assert isinstance(mix, EnvMixture) and mix.kinds == ["calculator", f"{HERE}:scripted"]
    runner = EpisodeRunner(mix, cfg.env, tok, RecordingLog(), run_seed=cfg.feeder.seed)
    seen = {}
    for k in range(40):
        task = _task(f"p{k}")
        runner.start(k, task, 4)
        kinds = {type(runner.episodes[(k, j)]).__name__ for j in range(4)}
        assert len(kinds) == 1, kinds  # one environment per group
        seen[mix.route(task)] = seen.get(mix.route(task), 0) + 1
        # the calculator is a ToolEnv: its episodes are ToolEpisodes
        assert kinds == {"ScriptedEpisode" if mix.route(task).endswith(":scripted") else "ToolEpisode"}
        # the same prompt, replayed: the same environment
        assert mix.route(task) == EnvMixture(cfg).route(_task(f"p{k}"))
        for j in range(4):
            runner.submit(k, j, "3")
        answered = 0
        while answered < 4:
            answered += len(runner.collect(block_s=1.0))
        runner.finish(k, 4)
    assert set(seen) == set(mix.kinds) and sum(seen.values()) == 40
    members = env_members(runner.take_counters())
    for kind, groups in seen.items():
        m = members[kind]
        assert m["episodes"] == m["finished"] == 4 * groups and m["errors"] == 0, (kind, m)
    # the scripted member gives 1.0 on the first turn (returns "last"); the calculator 1 for "3" on "1+2="
    assert members[f"{HERE}:scripted"]["reward"] == 4 * seen[f"{HERE}:scripted"]
    runner.close()


def test_pipeline_up_runs_two_environments_in_one_run_and_counts_each(tmp_path, tiny_base_model, redis_url):
    from harness import up

    from pipeline.bus.connection import connect
    from pipeline.bus.stats import read_stats
    from pipeline.config import load_config
    from pipeline.keys import Keys

    mix = f"mix:calculator=1,{HERE}:scripted=1"
    p = up(tmp_path, tiny_base_model, "--run-id", "mix-up", "--redis.url", redis_url, "--trainer.steps", "2",
           "--trainer.eval_every", "2", "--generator.swap", "step", "--env.kind", mix, "--env.max_turns", "3",
           "--task.max_new_tokens", "24", "--verifier.reward", "environment", "--cluster.generators", "1",
           "--cluster.timeout_s", "300", weak_rewards=False)
    out = p.communicate(timeout=400)[0].decode()
    assert p.returncode == 0, out[-4000:]
    run = tmp_path / "runs" / "mix-up"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 2, summary["status"]
    acc = summary["accounting"]
    assert acc["ok"] and acc["adds_up"] and acc["lost"] == 0 and acc["unexpected"] == 0, acc
    cfg = load_config(run / "config.toml")
    r = connect(redis_url, name="t")
    stats = read_stats(r, Keys.of(cfg.run_id, cfg.redis))
    r.close()
    members = env_members(stats)
    assert set(members) == {"calculator", f"{HERE}:scripted"}, stats
    for kind, m in members.items():
        assert m["episodes"] > 0 and m["finished"] > 0 and m["errors"] == 0, (kind, m)
    assert sum(m["episodes"] for m in members.values()) == stats["episodes_total"]
    assert summary["episodes"]["environments"].keys() == members.keys()


# ---------------------------------------------------------------------- returns over turns


def _play(returns: str, discount: float = 1.0, n: int = 3) -> tuple[list[float], list]:
    tok = CharTokenizer()
    env = _cfg(**{"env.kind": f"{HERE}:scripted", "env.returns": returns, "env.discount": discount}).env
    runner = EpisodeRunner(lambda task: ScriptedEpisode(), env, tok, RecordingLog())
    runner.start("g", _task("p0"), n)
    live = set(range(n))
    while live:
        for j in live:
            runner.submit("g", j, "1")
        got = []
        while len(got) < len(live):
            got += runner.collect(block_s=1.0)
        live = {j for _, j, _, done in got if not done}
    per_turn = runner.turn_rewards("g", n)
    rewards = runner.finish("g", n)
    runner.close()
    return rewards, per_turn


def test_returns_over_a_scripted_environments_per_turn_rewards():
    rewards, per_turn = _play("last")
    assert per_turn == [[(0, 1.0), (2, 0.5), (3, 2.0)]] * 3  # the turn with no reward is not there
    assert rewards == [2.0] * 3  # the last reward given, as before
    assert _play("sum")[0] == [3.5] * 3
    gamma = 0.5
    want = 1.0 + gamma ** 2 * 0.5 + gamma ** 3 * 2.0
    assert _play("discounted", gamma)[0] == pytest.approx([want] * 3)
    assert _play("discounted", 1.0)[0] == [3.5] * 3
    assert math.isnan(episode_return([], "sum")) and episode_return([(0, -1.0), (1, 2.0)], "last") == 2.0
    with pytest.raises(ConfigError, match=r"env.discount"):
        _cfg(**{"env.discount": 0.0})
    with pytest.raises(ConfigError, match=r"env.returns"):
        _cfg(**{"env.returns": "mean"})


# ---------------------------------------------------------------------- several servers behind one kind


def test_sessions_spread_over_two_servers_and_a_stopped_one_is_skipped_naming_its_url(tmp_path):
    pytest.importorskip("openenv.core", reason="the openenv lane installs openenv-core: bash ops/ci/openenv_lane.sh")
    from pipeline.envs.servers import ServerPool

    app = "pipeline.envs.calculator_server:app"
    a = ServerPool(app, n=1, name="a", log_dir=tmp_path / "a")
    b = ServerPool(app, n=1, name="b", log_dir=tmp_path / "b")
    try:
        url_a, url_b = a.urls()[0], b.urls()[0]
        envs = make_env(_cfg(**{"env.kind": f"openenv:{url_a},{url_b}", "env.step_timeout_s": 5}))
        assert envs.pool is None and envs.remote == [url_a, url_b]
        eps = [envs(_task(f"p{k}")) for k in range(6)]
        for ep in eps:
            assert ep.reset() == ""
        assert {ep.url for ep in eps} == {url_a, url_b}  # the fewest in flight: both get sessions
        assert [envs.health[u].in_flight for u in (url_a, url_b)] == [3, 3]
        assert all(ep.step("1+2=").observation == "3" for ep in eps)
        a.close()  # server a stops: its sessions are lost, naming its URL
        lost = [ep for ep in eps if ep.url == url_a]
        for ep in lost:
            with pytest.raises(EnvError, match=f"session on {url_a} was lost"):
                ep.step("2+2=")
        assert envs.health[url_a].down_until > time.monotonic()
        # new sessions go to b while a is down
        more = [envs(_task(f"q{k}")) for k in range(4)]
        for ep in more:
            ep.reset()
        assert {ep.url for ep in more} == {url_b}
        for ep in eps + more:
            ep.close()
        assert envs.health[url_b].in_flight == 0
        # both gone: the reset's error names each URL
        b.close()
        time.sleep(0.2)
        with pytest.raises(EnvError, match=f"cannot open a session.*{url_a}.*{url_b}|"
                                           f"cannot open a session.*{url_b}.*{url_a}"):
            envs(_task("z")).reset()
        envs.close()
    finally:
        a.close()
        b.close()


def test_the_exporter_serves_each_members_counters_labelled_by_its_kind():
    from pipeline.observe.metrics import episode_families, episode_summary

    stats = {"episodes_total": 12.0, "episodes_finished_total": 12.0, "env_errors_total": 1.0,
             "env_episodes_total:calculator": 8.0, "env_finished_total:calculator": 8.0,
             "env_reward_total:calculator": 6.0, "env_errors_total:calculator": 1.0,
             "env_episodes_total:textarena:GuessTheNumber-v0": 4.0,
             "env_finished_total:textarena:GuessTheNumber-v0": 4.0}
    summary = episode_summary(stats)
    assert summary["environments"]["calculator"] == {"episodes": 8.0, "errors": 1.0, "finished": 8.0,
                                                     "reward": 6.0, "reward_mean": 0.75}
    assert summary["environments"]["textarena:GuessTheNumber-v0"]["reward_mean"] == 0.0
    families = {f.name: f for f in episode_families({"episodes": summary, "stats": stats})}
    samples = {(s.name, s.labels["env"]): s.value for s in families["pipeline_env_member_episodes"].samples}
    assert samples == {("pipeline_env_member_episodes_total", "calculator"): 8.0,
                       ("pipeline_env_member_episodes_total", "textarena:GuessTheNumber-v0"): 4.0}
    assert episode_summary({"episodes_total": 3.0}).get("environments") is None  # one environment: as before


def test_pipeline_top_prints_a_line_per_member(redis_client):
    from tests.busy_streams import fill_streams

    from pipeline.keys import Keys
    from pipeline.observe.metrics import snapshot
    from pipeline.observe.top import frame_text, render

    keys = Keys("mixtop")
    fill_streams(redis_client, keys)
    redis_client.hset(keys.shard(0).stats, mapping={
        "episodes_total": 12, "episodes_finished_total": 12, "env_episodes_total:calculator": 8,
        "env_finished_total:calculator": 8, "env_reward_total:calculator": 6, "env_errors_total:calculator": 1,
        "env_episodes_total:textarena:GuessTheNumber-v0": 4, "env_finished_total:textarena:GuessTheNumber-v0": 4})
    text = frame_text(render(snapshot(redis_client, keys)), width=200)
    assert "env calculator   episodes 8 (finished 8)   errors 1   reward 0.750" in text, text
    assert "env textarena:GuessTheNumber-v0   episodes 4 (finished 4)   errors 0   reward 0.000" in text, text
