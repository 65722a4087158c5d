#!/usr/bin/env python3
"""RTL test suite of the XTS-AES-256 core (run by `make -C rtl test`).

Expected values come only from the shared vectors (tests/vectors) and from the software
engine, `target/release/cryptbridge cipher --cipher 'xts(aes)'` (built with cargo when missing;
there is no fallback). Nothing is taken from the RTL itself.

Steps:
  1. AES-256 KATs (NIST CAVP ECB*256, SP 800-38A ECB): all of them in Verilator (tb_aes_kat, unified
     and encrypt-only pipelines), a subset in Icarus.
  2. XTS-AES-256 vectors (IEEE 1619 via botan, Wycheproof; whole blocks) through xts_top in Icarus
     (tb_xts_vec, also checks that reset zeroes every key register) and in Verilator (xts_sim test).
  3. >= 200 random sectors of 512 and of 4096 bytes, random direction/LBA, keys reloaded between
     sectors mid-stream, random idle input cycles and output back-pressure, bypass sectors, a
     wrong-length sector: checked against cryptbridge; CSR counters checked against the
     testbench's own counts.
  4. Reset in mid-stream.
  5. Performance: back-to-back sectors with no idle/back-pressure: latency in cycles and
     throughput in blocks/cycle (must be exactly 1, no bubble at sector boundaries).
Options: --quick (fewer random sectors, for development), --seed N.
"""
import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RTL = os.path.dirname(HERE)
REPO = os.path.dirname(RTL)
BUILD = os.path.join(RTL, "build")
WORK = os.path.join(BUILD, "tests")
sys.path.insert(0, HERE)
import vectors  # noqa: E402

RTL_FILES = open(os.path.join(RTL, "sources.f")).read().split()

results = []      # (name, ok, detail)
metrics = {}


def log(msg):
    print(msg, flush=True)


def record(name, ok, detail=""):
    results.append((name, ok, detail))
    log(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")


def run(cmd, timeout=600, **kw):
    t = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, **kw)
    return p.returncode, p.stdout, time.time() - t


# ---------------------------------------------------------------- reference: cryptbridge

def cryptbridge():
    # CRYPTBRIDGE names another build of the same binary (used by tests/mutants.py on copies)
    exe = os.environ.get("CRYPTBRIDGE") or os.path.join(REPO, "target", "release", "cryptbridge")
    if not os.path.exists(exe):
        log("cryptbridge binary missing: cargo build --release --locked")
        rc, out, _ = run(["cargo", "build", "--release", "--locked", "-j", "2"], timeout=1800, cwd=REPO)
        if rc != 0 or not os.path.exists(exe):
            print(out[-3000:])
            raise SystemExit("FAIL: cannot build the reference implementation (target/release/cryptbridge)")
    return exe


