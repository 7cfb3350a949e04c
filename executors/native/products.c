/* graphlm's native products: matmuls of few rows (decoding, short prefills), large products
 * (training, long prefills) and panel products (a Generator's, B in column panels) by the same
 * NN chains, and the one BLAS call made from C
 * (executors/native/products.py binds them; kernels.h says what every C file here shares). */
#include "kernels.h"

enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO = 111, CBLAS_T = 112 };   /* CBLAS's enum values */
typedef void (*sgemm64_fn)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t,
                           const float *, int64_t, float, float *, int64_t);
typedef void (*sgemm32_fn)(int, int, int, int32_t, int32_t, int32_t, float, const float *, int32_t,
                           const float *, int32_t, float, float *, int32_t);

/* c = op(a) @ op(b) (+ c where `accumulate`) by the cblas_sgemm at `sgemm` (op(a) m x k, op(b)
 * k x n; row-major, alpha 1, beta 0 or 1; ta / tb: that operand transposed); `width` 2: it takes
 * 64-bit integers, 3: 32-bit (the team's piece kinds). The one place graphlm calls a BLAS from C
 * (team.c's BLAS pieces too). */
void gl_sgemm_acc(int64_t sgemm, int64_t width, int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a,
                  int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate) {
    int oa = ta ? CBLAS_T : CBLAS_NO, ob = tb ? CBLAS_T : CBLAS_NO;
    float beta = accumulate ? 1.0f : 0.0f;
    if (width == 2)
        ((sgemm64_fn)(intptr_t)sgemm)(CBLAS_ROW_MAJOR, oa, ob, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
    else
        ((sgemm32_fn)(intptr_t)sgemm)(CBLAS_ROW_MAJOR, oa, ob, (int32_t)m, (int32_t)n, (int32_t)k, 1.0f,
                                      a, (int32_t)lda, b, (int32_t)ldb, beta, c, (int32_t)ldc);
}

void gl_sgemm(int64_t sgemm, int64_t width, int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a,
              int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc) {
    gl_sgemm_acc(sgemm, width, ta, tb, m, n, k, a, lda, b, ldb, c, ldc, 0);
}
/* ---- small products: matmuls of few rows (executors/native/products.py) --------- */

/* out[e] = a[e] @ b[e] for the batch entries e in [e0, e1), over the columns [j0, j1) of each.
 * Entry e's operands start at a + offsets[3e], b + offsets[3e + 1], out + offsets[3e + 2]
 * (element offsets: any broadcast or stride of the batch axes); a is [m, k] with rows lda
 * apart, out [m, n] with rows ldo apart; b is [k, n] with rows ldb apart (gl_matmul_small) or
 * given as its transpose bt [n, k] with rows ldb apart (gl_matmul_small_nt: b = bt^T, as a key
 * cache read by a query). Elements are contiguous along each row.
 *
 * Every output element is computed by one fixed sequence of roundings that depends on k alone:
 *   NN: acc = 0; acc = MADD(a[i][p], b[p][j], acc) for p = 0, 1, ..., k-1;
 *   NT: 16 lane sums, lane l taking p = l, l+16, ... in order (as NN), then summed as a tree
 *       (lane l + lane l+8, then +4, +2, +1).
 * So a row's values are the same bits whatever m (decoding 8 rows or 1), the blocking below,
 * the column range or the thread computing it. The blocks only choose which accumulators live
 * in registers together: R rows x W columns, b's row read once for all R rows. */

/* Element (r, p) of a is a[r * sai + p * sap]: sap = 1 for a's rows contiguous (nn_product),
 * sai = 1 for a transposed view (a weight gradient's g^T). A block starts its chains from 0, or
 * with `more` from the values in o (a large product's next run of p: the same chains, stopped and
 * resumed). The blocks are always inlined into nn_rows' callers, each compiled for its constants. */
#if AVX2_BLOCKS || (defined(__AVX512F__) && defined(__FMA__))
#include <immintrin.h>
/* The same chains in vector registers by name. GCC vectorised the plain C below for AVX2 at 3-40
 * GFLOP/s (a 16-wide block not at all; these run a 6 x 16 block at 85-88 on one Zen 3 core),
 * and for AVX-512 with the accumulators in registers but stored through the stack in 32-byte
 * halves (a quarter of an attention product of k = 32, its chains being short). b's W / VL
 * vectors of row p are loaded once for the R rows (GCC keeps each load for all of them). */
#if AVX2_BLOCKS
typedef __m256 vec;
#define VL 8
#define VEC_LOAD _mm256_loadu_ps
#define VEC_STORE _mm256_storeu_ps
#define VEC_ZERO _mm256_setzero_ps
#define VEC_SET1 _mm256_set1_ps
#define VEC_FMADD _mm256_fmadd_ps
#define NN_PREFETCH(bp, ldb, W) __builtin_prefetch((bp) + ((ldb) <= 32 ? 16 : 8) * (ldb))   /* a panel's row ahead */
#else
typedef __m512 vec;
#define VL 16
#define VEC_LOAD _mm512_loadu_ps
#define VEC_STORE _mm512_storeu_ps
#define VEC_ZERO _mm512_setzero_ps
#define VEC_SET1 _mm512_set1_ps
#define VEC_FMADD _mm512_fmadd_ps
#define NN_PREFETCH(bp, ldb, W)                 /* the next block */                            \
    for (int j_ = 0; j_ < (W); j_ += 16) __builtin_prefetch((bp) + (W) + j_)
#endif
#define NN_BLOCK(R, W)                                                                          \
    static inline __attribute__((always_inline)) void nn_block_##R##x##W(const float *a,        \
            const float *b, float *o, int64_t k, int64_t sai, int64_t sap, int64_t ldb, int64_t ldo, \
            int more) {                                                                         \
        vec acc[R][W / VL];                                                                     \
        for (int r = 0; r < R; r++)                                                             \
            for (int v = 0; v < W / VL; v++) acc[r][v] = more ? VEC_LOAD(o + r * ldo + VL * v) : VEC_ZERO(); \
        for (int64_t p = 0; p < k; p++) {                                                       \
            const float *bp = b + p * ldb;                                                      \
            NN_PREFETCH(bp, ldb, W);                                                            \
            for (int r = 0; r < R; r++) {                                                       \
                const vec ar = VEC_SET1(a[r * sai + p * sap]);                                  \
                for (int v = 0; v < W / VL; v++) acc[r][v] = VEC_FMADD(ar, VEC_LOAD(bp + VL * v), acc[r][v]); \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < R; r++)                                                             \
            for (int v = 0; v < W / VL; v++) VEC_STORE(o + r * ldo + VL * v, acc[r][v]);        \
    }
#else
#define NN_BLOCK(R, W)                                                                          \
    static inline __attribute__((always_inline)) void nn_block_##R##x##W(const float *a,        \
            const float *b, float *o, int64_t k, int64_t sai, int64_t sap, int64_t ldb, int64_t ldo, \
            int more) {                                                                         \
        float acc[R][W];                                                                        \
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < W; j++) acc[r][j] = more ? o[r * ldo + j] : 0.0f;               \
        for (int64_t p = 0; p < k; p++) {                                                       \
            const float *bp = b + p * ldb;                                                      \
            for (int j = 0; j < W; j += 16) __builtin_prefetch(bp + W + j); /* the next block */ \
            for (int r = 0; r < R; r++) {                                                       \
                float ar = a[r * sai + p * sap];                                                \
                for (int j = 0; j < W; j++) acc[r][j] = MADD(ar, bp[j], acc[r][j]);             \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < R; r++)                                                             \
            for (int j = 0; j < W; j++) o[r * ldo + j] = acc[r][j];                             \
    }
