/* Activations for the quantized product (quant_gemm.h): each row quantized per group of 32
 * k as Q8_0 does (da = max|x| / 127, q = round-to-nearest-even(x / da), |q| <= 127) with the
 * sums each type's offset needs, and how each type's groups dot against them (the kinds).
 * The K-quants' rows are quantized per super-block of 256 instead, as llama.cpp's Q8_K
 * (quant_kq.h: their sub-block scales are then applied in the integers).
 * Included by quant_gemm.h, compiled per set; plain C the compiler vectorizes.
 */

typedef struct {
    const int8_t *q;     /* [m, kp] */
    const float *da;     /* [m, groups] */
    const float *dasa;   /* [m, groups]: da * sa (the float offsets M multiply it) */
    const int32_t *nsa;  /* [m, groups]: -c * sa for an integer offset c (below) */
    int64_t kp, groups;
    const uint8_t *blk;  /* the tiled product's blocks of rows (ACT_REC); NULL: the rows above */
    /* the K-quants' activations (quantize_row_k): da [m, groups / 8] per 256, and the
     * integer sums per group sg [m, groups] and per half sh [m, 2 groups] as int16 */
    const int16_t *sg, *sh;
} acts;

/* How a type's groups of 32 dot (see quant.h for D, M; the K-quants: quant_kq.h):
 *   KIND_UM   unsigned u, float offset M: da * (D * (u . q) + M * sa)  q4_1 q5_1
 *   KIND_UO   unsigned u, M = -c D with c an integer: da * D * (u . q - c sa), the offset
 *             taken in the int32 sum              q4_0 (c 8) q5_0 (16), 8-bit with FLIP8 (128)
 *   KIND_S    signed w (the sign trick), no offset                   q8_0 i8 without FLIP8
 * nsa holds -c * sa once per group.
 * FLIP8 (the VNNI set): 8-bit weights are stored as u = w + 128 (w ^ 0x80), unsigned, since
 * vpdpbusd sums u8 x s8 in int32 directly and u . q - 128 sa = w . q exactly. */
enum { KIND_UM, KIND_UO, KIND_S };

static inline int kind_of(int qt) {
    switch (qt) {
    case QT_Q4_0:
    case QT_Q5_0: return KIND_UO;
    case QT_Q8_0:
    case QT_I8: return FLIP8 ? KIND_UO : KIND_S;
    default: return KIND_UM;
    }
}

/* Chunks whose maddubs sums (int16, each at most 2 x umax x 127) add up in int16 before
 * one widening madd: 8 for 4-bit u (8 x 3810 = 30480 < 32768), 4 for 5-bit (31496); the
 * others widen every chunk. vpdpbusd has no int16 step: 1 there. */
static inline int run_of(int qt) {
#ifdef DOT_MADDUBS
    switch (qt) {
    case QT_Q4_0:
    case QT_Q4_1: return 8;
    case QT_Q5_0:
    case QT_Q5_1: return 4;
    default: return 1;
    }
#else
    (void)qt;
    return 1;
#endif
}

static inline int offset_of(int qt) {
    switch (qt) {
    case QT_Q4_0: return 8;
    case QT_Q5_0: return 16;
    case QT_Q8_0:
    case QT_I8: return FLIP8;
    default: return 0;
    }
}

/* ---- activations ----------------------------------------------------------------- */

/* One group of 32 (zeros past k: i8's padding to whole groups). */
static inline void load_group(const qlinear_args *a, int64_t i, int64_t k0, float *x) {
    const int64_t valid = a->k - k0 < 32 ? a->k - k0 : 32;
    if (a->xtype == XT_BF16) {
        const uint16_t *src = (const uint16_t *)a->x + i * a->ldx + k0;
        for (int j = 0; j < 32; j++) {
            union { uint32_t u; float f; } v = {(uint32_t)src[j < valid ? j : 0] << 16};
            x[j] = j < valid ? v.f : 0.0f;
        }
    } else if (valid == 32) {
        memcpy(x, (const float *)a->x + i * a->ldx + k0, 32 * sizeof(float));
    } else {
        const float *src = (const float *)a->x + i * a->ldx + k0;
        for (int j = 0; j < 32; j++) x[j] = j < valid ? src[j] : 0.0f;
    }
}

/* max |x| over n values, as the integer max of their bit patterns without the sign (the
 * same order for finite floats; a NaN wins, so its group's da is NaN, not a silent 0):
 * GCC vectorizes an integer max, and a float one only under -ffast-math. */
static inline float abs_max(const float *x, int n) {
    uint32_t m = 0;
    for (int j = 0; j < n; j++) {
        uint32_t u;
        memcpy(&u, x + j, 4);
        u &= 0x7fffffffu;
        m = u > m ? u : m;
    }
    float f;
    memcpy(&f, &m, 4);
    return f;
}

/* 32 values rounded to int8 at scale id (nearest even: adding 1.5 * 2^23 leaves no
 * fraction bits), with the sums of each 16. Three plain loops, so GCC vectorizes each under
 * the set's target (written as one loop with a running sum indexed by e >> 4 it stayed
 * scalar: with the float max, a tenth of a 32-token prefill on an AVX-512 Xeon). */
static inline void round_q(const float *restrict x, float id, int8_t *restrict q,
                           int32_t *restrict h) {
    int32_t v[32];
    for (int e = 0; e < 32; e++) v[e] = (int32_t)((x[e] * id + 12582912.0f) - 12582912.0f);
    for (int e = 0; e < 32; e++) q[e] = (int8_t)v[e];
    int32_t s0 = 0, s1 = 0;
    for (int e = 0; e < 16; e++) s0 += v[e];
    for (int e = 16; e < 32; e++) s1 += v[e];
    h[0] = s0;
    h[1] = s1;
}

