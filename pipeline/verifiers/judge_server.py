"""One LLM judge per host, shared by every verifier replica: ``pipeline judge-serve``.

A judge server loads an HF chat checkpoint once (``lm_judge.ChatJudge``) and answers
next-token P(yes) and P(answer) requests over ZeroMQ, so N verifier replicas on a host need one copy of
the model instead of N, and their questions share forwards. Requests that arrive within
``window_ms`` of the first waiting one, up to ``max_batch`` questions, are scored
together: the questions of several replicas (and of several styles) go into one
left-padded forward (P(answer) questions into right-padded ones), and identical questions
are scored once.

Run it::

    pipeline judge-serve artifacts/smollm2-135m-instruct --endpoint tcp://127.0.0.1:5600
    # then, in verifier.verifiers:
    #   "lm_judge:tcp://127.0.0.1:5600@direct", "lm_judge:tcp://127.0.0.1:5600@compare", ...

(or ``python -m pipeline.verifiers.judge_server <dir> ...``). Flags: ``--endpoint``
(``tcp://host:port`` or ``ipc:///path``, default ``tcp://127.0.0.1:5600``), ``--max-batch``
(64), ``--window-ms`` (20), ``--device`` (``auto``: CUDA when present, else CPU),
``--max-tokens`` (the longest question, ``lm_judge.MAX_QUESTION_TOKENS``), ``--threads``
(torch CPU threads). It binds only after the model has loaded and prints one ``ready``
line; SIGTERM or Ctrl-C stops it.

Wire (msgpack, never pickle; DEALER client → ROUTER server, one frame each way)::

    request  {"v": 1, "id": int, "op": "judge", "style": str, "prompt": str, "completions": [str]}
             (+ "style_def": {...}, the fields of a style file the client read, instead of a built-in name)
             {"v": 1, "id": int, "op": "info"}
    reply    {"id": int, "ok": true, "p": [float]}          (NaN = abstain)
             {"id": int, "ok": true, "info": {...}}         (directory, styles, counters)
             {"id": int, "ok": false, "error": str}

The client (``JudgeClient``, what ``lm_judge:tcp://...`` builds) waits at most
``timeout_s`` (``$RLPIPE_JUDGE_TIMEOUT_S``, default 8 s, below the verifier's default
10 s deadline) for a connection and then for the answer, and raises
``JudgeServerUnavailable`` naming the endpoint; the verifier stage counts that as an
abstention of that verifier for the group and keeps going. A socket that timed out is
discarded, so a late answer can never be taken for the next request's.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import zmq

from pipeline.model.tokenizer import is_char_tokenizer
from pipeline.verifiers.judge_client import (  # noqa: F401  the client side, re-exported
    PROTOCOL, DEFAULT_ENDPOINT, DEFAULT_MAX_BATCH, DEFAULT_WINDOW_MS, TIMEOUT_ENV, DEFAULT_TIMEOUT_S, MAX_MESSAGE_BYTES, _TCP, JudgeServerUnavailable, JudgeServerError, check_endpoint, timeout_from_env, JudgeClient)
from pipeline.verifiers.judge_styles import STYLES, make_style
from pipeline.verifiers.kinds.lm_judge import MAX_QUESTION_TOKENS, ChatJudge, ChatJudgeUnavailable


# ----------------------------------------------------------------------------- server


@dataclass
class _Pending:
    peer: bytes
    rid: object
    seqs: list  # per completion what the style asks (ChatJudge.questions_of), None where it cannot ask


@dataclass
class ServerStats:
    requests: int = 0
    """Judge requests answered."""
    questions: int = 0
    """Completions scored (asked or abstained)."""
    batches: int = 0
    """Windows flushed (each is one or more forwards of at most max_batch questions)."""
    errors: int = 0
    """Requests answered with an error."""
    latency_s: list[float] = field(default_factory=list)


class JudgeServer:
    """The serving loop around a ``ChatJudge`` (see the module docstring)."""

    def __init__(self, engine, endpoint: str, *, max_batch: int = DEFAULT_MAX_BATCH,
                 window_ms: float = DEFAULT_WINDOW_MS):
        check_endpoint(endpoint)
        if max_batch < 1 or not window_ms >= 0:
            raise ValueError(f"max_batch must be >= 1 and window_ms >= 0; got {max_batch}, {window_ms}")
        self.engine, self.endpoint = engine, endpoint
        self.max_batch, self.window_s = int(max_batch), float(window_ms) / 1000.0
        engine.max_batch = self.max_batch
        self.stats = ServerStats()
        self._stop = threading.Event()
        self._bound = threading.Event()

    def info(self) -> dict:
        s = self.stats
        return {"directory": self.engine.directory, "styles": sorted(STYLES), "max_batch": self.max_batch,
                "window_ms": self.window_s * 1000.0, "max_tokens": self.engine.max_tokens,
                "device": str(self.engine.device), "yes_tokens": self.engine.yes_tokens,
                "no_tokens": self.engine.no_tokens, "requests": s.requests, "questions": s.questions,
                "batches": s.batches, "forwards": self.engine.forwards, "errors": s.errors}

    def stop(self) -> None:
        self._stop.set()

    def wait_bound(self, timeout: float | None = None) -> bool:
        return self._bound.wait(timeout)

    def _reply(self, sock, peer: bytes, msg: dict) -> None:
        sock.send_multipart([peer, msgpack.packb(msg, use_bin_type=True)])

    def _take(self, sock, peer: bytes, raw: bytes, pending: list[_Pending]) -> int:
        """Read one request: answer info and errors at once, queue a judge request; questions queued."""
        rid = None
        try:
            msg = msgpack.unpackb(raw, raw=False)
            if not isinstance(msg, dict):
                raise ValueError("a request is a msgpack map")
            rid = msg.get("id")
            if msg.get("v") != PROTOCOL:
                raise ValueError(f"protocol version {msg.get('v')!r}; this server speaks {PROTOCOL}")
            op = msg.get("op")
            if op == "info":
                self._reply(sock, peer, {"id": rid, "ok": True, "info": self.info()})
                return 0
            if op != "judge":
                raise ValueError(f"unknown op {op!r}; ops: judge, info")
            style, prompt, completions = msg.get("style"), msg.get("prompt"), msg.get("completions")
            if msg.get("style_def") is not None:  # a client's style file, sent whole
                if not isinstance(msg["style_def"], dict):
                    raise ValueError("style_def must be a map of style fields")
                style = make_style(msg["style_def"], where=f"style {style!r} of the request")
            elif style not in STYLES:
                raise ValueError(f"unknown lm_judge style {style!r}; styles: {sorted(STYLES)} (a style file "
                                 "travels as style_def)")
            if not isinstance(prompt, str) or not isinstance(completions, list) or \
                    not all(isinstance(c, str) for c in completions):
                raise ValueError("judge needs prompt: str and completions: [str]")
            seqs = self.engine.questions_of(style, prompt, completions)
        except Exception as exc:  # noqa: BLE001 - one bad request never stops the server
            self.stats.errors += 1
            self._reply(sock, peer, {"id": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
            return 0
        pending.append(_Pending(peer, rid, seqs))
        return len(seqs)

    def _flush(self, sock, pending: list[_Pending]) -> None:
        asked = [s for p in pending for s in p.seqs if s is not None]
        try:
            scores = iter(self.engine.score_questions(asked).tolist()) if asked else iter(())
        except Exception as exc:  # noqa: BLE001 - report to every waiting client, keep serving
            for p in pending:
                self.stats.errors += 1
                self._reply(sock, p.peer, {"id": p.rid, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
            pending.clear()
            return
        self.stats.batches += 1
        for p in pending:
            out = [next(scores) if s is not None else math.nan for s in p.seqs]
            self.stats.requests += 1
            self.stats.questions += len(p.seqs)
            self._reply(sock, p.peer, {"id": p.rid, "ok": True, "p": out})
        pending.clear()

    def serve_forever(self) -> None:
        """Bind and serve until ``stop()`` (or SIGTERM/SIGINT in ``main``)."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a client that left: its reply is dropped
        try:
            sock.bind(self.endpoint)
            self._bound.set()
            pending: list[_Pending] = []
            queued, first_at = 0, 0.0
            while not self._stop.is_set():
                wait = 100 if not pending else max(0, int((first_at + self.window_s - time.monotonic()) * 1000))
                if sock.poll(wait, zmq.POLLIN):
                    while queued < self.max_batch:  # drain what has arrived, up to one batch
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if len(frames) != 2:  # not a DEALER's one-frame request: nothing to answer
                            continue
                        peer, raw = frames
                        if not pending:
                            first_at = time.monotonic()
                        queued += self._take(sock, peer, raw, pending)
                if pending and (queued >= self.max_batch or time.monotonic() >= first_at + self.window_s):
                    self._flush(sock, pending)
                    queued = 0
        finally:
            sock.close(linger=0)
            ctx.term()


