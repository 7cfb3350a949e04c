/* graphlm's native attention kernels: causal attention's block steps and the whole kernel
 * (training, prefill), and a decode step's cached attention (executors/native/attention.py binds
 * them; kernels.h says what every C file here shares). */
#include "kernels.h"

/* ---- causal attention's softmax (numpy_executor.py, "causal attention") ------------------ */

/* One row of a causal score block: E = exp(x - row_max) over x[0, n), 0 over [n, cols). The
 * exps run in whole chunks of LANES while the row's storage lasts (exps past n are overwritten
 * by 0), so no row ends in a scalar loop. */
static inline void causal_exp_row(float *x, int64_t n, int64_t cols) {
    const int64_t storage = cols / LANES * LANES;
    const int64_t upto = n <= storage ? (n + LANES - 1) / LANES * LANES : storage;
    const float mx = row_max(x, n);
    for (int64_t i = 0; i < upto; i += LANES)
        for (int j = 0; j < LANES; j++) x[i + j] = exp_f32(x[i + j] - mx);
    for (int64_t i = upto; i < n; i++) x[i] = exp_f32(x[i] - mx);
    for (int64_t i = n; i < cols; i++) x[i] = 0.0f;
}

/* One query block of `nmat` score matrices, each `rows` x `cols` and contiguous, row i being
 * query r0 + i: E = exp(s - rowmax) over the keys [0, r0 + i], 0 above the diagonal, in place
 * (causal_exp_row); l[m*l_stride + i] = rowsum(E), LANES rows at once (rows_sum). */
void gl_causal_softmax_block(float *s, float *l, int64_t nmat, int64_t rows, int64_t cols,
                             int64_t r0, int64_t l_stride) {
    for (int64_t m = 0; m < nmat; m++)
        for (int64_t i0 = 0; i0 < rows; i0 += LANES) {
            int64_t group = rows - i0 < LANES ? rows - i0 : LANES, valid[LANES];
            for (int64_t i = i0; i < i0 + group; i++) {
                valid[i - i0] = r0 + i + 1 < cols ? r0 + i + 1 : cols;
                causal_exp_row(s + (m * rows + i) * cols, valid[i - i0], cols);
            }
            rows_sum(s + (m * rows + i0) * cols, cols, valid, group, l + m * l_stride + i0);
        }
}

/* ds = (s - d) * E over the first n of a row's keys, in place in s */
static inline void softmax_ds_row(float *restrict x, const float *restrict e, float d, int64_t n) {
    for (int64_t j = 0; j < n; j++) x[j] = (x[j] - d) * e[j];
}

/* The softmax gradient's ds = (s - dd) * E over one query block, in place in s (dd one value
 * per row, at dd[m*dd_stride + i]): the numpy kernel's two passes, rounded the same way. */
void gl_softmax_ds_block(float *s, const float *e, const float *dd, int64_t nmat, int64_t rows,
                         int64_t cols, int64_t dd_stride) {
    for (int64_t m = 0; m < nmat; m++)
        for (int64_t i = 0; i < rows; i++)
            softmax_ds_row(s + (m * rows + i) * cols, e + (m * rows + i) * cols, dd[m * dd_stride + i], cols);
}

/* ---- causal attention whole in C: the numpy kernel's steps, its products as BLAS calls -------- */

/* The numpy attention kernels (executors/numpy/attention.py) run Python between their BLAS calls
 * and steps, so on n threads their pieces queue for the GIL. These run the same steps for score
 * matrices [m0, m1) with the products as cblas_sgemm calls of the BLAS NumPy uses (its address in
 * the plan), one matrix after the other, each computed the same way whatever the range or thread.
 *
 * plan (int64 words, built once per node by executors/native/attention.py): t, d, M (matrices of the node),
 * nb (query blocks), the sgemm's address and integer width (2: 64-bit, 3: 32-bit, as
 * team.c's piece kinds), whether the products run in C (plan_product), the row strides (floats) of
 * the STRIDED arrays (q, k, v, g, o and dq: 0 where a kernel has none), the address of a table of
 * STRIDED element offsets per matrix (from the address of each array in the kernel's list; dk and
 * dv lie M matrices' worth of floats after dq, M * t * d, and dv as far again), the addresses of
 * the node's arrays (PLAN_ARRAYS words, in the order each kernel names), then the nb + 1 query
 * block bounds. The other arrays hold their matrices contiguously, matrix after matrix. (Strided
 * o and dq: a node that stores its results heads_merged, [..., T, H, D], graphlm.ops.) Block b
 * of matrix m of a score buffer (E, ds) is (r1 - r0) x r1 floats at M * (the sizes of the blocks
 * before b) + m * (r1 - r0) * r1 (graphlm.ops.causal_attention_keep_layout). */
