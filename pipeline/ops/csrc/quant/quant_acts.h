/* Activations for the quantized product (quant_gemm.h): each row quantized per group of 32
 * k as Q8_0 does (da = max|x| / 127, q = round-to-nearest-even(x / da), |q| <= 127) with the
 * sums each type's offset needs, and how each type's groups dot against them (the kinds).
 * Included by quant_gemm.h, compiled per set; plain C the compiler vectorizes.
 */

typedef struct {
    const int8_t *q;     /* [m, kp] */
    const float *da;     /* [m, groups] */
    const float *dasa;   /* [m, groups]: da * sa (the float offsets M multiply it) */
    const int32_t *nsa;  /* [m, 2 groups]: -c * sa for an integer offset c (below) */
    int64_t kp, groups;
    const uint8_t *blk;  /* the tiled product's blocks of rows (ACT_REC); NULL: the rows above */
} acts;

/* How a type's groups dot (see quant.h for D, M):
 *   KIND_UM   unsigned u, float offset M: da * (D * (u . q) + M * sa)  q4_1 q5_1 q4_k q5_k
 *   KIND_UO   unsigned u, M = -c D with c an integer: da * D * (u . q - c sa), the offset
 *             taken in the int32 sum              q4_0 (c 8) q5_0 (16), 8-bit with FLIP8 (128)
 *   KIND_S    signed w (the sign trick), no offset                   q8_0 i8 without FLIP8
 *   KIND_U16  as UO per half of 16 k, each with its own D              q6_k (c 32)
 * nsa holds -c * sa once per group (KIND_UO: in [2g]) or per half (KIND_U16: [2g], [2g+1]).
 * FLIP8 (the VNNI set): 8-bit weights are stored as u = w + 128 (w ^ 0x80), unsigned, since
 * vpdpbusd sums u8 x s8 in int32 directly and u . q - 128 sa = w . q exactly. */
enum { KIND_UM, KIND_UO, KIND_S, KIND_U16 };

static inline int kind_of(int qt) {
    switch (qt) {
    case QT_Q4_0:
    case QT_Q5_0: return KIND_UO;
    case QT_Q8_0:
    case QT_I8: return FLIP8 ? KIND_UO : KIND_S;
    case QT_Q6_K: return KIND_U16;
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
    case QT_Q4_1:
    case QT_Q4_K: return 8;
    case QT_Q5_0:
    case QT_Q5_1:
    case QT_Q5_K: return 4;
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
    case QT_Q6_K: return 32;
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

/* Group g of row i quantized: 32 q, da, da * sa and the two nsa (see acts), written
 * where the caller's layout keeps them. */
static inline void quantize_group(const qlinear_args *a, int64_t i, int64_t g, int8_t *q,
                                  float *da_out, float *dasa_out, int32_t *nsa_out) {
    const int c = offset_of(a->qtype), halves = kind_of(a->qtype) == KIND_U16;
    float x[32], amax = 0.0f;
    load_group(a, i, g * 32, x);
    for (int j = 0; j < 32; j++) {
        const float ax = x[j] < 0 ? -x[j] : x[j];
        amax = ax > amax ? ax : amax;
    }
    const float da = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    int32_t qi[32], sum[2] = {0, 0};
    for (int j = 0; j < 32; j++) {
        /* round to nearest even: adding 1.5 * 2^23 leaves no fraction bits */
        qi[j] = (int32_t)((x[j] * id + 12582912.0f) - 12582912.0f);
        q[j] = (int8_t)qi[j];
    }
    for (int j = 0; j < 16; j++) {
        sum[0] += qi[j];
        sum[1] += qi[j + 16];
    }
    *da_out = da;
    *dasa_out = da * (float)(sum[0] + sum[1]);
    nsa_out[0] = -c * (halves ? sum[0] : sum[0] + sum[1]);
    nsa_out[1] = -c * sum[1];
}

static void quantize_row(const qlinear_args *a, const acts *A, int64_t i) {
    for (int64_t g = 0; g < A->groups; g++) {
        const int64_t ag = i * A->groups + g;
        quantize_group(a, i, g, (int8_t *)A->q + i * A->kp + g * 32, (float *)A->da + ag,
                       (float *)A->dasa + ag, (int32_t *)A->nsa + 2 * ag);
    }
}

#ifndef QUANT_SCALAR
/* The tiled product's layout (quant_gemm.h mk_body): rows in blocks of MK_MR, and per block
 * and group one record of ACT_REC bytes holding everything the micro-kernel reads for it,
 *
 *     q [MK_MR][32] int8 | da [MK_MR] | dasa [MK_MR] f32 | nsa [MK_MR][2] int32
 *
 * records of a block in group order, so the kernel walks one pointer and every operand is
 * at a constant offset from it (the rows of m's last block past m are never written,
 * read or stored: the micro-kernel takes only the block's mr rows). */
#define ACT_REC (MK_MR * 48)
static void quantize_row_blocked(const qlinear_args *a, uint8_t *ab, int64_t groups, int64_t i) {
    const int r = (int)(i % MK_MR);
    uint8_t *rec = ab + (i / MK_MR) * groups * ACT_REC;
    for (int64_t g = 0; g < groups; g++, rec += ACT_REC) {
        float *da = (float *)(rec + MK_MR * 32);
        quantize_group(a, i, g, (int8_t *)rec + r * 32, da + r, da + MK_MR + r,
                       (int32_t *)(da + 2 * MK_MR) + 2 * r);
    }
}
#endif
