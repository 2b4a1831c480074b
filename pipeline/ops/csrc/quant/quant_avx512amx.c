/* The AMX set (`quant_avx512amx`): the AVX-512 VNNI set for every GGUF type (the same
 * layout, the same bits), and int8 weights ("i8", --quantization int8) multiplied on the
 * tile unit in bfloat16 once a call has AMX_MIN_ROWS rows (fewer: the VNNI set's integer
 * kernels, whose activations are int8 per 32 k: a row's result then depends on whether
 * its step had 32 rows, within both schemes' error bounds).
 *
 * i8 on the tile unit. The weights are integers in -127..127, which bfloat16 holds exactly,
 * so a panel's groups are turned into B tiles as they are read; the activations are rounded
 * to bfloat16 once (a bfloat16 model's are already), never quantized; TDPBF16PS sums whole
 * rows in float32; the row scale (and bias) is applied once at the end:
 *
 *     y[i, j] = fl(fl(C[i, j] * scale[j]) + bias[j])      C: the tile unit's float32 sum
 *
 * The tile unit's arithmetic, as measured on a Sapphire Rapids class Xeon (docs/gguf.md,
 * "A bf16 tile product for int8 weights"): per instruction (32 k) and output, a running
 * float32 sum of the even k's products and one of the odd k's, each in k order and rounded
 * at every step, then C += (even + odd); denormals flushed. Every row of C depends on its
 * own activations only, and every call multiplies with the same instructions in the same
 * order whatever its number of rows (32 or more), so a row's output is the same in any
 * batch that takes this path.
 *
 *     B tile of group g (32 k) for a panel of 16 rows: 16 tile rows of 64 bytes,
 *       tile row 2c     n = 0..15: bf16(w[n][4c]),     bf16(w[n][4c + 1])
 *       tile row 2c + 1 n = 0..15: bf16(w[n][4c + 2]), bf16(w[n][4c + 3])
 *     from the packed chunk c (64 bytes: row n's k 4c..4c+3 at byte 4n, as w ^ 0x80).
 *
 * One panel and up to 64 rows at a time: C tiles 0-3, A tiles 4-6, B tile 7 (`panel_rows`).
 * Linux gives a process the tile data state only when asked (arch_prctl); without it the
 * set is not offered (`quant_amx_usable`).
 */
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx512vbmi,amx-tile,amx-bf16,avx2,fma,f16c")
#include <immintrin.h>
#include <omp.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "quant.h"

#define AMX_R 16          /* rows per panel: the VNNI set's layout */
/* AMX_MIN_ROWS (quant.h): fewer rows go to the VNNI set. Converting a panel's weights to
 * bfloat16 costs the same for one row as for 64, and below about 32 rows the integer kernel
 * is faster (bench qgemm, i8, 2 threads: 16 rows 500-704 GOP/s against 638-917; 64 rows
 * 998-1678 against 745-1011; one row 17-25 GB/s against 47-62). */
#define TILE_BYTES 1024   /* 16 rows x 64 bytes */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int quant_amx_usable(void) {
    static int state = -1; /* asked once, at import (under the GIL) */
    if (state < 0) {
        state = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi") &&
                syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) tile_config;

static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* One packed group (8 chunks, 512 bytes) into its B tile. */
static inline void group_to_tile(uint8_t *restrict tile, const uint8_t *restrict group) {
    /* bytes 0..31: each row's k 0, 1; bytes 32..63: its k 2, 3 */
    const __m512i order = _mm512_set_epi8(
        63, 62, 59, 58, 55, 54, 51, 50, 47, 46, 43, 42, 39, 38, 35, 34,
        31, 30, 27, 26, 23, 22, 19, 18, 15, 14, 11, 10, 7, 6, 3, 2,
        61, 60, 57, 56, 53, 52, 49, 48, 45, 44, 41, 40, 37, 36, 33, 32,
        29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int c = 0; c < 8; c++) {
        const __m512i v = _mm512_permutexvar_epi8(
            order, _mm512_xor_si512(_mm512_loadu_si512(group + 64 * c), flip));
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(v)));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 1)));
        const __m512 f2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 2)));
        const __m512 f3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 3)));
        _mm512_store_si512(tile + 128 * c, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
        _mm512_store_si512(tile + 128 * c + 64, (__m512i)_mm512_cvtne2ps_pbh(f3, f2));
    }
}

