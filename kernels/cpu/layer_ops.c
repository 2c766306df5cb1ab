/* The work of a decoder layer between its matmuls, for CPU fp32 decoding and tree verification:
 * RMSNorm, RoPE with the cache write, tree attention over the paged cache, SiLU(gate) * up.
 *
 * In torch these are ~40 small operators a layer (SmolLM2-135M, one new token: ~9 ms of a
 * 26 ms forward on two cores, most of it dispatch); here they are four calls.
 *
 * Every result of a row is the same sequence of operations whatever the other rows of the
 * call are, so a token's hidden states do not depend on how many tokens were verified with it:
 * - norms and SiLU work on one row at a time (8-lane chunks in order, a fixed horizontal sum);
 * - attention reads, for each query row, the cache slots it may see as one ordered list (its
 *   prefix, then its tree ancestors, then itself: `visible`), so a path's token sees the same
 *   keys in the same order in a tree of any shape as when it is decoded alone; the softmax sum
 *   and the weighted sum of values run over that list in order.
 * D (the head size) must be a multiple of 8 and at most 256 (the caller checks).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

/* exp(x) for 8 lanes: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n
 * through the exponent bits. Relative error ~2e-7; inputs below -87.3 give 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* Eight lanes of p[i .. i + 8), the lanes at or past `count` as `fill`. */
static inline __m256 load_tail(const float *p, int64_t i, int64_t count, float fill) {
    if (i + 8 <= count) return _mm256_loadu_ps(p + i);
    float tmp[8];
    for (int l = 0; l < 8; l++) tmp[l] = i + l < count ? p[i + l] : fill;
    return _mm256_loadu_ps(tmp);
}

/* Stores the lanes of v below `count` to p[i .. i + 8). */
static inline void store_tail(float *p, int64_t i, int64_t count, __m256 v) {
    if (i + 8 <= count) {
        _mm256_storeu_ps(p + i, v);
        return;
    }
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    for (int64_t l = 0; i + l < count; l++) p[i + l] = tmp[l];
}

/* out[n] = w * (x[n] / sqrt(mean(x[n]^2) + eps)), rows of H. */
void sf_rms_norm(const float *x, const float *w, float *out, int64_t N, int64_t H, float eps) {
    for (int64_t n = 0; n < N; n++) {
        const float *xr = x + n * H;
        float *yr = out + n * H;
        __m256 acc = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= H; k += 8) {
            __m256 v = _mm256_loadu_ps(xr + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (; k < H; k++) ss = __builtin_fmaf(xr[k], xr[k], ss);
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (k = 0; k + 8 <= H; k += 8)
            _mm256_storeu_ps(yr + k, _mm256_mul_ps(_mm256_loadu_ps(w + k),
                                                   _mm256_mul_ps(_mm256_loadu_ps(xr + k), _mm256_set1_ps(r))));
        for (; k < H; k++) yr[k] = w[k] * (xr[k] * r);
    }
}

/* out[n, :I] = silu(gu[n, :I]) * gu[n, I:2I], silu(g) = g / (1 + e^-g). */
void sf_silu_mul(const float *gu, float *out, int64_t N, int64_t I) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t n = 0; n < N; n++) {
        const float *g = gu + n * 2 * I, *u = g + I;
        float *y = out + n * I;
        for (int64_t k = 0; k < I; k += 8) {
            __m256 gv = load_tail(g, k, I, 0.0f), uv = load_tail(u, k, I, 0.0f);
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            store_tail(y, k, I, _mm256_mul_ps(s, uv));
        }
    }
}

/* Rotate-half RoPE on the q and k heads of each row of qkv [N, (Hq + 2 Hkv) D] in place
 * (cos, sin: [N, D/2]), then copy the row's k and v heads to cache slot slots[n] of
 * k_cache / v_cache ([slots, Hkv, D]). */
void sf_rope_store(float *qkv, const float *cos, const float *sin, float *k_cache, float *v_cache,
                   const int64_t *slots, int64_t N, int64_t Hq, int64_t Hkv, int64_t D) {
    const int64_t half = D / 2, width = (Hq + 2 * Hkv) * D;
    for (int64_t n = 0; n < N; n++) {
        float *row = qkv + n * width;
        const float *c = cos + n * half, *s = sin + n * half;
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            float *x1 = row + h * D, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
        float *kd = k_cache + slots[n] * Hkv * D, *vd = v_cache + slots[n] * Hkv * D;
        const float *ks = row + Hq * D, *vs = row + (Hq + Hkv) * D;
        for (int64_t i = 0; i < Hkv * D; i++) {
            kd[i] = ks[i];
            vd[i] = vs[i];
        }
    }
}

