"""Multi-turn episodes: token in, token out.

The slot sampler runs an episode's turns with the environment's observations appended as
their exact token ids; the trainer's log-probs of the sampled tokens equal the sampler's
behaviour log-probs over the whole interleaved sequence, observation tokens carry a loss
mask of 0 and leave the update untouched; the generator stage drives real environments
(the calculator; a failing one) on a real Redis-compatible server.
"""

from __future__ import annotations

import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from pipeline.bus.connection import connect
from pipeline.bus.stats import read_stats
from pipeline.config import ConfigError, RunConfig, load_config
from pipeline.engines.slots import SlotSampler
from pipeline.engines.torch import sampled_mask, train_step
from pipeline.envs.base import EpisodeRunner, Step
from pipeline.envs.calculator import CalculatorEpisode, evaluate
from pipeline.keys import Keys
from pipeline.model.qwen import ModelShape, build_model, ragged_completion_logprobs, save_checkpoint
from pipeline.model.tokenizer import CharTokenizer
from pipeline.producers.feeder import run_feeder
from pipeline.producers.generator import Generator, Streamer
from pipeline.records import RecordError, RolloutGroup, ScoredGroup
from pipeline.algo.rewards import parse_reward_mode
try:
    from builders import RecordingLog
except ImportError:  # this file imported by path as an env.kind plugin (pipeline up), outside pytest
    RecordingLog = None

