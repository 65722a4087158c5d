"""Keyslot changes (``luks add-key``, ``remove-key``, ``kill-slot``, ``change-key``) checked with the
real cryptsetup, both ways: our changes on cryptsetup-made LUKS2 and LUKS1 volumes must be taken by
``cryptsetup open --test-passphrase`` and shown by ``cryptsetup luksDump``; cryptsetup's changes on
volumes made here must open here. Every header change keeps the volume key (as ``cryptsetup
luksDump --dump-volume-key`` prints it) and leaves the data area's bytes as they were (hashed
before and after). A header locked by another process (``flock``, as cryptsetup locks image files)
is refused and left as it was.

Skipped, with the reason, where cryptsetup is missing.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import MiB, assert_no_panic, cb, pty_read_until, require_binary
from test_luks import FAST_ARGON, FAST_PBKDF2, PASS, cryptsetup, data_layout, luks_format, serve_luks, sparse, volume_key, write_file

# (id, luksFormat options, options for our new keyslots)
KINDS = [
    ("luks2-argon2id", ["--type", "luks2", "--pbkdf", "argon2id", *FAST_ARGON], ["--pbkdf", "argon2id", *FAST_ARGON]),
    ("luks2-pbkdf2", ["--type", "luks2", "--pbkdf", "pbkdf2", "--hash", "sha512", *FAST_PBKDF2], ["--pbkdf", "pbkdf2", *FAST_PBKDF2]),
    ("luks1", ["--type", "luks1", "--hash", "sha256", *FAST_PBKDF2], FAST_PBKDF2),
]
IDS = [k[0] for k in KINDS]


def data_hash(img: Path, offset: int) -> str:
    h = hashlib.sha256()
    with open(img, "rb") as f:
        f.seek(offset)
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fill_data(img: Path, offset: int) -> None:
    """Random bytes over the whole data area, so that any write there changes its hash."""
    size = img.stat().st_size
    with open(img, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(size - offset))


def opens(img: Path, pw: Path, *extra) -> bool:
    """cryptsetup's own verdict on a passphrase (no device-mapper needed)."""
    p = cryptsetup("open", "--test-passphrase", "--key-file", pw, *extra, img, check=False)
    return p.returncode == 0


def cs_slots(img: Path, *extra) -> list[int]:
    """Active keyslots as cryptsetup luksDump lists them."""
    import re

    out = cryptsetup("luksDump", *extra, img).stdout.decode()
    if re.search(r"Version:\s+1\b", out):
        return [int(m) for m in re.findall(r"Key Slot (\d+): ENABLED", out)]
    ks = out.split("Keyslots:", 1)[1].split("Tokens:", 1)[0]
    return [int(m) for m in re.findall(r"^\s+(\d+): luks2", ks, re.M)]


