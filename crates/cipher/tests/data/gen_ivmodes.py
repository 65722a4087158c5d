#!/usr/bin/env python3
"""Writes ivmodes_kat.txt: known answers for dm-crypt's old IV modes (tests/ivmodes_vectors.rs),
computed with Python `cryptography` (OpenSSL's AES-CBC, AES-XTS and AES-ECB), independently of
cryptbridge.

    python3 crates/cipher/tests/data/gen_ivmodes.py > crates/cipher/tests/data/ivmodes_kat.txt

The IVs, as dm-crypt computes them (drivers/md/dm-crypt.c; crypto/essiv.c since Linux 5.4):
  plain64       le64(sector) zero-padded to 16 bytes
  plain         le32(sector mod 2^32) zero-padded to 16 bytes
  essiv:sha256  AES-256-ECB under SHA-256(whole volume key) of the plain64 block
                (the whole key: both XTS halves for aes-xts-essiv:sha256)
The IV is CBC's IV, or XTS's tweak (which XTS encrypts again under Key2).

Each line: NAME KEYHEX UNIT_LEN SECTOR RESULT, where the plaintext of every unit is
byte i = (7 * i + 3) mod 256, and RESULT is the whole ciphertext in hex for 512-byte units, or
`sha256:HEX` of the ciphertext followed by ` head:HEX` (its first 32 bytes) for 4096-byte units.
"""
import hashlib

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes


def key(n: int, seed: int) -> bytes:
    # Distinct XTS halves (OpenSSL refuses equal ones).
    return bytes((seed * 41 + 17 * i + (i * i >> 3)) & 0xFF for i in range(n))


def plain64(sector: int) -> bytes:
    return (sector % 2**64).to_bytes(8, "little") + bytes(8)


def plain(sector: int) -> bytes:
    return (sector % 2**32).to_bytes(4, "little") + bytes(12)


def essiv(k: bytes, sector: int) -> bytes:
    salt = hashlib.sha256(k).digest()
    enc = Cipher(algorithms.AES(salt), modes.ECB()).encryptor()
    return enc.update(plain64(sector)) + enc.finalize()


def cbc(k: bytes, iv: bytes, data: bytes) -> bytes:
    enc = Cipher(algorithms.AES(k), modes.CBC(iv)).encryptor()
    return enc.update(data) + enc.finalize()


def xts(k: bytes, tweak: bytes, data: bytes) -> bytes:
    enc = Cipher(algorithms.AES(k), modes.XTS(tweak)).encryptor()
    return enc.update(data) + enc.finalize()


SCHEMES = [
    # name, key sizes, encrypt(key, sector, data)
    ("essiv(cbc(aes),sha256)", (16, 24, 32), lambda k, s, d: cbc(k, essiv(k, s), d)),
    ("cbc(aes)", (16, 32), lambda k, s, d: cbc(k, plain64(s), d)),
    ("xts(aes)-plain", (32, 64), lambda k, s, d: xts(k, plain(s), d)),
    ("essiv(xts(aes),sha256)", (32, 64), lambda k, s, d: xts(k, essiv(k, s), d)),
]
SECTORS = [0, 1, 2**32 - 1, 2**32, 2**32 + 5, 2**40 + 7]


def main() -> None:
    for seed, (name, sizes, encrypt) in enumerate(SCHEMES):
        for n in sizes:
            k = key(n, seed + n)
            for unit in (512, 4096):
                data = bytes((7 * i + 3) & 0xFF for i in range(unit))
                for s in SECTORS:
                    ct = encrypt(k, s, data)
                    if unit == 512:
                        result = ct.hex()
                    else:
                        result = f"sha256:{hashlib.sha256(ct).hexdigest()} head:{ct[:32].hex()}"
                    print(name, k.hex(), unit, s, result)


if __name__ == "__main__":
    main()
