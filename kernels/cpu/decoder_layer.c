/* A whole decoder layer in one call, for CPU fp32 forwards of 1 to 16 rows (plain decoding,
 * tree verification, draft passes): the few-row matmuls (panel_gemm.c, skinny_gemm.c) and the operators of
 * layer_ops.c, in the order models.transformer.DecoderLayer.forward runs them:
 *
 *   h += o_proj(attention(rope_store(qkv_proj(rms_norm(h)))))
 *   h += down_proj(silu_mul(gate_up_proj(rms_norm(h))))
 *
 * Python called each of those nine steps on its own (~300 calls a forward of SmolLM2-135M,
 * each a few microseconds of argument checks, tensor allocation and ctypes marshalling: ~15 %
 * of a 12 ms one-row forward); here a forward is one call per layer. Every step is the same
 * function with the same arguments as the per-step path, so the results are the same bits.
 */
#include <stdint.h>

int sf_skinny_linear(const float *x, const float *w, const float *bias, float *y,
                     int64_t M, int64_t K, int64_t N, int threads);
int sf_skinny_linear_f16w(const float *x, const uint16_t *w, const float *bias, float *y,
                          int64_t M, int64_t K, int64_t N, int threads);
int sf_skinny_linear_i8w(const float *x, const int8_t *w, const float *bias, float *y,
                         int64_t M, int64_t K, int64_t N, int threads, const float *scales);
int sf_panel_linear(const float *x, const float *wp, const float *bias, float *y, int64_t M, int64_t K,
                    int64_t N, int threads);
void sf_rms_norm(const float *x, const float *w, float *out, int64_t N, int64_t H, float eps);
void sf_silu_mul(const float *gu, float *out, int64_t N, int64_t I);
void sf_rope_store(float *qkv, const float *cos, const float *sin, float *k_cache, float *v_cache,
                   const int64_t *slots, int64_t N, int64_t Hq, int64_t Hkv, int64_t D);
void sf_tree_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                       const int64_t *vis, const int64_t *counts, int64_t S, float *out, int64_t R,
                       int64_t Hq, int64_t Hkv, int64_t D, float scale, float *scratch, int threads);

enum { SF_F32 = 0, SF_F16 = 1, SF_I8 = 2, SF_PANELS = 3 };

/* One weight as the few-row matmul reads it: [out, in] in `kind`'s format (int8: with one
 * fp32 scale per row; panels: fp32 repacked for panel_gemm.c), an optional fp32 bias [out]. */
typedef struct {
    const void *w;
    const float *scales;
    const float *bias;
    int64_t kind;
} sf_weight;

/* A layer's parameters and its cache pages ([slots, Hkv, D] each). windowed: the layer uses
 * the model's sliding window (the forward's second visibility). */
typedef struct {
    const float *attn_norm, *mlp_norm;      /* [H] */
    sf_weight qkv, o, gate_up, down;
    float *k_cache, *v_cache;
    int64_t windowed;
} sf_layer;

/* What every layer of one forward shares: its N rows' RoPE and cache slots, each row's ordered
 * visible slots (full and windowed: [N, S] and [N] counts, see sf_tree_attention), the shapes
 * and the scratch rows. */
typedef struct {
    int64_t N, H, Hq, Hkv, D, I;
    float eps, scale;
    const float *cos, *sin;                 /* [N, D/2] */
    const int64_t *slots;                   /* [N] */
    const int64_t *vis[2], *counts[2];
    int64_t S[2];
    float *xn, *qkv, *attn, *tmp, *gu, *act, *scratch;   /* [N, H], [N, (Hq+2Hkv)D], [N, HqD],
                                                            [N, H], [N, 2I], [N, I], threads * max S */
    int64_t threads;
} sf_forward;

static int linear(const sf_weight *w, const float *x, float *y, int64_t M, int64_t K, int64_t N, int threads) {
    switch (w->kind) {
    case SF_F32: return sf_skinny_linear(x, (const float *)w->w, w->bias, y, M, K, N, threads);
    case SF_F16: return sf_skinny_linear_f16w(x, (const uint16_t *)w->w, w->bias, y, M, K, N, threads);
    case SF_PANELS: return sf_panel_linear(x, (const float *)w->w, w->bias, y, M, K, N, threads);
    case SF_I8: return sf_skinny_linear_i8w(x, (const int8_t *)w->w, w->bias, y, M, K, N, threads, w->scales);
    default: return -2;
    }
}

