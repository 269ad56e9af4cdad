"""The reasoning-gym task and chat-model prompting: datasets and their parameters, a held-out
split training never touches, score_answer as the hidden truth, answer extraction, chat
templates and system prompts, refusals before launch, and ten datasets through the real
pipeline (separate OS processes, a real server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from pipeline.config import ConfigError, TaskConfig, load_config
from pipeline.inert import Situation, refuse_inert

pytest.importorskip("reasoning_gym")

from pipeline.tasks import reasoning_gym as rgt  # noqa: E402
from pipeline.tasks.answers import boxed_answer, last_number, make_extractor  # noqa: E402
from pipeline.tasks.prompting import PLAIN, build_prompt, checkpoint_format, prompt_format  # noqa: E402
from pipeline.tasks.registry import make_task  # noqa: E402

pytestmark = pytest.mark.one_server

TEN = ("basic_arithmetic", "chain_sum", "gcd", "lcm", "spell_backward", "count_bits", "letter_counting", "products",
       "fraction_simplification", "prime_factorization")
"""Ten datasets with short questions whose generation does not depend on string hashing."""

TEMPLATE = "{problem} Put the answer in \\boxed{}."


def rg_task(**fields) -> TaskConfig:
    return load_config(overrides={"task.kind": "reasoning_gym", **{f"task.{k}": v for k, v in fields.items()}}).task


@pytest.fixture(scope="module")
def rg_model(tmp_path_factory):
    """A tiny Qwen3 checkpoint whose BPE tokenizer is trained on the ten datasets' questions, warmed up
    briefly on their boxed answers (so completions vary and the weak verifiers have something to score)."""
    from pipeline.model.init_model import corpus, init_model, warm_up

    rows = rgt.sample_rows(rg_task(datasets=",".join(TEN), heldout_size=8), 600, seed=7)
    out = tmp_path_factory.mktemp("rg") / "model"
    init_model(out, preset="tiny", texts=corpus(rows) + [TEMPLATE], tokenizer_vocab=768, seed=0)
    warm_up(out, rows, template=TEMPLATE, steps=30, batch_size=16, seed=0)
    return out


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny checkpoint with the ChatML chat template in its tokenizer_config.json."""
    from pipeline.model.init_model import CHATML, init_model

    out = tmp_path_factory.mktemp("chat") / "model"
    init_model(out, preset="tiny", texts=["What is 2 + 3? The answer is \\boxed{5}.", "Be brief."] * 20,
               tokenizer_vocab=300, seed=0, chat_template=CHATML)
    return out


# ----------------------------------------------------------------------------- the held-out split


def test_heldout_never_overlaps_training_even_where_the_raw_streams_collide():
    # 1-digit a ± b: 200 distinct questions, so the unfiltered training stream repeats held-out ones.
    params = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    cfg = rg_task(datasets="chain_sum,gcd", heldout_size=40, dataset_params=json.dumps({"chain_sum": params}))
    task = make_task(cfg)
    held = [i.prompt for i in task.heldout()]
    assert len(held) == len(set(held)) == 80 and {i.source for i in task.heldout()} == {"chain_sum", "gcd"}
    raw = rgt.entries("chain_sum", params, kind="train", base=0)
    assert {next(raw)["question"] for _ in range(600)} & set(held), "the raw stream does collide"
    stream = task.training(0)
    train = [next(stream) for _ in range(1200)]
    assert not {i.prompt for i in train} & set(held)
    assert {i.source for i in train} == {"chain_sum", "gcd"}
    # Deterministic: the same config gives the same held-out set and training stream; the seeds matter.
    again = make_task(cfg)
    assert [i.prompt for i in again.heldout()] == held
    assert next(again.training(0)).prompt == train[0].prompt
    other = make_task(rg_task(datasets="chain_sum,gcd", heldout_size=40, heldout_seed=99,
                              dataset_params=json.dumps({"chain_sum": params})))
    assert [i.prompt for i in other.heldout()] != held
    seed1 = task.training(1)
    assert [next(seed1).prompt for _ in range(5)] != [i.prompt for i in train[:5]]


