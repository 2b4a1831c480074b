/* Quantized matrix kernels (`ringllm.pipeline.ops.quant_kernels`), shared declarations.
 *
 * A quantized weight matrix W [n, k] is held in a layout of our own, repacked at load from
 * GGUF's blocks (or from int8 rows with one scale per row, "i8"). Every type is read as
 * groups of 32 weights along k, each weight an integer u (unsigned for the 4/5/6-bit types,
 * signed for the 8-bit ones) with a float scale D_g and offset M_g per row and group:
 *
 *     w = D_g * u + M_g        q4_0: D=d, M=-8d      q4_1 / q5_1: D=d, M=m    q5_0: M=-16d
 *                              q4_k / q5_k: D=d*sc, M=-dmin*mn                q8_0 / i8: M=0
 *                              q6_k: groups of 16, D=d*sc, M=-32*d*sc
 *
 * Layout. Rows are interleaved in panels of R rows (R = int32 lanes of the set's vector:
 * 8 for generic / avx2, 16 for avx512 / avx512vnni), so one vector holds 4 consecutive k of
 * R rows: one integer dot-product instruction (vpdpbusd, or maddubs + madd) then sums them
 * into R int32 lanes, one lane per output row, and no horizontal sum is ever needed.
 * A "chunk vector" is CV = 4R bytes; a group of 32 k is 8 chunks:
 *
 *     chunk c (k = 4c .. 4c+3):   row 0: k0 k1 k2 k3 | row 1: k0 k1 k2 k3 | ... | row R-1
 *
 * The panel is a run of block records (a block is 32 k, or 256 for the K-quants), all of
 * one size, each holding the R rows' scales and then their weights:
 *
 *     nibbles  4 CV bytes per group: byte j of vector v = chunk v (low) | chunk v+4 (high)
 *     hi1      1 CV per group: bit c of byte j = the 5th bit of chunk c's byte j (q5_*)
 *     hi2      2 CV per group: bits 2(c%4)..+1 of byte j of vector c/4 = the 5th-6th bits
 *     raw8     8 CV per group, the chunks as they are (q8_0, i8: signed)
 *
 *     q4_0   d[R] fp16 | nibbles                     18 bytes per row per 32 (GGUF: 18)
 *     q4_1   d[R] m[R] fp16 | nibbles                20                      (20)
 *     q5_0   d[R] | hi1 | nibbles                    22                      (22)
 *     q5_1   d[R] m[R] | hi1 | nibbles               24                      (24)
 *     q8_0   d[R] | raw8                             34                      (34)
 *     q4_k   d[R] dmin[R] | sc[8][R] mn[8][R] u8 | 8 x nibbles     148 per 256 (144)
 *     q5_k   d[R] dmin[R] | sc[8][R] mn[8][R] | 8 x (nibbles hi1)  180 per 256 (176)
 *     q6_k   d[R] | sc[16][R] s8 | 8 x (nibbles hi2)               210 per 256 (210)
 *     i8     panel header: scale[R] f32 | per group raw8           32 per 32 + 4 per row
 *     bf16   per group one B tile of the AMX tile unit (the AMX set's only: a bfloat16
 *            checkpoint's weights, laid out at load; quant_avx512amx.c)     64 per 32
 *
 * n is padded to whole panels with zero rows (their outputs are never written).
 */
#ifndef RINGLLM_QUANT_H
#define RINGLLM_QUANT_H

#include <stddef.h>
#include <stdint.h>

enum {
    QT_Q4_0, QT_Q4_1, QT_Q5_0, QT_Q5_1, QT_Q8_0, QT_Q4_K, QT_Q5_K, QT_Q6_K, QT_I8, QT_BF16,
    NUM_QT
};
enum { XT_F32 = 0, XT_BF16 = 1 }; /* activation element types */

/* What a type's layout looks like, for any R (quant_layout.c). */
typedef struct {
    const char *name;
    int block_k;          /* k per block record: 32 or 256 */
    int gguf_block_bytes; /* bytes of one GGUF block (0: i8) */
    int row_block_bytes;  /* bytes per row of one block record (the record is R times it) */
    int panel_header;     /* bytes per row before the first record (i8's scales) */
} qtype_info;

