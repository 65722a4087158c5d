"""`serve --io-engine uring`: a file served through io_uring, cached and with --direct, moves the
same bytes as the independent XTS reference says, through a real NBD client (nbdcopy); and where
io_uring is refused (kernel.io_uring_disabled=2) the server falls back to the thread path with a
log line and serves the same bytes."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import need_tool, run
from reference import xts_ref

MiB = 1 << 20
SYSCTL = Path("/proc/sys/kernel/io_uring_disabled")


def roundtrip(ws, extra: tuple, size: int = 8 * MiB) -> str:
    """Serves an XTS image with `extra`, reads it whole and writes it whole with nbdcopy, checks
    both against the reference; returns the server's stderr."""
    need_tool("nbdcopy")
    kf, key = ws.key(64)
    pt = os.urandom(size)
    backing = ws.tmp / f"xts{len(ws.bridges)}.img"
    backing.write_bytes(xts_ref.encrypt_sectors(key, pt, 4096, 0, False))
    b = ws.serve(backing, kf, key_size=512, sector_size=4096, extra=extra)
    out = ws.tmp / "out.img"
    run(["nbdcopy", "--requests=8", "--request-size=1048576", b.uri, out], timeout=120, check=True)
    assert out.read_bytes() == pt
    # Small requests too: 4 KiB writes (the quick path) and 1 MiB ones, then a flush.
    pt2 = os.urandom(size)
    src = ws.tmp / "src.img"
    src.write_bytes(pt2)
    run(["nbdcopy", "--flush", "--requests=16", "--request-size=4096", src, b.uri], timeout=120, check=True)
    assert backing.read_bytes() == xts_ref.encrypt_sectors(key, pt2, 4096, 0, False)
    pt3 = os.urandom(size)
    src.write_bytes(pt3)
    run(["nbdcopy", "--flush", "--requests=8", "--request-size=1048576", src, b.uri], timeout=120, check=True)
    run(["nbdcopy", "--requests=8", "--request-size=1048576", b.uri, out], timeout=120, check=True)
    assert out.read_bytes() == pt3
    b.stop()
    assert backing.read_bytes() == xts_ref.encrypt_sectors(key, pt3, 4096, 0, False)
    return b.stderr()


@pytest.mark.parametrize("direct", [False, True], ids=["cached", "direct"])
def test_uring_serves_the_reference_bytes(ws, direct):
    extra = ("--io-engine", "uring") + (("--direct",) if direct else ())
    err = roundtrip(ws, extra)
    if "io_uring unavailable" in err:
        pytest.skip(f"io_uring unavailable on this machine: {err.strip().splitlines()[-1]}")
    assert "through io_uring" in err, err


def test_threads_engine_does_not_touch_io_uring(ws):
    err = roundtrip(ws, ("--io-engine", "threads"), size=2 * MiB)
    assert "io_uring" not in err, err


@pytest.mark.parametrize("engine", ["uring", "auto"])
def test_refused_io_uring_falls_back_to_threads(ws, engine):
    """kernel.io_uring_disabled=2 makes io_uring_setup fail with EPERM for every process: the
    server says so and serves on the thread path. The sysctl is restored afterwards."""
    if not SYSCTL.exists():
        pytest.skip("this kernel has no kernel.io_uring_disabled sysctl")
    before = SYSCTL.read_text().strip()
    try:
        SYSCTL.write_text("2\n")
    except OSError as e:
        pytest.skip(f"cannot set kernel.io_uring_disabled ({e}); needs root outside a locked-down container")
    try:
        err = roundtrip(ws, ("--io-engine", engine), size=2 * MiB)
    finally:
        SYSCTL.write_text(before + "\n")
    assert "io_uring unavailable" in err, err
    assert "on the I/O threads" in err, err
    assert "through io_uring" not in err, err
    if engine == "uring":
        assert "WARN" in err, err


def test_uring_with_an_nbd_backing_is_a_usage_error(ws):
    from conftest import cb

    r = cb("serve", "--backing", "nbd://127.0.0.1:1/x", "--passthrough", "--unix", ws.sockdir / "x.sock", "--io-engine", "uring")
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2, err
    assert "--io-engine uring applies to a file or device" in err