/* Activation row i as kp bfloat16 (zero past k; a zero row past m). */
static void row_to_bf16(const qlinear_args *a, uint16_t *restrict dst, int64_t i, int64_t kp) {
    if (i >= a->m) {
        memset(dst, 0, kp * 2);
        return;
    }
    const int64_t k = a->k;
    if (a->xtype == XT_BF16) {
        memcpy(dst, (const uint16_t *)a->x + i * a->ldx, k * 2);
    } else {
        const float *x = (const float *)a->x + i * a->ldx;
        int64_t j = 0;
        for (; j + 16 <= k; j += 16)
            _mm256_storeu_si256((__m256i *)(dst + j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + j)));
        if (j < k) {
            const __mmask16 tail = (__mmask16)((1u << (k - j)) - 1);
            const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, x + j));
            _mm256_mask_storeu_epi16(dst + j, tail, h);
        }
    }
    memset(dst + k, 0, (kp - k) * 2);
}

/* C tile rows (16 x 16 floats) of panel p into y: rows row0.. (< m), columns p * 16.. (< n). */
static void put_tile(const qlinear_args *a, const float *restrict c, const float *restrict scale,
                     int64_t p, int64_t row0) {
    const int64_t col = p * AMX_R, left = a->n - col;
    const __mmask16 cols = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    const __m512 s = _mm512_loadu_ps(scale);
    const __m512 b = a->bias ? _mm512_maskz_loadu_ps(cols, a->bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < 16 && row0 + r < a->m; r++) {
        const __m512 y = _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(c + 16 * r), s), b);
        const int64_t at = (row0 + r) * a->n + col;
        if (a->ytype == XT_BF16) /* the model's dtype: no float32 pass after the product */
            _mm256_mask_storeu_epi16((uint16_t *)a->y + at, cols, (__m256i)_mm512_cvtneps_pbh(y));
        else
            _mm512_mask_storeu_ps(a->y + at, cols, y);
    }
}

/* One group's products for up to 4 row tiles of 16 (rows x, kp apart) against B in tile 7:
 * A in tiles 4, 5, 6 (the fourth reuses 4, read long before), C in tiles 0..3. */
static inline void row_tiles(const uint16_t *x, int64_t kp, int64_t g, int nt) {
    const int64_t stride = kp * 2, tile = 16 * kp;
    _tile_loadd(4, x + 32 * g, stride);
    _tile_dpbf16ps(0, 4, 7);
    if (nt < 2) return;
    _tile_loadd(5, x + tile + 32 * g, stride);
    _tile_dpbf16ps(1, 5, 7);
    if (nt < 3) return;
    _tile_loadd(6, x + 2 * tile + 32 * g, stride);
    _tile_dpbf16ps(2, 6, 7);
    if (nt < 4) return;
    _tile_loadd(4, x + 3 * tile + 32 * g, stride);
    _tile_dpbf16ps(3, 4, 7);
}

static inline void zero_tiles(int nt) {
    _tile_zero(0);
    if (nt > 1) _tile_zero(1);
    if (nt > 2) _tile_zero(2);
    if (nt > 3) _tile_zero(3);
}

/* C tiles 0..nt-1 (rows row0 + 16 t) of panel p into y. */
static void put_tiles(const qlinear_args *a, const float *scale, int64_t p, int64_t row0,
                      int nt) {
    float c[256] __attribute__((aligned(64)));
    _tile_stored(0, c, 64);
    put_tile(a, c, scale, p, row0);
    if (nt < 2) return;
    _tile_stored(1, c, 64);
    put_tile(a, c, scale, p, row0 + 16);
    if (nt < 3) return;
    _tile_stored(2, c, 64);
    put_tile(a, c, scale, p, row0 + 32);
    if (nt < 4) return;
    _tile_stored(3, c, 64);
    put_tile(a, c, scale, p, row0 + 48);
}

