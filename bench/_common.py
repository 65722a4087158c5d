"""Shared helpers for the cryptbridge benchmarks (bench/engine.py, bench/bridge.py).

Benchmarks, not tests: nothing here asserts; targets are reported as PASS/MISS.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"
DEFAULT_BINARY = REPO / "target" / "release" / "cryptbridge"


class BenchInterrupted(Exception):
    """Raised from SIGTERM/SIGHUP so that `finally` blocks stop the servers."""


def install_signal_handlers() -> None:
    def _raise(signum, _frame):
        raise BenchInterrupted(f"received signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise)


def log(msg: str) -> None:
    print(msg, flush=True)


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def run(argv, timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run with a mandatory timeout; output captured as text."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    kw.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run([str(a) for a in argv], timeout=timeout, text=True, **kw)


_libc = None


def _pdeathsig() -> None:
    """preexec_fn: the child gets SIGTERM if this Python process dies (even by SIGKILL)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # best effort only
        pass


def spawn(argv, stdout, stderr, env=None) -> subprocess.Popen:
    """Start a long-running helper in its own session (so we can kill its whole group)."""
    return subprocess.Popen(
        [str(a) for a in argv],
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env=env,
        start_new_session=True,
        preexec_fn=_pdeathsig,
    )


def kill_group(proc: subprocess.Popen | None, term_timeout: float = 15.0) -> int | None:
    """SIGTERM the process group, then SIGKILL after term_timeout. Never raises, never hangs."""
    if proc is None:
        return None
    if proc.poll() is not None:
        return proc.returncode
    for sig, wait_s in ((signal.SIGTERM, term_timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
        try:
            return proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


def free_port() -> int:
    """A loopback TCP port free now (the kernel's pick; taken again by the server moments later)."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(address, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    """Waits until `address` (a Unix socket path, or a (host, port) pair) accepts a connection.
    RuntimeError if `proc` exits first or nothing listens within `timeout` seconds."""
    import socket
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if isinstance(address, tuple):
                socket.create_connection(address, timeout=1).close()
            else:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(address))
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} not listening on {address} after {timeout} s")


def process_cpu_ticks(pid: int | None) -> int | None:
    """utime + stime of every thread of `pid`, in clock ticks."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    want = {"aes", "vaes", "avx2", "avx512f", "vpclmulqdq", "pclmulqdq"}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(want & set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return []


def git_rev() -> str | None:
    try:
        r = run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], timeout=10)
        return r.stdout.strip() or None
    except Exception:
        return None


def tool_version(argv) -> str | None:
    try:
        r = run(argv, timeout=15)
        text = (r.stdout or r.stderr).strip()
        return text.splitlines()[0] if text else None
    except Exception:
        return None


def environment(binary: Path | None = None) -> dict:
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "nproc": os.cpu_count(),
        "loadavg_start": list(os.getloadavg()),
        "git": git_rev(),
    }
    if binary is not None and Path(binary).exists():
        env["cryptbridge"] = tool_version([binary, "--version"])
        m = re.search(r"CPU level (\S+) detected", env["cryptbridge"] or "")
        if m:
            # What the binary detects; CRYPTBRIDGE_CPU (inherited by the servers) selects a lower one.
            env["cpu_level_detected"] = m.group(1)
            env["cpu_level"] = os.environ.get("CRYPTBRIDGE_CPU") or m.group(1)
    return env


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def shjoin(argv) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


def fmt(x, nd=1, none="—") -> str:
    if x is None:
        return none
    return f"{x:.{nd}f}"


def verdict(ratio, target) -> str:
    if ratio is None or target is None:
        return ""
    return "PASS" if ratio >= target else "MISS"


# --------------------------------------------------------------------------------------------
# CPU per byte (issue 30): the server's CPU seconds per GiB moved, and the cipher's own cost.

GIB = 1 << 30
# `serve --cipher` (dm-crypt names) -> `bench cipher --cipher` (Linux crypto API names).
CIPHER_CAPI = {"aes-xts-plain64": "xts(aes)", "capi:xts(aes)-plain64": "xts(aes)"}


def process_cpu_seconds(pid: int | None) -> float | None:
    """utime + stime of every thread of `pid` (from /proc/PID/stat), in seconds."""
    ticks = process_cpu_ticks(pid)
    return None if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


def cpu_s_per_gib(cpu0: float | None, cpu1: float | None, moved_bytes: float) -> float | None:
    """CPU seconds spent between two process_cpu_seconds() readings, per GiB moved."""
    if cpu0 is None or cpu1 is None or not moved_bytes or moved_bytes <= 0:
        return None
    return round((cpu1 - cpu0) / (moved_bytes / GIB), 4)


def cipher_cost(binary, cipher: str = "xts(aes)", key_size: int = 512, sector_size: int = 4096,
                seconds: float = 2.0) -> dict:
    """`cryptbridge bench cipher --json` on one thread, at the CPU level a server started from the
    same environment runs (CRYPTBRIDGE_CPU is inherited): the cipher's own CPU seconds per GiB,
    1 GiB / (GB/s of one thread), for encrypt (what a write costs) and decrypt (a read).
    On failure: {"error": ...}."""
    cipher = CIPHER_CAPI.get(cipher, cipher)
    argv = [binary, "bench", "cipher", "--cipher", cipher, "--key-size", str(key_size),
            "--sector-size", str(sector_size), "--threads", "1", "--seconds", f"{seconds:g}", "--json"]
    try:
        r = run(argv, timeout=60 + 4 * seconds)
        data = json.loads(r.stdout)
    except Exception as e:  # noqa: BLE001 - a benchmark reports, it does not stop here
        return {"error": f"{shjoin(argv)}: {e}"}
    out = {"command": shjoin(argv), **data}
    for op in ("encrypt", "decrypt"):
        gbps = data.get(f"{op}_gbps")
        out[f"{op}_s_per_gib"] = round(GIB / 1e9 / gbps, 4) if gbps else None
    return out


