/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) for few rows M (1..16), fp32 arithmetic, AVX2 + FMA;
 * w in fp32, in fp16 (F16C conversion in registers: half the memory traffic), or in int8 with one
 * fp32 scale per weight row (a quarter of it: y[m, n] = scale[n] * (x[m] . q[n]) + bias[n]).
 *
 * Decoding and tree verification multiply a handful of rows by every weight
 * of the model once per step: the weight streams from memory and each of its
 * elements is used M times. This kernel reads the weight once, in memory
 * order, from the nn.Linear layout as it is ([N, K], no repacking, software
 * prefetch ahead of the stream), and computes each weight row's dot products
 * with up to 4 x rows at a time in registers (more rows re-read the weight
 * row from L1). A step of M rows then costs about the memory traffic of one
 * row; BLAS GEMV is as fast for M = 1 only, and small-M GEMMs re-read or
 * repack the weight.
 *
 * Every output element is the same sequence of operations whatever M is and
 * whichever other rows share its call: two 8-lane FMA accumulators over
 * 16-float chunks of k in order, a last 8-float chunk into the first, a fixed
 * horizontal sum of their sum, the scalar tail (fused multiply-adds), then the bias. A row's logits
 * therefore do not depend on how many rows were verified with it.
 *
 * Threads: OpenMP over blocks of output columns (the caller passes torch's
 * thread count; the library links the libgomp torch already loaded).
 */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

/* Prefetch distance along the weight, in floats: the weight is read as one sequential stream. */
#ifndef PREFETCH
#define PREFETCH 512
#endif

/* Dot products of one weight row with G (1, 2 or 4) x rows, two accumulators per x row (even and
 * odd L-float chunks of k: L = 8 on AVX2, V = 256; 16 on AVX-512, V = 512). Every element: chunks of
 * 2L in order, a last chunk of L into the even accumulator, HSUM(even + odd), the scalar tail, OUT
 * (the row's scale, for int8), the bias. WT is the weight's element type, LOADW / LOAD1 read L / 1
 * of them as fp32 (fp16 weights: F16C conversion in registers; int8: sign-extended and converted).
 * ATTR: the function's target attribute, or nothing. */
#define VEC_256 __m256
#define LANES_256 8
#define ZERO_256 _mm256_setzero_ps
#define LOADX_256 _mm256_loadu_ps
#define FMA_256 _mm256_fmadd_ps
#define ADD_256 _mm256_add_ps
#define HSUM_256 hsum8
#define VEC_512 __m512
#define LANES_512 16
#define ZERO_512 _mm512_setzero_ps
#define LOADX_512 _mm512_loadu_ps
#define FMA_512 _mm512_fmadd_ps
#define ADD_512 _mm512_add_ps
#define HSUM_512 _mm512_reduce_add_ps

#define DEFINE_ROW(G, SFX, WT, LOADW, LOAD1, OUT, V, ATTR)                                       \
ATTR static inline void row_##SFX##G(const float *x, const WT *wr, float *y, int64_t K, int64_t N, \
                                     float b, float sc) {                                        \
    const int64_t L = LANES_##V;                                                                 \
    const int64_t K2 = K & ~(2 * L - 1), K1 = K & ~(L - 1);                                      \
    VEC_##V a0[G], a1[G];                                                                        \
    _Pragma("GCC unroll 4") for (int m = 0; m < (G); m++) {                                      \
        a0[m] = ZERO_##V();                                                                      \
        a1[m] = ZERO_##V();                                                                      \
    }                                                                                            \
    for (int64_t k = 0; k < K2; k += 2 * L) {                                                    \
        _mm_prefetch((const char *)(wr + k + PREFETCH), _MM_HINT_T0);                            \
        VEC_##V w0 = LOADW(wr + k), w1 = LOADW(wr + k + L);                                      \
        _Pragma("GCC unroll 4") for (int m = 0; m < (G); m++) {                                  \
            a0[m] = FMA_##V(LOADX_##V(x + m * K + k), w0, a0[m]);                                \
            a1[m] = FMA_##V(LOADX_##V(x + m * K + k + L), w1, a1[m]);                            \
        }                                                                                        \
    }                                                                                            \
    if (K1 > K2) {                                                                               \
        VEC_##V w0 = LOADW(wr + K2);                                                             \
        _Pragma("GCC unroll 4") for (int m = 0; m < (G); m++)                                    \
            a0[m] = FMA_##V(LOADX_##V(x + m * K + K2), w0, a0[m]);                               \
    }                                                                                            \
    _Pragma("GCC unroll 4") for (int m = 0; m < (G); m++) {                                      \
        float s = HSUM_##V(ADD_##V(a0[m], a1[m]));                                               \
        for (int64_t k = K1; k < K; k++) s = __builtin_fmaf(x[m * K + k], LOAD1(wr[k]), s);      \
        y[m * N] = OUT(s, sc) + b;                                                               \
    }                                                                                            \
}

