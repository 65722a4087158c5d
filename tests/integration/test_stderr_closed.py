"""SIGTERM stops `serve` even when its stderr has gone away (`serve 2>&1 | head`, a log reader that
died): a log line that cannot be written must not take the signal handler down with it."""
from __future__ import annotations

import signal
import subprocess

from conftest import MiB, require_binary


def test_sigterm_stops_serve_whose_stderr_reader_is_gone(ws):
    backing = ws.backing(8 * MiB)
    key, _ = ws.key(64)
    p = subprocess.Popen([str(require_binary()), "serve", "--backing", str(backing), "--key-file", str(key), "--unix", str(ws.sockdir / "s.sock")],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        assert p.stdout.readline().startswith(b"ready "), "no ready line"
        p.stderr.close()  # the pipe's reader is gone: writes to stderr now fail with EPIPE
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
