#!/usr/bin/env python3
"""Cross-check the Rust wide-block schemes (through `cryptbridge cipher`) against the independent
Python references in this folder, on random inputs, and write the agreed outputs as project
vectors.

    tests/reference/cross_check.py                      # 10,000 random inputs per scheme
    tests/reference/cross_check.py -n 200 --schemes eme2 # quicker
    tests/reference/cross_check.py --write-vectors crates/cipher/tests/data

Schemes: eme2 (eme2(aes)), xcb (xcb(aes)), fast-horner, fast-brw. For every input it checks
  Rust encrypt == Python encrypt, Rust decrypt(ciphertext) == plaintext, and
  Python decrypt(ciphertext) == plaintext.
Exit status 0 only if every input agrees.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

from reference import eme2, fast, xcb  # noqa: E402

SCHEMES = {
    "eme2": "eme2(aes)",
    "xcb": "xcb(aes)",
    "fast-horner": "fast-horner(aes)",
    "fast-brw": "fast-brw(aes)",
}


def gen_case(scheme: str, rng: random.Random) -> tuple[bytes, bytes, bytes]:
    """A random (key, tweak, plaintext) for `scheme`; lengths cover the edge cases."""
    if scheme == "eme2":
        key = rng.randbytes(rng.choice([48, 64]))
        tweak = rng.randbytes(rng.choice([0, 1, 15, 16, 16, 16, 17, 31, 32, 33, rng.randrange(0, 80)]))
        r = rng.random()
        if r < 0.03:
            n = rng.choice([2048, 2064, 2065, 4096, 4100, 4111])  # past 128 blocks: re-masking
        elif r < 0.10:
            n = rng.choice([512, 520, 16, 17, 31, 32, 33])
        else:
            n = rng.randrange(16, 700)
    elif scheme == "xcb":
        key = rng.randbytes(rng.choice([16, 32]))
        tweak = rng.randbytes(rng.choice([0, 1, 15, 16, 16, 16, 17, 32, rng.randrange(0, 60)]))
        r = rng.random()
        if r < 0.03:
            n = rng.choice([4096, 4095, 4097])
        elif r < 0.10:
            n = rng.choice([16, 17, 31, 32, 47, 48, 512])
        else:
            n = rng.randrange(16, 700)
    else:
        key = rng.randbytes(rng.choice([16, 16, 16, 24, 32]))
        tweak = rng.randbytes(rng.choice([16, 16, 16, 16, 0, 1, 8, 15]))
        r = rng.random()
        if r < 0.03:
            m = 256
        elif r < 0.10:
            m = rng.choice([3, 4, 5, 31, 32, 33, 63, 64, 65])
        else:
            m = rng.randrange(3, 45)
        n = 16 * m
    return key, tweak, rng.randbytes(n)


def py_encrypt(scheme: str, key: bytes, tweak: bytes, pt: bytes) -> bytes:
    if scheme == "eme2":
        return eme2.encrypt(key, tweak, pt)
    if scheme == "xcb":
        return xcb.encrypt(key, tweak, pt)
    return fast.encrypt(key, tweak, pt, scheme.split("-")[1])


def py_decrypt(scheme: str, key: bytes, tweak: bytes, ct: bytes) -> bytes:
    if scheme == "eme2":
        return eme2.decrypt(key, tweak, ct)
    if scheme == "xcb":
        return xcb.decrypt(key, tweak, ct)
    return fast.decrypt(key, tweak, ct, scheme.split("-")[1])


def _py_job(args):
    scheme, key, tweak, pt = args
    ct = py_encrypt(scheme, key, tweak, pt)
    return ct, py_decrypt(scheme, key, tweak, ct)


def run_binary(binary: Path, name: str, jobs: list[tuple[bytes, bytes, bytes]], decrypt: bool) -> list[str]:
    lines = "".join(f"{k.hex()} {t.hex() if t else '-'} {d.hex()}\n" for k, t, d in jobs)
    cmd = [str(binary), "cipher", "--cipher", name] + (["--decrypt"] if decrypt else [])
    p = subprocess.run(cmd, input=lines.encode(), capture_output=True, timeout=600)
    out = p.stdout.decode().splitlines()
    if len(out) != len(jobs):
        raise SystemExit(f"{name}: expected {len(jobs)} output lines, got {len(out)}; stderr: {p.stderr.decode()[-2000:]}")
    return out


def check_scheme(scheme: str, n: int, seed: int, binary: Path, pool) -> tuple[int, list]:
    rng = random.Random(f"{seed}-{scheme}")
    cases = [gen_case(scheme, rng) for _ in range(n)]
    t0 = time.monotonic()
    py = pool.map(_py_job, [(scheme, *c) for c in cases], chunksize=16)
    t1 = time.monotonic()
    rust_ct = run_binary(binary, SCHEMES[scheme], cases, decrypt=False)
    rust_pt = run_binary(binary, SCHEMES[scheme], [(k, t, bytes.fromhex(c)) for (k, t, _), c in zip(cases, rust_ct) if not c.startswith("error")], decrypt=True)
    bad = 0
    agreed = []
    j = 0
    for i, ((key, tweak, pt), (ct, back)) in enumerate(zip(cases, py)):
        problems = []
        if rust_ct[i].startswith("error"):
            problems.append(f"rust encrypt: {rust_ct[i]}")
        else:
            if rust_ct[i] != ct.hex():
                problems.append("ciphertexts differ")
            if rust_pt[j] != pt.hex():
                problems.append("rust decrypt is not the plaintext")
            j += 1
        if back != pt:
            problems.append("python decrypt is not the plaintext")
        if problems:
            bad += 1
            if bad <= 5:
                print(f"  {scheme} #{i}: {'; '.join(problems)} (key {len(key)} B, tweak {len(tweak)} B, data {len(pt)} B)")
        else:
            agreed.append((key, tweak, pt, ct))
    print(f"{scheme:12s} {n - bad:6d}/{n} agree   (python {t1 - t0:.1f} s, rust {time.monotonic() - t1:.1f} s)", flush=True)
    return bad, agreed


def write_vectors(dirpath: Path, scheme: str, agreed: list, seed: int, n: int) -> None:
    """A fixed selection of agreed cases: the first 48 with data up to 700 bytes, plus the first
    case of up to four distinct lengths above 1000 bytes (4096-byte sectors, EME2 past 128
    blocks)."""
    pick = []
    long_seen = set()
    for key, tweak, pt, ct in agreed:
        if len(pt) <= 700 and sum(1 for p in pick if len(p[2]) <= 700) < 48:
            pick.append((key, tweak, pt, ct))
        elif len(pt) > 1000 and len(pt) not in long_seen and len(long_seen) < 4:
            long_seen.add(len(pt))
            pick.append((key, tweak, pt, ct))
    path = dirpath / f"tes_{scheme.replace('-', '_')}_project.txt"
    with open(path, "w") as f:
        f.write(f"# {SCHEMES[scheme]} project vectors: outputs on which the Rust implementation and the independent\n")
        f.write(f"# Python reference (tests/reference/) agreed, from tests/reference/cross_check.py -n {n} --seed {seed}.\n")
        f.write("# Not official vectors: there are none for this scheme. Format: KEY TWEAK PLAINTEXT CIPHERTEXT (hex, '-' = empty).\n")
        for key, tweak, pt, ct in pick:
            f.write(f"{key.hex()} {tweak.hex() or '-'} {pt.hex()} {ct.hex()}\n")
    print(f"  wrote {len(pick)} vectors to {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=10_000, help="random inputs per scheme (default 10000)")
    ap.add_argument("--seed", type=int, default=20261122)
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    ap.add_argument("--binary", type=Path, default=Path(os.environ.get("CRYPTBRIDGE_BIN", REPO / "target/release/cryptbridge")))
    ap.add_argument("--write-vectors", type=Path, metavar="DIR", help="write agreed cases as project vectors into DIR")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="Python worker processes")
    args = ap.parse_args()
    if not args.binary.exists():
        print(f"{args.binary} not found: cargo build --release", file=sys.stderr)
        return 2
    total_bad = 0
    with multiprocessing.Pool(args.jobs) as pool:
        for scheme in args.schemes:
            bad, agreed = check_scheme(scheme, args.n, args.seed, args.binary, pool)
            total_bad += bad
            if args.write_vectors and bad == 0:
                write_vectors(args.write_vectors, scheme, agreed, args.seed, args.n)
    print("all agree" if total_bad == 0 else f"{total_bad} disagreements")
    return 0 if total_bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
