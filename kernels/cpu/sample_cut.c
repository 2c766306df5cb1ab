/* A sampled draft row's truncation in C: min-p, top-k and top-p after the temperature, the
 * rules of models/sampling.py's logits_to_probs, so that a chain drawn in the one-call pass
 * (models/draft_chain.py) under a request's nucleus or top-k draws from the q the one-level path
 * would (equal but for float rounding at a cut's edge: the verifier reads the q the draw came
 * from, so either is exact).
 *
 * - min-p: drop y_j with exp(y_j - max y) < min_p (a token's probability under min_p times the
 *   largest);
 * - top-k: drop y_j below the k-th largest of what min-p kept (ties with it stay);
 * - top-p: sorted by probability descending, ties by lower index first, drop every token whose
 *   mass before it is at least top_p (the first always stays). Only candidates are sorted: the
 *   tokens of the top power-of-two buckets of probability that hold top_p and a margin; every
 *   other token is smaller than all of them, and the full sort would drop it too.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CUT_BUCKETS 160            /* powers of two down to 2^-159: below every float's probability */
#define CUT_MARGIN 1e-4            /* the mass beyond top_p the candidates must hold (rounding) */

typedef struct {
    float p;
    int64_t j;
} cut_cand;

static int by_p_then_index(const void *a, const void *b) {
    const cut_cand *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return (x->j > y->j) - (x->j < y->j);
}

