/* y[M, N] = x[M, K] @ W^T (+ bias[N]) for few rows M (1..16), fp32, AVX2 + FMA, with the weight
 * repacked once into panels of 16 output columns: wp[p, k, c] = W[16 p + c, k] (the last panel
 * padded with zeros), one sequential stream of K * 16 floats a panel.
 *
 * skinny_gemm.c reads W as nn.Linear stores it ([N, K]): each output is a dot product along k, and
 * every 8 of its FMAs load 8 x vectors beside the weight's 2, so beyond 4 rows the loads bound it.
 * Here each output keeps its own 16-column accumulator pair per row, fed by k in order: a k step
 * loads the panel's 2 vectors and broadcasts one x value per row, 2 + G loads for 2 G FMAs (G up
 * to 6 rows a pass), and a pass reads the panel once for all its rows.
 *
 * Every output element y[m, n] is the same sequence of operations whatever M is and whichever
 * rows share the call: s = 0, then s = fma(x[m, k], W[n, k], s) for k = 0 .. K-1 in order, then
 * + bias[n]. A row's results do not depend on the other rows (nor on the thread count).
 */
#include <immintrin.h>
#include <stdint.h>

#define PANEL 16

#ifndef PANEL_PREFETCH
#define PANEL_PREFETCH 32     /* k steps ahead (64 bytes each) */
#endif

/* Rows x[0..G) against one panel over k in [k0, k1): their accumulators ([G, 16] in acc) are
 * loaded, fed, and stored back (a store and a load leave the values as they are). */
#define DEFINE_PASS(G)                                                                           \
static inline void pass_##G(const float *x, const float *wp, float *acc, int64_t K, int64_t k0,  \
                            int64_t k1) {                                                        \
    __m256 a0[G], a1[G];                                                                         \
    _Pragma("GCC unroll 8") for (int m = 0; m < (G); m++) {                                      \
        a0[m] = _mm256_loadu_ps(acc + m * PANEL);                                                \
        a1[m] = _mm256_loadu_ps(acc + m * PANEL + 8);                                            \
    }                                                                                            \
    for (int64_t k = k0; k < k1; k++) {                                                          \
        const float *w = wp + k * PANEL;                                                         \
        _mm_prefetch((const char *)(w + PANEL_PREFETCH * PANEL), _MM_HINT_T0);                   \
        const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);                       \
        _Pragma("GCC unroll 8") for (int m = 0; m < (G); m++) {                                  \
            const __m256 xb = _mm256_broadcast_ss(x + m * K + k);                                \
            a0[m] = _mm256_fmadd_ps(xb, w0, a0[m]);                                              \
            a1[m] = _mm256_fmadd_ps(xb, w1, a1[m]);                                              \
        }                                                                                        \
    }                                                                                            \
    _Pragma("GCC unroll 8") for (int m = 0; m < (G); m++) {                                      \
        _mm256_storeu_ps(acc + m * PANEL, a0[m]);                                                \
        _mm256_storeu_ps(acc + m * PANEL + 8, a1[m]);                                            \
    }                                                                                            \
}

DEFINE_PASS(1)
DEFINE_PASS(2)
DEFINE_PASS(3)
DEFINE_PASS(4)
DEFINE_PASS(5)
DEFINE_PASS(6)

#define K_BLOCK 128    /* k steps a block (8 KB of the panel): passes after the first read it from L1 */

/* Every row against panel p: up to 6 rows, one pass over the panel; more, the rows split evenly
 * into passes (8 = 4 + 4) that take the panel a k block at a time. */
static void panel_rows(const float *x, const float *wp, const float *bias, float *y, int64_t M, int64_t K,
                       int64_t N, int64_t p) {
    const int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
    const float *w = wp + p * K * PANEL;
    const int64_t passes = (M + 5) / 6, per = (M + passes - 1) / passes;
    const int64_t kb = passes > 1 ? K_BLOCK : K;
    float acc[16 * PANEL] = {0};
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
        const int64_t k1 = k0 + kb < K ? k0 + kb : K;
        for (int64_t m0 = 0; m0 < M; m0 += per) {
            const float *xg = x + m0 * K;
            float *ag = acc + m0 * PANEL;
            switch (M - m0 < per ? M - m0 : per) {
                case 1: pass_1(xg, w, ag, K, k0, k1); break;
                case 2: pass_2(xg, w, ag, K, k0, k1); break;
                case 3: pass_3(xg, w, ag, K, k0, k1); break;
                case 4: pass_4(xg, w, ag, K, k0, k1); break;
                case 5: pass_5(xg, w, ag, K, k0, k1); break;
                default: pass_6(xg, w, ag, K, k0, k1); break;
            }
        }
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < cols; c++) y[m * N + n0 + c] = acc[m * PANEL + c] + (bias ? bias[n0 + c] : 0.0f);
}

/* Returns 0, or -1 when M is outside 1..16. wp: ceil(N / 16) panels of [K, 16]. */
int sf_panel_linear(const float *x, const float *wp, const float *bias, float *y, int64_t M, int64_t K,
                    int64_t N, int threads) {
    if (M < 1 || M > 16) return -1;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    if (threads <= 1 || panels < 2) {
        for (int64_t p = 0; p < panels; p++) panel_rows(x, wp, bias, y, M, K, N, p);
        return 0;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) panel_rows(x, wp, bias, y, M, K, N, p);
    return 0;
}
