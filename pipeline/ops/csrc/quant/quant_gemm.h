/* The quantized product y = x . W^T for one kernel set, over the layout of quant.h:
 *
 *     y[i, j] = sum_g da[i, g] * (D[j, g] * (u[j, g] . q[i, g]) + M[j, g] * sa[i, g])
 *
 * Activations are quantized per row and group of 32 k, as Q8_0 does (quant_acts.h):
 * da = max|x| / 127, q = round-to-nearest-even(x / da) in int8 (|q| <= 127), and the
 * group's integer sum sa kept with them. Each x then differs from q * da by at most da / 2,
 * the only error besides float32 summation. The integer dot u . q is exact in int32
 * (|u| <= 255, 32 terms); an offset that is an integer multiple of D (q4_0, q5_0, the VNNI
 * set's 8-bit) is taken there too (u . q - c sa), so the float work per group, row and QR
 * output rows is a conversion, a product and one or two fused multiply-adds. On the
 * maddubs sets (no VNNI) the int16 pair sums of 4- and 5-bit weights add up over 8 / 4
 * chunks before one widening madd (run_of, quant_acts.h). The K-quants (q4_k, q5_k, q6_k)
 * take their own path, quant_kq.h: activations per 256, sub-block scales in the integers,
 * one float step per super-block.
 *
 * Work: threads split the panels (QR output rows each; panels are all one size, so equal
 * bytes) in equal contiguous shares, one stream per thread, for the GEMV and the tiled
 * product alike (the tiled product once took runs of panels as threads came free, which
 * gave a core slowed by a neighbour fewer, but left each run's first panel unasked for:
 * see qlinear_impl). Small m (decode, m <= GEMV_ROWS) is memory-bound: gemv_panels loads each group's
 * packed vectors once and decodes them in registers straight into the dot products, the
 * rows' sums held in registers across the panel, so nothing but the weights and the
 * activations is read and only y is written (a tile written and read back cost the AVX-512
 * GEMV half its rate: 23 against 43-54 GB/s, 1 thread, cache-hot 2048 x 2048). Larger m
 * decodes the whole panel group by group into an L2-resident tile of int8 chunks
 * (quant_decode.h) and runs every block of MK_MR rows over it, sums kept in registers.
 * The crossover (GEMV_ROWS = 4) was measured: a row's cost is the same on either side of
 * it (2-core Zen 4, q4_k 8960 x 1536). The generic set takes the tile for every m, small m
 * in blocks of GEMV_GROUPS groups kept in L1.
 *
 * Included by a set's file after its vector layer and quant_decode.h. QUANT_SCALAR (the
 * generic set) selects plain-C dot products over an int16 k-major copy of each group.
 */

#include "quant_acts.h"

/* ---- the micro-kernel: MR rows x QR columns over ng decoded groups ---------------- */

#define UNROLL _Pragma("GCC unroll 16")

#ifdef QUANT_SCALAR
#define MK_MR 4
/* The portable dot products: panels_of rewrites each decoded group as int16 [32 k][QR rows]
 * (k_major), so a step of k is QR lanes times one activation, the loop any compiler
 * vectorizes for its baseline (SSE2, NEON): products of |u| <= 255 and |q| <= 127 are exact
 * in int16, their sums in int32. */
#define TILE_SCALE 2 /* tile bytes per weight */
static inline void k_major(uint8_t *restrict dst, const uint8_t *restrict src, int is_signed) {
    int16_t *d = (int16_t *)dst;
    for (int kk = 0; kk < 32; kk++)
        for (int r = 0; r < QR; r++) {
            const uint8_t b = src[(kk >> 2) * CV + r * 4 + (kk & 3)];
            d[kk * QR + r] = is_signed ? (int8_t)b : b;
        }
}

static inline __attribute__((always_inline)) void mk_body(
    const int mr, const int kind, const int run, float *acc, const uint8_t *const *gp,
    const float *D, const float *M, const acts *A, int64_t i0, int64_t g0, int64_t ng) {
    (void)run;
    for (int64_t gl = 0; gl < ng; gl++) {
        const int64_t g = g0 + gl;
        const float *d = D + gl * QR, *m = M + gl * QR;
        const int16_t *w = (const int16_t *)gp[gl];
        for (int r = 0; r < mr; r++) {
            const int8_t *q = A->q + (i0 + r) * A->kp + g * 32;
            const int64_t ag = (i0 + r) * A->groups + g;
            int32_t s0[QR];
            for (int j = 0; j < QR; j++) s0[j] = 0;
            for (int kk = 0; kk < 32; kk++)
                for (int j = 0; j < QR; j++) s0[j] += (int32_t)(int16_t)(w[kk * QR + j] * q[kk]);
            const float da = A->da[ag], dasa = A->dasa[ag];
            const int32_t nsa0 = A->nsa[ag];
            for (int j = 0; j < QR; j++) {
                float t = (float)(s0[j] + (kind == KIND_UO ? nsa0 : 0)) * d[j] * da;
                if (kind == KIND_UM) t += m[j] * dasa;
                acc[r * QR + j] += t;
            }
        }
    }
}
#else
#define TILE_SCALE 1
#ifndef VI_PIN
#define VI_PIN(v) ((void)0)
#endif
/* ab: the block's record of group g0 (quant_acts.h ACT_REC), the next group's ACT_REC on.
 * VI_PIN keeps each row's sum a chain in the order written: left free, GCC reassociated
 * the int16 adds into a tree over all of a group's products and spilled them (AVX2: 16
 * registers), 125 against 149 GOP/s (q4_k, Zen 3, 1 thread). */