TINY = ModelShape(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def tok() -> CharTokenizer:
    return CharTokenizer()


def _model(tok, seed=0):
    return build_model(TINY, tok.vocab_size, seed=seed).eval()


# ---------------------------------------------------------------------- the calculator


def test_the_calculator_answers_calls_and_scores_the_final_answer():
    ep = CalculatorEpisode(" 357")
    assert ep.reset() == ""
    assert ep.step("12+345=") == Step(observation="357", tool_call=True, tool_ok=True)
    assert ep.step("2+3*4 =") == Step(observation="14", tool_call=True, tool_ok=True)
    assert ep.step("12+=") == Step(observation="", tool_call=True, tool_ok=False)  # malformed: nothing back
    assert ep.step("356") == Step(observation="", reward=0.0, done=True)
    assert CalculatorEpisode("357").step(" 357 ") == Step(observation="", reward=1.0, done=True)
    assert evaluate("7*8*9+1") == 505 and ep.calls == 3


def test_the_runner_counts_each_episodes_tool_calls_and_the_answered_ones(tok):
    """A calculator episode making a valid and a malformed call, then its answer: 2 calls, 1
    answered (success 1/2); its sibling answers at once (no call). Real steps on the runner's
    threads, through its collect loop."""
    from pipeline.config import EnvConfig
    from pipeline.records import PromptTask
    from pipeline.envs.calculator import calculator

    runner = EpisodeRunner(calculator(None), EnvConfig(), tok, RecordingLog())
    task = PromptTask(prompt_id="p", prompt=" 12+345=", prompt_ids=np.array(tok.encode(" 12+345="), np.int32),
                      reference="357", issued_at=0.0)
    assert runner.start("k", task, 2) == [[], []]
    script = {0: ["12+345=", "12+=", "357"], 1: ["356"]}
    steps = {0: [], 1: []}
    for turn in range(3):
        for j, actions in script.items():
            if turn < len(actions):
                runner.submit("k", j, actions[turn])
        while runner.waiting:
            for key, j, obs, done in runner.collect(1.0):
                steps[j].append((tok.decode(obs), done))
    assert steps == {0: [("357", False), ("", False), ("", True)], 1: [("", True)]}
    assert runner.tools("k", 2) == ([2, 0], [1, 0])
    assert runner.finish("k", 2) == [1.0, 0.0] and runner.calls == {}
    counters = runner.take_counters()
    assert counters["episodes_total"] == 2 and counters["env_steps_total"] == 4
    buckets = {k: v for k, v in counters.items() if k.startswith("env_step_seconds_bucket:")}
    assert sum(buckets.values()) == 4  # every step attempt in one latency bucket
    runner.close()


# ---------------------------------------------------------------------- the slot sampler


def _episodes(model, tok, *, observation: str, max_turns=3, slots=6, seed=0, turn_tokens=0):
    s = SlotSampler(model, slots=slots, temperature=1.0, eos_id=tok.eos_id, pad_id=tok.pad_id,
                    generator=torch.Generator().manual_seed(seed))
    prompts = [np.array(tok.encode(" 12+34="), np.int32), np.array(tok.encode(" 5*6="), np.int32)]
    for k, p in enumerate(prompts):
        s.add(k, p, n=3, max_new_tokens=40, version=0, observations=[tok.encode("7")] * 3)
        s.set_max_turns(k, max_turns, turn_tokens)
    done, actions = [], []
    while len(done) < 2:
        done += s.step(0)
        for key, j, act in s.turn_ended():
            actions.append(act)
            f = s.observe(key, j, tok.encode(observation), done=False, version=0)
            if f is not None:
                done.append(f)
    return prompts, done, actions


def test_episode_logprobs_of_sampled_tokens_equal_the_trainers_over_the_interleaved_sequence(tok):
    model = _model(tok)
    prompts, done, actions = _episodes(model, tok, observation="99")
    assert actions, "no turn ended: nothing was interleaved"
    multi = 0
    obs_ids, first = tok.encode("99"), tok.encode("7")
    for f in done:
        p = torch.from_numpy(prompts[f.key].astype(np.int64))
        for t, lp, m, turns in zip(f.tokens, f.logprobs, f.masks, f.turns):
            m = np.asarray(m, dtype=bool)
            assert t[: len(first)] == first and not m[: len(first)].any()  # the reset observation
            assert 1 <= turns <= 3
            multi += turns > 1
            # Every observation follows an eos-ended turn, as its exact ids.
            ends = [i for i in range(len(t)) if m[i] and t[i] == tok.eos_id and i + 1 < len(t)]
            for i in ends:
                assert t[i + 1: i + 1 + len(obs_ids)] == obs_ids and not m[i + 1: i + 1 + len(obs_ids)].any()
            assert int((~m).sum()) == len(first) + len(ends) * len(obs_ids)
            re = ragged_completion_logprobs(model, [p], torch.tensor([t]), pad_id=tok.pad_id)[0]
            assert torch.allclose(re[torch.from_numpy(m)], torch.tensor(lp, dtype=torch.float32)[m], atol=1e-4)
            assert all(x == 0.0 for x, keep in zip(lp, m) if not keep)
    assert multi, "no episode took a second turn"


def test_a_turn_reaching_the_per_turn_token_limit_ends_there_closed_by_a_masked_eos(tok):
    model = _model(tok, seed=5)
    prompts, done, actions = _episodes(model, tok, observation="99", max_turns=3, turn_tokens=3)
    assert actions and all(len(a) <= 3 for a in actions)
    obs_ids, first = tok.encode("99"), tok.encode("7")
    cut_seen = 0
    for f in done:
        p = torch.from_numpy(prompts[f.key].astype(np.int64))
        for t, lp, m, turns, cut in zip(f.tokens, f.logprobs, f.masks, f.turns, f.turns_cut):
            m = np.asarray(m, dtype=bool)
            # Walk the stream turn by turn: sampled runs of at most 3 tokens, each either ending
            # in its own eos or followed by an eos the model did not sample, then the observation.
            i, n_turns, n_cut = len(first), 0, 0
            while i < len(t):
                j = i
                while j < len(t) and m[j]:
                    j += 1
                run = t[i:j]
                assert 1 <= len(run) <= 3, run
                n_turns += 1
                if run[-1] != tok.eos_id:  # cut at the limit (the budget, 40, is never reached:
                    assert len(run) == 3    # three turns of at most 3 + 1 + 2 tokens)
                    n_cut += 1
                    if j < len(t):
                        assert t[j] == tok.eos_id and not m[j] and lp[j] == 0.0
                        j += 1
                if j < len(t):
                    assert t[j: j + len(obs_ids)] == obs_ids and not m[j: j + len(obs_ids)].any()
                    j += len(obs_ids)
                i = j
            assert (n_turns, n_cut) == (turns, cut)
            cut_seen += cut
            re = ragged_completion_logprobs(model, [p], torch.tensor([t]), pad_id=tok.pad_id)[0]
            assert torch.allclose(re[torch.from_numpy(m)], torch.tensor(lp, dtype=torch.float32)[m], atol=1e-4)
    assert cut_seen, "no turn reached the limit: nothing was cut"
    # Without the limit the same sampler's turns run past three tokens.
    _, _, free = _episodes(model, tok, observation="99", max_turns=3)
    assert max(len(a) for a in free) > 3


def test_an_episode_ends_at_the_turn_limit_and_a_done_observation(tok):
    model = _model(tok, seed=3)
    _, done, _ = _episodes(model, tok, observation="5", max_turns=1)
    assert all(t == 1 for f in done for t in f.turns)
    s = SlotSampler(model, slots=2, temperature=1.0, eos_id=tok.eos_id, pad_id=tok.pad_id,
                    generator=torch.Generator().manual_seed(0))
    s.add("g", np.array(tok.encode(" 1+1="), np.int32), n=1, max_new_tokens=40, version=0, observations=[[]])
    got = None
    while got is None:
        s.step(0)
        for key, j, _ in s.turn_ended():
            got = s.observe(key, j, tok.encode("2"), done=True, version=0)
    assert got.turns == [1] and tok.encode("2")[0] not in got.tokens[0][-1:]
    with pytest.raises(KeyError):
        s.observe("g", 0, [], done=True, version=0)


# ---------------------------------------------------------------------- records and the trainer


def _episode_rollout(tok) -> RolloutGroup:
    # Two completions: sampled "1", eos, observation "23", sampled "4", eos; and sampled "5", eos.
    a = tok.encode("1") + [tok.eos_id] + tok.encode("23") + tok.encode("4") + [tok.eos_id]
    b = tok.encode("5") + [tok.eos_id]
    mask = [1, 1, 0, 0, 1, 1] + [1, 1]
    return RolloutGroup(
        prompt_id="p1", group_id="g", generator_id="gen", prompt=" 1+2=", prompt_ids=np.array(tok.encode(" 1+2="), np.int32),
        reference="3", completions=("4", "5"), completion_ids=np.array(a + b, np.int32),
        completion_lens=np.array([len(a), len(b)], np.int32),
        behaviour_logprobs=np.array([-1.0, -0.5, 0.0, 0.0, -2.0, -0.3, -1.2, -0.1], np.float32),
        min_version=0, max_version=0, created_at=0.0, loss_mask=np.array(mask, np.uint8),
        turns=np.array([2, 1], np.int32), env_rewards=np.array([0.0, np.nan], np.float32),
        tool_calls=np.array([1, 0], np.int32), tool_calls_ok=np.array([1, 0], np.int32))


def test_episode_records_round_trip_and_bad_episode_fields_are_refused(tok):
    g = RolloutGroup.decode(_episode_rollout(tok).encode())
    assert g.loss_mask.tolist() == [1, 1, 0, 0, 1, 1, 1, 1] and g.turns.tolist() == [2, 1]
    assert g.env_rewards[0] == 0.0 and np.isnan(g.env_rewards[1])
    assert g.tool_calls.tolist() == [1, 0] and g.tool_calls_ok.tolist() == [1, 0]
    assert ScoredGroup.decode(_scored(g, [1, 0]).encode()).rollout.tool_calls.tolist() == [1, 0]
    for field, value, why in (("loss_mask", bytes([1, 1, 0, 2, 1, 1, 1, 1]), "loss_mask"),
                              ("loss_mask", bytes([1, 1, 0]), "loss_mask"),
                              ("turns", np.array([2], "<i4").tobytes(), "turns"),
                              ("turns", np.array([-1, 1], "<i4").tobytes(), "turns"),
                              ("env_rewards", np.array([1.0], "<f4").tobytes(), "env_rewards"),
                              ("env_rewards", np.array([np.inf, 0], "<f4").tobytes(), "env_rewards"),
                              ("tool_calls", np.array([1], "<i4").tobytes(), "tool_calls"),
                              ("tool_calls_ok", np.array([2, 0], "<i4").tobytes(), "tool_calls"),
                              ("tool_calls_ok", None, "come together")):
        d = msgpack.unpackb(_episode_rollout(tok).encode())
        d[field] = value
        with pytest.raises(RecordError, match=why):
            RolloutGroup.decode(msgpack.packb(d))
    plain = RolloutGroup.decode(msgpack.packb({k: v for k, v in msgpack.unpackb(_episode_rollout(tok).encode()).items()
                                               if k not in ("loss_mask", "turns", "env_rewards")}))
    assert plain.loss_mask is None and plain.env_rewards is None and plain.tool_calls is None
    older = RolloutGroup.decode(msgpack.packb({k: v for k, v in msgpack.unpackb(_episode_rollout(tok).encode()).items()
                                               if k not in ("tool_calls", "tool_calls_ok")}))
    assert older.turns.tolist() == [2, 1] and older.tool_calls is None  # an episode record without the counts


def _scored(ro, rewards):
    return ScoredGroup(rollout=ro, verifier_names=("v",), votes=np.ones((2, 1), np.float32),
                       rewards=np.array(rewards, np.float32), truth=np.zeros(2, np.float32), reward_mode="environment",
                       labelmodel_version=-1, verifier_id="ver", scored_at=0.0)


def test_observation_tokens_are_out_of_the_loss_and_the_update(tok):
    import dataclasses

    ro = _episode_rollout(tok)
    m = sampled_mask([_scored(ro, [1, 0])], (2, 6))
    assert m.tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0]]
    cfg = RunConfig().with_overrides({"trainer.lr": 1e-2})

    def update(rollout):
        torch.manual_seed(0)
        model = _model(tok, seed=5).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_step(model, opt, [_scored(rollout, [1, 0])], cfg, pad_id=tok.pad_id, eos_id=tok.eos_id)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    base = update(ro)
    lp = ro.behaviour_logprobs.copy()
    lp[2:4] = -5.0  # the observation tokens' (meaningless) behaviour log-probs
    assert torch.equal(update(dataclasses.replace(ro, behaviour_logprobs=lp)), base)
    lp = ro.behaviour_logprobs.copy()
    lp[4] = -5.0  # a sampled token's
    assert not torch.allclose(update(dataclasses.replace(ro, behaviour_logprobs=lp)), base)
    everything = dataclasses.replace(ro, loss_mask=np.ones(8, np.uint8))
    assert not torch.allclose(update(everything), base)


