/* What both C files of the CPU kernels share (kernels/cpu/skinny_gemm.c, layer_ops.c). */
#ifndef SPECFLASH_SIMD_H
#define SPECFLASH_SIMD_H
#include <immintrin.h>

/* The sum of 8 lanes in a fixed order: (0+4) + (1+5), then (2+6) + (3+7), then the two. */
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);                 /* lanes (0+4, 1+5, 2+6, 3+7) */
    __m128 sh = _mm_movehdup_ps(s);                /* (1, 1, 3, 3) */
    __m128 t = _mm_add_ps(s, sh);                  /* (0+1, -, 2+3, -) */
    sh = _mm_movehl_ps(sh, t);                     /* (2+3, ...) */
    t = _mm_add_ss(t, sh);
    return _mm_cvtss_f32(t);
}

#endif
