#!/usr/bin/env python3
"""Wide-block TES comparison table (issue 3): the software analogue of the FPGA paper's Tables 4
and 5 (arXiv 2408.14113), for XTS and the wide-block schemes, on one core.

A benchmark, not a test: it exits 0 when the measurements ran and reports targets as PASS/MISS.
Every measurement is repeated at each CPU level this machine supports (CRYPTBRIDGE_CPU=portable,
aesni, vaes256, vaes512; `--levels` picks some), one row per scheme, sector size and level.

Measurements, for 4096- and 512-byte sectors, one thread, AES-256 wherever the scheme takes an
AES key (AEZ takes a 48-byte key; Adiantum a 32-byte one):

  cipher only:  target/release/examples/tes_speed --json   (cargo builds it)
                best of repeated 1 MiB passes (sector n gets tweak n), so time lost to other
                processes on a shared machine drops out; also measures the core clock with a
                chain of dependent additions, giving cycles/byte = clock / throughput.
  engine:       cryptbridge bench cipher --cipher NAME --key-size BITS --sector-size S
                --threads 1 --seconds T --json, the best of R runs (the same path the bridge
                uses; on a busy machine its average includes time other processes took).

Static columns per sector (m = sector/16 blocks), from the algorithms as implemented:
AES (or ChaCha) calls, GF(2^128) multiplications, whether decryption needs the AES inverse cipher.

  bench/tes.py                 # full run (~3 min)
  bench/tes.py --quick         # shorter measurements
  bench/tes.py --markdown      # also print the table as Markdown (for a docs/bench/ page)

BENCH_SKIP_BUILD=1 (as for bench/run.sh) or --no-build: do not run cargo for the example.

Targets, at vaes256 (and checked at vaes512 too): every AES-based TES >= 2.5 GB/s at 4096 bytes
(cipher only, encrypt and decrypt); FAST-BRW >= 0.6 x XTS at the same level: the median of
--pairs runs that measure the two back to back (the ratio from the table's rows is printed beside
it). Lower levels are reported without targets.
Output: table on stdout, JSON in bench/out/tes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_BINARY, OUT, REPO, BenchInterrupted, environment, install_signal_handlers, log, run, warn, write_json  # noqa: E402

# label, registry name, key bytes, AES-based (for the 2.5 GB/s target)
ROWS = [
    ("XTS", "xts(aes)", 64, True),
    ("EME2", "eme2(aes)", 64, True),
    ("XCB (legacy)", "xcb(aes)", 32, True),
    ("FAST-Horner", "fast-horner(aes)", 32, True),
    ("FAST-BRW", "fast-brw(aes)", 32, True),
    ("AEZ", "aez", 48, True),
    ("HCTR2", "hctr2(aes)", 32, True),
    ("Adiantum-XChaCha12", "adiantum(xchacha12,aes)", 32, False),
    ("Adiantum-XChaCha20", "adiantum(xchacha20,aes)", 32, False),
]
SECTORS = [4096, 512]


def costs(name: str, sector: int) -> tuple[str, str, str]:
    """(block-cipher calls, GF(2^128) multiplications, decryption needs AES inverse) per sector,
    with a 16-byte tweak (32 for HCTR2 and Adiantum, as Linux)."""
    m = sector // 16
    if name == "xts(aes)":
        return f"{m + 1} AES", "0 (doublings only)", "yes"
    if name == "eme2(aes)":
        remask = (m - 1) // 128
        return f"{2 * m + 2 + remask} AES", "0 (doublings only)", "yes"
    if name == "xcb(aes)":
        return f"{m + 1} AES", f"{2 * m + 5}", "yes"
    if name == "fast-horner(aes)":
        return f"{m} AES", f"{2 * m + 3}", "no"
    if name == "fast-brw(aes)":
        k = m - 1
        return f"{m} AES", f"{2 * (k // 2 + 1) + 3}", "no"
    if name == "aez":
        pairs = m // 2 - 1
        aes4 = 5 * pairs + 2 + 1
        return f"{aes4} AES4 + 2 AES10 (= {4 * aes4 + 20} rounds)", "0 (doublings only)", "no"
    if name == "hctr2(aes)":
        return f"{m} AES", f"{2 * m + 1} (POLYVAL)", "yes"
    if name.startswith("adiantum"):
        rounds = 12 if "xchacha12" in name else 20
        blocks = -(-(sector - 16) // 64)
        return f"{blocks} ChaCha{rounds} + 1 HChaCha + 1 AES", "0 (NH + 22 Poly1305)", "yes"
    return "?", "?", "?"


def build_example(no_build: bool) -> Path:
    exe = REPO / "target" / "release" / "examples" / "tes_speed"
    # BENCH_SKIP_BUILD=1 skips the build; unset, empty or 0 builds.
    if not no_build and os.environ.get("BENCH_SKIP_BUILD", "") in ("", "0"):
        p = run(["cargo", "build", "--release", "-p", "cryptbridge-cipher", "--example", "tes_speed"], timeout=1800, cwd=REPO)
        if p.returncode != 0:
            warn(p.stderr[-3000:])
    if not exe.exists():
        raise SystemExit(f"{exe} missing (cargo build --release -p cryptbridge-cipher --example tes_speed)")
    return exe


TARGET_LEVELS = ("vaes256", "vaes512")


def level_env(level: str) -> dict:
    env = dict(os.environ)
    env["CRYPTBRIDGE_CPU"] = level
    return env


def supported_levels(binary: Path) -> list[str]:
    """The levels `cryptbridge bench cipher --json` says this CPU can run (portable only if the
    binary is missing)."""
    if not binary.exists():
        return ["portable"]
    p = run([binary, "bench", "cipher", "--seconds", "0.05", "--threads", "1", "--json"], timeout=60)
    if p.returncode != 0:
        warn(f"cannot list CPU levels: {p.stderr.strip()[-300:]}")
        return ["portable"]
    return list(json.loads(p.stdout)["cpu_levels"])


def cipher_only(exe: Path, seconds: float, level: str, specs: list[str] | None = None, sector: int | None = None) -> dict:
    """tes_speed's figures at `level` keyed by (cipher, sector size): every row at both sizes by
    default."""
    specs = specs or [f"{name}:{klen}" for _, name, klen, _ in ROWS]
    sizes = ["--sector", sector] if sector else []
    p = run([exe, "--seconds", seconds, "--json", *sizes, *specs], timeout=60 + 10 * seconds * len(specs) * 4, env=level_env(level))
    if p.returncode != 0:
        raise SystemExit(f"tes_speed failed: {p.stderr[-2000:]}")
    out = {}
    for line in p.stdout.splitlines():
        d = json.loads(line)
        out[(d["cipher"], d["sector_size"])] = d
    return out


def paired_ratio(exe: Path, seconds: float, pairs: int, level: str) -> dict:
    """FAST-BRW / XTS encrypt at 4096 bytes from `pairs` runs of tes_speed that measure just the
    two, back to back (alternating which goes first), and the median of the per-run ratios. On
    these shared machines the speed of both drifts by several per cent over a few minutes, so a
    ratio of two measurements taken side by side, repeated, is steadier than one taken from the
    full table, whose rows run a minute apart."""
    ratios = []
    for i in range(pairs):
        specs = ["xts(aes):64", "fast-brw(aes):32"]
        if i % 2:
            specs.reverse()
        got = cipher_only(exe, seconds, level, specs, 4096)
        ratios.append(got[("fast-brw(aes)", 4096)]["encrypt_gbps"] / got[("xts(aes)", 4096)]["encrypt_gbps"])
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "ratios": ratios}


def engine(binary: Path, name: str, klen: int, sector: int, seconds: float, repeats: int, level: str) -> dict | None:
    best = None
    for _ in range(repeats):
        argv = [binary, "bench", "cipher", "--cipher", name, "--key-size", 8 * klen, "--sector-size", sector,
                "--threads", 1, "--seconds", seconds, "--json"]  # fmt: skip
        p = run(argv, timeout=60 + 4 * seconds, env=level_env(level))
        if p.returncode != 0:
            warn(f"{name} {sector}: {p.stderr.strip()[-300:]}")
            return None
        d = json.loads(p.stdout)
        if best is None:
            best = d
        else:
            best["encrypt_gbps"] = max(best["encrypt_gbps"], d["encrypt_gbps"])
            best["decrypt_gbps"] = max(best["decrypt_gbps"], d["decrypt_gbps"])
    return best


def table(rows: list[dict], markdown: bool) -> str:
    head = ["scheme", "level", "sector", "enc GB/s", "dec GB/s", "c/B enc", "engine enc/dec GB/s", "cipher calls / sector", "GF(2^128) mults / sector", "dec needs AES⁻¹"]
    lines = []
    for r in rows:
        eng = "—" if r["engine_enc"] is None else f"{r['engine_enc']:.2f} / {r['engine_dec']:.2f}"
        lines.append([r["label"], r["level"], str(r["sector"]), f"{r['enc']:.2f}", f"{r['dec']:.2f}", f"{r['cpb']:.2f}", eng, r["calls"], r["mults"], r["inverse"]])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        out += ["| " + " | ".join(l) + " |" for l in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    fmt_row = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt_row(head), fmt_row(["-" * w for w in widths]), *(fmt_row(l) for l in lines)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=DEFAULT_BINARY)
    ap.add_argument("--seconds", type=float, default=1.5, help="cipher-only time per measurement")
    ap.add_argument("--engine-seconds", type=float, default=0.5, help="engine time per run")
    ap.add_argument("--repeats", type=int, default=3, help="engine runs per measurement (best kept)")
    ap.add_argument("--pairs", type=int, default=9, help="paired XTS / FAST-BRW runs for the ratio target")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-engine", action="store_true", help="skip the `cryptbridge bench cipher` runs")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--levels", help="comma-separated CPU levels (default: all this CPU supports)")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.engine_seconds, args.repeats, args.pairs = 0.4, 0.3, 1, 3
    install_signal_handlers()
    supported = supported_levels(args.binary)
    levels = supported if not args.levels else [x.strip() for x in args.levels.split(",") if x.strip()]
    for level in [x for x in levels if x not in supported]:
        warn(f"level {level}: this CPU lacks it (supports {', '.join(supported)}); skipped")
    levels = [x for x in levels if x in supported]
    rows = []
    pairs = {}
    try:
        exe = build_example(args.no_build)
        for level in levels:
            log(f"{level}: cipher only ({exe.name}, {args.seconds} s per measurement) ...")
            co = cipher_only(exe, args.seconds, level)
            for label, name, klen, aes_based in ROWS:
                for sector in SECTORS:
                    d = co[(name, sector)]
                    eng = None if args.no_engine or not args.binary.exists() else engine(args.binary, name, klen, sector, args.engine_seconds, args.repeats, level)
                    calls, mults, inv = costs(name, sector)
                    rows.append({
                        "label": label, "cipher": name, "level": level, "key_bytes": klen, "aes_based": aes_based, "sector": sector,
                        "enc": d["encrypt_gbps"], "dec": d["decrypt_gbps"], "cpb": d["encrypt_cpb"], "cpb_dec": d["decrypt_cpb"],
                        "core_ghz": d["core_ghz"],
                        "engine_enc": None if eng is None else eng["encrypt_gbps"], "engine_dec": None if eng is None else eng["decrypt_gbps"],
                        "calls": calls, "mults": mults, "inverse": inv,
                    })  # fmt: skip
            log(f"{level}: FAST-BRW / XTS, {args.pairs} paired runs ...")
            pairs[level] = paired_ratio(exe, args.seconds, args.pairs, level)
    except BenchInterrupted as e:
        warn(str(e))
        return 1
    clock = max(r["core_ghz"] for r in rows)
    print()
    print(f"one core, GB/s = 10^9 bytes/s; core clock ~{clock:.2f} GHz (measured); c/B = clock / enc GB/s; CPU: {environment()['cpu']}")
    print(table(rows, False))
    if args.markdown:
        print()
        print(table(rows, True))
    # targets
    print()
    get = lambda name, sector, level: next(r for r in rows if r["cipher"] == name and r["sector"] == sector and r["level"] == level)  # noqa: E731
    verdicts = []
    for level in levels:
        xts, brw = get("xts(aes)", 4096, level), get("fast-brw(aes)", 4096, level)
        table_ratio = brw["enc"] / xts["enc"]
        pair = pairs[level]
        if level not in TARGET_LEVELS:
            print(f"  ----  {level}: FAST-BRW / XTS {pair['median']:.3f} x (no target at this level)")
            continue
        for r in rows:
            if r["level"] == level and r["aes_based"] and r["sector"] == 4096 and r["cipher"] != "xts(aes)":
                ok = min(r["enc"], r["dec"]) >= 2.5
                verdicts.append((f"{level}: {r['label']} >= 2.5 GB/s at 4096 B", f"{min(r['enc'], r['dec']):.2f} GB/s", ok))
        verdicts.append((f"{level}: FAST-BRW >= 0.6 x XTS (encrypt, 4096 B)",
                         f"{pair['median']:.3f} x (median of {len(pair['ratios'])} paired runs, range {pair['min']:.3f}-"
                         f"{pair['max']:.3f}; from the table above: {table_ratio:.3f} x)", pair["median"] >= 0.6))
    for what, value, ok in verdicts:
        print(f"  {'PASS' if ok else 'MISS'}  {what}: {value}")
    OUT.mkdir(parents=True, exist_ok=True)
    write_json(OUT / "tes.json", {"environment": environment(args.binary), "levels": levels, "rows": rows, "fast_brw_over_xts": pairs,
                                  "targets": [{"what": w, "value": v, "pass": ok} for w, v, ok in verdicts]})  # fmt: skip
    log(f"\nJSON: {OUT / 'tes.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
