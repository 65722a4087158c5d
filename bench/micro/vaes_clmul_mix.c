/* Throughput of the instruction mixes of the vaes256 FAST-BRW step on this CPU: how many
 * core cycles a loop body of independent instructions takes (no dependency across bodies
 * but the AES chains', eight of them). It measures the machine, not cryptbridge: which
 * units the AES rounds, the carry-less multiplies, the loads and the simple vector
 * operations share. See docs/bench/2026-11-26-fast-brw-frontback.md.
 *
 * Build and run: cc -O2 -mavx512f -mvaes -mvpclmulqdq bench/micro/vaes_clmul_mix.c -o /tmp/mix && /tmp/mix
 * (needs a CPU with VAES, VPCLMULQDQ and AVX-512F; on one without AVX-512, drop the zmm
 * line and -mavx512f). Cycles are TSC ticks times the core/TSC clock ratio measured with a
 * chain of dependent adds (one per cycle). */
#include <stdint.h>
#include <stdio.h>
#include <x86intrin.h>

#define N 2000000L
static char buf[4096] __attribute__((aligned(64)));

#define A4 "vaesenc %%ymm8,%%ymm0,%%ymm0\n vaesenc %%ymm8,%%ymm1,%%ymm1\n vaesenc %%ymm8,%%ymm2,%%ymm2\n vaesenc %%ymm8,%%ymm3,%%ymm3\n"
#define B4 "vaesenc %%ymm8,%%ymm4,%%ymm4\n vaesenc %%ymm8,%%ymm5,%%ymm5\n vaesenc %%ymm8,%%ymm6,%%ymm6\n vaesenc %%ymm8,%%ymm7,%%ymm7\n"
#define A8 A4 B4
#define CX "vpclmulqdq $0,%%xmm8,%%xmm9,%%xmm10\n"
#define CY "vpclmulqdq $0,%%ymm8,%%ymm9,%%ymm10\n"
#define CZ "vpclmulqdq $0,%%zmm8,%%zmm9,%%zmm10\n"
#define CDEP "vpclmulqdq $0,%%ymm8,%%ymm11,%%ymm11\n"
#define XR "vpxor %%ymm8,%%ymm9,%%ymm13\n"
#define LD "vmovdqa 64(%0),%%ymm15\n"
#define SH "vpshufd $0x4e,%%ymm9,%%ymm15\n"
#define SL "vpslldq $8,%%ymm9,%%ymm15\n"
#define ADD "add $1,%%rax\n"
#define R2(u) u u
#define R4(u) R2(u) R2(u)
#define R8(u) R4(u) R4(u)
#define R16(u) R8(u) R8(u)
#define CLOB "rax", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm10", "xmm11", "xmm13", "xmm15", "memory"
#define BODY(name, body) \
    static void name(long n) { for (long i = 0; i < n; i++) __asm__ volatile(body ::"r"(buf) : CLOB); }

BODY(adds, R16(ADD))
BODY(clmul_x, R16(CX))
BODY(clmul_y, R16(CY))
BODY(clmul_z, R16(CZ))
BODY(clmul_dep, R16(CDEP))
BODY(aes, R8(A8))
BODY(loads, R16(LD))
/* A step's worth: 56 AES rounds, 16 carry-less multiplies, 32 XORs. */
BODY(bunched, R4(A8) R2(A8) A8 R16(CY) R16(XR) R16(XR))
BODY(spread, R4(A8 R2(CY) R4(XR)) R2(A8 R2(CY) R4(XR)) A8 R2(CY) R4(XR) R2(CY) R4(XR))
BODY(aes_clmul, R4(A8) R2(A8) A8 R16(CY))
BODY(aes_xor, R4(A8) R2(A8) A8 R16(XR) R16(XR))
BODY(clmul_xor, R16(CY) R16(XR) R16(XR))
/* Which pairs of the three kinds overlap and whether all three do: 64 AES rounds, 16
 * multiplies and 64 XORs spread evenly; shuffles and byte shifts beside the AES rounds. */
BODY(aes_xor64, R8(A8 R8(XR)))
BODY(clmul_xor64, R8(R2(CY) R8(XR)))
BODY(aes_clmul_xor64, R8(A8 R2(CY) R8(XR)))
BODY(aes_shuf16, R8(A8 R2(SH)))
BODY(aes_shift16, R8(A8 R2(SL)))

static double ticks(void (*f)(long)) {
    double best = 1e300;
    for (int r = 0; r < 9; r++) {
        f(1000);
        uint64_t t = __rdtsc();
        f(N);
        double v = (double)(__rdtsc() - t) / N;
        if (v < best) best = v;
    }
    return best;
}

int main(void) {
    double ratio = 16.0 / ticks(adds); /* core cycles per TSC tick */
    printf("core/TSC clock ratio %.2f\n", ratio);
#define SHOW(what, f) printf("%-58s %6.1f cycles\n", what, ticks(f) * ratio)
    SHOW("16 vpclmulqdq xmm, independent", clmul_x);
    SHOW("16 vpclmulqdq ymm, independent", clmul_y);
    SHOW("16 vpclmulqdq zmm, independent", clmul_z);
    SHOW("16 vpclmulqdq ymm, one dependent chain", clmul_dep);
    SHOW("64 vaesenc ymm, 8 chains", aes);
    SHOW("16 ymm loads", loads);
    SHOW("56 vaesenc + 16 vpclmulqdq ymm", aes_clmul);
    SHOW("56 vaesenc + 32 vpxor", aes_xor);
    SHOW("16 vpclmulqdq + 32 vpxor", clmul_xor);
    SHOW("56 vaesenc + 16 vpclmulqdq + 32 vpxor, bunched", bunched);
    SHOW("the same, 7 x (8 vaesenc, 2 vpclmulqdq, 4 vpxor), 2, 4", spread);
    SHOW("64 vaesenc + 64 vpxor, spread", aes_xor64);
    SHOW("16 vpclmulqdq + 64 vpxor, spread", clmul_xor64);
    SHOW("64 vaesenc + 16 vpclmulqdq + 64 vpxor, spread", aes_clmul_xor64);
    SHOW("64 vaesenc + 16 vpshufd", aes_shuf16);
    SHOW("64 vaesenc + 16 vpslldq", aes_shift16);
    return 0;
}
