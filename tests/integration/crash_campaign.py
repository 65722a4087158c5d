#!/usr/bin/env python3
"""Crash campaign: `kill -9` of `cryptbridge serve` under a real ext4 workload, then restart + checks.

Stack per volume: cryptbridge serve (unix socket) -> nbdfuse -> losetup (sector size = the
export's) -> ext4 (made once by mkfs.ext4, then reused). Each volume keeps its backing file and key
for the whole campaign. Rounds take the volumes in turn: 4096-byte sectors with `mkfs.ext4 -b
4096`, 512-byte sectors with `-b 4096`, 512-byte sectors with `-b 1024` (``--block-sizes``); the
volumes cannot share a backing file, since XTS ciphertext depends on the data-unit size. Each
volume's rounds alternate between a page-cache backing and `serve --direct` (O_DIRECT).

One round:

1. Crash phase. Start the server, nbdfuse, losetup, mount. A child process (this file with
   ``--workload``) runs the workload: in ``synced/dNN/`` it creates, atomically replaces and
   deletes files, each step as write tmp + fsync + rename + fsync dir (or unlink + fsync dir);
   every step is first journaled as ``begin`` (name, old sha256, new sha256) and, once its last
   fsync returned, as ``done``, in a JSON-lines journal OUTSIDE the file system (host fs, written
   with O_APPEND and fsync'd per record). After one step in five the child pauses its fsyncs for
   0.05-0.5 s. A thread of the same child meanwhile writes unsynced files to ``unsynced/`` and
   starts the writeback of half of them (sync_file_range, no flush), so plain writes with no
   FLUSH behind them reach the server. After a random delay the server gets SIGKILL; the child is left
   0.5 s to hit the errors (an fsync that reports success after the kill must still hold), then
   gets SIGKILL too. Tear-down: ``umount -l``, ``losetup -d``, ``fusermount3 -u`` (``-z`` and
   killing nbdfuse as fall-backs), every step under a timeout.
2. Check phase. Restart the server on the same backing and key, nbdfuse + losetup again, record
   whether the superblock says ``needs_recovery``, mount (ext4 replays its journal), verify every
   journaled file: a ``done`` step must show its new content exactly (sha256; absent for a
   delete), a step begun but not done must show the old or the new content (the rename is
   atomic), then ``umount`` and ``fsck.ext4 -fn`` on the device, which must exit 0. Then the
   server gets SIGTERM and must exit 0 without a panic.

A round is clean when fsck exits 0 and every journaled file matches. Files written by earlier
rounds are verified again in every later round of their volume.

`kill -9` leaves the host's page cache alone: every write the server made survives, synced or
not, so plain kill -9 rounds test that the server answers only what it has written and that the
client stack (ext4 -> loop -> FUSE -> nbdfuse, 4 connections, CAN_MULTI_CONN) carries fsync
through as FLUSH. ``--power-loss`` adds the power cut: the crash-phase server runs under an
LD_PRELOAD shim (crash_undo_shim.c) that keeps an undo log of its backing writes, and after the
kill the writes that no completed fdatasync covered are undone (all of them in odd rounds, a
random half in even rounds), so what survives is what FLUSH/FUA made durable. ``--lie`` makes the
shim count no sync: the negative control, which must report lost files.

Run as a script (``--rounds N``, ``make crash-campaign``) or through ``run_campaign`` from the
pytest test (test_crash_campaign.py). Needs root, /dev/fuse, working loop devices, nbdfuse,
fusermount3 and e2fsprogs; ``skip_reason()`` names what is missing.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("CRYPTBRIDGE_BIN", REPO / "target" / "release" / "cryptbridge"))
MiB = 1 << 20
TOOLS = ("nbdfuse", "fusermount3", "losetup", "mkfs.ext4", "fsck.ext4", "dumpe2fs", "mount", "umount")


# --------------------------------------------------------------------------------------------
# subprocesses, always with a timeout


@dataclass
class Res:
    cmd: list
    rc: int
    out: str
    err: str
    timed_out: bool = False

    def text(self) -> str:
        return f"$ {' '.join(self.cmd)}  (rc={self.rc}{', TIMED OUT' if self.timed_out else ''})\n{self.out}{self.err}"


def sh(cmd, timeout: float) -> Res:
    """Runs cmd in its own session; on timeout the whole group gets SIGKILL (rc 124)."""
    cmd = [str(c) for c in cmd]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return Res(cmd, p.returncode, out.decode(errors="replace"), err.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        _killpg(p.pid)
        try:
            out, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # stuck in the kernel: give up on it, do not hang
            out, err = b"", b"(process did not exit after SIGKILL)"
        return Res(cmd, 124, out.decode(errors="replace"), err.decode(errors="replace"), timed_out=True)


def _killpg(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def _wait_for(pred, timeout: float, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)


def _tool(name: str) -> Optional[str]:
    p = shutil.which(name)
    if p:
        return p
    for d in ("/usr/sbin", "/sbin"):
        if os.path.exists(f"{d}/{name}"):
            return f"{d}/{name}"
    return None


def mounted_at(path: Path) -> bool:
    p = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == p for line in f)


def mounts_under(path: Path) -> list[str]:
    p = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1] == p or line.split()[1].startswith(p + "/")]


def loops_on(path_prefix: Path) -> list[str]:
    """Loop devices whose backing file lies under path_prefix (from sysfs, no tool needed)."""
    prefix = os.path.realpath(path_prefix)
    found = []
    for bf in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            target = bf.read_text().strip()
        except OSError:
            continue
        if target == prefix or target.startswith(prefix + "/"):
            found.append("/dev/" + bf.parent.parent.name)
    return found


def skip_reason(tmp: Optional[Path] = None) -> Optional[str]:
    """Why the campaign cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (loop devices, mount)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (nbdfuse)"
    for t in TOOLS:
        if _tool(t) is None:
            return f"{t} not installed (scripts/install-deps.sh)"
    if not os.path.exists("/dev/loop-control") and not os.path.exists("/dev/loop0"):
        return "no loop devices"
    d = Path(tempfile.mkdtemp(prefix="cbcc-loop", dir=tmp))
    try:
        img = d / "t.img"
        with open(img, "wb") as f:
            f.truncate(MiB)
        r = sh(["losetup", "-f", "--show", img], 30)
        if r.rc != 0:
            return f"losetup does not work here: {r.err.strip()}"
        sh(["losetup", "-d", r.out.strip()], 30)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return None  # a missing binary is a failure, not a skip: Campaign.setup raises


