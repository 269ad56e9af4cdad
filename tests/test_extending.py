"""Adding a component from outside the package, as docs/extending.md says: one module of the
user's registers a task kind, an advantage, a loss, a weight transport and an environment,
the config names it in ``plugins``, and each new name is accepted by the config and resolved
by its registry, in a fresh process (each process of a run loads the same modules)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]

EXTENSION = textwrap.dedent('''
    """A lab's own components, each one registration line beside its code."""
    from pipeline.catalog import ADVANTAGES, ENVS, LOSSES, TASKS, TRANSPORTS
    from pipeline.tasks.base import Item
    from pipeline.weights.shm import ShmFetcher, ShmPublisher


    @TASKS.register("pairs")
    class PairSums:
        """Two-digit sums, the odd ones held out."""

        eval_max_new_tokens = 4

        def __init__(self, cfg):
            self.cfg = cfg

        def training(self, seed):
            a = seed
            while True:
                a = (a * 7 + 3) % 100
                if a % 2 == 0:
                    yield Item(prompt=f" {a:02d}+{a:02d}=", reference=str(2 * a))

        def heldout(self):
            return [Item(prompt=f" {a:02d}+{a:02d}=", reference=str(2 * a)) for a in range(1, 100, 2)]

        def answer(self, completion):
            return completion.strip() or None

        def correctness(self, reference, completions):
            return [float(c.strip() == reference) for c in completions]


    @ADVANTAGES.register("centered")
    def centered(rewards):
        return rewards - rewards.mean()


    @LOSSES.register("half_ppo")
    def half_ppo(logp, prox_logp, behav_logp, adv, mask, s):
        loss, stats = LOSSES["decoupled_ppo"](logp, prox_logp, behav_logp, adv, mask, s)
        return loss * 0.5, stats


    class Shm2Publisher(ShmPublisher):
        transport = "shm2"


    class Shm2Fetcher(ShmFetcher):
        transport = "shm2"


    TRANSPORTS.register("shm2", (Shm2Publisher, Shm2Fetcher), socket=False)


    @ENVS.register("echo")
    def echo(cfg):
        def make(task):
            return ("an episode of", task)
        return make
''')

CHECK = textwrap.dedent('''
    import json, sys
    import torch
    from pipeline import catalog
    from pipeline.algo.losses import LossSettings, advantages, objective
    from pipeline.config import load_config
    from pipeline.envs.registry import make_env
    from pipeline.tasks.registry import make_task
    from pipeline.weights import make_fetcher, make_publisher

    cfg = load_config(overrides={"plugins": sys.argv[1], "task.kind": "pairs", "trainer.advantage": "centered",
                                 "trainer.loss": "half_ppo", "weights.transport": "shm2", "env.kind": "echo",
                                 "generator.swap": "step"})
    ext = sys.modules[next(m for m in sys.modules if m.endswith("my_lab") or m.startswith("rlpipe_plugin_my_lab"))]
    out = {
        "names": [cfg.task.kind, cfg.trainer.advantage, cfg.trainer.loss, cfg.weights.transport, cfg.env.kind],
        "task": type(make_task(cfg.task)) is ext.PairSums,
        "advantage": catalog.ADVANTAGES.get("centered") is ext.centered
                     and advantages([torch.tensor([1.0, 0.0])], "centered").tolist() == [0.5, -0.5],
        "loss": catalog.LOSSES.get("half_ppo") is ext.half_ppo,
        "transport": catalog.TRANSPORTS.get("shm2") == (ext.Shm2Publisher, ext.Shm2Fetcher),
        "env": make_env(cfg)("t") == ("an episode of", "t"),
    }
    s = LossSettings.from_config(cfg.trainer)
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = objective(logp, torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([1.0, -1.0]), s)
    loss.backward()
    out["objective"] = bool(torch.isfinite(loss))
    if len(sys.argv) > 2:  # a real publish and fetch over the new transport
        import redis
        r = redis.Redis.from_url(sys.argv[2])
        pub = make_publisher("shm2", r, "ext:weights", ns="ext-test", announce_host=None)
        fetcher = make_fetcher("shm2", r, "ext:weights")
        pub.publish(1, {"w": torch.arange(6, dtype=torch.float32)})
        version, tensors = fetcher.fetch()
        out["fetched"] = [version, tensors["w"].tolist()]
        fetcher.close()
        pub.close()
    print(json.dumps(out))
''')


def _run(tmp_path: Path, plugin: str, *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "check.py").write_text(CHECK)
    out = subprocess.run([sys.executable, str(tmp_path / "check.py"), plugin, *extra], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def lab(tmp_path: Path) -> Path:
    (tmp_path / "my_lab.py").write_text(EXTENSION)
    return tmp_path


@pytest.mark.parametrize("plugin", ["my_lab", "my_lab.py"])
def test_one_module_adds_a_task_an_advantage_a_loss_a_transport_and_an_environment(lab, plugin, redis_url):
    got = _run(lab, plugin, redis_url)
    assert got.pop("names") == ["pairs", "centered", "half_ppo", "shm2", "echo"]
    assert got.pop("fetched") == [1, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    assert got == {"task": True, "advantage": True, "loss": True, "transport": True, "env": True, "objective": True}


def test_without_the_plugin_the_new_names_are_refused_with_the_registered_ones():
    with pytest.raises(ConfigError, match=r"weights\.transport: must be shm\|tcp\|ucx; got 'shm2'"):
        load_config(overrides={"weights.transport": "shm2"})
    with pytest.raises(ConfigError, match=r"task\.kind: must be arithmetic\|math\|reasoning_gym\|code, module:Class"):
        load_config(overrides={"task.kind": "pairs"})


def test_a_plugin_module_that_cannot_be_imported_is_refused_naming_the_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"plugins: cannot import module 'no_such_lab'"):
        load_config(overrides={"plugins": "no_such_lab"})


def test_a_name_registered_twice_is_refused():
    from pipeline.catalog import LOSSES

    with pytest.raises(ValueError, match=r"trainer\.loss: 'tis' is registered already"):
        LOSSES.register("tis", lambda *a: None)
