"""Generator: samples G completions per prompt with the current policy.

consumes:     PromptTask records from {ns}:prompts (group "generators"), acked with the output
produces:     RolloutGroup records on {ns}:rollouts, with behaviour log-probs and policy version
waits for:    admission (docs/design.md §3): groups admitted < (η + v + 1)·B; then for a prompt
unblocked by: the trainer publishing version v+1 ({ns}:versions); the feeder adding prompts
Weights swap only between generation batches, so no batch runs on half-written weights.
A batch comes from one shard k and its groups go to rollouts shard k, so the xadd + xack +
counters stay one single-slot transaction (``Stage.emit``: the emit Lua script, or a
MULTI/EXEC when the groups come to ``stage.MULTI_BYTES`` or more).

The loop (``Stage.run``): swap in the newest weights → wait for room downstream → take
admitted prompts (own or reclaimed first, else as many new ones as admission grants) →
sample G completions per prompt → emit the groups and ack the prompts in that one transaction.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from typing import TYPE_CHECKING, Callable

import numpy as np
import redis

from pipeline.bus.flow import Admission, NewestVersion, VersionWatch
from pipeline.bus.streams import Entry, unacked_all
from pipeline.common.procs import EXIT_CONFIG_FAILED
from pipeline.config import RunConfig
from pipeline.envs.base import EnvResetsFailing, EpisodeRunner
from pipeline.envs.chat import ChatTurns
from pipeline.envs.registry import make_env
from pipeline.engines import GenerationBackend, Sampled, make_generation_backend
from pipeline.keys import GENERATORS_GROUP, VERIFIERS_GROUP, Keys
from pipeline.model.tokenizer import model_context_length
from pipeline.records import PromptTask, RecordError, RolloutGroup, check_token_ids, version_runs
from pipeline.stage import Batch, Output, Stage
from pipeline.tasks.arithmetic import prompt_length
from pipeline.tasks.prompting import prompt_format
from pipeline.weights import WeightsError, fetcher_options, make_fetcher

if TYPE_CHECKING:
    from pipeline.engines.slots import Finished


def sampling_seed(seed: int, prompt_id: str, version: int) -> int:
    """The sampling seed of a prompt sampled under policy ``version``: from ``generator.seed``,
    the prompt's id and the version, so the same prompt gets the same samples from the same
    weights on any generator, in any batch (engines that take seeds: ``seeded``), and replicas
    still draw different samples, since they sample different prompts."""
    digest = hashlib.blake2b(f"{seed}:{prompt_id}:{version}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def swap_weights(fetcher, backend: GenerationBackend, version: int, log, *,
                 publisher_closed: Callable[[], bool] | None = None) -> int:
    """Load the newest published version if it is newer; on any defect keep the old weights.

    ``publisher_closed``: whether the trainer has ended (its publisher releases every payload as
    it exits, so a fetch begun just before can find the payload gone). Such a failure is the
    run's end, not a defect, and is logged as ``weights_fetch_skipped`` (info)."""
    latest = fetcher.latest_version()
    if latest <= version:
        return version
    t0 = time.perf_counter()
    try:
        # Views of the fetcher's verified second buffer, copied into the engine right here.
        new_version, tensors = fetcher.fetch(latest, copy=False)
        backend.load_weights(tensors)
    except (WeightsError, ValueError) as e:
        if isinstance(e, WeightsError) and publisher_closed is not None and publisher_closed():
            log.info("weights_fetch_skipped", version=latest, reason="the trainer has ended", error=str(e),
                     keeping=version)
        else:
            log.warning("weights_fetch_failed", version=latest, error=str(e), keeping=version)
        return version
    log.info("weights_swapped", from_version=version, to_version=new_version, seconds=time.perf_counter() - t0)
    return new_version


