/* The AVX-512 BF16 set (`quant_avx512bf16`): the AVX-512 VNNI set for every GGUF type and
 * int8 (the same layout, the same bits), and bf16 weights ("bf16": a bfloat16 checkpoint
 * computed in float32 activations) multiplied with VDPBF16PS, for CPUs that have AVX512_BF16
 * but no AMX tile unit (AMD Zen 4 and Zen 5, Intel Cooper Lake).
 *
 * The weights lie as the AMX set's B tiles (quant_bf16.h), whose rows are what VDPBF16PS
 * takes: tile row c of group g is 16 outputs x the pair of k (32g + 2c, 32g + 2c + 1). The
 * activations are rounded to bfloat16 once per call (round to nearest even, as the AMX set
 * rounds them), the products summed in float32:
 *
 *     y[i, j] = fl(S[i, j] + bias[j])
 *
 * S: one chain of VDPBF16PS per output over k's pairs in order. A row's chains are the
 * same instructions in the same order whatever the call's number of rows and wherever the
 * row lies in it, so a row's output never depends on its batch.
 *
 * Work: the rows are converted to bfloat16 (all threads, a row each), then each thread
 * multiplies its own share of the panels (a half each on two cores). A block is BK_MR rows
 * x BK_NP panels (64 outputs) over all of k; a run's panels meet the rows in blocks of rows
 * that stay in L2 with the run's weights, which are read from memory once and from L2
 * after. While one block of panels meets the rows, the thread's next block of panels is
 * asked for, a few lines at each step: the memory reads while the products compute.
 */
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>
#include <omp.h>
#include <string.h>

#include "quant.h"
#include "quant_bf16.h"

#define BK_NP 4 /* panels a block multiplies at once: 64 outputs */
#define BK_MR 6 /* rows per block: 24 float sums and 4 weight vectors of the 32 zmm registers */
/* From this many rows the next panels are asked for by hand; below it the loads alone keep
 * the memory busy (one row: 46 GB/s, the machine's read rate; asking too was 3% slower) */
#define AHEAD_ROWS 2

/* Activation row i as bfloat16 into X (rows kp apart, zero past k). */
static void row_to_bf16(const qlinear_args *a, uint16_t *restrict X, int64_t i, int64_t kp) {
    uint16_t *dst = X + i * kp;
    for (int64_t j = 0; j < kp; j += 32)
        _mm512_storeu_si512(dst + j, x_group_bf16(a, i, j, a->k - j));
}

/* Rows i0 .. i0 + mr - 1 (x: row i0's bf16, rows kp apart) against panels p .. p + np - 1
 * (w: panel p's G groups, the next panel panel_bytes on): y = S (+ bias), float32 or
 * bfloat16. A pair of a row's activations is broadcast once and multiplies the np panels'
 * vectors: np + mr loads per np x mr products (one panel against a broadcast in every
 * instruction, 1 + mr loads per mr products, ran at 60% of oneDNN's rate at 64 rows). `mr`
 * and `np` are constants where it is called, so the sums stay in registers. Each step
 * also asks for `pf`'s next lines. */
static inline __attribute__((always_inline)) void block_rows(
    const int mr, const int np, const qlinear_args *a, const uint8_t *w, int64_t panel_bytes,
    const uint16_t *x, int64_t kp, int64_t p, int64_t i0, pf_stream *pf) {
    const int64_t G = kp / 32;
    __m512 s[BK_MR][BK_NP];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < np; j++) s[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *wg = w + g * 1024;
        const uint16_t *xg = x + 32 * g;
#pragma GCC unroll 4
        for (int c = 0; c < 16; c++) {
            if (pf->left) prefetch_step(pf);
            __m512bh wv[BK_NP];
            for (int j = 0; j < np; j++)
                wv[j] = (__m512bh)_mm512_loadu_si512(wg + j * panel_bytes + c * 64);
            for (int r = 0; r < mr; r++) {
                int32_t pair;
                memcpy(&pair, xg + r * kp + 2 * c, 4);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                for (int j = 0; j < np; j++) s[r][j] = _mm512_dpbf16_ps(s[r][j], wv[j], xb);
            }
        }
    }
    for (int j = 0; j < np; j++) {
        const int64_t col = (p + j) * BF16_R, left = a->n - col;
        const __mmask16 cols = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512 bias =
            a->bias ? _mm512_maskz_loadu_ps(cols, a->bias + col) : _mm512_setzero_ps();
        for (int r = 0; r < mr; r++) {
            const __m512 y = _mm512_add_ps(s[r][j], bias);
            const int64_t at = (i0 + r) * a->n + col;
            if (a->ytype == XT_BF16) /* the model's dtype: no float32 pass after the product */
                _mm256_mask_storeu_epi16((uint16_t *)a->y + at, cols,
                                         (__m256i)_mm512_cvtneps_pbh(y));
            else
                _mm512_mask_storeu_ps(a->y + at, cols, y);
        }
    }
}

typedef void (*block_fn)(const qlinear_args *, const uint8_t *, int64_t, const uint16_t *,
                         int64_t, int64_t, int64_t, pf_stream *);
