"""``env.kind = "openenv:..."``: OpenEnv environments, reached through OpenEnv's own client.

Two forms (docs/environments.md):

- ``openenv:http://host:port``: a server running elsewhere (OpenEnv's ``create_app`` under
  uvicorn, a container, a Space); the generator only connects to it. Several, comma-separated
  (``openenv:http://a:1,http://b:2``): each session opens on the one with the fewest
  sessions of this generator in flight (ties in turn); one that cannot be reached (its
  connection refused, a session on it lost) is down for a backoff (:data:`BACKOFF_S`,
  doubling per failure in a row up to :data:`MAX_BACKOFF_S`) and skipped while down, unless
  every one is; errors name the URL.
- ``openenv:module:app`` / ``openenv:path/to/file.py:app``: an app this generator serves
  itself, ``env.servers`` uvicorn processes on loopback ports (:class:`~pipeline.envs.servers.ServerPool`:
  health-checked at start, restarted when one exits, stopped when the factory is closed or
  the process exits; their pids recorded under ``<run_dir>/env-servers/``).

Each completion is one OpenEnv session: a WebSocket of ``GenericEnvClient`` (openenv-core,
the ``openenv`` extra) to a server of the pool, ``reset`` when the episode starts, ``step``
per model turn, closed with the episode. The text of a turn becomes the Action's one string
field; the Observation's text field (its one string field, or ``env.observation_field``) is
what the model reads next, its ``reward`` and ``done`` are the step's. Both fields are read
from the server's ``/schema`` when the factory starts; an Action without exactly one string
field, or with other required fields, is refused there, naming env.kind.

MCP tools (OpenEnv's ``MCPEnvironment``, RFC 003): the factory asks the server for its tools
(``tools/list`` on ``POST /mcp``) when it starts; an environment that declares some is
wrapped in a :class:`~pipeline.envs.tools.ToolEnv`, so the model is shown their schemas (each
tool's ``inputSchema`` as an OpenAI-style function), its ``<tool_call>`` blocks are parsed and
checked against them, and each well-formed call runs as ``tools/call`` over the episode's own
WebSocket session (the same environment instance its ``reset`` and ``step`` reach, so a tool
sees the episode's state); the result comes back as a tool turn. A turn without a call is the
environment's ``step`` as usual. An environment whose Action has no text field (only tool
calls) is refused when the factory starts: a model's final answer needs one. A server without
MCP (``Environment does not support MCP``, or no ``/mcp`` route) has no tools.

Tool calls (docs/observing.md): an Observation with a boolean field ``tool_call`` (and
``tool_ok``, a boolean or null) says whether the action was a tool call and whether it was
answered; the step carries them (``Step.tool_call``, ``Step.tool_ok``). Without those fields
a step is no tool call. (openenv-core 0.3.0 drops an Observation's ``metadata`` on the wire,
so the flags travel as fields of their own.)

``reset`` receives the keyword arguments ``prompt``, ``reference`` and ``prompt_id`` of the
episode's prompt, and ``seed``, the group's seed (pipeline.envs.base.episode_seed: the same
for every completion of a group); the server passes on those its environment's ``reset``
accepts (by name, or all of them to ``**kwargs``; OpenEnv's ``Environment.reset`` takes
``seed``), and drops the others.

Failures: a step the environment raised on (the server answers with an error) fails that
step only; a session that is lost (the server died, the connection closed, no answer within
``env.step_timeout_s``) fails this step and every later one of the episode. Both raise
:class:`~pipeline.envs.base.EnvError`, so the EpisodeRunner's ``env.on_error`` policy applies
and the group is still emitted. A reset that cannot get a session (every server full, none
up within ``env.start_timeout_s``, the environment's reset raised) raises EnvError with the
reason: the runner counts a failed reset (``env.max_failed_resets``) and ends the episode at
its first turn. Nothing of openenv-core is imported
until an ``openenv:`` kind is used.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import urllib.error
import weakref
from typing import TYPE_CHECKING

from pipeline.envs.base import EnvError, Step
from pipeline.envs.servers import RECORD_DIR, ServerPool, ServerStartError, http_get, http_post_json
from pipeline.envs.tools import Tool, ToolEpisode
from pipeline.plugins import is_spec

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from pipeline.records import PromptTask

PREFIX = "openenv:"
OBSERVATION_BASE_FIELDS = ("done", "reward", "metadata")
"""Fields every OpenEnv Observation has; the server sends reward and done beside the observation."""
ACTION_BASE_FIELDS = ("metadata",)
CONNECT_TIMEOUT_S = 10.0
SCHEMA_TIMEOUT_S = 10.0
BACKOFF_S = 1.0
"""Seconds a server of several (``openenv:http://a:1,http://b:2``) is skipped after its first failure."""
MAX_BACKOFF_S = 30.0
"""The longest a server is skipped (the backoff doubles per failure in a row up to this)."""


def split_kind(kind: str) -> tuple[str, str]:
    """``("url", url)`` (several comma-separated: ``"http://a:1,http://b:2"``, :func:`split_urls`)
    or ``("app", spec)`` of an ``openenv:`` kind; ValueError when it is neither."""
    if not kind.startswith(PREFIX):
        raise ValueError(f"{kind!r} does not start with {PREFIX!r}")
    target = kind[len(PREFIX):].strip()
    if target.startswith(("http://", "https://")):
        urls = [u.strip() for u in target.split(",")]
        if all(u.startswith(("http://", "https://")) and u.split("://", 1)[1].strip("/") for u in urls):
            return "url", ",".join(u.rstrip("/") for u in urls)
    elif is_spec(target):
        return "app", target
    raise ValueError(f"{kind!r}: after {PREFIX!r} comes a server's URL (http://host:port) or an app to serve "
                     f"(module:app or path/to/file.py:app)")


def split_urls(target: str) -> list[str]:
    """The URLs of a ``("url", target)`` :func:`split_kind` result."""
    return target.split(",")


class _Health:
    """One server of several: sessions in flight, failures in a row, skipped until ``down_until``."""

    __slots__ = ("in_flight", "failures", "down_until", "error")

    def __init__(self) -> None:
        self.in_flight, self.failures, self.down_until, self.error = 0, 0, 0.0, ""


def _is_string(prop: dict) -> bool:
    if prop.get("type") == "string":
        return True
    alts = prop.get("anyOf") or ()
    kinds = {a.get("type") for a in alts}
    return "string" in kinds and kinds <= {"string", "null"}


def action_field(schema: dict, kind: str) -> str:
    """The Action's one string field (the model's turn goes there)."""
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k not in ACTION_BASE_FIELDS}
    strings = [k for k, v in props.items() if _is_string(v)]
    if len(strings) != 1:
        raise EnvError(f"env.kind {kind!r}: the environment's Action ({schema.get('title', '?')}) must have exactly "
                       f"one string field to carry the model's turn; it has {len(strings)} "
                       f"({', '.join(strings) or 'none'}; all fields: {', '.join(props) or 'none'})")
    others = [k for k in schema.get("required", ()) if k != strings[0] and k not in ACTION_BASE_FIELDS]
    if others:
        raise EnvError(f"env.kind {kind!r}: the environment's Action ({schema.get('title', '?')}) also requires "
                       f"{', '.join(others)}, which a model's text turn cannot fill; give them defaults")
    return strings[0]


