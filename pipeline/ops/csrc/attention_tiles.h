/* Paged attention on the AMX tile unit (the avx512bf16 set, where the process owns the tile
 * unit): `attention_args.tiles` asks for it, for a bfloat16 cache under float32 or bfloat16
 * queries, head size a multiple of 64 up to 256, cache blocks a multiple of 16 keys
 * (`tiles_fit`; anything else takes attention_item). Engines ask for it where the step's
 * matrix products already round their activations to bfloat16 or coarser (int8 weights,
 * GGUF blocks, a bfloat16 checkpoint on tiles: models/quant_weights.py), never for an exact
 * float32 or bfloat16 model.
 *
 * The numerics: each query row rounded to bfloat16 once (a bfloat16 one is as it is); q.k
 * summed in float32 by the tile unit from the cache's rows as they lie (no copy, no
 * conversion), times the scale; the softmax in float32 per chunk of keys, online across
 * chunks (running max m and sum l per row); each weight exp(s - m) rounded to bfloat16, the
 * rounded weights summed into l (so a row's weights sum to exactly l), and the weighted
 * sum of the values by the tile unit in float32. Beside the vector path (float32 weights,
 * float32 sums) a row's output moves by about a bfloat16 rounding of its weights.
 *
 * A row's arithmetic never depends on the other rows of its item or on where its item
 * starts: keys are taken in chunks of AT_CHUNK at absolute positions and in steps of 32 at
 * absolute positions within them; a key outside a row's window gets the weight 0 exactly,
 * which adds nothing; every C element of a tile product depends on its own row and column
 * only. So a token's output is the same in a decode, a prompt chunk or any batch.
 *
 * Per chunk (up to AT_CHUNK keys of one request's KV head, every row of the item):
 *   1. values: pairs of rows interleaved into the tile unit's B layout (VNNI: word n of
 *      tile row j = keys 2j and 2j + 1 of column n), once for all the item's rows; keys
 *      outside every row's window as zeros (a cache slot never written may hold a NaN).
 *      VPUNPCK{L,H}WD interleave per 128-bit lane, so the tiles' columns are the head's
 *      dims in the order 0-3 8-11 16-19 24-27 | 4-7 12-15 20-23 28-31 per 32 dims, put
 *      back in order when the sums are added (at_unpermute).
 *   2. per block of 16 rows: scores C[key][row] = K (16 keys x 32 dims, tiles loaded from
 *      the cache with the keys' stride) x Q^T (the rows' query as B tiles, laid out once
 *      per item), 4 key groups at a time; each row's scores gathered from C's column.
 *   3. softmax: max over the row's window, weights, rounding, l.
 *   4. O_chunk = P (16 rows x 32 keys) x V (32 keys x 16 dims), 4 dim tiles at a time,
 *      then acc = acc * alpha + O_chunk per row.
 * Tiles: 0-3 C, 4 and 6 A, 5 and 7 B, all 16 rows x 64 bytes (at_configure).
 */
#ifndef RINGLLM_ATTENTION_TILES_H
#define RINGLLM_ATTENTION_TILES_H

#include "amx.h"

#define AT_CHUNK 256 /* keys per chunk: the scores and weights of one block of rows */
#define AT_TILE 1024 /* bytes of a tile: 16 rows x 64 */

/* Whether this process may run the tile unit (amx.h), asked once. */
int attention_tiles_usable(void) {
    static int state = -1; /* a race here stores the same answer twice */
    if (state < 0) state = amx_granted();
    return state;
}

static inline int tiles_fit(const attention_args *a) {
    return a->tiles && a->cache_dtype == DT_BF16 && (a->dtype == DT_F32 || a->dtype == DT_BF16) &&
           a->head_size % 64 == 0 && a->head_size <= 256 && a->block_size % 16 == 0 &&
           attention_tiles_usable();
}

/* A thread's scratch, bytes from its (64-byte aligned) start:
 *   qt    4 blocks of rows x d/32 tiles    the rows' query as B tiles
 *   vt    AT_CHUNK/32 x d/16 tiles          the chunk's values as B tiles
 *   ct    4 tiles                           C tiles stored
 *   s     16 x AT_CHUNK float32             one block of rows' scores
 *   p     16 x AT_CHUNK bfloat16            their weights (rows past the block's: zero)
 *   acc   ATTN_MAX_ROWS x d float32         the rows' output sums */
typedef struct {
    uint8_t *qt, *vt;
    float *ct, *s, *acc;
    uint16_t *p;
} at_scratch;

static inline int64_t at_scratch_bytes(int64_t d) {
    return 4 * (d / 32) * AT_TILE + (AT_CHUNK / 32) * (d / 16) * AT_TILE + 4 * AT_TILE +
           16 * AT_CHUNK * 4 + 16 * AT_CHUNK * 2 + ATTN_MAX_ROWS * d * 4;
}

