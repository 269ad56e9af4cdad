"""Verifier kinds beyond the rule-based checks: math equivalence, a local reward model, an
LM judge, sandboxed code execution, and the verifier stage surviving a hanging verifier."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import time

import numpy as np
import pytest

from pipeline.verifiers import registry as V
from pipeline.common import sandbox as SB
from pipeline.verifiers.kinds import code_exec as CE
from pipeline.verifiers.kinds.lm_judge import judge, p_yes
from pipeline.verifiers.base import VERIFIERS
from pipeline.verifiers.registry import Scorer, resolve

ADD = " 42+317="  # 359


# ------------------------------------------------------------------ math_equiv
def test_math_equiv_groups_latex_fractions_and_decimals_as_one_answer():
    fn = resolve("math_equiv")
    got = fn("Compute 2/4.", [r"$\frac{1}{2}$", "0.5", "1/2", r"\boxed{\dfrac{2}{4}}", "0.3", r"$\frac{3}{10}$", "no idea"])
    # Four ways of writing 1/2 beat two ways of writing 3/10; the unparseable one abstains.
    assert got[:6].tolist() == [1, 1, 1, 1, 0, 0] and math.isnan(got[6])


def test_math_equiv_scores_ties_alike_and_abstains_on_a_group_without_answers():
    fn = resolve("math_equiv")
    assert fn("", [r"$\sqrt{4}$", "2", "3", r"$\frac{6}{2}$"]).tolist() == [1, 1, 1, 1]
    assert fn("", ["359", "359", "349"]).tolist() == [1, 1, 0]
    assert np.isnan(fn("", ["", "??"])).all()


# ------------------------------------------------------- answers: self_consistency, states_answer, answer_only
CHATTY = ["7", "The answer is 7.", "8", "no idea", "7.", "I think -8", "  -8 "]


def test_self_consistency_is_the_majority_of_the_stated_answers():
    got = resolve("self_consistency:last_number")("q", CHATTY)
    # 7 three times, -8 twice, 8 once; 'no idea' states none: (count - 1) / (3 - 1), 0 without an answer
    assert got.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 0.5, 0.5]
    assert np.isnan(resolve("self_consistency")("q", ["none", "at all"])).all()
    boxed = resolve("self_consistency:boxed")("q", ["\\boxed{ x + 1 }", "\\boxed{x + 1}", "\\boxed{2}", "x + 1"])
    assert boxed.tolist() == [1.0, 1.0, 0.0, 0.0], "answers compare after whitespace is collapsed"


def test_states_answer_and_answer_only_read_the_format():
    assert resolve("states_answer:last_number")("q", CHATTY).tolist() == [1, 1, 1, 0, 1, 1, 1]
    only = resolve("answer_only:last_number")("q", CHATTY)
    assert only[[0, 1, 2, 4, 5, 6]].tolist() == [1, 0, 1, 1, 0, 1] and np.isnan(only[3])
    tagged = resolve("answer_only:regex:<a>(.*?)</a>")("q", ["<a>5</a>", "5"])
    assert tagged[0] == 0 and np.isnan(tagged[1]), "the tags are more than the answer; no tag, no answer"


def test_answer_kinds_check_their_extraction_before_anything_starts_and_one_is_sound():
    from pipeline.verifiers.base import is_sound

    with pytest.raises(ValueError, match="self_consistency:regex:\\(.*valid regular expression"):
        V.check_spec("self_consistency:regex:(")
    with pytest.raises(ValueError, match="answer_only:lastnumber"):
        V.check_spec("answer_only:lastnumber")
    assert is_sound("states_answer:last_number") and is_sound("mod9")
    assert not is_sound("self_consistency:last_number") and not is_sound("answer_only")


# ---------------------------------------------------------------- reward_model
def _tiny_classifier(directory, *, num_labels: int, seed: int = 0):
    """A random Qwen3 sequence classifier with the project's character tokenizer, saved as safetensors."""
    import torch
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from pipeline.model.tokenizer import CharTokenizer

    tok = CharTokenizer()
    cfg = Qwen3Config(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                      num_labels=num_labels, pad_token_id=tok.pad_id, eos_token_id=tok.eos_id,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    Qwen3ForSequenceClassification(cfg).save_pretrained(directory, safe_serialization=True)
    tok.save(directory)
    return directory


@pytest.mark.parametrize("num_labels", [1, 2])
def test_reward_model_scores_a_local_checkpoint_in_unit_range(tmp_path, num_labels):
    d = _tiny_classifier(tmp_path / "rm", num_labels=num_labels)
    assert (d / "model.safetensors").is_file()
    scorer = Scorer([f"reward_model:{d}"], default_timeout_s=120)
    completions = ["359", "358", "12", "3590", "0"]
    votes, outcome = scorer.score(ADD, completions)
    assert outcome == {f"reward_model:{d}": "ok"}
    s = votes[:, 0]
    assert s.shape == (5,) and ((s >= 0) & (s <= 1)).all() and np.isfinite(s).all()
    assert len(set(np.round(s, 6))) > 1, "a random head still separates different inputs"
    again, _ = scorer.score(ADD, completions)
    np.testing.assert_allclose(again[:, 0], s, rtol=1e-5)  # batched or not, the same scores


def test_reward_model_abstains_with_a_clear_message_when_it_cannot_load(tmp_path):
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "pytorch_model.bin").write_bytes(b"not allowed")
    for d, reason in [(tmp_path / "missing", "no such directory"), (tmp_path / "no_weights", "no model.safetensors")]:
        spec = f"reward_model:{d}"
        scorer = Scorer(["format", spec], default_timeout_s=60)
        votes, outcome = scorer.score(ADD, ["359", "35"])
        assert outcome == {"format": "ok", spec: "error"}
        assert np.isnan(votes[:, 1]).all() and votes[:, 0].tolist() == [1.0, 1.0]
        st = scorer.stats[spec]
        assert st.errors == 1 and reason in st.last_error and str(d) in st.last_error