def observation_field(schema: dict, chosen: str, kind: str) -> str:
    """The Observation's text field: ``chosen`` (env.observation_field) or its one string field."""
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k not in OBSERVATION_BASE_FIELDS}
    title = schema.get("title", "?")
    if chosen:
        if chosen not in props:
            raise EnvError(f"env.observation_field {chosen!r}: the environment's Observation ({title}) of env.kind "
                           f"{kind!r} has no such field; it has {', '.join(props) or 'none'}")
        return chosen
    strings = [k for k, v in props.items() if _is_string(v)]
    if len(strings) != 1:
        raise EnvError(f"env.kind {kind!r}: the environment's Observation ({title}) has {len(strings)} string fields "
                       f"({', '.join(strings) or 'none'}; all fields: {', '.join(props) or 'none'}): set "
                       f"env.observation_field to the one the model reads")
    return strings[0]


def fetch_schema(url: str, kind: str) -> dict:
    try:
        schema = json.loads(http_get(url + "/schema", timeout=SCHEMA_TIMEOUT_S))
    except (OSError, ValueError) as e:
        raise EnvError(f"env.kind {kind!r}: cannot read the environment's schema from {url}/schema "
                       f"({type(e).__name__}: {e}); is an OpenEnv server running there?") from e
    if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict) \
            or not isinstance(schema.get("observation"), dict):
        raise EnvError(f"env.kind {kind!r}: {url}/schema is not an OpenEnv schema (action, observation)")
    return schema


