"""Old volumes: dm-crypt's older IV modes, served for the volumes people still have.

``aes-cbc-essiv:sha256`` (cryptsetup's default before 1.6), ``aes-cbc-plain64``, ``aes-xts-plain``
(32-bit sector numbers: wraps at 2^32 sectors) and ``aes-xts-essiv:sha256``, on LUKS1 and LUKS2
volumes that ``cryptsetup luksFormat`` makes on image files (512- and, for LUKS2, 4096-byte
sectors) and on plain volumes (``serve --type plain --cipher SPEC``).

Every check is against an implementation written here over Python ``cryptography`` (OpenSSL's
AES-CBC, AES-XTS and AES-ECB), with the volume key ``cryptsetup luksDump --dump-volume-key``
prints and the data offset ``luksDump`` prints: data written through NBD is decrypted from the
image, and sectors encrypted here and written into the image read back through NBD. The IVs, as
dm-crypt computes them (drivers/md/dm-crypt.c, crypto/essiv.c), counting 512-byte units at every
sector size:

  plain64       le64(n) zero-padded to 16 bytes
  plain         le32(n mod 2^32) zero-padded to 16 bytes
  essiv:sha256  AES-256-ECB under SHA-256(whole volume key) of the plain64 block

Images are sparse files a little over 2 TiB, so that data sectors past 2^32 (512-byte units)
exist: there ``plain`` wraps and the others do not, and the tests write across that point.

Skipped, with the reason, where cryptsetup is missing or refuses a combination.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from conftest import MiB, assert_no_panic, cb, write_key
from nbd_client import NBDClient
from test_luks import FAST_PBKDF2, PASS, cryptsetup, data_layout, need, serve_luks, sparse, volume_key, write_file

TiB = 1 << 40
WRAP = (1 << 32) * 512  # the data byte where dm-crypt's 32-bit `plain` IV wraps to 0
IMAGE = WRAP + 64 * MiB

SPECS = ["aes-cbc-essiv:sha256", "aes-cbc-plain64", "aes-xts-plain", "aes-xts-essiv:sha256"]


# --- the reference: dm-crypt's IVs over OpenSSL's AES ---------------------------------------------

def iv_of(spec: str, key: bytes, n: int) -> bytes:
    """The IV (CBC) or tweak (XTS) of 512-byte unit `n`."""
    iv_mode = spec.rsplit("-", 1)[1]
    if iv_mode == "plain64":
        return (n % 2**64).to_bytes(16, "little")
    if iv_mode == "plain":
        return (n % 2**32).to_bytes(4, "little") + bytes(12)
    if iv_mode == "essiv:sha256":
        enc = Cipher(algorithms.AES(hashlib.sha256(key).digest()), modes.ECB()).encryptor()
        return enc.update((n % 2**64).to_bytes(16, "little")) + enc.finalize()
    raise ValueError(spec)


def crypt(spec: str, key: bytes, n: int, data: bytes, decrypt: bool) -> bytes:
    """One sector of `data` whose first 512-byte unit is `n`, en- or decrypted as dm-crypt does."""
    iv = iv_of(spec, key, n)
    mode = modes.CBC(iv) if "-cbc-" in spec else modes.XTS(iv)
    c = Cipher(algorithms.AES(key), mode)
    op = c.decryptor() if decrypt else c.encryptor()
    return op.update(data) + op.finalize()


def test_reference_ivs():
    """The reference's IVs for hand-picked numbers, and that it tells the modes apart."""
    k = bytes(range(32))
    assert iv_of("aes-xts-plain", k, 2**32 + 5) == bytes([5]) + bytes(15)
    assert iv_of("aes-xts-plain64", k, 2**32 + 5) == bytes([5, 0, 0, 0, 1]) + bytes(11)
    salt = hashlib.sha256(k).digest()
    enc = Cipher(algorithms.AES(salt), modes.ECB()).encryptor()
    assert iv_of("aes-cbc-essiv:sha256", k, 1) == enc.update(bytes([1]) + bytes(15))
    sector = os.urandom(512)
    for spec in SPECS:
        assert crypt(spec, k, 3, crypt(spec, k, 3, sector, False), True) == sector


