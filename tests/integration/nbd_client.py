"""Minimal raw-socket NBD client (fixed newstyle handshake, simple replies) for protocol tests.

Written from the NBD protocol specification
(https://github.com/NetworkBlockDevice/nbd/blob/master/doc/proto.md); deliberately independent of
libnbd so that tests can send malformed or unusual requests and pipeline freely.
"""
from __future__ import annotations

import errno
import itertools
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import parse_qs, urlparse

# --- handshake -------------------------------------------------------------------------------
NBDMAGIC = 0x4E42444D41474943  # "NBDMAGIC"
IHAVEOPT = 0x49484156454F5054  # "IHAVEOPT"
OPT_REPLY_MAGIC = 0x3E889045565A9

FLAG_FIXED_NEWSTYLE = 1 << 0
FLAG_NO_ZEROES = 1 << 1
CLIENT_FLAG_FIXED_NEWSTYLE = 1 << 0
CLIENT_FLAG_NO_ZEROES = 1 << 1

OPT_EXPORT_NAME = 1
OPT_ABORT = 2
OPT_LIST = 3
OPT_PEEK_EXPORT = 4
OPT_STARTTLS = 5
OPT_INFO = 6
OPT_GO = 7
OPT_STRUCTURED_REPLY = 8
OPT_LIST_META_CONTEXT = 9
OPT_SET_META_CONTEXT = 10

REP_ACK = 1
REP_SERVER = 2
REP_INFO = 3
REP_META_CONTEXT = 4
REP_ERR = 1 << 31
REP_ERR_UNSUP = REP_ERR | 1
REP_ERR_POLICY = REP_ERR | 2
REP_ERR_INVALID = REP_ERR | 3
REP_ERR_PLATFORM = REP_ERR | 4
REP_ERR_TLS_REQD = REP_ERR | 5
REP_ERR_UNKNOWN = REP_ERR | 6
REP_ERR_SHUTDOWN = REP_ERR | 7
REP_ERR_BLOCK_SIZE_REQD = REP_ERR | 8
REP_ERR_TOO_BIG = REP_ERR | 9

INFO_EXPORT = 0
INFO_NAME = 1
INFO_DESCRIPTION = 2
INFO_BLOCK_SIZE = 3

# --- transmission ----------------------------------------------------------------------------
TFLAG_HAS_FLAGS = 1 << 0
TFLAG_READ_ONLY = 1 << 1
TFLAG_SEND_FLUSH = 1 << 2
TFLAG_SEND_FUA = 1 << 3
TFLAG_ROTATIONAL = 1 << 4
TFLAG_SEND_TRIM = 1 << 5
TFLAG_SEND_WRITE_ZEROES = 1 << 6
TFLAG_SEND_DF = 1 << 7
TFLAG_CAN_MULTI_CONN = 1 << 8
TFLAG_SEND_RESIZE = 1 << 9
TFLAG_SEND_CACHE = 1 << 10
TFLAG_SEND_FAST_ZERO = 1 << 11

REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
STRUCTURED_REPLY_MAGIC = 0x668E33EF

CMD_READ = 0
CMD_WRITE = 1
CMD_DISC = 2
CMD_FLUSH = 3
CMD_TRIM = 4
CMD_CACHE = 5
CMD_WRITE_ZEROES = 6
CMD_BLOCK_STATUS = 7
CMD_RESIZE = 8

CMD_FLAG_FUA = 1 << 0
CMD_FLAG_NO_HOLE = 1 << 1
CMD_FLAG_DF = 1 << 2
CMD_FLAG_REQ_ONE = 1 << 3
CMD_FLAG_FAST_ZERO = 1 << 4

# NBD error numbers (protocol values, not necessarily the host's errno)
NBD_EPERM = 1
NBD_EIO = 5
NBD_ENOMEM = 12
NBD_EINVAL = 22
NBD_ENOSPC = 28
NBD_EOVERFLOW = 75
NBD_ENOTSUP = 95
NBD_ESHUTDOWN = 108

