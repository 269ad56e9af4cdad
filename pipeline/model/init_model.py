"""Build a randomly initialised Qwen3 checkpoint with a tokenizer trained here, and math prompt files.

No model hub is reachable, so a run on a real tokenizer and a real model size starts
from a directory this module writes: an HF layout (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``) that
``transformers``, vLLM and torchtitan all load like any Qwen3 checkpoint from a hub.

* The tokenizer is a byte-level BPE (Qwen's kind) trained on the given text files, with
  Qwen's special tokens: ``<|endoftext|>`` pads, ``<|im_end|>`` ends a completion.
* Presets: ``tiny`` (~0.2M parameters; tests and CPU lanes), ``qwen3-0.6b`` (Qwen3-0.6B's
  shape: 28 layers, hidden 1024, 16 heads, 8 key/value heads, ~0.6B parameters with the
  151 936-row vocabulary; embeddings untied as every Qwen3 checkpoint of this project) and
  ``smollm2-135m`` (SmolLM2-135M's Llama: 30 layers, hidden 576, 9 heads, 3 key/value heads,
  the 49 152-row vocabulary, tied embeddings, as the imported checkpoint has them).
* :func:`synthetic_math_rows` writes verifiable problems (integer expressions and
  fraction sums, answers in LaTeX) as JSONL or Parquet rows ``{"problem", "answer"}``.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline.tasks.prompting import build_prompt, checkpoint_format

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

IM_START = "<|im_start|>"
"""Opens a turn of ``CHATML``; a special token of the tokenizer when a chat template is written."""

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Qwen's ChatML chat template (without a default system turn), for ``init_model(chat_template=...)``;
its turns end with ``<|im_end|>``, the end-of-sequence token of these checkpoints."""

PRESETS: dict[str, dict] = {
    # head_dim 32: the smallest vLLM-CPU's attention kernels take.
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, max_position_embeddings=512),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, vocab_size=151936),
    "smollm2-135m": dict(arch="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         vocab_size=49152, rope_theta=100_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
}


def preset_config(preset: str, *, vocab_size: int, pad_id: int, eos_id: int):
    """The ``transformers`` config of ``preset`` with at least ``vocab_size`` rows, and its model
    class (``Qwen3ForCausalLM``, or ``LlamaForCausalLM`` for an ``arch="llama"`` preset)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"preset: one of {sorted(PRESETS)}; got {preset!r}")
    shape = dict(PRESETS[preset])
    config_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM),
                             "llama": (LlamaConfig, LlamaForCausalLM)}[shape.pop("arch", "qwen3")]
    settings = {"tie_word_embeddings": False, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, **shape,
                "vocab_size": max(shape.get("vocab_size", 0), vocab_size)}
    config = config_cls(pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None, **settings)
    return config, model_cls


def train_bpe(texts: list[str], *, vocab_size: int, extra_special: tuple[str, ...] = ()):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` with the two special tokens
    (and ``extra_special`` ones after them)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD_TOKEN, EOS_TOKEN, *extra_special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def init_model(out: str | Path, *, preset: str = "tiny", texts: list[str], tokenizer_vocab: int = 512,
               seed: int = 0, dtype: str = "float32", chat_template: str | None = None) -> dict:
    """Write a fresh checkpoint directory; returns its summary (parameters, vocabulary sizes).

    ``dtype`` is what the safetensors hold (``bfloat16`` halves a large model on disk, as hub
    checkpoints ship); every engine of the project loads it in its own compute dtype.
    ``chat_template`` (a Jinja chat template, e.g. ``CHATML``) is written into
    ``tokenizer_config.json``, as chat checkpoints ship it (with ``<|im_start|>`` a special token
    of the tokenizer); None writes none."""
    import torch

    from pipeline.model.qwen import _no_hf_progress_bars

    if preset not in PRESETS:
        raise ValueError(f"preset: one of {sorted(PRESETS)}; got {preset!r}")
    if not texts:
        raise ValueError("init_model needs text to train the tokenizer on")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(texts, vocab_size=tokenizer_vocab, extra_special=(IM_START,) if chat_template is not None else ())
    pad_id, eos_id = tok.token_to_id(PAD_TOKEN), tok.token_to_id(EOS_TOKEN)
    config, model_cls = preset_config(preset, vocab_size=tok.get_vocab_size(), pad_id=pad_id, eos_id=eos_id)
    vocab = config.vocab_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).float()
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    with _no_hf_progress_bars():
        model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        **({"chat_template": chat_template} if chat_template is not None else {})}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}) + "\n")
    n_params = sum(p.numel() for p in model.parameters())
    summary = {"preset": preset, "parameters": n_params, "model_vocab": vocab,
               "tokenizer_vocab": tok.get_vocab_size(), "eos_id": eos_id, "pad_id": pad_id}
    (out / "init.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _latex(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def synthetic_math_rows(n: int, *, seed: int = 0) -> list[dict]:
    """``n`` distinct problems with LaTeX answers: integer expressions and sums of two fractions."""
    rng = random.Random(seed)
    rows: list[dict] = []
    seen: set[str] = set()
    while len(rows) < n:
        if rng.random() < 0.5:
            a, b, c = rng.randint(2, 30), rng.randint(2, 30), rng.randint(2, 12)
            op = rng.choice(["+", "-"])
            problem = f"Compute {a} {op} {b} \\times {c}."
            answer = str(a + b * c if op == "+" else a - b * c)
        else:
            p, q = Fraction(rng.randint(1, 9), rng.randint(2, 9)), Fraction(rng.randint(1, 9), rng.randint(2, 9))
            problem = f"What is $\\frac{{{p.numerator}}}{{{p.denominator}}} + \\frac{{{q.numerator}}}{{{q.denominator}}}$?"
            answer = _latex(p + q)
        if problem not in seen:
            seen.add(problem)
            rows.append({"problem": problem, "answer": answer})
    return rows


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """``rows`` as ``.jsonl`` or ``.parquet`` (by the suffix)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        raise ValueError(f"{path}: write .jsonl or .parquet")
    return path


