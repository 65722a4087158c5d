"""Decrypting a volume whose LUKS2 header is in front of its data (issue 28): `cryptbridge luks
reencrypt --decrypt --header NEW-FILE DEVICE`, as `cryptsetup reencrypt --decrypt --header
NEW-FILE` (2.6) does it: the header moves to the new file, the data moves to the device's start
while it is decrypted (resilience `datashift-checksum`, requirement `online-reencrypt-v3`), from
the old data offset on forwards, and last the first bytes, which the init copied over the old
header, in place under checksums.

Every check compares the device's first bytes with the plaintext written before (encrypted with
the key `cryptsetup luksDump --dump-volume-key` printed and an independent XTS, the Python
`cryptography` package). Both tools start, continue, finish and recover each other's decryptions
(kill -9 in a hotzone of each kind); the metadata and device bytes cryptbridge's init writes are
compared with cryptsetup's for copies of one volume (salts and digests left out).
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import MiB, assert_no_panic, cb, require_binary
from test_luks import FAST_PBKDF2, cryptsetup, luks_format, need
from test_reencrypt import IMAGE, active_segments, header_json, read_all, volume_with_plaintext
from test_reencrypt_datashift import write_while_it_runs
from test_reencrypt_init import metadata, without_random
from test_reencrypt_online import wait_for

OFFSET = 16 * MiB  # cryptsetup's default LUKS2 data offset: the shift


def cb_decrypt(img, hdr, pw, *opts, init_only: bool = False):
    args = ["luks", "reencrypt", "--decrypt", *(["--init-only"] if init_only else []), "--header", str(hdr), "--key-file", str(pw), *map(str, opts), str(img)]
    return cb(*args, timeout=300)


def cs_decrypt(img, hdr, pw, *opts) -> None:
    cryptsetup("reencrypt", "--decrypt", "--header", hdr, "--force-offline-reencrypt", "--batch-mode", "--key-file", pw, *opts, img, timeout=300)


def volume(ws, sector: int = 4096) -> tuple[Path, Path, Path, bytes]:
    img, pw, plain, offset = volume_with_plaintext(ws, "--sector-size", str(sector))
    assert offset == OFFSET
    return img, ws.tmp / "moved.hdr", pw, plain


def check_decrypted(img: Path, hdr: Path, plain: bytes, old_tail: bytes) -> None:
    """A finished decryption: the header file holds one linear segment from offset 0 and no
    keyslots; the device starts with the plaintext; what lay behind it (old ciphertext) is gone."""
    meta = metadata(hdr)
    assert "requirements" not in meta["config"], meta["config"]
    assert meta["segments"] == {"0": {"type": "linear", "offset": "0", "size": "dynamic"}}, meta["segments"]
    assert meta["keyslots"] == {} and meta["digests"] == {}, meta
    assert hdr.stat().st_mode & 0o777 == 0o600, oct(hdr.stat().st_mode)
    raw = img.read_bytes()
    assert len(raw) == IMAGE
    assert raw[: len(plain)] == plain, "the device does not start with the plaintext"
    tail = raw[len(plain) :]
    same = [o for o in range(0, len(tail), 4096) if tail[o : o + 4096] == old_tail[o : o + 4096]]
    assert not same, f"old ciphertext left behind the plaintext at offsets {same[:5]}"


def old_tail(img: Path) -> bytes:
    return img.read_bytes()[IMAGE - OFFSET :]


@pytest.mark.parametrize("sector", [512, 4096])
def test_cryptbridge_decrypts_moving_the_header_out(ws, sector):
    need("cryptsetup")
    img, hdr, pw, plain = volume(ws, sector)
    tail = old_tail(img)
    p = cb_decrypt(img, hdr, pw)
    assert p.returncode == 0, p.stderr
    assert_no_panic(p.stderr.decode())
    check_decrypted(img, hdr, plain, tail)


def test_the_init_writes_what_cryptsetup_writes(ws):
    """For copies of one volume: the same device bytes (the header's signatures wiped, the first
    ciphertext copied over it) and the same metadata in the new header file, salts, digests and the
    benchmarked iterations aside."""
    need("cryptsetup")
    img, hdr, pw, _ = volume(ws)
    twin, twin_hdr = ws.tmp / "twin.img", ws.tmp / "twin.hdr"
    twin.write_bytes(img.read_bytes())
    p = cb_decrypt(img, hdr, pw, init_only=True)
    assert p.returncode == 0, p.stderr
    cs_decrypt(twin, twin_hdr, pw, "--init-only")
    assert hashlib.sha256(img.read_bytes()).digest() == hashlib.sha256(twin.read_bytes()).digest(), "the devices differ after the init"
    ours, theirs = without_random(metadata(hdr)), without_random(metadata(twin_hdr))
    for meta in (ours, theirs):
        for d in meta["digests"].values():
            d.pop("iterations")
            d["segments"].sort()
    assert ours == theirs
    assert ours["config"]["requirements"] == {"mandatory": ["online-reencrypt-v3"]}
    assert hdr.read_bytes()[2 * 16384 :] == twin_hdr.read_bytes()[2 * 16384 :], "the keyslots areas differ"


def kill_in_hotzone(cmd: list, hdr: Path, first: bool) -> None:
    """Runs `cmd` and kills it (SIGKILL) while a hotzone is flagged `in-reencryption`: the moved
    first bytes' (`first`, checksum) or a shifting step's (datashift). The process is stopped
    while its header is looked at, so what is seen is what the kill leaves."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    caught = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        p.send_signal(signal.SIGSTOP)
        meta = header_json(hdr) if hdr.exists() and hdr.stat().st_size >= 4096 else None
        hot = [s for s in active_segments(meta) if "in-reencryption" in s.get("flags", [])] if meta else []
        if hot and (hot[0]["offset"] == "0") == first:
            caught = hot[0]
            break
        p.send_signal(signal.SIGCONT)
        time.sleep(0.002)
    p.kill()
    _, err = p.communicate(timeout=60)
    assert caught, f"never saw the {'first' if first else 'shifting'} hotzone (exit {p.returncode}): {err[-400:]!r}"
    meta = header_json(hdr)
    assert "requirements" in meta["config"] and any("in-reencryption" in s.get("flags", []) for s in active_segments(meta)), meta["segments"]