enum { STRIDED = 6, S_Q = 0, S_K, S_V, S_G, S_O, S_DQ };   /* the strided arrays' slots */
enum { P_T, P_D, P_M, P_NB, P_SGEMM, P_KIND, P_OWN, P_LD, P_OFFSETS = P_LD + STRIDED, P_ARRAYS, PLAN_ARRAYS = 12,
       P_BOUNDS = P_ARRAYS + PLAN_ARRAYS };
const int64_t gl_attention_plan_arrays = PLAN_ARRAYS, gl_attention_strided = STRIDED;   /* read by attention.py */

#define PACK_FLOATS 65536   /* per thread: one matrix's k (or v) transposed, t x d floats */
static _Thread_local float pack[PACK_FLOATS];

#if defined(__AVX512F__) && defined(__FMA__)   /* (kernels.h's intrinsics) */
/* 16 x 16 floats (rows ld apart) transposed into xt (rows ldt apart) in registers: pairs of
 * rows interleaved, then pairs of pairs, then 128-bit quarters twice (a scalar loop took 2.3 us
 * of a 128 x 32 matrix, four times these) */
static inline void transpose16(const float *x, int64_t ld, float *xt, int64_t ldt) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(x + i * ld);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0x88);
            t[h + 4 + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0xDD);
        }
    for (int i = 0; i < 8; i++) {
        _mm512_storeu_ps(xt + i * ldt, _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88));
        _mm512_storeu_ps(xt + (8 + i) * ldt, _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD));
    }
}
#endif

/* x [rows, cols] at row stride ld, transposed into xt [cols, rows] (contiguous): 16 x 16 blocks
 * in registers where AVX-512 has them, the rest element by element */
static void transpose_into(const float *x, int64_t rows, int64_t cols, int64_t ld, float *xt) {
    int64_t i0 = 0, j0 = 0;
#if defined(__AVX512F__) && defined(__FMA__)
    i0 = rows / 16 * 16, j0 = cols / 16 * 16;
    for (int64_t i = 0; i < i0; i += 16)
        for (int64_t j = 0; j < j0; j += 16) transpose16(x + i * ld + j, ld, xt + j * rows + i, rows);
#endif
    for (int64_t i = 0; i < rows; i++)   /* the edges: rows past i0, or columns past j0 */
        for (int64_t j = i < i0 ? j0 : 0; j < cols; j++) xt[j * rows + i] = x[i * ld + j];
}

/* An attention plan's product c = op(a) @ b (ta: a stored [k, m], rows lda apart). Where the plan
 * says so (P_OWN), in C: the small products' NN kernel, reading a transposed a in place
 * (nn_product_ta: register blocks sized for the vectors, products.c; each element one chain of
 * fused multiply-adds over k in order): score blocks are small (64 x 64 to 64 x 1024, k = d), where a BLAS call's own
 * packing and dispatch weigh (docs/performance.md); else by the plan's sgemm. */
static void plan_product(const int64_t *plan, int ta, int64_t m, int64_t n, int64_t k, const float *a,
                         int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc) {
    if (!plan[P_OWN])
        gl_sgemm(plan[P_SGEMM], plan[P_KIND], ta, 0, m, n, k, a, lda, b, ldb, c, ldc);
    else if (ta)
        nn_product_ta(a, b, c, m, k, lda, ldb, ldc, 0, n);
    else
        nn_product(a, b, c, m, k, lda, ldb, ldc, 0, n);
}

/* One matrix's k or v ([t, d], rows ld apart) transposed into this thread's pack, once for all
 * its query blocks' products with it; NULL where they run by the plan's sgemm (not P_OWN, or
 * t x d past PACK_FLOATS). */
static const float *transposed_once(const int64_t *plan, const float *x, int64_t ld) {
    const int64_t t = plan[P_T], d = plan[P_D];
    if (!plan[P_OWN] || t * d > PACK_FLOATS) return NULL;
    transpose_into(x, t, d, ld, pack);
    return pack;
}

/* c = a @ x[0:n]^T, x a matrix's k or v (rows ldx apart): against xt, its transpose
 * (transposed_once: columns [0, n) of [d, t]), or by the plan's sgemm where xt is NULL */
static void plan_product_nt(const int64_t *plan, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                            const float *x, int64_t ldx, const float *xt, float *c, int64_t ldc) {
    if (xt)
        nn_product(a, xt, c, m, k, lda, plan[P_T], ldc, 0, n);
    else
        gl_sgemm(plan[P_SGEMM], plan[P_KIND], 0, 1, m, n, k, a, lda, x, ldx, c, ldc);
}

static float *plan_array(const int64_t *plan, int i) { return (float *)(intptr_t)plan[P_ARRAYS + i]; }

/* matrix m's query block b in the score buffer `e` */
static float *score_block(float *e, const int64_t *plan, int64_t b, int64_t m) {
    const int64_t *bound = plan + P_BOUNDS;
    int64_t before = 0;
    for (int64_t i = 0; i < b; i++) before += (bound[i + 1] - bound[i]) * bound[i + 1];
    return e + plan[P_M] * before + m * (bound[b + 1] - bound[b]) * bound[b + 1];
}

