"""``lm_judge[:<dir>|<endpoint>][@<style>]``: ask a language model whether a completion is right; score P(yes).

Every judge asks a yes/no question about (prompt, completion), reads the log-probabilities
of the *next token* only, and scores

    P(yes) = Σ_{t ∈ yes} p(t) / (Σ_{t ∈ yes} p(t) + Σ_{t ∈ no} p(t))

so the score is in [0, 1] whatever else the model would have said. Where the question
cannot be asked the judge abstains (NaN).

Specs
-----

==========================================  ======================================================
``lm_judge``                                the project's character policy (``artifacts/base-model``)
``lm_judge:<dir>``                          the checkpoint in ``<dir>``: a character policy, or an HF
                                            chat model asked in style ``direct``
``lm_judge:<dir>@<style>``                  an HF chat model asked in ``<style>`` (``STYLES``)
``lm_judge:tcp://<host>:<port>[@<style>]``  the same, through a judge server (``pipeline judge-serve``,
                                            ``pipeline.verifiers.judge_server``); also ``ipc://<path>``
==========================================  ======================================================

Each style is its own weak verifier: list several (``lm_judge:<dir>@direct``,
``lm_judge:<dir>@compare``, ...) in ``verifier.verifiers`` and Weaver learns each one's
TPR and TNR. An unknown style is refused when the config is checked, before anything
starts, with the list of styles. The style is whatever follows the *last* ``@``, so a
directory whose name contains ``@`` needs an explicit style (``<dir>@direct``).

HF chat judges
--------------

Any local ``AutoModelForCausalLM`` directory (safetensors) whose tokenizer has a chat
template (``chat_template`` in ``tokenizer_config.json`` or ``chat_template.jinja``), such
as SmolLM2-135M-Instruct, Qwen3 or Llama instruct models. The question is one user message,
rendered with the chat template and ``add_generation_prompt=True``; the yes tokens are
those of ``Yes``, `` Yes``, ``yes``, `` yes``, ``YES``, `` YES`` that are single tokens
of the vocabulary, and the same for No. The styles (``STYLES``):

* ``direct``: problem, proposed solution, "Is the answer correct? Answer Yes or No."
* ``stepwise``: the same, asked to check the final answer step by step before answering;
  still scored on the first token, so it measures the model's prior after that instruction.
* ``grader``: a strict-grader rubric (Yes only for an exactly right final answer).
* ``compare``: only the problem and the completion's extracted final answer (the last
  ``\\boxed{}``, else the last number); abstains when the completion states none.

All completions of one call are scored in one left-padded forward (attention mask,
position ids from the mask, logits of the last position only), in chunks of at most
``MAX_BATCH``; padding does not change a score. The checkpoint is loaded once per process,
on the first group (inside the verifier's deadline), and shared by every style naming the
same directory. A question longer than ``MAX_QUESTION_TOKENS`` (or the model's context) is
cut from the *left of the completion*, keeping its end, where the final answer is, after
``...``; a question that does not fit even so (an over-long prompt) abstains.

For several verifier replicas on one host, run one judge server (``pipeline judge-serve
<dir> --endpoint tcp://127.0.0.1:5600``) and name it in the spec instead of the directory:
the server holds the only copy of the model and batches the questions of all replicas
into shared forwards. A client waits at most ``$RLPIPE_JUDGE_TIMEOUT_S`` (default 8 s) for
a connection and for the answer, then raises a clear error; the verifier stage counts
that as an abstention.

The character policy
--------------------

``TorchCharBackend`` runs the project's torch policy (``pipeline.model.qwen``: the same
checkpoint loader and the same forward pass as the first step of ``sample``). Its alphabet
is digits and ``+*= ``, so it cannot read a question at all: its question is the prompt
followed by the completion, "yes" is ending the answer right there (``<eos>``) and "no" is
writing another digit. P(yes) is how much the policy itself would stop at this answer,
which mostly checks the length and the policy's own confidence. Styles do not apply to it.

Other backends implement ``JudgeBackend`` (``question``, ``yes`` / ``no`` token strings,
``next_token_logprobs``: the shape of vLLM's ``SamplingParams(max_tokens=1, logprobs=k)``
output) and are scored by :func:`judge`.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

DEFAULT_DIR = "artifacts/base-model"
"""Checkpoint ``lm_judge`` without an argument uses (the base policy)."""

DEFAULT_STYLE = "direct"
"""Style of an HF chat judge named without ``@<style>``."""

MAX_BATCH = 32
"""Questions per forward pass of an in-process judge (a group of G completions is one call)."""

MAX_QUESTION_TOKENS = 1024
"""Longest question (chat-templated, in tokens) a judge asks; longer completions are cut from the left."""

TRUNCATION_MARK = "... "
"""What replaces the cut-off beginning of an over-long completion."""

YES_VARIANTS = ("Yes", " Yes", "yes", " yes", "YES", " YES")
NO_VARIANTS = ("No", " No", "no", " no", "NO", " NO")

ENDPOINT_SCHEMES = ("tcp://", "ipc://")
"""Spec arguments starting with these name a judge server instead of a directory."""


@dataclass(frozen=True)
class Style:
    """One way of asking the judge: a user-message template with ``{prompt}`` and ``{completion}``
    (or ``{answer}``, the completion's extracted final answer, when ``uses_answer``)."""

    help: str
    template: str
    uses_answer: bool = False


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
}
"""The question styles of HF chat judges, by the name after ``@``."""


