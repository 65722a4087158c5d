// Shared C++ harness around the Verilated xts_top: clocking, pre-edge sampling, AXI4-Lite
// master, key loading. Used by the co-process (xts_sim.cpp) and the testbench (xts_tb.cpp).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "Vxts_top.h"
#include "verilated.h"

namespace xts {

// register map (docs/rtl.md)
enum : uint32_t {
    REG_ID = 0x00, REG_CTRL = 0x04, REG_CMD = 0x08, REG_STATUS = 0x0C, REG_SECTORS = 0x10,
    REG_BLOCKS = 0x14, REG_STALL_IN = 0x18, REG_STALL_OUT = 0x1C, REG_LEN_ERRS = 0x20,
    REG_CONFIG = 0x24, REG_KEY1 = 0x40, REG_KEY2 = 0x60,
};
enum : uint32_t { CMD_KEY_LOAD = 1, CMD_KEY_CLEAR = 2, CMD_CNT_CLEAR = 4, CMD_ERR_CLEAR = 8 };
enum : uint32_t { ST_KEY_VALID = 1, ST_KEY_BUSY = 2, ST_IDLE = 4, ST_LEN_ERR = 8, ST_TWEAK_ERR = 16 };
enum : uint32_t { MODE_AUTO = 0, MODE_ENC = 1, MODE_DEC = 2, MODE_BYPASS = 3 };
enum : uint32_t { SSIZE_512 = 0, SSIZE_4096 = 1, SSIZE_ANY = 2 };

inline void put128(VlWide<4>& w, const uint8_t* b) {
    for (int i = 0; i < 4; i++)
        w[i] = (uint32_t)b[4 * i] | ((uint32_t)b[4 * i + 1] << 8) | ((uint32_t)b[4 * i + 2] << 16) |
               ((uint32_t)b[4 * i + 3] << 24);
}
inline void get128(const VlWide<4>& w, uint8_t* b) {
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) b[4 * i + j] = (uint8_t)(w[i] >> (8 * j));
}
inline void put_lba(VlWide<4>& w, uint64_t lo, uint64_t hi) {
    w[0] = (uint32_t)lo; w[1] = (uint32_t)(lo >> 32); w[2] = (uint32_t)hi; w[3] = (uint32_t)(hi >> 32);
}

// One simulated clock: inputs are set by the caller before step(); the harness settles the
// combinational logic with the clock low, lets the caller sample handshakes (pre-edge values),
// then raises the clock.
class Sim {
public:
    explicit Sim(VerilatedContext* ctx) : top(new Vxts_top(ctx)) {
        top->clk = 0;
        top->aresetn = 0;
        top->s_axil_wstrb = 0xF;
        top->s_axil_bready = 1;
        top->s_axil_rready = 1;
        top->eval();
    }
    ~Sim() { top->final(); delete top; }

    Vxts_top* top;
    uint64_t cycles = 0;

    void settle() { top->clk = 0; top->eval(); }
    void edge() { top->clk = 1; top->eval(); top->clk = 0; top->eval(); cycles++; }
    void tick() { settle(); edge(); }

    void reset(int n = 4) {
        top->aresetn = 0;
        top->s_axis_tvalid = 0;
        top->s_axil_awvalid = 0; top->s_axil_wvalid = 0; top->s_axil_arvalid = 0;
        for (int i = 0; i < n; i++) tick();
        top->aresetn = 1;
        tick();
    }

    // Blocking AXI4-Lite accesses (nothing else is driven meanwhile; m_axis_tready is left as is).
    void axi_write(uint32_t addr, uint32_t data) {
        top->s_axil_awaddr = addr; top->s_axil_wdata = data;
        top->s_axil_awvalid = 1; top->s_axil_wvalid = 1;
        for (int guard = 0;; guard++) {
            settle();
            bool fire = top->s_axil_awready && top->s_axil_wready;
            edge();
            if (fire) break;
            if (guard > 1000) die("AXI write timeout");
        }
        top->s_axil_awvalid = 0; top->s_axil_wvalid = 0;
        for (int guard = 0;; guard++) {
            settle();
            bool b = top->s_axil_bvalid;
            edge();
            if (b) break;
            if (guard > 1000) die("AXI write response timeout");
        }
    }
    uint32_t axi_read(uint32_t addr) {
        top->s_axil_araddr = addr; top->s_axil_arvalid = 1;
        for (int guard = 0;; guard++) {
            settle();
            bool fire = top->s_axil_arready;
            edge();
            if (fire) break;
            if (guard > 1000) die("AXI read timeout");
        }
        top->s_axil_arvalid = 0;
        for (int guard = 0;; guard++) {
            settle();
            bool r = top->s_axil_rvalid;
            uint32_t d = top->s_axil_rdata;
            edge();
            if (r) return d;
            if (guard > 1000) die("AXI read data timeout");
        }
    }
    // Write Key1 and Key2 (32 bytes each, byte order as in the key file) and KEY_LOAD; wait
    // until the core reports the keys valid.
    void load_keys(const uint8_t* k1, const uint8_t* k2) {
        for (int j = 0; j < 8; j++) axi_write(REG_KEY1 + 4 * j, le32(k1 + 4 * j));
        for (int j = 0; j < 8; j++) axi_write(REG_KEY2 + 4 * j, le32(k2 + 4 * j));
        axi_write(REG_CMD, CMD_KEY_LOAD);
        for (int guard = 0;; guard++) {
            uint32_t st = axi_read(REG_STATUS);
            if ((st & ST_KEY_VALID) && !(st & ST_KEY_BUSY)) break;
            if (guard > 10000) die("key load timeout");
        }
    }
    static uint32_t le32(const uint8_t* p) {
        return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
    }
    [[noreturn]] static void die(const char* msg) {
        fprintf(stderr, "xts harness: %s\n", msg);
        exit(3);
    }
};

}  // namespace xts
