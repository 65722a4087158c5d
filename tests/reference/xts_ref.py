"""Reference AES-XTS (IEEE 1619 / dm-crypt plain64) for the test suite.

Two independent implementations:

* ``xts_encrypt`` / ``xts_decrypt``: pyca ``cryptography`` (OpenSSL) AES-XTS. OpenSSL supports
  ciphertext stealing but only XTS-AES-128/256 (32/64-byte keys) and refuses equal key halves for
  encryption.
* ``xts_encrypt_ecb`` / ``xts_decrypt_ecb``: written here from IEEE 1619-2007 on top of raw AES-ECB
  (also from ``cryptography``). Handles 32/48/64-byte keys, ciphertext stealing and equal halves
  (IEEE vector 1). Cross-checked against the first implementation and the public vectors.

``xts_any_*`` pick the OpenSSL one when it can handle the input and fall back to the ECB one.

The tweak is either 16 bytes or an integer (data-unit number, encoded as a 16-byte little-endian
block, i.e. dm-crypt ``plain64``).
"""
from __future__ import annotations

from typing import Union

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

Tweak = Union[int, bytes]

BLOCK = 16


def tweak_bytes(tweak: Tweak) -> bytes:
    if isinstance(tweak, int):
        if tweak < 0 or tweak >= 1 << 128:
            raise ValueError("tweak out of range")
        return tweak.to_bytes(16, "little")
    t = bytes(tweak)
    if len(t) > 16:
        raise ValueError("tweak longer than 16 bytes")
    return t + bytes(16 - len(t))


def _check(key: bytes, data: bytes) -> None:
    if len(key) not in (32, 48, 64):
        raise ValueError(f"XTS key must be 32, 48 or 64 bytes, got {len(key)}")
    if len(data) < BLOCK:
        raise ValueError("XTS data must be at least 16 bytes")


# --------------------------------------------------------------------------------------------
# 1. OpenSSL via cryptography
# --------------------------------------------------------------------------------------------
def xts_encrypt(key: bytes, tweak: Tweak, data: bytes) -> bytes:
    _check(key, data)
    enc = Cipher(algorithms.AES(bytes(key)), modes.XTS(tweak_bytes(tweak))).encryptor()
    return enc.update(bytes(data)) + enc.finalize()


def xts_decrypt(key: bytes, tweak: Tweak, data: bytes) -> bytes:
    _check(key, data)
    dec = Cipher(algorithms.AES(bytes(key)), modes.XTS(tweak_bytes(tweak))).decryptor()
    return dec.update(bytes(data)) + dec.finalize()


# --------------------------------------------------------------------------------------------
# 2. From the standard, on top of AES-ECB
# --------------------------------------------------------------------------------------------
_MASK128 = (1 << 128) - 1


def _mul_alpha(t: int) -> int:
    """Multiply by x in GF(2^128), little-endian block convention of IEEE 1619."""
    carry = t >> 127
    t = (t << 1) & _MASK128
    if carry:
        t ^= 0x87
    return t


def _ecb(key: bytes, data: bytes, decrypt: bool) -> bytes:
    c = Cipher(algorithms.AES(key), modes.ECB())
    ctx = c.decryptor() if decrypt else c.encryptor()
    return ctx.update(data) + ctx.finalize()


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


def _xts_ecb(key: bytes, tweak: Tweak, data: bytes, decrypt: bool) -> bytes:
    _check(key, data)
    key = bytes(key)
    data = bytes(data)
    half = len(key) // 2
    k1, k2 = key[:half], key[half:]
    t = int.from_bytes(_ecb(k2, tweak_bytes(tweak), False), "little")

    nfull, rem = divmod(len(data), BLOCK)
    tweaks = []
    for _ in range(nfull + 1):
        tweaks.append(t)
        t = _mul_alpha(t)

    def blocks(buf: bytes, ts: list[int]) -> bytes:
        """XEX over whole blocks of buf using tweak list ts (one per block)."""
        if not buf:
            return b""
        tw = b"".join(x.to_bytes(16, "little") for x in ts)
        return _xor(_ecb(k1, _xor(buf, tw), decrypt), tw)

    if rem == 0:
        return blocks(data, tweaks[:nfull])

    # ciphertext stealing: the last full block m-1 and the partial block m
    m = nfull
    head = blocks(data[: (m - 1) * BLOCK], tweaks[: m - 1])
    last_full = data[(m - 1) * BLOCK : m * BLOCK]
    partial = data[m * BLOCK :]
    if not decrypt:
        cc = blocks(last_full, [tweaks[m - 1]])
        pp = partial + cc[rem:]
        return head + blocks(pp, [tweaks[m]]) + cc[:rem]
    pp = blocks(last_full, [tweaks[m]])
    cc = partial + pp[rem:]
    return head + blocks(cc, [tweaks[m - 1]]) + pp[:rem]


def xts_encrypt_ecb(key: bytes, tweak: Tweak, data: bytes) -> bytes:
    return _xts_ecb(key, tweak, data, False)


def xts_decrypt_ecb(key: bytes, tweak: Tweak, data: bytes) -> bytes:
    return _xts_ecb(key, tweak, data, True)


def _openssl_ok(key: bytes) -> bool:
    return len(key) in (32, 64) and key[: len(key) // 2] != key[len(key) // 2 :]


def xts_any_encrypt(key: bytes, tweak: Tweak, data: bytes) -> bytes:
    if _openssl_ok(key):
        return xts_encrypt(key, tweak, data)
    return xts_encrypt_ecb(key, tweak, data)


def xts_any_decrypt(key: bytes, tweak: Tweak, data: bytes) -> bytes:
    if _openssl_ok(key):
        return xts_decrypt(key, tweak, data)
    return xts_decrypt_ecb(key, tweak, data)


# --------------------------------------------------------------------------------------------
# dm-crypt plain64 sector layout
# --------------------------------------------------------------------------------------------
def sector_tweak(sector: int, sector_size: int, iv_large_sectors: bool = False) -> int:
    """Tweak number for export sector ``sector`` (dm-crypt: in 512-byte units unless
    iv_large_sectors)."""
    return sector if iv_large_sectors else sector * (sector_size // 512)


def _map_sectors(transform, key: bytes, data: bytes, sector_size: int, first_sector: int, iv_large_sectors: bool) -> bytes:
    """``transform(key, tweak, sector)`` over every sector of ``data``, with dm-crypt's tweaks."""
    assert len(data) % sector_size == 0
    return b"".join(
        transform(key, sector_tweak(first_sector + i, sector_size, iv_large_sectors), data[off : off + sector_size])
        for i, off in enumerate(range(0, len(data), sector_size))
    )


def encrypt_sectors(
    key: bytes, plaintext: bytes, sector_size: int, first_sector: int = 0, iv_large_sectors: bool = False
) -> bytes:
    return _map_sectors(xts_any_encrypt, key, plaintext, sector_size, first_sector, iv_large_sectors)


def decrypt_sectors(
    key: bytes, ciphertext: bytes, sector_size: int, first_sector: int = 0, iv_large_sectors: bool = False
) -> bytes:
    return _map_sectors(xts_any_decrypt, key, ciphertext, sector_size, first_sector, iv_large_sectors)