static inline __attribute__((always_inline)) void mk_body(
    const int mr, const int kind, const int run, const int chan, float *acc,
    const uint8_t *const *gp, const float *D, const float *M, const uint8_t *ab, int64_t ng,
    pf_stream *pf) {
    /* a call takes all of a panel's groups (panels_of: gb = G past the GEMV): the sums
     * start at 0 and acc is only written (no memset of it, no load) */
    vf f[MK_MR];
    UNROLL for (int r = 0; r < mr; r++) f[r] = VF_SET1(0.0f);
    for (int64_t gl = 0; gl < ng; gl++, ab += ACT_REC) {
        if (pf->left) prefetch_step(pf);
        const uint8_t *w = gp[gl];
        const int8_t *q = (const int8_t *)ab;
        const float *da = (const float *)(ab + MK_MR * 32), *dasa = da + MK_MR;
        const int32_t *nsa = (const int32_t *)(dasa + MK_MR);
        vi s0[MK_MR];
#ifdef DOT_MADDUBS
        vi s1[MK_MR]; /* a run's int16 sums */
#endif
        UNROLL for (int r = 0; r < mr; r++)
            s0[r] = kind == KIND_UM || kind == KIND_S ? VI_ZERO() : VI_BCAST32(nsa + r);
        UNROLL for (int c = 0; c < 8; c++) {
            vi wv = VI_LOAD(w + c * CV);
            if (kind == KIND_S) {
                /* u8 x s8 pairs of 8-bit weights would saturate maddubs' int16: dot |w|
                 * with q carrying w's sign instead */
                const vsm sm = VSM(wv);
                wv = VI_ABS8(wv);
                UNROLL for (int r = 0; r < mr; r++) {
                    s0[r] = DOT_U(s0[r], wv, VI_APPLYSIGN(VI_BCAST32(q + r * 32 + c * 4), sm));
                    VI_PIN(s0[r]);
                }
#ifdef DOT_MADDUBS
            } else if (run > 1) {
                /* s1 holds the int16 run here; widened into s0 at the run's end */
                UNROLL for (int r = 0; r < mr; r++) {
                    const vi p = VI_MADDUBS(wv, VI_BCAST32(q + r * 32 + c * 4));
                    s1[r] = c % run == 0 ? p : VI_ADD16(s1[r], p);
                    VI_PIN(s1[r]);
                    if (c % run == run - 1) s0[r] = VI_WIDEN_ADD(s0[r], s1[r]);
                }
#endif
            } else {
                UNROLL for (int r = 0; r < mr; r++) {
                    s0[r] = DOT_U(s0[r], wv, VI_BCAST32(q + r * 32 + c * 4));
                    VI_PIN(s0[r]);
                }
            }
        }
        if (chan) { /* i8: one scale per output row, D, taken after the last group */
            UNROLL for (int r = 0; r < mr; r++) f[r] = VF_FMA(VF_CVT(s0[r]), VF_SET1(da[r]), f[r]);
            continue;
        }
        const vf d0 = VF_LOAD(D + gl * QR);
        const vf m0 = kind == KIND_UM ? VF_LOAD(M + gl * QR) : d0;
        UNROLL for (int r = 0; r < mr; r++) {
            f[r] = VF_FMA(VF_MUL(VF_CVT(s0[r]), d0), VF_SET1(da[r]), f[r]);
            if (kind == KIND_UM) f[r] = VF_FMA(m0, VF_SET1(dasa[r]), f[r]);
        }
    }
    if (chan) {
        const vf d0 = VF_LOAD(D);
        UNROLL for (int r = 0; r < mr; r++) f[r] = VF_MUL(f[r], d0);
    }
    UNROLL for (int r = 0; r < mr; r++) VF_STORE(acc + r * QR, f[r]);
}
#endif

#ifdef QUANT_SCALAR
typedef void (*mk_fn)(float *, const uint8_t *const *, const float *, const float *,
                      const acts *, int64_t, int64_t, int64_t);
