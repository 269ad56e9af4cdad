"""Tools an environment declares, shown to the model, and the function-calling parser that
runs the model's calls.

**Declaring.** A factory (``make(task) -> Episode``, pipeline.envs.base) declares tools with a
``tools`` attribute: a sequence of :class:`Tool` (a name, a description, the JSON schema of its
arguments, and the callable that runs it; :func:`tool` builds one from a Python function's
signature and docstring) or of OpenAI-style schema dicts. :class:`ToolEnv` is such a factory:
its episodes (:class:`ToolEpisode`) answer the model's tool calls themselves and hand every
other turn to the episode of the factory it wraps (or end the episode, without one).

**Shown.** The generator (and the held-out player) re-render each group's prompt with the
schemas (pipeline.envs.chat ``ChatTurns.for_factory``; pipeline.tasks.prompting): a chat
template that reads ``tools`` is rendered with ``tools=``, one that does not (SmolLM2's) gets
them in its system turn in the Hermes format. Without a chat template the prompt shows none.

**Parsed.** A model turn's calls are Hermes/JSON blocks, one or several:
``<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>``
(:func:`parse_tool_calls`; ``arguments`` may also be a JSON string of the object). Each is
checked against its tool's schema (:func:`check_arguments`: the tool known, ``arguments`` an
object, required ones present, none the schema does not name unless it allows more, JSON types
and enums) and run; each result is a ``tool`` chat turn (``Step.messages``: role ``tool``, the
call's ``name``, a ``tool_call_id``, the result as ``content``), in the order of the calls. A
malformed call (bad JSON, no name, unknown tool, arguments not matching) is answered with an
error turn and counted (``Step.tool_errors``, the ``env_tool_parse_errors_total`` counter); a
tool that raises is answered with its error (the step's ``tool_ok`` False, not a parse error).
A turn with no call goes to the wrapped episode's ``step``.

**Format reward.** ``format_reward`` (``env.format_reward``; 0 by default: nothing changes)
shapes the episode's reward once it made a call: the reward the episode gave last (0 for
none) plus ``format_reward × (well-formed calls − malformed calls) / calls``, so between
``-format_reward`` (every call malformed) and ``+format_reward`` (every call well-formed).
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pipeline.envs.base import EnvError, Step, reset_episode
from pipeline.tasks.prompting import function_schemas

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object",
               tuple: "array", type(None): "null"}


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its schema as the model sees it, and ``fn`` that runs it
    (called with the arguments as keywords; its result, a str or JSON-serialisable, is the
    tool turn's content)."""

    name: str
    description: str
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    """The JSON schema of the arguments: an object (``properties``, ``required``)."""
    fn: Callable[..., Any] | None = None

    @property
    def schema(self) -> dict:
        """The OpenAI-style function schema."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def tool(fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
         parameters: dict | None = None) -> Tool:
    """A :class:`Tool` running ``fn``: its name, the first paragraph of its docstring, and a
    parameters schema from its signature (annotations ``str``, ``int``, ``float``, ``bool``,
    ``list``, ``dict`` typed; parameters without a default required), unless given."""
    if parameters is None:
        props, required = {}, []
        hints = inspect.get_annotations(fn, eval_str=True)
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            t = _JSON_TYPES.get(hints.get(p.name))
            props[p.name] = {"type": t} if t else {}
            if p.default is p.empty:
                required.append(p.name)
        parameters = {"type": "object", "properties": props, "required": required}
    doc = inspect.getdoc(fn) or ""
    return Tool(name=name or fn.__name__, description=description if description is not None
                else doc.split("\n\n")[0].replace("\n", " "), parameters=parameters, fn=fn)


def as_tools(tools: Sequence[Tool | Callable]) -> tuple[Tool, ...]:
    """``tools`` as :class:`Tool` (a plain function through :func:`tool`); ValueError for two of
    one name."""
    out = tuple(t if isinstance(t, Tool) else tool(t) for t in tools)
    names = [t.name for t in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"tools: two tools are named {dup[0]!r}")
    return out


def schemas_of(factory) -> list[dict]:
    """The function schemas a factory declares (its ``tools``: :class:`Tool` objects or schema
    dicts); ``[]`` for none. ValueError for a schema that is not a function with a name, or two
    of one name (pipeline.tasks.prompting ``function_schemas``)."""
    return function_schemas(getattr(factory, "tools", None) or ())


# ----------------------------------------------------------------------------- the parser


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote, or why it could not be read (``error``)."""

    name: str
    arguments: dict
    error: str | None = None
    """Why the call is malformed (bad JSON, no name, arguments not an object); None: well-formed."""