def load_engine(directory: str, *, device: str = "auto", max_tokens: int | None = None):
    """The ``ChatJudge`` a server serves (CUDA when ``device`` is ``auto`` and one is present)."""
    import torch  # heavy: only a serving process loads it

    if is_char_tokenizer(directory):
        raise ChatJudgeUnavailable(f"judge-serve {directory!r}: a character policy cannot be served as a chat judge "
                                   "(use lm_judge:<dir> in process)")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return ChatJudge(directory, device=device, max_tokens=max_tokens or MAX_QUESTION_TOKENS)


def serve(directory: str, endpoint: str = DEFAULT_ENDPOINT, *, max_batch: int = DEFAULT_MAX_BATCH,
          window_ms: float = DEFAULT_WINDOW_MS, device: str = "auto", max_tokens: int | None = None,
          ready=None) -> JudgeServer:
    """Load ``directory`` once and serve it at ``endpoint`` until stopped; returns the stopped server.

    ``ready(server)`` is called from a helper thread once the socket is bound, e.g. to print
    the ready line or to keep the server for a later ``stop()``."""
    check_endpoint(endpoint)
    server = JudgeServer(load_engine(directory, device=device, max_tokens=max_tokens), endpoint,
                         max_batch=max_batch, window_ms=window_ms)
    if ready is not None:
        threading.Thread(target=lambda: server.wait_bound() and ready(server), daemon=True).start()
    server.serve_forever()
    return server


