import re

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from builders import make_prompt, make_rollout, make_scored
from pipeline.records import MAX_RECORD_BYTES, PromptTask, RecordError, RolloutGroup, ScoredGroup

pytestmark = pytest.mark.one_server


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


# ---------------------------------------------------------------------- the fast decoding path
#
# ``decode`` tries the typed fast path first and falls back to the field-by-field path
# (``_decode_fields``); both must accept the same records, build the same ones, and refuse
# the same defects with the same reason.

from pipeline.records import Partial, version_runs  # noqa: E402


def _with_partial() -> PromptTask:
    p = make_prompt()
    partial = Partial(lens=np.array([2, 0, 3], np.int32), ids=np.array([3, 4, 5, 6, 7], np.int32),
                      logprobs=np.array([-1, -2, 0, -0.5, -3], np.float32),
                      versions=version_runs(np.array([0, 1, 1, 1, 2])), done=np.array([True, False, False]))
    return PromptTask(prompt_id=p.prompt_id, prompt=p.prompt, prompt_ids=p.prompt_ids, reference=p.reference,
                      issued_at=p.issued_at, partial=partial)


def _with_runs() -> RolloutGroup:
    g = make_rollout(version=2)
    n = g.completion_ids.size
    per_token = np.where(np.arange(n) < n // 2, 2, 4)
    return RolloutGroup(**{**vars(g), "max_version": 4, "version_runs": version_runs(per_token)})


def _same(a, b) -> None:
    assert type(a) is type(b) and vars(a).keys() == vars(b).keys()
    for name, x in vars(a).items():
        y = vars(b)[name]
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and (x.dtype, x.shape) == (y.dtype, y.shape), name
            assert x.tobytes() == y.tobytes() and x.flags.writeable == y.flags.writeable, name
        elif isinstance(x, (PromptTask, RolloutGroup, ScoredGroup, Partial)):
            _same(x, y)
        else:
            assert type(x) is type(y) and (x == y or x != x and y != y), name  # NaN == NaN here


def _agree(cls, raw: bytes):
    """``cls.decode(raw)`` does exactly what the field-by-field path does; returns the record or the reason."""
    try:
        slow = cls._decode_fields(raw)
    except RecordError as e:
        with pytest.raises(RecordError) as got:
            cls.decode(raw)
        assert str(got.value) == str(e)
        return str(e)
    fast = cls.decode(raw)
    _same(fast, slow)
    return fast


def _long(*, zeros: bool = False) -> RolloutGroup:
    """A group past the byte-wise float test's size (4 x 600 tokens), its log-probs all negative or some 0."""
    g = make_rollout(completions=tuple("x" * 599 for _ in range(4)))
    lp = g.behaviour_logprobs.copy()
    if zeros:
        lp[::7] = 0.0
    return RolloutGroup(**{**vars(g), "behaviour_logprobs": lp})


_VALID = [(PromptTask, make_prompt), (PromptTask, _with_partial), (RolloutGroup, make_rollout),
          (RolloutGroup, _with_runs), (RolloutGroup, _long), (RolloutGroup, lambda: _long(zeros=True)),
          (ScoredGroup, make_scored)]


@pytest.mark.parametrize("cls, make", _VALID)
def test_both_paths_build_the_same_record(cls, make):
    rec = make()
    assert isinstance(_agree(cls, rec.encode()), cls)
    assert cls.decode(rec.encode()).encode() == rec.encode()


def test_valid_records_take_the_fast_path(monkeypatch):
    for cls, make in _VALID:
        if make is not _with_partial:  # a partial is left to the field-by-field path
            monkeypatch.setattr(cls, "_decode_fields", classmethod(lambda c, data: pytest.fail("field-by-field")))
            raw = make().encode()
            assert cls.decode(raw).encode() == raw
            monkeypatch.undo()


def _f4(*values) -> bytes:
    return np.array(values, dtype="<f4").tobytes()


def _i4(*values) -> bytes:
    return np.array(values, dtype="<i4").tobytes()


def _defects():
    """One mutation per reason ``decode`` can give, with the words the reason must carry."""
    g = make_rollout()  # 4 completions, 4 + 4 + 4 + 3 tokens
    n = int(g.completion_lens.sum())
    lp = g.behaviour_logprobs
    assert n == 15
    ro = [  # (changes to a RolloutGroup's map, reason)
        ({"completion_ids": "ab"}, "field 'completion_ids': expected bytes, got str"),
        ({"completion_ids": b"abc"}, "field 'completion_ids': 3 bytes is not a multiple of 4"),
        ({"prompt_id": None}, "field 'prompt_id': expected str, got NoneType"),
        ({"prompt_id": 7}, "field 'prompt_id': expected str"),
        ({"min_version": True}, "field 'min_version': expected int, got bool"),
        ({"min_version": 1.0}, "field 'min_version': expected int, got float"),
        ({"created_at": "now"}, "field 'created_at': expected float, got str"),
        ({"created_at": False}, "field 'created_at': expected float, got bool"),
        ({"completions": ["a", 1, "b", "c"]}, "field 'completions': expected a list of strings"),
        ({"completions": "abcd"}, "field 'completions': expected list"),
        ({"schema": 2}, "schema version 2 is not supported"),
        ({"schema": None}, "schema version None"),
        ({"type": "ScoredGroup"}, "record type 'ScoredGroup', expected 'RolloutGroup'"),
        ({"completion_lens": b""}, "group size 0 outside"),
        ({"completion_lens": _i4(*[1] * 1025)}, "group size 1025 outside"),
        ({"completion_lens": _i4(4, 4, 4, 4)}, "completion_lens (sum 16) do not match 15"),
        ({"completion_lens": _i4(15, 0, 0, 0)}, "completion_lens (sum 15)"),
        ({"completion_lens": _i4(16, -1, 0, 0)}, "completion_lens"),
        ({"behaviour_logprobs": lp[:-1].tobytes()}, "14 behaviour log-probs for 15 tokens"),
        ({"completions": ["a", "b", "c"]}, "3 completion texts for group size 4"),
        ({"prompt_ids": b""}, "prompt_ids has 0 tokens"),
        ({"behaviour_logprobs": _f4(*[-1] * (n - 1), np.nan)}, "behaviour_logprobs contain NaN, inf or positive"),
        ({"behaviour_logprobs": _f4(*[-1] * (n - 1), -np.inf)}, "behaviour_logprobs contain NaN"),
        ({"behaviour_logprobs": _f4(*[-1] * (n - 1), np.inf)}, "behaviour_logprobs contain NaN"),
        ({"behaviour_logprobs": _f4(*[-1] * (n - 1), 0.01)}, "behaviour_logprobs contain NaN"),
        ({"min_version": -1, "max_version": 0}, "policy versions min=-1 max=0 are inconsistent"),
        ({"min_version": 3, "max_version": 1}, "policy versions min=3 max=1"),
        ({"version_runs": b"abcdef"}, "field 'version_runs': 6 bytes is not a multiple of 4"),
        ({"version_runs": "x"}, "field 'version_runs': expected bytes"),
        ({"version_runs": _i4(0, 0, 3)}, "are not (start, version) pairs for 15 tokens"),
        ({"version_runs": b""}, "are not (start, version) pairs"),
        ({"version_runs": _i4(*[0, 0] * 16)}, "are not (start, version) pairs"),
        ({"version_runs": _i4(1, 0)}, "run starts must rise from 0 below 15"),
        ({"version_runs": _i4(0, 0, 5, 0, 5, 0)}, "run starts must rise"),
        ({"version_runs": _i4(0, 0, 15, 0)}, "run starts must rise"),
        ({"version_runs": _i4(0, 1)}, "versions 1..1 do not span min/max version 0..0"),
    ]
    out = []
    for changes, reason in ro:
        out.append((RolloutGroup, make_rollout, changes, None, reason))
    for name in ("prompt_id", "created_at", "min_version", "completions"):
        out.append((RolloutGroup, make_rollout, {}, name, f"missing field {name!r}"))
    out.append((RolloutGroup, make_rollout, {}, "completion_lens", "field 'completion_lens': expected bytes, got NoneType"))
    out += [
        (ScoredGroup, make_scored, {"rollout": {"completion_lens": _i4(1)}}, None, "completion_lens"),
        (ScoredGroup, make_scored, {"rollout": "x"}, None, "field 'rollout': expected dict, got str"),
        (ScoredGroup, make_scored, {"votes": _f4(1, 2, 3)}, None, "3 votes for 4 completions x 2 verifiers"),
        (ScoredGroup, make_scored, {"verifier_names": ["a"]}, None, "8 votes for 4 completions x 1 verifiers"),
        (ScoredGroup, make_scored, {"verifier_names": ["a", 2]}, None, "'verifier_names': expected a list of strings"),
        (ScoredGroup, make_scored, {"rewards": _f4(1, 0, 1)}, None, "3 rewards / 4 truth values for group size 4"),
        (ScoredGroup, make_scored, {"truth": _f4(1, 0, 1, 0, 1)}, None, "4 rewards / 5 truth values"),
        (ScoredGroup, make_scored, {"rewards": _f4(1, 0, np.nan, 0)}, None, "rewards contain NaN or inf"),
        (ScoredGroup, make_scored, {"rewards": _f4(1, 0, -np.inf, 0)}, None, "rewards contain NaN or inf"),
        (ScoredGroup, make_scored, {"labelmodel_version": 1.5}, None, "'labelmodel_version': expected int"),
        (ScoredGroup, make_scored, {"reward_mode": b"weaver"}, None, "'reward_mode': expected str, got bytes"),
        (ScoredGroup, make_scored, {}, "verifier_id", "missing field 'verifier_id'"),
        (ScoredGroup, make_scored, {"type": "RolloutGroup"}, None, "record type 'RolloutGroup'"),
        (PromptTask, make_prompt, {"prompt_ids": b""}, None, "prompt_ids has 0 tokens"),
        (PromptTask, make_prompt, {"issued_at": "x"}, None, "field 'issued_at': expected float, got str"),
        (PromptTask, make_prompt, {"partial": []}, None, "field 'partial': expected dict, got list"),
        (PromptTask, make_prompt, {}, "reference", "missing field 'reference'"),
        (PromptTask, make_prompt, {"schema": "1"}, None, "schema version '1'"),
        (PromptTask, _with_partial, {"partial": {"done": b"\x01\x00"}}, None, "partial: 'done' must be 3 bytes"),
        (PromptTask, _with_partial, {"partial": {"lens": _i4(2, 0, 4)}}, None,
         "partial: completion lengths (sum 6) do not match 5 tokens"),
        (PromptTask, _with_partial, {"partial": {"lens": _i4(2, -1, 4), "done": b"\x00\x00\x00"}}, None,
         "partial: completion lengths"),
        (PromptTask, _with_partial, {"partial": {"done": b"\x01\x01\x00"}}, None,
         "partial: a finished completion without tokens"),
        (PromptTask, _with_partial, {"partial": {"logprobs": _f4(-1, -2, 0, -0.5, 1)}}, None,
         "partial: behaviour log-probs missing, NaN, inf or positive"),
        (PromptTask, _with_partial, {"partial": {"logprobs": _f4(-1, -2, 0, np.nan, -1)}}, None,
         "partial: behaviour log-probs missing"),
        (PromptTask, _with_partial, {"partial": {"versions": _i4(0)}}, None, "partial: no policy versions"),
        (PromptTask, _with_partial, {"partial": {"versions": _i4(0, -1, 3, 2)}}, None,
         "partial: negative policy version"),
        (PromptTask, _with_partial, {"partial": {"versions": _i4(0, 1, 0, 2)}}, None, "run starts must rise"),
        (PromptTask, _with_partial, {"partial": {"ids": b"abcdefgh"}}, None, "partial: completion lengths"),
    ]
    return out


def _apply(body: dict, changes: dict) -> None:
    for k, v in changes.items():
        if isinstance(v, dict) and isinstance(body.get(k), dict):
            _apply(body[k], v)
        else:
            body[k] = v


@pytest.mark.parametrize("cls, make, changes, drop, reason", _defects())
def test_every_defect_is_refused_with_its_reason_on_both_paths(cls, make, changes, drop, reason):
    body = msgpack.unpackb(make().encode(), raw=False)
    _apply(body, changes)
    if drop:
        del body[drop]
    raw = msgpack.packb(body, use_bin_type=True)
    with pytest.raises(RecordError, match=re.escape(reason)):
        cls.decode(raw)
    assert isinstance(_agree(cls, raw), str)


@pytest.mark.parametrize("data, reason", [
    ("a string", "payload is str, not bytes"), (None, "payload is NoneType"),
    (b"\xc1", "not MessagePack"), (msgpack.packb({"a": 1}) + b"\x00", "not MessagePack"),
    (msgpack.packb([1, 2]), "record is a list, not a map"), (msgpack.packb({1: 2}), "not MessagePack"),
])
def test_undecodable_payloads_are_refused_by_every_type(data, reason):
    for cls in (PromptTask, RolloutGroup, ScoredGroup):
        with pytest.raises(RecordError, match=re.escape(reason)):
            cls.decode(data)


def test_records_shaped_unlike_the_encoder_writes_them_still_decode():
    """What the fast path leaves to the field-by-field path: unknown fields, ints for floats,
    nil optional fields, a bytearray payload."""
    body = msgpack.unpackb(make_rollout().encode(), raw=False)
    for changes in ({"extra": {"nested": [1, 2]}}, {"created_at": 12}, {"version_runs": None}, {"schema": 1.0}):
        raw = msgpack.packb({**body, **changes}, use_bin_type=True)
        assert isinstance(_agree(RolloutGroup, raw), RolloutGroup)
    assert RolloutGroup.decode(bytearray(make_rollout().encode())).prompt_id == body["prompt_id"]
    task = msgpack.unpackb(make_prompt().encode(), raw=False)
    assert _agree(PromptTask, msgpack.packb({**task, "partial": None}, use_bin_type=True)).partial is None


def _float_cases():
    """float32 bit patterns covering every top byte, with the low bits at their edges."""
    lows = (0x000000, 0x000001, 0x51B717, 0x51B718, 0x7FFFFF, 0x800000, 0x800001, 0xFFFFFF)
    return np.array([(top << 24) | low for top in range(256) for low in lows], dtype=np.uint32).view("<f4")


def test_float_tests_match_numpy_for_every_bit_pattern():
    from pipeline.records import _finite, _logprobs_ok

    cases = _float_cases()
    with np.errstate(invalid="ignore"):
        for x in cases:
            for a in (np.full(3, x, "<f4"), np.r_[np.full(300, -1.0, "<f4"), x], np.r_[x, np.zeros(2, "<f4")]):
                raw = a.tobytes()
                assert _logprobs_ok(memoryview(raw), a) == bool(np.isfinite(a).all() and not (a > 1e-4).any()), hex(a.view("u4")[-1])
                assert _finite(raw, a) == bool(np.isfinite(a).all()), hex(a.view("u4")[-1])
    negative = -np.abs(cases[np.isfinite(cases)])
    assert _logprobs_ok(memoryview(negative.tobytes()), negative) and _finite(negative.tobytes(), negative)


_blobs = st.one_of(
    st.lists(st.sampled_from(list(_float_cases())), max_size=40).map(lambda v: np.array(v, "<f4").tobytes()),
    st.lists(st.integers(-3, 20), max_size=40).map(lambda v: np.array(v, "<i4").tobytes()),
    st.binary(max_size=24))


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_both_paths_agree_on_any_mutation(data):
    cls, make = data.draw(st.sampled_from(_VALID))
    body = msgpack.unpackb(make().encode(), raw=False)
    for _ in range(data.draw(st.integers(1, 3))):
        target = body
        for nested in ("rollout", "partial"):
            if isinstance(target.get(nested), dict) and data.draw(st.booleans()):
                target = target[nested]
        field = data.draw(st.sampled_from(sorted(target) + ["extra", "version_runs", "partial"]))
        action = data.draw(st.sampled_from(["value", "blob", "delete"]))
        if action == "delete":
            target.pop(field, None)
        else:
            target[field] = data.draw(_msgpack_values if action == "value" else _blobs)
    _agree(cls, msgpack.packb(body, use_bin_type=True))


@pytest.mark.parametrize("cls, make", _VALID)
def test_encoding_writes_what_msgpack_writes(cls, make):
    wire = make().encode()
    assert wire == msgpack.packb(msgpack.unpackb(wire, raw=False), use_bin_type=True)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=8), _msgpack_values, max_size=6))
def test_the_encoder_writes_what_msgpack_writes_for_any_value(body):
    from pipeline.records import _pack

    assert _pack("PromptTask", body) == msgpack.packb({"schema": 1, "type": "PromptTask", **body}, use_bin_type=True)


def test_numpy_scalars_encode_as_msgpack_packs_them():
    p = make_prompt()
    q = PromptTask(prompt_id=np.str_(p.prompt_id), prompt=p.prompt, prompt_ids=p.prompt_ids, reference=p.reference,
                   issued_at=np.float64(p.issued_at))
    assert q.encode() == p.encode()
    with pytest.raises(TypeError):
        PromptTask(**{**vars(p), "issued_at": np.float32(1.0)}).encode()
