"""Online reencryption (issue 28): `serve --reencrypt` advances a LUKS2 reencryption while it
serves the volume, and crash recovery of a hotzone, both ways with cryptsetup.

Every check of the result is independent of cryptbridge: cryptsetup says whether the volume is
finished and prints the new volume key, and the data area is decrypted with Python's
`cryptography` XTS.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import MiB, assert_no_panic, cb, require_binary
from nbd_client import NBDClient
from test_luks import FAST_PBKDF2, cryptsetup, data_layout, need, serve_fails, serve_luks, volume_key
from test_metrics import http_get, samples
from test_reencrypt import active_segments, header_json, read_all, volume_with_plaintext, xts_sectors


def unix_connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(path))
    return s


def init(img: Path, pw: Path, *opts) -> None:
    cryptsetup("reencrypt", "--init-only", "--batch-mode", "--force-offline-reencrypt", "--key-file", pw, "--pbkdf", "pbkdf2", *FAST_PBKDF2, *opts, img)


def finished(img: Path) -> bool:
    meta = header_json(img)
    return bool(meta) and "requirements" not in meta["config"]


def hot(meta) -> bool:
    return bool(meta) and any("in-reencryption" in sg.get("flags", []) for sg in active_segments(meta))


def check_data_area(img: Path, pw: Path, offset: int, expect: bytes) -> None:
    """cryptsetup shows a finished volume, and its data area decrypts to `expect` with the key it
    prints."""
    assert finished(img), header_json(img)["config"]
    dump = cryptsetup("luksDump", img).stdout.decode()
    assert "online-reencrypt" not in dump, dump
    key = volume_key(img, pw)
    got_offset, sector = data_layout(img)
    assert got_offset == offset
    with open(img, "rb") as f:
        f.seek(offset)
        raw = f.read(len(expect))
    assert xts_sectors(key, raw, sector, 0, False) == expect, "the data area does not decrypt to what was written"


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("resilience", ["checksum", "journal", "none"])
def test_serve_reencrypt_finishes_under_client_writes(ws, resilience):
    """`cryptsetup reencrypt --init-only` (512-bit key, 4096-byte sectors -> 256-bit key, 512-byte
    sectors) -> `serve --reencrypt` while a client writes and reads back all over the volume (and
    fio verifies its own writes where fio is installed) -> cryptsetup shows a finished volume whose
    data area decrypts with the new key to the plaintext plus every acknowledged write."""
    need("cryptsetup")
    img, pw, plain, offset = volume_with_plaintext(ws, "--sector-size", "4096", "--key-size", "512")
    init(img, pw, "--resilience", resilience, "--key-size", "256", "--sector-size", "512")
    b = serve_luks(ws, img, pw, "--reencrypt", "--metrics", str(ws.sockdir / "m.sock"))
    expect = bytearray(plain)
    rng = random.Random(7)
    errors: list = []
    stop = threading.Event()

    def client():
        try:
            with NBDClient(b.uri) as c:
                c.connect()
                while not stop.is_set():
                    off = rng.randrange(0, len(plain) - 4 * MiB - 70_000)
                    data = os.urandom(rng.choice([512, 4096, 5000, 65536]))
                    c.write(off, data)
                    expect[off : off + len(data)] = data
                    back = c.read(off, len(data))
                    if back != data:
                        errors.append(f"read back at {off} differs")
                        return
        except Exception as e:  # reported below
            errors.append(repr(e))

    t = threading.Thread(target=client)
    t.start()
    fio = None
    if os.path.exists("/usr/bin/fio"):
        # fio's own verify over the last 4 MiB (the Python client stays out of it).
        fio = subprocess.run(
            ["fio", "--name=verify", "--ioengine=nbd", f"--uri={b.uri}", "--rw=randwrite", "--bs=4k", "--iodepth=8",
             f"--offset={len(plain) - 4 * MiB}", "--size=4M", "--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120,
        )  # fmt: skip
    try:
        wait_for(lambda: "reencryption finished" in b.stderr() or not b.alive, 240, "the reencryption to finish")
    finally:
        stop.set()
        t.join(timeout=60)
    assert not errors, errors
    if fio is not None:
        assert fio.returncode == 0, fio.stdout.decode()[-3000:]
        # fio wrote its own pattern there: read it back as the expected bytes.
        with NBDClient(b.uri) as c:
            c.connect()
            tail = c.read(len(plain) - 4 * MiB, 4 * MiB)
        expect[len(plain) - 4 * MiB :] = tail
    status, text = http_get(lambda: unix_connect(ws.sockdir / "m.sock"))
    got = {k.split("{")[0]: v for k, v in samples(text).items() if k.startswith("cryptbridge_reencryption")}
    assert status == 200 and got == {"cryptbridge_reencryption_done_bytes": len(plain), "cryptbridge_reencryption_size_bytes": len(plain)}, got
    assert read_all(b.uri, len(plain)) == bytes(expect)
    assert b.stop() == 0
    err = b.stderr()
    assert_no_panic(err)
    assert "re-encrypting online from byte 0" in err, err
    check_data_area(img, pw, offset, bytes(expect))


def test_sigterm_stops_at_a_commit_point_and_a_restart_resumes(ws):
    """SIGTERM while `serve --reencrypt` runs (slowed by --reencrypt-rate): exit 0, the header part
    way with no hotzone; a second cryptbridge (or cryptsetup) is refused while one holds the lock;
    a restart with --reencrypt continues from there and finishes."""
    need("cryptsetup")
    img, pw, plain, offset = volume_with_plaintext(ws)
    init(img, pw)
    b = serve_luks(ws, img, pw, "--reencrypt", "--reencrypt-rate", "8M")
    wait_for(lambda: len(active_segments(header_json(img) or {"segments": {}})) >= 2, 60, "progress")
    other = cb("luks", "reencrypt", "--key-file", str(pw), str(img))
    assert other.returncode == 1 and b"already running" in other.stderr, other.stderr
    p = serve_fails(ws, "--backing", img, "--key-file", pw, "--reencrypt")
    assert p.returncode == 1 and b"already running" in p.stderr, p.stderr
    assert b.stop() == 0
    meta = header_json(img)
    segs = active_segments(meta)
    assert "requirements" in meta["config"] and len(segs) == 2 and not hot(meta), segs
    stopped_at = int(segs[0]["size"])
    assert 0 < stopped_at < len(plain)
    assert "reencryption stopped at byte" in b.stderr(), b.stderr()
    b = serve_luks(ws, img, pw, "--reencrypt")
    wait_for(lambda: "reencryption finished" in b.stderr(), 120, "the resumed reencryption to finish")
    assert f"re-encrypting online from byte {stopped_at}" in b.stderr()
    assert read_all(b.uri, len(plain)) == plain
    assert b.stop() == 0
    check_data_area(img, pw, offset, plain)


def kill_in_hotzone(p: subprocess.Popen, img: Path) -> None:
    """SIGKILL `p` while the header shows a hotzone flagged `in-reencryption` (stopped while we
    look, so that what we see is what it leaves)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        p.send_signal(signal.SIGSTOP)
        if hot(header_json(img)):
            p.kill()
            p.wait(timeout=30)
            return
        p.send_signal(signal.SIGCONT)
        time.sleep(0.002)
    p.kill()
    p.wait(timeout=30)
    raise AssertionError("never saw a hotzone flagged in-reencryption")