# --------------------------------------------------------------------------------------------
# the journal (JSON lines on the host file system)


def journal_append(fd: int, rec: dict) -> None:
    line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
    n = os.write(fd, line)  # O_APPEND: one write per record
    assert n == len(line)
    os.fsync(fd)


def journal_read(path: Path) -> list[dict]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    recs = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            recs.append(json.loads(line))
        except ValueError:  # a torn last line (the writer was killed mid-record): never a done
            continue
    return recs


@dataclass
class FileState:
    name: str
    done: bool  # the last step on it finished (all its fsyncs returned)
    old: Optional[str]  # sha256 before the step (None: absent)
    new: Optional[str]  # sha256 after it (None: deleted)
    size: int = -1
    round: int = -1


def journal_state(recs: list[dict]) -> dict[str, FileState]:
    st: dict[str, FileState] = {}
    for r in recs:
        op = r.get("op")
        if op == "begin":
            st[r["name"]] = FileState(r["name"], False, r["old"], r["new"], r.get("size", -1), r.get("round", -1))
        elif op == "done":
            s = st[r["name"]]
            st[r["name"]] = FileState(s.name, True, s.new, s.new, s.size, s.round)
        elif op == "settle":  # the check phase found a half-done step's outcome
            s = st.get(r["name"])
            st[r["name"]] = FileState(r["name"], True, r["hash"], r["hash"], r.get("size", -1),
                                      s.round if s else -1)
    return st


def _sha(path: Path) -> Optional[str]:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 * MiB):
                h.update(chunk)
    except FileNotFoundError:
        return None
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# the workload (a child process: python3 crash_campaign.py --workload ...)