#define MK_DEF(MR, KIND, RUN)                                                              \
    static void mk_##KIND##_##RUN##_##MR(float *acc, const uint8_t *const *gp, const float *D, \
                                         const float *M, const acts *A, int64_t i0,         \
                                         int64_t g0, int64_t ng) {                          \
        mk_body(MR <= MK_MR ? MR : MK_MR, KIND, RUN, acc, gp, D, M, A, i0, g0, ng);        \
    }
#else
typedef void (*mk_fn)(float *, const uint8_t *const *, const float *, const float *,
                      const uint8_t *, int64_t, pf_stream *);
#define MK_DEF(MR, KIND, RUN)                                                              \
    static void mk_##KIND##_##RUN##_##MR(float *acc, const uint8_t *const *gp, const float *D, \
                                         const float *M, const uint8_t *ab, int64_t ng,     \
                                         pf_stream *pf) {                                   \
        mk_body(MR <= MK_MR ? MR : MK_MR, KIND, RUN, 0, acc, gp, D, M, ab, ng, pf);        \
    }
/* i8's: its integer kind, one scale per output row (mk_body's chan) */
#define MKC_DEF(MR)                                                                        \
    static void mk_chan_##MR(float *acc, const uint8_t *const *gp, const float *D,          \
                             const float *M, const uint8_t *ab, int64_t ng, pf_stream *pf) { \
        mk_body(MR <= MK_MR ? MR : MK_MR, kind_of(QT_I8), 1, 1, acc, gp, D, M, ab, ng, pf); \
    }
MKC_DEF(1) MKC_DEF(2) MKC_DEF(3) MKC_DEF(4) MKC_DEF(5) MKC_DEF(6) MKC_DEF(7) MKC_DEF(8)
static const mk_fn MK_CHAN[8] = {mk_chan_1, mk_chan_2, mk_chan_3, mk_chan_4,
                                 mk_chan_5, mk_chan_6, mk_chan_7, mk_chan_8};
#endif
#define MK_DEFS(KIND, RUN) MK_DEF(1, KIND, RUN) MK_DEF(2, KIND, RUN) MK_DEF(3, KIND, RUN)  \
    MK_DEF(4, KIND, RUN) MK_DEF(5, KIND, RUN) MK_DEF(6, KIND, RUN) MK_DEF(7, KIND, RUN)    \
    MK_DEF(8, KIND, RUN)
