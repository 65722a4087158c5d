// Cycle-level testbench for xts_top (Verilator), driven by a job file written by
// rtl/tests/run_tests.py. Expected outputs in the job file come from the shared vectors or from
// the software engine (cryptbridge cipher); nothing here computes AES.
//
// Job file: one record per line, hex in natural byte order (byte 0 first):
//   CTRL <mode> <ssize>                 AXI write of CTRL, issued while the preceding sector is
//                                       still being fed; the next sector is offered only after
//                                       the write completed
//   KEYS <key1 hex32B> <key2 hex32B>    staging-key writes + KEY_LOAD. The writes are issued while
//                                       the preceding sector is still being fed; the next sector
//                                       is offered only after the KEY_LOAD write completed.
//   SEC <dir> <tweak hex16B> <nblk> <in hex> <expected hex> <lenerr 0|1>
//                                       one sector (dir 1 = encrypt, 0 = decrypt)
//   RESET <n>                           assert reset n cycles after the previous sector's first
//                                       beat was accepted (mid-stream); that sector is abandoned,
//                                       post-reset checks run, and the job goes on
//   CHECK                               wait until everything is out, compare the CSR counters
//                                       and STATUS with the testbench's own counts
// Options: --idle P (probability of an idle input cycle), --stall P (probability of
// m_ready = 0), --seed N. Prints "METRIC name value" lines and "PASS"/"FAIL" (exit 0/1).
#include <deque>
#include <fstream>
#include <random>
#include <sstream>

#include "xts_harness.h"

using namespace xts;

namespace {

struct Record {
    std::string kind;
    int a = 0, b = 0;                // CTRL mode/ssize, SEC dir, RESET delay
    std::vector<uint8_t> k1, k2;     // KEYS
    uint8_t tweak[16] = {};
    int nblk = 0;
    std::vector<uint8_t> in, exp;
    bool lenerr = false;
    int line = 0;
};

struct Expect {
    uint8_t data[16];
    bool last;
    int user;            // {bypass, decrypt}
    int rec;             // record index, for messages
    int blk;
    uint64_t in_cycle;
};

struct AxiOp {
    bool write;
    uint32_t addr, data;
    int tag;             // >= 0: completion marks record `tag` as done
};

std::vector<uint8_t> unhex(const std::string& s) {
    if (s == "-") return {};
    std::vector<uint8_t> v(s.size() / 2);
    for (size_t i = 0; i < v.size(); i++) v[i] = (uint8_t)std::stoul(s.substr(2 * i, 2), nullptr, 16);
    return v;
}

std::string hex(const uint8_t* p, size_t n) {
    static const char* d = "0123456789abcdef";
    std::string s;
    for (size_t i = 0; i < n; i++) { s += d[p[i] >> 4]; s += d[p[i] & 15]; }
    return s;
}

class Tb {
public:
    Tb(VerilatedContext* ctx, double idle, double stall, uint64_t seed)
        : sim(ctx), pidle(idle), pstall(stall), rng(seed) {}

    bool load(const char* path) {
        std::ifstream f(path);
        if (!f) { fprintf(stderr, "cannot open %s\n", path); return false; }
        std::string line;
        int ln = 0;
        while (std::getline(f, line)) {
            ln++;
            std::istringstream is(line);
            Record r;
            r.line = ln;
            if (!(is >> r.kind) || r.kind[0] == '#') continue;
            if (r.kind == "CTRL") {
                is >> r.a >> r.b;
            } else if (r.kind == "KEYS") {
                std::string a, b;
                is >> a >> b;
                r.k1 = unhex(a); r.k2 = unhex(b);
                if (r.k1.size() != 32 || r.k2.size() != 32) { fprintf(stderr, "line %d: bad keys\n", ln); return false; }
            } else if (r.kind == "SEC") {
                std::string tw, in, ex;
                int le = 0;
                is >> r.a >> tw >> r.nblk >> in >> ex >> le;
                auto t = unhex(tw);
                if (t.size() != 16) { fprintf(stderr, "line %d: bad tweak\n", ln); return false; }
                memcpy(r.tweak, t.data(), 16);
                r.in = unhex(in); r.exp = unhex(ex); r.lenerr = le != 0;
                if ((int)r.in.size() != 16 * r.nblk || r.exp.size() != r.in.size()) {
                    fprintf(stderr, "line %d: bad sector lengths\n", ln); return false;
                }
            } else if (r.kind == "RESET") {
                is >> r.a;
            } else if (r.kind == "CHECK") {
            } else {
                fprintf(stderr, "line %d: unknown record %s\n", ln, r.kind.c_str());
                return false;
            }
            recs.push_back(std::move(r));
        }
        return true;
    }

