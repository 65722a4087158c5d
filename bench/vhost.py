#!/usr/bin/env python3
"""Front-end benchmark: the same cryptbridge through vhost-user-blk and through NBD (issue 29).

A benchmark, not a test: targets are reported as PASS/MISS and the exit status is 0 whenever the
measurements ran (1 only for setup failures such as a missing binary or tool).

One backing file in the page cache (pre-filled with random bytes, re-read before every repeat:
bridge.py's cpu regime) is served by `cryptbridge serve` four ways:

  vhost-enc  --vhost-user-blk SOCK, AES-256-XTS (512-bit key, --sector-size 4096)
  nbd-enc    --unix SOCK, the same cipher and key
  vhost-pt   --vhost-user-blk SOCK --passthrough
  nbd-pt     --unix SOCK --passthrough

After every write job the file is synced (fdatasync, outside the measured time, as bridge.py
does): otherwise the next job pays for the writeback of this one's dirty pages.

A served image is locked (one writer at a time), so the four share the file by taking turns: each
server is started for its own job and stopped after it. NBD jobs are fio (ioengine=nbd on the unix
socket, one job, one connection: bridge.py's `fio_job`); vhost-user jobs are
`target/release/examples/vhost_blk_bench` (libblkio's virtio-blk-vhost-user driver in user space,
no VM, one queue unless --queues), which keeps the same number of requests in flight with the same
block size, random offsets aligned to it, and the same runtime and ramp. Neither client is
counted: the figures are the bridge's.

The vhost-user client waits for completions the way fio's nbd engine does, asleep until the
server tells it (its completion eventfd; fio sleeps in poll(2) on the socket), so every batch of
replies costs the bridge a wake-up of the client in both. --client-poll gives it libblkio's poll
queues instead (vhost_blk_bench --poll): it spins on the used ring and asks for no notifications,
as a guest's polled virtio-blk queues or SPDK's initiator do; NBD has no such mode, so a run with
it compares a polling vhost-user client with a sleeping NBD one, and its report says so.

Profiles: SEQ1M Q8T1 read / write, RND4K Q32T1 read / write (MB/s = 10^6 B/s).

Every repeat runs each profile on all four servers, in an order that alternates the front ends
(vhost, NBD, vhost, NBD) and is rotated per repeat and profile, and reversed every other repeat
(bridge.py's `job_order`), so each server takes every position and neighbour in turn.

CPU per byte: the bridge process's utime+stime from /proc/PID/stat over the job (ramp included;
server startup not), per GiB moved over the same time, MB/s x (runtime + ramp), as the other
scripts count it. The client's CPU (fio or the blkio client, from getrusage of the children) is
recorded beside it but is not part of any target.

Ratios are the median over repeats of the ratio of two jobs of the same repeat (the machine is
shared and drifts; the jobs of a pair run seconds apart). Targets (issue 29):
  RND4K Q32 read and write, encrypted: vhost-user MB/s >= 1.5 x NBD, and the bridge's CPU s/GiB
  through vhost-user <= 0.6 x through NBD;
  SEQ1M through vhost-user: encrypted >= 0.9 x passthrough.
The other ratios (passthrough vhost/NBD, encrypted/passthrough through NBD) are printed without a
target.

Before/after a change: --baseline BINARY (say, built from the commit before it) runs every
selected server a second time with that binary ("-base" keys), in the same alternating order, so
both binaries see the same machine; the report adds each server's after/baseline MB/s and CPU
ratios and the targets' ratios for the baseline pair. --servers narrows the servers run.

Outputs: bench/out/vhost.json, bench/out/vhost.md (paste into a dated page under docs/bench/),
per-job fio and client JSON under bench/out/fio/vhost/, server logs under bench/out/logs/.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
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
    cpu_header,
    cpu_s_per_gib,
    environment,
    fmt,
    install_signal_handlers,
    kill_group,
    log,
    median,
    process_cpu_seconds,
    run,
    shjoin,
    spawn,
    tool_version,
    warn,
    write_json,
)
from bridge import (  # noqa: E402
    PROFILES as BRIDGE_PROFILES,
    Profile,
    fio_job,
    human_size,
    job_order,
    machine_cpu_ticks,
    parse_size,
    prepare_plain,
    sync_file,
    warm_file,
)

DEFAULT_CLIENT = REPO / "target" / "release" / "examples" / "vhost_blk_bench"
PROFILES: list[Profile] = [p for p in BRIDGE_PROFILES
                           if p.key in ("seq1m_q8t1_read", "seq1m_q8t1_write", "rnd4k_q32t1_read", "rnd4k_q32t1_write")]

# Front ends alternate in this order (job_order rotates and reverses it). --servers narrows it and
# --baseline adds a "-base" twin of each (main() rebinds the list).
ALL_SERVERS = ["vhost-enc", "nbd-enc", "vhost-pt", "nbd-pt"]
SERVERS = list(ALL_SERVERS)
LABELS = {
    "vhost-enc": "vhost-user XTS",
    "nbd-enc": "NBD XTS",
    "vhost-pt": "vhost-user passthrough",
    "nbd-pt": "NBD passthrough",
}
BASE = "-base"
for _k in ALL_SERVERS:
    LABELS[_k + BASE] = LABELS[_k] + " (baseline)"

# (label, numerator, denominator, field, {group: target}, direction): direction "ge" passes when
# the ratio is at least the target, "le" when at most.
RATIOS = [
    ("XTS: vhost / NBD MB/s", "vhost-enc", "nbd-enc", "mbps", {"RND4K": 1.5}, "ge"),
    ("XTS: vhost / NBD CPU s/GiB", "vhost-enc", "nbd-enc", "server_cpu_s_per_gib", {"RND4K": 0.6}, "le"),
    ("passthrough: vhost / NBD MB/s", "vhost-pt", "nbd-pt", "mbps", {}, "ge"),
    ("passthrough: vhost / NBD CPU s/GiB", "vhost-pt", "nbd-pt", "server_cpu_s_per_gib", {}, "le"),
    ("vhost: XTS / passthrough MB/s", "vhost-enc", "vhost-pt", "mbps", {"SEQ1M": 0.9}, "ge"),
    ("NBD: XTS / passthrough MB/s", "nbd-enc", "nbd-pt", "mbps", {}, "ge"),
]
# With --baseline: the target ratios for the baseline binary, and each server against its twin.
BASE_RATIOS = [
    ("baseline: XTS: vhost / NBD MB/s", "vhost-enc" + BASE, "nbd-enc" + BASE, "mbps", {"RND4K": 1.5}, "ge"),
    ("baseline: XTS: vhost / NBD CPU s/GiB", "vhost-enc" + BASE, "nbd-enc" + BASE, "server_cpu_s_per_gib", {"RND4K": 0.6}, "le"),
    ("baseline: vhost: XTS / passthrough MB/s", "vhost-enc" + BASE, "vhost-pt" + BASE, "mbps", {"SEQ1M": 0.9}, "ge"),
    ("baseline: NBD: XTS / passthrough MB/s", "nbd-enc" + BASE, "nbd-pt" + BASE, "mbps", {}, "ge"),
] + [(f"{LABELS[k]}: after / baseline {what}", k, k + BASE, field, {}, direction)
     for k in ALL_SERVERS
     for what, field, direction in (("MB/s", "mbps", "ge"), ("CPU s/GiB", "server_cpu_s_per_gib", "le"))]


def server_argv(key: str, binary: Path, backing: Path, keyfile: Path, sock: Path, queues: int) -> list:
    key = key.removesuffix(BASE)
    if key.endswith("-enc"):
        mode = ["--key-file", keyfile, "--cipher", "aes-xts-plain64", "--key-size", "512", "--sector-size", "4096"]
    else:
        mode = ["--passthrough"]
    if key.startswith("vhost"):
        front = ["--vhost-user-blk", sock] + (["--queues", str(queues)] if queues > 1 else [])
    else:
        front = ["--unix", sock]
    return [str(binary), "serve", "--backing", backing] + mode + front


class Bridge:
    """One `cryptbridge serve`, started for one job."""

    def __init__(self, key: str, argv: list, sock: Path, logdir: Path):
        self.key, self.argv, self.sock = key, argv, sock
        self.stdout_path = logdir / f"vhost-{key}.stdout.log"
        self.stderr_path = logdir / f"vhost-{key}.stderr.log"
        self.proc: subprocess.Popen | None = None
        self.uri: str | None = None

    def start(self, timeout: float = 30.0) -> None:
        self.sock.unlink(missing_ok=True)
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "ab") as err:
            self.proc = spawn(self.argv, out, err)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.stderr_path.read_text(errors="replace")[-600:]
                raise RuntimeError(f"{self.key} exited {self.proc.returncode}: {shjoin(self.argv)}\n{tail}")
            for line in self.stdout_path.read_text(errors="replace").splitlines():
                if line.startswith("ready "):
                    self.uri = line.split(None, 1)[1].strip()
                    return
            time.sleep(0.05)
        raise RuntimeError(f"{self.key} not ready after {timeout:.0f} s: {shjoin(self.argv)}")

    def stop(self) -> None:
        kill_group(self.proc)
        self.proc = None


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def blkio_job(client: Path, sock: Path, prof: Profile, size: int, runtime: float, ramp: float, queues: int,
              out_json: Path, server_pid: int | None, poll: bool = False) -> dict:
    """One vhost_blk_bench run; a sample shaped as bridge.py's fio_job returns it."""
    argv = [client, sock, "--bs", prof.bs, "--iodepth", prof.iodepth, "--rw", prof.rw, "--size", size,
            "--runtime", f"{runtime:g}", "--ramp", f"{ramp:g}", "--queues", queues]
    if poll:
        argv.append("--poll")
    if prof.rwmixread is not None:
        argv += ["--rwmixread", prof.rwmixread]
    cpu0, srv0 = machine_cpu_ticks(), process_cpu_seconds(server_pid)
    t0 = time.monotonic()
    try:
        r = run(argv, timeout=runtime + ramp + 60)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "vhost_blk_bench timed out", "argv": [str(a) for a in argv]}
    wall = time.monotonic() - t0
    cpu1, srv1 = machine_cpu_ticks(), process_cpu_seconds(server_pid)
    out_json.write_text(r.stdout)
    try:
        data = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"ok": False, "error": f"vhost_blk_bench rc={r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}",
                "argv": [str(a) for a in argv]}
    sample = {
        "ok": r.returncode == 0 and bool(data.get("ok")),
        "mbps": data["mbps"],
        "read_mbps": data["read_mbps"],
        "write_mbps": data["write_mbps"],
        "iops": data["iops"],
        "lat_us": data.get("lat_us"),
        "wall_s": round(wall, 2),
    }
    if cpu0 and cpu1 and cpu1[1] > cpu0[1]:
        sample["machine_busy"] = round((cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1]), 3)
    if srv0 is not None and srv1 is not None and wall > 0:
        sample["server_cores"] = round((srv1 - srv0) / wall, 3)
        sample["server_cpu_s"] = round(srv1 - srv0, 3)
        per_gib = cpu_s_per_gib(srv0, srv1, data["mbps"] * 1e6 * (runtime + ramp))
        if per_gib is not None:
            sample["server_cpu_s_per_gib"] = per_gib
    if not sample["ok"]:
        sample["error"] = f"rc={r.returncode} errors={data.get('errors')} errno={data.get('first_errno')}: {r.stderr.strip()[-300:]}"
    return sample