static inline float dot_d(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    return hsum8(acc);
}

/* One query head of one row: softmax(q . k_j * scale) over the ordered visible slots j, then
 * the weighted sum of their values into out (D floats). scores: count floats of scratch. */
static void attend_one(const float *q, const float *k_cache, const float *v_cache, const int64_t *vis,
                       int64_t count, int64_t kvh, int64_t Hkv, int64_t D, float scale, float *scores,
                       float *out) {
    if (count == 0) {                             /* a padding row that sees nothing: zeros */
        for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
        return;
    }
    float mx = -INFINITY;
    for (int64_t j = 0; j < count; j++) {
        const float sc = dot_d(q, k_cache + (vis[j] * Hkv + kvh) * D, D) * scale;
        scores[j] = sc;
        mx = sc > mx ? sc : mx;
    }
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 sumv = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; j += 8) {
        __m256 p = exp8(_mm256_sub_ps(load_tail(scores, j, count, -INFINITY), mv));
        sumv = _mm256_add_ps(sumv, p);
        store_tail(scores, j, count, p);
    }
    const float inv = 1.0f / hsum8(sumv);
    __m256 acc[32];                               /* D <= 256 */
    const int64_t chunks = D / 8;
    for (int64_t c = 0; c < chunks; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; j++) {
        const float *v = v_cache + (vis[j] * Hkv + kvh) * D;
        const __m256 p = _mm256_set1_ps(scores[j]);
        for (int64_t c = 0; c < chunks; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
    }
    for (int64_t c = 0; c < chunks; c++) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(acc[c], _mm256_set1_ps(inv)));
}

/* Tree attention of R query rows: row r's q heads at q + r * q_stride ([Hq, D]), its visible
 * cache slots vis[r, :counts[r]] (row stride S, in order), its output out[r] ([Hq, D]).
 * Query head h reads kv head h / (Hq / Hkv). scratch: threads * S floats. */
void sf_tree_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                       const int64_t *vis, const int64_t *counts, int64_t S, float *out, int64_t R,
                       int64_t Hq, int64_t Hkv, int64_t D, float scale, float *scratch, int threads) {
    const int64_t G = Hq / Hkv, tasks = R * Hq;
    int64_t work = 0;
    for (int64_t r = 0; r < R; r++) work += counts[r];
    work *= Hq * D;
    if (threads < 1 || work < 200000) threads = 1;      /* a short decode step: one thread */
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t r = t / Hq, h = t % Hq;
#ifdef _OPENMP
        float *scores = scratch + (int64_t)omp_get_thread_num() * S;
#else
        float *scores = scratch;
#endif
        attend_one(q + r * q_stride + h * D, k_cache, v_cache, vis + r * S, counts[r], h / G, Hkv, D, scale,
                   scores, out + (r * Hq + h) * D);
    }
}

/* What each query row of a forward sees, as `sf_tree_attention` reads it: B sequences of T new
 * tokens (prefix_lens[b] cached before them, their pages in block_tables[b, :W], block_size
 * slots a page), tree_mask [B, T, T] (node j is node i or its ancestor). Row (b, i) sees its
 * prefix's positions in order, then the tree nodes j it may see in index order (node j sits at
 * position prefix + j): vis[(b T + i), :counts[..]] their cache slots, the rest of the row
 * (S wide) repeating the last. With window > 0 (a sliding window) node i, at position
 * prefix + depth i, sees prefix positions above that less window and ancestors less than
 * window levels up. rows[b T + i]: the cache slot node i itself is written to. Returns 0, or -1
 * when the window's scratch cannot be allocated. */