def cipher_cost_for(cost: dict | None, writes: float) -> float | None:
    """The cipher's s/GiB for a job whose share of bytes written is `writes` (0 = reads only,
    1 = writes only, 0.3 for a 70/30 mix): decrypt for reads, encrypt for writes."""
    if not cost or cost.get("encrypt_s_per_gib") is None or cost.get("decrypt_s_per_gib") is None:
        return None
    return writes * cost["encrypt_s_per_gib"] + (1 - writes) * cost["decrypt_s_per_gib"]


def paired_cpu_overhead(enc: list[dict], pt: list[dict], field: str = "server_cpu_s_per_gib") -> dict:
    """Encrypted minus passthrough server CPU s/GiB in the same repeat: `enc` and `pt` are the two
    servers' samples of one profile, paired by their "repeat" key when both have one, else by
    position. Returns the median difference, the medians of each side and the number of pairs."""
    def usable(s):
        return s.get("ok") and s.get(field) is not None
    if all("repeat" in s for s in enc + pt if usable(s)):
        e = {s["repeat"]: s[field] for s in enc if usable(s)}
        p = {s["repeat"]: s[field] for s in pt if usable(s)}
        diffs = [e[r] - p[r] for r in sorted(e.keys() & p.keys())]
    else:
        diffs = [a[field] - b[field] for a, b in zip(enc, pt) if usable(a) and usable(b)]
    return {"enc_cpu_s_per_gib": median([s[field] for s in enc if usable(s)]),
            "pt_cpu_s_per_gib": median([s[field] for s in pt if usable(s)]),
            "overhead_cpu_s_per_gib": median(diffs), "pairs": len(diffs)}


def overhead_row(label: str, enc: list[dict], pt: list[dict], cost: dict | None, writes: float, **extra) -> dict:
    """One row of the "encryption overhead" table (see overhead_md)."""
    row = {"profile": label, **extra, **paired_cpu_overhead(enc, pt)}
    row["cipher_s_per_gib"] = cipher_cost_for(cost, writes)
    o, c = row["overhead_cpu_s_per_gib"], row["cipher_s_per_gib"]
    row["overhead_over_cipher"] = round(o / c, 3) if o is not None and c else None
    return row


def overhead_md(rows: list[dict], cost: dict | None, enc_name: str, pt_name: str, extra_cols=()) -> list[str]:
    """Markdown lines of the "encryption overhead" table: per profile, encrypted minus passthrough
    server CPU s/GiB (median over repeats of the same-repeat difference), next to the cipher's own
    cost from `bench cipher` (one thread, same cipher, key and sector size, same CPU level)."""
    if cost and "error" not in cost:
        src = (f"cipher alone: `{cost['command']}` → encrypt {fmt(cost.get('encrypt_gbps'), 2)} GB/s "
               f"({fmt(cost.get('encrypt_s_per_gib'), 3)} s/GiB), decrypt {fmt(cost.get('decrypt_gbps'), 2)} GB/s "
               f"({fmt(cost.get('decrypt_s_per_gib'), 3)} s/GiB), CPU level {cost.get('cpu_level')}; "
               "reads are charged decrypt, writes encrypt, a mix by its share of bytes")
    else:
        src = f"cipher alone: not measured ({(cost or {}).get('error', 'no bench cipher run')})"
    head = ["Profile", *(c for c, _ in extra_cols), f"{enc_name} CPU s/GiB", f"{pt_name} CPU s/GiB",
            "overhead s/GiB (enc − pt, paired)", "pairs", "cipher alone s/GiB", "overhead / cipher"]
    lines = ["**Encryption overhead (server CPU per GiB)**", "",
             f"Server CPU = utime+stime of the server process from /proc over the job, per GiB moved; "
             f"overhead = {enc_name} minus {pt_name} in the same repeat, median over repeats; {src}.", "",
             "| " + " | ".join(head) + " |", "|---|" + "---|" * len(extra_cols) + "---:|" * (len(head) - 1 - len(extra_cols))]
    for r in rows:
        lines.append("| " + " | ".join([r["profile"], *(str(r.get(k, "")) for _, k in extra_cols),
                                        fmt(r["enc_cpu_s_per_gib"], 3), fmt(r["pt_cpu_s_per_gib"], 3),
                                        fmt(r["overhead_cpu_s_per_gib"], 3), str(r["pairs"]),
                                        fmt(r["cipher_s_per_gib"], 3), fmt(r["overhead_over_cipher"], 2)]) + " |")
    return lines


def cpu_header(env: dict, cost: dict | None = None) -> str:
    """One header line: the CPU model and the CPU level cryptbridge runs at."""
    level = (cost or {}).get("cpu_level") or env.get("cpu_level") or "?"
    detected = env.get("cpu_level_detected")
    extra = f" (detected {detected})" if detected and detected != level else ""
    return f"CPU: {env.get('cpu')} ({env.get('nproc')} vCPUs); cryptbridge CPU level: {level}{extra}."
