/* graphlm's native kernels: what the C files of executors/native/ share.
 *
 * kernels.c (elementwise and memory-bound ops, layer norm, dropout, AdamW), attention.c (causal
 * attention's steps and its whole kernel, a decode step's cached attention) and products.c (the
 * small products, the one BLAS call) are compiled into one library by build.py with the
 * machine's C compiler:
 *     cc -O3 -march=native -ffp-contract=off -fno-math-errno -fPIC -shared
 * Each kernel is one fused pass (or one pass per row) over contiguous float32 memory that the
 * executor planned: no allocation, no threads (the executor cuts the work into ranges and runs
 * them on its own threads; ctypes releases the GIL for the call), no global state but the
 * attention's two per-thread packing buffers (attention.c, plan_product), scratch that no call
 * reads after. -ffp-contract=off keeps every `a*b + c` written as two roundings, so the kernels
 * that do not call exp_f32 or sum a row (dropout, AdamW, the attention gradient's ds and the
 * memory-bound ops) compute exactly what the numpy executor computes; exp_f32's polynomial and
 * the products ask for fused multiply-adds by name (MADD).
 *
 * Here: exp_f32 and the row reductions (row_sum, row_dot, row_max; rows_sum, row_sum of up to 16
 * rows side by side), and the dot product's fixed summation order that the NT products and the
 * cached attention share (nt_lanes, lanes_tree, nt_reduce16). */
#ifndef GRAPHLM_KERNELS_H
#define GRAPHLM_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __FMA__
#define MADD(a, b, c) fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

#define LANES 16   /* partial sums per row reduction (two AVX registers of 8 floats) */

/* Whether the products' register blocks are AVX2's (products.c): where the library is compiled
 * for AVX2 and FMA but not AVX-512, blocks of 12 of its 16 registers written with intrinsics;
 * elsewhere plain C blocks of 256 accumulators (16 AVX-512 registers) that the compiler
 * vectorises. A block only chooses which accumulators share the registers, never a bit. */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define AVX2_BLOCKS 1
#else
#define AVX2_BLOCKS 0
#endif