#define MK_ROW(KIND, RUN)                                                                  \
    {mk_##KIND##_##RUN##_1, mk_##KIND##_##RUN##_2, mk_##KIND##_##RUN##_3,                  \
     mk_##KIND##_##RUN##_4, mk_##KIND##_##RUN##_5, mk_##KIND##_##RUN##_6,                  \
     mk_##KIND##_##RUN##_7, mk_##KIND##_##RUN##_8}
MK_DEFS(KIND_UM, 1)
MK_DEFS(KIND_UO, 1)
MK_DEFS(KIND_S, 1)
#ifdef DOT_MADDUBS
MK_DEFS(KIND_UM, 4)
MK_DEFS(KIND_UM, 8)
MK_DEFS(KIND_UO, 4)
MK_DEFS(KIND_UO, 8)
/* [kind][run 1, 4, 8][rows - 1] */
static const mk_fn MK[3][3][8] = {
    {MK_ROW(KIND_UM, 1), MK_ROW(KIND_UM, 4), MK_ROW(KIND_UM, 8)},
    {MK_ROW(KIND_UO, 1), MK_ROW(KIND_UO, 4), MK_ROW(KIND_UO, 8)},
    {MK_ROW(KIND_S, 1), MK_ROW(KIND_S, 1), MK_ROW(KIND_S, 1)},
};
#else
static const mk_fn MK[3][3][8] = {
    {MK_ROW(KIND_UM, 1), MK_ROW(KIND_UM, 1), MK_ROW(KIND_UM, 1)},
    {MK_ROW(KIND_UO, 1), MK_ROW(KIND_UO, 1), MK_ROW(KIND_UO, 1)},
    {MK_ROW(KIND_S, 1), MK_ROW(KIND_S, 1), MK_ROW(KIND_S, 1)},
};
#endif

/* ---- the driver ------------------------------------------------------------------ */

#define GEMV_ROWS 4    /* m up to this: gemv_panels (generic: blocks of groups) */
#define GEMV_GROUPS 8  /* the generic set's groups per block there: 8 tiles in L1 */

/* NOTE: both GEMVs (gemv_panels, quant_kq.h gemv_kq) ask for each record's lines
 * GEMV_FAR_BYTES ahead of the one they decode, with prefetchnta, a record's worth at a
 * time (so as many lines a step as the step reads). Read this far ahead of the hardware
 * prefetcher, with the hint that does not keep the line in the outer caches, a thread
 * holds more of the memory's bandwidth, most of all while a neighbour loads the machine:
 * `bench qgemm-ab --rows 1,4 --cold-bytes 400000000 --threads 2` against the build
 * without it (Zen 5, VNNI set, 2 threads, 16 alternated turns, the medians of two runs):
 * q4_0 / q4_1 / q8_0 m=1 0.98-1.13x, m=4 1.18-1.68x; q4_k 1.08x and 1.16-1.18x; q5_k
 * 1.10-1.11x and 1.47-1.48x; q6_k 1.06-1.08x and 1.38-1.41x (the avx2 set, same CPU:
 * 0.99-1.77x but for one run of q4_k m=4 at 0.92x). 8 and 16 KiB ahead did as well on the simple
 * types; 16 and 20 KiB were 3-16% slower on the K-quants. With other hints the same
 * lines lost: q6_k's far lines as prefetcht2 beside a prefetcht0 near one 0.93x, its near
 * one as prefetcht1 0.93x; and a 4 KiB burst per block of groups (prefetcht0 or nta) had
 * halved the cold GEMV's rate on Zen 4, 1 thread: the hint and the spreading count. */
#define GEMV_FAR_BYTES 12288

/* Panel p's outputs of m rows from acc (row i at acc + i QR), plus the bias. */
static inline void put_panel(const qlinear_args *a, int64_t p, const float *acc, int64_t m) {
    const int rows = a->n - p * QR < QR ? (int)(a->n - p * QR) : QR;
#ifndef QUANT_SCALAR
    if (rows == QR) {
        /* a whole panel, a vector a row: 1.06-1.13x the tiled product of 16 and 64 rows
         * against the scalar loop below at k = 512 (Intel Xeon, SPR class, one core;
         * `bench qgemm-ab`). + 0 without a bias, as there (-0 becomes +0). */
        const vf b = a->bias ? VF_LOAD(a->bias + p * QR) : VF_SET1(0.0f);
        for (int64_t i = 0; i < m; i++)
            VF_STORE(a->y + i * a->n + p * QR, VF_ADD(VF_LOAD(acc + i * QR), b));
        return;
    }
#endif
    for (int64_t i = 0; i < m; i++)
        for (int r = 0; r < rows; r++)
            a->y[i * a->n + p * QR + r] =
                acc[i * QR + r] + (a->bias ? a->bias[p * QR + r] : 0.0f);
}

#ifndef QUANT_SCALAR
/* ---- the GEMV (m <= GEMV_ROWS): decoding in registers ----------------------------- */

/* Chunk c (0..7) of a group as the dot products take it, from the group's packed vectors:
 * nv the 4 nibble vectors, hv the 5th-bit plane (q5_*) or the two 5th-6th-bit planes (q6_k).
 * The 16-bit shifts move whole bytes' bits; the masks keep each byte's own. */
static inline __attribute__((always_inline)) vi gemv_chunk(const int qt, const vi *nv,
                                                           const vi *hv, const int c) {
    const vi lo = c < 4 ? nv[c] : VI_SRL16(nv[c - 4], 4);
    vi w = VI_AND(lo, VI_SET1_8(15));
    if (qt == QT_Q5_0 || qt == QT_Q5_1 || qt == QT_Q5_K) {
        /* bit c of hv[0] to bit 4 */
        const vi b = c <= 4 ? VI_SLL16(hv[0], 4 - c) : VI_SRL16(hv[0], c - 4);
        w = VI_OR(w, VI_AND(b, VI_SET1_8(16)));
    } else if (qt == QT_Q6_K) {
        /* bits 2 (c % 4) .. + 1 of hv[c / 4] to bits 4-5 */
        const int s = 2 * (c & 3);
        const vi h = hv[c >> 2], b = s <= 4 ? VI_SLL16(h, 4 - s) : VI_SRL16(h, s - 4);
        w = VI_OR(w, VI_AND(b, VI_SET1_8(0x30)));
    }
    return w;
}

/* Panels p0 .. p1-1 for MR (1..GEMV_ROWS) activation rows: each group's packed vectors are
 * loaded once and decoded in registers straight into the dot products, D and M made from
 * the record's scales in registers, and the rows' float sums stay in registers across the
 * panel. The float arithmetic is mk_body's, operation for operation (a row's result must
 * not depend on which path m takes, tests/pipeline/ops/test_quant_kernels.py). */
static inline __attribute__((always_inline)) void gemv_panels(
    const int qt, const int mr, const qlinear_args *a, const acts *A, int64_t p0, int64_t p1) {
    const int kind = kind_of(qt), run = run_of(qt);
    (void)run; /* the maddubs sets' */
    const int64_t G = A->groups;
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *panel = panel_at(qt, a->w, p, a->k);
        vf f[GEMV_ROWS];
        UNROLL for (int r = 0; r < mr; r++) f[r] = VF_SET1(0.0f);
        const vf di8 = qt == QT_I8 ? VF_LOAD((const float *)panel) : VF_SET1(0.0f);
        for (int64_t g = 0; g < G; g++) {
            /* the group's weights and D, M (quant_decode.h decode_group, in registers) */
            const uint8_t *rec = record_at(qt, panel, g);
            for (int64_t o = 0; o < ROW_BLOCK_BYTES[qt] * QR; o += 64)
                __builtin_prefetch(rec + GEMV_FAR_BYTES + o, 0, 0); /* prefetchnta */
            const vf d0 = qt == QT_I8 ? di8 : VF_H2F(rec);
            const vf m0 = qt == QT_Q4_1 || qt == QT_Q5_1 ? VF_H2F(rec + 2 * QR) : d0;
            const uint8_t *nib, *hb = NULL;
            switch (qt) {
            case QT_Q4_0: nib = rec + 2 * QR; break;
            case QT_Q5_0: hb = rec + 2 * QR, nib = hb + CV; break;
            case QT_Q4_1: nib = rec + 4 * QR; break;
            case QT_Q5_1: hb = rec + 4 * QR, nib = hb + CV; break;
            case QT_Q8_0: nib = rec + 2 * QR; break;
            default: nib = rec; break; /* QT_I8 */
            }
            const int eight = qt == QT_Q8_0 || qt == QT_I8;
            vi nv[4], hv[2];
            if (!eight) {
                UNROLL for (int v = 0; v < 4; v++) nv[v] = VI_LOAD(nib + v * CV);
                if (hb) hv[0] = VI_LOAD(hb);
            }
            const int8_t *q = A->q + g * 32;
            vi s0[GEMV_ROWS];
#ifdef DOT_MADDUBS
            vi s1[GEMV_ROWS];
#endif
            UNROLL for (int r = 0; r < mr; r++)
                s0[r] = kind == KIND_UM || kind == KIND_S ? VI_ZERO() : VI_BCAST32(A->nsa + r * G + g);
            UNROLL for (int c = 0; c < 8; c++) {
                vi wv = eight ? VI_LOAD(nib + c * CV) : gemv_chunk(qt, nv, hv, c);
                if (kind == KIND_S) {
                    /* as mk_body: |w| against q carrying w's sign */
                    const vsm sm = VSM(wv);
                    wv = VI_ABS8(wv);
                    UNROLL for (int r = 0; r < mr; r++) s0[r] = DOT_U(
                        s0[r], wv, VI_APPLYSIGN(VI_BCAST32(q + r * A->kp + c * 4), sm));
#ifdef DOT_MADDUBS
                } else if (run > 1) {
                    UNROLL for (int r = 0; r < mr; r++) {
                        const vi pr = VI_MADDUBS(wv, VI_BCAST32(q + r * A->kp + c * 4));
                        s1[r] = c % run == 0 ? pr : VI_ADD16(s1[r], pr);
                        if (c % run == run - 1) s0[r] = VI_WIDEN_ADD(s0[r], s1[r]);
                    }
#endif
                } else {
                    UNROLL for (int r = 0; r < mr; r++)
                        s0[r] = DOT_U(s0[r], wv, VI_BCAST32(q + r * A->kp + c * 4));
                }
            }
            UNROLL for (int r = 0; r < mr; r++) {
                if (qt == QT_I8) { /* as mk_body's chan: D after the last group */
                    f[r] = VF_FMA(VF_CVT(s0[r]), VF_SET1(A->da[r * G + g]), f[r]);
                    continue;
                }
                f[r] = VF_FMA(VF_MUL(VF_CVT(s0[r]), d0), VF_SET1(A->da[r * G + g]), f[r]);
                if (kind == KIND_UM) f[r] = VF_FMA(m0, VF_SET1(A->dasa[r * G + g]), f[r]);
            }
        }
        if (qt == QT_I8) {
            UNROLL for (int r = 0; r < mr; r++) f[r] = VF_MUL(f[r], di8);
        }
        float acc[GEMV_ROWS * QR];
        UNROLL for (int r = 0; r < mr; r++) VF_STORE(acc + r * QR, f[r]);
        put_panel(a, p, acc, mr);
    }
}
#endif

