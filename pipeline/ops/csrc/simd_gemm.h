/* The matrix product of a linear layer with 16-bit weights widened in registers:
 *
 *     y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n])      x, y, bias float32; W bfloat16 / float16
 *
 * For CPUs without bf16 arithmetic running a bf16 checkpoint in float32: the weights stay
 * 16-bit in memory (half the bytes each step streams, the bound of small batches), and
 * every product is float32, exactly as if the weights had been widened at load (widening
 * bf16 / fp16 to float32 is exact). Written over the vector layer (VL lanes), included by
 * the SIMD kernel files after simd_kernels.h.
 *
 * Weight layout (packed once at load by pack_linear_weight, cpu_ops_generic.c): panels of
 * 16 output columns, each K-major, so a panel is one contiguous stream of K x 32 bytes:
 *
 *     panel p = columns 16p .. 16p+15:  k=0: W[16p, 0] .. W[16p+15, 0] | k=1: ... | k=K-1
 *     (the last panel's missing columns are zeros)
 *
 * A tile is MR rows x NP panels held in MR x NP x 16/VL accumulators; per k it widens NP
 * panel rows, broadcasts MR values of x, and issues the MR x NP x 16/VL FMAs. Every output
 * is summed in the same order whatever the tile (below), so a row's result does not depend
 * on how many rows share the step (batch-invariant, like the attention kernels).
 *
 * Blocking, from the CPU's L2 size (cpu_l2_bytes(), asked once): rows in blocks whose x
 * rows fill at most half of L2, columns split between threads in chunks of panels that
 * fill a quarter of it; every row tile of a block walks the chunk, which stays in L2.
 */

#define PV (16 / VL) /* vectors per panel row */
/* Tiles' loops have constant trip counts: unrolled completely, their accumulator arrays
 * become registers (a loop left rolled keeps them on the stack). */
#define UNROLL _Pragma("GCC unroll 24")

#if VL == 8
#define GEMM_MR 6 /* 6 rows x 1 panel = 12 accumulators of the 16 ymm registers */
#define TILE_NP(mr) ((mr) >= 4 ? 1 : (mr) == 3 ? 2 : (mr) == 2 ? 3 : 6)
#else
#define GEMM_MR 8 /* 8 rows x 3 panels = 24 accumulators of the 32 zmm registers */
#define TILE_NP(mr) ((mr) >= 6 ? 3 : (mr) >= 4 ? 4 : (mr) >= 2 ? 8 : 12)
#endif

/* Rows per block: x rows of k floats filling at most half of L2, whole tiles, 1..8 tiles. */
static int64_t block_rows(int64_t k) {
    int64_t tiles = (cpu_l2_bytes() / 2) / (GEMM_MR * 4 * (k > 0 ? k : 1));
    tiles = tiles < 1 ? 1 : tiles > 8 ? 8 : tiles;
    return tiles * GEMM_MR;
}

/* K is summed in blocks of GEMM_KB: each block's products in k order in the registers,
 * the block sums added in order into y. The rounding error of a sum then grows with
 * GEMM_KB + K / GEMM_KB terms, not K (one chain over K = 1536 lost a bit more than twice
 * what the BLAS products in transformers lose, against float64). */
#define GEMM_KB 128