static inline at_scratch at_scratch_at(uint8_t *base, int64_t d) {
    at_scratch s;
    s.qt = base;
    s.vt = s.qt + 4 * (d / 32) * AT_TILE;
    s.ct = (float *)(s.vt + (AT_CHUNK / 32) * (d / 16) * AT_TILE);
    s.s = s.ct + 4 * AT_TILE / 4;
    s.p = (uint16_t *)(s.s + 16 * AT_CHUNK);
    s.acc = (float *)(s.p + 16 * AT_CHUNK);
    return s;
}

/* C tiles 0-3 zeroed, or stored to ct (1 KB each, in order). */
#define AT_ZERO_C()  \
    _tile_zero(0);   \
    _tile_zero(1);   \
    _tile_zero(2);   \
    _tile_zero(3)
#define AT_STORE_C(ct)                  \
    _tile_stored(0, (ct), 64);         \
    _tile_stored(1, (ct) + 256, 64);   \
    _tile_stored(2, (ct) + 512, 64);   \
    _tile_stored(3, (ct) + 768, 64)

/* Lanes u of t .. t + 15 with from <= t + u < to. */
INLINE __mmask16 at_range(int64_t t, int64_t from, int64_t to) {
    int64_t lo = from - t, hi = to - t;
    lo = lo < 0 ? 0 : lo;
    hi = hi > 16 ? 16 : hi;
    return hi <= lo ? 0 : (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

/* Byte address of key `key` (absolute) of KV head kvh in a cache, its dims from 0. */
INLINE const uint8_t *at_row(const attention_args *a, const void *cache, const int32_t *blocks,
                             int64_t kvh, int64_t key, int shift) {
    const int64_t bs = a->block_size;
    return (const uint8_t *)cache +
           (((int64_t)blocks[block_of(key, bs, shift)] * a->num_kv_heads + kvh) * bs +
            offset_in(key, bs, shift)) * a->head_size * 2;
}

/* Dims 0..15 and 16..31 of a 32-dim slice from its lo / hi tile columns (see the top). */
INLINE void at_unpermute(vf lo, vf hi, vf *d0, vf *d1) {
    const __m512i ia = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i ib = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30,
                                         31);
    *d0 = _mm512_permutex2var_ps(lo, ia, hi);
    *d1 = _mm512_permutex2var_ps(lo, ib, hi);
}

/* Row i's query (32 values from k0) as its column of a B tile: word j of tile row kk is
 * dims 2kk, 2kk + 1 of the row whose column is j. */
INLINE void at_query_column(uint8_t *tile, const void *query, int64_t off, int64_t col, int dt) {
    __m512i words;
    if (dt == DT_F32) {
        const float *q = (const float *)query + off;
        words = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q));
    } else {
        words = _mm512_loadu_si512((const uint16_t *)query + off);
    }
    const __m512i at = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(16));
    _mm512_i32scatter_epi32((int32_t *)tile + col, at, words, 4);
}

/* Step 1: the chunk's values (keys kstart .. kstart + n - 1; those below `lo` or past the
 * end as zeros) as B tiles, asking for rows ahead as attention_item does. */
INLINE void at_values(const attention_args *a, const int32_t *blocks, int64_t kvh, int64_t kstart,
                      int64_t n, int64_t lo, const at_scratch *s, int shift,
                      const kv_span *self, const kv_span *next_item, int64_t k0, int64_t stream,
                      int64_t *fetched) {
    const int64_t d = a->head_size, tiles = d / 16, n32 = (n + 31) / 32 * 32;
    for (int64_t t = 0; t < n32; t += 2) {
        const int64_t ahead = kstart - k0 + t + 2 + ATTN_AHEAD;
        for (const int64_t due = ahead < stream ? ahead : stream; *fetched < due; (*fetched)++) {
            if (*fetched < self->count)
                prefetch_row(a, self, *fetched, 2, shift);
            else
                prefetch_row(a, next_item, *fetched - self->count, 2, shift);
        }
        const int in0 = t < n && kstart + t >= lo, in1 = t + 1 < n && kstart + t + 1 >= lo;
        const uint8_t *r0 = in0 ? at_row(a, a->value_cache, blocks, kvh, kstart + t, shift) : NULL;
        const uint8_t *r1 = in1 ? at_row(a, a->value_cache, blocks, kvh, kstart + t + 1, shift)
                                : NULL;
        uint8_t *dst = s->vt + (t / 32) * tiles * AT_TILE + (t % 32 / 2) * 64;
        for (int64_t h = 0; h < d / 32; h++) {
            const __m512i x = in0 ? _mm512_loadu_si512(r0 + h * 64) : _mm512_setzero_si512();
            const __m512i y = in1 ? _mm512_loadu_si512(r1 + h * 64) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + 2 * h * AT_TILE, _mm512_unpacklo_epi16(x, y));
            _mm512_storeu_si512(dst + (2 * h + 1) * AT_TILE, _mm512_unpackhi_epi16(x, y));
        }
    }
}

