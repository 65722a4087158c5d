"""FAST[Fx_m, Horner] and FAST[Fx_m, BRW], a plain-Python reference.

Written from docs/specs/fast.md (the authors' reference code, transcribed), independently of the
Rust code in crates/cipher/src/fast.rs: Python integers for GF(2^128), the spec's formulas one
step at a time.

- Key: an AES key (16 bytes in the reference code; 24/32 replace AES-128 by AES-192/256, a
  project extension). tau = E_K(0^128).
- Tweak: 16 bytes (shorter is zero-padded on the right).
- Data: m >= 3 whole blocks.
- Field: a block is a little-endian 128-bit integer; modulus x^128 + x^7 + x^2 + x + 1.
"""
from __future__ import annotations

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

BLOCK = 16
MOD = (1 << 128) | 0x87


def gf_mul(a: int, b: int) -> int:
    """Product in GF(2^128) = GF(2)[x]/(x^128 + x^7 + x^2 + x + 1), bits as coefficients."""
    r = 0
    while b:
        if b & 1:
            r ^= a
        b >>= 1
        a <<= 1
        if a >> 128:
            a ^= MOD
    return r


def to_int(b: bytes) -> int:
    return int.from_bytes(b, "little")


def to_bytes(x: int) -> bytes:
    return x.to_bytes(16, "little")


class Fast:
    def __init__(self, key: bytes, variant: str = "horner"):
        if len(key) not in (16, 24, 32):
            raise ValueError("FAST key is an AES key: 16, 24 or 32 bytes")
        if variant not in ("horner", "brw"):
            raise ValueError("variant is 'horner' or 'brw'")
        self.variant = variant
        self._aes = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
        self.tau = to_int(self.E(bytes(16)))
        self._pow: dict[int, int] = {}

    def E(self, b: bytes) -> bytes:
        return self._aes.update(b)

    def Ei(self, x: int) -> int:
        return to_int(self.E(to_bytes(x)))

    # ---- hashes (fast.md section 2) ----
    def h_horner(self, xs: list[int]) -> int:
        acc = 1
        for x in xs:
            acc = gf_mul(acc, self.tau) ^ x
        return gf_mul(acc, self.tau)

    def tau_pow(self, e: int) -> int:
        if e not in self._pow:
            r = 1
            for _ in range(e):
                r = gf_mul(r, self.tau)
            self._pow[e] = r
        return self._pow[e]

    def brw(self, xs: list[int]) -> int:
        j = len(xs)
        tau = self.tau
        if j == 0:
            return 0
        if j == 1:
            return xs[0]
        if j == 2:
            return gf_mul(xs[0], tau) ^ xs[1]
        if j == 3:
            return gf_mul(tau ^ xs[0], self.tau_pow(2) ^ xs[1]) ^ xs[2]
        t = 1
        while t * 2 <= j:
            t *= 2
        return gf_mul(self.brw(xs[: t - 1]), self.tau_pow(t) ^ xs[t - 1]) ^ self.brw(xs[t:])

    def h(self, xs: list[int]) -> int:
        if self.variant == "horner":
            return self.h_horner(xs)
        return gf_mul(self.tau, self.brw(xs))

    def h_prime(self, xs: list[int]) -> int:
        return gf_mul(self.tau, self.h(xs))

    # ---- encryption and decryption (sections 3 and 4) ----
    @staticmethod
    def _split(data: bytes) -> list[int]:
        if len(data) % BLOCK or len(data) < 3 * BLOCK:
            raise ValueError("FAST needs m >= 3 whole 16-byte blocks")
        return [to_int(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK)]

    @staticmethod
    def _tweak(t: bytes) -> int:
        if len(t) > 16:
            raise ValueError("FAST tweak is one block")
        return to_int(t + bytes(16 - len(t)))

    def encrypt(self, tweak: bytes, data: bytes) -> bytes:
        T = self._tweak(tweak)
        P = self._split(data)
        m = len(P)
        tau = self.tau
        A1 = P[0] ^ self.h(P[2:] + [T])
        F1 = P[1] ^ gf_mul(tau, A1)
        F2 = A1 ^ self.Ei(F1)
        B2 = F1 ^ self.Ei(F2)
        Z = F1 ^ F2
        C = [0, 0] + [P[i] ^ self.Ei(Z ^ (i - 1)) for i in range(2, m)]  # bin(1), bin(2), ...
        C[0] = F2 ^ gf_mul(tau, B2)
        C[1] = B2 ^ self.h_prime(C[2:] + [T])
        return b"".join(to_bytes(c) for c in C)

    def decrypt(self, tweak: bytes, data: bytes) -> bytes:
        T = self._tweak(tweak)
        C = self._split(data)
        m = len(C)
        tau = self.tau
        B2 = C[1] ^ self.h_prime(C[2:] + [T])
        F2 = C[0] ^ gf_mul(tau, B2)
        F1 = B2 ^ self.Ei(F2)
        A1 = F2 ^ self.Ei(F1)
        Z = F1 ^ F2
        P = [0, 0] + [C[i] ^ self.Ei(Z ^ (i - 1)) for i in range(2, m)]
        P[0] = A1 ^ self.h(P[2:] + [T])
        P[1] = F1 ^ gf_mul(tau, A1)
        return b"".join(to_bytes(p) for p in P)


def encrypt(key: bytes, tweak: bytes, data: bytes, variant: str = "horner") -> bytes:
    return Fast(key, variant).encrypt(tweak, data)


def decrypt(key: bytes, tweak: bytes, data: bytes, variant: str = "horner") -> bytes:
    return Fast(key, variant).decrypt(tweak, data)