_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.S)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of a model turn, in
    order (``[]``: the turn makes no call). ``arguments`` may be the JSON text of the object
    (OpenAI's form), or named ``parameters`` (as some models write it); absent, it is ``{}``.
    An unclosed block, text that is not a JSON object,
    a missing or non-string ``name`` or ``arguments`` that are not an object (or the JSON
    text of one) give a call with ``error`` set."""
    calls = []
    for m in _CALL.finditer(text):
        body, closed = m.group(1).strip(), bool(m.group(2))
        if not closed:
            calls.append(ToolCall("", {}, "the <tool_call> block is not closed with </tool_call>"))
            continue
        try:
            obj = json.loads(body)
        except ValueError as e:
            calls.append(ToolCall("", {}, f"the call is not valid JSON ({e})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", {}, 'the call is not a JSON object with a string "name"'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, '"arguments" is not a JSON object'))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


def _type_ok(value, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or (
            isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "boolean": bool, "array": list, "object": dict,
                              "null": type(None)}.get(t, object))


def check_arguments(schema: dict, value, where: str = "arguments") -> str | None:
    """Why ``value`` does not match the JSON ``schema`` (the subset tool schemas use: ``type``,
    ``enum``, ``properties``, ``required``, ``additionalProperties``, ``items``), else None. An
    object may hold no property the schema does not name unless ``additionalProperties`` allows it."""
    if not isinstance(schema, dict):
        return None
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else list(types)
        if not any(_type_ok(value, t) for t in types):
            return f"{where} must be {' or '.join(types)}, not {json.dumps(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {json.dumps(schema['enum'])}, not {json.dumps(value)}"
    if isinstance(value, dict) and ("properties" in schema or "required" in schema):
        props = schema.get("properties") or {}
        for name in schema.get("required") or ():
            if name not in value:
                return f"{where} is missing the required {name!r}"
        extra = schema.get("additionalProperties", False)
        for name, v in value.items():
            if name in props:
                why = check_arguments(props[name], v, f"{where}.{name}")
                if why:
                    return why
            elif extra is False:
                return f"{where} has {name!r}, which the tool does not take (it takes {', '.join(props) or 'none'})"
            elif isinstance(extra, dict):
                why = check_arguments(extra, v, f"{where}.{name}")
                if why:
                    return why
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            why = check_arguments(schema["items"], v, f"{where}[{i}]")
            if why:
                return why
    return None


@dataclass(frozen=True)
class ToolResult:
    """One call answered: the tool turn's content, and what happened."""

    name: str
    content: str
    ok: bool
    """The tool ran and returned."""
    well_formed: bool
    """The call parsed and matched its tool's schema (False: a parse error)."""


def run_call(tools: dict[str, Tool], call: ToolCall) -> ToolResult:
    """Check ``call`` against its tool and run it: the result as text (a str as it is, else its
    JSON), or an ``error: ...`` text saying what was wrong."""
    if call.error is not None:
        return ToolResult(call.name, f"error: {call.error}", ok=False, well_formed=False)
    t = tools.get(call.name)
    if t is None:
        return ToolResult(call.name, f"error: unknown tool {call.name!r}; the tools are: {', '.join(tools)}",
                          ok=False, well_formed=False)
    why = check_arguments(t.parameters, call.arguments)
    if why:
        return ToolResult(call.name, f"error: {why}", ok=False, well_formed=False)
    if t.fn is None:
        return ToolResult(call.name, f"error: the tool {call.name!r} cannot run here", ok=False, well_formed=True)
    try:
        out = t.fn(**call.arguments)
    except EnvError:  # the environment itself failed (a lost session), not the tool: env.on_error applies
        raise
    except Exception as e:  # noqa: BLE001 - the tool's own failure is the model's answer
        return ToolResult(call.name, f"error: {type(e).__name__}: {e}", ok=False, well_formed=True)
    text = out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)
    return ToolResult(call.name, text, ok=True, well_formed=True)


