"""TCP connections from this host (the loopback): the bridge takes them off a pacing congestion
control (BBR), and large reads over them, as fio and nbdcopy make them, return the right bytes
(docs/bench/2026-11-26-tcp-read.md)."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import need_tool, run
from nbd_client import NBDClient
from reference import xts_ref

MiB = 1 << 20
KNOWN_CC = ("bbr", "cubic", "reno", "dctcp", "vegas", "westwood", "htcp", "bic", "illinois")


def system_congestion_control() -> str:
    try:
        return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError as e:
        pytest.skip(f"cannot read the system's TCP congestion control ({e})")


def socket_cc(filter_expr: str) -> list[str]:
    """The congestion control of each established TCP socket that `ss` matches."""
    p = run(["ss", "-tinH", "state", "established", filter_expr], timeout=20, check=True)
    found = []
    for line in p.stdout.decode(errors="replace").splitlines():
        for tok in line.split():
            if tok in KNOWN_CC:
                found.append(tok)
    return found


def port_of(uri: str) -> int:
    m = re.fullmatch(r"nbd://127\.0\.0\.1:(\d+)/?.*", uri)
    assert m, uri
    return int(m.group(1))


def test_same_host_connection_leaves_bbr_and_the_client_keeps_it(ws):
    """Under BBR (the system default here) the bridge's end of a loopback connection runs cubic
    or reno; the client's end of the same connection keeps BBR, which shows that the system
    default is in force and that the switch is the bridge's own."""
    default = system_congestion_control()
    if not default.startswith("bbr"):
        pytest.skip(f"the system's TCP congestion control is {default}, not BBR: the bridge leaves it alone")
    need_tool("ss")
    b = ws.serve(ws.backing(4 * MiB), passthrough=True, tcp=True)
    port = port_of(b.uri)
    with NBDClient(b.uri) as c:
        c.connect()
        assert c.read(0, MiB) == bytes(MiB)
        server_side = socket_cc(f"( sport = :{port} )")
        client_side = socket_cc(f"( dport = :{port} )")
    assert len(server_side) == 1 and len(client_side) == 1, (server_side, client_side)
    assert server_side[0] in ("cubic", "reno"), f"the bridge's socket still runs {server_side[0]}"
    assert client_side[0] == default, f"the client's socket runs {client_side[0]}, not the system's {default}"


def test_large_reads_over_loopback_tcp_return_the_file(ws):
    """SEQ1M-style reads (1 MiB, eight in flight) over TCP, by fio with verification of what a
    first fio job wrote, and by nbdcopy against the backing file's own bytes."""
    need_tool("nbdcopy", "fio")
    size = 48 * MiB
    backing = ws.tmp / "plain.img"
    backing.write_bytes(os.urandom(size))
    b = ws.serve(backing, passthrough=True, tcp=True)
    out = ws.tmp / "copy.img"
    run(["nbdcopy", "--requests=8", "--request-size=1048576", b.uri, out], timeout=120, check=True)
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(backing.read_bytes()).digest()
    # fio writes 1 MiB blocks with checksums through the bridge, then reads and checks them.
    common = ["fio", "--name=seq", "--ioengine=nbd", f"--uri={b.uri}", "--bs=1M", "--iodepth=8", "--size=32M",
              "--verify=crc32c", "--verify_fatal=1", "--do_verify=1"]  # fmt: skip
    p = run([*common, "--rw=write"], timeout=180, cwd=ws.tmp)
    if p.returncode != 0 and b"ioengine" in p.stderr and b"nbd" in p.stderr:
        pytest.skip("fio without the nbd ioengine")
    assert p.returncode == 0, p.stdout.decode(errors="replace")[-3000:] + p.stderr.decode(errors="replace")[-3000:]
    p = run([*common, "--rw=read"], timeout=180, cwd=ws.tmp)
    assert p.returncode == 0, p.stdout.decode(errors="replace")[-3000:] + p.stderr.decode(errors="replace")[-3000:]


def test_encrypted_large_reads_over_loopback_tcp(ws):
    """An XTS export over loopback TCP: what the reference encrypted reads back whole through
    nbdcopy, and what nbdcopy writes lands on disk as the reference encrypts it."""
    need_tool("nbdcopy")
    kf, key = ws.key(64)
    size = 24 * MiB
    pt = os.urandom(size)
    backing = ws.tmp / "xts.img"
    backing.write_bytes(xts_ref.encrypt_sectors(key, pt, 4096, 0, False))
    b = ws.serve(backing, kf, key_size=512, sector_size=4096, tcp=True)
    out = ws.tmp / "out.img"
    run(["nbdcopy", "--requests=8", "--request-size=1048576", b.uri, out], timeout=120, check=True)
    assert out.read_bytes() == pt
    pt2 = os.urandom(size)
    src = ws.tmp / "src.img"
    src.write_bytes(pt2)
    run(["nbdcopy", "--flush", "--requests=8", "--request-size=1048576", src, b.uri], timeout=120, check=True)
    assert backing.read_bytes() == xts_ref.encrypt_sectors(key, pt2, 4096, 0, False)


def test_unprivileged_bridge_falls_back_to_reno(tmp_path):
    """Without CAP_NET_ADMIN a process may only pick a congestion control the system allows
    (net.ipv4.tcp_allowed_congestion_control, which always holds reno): the bridge, run as
    nobody, must still leave BBR, for reno when cubic is not allowed."""
    import shutil
    import tempfile
    import time

    from conftest import require_binary

    default = system_congestion_control()
    if not default.startswith("bbr"):
        pytest.skip(f"the system's TCP congestion control is {default}, not BBR: the bridge leaves it alone")
    if os.geteuid() != 0:
        pytest.skip("needs root to start the bridge as another, unprivileged user")
    need_tool("ss", "setpriv")
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    want = "cubic" if "cubic" in allowed else "reno"
    binary = require_binary()
    d = Path(tempfile.mkdtemp(prefix="cbnobody", dir="/tmp"))
    try:
        d.chmod(0o777)
        backing = d / "b.img"
        backing.write_bytes(bytes(MiB))
        backing.chmod(0o666)
        out = d / "stdout"
        with open(out, "wb") as o:
            proc = subprocess.Popen(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                 str(binary), "serve", "--backing", str(backing), "--passthrough", "--listen", "127.0.0.1:0"],
                stdout=o, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + 20
            while "\n" not in out.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, "the bridge exited as nobody (cannot read its binary or backing?)"
                time.sleep(0.01)
            port = port_of(out.read_text().split("\n", 1)[0].split()[1])
            with NBDClient(f"nbd://127.0.0.1:{port}/") as c:
                c.connect()
                assert c.read(0, 4096) == bytes(4096)
                server_side = socket_cc(f"( sport = :{port} )")
            assert server_side == [want], f"as nobody the bridge's socket runs {server_side}, expected {want} (allowed: {allowed})"
        finally:
            proc.terminate()
            proc.wait(timeout=15)
    finally:
        shutil.rmtree(d, ignore_errors=True)
