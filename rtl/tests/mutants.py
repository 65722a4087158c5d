#!/usr/bin/env python3
"""Mutation check of the RTL test suite: each mutant is a small deliberate bug in a copy of rtl/;
the suite (tests/run_tests.py --quick) must FAIL on every one of them. Slow (one Verilator build
per mutant, about 2 minutes each on 2 cores), so it is not part of `make test`:

    python3 rtl/tests/mutants.py [NAME ...]

Results go to rtl/build/mutants.txt.
"""
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RTL = os.path.dirname(HERE)
REPO = os.path.dirname(RTL)

# name: (file, original text, mutated text)
MUTANTS = {
    "alpha_poly": ("aes_funcs.vh", "t[127] ? 8'h87 : 8'h00", "t[127] ? 8'h86 : 8'h00"),
    "sbox_entry": ("aes_sbox.v", "9'h053: y = 8'hed;", "9'h053: y = 8'hec;"),
    "isbox_entry": ("aes_sbox.v", "9'h1ed: y = 8'h53;", "9'h1ed: y = 8'h52;"),
    "dec_key_order": ("aes256_pipe.v", "(r == 14 ? rk_flat[127:0] : dkm_flat[128*r +: 128])",
                      "(r == 14 ? rk_flat[127:0] : dkm_flat[128*(14-r) +: 128])"),
    "tweak_delay_short": ("xts_core.v", "localparam DL = 15;", "localparam DL = 14;"),
    "no_drain_before_key_load": ("xts_core.v", "end else if (quiesce && empty && !kx_busy) begin",
                                 "end else if (quiesce && !kx_busy) begin"),
    "ignore_backpressure": ("xts_core.v", "wire         ce = (ob_cnt != 2'd2);", "wire         ce = 1'b1;"),
    "bypass_xor_tweak": ("xts_core.v", "r_byp ? p_tag[127:0] : (p_data ^ p_tag[127:0])",
                         "r_byp ? p_tag[127:0] ^ 128'h1 : (p_data ^ p_tag[127:0])"),
    "engine_reuse_early": ("xts_core.v", "wire       eng_free  = (tw_cnt <= 4'd1);",
                           "wire       eng_free  = (tw_cnt <= 4'd2);"),
    "reset_keeps_rk": ("aes256_key_expand.v", "                if (rst || clear)\n                    rk <= 128'h0;",
                       "                if (clear)\n                    rk <= 128'h0;"),
    "stall_counter": ("xts_csr.v", "if (ev_stall_in)  c_stall_in  <= c_stall_in + 32'h1;",
                      "if (ev_stall_in && !ev_stall_out)  c_stall_in  <= c_stall_in + 32'h1;"),
    "mode_sampled_late": ("xts_core.v", "wire       beat_byp  = in_first ? first_byp : cur_byp;",
                          "wire       beat_byp  = first_byp;"),
    "key2_not_staged": ("xts_core.v", ".ce(ce), .start(eng_start), .key(k2),", ".ce(ce), .start(eng_start), .key(key2),"),
    "lenerr_never": ("xts_core.v", "assign ev_len_err   = accept & ~ssize[1] &", "assign ev_len_err   = 1'b0 & ~ssize[1] &"),
    "ssize_per_beat": ("xts_core.v", "wire [1:0] ssize    = in_first ? cfg_ssize : cur_ssize;", "wire [1:0] ssize    = cfg_ssize;"),
    "tlast_lost": ("xts_core.v", "dl[0] <= {in_first, s_last, beat_dec, beat_byp, s_data};",
                   "dl[0] <= {in_first, 1'b0, beat_dec, beat_byp, s_data};"),
}


def main():
    names = sys.argv[1:] or list(MUTANTS)
    cb = os.path.join(REPO, "target", "release", "cryptbridge")
    vec = os.path.abspath(os.path.join(REPO, "..", "shared", "vectors"))
    base = os.path.join(RTL, "build", "mutants")
    out = []
    for name in names:
        f, a, b = MUTANTS[name]
        d = os.path.join(base, name, "rtl")
        shutil.rmtree(os.path.dirname(d), ignore_errors=True)
        shutil.copytree(RTL, d, ignore=shutil.ignore_patterns("build", "__pycache__"))
        p = os.path.join(d, f)
        src = open(p).read()
        if src.count(a) != 1:
            out.append(f"ERROR {name}: pattern not found exactly once in {f}")
            print(out[-1], flush=True)
            continue
        open(p, "w").write(src.replace(a, b))
        t = time.time()
        env = dict(os.environ, CRYPTBRIDGE=cb, CRYPTBRIDGE_VECTORS=vec, JOBS="1")
        r = subprocess.run(["make", "-C", d, "build/xts_sim", "build/tb_aes_kat"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            verdict = "KILLED (does not build)"
        else:
            r = subprocess.run([sys.executable, os.path.join(d, "tests", "run_tests.py"), "--quick"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)
            failed = [l for l in r.stdout.splitlines() if l.startswith("FAIL")]
            verdict = f"KILLED by {len(failed)} check(s): {failed[0][:150]}" if r.returncode else "SURVIVED"
        out.append(f"{name}: {verdict} ({time.time() - t:.0f}s)")
        print(out[-1], flush=True)
        shutil.rmtree(os.path.dirname(d), ignore_errors=True)
    with open(os.path.join(RTL, "build", "mutants.txt"), "w") as fh:
        fh.write("\n".join(out) + "\n")
    sys.exit(1 if any("SURVIVED" in l or "ERROR" in l for l in out) else 0)


if __name__ == "__main__":
    main()
