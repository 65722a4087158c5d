// XTS-AES-256 streaming core (IEEE 1619 / dm-crypt aes-xts-plain64), one block per clock.
//
// Input stream (valid/ready): one 16-byte block per beat, byte i in s_data[8i+7:8i]; s_last on the
// final block of a sector; s_lba (the data-unit number, zero-extended to 128 bits and used as a
// 16-byte little-endian tweak) and s_dir (1 = encrypt / write to disk, 0 = decrypt / read) are
// sampled on the first beat of each sector. Output stream: same layout, m_last marks the end of
// the sector, m_user = {bypass, decrypt} of the sector.
//
// Datapath (see docs/rtl.md for the diagram and cycle timing):
//   s_* -> 15-deep delay line ----------------------------> (P ^ T) -> aes256_pipe (15) -> ^T -> 2-entry out buffer
//        \-> aes256_enc_iter(Key2, LBA) = T0 (14 rounds) -/   T = T0 for the first block, T*alpha after
// The delay line is exactly as long as the tweak engine, so the first block of a sector meets its
// T0 and later blocks use the registered tweak times alpha. A new sector's first block is accepted
// no earlier than the cycle its predecessor's T0 is consumed (15 cycles after the predecessor
// started), so sectors of >= 15 blocks (all 512- and 4096-byte sectors) flow at 1 block/clock;
// shorter "sectors" (test vectors) are still correct, with stalls.
//
// Back-pressure: every register advances on ce = (output buffer not full), a registered signal, so
// there is no combinational path from m_ready to s_ready.
//
// Keys: key_load / key_clear (pulses) are honoured only between sectors: the input is held at the
// next sector boundary, the pipeline drains, then Key1 is expanded (14 cycles) and Key2 copied
// (or all key registers are zeroed). key_taken pulses when the staging keys were consumed.
// rst zeroes all key material immediately.
module xts_core #(
    parameter LBA_W   = 128,
    parameter HAS_DEC = 1
) (
    input  wire             clk,
    input  wire             rst,
    // input stream
    input  wire             s_valid,
    output wire             s_ready,
    input  wire [127:0]     s_data,
    input  wire             s_last,
    input  wire [LBA_W-1:0] s_lba,
    input  wire             s_dir,
    // output stream
    output wire             m_valid,
    input  wire             m_ready,
    output wire [127:0]     m_data,
    output wire             m_last,
    output wire [1:0]       m_user,
    // configuration (sampled per sector)
    input  wire [1:0]       cfg_mode,    // 0 = direction from s_dir, 1 = encrypt, 2 = decrypt, 3 = bypass
    input  wire [1:0]       cfg_ssize,   // 0 = 512, 1 = 4096, 2/3 = any length (no check)
    // keys
    input  wire [255:0]     key1,
    input  wire [255:0]     key2,
    input  wire             key_load,
    input  wire             key_clear,
    output reg              key_taken,
    output wire             key_valid,
    output wire             key_busy,
    // status / events
    output wire             idle,
    output wire             ev_block,
    output wire             ev_sector,
    output wire             ev_stall_in,
    output wire             ev_stall_out,
    output wire             ev_len_err,
    output reg              err_tweak     // sticky: internal tweak misalignment (never expected)
);
`include "aes_funcs.vh"

    localparam DL = 15;   // delay-line depth = tweak-engine latency (round 0 + 14 rounds)

    // ------------------------------------------------------------------ output buffer / stall
    reg  [1:0]   ob_cnt;
    reg  [130:0] ob0, ob1;            // {user[1:0], last, data}
    wire         ce = (ob_cnt != 2'd2);

    // ------------------------------------------------------------------ keys
    reg          load_pend, clear_pend;
    reg  [255:0] k2;
    reg          do_clear;
    reg          do_load;
    wire         kx_busy, kx_valid;
    wire [15*128-1:0] rk_flat, dkm_flat;

    aes256_key_expand #(.HAS_DEC(HAS_DEC)) u_kx (
        .clk(clk), .rst(rst), .clear(do_clear), .start(do_load), .key(key1),
        .busy(kx_busy), .valid(kx_valid), .rk_flat(rk_flat), .dkm_flat(dkm_flat));

    assign key_valid = kx_valid;
    assign key_busy  = load_pend | clear_pend | kx_busy;

    // ------------------------------------------------------------------ input side
    reg        in_first;               // next accepted beat starts a sector
    reg        cur_byp, cur_dec;       // latched for the rest of the sector
    reg  [1:0] cur_ssize;
    reg  [8:0] bcnt;                   // beats accepted in the current sector
    reg  [3:0] tw_cnt;                 // ce-cycles until the running tweak is consumed
    wire       eng_free  = (tw_cnt <= 4'd1);
    wire       quiesce   = (load_pend | clear_pend) & in_first;
    wire       first_byp = (cfg_mode == 2'd3);
    wire       first_dec = (cfg_mode == 2'd2) | ((cfg_mode == 2'd0) & ~s_dir);
    wire       beat_byp  = in_first ? first_byp : cur_byp;
    wire       beat_dec  = in_first ? first_dec : cur_dec;

    assign s_ready = ce & ~quiesce & ~(in_first & ~first_byp & ~(kx_valid & eng_free));
    wire accept    = s_valid & s_ready;
    wire eng_start = accept & in_first & ~first_byp;

    wire [1:0] ssize    = in_first ? cfg_ssize : cur_ssize;
    wire [8:0] bnow     = in_first ? 9'd1 : bcnt + 9'd1;
    wire [8:0] bexp     = ssize[0] ? 9'd256 : 9'd32;
    assign ev_len_err   = accept & ~ssize[1] & (s_last ? (bnow != bexp) : (bnow == bexp));

    always @(posedge clk) begin
        if (rst) begin
            in_first <= 1'b1;
            cur_byp  <= 1'b0;
            cur_dec  <= 1'b0;
            cur_ssize <= 2'd0;
            bcnt     <= 9'd0;
            tw_cnt   <= 4'd0;
        end else begin
            if (accept) begin
                in_first <= s_last;
                bcnt     <= bnow;
                if (in_first) begin
                    cur_byp   <= first_byp;
                    cur_dec   <= first_dec;
                    cur_ssize <= cfg_ssize;
                end
            end
            if (ce) begin
                if (eng_start)
                    tw_cnt <= DL[3:0];
                else if (tw_cnt != 4'd0)
                    tw_cnt <= tw_cnt - 4'd1;
            end
        end
    end

    // ------------------------------------------------------------------ tweak engine (Key2)
    wire [127:0] lba128 = s_lba;
    wire [127:0] t0;
    wire         eng_done;

    aes256_enc_iter u_tweak (
        .clk(clk), .rst(rst), .clear(do_clear), .ce(ce), .start(eng_start), .key(k2),
        .din(lba128), .dout(t0), .busy(), .done(eng_done));

    // ------------------------------------------------------------------ delay line
    reg [DL-1:0] dl_v;
    reg [131:0]  dl [0:DL-2];          // {first, last, dec, byp, data}: stages 0..DL-2
    reg [131:0]  dl_head;              // stage DL-1: a plain flip-flop (it has a reset, so it is
                                       // not packed into the shift-register primitive, whose
                                       // clock-to-output delay would start the critical path)

    always @(posedge clk) begin
        if (rst)
            dl_v <= {DL{1'b0}};
        else if (ce)
            dl_v <= {dl_v[DL-2:0], accept};
    end

    integer i;
    always @(posedge clk) begin
        if (ce) begin
            dl[0] <= {in_first, s_last, beat_dec, beat_byp, s_data};
            for (i = 1; i < DL - 1; i = i + 1)
                dl[i] <= dl[i-1];
        end
    end

    always @(posedge clk) begin
        if (rst)
            dl_head <= 132'h0;
        else if (ce)
            dl_head <= dl[DL-2];
    end

    wire         h_v     = dl_v[DL-1];
    wire [131:0] h       = dl_head;
    wire         h_first = h[131];
    wire         h_last  = h[130];
    wire         h_dec   = h[129];
    wire         h_byp   = h[128];
    wire [127:0] h_data  = h[127:0];

    // ------------------------------------------------------------------ tweak chain
    reg  [127:0] t_prev;
    wire [127:0] t_use = h_first ? t0 : xts_mul_alpha(t_prev);

    always @(posedge clk) begin
        if (rst) begin
            t_prev    <= 128'h0;
            err_tweak <= 1'b0;
        end else if (ce && h_v && !h_byp) begin
            t_prev <= t_use;
            if (h_first && !eng_done)
                err_tweak <= 1'b1;
        end
    end

    // ------------------------------------------------------------------ AES pipeline
    // tag = {byp, last, T or (bypass) the plain data}
    wire         p_valid, p_dec;
    wire [127:0] p_data;
    wire [129:0] p_tag;
    wire [14:0]  p_stages;

    aes256_pipe #(.HAS_DEC(HAS_DEC), .TAG_W(130)) u_pipe (
        .clk(clk), .rst(rst), .ce(ce),
        .in_valid(h_v), .in_dec(h_dec), .in_data(h_data ^ t_use),
        .in_tag({h_byp, h_last, h_byp ? h_data : t_use}),
        .rk_flat(rk_flat), .dkm_flat(dkm_flat),
        .out_valid(p_valid), .out_dec(p_dec), .out_data(p_data), .out_tag(p_tag),
        .stage_valid(p_stages));

    wire         r_byp  = p_tag[129];
    wire [130:0] result = {r_byp, p_dec & ~r_byp, p_tag[128], r_byp ? p_tag[127:0] : (p_data ^ p_tag[127:0])};

    // ------------------------------------------------------------------ output buffer
    wire push = ce & p_valid;
    wire pop  = m_valid & m_ready;

    always @(posedge clk) begin
        if (rst) begin
            ob_cnt <= 2'd0;
        end else begin
            case (ob_cnt)
                2'd0: if (push) ob_cnt <= 2'd1;
                2'd1: if (push && !pop) ob_cnt <= 2'd2; else if (!push && pop) ob_cnt <= 2'd0;
                default: if (pop) ob_cnt <= 2'd1;
            endcase
        end
    end

    always @(posedge clk) begin
        case (ob_cnt)
            2'd0: if (push) ob0 <= result;
            2'd1: if (push && pop) ob0 <= result; else if (push) ob1 <= result;
            default: if (pop) ob0 <= ob1;
        endcase
    end

    assign m_valid = (ob_cnt != 2'd0);
    assign m_data  = ob0[127:0];
    assign m_last  = ob0[128];
    assign m_user  = ob0[130:129];

    // ------------------------------------------------------------------ key load / clear
    wire empty = ~|dl_v & ~|p_stages;
    assign idle = empty & (ob_cnt == 2'd0) & in_first;

    always @(posedge clk) begin
        if (rst) begin
            load_pend  <= 1'b0;
            clear_pend <= 1'b0;
            do_clear   <= 1'b0;
            do_load    <= 1'b0;
            key_taken  <= 1'b0;
            k2         <= 256'h0;
        end else begin
            do_clear  <= 1'b0;
            do_load   <= 1'b0;
            key_taken <= 1'b0;
            // the pending flags stay set until the cycle the expander starts / clears, so that
            // the input stays closed in between
            if (do_clear) begin
                clear_pend <= 1'b0;
                load_pend  <= 1'b0;   // a pending load is dropped together with the staging keys
            end else if (do_load) begin
                load_pend <= 1'b0;
            end else if (quiesce && empty && !kx_busy) begin
                if (clear_pend) begin
                    do_clear  <= 1'b1;
                    k2        <= 256'h0;
                    key_taken <= 1'b1;
                end else begin
                    do_load   <= 1'b1;
                    k2        <= key2;
                    key_taken <= 1'b1;
                end
            end
            if (key_load)  load_pend  <= 1'b1;
            if (key_clear) clear_pend <= 1'b1;
        end
    end

    // ------------------------------------------------------------------ events
    assign ev_block     = pop;
    assign ev_sector    = pop & m_last;
    assign ev_stall_in  = s_valid & ~s_ready;
    assign ev_stall_out = m_valid & ~m_ready;
endmodule