def mcp_tools(url: str, kind: str) -> tuple[Tool, ...]:
    """The MCP tools the environment at ``url`` declares (``tools/list`` on ``POST /mcp``), as
    :class:`~pipeline.envs.tools.Tool` schemas to show (none runs here: see :class:`OpenEnvEpisode`);
    ``()`` for a server without MCP. EnvError when the server answers with another error."""
    try:
        raw = http_post_json(url + "/mcp", {"jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": 0},
                             timeout=SCHEMA_TIMEOUT_S)
    except urllib.error.HTTPError as e:
        if e.code in (404, 405):  # an openenv-core without the /mcp route
            return ()
        raise EnvError(f"env.kind {kind!r}: tools/list on {url}/mcp failed (HTTP {e.code})") from e
    except OSError as e:
        raise EnvError(f"env.kind {kind!r}: tools/list on {url}/mcp failed ({type(e).__name__}: {e})") from e
    try:
        answer = json.loads(raw)
    except ValueError as e:
        raise EnvError(f"env.kind {kind!r}: {url}/mcp answered tools/list with no JSON ({e})") from e
    error = answer.get("error") if isinstance(answer, dict) else None
    if error:
        message = str(error.get("message", error)) if isinstance(error, dict) else str(error)
        if "does not support MCP" in message:
            return ()
        raise EnvError(f"env.kind {kind!r}: tools/list on {url}/mcp failed: {message}")
    listed = (answer.get("result") or {}).get("tools") or []
    tools = []
    for t in listed:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise EnvError(f"env.kind {kind!r}: {url}/mcp lists a tool without a name: {t!r}")
        params = t.get("inputSchema") or t.get("input_schema") or {"type": "object", "properties": {}}
        tools.append(Tool(name=t["name"], description=str(t.get("description") or ""), parameters=params))
    return tuple(tools)


def mcp_result(result):
    """The text of a ``tools/call`` result: FastMCP's structured ``data`` where it has one, else
    its text content joined; RuntimeError with that text when the tool reported an error."""
    if not isinstance(result, dict):
        return result
    texts = [c.get("text", "") for c in result.get("content") or () if isinstance(c, dict) and c.get("type") == "text"]
    if result.get("is_error") or result.get("isError"):
        raise RuntimeError("\n".join(texts) or "the tool failed")
    data = result.get("data")
    if data is not None:
        return data
    if result.get("structured_content") is not None:
        return result["structured_content"]
    return "\n".join(texts)


def tool_flags(observation) -> tuple[bool, bool | None]:
    """``(tool_call, tool_ok)`` of an Observation (as the client's dict): its boolean ``tool_call``
    and ``tool_ok`` fields when it has them, else no tool call."""
    if not isinstance(observation, dict):
        return False, None
    call, ok = observation.get("tool_call"), observation.get("tool_ok")
    return call is True, ok if isinstance(ok, bool) else None


def _server_error(e: BaseException) -> str | None:
    """The server's own error message (the client raises RuntimeError("Server error: ...")), else None."""
    text = str(e)
    return text if isinstance(e, RuntimeError) and text.startswith("Server error") else None