def test_the_environment_reward_mode_reads_episode_rewards_and_needs_an_environment():
    mode = parse_reward_mode("environment")
    votes = np.ones((3, 1))
    assert mode(votes=votes, names=["v"], env_rewards=np.array([1.0, np.nan, 0.25])).tolist() == [1.0, 0.0, 0.25]
    with pytest.raises(ValueError, match="environment rewards"):
        mode(votes=votes, names=["v"])
    with pytest.raises(ConfigError, match="verifier.reward"):
        load_config(overrides={"verifier.reward": "environment"})
    with pytest.raises(ConfigError, match="env.kind"):
        load_config(overrides={"env.kind": "calculator"})  # batch generation cannot run episodes
    with pytest.raises(ConfigError, match="env.kind"):
        load_config(overrides={"env.kind": "calculator", "generator.swap": "step", "trainer.backend": "torchtitan"})


# ---------------------------------------------------------------------- the generator stage, real Redis


def _gen_cfg(ns: str, base: str, **extra) -> RunConfig:
    return RunConfig().with_overrides({
        "run_id": ns, "model.base_dir": base, "generator.swap": "step", "generator.group_size": 3,
        "generator.prompts_per_batch": 2, "generator.slots": 6, "task.max_new_tokens": 40,
        "feeder.max_prompts": 2, "redis.claim_idle_ms": 0, "redis.block_ms": 50, **extra})


