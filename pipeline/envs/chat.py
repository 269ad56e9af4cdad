"""Chat-native episodes: an environment's observations enter a chat model's context as turns of
its chat template.

With a chat template (``task.chat_template`` ``auto`` or ``on`` and a checkpoint that has one,
pipeline.tasks.prompting), an observation is a turn of the role the environment gives it
(``Step.role``: ``user`` by default, ``tool`` when the step was a tool call), rendered by the
template *incrementally*: its token ids are the template's text between the end of the
model's turn (its sampled eos) and the start of the model's next turn, generation prompt
included. So the whole sequence (prompt, sampled turns, observations) is the tokenisation of
the template's rendering of the same conversation, while the model's own tokens are never
re-tokenised.

The text around an observation of each role is derived once per template, by rendering a
probe conversation and slicing it; a template whose rendering of a longer conversation does
not extend that of a shorter one (or whose assistant turn does not end with the eos token)
is refused, naming ``task.chat_template``.

The reset text (the environment's first observation) is a user turn of its own before the
model's first turn: the prompt's generation prompt moves from the prompt to each episode's
first observation (``<|im_end|>\\n`` then ``<|im_start|>user\\n{reset}<|im_end|>\\n<|im_start|>
assistant\\n``), masked like every observation; a group whose episodes all reset to ``""``
keeps its prompt as it is. Without a template the observations are appended as their raw
encoding (``pipeline.envs.base.encode_text``), the reset text right after the prompt.

Tools (pipeline.envs.tools): for a factory that declares tools, :meth:`ChatTurns.for_factory`
gives the turns of the format showing them, and :meth:`ChatTurns.first` renders each group's
prompt again from its text with them (the feeder's prompt carries none). A step with several
turns of its own (``Step.messages``: one ``tool`` turn per call, with the call's name and id)
is rendered the same way as one observation (:meth:`ChatTurns.turns`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipeline.tasks.prompting import PromptFormat, function_schemas

_USER, _ASSISTANT, _OBS = "PROBE-USER-7f3a", "PROBE-ASSISTANT-7f3a", "PROBE-OBSERVATION-7f3a"
"""Probe contents: words no template writes, each found once in a rendering."""


class ChatTemplateError(ValueError):
    """The chat template cannot render an episode's turns incrementally."""


def _render(fmt: PromptFormat, messages: list[dict], *, generation: bool) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[fmt.messages(messages)], chat_template=fmt.chat_template,
                                        add_generation_prompt=generation, **fmt.template_kwargs())
    return rendered[0]


def _split(text: str, marker: str, what: str) -> tuple[str, str]:
    if text.count(marker) != 1:
        raise ChatTemplateError(f"task.chat_template: the checkpoint's chat template does not render {what} "
                                "as its content once; set task.chat_template to 'off' for raw observations")
    before, after = text.split(marker)
    return before, after