#if !defined(QUANT_SCALAR) && FLIP8
/* ---- i8 against several panels at once (the VNNI sets) ------------------------------- */

/* i8's groups need no decoding (mk_body reads them in the panel), so a block can take
 * MKC_NP panels side by side: a row's 4 activation bytes are broadcast once for the
 * panels' vectors, np + mr loads per np x mr dot products where mk_body has 1 + 8 per 8.
 * Rows r0 .. r0 + mr - 1 of a block's records (ab: its first group's, ACT_REC apart)
 * against panels at panel, panel + panel_bytes, ...: every sum is mk_body's chan sum, the
 * same operations in the same order (a row's output does not depend on which kernel, nor
 * which rows beside it). Sums to acc + j * acc_stride + (r0 + r) * QR. */
#define MKC_NP 3
#define MKC_MR 4 /* 12 int + 12 float sums, 3 weight vectors: 28 of the 32 registers */
static inline __attribute__((always_inline)) void mkc_body(
    const int mr, const int np, float *acc, int64_t acc_stride, const uint8_t *panel,
    int64_t panel_bytes, const uint8_t *ab, int r0, int64_t G, pf_stream *pf) {
    vf f[MKC_MR][MKC_NP];
    UNROLL for (int r = 0; r < mr; r++) UNROLL for (int j = 0; j < np; j++) f[r][j] = VF_SET1(0.0f);
    const uint8_t *rec = record_at(QT_I8, panel, 0);
    for (int64_t g = 0; g < G; g++, ab += ACT_REC, rec += GROUP_BYTES) {
        if (pf->left) prefetch_step(pf);
        /* the record as mk_body reads it: q [MK_MR][32] | da | dasa | nsa [MK_MR] */
        const int8_t *q = (const int8_t *)ab + r0 * 32;
        const float *da = (const float *)(ab + MK_MR * 32) + r0;
        const int32_t *nsa = (const int32_t *)(da - r0 + 2 * MK_MR) + r0;
        vi s[MKC_MR][MKC_NP];
        UNROLL for (int r = 0; r < mr; r++) UNROLL for (int j = 0; j < np; j++) s[r][j] = VI_BCAST32(nsa + r);
        UNROLL for (int c = 0; c < 8; c++) {
            vi wv[MKC_NP];
            UNROLL for (int j = 0; j < np; j++) wv[j] = VI_LOAD(rec + j * panel_bytes + c * CV);
            UNROLL for (int r = 0; r < mr; r++) {
                const vi xb = VI_BCAST32(q + r * 32 + c * 4);
                UNROLL for (int j = 0; j < np; j++) s[r][j] = DOT_U(s[r][j], wv[j], xb);
            }
        }
        UNROLL for (int r = 0; r < mr; r++) {
            const vf dr = VF_SET1(da[r]);
            UNROLL for (int j = 0; j < np; j++) f[r][j] = VF_FMA(VF_CVT(s[r][j]), dr, f[r][j]);
        }
    }
    UNROLL for (int j = 0; j < np; j++) {
        const vf d0 = VF_LOAD((const float *)(panel + j * panel_bytes));
        UNROLL for (int r = 0; r < mr; r++)
            VF_STORE(acc + j * acc_stride + (r0 + r) * QR, VF_MUL(f[r][j], d0));
    }
}

