"""An upstream NBD export as the backing store (`serve --backing nbd://...`, `nbd+unix://...`).

Real upstreams (nbdkit memory / file, qemu-nbd -f raw) over a Unix socket and over TCP; real
clients (nbdcopy, nbdinfo, qemu-img) in front. What the upstream holds is read back from it
directly (nbdcopy from the upstream, or its backing file) and checked against the independent
AES-XTS reference (tests/reference/xts_ref.py, on pyca `cryptography`).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import MiB, assert_no_panic, cb, need_tool, run
from nbd_client import CMD_FLAG_FUA, NBD_EIO, NBD_ENOSPC, NBD_EPERM, NBDClient, NBDError
from reference import xts_ref


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Upstream:
    """An NBD server the bridge connects to: nbdkit or qemu-nbd, on a Unix socket or TCP."""

    def __init__(self, ws, kind: str, *, tcp: bool = False, size: int = 64 * MiB, extra: tuple = (), plugin_args: tuple = (), name: str = "up"):
        self.ws = ws
        self.kind = kind
        self.tcp = tcp
        self.size = size
        self.extra = list(extra)
        self.plugin_args = list(plugin_args)
        self.name = name
        self.file: Optional[Path] = None
        self.proc: Optional[subprocess.Popen] = None
        self.sock = ws.sockdir / f"{name}.sock"
        self.port = free_port() if tcp else None
        self.log = ws.tmp / f"{name}.stderr"
        if kind in ("nbdkit-file", "qemu-nbd"):
            self.file = ws.tmp / f"{name}.img"
            if not self.file.exists():
                with open(self.file, "wb") as f:
                    f.truncate(size)

    @property
    def uri(self) -> str:
        if self.tcp:
            return f"nbd://127.0.0.1:{self.port}"
        return f"nbd+unix:///?socket={self.sock}"

    def command(self) -> list:
        if self.kind.startswith("nbdkit"):
            need_tool("nbdkit")
            cmd = ["nbdkit", "-f", "--exit-with-parent"]
            cmd += ["-i", "127.0.0.1", "-p", str(self.port)] if self.tcp else ["-U", str(self.sock)]
            cmd += self.extra
            if self.kind == "nbdkit-memory":
                cmd += ["memory", str(self.size)]
            else:
                cmd += ["file", str(self.file)]
            return cmd + self.plugin_args
        need_tool("qemu-nbd")
        cmd = ["qemu-nbd", "-f", "raw", "-t", "-e", "16", "--cache=writeback"]
        cmd += ["-b", "127.0.0.1", "-p", str(self.port)] if self.tcp else ["-k", str(self.sock)]
        return cmd + self.extra + [str(self.file)]

    def start(self) -> "Upstream":
        if not self.tcp and self.sock.exists():
            self.sock.unlink()
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}: {self.log.read_text(errors='replace')[-2000:]}")
            try:
                if self.tcp:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                else:
                    s = socket.socket(socket.AF_UNIX)
                    s.connect(str(self.sock))
                    s.close()
                return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"{self.kind} not listening after 20 s")

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)

    def read_all(self) -> bytes:
        """The upstream's whole content, read from it directly (not through the bridge)."""
        if self.file is not None:
            return self.file.read_bytes()
        out = self.ws.tmp / f"{self.name}.dump"
        run(["nbdcopy", self.uri, out], timeout=120, check=True)
        return out.read_bytes()


@pytest.fixture
def upstreams(ws):
    started: list[Upstream] = []

    def make(kind: str, **kw) -> Upstream:
        u = Upstream(ws, kind, **kw)
        started.append(u)
        return u.start()

    yield make
    for u in started:
        u.stop()


def serve_remote(ws, upstream_uri: str, key_file, *, sector_size: Optional[int] = None, extra: tuple = ()):
    # The backing "file" is the URI: Workspace.serve passes it to --backing as is.
    return ws.serve(upstream_uri, key_file, sector_size=sector_size, extra=extra)


def check_ciphertext(upstream: Upstream, key: bytes, plaintext: bytes, sector_size: int, offset: int = 0) -> None:
    """The upstream holds exactly the XTS encryption of `plaintext` at `offset` (plain64 IVs)."""
    data = upstream.read_all()
    ct = data[offset : offset + len(plaintext)]
    want = xts_ref.encrypt_sectors(key, plaintext, sector_size, offset // sector_size)
    assert ct != plaintext[: len(ct)], "upstream holds plaintext"
    if ct != want:
        bad = next(i for i in range(0, len(want), sector_size) if ct[i : i + sector_size] != want[i : i + sector_size])
        pytest.fail(f"upstream ciphertext differs from the reference from byte {offset + bad}")


# One upstream of each kind and transport.
KINDS = [
    ("nbdkit-memory", False),
    ("nbdkit-memory", True),
    ("nbdkit-file", False),
    ("qemu-nbd", False),
    ("qemu-nbd", True),
]


@pytest.mark.parametrize("kind,tcp", KINDS, ids=[f"{k}-{'tcp' if t else 'unix'}" for k, t in KINDS])
def test_nbdcopy_round_trip_and_upstream_ciphertext(ws, upstreams, kind, tcp):
    need_tool("nbdcopy", "nbdinfo")
    up = upstreams(kind, tcp=tcp)
    key_file, key = ws.key()
    b = serve_remote(ws, up.uri, key_file)
    info = run(["nbdinfo", "--json", b.uri], timeout=30, check=True).stdout.decode()
    assert re.search(r'"export-size":\s*%d' % up.size, info), info
    plaintext = os.urandom(6 * MiB + 4096)
    src = ws.tmp / "src.bin"
    src.write_bytes(plaintext)
    run(["nbdcopy", "--flush", src, b.uri], timeout=120, check=True)
    check_ciphertext(up, key, plaintext, 512)
    back = ws.tmp / "back.bin"
    run(["nbdcopy", b.uri, back], timeout=120, check=True)
    assert back.read_bytes()[: len(plaintext)] == plaintext
    b.stop()
    assert_no_panic(b.stderr())


def test_sector_size_4096_and_partial_writes(ws, upstreams):
    """Partial-sector writes at odd offsets go through read-modify-write over the network."""
    up = upstreams("nbdkit-memory", size=16 * MiB)
    key_file, key = ws.key()
    b = serve_remote(ws, up.uri, key_file, sector_size=4096)
    model = bytearray(xts_ref.decrypt_sectors(key, bytes(1 * MiB), 4096))
    rng = __import__("random").Random(18)
    with NBDClient(b.uri) as c:
        c.connect()
        for _ in range(60):
            off = rng.randrange(0, 1 * MiB - 20000)
            data = os.urandom(rng.randrange(1, 20000))
            c.write(off, data, fua=rng.random() < 0.2)
            model[off : off + len(data)] = data
        c.flush()
        assert c.read(0, 1 * MiB) == bytes(model)
    check_ciphertext(up, key, bytes(model), 4096)