def test_dataset_weights_set_how_often_each_dataset_is_drawn():
    task = make_task(rg_task(datasets="chain_sum,gcd", dataset_weights="3,1", heldout_size=5))
    stream = task.training(0)
    sources = [next(stream).source for _ in range(800)]
    assert 0.68 < sources.count("chain_sum") / len(sources) < 0.82


def test_a_heldout_set_larger_than_the_datasets_questions_is_refused_naming_the_field():
    params = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    task = make_task(rg_task(datasets="chain_sum", heldout_size=300, dataset_params=json.dumps({"chain_sum": params})))
    with pytest.raises(ValueError, match=r"^task\.heldout_size: chain_sum gave only 200 distinct questions"):
        task.heldout()


def _heldout_in_a_process(hash_seed: str) -> list[str]:
    code = ("import json; from pipeline.config import load_config; from pipeline.tasks.registry import make_task; "
            "t = make_task(load_config(overrides={'task.kind': 'reasoning_gym', 'task.datasets': 'ransom_note', "
            "'task.heldout_size': '8'}).task); print(json.dumps([i.prompt for i in t.heldout()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": hash_seed}).stdout
    return json.loads(out.splitlines()[-1])


def test_pipeline_up_fixes_the_hash_seed_so_every_worker_generates_the_same_heldout_set(tmp_path, monkeypatch):
    """Some datasets (ransom_note among them) build questions from string hashing, which differs
    between processes; `pipeline up` starts every worker of this task with one PYTHONHASHSEED."""
    assert _heldout_in_a_process("1") != _heldout_in_a_process("2")
    assert _heldout_in_a_process("0") == _heldout_in_a_process("0")
    from pipeline.run import launch

    seen = []
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(launch.subprocess, "Popen", lambda cmd, **kw: seen.append(kw.get("env")))
    for kind in ("reasoning_gym", "arithmetic"):
        cfg = load_config(overrides={"runs_dir": str(tmp_path), "run_id": kind, "task.kind": kind,
                                     **({"task.datasets": "gcd"} if kind == "reasoning_gym" else {})})
        (cfg.run_dir / "logs").mkdir(parents=True)
        launch._spawn(cfg, "feed", None)
    assert seen[0]["PYTHONHASHSEED"] == "0" and seen[1] is None  # the default run's workers: untouched


# ----------------------------------------------------------------------------- the truth


def test_the_reference_carries_the_whole_entry_losslessly():
    import reasoning_gym as rg

    for name in ("arc_1d", "graph_color", "basic_arithmetic", "knights_knaves"):  # tuples, int keys, numpy strings
        ds = rg.create_dataset(name, seed=3, size=3)
        for i in range(3):
            entry = ds[i]
            got_name, back = rgt.decode_reference(rgt.encode_reference(name, entry))
            assert got_name == name and back == entry
            assert ds.score_answer(entry["answer"], back) == ds.score_answer(entry["answer"], entry)


def test_score_answer_is_the_ground_truth():
    import reasoning_gym as rg

    task = make_task(rg_task(datasets="chain_sum,spell_backward", heldout_size=5))
    for item in task.heldout():
        name, entry = rgt.decode_reference(item.reference)
        ds = rg.create_dataset(name, seed=0, size=1)
        wrong = "1" + entry["answer"] + "x"
        comps = [f"The answer is \\boxed{{{entry['answer']}}}.", f"\\boxed{{{wrong}}}", entry["answer"], "nothing"]
        expected = [ds.score_answer(boxed_answer(c), entry) if boxed_answer(c) else 0.0 for c in comps]
        np.testing.assert_allclose(task.score(item.reference, comps), expected, rtol=1e-6)
        assert task.correctness(item.reference, comps).tolist() == [1.0, 0.0, 0.0, 0.0]
    # Partial credit is not a right answer: spell_backward gives some for a near miss.
    item = next(i for i in task.heldout() if i.source == "spell_backward")
    _, entry = rgt.decode_reference(item.reference)
    near = f"\\boxed{{{entry['answer'][:-1]}}}"
    assert 0 < task.score(item.reference, [near])[0] < 1 and task.correctness(item.reference, [near])[0] == 0