static inline float bits_to_float(uint32_t i) { float f; memcpy(&f, &i, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t i; memcpy(&i, &f, 4); return i; }

/* exp(x) in float32, within 2 ulp (Cephes' expf: x = n*ln2 + r, |r| <= ln2/2, a degree-6
 * polynomial for e^r, then 2^n put in the exponent bits). Branch-free, so the compiler
 * vectorises the loops that call it. Above EXP_HI the result is +inf (true exp overflows a
 * little later, at 88.72); below EXP_LO (ln of the smallest normal float) it is 0 (NumPy
 * returns subnormals there); NaN gives NaN. */
#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447504019f
static inline float exp_f32(float x) {
    float c = x > EXP_HI ? EXP_HI : x;
    c = c < EXP_LO ? EXP_LO : c;
    float t = MADD(c, 1.44269504088896341f, 12582912.0f);   /* n in t's low mantissa bits */
    float n = t - 12582912.0f;
    float r = MADD(n, -0.693359375f, c);
    r = MADD(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = MADD(p, r, 1.3981999507e-3f);
    p = MADD(p, r, 8.3334519073e-3f);
    p = MADD(p, r, 4.1665795894e-2f);
    p = MADD(p, r, 1.6666665459e-1f);
    p = MADD(p, r, 5.0000001201e-1f);
    p = MADD(p, r * r, r) + 1.0f;
    uint32_t e = (float_to_bits(t) - 0x4B400000u + 127u) << 23;   /* 2^n, n in [-126, 127] */
    float y = p * bits_to_float(e);
    y = x > EXP_HI ? INFINITY : y;
    y = x < EXP_LO ? 0.0f : y;
    return y;
}

static inline float row_sum(const float *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += x[i];
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

static inline float row_dot(const float *x, const float *y, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j] * y[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += x[i] * y[i];
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

/* The largest of x[0, n) (NaN skipped; -inf where none): LANES running maxima, the tail taken
 * into them, then their largest (with AVX-512 in registers, a masked tail and a shuffle tree). A
 * max is exact in any order: only which zero a row of +0 and -0 gives can depend on it, and
 * x - max is the same for both. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline float row_max(const float *x, int64_t n) {
    __m512 acc = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_max_ps(_mm512_loadu_ps(x + i), acc);   /* (NaN x: acc) */
    if (i < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1u);
        acc = _mm512_mask_max_ps(acc, tail, _mm512_maskz_loadu_ps(tail, x + i), acc);
    }
    return _mm512_reduce_max_ps(acc);
}
#else
static inline float row_max(const float *x, int64_t n) {
    float acc[LANES];
    for (int j = 0; j < LANES; j++) acc[j] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] = x[i + j] > acc[j] ? x[i + j] : acc[j];
    float m = -INFINITY;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    for (int j = 0; j < LANES; j++) m = acc[j] > m ? acc[j] : m;
    return m;
}
#endif

/* row_sum of `rows` <= LANES rows at once (row r: n[r] floats at x + r * ld) into out[r], each
 * in row_sum's order: its lane sums over whole chunks, its tail from 0, then the lanes one by
 * one. A row alone is a chain of up to 2 * LANES - 1 dependent adds; here the rows' chains run
 * side by side, a row per vector lane (a tail padded with +0.0, which leaves a sum unchanged: a
 * sum from +0.0 is never -0.0). */
static inline void rows_sum(const float *x, int64_t ld, const int64_t *n, int64_t rows, float *out) {
    float lanes[LANES][LANES] = {{0}}, tail[LANES][LANES] = {{0}};   /* [lane or tail index][row] */
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ld;
        float acc[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= n[r]; i += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += xr[i + j];
        for (int j = 0; j < LANES; j++) lanes[j][r] = acc[j];
        for (int j = 0; i + j < n[r]; j++) tail[j][r] = xr[i + j];
    }
    float s[LANES] = {0};
    for (int i = 0; i < LANES; i++)
        for (int r = 0; r < LANES; r++) s[r] += tail[i][r];
    for (int j = 0; j < LANES; j++)
        for (int r = 0; r < LANES; r++) s[r] += lanes[j][r];
    for (int64_t r = 0; r < rows; r++) out[r] = s[r];
}

/* ---- the dot product's summation order (products.c's NT kernel, attention.c's cached attention) ---- */

/* NT: one dot product's 16 lane sums into acc (lane l: p = l, l+16, ... < k, in order) */
static inline void nt_lanes(const float *x, const float *y, int64_t k, float acc[16]) {
    int64_t p = 0;
    for (; p + 16 <= k; p += 16)
        for (int l = 0; l < 16; l++) acc[l] = MADD(x[p + l], y[p + l], acc[l]);
    for (int l = 0; p + l < k; l++) acc[l] = MADD(x[p + l], y[p + l], acc[l]);
}

static inline float lanes_tree(float acc[16]) {
    for (int h = 8; h >= 1; h /= 2)
        for (int l = 0; l < h; l++) acc[l] += acc[l + h];
    return acc[0];
}

#if defined(__AVX512F__) && defined(__FMA__)
#include <immintrin.h>

/* 16 vectors of lane sums -> one vector: lane L holds the lanes_tree sum of v[4*(L%4) + L/4]
 * (each level adds lane l and lane l+h of every source, as lanes_tree does, h = 8, 4, 2, 1) */
static inline __m512 nt_reduce16(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)   /* h = 8: [v2i(l) + v2i(l+8) | v2i+1(l) + v2i+1(l+8)] */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)   /* h = 4: one source's four sums per 128-bit chunk */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)   /* h = 2 */
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88),   /* h = 1 */
                         _mm512_shuffle_ps(w[0], w[1], 0xDD));
}
#endif

/* products.c: the small products' NN kernel (out[i][j] for columns [j0, j1): one chain of fused
 * multiply-adds over k in order), which attention.c's products call too; _ta the same chains
 * with a stored transposed ([k, m], rows lda apart) */
__attribute__((visibility("hidden"))) void nn_product(const float *a, const float *b, float *o, int64_t m,
                                                      int64_t k, int64_t lda, int64_t ldb, int64_t ldo,
                                                      int64_t j0, int64_t j1);
__attribute__((visibility("hidden"))) void nn_product_ta(const float *at, const float *b, float *o, int64_t m,
                                                         int64_t k, int64_t lda, int64_t ldb, int64_t ldo,
                                                         int64_t j0, int64_t j1);

/* products.c: c = op(a) @ op(b) by a cblas_sgemm (attention.c's fallback), + c where `accumulate`
 * (team.c's BLAS pieces) */
void gl_sgemm(int64_t sgemm, int64_t width, int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a,
              int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc);
void gl_sgemm_acc(int64_t sgemm, int64_t width, int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a,
                  int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate);

#endif
