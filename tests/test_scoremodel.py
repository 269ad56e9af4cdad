"""The label model that keeps the scores (pipeline/algo/scoremodel.py), on synthetic votes with a known truth."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.algo.labelmodel import fit_label_model
from pipeline.algo.scoremodel import _auc, family, fit_score_model

pytestmark = pytest.mark.one_server

JUDGES = ["lm_judge:m@x", "lm_judge:m@y", "lm_judge:m@z"]


def make_votes(*, n: int = 2000, pi: float = 0.2, shared: float = 0.0, seed: int = 0):
    """Three independent verifiers of falling strength and three judges of one model that share a
    nuisance of strength ``shared``: (votes [n, 6], truth [n], names)."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < pi).astype(float)
    nuisance = rng.normal(size=n)
    cols = [1 / (1 + np.exp(-(s * (2 * y - 1) + rng.normal(size=n)))) for s in (2.0, 1.0, 0.7)]
    cols += [1 / (1 + np.exp(-(0.5 * (2 * y - 1) + shared * nuisance + 0.5 * rng.normal(size=n)))) for _ in JUDGES]
    return np.stack(cols, axis=1), y, ["a", "b", "c", *JUDGES]


def test_judges_of_one_model_are_one_family_and_count_once():
    assert family("lm_judge:artifacts/x@configs/judges/a.toml") == family("lm_judge:artifacts/x@solve")
    # the answer-level checks read one group's extracted answers: one family (not in the earlier fit)
    assert family("self_consistency:last_number") == family("states_answer:last_number") == family("answer_only")
    assert family("self_consistency:last_number", answers=False) == "self_consistency:last_number"
    assert family("mod9") == "mod9" and family("lm_judge:tcp://h:1") == "lm_judge:tcp://h:1"
    v, _, names = make_votes()
    weights = fit_score_model(v, names).report()["weights"]
    assert weights == {"a": 1.0, "b": 1.0, "c": 1.0, **dict.fromkeys(JUDGES, 0.333)}


def test_label_free_it_finds_pi_and_ranks_as_well_as_the_best_verifier():
    v, y, names = make_votes()
    m = fit_score_model(v, names)
    assert abs(m.pi - y.mean()) < 0.03 and m.sane and m.used == "fit"
    assert _auc(m.posterior(v, names), y) >= max(_auc(v[:, j], y) for j in range(v.shape[1])) - 0.01


def test_judges_sharing_an_error_do_not_pull_pi_up_as_they_pull_the_binarised_model():
    v, y, names = make_votes(shared=1.5)
    m = fit_score_model(v, names)
    weaver = fit_label_model(v, names)
    assert abs(m.pi - y.mean()) < 0.05 < abs(weaver.pi - y.mean())
    assert _auc(m.posterior(v, names), y) > _auc(np.asarray(weaver.posterior(v, names)), y) + 0.1


def test_y_is_the_component_the_verifiers_favour_even_when_right_answers_are_few():
    for pi in (0.08, 0.5, 0.85):
        v, y, names = make_votes(pi=pi, seed=3)
        m = fit_score_model(v, names)
        assert abs(m.pi - y.mean()) < 0.05, pi
        assert _auc(m.posterior(v, names), y) > 0.9
        assert sum(f > 0 for f in m.favour) == len(names)


def test_abstentions_leave_a_row_scored_by_the_others():
    v, y, names = make_votes()
    v[::3, 0] = np.nan
    m = fit_score_model(v, names)
    p = m.posterior(v, names)
    assert np.isfinite(p).all() and _auc(p, y) > 0.95


def test_a_sound_verifier_failing_makes_a_row_wrong():
    v, y, names = make_votes()
    states = np.where((y == 1) | (np.arange(len(y)) % 2 == 0), 1.0, 0.0)  # right answers always pass
    m = fit_score_model(np.column_stack([v, states]), [*names, "states_answer"], sound=["states_answer"])
    p = m.posterior(np.column_stack([v, states]), [*names, "states_answer"])
    assert p[states == 0].max() < 1e-3


