"""Connections to the Redis-compatible server: retries with backoff through a restart,
credentials from the environment, TLS, and Redis Cluster clients that ride a master's restart.
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, SlotNotCoveredError
from redis.retry import Retry


CONNECT_RETRIES = 10


class _TransientRetry(Retry):
    """Retries what a server restart causes, never refused credentials: those fail at once."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def transient(error: Exception) -> bool:
            if isinstance(error, redis.AuthenticationError) or "NOAUTH" in str(error) or "WRONGPASS" in str(error):
                return False
            return is_retryable(error) if is_retryable else True

        return super().call_with_retry(do, fail, transient, with_failure_count)


class _RidingCluster(RedisCluster):
    """A cluster client whose every command rides through a master's restart.

    redis-py's cluster client retries a failed command ``retry.get_retries()`` times but
    without sleeping in between (it refreshes the slot table and tries again at once), so
    a master that takes a second to come back fails the command. This one wraps each
    command in a second retry with exponential backoff, as ``connect`` does on one server;
    transactions (``pipeline(transaction=True)``) already back off with the ``retry`` given.
    """

    def __init__(self, *args, **kwargs):
        self._backoff_retry = _TransientRetry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), CONNECT_RETRIES * 2,
                                              supported_errors=CLUSTER_ERRORS)
        super().__init__(*args, **kwargs)

    def _internal_execute_command(self, *args, **kwargs):
        return self._backoff_retry.call_with_retry(
            lambda: super(_RidingCluster, self)._internal_execute_command(*args, **dict(kwargs)), lambda error: None)


CLUSTER_ERRORS = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, SlotNotCoveredError)


def _connect_cluster(url: str, *, name: str, socket_timeout: float, extra: dict) -> RedisCluster:
    client = _RidingCluster.from_url(
        url, client_name=name, socket_timeout=socket_timeout, socket_connect_timeout=5,
        require_full_coverage=False,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), CONNECT_RETRIES,
                    supported_errors=CLUSTER_ERRORS),
        **extra)
    return client


def connect(url: str, *, name: str = "pipeline", socket_timeout: float = 30.0, redis_cfg=None) -> redis.Redis:
    """A client that retries with exponential backoff (up to ~10 s) when the server restarts.

    With ``redis_cfg.cluster`` it is a Redis Cluster client bootstrapped from the node at
    ``url``; its commands back off the same way while a master restarts (``_RidingCluster``).

    ``socket_timeout`` must exceed the longest ``BLOCK`` a caller uses, or redis-py
    reports a blocking read as a timeout. Credentials come from the URL
    (``redis://user:password@host``) or, to keep them out of config files, from the
    environment variables named by ``redis_cfg.username_env`` / ``password_env``.
    ``rediss://`` URLs use TLS, verified against ``redis_cfg.tls_ca_file`` (else the
    system CAs), with ``tls_cert_file``/``tls_key_file`` as the client certificate.
    """
    if not url:
        raise ValueError("redis.url: empty; pass --redis.url or set REDIS_URL")
    extra: dict = {}
    if redis_cfg is not None:
        user = os.environ.get(redis_cfg.username_env, "") if redis_cfg.username_env else ""
        password = os.environ.get(redis_cfg.password_env, "") if redis_cfg.password_env else ""
        parsed = urlparse(url)
        if password and not parsed.password:
            extra["password"] = password
            if user and not parsed.username:
                extra["username"] = user
        if url.startswith("rediss://"):
            for key, attr in (("ssl_ca_certs", "tls_ca_file"), ("ssl_certfile", "tls_cert_file"),
                              ("ssl_keyfile", "tls_key_file")):
                if getattr(redis_cfg, attr):
                    extra[key] = getattr(redis_cfg, attr)
    if redis_cfg is not None and redis_cfg.cluster:
        try:
            client = _connect_cluster(url, name=name, socket_timeout=socket_timeout, extra=extra)
            client.ping()
        except redis.RedisError as e:
            raise redis.ConnectionError(f"cannot reach the Redis Cluster at {_redact(url)}: {e}") from e
        return client
    client = redis.Redis.from_url(
        url,
        client_name=name,
        socket_timeout=socket_timeout,
        socket_connect_timeout=5,
        health_check_interval=30,
        retry=_TransientRetry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), CONNECT_RETRIES),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        **extra,
    )
    try:
        client.ping()
    except redis.AuthenticationError as e:
        raise redis.ConnectionError(f"Redis at {_redact(url)} refused the credentials: {e}") from e
    except redis.ResponseError as e:
        if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
            raise redis.ConnectionError(f"Redis at {_redact(url)} needs credentials: {e}") from e
        raise
    except redis.ConnectionError as e:
        raise redis.ConnectionError(
            f"cannot reach Redis at {_redact(url)} after {CONNECT_RETRIES} retries with backoff: {e}") from e
    return client


def _redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    p = urlparse(url)
    if not p.password:
        return url
    return p._replace(netloc=p.netloc.replace(f":{p.password}@", ":***@")).geturl()
