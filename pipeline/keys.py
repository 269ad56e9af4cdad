"""Every Redis key the pipeline uses, in one place.

All keys live under the run's namespace ``ns`` so runs can share one server.

Streams (consumer groups, acked after the downstream write):
  {ns}:prompts      stream   feeder -> generators (group "generators"). PromptTask records.
  {ns}:rollouts     stream   generators -> verifiers (group "verifiers"). RolloutGroup records.
  {ns}:scored       stream   verifiers -> trainer (group "trainer"). ScoredGroup records.
  {ns}:dead         stream   any consumer -> humans. Fields: reason, stream, id, consumer, payload.
  {ns}:versions     stream   trainer -> generators. One entry per published policy version
                             (field ``version``); generators waiting for admission block on it.

Hashes, counters and lists:
  {ns}:weights      hash     trainer -> generators: ``version`` (latest), ``manifest`` (JSON).
  {ns}:labelmodel   hash     verifier fitter -> verifiers: ``version``, ``params`` (msgpack).
  {ns}:labelmodel:lock       string with TTL: which verifier replica is refitting.
  {ns}:votes        list     verifiers' recent vote rows (msgpack), the label model's window.
  {ns}:admitted     counter  groups admitted for generation, minus those dead-lettered before
                             training (the staleness admission rule, DESIGN §3).
  {ns}:ledger       hash     trainer: prompt id -> outcome ("trained:<step>", "stale:<step>",
                             "nosignal:<step>"). HSETNX makes training idempotent.
  {ns}:trainlog     stream   trainer -> auditors: one entry per group each committed step consumed
                             (prompt_id, group_id, outcome, version), appended unconditionally, so
                             a group trained twice would show up twice (``pipeline check``).
  {ns}:stats        hash     counters any stage increments (dead letters, drops, tokens...).
  {ns}:trainer      hash     trainer progress: step, version, reward, accuracies, state.
  {ns}:workers      hash     worker id -> JSON heartbeat (stage, pid, state, last seen).
  {ns}:stop         string   set by ``pipeline down`` / the cluster driver: every loop exits.

Sharding for Redis Cluster (a later issue): shard k of a stream becomes
``{ns}:rollouts:{<ns>-k}`` so a stream's shard, its dead letters and its metadata share
one hash slot. With one shard (the default) the names above are used unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

GENERATORS_GROUP = "generators"
VERIFIERS_GROUP = "verifiers"
TRAINER_GROUP = "trainer"


@dataclass(frozen=True)
class Keys:
    ns: str

    def __post_init__(self) -> None:
        if not self.ns or any(c in self.ns for c in " {}:"):
            raise ValueError(f"namespace must be non-empty without spaces, braces or colons; got {self.ns!r}")

    @property
    def prompts(self) -> str:
        return f"{self.ns}:prompts"

    @property
    def rollouts(self) -> str:
        return f"{self.ns}:rollouts"

    @property
    def scored(self) -> str:
        return f"{self.ns}:scored"

    @property
    def dead(self) -> str:
        return f"{self.ns}:dead"

    @property
    def versions(self) -> str:
        return f"{self.ns}:versions"

    @property
    def weights(self) -> str:
        return f"{self.ns}:weights"

    @property
    def labelmodel(self) -> str:
        return f"{self.ns}:labelmodel"

    @property
    def labelmodel_lock(self) -> str:
        return f"{self.ns}:labelmodel:lock"

    @property
    def votes(self) -> str:
        return f"{self.ns}:votes"

    @property
    def admitted(self) -> str:
        return f"{self.ns}:admitted"

    @property
    def ledger(self) -> str:
        return f"{self.ns}:ledger"

    @property
    def trainlog(self) -> str:
        return f"{self.ns}:trainlog"

    @property
    def stats(self) -> str:
        return f"{self.ns}:stats"

    @property
    def trainer(self) -> str:
        return f"{self.ns}:trainer"

    @property
    def workers(self) -> str:
        return f"{self.ns}:workers"

    @property
    def stop(self) -> str:
        return f"{self.ns}:stop"

    def streams(self) -> dict[str, tuple[str, str]]:
        """Stream name -> (key, consumer group), in pipeline order."""
        return {
            "prompts": (self.prompts, GENERATORS_GROUP),
            "rollouts": (self.rollouts, VERIFIERS_GROUP),
            "scored": (self.scored, TRAINER_GROUP),
        }
