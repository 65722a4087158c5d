"""keygen, key-file validation in serve, --size parsing, startup/shutdown contract."""
import os
import re
import signal
import stat
import subprocess
import time

import pytest

from conftest import Bridge, assert_no_panic, cb, random_key, require_binary, write_key
from nbd_client import NBDClient
from reference import xts_ref


@pytest.mark.parametrize("bits", [512, 256])
def test_keygen_mode_size_no_overwrite(tmp_path, bits):
    kf = tmp_path / "vol.key"
    p = cb("keygen", "--cipher", "aes-xts-plain64", "--key-size", bits, kf, timeout=30)
    assert p.returncode == 0, p.stderr
    st = kf.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    assert st.st_size == bits // 8
    key = kf.read_bytes()
    assert key[: len(key) // 2] != key[len(key) // 2 :]
    assert len(set(key)) > 8, "key does not look random"

    # refuses to overwrite
    p = cb("keygen", "--cipher", "aes-xts-plain64", "--key-size", bits, kf, timeout=30)
    assert p.returncode != 0
    assert_no_panic(p.stderr.decode(errors="replace"))
    assert kf.read_bytes() == key, "keygen modified an existing key file without --force"

    # --force overwrites with a fresh key
    p = cb("keygen", "--cipher", "aes-xts-plain64", "--key-size", bits, "--force", kf, timeout=30)
    assert p.returncode == 0, p.stderr
    key2 = kf.read_bytes()
    assert len(key2) == bits // 8 and key2 != key
    assert stat.S_IMODE(kf.stat().st_mode) == 0o600


def test_keygen_two_keys_differ(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for f in (a, b):
        assert cb("keygen", "--cipher", "aes-xts-plain64", "--key-size", 512, f, timeout=30).returncode == 0
    assert a.read_bytes() != b.read_bytes()


def test_keygen_key_usable_by_serve(ws):
    kf = ws.tmp / "vol.key"
    assert cb("keygen", "--cipher", "aes-xts-plain64", "--key-size", 512, kf, timeout=30).returncode == 0
    key = kf.read_bytes()
    backing = ws.backing(1 << 20)
    b = ws.serve(backing, kf, key_size=512)
    data = os.urandom(4096)
    with NBDClient(b.uri) as c:
        c.connect()
        c.write(8192, data)
        c.flush()
    with open(backing, "rb") as f:
        f.seek(8192)
        disk = f.read(4096)
    assert disk == xts_ref.encrypt_sectors(key, data, 512, first_sector=16)


def _serve_expect_failure(tmp_path, args, timeout=20):
    """Run serve that must fail fast (no 'ready' line)."""
    p = cb("serve", *args, timeout=timeout)
    out = p.stdout.decode(errors="replace")
    err = p.stderr.decode(errors="replace")
    assert_no_panic(err)
    assert p.returncode != 0, f"serve accepted {args}: stdout {out!r}"
    assert not out.startswith("ready"), out
    return err


@pytest.mark.parametrize("nbytes", [64, 32])
def test_serve_refuses_equal_key_halves(tmp_path, nbytes):
    half = os.urandom(nbytes // 2)
    kf = write_key(tmp_path / "eq.key", half + half)
    backing = tmp_path / "b.img"
    backing.write_bytes(bytes(1 << 20))
    sock = tmp_path / "s.sock"
    err = _serve_expect_failure(
        tmp_path,
        ["--backing", backing, "--key-file", kf, "--key-size", nbytes * 8, "--unix", sock],
    )
    assert "equal" in err.lower(), f"error message should mention equal halves: {err!r}"
    assert backing.read_bytes() == bytes(1 << 20), "backing modified"


@pytest.mark.parametrize(
    "key_len,key_size",
    [(63, 512), (65, 512), (32, 512), (64, 256), (0, 512), (48, 512)],
)
def test_serve_wrong_key_length(tmp_path, key_len, key_size):
    kf = write_key(tmp_path / "bad.key", random_key(max(key_len, 2))[:key_len])
    backing = tmp_path / "b.img"
    backing.write_bytes(bytes(65536))
    err = _serve_expect_failure(
        tmp_path,
        ["--backing", backing, "--key-file", kf, "--key-size", key_size, "--unix", tmp_path / "s.sock"],
    )
    low = err.lower()
    assert "key" in low, f"unclear error: {err!r}"
    assert re.search(r"\b(%d|%d|%d)\b" % (key_len, key_size, key_size // 8), err) or any(
        w in low for w in ("size", "length", "bytes")
    ), f"error does not say what is wrong with the key: {err!r}"


def test_serve_missing_key_file(tmp_path):
    backing = tmp_path / "b.img"
    backing.write_bytes(bytes(65536))
    err = _serve_expect_failure(
        tmp_path, ["--backing", backing, "--key-file", tmp_path / "nope.key", "--unix", tmp_path / "s.sock"]
    )
    assert err.strip()


def test_serve_needs_key_or_passthrough(tmp_path):
    backing = tmp_path / "b.img"
    backing.write_bytes(bytes(65536))
    p = cb("serve", "--backing", backing, "--unix", tmp_path / "s.sock", timeout=20)
    assert p.returncode == 2, f"usage error expected (clap exit 2), got {p.returncode}"
    kf = write_key(tmp_path / "k", random_key(64))
    p = cb("serve", "--backing", backing, "--unix", tmp_path / "s.sock", "--key-file", kf, "--passthrough", timeout=20)
    assert p.returncode == 2, f"--key-file with --passthrough: usage error expected, got {p.returncode}"


@pytest.mark.parametrize(
    "arg,size",
    [("1M", 1 << 20), ("64K", 64 << 10), ("2M", 2 << 20), ("8192", 8192), ("1G", 1 << 30)],
)
def test_serve_size_creates_sparse_file(ws, arg, size):
    kf, key = ws.key(64)
    backing = ws.tmp / f"new-{arg}.img"
    assert not backing.exists()
    b = ws.serve(backing, kf, size=arg)
    st = backing.stat()
    assert st.st_size == size
    assert st.st_blocks * 512 <= 65536, f"backing not sparse: {st.st_blocks * 512} bytes allocated"
    with NBDClient(b.uri) as c:
        c.connect()
        assert c.size == size
        data = os.urandom(4096)
        c.write(size - 4096, data)
        assert c.read(size - 4096, 4096) == data
        c.flush()
    with open(backing, "rb") as f:
        f.seek(size - 4096)
        assert f.read() == xts_ref.encrypt_sectors(key, data, 512, first_sector=(size - 4096) // 512)


@pytest.mark.parametrize("bad", ["1X", "abc", "-1M", ""])
def test_serve_bad_size(tmp_path, bad):
    kf = write_key(tmp_path / "k", random_key(64))
    p = cb("serve", "--backing", tmp_path / "x.img", "--size", bad, "--key-file", kf, "--unix", tmp_path / "s", timeout=20)
    assert p.returncode != 0
    assert not p.stdout.decode(errors="replace").startswith("ready")
    assert_no_panic(p.stderr.decode(errors="replace"))


def test_ready_line_unix(ws):
    kf, _ = ws.key(64)
    b = ws.serve(ws.backing(1 << 20), kf)
    sock = b.args[b.args.index("--unix") + 1]
    assert b.ready_line == f"ready nbd+unix:///?socket={sock}"
    # exactly one line on stdout
    time.sleep(0.2)
    assert b.stdout_path.read_text().splitlines() == [b.ready_line]


def test_ready_line_tcp_port_0(ws):
    kf, _ = ws.key(64)
    b = ws.serve(ws.backing(1 << 20), kf, tcp=True)
    m = re.fullmatch(r"ready nbd://127\.0\.0\.1:(\d+)", b.ready_line)
    assert m, b.ready_line
    assert int(m.group(1)) != 0
    with NBDClient(b.uri) as c:
        c.connect()
        assert c.size == 1 << 20


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_clean_exit_and_sync(ws, sig):
    kf, key = ws.key(64)
    backing = ws.backing(1 << 20)
    b = ws.serve(backing, kf)
    data = os.urandom(65536)
    c = NBDClient(b.uri).connect()
    c.write(0, data)  # no flush: shutdown must sync
    rc = b.stop(sig)
    c.close()
    assert rc == 0, f"exit status after {sig.name}: {rc}\n{b.stderr()[-2000:]}"
    assert backing.read_bytes()[:65536] == xts_ref.encrypt_sectors(key, data, 512)


def test_signal_with_idle_connection_open(ws):
    """A client that stays connected must not keep the server from exiting on SIGTERM."""
    kf, _ = ws.key(64)
    b = ws.serve(ws.backing(1 << 20), kf)
    c = NBDClient(b.uri).connect()
    c2 = NBDClient(b.uri)  # connected but still in handshake
    t0 = time.monotonic()
    rc = b.stop(signal.SIGTERM)
    c.close()
    c2.close()
    assert rc == 0, f"exit status {rc} (None = had to be killed)"
    assert time.monotonic() - t0 < 10


def test_help_for_every_subcommand():
    for sub in ([], ["cipher"], ["keygen"], ["serve"], ["bench", "cipher"]):
        p = cb(*sub, "--help", timeout=20)
        assert p.returncode == 0, (sub, p.stderr)
        assert p.stdout.strip()


def test_unknown_option_is_usage_error():
    p = cb("serve", "--no-such-option", timeout=20)
    assert p.returncode == 2


def test_bench_cipher_json():
    import json

    p = cb("bench", "cipher", "--cipher", "xts(aes)", "--key-size", 512, "--sector-size", 4096,
           "--threads", 1, "--seconds", 1, "--json", timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    j = json.loads(p.stdout)
    for k in ("encrypt_gbps", "decrypt_gbps", "ecb_gbps"):
        assert isinstance(j[k], (int, float)) and j[k] > 0, (k, j)
    assert j["key_size"] == 512 and j["sector_size"] == 4096 and j["threads"] == 1
    for k in ("cipher", "seconds", "bytes"):
        assert k in j, (k, j)
    assert j["bytes"] > 0


def test_unix_socket_of_live_server_not_stolen(ws):
    """Starting a second server on the Unix socket path of a running one must not silently take
    the path over (unlinking it cuts every future client off from the first server, and two
    bridges on one backing file corrupt each other's read-modify-write). Beyond docs/cli.md, but
    a stale-socket cleanup should only remove sockets nobody listens on."""
    kf, _ = ws.key(64)
    backing = ws.backing(1 << 20)
    first = ws.serve(backing, kf)
    sock = first.args[first.args.index("--unix") + 1]
    other = ws.backing(2 << 20, name="other.img")  # different size tells the servers apart
    second = subprocess.Popen(
        [str(require_binary()), "serve", "--backing", str(other), "--key-file", str(kf), "--unix", sock],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        try:
            out, err = second.communicate(timeout=3)
            exited = True
        except subprocess.TimeoutExpired:
            exited = False
        # whatever the second one did, the first server must still be the one at its path
        with NBDClient(first.uri) as c:
            c.connect()
            assert c.size == 1 << 20, "a client of the first server's socket reached the second server"
        if exited:
            assert second.returncode != 0
            assert_no_panic(err.decode(errors="replace"))
        else:
            second.terminate()
            second.wait(10)
        with NBDClient(first.uri) as c:  # and still after the second one is gone
            c.connect()
            assert c.size == 1 << 20
    except (ConnectionError, FileNotFoundError, OSError) as e:
        pytest.fail(f"second `serve --unix {sock}` took the socket of a live server: {e!r}")
    finally:
        if second.poll() is None:
            second.terminate()
            try:
                second.wait(10)
            except subprocess.TimeoutExpired:
                second.kill()
                second.wait(10)
