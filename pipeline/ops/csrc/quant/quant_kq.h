/* The K-quants' product (q4_k, q5_k, q6_k): sub-block scales applied in the integers.
 *
 * A super-block of 256 k holds 8 groups (q6_k: 16 halves) with integer scales sc_s and, for
 * q4_k / q5_k, integer mins mn_s; the activations are quantized per row and super-block
 * (quant_acts.h quantize_sb: one da per 256, as llama.cpp's Q8_K) with the int16 sums sg
 * per group and sh per half. A super-block then dots in integers, exactly,
 *
 *     q4_k / q5_k   S = sum_j sc_j (u_j . q_j)          O = sum_j mn_j sg_j
 *                   y += da * (d * S) + da * (-dmin * O)
 *     q6_k          S = sum_h sc_h (u_h . q_h) - 32 sum_h sc_h sh_h
 *                   y += da * (d * S)
 *
 * so a row's float work is one or two conversions and fused adds per 256 k, where the
 * group-of-32 scheme of quant_gemm.h has one per 32 (a quarter of the tiled q4_k kernel's
 * time on Zen 3). Ranges: a maddubs run is at most 8 x 2 x 15 x 127 (q4_k), 4 x 2 x 31 x 127
 * (q5_k) or 2 x 2 x 63 x 127 (q6_k) < 32768; |S| < 2^29 and |O| < 2^22 in int32; S is
 * rounded once to float32 (|S| may pass 2^24), O converts exactly.
 *
 * How the scales meet the sums: on the maddubs sets the widening madd that sums a run's
 * int16 pairs multiplies by a vector whose two int16 halves of each row's lane both hold
 * sc (kq_dup), so the scale costs nothing; on the VNNI set vpdpbusd sums into int32 and a
 * vpmulld applies it once per group (q6_k: per half), except for q4_k, whose half-group
 * sums fit int16 (16 x 15 x 127) and take their scale in one vpdpwssd each (a.lo16 x sc,
 * the high halves 0 x 0): one uop and no separate add where vpmulld is two and an add; on
 * 2026-12-06's Intel Xeon the tiled q4_k product went from 268-327 to 301-383 GOP/s a
 * core. The tiled VNNI kernel also runs two groups' chunks interleaved (kq_group2), twice
 * the independent chains. The offsets O (and q6_k's 32 sum sc sh) take one madd
 * per two sub-blocks: (mn_2i, mn_2i+1) per lane against the row's (sg_2i, sg_2i+1).
 *
 * Included by quant_gemm.h after its GEMV (gemv_chunk) on the vector sets; the generic set
 * (QUANT_SCALAR) does the same integers in plain C over its k-major tiles.
 */

static inline int kq_is(int qt) { return qt == QT_Q4_K || qt == QT_Q5_K || qt == QT_Q6_K; }

#ifndef QUANT_SCALAR
#ifndef VI_PIN
#define VI_PIN(v) ((void)0)
#endif

/* int16 x in both halves of each int32 lane (the maddubs sets' madd), or x itself */
static inline vi kq_dup(vi x) {
#ifdef DOT_MADDUBS
    return VI_OR(VI_AND(x, VI_SET1_32(0xffff)), VI_SLLI32(x, 16));
#else
    return x;
#endif
}

/* Sub-block scale s of a record (q4_k / q5_k: group s; q6_k: half s) as kq_group takes it. */
static inline __attribute__((always_inline)) vi kq_scale(const int qt, const uint8_t *rec,
                                                        int s) {
    return kq_dup(qt == QT_Q6_K ? VI_CVTS8_32(rec + 2 * QR + s * QR)
                                : VI_CVTU8_32(rec + 4 * QR + s * QR));
}

/* Offset pair i: (mn_2i, mn_2i+1) (q6_k: (sc_2i, sc_2i+1)) as int16 halves of each lane. */
static inline __attribute__((always_inline)) vi kq_pair(const int qt, const uint8_t *rec, int i) {
    const uint8_t *v = qt == QT_Q6_K ? rec + 2 * QR : rec + 12 * QR;
    const vi lo = qt == QT_Q6_K ? VI_CVTS8_32(v + 2 * i * QR) : VI_CVTU8_32(v + 2 * i * QR);
    const vi hi = qt == QT_Q6_K ? VI_CVTS8_32(v + (2 * i + 1) * QR)
                                : VI_CVTU8_32(v + (2 * i + 1) * QR);
    return VI_OR(VI_AND(lo, VI_SET1_32(0xffff)), VI_SLLI32(hi, 16));
}

