"""`cryptbridge serve --vhost-user-blk SOCKET`: the volume as a vhost-user-blk device, driven by a
real vhost-user front end in user space: libblkio's `virtio-blk-vhost-user` driver (the `blkio`
crate) in `crates/bridge/examples/vhost_blk_client.rs`, which shares its memory with the bridge as a
hypervisor does (memfd regions, virtqueues with event idx), with no VM.

What is checked: the on-disk bytes against AES-XTS from Python `cryptography` (tweak = the 512-byte
unit number, little-endian: plain64), reads back, several queues at once, FLUSH, the config space
the driver sees, read-only exports, DISCARD/WRITE_ZEROES only with --allow-discards, a front end
that disconnects (mid-request too) and the next one that connects to the same socket, the
socket's mode, a LUKS2 volume and a remote back end; and qemu-system-x86_64 (TCG) as the front end,
its firmware booting a sector written through the device (skipped where qemu is not installed). Malformed descriptor chains (loops, bad indirect tables, wrong direction, out of
guest memory) cannot be made through libblkio; the Rust unit tests in
crates/bridge/src/frontend/vhost_user/tests.rs feed them to the device's checks.
"""
from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from conftest import Bridge, assert_no_panic, example_binary

SIZE = 16 << 20


@pytest.fixture(scope="module")
def client_bin() -> Path:
    """The blkio client (crates/bridge/examples/vhost_blk_client.rs)."""
    return example_binary("vhost_blk_client", "CRYPTBRIDGE_VHOST_CLIENT")


def serve(ws, backing: Path, *extra, key_file=None, sector_size=512, queues=1) -> tuple[Bridge, str]:
    sock = ws.sockdir / f"vu{len(ws.bridges) + 1}.sock"
    args = ["--backing", backing, "--vhost-user-blk", sock, "--sector-size", sector_size]
    args += ["--key-file", key_file] if key_file else ["--passthrough"]
    if queues > 1:
        args += ["--queues", queues]
    b = Bridge(ws.tmp, [*args, *extra], label=f"vhost{len(ws.bridges) + 1}")
    ws.bridges.append(b)
    b.start()
    assert b.uri == f"vhost-user-blk:{sock.resolve()}", b.ready_line
    return b, str(sock)


def client(bin_: Path, sock: str, *ops, queues=1, timeout=60, read_only=False, exit_code=0) -> list[str]:
    cmd = [str(bin_), sock, "--queues", str(queues), *(["--read-only"] if read_only else []), *map(str, ops)]
    p = subprocess.run(cmd, capture_output=True, timeout=timeout)
    lines = p.stdout.decode().splitlines()
    assert p.returncode == exit_code, f"{cmd}: exit {p.returncode}\n{p.stdout.decode()}\n{p.stderr.decode()}"
    return lines


def ok(lines: list[str]) -> None:
    bad = [l for l in lines if not l.startswith("ok")]
    assert not bad, f"client ops failed: {lines}"


def xts(key: bytes, unit: int, data: bytes) -> bytes:
    e = Cipher(algorithms.AES(key), modes.XTS(unit.to_bytes(16, "little"))).encryptor()
    return e.update(data) + e.finalize()