def test_the_verifiers_see_the_prompt_and_completions_never_the_reference(rg_model, redis_url):
    """The feeder's PromptTask records carry the rendered question as the prompt and the entry only
    in the hidden reference; votes do not depend on the reference, the truth and the ground_truth reward do."""
    from pipeline.algo.rewards import parse_reward_mode
    from pipeline.keys import Keys
    from pipeline.model.tokenizer import load_tokenizer
    from pipeline.observe.logs import setup_logging
    from pipeline.producers.feeder import run_feeder
    from pipeline.records import PromptTask
    from pipeline.verifiers.registry import Scorer

    cfg = load_config(overrides={"run_id": "rg-feed", "redis.url": redis_url, "model.base_dir": str(rg_model),
                                 "task.kind": "reasoning_gym", "task.datasets": "chain_sum,gcd",
                                 "task.heldout_size": "5", "task.template": TEMPLATE, "feeder.backlog": "6"})
    r = redis.Redis.from_url(redis_url)
    keys = Keys.of(cfg.run_id, cfg.redis)
    tok = load_tokenizer(rg_model)
    run_feeder(cfg, r, keys, setup_logging(None, stage="feeder", worker="feeder"), tokenizer=tok, max_rounds=1)
    records = [PromptTask.decode(f[b"d"]) for _, f in r.xrange(keys.shard(0).prompts)]
    assert len(records) == 6
    task = make_task(cfg.task)
    for rec in records:
        name, entry = rgt.decode_reference(rec.reference)
        assert rec.prompt == TEMPLATE.replace("{problem}", entry["question"])
        assert rec.prompt_ids.tolist() == tok.encode(rec.prompt)
        assert "entry" not in rec.prompt and rec.reference not in rec.prompt
    rec = records[0]
    _, entry = rgt.decode_reference(rec.reference)
    other = rgt.encode_reference("chain_sum", {**entry, "answer": str(int(entry["answer"]) + 1)})
    comps = [f"\\boxed{{{entry['answer']}}}", f"\\boxed{{{int(entry['answer']) + 1}}}"]
    scorer = Scorer(["boxed", "boxed_majority"])
    votes, _ = scorer.score(rec.prompt, comps)  # the scorer's whole input: no reference in it
    truth, truth_other = task.correctness(rec.reference, comps), task.correctness(other, comps)
    assert truth.tolist() == [1.0, 0.0] and truth_other.tolist() == [0.0, 1.0]
    gt = parse_reward_mode("ground_truth")
    assert gt(votes=votes, names=scorer.names, completions=comps, label_model=None, truth=truth, prompt=rec.prompt,
              answer=task.answer).tolist() == [1.0, 0.0]


# ----------------------------------------------------------------------------- answer extraction


def test_answer_extraction_modes():
    text = "First 3, then \\boxed{12} and \\boxed{\\frac{1}{2}}; finally -1,234.5 <answer> yes </answer> done"
    assert make_extractor("boxed")(text) == "\\frac{1}{2}"
    assert make_extractor("last_number")(text) == "-1234.5"
    assert last_number("no digits") is None and last_number("x = +7") == "7"
    assert make_extractor("regex:<answer>(.*?)</answer>")(text) == "yes"
    assert make_extractor(r"regex:\d+")(text) == "5"  # no group: the whole last match
    assert make_extractor("regex:<none>(.*)</none>")(text) is None
    assert make_extractor("full")("  42 \n") == "42" and make_extractor("full")("   ") is None
    for bad, why in [("boxd", "one of boxed, last_number, regex:<pattern>, full"), ("regex:", "non-empty pattern"),
                     ("regex:(", "valid regular expression")]:
        with pytest.raises(ConfigError, match=rf"^task\.answer_extract: must be .*{why.replace('(', '.')}"):
            load_config(overrides={"task.kind": "reasoning_gym", "task.datasets": "gcd", "task.answer_extract": bad})


def test_the_extraction_mode_is_what_truth_and_answers_read():
    task = make_task(rg_task(datasets="chain_sum", heldout_size=3, answer_extract="last_number"))
    item = task.heldout()[0]
    _, entry = rgt.decode_reference(item.reference)
    comps = [f"I think it is {entry['answer']}", f"\\boxed{{{entry['answer']}}} or 0"]
    assert task.correctness(item.reference, comps).tolist() == [1.0, 0.0]
    assert task.answer(comps[0]) == entry["answer"]


