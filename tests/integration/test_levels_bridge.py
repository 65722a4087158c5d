"""FAST and XTS through the bridge at every CPU level (`CRYPTBRIDGE_CPU`), checked on every sector
against independent implementations: the Python FAST reference (tests/reference/fast.py) and
AES-XTS from Python `cryptography`.

`cryptbridge serve` enciphers a client's write in runs of whole sectors (the multi-unit call), so
4096-byte FAST-BRW sectors take the pipelined path of level `aesni` and up, and XTS at `portable`
its multi-unit path, which the `cipher` vector command (one unit per call) never reaches. The test
ids name the level; a level this CPU lacks is skipped with the reason.
"""
from __future__ import annotations

import functools
import os

import pytest

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

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


def write_through_bridge(ws, monkeypatch, level, cipher, klen, sector_size):
    """Serves a fresh backing file with `cipher` at `level`, writes random data through NBD and
    reads it back; returns (key, plaintext, backing bytes)."""
    if level not in supported_levels():
        pytest.skip(f"this CPU lacks level {level} (supports {', '.join(supported_levels())})")
    monkeypatch.setenv("CRYPTBRIDGE_CPU", level)
    kf, key = ws.key(klen)
    backing = ws.backing(SIZE)
    b = ws.serve(backing, kf, cipher=cipher, key_size=8 * klen, sector_size=sector_size)
    plaintext = os.urandom(SIZE)
    with NBDClient(b.uri) as c:
        c.connect()
        c.write(0, plaintext)
        c.flush()
        assert c.read(0, SIZE) == plaintext, f"{level}: data read back differs"
    return key, plaintext, backing.read_bytes()


def differing_sectors(encrypt, plaintext, disk, sector_size):
    bad = []
    for s in range(SIZE // sector_size):
        a = s * sector_size
        tweak = (s * sector_size // 512).to_bytes(16, "little")
        if encrypt(tweak, plaintext[a : a + sector_size]) != disk[a : a + sector_size]:
            bad.append(s)
    return bad


@pytest.mark.parametrize("sector_size", [512, 4096])
@pytest.mark.parametrize("variant", ["brw", "horner"])
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_fast_backing_bytes_match_python_reference(ws, monkeypatch, level, variant, sector_size):
    key, plaintext, disk = write_through_bridge(ws, monkeypatch, level, f"fast-{variant}(aes)", 32, sector_size)
    bad = differing_sectors(lambda t, d: fast.encrypt(key, t, d, variant), plaintext, disk, sector_size)
    assert not bad, f"{level}: {len(bad)} of {SIZE // sector_size} sectors differ from the Python reference, e.g. {bad[:8]}"


@pytest.mark.parametrize("sector_size", [512, 4096])
@pytest.mark.parametrize("klen", [32, 64])
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_xts_backing_bytes_match_cryptography(ws, monkeypatch, level, klen, sector_size):
    key, plaintext, disk = write_through_bridge(ws, monkeypatch, level, "aes-xts-plain64", klen, sector_size)

    def encrypt(tweak, data):
        e = Cipher(algorithms.AES(key), modes.XTS(tweak)).encryptor()
        return e.update(data) + e.finalize()

    bad = differing_sectors(encrypt, plaintext, disk, sector_size)
    assert not bad, f"{level}: {len(bad)} of {SIZE // sector_size} sectors differ from cryptography's AES-XTS, e.g. {bad[:8]}"