int sf_visible_slots(const int32_t *block_tables, int64_t W, const int64_t *prefix_lens, const uint8_t *tree_mask,
                      int64_t B, int64_t T, int64_t block_size, int64_t window, int64_t S, int64_t *vis,
                      int64_t *counts, int64_t *rows) {
    /* with a window, each node's depth (its ancestors), counted once a sequence */
    int64_t *depth = window > 0 && T > 0 ? (int64_t *)malloc((size_t)T * sizeof(int64_t)) : NULL;
    if (window > 0 && T > 0 && !depth) return -1;
    for (int64_t b = 0; b < B; b++) {
        const int32_t *table = block_tables + b * W;
        const int64_t P = prefix_lens[b];
        const uint8_t *mask = tree_mask + b * T * T;
        if (depth)
            for (int64_t i = 0; i < T; i++) {
                depth[i] = -1;
                for (int64_t j = 0; j < T; j++) depth[i] += mask[i * T + j] != 0;
            }
        for (int64_t i = 0; i < T; i++) {
            int64_t *out = vis + (b * T + i) * S, n = 0, first = 0;
            if (depth && P + depth[i] - window + 1 > 0) first = P + depth[i] - window + 1;
            for (int64_t p = first; p < P; p++) out[n++] = (int64_t)table[p / block_size] * block_size + p % block_size;
            for (int64_t j = 0; j < T; j++) {
                if (!mask[i * T + j] || (depth && depth[i] - depth[j] >= window)) continue;
                const int64_t p = P + j;
                out[n++] = (int64_t)table[p / block_size] * block_size + p % block_size;
            }
            const int64_t own = P + i;
            rows[b * T + i] = (int64_t)table[own / block_size] * block_size + own % block_size;
            counts[b * T + i] = n;
            for (int64_t k = n; k < S; k++) out[k] = n ? out[n - 1] : rows[b * T + i];
        }
    }
    free(depth);
    return 0;
}

/* Each of N rows of logits [N, V]: the index of its largest entry (the first of equals) and that
 * entry's log-softmax, -log(sum_j exp(x_j - max)) (a greedy draft's choice and its log q). */
void sf_greedy_pick(const float *logits, int64_t N, int64_t V, int64_t *index, float *log_q) {
    for (int64_t r = 0; r < N; r++) {
        const float *x = logits + r * V;
        int64_t best = 0;
        for (int64_t j = 1; j < V; j++)
            if (x[j] > x[best]) best = j;
        const __m256 mv = _mm256_set1_ps(x[best]);
        __m256 sumv = _mm256_setzero_ps();
        for (int64_t j = 0; j < V; j += 8)
            sumv = _mm256_add_ps(sumv, exp8(_mm256_sub_ps(load_tail(x, j, V, -INFINITY), mv)));
        index[r] = best;
        log_q[r] = -logf(hsum8(sumv));
    }
}

int sf_cut_pick(const float *x, int64_t V, float temp, float min_p, int64_t top_k, float top_p, const float *g,
                int64_t *index, float *log_q, float *q);

/* Each of N rows of logits [N, V] drawn as a draft node's children are: row r at temperature
 * temps[r] reads y = x / temps[r] and takes the first largest y_j + noise[r, j] (Gumbel noise:
 * an exact draw from softmax(y)); index[r], its log-softmax y_best - max y - log(sum_j exp(y_j -
 * max y)) in log_q[r] and softmax(y) in q[r, :] (the q the draw came from). A row at temperature 0
 * is sf_greedy_pick's (its q row left as it was). y is kept in q's row. A row with a cut (min_p,
 * top_k, top_p: per row, NULL for none; 0, 0, 1 for none) is sf_cut_pick's (sample_cut.c). Returns
 * 0, or -1 where a cut's scratch could not be had. */
int sf_sample_pick(const float *logits, int64_t N, int64_t V, const float *temps, const float *noise,
                   int64_t *index, float *log_q, float *q, const float *min_p, const int64_t *top_k,
                   const float *top_p) {
    for (int64_t r = 0; r < N; r++) {
        if (temps[r] == 0.0f) {
            sf_greedy_pick(logits + r * V, 1, V, index + r, log_q + r);
            continue;
        }
        if ((min_p && min_p[r] > 0.0f) || (top_k && top_k[r] > 0 && top_k[r] < V) || (top_p && top_p[r] < 1.0f)) {
            if (sf_cut_pick(logits + r * V, V, temps[r], min_p ? min_p[r] : 0.0f, top_k ? top_k[r] : 0,
                            top_p ? top_p[r] : 1.0f, noise + r * V, index + r, log_q + r, q + r * V))
                return -1;
            continue;
        }
        const float *x = logits + r * V, *g = noise + r * V;
        float *y = q + r * V, top = -INFINITY, best_score = -INFINITY, best_y = 0.0f;
        int64_t best = 0;
        for (int64_t j = 0; j < V; j++) {
            y[j] = x[j] / temps[r];
            if (y[j] > top) top = y[j];
            if (y[j] + g[j] > best_score) {
                best_score = y[j] + g[j];
                best = j;
                best_y = y[j];
            }
        }
        const __m256 mv = _mm256_set1_ps(top);
        __m256 sumv = _mm256_setzero_ps();
        for (int64_t j = 0; j < V; j += 8) {
            __m256 e = exp8(_mm256_sub_ps(load_tail(y, j, V, -INFINITY), mv));
            store_tail(y, j, V, e);
            sumv = _mm256_add_ps(sumv, e);
        }
        const float sum = hsum8(sumv), inv = 1.0f / sum;
        index[r] = best;
        log_q[r] = best_y - top - logf(sum);
        for (int64_t j = 0; j < V; j++) y[j] *= inv;
    }
    return 0;
}