# ----------------------------------------------------------------------------- prompts


def test_a_chat_template_and_system_prompt_render_as_apply_chat_template_does(chat_model, tmp_path):
    from transformers import AutoTokenizer

    from pipeline.model.tokenizer import load_tokenizer

    hf = AutoTokenizer.from_pretrained(chat_model)
    tok = load_tokenizer(chat_model)
    user = "What is 2 + 3? Put the answer in \\boxed{}."
    for system in ("", "Be brief."):
        fmt = checkpoint_format(chat_model, use="auto", system_prompt=system)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        text, ids = build_prompt(fmt, tok, user)
        assert text == want and text.endswith("<|im_start|>assistant\n")
        assert ids.tolist() == hf(want, add_special_tokens=False)["input_ids"]
        assert (system in text) and text.startswith("<|im_start|>system\n" if system else "<|im_start|>user\n")
    # The task's fields choose it: on, off; and a checkpoint with chat_template.jinja only.
    cfg = rg_task(datasets="gcd", system_prompt="Be brief.", chat_template="off")
    assert prompt_format(cfg, chat_model).render(user) == f"Be brief.\n\n{user}"
    assert prompt_format(rg_task(datasets="gcd"), chat_model).render(user) == hf.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
    jinja = tmp_path / "jinja"
    jinja.mkdir()
    for f in chat_model.iterdir():
        (jinja / f.name).write_bytes(f.read_bytes())
    tc = json.loads((jinja / "tokenizer_config.json").read_text())
    (jinja / "chat_template.jinja").write_text(tc.pop("chat_template").replace("<|im_start|>", "<|im_start|> "))
    (jinja / "tokenizer_config.json").write_text(json.dumps(tc))
    assert checkpoint_format(jinja, use="on").render(user).startswith("<|im_start|> user\n")


def test_without_a_chat_template_prompts_are_plain_and_on_is_refused_naming_the_field(rg_model):
    cfg = rg_task(datasets="gcd", chat_template="on")
    with pytest.raises(ValueError, match=r"^task\.chat_template: 'on' needs a chat template"):
        prompt_format(cfg, rg_model)
    assert prompt_format(rg_task(datasets="gcd"), rg_model).render("Q?") == "Q?"
    assert prompt_format(rg_task(datasets="gcd", system_prompt="S."), rg_model).render("Q?") == "S.\n\nQ?"
    from pipeline.run.preflight import preflight

    with pytest.raises(ConfigError, match=r"task\.chat_template: 'on' needs a chat template"):
        preflight(load_config(overrides={"model.base_dir": str(rg_model), "task.kind": "reasoning_gym",
                                         "task.datasets": "gcd", "task.chat_template": "on",
                                         "verifier.verifiers": "boxed,boxed_majority"}))


def test_the_arithmetic_default_builds_its_prompts_exactly_as_before():
    from pipeline.model.tokenizer import CharTokenizer

    assert prompt_format(TaskConfig(), "/nonexistent") is PLAIN
    tok = CharTokenizer()
    text, ids = build_prompt(PLAIN, tok, " 42+317=")
    assert text == " 42+317=" and ids.dtype == np.int32 and ids.tolist() == tok.encode(" 42+317=")


# ----------------------------------------------------------------------------- refused before launch


@pytest.mark.parametrize("overrides, field, says", [
    ({"task.datasets": "chain_sums"}, "task.datasets", "unknown reasoning-gym dataset 'chain_sums'; close names: "
                                                      "chain_sum, decimal_chain_sum"),
    ({"task.datasets": "zzz"}, "task.datasets", "the 105 datasets: ab, acre"),
    ({"task.datasets": "composite"}, "task.datasets", "not supported"),
    ({"task.datasets": "gcd", "task.dataset_params": '{"gcd": {"min_numbr": 3}}'}, "task.dataset_params",
     "gcd has no parameter 'min_numbr'; close names: max_numbers, min_numbers; its parameters: min_numbers"),
    ({"task.datasets": "chain_sum", "task.dataset_params": '{"chain_sum": {"min_terms": 5, "max_terms": 2}}'},
     "task.dataset_params", "max_terms must be >= min_terms"),
])
def test_unknown_datasets_and_bad_params_are_refused_before_launch_naming_the_field(rg_model, overrides, field, says):
    from pipeline.run.preflight import preflight

    cfg = load_config(overrides={"model.base_dir": str(rg_model), "task.kind": "reasoning_gym",
                                 "verifier.verifiers": "boxed,boxed_majority", **overrides})
    with pytest.raises(ConfigError, match=rf"^{field.replace('.', chr(92) + '.')}: .*{says.replace('(', '.')}"):
        preflight(cfg)


