// xts_sim: the Verilated XTS-AES-256 core as a co-process (stdin/stdout framing, docs/rtl.md),
// plus the cycle-level testbench ("xts_sim test JOBFILE ...", see xts_tb.cpp).
//
//   xts_sim [serve]          frames on stdin, replies on stdout, until EOF or a QUIT frame
//   xts_sim test JOB [...]   run a testbench job file
//
// Frames (all integers little-endian), request header 40 bytes:
//   u32 magic 0x31535458 ("XTS1")  u8 op  u8 flags(0)  u16 reserved(0)
//   u32 sector_size  u32 payload_len  u64 first_tweak  u64 tweak_step  u64 first_tweak_hi
//   then payload_len bytes.
// Reply header 40 bytes:
//   u32 magic  u8 op  u8 status (0 ok, 1 error: payload is a message)  u16 reserved
//   u32 sector_size  u32 payload_len  u64 cycles (this request)  u64 total_cycles  u64 wall_ns
//   then payload_len bytes.
// ops: 0 PING, 1 SET_KEYS (payload Key1||Key2, 64 bytes), 2 ENCRYPT, 3 DECRYPT, 4 BYPASS
//      (payload: whole sectors; sector i uses tweak first_tweak + i*tweak_step, 128-bit add),
//      5 STATS (reply payload: the 10 registers 0x00..0x24 as u32), 6 CLEAR_KEYS, 7 QUIT.
#include <chrono>
#include <unistd.h>

#include "xts_harness.h"

using namespace xts;

int tb_main(VerilatedContext* ctx, int argc, char** argv);