/* ---- the causal strips: the products of a query block stop where the mask does ---------------
 *
 * Query block [r0, r1) (rows = r1 - r0 queries, keys [0, r1)) runs its products in C (P_OWN) in
 * strips of CAUSAL_STRIP of its rows [s0, s1), each reading the keys [0, r0 + s1) its last query
 * sees: its scores (to the next multiple of 32 keys, the kernels' widest block; the rest of a
 * row is masked and never read), ds, and the weighted sums over those keys. The key and value
 * gradients, sums over the block's queries, take the diagonal's keys in strips too, each from
 * the first query that sees it. A term left out has a weight (E or ds) of 0 under the mask, and
 * every element's chain of fused multiply-adds starts from +0, to which a +-0 term adds nothing:
 * the same bits as the whole block for finite inputs, with a fifth to a quarter less product
 * work at 64-query blocks (docs/performance.md). Products by the plan's sgemm stay whole (a
 * BLAS's rounding may depend on the shape). */
#define CAUSAL_STRIP 8

static inline int64_t strip_end(int64_t s0, int64_t rows) { return s0 + CAUSAL_STRIP < rows ? s0 + CAUSAL_STRIP : rows; }

/* The keys the strip ending at block row s1 reads: up to its last query's own */
static inline int64_t strip_keys(int64_t r0, int64_t s1) { return r0 + s1; }

/* c [rows, r1] = a @ x^T over keys [0, r1), the block's scores (a: its rows' queries, lda apart;
 * x: the matrix's keys, or xt their transpose: plan_product_nt), strip by strip */
static void causal_scores(const int64_t *plan, int64_t rows, int64_t r0, int64_t r1, int64_t d, const float *a,
                          int64_t lda, const float *x, int64_t ldx, const float *xt, float *c) {
    if (!xt) {
        plan_product_nt(plan, rows, r1, d, a, lda, x, ldx, xt, c, r1);
        return;
    }
    for (int64_t s0 = 0; s0 < rows; s0 += CAUSAL_STRIP) {
        const int64_t s1 = strip_end(s0, rows), n = (strip_keys(r0, s1) + 31) / 32 * 32;
        plan_product_nt(plan, s1 - s0, n < r1 ? n : r1, d, a + s0 * lda, lda, x, ldx, xt, c + s0 * r1, r1);
    }
}

/* c [rows, d] (rows ldc apart) = w @ b over keys [0, r1): a block's weights w [rows, r1] (E or
 * ds, 0 past each row's own key) times the matrix's values or keys b (rows ldb apart) */
static void causal_weighted(const int64_t *plan, int64_t rows, int64_t r0, int64_t r1, int64_t d, const float *w,
                            const float *b, int64_t ldb, float *c, int64_t ldc) {
    if (!plan[P_OWN]) {
        plan_product(plan, 0, rows, d, r1, w, r1, b, ldb, c, ldc);
        return;
    }
    for (int64_t s0 = 0; s0 < rows; s0 += CAUSAL_STRIP) {
        const int64_t s1 = strip_end(s0, rows);
        nn_product(w + s0 * r1, b, c + s0 * ldc, s1 - s0, strip_keys(r0, s1), r1, ldb, ldc, 0, d);
    }
}

/* c [r1, d] (rows ldc apart) = w^T @ b over the block's queries: w [rows, r1] as above, b the
 * queries' rows (ldb apart, the block's first first); keys before r0 from every query, each
 * strip of the diagonal's keys from the first query that reaches it */
static void causal_weighted_t(const int64_t *plan, int64_t rows, int64_t r0, int64_t r1, int64_t d, const float *w,
                              const float *b, int64_t ldb, float *c, int64_t ldc) {
    if (!plan[P_OWN]) {
        plan_product(plan, 1, r1, d, rows, w, r1, b, ldb, c, ldc);
        return;
    }
    if (r0 > 0) nn_product_ta(w, b, c, r0, rows, r1, ldb, ldc, 0, d);
    for (int64_t s0 = 0; s0 < rows; s0 += CAUSAL_STRIP)
        nn_product_ta(w + s0 * r1 + r0 + s0, b + s0 * ldb, c + (r0 + s0) * ldc, strip_end(s0, rows) - s0, rows - s0,
                      r1, ldb, ldc, 0, d);
}

/* Forward, arrays q, k, v, o, E, l (t per matrix), qs (q * scale, t x d: the scratch of the
 * range's first matrix m0, reused for each of its matrices, so that it stays in cache): per query
 * block E = exp(qs @ k^T - rowmax) under the causal mask (gl_causal_softmax_block), l = rowsum(E),
 * o = E @ v; then o /= l. */