class OpenEnvEnvironments:
    """The factory of ``env.kind = "openenv:..."``: one :class:`OpenEnvEpisode` per completion.

    Owns the client side (one event loop thread for every session's WebSocket) and, for an
    app spec, the :class:`~pipeline.envs.servers.ServerPool`. :meth:`close` stops both; it
    also runs when the factory is collected or the process exits."""

    def __init__(self, cfg: RunConfig, *, log=None) -> None:
        self.kind = cfg.env.kind
        self.step_timeout_s = cfg.env.step_timeout_s
        self.start_timeout_s = cfg.env.start_timeout_s
        how, target = split_kind(self.kind)
        try:
            from openenv.core.generic_client import GenericEnvClient
        except ImportError as e:
            raise EnvError(f"env.kind {self.kind!r} needs openenv-core, the `openenv` extra "
                           f"(pip install -e '.[openenv]'; docs/environments.md): {e}") from e
        self._client_cls = GenericEnvClient
        self.pool = None
        if how == "app":
            try:
                # The servers' pids go to the run directory too, where `pipeline inject` finds them (chaos kind env).
                self.pool = ServerPool(target, n=cfg.env.servers, start_timeout_s=cfg.env.start_timeout_s,
                                       name=self.kind, log_dir=cfg.run_dir / "logs", log=log,
                                       record_dir=cfg.run_dir / RECORD_DIR)
            except (ServerStartError, ValueError) as e:
                raise EnvError(str(e) if isinstance(e, ServerStartError) else f"env.kind {self.kind!r}: {e}") from e
            self.url = None
            first = self.pool.urls()[0]
            self.remote: list[str] = []
        else:
            self.remote = split_urls(target)
            self.url = first = self.remote[0]
        self.health = {u: _Health() for u in self.remote}
        self._lock = threading.Lock()
        try:
            if len(self.remote) > 1:
                first = self._answering(self.kind)
            schema = fetch_schema(first, self.kind)
            self.tools = mcp_tools(first, self.kind)
            try:
                self.action_field = action_field(schema["action"], self.kind)
            except EnvError as e:
                if not self.tools:
                    raise
                raise EnvError(f"{e}. It declares MCP tools ({', '.join(t.name for t in self.tools)}), which run "
                               f"as tools/call; the model's turns without a call still need a text field") from None
            self.observation_field = observation_field(schema["observation"], cfg.env.observation_field, self.kind)
        except BaseException:
            if self.pool is not None:
                self.pool.close()
            raise
        self.format_reward = cfg.env.format_reward
        self._rpc = itertools.count(1)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="openenv-client", daemon=True)
        self._thread.start()
        self._turn = itertools.count()
        self._finalizer = weakref.finalize(self, _shutdown, self.loop, self._thread, self.pool)

    def __call__(self, task: PromptTask):
        """The episode of one completion: its session, and with MCP tools a ToolEpisode around
        it that runs the model's calls in that session (module docstring)."""
        episode = OpenEnvEpisode(self, task)
        if not self.tools:
            return episode
        return ToolEpisode(self.tools, episode, format_reward=self.format_reward)

    # ------------------------------------------------------------------ sessions

    def run(self, coro, timeout: float):
        """Run ``coro`` on the client loop; its result, or its exception (TimeoutError after ``timeout`` s)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def _answering(self, kind: str) -> str:
        """The first of several URLs whose /schema answers; EnvError naming each that does not."""
        errors = []
        for url in self.remote:
            try:
                fetch_schema(url, kind)
                return url
            except EnvError as e:
                errors.append(str(e))
        raise EnvError(f"env.kind {kind!r}: none of its {len(self.remote)} servers answers: " + "; ".join(errors))

    def _urls(self) -> list[str]:
        """Where to open a session: the pool's, rotated so that sessions spread over it; of
        several URLs, those up by fewest sessions in flight (ties rotated), or when every one
        is down, all by the end of their backoff."""
        if self.pool is None and len(self.remote) > 1:
            now = time.monotonic()
            k = next(self._turn)
            order = {u: (i - k) % len(self.remote) for i, u in enumerate(self.remote)}
            with self._lock:
                up = [u for u in self.remote if self.health[u].down_until <= now]
                if up:
                    return sorted(up, key=lambda u: (self.health[u].in_flight, order[u]))
                return sorted(self.remote, key=lambda u: self.health[u].down_until)
        urls = [self.url] if self.pool is None else self.pool.urls()
        if len(urls) > 1:
            k = next(self._turn) % len(urls)
            urls = urls[k:] + urls[:k]
        return urls

    def opened(self, url: str) -> None:
        """A session opened on ``url``: it is up, and one more is in flight there."""
        with self._lock:
            h = self.health.get(url)
            if h is not None:
                h.in_flight += 1
                h.failures, h.down_until = 0, 0.0

    def released(self, url: str | None) -> None:
        """A session on ``url`` ended."""
        with self._lock:
            h = self.health.get(url)
            if h is not None and h.in_flight > 0:
                h.in_flight -= 1

    def failed(self, url: str | None, error: str) -> None:
        """``url`` could not be reached (or lost a session): skipped for a backoff that doubles
        per failure in a row."""
        with self._lock:
            h = self.health.get(url)
            if h is not None and len(self.remote) > 1:
                h.failures += 1
                h.down_until = time.monotonic() + min(BACKOFF_S * 2 ** (h.failures - 1), MAX_BACKOFF_S)
                h.error = error

    async def _open(self, url: str, kwargs: dict):
        client = self._client_cls(base_url=url, connect_timeout_s=CONNECT_TIMEOUT_S,
                                  message_timeout_s=self.step_timeout_s + 5)
        try:
            await client.connect()
            result = await client.reset(**kwargs)
        except BaseException:
            await client.disconnect()
            raise
        return client, result

    def open(self, task: PromptTask, seed: int | None = None):
        """A new session reset for ``task`` (and ``seed``, where given): (client, url, first result).
        Tries every server up; waits (up to env.start_timeout_s) for one of the pool's to come up,
        not for a full one."""
        kwargs = {"prompt": task.prompt, "reference": task.reference, "prompt_id": task.prompt_id}
        if seed is not None:
            kwargs["seed"] = int(seed)
        deadline = time.monotonic() + self.start_timeout_s
        errors: dict[str, str] = {}
        while True:
            urls = self._urls()
            full = 0
            for url in urls:
                try:
                    client, result = self.run(self._open(url, kwargs), CONNECT_TIMEOUT_S + self.step_timeout_s + 5)
                    self.opened(url)
                    return client, url, result
                except Exception as e:
                    said = _server_error(e)
                    errors[url] = f"{type(e).__name__}: {e}"
                    if said is not None and "CAPACITY_REACHED" in said:
                        full += 1
                    elif said is not None:  # the environment's reset itself failed: no point trying elsewhere
                        raise EnvError(f"env.kind {self.kind!r}: reset on {url} failed: {said}") from None
                    else:  # unreachable: the next one (of several, this one skipped for a while)
                        self.failed(url, errors[url])
            if urls and full == len(urls):
                raise EnvError(f"env.kind {self.kind!r}: every server is at its session limit ({len(urls)} server(s)); "
                               f"raise max_concurrent_envs in the app's create_app, env.servers, or lower "
                               f"env.max_in_flight")
            if self.pool is None or time.monotonic() > deadline or self.pool.closed:
                with self._lock:  # the servers of several skipped while down, with why
                    errors.update({u: f"skipped while down ({h.error})" for u, h in self.health.items()
                                   if u not in errors and h.down_until > time.monotonic()})
                detail = "; ".join(f"{u}: {m}" for u, m in errors.items()) or "no server is up"
                raise EnvError(f"env.kind {self.kind!r}: cannot open a session ({detail})")
            self.pool.wait_up(min(1.0, max(deadline - time.monotonic(), 0.01)))
            time.sleep(0.05)

    def text(self, observation) -> str:
        value = observation.get(self.observation_field) if isinstance(observation, dict) else None
        return "" if value is None else value if isinstance(value, str) else str(value)

    def discard(self, client) -> None:
        """Close a session without waiting for it."""
        if client is None or self.loop.is_closed() or not self._finalizer.alive:
            return  # closing: the drain or the server ends the session
        try:
            asyncio.run_coroutine_threadsafe(client.disconnect(), self.loop)
        except RuntimeError:  # the loop is gone: the server drops the session with the connection
            pass

    def close(self) -> None:
        """Stop the client loop and the servers this factory started."""
        self._finalizer()


async def _drain(timeout: float) -> None:
    """Let the sessions' closes finish (up to ``timeout`` s), then cancel what is left."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread, pool) -> None:
    if not loop.is_closed() and thread.is_alive():
        try:
            asyncio.run_coroutine_threadsafe(_drain(2.0), loop).result(5)
        except Exception:  # best effort: the servers drop sessions whose connection goes
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
    if not thread.is_alive() and not loop.is_closed():
        loop.close()
    if pool is not None:
        pool.close()


