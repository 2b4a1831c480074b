/* The AMX set (`quant_avx512amx`): the AVX-512 VNNI set for every GGUF type (the same
 * layout, the same bits), and int8 weights ("i8", --quantization int8) multiplied on the
 * tile unit in bfloat16 once a call has AMX_MIN_ROWS rows (fewer: the VNNI set's integer
 * kernels, whose activations are int8 per 32 k: a row's result then depends on whether
 * its step had AMX_MIN_ROWS rows, within both schemes' error bounds).
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
 * One panel and up to 64 rows at a time: C tiles 0-3, A tiles 4-6, B tile 7 (`panels_rows`).
 * Each thread takes a run of whole panels. What a step at 64 rows costs besides the tile
 * unit, measured (one core, 64 x 3072 x 576): the weights' conversion to bf16 (7 vector
 * instructions a chunk, by byte lookups), and the output's stores, a row each, n apart,
 * whose lines must be fetched before they are written: done during the next block's
 * products, and with no lock between panels (a dynamic schedule's atomic waited for them
 * all), 290 -> 207 us. Slower, and not kept: k in blocks so that the rows' activations
 * stay in L1 (the C tiles' round trip cost more than it saved), two panels against 32 rows
 * (2 x 2 tiles), software prefetch of the next group's activation rows (docs/gguf.md).
 * bf16 weights ("bf16", a bfloat16 checkpoint computed in float32 activations): laid out
 * once, at load, as the B tiles above (`bf16_pack`: tile row r of group g, word n = row n's
 * k 32g + 2r and 32g + 2r + 1), so a product loads each tile straight from the weights:
 * nothing is converted, at any number of rows, and the output is fl(C + bias). Every call
 * runs the same instructions in the same order for every row, from one row up, so a row's
 * output never depends on its batch. One row costs a 16-row tile product per 32 k and
 * panel, which still outruns the bytes it reads (1 KB a tile: the weights' stream, not the
 * tile unit, bounds a decode step).
 *
 * Linux gives a process the tile data state only when asked (arch_prctl); without it the
 * set is not offered (`quant_amx_usable`).
 */
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx512vbmi,amx-tile,amx-bf16,avx2,fma,f16c")
#include <immintrin.h>
#include <omp.h>
#include <string.h>

#include "../amx.h"
#include "quant.h"
#include "quant_bf16.h"

#define AMX_R 16          /* rows per panel: the VNNI set's layout */
/* AMX_MIN_ROWS (quant.h): fewer rows go to the VNNI set. Converting a panel's weights to
 * bfloat16 costs the same for one row as for 64, and below about 10 rows the integer kernel
 * is faster (2 threads, cache-hot, qkv / o / gate-up / down / the demo's lm_head: 8 rows
 * the tile unit's time 0.94-1.29x the VNNI set's at 8 rows, 0.74-1.01x at 10, 0.68-0.93x at
 * 12, 0.56-0.79x at 16). */
#define TILE_BYTES 1024   /* 16 rows x 64 bytes */

/* bfloat16 of the integers 0..127, low bytes then high bytes (a weight's magnitude indexes
 * them; the sign is the high byte's top bit), and where each byte of a B tile's two rows of
 * a chunk comes from (`group_to_tile`). Filled once, with the answer of quant_amx_usable. */
static uint8_t BF16_INT_LO[128] __attribute__((aligned(64)));
static uint8_t BF16_INT_HI[128] __attribute__((aligned(64)));
static uint8_t TILE_ROW_BYTES[2][64] __attribute__((aligned(64)));

static void fill_tables(void) {
    for (int v = 0; v < 128; v++) {
        union { float f; uint32_t u; } b = {(float)v}; /* |v| < 256: bf16 holds it exactly */
        BF16_INT_LO[v] = (uint8_t)(b.u >> 16);
        BF16_INT_HI[v] = (uint8_t)(b.u >> 24);
    }
    /* tile row 2c + h, word j = 2 n + e (n = 0..15, e = 0, 1): k 4c + 2h + e of row n, the
     * chunk's byte 4 n + 2 h + e; its low byte from the low table's lookup (index < 64),
     * its high byte from the high table's (64 + index) */
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 32; j++) {
            const int at = 4 * (j / 2) + 2 * h + j % 2;
            TILE_ROW_BYTES[h][2 * j] = (uint8_t)at;
            TILE_ROW_BYTES[h][2 * j + 1] = (uint8_t)(64 + at);
        }
}