def corpus(rows: list[dict], *, prompt_field: str = "problem", answer_field: str = "answer") -> list[str]:
    """Text a tokenizer for these rows should cover: problems, boxed answers, and the digits."""
    return [str(r[prompt_field]) for r in rows] + [f"The answer is \\boxed{{{r[answer_field]}}}." for r in rows] + \
        ["0123456789 +-*/=()$\\{}^_.,?"]


def warm_up(directory: str | Path, rows: list[dict], *, template: str, steps: int, batch_size: int = 32,
            lr: float = 3e-3, seed: int = 0, prompt_field: str = "problem", answer_field: str = "answer",
            system_prompt: str = "", progress=None) -> dict:
    r"""Supervised warm-up in place: teacher-force ``template(problem)`` -> ``The answer is \boxed{answer}.<eos>``.

    Gives a fresh checkpoint the answer format (and some answers) so RL on the math task
    has reward variance to work with; the loss is the completion tokens' mean negative
    log-likelihood, through the same ragged scoring the trainer uses. The prompt is built
    as a run with ``task.chat_template = "auto"`` and ``system_prompt`` builds it
    (``pipeline.tasks.prompting``): through the checkpoint's chat template when it has one.
    """
    import torch

    from pipeline.model.qwen import load_checkpoint, ragged_completion_logprobs, save_checkpoint
    model, tok = load_checkpoint(directory)
    fmt = checkpoint_format(directory, use="auto", system_prompt=system_prompt)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses: list[float] = []
    for step in range(steps):
        batch = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
        prompts = [torch.from_numpy(build_prompt(fmt, tok, template.replace("{problem}", str(r[prompt_field])))[1])
                   .long() for r in batch]
        comps = [tok.encode(f" The answer is \\boxed{{{r[answer_field]}}}.") + [tok.eos_id] for r in batch]
        width = max(len(c) for c in comps)
        ids = torch.full((len(comps), width), tok.pad_id, dtype=torch.long)
        mask = torch.zeros((len(comps), width))
        for i, c in enumerate(comps):
            ids[i, : len(c)] = torch.tensor(c)
            mask[i, : len(c)] = 1
        logp = ragged_completion_logprobs(model, prompts, ids, pad_id=tok.pad_id)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, steps, float(loss.detach()))
    model.eval()
    save_checkpoint(model, tok, directory, tokenizer_dir=directory)
    return {"warmup_steps": steps, "warmup_final_loss": sum(losses[-10:]) / max(1, len(losses[-10:]))}
