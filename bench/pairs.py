#!/usr/bin/env python3
"""Alternating rounds of one fio profile against several NBD servers over TCP loopback: a quick
side-by-side check of two builds, or of a build against `nbdkit file` (docs/bench pages quote it
for before/after figures; bench/bridge.py and bench/tls.py are the full benchmarks).

    python3 bench/pairs.py seq1m-read 5 before=BINARY after=BINARY nbdkit
    python3 bench/pairs.py --tls seq1m-read 5 before=BINARY after=BINARY

Each SERVER is NAME=BINARY[:EXTRA SERVE ARGS] (a `cryptbridge serve --passthrough`, or with --tls an
AES-256-XTS export with 4096-byte sectors under `--tls on`, which then answers both an `nbd://` job
"NAME-plain" and an `nbds://` job "NAME-tls"), or `nbdkit` (`nbdkit file`). All servers share one
backing file in the page cache. Every round runs one job per server, the order rotated each round
and reversed every other one. Printed: each server's median MB/s, the median over rounds of its
ratio to the last server (with --tls: of each server's nbds:// job to its nbd:// job), and
the server's and fio's CPU seconds per GB moved.

Run it under the shared lock: `flock /work/bench.lock python3 bench/pairs.py ...`.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROFILES = {"seq1m-read": ("read", "1M", 8), "seq1m-write": ("write", "1M", 8),
            "rnd4k-read": ("randread", "4k", 32), "rnd4k-write": ("randwrite", "4k", 32)}


def cpu_seconds(pid):
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tls", action="store_true", help="XTS exports under --tls on: nbd:// and nbds:// jobs")
    ap.add_argument("--runtime", type=float, default=3.0, help="seconds per job after a 0.5 s ramp (default 3)")
    ap.add_argument("--size", type=int, default=1024, help="backing file MiB (default 1024)")
    ap.add_argument("profile", choices=sorted(PROFILES))
    ap.add_argument("rounds", type=int)
    ap.add_argument("servers", nargs="+")
    args = ap.parse_args()
    rw, bs, qd = PROFILES[args.profile]
    work = Path(tempfile.mkdtemp(prefix="cb-pairs-"))
    backing = work / "plain.img"
    with open(backing, "wb") as f:
        for _ in range(args.size // 64):
            f.write(os.urandom(64 << 20))
    env = dict(os.environ)
    if args.tls:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from tls import make_pki  # noqa: E402  (bench/tls.py: the same CA and certificates)
        certs, home = make_pki(work)
        env["HOME"] = str(home)  # libnbd finds the client's certificates under ~/.pki/libnbd
        key = work / "volume.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(64))
    jobs, procs, pids = [], [], {}
    port = 10930
    try:
        for spec in args.servers:
            name, _, rest = spec.partition("=")
            if name == "nbdkit":
                argv = ["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(port), "file", f"file={backing}"]
            else:
                binary, _, extra = rest.partition(":")
                mode = (["--key-file", str(key), "--cipher", "aes-xts-plain64", "--sector-size", "4096", "--tls", "on",
                         "--tls-certificates", str(certs)] if args.tls else ["--passthrough"])
                argv = [binary, "serve", "--backing", str(backing), *mode, "--listen", f"127.0.0.1:{port}", *extra.split()]
            p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(p)
            kinds = [("-plain", "nbd"), ("-tls", "nbds")] if args.tls and name != "nbdkit" else [("", "nbd")]
            for suffix, scheme in kinds:
                jobs.append((name + suffix, f"{scheme}://127.0.0.1:{port}/"))
                pids[name + suffix] = p.pid
            port += 1
        subprocess.run(["cat", str(backing)], stdout=subprocess.DEVNULL, check=True)
        time.sleep(1.0)
        mbps = {n: [] for n, _ in jobs}
        cpu = {n: [] for n, _ in jobs}
        print(f"{args.profile}, {args.rounds} rounds of {args.runtime:g} s; load average {os.getloadavg()[0]:.2f}", flush=True)
        for r in range(args.rounds):
            order = jobs[r % len(jobs):] + jobs[:r % len(jobs)]
            if r % 2:
                order.reverse()
            for name, uri in order:
                c0 = cpu_seconds(pids[name])
                out = subprocess.run(["fio", "--name=x", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
                                      f"--iodepth={qd}", "--numjobs=1", f"--size={args.size}M", "--time_based",
                                      f"--runtime={args.runtime}", "--ramp_time=0.5", "--norandommap", "--randrepeat=0",
                                      "--output-format=json"], capture_output=True, text=True, env=env, check=True).stdout
                j = json.loads(out[out.index("{"):])["jobs"][0]
                bw = (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / 1e6
                gb = bw * (args.runtime + 0.5) / 1e3
                fio_s = (j["usr_cpu"] + j["sys_cpu"]) / 100 * args.runtime
                mbps[name].append(bw)
                cpu[name].append(((cpu_seconds(pids[name]) - c0) / gb, fio_s / (bw * args.runtime / 1e3)))
            print(f"round {r + 1}: " + "  ".join(f"{n}={mbps[n][-1]:.0f}" for n, _ in jobs), flush=True)
        print(f"load average {os.getloadavg()[0]:.2f}; ratio: median over rounds of the round's pair "
              + ("(each server's nbds:// job / its nbd:// job)" if args.tls else f"(each server / {jobs[-1][0]})"))
        for n, _ in jobs:
            base = n.removesuffix("-tls") + "-plain" if args.tls and n.endswith("-tls") else n if args.tls else jobs[-1][0]
            ratios = [a / b for a, b in zip(mbps[n], mbps[base])]
            print(f"  {n:14} {statistics.median(mbps[n]):7.0f} MB/s  ratio {statistics.median(ratios):.3f} "
                  f"({' '.join(f'{x:.2f}' for x in ratios)})  server {statistics.median(c[0] for c in cpu[n]):.3f} s/GB"
                  f"  fio {statistics.median(c[1] for c in cpu[n]):.3f} s/GB")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