void gl_causal_attention(const int64_t *plan, int64_t m0, int64_t m1, float scale) {
    const int64_t t = plan[P_T], d = plan[P_D], nb = plan[P_NB], *ld = plan + P_LD, *bound = plan + P_BOUNDS;
    const int64_t *offsets = (const int64_t *)(intptr_t)plan[P_OFFSETS];
    for (int64_t m = m0; m < m1; m++) {
        const int64_t *off = offsets + STRIDED * m, ldo = ld[S_O];
        const float *qm = plan_array(plan, 0) + off[S_Q], *km = plan_array(plan, 1) + off[S_K];
        const float *vm = plan_array(plan, 2) + off[S_V];
        float *om = plan_array(plan, 3) + off[S_O], *e = plan_array(plan, 4);
        float *lm = plan_array(plan, 5) + m * t, *qsm = plan_array(plan, 6) + m0 * t * d;
        for (int64_t i = 0; i < t; i++)
            for (int64_t j = 0; j < d; j++) qsm[i * d + j] = qm[i * ld[0] + j] * scale;
        const float *kt = transposed_once(plan, km, ld[1]);
        for (int64_t b = 0; b < nb; b++) {
            int64_t r0 = bound[b], r1 = bound[b + 1];
            float *x = score_block(e, plan, b, m);
            causal_scores(plan, r1 - r0, r0, r1, d, qsm + r0 * d, d, km, ld[1], kt, x);
            gl_causal_softmax_block(x, lm + r0, 1, r1 - r0, r1, r0, 0);
            causal_weighted(plan, r1 - r0, r0, r1, d, x, vm, ld[2], om + r0 * ldo, ldo);
        }
        for (int64_t i = 0; i < t; i++)
            for (int64_t j = 0; j < d; j++) om[i * ldo + j] /= lm[i];
    }
}

/* ds = (s - dd) * E over a block [rows, r1] (gl_softmax_ds_block), where the products in C read
 * it: each strip's rows up to its keys (the rest of s was not computed) */
static void causal_ds(const int64_t *plan, int64_t rows, int64_t r0, int64_t r1, float *s, const float *e,
                      const float *dd) {
    if (!plan[P_OWN]) {
        gl_softmax_ds_block(s, e, dd, 1, rows, r1, 0);
        return;
    }
    for (int64_t s0 = 0; s0 < rows; s0 += CAUSAL_STRIP) {
        const int64_t s1 = strip_end(s0, rows);
        for (int64_t i = s0; i < s1; i++) softmax_ds_row(s + i * r1, e + i * r1, dd[i], strip_keys(r0, s1));
    }
}

/* out [r1, d] (rows ldo apart) += w^T @ b over a block's queries (causal_weighted_t): the
 * product into tmp (r1 x d, contiguous), then added */
static void add_product(const int64_t *plan, int64_t rows, int64_t r0, int64_t r1, int64_t d, const float *w,
                        const float *b, int64_t ldb, float *tmp, float *out, int64_t ldo) {
    causal_weighted_t(plan, rows, r0, r1, d, w, b, ldb, tmp, d);
    for (int64_t i = 0; i < r1; i++)
        for (int64_t j = 0; j < d; j++) out[i * ldo + j] += tmp[i * d + j];
}

/* dd[i] = (g[i] . o[i]) / l[i] for the rows [0, t) of g and o (d floats each, rows ldg and ldo
 * apart): each dot from 0 over j in order, each product rounded first. Where AVX-512 has them,
 * 16 rows side by side, one per lane, their products turned into columns (transpose16): a row
 * alone is a chain of d dependent adds. */
static void rows_dot_over(const float *g, int64_t ldg, const float *o, int64_t ldo, const float *l, int64_t t,
                          int64_t d, float *dd) {
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__FMA__)
    if (d % 16 == 0) {
        float prod[256], cols[256];
        for (; i + 16 <= t; i += 16) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j0 = 0; j0 < d; j0 += 16) {
                for (int r = 0; r < 16; r++)
                    _mm512_storeu_ps(prod + 16 * r, _mm512_mul_ps(_mm512_loadu_ps(g + (i + r) * ldg + j0),
                                                                  _mm512_loadu_ps(o + (i + r) * ldo + j0)));
                transpose16(prod, 16, cols, 16);
                for (int j = 0; j < 16; j++) acc = _mm512_add_ps(acc, _mm512_loadu_ps(cols + 16 * j));
            }
            _mm512_storeu_ps(dd + i, _mm512_div_ps(acc, _mm512_loadu_ps(l + i)));
        }
    }
#endif
    for (; i < t; i++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < d; j++) acc += g[i * ldg + j] * o[i * ldo + j];
        dd[i] = acc / l[i];
    }
}