def paired(results: dict, num: str, den: str, pkey: str, field: str) -> tuple[float | None, int]:
    """Median over repeats of num / den measured in the same repeat, and the number of pairs."""
    def by_rep(key):
        return {s["repeat"]: s[field] for s in results.get(key, {}).get(pkey, [])
                if s.get("ok") and s.get(field)}
    a, b = by_rep(num), by_rep(den)
    ratios = [a[r] / b[r] for r in sorted(a.keys() & b.keys())]
    return median(ratios), len(ratios)


def summarize(results: dict) -> dict:
    out = {}
    for key, per in results.items():
        for pkey, samples in per.items():
            ok = [s for s in samples if s.get("ok")]
            out.setdefault(key, {})[pkey] = {
                "n": len(ok), "failed": len(samples) - len(ok),
                "mbps": median([s["mbps"] for s in ok]),
                "iops": median([s["iops"] for s in ok]),
                "server_cpu_s_per_gib": median([s.get("server_cpu_s_per_gib") for s in ok]),
                "client_cpu_s_per_gib": median([s.get("client_cpu_s_per_gib") for s in ok]),
                "machine_busy": median([s.get("machine_busy") for s in ok]),
                "min_mbps": min((s["mbps"] for s in ok), default=None),
                "max_mbps": max((s["mbps"] for s in ok), default=None),
            }
    return out