def ours(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    """Our `luks` subcommand, stdin not a terminal."""
    p = subprocess.run([str(require_binary()), "luks", *map(str, args)], stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    assert_no_panic(p.stderr.decode(errors="replace"))
    return p


@pytest.fixture
def vol(ws, request):
    """A cryptsetup-made volume with its data area filled: (img, passphrase file, our KDF options,
    volume key, data offset, data hash)."""
    _, fmt, new_kdf = request.param
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, *fmt)
    offset, _ = data_layout(img)
    fill_data(img, offset)
    return img, pw, new_kdf, volume_key(img, pw), offset, data_hash(img, offset)


def unchanged(img: Path, pw: Path, vk: bytes, offset: int, digest: str) -> None:
    assert volume_key(img, pw) == vk, "the volume key changed"
    assert data_hash(img, offset) == digest, "the data area changed"


@pytest.mark.parametrize("vol", KINDS, ids=IDS, indirect=True)
def test_add_key_on_a_cryptsetup_volume(ws, vol):
    img, pw, kdf, vk, offset, digest = vol
    new = write_file(ws.tmp / "new", b"a new passphrase\n")
    p = ours("add-key", img, "--key-file", pw, new, *kdf)
    assert p.returncode == 0, p.stderr
    assert opens(img, new) and opens(img, pw)
    assert cs_slots(img) == [0, 1]
    assert opens(img, new, "--key-slot", "1")
    # An explicit free slot; a taken one is refused with nothing written.
    third = write_file(ws.tmp / "third", b"third")
    p = ours("add-key", img, "-d", new, "--key-slot", "5", third, *kdf)
    assert p.returncode == 0, p.stderr
    assert cs_slots(img) == [0, 1, 5] and opens(img, third, "--key-slot", "5")
    p = ours("add-key", img, "-d", new, "--key-slot", "5", third, *kdf)
    assert p.returncode == 1 and b"keyslot 5 is in use" in p.stderr, p.stderr
    unchanged(img, new, vk, offset, digest)
    # cryptsetup's own consistency check of the LUKS2 metadata passes (repair finds nothing to do).
    assert cryptsetup("repair", "--batch-mode", img, check=False).returncode == 0


@pytest.mark.parametrize("luks_type", ["luks2", "luks1"])
def test_cryptsetup_add_key_on_a_volume_made_here(ws, luks_type):
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    kdf = FAST_PBKDF2 if luks_type == "luks1" else ["--pbkdf", "argon2id", *FAST_ARGON]
    p = cb("luks", "format", "--type", luks_type, "--key-file", pw, *kdf, img, timeout=120)
    assert p.returncode == 0, p.stderr
    new = write_file(ws.tmp / "new", b"added by cryptsetup")
    cryptsetup("luksAddKey", "--batch-mode", "--key-file", pw, *kdf, img, new)
    b = serve_luks(ws, img, new)
    assert "keyslot 1" in b.stderr(), b.stderr()
    b.stop()
    # And our remove-key of cryptsetup's keyslot is taken by cryptsetup.
    p = ours("remove-key", img, new)
    assert p.returncode == 0, p.stderr
    assert not opens(img, new) and opens(img, pw)


@pytest.mark.parametrize("vol", KINDS, ids=IDS, indirect=True)
def test_remove_key_and_kill_slot(ws, vol):
    img, pw, kdf, vk, offset, digest = vol
    b_pw = write_file(ws.tmp / "b", b"passphrase b")
    c_pw = write_file(ws.tmp / "c", b"passphrase c")
    cs_kdf = kdf if "--pbkdf" in kdf else ["--pbkdf", "pbkdf2", *kdf]
    cryptsetup("luksAddKey", "--batch-mode", "--key-file", pw, *cs_kdf, img, b_pw)
    cryptsetup("luksAddKey", "--batch-mode", "--key-file", pw, "--key-slot", "4", *cs_kdf, img, c_pw)
    assert cs_slots(img) == [0, 1, 4]

    # remove-key: the keyslot that B opens goes; A and C stay.
    p = ours("remove-key", img, "--key-file", b_pw)
    assert p.returncode == 0, p.stderr
    assert cs_slots(img) == [0, 4]
    assert not opens(img, b_pw) and opens(img, pw) and opens(img, c_pw)
    # A passphrase that opens nothing: exit 1, clear message, nothing changed.
    p = ours("remove-key", img, "--key-file", b_pw)
    assert p.returncode == 1 and b"no key available with this passphrase" in p.stderr, p.stderr

    # kill-slot needs a remaining passphrase: C's own does not count for slot 4.
    p = ours("kill-slot", img, "4", "--key-file", c_pw)
    assert p.returncode == 1 and b"NOT wiped" in p.stderr, p.stderr
    assert cs_slots(img) == [0, 4]
    p = ours("kill-slot", img, "4", "--key-file", pw)
    assert p.returncode == 0, p.stderr
    assert cs_slots(img) == [0] and not opens(img, c_pw) and opens(img, pw)
    p = ours("kill-slot", img, "4", "--key-file", pw)
    assert p.returncode == 1 and b"keyslot 4 is not in use" in p.stderr, p.stderr
    unchanged(img, pw, vk, offset, digest)

    # The last keyslot: refused without a terminal unless --batch-mode, by either command.
    before = img.read_bytes()[:offset]
    for args in (["kill-slot", img, "0", "--key-file", pw], ["remove-key", img, "--key-file", pw]):
        p = ours(*args)
        assert p.returncode == 1 and b"last keyslot" in p.stderr and b"--batch-mode" in p.stderr, p.stderr
        assert img.read_bytes()[:offset] == before, "a refused removal wrote to the header"
    p = ours("kill-slot", img, "0", "--batch-mode")
    assert p.returncode == 0, p.stderr
    assert cs_slots(img) == [] and not opens(img, pw)
    assert data_hash(img, offset) == digest


@pytest.mark.parametrize("vol", KINDS, ids=IDS, indirect=True)
def test_change_key(ws, vol):
    img, pw, kdf, vk, offset, digest = vol
    new = write_file(ws.tmp / "new", b"changed passphrase")
    p = ours("change-key", img, "--key-file", pw, new, *kdf)
    assert p.returncode == 0, p.stderr
    # Without --key-slot the new passphrase goes to a new keyslot and the old one is wiped.
    assert cs_slots(img) == [1]
    assert opens(img, new) and not opens(img, pw)
    # With --key-slot it keeps its number.
    newer = write_file(ws.tmp / "newer", b"changed again")
    p = ours("change-key", img, "--key-file", new, "--key-slot", "1", newer, *kdf)
    assert p.returncode == 0, p.stderr
    assert cs_slots(img) == [1] and opens(img, newer, "--key-slot", "1") and not opens(img, new)
    wrong = write_file(ws.tmp / "wrong", b"not it")
    p = ours("change-key", img, "--key-file", wrong, new, *kdf)
    assert p.returncode == 1 and b"no key available with this passphrase (tried keyslot 1)" in p.stderr, p.stderr
    unchanged(img, newer, vk, offset, digest)
    # test-passphrase (cryptsetup open --test-passphrase) agrees with cryptsetup.
    assert ours("test-passphrase", img, "--key-file", newer).returncode == 0
    p = ours("test-passphrase", img, "--key-file", new)
    assert p.returncode == 1 and b"no key available" in p.stderr, p.stderr


@pytest.mark.parametrize("luks_type", ["luks2", "luks1"])
def test_detached_header(ws, luks_type):
    data = sparse(ws.tmp / "data.img", 8 * MiB)
    hdr = ws.tmp / "hdr.img"
    pw = write_file(ws.tmp / "pass", PASS)
    kdf = FAST_PBKDF2 if luks_type == "luks1" else ["--pbkdf", "pbkdf2", *FAST_PBKDF2]
    luks_format(data, pw, "--type", luks_type, *kdf, header=hdr)
    fill_data(data, 0)
    digest = data_hash(data, 0)
    new = write_file(ws.tmp / "new", b"detached new")
    p = ours("add-key", data, "--header", hdr, "--key-file", pw, new, *kdf)
    assert p.returncode == 0, p.stderr
    assert opens(data, new, "--header", hdr)
    p = ours("kill-slot", data, "--header", hdr, "0", "--key-file", new)
    assert p.returncode == 0, p.stderr
    assert not opens(data, pw, "--header", hdr) and opens(data, new, "--header", hdr)
    assert data_hash(data, 0) == digest


def test_wrong_passphrase_changes_nothing(ws):
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, "--type", "luks2", "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    cryptsetup("luksAddKey", "--batch-mode", "--key-file", pw, "--pbkdf", "pbkdf2", *FAST_PBKDF2, img, write_file(ws.tmp / "p2", b"two"))
    before = img.read_bytes()
    bad = write_file(ws.tmp / "bad", PASS.rstrip(b"\n"))
    new = write_file(ws.tmp / "new", b"n")
    p = ours("add-key", img, "--key-file", bad, new, "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    assert p.returncode == 1, p
    assert b"no key available with this passphrase (tried keyslots 0, 1)" in p.stderr, p.stderr
    p = ours("add-key", img, "--key-file", bad, "--key-slot", "1", "--new-key-slot", "2", new, "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    assert p.returncode == 1 and b"(tried keyslot 1)" in p.stderr, p.stderr
    # No passphrase at all without a terminal: a clear message.
    p = ours("add-key", img, new)
    assert p.returncode == 1 and b"--key-file" in p.stderr, p.stderr
    assert img.read_bytes() == before


def test_a_locked_header_is_refused(ws):
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, "--type", "luks2", "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    new = write_file(ws.tmp / "new", b"n")
    before = img.read_bytes()
    # Another process holds the lock cryptsetup takes on an image file.
    with open(img, "rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        for args in (["add-key", img, "-d", pw, new, "--pbkdf", "pbkdf2", *FAST_PBKDF2], ["kill-slot", img, "0", "-q"], ["change-key", img, "-d", pw, new, "--pbkdf", "pbkdf2", *FAST_PBKDF2]):
            t = time.monotonic()
            p = ours(*args)
            assert p.returncode == 1 and b"locked by another process" in p.stderr, p.stderr
            assert time.monotonic() - t < 30, "it waited instead of refusing"
        fcntl.flock(holder, fcntl.LOCK_UN)
    assert img.read_bytes() == before
    # Two of ours at once: the second is refused while the first (a slow KDF) holds the lock.
    slow = subprocess.Popen([str(require_binary()), "luks", "add-key", str(img), "-d", str(pw), str(new), "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "10000000"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        time.sleep(0.5)
        p = ours("add-key", img, "-d", pw, write_file(ws.tmp / "other", b"o"), "--pbkdf", "pbkdf2", *FAST_PBKDF2)
        assert slow.poll() is None, "the slow add-key finished too early for this test to mean anything"
        assert p.returncode == 1 and b"locked by another process" in p.stderr, p.stderr
    finally:
        _, err = slow.communicate(timeout=300)
    assert slow.returncode == 0, err
    assert cs_slots(img) == [0, 1] and opens(img, new)


def test_no_secret_in_the_log_and_a_refused_memory_lock_is_a_warning(ws):
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", b"s3cret-passphrase-in-the-log?")
    luks_format(img, pw, "--type", "luks2", "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    vk = volume_key(img, pw)
    new = write_file(ws.tmp / "new", b"n3w-passphrase-in-the-log?")
    p = ours("-vv", "add-key", img, "-d", pw, new, "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    assert p.returncode == 0, p.stderr
    log = p.stderr + p.stdout
    for secret in (b"s3cret-passphrase", b"n3w-passphrase", vk.hex().encode(), vk.hex(" ").encode()):
        assert secret not in log, f"{secret!r} logged"
    assert b"cannot lock key material" not in log, "root (or a sufficient ulimit -l) locks it"
    # Without the right to lock memory: a warning, and the work is done.
    capsh = "/usr/sbin/capsh" if os.path.exists("/usr/sbin/capsh") else None
    if capsh is None or os.geteuid() != 0:
        pytest.skip("capsh (libcap2-bin) as root is needed to take away the right to lock memory")
    third = write_file(ws.tmp / "third", b"third")
    cmd = f"ulimit -l 0; exec {require_binary()} luks add-key {img} -d {pw} {third} --pbkdf pbkdf2 {' '.join(FAST_PBKDF2)}"
    p = subprocess.run([capsh, "--drop=cap_ipc_lock", "--", "-c", cmd], stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert b"cannot lock key material in memory" in p.stderr and p.stderr.count(b"cannot lock") == 1, p.stderr
    assert opens(img, third)


def on_a_terminal(argv: list, answer: bytes, expect_prompt: bytes) -> tuple[int, bytes]:
    """Runs argv on a pty, answers `answer` once `expect_prompt` shows; (exit status, output)."""
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:
        os.execv(argv[0], argv)
    seen = b""
    try:
        seen = pty_read_until(fd, seen, expect_prompt, 60)
        assert expect_prompt in seen, seen
        os.write(fd, answer)
        while True:
            r, _, _ = select.select([fd], [], [], 30)
            if not r:
                break
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), seen


def test_last_keyslot_confirmation_on_a_terminal(ws):
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, "--type", "luks2", "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    argv = [str(require_binary()), "luks", "kill-slot", str(img), "0", "--key-file", str(pw)]
    rc, out = on_a_terminal(argv, b"yes\n", b"Type 'yes' in capital letters")
    assert rc == 1 and b"NOT wiped" in out, out
    assert cs_slots(img) == [0] and opens(img, pw)
    rc, out = on_a_terminal(argv, b"YES\n", b"Type 'yes' in capital letters")
    assert rc == 0, out
    assert cs_slots(img) == [] and not opens(img, pw)


def test_cryptsetup_waits_for_our_lock(ws):
    """cryptsetup takes the same flock on an image file: a luksAddKey started while our add-key
    holds it waits, and both keyslots survive (no lost update)."""
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, "--type", "luks2", "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    ours_new = write_file(ws.tmp / "ours", b"ours")
    theirs_new = write_file(ws.tmp / "theirs", b"theirs")
    slow = subprocess.Popen([str(require_binary()), "luks", "add-key", str(img), "-d", str(pw), str(ours_new), "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "10000000"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        time.sleep(0.5)
        from test_luks import need

        cs = subprocess.Popen([need("cryptsetup"), "luksAddKey", "--batch-mode", "--key-file", str(pw), "--pbkdf", "pbkdf2", *FAST_PBKDF2, str(img), str(theirs_new)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        time.sleep(1.0)
        assert slow.poll() is None, "our add-key finished too early for this test to mean anything"
        assert cs.poll() is None, "cryptsetup did not wait for the lock"
        _, err = slow.communicate(timeout=300)
        assert slow.returncode == 0, err
        _, err = cs.communicate(timeout=120)
        assert cs.returncode == 0, err
    finally:
        for p in (slow, locals().get("cs")):
            if p is not None and p.poll() is None:
                p.kill()
    assert cs_slots(img) == [0, 1, 2]
    # Ours took the lock first, so it wrote keyslot 1 and cryptsetup, after waiting, keyslot 2:
    # --key-slot 2 spares cryptsetup trying theirs on keyslot 1 (10M PBKDF2 iterations, ~10 s).
    assert opens(img, ours_new) and opens(img, theirs_new, "--key-slot", "2") and opens(img, pw)


def test_format_over_a_filesystem_asks_on_a_terminal(ws):
    """On a terminal, luks format over an ext4 filesystem warns and asks cryptsetup's question:
    anything but YES leaves the image as it was; YES formats it."""
    import hashlib as _h

    from test_luks import need, run

    img = sparse(ws.tmp / "v.img", 24 * MiB)
    run([need("mkfs.ext4"), "-q", "-F", img], timeout=120, check=True)
    before = _h.sha256(img.read_bytes()).hexdigest()
    pw = write_file(ws.tmp / "pass", PASS)
    argv = [str(require_binary()), "luks", "format", "--pbkdf", "pbkdf2", *FAST_PBKDF2, "--key-file", str(pw), str(img)]
    for answer in (b"no\n", b"yes\n"):
        rc, out = on_a_terminal(argv, answer, b"Type 'yes' in capital letters")
        assert rc == 1 and b"already contains a 'ext4' superblock signature" in out and b"NOT changed" in out, out
        assert _h.sha256(img.read_bytes()).hexdigest() == before, f"answered {answer!r}: the image changed"
    rc, out = on_a_terminal(argv, b"YES\n", b"Type 'yes' in capital letters")
    assert rc == 0, out
    assert opens(img, pw)


def test_a_keyslot_with_an_unsupported_pbkdf2_hash_is_skipped(ws):
    """cryptsetup adds keyslots whose PBKDF2 hash this build lacks (ripemd160, whirlpool): they are
    skipped with a warning, the volume still opens with its other keyslots, and a keyslot added
    here leaves them as cryptsetup opens them."""
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, "--type", "luks2", "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    odd = {}
    for slot, hash_ in ((1, "ripemd160"), (2, "whirlpool")):
        odd[slot] = write_file(ws.tmp / hash_, hash_.encode())
        p = cryptsetup("luksAddKey", "--batch-mode", "--key-file", pw, "--key-slot", str(slot), "--pbkdf", "pbkdf2", "--hash", hash_, *FAST_PBKDF2,
                       img, odd[slot], check=False)  # fmt: skip
        if p.returncode != 0:
            pytest.skip(f"cryptsetup cannot use {hash_} here: {p.stderr.decode(errors='replace').strip()}")
    dump = ours("dump", img)
    assert dump.returncode == 0, dump.stderr
    assert b"Hash:       ripemd160" in dump.stdout and b"Hash:       whirlpool" in dump.stdout, dump.stdout
    assert ours("test-passphrase", "--key-file", pw, img).returncode == 0
    p = ours("test-passphrase", "--key-file", odd[1], img)
    assert p.returncode == 1 and b"keyslot 1 cannot be used" in p.stderr and b"ripemd160" in p.stderr, p.stderr
    b = serve_luks(ws, img, pw, "--read-only")
    assert "keyslot 0" in b.stderr(), b.stderr()
    assert b.stop() == 0
    new = write_file(ws.tmp / "new", b"new")
    p = ours("add-key", "--key-file", pw, "--pbkdf", "pbkdf2", *FAST_PBKDF2, img, new)
    assert p.returncode == 0, p.stderr
    assert cs_slots(img) == [0, 1, 2, 3]
    assert opens(img, new) and opens(img, odd[1]) and opens(img, odd[2])


@pytest.mark.parametrize("luks_type", ["luks2", "luks1"])
def test_keyslot_commands_on_an_old_cbc_essiv_volume(ws, luks_type):
    """aes-cbc-essiv:sha256 volumes, whose keyslots cryptsetup encrypts with aes-cbc-essiv:sha256
    too (not only the data): every keyslot command, checked by cryptsetup. (Their data is checked
    in test_luks_ivmodes.py.)"""
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    p = cryptsetup("luksFormat", "--batch-mode", "--type", luks_type, "--cipher", "aes-cbc-essiv:sha256", "--key-size", "256", "--pbkdf", "pbkdf2",
                   *FAST_PBKDF2, "--key-file", pw, img, check=False)  # fmt: skip
    if p.returncode != 0:
        pytest.skip(f"cryptsetup cannot make an aes-cbc-essiv volume here: {p.stderr.decode(errors='replace').strip()}")
    if luks_type == "luks2":
        assert b"Cipher:     aes-cbc-essiv:sha256" in cryptsetup("luksDump", img).stdout  # the keyslot's cipher, not only the data's
    offset, _ = data_layout(img)
    fill_data(img, offset)
    vk, digest = volume_key(img, pw), data_hash(img, offset)
    assert b"aes-cbc-essiv:sha256" in ours("dump", img).stdout
    assert ours("test-passphrase", "--key-file", pw, img).returncode == 0
    bad = write_file(ws.tmp / "bad", b"bad")
    assert ours("test-passphrase", "--key-file", bad, img).returncode == 1
    second, third = write_file(ws.tmp / "second", b"second"), write_file(ws.tmp / "third", b"third")
    p = ours("add-key", "--key-file", pw, "--pbkdf", "pbkdf2", *FAST_PBKDF2, img, second)
    assert p.returncode == 0, p.stderr
    assert opens(img, second) and cs_slots(img) == [0, 1]
    p = ours("change-key", "--key-file", second, "--pbkdf", "pbkdf2", *FAST_PBKDF2, img, third)
    assert p.returncode == 0, p.stderr
    assert opens(img, third) and not opens(img, second)
    p = ours("remove-key", "--key-file", pw, img)
    assert p.returncode == 0, p.stderr
    assert not opens(img, pw) and opens(img, third)
    p = ours("add-key", "--key-file", third, "--pbkdf", "pbkdf2", *FAST_PBKDF2, img, pw)
    assert p.returncode == 0, p.stderr
    thirds = [s for s in cs_slots(img) if opens(img, third, "--key-slot", str(s))]
    assert len(thirds) == 1 and len(cs_slots(img)) == 2
    p = ours("kill-slot", "--key-file", pw, img, str(thirds[0]))
    assert p.returncode == 0, p.stderr
    assert len(cs_slots(img)) == 1 and opens(img, pw) and not opens(img, third)
    unchanged(img, pw, vk, offset, digest)
    # It is served, read-only, under the key the remaining keyslot holds: the data area reads as
    # the reference decrypts it.
    from nbd_client import NBDClient
    from test_luks_ivmodes import crypt

    b = serve_luks(ws, img, pw, "--read-only")
    with NBDClient(b.uri) as c:
        c.connect()
        _, sector = data_layout(img)
        raw = img.read_bytes()[offset : offset + 2 * sector]
        want = b"".join(crypt("aes-cbc-essiv:sha256", vk, i * sector // 512, raw[i * sector : (i + 1) * sector], True) for i in range(2))
        assert c.read(0, 2 * sector) == want
    assert b.stop() == 0
    assert_no_panic(b.stderr())
    unchanged(img, pw, vk, offset, digest)


def dump_sections(text: str) -> str:
    """A dump without cryptbridge's own trailer (after the first blank line that follows Digests)."""
    return text.split("\n\nRead from:")[0].split("\n\nServed as:")[0].rstrip("\n")


DUMPS = [
    ("luks2-pbkdf2", ["--type", "luks2", "--pbkdf", "pbkdf2", *FAST_PBKDF2, "--label", "data", "--subsystem", "backup"]),
    ("luks2-argon2id", ["--type", "luks2", "--pbkdf", "argon2id", *FAST_ARGON, "--sector-size", "512"]),
    ("luks1", ["--type", "luks1", "--hash", "sha512", *FAST_PBKDF2]),
]


@pytest.mark.parametrize("opts", [d[1] for d in DUMPS], ids=[d[0] for d in DUMPS])
def test_luks_dump_prints_what_cryptsetup_prints(ws, opts):
    """`luks dump` is `cryptsetup luksDump`, line for line (every section, field name and value),
    then what cryptbridge adds; on LUKS2 also with a token, a preferred and an ignored keyslot."""
    img = sparse(ws.tmp / "v.img", 20 * MiB)
    pw = write_file(ws.tmp / "pass", PASS)
    luks_format(img, pw, *opts)
    second = write_file(ws.tmp / "second", b"second")
    cryptsetup("luksAddKey", "--batch-mode", "--key-file", pw, "--pbkdf-force-iterations", "1000", "--pbkdf", "pbkdf2", img, second)
    if "luks2" in opts:
        cryptsetup("config", "--priority", "prefer", "--key-slot", "0", img)
        cryptsetup("config", "--priority", "ignore", "--key-slot", "1", img)
        cryptsetup("token", "add", "--key-description", "cryptbridge:test", "--key-slot", "1", img)
    theirs = cryptsetup("luksDump", img).stdout.decode()
    p = ours("dump", img)
    assert p.returncode == 0, p.stderr
    mine = p.stdout.decode()
    if "luks2" in opts:
        for words in ("Subsystem:", "Flags:", "Tokens:\n  0: luks2-keyring", "Priority:   preferred", "Priority:   ignored", "Digest ID:  0"):
            assert words in theirs, words  # the case covers what it means to
    assert dump_sections(mine) == theirs.rstrip("\n"), f"ours:\n{mine}\ncryptsetup:\n{theirs}"
    assert "Served as:     aes-xts-plain64" in mine