/* Backward from the kept E and l, arrays q, k, v, o, g, E, l, out (dq, dk, dv: the node's
 * [3, ...] output), and scratch ds (a score buffer), gs, tmp (t x d per matrix), dd (t per matrix),
 * of which a range of matrices uses its first matrix's (m0's) alone, rewritten for each matrix:
 * scratch that stays in cache (a block per matrix would be written back to memory unread) and
 * that no other range touches:
 *   dd = rowsum(g*o) / l (rows_dot_over),  gs = g / l,
 *   per block: ds = (gs @ v^T - dd) * E (gl_softmax_ds_block),  dq = ds @ k;
 *   dk = the sum over blocks of ds^T @ q, dv of E^T @ gs (the last block writes, the others add,
 *   from the last to the first);  dq, dk times the scale. */
void gl_causal_attention_backward(const int64_t *plan, int64_t m0, int64_t m1, float scale) {
    const int64_t t = plan[P_T], d = plan[P_D], nm = plan[P_M], nb = plan[P_NB];
    const int64_t *ld = plan + P_LD, *bound = plan + P_BOUNDS;
    const int64_t *offsets = (const int64_t *)(intptr_t)plan[P_OFFSETS];
    for (int64_t m = m0; m < m1; m++) {
        const int64_t *off = offsets + STRIDED * m, ldo = ld[S_O], ldd = ld[S_DQ];
        const float *qm = plan_array(plan, 0) + off[S_Q], *km = plan_array(plan, 1) + off[S_K];
        const float *vm = plan_array(plan, 2) + off[S_V], *om = plan_array(plan, 3) + off[S_O];
        const float *gm = plan_array(plan, 4) + off[S_G], *e = plan_array(plan, 5);
        const float *lm = plan_array(plan, 6) + m * t;
        float *ds = plan_array(plan, 8);
        float *dq = plan_array(plan, 7) + off[S_DQ], *dk = dq + nm * t * d, *dv = dk + nm * t * d;
        float *gs = plan_array(plan, 9) + m0 * t * d, *tmp = plan_array(plan, 10) + m0 * t * d;
        float *dd = plan_array(plan, 11) + m0 * t;
        rows_dot_over(gm, ld[3], om, ldo, lm, t, d, dd);
        for (int64_t i = 0; i < t; i++)
            for (int64_t j = 0; j < d; j++) gs[i * d + j] = gm[i * ld[3] + j] / lm[i];
        const float *vt = transposed_once(plan, vm, ld[2]);
        for (int64_t b = nb - 1; b >= 0; b--) {
            int64_t r0 = bound[b], r1 = bound[b + 1], last = b == nb - 1;
            float *s = score_block(ds, plan, b, m0);
            const float *x = score_block((float *)e, plan, b, m);
            causal_scores(plan, r1 - r0, r0, r1, d, gs + r0 * d, d, vm, ld[2], vt, s);
            causal_ds(plan, r1 - r0, r0, r1, s, x, dd + r0);
            causal_weighted(plan, r1 - r0, r0, r1, d, s, km, ld[1], dq + r0 * ldd, ldd);
            if (last)
                causal_weighted_t(plan, r1 - r0, r0, r1, d, s, qm + r0 * ld[0], ld[0], dk, ldd);
            else
                add_product(plan, r1 - r0, r0, r1, d, s, qm + r0 * ld[0], ld[0], tmp, dk, ldd);
            if (last)
                causal_weighted_t(plan, r1 - r0, r0, r1, d, x, gs + r0 * d, d, dv, ldd);
            else
                add_product(plan, r1 - r0, r0, r1, d, x, gs + r0 * d, d, tmp, dv, ldd);
        }
        for (int64_t i = 0; i < t; i++)
            for (int64_t j = 0; j < d; j++) {
                dq[i * ldd + j] *= scale;
                dk[i * ldd + j] *= scale;
            }
    }
}

/* ---- cached attention: one decode step against the KV cache (graphlm.ops.cached_attention) ---- */

/* Two steps of a row, each in one fixed order (the AVX-512 and AVX2 code and the plain C below
 * round alike):
 *   scores:  s_c = q . key_c for up to 16 keys, each dot as the small products' NT kernel
 *            computes it (16 lane sums over d, then their tree: nt_lanes, lanes_tree);
 *   values:  o = (((a_0 + a_1) + (a_2 + a_3)) + e_p * v) / l per column, a_u the multiply-add
 *            chain of e_j * cv[j] over the cached slots j = u mod 4, j < p, in order (four chains
 *            side by side). */
/* The values step's four chains for the vector code below: TERM(acc, j) adds slot j's term to
 * chain acc (a0 .. a3, declared by the caller), chain u taking the slots j = u mod 4, j < p */
