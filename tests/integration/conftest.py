"""Shared fixtures for the cryptbridge integration tests.

The binary under test is ``target/release/cryptbridge`` (override with $CRYPTBRIDGE_BIN).
Every subprocess has a timeout; every server started here is stopped at teardown (SIGTERM, then
SIGKILL), and a server whose stderr contains a Rust panic fails the test that used it.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

BIN = Path(os.environ.get("CRYPTBRIDGE_BIN", REPO / "target" / "release" / "cryptbridge"))
VECTORS = Path(os.environ.get("CRYPTBRIDGE_VECTORS", TESTS / "vectors"))

MiB = 1 << 20
READY_TIMEOUT = 20.0
STOP_TIMEOUT = 15.0


def load_bench_module(stem: str):
    """Imports bench/<stem>.py for tests of a benchmark's pure parts; yields the module, then
    forgets it (a generator, for module-scoped fixtures)."""
    import importlib.util

    bench = REPO / "bench"
    name = f"bench_{stem}"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location(name, bench / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    try:
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(bench))


def run(cmd, timeout: float = 60, input: Optional[bytes] = None, check: bool = False, **kw):
    """subprocess.run with a mandatory timeout and captured output (bytes)."""
    cmd = [str(c) for c in cmd]
    try:
        p = subprocess.run(cmd, input=input, capture_output=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"command timed out after {timeout}s: {' '.join(cmd)}\nstderr: {e.stderr!r}")
    if check and p.returncode != 0:
        pytest.fail(
            f"command failed (rc={p.returncode}): {' '.join(cmd)}\n"
            f"stdout: {p.stdout.decode(errors='replace')[-4000:]}\n"
            f"stderr: {p.stderr.decode(errors='replace')[-4000:]}"
        )
    return p


def require_binary() -> Path:
    if not BIN.exists():
        pytest.fail(f"{BIN} not found: run `cargo build --release` first")
    return BIN


def example_binary(name: str, env_var: str) -> Path:
    """The bridge crate's example `name` ($env_var overrides): the release build's or the one
    `make test` built with the Rust tests (profile ci-test); built here when neither exists
    (a plain `cargo build --release` builds no examples). Skipped without cargo; a build that
    fails is a failure."""
    if os.environ.get(env_var):
        return Path(os.environ[env_var])
    for profile in ("release", "ci-test"):
        path = REPO / "target" / profile / "examples" / name
        if path.exists():
            return path
    if shutil.which("cargo") is None:
        pytest.skip(f"the example {name} is not built and cargo is not installed")
    p = subprocess.run(["cargo", "build", "--release", "--locked", "-p", "cryptbridge-bridge", "--example", name],
                       cwd=REPO, capture_output=True, timeout=1800)
    if p.returncode != 0:
        pytest.fail(f"cannot build the example {name}:\n{p.stderr.decode(errors='replace')[-3000:]}")
    return REPO / "target" / "release" / "examples" / name


def cb(*args, timeout: float = 60, input: Optional[bytes] = None, check: bool = False):
    """Run the cryptbridge binary."""
    return run([require_binary(), *args], timeout=timeout, input=input, check=check)


def assert_no_panic(stderr: str, what: str = "cryptbridge") -> None:
    assert "panicked" not in stderr, f"{what} panicked:\n{stderr[-4000:]}"


def random_key(nbytes: int) -> bytes:
    """Random XTS key whose two halves differ (serve refuses equal halves)."""
    while True:
        k = os.urandom(nbytes)
        if k[: nbytes // 2] != k[nbytes // 2 :]:
            return k


def write_key(path: Path, key: bytes) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return path


def need_tool(*names: str) -> None:
    for n in names:
        if shutil.which(n) is None and not os.path.exists(f"/usr/sbin/{n}") and not os.path.exists(f"/sbin/{n}"):
            pytest.skip(f"{n} not installed (run scripts/install-deps.sh)")


class Bridge:
    """A running ``cryptbridge serve``."""

    def __init__(self, workdir: Path, args: list, label: str = "bridge"):
        self.workdir = workdir
        self.args = [str(a) for a in args]
        self.label = label
        self.stdout_path = workdir / f"{label}.stdout"
        self.stderr_path = workdir / f"{label}.stderr"
        self.proc: Optional[subprocess.Popen] = None
        self.uri: Optional[str] = None
        self.ready_line: Optional[str] = None
        self.returncode: Optional[int] = None

    def start(self) -> "Bridge":
        cmd = [str(require_binary()), "serve", *self.args]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            text = self.stdout_path.read_text(errors="replace")
            if "\n" in text:
                self.ready_line = text.split("\n", 1)[0]
                break
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"cryptbridge serve exited with {self.proc.returncode} before ready\n"
                    f"cmd: {' '.join(cmd)}\nstderr: {self.stderr()[-4000:]}"
                )
            time.sleep(0.01)
        else:
            self.stop()
            raise RuntimeError(f"cryptbridge serve not ready after {READY_TIMEOUT}s\nstderr: {self.stderr()[-4000:]}")
        m = re.fullmatch(r"ready (\S+)", self.ready_line.strip())
        if not m:
            self.stop()
            raise RuntimeError(f"unexpected first stdout line {self.ready_line!r} (docs/cli.md: 'ready URI')")
        self.uri = m.group(1)
        return self

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> Optional[int]:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT)
                self.returncode = "killed after SIGTERM timeout"  # type: ignore[assignment]
                return None
        if self.returncode is None:
            self.returncode = self.proc.returncode
        return self.returncode

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Workspace:
    """Per-test helpers: short socket dir, backing files, keys, bridges."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        # Unix socket paths are limited to 108 bytes: keep sockets in a short private dir
        self.sockdir = Path(tempfile.mkdtemp(prefix="cb", dir="/tmp"))
        self.bridges: list[Bridge] = []
        self._n = 0
        self._backings = 0

    def backing(self, size: int, name: Optional[str] = None) -> Path:
        """A new sparse file; without a name, a new one per call (backing.img, backing2.img, ...):
        a served image is locked, so two servers in one test need two images."""
        if name is None:
            self._backings += 1
            name = "backing.img" if self._backings == 1 else f"backing{self._backings}.img"
        p = self.tmp / name
        with open(p, "wb") as f:
            f.truncate(size)
        return p

    def key(self, nbytes: int = 64, name: str = "key.bin") -> tuple[Path, bytes]:
        k = random_key(nbytes)
        return write_key(self.tmp / name, k), k

    def serve(
        self,
        backing: Path,
        key_file: Optional[Path] = None,
        *,
        passthrough: bool = False,
        key_size: Optional[int] = None,
        sector_size: Optional[int] = None,
        iv_large: bool = False,
        tcp: bool = False,
        extra: tuple = (),
        size: Optional[str] = None,
        cipher: Optional[str] = "aes-xts-plain64",
    ) -> Bridge:
        self._n += 1
        args: list = ["--backing", backing]
        if size is not None:
            args += ["--size", size]
        if passthrough:
            args += ["--passthrough"]
        else:
            assert key_file is not None
            args += ["--key-file", key_file]
            if cipher is not None:
                args += ["--cipher", cipher]
            if key_size is not None:
                args += ["--key-size", key_size]
        if sector_size is not None:
            args += ["--sector-size", sector_size]
        if iv_large:
            args += ["--iv-large-sectors"]
        if tcp:
            args += ["--listen", "127.0.0.1:0"]
        else:
            args += ["--unix", self.sockdir / f"s{self._n}.sock"]
        args += list(extra)
        b = Bridge(self.tmp, args, label=f"bridge{self._n}")
        self.bridges.append(b)
        return b.start()

    def cleanup(self) -> list[str]:
        problems = []
        for b in self.bridges:
            b.stop()
            err = b.stderr()
            if "panicked" in err:
                problems.append(f"{b.label} ({' '.join(b.args)}) panicked:\n{err[-3000:]}")
        shutil.rmtree(self.sockdir, ignore_errors=True)
        return problems


@pytest.fixture
def ws(tmp_path):
    w = Workspace(tmp_path)
    try:
        yield w
    finally:
        problems = w.cleanup()
    if problems:
        pytest.fail("\n\n".join(problems))


def pytest_report_header(config):
    return [f"cryptbridge binary: {BIN} ({'present' if BIN.exists() else 'MISSING'})", f"vectors: {VECTORS}"]


try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "cryptbridge",
        deadline=None,
        database=None,
        max_examples=60,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "cryptbridge"))
except ImportError:  # pragma: no cover
    pass


def pty_read_until(fd: int, seen: bytes, needle: bytes, timeout: float) -> bytes:
    """Appends what the pseudo-terminal `fd` prints to `seen` until `needle` shows, the terminal
    closes or `timeout` seconds pass, and returns it (the caller asserts on it)."""
    import select

    deadline = time.monotonic() + timeout
    while needle not in seen and time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                seen += os.read(fd, 4096)
            except OSError:
                break
    return seen
