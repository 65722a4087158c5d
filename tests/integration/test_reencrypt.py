"""LUKS2 volumes whose reencryption is in progress (issue 28), served by the bridge.

cryptsetup 2.6 makes every state here (`reencrypt --init-only`, a `reencrypt` stopped by SIGINT
at a commit point); the plaintext is written and checked with an independent XTS (the Python
`cryptography` package), and what the bridge writes is checked by letting cryptsetup finish the
reencryption and decrypting the whole data area with the new key it prints.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import MiB, assert_no_panic, cb
from nbd_client import NBDClient
from reencrypt_crash import active_segments, header_json, xts_sectors
from test_luks import FAST_PBKDF2, PASS, cryptsetup, data_layout, luks_format, need, rewrite_luks2, serve_fails, serve_luks, sparse, volume_key, write_file

pytest.importorskip("cryptography.hazmat.primitives.ciphers", reason="the Python cryptography package is needed for the independent XTS")

IMAGE = 64 * MiB


def volume_with_plaintext(ws, *fmt, header: Optional[Path] = None) -> tuple[Path, Path, bytes, int]:
    """A LUKS2 image (`fmt` options; its header in `header` if given) whose data area holds random
    plaintext, encrypted here."""
    img = sparse(ws.tmp / "v.img", IMAGE)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, "--type", "luks2", "--pbkdf", "pbkdf2", *FAST_PBKDF2, *fmt, header=header)
    key = volume_key(header or img, pw)
    offset, sector = data_layout(header or img)
    plain = os.urandom(IMAGE - offset)
    with open(img, "r+b") as f:
        f.seek(offset)
        f.write(xts_sectors(key, plain, sector, 0, True))
    return img, pw, plain, offset


def interrupt_reencryption(img: Path, pw: Path, *opts, header: Optional[Path] = None) -> None:
    """Runs `cryptsetup reencrypt` and sends SIGINT once the header shows progress; it stops at its
    next commit point, part of the volume under each key."""
    p = subprocess.Popen(
        [need("cryptsetup"), "reencrypt", "--batch-mode", "--force-offline-reencrypt", "--hotzone-size", "128K", "--key-file", pw,
         "--pbkdf", "pbkdf2", *FAST_PBKDF2, *(["--header", header] if header else []), *opts, img],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and p.poll() is None:
        meta = header_json(header or img)
        if meta and "requirements" in meta["config"] and len(active_segments(meta)) == 2:
            break
        time.sleep(0.002)
    p.send_signal(signal.SIGINT)
    p.wait(timeout=60)
    meta = header_json(header or img)
    assert meta and "requirements" in meta["config"], "cryptsetup finished before SIGINT stopped it"
    assert len(active_segments(meta)) == 2, f"cryptsetup stopped before any progress: {meta['segments']}"


def read_all(uri: str, size: int) -> bytes:
    with NBDClient(uri) as c:
        c.connect()
        assert c.size == size, (c.size, size)
        return b"".join(c.read(o, min(MiB, size - o)) for o in range(0, size, MiB))


def test_interrupted_reencryption_serves_every_byte_and_writes_under_the_right_key(ws):
    """Old key 512-bit with 4096-byte sectors, new key 256-bit with 512-byte sectors, stopped part
    way: every byte reads as the plaintext; writes to the re-encrypted part, the old part and across
    the boundary read back, and after cryptsetup finishes the reencryption the whole data area
    decrypts with the new key to the expected plaintext."""
    need("cryptsetup")
    img, pw, plain, offset = volume_with_plaintext(ws, "--sector-size", "4096", "--key-size", "512")
    interrupt_reencryption(img, pw, "--sector-size", "512", "--key-size", "256")
    done = int(active_segments(header_json(img))[0]["size"])
    assert 0 < done < len(plain)

    dump = json.loads(cb("luks", "dump", "--json", str(img), check=True).stdout)
    assert dump["refused"] is None and dump["reencryption"]["done"] == done, dump["reencryption"]
    assert [r["data_segment"]["sector_size"] for r in dump["reencryption"]["regions"]] == [512, 4096]

    b = serve_luks(ws, img, pw)
    assert read_all(b.uri, len(plain)) == plain, "the bridge does not read what the header says is where"
    expect = bytearray(plain)
    patches = {
        4096 * 3 + 7: os.urandom(10_000),  # re-encrypted part, unaligned
        done - 5000: os.urandom(12_345),  # across the reencryption point
        (done + len(plain)) // 2 // 4096 * 4096: os.urandom(64 * 1024),  # old part, aligned
        len(plain) - 700: os.urandom(700),  # the last bytes
    }
    with NBDClient(b.uri) as c:
        c.connect()
        for off, data in patches.items():
            c.write(off, data)
            expect[off : off + len(data)] = data
        c.flush()
        for off, data in patches.items():
            assert c.read(off, len(data)) == data, f"read back at {off}"
    assert read_all(b.uri, len(plain)) == bytes(expect)
    assert b.stop() == 0
    err = b.stderr()
    assert_no_panic(err)
    assert "reencryption digest verified" in err, err

    # Independently: cryptsetup finishes the job, then the new key alone decrypts everything.
    cryptsetup("reencrypt", "--resume-only", "--batch-mode", "--force-offline-reencrypt", "--key-file", pw, img, timeout=300)
    assert "requirements" not in header_json(img)["config"]
    new_key = volume_key(img, pw)
    assert len(new_key) == 32
    assert data_layout(img) == (offset, 512)
    with open(img, "rb") as f:
        f.seek(offset)
        raw = f.read(len(plain))
    assert xts_sectors(new_key, raw, 512, 0, False) == bytes(expect), "what the bridge wrote is not where cryptsetup expects it"


def test_initialized_reencryption_is_served_under_the_old_key(ws):
    """`reencrypt --init-only`: nothing moved yet, the volume reads as before through the
    reencryption path (both keys opened, the digest checked)."""
    need("cryptsetup")
    img, pw, plain, _ = volume_with_plaintext(ws)
    cryptsetup("reencrypt", "--init-only", "--batch-mode", "--force-offline-reencrypt", "--key-file", pw, "--pbkdf", "pbkdf2", *FAST_PBKDF2, "--resilience", "none", img)
    b = serve_luks(ws, img, pw)
    assert read_all(b.uri, len(plain)) == plain
    assert b.stop() == 0
    err = b.stderr()
    assert "reencryption digest verified" in err and "resilience none" in err, err


def refused_unchanged(ws, img: Path, pw: Path, needle: str, with_key: bool = True) -> None:
    before = hashlib.sha256(img.read_bytes()).hexdigest()
    p = serve_fails(ws, "--backing", img, *(["--key-file", str(pw)] if with_key else []))
    assert p.returncode == 1 and needle in p.stderr.decode(), p.stderr
    assert hashlib.sha256(img.read_bytes()).hexdigest() == before, "a refused volume was written"


def test_refusals_change_nothing(ws):
    """A reencryption digest that does not match the metadata, and a hotzone a crash left
    (`in-reencryption`): exit 1 with a clear message, nothing written; the hotzone is refused
    before any passphrase is asked for."""
    need("cryptsetup")
    img, pw, _, _ = volume_with_plaintext(ws)
    interrupt_reencryption(img, pw)

    def flip_direction(meta):
        slot = next(k for k, v in meta["keyslots"].items() if v["type"] == "reencrypt")
        meta["keyslots"][slot]["direction"] = "backward"

    saved = img.read_bytes()[: 16 * MiB]
    rewrite_luks2(img, flip_direction)
    refused_unchanged(ws, img, pw, "reencryption metadata is invalid")

    with open(img, "r+b") as f:
        f.write(saved)

    def hotzone(meta):
        meta["segments"]["1"].setdefault("flags", []).append("in-reencryption")

    rewrite_luks2(img, hotzone)
    for with_key in (True, False):
        refused_unchanged(ws, img, pw, "reencrypt --resume-only", with_key)


def test_keyslot_commands_still_refuse_a_volume_in_reencryption(ws):
    need("cryptsetup")
    img = sparse(ws.tmp / "v.img", 32 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, "--type", "luks2", "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    cryptsetup("reencrypt", "--init-only", "--batch-mode", "--force-offline-reencrypt", "--key-file", pw, "--pbkdf", "pbkdf2", *FAST_PBKDF2, img)
    before = hashlib.sha256(img.read_bytes()).hexdigest()
    p = cb("luks", "add-key", "--key-file", str(pw), str(img), str(pw))
    assert p.returncode == 1 and b"reencryption is in progress" in p.stderr, p.stderr
    assert hashlib.sha256(img.read_bytes()).hexdigest() == before


def test_interrupted_decryption_serves_plaintext_and_ciphertext_regions(ws):
    """`reencrypt --decrypt` (cryptsetup 2.6 decrypts volumes with a detached header) stopped part
    way: the decrypted part is a linear (plaintext) segment, the rest is still under the key; both
    read as the plaintext, and a write to the decrypted part lands on disk as plaintext."""
    need("cryptsetup")
    hdr = ws.tmp / "hdr.img"
    img, pw, plain, offset = volume_with_plaintext(ws, "--sector-size", "4096", header=hdr)
    interrupt_reencryption(img, pw, "--decrypt", header=hdr)
    segs = active_segments(header_json(hdr))
    # It runs backward: the end of the device is decrypted first.
    assert [sg["type"] for sg in segs] == ["crypt", "linear"], segs
    assert next(v for v in header_json(hdr)["keyslots"].values() if v["type"] == "reencrypt")["direction"] == "backward"
    boundary = int(segs[0]["size"])
    assert int(segs[1]["offset"]) == boundary
    b = serve_luks(ws, img, pw, "--header", hdr)
    assert read_all(b.uri, len(plain)) == plain
    patch = os.urandom(8192)
    at = (boundary + len(plain)) // 2
    with NBDClient(b.uri) as c:
        c.connect()
        c.write(at, patch)  # the decrypted part
        c.write(boundary - 100, patch)  # across the boundary
        c.flush()
    assert b.stop() == 0
    expect = bytearray(plain)
    expect[at : at + 8192] = patch
    expect[boundary - 100 : boundary - 100 + 8192] = patch
    with open(img, "rb") as f:
        f.seek(boundary)
        assert f.read() == bytes(expect[boundary:]), "the decrypted part is not plaintext on disk"
    b = serve_luks(ws, img, pw, "--header", hdr)
    assert read_all(b.uri, len(plain)) == bytes(expect)
    assert b.stop() == 0


# --- luks reencrypt: continuing what cryptsetup started --------------------------------------------


@pytest.mark.parametrize("resilience", ["checksum", "none"])
def test_cryptbridge_finishes_what_cryptsetup_initialized(ws, resilience):
    """`cryptsetup reencrypt --init-only` (a new 256-bit key with 512-byte sectors) ->
    `cryptbridge luks reencrypt` -> cryptsetup sees a finished volume (no requirement, one
    segment, the old keyslot gone) and the data area decrypts to the plaintext with the key
    `cryptsetup luksDump --dump-volume-key` prints (independent XTS)."""
    need("cryptsetup")
    img, pw, plain, offset = volume_with_plaintext(ws, "--sector-size", "4096", "--key-size", "512")
    cryptsetup("reencrypt", "--init-only", "--batch-mode", "--force-offline-reencrypt", "--key-file", pw, "--pbkdf", "pbkdf2", *FAST_PBKDF2,
               "--resilience", resilience, "--key-size", "256", "--sector-size", "512", img)  # fmt: skip
    p = cb("luks", "reencrypt", "--resume-only", "--batch-mode", "--json", "--hotzone-size", "1M", "--key-file", str(pw), str(img), timeout=300)
    assert p.returncode == 0, p.stderr
    assert_no_panic(p.stderr.decode())
    lines = [json.loads(x) for x in p.stdout.decode().splitlines()]
    assert lines and lines[-1]["done"] == lines[-1]["size"] == len(plain), lines[-3:]
    meta = header_json(img)
    assert "requirements" not in meta["config"], meta["config"]
    assert list(meta["segments"]) == ["0"] and meta["segments"]["0"]["size"] == "dynamic"
    assert [v["type"] for v in meta["keyslots"].values()] == ["luks2"], meta["keyslots"]
    dump = cryptsetup("luksDump", img).stdout.decode()
    assert "reencrypt" not in dump.lower().replace("reencryption", ""), dump
    new_key = volume_key(img, pw)
    assert len(new_key) == 32
    assert data_layout(img) == (offset, 512)
    with open(img, "rb") as f:
        f.seek(offset)
        raw = f.read(len(plain))
    assert xts_sectors(new_key, raw, 512, 0, False) == plain, "the data area does not decrypt with the new key"
    assert cryptsetup("open", "--test-passphrase", "--key-file", pw, img, check=False).returncode == 0


def test_cryptsetup_finishes_what_cryptbridge_stopped(ws):
    """cryptbridge stopped by SIGINT at a commit point (checksum resilience) -> `cryptsetup
    reencrypt --resume-only` finishes -> the data decrypts with the new key. And a second
    cryptbridge run while the first holds cryptsetup's reencryption lock is refused."""
    need("cryptsetup")
    img, pw, plain, offset = volume_with_plaintext(ws)
    cryptsetup("reencrypt", "--init-only", "--batch-mode", "--force-offline-reencrypt", "--key-file", pw, "--pbkdf", "pbkdf2", *FAST_PBKDF2, img)
    from conftest import require_binary

    p = subprocess.Popen([require_binary(), "luks", "reencrypt", "--json", "--threads", "1", "--hotzone-size", "64K", "--key-file", pw, img],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    first = p.stdout.readline()
    assert first, p.stderr.read()
    second = cb("luks", "reencrypt", "--key-file", str(pw), str(img))
    assert second.returncode == 1 and b"already running" in second.stderr, second.stderr
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert_no_panic(err.decode())
    meta = header_json(img)
    segs = active_segments(meta)
    assert "requirements" in meta["config"] and len(segs) == 2, "cryptbridge did not stop part way"
    assert not any("in-reencryption" in sg.get("flags", []) for sg in segs)
    cryptsetup("reencrypt", "--resume-only", "--batch-mode", "--force-offline-reencrypt", "--key-file", pw, img, timeout=300)
    assert "requirements" not in header_json(img)["config"]
    new_key = volume_key(img, pw)
    with open(img, "rb") as f:
        f.seek(offset)
        raw = f.read(len(plain))
    assert xts_sectors(new_key, raw, data_layout(img)[1], 0, False) == plain


def test_cryptsetup_recovers_a_hotzone_cryptbridge_left_by_kill_9(ws):
    """cryptbridge killed with SIGKILL while a hotzone is flagged `in-reencryption` (checksum
    resilience): cryptsetup recovers the hotzone from our checksums and metadata and finishes; every
    byte then decrypts to the plaintext with the new key."""
    need("cryptsetup")
    img, pw, plain, offset = volume_with_plaintext(ws)
    cryptsetup("reencrypt", "--init-only", "--batch-mode", "--force-offline-reencrypt", "--key-file", pw, "--pbkdf", "pbkdf2", *FAST_PBKDF2, img)
    from conftest import require_binary

    p = subprocess.Popen([require_binary(), "luks", "reencrypt", "--json", "--threads", "1", "--hotzone-size", "256K", "--key-file", pw, img],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    caught = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and p.poll() is None:
        # Stopped while we look, so that what we see is what it leaves when killed.
        p.send_signal(signal.SIGSTOP)
        meta = header_json(img)
        if meta and any("in-reencryption" in sg.get("flags", []) for sg in meta["segments"].values()):
            caught = True
            break
        p.send_signal(signal.SIGCONT)
        time.sleep(0.003)
    p.kill()
    p.wait(timeout=30)
    assert caught, "never saw a hotzone flagged in-reencryption"
    meta = header_json(img)
    assert "requirements" in meta["config"], "the run finished before it was killed"
    hot = [sg for sg in active_segments(meta) if "in-reencryption" in sg.get("flags", [])]
    assert hot, "killed outside a hotzone"
    # Served? No: a crashed hotzone is refused until it is recovered.
    refused_unchanged(ws, img, pw, "--resume-only")
    # cryptsetup recovers a crashed hotzone in `repair` (offline), then resumes.
    cryptsetup("repair", "--batch-mode", "--key-file", pw, img, timeout=300)
    assert not any("in-reencryption" in sg.get("flags", []) for sg in active_segments(header_json(img)))
    cryptsetup("reencrypt", "--resume-only", "--batch-mode", "--force-offline-reencrypt", "--key-file", pw, img, timeout=300)
    assert "requirements" not in header_json(img)["config"]
    new_key = volume_key(img, pw)
    with open(img, "rb") as f:
        f.seek(offset)
        raw = f.read(len(plain))
    assert xts_sectors(new_key, raw, data_layout(img)[1], 0, False) == plain, "a sector is wrong after cryptsetup's recovery"