/* One super-block's scales as the tiled product reads them, made once per panel. */
typedef struct {
    vi sc[16], off[8];
    float d[QR], m[QR]; /* d, -dmin */
} kq_scales;

static inline __attribute__((always_inline)) void kq_fill(const int qt, const uint8_t *rec,
                                                         kq_scales *ks) {
    const int nsc = qt == QT_Q6_K ? 16 : 8;
    for (int s = 0; s < nsc; s++) ks->sc[s] = kq_scale(qt, rec, s);
    for (int i = 0; i < nsc / 2; i++) ks->off[i] = kq_pair(qt, rec, i);
    VF_STORE(ks->d, VF_H2F(rec));
    if (qt != QT_Q6_K) VF_STORE(ks->m, VF_NEG(VF_H2F(rec + 2 * QR)));
}

/* Group j's 8 chunks against mr rows into S: from the tile (tiled: w) or decoded in
 * registers (gemv_chunk of nv, hv). q: row 0's 32 values of the group, rows qs bytes apart;
 * sc: the group's scale vector(s) (q6_k: one per half). */
static inline __attribute__((always_inline)) void kq_group(
    const int qt, const int mr, vi *S, const int tiled, const uint8_t *w, const vi *nv,
    const vi *hv, const uint8_t *q, const int64_t qs, const vi *sc) {
#ifdef DOT_MADDUBS
    const int run = qt == QT_Q4_K ? 8 : qt == QT_Q5_K ? 4 : 2;
#else
    const int run = qt == QT_Q6_K ? 4 : 8;
#endif
    vi t[MK_MR > GEMV_ROWS ? MK_MR : GEMV_ROWS];
    UNROLL for (int c = 0; c < 8; c++) {
        const vi wv = tiled ? VI_LOAD(w + c * CV) : gemv_chunk(qt, nv, hv, c);
        const vi s = sc[qt == QT_Q6_K ? c >> 2 : 0];
        UNROLL for (int r = 0; r < mr; r++) {
            const vi a = VI_BCAST32(q + r * qs + c * 4);
#ifdef DOT_MADDUBS
            const vi p = VI_MADDUBS(wv, a);
            t[r] = c % run == 0 ? p : VI_ADD16(t[r], p);
            VI_PIN(t[r]);
            if (c % run == run - 1) {
                S[r] = VI_ADD32(S[r], VI_MADD16(t[r], s));
                VI_PIN(S[r]);
            }
#else
            t[r] = DOT_U(c % run == 0 ? VI_ZERO() : t[r], wv, a);
            if (c % run == run - 1) S[r] = VI_ADD32(S[r], VI_MULLO32(t[r], s));
#endif
        }
    }
}

/* A super-block's end for mr rows: the offsets, then the float step. sg / sh: row 0's
 * int16 sums of the super-block, rows sgs / shs values apart; da: row 0's scale, das apart. */
static inline __attribute__((always_inline)) void kq_finish(
    const int qt, const int mr, vf *f, vi *S, const vi *off, const vf d, const vf m,
    const int16_t *sg, const int64_t sgs, const int16_t *sh, const int64_t shs,
    const float *da, const int64_t das) {
    UNROLL for (int r = 0; r < mr; r++) {
        const vf dar = VF_SET1(da[r * das]);
        if (qt == QT_Q6_K) {
            const int16_t *h = sh + r * shs;
            vi o = VI_MADD16(off[0], VI_BCAST32(h));
            UNROLL for (int i = 1; i < 8; i++) o = VI_ADD32(o, VI_MADD16(off[i], VI_BCAST32(h + 2 * i)));
            const vi s = VI_SUB32(S[r], VI_SLLI32(o, 5));
            f[r] = VF_FMA(VF_CVT(s), VF_MUL(d, dar), f[r]);
        } else {
            const int16_t *g = sg + r * sgs;
            vi o = VI_MADD16(off[0], VI_BCAST32(g));
            UNROLL for (int i = 1; i < 4; i++) o = VI_ADD32(o, VI_MADD16(off[i], VI_BCAST32(g + 2 * i)));
            f[r] = VF_FMA(VF_CVT(S[r]), VF_MUL(d, dar), f[r]);
            f[r] = VF_FMA(VF_CVT(o), VF_MUL(m, dar), f[r]);
        }
    }
}

