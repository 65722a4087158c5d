"""Shared helpers for the cryptbridge benchmarks (bench/engine.py, bench/bridge.py).

Benchmarks, not tests: nothing here asserts; targets are reported as PASS/MISS.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import json
import os
import platform
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
