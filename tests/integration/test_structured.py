"""Structured replies, metadata contexts and NBD_CMD_BLOCK_STATUS (`base:allocation`).

Raw-socket tests (nbd_client.py for the handshake, the chunks decoded here from proto.md) check
the wire format, hostile option payloads and the errors; real clients (nbdinfo --map, qemu-img
map/convert, qemu-io) check that what is reported is used correctly. Holes are checked against
the backing file's SEEK_DATA/SEEK_HOLE map read here, and data against the Python XTS
reference: a hole in an encrypted export is reported NBD_STATE_HOLE, never NBD_STATE_ZERO,
because it reads as the decryption of zero ciphertext, not as zeroes.
"""
from __future__ import annotations

import json
import os
import struct

import pytest

import nbd_client as nbd
from conftest import need_tool, run
from nbd_client import NBDClient, NBDProtocolError
from reference import xts_ref

MiB = 1 << 20
STATE_HOLE, STATE_ZERO = 1, 2
REPLY_FLAG_DONE = 1
REPLY_TYPE_OFFSET_DATA, REPLY_TYPE_BLOCK_STATUS, REPLY_TYPE_ERROR = 1, 5, (1 << 15) | 1


class SClient(NBDClient):
    """NBDClient plus structured replies and metadata contexts."""

    def opt_structured(self) -> None:
        self.send_option(nbd.OPT_STRUCTURED_REPLY)
        r = self.recv_opt_reply()
        assert (r.option, r.type) == (nbd.OPT_STRUCTURED_REPLY, nbd.REP_ACK), r

    def meta(self, option: int, queries=(), name: bytes = b"", raw: bytes | None = None):
        """LIST/SET_META_CONTEXT: ([(id, name)], final reply type)."""
        if raw is None:
            raw = struct.pack(">I", len(name)) + name + struct.pack(">I", len(queries))
            raw += b"".join(struct.pack(">I", len(q)) + q for q in queries)
        self.send_option(option, raw)
        contexts = []
        while True:
            r = self.recv_opt_reply()
            assert r.option == option
            if r.type == nbd.REP_META_CONTEXT:
                contexts.append((struct.unpack(">I", r.data[:4])[0], r.data[4:].decode()))
                continue
            return contexts, r.type

    def chunks(self, handle: int) -> list[tuple[int, int, bytes]]:
        """Structured chunks of `handle` until DONE: [(flags, type, payload)]."""
        out = []
        while True:
            magic, flags, rtype, h, length = struct.unpack(">IHHQI", self.recv_exact(20))
            if magic != nbd.STRUCTURED_REPLY_MAGIC:
                raise NBDProtocolError(f"expected a structured chunk, got magic {magic:#x}")
            assert h == handle, (h, handle)
            out.append((flags, rtype, self.recv_exact(length) if length else b""))
            if flags & REPLY_FLAG_DONE:
                self._pending.pop(handle, None)
                return out

    def block_status(self, offset: int, length: int, flags: int = 0) -> list[tuple[int, int]]:
        h = self.send_request(nbd.CMD_BLOCK_STATUS, offset, length, flags=flags, expect_data=0)
        (c,) = self.chunks(h)
        assert c[1] == REPLY_TYPE_BLOCK_STATUS, c
        ctx = struct.unpack(">I", c[2][:4])[0]
        assert ctx == self.context_id
        body = c[2][4:]
        return [struct.unpack(">II", body[i:i + 8]) for i in range(0, len(body), 8)]

    def sread(self, offset: int, length: int, flags: int = 0) -> list[tuple[int, int, bytes]]:
        h = self.send_request(nbd.CMD_READ, offset, length, flags=flags, expect_data=0)
        return self.chunks(h)

    def start(self, meta: bool = True) -> "SClient":
        self.handshake()
        self.opt_structured()
        self.context_id = None
        if meta:
            contexts, rtype = self.meta(nbd.OPT_SET_META_CONTEXT, [b"base:allocation"])
            assert rtype == nbd.REP_ACK and len(contexts) == 1 and contexts[0][1] == "base:allocation", contexts
            self.context_id = contexts[0][0]
        self.opt_go()
        return self