def check_prompt(t: PromptTask, *, prompt_len: int | None, max_len: int, vocab_size: int,
                 group_size: int | None = None, max_new_tokens: int | None = None,
                 newest: Callable[[int], int] | None = None) -> None:
    """Defects only the generator can see: a prompt of the wrong length or with unknown tokens,
    a partial group of the wrong size, beyond the token budget or claiming a policy version not
    yet published (``newest``: the newest published, given the version claimed)."""
    if prompt_len is not None and t.prompt_ids.size != prompt_len:
        raise RecordError(f"prompt has {t.prompt_ids.size} tokens, this task's prompts have {prompt_len}")
    if not 1 <= t.prompt_ids.size <= max_len:
        raise RecordError(f"prompt has {t.prompt_ids.size} tokens; 1 to {max_len} leave room for the completion")
    check_token_ids("prompt", t.prompt_ids, vocab_size)
    if t.partial is not None:
        if group_size is not None and t.partial.lens.size != group_size:
            raise RecordError(f"partial group of {t.partial.lens.size} completions, generator.group_size is "
                              f"{group_size}")
        if max_new_tokens is not None and int(t.partial.lens.max()) > max_new_tokens:
            raise RecordError(f"partial completion of {int(t.partial.lens.max())} tokens exceeds "
                              f"task.max_new_tokens = {max_new_tokens}")
        check_token_ids("partial completion", t.partial.ids, vocab_size)
        if newest is not None and t.partial.versions.size:
            claimed = int(t.partial.versions[1::2].max())
            if claimed > max(newest(claimed), 0):
                raise RecordError(f"partial completion of policy version {claimed}, newer than the newest "
                                  f"published, {max(newest(claimed), 0)}")


def to_groups(tasks: list[PromptTask], samples: list[Sampled], *, tok, worker_id: str, batch: int,
              version: int) -> list[RolloutGroup]:
    """One RolloutGroup per task from its ``Sampled`` completions."""
    out = []
    for t, s in zip(tasks, samples):
        rows = range(s.tokens.shape[0])
        out.append(RolloutGroup(
            prompt_id=t.prompt_id, group_id=f"{t.prompt_id}:{worker_id}:{batch}", generator_id=worker_id,
            prompt=t.prompt, prompt_ids=t.prompt_ids, reference=t.reference,
            completions=tuple(tok.decode(s.tokens[j, : s.lengths[j]].tolist()) for j in rows),
            completion_ids=np.concatenate([s.tokens[j, : s.lengths[j]] for j in rows]).astype(np.int32),
            completion_lens=s.lengths.astype(np.int32),
            behaviour_logprobs=np.concatenate([s.logprobs[j, : s.lengths[j]] for j in rows]).astype(np.float32),
            min_version=version, max_version=version, created_at=time.time()))
    return out


def finished_group(t: PromptTask, fin: Finished, *, tok, worker_id: str, serial: int,
                   env_rewards: list[float] | None = None,
                   tools: tuple[list[int], list[int]] | None = None) -> RolloutGroup:
    """The RolloutGroup of a group the slot sampler finished, with every token's version (and,
    for episodes, the loss mask, turns, environment rewards and ``tools``, the tool calls and
    the answered ones per completion; the completion text is the final model turn, the answer
    the verifiers read)."""
    lens = np.array([len(x) for x in fin.tokens], dtype=np.int32)
    versions = np.concatenate([np.asarray(v, dtype=np.int64) for v in fin.versions])
    lo, hi = int(versions.min()), int(versions.max())
    episode = {} if fin.masks is None else {
        "loss_mask": np.concatenate([np.asarray(m, dtype=np.uint8) for m in fin.masks]),
        "turns": np.asarray(fin.turns, dtype=np.int32),
        "env_rewards": np.asarray(env_rewards if env_rewards is not None else [np.nan] * len(fin.tokens),
                                  dtype=np.float32)}
    if episode and tools is not None:
        episode["tool_calls"] = np.asarray(tools[0], dtype=np.int32)
        episode["tool_calls_ok"] = np.asarray(tools[1], dtype=np.int32)
    texts = fin.last_turns if fin.last_turns is not None else fin.tokens
    return RolloutGroup(
        prompt_id=t.prompt_id, group_id=f"{t.prompt_id}:{worker_id}:s{serial}", generator_id=worker_id, prompt=t.prompt,
        prompt_ids=t.prompt_ids, reference=t.reference, **episode,
        completions=tuple(tok.decode(x) for x in texts),
        completion_ids=np.concatenate([np.asarray(x, dtype=np.int32) for x in fin.tokens]),
        completion_lens=lens,
        behaviour_logprobs=np.concatenate([np.asarray(x, dtype=np.float32) for x in fin.logprobs]),
        min_version=lo, max_version=hi, created_at=time.time(),
        version_runs=None if lo == hi else version_runs(versions))


NO_PROMPT_WAIT_S = 0.05
"""Pause after an admitted read found no new prompt (the feeder keeps a backlog, so rare)."""


