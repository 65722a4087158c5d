#!/usr/bin/env python3
"""Interleaved A/B for the remote backing: one `nbdkit memory`, one bridge per binary in front of
it (same key; the export filled through the first), and short fio jobs (ioengine=nbd) rotated
over nbdkit alone and each bridge, round after round, so that every round compares them within
seconds of each other on a noisy machine. Prints each round and the medians of the ratios.

usage: remote_interleaved.py ROUNDS SECS PROFILES BINARY...   PROFILES: comma list of rw:bs:qd,
e.g. read:1m:8,write:1m:8,randread:4k:32,randwrite:4k:32. Run it under `flock /work/bench.lock`."""
import os, sys, subprocess, json, tempfile, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import wait_listening  # noqa: E402
rounds, secs, profs = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3].split(",")
bins = sys.argv[4:]
d = tempfile.mkdtemp(prefix="rcint")
up, key = f"{d}/up.sock", f"{d}/key"
fd = os.open(key, os.O_WRONLY|os.O_CREAT, 0o600); os.write(fd, os.urandom(64)); os.close(fd)
procs = [subprocess.Popen(["nbdkit", "-f", "-U", up, "memory", "512M"])]
wait_listening(up, procs[0], "nbdkit memory")
uris = {"direct": f"nbd+unix:///?socket={up}"}
for i, b in enumerate(bins):
    s = f"{d}/cb{i}.sock"
    procs.append(subprocess.Popen([b, "serve", "--backing", f"nbd+unix:///?socket={up}", "--key-file", key, "--unix", s], stderr=open(f"{d}/cb{i}.log", "w")))
    wait_listening(s, procs[-1], f"cryptbridge serve ({b})")
    uris[os.path.basename(b)] = f"nbd+unix:///?socket={s}"
subprocess.run(["nbdcopy", "--", "[", "nbdkit", "-r", "pattern", "512M", "]", list(uris.values())[1]], check=True)
names = list(uris)
res = {}
try:
  for r in range(rounds):
    for p in profs:
        rw, bs, qd = p.split(":")
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            out = f"{d}/fio.json"
            subprocess.run(["fio", "--name=x", "--ioengine=nbd", f"--uri={uris[n]}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}", "--numjobs=1", "--size=512M", "--time_based", f"--runtime={secs}", "--ramp_time=0.5", "--norandommap", "--randrepeat=0", "--output-format=json", f"--output={out}"], check=True, stdout=subprocess.DEVNULL)
            j = json.load(open(out))["jobs"][0]
            mbps = (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / 1e6
            res.setdefault(p, {}).setdefault(n, []).append(mbps)
        line = " ".join(f"{n}={res[p][n][-1]:.0f}" for n in names)
        rat = " ".join(f"{n}/direct={res[p][n][-1]/res[p]['direct'][-1]:.2f}" for n in names[1:])
        print(f"round {r} {p}: {line} | {rat} load {open('/proc/loadavg').read().split()[0]}", flush=True)
finally:
  for pr in procs: pr.terminate()
print("MEDIANS")
for p in profs:
    dd = res[p]["direct"]
    for n in names[1:]:
        ratios = [b/a for a, b in zip(dd, res[p][n])]
        print(f"{p} {n}: median ratio {statistics.median(ratios):.2f} ({' '.join(f'{x:.2f}' for x in ratios)}) median MB/s {statistics.median(res[p][n]):.0f} (direct {statistics.median(dd):.0f})")
    if len(names) == 3:
        rr = [b/a for a, b in zip(res[p][names[1]], res[p][names[2]])]
        print(f"{p} {names[2]}/{names[1]}: median {statistics.median(rr):.2f} ({' '.join(f'{x:.2f}' for x in rr)})")
