/* The layout of quant.h for one panel height QR: repacking GGUF blocks into it (pack),
 * decoding one group of a panel into the integer tile the dot products read, and the
 * bit-exact dequantization. Plain C with fixed trip counts, included by every set's file
 * after its vector layer (QR, h2f_row): compiled under the set's `#pragma GCC target`, GCC
 * vectorizes the byte loops itself. The vector layer gives h2f_row, u8_to_float_row and
 * s8_to_float_row: QR halves / bytes to floats (exact conversions all).
 *
 * A decoded group is the 8 chunks of 32 k x QR rows (8 CV bytes, CV = 4 QR), unsigned
 * (u = 0..63) for the 4/5/6-bit types, signed for q8_0 / i8, with D and M as float32
 * vectors of QR rows (q6_k: two of each, one per half of 16 k).
 */
#include <string.h>

#ifndef FLIP8
#define FLIP8 0 /* 8-bit weights stored as they are; the VNNI set stores w ^ 0x80 */
#endif

#define CV (4 * QR)
#define GROUP_BYTES (8 * CV)

static inline const uint8_t *panel_at(int qt, const uint8_t *w, int64_t p, int64_t k) {
    return w + p * packed_panel_bytes(qt, k, QR);
}

static const int ROW_BLOCK_BYTES[NUM_QT] = {18, 20, 22, 24, 34, 148, 180, 210, 32, 64};

/* QTYPES' record size as a constant where qt is one (the kernels' inlined decoders). */
static inline __attribute__((always_inline)) const uint8_t *record_at(
    const int qt, const uint8_t *panel, int64_t block) {
    return panel + ((qt == QT_I8 ? 4 : 0) + block * ROW_BLOCK_BYTES[qt]) * QR;
}

/* A K-quant record's group gi (32 k): its 4 nibble vectors, then q5_k's 5th-bit plane or
 * q6_k's two 5th-6th-bit planes, after the record's scales (q4_k / q5_k: d, dmin, 8 scales
 * and 8 mins, 20 QR bytes; q6_k: d and 16 scales, 18 QR). */
static inline __attribute__((always_inline)) int64_t kq_group_stride(const int qt) {
    return (qt == QT_Q6_K ? 6 : qt == QT_Q5_K ? 5 : 4) * CV;
}

static inline __attribute__((always_inline)) int64_t kq_group_offset(const int qt, int64_t gi) {
    return (qt == QT_Q6_K ? 18 : 20) * QR + gi * kq_group_stride(qt);
}

/* ---- decoding -------------------------------------------------------------------- */

static inline void unpack_nibbles(uint8_t *restrict t, const uint8_t *restrict nib) {
    for (int v = 0; v < 4; v++)
        for (int j = 0; j < CV; j++) {
            t[v * CV + j] = nib[v * CV + j] & 15;
            t[(v + 4) * CV + j] = nib[v * CV + j] >> 4;
        }
}

static inline void add_hi1(uint8_t *restrict t, const uint8_t *restrict hb) {
    for (int c = 0; c < 8; c++)
        for (int j = 0; j < CV; j++) t[c * CV + j] |= ((hb[j] >> c) & 1) << 4;
}

static inline void add_hi2(uint8_t *restrict t, const uint8_t *restrict hb) {
    for (int c = 0; c < 8; c++)
        for (int j = 0; j < CV; j++)
            t[c * CV + j] |= ((hb[(c >> 2) * CV + j] >> (2 * (c & 3))) & 3) << 4;
}

/* D = d * sc, M = -(dmin * mn): gguf's d * q - dm, exactly (a - b == a + -b). */
static inline void kquant_scales(float *restrict D, float *restrict M, const uint8_t *rec,
                                 int gi) {
    float d[QR], dmin[QR];
    h2f_row(d, rec);
    h2f_row(dmin, rec + 2 * QR);
    float sc[QR], mn[QR];
    u8_to_float_row(sc, rec + 4 * QR + gi * QR);
    u8_to_float_row(mn, rec + 12 * QR + gi * QR);
    for (int i = 0; i < QR; i++) {
        D[i] = d[i] * sc[i];
        M[i] = -(dmin[i] * mn[i]);
    }
}

/* Group g of a panel: its weights as a tile (into t, or the packed bytes themselves for the
 * 8-bit types, whose chunks are stored as they are read), D and M (QR floats each; q6_k:
 * 2 QR, one vector per half). */
