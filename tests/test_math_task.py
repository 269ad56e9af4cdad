"""The math task: prompt files (JSONL, Parquet), a locally built HF checkpoint with a BPE
tokenizer, prompts of any length through both torch engines, math-verify truth, the math
weak verifiers, and `pipeline up` on all of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pipeline.config import TaskConfig
from pipeline.model.init_model import corpus, init_model, synthetic_math_rows, warm_up, write_rows
from pipeline.tasks.math import MathTask, boxed_answer, read_rows
from pipeline.verifiers.registry import VERIFIERS  # the registry module registers the math checks

pytestmark = pytest.mark.one_server

pytest.importorskip("math_verify")

TEMPLATE = "{problem} Put the answer in \\boxed{}."


@pytest.fixture(scope="module")
def math_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("math")
    rows = synthetic_math_rows(400, seed=3)
    return rows, write_rows(rows, d / "math.jsonl")


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory, math_data):
    rows, _ = math_data
    out = tmp_path_factory.mktemp("bpe") / "model"
    init_model(out, preset="tiny", texts=corpus(rows), tokenizer_vocab=384, seed=1)
    return out


def test_boxed_answer_takes_the_last_balanced_box():
    assert boxed_answer("so \\boxed{3} no, \\boxed{\\frac{5}{6}} done") == "\\frac{5}{6}"
    assert boxed_answer("\\boxed{ 12 }") == "12"
    assert boxed_answer("no box here") is None
    assert boxed_answer("\\boxed{unclosed") is None
    assert boxed_answer("\\boxed{}") is None


def test_jsonl_and_parquet_give_the_same_rows(tmp_path, math_data):
    rows, path = math_data
    pq = write_rows(rows, tmp_path / "math.parquet")
    assert read_rows(path) == rows
    assert read_rows(pq) == rows


def test_bad_rows_are_refused_naming_the_row_and_field(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n" + json.dumps({"answer": "4"}) + "\n")
    with pytest.raises(ValueError, match=r"row 2 has no 'problem'"):
        MathTask(TaskConfig(kind="math", dataset=str(p), heldout_size=1))
    # A row without an answer is an unlabelled one (trained on, never held out), not a bad row.
    p.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n" + json.dumps({"problem": "2+2"}) + "\n")
    assert [i.reference for i in MathTask(TaskConfig(kind="math", dataset=str(p), heldout_size=1)).heldout()] == ["2"]
    p.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a JSON object"):
        read_rows(p)


def test_heldout_split_is_disjoint_deterministic_and_training_cycles(math_data):
    _, path = math_data
    cfg = TaskConfig(kind="math", dataset=str(path), heldout_size=50, template=TEMPLATE)
    a, b = MathTask(cfg), MathTask(cfg)
    assert [i.prompt for i in a.heldout()] == [i.prompt for i in b.heldout()]
    held = {i.prompt for i in a.heldout()}
    stream = a.training(seed=0)
    first_epoch = [next(stream) for _ in range(350)]
    assert len({i.prompt for i in first_epoch}) == 350 and not held & {i.prompt for i in first_epoch}
    assert all(i.prompt.endswith("Put the answer in \\boxed{}.") for i in first_epoch)
    assert next(stream).prompt in {i.prompt for i in first_epoch}  # the second epoch starts
    with pytest.raises(ValueError, match="heldout_size"):
        MathTask(TaskConfig(kind="math", dataset=str(path), heldout_size=400))


def test_truth_is_math_verify_equivalence_of_the_boxed_answer(math_data):
    _, path = math_data
    t = MathTask(TaskConfig(kind="math", dataset=str(path), heldout_size=10))
    got = t.correctness("\\frac{5}{6}", ["\\boxed{5/6}", "\\boxed{\\frac{10}{12}}", "\\boxed{0.8}", "5/6",
                                        "\\boxed{\\frac{5}{6}}"])
    assert got.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert t.correctness("-141", ["x \\boxed{-141}", "\\boxed{141}"]).tolist() == [1.0, 0.0]


def test_math_verifiers_never_need_the_reference():
    comps = ["a \\boxed{3}", "b \\boxed{3}", "\\boxed{x+1}", "nothing"]
    assert VERIFIERS["boxed"]("p", comps).tolist() == [1, 1, 1, 0]
    numeric = VERIFIERS["boxed_numeric"]("p", comps)
    assert numeric[:3].tolist() == [1, 1, 0] and np.isnan(numeric[3])
    maj = VERIFIERS["boxed_majority"]("p", comps)
    assert maj[:3].tolist() == [1, 1, 0] and maj[3] == 0


def test_local_checkpoint_with_bpe_tokenizer_loads_everywhere(bpe_model):
    from pipeline.model.qwen import load_checkpoint
    from pipeline.model.tokenizer import HFTokenizer, load_tokenizer, model_vocab_size

    tok = load_tokenizer(bpe_model)
    assert isinstance(tok, HFTokenizer)
    text = "What is $\\frac{7}{2} + \\frac{5}{9}$? Put the answer in \\boxed{}."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id] + ids) == text  # decoding stops at the end of sequence
    assert tok.eos_id != tok.pad_id
    model, tok2 = load_checkpoint(bpe_model)
    assert model.config.vocab_size == model_vocab_size(bpe_model) >= tok.vocab_size
    assert model.config.tie_word_embeddings is False
    assert tok2.encode(text) == ids


def test_prompts_of_different_lengths_sample_and_rescore_consistently(bpe_model):
    from pipeline.engines.torch import sample_prompts
    from pipeline.model.qwen import completion_logprobs, load_checkpoint, ragged_completion_logprobs

    model, tok = load_checkpoint(bpe_model)
    prompts = [np.asarray(tok.encode(t), dtype=np.int32) for t in
               ["Compute 3 + 4 \\times 2.", "What is $\\frac{1}{2} + \\frac{1}{3}$?", "Compute 30 - 2 \\times 9."]]
    assert len({p.size for p in prompts}) > 1
    samples = sample_prompts(model, prompts, n=3, max_new_tokens=8, temperature=1.0, eos_id=tok.eos_id,
                             pad_id=tok.pad_id, generator=torch.Generator().manual_seed(0))
    assert [s.tokens.shape[0] for s in samples] == [3, 3, 3]
    rows = [(torch.from_numpy(p.astype(np.int64)), s.tokens[j], s.logprobs[j], s.lengths[j])
            for p, s in zip(prompts, samples) for j in range(3)]
    comp = torch.from_numpy(np.stack([r[1] for r in rows]).astype(np.int64))
    with torch.no_grad():
        ragged = ragged_completion_logprobs(model, [r[0] for r in rows], comp, pad_id=tok.pad_id)
        for i, (p, _, lp, n) in enumerate(rows):
            alone = completion_logprobs(model, p.unsqueeze(0), comp[i: i + 1])[0]
            # Right-padded batch rows score exactly like the row alone ...
            torch.testing.assert_close(ragged[i, :n], alone[:n], atol=1e-5, rtol=1e-5)
            # ... and like the sampler's behaviour log-probs (temperature 1).
            torch.testing.assert_close(ragged[i, :n], torch.from_numpy(lp[:n]), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_pipeline_up_runs_the_math_task_on_a_local_bpe_checkpoint(tmp_path, math_data, bpe_model):
    import shutil

    rows, path = math_data
    base = tmp_path / "base"
    shutil.copytree(bpe_model, base)
    warm_up(base, rows, template=TEMPLATE, steps=120, seed=0)
    args = [sys.executable, "-m", "pipeline.cli", "up", "--run-id", "math", "--runs_dir", str(tmp_path / "runs"),
            "--model.base_dir", str(base), "--task.kind", "math", "--task.dataset", str(path),
            "--task.template", TEMPLATE, "--task.heldout_size", "40", "--task.max_new_tokens", "24",
            "--verifier.verifiers", "boxed,boxed_numeric,boxed_majority,math_equiv",
            "--trainer.steps", "4", "--trainer.groups_per_step", "4", "--generator.group_size", "4",
            "--generator.prompts_per_batch", "2", "--feeder.backlog", "16", "--verifier.batch", "4",
            "--verifier.min_fit_rows", "16", "--cluster.progress_every_s", "2"]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "math" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 4
    acc = summary["accounting"]
    assert acc["ok"] and acc["lost"] == 0 and acc["trained"] >= 1, acc
    assert set(summary["evals"]) >= {"0", "4"}
