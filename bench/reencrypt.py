#!/usr/bin/env python3
"""LUKS2 reencryption benchmark (issue 28): `cryptbridge luks reencrypt` against `cryptsetup
reencrypt`, and `serve --reencrypt` under client load and idle.

A benchmark, not a test: targets are reported as PASS/MISS and the exit status is 0 whenever the
measurements ran (1 only for setup failures such as a missing binary or tool).

Images. One file of random bytes (--size of data plus cryptsetup's 16 MiB LUKS2 header) is
formatted per resilience mode (`cryptsetup luksFormat --type luks2 --pbkdf pbkdf2
--pbkdf-force-iterations 1000 --cipher aes-xts-plain64 --key-size 512 --sector-size 4096`; the
random bytes stay as the data area's "ciphertext") and initialized (`cryptsetup reencrypt
--init-only --batch-mode --force-offline-reencrypt --resilience R`, a new key with the same
cipher, key size and sector size): one template per mode. Every measured run starts from a fresh
copy of its template (`cp --reflink=auto`, then fdatasync, outside the measured time), so every
tool starts from the same bytes and the copy's writeback is not charged to it. The images live
under --workdir (default bench/out/work, the disk; the data area mostly stays in the page cache,
every step's syncs go to the disk).

Part 1, offline (per resilience mode, --repeats times, tools in an order rotated per repeat and
mode):
  cryptsetup   cryptsetup reencrypt --resume-only --batch-mode --force-offline-reencrypt
               --key-file F IMG (its default hotzone)
  cb-offline   cryptbridge luks reencrypt IMG --resume-only --batch-mode --key-file F (its default
               hotzone, 16 MiB; --hotzone-size with --cb-hotzone)
  cb-idle      cryptbridge serve --type luks --backing IMG --key-file F --unix SOCK --reencrypt,
               no client: the time from its start to its "reencryption finished" log line
Each run's wall time (process start to exit, or to the log line; unlock included) gives its rate
(MB/s = 10^6 bytes of data area per second) and its CPU seconds are the child's user+sys from
resource usage (getrusage(RUSAGE_CHILDREN) around it; for cb-idle, the server up to its exit
after SIGTERM). cryptsetup's crypto runs in the kernel through AF_ALG in its own context, so it is
counted as its sys time. Each run is checked: exit status 0 and a header without the
online-reencrypt requirement (cb-idle: the log line).
Targets: cb-offline rate >= 2 x cryptsetup's, per mode (median of same-repeat ratios);
cb-idle rate >= 0.5 x cb-offline's, per mode.

Part 2, online under load (resilience --online-resilience, default checksum; an image of
--online-size, default 2G): per repeat one fresh copy of the template; per profile (SEQ1M Q8T1
read/write, RND4K Q32T1 read/write: bridge.py's fio jobs, `--ioengine=nbd` on a unix socket,
time based) two jobs in alternating order:
  baseline     serve --type luks on the copy, no --reencrypt (the same volume in the same state,
               its regions as the reencryption left them, nothing running in the background)
  online       the same with --reencrypt (default rate, no cap) --metrics SOCK
Each server is started for its job and stopped (SIGTERM) after it; the online server resumes the
reencryption where the last one stopped. cryptbridge_reencryption_done_bytes is read before and
after the fio run: the bytes re-encrypted during the job, and whether the reencryption was still
running when fio ended (a job where it was not is flagged and left out of the ratios).
Server CPU s/GiB: the server's utime+stime from /proc over the job per GiB the client moved (the
online server's includes the reencryption's work).
Targets: online / baseline MB/s (median of same-repeat ratios) >= 0.8 for RND4K Q32 read and
write, >= 0.7 for SEQ1M read and write.

Outputs: bench/out/reencrypt.json, bench/out/reencrypt.md (paste into a dated page under
docs/bench/), fio JSON under bench/out/fio/reencrypt/, server logs under bench/out/logs/.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_BINARY,
    OUT,
    BenchInterrupted,
    cpu_header,
    environment,
    fmt,
    install_signal_handlers,
    kill_group,
    log,
    median,
    run,
    shjoin,
    spawn,
    tool_version,
    verdict,
    warn,
    write_json,
)
from bridge import (  # noqa: E402
    PROFILES as BRIDGE_PROFILES,
    Profile,
    fill_file,
    fio_job,
    human_size,
    job_order,
    parse_size,
    sync_file,
)

MiB = 1 << 20
HEADER = 16 * MiB  # cryptsetup's default LUKS2 header (and data offset)
PASSPHRASE = b"cryptbridge-bench-reencrypt"
FAST_PBKDF2 = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
FORMAT = ["--type", "luks2", *FAST_PBKDF2, "--cipher", "aes-xts-plain64", "--key-size", "512", "--sector-size", "4096"]
RESILIENCES = ["checksum", "journal", "none"]
OFFLINE_TOOLS = ["cryptsetup", "cb-offline", "cb-idle"]
LABELS = {"cryptsetup": "cryptsetup reencrypt", "cb-offline": "cryptbridge luks reencrypt",
          "cb-idle": "serve --reencrypt, idle"}
PROFILES: list[Profile] = [p for p in BRIDGE_PROFILES
                           if p.key in ("seq1m_q8t1_read", "seq1m_q8t1_write", "rnd4k_q32t1_read", "rnd4k_q32t1_write")]
ONLINE_TARGETS = {"SEQ1M": 0.7, "RND4K": 0.8}
OFFLINE_TARGET = 2.0   # cb-offline / cryptsetup
IDLE_TARGET = 0.5      # cb-idle / cb-offline
REFRESH = 0.5          # online: a new copy of the template for the next pair past this share done


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cryptsetup_bin() -> str | None:
    for p in (shutil.which("cryptsetup"), "/usr/sbin/cryptsetup", "/sbin/cryptsetup"):
        if p and os.path.exists(p):
            return p
    return None


def header_finished(cs: str, img: Path) -> bool:
    r = run([cs, "luksDump", img], timeout=60)
    return r.returncode == 0 and "online-reencrypt" not in r.stdout


def copy_image(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    r = run(["cp", "--reflink=auto", src, dst], timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"cp {src} {dst}: {r.stderr.strip()}")
    sync_file(dst)


def make_templates(cs: str, work: Path, size: int, modes: list[str], keyfile: Path, tag: str) -> dict:
    """One init'ed template per resilience mode (kept between runs, keyed by size)."""
    base = work / f"reenc-random-{human_size(size)}.img"
    if not base.exists() or base.stat().st_size != size + HEADER:
        log(f"  filling {base} ({human_size(size + HEADER)} of random bytes)")
        tmp = base.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.truncate(size + HEADER)
        fill_file(tmp, 0, size + HEADER)
        tmp.replace(base)
    out = {}
    for mode in modes:
        t = work / f"reenc-{tag}-{mode}-{human_size(size)}.img"
        out[mode] = t
        if t.exists() and t.stat().st_size == size + HEADER:
            continue
        log(f"  template {t.name}: luksFormat + reencrypt --init-only --resilience {mode}")
        tmp = t.with_suffix(".tmp")
        copy_image(base, tmp)
        for argv in ([cs, "luksFormat", "--batch-mode", "--key-file", keyfile, *FORMAT, tmp],
                     [cs, "reencrypt", "--init-only", "--batch-mode", "--force-offline-reencrypt", "--key-file", keyfile,
                      *FAST_PBKDF2, "--key-size", "512", "--sector-size", "4096", "--resilience", mode, tmp]):
            r = run(argv, timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"{shjoin(argv)}: {(r.stderr or r.stdout).strip()[-500:]}")
        sync_file(tmp)
        tmp.replace(t)
    return out