ERR_NAMES = {
    0: "OK",
    NBD_EPERM: "EPERM",
    NBD_EIO: "EIO",
    NBD_ENOMEM: "ENOMEM",
    NBD_EINVAL: "EINVAL",
    NBD_ENOSPC: "ENOSPC",
    NBD_EOVERFLOW: "EOVERFLOW",
    NBD_ENOTSUP: "ENOTSUP",
    NBD_ESHUTDOWN: "ESHUTDOWN",
}


class NBDProtocolError(Exception):
    pass


class NBDError(Exception):
    """A transmission-phase request answered with a non-zero error."""

    def __init__(self, error: int, what: str = ""):
        self.error = error
        super().__init__(f"{what}: NBD error {error} ({ERR_NAMES.get(error, '?')})")


class OptionError(Exception):
    def __init__(self, reply_type: int, data: bytes):
        self.reply_type = reply_type
        self.data = data
        super().__init__(f"option error reply 0x{reply_type:08x} {data[:200]!r}")


@dataclass
class OptReply:
    option: int
    type: int
    data: bytes


@dataclass
class ExportInfo:
    size: Optional[int] = None
    flags: Optional[int] = None
    name: Optional[str] = None
    description: Optional[str] = None
    block_min: Optional[int] = None
    block_pref: Optional[int] = None
    block_max: Optional[int] = None
    raw: list = field(default_factory=list)


@dataclass
class Reply:
    handle: int
    error: int
    data: bytes = b""


def parse_uri(uri: str):
    """-> ('unix', path, export) or ('tcp', (host, port), export)."""
    u = urlparse(uri)
    export = u.path[1:] if u.path.startswith("/") else u.path
    if u.scheme == "nbd+unix":
        q = parse_qs(u.query)
        return "unix", q["socket"][0], export
    if u.scheme == "nbd":
        return "tcp", (u.hostname, u.port or 10809), export
    raise ValueError(f"unsupported URI {uri!r}")


def connect_socket(uri: str, timeout: float = 20.0) -> socket.socket:
    kind, addr, _ = parse_uri(uri)
    if kind == "unix":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.settimeout(timeout)
    s.connect(addr)
    return s


