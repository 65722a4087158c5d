#!/usr/bin/env python3
"""Writes fast_units_kat.txt beside this script: known answers for FAST's multi-unit calls
(`encrypt_units` / `decrypt_units`, the engine's call), 512- and 4096-byte units, computed by the
independent plain-Python FAST reference tests/reference/fast.py (written from
docs/specs/fast.md), not by the Rust code under test.

    python3 crates/cipher/tests/data/gen_fast_units.py

Unit i of a run is enciphered under the dm-crypt `plain64` tweak of unit number
(FIRST + i * STEP) mod 2^64: the number as 16 little-endian bytes. The plaintext of a run is
UNITS * UNIT_LEN bytes from the xorshift64* generator of crates/cipher/tests/levels/main.rs
(`Rng::new(SEED).bytes(n)`: state = SEED | 1; per byte: state ^= state >> 12, state ^= state << 25,
state ^= state >> 27, output the low byte of state * 0x2545f4914f6cdd1d), so the file holds only
the ciphertext.

The runs are chosen for FAST-BRW's pipelined 4096-byte path (level aesni and up, AES-128 and
AES-256 keys), whose unit counts 1, 2, 3 and more take different branches, and for the batched
multi-unit path of the other cases (4 units side by side, plus a remainder).
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]
sys.path.insert(0, str(REPO / "tests"))

from reference import fast  # noqa: E402

MASK = (1 << 64) - 1


def rng_bytes(seed: int, n: int) -> bytes:
    s = seed | 1
    out = bytearray(n)
    for i in range(n):
        s ^= s >> 12
        s ^= (s << 25) & MASK
        s ^= s >> 27
        out[i] = (s * 0x2545F4914F6CDD1D) & 0xFF
    return bytes(out)


# (variant, key length, first, step, unit length, units, seed)
RUNS = [
    ("brw", 32, 0, 1, 4096, 1, 101),
    ("brw", 32, 7, 1, 4096, 2, 102),
    ("brw", 32, MASK - 1, 1, 4096, 3, 103),  # the unit number wraps after the second unit
    ("brw", 32, 1000, 8, 4096, 5, 104),
    ("brw", 16, 3, 8, 4096, 4, 105),
    ("brw", 24, 0, 1, 4096, 2, 106),  # AES-192: no kernel, the portable path at every level
    ("brw", 32, 5, 1, 512, 5, 107),
    ("brw", 16, MASK, 1, 512, 3, 108),
    ("horner", 32, 9, 8, 4096, 2, 109),
    ("horner", 16, 0, 1, 512, 5, 110),
]


def main() -> int:
    out = HERE / "fast_units_kat.txt"
    lines = [
        "# FAST multi-unit known answers, written by crates/cipher/tests/data/gen_fast_units.py with the",
        "# independent Python reference tests/reference/fast.py (not the Rust code). See the script for",
        "# the plaintext generator and the tweak numbering.",
        "# Format: VARIANT KEY FIRST STEP UNIT_LEN UNITS SEED CIPHERTEXT (key and ciphertext in hex).",
    ]
    for variant, klen, first, step, unit_len, units, seed in RUNS:
        key = rng_bytes(seed * 7919, klen)
        pt = rng_bytes(seed, units * unit_len)
        ct = bytearray()
        for i in range(units):
            n = (first + i * step) & MASK
            unit = pt[i * unit_len : (i + 1) * unit_len]
            c = fast.encrypt(key, n.to_bytes(16, "little"), unit, variant)
            assert fast.decrypt(key, n.to_bytes(16, "little"), c, variant) == unit
            ct += c
        lines.append(f"{variant} {key.hex()} {first} {step} {unit_len} {units} {seed} {ct.hex()}")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(RUNS)} runs to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