# ----------------------------------------------------------------------------- episodes


class ToolEpisode:
    """An episode that answers the model's tool calls with ``tools`` and hands every turn
    without a call to ``inner`` (an Episode; None: such a turn ends the episode, unrewarded).
    An ``inner`` episode with a ``tools`` attribute of its own runs its calls with those (tools
    bound to its state), the factory's schemas being what the model was shown."""

    def __init__(self, tools: Sequence[Tool], inner=None, *, format_reward: float = 0.0) -> None:
        own = getattr(inner, "tools", None)
        self.tools = {t.name: t for t in as_tools(own if own else tools)}
        self.inner, self.format_reward = inner, float(format_reward)
        self.calls = self.malformed = 0
        self.reward: float | None = None
        """The last reward ``inner`` gave."""

    def reset(self, seed: int | None = None) -> str:
        return "" if self.inner is None else reset_episode(self.inner, seed)

    def step(self, action: str) -> Step:
        calls = parse_tool_calls(action)
        if not calls:
            step = Step(observation="", done=True) if self.inner is None else self.inner.step(action)
            if isinstance(step, Step) and step.reward is not None:
                self.reward = float(step.reward)
            return self._shaped(step)
        results = [run_call(self.tools, c) for c in calls]
        first = self.calls
        self.calls += len(results)
        bad = sum(not r.well_formed for r in results)
        self.malformed += bad
        messages = tuple({"role": "tool", "name": r.name, "tool_call_id": f"call{first + i:05d}", "content": r.content}
                         for i, r in enumerate(results))
        observation = "\n".join(f"<tool_response>\n{r.content}\n</tool_response>" for r in results)
        return self._shaped(Step(observation=observation, tool_call=True, tool_ok=all(r.ok for r in results),
                                 role="tool", messages=messages, tool_errors=bad))

    def _shaped(self, step):
        if not self.format_reward or not self.calls or not isinstance(step, Step):
            return step
        shaping = self.format_reward * (self.calls - 2 * self.malformed) / self.calls
        return replace(step, reward=(self.reward or 0.0) + shaping)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


class ToolEnv:
    """A factory of :class:`ToolEpisode`: ``tools`` (:class:`Tool` objects or plain functions,
    :func:`tool`) shown to the model and run on its calls, every other turn handed to the
    episode ``episodes(task)`` makes (None: such a turn ends the episode). ``cfg``: the run
    config, whose ``env.format_reward`` shapes the reward (module docstring)."""

    def __init__(self, tools: Sequence[Tool | Callable], episodes: Callable | None = None, *, cfg=None,
                 format_reward: float | None = None) -> None:
        self.tools = as_tools(tools)
        self.episodes = episodes
        if format_reward is None:
            format_reward = getattr(getattr(cfg, "env", None), "format_reward", 0.0)
        self.format_reward = float(format_reward)

    def __call__(self, task) -> ToolEpisode:
        inner = None if self.episodes is None else self.episodes(task)
        return ToolEpisode(self.tools, inner, format_reward=self.format_reward)

    def close(self) -> None:
        close = getattr(self.episodes, "close", None)
        if callable(close):
            close()
