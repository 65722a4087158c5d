// AES-256 key expansion, iterative (one round key per clock), with registered round keys.
//
// start (pulse) loads key[255:0] (byte i in bits [8i+7:8i]); round keys rk0 and rk1 are written
// in that cycle, rk2..rk14 in the next 13 cycles (4 key-schedule words per clock, 4 S-boxes).
// valid rises after the last one; busy is high meanwhile. For the equivalent inverse cipher it
// also stores dkm_r = InvMixColumns(rk_{14-r}) for r = 1..13 (only when HAS_DEC), each one a
// step after its round key.
// clear (or rst) zeroes every register that holds key material and drops valid.
module aes256_key_expand #(
    parameter HAS_DEC = 1
) (
    input  wire              clk,
    input  wire              rst,
    input  wire              clear,
    input  wire              start,
    input  wire [255:0]      key,
    output reg               busy,
    output reg               valid,
    output wire [15*128-1:0] rk_flat,   // rk_r in bits [128r +: 128], r = 0..14
    output wire [15*128-1:0] dkm_flat   // dkm_r in bits [128r +: 128], r = 1..13 (0 and 14 unused, zero)
);
`include "aes_funcs.vh"

    reg [127:0] win_a, win_b;      // previous two round keys (older, newer)
    reg [3:0]   idx;               // index of the round key produced in this cycle (2..14)
    reg [7:0]   rcon;

    wire [127:0] next_rk;
    aes256_ks_step u_ks (.a(win_a), .b3(win_b[127:96]), .odd_rk(idx[0]), .rcon(rcon), .n(next_rk));

    always @(posedge clk) begin
        if (rst || clear) begin
            win_a <= 128'h0;
            win_b <= 128'h0;
            idx   <= 4'd0;
            rcon  <= 8'h0;
            busy  <= 1'b0;
            valid <= 1'b0;
        end else if (start) begin
            win_a <= key[127:0];
            win_b <= key[255:128];
            idx   <= 4'd2;
            rcon  <= 8'h01;
            busy  <= 1'b1;
            valid <= 1'b0;
        end else if (busy) begin
            win_a <= win_b;
            win_b <= next_rk;
            if (!idx[0])
                rcon <= aes_xt(rcon);
            if (idx == 4'd14) begin
                busy  <= 1'b0;
                valid <= 1'b1;
                idx   <= 4'd0;
            end else begin
                idx <= idx + 4'd1;
            end
        end
    end

    genvar r;
    generate
        for (r = 0; r < 15; r = r + 1) begin : g_rk
            reg [127:0] rk;
            always @(posedge clk) begin
                if (rst || clear)
                    rk <= 128'h0;
                else if (start && r == 0)
                    rk <= key[127:0];
                else if (start && r == 1)
                    rk <= key[255:128];
                else if (busy && idx == r)
                    rk <= next_rk;
            end
            assign rk_flat[128*r +: 128] = rk;

            if (HAS_DEC && r >= 1 && r <= 13) begin : g_dk
                // dkm_r = InvMixColumns(rk_{14-r}), computed one step after rk_{14-r} is made,
                // from win_b (which holds it then), so the InvMixColumns network sits between
                // two registers instead of behind the key-schedule step
                reg [127:0] dk;
                always @(posedge clk) begin
                    if (rst || clear)
                        dk <= 128'h0;
                    else if (busy && idx == (15 - r))
                        dk <= aes_invmixcols(win_b);
                end
                assign dkm_flat[128*r +: 128] = dk;
            end else begin : g_nodk
                assign dkm_flat[128*r +: 128] = 128'h0;
            end
        end
    endgenerate
endmodule
