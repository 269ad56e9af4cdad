"""User code named in the config: a verifier, a labelled reward, an advantage and a loss, each in
the user's own file outside the package, checked before launch and used by a real run."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from harness import CLI, TINY

from pipeline import plugins
from pipeline.algo.losses import ADVANTAGES, LOSSES, LossSettings, advantages, resolve
from pipeline.algo.rewards import parse_reward_mode
from pipeline.config import ConfigError, load_config
from pipeline.verifiers.registry import check_spec, resolve as resolve_verifier

pytestmark = pytest.mark.one_server

USER_CODE = textwrap.dedent('''
    """A researcher's own extensions, outside the package."""
    import numpy as np
    import torch

    from pipeline.algo.losses import LOSSES

    CALLS = {"verifier": 0}


    def ends_in_digit(prompt, completions):
        CALLS["verifier"] += 1
        return np.array([1.0 if c.strip()[-1:].isdigit() else 0.0 for c in completions], dtype=np.float32)


    def exact(prompts, completions, reference, extracted, **kw):
        """TRL's shape: lists in, one float per completion out."""
        return [1.0 if e is not None and e == r else 0.0 for e, r in zip(extracted, reference)]


    def centered(rewards):
        return rewards - rewards.mean()


    def scaled_ppo(logp, prox_logp, behav_logp, adv, mask, s):
        loss, stats = LOSSES["decoupled_ppo"](logp, prox_logp, behav_logp, adv, mask, s)
        return loss * 0.5, {**stats, "scaled": 0.5}


    class TwoDigitSums:
        """A task of one's own: two-digit sums, the odd ones held out (so training never sees one)."""

        eval_max_new_tokens = 4

        def __init__(self, cfg):
            from pipeline.tasks.base import Item

            self.Item = Item
            self.cfg = cfg

        def _item(self, a, b):
            return self.Item(prompt=f" {a:02d}+{b:02d}=", reference=str(a + b))

        def training(self, seed):
            import random

            rng = random.Random(seed)
            while True:
                a, b = rng.randrange(100), rng.randrange(100)
                if (a + b) % 2 == 0:
                    yield self._item(a, b)

        def heldout(self):
            return [self._item(a, 7) for a in range(1, 40, 2)]

        def answer(self, completion):
            digits = "".join(c for c in completion.strip().split(" ")[0] if c.isdigit())
            return digits or None

        def correctness(self, reference, completions):
            return np.array([1.0 if self.answer(c) == reference else 0.0 for c in completions], dtype=np.float32)
''')


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "my_ext.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_specs_load_from_a_module_and_from_a_file(user_dir):
    check_spec("my_ext:ends_in_digit")
    check_spec("my_ext.py:ends_in_digit")
    scores = resolve_verifier("my_ext:ends_in_digit")(" 1+2=", ["3", "x"])
    assert list(scores) == [1.0, 0.0]
    mode = parse_reward_mode("my_ext:exact")
    assert mode.kind == "labelled" and mode.uses_truth
    got = mode(votes=np.zeros((3, 1)), names=["a"], completions=["3", "4", ""], prompt=" 1+2=", reference="3",
               answer=lambda c: c or None)
    assert list(got) == [1.0, 0.0, 0.0]
    assert resolve(ADVANTAGES, "advantage", "my_ext:centered") is plugins.load("my_ext:centered")
    import torch

    adv = advantages([torch.tensor([1.0, 0.0, 0.5])], "my_ext:centered")
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0]))
    LossSettings(advantage="my_ext:centered", loss="my_ext:scaled_ppo")
    assert "decoupled_ppo" in LOSSES


@pytest.mark.parametrize("spec, message", [
    ("my_ext:no_such", "has no attribute 'no_such'"),
    ("no_such_module:f", "cannot import module 'no_such_module'"),
    ("missing.py:f", "no such file 'missing.py'"),
    ("my_ext:CALLS", "not a callable"),
])
def test_a_bad_spec_is_refused_with_what_was_tried(user_dir, spec, message):
    with pytest.raises(ValueError, match=message):
        check_spec(spec)
    with pytest.raises(ValueError, match=message):
        parse_reward_mode(spec)


def test_a_typo_in_any_spec_fails_before_launch_naming_the_field(user_dir):
    from pipeline.run.preflight import registry_problems

    cfg = load_config(overrides={"verifier.verifiers": "format,my_ext:ends_in_digt", "verifier.reward": "my_ext:exct",
                                 "trainer.advantage": "my_ext:centred", "trainer.loss": "my_ext:scaled_pp",
                                 "task.kind": "my_ext:TwoDigitSum", "generator.swap": "step",
                                 "env.kind": "my_ext:calculatr"})
    problems = registry_problems(cfg)
    for field in ("verifier.verifiers", "verifier.reward", "trainer.advantage", "trainer.loss", "task.kind",
                  "env.kind"):
        assert any(p.startswith(f"{field}: ") for p in problems), (field, problems)
    with pytest.raises(ConfigError, match=r"trainer\.loss"):
        load_config(overrides={"trainer.loss": "ppo2"})  # neither built in nor an entry point nor module:attr


@pytest.mark.slow
def test_a_run_uses_the_users_verifier_labelled_reward_advantage_and_loss(tmp_path, tiny_base_model):
    import os
    import subprocess

    (tmp_path / "my_ext.py").write_text(USER_CODE)
    # The small test run without its label-model setting: a labelled reward fits no label model.
    (tmp_path / "run.toml").write_text(TINY.read_text().replace("min_fit_rows = 16", ""))
    args = [*CLI, "up", "--config", "run.toml", "--runs_dir", "runs", "--model.base_dir", str(tiny_base_model),
            "--run-id", "plugins", "--trainer.steps", "4", "--trainer.eval_every", "4",
            "--verifier.verifiers", "format,units_digit,my_ext:ends_in_digit", "--verifier.reward", "my_ext:exact",
            "--trainer.advantage", "my_ext:centered", "--trainer.loss", "my_ext:scaled_ppo",
            "--task.kind", "my_ext:TwoDigitSums", "--task.max_new_tokens", "4"]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    out = p.communicate(timeout=600)[0].decode()
    assert p.returncode == 0, out[-3000:]
    run = tmp_path / "runs" / "plugins"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["accounting"]["ok"], summary["accounting"]
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    assert steps and all(s.get("scaled") == 0.5 for s in steps if s["groups_trained"]), steps[-1]
    # The labelled reward is the task's own check here, so reward and sampled accuracy agree.
    assert all(abs(s["reward_mean"] - s["sample_accuracy"]) < 1e-6 for s in steps), steps
    # The user's task made the prompts (even sums only) and the held-out set (20 odd sums).
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert evals and all(e["n"] == 20 for e in evals), evals
    ledger_ids = summary["accounting"]["issued"]
    assert ledger_ids > 0
