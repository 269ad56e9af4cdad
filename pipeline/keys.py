"""Every Redis key the pipeline uses, in one place.

All keys live under the run's namespace ``ns`` so runs can share one server.

Unsharded layout (``redis.shards = 1``, ``redis.cluster = false``: one server, plain names)
-------------------------------------------------------------------------------------------

Streams (consumer groups, acked after the downstream write):
  ns:prompts      stream   feeder -> generators (group "generators"). PromptTask records.
  ns:rollouts     stream   generators -> verifiers (group "verifiers"). RolloutGroup records.
  ns:scored       stream   verifiers -> trainer (group "trainer"). ScoredGroup records.
  ns:dead         stream   any consumer -> humans. Fields: reason, stream, id, consumer, payload.
  ns:versions     stream   trainer -> generators. One entry per published policy version
                           (field ``version``); generators waiting for admission block on it.

Hashes, counters and lists:
  ns:weights      hash     trainer -> generators: ``version`` (latest), ``manifest`` (JSON).
  ns:labelmodel   hash     verifier fitter -> verifiers: ``version``, ``params`` (msgpack).
  ns:labelmodel:lock       string with TTL: which verifier replica is refitting.
  ns:votes        list     verifiers' recent vote rows (msgpack), the label model's window.
  ns:admitted     counter  groups admitted for generation, minus those dead-lettered before
                           training (the staleness admission rule, DESIGN §3).
  ns:ledger       hash     trainer: prompt id -> outcome ("trained:<step>", "stale:<step>",
                           "nosignal:<step>"). HSETNX makes training idempotent.
  ns:trainlog     stream   trainer -> auditors: one entry per group each committed step consumed
                           (prompt_id, group_id, outcome, version), appended unconditionally, so
                           a group trained twice would show up twice (``pipeline check``).
  ns:stats        hash     counters any stage increments (dead letters, drops, tokens...).
  ns:trainer      hash     trainer progress: step, version, reward, accuracies, state,
                           ``committed_version`` (last step whose commit is final).
  ns:workers      hash     worker id -> JSON heartbeat (stage, pid, state, last seen).
  ns:stop         string   set by ``pipeline down`` / the cluster driver: every loop exits.

Sharded layout (``redis.shards = S > 1``, or ``redis.cluster = true``)
----------------------------------------------------------------------

Redis Cluster hashes only the first ``{...}`` of a key, and a MULTI or a script must
touch one slot. So every key carries a hash tag: shard ``k`` (0 <= k < S) has the tag
``{ns/k}`` and holds everything one stage's transaction touches together:

  {ns/k}:prompts  {ns/k}:rollouts  {ns/k}:scored   the three streams of shard k
  {ns/k}:dead                                      dead letters of shard k's entries
  {ns/k}:ledger   {ns/k}:trainlog                  outcomes of the prompts routed to k
  {ns/k}:stats                                     counters incremented with k's writes
  {ns/k}:committed                                 last trainer step committed in shard k

Run-global keys share the tag ``{ns}`` (one slot): ``{ns}:versions``, ``{ns}:weights``,
``{ns}:labelmodel``, ``{ns}:labelmodel:lock``, ``{ns}:votes``, ``{ns}:admitted``,
``{ns}:trainer``, ``{ns}:workers``, ``{ns}:stop``.

Routing: prompt ``p`` lives in shard ``crc32(p) % S`` for its whole life (``shard_of``):
the generator writes a prompt's rollout group to the shard it read the prompt from, the
verifier the scored group likewise, so "write downstream + ack upstream + counters" is
one single-slot MULTI per batch. Consumers read every shard (``streams.ShardedReader``);
readers of counters, depths and dead letters sum or merge over the shards.

Admission stays global and exact: ``{ns}:admitted`` is one counter that the admission
script checks and increments atomically. Dead letters live in a shard's slot, so giving
their admission slot back is a separate ``DECRBY`` sent right after the shard's MULTI.
A crash between the two leaks those slots: the counter stays too high, so admission is
stricter than ``(η + v + 1)·B`` by at most the dead letters of one batch per crash; it
never admits more than the bound. (Unsharded, the release stays inside the MULTI.)
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

GENERATORS_GROUP = "generators"
VERIFIERS_GROUP = "verifiers"
TRAINER_GROUP = "trainer"
STREAM_NAMES = ("prompts", "rollouts", "scored")


@dataclass(frozen=True)
class ShardKeys:
    """The keys of one shard: its three streams, dead letters, ledger, training log and counters."""

    prefix: str
    """``ns`` unsharded; ``{ns/k}`` sharded."""
    index: int = 0

    @property
    def prompts(self) -> str:
        return f"{self.prefix}:prompts"

    @property
    def rollouts(self) -> str:
        return f"{self.prefix}:rollouts"

    @property
    def scored(self) -> str:
        return f"{self.prefix}:scored"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def ledger(self) -> str:
        return f"{self.prefix}:ledger"

    @property
    def trainlog(self) -> str:
        return f"{self.prefix}:trainlog"

    @property
    def stats(self) -> str:
        return f"{self.prefix}:stats"

    @property
    def committed(self) -> str:
        return f"{self.prefix}:committed"

    def streams(self) -> dict[str, tuple[str, str]]:
        """Stream name -> (key, consumer group), in pipeline order."""
        return {
            "prompts": (self.prompts, GENERATORS_GROUP),
            "rollouts": (self.rollouts, VERIFIERS_GROUP),
            "scored": (self.scored, TRAINER_GROUP),
        }


@dataclass(frozen=True)
class Keys:
    ns: str
    shards: int = 1
    """S: shards per stream."""
    cluster: bool = False
    """Hash-tagged names even with one shard (a Redis Cluster needs them)."""

    def __post_init__(self) -> None:
        if not self.ns or any(c in self.ns for c in " {}:"):
            raise ValueError(f"namespace must be non-empty without spaces, braces or colons; got {self.ns!r}")
        if self.shards < 1:
            raise ValueError(f"redis.shards: must be >= 1; got {self.shards}")

    @classmethod
    def of(cls, ns: str, redis_cfg) -> "Keys":
        """The keys of run ``ns`` under the layout ``redis_cfg`` (``RedisConfig``) selects."""
        return cls(ns, shards=redis_cfg.shards, cluster=redis_cfg.cluster)

    @property
    def sharded(self) -> bool:
        """Whether keys carry hash tags (more than one shard, or a Redis Cluster)."""
        return self.shards > 1 or self.cluster

    @property
    def _g(self) -> str:
        return f"{{{self.ns}}}" if self.sharded else self.ns

    # ---------------------------------------------------------------- shards

    def shard(self, k: int) -> ShardKeys:
        if not 0 <= k < self.shards:
            raise IndexError(f"shard {k} of {self.shards}")
        return ShardKeys(f"{{{self.ns}/{k}}}" if self.sharded else self.ns, k)

    def all_shards(self) -> list[ShardKeys]:
        return [self.shard(k) for k in range(self.shards)]

    def shard_of(self, prompt_id: str) -> int:
        """The shard a prompt (and everything derived from it) lives in: crc32(id) mod S."""
        return zlib.crc32(prompt_id.encode()) % self.shards if self.shards > 1 else 0

    def stream_keys(self, name: str) -> list[str]:
        """Every shard's key of stream ``name`` (prompts, rollouts, scored, dead)."""
        return [getattr(s, name) for s in self.all_shards()]

    def _only(self) -> ShardKeys:
        if self.shards != 1:
            raise ValueError(f"run {self.ns!r} has {self.shards} shards: name one (Keys.shard(k))")
        return self.shard(0)

    # ------------------------------------------- the single shard (S == 1)

    @property
    def prompts(self) -> str:
        return self._only().prompts

    @property
    def rollouts(self) -> str:
        return self._only().rollouts

    @property
    def scored(self) -> str:
        return self._only().scored

    @property
    def dead(self) -> str:
        return self._only().dead

    @property
    def ledger(self) -> str:
        return self._only().ledger

    @property
    def trainlog(self) -> str:
        return self._only().trainlog

    @property
    def stats(self) -> str:
        return self._only().stats

    def streams(self) -> dict[str, tuple[str, str]]:
        """Stream name -> (key, consumer group), in pipeline order (one shard only)."""
        return self._only().streams()

    # ---------------------------------------------------------- run-global

    @property
    def versions(self) -> str:
        return f"{self._g}:versions"

    @property
    def weights(self) -> str:
        return f"{self._g}:weights"

    @property
    def labelmodel(self) -> str:
        return f"{self._g}:labelmodel"

    @property
    def labelmodel_lock(self) -> str:
        return f"{self._g}:labelmodel:lock"

    @property
    def votes(self) -> str:
        return f"{self._g}:votes"

    @property
    def admitted(self) -> str:
        return f"{self._g}:admitted"

    @property
    def trainer(self) -> str:
        return f"{self._g}:trainer"

    @property
    def workers(self) -> str:
        return f"{self._g}:workers"

    @property
    def stop(self) -> str:
        return f"{self._g}:stop"
