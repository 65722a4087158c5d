"""Small hardening items (issue 27, "Permissions and small things"): the Unix socket's mode
whatever the umask, the cap on option haggling, FLUSH with an offset or length, and thread-start
failures logged once per burst. The LUKS2 geometry checks are in test_luks.py, the upstream time
limits in test_remote_backing.py.
"""
from __future__ import annotations

import grp
import os
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest

from conftest import MiB, Bridge, assert_no_panic, require_binary, run
from nbd_client import CMD_FLUSH, OPT_LIST, REP_ACK, NBDClient

NBD_EINVAL = 22
# crates/bridge/src/nbd/handshake.rs, MAX_OPTIONS.
MAX_OPTIONS = 64


def serve_under_umask(ws, mask: int, *extra) -> Bridge:
    """A server started with `mask` as its umask (inherited from this process for the start)."""
    key_file, _ = ws.key()
    old = os.umask(mask)
    try:
        return ws.serve(ws.backing(4 * MiB), key_file, extra=extra)
    finally:
        os.umask(old)


def socket_path(b: Bridge) -> Path:
    return Path(b.args[b.args.index("--unix") + 1])


def test_unix_socket_is_owner_only_whatever_the_umask(ws):
    b = serve_under_umask(ws, 0o000)
    st = os.stat(socket_path(b))
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    with NBDClient(b.uri) as c:  # its owner still connects
        c.connect()
        c.flush()


def other_group() -> grp.struct_group:
    mine = os.getgid()
    for g in grp.getgrall():
        if g.gr_gid != mine:
            return g
    pytest.skip("no group other than this process's own to give the socket to")


def test_group_option_makes_the_socket_0660_for_that_group(ws):
    if os.geteuid() != 0 and len(os.getgroups()) < 2:
        pytest.skip("not root and in no second group: cannot give a socket to another group")
    g = other_group() if os.geteuid() == 0 else grp.getgrgid([x for x in os.getgroups() if x != os.getgid()][0])
    b = serve_under_umask(ws, 0o000, "--group", g.gr_name)
    st = os.stat(socket_path(b))
    assert stat.S_IMODE(st.st_mode) == 0o660, oct(st.st_mode)
    assert st.st_gid == g.gr_gid, (st.st_gid, g)
    # By number too.
    b = serve_under_umask(ws, 0o022, "--group", str(g.gr_gid))
    st = os.stat(socket_path(b))
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, g.gr_gid)


def test_group_option_errors(ws):
    key_file, _ = ws.key()
    backing = ws.backing(MiB)
    sock = ws.sockdir / "g.sock"
    p = run([require_binary(), "serve", "--backing", backing, "--key-file", key_file, "--unix", sock, "--group", "no-such-group-cb"], timeout=30)
    assert p.returncode == 1 and b"no such group" in p.stderr, p.stderr
    assert not sock.exists(), "a socket left behind by a failed start"
    p = run([require_binary(), "serve", "--backing", backing, "--key-file", key_file, "--group", "root"], timeout=30)
    assert p.returncode == 2 and b"--unix" in p.stderr, p.stderr


def test_option_haggling_is_capped(ws):
    """A client looping NBD_OPT_LIST is answered MAX_OPTIONS times, then closed, with one log line,
    long before the handshake limit."""
    key_file, _ = ws.key()
    b = ws.serve(ws.backing(MiB), key_file)
    c = NBDClient(b.uri)
    try:
        c.handshake()
        answered = 0
        t0 = time.monotonic()
        for _ in range(10 * MAX_OPTIONS):
            try:
                c.send_option(OPT_LIST)
                while c.recv_opt_reply().type != REP_ACK:
                    pass
            except OSError:  # ConnectionError included: the server closed the connection
                break
            answered += 1
        took = time.monotonic() - t0
    finally:
        c.close()
    assert answered == MAX_OPTIONS, answered
    assert took < 10, took
    time.sleep(0.2)
    err = b.stderr()
    assert err.count(f"client sent {MAX_OPTIONS} options without choosing the export; closing") == 1, err[-2000:]
    # Other clients are served as before.
    with NBDClient(b.uri) as ok:
        ok.connect()
        ok.flush()


@pytest.mark.parametrize("offset,length", [(512, 0), (0, 4096), (4096, 4096)])
def test_flush_with_an_offset_or_length_is_einval(ws, offset, length):
    key_file, _ = ws.key()
    b = ws.serve(ws.backing(MiB), key_file)
    with NBDClient(b.uri) as c:
        c.connect()
        r = c.request(CMD_FLUSH, offset, length)
        assert r.error == NBD_EINVAL, r
        c.write(0, b"f" * 512)  # the connection goes on; a proper FLUSH works
        c.flush()
        assert c.read(0, 512) == b"f" * 512


# --- thread-start failures ------------------------------------------------------------------------

PIDS_ROOT = Path("/sys/fs/cgroup/pids")


def pids_cgroup(tmp_name: str, limit: int) -> Path:
    """A cgroup v1 pids group with `limit`, or skip (no writable pids controller here)."""
    cg = PIDS_ROOT / tmp_name
    try:
        cg.mkdir()
        (cg / "pids.max").write_text(str(limit))
    except OSError as e:
        if cg.exists():
            cg.rmdir()
        pytest.skip(f"cannot make a pids cgroup under {PIDS_ROOT}: {e}")
    return cg


def test_thread_start_failures_are_logged_once_per_burst(ws):
    """Under pids.max, every connection past the limit finds no thread: one WARN for the burst,
    and a summary with the count once threads start again (not a line per connection)."""
    cg = pids_cgroup(f"cb-test-{os.getpid()}", 24)
    key_file, _ = ws.key()
    sock = ws.sockdir / "p.sock"
    log = ws.tmp / "server.stderr"
    cmd = [str(require_binary()), "serve", "--backing", str(ws.backing(MiB)), "--key-file", str(key_file), "--unix", str(sock),
           "--threads", "1"]  # fmt: skip
    # The server joins the cgroup before it starts: every thread it makes counts.
    shell = f'echo $$ > {cg}/cgroup.procs && exec "$@"'
    with open(log, "wb") as err:
        proc = subprocess.Popen(["sh", "-c", shell, "sh", *cmd], stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
    held: list[socket.socket] = []
    try:
        line = proc.stdout.readline().decode()
        assert line.startswith("ready "), (line, log.read_text(errors="replace"))
        # Connections that never handshake each hold a thread until the handshake limit; the
        # ones past the pids limit find none.
        for _ in range(200):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            s.connect(str(sock))
            held.append(s)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "cannot start a thread" not in log.read_text(errors="replace"):
            time.sleep(0.05)
        time.sleep(1)
        for s in held:
            s.close()
        held.clear()
        # Once the held threads have gone, a new connection starts one again and the count of
        # unlogged failures is reported.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "connection threads start again" not in log.read_text(errors="replace"):
            with NBDClient(f"nbd+unix:///?socket={sock}") as c:
                try:
                    c.connect()
                except Exception:
                    pass
            time.sleep(0.2)
        err = log.read_text(errors="replace")
        warns = err.count("cannot start a thread for the connection")
        assert 1 <= warns <= 3, f"{warns} warnings:\n{err[-3000:]}"
        assert "connection threads start again" in err, err[-3000:]
        assert proc.poll() is None, "the server died"
        assert_no_panic(err)
    finally:
        for s in held:
            s.close()
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
