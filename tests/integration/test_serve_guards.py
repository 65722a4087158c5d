"""What stops a user from losing a volume by mistake, and the conventions every command follows:

- an image served read-write is locked the way qemu locks its images (qemu's lock bytes, checked
  here against real qemu-io and qemu-nbd): a second writer is refused, read-only servers share;
- plain `serve` of a backing that starts with a LUKS header (made by real cryptsetup) refuses,
  unless `--type plain` is given explicitly;
- a key file written as hex text is refused with the command that converts it;
- usage errors exit 2 in every command, runtime errors 1; CRYPTBRIDGE_CPU is checked by every
  command, --version included; log lines carry colour only on a terminal, and never with NO_COLOR.
"""
import os
import pty
import re
import shutil
import subprocess
import time

import pytest

from conftest import BIN, MiB, cb, need_tool, pty_read_until, run, write_key

ANSI = re.compile(rb"\x1b\[[0-9;]*m")


def refused(p, *needles):
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 1, f"rc={p.returncode}, stderr:\n{err}"
    for n in needles:
        assert n in err, f"{n!r} not in:\n{err}"
    assert "panicked" not in err
    return err


# ---------------------------------------------------------------- image locks


def serve_args(ws, backing, key, *extra):
    ws._n += 1
    return ["serve", "--backing", backing, "--key-file", key, "--unix", ws.sockdir / f"g{ws._n}.sock", *extra]


def test_second_writer_refused_readers_share(ws):
    key, _ = ws.key()
    img = ws.backing(16 * MiB)
    first = ws.serve(img, key)
    p = cb(*serve_args(ws, img, key), timeout=30)
    refused(p, "is in use", 'Failed to get "write" lock', "--read-only")
    p = cb(*serve_args(ws, img, key, "--read-only"), timeout=30)
    refused(p, "is in use", 'Failed to get shared "write" lock', "open for writing")
    first.stop()
    # Read-only servers share the image; a writer is refused while they hold it.
    r1 = ws.serve(img, key, extra=("--read-only",))
    r2 = ws.serve(img, key, extra=("--read-only",))
    assert r1.alive and r2.alive
    p = cb(*serve_args(ws, img, key), timeout=30)
    refused(p, "is in use", 'Failed to get "write" lock', "does not share it with a writer")
    r1.stop()
    r2.stop()
    # Once every server is gone, the image is free again (the locks die with the open file).
    again = ws.serve(img, key)
    assert again.alive


def test_lock_kills_with_the_process(ws):
    """OFD locks belong to the open file: a server killed with SIGKILL leaves no stale lock."""
    import signal

    key, _ = ws.key()
    img = ws.backing(16 * MiB)
    b = ws.serve(img, key)
    b.stop(signal.SIGKILL)
    assert ws.serve(img, key).alive


