"""Real NBD clients (libnbd's nbdcopy/nbdinfo, qemu-img/qemu-io, fio) against the bridge; on-disk
bytes checked against the Python XTS reference."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess

import pytest

from conftest import need_tool, run
from nbd_client import NBDClient
from reference import xts_ref

MiB = 1 << 20


def check_disk(backing, key, plaintext, sector_size, iv_large, nsample=None, rng=None):
    """Compare backing sectors with the reference encryption of ``plaintext`` (which starts at
    offset 0). nsample=None: all sectors."""
    disk = backing.read_bytes()
    nsec = len(plaintext) // sector_size
    sectors = range(nsec) if nsample is None else sorted((rng or random).sample(range(nsec), nsample))
    bad = []
    for s in sectors:
        a = s * sector_size
        want = xts_ref.xts_any_encrypt(key, xts_ref.sector_tweak(s, sector_size, iv_large), plaintext[a : a + sector_size])
        if disk[a : a + sector_size] != want:
            bad.append(s)
    assert not bad, f"{len(bad)} sectors differ from reference XTS (sector_size={sector_size}, iv_large={iv_large}), e.g. {bad[:8]}"


@pytest.mark.parametrize("iv_large", [False, True], ids=["iv512", "ivlarge"])
@pytest.mark.parametrize("key_bits", [256, 512])
@pytest.mark.parametrize("sector_size", [512, 4096])
def test_nbdcopy_roundtrip(ws, sector_size, key_bits, iv_large):
    need_tool("nbdcopy", "nbdinfo")
    size = 8 * MiB
    kf, key = ws.key(key_bits // 8)
    backing = ws.backing(size)
    b = ws.serve(backing, kf, key_size=key_bits, sector_size=sector_size, iv_large=iv_large)

    # nbdinfo: size and block sizes (any byte range is served, whole sectors preferred)
    p = run(["nbdinfo", "--json", "--no-content", b.uri], timeout=30, check=True)
    info = json.loads(p.stdout)
    exp = info["exports"][0]
    assert exp["export-size"] == size
    assert exp.get("block_size_minimum") == 1, exp
    assert exp.get("block_size_preferred") == sector_size, exp
    assert exp.get("block_size_maximum") == 32 * MiB, exp
    assert exp.get("can_flush") and exp.get("can_fua") and exp.get("can_zero") and exp.get("can_multi_conn")
    assert not exp.get("is_read_only")

    src = ws.tmp / "src.img"
    plaintext = os.urandom(size)
    src.write_bytes(plaintext)
    run(["nbdcopy", "--flush", src, b.uri], timeout=120, check=True)
    dst = ws.tmp / "dst.img"
    run(["nbdcopy", b.uri, dst], timeout=120, check=True)
    assert dst.read_bytes() == plaintext, "data read back differs"
    check_disk(backing, key, plaintext, sector_size, iv_large)


@pytest.mark.parametrize("sector_size,iv_large", [(512, False), (4096, False), (4096, True)])
def test_qemu_io_and_qemu_img(ws, sector_size, iv_large):
    need_tool("qemu-io", "qemu-img")
    size = 4 * MiB
    kf, key = ws.key(64)
    backing = ws.backing(size)
    b = ws.serve(backing, kf, key_size=512, sector_size=sector_size, iv_large=iv_large)

    src = ws.tmp / "src.raw"
    plaintext = bytearray(os.urandom(size))
    src.write_bytes(plaintext)
    run(["qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, b.uri], timeout=120, check=True)

    # qemu-io pattern writes, including ones not aligned to the 4096-byte sector size (the
    # advertised minimum block size is 1, so they reach the server's read-modify-write)
    writes = [(0x5A, 12288, 8192), (0xC3, 512, 1024), (0x11, size - 4096, 4096), (0x77, 65536 + 1536, 3072)]
    cmds = []
    for pat, off, ln in writes:
        cmds += ["-c", f"write -P {pat:#x} {off} {ln}"]
        plaintext[off : off + ln] = bytes([pat]) * ln
    for pat, off, ln in writes:
        cmds += ["-c", f"read -P {pat:#x} {off} {ln}"]
    cmds += ["-c", "flush"]
    p = run(["qemu-io", "-f", "raw", *cmds, b.uri], timeout=60, check=True)
    out = p.stdout.decode() + p.stderr.decode()
    assert "fail" not in out.lower(), out

    dst = ws.tmp / "dst.raw"
    run(["qemu-img", "convert", "-f", "raw", "-O", "raw", b.uri, dst], timeout=120, check=True)
    assert dst.read_bytes() == bytes(plaintext)
    p = run(["qemu-img", "compare", "-f", "raw", "-F", "raw", dst, b.uri], timeout=60)
    assert p.returncode == 0, p.stdout
    check_disk(backing, key, bytes(plaintext), sector_size, iv_large, nsample=64, rng=random.Random(5))


def _fio_has_nbd():
    if shutil.which("fio") is None:
        return False
    p = subprocess.run(["fio", "--enghelp"], capture_output=True, timeout=20)
    return b"nbd" in p.stdout


@pytest.mark.parametrize("sector_size,bs", [(4096, "4k"), (512, "512-64k")])
def test_fio_randwrite_verify(ws, sector_size, bs):
    if not _fio_has_nbd():
        pytest.skip("fio without the nbd ioengine")
    size = 32 * MiB
    kf, key = ws.key(64)
    backing = ws.backing(size)
    b = ws.serve(backing, kf, key_size=512, sector_size=sector_size)
    args = [
        "fio",
        "--name=cbverify",
        "--ioengine=nbd",
        f"--uri={b.uri}",
        "--rw=randwrite",
        f"--bsrange={bs}" if "-" in bs else f"--bs={bs}",
        f"--blockalign={sector_size}",
        "--size=16M",
        "--iodepth=16",
        "--numjobs=1",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--do_verify=1",
        "--randrepeat=0",
        "--output-format=json",
    ]
    p = run(args, timeout=180, cwd=ws.tmp)  # fio drops *-verify.state files in its cwd
    out = p.stdout.decode(errors="replace")
    assert p.returncode == 0, f"fio failed:\n{out[-3000:]}\n{p.stderr.decode(errors='replace')[-3000:]}"
    j = json.loads(out[out.index("{") :])
    job = j["jobs"][0]
    assert job["error"] == 0
    assert job["write"]["io_bytes"] >= 16 * MiB
    assert job["read"]["io_bytes"] >= 16 * MiB  # the verify pass
    # whatever fio wrote: the backing file is the reference encryption of what the bridge serves
    dst = ws.tmp / "dst.img"
    run(["nbdcopy", b.uri, dst], timeout=60, check=True)
    check_disk(backing, key, dst.read_bytes()[: 16 * MiB], sector_size, False, nsample=256, rng=random.Random(1))


def test_fio_multi_job_verify(ws):
    """Two fio jobs (two connections) on disjoint halves with verify."""
    if not _fio_has_nbd():
        pytest.skip("fio without the nbd ioengine")
    kf, key = ws.key(64)
    b = ws.serve(ws.backing(16 * MiB), kf, sector_size=4096)
    args = [
        "fio", "--ioengine=nbd", f"--uri={b.uri}", "--rw=randwrite", "--bs=4k", "--iodepth=8",
        "--verify=crc32c", "--verify_fatal=1", "--size=8M",
        "--name=a", "--offset=0",
        "--name=b", "--offset=8M",
    ]  # fmt: skip
    p = run(args, timeout=180, cwd=ws.tmp)
    assert p.returncode == 0, p.stdout.decode(errors="replace")[-3000:] + p.stderr.decode(errors="replace")[-3000:]


def test_passthrough_stores_plaintext(ws):
    size = 2 * MiB
    backing = ws.backing(size)
    b = ws.serve(backing, passthrough=True, sector_size=512)
    rng = random.Random(3)
    writes = []
    with NBDClient(b.uri) as c:
        c.connect()
        for _ in range(40):
            off = rng.randrange(0, size - 9000)
            data = rng.randbytes(rng.randint(1, 9000))
            c.write(off, data)
            writes.append((off, data))
        c.flush()
    disk = bytearray(size)
    for off, data in writes:
        disk[off : off + len(data)] = data
    assert backing.read_bytes() == bytes(disk)
    if shutil.which("nbdcopy"):
        src = ws.tmp / "src"
        pt = os.urandom(size)
        src.write_bytes(pt)
        run(["nbdcopy", "--flush", src, b.uri], timeout=60, check=True)
        assert backing.read_bytes() == pt


def test_existing_ciphertext_is_decrypted(ws):
    """Data encrypted by the reference (as dm-crypt would have written it) reads back as plaintext."""
    need_tool("nbdcopy")
    for sector_size, iv_large in ((512, False), (4096, False), (4096, True)):
        kf, key = ws.key(64, name=f"k{sector_size}{iv_large}")
        pt = os.urandom(2 * MiB)
        backing = ws.tmp / f"pre{sector_size}{iv_large}.img"
        backing.write_bytes(xts_ref.encrypt_sectors(key, pt, sector_size, 0, iv_large))
        b = ws.serve(backing, kf, key_size=512, sector_size=sector_size, iv_large=iv_large)
        dst = ws.tmp / f"out{sector_size}{iv_large}.img"
        run(["nbdcopy", b.uri, dst], timeout=60, check=True)
        assert dst.read_bytes() == pt, (sector_size, iv_large)


def test_cipher_name_spellings(ws):
    pt = os.urandom(64 * 1024)
    kf, key = ws.key(64)
    for name in ("aes-xts-plain64", "capi:xts(aes)-plain64", "xts(aes)"):
        backing = ws.backing(1 * MiB, name=f"b-{len(name)}.img")
        b = ws.serve(backing, kf, cipher=name)
        with NBDClient(b.uri) as c:
            c.connect()
            c.write(0, pt)
            c.flush()
        assert backing.read_bytes()[: len(pt)] == xts_ref.encrypt_sectors(key, pt, 512), name


def _dm_available():
    return os.path.exists("/dev/mapper/control") and shutil.which("cryptsetup") and os.geteuid() == 0


@pytest.mark.parametrize("sector_size,iv_large", [(512, False), (4096, False), (4096, True)])
def test_matches_real_dm_crypt(ws, sector_size, iv_large):
    """Byte-identical to dm-crypt plain mode: write through the bridge, read through dm-crypt."""
    if not _dm_available():
        pytest.skip("device-mapper not available here (no /dev/mapper/control)")
    size = 4 * MiB
    kf, key = ws.key(64)
    backing = ws.backing(size)
    pt = os.urandom(size)
    b = ws.serve(backing, kf, key_size=512, sector_size=sector_size, iv_large=iv_large)
    with NBDClient(b.uri) as c:
        c.connect()
        c.write(0, pt)
        c.flush()
    b.stop()
    loop = None
    name = f"cbtest{os.getpid()}"
    try:
        p = run(["losetup", "-f", "--show", backing], timeout=30)
        if p.returncode != 0:
            pytest.skip(f"losetup failed: {p.stderr.decode()}")
        loop = p.stdout.decode().strip()
        cmd = ["cryptsetup", "open", "--type", "plain", "--cipher", "aes-xts-plain64", "--key-size", "512",
               "--key-file", kf, "--sector-size", str(sector_size)]  # fmt: skip
        if iv_large:
            cmd.append("--iv-large-sectors")
        p = run(cmd + [loop, name], timeout=60)
        if p.returncode != 0:
            pytest.skip(f"cryptsetup open failed: {p.stderr.decode().strip().splitlines()[0]}")
        with open(f"/dev/mapper/{name}", "rb") as f:
            assert f.read(size) == pt
    finally:
        run(["cryptsetup", "close", name], timeout=60)
        if loop:
            run(["losetup", "-d", loop], timeout=30)


def _odirect_ok(directory):
    import mmap

    path = os.path.join(directory, ".odirect-probe")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        m = mmap.mmap(-1, 4096)
        os.pwritev(fd, [m], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.parametrize("sector_size", [512, 4096])
def test_direct_io_threads_engine(ws, sector_size):
    """--direct (O_DIRECT backing), --threads, --engine cpu: unaligned client I/O still correct."""
    if not _odirect_ok(ws.tmp):
        pytest.skip("file system under the tmp dir does not support O_DIRECT")
    size = 2 * MiB
    kf, key = ws.key(64)
    backing = ws.backing(size)
    b = ws.serve(backing, kf, key_size=512, sector_size=sector_size,
                 extra=("--direct", "--threads", "2", "--engine", "cpu"))  # fmt: skip
    rng = random.Random(sector_size)
    model = bytearray(xts_ref.decrypt_sectors(key, bytes(size), sector_size))
    with NBDClient(b.uri) as c:
        c.connect()
        for _ in range(60):
            off = rng.randrange(0, size - 20000)
            data = rng.randbytes(rng.randint(1, 20000))
            c.write(off, data, fua=rng.random() < 0.3)
            model[off : off + len(data)] = data
        c.flush()
        assert c.read(0, size) == bytes(model)
        # Reads from 256 KiB on are decrypted piece by piece as the reply goes out: unaligned
        # windows of them.
        for _ in range(12):
            n = rng.randint(256 * 1024, 700 * 1024)
            off = rng.randrange(0, size - n)
            assert c.read(off, n) == bytes(model[off : off + n]), (off, n)
    assert xts_ref.decrypt_sectors(key, backing.read_bytes(), sector_size) == bytes(model)