/* SplitMix64's finaliser (Steele, Lea and Flood 2014), as models/sampling.py's _splitmix64. */
static inline uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* The 53 random bits of token tokens[j] (j itself where tokens is NULL) under a position's key. */
static inline uint64_t token_bits(uint64_t key, const int64_t *tokens, int64_t j) {
    return mix64(key ^ (uint64_t)(tokens ? tokens[j] : j)) >> 11;
}

/* The Gumbel noise of 53 random bits: u = (bits + 1/2) / 2^53 in (0, 1), -log(-log u)
 * (models.sampling.gumbel_noise). */
static inline double gumbel_of_bits(uint64_t bits53) {
    return -log(-log(((double)bits53 + 0.5) * 0x1.0p-53));
}

/* out [N, V]: the Gumbel noise of token tokens[j] (j itself where tokens is NULL) at the position
 * whose key is keys[r] (models.sampling._position_keys). */
void sf_gumbel_noise(const int64_t *keys, int64_t N, const int64_t *tokens, int64_t V, float *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N * V > 16384)
    for (int64_t i = 0; i < N * V; i++) {
        const int64_t r = i / V, j = i % V;
        out[i] = (float)gumbel_of_bits(token_bits((uint64_t)keys[r], tokens, j));
    }
}

/* Row r of probs [N, V] perturbed as log p + G (G: sf_gumbel_noise's under keys[r]) where that
 * can be among the row's k largest, -inf elsewhere: the same k largest, without the logarithms
 * of the rest. Every G is at most the row's largest, G_max (the largest random bits), and k
 * tokens of the largest p score at least L, the smallest of their scores; a token with log p <
 * L - G_max - 1e-3 cannot reach the k largest. k is 1 to 16. */
void sf_coupled_top(const float *probs, const int64_t *keys, int64_t N, const int64_t *tokens, int64_t V,
                    int64_t k, float *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N > 1)
    for (int64_t r = 0; r < N; r++) {
        const float *p = probs + r * V;
        float *o = out + r * V;
        const uint64_t key = (uint64_t)keys[r];
        uint64_t top_bits = 0;
        for (int64_t j = 0; j < V; j++) {         /* the row's largest random bits: G_max */
            const uint64_t b = token_bits(key, tokens, j);
            top_bits = b > top_bits ? b : top_bits;
        }
        int64_t best[16], n = 0;                  /* the k largest p, largest first */
        for (int64_t j = 0; j < V; j++) {
            o[j] = -INFINITY;
            if (p[j] > 0.0f && (n < k || p[j] > p[best[n - 1]])) {
                int64_t at = n < k ? n++ : n - 1;
                while (at > 0 && p[best[at - 1]] < p[j]) { best[at] = best[at - 1]; at--; }
                best[at] = j;
            }
        }
        if (n == 0) continue;
        float low = INFINITY;
        for (int64_t i = 0; i < n; i++) {
            const int64_t j = best[i];
            const float s = logf(p[j]) + (float)gumbel_of_bits(token_bits(key, tokens, j));
            low = s < low ? s : low;
        }
        const float floor_p = (float)exp((double)low - gumbel_of_bits(top_bits) - 1e-3);
        for (int64_t j = 0; j < V; j++)
            if (p[j] > 0.0f && p[j] >= floor_p)
                o[j] = logf(p[j]) + (float)gumbel_of_bits(token_bits(key, tokens, j));
    }
}
