"""Connections to the Redis-compatible server: retries with backoff through a restart or an
outage, credentials from the environment, TLS, and Redis Cluster clients that ride a master's restart.

Every client retries what a server restart or outage causes (refused or dropped connections,
timeouts, ``LOADING``) with capped exponential backoff and full jitter, never refused
credentials. How long it keeps trying is ``connect``'s ``retries``: a finite budget
(``CONNECT_RETRIES``, about 10 s) for the driver and short commands, which then fail with a
clear message; ``None`` for stage workers, which wait out an outage of any length
(``ride_outages`` turns an existing client into one). A client that rides outages logs one
warning when an outage starts (``redis_unreachable``) and one info line with its duration
when the server answers again (``redis_reachable``).

A retried call is sent again whole, so a write whose reply was lost is applied again unless
it carries its own idempotency check: every transaction of the pipeline does
(``bus.streams.TxnWriter``, docs/design.md §2).
"""

from __future__ import annotations

import os
import threading
import time
from urllib.parse import urlparse

import redis
import structlog
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException, SlotNotCoveredError
from redis.retry import Retry

CONNECT_RETRIES = 10
"""The finite retry budget (``connect``'s default): about 10 s of backoff, for the driver and short commands."""
BACKOFF_BASE_S = 0.05
"""First backoff step; each retry doubles it, with full jitter, up to ``BACKOFF_CAP_S``."""
BACKOFF_CAP_S = 2.0
"""Longest wait between two tries, so a client notices a server that came back within ~2 s."""


class _CappedBackoff(ExponentialWithJitterBackoff):
    """redis-py's exponential backoff with jitter, whose exponent stops growing once past the cap.

    redis-py computes ``base * 2**failures`` as a float, which overflows (OverflowError)
    after about 1000 failures: some 20 minutes into an outage at a 2 s cap. A client that
    waits forever must keep computing its backoff.
    """

    def compute(self, failures: int) -> float:
        return super().compute(min(failures, 32))


def _backoff() -> ExponentialWithJitterBackoff:
    return _CappedBackoff(base=BACKOFF_BASE_S, cap=BACKOFF_CAP_S)


def _refused_credentials(error: Exception) -> bool:
    return isinstance(error, redis.AuthenticationError) or "NOAUTH" in str(error) or "WRONGPASS" in str(error)


class _Outage:
    """One client's view of an outage, shared by all its connections: a warning when the first
    call fails, an info line with the outage's duration when a call succeeds again."""

    def __init__(self, log, retries: int | None):
        self.log, self.retries = log, retries
        self.since: float | None = None
        self.failures = 0
        self.failed_calls = 0
        """Calls that failed with a transient error and were sent again, however long ago (``failed_calls``)."""
        self._lock = threading.Lock()

    def _logger(self):
        """The log to tell; a finite-budget client without one stays silent (its caller reports the failure)."""
        if self.log is not None or self.retries is not None:
            return self.log
        return structlog.get_logger()

    def failed(self, error: Exception) -> None:
        with self._lock:
            self.failures += 1
            self.failed_calls += 1
            if self.since is not None:
                return
            self.since = time.monotonic()
        if (log := self._logger()) is not None:
            log.warning("redis_unreachable", error=str(error)[:300],
                        retrying="until it answers" if self.retries is None else f"{self.retries} times")

    def ended(self) -> None:
        if self.since is None:  # the common case: no outage, no lock
            return
        with self._lock:
            if self.since is None:
                return
            seconds, failures = time.monotonic() - self.since, self.failures
            self.since, self.failures = None, 0
        if (log := self._logger()) is not None:
            log.info("redis_reachable", seconds=round(seconds, 3), failed_tries=failures)

    def __deepcopy__(self, memo) -> "_Outage":
        return self


class _TransientRetry(Retry):
    """Retries what a server restart or outage causes, never refused credentials: those fail at once.

    ``retries`` None retries forever. One object serves every connection of its client
    (redis-py copies the retry into each connection; copying returns the same object), so an
    outage is logged once however many connections notice it.
    """

    def __init__(self, retries: int | None, *, supported_errors: tuple = (redis.ConnectionError, redis.TimeoutError),
                 log=None):
        super().__init__(_backoff(), -1 if retries is None else retries, supported_errors=supported_errors)
        self.outage = _Outage(log, retries)

    def __deepcopy__(self, memo) -> "_TransientRetry":
        return self

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def transient(error: Exception) -> bool:
            if _refused_credentials(error):
                return False
            return is_retryable(error) if is_retryable else True

        def failed(error: Exception, count: int):
            self.outage.failed(error)
            return fail(error, count) if with_failure_count else fail(error)

        result = super().call_with_retry(do, failed, transient, True)
        self.outage.ended()
        return result


CLUSTER_ERRORS = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, SlotNotCoveredError)