class Server:
    """One `cryptbridge serve --type luks` on an image, with its log."""

    def __init__(self, key: str, binary: Path, img: Path, keyfile: Path, sock: Path, logdir: Path, extra=()):
        self.key, self.sock = key, sock
        self.metrics = sock.with_suffix(".metrics")
        self.argv = [str(binary), "serve", "--type", "luks", "--backing", str(img), "--key-file", str(keyfile),
                     "--unix", str(sock), *[str(a) for a in extra]]
        self.stdout_path = logdir / f"reencrypt-{key}.stdout.log"
        self.stderr_path = logdir / f"reencrypt-{key}.stderr.log"
        self.proc: subprocess.Popen | None = None
        self.uri: str | None = None
        self.started = 0.0

    def start(self, wait_ready: bool = True, timeout: float = 60.0) -> None:
        self.sock.unlink(missing_ok=True)
        self.metrics.unlink(missing_ok=True)
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.started = time.monotonic()
            self.proc = spawn(self.argv, out, err)
        if not wait_ready:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.key} exited {self.proc.returncode}: {shjoin(self.argv)}\n{self.stderr()[-600:]}")
            for line in self.stdout_path.read_text(errors="replace").splitlines():
                if line.startswith("ready "):
                    self.uri = line.split(None, 1)[1].strip()
                    return
            time.sleep(0.02)
        raise RuntimeError(f"{self.key} not ready after {timeout:.0f} s: {shjoin(self.argv)}")

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> int | None:
        rc = kill_group(self.proc, term_timeout=60)
        self.proc = None
        return rc

    def reencryption(self) -> tuple[float | None, float | None]:
        """(done bytes, size bytes) from the metrics socket."""
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(str(self.metrics))
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
        except OSError:
            return None, None
        vals = {}
        for line in data.decode(errors="replace").splitlines():
            m = re.match(r"^(cryptbridge_reencryption_(?:done|size)_bytes)(?:\{[^}]*\})?\s+(\S+)", line)
            if m:
                vals[m.group(1)] = float(m.group(2))
        return vals.get("cryptbridge_reencryption_done_bytes"), vals.get("cryptbridge_reencryption_size_bytes")


