#!/usr/bin/env python3
"""Synthesis report (make -C rtl report): Yosys synth_xilinx -family xc7 on the XTS core and, for
the cost of the unified datapath, on the AES pipeline alone with and without decryption.

For each design: LUTs (logic and shift-register), FFs, BRAM, DSP, MUXF7/F8, CARRY4, and the Yosys
`sta` longest path. `sta` adds the cell delays of Yosys' xc7 timing models along the longest
register-to-register path; it knows no wires, no placement, no routing, and MUXF7/MUXF8/CARRY4 have
no timing arcs in those models (counted as 0). It is NOT routed timing: a lower bound on the
period, not a clock frequency.

Output: rtl/build/synth/<design>.log, rtl/build/synth/report.md (also printed).
Usage: synth_report.py [--only NAME,...]
"""
import argparse
import os
import re
import subprocess
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
RTL = os.path.dirname(TOOLS)
OUT = os.path.join(RTL, "build", "synth")
SOURCES = open(os.path.join(RTL, "sources.f")).read().split()

DESIGNS = [
    # name, top, files, chparams, description
    ("xts_top", "xts_top",
     SOURCES,
     {}, "whole XTS core: unified enc/dec pipeline, tweak engine, key expansion, CSR"),
    ("aes_pipe_unified", "aes256_pipe", SOURCES, {"HAS_DEC": 1, "TAG_W": 1},
     "AES-256 pipeline alone, unified encrypt/decrypt (round keys as inputs)"),
    ("aes_pipe_enc", "aes256_pipe", SOURCES, {"HAS_DEC": 0, "TAG_W": 1},
     "AES-256 pipeline alone, encryption only (round keys as inputs)"),
    ("aes_pipe_dec", "aes256_pipe_dec_only", SOURCES + ["@dec_only"], {},
     "AES-256 pipeline alone, decryption only (unified RTL with the direction tied to decrypt)"),
]

# a decryption-only pipeline: the unified RTL with in_dec tied to 1 (synthesis removes the
# encryption half); only for the cost comparison, not part of the design
DEC_ONLY = """module aes256_pipe_dec_only (
    input wire clk, input wire rst, input wire ce, input wire in_valid, input wire [127:0] in_data,
    input wire [15*128-1:0] rk_flat, input wire [15*128-1:0] dkm_flat,
    output wire out_valid, output wire [127:0] out_data);
    wire d; wire [0:0] t; wire [14:0] sv;
    aes256_pipe #(.HAS_DEC(1), .TAG_W(1)) u (.clk(clk), .rst(rst), .ce(ce), .in_valid(in_valid),
        .in_dec(1'b1), .in_data(in_data), .in_tag(1'b0), .rk_flat(rk_flat), .dkm_flat(dkm_flat),
        .out_valid(out_valid), .out_dec(d), .out_data(out_data), .out_tag(t), .stage_valid(sv));
endmodule
"""


def synth(name, top, files, params):
    os.makedirs(OUT, exist_ok=True)
    ch = "".join(f"chparam -set {k} {v} {top}\n" for k, v in params.items())
    paths = []
    for f in files:
        if f == "@dec_only":
            f = os.path.join(OUT, "aes256_pipe_dec_only.v")
            with open(f, "w") as fh:
                fh.write(DEC_ONLY)
        paths.append(os.path.join(RTL, f))
    script = (f"read_verilog -I{RTL} " + " ".join(paths) + "\n" + ch +
              f"synth_xilinx -family xc7 -top {top} -flatten -abc9 -noiopad -noclkbuf\n"
              "tee -o {out}/{name}.stat stat\n"
              "tee -o {out}/{name}.sta sta\n").format(out=OUT, name=name)
    ys = os.path.join(OUT, f"{name}.ys")
    with open(ys, "w") as f:
        f.write(script)
    t = time.time()
    p = subprocess.run(["yosys", "-q", "-l", os.path.join(OUT, f"{name}.log"), ys],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit(f"yosys failed on {name}: {p.stderr[-2000:]}")
    return time.time() - t


def parse(name):
    cells = {}
    with open(os.path.join(OUT, f"{name}.stat")) as f:
        for line in f:
            m = re.match(r"\s+(\w+)\s+(\d+)$", line)
            if m:
                cells[m.group(1)] = cells.get(m.group(1), 0) + int(m.group(2))
    sta = None
    with open(os.path.join(OUT, f"{name}.sta")) as f:
        txt = f.read()
    m = re.search(r"Latest arrival time in '\S+' is (\d+)", txt)
    if m:
        sta = int(m.group(1))
    no_arcs = sorted(set(re.findall(r"Module '(\w+)' has no timing arcs", txt)))
    luts = sum(v for k, v in cells.items() if re.fullmatch(r"LUT[1-6]", k))
    srl = sum(v for k, v in cells.items() if k.startswith("SRL"))
    lutram = sum(v for k, v in cells.items() if k.startswith("RAM") and not k.startswith("RAMB"))
    ffs = sum(v for k, v in cells.items() if re.fullmatch(r"FD[A-Z]*", k))
    bram36 = cells.get("RAMB36E1", 0)
    bram18 = cells.get("RAMB18E1", 0)
    dsp = cells.get("DSP48E1", 0)
    return dict(luts=luts, srl=srl, lutram=lutram, ffs=ffs, bram36=bram36, bram18=bram18, dsp=dsp,
                muxf7=cells.get("MUXF7", 0), muxf8=cells.get("MUXF8", 0), carry4=cells.get("CARRY4", 0),
                sta_ps=sta, no_arcs=no_arcs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    ver = subprocess.run(["yosys", "-V"], stdout=subprocess.PIPE, text=True).stdout.strip()
    rows = []
    for name, top, files, params, desc in DESIGNS:
        if a.only and name not in a.only.split(","):
            continue
        print(f"synthesizing {name} ...", flush=True)
        dt = synth(name, top, files, params)
        r = parse(name)
        r.update(name=name, desc=desc, secs=dt)
        rows.append(r)
        print(f"  {name}: {r['luts']} LUT + {r['srl']} SRL + {r['lutram']} LUTRAM, {r['ffs']} FF, "
              f"{r['bram36']} RAMB36 + {r['bram18']} RAMB18, {r['dsp']} DSP; sta {r['sta_ps']} ps ({dt:.0f}s)",
              flush=True)
    lines = [f"# Synthesis report ({ver}; synth_xilinx -family xc7 -flatten -abc9 -noiopad -noclkbuf)", "",
             "| design | LUT (logic) | LUT as SRL | LUTRAM | FF | RAMB36/RAMB18 | DSP48 | MUXF7/F8 | CARRY4 | sta bound | what |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        sta = f"{r['sta_ps']} ps" if r["sta_ps"] is not None else "n/a"
        lines.append(f"| {r['name']} | {r['luts']} | {r['srl']} | {r['lutram']} | {r['ffs']} | {r['bram36']}/{r['bram18']} | "
                     f"{r['dsp']} | {r['muxf7']}/{r['muxf8']} | {r['carry4']} | {sta} | {r['desc']} |")
    lines += ["", "sta bound: sum of Yosys xc7 cell delays on the longest register-to-register path. Not routed "
              "timing: no wire delay, no placement; cells without timing arcs in the models count 0 ("
              + ", ".join(sorted({c for r in rows for c in r["no_arcs"]})) + ")."]
    rep = "\n".join(lines) + "\n"
    with open(os.path.join(OUT, "report.md"), "w") as f:
        f.write(rep)
    print(rep)


if __name__ == "__main__":
    main()
