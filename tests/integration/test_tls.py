"""TLS on the wire (`serve --tls`, NBD_OPT_STARTTLS): real clients (libnbd's nbdinfo/nbdcopy, qemu-img,
Python's ssl module) with certificates made by `openssl`, refusals of plaintext and of bad client
certificates, and start-up checks of the certificate directory."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import ssl
import struct
import time
from pathlib import Path

import pytest

from conftest import cb, need_tool, run
import nbd_client as nbd

MiB = 1 << 20

OPENSSL_CA_CONF = """[ca]
default_ca = d
[d]
database = {dir}/index.txt
new_certs_dir = {dir}
serial = {dir}/serial
default_md = sha256
policy = p
copy_extensions = copy
[p]
commonName = supplied
"""


def openssl(*args, cwd: Path):
    return run(["openssl", *args], cwd=cwd, timeout=60, check=True)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}-key.pem", d / f"{name}-cert.pem"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-days", "365",
            "-keyout", key, "-out", cert, cwd=d)
    return key, cert


def make_cert(d: Path, ca: tuple[Path, Path], name: str, cn: str, ext: str, key_type=("rsa:2048",)) -> tuple[Path, Path]:
    """A certificate signed by `ca` (its key and cert), valid for a year from now."""
    key, csr, cert, extfile = d / f"{name}-key.pem", d / f"{name}.csr", d / f"{name}-cert.pem", d / f"{name}.ext"
    extfile.write_text(ext + "\n")
    openssl("req", "-new", "-newkey", *key_type, "-nodes", "-subj", f"/CN={cn}", "-keyout", key, "-out", csr, cwd=d)
    openssl("x509", "-req", "-in", csr, "-CA", ca[1], "-CAkey", ca[0], "-CAcreateserial", "-days", "365",
            "-extfile", extfile, "-out", cert, cwd=d)
    return key, cert


def make_cert_dated(d: Path, ca: tuple[Path, Path], name: str, cn: str, ext: str, start: str, end: str) -> tuple[Path, Path]:
    """A certificate with given validity dates (YYYYMMDDHHMMSSZ), by `openssl ca`, which (unlike
    OpenSSL 3.0's `x509`) takes them."""
    cadir = d / f"ca-{name}"
    cadir.mkdir()
    (cadir / "index.txt").write_text("")
    (cadir / "serial").write_text("1000\n")
    conf = cadir / "ca.cnf"
    conf.write_text(OPENSSL_CA_CONF.format(dir=cadir))
    key, csr, cert = d / f"{name}-key.pem", d / f"{name}.csr", d / f"{name}-cert.pem"
    extfile = d / f"{name}.ext"
    extfile.write_text(f"[e]\n{ext}\n")
    openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", key, "-out", csr, cwd=d)
    openssl("ca", "-batch", "-config", conf, "-cert", ca[1], "-keyfile", ca[0], "-in", csr, "-out", cert, "-notext",
            "-startdate", start, "-enddate", end, "-extfile", extfile, "-extensions", "e", cwd=d)
    return key, cert


SERVER_EXT = "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"
CLIENT_EXT = "extendedKeyUsage=clientAuth"


def cert_dir(base: Path, name: str, files: dict[str, Path]) -> Path:
    """A directory in the nbdkit/qemu layout holding copies of `files` (dest name -> source)."""
    d = base / name
    d.mkdir()
    for dest, src in files.items():
        shutil.copy(src, d / dest)
        if dest.endswith("key.pem"):
            os.chmod(d / dest, 0o600)
    return d


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Certificates for every case, made once: a CA, the server's, good/expired/foreign client
    certificates, and the client-side directories libnbd and qemu read (ca-cert.pem,
    client-cert.pem, client-key.pem)."""
    need_tool("openssl")
    base = tmp_path_factory.mktemp("pki")
    work = base / "work"
    work.mkdir()
    ca = make_ca(work, "ca")
    other_ca = make_ca(work, "other-ca")
    server = make_cert(work, ca, "server", "localhost", SERVER_EXT)
    client = make_cert(work, ca, "client", "client", CLIENT_EXT)
    foreign = make_cert(work, other_ca, "foreign", "client", CLIENT_EXT)
    expired = make_cert_dated(work, ca, "expired", "client", CLIENT_EXT, "20200101000000Z", "20210101000000Z")
    expired_server = make_cert_dated(work, ca, "expired-server", "localhost", SERVER_EXT.replace("\n", "\n"),
                                     "20200101000000Z", "20210101000000Z")
    ns = type("PKI", (), {})()
    ns.base = base
    ns.work = work
    ns.ca, ns.server, ns.client, ns.other_ca = ca, server, client, other_ca
    ns.server_dir = cert_dir(base, "server", {"ca-cert.pem": ca[1], "server-cert.pem": server[1], "server-key.pem": server[0]})
    ns.client_dir = cert_dir(base, "client", {"ca-cert.pem": ca[1], "client-cert.pem": client[1], "client-key.pem": client[0]})
    ns.anon_dir = cert_dir(base, "anon", {"ca-cert.pem": ca[1]})
    ns.foreign_dir = cert_dir(base, "foreign", {"ca-cert.pem": ca[1], "client-cert.pem": foreign[1], "client-key.pem": foreign[0]})
    ns.expired_dir = cert_dir(base, "expired", {"ca-cert.pem": ca[1], "client-cert.pem": expired[1], "client-key.pem": expired[0]})
    ns.expired_server_dir = cert_dir(base, "expired-server", {"server-cert.pem": expired_server[1], "server-key.pem": expired_server[0]})
    return ns


def tls_uri(b, certs: Path) -> str:
    assert b.uri.startswith("nbds://"), b.uri
    return f"{b.uri}?tls-certificates={certs}"


def serve_tls(ws, pki, mode="require", *, passthrough=True, key=None, verify_peer=False, size=16 * MiB, extra=()):
    backing = ws.backing(size, name=f"tls{len(ws.bridges)}.img")
    args = ["--tls", mode, "--tls-certificates", pki.server_dir, *(["--tls-verify-peer"] if verify_peer else []), *extra]
    if passthrough:
        return ws.serve(backing, passthrough=True, tcp=True, extra=tuple(args))
    return ws.serve(backing, key, tcp=True, extra=tuple(args))


def nbdinfo_json(uri: str):
    p = run(["nbdinfo", "--json", "--no-content", uri], timeout=30, check=True)
    return json.loads(p.stdout)


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def log_of(b) -> str:
    """The server's log without colour codes."""
    return ANSI.sub("", b.stderr())


def wait_for_log(b, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        err = log_of(b)
        if text in err:
            return err
        time.sleep(0.05)
    pytest.fail(f"server log lacks {text!r} after {timeout}s:\n{b.stderr()[-3000:]}")


# --- libnbd ------------------------------------------------------------------------------------


def test_nbdinfo_over_tls(ws, pki):
    need_tool("nbdinfo")
    b = serve_tls(ws, pki, "require")
    info = nbdinfo_json(tls_uri(b, pki.client_dir))
    assert info["TLS"] is True, info
    assert info["exports"][0]["export-size"] == 16 * MiB
    err = wait_for_log(b, "TLS established")
    assert "peer=127.0.0.1:" in err


def test_plaintext_client_refused_under_require(ws, pki):
    need_tool("nbdinfo")
    b = serve_tls(ws, pki, "require")
    plain = b.uri.replace("nbds://", "nbd://", 1)
    p = run(["nbdinfo", "--json", plain], timeout=30)
    assert p.returncode != 0, p.stdout
    err = wait_for_log(b, "TLS is required (--tls=require)")
    assert "peer=127.0.0.1:" in err, err
    # The refusal closed that client only: a TLS client is served next.
    assert nbdinfo_json(tls_uri(b, pki.client_dir))["TLS"] is True
    assert b.alive
