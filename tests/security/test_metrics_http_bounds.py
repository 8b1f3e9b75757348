"""The workers' and the kvstore's /metrics server: a bounded number of connections served at once
(more are closed and counted) and idle connections closed, so idle or half-sent peers cannot hold
a thread each for ever. Real sockets on 127.0.0.1."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from security.deploy_probes import closed_by_server

from pdcluster.metrics_http import serve_registry

WAIT_S = 30.0  # generous bounds for slow machines: the server acts in well under a second


@pytest.fixture
def served():
    servers = []

    def start(**kwargs):
        registry = CollectorRegistry()
        Counter("probe_total", "a counter to scrape", registry=registry).inc(3)
        httpd, thread = serve_registry(registry, "127.0.0.1", 0, **kwargs)
        servers.append((httpd, thread))
        return httpd

    yield start
    for httpd, thread in servers:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S) as resp:
        return resp.read().decode()


def _scrape_eventually(port: int) -> str:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return _scrape(port)
        except (ConnectionError, urllib.error.URLError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _half_sent(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    s.sendall(b"GET /metrics HTTP/1.1\r\n")  # the request never ends
    return s


def test_scrape_serves_the_registry(served):
    httpd = served()
    assert "probe_total 3.0" in _scrape(httpd.server_port)


def test_connections_over_the_cap_are_closed_and_counted(served):
    httpd = served(max_connections=2, idle_timeout_s=WAIT_S * 2)
    held = [_half_sent(httpd.server_port) for _ in range(2)]
    extra = _half_sent(httpd.server_port)  # accepted after the two (one listen queue, in order)
    assert closed_by_server(extra, time.monotonic() + WAIT_S)
    assert httpd.refused == 1
    for s in held:
        s.close()
    extra.close()
    assert "probe_total 3.0" in _scrape_eventually(httpd.server_port)


def test_idle_connections_are_closed(served):
    httpd = served(max_connections=1, idle_timeout_s=0.3)
    idle = socket.create_connection(("127.0.0.1", httpd.server_port), timeout=WAIT_S)
    half = _half_sent(httpd.server_port)  # refused while the idle one holds the only slot, or later served
    assert closed_by_server(idle, time.monotonic() + WAIT_S)
    half.close()
    assert "probe_total 3.0" in _scrape_eventually(httpd.server_port)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_connections"):
        serve_registry(CollectorRegistry(), "127.0.0.1", 0, max_connections=0)