/* Group g of row i quantized: 32 q, da, da * sa and nsa (see acts), written
 * where the caller's layout keeps them. */
static inline void quantize_group(const qlinear_args *a, int64_t i, int64_t g, int8_t *q,
                                  float *da_out, float *dasa_out, int32_t *nsa_out) {
    const int c = offset_of(a->qtype);
    float x[32];
    load_group(a, i, g * 32, x);
    const float amax = abs_max(x, 32);
    const float da = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    int32_t h[2];
    round_q(x, id, q, h);
    const int32_t sum = h[0] + h[1];
    *da_out = da;
    *dasa_out = da * (float)sum;
    *nsa_out = -c * sum;
}

static void quantize_row(const qlinear_args *a, const acts *A, int64_t i) {
    for (int64_t g = 0; g < A->groups; g++) {
        const int64_t ag = i * A->groups + g;
        quantize_group(a, i, g, (int8_t *)A->q + i * A->kp + g * 32, (float *)A->da + ag,
                       (float *)A->dasa + ag, (int32_t *)A->nsa + ag);
    }
}

#ifndef QUANT_SCALAR
/* The tiled product's layout (quant_gemm.h mk_body): rows in blocks of MK_MR, and per block
 * and group one record of ACT_REC bytes holding everything the micro-kernel reads for it,
 *
 *     q [MK_MR][32] int8 | da [MK_MR] | dasa [MK_MR] f32 | nsa [MK_MR] int32
 *
 * records of a block in group order, so the kernel walks one pointer and every operand is
 * at a constant offset from it (the rows of m's last block past m are never written,
 * read or stored: the micro-kernel takes only the block's mr rows). */
#define ACT_REC (MK_MR * 44)
static void quantize_row_blocked(const qlinear_args *a, uint8_t *ab, int64_t groups, int64_t i) {
    const int r = (int)(i % MK_MR);
    uint8_t *rec = ab + (i / MK_MR) * groups * ACT_REC;
    for (int64_t g = 0; g < groups; g++, rec += ACT_REC) {
        float *da = (float *)(rec + MK_MR * 32);
        quantize_group(a, i, g, (int8_t *)rec + r * 32, da + r, da + MK_MR + r,
                       (int32_t *)(da + 2 * MK_MR) + r);
    }
}
#endif

/* ---- the K-quants' activations: one scale per 256 (quant_kq.h) ---------------------- */

/* Super-block b of row i: 256 q (da = max|x| / 127 over the 256), da, and the int16 sums
 * per group of 32 (sg[8]) and per half of 16 (sh[16]), |sum| <= 32 x 127. */
static inline void quantize_sb(const qlinear_args *a, int64_t i, int64_t b, int8_t *const q[8],
                               float *da_out, int16_t *sg, int16_t *sh) {
    float x[256];
    for (int j = 0; j < 8; j++) load_group(a, i, b * 256 + j * 32, x + 32 * j);
    const float amax = abs_max(x, 256);
    const float id = amax > 0 ? 127.0f / amax : 0.0f;
    *da_out = amax / 127.0f;
    for (int j = 0; j < 8; j++) {
        int32_t h[2];
        round_q(x + 32 * j, id, q[j], h);
        sh[2 * j] = (int16_t)h[0];
        sh[2 * j + 1] = (int16_t)h[1];
        sg[j] = (int16_t)(h[0] + h[1]);
    }
}

static void quantize_row_k(const qlinear_args *a, const acts *A, int64_t i) {
    const int64_t sbs = A->groups / 8;
    for (int64_t b = 0; b < sbs; b++) {
        int8_t *q0 = (int8_t *)A->q + i * A->kp + b * 256;
        int8_t *const q[8] = {q0, q0 + 32, q0 + 64, q0 + 96, q0 + 128, q0 + 160, q0 + 192, q0 + 224};
        quantize_sb(a, i, b, q, (float *)A->da + i * sbs + b, (int16_t *)A->sg + i * A->groups + 8 * b,
                    (int16_t *)A->sh + i * 2 * A->groups + 16 * b);
    }
}

#ifndef QUANT_SCALAR
/* The tiled product's K record, per block of MK_MR rows and super-block (quant_kq.h):
 *
 *     q [8 groups][MK_MR][32] int8 | da [MK_MR] f32 | sg [MK_MR][8] | sh [MK_MR][16] int16
 */
#define KREC (MK_MR * 308)
#define KREC_DA (MK_MR * 256)
#define KREC_SG (KREC_DA + MK_MR * 4)
#define KREC_SH (KREC_SG + MK_MR * 16)
static void quantize_row_kblocked(const qlinear_args *a, uint8_t *ab, int64_t groups, int64_t i) {
    const int r = (int)(i % MK_MR);
    const int64_t sbs = groups / 8;
    uint8_t *rec = ab + (i / MK_MR) * sbs * KREC;
    for (int64_t b = 0; b < sbs; b++, rec += KREC) {
        int8_t *q[8];
        for (int j = 0; j < 8; j++) q[j] = (int8_t *)rec + (j * MK_MR + r) * 32;
        quantize_sb(a, i, b, q, (float *)(rec + KREC_DA) + r, (int16_t *)(rec + KREC_SG) + 8 * r,
                    (int16_t *)(rec + KREC_SH) + 16 * r);
    }
}
#endif