#endif

/* The blocks by vector width (AVX2_BLOCKS, kernels.h): R x W accumulators fill 16 of AVX-512's
 * 32 registers of 16 floats, or 12 of AVX2's 16 of 8 (a 4 x 32 block there spilled: attention's
 * score products 1.4x slower than by BLAS). TALL_R x TALL_W is the block most rows take; a row
 * block's b row is read once for its R rows. */
#if !AVX2_BLOCKS
#define TALL_R 8
#define TALL_W 32
NN_BLOCK(8, 32)
NN_BLOCK(4, 64)
NN_BLOCK(2, 64)
NN_BLOCK(1, 256)
NN_BLOCK(1, 128)
#else
#define TALL_R 6
#define TALL_W 16
NN_BLOCK(6, 16)
NN_BLOCK(5, 16)
NN_BLOCK(4, 16)
NN_BLOCK(3, 16)
NN_BLOCK(2, 48)
NN_BLOCK(2, 32)
NN_BLOCK(1, 96)
#endif
NN_BLOCK(1, 64)
NN_BLOCK(1, 16)
#define NN_TALL_(R, W) nn_block_##R##x##W
#define NN_TALL_AT(R, W) NN_TALL_(R, W)
#define NN_TALL NN_TALL_AT(TALL_R, TALL_W)

/* `rows` rows x `w` columns (a block's ragged right edge), 16 columns at a time */
static inline __attribute__((always_inline)) void nn_edge(const float *a, const float *b, float *o,
        int64_t rows, int64_t k, int64_t w, int64_t sai, int64_t sap, int64_t ldb, int64_t ldo, int more) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j0 = 0; j0 < w; j0 += 16) {
            int64_t cols = w - j0 < 16 ? w - j0 : 16;
            float acc[16];
            for (int64_t j = 0; j < cols; j++) acc[j] = more ? o[r * ldo + j0 + j] : 0.0f;
            for (int64_t p = 0; p < k; p++) {
                float ar = a[r * sai + p * sap];
                const float *bp = b + p * ldb + j0;
                for (int64_t j = 0; j < cols; j++) acc[j] = MADD(ar, bp[j], acc[j]);
            }
            for (int64_t j = 0; j < cols; j++) o[r * ldo + j0 + j] = acc[j];
        }
}