def _random_base(tmp_path, tok, seed=11) -> str:
    out = tmp_path / "random-base"
    save_checkpoint(_model(tok, seed=seed), tok, out)
    return str(out)


def _rollouts(r, keys) -> list[RolloutGroup]:
    return [RolloutGroup.decode(f[b"d"]) for key in keys.stream_keys("rollouts") for _, f in r.xrange(key)]


class _Counter:
    """Answers every action with its length's last digit; done at the third turn, reward 1."""

    def __init__(self):
        self.turns = 0

    def reset(self):
        return "0"

    def step(self, action):
        self.turns += 1
        return Step(observation=str(len(action) % 10), reward=1.0 if self.turns == 3 else None,
                    done=self.turns == 3)

    def close(self):
        pass

    @staticmethod
    def expect(action: str, turn: int) -> Step:
        return Step(observation=str(len(action) % 10), done=turn == 3)


def counter(cfg):
    return lambda task: _Counter()


@pytest.mark.parametrize("env", ["calculator", "counter"])
def test_the_generator_runs_episodes_token_in_token_out(redis_url, tmp_path, tok, env):
    spec = env if env == "calculator" else f"{Path(__file__).resolve()}:counter"
    cfg = _gen_cfg(f"ep{env}", _random_base(tmp_path, tok), **{"env.kind": spec, "env.max_turns": 3})
    r = connect(redis_url, name="t")
    keys = Keys(f"ep{env}", shards=cfg.redis.shards)
    run_feeder(cfg, r, keys, RecordingLog(), tokenizer=tok, max_rounds=1)
    Streamer(Generator(cfg, r, keys, "gen-a", RecordingLog())).run(max_batches=1)
    groups = _rollouts(r, keys)
    assert len(groups) == 2
    stats = read_stats(r, keys)
    assert stats["episodes_total"] == 6 and stats["turns_total"] == sum(int(g.turns.sum()) for g in groups)
    # The tool-call counters are the records' own counts, summed.
    assert stats["episodes_finished_total"] == 6
    assert stats.get("tool_calls_total", 0) == sum(int(g.tool_calls.sum()) for g in groups)
    assert stats.get("tool_calls_ok_total", 0) == sum(int(g.tool_calls_ok.sum()) for g in groups)
    assert stats.get("episodes_with_tool_calls_total", 0) == sum(int((g.tool_calls > 0).sum()) for g in groups)
    calls = 0
    calls_of = {id(g): list(zip(g.tool_calls.tolist(), g.tool_calls_ok.tolist())) for g in groups}
    for g in groups:
        assert g.loss_mask is not None and g.turns is not None and g.env_rewards is not None
        for ids, m, lp, text, turns, reward in zip(g.split(g.completion_ids), g.split(g.loss_mask),
                                                   g.split(g.behaviour_logprobs), g.completions, g.turns,
                                                   g.env_rewards):
            ids, m = ids.tolist(), m.astype(bool)
            assert (lp[~m] == 0).all() and (lp[m] < 0).all()
            # Split into runs: model turns (mask 1, each ending at its eos; an empty observation
            # puts two turns side by side) and observations (mask 0), in order.
            runs, i = [], 0
            while i < len(ids):
                j = i
                while j < len(ids) and m[j] == m[i] and not (m[i] and j > i and ids[j - 1] == tok.eos_id):
                    j += 1
                runs.append((bool(m[i]), ids[i:j]))
                i = j
            model_runs = [r for sampled, r in runs if sampled]
            assert len(model_runs) == turns
            assert text == tok.decode(model_runs[-1])  # what the verifiers read: the last model turn
            if env == "calculator":
                # A random model rarely spells a call: every episode is then one turn, a final
                # answer the calculator scored (or cut off by the token budget, unscored).
                # The record's tool calls: the turns the calculator was sent (eos-ended, with
                # room left) that ended in "=", and of those the well-formed ones.
                sent = [CalculatorEpisode(g.reference).step(tok.decode(turn[:-1])) for k, turn in enumerate(model_runs)
                        if turn[-1] == tok.eos_id and (k + 1 < len(model_runs) or len(ids) < 40)]
                assert calls_of[id(g)].pop(0) == (sum(st.tool_call for st in sent),
                                                  sum(st.tool_call and st.tool_ok for st in sent))
                for (sampled, turn), (after, obs) in zip(runs, runs[1:]):
                    if sampled:  # a turn the calculator answered: its answer follows (nothing for a malformed call)
                        step = CalculatorEpisode(g.reference).step(tok.decode(turn[:-1]))
                        assert not step.done and (obs if not after else []) == tok.encode(step.observation)
                final = model_runs[-1][-1] == tok.eos_id and not tok.decode(model_runs[-1]).strip().endswith("=")
                assert reward == float(text.strip() == g.reference.strip()) if final else np.isnan(reward)
                continue
            # The reset observation first, then after every turn but the last the environment's
            # answer to it, as its exact encoded ids.
            assert runs[0] == (False, tok.encode("0"))
            for k, ((sampled, turn), (after, obs)) in enumerate(zip(runs[1::2], runs[2::2])):
                assert sampled and not after and turn[-1] == tok.eos_id
                assert obs == tok.encode(_Counter.expect(tok.decode(turn[:-1]), k + 1).observation)
                calls += 1
            # Reward 1 once the counter has answered a third action; a third turn the token
            # budget cut off (no eos, or eos as the budget's last token) was never sent to it.
            third_sent = turns == 3 and model_runs[-1][-1] == tok.eos_id and len(ids) < cfg.task.max_new_tokens
            assert reward == 1.0 if third_sent else np.isnan(reward)
    assert calls or env == "calculator", "no observation came back into a sequence"
    r.close()