/* The GEMV asks for the record KQ_GEMV_AHEAD super-blocks ahead, a share of its lines per
 * group, and for the lines GEMV_FAR_BYTES ahead the same way (quant_gemm.h's NOTE), both
 * with prefetchnta. Measured (Zen 5, `bench qgemm --rows 1`, 8192 x 2048 and 2048 x 8192),
 * the near one alone, with prefetcht0: one thread q4_k 23 -> 37 GB/s on the VNNI set, two
 * threads q4_k 39-41 -> 43-46 and q6_k 36-39 -> 42-46 (the avx2 set's q4_k 39-41 -> 45-56);
 * 1 and 3 ahead were slower than 2. Without it the VNNI GEMV stalled on each new line of
 * the panel: the hardware prefetcher alone kept one thread at half the read bandwidth (and
 * the far one alone, without it, was 5-17% slower than both). Two groups' chunks
 * interleaved (two vpdpbusd chains, as kq_group2) gave nothing on top. */
#define KQ_GEMV_AHEAD 2

/* The GEMV (m <= GEMV_ROWS): each group's packed vectors loaded once and decoded in
 * registers, the scales made in registers from the record, nothing but the weights and the
 * activations read. The integers and the float step are the tiled product's, in its order. */
static inline __attribute__((always_inline)) void gemv_kq(
    const int qt, const int mr, const qlinear_args *a, const acts *A, int64_t p0, int64_t p1) {
    const int64_t G = A->groups, SB = G / 8;
    const int64_t rb = ROW_BLOCK_BYTES[qt] * QR, lines = (rb + 63) / 64; /* a record */
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *panel = panel_at(qt, a->w, p, a->k);
        vf f[GEMV_ROWS];
        UNROLL for (int r = 0; r < mr; r++) f[r] = VF_SET1(0.0f);
        for (int64_t b = 0; b < SB; b++) {
            const uint8_t *rec = record_at(qt, panel, b);
            vi S[GEMV_ROWS];
            UNROLL for (int r = 0; r < mr; r++) S[r] = VI_ZERO();
            const uint8_t *ahead = rec + KQ_GEMV_AHEAD * rb;
            UNROLL for (int gi = 0; gi < 8; gi++) {
                for (int64_t l = gi * lines / 8; l < (gi + 1) * lines / 8; l++) {
                    __builtin_prefetch(ahead + l * 64, 0, 0); /* prefetchnta */
                    __builtin_prefetch(rec + GEMV_FAR_BYTES + l * 64, 0, 0);
                }
                const uint8_t *nib = rec + kq_group_offset(qt, gi);
                vi nv[4], hv[2], sc[2];
                UNROLL for (int v = 0; v < 4; v++) nv[v] = VI_LOAD(nib + v * CV);
                if (qt != QT_Q4_K) hv[0] = VI_LOAD(nib + 4 * CV);
                if (qt == QT_Q6_K) {
                    hv[1] = VI_LOAD(nib + 5 * CV);
                    sc[0] = kq_scale(qt, rec, 2 * gi);
                    sc[1] = kq_scale(qt, rec, 2 * gi + 1);
                } else {
                    sc[0] = kq_scale(qt, rec, gi);
                }
                kq_group(qt, mr, S, 0, NULL, nv, hv, (const uint8_t *)(A->q + (8 * b + gi) * 32),
                         A->kp, sc);
            }
            vi off[8];
            UNROLL for (int i = 0; i < 8; i++)
                if (i < 4 || qt == QT_Q6_K) off[i] = kq_pair(qt, rec, i);
            const vf d = VF_H2F(rec);
            const vf m = qt == QT_Q6_K ? d : VF_NEG(VF_H2F(rec + 2 * QR));
            kq_finish(qt, mr, f, S, off, d, m, A->sg + 8 * b, G, A->sh + 16 * b, 2 * G,
                      A->da + b, SB);
        }
        float acc[GEMV_ROWS * QR];
        UNROLL for (int r = 0; r < mr; r++) VF_STORE(acc + r * QR, f[r]);
        put_panel(a, p, acc, mr);
    }
}

#ifndef DOT_MADDUBS
/* Where the tiled VNNI product reads q4_k's weights: the panel's packed nibbles themselves,
 * decoded in registers as each chunk is loaded (an and, and a shift for the high nibbles;
 * these take other ports than vpdpbusd's), with no tile written and read back. The tile
 * cost the tiled q4_k product about a fifth of its time at 16 rows (`perf`, 8192 x 2048:
 * the decoding loop 19% of the kernel's samples, mostly the panel's first reads). Measured
 * against the tile (Zen 5, `bench qgemm-ab`, 2 threads, Llama-1B's 8192 x 2048 and
 * 2048 x 8192): 1.24-1.34x at 8 rows, 1.13-1.19x at 16, 1.06-1.15x at 32, 1.03x at 128.
 * q5_k and q6_k decoded the same way (kq_packed_chunk takes them) gained 2-10% at 16 rows
 * but lost 5-13% at 64, where their 3-4 more operations a chunk are repeated for each
 * block of rows: they keep the tile. */