typedef void (*mkc_fn)(float *, int64_t, const uint8_t *, int64_t, const uint8_t *, int, int64_t,
                       pf_stream *);
#define MKN_DEF(MR, NP)                                                                    \
    static void mkc_##MR##_##NP(float *acc, int64_t st, const uint8_t *panel, int64_t pb,   \
                                const uint8_t *ab, int r0, int64_t G, pf_stream *pf) {      \
        mkc_body(MR, NP, acc, st, panel, pb, ab, r0, G, pf);                               \
    }
#define MKN_DEFS(MR) MKN_DEF(MR, 1) MKN_DEF(MR, 2) MKN_DEF(MR, 3)
MKN_DEFS(1) MKN_DEFS(2) MKN_DEFS(3) MKN_DEFS(4)
#define MKN_ROW(MR) {mkc_##MR##_1, mkc_##MR##_2, mkc_##MR##_3}
/* [rows - 1][panels - 1] */
static const mkc_fn MKC[MKC_MR][MKC_NP] = {MKN_ROW(1), MKN_ROW(2), MKN_ROW(3), MKN_ROW(4)};

/* i8's tiled product for panels p0 .. p1 - 1, MKC_NP at a time (m > GEMV_ROWS); acc holds
 * MKC_NP x m x QR floats. */