/* One key group's product into C tile J: K (16 keys, A tile TA) x the block's query tiles
 * (the tile intrinsics take literal tile numbers). */
#define AT_QK(J, TA)                                                                           \
    if ((J) < nb) {                                                                            \
        _tile_loadd(TA, at_row(a, a->key_cache, blocks, kvh, kstart + (g + (J)) * 16, shift) + \
                            ks * 64,                                                           \
                    d * 2);                                                                    \
        _tile_dpbf16ps(J, TA, 5);                                                              \
    }

/* Step 2: scores s[i][t] of the block's nr rows, keys kstart + t, t < n (16 at a time). */
INLINE void at_scores(const attention_args *a, const int32_t *blocks, int64_t kvh, int64_t kstart,
                      int64_t n, const uint8_t *qt, int64_t nr, const at_scratch *s, int shift) {
    const int64_t d = a->head_size, groups = (n + 15) / 16;
    const __m512i col = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(16));
    const vf scale = vset1(a->scale);
    for (int64_t g = 0; g < groups; g += 4) {
        const int64_t nb = groups - g < 4 ? groups - g : 4;
        AT_ZERO_C();
        for (int64_t ks = 0; ks < d / 32; ks++) {
            _tile_loadd(5, qt + ks * AT_TILE, 64);
            AT_QK(0, 4)
            AT_QK(1, 6)
            AT_QK(2, 4)
            AT_QK(3, 6)
        }
        AT_STORE_C(s->ct);
        for (int64_t i = 0; i < nr; i++)
            for (int64_t j = 0; j < nb; j++)
                vstoreu(s->s + i * AT_CHUNK + (g + j) * 16,
                        vmul(_mm512_i32gather_ps(col, s->ct + j * 256 + i, 4), scale));
    }
}
#undef AT_QK

/* One value tile's product into C tile J (dims tile dg * 4 + J of the 32 keys at ks), B
 * tile TB. */
#define AT_PV(J, TB)                                                          \
    _tile_loadd(TB, s->vt + (ks * (d / 16) + dg * 4 + (J)) * AT_TILE, 64); \
    _tile_dpbf16ps(J, 4, TB);

/* Steps 3 and 4 for one block of rows (rows i0 .. i0 + nr - 1 of the item): their weights
 * over the chunk, and acc = acc * alpha + the chunk's weighted sum of values. */
