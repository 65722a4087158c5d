#!/usr/bin/env python3
"""Cipher-engine benchmark: cryptbridge XTS-AES-256 over 4096-byte sectors vs OpenSSL, one row
per CPU level this machine supports (portable, aesni, vaes256, vaes512; see `cryptbridge
--version`).

A benchmark, not a test: it always exits 0 when the measurements ran, and reports targets as
PASS/MISS. Runs, interleaved and repeated (median reported):

  CRYPTBRIDGE_CPU=LEVEL cryptbridge bench cipher --cipher 'xts(aes)' --key-size 512 \
      --sector-size 4096 --threads 1 --seconds S --json   (encrypt_gbps, decrypt_gbps, ecb_gbps:
                                                           raw AES-256-ECB at the same level)
  cryptbridge bench cipher ... --threads N                 (all threads, detected level)
  openssl speed -elapsed -seconds S -evp aes-256-xts -bytes 4096           (encrypt)
  openssl speed -elapsed -seconds S -decrypt -evp aes-256-xts -bytes 4096  (decrypt)
  openssl speed -elapsed -seconds S -evp aes-256-ecb -bytes 4096           (raw ECB reference)
  openssl speed -elapsed -seconds S -multi N -evp aes-256-xts -bytes 4096  (all threads, N > 1)

`-elapsed` makes OpenSSL divide by wall-clock time like a normal throughput measurement (its
default is CPU user time, which flatters it on a busy machine). OpenSSL prints 1000s of bytes per
second; everything here is GB/s with 1 GB = 10^9 bytes.

Targets (one thread), per level: XTS / raw ECB at the same level >= 0.85 (goal 0.9), the portable
level included; XTS / OpenSSL XTS >= 1.0 at aesni, >= 1.2 at vaes256 and vaes512 (goal 1.5), none
at portable. Output: table on stdout, JSON in bench/out/engine.json.
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
TARGET_VS_ECB = 0.85
TARGET_VS_OPENSSL = {"aesni": 1.0, "vaes256": 1.2, "vaes512": 1.2}


def ours(binary: Path, threads: int, seconds: float, level: str | None = None) -> dict:
    argv = [binary, "bench", "cipher", "--cipher", "xts(aes)", "--key-size", "512",
            "--sector-size", str(SECTOR), "--threads", str(threads), "--seconds", str(seconds),
            "--json"]
    env = dict(os.environ)
    env.pop("CRYPTBRIDGE_CPU", None)
    if level is not None:
        env["CRYPTBRIDGE_CPU"] = level
    r = run(argv, timeout=seconds * 6 + 60, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{shjoin(argv)} exited {r.returncode}: {r.stderr.strip()[-500:]}")
    # One JSON object; tolerate stray log lines around it.
    text = r.stdout.strip()
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < 0:
        raise RuntimeError(f"no JSON in output of {shjoin(argv)}: {text[:300]!r}")
    obj = json.loads(text[start:end + 1])
    for k in ("encrypt_gbps", "decrypt_gbps", "ecb_gbps", "cpu_level", "cpu_levels"):
        if k not in obj:
            raise RuntimeError(f"{shjoin(argv)}: field {k} missing in {obj}")
    return obj


def openssl_speed(alg: str, seconds: float, decrypt: bool = False, multi: int = 1) -> float:
    """Returns GB/s (10^9 B/s) parsed from `openssl speed` human output ('1000s of bytes')."""
    argv = ["openssl", "speed", "-elapsed", "-seconds", str(max(1, round(seconds)))]  # whole seconds only
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
    ap.add_argument("--seconds", type=float, default=2, help="seconds per measurement (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats, median reported (default 3)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="'all threads' count (default: os.cpu_count())")
    ap.add_argument("--levels", help="comma-separated CPU levels to measure (default: all this CPU supports)")
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

    probe = ours(args.binary, 1, 0.05)
    supported = list(probe["cpu_levels"])
    levels = supported if not args.levels else [x.strip() for x in args.levels.split(",") if x.strip()]
    for level in levels:
        if level not in supported:
            warn(f"level {level}: this CPU lacks it (supports {', '.join(supported)}); skipped")
    levels = [x for x in levels if x in supported]

    keys = ["ours_nt_enc", "ours_nt_dec", "ours_nt_ecb",
            "openssl_xts_enc", "openssl_xts_dec", "openssl_ecb_enc", "openssl_xts_enc_nt"]
    for level in levels:
        keys += [f"{level}_enc", f"{level}_dec", f"{level}_ecb"]
    samples: dict[str, list] = {k: [] for k in keys}
    raw_ours: list = []

    def add(key, fn):
        try:
            samples[key].append(fn())
        except (RuntimeError, OSError, ValueError) as e:
            warn(str(e))
            samples[key].append(None)

    def measure(tag: str, threads: int, level: str | None):
        try:
            o = ours(args.binary, threads, args.seconds, level)
            if level is not None and o["cpu_level"] != level:
                raise RuntimeError(f"asked for level {level}, ran at {o['cpu_level']}")
            raw_ours.append(o)
            samples[f"{tag}_enc"].append(float(o["encrypt_gbps"]))
            samples[f"{tag}_dec"].append(float(o["decrypt_gbps"]))
            samples[f"{tag}_ecb"].append(float(o["ecb_gbps"]))
        except (RuntimeError, OSError, ValueError) as e:
            warn(str(e))

    log(f"engine: XTS-AES-256, {SECTOR}-byte sectors, levels {', '.join(levels)} (1 thread) and "
        f"{nt} threads at {probe['cpu_detected']}, {args.seconds}s x {args.repeats} repeats")
    try:
        for rep in range(args.repeats):
            for level in levels:
                measure(level, 1, level)
            if nt > 1:
                measure("ours_nt", nt, None)
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

    def ratio(a, b):
        return None if med.get(a) is None or not med.get(b) else med[a] / med[b]

    ratios = []  # (label, numerator, denominator, target)
    for level in levels:
        ratios += [
            (f"{level}: encrypt / raw ECB ({level})", f"{level}_enc", f"{level}_ecb", TARGET_VS_ECB),
            (f"{level}: decrypt / raw ECB ({level})", f"{level}_dec", f"{level}_ecb", TARGET_VS_ECB),
            (f"{level}: encrypt / OpenSSL XTS", f"{level}_enc", "openssl_xts_enc", TARGET_VS_OPENSSL.get(level)),
            (f"{level}: decrypt / OpenSSL XTS", f"{level}_dec", "openssl_xts_dec", TARGET_VS_OPENSSL.get(level)),
        ]
    if nt > 1:
        ratios.append((f"{nt}T encrypt / OpenSSL XTS -multi {nt}", "ours_nt_enc", "openssl_xts_enc_nt", None))
    ratio_rows = []
    for label, a, b, target in ratios:
        r = ratio(a, b)
        ratio_rows.append({"label": label, "numerator": a, "denominator": b, "ratio": r,
                           "target": target, "verdict": verdict(r, target) or None})

    # ---- table ----
    log("")
    log(f"XTS-AES-256, {SECTOR}-byte sectors, GB/s (10^9 B/s), median of {args.repeats}; CPU: {environment()['cpu']}")
    log(f"{'':30}{'encrypt':>10}{'decrypt':>10}{'raw ECB':>10}{'enc/ECB':>9}{'enc/OpenSSL':>13}")
    for level in levels:
        log(f"{f'cryptbridge 1 thread, {level}':30}{fmt(med[f'{level}_enc'], 2):>10}{fmt(med[f'{level}_dec'], 2):>10}"
            f"{fmt(med[f'{level}_ecb'], 2):>10}{fmt(ratio(f'{level}_enc', f'{level}_ecb'), 2):>9}"
            f"{fmt(ratio(f'{level}_enc', 'openssl_xts_enc'), 2):>13}")
    if nt > 1:
        log(f"{f'cryptbridge {nt} threads':30}{fmt(med['ours_nt_enc'], 2):>10}"
            f"{fmt(med['ours_nt_dec'], 2):>10}{fmt(med['ours_nt_ecb'], 2):>10}")
    if have_openssl:
        log(f"{'OpenSSL 1 thread':30}{fmt(med['openssl_xts_enc'], 2):>10}"
            f"{fmt(med['openssl_xts_dec'], 2):>10}{fmt(med['openssl_ecb_enc'], 2):>10}")
        if nt > 1:
            log(f"{f'OpenSSL -multi {nt}':30}{fmt(med['openssl_xts_enc_nt'], 2):>10}")
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
        "levels": levels,
        "cpu_detected": probe["cpu_detected"],
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