class OpenEnvEpisode:
    """One completion's OpenEnv session (the :class:`~pipeline.envs.base.Episode` contract)."""

    def __init__(self, envs: OpenEnvEnvironments, task: PromptTask) -> None:
        self.envs, self.task = envs, task
        self.client = None
        self.url: str | None = None
        self.broken: str | None = None
        """Why the session cannot go on (every later step raises this)."""

    def reset(self, seed: int | None = None) -> str:
        try:
            self.client, self.url, result = self.envs.open(self.task, seed)
        except Exception as e:
            self.broken = str(e) if isinstance(e, EnvError) else f"env.kind {self.envs.kind!r}: reset failed " \
                                                                  f"({type(e).__name__}: {e})"
            raise EnvError(self.broken) from None
        return self.envs.text(result.observation)

    @property
    def tools(self) -> tuple[Tool, ...]:
        """The environment's MCP tools, each run as ``tools/call`` in this episode's session
        (what :class:`~pipeline.envs.tools.ToolEpisode` calls after checking the arguments)."""
        return tuple(Tool(t.name, t.description, t.parameters, fn=self._caller(t.name)) for t in self.envs.tools)

    def _caller(self, name: str):
        return lambda **arguments: self.call_tool(name, arguments)

    def call_tool(self, name: str, arguments: dict):
        """One MCP ``tools/call`` over this episode's WebSocket: the result (:func:`mcp_result`).
        RuntimeError when the server or the tool answered with an error (the model reads it);
        EnvError when the session is lost (the episode cannot go on)."""
        if self.broken is not None:
            raise EnvError(self.broken)
        envs = self.envs
        request = {"type": "mcp", "data": {"jsonrpc": "2.0", "method": "tools/call",
                                           "params": {"name": name, "arguments": arguments}, "id": next(envs._rpc)}}
        try:
            # openenv-core's client has no public call for a session's MCP message; its WebSocket
            # exchange (the one reset and step use) carries it.
            answer = envs.run(self.client._send_and_receive(request), envs.step_timeout_s)
        except Exception as e:
            said = _server_error(e)
            if said is not None:
                raise RuntimeError(said) from None
            self._lost(e)
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, dict):
            raise RuntimeError(f"{self.url} answered tools/call with {answer!r}")
        if data.get("error"):
            err = data["error"]
            raise RuntimeError(str(err.get("message", err)) if isinstance(err, dict) else str(err))
        return mcp_result(data.get("result"))

    def _lost(self, e: BaseException):
        """The session is gone: every later step raises why."""
        envs = self.envs
        self.broken = (f"env.kind {envs.kind!r}: the session on {self.url} was lost "
                       f"({type(e).__name__}: {e or 'no answer'}); the episode cannot go on")
        envs.discard(self.client)
        self.client = None
        envs.released(self.url)
        envs.failed(self.url, self.broken)
        raise EnvError(self.broken) from None

    def step(self, action: str) -> Step:
        if self.broken is not None:
            raise EnvError(self.broken)
        envs = self.envs
        try:
            result = envs.run(self.client.step({envs.action_field: action}), envs.step_timeout_s)
        except Exception as e:
            said = _server_error(e)
            if said is not None:  # the environment's step raised; the session goes on
                raise EnvError(f"env.kind {envs.kind!r}: step on {self.url} failed: {said}") from None
            self._lost(e)
        reward = result.reward
        call, ok = tool_flags(result.observation)
        return Step(observation=envs.text(result.observation), reward=None if reward is None else float(reward),
                    done=bool(result.done), tool_call=call, tool_ok=ok)

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            self.envs.released(self.url)
        self.envs.discard(client)


def openenv(cfg: RunConfig, *, log=None) -> OpenEnvEnvironments:
    """The factory ``make_env`` returns for an ``openenv:`` kind."""
    return OpenEnvEnvironments(cfg, log=log)