# --- helpers -----------------------------------------------------------------------------------

def read_at(img: Path, off: int, n: int) -> bytes:
    with open(img, "rb") as f:
        f.seek(off)
        return f.read(n)


def write_at(img: Path, off: int, data: bytes) -> None:
    with open(img, "r+b") as f:
        f.seek(off)
        f.write(data)


def decrypt_range(spec: str, img: Path, key: bytes, offset: int, sector: int, off: int, length: int) -> bytes:
    """Data bytes [off, off+length) of the volume, decrypted from the image by the reference."""
    first, last = off // sector, (off + length - 1) // sector
    out = bytearray()
    for i in range(first, last + 1):
        raw = read_at(img, offset + i * sector, sector)
        out += crypt(spec, key, i * sector // 512, raw, True)
    rel = off - first * sector
    return bytes(out[rel : rel + length])


def check_volume(ws, spec: str, img: Path, key: bytes, offset: int, sector: int, serve) -> None:
    """Sectors encrypted here read back through the bridge; data written through the bridge
    decrypts here. `serve()` starts the bridge on `img`."""
    size = (img.stat().st_size - offset) // sector * sector
    assert size > WRAP + 4 * sector, "the image must reach past the plain IV's wrap"
    # Written here, read there: sectors at the start, either side of the wrap, and the last one.
    theirs = {}
    for i in (0, 7, WRAP // sector - 1, WRAP // sector, WRAP // sector + 5, size // sector - 1):
        plain = os.urandom(sector)
        write_at(img, offset + i * sector, crypt(spec, key, i * sector // 512, plain, False))
        theirs[i * sector] = plain
    b = serve()
    ours = {
        sector: os.urandom(3 * sector),
        5 * sector + 100: os.urandom(300),
        TiB + 3 * sector: os.urandom(8192),
        WRAP - 2 * sector: os.urandom(4 * sector),  # across the wrap
        WRAP + 2 * sector: os.urandom(sector + 512),
        size - 2 * sector: os.urandom(sector),
    }
    with NBDClient(b.uri) as c:
        c.connect()
        assert c.size == size, (c.size, size)
        for off, data in theirs.items():
            assert c.read(off, len(data)) == data, f"{spec}: sector at {off:#x}, encrypted here, does not read back"
        for off, data in ours.items():
            c.write(off, data)
        c.flush()
        for off, data in ours.items():
            assert c.read(off, len(data)) == data, f"read back at {off:#x}"
    assert b.stop() == 0
    assert_no_panic(b.stderr())
    for off, data in ours.items():
        assert decrypt_range(spec, img, key, offset, sector, off, len(data)) == data, f"{spec}: on-disk bytes at {off:#x} do not decrypt"
    # The check tells the IV conventions apart: the sector past the wrap does not decrypt with the
    # other reading of its number (plain for plain64, plain64 for the rest), nor, at 4096-byte
    # sectors, with sectors counted as IV units. (A CBC IV changes the first block only.)
    i = WRAP // sector + 2
    raw = read_at(img, offset + i * sector, sector)
    want = ours[WRAP + 2 * sector][:sector]
    other = spec.rsplit("-", 1)[0] + ("-plain" if spec.endswith("-plain64") else "-plain64")
    assert crypt(spec, key, i * sector // 512, raw, True) == want
    assert crypt(other, key, i * sector // 512, raw, True)[:16] != want[:16], other
    if sector > 512:
        assert crypt(spec, key, i, raw, True)[:16] != want[:16]


def luks_format(img: Path, pw: Path, luks_type: str, spec: str, bits: int, sector: int) -> None:
    opts = ["--type", luks_type, "--cipher", spec, "--key-size", str(bits), "--pbkdf", "pbkdf2", *FAST_PBKDF2]
    if luks_type == "luks2":
        opts += ["--sector-size", str(sector)]
    p = cryptsetup("luksFormat", "--batch-mode", "--key-file", pw, *opts, img, check=False)
    if p.returncode != 0:
        pytest.skip(f"cryptsetup luksFormat {' '.join(opts)} failed here: {p.stderr.decode(errors='replace').strip()}")


# --- LUKS volumes made by cryptsetup -------------------------------------------------------------

DEFAULT_BITS = {"aes-cbc-essiv:sha256": 256, "aes-cbc-plain64": 256, "aes-xts-plain": 512, "aes-xts-essiv:sha256": 512}
CASES = [(spec, t, s, DEFAULT_BITS[spec]) for spec in SPECS for (t, s) in (("luks1", 512), ("luks2", 512), ("luks2", 4096))]
# The other key sizes: AES-128 CBC (ESSIV's AES is AES-256 all the same), AES-192 CBC, XTS-AES-128.
CASES += [("aes-cbc-essiv:sha256", "luks1", 512, 128), ("aes-cbc-plain64", "luks2", 4096, 192),
          ("aes-xts-plain", "luks2", 4096, 256), ("aes-xts-essiv:sha256", "luks1", 512, 256)]  # fmt: skip


@pytest.mark.parametrize("spec,luks_type,sector,bits", CASES, ids=[f"{c}-{t}-s{s}-k{b}" for c, t, s, b in CASES])
def test_cryptsetup_volume(ws, spec, luks_type, sector, bits):
    need("cryptsetup")
    img = sparse(ws.tmp / "v.img", IMAGE)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, luks_type, spec, bits, sector)
    mode = spec.split("-", 1)[1]  # LUKS1 dumps name and mode apart (aes, cbc-essiv:sha256)
    dump = cryptsetup("luksDump", img).stdout.decode()
    assert mode in dump, dump
    key = volume_key(img, pw)
    offset, dumped_sector = data_layout(img)
    assert dumped_sector == sector and len(key) == bits // 8
    check_volume(ws, spec, img, key, offset, sector, lambda: serve_luks(ws, img, pw))
    # The header is as cryptsetup left it: its passphrase still opens it, and dump names the cipher.
    cryptsetup("open", "--test-passphrase", "--key-file", pw, img)
    out = cb("luks", "dump", img, check=True).stdout.decode()
    assert mode in out, out


def test_luks_format_refuses_the_old_modes(ws):
    """They are for the volumes that have them: a new volume gets aes-xts-plain64."""
    img = sparse(ws.tmp / "v.img", 24 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    for spec in SPECS:
        p = cb("luks", "format", "--type", "luks2", "--cipher", spec, "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000", "--key-file", pw, img)
        assert p.returncode != 0 and b"existing volumes only" in p.stderr and b"aes-xts-plain64" in p.stderr, p.stderr
    assert read_at(img, 0, 4096) == bytes(4096), "nothing was written"


# --- plain volumes -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,bits,sector", [("aes-cbc-essiv:sha256", 256, 512), ("aes-cbc-plain64", 128, 4096),
                                              ("aes-xts-plain", 512, 512), ("aes-xts-essiv:sha256", 256, 4096)])  # fmt: skip
def test_plain_volume(ws, spec, bits, sector):
    """`serve --type plain --cipher SPEC` takes the same names as a LUKS header, with the same
    meaning (the IV counts 512-byte units unless --iv-large-sectors)."""
    img = sparse(ws.tmp / "plain.img", WRAP + 16 * MiB)
    key = os.urandom(bits // 8)
    kf = write_key(ws.tmp / "key.bin", key)
    serve = lambda: ws.serve(img, kf, cipher=spec, key_size=str(bits), sector_size=str(sector), extra=("--type", "plain"))
    check_volume(ws, spec, img, key, 0, sector, serve)