def file_map(path, offset=0, length=None):
    """The file's allocation from SEEK_DATA/SEEK_HOLE: [(length, hole)] over the range."""
    size = os.path.getsize(path)
    end = size if length is None else offset + length
    out, pos = [], offset
    fd = os.open(path, os.O_RDONLY)
    try:
        while pos < end:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                data = end
            if data > pos:
                out.append((min(data, end) - pos, True))
                pos = min(data, end)
                continue
            hole = os.lseek(fd, pos, os.SEEK_HOLE)
            out.append((min(hole, end) - pos, False))
            pos = min(hole, end)
    finally:
        os.close(fd)
    merged = []
    for ln, hole in out:
        if merged and merged[-1][1] == hole:
            merged[-1] = (merged[-1][0] + ln, hole)
        else:
            merged.append((ln, hole))
    return merged


def sparse_volume(ws, passthrough=False, size=16 * MiB, sector_size=4096):
    """A sparse backing with data written through the bridge at 4 MiB (1 MiB) and 12 MiB (4 KiB)."""
    kf, key = ws.key(64)
    backing = ws.backing(size)
    b = ws.serve(backing, None if passthrough else kf, passthrough=passthrough, sector_size=sector_size)
    with NBDClient(b.uri).connect() as c:
        c.write(4 * MiB, os.urandom(MiB))
        c.write(12 * MiB, os.urandom(4096))
        c.flush()
    if file_map(backing)[0] != (4 * MiB, True):
        pytest.skip("this file system does not keep holes (SEEK_DATA finds data everywhere)")
    return b, backing, key


def expected_status(backing, passthrough, offset=0, length=None):
    hole_flags = STATE_HOLE | STATE_ZERO if passthrough else STATE_HOLE
    return [(ln, hole_flags if hole else 0) for ln, hole in file_map(backing, offset, length)]


# ---------------------------------------------------------------------------------------------
# raw protocol
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("passthrough", [False, True], ids=["xts", "passthrough"])
def test_block_status_reports_holes_never_zero_when_encrypted(ws, passthrough):
    b, backing, _ = sparse_volume(ws, passthrough)
    with SClient(b.uri).start() as c:
        assert c.flags & nbd.TFLAG_SEND_DF, "SEND_DF once structured replies are on"
        got = c.block_status(0, 16 * MiB)
        assert got == expected_status(backing, passthrough), got
        assert sum(ln for ln, _ in got) == 16 * MiB
        if not passthrough:
            assert all(not f & STATE_ZERO for _, f in got), "a hole of ciphertext is not zeroes"
        # A range inside: clipped to the request.
        got = c.block_status(3 * MiB, 2 * MiB)
        assert got == expected_status(backing, passthrough, 3 * MiB, 2 * MiB), got
        # REQ_ONE: exactly one extent, starting at the offset.
        one = c.block_status(4 * MiB + 4096, 8 * MiB, flags=nbd.CMD_FLAG_REQ_ONE)
        assert one == [(MiB - 4096, 0)], one
        # Over a data/hole boundary at the very end of the export.
        tail = c.block_status(16 * MiB - 8192, 8192)
        assert tail == expected_status(backing, passthrough, 16 * MiB - 8192, 8192)


def test_structured_reads_writes_and_errors(ws):
    kf, key = ws.key(64)
    size = 4 * MiB
    backing = ws.backing(size)
    b = ws.serve(backing, kf, sector_size=512)
    data = os.urandom(65536)
    with SClient(b.uri).start(meta=False) as c:
        c.write(8192, data)  # simple reply to a WRITE: recv_reply accepts only that
        for flags in (0, nbd.CMD_FLAG_DF):
            (chunk,) = c.sread(8192 + 100, 30000, flags)
            assert chunk[0] == REPLY_FLAG_DONE and chunk[1] == REPLY_TYPE_OFFSET_DATA, chunk[:2]
            assert struct.unpack(">Q", chunk[2][:8])[0] == 8192 + 100, "chunk offset is the request's"
            assert chunk[2][8:] == data[100:30100]
        # on disk: the reference XTS of what was written
        with open(backing, "rb") as f:
            f.seek(8192)
            raw = f.read(65536)
        assert xts_ref.decrypt_sectors(key, raw, 512, 16, False) == data
        # errors on READ come as an ERROR chunk; the connection goes on
        (err,) = c.sread(size - 512, 1024)
        assert err[1] == REPLY_TYPE_ERROR and err[0] & REPLY_FLAG_DONE
        assert struct.unpack(">IH", err[2][:6]) == (22, 0), "EINVAL, empty message"
        (err,) = c.sread(0, 512, flags=nbd.CMD_FLAG_REQ_ONE)
        assert err[1] == REPLY_TYPE_ERROR and struct.unpack(">I", err[2][:4])[0] == 22
        # BLOCK_STATUS without a selected context: EINVAL (as a structured error here)
        h = c.send_request(nbd.CMD_BLOCK_STATUS, 0, 4096, expect_data=0)
        (err,) = c.chunks(h)
        assert err[1] == REPLY_TYPE_ERROR and struct.unpack(">I", err[2][:4])[0] == 22
        (chunk,) = c.sread(8192, 512)
        assert chunk[2][8:] == data[:512]