#define LOAD8_F32(p) _mm256_loadu_ps(p)
#define LOAD1_F32(v) (v)
#define LOAD8_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD1_F16(v) _cvtsh_ss(v)
#define LOAD8_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define LOAD1_I8(v) ((float)(v))
#define OUT_PLAIN(s, sc) (s)
#define OUT_SCALED(s, sc) ((s) * (sc))

DEFINE_ROW(1, f32_, float, LOAD8_F32, LOAD1_F32, OUT_PLAIN, 256, )
DEFINE_ROW(2, f32_, float, LOAD8_F32, LOAD1_F32, OUT_PLAIN, 256, )
DEFINE_ROW(4, f32_, float, LOAD8_F32, LOAD1_F32, OUT_PLAIN, 256, )
DEFINE_ROW(1, f16_, uint16_t, LOAD8_F16, LOAD1_F16, OUT_PLAIN, 256, )
DEFINE_ROW(2, f16_, uint16_t, LOAD8_F16, LOAD1_F16, OUT_PLAIN, 256, )
DEFINE_ROW(4, f16_, uint16_t, LOAD8_F16, LOAD1_F16, OUT_PLAIN, 256, )
DEFINE_ROW(1, i8_, int8_t, LOAD8_I8, LOAD1_I8, OUT_SCALED, 256, )
DEFINE_ROW(2, i8_, int8_t, LOAD8_I8, LOAD1_I8, OUT_SCALED, 256, )
DEFINE_ROW(4, i8_, int8_t, LOAD8_I8, LOAD1_I8, OUT_SCALED, 256, )

/* Columns [n0, n1) of y: weight rows in memory order, x rows in groups of 4, the rest as 2, 1
 * or 2 + 1 (a weight row is read from memory once; a second group reads it again from L1).
 * `python bench/cpu_matmul.py --rows 1 2 3 4 5 6 7 8` times each count in a whole forward. */
