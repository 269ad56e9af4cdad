"""Every Redis key the pipeline uses, in one place: one layout, S shards (S = 1 the ordinary case).

All keys live under the run's namespace ``ns`` so runs can share one server. A run's
streams are split into ``redis.shards = S`` shards; every stage reads, writes, acks and
commits through ``Keys.shard(k)`` the same way whatever S is. Only the names differ:
with one shard on one server they are plain (``ns:prompts``); with S > 1 or a Redis
Cluster (``redis.cluster = true``) they carry hash tags, because Redis Cluster hashes
only the first ``{...}`` of a key and a MULTI or a script must touch one slot:

  shard prefix   ``ns`` (plain)  or  ``{ns/k}`` (tagged), 0 <= k < S
  global prefix  ``ns`` (plain)  or  ``{ns}``   (tagged)

Per shard (``<shard>`` is the shard prefix; everything one stage's transaction touches together):

  <shard>:prompts    stream  feeder -> generators (group "generators"). PromptTask records.
  <shard>:rollouts   stream  generators -> verifiers (group "verifiers"). RolloutGroup records.
  <shard>:scored     stream  verifiers -> trainer (group "trainer"). ScoredGroup records.
  <shard>:dead       stream  any consumer -> humans. Fields: reason, stream, id, consumer,
                             prompt_id, payload (the entry's record bytes), at (unix seconds).
  <shard>:ledger     hash    trainer: prompt id -> outcome ("trained:<step>", "stale:<step>",
                             "nosignal:<step>"). HSETNX makes training idempotent.
  <shard>:trainlog   stream  trainer -> auditors: one entry per group each committed step
                             consumed (prompt_id, group_id, outcome, version), appended
                             unconditionally, so a group trained twice would show up twice.
  <shard>:stats      hash    counters the stages increment with this shard's writes (dead
                             letters, drops, tokens, seconds...); readers sum over shards,
                             except ``prompts_issued`` (the feeder's position: the maximum).
  <shard>:committed  string  the last trainer step whose commit is final in this shard; the
                             commit script checks it first, so a commit applied again changes nothing.
  <shard>:txn        hash    idempotency tokens of the stages' emit transactions: writer id
                             (``<stage>:<worker>:<random>``, one per stage process) -> "<seq> <result>",
                             the last transaction that writer applied in this shard. The emit
                             script checks it before writing, so a call sent again after a lost
                             reply changes nothing (``bus.streams.TxnWriter``). One field per
                             stage process that ever wrote to the shard; no TTL.
  <shard>:txn:<writer> string the same token, "<seq> <result>", for that writer's emits of 64 KiB
                             or more, which are a WATCHed MULTI rather than the script
                             (``stage.Stage._emit_multi``); one key per such writer; no TTL.

Run-global (``<global>`` is the global prefix; one slot when tagged):

  <global>:versions          stream   trainer -> generators: one entry per published policy
                                      version (field ``version``); waiting generators block on it.
  <global>:weights           hash     trainer -> generators: ``version`` (latest) and the
                                      transport's fields (``manifest``, JSON; see pipeline.weights).
  <global>:labelmodel        hash     verifier fitter -> verifiers: ``version``, ``params``
                                      (MessagePack), ``rows`` (votes fitted on), ``new_groups``.
  <global>:labelmodel:lock   string   with TTL: which verifier replica is refitting.
  <global>:votes             list     the label model's window: one raw little-endian float32
                                      blob per group, [G, m] votes (m verifiers, NaN = abstain).
  <global>:votes:v<version>  hash     ``verifier.refit = "versions"``: the votes of the groups sampled
                                      at one policy version (prompt id -> [G, m] float32 blob), each
                                      replica's fit input for the versions after it.
  <global>:labels            list     the label model's labelled set (``verifier.labels``): one
                                      blob per group, [G, m + 1] float32, votes then hidden truth.
  <global>:admitted          counter  groups admitted for generation, minus those dead-lettered
                                      before training (the staleness admission rule).
  <global>:admitted:txn      hash     idempotency tokens of the changes to ``admitted`` (grants and
                                      give-backs): writer id -> "<seq> <result>", as ``<shard>:txn``.
  <global>:trainer           hash     trainer progress: ``version`` (published), ``steps``
                                      (target), ``state``, ``reward_mean``, ``sample_accuracy``,
                                      ``base_accuracy``, ``eval_accuracy``, ``eval_version``,
                                      ``updated_at``, ``committed_version`` (every shard has it).
  <global>:workers           hash     worker id -> JSON heartbeat (stage, pid, state, at, ...).
  <global>:stop              string   set by ``pipeline down`` / the driver: every loop exits.

Routing: prompt ``p`` lives in shard ``crc32(p) % S`` for its whole life (``shard_of``):
the generator writes a prompt's rollout group to the shard it read the prompt from, the
verifier the scored group likewise, so "write downstream + ack upstream + counters" is
one single-slot transaction per batch. Consumers read every shard (``bus.streams.ShardedReader``);
readers of counters, depths and dead letters sum or merge over the shards.

Admission stays global and exact: ``<global>:admitted`` is one counter that the admission
script checks and increments atomically (on one server the same script reads the prompts
it admits, ``bus.flow.Admission.admit_read``). Dead letters live in a shard's slot, so giving
their admission slot back is a second script (``DECRBY``) sent right after the shard's
transaction. A crash between the two leaks those slots: the counter stays too high, so
admission is stricter than ``(η + v + 1)·B`` by at most the dead letters of one batch per
crash; it never admits more than the bound.

Idempotency: redis-py sends a call again after a connection error, and a transaction the
server applied before the reply was lost would be applied twice. Every transaction that
writes is therefore a Lua script that checks a token in its own slot before writing: an
emit checks ``<shard>:txn``, a grant or give-back ``<global>:admitted:txn``, a trainer commit
``<shard>:committed``, the feeder's prompt writes ``<shard>:stats`` ``prompts_issued``.
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
    """``ns`` with plain names; ``{ns/k}`` tagged."""
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

    @property
    def txn(self) -> str:
        return f"{self.prefix}:txn"

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
    def tagged(self) -> bool:
        """Whether names carry hash tags (more than one shard, or a Redis Cluster). Only the
        names depend on it: every stage reads, writes and commits the same way whatever S is."""
        return self.shards > 1 or self.cluster

    @property
    def _g(self) -> str:
        return f"{{{self.ns}}}" if self.tagged else self.ns

    # ---------------------------------------------------------------- shards

    def shard(self, k: int) -> ShardKeys:
        if not 0 <= k < self.shards:
            raise IndexError(f"shard {k} of {self.shards}")
        return ShardKeys(f"{{{self.ns}/{k}}}" if self.tagged else self.ns, k)

    def all_shards(self) -> list[ShardKeys]:
        return [self.shard(k) for k in range(self.shards)]

    def shard_of(self, prompt_id: str) -> int:
        """The shard a prompt (and everything derived from it) lives in: crc32(id) mod S."""
        return zlib.crc32(prompt_id.encode()) % self.shards if self.shards > 1 else 0

    def stream_keys(self, name: str) -> list[str]:
        """Every shard's key of stream ``name`` (prompts, rollouts, scored, dead)."""
        return [getattr(s, name) for s in self.all_shards()]

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

    def version_votes(self, version: int) -> str:
        return f"{self._g}:votes:v{version}"

    @property
    def labels(self) -> str:
        return f"{self._g}:labels"

    @property
    def admitted(self) -> str:
        return f"{self._g}:admitted"

    @property
    def admitted_txn(self) -> str:
        return f"{self._g}:admitted:txn"

    @property
    def trainer(self) -> str:
        return f"{self._g}:trainer"

    @property
    def workers(self) -> str:
        return f"{self._g}:workers"

    @property
    def stop(self) -> str:
        return f"{self._g}:stop"
