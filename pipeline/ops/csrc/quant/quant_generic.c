/* The portable set (`quant_generic`): plain C, every CPU gcc targets (aarch64 included),
 * panels of 8 rows. Its dot products are scalar loops the compiler may vectorize for the
 * baseline ISA; the x86-64 sets below are the fast ones. */
#include <omp.h>

#include "quant.h"

#define QR 8
#define QUANT_SCALAR

static inline void h2f_row(float *dst, const uint8_t *src) {
    for (int i = 0; i < QR; i++) dst[i] = half_to_float(src[2 * i] | src[2 * i + 1] << 8);
}

static inline void u8_to_float_row(float *dst, const uint8_t *src) {
    for (int i = 0; i < QR; i++) dst[i] = (float)src[i];
}

static inline void s8_to_float_row(float *dst, const uint8_t *src) {
    for (int i = 0; i < QR; i++) dst[i] = (float)(int8_t)src[i];
}

#include "quant_decode.h"
#include "quant_gemm.h"

QUANT_SET(quant_generic, "generic")