#define DEFINE_COLUMNS(SFX, WT, ATTR)                                                            \
ATTR static void columns_##SFX(const float *x, const WT *w, const float *scales, const float *bias,  \
                          float *y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {   \
    for (int64_t n = n0; n < n1; n++) {                                                          \
        const WT *wr = w + n * K;                                                                \
        const float b = bias ? bias[n] : 0.0f, sc = scales ? scales[n] : 1.0f;                   \
        for (int64_t m0 = 0; m0 < M; m0 += 4) {                                                  \
            const float *xg = x + m0 * K;                                                        \
            float *yg = y + m0 * N + n;                                                          \
            switch (M - m0 < 4 ? M - m0 : 4) {                                                   \
                case 1: row_##SFX##1(xg, wr, yg, K, N, b, sc); break;                            \
                case 2: row_##SFX##2(xg, wr, yg, K, N, b, sc); break;                            \
                case 3: /* two and one: row_3 streamed ~40 % slower than row_4 (AMD EPYC) */     \
                    row_##SFX##2(xg, wr, yg, K, N, b, sc);                                       \
                    row_##SFX##1(xg + 2 * K, wr, yg + 2 * N, K, N, b, sc);                       \
                    break;                                                                       \
                default: row_##SFX##4(xg, wr, yg, K, N, b, sc); break;                           \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
}

DEFINE_COLUMNS(f32_, float, )
DEFINE_COLUMNS(f16_, uint16_t, )
DEFINE_COLUMNS(i8_, int8_t, )

/* ---- int8 on AVX-512 --------------------------------------------------------------------------
 * Drafts' int8 weights are compute-bound on AVX2 (8 weights a load, extend and convert: ~28 GB/s of
 * int8 on an Intel Xeon, against a memory stream twice as fast): with AVX-512 each of those
 * instructions takes 16. A draft's results need not match another ISA's bits, only be the same
 * whatever M and the neighbouring rows: every element is two 16-lane accumulators over 32-weight
 * chunks of k in order, a last chunk of 16 into the first, the fixed reduction of their sum, the
 * scalar tail, the row's scale, the bias. Taken where `sf_panel_isa` takes AVX-512. */
#define LOAD16_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))

#define AVX512 __attribute__((target("avx512f")))
DEFINE_ROW(1, i8_512_, int8_t, LOAD16_I8, LOAD1_I8, OUT_SCALED, 512, AVX512)
DEFINE_ROW(2, i8_512_, int8_t, LOAD16_I8, LOAD1_I8, OUT_SCALED, 512, AVX512)
DEFINE_ROW(4, i8_512_, int8_t, LOAD16_I8, LOAD1_I8, OUT_SCALED, 512, AVX512)

DEFINE_COLUMNS(i8_512_, int8_t, AVX512)

int sf_panel_isa(int want);    /* panel_gemm.c: the instruction set the calls take (1: AVX-512) */

/* Returns 0, or -1 when M is outside 1..16 (the caller takes another path). SCALES: the int8
 * entry's extra argument (and SCALE_ARG what the columns get: it, or NULL). */
#define COMMA_SCALES , const float *scales
#define DEFINE_ENTRY(NAME, SFX, WT, SCALES)                                                      \
int NAME(const float *x, const WT *w, const float *bias, float *y,                               \
         int64_t M, int64_t K, int64_t N, int threads SCALES) {                                  \
    if (M < 1 || M > 16) return -1;                                                              \
    const int64_t chunk = 64;                      /* output columns per task */                 \
    const int64_t tasks = (N + chunk - 1) / chunk;                                               \
    if (threads <= 1 || tasks < 2) {                                                             \
        columns_##SFX(x, w, SCALE_ARG, bias, y, M, K, N, 0, N);                                  \
        return 0;                                                                                \
    }                                                                                            \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                            \
    for (int64_t t = 0; t < tasks; t++) {                                                        \
        int64_t n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;                            \
        columns_##SFX(x, w, SCALE_ARG, bias, y, M, K, N, n0, n1);                                \
    }                                                                                            \
    return 0;                                                                                    \
}

#define SCALE_ARG NULL
/* fp32 weights */
DEFINE_ENTRY(sf_skinny_linear, f32_, float, )
/* fp16 weights (IEEE half, as torch.float16 stores them), fp32 activations and accumulation */
DEFINE_ENTRY(sf_skinny_linear_f16w, f16_, uint16_t, )
#undef SCALE_ARG
#define SCALE_ARG scales
/* int8 weights, one fp32 scale per weight row (drafts: `models.transformer.use_draft_weights`), on
 * AVX-512 where sf_panel_isa takes it, else AVX2 */
DEFINE_ENTRY(skinny_linear_i8w_avx2, i8_, int8_t, COMMA_SCALES)
DEFINE_ENTRY(skinny_linear_i8w_avx512, i8_512_, int8_t, COMMA_SCALES)

int sf_skinny_linear_i8w(const float *x, const int8_t *w, const float *bias, float *y,
                         int64_t M, int64_t K, int64_t N, int threads, const float *scales) {
    return (sf_panel_isa(-1) ? skinny_linear_i8w_avx512 : skinny_linear_i8w_avx2)(x, w, bias, y, M, K, N,
                                                                                 threads, scales);
}
