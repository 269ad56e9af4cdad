"""Episode seeds, environments that cannot start, the check before launch, and the counts.

- every episode of a GRPO group is reset with one seed (``episode_seed``: the run's
  ``feeder.seed`` and the prompt's id), two groups with different ones; an Episode whose
  ``reset`` takes no argument keeps working; held-out episodes get theirs from their ids;
- resets failing in a row past ``env.max_failed_resets`` stop the generator, and ``pipeline up``
  stops the run naming the error (real processes);
- the check before launch plays one episode through the model's tokenizer and refuses an
  environment whose text it cannot encode, or whose reset or step raises;
- every environment failure logged is counted, those of groups handed back at a stop included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from pipeline.bus.connection import connect
from pipeline.bus.stats import read_stats
from pipeline.config import ConfigError, RunConfig
from pipeline.engines.episodes import play
from pipeline.envs.base import EnvResetsFailing, EpisodeRunner, Step, episode_seed, takes_seed
from pipeline.keys import Keys
from pipeline.model.qwen import ModelShape, build_model, save_checkpoint
from pipeline.model.tokenizer import CharTokenizer
from pipeline.producers.feeder import run_feeder
from pipeline.producers.generator import Generator, Streamer
from pipeline.records import PromptTask, RolloutGroup
from pipeline.run.preflight import preflight
try:
    from builders import RecordingLog
except ImportError:  # this file imported by path as an env.kind plugin (pipeline up), outside pytest
    RecordingLog = None

HERE = Path(__file__).resolve()
SHAPE = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.one_server]


@pytest.fixture
def tok() -> CharTokenizer:
    return CharTokenizer()


def _task(pid: str) -> PromptTask:
    return PromptTask(prompt_id=pid, prompt="1+2=", prompt_ids=np.array([1, 2, 3], dtype=np.int32), reference="3",
                      issued_at=0.0)


def _env_cfg(**kw):
    return RunConfig().with_overrides({"env.kind": "calculator", "generator.swap": "step",
                                       **{f"env.{k}": v for k, v in kw.items()}}).env


# ---------------------------------------------------------------------- episodes that record their seed


class _Seeded:
    """Answers its reset with the seed it was given (digits the tiny tokenizer encodes)."""

    def __init__(self, log: list):
        self.log = log

    def reset(self, seed=None):
        self.log.append(seed)
        return str(seed)

    def step(self, action):
        return Step(observation="", reward=1.0, done=True)

    def close(self):
        pass


class _NoSeed(_Seeded):
    def reset(self):  # the contract before seeds: still called, without one
        self.log.append("none")
        return ""


class _Kwargs(_Seeded):
    def reset(self, **kwargs):
        self.log.append(kwargs.get("seed"))
        return ""


def test_the_seed_is_a_stable_hash_of_the_run_seed_and_the_prompt_id():
    a = episode_seed(0, "p00000001")
    assert a == episode_seed(0, "p00000001") and 0 <= a < 2 ** 31
    assert len({a, episode_seed(0, "p00000002"), episode_seed(1, "p00000001")}) == 3
    # Not Python's hash(): another process with another hash seed derives the same number.
    code = "from pipeline.envs.base import episode_seed; print(episode_seed(0, 'p00000001'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert int(out) == a


def test_every_episode_of_a_group_gets_the_groups_seed_and_two_groups_different_ones(tok):
    for cls, expect_seed in ((_Seeded, True), (_Kwargs, True), (_NoSeed, False)):
        seen: list = []
        runner = EpisodeRunner(lambda task: cls(seen), _env_cfg(), tok, RecordingLog(), run_seed=7)
        runner.start("a", _task("p00000001"), 4)
        runner.start("b", _task("p00000002"), 4)
        if not expect_seed:
            assert seen == ["none"] * 8 and not takes_seed(cls([]))
            continue
        assert seen[:4] == [episode_seed(7, "p00000001")] * 4
        assert seen[4:] == [episode_seed(7, "p00000002")] * 4
        assert seen[0] != seen[4]
        assert runner.seeds == {"a": seen[0], "b": seen[4]}
        runner.finish("a", 4)
        assert "a" not in runner.seeds


class _SlowReset(_Seeded):
    """A reset that waits on a server for 0.3 s."""

    def reset(self, seed=None):
        time.sleep(0.3)
        return super().reset(seed)


def test_a_groups_resets_run_together_on_the_pool_and_keep_their_order(tok):
    seen: list = []
    calls = []

    def factory(task):
        calls.append(task.prompt_id)
        if len(calls) % 4 == 0:
            raise RuntimeError("no session")
        return _SlowReset(seen)

    log = RecordingLog()
    runner = EpisodeRunner(factory, _env_cfg(workers=8), tok, log, run_seed=7)
    t0 = time.monotonic()
    firsts = runner.start("a", _task("p00000001"), 8)
    took = time.monotonic() - t0
    assert took < 1.5, f"8 resets of 0.3 s each took {took:.2f} s: they ran one after another"
    digits = tok.encode(str(episode_seed(7, "p00000001")))
    assert sum(f == digits for f in firsts) == 6 and sum(f == [] for f in firsts) == 2
    assert len(runner.broken) == 2 and runner.take_counters()["env_errors_total"] == 2
    assert [e for e, kw in log.events if e == "env_reset_failed"] == ["env_reset_failed"] * 2
    assert len(runner.episodes) == 6, "every episode made is kept, so finish closes it"
    runner.finish("a", 8)
    assert not runner.episodes


def seeded(cfg):
    return lambda task: _Seeded([])


def _base(tmp_path, tok, seed=11) -> str:
    model = build_model(SHAPE, tok.vocab_size, seed=seed).eval()
    out = tmp_path / "random-base"
    save_checkpoint(model, tok, out)
    return str(out)


def _gen_cfg(ns: str, base: str, **extra) -> RunConfig:
    return RunConfig().with_overrides({
        "run_id": ns, "model.base_dir": base, "generator.swap": "step", "generator.group_size": 3,
        "generator.prompts_per_batch": 2, "generator.slots": 6, "task.max_new_tokens": 40,
        "feeder.max_prompts": 2, "redis.claim_idle_ms": 0, "redis.block_ms": 50, **extra})


def _rollouts(r, keys) -> list[RolloutGroup]:
    return [RolloutGroup.decode(f[b"d"]) for key in keys.stream_keys("rollouts") for _, f in r.xrange(key)]


def test_the_generator_resets_a_groups_episodes_with_one_seed_from_feeder_seed(redis_url, tmp_path, tok):
    cfg = _gen_cfg("seeds", _base(tmp_path, tok), **{"env.kind": f"{HERE}:seeded", "env.max_turns": 2,
                                                     "feeder.seed": 5})
    r = connect(redis_url, name="t")
    keys = Keys("seeds", shards=cfg.redis.shards)
    run_feeder(cfg, r, keys, RecordingLog(), tokenizer=tok, max_rounds=1)
    Streamer(Generator(cfg, r, keys, "gen-a", RecordingLog())).run(max_batches=1)
    groups = _rollouts(r, keys)
    assert len(groups) == 2
    firsts = []
    for g in groups:
        # Each completion opens with its reset observation (mask 0): the seed's digits.
        opened = set()
        for ids, mask in zip(g.split(g.completion_ids), g.split(g.loss_mask)):
            n = int(np.argmax(mask == 1)) if (mask == 1).any() else len(mask)
            opened.add(tok.decode(ids[:n].tolist()))
        assert opened == {str(episode_seed(5, g.prompt_id))}, (g.prompt_id, opened)
        firsts.append(opened.pop())
    assert firsts[0] != firsts[1]
    r.close()


def test_held_out_episodes_are_the_same_games_at_every_evaluation(tok):
    model = build_model(SHAPE, tok.vocab_size, seed=0).eval()
    prompts = [np.asarray(tok.encode(p), dtype=np.int32) for p in ("1+2=", "3+4=", "5+6=")]
    runs = []
    for _ in range(2):
        seen: list = []
        play(model, tok, prompts, ["3", "7", "11"], lambda task: _Seeded(seen), max_turns=1, max_new_tokens=12)
        runs.append(sorted(seen))
    expect = sorted(episode_seed(0, f"heldout-{i}") for i in range(3))
    assert runs[0] == runs[1] == expect and len(set(expect)) == 3


# ---------------------------------------------------------------------- resets that keep failing


class _Refuses:
    def reset(self, seed=None):
        raise RuntimeError("no game here")

    def step(self, action):
        raise AssertionError("never stepped")

    def close(self):
        pass


def test_resets_failing_in_a_row_past_the_bound_raise_naming_the_environment_and_the_first_error(tok):
    fail = {"on": True}

    def factory(task):
        return _Refuses() if fail["on"] else _Seeded([])

    runner = EpisodeRunner(factory, _env_cfg(max_failed_resets=5), tok, RecordingLog())
    runner.start("a", _task("p1"), 3)  # 3 in a row: under the bound
    fail["on"] = False
    runner.start("b", _task("p2"), 1)  # one that starts: the count starts again
    fail["on"] = True
    runner.start("c", _task("p3"), 3)
    with pytest.raises(EnvResetsFailing, match=r"env.kind 'calculator': 6 episode resets failed in a row.*"
                                               r"max_failed_resets = 5.*RuntimeError: no game here"):
        runner.start("d", _task("p4"), 3)
    # 0: never.
    runner = EpisodeRunner(lambda task: _Refuses(), _env_cfg(max_failed_resets=0), tok, RecordingLog())
    for k in range(20):
        runner.start(k, _task(f"p{k}"), 4)


def fails_in_generators(cfg):
    """Works in the driver's check and the trainer's held-out episodes; every reset in a generator
    process fails (as an environment whose server the generators' hosts cannot reach)."""
    in_generator = "generate" in sys.argv

    class Episode(_Seeded):
        def reset(self, seed=None):
            if in_generator:
                raise ConnectionError("the game server refused the connection")
            return ""

    return lambda task: Episode([])


def test_pipeline_up_stops_within_a_minute_when_every_reset_fails_naming_the_error(tmp_path, tiny_base_model):
    from harness import up

    t0 = time.monotonic()
    p = up(tmp_path, tiny_base_model, "--run-id", "resets", "--trainer.steps", "50", "--generator.swap", "step",
           "--env.kind", f"{HERE}:fails_in_generators", "--env.max_failed_resets", "8",
           "--cluster.timeout_s", "300")
    out = p.communicate(timeout=300)[0].decode()
    seconds = time.monotonic() - t0
    assert p.returncode != 0, out[-3000:]
    assert "the game server refused the connection" in out and "env.max_failed_resets = 8" in out, out[-3000:]
    assert "restarting it" not in out, "a generator that cannot start its environment was restarted"
    summary = json.loads((tmp_path / "runs" / "resets" / "summary.json").read_text())
    assert summary["status"].startswith("failed: gen-") and "the game server refused the connection" in \
        summary["status"], summary["status"]
    # Every failed reset the generators logged is counted, the exiting generator's last ones included.
    run = tmp_path / "runs" / "resets"
    logged = sum(json.loads(line).get("event") == "env_reset_failed" for f in (run / "logs").glob("gen-*.jsonl")
                 for line in f.read_text().splitlines() if line.startswith("{"))
    assert logged >= 8 and summary["episodes"]["env_errors"] == logged, (logged, summary.get("episodes"))
    # The run's own clock (from its workers' start to the stop) within a minute; the command with
    # its check before launch, the workers' imports and the report, within three on a loaded host.
    assert summary["wall_seconds"] < 60 and seconds < 180, (summary["wall_seconds"], seconds)


# ---------------------------------------------------------------------- the check before launch


def prose(cfg):
    class Episode(_Seeded):
        def reset(self, seed=None):
            return "I am thinking of an integer"

    return lambda task: Episode([])


def prose_after_a_step(cfg):
    class Episode(_Seeded):
        def reset(self, seed=None):
            return "1"

        def step(self, action):
            return Step(observation="Too high.", reward=None, done=False)

    return lambda task: Episode([])


def step_raises(cfg):
    class Episode(_Seeded):
        def reset(self, seed=None):
            return ""

        def step(self, action):
            raise KeyError("action")

    return lambda task: Episode([])


class _Closing:
    """A factory with resources: the check must close it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __call__(self, task):
        return _Seeded([])

    def close(self):
        self.marker.write_text("closed")


def closing(cfg):
    return _Closing(Path(os.environ["RLPIPE_TEST_CLOSE_MARKER"]))


def _up_cfg(base, kind: str) -> RunConfig:
    return RunConfig().with_overrides({"model.base_dir": str(base), "generator.swap": "step", "env.kind": kind,
                                       "redis.url": "redis://127.0.0.1:1/0"})


@pytest.mark.parametrize("fn, stage, text", [("prose", "reset", "I am thinking of an integer"),
                                             ("prose_after_a_step", "step", "Too high.")])
def test_the_check_refuses_an_environment_whose_text_the_tokenizer_cannot_encode(tiny_base_model, fn, stage, text):
    kind = f"{HERE}:{fn}"
    with pytest.raises(ConfigError) as e:
        preflight(_up_cfg(tiny_base_model, kind))
    msg = str(e.value)
    assert f"env.kind {kind!r}" in msg and str(tiny_base_model) in msg, msg
    assert f"{stage} observation {text!r}" in msg and "not in the vocabulary" in msg, msg


def test_the_check_refuses_an_environment_whose_step_raises_and_passes_a_good_one(tiny_base_model, tmp_path,
                                                                                  monkeypatch):
    kind = f"{HERE}:step_raises"
    with pytest.raises(ConfigError, match=r"its step raised KeyError: 'action'") as e:
        preflight(_up_cfg(tiny_base_model, kind))
    assert str(tiny_base_model) in str(e.value)
    preflight(_up_cfg(tiny_base_model, "calculator"))
    marker = tmp_path / "closed"
    monkeypatch.setenv("RLPIPE_TEST_CLOSE_MARKER", str(marker))
    preflight(_up_cfg(tiny_base_model, f"{HERE}:closing"))
    assert marker.read_text() == "closed", "the check left the environment's factory open"


# ---------------------------------------------------------------------- every failure logged is counted


def stops_the_run(cfg):
    """Member 0's reset fails; every step fails, and the fourth one asks the run to stop, so the
    failures logged after the last group emitted belong to groups handed back."""
    url, stop = os.environ["RLPIPE_TEST_REDIS"], os.environ["RLPIPE_TEST_STOP_KEY"]

    class Episode(_Seeded):
        def __init__(self, member: int):
            super().__init__([])
            self.member = member

        def reset(self, seed=None):
            if self.member == 0:
                raise RuntimeError("reset fell over")
            return ""

        def step(self, action):
            client = redis.Redis.from_url(url)
            if client.incr(f"{stop}:test-steps") > 3:  # failures logged first, then the stop
                client.set(stop, 1)
            client.close()
            raise RuntimeError("step fell over")

    made = {}

    def factory(task):
        made[task.prompt_id] = made.get(task.prompt_id, -1) + 1
        return Episode(made[task.prompt_id])

    return factory


def test_every_failure_logged_is_counted_also_of_groups_handed_back_at_a_stop(redis_url, tmp_path, tok,
                                                                             monkeypatch):
    cfg = _gen_cfg("counts", _base(tmp_path, tok, seed=3),
                   **{"env.kind": f"{HERE}:stops_the_run", "env.on_error": "retry", "env.retries": 50,
                      "env.max_turns": 4})
    keys = Keys("counts", shards=cfg.redis.shards)
    monkeypatch.setenv("RLPIPE_TEST_REDIS", redis_url)
    monkeypatch.setenv("RLPIPE_TEST_STOP_KEY", keys.stop)
    r = connect(redis_url, name="t")
    run_feeder(cfg, r, keys, RecordingLog(), tokenizer=tok, max_rounds=1)
    log = RecordingLog()
    Streamer(Generator(cfg, r, keys, "gen-a", log)).run()
    logged = [e for e, _ in log.events if e in ("env_reset_failed", "env_step_failed")]
    assert any(e == "env_reset_failed" for e in logged) and any(e == "env_step_failed" for e in logged)
    assert any(e == "episode_handed_back" for e, _ in log.events), "no group was in flight at the stop"
    assert read_stats(r, keys).get("env_errors_total", 0) == len(logged)
    r.close()


# ---------------------------------------------------------------------- the seed reaches the game


def _guesses(ep) -> list:
    """Every answer to the guesses 1, 2, ... until the game ends."""
    out = []
    for guess in range(1, 21):
        step = ep.step(f"[{guess}]")
        out.append(step)
        if step.done:
            break
    return out


def test_a_textarena_game_is_the_seeds_game_in_process_and_over_openenv(tmp_path):
    pytest.importorskip("textarena", reason="the textarena extra")
    from pipeline.envs.textarena import DEFAULT_GAME, TextArenaEpisode

    games = {}
    for seed in (1, 2, 3, 4):
        a, b = TextArenaEpisode(DEFAULT_GAME, 0), TextArenaEpisode(DEFAULT_GAME, 99)
        assert a.reset(seed=seed) == b.reset(seed=seed)  # the seed given wins over the one it was made with
        games[seed] = _guesses(a)
        assert games[seed] == _guesses(b)
    assert len({len(g) for g in games.values()}) > 1, "every seed played the same game"
    pytest.importorskip("openenv.core", reason="the openenv extra")
    from pipeline.envs.registry import make_env

    served = make_env(RunConfig().with_overrides({"generator.swap": "step", "runs_dir": str(tmp_path / "runs"),
                                                  "env.kind": "openenv:pipeline.envs.textarena_server:app"}))
    try:
        for seed, game in games.items():  # the seed travels with OpenEnv's reset: the same game on the server
            ep = served(_task(f"p{seed}"))
            ep.reset(seed=seed)
            assert _guesses(ep) == game
            ep.close()
    finally:
        served.close()
