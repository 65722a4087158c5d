"""Where the key lives in a running server (issue 27, deliverable 5).

The README promises that key material is locked in RAM (never swapped), left out of core dumps and
wiped when released. This test reads a running ``cryptbridge serve`` the way an attacker with root
(or a swap or core file) would: every readable mapping of /proc/PID/mem, searched for the key.

What is searched for: each 16-byte quarter of the volume key (an AES-256 key is two of them, and
the first two round keys of an AES-256 key schedule are the key itself, so a copy of the
schedule, of one half, or of a vector register spilled with a round key broadcast in it, is
found too), and the third round key (the first one derived by the key expansion) of each AES key,
so that copies of the expanded schedule count even where the raw words are not kept. For LUKS
the passphrase too. Not searched for: values derived from the key that are not round keys
(a tweak XORed into the last round key, HMAC pads), which the stack wipes cover without a check.

Each hit is classified by the mapping it is in: locked (``lo`` in the VmFlags of
/proc/PID/smaps: mlock'ed, never written to swap) and ``dd`` (MADV_DONTDUMP: not in a core dump),
or neither. The promise holds when every hit is in a locked, don't-dump mapping and VmLck > 0.

Three moments are checked: after start-up, right after a load that runs the crypto on the pool
threads and the I/O threads (large and small requests, both directions), and once the load is
over and the I/O threads have ended (they end after 5 s idle; what they left on their stacks
stays in the process unless it was wiped; the thread count is in the report). "After the export
stops" the process exits (SIGTERM: flush, then exit; the test asserts exit status 0), so its
memory goes back to the kernel, readable by no one; the locked pages are not wiped by the
process on that path (exit runs no destructors), the kernel frees them. What can be checked
before that is that no copy is where swap or a core dump would write it, which the
classification does at each moment.

Needs root (to read another process's memory) and nbdcopy; skipped with the reason otherwise.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import MiB, Bridge, require_binary, run
from nbd_client import NBDClient

PASS = b"memory test passphrase"
FAST_PBKDF2 = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
# The I/O threads end after this long without work (bridge: 5 s), with a margin.
IO_THREAD_IDLE_S = 8.0

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="reading another process's memory (/proc/PID/mem) needs root")


# --- AES key expansion (FIPS 197 5.2), enough to name a derived round key -------------------------

def _sbox() -> list[int]:
    sbox = [0] * 256
    p = q = 1
    while True:
        p = p ^ ((p << 1) & 0xFF) ^ (0x1B if p & 0x80 else 0)
        q ^= q << 1
        q ^= q << 2
        q ^= q << 4
        q &= 0xFF
        if q & 0x80:
            q ^= 0x09
        x = q ^ ((q << 1) | (q >> 7)) ^ ((q << 2) | (q >> 6)) ^ ((q << 3) | (q >> 5)) ^ ((q << 4) | (q >> 4))
        sbox[p] = (x ^ 0x63) & 0xFF
        if p == 1:
            break
    sbox[0] = 0x63
    return sbox


SBOX = _sbox()


def round_keys(key: bytes) -> list[bytes]:
    """The encryption round keys of AES-128 or AES-256 (16 or 32-byte key)."""
    nk = len(key) // 4
    rounds = {4: 10, 6: 12, 8: 14}[nk]
    w = [list(key[4 * i : 4 * i + 4]) for i in range(nk)]
    rcon = 1
    for i in range(nk, 4 * (rounds + 1)):
        t = list(w[i - 1])
        if i % nk == 0:
            t = t[1:] + t[:1]
            t = [SBOX[b] for b in t]
            t[0] ^= rcon
            rcon = ((rcon << 1) ^ (0x1B if rcon & 0x80 else 0)) & 0xFF
        elif nk > 6 and i % nk == 4:
            t = [SBOX[b] for b in t]
        w.append([a ^ b for a, b in zip(w[i - nk], t)])
    flat = bytes(b for word in w for b in word)
    return [flat[16 * r : 16 * r + 16] for r in range(rounds + 1)]


def test_round_keys_match_fips197():
    # FIPS 197 appendix A.3: the AES-256 expansion of 603deb10...; w[8..11] is round key 2.
    key = bytes.fromhex("603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4")
    assert round_keys(key)[2] == bytes.fromhex("9ba354118e6925afa51a8b5f2067fcde")
    assert round_keys(key)[14] == bytes.fromhex("fe4890d1e6188d0b046df344706c631e")


def needles(xts_key: bytes) -> dict[str, bytes]:
    """What counts as a copy of an XTS key (Key1 || Key2): its quarters and each AES key's round
    key 2."""
    out = {f"key[{i}:{i + 16}]": xts_key[i : i + 16] for i in range(0, len(xts_key), 16)}
    half = len(xts_key) // 2
    for name, k in (("Key1", xts_key[:half]), ("Key2", xts_key[half:])):
        out[f"{name} round key 2"] = round_keys(k)[2]
    return out


# --- reading the process ------------------------------------------------------------------------

class Mapping:
    def __init__(self, start: int, end: int, perms: str, name: str):
        self.start, self.end, self.perms, self.name = start, end, perms, name
        self.flags: set[str] = set()
        self.locked_kb = 0

    @property
    def locked(self) -> bool:
        return "lo" in self.flags

    @property
    def dontdump(self) -> bool:
        return "dd" in self.flags

    def __repr__(self) -> str:
        return f"{self.start:x}-{self.end:x} {self.perms} {self.name or '[anon]'} flags={' '.join(sorted(self.flags))}"


def mappings(pid: int) -> list[Mapping]:
    out: list[Mapping] = []
    head = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = head.match(line)
            if m:
                out.append(Mapping(int(m.group(1), 16), int(m.group(2), 16), m.group(3), m.group(4).strip()))
            elif line.startswith("VmFlags:"):
                out[-1].flags = set(line.split()[1:])
            elif line.startswith("Locked:"):
                out[-1].locked_kb = int(line.split()[1])
    return out


def vm_lck_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    raise AssertionError("no VmLck in /proc/PID/status")


class Hit:
    def __init__(self, what: str, addr: int, mapping: Mapping):
        self.what, self.addr, self.mapping = what, addr, mapping

    def __repr__(self) -> str:
        return f"{self.what} at {self.addr:#x} in {self.mapping!r}"


def scan(pid: int, find: dict[str, bytes]) -> tuple[list[Hit], list[Hit]]:
    """(hits in locked, don't-dump mappings; every other hit)."""
    good: list[Hit] = []
    bad: list[Hit] = []
    chunk = 64 * MiB
    overlap = max(len(n) for n in find.values()) - 1
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for m in mappings(pid):
            if "r" not in m.perms or m.name in ("[vvar]", "[vsyscall]", "[vvar_vclock]"):
                continue
            pos = m.start
            while pos < m.end:
                n = min(chunk + overlap, m.end - pos)
                try:
                    mem.seek(pos)
                    data = mem.read(n)
                except OSError:
                    break  # a mapping that cannot be read (device memory, guard pages)
                for what, needle in find.items():
                    i = data.find(needle)
                    while i != -1:
                        # One starting in the overlap is found again by the next chunk.
                        if i < chunk:
                            hit = Hit(what, pos + i, m)
                            (good if m.locked and m.dontdump else bad).append(hit)
                        i = data.find(needle, i + 1)
                pos += chunk
    return good, bad


def summary(hits: list[Hit]) -> str:
    by_map: dict[str, int] = {}
    for h in hits:
        key = f"{h.mapping.name or '[anon]'} {' '.join(sorted(h.mapping.flags & {'lo', 'dd', 'gd'}))}"
        by_map[key] = by_map.get(key, 0) + 1
    return ", ".join(f"{n} in {k}" for k, n in sorted(by_map.items(), key=lambda kv: -kv[1]))


# --- load -----------------------------------------------------------------------------------

def load(bridge: Bridge, tmp: Path, size: int) -> None:
    """Large requests both ways with nbdcopy (several connections, requests of 256 KiB and more:
    the crypto pool runs them), then small ones on one connection (the I/O threads run them)."""
    src = tmp / "load.src"
    with open(src, "wb") as f:
        f.write(os.urandom(size))
    run(["nbdcopy", "--request-size=1048576", src, bridge.uri], timeout=120, check=True)
    back = tmp / "load.back"
    run(["nbdcopy", "--request-size=1048576", bridge.uri, back], timeout=120, check=True)
    assert back.read_bytes() == src.read_bytes()
    with NBDClient(bridge.uri) as c:
        c.connect()
        for i in range(64):
            c.write(i * 4096, os.urandom(4096))
            c.read(i * 4096, 4096)
    src.unlink()
    back.unlink()


def check_server(bridge: Bridge, tmp: Path, key: bytes, size: int, passphrase: Optional[bytes] = None) -> None:
    pid = bridge.proc.pid
    find = needles(key)
    if passphrase is not None:
        find["passphrase"] = passphrase
    report = []
    failures = []

    def look(moment: str) -> None:
        good, bad = scan(pid, find)
        lck = vm_lck_kb(pid)
        threads = len(os.listdir(f"/proc/{pid}/task"))
        report.append(f"{moment}: {threads} threads, VmLck {lck} kB; {len(good)} copies in locked don't-dump pages; "
                      f"{len(bad)} elsewhere ({summary(bad)})")
        if lck == 0:
            failures.append(f"{moment}: VmLck is 0 kB: nothing is locked")
        if bad:
            failures.append(f"{moment}: {len(bad)} copies of key material outside locked don't-dump pages, e.g. {bad[:5]}")

    look("started")
    load(bridge, tmp, size)
    look("after the load")
    time.sleep(IO_THREAD_IDLE_S)
    look("idle, I/O threads ended")
    print("\n".join(report))
    assert bridge.stop(signal.SIGTERM) == 0, bridge.stderr()[-2000:]
    assert not failures, "\n".join(failures + ["", *report])


def test_plain_key_file_key_is_only_in_locked_pages(ws):
    require_binary()
    if subprocess.run(["which", "nbdcopy"], capture_output=True).returncode != 0:
        pytest.skip("nbdcopy not installed (libnbd-bin)")
    size = 32 * MiB
    key_path, key = ws.key(64)
    b = ws.serve(ws.backing(size), key_path)
    check_server(b, ws.tmp, key, size)


def test_luks_volume_key_is_only_in_locked_pages(ws):
    require_binary()
    from test_luks import need, volume_key

    if subprocess.run(["which", "nbdcopy"], capture_output=True).returncode != 0:
        pytest.skip("nbdcopy not installed (libnbd-bin)")
    need("cryptsetup")
    size = 32 * MiB
    img = ws.backing(size + 16 * MiB, "luks.img")
    pw = ws.tmp / "pass"
    pw.write_bytes(PASS)
    os.chmod(pw, 0o600)
    run([need("cryptsetup"), "luksFormat", "--batch-mode", "--type", "luks2", "--key-size", "512", *FAST_PBKDF2,
         "--key-file", pw, img], timeout=120, check=True)
    key = volume_key(img, pw)
    ws._n += 1
    b = Bridge(ws.tmp, ["--type", "luks", "--backing", img, "--unix", ws.sockdir / f"l{ws._n}.sock", "--key-file", pw],
               label=f"luks{ws._n}")
    ws.bridges.append(b)
    b.start()
    check_server(b, ws.tmp, key, size, PASS)


def test_a_refused_lock_is_one_warning_and_the_server_runs(ws):
    """Without the right to lock memory (RLIMIT_MEMLOCK 0, no CAP_IPC_LOCK) every allocation of
    key material is refused its lock: one warning, and the volume is served (the README says so)."""
    capsh = "/usr/sbin/capsh" if os.path.exists("/usr/sbin/capsh") else None
    if capsh is None:
        pytest.skip("capsh (libcap2-bin) is needed to take away the right to lock memory")
    key_path, _ = ws.key(64)
    backing = ws.backing(4 * MiB)
    sock = ws.sockdir / "unlocked.sock"
    cmd = f"ulimit -l 0; exec {require_binary()} serve --backing {backing} --key-file {key_path} --unix {sock}"
    out, err = ws.tmp / "unlocked.stdout", ws.tmp / "unlocked.stderr"
    with open(out, "wb") as o, open(err, "wb") as e:
        p = subprocess.Popen([capsh, "--drop=cap_ipc_lock", "--", "-c", cmd], stdout=o, stderr=e, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while b"ready" not in out.read_bytes() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b"ready" in out.read_bytes(), err.read_bytes()[-2000:]
        with NBDClient(out.read_text().split()[1]) as c:
            c.connect()
            c.write(0, b"x" * 4096)
            assert c.read(0, 4096) == b"x" * 4096
        assert vm_lck_kb(p.pid) == 0
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=15)
    log = err.read_bytes()
    assert log.count(b"cannot lock key material in memory") == 1, log
    assert b"panicked" not in log, log