/* rows [i, i + R) of one product, columns [j0, j1): W-wide blocks, then the edge */
#define NN_ROWS(R, W)                                                                           \
    for (; i + R <= m; i += R) {                                                                \
        int64_t j = j0;                                                                         \
        for (; j + W <= j1; j += W)                                                             \
            nn_block_##R##x##W(a + i * sai, b + j, o + i * ldo + j, k, sai, sap, ldb, ldo, more); \
        if (j < j1) nn_edge(a + i * sai, b + j, o + i * ldo + j, R, k, j1 - j, sai, sap, ldb, ldo, more); \
    }

static inline __attribute__((always_inline)) void nn_rows(const float *a, const float *b, float *o,
        int64_t m, int64_t k, int64_t sai, int64_t sap, int64_t ldb, int64_t ldo, int64_t j0, int64_t j1,
        int more) {
    int64_t i = 0;
#if !AVX2_BLOCKS
    NN_ROWS(8, 32)
    NN_ROWS(4, 64)
    NN_ROWS(2, 64)
#else
    NN_ROWS(6, 16)
    NN_ROWS(5, 16)   /* (the rows left: at most one of these) */
    NN_ROWS(4, 16)
    NN_ROWS(3, 16)
    NN_ROWS(2, 48)
#endif
    if (i < m) {   /* the last row: blocks as wide as fit (a block's k-long chains are its latency) */
        int64_t j = j0;
        const float *ai = a + i * sai;
        float *oi = o + i * ldo;
#if !AVX2_BLOCKS
        for (; j + 256 <= j1; j += 256) nn_block_1x256(ai, b + j, oi + j, k, sai, sap, ldb, ldo, more);
        if (j + 128 <= j1) { nn_block_1x128(ai, b + j, oi + j, k, sai, sap, ldb, ldo, more); j += 128; }
#else
        for (; j + 96 <= j1; j += 96) nn_block_1x96(ai, b + j, oi + j, k, sai, sap, ldb, ldo, more);
#endif
        if (j + 64 <= j1) { nn_block_1x64(ai, b + j, oi + j, k, sai, sap, ldb, ldo, more); j += 64; }
        for (; j + 16 <= j1; j += 16) nn_block_1x16(ai, b + j, oi + j, k, sai, sap, ldb, ldo, more);
        if (j < j1) nn_edge(ai, b + j, oi + j, 1, k, j1 - j, sai, sap, ldb, ldo, more);
    }
}

/* a [m, k] with rows lda apart */
void nn_product(const float *a, const float *b, float *o, int64_t m, int64_t k,
                int64_t lda, int64_t ldb, int64_t ldo, int64_t j0, int64_t j1) {
    nn_rows(a, b, o, m, k, lda, 1, ldb, ldo, j0, j1, 0);
}

/* the same chains with a stored transposed: a^T [k, m], rows lda apart (a block's R values of
 * one p lie side by side) */
void nn_product_ta(const float *at, const float *b, float *o, int64_t m, int64_t k,
                   int64_t lda, int64_t ldb, int64_t ldo, int64_t j0, int64_t j1) {
    nn_rows(at, b, o, m, k, 1, lda, ldb, ldo, j0, j1, 0);
}

/* rows [0, m) x columns [0, w) of a product whose b is packed in column panels of 32: panel c
 * holds columns [32c, 32c + 32) as k rows of 32 floats, one after the other (the last panel's
 * rows as wide as its columns are, still 32 apart) */
static inline __attribute__((always_inline)) void nn_panels(const float *a, const float *panels, float *o,
        int64_t m, int64_t k, int64_t sai, int64_t sap, int64_t ldo, int64_t w, int more) {
    int64_t i = 0;
    for (; i + TALL_R <= m; i += TALL_R)
        for (int64_t j = 0; j < w; j += 32) {
            const float *bp = panels + j * k;   /* (panel j / 32: 32 k floats each) */
            if (w - j >= 32)   /* the panel in TALL_W-wide blocks */
                for (int64_t jj = 0; jj < 32; jj += TALL_W)
                    NN_TALL(a + i * sai, bp + jj, o + i * ldo + j + jj, k, sai, sap, 32, ldo, more);
            else nn_edge(a + i * sai, bp, o + i * ldo + j, TALL_R, k, w - j, sai, sap, 32, ldo, more);
        }
    if (i < m)
        for (int64_t j = 0; j < w; j += 32)
            nn_edge(a + i * sai, panels + j * k, o + i * ldo + j, m - i, k, w - j < 32 ? w - j : 32, sai, sap,
                    32, ldo, more);
}