#define KQ_PACKED(qt) ((qt) == QT_Q4_K)

/* Chunk c of a group from its packed vectors grp (gemv_chunk's decoding, each vector
 * loaded as the chunk needs it). */
static inline __attribute__((always_inline)) vi kq_packed_chunk(const int qt, const uint8_t *grp,
                                                               const int c) {
    vi nv[4], hv[2];
    nv[c & 3] = VI_LOAD(grp + (c & 3) * CV);
    if (qt == QT_Q5_K) hv[0] = VI_LOAD(grp + 4 * CV);
    if (qt == QT_Q6_K) hv[c >> 2] = VI_LOAD(grp + (4 + (c >> 2)) * CV);
    return gemv_chunk(qt, nv, hv, c);
}

/* Groups j and j + 1 of a super-block against mr rows into S, their chunks interleaved:
 * twice the independent vpdpbusd chains of one group at a time (a chain is a group's run
 * of chunks for one row, each link waiting out the instruction's latency). w: group j's
 * decoded tile, or (KQ_PACKED) its 4 nibble vectors, group j + 1's following them. */
static inline __attribute__((always_inline)) void kq_group2(
    const int qt, const int mr, vi *S, const uint8_t *w, const uint8_t *q, const vi *sc) {
    /* q4_k: half groups, each sum within int16 (16 x 15 x 127), scaled by one vpdpwssd */
    const int run = qt == QT_Q6_K || qt == QT_Q4_K ? 4 : 8;
    vi t[2][MK_MR];
    UNROLL for (int c = 0; c < 8; c++) {
        UNROLL for (int g = 0; g < 2; g++) {
            vi wv;
            if (KQ_PACKED(qt)) {
                wv = kq_packed_chunk(qt, w + g * kq_group_stride(qt), c);
            } else {
                wv = VI_LOAD(w + g * GROUP_BYTES + c * CV);
            }
            UNROLL for (int r = 0; r < mr; r++) {
                const vi a = VI_BCAST32(q + g * MK_MR * 32 + r * 32 + c * 4);
                t[g][r] = DOT_U(c % run == 0 ? VI_ZERO() : t[g][r], wv, a);
            }
        }
        if (c % run == run - 1)
            UNROLL for (int g = 0; g < 2; g++) {
                const vi s = qt == QT_Q6_K ? sc[2 * g + (c >> 2)] : sc[g];
                UNROLL for (int r = 0; r < mr; r++)
                    S[r] = qt == QT_Q4_K ? VI_DPWSSD(S[r], t[g][r], s)
                                         : VI_ADD32(S[r], VI_MULLO32(t[g][r], s));
            }
    }
}
#else
#define KQ_PACKED(qt) 0 /* the maddubs sets decode every type into the tile */
#endif

/* The tiled micro-kernel: mr rows x QR outputs over nsb super-blocks. tile: the decoded
 * tile, or (KQ_PACKED) the panel's first record's nibbles. ab: the rows' block of K records
 * (quant_acts.h KREC) from the first super-block on. */
static inline __attribute__((always_inline)) void mkq_body(
    const int mr, const int qt, float *acc, const uint8_t *tile, const kq_scales *ks,
    const uint8_t *ab, int64_t nsb, pf_stream *pf) {
    const int64_t step = KQ_PACKED(qt) ? ROW_BLOCK_BYTES[qt] * QR : 8 * GROUP_BYTES;
    /* the float sums wait in the acc rows between super-blocks: the registers hold the
     * integer chains (on AVX2's 16 the rows' floats would take four of them) */
    for (int64_t b = 0; b < nsb; b++, ab += KREC, ks++, tile += step) {
        if (pf->left) prefetch_step(pf);
        vi S[MK_MR];
        UNROLL for (int r = 0; r < mr; r++) S[r] = VI_ZERO();
#ifndef DOT_MADDUBS
        const int64_t group = KQ_PACKED(qt) ? kq_group_stride(qt) : GROUP_BYTES;
        for (int j = 0; j < 8; j += 2)
            kq_group2(qt, mr, S, tile + j * group, ab + j * MK_MR * 32,
                      ks->sc + (qt == QT_Q6_K ? 2 * j : j));
#else
        for (int j = 0; j < 8; j++)
            kq_group(qt, mr, S, 1, tile + j * GROUP_BYTES, NULL, NULL, ab + j * MK_MR * 32, 32,
                     ks->sc + (qt == QT_Q6_K ? 2 * j : j));
#endif
        vf f[MK_MR];
        UNROLL for (int r = 0; r < mr; r++) f[r] = VF_LOAD(acc + r * QR);
        kq_finish(qt, mr, f, S, ks->off, VF_LOAD(ks->d), VF_LOAD(qt == QT_Q6_K ? ks->d : ks->m),
                  (const int16_t *)(ab + KREC_SG), 8, (const int16_t *)(ab + KREC_SH), 16,
                  (const float *)(ab + KREC_DA), 1);
        UNROLL for (int r = 0; r < mr; r++) VF_STORE(acc + r * QR, f[r]);
    }
}