#define FOUR_VALUE_CHAINS(TERM, p)                                                              \
    do {                                                                                        \
        int64_t j_ = 0;                                                                         \
        for (; j_ + 4 <= (p); j_ += 4) {                                                        \
            TERM(a0, j_); TERM(a1, j_ + 1); TERM(a2, j_ + 2); TERM(a3, j_ + 3);                 \
        }                                                                                       \
        if (j_ < (p)) TERM(a0, j_);                                                             \
        if (j_ + 1 < (p)) TERM(a1, j_ + 1);                                                     \
        if (j_ + 2 < (p)) TERM(a2, j_ + 2);                                                     \
    } while (0)

#if defined(__AVX512F__) && defined(__FMA__)
/* s[0..n) = q . key[c] (n <= 16; the unused lanes read q and are not stored) */
static inline void attention_dots(const float *q, const float *const key[16], int n, int64_t d, float *s) {
    const float *row[16];
    for (int c = 0; c < 16; c++) row[c] = c < n ? key[c] : q;
    __m512 acc[16];
    for (int c = 0; c < 16; c++) acc[c] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + 16 <= d; p += 16) {
        __m512 x = _mm512_loadu_ps(q + p);
        for (int c = 0; c < 16; c++)   /* key c's sums in the reduction's source of lane c */
            acc[4 * (c % 4) + c / 4] = _mm512_fmadd_ps(x, _mm512_loadu_ps(row[c] + p), acc[4 * (c % 4) + c / 4]);
    }
    if (p < d) {
        __mmask16 mask = (__mmask16)((1u << (d - p)) - 1u);
        __m512 x = _mm512_maskz_loadu_ps(mask, q + p);
        for (int c = 0; c < 16; c++)
            acc[4 * (c % 4) + c / 4] = _mm512_mask3_fmadd_ps(x, _mm512_maskz_loadu_ps(mask, row[c] + p),
                                                             acc[4 * (c % 4) + c / 4], mask);
    }
    _mm512_mask_storeu_ps(s, (__mmask16)((1u << n) - 1u), nt_reduce16(acc));
}

