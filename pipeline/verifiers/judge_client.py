"""The client side of the judge server (``pipeline.verifiers.judge_server``): its wire
constants, its errors, the endpoint check and ``JudgeClient``, which an
``lm_judge:tcp://<host>:<port>@<style>`` verifier builds. The wire is described in the
server's module docstring (msgpack, never pickle).
"""

from __future__ import annotations

import itertools
import os
import re
import threading
import time
from collections.abc import Sequence

import msgpack
import numpy as np
import zmq

from pipeline.verifiers.judge_styles import is_style_file, style_file

PROTOCOL = 1
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5600"
DEFAULT_MAX_BATCH = 64
DEFAULT_WINDOW_MS = 20.0
TIMEOUT_ENV = "RLPIPE_JUDGE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 8.0
MAX_MESSAGE_BYTES = 64 << 20
"""Largest request a server accepts (a bigger one closes that client's connection)."""

_TCP = re.compile(r"tcp://(\[[0-9a-fA-F:.]+\]|[^:/\[\]]+):(\d+)")


class JudgeServerUnavailable(RuntimeError):
    """No judge server answered at the endpoint in time; the message says which and what to start."""


class JudgeServerError(RuntimeError):
    """The judge server answered with an error (a bad style, a request it could not read)."""


def check_endpoint(endpoint: str) -> None:
    """ValueError unless ``endpoint`` is ``tcp://<host>:<port>`` (a port 1-65535) or ``ipc://<path>``."""
    if endpoint.startswith("ipc://"):
        if len(endpoint) <= len("ipc://"):
            raise ValueError(f"judge endpoint {endpoint!r}: ipc:// needs a path")
        return
    m = _TCP.fullmatch(endpoint)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"judge endpoint {endpoint!r}: write tcp://<host>:<port> (port 1-65535) or ipc://<path>")


def timeout_from_env() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        t = float(raw)
    except ValueError:
        t = -1.0
    if not t > 0:
        raise ValueError(f"${TIMEOUT_ENV}={raw!r}: must be a positive number of seconds")
    return t


# ----------------------------------------------------------------------------- client


class JudgeClient:
    """Asks a judge server; safe to call from many threads (each call borrows its own socket)."""

    def __init__(self, endpoint: str, *, timeout_s: float | None = None):
        check_endpoint(endpoint)
        self.endpoint = endpoint
        self.timeout_s = timeout_from_env() if timeout_s is None else float(timeout_s)
        self._idle: list = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._ctx = None

    def _socket(self):
        with self._lock:
            if self._idle:
                return self._idle.pop()
            if self._ctx is None:
                self._ctx = zmq.Context()
            sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # not writable until a connection is up: "unreachable" is detectable
        sock.connect(self.endpoint)
        return sock

    def request(self, msg: dict) -> dict:
        """One request → its reply (``ok`` true); raises JudgeServerUnavailable or JudgeServerError."""
        rid = next(self._ids)
        deadline = time.monotonic() + self.timeout_s
        sock = self._socket()
        healthy = False
        try:
            if not sock.poll(int(self.timeout_s * 1000), zmq.POLLOUT):
                raise JudgeServerUnavailable(
                    f"lm_judge: cannot reach a judge server at {self.endpoint} (no connection within "
                    f"{self.timeout_s:g} s); start one with `pipeline judge-serve <dir> --endpoint {self.endpoint}`")
            sock.send(msgpack.packb({"v": PROTOCOL, "id": rid, **msg}, use_bin_type=True))
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                    raise JudgeServerUnavailable(
                        f"lm_judge: the judge server at {self.endpoint} did not answer within {self.timeout_s:g} s "
                        f"(${TIMEOUT_ENV}); it is stopped or overloaded")
                reply = msgpack.unpackb(sock.recv(), raw=False)
                if isinstance(reply, dict) and reply.get("id") == rid:
                    break
            healthy = True
        finally:
            if healthy:
                with self._lock:
                    self._idle.append(sock)
            else:
                sock.close(linger=0)
        if not reply.get("ok"):
            raise JudgeServerError(f"lm_judge: judge server at {self.endpoint}: {reply.get('error')}")
        return reply

    def score(self, style: str, prompt: str, completions: Sequence[str]) -> np.ndarray:
        """float32 [G] score of each completion, asked in ``style`` (NaN = abstain); a style file is read
        here and sent whole, so the server needs no copy of it."""
        msg = {"op": "judge", "style": style, "prompt": prompt, "completions": list(completions)}
        if is_style_file(style):
            msg["style_def"] = style_file(style).as_dict()
        reply = self.request(msg)
        p = np.asarray(reply["p"], dtype=np.float32)
        if p.shape != (len(completions),):
            raise JudgeServerError(f"lm_judge: judge server at {self.endpoint} returned {p.shape[0]} scores "
                                   f"for {len(completions)} completions")
        return p

    def info(self) -> dict:
        """The server's checkpoint, styles, batching settings and counters."""
        return self.request({"op": "info"})["info"]

    def close(self) -> None:
        with self._lock:
            for s in self._idle:
                s.close(linger=0)
            self._idle.clear()
            if self._ctx is not None:
                self._ctx.term()
                self._ctx = None
