// Pipelined AES-256 datapath: initial AddRoundKey stage + 14 round stages, one block per clock.
//
// HAS_DEC = 1: unified encrypt/decrypt pipeline; every block carries its own direction bit
// (in_dec), so encryption and decryption blocks can follow each other back to back. Decryption
// uses the equivalent inverse cipher (FIPS-197 5.3.5), which has the same round structure as
// encryption: each stage has a direction-selected S-box (SubBytes/InvSubBytes), ShiftRows mux
// (rows 1 and 3 only), MixColumns with an optional InvMixColumns pre-step, and a key mux
// (rk_r or dkm_r = InvMixColumns(rk_{14-r})).
// HAS_DEC = 0: encryption only (the decryption logic is not generated).
//
// All registers advance together when ce = 1 (a global stall for back-pressure). Latency: 15
// ce-cycles from in_* to out_*. A TAG_W-bit side-band travels with each block unchanged. Only the
// valid bits are reset; data registers are not (so that tools may use shift-register primitives).
module aes256_pipe #(
    parameter HAS_DEC = 1,
    parameter TAG_W   = 1
) (
    input  wire              clk,
    input  wire              rst,
    input  wire              ce,
    input  wire              in_valid,
    input  wire              in_dec,
    input  wire [127:0]      in_data,
    input  wire [TAG_W-1:0]  in_tag,
    input  wire [15*128-1:0] rk_flat,
    input  wire [15*128-1:0] dkm_flat,
    output wire              out_valid,
    output wire              out_dec,
    output wire [127:0]      out_data,
    output wire [TAG_W-1:0]  out_tag,
    output wire [14:0]       stage_valid   // occupancy of stages 0..14 (for drain detection)
);

    reg [127:0]     st  [0:14];
    reg [TAG_W-1:0] tag [0:14];
    reg [14:0]      vld;
    reg [14:0]      dir;

    wire in_d = HAS_DEC ? in_dec : 1'b0;

    always @(posedge clk) begin
        if (rst)
            vld <= 15'h0;
        else if (ce)
            vld <= {vld[13:0], in_valid};
    end

    // stage 0: initial AddRoundKey (rk0 to encrypt, rk14 to decrypt)
    always @(posedge clk) begin
        if (ce) begin
            st[0]  <= in_data ^ (in_d ? rk_flat[128*14 +: 128] : rk_flat[127:0]);
            tag[0] <= in_tag;
            dir[0] <= in_d;
        end
    end

    genvar r;
    generate
        for (r = 1; r <= 14; r = r + 1) begin : g_round
            wire         d = HAS_DEC ? dir[r-1] : 1'b0;
            wire [127:0] k = !d ? rk_flat[128*r +: 128]
                                : (r == 14 ? rk_flat[127:0] : dkm_flat[128*r +: 128]);
            wire [127:0] nxt;
            aes_round #(.HAS_DEC(HAS_DEC)) u_round (.dec(d), .last(r == 14), .x(st[r-1]), .k(k), .y(nxt));
            always @(posedge clk) begin
                if (ce) begin
                    st[r]  <= nxt;
                    tag[r] <= tag[r-1];
                    dir[r] <= d;
                end
            end
        end
    endgenerate

    assign out_valid   = vld[14];
    assign out_dec     = dir[14];
    assign out_data    = st[14];
    assign out_tag     = tag[14];
    assign stage_valid = vld;
endmodule
