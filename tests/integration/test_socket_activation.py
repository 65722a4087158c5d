"""systemd socket activation: `serve` started with LISTEN_PID/LISTEN_FDS serves inherited fd 3.

Real clients start it the way libnbd does (`nbdinfo -- [ ... ]`, `nbdcopy -- [ ... ]`: a Unix
socket, LISTEN_PID set in the child); a TCP socket is passed by a shell that sets LISTEN_PID to
its own pid before exec, as systemd does. Bytes on disk are checked against the Python
reference XTS.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from conftest import need_tool, require_binary, run
from nbd_client import NBDClient
from reference import xts_ref

MiB = 1 << 20
# An address no interface here has: binding it fails, so a server that serves at all ignored it.
UNBINDABLE = "192.0.2.1:10809"


def serve_cmd(backing, key_file, *extra):
    return [str(require_binary()), "serve", "--backing", str(backing), "--key-file", str(key_file), *map(str, extra)]


def test_nbdinfo_json_over_socket_activation(ws):
    need_tool("nbdinfo")
    kf, _ = ws.key(64)
    backing = ws.tmp / "act.img"
    ignored = ws.sockdir / "ignored.sock"
    p = run(["nbdinfo", "--json", "--", "[", *serve_cmd(backing, kf, "--size", "8M", "--unix", ignored), "]"],
            timeout=60, check=True)
    info = json.loads(p.stdout)  # nothing else on stdout: no ready line mixed into nbdinfo's JSON
    exp = info["exports"][0]
    assert exp["export-size"] == 8 * MiB
    assert exp["description"].startswith("cryptbridge aes-xts-plain64")
    err = p.stderr.decode(errors="replace")
    assert "socket activation" in err and "--unix ignored" in err, err[-2000:]
    assert "panicked" not in err
    assert not ignored.exists(), "--unix is ignored under socket activation"


def test_nbdcopy_roundtrip_over_socket_activation(ws):
    need_tool("nbdcopy")
    size = 4 * MiB
    kf, key = ws.key(64)
    backing = ws.tmp / "act.img"
    src = ws.tmp / "src.img"
    plaintext = os.urandom(size)
    src.write_bytes(plaintext)
    server = serve_cmd(backing, kf, "--size", "4M", "--sector-size", "4096", "--listen", UNBINDABLE)
    run(["nbdcopy", "--flush", "--", src, "[", *server, "]"], timeout=120, check=True)
    dst = ws.tmp / "dst.img"
    run(["nbdcopy", "--", "[", *server, "]", dst], timeout=120, check=True)
    assert dst.read_bytes() == plaintext, "data read back differs"
    disk = backing.read_bytes()
    assert len(disk) == size
    for s in range(size // 4096):
        a = s * 4096
        want = xts_ref.xts_any_encrypt(key, xts_ref.sector_tweak(s, 4096, False), plaintext[a:a + 4096])
        assert disk[a:a + 4096] == want, f"sector {s} is not the reference XTS of the data"


def start_with_fd3(listener: socket.socket, args: list, listen_fds: str = "1", pid_offset: int = 0):
    """Starts `serve` with `listener` as descriptor 3 and LISTEN_PID set to its own pid plus
    `pid_offset`, as systemd does: a small Python exec()s it, keeping its pid."""
    fd = listener.fileno()
    shim = ("import os, sys\n"
            "fd, off, n = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]\n"
            "if fd != 3:\n    os.dup2(fd, 3)\n    os.close(fd)\n"
            "os.environ.update(LISTEN_PID=str(os.getpid() + off), LISTEN_FDS=n)\n"
            "os.execv(sys.argv[4], sys.argv[4:])\n")
    argv = [sys.executable, "-c", shim, str(fd), str(pid_offset), listen_fds, *map(str, args)]
    return subprocess.Popen(argv, pass_fds=(fd,), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def stop(proc) -> tuple[str, str]:
    if proc.poll() is None:
        proc.terminate()
    try:
        out, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=15)
    return out.decode(errors="replace"), err.decode(errors="replace")


def finish(proc) -> tuple[str, str]:
    """Waits for a server that should exit by itself (one that does not is stopped, and fails)."""
    try:
        out, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        out, err = (x.encode() for x in stop(proc))
    return out.decode(errors="replace"), err.decode(errors="replace")


def test_tcp_socket_is_detected_and_served(ws):
    kf, _ = ws.key(64)
    backing = ws.backing(2 * MiB)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(8)
        port = lst.getsockname()[1]
        proc = start_with_fd3(lst, serve_cmd(backing, kf, "--listen", UNBINDABLE))
        try:
            with NBDClient(f"nbd://127.0.0.1:{port}") as c:
                c.connect()
                assert c.size == 2 * MiB
                c.write(4096, b"\x5a" * 4096)
                assert c.read(4096, 4096) == b"\x5a" * 4096
        except Exception as e:
            out, err = stop(proc)
            raise AssertionError(f"{e}; server stderr: {err[-2000:]}") from e
        out, err = stop(proc)
    assert proc.returncode == 0, err[-2000:]
    assert "ready" not in out, "no ready line on stdout under socket activation"
    assert f"nbd://127.0.0.1:{port}" in err and "--listen/--unix ignored" in err, err[-2000:]


def test_variables_for_another_process_are_ignored(ws):
    """LISTEN_PID of another process (a parent that did not unset it): serve binds as usual."""
    kf, _ = ws.key(64)
    backing = ws.backing(MiB)
    sock = ws.sockdir / "own.sock"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        proc = start_with_fd3(lst, serve_cmd(backing, kf, "--unix", sock), pid_offset=1)
        try:
            line = proc.stdout.readline().decode()
        finally:
            out, err = stop(proc)
    assert line.strip() == f"ready nbd+unix:///?socket={sock.resolve()}", (line, err[-2000:])


def test_bad_activation_is_a_clear_error(ws):
    kf, _ = ws.key(64)
    backing = ws.backing(MiB)
    # LISTEN_FDS=0: nothing passed.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        proc = start_with_fd3(lst, serve_cmd(backing, kf), listen_fds="0")
        out, err = finish(proc)
    assert proc.returncode == 1 and "LISTEN_FDS" in err and "panicked" not in err, err[-2000:]
    # A socket that is not listening.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        proc = start_with_fd3(s, serve_cmd(backing, kf))
        out, err = finish(proc)
    assert proc.returncode == 1 and "not listening" in err and "panicked" not in err, err[-2000:]
    # A datagram socket.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        proc = start_with_fd3(s, serve_cmd(backing, kf))
        out, err = finish(proc)
    assert proc.returncode == 1 and "not a stream socket" in err, err[-2000:]


def test_children_inherit_neither_the_variables_nor_the_socket(ws, tmp_path):
    """The rtl-sim co-process is a child of serve: a stand-in records its environment and open
    descriptors (then exits, so serve stops with an error; that is not what is tested)."""
    kf, _ = ws.key(64)
    backing = ws.backing(MiB)
    seen_env, seen_fds = tmp_path / "env.txt", tmp_path / "fds.txt"
    fake = tmp_path / "fake_sim.sh"
    fake.write_text(f"#!/bin/sh\nenv > {seen_env}\nls /proc/$$/fd > {seen_fds}\nexit 0\n")
    fake.chmod(0o755)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        os.environ["CRYPTBRIDGE_RTL_SIM"] = str(fake)
        try:
            proc = start_with_fd3(lst, serve_cmd(backing, kf, "--cipher", "aes-xts-plain64", "--engine", "rtl-sim"))
        finally:
            del os.environ["CRYPTBRIDGE_RTL_SIM"]
        out, err = finish(proc)
    assert seen_env.exists(), f"the stand-in did not run: {err[-2000:]}"
    env = seen_env.read_text()
    assert "CRYPTBRIDGE_RTL_SIM=" in env, "the environment was recorded"
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        assert f"{var}=" not in env, f"{var} leaked to a child"
    assert "3" not in seen_fds.read_text().split(), "the listening socket leaked to a child"
    assert "panicked" not in err


CONTRIB = Path(__file__).resolve().parents[2] / "contrib"


def unit_exec_start(service_text: str) -> list[str]:
    """ExecStart= of the sample service, continuation lines joined, split as systemd does for
    this simple case (no quotes in it)."""
    text = service_text.replace("\\\n", " ")
    (line,) = [l for l in text.splitlines() if l.startswith("ExecStart=")]
    return line[len("ExecStart="):].split()


def test_sample_units_verify_and_their_command_serves(ws, tmp_path):
    """contrib/cryptbridge@.socket/.service: systemd-analyze verify finds nothing (with the binary
    path pointed at this build), and the service's command line, with the instance and its files
    filled in, serves a socket passed the way the socket unit passes it."""
    service = (CONTRIB / "cryptbridge@.service").read_text()
    socket_unit = (CONTRIB / "cryptbridge@.socket").read_text()
    assert "Accept=no" in socket_unit and "ListenStream=/run/cryptbridge/%i.sock" in socket_unit
    binary = str(require_binary())
    if shutil.which("systemd-analyze"):
        units = tmp_path / "units"
        units.mkdir()
        (units / "cryptbridge@vol1.service").write_text(service.replace("/usr/local/bin/cryptbridge", binary))
        (units / "cryptbridge@vol1.socket").write_text(socket_unit)
        p = run(["systemd-analyze", "verify", "--man=no", units / "cryptbridge@vol1.socket",
                 units / "cryptbridge@vol1.service"], timeout=60)
        err = p.stderr.decode(errors="replace")
        assert p.returncode == 0 and not err.strip(), err
    # The command line as systemd would run it for instance vol1 (CRYPTBRIDGE_OPTS unset).
    kf, key = ws.key(64)
    backing = ws.backing(2 * MiB)
    argv = [a.replace("%i", "vol1") for a in unit_exec_start(service) if a != "$CRYPTBRIDGE_OPTS"]
    assert argv[0] == "/usr/local/bin/cryptbridge" and argv[1] == "serve"
    subst = {"/var/lib/cryptbridge/vol1.img": str(backing), "/etc/cryptbridge/vol1.key": str(kf)}
    argv = [binary] + [subst.get(a, a) for a in argv[1:]]
    assert str(backing) in argv and str(kf) in argv, argv
    sock_path = ws.sockdir / "vol1.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as lst:
        lst.bind(str(sock_path))
        lst.listen(8)
        proc = start_with_fd3(lst, argv)
        try:
            with NBDClient(f"nbd+unix:///vol1?socket={sock_path}") as c:
                c.connect("vol1")  # the export name is the instance name
                c.write(0, b"\x11" * 4096)
                assert c.read(0, 4096) == b"\x11" * 4096
        except Exception as e:
            out, err = stop(proc)
            raise AssertionError(f"{e}; server stderr: {err[-2000:]}") from e
        out, err = stop(proc)
    assert proc.returncode == 0, err[-2000:]
    raw = backing.read_bytes()[:4096]
    want = b"".join(xts_ref.xts_any_encrypt(key, xts_ref.sector_tweak(s, 512, False), b"\x11" * 512) for s in range(8))
    assert raw == want