int quant_amx_usable(void) {
    static int state = -1; /* asked once, at import (under the GIL) */
    if (state < 0) {
        state = __builtin_cpu_supports("avx512vbmi") && amx_granted();
        if (state) fill_tables();
    }
    return state;
}

/* The tables in registers, for one thread's call. */
typedef struct {
    __m512i lo0, lo1, hi0, hi1, row0, row1;
} tile_tables;

static tile_tables load_tables(void) {
    return (tile_tables){_mm512_load_si512(BF16_INT_LO), _mm512_load_si512(BF16_INT_LO + 64),
                         _mm512_load_si512(BF16_INT_HI), _mm512_load_si512(BF16_INT_HI + 64),
                         _mm512_load_si512(TILE_ROW_BYTES[0]),
                         _mm512_load_si512(TILE_ROW_BYTES[1])};
}

/* One packed group (8 chunks, 512 bytes) into its B tile: per chunk, the magnitudes' two
 * bytes looked up (the weights are -127..127), the sign put in the high byte, and both
 * rows' words gathered from the two, in 7 vector instructions. */
static inline void group_to_tile(uint8_t *restrict tile, const uint8_t *restrict group,
                                 const tile_tables *t) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int c = 0; c < 8; c++) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(group + 64 * c), flip);
        const __m512i mag = _mm512_abs_epi8(w);
        const __m512i lo = _mm512_permutex2var_epi8(t->lo0, mag, t->lo1);
        /* hi | (w & 0x80) */
        const __m512i hi =
            _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi0, mag, t->hi1), w, flip, 0xF8);
        _mm512_store_si512(tile + 128 * c, _mm512_permutex2var_epi8(lo, t->row0, hi));
        _mm512_store_si512(tile + 128 * c + 64, _mm512_permutex2var_epi8(lo, t->row1, hi));
    }
}

/* Activation row i as bfloat16 into X, which holds each tile of 16 rows group by group:
 * 16 rows x 32 bf16 (1 KB, what one tile load reads, 16 lines in a run; rows kp apart
 * instead were 2-16% slower). Zero past k; a zero row past m. */
static void row_to_tiles(const qlinear_args *a, uint16_t *restrict X, int64_t i, int64_t kp) {
    const int64_t G = kp / 32;
    uint16_t *dst = X + (i / 16) * 16 * kp + (i % 16) * 32; /* row tile i / 16, group 0 */
    for (int64_t g = 0; g < G; g++) {
        const int64_t j = 32 * g, left = i < a->m ? a->k - j : 0; /* this group's elements */
        _mm512_store_si512(dst + g * 512, x_group_bf16(a, i, j, left));
    }
}

/* A block of up to 64 rows of one panel, its C tiles stored in order (16 x 16 floats each). */
typedef struct {
    int64_t p, row0, rows;
    const float *scale;
} tile_block;

/* Rows r0..r1 of block b (C in c) into y: fl(fl(C * scale) + bias) (bf16 weights, no
 * scale: fl(C + bias)), float32 or bfloat16. */
static void put_rows(const qlinear_args *a, const float *restrict c, const tile_block *b,
                     int64_t r0, int64_t r1) {
    const int64_t col = b->p * AMX_R, left = a->n - col;
    const __mmask16 cols = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    const __m512 bias = a->bias ? _mm512_maskz_loadu_ps(cols, a->bias + col) : _mm512_setzero_ps();
    const __m512 s = b->scale ? _mm512_loadu_ps(b->scale) : _mm512_setzero_ps();
    for (int64_t r = r0; r < r1; r++) {
        const __m512 cr = _mm512_load_ps(c + 16 * r);
        const __m512 y = _mm512_add_ps(b->scale ? _mm512_mul_ps(cr, s) : cr, bias);
        const int64_t at = (b->row0 + r) * a->n + col;
        if (a->ytype == XT_BF16) /* the model's dtype: no float32 pass after the product */
            _mm256_mask_storeu_epi16((uint16_t *)a->y + at, cols, (__m256i)_mm512_cvtneps_pbh(y));
        else
            _mm512_mask_storeu_ps(a->y + at, cols, y);
    }
}