/* a large product's run of p (gl_matmul_large), b in place (ldb) or packed (ldb 0: nn_panels);
 * a's rows contiguous (sap = 1) or a transposed (sai = 1), each compiled apart */
static void nn_run(const float *a, const float *b, float *o, int64_t m, int64_t k, int64_t sai,
                   int64_t sap, int64_t ldb, int64_t ldo, int64_t w, int more) {
    if (ldb == 0 && sap == 1)
        nn_panels(a, b, o, m, k, sai, 1, ldo, w, more);
    else if (ldb == 0)
        nn_panels(a, b, o, m, k, 1, sap, ldo, w, more);
    else if (sap == 1)
        nn_rows(a, b, o, m, k, sai, 1, ldb, ldo, 0, w, more);
    else
        nn_rows(a, b, o, m, k, 1, sap, ldb, ldo, 0, w, more);
}

/* one row x 32 columns of Q products at once (entry q's a, b, out at a[q], b[q], o[q]): 2Q
 * independent accumulator chains where one product has two (a query's read of the value cache) */
static inline __attribute__((always_inline)) void nn_entries_1x32(const float *const a[4],
        const float *const b[4], float *const o[4], int64_t k, int64_t ldb, const int Q) {
    float acc[4][32];
    for (int q = 0; q < Q; q++)
        for (int j = 0; j < 32; j++) acc[q][j] = 0.0f;
    for (int64_t p = 0; p < k; p++)
        for (int q = 0; q < Q; q++) {
            float ap = a[q][p];
            const float *bp = b[q] + p * ldb;
            for (int j = 0; j < 32; j++) acc[q][j] = MADD(ap, bp[j], acc[q][j]);
        }
    for (int q = 0; q < Q; q++)
        for (int j = 0; j < 32; j++) o[q][j] = acc[q][j];
}

void gl_matmul_small(const float *a, const float *b, float *o, const int64_t *offsets, int64_t e0,
                     int64_t e1, int64_t m, int64_t k, int64_t lda, int64_t ldb, int64_t ldo,
                     int64_t j0, int64_t j1) {
    int64_t e = e0;
    if (m == 1 && j1 - j0 < 128)   /* one row of few columns: four (or two) entries at a time */
        for (int Q = AVX2_BLOCKS ? 2 : 4; Q >= 2; Q /= 2)
            for (; e + Q <= e1; e += Q) {
                const int64_t *f = offsets + 3 * e;
                int64_t j = j0;
                for (; j + 32 <= j1; j += 32) {
                    const float *aq[4], *bq[4];
                    float *oq[4];
                    for (int q = 0; q < Q; q++) {
                        aq[q] = a + f[3 * q];
                        bq[q] = b + f[3 * q + 1] + j;
                        oq[q] = o + f[3 * q + 2] + j;
                    }
                    if (Q == 4) nn_entries_1x32(aq, bq, oq, k, ldb, 4);
                    else nn_entries_1x32(aq, bq, oq, k, ldb, 2);
                }
                for (int q = 0; q < Q && j < j1; q++)
                    nn_product(a + f[3 * q], b + f[3 * q + 1], o + f[3 * q + 2], 1, k, lda, ldb, ldo, j, j1);
            }
    for (; e < e1; e++)
        nn_product(a + offsets[3 * e], b + offsets[3 * e + 1], o + offsets[3 * e + 2], m, k, lda,
                   ldb, ldo, j0, j1);
}


/* ---- panel products: x @ B (+ bias), B held in column panels (graphlm.ops.panel_matmul) ---- */

/* R rows x Q panels of 32 columns (panel q at pn + q * k * 32: k rows of 32 floats, one after the
 * other), each element the NN chain above (acc = 0; acc = MADD(a[i][p], b[p][j], acc) for p in
 * order), then stored plus bias[j] where there is a bias: the bits of the product, then of the
 * add. The last panel stores its first `w_last` columns (the rest is padding). Blocks of 4 rows
 * or more read their panels PANEL_AHEAD floats ahead (from L3: a decode step's weights do not
 * stay in L2); a 1- or 2-row block reads Q panels at once, streams the prefetcher follows. */
