"""HCTR2 (Crowley, Huckleberry, Biggers, ePrint 2021/1441; Linux `hctr2(aes)`), a plain-Python
reference: Python integers for POLYVAL (RFC 8452's definition, bit by bit), AES from
`cryptography`. Independent of the Rust code in crates/cipher/src/hctr2.rs; checked against the
authors' vectors by tests/integration/test_tes_bridge.py.
"""
from __future__ import annotations

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

# POLYVAL: GF(2^128) with x^128 + x^127 + x^126 + x^121 + 1, little-endian blocks,
# dot(a, b) = a * b * x^-128.
P = (1 << 128) | (1 << 127) | (1 << 126) | (1 << 121) | 1


def _polymul_mod(a: int, b: int) -> int:
    r = 0
    while b:
        if b & 1:
            r ^= a
        b >>= 1
        a <<= 1
        if a >> 128:
            a ^= P
    return r


# x^-128 mod P, by inverting x^128 with Fermat: x^-128 = (x^128)^(2^128 - 2).
def _pow(a: int, e: int) -> int:
    r = 1
    while e:
        if e & 1:
            r = _polymul_mod(r, a)
        a = _polymul_mod(a, a)
        e >>= 1
    return r


X128 = _polymul_mod(1 << 127, 2)  # x^128 mod P
X_INV128 = _pow(X128, (1 << 128) - 2)


def dot(a: int, b: int) -> int:
    return _polymul_mod(_polymul_mod(a, b), X_INV128)


def polyval(h: bytes, data: bytes) -> bytes:
    assert len(data) % 16 == 0
    hh = int.from_bytes(h, "little")
    s = 0
    for i in range(0, len(data), 16):
        s = dot(s ^ int.from_bytes(data[i : i + 16], "little"), hh)
    return s.to_bytes(16, "little")


def xor(a: bytes, b: bytes) -> bytes:
    return bytes(p ^ q for p, q in zip(a, b))


class HCTR2:
    def __init__(self, key: bytes):
        if len(key) not in (16, 24, 32):
            raise ValueError("HCTR2 key is an AES key")
        aes = Cipher(algorithms.AES(key), modes.ECB())
        self._e = aes.encryptor()
        self._d = aes.decryptor()
        self.h = self._e.update(bytes(16))
        self.L = self._e.update(b"\x01" + bytes(15))

    def H(self, t: bytes, n: bytes) -> bytes:
        partial = len(n) % 16 != 0
        head = (2 * 8 * len(t) + 2 + int(partial)).to_bytes(16, "little")
        tp = t + bytes(-len(t) % 16)
        np = n + b"\x01" + bytes(-(len(n) + 1) % 16) if partial else n
        return polyval(self.h, head + tp + np)

    def xctr(self, s: bytes, n: int) -> bytes:
        si = int.from_bytes(s, "little")
        out = b"".join(self._e.update((si ^ i).to_bytes(16, "little")) for i in range(1, n // 16 + 2))
        return out[:n]

    def encrypt(self, t: bytes, p: bytes) -> bytes:
        m, n = p[:16], p[16:]
        mm = xor(m, self.H(t, n))
        uu = self._e.update(mm)
        s = xor(xor(mm, uu), self.L)
        v = xor(n, self.xctr(s, len(n)))
        u = xor(uu, self.H(t, v))
        return u + v

    def decrypt(self, t: bytes, c: bytes) -> bytes:
        u, v = c[:16], c[16:]
        uu = xor(u, self.H(t, v))
        mm = self._d.update(uu)
        s = xor(xor(mm, uu), self.L)
        n = xor(v, self.xctr(s, len(v)))
        m = xor(mm, self.H(t, n))
        return m + n


def encrypt(key: bytes, tweak: bytes, data: bytes) -> bytes:
    return HCTR2(key).encrypt(tweak, data)


def decrypt(key: bytes, tweak: bytes, data: bytes) -> bytes:
    return HCTR2(key).decrypt(tweak, data)