def hotzone_of(text: str) -> int | None:
    m = re.search(r"hotzone (\d+) bytes", text)
    return int(m.group(1)) if m else None


def offline_run(tool: str, args, cs: str, img: Path, keyfile: Path, rundir: Path, logdir: Path, data_size: int) -> dict:
    """One reencryption of `img` (a fresh copy of its template) by `tool`."""
    s: dict = {"tool": tool}
    if tool == "cb-idle":
        srv = Server("idle", args.binary, img, keyfile, rundir / "idle.sock", logdir, ["--reencrypt"])
        c0 = children_cpu()
        srv.start(wait_ready=False)
        t0 = srv.started
        deadline = t0 + args.timeout
        end = None
        try:
            while time.monotonic() < deadline:
                if "reencryption finished" in srv.stderr():
                    end = time.monotonic()
                    break
                if srv.proc.poll() is not None:
                    break
                time.sleep(0.01)
        finally:
            rc = srv.stop()
        s["cpu_s"] = round(children_cpu() - c0, 3)
        s["argv"] = shjoin(srv.argv)
        s["hotzone"] = hotzone_of(srv.stderr())
        s["ok"] = end is not None
        if end is None:
            s["error"] = f"no 'reencryption finished' (rc {rc}): {srv.stderr()[-400:]}"
            return s
        s["wall_s"] = round(end - t0, 3)
    else:
        if tool == "cryptsetup":
            argv = [cs, "reencrypt", "--resume-only", "--batch-mode", "--force-offline-reencrypt", "--key-file", keyfile, img]
        else:
            argv = [args.binary, "luks", "reencrypt", img, "--resume-only", "--batch-mode", "--key-file", keyfile]
            if args.cb_hotzone:
                argv += ["--hotzone-size", args.cb_hotzone]
        s["argv"] = shjoin(argv)
        c0 = children_cpu()
        t0 = time.monotonic()
        try:
            r = run(argv, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            s.update(ok=False, error="timed out")
            return s
        s["wall_s"] = round(time.monotonic() - t0, 3)
        s["cpu_s"] = round(children_cpu() - c0, 3)
        if tool == "cb-offline":
            s["hotzone"] = hotzone_of(r.stderr)
        s["ok"] = r.returncode == 0
        if not s["ok"]:
            s["error"] = f"rc={r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}"
            return s
    if tool != "cb-idle" and not header_finished(cs, img):
        s.update(ok=False, error="the header still shows a reencryption")
        return s
    s["mbps"] = round(data_size / s["wall_s"] / 1e6, 1)
    s["cpu_s_per_gib"] = round(s["cpu_s"] / (data_size / (1 << 30)), 3)
    return s


def paired(samples: list[dict], num: str, den: str, field: str = "mbps") -> tuple[float | None, int]:
    """Median over repeats of num's `field` / den's in the same repeat, and the number of pairs."""
    def by_rep(key):
        return {s["repeat"]: s[field] for s in samples if s.get("tool") == key and s.get("ok") and s.get(field)}
    a, b = by_rep(num), by_rep(den)
    ratios = [a[r] / b[r] for r in sorted(a.keys() & b.keys())]
    return median(ratios), len(ratios)


def online_usable(s: dict) -> bool:
    return bool(s.get("ok")) and (s["tool"] == "baseline" or s.get("reencrypting_at_end") is True)


def compute(state: dict) -> dict:
    out: dict = {"offline": [], "online": []}
    for mode, samples in state["offline"].items():
        row = {"resilience": mode}
        for tool in OFFLINE_TOOLS:
            ok = [s for s in samples if s["tool"] == tool and s.get("ok")]
            row[tool] = {"n": len(ok), "failed": sum(1 for s in samples if s["tool"] == tool and not s.get("ok")),
                         "mbps": median([s["mbps"] for s in ok]), "wall_s": median([s["wall_s"] for s in ok]),
                         "cpu_s": median([s["cpu_s"] for s in ok]), "cpu_s_per_gib": median([s["cpu_s_per_gib"] for s in ok]),
                         "hotzone": median([s.get("hotzone") for s in ok])}
        row["offline_ratio"], row["offline_pairs"] = paired(samples, "cb-offline", "cryptsetup")
        row["offline_verdict"] = verdict(row["offline_ratio"], OFFLINE_TARGET)
        row["cpu_ratio"], _ = paired(samples, "cb-offline", "cryptsetup", "cpu_s")
        row["idle_ratio"], row["idle_pairs"] = paired(samples, "cb-idle", "cb-offline")
        row["idle_verdict"] = verdict(row["idle_ratio"], IDLE_TARGET)
        out["offline"].append(row)
    for prof in PROFILES:
        samples = state["online"].get(prof.key, [])
        usable = [s for s in samples if online_usable(s)]
        row = {"profile": prof.label, "pkey": prof.key, "target": ONLINE_TARGETS.get(prof.group)}
        for tool in ("baseline", "online"):
            ok = [s for s in usable if s["tool"] == tool]
            row[tool] = {"n": len(ok), "mbps": median([s["mbps"] for s in ok]), "iops": median([s["iops"] for s in ok]),
                         "server_cpu_s_per_gib": median([s.get("server_cpu_s_per_gib") for s in ok])}
        on = [s for s in samples if s["tool"] == "online" and s.get("ok")]
        row["reencrypted_bytes"] = median([s.get("reencrypted_bytes") for s in on])
        row["reencrypted_mbps"] = median([s.get("reencrypted_mbps") for s in on])
        row["not_running_at_end"] = sum(1 for s in on if s.get("reencrypting_at_end") is not True)
        row["ratio"], row["pairs"] = paired(usable, "online", "baseline")
        row["verdict"] = verdict(row["ratio"], row["target"])
        row["variants"] = {}
        for name in state.get("config", {}).get("online_variants", {}):
            tool = f"online@{name}"
            von = [s for s in samples if s["tool"] == tool and s.get("ok")]
            ratio, pairs = paired(usable, tool, "baseline")
            vs_online, _ = paired(usable, tool, "online")
            row["variants"][name] = {
                "mbps": median([s["mbps"] for s in von if online_usable(s)]),
                "server_cpu_s_per_gib": median([s.get("server_cpu_s_per_gib") for s in von if online_usable(s)]),
                "reencrypted_bytes": median([s.get("reencrypted_bytes") for s in von]),
                "reencrypted_mbps": median([s.get("reencrypted_mbps") for s in von]),
                "ratio": ratio, "pairs": pairs, "verdict": verdict(ratio, row["target"]), "vs_online": vs_online}
        out["online"].append(row)
    return out


def markdown(state: dict) -> str:
    env, res, cfg = state["environment"], state["computed"], state["config"]
    L = [f"# cryptbridge: LUKS2 reencryption ({env['date'][:10]})", "",
         cpu_header(env) + f" Load average at start {', '.join(f'{x:.2f}' for x in env['loadavg_start'])}, "
         f"at end {', '.join(f'{x:.2f}' for x in env.get('loadavg_end', []))}.",
         f"Command: `{state['command']}`; git {env.get('git')}; {cfg['repeats']} repeats; "
         f"{state['versions'].get('cryptsetup')}; {state['versions'].get('fio')}; images under `{cfg['workdir']}` "
         f"({cfg['workdir_fs']}).", ""]
    if res["offline"]:
        L += [f"**Offline: {human_size(cfg['size'])} data area, AES-256-XTS 4096-byte sectors -> new key, same cipher "
              "(medians over repeats; MB/s = 10^6 B/s of data area over wall time, unlock included; CPU = "
              "user+sys of the child)**", "",
              "| Resilience | Tool | MB/s | wall s | CPU s | CPU s/GiB | hotzone | runs |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
        for row in res["offline"]:
            for tool in OFFLINE_TOOLS:
                c = row[tool]
                hz = "default" if tool == "cryptsetup" else (f"{c['hotzone'] / MiB:.3g} MiB" if c["hotzone"] else "—")
                L.append(f"| {row['resilience']} | {LABELS[tool]} | {fmt(c['mbps'], 0)} | {fmt(c['wall_s'], 2)} | "
                         f"{fmt(c['cpu_s'], 2)} | {fmt(c['cpu_s_per_gib'], 2)} | {hz} | {c['n']}"
                         + (f" ({c['failed']} failed)" if c["failed"] else "") + " |")
        L += ["", "**Offline targets (median of same-repeat ratios)**", "",
              "| Resilience | cryptbridge / cryptsetup MB/s (≥ 2) | pairs | verdict | CPU s ratio | "
              "idle serve / cryptbridge offline MB/s (≥ 0.5) | pairs | verdict |",
              "|---|---:|---:|---|---:|---:|---:|---|"]
        for row in res["offline"]:
            L.append(f"| {row['resilience']} | {fmt(row['offline_ratio'], 2)} | {row['offline_pairs']} | "
                     f"{row['offline_verdict']} | {fmt(row['cpu_ratio'], 2)} | {fmt(row['idle_ratio'], 2)} | "
                     f"{row['idle_pairs']} | {row['idle_verdict']} |")
    if res["online"] and any(r["pairs"] or r["online"]["n"] or r["baseline"]["n"] for r in res["online"]):
        L += ["", f"**Online under load: {human_size(cfg['online_size'])} volume, resilience {cfg['online_resilience']}, "
              f"--reencrypt-rate {cfg.get('online_rate') or 'default (no cap)'}, "
              f"fio {cfg['runtime_s']:g} s + {cfg['ramp_s']:g} s ramp per job, baseline = the same image served "
              "without --reencrypt (medians over repeats)**", "",
              "| Profile | baseline MB/s | online MB/s | baseline CPU s/GiB | online CPU s/GiB | "
              "re-encrypted per job | reencryption MB/s during job | online / baseline | pairs | target | verdict |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in res["online"]:
            rb = r["reencrypted_bytes"]
            L.append(f"| {r['profile']} | {fmt(r['baseline']['mbps'], 0)} | {fmt(r['online']['mbps'], 0)} | "
                     f"{fmt(r['baseline']['server_cpu_s_per_gib'], 3)} | {fmt(r['online']['server_cpu_s_per_gib'], 3)} | "
                     f"{fmt(rb / MiB if rb is not None else None, 0)} MiB | {fmt(r['reencrypted_mbps'], 1)} | "
                     f"{fmt(r['ratio'], 2)} | {r['pairs']} | ≥ {r['target']:g} | {r['verdict']}"
                     + (f" ({r['not_running_at_end']} online job(s) where the reencryption had ended: left out)"
                        if r["not_running_at_end"] else "") + " |")
    names = list(cfg.get("online_variants", {}))
    if names and res["online"]:
        L += ["", "**Online, other builds in the same rotation (same baseline)**: "
              + "; ".join(f"`{n}` = {cfg['online_variants'][n]}" for n in names), "",
              "| Profile | build | online MB/s | CPU s/GiB | re-encrypted per job | reencryption MB/s | "
              "/ baseline | pairs | verdict | / this build's online |", "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
        for r in res["online"]:
            for n in names:
                v = r["variants"].get(n, {})
                rb = v.get("reencrypted_bytes")
                L.append(f"| {r['profile']} | {n} | {fmt(v.get('mbps'), 0)} | {fmt(v.get('server_cpu_s_per_gib'), 3)} | "
                         f"{fmt(rb / MiB if rb is not None else None, 0)} MiB | {fmt(v.get('reencrypted_mbps'), 1)} | "
                         f"{fmt(v.get('ratio'), 2)} | {v.get('pairs')} | {v.get('verdict')} | {fmt(v.get('vs_online'), 2)} |")
    L += ["", "**Targets**", ""]
    for line in state.get("verdicts", []):
        L.append(f"- {line}")
    return "\n".join(L)


def verdict_lines(computed: dict) -> list[str]:
    lines = []
    for row in computed["offline"]:
        if row["offline_verdict"]:
            lines.append(f"{row['offline_verdict']} offline {row['resilience']}: cryptbridge / cryptsetup "
                         f"{fmt(row['offline_ratio'], 2)} (target >= {OFFLINE_TARGET:g}, {row['offline_pairs']} pairs)")
    for r in computed["online"]:
        if r["verdict"]:
            lines.append(f"{r['verdict']} online {r['profile']}: with reencryption / without "
                         f"{fmt(r['ratio'], 2)} (target >= {r['target']:g}, {r['pairs']} pairs)")
    for row in computed["offline"]:
        if row["idle_verdict"]:
            lines.append(f"{row['idle_verdict']} idle online {row['resilience']}: serve --reencrypt / luks reencrypt "
                         f"{fmt(row['idle_ratio'], 2)} (target >= {IDLE_TARGET:g}, {row['idle_pairs']} pairs)")
    return lines


def check_tools(binary: Path, need_fio: bool) -> list[str]:
    missing = []
    if cryptsetup_bin() is None:
        missing.append("cryptsetup")
    if need_fio:
        if not shutil.which("fio"):
            missing.append("fio")
        elif "uri" not in run(["fio", "--enghelp=nbd"], timeout=30).stdout:
            missing.append("fio built with the nbd engine")
    if not binary.exists():
        missing.append(f"{binary} (cargo build --release --locked)")
    return missing


def cpu_id() -> str:
    """"family F model M" from /proc/cpuinfo (the model name alone says "AMD EPYC" on some VMs)."""
    fam = mod = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k.strip() == "cpu family" and fam is None:
                fam = v.strip()
            elif k.strip() == "model" and mod is None:
                mod = v.strip()
    except OSError:
        pass
    return f"family {fam} model {mod}"


def fs_of(path: Path) -> str:
    try:
        r = run(["stat", "-f", "-c", "%T", path], timeout=10)
        return r.stdout.strip() or "?"
    except Exception:  # noqa: BLE001
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=DEFAULT_BINARY)
    ap.add_argument("--size", default=None, help="offline data area (default 1G; quick 48M)")
    ap.add_argument("--online-size", default=None, help="online volume's data area (default 2G; quick 64M)")
    ap.add_argument("--resilience", default=",".join(RESILIENCES), help="offline modes (comma list)")
    ap.add_argument("--online-resilience", default="checksum", choices=RESILIENCES)
    ap.add_argument("--repeats", type=int, default=None, help="repeats, medians reported (default 3; quick 1)")
    ap.add_argument("--runtime", type=float, default=None, help="fio seconds per online job (default 4; quick 0.5)")
    ap.add_argument("--ramp", type=float, default=None, help="fio ramp seconds (default 1; quick 0.2)")
    ap.add_argument("--online-rate", default=None,
                    help="online: serve --reencrypt-rate (default: none, the default rate; quick 32M so that "
                         "the small volume's reencryption outlasts the jobs)")
    ap.add_argument("--online-variant", action="append", default=[], metavar="NAME=BINARY",
                    help="online: also serve --reencrypt from this build (e.g. other back-off constants), "
                         "as job online@NAME in the same rotation, its ratio to the same baseline reported")
    ap.add_argument("--cb-hotzone", default=None, help="--hotzone-size for `luks reencrypt` (default: its own)")
    ap.add_argument("--profiles", default=None,
                    help="online: only these profiles, comma-separated keys (e.g. seq1m_q8t1_write); default: all four")
    ap.add_argument("--parts", default="offline,online", help="offline (with the idle runs), online, or both")
    ap.add_argument("--timeout", type=float, default=900, help="seconds allowed per reencryption")
    ap.add_argument("--quick", action="store_true", help="smoke run: small images, short jobs, 1 repeat (< 60 s)")
    ap.add_argument("--workdir", type=Path, default=OUT / "work")
    ap.add_argument("--out-json", type=Path, default=OUT / "reencrypt.json")
    ap.add_argument("--out-md", type=Path, default=OUT / "reencrypt.md")
    args = ap.parse_args()
    if args.profiles:
        keep = set(args.profiles.split(","))
        unknown = keep - {p.key for p in PROFILES}
        if unknown:
            ap.error(f"--profiles: unknown {sorted(unknown)}; use {', '.join(p.key for p in PROFILES)}")
        PROFILES[:] = [p for p in PROFILES if p.key in keep]
    q = args.quick
    args.repeats = max(1, args.repeats if args.repeats is not None else (1 if q else 3))
    args.runtime = args.runtime if args.runtime is not None else (0.5 if q else 4.0)
    args.ramp = args.ramp if args.ramp is not None else (0.2 if q else 1.0)
    if q and args.online_rate is None:
        args.online_rate = "32M"
    size = parse_size(args.size or ("48M" if q else "1G"))
    online_size = parse_size(args.online_size or ("64M" if q else "2G"))
    modes = [m for m in args.resilience.split(",") if m]
    if set(modes) - set(RESILIENCES):
        ap.error(f"unknown resilience: {', '.join(sorted(set(modes) - set(RESILIENCES)))}")
    parts = set(args.parts.split(","))
    variants = {}
    for v in args.online_variant:
        name, sep, path = v.partition("=")
        if not sep or not name or not Path(path).exists():
            ap.error(f"--online-variant {v}: want NAME=BINARY, an existing file")
        variants[name] = Path(path).resolve()
    online_tools = ["baseline", "online", *(f"online@{n}" for n in variants)]
    missing = check_tools(args.binary, "online" in parts)
    if missing:
        print("error: missing: " + ", ".join(missing), file=sys.stderr)
        return 1
    cs = cryptsetup_bin()
    install_signal_handlers()

    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    logdir = OUT / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    jobdir = OUT / "fio" / "reencrypt"
    jobdir.mkdir(parents=True, exist_ok=True)
    env = environment(args.binary)
    env["cpu"] = f"{env['cpu']} ({cpu_id()})"
    rundir = Path(tempfile.mkdtemp(prefix="cbreenc."))  # short path for unix sockets
    keyfile = work / "reencrypt.pass"
    keyfile.write_bytes(PASSPHRASE)
    runimg = work / "reenc-run.img"

    state = {
        "benchmark": "reencrypt",
        "command": shjoin(["python3", "bench/reencrypt.py", *sys.argv[1:]]),
        "config": {"size": size, "online_size": online_size, "resilience": modes,
                   "online_resilience": args.online_resilience, "repeats": args.repeats, "runtime_s": args.runtime,
                   "ramp_s": args.ramp, "cb_hotzone": args.cb_hotzone, "online_rate": args.online_rate,
                   "online_variants": {k: str(v) for k, v in variants.items()}, "parts": sorted(parts), "quick": q,
                   "workdir": str(work), "workdir_fs": fs_of(work), "format": shjoin(FORMAT)},
        "units": "MB/s = 1e6 bytes/s; CPU s = user+sys of the child (getrusage); "
                 "server CPU s/GiB = utime+stime per 2^30 bytes the client moved; medians over repeats",
        "environment": env,
        "versions": {"cryptsetup": tool_version([cs, "--version"]), "fio": tool_version(["fio", "--version"])},
        "offline": {},
        "online": {},
    }

    def report(final: bool) -> None:
        state["computed"] = compute(state)
        state["verdicts"] = verdict_lines(state["computed"])
        state["environment"]["loadavg_end"] = list(os.getloadavg())
        write_json(args.out_json, state)
        if final:
            md = markdown(state)
            args.out_md.parent.mkdir(parents=True, exist_ok=True)
            args.out_md.write_text(md + "\n")
            log("\n" + md + "\n")
            log(f"wrote {args.out_json}\nwrote {args.out_md}")

    rc = 0
    try:
        if "offline" in parts:
            templates = make_templates(cs, work, size, modes, keyfile, "offline")
            n = len(modes) * len(OFFLINE_TOOLS) * args.repeats
            log(f"reencrypt offline: {n} runs of {human_size(size)}")
            for rep in range(1, args.repeats + 1):
                log(f"\n== offline repeat {rep}/{args.repeats}")
                for mi, mode in enumerate(modes):
                    shift = (rep - 1 + mi) % len(OFFLINE_TOOLS)
                    order = OFFLINE_TOOLS[shift:] + OFFLINE_TOOLS[:shift]
                    if rep % 2 == 0:
                        order.reverse()
                    for tool in order:
                        copy_image(templates[mode], runimg)
                        s = offline_run(tool, args, cs, runimg, keyfile, rundir, logdir, size)
                        s["repeat"] = rep
                        state["offline"].setdefault(mode, []).append(s)
                        line = (f"  {mode:<9} {LABELS[tool]:<28} {fmt(s.get('mbps'), 0):>6} MB/s "
                                f"{fmt(s.get('wall_s'), 2):>7} s  CPU {fmt(s.get('cpu_s'), 2)} s")
                        log(line if s.get("ok") else line + f"  FAILED: {s.get('error')}")
                    report(False)
        if "online" in parts:
            tmpl = make_templates(cs, work, online_size, [args.online_resilience], keyfile, "online")[args.online_resilience]
            log(f"\nreencrypt online: {len(PROFILES) * len(online_tools) * args.repeats} fio jobs on {human_size(online_size)}")
            for rep in range(1, args.repeats + 1):
                log(f"\n== online repeat {rep}/{args.repeats}")
                copy_image(tmpl, runimg)
                fresh = True
                for pi, prof in enumerate(PROFILES):
                    # A pair starts on a copy with room left for its online job: a fresh copy of
                    # the template once the reencryption has gone past REFRESH of the volume.
                    last = next((x for x in reversed(state["online"].get(PROFILES[pi - 1].key, []) if pi else [])
                                 if x["tool"].startswith("online") and x["repeat"] == rep
                                 and x.get("done_at_end") is not None), None)
                    if not fresh and (last is None or last.get("done_at_end") is None
                                      or last["done_at_end"] > REFRESH * online_size):
                        log(f"  (fresh copy of {tmpl.name})")
                        copy_image(tmpl, runimg)
                    fresh = False
                    for tool in job_order(online_tools, rep - 1, pi):
                        extra = []
                        sock = rundir / f"{tool.replace('@', '-')}.sock"
                        binary = variants.get(tool.partition("@")[2], args.binary)
                        if tool.startswith("online"):
                            extra = ["--reencrypt", "--metrics", sock.with_suffix(".metrics")]
                            if args.online_rate:
                                extra += ["--reencrypt-rate", args.online_rate]
                        srv = Server(tool.replace("@", "-"), binary, runimg, keyfile, sock, logdir, extra)
                        out = jobdir / f"{prof.key}-{tool}-r{rep}.json"
                        try:
                            srv.start()
                            pid = srv.proc.pid if srv.proc else None
                            d0, total = srv.reencryption() if tool.startswith("online") else (None, None)
                            s = fio_job(srv.uri, prof, online_size, args.runtime, args.ramp, out, pid)
                            if tool.startswith("online"):
                                d1, total = srv.reencryption()
                                if d0 is not None and d1 is not None:
                                    s["reencrypted_bytes"] = d1 - d0
                                    s["reencrypted_mbps"] = round((d1 - d0) / (args.runtime + args.ramp) / 1e6, 1)
                                    s["done_at_end"] = d1
                                    s["reencrypting_at_end"] = bool(total) and d1 < total
                            if srv.proc is not None and srv.proc.poll() is not None:
                                s["ok"] = False
                                s["error"] = f"server exited {srv.proc.returncode} during the job"
                        finally:
                            srv.stop()
                        if prof.writes:
                            sync_file(runimg)
                        s["tool"], s["repeat"] = tool, rep
                        state["online"].setdefault(prof.key, []).append(s)
                        extra_txt = ""
                        if tool.startswith("online"):
                            rb = s.get("reencrypted_bytes")
                            extra_txt = (f"  re-encrypted {fmt(rb / MiB if rb is not None else None, 0)} MiB, "
                                         f"running at end: {s.get('reencrypting_at_end')}")
                        line = (f"  {prof.label:<18} {tool:<14} {fmt(s.get('mbps'), 0):>7} MB/s  server "
                                f"{fmt(s.get('server_cpu_s_per_gib'), 3)} s/GiB{extra_txt}")
                        log(line if s.get("ok") else line + f"  FAILED: {s.get('error')}")
                report(False)
    except (KeyboardInterrupt, BenchInterrupted) as e:
        warn(f"interrupted ({e}); reporting what was measured")
        rc = 130
    except Exception as e:  # noqa: BLE001 - report what ran
        warn(f"aborted: {e}")
        rc = 1
    finally:
        shutil.rmtree(rundir, ignore_errors=True)
        runimg.unlink(missing_ok=True)
    report(True)
    for line in state["verdicts"]:
        log(line)
    return rc


if __name__ == "__main__":
    sys.exit(main())