static int i8_panels(const qlinear_args *a, const acts *A, int64_t p0, int64_t p1, float *acc) {
    const int64_t G = A->groups, m = a->m, pb = packed_panel_bytes(QT_I8, a->k, QR);
    const int64_t blocks = (m + MK_MR - 1) / MK_MR;
    for (int64_t p = p0; p < p1; p += MKC_NP) {
        const int np = p1 - p < MKC_NP ? (int)(p1 - p) : MKC_NP;
        const uint8_t *panel = panel_at(QT_I8, a->w, p, a->k);
        const int nn = p1 - p - np < MKC_NP ? (int)(p1 - p - np) : MKC_NP;
        const uint8_t *next = nn > 0 ? panel + np * pb : NULL;
        for (int64_t b = 0; b < blocks; b++) {
            const int rows = m - b * MK_MR < MK_MR ? (int)(m - b * MK_MR) : MK_MR;
            /* the block's share of the next panels, over its calls' groups */
            const int64_t steps = (rows + MKC_MR - 1) / MKC_MR * G;
            pf_stream pf = prefetch_share(next, (nn * pb + 63) / 64, b, blocks, steps);
            for (int r0 = 0; r0 < rows; r0 += MKC_MR) {
                const int mr = rows - r0 < MKC_MR ? rows - r0 : MKC_MR;
                MKC[mr - 1][np - 1](acc + b * MK_MR * QR, m * QR, panel, pb,
                                    A->blk + b * G * ACT_REC, r0, G, &pf);
            }
        }
        for (int j = 0; j < np; j++) put_panel(a, p + j, acc + j * m * QR, m);
    }
    return 0;
}
#endif

#include "quant_kq.h"

/* Panels p0 .. p1-1 of one thread, for one type (inlined per type: qt is a constant). */
static inline __attribute__((always_inline)) int panels_of(
    const int qt, const qlinear_args *a, const acts *A, int64_t p0, int64_t p1) {
    if (kq_is(qt)) return panels_kq(qt, a, A, p0, p1);
    const int kind = kind_of(qt);
    const int runi = run_of(qt) == 8 ? 2 : run_of(qt) == 4 ? 1 : 0;
    const int64_t G = A->groups, m = a->m;
#ifndef QUANT_SCALAR
    switch (m) {
    case 1: gemv_panels(qt, 1, a, A, p0, p1); return 0;
    case 2: gemv_panels(qt, 2, a, A, p0, p1); return 0;
    case 3: gemv_panels(qt, 3, a, A, p0, p1); return 0;
    case 4: gemv_panels(qt, 4, a, A, p0, p1); return 0;
    }
#endif
#if !defined(QUANT_SCALAR) && FLIP8
    if (qt == QT_I8) {
        float *acc = quant_scratch(1, MKC_NP * m * QR * sizeof(float));
        return acc ? i8_panels(a, A, p0, p1, acc) : -1;
    }
#endif
    const int64_t gb = m <= GEMV_ROWS ? (G < GEMV_GROUPS ? G : GEMV_GROUPS) : G;
    const size_t tile_bytes = gb * GROUP_BYTES * TILE_SCALE, scale_bytes = gb * QR * sizeof(float);
    uint8_t *buf = quant_scratch(1, tile_bytes + 2 * scale_bytes + gb * sizeof(void *) +
                                        m * QR * sizeof(float));
    if (!buf) return -1;
    uint8_t *tile = buf;
    float *D = (float *)(buf + tile_bytes), *M = (float *)(buf + tile_bytes + scale_bytes);
    const uint8_t **gp = (const uint8_t **)(buf + tile_bytes + 2 * scale_bytes);
    float *acc = (float *)(gp + gb);
    /* Software prefetch of the next panel during the tiled product's row blocks (m > the
     * GEMV's: there the compute phase is long enough to hide the next panel's read, which
     * would otherwise wait on memory in decode_group; the GEMV streams and prefetches
     * nothing, see the note above). */
    const int64_t next_lines = (packed_panel_bytes(qt, a->k, QR) + 63) / 64;
    const int64_t blocks = (m + MK_MR - 1) / MK_MR;
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *panel = panel_at(qt, a->w, p, a->k);
        const uint8_t *next = m > GEMV_ROWS && p + 1 < p1 ? panel_at(qt, a->w, p + 1, a->k) : NULL;
#ifdef QUANT_SCALAR
        memset(acc, 0, m * QR * sizeof(float)); /* its small m adds blocks of groups up */
#endif
        for (int64_t g0 = 0; g0 < G; g0 += gb) {
            const int64_t ng = G - g0 < gb ? G - g0 : gb;
            for (int64_t gl = 0; gl < ng; gl++) {
                uint8_t *at = tile + gl * GROUP_BYTES * TILE_SCALE;
#ifdef QUANT_SCALAR
                uint8_t chunks[GROUP_BYTES];
                k_major(at, decode_group(qt, panel, g0 + gl, chunks, D + gl * QR, M + gl * QR),
                        kind == KIND_S);
                gp[gl] = at;
#else
                gp[gl] = decode_group(qt, panel, g0 + gl, at, D + gl * QR, M + gl * QR);
#endif
            }
            for (int64_t i0 = 0; i0 < m; i0 += MK_MR) {
                const int mr = m - i0 < MK_MR ? (int)(m - i0) : MK_MR;
                pf_stream pf = prefetch_share(g0 + ng == G ? next : NULL, next_lines,
                                              i0 / MK_MR, blocks, ng);
#ifdef QUANT_SCALAR
                while (pf.left) prefetch_step(&pf); /* all at once: the generic set's */
                MK[kind][runi][mr - 1](acc + i0 * QR, gp, D, M, A, i0, g0, ng);
#else
                (qt == QT_I8 ? MK_CHAN : MK[kind][runi])[mr - 1](
                    acc + i0 * QR, gp, D, M, A->blk + ((i0 / MK_MR) * G + g0) * ACT_REC, ng, &pf);
#endif
            }
        }
        put_panel(a, p, acc, m);
    }
    return 0;
}