def test_qemu_sees_the_lock_and_we_see_qemus(ws):
    need_tool("qemu-io", "qemu-nbd")
    key, _ = ws.key()
    img = ws.backing(16 * MiB)
    b = ws.serve(img, key)
    p = run(["qemu-io", "-f", "raw", "-c", "read 0 512", img], timeout=30)
    out = (p.stdout + p.stderr).decode(errors="replace")
    assert p.returncode != 0 and 'Failed to get "write" lock' in out, out
    b.stop()
    sock = ws.sockdir / "qemu.sock"
    q = subprocess.Popen(["qemu-nbd", "-f", "raw", "-k", str(sock), str(img)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sock.exists(), "qemu-nbd did not start"
        p = cb(*serve_args(ws, img, key), timeout=30)
        refused(p, "is in use", 'Failed to get shared "write" lock')
    finally:
        q.terminate()
        q.wait(timeout=20)


# ---------------------------------------------------------------- LUKS backing served as plain


def luks_image(ws, name="luks.img"):
    need_tool("cryptsetup")
    img = ws.backing(32 * MiB, name)
    pw = ws.tmp / "pw.txt"
    pw.write_bytes(b"correct horse")
    run(["cryptsetup", "luksFormat", "-q", "--type", "luks2", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000",
         "--key-file", pw, img], timeout=60, check=True)
    return img


def test_plain_serve_of_a_luks_image_refused(ws):
    img = luks_image(ws)
    before = img.read_bytes()
    key, _ = ws.key()
    p = cb(*serve_args(ws, img, key), timeout=30)
    refused(p, "starts with a LUKS2 header", "--type luks", "--type plain")
    assert img.read_bytes() == before
    # Passthrough would expose and overwrite the header the same way.
    p = cb("serve", "--backing", img, "--passthrough", "--unix", ws.sockdir / "pt.sock", timeout=30)
    refused(p, "starts with a LUKS2 header")
    # An explicit --type plain is the user's word that the whole device is a plain volume.
    b = ws.serve(img, key, extra=("--type", "plain"))
    assert b.alive


def test_luks1_header_refused_too(ws):
    need_tool("cryptsetup")
    img = ws.backing(32 * MiB, "l1.img")
    pw = ws.tmp / "pw.txt"
    pw.write_bytes(b"pw")
    run(["cryptsetup", "luksFormat", "-q", "--type", "luks1", "--iter-time", "10", "--key-file", pw, img], check=True)
    key, _ = ws.key()
    refused(cb(*serve_args(ws, img, key), timeout=30), "starts with a LUKS1 header")


# ---------------------------------------------------------------- key files as hex text


@pytest.mark.parametrize("nbytes,newline", [(64, True), (64, False), (32, True), (16, False)])
def test_hex_key_file_refused_with_the_conversion(ws, nbytes, newline):
    img = ws.backing(16 * MiB)
    text = os.urandom(nbytes).hex().encode() + (b"\n" if newline else b"")
    key = write_key(ws.tmp / "hex.key", text)
    err = refused(cb(*serve_args(ws, img, key), timeout=30), f"{2 * nbytes} hex characters", f"{8 * nbytes}-bit key",
                  "xxd -r -p")
    # The conversion the message prints makes a key file that serve takes.
    raw = ws.tmp / "KEY.bin"
    cmd = re.search(r"`(xxd -r -p [^`]+)`", err).group(1).replace("KEY.bin", str(raw))
    if shutil.which("xxd"):
        subprocess.run(cmd, shell=True, cwd=ws.tmp, check=True)
        assert raw.read_bytes() == bytes.fromhex(text.decode().strip())
    else:
        raw.write_bytes(bytes.fromhex(text.decode().strip()))
    if nbytes in (32, 64):
        assert ws.serve(img, raw).alive


def test_overlong_key_file_message(ws):
    img = ws.backing(16 * MiB)
    key = write_key(ws.tmp / "long.key", os.urandom(65))
    err = refused(cb(*serve_args(ws, img, key), timeout=30), "is 65 bytes, more than 64 bytes", "raw key file")
    assert "endless" not in err  # a regular file is not called a device or a stream
    refused(cb(*serve_args(ws, img, "/dev/zero"), timeout=30), "not a device or an endless stream")


# ---------------------------------------------------------------- conventions


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--backing", "x.img", "--size", "1M", "--key-file", "k", "--cipher", "bogus"],
        ["keygen", "--cipher", "bogus", "k2"],
        ["keygen", "--key-size", "100", "k3"],
        ["cipher", "--cipher", "bogus"],
        ["bench", "cipher", "--cipher", "bogus", "--seconds", "0.1"],
        ["bench", "cipher", "--sector-size", "7", "--seconds", "0.1"],
        ["file", "encrypt", "--cipher", "bogus", "--pass-file", "p", "in"],
        ["serve", "--backing", "x.img", "--size", "1M", "--key-file", "k", "--threads", "0"],
        ["serve", "--backing", "x.img", "--size", "1M", "--key-file", "k", "--tls-verify-peer"],
    ],
)
def test_usage_errors_exit_2(tmp_path, args):
    p = run([BIN, *args], cwd=tmp_path, timeout=30, input=b"")
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 2, f"{args}: rc={p.returncode}\n{err}"
    assert "error" in err and "panicked" not in err
    assert not (tmp_path / "x.img").exists() and not (tmp_path / "k2").exists()


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["keygen", "k"], ["cipher"]])
def test_cpu_env_checked_by_every_command(tmp_path, args):
    env = dict(os.environ, CRYPTBRIDGE_CPU="bogus")
    p = run([BIN, *args], cwd=tmp_path, env=env, timeout=30, input=b"")
    assert p.returncode == 2, p
    assert b"CRYPTBRIDGE_CPU=bogus: unknown CPU level" in p.stderr
    assert not (tmp_path / "k").exists()


def log_line_stderr(tmp_path, env, on_terminal):
    """stderr of a command that logs a WARN line (a key file readable by others)."""
    key = tmp_path / "k.key"
    key.write_bytes(os.urandom(64))
    os.chmod(key, 0o644)
    cmd = [str(BIN), "serve", "--backing", str(tmp_path / "none.img"), "--key-file", str(key), "--unix",
           str(tmp_path / "s.sock")]
    if not on_terminal:
        return run(cmd, env=env, timeout=30).stderr
    leader, follower = pty.openpty()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=follower, env=env)
    os.close(follower)
    seen = pty_read_until(leader, b"", b"does not exist", 30)
    p.wait(timeout=30)
    os.close(leader)
    return seen


def test_no_colour_unless_stderr_is_a_terminal(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    piped = log_line_stderr(tmp_path, env, on_terminal=False)
    assert b"WARN" in piped and not ANSI.search(piped), piped
    tty = log_line_stderr(tmp_path, env, on_terminal=True)
    assert b"WARN" in tty and ANSI.search(tty), tty
    no_colour = log_line_stderr(tmp_path, dict(env, NO_COLOR="1"), on_terminal=True)
    assert b"WARN" in no_colour and not ANSI.search(no_colour), no_colour


def test_plain_serve_of_a_remote_luks_export_refused(ws):
    """The same guard over an upstream NBD export (nbdkit's file plugin over a LUKS image)."""
    need_tool("nbdkit")
    img = luks_image(ws)
    sock = ws.sockdir / "up.sock"
    up = subprocess.Popen(["nbdkit", "-f", "-U", str(sock), "file", str(img)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        key, _ = ws.key()
        uri = f"nbd+unix:///?socket={sock}"
        refused(cb(*serve_args(ws, uri, key), timeout=30), "starts with a LUKS2 header", "--type luks")
    finally:
        up.terminate()
        up.wait(timeout=20)
