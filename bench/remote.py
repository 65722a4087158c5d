#!/usr/bin/env python3
"""Remote backing benchmark: cryptbridge in front of `nbdkit memory` vs `nbdkit memory` alone.

A benchmark, not a test: the target is reported as PASS/MISS and the exit status is 0 whenever
the measurements ran (1 only for setup failures such as a missing binary or tool).

Both servers are up at once on Unix sockets: nbdkit memory (the upstream), and cryptbridge serve
--backing nbd+unix:///?socket=<upstream> (AES-XTS 512-bit, 512-byte sectors). fio (ioengine=nbd,
one job, one connection) runs each profile against one, then the other, in alternating pairs (the
order flips every repeat); the export is filled through the bridge first, so both read
allocated memory. The ratio per profile is the median over repeats of bridge / direct in the
same pair (the machine is shared and drifts); the ratio of the medians is printed beside it.

Profiles: SEQ1M Q8T1 read / write, RND4K Q32T1 read / write. Targets (issue 30): bridge >= 0.8 x
direct on SEQ1M, >= 0.6 x on RND4K.

With --proxy a third server joins the rotation: nbdkit's own NBD proxy (`nbdkit nbd
socket=<upstream>`, no encryption) in front of the same upstream. It is the peer's cost of one
extra NBD hop on the same vCPUs, so its ratio to `nbdkit memory` alone says how much of the
bridge's gap any server that sits between fio and the upstream pays here.

A passthrough bridge, "bridge-pt" (`cryptbridge serve --passthrough`, same upstream, its own
socket), is in the rotation too (--no-passthrough leaves it out): the same bridge without
encryption. Every server's CPU seconds (utime+stime of its process from /proc over the job, ramp
included; for "direct" that is nbdkit memory, for the bridges the cryptbridge process alone, the
upstream not counted) per GiB moved (MB/s x (runtime + ramp)) is reported beside its MB/s, and the
"encryption overhead" table gives, per profile, bridge minus bridge-pt CPU s/GiB in the same repeat
(median) next to the cipher's own cost per GiB from `cryptbridge bench cipher` (one thread, the
volume's cipher, key and sector size, the CPU level the servers run; measured once per run).

With --peers, a second `nbdkit memory` upstream holds a LUKS1 volume (qemu-img create -f luks:
aes-256 xts-plain64, 512-bit key, sha256; the same bytes a cryptsetup LUKS1 volume has), and three
encrypting servers in front of it join the rotation: "bridge-luks" (`cryptbridge serve --type
luks`), "nbdkit-luks" (`nbdkit --filter=luks nbd socket=...`) and "qemu-luks" (`qemu-nbd
--image-opts driver=luks,file.driver=nbd,...`). The report adds, per profile, their MB/s and CPU
s/GiB and bridge-luks / the faster peer (median of same-repeat ratios); the issue's targets: >= 3x
the faster peer, and CPU per request below qemu-nbd's.

With --baseline BINARY a second bridge, "bridge@base", runs from BINARY with the same arguments
(its own socket, the same upstream) and joins the rotation next to "bridge": a before/after
check of two builds in one run. The report gets an "after / before" section: per profile, the
median over repeats of bridge / bridge@base in the same repeat, and each bridge's CPU seconds
(utime+stime of the cryptbridge process over the job, ramp included; the upstream's not counted)
per GiB moved (MB/s x (runtime + ramp)).

Outputs: bench/out/remote.json, bench/out/remote.md (paste into a dated page under docs/bench/),
per-job fio JSON under bench/out/fio/remote/, server logs under bench/out/logs/.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_BINARY,
    OUT,
    BenchInterrupted,
    cipher_cost,
    cpu_header,
    environment,
    fmt,
    install_signal_handlers,
    kill_group,
    log,
    median,
    overhead_md,
    overhead_row,
    run,
    shjoin,
    spawn,
    tool_version,
    verdict,
    wait_listening,
    warn,
    write_json,
)
from bridge import PASSPHRASE, PROFILES, create_luks1_image, fio_job, qemu_opt_escape  # noqa: E402

MiB = 1 << 20
# Issue 30's targets for bridge / direct, by profile.
TARGETS = {"seq1m": 0.8, "rnd4k": 0.6}
PROFILE_KEYS = ["seq1m_q8t1_read", "seq1m_q8t1_write", "rnd4k_q32t1_read", "rnd4k_q32t1_write"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", type=Path, default=DEFAULT_BINARY)
    ap.add_argument("--baseline", type=Path, default=None, metavar="BINARY",
                    help="also run the bridge from BINARY as \"bridge@base\" in the same rotation; report after / before")
    ap.add_argument("--size", default="512M", help="export size (nbdkit memory), default 512M")
    ap.add_argument("--repeats", type=int, default=5, help="alternating pairs per profile (default 5)")
    ap.add_argument("--runtime", type=float, default=5.0, help="seconds per fio job (default 5)")
    ap.add_argument("--ramp", type=float, default=1.0, help="fio ramp time in seconds (default 1)")
    ap.add_argument("--backing-connections", type=int, default=None, help="serve --backing-connections (default: the bridge's)")
    ap.add_argument("--profiles", default=",".join(PROFILE_KEYS), help="comma-separated profile keys")
    ap.add_argument("--proxy", action="store_true", help="add nbdkit's NBD proxy (nbdkit nbd) as a third server (see above)")
    ap.add_argument("--peers", action="store_true",
                    help="add the encrypting peers on a LUKS1 volume of a second nbdkit memory upstream (see above)")
    ap.add_argument("--no-passthrough", action="store_true",
                    help="leave the passthrough bridge (serve --passthrough) out of the rotation; no encryption overhead table")
    ap.add_argument("--cipher-seconds", type=float, default=None,
                    help="seconds per measurement of `cryptbridge bench cipher` (default 2, quick 0.5; 0 skips it)")
    ap.add_argument("--quick", action="store_true", help="2 repeats of 2 s jobs (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.runtime, args.ramp = 2, 2.0, 0.5
    install_signal_handlers()
    for tool in ("nbdkit", "fio", "nbdcopy"):
        if not tool_version([tool, "--version"]):
            warn(f"{tool} not found")
            return 1
    if not args.binary.exists():
        warn(f"{args.binary} not found: cargo build --release")
        return 1
    if args.baseline is not None and not args.baseline.exists():
        warn(f"{args.baseline} (--baseline) not found")
        return 1
    profiles = [p for p in PROFILES if p.key in args.profiles.split(",")]
    size_bytes = int(args.size[:-1]) * {"K": 1 << 10, "M": MiB, "G": 1 << 30}[args.size[-1].upper()] if args.size[-1].isalpha() else int(args.size)

    logdir = OUT / "logs"
    fio_dir = OUT / "fio" / "remote"
    logdir.mkdir(parents=True, exist_ok=True)
    fio_dir.mkdir(parents=True, exist_ok=True)
    rundir = Path(tempfile.mkdtemp(prefix="cbremote", dir="/tmp"))
    up_sock, cb_sock, px_sock = rundir / "up.sock", rundir / "cb.sock", rundir / "proxy.sock"
    base_sock = rundir / "cb-base.sock"
    pt_sock = rundir / "cb-pt.sock"
    keyfile = rundir / "key"
    fd = os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        key = os.urandom(64)
        while key[:32] == key[32:]:
            key = os.urandom(64)
        f.write(key)
    up_argv = ["nbdkit", "-f", "-U", up_sock, "memory", args.size]
    cb_argv = [args.binary, "serve", "--backing", f"nbd+unix:///?socket={up_sock}", "--key-file", keyfile, "--unix", cb_sock]
    if args.backing_connections:
        cb_argv += ["--backing-connections", str(args.backing_connections)]
    base_argv = None
    if args.baseline is not None:
        base_argv = [args.baseline, *cb_argv[1:]]
        base_argv[base_argv.index(cb_sock)] = base_sock
    px_argv = ["nbdkit", "-f", "-U", px_sock, "nbd", f"socket={up_sock}"]
    pt_argv = None
    if not args.no_passthrough:
        pt_argv = [args.binary, "serve", "--backing", f"nbd+unix:///?socket={up_sock}", "--passthrough", "--unix", pt_sock]
        if args.backing_connections:
            pt_argv += ["--backing-connections", str(args.backing_connections)]
    peer_argv: dict[str, list] = {}
    up2_sock, luks_img, passfile = rundir / "up-luks.sock", rundir / "luks.img", rundir / "luks.pass"
    if args.peers:
        for tool in ("qemu-img", "qemu-nbd"):
            if not tool_version([tool, "--version"]):
                warn(f"{tool} not found (--peers)")
                return 1
        fd = os.open(passfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(PASSPHRASE)
        peer_argv = {
            "bridge-luks": [args.binary, "serve", "--type", "luks", "--backing", f"nbd+unix:///?socket={up2_sock}",
                            "--header", rundir / "luks.hdr", "--key-file", passfile, "--unix", rundir / "bridge-luks.sock"],
            "nbdkit-luks": ["nbdkit", "-f", "-U", rundir / "nbdkit-luks.sock", "--filter=luks", "nbd", f"socket={up2_sock}",
                            f"passphrase=+{passfile}"],
            "qemu-luks": ["qemu-nbd", "--persistent", "--shared=8", "--socket", rundir / "qemu-luks.sock",
                          "--cache=writeback", "--aio=threads",
                          "--object", f"secret,id=sec0,file={qemu_opt_escape(passfile)},format=raw", "--image-opts",
                          f"driver=luks,key-secret=sec0,file.driver=nbd,file.server.type=unix,file.server.path={qemu_opt_escape(up2_sock)}"],
        }
    uris = {"direct": f"nbd+unix:///?socket={up_sock}", "bridge": f"nbd+unix:///?socket={cb_sock}"}
    if pt_argv:
        uris["bridge-pt"] = f"nbd+unix:///?socket={pt_sock}"
    if base_argv:
        uris["bridge@base"] = f"nbd+unix:///?socket={base_sock}"
    if args.proxy:
        uris["proxy"] = f"nbd+unix:///?socket={px_sock}"
    for who in peer_argv:
        uris[who] = f"nbd+unix:///?socket={rundir / (who + '.sock')}"  # each peer's --unix/-U/--socket above
    state = {
        "environment": environment(args.binary),
        "commands": {"upstream": shjoin(up_argv), "bridge": shjoin(cb_argv)} | ({"proxy": shjoin(px_argv)} if args.proxy else {})
        | ({"bridge@base": shjoin(base_argv)} if base_argv else {}) | ({"bridge-pt": shjoin(pt_argv)} if pt_argv else {})
        | {who: shjoin(a) for who, a in peer_argv.items()},
        "config": {"size": args.size, "repeats": args.repeats, "runtime": args.runtime, "ramp": args.ramp},
        "results": {},
    }
    if base_argv:
        state["environment"]["cryptbridge_baseline"] = tool_version([args.baseline, "--version"])
    cipher_s = args.cipher_seconds if args.cipher_seconds is not None else (0.5 if args.quick else 2.0)
    cost = None
    if cipher_s > 0:
        # serve's defaults here: aes-xts-plain64, the 64-byte key file (512 bits), 512-byte sectors.
        cost = cipher_cost(args.binary, "aes-xts-plain64", 512, 512, cipher_s)
        state["cipher_cost"] = cost
        if "error" in cost:
            warn(f"bench cipher: {cost['error']}")
    up = cb = px = base = pt = up2 = None
    peers: dict = {}
    try:
        if peer_argv:
            create_luks1_image(luks_img, size_bytes, passfile)
            # The bridge reads a LUKS header over NBD only from a local copy (--header): the
            # volume's header area, the same bytes as at the start of the upstream.
            with open(luks_img, "rb") as f, open(rundir / "luks.hdr", "wb") as h:
                h.write(f.read(luks_img.stat().st_size - size_bytes))
            with open(logdir / "remote-upstream-luks.log", "wb") as err:
                up2 = spawn(["nbdkit", "-f", "-U", up2_sock, "memory", str(luks_img.stat().st_size)], stdout=err, stderr=err)
            wait_listening(up2_sock, up2, "nbdkit memory (LUKS1 volume)")
            r = run(["nbdcopy", "--flush", luks_img, f"nbd+unix:///?socket={up2_sock}"], timeout=600)
            if r.returncode != 0:
                warn(f"copying the LUKS1 volume to its upstream failed: {r.stderr.strip()[-400:]}")
                return 1
            luks_img.unlink()
            for who, argv in peer_argv.items():
                with open(logdir / f"remote-{who}.log", "wb") as err:
                    peers[who] = spawn(argv, stdout=err, stderr=err)
                wait_listening(Path(uris[who].split("socket=", 1)[1]), peers[who], who)
            log("filling the LUKS1 volume through bridge-luks")
            r = run(["nbdcopy", "--flush", "--", "[", "nbdkit", "-r", "pattern", args.size, "]", uris["bridge-luks"]], timeout=600)
            if r.returncode != 0:
                warn(f"fill failed: {r.stderr.strip()[-400:]}")
                return 1
        with open(logdir / "remote-upstream.log", "wb") as err:
            up = spawn(up_argv, stdout=err, stderr=err)
        wait_listening(up_sock, up, "nbdkit memory")
        with open(logdir / "remote-bridge.stdout.log", "wb") as out, open(logdir / "remote-bridge.stderr.log", "wb") as err:
            cb = spawn(cb_argv, stdout=out, stderr=err)
        wait_listening(cb_sock, cb, "cryptbridge serve")
        if base_argv:
            with open(logdir / "remote-bridge-base.stdout.log", "wb") as out, open(logdir / "remote-bridge-base.stderr.log", "wb") as err:
                base = spawn(base_argv, stdout=out, stderr=err)
            wait_listening(base_sock, base, "cryptbridge serve (--baseline)")
        if pt_argv:
            with open(logdir / "remote-bridge-pt.stdout.log", "wb") as out, open(logdir / "remote-bridge-pt.stderr.log", "wb") as err:
                pt = spawn(pt_argv, stdout=out, stderr=err)
            wait_listening(pt_sock, pt, "cryptbridge serve --passthrough")
        if args.proxy:
            with open(logdir / "remote-proxy.log", "wb") as err:
                px = spawn(px_argv, stdout=err, stderr=err)
            wait_listening(px_sock, px, "nbdkit nbd (proxy)")
        log(f"filling the {args.size} export through the bridge; rotation: {', '.join(uris)}")
        r = run(["nbdcopy", "--flush", "--", "[", "nbdkit", "-r", "pattern", args.size, "]", uris["bridge"]], timeout=600)
        if r.returncode != 0:
            warn(f"fill failed: {r.stderr.strip()[-400:]}")
            return 1
        pids = {"direct": up.pid, "bridge": cb.pid} | ({"proxy": px.pid} if px else {}) | ({"bridge@base": base.pid} if base else {}) | ({"bridge-pt": pt.pid} if pt else {})
        pids |= {who: p.pid for who, p in peers.items()}
        servers = list(uris)
        for rep in range(args.repeats):
            for pi, prof in enumerate(profiles):
                shift = (rep + pi) % len(servers)
                order = servers[shift:] + servers[:shift]
                for who in order:
                    sample = fio_job(uris[who], prof, size_bytes, args.runtime, args.ramp, fio_dir / f"{prof.key}-{who}-{rep}.json", pids[who])
                    sample["repeat"] = rep + 1
                    state["results"].setdefault(prof.key, {}).setdefault(who, []).append(sample)
                    log(f"  [{rep + 1}/{args.repeats}] {prof.label:20} {who:11} {fmt(sample.get('mbps'))} MB/s {fmt(sample.get('server_cpu_s_per_gib'), 3)} CPU s/GiB"
                        + ("" if sample["ok"] else f"  FAILED: {sample.get('error')}"))
    except BenchInterrupted as e:
        warn(f"interrupted: {e}")
    finally:
        for p in peers.values():
            kill_group(p)
        kill_group(up2)
        kill_group(px)
        kill_group(pt)
        kill_group(base)
        kill_group(cb)
        kill_group(up)

    lines = [
        f"CPU: {state['environment']['cpu']} ({state['environment']['nproc']} vCPUs), load at start "
        f"{' '.join(f'{x:.2f}' for x in state['environment']['loadavg_start'])}; git {state['environment']['git']}",
        "",
        cpu_header(state["environment"], cost),
        "",
        f"Upstream: `{state['commands']['upstream']}`; bridge: `{state['commands']['bridge']}`"
        + (f"; passthrough bridge: `{state['commands']['bridge-pt']}`" if pt_argv else ""),
        f"fio --ioengine=nbd, {args.repeats} alternating pairs of {args.runtime:g} s jobs (+{args.ramp:g} s ramp) per profile.",
        "",
        "| Profile | nbdkit memory MB/s (median) | bridge MB/s (median) | bridge / direct (median of pairs) | ratio of medians | target | |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for prof in profiles:
        res = state["results"].get(prof.key, {})
        d = [s["mbps"] for s in res.get("direct", []) if s["ok"]]
        b = [s["mbps"] for s in res.get("bridge", []) if s["ok"]]
        pairs = [sb["mbps"] / sd["mbps"] for sd, sb in zip(res.get("direct", []), res.get("bridge", [])) if sd["ok"] and sb["ok"] and sd["mbps"] > 0]
        ratio, mratio = median(pairs), (median(b) / median(d) if d and b and median(d) else None)
        target = TARGETS[prof.key.split("_")[0]]
        summary[prof.key] = {"direct_mbps": median(d), "bridge_mbps": median(b), "ratio": ratio, "ratio_of_medians": mratio, "pairs": pairs, "target": target}
        lines.append(f"| {prof.label} | {fmt(median(d), 0)} | {fmt(median(b), 0)} | {fmt(ratio, 2)} | {fmt(mratio, 2)} | {target} | {verdict(ratio, target)} |")
    if args.proxy:
        lines += [
            "",
            "nbdkit's NBD proxy in the same rotation (`" + state["commands"]["proxy"] + "`, no encryption):",
            "",
            "| Profile | proxy MB/s (median) | proxy / direct (median of triples) | bridge / proxy (median of triples) |",
            "|---|---|---|---|",
        ]
        for prof in profiles:
            res = state["results"].get(prof.key, {})
            triples = [(d, b, x) for d, b, x in zip(res.get("direct", []), res.get("bridge", []), res.get("proxy", []))
                       if d["ok"] and b["ok"] and x["ok"] and d["mbps"] > 0 and x["mbps"] > 0]
            px = [x["mbps"] for x in res.get("proxy", []) if x["ok"]]
            px_direct = median([x["mbps"] / d["mbps"] for d, _, x in triples])
            bridge_px = median([b["mbps"] / x["mbps"] for _, b, x in triples])
            summary[prof.key] |= {"proxy_mbps": median(px), "proxy_ratio": px_direct, "bridge_over_proxy": bridge_px}
            lines.append(f"| {prof.label} | {fmt(median(px), 0)} | {fmt(px_direct, 2)} | {fmt(bridge_px, 2)} |")
    if peer_argv:
        lines += [
            "",
            "Encrypting servers on the same LUKS1 volume (aes-256 xts-plain64, 512-bit key) of a second `nbdkit memory` "
            "upstream: bridge-luks (`serve --type luks`), nbdkit's luks filter over its nbd plugin, qemu-nbd driver=luks "
            "over file.driver=nbd. Ratio: median over repeats of bridge-luks / the faster peer in the same repeat; "
            "CPU: server process utime+stime per GiB moved, medians.",
            "",
            "| Profile | bridge-luks MB/s | nbdkit-luks MB/s | qemu-luks MB/s | bridge-luks / faster peer | target | | "
            "bridge-luks CPU s/GiB | nbdkit-luks CPU s/GiB | qemu-luks CPU s/GiB | bridge CPU < qemu-nbd |",
            "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
        ]
        for prof in profiles:
            res = state["results"].get(prof.key, {})
            ok = lambda who: [s for s in res.get(who, []) if s["ok"]]  # noqa: E731
            mb = {who: median([s["mbps"] for s in ok(who)]) for who in peer_argv}
            cpu = {who: median([s.get("server_cpu_s_per_gib") for s in ok(who)]) for who in peer_argv}
            ratios = [b["mbps"] / max(n["mbps"], q["mbps"]) for b, n, q in zip(res.get("bridge-luks", []), res.get("nbdkit-luks", []), res.get("qemu-luks", []))
                      if b["ok"] and n["ok"] and q["ok"] and max(n["mbps"], q["mbps"]) > 0]
            ratio = median(ratios)
            cheaper = None if cpu["bridge-luks"] is None or cpu["qemu-luks"] is None else cpu["bridge-luks"] < cpu["qemu-luks"]
            summary[prof.key]["peers"] = {"mbps": mb, "cpu_s_per_gib": cpu, "bridge_over_faster_peer": ratio, "ratios": ratios}
            lines.append(f"| {prof.label} | {fmt(mb['bridge-luks'], 0)} | {fmt(mb['nbdkit-luks'], 0)} | {fmt(mb['qemu-luks'], 0)} | "
                         f"{fmt(ratio, 2)} | 3 | {verdict(ratio, 3.0)} | {fmt(cpu['bridge-luks'], 3)} | {fmt(cpu['nbdkit-luks'], 3)} | "
                         f"{fmt(cpu['qemu-luks'], 3)} | {'yes' if cheaper else 'no' if cheaper is not None else '?'} |")
    lines += [
        "",
        "Every server, MB/s and server CPU s/GiB (utime+stime of the server process from /proc over the job, ramp "
        "included, per GiB moved; direct = nbdkit memory; the bridges' upstream not counted), medians over repeats:",
        "",
        "| Profile | " + " | ".join(f"{who} MB/s | {who} CPU s/GiB" for who in uris) + " |",
        "|---|" + "---:|---:|" * len(uris),
    ]
    for prof in profiles:
        res = state["results"].get(prof.key, {})
        per = {}
        for who in uris:
            ok = [s for s in res.get(who, []) if s["ok"]]
            per[who] = {"mbps": median([s["mbps"] for s in ok]),
                        "cpu_s_per_gib": median([s.get("server_cpu_s_per_gib") for s in ok])}
        summary[prof.key]["servers"] = per
        lines.append(f"| {prof.label} | " + " | ".join(f"{fmt(per[w]['mbps'], 0)} | {fmt(per[w]['cpu_s_per_gib'], 3)}" for w in uris) + " |")
    lines.append("")
    if pt_argv:
        overhead = [overhead_row(prof.label, state["results"].get(prof.key, {}).get("bridge", []),
                                 state["results"].get(prof.key, {}).get("bridge-pt", []), cost,
                                 1.0 if prof.writes else 0.0, profile_key=prof.key) for prof in profiles]
        state["encryption_overhead"] = overhead
        lines += overhead_md(overhead, cost, "bridge", "bridge-pt")
    else:
        lines.append("No encryption overhead table: run without --no-passthrough for the passthrough bridge it is "
                     "measured against (nbdkit memory, the direct baseline, is a different server).")
    if base_argv:
        lines += [
            "",
            "**after / before**",
            "",
            f"This build (`{args.binary}`, {state['environment'].get('cryptbridge') or '?'}) against the baseline "
            f"(`{args.baseline}`, {state['environment'].get('cryptbridge_baseline') or '?'}), the same arguments, in the same "
            "rotation. after / before: median over repeats of the two bridges' MB/s ratio in the same repeat. CPU: the "
            "cryptbridge process's utime+stime over the job (ramp included) per GiB moved, median.",
            "",
            "| Profile | after MB/s | before MB/s | after / before | min–max | pairs | CPU s/GiB after | CPU s/GiB before | CPU after / before | before / direct |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        after_before = []
        for prof in profiles:
            res = state["results"].get(prof.key, {})
            a_s, b_s, d_s = res.get("bridge", []), res.get("bridge@base", []), res.get("direct", [])
            ok = lambda xs: [x for x in xs if x["ok"]]  # noqa: E731
            pairs = [a["mbps"] / b["mbps"] for a, b in zip(a_s, b_s) if a["ok"] and b["ok"] and b["mbps"] > 0]
            cpu_pairs = [a["server_cpu_s_per_gib"] / b["server_cpu_s_per_gib"] for a, b in zip(a_s, b_s)
                         if a["ok"] and b["ok"] and a.get("server_cpu_s_per_gib") and b.get("server_cpu_s_per_gib")]
            base_direct = median([b["mbps"] / d["mbps"] for d, b in zip(d_s, b_s) if d["ok"] and b["ok"] and d["mbps"] > 0])
            row = {"profile": prof.key, "after_mbps": median([x["mbps"] for x in ok(a_s)]),
                   "before_mbps": median([x["mbps"] for x in ok(b_s)]), "ratio": median(pairs),
                   "ratio_min": min(pairs) if pairs else None, "ratio_max": max(pairs) if pairs else None,
                   "pairs": len(pairs),
                   "after_cpu_s_per_gib": median([x.get("server_cpu_s_per_gib") for x in ok(a_s)]),
                   "before_cpu_s_per_gib": median([x.get("server_cpu_s_per_gib") for x in ok(b_s)]),
                   "cpu_ratio": median(cpu_pairs), "before_over_direct": base_direct}
            after_before.append(row)
            lines.append(f"| {prof.label} | {fmt(row['after_mbps'], 0)} | {fmt(row['before_mbps'], 0)} | {fmt(row['ratio'], 3)} | "
                         f"{fmt(row['ratio_min'], 2)}–{fmt(row['ratio_max'], 2)} | {row['pairs']} | {fmt(row['after_cpu_s_per_gib'], 3)} | "
                         f"{fmt(row['before_cpu_s_per_gib'], 3)} | {fmt(row['cpu_ratio'], 3)} | {fmt(base_direct, 2)} |")
        state["after_before"] = after_before
    state["summary"] = summary
    write_json(OUT / "remote.json", state)
    (OUT / "remote.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
