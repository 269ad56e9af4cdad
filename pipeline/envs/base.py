"""The environment contract of a multi-turn episode, and the environments by name.

An episode alternates turns: the model samples until it ends its turn (the eos token), the
turn's text is the *action*, the environment answers with an *observation* (text), whose
token ids are appended to the sequence, and the model samples again;
until the environment says done, ``env.max_turns`` model turns, or the completion's token
budget (``task.max_new_tokens``, observation tokens included). Token in, token out: the
sequence the trainer scores is the sampled ids and the appended observation ids, never
re-tokenised text; observation tokens carry a loss mask of 0 and no behaviour log-prob.
An observation's ids are its raw encoding (:func:`encode_text`), or, for a model with a chat
template, a turn of that template (pipeline.envs.chat: ``Step.role``).

An environment is a factory ``make(task: PromptTask) -> Episode``, one episode per
completion. :class:`Episode` is OpenEnv's shape (reset, step, a reward and done with each
observation) on text: ``reset()`` returns the first observation (appended after the
prompt; ``""`` for none), ``step(action)`` a :class:`Step`. ``env.kind`` names one:
``calculator`` (pipeline.envs.calculator), or your own as ``module:function`` /
``path/to/file.py:function`` returning the factory for a config (pipeline.plugins).

Seeds: every episode of a GRPO group is reset with the same ``seed`` (:func:`episode_seed`:
the run's ``feeder.seed`` and the prompt's id, hashed), so the completions of a group play the
same game and group-relative advantages compare like with like; two prompts get different
seeds. An episode whose ``reset`` accepts a ``seed`` keyword (or ``**kwargs``) is given it
(:func:`reset_episode`, the signature read once per class); one whose ``reset`` takes no
argument is reset as before. An environment with randomness must draw it from that seed
alone: the same seed, the same game.

A step may say that its action was a tool call and whether the environment answered it
(``Step.tool_call``, ``Step.tool_ok``); both default to "not a tool call", so an environment
that does not say is counted as making none. The runner counts them per episode.
"""

from __future__ import annotations

import hashlib
import inspect
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from pipeline.envs.chat import ChatTurns
    from pipeline.records import PromptTask  # noqa: F401 (the EnvFactory annotation)


@dataclass(frozen=True)
class Step:
    """What the environment returns for one action."""

    observation: str
    """Appended to the sequence (as its exact token ids) before the model's next turn."""
    reward: float | None = None
    """The environment's reward for this turn; the episode's is computed over its turns'
    rewards as ``env.returns`` says (:func:`episode_return`; ``last``: the last one given)."""
    done: bool = False
    """The episode is over: no further model turn."""
    tool_call: bool = False
    """The action was a tool call (the environment's own judgement: the calculator's is an
    expression ending in ``=``). Counted per episode (docs/observing.md, "Episodes")."""
    tool_ok: bool | None = None
    """For a tool call: whether the environment answered it (False: malformed, unknown tool,
    or the tool failed). None counts as answered. Ignored when ``tool_call`` is False."""
    role: str | None = None
    """The turn the observation is, for a model with a chat template (pipeline.envs.chat):
    None is ``tool`` after a tool call, else ``user``. Without a template it is not used."""

    messages: tuple[dict, ...] = ()
    """The observation as chat turns of their own, for a model with a chat template: message
    dicts (``role``, ``content``; a tool result's ``name`` and ``tool_call_id``), rendered in
    place of ``observation`` and ``role`` (pipeline.envs.tools: one ``tool`` turn per call)."""
    tool_errors: int = 0
    """Malformed tool calls in the action (pipeline.envs.tools: bad JSON, unknown tool, arguments
    not matching the schema), counted as ``env_tool_parse_errors_total``."""

    @property
    def turn_role(self) -> str:
        """The chat role of the observation: ``role``, else ``tool`` or ``user``."""
        return self.role or ("tool" if self.tool_call else "user")


class Episode(Protocol):
    def reset(self, seed: int | None = None) -> str:
        """The first observation ("" for none), appended right after the prompt (with a chat
        template: a user turn before the model's first, pipeline.envs.chat). ``seed``: the
        group's seed (:func:`episode_seed`); the same seed must give the same game. A ``reset``
        without the parameter is called without it."""
        ...

    def step(self, action: str) -> Step:
        ...

    def close(self) -> None:
        ...


