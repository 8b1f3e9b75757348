"""The p2p_ec control and data planes with real sockets on 127.0.0.1 and real CURVE keys, without an
engine: fetch over shared memory and TCP, the producer-readiness race (NOT_READY, retried), missing vs
evicted, untrusted and incompatible producers, hostile peers on the control port, and no leaks."""

from __future__ import annotations

import os
import pickle
import threading
import time

import pytest
import torch
import zmq
from ec_parts import FP, Producer, consumer, fetch
from proc_sockets import listening

from pdcluster.connectors.ec.wire import FETCH, MAX_FRAME_BYTES, REPLIES, new_nonce, now_ms
from pdcluster.engine.ec_connector import ECFetchError
from pdcluster.security.curve import make_client_socket
from pdcluster.security.envelope import decode, encode
from pdcluster.security.keys import generate_keypair

H0, H1, H2 = "0" * 63 + "a", "0" * 63 + "b", "0" * 63 + "c"


def _wait(cond, what: str, timeout_s: float = 30.0) -> None:
    """Wait for an event (never asserts a duration: the deadline only stops a hung test)."""
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def producer(ec_keys):
    p = Producer(ec_keys)
    yield p
    p.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_fetch_round_trip(ec_keys, producer, transport) -> None:
    out = torch.randn(16, 24)
    assert producer.producer.save(H0, out)
    [(h, lease, nbytes, ntok)] = producer.producer.announce([H0])
    assert (h, nbytes, ntok) == (H0, out.numel() * 4, 16)
    fetcher = consumer(ec_keys, transport=transport)
    try:
        report = fetch(fetcher, producer.params([(H0, lease)]), [(H0, 16)])
        assert not report.failed and torch.equal(report.loaded[H0], out)
        stats = fetcher.stats()
        assert stats[f"fetched_{transport}"] == 1 and stats["transfer_bytes"] == out.numel() * 4
        assert stats["release_released"] == 1
        # released by the consumer after the fetch: the announced lease and the grant are gone
        assert producer.store.stats()["store_leases_active"] == 0
        if transport == "tcp":  # counted by the server thread after its send: wait for it, do not race it
            _wait(lambda: producer.producer.stats()["producer_bytes_served"] == out.numel() * 4, "bytes counted")
    finally:
        fetcher.close()


def test_readiness_race_not_ready_then_served(ec_keys, producer) -> None:
    """The consumer asks before the producer's save completed: NOT_READY (not MISSING), it retries,
    and gets the right bytes once they are saved."""
    out = torch.randn(16, 8)
    producer.store.reserve(H1)  # the tower is running
    fetcher = consumer(ec_keys, fetch_timeout_s=120.0)
    result = {}
    try:
        t = threading.Thread(target=lambda: result.update(r=fetch(fetcher, producer.params(), [(H1, 16)])))
        t.start()
        _wait(lambda: producer.producer.counters["not_ready"] >= 2, "two NOT_READY answers")
        producer.producer.save(H1, out)
        t.join(60)
        report = result["r"]
        assert not report.failed and torch.equal(report.loaded[H1], out)
        assert fetcher.stats()["not_ready_retries"] >= 2
        assert producer.producer.counters.get("refused_missing", 0) == 0
    finally:
        fetcher.close()


def test_missing_evicted_and_shape_checked(ec_keys, producer) -> None:
    producer.producer.save(H0, torch.randn(16, 8))
    producer.producer.save(H2, torch.randn(16, 8))
    [(_, lease, _, _)] = producer.producer.announce([H0])
    assert producer.store.drop(H0)  # evicted after it was announced
    fetcher = consumer(ec_keys)
    try:
        report = fetch(fetcher, producer.params([(H0, lease)]), [(H0, 16), (H1, 16), (H2, 4)])
        assert report.failed == {H0: ECFetchError.EVICTED, H1: ECFetchError.MISSING, H2: ECFetchError.MALFORMED}
        assert fetcher.stats()["errors_evicted"] == 1 and fetcher.stats()["errors_missing"] == 1
        # the wrong-shape fetch still ended its grant
        assert producer.store.stats()["store_leases_active"] == 0
    finally:
        fetcher.close()


def test_item_of_another_width_refused_before_allocation(ec_keys, producer) -> None:
    producer.producer.save(H0, torch.randn(16, 8))
    producer.producer.save(H1, torch.randn(16, 9))
    fetcher = consumer(ec_keys, row_bytes=8 * 4)  # this engine's rows: 8 float32
    try:
        report = fetch(fetcher, producer.params(), [(H0, 16), (H1, 16)])
        assert list(report.loaded) == [H0] and report.failed == {H1: ECFetchError.MALFORMED}
    finally:
        fetcher.close()


def test_untrusted_key_and_incompatible_fingerprint(ec_keys, producer) -> None:
    producer.producer.save(H0, torch.randn(16, 8))
    fetcher = consumer(ec_keys)
    try:
        stranger = producer.params().__class__(address=producer.server.address,
                                               public_key=generate_keypair("x").public, fingerprint=FP)
        assert fetch(fetcher, stranger, [(H0, 16)]).failed == {H0: ECFetchError.UNTRUSTED}
        other_fp = producer.params(fingerprint="cd" * 32)
        assert fetch(fetcher, other_fp, [(H0, 16)]).failed == {H0: ECFetchError.INCOMPATIBLE}
        # params without a fingerprint: the producer's per-request check catches it
        other = consumer(ec_keys, fingerprint="ef" * 32)
        try:
            assert fetch(other, producer.params(fingerprint=""), [(H0, 16)]).failed == {H0: ECFetchError.INCOMPATIBLE}
        finally:
            other.close()
        assert producer.producer.counters["refused_incompatible"] == 1
    finally:
        fetcher.close()