class Generator:
    """One generator process: its engine, weight fetcher, admission and stage plumbing."""

    def __init__(self, cfg: RunConfig, r, keys: Keys, worker_id: str, log, *,
                 backend: GenerationBackend | None = None) -> None:
        self.cfg, self.r, self.keys, self.worker_id, self.log = cfg, r, keys, worker_id, log
        self.backend = backend if backend is not None else make_generation_backend(cfg, worker_id=worker_id)
        self.fetcher = make_fetcher(cfg.weights.transport, r, keys.weights, **fetcher_options(cfg.weights))
        self.admission = Admission(r, keys, max_staleness=cfg.trainer.max_staleness,
                                   groups_per_step=cfg.trainer.groups_per_step)
        self.watch = VersionWatch(r, keys)
        plen = prompt_length(cfg.task.digits) if cfg.task.kind == "arithmetic" else None
        max_len = model_context_length(cfg.model.base_dir) - cfg.task.max_new_tokens
        newest = NewestVersion(r, keys)
        self.stage = Stage(r, keys, cfg, name="generator", worker_id=worker_id, log=log, source="prompts",
                           group=GENERATORS_GROUP, decode=PromptTask.decode, sink="rollouts",
                           sink_group=VERIFIERS_GROUP,
                           check=lambda t: check_prompt(t, prompt_len=plen, max_len=max_len,
                                                        vocab_size=self.backend.vocab_size,
                                                        group_size=cfg.generator.group_size,
                                                        max_new_tokens=cfg.task.max_new_tokens,
                                                        newest=newest))
        self.version, self.produced = 0, 0
        self.seeded = bool(getattr(self.backend, "seeded", False))
        """The engine takes a sampling seed per prompt (:func:`sampling_seed`)."""

    def seeds(self, tasks: list[PromptTask]) -> dict:
        """``generate``'s ``seeds`` keyword for an engine that takes them, else nothing."""
        return {"seeds": [sampling_seed(self.cfg.generator.seed, t.prompt_id, self.version) for t in tasks]
                } if self.seeded else {}

    def swap_weights(self) -> None:
        self.version = swap_weights(self.fetcher, self.backend, self.version, self.log,
                                    publisher_closed=self.trainer_ended)

    def trainer_ended(self) -> bool:
        """The trainer wrote its final state (it does so before it closes its weights publisher)."""
        try:
            state = self.r.hget(self.keys.trainer, "state")
        except redis.RedisError:
            return False
        return state in (b"finished", b"stopped")

    def read_admitted(self, count: int, *, wait: bool = True) -> list[Entry]:
        """Prompts already admitted (own or a dead generator's), else as many new ones as admission
        grants; ``wait``: block a while when admission has no room or no prompt came."""
        entries = self.stage.reader.read_owned(count)
        if entries:
            return entries
        if self.cfg.redis.cluster:
            granted = self.admission.admit(count, self.version)
            room = granted > 0
            if room:  # not blocking: the window in which a kill leaks the grant is one round trip
                lost = self.stage.reader.lost_waiting
                entries = self.stage.reader.read_new(granted, None)
                # Entries of a lost reply the read found are read next as owned work: they keep their slots.
                self.admission.release(max(0, granted - len(entries) - (self.stage.reader.lost_waiting - lost)))
        else:  # one script: a kill at any point leaks no slot
            room, entries = self.admission.admit_read(self.stage.reader, count, self.version)
        if not room:
            if wait:
                self.stage.heartbeat("waiting_admission", version=self.version, groups=self.produced)
                self.watch.wait(self.cfg.redis.block_ms)
            return []
        if not entries and wait:
            time.sleep(NO_PROMPT_WAIT_S)
        return entries

    def step(self, batch: Batch) -> Output:
        """G completions of every prompt, as one RolloutGroup each."""
        g = self.cfg.generator
        tasks = batch.records
        for t in tasks:
            if t.partial is not None:  # batch generation starts every completion afresh
                self.log.info("partial_restarted", prompt_id=t.prompt_id, tokens=int(t.partial.ids.size))
        self.stage.heartbeat("generating", version=self.version, groups=self.produced)
        t0 = time.perf_counter()
        samples = self.backend.generate([t.prompt_ids for t in tasks], n=g.group_size,
                                        max_new_tokens=self.cfg.task.max_new_tokens, temperature=g.temperature,
                                        **self.seeds(tasks))
        groups = to_groups(tasks, samples, tok=self.backend.tokenizer, worker_id=self.worker_id,
                           batch=self.stage.batches + 1, version=self.version)
        seconds = time.perf_counter() - t0
        n_tokens = int(sum(int(s.lengths.sum()) for s in samples))
        self.produced += len(groups)
        self.log.info("batch_generated", groups=len(groups), version=self.version, seconds=round(seconds, 4),
                      tokens=n_tokens, prompt_ids=[t.prompt_id for t in tasks])
        return Output(written=[(e, grp.encode()) for (e, _), grp in zip(batch.good, groups)],
                      counters={"groups_generated_total": len(groups), "tokens_generated_total": n_tokens,
                                "generate_seconds_total": seconds})

    def close(self) -> None:
        self.backend.close()


