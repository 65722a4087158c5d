"""`cryptbridge cipher --cipher 'xts(aes)'` against the independent Python reference and the
public vectors, plus its error handling (docs/cli.md, "cryptbridge cipher")."""
import os
import random

import pytest

from conftest import VECTORS, assert_no_panic, cb
from reference import xts_ref
import vectors


def run_cipher(lines, decrypt=False, cipher="xts(aes)", timeout=120):
    args = ["cipher", "--cipher", cipher] + (["--decrypt"] if decrypt else [])
    p = cb(*args, input=("\n".join(lines) + "\n").encode(), timeout=timeout)
    err = p.stderr.decode(errors="replace")
    assert_no_panic(err, "cryptbridge cipher")
    out = p.stdout.decode(errors="replace").splitlines()
    return p.returncode, out, err


def random_jobs(rng, n, key_sizes=(32, 64)):
    jobs = []
    for i in range(n):
        ks = rng.choice(key_sizes)
        while True:
            key = rng.randbytes(ks)
            if key[: ks // 2] != key[ks // 2 :]:
                break
        # lengths 16..4096, biased towards block boundaries and odd tails
        r = rng.random()
        if r < 0.3:
            length = rng.randint(16, 64)
        elif r < 0.6:
            length = rng.randint(1, 256) * 16
        else:
            length = rng.randint(16, 4096)
        data = rng.randbytes(length)
        if i % 7 == 0:
            tweak = rng.randbytes(rng.randint(1, 15))  # short: zero-padded on the right
        else:
            tweak = rng.randbytes(16)
        jobs.append((key, tweak, data))
    return jobs


def fmt(key, tweak, data, upper=False):
    t = tweak.hex() if tweak else "-"
    line = f"{key.hex()} {t} {data.hex()}"
    return line.upper() if upper else line


def test_cipher_random_encrypt_vs_reference():
    rng = random.Random(0xC1F3)
    jobs = random_jobs(rng, 300)
    rc, out, err = run_cipher([fmt(*j, upper=(i % 5 == 0)) for i, j in enumerate(jobs)])
    assert rc == 0, err
    assert len(out) == len(jobs)
    for i, ((key, tweak, data), got) in enumerate(zip(jobs, out)):
        want = xts_ref.xts_encrypt(key, tweak, data).hex()
        assert got == want, f"job {i}: key {len(key)}B tweak {tweak.hex()} len {len(data)}"


def test_cipher_random_decrypt_vs_reference():
    rng = random.Random(0xDEC)
    jobs = random_jobs(rng, 300)
    rc, out, err = run_cipher([fmt(*j) for j in jobs], decrypt=True)
    assert rc == 0, err
    assert len(out) == len(jobs)
    for i, ((key, tweak, data), got) in enumerate(zip(jobs, out)):
        want = xts_ref.xts_decrypt(key, tweak, data).hex()
        assert got == want, f"job {i}: key {len(key)}B len {len(data)}"


def test_cipher_aes192_vs_ecb_reference():
    """XTS-AES-192 (48-byte keys): OpenSSL has none, compare with the ECB-based reference."""
    rng = random.Random(192)
    jobs = random_jobs(rng, 60, key_sizes=(48,))
    rc, out, err = run_cipher([fmt(*j) for j in jobs])
    assert rc == 0, err
    for (key, tweak, data), got in zip(jobs, out):
        assert got == xts_ref.xts_encrypt_ecb(key, tweak, data).hex()
    rc, out, err = run_cipher([fmt(*j) for j in jobs], decrypt=True)
    assert rc == 0, err
    for (key, tweak, data), got in zip(jobs, out):
        assert got == xts_ref.xts_decrypt_ecb(key, tweak, data).hex()


def test_cipher_public_vectors():
    vs = vectors.all_xts(VECTORS)
    assert vs
    rc, out, err = run_cipher([fmt(v.key, v.tweak, v.pt) for v in vs])
    assert rc == 0, err
    assert len(out) == len(vs)
    bad = [v.name for v, got in zip(vs, out) if got != v.ct.hex()]
    assert not bad, f"{len(bad)} encrypt mismatches, e.g. {bad[:5]}"
    rc, out, err = run_cipher([fmt(v.key, v.tweak, v.ct) for v in vs], decrypt=True)
    assert rc == 0, err
    bad = [v.name for v, got in zip(vs, out) if got != v.pt.hex()]
    assert not bad, f"{len(bad)} decrypt mismatches, e.g. {bad[:5]}"


def test_cipher_empty_tweak_and_blank_lines():
    key = bytes(range(64))
    data = os.urandom(100)
    lines = ["", fmt(key, b"", data), "   ", "", fmt(key, bytes(16), data)]
    rc, out, err = run_cipher(lines)
    assert rc == 0, err
    want = xts_ref.xts_encrypt(key, bytes(16), data).hex()
    assert out == [want, want]


def test_cipher_cipher_names():
    """docs: `serve --cipher` accepts three spellings; `cipher` at least xts(aes)."""
    key = bytes(range(64))
    data = os.urandom(48)
    rc, out, err = run_cipher([fmt(key, b"\x05", data)])
    assert rc == 0, err
    assert out == [xts_ref.xts_encrypt(key, 5, data).hex()]


BAD_LINES = {
    "bad hex in data": "{k} {t} zz{d}",
    "odd-length hex": "{k} {t} {d}0",
    "key 31 bytes": "{k31} {t} {d}",
    "key 40 bytes": "{k40} {t} {d}",
    "key 16 bytes": "{k16} {t} {d}",
    "data 15 bytes": "{k} {t} {d15}",
    "empty data hex": "{k} {t} -",
    "missing data field": "{k} {t}",
    "bad hex in key": "{kbad} {t} {d}",
    "bad hex in tweak": "{k} 0g {d}",
    "tweak longer than 16 bytes": "{k} {t17} {d}",
    "too many fields": "{k} {t} {d} {d}",
}


def test_cipher_error_lines():
    rng = random.Random(7)
    key = rng.randbytes(64)
    data = rng.randbytes(40)
    subst = dict(
        k=key.hex(),
        t=rng.randbytes(16).hex(),
        d=data.hex(),
        k31=rng.randbytes(31).hex(),
        k40=rng.randbytes(40).hex(),
        k16=rng.randbytes(16).hex(),
        d15=rng.randbytes(15).hex(),
        kbad="x" + key.hex()[1:],
        t17=rng.randbytes(17).hex(),
    )
    good_tweak = rng.randbytes(16)
    good = fmt(key, good_tweak, data)
    want_good = xts_ref.xts_encrypt(key, good_tweak, data).hex()
    names = list(BAD_LINES)
    lines = []
    expect = []
    for n in names:
        lines += [good, BAD_LINES[n].format(**subst)]
        expect += [("good", None), ("bad", n)]
    lines.append(good)
    expect.append(("good", None))
    for decrypt in (False, True):
        rc, out, err = run_cipher(lines, decrypt=decrypt)
        assert rc == 1, f"exit status {rc}, docs say 1 for a bad line\nstderr: {err}"
        assert len(out) == len(lines), f"one output line per job expected:\n" + "\n".join(out)
        want_g = xts_ref.xts_decrypt(key, good_tweak, data).hex() if decrypt else want_good
        for (kind, name), got in zip(expect, out):
            if kind == "good":
                assert got == want_g
            else:
                assert got.startswith("error: "), f"{name}: got {got!r}"
                assert len(got) > len("error: "), f"{name}: empty reason"


@pytest.mark.parametrize("name", ["nonsense", "xts(des)", ""])
def test_cipher_unknown_cipher_name(name):
    job = fmt(bytes(range(64)), b"\x01", bytes(32))
    p = cb("cipher", "--cipher", name, input=(job + "\n").encode(), timeout=30)
    assert p.returncode != 0
    assert_no_panic(p.stderr.decode(errors="replace"))
    out = p.stdout.decode(errors="replace").splitlines()
    assert not out or out[0].startswith("error: "), out


def test_cipher_large_job():
    """A 1 MiB data unit (longer than any sector) still matches the reference."""
    key = os.urandom(64)
    data = os.urandom((1 << 20) + 5)
    rc, out, err = run_cipher([fmt(key, b"\x01\x02", data)])
    assert rc == 0, err
    assert out == [xts_ref.xts_encrypt(key, b"\x01\x02", data).hex()]


@pytest.mark.parametrize("key_bytes", [32, 64])
def test_cipher_every_length(key_bytes):
    """Every length 16..1100 plus lengths around 32-block (512-byte) multiples up to 8 KiB:
    exercises every tail/CTS split of a wide (e.g. 32-blocks-per-iteration) fast path."""
    rng = random.Random(key_bytes)
    key = rng.randbytes(key_bytes)
    lengths = list(range(16, 1101))
    for m in range(2, 17):
        lengths += [m * 512 + d for d in (-17, -16, -1, 0, 1, 15, 16, 17)]
    jobs = [(key, rng.randbytes(16), rng.randbytes(n)) for n in lengths]
    for decrypt in (False, True):
        rc, out, err = run_cipher([fmt(*j) for j in jobs], decrypt=decrypt)
        assert rc == 0, err
        assert len(out) == len(jobs)
        ref = xts_ref.xts_decrypt if decrypt else xts_ref.xts_encrypt
        bad = [len(d) for (k, t, d), got in zip(jobs, out) if got != ref(k, t, d).hex()]
        assert not bad, f"{'decrypt' if decrypt else 'encrypt'} wrong for lengths {bad[:20]}"