/* One tile: rows m0 .. m0+MR-1, panels p0 .. p0+NP-1. */
#define DEFINE_TILE(MR, NP)                                                                      \
    static void tile_##MR##x##NP(const linear_args *a, int64_t m0, int64_t p0, int wdt) {        \
        const uint16_t *w = a->w + p0 * a->k * 16;                                               \
        const float *x = a->x + m0 * a->ldx;                                                     \
        for (int64_t k0 = 0; k0 < a->k; k0 += GEMM_KB) {                                         \
            const int64_t k1 = k0 + GEMM_KB < a->k ? k0 + GEMM_KB : a->k;                        \
            vf acc[MR][NP * PV];                                                                 \
            UNROLL for (int i = 0; i < MR; i++)                                                  \
                UNROLL for (int j = 0; j < NP * PV; j++) acc[i][j] = vzero();                    \
            for (int64_t kk = k0; kk < k1; kk++) {                                               \
                vf b[NP * PV];                                                                   \
                UNROLL for (int p = 0; p < NP; p++)                                              \
                    UNROLL for (int v = 0; v < PV; v++)                                          \
                        b[p * PV + v] = vload16_full(w, (p * a->k + kk) * 16 + v * VL, wdt);     \
                UNROLL for (int i = 0; i < MR; i++) {                                            \
                    const vf xi = vset1(x[i * a->ldx + kk]);                                     \
                    UNROLL for (int j = 0; j < NP * PV; j++)                                     \
                        acc[i][j] = vfmadd(xi, b[j], acc[i][j]);                                 \
                }                                                                                \
            }                                                                                    \
            UNROLL for (int j = 0; j < NP * PV; j++) {                                           \
                const int64_t c = (p0 + j / PV) * 16 + (j % PV) * VL; /* first column */         \
                const int64_t left = a->n - c;                                                   \
                if (left <= 0) break;                                                            \
                const vmask m = lanes(left);                                                     \
                vf base = vzero(); /* the bias, then the sum of the blocks before */             \
                if (k0 == 0 && a->bias) base = vloadu_part(a->bias + c, m);                      \
                UNROLL for (int i = 0; i < MR; i++) {                                            \
                    float *y = a->y + (m0 + i) * a->ldy + c;                                     \
                    const vf before = k0 == 0 ? base : vloadu_part(y, m);                        \
                    vstoreu_part(y, m, vadd(before, acc[i][j]));                                 \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }

#define DEFINE_TILES(MR) DEFINE_TILE(MR, 1) DEFINE_TILE_WIDE(MR)

/* Each MR gets its wide tile (TILE_NP(MR) panels) and the one-panel tile for a chunk's
 * last panels. */
#if VL == 8
#define DEFINE_TILE_WIDE(MR) DEFINE_TILE_WIDE_##MR
#define DEFINE_TILE_WIDE_1 DEFINE_TILE(1, 6)
#define DEFINE_TILE_WIDE_2 DEFINE_TILE(2, 3)
#define DEFINE_TILE_WIDE_3 DEFINE_TILE(3, 2)
#define DEFINE_TILE_WIDE_4
#define DEFINE_TILE_WIDE_5
#define DEFINE_TILE_WIDE_6
DEFINE_TILES(1) DEFINE_TILES(2) DEFINE_TILES(3) DEFINE_TILES(4) DEFINE_TILES(5) DEFINE_TILES(6)
#else
#define DEFINE_TILE_WIDE(MR) DEFINE_TILE_WIDE_##MR
#define DEFINE_TILE_WIDE_1 DEFINE_TILE(1, 12)
#define DEFINE_TILE_WIDE_2 DEFINE_TILE(2, 8)
#define DEFINE_TILE_WIDE_3 DEFINE_TILE(3, 8)
#define DEFINE_TILE_WIDE_4 DEFINE_TILE(4, 4)
#define DEFINE_TILE_WIDE_5 DEFINE_TILE(5, 4)
#define DEFINE_TILE_WIDE_6 DEFINE_TILE(6, 3)
#define DEFINE_TILE_WIDE_7 DEFINE_TILE(7, 3)
#define DEFINE_TILE_WIDE_8 DEFINE_TILE(8, 3)
DEFINE_TILES(1) DEFINE_TILES(2) DEFINE_TILES(3) DEFINE_TILES(4) DEFINE_TILES(5) DEFINE_TILES(6)
DEFINE_TILES(7) DEFINE_TILES(8)
#endif

typedef void (*tile_fn)(const linear_args *, int64_t, int64_t, int);

/* The tile of mr rows x np panels (np: 1 or TILE_NP(mr)). */
static tile_fn tile_of(int mr, int wide) {
#if VL == 8
    static const tile_fn narrow[7] = {NULL, tile_1x1, tile_2x1, tile_3x1, tile_4x1, tile_5x1, tile_6x1};
    static const tile_fn wide_[7] = {NULL, tile_1x6, tile_2x3, tile_3x2, tile_4x1, tile_5x1, tile_6x1};
#else
    static const tile_fn narrow[9] = {NULL,     tile_1x1, tile_2x1, tile_3x1, tile_4x1,
                                      tile_5x1, tile_6x1, tile_7x1, tile_8x1};
    static const tile_fn wide_[9] = {NULL,     tile_1x12, tile_2x8, tile_3x8, tile_4x4,
                                     tile_5x4, tile_6x3,  tile_7x3, tile_8x3};
#endif
    return wide ? wide_[mr] : narrow[mr];
}

/* Panels per thread chunk: at most a quarter of L2 of weights (k x 32 bytes a panel), and
 * small enough that every thread gets 4 chunks or more (a matrix of few columns split in a
 * few big chunks leaves a thread idle). */
static int64_t chunk_panels(int64_t k, int64_t panels, int threads) {
    int64_t per = (cpu_l2_bytes() / 4) / (k * 32 > 0 ? k * 32 : 1);
    const int64_t even = (panels + 4 * threads - 1) / (4 * threads);
    per = per < even ? per : even;
    return per < 1 ? 1 : per;
}

INLINE void linear_worker(const linear_args *a, int wdt) {
    const int64_t panels = (a->n + 15) / 16;
    const int64_t per_chunk = chunk_panels(a->k, panels, omp_get_num_threads());
    const int64_t chunks = (panels + per_chunk - 1) / per_chunk, mc = block_rows(a->k);
    for (int64_t r0 = 0; r0 < a->m; r0 += mc) {
        const int64_t r1 = r0 + mc < a->m ? r0 + mc : a->m;
        int64_t c;
#pragma omp for schedule(static)
        for (c = 0; c < chunks; c++) {
            const int64_t p_end = (c + 1) * per_chunk < panels ? (c + 1) * per_chunk : panels;
            for (int64_t m0 = r0; m0 < r1; m0 += GEMM_MR) {
                const int mr = (int)(r1 - m0 < GEMM_MR ? r1 - m0 : GEMM_MR);
                const int np = TILE_NP(mr);
                const tile_fn wide = tile_of(mr, 1), narrow = tile_of(mr, 0);
                int64_t p = c * per_chunk;
                for (; p + np <= p_end; p += np) wide(a, m0, p, wdt);
                for (; p < p_end; p++) narrow(a, m0, p, wdt);
            }
        }
    }
}

static void linear_bf16(const linear_args *a) {
#pragma omp parallel num_threads(a->threads) if (a->threads > 1 && a->n * a->k > (1 << 14))
    linear_worker(a, DT_BF16);
}

static void linear_f16(const linear_args *a) {
#pragma omp parallel num_threads(a->threads) if (a->threads > 1 && a->n * a->k > (1 << 14))
    linear_worker(a, DT_F16);
}

static void v_linear(const linear_args *a) {
    if (a->wdtype == DT_BF16)
        linear_bf16(a);
    else
        linear_f16(a);
}