/* One group's products for up to 4 row tiles of 16 (x: the first, in row_to_tiles' layout)
 * against B in tile 7: A in tiles 4, 5, 6 (the fourth reuses 4, read long before), C in
 * tiles 0..3. */
static inline void row_tiles(const uint16_t *x, int64_t kp, int64_t g, int nt) {
    const int64_t tile = 16 * kp;     /* a row tile: its G groups of 16 x 32 */
    const uint16_t *at = x + 512 * g; /* group g of the first */
    _tile_loadd(4, at, 64);
    _tile_dpbf16ps(0, 4, 7);
    if (nt < 2) return;
    _tile_loadd(5, at + tile, 64);
    _tile_dpbf16ps(1, 5, 7);
    if (nt < 3) return;
    _tile_loadd(6, at + 2 * tile, 64);
    _tile_dpbf16ps(2, 6, 7);
    if (nt < 4) return;
    _tile_loadd(4, at + 3 * tile, 64);
    _tile_dpbf16ps(3, 4, 7);
}

static inline void zero_tiles(int nt) {
    _tile_zero(0);
    if (nt > 1) _tile_zero(1);
    if (nt > 2) _tile_zero(2);
    if (nt > 3) _tile_zero(3);
}

static inline void store_tiles(float *c, int nt) {
    _tile_stored(0, c, 64);
    if (nt > 1) _tile_stored(1, c + 256, 64);
    if (nt > 2) _tile_stored(2, c + 512, 64);
    if (nt > 3) _tile_stored(3, c + 768, 64);
}

/* Bytes of converted B tiles a thread keeps (more rows than 64: a run of panels' groups),
 * and of activation rows multiplied by each run in one pass: both stay in L2. */
#define KEEP_B_BYTES (1 << 20)
#define ROWS_BLOCK_BYTES (1 << 17)

/* Panels of a thread (kept: up to KEEP_B_BYTES of B tiles) against every row. */
static int64_t kept_panels(int64_t G) {
    const int64_t n = KEEP_B_BYTES / (G * TILE_BYTES);
    return n > 0 ? n : 1;
}

/* Panels p0..p1 against every row, one block of up to 64 rows (4 C tiles) at a time.
 *
 * Up to 64 rows: each group is turned into its B tile two groups before its products
 * (three tiles in turn, in L1), so the vector units convert while the tile unit multiplies
 * (a tile load waits for the stores before it to reach the cache). More rows: the panels
 * come in runs whose B tiles are all kept (kept_panels), converted the same way during each
 * panel's first block, and the rows in blocks of about ROWS_BLOCK_BYTES, each multiplied
 * by every panel of the run: both then come from L2, where one panel at a time against
 * every row read all the rows again for each panel (2,048 rows: 3x oneDNN's bf16 time).
 *
 * Output: a block's C tiles are stored (c) and written to y during the next block's
 * products, a few rows per group, so those scattered stores (a row each, n apart) wait for
 * their lines while the tile unit works, not between two blocks. */