typedef void (*mkq_fn)(float *, const uint8_t *, const kq_scales *, const uint8_t *, int64_t,
                       pf_stream *);
#define MKQ_DEF(MR, QT)                                                                    \
    static void mkq_##QT##_##MR(float *acc, const uint8_t *tile, const kq_scales *ks,       \
                                const uint8_t *ab, int64_t nsb, pf_stream *pf) {            \
        mkq_body(MR <= MK_MR ? MR : MK_MR, QT, acc, tile, ks, ab, nsb, pf);                 \
    }
#define MKQ_DEFS(QT) MKQ_DEF(1, QT) MKQ_DEF(2, QT) MKQ_DEF(3, QT) MKQ_DEF(4, QT)           \
    MKQ_DEF(5, QT) MKQ_DEF(6, QT) MKQ_DEF(7, QT) MKQ_DEF(8, QT)
#define MKQ_ROW(QT)                                                                        \
    {mkq_##QT##_1, mkq_##QT##_2, mkq_##QT##_3, mkq_##QT##_4,                               \
     mkq_##QT##_5, mkq_##QT##_6, mkq_##QT##_7, mkq_##QT##_8}
MKQ_DEFS(QT_Q4_K)
MKQ_DEFS(QT_Q5_K)
MKQ_DEFS(QT_Q6_K)
/* [qt - QT_Q4_K][rows - 1] */
static const mkq_fn MKQ[3][8] = {MKQ_ROW(QT_Q4_K), MKQ_ROW(QT_Q5_K), MKQ_ROW(QT_Q6_K)};
#endif /* !QUANT_SCALAR */

/* Panels p0 .. p1-1 of a K-quant for one thread. */
static inline __attribute__((always_inline)) int panels_kq(
    const int qt, const qlinear_args *a, const acts *A, int64_t p0, int64_t p1) {
    const int64_t G = A->groups, SB = G / 8, m = a->m;
#ifndef QUANT_SCALAR
    switch (m) {
    case 1: gemv_kq(qt, 1, a, A, p0, p1); return 0;
    case 2: gemv_kq(qt, 2, a, A, p0, p1); return 0;
    case 3: gemv_kq(qt, 3, a, A, p0, p1); return 0;
    case 4: gemv_kq(qt, 4, a, A, p0, p1); return 0;
    }
    const int packed = KQ_PACKED(qt);
    const size_t tile_bytes = packed ? 0 : SB * 8 * GROUP_BYTES;
    uint8_t *buf = quant_scratch(1, tile_bytes + SB * sizeof(kq_scales) + m * QR * sizeof(float));
    if (!buf) return -1;
    uint8_t *tile = buf;
    kq_scales *ks = (kq_scales *)(buf + tile_bytes); /* GROUP_BYTES keeps it vector-aligned */
    float *acc = (float *)(ks + SB);
    float Dd[2 * QR], Md[2 * QR]; /* decode_group's float scales, not used here */
    /* the next panel's lines spread over the row blocks, as panels_of does */
    const int64_t next_lines = (packed_panel_bytes(qt, a->k, QR) + 63) / 64;
    const int64_t blocks = (m + MK_MR - 1) / MK_MR;
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *panel = panel_at(qt, a->w, p, a->k);
        const uint8_t *next = p + 1 < p1 ? panel_at(qt, a->w, p + 1, a->k) : NULL;
        memset(acc, 0, m * QR * sizeof(float));
        for (int64_t b = 0; b < SB; b++) {
            kq_fill(qt, record_at(qt, panel, b), ks + b);
            for (int gi = 0; gi < 8 && !packed; gi++)
                decode_group(qt, panel, 8 * b + gi, tile + (8 * b + gi) * GROUP_BYTES, Dd, Md);
        }
        const uint8_t *w = packed ? record_at(qt, panel, 0) + kq_group_offset(qt, 0) : tile;
        for (int64_t i0 = 0; i0 < m; i0 += MK_MR) {
            const int mr = m - i0 < MK_MR ? (int)(m - i0) : MK_MR;
            pf_stream pf = prefetch_share(next, next_lines, i0 / MK_MR, blocks, SB);
            MKQ[qt - QT_Q4_K][mr - 1](acc + i0 * QR, w, ks, A->blk + (i0 / MK_MR) * SB * KREC, SB,
                                      &pf);
        }
#else
    /* generic: super-blocks decoded into k-major int16 tiles (k_major), the same integers */
    uint8_t *buf = quant_scratch(1, 8 * GROUP_BYTES * TILE_SCALE + m * QR * sizeof(float));
    if (!buf) return -1;
    int16_t *tile = (int16_t *)buf;
    float *acc = (float *)(buf + 8 * GROUP_BYTES * TILE_SCALE);
    float Dd[2 * QR], Md[2 * QR];
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *panel = panel_at(qt, a->w, p, a->k);
        memset(acc, 0, m * QR * sizeof(float));
        for (int64_t b = 0; b < SB; b++) {
            const uint8_t *rec = record_at(qt, panel, b);
            for (int gi = 0; gi < 8; gi++) {
                uint8_t chunks[GROUP_BYTES];
                k_major((uint8_t *)(tile + gi * 32 * QR),
                        decode_group(qt, panel, 8 * b + gi, chunks, Dd, Md), 0);
            }
            float d[QR], nm[QR];
            int32_t sc[16][QR], mn[8][QR];
            h2f_row(d, rec);
            if (qt == QT_Q6_K) {
                for (int s = 0; s < 16; s++)
                    for (int j = 0; j < QR; j++) sc[s][j] = (int8_t)rec[2 * QR + s * QR + j];
            } else {
                h2f_row(nm, rec + 2 * QR);
                for (int j = 0; j < QR; j++) nm[j] = -nm[j];
                for (int s = 0; s < 8; s++)
                    for (int j = 0; j < QR; j++) {
                        sc[s][j] = rec[4 * QR + s * QR + j];
                        mn[s][j] = rec[12 * QR + s * QR + j];
                    }
            }
            for (int64_t i = 0; i < m; i++) {
                const int8_t *q = A->q + i * A->kp + b * 256;
                const int16_t *sg = A->sg + i * G + 8 * b, *sh = A->sh + i * 2 * G + 16 * b;
                const float da = A->da[i * SB + b];
                int32_t S[QR], O[QR];
                for (int j = 0; j < QR; j++) S[j] = O[j] = 0;
                for (int gi = 0; gi < 8; gi++) {
                    const int16_t *w = tile + gi * 32 * QR;
                    int32_t h0[QR], h1[QR];
                    for (int j = 0; j < QR; j++) h0[j] = h1[j] = 0;
                    for (int kk = 0; kk < 16; kk++)
                        for (int j = 0; j < QR; j++) h0[j] += w[kk * QR + j] * q[gi * 32 + kk];
                    for (int kk = 16; kk < 32; kk++)
                        for (int j = 0; j < QR; j++) h1[j] += w[kk * QR + j] * q[gi * 32 + kk];
                    for (int j = 0; j < QR; j++) {
                        if (qt == QT_Q6_K) {
                            S[j] += sc[2 * gi][j] * h0[j] + sc[2 * gi + 1][j] * h1[j];
                            O[j] += sc[2 * gi][j] * sh[2 * gi] + sc[2 * gi + 1][j] * sh[2 * gi + 1];
                        } else {
                            S[j] += sc[gi][j] * (h0[j] + h1[j]);
                            O[j] += mn[gi][j] * sg[gi];
                        }
                    }
                }
                float *f = acc + i * QR;
                for (int j = 0; j < QR; j++) {
                    if (qt == QT_Q6_K) {
                        f[j] += (float)(S[j] - 32 * O[j]) * (d[j] * da);
                    } else {
                        f[j] += (float)S[j] * (d[j] * da);
                        f[j] += (float)O[j] * (nm[j] * da);
                    }
                }
            }
        }
#endif
        put_panel(a, p, acc, m);
    }
    return 0;
}