namespace {

constexpr uint32_t MAGIC = 0x31535458;
enum { OP_PING = 0, OP_SET_KEYS = 1, OP_ENCRYPT = 2, OP_DECRYPT = 3, OP_BYPASS = 4, OP_STATS = 5,
       OP_CLEAR_KEYS = 6, OP_QUIT = 7 };

bool read_full(int fd, void* buf, size_t n) {
    uint8_t* p = (uint8_t*)buf;
    while (n) {
        ssize_t r = read(fd, p, n);
        if (r <= 0) return false;
        p += r; n -= (size_t)r;
    }
    return true;
}

bool write_full(int fd, const void* buf, size_t n) {
    const uint8_t* p = (const uint8_t*)buf;
    while (n) {
        ssize_t r = write(fd, p, n);
        if (r <= 0) return false;
        p += r; n -= (size_t)r;
    }
    return true;
}

uint32_t rd32(const uint8_t* p) { return Sim::le32(p); }
uint64_t rd64(const uint8_t* p) { return (uint64_t)rd32(p) | ((uint64_t)rd32(p + 4) << 32); }
void wr32(uint8_t* p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
void wr64(uint8_t* p, uint64_t v) { wr32(p, (uint32_t)v); wr32(p + 4, (uint32_t)(v >> 32)); }

class Server {
public:
    explicit Server(VerilatedContext* ctx) : sim(ctx) {
        sim.reset();
        sim.top->m_axis_tready = 1;
    }

    int serve() {
        uint8_t h[40];
        std::vector<uint8_t> payload;
        for (;;) {
            if (!read_full(0, h, sizeof h)) return 0;   // EOF: done
            if (rd32(h) != MAGIC) { fprintf(stderr, "xts_sim: bad magic\n"); return 1; }
            uint8_t op = h[4];
            uint32_t ss = rd32(h + 8), len = rd32(h + 12);
            uint64_t tw = rd64(h + 16), step = rd64(h + 24), tw_hi = rd64(h + 32);
            payload.resize(len);
            if (len && !read_full(0, payload.data(), len)) return 1;
            auto t0 = std::chrono::steady_clock::now();
            uint64_t c0 = sim.cycles;
            std::string err;
            std::vector<uint8_t> out;
            switch (op) {
            case OP_PING: break;
            case OP_QUIT: reply(op, 0, ss, {}, 0, t0); return 0;
            case OP_SET_KEYS:
                if (len != 64) err = "SET_KEYS needs 64 bytes (Key1 || Key2, XTS-AES-256)";
                else sim.load_keys(payload.data(), payload.data() + 32);
                break;
            case OP_CLEAR_KEYS:
                sim.axi_write(REG_CMD, CMD_KEY_CLEAR);
                while (sim.axi_read(REG_STATUS) & (ST_KEY_BUSY | ST_KEY_VALID)) {}
                break;
            case OP_STATS:
                for (uint32_t a = 0; a <= REG_CONFIG; a += 4) {
                    uint8_t b[4];
                    wr32(b, sim.axi_read(a));
                    out.insert(out.end(), b, b + 4);
                }
                break;
            case OP_ENCRYPT: case OP_DECRYPT: case OP_BYPASS:
                if (ss < 16 || ss % 16 || len % ss) err = "sector_size must be a multiple of 16 and divide the payload";
                else if (op != OP_BYPASS && !(sim.axi_read(REG_STATUS) & ST_KEY_VALID)) err = "no keys loaded";
                else { out = payload; stream(op, ss, tw, tw_hi, step, out); }
                break;
            default: err = "unknown op";
            }
            if (!err.empty()) {
                if (!reply(op, 1, ss, std::vector<uint8_t>(err.begin(), err.end()), sim.cycles - c0, t0)) return 1;
            } else if (!reply(op, 0, ss, out, sim.cycles - c0, t0)) {
                return 1;
            }
        }
    }

private:
    Sim sim;
    uint32_t ctrl = 0xFFFFFFFF;

    bool reply(uint8_t op, uint8_t status, uint32_t ss, const std::vector<uint8_t>& p, uint64_t cycles,
               std::chrono::steady_clock::time_point t0) {
        uint8_t h[40] = {};
        wr32(h, MAGIC);
        h[4] = op; h[5] = status;
        wr32(h + 8, ss); wr32(h + 12, (uint32_t)p.size());
        wr64(h + 16, cycles); wr64(h + 24, sim.cycles);
        auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
        wr64(h + 32, (uint64_t)ns);
        return write_full(1, h, sizeof h) && (p.empty() || write_full(1, p.data(), p.size()));
    }

    void set_ctrl(uint32_t mode, uint32_t ss) {
        uint32_t ssize = ss == 512 ? SSIZE_512 : ss == 4096 ? SSIZE_4096 : SSIZE_ANY;
        uint32_t v = mode | (ssize << 4);
        if (v != ctrl) { sim.axi_write(REG_CTRL, v); ctrl = v; }
    }

    // Feed all sectors back to back (s_valid held high) while draining the output at full rate.
    void stream(uint8_t op, uint32_t ss, uint64_t tw, uint64_t tw_hi, uint64_t step, std::vector<uint8_t>& buf) {
        set_ctrl(op == OP_BYPASS ? MODE_BYPASS : MODE_AUTO, ss);
        auto* t = sim.top;
        const size_t nblk = buf.size() / 16, per = ss / 16;
        std::vector<uint8_t> in = buf;
        size_t ib = 0, ob = 0;
        uint64_t lo = tw, hi = tw_hi;
        t->s_axis_dir = op == OP_ENCRYPT;
        while (ob < nblk) {
            if (ib < nblk) {
                if (ib % per == 0) {
                    size_t sec = ib / per;
                    // 128-bit tweak number: first + sec * step
                    unsigned __int128 v = ((unsigned __int128)hi << 64 | lo) + (unsigned __int128)step * sec;
                    put_lba(t->s_axis_lba, (uint64_t)v, (uint64_t)(v >> 64));
                }
                put128(t->s_axis_tdata, &in[16 * ib]);
                t->s_axis_tlast = (ib % per) == per - 1;
                t->s_axis_tvalid = 1;
            } else {
                t->s_axis_tvalid = 0;
            }
            sim.settle();
            bool in_fire = t->s_axis_tvalid && t->s_axis_tready;
            bool out_fire = t->m_axis_tvalid;   // m_axis_tready = 1
            if (out_fire) get128(t->m_axis_tdata, &buf[16 * ob]);
            sim.edge();
            if (in_fire) ib++;
            if (out_fire) ob++;
        }
        t->s_axis_tvalid = 0;
    }
};

}  // namespace

int main(int argc, char** argv) {
    auto ctx = std::make_unique<VerilatedContext>();
    ctx->commandArgs(argc, argv);
    std::string mode = argc > 1 ? argv[1] : "serve";
    if (mode == "test") return tb_main(ctx.get(), argc - 2, argv + 2);
    if (mode == "serve") {
        Server s(ctx.get());
        return s.serve();
    }
    fprintf(stderr, "usage: xts_sim [serve] | xts_sim test JOBFILE [--idle P] [--stall P] [--seed N]\n");
    return 2;
}
