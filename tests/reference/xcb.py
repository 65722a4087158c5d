"""XCB-AES (XCBv2 / IEEE 1619.2), a plain-Python reference.

Written from docs/specs/xcb.md, independently of the Rust code in crates/cipher/src/xcb.rs: the
GHASH here is GCM's bit-serial multiplication (NIST SP 800-38D, algorithm 1) on big-endian
integers, where the Rust code uses POLYVAL on byte-reversed blocks with carry-less multiplies.

LEGACY: XCB is broken as a TES (Bhati and Andreeva, ePrint 2024/1554). Comparison only.

- Key: 16 or 32 bytes. Tweak Z: any length. Data: at least 16 bytes, any length.
"""
from __future__ import annotations

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

R = 0xE1 << 120


def gcm_mul(x: int, y: int) -> int:
    z, v = 0, y
    for i in range(128):
        if (x >> (127 - i)) & 1:
            z ^= v
        v = (v >> 1) ^ R if v & 1 else v >> 1
    return z


def pad(x: bytes) -> bytes:
    return x + bytes(-len(x) % 16)


def len64(v: int) -> bytes:
    return v.to_bytes(8, "big")


def xor(a: bytes, b: bytes) -> bytes:
    return bytes(p ^ q for p, q in zip(a, b))


class XCB:
    def __init__(self, key: bytes):
        if len(key) not in (16, 32):
            raise ValueError("XCB key is 16 or 32 bytes")
        n = len(key)
        enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
        self.H = int.from_bytes(enc.update(bytes(16)), "big")
        s = [enc.update(bytes(15) + bytes([i])) for i in range(1, 7)]
        ke, kd, kc = (s[0] + s[1])[:n], (s[2] + s[3])[:n], (s[4] + s[5])[:n]
        self.subkeys = (ke, kd, kc)
        self._ke = Cipher(algorithms.AES(ke), modes.ECB())
        self._kd = Cipher(algorithms.AES(kd), modes.ECB())
        self._kc = Cipher(algorithms.AES(kc), modes.ECB()).encryptor()

    def chain(self, data: bytes) -> bytes:
        """y <- (y ^ block) * H over whole blocks, from y = 0."""
        assert len(data) % 16 == 0
        y = 0
        for i in range(0, len(data), 16):
            y = gcm_mul(y ^ int.from_bytes(data[i : i + 16], "big"), self.H)
        return y.to_bytes(16, "big")

    def h1(self, z: bytes, b: bytes) -> bytes:
        return self.chain(pad(z) + pad(b) + bytes(16) + len64(8 * len(z) + 128) + len64(8 * len(pad(b)) + 128))

    def h2(self, z: bytes, e: bytes) -> bytes:
        return self.chain(
            pad(z) + bytes(16) + pad(e)
            + len64(8 * len(z) + 128) + len64(8 * len(e))
            + len64(8 * len(z) + 128) + len64(8 * len(pad(e)) + 128)
        )  # fmt: skip

    def ctr(self, s: bytes, length: int) -> bytes:
        out = b""
        low = int.from_bytes(s[12:], "big")
        i = 0
        while len(out) < length:
            block = s[:12] + ((low + i) % (1 << 32)).to_bytes(4, "big")
            out += self._kc.update(block)
            i += 1
        return out[:length]

    def encrypt(self, z: bytes, p: bytes, trace: dict | None = None) -> bytes:
        if len(p) < 16:
            raise ValueError("XCB needs at least 16 bytes")
        a, b = p[-16:], p[:-16]
        c = self._ke.encryptor().update(a)
        d = xor(c, self.h1(z, b))
        e = xor(b, self.ctr(d, len(b)))
        f = xor(d, self.h2(z, e))
        g = self._kd.decryptor().update(f)
        if trace is not None:
            trace.update(C=c, h1=self.h1(z, b), D=d, h2=self.h2(z, e), F=f)
        return e + g

    def decrypt(self, z: bytes, q: bytes) -> bytes:
        if len(q) < 16:
            raise ValueError("XCB needs at least 16 bytes")
        g, e = q[-16:], q[:-16]
        f = self._kd.encryptor().update(g)
        d = xor(f, self.h2(z, e))
        b = xor(e, self.ctr(d, len(e)))
        c = xor(d, self.h1(z, b))
        a = self._ke.decryptor().update(c)
        return b + a


def encrypt(key: bytes, tweak: bytes, data: bytes) -> bytes:
    return XCB(key).encrypt(tweak, data)


def decrypt(key: bytes, tweak: bytes, data: bytes) -> bytes:
    return XCB(key).decrypt(tweak, data)
