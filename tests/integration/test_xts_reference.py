"""Self-test of the Python XTS reference (tests/reference/xts_ref.py) against the public vectors.

This does not involve cryptbridge: it establishes that the reference the other tests rely on is
right, including ciphertext stealing and XTS-AES-192 (which OpenSSL lacks).
"""
import os
import random

import pytest

from conftest import VECTORS
from reference import xts_ref
import vectors

ALL = vectors.all_xts(VECTORS) if (VECTORS / "xts").is_dir() else []


def test_vectors_present():
    assert ALL, f"no XTS vectors under {VECTORS}"
    assert any(len(v.pt) % 16 for v in ALL), "expected ciphertext-stealing vectors"


@pytest.mark.parametrize("v", ALL, ids=lambda v: v.name)
def test_reference_matches_vectors(v):
    assert xts_ref.xts_encrypt_ecb(v.key, v.tweak, v.pt) == v.ct
    assert xts_ref.xts_decrypt_ecb(v.key, v.tweak, v.ct) == v.pt
    if xts_ref._openssl_ok(v.key):
        assert xts_ref.xts_encrypt(v.key, v.tweak, v.pt) == v.ct
        assert xts_ref.xts_decrypt(v.key, v.tweak, v.ct) == v.pt


def test_two_references_agree_random():
    rng = random.Random(1619)
    for _ in range(300):
        key = os.urandom(rng.choice([32, 64]))
        data = os.urandom(rng.randint(16, 1100))
        tweak = rng.getrandbits(128)
        ct = xts_ref.xts_encrypt(key, tweak, data)
        assert xts_ref.xts_encrypt_ecb(key, tweak, data) == ct
        assert xts_ref.xts_decrypt_ecb(key, tweak, ct) == data


def test_plain64_tweak_layout():
    # dm-crypt plain64: little-endian sector number, zero-padded to 16 bytes
    assert xts_ref.tweak_bytes(1) == b"\x01" + bytes(15)
    assert xts_ref.tweak_bytes(0x0102) == b"\x02\x01" + bytes(14)
    assert xts_ref.sector_tweak(3, 4096) == 24
    assert xts_ref.sector_tweak(3, 4096, iv_large_sectors=True) == 3
    assert xts_ref.sector_tweak(3, 512) == 3
