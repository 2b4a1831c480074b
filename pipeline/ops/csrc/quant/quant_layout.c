/* What every kernel set shares: the types' record sizes (the layout is drawn in quant.h)
 * and the per-thread scratch buffers. */
#include <stdlib.h>

#include "quant.h"

const qtype_info QTYPES[NUM_QT] = {
    [QT_Q4_0] = {"q4_0", 32, 18, 18, 0},
    [QT_Q4_1] = {"q4_1", 32, 20, 20, 0},
    [QT_Q5_0] = {"q5_0", 32, 22, 22, 0},
    [QT_Q5_1] = {"q5_1", 32, 24, 24, 0},
    [QT_Q8_0] = {"q8_0", 32, 34, 34, 0},
    [QT_Q4_K] = {"q4_k", 256, 144, 148, 0},
    [QT_Q5_K] = {"q5_k", 256, 176, 180, 0},
    [QT_Q6_K] = {"q6_k", 256, 210, 210, 0},
    [QT_I8] = {"i8", 32, 0, 32, 4},
    [QT_BF16] = {"bf16", 32, 0, 64, 0},
};

int64_t packed_panel_bytes(int qtype, int64_t k, int rows_per_panel) {
    const qtype_info *t = &QTYPES[qtype];
    const int64_t blocks = (k + t->block_k - 1) / t->block_k;
    return (int64_t)rows_per_panel * (t->panel_header + blocks * t->row_block_bytes);
}

int64_t packed_bytes(int qtype, int64_t n, int64_t k, int rows_per_panel) {
    const int64_t panels = (n + rows_per_panel - 1) / rows_per_panel;
    return panels * packed_panel_bytes(qtype, k, rows_per_panel);
}

/* NOTE: thread-local, not freed: the OpenMP threads live as long as the process, and
 * keeping the pages means a decode step touches no fresh memory. */
static __thread void *scratch[2];
static __thread size_t scratch_bytes[2];

void *quant_scratch(int slot, size_t bytes) {
    if (scratch_bytes[slot] >= bytes) return scratch[slot];
    free(scratch[slot]);
    scratch_bytes[slot] = 0;
    const size_t rounded = (bytes + 4095) & ~(size_t)4095;
    scratch[slot] = aligned_alloc(64, rounded);
    if (scratch[slot]) scratch_bytes[slot] = rounded;
    return scratch[slot];
}