def cb_run(img: Path, hdr: Path, pw: Path) -> list:
    return [require_binary(), "luks", "reencrypt", "--resume-only", "--threads", "1", "--header", str(hdr), "--key-file", str(pw), str(img)]


def cs_run(img: Path, hdr: Path, pw: Path) -> list:
    return [need("cryptsetup"), "reencrypt", "--resume-only", "--force-offline-reencrypt", "--batch-mode", "--header", str(hdr), "--key-file", str(pw), str(img)]


@pytest.mark.parametrize("first", [False, True], ids=["datashift-hotzone", "checksum-hotzone"])
def test_cryptsetup_recovers_and_finishes_what_cryptbridge_left(ws, first):
    need("cryptsetup")
    img, hdr, pw, plain = volume(ws)
    tail = old_tail(img)
    assert cb_decrypt(img, hdr, pw, init_only=True).returncode == 0
    kill_in_hotzone(cb_run(img, hdr, pw), hdr, first)
    cryptsetup("repair", "--batch-mode", "--header", hdr, "--key-file", pw, img, timeout=300)
    # The repair of the last hotzone (the first bytes) finishes the decryption itself.
    if "requirements" in metadata(hdr)["config"]:
        cryptsetup(*cs_run(img, hdr, pw)[1:], timeout=300)
    check_decrypted(img, hdr, plain, tail)


@pytest.mark.parametrize("first", [False, True], ids=["datashift-hotzone", "checksum-hotzone"])
def test_cryptbridge_recovers_and_finishes_what_cryptsetup_left(ws, first):
    need("cryptsetup")
    img, hdr, pw, plain = volume(ws)
    tail = old_tail(img)
    cs_decrypt(img, hdr, pw, "--init-only")
    kill_in_hotzone(cs_run(img, hdr, pw), hdr, first)
    p = cb(*cb_run(img, hdr, pw)[1:], timeout=300)
    assert p.returncode == 0, p.stderr
    assert b"recovered the hotzone" in p.stderr, p.stderr
    check_decrypted(img, hdr, plain, tail)


def test_cryptbridge_finishes_what_cryptsetup_initialized(ws):
    need("cryptsetup")
    img, hdr, pw, plain = volume(ws, 512)
    tail = old_tail(img)
    cs_decrypt(img, hdr, pw, "--init-only")
    p = cb(*cb_run(img, hdr, pw)[1:], timeout=300)
    assert p.returncode == 0, p.stderr
    check_decrypted(img, hdr, plain, tail)


def test_a_decryption_is_served_while_it_runs(ws):
    """`serve --reencrypt` on a decryption cryptsetup initialized: the export is the plaintext's
    size; every byte reads as the plaintext before, during and after the steps; writes land as
    plaintext where the finished volume has them."""
    need("cryptsetup")
    img, hdr, pw, plain = volume(ws)
    tail = old_tail(img)
    cs_decrypt(img, hdr, pw, "--init-only")
    b = ws.serve(img, pw, cipher=None, extra=("--type", "luks", "--header", str(hdr), "--reencrypt", "--reencrypt-rate", "16M"))
    expect = write_while_it_runs(b.uri, plain)
    wait_for(lambda: "reencryption finished" in b.stderr(), 120, "the decryption to finish")
    assert read_all(b.uri, len(plain)) == bytes(expect)
    assert b.stop() == 0
    check_decrypted(img, hdr, bytes(expect), tail)


def test_refusals_write_nothing(ws):
    """Refused with the reason, exit 1, the device unchanged and no header file left: another
    resilience, a new cipher, a wrong passphrase, a LUKS1 volume, a volume whose data area is not
    larger than its header."""
    need("cryptsetup")
    img, hdr, pw, _ = volume(ws)
    before = hashlib.sha256(img.read_bytes()).hexdigest()
    bad = ws.tmp / "bad"
    bad.write_bytes(b"not the passphrase")
    cases = [
        (pw, ["--resilience", "journal"], "datashift-checksum"),
        (pw, ["--cipher", "aes-cbc-essiv:sha256"], "do not apply"),
        (bad, [], "no key available"),
    ]
    for key, opts, why in cases:
        p = cb_decrypt(img, hdr, key, *opts)
        assert p.returncode == 1 and why.encode() in p.stderr, (opts, p.stderr)
        assert_no_panic(p.stderr.decode())
        assert hashlib.sha256(img.read_bytes()).hexdigest() == before, opts
        assert not hdr.exists(), opts
    small = ws.backing(24 * MiB, name="small.img")
    luks_format(small, pw, "--type", "luks2", "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    p = cb_decrypt(small, hdr, pw)
    assert p.returncode == 1 and b"must be larger than the header" in p.stderr, p.stderr
    assert not hdr.exists()
    old = ws.backing(24 * MiB, name="luks1.img")
    luks_format(old, pw, "--type", "luks1", "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    p = cb_decrypt(old, hdr, pw)
    assert p.returncode == 1 and b"LUKS1" in p.stderr, p.stderr
    assert not hdr.exists()