/* columns [0, w) of the row's output, w <= 16 (see above) */
static inline void attention_values(const float *e, const float *cv, const float *v, float *o,
                                    int64_t p, int64_t d, float l, int64_t w) {
    __mmask16 mask = (__mmask16)((1u << w) - 1u);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;   /* (named: kept in registers) */
#define VALUE_TERM(acc, j) acc = _mm512_fmadd_ps(_mm512_set1_ps(e[j]), _mm512_maskz_loadu_ps(mask, cv + (j) * d), acc)
    FOUR_VALUE_CHAINS(VALUE_TERM, p);
#undef VALUE_TERM
    __m512 sum = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
    sum = _mm512_fmadd_ps(_mm512_set1_ps(e[p]), _mm512_maskz_loadu_ps(mask, v), sum);
    _mm512_mask_storeu_ps(o, mask, _mm512_div_ps(sum, _mm512_set1_ps(l)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* The same two steps in AVX2 registers (the plain C below ran a TinyLM decode step's attention
 * 7x slower on a Zen 3 core). A dot's 16 lanes are two vectors, lanes 0-7 and 8-15; the last
 * d % 16 terms are blended in only where lanes take them, as nt_lanes leaves the others. */
static inline __m256i lanes_below(int64_t n) {   /* lane l set where l < n */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* the lanes_tree sums of eight keys' h = 8 vectors s[0..8) (lo + hi: lanes l and l+8), in key
 * order: h = 4 pairs the 128-bit halves of two keys, h = 2 and h = 1 pair lanes within a half
 * (each level adds lane l and lane l+h of every key, as lanes_tree does) */
static inline __m256 lanes_tree8_keys(const __m256 s[8]) {
    __m256 t[4], u[2];
    for (int i = 0; i < 4; i++)   /* [key 2i's 4 sums | key 2i+1's] */
        t[i] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)   /* [4i: 2, 4i+2: 2 | 4i+1: 2, 4i+3: 2] */
        u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    __m256 w = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88),   /* [0, 2, 4, 6 | 1, 3, 5, 7] */
                             _mm256_shuffle_ps(u[0], u[1], 0xDD));
    return _mm256_permutevar8x32_ps(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* key's 16 lanes after h = 8 (lane l + lane l+8), D = d a multiple of 16 up to 64: q's D / 8
 * vectors x in registers, the lanes' chains from 0 in order of p (nt_lanes) */
static inline __attribute__((always_inline)) __m256 dot_lanes_h8(const __m256 *x, const float *key, const int D) {
    __m256 lo = _mm256_fmadd_ps(x[0], _mm256_loadu_ps(key), _mm256_setzero_ps());
    __m256 hi = _mm256_fmadd_ps(x[1], _mm256_loadu_ps(key + 8), _mm256_setzero_ps());
    for (int v = 2; v < D / 8; v += 2) {
        lo = _mm256_fmadd_ps(x[v], _mm256_loadu_ps(key + 8 * v), lo);
        hi = _mm256_fmadd_ps(x[v + 1], _mm256_loadu_ps(key + 8 * v + 8), hi);
    }
    return _mm256_add_ps(lo, hi);
}

/* A row's scores s[j] = q . key_j for the cached keys j < p (rows D apart from kc) and s[p] =
 * q . knew, D = d a multiple of 16 up to 64: q in registers, the cached keys read straight
 * through eight at a time (their trees reduced together), the last group with the new key
 * through a buffer. One call a row: the 16-key calls through a table of key pointers cost
 * twice the dots themselves (0.25 us a row at p = 66). */
static inline __attribute__((always_inline)) void row_dots_fixed(const float *q, const float *kc, const float *knew,
                                                                  int64_t p, float *s, const int D) {
    __m256 x[8], h8[8];
    for (int v = 0; v < D / 8; v++) x[v] = _mm256_loadu_ps(q + 8 * v);
    int64_t j = 0;
    for (; j + 8 <= p; j += 8) {
        for (int c = 0; c < 8; c++) h8[c] = dot_lanes_h8(x, kc + (j + c) * D, D);
        _mm256_storeu_ps(s + j, lanes_tree8_keys(h8));
    }
    for (int c = 0; c < 8; c++)   /* slots j.. p - 1, then the new key (the lanes past it read q) */
        h8[c] = dot_lanes_h8(x, j + c < p ? kc + (j + c) * D : j + c == p ? knew : q, D);
    float tmp[8];
    _mm256_storeu_ps(tmp, lanes_tree8_keys(h8));
    for (int64_t c = 0; j + c <= p; c++) s[j + c] = tmp[c];
}
#define ROW_DOTS_FIXED 1   /* (gl_cached_attention takes it for d = 32 and 64) */

/* s[0..n) = q . key[c] (n <= 16): four keys' lanes side by side, their trees eight at a time */
static inline void attention_dots(const float *q, const float *const key[16], int n, int64_t d, float *s) {
    const int64_t whole = d / 16 * 16;
    const __m256i m_lo = lanes_below(d - whole), m_hi = lanes_below(d - whole - 8);
    for (int c8 = 0; c8 < n; c8 += 8) {
        __m256 h8[8];   /* key c8 + c's lanes after h = 8 */
        for (int c0 = 0; c0 < 8; c0 += 4) {
            const float *row[4];
            for (int c = 0; c < 4; c++) row[c] = c8 + c0 + c < n ? key[c8 + c0 + c] : q;
            __m256 lo[4], hi[4];
            for (int c = 0; c < 4; c++) lo[c] = hi[c] = _mm256_setzero_ps();
            for (int64_t p = 0; p < whole; p += 16) {
                const __m256 x0 = _mm256_loadu_ps(q + p), x1 = _mm256_loadu_ps(q + p + 8);
                for (int c = 0; c < 4; c++) {
                    lo[c] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(row[c] + p), lo[c]);
                    hi[c] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(row[c] + p + 8), hi[c]);
                }
            }
            if (whole < d) {
                const __m256 x0 = _mm256_maskload_ps(q + whole, m_lo), x1 = _mm256_maskload_ps(q + whole + 8, m_hi);
                for (int c = 0; c < 4; c++) {
                    __m256 f0 = _mm256_fmadd_ps(x0, _mm256_maskload_ps(row[c] + whole, m_lo), lo[c]);
                    __m256 f1 = _mm256_fmadd_ps(x1, _mm256_maskload_ps(row[c] + whole + 8, m_hi), hi[c]);
                    lo[c] = _mm256_blendv_ps(lo[c], f0, _mm256_castsi256_ps(m_lo));
                    hi[c] = _mm256_blendv_ps(hi[c], f1, _mm256_castsi256_ps(m_hi));
                }
            }
            for (int c = 0; c < 4; c++) h8[c0 + c] = _mm256_add_ps(lo[c], hi[c]);
        }
        float tmp[8];
        _mm256_storeu_ps(tmp, lanes_tree8_keys(h8));
        for (int c = 0; c < 8 && c8 + c < n; c++) s[c8 + c] = tmp[c];
    }
}

/* columns [0, w) of the row's output, w <= 16: two vectors of 8 columns, four chains each; a
 * whole 16 as the two side by side (eight chains in flight: the FMAs' latency hidden) */
static inline void attention_values(const float *e, const float *cv, const float *v, float *o,
                                    int64_t p, int64_t d, float l, int64_t w) {
    if (w == 16) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a0h = a0, a1h = a0, a2h = a0, a3h = a0;
#define VALUE_TERM(acc, j)                                                                      \
        do {                                                                                    \
            const __m256 e_ = _mm256_set1_ps(e[j]);                                             \
            acc = _mm256_fmadd_ps(e_, _mm256_loadu_ps(cv + (j) * d), acc);                      \
            acc##h = _mm256_fmadd_ps(e_, _mm256_loadu_ps(cv + (j) * d + 8), acc##h);            \
        } while (0)
        FOUR_VALUE_CHAINS(VALUE_TERM, p);
#undef VALUE_TERM
        const __m256 ep = _mm256_set1_ps(e[p]), lv = _mm256_set1_ps(l);
        __m256 lo = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        __m256 hi = _mm256_add_ps(_mm256_add_ps(a0h, a1h), _mm256_add_ps(a2h, a3h));
        _mm256_storeu_ps(o, _mm256_div_ps(_mm256_fmadd_ps(ep, _mm256_loadu_ps(v), lo), lv));
        _mm256_storeu_ps(o + 8, _mm256_div_ps(_mm256_fmadd_ps(ep, _mm256_loadu_ps(v + 8), hi), lv));
        return;
    }
    for (int64_t h = 0; h < w; h += 8) {
        const __m256i mask = lanes_below(w - h);
        const float *c = cv + h;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#define VALUE_TERM(acc, j) acc = _mm256_fmadd_ps(_mm256_set1_ps(e[j]), _mm256_maskload_ps(c + (j) * d, mask), acc)
        FOUR_VALUE_CHAINS(VALUE_TERM, p);
#undef VALUE_TERM
        __m256 sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        sum = _mm256_fmadd_ps(_mm256_set1_ps(e[p]), _mm256_maskload_ps(v + h, mask), sum);
        _mm256_maskstore_ps(o + h, mask, _mm256_div_ps(sum, _mm256_set1_ps(l)));
    }
}
#else
static inline void attention_dots(const float *q, const float *const key[16], int n, int64_t d, float *s) {
    for (int c = 0; c < n; c++) {
        float acc[16] = {0};
        nt_lanes(q, key[c], d, acc);
        s[c] = lanes_tree(acc);
    }
}

