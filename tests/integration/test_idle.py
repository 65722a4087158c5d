"""Idle connections (issue 27, deliverable 2): a connection with nothing to read parks in the
server's readiness waiter and holds no thread; it wakes when the client sends (plain TCP, Unix,
TLS) and is dropped when the client hangs up while parked; --idle-timeout closes connections
idle past it and keeps busy ones.

Figures (threads, latency) are printed (pytest -s).
"""
from __future__ import annotations

import os
import shutil
import time

import pytest

import nbd_client as nbd
from nbd_client import NBDClient
from test_limits import raise_nofile, raw_go_many, threads_of, wrap
from test_remote_backing import serve_remote, upstreams  # noqa: F401 (upstreams is a fixture)
from test_tls import pki, raw_client, serve_tls, starttls  # noqa: F401 (pki is a fixture)

MiB = 1 << 20
# Longer than the server's wait before parking (50 ms), with room for a loaded machine.
PARKED = 0.5


def wait_until(what: str, cond, timeout: float = 15.0, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(step)


def serve_filled(ws, *extra, tcp=False):
    key_file, _ = ws.key(64)
    bridge = ws.serve(ws.backing(16 * MiB), key_file, tcp=tcp, extra=tuple(str(e) for e in extra))
    data = os.urandom(64 * 1024)
    with NBDClient(bridge.uri).connect() as c:
        c.write(0, data)
    return bridge, data


def new_client_beside_idle(bridge, data: bytes, before: int, label: str) -> None:
    """Once the server's threads settle (handshake threads end, idle pool threads leave after
    5 s without work), it has under 16 more than `before`, and a new client connects, shakes
    hands and reads 4 KiB of `data` within 100 ms."""
    pid = bridge.proc.pid
    wait_until("threads to settle", lambda: threads_of(pid) < before + 16, timeout=20.0)
    settled = threads_of(pid)
    t1 = time.monotonic()
    with NBDClient(bridge.uri).connect() as c:
        got = c.read(0, 4096)
    took = time.monotonic() - t1
    print(f"\n{label}: server threads {before} before, {settled} with them (+{settled - before}); "
          f"new client: connect, handshake and 4 KiB read in {took * 1000:.1f} ms")
    assert got == data[:4096]
    assert settled - before < 16, f"{label}: {settled} threads ({before} before)"
    assert took < 0.1, f"new client took {took * 1000:.0f} ms"


def nbdkit_idle_figure(upstreams, n: int) -> str:  # noqa: F811 (the upstreams fixture)
    """nbdkit's figure beside ours (issue 27, D7): threads added by `n` idle connections past
    NBD_OPT_GO."""
    if not shutil.which("nbdkit"):
        return "nbdkit: not installed"
    up = upstreams("nbdkit-memory", size=16 * MiB)
    pid = up.proc.pid
    before = threads_of(pid)
    socks = raw_go_many(up.uri, n, timeout=60.0)
    try:
        time.sleep(0.5)
        return f"nbdkit memory: {n} idle connections add {threads_of(pid) - before} threads"
    finally:
        for s in socks:
            s.close()
        up.stop()


def test_four_thousand_idle_connections_hold_no_threads(ws, upstreams):  # noqa: F811
    """(a) 4,000 connections past NBD_OPT_GO, idle: the server's threads grow by under 16, and
    a new client's 4 KiB read is served within 100 ms; parked connections still serve."""
    n = 4000
    raise_nofile(n + 512)
    bridge, data = serve_filled(ws)
    pid = bridge.proc.pid
    time.sleep(0.3)
    before = threads_of(pid)
    t0 = time.monotonic()
    socks = raw_go_many(bridge.uri, n, timeout=60.0)
    try:
        opened = time.monotonic() - t0
        assert bridge.alive, bridge.stderr()[-3000:]
        new_client_beside_idle(bridge, data, before, f"{n} idle connections (opened in {opened:.2f} s)")
        # Parked connections wake and serve.
        for s in socks[:: n // 8]:
            assert wrap(s, bridge.uri).read(4096, 4096) == data[4096:8192]
    finally:
        for s in socks:
            s.close()
    # Hung up while parked: every connection is dropped.
    wait_until("the idle connections' threads to go", lambda: threads_of(pid) < before + 16)
    assert bridge.alive
    print(nbdkit_idle_figure(upstreams, 500))


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_parked_connection_wakes_and_serves(ws, transport):
    """(c) a connection idle long enough to park serves its next requests correctly."""
    bridge, data = serve_filled(ws, tcp=transport == "tcp")
    with NBDClient(bridge.uri).connect() as c:
        assert c.read(0, 4096) == data[:4096]
        for i in range(3):
            time.sleep(PARKED)
            new = os.urandom(8192)
            c.write(MiB + 8192 * i, new)
            assert c.read(MiB + 8192 * i, 8192) == new
            assert c.read(0, len(data) // 2) == data[: len(data) // 2]
        time.sleep(PARKED)
        c.flush()


def test_parked_tls_connection_wakes_and_serves(ws, pki):  # noqa: F811 (the pki fixture)
    """(c) the same under TLS: a request waiting inside the TLS session must not be missed."""
    b = serve_tls(ws, pki, "require")
    c = raw_client(b)
    try:
        starttls(c, pki)
        c.opt_go()
        data = os.urandom(4096)
        c.write(0, data)
        for _ in range(3):
            time.sleep(PARKED)
            assert c.read(0, 4096) == data
        # Several requests in one burst after parking (more than one in the first TLS record).
        time.sleep(PARKED)
        handles = [c.send_request(nbd.CMD_READ, 0, 4096) for _ in range(8)]
        for _ in handles:
            r = c.recv_reply()
            assert r.error == 0
    finally:
        c.close()


def test_hang_up_while_parked_leaves_nothing(ws):
    """(d) clients that hang up while parked leave no connection behind: with
    --max-connections 2, many such clients in turn, then two at once, are all served."""
    bridge, data = serve_filled(ws, "--max-connections", 2)
    pid = bridge.proc.pid
    time.sleep(0.3)
    before = threads_of(pid)
    for _ in range(6):
        c = NBDClient(bridge.uri).connect()
        assert c.read(0, 4096) == data[:4096]
        time.sleep(0.2)  # parked
        c.sock.close()
    time.sleep(0.3)
    with NBDClient(bridge.uri).connect() as a, NBDClient(bridge.uri).connect() as b:
        assert a.read(0, 4096) == data[:4096]
        assert b.read(4096, 4096) == data[4096:8192]
    assert "refusing connection" not in bridge.stderr()
    wait_until("threads to go back", lambda: threads_of(pid) <= before + 2)


def test_idle_timeout_closes_idle_connections_only(ws):
    """(b) --idle-timeout 2: an idle connection is closed after about 2 s, one with a request
    every 0.5 s stays."""
    bridge, data = serve_filled(ws, "--idle-timeout", 2)
    idle = NBDClient(bridge.uri).connect()
    busy = NBDClient(bridge.uri).connect()
    try:
        t0 = time.monotonic()
        closed_at = None
        while time.monotonic() - t0 < 4.0:
            assert busy.read(0, 4096) == data[:4096]
            if closed_at is None and idle.is_closed_by_peer(timeout=0.5):
                closed_at = time.monotonic() - t0
        assert closed_at is not None, "the idle connection was not closed"
        assert 1.5 <= closed_at <= 3.5, f"closed after {closed_at:.2f} s"
        assert busy.read(4096, 4096) == data[4096:8192]
        assert "--idle-timeout" in bridge.stderr()
    finally:
        idle.close()
        busy.close()


def test_idle_timeout_on_a_remote_backing(ws, upstreams):  # noqa: F811 (the upstreams fixture)
    """(b) the same where each client has its own upstream connection (the session loop, which
    parks with its session kept)."""
    up = upstreams("nbdkit-memory", size=16 * MiB)
    key_file, _ = ws.key(64)
    bridge = serve_remote(ws, up.uri, key_file, extra=("--idle-timeout", "1"))
    with NBDClient(bridge.uri).connect() as idle, NBDClient(bridge.uri).connect() as busy:
        data = os.urandom(4096)
        busy.write(0, data)
        t0 = time.monotonic()
        closed_at = None
        while time.monotonic() - t0 < 3.0:
            assert busy.read(0, 4096) == data
            if closed_at is None and idle.is_closed_by_peer(timeout=0.25):
                closed_at = time.monotonic() - t0
        assert closed_at is not None and 0.7 <= closed_at <= 2.5, closed_at


def test_idle_connections_with_own_upstream_connections_hold_no_threads(ws, upstreams):  # noqa: F811
    """(a) on a remote back end each client has an upstream connection of its own (the session
    loop): 200 idle clients add under 16 threads, keep their sessions while parked, and wake to
    serve; a new client is served within 100 ms."""
    n = 200
    raise_nofile(4 * n + 512)
    up = upstreams("nbdkit-memory", size=16 * MiB)
    key_file, _ = ws.key(64)
    bridge = serve_remote(ws, up.uri, key_file)
    data = os.urandom(64 * 1024)
    with NBDClient(bridge.uri).connect() as c:
        c.write(0, data)
    pid = bridge.proc.pid
    time.sleep(0.3)
    before = threads_of(pid)
    socks = raw_go_many(bridge.uri, n, timeout=60.0)
    try:
        new_client_beside_idle(bridge, data, before, f"{n} idle clients with own upstream connections")
        for i, s in enumerate(socks[:: n // 8]):
            c = wrap(s, bridge.uri)
            assert c.read(4096, 4096) == data[4096:8192]
            new = os.urandom(4096)
            c.write(MiB + 4096 * i, new)
            time.sleep(PARKED)  # parks again between the two
            assert c.read(MiB + 4096 * i, 4096) == new
    finally:
        for s in socks:
            s.close()
    wait_until("the idle connections' threads to go", lambda: threads_of(pid) < before + 16)
    assert bridge.alive
    assert "no upstream connection of its own" not in bridge.stderr()


def test_no_idle_timeout_by_default(ws):
    bridge, data = serve_filled(ws)
    with NBDClient(bridge.uri).connect() as c:
        time.sleep(2.5)
        assert c.read(0, 4096) == data[:4096]