HEARTBEAT_EVERY_S = 1.0
"""Seconds between heartbeats while the slot sampler decodes."""
ADMIT_RETRY_S = 0.02
"""While sequences are in flight, the pause before asking admission again after it gave nothing."""
ENV_WAIT_S = 0.05
"""Longest wait for an environment's answer when no sequence is left to decode."""


class Streamer:
    """``generator.swap`` step/drain: continuous batching over the engine's slot sampler.

    The loop: stop requested → hand every group in flight back to the prompts stream as
    resumable work and leave; a newer version published → swap it in now (``step``: between
    two decode steps, the sequences in flight keep going) or stop admitting until they
    finish (``drain``); free slots for a group and room downstream → read admitted prompts
    (without blocking while sequences are in flight) and put them in flight; then one decode
    step; every group that finished is emitted at once (its XADD and its prompt's XACK in one
    transaction, as in batch mode).
    """

    def __init__(self, gen: Generator) -> None:
        self.gen = gen
        g = gen.cfg.generator
        self.g = g
        self.sampler = gen.backend.continuous(slots=g.slots or g.prompts_per_batch * g.group_size)
        self.inflight: dict[tuple[int, bytes], tuple[Entry, PromptTask]] = {}
        factory = make_env(gen.cfg)
        # Every episode of a group is reset with one seed, from feeder.seed and the prompt's id.
        self.env = None if factory is None else EpisodeRunner(
            factory, gen.cfg.env, gen.backend.tokenizer, gen.log,
            chat=ChatTurns.of(prompt_format(gen.cfg.task, gen.cfg.model.base_dir), gen.backend.tokenizer),
            run_seed=gen.cfg.feeder.seed)
        self.draining = False
        self.serial = 0
        self.decode_s, self.steps, self.slot_steps = 0.0, 0, 0
        self._beat = 0.0
        self._next_admit = 0.0

    # ------------------------------------------------------------------ weights

    def maybe_swap(self) -> None:
        gen = self.gen
        latest = gen.fetcher.latest_version()
        if latest <= gen.version:
            return
        if self.g.swap == "drain" and self.sampler.active:
            if not self.draining:
                gen.log.info("draining_for_version", version=latest, in_flight=self.sampler.active)
            self.draining = True
            return
        before = gen.version
        gen.swap_weights()
        self.draining = False
        if gen.version != before:
            gen.log.info("swapped_in_flight", version=gen.version, in_flight=self.sampler.active,
                         kv=self.g.kv_on_swap)
            # The next token sampled comes from the new weights: re-run every prefix, or only
            # the last position of each (its keys and values and its next-token logits).
            if self.g.kv_on_swap == "recompute":
                self.sampler.recompute(gen.version)
            else:
                self.sampler.refresh(gen.version)

    # ------------------------------------------------------------------ prompts in

    def room_downstream(self) -> bool:
        st = self.gen.stage
        return unacked_all(st.r, st.keys.stream_keys("rollouts"), VERIFIERS_GROUP,
                           cap=st.cfg.redis.max_stream_lag + 1) <= st.cfg.redis.max_stream_lag

    def admit(self) -> bool:
        """Read admitted prompts into free slots; returns whether a read returned entries."""
        gen, st = self.gen, self.gen.stage
        if self.sampler.active and time.monotonic() < self._next_admit:
            return False
        want = min(self.g.prompts_per_batch, self.sampler.free // self.g.group_size)
        if self.env is not None:  # episodes waiting on their environments hold no slot, up to a bound
            cap = gen.cfg.env.max_in_flight or 2 * self.sampler.slots
            want = min(want, (cap - self.sampler.rows) // self.g.group_size)
        if want < 1 or self.draining:
            return False
        if self.sampler.active:
            if not self.room_downstream():
                self._next_admit = time.monotonic() + ADMIT_RETRY_S
                return False
            entries = gen.read_admitted(want, wait=False)
        else:
            st.wait_for_room()
            entries = gen.read_admitted(want)
        entries = [e for e in entries if (e.shard, e.id) not in self.inflight]  # our own, reclaimed
        if not entries:
            # Nothing to admit: ask again after a pause, not at every decode step.
            self._next_admit = time.monotonic() + ADMIT_RETRY_S
            return False
        batch = st.take(entries)
        if batch.bad:
            st.emit(dataclasses.replace(batch, good=[]), Output())
        for e, task in batch.good:
            key = (e.shard, e.id)
            self.inflight[key] = (e, task)
            seed = {"seed": sampling_seed(self.g.seed, task.prompt_id, gen.version)} if gen.seeded else {}
            if self.env is not None:  # an episode per completion; the environment's first words
                firsts = self.env.start(key, task, self.g.group_size)
                done = self.sampler.add(key, self.env.prompt(key, task.prompt_ids), n=self.g.group_size,
                                        max_new_tokens=gen.cfg.task.max_new_tokens, version=gen.version,
                                        observations=firsts, **seed)
                self.sampler.set_max_turns(key, gen.cfg.env.max_turns, gen.cfg.env.max_turn_tokens)
                continue
            done = self.sampler.add(key, task.prompt_ids, n=self.g.group_size,
                                    max_new_tokens=gen.cfg.task.max_new_tokens, version=gen.version,
                                    partial=task.partial, **seed)
            if task.partial is not None:
                gen.log.info("partial_resumed", prompt_id=task.prompt_id, tokens=int(task.partial.ids.size))
            if done is not None:
                self.emit([done])
        return True

    # ------------------------------------------------------------------ groups out

    def emit(self, finished: list[Finished]) -> None:
        gen, st = self.gen, self.gen.stage
        by_shard: dict[int, list] = {}
        tokens = 0
        episodes: dict[str, float] = {}
        for fin in finished:
            e, task = self.inflight.pop(fin.key)
            self.serial += 1
            env_rewards = tools = None
            if self.env is not None:
                tools = self.env.tools(fin.key, len(fin.tokens))
                task = dataclasses.replace(task, prompt_ids=self.env.prompt(fin.key, task.prompt_ids))
                env_rewards = self.env.finish(fin.key, len(fin.tokens))
            grp = finished_group(task, fin, tok=gen.backend.tokenizer, worker_id=gen.worker_id, serial=self.serial,
                                 env_rewards=env_rewards, tools=tools)
            tokens += int(grp.completion_ids.size)
            by_shard.setdefault(e.shard, []).append((e, grp.encode()))
            more = {}
            if tools is not None:  # this group's finished episodes: the counters below and its log line
                calls, ok = tools
                for name, n in (("episodes_finished_total", len(calls)), ("tool_calls_total", sum(calls)),
                                ("tool_calls_ok_total", sum(ok)),
                                ("episodes_with_tool_calls_total", sum(c > 0 for c in calls))):
                    episodes[name] = episodes.get(name, 0) + n
                more = {"turns": list(fin.turns or ()), "tool_calls": calls, "tool_calls_ok": ok}
            gen.log.info("group_generated", prompt_id=task.prompt_id, group_id=grp.group_id,
                         min_version=grp.min_version, max_version=grp.max_version,
                         tokens=int(grp.completion_ids.size), **more)
        gen.produced += len(finished)
        # Environment counters go with the first shard's transaction.
        extra = {} if self.env is None else {**self.env.take_counters(), **episodes,
                                              "turns_total": sum(sum(f.turns or ()) for f in finished),
                                              "env_turns_cut_total": sum(sum(f.turns_cut or ()) for f in finished)}
        for shard, written in by_shard.items():
            seconds, self.decode_s = self.decode_s, 0.0
            st.emit(Batch(shard=gen.keys.shard(shard), good=[], bad=[]),
                    Output(written=written, counters={"groups_generated_total": len(written),
                                                      "tokens_generated_total": tokens,
                                                      "generate_seconds_total": seconds, **extra}))
            tokens, extra = 0, {}

    def hand_back(self) -> None:
        """Every group in flight back to its prompts shard, with what it has so far."""
        gen, st = self.gen, self.gen.stage
        by_shard: dict[int, list] = {}
        for key, partial in self.sampler.unfinished():
            e, task = self.inflight.pop(key)
            if self.env is not None:
                # An environment's state cannot travel with the tokens: the episode starts over.
                self.env.finish(key, self.g.group_size, emitted=False)
                by_shard.setdefault(e.shard, []).append((e, dataclasses.replace(task, partial=None).encode()))
                gen.log.info("episode_handed_back", prompt_id=task.prompt_id, tokens=int(partial.ids.size))
                continue
            by_shard.setdefault(e.shard, []).append(
                (e, dataclasses.replace(task, partial=partial).encode()))
            gen.log.info("partial_handed_back", prompt_id=task.prompt_id, tokens=int(partial.ids.size),
                         done=int(partial.done.sum()))
        self.sampler.clear()
        for shard, back in by_shard.items():
            st.emit(Batch(shard=gen.keys.shard(shard), good=[], bad=[]),
                    Output(handed_back=back, counters={"partials_handed_back_total": len(back)}))
        self.flush_env_counters()

    def flush_env_counters(self) -> None:
        """The environment counters not yet emitted (failures of episodes abandoned at a stop
        included), to ``{ns}:stats`` now: every failure logged is counted."""
        extra = {} if self.env is None else self.env.take_counters()
        if extra:
            self.gen.stage.emit(Batch(shard=self.gen.keys.shard(0), good=[], bad=[]), Output(counters=extra))

    # ------------------------------------------------------------------ the loop

    def run(self, max_batches: int | None = None) -> None:
        gen, st = self.gen, self.gen.stage
        reads = 0
        try:
            while True:
                if st.stopped():
                    self.hand_back()
                    return
                self.maybe_swap()
                admitting = max_batches is None or reads < max_batches
                if admitting and self.admit():
                    reads += 1
                finished = self.observe(block=not self.sampler.active)
                if self.sampler.active:
                    now = time.perf_counter()
                    if now - self._beat > HEARTBEAT_EVERY_S:
                        self._beat = now
                        st.heartbeat("generating", version=gen.version, groups=gen.produced,
                                     in_flight=self.sampler.active)
                    self.steps += 1
                    self.slot_steps += self.sampler.active
                    finished += self.sampler.step(gen.version)
                    self.decode_s += time.perf_counter() - now
                    if self.env is not None:
                        for key, member, action in self.sampler.turn_ended():
                            self.env.submit(key, member, gen.backend.tokenizer.decode(action))
                elif not finished and not self.inflight:
                    if not admitting:
                        return
                    continue
                if finished:
                    self.emit(finished)
        finally:
            if self.env is not None:
                self.env.close()

    def observe(self, *, block: bool) -> list[Finished]:
        """The environments' answers that came back, fed to their episodes; groups that ended."""
        if self.env is None or not self.env.waiting:
            return []
        out = []
        for key, member, obs, done in self.env.collect(ENV_WAIT_S if block else 0.0):
            fin = self.sampler.observe(key, member, obs, done=done, version=self.gen.version)
            if fin is not None:
                out.append(fin)
        return out


def run_generator(cfg: RunConfig, r, keys: Keys, worker_id: str, log, *, max_batches: int | None = None,
                  backend: GenerationBackend | None = None) -> int:
    """Generate until stopped (or ``max_batches`` reads); returns groups produced.

    ``backend`` replaces the engine ``generator.backend`` names (benchmarks pass a fake one).
    """
    gen = Generator(cfg, r, keys, worker_id, log, backend=backend)
    log.info("generator_started", group_size=cfg.generator.group_size, transport=cfg.weights.transport,
             backend=cfg.generator.backend, swap=cfg.generator.swap)
    try:
        if cfg.generator.swap == "batch":
            gen.stage.run(gen.step, count=cfg.generator.prompts_per_batch, read=gen.read_admitted,
                          before=gen.swap_weights, max_batches=max_batches)
        else:
            streamer = Streamer(gen)
            gen.swap_weights()
            try:
                streamer.run(max_batches)
            except EnvResetsFailing as e:  # no restart can fix it: the driver stops the run
                try:
                    streamer.flush_env_counters()
                except redis.RedisError:  # the counts are lost; the error below is what matters
                    pass
                log.error("env_resets_failing", error=str(e))
                print(f"generator {worker_id}: {e}", file=sys.stderr, flush=True)
                raise SystemExit(EXIT_CONFIG_FAILED) from None
            log.info("slot_utilisation", steps=streamer.steps,
                     mean=round(streamer.slot_steps / max(streamer.steps * streamer.sampler.slots, 1), 4))
    finally:
        gen.close()
    log.info("generator_stopped", groups=gen.produced, version=gen.version)
    return gen.produced
