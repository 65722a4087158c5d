"""EME2-AES (IEEE Std 1619.2-2010; Halevi's EME*), a plain-Python reference.

Written from the algorithm description (Halevi, "EME*: extending EME to handle arbitrary-length
messages with associated data", INDOCRYPT 2004, which 1619.2 standardises as EME2), independently
of the Rust code in crates/cipher/src/eme2.rs. Slow and simple on purpose: one block at a time,
Python integers for the field.

Key = K_AD (16) || K_ECB (16) || K_AES (16 or 32 bytes). The tweak ("associated data") may have
any length, including 0. Data: at least 16 bytes, any length (the last block may be partial).

Field: GF(2^128) in the XTS convention -- a block is a little-endian 128-bit integer, multiplying
by alpha is a left shift with 0x87 folded into the low byte.
"""
from __future__ import annotations

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

BLOCK = 16
MASK = (1 << 128) - 1


def _i(b: bytes) -> int:
    return int.from_bytes(b, "little")


def _b(x: int) -> bytes:
    return x.to_bytes(16, "little")


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b))


def times_alpha(b: bytes) -> bytes:
    x = _i(b)
    x = ((x << 1) & MASK) ^ (0x87 if x >> 127 else 0)
    return _b(x)


def _pad(b: bytes) -> bytes:
    """Partial block -> b || 0x80 || 0..0 (16 bytes)."""
    assert len(b) < BLOCK
    return b + b"\x80" + bytes(BLOCK - 1 - len(b))


class EME2:
    def __init__(self, key: bytes):
        if len(key) not in (48, 64):
            raise ValueError("EME2 key is K_AD || K_ECB || K_AES: 48 or 64 bytes")
        self.k_ad = key[:16]
        self.k_ecb = key[16:32]
        aes = Cipher(algorithms.AES(key[32:]), modes.ECB())
        self._enc = aes.encryptor()
        self._dec = aes.decryptor()

    def E(self, b: bytes) -> bytes:
        return self._enc.update(b)

    def D(self, b: bytes) -> bytes:
        return self._dec.update(b)

    def tweak_hash(self, t: bytes) -> bytes:
        """T* (the function H of the standard), always with the forward cipher."""
        if len(t) == 0:
            return self.E(self.k_ad)
        acc = bytes(16)
        k = self.k_ad
        blocks = [t[i : i + BLOCK] for i in range(0, len(t), BLOCK)]
        for blk in blocks:
            if len(blk) < BLOCK:
                blk = _pad(blk)
                k = times_alpha(k)  # a padded last block takes one extra doubling
            k = times_alpha(k)
            acc = _xor(acc, _xor(self.E(_xor(k, blk)), k))
        return acc

    def _crypt(self, t: bytes, data: bytes, f) -> bytes:
        """Encryption with f = E, decryption with f = D: EME2 is symmetric in this way."""
        if len(data) < BLOCK:
            raise ValueError("EME2 needs at least 16 bytes")
        n_full = len(data) // BLOCK
        tail = data[n_full * BLOCK :]
        tstar = self.tweak_hash(t)

        # first ECB layer, masked by K_ECB * alpha^(j-1)
        ppp = []
        L = self.k_ecb
        for j in range(n_full):
            ppp.append(f(_xor(data[j * BLOCK : (j + 1) * BLOCK], L)))
            L = times_alpha(L)

        mp = tstar
        for x in ppp:
            mp = _xor(mp, x)
        ccc1 = tstar
        out_tail = b""
        if tail:
            mp = _xor(mp, _pad(tail))
            mm = f(mp)
            out_tail = _xor(tail, mm[: len(tail)])
            ccc1 = _xor(ccc1, _pad(out_tail))
            mc = f(mm)
        else:
            mc = f(mp)
        m1 = _xor(mp, mc)
        m = m1
        ccc1 = _xor(ccc1, mc)

        ccc = [None] * n_full
        for j in range(1, n_full):
            if j % 128 != 0:
                m = times_alpha(m)
                ccc[j] = _xor(ppp[j], m)
            else:
                # every 128 blocks a fresh mask from one more cipher call
                mp2 = _xor(ppp[j], m1)
                mc2 = f(mp2)
                m = _xor(mp2, mc2)
                ccc[j] = _xor(mc2, m1)
            ccc1 = _xor(ccc1, ccc[j])
        ccc[0] = ccc1

        out = []
        L = self.k_ecb
        for j in range(n_full):
            out.append(_xor(f(ccc[j]), L))
            L = times_alpha(L)
        return b"".join(out) + out_tail

    def encrypt(self, tweak: bytes, data: bytes) -> bytes:
        return self._crypt(tweak, data, self.E)

    def decrypt(self, tweak: bytes, data: bytes) -> bytes:
        return self._crypt(tweak, data, self.D)


def encrypt(key: bytes, tweak: bytes, data: bytes) -> bytes:
    return EME2(key).encrypt(tweak, data)


def decrypt(key: bytes, tweak: bytes, data: bytes) -> bytes:
    return EME2(key).decrypt(tweak, data)