def test_lease_expiry_frees_the_item(ec_keys) -> None:
    """The server thread's expiry scan ends an announced lease nobody released; the item is then
    evictable, and a consumer that comes later hears 'evicted'."""
    from pdcluster.engine.ec_connector import ECItemState

    p = Producer(ec_keys, lease_s=30, max_bytes=1024)
    now = [time.monotonic()]
    p.store._clock = lambda: now[0]  # the store's clock, moved by hand: no test waits out a lease
    try:
        p.producer.save(H0, torch.randn(16, 8))  # 512 bytes
        [(_, lease, _, _)] = p.producer.announce([H0])
        assert p.store.state(H0) is ECItemState.PINNED
        assert not p.producer.save(H1, torch.randn(16, 16))  # 1 KiB: no room while H0 is leased
        now[0] += 31
        _wait(lambda: p.store.state(H0) is ECItemState.READY, "the expiry scan to end the lease")
        assert p.producer.save(H1, torch.randn(16, 16))  # now H0 is evicted to make room
        fetcher = consumer(ec_keys)
        try:
            assert fetch(fetcher, p.params([(H0, lease)]), [(H0, 16)]).failed == {H0: ECFetchError.EVICTED}
        finally:
            fetcher.close()
    finally:
        p.close()


def test_data_plane_failure_fails_the_item(ec_keys, producer) -> None:
    producer.producer.save(H0, torch.randn(16, 8))
    producer.producer.server.stop()  # the control plane answers, the TCP data plane is gone
    fetcher = consumer(ec_keys, transport="tcp")
    try:
        assert fetch(fetcher, producer.params(), [(H0, 16)]).failed == {H0: ECFetchError.TRANSFER}
        assert fetcher.stats()["release_released"] == 1  # its grant was still ended
    finally:
        fetcher.close()


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/pdcluster-ec-unpickled",))


def test_hostile_peers_refused_counted_server_keeps_answering(ec_keys, producer) -> None:
    addr = f"tcp://{producer.server.address}"
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.DEALER)  # no CURVE at all
        plain.linger = 0
        plain.connect(addr)
        plain.send(b"hello")
        stranger = make_client_socket(ctx, zmq.DEALER, generate_keypair("stranger"), producer.opts.keypair.public, addr)
        stranger.send(b"hello")
        _wait(lambda: producer.server.refusals() >= 2, "two refused handshakes")
        assert not plain.poll(50) and not stranger.poll(50)

        sock = make_client_socket(ctx, zmq.DEALER, ec_keys.pairs["prefill"], producer.opts.keypair.public, addr)
        msg = encode(FETCH, {"nonce": new_nonce(), "ts_ms": now_ms(), "fingerprint": FP, "mm_hash": H0,
                             "lease_id": ""})
        for frame in (pickle.dumps(_Boom()), os.urandom(300), b"\x00" * (2 * MAX_FRAME_BYTES), msg, msg):
            sock.send(frame)
            assert sock.poll(30_000)
            nonce, body = sock.recv_multipart()
            _, reply = decode(REPLIES, body)
            assert reply["ok"] is False
        assert not os.path.exists("/tmp/pdcluster-ec-unpickled")
        counters = producer.producer.counters
        assert counters["refused_malformed"] == 2 and counters["refused_too_large"] == 1
        assert counters["refused_missing"] == 1 and counters["refused_replayed"] == 1
        sock.send(b"\x00" * (8 * MAX_FRAME_BYTES))  # over MAXMSGSIZE: libzmq drops the connection unread
        sock.close()
        plain.close()
        stranger.close()
    finally:
        ctx.term()
    producer.producer.save(H0, torch.ones(16, 8))  # the server keeps answering everybody else
    fetcher = consumer(ec_keys)
    try:
        assert torch.equal(fetch(fetcher, producer.params(), [(H0, 16)]).loaded[H0], torch.ones(16, 8))
    finally:
        fetcher.close()


def test_nothing_leaks_after_shutdown(ec_keys) -> None:
    before = {t.ident for t in threading.enumerate()}
    p = Producer(ec_keys)
    fetcher = consumer(ec_keys, transport="tcp")
    p.producer.save(H0, torch.randn(16, 8))
    fetch(fetcher, p.params(), [(H0, 16)])
    shm = f"/dev/shm/{p.producer.region.shm_name}"
    ports = {int(p.server.address.rpartition(":")[2]), p.producer.server.address[1]}
    assert os.path.exists(shm) and ports <= {port for _, port in listening([os.getpid()])}
    fetcher.close()
    p.close()
    assert not os.path.exists(shm)
    assert not ports & {port for _, port in listening([os.getpid()])}
    _wait(lambda: {t.ident for t in threading.enumerate()} <= before, "the connector's threads to end")


def test_wildcard_data_host_needs_an_advertised_address(tmp_path) -> None:
    """A producer bound to a wildcard never announces 0.0.0.0 as where to fetch from."""
    from pdcluster.connectors.ec.options import ECOptions
    from pdcluster.connectors.ec.producer import ECProducer
    from pdcluster.security.keys import ensure_instance_keys

    keys = str(tmp_path / "keys")
    ensure_instance_keys(keys, ["enc"])
    base = {"keys_dir": keys, "key_name": "enc", "data_host": "0.0.0.0", "max_bytes": 1 << 16}
    with pytest.raises(ValueError, match="data_host is a wildcard address: set advertise_host"):
        ECProducer(ECOptions.from_dict(base), fingerprint="fp")
    producer = ECProducer(ECOptions.from_dict({**base, "advertise_host": "127.0.0.1"}), fingerprint="fp")
    try:
        assert producer.data_address[0] == "127.0.0.1"
    finally:
        producer.close()
