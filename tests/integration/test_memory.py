"""Memory of `cryptbridge serve` bounded by its configuration (docs/cli.md, "Memory"): clients that
pipeline 32 MiB READs and never read the replies, the memory given back after a load, and the
default limits under a 256 MiB memory cgroup (file and remote back ends).

Figures (RSS from /proc/PID/status) are printed (pytest -s).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

import nbd_client as nbd
from conftest import need_tool
from nbd_client import NBDClient

MiB = 1 << 20
GiB = 1 << 30
BIG = 32 * MiB  # the largest READ the protocol allows


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise AssertionError(f"no VmRSS for {pid}")


def never_reading(uri: str, n: int, depth: int = 32, size: int = GiB) -> list[NBDClient]:
    """`n` clients that each send `depth` pipelined 32 MiB READs and never read a reply."""
    clients = []
    for k in range(n):
        c = NBDClient(uri).connect()
        wire = b"".join(c.pack_request(nbd.CMD_READ, ((k + i) * BIG) % size, BIG)[1] for i in range(depth))
        c.sendall(wire)
        clients.append(c)
    return clients


def watch_rss(pid: int, seconds: float) -> int:
    """The highest RSS (MiB) seen over `seconds`."""
    peak = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            peak = max(peak, rss_mib(pid))
        except FileNotFoundError:
            break
        time.sleep(0.05)
    return peak


def honest_read(uri: str, timeout: float = 30.0) -> float:
    """Seconds a new client takes to connect and read 4 KiB."""
    t0 = time.monotonic()
    with NBDClient(uri, timeout=timeout).connect() as c:
        assert len(c.read(0, 4096)) == 4096
    return time.monotonic() - t0


def close_all(clients: list[NBDClient]) -> None:
    for c in clients:
        c.close()


def drain_replies(c: NBDClient, count: int, scratch: memoryview) -> None:
    """Reads `count` simple replies, throwing the data away (faster than NBDClient.recv_reply)."""
    for _ in range(count):
        magic, error, handle = struct.unpack(">IIQ", c.recv_exact(16))
        assert magic == nbd.SIMPLE_REPLY_MAGIC and error == 0, (hex(magic), error)
        want = c._pending.pop(handle)
        while want:
            got = c.sock.recv_into(scratch[: min(want, len(scratch))])
            assert got, "server closed the connection"
            want -= got


@pytest.fixture
def volume(ws):
    """A 1 GiB encrypted file-backed export, served with default limits unless `extra` says."""

    def make(*extra):
        key_file, _ = ws.key(64)
        return ws.serve(ws.backing(GiB), key_file, extra=tuple(str(e) for e in extra))

    return make


def test_never_reading_clients_stay_under_512_mib(volume, ws):
    """Eight clients with 32 pipelined 32 MiB READs each, never reading: with the default limits
    the server stays under 512 MiB RSS, and an honest client's 4 KiB read is answered."""
    bridge = volume()
    pid = bridge.proc.pid
    hogs = never_reading(bridge.uri, 8)
    try:
        peak = watch_rss(pid, 3.0)
        took = honest_read(bridge.uri)
        peak = max(peak, rss_mib(pid))
        print(f"\n8 never-reading clients: peak RSS {peak} MiB; honest 4 KiB read in {took * 1000:.1f} ms")
        assert bridge.alive, bridge.stderr()[-3000:]
        assert peak < 512, f"RSS {peak} MiB"
        assert took < 10, f"honest read took {took:.1f} s"
    finally:
        close_all(hogs)
    assert bridge.alive
    print(nbdkit_rss_figure(ws, 1))