def test_block_status_and_df_before_negotiation_are_einval(ws):
    kf, _ = ws.key(64)
    b = ws.serve(ws.backing(MiB), kf)
    with NBDClient(b.uri) as c:
        c.connect()
        assert not c.flags & nbd.TFLAG_SEND_DF
        r = c.request(nbd.CMD_BLOCK_STATUS, 0, 4096)
        assert r.error == 22
        r = c.request(nbd.CMD_READ, 0, 512, flags=nbd.CMD_FLAG_DF)
        assert r.error == 22
        assert len(c.read(0, 512)) == 512, "simple replies go on"


def test_list_meta_context(ws):
    kf, _ = ws.key(64)
    b = ws.serve(ws.backing(MiB), kf)
    with SClient(b.uri) as c:
        c.handshake()
        # Before STRUCTURED_REPLY: refused
        assert c.meta(nbd.OPT_LIST_META_CONTEXT) == ([], nbd.REP_ERR_INVALID)
        assert c.meta(nbd.OPT_SET_META_CONTEXT, [b"base:allocation"]) == ([], nbd.REP_ERR_INVALID)
        c.opt_structured()
        ctx, t = c.meta(nbd.OPT_LIST_META_CONTEXT)
        assert t == nbd.REP_ACK and [n for _, n in ctx] == ["base:allocation"]
        ctx, t = c.meta(nbd.OPT_LIST_META_CONTEXT, [b"base:"])
        assert t == nbd.REP_ACK and [n for _, n in ctx] == ["base:allocation"]
        assert c.meta(nbd.OPT_LIST_META_CONTEXT, [b"qemu:dirty-bitmap:x"]) == ([], nbd.REP_ACK)
        assert c.meta(nbd.OPT_LIST_META_CONTEXT, name=b"cryptbridge")[1] == nbd.REP_ACK
        assert c.meta(nbd.OPT_LIST_META_CONTEXT, name=b"other") == ([], nbd.REP_ERR_UNKNOWN)
        # SET by exact name only; an unknown one selects nothing
        assert c.meta(nbd.OPT_SET_META_CONTEXT, [b"base:"]) == ([], nbd.REP_ACK)
        ctx, t = c.meta(nbd.OPT_SET_META_CONTEXT, [b"nope", b"base:allocation"])
        assert t == nbd.REP_ACK and len(ctx) == 1 and ctx[0][0] != 0
        # A later SET replaces the selection: BLOCK_STATUS is then refused
        assert c.meta(nbd.OPT_SET_META_CONTEXT, [b"nope"]) == ([], nbd.REP_ACK)
        c.opt_go()
        h = c.send_request(nbd.CMD_BLOCK_STATUS, 0, 4096, expect_data=0)
        (err,) = c.chunks(h)
        assert err[1] == REPLY_TYPE_ERROR and struct.unpack(">I", err[2][:4])[0] == 22


def lying(name_len=None, name=b"", count=None, queries=(), tail=b""):
    raw = struct.pack(">I", len(name) if name_len is None else name_len) + name
    raw += struct.pack(">I", len(queries) if count is None else count)
    for q in queries:
        if isinstance(q, tuple):  # (declared length, bytes)
            raw += struct.pack(">I", q[0]) + q[1]
        else:
            raw += struct.pack(">I", len(q)) + q
    return raw + tail


HOSTILE = {
    "name length past the data": lying(name_len=100, name=b"x"),
    "name length 4 GiB": lying(name_len=0xFFFFFFFF),
    "name longer than 4096": lying(name=b"n" * 5000),
    "count that lies": lying(count=1000, queries=[b"base:allocation"]),
    "count 4 G": lying(count=0xFFFFFFFF),
    "query length past the data": lying(queries=[(64, b"base:allocation")]),
    "query longer than 4096": lying(queries=[b"q" * 5000]),
    "trailing bytes": lying(queries=[b"base:allocation"], tail=b"junk"),
    "truncated header": b"\x00\x00",
    "empty": b"",
}


