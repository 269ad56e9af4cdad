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
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

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

    def render(self, user: str) -> str:
        """The prompt text of one user message."""
        if self.chat_template is None:
            return f"{self.system_prompt}\n\n{user}" if self.system_prompt else user
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": user})
        return render_chat(self.chat_template, messages, **dict(self.special_tokens))


PLAIN = PromptFormat()
"""The user message as it is (the arithmetic task; a checkpoint without a chat template)."""


def render_chat(template: str, messages: list[dict[str, str]], **special_tokens: str) -> str:
    """``messages`` through the Jinja chat ``template`` with the generation prompt, as
    ``apply_chat_template(..., add_generation_prompt=True, tokenize=False)`` renders them."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                        add_generation_prompt=True, **special_tokens)
    return rendered[0]


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