def compute_ratios(results: dict) -> list[dict]:
    rows = []
    for label, num, den, field, targets, direction in RATIOS + BASE_RATIOS:
        if num not in SERVERS or den not in SERVERS:
            continue
        for prof in PROFILES:
            ratio, pairs = paired(results, num, den, prof.key, field)
            target = targets.get(prof.group)
            verdict = ""
            if ratio is not None and target is not None:
                verdict = "PASS" if (ratio >= target if direction == "ge" else ratio <= target) else "MISS"
            rows.append({"ratio": label, "profile": prof.label, "pkey": prof.key, "value": ratio, "pairs": pairs,
                         "target": target, "direction": direction, "verdict": verdict})
    return rows


def markdown(state: dict, args) -> str:
    env, summary, ratios = state["environment"], state["summary"], state["ratios"]
    L = [f"# cryptbridge: vhost-user-blk against NBD ({env['date'][:10]})", "",
         cpu_header(env) + f" Load average at start {', '.join(f'{x:.2f}' for x in env['loadavg_start'])}, "
         f"at end {', '.join(f'{x:.2f}' for x in env.get('loadavg_end', []))}.",
         f"Command: `{state['command']}`; git {env.get('git')}; {state['config']['repeats']} repeats, "
         f"{state['config']['runtime_s']:g} s + {state['config']['ramp_s']:g} s ramp per job, export "
         f"{human_size(state['config']['size'])} in the page cache, vhost-user queues {state['config']['queues']}; "
         f"fio: {state['versions'].get('fio')}."
         + (" **vhost-user client polling** (libblkio poll queues, no used-ring notifications); the NBD client "
            "(fio) sleeps in poll(2) as always." if state['config'].get('client_poll') else
            " vhost-user client waiting on its completion eventfd (interrupt mode), as fio waits on its socket.")
         + (f" Baseline (\"-base\" rows): `{state['baseline']['binary']}`." if state.get("baseline") else ""), "",
         "**MB/s, IOPS, bridge CPU s/GiB (medians over repeats)**", "",
         "| Profile | " + " | ".join(LABELS[k] for k in SERVERS) + " |",
         "|---|" + "---:|" * len(SERVERS)]
    for prof in PROFILES:
        cells = []
        for k in SERVERS:
            c = summary.get(k, {}).get(prof.key)
            if not c or c["mbps"] is None:
                cells.append("—")
                continue
            cells.append(f"{fmt(c['mbps'], 0)} MB/s, {fmt(c['iops'] / 1000, 1)} k IOPS, "
                         f"{fmt(c['server_cpu_s_per_gib'], 3)} s/GiB")
        L.append(f"| {prof.label} | " + " | ".join(cells) + " |")
    L += ["", "Client CPU s/GiB (fio for NBD, vhost_blk_bench for vhost-user; not in any target): " + "; ".join(
        f"{prof.label}: " + ", ".join(f"{k} {fmt(summary.get(k, {}).get(prof.key, {}).get('client_cpu_s_per_gib'), 3)}"
                                      for k in SERVERS) for prof in PROFILES) + ".",
          "", "**Ratios (median of same-repeat ratios)**", "",
          "| Ratio | Profile | value | pairs | target | verdict |", "|---|---|---:|---:|---:|---|"]
    for r in ratios:
        t = "" if r["target"] is None else ("≥ " if r["direction"] == "ge" else "≤ ") + f"{r['target']:g}"
        L.append(f"| {r['ratio']} | {r['profile']} | {fmt(r['value'], 2)} | {r['pairs']} | {t} | {r['verdict']} |")
    return "\n".join(L)


