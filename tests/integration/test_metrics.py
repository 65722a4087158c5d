"""`serve --metrics` (issue 29, deliverable 4): the Prometheus endpoint on TCP and on a Unix
socket counts every request once, by kind, with bytes, latency and errors by errno; connections;
the export's cipher and CPU level; and it survives clients that misbehave on it."""
from __future__ import annotations

import os
import re
import socket
import stat
import time

import pytest

import nbd_client as nbd
from nbd_client import NBDClient

MiB = 1 << 20
SAMPLE = re.compile(r"^([a-z_]+)(\{[^}]*\})? (\S+)$")


def http_get(connect, path: str = "/metrics", raw: bytes | None = None, timeout: float = 10.0) -> tuple[int, str]:
    s = connect()
    s.settimeout(timeout)
    try:
        s.sendall(raw if raw is not None else f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def samples(text: str) -> dict[str, float]:
    """`name{labels}` -> value, for every sample line."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def tcp_endpoint(bridge) -> tuple:
    m = re.search(r"metrics at http://([0-9.]+):(\d+)/metrics", bridge.stderr())
    assert m, bridge.stderr()[-2000:]
    return m.group(1), int(m.group(2))


def op(name: str, kind: str) -> str:
    return f'{name}{{export="cryptbridge",op="{kind}"}}'


def test_every_request_is_counted_once_with_bytes_latency_and_errors(ws):
    key_file, _ = ws.key(64)
    bridge = ws.serve(ws.backing(16 * MiB), key_file, extra=("--metrics", "127.0.0.1:0", "--allow-discards"))
    host, port = tcp_endpoint(bridge)
    scrape = lambda: samples(http_get(lambda: socket.create_connection((host, port)))[1])  # noqa: E731
    with NBDClient(bridge.uri).connect() as c:
        for i in range(10):
            c.write(i * 4096, os.urandom(4096))
        for i in range(5):
            c.read(i * 8192, 8192)
        c.flush()
        c.trim(MiB, 64 * 1024)
        c.trim(2 * MiB, 4096)
        c.write_zeroes(3 * MiB, 65536)
        # Past the end: refused by the front end (EINVAL), counted as an error of a read.
        r = c.request(nbd.CMD_READ, 16 * MiB, 4096)
        assert r.error == nbd.NBD_EINVAL
        during = scrape()
    # The server learns of the client's close when it next reads the socket.
    deadline = time.monotonic() + 10
    while (after := scrape())['cryptbridge_connections{export="cryptbridge"}'] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    print("\n" + "\n".join(f"{k} {v:g}" for k, v in after.items() if v and "bucket" not in k))
    assert after[op("cryptbridge_requests_total", "write")] == 10
    assert after[op("cryptbridge_request_bytes_total", "write")] == 40960
    assert after[op("cryptbridge_requests_total", "read")] == 5
    assert after[op("cryptbridge_request_bytes_total", "read")] == 40960
    assert after[op("cryptbridge_requests_total", "flush")] == 1
    assert after[op("cryptbridge_requests_total", "trim")] == 2
    assert after[op("cryptbridge_request_bytes_total", "trim")] == 65536 + 4096
    assert after[op("cryptbridge_requests_total", "zero")] == 1
    assert after['cryptbridge_request_errors_total{export="cryptbridge",op="read",errno="EINVAL"}'] == 1
    # The histogram: +Inf equals the count, which equals the requests; the sum is plausible.
    for kind, n in (("write", 10), ("read", 5), ("flush", 1)):
        assert after[f'cryptbridge_request_duration_seconds_bucket{{export="cryptbridge",op="{kind}",le="+Inf"}}'] == n
        assert after[op("cryptbridge_request_duration_seconds_count", kind)] == n
        assert 0 < after[op("cryptbridge_request_duration_seconds_sum", kind)] < n * 5
    assert during['cryptbridge_connections{export="cryptbridge"}'] == 1
    assert after['cryptbridge_connections{export="cryptbridge"}'] == 0
    assert after['cryptbridge_connections_accepted_total{export="cryptbridge"}'] == 1
    assert after['cryptbridge_requests_in_flight{export="cryptbridge"}'] == 0
    info = [k for k in after if k.startswith("cryptbridge_info{")]
    assert len(info) == 1 and 'cipher="aes-xts-plain64"' in info[0] and 'backing="file"' in info[0], info
    level = re.search(r'cpu_level="([a-z0-9]+)"', info[0]).group(1)
    assert level in ("portable", "aesni", "vaes256", "vaes512", "armv8"), info[0]


def test_unix_socket_endpoint_is_owner_only_and_answers(ws):
    key_file, _ = ws.key(64)
    path = ws.sockdir / "metrics.sock"
    old = os.umask(0)
    try:
        bridge = ws.serve(ws.backing(16 * MiB), key_file, extra=("--metrics", str(path)))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

    def connect():
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(path))
        return s

    status, body = http_get(connect)
    assert status == 200 and "cryptbridge_requests_total" in body
    assert http_get(connect, "/other")[0] == 404
    assert http_get(connect, raw=b"POST /metrics HTTP/1.1\r\n\r\n")[0] == 405
    assert http_get(connect, raw=b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n")[0] == 431
    bridge.stop()
    assert not path.exists(), "the metrics socket is removed when the server stops"


def test_a_silent_client_holds_the_endpoint_for_its_deadline_only(ws):
    """A client that connects to the endpoint and sends nothing is dropped after 5 s; scrapes
    behind it are then answered, and NBD clients are never held."""
    key_file, _ = ws.key(64)
    bridge = ws.serve(ws.backing(16 * MiB), key_file, extra=("--metrics", "127.0.0.1:0"))
    host, port = tcp_endpoint(bridge)
    silent = socket.create_connection((host, port))
    try:
        t0 = time.monotonic()
        with NBDClient(bridge.uri).connect() as c:
            c.write(0, os.urandom(4096))
        assert time.monotonic() - t0 < 1.0
        status, body = http_get(lambda: socket.create_connection((host, port)), timeout=15)
        took = time.monotonic() - t0
        assert status == 200 and 'op="write"} 1' in body
        assert took < 8, f"scrape behind a silent client took {took:.1f} s"
        assert silent.recv(1) == b"", "the silent client is dropped"
    finally:
        silent.close()
    assert bridge.alive


def test_bad_metrics_address_is_a_clear_error(ws):
    key_file, _ = ws.key(64)
    with pytest.raises(Exception) as e:
        ws.serve(ws.backing(16 * MiB), key_file, extra=("--metrics", "no-such-host-or-port"))
    assert "--metrics" in str(e.value)


def test_contrib_dashboard_and_scrape_config_name_what_the_server_exports(ws):
    """contrib/grafana-dashboard.json queries only metrics the server exports, and
    contrib/prometheus.yml scrapes the /metrics path the server answers."""
    import json

    from conftest import REPO

    key_file, _ = ws.key(64)
    bridge = ws.serve(ws.backing(16 * MiB), key_file, extra=("--metrics", "127.0.0.1:0"))
    host, port = tcp_endpoint(bridge)
    body = http_get(lambda: socket.create_connection((host, port)))[1]
    families = set(re.findall(r"^# TYPE (\S+) ", body, re.M))
    dash = json.loads((REPO / "contrib" / "grafana-dashboard.json").read_text())
    used = set()
    for p in dash["panels"]:
        for t in p["targets"]:
            used |= set(re.findall(r"\b(cryptbridge_[a-z_]+)", t["expr"]))
    known = families | {f + "_bucket" for f in families}
    assert used and used <= known, f"the dashboard queries metrics the server lacks: {sorted(used - known)}"
    scrape = (REPO / "contrib" / "prometheus.yml").read_text()
    assert "job_name: cryptbridge" in scrape and "metrics_path" not in scrape  # the default, /metrics