/* Panel p against every row, 64 rows (4 C tiles) at a time. Up to 64 rows: each group is
 * turned into its B tile two groups before its products (three tiles in turn, in L1), so
 * the vector units convert while the tile unit multiplies; more rows: the whole panel first
 * (B holds kp / 32 tiles), multiplied by every block of 64 rows. */
static void panel_rows(const qlinear_args *a, const uint16_t *X, int64_t kp, uint8_t *B,
                       int64_t p) {
    const int64_t G = kp / 32, m = a->m;
    const uint8_t *w = a->w + p * packed_panel_bytes(QT_I8, a->k, AMX_R);
    const uint8_t *groups = w + 4 * AMX_R;
    const float *scale = (const float *)w;
    if (m <= 64) {
        /* three B tiles in turn, each converted two groups ahead of its products: a tile
         * load waits for the stores before it to reach the cache */
        const int nt = (int)((m + 15) / 16);
        zero_tiles(nt);
        for (int64_t g = 0; g < 2 && g < G; g++)
            group_to_tile(B + g * TILE_BYTES, groups + g * 32 * AMX_R);
        for (int64_t g = 0; g < G; g++) {
            _tile_loadd(7, B + (g % 3) * TILE_BYTES, 64);
            row_tiles(X, kp, g, nt);
            if (g + 2 < G)
                group_to_tile(B + ((g + 2) % 3) * TILE_BYTES, groups + (g + 2) * 32 * AMX_R);
        }
        put_tiles(a, scale, p, 0, nt);
        return;
    }
    for (int64_t g = 0; g < G; g++) group_to_tile(B + g * TILE_BYTES, groups + g * 32 * AMX_R);
    for (int64_t row0 = 0; row0 < m; row0 += 64) {
        const int nt = (int)(m - row0 >= 64 ? 4 : (m - row0 + 15) / 16);
        zero_tiles(nt);
        for (int64_t g = 0; g < G; g++) {
            _tile_loadd(7, B + g * TILE_BYTES, 64);
            row_tiles(X + row0 * kp, kp, g, nt);
        }
        put_tiles(a, scale, p, row0, nt);
    }
}

static int i8_on_tiles(const qlinear_args *a) {
    const int64_t kp = (a->k + 31) / 32 * 32, mp = (a->m + 15) / 16 * 16;
    uint16_t *X = quant_scratch(0, (size_t)(mp * kp * 2));
    if (!X) return -1;
    const int64_t panels = (a->n + AMX_R - 1) / AMX_R;
    int failed = 0;
#pragma omp parallel num_threads(a->threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < mp; i++) row_to_bf16(a, X + i * kp, i, kp);
        uint8_t *B = quant_scratch(1, (size_t)((kp / 32 > 3 ? kp / 32 : 3) * TILE_BYTES));
        if (!B) {
#pragma omp atomic write
            failed = 1;
        } else {
            configure_tiles();
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < panels; p++)
            if (B) panel_rows(a, X, kp, B, p);
        if (B) _tile_release();
    }
    return failed ? -1 : 0;
}

static void amx_pack(int qt, uint8_t *dst, const uint8_t *src, const float *rs, int64_t n,
                     int64_t k, int threads) {
    quant_avx512vnni.pack(qt, dst, src, rs, n, k, threads);
}

static void amx_dequantize(int qt, float *out, const uint8_t *w, int64_t n, int64_t k,
                           int threads) {
    quant_avx512vnni.dequantize(qt, out, w, n, k, threads);
}

static int amx_qlinear(const qlinear_args *a) {
    if (a->qtype == QT_I8 && a->m >= AMX_MIN_ROWS) return i8_on_tiles(a);
    if (a->ytype != XT_F32) return -2;
    return quant_avx512vnni.qlinear(a);
}

const quant_kernels quant_avx512amx = {"avx512amx", AMX_R, amx_pack, amx_dequantize,
                                       amx_qlinear};
#endif
