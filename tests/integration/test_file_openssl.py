"""`cryptbridge file encrypt|decrypt`: OpenSSL `enc` interop in both directions for CTR/CBC/ECB
over every size class, the chunked GCM format (decoded here independently from
docs/file-format.md), tamper/truncate/reorder/swap detection, and the no-partial-OUT rule."""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
from pathlib import Path

import pytest

from conftest import assert_no_panic, cb, need_tool, run, write_key

SIZES = [0, 1, 15, 16, 17, 4096, (1 << 20) + 3]
ITER = "1000"  # keep the suite fast; PBKDF2 is tested at the defaults below
OSSL_MODES = ["ctr", "cbc", "ecb"]


def payload(n: int) -> bytes:
    # Mixed content: a random part and a repetitive part (ECB would show the latter).
    r = os.urandom(n // 2)
    return r + (b"0123456789abcdef" * (n // 32 + 1))[: n - len(r)]


def passfile(tmp: Path, text: bytes = b"pa ss w\xc3\xb6rd\n") -> Path:
    p = tmp / "pass"
    p.write_bytes(text)
    return p


def ours(*args, check=True, input=None, timeout=60):
    p = cb("file", *args, timeout=timeout, input=input)
    err = p.stderr.decode(errors="replace")
    assert_no_panic(err)
    if check:
        assert p.returncode == 0, f"cryptbridge file {' '.join(map(str, args))} failed: {err}"
    return p


def ecb_flag(mode: str) -> list:
    return ["--insecure-ecb"] if mode == "ecb" else []


def leftovers(d: Path) -> list:
    return sorted(p.name for p in d.iterdir() if "cryptbridge-tmp" in p.name)


# ---- OpenSSL interop ------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", OSSL_MODES)
def test_openssl_decrypts_ours_and_we_decrypt_openssl(tmp_path, mode, size):
    need_tool("openssl")
    pw = passfile(tmp_path)
    plain = tmp_path / "plain"
    plain.write_bytes(payload(size))
    cipher = f"aes-256-{mode}"

    # ours -> openssl enc -d
    ours("encrypt", "--cipher", cipher, *ecb_flag(mode), "--pass-file", pw, "--iter", ITER, plain, tmp_path / "ours.enc")
    data = (tmp_path / "ours.enc").read_bytes()
    assert data[:8] == b"Salted__"
    p = run(["openssl", "enc", "-d", f"-{cipher}", "-pbkdf2", "-iter", ITER, "-pass", f"file:{pw}",
             "-in", tmp_path / "ours.enc", "-out", tmp_path / "ours.dec"], timeout=60)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "ours.dec").read_bytes() == plain.read_bytes()

    # openssl enc -> ours
    p = run(["openssl", "enc", f"-{cipher}", "-pbkdf2", "-iter", ITER, "-pass", f"file:{pw}",
             "-in", plain, "-out", tmp_path / "ossl.enc"], timeout=60)
    assert p.returncode == 0, p.stderr
    ours("decrypt", "--cipher", cipher, *ecb_flag(mode), "--pass-file", pw, "--iter", ITER,
         tmp_path / "ossl.enc", tmp_path / "ossl.dec")
    assert (tmp_path / "ossl.dec").read_bytes() == plain.read_bytes()
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("mode", OSSL_MODES)
def test_openssl_default_iterations(tmp_path, mode):
    """Without --iter both sides use OpenSSL's default (10000)."""
    need_tool("openssl")
    pw = passfile(tmp_path)
    plain = tmp_path / "plain"
    plain.write_bytes(payload(5000))
    cipher = f"aes-256-{mode}"
    ours("encrypt", "--cipher", cipher, *ecb_flag(mode), "--pass-file", pw, plain, tmp_path / "c")
    p = run(["openssl", "enc", "-d", f"-{cipher}", "-pbkdf2", "-pass", f"file:{pw}", "-in", tmp_path / "c"], timeout=60)
    assert p.returncode == 0 and p.stdout == plain.read_bytes(), p.stderr


@pytest.mark.parametrize("mode", OSSL_MODES)
def test_openssl_raw_key_file(tmp_path, mode):
    """--key-file: CTR/CBC files are IV ‖ `openssl enc -nosalt -K -iv` output; ECB is bare."""
    need_tool("openssl")
    key = os.urandom(32)
    kf = write_key(tmp_path / "k", key)
    plain = payload(70000)
    (tmp_path / "p").write_bytes(plain)
    cipher = f"aes-256-{mode}"
    ours("encrypt", "--cipher", cipher, *ecb_flag(mode), "--key-file", kf, tmp_path / "p", tmp_path / "c")
    data = (tmp_path / "c").read_bytes()
    ivlen = 0 if mode == "ecb" else 16
    (tmp_path / "body").write_bytes(data[ivlen:])
    args = ["openssl", "enc", "-d", f"-{cipher}", "-nosalt", "-K", key.hex(), "-in", tmp_path / "body"]
    if ivlen:
        args += ["-iv", data[:ivlen].hex()]
    p = run(args, timeout=60)
    assert p.returncode == 0 and p.stdout == plain, p.stderr


def test_passphrase_file_first_line_only(tmp_path):
    """Only the first line counts, as with `openssl -pass file:`."""
    need_tool("openssl")
    pw = passfile(tmp_path, b"first line\nsecond line\n")
    plain = tmp_path / "p"
    plain.write_bytes(b"hello openssl\n")
    ours("encrypt", "--cipher", "aes-256-cbc", "--pass-file", pw, "--iter", ITER, plain, tmp_path / "c")
    p = run(["openssl", "enc", "-d", "-aes-256-cbc", "-pbkdf2", "-iter", ITER, "-pass", "pass:first line",
             "-in", tmp_path / "c"], timeout=60)
    assert p.returncode == 0 and p.stdout == b"hello openssl\n", p.stderr


def test_stdin_stdout(tmp_path):
    need_tool("openssl")
    pw = passfile(tmp_path)
    plain = payload(300_001)
    p = ours("encrypt", "--cipher", "aes-256-ctr", "--pass-file", pw, "--iter", ITER, "-", "-", input=plain)
    p2 = run(["openssl", "enc", "-d", "-aes-256-ctr", "-pbkdf2", "-iter", ITER, "-pass", f"file:{pw}"],
             input=p.stdout, timeout=60)
    assert p2.returncode == 0 and p2.stdout == plain
    for mode in ["gcm", "cbc"]:
        enc = ours("encrypt", "--cipher", f"aes-256-{mode}", "--pass-file", pw, "--iter", ITER, "-", "-", input=plain)
        dec = ours("decrypt", "--cipher", f"aes-256-{mode}", "--pass-file", pw, "--iter", ITER, "-", "-", input=enc.stdout)
        assert dec.stdout == plain


# ---- GCM --------------------------------------------------------------------------------------

def spec_decode(file: bytes, secret: bytes, is_key: bool) -> bytes:
    """Decoder written from docs/file-format.md alone (pyca/cryptography for AES-GCM)."""
    AESGCM = pytest.importorskip("cryptography.hazmat.primitives.ciphers.aead").AESGCM
    hdr = file[:48]
    magic, version, kdf_id, iters, cs = struct.unpack(">6sBBII", hdr[:16])
    assert (magic, version) == (b"CBFGCM", 1)
    salt, check = hdr[16:32], hdr[32:48]
    if kdf_id == 1:
        assert not is_key
        prk = hashlib.pbkdf2_hmac("sha256", secret, salt, iters, 32)
    else:
        assert kdf_id == 2 and is_key and iters == 0
        prk = hmac.new(salt, secret, hashlib.sha256).digest()
    key = hmac.new(prk, b"cryptbridge file v1 aes-256-gcm key\x01", hashlib.sha256).digest()
    assert hmac.new(prk, b"cryptbridge file v1 key check\x01", hashlib.sha256).digest()[:16] == check
    rec = cs + 28
    body = file[48:]
    n = max(1, -(-len(body) // rec))
    out = b""
    for i in range(n):
        r = body[i * rec:(i + 1) * rec]
        last = i == n - 1
        nonce = struct.pack(">Q", i) + b"\x00\x00\x00" + (b"\x01" if last else b"\x00")
        assert r[:12] == nonce
        out += AESGCM(key).decrypt(nonce, r[12:], hdr)
    return out


def spec_encode(plain: bytes, secret: bytes, is_key: bool, chunk: int, iters: int = 1000) -> bytes:
    """Encoder written from docs/file-format.md alone (pyca/cryptography for AES-GCM)."""
    AESGCM = pytest.importorskip("cryptography.hazmat.primitives.ciphers.aead").AESGCM
    salt = os.urandom(16)
    if is_key:
        kdf_id, iters = 2, 0
        prk = hmac.new(salt, secret, hashlib.sha256).digest()
    else:
        kdf_id = 1
        prk = hashlib.pbkdf2_hmac("sha256", secret, salt, iters, 32)
    key = hmac.new(prk, b"cryptbridge file v1 aes-256-gcm key\x01", hashlib.sha256).digest()
    check = hmac.new(prk, b"cryptbridge file v1 key check\x01", hashlib.sha256).digest()[:16]
    hdr = struct.pack(">6sBBII", b"CBFGCM", 1, kdf_id, iters, chunk) + salt + check
    pieces = [plain[i:i + chunk] for i in range(0, len(plain), chunk)] or [b""]
    out = [hdr]
    for i, piece in enumerate(pieces):
        nonce = struct.pack(">Q", i) + b"\x00\x00\x00" + (b"\x01" if i == len(pieces) - 1 else b"\x00")
        out.append(nonce + AESGCM(key).encrypt(nonce, piece, hdr))  # ciphertext || tag
    return b"".join(out)


@pytest.mark.parametrize("size", [0, 17, 4096, 5 * 4096 + 100, (1 << 20) + 3, (3 << 20) + 5])
def test_gcm_we_decrypt_independent_encoder(tmp_path, size):
    """Files made by the spec encoder above (not by us) decrypt with both secrets, through the
    single-thread path (<= 2 chunks) and the pipeline (more chunks, default 1 MiB chunks and
    4 KiB chunks, 1 and 2 workers); a flipped bit in the Python-made file is rejected."""
    pw = passfile(tmp_path)
    key = os.urandom(32)
    kf = write_key(tmp_path / "k", key)
    plain = payload(size)
    for chunk in (4096, 1 << 20):
        for secret, is_key, arg in ((b"pa ss w\xc3\xb6rd", False, ["--pass-file", pw]), (key, True, ["--key-file", kf])):
            (tmp_path / "c").write_bytes(spec_encode(plain, secret, is_key, chunk))
            for threads in ("1", "2"):
                (tmp_path / "d").unlink(missing_ok=True)
                ours("decrypt", *arg, "--threads", threads, tmp_path / "c", tmp_path / "d")
                assert (tmp_path / "d").read_bytes() == plain
    if size:
        bad = bytearray(spec_encode(plain, key, True, 4096))
        bad[-1] ^= 0x01  # in the last tag
        (tmp_path / "bad").write_bytes(bytes(bad))
        p = ours("decrypt", "--key-file", kf, tmp_path / "bad", tmp_path / "bad-out", check=False)
        assert p.returncode == 1 and "failed authentication" in p.stderr.decode(), p.stderr
        assert not (tmp_path / "bad-out").exists()


@pytest.mark.parametrize("size", SIZES)
def test_gcm_round_trip_and_spec(tmp_path, size):
    pw = passfile(tmp_path)
    plain = payload(size)
    (tmp_path / "p").write_bytes(plain)
    ours("encrypt", "--pass-file", pw, "--iter", ITER, "--chunk-size", "64K", tmp_path / "p", tmp_path / "c")
    data = (tmp_path / "c").read_bytes()
    assert len(data) == 48 + size + 28 * max(1, -(-size // 65536))
    if size in (0, 17, (1 << 20) + 3):
        assert spec_decode(data, b"pa ss w\xc3\xb6rd", False) == plain
    ours("decrypt", "--pass-file", pw, tmp_path / "c", tmp_path / "d")
    assert (tmp_path / "d").read_bytes() == plain


def test_gcm_raw_key_and_default_iterations(tmp_path):
    key = os.urandom(32)
    kf = write_key(tmp_path / "k", key)
    plain = payload(100_000)
    (tmp_path / "p").write_bytes(plain)
    ours("encrypt", "--key-file", kf, tmp_path / "p", tmp_path / "c")
    assert spec_decode((tmp_path / "c").read_bytes(), key, True) == plain
    pw = passfile(tmp_path)
    ours("encrypt", "--pass-file", pw, tmp_path / "p", tmp_path / "c2")
    hdr = (tmp_path / "c2").read_bytes()[:16]
    assert struct.unpack(">I", hdr[8:12])[0] == 600_000
    ours("decrypt", "--pass-file", pw, tmp_path / "c2", tmp_path / "d")
    assert (tmp_path / "d").read_bytes() == plain


CS = 4096
REC = CS + 28


@pytest.fixture
def gcm_file(tmp_path):
    pw = passfile(tmp_path)
    plain = payload(5 * CS + 100)
    (tmp_path / "p").write_bytes(plain)
    ours("encrypt", "--pass-file", pw, "--iter", ITER, "--chunk-size", str(CS), tmp_path / "p", tmp_path / "c")
    data = (tmp_path / "c").read_bytes()
    assert len(data) == 48 + 5 * REC + 100 + 28
    return pw, plain, data


def chunks(data: bytes) -> list:
    body = data[48:]
    return [body[i:i + REC] for i in range(0, len(body), REC)]


def expect_failure(tmp_path, pw, data: bytes, *needles: str, out_name="out"):
    (tmp_path / "bad").write_bytes(data)
    out = tmp_path / out_name
    p = ours("decrypt", "--pass-file", pw, tmp_path / "bad", out, check=False)
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 1, f"rc={p.returncode} {err}"
    for n in needles:
        assert n in err, f"expected {n!r} in: {err}"
    assert not out.exists(), "partial OUT left behind"
    assert leftovers(tmp_path) == []
    return err


def test_gcm_tamper_detected(tmp_path, gcm_file):
    pw, _, data = gcm_file
    for pos in [0, 7, 20, 40, 48, 48 + 12, 48 + 2 * REC + 500, 48 + 3 * REC - 1, len(data) - 1]:
        bad = bytearray(data)
        bad[pos] ^= 0x10
        expect_failure(tmp_path, pw, bytes(bad), "error")
    bad = bytearray(data)
    bad[48 + 3 * REC + 100] ^= 1
    expect_failure(tmp_path, pw, bytes(bad), "chunk 3 failed authentication")


def test_gcm_truncation_detected(tmp_path, gcm_file):
    pw, _, data = gcm_file
    expect_failure(tmp_path, pw, data[:48 + 5 * REC], "truncated", "chunk 4")
    expect_failure(tmp_path, pw, data[:48 + 2 * REC + 1000], "truncated")
    expect_failure(tmp_path, pw, data[:-1])
    expect_failure(tmp_path, pw, data[:48], "truncated")
    expect_failure(tmp_path, pw, data[:30], "truncated")
    expect_failure(tmp_path, pw, b"", "truncated")


def test_gcm_reorder_and_drop_detected(tmp_path, gcm_file):
    pw, _, data = gcm_file
    c = chunks(data)
    expect_failure(tmp_path, pw, data[:48] + c[0] + c[2] + c[1] + b"".join(c[3:]), "chunk 2 found where chunk 1 belongs")
    expect_failure(tmp_path, pw, data[:48] + c[0] + c[1] + b"".join(c[3:]), "chunk 3 found where chunk 2 belongs")
    expect_failure(tmp_path, pw, data + c[2], "data after the final chunk")


def test_gcm_swap_from_other_file_detected(tmp_path, gcm_file):
    pw, plain, data = gcm_file
    # Same passphrase, same plaintext, encrypted again: a different salt, so a different key.
    ours("encrypt", "--pass-file", pw, "--iter", ITER, "--chunk-size", str(CS), tmp_path / "p", tmp_path / "c2")
    other = (tmp_path / "c2").read_bytes()
    c, o = chunks(data), chunks(other)
    expect_failure(tmp_path, pw, data[:48] + c[0] + o[1] + b"".join(c[2:]), "chunk 1 failed authentication")
    expect_failure(tmp_path, pw, other[:48] + b"".join(c), "chunk 0 failed authentication")


def test_gcm_wrong_passphrase(tmp_path, gcm_file):
    _, _, data = gcm_file
    wrong = tmp_path / "wrong"
    wrong.write_bytes(b"not the passphrase\n")
    expect_failure(tmp_path, wrong, data, "wrong passphrase or key")


def test_gcm_stdout_only_authenticated_chunks(tmp_path, gcm_file):
    pw, plain, data = gcm_file
    bad = bytearray(data)
    bad[48 + 2 * REC + 20] ^= 1
    p = ours("decrypt", "--pass-file", pw, "-", "-", input=bytes(bad), check=False)
    assert p.returncode == 1
    assert p.stdout == plain[:2 * CS], "only chunks 0 and 1 (authenticated) may reach stdout"


@pytest.mark.parametrize("bad_chunk", [1, 2, 4])
def test_gcm_stdout_every_chunk_before_the_bad_one_many_workers(tmp_path, gcm_file, bad_chunk):
    """More workers than cores: chunks finish out of order, and a bad chunk's failure often
    reaches the writer before the chunks in front of it are done. Each of those must still reach
    stdout (before the fix, 7 runs in 300 with --threads 8 left stdout short by one or two chunks)."""
    pw, plain, data = gcm_file
    bad = bytearray(data)
    bad[48 + bad_chunk * REC + 20] ^= 1
    for _ in range(25):
        p = ours("decrypt", "--threads", "8", "--pass-file", pw, "-", "-", input=bytes(bad), check=False)
        assert p.returncode == 1 and f"chunk {bad_chunk} failed authentication" in p.stderr.decode(), p.stderr
        assert len(p.stdout) == bad_chunk * CS and p.stdout == plain[:bad_chunk * CS]


# ---- no partial OUT, usage errors -------------------------------------------------------------

def test_no_partial_out_openssl_modes(tmp_path):
    pw = passfile(tmp_path)
    plain = payload(200_000)
    (tmp_path / "p").write_bytes(plain)
    ours("encrypt", "--cipher", "aes-256-cbc", "--pass-file", pw, "--iter", ITER, tmp_path / "p", tmp_path / "c")
    data = (tmp_path / "c").read_bytes()
    for bad, needle in [
        (data[:-7], "not a whole number of 16-byte blocks"),
        (data[:16], "no ciphertext"),
        (data[:10], "too short"),
        (b"X" * 64, "Salted__"),
    ]:
        (tmp_path / "bad").write_bytes(bad)
        (tmp_path / "existing").write_bytes(b"keep me")
        p = ours("decrypt", "--cipher", "aes-256-cbc", "--pass-file", pw, "--iter", ITER,
                 tmp_path / "bad", tmp_path / "fresh", check=False)
        assert p.returncode == 1 and needle in p.stderr.decode(), p.stderr
        assert not (tmp_path / "fresh").exists()
        p = ours("decrypt", "--cipher", "aes-256-cbc", "--pass-file", pw, "--iter", ITER,
                 tmp_path / "bad", tmp_path / "existing", check=False)
        assert p.returncode == 1
        assert (tmp_path / "existing").read_bytes() == b"keep me"
    # Wrong passphrase: the padding check fails (about 255 times in 256) -> nothing written.
    wrong = tmp_path / "wrong"
    wrong.write_bytes(b"nope\n")
    p = ours("decrypt", "--cipher", "aes-256-cbc", "--pass-file", wrong, "--iter", ITER, tmp_path / "c", tmp_path / "w", check=False)
    if p.returncode == 1:
        assert "bad decrypt" in p.stderr.decode() and not (tmp_path / "w").exists()
    else:
        assert (tmp_path / "w").read_bytes() != plain
    assert leftovers(tmp_path) == []


def test_ecb_needs_insecure_flag_and_says_why(tmp_path):
    pw = passfile(tmp_path)
    (tmp_path / "p").write_bytes(b"x" * 100)
    p = ours("encrypt", "--cipher", "aes-256-ecb", "--pass-file", pw, tmp_path / "p", tmp_path / "c", check=False)
    err = p.stderr.decode()
    assert p.returncode != 0 and "identical" in err and "--insecure-ecb" in err, err
    assert not (tmp_path / "c").exists()
    h = ours("encrypt", "--help").stdout.decode()
    assert "--insecure-ecb" in h and "identical" in h
    assert "SEQUENTIAL" in h or "sequential" in h, "--help must say CBC encryption is sequential"


def test_sink_writes_nothing(tmp_path):
    pw = passfile(tmp_path)
    (tmp_path / "p").write_bytes(payload(1 << 20))
    for mode in ["gcm", "ctr", "cbc", "ecb"]:
        ours("encrypt", "--cipher", f"aes-256-{mode}", *ecb_flag(mode), "--pass-file", pw, "--iter", ITER,
             "--sink", tmp_path / "p")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["p", "pass"]
    p = ours("encrypt", "--pass-file", pw, "--sink", tmp_path / "p", tmp_path / "o", check=False)
    assert p.returncode == 2


def test_key_and_pass_are_exclusive_and_required(tmp_path):
    pw = passfile(tmp_path)
    kf = write_key(tmp_path / "k", os.urandom(32))
    (tmp_path / "p").write_bytes(b"x")
    assert ours("encrypt", tmp_path / "p", tmp_path / "c", check=False).returncode == 2
    assert ours("encrypt", "--pass-file", pw, "--key-file", kf, tmp_path / "p", tmp_path / "c", check=False).returncode == 2
    short = write_key(tmp_path / "short", os.urandom(16))
    p = ours("encrypt", "--key-file", short, tmp_path / "p", tmp_path / "c", check=False)
    assert p.returncode == 1 and b"32" in p.stderr
    # Secrets never appear in output.
    p = ours("encrypt", "--pass-file", pw, "--iter", ITER, "--stats", tmp_path / "p", tmp_path / "c")
    assert b"pa ss" not in p.stderr and b"pa ss" not in p.stdout


def test_sigterm_removes_the_temporary_file(tmp_path):
    """Interrupted mid-stream (stdin still open): no OUT and no temporary file remain."""
    import signal
    import subprocess
    import time

    from conftest import require_binary

    pw = passfile(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.Popen([str(require_binary()), "file", "encrypt", "--pass-file", str(pw), "--iter", ITER,
                             "--chunk-size", "4K", "-", str(out)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        proc.stdin.write(os.urandom(1 << 20))
        proc.stdin.flush()
        deadline = time.monotonic() + 20
        while not leftovers(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert leftovers(tmp_path), "temporary output file never appeared"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert rc != 0
    assert not out.exists()
    assert leftovers(tmp_path) == []
