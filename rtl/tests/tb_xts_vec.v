// XTS-AES-256 vectors (IEEE 1619 via botan, Wycheproof) through xts_top: keys are loaded over
// AXI4-Lite, each vector runs as one encrypt sector and one decrypt sector (s_dir), SSIZE = any.
// Also checks: after reset every key register of the core reads zero, STATUS.KEY_VALID = 0, and
// key words read back as 0 over AXI.
// +vec=FILE: $readmemh words of 256 bits; per vector: {nblocks}, key1, key2, tweak, nblocks plain
// blocks, nblocks cipher blocks (byte 0 in the low bits). +n=VECTORS.
`timescale 1ns/1ps
module tb_xts_vec;
    reg clk = 1'b0;
    always #5 clk = ~clk;
    reg aresetn = 1'b0;

    reg  [7:0]   awaddr = 0, araddr = 0;
    reg          awvalid = 0, wvalid = 0, bready = 1, arvalid = 0, rready = 1;
    reg  [31:0]  wdata = 0;
    wire         awready, wready, bvalid, arready, rvalid;
    wire [1:0]   bresp, rresp;
    wire [31:0]  rdata;
    reg          s_valid = 0, s_last = 0, s_dir = 0;
    reg  [127:0] s_data = 0, s_lba = 0;
    wire         s_ready, m_valid, m_last;
    wire [127:0] m_data;
    wire [1:0]   m_user;

    xts_top dut (
        .clk(clk), .aresetn(aresetn),
        .s_axil_awaddr(awaddr), .s_axil_awvalid(awvalid), .s_axil_awready(awready),
        .s_axil_wdata(wdata), .s_axil_wstrb(4'hf), .s_axil_wvalid(wvalid), .s_axil_wready(wready),
        .s_axil_bvalid(bvalid), .s_axil_bready(bready), .s_axil_bresp(bresp),
        .s_axil_araddr(araddr), .s_axil_arvalid(arvalid), .s_axil_arready(arready),
        .s_axil_rdata(rdata), .s_axil_rvalid(rvalid), .s_axil_rready(rready), .s_axil_rresp(rresp),
        .s_axis_tvalid(s_valid), .s_axis_tready(s_ready), .s_axis_tdata(s_data),
        .s_axis_tlast(s_last), .s_axis_lba(s_lba), .s_axis_dir(s_dir),
        .m_axis_tvalid(m_valid), .m_axis_tready(1'b1), .m_axis_tdata(m_data),
        .m_axis_tlast(m_last), .m_axis_tuser(m_user));

    integer fails = 0;

    initial begin
        #(50_000_000);
        $display("FAIL xts_vec: timeout");
        $finish;
    end

    // Handshakes are sampled at the falling edge (inputs change only after rising edges), so the
    // tasks behave the same in Icarus and in Verilator's timing mode.
    task axi_write(input [7:0] a, input [31:0] d);
        begin
            awaddr <= a; wdata <= d; awvalid <= 1'b1; wvalid <= 1'b1;
            @(negedge clk);
            while (!(awready && wready)) @(negedge clk);
            @(posedge clk);
            awvalid <= 1'b0; wvalid <= 1'b0;
            @(negedge clk);
            while (!bvalid) @(negedge clk);
            @(posedge clk);
        end
    endtask

    task axi_read(input [7:0] a, output [31:0] d);
        begin
            araddr <= a; arvalid <= 1'b1;
            @(negedge clk);
            while (!arready) @(negedge clk);
            @(posedge clk);
            arvalid <= 1'b0;
            @(negedge clk);
            while (!rvalid) @(negedge clk);
            d = rdata;
            @(posedge clk);
        end
    endtask

    reg [31:0] r;
    task load_keys(input [255:0] k1, input [255:0] k2);
        integer j;
        begin
            for (j = 0; j < 8; j = j + 1) axi_write(8'h40 + 4*j, k1[32*j +: 32]);
            for (j = 0; j < 8; j = j + 1) axi_write(8'h60 + 4*j, k2[32*j +: 32]);
            axi_write(8'h08, 32'h1);                     // KEY_LOAD
            r = 32'h2;
            while (r[1] || !r[0]) axi_read(8'h0c, r);   // wait KEY_BUSY = 0, KEY_VALID = 1
        end
    endtask

    // all round keys, decryption keys, the tweak key and the key-schedule windows must be zero
    task check_keys_zero(input [8*24-1:0] when);
        integer q;
        reg nz;
        begin
            nz = |dut.u_core.k2 | |dut.u_core.u_kx.win_a | |dut.u_core.u_kx.win_b
               | |dut.u_core.u_tweak.win_a | |dut.u_core.u_tweak.win_b | |dut.u_core.u_tweak.state
               | |dut.u_core.rk_flat | |dut.u_core.dkm_flat | |dut.u_csr.key1 | |dut.u_csr.key2;
            if (nz) begin
                $display("FAIL xts_vec: key material not zero %0s", when);
                fails = fails + 1;
            end
            axi_read(8'h0c, r);
            if (r[0]) begin
                $display("FAIL xts_vec: KEY_VALID set %0s", when);
                fails = fails + 1;
            end
            for (q = 0; q < 16; q = q + 1) begin
                axi_read(8'h40 + 4*q, r);
                if (r != 0) begin
                    $display("FAIL xts_vec: key word %0d reads %h", q, r);
                    fails = fails + 1;
                end
            end
        end
    endtask

    reg [255:0] mem [0:16383];
    reg [1023:0] vecfile;
    integer n, v, p, nb, b, dirn, outs, sectors_done;
    reg [127:0] exp_q [0:511];
    integer exp_n, exp_i;

    // output checker: compares every output beat with the queue of expected blocks
    always @(posedge clk) begin
        if (aresetn && m_valid) begin
            if (exp_i >= exp_n || m_data !== exp_q[exp_i]) begin
                $display("FAIL xts_vec: vector %0d dir %0d block %0d: got %h want %h", v, dirn,
                         exp_i, m_data, exp_q[exp_i]);
                fails = fails + 1;
            end
            if (m_last !== (exp_i == exp_n - 1)) begin
                $display("FAIL xts_vec: vector %0d: m_last wrong at block %0d", v, exp_i);
                fails = fails + 1;
            end
            exp_i = exp_i + 1;
        end
    end

    initial begin
        if (!$value$plusargs("vec=%s", vecfile) || !$value$plusargs("n=%d", n)) begin
            $display("FAIL xts_vec: need +vec=FILE +n=N");
            $finish;
        end
        $readmemh(vecfile, mem);
        exp_n = 0; exp_i = 0; sectors_done = 0;
        repeat (4) @(posedge clk);
        aresetn <= 1'b1;
        @(posedge clk);
        axi_read(8'h00, r);
        if (r != 32'h58545331) begin
            $display("FAIL xts_vec: ID register %h", r);
            fails = fails + 1;
        end
        axi_write(8'h04, 32'h20);                        // MODE = from s_dir, SSIZE = any
        p = 0;
        for (v = 0; v < n; v = v + 1) begin
            nb = mem[p][15:0];
            load_keys(mem[p + 1], mem[p + 2]);
            for (dirn = 0; dirn < 2; dirn = dirn + 1) begin
                // dirn 0: encrypt plain -> cipher; 1: decrypt cipher -> plain
                for (b = 0; b < nb; b = b + 1)
                    exp_q[b] = mem[p + 4 + (dirn ? 0 : nb) + b][127:0];
                exp_i = 0; exp_n = nb;
                for (b = 0; b < nb; b = b + 1) begin
                    s_valid <= 1'b1;
                    s_data  <= mem[p + 4 + (dirn ? nb : 0) + b][127:0];
                    s_last  <= (b == nb - 1);
                    s_lba   <= mem[p + 3][127:0];
                    s_dir   <= (dirn == 0);
                    @(negedge clk);
                    while (!s_ready) @(negedge clk);
                    @(posedge clk);
                end
                s_valid <= 1'b0;
                outs = 0;
                while (exp_i < exp_n && outs < 2000) begin
                    @(posedge clk);
                    outs = outs + 1;
                end
                if (exp_i != exp_n) begin
                    $display("FAIL xts_vec: vector %0d dir %0d: %0d of %0d blocks came out", v, dirn, exp_i, exp_n);
                    fails = fails + 1;
                end
                sectors_done = sectors_done + 1;
            end
            p = p + 4 + 2 * nb;
        end
        axi_read(8'h10, r);
        if (r != sectors_done) begin
            $display("FAIL xts_vec: SECTORS counter %0d, expected %0d", r, sectors_done);
            fails = fails + 1;
        end
        axi_read(8'h0c, r);
        if (r[4] || r[3]) begin
            $display("FAIL xts_vec: STATUS %h (tweak or length error flagged)", r);
            fails = fails + 1;
        end
        // reset must leave no key material
        aresetn <= 1'b0;
        repeat (2) @(posedge clk);
        aresetn <= 1'b1;
        @(posedge clk);
        check_keys_zero("after reset");
        if (fails == 0)
            $display("PASS xts_vec: %0d vectors x 2 directions; key registers zero after reset", n);
        else
            $display("FAIL xts_vec: %0d failures", fails);
        $finish;
    end
endmodule
