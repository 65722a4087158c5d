#!/usr/bin/env python3
"""File-encryption benchmark: `cryptbridge file` vs `openssl enc` on the same files, same run.

A benchmark, not a test: it exits 0 when the measurements ran and reports targets as PASS/MISS.

For each file size (16 sizes, 32 KiB, 64 KiB, ... 1 GiB) x mode (gcm, ctr, cbc, ecb) x direction
(encrypt, decrypt), interleaved and repeated (median wall time, process start included for
every tool):

  ours file:  cryptbridge file encrypt|decrypt --cipher aes-256-M --pass-file P --iter N --stats IN OUT
              (default settings: all cores, OUT fsynced and renamed into place, O_DIRECT for
              inputs >= 64 MiB; --stats splits
              the time into key derivation, pipeline and fsync+rename, reported per row)
  ours sink:  the same with --sink (transform and discard: no output I/O)
  openssl:    openssl enc [-d] -aes-256-M -pbkdf2 -iter N -pass file:P -in IN -out OUT
              `openssl enc` has no AEAD mode, so the gcm rows compare against
              `openssl enc -aes-256-ctr` on the same plaintext: the same AES work without the
              authentication, a stricter baseline than any GCM tool.

Before every timed run the previous output is deleted and `sync` is called (not timed), so no
run pays for an earlier run's writeback; every input is read once beforehand so that all runs
find it in the page cache. Decryption inputs are made once per size and mode (openssl's output for ctr/cbc/ecb, ours for
gcm), so both tools decrypt the same bytes.
`openssl speed -elapsed -evp aes-256-M [-decrypt] -bytes 16384` is recorded as the library
ceiling (one core, no I/O), and `cryptbridge file sweep --json` as the per-call-overhead sweep of
the synchronous API (16 B .. 256 KiB).

Throughput = plaintext bytes / wall time, GB/s = 10^9 B/s. Noise: on a VM that hands freed memory
back to its host (balloon / free page reporting, e.g. Firecracker), the first writes after a large
file was deleted fault memory back in and run several times slower, whichever tool does them; the
order of the tools rotates across repeats, so use the default 3 repeats (or more) for real numbers.
Targets: ours file >= 1.0x openssl enc at every size >= 1 MiB in every mode and direction;
         ctr and gcm >= 1.5x at 1 GiB.
Output: tables on stdout; bench/out/file.json, bench/out/file.md; plots docs/bench/bench-file.png,
docs/bench/bench-file-speedup.png, docs/bench/bench-file-sweep.png (bench/out/ with --quick).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_BINARY,
    OUT,
    REPO,
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

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ALL_SIZES = [32 * KiB << k for k in range(16)]  # 32 KiB .. 1 GiB
QUICK_SIZES = [32 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]
MODES = ["gcm", "ctr", "cbc", "ecb"]
DIRS = ["encrypt", "decrypt"]
TARGET_ALL = 1.0
TARGET_BIG = 1.5
BIG_MODES = ("ctr", "gcm")


def human(n: int) -> str:
    if n >= GiB:
        return f"{n // GiB}G"
    if n >= MiB:
        return f"{n // MiB}M"
    return f"{n // KiB}K"


def make_file(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        block = os.urandom(min(size, 4 * MiB)) if size else b""
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
            # fresh randomness now and then so that nothing compresses or dedups
            if left and left % (64 * MiB) < len(block):
                block = os.urandom(len(block))


def timed(argv, timeout: float, stats: list | None = None) -> float:
    t0 = time.perf_counter()
    r = run(argv, timeout=timeout)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{shjoin(argv)} exited {r.returncode}: {r.stderr.strip()[-400:]}")
    if stats is not None:
        # `cryptbridge file --stats`: one JSON line on stderr (kdf / pipeline / fsync+rename)
        import json

        for line in r.stderr.splitlines():
            if line.startswith("{"):
                try:
                    stats.append(json.loads(line))
                except ValueError:
                    pass
    return dt


def ossl_name(mode: str) -> str:
    return "aes-256-ctr" if mode == "gcm" else f"aes-256-{mode}"


def openssl_speed(alg: str, seconds: int, decrypt: bool) -> float | None:
    argv = ["openssl", "speed", "-elapsed", "-seconds", str(seconds)]
    if decrypt:
        argv.append("-decrypt")
    argv += ["-evp", alg, "-bytes", "16384"]
    try:
        r = run(argv, timeout=seconds * 4 + 60)
    except Exception as e:  # noqa: BLE001
        warn(f"{shjoin(argv)}: {e}")
        return None
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].lower() == alg.lower() and parts[-1].endswith("k"):
            try:
                return float(parts[-1][:-1]) * 1000.0 / 1e9
            except ValueError:
                pass
    warn(f"cannot parse {shjoin(argv)}: {r.stdout[-300:]!r} {r.stderr[-300:]!r}")
    return None


def sweep(binary: Path, mode: str, millis: int) -> dict | None:
    import json

    argv = [binary, "file", "sweep", "--cipher", f"aes-256-{mode}", "--millis", str(millis), "--json"]
    try:
        r = run(argv, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-400:])
        return json.loads(r.stdout[r.stdout.find("{"):])
    except Exception as e:  # noqa: BLE001
        warn(f"{shjoin(argv)}: {e}")
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=DEFAULT_BINARY)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 4 sizes (32K, 1M, 16M, 64M), 1 repeat, short sweep; plots to bench/out/")
    ap.add_argument("--sizes", default=None, help="comma-separated sizes (e.g. 1M,256M), overrides the list")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dirs", default=",".join(DIRS))
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats, median reported (default 3)")
    ap.add_argument("--iter", type=int, default=10000, help="PBKDF2 iterations for both tools (default 10000)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the test files go (default: a temporary directory under bench/out)")
    ap.add_argument("--speed-seconds", type=int, default=2)
    ap.add_argument("--sweep-millis", type=int, default=150)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT / "file.json")
    ap.add_argument("--plots", type=Path, default=None, help="plot directory (default docs/bench/, bench/out/ with --quick)")
    args = ap.parse_args()

    sizes = ALL_SIZES
    if args.quick:
        sizes, args.repeats, args.speed_seconds, args.sweep_millis = QUICK_SIZES, 1, 1, 30
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    dirs = [d for d in args.dirs.split(",") if d]
    plots = args.plots or (OUT if args.quick else REPO / "docs" / "bench")
    install_signal_handlers()

    if not args.binary.exists():
        print(f"error: {args.binary} not found (run `cargo build --release`)", file=sys.stderr)
        return 1
    have_openssl = shutil.which("openssl") is not None
    if not have_openssl:
        warn("openssl not found: only our own numbers are reported")

    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="file-bench-", dir=args.workdir or OUT))
    pw = work / "pass"
    pw.write_bytes(b"benchmark passphrase\n")
    env = environment(args.binary)
    log(f"file: sizes {human(sizes[0])}..{human(sizes[-1])} ({len(sizes)}), modes {','.join(modes)}, "
        f"{'/'.join(dirs)}, {args.repeats} repeats, --iter {args.iter}, work dir {work}")

    # results[(mode, dir, size)][variant] = [seconds...]
    results: dict = {}
    breakdown: dict = {}
    ceiling: dict = {}
    sweeps: dict = {}
    try:
        if have_openssl:
            for mode in modes:
                for d in dirs:
                    ceiling[f"{mode}/{d}"] = openssl_speed(f"aes-256-{mode}", args.speed_seconds, d == "decrypt")
            log("  openssl speed: " + ", ".join(f"{k} {fmt(v, 2)}" for k, v in ceiling.items()))
        for size in sizes:
            plain = work / "plain"
            make_file(plain, size)
            # ciphertexts to decrypt, one per mode, made once
            cts: dict = {}
            for mode in modes:
                if "decrypt" not in dirs:
                    break
                ct = work / f"ct.{mode}"
                if mode == "gcm" or not have_openssl:
                    timed([args.binary, "file", "encrypt", "--cipher", f"aes-256-{mode}", "--insecure-ecb",
                           "--pass-file", pw, "--iter", args.iter, plain, ct], timeout=600)
                else:
                    timed(["openssl", "enc", f"-{ossl_name(mode)}", "-pbkdf2", "-iter", args.iter,
                           "-pass", f"file:{pw}", "-in", plain, "-out", ct], timeout=600)
                cts[mode] = ct
                if mode == "gcm" and have_openssl:
                    # openssl's baseline decrypts a CTR file of the same plaintext
                    ctr = work / "ct.gcm-baseline"
                    timed(["openssl", "enc", "-aes-256-ctr", "-pbkdf2", "-iter", args.iter,
                           "-pass", f"file:{pw}", "-in", plain, "-out", ctr], timeout=600)
                    cts["gcm-baseline"] = ctr
            # small files are cheap and noisy (process start, PBKDF2, fsync): more repeats
            # Every input is read once now, so that all runs find it in the page cache (ours
            # writes large outputs with O_DIRECT, which leaves them uncached).
            for f in [plain, *cts.values()]:
                with open(f, "rb") as fh:
                    while fh.read(8 * MiB):
                        pass
            reps = args.repeats if size > 16 * MiB else max(args.repeats, 5)
            timeout = 120 + size / (50 * MiB)
            for rep in range(reps):
                for mode in modes:
                    for d in dirs:
                        key = (mode, d, size)
                        slot = results.setdefault(key, {"ours_file": [], "ours_sink": [], "openssl": []})
                        st = breakdown.setdefault(key, [])
                        src = plain if d == "encrypt" else cts[mode]
                        out = work / "out"
                        base = [args.binary, "file", d, "--cipher", f"aes-256-{mode}", "--insecure-ecb",
                                "--pass-file", pw, "--iter", args.iter, "--no-progress"]
                        variants = [("ours_file", base + ["--stats", src, out]), ("ours_sink", base + ["--sink", src])]
                        if have_openssl:
                            osrc = cts.get("gcm-baseline", src) if (mode == "gcm" and d == "decrypt") else src
                            variants.append(("openssl", ["openssl", "enc"] + (["-d"] if d == "decrypt" else [])
                                             + [f"-{ossl_name(mode)}", "-pbkdf2", "-iter", args.iter,
                                                "-pass", f"file:{pw}", "-in", osrc, "-out", out]))
                        # rotate the order so that no variant always runs first
                        k = rep % len(variants)
                        for name, argv in variants[k:] + variants[:k]:
                            out.unlink(missing_ok=True)
                            # Start every run without a backlog of dirty pages (ours fsyncs OUT,
                            # openssl does not; neither should pay for earlier runs' writeback).
                            os.sync()
                            try:
                                slot[name].append(timed(argv, timeout, st if name == "ours_file" else None))
                            except Exception as e:  # noqa: BLE001
                                warn(str(e))
                                slot[name].append(None)
                        out.unlink(missing_ok=True)
            line = []
            for mode in modes:
                for d in dirs:
                    s = results[(mode, d, size)]
                    o, b = median(s["ours_file"]), median(s["openssl"])
                    line.append(f"{mode}/{d[:3]} {fmt(size / o / 1e9 if o else None, 2)}"
                                f"{'' if not b else ' (' + fmt(b / o, 2) + 'x)'}")
            log(f"  {human(size):>5}: " + ", ".join(line))
            for p in work.glob("ct.*"):
                p.unlink()
        if not args.no_sweep:
            for mode in modes:
                sweeps[mode] = sweep(args.binary, mode, args.sweep_millis)
    except (KeyboardInterrupt, BenchInterrupted) as e:
        warn(f"interrupted ({e}); reporting what was measured")
    except Exception as e:  # noqa: BLE001
        warn(f"aborted: {e!r}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    # ---- tables ----
    rows = []
    for (mode, d, size), s in sorted(results.items(), key=lambda kv: (MODES.index(kv[0][0]), DIRS.index(kv[0][1]), kv[0][2])):
        t = {k: median(v) for k, v in s.items()}
        gb = {k: (size / v / 1e9 if v else None) for k, v in t.items()}
        sp = (t["openssl"] / t["ours_file"]) if t.get("openssl") and t.get("ours_file") else None
        sp_sink = (t["openssl"] / t["ours_sink"]) if t.get("openssl") and t.get("ours_sink") else None
        target = None
        if size >= MiB:
            target = TARGET_ALL
        if size >= GiB and mode in BIG_MODES:
            target = TARGET_BIG
        bd = breakdown.get((mode, d, size), [])
        parts = {k: median([b.get(k) for b in bd]) for k in ("kdf_s", "pipeline_s", "commit_s", "total_s")}
        rows.append({
            "mode": mode, "direction": d, "size": size, "ours_file_breakdown_s": parts,
            "seconds": t, "gbps": gb, "speedup_file": sp, "speedup_sink": sp_sink,
            "target": target, "verdict": verdict(sp, target) or None,
            "samples": s,
        })

    md = ["| mode | dir | size | ours file GB/s | ours sink GB/s | openssl enc GB/s | ours/openssl | sink/openssl "
          "| ours: pipeline s | ours: fsync+rename s | target |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    log("")
    log(f"{'mode':5} {'dir':8} {'size':>5} {'ours':>7} {'sink':>7} {'openssl':>8} {'x':>6} {'sink x':>7} "
        f"{'pipe s':>8} {'fsync s':>8}  target")
    for r in rows:
        g = r["gbps"]
        bd = r["ours_file_breakdown_s"]
        tgt = f">= {r['target']} {r['verdict'] or ''}" if r["target"] else ""
        log(f"{r['mode']:5} {r['direction']:8} {human(r['size']):>5} {fmt(g['ours_file'], 2):>7} "
            f"{fmt(g['ours_sink'], 2):>7} {fmt(g['openssl'], 2):>8} {fmt(r['speedup_file'], 2):>6} "
            f"{fmt(r['speedup_sink'], 2):>7} {fmt(bd['pipeline_s'], 3):>8} {fmt(bd['commit_s'], 3):>8}  {tgt}")
        md.append(f"| {r['mode']} | {r['direction']} | {human(r['size'])} | {fmt(g['ours_file'], 2)} | "
                  f"{fmt(g['ours_sink'], 2)} | {fmt(g['openssl'], 2)} | {fmt(r['speedup_file'], 2)} | "
                  f"{fmt(r['speedup_sink'], 2)} | {fmt(bd['pipeline_s'], 3)} | {fmt(bd['commit_s'], 3)} | {tgt} |")
    judged = [r for r in rows if r["target"]]
    passed = sum(1 for r in judged if r["verdict"] == "PASS")
    summary = f"targets: {passed}/{len(judged)} PASS"
    misses = [f"{r['mode']}/{r['direction']}/{human(r['size'])} {fmt(r['speedup_file'], 2)}x"
              for r in judged if r["verdict"] != "PASS"]
    if misses:
        summary += " (MISS: " + ", ".join(misses) + ")"
    log(summary)
    if ceiling:
        log("openssl speed -evp (1 core, 16 KiB, no I/O), GB/s: "
            + ", ".join(f"{k} {fmt(v, 2)}" for k, v in ceiling.items()))
    for mode, sw in sweeps.items():
        if not sw:
            continue
        for s in sw["series"]:
            log(f"sweep {mode} {s['name']:>7}: per-call overhead {s['overhead_ns']:.0f} ns, peak "
                f"{s['peak_gbps']:.2f} GB/s, half peak at {s['n_half_bytes']:.0f} B, overhead < 10% from "
                f"{s['n90_bytes']:.0f} B")

    doc = {
        "benchmark": "file", "environment": env, "iter": args.iter, "repeats": args.repeats,
        "sizes": sizes, "modes": modes, "directions": dirs,
        "notes": "gcm rows: openssl baseline is `openssl enc -aes-256-ctr` (enc has no AEAD). "
                 "ours file = default settings incl. fsync of OUT. Wall time incl. process start and PBKDF2.",
        "rows": rows, "openssl_speed_gbps": ceiling, "sweep": sweeps, "summary": summary,
    }
    write_json(args.out, doc)
    md_path = args.out.with_suffix(".md")
    md_path.write_text("\n".join(md) + "\n\n" + summary + "\n")
    log(f"results: {args.out}, {md_path}")
    plot(rows, ceiling, sweeps, plots)
    return 0


def parse_size(s: str) -> int:
    s = s.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": KiB, "M": MiB, "G": GiB}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KMG" else s) * mult


def plot(rows, ceiling, sweeps, outdir: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warn("matplotlib not installed; plots skipped (pip install matplotlib)")
        return
    if not rows:
        return
    outdir.mkdir(parents=True, exist_ok=True)
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]

    fig, axes = plt.subplots(2, len(modes), figsize=(4.2 * len(modes), 7.5), squeeze=False, sharex=True)
    for j, mode in enumerate(modes):
        for i, d in enumerate(DIRS):
            ax = axes[i][j]
            rs = [r for r in rows if r["mode"] == mode and r["direction"] == d]
            if not rs:
                ax.set_visible(False)
                continue
            xs = [r["size"] for r in rs]
            for key, label, style in (("ours_file", "cryptbridge file→file", "o-"),
                                      ("ours_sink", "cryptbridge sink", "s--"),
                                      ("openssl", "openssl enc" + (" (ctr)" if mode == "gcm" else ""), "^-")):
                ys = [r["gbps"].get(key) for r in rs]
                if any(y is not None for y in ys):
                    ax.plot(xs, [y if y is not None else float("nan") for y in ys], style, label=label, ms=4)
            c = ceiling.get(f"{mode}/{d}")
            if c:
                ax.axhline(c, color="gray", ls=":", label="openssl speed (1 core)")
            ax.set_xscale("log", base=2)
            ax.set_title(f"aes-256-{mode} {d}")
            ax.grid(True, alpha=0.3)
            if j == 0:
                ax.set_ylabel("GB/s")
            if i == 1:
                ax.set_xlabel("file size (bytes)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(outdir / "bench-file.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode in modes:
        for d, ls in (("encrypt", "-"), ("decrypt", "--")):
            rs = [r for r in rows if r["mode"] == mode and r["direction"] == d and r["speedup_file"]]
            if rs:
                ax.plot([r["size"] for r in rs], [r["speedup_file"] for r in rs], ls, marker="o", ms=3,
                        label=f"{mode} {d}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.5, color="gray", lw=0.8, ls=":")
    ax.axvline(MiB, color="gray", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("file size (bytes)")
    ax.set_ylabel("speed-up vs openssl enc (file→file)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(outdir / "bench-file-speedup.png", dpi=100)
    plt.close(fig)

    if sweeps:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for mode, sw in sweeps.items():
            if not sw:
                continue
            for s, ls in zip(sw["series"], ("-", "--")):
                pts = s["points"]
                axes[0].plot([p["size"] for p in pts], [p["gbps"] for p in pts], ls, marker="o", ms=3,
                             label=f"{mode} {s['name']}")
                axes[1].plot([p["size"] for p in pts], [p["ns_per_call"] for p in pts], ls, marker="o", ms=3,
                             label=f"{mode} {s['name']}")
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("bytes per encrypt(chunk) call")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
        axes[0].set_ylabel("GB/s")
        axes[1].set_ylabel("ns per call")
        axes[1].set_yscale("log")
        fig.suptitle("encrypt(chunk): inline call vs round trip to a worker thread")
        fig.tight_layout()
        fig.savefig(outdir / "bench-file-sweep.png", dpi=100)
        plt.close(fig)
    log(f"plots: {outdir / 'bench-file.png'}, {outdir / 'bench-file-speedup.png'}, {outdir / 'bench-file-sweep.png'}")


if __name__ == "__main__":
    sys.exit(main())
