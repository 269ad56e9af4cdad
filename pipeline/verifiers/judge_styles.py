"""The question styles of a language-model judge (``lm_judge:...@<style>``): the built-in ones
(``STYLES``) and styles of one's own in TOML files (``make_style`` checks their fields).

The in-process judge (``pipeline.verifiers.kinds.lm_judge``), its client (``judge_client``: a
style file is read there and sent whole) and the judge server read them here.
"""

from __future__ import annotations

import dataclasses
import functools
import string
import tomllib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Style:
    """One way of asking the judge.

    ``kind = "yes_no"``: the template is a question about (prompt, completion) and the score is
    the next token's P(yes). ``kind = "likelihood"``: the template is the text *before* an
    answer (it names no ``{completion}`` or ``{answer}``) and the score is the probability that
    the judge, reading it, states exactly the completion's final answer followed by ``end``:
    P(answer) = exp Σ log p(token), over the answer's tokens and the end's.

    Placeholders: ``{question}`` (the user message of a chat-rendered prompt, else the prompt),
    ``{prompt}`` (the prompt as the policy read it), ``{completion}``, ``{answer}`` (the
    completion's extracted final answer; a style that needs one abstains where it has none).
    """

    help: str
    template: str
    uses_answer: bool = False
    kind: str = "yes_no"
    """``yes_no`` or ``likelihood``."""
    chat: bool = True
    """Render the template as one user message with the checkpoint's chat template (after an
    optional ``system`` message); False: the template's text as it is (base models, few-shot text)."""
    system: str = ""
    """A system message before the question (chat styles only)."""
    end: str | None = None
    """``likelihood``: what must follow the answer (None: the tokenizer's end-of-sequence token for
    chat styles, a newline for plain ones)."""

    def fields(self) -> set[str]:
        return {f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None}

    def as_dict(self) -> dict:
        """The fields ``make_style`` reads back (what a client sends a judge server for a style file)."""
        d = dataclasses.asdict(self)
        del d["uses_answer"]
        return d


PLACEHOLDERS = frozenset({"question", "prompt", "completion", "answer"})
"""What a style's template may name."""

KINDS = ("yes_no", "likelihood")


def make_style(fields: dict, *, where: str) -> Style:
    """A ``Style`` from a style file's (or a request's) fields; ValueError naming ``where`` and the field."""
    allowed = {f.name for f in dataclasses.fields(Style)} - {"uses_answer"}
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; a style has {sorted(allowed)}")
    kind = fields.get("kind", "yes_no")
    if kind not in KINDS:
        raise ValueError(f"{where}: kind must be one of {list(KINDS)}, got {kind!r}")
    template = fields.get("template")
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"{where}: template must be a non-empty string")
    for name, typ in (("help", str), ("system", str), ("chat", bool)):
        if name in fields and not isinstance(fields[name], typ):
            raise ValueError(f"{where}: {name} must be a {typ.__name__}, got {fields[name]!r}")
    end = fields.get("end")
    if end is not None and not isinstance(end, str):
        raise ValueError(f"{where}: end must be a string, got {end!r}")
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"{where}: template: {e} (write {{{{ and }}}} for literal braces)") from None
    bad = sorted(names - PLACEHOLDERS)
    if bad:
        raise ValueError(f"{where}: template names {bad}; placeholders are {sorted(PLACEHOLDERS)}")
    if kind == "likelihood" and names & {"completion", "answer"}:
        raise ValueError(f"{where}: a likelihood template is the text before the answer; it cannot name "
                         f"{sorted(names & {'completion', 'answer'})}")
    if kind == "yes_no" and not names & {"completion", "answer"}:
        raise ValueError(f"{where}: a yes_no template must show the judged completion ({{completion}} or {{answer}})")
    return Style(help=fields.get("help", "") or where, template=template, kind=kind,
                 uses_answer=kind == "likelihood" or "answer" in names, chat=fields.get("chat", True),
                 system=fields.get("system", ""), end=end)


STYLES: dict[str, Style] = {
    "direct": Style(
        "problem and solution; 'Is the answer correct? Answer Yes or No.'",
        "Problem:\n{prompt}\n\nProposed solution:\n{completion}\n\nIs the answer correct? Answer Yes or No."),
    "stepwise": Style(
        "asked to check the final answer step by step, then Yes or No (scored on the first token)",
        "Problem:\n{prompt}\n\nProposed solution:\n{completion}\n\nCheck the final answer step by step: work the "
        "problem out yourself and compare. Then answer Yes if the final answer is correct, or No if it is not."),
    "grader": Style(
        "a strict grader with a rubric",
        "You are a strict grader. Grade the proposed solution to the problem below.\n"
        "Rubric:\n- Yes: the final answer is exactly correct.\n- No: the final answer is wrong, missing or "
        "ambiguous.\n\nProblem:\n{prompt}\n\nProposed solution:\n{completion}\n\nGrade (Yes or No):"),
    "compare": Style(
        "only the problem and the extracted final answer; 'is the final answer right?'",
        "Here is a problem and a proposed final answer.\n\nProblem:\n{prompt}\n\nProposed final answer: {answer}\n\n"
        "Is the final answer right? Answer Yes or No.",
        uses_answer=True),
    "solve": Style(
        "likelihood: P(the judge, asked the question, replies with exactly the completion's final answer)",
        "{question}", uses_answer=True, kind="likelihood", system="Give only the final answer."),
}
"""The built-in question styles of HF judges, by the name after ``@``; a style of one's own is a
TOML file named instead (``@path/to/style.toml``, :func:`style_file`)."""


def is_style_file(style: str) -> bool:
    return style.endswith(".toml")


@functools.lru_cache(maxsize=64)
def _read_style_file(path: str, mtime_ns: int) -> Style:
    try:
        fields = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"lm_judge style file {path!r}: not valid TOML: {e}") from None
    return make_style(fields, where=f"lm_judge style file {path!r}")


def style_file(path: str) -> Style:
    """The style a TOML file defines (fields of ``Style``: ``kind``, ``template``, ``chat``, ``system``,
    ``end``, ``help``); read again when the file changes. ValueError naming the file and the field."""
    try:
        mtime = Path(path).stat().st_mtime_ns
    except OSError as e:
        raise ValueError(f"lm_judge style file {path!r}: cannot read it ({e.strerror})") from None
    return _read_style_file(path, mtime)


def get_style(style: str | Style) -> Style:
    """The ``Style`` a name (``STYLES``) or a style file names."""
    if isinstance(style, Style):
        return style
    if is_style_file(style):
        return style_file(style)
    check_style(style)
    return STYLES[style]


def check_style(style: str) -> None:
    """ValueError unless ``style`` is a built-in style or a readable, valid style file."""
    if is_style_file(style):
        style_file(style)
        return
    if style not in STYLES:
        raise ValueError(f"unknown lm_judge style {style!r}; styles: {sorted(STYLES)}, or a style file "
                         "path/to/style.toml (the style follows the last '@'; a directory containing '@' needs "
                         "an explicit '<dir>@direct')")