@pytest.mark.parametrize("sector_size", [512, 4096])
def test_disk_bytes_match_cryptography_xts_and_read_back(ws, client_bin, sector_size):
    kf, key = ws.key(64)
    backing = ws.backing(SIZE)
    b, sock = serve(ws, backing, key_file=kf, sector_size=sector_size)
    offset, data = 1 << 20, os.urandom(256 * 1024)
    (ws.tmp / "data").write_bytes(data)
    lines = client(client_bin, sock, "info", "write", offset, ws.tmp / "data", "flush", "read", offset, len(data), ws.tmp / "back")
    ok(lines)
    # The driver sees the volume's size in 512-byte units and its sector size as the block size.
    assert f"capacity={SIZE}" in lines[0] and "read-only=false" in lines[0], lines[0]
    assert f"request-alignment={sector_size}" in lines[0], lines[0]
    assert (ws.tmp / "back").read_bytes() == data, "data read back through vhost-user differs"
    disk = backing.read_bytes()
    bad = [
        s for s in range(len(data) // sector_size)
        if xts(key, (offset + s * sector_size) // 512, data[s * sector_size:(s + 1) * sector_size])
        != disk[offset + s * sector_size: offset + (s + 1) * sector_size]
    ]
    assert not bad, f"{len(bad)} sectors on disk differ from cryptography's AES-XTS, e.g. {bad[:8]}"
    assert disk[:offset] == bytes(offset), "bytes outside the write changed"
    assert_no_panic(b.stderr())


def test_queues_at_once_and_a_second_front_end_reads_them(ws, client_bin):
    kf, key = ws.key(64)
    backing = ws.backing(SIZE)
    b, sock = serve(ws, backing, key_file=kf, queues=4)
    lines = client(client_bin, sock, "info", "spread", 48, 65536, 5, queues=4)
    ok(lines)
    assert "num-queues=4" in lines[0], lines[0]
    assert lines[1] == "ok spread 48 4", lines
    # Another front end, on fewer queues, sees what the first one wrote.
    ok(client(client_bin, sock, "read", 0, 65536, ws.tmp / "first", queues=2))
    expect = bytes((5 * 31 + j // 512) & 0xFF for j in range(65536))
    assert (ws.tmp / "first").read_bytes() == expect
    assert backing.read_bytes()[:512] == xts(key, 0, expect[:512])
    assert_no_panic(b.stderr())


def test_flushed_writes_survive_kill_and_reconnects_keep_acknowledged_writes(ws, client_bin):
    kf, key = ws.key(64)
    backing = ws.backing(SIZE)
    b, sock = serve(ws, backing, key_file=kf, queues=2)
    data = os.urandom(64 * 1024)
    (ws.tmp / "data").write_bytes(data)
    ok(client(client_bin, sock, "write", 8 << 20, ws.tmp / "data", queues=2))
    # A front end that leaves with writes in flight (elsewhere on the volume): the daemon goes on
    # listening, and what was acknowledged before is intact.
    assert client(client_bin, sock, "abandon", 32, 65536, queues=2) == ["ok abandon"]
    for _ in range(3):
        ok(client(client_bin, sock, "read", 8 << 20, len(data), ws.tmp / "back"))
        assert (ws.tmp / "back").read_bytes() == data, "an acknowledged write was lost across reconnects"
    ok(client(client_bin, sock, "write", 9 << 20, ws.tmp / "data", "flush"))
    assert b.alive
    b.stop(signal.SIGKILL)
    disk = backing.read_bytes()
    for off in (8 << 20, 9 << 20):
        assert disk[off:off + 512] == xts(key, off // 512, data[:512]), f"write at {off} not on disk after FLUSH and kill -9"
    assert_no_panic(b.stderr())


def test_read_only_export_refuses_writes(ws, client_bin):
    backing = ws.backing(SIZE)
    before = os.urandom(4096)
    with open(backing, "r+b") as f:
        f.write(before)
    (ws.tmp / "data").write_bytes(bytes(4096))
    b, sock = serve(ws, backing, "--read-only")
    # VIRTIO_BLK_F_RO is offered: libblkio will not start the device for writing. (The device's
    # own refusal of a WRITE, VIRTIO_BLK_S_IOERR, is in the Rust unit tests: libblkio never sends
    # one to a read-only device.)
    lines = client(client_bin, sock, "info", exit_code=1)
    assert lines == ["error 30 start: Device is read-only"], lines
    lines = client(client_bin, sock, "info", "write", 0, ws.tmp / "data", "read", 0, 4096, ws.tmp / "back", read_only=True)
    assert "read-only=true" in lines[0], lines
    assert lines[1].startswith("error"), f"a write to a read-only export succeeded: {lines}"
    assert lines[2] == "ok read 4096", lines
    assert (ws.tmp / "back").read_bytes() == before
    assert backing.read_bytes()[:4096] == before
    assert_no_panic(b.stderr())


def test_discard_and_write_zeroes_only_with_allow_discards(ws, client_bin):
    kf, key = ws.key(64)
    data = os.urandom(8192)
    (ws.tmp / "data").write_bytes(data)
    b, sock = serve(ws, ws.backing(SIZE), key_file=kf)
    lines = client(client_bin, sock, "write", 0, ws.tmp / "data", "zero", 0, 4096, "discard", 4096, 4096)
    assert lines[0] == "ok write 8192" and all(l.startswith("error 95") for l in lines[1:]), lines

    backing = ws.backing(SIZE)
    b, sock = serve(ws, backing, "--allow-discards", key_file=kf)
    lines = client(client_bin, sock, "write", 0, ws.tmp / "data", "zero", 0, 4096, "discard", 4096, 4096,
                   "read", 0, 4096, ws.tmp / "back")
    ok(lines)
    assert (ws.tmp / "back").read_bytes() == bytes(4096), "WRITE_ZEROES did not read back as zeros"
    # Zeros are written encrypted: the disk holds the ciphertext of zeros, not zeros.
    assert backing.read_bytes()[:512] == xts(key, 0, bytes(512))
    assert_no_panic(b.stderr())


def test_socket_is_owner_only_whatever_the_umask(ws, client_bin):
    old = os.umask(0)
    try:
        b, sock = serve(ws, ws.backing(SIZE))
    finally:
        os.umask(old)
    mode = stat.S_IMODE(os.stat(sock).st_mode)
    assert mode == 0o600, oct(mode)
    ok(client(client_bin, sock, "info"))
    b.stop()
    assert not os.path.exists(sock), "the socket was left behind after SIGTERM"


def test_luks2_volume_over_vhost_user(ws, client_bin):
    """A LUKS2 volume (cryptsetup's header, 4096-byte sectors): the export is its data segment, and
    the bytes there are AES-XTS of the data with LUKS's IVs (512-byte units at every sector size)."""
    from test_luks import FAST_PBKDF2, data_layout, luks_format, volume_key

    img = ws.backing(2 * SIZE, "luks.img")
    pw = ws.tmp / "pass"
    pw.write_bytes(b"vhost-user passphrase")
    luks_format(img, pw, "--type", "luks2", "--cipher", "aes-xts-plain64", "--key-size", "512",
                "--sector-size", "4096", "--pbkdf", "pbkdf2", *FAST_PBKDF2)
    key = volume_key(img, pw)
    data_offset, sector = data_layout(img)
    assert sector == 4096
    sock = ws.sockdir / "luks.sock"
    b = Bridge(ws.tmp, ["--type", "luks", "--backing", img, "--key-file", pw, "--vhost-user-blk", sock], label="vhost-luks")
    ws.bridges.append(b)
    b.start()
    data = os.urandom(64 * 1024)
    (ws.tmp / "data").write_bytes(data)
    lines = client(client_bin, str(sock), "info", "write", 1 << 20, ws.tmp / "data", "flush", "read", 1 << 20, len(data), ws.tmp / "back")
    ok(lines)
    assert f"capacity={2 * SIZE - data_offset}" in lines[0] and "request-alignment=4096" in lines[0], lines[0]
    assert (ws.tmp / "back").read_bytes() == data
    disk = img.read_bytes()
    at = data_offset + (1 << 20)
    for s in range(len(data) // sector):
        unit = ((1 << 20) + s * sector) // 512
        assert disk[at + s * sector: at + (s + 1) * sector] == xts(key, unit, data[s * sector:(s + 1) * sector]), f"sector {s}"
    assert_no_panic(b.stderr())


def test_remote_backing_over_vhost_user(ws, client_bin):
    """An upstream NBD export as the back end (here a passthrough cryptbridge): the replies of the
    upstream connections complete the virtio requests (on the back end's threads)."""
    up_img = ws.backing(SIZE, "up.img")
    up = ws.serve(up_img, passthrough=True)
    kf, key = ws.key(64)
    sock = ws.sockdir / "remote.sock"
    b = Bridge(ws.tmp, ["--backing", up.uri, "--key-file", kf, "--vhost-user-blk", sock, "--queues", 2], label="vhost-remote")
    ws.bridges.append(b)
    b.start()
    data = os.urandom(128 * 1024)
    (ws.tmp / "data").write_bytes(data)
    ok(client(client_bin, str(sock), "write", 0, ws.tmp / "data", "flush", "read", 0, len(data), ws.tmp / "back",
              "spread", 32, 65536, 9, queues=2))
    assert (ws.tmp / "back").read_bytes() == data
    ok(client(client_bin, str(sock), "write", 4 << 20, ws.tmp / "data", "flush"))
    disk = up_img.read_bytes()
    at = 4 << 20
    for s in range(0, len(data), 512):
        assert disk[at + s: at + s + 512] == xts(key, (at + s) // 512, data[s:s + 512]), f"offset {at + s}"
    # Stopped before its upstream (the workspace stops them in start order), so its flush on exit
    # finds the upstream there.
    assert b.stop() == 0, b.stderr()[-3000:]
    assert_no_panic(b.stderr())


# A boot sector that prints a line on the first serial port and halts: 16-bit code run by SeaBIOS,
# which reads it from the disk through its own virtio-blk driver (qemu's vhost-user-blk-pci).
#   xor ax,ax; mov ds,ax; mov dx,0x3f8; mov si,msg
#   next: lodsb; test al,al; jz done; out dx,al; jmp next
#   done: hlt; jmp done
#   msg: BOOT_LINE, 0
BOOT_LINE = b"booted from cryptbridge vhost-user-blk\r\n"
BOOT_CODE = bytes.fromhex("31c08ed8baf803be157cac84c07403eeebf8f4ebfd")


def boot_sector() -> bytes:
    code = BOOT_CODE + BOOT_LINE + b"\0"
    assert len(BOOT_CODE) == 0x15
    return code + bytes(510 - len(code)) + b"\x55\xaa"


def test_qemu_boots_from_the_device(ws, client_bin):
    """qemu-system-x86_64 (TCG; no KVM or guest kernel needed) as the front end: its firmware reads
    a boot sector that a blkio client wrote through the same socket, encrypted on the backing file,
    and runs it. Skipped where qemu-system-x86_64 is not installed (scripts/install-deps.sh installs
    it as optional)."""
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        pytest.skip("qemu-system-x86_64 not installed (Debian: qemu-system-x86)")
    kf, key = ws.key(64)
    backing = ws.backing(SIZE)
    b, sock = serve(ws, backing, key_file=kf)
    (ws.tmp / "boot").write_bytes(boot_sector())
    ok(client(client_bin, sock, "write", 0, ws.tmp / "boot", "flush"))
    assert backing.read_bytes()[:512] == xts(key, 0, boot_sector()), "boot sector not encrypted on disk"
    serial = ws.tmp / "serial.txt"
    cmd = [
        qemu, "-machine", "pc,accel=tcg,memory-backend=mem", "-m", "64M",
        "-object", "memory-backend-memfd,id=mem,size=64M,share=on",
        "-chardev", f"socket,id=disk,path={sock}",
        "-device", "vhost-user-blk-pci,chardev=disk,num-queues=1,bootindex=1",
        "-display", "none", "-nodefaults", "-monitor", "none", "-no-reboot",
        "-serial", f"file:{serial}",
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None:
            if serial.exists() and BOOT_LINE in serial.read_bytes():
                break
            time.sleep(0.1)
        out = serial.read_bytes() if serial.exists() else b""
    finally:
        p.kill()
        _, err = p.communicate(timeout=30)
    assert BOOT_LINE in out, f"qemu did not boot from the device; serial: {out[-500:]!r}\nqemu: {err.decode(errors='replace')[-2000:]}"
    # The bridge takes the next front end after qemu is gone.
    ok(client(client_bin, sock, "read", 0, 512, ws.tmp / "back"))
    assert (ws.tmp / "back").read_bytes() == boot_sector()
    assert_no_panic(b.stderr())


def test_metrics_count_vhost_user_requests_through_the_same_core(ws, client_bin):
    """serve --metrics beside --vhost-user-blk: the requests of the vhost-user front end are
    counted by the core exactly as NBD's are."""
    import re
    import socket as socket_mod

    from test_metrics import http_get, samples

    key_file, _ = ws.key(64)
    data = os.urandom(65536)
    (ws.tmp / "data").write_bytes(data)
    msock = ws.sockdir / "vu-metrics.sock"
    b, sock = serve(ws, ws.backing(SIZE), "--metrics", msock, key_file=key_file)

    def connect():
        s = socket_mod.socket(socket_mod.AF_UNIX)
        s.connect(str(msock))
        return s

    ok(client(client_bin, sock, "write", 0, ws.tmp / "data", "flush", "read", 0, len(data), ws.tmp / "back"))
    got = samples(http_get(connect)[1])
    assert (ws.tmp / "back").read_bytes() == data
    w = got['cryptbridge_request_bytes_total{export="cryptbridge",op="write"}']
    r = got['cryptbridge_request_bytes_total{export="cryptbridge",op="read"}']
    assert w == len(data) and r == len(data), (w, r)
    assert got['cryptbridge_requests_total{export="cryptbridge",op="flush"}'] >= 1
    assert got['cryptbridge_requests_in_flight{export="cryptbridge"}'] == 0
    assert any(re.match(r'cryptbridge_info\{.*cipher="aes-xts-plain64"', k) for k in got)
    assert_no_panic(b.stderr())