#define PANEL_AHEAD 256
#define PANEL_BLOCK(R, Q)                                                                       \
    static inline __attribute__((always_inline)) void panel_block_##R##x##Q(const float *a,     \
            const float *pn, const float *bias, float *o, int64_t k, int64_t lda, int64_t ldo,    \
            int64_t w_last) {                                                                   \
        float acc[R][Q][32];                                                                    \
        for (int r = 0; r < R; r++)                                                             \
            for (int q = 0; q < Q; q++)                                                         \
                for (int j = 0; j < 32; j++) acc[r][q][j] = 0.0f;                               \
        for (int64_t p = 0; p < k; p++)                                                         \
            for (int q = 0; q < Q; q++) {                                                       \
                const float *bp = pn + q * k * 32 + p * 32;                                     \
                if (R >= 3) { __builtin_prefetch(bp + PANEL_AHEAD); __builtin_prefetch(bp + PANEL_AHEAD + 16); } \
                for (int r = 0; r < R; r++) {                                                   \
                    float ar = a[r * lda + p];                                                  \
                    for (int j = 0; j < 32; j++) acc[r][q][j] = MADD(ar, bp[j], acc[r][q][j]);  \
                }                                                                               \
            }                                                                                   \
        for (int r = 0; r < R; r++)                                                             \
            for (int q = 0; q < Q; q++) {                                                       \
                float *or_ = o + r * ldo + q * 32;                                              \
                const int64_t w = q == Q - 1 ? w_last : 32;                                     \
                if (bias && w == 32)                                                            \
                    for (int j = 0; j < 32; j++) or_[j] = acc[r][q][j] + bias[q * 32 + j];      \
                else if (w == 32)                                                               \
                    for (int j = 0; j < 32; j++) or_[j] = acc[r][q][j];                         \
                else                                                                            \
                    for (int j = 0; j < w; j++) or_[j] = bias ? acc[r][q][j] + bias[q * 32 + j] : acc[r][q][j]; \
            }                                                                                   \
    }
PANEL_BLOCK(2, 1)
PANEL_BLOCK(1, 2)
PANEL_BLOCK(1, 1)
/* by vector width, as the NN blocks: R x Q panels fill 16 AVX-512 registers, or 12 AVX2 ones */
#if !AVX2_BLOCKS
#define PANEL_TALL 8
PANEL_BLOCK(8, 1)
PANEL_BLOCK(4, 2)
PANEL_BLOCK(4, 1)
PANEL_BLOCK(2, 4)
PANEL_BLOCK(2, 2)
PANEL_BLOCK(1, 8)
PANEL_BLOCK(1, 4)
#define PANEL_TALL_BLOCK panel_block_8x1
#define PANEL_REST                                                                              \
    if (r1 - i >= 4) { int64_t c = c0; PANEL_SPAN(4, 2) PANEL_SPAN(4, 1) i += 4; }              \
    if (r1 - i >= 2) { int64_t c = c0; PANEL_SPAN(2, 4) PANEL_SPAN(2, 2) PANEL_SPAN(2, 1) i += 2; } \
    if (r1 - i >= 1) { int64_t c = c0; PANEL_SPAN(1, 8) PANEL_SPAN(1, 4) PANEL_SPAN(1, 2) PANEL_SPAN(1, 1) }
#else
PANEL_BLOCK(3, 1)
PANEL_BLOCK(1, 3)
#define PANEL_TALL 8
#define PANEL_TALL_BLOCK panel_block_8x1
#define PANEL_REST                                                                              \
    if (talls > r0 || r1 - i >= 6)   /* rows left, panel by panel while each is still in cache */ \
        for (int64_t c = c0; c < c1; c++) {                                                     \
            const float *pc = pn + c * k * 32, *bc = bias ? bias + c * 32 : 0;                  \
            const int64_t w_last = c + 1 == cn ? n - (cn - 1) * 32 : 32;                        \
            int64_t j = i;                                                                      \
            if (r1 - j >= 6) { panel_block_6x1(a + j * lda, pc, bc, o + j * ldo + c * 32, k, lda, ldo, w_last); j += 6; } \
            if (r1 - j >= 3) { panel_block_3x1(a + j * lda, pc, bc, o + j * ldo + c * 32, k, lda, ldo, w_last); j += 3; } \
            if (r1 - j >= 2) { panel_block_2x1(a + j * lda, pc, bc, o + j * ldo + c * 32, k, lda, ldo, w_last); j += 2; } \
            if (r1 - j >= 1) panel_block_1x1(a + j * lda, pc, bc, o + j * ldo + c * 32, k, lda, ldo, w_last); \
        }                                                                                       \
    else {                                                                                      \
        if (r1 - i >= 3) { int64_t c = c0; PANEL_SPAN(3, 1) i += 3; }                            \
        if (r1 - i >= 2) { int64_t c = c0; PANEL_SPAN(2, 1) i += 2; }                            \
        if (r1 - i >= 1) { int64_t c = c0; PANEL_SPAN(1, 3) PANEL_SPAN(1, 2) PANEL_SPAN(1, 1) }  \
    }
/* 6 rows of one panel: a whole panel as two 6 x 16 NN blocks (AVX2's fastest, above; the GCC-
 * vectorised 3 x 32 panel block ran a batch-8 decode step's products at 33 GFLOP/s), the bias
 * added after the store (the same two roundings); the last panel of a ragged n by PANEL_BLOCK */