# ----------------------------------------------------------------------------- specs


def is_endpoint(target: str | None) -> bool:
    return bool(target) and target.startswith(ENDPOINT_SCHEMES)


def parse_arg(arg: str | None) -> tuple[str | None, str | None]:
    """``(target, style)`` of a spec's argument: target is a directory, an endpoint or None
    (the default directory); style is None when the spec names none."""
    if not arg:
        return None, None
    if "@" in arg:
        target, _, style = arg.rpartition("@")
        return target or None, style
    return arg, None


def check_style(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"unknown lm_judge style {style!r}; styles: {sorted(STYLES)} "
                         "(the style follows the last '@'; a directory containing '@' needs an explicit "
                         "'<dir>@direct')")


def check_arg(arg: str | None) -> None:
    """The kind's spec check (``Kind.check``): a known style, a well-formed endpoint. Touches no file."""
    target, style = parse_arg(arg)
    if style is not None:
        check_style(style)
    if is_endpoint(target):
        from pipeline.verifiers.judge_client import check_endpoint

        check_endpoint(target)
    elif target is not None and target.startswith(("tcp:", "ipc:")):
        raise ValueError(f"lm_judge endpoint {target!r}: write tcp://<host>:<port> or ipc://<path>")


# ----------------------------------------------------------------------------- backends (generic)


class JudgeBackend(Protocol):
    """What a judge needs from a generator backend."""

    yes: tuple[str, ...]
    """Next tokens that mean yes."""
    no: tuple[str, ...]
    """Next tokens that mean no."""

    def question(self, prompt: str, completion: str) -> str | None:
        """The text whose next token answers "is this completion right?"; None if it cannot be encoded."""

    def next_token_logprobs(self, texts: Sequence[str]) -> list[dict[str, float]]:
        """Per text, next-token log-probabilities by token string (at least the yes and no tokens)."""


class TorchCharBackend:
    """The project's torch policy (character tokenizer) as a judge backend; see the module docstring."""

    def __init__(self, directory: str | Path):
        import torch

        from pipeline.model.qwen import load_checkpoint

        self._torch = torch
        self.model, self.tokenizer = load_checkpoint(directory)
        vocab = self.tokenizer.tokens
        self.yes = (vocab[self.tokenizer.eos_id],)
        self.no = tuple(t for t in vocab if t.isdigit())

    def question(self, prompt: str, completion: str) -> str | None:
        text = prompt + completion.strip()
        try:
            self.tokenizer.encode(text)
        except ValueError:
            return None
        if len(text) >= self.model.config.max_position_embeddings:
            return None
        return text

    def next_token_logprobs(self, texts: Sequence[str]) -> list[dict[str, float]]:
        torch = self._torch
        from pipeline.model.qwen import encode_prompts

        out: list[dict[str, float]] = [{} for _ in texts]
        by_len: dict[int, list[int]] = {}
        for i, t in enumerate(texts):
            by_len.setdefault(len(t), []).append(i)  # no attention mask: one forward per length
        vocab = self.tokenizer.tokens
        with torch.no_grad():
            for idx in by_len.values():
                ids = encode_prompts(self.tokenizer, [texts[i] for i in idx])
                logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1, :].float()
                logp = torch.log_softmax(logits, dim=-1).numpy()
                for row, i in enumerate(idx):
                    out[i] = {tok: float(logp[row, k]) for k, tok in enumerate(vocab)}
        return out


def p_yes(logprobs: dict[str, float], yes: Sequence[str], no: Sequence[str]) -> float:
    """P(yes) renormalised over the yes and no tokens present; NaN if none is present."""
    py = sum(math.exp(logprobs[t]) for t in yes if t in logprobs)
    pn = sum(math.exp(logprobs[t]) for t in no if t in logprobs)
    return py / (py + pn) if py + pn > 0 else float("nan")