EnvFactory = Callable[["PromptTask"], Episode]


ENV_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the environment step latency histogram (then +Inf)."""
ENV_STEP_BUCKET = "env_step_seconds_bucket:"
"""Counter name prefix of one latency bucket in ``{ns}:stats``: ``env_step_seconds_bucket:0.005``
counts the step attempts that took more than the bound below it and at most 0.005 s
(``+Inf`` the rest); not cumulative (the exporter and the views add them up)."""


def step_bucket(seconds: float) -> str:
    """The ``{ns}:stats`` counter of the latency bucket ``seconds`` falls in."""
    for bound in ENV_STEP_BUCKETS:
        if seconds <= bound:
            return f"{ENV_STEP_BUCKET}{bound:g}"
    return f"{ENV_STEP_BUCKET}+Inf"


SEED_BITS = 31
"""Episode seeds are below ``2**31``: every seeding API takes them (numpy, torch, JSON, Java-style ints)."""


def episode_seed(run_seed: int, prompt_id: str) -> int:
    """The seed of every episode of ``prompt_id``'s group: blake2b of the run seed and the prompt
    id (stable across processes and Python versions, unlike ``hash()``), below ``2**31``."""
    digest = hashlib.blake2b(f"{int(run_seed)}:{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << SEED_BITS) - 1)


_TAKES_SEED: dict[type, bool] = {}


def takes_seed(episode) -> bool:
    """Whether ``episode.reset`` accepts a ``seed`` keyword (a parameter of that name, or
    ``**kwargs``); read once per class (an instance's own ``reset`` attribute: every time)."""
    cls = type(episode)
    own = "reset" in getattr(episode, "__dict__", {})
    if not own and cls in _TAKES_SEED:
        return _TAKES_SEED[cls]
    try:
        params = inspect.signature(episode.reset).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called as before
        ok = False
    else:
        ok = any(p.name == "seed" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                 or p.kind == p.VAR_KEYWORD for p in params)
    if not own:
        _TAKES_SEED[cls] = ok
    return ok


ROUTE_SALT = "env-route"


def route_index(run_seed: int, prompt_id: str, weights: list[float]) -> int:
    """The member of a mixture (``env.kind = "mix:..."``) that ``prompt_id``'s group plays: a
    blake2b draw from the run seed and the prompt id (salted apart from :func:`episode_seed`),
    uniform in [0, 1), mapped onto the cumulative ``weights``. The same in every process, for
    every completion of a group and in every replay; over many prompts the shares follow the
    weights."""
    digest = hashlib.blake2b(f"{ROUTE_SALT}:{int(run_seed)}:{prompt_id}".encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "big") >> 11) / float(1 << 53)
    total, acc = float(sum(weights)), 0.0
    for i, w in enumerate(weights):
        acc += w
        if u * total < acc:
            return i
    return len(weights) - 1


RETURNS = ("last", "sum", "discounted")


def episode_return(rewards: list[tuple[int, float]], how: str = "last", discount: float = 1.0) -> float:
    """An episode's environment reward from ``rewards``, the (model turn index from 0, reward)
    of each turn whose step gave one, in order: ``last`` the last reward, ``sum`` their sum,
    ``discounted`` the sum of ``discount ** t * reward``. NaN when no turn gave one."""
    if not rewards:
        return float("nan")
    if how == "last":
        return rewards[-1][1]
    if how == "sum":
        return float(sum(r for _, r in rewards))
    if how == "discounted":
        return float(sum(discount ** t * r for t, r in rewards))
    raise ValueError(f"env.returns: {how!r} is not one of {', '.join(RETURNS)}")


ENV_MEMBER_COUNTERS = ("env_episodes_total:", "env_errors_total:", "env_finished_total:", "env_reward_total:")
"""Per member of a mixture, ``{ns}:stats`` counters named ``<prefix><member kind>``: episodes
started, environment errors (failed resets and steps), episodes finished (their groups
emitted) and the sum of their environment rewards (none given counts 0)."""


