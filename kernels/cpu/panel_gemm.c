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
 * Where the CPU has AVX-512 (checked at run time; `sf_panel_isa`), every row of the call shares one
 * pass: a panel's 16 columns are one 512-bit register a row, so 7 to 16 rows need no second pass
 * (AVX2's 16 registers hold 6 rows' accumulators), and 1 to 7 rows take 2 to 4 panels at once so
 * that more accumulators hide the FMA's latency (`GROUP_PANELS`; one row reads 4 panels, not 8:
 * measured faster on one thread).
 *
 * Every output element y[m, n] is the same sequence of operations whatever M is, whichever rows
 * share the call and whichever instruction set runs it: s = 0, then s = fma(x[m, k], W[n, k], s)
 * for k = 0 .. K-1 in order, then + bias[n] (+ 0 without one). A row's results do not depend on
 * the other rows, the thread count or the path: AVX2 and AVX-512 give the same bits.
 */
#include <immintrin.h>
#include <omp.h>
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

/* ---- AVX-512: all rows in one pass, P panels at once ---------------------------------------- */

/* Rows x[0..G) against panels p .. p+P-1 (wp: panel p's first float, consecutive panels `stride`
 * floats apart) over every k; their sums, + bias (+ 0 without one), into y. */
#define DEFINE_PASS512(G, P)                                                                     \
__attribute__((target("avx512f")))                                                               \
static void pass512_##G##_##P(const float *x, const float *wp, int64_t stride, const float *bias, \
                              float *y, int64_t K, int64_t N, int64_t n0, int64_t cols) {        \
    __m512 a[(G) * (P)];                                                                         \
    _Pragma("GCC unroll 32") for (int i = 0; i < (G) * (P); i++) a[i] = _mm512_setzero_ps();     \
    for (int64_t k = 0; k < K; k++) {                                                            \
        __m512 w[P];                                                                             \
        _Pragma("GCC unroll 8") for (int j = 0; j < (P); j++) {                                  \
            const float *wk = wp + j * stride + k * PANEL;                                       \
            _mm_prefetch((const char *)(wk + PANEL_PREFETCH * PANEL), _MM_HINT_T0);              \
            w[j] = _mm512_loadu_ps(wk);                                                          \
        }                                                                                        \
        _Pragma("GCC unroll 16") for (int m = 0; m < (G); m++) {                                 \
            const __m512 xb = _mm512_set1_ps(x[m * K + k]);                                      \
            _Pragma("GCC unroll 8") for (int j = 0; j < (P); j++)                                \
                a[m * (P) + j] = _mm512_fmadd_ps(xb, w[j], a[m * (P) + j]);                      \
        }                                                                                        \
    }                                                                                            \
    _Pragma("GCC unroll 8") for (int j = 0; j < (P); j++) {                                      \
        const int64_t c0 = n0 + j * PANEL, left = cols - j * PANEL;                              \
        const int64_t n = left < PANEL ? left : PANEL;                                           \
        const __mmask16 mask = (__mmask16)((1u << n) - 1u);                                      \
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();    \
        _Pragma("GCC unroll 16") for (int m = 0; m < (G); m++)                                   \
            _mm512_mask_storeu_ps(y + m * N + c0, mask, _mm512_add_ps(a[m * (P) + j], b));       \
    }                                                                                            \
}

/* (G, P): G rows against P panels, G x P accumulators and P panels' weights within 32 registers */
DEFINE_PASS512(1, 4)
DEFINE_PASS512(2, 4)
DEFINE_PASS512(3, 3)
DEFINE_PASS512(4, 2)
DEFINE_PASS512(5, 2)
DEFINE_PASS512(6, 2)
DEFINE_PASS512(7, 2)
DEFINE_PASS512(8, 1)
DEFINE_PASS512(9, 1)
DEFINE_PASS512(10, 1)
DEFINE_PASS512(11, 1)
DEFINE_PASS512(12, 1)
DEFINE_PASS512(13, 1)
DEFINE_PASS512(14, 1)
DEFINE_PASS512(15, 1)
DEFINE_PASS512(16, 1)
/* one panel at a time, for the panels left over after the groups of P */
DEFINE_PASS512(1, 1)
DEFINE_PASS512(2, 1)
DEFINE_PASS512(3, 1)
DEFINE_PASS512(4, 1)
DEFINE_PASS512(5, 1)
DEFINE_PASS512(6, 1)
DEFINE_PASS512(7, 1)

typedef void (*pass512_fn)(const float *, const float *, int64_t, const float *, float *, int64_t, int64_t,
                           int64_t, int64_t);
static const pass512_fn GROUP512[17] = {0, pass512_1_4, pass512_2_4, pass512_3_3, pass512_4_2, pass512_5_2,
    pass512_6_2, pass512_7_2, pass512_8_1, pass512_9_1, pass512_10_1, pass512_11_1, pass512_12_1, pass512_13_1,
    pass512_14_1, pass512_15_1, pass512_16_1};
static const int GROUP_PANELS[17] = {0, 4, 4, 3, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1};
/* a leftover panel of 1 to 7 rows (8 and more take one panel a group already) */
static const pass512_fn SINGLE512[8] = {0, pass512_1_1, pass512_2_1, pass512_3_1, pass512_4_1, pass512_5_1,
    pass512_6_1, pass512_7_1};

/* Panels [p, p + P) of the M rows (P the group's size, or 1 for a leftover panel). */
static void avx512_rows(const float *x, const float *wp, const float *bias, float *y, int64_t M, int64_t K,
                        int64_t N, int64_t p, int64_t P) {
    const int64_t n0 = p * PANEL, cols = N - n0 < P * PANEL ? N - n0 : P * PANEL;
    const pass512_fn pass = P == GROUP_PANELS[M] ? GROUP512[M] : SINGLE512[M];
    pass(x, wp + p * K * PANEL, K * PANEL, bias, y, K, N, n0, cols);
}

/* -1: not yet decided; 0: AVX2; 1: AVX-512 */
static int isa512 = -1;

/* The path of the calls that follow: `want` 0 AVX2, 1 AVX-512 where the CPU has it, -1 leave it
 * (first use: AVX-512 where the CPU has it). Returns the path now taken (0 or 1). */
int sf_panel_isa(int want) {
    if (want >= 0 || isa512 < 0) {
        __builtin_cpu_init();
        const int has = __builtin_cpu_supports("avx512f");
        isa512 = (want < 0 ? 1 : want) && has;
    }
    return isa512;
}

/* Returns 0, or -1 when M is outside 1..16. wp: ceil(N / 16) panels of [K, 16]. */
int sf_panel_linear(const float *x, const float *wp, const float *bias, float *y, int64_t M, int64_t K,
                    int64_t N, int threads) {
    if (M < 1 || M > 16) return -1;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    if (sf_panel_isa(-1)) {
        /* each thread an even share of the panels, in groups of P and then one at a time */
        const int64_t P = GROUP_PANELS[M];
        #pragma omp parallel num_threads(threads) if (threads > 1 && panels > 1)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t end = panels * (t + 1) / nt;
            int64_t p = panels * t / nt;
            for (; p + P <= end; p += P) avx512_rows(x, wp, bias, y, M, K, N, p, P);
            for (; p < end; p++) avx512_rows(x, wp, bias, y, M, K, N, p, 1);
        }
        return 0;
    }
    if (threads <= 1 || panels < 2) {
        for (int64_t p = 0; p < panels; p++) panel_rows(x, wp, bias, y, M, K, N, p);
        return 0;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) panel_rows(x, wp, bias, y, M, K, N, p);
    return 0;
}
