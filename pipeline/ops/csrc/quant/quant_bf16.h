/* bf16 weights ("bf16": a bfloat16 checkpoint computed in float32 activations), laid out
 * once, at load, as the AMX tile unit's B tiles, which are also what VDPBF16PS takes a
 * vector of: per panel of 16 rows and group of 32 k, 16 tile rows of 64 bytes, tile row r's
 * word n = row n's k 32g + 2r (low half) and 32g + 2r + 1 (high half), zero past n and k.
 * The AMX set (quant_avx512amx.c) loads a group as a tile, the AVX-512 BF16 set
 * (quant_avx512bf16.c) a tile row as a vector. Included by both, after quant.h. */
#ifndef QUANT_BF16_H
#define QUANT_BF16_H

#include <immintrin.h>

#define BF16_R 16 /* rows per panel: the VNNI set's */

/* Word n of tile row r of group g of panel p: row 16p + n's k 32g + 2r (low half) and
 * 32g + 2r + 1 (high half), zero past n and k. */
static inline uint32_t *bf16_word(uint8_t *w, int64_t G, int64_t p, int64_t g, int64_t r,
                                  int64_t n) {
    return (uint32_t *)(w + ((p * G + g) * BF16_R + r) * 64) + n;
}

static void bf16_pack(uint8_t *dst, const uint16_t *src, int64_t n, int64_t k, int threads) {
    const int64_t G = (k + 31) / 32, panels = (n + BF16_R - 1) / BF16_R;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t r = 0; r < 16; r++)
                for (int64_t c = 0; c < BF16_R; c++) {
                    const int64_t row = p * BF16_R + c, j = 32 * g + 2 * r;
                    const uint32_t lo = row < n && j < k ? src[row * k + j] : 0;
                    const uint32_t hi = row < n && j + 1 < k ? src[row * k + j + 1] : 0;
                    *bf16_word(dst, G, p, g, r, c) = lo | hi << 16;
                }
}

static void bf16_unpack(float *out, const uint8_t *w, int64_t n, int64_t k, int threads) {
    const int64_t G = (k + 31) / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t row = 0; row < n; row++)
        for (int64_t j = 0; j < k; j++) {
            const uint32_t word = *bf16_word((uint8_t *)w, G, row / BF16_R, j / 32, j % 32 / 2,
                                             row % BF16_R);
            union { uint32_t u; float f; } v = {(j % 2 ? word >> 16 : word & 0xffffu) << 16};
            out[row * k + j] = v.f;
        }
}

/* Elements j .. j + 31 of activation row i as bfloat16 (round to nearest even; a bfloat16
 * row's as they are), the `left` < 32 first of them where the row ends, zero after. Needs
 * the including file's AVX512_BF16 target. */
static inline __m512i x_group_bf16(const qlinear_args *a, int64_t i, int64_t j, int64_t left) {
    const __mmask32 m = left >= 32 ? 0xffffffffu : left > 0 ? (1u << left) - 1u : 0u;
    if (!m) return _mm512_setzero_si512();
    if (a->xtype == XT_BF16)
        return _mm512_maskz_loadu_epi16(m, (const uint16_t *)a->x + i * a->ldx + j);
    const float *x = (const float *)a->x + i * a->ldx + j;
    const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps((__mmask16)m, x));
    const __m256i hi =
        (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps((__mmask16)(m >> 16), x + 16));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* The pack and dequantize of a set that adds bf16 weights to the VNNI set's types. */
static void bf16_set_pack(int qt, uint8_t *dst, const uint8_t *src, const float *rs, int64_t n,
                          int64_t k, int threads) {
    if (qt == QT_BF16)
        bf16_pack(dst, (const uint16_t *)src, n, k, threads);
    else
        quant_avx512vnni.pack(qt, dst, src, rs, n, k, threads);
}

static void bf16_set_dequantize(int qt, float *out, const uint8_t *w, int64_t n, int64_t k,
                                int threads) {
    if (qt == QT_BF16)
        bf16_unpack(out, w, n, k, threads);
    else
        quant_avx512vnni.dequantize(qt, out, w, n, k, threads);
}

#endif
