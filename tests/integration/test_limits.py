"""Resource limits of `cryptbridge serve`: threads that do not grow with idle connections,
--max-connections, bounded memory under clients that never read their replies, and a thread that
cannot be started costing one connection rather than the server.

Figures (threads, RSS) are read from /proc/PID/status of the server and printed (pytest -s).
"""
from __future__ import annotations

import itertools
import os
import resource
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

import nbd_client as nbd
from nbd_client import NBDClient

MiB = 1 << 20
GiB = 1 << 30


def proc_status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def threads_of(pid: int) -> int:
    return int(proc_status(pid)["Threads"])


def kib(pid: int, field: str) -> int:
    return int(proc_status(pid)[field].split()[0])


def raise_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need} descriptors needed")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def raw_go_many(uri: str, n: int, timeout: float = 30.0) -> list[socket.socket]:
    """Opens `n` connections and takes each through the fixed newstyle handshake and NBD_OPT_GO
    (sent without waiting for the greeting, all connections in flight at once)."""
    name = b""
    go = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
    hello = struct.pack(">I", nbd.CLIENT_FLAG_FIXED_NEWSTYLE | nbd.CLIENT_FLAG_NO_ZEROES)
    hello += struct.pack(">QII", nbd.IHAVEOPT, nbd.OPT_GO, len(go)) + go
    socks = []
    for _ in range(n):
        s = nbd.connect_socket(uri, timeout)
        s.sendall(hello)
        socks.append(s)

    def recv_exact(s: socket.socket, k: int) -> bytes:
        buf = b""
        while len(buf) < k:
            chunk = s.recv(k - len(buf))
            if not chunk:
                raise ConnectionError(f"closed after {len(buf)} of {k} bytes")
            buf += chunk
        return buf

    for s in socks:
        magic, opt, _flags = struct.unpack(">QQH", recv_exact(s, 18))
        assert (magic, opt) == (nbd.NBDMAGIC, nbd.IHAVEOPT)
        while True:
            magic, option, rtype, length = struct.unpack(">QIII", recv_exact(s, 20))
            assert magic == nbd.OPT_REPLY_MAGIC and option == nbd.OPT_GO
            recv_exact(s, length)
            assert not rtype & nbd.REP_ERR, f"GO refused: {rtype:#x}"
            if rtype == nbd.REP_ACK:
                break
    return socks


def closed_without_greeting(uri: str, timeout: float = 5.0) -> bool:
    """Connects and reports whether the server closes the socket before sending anything."""
    s = nbd.connect_socket(uri, timeout)
    try:
        s.settimeout(timeout)
        try:
            return s.recv(18) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False
    finally:
        s.close()


@pytest.fixture
def vol(ws):
    """An encrypted 64 MiB export with 1 MiB of known data at offset 0."""

    def make(*extra, size=64 * MiB, fill=True):
        key_file, _ = ws.key(64)
        backing = ws.backing(size)
        bridge = ws.serve(backing, key_file, extra=tuple(str(e) for e in extra))
        data = os.urandom(MiB)
        if fill:
            with NBDClient(bridge.uri).connect() as c:
                quick_fill(c, data)
        return bridge, data

    return make


def quick_fill(c: NBDClient, data: bytes) -> None:
    """Writes `data` at offset 0 in 16 KiB requests: quick ones, run on the connection's own
    thread, so no I/O pool thread is needed (no FLUSH either: reads find the page cache)."""
    for off in range(0, len(data), 16384):
        c.write(off, data[off : off + 16384])


