// XTS-AES-256 bridge core: AXI4-Lite register block + streaming XTS core.
// Reset: aresetn, active low, synchronous (AXI convention). It zeroes all key material.
module xts_top #(
    parameter LBA_W   = 128,
    parameter HAS_DEC = 1
) (
    input  wire             clk,
    input  wire             aresetn,
    // AXI4-Lite registers
    input  wire [7:0]       s_axil_awaddr,
    input  wire             s_axil_awvalid,
    output wire             s_axil_awready,
    input  wire [31:0]      s_axil_wdata,
    input  wire [3:0]       s_axil_wstrb,
    input  wire             s_axil_wvalid,
    output wire             s_axil_wready,
    output wire             s_axil_bvalid,
    input  wire             s_axil_bready,
    output wire [1:0]       s_axil_bresp,
    input  wire [7:0]       s_axil_araddr,
    input  wire             s_axil_arvalid,
    output wire             s_axil_arready,
    output wire [31:0]      s_axil_rdata,
    output wire             s_axil_rvalid,
    input  wire             s_axil_rready,
    output wire [1:0]       s_axil_rresp,
    // input stream (host side for writes / disk side for reads)
    input  wire             s_axis_tvalid,
    output wire             s_axis_tready,
    input  wire [127:0]     s_axis_tdata,
    input  wire             s_axis_tlast,
    input  wire [LBA_W-1:0] s_axis_lba,
    input  wire             s_axis_dir,
    // output stream
    output wire             m_axis_tvalid,
    input  wire             m_axis_tready,
    output wire [127:0]     m_axis_tdata,
    output wire             m_axis_tlast,
    output wire [1:0]       m_axis_tuser
);
    wire rst = ~aresetn;

    wire [1:0]   cfg_mode, cfg_ssize;
    wire [255:0] key1, key2;
    wire         key_load, key_clear, key_taken, key_valid, key_busy, idle;
    wire         ev_block, ev_sector, ev_stall_in, ev_stall_out, ev_len_err, err_tweak;

    xts_csr #(.LBA_W(LBA_W), .HAS_DEC(HAS_DEC)) u_csr (
        .clk(clk), .rst(rst),
        .s_axil_awaddr(s_axil_awaddr), .s_axil_awvalid(s_axil_awvalid), .s_axil_awready(s_axil_awready),
        .s_axil_wdata(s_axil_wdata), .s_axil_wstrb(s_axil_wstrb), .s_axil_wvalid(s_axil_wvalid),
        .s_axil_wready(s_axil_wready), .s_axil_bvalid(s_axil_bvalid), .s_axil_bready(s_axil_bready),
        .s_axil_bresp(s_axil_bresp), .s_axil_araddr(s_axil_araddr), .s_axil_arvalid(s_axil_arvalid),
        .s_axil_arready(s_axil_arready), .s_axil_rdata(s_axil_rdata), .s_axil_rvalid(s_axil_rvalid),
        .s_axil_rready(s_axil_rready), .s_axil_rresp(s_axil_rresp),
        .cfg_mode(cfg_mode), .cfg_ssize(cfg_ssize), .key1(key1), .key2(key2),
        .key_load(key_load), .key_clear(key_clear), .key_taken(key_taken),
        .key_valid(key_valid), .key_busy(key_busy), .idle(idle),
        .ev_block(ev_block), .ev_sector(ev_sector), .ev_stall_in(ev_stall_in),
        .ev_stall_out(ev_stall_out), .ev_len_err(ev_len_err), .err_tweak(err_tweak));

    xts_core #(.LBA_W(LBA_W), .HAS_DEC(HAS_DEC)) u_core (
        .clk(clk), .rst(rst),
        .s_valid(s_axis_tvalid), .s_ready(s_axis_tready), .s_data(s_axis_tdata),
        .s_last(s_axis_tlast), .s_lba(s_axis_lba), .s_dir(s_axis_dir),
        .m_valid(m_axis_tvalid), .m_ready(m_axis_tready), .m_data(m_axis_tdata),
        .m_last(m_axis_tlast), .m_user(m_axis_tuser),
        .cfg_mode(cfg_mode), .cfg_ssize(cfg_ssize),
        .key1(key1), .key2(key2), .key_load(key_load), .key_clear(key_clear),
        .key_taken(key_taken), .key_valid(key_valid), .key_busy(key_busy),
        .idle(idle), .ev_block(ev_block), .ev_sector(ev_sector), .ev_stall_in(ev_stall_in),
        .ev_stall_out(ev_stall_out), .ev_len_err(ev_len_err), .err_tweak(err_tweak));
endmodule
