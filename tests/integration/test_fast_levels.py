"""FAST through the bridge at every CPU level (`CRYPTBRIDGE_CPU`), checked on every sector against
the independent Python reference (tests/reference/fast.py).

`cryptbridge serve` enciphers a client's write in runs of whole sectors (the multi-unit call), so
4096-byte FAST-BRW sectors take the pipelined path of level `aesni` and up, which the `cipher`
vector command (one unit per call) never reaches. The test ids name the level; a level this CPU
lacks is skipped with the reason.
"""
from __future__ import annotations

import functools
import os

import pytest

from conftest import cb
from nbd_client import NBDClient
from reference import fast

ALL_LEVELS = ["portable", "aesni", "vaes256", "vaes512"]
SIZE = 128 * 1024


@functools.cache
def supported_levels() -> tuple[str, ...]:
    p = cb("--version", check=True)
    out = p.stdout.decode()
    # "... CPU level vaes512 detected; available: portable, aesni, vaes256, vaes512; ..."
    avail = out.split("available:", 1)[1].split(";", 1)[0]
    return tuple(x.strip().rstrip(")") for x in avail.split(","))


@pytest.mark.parametrize("sector_size", [512, 4096])
@pytest.mark.parametrize("variant", ["brw", "horner"])
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_fast_backing_bytes_match_python_reference(ws, monkeypatch, level, variant, sector_size):
    if level not in supported_levels():
        pytest.skip(f"this CPU lacks level {level} (supports {', '.join(supported_levels())})")
    monkeypatch.setenv("CRYPTBRIDGE_CPU", level)
    kf, key = ws.key(32)
    backing = ws.backing(SIZE)
    b = ws.serve(backing, kf, cipher=f"fast-{variant}(aes)", key_size=256, sector_size=sector_size)
    plaintext = os.urandom(SIZE)
    with NBDClient(b.uri) as c:
        c.connect()
        c.write(0, plaintext)
        c.flush()
        assert c.read(0, SIZE) == plaintext, f"{level}: data read back differs"
    disk = backing.read_bytes()
    bad = []
    for s in range(SIZE // sector_size):
        a = s * sector_size
        tweak = (s * sector_size // 512).to_bytes(16, "little")
        if fast.encrypt(key, tweak, plaintext[a : a + sector_size], variant) != disk[a : a + sector_size]:
            bad.append(s)
    assert not bad, f"{level}: {len(bad)} of {SIZE // sector_size} sectors differ from the Python reference, e.g. {bad[:8]}"
