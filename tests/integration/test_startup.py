"""`serve` start-up on bad input: key files that are devices or endless pipes, a failed start
that must not leave the files it created, and the mode of a newly created backing file."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from conftest import assert_no_panic, cb, random_key, require_binary, write_key
from nbd_client import INFO_DESCRIPTION, NBDClient
from reference import xts_ref

MiB = 1 << 20


def serve_fails(*args, timeout: float = 20, stdin=None):
    """Runs `serve` that must fail at once: returns (stderr, seconds taken)."""
    cmd = [str(require_binary()), "serve", *map(str, args)]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, stdin=stdin if stdin is not None else subprocess.DEVNULL,
                           capture_output=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve did not fail within {timeout}s: {' '.join(cmd)}")
    took = time.monotonic() - t0
    out, err = p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")
    assert_no_panic(err)
    assert p.returncode == 1, f"exit status {p.returncode} (1 expected): {err}"
    assert not out.startswith("ready"), out
    return err, took


def start_serving(args, cmd=None) -> tuple[subprocess.Popen, str]:
    """Starts `serve ARGS` (or `cmd`) and waits for its ready line: (process, URI)."""
    cmd = cmd or [str(require_binary()), "serve", *map(str, args)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
    line = proc.stdout.readline().decode()
    if not line.startswith("ready "):
        proc.kill()
        _, err = proc.communicate(timeout=20)
        pytest.fail(f"serve did not start: stdout {line!r}, stderr {err.decode(errors='replace')[-3000:]}")
    return proc, line.split()[1]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=20)
        pytest.fail("serve did not stop on SIGTERM")
    assert_no_panic(err.decode(errors="replace"))
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]


# ---- A: key files are read with a bound -------------------------------------------------------

def test_key_file_dev_zero_fails_at_once(tmp_path):
    backing = tmp_path / "b.img"
    backing.write_bytes(bytes(MiB))
    err, took = serve_fails("--backing", backing, "--key-file", "/dev/zero", "--unix", tmp_path / "s")
    assert "/dev/zero" in err and "more than 64 bytes" in err, err
    assert took < 10, f"took {took:.1f}s"
    assert backing.read_bytes() == bytes(MiB)


def test_key_file_endless_pipe_fails_at_once(tmp_path):
    """An endless pipe (as `--key-file <(yes)` gives) is refused after 65 bytes, not read on."""
    backing = tmp_path / "b.img"
    backing.write_bytes(bytes(MiB))
    yes = subprocess.Popen(["yes"], stdout=subprocess.PIPE)
    try:
        err, took = serve_fails("--backing", backing, "--key-file", "/dev/stdin", "--unix", tmp_path / "s",
                                stdin=yes.stdout)  # fmt: skip
    finally:
        yes.stdout.close()
        yes.kill()
        yes.wait(timeout=10)
    assert "more than 64 bytes" in err, err
    assert took < 10, f"took {took:.1f}s"
    # bash's <(yes): the same through /dev/fd
    p = subprocess.run(["bash", "-c", 'exec "$0" serve --backing "$1" --key-file <(yes) --unix "$2"',
                        str(require_binary()), str(backing), str(tmp_path / "s2")],
                       capture_output=True, timeout=20)  # fmt: skip
    assert p.returncode == 1 and b"more than 64 bytes" in p.stderr, p.stderr


@pytest.mark.parametrize("nbytes", [65, 1024, 1 << 20])
def test_key_file_too_long(tmp_path, nbytes):
    kf = write_key(tmp_path / "long.key", os.urandom(nbytes))
    backing = tmp_path / "b.img"
    backing.write_bytes(bytes(MiB))
    err, _ = serve_fails("--backing", backing, "--key-file", kf, "--unix", tmp_path / "s")
    assert "more than 64 bytes" in err and "raw key file" in err, err


def test_key_size_beyond_largest_key(tmp_path):
    kf = write_key(tmp_path / "k", random_key(64))
    backing = tmp_path / "b.img"
    backing.write_bytes(bytes(MiB))
    for bits in (1024, 520, 12):
        err, _ = serve_fails("--backing", backing, "--key-file", kf, "--key-size", bits, "--unix", tmp_path / "s")
        assert f"--key-size {bits}" in err and "512 bits" in err, err


def test_key_from_a_pipe(tmp_path):
    """A key that arrives through a pipe (`--key-file <(cat KEY)`) works, and the export's
    description names its real size (the size of a pipe's metadata is 0)."""
    key = random_key(64)
    kf = write_key(tmp_path / "k", key)
    backing = tmp_path / "b.img"
    backing.write_bytes(bytes(MiB))
    proc, uri = start_serving(None, cmd=["bash", "-c", 'exec "$0" serve --backing "$1" --key-file <(cat "$2") --unix "$3"',
                                         str(require_binary()), str(backing), str(kf), str(tmp_path / "s")])  # fmt: skip
    try:
        data = os.urandom(4096)
        with NBDClient(uri) as c:
            c.handshake()
            info = c.opt_go(requests=(INFO_DESCRIPTION,))
            assert "512-bit" in (info.description or ""), info.description
            c.write(4096, data)
            c.flush()
    finally:
        stop(proc)
    assert backing.read_bytes()[4096:8192] == xts_ref.encrypt_sectors(key, data, 512, first_sector=8)


# ---- B: a failed start leaves no file it created -----------------------------------------------

def _too_large_for(directory: Path) -> str:
    """A --size that `directory`'s file system cannot hold, or skips."""
    probe = directory / "probe"
    for size in ("16T", "1048575T"):
        n = int(size[:-1]) << 40
        try:
            with open(probe, "wb") as f:
                f.truncate(n)
        except OSError:
            return size
        finally:
            probe.unlink(missing_ok=True)
    pytest.skip(f"the file system of {directory} holds even a 1048575T sparse file")


def test_size_too_large_leaves_no_file_and_retry_works(tmp_path):
    kf = write_key(tmp_path / "k", random_key(64))
    backing = tmp_path / "new.img"
    size = _too_large_for(tmp_path)
    err, _ = serve_fails("--backing", backing, "--size", size, "--key-file", kf, "--unix", tmp_path / "s")
    assert "File too large" in err or "too large" in err.lower(), err
    assert not backing.exists(), "the failed start left the backing file it created"
    # the corrected retry creates it
    proc, uri = start_serving(["--backing", backing, "--size", "1M", "--key-file", kf, "--unix", tmp_path / "s"])
    try:
        with NBDClient(uri) as c:
            c.connect()
            assert c.size == MiB
    finally:
        stop(proc)
    assert backing.stat().st_size == MiB


def test_failure_after_creating_the_backing_removes_it(tmp_path):
    """Start-up fails after the backing file was created (the --unix path is a regular file):
    the new backing file is removed; an existing one is left as it was."""
    kf = write_key(tmp_path / "k", random_key(64))
    not_a_socket = tmp_path / "plain-file"
    not_a_socket.write_bytes(b"keep")
    backing = tmp_path / "new.img"
    err, _ = serve_fails("--backing", backing, "--size", "1M", "--key-file", kf, "--unix", not_a_socket)
    assert "not a socket" in err, err
    assert not backing.exists(), "the failed start left the backing file it created"
    assert not_a_socket.read_bytes() == b"keep"

    existing = tmp_path / "existing.img"
    content = os.urandom(MiB)
    existing.write_bytes(content)
    for size_args in ([], ["--size", "1M"]):
        serve_fails("--backing", existing, *size_args, "--key-file", kf, "--unix", not_a_socket)
        assert existing.read_bytes() == content, "a failed start changed an existing backing file"


def test_tcp_port_in_use_removes_the_new_backing(tmp_path):
    import socket

    kf = write_key(tmp_path / "k", random_key(64))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        backing = tmp_path / "new.img"
        err, _ = serve_fails("--backing", backing, "--size", "1M", "--key-file", kf, "--listen", f"127.0.0.1:{port}")
    assert "cannot listen" in err, err
    assert not backing.exists(), "the failed start left the backing file it created"


# ---- D: new backing files are 0600, existing ones keep their mode -------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_new_backing_file_is_0600(tmp_path, umask):
    kf = write_key(tmp_path / "k", random_key(64))
    backing = tmp_path / "new.img"
    old = os.umask(umask)
    try:
        proc, uri = start_serving(["--backing", backing, "--size", "1M", "--key-file", kf, "--unix", tmp_path / "s"])
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(backing.stat().st_mode) == 0o600, oct(backing.stat().st_mode)
        with NBDClient(uri) as c:
            c.connect()
            c.write(0, os.urandom(4096))
            c.flush()
    finally:
        stop(proc)
    assert stat.S_IMODE(backing.stat().st_mode) == 0o600, oct(backing.stat().st_mode)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o666])
def test_existing_backing_file_keeps_its_mode(tmp_path, mode):
    kf = write_key(tmp_path / "k", random_key(64))
    backing = tmp_path / "existing.img"
    backing.write_bytes(bytes(MiB))
    os.chmod(backing, mode)
    proc, uri = start_serving(["--backing", backing, "--key-file", kf, "--unix", tmp_path / "s"])
    try:
        with NBDClient(uri) as c:
            c.connect()
            c.write(0, os.urandom(4096))
            c.flush()
    finally:
        stop(proc)
    assert stat.S_IMODE(backing.stat().st_mode) == mode, oct(backing.stat().st_mode)
