// AXI4-Lite register block of the XTS bridge core (32-bit data, 8-bit byte address).
// Register map (see docs/rtl.md):
//   0x00 ID        RO  0x58545331 ("XTS1")
//   0x04 CTRL      RW  [1:0] MODE (0 = direction from s_dir, 1 = encrypt, 2 = decrypt, 3 = bypass)
//                      [5:4] SSIZE (0 = 512, 1 = 4096, 2 = any length); both sampled per sector
//   0x08 CMD       WO  [0] KEY_LOAD [1] KEY_CLEAR [2] CNT_CLEAR [3] ERR_CLEAR (self-clearing)
//   0x0C STATUS    RO  [0] KEY_VALID [1] KEY_BUSY [2] IDLE [3] LEN_ERR (sticky) [4] TWEAK_ERR (sticky)
//   0x10 SECTORS   RO  sectors delivered on the output stream
//   0x14 BLOCKS    RO  16-byte blocks delivered on the output stream
//   0x18 STALL_IN  RO  cycles with s_valid && !s_ready
//   0x1C STALL_OUT RO  cycles with m_valid && !m_ready
//   0x20 LEN_ERRS  RO  sectors whose length did not match SSIZE
//   0x24 CONFIG    RO  [0] HAS_DEC, [15:8] LBA_W
//   0x40..0x5C KEY1[0..7]  WO (read as 0); word j = key bytes 4j..4j+3, little-endian
//   0x60..0x7C KEY2[0..7]  WO (read as 0)
// Key words are staging registers: KEY_LOAD copies them into the core at the next sector
// boundary, after which they are zeroed. Reset zeroes them too. Counters are 32 bits and wrap.
module xts_csr #(
    parameter LBA_W   = 128,
    parameter HAS_DEC = 1
) (
    input  wire         clk,
    input  wire         rst,
    // AXI4-Lite slave
    input  wire [7:0]   s_axil_awaddr,
    input  wire         s_axil_awvalid,
    output wire         s_axil_awready,
    input  wire [31:0]  s_axil_wdata,
    input  wire [3:0]   s_axil_wstrb,
    input  wire         s_axil_wvalid,
    output wire         s_axil_wready,
    output reg          s_axil_bvalid,
    input  wire         s_axil_bready,
    output wire [1:0]   s_axil_bresp,
    input  wire [7:0]   s_axil_araddr,
    input  wire         s_axil_arvalid,
    output wire         s_axil_arready,
    output reg  [31:0]  s_axil_rdata,
    output reg          s_axil_rvalid,
    input  wire         s_axil_rready,
    output wire [1:0]   s_axil_rresp,
    // to / from the core
    output reg  [1:0]   cfg_mode,
    output reg  [1:0]   cfg_ssize,
    output wire [255:0] key1,
    output wire [255:0] key2,
    output reg          key_load,
    output reg          key_clear,
    input  wire         key_taken,
    input  wire         key_valid,
    input  wire         key_busy,
    input  wire         idle,
    input  wire         ev_block,
    input  wire         ev_sector,
    input  wire         ev_stall_in,
    input  wire         ev_stall_out,
    input  wire         ev_len_err,
    input  wire         err_tweak
);
    reg [31:0] kw [0:15];              // staging key words: 0..7 Key1, 8..15 Key2
    reg [31:0] c_sectors, c_blocks, c_stall_in, c_stall_out, c_len_err;
    reg        len_err;

    wire wr = s_axil_awvalid & s_axil_wvalid & ~s_axil_bvalid;
    assign s_axil_awready = wr;
    assign s_axil_wready  = wr;
    assign s_axil_bresp   = 2'b00;
    assign s_axil_rresp   = 2'b00;
    assign s_axil_arready = ~s_axil_rvalid;

    wire [5:0] wa = s_axil_awaddr[7:2];
    wire [5:0] ra = s_axil_araddr[7:2];

    function [31:0] merge;
        input [31:0] old, val;
        input [3:0]  strb;
        integer b;
        begin
            for (b = 0; b < 4; b = b + 1)
                merge[8*b +: 8] = strb[b] ? val[8*b +: 8] : old[8*b +: 8];
        end
    endfunction

    wire cmd_wr   = wr && wa == 6'h02 && s_axil_wstrb[0];
    wire cnt_clr  = cmd_wr && s_axil_wdata[2];
    wire err_clr  = cmd_wr && s_axil_wdata[3];

    always @(posedge clk) begin
        if (rst) begin
            s_axil_bvalid <= 1'b0;
            cfg_mode      <= 2'd0;
            cfg_ssize     <= 2'd0;
            key_load      <= 1'b0;
            key_clear     <= 1'b0;
        end else begin
            key_load  <= 1'b0;
            key_clear <= 1'b0;
            if (s_axil_bvalid && s_axil_bready)
                s_axil_bvalid <= 1'b0;
            if (wr) begin
                s_axil_bvalid <= 1'b1;
                if (wa == 6'h01 && s_axil_wstrb[0]) begin
                    cfg_mode  <= s_axil_wdata[1:0];
                    cfg_ssize <= s_axil_wdata[5:4];
                end
                if (cmd_wr) begin
                    key_load  <= s_axil_wdata[0];
                    key_clear <= s_axil_wdata[1];
                end
            end
        end
    end

    genvar g;
    generate
        for (g = 0; g < 16; g = g + 1) begin : g_kw
            always @(posedge clk) begin
                if (rst)
                    kw[g] <= 32'h0;
                else if (wr && wa == 6'h10 + g)
                    kw[g] <= merge(kw[g], s_axil_wdata, s_axil_wstrb);
                else if (key_taken)
                    kw[g] <= 32'h0;
            end
        end
        for (g = 0; g < 8; g = g + 1) begin : g_key
            assign key1[32*g +: 32] = kw[g];
            assign key2[32*g +: 32] = kw[8 + g];
        end
    endgenerate

    always @(posedge clk) begin
        if (rst || cnt_clr) begin
            c_sectors   <= 32'h0;
            c_blocks    <= 32'h0;
            c_stall_in  <= 32'h0;
            c_stall_out <= 32'h0;
            c_len_err   <= 32'h0;
        end else begin
            if (ev_sector)    c_sectors   <= c_sectors + 32'h1;
            if (ev_block)     c_blocks    <= c_blocks + 32'h1;
            if (ev_stall_in)  c_stall_in  <= c_stall_in + 32'h1;
            if (ev_stall_out) c_stall_out <= c_stall_out + 32'h1;
            if (ev_len_err)   c_len_err   <= c_len_err + 32'h1;
        end
    end

    always @(posedge clk) begin
        if (rst || err_clr)
            len_err <= 1'b0;
        else if (ev_len_err)
            len_err <= 1'b1;
    end

    always @(posedge clk) begin
        if (rst) begin
            s_axil_rvalid <= 1'b0;
            s_axil_rdata  <= 32'h0;
        end else if (s_axil_rvalid) begin
            if (s_axil_rready)
                s_axil_rvalid <= 1'b0;
        end else if (s_axil_arvalid) begin
            s_axil_rvalid <= 1'b1;
            case (ra)
                6'h00: s_axil_rdata <= 32'h58545331;
                6'h01: s_axil_rdata <= {26'h0, cfg_ssize, 2'b00, cfg_mode};
                6'h03: s_axil_rdata <= {27'h0, err_tweak, len_err, idle, key_busy, key_valid};
                6'h04: s_axil_rdata <= c_sectors;
                6'h05: s_axil_rdata <= c_blocks;
                6'h06: s_axil_rdata <= c_stall_in;
                6'h07: s_axil_rdata <= c_stall_out;
                6'h08: s_axil_rdata <= c_len_err;
                6'h09: s_axil_rdata <= {16'h0, LBA_W[7:0], 7'h0, HAS_DEC[0]};
                default: s_axil_rdata <= 32'h0;   // key words are write-only
            endcase
        end
    end
endmodule
