import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from builders import make_prompt, make_rollout, make_scored
from pipeline.records import MAX_RECORD_BYTES, PromptTask, RecordError, RolloutGroup, ScoredGroup


def test_prompt_task_round_trips_through_bytes():
    p = make_prompt()
    q = PromptTask.decode(p.encode())
    assert (q.prompt_id, q.prompt, q.reference) == (p.prompt_id, p.prompt, p.reference)
    assert np.array_equal(q.prompt_ids, p.prompt_ids) and q.prompt_ids.dtype == np.dtype("<i4")


def test_rollout_group_round_trips_and_splits_per_completion():
    g = make_rollout(version=5)
    h = RolloutGroup.decode(g.encode())
    assert h.completions == g.completions and h.min_version == 5
    assert np.array_equal(h.completion_ids, g.completion_ids)
    assert np.allclose(h.behaviour_logprobs, g.behaviour_logprobs)
    parts = h.split(h.completion_ids)
    assert [len(p) for p in parts] == list(g.completion_lens)


def test_scored_group_round_trips_with_votes_matrix():
    s = make_scored(rewards=[0.9, 0.1, 0.8, 0.0])
    t = ScoredGroup.decode(s.encode())
    assert t.votes.shape == (4, 2) and t.verifier_names == ("format", "mod9")
    assert np.allclose(t.rewards, [0.9, 0.1, 0.8, 0.0]) and t.labelmodel_version == 3
    assert t.rollout.prompt_id == s.rollout.prompt_id


def test_arrays_travel_as_little_endian_byte_blobs():
    raw = msgpack.unpackb(make_rollout().encode())
    assert isinstance(raw["completion_ids"], bytes) and isinstance(raw["behaviour_logprobs"], bytes)
    assert raw["schema"] == 1 and raw["type"] == "RolloutGroup"


def _mutate(record: bytes, **changes) -> bytes:
    d = msgpack.unpackb(record)
    d.update(changes)
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize("changes, reason", [
    ({"schema": 2}, "schema version"),
    ({"type": "PromptTask"}, "record type"),
    ({"completion_lens": np.array([1, 1], dtype="<i4").tobytes()}, "completion_lens"),
    ({"behaviour_logprobs": np.full(16, np.nan, dtype="<f4").tobytes()}, "behaviour_logprobs contain NaN"),
    ({"min_version": 3, "max_version": 1}, "versions"),
    ({"completions": ["1"]}, "completion texts"),
    ({"prompt_id": 7}, "prompt_id"),
])
def test_defective_rollouts_are_rejected_with_a_reason(changes, reason):
    g = make_rollout()
    if "behaviour_logprobs" in changes:
        changes["behaviour_logprobs"] = np.full(int(g.completion_lens.sum()), np.nan, dtype="<f4").tobytes()
    with pytest.raises(RecordError, match=reason):
        RolloutGroup.decode(_mutate(g.encode(), **changes))


def test_oversize_record_is_refused_before_decoding():
    with pytest.raises(RecordError, match="exceeds"):
        RolloutGroup.decode(b"\x00" * (MAX_RECORD_BYTES + 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_a_decoder(data):
    for cls in (PromptTask, RolloutGroup, ScoredGroup):
        try:
            cls.decode(data)
        except RecordError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_valid_records_decode_or_fail_cleanly(data):
    raw = bytearray(make_scored().encode())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    try:
        ScoredGroup.decode(bytes(raw))
    except RecordError:
        pass


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_field_replaced_by_any_value_decodes_or_fails_cleanly(data):
    """Structure-aware mutation: valid MessagePack, wrong contents, for every record type."""
    import msgpack

    from pipeline.run.accounting import _prompt_id

    cls, record = data.draw(st.sampled_from([(PromptTask, make_prompt()), (RolloutGroup, make_rollout()),
                                             (ScoredGroup, make_scored())]))
    body = msgpack.unpackb(record.encode(), raw=False)
    target = body
    if cls is ScoredGroup and data.draw(st.booleans()):
        target = body["rollout"]
    field = data.draw(st.sampled_from(sorted(target)))
    if data.draw(st.booleans()):
        target[field] = data.draw(_msgpack_values)
    else:
        del target[field]
    raw = msgpack.packb(body, use_bin_type=True)
    try:
        decoded = cls.decode(raw)
    except RecordError as e:
        assert str(e), "a defect always has a reason for the dead-letter stream"
    else:
        assert type(decoded) is cls
    pid = _prompt_id(raw)
    assert pid is None or isinstance(pid, str)
