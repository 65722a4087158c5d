#!/usr/bin/env python3
"""Cipher-engine benchmark: cryptbridge XTS-AES-256 over 4096-byte sectors vs OpenSSL.

A benchmark, not a test: it always exits 0 when the measurements ran, and reports targets as
PASS/MISS. Runs, interleaved and repeated (median reported):

  cryptbridge bench cipher --cipher 'xts(aes)' --key-size 512 --sector-size 4096 \
      --threads {1,N} --seconds S --json          (encrypt_gbps, decrypt_gbps, ecb_gbps)
  openssl speed -elapsed -seconds S -evp aes-256-xts -bytes 4096           (encrypt)
  openssl speed -elapsed -seconds S -decrypt -evp aes-256-xts -bytes 4096  (decrypt)
  openssl speed -elapsed -seconds S -evp aes-256-ecb -bytes 4096           (raw ECB reference)
  openssl speed -elapsed -seconds S -multi N -evp aes-256-xts -bytes 4096  (all threads, N > 1)

`-elapsed` makes OpenSSL divide by wall-clock time like a normal throughput measurement (its
default is CPU user time, which flatters it on a busy machine). OpenSSL prints 1000s of bytes per
second; everything here is GB/s with 1 GB = 10^9 bytes.

Targets: ours (1 thread) / OpenSSL XTS >= 1.2;  ours XTS / raw ECB >= 0.85.
Output: table on stdout, JSON in bench/out/engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_BINARY,
    OUT,
    BenchInterrupted,
    environment,
    fmt,
    install_signal_handlers,
    log,
    median,
    run,
    shjoin,
    verdict,
    warn,
    write_json,
)

SECTOR = 4096
TARGET_VS_OPENSSL = 1.2
TARGET_VS_ECB = 0.85


def ours(binary: Path, threads: int, seconds: int) -> dict:
    argv = [binary, "bench", "cipher", "--cipher", "xts(aes)", "--key-size", "512",
            "--sector-size", str(SECTOR), "--threads", str(threads), "--seconds", str(seconds),
            "--json"]
    r = run(argv, timeout=seconds * 6 + 60)
    if r.returncode != 0:
        raise RuntimeError(f"{shjoin(argv)} exited {r.returncode}: {r.stderr.strip()[-500:]}")
    # One JSON object; tolerate stray log lines around it.
    text = r.stdout.strip()
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < 0:
        raise RuntimeError(f"no JSON in output of {shjoin(argv)}: {text[:300]!r}")
    obj = json.loads(text[start:end + 1])
    for k in ("encrypt_gbps", "decrypt_gbps", "ecb_gbps"):
        if k not in obj:
            raise RuntimeError(f"{shjoin(argv)}: field {k} missing in {obj}")
    return obj


def openssl_speed(alg: str, seconds: int, decrypt: bool = False, multi: int = 1) -> float:
    """Returns GB/s (10^9 B/s) parsed from `openssl speed` human output ('1000s of bytes')."""
    argv = ["openssl", "speed", "-elapsed", "-seconds", str(seconds)]
    if decrypt:
        argv.append("-decrypt")
    if multi > 1:
        argv += ["-multi", str(multi)]
    argv += ["-evp", alg, "-bytes", str(SECTOR)]
    r = run(argv, timeout=seconds * 4 + 60)
    if r.returncode != 0:
        raise RuntimeError(f"{shjoin(argv)} exited {r.returncode}: {r.stderr.strip()[-500:]}")
    # e.g. "AES-256-XTS    5845491.71k"  (value in 1000s of bytes per second)
    pat = re.compile(rf"^\s*{re.escape(alg)}\s+([0-9.]+)k\s*$", re.IGNORECASE | re.MULTILINE)
    m = pat.findall(r.stdout)
    if not m:
        raise RuntimeError(f"cannot parse output of {shjoin(argv)}:\n{r.stdout[-800:]}")
    return float(m[-1]) * 1000.0 / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=DEFAULT_BINARY)
    ap.add_argument("--seconds", type=int, default=2, help="seconds per measurement (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats, median reported (default 3)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="'all threads' count (default: os.cpu_count())")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 s, 1 repeat")
    ap.add_argument("--out", type=Path, default=OUT / "engine.json")
    ap.add_argument("--no-openssl", action="store_true", help="skip the OpenSSL references")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.repeats = 1, 1
    install_signal_handlers()

    if not args.binary.exists():
        print(f"error: {args.binary} not found (run `cargo build --release`)", file=sys.stderr)
        return 1
    have_openssl = not args.no_openssl and shutil.which("openssl") is not None
    if not have_openssl and not args.no_openssl:
        warn("openssl not found; OpenSSL references skipped")
    nt = max(1, args.threads)

    samples: dict[str, list] = {k: [] for k in (
        "ours_1t_enc", "ours_1t_dec", "ours_1t_ecb", "ours_nt_enc", "ours_nt_dec", "ours_nt_ecb",
        "openssl_xts_enc", "openssl_xts_dec", "openssl_ecb_enc", "openssl_xts_enc_nt")}
    raw_ours: list = []

    def add(key, fn):
        try:
            samples[key].append(fn())
        except (RuntimeError, OSError, ValueError) as e:
            warn(str(e))
            samples[key].append(None)

    log(f"engine: XTS-AES-256, {SECTOR}-byte sectors, threads 1 and {nt}, "
        f"{args.seconds}s x {args.repeats} repeats")
    try:
        for rep in range(args.repeats):
            for t in ([1, nt] if nt > 1 else [1]):
                try:
                    o = ours(args.binary, t, args.seconds)
                    raw_ours.append(o)
                    tag = "1t" if t == 1 else "nt"
                    samples[f"ours_{tag}_enc"].append(float(o["encrypt_gbps"]))
                    samples[f"ours_{tag}_dec"].append(float(o["decrypt_gbps"]))
                    samples[f"ours_{tag}_ecb"].append(float(o["ecb_gbps"]))
                    if nt == 1:
                        for k in ("enc", "dec", "ecb"):
                            samples[f"ours_nt_{k}"].append(samples[f"ours_1t_{k}"][-1])
                except (RuntimeError, OSError, ValueError) as e:
                    warn(str(e))
            if have_openssl:
                add("openssl_xts_enc", lambda: openssl_speed("aes-256-xts", args.seconds))
                add("openssl_xts_dec", lambda: openssl_speed("aes-256-xts", args.seconds, decrypt=True))
                add("openssl_ecb_enc", lambda: openssl_speed("aes-256-ecb", args.seconds))
                if nt > 1:
                    add("openssl_xts_enc_nt", lambda: openssl_speed("aes-256-xts", args.seconds, multi=nt))
            log(f"  repeat {rep + 1}/{args.repeats} done")
    except (KeyboardInterrupt, BenchInterrupted) as e:
        warn(f"interrupted ({e}); reporting what was measured")
    except Exception as e:  # a subprocess timeout etc.: still report
        warn(f"aborted: {e!r}")

    med = {k: median(v) for k, v in samples.items()}
    if nt == 1:
        med["openssl_xts_enc_nt"] = med["openssl_xts_enc"]

    def ratio(a, b):
        return None if med.get(a) is None or not med.get(b) else med[a] / med[b]

    ratios = [
        # (label, numerator, denominator, target)
        ("ours 1T encrypt / OpenSSL XTS encrypt", "ours_1t_enc", "openssl_xts_enc", TARGET_VS_OPENSSL),
        ("ours 1T decrypt / OpenSSL XTS decrypt", "ours_1t_dec", "openssl_xts_dec", TARGET_VS_OPENSSL),
        ("ours 1T encrypt / our raw ECB 1T", "ours_1t_enc", "ours_1t_ecb", TARGET_VS_ECB),
        ("ours 1T decrypt / our raw ECB 1T", "ours_1t_dec", "ours_1t_ecb", TARGET_VS_ECB),
        (f"ours {nt}T encrypt / our raw ECB {nt}T", "ours_nt_enc", "ours_nt_ecb", TARGET_VS_ECB),
        (f"ours {nt}T decrypt / our raw ECB {nt}T", "ours_nt_dec", "ours_nt_ecb", TARGET_VS_ECB),
        ("ours 1T encrypt / OpenSSL ECB 1T", "ours_1t_enc", "openssl_ecb_enc", TARGET_VS_ECB),
        ("our raw ECB 1T / OpenSSL ECB 1T", "ours_1t_ecb", "openssl_ecb_enc", None),
        (f"ours {nt}T encrypt / OpenSSL XTS -multi {nt}", "ours_nt_enc", "openssl_xts_enc_nt", None),
        (f"ours {nt}T encrypt / ours 1T (scaling)", "ours_nt_enc", "ours_1t_enc", None),
    ]
    ratio_rows = []
    for label, a, b, target in ratios:
        r = ratio(a, b)
        ratio_rows.append({"label": label, "numerator": a, "denominator": b, "ratio": r,
                           "target": target, "verdict": verdict(r, target) or None})

    # ---- table ----
    log("")
    log(f"XTS-AES-256, {SECTOR}-byte sectors, GB/s (10^9 B/s), median of {args.repeats}")
    log(f"{'':28}{'encrypt':>10}{'decrypt':>10}{'raw ECB':>10}")
    log(f"{'cryptbridge 1 thread':28}{fmt(med['ours_1t_enc'], 2):>10}{fmt(med['ours_1t_dec'], 2):>10}"
        f"{fmt(med['ours_1t_ecb'], 2):>10}")
    if nt > 1:
        log(f"{f'cryptbridge {nt} threads':28}{fmt(med['ours_nt_enc'], 2):>10}"
            f"{fmt(med['ours_nt_dec'], 2):>10}{fmt(med['ours_nt_ecb'], 2):>10}")
    if have_openssl:
        log(f"{'OpenSSL 1 thread':28}{fmt(med['openssl_xts_enc'], 2):>10}"
            f"{fmt(med['openssl_xts_dec'], 2):>10}{fmt(med['openssl_ecb_enc'], 2):>10}")
        if nt > 1:
            log(f"{f'OpenSSL -multi {nt}':28}{fmt(med['openssl_xts_enc_nt'], 2):>10}{'':>10}{'':>10}")
    log("")
    log(f"{'ratio':48}{'value':>8}{'target':>9}  verdict")
    for row in ratio_rows:
        tgt = f">= {row['target']}" if row["target"] is not None else ""
        log(f"{row['label']:48}{fmt(row['ratio'], 3):>8}{tgt:>9}  {row['verdict'] or ''}")

    result = {
        "benchmark": "engine",
        "cipher": "xts(aes)",
        "key_size_bits": 512,
        "sector_size": SECTOR,
        "seconds": args.seconds,
        "repeats": args.repeats,
        "threads_all": nt,
        "units": "GB/s, 1 GB = 1e9 bytes; OpenSSL timed with -elapsed (wall clock)",
        "environment": environment(args.binary),
        "openssl": None,
        "median": med,
        "samples": samples,
        "cryptbridge_raw": raw_ours,
        "ratios": ratio_rows,
    }
    if have_openssl:
        try:
            result["openssl"] = run(["openssl", "version"], timeout=10).stdout.strip()
        except Exception:
            pass
    write_json(args.out, result)
    log(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