def env_members(stats: dict[str, float]) -> dict[str, dict[str, float]]:
    """The per-member counters of a mixture in ``stats``: member kind -> episodes, errors,
    finished, reward (sum) and reward_mean (over finished episodes; None before any)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in stats.items():
        for prefix in ENV_MEMBER_COUNTERS:
            if key.startswith(prefix):
                field = prefix[len("env_"):-len("_total:")]
                out.setdefault(key[len(prefix):], {"episodes": 0.0, "errors": 0.0, "finished": 0.0,
                                                   "reward": 0.0})[field] = value
    for row in out.values():
        row["reward_mean"] = row["reward"] / row["finished"] if row["finished"] else None
    return dict(sorted(out.items()))


def reset_episode(episode, seed: int | None) -> str:
    """``episode.reset(seed=seed)`` where it takes a seed (:func:`takes_seed`), else ``episode.reset()``."""
    if seed is not None and takes_seed(episode):
        return episode.reset(seed=seed)
    return episode.reset()


def encode_text(tokenizer, text: str) -> list[int]:
    """An observation's token ids, exactly as the tokenizer encodes them (none for ``""``)."""
    return list(tokenizer.encode(text)) if text else []


class EnvError(RuntimeError):
    """An environment step that failed (raised, timed out, lost its server)."""


class EnvResetsFailing(EnvError):
    """``env.max_failed_resets`` resets failed in a row: the environment cannot start here (the
    generator exits with ``EXIT_CONFIG_FAILED``, and the run stops naming this error)."""