    int run();

private:
    Sim sim;
    double pidle, pstall;
    std::mt19937_64 rng;
    std::vector<Record> recs;
    std::vector<bool> done_axi;       // per record: its AXI writes have completed
    std::vector<bool> issued;         // per record: its AXI writes are queued
    std::deque<AxiOp> axq;
    int ax_phase = 0;                 // 0 idle, 1 address/data, 2 response, 3 read data
    std::deque<Expect> outq;
    int fails = 0;

    // input agent
    size_t ri = 0;                    // current record
    int bi = 0;                       // next beat of the current sector
    bool holding = false;             // s_valid asserted, not yet accepted
    int64_t reset_countdown = -1;
    uint32_t mode_now = MODE_AUTO;    // CTRL.MODE in force for sectors offered now

    // own counts
    uint64_t n_sectors = 0, n_blocks = 0, n_stall_in = 0, n_stall_out = 0, n_lenerr = 0;
    // metrics
    uint64_t first_in = UINT64_MAX, first_out = UINT64_MAX, last_out = 0, blocks_out_total = 0;
    uint64_t lat_min = UINT64_MAX, lat_max = 0, stall_in_after_first = 0;
    uint64_t max_out_gap = 0, prev_out = 0;
    uint64_t boundary_gaps = 0;        // out-stream gaps at sector boundaries (m_ready always 1)

    bool chance(double p) { return p > 0 && std::uniform_real_distribution<double>(0, 1)(rng) < p; }

    void fail(const std::string& m) {
        if (fails < 20) fprintf(stdout, "FAIL: %s\n", m.c_str());
        fails++;
    }

    void queue_keys(size_t r) {
        const Record& k = recs[r];
        for (int j = 0; j < 8; j++) axq.push_back({true, REG_KEY1 + 4u * j, Sim::le32(&k.k1[4 * j]), -1});
        for (int j = 0; j < 8; j++) axq.push_back({true, REG_KEY2 + 4u * j, Sim::le32(&k.k2[4 * j]), -1});
        axq.push_back({true, REG_CMD, CMD_KEY_LOAD, (int)r});
        issued[r] = true;
    }