/* h [N, H] in place. Returns 0, or the failing matmul's code (rows outside 1..16, a bad kind). */
int sf_decoder_layer(const sf_layer *L, const sf_forward *F, float *h) {
    const int64_t N = F->N, H = F->H, Hq = F->Hq, Hkv = F->Hkv, D = F->D, I = F->I;
    const int64_t qkv_w = (Hq + 2 * Hkv) * D, win = L->windowed ? 1 : 0;
    const int th = (int)F->threads;
    int rc;
    sf_rms_norm(h, L->attn_norm, F->xn, N, H, F->eps);
    if ((rc = linear(&L->qkv, F->xn, F->qkv, N, H, qkv_w, th))) return rc;
    sf_rope_store(F->qkv, F->cos, F->sin, L->k_cache, L->v_cache, F->slots, N, Hq, Hkv, D);
    sf_tree_attention(F->qkv, qkv_w, L->k_cache, L->v_cache, F->vis[win], F->counts[win], F->S[win], F->attn,
                      N, Hq, Hkv, D, F->scale, F->scratch, th);
    if ((rc = linear(&L->o, F->attn, F->tmp, N, Hq * D, H, th))) return rc;
    for (int64_t i = 0; i < N * H; i++) h[i] = h[i] + F->tmp[i];
    sf_rms_norm(h, L->mlp_norm, F->xn, N, H, F->eps);
    if ((rc = linear(&L->gate_up, F->xn, F->gu, N, H, 2 * I, th))) return rc;
    sf_silu_mul(F->gu, F->act, N, I);
    if ((rc = linear(&L->down, F->act, F->tmp, N, I, H, th))) return rc;
    for (int64_t i = 0; i < N * H; i++) h[i] = h[i] + F->tmp[i];
    return 0;
}

void sf_greedy_pick(const float *logits, int64_t N, int64_t V, int64_t *index, float *log_q);
int sf_sample_pick(const float *logits, int64_t N, int64_t V, const float *temps, const float *noise,
                   int64_t *index, float *log_q, float *q, const float *min_p, const int64_t *top_k,
                   const float *top_p);
void sf_history_apply(float *logits, int64_t N, int64_t V, int64_t d, const float *bias, const float *counts,
                      const uint8_t *seen, const uint8_t *stops, const int64_t *stop_levels, const float *pen);
void sf_history_take(const int64_t *picked, int64_t N, int64_t V, float *counts, uint8_t *seen);

/* Layers L[0 .. n) of one forward in turn on h (sf_decoder_layer each): a forward's layers in
 * one call. Returns 0 or the first failing layer's code. */
int sf_decoder_layers(const sf_layer *L, int64_t n, const sf_forward *F, float *h) {
    int rc;
    for (int64_t l = 0; l < n; l++)
        if ((rc = sf_decoder_layer(&L[l], F, h))) return rc;
    return 0;
}

/* A row's input: the token's embedding, or with `fc` (a feature-conditioned draft, models/eagle.py)
 * fc([embedding; feature]) through x2 [n, 2H] scratch. */
static int draft_inputs(const float *embed, const int64_t *tok, const sf_weight *fc, const float *feat,
                        float *x2, float *h, int64_t n, int64_t H, int threads) {
    for (int64_t r = 0; r < n; r++) {
        const float *e = embed + tok[r] * H;
        float *dst = fc ? x2 + r * 2 * H : h + r * H;
        for (int64_t i = 0; i < H; i++) dst[i] = e[i];
        if (fc)
            for (int64_t i = 0; i < H; i++) dst[H + i] = feat[r * H + i];
    }
    return fc ? linear(fc, x2, h, n, 2 * H, H, threads) : 0;
}