static inline __attribute__((always_inline)) const uint8_t *decode_group(
    const int qt, const uint8_t *panel, int64_t g, uint8_t *restrict t, float *restrict D,
    float *restrict M) {
    /* always inlined into callers that fix qt: the switch and the divisions fold away */
    const int kquant = qt == QT_Q4_K || qt == QT_Q5_K || qt == QT_Q6_K;
    const uint8_t *rec = record_at(qt, panel, kquant ? g >> 3 : g);
    const int gi = kquant ? (int)(g & 7) : 0;
    switch (qt) {
    case QT_Q4_0:
    case QT_Q5_0: {
        const float off = qt == QT_Q4_0 ? -8.0f : -16.0f;
        h2f_row(D, rec);
        for (int i = 0; i < QR; i++) M[i] = off * D[i];
        unpack_nibbles(t, rec + 2 * QR + (qt == QT_Q5_0) * CV);
        if (qt == QT_Q5_0) add_hi1(t, rec + 2 * QR);
        return t;
    }
    case QT_Q4_1:
    case QT_Q5_1:
        h2f_row(D, rec);
        h2f_row(M, rec + 2 * QR);
        unpack_nibbles(t, rec + 4 * QR + (qt == QT_Q5_1) * CV);
        if (qt == QT_Q5_1) add_hi1(t, rec + 4 * QR);
        return t;
    case QT_Q8_0:
        h2f_row(D, rec);
        return rec + 2 * QR;
    case QT_I8:
        memcpy(D, panel, QR * sizeof(float));
        return rec;
    case QT_Q4_K:
        kquant_scales(D, M, rec, gi);
        unpack_nibbles(t, rec + kq_group_offset(qt, gi));
        return t;
    case QT_Q5_K: {
        kquant_scales(D, M, rec, gi);
        const uint8_t *grp = rec + kq_group_offset(qt, gi);
        unpack_nibbles(t, grp);
        add_hi1(t, grp + 4 * CV);
        return t;
    }
    default: { /* QT_Q6_K */
        float d[QR], sc[2 * QR];
        h2f_row(d, rec);
        s8_to_float_row(sc, rec + 2 * QR + 2 * gi * QR);
        s8_to_float_row(sc + QR, rec + 2 * QR + (2 * gi + 1) * QR);
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < QR; i++) D[h * QR + i] = d[i] * sc[h * QR + i];
        for (int i = 0; i < 2 * QR; i++) M[i] = -32.0f * D[i];
        const uint8_t *grp = rec + kq_group_offset(qt, gi);
        unpack_nibbles(t, grp);
        add_hi2(t, grp + 4 * CV);
        return t;
    }
    }
}

/* ---- dequantization -------------------------------------------------------------- */

/* One decoded value of row r, k kk of the group, in gguf's float32 arithmetic. */
static inline float dequant_value(int qt, const uint8_t *t, const float *D, const float *M,
                                  int r, int kk) {
    const uint8_t u = t[(kk >> 2) * CV + r * 4 + (kk & 3)];
    switch (qt) {
    case QT_Q4_0: return D[r] * (float)((int)u - 8);
    case QT_Q5_0: return D[r] * (float)((int)u - 16);
    case QT_Q8_0:
    case QT_I8: return (float)(int8_t)(u ^ FLIP8) * D[r];
    case QT_Q6_K: {
        const int h = kk >> 4;
        return D[h * QR + r] * (float)((int)u - 32);
    }
    default: return D[r] * (float)u + M[r];
    }
}

static void dequantize_impl(int qt, float *out, const uint8_t *w, int64_t n, int64_t k,
                            int threads) {
    const int64_t panels = (n + QR - 1) / QR, groups = (k + 31) / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        uint8_t t[GROUP_BYTES];
        float D[2 * QR], M[2 * QR];
        const uint8_t *panel = panel_at(qt, w, p, k);
        const int rows = n - p * QR < QR ? (int)(n - p * QR) : QR;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *tile = decode_group(qt, panel, g, t, D, M);
            const int valid = k - g * 32 < 32 ? (int)(k - g * 32) : 32; /* i8's last group */
            for (int r = 0; r < rows; r++) {
                float *o = out + (p * QR + r) * k + g * 32;
                for (int kk = 0; kk < valid; kk++) o[kk] = dequant_value(qt, tile, D, M, r, kk);
            }
        }
    }
}

/* ---- repacking ------------------------------------------------------------------- */

/* Where value kk (0..31) of row r of a group goes. */
#define CHUNK_BYTE(r, kk) ((r) * 4 + ((kk) & 3))

static inline void put_nib(uint8_t *nib, int r, int kk, int u) {
    const int c = kk >> 2;
    nib[(c & 3) * CV + CHUNK_BYTE(r, kk)] |= (uint8_t)((u & 15) << (4 * (c >> 2)));
}

static inline void put_hi1(uint8_t *hb, int r, int kk, int u) {
    hb[CHUNK_BYTE(r, kk)] |= (uint8_t)(((u >> 4) & 1) << (kk >> 2));
}

static inline void put_hi2(uint8_t *hb, int r, int kk, int u) {
    const int c = kk >> 2;
    hb[(c >> 2) * CV + CHUNK_BYTE(r, kk)] |= (uint8_t)(((u >> 4) & 3) << (2 * (c & 3)));
}

/* 8-bit weights (FLIP8: as w + 128, see quant_gemm.h). */
static inline void put_raw(uint8_t *raw, int r, int kk, int v) {
    raw[(kk >> 2) * CV + CHUNK_BYTE(r, kk)] = (uint8_t)(v ^ FLIP8);
}

