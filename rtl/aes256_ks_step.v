// One AES-256 key-schedule step (FIPS-197 5.2), combinational: from the previous 8 words, given
// as a = the older 4 and b3 = the newest word, make the next 4 words (the next round key).
// odd_rk = 0: the new round key has an even index 2m (RotWord, SubWord, Rcon[m] = rcon);
// odd_rk = 1: odd index (SubWord only).
module aes256_ks_step (
    input  wire [127:0] a,
    input  wire [31:0]  b3,
    input  wire         odd_rk,
    input  wire [7:0]   rcon,
    output wire [127:0] n
);
    wire [31:0] w = odd_rk ? b3 : {b3[7:0], b3[31:8]};   // RotWord in byte-lane order
    wire [31:0] sw;

    genvar j;
    generate
        for (j = 0; j < 4; j = j + 1) begin : g_sb
            aes_sbox #(.HAS_DEC(0)) u_sb (.dec(1'b0), .x(w[8*j +: 8]), .y(sw[8*j +: 8]));
        end
    endgenerate

    wire [31:0] t  = odd_rk ? sw : sw ^ {24'h0, rcon};
    wire [31:0] n0 = a[31:0] ^ t;
    wire [31:0] n1 = a[63:32] ^ n0;
    wire [31:0] n2 = a[95:64] ^ n1;
    wire [31:0] n3 = a[127:96] ^ n2;
    assign n = {n3, n2, n1, n0};
endmodule
