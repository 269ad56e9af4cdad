"""Tools an environment declares (pipeline.envs.tools): their schemas shown in the prompt the
way the chat template expects, the model's ``<tool_call>`` blocks parsed, checked against the
schemas and run, each result a ``tool`` turn of the template, malformed calls answered and
counted, the format reward.

The real SmolLM2-135M-Instruct tokenizer and chat template (no ``tools`` support: the schemas
go into its system turn in the Hermes format) and a Hermes/Qwen-style template written here
(it reads ``tools`` and wraps tool results in ``<tool_response>``) build the token streams the
episode runner appends; they must equal the tokenisation of the template's rendering of the
same conversation. The generator stage (feeder, streamer, a real Redis-compatible server) and
the held-out player run the real model with a tool environment; the calculator keeps its
``=`` calls and answers its declared ``calculate`` function too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pipeline.bus.connection import connect
from pipeline.config import ConfigError, EnvConfig, RunConfig
from pipeline.engines.episodes import play
from pipeline.envs.base import EpisodeRunner, Step
from pipeline.envs.calculator import CALCULATE, CalculatorEpisode, calculator
from pipeline.envs.chat import ChatTemplateError, ChatTurns
from pipeline.envs.tools import (Tool, ToolEnv, ToolEpisode, check_arguments, parse_tool_calls, schemas_of,
                                 tool)
from pipeline.keys import Keys
from pipeline.model.qwen import load_checkpoint
from pipeline.model.tokenizer import load_tokenizer
from pipeline.producers.feeder import run_feeder
from pipeline.producers.generator import Generator, Streamer
from pipeline.records import PromptTask, RolloutGroup
from pipeline.tasks.prompting import (PromptFormat, build_prompt, checkpoint_format, hermes_tools_text, reads_tools,
                                      render_chat)
try:
    from builders import RecordingLog
except ImportError:  # this file imported by path as an env.kind plugin (pipeline up), outside pytest
    RecordingLog = None

SMOLLM2 = Path(__file__).resolve().parents[1] / "artifacts" / "smollm2-135m-instruct"
needs_smollm2 = pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").is_file(),
                                   reason=f"no imported SmolLM2-135M-Instruct tokenizer at {SMOLLM2}")
needs_model = pytest.mark.skipif(not (SMOLLM2 / "model.safetensors").is_file(),
                                 reason=f"no imported SmolLM2-135M-Instruct at {SMOLLM2}")
QUESTION = "What is 2 + 3, then times 4?"

HERMES = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
"""A Hermes/Qwen2.5-style chat template: it reads ``tools`` (a ``# Tools`` system section), and
renders a run of tool results as one user turn of ``<tool_response>`` blocks."""


pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.one_server]


def add(a: int, b: int) -> int:
    """Add two integers.

    Longer text that is not the description."""
    return a + b


def mul(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


class Answer:
    """The episode a turn without a call goes to: reward 1 for the answer 20."""

    def __init__(self, reference: str = "20"):
        self.reference, self.actions = reference, []

    def reset(self, seed=None) -> str:
        return ""

    def step(self, action: str) -> Step:
        self.actions.append(action)
        return Step(observation="", reward=float(action.strip() == self.reference), done=True)

    def close(self) -> None:
        pass


def arithmetic_tools(cfg):
    """``env.kind`` factory: ``add`` and ``mul`` as tools, then the answer."""
    return ToolEnv([add, mul], lambda task: Answer(task.reference), cfg=cfg)


def _call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _formats(tok_dir=SMOLLM2):
    smol = checkpoint_format(tok_dir)
    return {"smollm2": smol, "hermes": PromptFormat(chat_template=HERMES, special_tokens=smol.special_tokens)}


def _play_scripted(fmt: PromptFormat, tok, turns: list[str], factory=None, *, max_turns: int = 4):
    """One episode through the runner (its thread pool, the chat turns) with the sampled turns
    given as text (each encoded and ended with the eos, as the slot sampler hands them over;
    an observation with done is not appended, as the slot sampler does):
    the token stream (prompt, first observation, turns and observations) and the runner."""
    factory = factory or arithmetic_tools(None)
    runner = EpisodeRunner(factory, EnvConfig(max_turns=max_turns), tok, RecordingLog(), chat=ChatTurns.of(fmt, tok))
    text, prompt = build_prompt(fmt, tok, QUESTION)
    task = PromptTask(prompt_id="p", prompt=text, prompt_ids=prompt, reference="20", issued_at=0.0)
    (first,) = runner.start("k", task, 1)
    stream = [int(x) for x in runner.prompt("k", task.prompt_ids)] + list(first)
    done = False
    for turn in turns:
        assert not done
        stream += list(tok.encode(turn)) + [tok.eos_id]
        runner.submit("k", 0, turn)
        got = []
        while runner.waiting:
            got += runner.collect(1.0)
        ((_, _, obs, done),) = got
        stream += [] if done else list(obs)  # the slot sampler appends no observation after done
    return stream, runner, done


# ------------------------------------------------------------------ the parser and the schemas


def test_tool_schemas_from_functions_and_the_parser():
    t = tool(add)
    assert t.schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}}
    assert schemas_of(ToolEnv([add, CALCULATE])) == [t.schema, CALCULATE.schema]
    assert schemas_of(lambda task: None) == [] and schemas_of(calculator(None)) == [CALCULATE.schema]
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        ToolEnv([add, Tool("add", "again")])
    with pytest.raises(ValueError, match="not a function schema"):
        schemas_of(type("F", (), {"tools": [{"name": "add"}]})())

    calls = parse_tool_calls("Let me compute. " + _call("add", a=2, b=3) + " and "
                             + '<tool_call>{"name": "mul", "arguments": "{\\"a\\": 5, \\"b\\": 4}"}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 2, "b": 3}, None),
                                                             ("mul", {"a": 5, "b": 4}, None)]
    assert parse_tool_calls("20") == []
    bad = parse_tool_calls('<tool_call>{"name": add}</tool_call><tool_call>[1]</tool_call>'
                           '<tool_call>{"name": "add", "arguments": 3}</tool_call><tool_call>{"name": "add"')
    assert [c.error.split(" (")[0] for c in bad] == [
        "the call is not valid JSON", 'the call is not a JSON object with a string "name"',
        '"arguments" is not a JSON object', "the <tool_call> block is not closed with </tool_call>"]

    params = t.parameters
    assert check_arguments(params, {"a": 1, "b": 2}) is None
    assert check_arguments(params, {"a": 1}) == "arguments is missing the required 'b'"
    assert "has 'c', which the tool does not take" in check_arguments(params, {"a": 1, "b": 2, "c": 3})
    assert check_arguments(params, {"a": "1", "b": 2}) == 'arguments.a must be integer, not "1"'
    assert check_arguments(params, {"a": True, "b": 2}) == "arguments.a must be integer, not true"
    assert check_arguments({"type": "object", "properties": {"op": {"enum": ["+", "*"]},
                                                             "xs": {"type": "array", "items": {"type": "number"}}}},
                           {"op": "-", "xs": [1]}) == 'arguments.op must be one of ["+", "*"], not "-"'
    assert check_arguments({"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "number"}}}},
                           {"xs": [1, "x"]}) == 'arguments.xs[1] must be number, not "x"'


# ------------------------------------------------------------------ shown in the prompt


@needs_smollm2
def test_the_schemas_are_shown_as_each_template_expects_and_prompts_without_tools_are_unchanged():
    fmts = _formats()
    smol, hermes = fmts["smollm2"], fmts["hermes"]
    schemas = schemas_of(arithmetic_tools(None))
    assert not reads_tools(smol.chat_template) and reads_tools(HERMES)

    # Without tools: the text is the template's rendering of [system?, user], as before.
    for fmt in (smol, checkpoint_format(SMOLLM2, system_prompt="Be brief."), hermes):
        head = [{"role": "system", "content": fmt.system_prompt}] if fmt.system_prompt else []
        assert fmt.with_tools(()) == fmt
        assert fmt.render(QUESTION) == render_chat(fmt.chat_template, head + [{"role": "user", "content": QUESTION}],
                                                   **dict(fmt.special_tokens))
    assert smol.render(QUESTION).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")

    # SmolLM2's template has no tools: the Hermes text is its system turn (after the system prompt).
    shown = smol.with_tools(schemas).render(QUESTION)
    lines = "\n".join(json.dumps(s) for s in schemas)
    assert shown == (f"<|im_start|>system\n{hermes_tools_text(schemas)}<|im_end|>\n"
                     f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert f"<tools>\n{lines}\n</tools>" in shown and '<tool_call>\n{"name": <function-name>, "arguments"' in shown
    brief = checkpoint_format(SMOLLM2, system_prompt="Be brief.").with_tools(schemas).render(QUESTION)
    assert brief.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions")

    # A template that reads tools renders them itself, given tools=.
    assert hermes.with_tools(schemas).render(QUESTION) == render_chat(
        HERMES, [{"role": "user", "content": QUESTION}], tools=schemas, **dict(hermes.special_tokens))
    assert f"# Tools\n\n<tools>\n{lines}\n</tools><|im_end|>\n<|im_start|>user\n" in hermes.with_tools(
        schemas).render(QUESTION)
    assert "<tools>" not in hermes.render(QUESTION)

    # The user message is recovered from a prompt to render it again with the tools.
    for fmt in fmts.values():
        assert fmt.user_of(fmt.render(QUESTION)) == QUESTION and fmt.user_of("not a prompt") is None

    # The runner: a factory without tools keeps the task's prompt as it is; one with tools
    # gets it rendered again showing them.
    tok = load_tokenizer(SMOLLM2)
    text, ids = build_prompt(smol, tok, QUESTION)
    task = PromptTask(prompt_id="p", prompt=text, prompt_ids=ids, reference="20", issued_at=0.0)
    plain = EpisodeRunner(lambda task: Answer(), EnvConfig(), tok, RecordingLog(), chat=ChatTurns.of(smol, tok))
    assert plain.start("k", task, 2) == [[], []] and plain.prompt("k", task.prompt_ids) is task.prompt_ids
    with_tools = EpisodeRunner(arithmetic_tools(None), EnvConfig(), tok, RecordingLog(), chat=ChatTurns.of(smol, tok))
    assert with_tools.start("k", task, 2) == [[], []]
    assert list(with_tools.prompt("k", task.prompt_ids)) == tok.encode(shown)
    other = PromptTask(prompt_id="q", prompt="not a prompt", prompt_ids=ids, reference="", issued_at=0.0)
    assert with_tools.start("q", other, 1) == [[]] and with_tools.take_counters()["env_errors_total"] == 1
    with pytest.raises(ChatTemplateError, match="task.chat_template"):
        with_tools.chat.first(ids, [""])  # no text to render again
    for r in (plain, with_tools):
        r.close()


# ------------------------------------------------------------------ calls answered as tool turns


@needs_smollm2
@pytest.mark.parametrize("kind", ["smollm2", "hermes"])
def test_a_call_is_parsed_run_and_answered_as_a_tool_turn_of_the_template(kind):
    """Two turns with calls (one call, then two in one turn), then the answer: each result is a
    ``tool`` turn with the call's name; the token stream the runner builds (the prompt showing
    the tools, sampled turns, observations) is the tokenisation of the template's rendering of
    the same conversation."""
    tok = load_tokenizer(SMOLLM2)
    fmt = _formats()[kind]
    turns = [_call("add", a=2, b=3), "First I multiply. " + _call("mul", a=5, b=4) + "\n" + _call("add", a=20, b=0),
             "20"]
    stream, runner, done = _play_scripted(fmt, tok, turns)
    assert done and runner.finish("k", 1) == [1.0]
    counters = runner.take_counters()
    assert counters.get("env_tool_parse_errors_total", 0) == 0 and counters["env_steps_total"] == 3
    runner.close()

    shown = fmt.with_tools(schemas_of(arithmetic_tools(None)))
    conversation = [{"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": turns[0]},
                    {"role": "tool", "name": "add", "tool_call_id": "call00000", "content": "5"},
                    {"role": "assistant", "content": turns[1]},
                    {"role": "tool", "name": "mul", "tool_call_id": "call00001", "content": "20"},
                    {"role": "tool", "name": "add", "tool_call_id": "call00002", "content": "20"},
                    {"role": "assistant", "content": turns[2]}]
    expected = render_chat(fmt.chat_template, shown.messages(conversation), **shown.template_kwargs())
    expected_ids = tok.encode(expected)
    # The rendering adds the eos's "\n" and the next generation prompt; the stream ends at the eos.
    assert stream == expected_ids[:len(stream)]
    assert expected_ids[len(stream):] == tok.encode("\n<|im_start|>assistant\n")
    text = tok._tok.decode(stream, skip_special_tokens=False)
    if kind == "smollm2":
        assert "<|im_start|>tool\n20<|im_end|>\n<|im_start|>tool\n20<|im_end|>\n<|im_start|>assistant\n" in text
    else:
        assert ("<|im_start|>user\n<tool_response>\n20\n</tool_response>\n<tool_response>\n20\n</tool_response>"
                "<|im_end|>\n<|im_start|>assistant\n") in text


@needs_smollm2
def test_malformed_calls_are_answered_with_errors_counted_and_shape_the_format_reward():
    tok = load_tokenizer(SMOLLM2)
    fmt = _formats()["smollm2"]
    turns = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}</tool_call>',  # bad JSON
             _call("sub", a=1, b=2) + _call("add", a=2),  # unknown tool, a missing argument
             _call("add", a=2, b="3") + _call("add", a=2, b=3, c=4),  # a wrong type, an extra argument
             _call("add", a=2, b=3)]
    stream, runner, done = _play_scripted(fmt, tok, turns, max_turns=8)
    assert not done
    counters = runner.take_counters()
    assert counters["env_tool_parse_errors_total"] == 5
    calls, ok = runner.tools("k", 1)
    assert calls == [4] and ok == [1]  # four turns with calls, the last one answered
    runner.finish("k", 1)
    runner.close()
    text = tok._tok.decode(stream, skip_special_tokens=False)
    for said in ("<|im_start|>tool\nerror: the call is not valid JSON",
                 "<|im_start|>tool\nerror: unknown tool 'sub'; the tools are: add, mul<|im_end|>",
                 "<|im_start|>tool\nerror: arguments is missing the required 'b'<|im_end|>",
                 "<|im_start|>tool\nerror: arguments.b must be integer, not \"3\"<|im_end|>",
                 "<|im_start|>tool\nerror: arguments has 'c', which the tool does not take (it takes a, b)",
                 "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"):
        assert said in text, said

    # The format reward: (well-formed - malformed) / calls x env.format_reward, on the episode's reward.
    def shaped(actions, format_reward):
        ep = ArithmeticEpisode(format_reward)
        return [ep.step(a).reward for a in actions]

    class ArithmeticEpisode(ToolEpisode):
        def __init__(self, format_reward):
            super().__init__(ToolEnv([add, mul]).tools, Answer(), format_reward=format_reward)

    assert shaped([_call("add", a=1, b=1), "20"], 0.0) == [None, 1.0]  # the default: nothing changes
    assert shaped([_call("add", a=1, b=1), "20"], 0.5) == [0.5, 1.5]
    assert shaped([_call("add", a=1, b=1) + _call("nope"), "7"], 0.5) == [0.0, 0.0]
    assert shaped([_call("nope"), "7"], 0.25) == [-0.25, -0.25]
    assert shaped(["7"], 0.5) == [0.0]  # no call: no shaping
    cfg = RunConfig().with_overrides({"env.format_reward": 0.2})
    assert arithmetic_tools(cfg).format_reward == 0.2 and arithmetic_tools(None).format_reward == 0.0
    with pytest.raises(ConfigError, match="env.format_reward"):
        RunConfig().with_overrides({"env.format_reward": math.inf})


def test_the_calculator_keeps_its_calls_and_answers_its_declared_function():
    ep = calculator(None)(PromptTask(prompt_id="p", prompt=" 12*3=", prompt_ids=np.zeros(1, np.int32),
                                     reference="36", issued_at=0.0))
    assert ep.reset(seed=7) == ""
    assert ep.step("12*3=") == CalculatorEpisode("36").step("12*3=")  # the = call as before
    step = ep.step(_call("calculate", expression="1234*5678"))
    assert step.tool_call and step.tool_ok and step.messages[0]["content"] == "7006652"
    step = ep.step(_call("calculate", expression="12/3"))
    assert step.tool_call and not step.tool_ok and step.tool_errors == 0 and "ValueError" in step.observation
    assert ep.step("36") == Step(observation="", reward=1.0, done=True)


# ------------------------------------------------------------------ the real model, the real stages


@needs_model
def test_the_generator_stage_and_the_held_out_player_show_the_tools(redis_url):
    """The generator stage (feeder, streamer, a real Redis-compatible server) with SmolLM2 and a
    tool environment: the group's prompt is the feeder's, rendered again with the tools in its
    system turn; each completion's turns are masked and answered as the environment says.
    The held-out player shows the same prompt."""
    cfg = RunConfig().with_overrides({
        "run_id": "tools", "model.base_dir": str(SMOLLM2), "task.kind": "code", "task.max_new_tokens": 48,
        "generator.swap": "step", "generator.group_size": 2, "generator.prompts_per_batch": 1,
        "generator.temperature": 0.0, "feeder.max_prompts": 1, "redis.claim_idle_ms": 0, "redis.block_ms": 50,
        "env.kind": f"{Path(__file__).resolve()}:arithmetic_tools", "env.max_turns": 2})
    tok = load_tokenizer(SMOLLM2)
    fmt = checkpoint_format(SMOLLM2)
    shown = fmt.with_tools(schemas_of(arithmetic_tools(None)))
    r = connect(redis_url, name="t")
    keys = Keys("tools", shards=cfg.redis.shards)
    run_feeder(cfg, r, keys, RecordingLog(), tokenizer=tok, max_rounds=1)
    Streamer(Generator(cfg, r, keys, "gen-a", RecordingLog())).run(max_batches=1)
    (g,) = [RolloutGroup.decode(f[b"d"]) for key in keys.stream_keys("rollouts") for _, f in r.xrange(key)]
    user = fmt.user_of(g.prompt)
    assert user is not None and "<tools>" not in g.prompt  # the feeder's prompt: no tools
    assert list(g.prompt_ids) == tok.encode(shown.render(user))
    assert "<tools>\n" + json.dumps(tool(add).schema) in tok._tok.decode(list(g.prompt_ids))
    for mask, turns in zip(g.split(g.loss_mask), g.turns):
        assert (mask == 1).any() and 1 <= int(turns) <= 2
    r.close()

    # The held-out player: given the prompt's text, or its user message (as the trainer gives them).
    model, _ = load_checkpoint(SMOLLM2)
    text, prompt = build_prompt(fmt, tok, user)
    played = play(model.eval(), tok, [prompt, prompt], ["20", "20"], arithmetic_tools(None), max_turns=1,
                  max_new_tokens=8, texts=[text, user], chat=ChatTurns.of(fmt, tok))
    assert [p.error for p in played] == [None, None]
    assert played[0].prompt == played[1].prompt == tok.encode(shown.render(user))


def twin_tools(cfg):
    """``env.kind`` factory declaring two tool schemas of one name: a prompt cannot show them."""
    def factory(task):
        return Answer(task.reference)

    factory.tools = [tool(add).schema, tool(add).schema]
    return factory


@needs_smollm2
def test_the_check_before_launch_renders_the_prompt_with_the_tools():
    from pipeline.run.preflight import env_problems

    base = {"model.base_dir": str(SMOLLM2), "task.kind": "code", "generator.swap": "step"}
    good = RunConfig().with_overrides({**base, "env.kind": f"{Path(__file__).resolve()}:arithmetic_tools"})
    assert env_problems(good) == []
    bad = RunConfig().with_overrides({**base, "env.kind": f"{Path(__file__).resolve()}:twin_tools"})
    (problem,) = env_problems(bad)
    assert "cannot show the environment's tools" in problem and "named 'add'" in problem and "env.kind" in problem
