"""The distilled verifier: selection accuracy, training, safetensors round-trip, the run's
posteriors file, and the ``distilled:<dir>`` reward mode inside the real verifier stage."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from pipeline.tasks import arithmetic as task
from pipeline.algo.distill import (DistillConfig, DistilledVerifier, distill_run, load_posteriors, posterior_files,
                              posterior_rows, selection_accuracy,
                              split_groups, train)
from pipeline.model.tokenizer import CharTokenizer
from pipeline.algo.rewards import compute_rewards, parse_reward_mode

TINY = dict(init="scratch", hidden_size=32, num_layers=1, num_heads=2, batch_size=64, lr=3e-3, warmup_steps=5)


def format_rows(n: int, *, seed: int) -> tuple[list[str], list[str], np.ndarray]:
    """Rows whose target is a format check: a plain number scores 1, one with a stray operator 0."""
    rng = random.Random(seed)
    prompts, comps, targets = [], [], []
    for _ in range(n):
        p = task.random_problem(rng, digits=3, ops=("+",))
        good = rng.random() < 0.5
        ans = str(int(p.answer) + rng.choice([0, 0, 1, -1, 10]))
        comps.append(ans if good else ans[:1] + rng.choice("+=*") + ans[1:])
        prompts.append(p.prompt)
        targets.append(1.0 if good else 0.0)
    return prompts, comps, np.array(targets, dtype=np.float32)


def test_selection_accuracy_averages_ties_and_ranks_abstentions_last():
    truth = np.array([[1, 0, 0, 0], [0, 1, 0, 1], [1, 0, 0, 0]], dtype=np.float32)
    scores = np.array([[0.9, 0.1, 0.1, 0.1],        # picks the right one: 1
                       [1.0, 1.0, 1.0, 1.0],        # all tied: 2 of 4 right -> 0.5
                       [np.nan, 0.2, 0.2, 0.1]])    # abstention below everything: tie of two wrong -> 0
    assert selection_accuracy(scores, truth) == pytest.approx((1 + 0.5 + 0) / 3)
    with pytest.raises(ValueError, match="shape"):
        selection_accuracy(scores[:, :3], truth)


def test_a_few_training_steps_learn_a_checkable_rule_on_held_out_rows():
    tok = CharTokenizer()
    prompts, comps, y = format_rows(768, seed=0)
    cfg = DistillConfig(**TINY, epochs=8)
    verifier, losses = train(prompts[:512], comps[:512], y[:512], cfg, tok=tok, progress=None)
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    s = verifier.score(prompts[512:], comps[512:])
    held = y[512:]
    assert s.shape == held.shape and ((s >= 0) & (s <= 1)).all()
    assert s[held == 1].mean() - s[held == 0].mean() > 0.5
    assert np.mean((s > 0.5) == (held == 1)) > 0.9


def test_save_and_load_round_trip_through_safetensors(tmp_path):
    tok = CharTokenizer()
    prompts, comps, y = format_rows(64, seed=1)
    verifier, _ = train(prompts, comps, y, DistillConfig(**TINY, epochs=1), tok=tok, progress=None)
    out = verifier.save(tmp_path / "dv", extra={"note": "test"})
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin")) and not list(out.glob("*.pt"))
    assert json.loads((out / "config.json").read_text())["kind"] == "distilled-verifier"
    loaded = DistilledVerifier.load(out)
    np.testing.assert_allclose(loaded.score(prompts, comps), verifier.score(prompts, comps), atol=1e-6)
    (out / "config.json").write_text(json.dumps({"kind": "policy"}))
    with pytest.raises(ValueError, match="distilled-verifier"):
        DistilledVerifier.load(out)
    with pytest.raises(FileNotFoundError, match="not a distilled verifier"):
        DistilledVerifier.load(tmp_path)


def test_bad_settings_and_rows_are_refused_by_name():
    with pytest.raises(ValueError, match="distill.init"):
        DistillConfig(init="bert").validate()
    with pytest.raises(ValueError, match="distill.heldout_fraction"):
        DistillConfig(heldout_fraction=1.0).validate()
    with pytest.raises(ValueError, match="targets"):
        train([" 12+345="], ["357"], np.array([1.5], np.float32), DistillConfig(**TINY), tok=CharTokenizer(),
              progress=None)
    with pytest.raises(ValueError, match=r"row 0 .*not in the vocabulary"):
        train([" 12+345="], ["35x"], np.array([1.0], np.float32), DistillConfig(**TINY), tok=CharTokenizer(),
              progress=None)


def write_posteriors(path, *, groups: int, seed: int, with_posterior: bool = True) -> None:
    """A posteriors.jsonl as the verifier stage writes it, from real verifiers and a real label model."""
    from pipeline.algo.labelmodel import fit_label_model
    from pipeline.tasks.arithmetic import correctness
    from pipeline.verifiers.registry import DEFAULT_VERIFIERS, score_group

    rng = random.Random(seed)
    names = list(DEFAULT_VERIFIERS)
    rows = []
    for i in range(groups):
        p = task.random_problem(rng, digits=3, ops=("+",))
        a = int(p.answer)
        comps = [str(a + rng.choice([0, 0, 0, 1, 9, 10, -10, 100])) for _ in range(8)]
        votes, _ = score_group(p.prompt, comps, names)
        rows.append((p, comps, votes, correctness(p.answer, comps)))
    lm = fit_label_model(np.concatenate([r[2] for r in rows]), names)
    with open(path, "w") as f:
        for i, (p, comps, votes, truth) in enumerate(rows):
            post = lm.posterior(votes, names).tolist() if with_posterior else None
            f.write(json.dumps({"group_id": f"g{i}", "prompt_id": f"p{i:08d}", "prompt": p.prompt,
                                "completions": comps, "names": names,
                                "votes": [[None if np.isnan(x) else float(x) for x in row] for row in votes],
                                "posterior": post, "truth": truth.astype(int).tolist(),
                                "labelmodel_version": 0, "policy_version": 0}) + "\n")


def test_posteriors_are_read_back_and_a_bad_line_is_named(tmp_path):
    path = tmp_path / "posteriors.jsonl"
    write_posteriors(path, groups=40, seed=0, with_posterior=False)
    groups, names = load_posteriors(path)
    assert len(groups) == 40 and names[0] == "format"
    # No posterior recorded (a run without a label model): one is fitted from the votes.
    assert all(np.isfinite(g.posterior).all() for g in groups)
    train_g, held = split_groups(groups, heldout_fraction=0.25, seed=0)
    assert len(held) == 10 and not {g.prompt for g in train_g} & {g.prompt for g in held}
    path.write_text(path.read_text().splitlines()[0] + "\n" + '{"prompt": "1+1="}\n')
    with pytest.raises(ValueError, match=r"posteriors.jsonl:2: bad record"):
        load_posteriors(path)


def test_distill_run_trains_measures_and_saves(tmp_path):
    write_posteriors(tmp_path / "posteriors.jsonl", groups=60, seed=1)
    report = distill_run(tmp_path, DistillConfig(**TINY, epochs=2), progress=None)
    assert report["heldout_groups"] == 12 and report["train_groups"] == 48
    sel = report["selection_accuracy"]
    assert 0 <= sel["distilled"] <= 1 and sel["ensemble"] > 0.5   # the ensemble is informative here
    assert report["retention"] == pytest.approx(sel["distilled"] / sel["ensemble"], abs=1e-3)
    assert report["rows_per_second"]["ensemble_per_group"] > 0 and report["rows_per_second"]["distilled_batched"] > 0
    saved = json.loads((tmp_path / "distilled" / "report.json").read_text())
    assert saved["retention"] == report["retention"]
    assert DistilledVerifier.load(tmp_path / "distilled").score([" 12+345="], ["357"]).shape == (1,)


def test_the_distilled_reward_mode_scores_prompt_and_completions(tmp_path):
    with pytest.raises(ValueError, match="not a distilled verifier directory"):
        parse_reward_mode(f"distilled:{tmp_path / 'missing'}")
    prompts, comps, y = format_rows(64, seed=2)
    verifier, _ = train(prompts, comps, y, DistillConfig(**TINY, epochs=1), tok=CharTokenizer(), progress=None)
    out = verifier.save(tmp_path / "dv")
    mode = parse_reward_mode(f"distilled:{out}")
    completions = ["357", "3+7", "356", "1"]
    votes = np.ones((4, 1), np.float32)
    r = compute_rewards(mode, votes=votes, names=["format"], completions=completions, prompt=" 12+345=")
    np.testing.assert_allclose(r, verifier.score_group(" 12+345=", completions), atol=1e-6)
    with pytest.raises(ValueError, match="prompt"):
        compute_rewards(mode, votes=votes, names=["format"], completions=completions)


def test_the_verifier_stage_records_posteriors_and_can_reward_with_the_distilled_model(
        tmp_path, tiny_base_model, redis_client, redis_url):
    from builders import make_rollout
    from pipeline.config import load_config
    from pipeline.consumers.verifier import run_verifier
    from pipeline.keys import Keys
    from pipeline.observe.logs import setup_logging
    from pipeline.records import ScoredGroup
    from pipeline.bus.streams import FIELD

    prompts, comps, y = format_rows(64, seed=3)
    verifier, _ = train(prompts, comps, y, DistillConfig(**TINY, epochs=1), tok=CharTokenizer(), progress=None)
    dv = verifier.save(tmp_path / "dv")
    for reward in ("weaver", f"distilled:{dv}"):
        run_id = "distil-" + reward.split(":")[0]
        cfg = load_config(overrides={"run_id": run_id, "runs_dir": str(tmp_path), "redis.url": redis_url,
                                     "model.base_dir": str(tiny_base_model), "verifier.reward": reward,
                                     "verifier.batch": 4, "verifier.min_fit_rows": 8,
                                     "generator.group_size": 4})
        keys = Keys(run_id)
        for i in range(3):
            redis_client.xadd(keys.shard(0).rollouts, {FIELD: make_rollout(prompt_id=f"p{i:08d}").encode()})
        log = setup_logging(tmp_path / "logs", stage="verifier", worker="ver-0")
        assert run_verifier(cfg, redis_client, keys, "ver-0", log, max_batches=1) == 3
        scored = [ScoredGroup.decode(f[FIELD]) for _, f in redis_client.xrange(keys.shard(0).scored)]
        # One file per verifier replica, read back through the run directory.
        assert [f.name for f in posterior_files(tmp_path / run_id)] == ["ver-0.jsonl"]
        lines = posterior_rows(tmp_path / run_id)
        assert [x["prompt_id"] for x in lines] == [g.rollout.prompt_id for g in scored]
        for line, g in zip(lines, scored):
            assert line["completions"] == list(g.rollout.completions)
            assert line["truth"] == [int(t) for t in g.truth]
            if reward == "weaver":
                np.testing.assert_allclose(line["posterior"], g.rewards, atol=1e-4)
            else:
                assert line["posterior"] is None
                np.testing.assert_allclose(g.rewards, verifier.score_group(g.rollout.prompt, g.rollout.completions),
                                           atol=1e-6)
