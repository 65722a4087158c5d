"""LUKS interop: volumes made by cryptsetup (LUKS2 and LUKS1) and qemu-img (LUKS1), served with
``cryptbridge serve --type luks``.

For every volume: data written through NBD reads back, and the bytes on disk are checked with an
independent AES-XTS (Python ``cryptography``) under the volume key that ``cryptsetup luksDump
--dump-volume-key`` prints, at the data offset that ``luksDump`` prints, with dm-crypt's IV numbering
(plain64 counting 512-byte units, also for 4096-byte sectors). Where the tools allow it without
device-mapper, cryptsetup's and qemu's own crypto read or write the same data: ``cryptsetup
reencrypt`` (offline, userspace) encrypts and decrypts a detached-header volume, and ``qemu-io``
reads and writes LUKS1 images through qemu's luks driver.

Skipped, with the reason, where cryptsetup or qemu-img is missing.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import MiB, Bridge, assert_no_panic, pty_read_until, require_binary, run
from nbd_client import NBDClient
from reference.xts_ref import xts_decrypt

PASS = b"correct horse\nbattery staple\n"  # newlines inside and at the end: key files are read whole
FAST_ARGON = ["--pbkdf-memory", "32768", "--pbkdf-parallel", "2", "--pbkdf-force-iterations", "4"]
FAST_PBKDF2 = ["--pbkdf-force-iterations", "1000"]


def tool(name: str) -> Optional[str]:
    for p in (shutil.which(name), f"/usr/sbin/{name}", f"/sbin/{name}"):
        if p and os.path.exists(p):
            return p
    return None


def need(name: str) -> str:
    p = tool(name)
    if p is None:
        pytest.skip(f"{name} not installed (scripts/install-deps.sh installs cryptsetup-bin and qemu-utils)")
    return p


def write_file(path: Path, data: bytes) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def cryptsetup(*args, check: bool = True, timeout: float = 120):
    return run([need("cryptsetup"), *args], timeout=timeout, check=check)


def luks_format(img: Path, pass_file: Path, *opts, header: Optional[Path] = None) -> None:
    extra = ["--header", header] if header else []
    cryptsetup("luksFormat", "--batch-mode", "--key-file", pass_file, *extra, *opts, img)


def volume_key(img: Path, pass_file: Path) -> bytes:
    """The volume key as cryptsetup prints it (``MK dump:`` in 2.6, ``Volume key`` later)."""
    out = cryptsetup("luksDump", "--dump-volume-key", "--batch-mode", "--key-file", pass_file, img).stdout.decode()
    m = re.search(r"(?:MK dump|Volume key):?\s*\n?((?:\s*(?:[0-9a-f]{2}\s+)+)+)", out)
    assert m, f"no volume key in luksDump output:\n{out}"
    key = bytes.fromhex("".join(m.group(1).split()))
    assert len(key) in (16, 24, 32, 48, 64), out
    return key


def data_layout(img: Path) -> tuple[int, int]:
    """(data offset in bytes, sector size) from ``cryptsetup luksDump``, not from cryptbridge."""
    out = cryptsetup("luksDump", img).stdout.decode()
    if "Version:       \t1" in out or re.search(r"Version:\s+1\b", out):
        m = re.search(r"Payload offset:\s*(\d+)", out)
        assert m, out
        return int(m.group(1)) * 512, 512
    seg = out.split("Data segments:", 1)[1]
    off = re.search(r"offset:\s*(\d+) \[bytes\]", seg)
    sector = re.search(r"sector:\s*(\d+) \[bytes\]", seg)
    assert off and sector, out
    return int(off.group(1)), int(sector.group(1))


def serve_luks(ws, backing: Path, pass_file: Optional[Path], *extra, label: str = "luks") -> Bridge:
    ws._n += 1
    args = ["--type", "luks", "--backing", backing, "--unix", ws.sockdir / f"l{ws._n}.sock", *extra]
    if pass_file is not None:
        args += ["--key-file", pass_file]
    b = Bridge(ws.tmp, args, label=f"{label}{ws._n}")
    ws.bridges.append(b)
    return b.start()


def serve_fails(ws, *args, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs serve expecting it to refuse to start (stdin is not a terminal)."""
    sock = ws.sockdir / "refused.sock"
    p = run([require_binary(), "serve", "--type", "luks", "--unix", sock, *args], timeout=timeout, stdin=subprocess.DEVNULL)
    assert_no_panic(p.stderr.decode(errors="replace"))
    assert b"ready" not in p.stdout, p.stdout
    return p