#define BLOCK_DEF(MR, NP)                                                                  \
    static void block_##MR##_##NP(const qlinear_args *a, const uint8_t *w, int64_t pb,      \
                                  const uint16_t *x, int64_t kp, int64_t p, int64_t i0,     \
                                  pf_stream *pf) {                                          \
        block_rows(MR, NP, a, w, pb, x, kp, p, i0, pf);                                    \
    }
#define BLOCK_DEFS(MR) BLOCK_DEF(MR, 1) BLOCK_DEF(MR, 2) BLOCK_DEF(MR, 3) BLOCK_DEF(MR, 4)
BLOCK_DEFS(1) BLOCK_DEFS(2) BLOCK_DEFS(3) BLOCK_DEFS(4) BLOCK_DEFS(5) BLOCK_DEFS(6)
#define BLOCK_ROW(MR) {block_##MR##_1, block_##MR##_2, block_##MR##_3, block_##MR##_4}
/* [rows - 1][panels - 1] */
static const block_fn BLOCKS[BK_MR][BK_NP] = {BLOCK_ROW(1), BLOCK_ROW(2), BLOCK_ROW(3),
                                              BLOCK_ROW(4), BLOCK_ROW(5), BLOCK_ROW(6)};

/* Bytes of activation rows multiplied by a run of panels in one pass, and of the run's
 * weights: both stay in L2 while every block of the rows meets every panel of the run. */
#define ROWS_BLOCK_BYTES (1 << 17)
#define RUN_BYTES (1 << 18)

/* Panels p0 .. p1 - 1 (a thread's) against every row. */
static void panels_bf16(const qlinear_args *a, const uint16_t *X, int64_t kp, int64_t p0,
                        int64_t p1) {
    const int64_t panel_bytes = packed_panel_bytes(QT_BF16, a->k, BF16_R), m = a->m;
    int64_t rows_block = ROWS_BLOCK_BYTES / (kp * 2) / BK_MR * BK_MR;
    if (rows_block < BK_MR) rows_block = BK_MR;
    int64_t run = RUN_BYTES / panel_bytes / BK_NP * BK_NP;
    if (run < BK_NP) run = BK_NP;
    const int64_t steps = kp / 2; /* a block's steps: G groups x 16 */
    for (int64_t q0 = p0; q0 < p1; q0 += run) {
        const int64_t q1 = q0 + run < p1 ? q0 + run : p1;
        for (int64_t rb = 0; rb < m; rb += rows_block) {
            const int64_t rb_end = rb + rows_block < m ? rb + rows_block : m;
            const int64_t blocks = (rb_end - rb + BK_MR - 1) / BK_MR;
            for (int64_t p = q0; p < q1; p += BK_NP) {
                const int np = q1 - p < BK_NP ? (int)(q1 - p) : BK_NP;
                const uint8_t *w = a->w + p * panel_bytes;
                /* the first pass over the rows asks for the thread's next block of
                 * panels, a few lines at each step of every block of rows that meets
                 * these: the memory reads while the products compute (asked for during
                 * the first block of rows alone, the reads and the products took turns:
                 * 16 rows 1.2x slower) */
                const int64_t after = p1 - (p + np) < BK_NP ? p1 - (p + np) : BK_NP;
                pf_stream pf = prefetch_share(
                    rb == 0 && after > 0 && m >= AHEAD_ROWS ? w + np * panel_bytes : NULL,
                    after * panel_bytes / 64, 0, 1, blocks * steps);
                for (int64_t i0 = rb; i0 < rb_end; i0 += BK_MR) {
                    const int mr = rb_end - i0 < BK_MR ? (int)(rb_end - i0) : BK_MR;
                    BLOCKS[mr - 1][np - 1](a, w, panel_bytes, X + i0 * kp, kp, p, i0, &pf);
                }
            }
        }
    }
}

static int bf16_qlinear(const qlinear_args *a) {
    const int64_t kp = (a->k + 31) / 32 * 32;
    uint16_t *X = quant_scratch(0, (size_t)(a->m * kp * 2));
    if (!X) return -1;
    const int64_t panels = (a->n + BF16_R - 1) / BF16_R;
#pragma omp parallel num_threads(a->threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < a->m; i++) row_to_bf16(a, X, i, kp);
        /* each thread its own run of panels (a half each on two cores), so that every
         * panel's weights but its first block's are asked for ahead; runs taken as threads
         * came free kept no next run to ask for (demo layers at 16 rows: 1.2x slower) */
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        panels_bf16(a, X, kp, p0, p1);
    }
    return 0;
}

static int bf16set_qlinear(const qlinear_args *a) {
    if (a->qtype == QT_BF16) return bf16_qlinear(a);
    if (a->ytype != XT_F32) return -2;
    return quant_avx512vnni.qlinear(a);
}

const quant_kernels quant_avx512bf16 = {"avx512bf16", BF16_R, bf16_set_pack,
                                        bf16_set_dequantize, bf16set_qlinear};
#endif