def reference(jobs):
    """jobs: list of (decrypt, key64, tweak16, data) -> list of result bytes, from cryptbridge."""
    exe = cryptbridge()
    out = [None] * len(jobs)
    for dec in (0, 1):
        idx = [i for i, j in enumerate(jobs) if j[0] == dec]
        if not idx:
            continue
        lines = "".join(f"{jobs[i][1].hex()} {jobs[i][2].hex()} {jobs[i][3].hex()}\n" for i in idx)
        cmd = [exe, "cipher", "--cipher", "xts(aes)"] + (["--decrypt"] if dec else [])
        p = subprocess.run(cmd, input=lines, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
        res = p.stdout.split("\n")
        if p.returncode != 0 or len(res) < len(idx):
            raise SystemExit(f"FAIL: cryptbridge cipher exited {p.returncode}: {p.stderr[-500:]}")
        for i, line in zip(idx, res):
            if line.startswith("error"):
                raise SystemExit(f"FAIL: cryptbridge cipher: {line}")
            out[i] = bytes.fromhex(line.strip())
            assert len(out[i]) == len(jobs[i][3])
    return out


# ---------------------------------------------------------------- job files for xts_sim test

class Job:
    def __init__(self):
        self.lines = []

    def ctrl(self, mode, ssize):
        self.lines.append(f"CTRL {mode} {ssize}")

    def keys(self, key64):
        self.lines.append(f"KEYS {key64[:32].hex()} {key64[32:].hex()}")

    def sector(self, enc, tweak16, data, expected, lenerr=False):
        assert len(data) % 16 == 0 and len(expected) == len(data)
        self.lines.append(f"SEC {1 if enc else 0} {tweak16.hex()} {len(data) // 16} {data.hex()} {expected.hex()} {int(lenerr)}")

    def reset(self, delay):
        self.lines.append(f"RESET {delay}")

    def check(self):
        self.lines.append("CHECK")

    def write(self, name):
        path = os.path.join(WORK, name)
        with open(path, "w") as f:
            f.write("\n".join(self.lines) + "\n")
        return path


MODE_AUTO, MODE_ENC, MODE_DEC, MODE_BYPASS = 0, 1, 2, 3
SS_512, SS_4096, SS_ANY = 0, 1, 2


def rand_tweak(rng):
    r = rng.random()
    if r < 0.1:
        n = rng.randrange(0, 64)
    elif r < 0.2:
        n = (1 << 64) - 1 - rng.randrange(0, 64)          # carries through all 8 bytes
    elif r < 0.3:
        n = rng.getrandbits(128)                           # full 16-byte tweak
    else:
        n = rng.getrandbits(rng.choice([32, 40, 48, 64]))
    return n.to_bytes(16, "little")


def rand_key(rng):
    while True:
        k = rng.randbytes(64)
        if k[:32] != k[32:]:
            return k


def xts_sim(job, idle, stall, seed, label):
    exe = os.path.join(BUILD, "xts_sim")
    rc, out, dt = run([exe, "test", job, "--idle", str(idle), "--stall", str(stall), "--seed", str(seed)], timeout=900)
    m = {}
    for line in out.splitlines():
        mm = re.match(r"METRIC (\S+) (.*)", line)
        if mm:
            m[mm.group(1)] = mm.group(2)
    ok = rc == 0 and out.rstrip().endswith("PASS")
    if not ok:
        print(out[-4000:])
    return ok, m, dt


def num(m, k):
    return float(m[k]) if "." in m[k] else int(m[k])


# ---------------------------------------------------------------- steps

def step_aes_kat(quick):
    vec = vectors.aes256_ecb()
    path = os.path.join(WORK, "aes_kat.hex")
    with open(path, "w") as f:
        for _, dec, key, src, exp in vec:
            f.write(f"{dec:01x}{vectors.le_hex(key)}{vectors.le_hex(src)}{vectors.le_hex(exp)}\n")
    rc, out, dt = run([os.path.join(BUILD, "tb_aes_kat"), f"+vec={path}", f"+n={len(vec)}"])
    ok = rc == 0 and "PASS aes_kat" in out
    lat = re.search(r"latency (\d+)", out)
    if lat:
        metrics["aes_pipe_latency"] = int(lat.group(1))
    record("aes256 KAT, Verilator (unified + encrypt-only pipelines)", ok,
           f"{len(vec)} vectors, {dt:.1f}s" if ok else out[-2000:])

    # Icarus: every GFSbox/KeySbox/SP 800-38A vector and every 16th VarKey/VarTxt one
    sub = [v for i, v in enumerate(vec) if not ("VarKey" in v[0] or "VarTxt" in v[0]) or i % 16 == 0]
    if quick:
        sub = sub[:12]
    path2 = os.path.join(WORK, "aes_kat_subset.hex")
    with open(path2, "w") as f:
        for _, dec, key, src, exp in sub:
            f.write(f"{dec:01x}{vectors.le_hex(key)}{vectors.le_hex(src)}{vectors.le_hex(exp)}\n")
    vvp = os.path.join(WORK, "tb_aes_kat.vvp")
    rc, out, _ = run(["iverilog", "-g2005", "-I", RTL, "-o", vvp, os.path.join(HERE, "tb_aes_kat.v")] +
                     [os.path.join(RTL, f) for f in RTL_FILES])
    if rc == 0:
        rc, out, dt = run(["vvp", "-n", vvp, f"+vec={path2}", f"+n={len(sub)}"])
    ok = rc == 0 and "PASS aes_kat" in out
    record("aes256 KAT, Icarus (subset)", ok, f"{len(sub)} vectors, {dt:.1f}s" if ok else out[-2000:])


def step_xts_vectors():
    vec, skipped = vectors.xts256()
    # Icarus: tb_xts_vec
    path = os.path.join(WORK, "xts_vec.hex")
    with open(path, "w") as f:
        for _, key, tw, pt, ct in vec:
            nb = len(pt) // 16
            f.write(f"{nb:064x}\n{vectors.le_hex(key[:32])}\n{vectors.le_hex(key[32:])}\n{vectors.le_hex(tw).rjust(64, '0')}\n")
            for d in (pt, ct):
                for b in range(nb):
                    f.write(vectors.le_hex(d[16 * b:16 * b + 16]).rjust(64, "0") + "\n")
    vvp = os.path.join(WORK, "tb_xts_vec.vvp")
    rc, out, _ = run(["iverilog", "-g2005", "-I", RTL, "-o", vvp, os.path.join(HERE, "tb_xts_vec.v")] +
                     [os.path.join(RTL, f) for f in RTL_FILES])
    dt = 0
    if rc == 0:
        rc, out, dt = run(["vvp", "-n", vvp, f"+vec={path}", f"+n={len(vec)}"])
    ok = rc == 0 and "PASS xts_vec" in out
    record("XTS-AES-256 vectors, Icarus (xts_top over AXI4-Lite; key registers zero after reset)", ok,
           f"{len(vec)} vectors x 2 directions ({skipped} ciphertext-stealing vectors not applicable), {dt:.1f}s"
           if ok else out[-2000:])

    # Verilator: same vectors through the cycle-level testbench, with and without idle/stall
    job = Job()
    job.ctrl(MODE_AUTO, SS_ANY)
    for _, key, tw, pt, ct in vec:
        job.keys(key)
        job.sector(True, tw, pt, ct)
        job.sector(False, tw, ct, pt)
    job.check()
    path = job.write("xts_vectors.job")
    for idle, stall in ((0.0, 0.0), (0.3, 0.4)):
        ok, m, dt = xts_sim(path, idle, stall, 11, "vectors")
        record(f"XTS-AES-256 vectors, Verilator (idle {idle}, back-pressure {stall})", ok,
               f"{len(vec)} x 2 sectors, {dt:.1f}s")


def step_random(seed, quick):
    rng = random.Random(seed)
    n_per_size = 20 if quick else 200
    job = Job()
    jobs = []            # reference jobs, in order
    recs = []            # (kind, args) to emit after the reference ran

    def sec(key, size, enc=None, lenerr_blocks=None):
        enc = rng.random() < 0.5 if enc is None else enc
        tw = rand_tweak(rng)
        nbytes = size if lenerr_blocks is None else 16 * lenerr_blocks
        data = rng.randbytes(nbytes)
        jobs.append((0 if enc else 1, key, tw, data))
        recs.append(("sec", enc, tw, data, len(jobs) - 1, lenerr_blocks is not None))

    keys = [rand_key(rng) for _ in range(3)]
    recs.append(("keys", keys[0]))
    recs.append(("ctrl", MODE_AUTO, SS_512))
    for i in range(n_per_size):
        if i == n_per_size // 2:
            recs.append(("keys", keys[1]))      # reload between sectors, mid-stream
        sec(keys[0] if i < n_per_size // 2 else keys[1], 512)
    recs.append(("check",))
    recs.append(("ctrl", MODE_AUTO, SS_4096))
    for i in range(n_per_size):
        if i == n_per_size // 2:
            recs.append(("keys", keys[2]))
        sec(keys[1] if i < n_per_size // 2 else keys[2], 4096)
    recs.append(("check",))
    # bypass sectors between XTS sectors (mode switches between sectors)
    recs.append(("ctrl", MODE_BYPASS, SS_512))
    bypass = [rng.randbytes(512) for _ in range(8)]
    for b in bypass:
        recs.append(("bypass", rand_tweak(rng), b))
    recs.append(("ctrl", MODE_AUTO, SS_512))
    for _ in range(8):
        sec(keys[2], 512)
    recs.append(("ctrl", MODE_BYPASS, SS_4096))
    recs.append(("bypass", rand_tweak(rng), rng.randbytes(4096)))
    # forced directions: MODE_ENC / MODE_DEC ignore s_dir
    recs.append(("ctrl", MODE_ENC, SS_4096))
    sec(keys[2], 4096, enc=True)
    recs.append(("forced", "enc"))
    recs.append(("ctrl", MODE_DEC, SS_512))
    sec(keys[2], 512, enc=False)
    recs.append(("forced", "dec"))
    # a sector of the wrong length for SSIZE (31 blocks with SSIZE = 512) sets LEN_ERR
    recs.append(("ctrl", MODE_AUTO, SS_512))
    sec(keys[2], 512, lenerr_blocks=31)
    sec(keys[2], 512)
    recs.append(("check",))

    t = time.time()
    ref = reference(jobs)
    ref_dt = time.time() - t
    nsec = {512: 0, 4096: 0}
    forced_dir = None
    pending = []
    for r in recs:
        if r[0] == "keys":
            job.keys(r[1])
        elif r[0] == "ctrl":
            job.ctrl(r[1], r[2])
        elif r[0] == "check":
            job.check()
        elif r[0] == "bypass":
            job.sector(rng.random() < 0.5, r[1], r[2], r[2])
            nsec[len(r[2])] = nsec.get(len(r[2]), 0) + 1
        elif r[0] == "forced":
            # the sector just emitted had its s_dir chosen by the generator; flip s_dir on the
            # wire so that only CTRL.MODE can produce the right answer
            last = job.lines[-1].split()
            last[1] = "0" if r[1] == "enc" else "1"
            job.lines[-1] = " ".join(last)
        elif r[0] == "sec":
            _, enc, tw, data, ji, lenerr = r
            job.sector(enc, tw, data, ref[ji], lenerr)
            nsec[len(data)] = nsec.get(len(data), 0) + 1
    path = job.write("random.job")
    ok, m, dt = xts_sim(path, 0.25, 0.35, seed, "random")
    record("random sectors vs cryptbridge (idle 0.25, back-pressure 0.35, key reloads, bypass, forced modes, "
           "length error; CSR counters)", ok,
           f"{nsec.get(512, 0)} x 512 B + {nsec.get(4096, 0)} x 4096 B (+1 short), reference {ref_dt:.1f}s, sim {dt:.1f}s")
    metrics["random_sectors_512"] = nsec.get(512, 0)
    metrics["random_sectors_4096"] = nsec.get(4096, 0)
    return ok


def step_reset(seed):
    rng = random.Random(seed + 1)
    jobs = []
    plan = []
    k1, k2 = rand_key(rng), rand_key(rng)
    for i in range(7):
        d = rng.randbytes(512)
        tw = rand_tweak(rng)
        enc = rng.random() < 0.5
        jobs.append((0 if enc else 1, k1, tw, d))
    for i in range(6):
        d = rng.randbytes(512)
        tw = rand_tweak(rng)
        enc = rng.random() < 0.5
        jobs.append((0 if enc else 1, k2, tw, d))
    ref = reference(jobs)
    ok_all = True
    for delay in (5, 20, 29):
        job = Job()
        job.keys(k1)
        job.ctrl(MODE_AUTO, SS_512)
        for i in range(7):
            job.sector(jobs[i][0] == 0, jobs[i][2], jobs[i][3], ref[i])
        job.reset(delay)          # 'delay' cycles after the 7th sector started: mid-sector, pipeline full
        job.ctrl(MODE_BYPASS, SS_512)
        b = rng.randbytes(512)
        job.sector(True, rand_tweak(rng), b, b)      # bypass needs no keys
        job.ctrl(MODE_AUTO, SS_512)
        job.keys(k2)
        for i in range(7, 13):
            job.sector(jobs[i][0] == 0, jobs[i][2], jobs[i][3], ref[i])
        job.check()
        path = job.write(f"reset_{delay}.job")
        ok, m, dt = xts_sim(path, 0.1, 0.2, seed + delay, "reset")
        ok_all &= ok
        record(f"reset mid-stream ({delay} cycles into a sector; then no stale output, keys gone, "
               "keyless XTS held, bypass, reload)", ok, f"{m.get('reset_inflight_blocks', '?')} blocks in flight at reset")
    return ok_all


def step_perf(seed):
    rng = random.Random(seed + 2)
    for size, n in ((512, 64), (4096, 12)):
        key = rand_key(rng)
        jobs = []
        for i in range(n):
            jobs.append((i % 2, key, rand_tweak(rng), rng.randbytes(size)))     # alternate enc/dec
        ref = reference(jobs)
        job = Job()
        job.keys(key)
        job.ctrl(MODE_AUTO, SS_512 if size == 512 else SS_4096)
        for j, r in zip(jobs, ref):
            job.sector(j[0] == 0, j[2], j[3], r)
        job.check()
        path = job.write(f"perf_{size}.job")
        ok, m, dt = xts_sim(path, 0.0, 0.0, seed, "perf")
        blocks = num(m, "blocks_out")
        span = num(m, "out_span_cycles")
        lat_min, lat_max = num(m, "latency_min"), num(m, "latency_max")
        thr = blocks / span if span else 0
        full = ok and blocks == n * size // 16 and span == blocks and num(m, "boundary_gaps") == 0 \
            and num(m, "stall_in_after_first") == 0 and lat_min == lat_max
        metrics[f"latency_{size}"] = lat_min
        metrics[f"throughput_{size}"] = thr
        metrics[f"blocks_{size}"] = blocks
        metrics[f"span_{size}"] = span
        record(f"throughput/latency, {n} back-to-back {size}-byte sectors alternating encrypt/decrypt", full,
               f"{blocks} blocks out in {span} cycles = {thr:.4f} blocks/cycle; latency {lat_min}..{lat_max} cycles; "
               f"{m.get('boundary_gaps')} gaps at sector boundaries; {m.get('stall_in_after_first')} input stalls")


def step_coproc(seed):
    sys.path.insert(0, os.path.join(RTL, "tools"))
    import xts_sim_client as xc
    rng = random.Random(seed + 3)
    sim = xc.XtsSim(os.path.join(BUILD, "xts_sim"))
    problems = []
    try:
        try:
            sim.encrypt(b"\0" * 512, 512, 0)
            problems.append("ENCRYPT without keys did not fail")
        except xc.XtsSimError:
            pass
        key = rand_key(rng)
        sim.set_keys(key)
        speed = []
        for size, n, dec in ((4096, 64, False), (512, 256, True), (4096, 16, True), (512, 64, False)):
            data = rng.randbytes(size * n)
            first = rng.getrandbits(60)
            step = size // 512
            out = (sim.decrypt if dec else sim.encrypt)(data, size, first, step)
            cycles, _, wall = sim.last
            speed.append((cycles, wall, len(data)))
            jobs = [(1 if dec else 0, key, ((first + i * step) % (1 << 128)).to_bytes(16, "little"),
                     data[i * size:(i + 1) * size]) for i in range(n)]
            ref = b"".join(reference(jobs))
            if out != ref:
                problems.append(f"{'decrypt' if dec else 'encrypt'} {n} x {size}: result differs from cryptbridge")
            if cycles > len(data) // 16 + 64:
                problems.append(f"{n} x {size}: {cycles} cycles for {len(data) // 16} blocks")
        b = rng.randbytes(4096)
        if sim.bypass(b, 512) != b:
            problems.append("BYPASS changed the data")
        st = sim.stats()
        if st["id"] != 0x58545331 or st["stall_in"] != 0 or st["sectors"] != 64 + 256 + 16 + 64 + 8:
            problems.append(f"STATS {st}")
        try:
            sim.encrypt(b"\0" * 100, 100, 0)
            problems.append("sector size 100 accepted")
        except xc.XtsSimError:
            pass
        # KEY_CLEAR: keys gone (XTS refused), then a new key works
        sim.call(xc.OP_CLEAR_KEYS)
        if sim.stats()["status"] & 1:
            problems.append("KEY_VALID still set after CLEAR_KEYS")
        try:
            sim.encrypt(b"\0" * 512, 512, 0)
            problems.append("ENCRYPT accepted after CLEAR_KEYS")
        except xc.XtsSimError:
            pass
        key2 = rand_key(rng)
        sim.set_keys(key2)
        data = rng.randbytes(2048)
        if sim.encrypt(data, 512, 9, 1) != b"".join(reference(
                [(0, key2, (9 + i).to_bytes(16, "little"), data[512 * i:512 * (i + 1)]) for i in range(4)])):
            problems.append("encrypt after CLEAR_KEYS + SET_KEYS differs from cryptbridge")
    finally:
        sim.close()
    cyc = sum(c for c, _, _ in speed)
    ns = sum(w for _, w, _ in speed)
    nbytes = sum(n for _, _, n in speed)
    metrics["coproc_cycles_per_s"] = round(cyc / (ns / 1e9))
    metrics["coproc_MB_per_s"] = round(nbytes / (ns / 1e9) / 1e6, 2)
    record("co-process xts_sim serve (framing; results vs cryptbridge; errors; STATS; KEY_CLEAR)", not problems,
           "; ".join(problems) if problems else
           f"{nbytes} bytes in {cyc} simulated cycles; {metrics['coproc_cycles_per_s']} cycles/s, "
           f"{metrics['coproc_MB_per_s']} MB/s of simulation")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("RTL_TEST_SEED", "20261122")))
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    os.makedirs(WORK, exist_ok=True)
    for tool in ("iverilog", "vvp"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} missing: run rtl/install-deps.sh")
    for exe in ("xts_sim", "tb_aes_kat"):
        if not os.path.exists(os.path.join(BUILD, exe)):
            raise SystemExit(f"{exe} missing: run make -C rtl test")
    t0 = time.time()
    log(f"rtl tests: seed {a.seed}; vectors from {vectors.vectors_dir()}; reference {cryptbridge()}")
    steps = [("aes", lambda: step_aes_kat(a.quick)), ("xts", step_xts_vectors),
             ("random", lambda: step_random(a.seed, a.quick)), ("reset", lambda: step_reset(a.seed)),
             ("perf", lambda: step_perf(a.seed)), ("coproc", lambda: step_coproc(a.seed))]
    for name, fn in steps:
        if a.only and name not in a.only.split(","):
            continue
        fn()
    dt = time.time() - t0
    fails = [r for r in results if not r[1]]
    summary = [f"rtl tests: {len(results) - len(fails)}/{len(results)} passed in {dt:.0f}s (seed {a.seed})"]
    for k in ("aes_pipe_latency", "latency_512", "throughput_512", "latency_4096", "throughput_4096",
              "coproc_cycles_per_s", "coproc_MB_per_s"):
        if k in metrics:
            summary.append(f"  {k} = {metrics[k]}")
    log("\n".join(summary))
    with open(os.path.join(BUILD, "test-summary.txt"), "w") as f:
        for n, ok, d in results:
            f.write(f"{'PASS' if ok else 'FAIL'} {n}: {d}\n")
        f.write("\n".join(summary) + "\n")
    sys.exit(1 if fails or not results else 0)


if __name__ == "__main__":
    main()
