"""Encrypting an unencrypted image in place with the data moving (issue 28): `cryptbridge luks
reencrypt --encrypt --reduce-device-size SIZE`, as `cryptsetup reencrypt --encrypt
--reduce-device-size SIZE` does (resilience `datashift`): the header takes the image's first
SIZE/2 bytes, which first move to its end; the steps then encrypt the plaintext from the end
backwards, each SIZE/2 bytes further on than it was.

Every check decrypts the data area with the key `cryptsetup luksDump --dump-volume-key` prints
and an independent XTS (the Python `cryptography` package), and compares it with the plaintext
written before. Both tools start, continue and finish each other's encryptions; the metadata
cryptbridge initializes is compared with cryptsetup's for copies of one image (salts and digests
left out). Crashes (kill -9 and the power-loss model, of either tool) are the campaign's:
test_reencrypt_crash.py runs datashift rounds too.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from conftest import MiB, assert_no_panic, cb
from nbd_client import NBDClient
from test_luks import FAST_PBKDF2, PASS, cryptsetup, luks_format, need, write_file
from test_reencrypt import header_json, read_all, xts_sectors
from test_reencrypt_init import metadata, without_random
from test_reencrypt_online import wait_for

KDF = ["--pbkdf", "pbkdf2", *FAST_PBKDF2]
SIZE = 48 * MiB
REDUCE = 8 * MiB  # the data moves by 4 MiB
SHIFT = REDUCE // 2


def plain_image(ws, name: str = "plain.img") -> tuple:
    """An unencrypted image whose last REDUCE bytes are free, and its plaintext (what must survive)."""
    plain = os.urandom(SIZE - REDUCE)
    img = write_file(ws.tmp / name, plain + bytes(REDUCE))
    pw = write_file(ws.tmp / "pass", PASS)
    return img, pw, plain


def cb_encrypt(img, pw, *opts, init_only: bool = False):
    args = ["luks", "reencrypt", "--encrypt", *(["--init-only"] if init_only else []), "--reduce-device-size", str(REDUCE),
            "--batch-mode", "--key-file", str(pw), *KDF, *map(str, opts), str(img)]  # fmt: skip
    return cb(*args, timeout=300)


def cs_encrypt(img, pw, *opts, init_only: bool = True) -> None:
    cryptsetup("reencrypt", "--encrypt", "--type", "luks2", *(["--init-only"] if init_only else ["--force-offline-reencrypt"]),
               "--reduce-device-size", str(REDUCE), "--batch-mode", "--key-file", pw, *KDF, *opts, img, timeout=300)  # fmt: skip


def check_encrypted(img, pw, plain: bytes, sector: int = 512) -> None:
    """A finished LUKS2 volume whose data (at SHIFT) decrypts to `plain`, and no copy of the
    plaintext left in the header area or the moved copy at the end."""
    meta = header_json(img)
    assert "requirements" not in meta["config"], meta["config"]
    assert list(meta["segments"]) == ["0"], meta["segments"]
    seg = meta["segments"]["0"]
    assert (seg["type"], int(seg["offset"]), seg["size"], seg["sector_size"]) == ("crypt", SHIFT, "dynamic", sector), seg
    assert list(meta["keyslots"]) == ["0"], meta["keyslots"]
    with open(img, "rb") as f:
        raw = f.read()
    assert len(raw) == SIZE
    assert xts_sectors(cryptsetup_key(img, pw), raw[SHIFT : SHIFT + len(plain)], sector, 0, False) == plain, "the data area does not decrypt to the plaintext"
    head, moved = raw[:SHIFT], raw[SIZE - SHIFT :]
    first = plain[:SHIFT]
    leaks = [o for o in range(0, SHIFT, 4096) if first[o : o + 4096] in (head[o : o + 4096], moved[o : o + 4096])]
    assert not leaks, f"plaintext of the first {SHIFT} bytes still stored at offsets {leaks[:5]} (header area or moved copy)"


def cryptsetup_key(img, pw) -> bytes:
    from test_luks import volume_key

    return volume_key(img, pw)


@pytest.mark.parametrize("sector", [512, 4096])
def test_cryptbridge_encrypts_a_plain_image_in_place(ws, sector):
    need("cryptsetup")
    img, pw, plain = plain_image(ws)
    p = cb_encrypt(img, pw, "--sector-size", sector)
    assert p.returncode == 0, p.stderr
    assert_no_panic(p.stderr.decode())
    assert b"resilience datashift" in p.stderr, p.stderr
    check_encrypted(img, pw, plain, sector)
    # The finished volume opens with cryptsetup's tools as any LUKS2 volume.
    dump = cryptsetup("luksDump", img).stdout.decode()
    assert "online-reencrypt" not in dump and "reencrypt" not in dump, dump


def test_the_init_writes_what_cryptsetup_writes(ws):
    need("cryptsetup")
    a, pw, plain = plain_image(ws, "a.img")
    b = write_file(ws.tmp / "b.img", plain + bytes(REDUCE))
    p = cb_encrypt(a, pw, init_only=True)
    assert p.returncode == 0, p.stderr
    cs_encrypt(b, pw)
    ours, theirs = without_random(metadata(a)), without_random(metadata(b))
    assert ours == theirs
    # Both moved the first SHIFT bytes to the end before the header covered them.
    for img in (a, b):
        with open(img, "rb") as f:
            f.seek(SIZE - SHIFT)
            assert f.read(SHIFT) == plain[:SHIFT], img


def test_cryptsetup_finishes_what_cryptbridge_started(ws):
    need("cryptsetup")
    img, pw, plain = plain_image(ws)
    p = cb_encrypt(img, pw, "--sector-size", 4096, init_only=True)
    assert p.returncode == 0, p.stderr
    cryptsetup("reencrypt", "--resume-only", "--force-offline-reencrypt", "--batch-mode", "--key-file", pw, img, timeout=300)
    check_encrypted(img, pw, plain, 4096)


def test_cryptbridge_finishes_what_cryptsetup_started(ws):
    need("cryptsetup")
    img, pw, plain = plain_image(ws)
    cs_encrypt(img, pw)
    p = cb("luks", "reencrypt", "--resume-only", "--key-file", str(pw), str(img), timeout=300)
    assert p.returncode == 0, p.stderr
    check_encrypted(img, pw, plain)


def test_an_encryption_is_served_while_it_runs(ws):
    """`serve --reencrypt` on an encryption cryptsetup initialized: every byte reads as the
    plaintext before, during and after the steps, writes land under the key, and the finished
    volume decrypts with it."""
    need("cryptsetup")
    img, pw, plain = plain_image(ws)
    cs_encrypt(img, pw, "--sector-size", "4096")
    b = ws.serve(img, pw, cipher=None, extra=("--type", "luks", "--reencrypt", "--reencrypt-rate", "8M"))
    expect = write_while_it_runs(b.uri, plain)
    wait_for(lambda: "reencryption finished" in b.stderr(), 120, "the encryption to finish")
    assert read_all(b.uri, len(plain)) == bytes(expect)
    assert b.stop() == 0
    check_encrypted(img, pw, bytes(expect), 4096)


def write_while_it_runs(uri: str, plain: bytes) -> bytearray:
    """32 flushed 8 KiB writes over an export of `plain` whose data moves, then every byte read
    back: the plaintext with those writes, which this returns."""
    expect = bytearray(plain)
    with NBDClient(uri) as c:
        c.connect()
        assert c.size == len(plain)
        for i in range(32):
            off = (i * 1237 * 4096) % (len(plain) - 8192)
            data = os.urandom(8192)
            c.write(off, data)
            c.flush()
            expect[off : off + 8192] = data
    assert read_all(uri, len(plain)) == bytes(expect)
    return expect


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_refusals_change_nothing(ws):
    need("cryptsetup")
    img, pw, _ = plain_image(ws)
    before = sha(img)
    cases = [
        (["--reduce-device-size", "100K"], "a multiple of 8192 bytes"),
        (["--reduce-device-size", "128K"], "must hold the LUKS2 header"),
        (["--reduce-device-size", "40M"], "must hold the"),
        (["--reduce-device-size", "8M", "--header", ws.tmp / "hdr"], "detached header"),
        (["--reduce-device-size", "8M", "--resilience", "checksum"], "datashift"),
        (["--reduce-device-size", "8M", "--type", "luks1"], "only LUKS2"),
        ([], "needs --reduce-device-size"),
    ]
    for opts, why in cases:
        p = cb("luks", "reencrypt", "--encrypt", "--batch-mode", "--key-file", str(pw), *KDF, *map(str, opts), str(img), timeout=120)
        assert p.returncode == 1, (opts, p.returncode, p.stderr)
        assert why.encode() in p.stderr, (opts, p.stderr)
        assert_no_panic(p.stderr.decode())
        assert sha(img) == before, opts
    p = cb("luks", "reencrypt", "--decrypt", "--key-file", str(pw), str(img))
    assert p.returncode == 1 and b"no LUKS header found" in p.stderr, p.stderr
    # Without --batch-mode and no terminal to ask on: refused, nothing written.
    p = cb("luks", "reencrypt", "--encrypt", "--reduce-device-size", str(REDUCE), "--key-file", str(pw), *KDF, str(img))
    assert p.returncode == 1 and b"--batch-mode" in p.stderr, p.stderr
    assert sha(img) == before
    # A LUKS volume already: refused, its header untouched.
    vol = ws.backing(SIZE, name="vol.img")
    luks_format(vol, pw, *KDF)
    before = sha(vol)
    p = cb("luks", "reencrypt", "--encrypt", "--reduce-device-size", str(REDUCE), "--batch-mode", "--key-file", str(pw), *KDF, str(vol))
    assert p.returncode == 1 and b"already has a LUKS header" in p.stderr, p.stderr
    assert sha(vol) == before
