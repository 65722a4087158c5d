// AES-256 known-answer test of aes256_key_expand + aes256_pipe (unified, and encrypt-only).
// Vectors: +vec=FILE (from rtl/tests/run_tests.py: NIST CAVP ECB*256 + SP 800-38A ECB), one
// $readmemh word per vector: {dec[3:0], key[255:0], in[127:0], expected[127:0]}, byte 0 in the
// low bits. +n=COUNT. Blocks with the same key stream back to back (1 per clock); the pipeline is
// drained before a key change. Prints "PASS aes_kat ..." or "FAIL ...", and $finish.
`timescale 1ns/1ps
module tb_aes_kat;
    reg clk = 1'b0;
    always #5 clk = ~clk;

    reg          rst = 1'b1;
    reg          kx_start = 1'b0;
    reg  [255:0] kx_key = 256'h0;
    wire         kx_busy, kx_valid;
    wire [15*128-1:0] rk, dkm;
    reg          in_valid = 1'b0, in_dec = 1'b0;
    reg  [127:0] in_data = 128'h0;
    reg  [15:0]  in_tag = 16'h0;
    wire         out_valid, out_dec, eo_valid, eo_dec;
    wire [127:0] out_data, eo_data;
    wire [15:0]  out_tag, eo_tag;
    wire [14:0]  sv, sv2;
    wire         kx2_busy, kx2_valid;
    wire [15*128-1:0] rk2, dkm2;

    aes256_key_expand #(.HAS_DEC(1)) u_kx (.clk(clk), .rst(rst), .clear(1'b0), .start(kx_start),
        .key(kx_key), .busy(kx_busy), .valid(kx_valid), .rk_flat(rk), .dkm_flat(dkm));
    aes256_pipe #(.HAS_DEC(1), .TAG_W(16)) u_pipe (.clk(clk), .rst(rst), .ce(1'b1),
        .in_valid(in_valid), .in_dec(in_dec), .in_data(in_data), .in_tag(in_tag),
        .rk_flat(rk), .dkm_flat(dkm), .out_valid(out_valid), .out_dec(out_dec),
        .out_data(out_data), .out_tag(out_tag), .stage_valid(sv));
    // encryption-only configuration, fed the encryption vectors only
    aes256_key_expand #(.HAS_DEC(0)) u_kx2 (.clk(clk), .rst(rst), .clear(1'b0), .start(kx_start),
        .key(kx_key), .busy(kx2_busy), .valid(kx2_valid), .rk_flat(rk2), .dkm_flat(dkm2));
    aes256_pipe #(.HAS_DEC(0), .TAG_W(16)) u_enc (.clk(clk), .rst(rst), .ce(1'b1),
        .in_valid(in_valid & ~in_dec), .in_dec(1'b0), .in_data(in_data), .in_tag(in_tag),
        .rk_flat(rk2), .dkm_flat(dkm2), .out_valid(eo_valid), .out_dec(eo_dec),
        .out_data(eo_data), .out_tag(eo_tag), .stage_valid(sv2));

    reg [515:0] mem [0:4095];
    integer n, i, sent, got, got_enc, fails, lat;
    reg [255:0] cur_key;
    reg have_key;
    reg [1023:0] vecfile;

    // latency of the first block: clock edges from the one that takes it in to the one at which
    // it is valid at the output
    integer cyc = 0, first_in = -1, first_out = -1;
    always @(posedge clk) begin
        cyc <= cyc + 1;
        if (in_valid && first_in < 0) first_in <= cyc;
        if (out_valid && first_out < 0) first_out <= cyc;
    end

    // checker
    always @(posedge clk) begin
        if (out_valid) begin
            if (out_tag != got[15:0] || out_dec != mem[got][512] ||
                out_data !== mem[got][127:0]) begin
                $display("FAIL aes_kat vector %0d dec=%0d: got %h want %h (tag %0d)", got,
                         mem[got][512], out_data, mem[got][127:0], out_tag);
                fails = fails + 1;
            end
            got = got + 1;
        end
        if (eo_valid) begin
            if (eo_data !== mem[eo_tag][127:0] || mem[eo_tag][512]) begin
                $display("FAIL aes_kat enc-only vector %0d: got %h want %h", eo_tag, eo_data,
                         mem[eo_tag][127:0]);
                fails = fails + 1;
            end
            got_enc = got_enc + 1;
        end
    end

    integer n_enc;
    initial begin
        if (!$value$plusargs("vec=%s", vecfile)) begin
            $display("FAIL aes_kat: no +vec=FILE");
            $finish;
        end
        if (!$value$plusargs("n=%d", n)) n = 0;
        $readmemh(vecfile, mem);
        sent = 0; got = 0; got_enc = 0; fails = 0; have_key = 1'b0; n_enc = 0;
        for (i = 0; i < n; i = i + 1)
            if (!mem[i][512]) n_enc = n_enc + 1;
        repeat (3) @(posedge clk);
        rst <= 1'b0;
        @(posedge clk);
        for (i = 0; i < n; i = i + 1) begin
            if (!have_key || mem[i][511:256] != cur_key) begin
                in_valid <= 1'b0;
                while (got != sent) @(posedge clk);    // drain before changing keys
                kx_key   <= mem[i][511:256];
                kx_start <= 1'b1;
                @(posedge clk);
                kx_start <= 1'b0;
                @(posedge clk);
                while (!kx_valid) @(posedge clk);
                cur_key  = mem[i][511:256];
                have_key = 1'b1;
            end
            in_valid <= 1'b1;
            in_dec   <= mem[i][512];
            in_data  <= mem[i][255:128];
            in_tag   <= i;
            sent = sent + 1;
            @(posedge clk);
        end
        in_valid <= 1'b0;
        for (i = 0; i < 100 && got != n; i = i + 1) @(posedge clk);
        repeat (20) @(posedge clk);
        lat = first_out - first_in;
        if (got != n || got_enc != n_enc) begin
            $display("FAIL aes_kat: %0d of %0d outputs (%0d of %0d enc-only)", got, n, got_enc, n_enc);
            fails = fails + 1;
        end
        if (fails == 0 && n > 0)
            $display("PASS aes_kat: %0d vectors (%0d decrypt), enc-only pipe %0d; pipeline latency %0d cycles",
                     n, n - n_enc, n_enc, lat);
        else
            $display("FAIL aes_kat: %0d failures, %0d vectors", fails, n);
        $finish;
    end
endmodule