static int qlinear_panels(const qlinear_args *a, const acts *A, int64_t p0, int64_t p1) {
    switch (a->qtype) {
    case QT_Q4_0: return panels_of(QT_Q4_0, a, A, p0, p1);
    case QT_Q4_1: return panels_of(QT_Q4_1, a, A, p0, p1);
    case QT_Q5_0: return panels_of(QT_Q5_0, a, A, p0, p1);
    case QT_Q5_1: return panels_of(QT_Q5_1, a, A, p0, p1);
    case QT_Q8_0: return panels_of(QT_Q8_0, a, A, p0, p1);
    case QT_Q4_K: return panels_of(QT_Q4_K, a, A, p0, p1);
    case QT_Q5_K: return panels_of(QT_Q5_K, a, A, p0, p1);
    case QT_Q6_K: return panels_of(QT_Q6_K, a, A, p0, p1);
    default: return panels_of(QT_I8, a, A, p0, p1);
    }
}

static int qlinear_impl(const qlinear_args *a) {
    const int64_t G = (a->k + 31) / 32, kp = G * 32, m = a->m;
    /* the K-quants' activations: one scale per 256 (quant_kq.h; k is whole super-blocks) */
    const int kq = kq_is(a->qtype);
#ifdef QUANT_SCALAR
    const int blocked = 0;
    const size_t bytes = m * kp + 3 * m * G * sizeof(float);
#else
    const int blocked = m > GEMV_ROWS; /* the tiled product reads its rows blocked */
    const size_t bytes = !blocked ? m * kp + 3 * m * G * sizeof(float)
                         : kq     ? (size_t)((m + MK_MR - 1) / MK_MR) * (G / 8) * KREC
                                  : (size_t)((m + MK_MR - 1) / MK_MR) * G * ACT_REC;
#endif
    uint8_t *abuf = quant_scratch(0, bytes);
    if (!abuf) return -1;
    const float *scales = (const float *)(abuf + m * kp);
    /* one layout or the other: the rows (GEMV, the generic set) or the blocks (tiled);
     * K rows: da [m, G / 8], sg [m, G], sh [m, 2G] (fewer bytes than the groups' four) */
    const int16_t *ksums = (const int16_t *)(scales + m * (G / 8));
    const acts A = blocked ? (acts){.kp = kp, .groups = G, .blk = abuf}
                   : kq    ? (acts){.q = (const int8_t *)abuf, .da = scales, .sg = ksums,
                                    .sh = ksums + m * G, .kp = kp, .groups = G}
                           : (acts){
                                 .q = (const int8_t *)abuf, .da = scales,
                                 .dasa = scales + m * G,
                                 .nsa = (const int32_t *)(scales + 2 * m * G), .kp = kp,
                                 .groups = G,
                             };
    const int64_t panels = (a->n + QR - 1) / QR;
    int failed = 0;
#pragma omp parallel num_threads(a->threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) {
#ifndef QUANT_SCALAR
            if (blocked) {
                if (kq)
                    quantize_row_kblocked(a, abuf, G, i);
                else
                    quantize_row_blocked(a, abuf, G, i);
                continue;
            }
#endif
            if (kq)
                quantize_row_k(a, &A, i);
            else
                quantize_row(a, &A, i);
        }
        const int64_t nt = omp_get_num_threads();
        /* each thread its own run of panels (a half each on two cores), for the GEMV and
         * the tiled product alike: every panel's next is then the thread's own, asked for
         * while this one computes. Runs taken as threads came free (against a neighbour
         * taking a core) left each run's first panel unasked for: the demo's int8 layers
         * at 16 rows 1.35x slower, Qwen's Q4_K 1.05x (Zen 5). */
        const int64_t t = omp_get_thread_num();
        if (qlinear_panels(a, &A, panels * t / nt, panels * (t + 1) / nt)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}

#define QUANT_SET(sym, set_name)                                                           \
    static void pack_entry(int qt, uint8_t *dst, const uint8_t *src, const float *rs,      \
                           int64_t n, int64_t k, int threads) {                            \
        pack_impl(qt, dst, src, rs, n, k, threads);                                        \
    }                                                                                      \
    const quant_kernels sym = {set_name, QR, pack_entry, dequantize_impl, qlinear_impl};
