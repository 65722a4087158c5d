#!/usr/bin/env python3
"""Crash campaign for LUKS2 reencryption (issue 28): kill -9 in the middle of a reencryption, then
recovery by either tool, and a check of every sector and every acknowledged write.

Per resilience mode (checksum, journal) one LUKS2 volume (cryptsetup luksFormat, plaintext written
with an independent XTS), its reencryption initialized by `cryptsetup reencrypt --init-only`; for
datashift, an unencrypted image whose encryption `cryptsetup reencrypt --encrypt --init-only
--reduce-device-size` initialized (the data moves by half of that, the first part to the end);
for decrypt (`--modes decrypt`, resilience datashift-checksum), a LUKS2 volume whose decryption
`cryptsetup reencrypt --decrypt --header NEW --init-only` initialized (the header moves to NEW,
the data to the start; the undo shim models the image, not NEW).
Rounds:

1. Crash phase. Normally `cryptbridge serve --reencrypt --reencrypt-rate R` while a client writes
   random stretches through NBD, each followed by FLUSH: a write whose FLUSH returned is
   acknowledged and must survive; the one in flight at the kill may read old or new. Half the
   rounds kill while the header shows a hotzone flagged `in-reencryption` (the server stopped with
   SIGSTOP while the header is read, so what is seen is what it leaves), the others after a random
   delay. Every fifth round `cryptsetup reencrypt --resume-only` is the one killed in a hotzone
   instead. Power-loss rounds (every other one with --power-loss): the server runs under the
   LD_PRELOAD undo shim of crash_campaign.py, and after the kill the writes no completed
   fdatasync covered are undone (all of them, or a random half), header writes included.
2. Recovery. Every third round by cryptsetup (whichever tool was killed; when that round's
   reencryption finished before the kill, the next round still in progress) (`repair`, then `reencrypt --resume-only
   --force-offline-reencrypt` to the end; the data area then decrypted here with the key
   `luksDump --dump-volume-key` prints), the others by `cryptbridge serve --reencrypt`, which
   recovers the hotzone (checksum: the blocks whose hash still matches the old ciphertext; journal:
   from the area), and every byte is read through NBD and compared. A finished reencryption is
   initialized again (a new key) for the next rounds.

A round is clean when every byte equals the model (the plaintext with every acknowledged write;
the write in flight either way). ``--lie`` (the negative control) makes the shim count no sync:
acknowledged writes are then lost and the campaign must say so.

Run as a script (``--rounds N`` per mode, ``make crash-campaign-reencrypt``) or through
``run_campaign`` from test_reencrypt_crash.py. Needs cryptsetup and the Python cryptography
package; --power-loss needs a C compiler.
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
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from crash_campaign import apply_undo, build_undo_shim  # noqa: E402
from nbd_client import NBDClient  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("CRYPTBRIDGE_BIN", REPO / "target" / "release" / "cryptbridge"))
MiB = 1 << 20
PASS = b"reencrypt crash campaign"
SECTOR = 4096  # the volumes' sector, old and new
FAST = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
SHIFT = 4 * MiB  # datashift: the data moves by this (--reduce-device-size twice it)


def skip_reason() -> Optional[str]:
    if shutil.which("cryptsetup") is None:
        return "cryptsetup not installed (scripts/install-deps.sh)"
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return "the Python cryptography package is needed for the independent XTS"
    return None


def xts_sectors(key: bytes, data: bytes, sector: int, first_iv: int, encrypt: bool) -> bytes:
    """aes-xts-plain64 over whole sectors, IVs counting 512-byte units (LUKS at every sector size)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    out = bytearray()
    for i in range(0, len(data), sector):
        c = Cipher(algorithms.AES(key), modes.XTS((first_iv + i // 512).to_bytes(16, "little")))
        op = c.encryptor() if encrypt else c.decryptor()
        out += op.update(data[i : i + sector]) + op.finalize()
    return bytes(out)


def cryptsetup(*args, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["cryptsetup", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"cryptsetup {' '.join(map(str, args))}: exit {p.returncode}: {p.stderr.decode()[-2000:]}")
    return p


def header_json(img: Path):
    """The JSON of the header copy a LUKS2 tool would use: the valid copy (sha256 checksum) with the
    higher sequence id, read directly, without the lock. cryptsetup writes a copy in three steps
    (binary header without checksum, JSON, checksum), so the other tool may be stopped between
    them; a torn primary then falls back to the secondary, as cryptsetup and cryptbridge do. None
    when no copy is valid."""
    best = None
    with open(img, "rb") as f:
        primary = f.read(4096)
        hdr_size = struct.unpack(">Q", primary[8:16])[0] if len(primary) == 4096 else 0
        for offset in sorted({0, hdr_size if 16384 <= hdr_size <= 4 << 20 else 16384}):
            f.seek(offset)
            binary = f.read(4096)
            if len(binary) < 4096 or binary[:6] not in (b"LUKS\xba\xbe", b"SKUL\xba\xbe"):
                continue
            size = struct.unpack(">Q", binary[8:16])[0]
            if not 16384 <= size <= 4 << 20:
                continue
            area = f.read(size - 4096)
            if hashlib.sha256(binary[:448] + bytes(64) + binary[512:] + area).digest() != binary[448:480]:
                continue
            seqid = struct.unpack(">Q", binary[16:24])[0]
            if best is None or seqid > best[0]:
                best = (seqid, area)
    if best is None:
        return None
    try:
        return json.loads(best[1].split(b"\0", 1)[0])
    except ValueError:
        return None


def active_segments(meta) -> list:
    backups = {"backup-previous", "backup-final", "backup-moved-segment"}
    return [s for _, s in sorted(meta["segments"].items(), key=lambda kv: int(kv[0])) if not backups & set(s.get("flags", []))]


def is_hot(meta) -> bool:
    return bool(meta) and any("in-reencryption" in s.get("flags", []) for s in active_segments(meta))


def in_progress(img: Path) -> bool:
    if not img.exists():
        return False
    meta = header_json(img)
    return bool(meta) and "requirements" in meta["config"]


def volume_key(img: Path, pw: Path) -> bytes:
    out = cryptsetup("luksDump", "--dump-volume-key", "--batch-mode", "--key-file", pw, img).stdout.decode()
    m = re.search(r"(?:MK dump|Volume key):?\s*\n?((?:\s*(?:[0-9a-f]{2}\s+)+)+)", out)
    assert m, out
    return bytes.fromhex("".join(m.group(1).split()))


@dataclass
class Volume:
    resilience: str
    img: Path
    pw: Path
    offset: int
    model: bytearray  # the plaintext every byte must read as
    size: int = 0  # the image's
    inits: int = 0
    header: Optional[Path] = None  # decrypt: where the header moves

    @property
    def hdr(self) -> Path:
        return self.header or self.img

    def header_opts(self) -> list:
        return ["--header", str(self.header)] if self.header else []

    def init(self) -> None:
        if self.resilience == "decrypt":
            # A finished decryption leaves plaintext and no key: a new volume holding the model.
            assert self.header is not None
            self.header.unlink(missing_ok=True)
            with open(self.img, "wb") as f:
                f.truncate(self.size)
            cryptsetup("luksFormat", "--batch-mode", "--type", "luks2", "--key-file", self.pw, *FAST, "--sector-size", str(SECTOR), self.img)
            with open(self.img, "r+b") as f:
                f.seek(self.size - len(self.model))
                f.write(xts_sectors(volume_key(self.img, self.pw), bytes(self.model), SECTOR, 0, True))
            cryptsetup("reencrypt", "--decrypt", "--init-only", "--batch-mode", "--force-offline-reencrypt", "--header", self.header,
                       "--key-file", self.pw, self.img)  # fmt: skip
        elif self.resilience == "datashift":
            # A finished encryption leaves a LUKS2 volume: the next rounds start from plaintext again.
            with open(self.img, "wb") as f:
                f.truncate(self.size)
                f.write(self.model)
            cryptsetup("reencrypt", "--encrypt", "--init-only", "--type", "luks2", "--batch-mode", "--key-file", self.pw, *FAST,
                       "--sector-size", str(SECTOR), "--reduce-device-size", str(2 * SHIFT), self.img)  # fmt: skip
        else:
            cryptsetup("reencrypt", "--init-only", "--batch-mode", "--force-offline-reencrypt", "--key-file", self.pw, *FAST,
                       "--resilience", self.resilience, self.img)  # fmt: skip
        self.inits += 1


@dataclass
class Round:
    round: int
    resilience: str
    killed: str  # "cryptbridge" or "cryptsetup"
    crash_model: str = "kill-9"
    kill: str = ""  # "in a hotzone" or "after N s"
    hot_at_kill: bool = False
    acked_writes: int = 0
    in_flight_at_kill: bool = False
    writes_undone: int = 0
    recovered_by: str = ""
    recovered_hotzone: bool = False
    wrong: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.wrong and not self.problems


class Server:
    def __init__(self, c: "Campaign", vol: Volume, label: str, env: Optional[dict] = None, rate: Optional[str] = None, reencrypt: bool = True):
        self.sock = c.sockdir / f"{label}.sock"
        self.err_path = c.workdir / f"{label}.stderr"
        argv = [c.bin, "serve", "--type", "luks", "--backing", vol.img, *vol.header_opts(), "--key-file", vol.pw, "--unix", self.sock]
        if reencrypt:
            argv.append("--reencrypt")
        if rate:
            argv += ["--reencrypt-rate", rate]
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(list(map(str, argv)), stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **(env or {})}, start_new_session=True)  # fmt: skip
        line = self.proc.stdout.readline().decode()
        if not line.startswith("ready "):
            self.proc.wait(timeout=30)
            raise RuntimeError(f"serve did not start (exit {self.proc.returncode}): {self.stderr()[-3000:]}")
        self.uri = line.split()[1]

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


def kill_in_hotzone(proc: subprocess.Popen, img: Path, timeout: float) -> bool:
    """SIGKILL `proc` once the header shows a hotzone; False (and killed anyway) when none was seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        proc.send_signal(signal.SIGSTOP)
        if is_hot(header_json(img)):
            proc.kill()
            proc.wait(timeout=30)
            return True
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.002)
    proc.kill()
    proc.wait(timeout=30)
    return False


class Writer(threading.Thread):
    """Random writes, each followed by FLUSH; the model takes a write once its FLUSH returned."""

    def __init__(self, uri: str, vol: Volume, rng: random.Random):
        super().__init__(daemon=True)
        self.uri, self.vol, self.rng = uri, vol, rng
        self.pending: Optional[tuple[int, bytes]] = None
        self.acked = 0
        self.error: Optional[str] = None

    def run(self) -> None:
        size = len(self.vol.model)
        try:
            with NBDClient(self.uri) as c:
                c.connect()
                while True:
                    n = self.rng.choice([512, 4096, 5000, 65536, 300_000])
                    off = self.rng.randrange(0, size - n)
                    data = os.urandom(n)
                    self.pending = (off, data)
                    c.write(off, data)
                    c.flush()
                    self.vol.model[off : off + n] = data
                    self.pending = None
                    self.acked += 1
        except Exception as e:  # the server's death ends the writer
            self.error = repr(e)


class Campaign:
    def __init__(self, workdir: Path, seed: int, log=print, size: int = 80 * MiB, power_loss: bool = False, lie: bool = False,
                 modes: tuple = ("checksum", "journal", "datashift"), rate: str = "16M"):  # fmt: skip
        unknown = set(modes) - {"checksum", "journal", "datashift", "decrypt"}
        if unknown:
            raise ValueError(f"unknown modes {sorted(unknown)}: use checksum, journal, datashift, decrypt")
        self.workdir, self.rng, self.log, self.size = workdir, random.Random(seed), log, size
        self.power_loss, self.lie, self.modes, self.rate = power_loss or lie, lie, modes, rate
        self.sockdir = Path(tempfile.mkdtemp(prefix="cbrc", dir="/tmp"))
        self.bin = workdir / "cryptbridge"
        self.shim: Optional[Path] = None
        self.volumes: dict[str, Volume] = {}
        self.results: list[Round] = []
        self.before: Optional[bytes] = None
        self.cryptsetup_owed: dict[str, int] = {}

    def setup(self) -> None:
        if not BIN.exists():
            raise FileNotFoundError(f"{BIN} not found: run `cargo build --release --locked` first")
        shutil.copy2(BIN, self.bin)
        if self.power_loss:
            self.shim = build_undo_shim(self.workdir)
        for mode in self.modes:
            img, pw = self.workdir / f"{mode}.img", self.workdir / f"{mode}.pass"
            fd = os.open(pw, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, PASS)
            os.close(fd)
            if mode == "decrypt":
                offset = 16 * MiB  # cryptsetup's LUKS2 data offset: the shift
                vol = Volume(mode, img, pw, 0, bytearray(os.urandom(self.size - offset)), self.size, header=self.workdir / "decrypt.hdr")
                vol.init()
                self.volumes[mode] = vol
                self.log(f"volume {mode}: {self.size // MiB} MiB LUKS2, its decryption initialized (the header moved out, the data moving {offset // MiB} MiB)")
                continue
            if mode == "datashift":
                vol = Volume(mode, img, pw, SHIFT, bytearray(os.urandom(self.size - 2 * SHIFT)), self.size)
                vol.init()
                self.volumes[mode] = vol
                self.log(f"volume {mode}: {self.size // MiB} MiB of plaintext, its encryption initialized (moving {SHIFT // MiB} MiB)")
                continue
            with open(img, "wb") as f:
                f.truncate(self.size)
            cryptsetup("luksFormat", "--batch-mode", "--type", "luks2", "--key-file", pw, *FAST, "--sector-size", "4096", img)
            meta = header_json(img)
            offset = int(meta["segments"]["0"]["offset"])
            plain = os.urandom(self.size - offset)
            with open(img, "r+b") as f:
                f.seek(offset)
                f.write(xts_sectors(volume_key(img, pw), plain, 4096, 0, True))
            vol = Volume(mode, img, pw, offset, bytearray(plain), self.size)
            vol.init()
            self.volumes[mode] = vol
            self.log(f"volume {mode}: {self.size // MiB} MiB LUKS2, 4096-byte sectors, reencryption initialized (resilience {mode})")

    def compare(self, got: bytes, vol: Volume, pending: Optional[tuple[int, bytes]], rr: Round) -> None:
        model = vol.model
        if pending is not None:
            # The write in flight at the kill was not acknowledged: each of its sectors may hold
            # the old or the new bytes (a large write reaches the disk in pieces).
            off, data = pending
            for lo in range(off // SECTOR * SECTOR, off + len(data), SECTOR):
                a, b = max(lo, off), min(lo + SECTOR, off + len(data))
                if got[a:b] == data[a - off : b - off]:
                    model[a:b] = data[a - off : b - off]
        if got != bytes(model):
            bad = [i for i in range(0, len(model), 4096) if got[i : i + 4096] != model[i : i + 4096]]
            # A lost write reads as what was there before the round; anything else is a wrong key or torn data.
            lost = [i for i in bad if self.before is not None and got[i : i + 4096] == self.before[i : i + 4096]]
            rr.wrong.append(f"{len(bad)} 4 KiB blocks differ ({len(lost)} hold what was there before the round), first at bytes {bad[:5]}")

    def crash_phase(self, vol: Volume, rr: Round) -> Optional[tuple[int, bytes]]:
        if rr.killed == "cryptsetup":
            p = subprocess.Popen(["cryptsetup", "reencrypt", "--resume-only", "--batch-mode", "--force-offline-reencrypt", "--hotzone-size", "1M",
                                  *vol.header_opts(), "--key-file", str(vol.pw), str(vol.img)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            rr.hot_at_kill = kill_in_hotzone(p, vol.hdr, 60)
            rr.kill = "in a hotzone" if rr.hot_at_kill else "cryptsetup finished first"
            return None
        env, undo_log = None, self.workdir / f"r{rr.round}.undo"
        if self.power_loss and rr.round % 2 == 0:
            env = {"LD_PRELOAD": str(self.shim), "CB_UNDO_BACKING": str(vol.img), "CB_UNDO_LOG": str(undo_log), "CB_UNDO_LIE": "1" if self.lie else "0"}
        srv = Server(self, vol, f"r{rr.round}-crash", env, self.rate)
        writer = Writer(srv.uri, vol, random.Random(self.rng.randrange(1 << 30)))
        writer.start()
        time.sleep(self.rng.uniform(0.05, 0.3))
        if self.rng.random() < 0.5:
            rr.hot_at_kill = kill_in_hotzone(srv.proc, vol.hdr, 20)
            rr.kill = "in a hotzone" if rr.hot_at_kill else "no hotzone seen in 20 s"
        else:
            delay = self.rng.uniform(0.1, 1.5)
            time.sleep(delay)
            srv.proc.send_signal(signal.SIGSTOP)
            rr.hot_at_kill = is_hot(header_json(vol.hdr))
            srv.proc.kill()
            srv.proc.wait(timeout=30)
            rr.kill = f"after {delay:.2f} s"
        writer.join(timeout=30)
        rr.acked_writes, rr.in_flight_at_kill = writer.acked, writer.pending is not None
        if env is not None:
            if "crash_undo_shim: tracking fd" not in srv.stderr():
                rr.problems.append("the undo shim never saw the image opened")
            fraction = 1.0 if rr.round % 4 == 0 else 0.5
            _, rr.writes_undone, _ = apply_undo(undo_log, vol.img, fraction, self.rng)
            rr.crash_model = f"power-loss p={fraction}"
            undo_log.unlink(missing_ok=True)
        return writer.pending

    def recover_with_cryptbridge(self, vol: Volume, rr: Round, pending) -> None:
        rr.recovered_by = "cryptbridge"
        if vol.header and not in_progress(vol.hdr):
            # A decryption that finished before the kill: plaintext, nothing to serve it as LUKS.
            self.compare(vol.img.read_bytes()[: len(vol.model)], vol, pending, rr)
            return
        # --reencrypt recovers a hotzone and goes on; a reencryption that finished before the kill
        # is served as it is.
        srv = Server(self, vol, f"r{rr.round}-check", reencrypt=in_progress(vol.hdr))
        try:
            rr.recovered_hotzone = "recovered the hotzone" in srv.stderr()
            with NBDClient(srv.uri) as c:
                c.connect()
                got = b"".join(c.read(o, min(4 * MiB, len(vol.model) - o)) for o in range(0, len(vol.model), 4 * MiB))
            self.compare(got, vol, pending, rr)
        finally:
            rc = srv.stop()
            if rc != 0:
                rr.problems.append(f"serve --reencrypt exit {rc} after SIGTERM: {srv.stderr()[-2000:]}")
            if "panicked" in srv.stderr():
                rr.problems.append(f"panic: {srv.stderr()[-2000:]}")

    def recover_with_cryptsetup(self, vol: Volume, rr: Round, pending) -> None:
        rr.recovered_by = "cryptsetup"
        rr.recovered_hotzone = is_hot(header_json(vol.hdr))
        if rr.recovered_hotzone:
            cryptsetup("repair", "--batch-mode", *vol.header_opts(), "--key-file", vol.pw, vol.img)
        if in_progress(vol.hdr):  # a repair of the last hotzone finishes the reencryption
            cryptsetup("reencrypt", "--resume-only", "--batch-mode", "--force-offline-reencrypt", *vol.header_opts(), "--key-file", vol.pw, vol.img)
        if vol.header:  # a finished decryption: the plaintext from the start
            self.compare(vol.img.read_bytes()[: len(vol.model)], vol, pending, rr)
            return
        with open(vol.img, "rb") as f:
            f.seek(vol.offset)
            raw = f.read(len(vol.model))
        self.compare(xts_sectors(volume_key(vol.img, vol.pw), raw, 4096, 0, False), vol, pending, rr)

    def round(self, n: int, mode: str) -> Round:
        vol = self.volumes[mode]
        t0 = time.monotonic()
        rr = Round(n, mode, "cryptsetup" if n % 5 == 4 else "cryptbridge")
        self.before = bytes(vol.model)
        try:
            if not in_progress(vol.hdr):
                vol.init()
            pending = self.crash_phase(vol, rr)
            # Every third round is cryptsetup's to recover; one it could not take (the reencryption
            # finished before the kill) passes to the next round still in progress.
            if n % 3 == 2:
                self.cryptsetup_owed[mode] = self.cryptsetup_owed.get(mode, 0) + 1
            if in_progress(vol.hdr) and self.cryptsetup_owed.get(mode, 0) > 0:
                self.cryptsetup_owed[mode] -= 1
                self.recover_with_cryptsetup(vol, rr, pending)
            else:
                self.recover_with_cryptbridge(vol, rr, pending)
        except Exception as e:
            rr.problems.append(repr(e))
        rr.seconds = time.monotonic() - t0
        self.log(f"round {n} {mode}: killed {rr.killed} {rr.kill} ({rr.crash_model}, {rr.acked_writes} acked writes, "
                 f"{rr.writes_undone} undone) -> recovered by {rr.recovered_by}{' (hotzone)' if rr.recovered_hotzone else ''}: "
                 f"{'ok' if rr.ok else 'FAILED ' + str(rr.wrong + rr.problems)} [{rr.seconds:.1f} s]")  # fmt: skip
        return rr

    def run(self, rounds: int) -> list[Round]:
        self.setup()
        for n in range(rounds):
            for mode in self.modes:
                self.results.append(self.round(n, mode))
        return self.results

    def summary(self) -> dict:
        rs = self.results
        return {
            "rounds": len(rs),
            "ok": sum(r.ok for r in rs),
            "per_mode": {m: {"rounds": sum(r.resilience == m for r in rs), "ok": sum(r.ok for r in rs if r.resilience == m),
                             "recovered_by_cryptsetup": sum(r.recovered_by == "cryptsetup" for r in rs if r.resilience == m),
                             "cryptsetup_killed": sum(r.killed == "cryptsetup" for r in rs if r.resilience == m),
                             "killed_in_hotzone": sum(r.hot_at_kill for r in rs if r.resilience == m),
                             "hotzones_recovered": sum(r.recovered_hotzone for r in rs if r.resilience == m)}
                         for m in self.modes},  # fmt: skip
            "acked_writes": sum(r.acked_writes for r in rs),
            "power_loss_rounds": sum(r.crash_model.startswith("power-loss") for r in rs),
            "writes_undone": sum(r.writes_undone for r in rs),
            "reinitialized": {m: v.inits for m, v in self.volumes.items()},
        }

    def cleanup(self) -> None:
        shutil.rmtree(self.sockdir, ignore_errors=True)


def run_campaign(rounds: int, workdir: Path, seed: Optional[int] = None, log=print, **kw) -> tuple[list[Round], dict]:
    seed = random.randrange(1 << 30) if seed is None else seed
    log(f"seed {seed}")
    c = Campaign(workdir, seed, log=log, **kw)
    try:
        results = c.run(rounds)
        return results, c.summary()
    finally:
        c.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30, help="rounds per resilience mode (default 30)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--power-loss", action="store_true", help="undo unsynced writes after the kill in every other round")
    ap.add_argument("--lie", action="store_true", help="negative control: the shim counts no sync")
    ap.add_argument("--modes", default="checksum,journal,datashift", help="modes, comma-separated: checksum, journal, datashift (default: these three), decrypt")
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--json", type=Path, help="write the rounds and the summary here")
    a = ap.parse_args()
    reason = skip_reason()
    if reason:
        print(f"SKIPPED: {reason}")
        return 0
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="cb-reencrypt-crash-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results, summary = run_campaign(a.rounds, workdir, a.seed, power_loss=a.power_loss, lie=a.lie, modes=tuple(a.modes.split(",")))
    print(json.dumps(summary, indent=2))
    if a.json:
        a.json.write_text(json.dumps({"summary": summary, "rounds": [r.__dict__ | {"ok": r.ok} for r in results]}, indent=2))
    bad = [r for r in results if not r.ok]
    print(f"{len(results) - len(bad)}/{len(results)} rounds clean")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