def test_labels_guard_falls_back_to_the_best_single_verifier_when_the_fit_loses_on_them():
    rng = np.random.default_rng(5)
    n = 2000
    y = (rng.random(n) < 0.3).astype(float)
    nuisance = rng.normal(size=n)
    strong = 1 / (1 + np.exp(-(1.5 * (2 * y - 1) + 0.5 * rng.normal(size=n))))
    # four judges of four models that agree on a nuisance and say nothing about correctness
    fooled = [1 / (1 + np.exp(-(2 * nuisance + 0.3 * rng.normal(size=n)))) for _ in range(4)]
    v = np.column_stack([strong, *fooled])
    names = ["strong", "f1", "f2", "f3", "f4"]
    free = fit_score_model(v, names)
    assert _auc(free.posterior(v, names), y) < 0.7  # label-free, the shared nuisance wins
    labelled = rng.choice(n, size=128, replace=False)
    m = fit_score_model(v, names, labels=(labelled, y[labelled]))
    assert m.used == "single:strong" and m.report()["labels"] == 128
    assert _auc(m.posterior(v, names), y) > 0.9
    ok = fit_score_model(*make_votes()[::2], labels=None)  # without labels nothing is guarded
    assert ok.used == "fit"


def fooled_votes(strengths, *, n: int = 2000, pi: float = 0.06, seed: int = 0):
    """Verifiers of the given strengths, each independent given the truth, and four judges of four
    models that agree on a nuisance and say nothing about correctness (so the label-free fit
    follows the nuisance): (votes [n, k + 4], truth [n], names)."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < pi).astype(float)
    nuisance = rng.normal(size=n)
    cols = [1 / (1 + np.exp(-(s * (2 * y - 1) + rng.normal(size=n)))) for s in strengths]
    cols += [1 / (1 + np.exp(-(2 * nuisance + 0.3 * rng.normal(size=n)))) for _ in range(4)]
    return np.column_stack(cols), y, [f"v{i}" for i in range(len(strengths))] + ["f1", "f2", "f3", "f4"]


def test_with_few_positives_the_guard_finds_the_best_verifier_among_noisy_ones():
    # ~8 positives among 128 labels: one verifier clearly best, five weaker ones whose label AUC
    # can beat it by chance; the guard's rule, scored out of bag, always keeps the best one (alone
    # or averaged with the runner-up) and its AUC near the best one's.
    v, y, names = fooled_votes([2.0, 0.6, 0.6, 0.5, 0.5, 0.4], seed=11)
    best = _auc(v[:, 0], y)
    got, pis = [], []
    for seed in range(6):
        labelled = np.random.default_rng(seed).choice(len(y), size=128, replace=False)
        m = fit_score_model(v, names, labels=(labelled, y[labelled]))
        assert m.used != "fit" and "v0" in m.used.split(":")[1].split(","), m.used
        got.append(_auc(m.posterior(v, names), y))
        pis.append(m.pi)
    assert np.mean(got) >= best - 0.02 and min(got) >= best - 0.05 and abs(np.mean(pis) - y.mean()) < 0.03


def test_two_equal_verifiers_are_averaged_when_the_labels_cannot_tell_them_apart():
    v, y, names = fooled_votes([1.2, 1.2], pi=0.1, seed=4)
    labelled = np.random.default_rng(4).choice(len(y), size=128, replace=False)
    m = fit_score_model(v, names, labels=(labelled, y[labelled]))
    assert m.used == "rank-mean:v0,v1" or m.used == "rank-mean:v1,v0", m.used
    assert _auc(m.posterior(v, names), y) > max(_auc(v[:, 0], y), _auc(v[:, 1], y)) + 0.02
    oob = m.report()["label_auc"]["out_of_bag"]
    assert oob["top2"] > max(oob["fit"], oob["top1"])


def test_with_labels_the_fit_is_kept_when_it_wins_and_reports_the_labelled_share():
    # The earlier guard (highest mean) keeps a fit that ties the best single verifier on 32 labels;
    # the default keeps the simpler single verifier unless the fit beats it on a clear majority.
    v, y, names = make_votes(shared=1.5, seed=7)
    labelled = np.random.default_rng(7).choice(len(y), size=32, replace=False)
    m = fit_score_model(v, names, labels=(labelled, y[labelled]), guard="mean")
    r = m.report()
    assert m.used == "fit" and r["label_auc"]["fit"] >= r["label_auc"]["best_single_auc"]
    assert r["label_share"] == pytest.approx((y[labelled].sum() + 1) / 34, abs=1e-4)
    assert abs(m.pi - y.mean()) < 0.05
    simple = fit_score_model(v, names, labels=(labelled, y[labelled]))
    assert simple.used == "single:a" and simple.report()["label_auc"]["beats_top1"]["fit"] < 0.9
    assert _auc(simple.posterior(v, names), y) >= _auc(m.posterior(v, names), y) - 0.01


def test_with_labels_a_combination_is_kept_when_it_clearly_beats_the_best_single_verifier():
    # five independent verifiers of equal, moderate strength: together far better than any one
    rng = np.random.default_rng(2)
    n = 2000
    y = (rng.random(n) < 0.3).astype(float)
    v = np.column_stack([1 / (1 + np.exp(-(0.9 * (2 * y - 1) + rng.normal(size=n)))) for _ in range(5)])
    names = [f"v{i}" for i in range(5)]
    labelled = rng.choice(n, size=128, replace=False)
    m = fit_score_model(v, names, labels=(labelled, y[labelled]))
    assert m.used.split(":")[0] != "single", m.report()["label_auc"]
    assert _auc(m.posterior(v, names), y) > max(_auc(v[:, j], y) for j in range(5)) + 0.05


def panel_votes(*, n: int = 2000, pi: float = 0.08, seed: int = 0):
    """A panel like the recorded one: two judge models, each asked in one informative style and two
    uninformative ones that share the model's nuisance; and the three answer-level checks, which
    follow one shared quantity (how popular an answer is) that says little about correctness."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < pi).astype(float)
    cols, names = [], []
    for model in ("A", "B"):
        nuisance = rng.normal(size=n)
        for style, s in (("qa", 1.5), ("check", 0.0), ("solve", 0.0)):
            cols.append(1 / (1 + np.exp(-(s * (2 * y - 1) + nuisance + 0.7 * rng.normal(size=n)))))
            names.append(f"lm_judge:{model}@{style}")
    popular = rng.normal(size=n) + 0.3 * (2 * y - 1)
    cols += [np.round(np.clip((popular + 2) / 4, 0, 1) * 4) / 4, (popular + 0.3 * rng.normal(size=n) > -0.5) * 1.0,
             (popular + 0.3 * rng.normal(size=n) > 0) * 1.0]
    names += ["self_consistency:last_number", "states_answer:last_number", "answer_only:last_number"]
    return np.column_stack(cols), y, names


