"""Versioned weights over shm and tcp, against a real Redis, real files and real sockets."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import msgpack
import pytest
import redis
import safetensors.torch
import torch
import zmq

from pipeline.weights import (
    TRANSPORTS,
    Manifest,
    TensorSpec,
    WeightFetcher,
    WeightPublisher,
    WeightsError,
    make_fetcher,
    make_publisher,
)
from pipeline.weights.manifest import RunningChecksum, checksum

KEY = "run1:weights"
SMALL_BUCKET = 1000  # many buckets, the last one partial, for payloads of ~12 KB


def make_tensors(*, seed: int = 0) -> dict[str, torch.Tensor]:
    """A small fake checkpoint: HF-style names, several dtypes, odd and edge-case shapes.

    Every value depends on ``seed``, so a fetched version can be told from any other.
    """
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(17, 5, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(7, 3, 11, generator=g),
        "model.layers.0.self_attn.q_norm.weight": torch.randn(13, generator=g).to(torch.float16),
        "model.norm.weight": torch.randn(1, 1, 9, generator=g, dtype=torch.float64),
        "position_ids": torch.arange(1001, dtype=torch.int64) * (seed + 1),
        "step": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.rand(3, 7, generator=g) > 0.5,
        "bytes": torch.randint(0, 256, (29,), generator=g, dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
    }


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, name
        assert g.shape == w.shape, name
        assert torch.equal(g, w), name


@pytest.fixture
def ns() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


try:
    import ucxx  # noqa: F401

    UCX_SKIP = None
except ImportError as e:
    UCX_SKIP = f"the ucx transport needs the optional extra (pip install -e '.[ucx]'): {e}"


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    if request.param == "ucx" and UCX_SKIP:
        pytest.skip(UCX_SKIP)
    return request.param


@pytest.fixture
def publisher_factory(redis_client: redis.Redis, ns: str) -> Iterator[Callable[..., WeightPublisher]]:
    made: list[WeightPublisher] = []

    def build(transport: str, **opts: object) -> WeightPublisher:
        opts.setdefault("bucket_bytes", SMALL_BUCKET)
        publisher = make_publisher(transport, redis_client, KEY, ns=ns, **opts)
        made.append(publisher)
        return publisher

    yield build
    for publisher in made:
        publisher.close()


@pytest.fixture
def fetcher_factory(redis_client: redis.Redis) -> Iterator[Callable[..., WeightFetcher]]:
    made: list[WeightFetcher] = []

    def build(transport: str, *, client: redis.Redis | None = None, **opts: object) -> WeightFetcher:
        fetcher = make_fetcher(transport, client or redis_client, KEY, **opts)
        made.append(fetcher)
        return fetcher

    yield build
    for fetcher in made:
        fetcher.close()


def refuse_each(sock, requests) -> None:
    """Each request sent on ``sock`` is answered with a 'bad request' or 'gone' header and no data."""
    for request in requests:
        sock.send(request)
        header, data = sock.recv_multipart()
        assert msgpack.unpackb(header)[2] in ("bad request", "gone")
        assert data == b""


def corrupt_one_byte(publisher: WeightPublisher, manifest: Manifest, position: int | None = None) -> bytes:
    """Flip one byte of tensor data where the transport keeps it; return the bad payload."""
    if position is None:
        # Inside the largest tensor's data, not the header, so the payload still loads.
        largest = max(manifest.tensors, key=lambda t: t.end - t.start)
        position = (largest.start + largest.end) // 2
    if manifest.transport == "shm":
        with open(manifest.address, "r+b") as f:
            f.seek(position)
            (byte,) = f.read(1)
            f.seek(position)
            f.write(bytes([byte ^ 0xFF]))
        with open(manifest.address, "rb") as f:
            return f.read()
    with publisher._lock:  # type: ignore[attr-defined]  # fault injection into the server's store
        data = bytearray(publisher._payloads[manifest.version])  # type: ignore[attr-defined]
        data[position] ^= 0xFF
        publisher._payloads[manifest.version] = bytes(data)  # type: ignore[attr-defined]
    return bytes(data)


# --- both transports ----------------------------------------------------------------


def test_a_published_version_fetches_back_bit_identical(transport, publisher_factory, fetcher_factory):
    publisher = publisher_factory(transport)
    tensors = make_tensors(seed=1)
    manifest = publisher.publish(1, tensors)
    assert manifest.num_buckets > 3 and manifest.total_bytes % SMALL_BUCKET != 0

    version, got = fetcher_factory(transport).fetch()

    assert version == 1
    assert_same_tensors(got, tensors)
    specs = {t.name: t for t in manifest.tensors}
    assert specs["model.embed_tokens.weight"].dtype == "BF16"
    assert specs["model.layers.0.mlp.up_proj.weight"].shape == (7, 3, 11)
    assert specs["step"].shape == () and specs["empty"].shape == (0, 4)


def test_publish_takes_a_snapshot_so_later_in_place_updates_never_reach_fetchers(
    transport, publisher_factory, fetcher_factory
):
    live = make_tensors(seed=1)
    want = {name: t.clone() for name, t in live.items()}
    publisher_factory(transport).publish(1, live)
    for t in live.values():  # what an optimizer step does to live parameters
        if t.numel() and t.dtype != torch.bool:
            t.add_(1)

    assert_same_tensors(fetcher_factory(transport).fetch(1)[1], want)


def test_views_from_a_fetch_without_copy_hold_the_version(transport, publisher_factory, fetcher_factory):
    tensors = make_tensors(seed=3)
    publisher_factory(transport).publish(1, tensors)
    version, views = fetcher_factory(transport).fetch(copy=False)
    assert version == 1
    assert_same_tensors(views, tensors)


def test_a_published_shm_file_is_a_safetensors_file(publisher_factory):
    tensors = make_tensors(seed=2)
    manifest = publisher_factory("shm").publish(1, tensors)
    assert_same_tensors(safetensors.torch.load_file(manifest.address), tensors)


def test_tensors_that_cannot_be_published_are_refused_with_their_name(transport, publisher_factory):
    publisher = publisher_factory(transport)
    with pytest.raises(ValueError, match="tensor 'model.rotary': dtype torch.complex64 cannot be published"):
        publisher.publish(1, {"model.rotary": torch.zeros(3, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="empty set of tensors"):
        publisher.publish(1, {})
    publisher.publish(1, make_tensors(seed=1))  # a refused publish leaves the publisher usable


def test_latest_version_is_minus_one_before_any_publish_and_then_follows_publishes(
    transport, publisher_factory, fetcher_factory
):
    fetcher = fetcher_factory(transport)
    assert fetcher.latest_version() == -1
    publisher = publisher_factory(transport)
    for version in (0, 1, 2, 7):
        publisher.publish(version, make_tensors(seed=version))
        assert fetcher.latest_version() == version


def test_fetching_before_anything_is_published_raises_weights_error(transport, fetcher_factory):
    with pytest.raises(WeightsError, match="no weights published"):
        fetcher_factory(transport).fetch()


def test_a_fetcher_can_jump_from_v1_to_v4(transport, publisher_factory, fetcher_factory):
    publisher = publisher_factory(transport)
    fetcher = fetcher_factory(transport)
    publisher.publish(1, make_tensors(seed=1))
    assert fetcher.fetch()[0] == 1
    for version in (2, 3, 4):
        publisher.publish(version, make_tensors(seed=version))

    version, got = fetcher.fetch()

    assert version == 4
    assert_same_tensors(got, make_tensors(seed=4))


def test_only_the_last_keep_versions_remain_fetchable(transport, publisher_factory, fetcher_factory, redis_client):
    publisher = publisher_factory(transport, keep_versions=3)
    for version in range(1, 6):
        publisher.publish(version, make_tensors(seed=version))
    fetcher = fetcher_factory(transport)

    for version in (3, 4, 5):
        got_version, got = fetcher.fetch(version)
        assert got_version == version
        assert_same_tensors(got, make_tensors(seed=version))
    for version in (1, 2):
        with pytest.raises(WeightsError, match=f"v{version} not available"):
            fetcher.fetch(version)
    assert publisher.retained_versions == (3, 4, 5)
    assert sorted(redis_client.hkeys(KEY)) == [b"announce", b"manifest", b"manifest:3", b"manifest:4", b"manifest:5", b"version"]


def test_a_corrupted_payload_raises_weights_error_not_bad_tensors(transport, publisher_factory, fetcher_factory):
    publisher = publisher_factory(transport)
    tensors = make_tensors(seed=1)
    manifest = publisher.publish(1, tensors)
    bad = corrupt_one_byte(publisher, manifest)
    # Without the checksums this payload would load fine, with one wrong value in it.
    loaded = safetensors.torch.load(bad)
    assert set(loaded) == set(tensors) and not all(torch.equal(loaded[n], t) for n, t in tensors.items())

    with pytest.raises(WeightsError, match="checksum"):
        fetcher_factory(transport).fetch()


def test_a_late_fetcher_gets_the_newest_version(transport, publisher_factory, fetcher_factory):
    publisher = publisher_factory(transport)
    for version in range(4):
        publisher.publish(version, make_tensors(seed=version))

    version, got = fetcher_factory(transport).fetch()

    assert version == 3
    assert_same_tensors(got, make_tensors(seed=3))


def test_a_fetcher_works_with_a_decoding_redis_client(transport, publisher_factory, fetcher_factory, redis_url):
    publisher_factory(transport).publish(2, make_tensors(seed=2))
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        fetcher = fetcher_factory(transport, client=client)
        assert fetcher.latest_version() == 2
        assert_same_tensors(fetcher.fetch(2)[1], make_tensors(seed=2))
    finally:
        client.close()


def test_fetching_from_a_closed_publisher_raises_within_the_timeout(transport, publisher_factory, fetcher_factory):
    publisher = publisher_factory(transport)
    publisher.publish(1, make_tensors(seed=1))
    fetcher = fetcher_factory(transport, **({"timeout_s": 0.5} if transport != "shm" else {}))
    publisher.close()

    start = time.monotonic()
    with pytest.raises(WeightsError, match="gone"):
        fetcher.fetch()
    assert time.monotonic() - start < 3.0


def test_a_malformed_manifest_in_redis_raises_weights_error(transport, fetcher_factory, redis_client):
    redis_client.hset(KEY, mapping={"version": 1, "manifest": "{not json"})
    with pytest.raises(WeightsError, match="malformed manifest"):
        fetcher_factory(transport).fetch()


def test_a_manifest_for_another_transport_is_refused(transport, publisher_factory, fetcher_factory):
    other = next(t for t in TRANSPORTS if t != transport)
    publisher_factory(other).publish(1, make_tensors(seed=1))
    with pytest.raises(WeightsError, match=f"served over '{other}'"):
        fetcher_factory(transport).fetch()


def test_fetches_racing_publishes_get_whole_versions_or_a_weights_error(
    transport, publisher_factory, fetcher_factory
):
    publisher = publisher_factory(transport, keep_versions=1)
    publisher.publish(0, make_tensors(seed=0))
    fetcher = fetcher_factory(transport)
    done = threading.Event()
    outcomes: list[int | str] = []

    def fetch_until_done() -> None:
        while not done.is_set():
            try:
                version, got = fetcher.fetch()
            except WeightsError:
                outcomes.append("retry")
                continue
            assert_same_tensors(got, make_tensors(seed=version))
            outcomes.append(version)

    reader = threading.Thread(target=fetch_until_done)
    reader.start()
    try:
        for version in range(1, 30):
            publisher.publish(version, make_tensors(seed=version))
        # On a loaded host every fetch during the publishes may have lost its race (a
        # WeightsError each); the reader keeps going until it has a whole version.
        deadline = time.monotonic() + 30
        while not any(isinstance(o, int) for o in outcomes) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        done.set()
        reader.join(timeout=30)
    assert not reader.is_alive()
    assert any(isinstance(o, int) for o in outcomes)
    assert fetcher.fetch()[0] == 29


def test_publishing_a_version_that_is_not_newer_is_refused(transport, publisher_factory):
    publisher = publisher_factory(transport)
    publisher.publish(3, make_tensors(seed=3))
    with pytest.raises(ValueError, match="not newer"):
        publisher.publish(3, make_tensors(seed=3))
    with pytest.raises(ValueError, match="not newer"):
        publisher.publish(2, make_tensors(seed=2))


def test_a_new_publisher_sweeps_the_announcements_its_predecessor_left(
    transport, publisher_factory, fetcher_factory, redis_client
):
    first = publisher_factory(transport)
    for version in (1, 2, 3):
        first.publish(version, make_tensors(seed=version))
    first.close()  # as if the trainer restarted

    second = publisher_factory(transport, keep_versions=2)
    second.publish(4, make_tensors(seed=4))

    assert sorted(redis_client.hkeys(KEY)) == [b"announce", b"manifest", b"manifest:4", b"version"]
    assert_same_tensors(fetcher_factory(transport).fetch()[1], make_tensors(seed=4))


def test_unknown_transport_names_are_refused_with_the_allowed_list(redis_client):
    with pytest.raises(ValueError, match="allowed: shm, tcp"):
        make_publisher("carrier-pigeon", redis_client, KEY, ns="x")
    with pytest.raises(ValueError, match="allowed: shm, tcp"):
        make_fetcher("carrier-pigeon", redis_client, KEY)


# --- shm ----------------------------------------------------------------------------


def test_a_truncated_shm_file_is_reported_as_a_size_mismatch(publisher_factory, fetcher_factory):
    manifest = publisher_factory("shm").publish(1, make_tensors(seed=1))
    with open(manifest.address, "r+b") as f:
        f.truncate(manifest.total_bytes // 2)
    with pytest.raises(WeightsError, match="bytes, manifest says"):
        fetcher_factory("shm").fetch()


def test_the_shm_publisher_keeps_only_retained_files_and_removes_them_on_close(
    publisher_factory, redis_client, ns, tmp_path
):
    publisher = publisher_factory("shm", root=tmp_path, keep_versions=2)
    folder = tmp_path / ns
    leftover = folder / "run1_weights.v0.safetensors"  # as if a killed predecessor left it
    folder.mkdir(exist_ok=True)
    leftover.write_bytes(b"stale")
    for version in (1, 2, 3):
        manifest = publisher.publish(version, make_tensors(seed=version))
    assert manifest.address == str(folder / "run1_weights.v3.safetensors")
    assert sorted(p.name for p in folder.iterdir()) == ["run1_weights.v2.safetensors", "run1_weights.v3.safetensors"]

    publisher.close()
    assert not folder.exists()


def test_the_shm_publisher_writes_under_dev_shm_by_default(publisher_factory, ns):
    manifest = publisher_factory("shm").publish(1, make_tensors(seed=1))
    assert manifest.address.startswith(f"/dev/shm/{ns}/")


# --- tcp ----------------------------------------------------------------------------


def test_the_tcp_publisher_answers_garbage_requests_and_keeps_serving(publisher_factory, fetcher_factory):
    publisher = publisher_factory("tcp")
    publisher.publish(1, make_tensors(seed=1))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.rcvtimeo = 5000
    sock.linger = 0
    sock.connect(publisher.address)  # type: ignore[attr-defined]
    try:
        refuse_each(sock, (b"\xc1garbage", msgpack.packb(["1", 0]), msgpack.packb([1, 10**6]), msgpack.packb([9, 0])))
    finally:
        sock.close()
        ctx.term()
    assert_same_tensors(fetcher_factory("tcp").fetch()[1], make_tensors(seed=1))


def test_a_tcp_publisher_on_a_taken_port_fails_at_construction(publisher_factory):
    first = publisher_factory("tcp")
    port = int(first.address.rsplit(":", 1)[1])  # type: ignore[attr-defined]
    with pytest.raises(zmq.ZMQError):
        publisher_factory("tcp", port=port)


def test_the_tcp_publisher_advertises_its_bound_address(publisher_factory):
    publisher = publisher_factory("tcp")
    manifest = publisher.publish(1, make_tensors(seed=1))
    assert manifest.address == publisher.address  # type: ignore[attr-defined]
    assert manifest.address.startswith("tcp://127.0.0.1:")
    assert int(manifest.address.rsplit(":", 1)[1]) > 0


def test_a_fetch_pipelines_many_buckets_with_a_single_request_in_flight_too(publisher_factory, fetcher_factory):
    publisher_factory("tcp", bucket_bytes=256).publish(1, make_tensors(seed=1))
    for depth in (1, 16):
        assert_same_tensors(fetcher_factory("tcp", max_in_flight=depth).fetch()[1], make_tensors(seed=1))


# --- ucx ----------------------------------------------------------------------------


@pytest.fixture
def ucx() -> None:
    if UCX_SKIP:
        pytest.skip(UCX_SKIP)


def test_ucx_messages_cut_each_bucket_into_pieces_that_cover_it_in_order(ucx):
    from pipeline.weights.ucx import _message_count, _messages

    for total, bucket, message in [(10, 4, 3), (12, 4, 4), (12, 4, 100), (1, 16, 4), (9000, 1000, 333), (0, 5, 2)]:
        pieces = _messages(total, bucket, message)
        assert len(pieces) == _message_count(total, bucket, message)
        assert [end for *_, end, _ in pieces[:-1]] == [start for _, start, *_ in pieces[1:]]
        assert (pieces[0][1], pieces[-1][2]) == (0, total) if pieces else total == 0
        for index, start, end, last in pieces:
            assert index * bucket <= start < end <= min((index + 1) * bucket, total)
            assert end - start <= message
            assert last == (end == min((index + 1) * bucket, total))
        assert sum(last for *_, last in pieces) == -(-total // bucket)


@pytest.mark.parametrize("behind", [0, 1, 10**9])
def test_a_ucx_fetch_in_pieces_smaller_than_a_bucket_checks_every_bucket_as_it_lands(
    ucx, behind, publisher_factory, fetcher_factory, monkeypatch
):
    import pipeline.weights.ucx

    monkeypatch.setattr(pipeline.weights.ucx, "_BEHIND_PIECES", behind)  # 0: every bucket summed inline
    manifest = publisher_factory("ucx", bucket_bytes=4000).publish(1, make_tensors(seed=1))
    assert manifest.num_buckets > 2
    for message_bytes in (333, 4000, 1 << 20):
        fetcher = fetcher_factory("ucx", message_bytes=message_bytes)
        assert_same_tensors(fetcher.fetch(1)[1], make_tensors(seed=1))
        # Every bucket was summed while the transfer ran, none by a pass afterwards.
        assert sorted(fetcher._checks) == list(range(manifest.num_buckets))  # type: ignore[attr-defined]


@pytest.mark.parametrize("summed_by", ["helper thread", "fetching thread"])
@pytest.mark.parametrize("where", ["last byte", "first byte of a late piece", "middle of an early bucket"])
def test_a_ucx_fetch_refuses_a_corrupt_byte_in_any_piece_and_then_fetches_the_next_version(
    ucx, where, summed_by, publisher_factory, fetcher_factory, monkeypatch
):
    import pipeline.weights.ucx

    # The fetching thread sums a bucket itself when the helper is that many pieces behind.
    monkeypatch.setattr(pipeline.weights.ucx, "_BEHIND_PIECES", 10**9 if summed_by == "helper thread" else 0)
    publisher = publisher_factory("ucx", bucket_bytes=4000)
    manifest = publisher.publish(1, make_tensors(seed=1))
    position = {"last byte": manifest.total_bytes - 1,
                "first byte of a late piece": (manifest.num_buckets - 1) * 4000 + 500,
                "middle of an early bucket": 4000 + 2000}[where]
    corrupt_one_byte(publisher, manifest, position)
    fetcher = fetcher_factory("ucx", message_bytes=500)
    with pytest.raises(WeightsError, match=f"bucket {position // 4000} .*checksum"):
        fetcher.fetch(1)
    publisher.publish(2, make_tensors(seed=2))
    assert_same_tensors(fetcher.fetch(2)[1], make_tensors(seed=2))


def test_the_ucx_publisher_answers_garbage_requests_and_keeps_serving(ucx, publisher_factory, fetcher_factory):
    publisher = publisher_factory("ucx")
    publisher.publish(1, make_tensors(seed=1))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.rcvtimeo = 5000
    sock.linger = 0
    sock.connect(publisher.address)  # type: ignore[attr-defined]
    tag = 7 << 24
    try:
        refuse_each(sock, [msgpack.packb(x) if isinstance(x, list) else x for x in (
            b"\xc1garbage", [1, "ucx", b"addr"], [1, "tcp", b"addr", tag], [1, "ucx", b"addr", tag + 1],
            [1, "ucx", b"addr", tag, 0], [1, "ucx", b"addr", tag, -4], [1, "ucx", b"addr", tag, "4"],
            [1, "ucx", b"addr", tag, 4, 4], [9, "ucx", b"addr", tag, 4])])
    finally:
        sock.close()
        ctx.term()
    assert_same_tensors(fetcher_factory("ucx").fetch()[1], make_tensors(seed=1))


def test_a_ucx_fetcher_refuses_a_message_size_that_is_not_a_positive_int(ucx, fetcher_factory):
    for bad in (0, -1, 1.5, "4"):
        with pytest.raises(ValueError, match="message_bytes"):
            fetcher_factory("ucx", message_bytes=bad)


# --- manifest -----------------------------------------------------------------------


def test_a_running_checksum_over_consecutive_pieces_equals_the_checksum_of_the_whole():
    data = bytes(range(256)) * 41 + b"tail"
    for size in (1, 7, 1000, len(data), len(data) + 1):
        running = RunningChecksum()
        for start in range(0, len(data), size):
            running.update(memoryview(data)[start : start + size])
        assert running.hexdigest() == checksum(data)
    assert RunningChecksum().hexdigest() == checksum(b"")


def make_manifest(**overrides: object) -> Manifest:
    fields: dict[str, object] = dict(
        version=4,
        transport="shm",
        address="/dev/shm/run1/run1_weights.v4.safetensors",
        total_bytes=2500,
        bucket_bytes=1000,
        checksums=(checksum(b"a"), checksum(b"b"), checksum(b"c")),
        tensors=(TensorSpec(name="w", dtype="BF16", shape=(3, 5), start=100, end=130),
                 TensorSpec(name="s", dtype="I64", shape=(), start=130, end=138)),
        created_at=1_700_000_000.25,
    )
    fields.update(overrides)
    return Manifest(**fields)  # type: ignore[arg-type]


def test_a_manifest_survives_a_json_round_trip():
    manifest = make_manifest()
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert Manifest.from_json(manifest.to_json().encode()) == manifest
    assert manifest.bucket_span(2) == (2000, 2500)


_DROP = object()


def _json_with(**changes: object) -> str:
    """The JSON of ``make_manifest()`` with fields changed (or removed with ``_DROP``)."""
    d = json.loads(make_manifest().to_json())
    for name, value in changes.items():
        if value is _DROP:
            del d[name]
        else:
            d[name] = value
    return json.dumps(d)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("{not json", id="not json"),
        pytest.param("[1, 2]", id="not an object"),
        pytest.param(b"\xff\xfe", id="not utf-8"),
        pytest.param(_json_with(version=_DROP), id="missing field"),
        pytest.param(_json_with(extra=1), id="unexpected field"),
        pytest.param(_json_with(schema=1), id="old schema (zlib crc32 checksums)"),
        pytest.param(_json_with(schema=3), id="unknown schema"),
        pytest.param(_json_with(version="4"), id="version as string"),
        pytest.param(_json_with(version=True), id="version as bool"),
        pytest.param(_json_with(version=-1), id="negative version"),
        pytest.param(_json_with(total_bytes=-5), id="negative size"),
        pytest.param(_json_with(bucket_bytes=0), id="zero bucket size"),
        pytest.param(_json_with(transport=""), id="empty transport"),
        pytest.param(_json_with(checksums=["00000000"]), id="too few checksums"),
        pytest.param(_json_with(checksums=["xyz", "00000000", "00000000"]), id="bad checksum"),
        pytest.param(_json_with(checksums="00000000"), id="checksums not a list"),
        pytest.param(_json_with(tensors=[{"name": "w", "dtype": "F32", "shape": [2]}]), id="tensor without range"),
        pytest.param(_json_with(tensors=[{"name": "w", "dtype": "F32", "shape": [-2], "start": 0, "end": 0}]),
                     id="negative dim"),
        pytest.param(_json_with(tensors=[{"name": "w", "dtype": "F32", "shape": [2], "start": 0, "end": 9999}]),
                     id="tensor past the payload"),
        pytest.param(_json_with(created_at="yesterday"), id="created_at not a number"),
    ],
)
def test_a_malformed_manifest_json_is_rejected_with_value_error(text):
    with pytest.raises(ValueError):
        Manifest.from_json(text)


@pytest.mark.parametrize("transport", ["tcp"])
def test_fixed_ports_and_an_advertised_host_reach_the_fetcher(transport, redis_client):
    """Multi-host settings (weights.tcp_port, announce_port, advertise_host): the publisher binds
    the configured ports and tells fetchers the advertised name, which they connect through."""
    from types import SimpleNamespace

    from pipeline.bus.server import free_port
    from pipeline.weights import WeightWatch, fetcher_options, publisher_options

    cfg = SimpleNamespace(transport=transport, tcp_host="127.0.0.1", tcp_port=free_port(),
                          announce_port=free_port(), advertise_host="localhost", ucx_tls="", fetch_timeout_s=5.0)
    pub = make_publisher(transport, redis_client, KEY, ns=f"ports-{uuid.uuid4().hex[:6]}", **publisher_options(cfg))
    fetcher = make_fetcher(transport, redis_client, KEY, **fetcher_options(cfg))
    try:
        manifest = pub.publish(1, {"w": torch.arange(6, dtype=torch.float32)})
        assert manifest.address == f"tcp://localhost:{cfg.tcp_port}"
        assert redis_client.hget(KEY, "announce").decode() == f"tcp://localhost:{cfg.announce_port}"
        version, tensors = fetcher.fetch(1)
        assert version == 1 and torch.equal(tensors["w"], torch.arange(6, dtype=torch.float32))
        watch = WeightWatch(redis_client, KEY)
        try:
            got = []
            t = threading.Thread(target=lambda: got.append(watch.wait(1, timeout_s=10.0)))
            t.start()
            time.sleep(0.5)
            pub.publish(2, {"w": torch.zeros(6)})
            t.join(15)
            assert got == [2]
        finally:
            watch.close()
    finally:
        fetcher.close()
        pub.close()
    # A port in use is refused with the port named.
    with zmq.Context() as ctx, ctx.socket(zmq.PUB) as busy:
        port = free_port()
        busy.bind(f"tcp://127.0.0.1:{port}")
        cfg.announce_port, cfg.tcp_port = port, 0
        with pytest.raises(ValueError, match=str(port)):
            make_publisher(transport, redis_client, KEY, ns="ports-busy", **publisher_options(cfg))
