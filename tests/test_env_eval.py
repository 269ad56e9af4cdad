"""Held-out episodes (pipeline.engines.episodes) and the tool-use cold start (pipeline.model.tool_warmup).

The episodes are played by the real shipped base model and the real calculator; the
multi-turn mechanics (turn ends, observation ids, the turn and token budgets, a failing
step) with environments written here, whose every answer the test knows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.envs.base import Step
from pipeline.envs.calculator import calculator
from pipeline.engines.episodes import play, summarise
from pipeline.model.pretrain import SHIPPED
from pipeline.model.qwen import ModelShape, load_checkpoint
from pipeline.model.tool_warmup import transcript, warm_up_tool_use
from pipeline.model.tokenizer import CharTokenizer
from pipeline.engines.torch import greedy_decode
from pipeline.tasks import arithmetic as task


@pytest.fixture(scope="module")
def shipped():
    model, tok = load_checkpoint(SHIPPED)
    return model.eval(), tok


@pytest.fixture(scope="module")
def problems():
    return task.heldout_problems(n=60, seed=99, digits=3, ops=("+",))


def _ids(tok, problems):
    return [np.asarray(tok.encode(p.prompt), dtype=np.int32) for p in problems]


def test_a_base_that_answers_directly_plays_one_turn_scored_like_its_greedy_answer(shipped, problems):
    model, tok = shipped
    prompts = _ids(tok, problems)
    played = play(model, tok, prompts, [p.answer for p in problems], calculator(None), max_turns=3,
                  max_new_tokens=8)
    answers = greedy_decode(model, tok, prompts, max_new_tokens=8)
    right = [float(task.correctness(p.answer, [a])[0]) for p, a in zip(problems, answers)]
    assert [p.reward for p in played] == right
    assert 0 < sum(right) < len(right)  # the comparison is not between two constants
    assert all(p.turns == 1 and p.tool_calls == 0 and p.error is None for p in played)
    s = summarise(played)
    assert s["heldout_accuracy"] == pytest.approx(np.mean(right))
    assert s["heldout_tool_call_rate"] == 0.0 and s["heldout_tool_call_success"] is None


class Echo:
    """Answers every turn with ``obs`` and never ends the episode; counts its steps."""

    def __init__(self, obs: str, fail_at: int = 0):
        self.obs, self.fail_at, self.steps, self.closed = obs, fail_at, 0, False

    def reset(self) -> str:
        return ""

    def step(self, action: str) -> Step:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("tool crashed")
        return Step(observation=self.obs, reward=float(self.steps), tool_call=True, tool_ok=self.steps % 2 == 1)

    def close(self) -> None:
        self.closed = True


def _turns(completion: list[int], eos: int, obs: list[int]) -> list[list[int]]:
    """Split a completion into its sampled turns, checking that each ended turn is followed by ``obs``."""
    turns, i = [], 0
    while i < len(completion):
        j = completion.index(eos, i) + 1 if eos in completion[i:] else len(completion)
        turns.append(completion[i:j])
        i = j
        if i < len(completion):
            assert completion[i: i + len(obs)] == obs
            i += len(obs)
    return turns


def _play_echo(shipped, items, obs: str, **budget) -> tuple[list, list[Echo]]:
    """``items`` played by the shipped base against :class:`Echo` environments; (played, environments)."""
    model, tok = shipped
    made: list[Echo] = []

    def factory(t):
        made.append(Echo(obs))
        return made[-1]

    return play(model, tok, _ids(tok, items), [p.answer for p in items], factory, **budget), made


def test_turns_end_at_eos_and_the_observation_ids_follow_exactly_until_the_turn_limit(shipped, problems):
    _, tok = shipped
    played, made = _play_echo(shipped, problems[:12], "77", max_turns=3, max_new_tokens=40)
    obs = tok.encode("77")
    for p, env in zip(played, made):
        turns = _turns(p.completion, tok.eos_id, obs)
        assert p.turns == len(turns) == env.steps == 3  # every turn ended in eos: the limit ended the episode
        assert all(t[-1] == tok.eos_id for t in turns)
        assert len(p.completion) == sum(map(len, turns)) + 2 * len(obs)  # no observation after the last turn
        assert p.reward == 3.0 and p.tool_calls == 3 and p.tool_calls_ok == 2 and env.closed
    assert summarise(played)["heldout_tool_call_success"] == pytest.approx(2 / 3)


def test_the_token_budget_counts_observations_and_a_cut_turn_is_never_stepped(shipped, problems):
    _, tok = shipped
    played, made = _play_echo(shipped, problems[:8], "1234567", max_turns=10, max_new_tokens=16)
    for p, env in zip(played, made):
        assert len(p.completion) <= 16
        ended = p.completion.count(tok.eos_id)
        assert env.steps == ended  # only a turn that ended in eos within the budget went to the environment
        assert p.turns >= env.steps


def test_a_step_that_raises_ends_its_episode_keeping_the_reward_so_far(shipped, problems):
    model, tok = shipped
    played = play(model, tok, _ids(tok, problems[:4]), [p.answer for p in problems[:4]],
                  lambda t: Echo("5", fail_at=2), max_turns=4, max_new_tokens=40)
    for p in played:
        assert p.turns == 2 and p.reward == 1.0 and p.error == "RuntimeError: tool crashed"
    assert summarise(played)["heldout_env_errors"] == 4


def test_an_environment_that_cannot_start_leaves_its_episode_unrewarded_not_the_others(shipped, problems):
    model, tok = shipped
    calls = iter(range(100))

    def factory(t):
        if next(calls) == 1:
            raise ConnectionError("no server")
        return calculator(None)(t)

    played = play(model, tok, _ids(tok, problems[:3]), [p.answer for p in problems[:3]], factory, max_turns=2,
                  max_new_tokens=8)
    assert played[1].error == "ConnectionError: no server" and played[1].turns == 0 and np.isnan(played[1].reward)
    assert played[0].turns == played[2].turns == 1


def test_a_tool_transcript_is_the_calculator_episode_laid_out_as_the_generator_does():
    tok = CharTokenizer()
    p = task.Problem(a=1234, op="+", b=5678, digits=4)
    ids, mask = transcript(tok, p, tool=True)
    call = tok.encode("1234+5678=") + [tok.eos_id]
    obs = tok.encode("6912")
    assert ids == call + obs + tok.encode("6912") + [tok.eos_id]
    assert mask == [1] * len(call) + [0] * len(obs) + [1] * 5  # the tool's answer carries no loss
    assert transcript(tok, p, tool=False) == (tok.encode("6912") + [tok.eos_id], [1] * 5)


def test_the_tool_warm_up_writes_a_checkpoint_and_its_recipe(tmp_path):
    held = task.heldout_problems(n=20, seed=5, digits=4, ops=("+",))
    shape = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    info = warm_up_tool_use(tmp_path / "m", heldout=held, tool_rate=0.5, steps=3, batch_size=8, shape=shape,
                            log=lambda s: None)
    model, tok = load_checkpoint(tmp_path / "m")
    assert isinstance(tok, CharTokenizer) and sum(p.numel() for p in model.parameters()) > 0
    rec = json.loads((tmp_path / "m" / "tool_warmup.json").read_text())
    assert rec == info and rec["tool_rate"] == 0.5 and rec["heldout_excluded"] == 20 and np.isfinite(rec["final_loss"])
    with pytest.raises(ValueError, match="tool_rate"):
        warm_up_tool_use(tmp_path / "x", heldout=held, tool_rate=1.5, steps=1)
    with pytest.raises(ValueError, match="heldout"):
        warm_up_tool_use(tmp_path / "x", heldout=[], steps=1)


def test_greedy_play_is_deterministic(shipped, problems):
    model, tok = shipped
    args = (model, tok, _ids(tok, problems[:10]), [p.answer for p in problems[:10]], calculator(None))
    a = play(*args, max_turns=2, max_new_tokens=8)
    b = play(*args, max_turns=2, max_new_tokens=8, generator=torch.Generator().manual_seed(1))
    assert [x.completion for x in a] == [x.completion for x in b]


def test_an_arithmetic_run_uses_a_checkpoint_built_another_way_as_it_is(tmp_path):
    """A base from the tool warm-up (or init-model) has no pretrain.json: `pipeline up` must
    not pretrain over it."""
    import shutil

    from pipeline.config import RunConfig
    from pipeline.run.base_model import ensure_base_model

    base = tmp_path / "base"
    shutil.copytree(SHIPPED, base)
    (base / "pretrain.json").unlink()
    (base / "tool_warmup.json").write_text(json.dumps({"tool_rate": 0.3}))
    before = (base / "model.safetensors").read_bytes()
    cfg = RunConfig().with_overrides({"model.base_dir": str(base)})
    info = ensure_base_model(cfg)
    assert info == {"source": "checkpoint", "tool_warmup": {"tool_rate": 0.3}}
    assert (base / "model.safetensors").read_bytes() == before and not (base / "pretrain.json").exists()


def test_the_environment_is_given_the_prompt_as_the_task_wrote_it(shipped, problems):
    """A chat-formatted prompt's ids are what the model reads; the environment gets the task's
    own text (as the feeder's record carries it), and the references in order."""
    model, tok = shipped
    seen = []

    def factory(t):
        seen.append((t.prompt, t.reference, t.prompt_id))
        return calculator(None)(t)

    items = problems[:3]
    play(model, tok, _ids(tok, items), [p.answer for p in items], factory, max_turns=1, max_new_tokens=8,
         texts=[f"raw {i}" for i in range(3)])
    assert seen == [(f"raw {i}", p.answer, f"heldout-{i}") for i, p in enumerate(items)]
    seen.clear()
    play(model, tok, _ids(tok, items), [p.answer for p in items], factory, max_turns=1, max_new_tokens=8)
    assert [s[0] for s in seen] == [p.prompt for p in items]  # the char tokenizer decodes the ids back
