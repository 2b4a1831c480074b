/* The AVX-512 BF16 set (`quant_avx512bf16`): the AVX-512 VNNI set for every GGUF type and
 * int8 (the same layout, the same bits), and bf16 weights ("bf16": a bfloat16 checkpoint
 * computed in float32 activations) multiplied with VDPBF16PS, for CPUs that have AVX512_BF16
 * but no AMX tile unit (AMD Zen 4 and Zen 5, Intel Cooper Lake).
 *
 * The weights lie as the AMX set's B tiles (quant_bf16.h), whose rows are what VDPBF16PS
 * takes: tile row r of group g is 16 outputs x the pair of k (32g + 2r, 32g + 2r + 1). The
 * activations are rounded to bfloat16 once per call (round to nearest even, as the AMX set
 * rounds them), the products summed in float32:
 *
 *     y[i, j] = fl(fl(E[i, j] + O[i, j]) + bias[j])
 *
 * E: one running sum over the even tile rows (k pairs 0, 2, 4... in order), O over the odd
 * ones: two chains per row, so one row (decode) has two sums in flight instead of one chain
 * of k / 2 dependent instructions. A row's sums are the same instructions in the same order
 * whatever the call's number of rows and wherever the row lies in it, so a row's output
 * never depends on its batch.
 *
 * Work: the rows are converted to bfloat16 (all threads, a row each), then each thread takes
 * runs of panels as it comes free (a core slowed by a neighbour takes fewer), and each
 * panel multiplies every block of BK_MR rows over all of k, its weights read from memory
 * once and from L1 / L2 for the other blocks. The activations' pair is broadcast from
 * memory inside the instruction ({1to16}).
 */
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>
#include <omp.h>
#include <string.h>

#include "quant.h"
#include "quant_bf16.h"

#define BK_MR 12 /* rows per block: 16 float sums (even, odd) of the 32 zmm registers */

/* acc += w . (the bf16 pair at p, in every lane) */
static inline __m512 dp_bcast(__m512 acc, __m512i w, const void *p) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

/* Activation row i as bfloat16 into X (rows kp apart, zero past k). */
static void row_to_bf16(const qlinear_args *a, uint16_t *restrict X, int64_t i, int64_t kp) {
    uint16_t *dst = X + i * kp;
    for (int64_t j = 0; j < kp; j += 32) {
        const int64_t left = a->k - j;
        const __mmask32 m = left >= 32 ? 0xffffffffu : left > 0 ? (1u << left) - 1u : 0u;
        __m512i v = _mm512_setzero_si512();
        if (m && a->xtype == XT_BF16) {
            v = _mm512_maskz_loadu_epi16(m, (const uint16_t *)a->x + i * a->ldx + j);
        } else if (m) {
            const float *x = (const float *)a->x + i * a->ldx + j;
            const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps((__mmask16)m, x));
            const __m256i hi =
                (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps((__mmask16)(m >> 16), x + 16));
            v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
        _mm512_storeu_si512(dst + j, v);
    }
}

/* Rows i0 .. i0 + mr - 1 (x: row i0's bf16, rows kp apart) against panel p (w: its G
 * groups): y = E + O (+ bias), float32 or bfloat16. `mr` is a constant where it is called,
 * so the sums stay in registers. */