@pytest.mark.parametrize("overrides, field", [
    ({"task.datasets": ""}, "task.datasets"),
    ({"task.datasets": "gcd,gcd"}, "task.datasets"),
    ({"task.datasets": "gcd,lcm", "task.dataset_weights": "1"}, "task.dataset_weights"),
    ({"task.datasets": "gcd", "task.dataset_weights": "0"}, "task.dataset_weights"),
    ({"task.datasets": "gcd", "task.dataset_params": "{not json"}, "task.dataset_params"),
    ({"task.datasets": "gcd", "task.dataset_params": '{"lcm": {}}'}, "task.dataset_params"),
    ({"task.datasets": "gcd", "task.dataset_params": '{"gcd": {"seed": 1}}'}, "task.dataset_params"),
    ({"task.datasets": "gcd", "task.template": "no placeholder"}, "task.template"),
])
def test_malformed_task_fields_are_refused_when_the_config_loads(overrides, field):
    with pytest.raises(ConfigError, match=rf"^{field.replace('.', chr(92) + '.')}: must be"):
        load_config(overrides={"task.kind": "reasoning_gym", **overrides})


def test_a_bad_dataset_fails_pipeline_up_before_anything_starts_naming_the_field(rg_model, tmp_path):
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "up", "--runs_dir", str(tmp_path / "runs"),
                        "--model.base_dir", str(rg_model), "--task.kind", "reasoning_gym",
                        "--task.datasets", "basic_arithmetic,chain_sums", "--verifier.verifiers", "boxed"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "task.datasets: unknown reasoning-gym dataset 'chain_sums'; close names: chain_sum" in p.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("overrides, field", [
    ({"task.datasets": "gcd"}, "task.datasets"),
    ({"task.system_prompt": "Be brief."}, "task.system_prompt"),
    ({"task.chat_template": "off"}, "task.chat_template"),
    ({"task.answer_extract": "full"}, "task.answer_extract"),
])
def test_the_new_task_fields_set_for_the_arithmetic_task_are_refused_by_name(overrides, field):
    with pytest.raises(ConfigError, match=rf"^{field.replace('.', chr(92) + '.')} = .*cannot take effect"):
        refuse_inert(load_config(overrides=overrides), Situation())
    refuse_inert(load_config(overrides={"task.kind": "reasoning_gym", "task.datasets": "gcd", **overrides}),
                 Situation())


# ----------------------------------------------------------------------------- ten datasets, the real pipeline

STEPS = 2
B = 5
HELD = 2  # held-out questions per dataset