def test_reward_model_refuses_a_checkpoint_with_more_than_two_labels(tmp_path):
    d = _tiny_classifier(tmp_path / "rm3", num_labels=3)
    scorer = Scorer([f"reward_model:{d}"], default_timeout_s=60)
    scorer.score(ADD, ["359"])
    assert "3 labels" in scorer.stats[f"reward_model:{d}"].last_error


# -------------------------------------------------------------------- lm_judge
class FixedBackend:
    """A judge backend with known next-token log-probs: says yes with probability 0.8 to '359', 0.1 otherwise."""

    yes = ("yes", "Yes")
    no = ("no",)

    def question(self, prompt, completion):
        return None if "?" in completion else f"{prompt}{completion} correct?"

    def next_token_logprobs(self, texts):
        out = []
        for t in texts:
            p = 0.8 if "359 " in t else 0.1
            out.append({"yes": math.log(p * 0.75), "Yes": math.log(p * 0.25), "no": math.log(1 - p), "maybe": -1.0})
        return out


def test_lm_judge_scores_p_yes_renormalised_over_yes_and_no_tokens():
    got = judge(FixedBackend(), ADD, ["359", "358", "??"])
    np.testing.assert_allclose(got[:2], [0.8, 0.1], rtol=1e-6)  # 'maybe' is not counted either way
    assert math.isnan(got[2])
    assert math.isnan(p_yes({"maybe": 0.0}, ("yes",), ("no",)))


def test_lm_judge_on_the_torch_policy_gives_probabilities_and_abstains_on_foreign_text(tiny_base_model):
    spec = f"lm_judge:{tiny_base_model}"
    scorer = Scorer([spec], default_timeout_s=120)
    votes, outcome = scorer.score(ADD, ["359", "35", "abc", "3590"])
    assert outcome == {spec: "ok"}
    s = votes[:, 0]
    assert np.isnan(s[2]), "characters outside the policy's alphabet cannot be asked about"
    finite = s[[0, 1, 3]]
    assert ((finite >= 0) & (finite <= 1)).all() and np.isfinite(finite).all()


def test_lm_judge_without_a_checkpoint_abstains_with_the_reason(tmp_path):
    spec = f"lm_judge:{tmp_path}"
    scorer = Scorer([spec], default_timeout_s=60)
    _, outcome = scorer.score(ADD, ["359"])
    assert outcome == {spec: "error"} and "no model.safetensors" in scorer.stats[spec].last_error


# ------------------------------------------------------------------- code_exec
FAST = SB.SandboxLimits(wall_s=3.0, cpu_s=2)


def _live_in_group(pgid: int, *, within_s: float = 3.0) -> list[int]:
    """Pids of processes (not zombies) still in process group ``pgid`` after up to ``within_s``
    (a SIGKILLed grandchild is reparented and reaped asynchronously; on a loaded machine that
    takes a moment)."""
    deadline = time.monotonic() + within_s
    while (live := _group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return live


def _group_members(pgid: int) -> list[int]:
    live = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(pid))
    return live


def test_code_exec_scores_the_share_of_asserts_passed():
    code = "def double(x):\n    return 2 * x\n"
    r = SB.run_tests(code, ["assert double(2) == 4", "assert double(0) == 0", "assert double(3) == 7"], limits=FAST)
    assert (r.passed, r.total, r.timed_out) == (2, 3, False) and r.score == pytest.approx(2 / 3)
    assert "assert double(3) == 7" in r.stderr