@pytest.mark.parametrize("option", [nbd.OPT_LIST_META_CONTEXT, nbd.OPT_SET_META_CONTEXT], ids=["list", "set"])
def test_hostile_meta_context_options_are_refused(ws, option):
    kf, key = ws.key(64)
    backing = ws.backing(MiB)
    b = ws.serve(backing, kf)
    with SClient(b.uri) as c:
        c.handshake()
        c.opt_structured()
        for what, raw in HOSTILE.items():
            ctx, t = c.meta(option, raw=raw)
            assert (ctx, t) == ([], nbd.REP_ERR_INVALID), what
        # STRUCTURED_REPLY with a payload is invalid too
        c.send_option(nbd.OPT_STRUCTURED_REPLY, b"x")
        assert c.recv_opt_reply().type == nbd.REP_ERR_INVALID
        # an over-long option is drained and refused, the handshake goes on
        c.send_option(option, b"\x00" * (64 * 1024))
        assert c.recv_opt_reply().type == nbd.REP_ERR_TOO_BIG
        c.opt_go()
        (chunk,) = c.sread(0, 4096)
        assert chunk[1] == REPLY_TYPE_OFFSET_DATA and len(chunk[2]) == 8 + 4096
    assert b.alive


def test_structured_reply_negotiated_twice_and_simple_otherwise(ws):
    kf, _ = ws.key(64)
    b = ws.serve(ws.backing(MiB), kf)
    with SClient(b.uri) as c:
        c.handshake()
        c.opt_structured()
        c.opt_structured()
        c.opt_go()
        (chunk,) = c.sread(0, 4096)
        assert chunk[1] == REPLY_TYPE_OFFSET_DATA and len(chunk[2]) == 8 + 4096


# ---------------------------------------------------------------------------------------------
# real clients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("passthrough", [False, True], ids=["xts", "passthrough"])
def test_nbdinfo_map(ws, passthrough):
    need_tool("nbdinfo")
    b, backing, _ = sparse_volume(ws, passthrough)
    p = run(["nbdinfo", "--map", "--json", b.uri], timeout=30, check=True)
    got = [(e["length"], e["type"]) for e in json.loads(p.stdout)]
    assert got == expected_status(backing, passthrough), got
    if not passthrough:
        assert all(t in (0, STATE_HOLE) for _, t in got)


@pytest.mark.parametrize("passthrough", [False, True], ids=["xts", "passthrough"])
def test_qemu_img_map_and_convert(ws, passthrough):
    need_tool("qemu-img")
    b, backing, key = sparse_volume(ws, passthrough)
    p = run(["qemu-img", "map", "--output=json", "-f", "raw", b.uri], timeout=60, check=True)
    extents = json.loads(p.stdout)
    assert sum(e["length"] for e in extents) == 16 * MiB
    holes = [(e["start"], e["length"]) for e in extents if not e["data"]]
    want_holes = []
    pos = 0
    for ln, hole in file_map(backing):
        if hole:
            want_holes.append((pos, ln))
        pos += ln
    assert holes == want_holes, (holes, want_holes)
    for e in extents:
        if not e["data"]:
            assert e["zero"] == passthrough, e  # never "zero" for an encrypted hole
    out = ws.tmp / "converted.raw"
    run(["qemu-img", "convert", "-f", "raw", "-O", "raw", b.uri, out], timeout=120, check=True)
    raw = backing.read_bytes()
    want = raw if passthrough else xts_ref.decrypt_sectors(key, raw, 4096, 0, False)
    got = out.read_bytes()
    assert len(got) == len(want)
    assert got == want, "convert skipped or zeroed bytes that read otherwise"
    if not passthrough:
        assert got[:4096] != b"\0" * 4096, "a hole in an encrypted export does not read as zeroes"


def test_qemu_io_over_structured_replies(ws):
    need_tool("qemu-io")
    kf, key = ws.key(64)
    backing = ws.backing(4 * MiB)
    b = ws.serve(backing, kf, sector_size=4096)
    p = run(["qemu-io", "-f", "raw", "-c", "write -P 0xa5 1M 192k", "-c", "read -P 0xa5 1M 192k",
             "-c", "read -P 0xa5 1052672 4096", b.uri], timeout=60, check=True)
    out = p.stdout.decode()
    assert "Pattern verification failed" not in out and out.count("read ") == 2, out
    raw = backing.read_bytes()[MiB:MiB + 192 * 1024]
    assert xts_ref.decrypt_sectors(key, raw, 4096, MiB // 4096, False) == b"\xa5" * (192 * 1024)