class ChatTurns:
    """The token ids of an episode's observations as turns of a chat template (``of`` builds
    one for a :class:`~pipeline.tasks.prompting.PromptFormat`, None without a template)."""

    def __init__(self, fmt: PromptFormat, tokenizer) -> None:
        self.fmt, self.tok = fmt, tokenizer
        self._roles: dict[str, tuple[str, str]] = {}
        eos = dict(fmt.special_tokens).get("eos_token")
        if not eos or list(tokenizer.encode(eos)) != [tokenizer.eos_id]:
            raise ChatTemplateError(f"task.chat_template: the checkpoint's eos token {eos!r} is not the one token "
                                    f"id {tokenizer.eos_id} the model ends its turn with; set task.chat_template "
                                    "to 'off' for raw observations")
        user = [{"role": "user", "content": _USER}]
        prompt = _render(fmt, user, generation=False)
        prompted = _render(fmt, user, generation=True)
        if not prompted.startswith(prompt):
            raise self._unstable("the prompt with its generation prompt", "without it")
        self.generation = prompted[len(prompt):]
        """The generation prompt's text (``<|im_start|>assistant\\n``)."""
        self.generation_ids = list(tokenizer.encode(self.generation))
        if list(tokenizer.encode(prompted)) != list(tokenizer.encode(prompt)) + self.generation_ids:
            raise self._unstable("the prompt's tokens", "the tokens of its text and its generation prompt")
        answered = _render(fmt, [*user, {"role": "assistant", "content": _ASSISTANT}], generation=False)
        turn = prompted + _ASSISTANT + eos
        if not answered.startswith(prompted):
            raise self._unstable("a conversation with the model's turn", "the prompt")
        if not answered.startswith(turn):
            raise ChatTemplateError("task.chat_template: the checkpoint's chat template does not render the "
                                    f"model's turn as its text followed by the eos token {eos!r}; set "
                                    "task.chat_template to 'off' for raw observations")
        if list(tokenizer.encode(turn)) != (list(tokenizer.encode(prompted)) + list(tokenizer.encode(_ASSISTANT))
                                            + [tokenizer.eos_id]):
            raise self._unstable("a model turn's tokens", "its sampled tokens")
        self._probe, self._turn = [*user, {"role": "assistant", "content": _ASSISTANT}], turn
        opened = _render(fmt, [*user, {"role": "user", "content": _OBS}], generation=True)
        if not opened.startswith(prompt):
            raise self._unstable("the prompt followed by a user turn", "the prompt")
        self.reset_wrap = _split(opened[len(prompt):], _OBS, "a user turn after the prompt")
        """The text before and after the reset text (its own user turn, generation prompt included)."""
        reset_ids = self._encode_wrapped(_OBS, self.reset_wrap)
        if list(tokenizer.encode(opened)) != list(tokenizer.encode(prompt)) + reset_ids:
            raise self._unstable("the prompt and the reset turn's tokens", "their tokens apart")
        self.wrap("user")

    @staticmethod
    def _unstable(longer: str, shorter: str) -> ChatTemplateError:
        return ChatTemplateError(f"task.chat_template: the checkpoint's chat template is not prefix-stable ({longer} "
                                 f"does not extend {shorter}), so an episode's turns cannot be appended as tokens; "
                                 "set task.chat_template to 'off' for raw observations")

    @classmethod
    def of(cls, fmt: PromptFormat, tokenizer) -> ChatTurns | None:
        """The turns of ``fmt``'s chat template; None for a plain-text format (raw observations)."""
        return None if fmt.chat_template is None else cls(fmt, tokenizer)

    def for_factory(self, factory) -> ChatTurns:
        """These turns with the prompt showing the tools an environment's factory declares (its
        ``tools`` attribute, pipeline.envs.tools); ``self`` when it declares none."""
        schemas = function_schemas(getattr(factory, "tools", None) or ())
        return ChatTurns(self.fmt.with_tools(schemas), self.tok) if schemas else self

    def tools_prompt(self, text: str, prompt_ids: np.ndarray) -> np.ndarray:
        """The token ids of a prompt rendered again showing this format's tools, from its
        ``text``: the prompt as the format rendered it without tools (the feeder's record), or
        the user message it rendered (the held-out items the trainer hands over), whichever
        renders to ``prompt_ids``."""
        plain = replace(self.fmt, tools=())
        user = plain.user_of(text)
        if user is None and list(self.tok.encode(plain.render(text))) == [int(x) for x in prompt_ids]:
            user = text
        if user is None:
            raise ChatTemplateError("task.chat_template: the prompt is not one the chat template rendered from a "
                                    "user message, so it cannot be rendered again with the environment's tools")
        return np.asarray(self.tok.encode(self.fmt.render(user)), dtype=np.int32)

    def _encode_wrapped(self, text: str, wrap: tuple[str, str]) -> list[int]:
        return list(self.tok.encode(wrap[0] + text + wrap[1]))

    def wrap(self, role: str) -> tuple[str, str]:
        """The text before and after an observation of ``role`` that follows the model's turn
        (from right after its eos to the next generation prompt's end), derived on first use."""
        if role not in self._roles:
            what = f"a {role!r} turn after the model's"
            try:
                full = _render(self.fmt, [*self._probe, {"role": role, "content": _OBS}], generation=True)
            except Exception as e:  # noqa: BLE001 - the template's own refusal (an unknown role), reported as such
                raise ChatTemplateError(f"task.chat_template: the checkpoint's chat template cannot render {what}: "
                                        f"{type(e).__name__}: {e}") from None
            if not full.startswith(self._turn):
                raise self._unstable(f"a conversation with {what}", "the model's turn")
            wrap = _split(full[len(self._turn):], _OBS, what)
            if list(self.tok.encode(full)) != list(self.tok.encode(self._turn)) + self._encode_wrapped(_OBS, wrap):
                raise self._unstable(f"the tokens of {what}", "the model's turn's")
            self._roles[role] = wrap
        return self._roles[role]

    def observation(self, text: str, role: str = "user") -> list[int]:
        """The token ids appended after the model's turn (which ended with its eos): ``text``
        as a ``role`` turn, then the generation prompt of the model's next turn."""
        return self._encode_wrapped(text, self.wrap(role))

    def turns(self, messages) -> list[int]:
        """The token ids appended after the model's turn for several turns of their own
        (message dicts: a tool result's ``name`` and ``tool_call_id`` beside ``role`` and
        ``content``), then the generation prompt: the template's rendering of the conversation
        with them, minus its rendering up to the end of the model's turn."""
        what = "the turns " + ", ".join(repr(m.get("role")) for m in messages) + " after the model's"
        try:
            full = _render(self.fmt, [*self._probe, *messages], generation=True)
        except Exception as e:  # noqa: BLE001 - the template's own refusal, reported as such
            raise ChatTemplateError(f"task.chat_template: the checkpoint's chat template cannot render {what}: "
                                    f"{type(e).__name__}: {e}") from None
        if not full.startswith(self._turn):
            raise self._unstable(f"a conversation with {what}", "the model's turn")
        ids = list(self.tok.encode(full[len(self._turn):]))
        if list(self.tok.encode(full)) != list(self.tok.encode(self._turn)) + ids:
            raise self._unstable(f"the tokens of {what}", "the model's turn's")
        return ids

    def step_ids(self, step) -> list[int]:
        """The token ids of a step's observation: its ``messages`` as turns of their own where it
        has them (:meth:`turns`), else its text as one turn of its role (:meth:`observation`)."""
        if step.messages:
            return self.turns(step.messages)
        return self.observation(step.observation, step.turn_role)

    def first(self, prompt_ids: np.ndarray, resets: list[str], text: str | None = None,
              ) -> tuple[np.ndarray, list[list[int]]]:
        """A group's prompt and its episodes' first observations, from their reset texts: all
        empty, the prompt as it is and no observation; else the prompt without its generation
        prompt, and each episode's reset text as a user turn followed by the generation prompt
        (only the generation prompt for an empty one). With tools (:meth:`for_factory`) the
        prompt is first rendered again from its ``text`` showing them (:meth:`tools_prompt`)."""
        if self.fmt.tools:
            if text is None:
                raise ChatTemplateError("task.chat_template: the environment's tools are shown by rendering the "
                                        "prompt again, and its text was not given")
            prompt_ids = self.tools_prompt(text, prompt_ids)
        if not any(resets):
            return prompt_ids, [[] for _ in resets]
        g = len(self.generation_ids)
        if prompt_ids.size <= g or [int(x) for x in prompt_ids[-g:]] != self.generation_ids:
            raise ChatTemplateError("task.chat_template: the prompt does not end with the chat template's "
                                    f"generation prompt {self.generation!r}, so the reset text cannot be a user "
                                    "turn of its own")
        firsts = [self._encode_wrapped(r, self.reset_wrap) if r else list(self.generation_ids) for r in resets]
        return prompt_ids[:-g], firsts