def test_code_exec_gives_zero_to_a_program_that_does_not_run():
    r = SB.run_tests("def double(x) return 2x", ["assert double(2) == 4"], limits=FAST)
    assert r.passed == 0 and r.score == 0.0 and "SyntaxError" in r.stderr


def test_code_exec_kills_an_infinite_loop_at_the_wall_clock_and_abstains():
    t0 = time.perf_counter()
    r = SB.run_tests("while True:\n    pass\n", ["assert True"], limits=SB.SandboxLimits(wall_s=1.0, cpu_s=10))
    assert r.timed_out and math.isnan(r.score)
    assert time.perf_counter() - t0 < 5.0
    assert _live_in_group(r.pid) == []


@pytest.mark.parametrize("isolate", [True, False])
def test_code_exec_stops_a_cpu_burner_at_its_cpu_allowance_and_abstains_as_at_the_wall_clock(isolate):
    # The CPU limit (1 s) comes long before the wall clock (20 s): stopped for time all the same,
    # inside the namespaces too (where unshare reports its child's SIGKILL as its own exit status 1).
    t0 = time.perf_counter()
    r = SB.run_tests("while True:\n    pass\n", ["assert True"], limits=SB.SandboxLimits(wall_s=20.0, cpu_s=1),
                     isolate_network=isolate)
    assert r.timed_out and math.isnan(r.score) and r.returncode != 0
    assert time.perf_counter() - t0 < 15.0
    assert _live_in_group(r.pid) == []


