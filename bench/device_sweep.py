#!/usr/bin/env python3
"""How fast may the device be before encryption stops hiding behind it?

A benchmark, not a test: the exit status is 0 whenever the measurements ran.

The bridge benchmark's device regime compares cryptbridge encrypted with --passthrough on one
disk, and its target (encrypted >= 0.95 x passthrough) holds only while the disk, not the CPU,
is the limit. These machines' VM disk takes O_DIRECT writes at 1.5-4 GB/s, several times the
600 MB/s the issue measured, so this sweep caps the servers' disk bandwidth with a cgroup (the
bridge benchmark's DiskThrottle) at a series of speeds and measures the same pair at each:

  cap (MB/s written; reads get the cap x --read-factor, the issue's disk read 880 / wrote 600)
    600, 1000, 1500, 2000, 3000 and none (the unthrottled disk)

Both servers of every cap are up at once on one shared backing file (only one fio job runs at
a time); each repeat runs every cap, in an order rotated per repeat, and the pair's order
alternates, so the disk's drift over the run falls on every cap alike. Reported per cap and
profile: each server's median MB/s, the median of same-repeat encrypted / passthrough ratios,
and how busy the machine was.

Default profiles: SEQ1M Q8T1 write and read, the two whose speed the disk cap moves (the 4K
profiles are bound by request rate, not bandwidth).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import bridge
from _common import (
    DEFAULT_BINARY,
    OUT,
    BenchInterrupted,
    environment,
    fmt,
    install_signal_handlers,
    log,
    median,
    run,
    verdict,
    warn,
    write_json,
)

TARGET = 0.95
DEFAULT_CAPS = "600,1000,1500,2000,3000,none"
DEFAULT_PROFILES = "seq1m_q8t1_write,seq1m_q8t1_read"
# The disk the issue measured: 600 MB/s writing, 880 MB/s reading.
READ_FACTOR = bridge.SSD_READ_BPS / bridge.SSD_WRITE_BPS


def parse_caps(text: str) -> list[int | None]:
    """'600,1500,none' -> [600, 1500, None] (MB/s written; None: not throttled)."""
    caps: list[int | None] = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        if item in ("none", "off", "unthrottled"):
            caps.append(None)
            continue
        value = int(item)
        if value <= 0:
            raise ValueError(f"cap {value} MB/s: must be positive")
        caps.append(value)
    if not caps:
        raise ValueError("no caps given")
    return caps


def cap_name(cap: int | None) -> str:
    return "none" if cap is None else f"{cap}"


def cap_order(caps: list, rep: int) -> list:
    """Every repeat visits every cap; the start rotates so no cap always runs first."""
    shift = rep % len(caps)
    return caps[shift:] + caps[:shift]


def pair_order(servers: list, rep: int) -> list:
    return servers if rep % 2 == 0 else list(reversed(servers))


def summarize(results: dict, caps: list, profiles: list) -> list[dict]:
    """One row per (cap, profile): medians of each server and the paired ratio. `results` has
    the bridge benchmark's shape, with the cap's name in place of the regime."""
    rows = []
    for cap in caps:
        name = cap_name(cap)
        for prof in profiles:
            cell = lambda key: [s for s in results.get(name, {}).get(key, {}).get(prof.key, []) if s.get("ok")]  # noqa: E731
            enc, pt = cell("cb-enc"), cell("cb-pt")
            ratio, pairs = bridge.paired_ratio(results, name, "cb-enc", "cb-pt", prof.key)
            rows.append({
                "cap_write_mbps": cap,
                "cap_read_mbps": None if cap is None else round(cap * READ_FACTOR),
                "profile": prof.key,
                "profile_label": prof.label,
                "enc_mbps": median([s["mbps"] for s in enc]),
                "pt_mbps": median([s["mbps"] for s in pt]),
                "pt_max_mbps": max((s["mbps"] for s in pt), default=None),
                "ratio": ratio,
                "pairs": pairs,
                "enc_busy": median([s.get("machine_busy") for s in enc]),
                "pt_busy": median([s.get("machine_busy") for s in pt]),
                "verdict": verdict(ratio, TARGET) or None,
            })
    return rows


def markdown(rows: list[dict], state: dict) -> str:
    env, cfg = state["environment"], state["config"]
    lines = [
        f"Measured {env['date'][:10]} on {env['cpu']} ({env['nproc']} CPUs, Linux {env['kernel']}), "
        f"commit {env.get('git')}; fio `ioengine=nbd`, {cfg['repeats']} repeats of "
        f"{cfg['runtime_s']} s jobs after {cfg['ramp_s']} s; cryptbridge XTS = AES-256-XTS, 4096-byte "
        "sectors, both servers `--direct` on one backing file; caps by cgroup io throttle.",
        "",
        "| Disk cap, write / read MB/s | Profile | passthrough MB/s | XTS MB/s | XTS / passthrough (paired) | pairs | machine busy, XTS / passthrough | ≥ 0.95 |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        cap = "none (VM disk)" if r["cap_write_mbps"] is None else f"{r['cap_write_mbps']} / {r['cap_read_mbps']}"
        busy = (f"{fmt(100 * r['enc_busy'], 0)} % / {fmt(100 * r['pt_busy'], 0)} %"
                if r["enc_busy"] is not None and r["pt_busy"] is not None else "—")
        lines.append(f"| {cap} | {r['profile_label']} | {fmt(r['pt_mbps'], 0)} | {fmt(r['enc_mbps'], 0)} | "
                     f"{fmt(r['ratio'], 2)} | {r['pairs']} | {busy} | {r['verdict'] or '—'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=DEFAULT_BINARY)
    ap.add_argument("--caps", default=DEFAULT_CAPS,
                    help=f"comma list of disk write caps in MB/s, 'none' for unthrottled (default {DEFAULT_CAPS})")
    ap.add_argument("--profiles", default=DEFAULT_PROFILES,
                    help="comma list of bridge.py profiles (default: " + DEFAULT_PROFILES + ")")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--runtime", type=float, default=2.5, help="seconds per fio job")
    ap.add_argument("--ramp", type=float, default=0.5, help="fio ramp_time seconds")
    ap.add_argument("--size", default="2G", help="export size")
    ap.add_argument("--workdir", type=Path, default=OUT / "work", help="backing file (on the disk to measure)")
    ap.add_argument("--keep-files", action="store_true")
    ap.add_argument("--out-json", type=Path, default=OUT / "device_sweep.json")
    ap.add_argument("--out-md", type=Path, default=OUT / "device_sweep.md")
    args = ap.parse_args()

    try:
        caps = parse_caps(args.caps)
    except ValueError as e:
        ap.error(f"--caps: {e}")
    by_key = {p.key: p for p in bridge.PROFILES}
    wanted = [k.strip() for k in args.profiles.split(",") if k.strip()]
    unknown = [k for k in wanted if k not in by_key]
    if unknown or not wanted:
        ap.error(f"--profiles: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(by_key)}")
    profiles = [by_key[k] for k in wanted]
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    missing = bridge.check_tools({"cb-enc", "cb-pt"}, args.binary)
    if missing:
        print("error: missing: " + ", ".join(missing) + " (bench/run.sh installs them)", file=sys.stderr)
        return 1
    size = bridge.parse_size(args.size)
    install_signal_handlers()

    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if bridge.fs_type(work) in ("tmpfs", "ramfs"):
        warn(f"{work} is in memory: no disk is measured (use --workdir)")
    backing = work / "device-plain.img"  # the bridge benchmark's device file, reused if present
    created = not backing.exists()
    keyfile = work / "xts.key"
    logdir = OUT / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    rundir = Path(tempfile.mkdtemp(prefix="cbsweep."))
    jobs = len(caps) * len(profiles) * 2 * args.repeats
    log(f"device sweep: caps {', '.join(cap_name(c) for c in caps)} MB/s; {jobs} fio jobs ≈ "
        f"{jobs * (args.runtime + args.ramp + 0.7) / 60:.1f} min")

    state = {
        "benchmark": "device_sweep",
        "config": {"caps_write_mbps": caps, "read_factor": READ_FACTOR, "repeats": args.repeats,
                   "runtime_s": args.runtime, "ramp_s": args.ramp, "size": size,
                   "profiles": wanted, "backing": str(backing)},
        "environment": environment(args.binary),
        "results": {},
    }
    servers: dict[str, list[bridge.Server]] = {}
    throttles = []
    rc = 0
    try:
        if not keyfile.exists():
            r = run([args.binary, "keygen", "--cipher", "aes-xts-plain64", "--key-size", "512", keyfile], timeout=30)
            if r.returncode != 0:
                raise RuntimeError(f"cryptbridge keygen failed: {r.stderr.strip()}")
        bridge.prepare_plain(backing, size)
        bridge.drop_file_cache(backing)
        for cap in caps:
            name = cap_name(cap)
            throttle = None
            if cap is not None:
                throttle = bridge.DiskThrottle(backing, cap * 1_000_000, round(cap * READ_FACTOR) * 1_000_000,
                                               name=f"cap{name}")
                throttles.append(throttle)
            pair = [
                bridge.Server(key, f"cap{name}", lambda sock, _pid, k=key: bridge.cryptbridge_argv(
                    k, args.binary, backing, keyfile, sock, 4096, ["--direct"]), backing, rundir, logdir, True)
                for key in ("cb-enc", "cb-pt")
            ]
            for s in pair:
                s.start()
                if throttle is not None:
                    throttle.add(s.proc.pid)
            servers[name] = pair
            log(f"  cap {name:>5}: {'unthrottled' if throttle is None else throttle.describe()}")

        for rep in range(args.repeats):
            for cap in cap_order(caps, rep):
                name = cap_name(cap)
                for prof in profiles:
                    for s in pair_order(servers[name], rep):
                        if not s.alive():
                            raise RuntimeError(f"{s.key} (cap {name}) exited {s.proc.returncode}; see {s.stderr_path}")
                        out = OUT / "fio" / "sweep" / f"{name}.{s.key}.{prof.key}.r{rep + 1}.json"
                        out.parent.mkdir(parents=True, exist_ok=True)
                        sample = bridge.fio_job(s.uri, prof, size, args.runtime, args.ramp, out, s.proc.pid)
                        sample["repeat"] = rep + 1
                        state["results"].setdefault(name, {}).setdefault(s.key, {}).setdefault(prof.key, []).append(sample)
                        if prof.writes:
                            bridge.sync_file(backing)
                        shown = f"{sample['mbps']:8.0f} MB/s" if sample["ok"] else f"FAILED: {sample.get('error')}"
                        log(f"  [{rep + 1}/{args.repeats}] cap {name:>5} {prof.label:17} {s.key:6} {shown}")
            write_json(args.out_json, state)
    except (KeyboardInterrupt, BenchInterrupted) as e:
        warn(f"interrupted ({e}); reporting what was measured")
        rc = 130
    except Exception as e:
        warn(f"aborted: {e}")
        rc = 1
    finally:
        for pair in servers.values():
            for s in pair:
                s.stop()  # waits for the process, so its cgroup is empty after
        for t in throttles:
            t.remove()
        if created and not args.keep_files:
            backing.unlink(missing_ok=True)
            backing.with_name(backing.name + ".stamp").unlink(missing_ok=True)

    rows = summarize(state["results"], caps, profiles)
    for r in rows:
        limit = r["cap_write_mbps"] if by_key[r["profile"]].writes else r["cap_read_mbps"]
        if limit is not None and r["pt_max_mbps"] is not None and r["pt_max_mbps"] > 1.1 * limit:
            warn(f"cap {limit} MB/s did not hold: {r['profile_label']} passthrough reached "
                 f"{r['pt_max_mbps']:.0f} MB/s")
    state["rows"] = rows
    write_json(args.out_json, state)
    text = markdown(rows, state)
    args.out_md.parent.mkdir(parents=True, exist_ok=True)
    args.out_md.write_text(text + "\n")
    print("\n" + text)
    log(f"wrote {args.out_json}\nwrote {args.out_md}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
