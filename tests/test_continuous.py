"""Continuous batching and in-flight weight updates (``generator.swap`` step/drain).

The slot sampler's log-probabilities must agree with the trainer's re-scoring while groups
join and leave mid-flight; a swap between decode steps must label every token with the
version whose forward produced its logits (with ``recompute``, exactly that policy's
conditionals); a generator stopped mid-sequence hands its completions back and another
resumes them token for token; the trainer's staleness rule and metrics read each token's
own version. Real Redis-compatible server, real checkpoints, real weight publishing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.algo.losses import LossSettings, objective
from pipeline.bus.connection import connect
from pipeline.config import RunConfig
from pipeline.consumers.trainer import Outcome, classify, step_metrics
from pipeline.engines.slots import SlotSampler
from pipeline.keys import GENERATORS_GROUP, Keys
from pipeline.model.qwen import ModelShape, build_model, load_checkpoint, ragged_completion_logprobs
from pipeline.model.tokenizer import CharTokenizer
from pipeline.producers.feeder import run_feeder
from pipeline.producers.generator import Generator, Streamer
from pipeline.records import Partial, PromptTask, RecordError, RolloutGroup, ScoredGroup, expand_runs, version_runs
from pipeline.weights import make_publisher
from builders import RecordingLog

TINY = ModelShape(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def tok() -> CharTokenizer:
    return CharTokenizer()


def _model(tok, seed=0):
    return build_model(TINY, tok.vocab_size, seed=seed).eval()


def _prompts(tok, n, seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, tok.vocab_size, size=int(rng.integers(3, 10))).astype(np.int32) for _ in range(n)]


def _rescore(model, prompt: np.ndarray, tokens: list[int], pad_id: int) -> torch.Tensor:
    p = torch.from_numpy(prompt.astype(np.int64))
    return ragged_completion_logprobs(model, [p], torch.tensor([tokens]), pad_id=pad_id)[0]


def _sampler(model, tok, slots, seed=0, temperature=1.0):
    return SlotSampler(model, slots=slots, temperature=temperature, eos_id=tok.eos_id, pad_id=tok.pad_id,
                       generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- the slot sampler


def test_groups_join_free_slots_mid_flight_and_logprobs_match_the_trainers_rescoring(tok):
    model = _model(tok)
    prompts = _prompts(tok, 8)
    s = _sampler(model, tok, slots=9)
    queue, done, steps, joined_late = list(range(8)), [], 0, 0
    while queue or s.active:
        while queue and s.free >= 3:
            joined_late += steps > 0
            k = queue.pop(0)
            assert s.add(k, prompts[k], n=3, max_new_tokens=24, version=0) is None
        assert s.active <= 9
        done += s.step(0)
        steps += 1
    assert joined_late >= 3, "no group ever joined while others were in flight"
    assert sorted(f.key for f in done) == list(range(8))
    lengths = {len(t) for f in done for t in f.tokens}
    assert len(lengths) > 1, "every completion had the same length: nothing to batch around"
    for f in done:
        for t, lp in zip(f.tokens, f.logprobs):
            assert t[-1] == tok.eos_id or len(t) == 24
            assert torch.allclose(_rescore(model, prompts[f.key], t, tok.pad_id),
                                  torch.tensor(lp, dtype=torch.float32), atol=1e-4)


def test_greedy_slot_sampling_equals_the_batch_sampler(tok):
    from pipeline.engines.torch import sample_prompts

    model = _model(tok, seed=2)
    prompts = _prompts(tok, 4, seed=3)
    s = _sampler(model, tok, slots=4, temperature=0.0)
    for k, p in enumerate(prompts):
        s.add(k, p, n=1, max_new_tokens=12, version=0)
    out = {}
    while s.active:
        out.update({f.key: f.tokens[0] for f in s.step(0)})
    ref = sample_prompts(model, prompts, n=1, max_new_tokens=12, temperature=0.0, eos_id=tok.eos_id,
                         pad_id=tok.pad_id)
    for k, r in enumerate(ref):
        assert out[k] == r.tokens[0, : r.lengths[0]].tolist()


def _swap_run(tok, kv: str):
    a, b = _model(tok, seed=0), _model(tok, seed=7)
    live = _model(tok, seed=0)
    prompts = _prompts(tok, 3, seed=5)
    s = _sampler(live, tok, slots=6)
    for k, p in enumerate(prompts):
        s.add(k, p, n=2, max_new_tokens=30, version=0)
    done = []
    for _ in range(3):
        done += s.step(0)
    live.load_state_dict(b.state_dict())
    if kv == "recompute":
        s.recompute(1)
    else:
        s.refresh(1)
    while s.active:
        done += s.step(1)
    return a, b, prompts, done


def test_a_swap_with_recompute_gives_each_token_the_logprob_of_its_own_version(tok):
    a, b, prompts, done = _swap_run(tok, "recompute")
    mixed = 0
    for f in done:
        for t, lp, v in zip(f.tokens, f.logprobs, f.versions):
            v = np.asarray(v)
            assert (v[: min(3, len(v))] == 0).all() and (v[3:] == 1).all()
            mixed += len(v) > 3
            lp = torch.tensor(lp, dtype=torch.float32)
            under_a, under_b = _rescore(a, prompts[f.key], t, tok.pad_id), _rescore(b, prompts[f.key], t, tok.pad_id)
            assert torch.allclose(lp[v == 0], under_a[v == 0], atol=1e-4)
            assert torch.allclose(lp[v == 1], under_b[v == 1], atol=1e-4)
            if (v == 1).any():  # the versions really differ on these tokens
                assert not torch.allclose(under_a[v == 1], under_b[v == 1], atol=1e-2)
    assert mixed, "no completion spanned the swap"


def test_a_swap_that_keeps_the_cache_reaches_the_next_token_within_one_step(tok):
    a, _, prompts, done = _swap_run(tok, "keep")
    seen_new = 0
    for f in done:
        for t, lp, v in zip(f.tokens, f.logprobs, f.versions):
            v = np.asarray(v)
            # Tokens 0-2 were sampled before the swap; the very next one from the new weights
            # (the last position re-run), over keys and values the old weights computed.
            assert (v[:3] == 0).all() and (v[3:] == 1).all()
            seen_new += len(v) > 3
            assert torch.allclose(torch.tensor(lp[:3], dtype=torch.float32),
                                  _rescore(a, prompts[f.key], t, tok.pad_id)[:3], atol=1e-4)
    assert seen_new


def test_a_partial_group_resumes_on_another_sampler_token_for_token(tok):
    model = _model(tok, seed=4)
    prompts = _prompts(tok, 2, seed=9)
    s = _sampler(model, tok, slots=6, seed=1)
    for k, p in enumerate(prompts):
        s.add(k, p, n=3, max_new_tokens=40, version=2)
    for _ in range(5):
        assert not s.step(2)
    saved = dict(s.unfinished())
    assert set(saved) == {0, 1}
    assert all(int(p.ids.size) == 5 * 3 - sum(5 - n for n in p.lens[p.done]) for p in saved.values())
    assert all((p.lens[~p.done] == 5).all() and (~p.done).any() for p in saved.values())
    # Through the wire, as a stopped generator writes it.
    for k in saved:
        task = PromptTask(prompt_id=f"p{k}", prompt="x", prompt_ids=prompts[k], reference="", issued_at=0.0,
                          partial=saved[k])
        saved[k] = PromptTask.decode(task.encode()).partial
    other = _sampler(model, tok, slots=6, seed=99)
    for k, p in enumerate(prompts):
        other.add(k, p, n=3, max_new_tokens=40, version=3, partial=saved[k])
    done = []
    while other.active:
        done += other.step(3)
    assert len(done) == 2
    for f in done:
        part = saved[f.key]
        starts = np.r_[0, np.cumsum(part.lens)]
        for j, (t, lp, v) in enumerate(zip(f.tokens, f.logprobs, f.versions)):
            prefix = part.ids[starts[j]: starts[j + 1]].tolist()
            assert t[: len(prefix)] == prefix and len(t) >= len(prefix)
            assert np.allclose(lp[: len(prefix)], part.logprobs[starts[j]: starts[j + 1]])
            assert v[: len(prefix)] == [2] * len(prefix) and set(v[len(prefix):]) <= {3}
            assert torch.allclose(_rescore(model, prompts[f.key], t, tok.pad_id),
                                  torch.tensor(lp, dtype=torch.float32), atol=1e-4)


def test_a_full_slot_table_refuses_a_group():
    tok = CharTokenizer()
    s = _sampler(_model(tok), tok, slots=4)
    s.add("a", _prompts(tok, 1)[0], n=3, max_new_tokens=5, version=0)
    with pytest.raises(ValueError, match="free slots"):
        s.add("b", _prompts(tok, 1)[0], n=3, max_new_tokens=5, version=0)
    with pytest.raises(ValueError, match="already in flight"):
        s.add("a", _prompts(tok, 1)[0], n=1, max_new_tokens=5, version=0)


# ---------------------------------------------------------------------- records


def _rollout(versions: list[int], lens=(3, 2)) -> RolloutGroup:
    n = sum(lens)
    v = np.array(versions)
    return RolloutGroup(prompt_id="p1", group_id="g", generator_id="gen", prompt="x",
                        prompt_ids=np.arange(4, dtype=np.int32), reference="", completions=("a",) * len(lens),
                        completion_ids=np.arange(n, dtype=np.int32) + 2, completion_lens=np.array(lens, np.int32),
                        behaviour_logprobs=-np.ones(n, np.float32), min_version=int(v.min()),
                        max_version=int(v.max()), created_at=0.0,
                        version_runs=None if v.min() == v.max() else version_runs(v))


def test_per_token_versions_round_trip_and_bad_runs_are_refused():
    g = RolloutGroup.decode(_rollout([4, 4, 5, 4, 6]).encode())
    assert g.token_versions().tolist() == [4, 4, 5, 4, 6]
    assert expand_runs(version_runs(np.array([1, 1, 1])), 3).tolist() == [1, 1, 1]
    assert RolloutGroup.decode(_rollout([3] * 5).encode()).token_versions().tolist() == [3] * 5
    import msgpack

    for runs, why in (([0, 4, 0, 5], "rise"), ([1, 4, 3, 6], "rise"), ([0, 4, 9, 6], "rise"),
                      ([0, 5, 2, 5], "span"), ([0, 4, 2], "pairs")):
        d = msgpack.unpackb(_rollout([4, 4, 5, 4, 6]).encode())
        d["version_runs"] = np.array(runs, "<i4").tobytes()
        with pytest.raises(RecordError, match=why):
            RolloutGroup.decode(msgpack.packb(d))


def test_a_bad_partial_is_refused():
    import msgpack

    good = Partial(lens=np.array([2, 0], np.int32), ids=np.array([3, 4], np.int32),
                   logprobs=np.array([-1, -2], np.float32), versions=version_runs(np.array([0, 1])),
                   done=np.array([True, False]))
    task = PromptTask(prompt_id="p", prompt="x", prompt_ids=np.arange(3, dtype=np.int32), reference="",
                      issued_at=0.0, partial=good)
    assert PromptTask.decode(task.encode()).partial.done.tolist() == [True, False]
    for change, why in (({"lens": np.array([3, 0], "<i4").tobytes()}, "lengths"),
                        ({"logprobs": np.array([-1, 2], "<f4").tobytes()}, "positive"),
                        ({"done": b"\x01\x01"}, "without tokens"),
                        ({"done": b"\x01"}, "2 bytes")):
        d = msgpack.unpackb(task.encode())
        d["partial"].update(change)
        with pytest.raises(RecordError, match=why):
            PromptTask.decode(msgpack.packb(d))


# ---------------------------------------------------------------------- the trainer's view


def _scored(versions, rewards=(1.0, 0.0)) -> ScoredGroup:
    ro = _rollout(versions)
    return ScoredGroup(rollout=ro, verifier_names=("v",), votes=np.ones((2, 1), np.float32),
                       rewards=np.array(rewards, np.float32), truth=np.zeros(2, np.float32), reward_mode="weaver",
                       labelmodel_version=-1, verifier_id="ver", scored_at=0.0)


def test_staleness_is_the_oldest_tokens_and_metrics_read_each_tokens_version():
    # At version 6 with eta 2: a group whose newest tokens are fresh but oldest are version 3 is stale.
    old_start = _scored([3, 5, 5, 5, 5])
    fresh = _scored([4, 4, 5, 5, 5])
    kinds = classify([(None, old_start), (None, fresh)], version=6, max_staleness=2)
    assert kinds == [Outcome.STALE, Outcome.TRAINED]
    row = step_metrics([(None, old_start), (None, fresh)], [fresh], [fresh], version=7, stats={}, wait_s=0,
                       step_s=0)
    # Lags against version 6: tokens 4,4,5,5,5 -> 2,2,1,1,1.
    assert row["token_lag_mean"] == pytest.approx(7 / 5) and row["token_lag_max"] == 2
    assert row["groups_mixed_versions"] == 1


def test_importance_weights_use_each_tokens_own_behaviour_logprob():
    # Two completions of equal advantage magnitude; the behaviour log-probs of the second
    # half of each (the tokens sampled after a swap) differ from the first half's.
    torch.manual_seed(0)
    logp = torch.randn(2, 6).clamp(max=-0.1).requires_grad_()
    mask = torch.ones(2, 6)
    adv = torch.tensor([1.0, -1.0])
    settings = LossSettings.from_config(RunConfig().trainer)
    behav_same = logp.detach().clone()
    behav_mixed = behav_same.clone()
    behav_mixed[:, 3:] -= 0.5   # older policy: less likely there, so weight exp(0.5) on those tokens only
    grads = []
    for behav in (behav_same, behav_mixed):
        logp.grad = None
        loss, _ = objective(logp, behav, mask, adv, settings)
        loss.backward()
        grads.append(logp.grad.clone())
    same, mixed = grads
    assert torch.allclose(mixed[:, :3], same[:, :3], atol=1e-6)  # untouched tokens, unchanged weight
    assert not torch.allclose(mixed[:, 3:], same[:, 3:], atol=1e-4)


# ---------------------------------------------------------------------- the generator stage, real Redis


def _gen_cfg(ns: str, base: str, **extra) -> RunConfig:
    return RunConfig().with_overrides({
        "run_id": ns, "model.base_dir": base, "generator.swap": "step", "generator.group_size": 3,
        "generator.prompts_per_batch": 2, "generator.slots": 6, "task.max_new_tokens": 40,
        "feeder.max_prompts": 2, "redis.claim_idle_ms": 0, "redis.block_ms": 50, **extra})


def _random_base(tmp_path, tok) -> str:
    """A random-weight checkpoint: its completions run long, so a stop lands mid-sequence."""
    from pipeline.model.qwen import save_checkpoint

    out = tmp_path / "random-base"
    save_checkpoint(_model(tok, seed=11), tok, out)
    return str(out)


def test_a_stopped_generator_hands_back_its_sequences_and_another_resumes_them(redis_url, tmp_path, tok):
    from pipeline.bus.stats import read_stats

    base = _random_base(tmp_path, tok)
    cfg = _gen_cfg("resume", base)
    r = connect(redis_url, name="t")
    keys = Keys("resume", shards=cfg.redis.shards)
    run_feeder(cfg, r, keys, RecordingLog(), tokenizer=tok, max_rounds=1)
    first = Generator(cfg, r, keys, "gen-a", RecordingLog())
    st = Streamer(first)
    assert st.admit() and st.sampler.active == 6
    for _ in range(4):
        assert not st.sampler.step(0), "a group finished in 4 tokens: the prefix test needs longer ones"
    admitted = int(r.get(keys.admitted))
    r.set(keys.stop, 1)
    st.run()
    r.delete(keys.stop)
    assert st.sampler.active == 0 and not st.inflight
    assert int(r.get(keys.admitted)) == admitted - 2, "handed-back prompts keep their admission slots"
    assert read_stats(r, keys).get("partials_handed_back_total") == 2
    saved = {}
    for key in keys.stream_keys("prompts"):
        assert r.xpending(key, GENERATORS_GROUP)["pending"] == 0, "a handed-back prompt is still pending"
        for _, f in r.xrange(key):
            t = PromptTask.decode(f[b"d"])
            if t.partial is not None:
                saved[t.prompt_id] = t
    assert len(saved) == 2
    for t in saved.values():  # 4 tokens each, unless a completion ended (eos) earlier
        p = t.partial
        assert (p.lens[~p.done] == 4).all() and (~p.done).any() and (p.lens[p.done] <= 4).all()

    second = Generator(cfg, r, keys, "gen-b", RecordingLog())
    Streamer(second).run(max_batches=1)
    model = load_checkpoint(base)[0].eval()
    groups = [RolloutGroup.decode(f[b"d"]) for key in keys.stream_keys("rollouts") for _, f in r.xrange(key)]
    assert sorted(g.prompt_id for g in groups) == sorted(saved)
    for g in groups:
        part = saved[g.prompt_id].partial
        starts = np.r_[0, np.cumsum(part.lens)]
        for j, (ids, lp) in enumerate(zip(g.split(g.completion_ids), g.split(g.behaviour_logprobs))):
            prefix = part.ids[starts[j]: starts[j + 1]]
            assert ids[: prefix.size].tolist() == prefix.tolist()
            assert ids.size == prefix.size if part.done[j] else ids.size > prefix.size
            assert np.array_equal(lp[: prefix.size], part.logprobs[starts[j]: starts[j + 1]])
            assert torch.allclose(_rescore(model, g.prompt_ids, ids.tolist(), tok.pad_id),
                                  torch.from_numpy(lp.copy()), atol=1e-4)
        assert g.generator_id == "gen-b"
    r.close()


def test_a_version_published_mid_sequence_reaches_the_next_tokens(redis_url, tmp_path, tok):
    base = _random_base(tmp_path, tok)
    cfg = _gen_cfg("inflight", base, **{"weights.transport": "shm"})
    r = connect(redis_url, name="t")
    keys = Keys("inflight", shards=cfg.redis.shards)
    run_feeder(cfg, r, keys, RecordingLog(), tokenizer=tok, max_rounds=1)
    gen = Generator(cfg, r, keys, "gen-a", RecordingLog())
    st = Streamer(gen)
    assert st.admit()
    for _ in range(3):
        st.sampler.step(gen.version)
    pub = make_publisher("shm", r, keys.weights, ns=keys.ns)
    try:
        pub.publish(1, {k: v.clone() for k, v in _model(tok, seed=12).state_dict().items()})
        st.run(max_batches=0)  # swaps at its first turn, then finishes what is in flight
    finally:
        pub.close()
    assert gen.version == 1
    groups = [RolloutGroup.decode(f[b"d"]) for key in keys.stream_keys("rollouts") for _, f in r.xrange(key)]
    assert len(groups) == 2
    for g in groups:
        assert g.min_version == 0 and g.max_version == 1 and g.version_runs is not None
        for v in g.split(g.token_versions()):
            # 3 tokens sampled before the swap; the next one already under the new version.
            assert (v[:3] == 0).all() and (v[3:] == 1).all()
    r.close()
