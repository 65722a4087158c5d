#!/usr/bin/env python3
"""Where the CPU goes per request, remote backing: one fio job (ioengine=nbd) against the bridge
in front of `nbdkit memory` (or, with --direct, against nbdkit alone), and the CPU time of fio,
nbdkit and the bridge per request from /proc/PID/stat (fio's from its own usr/sys figures).

usage: remote_cpu.py BINARY [RW BS QD SECS] [--direct] [--perf] [--strace]
  --perf    perf record -e cpu-clock -g on the bridge (to /tmp/rc/perf.data)
  --strace  strace -c -f on the bridge (to /tmp/rc/strace.txt)
Extra serve options in $CBARGS. Prints one JSON line. Run it under `flock /work/bench.lock`.
A measurement aid, not a benchmark: perf and strace slow the bridge down."""
import os, sys, subprocess, time, json, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import process_cpu_ticks, wait_listening  # noqa: E402
binp = sys.argv[1]
rw, bs, qd, secs = (sys.argv[2:6] + ["randread", "4k", "32", "4"][len(sys.argv[2:6]):])[:4]
perf = "--perf" in sys.argv; strace = "--strace" in sys.argv; direct = "--direct" in sys.argv
d = tempfile.mkdtemp(prefix="rcprof")
os.makedirs("/tmp/rc", exist_ok=True)
up, cb, key = f"{d}/up.sock", f"{d}/cb.sock", f"{d}/key"
fd = os.open(key, os.O_WRONLY|os.O_CREAT, 0o600); os.write(fd, os.urandom(64)); os.close(fd)
nb = subprocess.Popen(["nbdkit", "-f", "-U", up, "memory", "512M"])
wait_listening(up, nb, "nbdkit memory")
extra = os.environ.get("CBARGS", "").split()
br = subprocess.Popen([binp, "serve", "--backing", f"nbd+unix:///?socket={up}", "--key-file", key, "--unix", cb] + extra, stderr=open(f"{d}/cb.log","w"))
wait_listening(cb, br, "cryptbridge serve")
subprocess.run(["nbdcopy", "--", "[", "nbdkit", "-r", "pattern", "512M", "]", f"nbd+unix:///?socket={cb}"], check=True)
def ticks(pid):
    return process_cpu_ticks(pid) or 0
uri = f"nbd+unix:///?socket={up if direct else cb}"
fio = subprocess.Popen(["fio", "--name=x", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}", "--numjobs=1", "--size=512M", "--time_based", f"--runtime={int(secs)+1}", "--norandommap", "--randrepeat=0", "--output-format=json", f"--output={d}/fio.json"])
time.sleep(1.0)
t = {p: ticks(p) for p in (fio.pid, nb.pid, br.pid)}
t0 = time.time()
aux = None
if perf: aux = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-g", "-o", "/tmp/rc/perf.data", "-p", str(br.pid), "--", "sleep", str(int(secs)-1)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if strace: aux = subprocess.Popen(["timeout", "-s", "INT", str(int(secs)-1), "strace", "-c", "-f", "-o", "/tmp/rc/strace.txt", "-p", str(br.pid)])
fio.wait()
# the fio's ticks are lost after exit; sample before exit instead: approximate by using measurement window below
t1 = time.time()
t2 = {p: ticks(p) for p in (nb.pid, br.pid)}
if aux: aux.wait()
j = json.load(open(f"{d}/fio.json"))["jobs"][0]
io = j["read"]["io_bytes"] + j["write"]["io_bytes"]; n = j["read"]["total_ios"] + j["write"]["total_ios"]
rt = (j["read"]["runtime"] or j["write"]["runtime"]) / 1000
iops = n / rt
hz = os.sysconf("SC_CLK_TCK")
out = {"mbps": io/rt/1e6, "iops": iops, "fio_usr_sys_pct": (j["usr_cpu"] , j["sys_cpu"])}
for name, p in (("nbdkit", nb.pid), ("bridge", br.pid)):
    cpu = (t2[p]-t[p])/hz/(t1-t0)
    out[name+"_cores"] = round(cpu, 3); out[name+"_us_per_req"] = round(cpu/iops*1e6, 2)
out["fio_us_per_req"] = round((j["usr_cpu"]+j["sys_cpu"])/100/iops*1e6, 2)
print(json.dumps(out))
br.terminate(); nb.terminate(); br.wait(); nb.wait()