static inline __attribute__((always_inline)) void panel_block_6x1(const float *a, const float *pn,
        const float *bias, float *o, int64_t k, int64_t lda, int64_t ldo, int64_t w_last) {
    if (w_last < 32) {
        panel_block_3x1(a, pn, bias, o, k, lda, ldo, w_last);
        panel_block_3x1(a + 3 * lda, pn, bias, o + 3 * ldo, k, lda, ldo, w_last);
        return;
    }
    nn_block_6x16(a, pn, o, k, lda, 1, 32, ldo, 0);
    nn_block_6x16(a, pn + 16, o + 16, k, lda, 1, 32, ldo, 0);
    if (bias)
        for (int r = 0; r < 6; r++)
            for (int j = 0; j < 32; j++) o[r * ldo + j] += bias[j];
}
/* 8 rows (a batch-8 decode step): the 6 above, then 2 x 32 in registers while the panel is in
 * L1 (the GCC-vectorised 2 x 32 panel block after 6-row blocks: the step's products 10-14 %
 * slower, AVX2 on a Xeon) */
static inline __attribute__((always_inline)) void panel_block_8x1(const float *a, const float *pn,
        const float *bias, float *o, int64_t k, int64_t lda, int64_t ldo, int64_t w_last) {
    panel_block_6x1(a, pn, bias, o, k, lda, ldo, w_last);
    if (w_last < 32) {
        panel_block_2x1(a + 6 * lda, pn, bias, o + 6 * ldo, k, lda, ldo, w_last);
        return;
    }
    nn_block_2x32(a + 6 * lda, pn, o + 6 * ldo, k, lda, 1, 32, ldo, 0);
    if (bias)
        for (int r = 6; r < 8; r++)
            for (int j = 0; j < 32; j++) o[r * ldo + j] += bias[j];
}
#endif

/* panels [c, c1) of R rows, Q at a time while Q fit (cn: the product's panels, n its columns) */
#define PANEL_SPAN(R, Q)                                                                        \
    for (; c + Q <= c1; c += Q)                                                                 \
        panel_block_##R##x##Q(a + i * lda, pn + c * k * 32, bias ? bias + c * 32 : 0, o + i * ldo + c * 32, \
                              k, lda, ldo, c + Q == cn ? n - (cn - 1) * 32 : 32);

#define PANEL_ROWS 64   /* rows of a taken through all the panels at once (they stay in L2) */

/* rows [i0, i1) x panels [c0, c1) of one product: in runs of PANEL_ROWS rows, each panel read
 * once for all the 8-row blocks of a run, then the run's last rows */
static void panel_rows(const float *a, const float *pn, const float *bias, float *o, int64_t k,
                       int64_t lda, int64_t ldo, int64_t n, int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
    const int64_t cn = (n + 31) / 32;
    for (int64_t r0 = i0; r0 < i1; r0 += PANEL_ROWS) {
        const int64_t r1 = i1 - r0 < PANEL_ROWS ? i1 : r0 + PANEL_ROWS;
        const int64_t talls = r0 + (r1 - r0) / PANEL_TALL * PANEL_TALL;
        for (int64_t c = c0; c < c1; c++)
            for (int64_t i = r0; i < talls; i += PANEL_TALL)
                PANEL_TALL_BLOCK(a + i * lda, pn + c * k * 32, bias ? bias + c * 32 : 0, o + i * ldo + c * 32,
                                 k, lda, ldo, c + 1 == cn ? n - (cn - 1) * 32 : 32);
        int64_t i = talls;
        PANEL_REST
    }
}

/* out[e] = a[e] @ B[e] (+ bias[e]) for the entries e in [e0, e1), rows [i0, i1), panels [c0, c1).
 * plan: a, panels, bias (0: none), out, offsets (addresses), k, lda, ldo, n; entry e's operands
 * start at offsets[4e .. 4e + 3] elements past a, panels, bias and out; a [m, k] with rows lda
 * apart, B [k, n] as ceil(n / 32) panels (graphlm.ops.to_panels, width 32), out [m, n] with rows
 * ldo apart, the bias one row of n floats. */
void gl_matmul_panels(const int64_t *plan, int64_t e0, int64_t e1, int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
    const float *a = (const float *)(intptr_t)plan[0], *pn = (const float *)(intptr_t)plan[1];
    const float *bias = (const float *)(intptr_t)plan[2];
    float *o = (float *)(intptr_t)plan[3];
    const int64_t *f = (const int64_t *)(intptr_t)plan[4];
    for (int64_t e = e0; e < e1; e++)
        panel_rows(a + f[4 * e], pn + f[4 * e + 1], bias ? bias + f[4 * e + 2] : 0, o + f[4 * e + 3],
                   plan[5], plan[6], plan[7], plan[8], i0, i1, c0, c1);
}

/* NT, rows [i0, i1) x columns [j0, j1) of one product, one dot product at a time */
static void nt_scalar(const float *a, const float *bt, float *o, int64_t i0, int64_t i1,
                      int64_t j0, int64_t j1, int64_t k, int64_t lda, int64_t ldb, int64_t ldo) {
    for (int64_t i = i0; i < i1; i++)
        for (int64_t j = j0; j < j1; j++) {
            float acc[16] = {0};
            nt_lanes(a + i * lda, bt + j * ldb, k, acc);
            o[i * ldo + j] = lanes_tree(acc);
        }
}