static inline void put_half(uint8_t *dst, int r, const uint8_t *src) {
    dst[2 * r] = src[0];
    dst[2 * r + 1] = src[1];
}

/* Q4_K / Q5_K's 12 bytes of 6-bit scales and mins (the order gguf's get_scale_min reads). */
static inline void kquant_unpack_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

/* One GGUF block (s) of row r into its record (rec). */
static void pack_block(int qt, uint8_t *rec, const uint8_t *s, int r) {
    switch (qt) {
    case QT_Q4_0:
    case QT_Q4_1: {
        const int scales = qt == QT_Q4_0 ? 1 : 2;
        for (int i = 0; i < scales; i++) put_half(rec + 2 * QR * i, r, s + 2 * i);
        const uint8_t *qs = s + 2 * scales;
        for (int i = 0; i < 32; i++)
            put_nib(rec + 2 * QR * scales, r, i, i < 16 ? qs[i] & 15 : qs[i - 16] >> 4);
        return;
    }
    case QT_Q5_0:
    case QT_Q5_1: {
        const int scales = qt == QT_Q5_0 ? 1 : 2;
        for (int i = 0; i < scales; i++) put_half(rec + 2 * QR * i, r, s + 2 * i);
        const uint8_t *qh = s + 2 * scales, *qs = qh + 4;
        const uint32_t bits = qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 |
                              (uint32_t)qh[3] << 24;
        uint8_t *hb = rec + 2 * QR * scales;
        for (int i = 0; i < 32; i++) {
            const int u = (i < 16 ? qs[i] & 15 : qs[i - 16] >> 4) | ((bits >> i) & 1) << 4;
            put_nib(hb + CV, r, i, u);
            put_hi1(hb, r, i, u);
        }
        return;
    }
    case QT_Q8_0:
        put_half(rec, r, s);
        for (int i = 0; i < 32; i++) put_raw(rec + 2 * QR, r, i, s[2 + i]);
        return;
    case QT_Q4_K:
    case QT_Q5_K: {
        const int five = qt == QT_Q5_K;
        uint8_t sc[8], mn[8];
        put_half(rec, r, s);
        put_half(rec + 2 * QR, r, s + 2);
        kquant_unpack_scales(s + 4, sc, mn);
        const uint8_t *qh = s + 16, *qs = s + 16 + 32 * five;
        for (int g = 0; g < 8; g++) {
            rec[4 * QR + g * QR + r] = sc[g];
            rec[12 * QR + g * QR + r] = mn[g];
            uint8_t *grp = rec + kq_group_offset(qt, g);
            for (int i = 0; i < 32; i++) {
                int u = (qs[(g / 2) * 32 + i] >> (4 * (g & 1))) & 15;
                if (five) u |= ((qh[i] >> g) & 1) << 4;
                put_nib(grp, r, i, u);
                if (five) put_hi1(grp + 4 * CV, r, i, u);
            }
        }
        return;
    }
    case QT_Q6_K: {
        const uint8_t *ql = s, *qh = s + 128;
        put_half(rec, r, s + 208);
        for (int j = 0; j < 16; j++) rec[2 * QR + j * QR + r] = s[192 + j];
        for (int e = 0; e < 256; e++) {
            const int a = e / 128, lo = (ql[a * 64 + e % 64] >> (4 * ((e % 128) / 64))) & 15;
            const int hi = (qh[a * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
            uint8_t *grp = rec + kq_group_offset(qt, e / 32);
            put_nib(grp, r, e % 32, lo | hi << 4);
            put_hi2(grp + 4 * CV, r, e % 32, lo | hi << 4);
        }
        return;
    }
    }
}

static void pack_impl(int qt, uint8_t *dst, const uint8_t *src, const float *row_scales,
                      int64_t n, int64_t k, int threads) {
    const qtype_info *ti = &QTYPES[qt];
    const int64_t panels = (n + QR - 1) / QR, blocks = (k + ti->block_k - 1) / ti->block_k;
    const int64_t panel_bytes = packed_panel_bytes(qt, k, QR);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        uint8_t *panel = dst + p * panel_bytes;
        memset(panel, 0, panel_bytes); /* rows past n: zero weights and scales */
        for (int r = 0; r < QR && p * QR + r < n; r++) {
            const int64_t row = p * QR + r;
            if (qt == QT_I8) {
                memcpy(panel + 4 * r, &row_scales[row], 4);
                for (int64_t kk = 0; kk < k; kk++)
                    put_raw((uint8_t *)record_at(qt, panel, kk / 32), r, (int)(kk % 32),
                            src[row * k + kk]);
                continue;
            }
            for (int64_t b = 0; b < blocks; b++)
                pack_block(qt, (uint8_t *)record_at(qt, panel, b), src +
                           (row * blocks + b) * ti->gguf_block_bytes, r);
        }
    }
}