extern const qtype_info QTYPES[NUM_QT];

/* Bytes of the packed matrix: ceil(n / R) panels. */
int64_t packed_panel_bytes(int qtype, int64_t k, int rows_per_panel);
int64_t packed_bytes(int qtype, int64_t n, int64_t k, int rows_per_panel);

/* y [m, n] (dense) = x [m, k] (rows ldx elements apart, XT_*) . W^T (+ bias [n]).
 * ytype: y's elements, XT_F32; XT_BF16 (y holds uint16 then, rounded to nearest even) only
 * where the AMX set multiplies on the tile unit (bf16; i8 from AMX_MIN_ROWS rows). */
typedef struct {
    float *y;
    const void *x;
    const uint8_t *w; /* packed */
    const float *bias; /* NULL: none */
    int64_t m, n, k, ldx;
    int qtype, xtype, threads, ytype;
} qlinear_args;

/* The AMX set multiplies int8 weights on the tile unit from this many rows on (fewer: the
 * VNNI set's kernels, quant_avx512amx.c). */
#define AMX_MIN_ROWS 12

typedef struct {
    const char *name;
    int rows_per_panel;
    /* src: GGUF blocks [n, row_bytes] (row_bytes = k / block_k * gguf_block_bytes) or, for
     * i8, int8 [n, k] with row_scales [n], or, for bf16, bfloat16 [n, k]. dst:
     * packed_bytes(). */
    void (*pack)(int qtype, uint8_t *dst, const uint8_t *src, const float *row_scales,
                 int64_t n, int64_t k, int threads);
    /* out [n, k] float32, bit for bit gguf.quants.dequantize's float32 arithmetic. */
    void (*dequantize)(int qtype, float *out, const uint8_t *w, int64_t n, int64_t k,
                       int threads);
    int (*qlinear)(const qlinear_args *); /* 0, -1: out of memory, -2: ytype not here */
} quant_kernels;

extern const quant_kernels quant_generic;
#if defined(__x86_64__)
extern const quant_kernels quant_avx2;
extern const quant_kernels quant_avx512;
extern const quant_kernels quant_avx512vnni;
extern const quant_kernels quant_avx512bf16;
extern const quant_kernels quant_avx512amx;
/* Whether the CPU has the tile unit (bf16) and the OS gave this process its state. */
int quant_amx_usable(void);
#endif

/* A buffer of at least `bytes` owned by the calling thread (slot 0: activations, made by
 * the calling thread; slot 1: weight tiles, one per OpenMP thread), kept and grown across
 * calls so a step allocates nothing. 64-byte aligned. NULL: out of memory. */
void *quant_scratch(int slot, size_t bytes);

/* The products' prefetch (quant_gemm.h's tiled product, quant_avx512bf16.c): row block b
 * of `blocks` asks for its share of the next panels' `lines` cache lines while these are
 * hot, a few lines per step of its micro-kernel's `steps` (groups, super-blocks, pairs of
 * k). Issued in one burst, a share (72 lines of a 1B model's q4_k panel, 32 rows) stalled
 * the core until the line fill buffers drained: 12% of a 32-token prefill sat on the
 * prefetch loop (Intel Xeon, Sapphire Rapids class, perf annotate). */
typedef struct {
    const uint8_t *at;
    int64_t left, per;
} pf_stream;

static inline pf_stream prefetch_share(const uint8_t *next, int64_t lines, int64_t b,
                                       int64_t blocks, int64_t steps) {
    const int64_t share = (lines + blocks - 1) / blocks, first = b * share;
    pf_stream s = {NULL, 0, 0};
    if (!next || first >= lines) return s;
    s.at = next + first * 64;
    s.left = lines - first < share ? lines - first : share;
    s.per = (s.left + steps - 1) / steps; /* steps >= 1: a call's groups or super-blocks */
    return s;
}

static inline void prefetch_step(pf_stream *s) {
    const int64_t n = s->left < s->per ? s->left : s->per;
    for (int64_t l = 0; l < n; l++) __builtin_prefetch(s->at + l * 64, 0, 3);
    s->at += n * 64;
    s->left -= n;
}

/* IEEE half -> float, exactly (every half is a float). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (!mant) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}

#endif