@pytest.mark.parametrize("resilience", ["checksum", "journal"])
def test_cryptbridge_recovers_a_hotzone_cryptsetup_left_by_kill_9(ws, resilience):
    """`cryptsetup reencrypt` killed with SIGKILL in the middle of a step -> `cryptbridge luks
    reencrypt --resume-only` recovers the hotzone (checksum: the blocks still under the old key;
    journal: from the area) and finishes -> every byte decrypts with the new key."""
    need("cryptsetup")
    img, pw, plain, offset = volume_with_plaintext(ws)
    init(img, pw, "--resilience", resilience)
    # A kill while cryptsetup writes the primary header leaves it torn: the secondary (the commit
    # before, no hotzone yet) is the header then, and a new attempt starts from it.
    for _ in range(5):
        p = subprocess.Popen(
            [need("cryptsetup"), "reencrypt", "--resume-only", "--batch-mode", "--force-offline-reencrypt", "--hotzone-size", "1M",
             "--key-file", pw, img], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        kill_in_hotzone(p, img)
        if hot(json.loads(cryptsetup("luksDump", "--dump-json-metadata", img).stdout)):
            break
    else:
        pytest.fail("no kill of cryptsetup in a hotzone with a whole header in 5 attempts")
    r = cb("luks", "reencrypt", "--resume-only", "--key-file", str(pw), str(img), timeout=300)
    assert r.returncode == 0, r.stderr
    assert b"recovered the hotzone" in r.stderr, r.stderr
    check_data_area(img, pw, offset, plain)


@pytest.mark.parametrize("recoverer", ["cryptbridge", "cryptsetup"])
def test_kill_9_of_serve_reencrypt_is_recovered(ws, recoverer):
    """`serve --reencrypt` (checksum resilience) killed with SIGKILL in the middle of a step, while
    a client writes -> recovered and finished by `serve --reencrypt` again, or by `cryptsetup
    repair` + `cryptsetup reencrypt --resume-only` -> every acknowledged write is there and every
    byte decrypts with the new key."""
    need("cryptsetup")
    img, pw, plain, offset = volume_with_plaintext(ws)
    init(img, pw)
    b = serve_luks(ws, img, pw, "--reencrypt", "--reencrypt-rate", "16M")  # slow enough to be caught in a hotzone
    expect = bytearray(plain)
    with NBDClient(b.uri) as c:
        c.connect()
        for i in range(64):
            off = (i * 997 * 4096) % (len(plain) - 8192)
            data = os.urandom(8192)
            c.write(off, data)
            c.flush()
            expect[off : off + 8192] = data
    kill_in_hotzone(b.proc, img)
    assert hot(header_json(img))
    if recoverer == "cryptbridge":
        b = serve_luks(ws, img, pw, "--reencrypt")
        wait_for(lambda: "reencryption finished" in b.stderr(), 120, "the reencryption to finish")
        assert "recovered the hotzone" in b.stderr(), b.stderr()
        assert read_all(b.uri, len(plain)) == bytes(expect)
        assert b.stop() == 0
    else:
        cryptsetup("repair", "--batch-mode", "--key-file", pw, img, timeout=300)
        if not finished(img):  # a repair of the last hotzone finishes the reencryption
            cryptsetup("reencrypt", "--resume-only", "--batch-mode", "--force-offline-reencrypt", "--key-file", pw, img, timeout=300)
    check_data_area(img, pw, offset, bytes(expect))


def test_reencrypt_refusals(ws):
    """--reencrypt on a volume with no reencryption, read-only or plain: exit 1 (2 for usage),
    nothing written."""
    need("cryptsetup")
    img, pw, _, _ = volume_with_plaintext(ws)
    before = img.read_bytes()[: 16 * MiB]
    p = serve_fails(ws, "--backing", img, "--key-file", pw, "--reencrypt")
    assert p.returncode == 1 and b"no reencryption is in progress" in p.stderr, p.stderr
    p = serve_fails(ws, "--backing", img, "--key-file", pw, "--reencrypt", "--read-only")
    assert p.returncode == 2 and b"--reencrypt needs" in p.stderr, p.stderr
    p = subprocess.run([require_binary(), "serve", "--backing", img, "--unix", ws.sockdir / "x.sock", "--key-file", pw, "--reencrypt-rate", "1M"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, timeout=60)  # fmt: skip
    assert p.returncode == 2 and b"--reencrypt-rate needs --reencrypt" in p.stderr, p.stderr
    assert img.read_bytes()[: 16 * MiB] == before


def test_a_volume_in_reencryption_is_served_under_the_reencryption_lock(ws):
    """A plain `serve` (no --reencrypt) of a volume in reencryption holds cryptsetup's reencryption
    lock while it serves: `cryptsetup reencrypt --resume-only` (which would move data under the
    server) is refused meanwhile, and runs once the server is gone; and a server does not start
    while another process holds the lock."""
    need("cryptsetup")
    img, pw, plain, offset = volume_with_plaintext(ws)
    init(img, pw)
    b = serve_luks(ws, img, pw)
    before = img.read_bytes()
    p = cryptsetup("reencrypt", "--resume-only", "--batch-mode", "--force-offline-reencrypt", "--key-file", pw, img, check=False)
    assert p.returncode != 0 and b"already running" in p.stderr, p.stderr
    assert img.read_bytes() == before
    assert read_all(b.uri, len(plain)) == plain
    assert b.stop() == 0
    # `luks reencrypt` stopped (SIGSTOP) once it runs: it holds the lock.
    held = subprocess.Popen([require_binary(), "luks", "reencrypt", "--resume-only", "--key-file", str(pw), "--hotzone-size", "1M", str(img)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        line = b""
        while b"re-encrypting from byte" not in line:
            line = held.stderr.readline()
            assert line, "luks reencrypt ended before it ran"
        held.send_signal(signal.SIGSTOP)
        p = serve_fails(ws, "--backing", img, "--key-file", pw)
        assert p.returncode == 1 and b"already running" in p.stderr, p.stderr
    finally:
        held.send_signal(signal.SIGCONT)
        assert held.wait(timeout=300) == 0, held.stderr.read()
    check_data_area(img, pw, offset, plain)


@pytest.mark.parametrize("old", ["aes-cbc-essiv:sha256", "aes-cbc-plain64", "aes-xts-plain", "aes-xts-essiv:sha256"])
def test_an_old_volume_moves_to_xts_plain64_while_served(ws, old):
    """A LUKS2 volume in one of the old IV modes, its data written through the bridge ->
    `cryptsetup reencrypt --init-only --cipher aes-xts-plain64 --key-size 512` -> `serve
    --reencrypt` -> the data area decrypts with the new key (independent XTS) to what was written."""
    need("cryptsetup")
    img = ws.tmp / "old.img"
    with open(img, "wb") as f:
        f.truncate(48 * MiB)
    pw = ws.tmp / "pass"
    pw.write_bytes(b"old volume")
    os.chmod(pw, 0o600)
    cryptsetup("luksFormat", "--batch-mode", "--type", "luks2", "--key-file", pw, "--pbkdf", "pbkdf2", *FAST_PBKDF2, "--cipher", old, "--key-size", "256", img)
    offset, _ = data_layout(img)
    plain = os.urandom(48 * MiB - offset)
    b = serve_luks(ws, img, pw)
    with NBDClient(b.uri) as c:
        c.connect()
        for o in range(0, len(plain), MiB):
            c.write(o, plain[o : o + MiB])
        c.flush()
    assert b.stop() == 0
    init(img, pw, "--cipher", "aes-xts-plain64", "--key-size", "512")
    b = serve_luks(ws, img, pw, "--reencrypt")
    wait_for(lambda: "reencryption finished" in b.stderr(), 120, "the reencryption to finish")
    assert read_all(b.uri, len(plain)) == plain
    assert b.stop() == 0
    assert "cipher: aes-xts-plain64" in cryptsetup("luksDump", img).stdout.decode()
    check_data_area(img, pw, offset, plain)


@pytest.mark.parametrize("finisher", ["cryptbridge", "cryptsetup"])
@pytest.mark.parametrize("mode", ["encrypt", "decrypt"])
def test_encrypt_and_decrypt_with_a_detached_header(ws, mode, finisher):
    """`cryptsetup reencrypt --encrypt|--decrypt --init-only --header HDR` (the data in place) ->
    `serve --reencrypt --header HDR` while a client writes -> finished by the bridge, or stopped
    part way (SIGTERM) and finished by `cryptsetup reencrypt --resume-only` -> encrypt: the data
    device decrypts with the key cryptsetup prints; decrypt: it holds the plaintext."""
    need("cryptsetup")
    size = 24 * MiB
    img, hdr, pw = ws.tmp / "d.img", ws.tmp / "h.img", ws.tmp / "pass"
    pw.write_bytes(b"detached")
    os.chmod(pw, 0o600)
    with open(img, "wb") as f:
        f.truncate(size)
    plain = bytearray(os.urandom(size))
    if mode == "decrypt":
        cryptsetup("luksFormat", "--batch-mode", "--type", "luks2", "--key-file", pw, "--pbkdf", "pbkdf2", *FAST_PBKDF2, "--header", hdr, img)
        sector = data_layout(hdr)[1]
        with open(img, "r+b") as f:
            f.write(xts_sectors(volume_key(hdr, pw), bytes(plain), sector, 0, True))
        cryptsetup("reencrypt", "--decrypt", "--init-only", "--batch-mode", "--force-offline-reencrypt", "--header", hdr, "--key-file", pw, img)
    else:
        with open(hdr, "wb") as f:
            f.truncate(16 * MiB)
        img.write_bytes(bytes(plain))
        cryptsetup("reencrypt", "--encrypt", "--init-only", "--batch-mode", "--force-offline-reencrypt", "--type", "luks2", "--header", hdr,
                   "--key-file", pw, "--pbkdf", "pbkdf2", *FAST_PBKDF2, img)  # fmt: skip
    rate = ["--reencrypt-rate", "4M"] if finisher == "cryptsetup" else []
    b = serve_luks(ws, img, pw, "--header", hdr, "--reencrypt", *rate)
    with NBDClient(b.uri) as c:
        c.connect()
        for i in range(40):
            off = (i * 7919 * 512) % (size - 70_000)
            data = os.urandom(65_536 + i)
            c.write(off, data)
            plain[off : off + len(data)] = data
        c.flush()
    if finisher == "cryptbridge":
        wait_for(lambda: "reencryption finished" in b.stderr(), 120, "the reencryption to finish")
        assert read_all(b.uri, size) == bytes(plain)
        assert b.stop() == 0
    else:
        assert b.stop() == 0
        assert "reencryption stopped at byte" in b.stderr(), b.stderr()
        cryptsetup("reencrypt", "--resume-only", "--batch-mode", "--force-offline-reencrypt", "--header", hdr, "--key-file", pw, img, timeout=300)
    assert finished(hdr), header_json(hdr)["config"]
    raw = img.read_bytes()
    if mode == "decrypt":
        assert raw == bytes(plain), "the data device does not hold the plaintext"
    else:
        assert xts_sectors(volume_key(hdr, pw), raw, data_layout(hdr)[1], 0, False) == bytes(plain)