def decrypt_sectors(raw: bytes, key: bytes, offset: int, sector: int, first: int, count: int) -> bytes:
    """Sectors [first, first+count) of the data area, decrypted with plain64 IVs in 512-byte units."""
    out = bytearray()
    for i in range(first, first + count):
        start = offset + i * sector
        out += xts_decrypt(key, i * sector // 512, raw[start : start + sector])
    return bytes(out)


def write_and_check(ws, img: Path, pass_file: Path, key: bytes, offset: int, sector: int, *extra, data_file: Optional[Path] = None) -> dict:
    """Writes extents through the bridge, reads them back, then checks the on-disk ciphertext."""
    data_file = data_file or img
    b = serve_luks(ws, data_file, pass_file, *extra)
    expected_size = (data_file.stat().st_size - offset) // sector * sector
    rnd = os.urandom
    with NBDClient(b.uri) as c:
        c.connect()
        assert c.size == expected_size, (c.size, expected_size)
        extents = {0: rnd(3 * sector), (c.size // 2) // sector * sector: rnd(8192), c.size - sector: rnd(sector), sector * 5 + 100: rnd(300)}
        for off, data in extents.items():
            c.write(off, data)
        c.flush()
        for off, data in extents.items():
            assert c.read(off, len(data)) == data, f"read back at {off}"
    assert b.stop() == 0
    assert_no_panic(b.stderr())
    raw = data_file.read_bytes()
    for off, data in extents.items():
        first, last = off // sector, (off + len(data) - 1) // sector
        plain = decrypt_sectors(raw, key, offset, sector, first, last - first + 1)
        rel = off - first * sector
        assert plain[rel : rel + len(data)] == data, f"on-disk bytes at {off} do not decrypt to what was written"
    if sector > 512:
        # The check tells the IV conventions apart: counting 4096-byte sectors would not decrypt.
        i = next(iter(extents)) // sector + 1
        start = offset + i * sector
        assert xts_decrypt(key, i, raw[start : start + sector]) != extents[0][sector : 2 * sector]
    return extents


# --- the matrix ----------------------------------------------------------------------------------

LUKS2 = [(kdf, sector, bits) for kdf in ("argon2id", "pbkdf2") for sector in (512, 4096) for bits in (256, 512)]
LUKS2 += [("argon2i", 4096, 512)]


@pytest.mark.parametrize("kdf,sector,bits", LUKS2, ids=[f"{k}-s{s}-k{b}" for k, s, b in LUKS2])
def test_luks2_cryptsetup(ws, kdf, sector, bits):
    img = sparse(ws.tmp / "v.img", 24 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    fast = FAST_PBKDF2 + ["--hash", "sha256"] if kdf == "pbkdf2" else FAST_ARGON
    luks_format(img, pw, "--type", "luks2", "--cipher", "aes-xts-plain64", "--key-size", str(bits), "--sector-size", str(sector), "--pbkdf", kdf, *fast)
    key = volume_key(img, pw)
    offset, dumped_sector = data_layout(img)
    assert dumped_sector == sector and len(key) == bits // 8
    write_and_check(ws, img, pw, key, offset, sector)
    # cryptsetup still accepts the volume and passphrase afterwards.
    cryptsetup("open", "--test-passphrase", "--key-file", pw, img)


LUKS1 = [("sha256", 512), ("sha1", 256), ("sha512", 512)]


@pytest.mark.parametrize("hash_,bits", LUKS1, ids=[f"{h}-k{b}" for h, b in LUKS1])
def test_luks1_cryptsetup(ws, hash_, bits):
    img = sparse(ws.tmp / "v.img", 8 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, "--type", "luks1", "--cipher", "aes-xts-plain64", "--key-size", str(bits), "--hash", hash_, *FAST_PBKDF2)
    key = volume_key(img, pw)
    offset, sector = data_layout(img)
    extents = write_and_check(ws, img, pw, key, offset, sector)
    qemu_io_check(ws, img, pw, extents)


def qemu_img_luks(ws, img: Path, pw: Path, size: str) -> None:
    """qemu-img create -f luks. qemu calibrates PBKDF2 on thread CPU time, which a coarse clock
    can report as 0 ms ("Unable to get accurate CPU usage"): a few tries."""
    qemu_img = need("qemu-img")
    err = b""
    for _ in range(8):
        img.unlink(missing_ok=True)
        p = run([qemu_img, "create", "-q", "-f", "luks", "--object", f"secret,id=sec0,file={pw}", "-o", "key-secret=sec0,iter-time=10", img, size], timeout=120)
        if p.returncode == 0:
            return
        err = p.stderr
    pytest.skip(f"qemu-img create -f luks failed 8 times here: {err.decode(errors='replace').strip()}")


def qemu_io(img: Path, pw: Path, command: str, read_only: bool = True) -> str:
    args = [need("qemu-io")] + (["-r"] if read_only else [])
    args += ["--object", f"secret,id=sec0,file={pw}", "--image-opts", f"driver=luks,key-secret=sec0,file.driver=file,file.filename={img}", "-c", command]
    p = run(args, timeout=120, check=True)
    return (p.stdout + p.stderr).decode(errors="replace")


def qemu_io_check(ws, img: Path, pw: Path, extents: dict) -> None:
    """qemu's own LUKS driver reads what the bridge wrote, and the bridge reads what qemu writes."""
    if tool("qemu-io") is None:
        return  # the on-disk check above already ran; qemu-io is the extra, independent reader
    off, data = next(iter(extents.items()))
    out = qemu_io(img, pw, f"read -v {off} 512")
    dumped = bytes.fromhex("".join(re.findall(r"^[0-9a-f]{8}:\s+((?:[0-9a-f]{2}\s){16})", out, re.M)).replace(" ", ""))
    assert dumped == data[:512], f"qemu-io reads other bytes than the bridge wrote:\n{out[:2000]}"
    out = qemu_io(img, pw, "write -P 0x5c 65536 4096", read_only=False)
    assert "wrote 4096/4096" in out, out
    b = serve_luks(ws, img, pw, "--read-only", label="qemu-check")
    with NBDClient(b.uri) as c:
        c.connect()
        assert c.read(65536, 4096) == b"\x5c" * 4096, "the bridge reads other bytes than qemu wrote"
    assert b.stop() == 0


def test_luks1_qemu_img(ws):
    pw = write_file(ws.tmp / "pass", b"qemu secret, no newline")
    img = ws.tmp / "q.img"
    qemu_img_luks(ws, img, pw, "6M")
    key = volume_key(img, pw)
    offset, sector = data_layout(img)
    assert sector == 512
    extents = write_and_check(ws, img, pw, key, offset, sector)
    qemu_io_check(ws, img, pw, extents)


@pytest.mark.parametrize("sector", [512, 4096])
def test_cryptsetup_encrypts_bridge_reads_bridge_writes_cryptsetup_decrypts(ws, sector):
    """Data encrypted by cryptsetup's own code (offline reencryption, userspace, detached header)
    reads back through the bridge; data the bridge writes decrypts with cryptsetup."""
    need("cryptsetup")
    plain = os.urandom(4 * MiB)
    data = write_file(ws.tmp / "data.img", plain)
    hdr = ws.tmp / "hdr.img"
    pw = write_file(ws.tmp / "pass", PASS)
    p = cryptsetup("reencrypt", "--encrypt", "--type", "luks2", "--batch-mode", "--force-offline-reencrypt", "--key-file", pw,
                   "--header", hdr, "--sector-size", str(sector), "--pbkdf", "pbkdf2", *FAST_PBKDF2, data, check=False)  # fmt: skip
    if p.returncode != 0:
        pytest.skip(f"cryptsetup offline reencryption unavailable here: {p.stderr.decode(errors='replace').strip()}")
    assert data.read_bytes() != plain
    b = serve_luks(ws, data, pw, "--header", hdr)
    with NBDClient(b.uri) as c:
        c.connect()
        assert c.size == len(plain)
        got = b"".join(c.read(o, 1 * MiB) for o in range(0, len(plain), MiB))
        assert got == plain, "the bridge does not read what cryptsetup encrypted"
        new = os.urandom(2 * MiB)
        c.write(MiB, new)
        c.flush()
    assert b.stop() == 0
    expect = plain[:MiB] + new + plain[3 * MiB :]
    p = cryptsetup("reencrypt", "--decrypt", "--batch-mode", "--force-offline-reencrypt", "--key-file", pw, "--header", hdr, data, check=False)
    if p.returncode != 0:
        pytest.skip(f"cryptsetup offline decryption unavailable here: {p.stderr.decode(errors='replace').strip()}")
    assert data.read_bytes() == expect, "cryptsetup does not decrypt what the bridge wrote"


# --- passphrases and keyslots --------------------------------------------------------------------


@pytest.fixture
def luks2_img(ws):
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, "--type", "luks2", "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    return img, pw


def test_wrong_passphrase_exits_1_with_a_clear_message(ws, luks2_img):
    img, _ = luks2_img
    bad = write_file(ws.tmp / "bad", PASS.rstrip(b"\n"))  # cryptsetup too reads the newline as part of it
    p = serve_fails(ws, "--backing", img, "--key-file", bad)
    assert p.returncode == 1, p
    assert "no key available with this passphrase (tried keyslot 0)" in p.stderr.decode(), p.stderr


def test_a_key_file_ending_in_a_newline_is_pointed_out(ws):
    """A passphrase set at a prompt has no newline; a key file made with echo has one. Both tools
    read key files whole, so it does not open; the error says why and how to fix it, for serve and
    for every luks keyslot command, and following the advice opens it."""
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    typed = write_file(ws.tmp / "typed", b"typed at a prompt")
    luks_format(img, typed, "--type", "luks2", "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    echoed = write_file(ws.tmp / "echoed", b"typed at a prompt\n")
    assert cryptsetup("open", "--test-passphrase", "--key-file", echoed, img, check=False).returncode != 0
    new = write_file(ws.tmp / "new", b"new")
    runs = [
        serve_fails(ws, "--backing", img, "--key-file", echoed),
        run([require_binary(), "luks", "test-passphrase", "--key-file", echoed, img], timeout=60, stdin=subprocess.DEVNULL),
        run([require_binary(), "luks", "add-key", "--key-file", echoed, *FAST_PBKDF2, "--pbkdf", "pbkdf2", img, new], timeout=60, stdin=subprocess.DEVNULL),
        run([require_binary(), "luks", "change-key", "--key-file", echoed, *FAST_PBKDF2, "--pbkdf", "pbkdf2", img, new], timeout=60, stdin=subprocess.DEVNULL),
        run([require_binary(), "luks", "remove-key", "--key-file", echoed, img], timeout=60, stdin=subprocess.DEVNULL),
        run([require_binary(), "luks", "kill-slot", "--batch-mode", "--key-file", echoed, img, "0"], timeout=60, stdin=subprocess.DEVNULL),
        run([require_binary(), "serve", "--type", "luks", "--backing", img, "--key-file", "-", "--unix", ws.sockdir / "x.sock"], input=b"typed at a prompt\n", timeout=60),
    ]
    for p in runs:
        err = p.stderr.decode()
        assert p.returncode == 1 and "no key available with this passphrase" in err, err
        assert "newline, which is part of the passphrase" in err, err
    assert f"truncate -s -1 {echoed}" in runs[0].stderr.decode()
    assert "standard input ended with a newline" in runs[-1].stderr.decode()
    # A wrong passphrase without a newline gets no such note.
    other = write_file(ws.tmp / "other", b"something else")
    p = run([require_binary(), "luks", "test-passphrase", "--key-file", other, img], timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode == 1 and b"no key available" in p.stderr and b"newline" not in p.stderr, p.stderr
    assert cryptsetup("luksDump", img).returncode == 0 and volume_key(img, typed)  # nothing changed
    run(["truncate", "-s", "-1", echoed], check=True)
    assert run([require_binary(), "luks", "test-passphrase", "--key-file", echoed, img], timeout=60).returncode == 0
    cryptsetup("open", "--test-passphrase", "--key-file", echoed, img)


def test_passphrase_from_stdin_and_no_passphrase_without_a_terminal(ws, luks2_img):
    img, pw = luks2_img
    p = run([require_binary(), "serve", "--type", "luks", "--backing", img, "--key-file", "-", "--unix", ws.sockdir / "x.sock"],
            input=b"wrong", timeout=60)  # fmt: skip
    assert p.returncode == 1 and b"no key available" in p.stderr, p.stderr
    p = serve_fails(ws, "--backing", img)
    assert p.returncode == 1 and b"no passphrase" in p.stderr and b"--key-file" in p.stderr, p.stderr
    # The right passphrase on stdin opens it.
    sock = ws.sockdir / "stdin.sock"
    proc = subprocess.Popen([str(require_binary()), "serve", "--type", "luks", "--backing", str(img), "--key-file", "-", "--unix", str(sock)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        proc.stdin.write(PASS)
        proc.stdin.close()
        line = proc.stdout.readline().decode()
        assert line.startswith("ready nbd+unix://"), (line, proc.stderr.read1().decode() if proc.poll() is not None else "")
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_key_slots(ws, luks2_img):
    img, pw = luks2_img
    pw2 = write_file(ws.tmp / "pass2", b"second passphrase")
    cryptsetup("luksAddKey", "--batch-mode", "--key-file", pw, "--key-slot", "3", "--pbkdf", "pbkdf2", *FAST_PBKDF2, img, pw2)
    b = serve_luks(ws, img, pw2)
    assert "keyslot 3" in b.stderr(), b.stderr()
    b.stop()
    b = serve_luks(ws, img, pw2, "--key-slot", "3")
    b.stop()
    p = serve_fails(ws, "--backing", img, "--key-file", pw2, "--key-slot", "0")
    assert p.returncode == 1 and "tried keyslot 0)" in p.stderr.decode(), p.stderr
    p = serve_fails(ws, "--backing", img, "--key-file", pw2, "--key-slot", "5")
    assert p.returncode == 1 and "keyslot 5 is not active" in p.stderr.decode(), p.stderr
    cryptsetup("luksKillSlot", "--batch-mode", "--key-file", pw2, img, "0")
    p = serve_fails(ws, "--backing", img, "--key-file", pw)
    assert p.returncode == 1 and "tried keyslot 3)" in p.stderr.decode(), p.stderr


def test_plain_options_conflict_with_luks(ws, luks2_img):
    img, pw = luks2_img
    for extra in (["--cipher", "xts(aes)"], ["--sector-size", "4096"], ["--size", "1M"], ["--key-size", "256"], ["--passthrough"]):
        key = [] if extra == ["--passthrough"] else ["--key-file", pw]  # clap itself refuses --passthrough with a key file
        p = serve_fails(ws, "--backing", img, *key, *extra)
        assert p.returncode == 2 and b"--type luks takes the volume's parameters from its header" in p.stderr, (extra, p.stderr)
    p = run([require_binary(), "serve", "--backing", img, "--header", img, "--key-file", pw, "--unix", ws.sockdir / "p.sock"], timeout=30)
    assert p.returncode == 2 and b"need --type luks" in p.stderr, p.stderr
    p = serve_fails(ws, "--backing", ws.tmp / "missing.img", "--key-file", pw)
    assert p.returncode == 1 and b"missing.img" in p.stderr, p.stderr


# --- damaged and unsupported headers ---------------------------------------------------------------


def rewrite_luks2(img: Path, edit=None, corrupt_primary: bool = False) -> None:
    """Edits the LUKS2 JSON of both copies and recomputes their sha256 checksums (the on-disk
    format: the hash over the binary header with its checksum zeroed, then the whole JSON area)."""
    with open(img, "r+b") as f:
        f.seek(0)
        hdr_size = struct.unpack(">Q", f.read(16)[8:16])[0]
        for off in (0, hdr_size):
            f.seek(off)
            area = bytearray(f.read(hdr_size))
            assert area[:6] in (b"LUKS\xba\xbe", b"SKUL\xba\xbe")
            meta = json.loads(bytes(area[4096:]).split(b"\0", 1)[0])
            if edit:
                edit(meta)
            text = json.dumps(meta, separators=(",", ":")).encode()
            area[4096:] = text + bytes(hdr_size - 4096 - len(text))
            area[448:512] = bytes(64)
            area[448:480] = hashlib.sha256(bytes(area)).digest()
            f.seek(off)
            f.write(area)


def test_damaged_primary_header_falls_back_to_the_secondary(ws):
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, "--type", "luks2", "--sector-size", "4096", "--pbkdf", "argon2id", *FAST_ARGON)
    key = volume_key(img, pw)
    offset, sector = data_layout(img)
    with open(img, "r+b") as f:  # one byte of the primary JSON area
        f.seek(4096 + 2)
        c = f.read(1)
        f.seek(4096 + 2)
        f.write(bytes([c[0] ^ 0x20]))
    write_and_check(ws, img, pw, key, offset, sector)
    err = ws.bridges[-1].stderr()
    assert "primary header is damaged" in err and "checksum mismatch" in err and "secondary" in err, err
    with open(img, "r+b") as f:  # now the secondary too
        f.seek(16384 + 4096 + 2)
        f.write(b"\xff")
    p = serve_fails(ws, "--backing", img, "--key-file", pw)
    assert p.returncode == 1 and b"both LUKS2 header copies are damaged" in p.stderr, p.stderr


@pytest.mark.parametrize(
    "what,edit,needle",
    [
        ("unknown requirement", lambda m: m["config"].update(requirements={"mandatory": ["cryptbridge-test-requirement"]}), "requirement `cryptbridge-test-requirement`"),
        ("integrity", lambda m: m["segments"]["0"].update(integrity={"type": "hmac(sha256)", "journal_encryption": "none", "journal_integrity": "none"}), "dm-integrity"),
        ("reencryption segment flag", lambda m: m["segments"]["0"].update(flags=["backup-final"]), "reencryption"),
    ],
    ids=["requirement", "integrity", "segment-flag"],
)
def test_unsupported_luks2_states_are_refused(ws, luks2_img, what, edit, needle):
    img, pw = luks2_img
    rewrite_luks2(img, edit)
    if what == "unknown requirement":  # the edit is a well-formed header: cryptsetup reads it too
        out = cryptsetup("luksDump", img, check=False)
        assert b"cryptbridge-test-requirement" in out.stdout + out.stderr, out
    # Refused before the passphrase is even asked for: without a key file nor a terminal the
    # message is still about the header.
    for extra in (["--key-file", str(pw)], []):
        p = serve_fails(ws, "--backing", img, *extra)
        assert p.returncode == 1 and needle in p.stderr.decode(), (what, p.stderr)


def keyslot_area(img: Path, key: str) -> int:
    """Keyslot 0's area `offset` or `size`, as the header says."""
    with open(img, "rb") as f:
        hdr_size = struct.unpack(">Q", f.read(16)[8:16])[0]
        f.seek(4096)
        meta = json.loads(f.read(hdr_size - 4096).split(b"\0", 1)[0])
    return int(meta["keyslots"]["0"]["area"][key])


@pytest.mark.parametrize(
    "what,edit,needle",
    [
        ("1 TiB area", lambda m: m["keyslots"]["0"]["area"].update(size=str(1 << 40)), "runs past the keyslots area"),
        ("area over the header", lambda m: m["keyslots"]["0"]["area"].update(offset="4096"), "overlaps the header copies"),
        ("keyslots area over the data", lambda m: m["config"].update(keyslots_size=str(int(m["segments"]["0"]["offset"]))), "runs into the data"),
    ],
    ids=["huge-area", "area-over-header", "keyslots-over-data"],
)
def test_luks2_geometry_cryptsetup_refuses_is_refused(ws, luks2_img, what, edit, needle):
    """A header whose keyslot areas lie where cryptsetup does not allow them (checksums
    recomputed, so only the geometry is wrong) is not a valid LUKS device for cryptsetup, and a
    damaged header here: not served, and not reported as a wrong passphrase."""
    img, pw = luks2_img
    assert keyslot_area(img, "size") > 0
    rewrite_luks2(img, edit)
    out = cryptsetup("open", "--test-passphrase", "--key-file", pw, img, check=False)
    assert out.returncode != 0, (what, out)
    assert b"not a valid LUKS device" in out.stdout + out.stderr, (what, out)
    p = serve_fails(ws, "--backing", img, "--key-file", pw)
    err = p.stderr.decode()
    assert p.returncode == 1 and "both LUKS2 header copies are damaged" in err and needle in err, (what, err)
    assert "no key available" not in err, err


def test_cryptsetup_integrity_volume_is_refused(ws):
    img = sparse(ws.tmp / "v.img", 40 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    p = cryptsetup("luksFormat", "--batch-mode", "--type", "luks2", "--integrity", "hmac-sha256", "--integrity-no-wipe", "--pbkdf", "pbkdf2",
                   *FAST_PBKDF2, "--key-file", pw, img, check=False)  # fmt: skip
    if p.returncode != 0:
        pytest.skip(f"cryptsetup luksFormat --integrity needs device-mapper here: {p.stderr.decode(errors='replace').strip()}")
    p = serve_fails(ws, "--backing", img, "--key-file", pw)
    assert p.returncode == 1 and b"dm-integrity" in p.stderr, p.stderr


def test_luks1_unsupported_iv_is_refused(ws):
    """An IV mode outside the catalogue (benbi; the old ones served are in test_luks_ivmodes.py)."""
    img = sparse(ws.tmp / "v.img", 8 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    p = cryptsetup("luksFormat", "--batch-mode", "--type", "luks1", "--cipher", "aes-cbc-benbi", "--key-size", "256", *FAST_PBKDF2,
                   "--key-file", pw, img, check=False)  # fmt: skip
    if p.returncode != 0:
        pytest.skip(f"cryptsetup cannot make an aes-cbc-benbi volume here: {p.stderr.decode(errors='replace').strip()}")
    p = serve_fails(ws, "--backing", img, "--key-file", pw)
    assert p.returncode == 1 and b"cipher `aes-cbc-benbi` is not supported: the IV `benbi` is not implemented" in p.stderr, p.stderr


# --- luks format / luks dump ---------------------------------------------------------------------

FORMATS = [
    ("luks2", "argon2id", 512, 512),
    ("luks2", "argon2i", 4096, 256),
    ("luks2", "pbkdf2", 4096, 512),
    ("luks1", "pbkdf2", 512, 512),
    ("luks1", "pbkdf2", 512, 256),
]


def cb_format(img: Path, pw: Path, luks_type: str, pbkdf: str, sector: int, bits: int, *extra):
    force = "1000" if pbkdf == "pbkdf2" else "4"
    args = ["luks", "format", "--type", luks_type, "--pbkdf", pbkdf, "--key-size", str(bits), "--pbkdf-force-iterations", force,
            "--pbkdf-memory", "32768", "--key-file", pw, *extra, img]  # fmt: skip
    if luks_type == "luks2":
        args[2:2] = ["--sector-size", str(sector)]
    return run([require_binary(), *args], timeout=120)


@pytest.mark.parametrize("luks_type,pbkdf,sector,bits", FORMATS, ids=[f"{t}-{p}-s{s}-k{b}" for t, p, s, b in FORMATS])
def test_luks_format_is_read_by_cryptsetup(ws, luks_type, pbkdf, sector, bits):
    need("cryptsetup")
    img = sparse(ws.tmp / "v.img", 24 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    p = cb_format(img, pw, luks_type, pbkdf, sector, bits)
    assert p.returncode == 0, p.stderr
    dump = cryptsetup("luksDump", img).stdout.decode()
    assert re.search(rf"Version:\s+{luks_type[-1]}\b", dump), dump
    if luks_type == "luks2":
        assert f"PBKDF:      {pbkdf}" in dump and f"sector: {sector} [bytes]" in dump, dump
    cryptsetup("open", "--test-passphrase", "--key-file", pw, img)
    bad = write_file(ws.tmp / "bad", b"not it")
    assert cryptsetup("open", "--test-passphrase", "--key-file", bad, img, check=False).returncode != 0
    key = volume_key(img, pw)
    offset, dumped_sector = data_layout(img)
    assert dumped_sector == sector and len(key) == bits // 8
    extents = write_and_check(ws, img, pw, key, offset, sector)
    if luks_type == "luks1":
        qemu_io_check(ws, img, pw, extents)
    # cryptsetup manages keyslots of the header made here.
    pw2 = write_file(ws.tmp / "pass2", b"added by cryptsetup")
    cryptsetup("luksAddKey", "--batch-mode", "--key-file", pw, "--pbkdf-force-iterations", "1000", "--pbkdf", "pbkdf2", img, pw2)
    b = serve_luks(ws, img, pw2, "--read-only")
    with NBDClient(b.uri) as c:
        c.connect()
        off, data = next(iter(extents.items()))
        assert c.read(off, len(data)) == data
    assert b.stop() == 0
    # luks dump --json agrees with cryptsetup.
    j = json.loads(run([require_binary(), "luks", "dump", "--json", img], timeout=30, check=True).stdout)
    assert j["version"] == int(luks_type[-1]) and j["refused"] is None
    assert (j["data_segment"]["offset"], j["data_segment"]["sector_size"], j["data_segment"]["key_size"]) == (offset, sector, bits)
    # An existing header is not overwritten without --batch-mode.
    p = cb_format(img, pw, luks_type, pbkdf, sector, bits)
    assert p.returncode == 1 and b"already contains a 'crypto_LUKS' superblock signature" in p.stderr, p.stderr
    cryptsetup("open", "--test-passphrase", "--key-file", pw, img)


def test_luks_format_detached_header(ws):
    need("cryptsetup")
    data = sparse(ws.tmp / "data.img", 4 * MiB)
    hdr = ws.tmp / "hdr.img"
    pw = write_file(ws.tmp / "pass", PASS)
    p = cb_format(data, pw, "luks2", "argon2id", 4096, 512, "--header", hdr)
    assert p.returncode == 0, p.stderr
    assert oct(hdr.stat().st_mode & 0o777) == "0o600"
    cryptsetup("open", "--test-passphrase", "--key-file", pw, "--header", hdr, data)
    key = volume_key(hdr, pw)
    offset, sector = data_layout(hdr)
    assert (offset, sector) == (0, 4096)
    write_and_check(ws, data, pw, key, offset, sector, "--header", hdr)
    # Without --header the data file holds no header: refused clearly.
    p = serve_fails(ws, "--backing", data, "--key-file", pw)
    assert p.returncode == 1 and b"no LUKS header" in p.stderr, p.stderr


def mbr(path: Path) -> None:
    """A DOS partition table written here byte by byte: one Linux partition from sector 2048."""
    entry = struct.pack("<B3sB3sII", 0x00, b"\x00\x00\x00", 0x83, b"\x00\x00\x00", 2048, 8192)
    with open(path, "r+b") as f:
        f.seek(446)
        f.write(entry + bytes(48) + b"\x55\xaa")


def mkfs(tool_name: str, *args) -> callable:
    def make(path: Path) -> None:
        run([need(tool_name), *args, path], timeout=120, check=True)

    return make


# (id, how the signature is made, what blkid and luks format call it, the words of the warning)
SIGNATURES = [
    ("ext4", mkfs("mkfs.ext4", "-q", "-F"), "ext4", "an ext4 filesystem"),
    ("swap", mkfs("mkswap"), "swap", "swap space"),
    ("mbr", mbr, "dos", "a DOS/MBR partition table"),
    ("xfs", mkfs("mkfs.xfs", "-q", "-f"), "xfs", "an XFS filesystem"),
    ("btrfs", mkfs("mkfs.btrfs", "-q", "-f"), "btrfs", "a btrfs filesystem"),
    ("luks", lambda p: luks_format(p, write_file(p.parent / "old", b"old"), "--pbkdf", "pbkdf2", *FAST_PBKDF2), "crypto_LUKS", "a LUKS2 header"),
]


def blkid_types(img: Path) -> dict:
    p = run([need("blkid"), "-p", "-o", "export", img], timeout=30)
    return dict(line.split("=", 1) for line in p.stdout.decode().splitlines() if "=" in line)


@pytest.mark.parametrize("make,kind,words", [s[1:] for s in SIGNATURES], ids=[s[0] for s in SIGNATURES])
def test_luks_format_names_what_it_would_overwrite(ws, make, kind, words):
    """cryptsetup's rule: a signature on the target (found by blkid) is named, and without a
    terminal nothing is overwritten unless --batch-mode."""
    need("cryptsetup")
    img = sparse(ws.tmp / "v.img", 320 * MiB if kind in ("xfs", "btrfs") else 24 * MiB)
    make(img)
    found = blkid_types(img)
    assert kind in (found.get("TYPE"), found.get("PTTYPE")), found  # what blkid itself says is there
    before = hashlib.sha256(img.read_bytes()).hexdigest()
    pw = write_file(ws.tmp / "pass", PASS)
    p = cb_format(img, pw, "luks2", "pbkdf2", 512, 512)
    err = p.stderr.decode()
    assert p.returncode == 1, err
    assert f"WARNING: Device {img} already contains a '{kind}' " in err and words in err, err
    assert "--batch-mode" in err, err
    assert hashlib.sha256(img.read_bytes()).hexdigest() == before, "the refused format changed the image"
    p = cb_format(img, pw, "luks2", "pbkdf2", 512, 512, "--batch-mode")
    assert p.returncode == 0, p.stderr
    assert b"WARNING" not in p.stderr, p.stderr
    assert blkid_types(img).get("TYPE") == "crypto_LUKS"
    cryptsetup("open", "--test-passphrase", "--key-file", pw, img)


def test_luks_format_offset_must_be_a_multiple_of_4096_bytes(ws):
    """--offset is in 512-byte sectors, as cryptsetup's; both refuse 40001 (not 4096-byte aligned)
    and take 40008."""
    img = sparse(ws.tmp / "v.img", 24 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    theirs = cryptsetup("luksFormat", "--batch-mode", "--key-file", pw, "--pbkdf", "pbkdf2", *FAST_PBKDF2, "--offset", "40001", img, check=False)
    assert theirs.returncode != 0 and b"not multiple of 4096 bytes" in theirs.stderr, theirs.stderr
    for luks_type in ("luks2", "luks1"):
        p = cb_format(img, pw, luks_type, "pbkdf2", 512, 512, "--offset", "40001")
        # An option that cannot make a volume is a usage error (exit 2), found before any I/O.
        assert p.returncode == 2 and b"not a multiple of 4096 bytes" in p.stderr, p.stderr
        assert img.read_bytes() == bytes(24 * MiB), "a refused format wrote something"
    p = cb_format(img, pw, "luks2", "pbkdf2", 512, 512, "--offset", "40008")
    assert p.returncode == 0, p.stderr
    assert data_layout(img) == (40008 * 512, 512)
    cryptsetup("open", "--test-passphrase", "--key-file", pw, img)
    # Below LUKS2's default 16 MiB the keyslots area ends at the data, as cryptsetup makes it.
    img = sparse(ws.tmp / "v4.img", 24 * MiB)
    p = cb_format(img, pw, "luks2", "pbkdf2", 512, 512, "--offset", "8192")
    assert p.returncode == 0, p.stderr
    assert data_layout(img) == (4 * MiB, 512)
    meta = json.loads(cryptsetup("luksDump", "--dump-json-metadata", img).stdout)
    assert meta["config"]["keyslots_size"] == str(4 * MiB - 32768)
    cryptsetup("open", "--test-passphrase", "--key-file", pw, img)
    assert run([require_binary(), "luks", "dump", img], timeout=60).returncode == 0


def test_luks_format_refuses_before_any_kdf(ws):
    """A key size the cipher does not take, and a data device with no room after the data offset,
    are refused at once (a 20 s --iter-time benchmark never starts) and nothing is written."""
    pw = write_file(ws.tmp / "pass", PASS)
    img = sparse(ws.tmp / "v.img", 24 * MiB)
    small = sparse(ws.tmp / "small.img", 16 * MiB)  # LUKS2's data starts at 16 MiB
    # (target, options, message, exit status): options that cannot make a volume are usage errors
    # (2); a device too small for them is a runtime error (1).
    cases = [
        (img, ["--key-size", "384"], b"--key-size 384 is not a key size of aes-xts-plain64: use 256 or 512", 2),
        (img, ["--key-size", "512", "--cipher", "xchacha12,aes-adiantum-plain64"], b"use 256", 2),
        (small, [], b"no room for data after the data offset 16777216", 1),
        (small, ["--type", "luks1", "--offset", str(16 * MiB // 512)], b"no room for data", 1),
    ]
    for target, opts, needle, status in cases:
        t = time.monotonic()
        p = run([require_binary(), "luks", "format", "--iter-time", "20000", "--key-file", pw, *opts, target], timeout=60)
        assert p.returncode == status and needle in p.stderr, (opts, p.stderr)
        assert time.monotonic() - t < 5, f"{opts}: refused only after {time.monotonic() - t:.1f} s"
        assert target.read_bytes() == bytes(target.stat().st_size), opts


def keyslot_iterations(img: Path) -> int:
    """Keyslot 0's PBKDF2 iterations as cryptsetup luksDump prints them."""
    out = cryptsetup("luksDump", img).stdout.decode()
    m = re.search(r"Key Slot 0: ENABLED\s*\n\s*Iterations:\s*(\d+)", out) or re.search(r"PBKDF:\s+pbkdf2\s*\n\s*Hash:.*\n\s*Iterations:\s*(\d+)", out)
    assert m, out
    return int(m.group(1))


@pytest.mark.parametrize("luks_type,bits", [("luks2", 512), ("luks1", 256)])
def test_iter_time_means_what_it_means_to_cryptsetup(ws, luks_type, bits):
    """For the same --iter-time, luks format picks about the PBKDF2 iterations cryptsetup
    luksFormat picks on this machine (so cryptsetup's unlock takes about that long), within 2x
    either way: the median of three runs each, for a noisy shared machine."""
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    theirs, mine = [], []
    for _ in range(3):
        luks_format(img, pw, "--type", luks_type, "--pbkdf", "pbkdf2", "--key-size", str(bits), "--iter-time", "500")
        theirs.append(keyslot_iterations(img))
        p = run([require_binary(), "luks", "format", "--batch-mode", "--type", luks_type, "--pbkdf", "pbkdf2", "--key-size", str(bits),
                 "--iter-time", "500", "--key-file", pw, img], timeout=120)  # fmt: skip
        assert p.returncode == 0, p.stderr
        mine.append(keyslot_iterations(img))
    ratio = sorted(mine)[1] / sorted(theirs)[1]
    assert 0.5 <= ratio <= 2, f"ours {mine}, cryptsetup's {theirs}"


def test_luks_dump_text_and_refusal(ws, luks2_img):
    img, _ = luks2_img
    out = run([require_binary(), "luks", "dump", img], timeout=30, check=True).stdout.decode()
    assert "Version:       \t2" in out and "Served as:     aes-xts-plain64 512-bit" in out, out
    rewrite_luks2(img, lambda m: m["config"].update(requirements={"mandatory": ["cryptbridge-test-requirement"]}))
    out = run([require_binary(), "luks", "dump", img], timeout=30, check=True).stdout.decode()
    assert "Served as:     refused: LUKS2 requirement `cryptbridge-test-requirement`" in out, out
    p = run([require_binary(), "luks", "dump", ws.tmp / "pass"], timeout=30)
    assert p.returncode == 1 and b"no LUKS header" in p.stderr, p.stderr


def test_passphrase_prompt_on_a_terminal_without_echo(ws):
    """Without --key-file on a terminal: a prompt, the typed passphrase not echoed, the line's
    newline not part of it."""
    import pty
    import termios

    img = sparse(ws.tmp / "v.img", 20 * MiB)
    secret = b"typed at the prompt"
    pw = write_file(ws.tmp / "pass", secret)
    luks_format(img, pw, "--type", "luks2", "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    sock = ws.sockdir / "tty.sock"
    pid, fd = pty.fork()
    if pid == 0:  # the child: serve on the pty
        os.execv(str(require_binary()), [str(require_binary()), "serve", "--type", "luks", "--backing", str(img), "--unix", str(sock)])
    seen = b""

    def read_until(needle: bytes, timeout: float = 30) -> None:
        nonlocal seen
        seen = pty_read_until(fd, seen, needle, timeout)
        assert needle in seen, seen

    try:
        read_until(b"Enter passphrase for")
        # Type only once echo is off (what was typed ahead would be echoed by the tty itself).
        deadline = time.monotonic() + 30
        while termios.tcgetattr(fd)[3] & termios.ECHO and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not termios.tcgetattr(fd)[3] & termios.ECHO, "echo stays on at the prompt"
        os.write(fd, secret + b"\n")
        read_until(b"ready nbd+unix://")
        assert secret not in seen, "the passphrase was echoed"
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        os.close(fd)


def test_luks2_hctr2_volume_formatted_here(ws):
    """A LUKS2 volume with a wide-block data cipher (aes-hctr2-plain64): cryptsetup opens its
    keyslot (aes-xts-plain64/512, cryptsetup's keyslot cipher for such volumes), and the data on
    disk is HCTR2 (Python reference) with dm-crypt's 32-byte plain64 tweak in 512-byte units."""
    from reference import hctr2

    need("cryptsetup")
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    p = run([require_binary(), "luks", "format", "--cipher", "aes-hctr2-plain64", "--key-size", "256", "--sector-size", "4096",
             "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000", "--key-file", pw, img], timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    cryptsetup("open", "--test-passphrase", "--key-file", pw, img)
    key = volume_key(img, pw)
    offset, sector = data_layout(img)
    assert (len(key), sector) == (32, 4096)
    b = serve_luks(ws, img, pw)
    data = os.urandom(2 * sector)
    with NBDClient(b.uri) as c:
        c.connect()
        c.write(3 * sector, data)
        c.flush()
        assert c.read(3 * sector, len(data)) == data
    assert b.stop() == 0
    raw = img.read_bytes()
    for i in (3, 4):
        tweak = (i * sector // 512).to_bytes(16, "little") + bytes(16)
        want = hctr2.encrypt(key, tweak, data[(i - 3) * sector : (i - 2) * sector])
        assert raw[offset + i * sector : offset + (i + 1) * sector] == want, f"sector {i}"


@pytest.mark.parametrize("spec", ["aes-eme2-plain64", "capi:eme2(aes)-plain64"])
def test_luks2_eme2_volume_formatted_here(ws, spec):
    """A header naming EME2 (either spelling `serve --cipher` takes) opens: the LUKS reader and the
    CLI share one cipher catalogue. Data on disk is EME2 (Python reference) under the 16-byte
    plain64 tweak, counted in 512-byte units."""
    from reference import eme2

    need("cryptsetup")
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    p = run([require_binary(), "luks", "format", "--cipher", spec, "--key-size", "512", "--sector-size", "4096",
             "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000", "--key-file", pw, img], timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    key = volume_key(img, pw)
    offset, sector = data_layout(img)
    assert (len(key), sector) == (64, 4096)
    b = serve_luks(ws, img, pw)
    data = os.urandom(sector)
    with NBDClient(b.uri) as c:
        c.connect()
        c.write(2 * sector, data)
        c.flush()
        assert c.read(2 * sector, len(data)) == data
    assert b.stop() == 0
    raw = img.read_bytes()
    want = eme2.encrypt(key, (2 * sector // 512).to_bytes(16, "little"), data)
    assert raw[offset + 2 * sector : offset + 3 * sector] == want


def test_luks_format_refuses_a_bare_crypto_api_name(ws):
    """`xts(aes)` names the cipher but is no dm-crypt spec; a header holding it would not open in
    cryptsetup, so format refuses it (serve --cipher takes it, there is no header there)."""
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    p = run([require_binary(), "luks", "format", "--cipher", "xts(aes)", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000",
             "--key-file", pw, img], timeout=60)  # fmt: skip
    assert p.returncode == 2 and b"not a dm-crypt spec" in p.stderr, p.stderr