#if defined(__AVX512F__) && defined(__FMA__)
#include <immintrin.h>

/* bt is prefetched this many elements (16 KB) ahead of the block reading it, in whole rows:
 * weights come from L3 (-35 % at batch 8), and a prefetch further ahead than L1 holds evicts
 * the rows of a that every block reads (k = 768: 16 rows ahead was 48 KB, 2x slower) */
#define NT_AHEAD_ELEMENTS 2048

/* v's lanes from `first` on, moved down to lane 0 */
static inline __m512 lanes_from(int first, __m512 v) {
    return _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                  _mm512_set1_epi32(first)), v);
}

/* NT block of R rows x J columns (R*J = 16): out[r][c] for its 16 dot products */
static inline __attribute__((always_inline)) void nt_block(const float *a, const float *bt,
        float *o, int64_t k, int64_t lda, int64_t ldb, int64_t ldo, const int R, const int J) {
    __m512 acc[16], x[8], y[16];
    for (int s = 0; s < 16; s++) acc[s] = _mm512_setzero_ps();
    const int64_t ahead = (NT_AHEAD_ELEMENTS / ldb > J ? NT_AHEAD_ELEMENTS / ldb : J) * ldb;
    int64_t p = 0;
    for (; p + 16 <= k; p += 16) {
        for (int r = 0; r < R; r++) x[r] = _mm512_loadu_ps(a + r * lda + p);
        for (int c = 0; c < J; c++) {
            y[c] = _mm512_loadu_ps(bt + c * ldb + p);
            __asm__("" : "+v"(y[c]));   /* in a register: the compiler would reload it per row */
            _mm_prefetch((const char *)(bt + c * ldb + ahead + p), _MM_HINT_T0);
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < J; c++) {   /* lane sum s: the reduction's source of lane r*J + c */
                int L = r * J + c, s = 4 * (L % 4) + L / 4;
                acc[s] = _mm512_fmadd_ps(x[r], y[c], acc[s]);
            }
    }
    if (p < k) {   /* the last k % 16 terms, in lanes 0.. (the others left as they are) */
        __mmask16 mask = (__mmask16)((1u << (k - p)) - 1u);
        for (int r = 0; r < R; r++) x[r] = _mm512_maskz_loadu_ps(mask, a + r * lda + p);
        for (int c = 0; c < J; c++) y[c] = _mm512_maskz_loadu_ps(mask, bt + c * ldb + p);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < J; c++) {
                int L = r * J + c, s = 4 * (L % 4) + L / 4;
                acc[s] = _mm512_mask3_fmadd_ps(x[r], y[c], acc[s], mask);
            }
    }
    __m512 sums = nt_reduce16(acc);   /* lane r*J + c: out[r][c] */
    for (int r = 0; r < R; r++) {
        __m512 row = r ? lanes_from(r * J, sums) : sums;
        _mm512_mask_storeu_ps(o + r * ldo, (__mmask16)((1u << J) - 1u), row);
    }
}

#define NT_ROWS(R, J)                                                                           \
    for (; i + R <= m; i += R) {                                                                \
        int64_t j = j0;                                                                         \
        for (; j + J <= j1; j += J) nt_block(ae + i * lda, be + j * ldb, oe + i * ldo + j, k, lda, ldb, ldo, R, J); \
        nt_scalar(ae, be, oe, i, i + R, j, j1, k, lda, ldb, ldo);                               \
    }

/* the columns [j0, j1) of one product: per 4 columns, all row blocks of 4 (b's rows stay in L1) */
static void nt_product(const float *ae, const float *be, float *oe, int64_t m, int64_t k,
                       int64_t lda, int64_t ldb, int64_t ldo, int64_t j0, int64_t j1) {
    if (m >= 4) {
        int64_t j = j0;
        for (; j + 4 <= j1; j += 4) {
            int64_t i = 0;
            for (; i + 4 <= m; i += 4) nt_block(ae + i * lda, be + j * ldb, oe + i * ldo + j, k, lda, ldb, ldo, 4, 4);
            for (; i < m; i++) nt_scalar(ae, be, oe, i, i + 1, j, j + 4, k, lda, ldb, ldo);
        }
        nt_scalar(ae, be, oe, 0, m, j, j1, k, lda, ldb, ldo);
        return;
    }
    int64_t i = 0;
    NT_ROWS(2, 8)
    NT_ROWS(1, 4)   /* one row: 4 rows of bt at a time, 4 streams from memory (16 was 7 % slower at batch 1) */
}
#else
static void nt_product(const float *ae, const float *be, float *oe, int64_t m, int64_t k,
                       int64_t lda, int64_t ldb, int64_t ldo, int64_t j0, int64_t j1) {
    nt_scalar(ae, be, oe, 0, m, j0, j1, k, lda, ldb, ldo);
}
#endif