def test_memory_returns_after_a_load(volume):
    """A 1 GiB load (writes, then 32 MiB READs pipelined over four clients that read them), then
    idle: RSS back under 128 MiB within 10 s."""
    bridge = volume()
    pid = bridge.proc.pid
    chunk = os.urandom(4 * MiB)
    scratch = memoryview(bytearray(BIG))
    clients = [NBDClient(bridge.uri).connect() for _ in range(4)]
    sampled = [0]
    loading = threading.Event()
    loading.set()

    def sample():
        while loading.is_set():
            sampled[0] = max(sampled[0], rss_mib(pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for i, c in enumerate(clients):  # 256 MiB written in 4 MiB WRITEs
            for j in range(0, 64, 16):
                for k in range(16):
                    c.send_request(nbd.CMD_WRITE, (i * 64 + j + k) * 4 * MiB, len(chunk), chunk)
                drain_replies(c, 16, scratch)
        for _ in range(4):  # 1 GiB read in 32 MiB READs, 8 in flight per client
            for i, c in enumerate(clients):
                for k in range(8):
                    c.send_request(nbd.CMD_READ, ((i * 8 + k) * BIG) % GiB, BIG)
            for c in clients:
                drain_replies(c, 8, scratch)
    finally:
        loading.clear()
        sampler.join()
        close_all(clients)
    peak = sampled[0]
    t0 = time.monotonic()
    while True:
        rss = rss_mib(pid)
        if rss < 128 or time.monotonic() - t0 > 10:
            break
        time.sleep(0.25)
    idle = time.monotonic() - t0
    print(f"\nafter a 1 GiB load (RSS up to {peak} MiB): {rss} MiB after {idle:.1f} s idle")
    assert rss < 128, f"RSS still {rss} MiB after {idle:.1f} s idle"
    assert honest_read(bridge.uri) < 10
    assert bridge.alive


# --- under a memory cgroup ---------------------------------------------------------------------

LIMIT = 256 * MiB


class MemCgroup:
    """A child memory cgroup of this process's own with a limit (v1 or v2), into which a
    process is started with `preexec`."""

    def __init__(self, path: Path, v2: bool):
        self.path, self.v2 = path, v2

    def preexec(self) -> None:
        # Runs in the forked child before exec: the server starts inside the cgroup, so its
        # default limits are sized from it.
        with open(self.path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def oom_kills(self) -> int:
        name = "memory.events" if self.v2 else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        # Only a server this test started can be in the cgroup; one left by a failed test is
        # killed so that the cgroup can go.
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def own_cgroup(controller_line: str) -> Optional[str]:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller_line == "" and controllers == "":
                return path
            if controller_line and controller_line in controllers.split(","):
                return path
    return None


def make_memcg(tag: str) -> tuple[Optional[MemCgroup], str]:
    """A fresh memory cgroup limited to LIMIT, or None and why it cannot be had."""
    if os.geteuid() != 0:
        return None, "needs root to create a memory cgroup"
    v1 = Path("/sys/fs/cgroup/memory")
    own = own_cgroup("memory")
    if own is not None and (v1 / "cgroup.procs").exists():
        d = v1 / own.lstrip("/") / tag
        if not d.parent.is_dir():  # a cgroup namespace: our own cgroup is the mount's root
            d = v1 / tag
        try:
            d.mkdir()
            (d / "memory.limit_in_bytes").write_text(str(LIMIT))
        except OSError as e:
            return None, f"cannot create the v1 memory cgroup {d}: {e}"
        return MemCgroup(d, v2=False), ""
    own = own_cgroup("")
    v2 = Path("/sys/fs/cgroup")
    if own is not None and (v2 / "cgroup.controllers").exists():
        parent = v2 / own.lstrip("/")
        if not parent.is_dir():
            parent = v2
        if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
            return None, f"the memory controller is not enabled for children of {parent} (cgroup.subtree_control)"
        d = parent / tag
        try:
            d.mkdir()
            (d / "memory.max").write_text(str(LIMIT))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
        except OSError as e:
            return None, f"cannot create the v2 memory cgroup {d}: {e}"
        return MemCgroup(d, v2=True), ""
    return None, "no memory cgroup controller mounted (v1 /sys/fs/cgroup/memory or v2 /sys/fs/cgroup)"


@pytest.fixture
def memcg():
    """Set up before `ws` in the tests, so torn down after it has stopped the servers."""
    cg, why = make_memcg(f"cryptbridge-mem-{os.getpid()}-{time.monotonic_ns()}")
    if cg is None:
        pytest.skip(why)
    try:
        yield cg
    finally:
        cg.remove()


def serve_in(cg: MemCgroup, ws, monkeypatch, backing, key_file):
    """`ws.serve`, the server started inside `cg` with default limits."""
    real = subprocess.Popen

    def popen(*a, **kw):
        return real(*a, preexec_fn=cg.preexec, **kw)

    with monkeypatch.context() as m:
        m.setattr(subprocess, "Popen", popen)
        return ws.serve(backing, key_file)


def survive(cg: MemCgroup, bridge, clients: int) -> None:
    pid = bridge.proc.pid
    assert "in-flight budget 64 MiB" in bridge.stderr(), bridge.stderr()[-3000:]
    hogs = never_reading(bridge.uri, clients)
    try:
        peak = watch_rss(pid, 3.0)
        took = honest_read(bridge.uri)
        print(f"\n{clients} never-reading clients in a {LIMIT // MiB} MiB cgroup: peak RSS {peak} MiB, honest read {took * 1000:.1f} ms")
    finally:
        close_all(hogs)
    assert bridge.alive, f"server gone (OOM kills in the cgroup: {cg.oom_kills()}):\n{bridge.stderr()[-3000:]}"
    assert cg.oom_kills() == 0
    assert honest_read(bridge.uri) < 10
    bridge.stop()


def test_default_limits_fit_a_256_mib_cgroup_file(memcg, ws, monkeypatch):
    """Eight never-reading clients against a file back end, the server in a 256 MiB memory
    cgroup with the default limits: it is not OOM-killed and still serves."""
    key_file, _ = ws.key(64)
    bridge = serve_in(memcg, ws, monkeypatch, ws.backing(GiB), key_file)
    survive(memcg, bridge, 8)


def test_default_limits_fit_a_256_mib_cgroup_remote(memcg, ws, monkeypatch):
    """Four never-reading clients against an `nbdkit memory` upstream, the server in a 256 MiB
    memory cgroup with the default limits: it is not OOM-killed and still serves."""
    need_tool("nbdkit")
    sock = ws.sockdir / "up.sock"
    up = start_nbdkit_memory(sock)
    bridge = None
    try:
        key_file, _ = ws.key(64)
        bridge = serve_in(memcg, ws, monkeypatch, f"nbd+unix:///?socket={sock}", key_file)
        survive(memcg, bridge, 4)
    finally:
        if bridge is not None:
            bridge.stop()  # nbdkit waits for its connections before it exits
        stop(up)


def start_nbdkit_memory(sock: Path) -> subprocess.Popen:
    """`nbdkit memory 1G` on a Unix socket, once it accepts."""
    up = subprocess.Popen(["nbdkit", "-f", "--exit-with-parent", "-U", str(sock), "memory", "1G"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(sock))
            s.close()
            return up
        except OSError:
            if up.poll() is not None or time.monotonic() > deadline:
                stop(up)
                pytest.fail("nbdkit did not start")
            time.sleep(0.02)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


def nbdkit_rss_figure(ws, clients: int) -> str:
    """nbdkit's figure beside ours (issue 27, D7): its peak RSS with `clients` never-reading
    clients (fewer than ours: each of its 16 threads per connection holds a 32 MiB buffer)."""
    if not shutil.which("nbdkit"):
        return "nbdkit: not installed"
    up = start_nbdkit_memory(ws.sockdir / "nbdkit-rss.sock")
    try:
        hogs = never_reading(f"nbd+unix:///?socket={ws.sockdir / 'nbdkit-rss.sock'}", clients)
        try:
            return f"nbdkit memory, {clients} such client(s): peak RSS {watch_rss(up.pid, 2.0)} MiB"
        finally:
            close_all(hogs)
    finally:
        stop(up)