class _RidingCluster(RedisCluster):
    """A cluster client whose every command rides through a master's restart.

    redis-py's cluster client retries a failed command ``retry.get_retries()`` times but
    without sleeping in between (it refreshes the slot table and tries again at once), so
    a master that takes a second to come back fails the command. This one wraps each
    command in a second retry with exponential backoff (``_backoff_retry``: twice the
    budget ``connect`` was given, or forever), as ``connect`` does on one server.
    Transactions (``pipeline(transaction=True)``) back off with the finite ``retry`` given.
    """

    def __init__(self, *args, outer_retries: int | None = CONNECT_RETRIES * 2, log=None, **kwargs):
        self._backoff_retry = _TransientRetry(outer_retries, supported_errors=CLUSTER_ERRORS, log=log)
        self._node_failures = 0
        """Commands that failed on a node (redis-py's own retry sends them again at once: ``failed_calls``)."""
        super().__init__(*args, **kwargs)

    def _execute_command(self, target_node, *args, **kwargs):
        try:
            return super()._execute_command(target_node, *args, **kwargs)
        except CLUSTER_ERRORS:
            self._node_failures += 1
            raise

    def _internal_execute_command(self, *args, **kwargs):
        return self._backoff_retry.call_with_retry(
            lambda: super(_RidingCluster, self)._internal_execute_command(*args, **dict(kwargs)), lambda error: None)


def _connect_cluster(url: str, *, name: str, socket_timeout: float, extra: dict, retries: int | None,
                     log) -> RedisCluster:
    """The cluster client; bootstrapping its slot table is retried within the same budget as its commands."""
    attempt, backoff, outage = 0, _backoff(), _Outage(log, retries)
    while True:
        try:
            client = _RidingCluster.from_url(
                url, client_name=name, socket_timeout=socket_timeout, socket_connect_timeout=5,
                require_full_coverage=False,
                retry=Retry(_backoff(), CONNECT_RETRIES, supported_errors=CLUSTER_ERRORS),
                outer_retries=None if retries is None else retries * 2, log=log, **extra)
            outage.ended()
            return client
        except (RedisClusterException, *CLUSTER_ERRORS) as e:
            if _refused_credentials(e):
                raise
            attempt += 1
            if retries is not None and attempt > retries:
                raise
            outage.failed(e)
            time.sleep(backoff.compute(attempt))


def connect(url: str, *, name: str = "pipeline", socket_timeout: float = 30.0, redis_cfg=None,
            retries: int | None = CONNECT_RETRIES, log=None) -> redis.Redis:
    """A client that retries with exponential backoff when the server restarts or is down.

    ``retries``: how many times a call is retried (backoff capped at ``BACKOFF_CAP_S``); the
    default, ``CONNECT_RETRIES``, gives up after about 10 s with a clear error, for the driver
    and short commands; ``None`` never gives up, for stage workers, and logs the outage on
    ``log`` (a structlog logger; default: the process's). Refused credentials fail at once.

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
    if retries is not None and retries < 0:
        raise ValueError(f"retries: must be >= 0 or None (forever); got {retries}")
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
    budget = "retrying until it answers" if retries is None else f"after {retries} retries with backoff"
    if redis_cfg is not None and redis_cfg.cluster:
        try:
            client = _connect_cluster(url, name=name, socket_timeout=socket_timeout, extra=extra, retries=retries,
                                      log=log)
            client.ping()
        except redis.RedisError as e:
            raise redis.ConnectionError(f"cannot reach the Redis Cluster at {_redact(url)} ({budget}): {e}") from e
        return client
    client = redis.Redis.from_url(
        url,
        client_name=name,
        socket_timeout=socket_timeout,
        socket_connect_timeout=5,
        health_check_interval=30,
        retry=_TransientRetry(retries, log=log),
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
        raise redis.ConnectionError(f"cannot reach Redis at {_redact(url)} {budget}: {e}") from e
    return client


def ride_outages(client, log=None) -> None:
    """Make a client from ``connect`` wait out an outage of any length, logging it on ``log``.

    What a stage worker does with the client it was given: its calls are retried until the
    server answers again (``connect(retries=None)``). Clients not made by ``connect`` are
    left as they are.
    """
    if isinstance(client, _RidingCluster):
        client._backoff_retry = _TransientRetry(None, supported_errors=CLUSTER_ERRORS, log=log)
        return
    if isinstance(client, redis.Redis) and isinstance(client.get_retry(), _TransientRetry):
        client.set_retry(_TransientRetry(None, log=log))


def failed_calls(client) -> int:
    """How many calls of ``client`` have failed with a transient error and been sent again.

    A call sent again may have been applied the first time with its reply lost; a caller
    whose call is not idempotent (a read that delivers stream entries to its consumer)
    compares this count before and after the call to know it must look for such effects
    (``bus.streams.GroupReader``). It counts every connection's failures, so another
    thread's failed call can make a caller look for nothing. 0 for clients not made by
    ``connect``, which do not retry.
    """
    if isinstance(client, _RidingCluster):
        return client._backoff_retry.outage.failed_calls + client._node_failures
    retry = client.get_retry() if isinstance(client, redis.Redis) else None
    return retry.outage.failed_calls if isinstance(retry, _TransientRetry) else 0


def _redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    p = urlparse(url)
    if not p.password:
        return url
    return p._replace(netloc=p.netloc.replace(f":{p.password}@", ":***@")).geturl()