def test_code_exec_limits_a_memory_hog_and_a_fork_bomb_and_leaves_nothing_running():
    hog = SB.run_tests("x = bytearray(2 << 30)\n", ["assert len(x) > 0"], limits=FAST)
    assert not hog.timed_out and hog.score == 0.0 and "MemoryError" in hog.stderr
    bomb = (
        "import os, time\n"
        "n = 0\n"
        "while n < 200:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
    )
    limits = SB.SandboxLimits(wall_s=10.0, nproc=16)
    r = SB.run_tests(bomb, [f"assert n < {limits.nproc}"], limits=limits)
    _, as_nobody, _ = SB.sandbox_python()
    if as_nobody or os.getuid() != 0:
        assert r.score == 1.0, r  # RLIMIT_NPROC stopped the forking
    else:
        assert "RLIMIT_NPROC is not enforced" in r.note
    deadline = time.monotonic() + 5
    while _live_in_group(r.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live_in_group(r.pid) == [], "the sleeping children must be killed with the sandbox"


def test_code_exec_reports_whether_network_isolation_is_used():
    available = subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0 \
        if SB._UNSHARE else False
    r = SB.run_tests("x = 1", ["assert x == 1"], limits=FAST)
    assert r.network_isolated is available and r.score == 1.0
    if not available:
        assert "network isolation unavailable" in r.note
    off = SB.run_tests("x = 1", ["assert x == 1"], limits=FAST, isolate_network=False)
    assert off.network_isolated is False and "not requested" in off.note


def test_code_exec_cannot_reach_a_socket_on_loopback_when_isolated():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nok = True\n"
    try:
        isolated = SB.run_tests(code, ["assert ok"], limits=FAST)
        if not isolated.network_isolated:
            pytest.skip(isolated.note)
        assert isolated.score == 0.0 and ("unreachable" in isolated.stderr or "refused" in isolated.stderr)
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever connected
        # The same program without the namespace does connect: the isolation is what stops it.
        open_net = SB.run_tests(code, ["assert ok"], limits=FAST, isolate_network=False)
        assert open_net.score == 1.0
        server.accept()[0].close()
    finally:
        server.close()


def test_the_code_exec_verifier_takes_its_tests_from_the_prompt_and_abstains_without_them():
    prompt = "Write inc(x) returning x + 1.\nassert inc(1) == 2\nassert inc(-1) == 0\n"
    fn = resolve("code_exec")
    got = fn(prompt, ["```python\ndef inc(x):\n    return x + 1\n```", "def inc(x):\n    return x", "while True: pass"])
    assert got[0] == 1.0 and got[1] == 0.0 and (math.isnan(got[2]) or got[2] == 0.0)
    assert np.isnan(fn(ADD, ["359"])).all(), "no asserts in the prompt: not a code task"


# ------------------------------------------------- the verifier stage survives
def test_the_verifier_stage_keeps_scoring_when_a_verifier_hangs_or_raises(tmp_path, tiny_base_model, redis_client,
                                                                          redis_url, monkeypatch):
    from builders import make_rollout
    from pipeline.config import load_config
    from pipeline.consumers.verifier import run_verifier
    from pipeline.keys import Keys
    from pipeline.observe.logs import setup_logging
    from pipeline.records import ScoredGroup
    from pipeline.bus.stats import read_stats
    from pipeline.bus.streams import FIELD

    def hangs(prompt, completions):
        time.sleep(5)
        return np.ones(len(completions), np.float32)

    def raises(prompt, completions):
        raise RuntimeError("checker crashed")

    monkeypatch.setitem(VERIFIERS, "hangs", hangs)
    monkeypatch.setitem(VERIFIERS, "raises", raises)
    monkeypatch.setattr(V, "THREADED", V.THREADED | {"hangs"})
    cfg = load_config(overrides={
        "run_id": "kinds", "runs_dir": str(tmp_path), "redis.url": redis_url, "model.base_dir": str(tiny_base_model),
        "verifier.verifiers": "format,mod9,hangs,raises", "verifier.reward": "average",
        "verifier.timeouts": "hangs=0.3", "verifier.batch": 4, "generator.group_size": 4})
    keys = Keys(cfg.run_id)
    for i in range(3):
        redis_client.xadd(keys.shard(0).rollouts, {FIELD: make_rollout(prompt_id=f"p{i:08d}").encode()})
    log = setup_logging(tmp_path / "logs", stage="verifier", worker="ver-0")
    t0 = time.perf_counter()
    assert run_verifier(cfg, redis_client, keys, "ver-0", log, max_batches=1) == 3
    assert time.perf_counter() - t0 < 30
    scored = [ScoredGroup.decode(f[FIELD]) for _, f in redis_client.xrange(keys.shard(0).scored)]
    assert len(scored) == 3
    for g in scored:
        assert np.isnan(g.votes[:, 2:]).all() and not np.isnan(g.votes[:, 0]).any()
    stats = read_stats(redis_client, keys)
    assert stats["verifier_timeouts_total"] >= 1 and stats["verifier_errors_total"] == 3
    lines = (tmp_path / "logs" / "ver-0.jsonl").read_text()
    assert '"verifier_abstained"' in lines and "checker crashed" in lines and '"outcome": "timeout"' in lines


def test_the_verifier_stage_runs_only_what_the_reward_reads_and_counts_each_ones_cost(
        tmp_path, tiny_base_model, redis_client, redis_url):
    from builders import make_rollout
    from pipeline.bus.stats import read_stats
    from pipeline.bus.streams import FIELD
    from pipeline.config import load_config
    from pipeline.consumers.verifier import monitored, run_verifier
    from pipeline.keys import Keys
    from pipeline.observe.logs import setup_logging
    from pipeline.records import ScoredGroup
    from pipeline.verifiers.base import verifier_costs

    names = ["format", "mod9", "states_answer:last_number"]
    ids = [f"p{i:08d}" for i in range(12)]
    for reward, share, runs_all in (("single:mod9", 0.0, False), ("ground_truth", 0.5, None), ("weaver", 0.0, True)):
        run_id = f"reads-{reward.replace(':', '-')}"
        cfg = load_config(overrides={
            "run_id": run_id, "runs_dir": str(tmp_path), "redis.url": redis_url,
            "model.base_dir": str(tiny_base_model), "verifier.verifiers": ",".join(names), "verifier.reward": reward,
            "verifier.monitor_share": share, "verifier.batch": 12, "verifier.min_fit_rows": 8,
            "generator.group_size": 4})
        keys = Keys(run_id)
        for pid in ids:
            redis_client.xadd(keys.shard(0).rollouts, {FIELD: make_rollout(prompt_id=pid).encode()})
        log = setup_logging(tmp_path / run_id, stage="verifier", worker="ver-0")
        assert run_verifier(cfg, redis_client, keys, "ver-0", log, max_batches=1) == 12
        scored = [ScoredGroup.decode(f[FIELD]) for _, f in redis_client.xrange(keys.shard(0).scored)]
        every = [not np.isnan(g.votes).all(axis=0)[2] for g in scored]  # the kind voted: every verifier ran
        if runs_all is None:  # the monitored share: every verifier on the groups its hash picks, none elsewhere
            assert every == [monitored(g.rollout.group_id, share) for g in scored] and 0 < sum(every) < 12
            assert all(np.isnan(g.votes).all() for g, e in zip(scored, every) if not e)
        else:
            assert every == [runs_all] * 12
        if reward == "single:mod9":
            assert all(not np.isnan(g.votes[:, 1]).any() and np.isnan(g.votes[:, [0, 2]]).all() for g in scored)
        costs = verifier_costs(read_stats(redis_client, keys), names)
        ran = {n: c["completions"] for n, c in costs.items()}
        g = scored[0].rollout.group_size
        if reward == "single:mod9":
            assert ran == {"format": 0, "mod9": 12 * g, "states_answer:last_number": 0}
        elif reward == "ground_truth":
            assert ran == {n: sum(every) * g for n in names}
        else:
            assert ran == {n: 12 * g for n in names}
        assert all(c["seconds_per_completion"] > 0 for c in costs.values() if c["completions"])