SYNC_SIZES = (0, 1, 511, 4095, 4096, 4097, 65536 + 13)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view[: 1 * MiB])
            view = view[n:]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _start_writeback(path: Path) -> None:
    """sync_file_range(SYNC_FILE_RANGE_WRITE): the data goes to the device as plain writes, with no
    flush and no wait, so unsynced writes are in flight at the server when it dies."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.sync_file_range(fd, ctypes.c_int64(0), ctypes.c_int64(0), 2) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
    finally:
        os.close(fd)


def _unsynced_writer(root: Path, rng: random.Random, stop: threading.Event, stats: dict) -> None:
    """Writes 256 KiB - 8 MiB files without fsync, keeping at most 8 of them; starts the writeback
    of half of them (sync_file_range, no flush)."""
    kept: list[Path] = []
    k = 0
    try:
        while not stop.is_set():
            p = root / f"u{k:05d}.bin"
            k += 1
            _write_file(p, os.urandom(rng.randint(256 * 1024, 8 * MiB)), sync=False)
            if rng.random() < 0.5:
                _start_writeback(p)
            stats["unsynced_bytes"] = stats.get("unsynced_bytes", 0) + p.stat().st_size
            kept.append(p)
            if len(kept) > 8:
                kept.pop(0).unlink()
            time.sleep(rng.uniform(0, 0.05))
    except OSError as e:
        stats["unsynced_error"] = f"{type(e).__name__}: {e}"


def workload(mnt: Path, journal: Path, seed: int, round_no: int, max_live: int) -> int:
    rng = random.Random(seed)
    jfd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    state = journal_state(journal_read(journal))
    live = {n: s.new for n, s in state.items() if s.done and s.new is not None}
    synced = mnt / "synced"
    unsynced = mnt / "unsynced"
    stats: dict = {}
    stop = threading.Event()
    try:
        for d in (synced, *(synced / f"d{i}" for i in range(4)), unsynced):
            if not d.exists():
                d.mkdir()
                _fsync_dir(d.parent)
        # leftovers of earlier crashes: tmp files of half-done steps, the unsynced files
        for p in synced.glob("d*/*.tmp"):
            p.unlink()
        for p in unsynced.iterdir():
            p.unlink()
        t = threading.Thread(target=_unsynced_writer, args=(unsynced, random.Random(seed + 1), stop, stats),
                             daemon=True)
        t.start()
        journal_append(jfd, {"op": "start", "round": round_no, "t": time.time(), "live": len(live)})
        k = 0
        while True:
            k += 1
            names = sorted(live)
            x = rng.random()
            if names and (len(names) >= max_live or x < 0.15):
                name = rng.choice(names)
                kind = "delete"
            elif names and x < 0.40:
                name = rng.choice(names)
                kind = "replace"
            else:
                name = f"d{rng.randrange(4)}/r{round_no:03d}-{k:05d}.bin"
                kind = "create"
            path = synced / name
            if kind == "delete":
                journal_append(jfd, {"op": "begin", "kind": kind, "name": name, "old": live[name], "new": None,
                                     "round": round_no, "t": time.time()})
                path.unlink()
                _fsync_dir(path.parent)
                del live[name]
            else:
                y = rng.random()
                if y < 0.5:
                    size = rng.choice(SYNC_SIZES)
                elif y < 0.9:
                    size = rng.randint(1, 256 * 1024)
                else:
                    size = rng.randint(256 * 1024, 2 * MiB)
                data = os.urandom(size)
                h = hashlib.sha256(data).hexdigest()
                journal_append(jfd, {"op": "begin", "kind": kind, "name": name, "old": live.get(name), "new": h,
                                     "size": size, "round": round_no, "t": time.time()})
                tmp = path.with_name(path.name + ".tmp")
                _write_file(tmp, data, sync=True)
                os.rename(tmp, path)
                _fsync_dir(path.parent)
                live[name] = h
            journal_append(jfd, {"op": "done", "name": name, "t": time.time()})
            if rng.random() < 0.2:
                # a pause in the fsyncs: the unsynced writer's writeback then reaches the server with
                # no flush behind it for a while (what --power-loss undoes)
                time.sleep(rng.uniform(0.05, 0.5))
    except OSError as e:
        # expected once the server is gone: EIO (or EROFS after ext4 aborted its journal)
        stop.set()
        journal_append(jfd, {"op": "error", "round": round_no, "t": time.time(), "errno": e.errno,
                             "error": f"{type(e).__name__}: {e}", **stats})
        return 3
    finally:
        stop.set()


# --------------------------------------------------------------------------------------------
# the stack: server -> nbdfuse -> loop -> ext4


class StackError(RuntimeError):
    pass


class Stack:
    """One server + nbdfuse + loop device (+ mount) over a volume's backing file."""

    def __init__(self, camp: "Campaign", vol: "Volume", label: str, direct: bool = False):
        self.camp = camp
        self.vol = vol
        self.label = label
        self.direct = direct
        d = camp.workdir / label
        d.mkdir(parents=True)
        self.dir = d
        self.sock = camp.sockdir / f"{label}.sock"
        self.fusedir = d / "fuse"
        self.mnt = d / "mnt"
        self.fusedir.mkdir()
        self.mnt.mkdir()
        self.server: Optional[subprocess.Popen] = None
        self.nbdfuse: Optional[subprocess.Popen] = None
        self.fuse_conn: Optional[int] = None
        self.loop: Optional[str] = None
        self.disk = ""
        self.mounted = False
        self.notes: list[str] = []

    # -- bring up

    def start_server(self, env: Optional[dict] = None) -> None:
        cmd = [self.camp.bin, "serve", "--backing", self.vol.backing, "--key-file", self.vol.key,
               "--cipher", "aes-xts-plain64", "--key-size", "512", "--sector-size", self.vol.sector_size,
               "--unix", self.sock] + (["--direct"] if self.direct else [])
        out = self.dir / "server.stdout"
        with open(out, "wb") as o, open(self.dir / "server.stderr", "wb") as e:
            self.server = subprocess.Popen([str(c) for c in cmd], stdout=o, stderr=e, stdin=subprocess.DEVNULL,
                                           start_new_session=True, env={**os.environ, **(env or {})})
        self.camp.procs.append(self.server)
        if not _wait_for(lambda: b"\n" in out.read_bytes() or self.server.poll() is not None, 20):
            raise StackError(f"{self.label}: server not ready after 20 s")
        line = out.read_bytes().split(b"\n", 1)[0].decode(errors="replace")
        m = re.fullmatch(r"ready (\S+)", line.strip())
        if self.server.poll() is not None or not m:
            raise StackError(f"{self.label}: server exited or bad ready line {line!r}: {self.server_stderr()[-2000:]}")
        self.uri = m.group(1)

    def server_stderr(self) -> str:
        try:
            return (self.dir / "server.stderr").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def attach(self) -> None:
        disk = self.fusedir / "disk"
        pidfile = self.dir / "nbdfuse.pid"
        with open(self.dir / "nbdfuse.stderr", "wb") as err:
            self.nbdfuse = subprocess.Popen(["nbdfuse", "-P", str(pidfile), str(disk), self.uri],
                                            stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        self.camp.procs.append(self.nbdfuse)
        ok = _wait_for(lambda: (pidfile.exists() and pidfile.read_text().strip() != "") or self.nbdfuse.poll() is not None, 30)
        if not ok or self.nbdfuse.poll() is not None:
            raise StackError(f"{self.label}: nbdfuse did not start: {(self.dir / 'nbdfuse.stderr').read_text()}")
        if not _wait_for(lambda: mounted_at(self.fusedir) and disk.exists(), 10):
            raise StackError(f"{self.label}: nbdfuse file missing")
        self.disk = str(disk)
        self.fuse_conn = os.minor(os.stat(self.fusedir).st_dev)  # /sys/fs/fuse/connections/N
        if disk.stat().st_size != self.vol.size:
            raise StackError(f"{self.label}: export size {disk.stat().st_size} != {self.vol.size}")
        r = sh(["losetup", "-f", "--show", "--sector-size", self.vol.sector_size, disk], 30)
        if r.rc != 0:
            raise StackError(f"{self.label}: losetup failed: {r.text()}")
        self.loop = r.out.strip()

    def mount(self) -> None:
        r = sh(["mount", "-t", "ext4", self.loop, self.mnt], 60)
        if r.rc != 0:
            raise StackError(f"{self.label}: mount failed: {r.text()}")
        self.mounted = True

    def umount(self) -> Res:
        r = sh(["umount", self.mnt], 60)
        if r.rc == 0:
            self.mounted = False
        return r

    # -- tear down

    def kill_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            os.kill(self.server.pid, signal.SIGKILL)
            if not _wait(self.server, 10):
                self.notes.append("server still alive 10 s after SIGKILL")

    def stop_server(self) -> Optional[int]:
        """SIGTERM (the server syncs and exits 0), SIGKILL after 15 s."""
        if self.server is None:
            return None
        if self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            if not _wait(self.server, 15):
                self.server.kill()
                _wait(self.server, 10)
                self.notes.append("server needed SIGKILL after SIGTERM")
                return None
        return self.server.returncode

    def _abort_fuse(self) -> None:
        if self.fuse_conn is not None:
            try:
                Path(f"/sys/fs/fuse/connections/{self.fuse_conn}/abort").write_text("1")
                self.notes.append(f"aborted FUSE connection {self.fuse_conn}")
            except OSError:
                pass

    def teardown(self, crashed: bool) -> list[str]:
        """Unmounts and detaches everything; returns what went wrong (never raises, never hangs)."""
        problems: list[str] = []
        if self.mounted or mounted_at(self.mnt):
            r = sh(["umount", "-l", self.mnt] if crashed else ["umount", self.mnt], 60)
            if r.rc != 0 and not crashed:
                problems.append(f"umount: {r.text()}")
                r = sh(["umount", "-l", self.mnt], 60)
            if r.rc != 0:
                problems.append(f"umount -l: {r.text()}")
            self.mounted = False
        if self.loop:
            r = sh(["losetup", "-d", self.loop], 30)
            if r.rc != 0:
                problems.append(f"losetup -d {self.loop}: {r.text()}")
        if self.nbdfuse is not None:
            if mounted_at(self.fusedir):
                # the loop device lets go of the FUSE file asynchronously (autoclear): retry
                for _ in range(40):
                    if sh(["fusermount3", "-u", self.fusedir], 30).rc == 0 or not mounted_at(self.fusedir):
                        break
                    time.sleep(0.25)
                else:
                    self.notes.append("fusermount3 -u busy for 10 s; lazy unmount")
                    sh(["fusermount3", "-u", "-z", self.fusedir], 30)
            if not _wait(self.nbdfuse, 10):
                self._abort_fuse()
                self.nbdfuse.kill()
                if not _wait(self.nbdfuse, 10):
                    problems.append("nbdfuse did not exit after SIGKILL")
        # the old loop device must be gone before the volume is attached again
        if self.loop:
            dev = Path("/sys/block") / Path(self.loop).name / "loop" / "backing_file"
            disk = self.disk

            def gone():
                try:
                    return dev.read_text().strip() != disk
                except OSError:
                    return True

            if not _wait_for(gone, 20, 0.05):
                self._abort_fuse()
                if not _wait_for(gone, 10, 0.05):
                    problems.append(f"{self.loop} still attached to {disk} 30 s after losetup -d")
            self.loop = None
        if self.server is not None and self.server.poll() is None:
            rc = self.stop_server()
            if not crashed and rc != 0:
                problems.append(f"server exit status {rc} after SIGTERM")
        if "panicked" in self.server_stderr():
            problems.append(f"server panicked:\n{self.server_stderr()[-3000:]}")
        return problems


# --------------------------------------------------------------------------------------------
# the campaign


@dataclass
class Volume:
    name: str
    sector_size: int
    block_size: int
    backing: Path
    key: Path
    journal: Path
    size: int


@dataclass
class RoundResult:
    round: int
    volume: str
    sector_size: int
    block_size: int
    direct: bool = False  # serve --direct (O_DIRECT backing) in both phases
    # "kill-9", or "power-loss p=F": after the kill, writes not covered by a completed fdatasync
    # are undone (each with probability F) from the LD_PRELOAD shim's undo log
    crash_model: str = "kill-9"
    writes_logged: int = 0  # power loss: backing writes since the last sync that covered everything
    writes_undone: int = 0
    bytes_undone: int = 0
    kill_after_s: float = 0.0  # from the workload's start record to SIGKILL of the server
    steps_done_at_kill: int = 0  # fsync'd steps (create/replace/delete) journaled this round before the kill
    step_in_flight_at_kill: bool = False  # a step was begun and not done when the server died
    done_after_kill: int = 0  # steps whose fsyncs returned success after the kill (must hold too)
    unsynced_bytes: int = 0
    workload_end: str = ""
    needs_recovery: Optional[bool] = None
    files_verified: int = 0  # live fsync'd files whose sha256 was checked (all rounds so far)
    absent_verified: int = 0  # fsync'd deletes checked to be absent
    half_done_checked: int = 0  # steps in flight at the kill: old or new content accepted
    fsck_rc: Optional[int] = None
    fsck_out: str = ""
    lost: list = field(default_factory=list)  # journaled files that did not match
    problems: list = field(default_factory=list)  # tear-down / server trouble
    notes: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return self.fsck_rc == 0

    @property
    def intact(self) -> bool:
        return self.fsck_rc is not None and not self.lost

    @property
    def ok(self) -> bool:
        return self.clean and self.intact and not self.problems


def build_undo_shim(workdir: Path) -> Path:
    """Compiles crash_undo_shim.c into `workdir`; the power-loss model's LD_PRELOAD library."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FileNotFoundError("--power-loss needs a C compiler (cc) for crash_undo_shim.c")
    shim = workdir / "crash_undo_shim.so"
    r = sh([cc, "-O2", "-Wall", "-shared", "-fPIC", "-o", shim, Path(__file__).resolve().with_name("crash_undo_shim.c"), "-ldl"], 120)
    if r.rc != 0:
        raise StackError(f"building the undo shim failed: {r.text()}")
    return shim


def apply_undo(log: Path, backing: Path, fraction: float, rng: random.Random) -> tuple[int, int, int]:
    """Writes back the old bytes of the logged writes that no completed sync covered (each with
    probability `fraction`), newest first. A write made durable by itself (RWF_DSYNC, a 'D'
    record) is kept, and so are its bytes against the undo of older writes under it. Returns
    (writes not covered, undone, bytes undone)."""
    import mmap
    import struct

    if not log.exists() or log.stat().st_size == 0:
        return 0, 0, 0
    with open(log, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        recs = []
        durable = 0
        dsync: set[int] = set()
        pos = 0
        while pos < len(m):
            t = m[pos : pos + 1]
            if t == b"W" and pos + 17 <= len(m):
                off, n = struct.unpack_from("<QQ", m, pos + 1)
                if pos + 17 + n > len(m):
                    break  # torn by the kill: logged before its write, so that write never happened
                recs.append((pos, off, pos + 17, n))
                pos += 17 + n
            elif t == b"S" and pos + 9 <= len(m):
                durable = max(durable, struct.unpack_from("<Q", m, pos + 1)[0])
                pos += 9
            elif t == b"D" and pos + 9 <= len(m):
                dsync.add(struct.unpack_from("<Q", m, pos + 1)[0])
                pos += 9
            elif t in (b"W", b"S", b"D"):
                break  # torn header
            else:
                raise StackError(f"undo log {log}: bad record type {t!r} at {pos}")
        pending = [r for r in recs if r[0] >= durable and r[0] not in dsync]
        # The ranges the self-durable writes made durable, by log position.
        kept = [(p, off, off + n) for p, off, _, n in recs if p in dsync]
        undone = nbytes = 0
        fd = os.open(backing, os.O_WRONLY)
        try:
            for p, off, data_pos, n in reversed(pending):
                if fraction >= 1.0 or rng.random() < fraction:
                    # Only the bytes no later durable write covers go back.
                    pieces = [(off, off + n)]
                    for q, lo, hi in kept:
                        if q > p:
                            pieces = [x for a, b in pieces for x in ((a, min(b, lo)), (max(a, hi), b)) if x[0] < x[1]]
                    for a, b in pieces:
                        os.pwrite(fd, m[data_pos + a - off : data_pos + b - off], a)
                    undone += 1
                    nbytes += sum(b - a for a, b in pieces)
        finally:
            os.close(fd)
    return len(pending), undone, nbytes


class Campaign:
    def __init__(self, workdir: Path, seed: int, log=print, vol_size: int = 320 * MiB,
                 delay: tuple = (0.3, 4.0), max_live: int = 200, block_sizes: tuple = (4096, 1024),
                 power_loss: bool = False, lie: bool = False):
        self.workdir = workdir
        self.seed = seed
        self.rng = random.Random(seed)
        self.log = log
        self.vol_size = vol_size
        self.delay = delay
        self.max_live = max_live
        self.block_sizes = block_sizes
        self.power_loss = power_loss or lie
        self.lie = lie  # negative control: the shim counts no sync, so fsync'd files must be reported lost
        self.shim: Optional[Path] = None
        self.procs: list[subprocess.Popen] = []
        self.stacks: list[Stack] = []
        self.sockdir = Path(tempfile.mkdtemp(prefix="cbcc", dir="/tmp"))  # unix socket paths <= 108 bytes
        self.volumes: list[Volume] = []
        self.results: list[RoundResult] = []
        self.bin = workdir / "cryptbridge"

    def setup(self) -> None:
        if not BIN.exists():
            raise FileNotFoundError(f"{BIN} not found: run `cargo build --release --locked` first")
        # a private copy: a rebuild of the shared target dir mid-campaign must not change the binary
        shutil.copy2(BIN, self.bin)
        if self.power_loss:
            self.shim = build_undo_shim(self.workdir)
        self.bin_info = f"{BIN} (mtime {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(BIN.stat().st_mtime))}, " \
                        f"sha256 {_sha(self.bin)[:16]})"
        key_bytes = os.urandom(64)
        while key_bytes[:32] == key_bytes[32:]:
            key_bytes = os.urandom(64)
        specs = [(4096, 4096), (512, 4096)] + [(512, b) for b in self.block_sizes if b != 4096]
        for ss, bs in specs:
            name = f"s{ss}-b{bs}"
            key = self.workdir / f"{name}.key"
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, key_bytes)  # the same key for every volume and round
            os.close(fd)
            backing = self.workdir / f"{name}.img"
            with open(backing, "wb") as f:
                f.truncate(self.vol_size)
            vol = Volume(name, ss, bs, backing, key, self.workdir / f"{name}.journal", self.vol_size)
            st = self.stack(vol, f"{name}-mkfs")
            try:
                st.start_server()
                st.attach()
                r = sh(["mkfs.ext4", "-q", "-F", "-b", bs, "-E", "lazy_itable_init=0,lazy_journal_init=0",
                        st.loop], 300)
                if r.rc != 0:
                    raise StackError(f"mkfs.ext4 -b {bs} on {name}: {r.text()}")
            finally:
                probs = st.teardown(crashed=False)
            if probs:
                raise StackError(f"{name}: tear-down after mkfs: {probs}")
            self.volumes.append(vol)
            self.log(f"volume {name}: {self.vol_size // MiB} MiB, --sector-size {ss}, mkfs.ext4 -b {bs}")

    def stack(self, vol: Volume, label: str, direct: bool = False) -> Stack:
        st = Stack(self, vol, label, direct)
        self.stacks.append(st)
        return st

    def crash_phase(self, vol: Volume, rr: RoundResult) -> None:
        st = self.stack(vol, f"r{rr.round:03d}-{vol.name}-crash", rr.direct)
        child = None
        undo_log = st.dir / "undo.log"
        env = None
        if self.power_loss:
            env = {"LD_PRELOAD": str(self.shim), "CB_UNDO_BACKING": str(vol.backing), "CB_UNDO_LOG": str(undo_log),
                   "CB_UNDO_LIE": "1" if self.lie else "0"}
        killed = False
        try:
            st.start_server(env)
            st.attach()
            st.mount()
            n_before = len(journal_read(vol.journal))
            with open(st.dir / "workload.out", "wb") as wout:
                child = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--workload", str(st.mnt), str(vol.journal),
                     str(self.rng.randrange(1 << 30)), str(rr.round), str(self.max_live)],
                    stdin=subprocess.DEVNULL, stdout=wout, stderr=subprocess.STDOUT, start_new_session=True)
            self.procs.append(child)

            def started():
                return any(r.get("op") == "start" and r.get("round") == rr.round
                           for r in journal_read(vol.journal)[n_before:]) or child.poll() is not None

            if not _wait_for(started, 30, 0.01) or child.poll() is not None:
                raise StackError(f"workload did not start: {(st.dir / 'workload.out').read_text()}")
            t0 = time.monotonic()
            time.sleep(self.rng.uniform(*self.delay))
            if child.poll() is not None:
                raise StackError(f"workload ended before the kill: {(st.dir / 'workload.out').read_text()}")
            if st.server.poll() is not None:
                raise StackError(f"server died before the kill: {st.server_stderr()[-2000:]}")
            st.kill_server()
            killed = True
            t_kill = time.time()
            rr.kill_after_s = time.monotonic() - t0
            recs = journal_read(vol.journal)[n_before:]
            begun = [r for r in recs if r.get("op") == "begin"]
            done = [r for r in recs if r.get("op") == "done"]
            rr.steps_done_at_kill = len(done)
            rr.step_in_flight_at_kill = len(begun) > len(done)
            # let the workload run into the errors, then kill it
            _wait(child, 0.5)
            if child.poll() is None:
                _killpg(child.pid)
                if not _wait(child, 10):
                    st._abort_fuse()
                    if not _wait(child, 10):
                        rr.problems.append("workload did not exit after SIGKILL")
                rr.workload_end = "killed"
            else:
                rr.workload_end = f"exit {child.returncode}"
            recs = journal_read(vol.journal)[n_before:]
            rr.done_after_kill = sum(1 for r in recs if r.get("op") == "done" and r["t"] > t_kill)
            err = [r for r in recs if r.get("op") == "error"]
            if err:
                rr.workload_end += f" ({err[-1]['error']})"
                rr.unsynced_bytes = err[-1].get("unsynced_bytes", 0)
        finally:
            if child is not None and child.poll() is None:
                _killpg(child.pid)
                _wait(child, 10)
            rr.problems += st.teardown(crashed=True)
            rr.notes += st.notes
        if self.power_loss and killed:
            if "crash_undo_shim: tracking fd" not in st.server_stderr():
                raise StackError(f"the undo shim never saw the backing opened: {st.server_stderr()[-2000:]}")
            fraction = float(rr.crash_model.split("=")[1])
            rr.writes_logged, rr.writes_undone, rr.bytes_undone = apply_undo(
                undo_log, vol.backing, fraction, random.Random(self.rng.randrange(1 << 30)))

    def check_phase(self, vol: Volume, rr: RoundResult) -> None:
        st = self.stack(vol, f"r{rr.round:03d}-{vol.name}-check", rr.direct)
        try:
            st.start_server()
            st.attach()
            r = sh(["dumpe2fs", "-h", st.loop], 60)
            m = re.search(r"^Filesystem features:\s*(.*)$", r.out, re.M)
            rr.needs_recovery = ("needs_recovery" in m.group(1).split()) if m else None
            st.mount()  # replays the journal
            self.verify(vol, st.mnt, rr)
            u = st.umount()
            if u.rc != 0:
                raise StackError(f"umount after verify: {u.text()}")
            f = sh(["fsck.ext4", "-fn", st.loop], 300)
            rr.fsck_rc = f.rc
            rr.fsck_out = (f.out + f.err).strip()
        finally:
            rr.problems += st.teardown(crashed=False)
            rr.notes += st.notes

    def verify(self, vol: Volume, mnt: Path, rr: RoundResult) -> None:
        state = journal_state(journal_read(vol.journal))
        settle = []
        for name, s in sorted(state.items()):
            actual = _sha(mnt / "synced" / name)
            ok = actual == s.new if s.done else actual in (s.old, s.new)
            if s.done and s.new is not None:
                rr.files_verified += 1
            elif s.done:
                rr.absent_verified += 1
            else:
                rr.half_done_checked += 1
            if not ok:
                rr.lost.append({"name": name, "expected": s.new if s.done else [s.old, s.new],
                                "actual": actual, "size": s.size, "written_in_round": s.round,
                                "state": "done" if s.done else "in flight"})
            if not s.done or not ok:
                settle.append((name, actual))
        # record what the half-done steps (and any loss) came to, so later rounds expect that
        fd = os.open(vol.journal, os.O_WRONLY | os.O_APPEND)
        try:
            for name, actual in settle:
                size = (mnt / "synced" / name).stat().st_size if actual is not None else -1
                journal_append(fd, {"op": "settle", "name": name, "hash": actual, "size": size, "round": rr.round})
        finally:
            os.close(fd)

    def run(self, rounds: int) -> list[RoundResult]:
        for i in range(1, rounds + 1):
            vol = self.volumes[(i - 1) % len(self.volumes)]
            # each volume's rounds alternate between a page-cache backing and --direct (O_DIRECT)
            direct = ((i - 1) // len(self.volumes)) % 2 == 1
            rr = RoundResult(i, vol.name, vol.sector_size, vol.block_size, direct)
            if self.power_loss:
                # every unsynced write lost, or a random half of them (a volatile cache keeps any subset)
                rr.crash_model = f"power-loss{' LIE' if self.lie else ''} p={1.0 if i % 2 else 0.5}"
            t0 = time.monotonic()
            try:
                self.crash_phase(vol, rr)
                self.check_phase(vol, rr)
            except StackError as e:
                rr.problems.append(str(e))
            rr.seconds = time.monotonic() - t0
            self.results.append(rr)
            self.log(format_round(rr))
            if rr.lost:
                for x in rr.lost[:20]:
                    self.log(f"    LOST: {x}")
            if rr.fsck_rc not in (0, None):
                self.log("    fsck output:\n" + "\n".join("      " + l for l in rr.fsck_out.splitlines()[-40:]))
            for p in rr.problems:
                self.log(f"    PROBLEM: {p}")
            for n in rr.notes:
                self.log(f"    note: {n}")
        return self.results

    def cleanup(self) -> list[str]:
        """Tears down whatever is still up (after an exception); returns leftovers it could not remove."""
        problems = []
        for st in reversed(self.stacks):
            if st.mounted or st.loop or (st.nbdfuse and st.nbdfuse.poll() is None) or \
                    (st.server and st.server.poll() is None):
                problems += st.teardown(crashed=True)
        for p in self.procs:
            if p.poll() is None:
                _killpg(p.pid)
                if not _wait(p, 10):
                    problems.append(f"process {p.pid} ({p.args[:2]}) did not exit")
        left = mounts_under(self.workdir)
        for m in left:
            sh(["umount", "-l", m], 30)
        if mounts_under(self.workdir):
            problems.append(f"mounts left: {mounts_under(self.workdir)}")
        loops = loops_on(self.workdir)
        if loops:
            problems.append(f"loop devices left: {loops}")
        shutil.rmtree(self.sockdir, ignore_errors=True)
        return problems


def format_round(rr: RoundResult) -> str:
    verdict = "OK  " if rr.ok else "FAIL"
    rec = {True: "yes", False: "no", None: "?"}[rr.needs_recovery]
    undo = f" undid {rr.writes_undone}/{rr.writes_logged} unsynced writes ({rr.bytes_undone >> 10} KiB)" \
        if rr.crash_model != "kill-9" else ""
    return (f"round {rr.round:3d} {verdict} {rr.volume:11s} {'direct  ' if rr.direct else 'buffered'} "
            f"{rr.crash_model}{undo} kill at {rr.kill_after_s:5.2f} s "
            f"({rr.steps_done_at_kill:3d} steps done{', 1 in flight' if rr.step_in_flight_at_kill else ''}"
            f"{f', {rr.done_after_kill} done after kill' if rr.done_after_kill else ''}) "
            f"journal replay needed: {rec:3s} fsck -fn rc={rr.fsck_rc} "
            f"verified {rr.files_verified} files + {rr.absent_verified} deletes + {rr.half_done_checked} half-done, "
            f"lost {len(rr.lost)}  [{rr.seconds:.1f} s]")


def summary(results: list[RoundResult], seconds: float) -> dict:
    return {
        "rounds": len(results),
        "rounds_ok": sum(r.ok for r in results),
        "rounds_fsck_clean": sum(r.clean for r in results),
        "rounds_intact": sum(r.intact for r in results),
        "rounds_needing_journal_replay": sum(bool(r.needs_recovery) for r in results),
        "files_verified_total": sum(r.files_verified for r in results),
        "fsynced_steps_before_kill_total": sum(r.steps_done_at_kill for r in results),
        "steps_done_after_kill_total": sum(r.done_after_kill for r in results),
        "rounds_with_step_in_flight": sum(r.step_in_flight_at_kill for r in results),
        "files_lost_total": sum(len(r.lost) for r in results),
        "rounds_with_writes_undone": sum(r.writes_undone > 0 for r in results),
        "writes_undone_total": sum(r.writes_undone for r in results),
        "bytes_undone_total": sum(r.bytes_undone for r in results),
        "kill_after_s": [round(r.kill_after_s, 2) for r in results],
        "seconds": round(seconds, 1),
    }


def run_campaign(rounds: int, workdir: Path, seed: Optional[int] = None, log=print, **kw) -> tuple[list, dict, list]:
    """Runs the campaign in workdir; returns (round results, summary, leftover problems)."""
    seed = random.randrange(1 << 31) if seed is None else seed
    t0 = time.monotonic()
    camp = Campaign(workdir, seed, log=log, **kw)
    log(f"crash campaign: {rounds} rounds, seed {seed}, workdir {workdir}")
    try:
        camp.setup()
        log(f"binary: {camp.bin_info}")
        camp.run(rounds)
    finally:
        leftovers = camp.cleanup()
    s = summary(camp.results, time.monotonic() - t0)
    s["seed"] = seed
    s["binary"] = getattr(camp, "bin_info", str(BIN))
    return camp.results, s, leftovers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--workdir", type=Path, help="default: a new directory under /var/tmp, removed when every round passed")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (backing files, logs, journals)")
    ap.add_argument("--json", type=Path, help="write the per-round results and the summary here")
    ap.add_argument("--max-delay", type=float, default=4.0, help="kill the server 0.3 .. this many seconds into the workload")
    ap.add_argument("--block-sizes", default="4096,1024",
                    help="ext4 block sizes, comma separated: 4096 gives a 4096- and a 512-byte-sector volume, "
                         "1024 a third volume with 512-byte sectors (default: both)")
    ap.add_argument("--power-loss", action="store_true",
                    help="model a power cut: after each kill, undo the backing writes no completed fdatasync covered "
                         "(LD_PRELOAD shim, needs cc)")
    ap.add_argument("--lie", action="store_true",
                    help="negative control for --power-loss: count no sync as done; the campaign must then FAIL")
    ap.add_argument("--workload", nargs=5, metavar=("MNT", "JOURNAL", "SEED", "ROUND", "MAX_LIVE"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.workload:
        mnt, journal, seed, rnd, max_live = a.workload
        return workload(Path(mnt), Path(journal), int(seed), int(rnd), int(max_live))

    reason = skip_reason()
    if reason:
        print(f"crash-campaign: SKIPPED ({reason})")
        return 0
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="cbcrash-", dir="/var/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    # SIGTERM/SIGHUP: unwind through the finally blocks so nothing stays mounted
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    results, s, leftovers = run_campaign(a.rounds, workdir, a.seed,
                                         delay=(0.3, a.max_delay),
                                         block_sizes=tuple(int(x) for x in a.block_sizes.split(",")),
                                         power_loss=a.power_loss, lie=a.lie)
    print(json.dumps(s, indent=1))
    if a.json:
        a.json.write_text(json.dumps({"summary": s, "rounds": [r.__dict__ for r in results],
                                      "leftovers": leftovers}, indent=1, default=str))
    for p in leftovers:
        print(f"LEFTOVER: {p}")
    ok = s["rounds_ok"] == a.rounds and not leftovers
    print(f"crash-campaign: {s['rounds_ok']}/{a.rounds} rounds clean and intact "
          f"({s['rounds_fsck_clean']} fsck-clean, {s['rounds_intact']} with every fsync'd file intact), "
          f"{s['files_verified_total']} file checks, {s['files_lost_total']} lost, {s['seconds']} s")
    if ok and not a.keep and a.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"work directory kept: {workdir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