static inline __attribute__((always_inline)) void block_rows(
    const int mr, const qlinear_args *a, const uint8_t *w, const uint16_t *x, int64_t kp,
    int64_t p, int64_t i0, const uint8_t *next) {
    const int64_t G = kp / 32;
    __m512 e[BK_MR], o[BK_MR];
    for (int r = 0; r < mr; r++) e[r] = o[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++, w += 16 * 64) {
        const uint16_t *xg = x + 32 * g;
#pragma GCC unroll 8
        for (int c = 0; c < 16; c += 2) {
            /* the first block asks for the next panel's same group, two lines a step: its
             * weights then come from L2 while this panel computes (a burst of a group's 16
             * lines at once would fill the core's miss buffers) */
            if (next) {
                _mm_prefetch((const char *)next + g * 1024 + c * 64, _MM_HINT_T0);
                _mm_prefetch((const char *)next + g * 1024 + c * 64 + 64, _MM_HINT_T0);
            }
            const __m512i w0 = _mm512_loadu_si512(w + c * 64), w1 = _mm512_loadu_si512(w + c * 64 + 64);
#pragma GCC unroll 16
            for (int r = 0; r < mr; r++) {
                e[r] = dp_bcast(e[r], w0, xg + r * kp + 2 * c);
                o[r] = dp_bcast(o[r], w1, xg + r * kp + 2 * c + 2);
            }
        }
    }
    const int64_t col = p * BF16_R, left = a->n - col;
    const __mmask16 cols = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    const __m512 bias = a->bias ? _mm512_maskz_loadu_ps(cols, a->bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < mr; r++) {
        const __m512 y = _mm512_add_ps(_mm512_add_ps(e[r], o[r]), bias);
        const int64_t at = (i0 + r) * a->n + col;
        if (a->ytype == XT_BF16) /* the model's dtype: no float32 pass after the product */
            _mm256_mask_storeu_epi16((uint16_t *)a->y + at, cols, (__m256i)_mm512_cvtneps_pbh(y));
        else
            _mm512_mask_storeu_ps(a->y + at, cols, y);
    }
}

#define BLOCK_CASE(n) \
    case n: block_rows(n, a, w, X + i0 * kp, kp, p, i0, i0 ? NULL : next); break;

static void panels_bf16(const qlinear_args *a, const uint16_t *X, int64_t kp, int64_t p0,
                        int64_t p1) {
    const int64_t panel_bytes = packed_panel_bytes(QT_BF16, a->k, BF16_R);
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *w = a->w + p * panel_bytes, *next = p + 1 < p1 ? w + panel_bytes : NULL;
        for (int64_t i0 = 0; i0 < a->m; i0 += BK_MR) {
            switch (a->m - i0 < BK_MR ? (int)(a->m - i0) : BK_MR) {
                BLOCK_CASE(1)
                BLOCK_CASE(2)
                BLOCK_CASE(3)
                BLOCK_CASE(4)
                BLOCK_CASE(5)
                BLOCK_CASE(6)
                BLOCK_CASE(7)
                BLOCK_CASE(8)
                BLOCK_CASE(9)
                BLOCK_CASE(10)
                BLOCK_CASE(11)
                default: block_rows(BK_MR, a, w, X + i0 * kp, kp, p, i0, i0 ? NULL : next); break;
            }
        }
    }
}
#undef BLOCK_CASE

static int bf16_qlinear(const qlinear_args *a) {
    const int64_t kp = (a->k + 31) / 32 * 32;
    uint16_t *X = quant_scratch(0, (size_t)(a->m * kp * 2));
    if (!X) return -1;
    const int64_t panels = (a->n + BF16_R - 1) / BF16_R;
#pragma omp parallel num_threads(a->threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < a->m; i++) row_to_bf16(a, X, i, kp);
        /* runs of panels taken as threads come free (the VNNI set's tiled product's rule) */
        const int64_t nt = omp_get_num_threads();
        const int64_t run = panels / (8 * nt) > 4 ? panels / (8 * nt) : 4;
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < panels; p += run)
            panels_bf16(a, X, kp, p, p + run < panels ? p + run : panels);
    }
    return 0;
}

static void bf16set_pack(int qt, uint8_t *dst, const uint8_t *src, const float *rs, int64_t n,
                         int64_t k, int threads) {
    if (qt == QT_BF16)
        bf16_pack(dst, (const uint16_t *)src, n, k, threads);
    else
        quant_avx512vnni.pack(qt, dst, src, rs, n, k, threads);
}

static void bf16set_dequantize(int qt, float *out, const uint8_t *w, int64_t n, int64_t k,
                               int threads) {
    if (qt == QT_BF16)
        bf16_unpack(out, w, n, k, threads);
    else
        quant_avx512vnni.dequantize(qt, out, w, n, k, threads);
}

static int bf16set_qlinear(const qlinear_args *a) {
    if (a->qtype == QT_BF16) return bf16_qlinear(a);
    if (a->ytype != XT_F32) return -2;
    return quant_avx512vnni.qlinear(a);
}

const quant_kernels quant_avx512bf16 = {"avx512bf16", BF16_R, bf16set_pack, bf16set_dequantize,
                                        bf16set_qlinear};
#endif