def test_a_dependent_answer_family_that_fooled_the_earlier_fit_leaves_the_factor_to_the_judges():
    for seed in range(3):
        v, y, names = panel_votes(seed=seed)
        old = fit_score_model(v, names, free="em")
        new = fit_score_model(v, names)
        assert _auc(old.posterior(v, names), y) < 0.8  # EM splits on the answer-level checks
        assert new.used == "factor" and any("common factor" in w for w in new.warnings)
        loadings = dict(zip(new.names, new.factor["loadings"]))
        for model in ("A", "B"):
            assert loadings[f"lm_judge:{model}@qa"] > max(0.1, *(abs(loadings[f"lm_judge:{model}@{s}"])
                                                               for s in ("check", "solve")))
        got = _auc(new.posterior(v, names), y)
        assert got > 0.9 and got > _auc(v.mean(axis=1), y) + 0.1


def test_label_free_the_factor_is_signed_by_the_verifiers_and_keeps_a_fit_that_follows_it():
    for pi in (0.08, 0.5, 0.85):
        v, y, names = make_votes(pi=pi, shared=1.5, seed=3)
        m = fit_score_model(v, names)
        assert m.used == "fit" and m.agreement >= 0.75 and sum(m.factor["loadings"]) > 0
        assert _auc(-m.factor["loadings"][0] * v[:, 0], y) < 0.5 < _auc(m.posterior(v, names), y)


def test_a_constant_column_is_left_out_and_none_left_is_refused():
    v, y, names = make_votes()
    m = fit_score_model(np.column_stack([v, np.ones(len(y))]), [*names, "const"])
    assert "const" not in m.names and np.isfinite(m.posterior(np.column_stack([v, np.ones(len(y))]),
                                                              [*names, "const"])).all()
    with pytest.raises(ValueError, match="no verifier has two distinct scores"):
        fit_score_model(np.ones((10, 2)), ["x", "y"])


def test_a_fit_survives_its_dict_form_as_the_verifier_stage_stores_it():
    import msgpack

    from pipeline.algo.scoremodel import ScoreModel

    v, y, names = make_votes()
    labelled = np.arange(0, 400, 5)
    pv, _, pnames = panel_votes()
    factor = fit_score_model(pv, pnames, sound=["states_answer:last_number"])
    assert factor.used == "factor"
    back = ScoreModel.from_dict(msgpack.unpackb(msgpack.packb(factor.to_dict())))
    np.testing.assert_array_equal(back.posterior(pv, pnames), factor.posterior(pv, pnames))
    for m in (fit_score_model(v, names, version=3), fit_score_model(v, names, labels=(labelled, y[labelled]))):
        back = ScoreModel.from_dict(msgpack.unpackb(msgpack.packb(m.to_dict())))
        np.testing.assert_array_equal(back.posterior(v, names), m.posterior(v, names))
        assert back.report() == m.report()