static void panels_rows(const qlinear_args *a, const uint16_t *X, int64_t kp, uint8_t *B,
                        float *c, int64_t p0, int64_t p1) {
    const int64_t G = kp / 32, m = a->m;
    const int ring = m <= 64, direct = a->qtype == QT_BF16; /* direct: the weights are tiles */
    const int64_t run = ring ? 1 : kept_panels(G);
    int64_t rows_block = ROWS_BLOCK_BYTES / (kp * 2) / 64 * 64;
    if (rows_block < 64) rows_block = 64;
    const int64_t panel_bytes = packed_panel_bytes(a->qtype, a->k, AMX_R);
    const tile_tables t = load_tables();
    tile_block done = {0, 0, 0, NULL}; /* the block whose C waits in c */
    for (int64_t q0 = p0; q0 < p1; q0 += run) {
        const int64_t q1 = q0 + run < p1 ? q0 + run : p1;
        for (int64_t rb = 0; rb < m; rb += rows_block) {
            const int64_t rb_end = rb + rows_block < m ? rb + rows_block : m;
            for (int64_t p = q0; p < q1; p++) {
                const uint8_t *w = a->w + p * panel_bytes;
                const uint8_t *groups = w + 4 * AMX_R;
                /* this panel's tiles: its own bytes, or converted (and kept) in B */
                uint8_t *pb = direct ? (uint8_t *)w : B + (p - q0) * G * TILE_BYTES;
                for (int64_t row0 = rb; row0 < rb_end; row0 += 64) {
                    const int64_t rows = rb_end - row0 < 64 ? rb_end - row0 : 64;
                    const int nt = (int)((rows + 15) / 16);
                    const int convert = !direct && row0 == 0;
                    const int64_t per = (done.rows + G - 1) / G; /* rows of `done` per group */
                    zero_tiles(nt);
                    if (convert)
                        for (int64_t g = 0; g < 2 && g < G; g++)
                            group_to_tile(pb + g * TILE_BYTES, groups + g * 32 * AMX_R, &t);
                    for (int64_t g = 0; g < G; g++) {
                        _tile_loadd(7, pb + (ring && !direct ? g % 3 : g) * TILE_BYTES, 64);
                        row_tiles(X + row0 * kp, kp, g, nt);
                        if (convert && g + 2 < G)
                            group_to_tile(pb + (ring ? (g + 2) % 3 : g + 2) * TILE_BYTES,
                                          groups + (g + 2) * 32 * AMX_R, &t);
                        if (g * per < done.rows)
                            put_rows(a, c, &done, g * per,
                                     (g + 1) * per < done.rows ? (g + 1) * per : done.rows);
                    }
                    store_tiles(c, nt);
                    done = (tile_block){p, row0, rows, direct ? NULL : (const float *)w};
                }
            }
        }
    }
    put_rows(a, c, &done, 0, done.rows);
}

/* i8 (converted to B tiles as read) or bf16 (read as tiles) weights on the tile unit. */
static int on_tiles(const qlinear_args *a) {
    const int64_t kp = (a->k + 31) / 32 * 32, mp = (a->m + 15) / 16 * 16, G = kp / 32;
    uint16_t *X = quant_scratch(0, (size_t)(mp * kp * 2));
    if (!X) return -1;
    const int64_t panels = (a->n + AMX_R - 1) / AMX_R;
    const int64_t b_tiles = a->qtype == QT_BF16 ? 0 : a->m <= 64 ? 3 : G * kept_panels(G);
    int failed = 0;
#pragma omp parallel num_threads(a->threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < mp; i++) row_to_tiles(a, X, i, kp);
        /* each thread a run of whole panels: its output rows' lines are its own */
        const int64_t th = omp_get_thread_num(), nth = omp_get_num_threads();
        const int64_t p0 = panels * th / nth, p1 = panels * (th + 1) / nth;
        uint8_t *B = quant_scratch(1, (size_t)(b_tiles * TILE_BYTES + 4 * TILE_BYTES));
        if (!B) {
#pragma omp atomic write
            failed = 1;
        } else if (p0 < p1) {
            amx_configure();
            panels_rows(a, X, kp, B, (float *)(B + b_tiles * TILE_BYTES), p0, p1);
            _tile_release();
        }
    }
    return failed ? -1 : 0;
}

static int amx_qlinear(const qlinear_args *a) {
    if (a->qtype == QT_BF16 || (a->qtype == QT_I8 && a->m >= AMX_MIN_ROWS)) return on_tiles(a);
    if (a->ytype != XT_F32) return -2;
    return quant_avx512vnni.qlinear(a);
}

const quant_kernels quant_avx512amx = {"avx512amx", AMX_R, bf16_set_pack, bf16_set_dequantize,
                                       amx_qlinear};
#endif