/* The k-th largest of work[0 .. n) (1 <= k <= n), reordering work (quickselect, Hoare's scheme). */
static float kth_largest(float *work, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    const int64_t want = k - 1;
    while (lo < hi) {
        const float pivot = work[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (work[i] > pivot) i++;
            while (work[j] < pivot) j--;
            if (i <= j) {
                const float t = work[i];
                work[i++] = work[j];
                work[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return work[want];
    }
    return work[want];
}

/* A positive probability's bucket: p = m 2^e with m in [0.5, 1), bucket -e (larger p, lower bucket). */
static inline int bucket_of(float p) {
    int e;
    frexpf(p, &e);
    return e > 0 ? 0 : (-e < CUT_BUCKETS ? -e : CUT_BUCKETS - 1);
}

/* q [V] (probabilities summing to 1): zero every token the nucleus top_p drops; returns the mass
 * left. cand [V] is scratch. */
static double top_p_cut(float *q, int64_t V, float top_p, cut_cand *cand) {
    double mass[CUT_BUCKETS] = {0};
    for (int64_t j = 0; j < V; j++)
        if (q[j] > 0.0f) mass[bucket_of(q[j])] += q[j];
    int last = 0;
    for (double held = mass[0]; last < CUT_BUCKETS - 1 && held < top_p + CUT_MARGIN; held += mass[++last]) {}
    int64_t n = 0;
    for (int64_t j = 0; j < V; j++) {
        if (q[j] <= 0.0f) continue;
        if (bucket_of(q[j]) <= last) cand[n++] = (cut_cand){q[j], j};
        q[j] = 0.0f;                                    /* a candidate the cut keeps comes back below */
    }
    qsort(cand, (size_t)n, sizeof(cut_cand), by_p_then_index);
    double before = 0.0;
    for (int64_t i = 0; i < n && before < top_p; i++) {
        q[cand[i].j] = cand[i].p;
        before += cand[i].p;
    }
    return before;
}

/* Row y [V] (logits / temperature, its largest `top`) → q [V] (y itself may be q): the
 * probabilities after min-p (0: off), top-k (0 or >= V: off) and top-p (1: off), normalised over
 * what they keep. Returns 0, or -1 where scratch could not be had. */
static int cut_row(const float *y, int64_t V, float top, float min_p, int64_t top_k, float top_p, float *q) {
    float floor_y = min_p > 0.0f ? top + logf(min_p) : -INFINITY;
    if (top_k > 0 && top_k < V) {
        float *work = malloc((size_t)V * sizeof(float));
        if (!work) return -1;
        for (int64_t j = 0; j < V; j++) work[j] = y[j] < floor_y ? -INFINITY : y[j];
        const float kth = kth_largest(work, V, top_k);
        free(work);
        floor_y = kth > floor_y ? kth : floor_y;
    }
    double sum = 0.0;
    for (int64_t j = 0; j < V; j++) {
        q[j] = y[j] >= floor_y ? expf(y[j] - top) : 0.0f;
        sum += q[j];
    }
    for (int64_t j = 0; j < V; j++) q[j] = (float)(q[j] / sum);
    if (top_p < 1.0f) {
        cut_cand *cand = malloc((size_t)V * sizeof(cut_cand));
        if (!cand) return -1;
        const double kept = top_p_cut(q, V, top_p, cand);
        free(cand);
        for (int64_t j = 0; j < V; j++) q[j] = (float)(q[j] / kept);
    }
    return 0;
}

/* A sampled draft row drawn under a cut (sf_sample_pick's, for a row with min-p, top-k or top-p):
 * logits x [V] at temperature temp, q [V] the cut's probabilities (cut_row), index the first
 * largest log q_j + g_j over the tokens kept (Gumbel-max: an exact draw from q), log_q its log q.
 * Returns 0, or -1 where scratch could not be had. */
int sf_cut_pick(const float *x, int64_t V, float temp, float min_p, int64_t top_k, float top_p, const float *g,
                int64_t *index, float *log_q, float *q) {
    float top = -INFINITY;
    for (int64_t j = 0; j < V; j++) {
        q[j] = x[j] / temp;
        top = q[j] > top ? q[j] : top;
    }
    if (cut_row(q, V, top, min_p, top_k, top_p, q)) return -1;
    float best_score = -INFINITY;
    int64_t best = 0;
    for (int64_t j = 0; j < V; j++) {
        if (q[j] <= 0.0f) continue;
        const float score = logf(q[j]) + g[j];
        if (score > best_score) {
            best_score = score;
            best = j;
        }
    }
    *index = best;
    *log_q = logf(q[best]);
    return 0;
}

/* The history transforms of a draft pass's rows (models/sampling.py's process_logits, on the
 * head's V columns), level d of N chains: logits [N, V] in place, x = logit + bias (NULL: none);
 * a stop column (stops [N, V], NULL: none) -inf while d < stop_levels[r] (min_tokens); where
 * seen (seen [N, V]: prompt, output, the chain so far) x / rep if x > 0 else x * rep; then
 * x - frequency * count - presence * (count > 0) (counts [N, V]); pen [N, 3] = (presence,
 * frequency, repetition) per chain. The same float operations in the same order as torch's. */
__attribute__((optimize("fp-contract=off")))
void sf_history_apply(float *logits, int64_t N, int64_t V, int64_t d, const float *bias, const float *counts,
                      const uint8_t *seen, const uint8_t *stops, const int64_t *stop_levels, const float *pen) {
    for (int64_t r = 0; r < N; r++) {
        float *x = logits + r * V;
        const float presence = pen[3 * r], frequency = pen[3 * r + 1], rep = pen[3 * r + 2];
        const int stop = stops && d < stop_levels[r];
        for (int64_t j = 0; j < V; j++) {
            float v = bias ? x[j] + bias[r * V + j] : x[j];
            if (stop && stops[r * V + j]) v = -INFINITY;
            if (rep != 1.0f && seen[r * V + j]) v = v > 0.0f ? v / rep : v * rep;
            const float c = counts[r * V + j];
            v = v - frequency * c;
            v = v - presence * (c > 0.0f ? 1.0f : 0.0f);
            x[j] = v;
        }
    }
}

/* Each chain's pick (column picked[r]) joins its history: counted once more, seen. */
void sf_history_take(const int64_t *picked, int64_t N, int64_t V, float *counts, uint8_t *seen) {
    for (int64_t r = 0; r < N; r++) {
        counts[r * V + picked[r]] += 1.0f;
        seen[r * V + picked[r]] = 1;
    }
}