@pytest.mark.parametrize("labels", [0, 16])
def test_the_verifier_stage_fits_the_score_model_when_configured_and_logs_which(tmp_path, tiny_base_model,
                                                                               redis_client, redis_url, labels):
    import json

    from builders import make_rollout

    from pipeline.bus.streams import FIELD
    from pipeline.config import load_config
    from pipeline.consumers.verifier import run_verifier
    from pipeline.keys import Keys
    from pipeline.observe.logs import setup_logging
    from pipeline.records import ScoredGroup

    cfg = load_config(overrides={
        "run_id": "scores", "runs_dir": str(tmp_path), "redis.url": redis_url, "model.base_dir": str(tiny_base_model),
        "verifier.verifiers": "format,mod9,units_digit,self_consistency", "verifier.reward": "weaver",
        "verifier.label_model": "scores", "verifier.labels": labels, "verifier.min_fit_rows": 8,
        "verifier.batch": 4})
    keys = Keys(cfg.run_id)
    answers = ["357", "356", "357", "12", "357", "358", "3570", "357"]
    for i in range(4):
        redis_client.xadd(keys.shard(0).rollouts, {FIELD: make_rollout(
            prompt_id=f"p{i:08d}", completions=tuple(answers[(i + k) % 8] for k in range(8))).encode()})
    log = setup_logging(tmp_path / "logs", stage="verifier", worker="ver-0")
    assert run_verifier(cfg, redis_client, keys, "ver-0", log, max_batches=1) == 4
    scored = [ScoredGroup.decode(f[FIELD]) for _, f in redis_client.xrange(keys.shard(0).scored)]
    assert len(scored) == 4 and all(np.isfinite(g.rewards).all() for g in scored)
    right = np.concatenate([g.rewards[np.array(g.rollout.completions) == "357"] for g in scored])
    wrong = np.concatenate([g.rewards[np.array(g.rollout.completions) != "357"] for g in scored])
    assert right.mean() > wrong.mean()
    fits = [json.loads(line) for line in (tmp_path / "logs" / "ver-0.jsonl").read_text().splitlines()
            if '"labelmodel_fitted"' in line]
    assert fits and fits[-1]["method"] == "scores" and fits[-1]["labels"] == labels
    assert fits[-1]["used"] in ("fit", "factor") or (labels and fits[-1]["used"].split(":")[0] in ("single",
                                                                                                 "rank-mean"))
    assert redis_client.llen(keys.labels) == (4 if labels else 0)  # a batch of 4 groups, kept whole
    if labels:
        assert 0 < fits[-1]["label_share"] < 1 and "best_single" in fits[-1]["label_auc"]


def test_labels_need_the_score_model():
    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"verifier\.labels: must be 0 unless verifier\.label_model = \"scores\""):
        load_config(overrides={"verifier.labels": 32})
    assert load_config(overrides={"verifier.labels": 32, "verifier.label_model": "scores"}).verifier.labels == 32