/* A greedy draft pass of `chains` chains in one call (models/draft_chain.py). First the catch-up:
 * `first_rows` rows (each chain's committed tokens the draft has not seen, root last: its
 * row first_pick[r]) feed first_tokens through the embedding [V_all, H] and every layer; the
 * picked rows go through the final norm and the head [V, H] (`rows`: the token id of each of
 * its V rows, or NULL for all), and each chain's largest logit's token is tokens[0, r], its
 * log-softmax log_q[0, r]. Then `levels` more levels of one row a chain: level d feeds
 * tokens[d - 1, r] and chooses tokens[d, r]. The rows read their RoPE (cos, sin: [rows, D/2]),
 * cache slot [rows] and visible slots [rows, F->S[0]] with counts [rows] in that order (the
 * catch-up's, then level after level). A feature-conditioned draft (`fc` not NULL) reads
 * fc([embedding; feature]) instead of the embedding: the catch-up's rows first_features
 * [first_rows, H], each level's row its parent's final-norm state, which features [levels + 1,
 * chains, H] returns (NULL: not wanted; x2 [first_rows, 2H] is scratch). Sampled chains
 * (`temps` [chains] not NULL, 0 for a greedy one) draw each level as sf_sample_pick does, with
 * noise [levels + 1, chains, V], each chain's cut (min_p, top_k, top_p [chains], NULL for none)
 * and the q of each draw in q [levels + 1, chains, V]; chains that read their history (`pen` not
 * NULL) transform each level's logits first (sf_history_apply: bias, hist_counts, seen, stops,
 * stop_levels, pen) and add each pick to hist_counts and seen. Each step is the
 * function the one-level path calls (the decoder layer, sf_rms_norm, the head's matmul, fc's),
 * so the logits are the same bits. F's scratch holds first_rows >= chains rows (F->N); h
 * [first_rows, H], picked_h, hn [chains, H] and logits [chains, V] are scratch too. Returns 0
 * or the failing matmul's code. */
int sf_draft_chains(const sf_layer *layers, int64_t num_layers, sf_forward *F, int64_t chains, int64_t first_rows,
                    const int64_t *first_tokens, const int64_t *first_pick, int64_t levels,
                    const float *cos, const float *sin, const int64_t *slots, const int64_t *vis,
                    const int64_t *counts, const float *embed, const float *norm, const sf_weight *head,
                    int64_t V, const int64_t *rows, int64_t *tokens, float *log_q, float *h, float *picked_h,
                    float *hn, float *logits, int64_t *picked, const sf_weight *fc, const float *first_features,
                    float *features, float *x2, const float *temps, const float *noise, float *q,
                    const float *min_p, const int64_t *top_k, const float *top_p, const float *bias,
                    float *hist_counts, uint8_t *seen, const uint8_t *stops, const int64_t *stop_levels,
                    const float *pen) {
    const int64_t N = chains, H = F->H, half = F->D / 2, S = F->S[0], scratch_rows = F->N;
    const int th = (int)F->threads;
    int64_t at = 0;                               /* the level's first row among all rows */
    if (first_rows > scratch_rows || N > first_rows) return -3;
    int rc;
    for (int64_t d = 0; d <= levels; d++) {
        const int64_t n = d == 0 ? first_rows : N;
        F->N = n;
        F->cos = cos + at * half;
        F->sin = sin + at * half;
        F->slots = slots + at;
        F->vis[0] = F->vis[1] = vis + at * S;
        F->counts[0] = F->counts[1] = counts + at;
        if ((rc = draft_inputs(embed, d == 0 ? first_tokens : tokens + (d - 1) * N, fc,
                               d == 0 ? first_features : hn, x2, h, n, H, th))) return rc;
        if ((rc = sf_decoder_layers(layers, num_layers, F, h))) return rc;
        for (int64_t r = 0; r < N; r++) {
            const float *src = h + (d == 0 ? first_pick[r] : r) * H;
            for (int64_t i = 0; i < H; i++) picked_h[r * H + i] = src[i];
        }
        sf_rms_norm(picked_h, norm, hn, N, H, F->eps);
        if (features)
            for (int64_t i = 0; i < N * H; i++) features[d * N * H + i] = hn[i];
        if ((rc = linear(head, hn, logits, N, H, V, th))) return rc;
        if (pen) sf_history_apply(logits, N, V, d, bias, hist_counts, seen, stops, stop_levels, pen);
        if (temps) {
            if (sf_sample_pick(logits, N, V, temps, noise + d * N * V, picked, log_q + d * N, q + d * N * V,
                               min_p, top_k, top_p)) return -4;
        } else
            sf_greedy_pick(logits, N, V, picked, log_q + d * N);
        if (pen) sf_history_take(picked, N, V, hist_counts, seen);
        for (int64_t r = 0; r < N; r++) tokens[d * N + r] = rows ? rows[picked[r]] : picked[r];
        at += n;
    }
    F->N = scratch_rows;
    return 0;
}
