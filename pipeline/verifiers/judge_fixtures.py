"""A tiny random chat checkpoint for the judge's tests and benchmark (no hub, a few seconds on a CPU).

:func:`write_tiny_chat_model` writes an HF directory that loads like any instruct model
from a hub: a ``LlamaForCausalLM`` (random weights, ~60K parameters), a byte-level BPE
``tokenizer.json`` trained here on a few sentences that contain every yes/no variant the
judge looks for, and a ChatML chat template in ``tokenizer_config.json``. Its judgements
are noise; it exists so the batching, padding, server and truncation paths run on a
real tokenizer and a real chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The chat template the tiny model ships (Qwen's / SmolLM2's ChatML, without a default system prompt)."""

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_SENTENCES = [
    "Is the answer correct? Answer Yes or No.",
    "Yes", " Yes", "yes", " yes", "YES", " YES", "No", " No", "no", " no", "NO", " NO",
    "Yes, the answer is correct.", "No, the final answer is wrong.",
    "Check the final answer step by step, then answer Yes or No.",
    "You are a strict grader. Here is the problem and a proposed final answer; is the final answer right?",
    "Problem: 42+317= Proposed answer: 359. The answer is \\boxed{359}.",
    "0123456789 +-*/=()$\\{}^_.,?:;!'\"\n",
]


def write_tiny_chat_model(out: str | Path, *, seed: int = 0, hidden_size: int = 32, layers: int = 2,
                          vocab_size: int = 384, max_positions: int = 512, architecture: str = "llama",
                          chat_template: bool = True) -> Path:
    """Write the tiny chat checkpoint into ``out`` (created) and return it. ``architecture``
    ``"gemma3"`` writes a ``Gemma3ForCausalLM`` instead (Gemma 3's layers: sliding and full
    attention, scaled embeddings); ``chat_template=False`` leaves the template out, as a
    base model ships."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    from pipeline.model.qwen import _no_hf_progress_bars

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_SENTENCES * 20, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    pad_id, eos_id = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    shape = dict(vocab_size=tok.get_vocab_size(), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                 num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 max_position_embeddings=max_positions, tie_word_embeddings=False, pad_token_id=pad_id,
                 eos_token_id=eos_id, bos_token_id=None, rms_norm_eps=1e-6)
    if architecture == "llama":
        config, cls = LlamaConfig(**shape), LlamaForCausalLM
    elif architecture == "gemma3":
        config, cls = Gemma3TextConfig(**shape, sliding_window=8, query_pre_attn_scalar=16,
                                       layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                                       + ["full_attention"] * (layers % 2)), Gemma3ForCausalLM
    else:
        raise ValueError(f"architecture {architecture!r} is not llama or gemma3")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).float()
        # Larger logits than the default init's, so P(yes) varies visibly with the question.
        torch.nn.init.normal_(model.lm_head.weight, std=0.5)
    with _no_hf_progress_bars():
        model.save_pretrained(out)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": max_positions, **({"chat_template": CHATML} if chat_template else {})}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}) + "\n")
    return out
