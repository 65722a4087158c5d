// One AES round, combinational, with a per-block direction (unified encrypt/decrypt).
//   encrypt: SubBytes, ShiftRows, MixColumns (not when last), AddRoundKey(k)
//   decrypt: InvSubBytes, InvShiftRows, InvMixColumns (not when last), AddRoundKey(k): the
//            FIPS-197 5.3.5 equivalent inverse cipher, so middle rounds need k = InvMixColumns(rk).
// InvMixColumns is MixColumns after a cheap pre-step (aes_imix_pre), so both directions share the
// MixColumns XOR network. HAS_DEC = 0 drops every decryption part (dec is ignored).
module aes_round #(
    parameter HAS_DEC = 1
) (
    input  wire         dec,
    input  wire         last,
    input  wire [127:0] x,
    input  wire [127:0] k,
    output wire [127:0] y
);
`include "aes_funcs.vh"

    wire         d = (HAS_DEC != 0) && dec;
    wire [127:0] s;

    genvar j;
    generate
        for (j = 0; j < 16; j = j + 1) begin : g_sb
            aes_sbox #(.HAS_DEC(HAS_DEC)) u_sb (.dec(d), .x(x[8*j +: 8]), .y(s[8*j +: 8]));
        end
    endgenerate

    wire [127:0] p = d ? aes_invshiftrows(s) : aes_shiftrows(s);
    wire [127:0] m = aes_mixcols(d ? aes_imix_pre128(p) : p);
    assign y = (last ? p : m) ^ k;
endmodule