class EpisodeRunner:
    """The environment side of one generator's episodes in flight: one :class:`Episode` per
    completion, their steps on a thread pool of ``env.workers`` so environment latency
    overlaps decoding, timeouts and the ``env.on_error`` policy, and the counters.

    Counters (``take_counters``, added to ``{ns}:stats`` with the next groups emitted, or with
    the groups handed back at a stop, so every failure logged is counted):
    ``episodes_total`` (started), ``env_steps_total`` (answered), ``env_errors_total``,
    ``env_tool_parse_errors_total`` (malformed tool calls, ``Step.tool_errors``),
    ``env_step_seconds_total`` and the latency buckets (``step_bucket``) of every step
    attempt. Each episode's tool calls and the ones answered are kept until :meth:`tools`
    hands them over with its group (the generator counts them per finished episode).

    Rewards: every reward a turn's step gives is kept with its model turn's index (from 0;
    :meth:`turn_rewards`), and :meth:`finish` returns each episode's environment reward over
    them as ``env.returns`` says (:func:`episode_return`). A factory with a ``route(task) ->
    name`` method (a mixture, ``env.kind = "mix:..."``) has its groups counted per member as
    well (:data:`ENV_MEMBER_COUNTERS`).

    Every episode of a group is reset with the group's seed, ``episode_seed(run_seed,
    prompt_id)`` (``seeds`` keeps it per group in flight). ``env.max_failed_resets`` resets
    failing in a row, none succeeding in between, raise :class:`EnvResetsFailing` naming
    ``env.kind`` and the first of them."""

    def __init__(self, factory: EnvFactory, env_cfg, tokenizer, log, chat: ChatTurns | None = None, *,
                 run_seed: int = 0) -> None:
        self.factory, self.cfg, self.tok, self.log = factory, env_cfg, tokenizer, log
        self.chat = chat if chat is None else chat.for_factory(factory)
        """The observations as chat turns (pipeline.envs.chat; the prompt showing the factory's
        tools, pipeline.envs.tools); None: their raw encoding."""
        self.prompts: dict[object, np.ndarray] = {}
        """Group key -> the prompt its episodes continue (:meth:`prompt`)."""
        self.run_seed = run_seed
        self.seeds: dict[object, int] = {}
        """Group key -> the seed its episodes were reset with."""
        self.failed_resets = 0
        """Resets failed in a row (a successful one sets it back to 0)."""
        self.first_failure: str | None = None
        """The first error of the current run of failed resets."""
        self.pool = ThreadPoolExecutor(env_cfg.workers, thread_name_prefix="env")
        self.episodes: dict[tuple, Episode] = {}
        self.pending: dict[tuple, list] = {}
        """(group key, completion) -> [future, started, attempts, action text]."""
        self.rewards: dict[object, list[list[tuple[int, float]]]] = {}
        """Group key -> per completion the (model turn index, reward) of every turn that gave one."""
        self.turns: dict[tuple, int] = {}
        """(group key, completion) -> model turns submitted so far."""
        self.returns = getattr(env_cfg, "returns", "last")
        self.discount = float(getattr(env_cfg, "discount", 1.0))
        self.route = getattr(factory, "route", None)
        """A mixture's router (task -> member kind), else None."""
        self.members: dict[object, str] = {}
        """Group key -> the member of the mixture its episodes play."""
        self.calls: dict[object, list[list[int]]] = {}
        """Group key -> per completion [tool calls, tool calls answered]."""
        self.counters: dict[str, float] = {}
        self.broken: set[tuple] = set()
        """Episodes whose environment failed to start."""

    def _count(self, name: str, value: float = 1, key=None) -> None:
        self.counters[name] = self.counters.get(name, 0) + value
        member = self.members.get(key) if key is not None else None
        if member is not None and f"{name}:" in ENV_MEMBER_COUNTERS:
            self.counters[f"{name}:{member}"] = self.counters.get(f"{name}:{member}", 0) + value

    def take_counters(self) -> dict[str, float]:
        out, self.counters = self.counters, {}
        return out

    def start(self, key, task, n: int) -> list[list[int]]:
        """``n`` new episodes of ``task``; their first observations' token ids. An episode whose
        environment cannot start (or whose first observation cannot be encoded) is counted as
        an error and ends at its first turn, unrewarded."""
        firsts = []
        self.rewards[key] = [[] for _ in range(n)]
        self.calls[key] = [[0, 0] for _ in range(n)]
        seed = self.seeds[key] = episode_seed(self.run_seed, task.prompt_id)
        if self.route is not None:
            self.members[key] = self.route(task)
        # The group's episodes are made and reset on the pool together (``env.workers`` at a time),
        # so one round trip to a server costs the group once, not once per completion.
        opened = [self.pool.submit(self._open, task, seed) for _ in range(n)]
        for j, fut in enumerate(opened):
            try:
                ep, reset = fut.result()
                if ep is not None:
                    self.episodes[(key, j)] = ep
                if isinstance(reset, BaseException):
                    raise reset
                if not isinstance(reset, str):
                    raise EnvError(f"reset returned {type(reset).__name__}, not a str")
                firsts.append(reset if self.chat is not None else encode_text(self.tok, reset))
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                self._count("env_errors_total", key=key)
                self.log.warning("env_reset_failed", member=j, seed=seed, error=error)
                self.broken.add((key, j))
                firsts.append("" if self.chat is not None else [])
                self.failed_resets += 1
                self.first_failure = self.first_failure or error
            else:
                self.failed_resets, self.first_failure = 0, None
        self._count("episodes_total", n)
        if key in self.members:
            self._count(f"env_episodes_total:{self.members[key]}", n)
        if self.chat is not None:  # the reset texts as a user turn before the model's first
            try:
                self.prompts[key], firsts = self.chat.first(task.prompt_ids, firsts, text=task.prompt)
            except ValueError as e:  # a prompt not built with the template: its episodes end unrewarded
                self._count("env_errors_total", n, key=key)
                self.log.warning("env_reset_failed", error=str(e))
                self.broken.update((key, j) for j in range(n))
                firsts = [[] for _ in range(n)]
                self.failed_resets += n
                self.first_failure = self.first_failure or str(e)
        bound = getattr(self.cfg, "max_failed_resets", 0)
        if bound and self.failed_resets >= bound:
            raise EnvResetsFailing(
                f"env.kind {getattr(self.cfg, 'kind', '')!r}: {self.failed_resets} episode resets failed in a row, "
                f"none succeeded in between (env.max_failed_resets = {bound}); the first: {self.first_failure}")
        return firsts

    def _open(self, task, seed: int):
        """One episode of ``task`` made and reset (on the pool): (episode or None, its first
        observation or the exception that stopped it). The episode is returned even when its
        reset failed, so :meth:`finish` closes it."""
        try:
            ep = self.factory(task)
        except Exception as e:
            return None, e
        try:
            return ep, reset_episode(ep, seed)
        except Exception as e:
            return ep, e

    def prompt(self, key, default: np.ndarray) -> np.ndarray:
        """The prompt a group's episodes continue: ``default`` (the task's), or without its
        generation prompt where the reset texts went into a user turn (:meth:`ChatTurns.first`)."""
        return self.prompts.get(key, default)

    def submit(self, key, member: int, action: str, attempts: int = 0) -> None:
        if (key, member) in self.broken:  # its environment never started: the episode ends here
            fut: Future = Future()
            fut.set_result(Step(observation="", done=True))
        else:
            fut = self.pool.submit(self.episodes[(key, member)].step, action)
        if not attempts:  # a retry is the same model turn
            self.turns[(key, member)] = self.turns.get((key, member), 0) + 1
        self.pending[(key, member)] = [fut, time.monotonic(), attempts, action]

    @property
    def waiting(self) -> int:
        return len(self.pending)

    def collect(self, block_s: float = 0.0) -> list[tuple[object, int, list[int], bool]]:
        """Answers that came back (waiting up to ``block_s`` for one): (key, completion,
        observation ids, done). A step that raised or timed out is retried or ends its episode."""
        if not self.pending:
            return []
        if block_s > 0:
            wait([p[0] for p in self.pending.values()], timeout=block_s, return_when=FIRST_COMPLETED)
        out, now = [], time.monotonic()
        for (key, member), (fut, started, attempts, action) in list(self.pending.items()):
            error = None
            if fut.done():
                try:
                    step = fut.result()
                    if not isinstance(step, Step):
                        raise EnvError(f"step returned {type(step).__name__}, not a Step")
                    obs = encode_text(self.tok, step.observation) if self.chat is None else self.chat.step_ids(step)
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
            elif now - started > self.cfg.step_timeout_s:
                error = f"no answer in {self.cfg.step_timeout_s:g} s"
            else:
                continue
            del self.pending[(key, member)]
            self._count("env_step_seconds_total", now - started)
            self._count(step_bucket(now - started))
            if error is not None:
                self._count("env_errors_total", key=key)
                self.log.warning("env_step_failed", member=member, error=error, attempt=attempts + 1)
                if self.cfg.on_error == "retry" and attempts < self.cfg.retries:
                    self.submit(key, member, action, attempts + 1)
                    continue
                out.append((key, member, [], True))
                continue
            self._count("env_steps_total")
            if step.tool_errors:
                self._count("env_tool_parse_errors_total", step.tool_errors)
            if step.tool_call:
                calls = self.calls[key][member]
                calls[0] += 1
                calls[1] += step.tool_ok is not False
            if step.reward is not None:
                self.rewards[key][member].append((self.turns.get((key, member), 1) - 1, float(step.reward)))
            out.append((key, member, obs, bool(step.done)))
        return out

    def tools(self, key, n: int) -> tuple[list[int], list[int]]:
        """A group's tool calls and the ones the environment answered, per completion (call it
        before :meth:`finish`)."""
        calls = self.calls.get(key) or [[0, 0] for _ in range(n)]
        return [c[0] for c in calls], [c[1] for c in calls]

    def turn_rewards(self, key, n: int) -> list[list[tuple[int, float]]]:
        """A group's per-turn rewards, per completion: (model turn index from 0, reward) of each
        turn whose step gave one (call it before :meth:`finish`)."""
        return [list(r) for r in self.rewards.get(key) or [[] for _ in range(n)]]

    def finish(self, key, n: int, *, emitted: bool = True) -> list[float]:
        """Close a group's episodes; their environment rewards over their turns (``env.returns``;
        NaN where no turn gave one). ``emitted``: the group is emitted (a mixture counts its
        episodes finished and their rewards), not handed back."""
        for j in range(n):
            self.turns.pop((key, j), None)
            self.pending.pop((key, j), None)
            self.broken.discard((key, j))
            ep = self.episodes.pop((key, j), None)
            if ep is not None:
                try:
                    ep.close()
                except Exception as e:  # a failed close loses nothing
                    self.log.warning("env_close_failed", error=f"{type(e).__name__}: {e}")
        self.calls.pop(key, None)
        self.seeds.pop(key, None)
        self.prompts.pop(key, None)
        per_turn = self.rewards.pop(key, None) or [[] for _ in range(n)]
        rewards = [episode_return(r, self.returns, self.discount) for r in per_turn]
        member = self.members.pop(key, None)
        if member is not None and emitted:
            self._count(f"env_finished_total:{member}", n)
            self._count(f"env_reward_total:{member}", sum(r for r in rewards if r == r))
        return rewards

    def close(self) -> None:
        """Stop the steps in flight, and the factory's own resources (its servers) if it has any."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.factory, "close", None)
        if callable(close):
            try:
                close()
            except Exception as e:  # a failed teardown loses nothing
                self.log.warning("env_close_failed", error=f"{type(e).__name__}: {e}")