def add_arguments(sp: argparse.ArgumentParser) -> None:
    """The flags of ``pipeline judge-serve`` (and of this module's ``main``)."""
    sp.add_argument("directory", help="HF chat checkpoint directory (safetensors, a chat template in its tokenizer)")
    sp.add_argument("--endpoint", default=DEFAULT_ENDPOINT,
                    help=f"ZeroMQ endpoint to bind: tcp://<host>:<port> or ipc://<path> (default {DEFAULT_ENDPOINT})")
    sp.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                    help=f"most questions per forward (default {DEFAULT_MAX_BATCH})")
    sp.add_argument("--window-ms", type=float, default=DEFAULT_WINDOW_MS,
                    help=f"how long the first waiting request waits for others to join its batch "
                         f"(default {DEFAULT_WINDOW_MS:g})")
    sp.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda, cuda:1, ...")
    sp.add_argument("--max-tokens", type=int, default=None,
                    help="longest question in tokens; longer completions are cut from the left (default 1024)")
    sp.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def run(args: argparse.Namespace) -> int:
    """``pipeline judge-serve``: serve until SIGTERM or Ctrl-C."""
    if args.threads:
        import torch  # heavy: only a serving process loads it

        torch.set_num_threads(args.threads)
    holder: dict[str, JudgeServer] = {}

    def ready(server: JudgeServer) -> None:
        holder["server"] = server
        e = server.engine
        print(f"judge server ready: {server.endpoint} serving {e.directory} on {e.device} "
              f"(max_batch {server.max_batch}, window {server.window_s * 1000:g} ms, yes {e.yes_tokens}, "
              f"no {e.no_tokens})", flush=True)

    def stop(signum, frame) -> None:
        if "server" in holder:
            holder["server"].stop()
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server = serve(args.directory, args.endpoint, max_batch=args.max_batch, window_ms=args.window_ms,
                   device=args.device, max_tokens=args.max_tokens, ready=ready)
    s = server.stats
    print(f"judge server stopped: {s.requests} requests, {s.questions} questions, {server.engine.forwards} "
          f"forwards, {s.errors} errors", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pipeline judge-serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