def test_the_panel_bench_compares_every_method_from_a_recorded_cache(tmp_path):
    """bench/bench_panel.py's comparison, on a cache of synthetic groups (the recording needs the models)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_panel

    v, y, names = make_votes(n=8 * 48, shared=1.5)
    task = {"key": "synthetic", "dataset": "synthetic", "params": {}, "chosen": True, "distinct_in_2000": 2000,
            "pilot_accuracy": 0.2}
    (tmp_path / "pilot.json").write_text(json.dumps([task]))
    with open(tmp_path / "synthetic.jsonl", "w") as f:
        for i in range(48):
            rows = slice(8 * i, 8 * i + 8)
            f.write(json.dumps({"i": i, "names": names, "truth": y[rows].tolist(), "votes": v[rows].tolist(),
                                "seconds": dict.fromkeys(names, 0.8)}) + "\n")
    result = bench_panel.analyse(tmp_path, tmp_path / "out")
    t = result["tasks"]["synthetic"]
    assert t["completions"] == 384 and t["best_single"] == "a"
    current = "label model (current)"
    assert set(t["methods"]) == {"best single verifier", "mean", "majority vote", f"{current}, label-free",
                                 f"{current}, pi from 32 labels", f"{current}, pi from 128 labels",
                                 "score model, label-free", "score model, 32 labels", "score model, 128 labels",
                                 "score model (earlier), label-free", "score model (earlier), 128 labels"}
    for f in t["methods"].values():
        assert 0 <= f["auc"] <= 1 and 0 <= f["selection_accuracy"] <= 1 and f["pi_error"] >= 0
    assert t["members"]["a"]["seconds_per_completion"] == pytest.approx(0.1)
    md = (tmp_path / "out" / "panel.md").read_text()
    assert "## synthetic" in md and "| score model, 128 labels |" in md
    assert len(t["targets"]) == 5 and all(a["met"] in (True, False) for a in t["targets"])
    assert "| label-free pi error <= 0.05 |" in md


def test_the_guard_scores_the_fit_on_labels_it_did_not_hold():
    # Verifiers that say nothing: held at their truth, the labels make the fit look good on
    # themselves; scored on labels a fit did not hold (the default guard) it is at chance.
    for seed in range(3):
        rng = np.random.default_rng(seed)
        y = (rng.random(2000) < 0.1).astype(float)
        v, names = rng.random((2000, 5)), [f"n{i}" for i in range(5)]
        labelled = rng.choice(2000, size=128, replace=False)
        in_sample = fit_score_model(v, names, labels=(labelled, y[labelled]), guard="mean").report()["label_auc"]
        crossed = fit_score_model(v, names, labels=(labelled, y[labelled])).report()["label_auc"]
        assert in_sample["out_of_bag"]["fit"] > 0.6 and crossed["out_of_bag"]["fit"] < 0.6


def test_the_panel_bench_measures_how_judges_of_two_models_agree_on_wrong_answers(monkeypatch):
    """bench_panel.wrong_answer_agreement: a nuisance each prompt puts into both models' scores shows as a
    rank correlation of the same-prompt pairs on the wrong answers; judges independent given the truth
    show none; rows a sound check fails (every judge at its floor) are left out."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_panel

    names = ["lm_judge:m1@p", "lm_judge:m1@q", "lm_judge:m2@p", "lm_judge:m2@q", "states_answer:last_number"]
    rng = np.random.default_rng(0)
    n = 4000
    y = (rng.random(n) < 0.1).astype(float)
    stated = rng.random(n) < 0.8  # the rest fail the sound check: every judge at 0
    for shared, low, high in ((2.0, 0.6, 1.0), (0.0, -0.1, 0.1)):
        nuis = {p: rng.normal(size=n) for p in "pq"}
        cols = [1 / (1 + np.exp(-(2 * y - 1 + shared * nuis[name[-1]] + rng.normal(size=n)))) for name in names[:4]]
        v = np.stack([*(np.where(stated, c, 0.0) for c in cols), stated.astype(float)], axis=1)
        w = bench_panel.wrong_answer_agreement(v.reshape(-1, 8, 5), y.reshape(-1, 8), names,
                                               ["states_answer:last_number"])
        assert w["wrong_answers"] == int(((y == 0) & stated).sum())
        assert sorted((x["a"], x["b"]) for x in w["same_prompt"]) == [("lm_judge:m1@p", "lm_judge:m2@p"),
                                                                      ("lm_judge:m1@q", "lm_judge:m2@q")]
        assert len(w["different_prompt"]) == 2  # m1@p-m2@q, m1@q-m2@p; pairs of one model are not counted
        assert all(low < x["r"] < high for x in w["same_prompt"])
        assert all(-0.1 < x["r"] < 0.1 for x in w["different_prompt"])


def test_label_free_it_warns_when_the_common_factor_does_not_follow_the_verifiers_together():
    # Four verifiers of four families, each a little better than random, and a taste they all
    # share, two of them with it and two against it: the common factor is the taste (its
    # loadings of both signs), the verifiers' mean rank is the truth's. Said, not changed.
    rng = np.random.default_rng(5)
    n = 3000
    y = (rng.random(n) < 0.1).astype(float)
    taste = rng.normal(size=n)
    v = np.stack([1 / (1 + np.exp(-(0.8 * y + s * 1.5 * taste + rng.normal(size=n)))) for s in (1, -1, 1, -1)], axis=1)
    names = ["a", "b", "c", "d"]
    m = fit_score_model(v, names)
    said = [w for w in m.warnings if "follows the verifiers' mean rank" in w]
    assert said and not m.sane
    assert abs(_auc(v.mean(axis=1), y) - 0.5) > 0.1 > abs(_auc(m.posterior(v, names), y) - 0.5)
    clean, _, clean_names = make_votes(pi=0.08, seed=3)
    assert not [w for w in fit_score_model(clean, clean_names).warnings if "mean rank" in w]
