/* The AMX tile unit, as the kernels that use it (attention_tiles.h in cpu_kernels,
 * quant/quant_avx512amx.c in quant_kernels) start it: whether this process may, and the one
 * configuration they run (8 tiles of 16 rows x 64 bytes). Included by a translation unit
 * compiled with `#pragma GCC target("amx-tile,amx-bf16,...")`.
 *
 * Linux gives a process the tile data state only when asked (arch_prctl); without it a tile
 * instruction faults, so every caller asks `amx_granted` first. */
#ifndef RINGLLM_AMX_H
#define RINGLLM_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ARCH_REQ_XCOMP_PERM 0x1023
#define AMX_XFEATURE_XTILEDATA 18

/* The CPU has the tile unit with bf16 products (and AVX512_BF16), and Linux granted this
 * process its state (the request is idempotent; each caller asks once and keeps the answer). */
static inline int amx_granted(void) {
    return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
           __builtin_cpu_supports("avx512bf16") &&
           syscall(SYS_arch_prctl, AMX_ARCH_REQ_XCOMP_PERM, AMX_XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_tile_config;

/* Tiles 0-7 as 16 rows of 64 bytes, for the calling thread (until _tile_release). */
static inline void amx_configure(void) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

#endif