@pytest.mark.slow
def test_ten_reasoning_gym_datasets_run_together_through_the_real_pipeline(tmp_path, rg_model, redis_url):
    """The ten datasets in one run of the real stages as OS processes (trainer, feeder, a generator
    and a verifier, ``harness.run_stages``) on the session's server: it finishes its steps with
    every prompt accounted for, and evaluates each dataset's held-out questions at its first and
    last evaluation, each dataset apart and all together, as ``pipeline up`` writes them."""
    from harness import run_stages, tiny_config

    from pipeline.keys import Keys
    from pipeline.run.accounting import account
    from pipeline.run.summary import write_summary

    cfg, path = tiny_config(tmp_path, rg_model, redis_url, "rg-ten", **{
        "task.kind": "reasoning_gym", "task.datasets": ",".join(TEN), "task.template": TEMPLATE,
        "task.heldout_size": HELD, "task.max_new_tokens": 12, "verifier.verifiers": "boxed,boxed_majority",
        "verifier.reward": "average", "verifier.batch": B, "trainer.steps": STEPS, "trainer.groups_per_step": B,
        "trainer.eval_every": STEPS, "generator.group_size": 2, "generator.prompts_per_batch": B,
        "feeder.backlog": 2 * B})
    t0 = time.time()
    run_stages(cfg, path, redis_url, generators=1, verifiers=1, timeout=300)
    r = redis.Redis.from_url(redis_url)
    keys = Keys.of(cfg.run_id, cfg.redis)
    summary = write_summary(cfg, r, keys, account(r, keys), {}, status="finished", wall_seconds=time.time() - t0,
                            restarts=0, server_restarts=0)
    assert summary["steps"] == STEPS, summary
    acc = summary["accounting"]
    assert acc["ok"] and acc["adds_up"] and acc["trained_once"], acc
    assert acc["lost"] == 0 and acc["unexpected"] == 0 and acc["dead_lettered"] == 0, acc
    assert acc["trained"] + acc["nosignal"] + acc["stale"] == STEPS * B, acc
    assert set(summary["evals"]) == {0, STEPS}, summary["evals"]
    by = summary["evals_by_dataset"]
    assert set(by) == {0, STEPS} and all(set(v) == set(TEN) for v in by.values()), by
    for step, per in by.items():
        # each dataset holds out HELD questions: a dataset's accuracy is a multiple of 1/HELD, and
        # the overall one the mean of the datasets'
        assert all(v * HELD == pytest.approx(round(v * HELD)) and 0.0 <= v <= 1.0 for v in per.values()), per
        assert sum(per.values()) / len(TEN) == pytest.approx(summary["evals"][step]), (per, summary["evals"])
    md = (tmp_path / "runs" / "rg-ten" / "summary.md").read_text()
    line = next(x for x in md.splitlines() if "held-out accuracy per dataset, first -> last evaluation: " in x)
    assert all(f"{name} " in line for name in TEN), line


def test_a_reasoning_gym_run_gets_verifiers_that_read_its_prompts_unless_it_names_its_own():
    from pipeline.config import DEFAULT_VERIFIERS

    rg = {"task.kind": "reasoning_gym", "task.datasets": "chain_sum"}
    cfg = load_config(overrides={**rg, "task.answer_extract": "last_number"})
    assert cfg.verifier.verifiers == ("self_consistency:last_number", "states_answer:last_number",
                                      "answer_only:last_number")
    assert "verifier.verifiers" not in cfg.explicit
    own = load_config(overrides={**rg, "verifier.verifiers": "states_answer"})
    assert own.verifier.verifiers == ("states_answer",)
    assert load_config().verifier.verifiers == DEFAULT_VERIFIERS  # the arithmetic task keeps its checks


def test_the_check_before_launch_refuses_a_verifier_that_reads_none_of_the_tasks_prompts(tiny_base_model):
    from pipeline.consumers.verifier import panel_problems
    from pipeline.run.preflight import preflight

    fields = {"task.kind": "reasoning_gym", "task.datasets": "chain_sum", "task.heldout_size": 20,
              "task.answer_extract": "last_number", "model.base_dir": str(tiny_base_model)}
    cfg = load_config(overrides={**fields, "verifier.verifiers": "mod9,states_answer:last_number,code_exec",
                                 "verifier.reward": "weaver"})
    problems = panel_problems(cfg)
    assert [p.split("'")[1] for p in problems] == ["mod9", "code_exec"], problems
    assert all("on every one" in p for p in problems)
    # The driver's check before launch runs it (on the arithmetic task here: the small model's
    # tokenizer reads digits only, and the prompt checks encode reasoning-gym prompts first).
    arith = load_config(overrides={"model.base_dir": str(tiny_base_model), "verifier.verifiers": "format,code_exec"})
    with pytest.raises(ConfigError, match="'code_exec' does not apply to this task"):
        preflight(arith)
    # A reward that reads none of them runs none: nothing to refuse (unless monitored).
    assert panel_problems(cfg.replace("verifier.reward", "ground_truth")) == []
    assert len(panel_problems(cfg.replace("verifier.reward", "ground_truth").replace("verifier.monitor_share", 0.1))) == 2
    assert panel_problems(cfg.replace("verifier.reward", "single:states_answer:last_number")) == []
    assert panel_problems(load_config(overrides=fields)) == []  # the task's own default panel applies
