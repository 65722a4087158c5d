#!/usr/bin/env python3
"""TLS benchmark: the same cryptbridge server (`serve --tls on`, AES-256-XTS, page-cache backing)
through nbd:// and through nbds:// (STARTTLS), with fio's nbd engine (libnbd, GnuTLS).

A benchmark, not a test: the target (TLS >= 0.8 x plaintext per profile) is reported as PASS/MISS and
the exit status is 0 whenever the measurements ran (1 for a setup failure: a missing tool or binary).

With `--tls on` one server answers both kinds of client, so a pair (plaintext job, TLS job) differs
only in TLS. Pairs alternate their order every repeat; the ratio is the median over repeats of the
per-pair ratio (the machine's speed drifts over a run, the two jobs of a pair run back to back).

fio's nbd engine calls nbd_connect_uri without allowing the URI to name local files, so
`?tls-certificates=` is not accepted there: fio runs with HOME set to a directory whose
.pki/libnbd/ holds the client's certificates, libnbd's default place.

With --peer, nbdkit (`nbdkit --tls=on file`, the same backing file, no encryption of the
sectors) runs beside it and gets the same pairs: nbdkit's TLS/plain ratio with the same client
on the same machine, the peer's figure for the target.

Per job it also records the CPU time of the server (utime+stime from /proc) and of fio (its
usr+sys), per GiB moved: on 2 vCPUs client and server share the machine, and this shows where TLS
costs.

A passthrough server, "cryptbridge-pt" (`serve --passthrough --tls on`, its own copy of the
backing file: cryptbridge locks a served image), gets the same pairs (--no-passthrough leaves it
out). The "encryption overhead" table gives, per profile and kind of job, cryptbridge minus
cryptbridge-pt server CPU s/GiB in the same repeat (median), next to the cipher's own cost per GiB
from `cryptbridge bench cipher` (one thread, AES-256-XTS, 4096-byte sectors, the CPU level the
servers run; measured once per run). With more than one cryptbridge server the servers' order
rotates every profile and repeat.

With --baseline BINARY a second `serve --tls on`, "cryptbridge@base", runs from BINARY with the
same arguments (its own port, and its own copy of the backing file: cryptbridge locks a served
image, one writer at a time) and gets the same pairs: a before/after check of two builds in one
run. The servers' order then rotates every profile and repeat (without --baseline it stays
fixed, as before), so neither build always goes first. The report gets an "after / before"
section: per profile and kind of job (nbd://, nbds://), the median over repeats of this build's
MB/s / the baseline's in the same repeat, and each one's server CPU seconds per GiB.

Outputs: bench/out/tls.json and bench/out/tls.md (paste into a dated page under docs/bench/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
    cipher_cost,
    cpu_header,
    cpu_s_per_gib,
    environment,
    fmt,
    free_port,
    kill_group,
    log,
    median,
    overhead_md,
    overhead_row,
    process_cpu_seconds,
    run,
    shjoin,
    spawn,
    tool_version,
    verdict,
    wait_listening,
    write_json,
)

MiB = 1 << 20
TARGET = 0.8


@dataclasses.dataclass(frozen=True)
class Profile:
    key: str
    rw: str
    bs: str
    iodepth: int
    numjobs: int = 1
    nbdcopy: bool = False


PROFILES = [
    Profile("SEQ1M Q8T1 read", "read", "1M", 8),
    Profile("SEQ1M Q8T1 write", "write", "1M", 8),
    Profile("RND4K Q32T1 read", "randread", "4k", 32),
    Profile("RND4K Q32T1 write", "randwrite", "4k", 32),
    Profile("RND4K Q1T1 read", "randread", "4k", 1),
    # One fio job is one connection and one client thread, which does all of the client's TLS
    # work; nbdcopy (4 connections, a thread each, 256 KiB requests) spreads it over the CPUs.
    Profile("nbdcopy read", "read", "256k", 64, 4, True),
    Profile("nbdcopy write", "write", "256k", 64, 4, True),
]


def make_pki(d: Path) -> tuple[Path, Path]:
    """CA, server certificate (for 127.0.0.1) and client certificate by openssl; returns the
    server's certificate directory and a HOME whose .pki/libnbd holds the client's."""
    def ossl(*args):
        r = run(["openssl", *args], timeout=120, cwd=d)
        if r.returncode != 0:
            raise SystemExit(f"openssl {' '.join(map(str, args))} failed: {r.stderr.strip()}")

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=bench-ca", "-days", "2",
         "-keyout", "ca-key.pem", "-out", "ca-cert.pem")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{name}.ext").write_text(ext + "\n")
        ossl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
             "-keyout", f"{name}-key.pem", "-out", f"{name}.csr")
        ossl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca-cert.pem", "-CAkey", "ca-key.pem",
             "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}-cert.pem")
    server = d / "server"
    server.mkdir()
    for f in ("ca-cert.pem", "server-cert.pem", "server-key.pem"):
        shutil.copy(d / f, server / f)
    home = d / "home"
    libnbd = home / ".pki" / "libnbd"
    libnbd.mkdir(parents=True)
    for f in ("ca-cert.pem", "client-cert.pem", "client-key.pem"):
        shutil.copy(d / f, libnbd / f)
    for p in list(server.glob("*key.pem")) + list(libnbd.glob("*key.pem")):
        os.chmod(p, 0o600)
    return server, home


def nbdcopy_job(uri: str, prof: Profile, size: int, src: Path, certs_home: Path, server_pid: int) -> dict:
    """nbdcopy of the whole export to null: (read) or of `src` onto it (write); MB/s of wall time."""
    if uri.startswith("nbds://"):
        uri += f"?tls-certificates={certs_home / '.pki' / 'libnbd'}"
    argv = ["nbdcopy", f"--request-size={256 * 1024}", f"--connections={prof.numjobs}"]
    argv += [uri, "null:"] if prof.rw == "read" else ["--flush", src, uri]
    srv0 = process_cpu_seconds(server_pid)
    t0 = time.monotonic()
    r = run(argv, timeout=600)
    wall = time.monotonic() - t0
    srv1 = process_cpu_seconds(server_pid)
    if r.returncode != 0:
        return {"ok": False, "error": f"nbdcopy rc={r.returncode}: {r.stderr.strip()[-400:]}"}
    moved = (size if prof.rw == "read" else src.stat().st_size) / 1e9
    sample = {"ok": True, "mbps": moved * 1e3 / wall}
    if srv0 is not None and srv1 is not None:
        sample["server_cpu_s_per_gb"] = (srv1 - srv0) / moved
        sample["server_cpu_s_per_gib"] = cpu_s_per_gib(srv0, srv1, moved * 1e9)
    return sample


def fio_job(uri: str, prof: Profile, size: int, runtime: float, out_json: Path, home: Path, server_pid: int) -> dict:
    argv = ["fio", "--name=job", "--ioengine=nbd", f"--uri={uri}", f"--rw={prof.rw}", f"--bs={prof.bs}",
            f"--iodepth={prof.iodepth}", "--numjobs=1", f"--size={size}", "--time_based",
            f"--runtime={runtime}s", "--ramp_time=0.5s", "--norandommap", "--randrepeat=0",
            "--output-format=json", f"--output={out_json}"]
    out_json.unlink(missing_ok=True)
    env = dict(os.environ, HOME=str(home))
    srv0 = process_cpu_seconds(server_pid)
    r = run(argv, timeout=runtime + 60, env=env)
    srv1 = process_cpu_seconds(server_pid)
    try:
        job = json.loads(out_json.read_text())["jobs"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return {"ok": False, "error": f"fio rc={r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}"}
    rbw, wbw = job["read"]["bw_bytes"], job["write"]["bw_bytes"]
    moved_gb = (job["read"]["io_bytes"] + job["write"]["io_bytes"]) / 1e9
    # fio's cpu usage is a percentage of its run time (ramp excluded), like its bandwidth.
    fio_cpu = (job.get("usr_cpu", 0) + job.get("sys_cpu", 0)) / 100 * job.get("job_runtime", 0) / 1000
    sample = {"ok": r.returncode == 0 and job.get("error", 0) == 0 and rbw + wbw > 0, "mbps": (rbw + wbw) / 1e6}
    if moved_gb > 0:
        sample["fio_cpu_s_per_gb"] = fio_cpu / moved_gb
        sample["fio_cpu_s_per_gib"] = fio_cpu / (moved_gb * 1e9 / (1 << 30))
        if srv0 is not None and srv1 is not None:
            # Server CPU over the whole job, ramp included, against the bytes of the measured part:
            # an upper bound, the same for both kinds of job.
            sample["server_cpu_s_per_gb"] = (srv1 - srv0) / moved_gb
            sample["server_cpu_s_per_gib"] = cpu_s_per_gib(srv0, srv1, moved_gb * 1e9)
    return sample


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=DEFAULT_BINARY)
    ap.add_argument("--baseline", type=Path, default=None, metavar="BINARY",
                    help="also run the server from BINARY as \"cryptbridge@base\" in the same pairs; report after / before")
    ap.add_argument("--repeats", type=int, default=7, help="pairs per profile (default 7)")
    ap.add_argument("--runtime", type=float, default=3.0, help="seconds per fio job (default 3)")
    ap.add_argument("--size", default="1G", help="export size (default 1G)")
    ap.add_argument("--quick", action="store_true", help="2 repeats of 2 s")
    ap.add_argument("--only", help="run the profiles whose name contains this (e.g. SEQ1M)")
    ap.add_argument("--peer", action="store_true", help="also measure nbdkit file --tls=on's TLS/plain (see above)")
    ap.add_argument("--no-passthrough", action="store_true",
                    help="leave out the passthrough server (serve --passthrough --tls on); no encryption overhead table")
    ap.add_argument("--cipher-seconds", type=float, default=None,
                    help="seconds per measurement of `cryptbridge bench cipher` (default 2, quick 0.5; 0 skips it)")
    ap.add_argument("--workdir", type=Path, help="where the backing file and certificates go (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.runtime = 2, 2.0
    profiles = [p for p in PROFILES if args.only is None or args.only in p.key]
    for tool in ("fio", "openssl", "nbdcopy"):
        if shutil.which(tool) is None:
            print(f"{tool} not found (scripts/install-deps.sh)", file=sys.stderr)
            return 1
    if not args.binary.exists():
        print(f"{args.binary} not found: cargo build --release", file=sys.stderr)
        return 1
    if args.baseline is not None and not args.baseline.exists():
        print(f"{args.baseline} (--baseline) not found", file=sys.stderr)
        return 1
    size = int(args.size[:-1]) << {"M": 20, "G": 30}[args.size[-1]] if args.size[-1] in "MG" else int(args.size)
    env_info = environment(args.binary)
    env_info["fio"] = tool_version(["fio", "--version"])
    env_info["libnbd"] = tool_version(["nbdinfo", "--version"])
    if args.baseline is not None:
        env_info["cryptbridge_baseline"] = tool_version([args.baseline, "--version"])
    OUT.mkdir(parents=True, exist_ok=True)
    fio_dir = OUT / "fio-tls"
    fio_dir.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cb-tls-", dir=args.workdir))
    server = peer = base = pt = None
    cost = None
    cipher_s = args.cipher_seconds if args.cipher_seconds is not None else (0.5 if args.quick else 2.0)
    if cipher_s > 0:
        cost = cipher_cost(args.binary, "aes-xts-plain64", 512, 4096, cipher_s)
        if "error" in cost:
            print(f"warning: bench cipher: {cost['error']}", file=sys.stderr)
    try:
        certs, home = make_pki(work)
        key = work / "volume.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(64))
        src = work / "source.img"  # nbdcopy write's source: 512 MiB of random bytes
        with open(src, "wb") as f:
            for _ in range(8):
                f.write(os.urandom(64 * MiB))
        def fill(path):
            # Random bytes: reads decrypt real data, the file is in the page cache. Every backing is
            # written the same way: how a file's page cache was filled (a copy, or 64 MiB writes)
            # changed 4 KiB random-write speed on it by 2x here, whichever server wrote to it.
            with open(path, "wb") as f:
                for _ in range(size // (64 * MiB)):
                    f.write(os.urandom(64 * MiB))

        backing = work / "volume.img"
        fill(backing)
        def serve_argv(binary, backing, passthrough=False):
            mode = ["--passthrough"] if passthrough else ["--key-file", key, "--cipher", "aes-xts-plain64",
                                                           "--sector-size", "4096"]
            return [binary, "serve", "--backing", backing, *mode, "--listen", "127.0.0.1:0", "--tls", "on",
                    "--tls-certificates", certs]

        def start(argv, name):
            stdout = open(work / f"{name}.stdout", "w+")
            proc = spawn(argv, stdout, open(work / f"{name}.stderr", "w"))
            deadline = time.monotonic() + 30
            ready = ""
            while time.monotonic() < deadline and not ready.endswith("\n"):
                stdout.seek(0)
                ready = stdout.read()
                if proc.poll() is not None:
                    raise SystemExit(f"{name} exited: {(work / f'{name}.stderr').read_text()[-2000:]}")
                time.sleep(0.05)
            tls_uri = ready.split()[1]
            plain_uri = tls_uri.replace("nbds://", "nbd://", 1)
            log(f"{name} {shjoin(argv)}\n  {plain_uri} and {tls_uri}")
            return proc, plain_uri, tls_uri

        argv = serve_argv(args.binary, backing)
        server, plain_uri, tls_uri = start(argv, "server")
        # Each server: (its pid, plaintext URI, TLS URI).
        servers = {"cryptbridge": (server.pid, plain_uri, tls_uri)}
        base_argv = None
        if args.baseline is not None:
            base_backing = work / "volume-base.img"  # its own copy: the image lock allows one writer
            fill(base_backing)
            base_argv = serve_argv(args.baseline, base_backing)
            base, base_plain, base_tls = start(base_argv, "baseline")
            servers["cryptbridge@base"] = (base.pid, base_plain, base_tls)
        pt_argv = None
        if not args.no_passthrough:
            pt_backing = work / "volume-pt.img"  # its own copy: the image lock allows one writer
            fill(pt_backing)
            pt_argv = serve_argv(args.binary, pt_backing, passthrough=True)
            pt, pt_plain, pt_tls = start(pt_argv, "passthrough")
            servers["cryptbridge-pt"] = (pt.pid, pt_plain, pt_tls)
        peer_argv = None
        if args.peer:
            port = free_port()
            peer_argv = ["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(port), "--tls=on",
                         f"--tls-certificates={certs}", "file", backing]
            peer = spawn(peer_argv, open(work / "peer.stdout", "w"), open(work / "peer.stderr", "w"))
            try:
                wait_listening(("127.0.0.1", port), peer, "nbdkit (peer)")
            except RuntimeError as e:
                raise SystemExit(f"{e}: {(work / 'peer.stderr').read_text()[-2000:]}")
            servers["nbdkit"] = (peer.pid, f"nbd://127.0.0.1:{port}", f"nbds://127.0.0.1:{port}")
            log(f"peer {shjoin(peer_argv)}")
        samples: dict[str, dict[str, dict[str, list[dict]]]] = {
            name: {p.key: {"plain": [], "tls": []} for p in profiles} for name in servers}
        for rep in range(args.repeats):
            for i, prof in enumerate(profiles):
                names = list(servers)
                if base_argv or pt_argv:  # rotated, so that no cryptbridge server always goes first
                    shift = (rep + i) % len(names)
                    names = names[shift:] + names[:shift]
                for name in names:
                    pid, plain, tls = servers[name]
                    order = [("plain", plain), ("tls", tls)]
                    if (rep + i) % 2:
                        order.reverse()
                    for kind, uri in order:
                        if prof.nbdcopy:
                            s = nbdcopy_job(uri, prof, size, src, home, pid)
                        else:
                            s = fio_job(uri, prof, size, args.runtime,
                                        fio_dir / f"{name}-{prof.rw}-{prof.bs}-{prof.iodepth}-{kind}-{rep}.json", home, pid)
                        s["repeat"] = rep + 1
                        samples[name][prof.key][kind].append(s)
                        log(f"rep {rep + 1}/{args.repeats} {prof.key:18} {name:16} {kind:5} "
                            + (f"{s['mbps']:8.1f} MB/s" if s["ok"] else f"FAILED {s.get('error')}"))
        rows = []
        for name, prof in [(n, p) for n in servers for p in profiles]:
            pl, tl = samples[name][prof.key]["plain"], samples[name][prof.key]["tls"]
            ratios = [t["mbps"] / p["mbps"] for p, t in zip(pl, tl) if p["ok"] and t["ok"] and p["mbps"] > 0]
            def med(xs, k):
                return median([x.get(k) for x in xs if x["ok"]])
            rows.append({
                "server": name,
                "profile": prof.key,
                "plain_mbps": med(pl, "mbps"),
                "tls_mbps": med(tl, "mbps"),
                "ratio_median": median(ratios),
                "ratio_min": min(ratios) if ratios else None,
                "ratio_max": max(ratios) if ratios else None,
                "pairs": len(ratios),
                "server_cpu_s_per_gb": {"plain": med(pl, "server_cpu_s_per_gb"), "tls": med(tl, "server_cpu_s_per_gb")},
                "fio_cpu_s_per_gb": {"plain": med(pl, "fio_cpu_s_per_gb"), "tls": med(tl, "fio_cpu_s_per_gb")},
                "server_cpu_s_per_gib": {"plain": med(pl, "server_cpu_s_per_gib"), "tls": med(tl, "server_cpu_s_per_gib")},
                "fio_cpu_s_per_gib": {"plain": med(pl, "fio_cpu_s_per_gib"), "tls": med(tl, "fio_cpu_s_per_gib")},
                "verdict": verdict(median(ratios), TARGET),
            })
        env_info["loadavg_end"] = list(os.getloadavg())
        result = {"environment": env_info, "server": shjoin(argv), "peer": peer_argv and shjoin(peer_argv), "repeats": args.repeats, "runtime_s": args.runtime,
                  "target": TARGET, "rows": rows, "samples": samples, "cipher_cost": cost,
                  "passthrough": pt_argv and shjoin(pt_argv)}
        overhead = []
        if pt_argv:
            for prof in profiles:
                for kind in ("plain", "tls"):
                    overhead.append(overhead_row(
                        prof.key, samples["cryptbridge"][prof.key][kind], samples["cryptbridge-pt"][prof.key][kind],
                        cost, 1.0 if prof.rw in ("write", "randwrite") else 0.0,
                        kind=kind, job="nbds://" if kind == "tls" else "nbd://"))
            result["encryption_overhead"] = overhead
        ab_md = []
        if base_argv:
            gib = (1 << 30) / 1e9  # s/GB -> s/GiB
            after_before = []
            for prof in profiles:
                for kind in ("plain", "tls"):
                    a_s = samples["cryptbridge"][prof.key][kind]
                    b_s = samples["cryptbridge@base"][prof.key][kind]
                    pairs = [a["mbps"] / b["mbps"] for a, b in zip(a_s, b_s) if a["ok"] and b["ok"] and b["mbps"] > 0]
                    cpu = [a["server_cpu_s_per_gb"] / b["server_cpu_s_per_gb"] for a, b in zip(a_s, b_s)
                           if a["ok"] and b["ok"] and a.get("server_cpu_s_per_gb") and b.get("server_cpu_s_per_gb")]
                    ok = lambda xs, k: [x.get(k) for x in xs if x["ok"]]  # noqa: E731
                    a_cpu, b_cpu = median(ok(a_s, "server_cpu_s_per_gb")), median(ok(b_s, "server_cpu_s_per_gb"))
                    after_before.append({
                        "profile": prof.key, "kind": kind, "after_mbps": median(ok(a_s, "mbps")),
                        "before_mbps": median(ok(b_s, "mbps")), "ratio": median(pairs),
                        "ratio_min": min(pairs) if pairs else None, "ratio_max": max(pairs) if pairs else None,
                        "pairs": len(pairs),
                        "after_cpu_s_per_gib": a_cpu and a_cpu * gib, "before_cpu_s_per_gib": b_cpu and b_cpu * gib,
                        "cpu_ratio": median(cpu)})
            result["baseline"] = shjoin(base_argv)
            result["after_before"] = after_before
            ab_md = [
                "",
                "**after / before**",
                "",
                f"This build (`{args.binary}`, {env_info.get('cryptbridge') or '?'}) against the baseline (`{args.baseline}`, "
                f"{env_info.get('cryptbridge_baseline') or '?'}; `{shjoin(base_argv)}`), in the same rotation. after / before: "
                "median over repeats of the two servers' MB/s ratio in the same repeat. CPU: the server's utime+stime over "
                "the job per GiB moved, median.",
                "",
                "| profile | job | after MB/s | before MB/s | after / before | min–max | pairs | CPU s/GiB after | CPU s/GiB before | CPU after / before |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for r in after_before:
                ab_md.append(f"| {r['profile']} | {'nbds://' if r['kind'] == 'tls' else 'nbd://'} | {fmt(r['after_mbps'])} | "
                             f"{fmt(r['before_mbps'])} | {fmt(r['ratio'], 3)} | {fmt(r['ratio_min'], 2)}–{fmt(r['ratio_max'], 2)} | "
                             f"{r['pairs']} | {fmt(r['after_cpu_s_per_gib'], 3)} | {fmt(r['before_cpu_s_per_gib'], 3)} | {fmt(r['cpu_ratio'], 3)} |")
        write_json(OUT / "tls.json", result)
        md = [
            f"cryptbridge `serve --tls on` (AES-256-XTS, 4096-byte sectors, page-cache backing of {args.size}), "
            f"fio ioengine=nbd over TCP loopback, nbd:// vs nbds:// on the same server; "
            f"{args.repeats} alternating pairs of {args.runtime:g} s jobs; {env_info['cpu']}, {env_info['nproc']} CPUs; "
            f"load average {env_info['loadavg_start'][0]:.2f} at start, {env_info['loadavg_end'][0]:.2f} at end.",
            "",
            cpu_header(env_info, cost) + " Server CPU s/GiB: utime+stime of the server process (/proc/PID/stat) over "
            "the job (ramp included) per GiB moved, median over repeats; fio CPU: its usr+sys per GiB.",
            "",
            *([f"Passthrough: `{shjoin(pt_argv)}` (the same pairs; its own copy of the backing file).", ""] if pt_argv else
              ["No passthrough server (--no-passthrough): no encryption overhead table.", ""]),
            *([f"Peer: `{shjoin(peer_argv)}` (the same pairs, same client; no encryption of the sectors).", ""] if peer_argv else []),
            "| server | profile | nbd:// MB/s | nbds:// MB/s | TLS/plain (median of pairs) | min–max | target 0.8 | server CPU s/GiB plain → TLS | fio CPU s/GiB plain → TLS |",
            "|---|---|---:|---:|---:|---:|---|---:|---:|",
        ]
        for r in rows:
            sc, fc = r["server_cpu_s_per_gib"], r["fio_cpu_s_per_gib"]
            md.append(f"| {r['server']} | {r['profile']} | {fmt(r['plain_mbps'])} | {fmt(r['tls_mbps'])} | {fmt(r['ratio_median'], 3)} | "
                      f"{fmt(r['ratio_min'], 2)}–{fmt(r['ratio_max'], 2)} | {r['verdict']} | "
                      f"{fmt(sc['plain'], 2)} → {fmt(sc['tls'], 2)} | {fmt(fc['plain'], 2)} → {fmt(fc['tls'], 2)} |")
        if overhead:
            md += [""] + overhead_md(overhead, cost, "cryptbridge", "cryptbridge-pt", extra_cols=(("job", "job"),))
        md += ab_md
        text = "\n".join(md) + "\n"
        (OUT / "tls.md").write_text(text)
        print(text)
        return 0
    finally:
        kill_group(peer)
        kill_group(base)
        kill_group(pt)
        kill_group(server)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