class NBDClient:
    """One NBD connection. Call ``handshake()`` then one of the option methods, then go()/
    export_name() to enter transmission."""

    def __init__(self, uri: str, timeout: float = 20.0):
        self.uri = uri
        self.sock = connect_socket(uri, timeout)
        self.handshake_flags = 0
        self.no_zeroes = False
        self.size: Optional[int] = None
        self.flags: Optional[int] = None
        self.info: Optional[ExportInfo] = None
        self._handles = itertools.count(1)
        # handle -> expected read length (for data following a successful simple reply)
        self._pending: dict[int, int] = {}
        self._send_lock = threading.Lock()

    # --- plumbing ----------------------------------------------------------------------------
    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
            buf += chunk
        return bytes(buf)

    def sendall(self, data: bytes) -> None:
        with self._send_lock:
            self.sock.sendall(data)

    def is_closed_by_peer(self, timeout: float = 5.0) -> bool:
        """True when the server closes the connection (EOF or reset) within ``timeout``."""
        old = self.sock.gettimeout()
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
            return data == b""
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False
        finally:
            try:
                self.sock.settimeout(old)
            except OSError:
                pass

    # --- handshake ---------------------------------------------------------------------------
    def handshake(self, no_zeroes: bool = True, client_flags: Optional[int] = None) -> int:
        magic, opt = struct.unpack(">QQ", self.recv_exact(16))
        if magic != NBDMAGIC:
            raise NBDProtocolError(f"bad NBDMAGIC {magic:#x}")
        if opt != IHAVEOPT:
            raise NBDProtocolError(f"server is not newstyle ({opt:#x})")
        (self.handshake_flags,) = struct.unpack(">H", self.recv_exact(2))
        if not self.handshake_flags & FLAG_FIXED_NEWSTYLE:
            raise NBDProtocolError("server does not offer fixed newstyle")
        if client_flags is None:
            client_flags = CLIENT_FLAG_FIXED_NEWSTYLE
            if no_zeroes and self.handshake_flags & FLAG_NO_ZEROES:
                client_flags |= CLIENT_FLAG_NO_ZEROES
        self.no_zeroes = bool(client_flags & CLIENT_FLAG_NO_ZEROES)
        self.sendall(struct.pack(">I", client_flags))
        return self.handshake_flags

    def send_option(self, option: int, data: bytes = b"") -> None:
        self.sendall(struct.pack(">QII", IHAVEOPT, option, len(data)) + data)

    def recv_opt_reply(self) -> OptReply:
        magic, option, rtype, length = struct.unpack(">QIII", self.recv_exact(20))
        if magic != OPT_REPLY_MAGIC:
            raise NBDProtocolError(f"bad option reply magic {magic:#x}")
        data = self.recv_exact(length) if length else b""
        return OptReply(option, rtype, data)

    def opt_list(self) -> list[str]:
        self.send_option(OPT_LIST)
        names = []
        while True:
            r = self.recv_opt_reply()
            if r.option != OPT_LIST:
                raise NBDProtocolError(f"reply for option {r.option}, expected LIST")
            if r.type == REP_ACK:
                return names
            if r.type == REP_SERVER:
                (n,) = struct.unpack(">I", r.data[:4])
                names.append(r.data[4 : 4 + n].decode())
            elif r.type & REP_ERR:
                raise OptionError(r.type, r.data)
            else:
                raise NBDProtocolError(f"unexpected LIST reply type {r.type}")

    def _info_or_go(self, option: int, name: str, requests: tuple[int, ...]) -> ExportInfo:
        nb = name.encode()
        payload = struct.pack(">I", len(nb)) + nb + struct.pack(">H", len(requests))
        payload += b"".join(struct.pack(">H", r) for r in requests)
        self.send_option(option, payload)
        info = ExportInfo()
        while True:
            r = self.recv_opt_reply()
            if r.option != option:
                raise NBDProtocolError(f"reply for option {r.option}, expected {option}")
            if r.type == REP_ACK:
                break
            if r.type & REP_ERR:
                raise OptionError(r.type, r.data)
            if r.type != REP_INFO:
                raise NBDProtocolError(f"unexpected reply type {r.type:#x}")
            (itype,) = struct.unpack(">H", r.data[:2])
            info.raw.append((itype, r.data[2:]))
            if itype == INFO_EXPORT:
                info.size, info.flags = struct.unpack(">QH", r.data[2:12])
            elif itype == INFO_NAME:
                info.name = r.data[2:].decode()
            elif itype == INFO_DESCRIPTION:
                info.description = r.data[2:].decode()
            elif itype == INFO_BLOCK_SIZE:
                info.block_min, info.block_pref, info.block_max = struct.unpack(">III", r.data[2:14])
        if info.size is None:
            raise NBDProtocolError("server sent no NBD_INFO_EXPORT")
        return info

    def opt_info(self, name: str = "", requests=(INFO_BLOCK_SIZE,)) -> ExportInfo:
        return self._info_or_go(OPT_INFO, name, tuple(requests))

    def opt_go(self, name: str = "", requests=(INFO_BLOCK_SIZE,)) -> ExportInfo:
        info = self._info_or_go(OPT_GO, name, tuple(requests))
        self.size, self.flags, self.info = info.size, info.flags, info
        return info

    def opt_export_name(self, name: str = "") -> tuple[int, int]:
        """NBD_OPT_EXPORT_NAME: no reply header; on success size+flags(+zeroes)."""
        self.send_option(OPT_EXPORT_NAME, name.encode())
        self.size, self.flags = struct.unpack(">QH", self.recv_exact(10))
        if not self.no_zeroes:
            z = self.recv_exact(124)
            if z != bytes(124):
                raise NBDProtocolError("non-zero padding after EXPORT_NAME")
        return self.size, self.flags

    def opt_abort(self) -> Optional[OptReply]:
        """Send NBD_OPT_ABORT; returns the ACK if the server sent one before closing."""
        self.send_option(OPT_ABORT)
        try:
            return self.recv_opt_reply()
        except (ConnectionError, OSError):
            return None

    def connect(self, name: str = "") -> "NBDClient":
        self.handshake()
        self.opt_go(name)
        return self

    # --- transmission ------------------------------------------------------------------------
    def send_request(self, *args, **kwargs) -> int:
        """Send one request (does not wait); the arguments are those of ``pack_request``."""
        handle, wire = self.pack_request(*args, **kwargs)
        self.sendall(wire)
        return handle

    def pack_request(
        self,
        cmd: int,
        offset: int = 0,
        length: int = 0,
        data: bytes = b"",
        flags: int = 0,
        handle: Optional[int] = None,
        magic: int = REQUEST_MAGIC,
        expect_data: Optional[int] = None,
    ) -> tuple[int, bytes]:
        """Encode one request and expect its reply, without sending it (``send_request`` sends
        it). ``length`` defaults to len(data) for writes."""
        if handle is None:
            handle = next(self._handles)
        if cmd == CMD_WRITE and length == 0 and data:
            length = len(data)
        if expect_data is None:
            expect_data = length if cmd == CMD_READ else 0
        self._pending[handle] = expect_data
        hdr = struct.pack(">IHHQQI", magic, flags, cmd, handle, offset, length)
        return handle, hdr + data

    def recv_reply(self) -> Reply:
        magic, error, handle = struct.unpack(">IIQ", self.recv_exact(16))
        if magic == STRUCTURED_REPLY_MAGIC:
            raise NBDProtocolError("structured reply received without negotiating it")
        if magic != SIMPLE_REPLY_MAGIC:
            raise NBDProtocolError(f"bad reply magic {magic:#x}")
        if handle not in self._pending:
            raise NBDProtocolError(f"reply for unknown handle {handle:#x}")
        want = self._pending.pop(handle)
        data = b""
        if error == 0 and want:
            data = self.recv_exact(want)
        return Reply(handle, error, data)

    def request(self, cmd: int, offset: int = 0, length: int = 0, data: bytes = b"", flags: int = 0) -> Reply:
        h = self.send_request(cmd, offset, length, data, flags)
        r = self.recv_reply()
        if r.handle != h:
            raise NBDProtocolError(f"reply handle {r.handle} != request handle {h}")
        return r

    def _ok(self, r: Reply, what: str) -> Reply:
        if r.error:
            raise NBDError(r.error, what)
        return r

    def read(self, offset: int, length: int, flags: int = 0) -> bytes:
        return self._ok(self.request(CMD_READ, offset, length, flags=flags), f"read {offset}+{length}").data

    def write(self, offset: int, data: bytes, fua: bool = False) -> None:
        self._ok(
            self.request(CMD_WRITE, offset, len(data), data, CMD_FLAG_FUA if fua else 0),
            f"write {offset}+{len(data)}",
        )

    def flush(self) -> None:
        self._ok(self.request(CMD_FLUSH), "flush")

    def trim(self, offset: int, length: int) -> None:
        self._ok(self.request(CMD_TRIM, offset, length), f"trim {offset}+{length}")

    def write_zeroes(self, offset: int, length: int, flags: int = 0) -> None:
        self._ok(self.request(CMD_WRITE_ZEROES, offset, length, flags=flags), f"write_zeroes {offset}+{length}")

    def cache(self, offset: int, length: int) -> None:
        self._ok(self.request(CMD_CACHE, offset, length), f"cache {offset}+{length}")

    def disconnect(self) -> None:
        """NBD_CMD_DISC: no reply; the server closes the connection."""
        try:
            self.send_request(CMD_DISC)
            self._pending.clear()
        except OSError:
            pass


def errno_name(e: int) -> str:
    return ERR_NAMES.get(e, errno.errorcode.get(e, str(e)))
