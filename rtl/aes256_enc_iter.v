// Iterative AES-256 encryption, one round per ce-cycle, round keys computed on the fly.
//
// Used by the XTS wrapper to encrypt the sector number with Key2 (the initial tweak). Only one
// tweak is needed per sector (>= 32 blocks), so an iterative core (16 S-boxes for the state and
// 4 for the key schedule, no round-key storage) is enough to keep the data pipeline busy.
//
// When ce && start: state <= din ^ key[127:0] (round 0) and the key window is loaded. Each
// following ce-cycle runs one round; after 14 of them done = 1 and dout holds AES-256_key(din).
// dout is not meaningful while busy. rst / clear zero the state and the key window.
module aes256_enc_iter (
    input  wire         clk,
    input  wire         rst,
    input  wire         clear,
    input  wire         ce,
    input  wire         start,
    input  wire [255:0] key,
    input  wire [127:0] din,
    output wire [127:0] dout,
    output wire         busy,
    output wire         done
);
`include "aes_funcs.vh"

    reg [127:0] state;
    reg [127:0] win_a, win_b;    // win_b = key of the round run next; win_a = the one before
    reg [3:0]   rnd;             // round run next (1..14); 0 = idle, 15 = done
    reg [7:0]   rcon;

    wire [127:0] round_out, next_key;
    aes_round #(.HAS_DEC(0)) u_round (.dec(1'b0), .last(rnd == 4'd14), .x(state), .k(win_b), .y(round_out));
    // key of round rnd+1 (even index: RotWord/SubWord/Rcon; odd: SubWord)
    aes256_ks_step u_ks (.a(win_a), .b3(win_b[127:96]), .odd_rk(~rnd[0]), .rcon(rcon), .n(next_key));

    always @(posedge clk) begin
        if (rst || clear) begin
            state <= 128'h0;
            win_a <= 128'h0;
            win_b <= 128'h0;
            rnd   <= 4'd0;
            rcon  <= 8'h0;
        end else if (ce) begin
            if (start) begin
                state <= din ^ key[127:0];
                win_a <= key[127:0];
                win_b <= key[255:128];
                rnd   <= 4'd1;
                rcon  <= 8'h01;
            end else if (rnd != 4'd0 && rnd != 4'd15) begin
                state <= round_out;
                win_a <= win_b;
                win_b <= next_key;
                if (rnd[0])
                    rcon <= aes_xt(rcon);
                rnd <= rnd + 4'd1;
            end
        end
    end

    assign dout = state;
    assign busy = rnd != 4'd0 && rnd != 4'd15;
    assign done = rnd == 4'd15;
endmodule