    void cycle();
    void drive_inputs();
    void do_reset_checks();
    void do_check(int line);
    void wait_drained();
};

void Tb::drive_inputs() {
    auto* t = sim.top;
    // AXI master
    if (ax_phase == 0 && !axq.empty()) {
        const AxiOp& op = axq.front();
        t->s_axil_awaddr = op.addr; t->s_axil_wdata = op.data;
        t->s_axil_awvalid = op.write; t->s_axil_wvalid = op.write;
        t->s_axil_araddr = op.addr; t->s_axil_arvalid = !op.write;
        ax_phase = 1;
    }
    // input stream
    if (!holding) {
        t->s_axis_tvalid = 0;
        while (ri < recs.size()) {
            Record& r = recs[ri];
            if (r.kind == "CTRL") {
                if (!issued[ri]) {
                    axq.push_back({true, REG_CTRL, (uint32_t)(r.a | (r.b << 4)), (int)ri});
                    issued[ri] = true;
                }
                if (!done_axi[ri]) return;
                mode_now = (uint32_t)r.a;
                ri++;
                continue;
            }
            if (r.kind == "KEYS") {
                if (!issued[ri]) queue_keys(ri);
                if (!done_axi[ri]) return;
                ri++;
                continue;
            }
            if (r.kind == "RESET" || r.kind == "CHECK") return;   // handled in cycle()
            break;
        }
        if (ri >= recs.size()) return;
        Record& r = recs[ri];
        if (chance(pidle)) return;
        put128(t->s_axis_tdata, &r.in[16 * bi]);
        t->s_axis_tlast = (bi == r.nblk - 1);
        VlWide<4> lba;
        put128(lba, r.tweak);
        for (int i = 0; i < 4; i++) t->s_axis_lba[i] = lba[i];
        t->s_axis_dir = r.a;
        t->s_axis_tvalid = 1;
        holding = true;
    }
}

void Tb::cycle() {
    auto* t = sim.top;
    drive_inputs();
    t->m_axis_tready = !chance(pstall);
    sim.settle();

    // sample handshakes before the edge
    bool in_fire = t->s_axis_tvalid && t->s_axis_tready;
    bool out_fire = t->m_axis_tvalid && t->m_axis_tready;
    if (t->s_axis_tvalid && !t->s_axis_tready) {
        n_stall_in++;
        if (first_in != UINT64_MAX) stall_in_after_first++;
    }
    if (t->m_axis_tvalid && !t->m_axis_tready) n_stall_out++;
    uint8_t od[16];
    get128(t->m_axis_tdata, od);
    bool olast = t->m_axis_tlast;
    int ouser = t->m_axis_tuser;
    bool aw_fire = ax_phase == 1 && axq.front().write && t->s_axil_awready && t->s_axil_wready;
    bool ar_fire = ax_phase == 1 && !axq.front().write && t->s_axil_arready;
    bool b_fire = ax_phase == 2 && t->s_axil_bvalid;
    bool r_fire = ax_phase == 3 && t->s_axil_rvalid;
    uint64_t now = sim.cycles;
    sim.edge();

    // AXI bookkeeping
    if (aw_fire) { t->s_axil_awvalid = 0; t->s_axil_wvalid = 0; ax_phase = 2; }
    if (ar_fire) { t->s_axil_arvalid = 0; ax_phase = 3; }
    if (b_fire || r_fire) {
        if (axq.front().tag >= 0) done_axi[axq.front().tag] = true;
        axq.pop_front();
        ax_phase = 0;
    }

    if (in_fire) {
        Record& r = recs[ri];
        Expect e;
        memcpy(e.data, &r.exp[16 * bi], 16);
        e.last = (bi == r.nblk - 1);
        bool dec = mode_now == MODE_DEC || (mode_now == MODE_AUTO && r.a == 0);
        e.user = mode_now == MODE_BYPASS ? 2 : (dec ? 1 : 0);
        e.rec = (int)ri; e.blk = bi; e.in_cycle = now;
        outq.push_back(e);
        if (first_in == UINT64_MAX) first_in = now;
        // CTRL and key reloads that follow this sector are written while it streams (from the
        // cycle after its first beat was taken): they must take effect only from the next sector
        if (bi == 0 && ri + 1 < recs.size() && !issued[ri + 1]) {
            const Record& nx = recs[ri + 1];
            if (nx.kind == "KEYS") queue_keys(ri + 1);
            if (nx.kind == "CTRL") {
                axq.push_back({true, REG_CTRL, (uint32_t)(nx.a | (nx.b << 4)), (int)(ri + 1)});
                issued[ri + 1] = true;
            }
        }
        if (bi == 0 && ri + 1 < recs.size() && recs[ri + 1].kind == "RESET")
            reset_countdown = recs[ri + 1].a;
        holding = false;
        bi++;
        if (bi == r.nblk) {
            bi = 0;
            ri++;
            if (r.lenerr) n_lenerr++;
        }
    }
    if (out_fire) {
        if (outq.empty()) {
            fail("output beat with nothing expected: " + hex(od, 16));
        } else {
            Expect& e = outq.front();
            if (memcmp(e.data, od, 16) != 0)
                fail("line " + std::to_string(recs[e.rec].line) + " block " + std::to_string(e.blk) +
                     ": got " + hex(od, 16) + " want " + hex(e.data, 16));
            if (e.last != olast)
                fail("line " + std::to_string(recs[e.rec].line) + " block " + std::to_string(e.blk) + ": m_last wrong");
            if (e.user != ouser)
                fail("line " + std::to_string(recs[e.rec].line) + ": m_user " + std::to_string(ouser) +
                     ", expected " + std::to_string(e.user));
            uint64_t lat = now - e.in_cycle;
            lat_min = std::min(lat_min, lat);
            lat_max = std::max(lat_max, lat);
            if (first_out == UINT64_MAX) first_out = now;
            else {
                max_out_gap = std::max(max_out_gap, now - prev_out);
                if (e.blk == 0 && now - prev_out > 1) boundary_gaps++;
            }
            prev_out = now;
            last_out = now;
            blocks_out_total++;
            n_blocks++;
            if (e.last) n_sectors++;
            outq.pop_front();
        }
    }

    if (reset_countdown >= 0 && reset_countdown-- == 0) {
        reset_countdown = -1;
        do_reset_checks();
    }
}

void Tb::wait_drained() {
    for (int guard = 0; guard < 200000; guard++) {
        if (outq.empty() && axq.empty() && ax_phase == 0 && !holding) return;
        cycle();
    }
    fail("timeout waiting for the stream to drain");
}

// Mid-stream reset: the sector being fed is abandoned; afterwards nothing of the old stream may
// come out, keys must be gone (XTS sectors held, key words read 0), counters zero.
void Tb::do_reset_checks() {
    auto* t = sim.top;
    uint64_t inflight = outq.size();
    t->aresetn = 0;
    t->s_axis_tvalid = 0;
    t->s_axil_awvalid = 0; t->s_axil_wvalid = 0; t->s_axil_arvalid = 0;
    for (int i = 0; i < 3; i++) sim.tick();
    t->aresetn = 1;
    sim.tick();
    outq.clear(); axq.clear(); ax_phase = 0; holding = false;
    mode_now = MODE_AUTO;
    n_sectors = n_blocks = n_stall_in = n_stall_out = n_lenerr = 0;
    printf("METRIC reset_inflight_blocks %llu\n", (unsigned long long)inflight);
    if (inflight == 0) fail("reset scenario: nothing was in flight at the reset");
    // skip the abandoned sector and the RESET record
    while (ri < recs.size() && recs[ri].kind != "RESET") ri++;
    ri++;
    bi = 0;
    t->m_axis_tready = 1;
    for (int i = 0; i < 64; i++) {
        sim.settle();
        if (t->m_axis_tvalid) { fail("output after reset"); break; }
        sim.edge();
    }
    uint32_t st = sim.axi_read(REG_STATUS);
    if (st & (ST_KEY_VALID | ST_KEY_BUSY)) fail("STATUS after reset shows keys: " + std::to_string(st));
    if (!(st & ST_IDLE)) fail("STATUS after reset not idle");
    for (uint32_t a = REG_SECTORS; a <= REG_LEN_ERRS; a += 4)
        if (sim.axi_read(a) != 0) fail("counter not zero after reset");
    for (uint32_t a = REG_KEY1; a < REG_KEY2 + 32; a += 4)
        if (sim.axi_read(a) != 0) fail("key word readable after reset");
    // an XTS sector must not be accepted without keys
    const Record* sec = nullptr;
    for (size_t j = ri; j < recs.size(); j++)
        if (recs[j].kind == "SEC") { sec = &recs[j]; break; }
    if (sec) {
        put128(t->s_axis_tdata, sec->in.data());
        t->s_axis_tlast = 0;
        t->s_axis_dir = 1;
        t->s_axis_tvalid = 1;
        int accepted = 0;
        for (int i = 0; i < 100; i++) {
            sim.settle();
            if (t->s_axis_tready) accepted++;
            sim.edge();
        }
        t->s_axis_tvalid = 0;
        if (accepted) fail("XTS sector accepted without keys after reset");
        uint32_t stalls = sim.axi_read(REG_STALL_IN);
        if (stalls != 100) fail("STALL_IN after 100 keyless cycles = " + std::to_string(stalls));
        sim.axi_write(REG_CMD, CMD_CNT_CLEAR);
    }
}

void Tb::do_check(int line) {
    wait_drained();
    for (int i = 0; i < 40; i++) cycle();   // let the output buffer settle (nothing expected)
    struct { uint32_t reg; uint64_t want; const char* name; } c[] = {
        {REG_SECTORS, n_sectors, "SECTORS"}, {REG_BLOCKS, n_blocks, "BLOCKS"},
        {REG_STALL_IN, n_stall_in, "STALL_IN"}, {REG_LEN_ERRS, n_lenerr, "LEN_ERRS"},
    };
    // reading registers takes cycles in which nothing is valid, so the counts do not move
    for (auto& x : c) {
        uint32_t v = sim.axi_read(x.reg);
        if (v != (uint32_t)x.want)
            fail("CHECK line " + std::to_string(line) + ": " + x.name + " = " + std::to_string(v) +
                 ", testbench counted " + std::to_string(x.want));
    }
    uint32_t so = sim.axi_read(REG_STALL_OUT);
    if (so != (uint32_t)n_stall_out)
        fail("CHECK: STALL_OUT = " + std::to_string(so) + ", counted " + std::to_string(n_stall_out));
    uint32_t st = sim.axi_read(REG_STATUS);
    if (st & ST_TWEAK_ERR) fail("STATUS.TWEAK_ERR set");
    if (((st & ST_LEN_ERR) != 0) != (n_lenerr != 0)) fail("STATUS.LEN_ERR does not match expectation");
    if (!(st & ST_IDLE)) fail("STATUS.IDLE not set after drain");
    printf("METRIC check_line%d sectors=%llu blocks=%llu stall_in=%llu stall_out=%llu len_errs=%llu\n", line,
           (unsigned long long)n_sectors, (unsigned long long)n_blocks, (unsigned long long)n_stall_in,
           (unsigned long long)n_stall_out, (unsigned long long)n_lenerr);
}

int Tb::run() {
    done_axi.assign(recs.size(), false);
    issued.assign(recs.size(), false);
    sim.reset();
    if (sim.axi_read(REG_ID) != 0x58545331) fail("ID register");
    uint64_t guard = 0;
    while (ri < recs.size()) {
        if (recs[ri].kind == "CHECK" && !holding) {
            do_check(recs[ri].line);
            ri++;
            continue;
        }
        if (recs[ri].kind == "RESET" && !holding && reset_countdown < 0) {
            fail("RESET record not preceded by a sector");
            ri++;
            continue;
        }
        cycle();
        if (++guard > 50000000ull) { fail("global timeout"); break; }
    }
    wait_drained();
    for (int i = 0; i < 40; i++) cycle();
    if (!outq.empty()) fail("blocks never came out: " + std::to_string(outq.size()));
    uint64_t span = last_out >= first_out && first_out != UINT64_MAX ? last_out - first_out + 1 : 0;
    printf("METRIC cycles %llu\n", (unsigned long long)sim.cycles);
    printf("METRIC blocks_out %llu\n", (unsigned long long)blocks_out_total);
    printf("METRIC latency_min %llu\n", (unsigned long long)lat_min);
    printf("METRIC latency_max %llu\n", (unsigned long long)lat_max);
    printf("METRIC out_span_cycles %llu\n", (unsigned long long)span);
    printf("METRIC max_out_gap %llu\n", (unsigned long long)max_out_gap);
    printf("METRIC boundary_gaps %llu\n", (unsigned long long)boundary_gaps);
    printf("METRIC stall_in_after_first %llu\n", (unsigned long long)stall_in_after_first);
    if (span) printf("METRIC throughput %.6f\n", (double)blocks_out_total / (double)span);
    printf(fails ? "FAIL (%d failures)\n" : "PASS\n", fails);
    return fails ? 1 : 0;
}

}  // namespace

int tb_main(VerilatedContext* ctx, int argc, char** argv) {
    double idle = 0, stall = 0;
    uint64_t seed = 1;
    const char* job = nullptr;
    for (int i = 0; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--idle" && i + 1 < argc) idle = atof(argv[++i]);
        else if (a == "--stall" && i + 1 < argc) stall = atof(argv[++i]);
        else if (a == "--seed" && i + 1 < argc) seed = strtoull(argv[++i], nullptr, 0);
        else if (a[0] != '-') job = argv[i];
    }
    if (!job) { fprintf(stderr, "usage: xts_sim test JOBFILE [--idle P] [--stall P] [--seed N]\n"); return 2; }
    // registers without a reset start with random values (built with --x-initial unique)
    ctx->randReset(2);
    ctx->randSeed((int)(seed & 0x7fffffff));
    Tb tb(ctx, idle, stall, seed);
    if (!tb.load(job)) return 2;
    return tb.run();
}