_CALLS = {"n": 0}
_LOCK = threading.Lock()


class _Flaky:
    """Raises on every other step, answers "1" otherwise, ends at the third answer."""

    def __init__(self):
        self.answers = 0

    def reset(self):
        return ""

    def step(self, action):
        with _LOCK:
            _CALLS["n"] += 1
            fail = _CALLS["n"] % 2 == 1
        if fail:
            raise RuntimeError("the environment fell over")
        self.answers += 1
        return Step(observation="1", reward=0.5, done=self.answers >= 3)

    def close(self):
        pass


def test_the_generator_cuts_turns_at_the_per_turn_limit_and_counts_them(redis_url, tmp_path, tok):
    spec = f"{Path(__file__).resolve()}:counter"
    cfg = _gen_cfg("epcut", _random_base(tmp_path, tok), **{"env.kind": spec, "env.max_turns": 3,
                                                            "env.max_turn_tokens": 2})
    r = connect(redis_url, name="t")
    keys = Keys("epcut", shards=cfg.redis.shards)
    run_feeder(cfg, r, keys, RecordingLog(), tokenizer=tok, max_rounds=1)
    Streamer(Generator(cfg, r, keys, "gen-a", RecordingLog())).run(max_batches=1)
    groups = _rollouts(r, keys)
    assert len(groups) == 2
    cut = 0
    for g in groups:
        for ids, m, turns in zip(g.split(g.completion_ids), g.split(g.loss_mask), g.turns):
            ids, m = ids.tolist(), m.astype(bool).tolist()
            runs = [ids[i:j] for i, j in _sampled_runs(m)]
            assert len(runs) == turns and all(1 <= len(x) <= 2 for x in runs)
            for (i, j), run in zip(_sampled_runs(m), runs):
                if run[-1] != tok.eos_id:
                    cut += 1
                    if j < len(ids):  # closed by an eos the model did not sample, then the counter's answer
                        assert ids[j] == tok.eos_id and not m[j]
                        assert tok.decode(ids[j + 1: j + 2]) == str(len(run))
    assert cut > 0 and read_stats(r, keys)["env_turns_cut_total"] == cut
    with pytest.raises(ConfigError, match=r"env\.max_turn_tokens"):
        _gen_cfg("epcut-bad", "unused", **{"env.max_turn_tokens": -1}).validate()