def judge(backend: JudgeBackend, prompt: str, completions: Sequence[str]) -> np.ndarray:
    """float32 [G] P(yes) per completion (NaN where the backend cannot ask)."""
    questions = [backend.question(prompt, c) for c in completions]
    asked = [i for i, q in enumerate(questions) if q is not None]
    out = np.full(len(completions), np.nan, dtype=np.float32)
    if asked:
        for i, lp in zip(asked, backend.next_token_logprobs([questions[i] for i in asked])):
            out[i] = p_yes(lp, backend.yes, backend.no)
    return out


# ----------------------------------------------------------------------------- HF chat judges

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def final_answer(completion: str) -> str | None:
    r"""The completion's final answer for the ``compare`` style: the last ``\boxed{}``, else the
    last number in it; None when it states neither."""
    from pipeline.tasks.math import boxed_answer

    boxed = boxed_answer(completion)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def render(style: str, prompt: str, completion: str) -> str | None:
    """The user message of ``style`` about (prompt, completion); None when it cannot be asked
    (``compare`` on a completion without a final answer)."""
    st = STYLES[style]
    if st.uses_answer:
        answer = final_answer(completion)
        if answer is None:
            return None
        return st.template.format(prompt=prompt.strip(), answer=answer)
    return st.template.format(prompt=prompt.strip(), completion=completion.strip())


class ChatJudgeUnavailable(RuntimeError):
    """The checkpoint cannot serve as a chat judge; the message says why."""


class ChatJudge:
    """An HF chat checkpoint as a yes/no judge: renders, truncates, batches, scores P(yes).

    Thread-safe: one lock serialises the tokenizer and the forward, so the styles of one
    process (and late threads of a verifier past its deadline) share one copy of the model.
    ``forwards`` and ``questions`` count the model calls and the questions they scored.
    """

    def __init__(self, directory: str | Path, *, max_batch: int = MAX_BATCH, max_tokens: int = MAX_QUESTION_TOKENS,
                 device: str = "cpu"):
        import torch
        from transformers import AutoTokenizer

        from pipeline.model.qwen import _no_hf_progress_bars, load_checkpoint

        d = Path(directory)
        self.directory = str(d)
        if not ((d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file()):
            raise FileNotFoundError(f"lm_judge: no model.safetensors in {str(d)!r}")
        try:
            with _no_hf_progress_bars():
                self.tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - one clear message
            raise ChatJudgeUnavailable(f"lm_judge {str(d)!r}: cannot load its tokenizer: "
                                       f"{type(exc).__name__}: {exc}") from exc
        self.tokenizer.model_max_length = 1 << 62  # questions are cut here (encode), not by the tokenizer
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatJudgeUnavailable(f"lm_judge {str(d)!r}: the tokenizer has no chat template (chat_template "
                                       "in tokenizer_config.json or chat_template.jinja); a chat judge needs an "
                                       "instruct model")
        self.yes_ids = self._single_token_ids(YES_VARIANTS)
        self.no_ids = self._single_token_ids(NO_VARIANTS)
        if not self.yes_ids or not self.no_ids:
            raise ChatJudgeUnavailable(f"lm_judge {str(d)!r}: no single-token yes/no in the vocabulary "
                                       f"(yes ids {self.yes_ids}, no ids {self.no_ids})")
        self.model, _ = load_checkpoint(d)
        self.device = torch.device(device)
        self.model.to(self.device)
        context = int(getattr(self.model.config, "max_position_embeddings", max_tokens) or max_tokens)
        self.max_tokens = min(max_tokens, context)
        self.max_batch = max(1, int(max_batch))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        self._torch = torch
        self._yes = torch.tensor(self.yes_ids, device=self.device)
        self._no = torch.tensor(self.no_ids, device=self.device)
        self._lock = threading.RLock()
        self.forwards = 0
        self.questions = 0

    def _single_token_ids(self, variants: Sequence[str]) -> list[int]:
        ids: list[int] = []
        for v in variants:
            enc = self.tokenizer.encode(v, add_special_tokens=False)
            if len(enc) == 1 and enc[0] not in ids:
                ids.append(int(enc[0]))
        return ids

    @property
    def yes_tokens(self) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(self.yes_ids)

    @property
    def no_tokens(self) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(self.no_ids)

    def _ids(self, message: str) -> list[int]:
        # enable_thinking=False: templates with a thinking switch (Qwen3) open the answer at once;
        # templates without one ignore it.
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                                  tokenize=False, enable_thinking=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, style: str, prompt: str, completion: str) -> list[int] | None:
        """Token ids of the chat-templated question, cut to ``max_tokens`` from the left of the
        completion; None when it cannot be asked."""
        check_style(style)
        with self._lock:
            message = render(style, prompt, completion)
            if message is None:
                return None
            ids = self._ids(message)
            if len(ids) <= self.max_tokens:
                return ids
            if STYLES[style].uses_answer:
                return None  # the prompt alone is too long
            body = self.tokenizer.encode(completion.strip(), add_special_tokens=False)
            keep = self.max_tokens - len(self._ids(render(style, prompt, TRUNCATION_MARK)))
            for _ in range(4):  # re-tokenising the cut text may merge differently; shave until it fits
                if keep <= 0:
                    return None
                tail = TRUNCATION_MARK + self.tokenizer.decode(body[-keep:])
                ids = self._ids(render(style, prompt, tail))
                if len(ids) <= self.max_tokens:
                    return ids
                keep -= len(ids) - self.max_tokens
            return None

    def p_yes_ids(self, seqs: Sequence[Sequence[int]]) -> np.ndarray:
        """float64 [N] P(yes) of each question (token ids), in left-padded forwards of at most ``max_batch``."""
        torch = self._torch
        out = np.full(len(seqs), np.nan, dtype=np.float64)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths share a forward
        with self._lock, torch.no_grad():
            for start in range(0, len(order), self.max_batch):
                idx = order[start:start + self.max_batch]
                width = max(len(seqs[i]) for i in idx)
                ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for row, i in enumerate(idx):
                    n = len(seqs[i])
                    ids[row, width - n:] = torch.as_tensor(seqs[i], dtype=torch.long)
                    mask[row, width - n:] = 1
                positions = (mask.cumsum(-1) - 1).clamp(min=0)
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                    position_ids=positions.to(self.device), use_cache=False,
                                    logits_to_keep=1).logits[:, -1, :].double()
                ly = torch.logsumexp(logits[:, self._yes], dim=-1)
                ln = torch.logsumexp(logits[:, self._no], dim=-1)
                out[idx] = torch.sigmoid(ly - ln).cpu().numpy()
                self.forwards += 1
                self.questions += len(idx)
        return out

    def score(self, style: str, prompt: str, completions: Sequence[str]) -> np.ndarray:
        """float32 [G] P(yes) of each completion in ``style`` (NaN where it cannot be asked)."""
        seqs = [self.encode(style, prompt, c) for c in completions]
        asked = [i for i, s in enumerate(seqs) if s is not None]
        out = np.full(len(completions), np.nan, dtype=np.float32)
        if asked:
            out[asked] = self.p_yes_ids([seqs[i] for i in asked])
        return out


