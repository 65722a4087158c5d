"""The hardware core behind the bridge (issue 5, deliverable 3): `cryptbridge serve --engine
rtl-sim` runs the Verilated XTS-AES-256 core (rtl/build/xts_sim) as a co-process.

A real NBD client writes the same data through a bridge on the simulated core and through one on
the CPU engine. The two backing files must be byte-identical, and both must equal pyca
`cryptography`'s AES-XTS of the data (dm-crypt plain64 tweak numbering). Reads through the RTL
bridge must return the data, and at shutdown the bridge must log the simulation speed it reached.
"""
from __future__ import annotations

import random
import re
import signal

import pytest

from conftest import REPO, need_tool, run
from nbd_client import NBDClient
from reference import xts_ref

SIM = REPO / "rtl" / "build" / "xts_sim"
IMAGE = 1 << 20  # the simulator runs at ~15 MB/s, so a small image keeps this test quick


@pytest.fixture(scope="module")
def rtl_sim():
    if not SIM.exists():
        need_tool("verilator", "make")
        r = run(["make", "-C", str(REPO / "rtl"), "sim"], timeout=1200)
        assert r.returncode == 0, f"make -C rtl sim failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    assert SIM.exists()
    return SIM


def write_image(uri: str, data: bytes, rng: random.Random) -> None:
    """Writes `data` in request sizes a real client uses, in a shuffled order, then flushes."""
    with NBDClient(uri) as c:
        c.connect()
        pieces = []
        off = 0
        while off < len(data):
            n = min(rng.choice([4096, 8192, 65536, 131072]), len(data) - off)
            pieces.append((off, n))
            off += n
        rng.shuffle(pieces)
        for off, n in pieces:
            c.write(off, data[off:off + n])
        c.flush()
        c.disconnect()


@pytest.mark.parametrize("sector_size,iv_large", [(512, False), (4096, False), (4096, True)])
def test_rtl_engine_writes_the_bytes_the_cpu_engine_writes(ws, rtl_sim, sector_size, iv_large):
    rng = random.Random(sector_size * 2 + iv_large)
    key_file, key = ws.key(64)
    data = rng.randbytes(IMAGE)
    backings = {}
    for engine in ("rtl-sim", "cpu"):
        backing = ws.backing(IMAGE, name=f"{engine}.img")
        bridge = ws.serve(backing, key_file, sector_size=sector_size, iv_large=iv_large,
                          extra=("--engine", engine))
        write_image(bridge.uri, data, rng)
        if engine == "rtl-sim":
            with NBDClient(bridge.uri) as c:
                c.connect()
                for off in (0, IMAGE // 2 - sector_size, IMAGE - 65536):
                    assert c.read(off, 65536) == data[off:off + 65536], f"read back at {off}"
                c.disconnect()
        assert bridge.stop(signal.SIGTERM) == 0, bridge.stderr()[-2000:]
        if engine == "rtl-sim":
            log = bridge.stderr()
            m = re.search(r"rtl-sim: (\d+) bytes in \d+ requests, (\d+) cycles .*simulation speed "
                          r"([0-9.e+]+) cycles/s, ([0-9.]+) MB/s", log)
            assert m, f"no simulation-speed line in the log:\n{log[-2000:]}"
            assert int(m.group(1)) >= IMAGE and int(m.group(2)) > 0 and float(m.group(3)) > 0
        backings[engine] = backing.read_bytes()

    assert backings["rtl-sim"] == backings["cpu"], "RTL core and CPU engine wrote different bytes"
    # Both against an independent XTS: every sector of the image.
    for s in range(IMAGE // sector_size):
        unit = s if iv_large else s * sector_size // 512
        plain = data[s * sector_size:(s + 1) * sector_size]
        want = xts_ref.xts_encrypt(key, unit, plain)
        assert backings["rtl-sim"][s * sector_size:(s + 1) * sector_size] == want, f"sector {s}"


def test_rtl_engine_refuses_what_the_core_cannot_do(ws, rtl_sim):
    key_file, _ = ws.key(32, name="k256.bin")  # XTS-AES-128: the core is AES-256 only
    backing = ws.backing(IMAGE)
    with pytest.raises(RuntimeError, match="exited with"):
        ws.serve(backing, key_file, key_size=256, extra=("--engine", "rtl-sim"))
    err = ws.bridges[-1].stderr()
    assert "512" in err or "AES-256" in err, err[-2000:]
    assert "panicked" not in err