def _sampled_runs(mask: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of sampled tokens (the counter's answers are never empty)."""
    out, i = [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            out.append((i, j))
            i = j
        else:
            i += 1
    return out


def flaky(cfg):
    return lambda task: _Flaky()


@pytest.mark.parametrize("policy", ["end", "retry"])
def test_failing_environment_steps_end_or_retry_the_episode_and_are_counted(redis_url, tmp_path, tok, policy):
    _CALLS["n"] = 0
    spec = f"{Path(__file__).resolve()}:flaky"
    cfg = _gen_cfg(f"flaky{policy}", _random_base(tmp_path, tok, seed=13),
                   **{"env.kind": spec, "env.on_error": policy, "env.retries": 2, "env.max_turns": 6})
    r = connect(redis_url, name="t")
    keys = Keys(f"flaky{policy}", shards=cfg.redis.shards)
    run_feeder(cfg, r, keys, RecordingLog(), tokenizer=tok, max_rounds=1)
    log = RecordingLog()
    Streamer(Generator(cfg, r, keys, "gen-a", log)).run(max_batches=1)
    groups = _rollouts(r, keys)
    assert len(groups) == 2, "a failing environment lost a group"
    stats = read_stats(r, keys)
    assert stats["env_errors_total"] >= 1
    assert any(e == "env_step_failed" for e, _ in log.events)
    turns = np.concatenate([g.turns for g in groups])
    if policy == "end":  # the first step of every episode fails: each ends after one turn, unrewarded
        assert (turns <= 1 + 6).all() and np.isnan(np.concatenate([g.env_rewards for g in groups])).any()
    else:  # retried until it answers: some episode got a reward
        assert (np.concatenate([g.env_rewards for g in groups]) == 0.5).any()
    r.close()
