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
    ns_foreign = foreign = make_cert(work, other_ca, "foreign", "client", CLIENT_EXT)
    expired = make_cert_dated(work, ca, "expired", "client", CLIENT_EXT, "20200101000000Z", "20210101000000Z")
    expired_server = make_cert_dated(work, ca, "expired-server", "localhost", SERVER_EXT.replace("\n", "\n"),
                                     "20200101000000Z", "20210101000000Z")
    ns = type("PKI", (), {})()
    ns.base = base
    ns.work = work
    ns.ca, ns.server, ns.client, ns.other_ca, ns.foreign = ca, server, client, other_ca, ns_foreign
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


def xts_decrypt_disk(disk: bytes, key: bytes, sector_size: int) -> bytes:
    """dm-crypt plain aes-xts-plain64 decryption of `disk` (IVs in 512-byte units), by Python
    `cryptography` (OpenSSL's XTS), independently of the bridge."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    out = bytearray()
    for s in range(len(disk) // sector_size):
        tweak = (s * (sector_size // 512)).to_bytes(16, "little")
        d = Cipher(algorithms.AES(key), modes.XTS(tweak)).decryptor()
        out += d.update(disk[s * sector_size : (s + 1) * sector_size]) + d.finalize()
    return bytes(out)


def test_nbdcopy_roundtrip_over_tls_encrypts_on_disk(ws, pki):
    """Bytes written through nbds:// land XTS-encrypted (checked with Python's cryptography) and
    read back the same through TLS, with a verified client certificate."""
    need_tool("nbdcopy")
    size = 8 * MiB
    kf, key = ws.key(64)
    backing = ws.backing(size)
    b = ws.serve(backing, kf, sector_size=4096, tcp=True,
                 extra=("--tls", "require", "--tls-certificates", pki.server_dir, "--tls-verify-peer"))
    uri = tls_uri(b, pki.client_dir)
    src = ws.tmp / "src.img"
    plaintext = os.urandom(size)
    src.write_bytes(plaintext)
    run(["nbdcopy", "--flush", src, uri], timeout=120, check=True)
    disk = backing.read_bytes()
    assert disk != plaintext
    assert xts_decrypt_disk(disk, key, 4096) == plaintext
    dst = ws.tmp / "dst.img"
    run(["nbdcopy", uri, dst], timeout=120, check=True)
    assert dst.read_bytes() == plaintext
    # 1 MiB READs: under TLS each is decrypted piece by piece while it is sealed and sent.
    dst.unlink()
    run(["nbdcopy", "--request-size=1048576", uri, dst], timeout=120, check=True)
    assert dst.read_bytes() == plaintext
    err = log_of(b)
    assert "client certificate verified" in err, err[-2000:]


def test_nbdcopy_many_connections_and_requests_in_flight(ws, pki):
    """nbdcopy's default 4 connections x 64 requests in flight, 256 KiB requests: the reader and
    the reply writers share each TLS session."""
    need_tool("nbdcopy")
    size = 32 * MiB
    b = serve_tls(ws, pki, "on", size=size)
    uri = tls_uri(b, pki.client_dir)
    src = ws.tmp / "src.img"
    data = os.urandom(size)
    src.write_bytes(data)
    run(["nbdcopy", "--request-size=262144", "--flush", src, uri], timeout=180, check=True)
    dst = ws.tmp / "dst.img"
    run(["nbdcopy", "--request-size=4096", uri, dst], timeout=180, check=True)
    assert dst.read_bytes() == data


def test_tls_on_serves_plaintext_and_tls_clients(ws, pki):
    need_tool("nbdinfo")
    b = serve_tls(ws, pki, "on")
    assert nbdinfo_json(tls_uri(b, pki.client_dir))["TLS"] is True
    assert nbdinfo_json(b.uri.replace("nbds://", "nbd://", 1))["TLS"] is False


def test_qemu_img_over_tls(ws, pki):
    """qemu's own TLS client (tls-creds-x509): qemu-img info, then convert in and out; the disk
    checked against the XTS reference."""
    need_tool("qemu-img")
    size = 4 * MiB
    kf, key = ws.key(64)
    backing = ws.backing(size)
    b = ws.serve(backing, kf, sector_size=4096, tcp=True,
                 extra=("--tls", "require", "--tls-certificates", pki.server_dir, "--tls-verify-peer"))
    host, port = b.uri[len("nbds://"):].split(":")
    obj = f"tls-creds-x509,id=tls0,dir={pki.client_dir},endpoint=client"
    image = f"driver=nbd,host={host},port={port},tls-creds=tls0"
    p = run(["qemu-img", "info", "--object", obj, "--image-opts", image], timeout=60, check=True)
    assert str(size) in p.stdout.decode(), p.stdout
    src = ws.tmp / "src.img"
    data = os.urandom(size)
    src.write_bytes(data)
    run(["qemu-img", "convert", "-n", "--object", obj, "-f", "raw", src, "--target-image-opts", image],
        timeout=120, check=True)
    assert xts_decrypt_disk(backing.read_bytes(), key, 4096) == data
    dst = ws.tmp / "dst.img"
    run(["qemu-img", "convert", "--object", obj, "--image-opts", image, "-O", "raw", dst], timeout=120, check=True)
    assert dst.read_bytes() == data


# --- refusals ----------------------------------------------------------------------------------


# GnuTLS (libnbd) sends a certificate only when its issuer is among the CAs the server names, so
# the other CA's certificate stays home: the server sees none.
@pytest.mark.parametrize("client,reason", [
    ("anon_dir", "peer sent no certificates"),
    ("foreign_dir", "peer sent no certificates"),
    ("expired_dir", "invalid peer certificate: certificate expired"),
], ids=["no-client-cert", "other-ca", "expired-client-cert"])
def test_verify_peer_refuses_bad_client_certificates(ws, pki, client, reason):
    need_tool("nbdinfo")
    b = serve_tls(ws, pki, "require", verify_peer=True)
    p = run(["nbdinfo", "--json", tls_uri(b, getattr(pki, client))], timeout=30)
    assert p.returncode != 0, p.stdout
    err = wait_for_log(b, "TLS handshake failed")
    line = next(l for l in err.splitlines() if "TLS handshake failed" in l)
    assert "peer=127.0.0.1:" in line and reason in line, line
    # Only that connection closed: a good client is served next.
    assert nbdinfo_json(tls_uri(b, pki.client_dir))["TLS"] is True
    assert b.alive


def test_verify_peer_refuses_certificate_of_another_ca(ws, pki):
    """OpenSSL (Python's ssl) sends its certificate whatever CAs the server names: the server
    checks it and refuses it."""
    b = serve_tls(ws, pki, "require", verify_peer=True)
    with raw_client(b) as c:
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            starttls(c, pki, cert=pki.foreign)
            c.opt_list()
    err = wait_for_log(b, "TLS handshake failed")
    assert "UnknownIssuer" in err, err[-2000:]
    assert b.alive


def write_crl(ca: tuple[Path, Path], revoked: list[Path], dest: Path) -> None:
    """A CRL signed by `ca` (its key and cert) listing the serial numbers of `revoked`, written
    with pyca `cryptography` (not the code under test)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    ca_key = serialization.load_pem_private_key(ca[0].read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(ca[1].read_bytes())
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now)
        .next_update(now + datetime.timedelta(days=30))
        .add_extension(x509.CRLNumber(1), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    for cert in revoked:
        serial = x509.load_pem_x509_certificate(cert.read_bytes()).serial_number
        b = b.add_revoked_certificate(x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build())
    dest.write_bytes(b.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))


def test_verify_peer_refuses_revoked_client_certificates(ws, pki, tmp_path):
    """ca-crl.pem in --tls-certificates (qemu's and GnuTLS's name): a client certificate it
    revokes is refused with a log line that says so; one it does not list is served."""
    need_tool("nbdinfo")
    revoked = make_cert(pki.work, pki.ca, "revoked", "client", CLIENT_EXT)
    revoked_dir = cert_dir(tmp_path, "revoked", {"ca-cert.pem": pki.ca[1], "client-cert.pem": revoked[1], "client-key.pem": revoked[0]})
    server_dir = cert_dir(tmp_path, "server", {"ca-cert.pem": pki.ca[1], "server-cert.pem": pki.server[1], "server-key.pem": pki.server[0]})
    write_crl(pki.ca, [revoked[1]], server_dir / "ca-crl.pem")
    backing = ws.backing(16 * MiB, name="crl.img")
    b = ws.serve(backing, passthrough=True, tcp=True, extra=("--tls", "require", "--tls-certificates", server_dir, "--tls-verify-peer"))
    p = run(["nbdinfo", "--json", tls_uri(b, revoked_dir)], timeout=30)
    assert p.returncode != 0, p.stdout
    err = wait_for_log(b, "TLS handshake failed")
    line = next(l for l in err.splitlines() if "TLS handshake failed" in l)
    assert "revoked" in line.lower(), line
    assert nbdinfo_json(tls_uri(b, pki.client_dir))["TLS"] is True
    assert b.alive


def test_unreadable_crl_is_a_startup_error(ws, pki, tmp_path):
    bad = cert_dir(tmp_path, "bad-crl", {"ca-cert.pem": pki.ca[1], "server-cert.pem": pki.server[1], "server-key.pem": pki.server[0]})
    (bad / "ca-crl.pem").write_text("not a CRL\n")
    assert "ca-crl.pem" in startup_error(ws, bad, "--tls-verify-peer")


def test_expired_server_certificate_refused_at_start(ws, pki):
    """An expired server certificate stops the start, before listening."""
    backing = ws.backing(MiB)
    p = cb("serve", "--backing", backing, "--passthrough", "--listen", "127.0.0.1:0", "--tls", "on",
           "--tls-certificates", pki.expired_server_dir, timeout=30)
    err = p.stderr.decode()
    assert p.returncode == 1, err
    assert "expired on 2021-01-01 00:00:00 UTC" in err, err
    assert p.stdout == b"", "no ready line"


def startup_error(ws, certs: Path, *more) -> str:
    backing = ws.backing(MiB, name="startup.img")
    p = cb("serve", "--backing", backing, "--passthrough", "--listen", "127.0.0.1:0", "--tls", "require",
           "--tls-certificates", certs, *more, timeout=30)
    err = ANSI.sub("", p.stderr.decode())
    assert p.returncode == 1, (p.returncode, err)
    assert p.stdout == b"", "no ready line"
    assert "panicked" not in err
    return err


def test_startup_errors_name_the_file(ws, pki, tmp_path):
    missing = tmp_path / "nothing"
    assert "server-cert.pem: No such file" in startup_error(ws, missing)

    no_key = cert_dir(tmp_path, "no-key", {"server-cert.pem": pki.server[1]})
    assert "cannot read " + str(no_key / "server-key.pem") in startup_error(ws, no_key)

    wrong_key = cert_dir(tmp_path, "wrong-key", {"server-cert.pem": pki.server[1], "server-key.pem": pki.client[0]})
    assert "does not belong to the certificate" in startup_error(ws, wrong_key)

    garbage = cert_dir(tmp_path, "garbage", {"server-cert.pem": pki.server[1], "server-key.pem": pki.server[1]})
    assert "no private key" in startup_error(ws, garbage)

    enc = tmp_path / "enc"
    enc.mkdir()
    shutil.copy(pki.server[1], enc / "server-cert.pem")
    openssl("pkey", "-in", pki.server[0], "-aes256", "-passout", "pass:secret", "-out", enc / "server-key.pem", cwd=tmp_path)
    assert "encrypted" in startup_error(ws, enc)

    no_ca = cert_dir(tmp_path, "no-ca", {"server-cert.pem": pki.server[1], "server-key.pem": pki.server[0]})
    assert "ca-cert.pem: No such file" in startup_error(ws, no_ca, "--tls-verify-peer")

    unreadable = cert_dir(tmp_path, "unreadable", {"server-cert.pem": pki.server[1], "server-key.pem": pki.server[0]})
    (unreadable / "server-key.pem").write_bytes(b"")
    assert "no private key" in startup_error(ws, unreadable)


def test_usage_errors(ws, pki):
    backing = ws.backing(MiB)
    p = cb("serve", "--backing", backing, "--passthrough", "--tls", "require", timeout=30)
    assert p.returncode == 2 and b"--tls-certificates" in p.stderr, p.stderr
    p = cb("serve", "--backing", backing, "--passthrough", "--tls-certificates", pki.server_dir, timeout=30)
    assert p.returncode == 2 and b"need --tls on or --tls require" in p.stderr, p.stderr
    p = cb("serve", "--backing", backing, "--passthrough", "--tls", "maybe", "--tls-certificates", pki.server_dir, timeout=30)
    assert p.returncode == 2, p.stderr


# --- the protocol, from a raw client (Python's ssl for the TLS part) ------------------------------


def raw_client(b) -> nbd.NBDClient:
    c = nbd.NBDClient(b.uri.replace("nbds://", "nbd://", 1))
    c.handshake()
    return c


def starttls(c: nbd.NBDClient, pki, cert=None) -> None:
    """STARTTLS, then the TLS handshake with `cert` (key, cert; default: the good client's)."""
    c.send_option(nbd.OPT_STARTTLS)
    r = c.recv_opt_reply()
    assert (r.option, r.type) == (nbd.OPT_STARTTLS, nbd.REP_ACK), r
    ctx = ssl.create_default_context(cafile=str(pki.ca[1]))
    key, crt = cert or pki.client
    ctx.load_cert_chain(str(crt), str(key))
    c.sock = ctx.wrap_socket(c.sock, server_hostname="localhost")


def test_require_refuses_options_before_starttls(ws, pki):
    b = serve_tls(ws, pki, "require")
    with raw_client(b) as c:
        for opt, data in [(nbd.OPT_LIST, b""), (nbd.OPT_INFO, struct.pack(">IH", 0, 0)), (nbd.OPT_GO, struct.pack(">IH", 0, 0)), (99, b"xyz")]:
            c.send_option(opt, data)
            r = c.recv_opt_reply()
            assert (r.option, r.type) == (opt, nbd.REP_ERR_TLS_REQD), r
        # STARTTLS with data is malformed; the connection goes on.
        c.send_option(nbd.OPT_STARTTLS, b"x")
        assert c.recv_opt_reply().type == nbd.REP_ERR_INVALID
        starttls(c, pki)
        assert c.opt_list() == ["cryptbridge"]
        # A second STARTTLS inside TLS is an error, not a second handshake.
        c.send_option(nbd.OPT_STARTTLS)
        r = c.recv_opt_reply()
        assert (r.option, r.type) == (nbd.OPT_STARTTLS, nbd.REP_ERR_INVALID), r
        c.opt_go()
        payload = os.urandom(3 * 4096 + 17)
        c.write(4096 + 5, payload)
        assert c.read(4096 + 5, len(payload)) == payload
        c.disconnect()


def test_require_closes_on_export_name_before_tls(ws, pki):
    b = serve_tls(ws, pki, "require")
    with raw_client(b) as c:
        c.send_option(nbd.OPT_EXPORT_NAME, b"")
        assert c.is_closed_by_peer(timeout=10)
    wait_for_log(b, "NBD_OPT_EXPORT_NAME, but TLS is required")


def test_starttls_refused_without_tls(ws):
    backing = ws.backing(MiB)
    b = ws.serve(backing, passthrough=True, tcp=True)
    with nbd.NBDClient(b.uri) as c:
        c.handshake()
        c.send_option(nbd.OPT_STARTTLS)
        r = c.recv_opt_reply()
        assert (r.option, r.type) == (nbd.OPT_STARTTLS, nbd.REP_ERR_UNSUP), r
        assert c.opt_list() == ["cryptbridge"]


def test_tls_handshake_bounded_by_handshake_limit(ws, pki):
    """A client that sends STARTTLS and then nothing (or trickles a ClientHello) is cut at the
    handshake deadline; others are served meanwhile."""
    b = serve_tls(ws, pki, "require", extra=("--handshake-limit", "2"))
    with raw_client(b) as c:
        c.send_option(nbd.OPT_STARTTLS)
        assert c.recv_opt_reply().type == nbd.REP_ACK
        t0 = time.monotonic()
        c.sock.sendall(b"\x16\x03\x01")  # the start of a TLS record, then silence
        assert nbdinfo_json(tls_uri(b, pki.client_dir))["TLS"] is True
        assert c.is_closed_by_peer(timeout=10)
        assert 1.0 < time.monotonic() - t0 < 8.0
    err = wait_for_log(b, "TLS handshake failed")
    assert "handshake not finished within" in err, err[-2000:]


def test_plaintext_bytes_after_starttls_fail_the_handshake(ws, pki):
    """A client that acknowledges STARTTLS but goes on in plaintext gets a TLS alert and is closed."""
    b = serve_tls(ws, pki, "on")
    with raw_client(b) as c:
        c.send_option(nbd.OPT_STARTTLS)
        assert c.recv_opt_reply().type == nbd.REP_ACK
        c.send_option(nbd.OPT_LIST)
        data = c.sock.recv(100)
        assert data[:1] in (b"\x15", b""), data  # an alert record, or the close
        assert c.is_closed_by_peer(timeout=10)
    wait_for_log(b, "TLS handshake failed")
    assert b.alive


def test_transmission_over_tls_pipelined_requests(ws, pki):
    """Many requests in flight on one TLS connection, from Python's ssl: each reply matches."""
    size = 8 * MiB
    b = serve_tls(ws, pki, "require", size=size)
    with raw_client(b) as c:
        starttls(c, pki)
        c.opt_go()
        data = os.urandom(size)
        for off in range(0, size, 1 * MiB):
            c.write(off, data[off : off + MiB])
        c.flush()
        # Pipelined small and large reads, sent before any reply is read.
        import random
        rng = random.Random(7)
        reqs = [(rng.randrange(0, size - 70000), rng.choice([1, 512, 4096, 65536])) for _ in range(200)]
        handles = [c.send_request(nbd.CMD_READ, off, ln) for off, ln in reqs]
        got = {}
        for _ in reqs:
            r = c.recv_reply()
            got[r.handle] = r
        for h, (off, ln) in zip(handles, reqs):
            assert got[h].error == 0
            assert got[h].data == data[off : off + ln], (off, ln)
        c.disconnect()


def test_nbdinfo_map_over_tls(ws, pki):
    """Structured replies and block status (nbdinfo --map) inside TLS."""
    need_tool("nbdinfo")
    b = serve_tls(ws, pki, "require")
    p = run(["nbdinfo", "--map", tls_uri(b, pki.client_dir)], timeout=30, check=True)
    assert p.stdout.strip(), p.stderr


def test_options_negotiated_before_starttls_are_forgotten(ws, pki):
    """What a client negotiated in plaintext (structured replies) does not carry into TLS: a
    metadata context then needs NBD_OPT_STRUCTURED_REPLY again."""
    b = serve_tls(ws, pki, "on")
    with raw_client(b) as c:
        c.send_option(nbd.OPT_STRUCTURED_REPLY)
        assert c.recv_opt_reply().type == nbd.REP_ACK
        starttls(c, pki)
        query = b"base:allocation"
        data = struct.pack(">I", 0) + struct.pack(">I", 1) + struct.pack(">I", len(query)) + query
        c.send_option(nbd.OPT_SET_META_CONTEXT, data)
        assert c.recv_opt_reply().type == nbd.REP_ERR_INVALID
        c.send_option(nbd.OPT_STRUCTURED_REPLY)
        assert c.recv_opt_reply().type == nbd.REP_ACK
        c.send_option(nbd.OPT_SET_META_CONTEXT, data)
        replies = [c.recv_opt_reply()]
        while replies[-1].type != nbd.REP_ACK:
            assert not replies[-1].type & nbd.REP_ERR, replies[-1]
            replies.append(c.recv_opt_reply())
        assert any(r.type == nbd.REP_META_CONTEXT for r in replies)


def test_tls_over_unix_socket(ws, pki):
    """nbds+unix:// (libnbd checks the certificate against "localhost" there)."""
    need_tool("nbdinfo")
    b = ws.serve(ws.backing(MiB), passthrough=True,
                 extra=("--tls", "require", "--tls-certificates", pki.server_dir))
    assert b.uri.startswith("nbds+unix:///?socket="), b.uri
    info = nbdinfo_json(f"{b.uri}&tls-certificates={pki.client_dir}")
    assert info["TLS"] is True and info["exports"][0]["export-size"] == MiB