static inline void attention_values(const float *e, const float *cv, const float *v, float *o,
                                    int64_t p, int64_t d, float l, int64_t w) {
    for (int64_t i = 0; i < w; i++) {
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t j = 0; j < p; j++) a[j % 4] = MADD(e[j], cv[j * d + i], a[j % 4]);
        o[i] = MADD(e[p], v[i], (a[0] + a[1]) + (a[2] + a[3])) / l;
    }
}
#endif

/* Rows [r0, r1) of a decode step's attention (a row: one batch row's head). Row r's query, new
 * key, new value and output are d floats at q + r*ldq, k + r*ldk, v + r*ldv, out + r*ldo; its
 * caches are t x d floats at ck + r*ldc, cv + r*ldc. With p = *position (0 <= p < t, checked by
 * the caller), only the cached slots j < p are read:
 *   s_j = (q . ck[j]) * scale (j < p),  s_p = (q . k) * scale   (attention_dots),
 *   e_j = exp_f32(s_j - max_j s_j),  l = row_sum(e_0..e_p),
 *   out = (e_0 cv[0] + ... + e_{p-1} cv[p-1] + e_p v) / l   (attention_values).
 * `scores` holds t + 1 floats per row (row r at scores + r*(t+1)). Each row is one fixed sequence
 * of roundings that depends on p and d alone (a slot's score on d alone), so its bits do not
 * depend on the rows around it or the thread. */
void gl_cached_attention(const float *q, const float *k, const float *v, const float *ck,
                         const float *cv, float *out, float *scores, const int64_t *position,
                         int64_t r0, int64_t r1, int64_t t, int64_t d, int64_t ldq, int64_t ldk,
                         int64_t ldv, int64_t ldo, int64_t ldc, float scale) {
    const int64_t p = *position;
    for (int64_t r = r0; r < r1; r++) {
        const float *qr = q + r * ldq, *kc = ck + r * ldc, *vc = cv + r * ldc;
        float *s = scores + r * (t + 1), *o = out + r * ldo;
#ifdef ROW_DOTS_FIXED
        if (d == 32) row_dots_fixed(qr, kc, k + r * ldk, p, s, 32);
        else if (d == 64) row_dots_fixed(qr, kc, k + r * ldk, p, s, 64);
        else
#endif
        for (int64_t j0 = 0; j0 <= p; j0 += 16) {   /* the slots j < p, then the new key */
            const float *key[16];
            int n = p + 1 - j0 < 16 ? (int)(p + 1 - j0) : 16;
            for (int c = 0; c < n; c++) key[c] = j0 + c < p ? kc + (j0 + c) * d : k + r * ldk;
            attention_dots(qr, key, n, d, s + j0);
        }
        for (int64_t j = 0; j <= p; j++) s[j] = s[j] * scale;
        const float m = row_max(s, p + 1);
        for (int64_t j = 0; j <= p; j++) s[j] = exp_f32(s[j] - m);
        const float l = row_sum(s, p + 1);
        for (int64_t i = 0; i < d; i += 16)
            attention_values(s, vc + i, v + r * ldv + i, o + i, p, d, l, d - i < 16 ? d - i : 16);
    }
}