@pytest.mark.slow
def test_thousand_idle_connections(vol):
    """(a) 1,000 idle connections past NBD_OPT_GO: the server lives, its threads stay about one
    per connection (under 2,000 in all), and a new client reads 1 MiB correctly within 1 s."""
    n = 1000
    raise_nofile(n + 256)
    bridge, data = vol()
    pid = bridge.proc.pid
    before = threads_of(pid)
    t0 = time.monotonic()
    socks = raw_go_many(bridge.uri, n)
    try:
        opened = time.monotonic() - t0
        assert bridge.alive, bridge.stderr()[-3000:]
        threads = threads_of(pid)
        print(f"\n{n} idle connections opened in {opened:.2f} s; server threads {before} before, {threads} with them")
        assert threads < 2000, f"{threads} threads for {n} idle connections"
        # About one per connection: the connection's reader, and no I/O threads while idle.
        assert threads <= n + before + 16, f"{threads} threads for {n} idle connections ({before} before)"
        t1 = time.monotonic()
        with NBDClient(bridge.uri).connect() as c:
            got = c.read(0, MiB)
        took = time.monotonic() - t1
        print(f"new client: handshake + 1 MiB read in {took * 1000:.1f} ms")
        assert got == data
        assert took < 1.0, f"new client took {took:.2f} s"
        # The idle connections still work.
        for s in socks[:: n // 10]:
            c = wrap(s, bridge.uri)
            assert c.read(4096, 4096) == data[4096:8192]
    finally:
        for s in socks:
            s.close()
    assert bridge.alive


def wrap(sock: socket.socket, uri: str) -> NBDClient:
    """An NBDClient around a socket already in transmission."""
    c = NBDClient.__new__(NBDClient)
    c.uri, c.sock, c.handshake_flags, c.no_zeroes = uri, sock, 0, True
    c.size = c.flags = c.info = None
    c._handles = itertools.count(1)
    c._pending = {}
    c._send_lock = threading.Lock()
    return c


def test_max_connections(vol):
    """(b) --max-connections N: the N+1-th connection is closed before the greeting while the
    first N keep working; a slot freed by a client that leaves is given to the next."""
    n = 4
    bridge, data = vol("--max-connections", n)
    clients = [NBDClient(bridge.uri).connect() for _ in range(n)]
    try:
        assert closed_without_greeting(bridge.uri), "connection over the limit was not closed"
        for i, c in enumerate(clients):
            c.write(MiB + i * 4096, bytes([i + 1]) * 4096)
        for i, c in enumerate(clients):
            j = (i + 1) % n
            assert c.read(MiB + j * 4096, 4096) == bytes([j + 1]) * 4096
            assert c.read(0, 65536) == data[:65536]
        assert "refusing connection" in bridge.stderr() and "--max-connections" in bridge.stderr()
        clients.pop().close()
        deadline = time.monotonic() + 5
        while True:
            try:
                c = NBDClient(bridge.uri, timeout=5).connect()
                break
            except (ConnectionError, OSError, struct.error):
                if time.monotonic() > deadline:
                    pytest.fail("no connection accepted after one of the N left")
                time.sleep(0.05)
        clients.append(c)
        assert c.read(0, 4096) == data[:4096]
    finally:
        for c in clients:
            c.close()
    assert bridge.alive


def test_unread_replies_bound_memory(vol):
    """(c) Three clients each send 32 pipelined 32 MiB READs and never read a reply: the
    server's RSS stays under 1 GiB and another client is served."""
    bridge, data = vol()
    pid = bridge.proc.pid
    greedy = []
    try:
        offsets = {}
        for _ in range(3):
            c = NBDClient(bridge.uri).connect()
            wire = b""
            for i in range(32):
                handle, req = c.pack_request(nbd.CMD_READ, (i % 2) * 32 * MiB, 32 * MiB)
                offsets[handle] = (i % 2) * 32 * MiB
                wire += req
            c.sendall(wire)
            greedy.append(c)
        # Let the server take what it will and settle.
        peak = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            peak = max(peak, kib(pid, "VmRSS"))
            time.sleep(0.1)
        rss, hwm = kib(pid, "VmRSS"), kib(pid, "VmHWM")
        print(f"\nwith 3 x 32 unread 32 MiB READs: VmRSS {rss // 1024} MiB (highest seen {peak // 1024} MiB), VmHWM {hwm // 1024} MiB")
        assert bridge.alive, bridge.stderr()[-3000:]
        assert hwm * 1024 < GiB, f"peak RSS {hwm // 1024} MiB"
        t0 = time.monotonic()
        with NBDClient(bridge.uri).connect() as other:
            assert other.read(0, MiB) == data
            other.write(2 * MiB, data, fua=True)
            assert other.read(2 * MiB, MiB) == data
        print(f"another client served in {(time.monotonic() - t0) * 1000:.0f} ms")
        # The stalled clients still get correct data once they read (replies in completion
        # order: find one for offset 0).
        c = greedy[0]
        for _ in range(4):
            r = c.recv_reply()
            assert r.error == 0 and len(r.data) == 32 * MiB
            if offsets[r.handle] == 0:
                assert r.data[:MiB] == data
                break
        else:
            pytest.fail("no reply for offset 0 among the first four")
    finally:
        for c in greedy:
            c.close()
    # Their permits come back when they leave: a new client's big reads are not stuck.
    with NBDClient(bridge.uri).connect() as c:
        handles = [c.send_request(nbd.CMD_READ, 0, 32 * MiB) for _ in range(4)]
        for _ in handles:
            r = c.recv_reply()
            assert r.error == 0 and r.data[:MiB] == data
    assert bridge.alive


def test_back_pressure_keeps_order_and_data(vol):
    """A reading client far over the per-connection cap: requests wait for earlier replies and
    every reply is right (pipelined writes, FLUSH, then reads of what was written)."""
    bridge, _ = vol("--max-inflight-bytes-per-connection", "4M", "--max-inflight-bytes", "6M", "--io-workers", "3")
    chunks = [os.urandom(2 * MiB) for _ in range(12)]
    with NBDClient(bridge.uri).connect() as c:
        for i, d in enumerate(chunks):
            c.send_request(nbd.CMD_WRITE, 4 * MiB + i * 2 * MiB, len(d), d)
        # The server stops reading at 4 MiB in flight; replies must flow while we still send.
        got = [c.recv_reply() for _ in chunks]
        assert all(r.error == 0 for r in got)
        c.flush()
        handles = {c.send_request(nbd.CMD_READ, 4 * MiB + i * 2 * MiB, 2 * MiB): i for i in range(12)}
        for _ in handles:
            r = c.recv_reply()
            assert r.error == 0
            assert r.data == chunks[handles[r.handle]]
    assert bridge.alive


def pids_cgroup(tag: str):
    """A fresh pids cgroup (v1 hierarchy or v2 with the pids controller) -> (dir, root procs
    file to move processes back), or a reason it cannot be had."""
    if os.geteuid() != 0:
        return None, "needs root to create a pids cgroup (RLIMIT_NPROC does not bind root either)"
    v1 = Path("/sys/fs/cgroup/pids")
    if (v1 / "cgroup.procs").exists():
        d = v1 / tag
        try:
            d.mkdir()
        except OSError as e:
            return None, f"cannot create {d}: {e}"
        return (d, v1 / "cgroup.procs"), None
    v2 = Path("/sys/fs/cgroup")
    if "pids" in (v2 / "cgroup.controllers").read_text(errors="replace") if (v2 / "cgroup.controllers").exists() else False:
        d = v2 / tag
        try:
            d.mkdir()
        except OSError as e:
            return None, f"cannot create {d}: {e}"
        if not (d / "pids.max").exists():
            d.rmdir()
            return None, "the pids controller is not enabled for child cgroups (cgroup.subtree_control)"
        return (d, v2 / "cgroup.procs"), None
    return None, "no pids cgroup controller mounted"


def test_thread_start_failure_drops_one_connection(vol):
    """(d) With no thread to be had (pids cgroup at its limit), a new connection is closed with a
    log line; the server and its other clients go on, slow requests included (the reader keeps
    the read side and runs them itself when no I/O thread can take over)."""
    bridge, data = vol(fill=False)
    pid = bridge.proc.pid
    cg, why = pids_cgroup(f"cryptbridge-test-{os.getpid()}")
    if cg is None:
        pytest.skip(why)
    d, root_procs = cg
    try:
        (d / "cgroup.procs").write_text(str(pid))
        # Only quick requests so far: no I/O pool thread exists when the limit comes.
        existing = NBDClient(bridge.uri).connect()
        quick_fill(existing, data)
        assert existing.read(0, 4096) == data[:4096]
        (d / "pids.max").write_text((d / "pids.current").read_text().strip())
        try:
            assert closed_without_greeting(bridge.uri), "connection without a thread was not closed"
            assert closed_without_greeting(bridge.uri), "a second one neither"
            assert bridge.alive
            # The open connection still works: a quick request, and pipelined 1 MiB reads and a
            # FUA write, each of which would hand the read side to an I/O thread that cannot start.
            assert existing.read(8192, 4096) == data[8192:12288]
            handles = [existing.send_request(nbd.CMD_READ, 0, MiB) for _ in range(8)]
            for _ in handles:
                r = existing.recv_reply()
                assert r.error == 0 and r.data == data
            existing.write(3 * MiB, data[:65536], fua=True)
            assert existing.read(3 * MiB, 65536) == data[:65536]
            err = bridge.stderr()
            assert "cannot start a thread for the connection" in err, err[-3000:]
            assert "cannot start an I/O thread" in err, err[-3000:]
        finally:
            (d / "pids.max").write_text("max")
        with NBDClient(bridge.uri).connect() as c:
            assert c.read(0, MiB) == data
        existing.close()
    finally:
        try:
            root_procs.write_text(str(pid))
        except OSError:
            pass  # the server has exited
        for _ in range(50):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert bridge.alive