# ----------------------------------------------------------------------------- one engine per directory

_ENGINES: dict[str, object] = {}
"""Loaded judges (or the reason one cannot load) by resolved directory."""
_ENGINES_LOCK = threading.Lock()


def engine(directory: str | Path) -> ChatJudge | TorchCharBackend:
    """The process's judge for a checkpoint directory, loaded on first use and shared by every
    spec that names it: a ``TorchCharBackend`` for a character policy, else a ``ChatJudge``."""
    from pipeline.model.tokenizer import is_char_tokenizer

    d = Path(directory)
    key = str(d.resolve())
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            if not ((d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file()):
                raise FileNotFoundError(f"lm_judge: no model.safetensors in {str(d)!r}")  # may appear later
            try:
                _ENGINES[key] = TorchCharBackend(d) if is_char_tokenizer(d) else ChatJudge(d)
            except ChatJudgeUnavailable as exc:
                _ENGINES[key] = exc  # not retried on every group: the same reason each time
        e = _ENGINES[key]
        if isinstance(e, Exception):
            raise ChatJudgeUnavailable(str(e))
        return e  # type: ignore[return-value]


def build(arg: str | None, *, backend: JudgeBackend | None = None) -> object:
    target, style = parse_arg(arg)
    if style is not None:
        check_style(style)
    if backend is not None:
        return lambda prompt, completions: judge(backend, prompt, completions)
    if is_endpoint(target):
        from pipeline.verifiers.judge_client import JudgeClient

        client = JudgeClient(target)

        def lm_judge_remote(prompt: str, completions: Sequence[str]) -> np.ndarray:
            return client.score(style or DEFAULT_STYLE, prompt, completions)

        return lm_judge_remote
    directory = target or DEFAULT_DIR

    def lm_judge(prompt: str, completions: Sequence[str]) -> np.ndarray:
        e = engine(directory)  # loaded on first use, inside the verifier's deadline
        if isinstance(e, ChatJudge):
            return e.score(style or DEFAULT_STYLE, prompt, completions)
        if style is not None:
            raise ValueError(f"lm_judge {directory!r} is a character policy: it cannot read a question, so "
                             f"style {style!r} does not apply (name it without '@{style}')")
        return judge(e, prompt, completions)

    return lm_judge