def check_tools(binary: Path, client: Path) -> list[str]:
    missing = []
    if not shutil.which("fio"):
        missing.append("fio")
    elif "uri" not in run(["fio", "--enghelp=nbd"], timeout=30).stdout:
        missing.append("fio built with the nbd engine")
    if not binary.exists():
        missing.append(f"{binary} (cargo build --release --locked)")
    if not client.exists():
        missing.append(f"{client} (cargo build --release --locked -p cryptbridge-bridge --example vhost_blk_bench)")
    return missing


def main() -> int:
    global PROFILES, SERVERS  # --profiles, --servers and --baseline set the module-wide lists every report walks
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=DEFAULT_BINARY)
    ap.add_argument("--client", type=Path, default=DEFAULT_CLIENT, help="the vhost_blk_bench example")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a second cryptbridge binary: every server also runs with it (\"-base\" keys), alternating")
    ap.add_argument("--servers", default=None,
                    help="comma list of servers to run (default all): " + ",".join(ALL_SERVERS))
    ap.add_argument("--runtime", type=float, default=None, help="seconds per job (default 4; quick 1)")
    ap.add_argument("--ramp", type=float, default=None, help="ramp seconds per job (default 1; quick 0.3)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats, medians reported (default 3; quick 1)")
    ap.add_argument("--size", default=None, help="export size (default 1G; quick 128M)")
    ap.add_argument("--queues", type=int, default=1, help="vhost-user queues (server --queues and client)")
    ap.add_argument("--client-poll", action="store_true",
                    help="vhost-user client on libblkio poll queues (vhost_blk_bench --poll; see above)")
    ap.add_argument("--profiles", default=None,
                    help="comma list of profiles to run (default all): " + ",".join(p.key for p in PROFILES))
    ap.add_argument("--quick", action="store_true", help="smoke run: short jobs, 1 repeat, small file")
    ap.add_argument("--workdir", type=Path, default=OUT / "work")
    ap.add_argument("--out-json", type=Path, default=OUT / "vhost.json")
    ap.add_argument("--out-md", type=Path, default=OUT / "vhost.md")
    args = ap.parse_args()
    if args.profiles:
        wanted = args.profiles.split(",")
        unknown = sorted(set(wanted) - {p.key for p in PROFILES})
        if unknown:
            ap.error(f"unknown profile(s): {', '.join(unknown)}")
        PROFILES = [p for p in PROFILES if p.key in wanted]
    if args.servers:
        wanted = args.servers.split(",")
        unknown = sorted(set(wanted) - set(ALL_SERVERS))
        if unknown:
            ap.error(f"unknown server(s): {', '.join(unknown)}")
        SERVERS = [k for k in ALL_SERVERS if k in wanted]
    if args.baseline:
        # Each twin next to its server: job_order then rotates them together with the others.
        SERVERS = [k for s in SERVERS for k in (s, s + BASE)]
    q = args.quick
    args.runtime = args.runtime if args.runtime is not None else (1.0 if q else 4.0)
    args.ramp = args.ramp if args.ramp is not None else (0.3 if q else 1.0)
    args.repeats = max(1, args.repeats if args.repeats is not None else (1 if q else 3))
    size = parse_size(args.size or ("128M" if q else "1G"))

    missing = check_tools(args.binary, args.client)
    if args.baseline and not args.baseline.exists():
        missing.append(f"{args.baseline} (--baseline)")
    if missing:
        print("error: missing: " + ", ".join(missing), file=sys.stderr)
        return 1
    install_signal_handlers()
    minutes = len(SERVERS) * len(PROFILES) * args.repeats * (args.runtime + args.ramp + 0.8) / 60
    log(f"vhost: {len(SERVERS) * len(PROFILES) * args.repeats} jobs ≈ {minutes:.1f} min")

    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    logdir = OUT / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    jobdir = OUT / "fio" / "vhost"
    jobdir.mkdir(parents=True, exist_ok=True)
    rundir = Path(tempfile.mkdtemp(prefix="cbvhost."))  # short path for unix sockets
    backing = work / f"vhost-{human_size(size)}.img"
    keyfile = work / "vhost-xts.key"

    state = {
        "benchmark": "vhost",
        "command": shjoin(["python3", "bench/vhost.py", *sys.argv[1:]]),
        "config": {"runtime_s": args.runtime, "ramp_s": args.ramp, "repeats": args.repeats, "size": size,
                   "queues": args.queues, "client_poll": args.client_poll, "quick": q, "servers": SERVERS, "profiles": [p.key for p in PROFILES]},
        "units": "MB/s = 1e6 bytes/s; CPU s/GiB = bridge utime+stime per 2^30 bytes moved; medians over repeats",
        "environment": environment(args.binary),
        "baseline": None if not args.baseline else {"binary": str(args.baseline),
                                                    "version": tool_version([args.baseline, "--version"])},
        "versions": {"fio": tool_version(["fio", "--version"])},
        "results": {},
    }

    def report(final: bool) -> None:
        state["summary"] = summarize(state["results"])
        state["ratios"] = compute_ratios(state["results"])
        state["environment"]["loadavg_end"] = list(os.getloadavg())
        write_json(args.out_json, state)
        if final:
            md = markdown(state, args)
            args.out_md.parent.mkdir(parents=True, exist_ok=True)
            args.out_md.write_text(md + "\n")
            log("\n" + md + "\n")
            log(f"wrote {args.out_json}\nwrote {args.out_md}")

    rc = 0
    try:
        if not keyfile.exists():
            r = run([args.binary, "keygen", "--cipher", "aes-xts-plain64", "--key-size", "512", "--force", keyfile],
                    timeout=30)
            if r.returncode != 0:
                raise RuntimeError(f"cryptbridge keygen failed: {r.stderr.strip()}")
        prepare_plain(backing, size)
        for rep in range(1, args.repeats + 1):
            resident = warm_file(backing)
            log(f"\n== repeat {rep}/{args.repeats}" + (f" (backing {resident:.0%} resident)" if resident is not None else ""))
            for pi, prof in enumerate(PROFILES):
                for key in job_order(SERVERS, rep - 1, pi):
                    sock = rundir / f"{key}.sock"
                    binary = args.baseline if key.endswith(BASE) else args.binary
                    srv = Bridge(key, server_argv(key, binary, backing, keyfile, sock, args.queues), sock, logdir)
                    out = jobdir / f"{prof.key}-{key}-r{rep}.json"
                    try:
                        srv.start()
                        pid = srv.proc.pid if srv.proc else None
                        c0 = children_cpu()
                        if key.startswith("vhost"):
                            s = blkio_job(args.client, sock, prof, size, args.runtime, args.ramp, args.queues, out, pid,
                                          args.client_poll)
                        else:
                            s = fio_job(srv.uri, prof, size, args.runtime, args.ramp, out, pid)
                        client_s = children_cpu() - c0
                        if srv.proc is not None and srv.proc.poll() is not None:
                            s["ok"] = False
                            s["error"] = f"bridge exited {srv.proc.returncode} during the job"
                    finally:
                        srv.stop()
                    if prof.writes:
                        sync_file(backing)  # the next job starts without this one's dirty pages
                    if s.get("mbps"):
                        s["client_cpu_s_per_gib"] = round(client_s / (s["mbps"] * 1e6 * (args.runtime + args.ramp) / (1 << 30)), 4)
                    s["repeat"] = rep
                    state["results"].setdefault(key, {}).setdefault(prof.key, []).append(s)
                    line = (f"  {prof.label:<18} {LABELS[key]:<35} {fmt(s.get('mbps'), 0):>7} MB/s "
                            f"{fmt((s.get('iops') or 0) / 1000, 1):>6} k IOPS  bridge "
                            f"{fmt(s.get('server_cpu_s_per_gib'), 3)} s/GiB  busy {fmt(s.get('machine_busy'), 2)}")
                    log(line if s.get("ok") else line + f"  FAILED: {s.get('error')}")
            report(False)
    except (KeyboardInterrupt, BenchInterrupted) as e:
        warn(f"interrupted ({e}); reporting what was measured")
        rc = 130
    except Exception as e:  # noqa: BLE001 - report what ran
        warn(f"aborted: {e}")
        rc = 1
    finally:
        shutil.rmtree(rundir, ignore_errors=True)
    if state["results"]:
        report(True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