void gl_matmul_small_nt(const float *a, const float *bt, float *o, const int64_t *offsets,
                        int64_t e0, int64_t e1, int64_t m, int64_t k, int64_t lda, int64_t ldb,
                        int64_t ldo, int64_t j0, int64_t j1) {
    for (int64_t e = e0; e < e1; e++)
        nt_product(a + offsets[3 * e], bt + offsets[3 * e + 1], o + offsets[3 * e + 2], m, k, lda,
                   ldb, ldo, j0, j1);
}

/* ---- large products: any layout, by the NN kernel (training, long prefills; products.py) -------- */

/* b is taken in tiles of up to kc rows (values of p) x `width` columns (a multiple of 32) that
 * L2 holds while every row block reads them, each copied first into the thread's `panel` as
 * column panels of 32 (nn_panels: a row block's reads of b then run straight through memory,
 * where b's own rows, often a multiple of 1 KB apart, map onto a few cache sets): b's own rows
 * (kc <= KC_PLAIN, up to TILE_PLAIN floats; a piece of fewer rows than the plan's copy_rows
 * reads them in place, the copy costing more than it saves), or b given as a transposed view
 * (x @ W^T reads a Linear's weight so; kc <= KC_PACKED, up to TILE_PACKED floats). The sizes
 * were the fastest of those tried at TinyLM's and GPT-2 small's training shapes. */
#define KC_PLAIN 512
#define TILE_PLAIN 131072
#define KC_PACKED 1024
#define TILE_PACKED 65536
static _Thread_local float panel[TILE_PLAIN > TILE_PACKED ? TILE_PLAIN : TILE_PACKED];

/* out[e] = a[e] @ b[e], rows [i0, i1) x columns [j0, j1) of the entries e in [e0, e1).
 * plan (int64 words): a, b, out, offsets (addresses: the entries' element offsets, 3 per entry,
 * as gl_matmul_small's), k, n, sai, sap, sbp, sbj, ldo, copy_rows: element (i, p) of a is at
 * a[i*sai + p*sap] (sap = 1 or sai = 1), (p, j) of b at b[p*sbp + j*sbj] (sbj = 1, or sbp = 1),
 * out's rows ldo apart; b's own rows are copied into panels for a piece of at least copy_rows
 * rows. Every element is one chain of fused multiply-adds over p = 0, 1, ...,
 * k-1 from 0, as gl_matmul_small's NN kernel computes it (a chain runs over the tiles of p in
 * order, kept in out between them): its bits depend on k alone, not on the cut, the tiles or the
 * thread. */
void gl_matmul_large(const int64_t *plan, int64_t e0, int64_t e1, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    const float *a0 = (const float *)(intptr_t)plan[0], *b0 = (const float *)(intptr_t)plan[1];
    float *o0 = (float *)(intptr_t)plan[2];
    const int64_t *offsets = (const int64_t *)(intptr_t)plan[3];
    const int64_t k = plan[4], sai = plan[6], sap = plan[7], sbp = plan[8], sbj = plan[9], ldo = plan[10];
    const int transposed = sbj != 1, copy = transposed || i1 - i0 >= plan[11];
    const int64_t most = transposed ? KC_PACKED : KC_PLAIN, kc = k < most ? (k > 0 ? k : 1) : most;
    const int64_t width = (transposed ? TILE_PACKED : TILE_PLAIN) / kc / 32 * 32;
    for (int64_t e = e0; e < e1; e++) {
        const float *a = a0 + offsets[3 * e], *b = b0 + offsets[3 * e + 1];
        float *o = o0 + offsets[3 * e + 2];
        for (int64_t js = j0; js < j1; js += width) {
            const int64_t w = j1 - js < width ? j1 - js : width;
            for (int64_t p0 = 0; p0 < k || p0 == 0; p0 += kc) {
                const int64_t pc = k - p0 < kc ? k - p0 : kc;
                const float *tile = b + p0 * sbp + js * sbj;
                int64_t ldb = sbp;
                if (copy) {   /* into column panels of 32 (nn_panels) */
                    for (int64_t j = 0; j < w; j += 32) {
                        float *dst = panel + j * pc;
                        const int64_t cols = w - j < 32 ? w - j : 32;
                        if (transposed)
                            for (int64_t jj = 0; jj < cols; jj++)
                                for (int64_t p = 0; p < pc; p++) dst[p * 32 + jj] = tile[(j + jj) * sbj + p * sbp];
                        else
                            for (int64_t p = 0; p < pc; p++) memcpy(dst + p * 32, tile + p * sbp + j, (size_t)cols * 4);
                    }
                    tile = panel, ldb = 0;
                }
                nn_run(a + i0 * sai + p0 * sap, tile, o + i0 * ldo + js, i1 - i0, pc, sai, sap, ldb, ldo, w,
                       p0 > 0);
            }
        }
    }
}
