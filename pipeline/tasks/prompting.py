"""The one place a prompt is built: a task's user message -> the text the policy reads -> token ids.

A task's ``Item.prompt`` is the user message (``task.template`` applied to the problem).
:func:`build_prompt` renders it with the run's :class:`PromptFormat` and encodes it; the
feeder (training prompts), the trainer (held-out evaluation) and the supervised warm-up of
``pipeline init-model`` all build their prompts through it, so what is sampled, trained and
evaluated is one text. The rendered text is what ``PromptTask.prompt`` carries, so the
weak verifiers see exactly what the policy saw (never the reference).

For the text tasks (``math``, ``reasoning_gym``) :func:`prompt_format` reads the
checkpoint: with a chat template (``tokenizer_config.json``'s ``chat_template`` or
``chat_template.jinja``) and ``task.chat_template`` ``auto`` or ``on``, the prompt is the
template applied to ``[system?, user]`` with the generation prompt added, exactly as
``AutoTokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``
renders it (the same renderer, without loading a tokenizer or torch). Without one, the
optional ``task.system_prompt`` precedes the user message, separated by a blank line. The
arithmetic task's prompts pass through untouched: they are fixed-width character strings
for the character tokenizer.

Tools (pipeline.envs.tools): a format may carry the OpenAI-style function schemas of an
environment's tools (:meth:`PromptFormat.with_tools`). A template that reads a ``tools``
variable (Qwen2.5's, Hermes') is rendered with ``tools=``; one that does not (SmolLM2's) gets
them in its system turn in the Hermes format (:func:`hermes_tools_text`: the schemas as JSON
lines between ``<tools>`` and ``</tools>``, and the instruction to answer with
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), after ``task.system_prompt``. A
format without tools renders exactly as before. The feeder's prompts carry no tools: the
generator, which builds the environment, re-renders a group's prompt with them
(:meth:`PromptFormat.user_of` recovers the user message; pipeline.envs.chat).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
from jinja2 import Environment, TemplateError, meta

from pipeline.common.hf_files import read_chat_template, special_token_names

if TYPE_CHECKING:
    from pipeline.config import TaskConfig


@dataclass(frozen=True)
class PromptFormat:
    """How a user message becomes the policy's prompt text."""

    chat_template: str | None = None
    """Jinja chat template of the checkpoint (None: plain text)."""
    system_prompt: str = ""
    """System message (empty: none)."""
    special_tokens: tuple[tuple[str, str], ...] = ()
    """``(name, token)`` pairs the template may read (``bos_token``, ``eos_token``, ...)."""
    tools: tuple[str, ...] = ()
    """The tools shown to the model: OpenAI-style function schemas, each as its JSON text
    (empty: none; only a chat template shows them)."""

    def render(self, user: str) -> str:
        """The prompt text of one user message."""
        if self.chat_template is None:
            return f"{self.system_prompt}\n\n{user}" if self.system_prompt else user
        return render_chat(self.chat_template, self.messages([{"role": "user", "content": user}]),
                           **self.template_kwargs())

    def with_tools(self, schemas) -> PromptFormat:
        """This format showing the function ``schemas`` (dicts, ``{"type": "function", "function":
        {...}}``); ``()`` for none."""
        return replace(self, tools=tuple(json.dumps(s, ensure_ascii=False) for s in schemas))

    @property
    def tool_schemas(self) -> list[dict]:
        return [json.loads(t) for t in self.tools]

    @property
    def template_reads_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` variable itself."""
        return self.chat_template is not None and reads_tools(self.chat_template)

    def system_text(self) -> str:
        """The system message: ``system_prompt``, then the Hermes tools text where the format has
        tools and its template does not read them (empty: no system message)."""
        if not self.tools or self.template_reads_tools:
            return self.system_prompt
        block = hermes_tools_text(self.tool_schemas)
        return f"{self.system_prompt}\n\n{block}" if self.system_prompt else block

    def messages(self, conversation: list[dict]) -> list[dict]:
        """``conversation`` after the format's system message (if any)."""
        system = self.system_text()
        return ([{"role": "system", "content": system}] if system else []) + list(conversation)

    def template_kwargs(self) -> dict:
        """What the template is rendered with besides the messages: the special tokens, and
        ``tools`` for a template that reads them."""
        kw: dict = dict(self.special_tokens)
        if self.tools and self.template_reads_tools:
            kw["tools"] = self.tool_schemas
        return kw

    def user_of(self, prompt: str) -> str | None:
        """The user message this format rendered as ``prompt`` (None: not one of its prompts)."""
        probe = "PROBE-USER-MESSAGE-c41e"
        rendered = self.render(probe)
        if rendered.count(probe) != 1:
            return None
        before, after = rendered.split(probe)
        if len(prompt) < len(before) + len(after) or not prompt.startswith(before) or not prompt.endswith(after):
            return None
        user = prompt[len(before):len(prompt) - len(after)]
        return user if self.render(user) == prompt else None


PLAIN = PromptFormat()
"""The user message as it is (the arithmetic task; a checkpoint without a chat template)."""


def render_chat(template: str, messages: list[dict[str, str]], **special_tokens) -> str:
    """``messages`` through the Jinja chat ``template`` with the generation prompt, as
    ``apply_chat_template(..., add_generation_prompt=True, tokenize=False)`` renders them
    (``tools=`` among the keywords: the function schemas, for a template that reads them)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                        add_generation_prompt=True, **special_tokens)
    return rendered[0]


@lru_cache(maxsize=32)
def reads_tools(template: str) -> bool:
    """Whether a Jinja chat template reads a ``tools`` variable (one of its undeclared variables;
    for a template Jinja cannot parse here, whether it says ``tools`` at all)."""
    try:
        env = Environment(extensions=["jinja2.ext.loopcontrols"])
        return "tools" in meta.find_undeclared_variables(env.parse(template))
    except TemplateError:
        return re.search(r"\btools\b", template) is not None


HERMES_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
"""The Hermes tools text (as Qwen2.5's template writes it into its system turn)."""


def function_schemas(tools) -> list[dict]:
    """The OpenAI-style function schemas of ``tools`` (objects with a ``schema``, such as
    pipeline.envs.tools ``Tool``, or schema dicts). ValueError for one that is not a function
    with a name, cannot be written as JSON, or shares its name with another."""
    out = []
    for t in tools:
        s = getattr(t, "schema", t)
        fn = s.get("function") if isinstance(s, dict) else None
        if not isinstance(fn, dict) or s.get("type") != "function" or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools: {s!r} is not a function schema "
                             '({"type": "function", "function": {"name": ..., "parameters": ...}})')
        json.dumps(s)  # a schema the prompt can show
        out.append(s)
    names = [s["function"]["name"] for s in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"tools: two tools are named {dup[0]!r}")
    return out


def hermes_tools_text(schemas: list[dict]) -> str:
    """The Hermes tools text of function ``schemas``: one JSON line each between ``<tools>`` tags,
    then the ``<tool_call>`` instruction."""
    return HERMES_TOOLS.format(tools="\n".join(json.dumps(s, ensure_ascii=False) for s in schemas))


def checkpoint_format(model_dir: str | os.PathLike[str], *, use: str = "auto", system_prompt: str = "") -> PromptFormat:
    """The format of a checkpoint's chat template (``use``: ``auto``, ``on`` or ``off``, as
    ``task.chat_template``). ValueError naming the field when ``on`` finds no template."""
    template = None if use == "off" else read_chat_template(model_dir)
    if use == "on" and template is None:
        raise ValueError(f"task.chat_template: 'on' needs a chat template in model.base_dir {str(model_dir)!r} "
                         "(chat_template in tokenizer_config.json, or chat_template.jinja), and it has none; "
                         "use 'auto' or 'off' for a plain-text prompt")
    special = tuple(sorted(special_token_names(model_dir).items())) if template is not None else ()
    return PromptFormat(chat_template=template, system_prompt=system_prompt, special_tokens=special)


def prompt_format(task: TaskConfig, model_dir: str | os.PathLike[str]) -> PromptFormat:
    """The run's prompt format: ``PLAIN`` for the arithmetic task, else the checkpoint's
    (``task.chat_template``, ``task.system_prompt``)."""
    if task.kind == "arithmetic":
        return PLAIN
    return checkpoint_format(model_dir, use=task.chat_template, system_prompt=task.system_prompt)


def build_prompt(fmt: PromptFormat, tokenizer, user: str) -> tuple[str, np.ndarray]:
    """The prompt text of the user message ``user`` and its token ids (int32), the one way
    every stage builds a prompt."""
    text = fmt.render(user)
    return text, np.asarray(tokenizer.encode(text), dtype=np.int32)
