"""`cryptbridge luks reencrypt --init-only`: starting a LUKS2 reencryption with the metadata
`cryptsetup reencrypt --init-only --force-offline-reencrypt` (2.6) writes.

The plaintext is written before the init with an independent XTS (the Python `cryptography`
package) under the old key cryptsetup prints; after the reencryption (finished by cryptsetup or by
cryptbridge) the whole data area must decrypt to it with the new key cryptsetup prints. The JSON
cryptbridge writes is compared with cryptsetup's for copies of one image, only the random parts
(salts, digests) left out.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from conftest import MiB, assert_no_panic, cb
from test_luks import FAST_PBKDF2, PASS, cryptsetup, data_layout, luks_format, need, sparse, volume_key, write_file
from test_reencrypt import header_json, volume_with_plaintext, xts_sectors

KDF = ["--pbkdf", "pbkdf2", *FAST_PBKDF2]


def cb_init(img, pw, *opts, init_only: bool = True):
    args = ["luks", "reencrypt", *(["--init-only"] if init_only else []), "--batch-mode", "--key-file", str(pw), *KDF, *map(str, opts), str(img)]
    return cb(*args, timeout=300)


def decrypts_with_new_key(img, pw, plain: bytes, offset: int, key_bytes: int, sector: int) -> None:
    meta = header_json(img)
    assert "requirements" not in meta["config"], meta["config"]
    assert list(meta["segments"]) == ["0"], meta["segments"]
    new_key = volume_key(img, pw)
    assert len(new_key) == key_bytes
    assert data_layout(img) == (offset, sector)
    with open(img, "rb") as f:
        f.seek(offset)
        raw = f.read(len(plain))
    assert xts_sectors(new_key, raw, sector, 0, False) == plain, "the data area does not decrypt with the new key"


def metadata(img) -> dict:
    return json.loads(cryptsetup("luksDump", "--dump-json-metadata", img).stdout)


def without_random(meta: dict) -> dict:
    meta = json.loads(json.dumps(meta))
    for ks in meta["keyslots"].values():
        if "kdf" in ks:
            ks["kdf"].pop("salt")
    for d in meta["digests"].values():
        d.pop("salt")
        d.pop("digest")
    return meta


CASES = [
    # (format options, init options, new key bytes, new sector size)
    (["--key-size", "512", "--sector-size", "4096"], [], 64, 4096),
    (["--key-size", "256", "--sector-size", "512"], ["--key-size", "512", "--sector-size", "4096", "--resilience", "checksum"], 64, 4096),
    (["--key-size", "256", "--sector-size", "512"], ["--key-size", "512", "--sector-size", "4096", "--resilience", "none"], 64, 4096),
    (["--key-size", "512", "--sector-size", "4096"], ["--key-size", "256", "--sector-size", "512", "--resilience", "none"], 32, 512),
]


@pytest.mark.parametrize("fmt,opts,key_bytes,sector", CASES)
def test_cryptsetup_finishes_what_cryptbridge_initialized(ws, fmt, opts, key_bytes, sector):
    need("cryptsetup")
    img, pw, plain, offset = volume_with_plaintext(ws, *fmt)
    p = cb_init(img, pw, *opts)
    assert p.returncode == 0, p.stderr
    assert_no_panic(p.stderr.decode())
    dump = cryptsetup("luksDump", img).stdout.decode()
    assert "online-reencrypt-v2" in dump and "reencrypt (unbound)" in dump, dump
    cryptsetup("reencrypt", "--resume-only", "--force-offline-reencrypt", "--batch-mode", "--key-file", pw, img, timeout=300)
    decrypts_with_new_key(img, pw, plain, offset, key_bytes, sector)


@pytest.mark.parametrize("fmt,opts,key_bytes,sector", CASES[1:])
def test_cryptbridge_initializes_then_finishes(ws, fmt, opts, key_bytes, sector):
    """--init-only then --resume-only (the existing run), and a plain run that does both."""
    need("cryptsetup")
    for two_steps in (True, False):
        img, pw, plain, offset = volume_with_plaintext(ws, *fmt)
        if two_steps:
            p = cb_init(img, pw, *opts)
            assert p.returncode == 0, p.stderr
            p = cb("luks", "reencrypt", "--resume-only", "--batch-mode", "--hotzone-size", "1M", "--key-file", str(pw), str(img), timeout=300)
        else:
            p = cb_init(img, pw, "--hotzone-size", "1M", *opts, init_only=False)
        assert p.returncode == 0, p.stderr
        assert_no_panic(p.stderr.decode())
        decrypts_with_new_key(img, pw, plain, offset, key_bytes, sector)
        assert cryptsetup("open", "--test-passphrase", "--key-file", pw, img, check=False).returncode == 0


@pytest.mark.parametrize("fmt,opts", [
    (["--key-size", "512", "--sector-size", "4096"], []),
    (["--key-size", "256", "--sector-size", "512"], ["--key-size", "512", "--sector-size", "4096"]),
    (["--key-size", "512", "--sector-size", "512"], ["--resilience", "none"]),
    (["--key-size", "512", "--sector-size", "512"], ["--resilience", "journal"]),
    (["--key-size", "512", "--sector-size", "4096"], ["--resilience-hash", "sha1", "--sector-size", "512"]),
])  # fmt: skip
def test_metadata_is_what_cryptsetup_writes(ws, fmt, opts):
    """The same image initialized by each tool: identical JSON but for salts and digests (field
    for field: keyslots and their areas, segments, digests and their assignments, config)."""
    need("cryptsetup")
    img = sparse(ws.tmp / "v.img", 32 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, "--type", "luks2", *KDF, *fmt)
    theirs = shutil.copy(img, ws.tmp / "theirs.img")
    cryptsetup("reencrypt", "--init-only", "--force-offline-reencrypt", "--batch-mode", "--key-file", pw, *KDF, *opts, theirs)
    p = cb_init(img, pw, *opts)
    assert p.returncode == 0, p.stderr
    ours, expected = metadata(img), metadata(theirs)
    assert without_random(ours) == without_random(expected)
    # Both open with the passphrase in cryptsetup's eyes (cryptsetup 2.6 refuses --key-slot with
    # --test-passphrase on a volume in reencryption, for its own metadata too).
    for i in (img, theirs):
        assert cryptsetup("open", "--test-passphrase", "--key-file", pw, i, check=False).returncode == 0


def test_no_room_is_refused_as_cryptsetup_refuses_it(ws):
    need("cryptsetup")
    img = sparse(ws.tmp / "v.img", 32 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, "--type", "luks2", *KDF, "--luks2-keyslots-size", "384k")
    theirs = shutil.copy(img, ws.tmp / "theirs.img")
    r = cryptsetup("reencrypt", "--init-only", "--force-offline-reencrypt", "--batch-mode", "--key-file", pw, *KDF, theirs, check=False)
    assert r.returncode != 0, "cryptsetup found room: this test's premise is wrong"
    before = hashlib.sha256(img.read_bytes()).hexdigest()
    p = cb_init(img, pw)
    assert p.returncode == 1 and b"no room" in p.stderr, p.stderr
    assert hashlib.sha256(img.read_bytes()).hexdigest() == before


def test_refusals_write_nothing(ws):
    need("cryptsetup")
    img = sparse(ws.tmp / "v.img", 32 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    wrong = write_file(ws.tmp / "wrong", b"wrong")
    luks_format(img, pw, "--type", "luks2", *KDF)

    def refused(path, needle: bytes, *opts, key=pw):
        before = hashlib.sha256(path.read_bytes()).hexdigest()
        args = ["luks", "reencrypt", "--init-only", "--batch-mode", "--key-file", str(key), *opts, str(path)]
        p = cb(*args, timeout=120)
        assert p.returncode == 1 and needle in p.stderr, (opts, p.stderr)
        assert_no_panic(p.stderr.decode())
        assert hashlib.sha256(path.read_bytes()).hexdigest() == before, f"{opts}: written"

    refused(img, b"no key available", *KDF, key=wrong)
    refused(img, b"--key-size 200", *KDF, "--key-size", "200")
    refused(img, b"--pbkdf-force-iterations 10", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "10")
    refused(img, b"--sector-size 8192", *KDF, "--sector-size", "8192")
    # Two keyslots and a key file: cryptsetup wants --key-slot too.
    cryptsetup("luksAddKey", "--batch-mode", "--key-file", pw, *KDF, img, write_file(ws.tmp / "other", b"other"))
    refused(img, b"give --key-slot", *KDF)
    # Already in progress.
    p = cb_init(img, pw, "--key-slot", "0")
    assert p.returncode == 0, p.stderr
    refused(img, b"already in progress", *KDF)
    # LUKS1.
    v1 = sparse(ws.tmp / "v1.img", 32 * MiB)
    luks_format(v1, pw, "--type", "luks1", *FAST_PBKDF2)
    refused(v1, b"LUKS1", *KDF)


def test_detached_header(ws):
    """--header: the metadata equals cryptsetup's for the same header, and cryptsetup finishes
    what cryptbridge initialized."""
    need("cryptsetup")
    hdr = ws.tmp / "v.hdr"
    img, pw, plain, offset = volume_with_plaintext(ws, "--key-size", "256", "--sector-size", "512", header=hdr)
    assert offset == 0
    theirs = shutil.copy(hdr, ws.tmp / "theirs.hdr")
    cryptsetup("reencrypt", "--init-only", "--force-offline-reencrypt", "--batch-mode", "--key-file", pw, *KDF, "--key-size", "512",
               "--header", theirs, img)  # fmt: skip
    p = cb_init(img, pw, "--header", hdr, "--key-size", "512")
    assert p.returncode == 0, p.stderr
    assert without_random(metadata(hdr)) == without_random(metadata(theirs))
    cryptsetup("reencrypt", "--resume-only", "--force-offline-reencrypt", "--batch-mode", "--key-file", pw, "--header", hdr, img, timeout=300)
    assert "requirements" not in header_json(hdr)["config"]
    new_key = volume_key(hdr, pw)
    assert len(new_key) == 64
    with open(img, "rb") as f:
        raw = f.read(len(plain))
    assert xts_sectors(new_key, raw, 512, 0, False) == plain


@pytest.mark.parametrize("finisher", ["cryptbridge", "cryptsetup"])
@pytest.mark.parametrize("mode", ["encrypt", "decrypt"])
def test_detached_encrypt_and_decrypt_initialized_here(ws, mode, finisher):
    """`luks reencrypt --encrypt|--decrypt --header HDR --init-only` writes what `cryptsetup
    reencrypt --encrypt|--decrypt --init-only --header HDR` writes for a copy of the same devices
    (salts and digests aside); either tool then finishes it: encrypt, the data device decrypts with
    the key cryptsetup prints; decrypt, it holds the plaintext."""
    need("cryptsetup")
    size = 24 * MiB
    pw = ws.tmp / "pass"
    pw.write_bytes(b"detached")
    os.chmod(pw, 0o600)
    plain = os.urandom(size)
    devs = {}
    for who in ("cb", "cs"):
        img, hdr = ws.tmp / f"{who}.img", ws.tmp / f"{who}.hdr"
        if mode == "decrypt":
            if who == "cb":
                img.write_bytes(bytes(size))
                cryptsetup("luksFormat", "--batch-mode", "--type", "luks2", "--key-file", pw, *KDF, "--sector-size", "4096", "--header", hdr, img)
                img.write_bytes(xts_sectors(volume_key(hdr, pw), plain, 4096, 0, True))
            else:  # the same header and data
                shutil.copyfile(ws.tmp / "cb.hdr", hdr)
                shutil.copyfile(ws.tmp / "cb.img", img)
        else:
            img.write_bytes(plain)
        devs[who] = (img, hdr)
    (img, hdr), (cs_img, cs_hdr) = devs["cb"], devs["cs"]
    flag = f"--{mode}"
    p = cb_init(img, pw, flag, "--header", hdr)
    assert p.returncode == 0, p.stderr
    assert_no_panic(p.stderr.decode())
    opts = ["--type", "luks2"] if mode == "encrypt" else []
    cryptsetup("reencrypt", flag, "--init-only", "--batch-mode", "--force-offline-reencrypt", *opts, "--header", cs_hdr, "--key-file", pw, *KDF, cs_img)
    ours, theirs = without_random(metadata(hdr)), without_random(metadata(cs_hdr))
    if mode == "decrypt":  # no new keyslot: both benchmark the reencryption digest's iterations
        for m in (ours, theirs):
            assert m["digests"]["1"].pop("iterations") >= 1000
    assert ours == theirs
    if finisher == "cryptbridge":
        r = cb("luks", "reencrypt", "--resume-only", "--header", str(hdr), "--key-file", str(pw), str(img), timeout=300)
        assert r.returncode == 0, r.stderr
    else:
        cryptsetup("reencrypt", "--resume-only", "--batch-mode", "--force-offline-reencrypt", "--header", hdr, "--key-file", pw, img, timeout=300)
    meta = header_json(hdr)
    assert "requirements" not in meta["config"], meta["config"]
    raw = img.read_bytes()
    if mode == "decrypt":
        assert raw == plain, "the data device does not hold the plaintext"
    else:
        assert xts_sectors(volume_key(hdr, pw), raw, 512, 0, False) == plain, "the data device does not decrypt to the plaintext"


def test_encrypt_and_decrypt_refusals_write_nothing(ws):
    """What is not done here, or cannot be, is refused with the reason (exit 1) before anything is
    written: --decrypt of a volume whose header is in front of its data (cryptsetup 2.6 moves the
    data), --decrypt with a new cipher, --encrypt with both --header and --reduce-device-size, and
    --encrypt of a device that is a LUKS volume already."""
    need("cryptsetup")
    img, pw, _, _ = volume_with_plaintext(ws)
    before = hashlib.sha256(img.read_bytes()).hexdigest()
    cases = [
        (["--decrypt"], b"moves the data"),
        (["--encrypt", "--header", ws.tmp / "new.hdr"], b"already has a LUKS header"),
        (["--encrypt", "--header", ws.tmp / "new.hdr", "--reduce-device-size", "8M"], b"give one of --header and --reduce-device-size"),
    ]
    for opts, why in cases:
        p = cb_init(img, pw, *opts)
        assert p.returncode == 1 and why in p.stderr, (opts, p.stderr)
        assert_no_panic(p.stderr.decode())
        assert hashlib.sha256(img.read_bytes()).hexdigest() == before, opts
    data, hdr = ws.tmp / "d.img", ws.tmp / "d.hdr"
    sparse(data, 24 * MiB)
    luks_format(data, pw, *KDF, header=hdr)
    before = hashlib.sha256(hdr.read_bytes()).hexdigest()
    p = cb_init(data, pw, "--decrypt", "--header", hdr, "--cipher", "aes-cbc-essiv:sha256")
    assert p.returncode == 1 and b"do not apply" in p.stderr, p.stderr
    assert hashlib.sha256(hdr.read_bytes()).hexdigest() == before