INLINE void at_weights_values(const attention_args *a, int64_t kstart, int64_t n, int64_t i0,
                              int64_t nr, const int64_t *pos, float *m, float *l,
                              const at_scratch *s) {
    const int64_t d = a->head_size, n32 = (n + 31) / 32 * 32;
    float alpha[16];
    int has[16];
    for (int64_t i = 0; i < 16; i++) {
        uint16_t *prow = s->p + i * AT_CHUNK;
        const int64_t row = i0 + i;
        int64_t from = 0, to = 0;
        if (i < nr) {
            from = first_key(a, pos[row]) - kstart;
            to = pos[row] - kstart + 1;
            from = from < 0 ? 0 : from;
            to = to > n ? n : to;
        }
        has[i] = to > from;
        if (!has[i]) { /* no key of this chunk (or a padding row): weights 0 */
            memset(prow, 0, (size_t)n32 * 2);
            continue;
        }
        const float *sc = s->s + i * AT_CHUNK;
        vf vmx = vset1(m[row]);
        for (int64_t t = from / 16 * 16; t < to; t += 16) {
            const __mmask16 k = at_range(t, from, to);
            vmx = _mm512_mask_max_ps(vmx, k, vmx, _mm512_maskz_loadu_ps(k, sc + t));
        }
        const float mx = vreduce_max(vmx);
        alpha[i] = expf(m[row] - mx);
        vf sum = vzero();
        for (int64_t t = 0; t < n32; t += 16) {
            const __mmask16 k = at_range(t, from, to);
            const vf e = _mm512_maskz_mov_ps(k, vexp(vsub(_mm512_maskz_loadu_ps(k, sc + t), vset1(mx))));
            const __m256i b = bf16_bits(e);
            _mm256_storeu_si256((__m256i *)(prow + t), b);
            sum = vadd(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
        }
        l[row] = l[row] * alpha[i] + vreduce_add(sum);
        m[row] = mx;
    }
    for (int64_t dg = 0; dg < d / 64; dg++) {
        AT_ZERO_C();
        for (int64_t ks = 0; ks < n32 / 32; ks++) {
            _tile_loadd(4, s->p + ks * 32, AT_CHUNK * 2);
            AT_PV(0, 5)
            AT_PV(1, 7)
            AT_PV(2, 5)
            AT_PV(3, 7)
        }
        AT_STORE_C(s->ct);
        for (int64_t i = 0; i < nr; i++) {
            if (!has[i]) continue;
            float *o = s->acc + (i0 + i) * d + dg * 64;
            const vf al = vset1(alpha[i]);
            for (int64_t h = 0; h < 2; h++) {
                vf d0, d1;
                at_unpermute(vloadu(s->ct + 2 * h * 256 + i * 16),
                             vloadu(s->ct + (2 * h + 1) * 256 + i * 16), &d0, &d1);
                vstoreu(o + 32 * h, vfmadd(vloadu(o + 32 * h), al, d0));
                vstoreu(o + 32 * h + 16, vfmadd(vloadu(o + 32 * h + 16), al, d1));
            }
        }
    }
}
#undef AT_PV

/* The item's rows (query tokens t0 .. t0 + nt - 1 of request r x the query heads of KV head
 * kvh), as attention_item takes them. */
INLINE void attention_item_tiles(const attention_args *a, int64_t r, int64_t kvh, int64_t t0,
                                 int64_t nt, const at_scratch *s, const kv_span *next_item,
                                 int dt) {
    const int64_t d = a->head_size, group = a->num_heads / a->num_kv_heads, rows = nt * group;
    const int64_t q_first = query_first(a, r), q_len = query_len(a, r);
    const int64_t first_pos = a->seq_lens[r] - q_len + t0, last_pos = first_pos + nt - 1;
    const int32_t *blocks = a->block_tables + r * a->bt_stride;
    const int shift = block_shift(a->block_size);
    float m[ATTN_MAX_ROWS], l[ATTN_MAX_ROWS];
    int64_t pos[ATTN_MAX_ROWS];
    const int64_t blocks_of_rows = (rows + 15) / 16;
    memset(s->qt, 0, (size_t)(blocks_of_rows * (d / 32) * AT_TILE));
    for (int64_t i = 0; i < rows; i++) {
        const int64_t tok = q_first + t0 + i / group, head = kvh * group + i % group;
        const int64_t off = tok * a->q_tok_stride + head * a->q_head_stride;
        pos[i] = first_pos + i / group;
        for (int64_t ks = 0; ks < d / 32; ks++)
            at_query_column(s->qt + ((i / 16) * (d / 32) + ks) * AT_TILE, a->query, off + ks * 32,
                            i % 16, dt);
        memset(s->acc + i * d, 0, (size_t)d * 4);
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    /* keys lo .. last_pos: the first row's window (the widest reach back) */
    const int64_t lo = first_key(a, first_pos), k0 = lo / 32 * 32;
    const kv_span self = {blocks, kvh, k0, last_pos + 1 - k0};
    const int64_t stream =
        self.count + (next_item->count < ATTN_AHEAD ? next_item->count : ATTN_AHEAD);
    int64_t fetched = self.count < ATTN_AHEAD ? self.count : ATTN_AHEAD;
    for (int64_t c0 = lo / AT_CHUNK * AT_CHUNK; c0 <= last_pos; c0 += AT_CHUNK) {
        const int64_t kstart = c0 > k0 ? c0 : k0;
        const int64_t kend = c0 + AT_CHUNK < last_pos + 1 ? c0 + AT_CHUNK : last_pos + 1;
        const int64_t n = kend - kstart;
        at_values(a, blocks, kvh, kstart, n, lo, s, shift, &self, next_item, k0, stream, &fetched);
        for (int64_t i0 = 0; i0 < rows; i0 += 16) {
            const int64_t nr = rows - i0 < 16 ? rows - i0 : 16;
            at_scores(a, blocks, kvh, kstart, n, s->qt + (i0 / 16) * (d / 32) * AT_TILE, nr, s,
                      shift);
            at_weights_values(a, kstart, n, i0, nr, pos, m, l, s);
        }
    }
    for (int64_t i = 0; i < rows; i++) {
        const int64_t tok = q_first + t0 + i / group, head = kvh * group + i % group;
        const int64_t off = tok * a->out_tok_stride + head * a->out_head_stride;
        const vf inv = vset1(1.0f / l[i]);
        for (int64_t j = 0; j < d; j += VL)
            vstore(a->out, off + j, vmul(vloadu(s->acc + i * d + j), inv), dt, lanes(VL));
    }
}

#endif
